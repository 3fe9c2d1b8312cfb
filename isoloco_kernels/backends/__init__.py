"""Who serves each op: the dispatch table (dispatch.py, the one place a backend is chosen), the loaders of the compiled
paths (_ext: the CUDA extension built from csrc/; _cupy: the same kernels through CuPy) and the torch paths of the two
ops. Imports only reference/_validate and triton/; loaded lazily by the flatten methods and by ops.py."""
