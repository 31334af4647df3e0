"""scripts/gpu_check.sh, the one script for a machine with a GPU, checked where there is none:
it parses, its dry run prints every step and says why each GPU step is skipped, and the GPU
flags of the programs it runs fail in one line without CUDA."""

import subprocess

import pytest
import torch

from conftest import ROOT, run_cli

STEPS = ["install (not torch)", "Triton kernels and CUDA-marked tests, on the GPU",
         "Triton kernels in the interpreter (CUDA hidden)", "decode, batch 1, bf16", "flash attention",
         "the engine at batch 16"]


def test_gpu_check_parses_and_its_dry_run_prints_every_step():
    assert subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], cwd=ROOT).returncode == 0
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    for name in STEPS:
        assert f"== {name}" in p.stdout
    reason = "skipped: --dry-run" if torch.cuda.is_available() else "skipped: no CUDA GPU on this machine"
    assert p.stdout.count(reason) == p.stdout.count("\n== ") == 7
    assert "bench.py decode --device cuda --dtypes bfloat16" in p.stdout
    assert "bench.py attention --quick --device cuda" in p.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_without_cuda_the_script_and_the_gpu_flags_fail_in_one_line():
    p = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout.count("\n") == 1 and "--dry-run" in p.stdout
    rc, out, err = run_cli("bench.py", "attention", "--device", "cuda")
    assert rc == 2 and "no such CUDA GPU on this machine" in err and "Traceback" not in err
