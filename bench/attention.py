"""`python bench.py attention` (flash.py): naive, tiled (eager, compiled) and SDPA attention, time
and peak memory as N grows (`--device cuda`: and flash.py's Triton kernel). Each configuration runs
in a fresh process (`python -m bench.attention --measure ...`), so that one configuration's peak
memory cannot hide in another's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import kernels
import results
from flash import TILE_K, TILE_Q, attention, naive
from kernels import triton_attention
from bench.common import ROOT


# The benchmark: naive (the N×N matrix, one head at a time), tiled eager,
# tiled compiled and PyTorch's fused kernel, causal, 8 heads, batch 1. Each
# configuration runs in a fresh process, so that one configuration's peak
# memory (RSS, including the output tensor; the inputs are allocated before
# the baseline) cannot hide in another's, and a warm-up call on a small input
# first pays for one-off costs (compiling the tile graphs, thread pools).

METHODS = ["naive", "tiled eager", "tiled compiled", "sdpa"]
BENCH_N = [512, 1024, 2048, 4096, 8192, 16384]
QUICK_N = [512, 2048, 8192]
HEADS = 8


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _measure(method: str, n: int, d: int, dtype: torch.dtype, reps: int, device: str = "cpu") -> dict:
    """One configuration, in this (fresh) process: best time of ``reps`` calls and
    the peak RSS growth of the first one (on CUDA: of allocated GPU memory)."""
    import gc
    import time

    def inputs(length):
        g = torch.Generator().manual_seed(0)
        return [torch.randn(1, HEADS, length, d, generator=g).to(device, dtype) for _ in range(3)]

    def run(q, k, v):
        if method == "naive":   # all heads at once would hold 8 score matrices (8 GiB each in fp32 at 16K)
            out = torch.empty_like(q)
            for h in range(q.shape[1]):
                out[:, h:h + 1] = naive(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1])[0]
            return out
        if method == "sdpa":
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if method == "triton":
            return triton_attention(q, k, v)[0]
        return attention(q, k, v, compiled=method == "tiled compiled")[0]

    with torch.inference_mode():
        run(*inputs(2 * max(TILE_Q, TILE_K)))   # covers both tile graphs: full tiles and diagonal ones
        q, k, v = inputs(n)
        gc.collect()
        try:    # Linux: writing 5 resets the peak RSS (VmHWM) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = _proc_kib("VmRSS")
        except OSError:
            base = None
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 1024
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            out = run(q, k, v)
            kernels.synchronize(q.device)
            times.append(time.perf_counter() - t0)
            if i == 0:
                used = torch.cuda.max_memory_allocated() / 1024 if device == "cuda" else _proc_kib("VmHWM")
                peak = (used - base) / 1024 if base is not None else float("nan")
            del out
    return {"time_s": min(times), "peak_mib": peak}


def _reps(method: str, n: int) -> int:
    if n >= 8192:
        return 1 if method == "naive" else 2
    return 3


def bench(quick: bool = False, dtype: str = "float32", plot: str | None = None, device: str = "cpu") -> list[dict]:
    """Every configuration in its own subprocess; prints the table, saves it (results/attention.json,
    attention-quick.json; on CUDA attention-cuda*.json, with the Triton kernel) and a plot (plots/flash.png;
    ``plot``: another path, or "" for none)."""
    import json
    import os
    import subprocess
    import sys
    import time
    sizes, dims = (QUICK_N if device == "cpu" else [2048, 16384], [64]) if quick else (BENCH_N, [64, 128])
    rows, t_start, load = [], time.perf_counter(), os.getloadavg()[0]
    for d in dims:
        for n in sizes:
            row = {"n": n, "d": d}
            for method in METHODS + (["triton"] if device == "cuda" else []):
                cmd = [sys.executable, "-m", "bench.attention", "--measure", method, str(n), str(d), dtype,
                       str(_reps(method, n)), device]
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if p.returncode != 0:
                    print(f"  {method} N={n} d={d}: failed: {p.stderr.strip().splitlines()[-1:]}", flush=True)
                    row[method] = {"time_s": float("nan"), "peak_mib": float("nan")}
                    continue
                row[method] = json.loads(p.stdout.strip().splitlines()[-1])
                print(f"  N={n:>5} d={d:>3} {method:>14}: {row[method]['time_s'] * 1e3:9.1f} ms "
                      f"{row[method]['peak_mib']:9.1f} MiB", flush=True)
            rows.append(row)
    table = bench_table(rows, dtype, device, [
        f"total {time.perf_counter() - t_start:.0f} s; load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end (other processes on the cores slow the tiled loop far more "
        "than SDPA)"])
    print(f"\n{table.title}\n\n{table.markdown()}")
    path = results.plot_path("flash.png") if plot is None else Path(plot) if plot else None
    drawn = path is not None and _plot(rows, dtype, path)
    name = ("attention" if device == "cpu" else f"attention-{device}") + ("-quick" if quick else "")
    saved = results.save(name, "flash", [table],
                         plots=[path] if drawn and plot is None else [])
    print(f"saved {saved}")
    return rows


def bench_table(rows: list[dict], dtype: str, device: str = "cpu", notes: list[str] = ()) -> results.Table:
    """Per N and d: each method's best time and peak memory, compiled tiles against SDPA, naive's memory
    against the tiles'; on CUDA the Triton kernel's time too, and against SDPA."""
    columns = ["N", "d", "naive ms", "tiled eager ms", "tiled compiled ms", "SDPA ms", "compiled / SDPA",
               "naive MiB", "tiled eager MiB", "tiled compiled MiB", "SDPA MiB", "naive / compiled MiB"]
    cells, gpu = [], device == "cuda"
    for r in rows:
        t = [r[m]["time_s"] * 1e3 for m in METHODS]
        mem = [r[m]["peak_mib"] for m in METHODS]
        cells.append([r["n"], r["d"]] + [f"{x:.1f}" for x in t] + [f"{t[2] / t[3]:.2f}×"]
                     + [f"{x:.0f}" for x in mem] + [f"{mem[0] / max(mem[2], 1e-9):.0f}×"]
                     + ([f"{r['triton']['time_s'] * 1e3:.2f}", f"{r['triton']['time_s'] * 1e3 / t[3]:.2f}×"] if gpu else []))
    return results.Table(
        f"causal attention, {HEADS} heads, batch 1, {dtype}, "
        f"{torch.cuda.get_device_name() if gpu else f'{torch.get_num_threads()} threads'}",
        columns + (["Triton ms", "Triton / SDPA"] if gpu else []), cells,
        ["time: best of 1-3 calls; memory: peak RSS growth during one call (inputs allocated before, output "
         "included), each configuration in a fresh process; naive runs the heads one after another (one N×N "
         "matrix at a time)"] + list(notes))


def _plot(rows, dtype, path) -> bool:
    plt = results.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "peak_mib", "peak extra memory (MiB)"), (axes[1], "time_s", "time (s)")):
        for i, method in enumerate(METHODS):
            for d, style in ((64, "-"), (128, "--")):
                pts = [(r["n"], r[method][key]) for r in rows if r["d"] == d]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", ms=3, color=f"C{i}", label=f"{method}, d {d}")
        ax.set(xscale="log", yscale="log", xlabel="N (sequence length)", ylabel=label)
        ax.set_xticks(sorted({r["n"] for r in rows}), [str(r) for r in sorted({r["n"] for r in rows})])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"causal attention, {HEADS} heads, {dtype}, {torch.get_num_threads()} CPU threads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"\nplot: {path}")
    return True


def attention_args(p):
    """The flags of `python bench.py attention`."""
    p.add_argument("--quick", action="store_true", help="N = 512, 2048, 8192 and d 64 only")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--plot", default=None, help="where the PNG goes (default: plots/flash.png; '' for none)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (adds the Triton kernel of flash.py's section 5)")


def attention_command(args):
    try:
        kernels.pick_device(args.device)
    except ValueError as e:                # --device cuda without a GPU: one line, as argparse's errors
        print(f"bench.py attention: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    bench(args.quick, args.dtype, args.plot, args.device)


def main():
    """One configuration in this process, for bench(): prints its measurement as JSON."""
    ap = argparse.ArgumentParser(description="one attention configuration, measured (bench.py attention runs this)")
    ap.add_argument("--measure", nargs=6, required=True, metavar=("METHOD", "N", "D", "DTYPE", "REPS", "DEVICE"))
    import json
    method, n, d, dtype, reps, device = ap.parse_args().measure
    print(json.dumps(_measure(method, int(n), int(d), getattr(torch, dtype), int(reps), device)))


if __name__ == "__main__":
    main()
