"""The course's exercises: write one function of a lesson yourself, then run that lesson's own
tests on it.

Each file here holds stubs: the lesson function's signature, a docstring with its
contract, and a body that raises NotImplementedError with a hint. Replace the body,
then run

    make exercise E=flash          (or: .venv/bin/python -m pytest tests --exercise flash)

tests/conftest.py puts your function where the lesson's was (the module or class
attribute the lesson calls, so every call inside the lesson goes through your code)
and runs only that exercise's tests. `--exercise-solution` swaps the lesson's own
function in through the same machinery instead: the tests must pass, which is how
tests/lessons/test_exercises.py checks the table below.

This table is the one place that names, per exercise, what its stubs replace and
which tests judge them; conftest.py, the Makefile and tests/lessons/test_exercises.py read it.
It imports nothing heavy: `python3 -c "import exercises; print(exercises.usage())"`
works before torch is installed.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    name: str                   # E=name; the stubs live in exercises/<name>.py
    what: str                   # one line for the list
    replaces: tuple[str, ...]   # "module.function" or "module.Class.method"; the stub has the
                                # last name
    tests: tuple[str, ...]      # "test_file.py::test_name" (every parametrization) or
                                # "...::test_name[id]"; the file by its name alone: no two
                                # files under tests/ share one

    @property
    def module(self) -> str:
        return f"exercises.{self.name}"

    @property
    def files(self) -> set[str]:
        return {t.split("::")[0] for t in self.tests}

    def selects(self, file: str, name: str, originalname: str) -> bool:
        """Whether the test ``file::name`` (``originalname``: without its parameters) is one of
        ours."""
        return f"{file}::{name}" in self.tests or f"{file}::{originalname}" in self.tests

    def stubs(self) -> dict[str, object]:
        """'module.attr' -> the function of exercises/<name>.py that stands in for it."""
        mod = importlib.import_module(self.module)
        return {target: getattr(mod, target.rsplit(".", 1)[1]) for target in self.replaces}

    def references(self) -> dict[str, object]:
        """'module.attr' -> the lesson's own function (as the class or module holds it)."""
        return {target: getattr(*_owner(target)) for target in self.replaces}

    def install(self, functions: dict[str, object]):
        """Put ``functions`` where the lesson looks them up; returns a callable that puts the
        originals back."""
        saved = [(*_owner(target), getattr(*_owner(target))) for target in functions]
        for target, fn in functions.items():
            setattr(*_owner(target), fn)

        def restore():
            for owner, attr, original in saved:
                setattr(owner, attr, original)
        return restore


def _owner(target: str) -> tuple[object, str]:
    """'paged.BlockTable.slot' -> (the class paged.BlockTable, 'slot')."""
    module, *path, attr = target.split(".")
    owner = importlib.import_module(module)
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def counted(fn, calls: dict, key: str):
    """fn, counting its calls into calls[key] (the solution run proves each swap is reached)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        __tracebackhide__ = True
        calls[key] = calls.get(key, 0) + 1
        return fn(*args, **kwargs)
    return wrapper


EXERCISES = {e.name: e for e in [
    Exercise("kvcache", "write new K/V rows into a cache at their positions",
             ("kvcache.write_rows",),
             ("test_kvcache.py::test_write_rows_puts_each_row_where_its_position_says",
              "test_kvcache.py::test_caches_equal_naive_greedy[static]",
              "test_kvcache.py::test_sliding_window_caches_equal_naive[sliding]",
              "test_kvcache.py::test_crop_then_redecode_reproduces[static]",
              "test_kvcache.py::"
              "test_fork_shares_until_write_and_branches_are_independent[static]")),
    Exercise("flash",
             "one online-softmax tile step: running max, running sum, rescaled accumulator",
             ("flash.tile_step",),
             ("test_flash.py::test_tiled_prefill_matches_naive_fp32[128-16]",
              "test_flash.py::test_tiled_prefill_matches_naive_fp32[1000-128]",
              "test_flash.py::test_tiled_prefill_bf16[128]",
              "test_flash.py::test_rectangular_tiles_and_causal_skipping",
              "test_flash.py::test_sliding_window[1000-100]",
              "test_flash.py::test_explicit_positions_offsets_and_masks",
              "test_flash.py::test_merge_of_partials_equals_the_whole")),
    Exercise("paged", "a token's physical slot, and dropping a reference to a block",
             ("paged.BlockTable.slot", "paged.BlockAllocator.release"),
             ("test_paged.py::test_slots_follow_the_block_table",
              "test_paged.py::test_prefix_cache_reuses_the_same_blocks_for_the_same_prefix",
              "test_paged.py::test_copy_on_write_keeps_branches_independent",
              "test_paged.py::test_forking_a_full_last_block_needs_no_copy",
              "test_paged.py::test_out_of_blocks_is_clear_and_leaks_nothing",
              "test_paged.py::test_lru_evicts_the_least_recently_freed_cached_block",
              "test_paged.py::test_randomized_run_of_1000_requests_keeps_every_invariant",
              "test_paged.py::test_property_any_sequence_of_operations")),
    Exercise("prefix", "the prefix cache's chain of block hashes",
             ("paged.block_hashes",),
             ("test_paged.py::test_block_hashes_chain_every_full_block",
              "test_paged.py::test_prefix_cache_reuses_the_same_blocks_for_the_same_prefix",
              "test_paged.py::test_a_block_aligned_prompt_leaves_its_last_block_to_compute",
              "test_paged.py::test_decoded_blocks_enter_the_prefix_cache",
              "test_paged.py::test_forced_hash_collisions_never_return_another_prefix",
              "test_paged.py::test_lru_evicts_the_least_recently_freed_cached_block")),
    Exercise("engine",
             "one scheduler step: who decodes, and preempting the newest when blocks run out",
             ("engine.Scheduler.schedule_decode",),
             ("test_engine.py::test_preempted_requests_produce_the_same_tokens",
              "test_engine.py::test_sessions_keep_a_conversation_until_blocks_are_needed",
              "test_engine.py::test_scheduler_bookkeeping_without_a_model",
              "test_engine.py::"
              "test_out_of_blocks_frees_parked_conversations_first_then_preempts_the_newest")),
    Exercise("speculative", "the accept/resample rule of speculative sampling",
             ("speculative.accept", "speculative.residual"),
             ("test_speculative.py::test_rule_on_probability_vectors",
              "test_speculative.py::test_greedy_verdict_from_token_ids",
              "test_speculative.py::test_simple_chain_equals_the_general_loop")),
    Exercise("quantize", "int8 quantize and dequantize with a scale per row",
             ("quantize.quantize_int8", "quantize.dequantize_int8"),
             ("test_quantize.py::test_int8_round_trip_within_half_a_step",
              "test_quantize.py::test_quantized_cache_kinds_agree_and_stay_close_to_full[int8]",
              "test_quantize.py::test_attention_over_a_quantized_cache_is_close",
              "test_quantize.py::test_quantized_linear_equals_its_dequantized_matrix[fp32-int8]",
              "test_quantize.py::test_quantized_linear_equals_its_dequantized_matrix[bf16-int8]")),
]}


def usage() -> str:
    width = max(map(len, EXERCISES))
    lines = ["exercises (in the course's reading order); run one with  make exercise E=NAME", ""]
    lines += [f"  {e.name:{width}}  exercises/{e.name}.py: {e.what}" for e in EXERCISES.values()]
    return "\n".join(lines)
