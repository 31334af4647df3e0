"""The lessons' measured halves, now in bench/: paged.py's fragmentation simulation (bench/paged.py),
flash.py's benchmark table (bench/attention.py) and kvcache.py's bytes-by-kind table and plot
(bench/kvcache.py); the simulation's command writes no tracked file."""

import importlib.util
import json
import sys

import bench.attention
import bench.kvcache
import bench.paged
import kvcache
import results
from conftest import ROOT, run_cli


def test_simulation_meets_the_fragmentation_targets():
    _, (maxlen, oracle, pages) = bench.paged.simulate(150, seed=1)
    assert pages.empty_pct <= 4 and maxlen.empty_pct >= 50
    assert pages.never_written_pct < 4 and oracle.never_written_pct == 0
    assert pages.peak_running > oracle.peak_running > maxlen.peak_running
    assert pages.steps < maxlen.steps
    table = bench.paged.simulation_table([maxlen, oracle, pages], 150)
    assert [row[0] for row in table.rows] == ["contiguous, reserve 2048", "contiguous, reserve true length (oracle)",
                                              "16-token pages"]
    assert table.rows[2][5] == f"{pages.empty_pct:.1f}%" and table.markdown().startswith("| allocation |")


def test_a_missing_matplotlib_still_saves_the_table(capsys, monkeypatch, tmp_path):
    """The plot is optional: without matplotlib one line says so, and the table is saved."""
    monkeypatch.setenv("NANOINFER_RESULTS", str(tmp_path))
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # as if it were not installed
    bench.paged.run_simulation(20, 65536, 2048, 16, seed=0)
    assert capsys.readouterr().out.count("matplotlib is not installed") == 1
    record = json.loads((tmp_path / "paged-simulation.json").read_text())
    assert (record["name"], record["lesson"], record["plots"]) == ("paged-simulation", "paged", [])
    assert len(record["tables"][0]["rows"]) == 3 and not (tmp_path / "paged_simulation.png").exists()


def test_paged_simulation_writes_no_tracked_file():
    """Its table and plot go where NANOINFER_RESULTS points (conftest), never into results/ or plots/."""
    plot = ROOT / "plots" / "paged_simulation.png"
    before = plot.stat().st_mtime_ns, sorted((ROOT / "results").glob("*"))
    rc, out, err = run_cli("bench.py", "paged", "--simulate", "30")
    assert rc == 0, err
    assert (plot.stat().st_mtime_ns, sorted((ROOT / "results").glob("*"))) == before
    record = json.loads((results.directory() / "paged-simulation.json").read_text())
    assert (record["name"], record["lesson"], record["command"]) == ("paged-simulation", "paged",
                                                                     "python bench.py paged --simulate 30")
    table = record["tables"][0]
    assert table["columns"][:2] == ["allocation", "peak concurrent seqs"] and len(table["rows"]) == 3
    assert table["rows"][2][0] == "16-token pages"
    drawn = importlib.util.find_spec("matplotlib") is not None
    assert record["plots"] == (["paged_simulation.png"] if drawn else [])
    assert (results.directory() / "paged_simulation.png").is_file() == drawn


def test_bench_table_from_measurements():
    """The benchmark's table (its full run takes minutes): times in ms, memory in MiB, the two ratios."""
    row = {"n": 4096, "d": 64, "naive": {"time_s": 0.5, "peak_mib": 512.0},
           "tiled eager": {"time_s": 0.3, "peak_mib": 9.0}, "tiled compiled": {"time_s": 0.12, "peak_mib": 8.0},
           "sdpa": {"time_s": 0.1, "peak_mib": 6.0}}
    table = bench.attention.bench_table([row], "float32")
    assert table.columns == ["N", "d", "naive ms", "tiled eager ms", "tiled compiled ms", "SDPA ms", "compiled / SDPA",
                             "naive MiB", "tiled eager MiB", "tiled compiled MiB", "SDPA MiB", "naive / compiled MiB"]
    assert table.rows == [[4096, 64, "500.0", "300.0", "120.0", "100.0", "1.20×", "512", "9", "8", "6", "64×"]]
    assert "float32" in table.title and table.markdown().startswith("| N | d |")


def test_kv_bytes_plot_saves_the_table_and_the_picture():
    path = bench.kvcache.plot_bytes("smollm2-135m", 2048, 1024)
    record = json.loads(path.read_text())
    assert (path.name, record["name"], record["lesson"]) == ("kv-bytes-by-kind.json", "kv-bytes-by-kind", "kvcache")
    (table,) = record["tables"]
    assert table["columns"] == ["cache", "dtype", "100 tokens", "1000 tokens", "2048 tokens"]
    rows = {(r[0], r[1]): r[2:] for r in table["rows"]}
    assert len(rows) == 8
    # SmolLM2: 30 layers × 2 × 3 KV heads × 128 B = 22.5 KiB per token in fp16, × 66 B = 11.6 KiB in int8
    assert rows["dynamic (doubling)", "fp16/bf16"] == ["5.62 MiB", "22.50 MiB", "45 MiB"]       # 256, 1024, 2048 rows
    assert rows["paged (16-token blocks)", "fp16/bf16"] == ["2.46 MiB", "22.15 MiB", "45 MiB"]   # 112, 1008, 2048
    assert rows["static (max_len 2048)", "int8 + scale"] == [kvcache.human(2048 * 11880)] * 3
    assert rows["sliding (window 1024)", "fp16/bf16"] == [kvcache.human(1088 * 23040)] * 3
    if importlib.util.find_spec("matplotlib") is None:
        assert record["plots"] == []
    else:
        assert record["plots"] == ["kv_bytes.png"] and results.plot_path("kv_bytes.png").stat().st_size > 10_000
