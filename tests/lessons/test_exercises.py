"""exercises/: every stub keeps its lesson function's signature and only raises its hint; run
through `--exercise NAME` it fails that exercise's tests showing the hint, while the reference
(the lesson's own functions; an extend exercise's solution in exercises/solutions/), put through
the same swap (`--exercise-solution`), passes the same tests and is called; every course lesson
has an exercise, and at least two extend one; a bad name is one line; `make exercise` lists the
exercises."""

import ast
import inspect
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import exercises
from conftest import ROOT

NAMES = list(exercises.EXERCISES)


def pytest_run(*args) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def runs():
    """Each exercise run twice in a pytest of its own: the stubs as committed (stopping at the
    first failure, as a learner would see it) and the reference through the swap."""
    jobs = {(name, mode): args for name in NAMES
            for mode, args in (("stub", ("--exercise", name, "-x")),
                               ("solution", ("--exercise", name, "--exercise-solution")))}
    jobs["unknown", "stub"] = ("--exercise", "nope")
    with ThreadPoolExecutor(2) as pool:        # the runs are mostly single-threaded (one_thread)
        futures = {key: pool.submit(pytest_run, *args) for key, args in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def hints(name: str) -> dict[str, str]:
    """Stub name -> its hint, checking that each stub is a docstring and `raise NotImplementedError(hint)`."""
    path = ROOT / "exercises" / f"{name}.py"
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            doc, rest = node.body[0], node.body[1:]
            assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{path}:{node.name}"
            raise_ = rest[0] if len(rest) == 1 else None
            assert isinstance(raise_, ast.Raise) and isinstance(raise_.exc, ast.Call) \
                and getattr(raise_.exc.func, "id", None) == "NotImplementedError", \
                f"{path}:{node.name} must be its docstring and raise NotImplementedError(hint) (is a solution committed?)"
            found[node.name] = raise_.exc.args[0].value
    return found


def test_every_lesson_has_an_exercise_and_two_extend_one():
    table = exercises.EXERCISES.values()
    assert len(NAMES) >= 10
    assert {e.lesson for e in table} == set(exercises.LESSONS)
    assert {e.kind for e in table} <= set(exercises.KINDS)
    assert sum(e.kind == "extend" for e in table) >= 2
    assert [exercises.LESSONS.index(e.lesson) for e in table] == \
        sorted(exercises.LESSONS.index(e.lesson) for e in table), "the table follows the course"
    solutions = {p.stem for p in (ROOT / "exercises" / "solutions").glob("*.py")} - {"__init__"}
    assert solutions == {e.name for e in table if e.kind == "extend"}


@pytest.mark.parametrize("name", NAMES)
def test_stubs_have_the_lesson_signatures_a_contract_and_a_hint(name):
    ex = exercises.EXERCISES[name]
    stubs, refs, lessons = ex.stubs(), ex.references(), ex.lesson_functions()
    for target in ex.replaces:
        assert inspect.signature(stubs[target]) == inspect.signature(refs[target]), target
        assert inspect.signature(refs[target]) == inspect.signature(lessons[target]), target
        assert len(inspect.getdoc(stubs[target])) > 100, f"{target}: the docstring states the contract"
    if ex.kind == "extend":         # judged by tests of its own, beside the lesson's
        assert "test_extend.py" in ex.files and len(ex.files) > 1, ex.files
        assert all(refs[t] is not lessons[t] for t in ex.replaces), "the solution is not the lesson's"
    found = hints(name)
    assert sorted(found) == sorted(t.rsplit(".", 1)[1] for t in ex.replaces)
    for stub, hint in found.items():
        assert 2 <= len(hint.strip().splitlines()) <= 4, f"{name}.{stub}: a hint is 2-4 lines"
    doc = inspect.getdoc(sys.modules[ex.module])
    assert f"make exercise E={name}" in doc and f"--exercise {name}" in doc and "Passing means" in doc
    for target in ex.replaces:      # names the lesson function it replaces, as file:function
        module, *rest = target.split(".")
        assert f"{module}.py:{'.'.join(rest)}" in doc, target


@pytest.mark.parametrize("name", NAMES)
def test_stub_fails_its_tests_showing_the_hint(runs, name):
    rc, out = runs[name, "stub"]
    assert rc == 1 and re.search(r"^1 failed", out, re.M), out[-3000:]
    assert f"exercises/{name}.py" in out and "NotImplementedError" in out
    assert any(f"NotImplementedError: {hint.splitlines()[0]}" in out for hint in hints(name).values()), out[-3000:]
    assert f"exercise {name}: not yet" in out


@pytest.mark.parametrize("name", NAMES)
def test_the_references_pass_through_the_same_swap(runs, name):
    ex = exercises.EXERCISES[name]
    rc, out = runs[name, "solution"]
    assert rc == 0, out[-3000:]
    passed = int(re.search(r"^(\d+) passed", out, re.M).group(1))
    assert passed >= len(ex.tests) and "failed" not in out
    for target in ex.replaces:      # each swapped attribute is what the lesson really calls
        calls = re.search(rf"{re.escape(target)} ran (\d+) times", out)
        assert calls and int(calls.group(1)) > 0, (target, out[-2000:])


def test_unknown_exercise_is_one_line_naming_them_all(runs):
    rc, out = runs["unknown", "stub"]
    assert rc == 4
    assert out.strip() == f"ERROR: unknown exercise 'nope': use --exercise with one of {', '.join(NAMES)}"


def test_make_exercise_without_a_name_lists_them():
    p = subprocess.run(["make", "-s", "exercise"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == exercises.usage().strip()
