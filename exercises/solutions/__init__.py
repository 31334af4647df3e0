"""Reference solutions of the extend exercises (exercises/__init__.py's kind "extend"): the
function each stub asks for, kept here so that `--exercise NAME --exercise-solution` and the plain
test suite (tests/lessons/test_extend.py) check that the feature can be built as its contract
says. Try the exercise before reading one."""
