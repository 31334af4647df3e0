"""Exercise `plan`: the two terms of the inference optimizer's cost model.

Implement ``token_bytes`` and ``kv_bytes`` below. They replace plan.py:ModelInfo.token_bytes
and plan.py:ModelInfo.kv_bytes. Decoding one token is memory-bound, so plan.choose judges a
configuration by the bytes a step reads (every weight matrix once, then the KV cache written
so far) against the machine's bandwidth and memory: they decide whether the KV cache is
quantized to int8, which context still fits, and the tok/s ceiling `--plan` prints.

Run it:  make exercise E=plan    (or: .venv/bin/python -m pytest tests --exercise plan)

Passing means the plan lesson's own tests pass with your cost model: SmolLM2's KV bytes at
2,048 tokens in fp32 and int8 and its bytes per token in every weight format come out as the
cost model says, the plans for a CPU without bf16 print the ceiling bandwidth / bytes per
token, TinyLlama's KV goes int8 exactly when the fp32 cache does not fit beside the weights
(and names the --ctx that would fit), and its weights go int8 then int4 as memory shrinks.
"""

from __future__ import annotations


def token_bytes(self, weights: str, dtype: str) -> int:
    """ModelInfo method. Bytes one decode step reads of the weights, under ``weights`` ("float",
    "int8", "int4", or "gguf": as the file holds them) with activations in ``dtype``
    ("float32", "bfloat16", "float16"). A step multiplies by every matrix once, the LM head
    included; of the embedding table it reads a single row: count none of it.

    What you have: self.weight_bytes(weights, dtype), the bytes of every weight the model
    holds, the embedding table included. Where the table is the LM head (tied) it counts as
    the head. Otherwise, under "gguf" it is held at the file's own bits, self.table_bytes of
    them; under the other formats in ``dtype``: self.embed_params numbers of plan.SIZES[dtype]
    bytes (embed_params and table_bytes are 0 for a tied table)."""
    raise NotImplementedError(
        """token_bytes: start from everything held, and take out what a step does not read.
Which part of the model is held but not streamed through per token, and how many bytes is it
in each format? A tied table is the LM head, which every step does read.""")


def kv_bytes(self, ctx: int, kv_dtype: str, dtype: str) -> int:
    """ModelInfo method. Bytes of the KV cache holding ``ctx`` tokens: every layer keeps a key
    and a value row per KV head per token (self.config: n_layers, n_kv_heads, head_dim).
    ``kv_dtype`` "auto" stores them in the model's ``dtype`` (plan.SIZES[dtype] bytes a
    number); otherwise it names a quantized format, quantize.KV_CODECS[kv_dtype], whose
    row_bytes(head_dim) is the bytes of one head's row (int8: head_dim values and a 2-byte
    scale). Return an int (rounded)."""
    raise NotImplementedError(
        """kv_bytes: count rows, then bytes per row. How many rows does one token add to the
cache over the whole model (keys and values, every layer, every KV head)? A row's bytes depend
on the format only: the model's dtype, or what the quantized codec says.""")
