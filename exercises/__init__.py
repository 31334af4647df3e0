"""The course's exercises: write one function of a lesson yourself, then run that lesson's own
tests on it; or add a small feature a lesson lacks, and run the tests that judge it.

Each file here holds stubs: a signature, a docstring with its contract, and a body that
raises NotImplementedError with a hint. Replace the body, then run

    make exercise E=flash          (or: .venv/bin/python -m pytest tests --exercise flash)

Two kinds:
* implement: the stub is a lesson function (same signature). tests/conftest.py puts yours
  where the lesson's was (the module or class attribute the lesson calls, so every call
  inside the lesson goes through your code) and runs only that exercise's tests.
* extend: the stub is a feature the lesson lacks, put in at one of its hooks (a method or
  function the lesson calls, e.g. paged.py's eviction policy) through the same swap. Its
  tests are the lesson's own (nothing else may break) and tests/lessons/test_extend.py's,
  which judge the new feature. A reference solution lives in exercises/solutions/NAME.py;
  the plain test suite runs test_extend.py on it.

`--exercise-solution` swaps the reference in through the same machinery instead (the
lesson's own function, or the solution of an extend exercise): the tests must pass, which
is how tests/lessons/test_exercises.py checks the table below.

This table is the one place that names, per exercise, what its stubs replace and
which tests judge them; conftest.py, the Makefile and tests/lessons/test_exercises.py read it.
It imports nothing heavy: `python3 -c "import exercises; print(exercises.usage())"`
works before torch is installed.
"""

from __future__ import annotations

import enum
import functools
import importlib
from dataclasses import dataclass


# The course's lessons (the README's table, in its order): each has at least one exercise.
LESSONS = ("model", "kvcache", "flash", "paged", "engine", "speculative", "quantize", "tp", "plan")


class Kind(enum.StrEnum):
    IMPLEMENT = "implement"     # write a function the lesson has
    EXTEND = "extend"           # add a feature the lesson lacks, at one of its hooks


KINDS = tuple(Kind)


@dataclass(frozen=True)
class Exercise:
    name: str                   # E=name; the stubs live in exercises/<name>.py
    lesson: str                 # the lesson (of LESSONS) whose row lists it
    kind: Kind                  # implement a lesson function, or extend the lesson
    what: str                   # one line for the list
    replaces: tuple[str, ...]   # "module.function" or "module.Class.method"; the stub has the
                                # last name (extend: the hook the feature goes in at)
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

    @property
    def solution(self) -> str | None:
        """The module of an extend exercise's reference solution."""
        return f"exercises.solutions.{self.name}" if self.kind is Kind.EXTEND else None

    def lesson_functions(self) -> dict[str, object]:
        """'module.attr' -> what the lesson holds there now (as the class or module holds it)."""
        return {target: getattr(*_owner(target)) for target in self.replaces}

    def references(self) -> dict[str, object]:
        """'module.attr' -> the reference: the lesson's own function (implement), or the
        function of exercises/solutions/<name>.py that stands in for it (extend)."""
        if self.kind is Kind.IMPLEMENT:
            return self.lesson_functions()
        mod = importlib.import_module(self.solution)
        return {target: getattr(mod, target.rsplit(".", 1)[1]) for target in self.replaces}

    def install(self, functions: dict[str, object]):
        """Put ``functions`` where the lesson looks them up; returns a callable that puts the
        originals back. Meanwhile ``original(target)`` still reaches the lesson's own."""
        saved = [(target, *_owner(target), getattr(*_owner(target))) for target in functions]
        for target, fn in functions.items():
            setattr(*_owner(target), fn)
        for target, _, _, lessons in saved:
            _swapped_out.setdefault(target, lessons)

        def restore():
            for target, owner, attr, lessons in saved:
                setattr(owner, attr, lessons)
                if _swapped_out.get(target) is lessons:
                    del _swapped_out[target]
        return restore


# target -> the lesson's function while something else is installed there (Exercise.install)
_swapped_out: dict[str, object] = {}


def original(target: str):
    """The lesson's own function at ``target`` ("sampling.sampling_probs"), also while an
    exercise's function is installed there: an extension that adds to the lesson's function
    calls this one, not the attribute it replaces (which would call itself)."""
    return _swapped_out.get(target) or getattr(*_owner(target))


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
    Exercise("rope", "model", Kind.IMPLEMENT,
             "rotary position embeddings: each position's angles, and the rotation",
             ("model.rope_cos_sin", "model.apply_rope"),
             ("test_model.py::test_logits_match_transformers",
              "test_model.py::test_cached_logits_match_full_forward",
              "test_engine.py::test_batch_of_32_equals_each_request_alone")),
    Exercise("minp", "model", Kind.EXTEND,
             "min-p sampling: keep the tokens within a factor of the likeliest",
             ("sampling.sampling_probs",),
             ("test_sampling.py::test_sampling_controls",
              "test_sampling.py::test_top_p_equals_a_full_sort_of_the_vocabulary",
              "test_sampling.py::test_distribution_is_what_sample_draws",
              "test_extend.py::test_min_p_keeps_the_tokens_within_min_p_of_the_likeliest",
              "test_extend.py::test_min_p_off_changes_nothing",
              "test_extend.py::test_min_p_draws_follow_the_cut_distribution")),
    Exercise("kvcache", "kvcache", Kind.IMPLEMENT,
             "write new K/V rows into a cache at their positions",
             ("kvcache.write_rows",),
             ("test_kvcache.py::test_write_rows_puts_each_row_where_its_position_says",
              "test_kvcache.py::test_caches_equal_naive_greedy[static]",
              "test_kvcache.py::test_sliding_window_caches_equal_naive[sliding]",
              "test_kvcache.py::test_crop_then_redecode_reproduces[static]",
              "test_kvcache.py::"
              "test_fork_shares_until_write_and_branches_are_independent[static]")),
    Exercise("flash", "flash", Kind.IMPLEMENT,
             "one online-softmax tile step: running max, running sum, rescaled accumulator",
             ("flash.tile_step",),
             ("test_flash.py::test_tiled_prefill_matches_naive_fp32[128-16]",
              "test_flash.py::test_tiled_prefill_matches_naive_fp32[1000-128]",
              "test_flash.py::test_tiled_prefill_bf16[128]",
              "test_flash.py::test_rectangular_tiles_and_causal_skipping",
              "test_flash.py::test_sliding_window[1000-100]",
              "test_flash.py::test_explicit_positions_offsets_and_masks",
              "test_flash.py::test_merge_of_partials_equals_the_whole")),
    Exercise("paged", "paged", Kind.IMPLEMENT,
             "a token's physical slot, and dropping a reference to a block",
             ("paged.BlockTable.slot", "paged.BlockAllocator.release"),
             ("test_paged.py::test_slots_follow_the_block_table",
              "test_paged.py::test_prefix_cache_reuses_the_same_blocks_for_the_same_prefix",
              "test_paged.py::test_copy_on_write_keeps_branches_independent",
              "test_paged.py::test_forking_a_full_last_block_needs_no_copy",
              "test_paged.py::test_out_of_blocks_is_clear_and_leaks_nothing",
              "test_paged.py::test_lru_evicts_the_least_recently_freed_cached_block",
              "test_paged.py::test_randomized_run_of_1000_requests_keeps_every_invariant",
              "test_paged.py::test_property_any_sequence_of_operations")),
    Exercise("prefix", "paged", Kind.IMPLEMENT, "the prefix cache's chain of block hashes",
             ("paged.block_hashes",),
             ("test_paged.py::test_block_hashes_chain_every_full_block",
              "test_paged.py::test_prefix_cache_reuses_the_same_blocks_for_the_same_prefix",
              "test_paged.py::test_a_block_aligned_prompt_leaves_its_last_block_to_compute",
              "test_paged.py::test_decoded_blocks_enter_the_prefix_cache",
              "test_paged.py::test_forced_hash_collisions_never_return_another_prefix",
              "test_paged.py::test_lru_evicts_the_least_recently_freed_cached_block")),
    Exercise("evict", "paged", Kind.EXTEND,
             "a prefix-cache eviction policy that keeps shared prefixes: deepest block first",
             ("paged.BlockAllocator.victim",),
             ("test_paged.py::test_prefix_cache_reuses_the_same_blocks_for_the_same_prefix",
              "test_paged.py::test_decoded_blocks_enter_the_prefix_cache",
              "test_paged.py::test_forced_hash_collisions_never_return_another_prefix",
              "test_paged.py::test_out_of_blocks_is_clear_and_leaks_nothing",
              "test_paged.py::test_randomized_run_of_1000_requests_keeps_every_invariant",
              "test_paged.py::test_property_any_sequence_of_operations",
              "test_extend.py::test_evict_deepest_first_then_least_recently_freed",
              "test_extend.py::test_evict_unreachable_blocks_before_any_other",
              "test_extend.py::test_evict_keeps_a_shared_system_prompt_through_a_flood")),
    Exercise("engine", "engine", Kind.IMPLEMENT,
             "one scheduler step: who decodes, and preempting the newest when blocks run out",
             ("engine.Scheduler.schedule_decode",),
             ("test_engine.py::test_preempted_requests_produce_the_same_tokens",
              "test_engine.py::test_sessions_keep_a_conversation_until_blocks_are_needed",
              "test_engine.py::test_scheduler_bookkeeping_without_a_model",
              "test_engine.py::"
              "test_out_of_blocks_frees_parked_conversations_first_then_preempts_the_newest")),
    Exercise("speculative", "speculative", Kind.IMPLEMENT,
             "the accept/resample rule of speculative sampling",
             ("speculative.accept", "speculative.residual"),
             ("test_speculative.py::test_rule_on_probability_vectors",
              "test_speculative.py::test_greedy_verdict_from_token_ids",
              "test_speculative.py::test_simple_chain_equals_the_general_loop")),
    Exercise("quantize", "quantize", Kind.IMPLEMENT,
             "int8 quantize and dequantize with a scale per row",
             ("quantize.quantize_int8", "quantize.dequantize_int8"),
             ("test_quantize.py::test_int8_round_trip_within_half_a_step",
              "test_quantize.py::test_quantized_cache_kinds_agree_and_stay_close_to_full[int8]",
              "test_quantize.py::test_attention_over_a_quantized_cache_is_close",
              "test_quantize.py::test_quantized_linear_equals_its_dequantized_matrix[fp32-int8]",
              "test_quantize.py::test_quantized_linear_equals_its_dequantized_matrix[bf16-int8]")),
    Exercise("tp", "tp", Kind.IMPLEMENT,
             "which heads and MLP units a rank keeps: whole GQA groups, split evenly",
             ("tp.plan",),
             ("test_tp.py::test_plan_splits_whole_kv_groups",)),
    Exercise("plan", "plan", Kind.IMPLEMENT,
             "the plan's cost model: bytes a decode step reads, and the KV cache's at ctx",
             ("plan.ModelInfo.token_bytes", "plan.ModelInfo.kv_bytes"),
             ("test_plan.py::test_model_info_from_configs",
              "test_plan.py::test_cpu_without_bf16",
              "test_plan.py::test_kv_quantized_when_the_context_does_not_fit",
              "test_plan.py::test_weights_quantized_when_the_model_does_not_fit")),
]}


def usage() -> str:
    width = max(map(len, EXERCISES))
    lines = ["exercises, in the course's reading order: edit exercises/NAME.py, then run"
             "  make exercise E=NAME",
             "implement: write a function the lesson has; extend: add a feature it lacks", ""]
    lines += [f"  {e.name:{width}}  {e.kind:9}  lesson {LESSONS.index(e.lesson) + 1}  "
              f"{e.replaces[0].split('.')[0] + '.py':15} {e.what}" for e in EXERCISES.values()]
    return "\n".join(lines)
