"""Options, the per-device ceilings fixture, and what the JSON report carries besides timings.

    pytest bench/ --benchmark-only                       every case on every available device
    pytest bench/ --benchmark-only --bench-devices cuda  the GPU cases only
    pytest bench/ --benchmark-only --bench-sets ref-tiny,llama-tiny --bench-seconds 0.5
    ... --benchmark-json bench/results/<date>-<device>.json, then `python bench/report.py`
"""
from __future__ import annotations

import platform

import pytest
import torch

from bench import harness
from bench.shapes import SETS, bucket_shapes, cpu_variant, decoder_weight_shapes

_CEILINGS: dict[str, dict] = {}


def pytest_addoption(parser):
    g = parser.getgroup("isoloco bench")
    g.addoption("--bench-seconds", type=float, default=1.0,
                help="timed seconds per case (rounds = this / one run's time, 1..200); default 1")
    g.addoption("--bench-devices", default="cpu,cuda",
                help="comma-separated devices to run (cpu, cuda); others are deselected")
    g.addoption("--bench-sets", default=",".join(SETS),
                help=f"comma-separated bucket sets to run, in this order, from {', '.join(SETS)}")
    g.addoption("--bench-threads", type=int, default=None,
                help="torch.set_num_threads for the run (default: torch's choice)")


def pytest_configure(config):
    threads = config.getoption("--bench-threads", None)
    if threads:
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    devices = set(config.getoption("--bench-devices").split(","))
    order = config.getoption("--bench-sets").split(",")
    sets = set(order)
    unknown = sets - set(SETS)
    if unknown:
        raise pytest.UsageError(f"--bench-sets: unknown set(s) {sorted(unknown)}; known: {list(SETS)}")
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("device", "cpu") not in devices or params.get("set_name", next(iter(sets))) not in sets:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    # Cases run set by set in the order --bench-sets names them (stable within a set), so a run
    # stopped at a time budget has finished the sets named first.
    rank = {name: i for i, name in enumerate(order)}
    keep.sort(key=lambda it: rank.get(getattr(getattr(it, "callspec", None), "params", {}).get("set_name"), -1))
    items[:] = keep


@pytest.fixture(scope="session")
def bench_seconds(request) -> float:
    return request.config.getoption("--bench-seconds")


@pytest.fixture
def device(request) -> torch.device:
    """The case's device (parametrised by name); CUDA cases skip without a GPU."""
    name = request.param
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return torch.device(name)


@pytest.fixture(scope="session")
def ceilings():
    """ceilings(device) -> {"copy_GBps", "matmul_TFLOPs": {dtype: …}, …}, measured once per device."""

    def get(device: torch.device) -> dict:
        key = torch.device(device).type
        if key not in _CEILINGS:
            _CEILINGS[key] = harness.measure_ceilings(device)
        return _CEILINGS[key]

    return get


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["torch"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        machine_info["cuda_device"] = torch.cuda.get_device_name(0)
        machine_info["cuda_runtime"] = torch.version.cuda
    try:
        import triton

        machine_info["triton"] = triton.__version__
    except ImportError:
        pass
    machine_info["python"] = platform.python_version()


def pytest_benchmark_update_json(config, benchmarks, output_json):
    import isoloco_kernels as ik

    sets = {}
    for name, spec in SETS.items():
        cpu = cpu_variant(spec)
        sets[name] = {
            "vocab": spec.vocab, "hidden": spec.hidden, "layers": spec.layers, "ffn": spec.ffn,
            "n_params": spec.n_params,
            "buckets": bucket_shapes(s for _, s in decoder_weight_shapes(spec)),
            "cpu": None if cpu is None else {
                "note": cpu.note or "as is",
                "buckets": bucket_shapes(s for _, s in decoder_weight_shapes(cpu)),
            },
        }
    output_json["isoloco"] = {
        "ceilings": dict(_CEILINGS),
        "sets": sets,
        "backends": ik.backends(),
        "bench_seconds": config.getoption("--bench-seconds"),
        "models": harness.__doc__,
    }
