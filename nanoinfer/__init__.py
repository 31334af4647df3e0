"""nanoinfer, the product: the runner and the server, built from the lessons at the repository root.

The lessons teach one technique each on plain PyTorch; this package chains them and makes them fast,
as gpt-fast does: it loads a model as the lessons build it, then swaps in what this machine runs
fastest (quantized layers, native kernels, prepacked weights, a compiled step). No lesson imports it.

    config.py   RunConfig: what a run is, built once from the flags, the plan and defaults
    machine.py  this machine measured (probe), for plan.choose
    load.py     the one way a model is assembled for running: checkpoint -> quantize -> kernels
"""
