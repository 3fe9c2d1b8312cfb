"""dispatch/table.py: one table per (op, device) chooses the backend; backends() reports that same choice;
every backend sees arguments checked by the one check of its op."""

from __future__ import annotations

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.dispatch import table as dispatch


def _fake(name: str, ok: bool, takes: bool = True, log=None):
    def run(*args):
        log.append(name)

    return dispatch.Candidate(
        name, lambda: (ok, "" if ok else f"{name} is off"), lambda *a: (takes, "" if takes else f"{name} refuses"), run
    )


def test_select_takes_the_first_available_candidate_that_supports_the_call(monkeypatch):
    log = []
    table = [
        _fake("a", False, log=log),
        _fake("b", True, takes=False, log=log),
        _fake("c", True, log=log),
        _fake("d", True, log=log),
    ]
    monkeypatch.setitem(dispatch.TABLES, ("iso_scale_", "cuda"), table)
    assert dispatch.select("iso_scale_", "cuda", "args").name == "c"
    assert dispatch.select("iso_scale_", "cuda").name == "b"  # no arguments: the first available
    assert [r[:2] for r in dispatch.report("iso_scale_", "cuda")] == [
        ("a", False),
        ("b", True),
        ("c", True),
        ("d", True),
    ]


@pytest.mark.parametrize("key", sorted(dispatch.TABLES), ids=lambda k: f"{k[0]}-{k[1]}")
def test_backends_names_what_select_picks(key):
    op, device = key
    assert ik.backends()[f"{op}[{device}]"].startswith(dispatch.select(op, device).name)


def test_the_cpu_op_runs_what_the_table_selects(monkeypatch):
    """The registered implementation runs select()'s candidate (a recording stand-in here)."""
    log = []
    monkeypatch.setitem(
        dispatch.TABLES, ("nesterov_outer_", "cpu"), [_fake("first", False, log=log), _fake("second", True, log=log)]
    )
    monkeypatch.setitem(dispatch.TABLES, ("iso_scale_", "cpu"), [_fake("only", True, log=log)])
    p = [torch.zeros(3)]
    torch.ops.isoloco.nesterov_outer_(p, [torch.zeros(3)], [torch.ones(3)], 0.5, 0.9, None)
    x = torch.randn(2, 3)
    torch.ops.isoloco.iso_scale_(x, x.clone())
    assert log == ["second", "only"]


@pytest.mark.parametrize(
    "edit,exc,match",
    [
        pytest.param(
            lambda a: a["bufs"].__setitem__(0, torch.zeros(3, dtype=torch.float64)),
            TypeError,
            r"buf 0 is torch.float64; it must be float32 or the param's dtype \(torch.float16\)",
            id="buf-dtype",
        ),
        pytest.param(
            lambda a: a.__setitem__("amax", [1.0, 1.0]),
            ValueError,
            r"amax must have 3 entries per tensor \(3: params, bufs, updates\), got 2",
            id="amax-length",
        ),
        pytest.param(lambda a: a.__setitem__("lr", float("nan")), ValueError, "finite", id="nan-lr"),
        pytest.param(lambda a: a["updates"].__setitem__(0, torch.ones(4)), ValueError, "same shape", id="shape"),
    ],
)
def test_nesterov_arguments_are_refused_alike_on_every_table(edit, exc, match, monkeypatch):
    """The op's one check runs before select(): every backend (recording stand-ins here) sees only
    input it accepts, and what is refused is refused on every device's table the same way."""
    log = []
    for key in [k for k in dispatch.TABLES if k[0] == "nesterov_outer_"]:
        monkeypatch.setitem(dispatch.TABLES, key, [_fake("any", True, log=log)])
    args = dict(
        params=[torch.zeros(3, dtype=torch.float16)],
        bufs=[torch.zeros(3)],
        updates=[torch.ones(3, dtype=torch.float16)],
        lr=0.5,
        momentum=0.9,
        amax=None,
    )
    edit(args)
    before = [t.clone() for t in args["params"] + args["bufs"]]
    with pytest.raises(exc, match=match):
        torch.ops.isoloco.nesterov_outer_(**args)
    assert log == [] and all(torch.equal(a, b) for a, b in zip(args["params"] + args["bufs"], before))


def test_every_table_has_a_choice_to_make():
    """A table per op that dispatches: each ends with torch and lists another backend before it on CUDA;
    nothing chooses among one candidate (the polar GEMMs run on torch, with no table)."""
    assert sorted(dispatch.TABLES) == [
        ("iso_scale_", "cpu"),
        ("iso_scale_", "cuda"),
        ("nesterov_outer_", "cpu"),
        ("nesterov_outer_", "cuda"),
    ]
    for (op, device), cands in dispatch.TABLES.items():
        assert cands[-1].name.startswith("torch"), (op, device)
        assert device == "cpu" or len(cands) > 1, (op, device)


# ---------------------------------------------------------------------------------------------
# The csrc kernels (extension and CuPy) only where they can run: sm_80 or newer (bfloat16
# conversions), and for the extension a cubin or PTX the device loads. Device properties mocked.

from isoloco_kernels.dispatch import _cupy, _ext  # noqa: E402

DEFAULT_BUILD = ("sm_80", "sm_90", "compute_90")  # TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX"


@pytest.mark.parametrize(
    "capability,archs,runs",
    [
        pytest.param((8, 0), DEFAULT_BUILD, True, id="A100"),
        pytest.param((8, 6), DEFAULT_BUILD, True, id="sm86-runs-the-sm80-cubin"),
        pytest.param((9, 0), DEFAULT_BUILD, True, id="H100"),
        pytest.param((10, 0), DEFAULT_BUILD, True, id="B200-through-PTX"),
        pytest.param((12, 0), DEFAULT_BUILD, True, id="sm120-through-PTX"),
        pytest.param((10, 0), ("sm_80", "sm_90"), False, id="B200-without-PTX"),
        pytest.param((12, 0), ("sm_80", "sm_90"), False, id="sm120-without-PTX"),
        pytest.param((8, 0), ("sm_90", "compute_90"), False, id="older-than-every-target"),
        pytest.param((9, 0), ("sm_90a",), True, id="arch-specific-on-its-own"),
        pytest.param((10, 0), ("sm_90a",), False, id="arch-specific-elsewhere"),
        pytest.param((10, 3), ("sm_100",), True, id="sm103-runs-the-sm100-cubin"),
    ],
)
def test_runs_on_reads_cubins_and_ptx(capability, archs, runs):
    assert _ext.runs_on(capability, archs) is runs


class _CudaStandIn:
    """Just enough of a CUDA tensor for supports(): a device (no GPU here)."""

    is_cuda = True

    def __init__(self, index=0):
        self.device = torch.device("cuda", index)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A visible GPU of a chosen capability, a loaded extension built for DEFAULT_BUILD (or
    `archs`), CuPy importable: returns a setter `gpu(capability, archs=DEFAULT_BUILD)`."""

    def gpu(capability, archs=DEFAULT_BUILD):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(_ext, "LOADED", True)
        monkeypatch.setattr(_ext, "has_kernel", lambda op, key="CUDA": True)
        monkeypatch.setattr(_ext, "built_archs", lambda: archs)
        monkeypatch.setattr(_cupy, "available", lambda: (True, "cupy (stand-in)"))

    return gpu


@pytest.mark.parametrize("op", ["iso_scale_", "nesterov_outer_"])
def test_csrc_backends_say_no_below_sm80(fake_gpu, op):
    fake_gpu((7, 5))
    rows = {name: (ok, why) for name, ok, why in dispatch.report(op, "cuda")}
    for name in ("csrc (compiled extension)", "csrc through CuPy/NVRTC"):
        ok, why = rows[name]
        assert not ok and "7.5 is below 8.0" in why and "bfloat16" in why


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)], ids=str)
def test_csrc_backends_serve_sm80_and_newer(fake_gpu, capability):
    fake_gpu(capability)
    assert dispatch.select("iso_scale_", "cuda").name == "csrc (compiled extension)"
    x = _CudaStandIn()
    assert dispatch.select("iso_scale_", "cuda", x, x).name == "csrc (compiled extension)"


def test_extension_without_a_kernel_image_falls_back_instead_of_raising(fake_gpu):
    """Built for sm_80/sm_90 without PTX, on a B200: the extension is skipped with the reason,
    the same kernels through CuPy (NVRTC compiles for the device) serve."""
    fake_gpu((10, 0), archs=("sm_80", "sm_90"))
    rows = {name: (ok, why) for name, ok, why in dispatch.report("iso_scale_", "cuda")}
    ok, why = rows["csrc (compiled extension)"]
    assert not ok and "no kernel image for compute capability 10.0" in why
    x = _CudaStandIn()
    assert dispatch.select("iso_scale_", "cuda", x, x).name == "csrc through CuPy/NVRTC"
    assert dispatch.select("nesterov_outer_", "cuda", [x], [x], [x], 0.1, 0.9).name == "csrc through CuPy/NVRTC"


def test_supports_checks_the_tensors_own_device(fake_gpu, monkeypatch):
    """The device of the call decides (cuda:1 an sm_75 next to an sm_90 current device)."""
    fake_gpu((9, 0))
    caps = {0: (9, 0), 1: (7, 5)}
    monkeypatch.setattr(
        torch.cuda,
        "get_device_capability",
        lambda device=None: caps[torch.device(device).index if not isinstance(device, int) else device],
    )
    x0, x1 = _CudaStandIn(0), _CudaStandIn(1)
    assert dispatch.select("iso_scale_", "cuda", x0, x0).name == "csrc (compiled extension)"
    assert dispatch.select("iso_scale_", "cuda", x1, x1).name in (
        "triton",
        "torch",
    )  # triton: not under the interpreter


# ---------------------------------------------------------------------------------------------
# CUDA graphs: the ops that sync with the host or launch from host-built tables are tagged.

HOST_BOUND_OPS = ["iso_flatten_", "nesterov_outer_", "csrc_nesterov_outer_"]


@pytest.mark.skipif(
    not hasattr(torch.Tag, "cudagraph_unsafe"), reason=f"torch {torch.__version__} has no cudagraph_unsafe tag"
)
@pytest.mark.parametrize("op", HOST_BOUND_OPS)
def test_host_bound_ops_are_tagged_cudagraph_unsafe(op):
    assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.isoloco, op).default.tags


@pytest.mark.skipif(
    not hasattr(torch.Tag, "cudagraph_unsafe"), reason=f"torch {torch.__version__} has no cudagraph_unsafe tag"
)
def test_iso_scale_stays_capturable():
    """The epilogue alone neither syncs nor bakes host tables: no tag, graphs may hold it."""
    assert torch.Tag.cudagraph_unsafe not in torch.ops.isoloco.iso_scale_.default.tags
