"""No typed numbers: a lesson's docstrings and comments quote no measured figure by hand.

A speed typed into a docstring is true on one machine on one day; RESULTS.md is regenerated from
results/*.json (results.py). So every *figure with a unit* in the docstrings and comments of the
lessons and ground files at the repository root (FILES) must be one of:

1. **Arithmetic shown**: an operand or the result of a formula written out where it stands. An
   operand touches an arithmetic operator (``· × * / ÷ + −``: "16 × 22.5 KiB"); a result follows
   ``=`` or ``≈`` with an operator before it in the same clause ("16384² · 4 B = 1 GiB",
   "135M · 4 B ≈ 540 MB"). "a step = 40 ms" shows no arithmetic: it is a measurement. A table
   (lines indented deeper than the prose around them, blank lines allowed) that holds a formula
   ("bytes per token per layer = 2 · n_kv_heads · d_head · dtype_size") is computed by it:
   every figure in it counts as shown. Once shown, a figure may be repeated anywhere in the same
   docstring or comment block.
2. **A vendor's specification**, said so in its sentence with the word "spec" (or "specs",
   "specification"): "HBM3 at 3.35 TB/s, the H100's spec".
3. **Measured, and in results/**: a table of some results/*.json holds the same number with the
   same unit (in its cell or its column's name, or for a unit other than × in the table's title;
   or written after the number in a title or a note), the figure has two significant digits or
   more (a one-digit "2 MiB" or "8×" matches some cell by chance), *and* the docstring or comment
   block names that record's command ("python bench.py context") or its file
   ("results/context.json"), so a reader can rerun it. A figure missing from the records of the
   commands its block names is reported as contradicting them.

A figure with a unit is a number (a range "4-8x", "~" or "≈" before it allowed) followed by a
unit of time (ns, µs, us, ms, s, sec, seconds, min, minutes, hours; also "ns/weight", "ms per
call"), a rate (tok/s, GB/s, positions/s, /s), a size (KB, kB, MB, GB, TB, KiB, MiB, GiB, TiB)
or a ratio written against the number ("3.5x", "2.06×"; "16 × 22" and "5632×2048" are a product
and a shape). In a docstring's table that holds no formula, a bare decimal ("256×256 1.27") is a
figure too, its unit in the table's heading; a value given to a flag ("--max-minutes 1.5") is
not. A bare number in prose ("mean ≈ 420") carries no unit to tell a measurement from a
setting ("temperature 0.7"): that one is left to review.

Definitions are not figures, by construction of the pattern: bytes ("2 bytes per fp16 weight",
"768 B per layer": the size of a value or a row is a definition), counts ("16-token blocks",
"30 layers", "135M parameters"), percentages (a share of fixed data: "54% of each layer's
weights"), formulas without a unit ("N(N+1)/2 positions"), a figure joined to its noun by a
hyphen, which names a size rather than reports one ("2-MiB pages"), and words ("several times",
"an order of magnitude"). A measurement a docstring needs is said in words or as a ratio
together with the command that produces it, or quoted from results/ under rule 3.

ALLOWED lists the exceptions, each with its reason; keep it tiny.
"""

import ast
import io
import json
import re
import tokenize
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import pytest

import results
from conftest import ROOT

# The lessons and the ground files: what a learner reads. Not the programs (server.py,
# serve_local.py, bench.py) nor the packages (nanoinfer/, bench/).
FILES = ["model", "kvcache", "flash", "paged", "engine", "speculative", "drafting", "quantize",
         "tp", "plan", "sampling", "tokenizer", "kernels", "checkpoint", "gguf_hf",
         "safetensors_io", "results", "train"]

# (file, the figure as written) -> why it may stay. Keep it tiny.
ALLOWED: dict[tuple[str, str], str] = {}

NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
TIME = r"ns|µs|μs|us|ms|s|sec|seconds?|min|minutes?|hours?"
SIZE = r"[kKMGT]i?B"
FIGURE = re.compile(
    rf"(?<![\w.,\-–/^])(?P<approx>[~≈]\s?)?(?P<num>{NUM}(?:\s?[-–]\s?{NUM})?)"
    rf"(?:\s?(?P<unit>{SIZE}/s|[A-Za-z]+/s|/s|{SIZE}|(?:{TIME})(?:/[A-Za-z]+|\s+per\s+[a-z]+)?)"
    rf"(?![\w/(])"
    rf"|(?P<ratio>[×x])(?![\w(]|\s?\d))")
OPERATOR = "·×*/÷+−"
FIX = "show its arithmetic, or say it in words with the command that measures it"


@dataclass
class Figure:
    line: int           # in the source file
    text: str           # as written
    numbers: list[str]  # the number, or a range's two ends, as written
    unit: str           # normalised: "×", "tok/s", "MiB", "ms", ...
    exempt: bool        # a definition: arithmetic shown, or a spec


def normal_unit(unit: str) -> str:
    """One name per unit: "ns/weight" and "ms per call" are times, "x" is ×, "tokens/s" tok/s."""
    unit = unit.split("/")[0] if unit.split("/")[0] in TIME.split("|") else unit
    unit = re.sub(r"\s+per\s+\w+$", "", unit)
    return {"x": "×", "us": "µs", "μs": "µs", "sec": "s", "second": "s", "seconds": "s",
            "minute": "min", "minutes": "min", "tokens/s": "tok/s", "token/s": "tok/s",
            "kB": "KB"}.get(unit, unit)


def clause_before(text: str, start: int) -> str:
    """The text from the last clause break (, ; : ( or a sentence's end) up to ``start``."""
    head = text[:start]
    cut = max([head.rfind(c) for c in ",;:("] + [m.end() for m in re.finditer(r"\.\s", head)]
              + [-1])
    return head[cut + 1:]


def sentence_of(text: str, start: int, end: int) -> str:
    """The sentence (or the clause after a semicolon) around text[start:end]."""
    a = max([m.end() for m in re.finditer(r"[.;!?]\s", text[:start])] + [0])
    b = re.search(r"[.;!?]\s|$", text[end:])
    return text[a:end + b.start()]


def figures(text: str, first_line: int) -> list[Figure]:
    """Every figure with a unit in one block of text (a docstring or a run of comments)."""
    found = []
    for m in FIGURE.finditer(text):
        unit = normal_unit(m["unit"] or m["ratio"])
        before = text[:m.start()].rstrip()[-1:] or " "     # the characters around it
        after = text[m.end():].lstrip()[:1] or " "
        operand = (before in OPERATOR or after in OPERATOR + "=≈") and unit != "×"
        result = (before in "=≈" and m["approx"] is None
                  or m["approx"] is not None and m["approx"][0] == "≈")
        result = result and any(op in clause_before(text, m.start()) for op in OPERATOR + "²")
        spec = re.search(r"\bspec(s|ification)?\b", sentence_of(text, m.start(), m.end()))
        found.append(Figure(first_line + text.count("\n", 0, m.start()), m[0].strip(),
                            re.findall(NUM, m["num"]), unit, operand or result or bool(spec)))
    return found


def tables(text: str, first_line: int) -> list[tuple[list[int], bool]]:
    """The tables of a docstring, runs of lines indented deeper than its prose (blank lines inside
    a run allowed): their line numbers, and whether one of them is a formula "x = ... · ..."."""
    lines = text.split("\n")
    indents = [len(x) - len(x.lstrip()) for x in lines[1:] if x.strip()]
    base, found, run = min(indents, default=0), [], []
    for i, line in enumerate(lines + ["end"]):
        if i > 0 and (len(line) - len(line.lstrip()) >= base + 4 or run and not line.strip()):
            run.append(i)
            continue
        if run:
            found.append(([first_line + j for j in run],
                          any(re.search(r"=[^=]*[·×*/÷+]", lines[j]) for j in run)))
        run = []
    return found


def table_figures(text: str, first_line: int) -> list[Figure]:
    """The bare decimals ("1.43") of a docstring's tables that hold no formula: a table of
    measurements whose unit is in its heading. A value given to a command-line flag
    ("--max-minutes 1.5") and an operand ("0.5 + 4/group") are not."""
    found, lines = [], text.split("\n")
    for rows, formula in tables(text, first_line):
        for n in [] if formula else rows:
            line = lines[n - first_line]
            for m in re.finditer(r"(?<![\w.,\-–/^×])\d+(?:,\d{3})*\.\d+(?![\w.])", line):
                before = line[:m.start()].rstrip()[-1:] or " "
                after = line[m.end():].lstrip()[:1] or " "
                if (FIGURE.match(line, m.start()) or re.search(r"--[\w-]+[ =]$", line[:m.start()])
                        or before in OPERATOR + "=" or after in OPERATOR + "="):
                    continue
                found.append(Figure(n, m[0], [m[0]], "", False))
    return found


def blocks(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each docstring (every string standing alone as a statement) and of
    each run of comments on consecutive lines."""
    lines, found = source.splitlines(), []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            found.append((node.lineno, "\n".join(lines[node.lineno - 1:node.end_lineno])))
    run: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if run and tok.start[0] != run[-1][0] + 1:
            found.append((run[0][0], "\n".join(t for _, t in run)))
            run = []
        run.append((tok.start[0], tok.string))
    if run:
        found.append((run[0][0], "\n".join(t for _, t in run)))
    return found


# ----------------------------------------------------------------------------
# What results/ holds.

def number(s: str) -> Decimal | None:
    try:
        return Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None


def digits(s: str) -> str:
    """The significant digits of a number as written: "0.049" -> "49", "2.0" -> "20"."""
    return s.replace(",", "").replace(".", "").lstrip("0")


def unit_in(unit: str, h: "Held") -> bool:
    """Is ``unit`` the one written after the number in its cell or, a bare number, named in its
    column's name (or, but for ×, in the table's title)?"""
    if not unit:                # a table's bare number: its unit is in the table's heading
        return True
    if h.unit:
        return normal_unit(h.unit) == unit
    context = h.context if unit == "×" else f"{h.context} | {h.title}"
    if unit == "×":
        return re.search(r"×|÷| / |ratio|speedup|\bx\b", context) is not None
    if unit == "tok/s":
        return re.search(r"\btok(en)?s?/s\b", context) is not None
    return re.search(rf"(?<![\w']){re.escape(unit)}(?!\w)", context) is not None


@dataclass
class Held:
    record: str         # results/<name>.json
    command: str
    value: Decimal
    unit: str           # written after the number in its cell, title or note ("" if none)
    context: str = ""   # a bare number's column: where its unit is named
    title: str = ""     # the table's, where a bare number's unit other than × may be named


def held(where) -> list[Held]:
    """Every number the tables of where/*.json hold, with where its unit is named."""
    out = []
    for path in sorted(where.glob("*.json")):
        r = json.loads(path.read_text())
        name, command = f"results/{path.name}", r["command"]
        for t in r["tables"]:
            for row in t["rows"]:
                for column, v in zip(t["columns"], row):
                    for shown in {results.cell(v), str(v)}:
                        for m in re.finditer(NUM, shown):
                            unit = re.match(r"\s?(×|x\b|%|[A-Za-zµ/]+)?", shown[m.end():])[1]
                            out.append(Held(name, command, number(m[0]), unit or "", column,
                                            t["title"]))
            for text in [t["title"], *t.get("notes", [])]:
                for f in figures(text, 0):
                    out += [Held(name, command, number(n), f.unit) for n in f.numbers]
    return out


def names(block: str, record: str, command: str) -> bool:
    """Does the block name the record's command ("python bench.py context") or its file?"""
    flat = " ".join(block.replace("`", " ").split())
    return command in flat or record in flat


def holders(f: Figure, store: list[Held]) -> dict[str, str]:
    """record -> its command, for each record holding every number of ``f`` in ``f``'s unit."""
    if not all(len(digits(n)) > 1 for n in f.numbers):    # "2 MiB", "8×": some cell, by chance
        return {}
    each = [{h.record: h.command for h in store if h.value == number(n) and unit_in(f.unit, h)}
            for n in f.numbers]
    return {r: c for r, c in each[0].items() if all(r in e for e in each)}


def findings(path, store: list[Held]) -> list[str]:
    """One line per figure that breaks the rules: "file:line: figure, why and what to do"."""
    name, out = path.stem, []
    commands = {h.record: h.command for h in store}
    for first, text in blocks(path.read_text()):
        computed = {n for rows, formula in tables(text, first) if formula for n in rows}
        found = figures(text, first) + table_figures(text, first)
        for f in found:
            f.exempt = f.exempt or f.line in computed
        shown = {(tuple(map(number, f.numbers)), f.unit) for f in found if f.exempt}
        named = sorted(r for r, c in commands.items() if names(text, r, c))
        for f in found:
            if (f.exempt or (tuple(map(number, f.numbers)), f.unit) in shown
                    or (name, f.text) in ALLOWED):
                continue
            by = holders(f, store)
            if any(r in named for r in by):
                continue
            where = f"{name}.py:{f.line}: {f.text}"
            if by:
                record = sorted(by)[0]
                out.append(f"{where} matches {record}: if it is that measurement, name "
                           f"`{by[record]}` beside it; if not, {FIX}")
            elif named:
                out.append(f"{where} contradicts {', '.join(named)} (named here, without it); "
                           f"{FIX}")
            else:
                out.append(f"{where} is in no results/*.json; {FIX}")
    return out


@pytest.fixture(scope="module")
def store():
    return held(ROOT / "results")


@pytest.mark.parametrize("name", FILES)
def test_no_typed_numbers(name, store):
    """One line per figure: file:line: the figure, and why it fails."""
    found = findings(ROOT / f"{name}.py", store)
    assert not found, "\n" + "\n".join(found)


def test_every_file_is_read():
    assert all((ROOT / f"{name}.py").is_file() for name in FILES)
    assert all(name in FILES and reason for (name, _), reason in ALLOWED.items())


@pytest.mark.parametrize("text, figure", [
    ("a decode step took 40 ms here", "40 ms"),
    ("prompt lookup at ~4.66x, once", "~4.66x"),
    ("decoding runs 4-37x longer", "4-37x"),
    ("it streams 0.045 ns/weight", "0.045 ns/weight"),
    ("at 20 GB/s that", "20 GB/s"),
    ("870 positions/s", "870 positions/s"),
    ("136 MB in int8", "136 MB"),
    ("a step = 40 ms", "40 ms"),                    # no arithmetic before the =
    ("on 200-token contexts, 16 rows gave 9x the tokens per second of one", "9x"),
    ("the full run: ~45 min on 2 CPU cores", "~45 min"),
])
def test_measured_figures_are_found(text, figure):
    found = figures(text, 1)
    assert [f.text for f in found] == [figure] and not found[0].exempt


@pytest.mark.parametrize("text", [
    "scores of one head, fp32:   16384² · 4 B = 1 GiB",
    "one block holds 16 × 22.5 KiB = 360 KiB",
    "16 · 200 · 1.5 KiB ≈ 4.7 MiB per layer",
    "~340k positions × 576 × 2 bytes ≈ 0.4 GB",
    "HBM3 reads 3.35 TB/s by the H100's spec.",
    "2 bytes per fp16 weight, 768 B per layer, 16-token blocks, 2-MiB pages",
    "W 5632×2048 fp32, the 256×256 tile, 2048 x 4112, PCIe 4.0 x16, 0x1F",
    "N(N+1)/2 positions, 54% of the weights, 135M parameters, Q4_1",
])
def test_definitions_pass(text):
    assert [f.text for f in figures(text, 1) if not f.exempt] == []


def test_a_table_under_its_formula_is_computed(tmp_path):
    """A table that holds its formula passes; the same rows under prose are measurements."""
    formula = "The price:\n\n    bytes per token = 2 · layers · heads · d · size\n\n"
    rows = ("    Llama-2-7B   32   128   fp16   512 KiB\n"
            "    SmolLM2       3    64   bf16   22.5 KiB\n")
    timed = "    d 64:   128×256 1.43   256×256 1.27   (python train.py --max-minutes 1.5)\n"
    for head, want in ((formula, []), ("Measured here:\n\n", ["512 KiB", "22.5 KiB"]),
                       ("Time ÷ SDPA's:\n\n" + timed, ["1.43", "1.27", "512 KiB", "22.5 KiB"])):
        (tmp_path / "lesson.py").write_text(f'"""\n{head}{rows}\nDone.\n"""\n')
        found = findings(tmp_path / "lesson.py", [])
        assert sorted(f.split(": ")[1].split(" is ")[0] for f in found) == sorted(want)


def test_a_figure_in_results_passes_only_beside_its_command(tmp_path, monkeypatch):
    """Rule 3: a figure a record holds passes where its block names the record's command, is told
    to name it otherwise, and one that the named record lacks contradicts it."""
    monkeypatch.setenv("NANOINFER_RESULTS", str(tmp_path / "results"))
    table = results.Table("x·Wᵀ, ms per call", ["rows", "F.linear", "F.linear / prepacked"],
                          [[1, 3.313, "1.30×"], [4, 7.969, "3.63×"]], ["total 362 s"])
    results.save("demo", "kernels", [table], command="python kernels.py")
    store = held(tmp_path / "results")
    cases = {"F.linear takes 3.313 ms, 1.30× prepacked's, 362 s in all (python kernels.py).": [],
             "F.linear takes 3.313 ms a call.": ["name `python kernels.py`"],
             "prepacked: 3.63× (`python kernels.py`)": [],
             "F.linear / prepacked: 2.50× (`python kernels.py`)": ["contradicts results/demo.json"],
             "3.63 ms (python kernels.py)": ["contradicts"],     # a number, but not in ms
             "8× (python kernels.py)": ["contradicts"]}          # one digit: no match by chance
    for text, want in cases.items():
        (tmp_path / "lesson.py").write_text(f'"""{text}"""\n')
        found = findings(tmp_path / "lesson.py", store)
        assert len(found) == len(want) and all(w in f for w, f in zip(want, found)), (text, found)


def test_demos_time_in_turns_and_print_a_median_with_its_spread():
    """results.alternate: warm-ups first, then one call of each side per round, in turn (the
    order is what is asserted, never a time); results.spread: the median, then the range."""
    order = []
    seconds = results.alternate({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                rounds=3, warmup=1)
    assert order == ["a", "b"] * 4 and {k: len(v) for k, v in seconds.items()} == {"a": 3, "b": 3}
    assert results.spread([0.0140, 0.0119, 0.0123], 1e3) == "12.3 (11.9–14.0)"
    assert results.spread([2.0, 1.5, 3.25], digits=2, unit="×") == "2.00× (1.50–3.25×)"
    with pytest.raises(ValueError, match="rounds"):
        results.alternate({"a": lambda: None}, rounds=0)
