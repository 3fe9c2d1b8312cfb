"""The "merge" entry of MergeLoCo's state dict (outer/merge_state.py): a resume is bit for bit for every merge,
a checkpoint of another merge warns naming both, a malformed entry is refused and nothing loads."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import isoloco_kernels as ik
from tests.helpers import three_params, worker_deltas

MERGES = ["iso_c", "mean", "tsv", "iso_cts", "ties", "dare"]


K = 3


# -- 2. exact resume, and the checkpoint says which merge wrote it -----------------------------------


@pytest.mark.parametrize("merge_name", MERGES)
def test_resume_is_bit_exact(merge_name):
    def run(steps, opt, params, start=0):
        for s in range(start, steps):
            opt.step(deltas=worker_deltas(params, ("resume", s)))

    opts = {"sparsity": 0.5} if merge_name == "dare" else {}
    a = three_params()
    oa = ik.MergeLoCo(a, lr=0.9, momentum=0.8, merge=merge_name, merge_options=opts)
    run(4, oa, a)
    b = three_params()
    ob = ik.MergeLoCo(b, lr=0.9, momentum=0.8, merge=merge_name, merge_options=opts)
    run(2, ob, b)
    saved = pickle.loads(pickle.dumps(ob.state_dict()))  # through bytes, as torch.save would
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    oc = ik.MergeLoCo(c, lr=0.9, momentum=0.8, merge=merge_name, merge_options=opts)
    oc.load_state_dict(saved)
    run(4, oc, c, start=2)
    assert all(torch.equal(p, q) for p, q in zip(a, c)), "the resumed run left the uninterrupted one"
    assert oc.merged_steps == oa.merged_steps == 4


def test_a_checkpoint_of_another_merge_warns_naming_both():
    params = three_params()
    tsv = ik.MergeLoCo(params, merge="tsv")
    tsv.step(deltas=worker_deltas(params, "tsv"))
    ties = ik.MergeLoCo(params, merge="ties")
    with pytest.warns(UserWarning, match="written by merge='tsv'.*continues as merge='ties'"):
        ties.load_state_dict(tsv.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ik.MergeLoCo(params, merge="tsv").load_state_dict(tsv.state_dict())  # the same merge: silent


def test_a_malformed_merge_entry_is_refused_and_nothing_loads():
    params = three_params()
    opt = ik.MergeLoCo(params, merge="dare")
    opt.step(deltas=worker_deltas(params, "m"))
    sd = opt.state_dict()
    sd["merge"] = {"merge": "dare", "options": {}, "steps": 1.5}
    fresh = ik.MergeLoCo(params, merge="dare")
    with pytest.raises(ValueError, match="'merge' entry"):
        fresh.load_state_dict(sd)
    assert fresh.merged_steps == 0 and not fresh.state


def test_merge_entry_warnings_are_consistent():
    """DARE's default seed written out is the same merge (no warning); another merge's checkpoint loaded into
    IsoLoCo warns as MergeLoCo does; an AdamW dict is refused before any warning about its missing entry."""
    params = three_params()
    dare = ik.MergeLoCo(params, merge="dare")
    dare.step(deltas=worker_deltas(params, "dare-entry"))
    sd = dare.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ik.MergeLoCo(params, merge="dare", merge_options={"seed": 0}).load_state_dict(sd)
    with pytest.warns(UserWarning, match="written by merge='dare'; IsoLoCo continues as Iso-C of the mean"):
        ik.IsoLoCo(params).load_state_dict(sd)
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params)
    adamw.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="not an SGD-shaped state dict"):
            ik.MergeLoCo(params, merge="dare").load_state_dict(adamw.state_dict())
