"""The benchmarks behind `python bench.py SUB`, one module per family; bench.py is their table.
Lessons (the root files) never import this package."""
