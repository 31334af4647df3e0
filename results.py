"""
results.py — numbers are generated, not typed.

A speed measured on one machine says little on another: the machines this
project runs on change from day to day (an AMD EPYC, an Intel Xeon with AMX),
and memory bandwidth drifts minute to minute on a shared one. So every
benchmark and demo that measures saves what it measured as JSON under
`results/` — its tables, the exact command, the commit, the date and the
machine (CPU model, cores, threads, torch version) — and `python bench.py
report` renders RESULTS.md from those files, one section per lesson, each
table headed by where it came from. Nobody types a measured number into the
README or a docstring; a test fails when RESULTS.md differs from what the JSON
renders to. Compare numbers only inside one table: ratios between rows of one
run survive a change of machine, absolute speeds do not.

    save(name, lesson, tables, plots)    ->  results/<name>.json
    cpu_kind()                           ->  "amd-epyc", "intel-xeon": a name's suffix where a
                                             result is kept for each kind of CPU
    plot_path("x.png"), pyplot()         ->  plots/x.png, drawn if matplotlib is installed
    render(load())                       ->  RESULTS.md
    alternate({"a": f, "b": g}, rounds)  ->  seconds per call, the sides timed in turns
    spread(times)                        ->  "median (min–max)", formatted

A demo on a learner's busy laptop measures the laptop's load as much as the code: one cold
call of each side says little. So a demo leads with the counts that do not drift (tokens
per forward, bytes, positions), warms every side up, times the sides in turns, round after
round (a burst of load then slows each side alike), and prints the median with its spread.

Tests set NANOINFER_RESULTS to a scratch directory, so running the suite never
rewrites the committed results or plots.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# The course's reading order (README): RESULTS.md follows it, section by section.
LESSONS = ["model", "kvcache", "flash", "paged", "engine", "speculative", "quantize", "tp",
           "kernels", "runner"]
TITLES = {"model": "model.py — naive vs cached decoding, prefill vs decode",
          "kvcache": "kvcache.py — what a cache holds, and what reusing one buys",
          "flash": "flash.py — attention without the N×N matrix",
          "paged": "paged.py — KV memory in 16-token blocks",
          "engine": "engine.py — continuous batching, prefix caching and chunked prefill",
          "speculative": "speculative.py — guessing tokens and checking them in one pass",
          "quantize": "quantize.py — fewer bits, measured against accuracy",
          "tp": "tp.py — one model across several processes",
          "kernels": "kernels.py — which kernel runs each product on this machine",
          "runner": "The runner against its peers (batch-1 decode)"}


@dataclass
class Table:
    """One table: a title, column names and rows of already formatted cells."""
    title: str
    columns: list[str]
    rows: list[list]
    notes: list[str] = field(default_factory=list)   # one line each, printed under the table

    def markdown(self) -> str:
        align = ["---:" if all(NUMERIC.match(cell(r[i])) for r in self.rows if cell(r[i]))
                 else "---" for i in range(len(self.columns))]
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "|".join(align) + "|"]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        return "\n".join(lines + [f"\n{n}" for n in self.notes])


NUMERIC = re.compile(r"^[-+]?[\d.,]+ ?(×|x|%|s|ms|MiB|GiB|MB|KiB|B)?$")


def cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 10_000 else f"{v:.0f}"
    return str(v)


# ----------------------------------------------------------------------------
# Timing that tells the truth on a busy machine.

def alternate(calls: dict[str, Callable[[], object]], rounds: int = 5,
              warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls``: ``warmup`` untimed calls of each first (a first call
    pays one-off costs: allocation, thread pools, compilation), then ``rounds`` rounds that call
    each once, in turn, so whatever else the machine does lands on every side alike."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    for _ in range(warmup):
        for call in calls.values():
            call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - t0)
    return seconds


def spread(values: list[float], scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    """The median of repeated measurements and their range, each times ``scale``: spread([0.0123,
    0.0119, 0.0140], 1e3) is "12.3 (11.9–14.0)". A range much wider than the median says the
    machine was busy: rerun, or compare medians only."""
    lo, mid, hi = (v * scale for v in (min(values), statistics.median(values), max(values)))
    return f"{mid:.{digits}f}{unit} ({lo:.{digits}f}–{hi:.{digits}f}{unit})"


# ----------------------------------------------------------------------------
# Where a number came from.

ISA = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"]


def machine() -> dict:
    """The facts a reader needs to weigh a measurement: CPU, cores, threads, versions."""
    import torch
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            # what decides the fast paths (kernels.py): bf16 and int8 arithmetic in hardware
            "isa": " ".join(f for f in ISA if f in flags)}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def cpu_kind(cpu: str | None = None) -> str:
    """The CPU's vendor and family as a file name's part ("Intel(R) Xeon(R) Processor" ->
    "intel-xeon"): the runner's acceptance holds on each kind of CPU of the pool, so its results
    keep one record per kind instead of the last machine's."""
    words = re.sub(r"\((R|TM|tm)\)", "", cpu or machine()["cpu"]).lower().split()
    return "-".join(re.sub(r"[^a-z0-9]", "", w) for w in words[:2]) or platform.machine()


def commit() -> str:
    """The commit the code ran at ("+changes" when the tree differed from it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "*.py"],
            cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+changes" if dirty else "")


def directory() -> Path:
    return Path(os.environ.get("NANOINFER_RESULTS", ROOT / "results"))


def plot_path(filename: str) -> Path:
    """Where a demo writes a picture: plots/ (or the tests' scratch directory)."""
    base = (Path(os.environ["NANOINFER_RESULTS"]) if "NANOINFER_RESULTS" in os.environ
            else ROOT / "plots")
    base.mkdir(parents=True, exist_ok=True)
    return base / filename


def pyplot():
    """matplotlib.pyplot drawing to files (the Agg backend), or None, said in one line, when
    matplotlib is not installed: a plot is optional, the tables are saved either way."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot
    except ImportError:
        print("matplotlib is not installed: plot skipped (pip install -r requirements-test.txt)")
        return None
    return matplotlib.pyplot


def save_plot(fig, filename: str, **savefig) -> Path:
    """Write a demo's figure to plot_path(filename), close it, and say where it went."""
    fig.savefig(path := plot_path(filename), **savefig)
    import matplotlib.pyplot
    matplotlib.pyplot.close(fig)
    print(f"plot: {path}")
    return path


def save(name: str, lesson: str, tables: list[Table], command: str | None = None,
         plots: list[str] = ()) -> Path:
    """Write results/<name>.json: the tables with the command, commit, date and machine."""
    assert lesson in LESSONS, lesson
    # quoted as a shell would need it: `--flags '--activations int8'` is one argument
    command = command or "python " + shlex.join([Path(sys.argv[0]).name] + sys.argv[1:])
    record = {"name": name, "lesson": lesson, "command": command, "commit": commit(),
              "date": datetime.date.today().isoformat(), "machine": machine(),
              "tables": [t.__dict__ for t in tables], "plots": [Path(p).name for p in plots]}
    path = directory() / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path


# ----------------------------------------------------------------------------
# RESULTS.md, rendered.

def load(where: Path | None = None) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((where or directory()).glob("*.json"))]


def render(records: list[dict]) -> str:
    """RESULTS.md from the saved records: lessons in reading order, each table under its source."""
    out = ["# Results", "",
           "Generated by `python bench.py report` from `results/*.json`; "
           "do not edit by hand (a test",
           "compares). Each table is one run of the command above it, "
           "on the machine it names: compare",
           "rows within a table, not across tables or machines.", ""]
    for lesson in LESSONS:
        mine = sorted((r for r in records if r["lesson"] == lesson), key=lambda r: r["name"])
        if not mine:
            continue
        out += [f"## {TITLES[lesson]}", ""]
        for r in mine:
            m = r["machine"]
            where = (f"{m['cpu']}, {m['cores']} cores, {m['threads']} threads, "
                     f"torch {m['torch']}" + (f"; {m['isa']}" if m.get("isa") else ""))
            out += [f"### `{r['command']}`", "",
                    f"commit {r['commit']}, {r['date']}; {where}", ""]
            for t in r["tables"]:
                table = Table(**t)
                out += ([f"**{table.title}**", ""] if table.title else []) + [table.markdown(), ""]
            out += ([f"![{p}](plots/{p})" for p in r.get("plots", [])]
                    + ([""] if r.get("plots") else []))
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------
# Pictures.

def plain_ticks(axis, ticks=None):
    """Label a log-scaled axis in plain numbers: at ``ticks`` when given (the sizes a
    demo measured), else at 1, 10, 100, ... and, over a short range (under 2.5
    decades), at 2, 5, 20, 50, ... too (matplotlib would write 2×10⁰)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator
    if ticks is not None:
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_minor_locator(NullLocator())
    else:
        axis.set_minor_locator(LogLocator(subs=(2, 5)))

        def minor(x, _):
            lo, hi = sorted(axis.get_view_interval())
            return f"{x:g}" if hi < 300 * lo else ""
        axis.set_minor_formatter(FuncFormatter(minor))
    axis.set_major_formatter("{x:g}")
