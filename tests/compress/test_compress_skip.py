"""The spec's `skip` rule: which params stay in full precision. Its grammar (refused by name), the predicate by
shape and by name, the per-tensor functions refusing a rule they cannot apply, MergeLoCo applying it (the kept
params in full precision, the rest as without the rule), and the bytes of a model with the skipped params counted
in their own dtype. The sharded route: tests/distributed/test_compress_skip_tracking_sharded.py."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from isoloco_kernels import MergeLoCo
from isoloco_kernels.compress import (
    FORMATS,
    STAT_FORMATS,
    Compression,
    Packed,
    allreduce_bytes,
    bytes_of,
    compress,
    exchange_bytes,
    model_exchange_bytes,
    model_residual_bytes,
    parse,
    quantize,
    residual_bytes,
    skip_mask,
)
from isoloco_kernels.train.model import PRESETS, ByteLM


def _tiny(preset="tiny"):
    return [(n, tuple(p.shape)) for n, p in ByteLM(PRESETS[preset]).named_parameters()]


def test_every_spec_compresses_every_param_unless_it_says_skip():
    """The default is "none" for every format, the statistical ones included: the specs of before (and their
    cli strings, state-dict fields aside) are unchanged."""
    for fmt in list(FORMATS) + list(STAT_FORMATS):
        s = Compression(fmt)
        assert s.skip == "none" and s.for_tensor((7,)) is s and not s.skips((128,)) and not s.skips((256, 128))
        assert ":skip" not in s.cli()
    assert parse("int4:128:0.95").cli() == "int4:128:0.95"
    assert dataclasses.asdict(Compression("int4"))["skip"] == "none"


def test_the_rule_is_normalized_and_bad_rules_are_refused_by_name():
    assert Compression("stat2", skip="vocab=256+vectors").skip == "vectors+vocab=256"
    assert (
        Compression("stat2", skip=" Vectors + vectors+vocab=50257+vocab=256 ").skip == "vectors+vocab=256+vocab=50257"
    )
    assert Compression("int2", skip="name=tok.+name=head.+vectors").skip == "vectors+name=head.+name=tok."
    assert Compression("int2", skip="NONE").skip == "none"
    assert Compression("int2", skip="vectors+name=Tok.").skip == "vectors+name=Tok."  # names keep their case
    for rule, err, msg in [
        ("vector", ValueError, r"unknown term 'vector'.*\['vectors', 'vocab=<size>', 'name=<prefix>'\]"),
        ("none+vectors", ValueError, "unknown term 'none'"),
        ("vectors+", ValueError, "unknown term ''"),
        ("vocab=0", ValueError, "vocab= takes a positive int"),
        ("vocab=x", ValueError, "vocab= takes a positive int"),
        ("vocab", ValueError, "unknown term 'vocab'"),
        ("name=", ValueError, "name= takes a non-empty param-name prefix"),
        ("vectors=1", ValueError, "unknown term 'vectors=1'"),
        (None, TypeError, "skip must be a string"),
        (1, TypeError, "skip must be a string"),
    ]:
        with pytest.raises(err, match=msg):
            Compression("stat2", skip=rule)
    with pytest.raises(ValueError, match="compression spec 'int4:128:skip=vocab': .*unknown term 'vocab'"):
        parse("int4:128:skip=vocab")


def test_parse_and_cli_carry_the_rule():
    s = parse("stat2:256:0.95:skip=vectors+vocab=256")
    assert s == Compression("stat2", 256, ef_beta=0.95, skip="vectors+vocab=256")
    assert s.cli() == "stat2:256:0.95:skip=vectors+vocab=256" and parse(s.cli()) == s
    t = Compression("int2", 64, "stochastic", 0.9, feedback="both", skip="vectors+name=tok.")
    assert t.cli() == "int2:64:0.9:stochastic:both:skip=vectors+name=tok." and parse(t.cli()) == t
    assert parse("stat4:1024:0.9:sigmas=3:skip=vectors").cli() == "stat4:1024:0.9:sigmas=3:skip=vectors"
    assert parse("int8", skip="vectors") == Compression(skip="vectors")


def test_the_predicate_by_shape_and_by_name():
    s = Compression("stat2", skip="vectors+vocab=256")
    assert s.skips(()) and s.skips((128,)) and s.skips((256,)) and s.skips(torch.Size([7]))
    assert s.skips((256, 128)) and s.skips((128, 256)) and s.skips((4, 256, 3))
    assert not s.skips((384, 128)) and not s.skips((128, 128))
    assert s.for_tensor((256, 128)) is None
    per = s.for_tensor((384, 128))
    assert per == dataclasses.replace(s, skip="none") and per.skip == "none"
    only_vocab = Compression("int2", skip="vocab=256")
    assert not only_vocab.skips((256,)) and only_vocab.skips((256, 8))  # 1-D params: only with "vectors"
    named = Compression("int2", skip="vectors+name=tok.+name=head.")
    assert named.skips((128,)) and named.skips((256, 128), "tok.weight") and named.skips((9, 9), "head.weight")
    assert not named.skips((256, 128), "blocks.0.qkv.weight")
    assert named.skips((5,), None)  # decided by shape before the names are needed
    with pytest.raises(
        ValueError, match=r"names params \(name=...\), but no name was given for the param of shape \(256, 128\)"
    ):
        named.skips((256, 128))


def test_skip_mask_on_the_loops_tiny_model():
    """tiny (vocab 256, d 128): "vectors+vocab=256" keeps the token embedding, the output head and the 5 norm
    gains, as the name rule does; the position table (64×128) is compressed. tiny-wide (d 256 = the vocabulary)
    is where the shape rule cannot tell: every matrix has a dimension 256, so every param is kept; the name rule
    still keeps the three it names."""
    names, shapes = zip(*_tiny())
    by_shape = skip_mask(Compression("stat2", skip="vectors+vocab=256"), shapes)
    by_name = skip_mask(Compression("stat2", skip="vectors+name=tok.+name=head."), shapes, names)
    kept = [n for n, k in zip(names, by_shape) if k]
    assert by_shape == by_name
    norms = [f"blocks.{b}.norm{k}.weight" for b in (0, 1) for k in (1, 2)]
    assert kept == ["tok.weight", *norms, "norm.weight", "head.weight"]
    assert sum(math.prod(s) for s, k in zip(shapes, by_shape) if k) == 2 * 256 * 128 + 5 * 128
    wide_names, wide = zip(*_tiny("tiny-wide"))
    assert all(skip_mask(Compression("stat2", skip="vectors+vocab=256"), wide))
    named = skip_mask(Compression("stat2", skip="vectors+name=tok.+name=head."), wide, wide_names)
    assert sum(1 for n, k in zip(wide_names, named) if k and n.endswith("weight") and "norm" not in n) == 2
    with pytest.raises(ValueError, match="no name was given"):
        skip_mask(Compression("stat2", skip="name=tok."), shapes)
    with pytest.raises(ValueError, match="as many"):
        skip_mask(Compression("stat2", skip="name=tok."), shapes, names[:-1])


def test_the_per_tensor_functions_refuse_a_rule_they_cannot_apply():
    """compress, quantize, bytes_of, exchange_bytes, residual_bytes and Packed.from_wire work on one tensor: with a
    skip rule they refuse, naming it (the routes apply the rule: they call them with `for_tensor`'s per-param
    spec), so a caller that does not apply it fails at once instead of sending every param compressed."""
    s = Compression("stat2", 256, ef_beta=0.9, skip="vectors")
    x = torch.randn(300)
    msg = "skip='vectors' keeps some params in full precision.*for_tensor"
    for call in (
        lambda: compress(x, None, s, step=0, tensor_id=0),
        lambda: quantize(x, s),
        lambda: bytes_of(s, 300),
        lambda: exchange_bytes(s, 300, 4),
        lambda: residual_bytes(s, 300, torch.float32),
        lambda: Packed.from_wire(torch.zeros(10, dtype=torch.uint8), s, 300),
    ):
        with pytest.raises(ValueError, match=msg):
            call()
    per = s.for_tensor((300, 1))
    assert bytes_of(per, 300) == bytes_of(Compression("stat2", 256), 300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mergeloco_sends_the_kept_params_in_full_and_the_rest_as_without_the_rule(dtype):
    """MergeLoCo(compress=...) applies the rule: a kept param's step is the plain mean's, θ − lr·(Σ_k Δ_k / K),
    summed in the compute dtype and rounded once (momentum 0, merge "mean": a float64 oracle to the dtype's
    rounding), with no residual; every other param is bit-equal to a run whose spec keeps nothing."""
    shapes, names = [(16, 8), (8,), (12, 256), (7, 5)], ["w", "norm.weight", "tok.weight", "v"]
    g = torch.Generator().manual_seed(4)
    init = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    deltas = [torch.randn(3, *s, generator=g).to(dtype) for s in shapes]
    kept = {1, 2}
    runs = {}
    for rule in ("vectors+vocab=256", "vectors+name=tok.", "none"):
        ps = [t.clone() for t in init]
        opt = MergeLoCo(list(zip(names, ps)), lr=0.7, momentum=0.0, merge="mean", compress=f"int4:32:0.9:skip={rule}")
        opt.step(deltas=deltas)
        runs[rule] = (ps, set(opt._residuals))
    for rule in ("vectors+vocab=256", "vectors+name=tok."):
        ps, residuals = runs[rule]
        assert residuals == {0, 3}  # the kept params keep none
        for i in range(len(shapes)):
            if i in kept:
                want = init[i].double() - 0.7 * deltas[i].double().mean(0)
                tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
                torch.testing.assert_close(ps[i].double(), want, rtol=tol, atol=tol)
                assert not torch.equal(ps[i], runs["none"][0][i])  # not sent compressed
            else:
                assert torch.equal(ps[i], runs["none"][0][i]), (rule, i)


def test_a_name_rule_without_names_is_refused_when_the_optimizer_is_built():
    ps = [torch.randn(16, 8), torch.randn(8)]
    with pytest.raises(ValueError, match=r"MergeLoCo: Compression.skip=.*no name was given.*named_parameters"):
        MergeLoCo(ps, compress="stat2:256:skip=name=tok.")
    MergeLoCo(ps, compress="stat2:256:skip=vectors")  # a rule by shape needs no names


def test_a_nan_in_a_kept_params_delta_is_refused_and_nothing_changes():
    ps = [torch.randn(16, 8), torch.randn(8)]
    before = [p.clone() for p in ps]
    opt = MergeLoCo(ps, lr=1.0, momentum=0.5, compress="stat2:256:0.95:skip=vectors")
    deltas = [torch.randn(2, *p.shape) for p in ps]
    deltas[1][1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"worker 1's Δ of param 1 .*NaN"):
        opt.step(deltas=deltas)
    assert all(torch.equal(p, q) for p, q in zip(ps, before)) and not any(opt.state.values()) and not opt._residuals
    assert opt.merged_steps == 0


def test_a_models_bytes_count_the_skipped_params_in_their_dtype():
    """model_exchange_bytes: exchange_bytes of each compressed param; a skipped one goes in its own dtype both
    ways (2·(W − 1)/W·itemsize per entry). On the tiny model, "vectors+vocab=256" (73,728 + 640 entries in
    fp32 of 467,584) lifts stat2:256 from 0.0781× to 0.2086× of an fp32 all-reduce, int2:128 to 0.2019×."""
    shapes = [(256, 128), (64, 128), (128,), (3, 5)]
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    s = Compression("stat2", 64, ef_beta=0.9, skip="vectors+vocab=256")
    per = dataclasses.replace(s, skip="none")
    for w in (1, 2, 3):
        want = 2 * (w - 1) / w * (4 * 256 * 128 + 2 * 128)
        want += exchange_bytes(per, 64 * 128, w, torch.bfloat16) + exchange_bytes(per, 15, w)
        assert model_exchange_bytes(s, shapes, w, dtypes) == pytest.approx(want, rel=1e-15)
    assert model_residual_bytes(s, shapes, dtypes) == 2 * 64 * 128 + 4 * 15  # kept ones keep no residual
    assert model_residual_bytes(s, shapes, dtypes, leg="owner") == 0  # the default placement
    assert model_exchange_bytes(per, shapes, 4, dtypes) == sum(
        exchange_bytes(per, math.prod(sh), 4, dt) for sh, dt in zip(shapes, dtypes)
    )
    names, tiny = zip(*_tiny())
    total = sum(math.prod(t) for t in tiny)
    for text, want in (
        ("stat2:256", 0.0781),
        ("stat2:256:skip=vectors", 0.0794),
        ("stat2:256:skip=vectors+vocab=256", 0.2086),
        ("int2:128:skip=vectors+vocab=256", 0.2019),
        ("stat4:1024:skip=vectors+vocab=256", 0.2623),
        ("int4:128:skip=vectors+vocab=256", 0.2555),
    ):
        got = model_exchange_bytes(parse(text), tiny, 4, names=names) / allreduce_bytes(total, 4)
        assert round(got, 4) == want, (text, got)
    with pytest.raises(ValueError, match="world must be"):
        model_exchange_bytes(s, shapes, 0)


def test_the_rule_is_applied_to_the_names_the_params_were_given_with():
    """The kept params are decided when a group is added: a state dict that brings other names does not move
    them; names that are not one str per param are refused, naming the group."""
    a, b = torch.randn(16, 8), torch.randn(16, 8)
    opt = MergeLoCo([("tok.weight", a), ("blocks.w", b)], lr=1.0, compress="int4:32:0.9:skip=name=tok.")
    assert [s is None for s in opt._specs] == [True, False]
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["param_names"] = ["module.tok.weight", "module.blocks.w"]
    opt.load_state_dict(sd)
    assert [s is None for s in opt._specs] == [True, False]
    opt.step(deltas=[torch.randn(2, 16, 8), torch.randn(2, 16, 8)])
    assert set(opt._residuals) == {1}
    with pytest.raises(ValueError, match=r"MergeLoCo: param group 0's param_names must be one str per param"):
        MergeLoCo([{"params": [a, b], "param_names": ["tok.weight"]}], compress="int4:32:skip=name=tok.")
    with pytest.raises(ValueError, match=r"param group 1's param_names must be one str per param"):
        MergeLoCo(
            [{"params": [a], "param_names": ["x"]}, {"params": [b], "param_names": [3]}],
            compress="int4:32:skip=name=tok.",
        )
    grow = MergeLoCo([("x", a)], compress="int4:32:skip=name=tok.")
    with pytest.raises(ValueError, match="param group 1's param_names"):
        grow.add_param_group({"params": [b], "param_names": [None]})
    assert len(grow.param_groups) == 1 and len(grow._specs) == 1  # the refused group taken back out
    grow.add_param_group({"params": [b], "param_names": ["tok.extra"]})
    assert [s is None for s in grow._specs] == [False, True]


def test_wire_bytes_refuses_names_that_do_not_match_the_params():
    from isoloco_kernels.distributed import sharded
    from isoloco_kernels.distributed.plan import plan_shards

    plan = plan_shards([(16, 8), (8,), (4, 4)], 2)
    spec = Compression("int4", 32, skip="name=tok.")
    with pytest.raises(ValueError, match="wire_bytes: 1 names for 3 params"):
        sharded.wire_bytes(plan, spec, ["tok.weight"])
    with pytest.raises(ValueError, match="wire_bytes: .*no name was given"):
        sharded.wire_bytes(plan, spec)
    full = sharded.wire_bytes(plan, Compression("int4", 32), ["a", "b", "c"])
    kept = sharded.wire_bytes(plan, spec, ["tok.weight", "b", "c"])
    assert kept["all_to_all"] > full["all_to_all"]


def test_the_rule_names_its_prefixes():
    assert Compression("int2", skip="vectors+name=tok.+name=head.").skip_prefixes == ("head.", "tok.")
    assert Compression("int2", skip="vectors+vocab=256").skip_prefixes == ()
