"""RESULTS.md is generated: it must be exactly what results/*.json render to."""

import json

import results
from conftest import ROOT


def test_results_md_is_fresh():
    """Rerun `python bench.py report` after a benchmark saves new results."""
    assert (ROOT / "RESULTS.md").read_text() == results.render(results.load(ROOT / "results"))


def test_save_stamps_and_render_places(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOINFER_RESULTS", str(tmp_path))
    t = results.Table("speed", ["method", "tok/s", "speedup"], [["plain", 20.0, "1.00×"], ["fast", 41.25, "2.06×"]])
    path = results.save("demo", "speculative", [t], command="python bench.py demo")
    record = json.loads(path.read_text())
    assert path == tmp_path / "demo.json"
    assert {"command", "commit", "date", "machine", "tables"} <= set(record)
    assert {"cpu", "cores", "threads", "torch"} <= set(record["machine"])
    text = results.render(results.load(tmp_path))
    assert "## speculative.py" in text and "### `python bench.py demo`" in text
    assert "| method | tok/s | speedup |\n|---|---:|---:|\n| plain | 20.0 | 1.00× |\n| fast | 41.2 | 2.06× |" in text


def test_cpu_kind_names_the_vendor_and_family():
    """The runner's results keep a record per kind of CPU: the name's suffix is the vendor and
    family, whatever the model number and marks."""
    assert results.cpu_kind("Intel(R) Xeon(R) Processor") == "intel-xeon"
    assert results.cpu_kind("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz") == "intel-xeon"
    assert results.cpu_kind("AMD EPYC 7B13 64-Core Processor") == "amd-epyc"
    assert results.cpu_kind() == results.cpu_kind(results.machine()["cpu"])
