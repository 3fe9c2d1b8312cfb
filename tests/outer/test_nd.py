"""Parameters with 3 or more dims in the outer step (outer/nd.py): named once at construction, flattened as
dim 0 × the rest with iso_nd=True, the plain DiLoCo update by default, refused for N-D DTensor params."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import isoloco_kernels as ik
from isoloco_kernels.outer.nd import NDParamWarning
from isoloco_kernels.reference import iso_flatten_ref, nesterov_ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- parameters with 3 or more dims -------------------------------------------------------------


def _conv_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 1), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))


@pytest.mark.usefixtures("one_thread")
def test_nd_params_are_named_once_at_construction():
    net = _conv_net()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ik.IsoLoCo(net.parameters())
    nd = [x for x in w if issubclass(x.category, NDParamWarning)]
    assert len(nd) == 1, [str(x.message) for x in w]
    msg = str(nd[0].message)
    assert nd[0].filename == __file__, "the warning points at the user's line"
    assert "2 param(s) with 3 or more dims" in msg and "shape (8, 3, 3, 3)" in msg and "iso_nd=True" in msg
    # no warning: the option taken, the N-D params in a group without Iso-C, or no N-D params at all
    convs = [p for p in net.parameters() if p.ndim > 2]
    rest = [p for p in net.parameters() if p.ndim <= 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error", NDParamWarning)
        ik.IsoLoCo(net.parameters(), iso_nd=True)
        ik.IsoLoCo([{"params": convs, "iso": False}, {"params": rest}])
        ik.IsoLoCo(rest)


def _step_and_compare(iso_nd: bool, momentum: float = 0.8):
    net = _conv_net()
    params = list(net.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NDParamWarning)
        opt = ik.IsoLoCo(params, lr=1.5, momentum=momentum, iso_nd=iso_nd, method="svd")
    before = [p.detach().clone() for p in params]
    for _ in range(2):  # the second step reads the momentum buffers
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        bufs = [opt.state[p].get("momentum_buffer", torch.zeros_like(p)).clone() for p in params]
        opt.step()
        for p, p0, b, g in zip(params, before, bufs, grads):
            if g.ndim == 2 or (iso_nd and g.ndim > 2):
                m = iso_flatten_ref(g.reshape(g.shape[0], -1)).reshape(g.shape)
            else:
                m = g.double()
            want, _ = nesterov_ref(p0, b, m, 1.5, momentum)
            assert torch.allclose(p.detach().double(), want, rtol=1e-5, atol=1e-5), (tuple(p.shape), iso_nd)
        before = [p.detach().clone() for p in params]
    return params


@pytest.mark.usefixtures("one_thread")
def test_iso_nd_flattens_each_nd_grad_as_dim0_by_the_rest():
    _step_and_compare(iso_nd=True)


@pytest.mark.usefixtures("one_thread")
def test_default_gives_nd_grads_the_plain_diloco_update():
    _step_and_compare(iso_nd=False)


@pytest.mark.usefixtures("one_thread")
def test_iso_nd_is_checked_and_survives_copies():
    with pytest.raises(ValueError, match="iso_nd must be a bool, got 'yes'"):
        ik.IsoLoCo(_conv_net().parameters(), iso_nd="yes")
    opt = ik.IsoLoCo(_conv_net().parameters(), iso_nd=True)
    assert copy.deepcopy(opt).iso_nd is True
    assert (
        opt.state_dict()["param_groups"][0].keys()
        == ik.IsoLoCo(nn.Linear(2, 2).parameters()).state_dict()["param_groups"][0].keys()
    ), "iso_nd stays out of the SGD-shaped state dict"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow  # a fresh interpreter with a process group
def test_iso_nd_is_refused_for_nd_dtensor_params_and_sharded_isoloco_warns():
    """One gloo rank in a process of its own (a default process group would leak into other tests)."""
    script = textwrap.dedent(
        """
        import os, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        import isoloco_kernels as ik
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        mesh = init_device_mesh("cpu", (1,))
        w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 2, 3, 3), mesh, [Shard(0)]))
        try:
            ik.IsoLoCo([w], iso_nd=True)
        except ValueError as e:
            print("REFUSED", e)
        ik.IsoLoCo([w])  # the default is fine: plain update for N-D
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ik.ShardedIsoLoCo([torch.nn.Parameter(torch.randn(4, 2, 3))])
        print("SHARDED", [f"{w.filename}: {w.message}" for w in caught])
        dist.destroy_process_group()
        """
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED IsoLoCo: iso_nd=True is not supported for DTensor params" in out.stdout, out.stdout
    sharded = out.stdout.split("SHARDED", 1)[1]
    assert "<string>: ShardedIsoLoCo: 1 param(s) with 3 or more dims (first: param 0 (shape (4, 2, 3)))" in sharded
