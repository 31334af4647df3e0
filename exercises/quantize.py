"""Exercise `quantize`: symmetric int8 quantization with one scale per row.

Implement ``quantize_int8`` and ``dequantize_int8`` below. They replace
quantize.py:quantize_int8 and quantize.py:dequantize_int8, which every int8 thing in the
project uses: Int8Linear's weights (a scale per output row) and the int8 KV cache (a
scale per token and head, stored right after the row's bytes).

Run it:  make exercise E=quantize    (or: .venv/bin/python -m pytest tests --exercise quantize)

Passing means the quantize lesson's own tests pass with your round trip: every element
comes back within half a step (s/2) on rows of very different magnitudes, an int8 KV cache
decodes the same tokens in dynamic and static caches with logits within 2% of full
precision, attention over int8 K/V stays within 1%, and Int8Linear equals its dequantized
matrix in fp32 and bf16.
"""

from __future__ import annotations

import torch


def quantize_int8(x: torch.Tensor, scale_dtype=torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim. x (..., n) any float dtype -> (q, s): q (..., n)
    torch.int8 and s (..., 1) in ``scale_dtype``, with s = max|x| over the row / 127
    (computed in fp32, floored at quantize.TINY = 1e-8 so an all-zero row does not divide
    by zero, then cast to scale_dtype) and q = round(x / s) clamped to [-127, 127], dividing
    by s as stored (after its cast), so dequantizing with it undoes exactly this rounding."""
    raise NotImplementedError(
        """quantize_int8: choose the scale so the row's largest magnitude lands on 127, the edge of
int8. Work in fp32, keep the reduced dim (keepdim) so s broadcasts over its row, and divide by the
scale as it will be stored; then round, clamp to [-127, 127] and cast. Symmetric: no zero point.""")


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q (..., n) int8 and scale (..., 1) (any float dtype) -> q · scale as ``dtype``,
    computed in fp32 and cast at the end."""
    raise NotImplementedError(
        """dequantize_int8: undo quantize_int8: multiply each row back by its scale.
Do the product in fp32 (int8 times fp16 would neither be exact nor allowed everywhere),
then cast to the dtype asked for.""")
