"""Options, the per-device ceilings fixture, and what the JSON report carries besides timings.

    pytest bench/ --benchmark-only                       quick: the two small sets, every method and
                                                         baseline, 0.3 s per case (minutes on 2 cores)
    pytest bench/ --benchmark-only --bench-full          every set and world size, 1 s per case
    pytest bench/ --benchmark-only --bench-devices cuda  the GPU cases only
    pytest bench/ --benchmark-only --bench-sets ref-tiny,llama-178m --bench-seconds 0.5
    ... --benchmark-json bench/results/<date>-<device>.json, then `python bench/report.py`
    pytest bench/ --benchmark-only --bench-dry-run       every case once at its smallest size, small
                                                         ceilings: checks that each case runs and
                                                         reports (bench/tests/test_bench_roofline.py), its
                                                         numbers measure nothing

Either mode times every implementation beside its torch baseline in the same run, so the ratios
hold in both. --bench-sets and --bench-seconds, when given, win over the mode's defaults. Cases
marked `bench_full` run only with --bench-full: whole outer steps and the distributed step on
llama-tiny, and the 4-rank distributed group; the quick run also skips the flatten methods "gram"
and "svd" (float64) on llama-tiny, which ref-tiny times. Without
--benchmark-json (or --benchmark-save / --benchmark-autosave) the JSON goes to
.benchmarks/isoloco/<UTC time>-<mode>.json; the summary names the file and how to render it.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import pytest
import torch

from bench import harness
from bench.shapes import SETS, bucket_shapes, cpu_variant, decoder_weight_shapes

_CEILINGS: dict[str, dict] = {}

QUICK_SETS = ("ref-tiny", "llama-tiny")  # llama-tiny carries the CPU flatten target (bench/report.py)
QUICK_SECONDS, FULL_SECONDS = 0.3, 1.0
DRY_SETS = ("dry-tiny",)  # --bench-dry-run's set (bench/shapes.py); the other modes leave it out
FULL = pytest.mark.bench_full  # a case (or parameter) that runs with --bench-full only


def pytest_addoption(parser):
    g = parser.getgroup("isoloco bench")
    g.addoption(
        "--bench-full",
        action="store_true",
        help=f"every set and case (default: quick, sets {','.join(QUICK_SETS)}, "
        f"{QUICK_SECONDS:g} s per case, no bench_full cases)",
    )
    g.addoption(
        "--bench-seconds",
        type=float,
        default=None,
        help="timed seconds per case (rounds = this / one run's time, 1..200); "
        f"default {QUICK_SECONDS:g}, {FULL_SECONDS:g} with --bench-full",
    )
    g.addoption(
        "--bench-devices", default="cpu,cuda", help="comma-separated devices to run (cpu, cuda); others are deselected"
    )
    g.addoption(
        "--bench-sets",
        default=None,
        help=f"comma-separated bucket sets to run, in this order, from {', '.join(SETS)}; "
        f"default {','.join(QUICK_SETS)}, all but {DRY_SETS[0]} with --bench-full, {DRY_SETS[0]} with --bench-dry-run",
    )
    g.addoption(
        "--bench-threads", type=int, default=None, help="torch.set_num_threads for the run (default: torch's choice)"
    )
    g.addoption(
        "--bench-dry-run",
        action="store_true",
        help=f"every case once at its smallest size (set {DRY_SETS[0]}, one round per case, small ceilings and "
        "shapes): that each case runs and reports, not a measurement",
    )


def _full(config) -> bool:
    return bool(config.getoption("--bench-full", False))


def _dry(config) -> bool:
    return bool(config.getoption("--bench-dry-run", False))


def _sets(config) -> list[str]:
    given = config.getoption("--bench-sets", None)
    if given:
        return given.split(",")
    if _dry(config):
        return list(DRY_SETS)
    return [s for s in SETS if s not in DRY_SETS] if _full(config) else list(QUICK_SETS)


def _seconds(config) -> float:
    given = config.getoption("--bench-seconds", None)
    if given is not None:
        return given
    if _dry(config):
        return 0.0
    return FULL_SECONDS if _full(config) else QUICK_SECONDS


def _mode(config) -> str:
    return "dry-run" if _dry(config) else "full" if _full(config) else "quick"


def pytest_configure(config):
    config.addinivalue_line("markers", "bench_full: runs only with --bench-full")
    threads = config.getoption("--bench-threads", None)
    if threads:
        torch.set_num_threads(threads)
    # Runs before pytest-benchmark's own configure (trylast), which reads the JSON path.
    opt = config.option
    if (
        getattr(opt, "benchmark_only", False)
        and not getattr(opt, "benchmark_json", True)
        and not getattr(opt, "benchmark_save", None)
        and not getattr(opt, "benchmark_autosave", False)
    ):
        stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
        path = Path(config.rootpath, ".benchmarks", "isoloco", f"{stamp}-{_mode(config)}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        opt.benchmark_json = path


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's tables: the last thing printed
def pytest_terminal_summary(terminalreporter, config):
    path = getattr(config.option, "benchmark_json", None)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        path = path.name  # some pytest-benchmark versions hand --benchmark-json over as an open file
    if not path or not getattr(config.option, "benchmark_only", False):
        return
    mode = {"quick": "quick (--bench-full for every set and case)"}.get(_mode(config), _mode(config))
    rel = os.path.relpath(path)
    if rel.startswith(os.pardir):  # outside the working directory: the absolute path reads better
        rel = os.path.abspath(path)
    terminalreporter.write_sep("-", "isoloco bench")
    terminalreporter.write_line(f"mode: {mode}; sets {','.join(_sets(config))}; {_seconds(config):g} s per case")
    if not os.path.exists(path):
        terminalreporter.write_line(f"no JSON written (no benchmark ran); it would have gone to {rel}")
        return
    terminalreporter.write_line(f"results: {rel}")
    terminalreporter.write_line(f"tables:  python bench/report.py {rel} --table --no-write")
    terminalreporter.write_line(
        f"page:    python bench/report.py {rel} --out {os.path.splitext(rel)[0]}.md"
        "  (markdown, and a plot beside the JSON)"
    )


_HERE = Path(__file__).resolve().parent


def _is_case(item) -> bool:
    """A benchmark case: a test of bench/'s own files, not of bench/tests (the unit tests of bench's code)."""
    return item.path.is_relative_to(_HERE) and not item.path.is_relative_to(_HERE / "tests")


def pytest_collection_modifyitems(config, items):
    devices = set(config.getoption("--bench-devices").split(","))
    full = _full(config)
    order = _sets(config)
    sets = set(order)
    unknown = sets - set(SETS)
    if unknown:
        raise pytest.UsageError(f"--bench-sets: unknown set(s) {sorted(unknown)}; known: {list(SETS)}")
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if not _is_case(item):  # bench/tests, or tests/ collected in the same run: not a benchmark case
            keep.append(item)
        elif (
            params.get("device", "cpu") not in devices
            or params.get("set_name", next(iter(sets))) not in sets
            or (not full and item.get_closest_marker("bench_full"))
        ):
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
def bench_full(request) -> bool:
    """True with --bench-full (cases may skip parts of a quick run with this)."""
    return _full(request.config)


@pytest.fixture(scope="session")
def bench_seconds(request) -> float:
    return _seconds(request.config)


@pytest.fixture(scope="session")
def bench_dry(request) -> bool:
    """True with --bench-dry-run: cases with sizes of their own take their smallest."""
    return _dry(request.config)


@pytest.fixture
def device(request) -> torch.device:
    """The case's device (parametrised by name); CUDA cases skip without a GPU."""
    name = request.param
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return torch.device(name)


@pytest.fixture(scope="session")
def ceilings(bench_dry):
    """ceilings(device) -> {"copy_GBps", "matmul_TFLOPs": {dtype: …}, …}, measured once per device
    (on small buffers with --bench-dry-run)."""

    def get(device: torch.device) -> dict:
        key = torch.device(device).type
        if key not in _CEILINGS:
            _CEILINGS[key] = harness.measure_ceilings(device, dry=bench_dry)
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
            "vocab": spec.vocab,
            "hidden": spec.hidden,
            "layers": spec.layers,
            "ffn": spec.ffn,
            "n_params": spec.n_params,
            "buckets": bucket_shapes(s for _, s in decoder_weight_shapes(spec)),
            "cpu": None
            if cpu is None
            else {
                "note": cpu.note or "as is",
                "buckets": bucket_shapes(s for _, s in decoder_weight_shapes(cpu)),
            },
        }
    output_json["isoloco"] = {
        "ceilings": dict(_CEILINGS),
        "sets": sets,
        "backends": ik.backends(),
        "bench_seconds": _seconds(config),
        "mode": _mode(config),
        "bench_sets": _sets(config),
        "models": harness.__doc__,
    }
