"""The project's layout: flat modules on floors, imports running one way only.

A reader opens the files bottom up, so a file may use only what stands below
it (or beside it, without a circle): the ground holds what needs no model
(tokenizer, the caches, flash attention, paging, the device kernels), then
quantization and checkpoints, then the model, then what drives it (engine,
speculative decoding), then the programs on top. Imports inside functions
count too: moving one into a function hides a circle, it does not remove it.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FLOORS = {
    "tokenizer": 0, "kernels": 0, "results": 0, "sampling": 0, "kvcache": 0, "flash": 0, "paged": 0,
    "quantize": 1, "checkpoint": 1,
    "model": 2,
    "engine": 3, "speculative": 3, "drafting": 3, "plan": 3,
    "serve_local": 4, "server": 4, "bench": 4, "train": 4, "tp": 4,
}


def modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(ROOT.glob("*.py"))}


def project_imports(path: Path) -> list[tuple[str, int, str | None]]:
    """(module, line, alias) for every import of a project module in ``path``, at any depth."""
    names, found = set(modules()), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, a.asname) for a in node.names if a.name in names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in names:
            found.append((node.module, node.lineno, None))
    return found


def graph() -> dict[str, set[str]]:
    return {name: {m for m, _, _ in project_imports(path) if m != name} for name, path in modules().items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every circle in the import graph, each once (depth-first search from each module)."""
    found, seen = [], set()

    def walk(node, path):
        for nxt in sorted(g.get(node, ())):
            if nxt in path:
                circle = path[path.index(nxt):]
                key = frozenset(circle)
                if key not in seen:
                    seen.add(key)
                    found.append(circle + [nxt])
            else:
                walk(nxt, path + [nxt])

    for start in sorted(g):
        walk(start, [start])
    return found


def test_every_module_has_a_floor():
    """A new top-level file must say where it stands (and a new file is a new concept)."""
    assert sorted(set(modules()) - set(FLOORS)) == []


def test_no_import_circle():
    assert cycles(graph()) == []


def test_imports_run_down_the_floors():
    upward = [f"{name}.py:{line} imports {m} (floor {FLOORS[m]} above {FLOORS[name]})"
              for name, path in modules().items() for m, line, _ in project_imports(path)
              if FLOORS.get(m, 0) > FLOORS.get(name, 0)]
    assert upward == []


def test_no_module_aliases():
    """`import model` or `from model import X`: a reader (and grep) can follow every call."""
    aliased = [f"{name}.py:{line} imports {m} as {alias}" for name, path in modules().items()
               for m, line, alias in project_imports(path) if alias is not None]
    assert aliased == []


PROGRAMS = {"bench", "serve_local", "server", "train"}   # the programs on top; every other root file is a lesson


def test_no_lesson_imports_bench():
    """bench/ (and bench.py) measure the lessons; a lesson never imports them, at any depth: its own
    `python X.py` demo shows its idea without the benchmark code."""
    found = []
    for name, path in modules().items():
        if name in PROGRAMS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [f"{name}.py:{node.lineno} imports {a.name}" for a in node.names
                          if a.name == "bench" or a.name.startswith("bench.")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == "bench" or node.module.startswith("bench.")):
                found.append(f"{name}.py:{node.lineno} imports from {node.module}")
    assert found == []


def test_device_specific_code_lives_in_kernels():
    """oneDNN calls and inductor settings are named in kernels.py alone (bench.py may report them)."""
    pattern = re.compile(r"mkldnn|onednn|_inductor|inductor\.config")
    found = [f"{name}.py:{i}" for name, path in modules().items() if name not in ("kernels", "bench")
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_float_forward_needs_no_quantize():
    """The blocks of a float model run kernels.linear; quantize.py is only for loading quantized layers."""
    import model
    import inspect
    for part in (model.Attention, model.MLP, model.Block, model.Llama.forward, model.Llama.step, model.attend):
        assert "quantize" not in inspect.getsource(part), part


def test_bookkeeping_is_free_of_torch():
    """The block allocator and the scheduler are plain Python: unit-testable without a model or tensors."""
    for file, classes in (("paged.py", {"Block", "BlockTable", "BlockAllocator"}), ("engine.py", {"Scheduler"})):
        tree = ast.parse((ROOT / file).read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name in classes:
                used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                assert "torch" not in used, f"{file}:{node.name} uses torch"
