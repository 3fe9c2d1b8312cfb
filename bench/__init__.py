"""Benchmarks of isoloco_kernels: run with `pytest bench/ --benchmark-only` (see README.md there)."""
