"""Who serves each op: the dispatch table (table.py, the one place a backend is chosen; `backends()` reads it), the
loaders of the compiled paths (_ext: the CUDA extension built from csrc/; _cupy: the same kernels through CuPy) and the
torch paths of the two ops. Imports only _validate and triton/; loaded by ops.py and, lazily, by the flatten methods."""
