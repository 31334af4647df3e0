"""The project's layout: the lessons in course order, the product on top, imports one way only.

A reader takes the lessons in the README's order, so a lesson may use only the ground files (what
needs no model: sampling, the tokenizer, storage, the results stamp) and the lessons
before it. The programs (the runner, the server, bench.py, train.py) and the package that holds the
product (nanoinfer/) may use anything; no lesson uses them, nor bench/. Imports inside functions
count too: moving one into a function hides a circle, it does not remove it.

Storage is three ground files, the formats below the names: safetensors_io (a Hugging Face
directory read and written), gguf_hf (GGUF converted to and from one), checkpoint (a model name
resolved to one).
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GROUND = ["sampling", "tokenizer", "safetensors_io", "gguf_hf", "checkpoint", "results"]
COURSE = ["model", "kvcache", "flash", "paged", "engine", "speculative", "quantize", "drafting", "tp",
          "plan", "kernels"]
PROGRAMS = ["serve_local", "server", "bench", "train"]
PRODUCT = ("nanoinfer", "bench")       # packages: the product, the benchmarks


def modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(ROOT.glob("*.py"))}


def project_imports(path: Path) -> list[tuple[str, int, str | None]]:
    """(module, line, alias) for every import of a root module in ``path``, at any depth; a
    package's modules (nanoinfer.load, bench.x) by their package's name."""
    names, found = set(modules()) | set(PRODUCT), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[0], node.lineno, a.asname) for a in node.names
                      if a.name.split(".")[0] in names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in names:
            found.append((node.module.split(".")[0], node.lineno, None))
    return found


def allowed(name: str) -> set[str]:
    """What a root module may import: the ground below it, and for a lesson the lessons before it."""
    if name in GROUND:
        return set(GROUND[:GROUND.index(name)])
    if name in COURSE:
        return set(GROUND) | set(COURSE[:COURSE.index(name)])
    return set(modules()) | set(PRODUCT)


def graph() -> dict[str, set[str]]:
    g = {name: {m for m, _, _ in project_imports(path) if m != name} for name, path in modules().items()}
    for package in PRODUCT:     # a package is one node: what its modules import
        g[package] = {m for p in sorted((ROOT / package).glob("*.py")) for m, _, _ in project_imports(p)} - {package}
    return g


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


def test_every_module_has_a_place():
    """A new top-level file must say where it stands: ground, a lesson in course order, or a program."""
    assert sorted(set(modules()) - set(GROUND + COURSE + PROGRAMS)) == []


def test_no_import_circle():
    assert cycles(graph()) == []


def test_lessons_import_only_earlier_lessons_and_ground():
    forward = {}
    for name in GROUND + COURSE:
        for m, line, _ in project_imports(modules()[name]):
            if m != name and m not in allowed(name) and m not in PRODUCT:
                forward.setdefault(name, set()).add(m)
    assert forward == {}


def test_no_lesson_imports_the_product_or_bench():
    found = [f"{name}.py:{line} imports {m}" for name in GROUND + COURSE
             for m, line, _ in project_imports(modules()[name]) if m in PRODUCT]
    assert found == []


def test_model_is_the_llama_and_its_decoders():
    """Lesson 1 needs nothing but the ground: no cache kinds, attention kernels, quantization,
    compilation or C++ (they come in as arguments and plain fields, or the product swaps them in)."""
    assert {m for m, _, _ in project_imports(modules()["model"])} <= set(GROUND)


def test_no_module_aliases():
    """`import model` or `from model import X`: a reader (and grep) can follow every call."""
    aliased = [f"{name}.py:{line} imports {m} as {alias}" for name, path in modules().items()
               for m, line, alias in project_imports(path) if alias is not None]
    assert aliased == []


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


def test_server_reads_the_engine_only_through_its_public_data():
    """server.py consumes engine.Events, Engine.stats() and a request's public results: it never
    walks a request's sequences, the scheduler, the allocator or the model behind the engine."""
    tree = ast.parse((ROOT / "server.py").read_text())
    internals = {"sequences", "scheduler", "allocator", "cache", "counts"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = ast.unparse(node.value)
        engine_side = re.search(r"\beng(ine)?$", base) is not None
        hidden = node.attr == "model" or node.attr.startswith("_")
        if node.attr in internals or (engine_side and hidden):
            found.append(f"server.py:{node.lineno} {base}.{node.attr}")
        if node.attr == "logprobs" and base != "body":
            found.append(f"server.py:{node.lineno} {base}.logprobs")  # a sequence's, not the body's
    assert found == []


def test_one_stop_token_rule():
    """Whether a token is shown is sampling.visible's to say: no other file tests
    `t not in ...eos...`."""
    found = [f"{name}.py:{node.lineno}" for name, path in modules().items() if name != "sampling"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Compare) and any(isinstance(op, ast.NotIn) for op in node.ops)
             and any(isinstance(c, (ast.Name, ast.Attribute, ast.Call)) and "eos" in ast.unparse(c)
                     for c in node.comparators)]   # a set of ids, not a tuple of names
    assert found == []


def top_level_names(path: Path) -> set[str]:
    """What ``module.NAME`` can reach in a file: its top-level defs, classes, assignments and
    imports (and anything a module-level ``__getattr__`` would answer: then every name)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):     # names bound under a guard count too
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                    ts = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                    names |= {n.id for t in ts for n in ast.walk(t) if isinstance(n, ast.Name)}
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
    return names


def project_files() -> dict[str, Path]:
    """Every module of the tree by its import name: root files, the packages' modules, the tests."""
    found = {name: path for name, path in modules().items()}
    for package in PRODUCT:
        found |= {f"{package}.{p.stem}": p for p in sorted((ROOT / package).glob("*.py"))}
    return found


def bound_in(fn) -> set[str]:
    """Names a function binds locally (arguments, assignments, loop and with targets), which
    shadow a module of the same name inside it."""
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_every_project_name_a_file_reads_exists():
    """``module.name`` and ``from module import name`` name something the module defines: a name
    moved from one file to another (SUMMARISE left speculative.py for drafting.py) must not leave
    a caller behind that only a rarely run benchmark would reach."""
    files = project_files()
    defined = {name: top_level_names(path) for name, path in files.items()}
    readers = list(files.values()) + sorted((ROOT / "tests").rglob("*.py"))
    missing = []
    for path in readers:
        tree = ast.parse(path.read_text(), str(path))
        imported = {}       # local name -> module, for `import m` and `import pkg.m` (as pkg.m)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name: a.name for a in node.names if a.asname is None and a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
                missing += [f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import {a.name}"
                            for a in node.names
                            if a.name != "*" and a.name not in defined[node.module]
                            and f"{node.module}.{a.name}" not in files]

        def visit(node, shadowed):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                shadowed = shadowed | bound_in(node)
            if isinstance(node, ast.Attribute):
                base = ast.unparse(node.value)
                if base in imported and base.split(".")[0] not in shadowed:
                    module = imported[base]
                    if node.attr not in defined[module] and f"{module}.{node.attr}" not in files:
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {base}.{node.attr}")
            for child in ast.iter_child_nodes(node):
                visit(child, shadowed)

        visit(tree, set())
    assert missing == []
