"""The reference training loop: every mode trains, runs are reproducible and paired, bad input is
refused before training, and the CLI writes its JSON and PNG."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from isoloco_kernels.train import MODES, Comm, Setup, TrainConfig, load_corpus, run_mode, tokenizer
from isoloco_kernels.train.capture import load_pseudo_gradients
from isoloco_kernels.train.cli import main
from isoloco_kernels.train.data import Batches, check_fits, heldout_windows, worker_seed
from isoloco_kernels.train.divergence import DivergenceMeter
from isoloco_kernels.train.loop import DEFAULT_MODES
from isoloco_kernels.train.model import ByteLM, ModelConfig
from tests.helpers import TOL, rel_err

SMALL = dict(model="tiny", seq_len=16, workers=2, inner_steps=3, rounds=2, batch=2, warmup=1, eval_windows=8)
CLI_SMALL = "-K 2 -H 2 -R 2 --batch 2 --seq-len 16 --eval-windows 8 --max-bytes 60000 --quiet --threads 1".split()


pytestmark = [
    pytest.mark.slow,  # trains the reference loop
    pytest.mark.usefixtures("one_thread"),  # small computations (tests/conftest.py)
]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=60_000)


@pytest.fixture(scope="module")
def setup(corpus):
    return Setup(TrainConfig(**SMALL), corpus)


def test_corpus_is_stdlib_text_split_by_document(corpus):
    again = load_corpus(max_bytes=60_000)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.heldout, again.heldout)
    assert 0 < corpus.n_heldout_docs < corpus.n_docs
    assert corpus.heldout.numel() > 0 and corpus.train.numel() > corpus.heldout.numel()
    text = bytes(corpus.train[:20000].tolist()).decode("utf-8")
    assert "def " in text or "import " in text


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_trains(setup, mode):
    r = run_mode(mode, setup)
    cfg = setup.cfg
    assert "diverged" not in r
    assert len(r["heldout_loss"]) == cfg.rounds + 1
    assert r["tokens"] == [i * cfg.workers * cfg.inner_steps * cfg.batch * 16 for i in range(cfg.rounds + 1)]
    assert all(math.isfinite(x) for x in r["heldout_loss"])
    assert abs(r["heldout_loss"][0] - math.log(256)) < 0.1  # init is near uniform over bytes
    assert r["final_loss"] == r["heldout_loss"][-1] < r["heldout_loss"][0] - 0.05


def test_same_seed_same_numbers_other_seed_other_numbers(corpus, setup):
    a = run_mode("isoloco", setup)["heldout_loss"]
    b = run_mode("isoloco", Setup(TrainConfig(**SMALL), corpus))["heldout_loss"]
    c = run_mode("isoloco", Setup(TrainConfig(**SMALL, seed=1), corpus))["heldout_loss"]
    assert a == b
    assert a[1:] != c[1:]


def test_worker_streams_depend_on_seed_and_worker_only(corpus):
    s2 = Setup(TrainConfig(**SMALL), corpus)
    x0, _ = s2.batches()[0].next()
    x0_again, _ = Setup(TrainConfig(**{**SMALL, "rounds": 5}), corpus).batches()[0].next()
    x1, _ = s2.batches()[1].next()
    assert torch.equal(x0, x0_again)
    assert not torch.equal(x0, x1)
    assert worker_seed(0, 0) != worker_seed(1, 0)


def test_batches_are_next_byte_windows(corpus):
    x, y = Batches(corpus.train, 3, 16, seed=5).next()
    assert x.shape == y.shape == (3, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    hx, hy = heldout_windows(corpus.heldout, 16, 8)
    assert hx.shape == (8, 16) and torch.equal(hx[:, 1:], hy[:, :-1])


def test_one_worker_diloco_step_lands_on_the_ddp_model(corpus):
    # K=1 and outer lr 1/(1+μ): Nesterov's first step is θ − Δ = the worker's weights, and the
    # worker saw exactly ddp's batches with ddp's schedule. Checks the sign of Δ, the pairing and
    # that the outer step happens once per round.
    cfg = TrainConfig(**{**SMALL, "workers": 1, "rounds": 1, "outer_lr": {"diloco": 1 / 1.9}})
    s = Setup(cfg, corpus)
    ddp, dil = run_mode("ddp", s), run_mode("diloco", s)
    assert dil["heldout_loss"][0] == ddp["heldout_loss"][0]
    assert dil["final_loss"] == pytest.approx(ddp["final_loss"], abs=1e-5)
    assert dil["final_loss"] < dil["heldout_loss"][0] - 0.05


def test_comm_average_divides_the_sum_by_all_workers():
    t = [torch.tensor([3.0, 6.0]), torch.tensor([[9.0]])]
    Comm(3).average_(t)
    assert t[0].tolist() == [1.0, 2.0] and t[1].item() == 3.0


def test_nonfinite_loss_is_reported_not_hidden(corpus):
    s = Setup(TrainConfig(**SMALL), corpus)
    s.init_state = {k: v.clone() for k, v in s.init_state.items()}
    s.init_state["blocks.0.up.weight"][0, 0] = float("nan")
    for mode in ("ddp", "isoloco"):
        r = run_mode(mode, s)
        assert r["final_loss"] is None
        assert "loss is nan" in r["diverged"]


@pytest.mark.parametrize(
    "field, value, msg",
    [
        ("workers", 0, "workers must be an integer ≥ 1, got 0"),
        ("inner_steps", 0, "inner_steps must be an integer ≥ 1, got 0"),
        ("rounds", -1, "rounds must be"),
        ("batch", 0, "batch must be"),
        ("outer_lr", {"ddp": 1.0}, "outer lr given for 'ddp'"),
        ("outer_lr", {"isoloco": float("nan")}, "outer lr for isoloco must be a finite number"),
        ("model", "huge", "model must be one of"),
        ("iso_skip", ("bogus.",), "iso_skip 'bogus.' matches no matrix of the model; its matrices: tok.weight"),
        ("iso_skip", ("",), "iso_skip entries must be non-empty"),
        ("iso_skip", "tok.", "iso_skip must be a tuple of parameter-name prefixes, got the string 'tok.'"),
        ("iso_skip_outer", (0.35, 0.9), "iso_skip_outer is set but iso_skip names no parameters"),
    ],
)
def test_bad_settings_are_refused(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig(**{**SMALL, field: value}).validate()


@pytest.mark.parametrize("value", [(0.0, 0.9), (0.35, 1.0), (float("nan"), 0.5), (0.35,), (True, 0.5), "0.35,0.9"])
def test_bad_iso_skip_outer_is_refused(value):
    with pytest.raises(ValueError, match=r"iso_skip_outer must be \(lr > 0, 0 ≤ momentum < 1\)"):
        TrainConfig(**SMALL, iso_skip=("tok.",), iso_skip_outer=value).validate()


def test_batch_or_sequence_larger_than_data(corpus):
    shard = corpus.train.numel() // 2
    with pytest.raises(ValueError, match=r"larger than each of the 2 workers' data shard"):
        check_fits(corpus, 2, shard // 17 + 1, 16)
    with pytest.raises(ValueError, match=r"longer than each half of the held-out data"):
        check_fits(corpus, 1, 1, corpus.heldout.numel())


def test_bad_data_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 40)
    with pytest.raises(ValueError, match="blob.bin is not UTF-8 text"):
        load_corpus(tmp_path / "blob.bin")
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="holds no text: its 0 files are empty"):
        load_corpus(tmp_path / "d")
    (tmp_path / "d" / "a.bin").write_bytes(b"\x00\xff" * 100)
    with pytest.raises(ValueError, match="holds no text: its 1 files are binary"):
        load_corpus(tmp_path / "d")


def test_text_file_and_folder(tmp_path, corpus):
    text = bytes(corpus.train[:100_000].tolist())
    f = tmp_path / "t.txt"
    f.write_bytes(text)
    c = load_corpus(f)
    assert c.train.numel() + c.heldout.numel() > len(text) * 0.99 and c.heldout.numel() > 0
    d = tmp_path / "folder"
    d.mkdir()
    for i in range(12):
        (d / f"part{i}.txt").write_bytes(text[i * 5000 : (i + 1) * 5000])
    (d / "skip.bin").write_bytes(b"\0" * 10)
    c = load_corpus(d)
    assert c.n_docs == 12 and c.train.numel() > 0 and c.heldout.numel() > 0
    (tmp_path / "short.txt").write_text("print('hello')\n" * 20)
    with pytest.raises(ValueError, match="too little to split"):
        load_corpus(tmp_path / "short.txt")


@pytest.mark.parametrize(
    "args, msg",
    [
        (["-K", "0"], "workers must be an integer ≥ 1, got 0"),
        (["-H", "0"], "inner_steps must be an integer ≥ 1, got 0"),
        (["--data", "/nonexistent/corpus"], "does not exist"),
        (["--batch", "100000"], "larger than each of the 2 workers' data shard"),
        (["--sweep", "workers=2,0"], "values must be integers ≥ 1"),
        (["--outer-lr", "diloco=fast"], "--outer-lr takes a number"),
        (["--mode", "adam"], "unknown mode"),
        (["--iso-method", "bogus"], "iso_method must be one of"),
        (["--mode", "ddp", "--iso-method", "bogus"], "iso_method must be one of"),
        (["--device", "tpu"], "device must be cpu, cuda or cuda:N, got 'tpu'"),
        (["--device", "meta"], "device must be cpu, cuda or cuda:N, got 'meta'"),
        (["--vocab", "100"], "--vocab takes bytes, 256 or an integer in 257..262144"),
        (["--init", "xavier"], "invalid choice: 'xavier'"),
        (["--iso-skip", "norm."], "iso_skip 'norm.' matches no matrix of the model"),
        (["--iso-skip", "tok.", "--iso-skip-outer", "0.35"], "takes LR,MOMENTUM"),
        (["--save-pseudo-gradients", "cap", "--save-rounds", "5"], "round 5 is outside 1..2"),
    ],
)
def test_cli_refuses_bad_input_before_training(tmp_path, capsys, args, msg):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(CLI_SMALL + ["--out", str(out)] + args)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
    assert not out.exists()


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(CLI_SMALL + ["--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["modes"]) == set(DEFAULT_MODES)
    assert res["config"]["workers"] == 2 and res["config"]["inner_steps"] == 2
    assert res["wall_s"] > 0 and res["params"] > 0
    init = res["modes"]["ddp"]["heldout_loss"][0]
    for m, r in res["modes"].items():
        assert len(r["heldout_loss"]) == 3 and r["heldout_loss"][0] == init, m
        assert r["final_loss"] == r["heldout_loss"][-1] < init, m
    assert res["modes"]["isoloco"]["outer_lr"] == 1.8 and res["modes"]["diloco"]["outer_momentum"] == 0.9
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert all(m in table for m in DEFAULT_MODES) and "final held-out loss" in table


def test_cli_sweep_and_outer_lr_override(tmp_path):
    out = tmp_path / "sweep"
    args = [*CLI_SMALL, "--out", str(out)] + "--mode diloco,isoloco --sweep workers=1,3 --outer-lr isoloco=1.2".split()
    args.append("--tie-embeddings")
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["sweep"]["param"] == "workers" and res["sweep"]["values"] == [1, 3]
    assert res["config"]["model_config"]["tie_embeddings"] is True
    runs = res["sweep"]["runs"]
    assert [r["config"]["workers"] for r in runs] == [1, 3]
    for r in runs:
        assert set(r["modes"]) == {"diloco", "isoloco"}
        assert r["modes"]["isoloco"]["outer_lr"] == 1.2 and r["modes"]["diloco"]["outer_lr"] == 0.7
    # 3 workers see 3x the tokens of 1 per round
    assert runs[1]["modes"]["diloco"]["tokens"][1] == 3 * runs[0]["modes"]["diloco"]["tokens"][1]
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("where", ["out", "under"])
def test_cli_out_naming_a_file_is_refused_before_training(tmp_path, capsys, where):
    f = tmp_path / "results.txt"
    f.write_text("not a folder")
    out = f if where == "out" else f / "run"
    with pytest.raises(SystemExit) as e:
        main(CLI_SMALL + ["--out", str(out)])
    assert e.value.code == 2
    assert "a file, not a folder" in capsys.readouterr().err
    assert f.read_text() == "not a folder"


def test_utf8_file_cut_mid_character_is_text(tmp_path):
    # 2-byte characters throughout: an odd --max-bytes cuts the last one in two
    f = tmp_path / "accents.txt"
    f.write_text("déjà vu — naïve café, smörgåsbord\n" * 2000, encoding="utf-8")
    raw = f.read_bytes()
    cut = next(n for n in range(40_001, 40_010) if (raw[n] & 0xC0) == 0x80)  # n falls inside a character
    c = load_corpus(f, max_bytes=cut)
    text = bytes(c.train.tolist()).decode("utf-8") + bytes(c.heldout.tolist()).decode("utf-8")
    # the streams hold the first cut−1 bytes (the broken character dropped) plus the "\n" joins
    assert c.train.numel() + c.heldout.numel() - (c.n_docs - 2) == cut - 1
    assert "smörgåsbord" in text
    # a folder whose byte cap falls inside a character keeps valid UTF-8 too
    d = tmp_path / "folder"
    d.mkdir()
    for i in range(12):
        (d / f"p{i}.txt").write_bytes(raw[: 5000 + i])
    c = load_corpus(d, max_bytes=cut)
    bytes(c.train.tolist()).decode("utf-8")
    bytes(c.heldout.tolist()).decode("utf-8")


def test_divergence_meter_matches_pairwise_brute_force():
    torch.manual_seed(0)
    model = ByteLM(ModelConfig(d_model=16, n_layers=2, n_heads=2, seq_len=8))
    params = list(model.parameters())
    K = 3
    common = [torch.randn_like(p) for p in params]
    deltas = [[c + 0.7 * torch.randn_like(c) for c in common] for _ in range(K)]
    meter = DivergenceMeter(model)
    meter.start_round()
    for d in deltas:
        meter.add_worker(d)
    mean = [sum(ds) / K for ds in zip(*deltas)]
    res = meter.finish(Comm(K), mean)
    for g, idx in meter.groups.items():
        flat = [torch.cat([d[i].flatten() for i in idx]).double() for d in deltas]
        cos = [
            torch.nn.functional.cosine_similarity(flat[i], flat[j], dim=0) for i in range(K) for j in range(i + 1, K)
        ]
        assert res["cosine"][g] == pytest.approx(float(sum(cos) / len(cos)), rel=1e-5), g
        shrink = (sum(flat) / K).norm() / (sum(f.norm() for f in flat) / K)
        assert res["shrinkage"][g] == pytest.approx(float(shrink), rel=1e-5), g
    s = torch.linalg.svdvals(mean[meter.groups["head"][0]].double())
    spec = res["spectrum"]["head.weight"]
    assert spec["top_over_mean"] == pytest.approx(float(s[0] / s.mean()), rel=1e-9)
    assert spec["cond"] == pytest.approx(float(s[0] / s[-1]), rel=1e-9)
    assert 1 <= spec["erank"] <= min(mean[meter.groups["head"][0]].shape)


def test_bpe_vocab_trains_caches_and_reports_nats_per_byte(corpus, tmp_path):
    cfg = TrainConfig(**{**SMALL, "vocab": 300})
    s = Setup(cfg, corpus, cache_dir=tmp_path)
    assert s.corpus.vocab == 300 and s.corpus.train.dtype == torch.int32
    assert int(s.corpus.train.max()) < 300 and s.corpus.train.numel() < corpus.train.numel()
    # every token stands for its bytes: the streams still hold exactly the corpus bytes
    assert s.corpus.token_bytes[s.corpus.train.long()].sum() == corpus.train.numel()
    assert s.corpus.token_bytes[s.corpus.heldout.long()].sum() == corpus.heldout.numel()
    assert len(list(tmp_path.glob("bpe300-*.json"))) == 1
    r = run_mode("isoloco", s)
    # near-uniform init: log(300) nats per token, spread over the bytes the targets stand for
    per_byte = math.log(300) * s.hy.numel() / s.heldout_bytes
    assert abs(r["heldout_loss"][0] - per_byte) < 0.1
    assert r["final_loss"] < r["heldout_loss"][0] - 0.05


def test_cli_vocab_and_torch_init(tmp_path):
    out = tmp_path / "bpe"
    args = CLI_SMALL + ["--out", str(out), "--mode", "ddp,diloco", "--vocab", "300", "--init", "torch"]
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["vocab"] == 300 and res["config"]["init"] == "torch"
    assert res["data"]["vocab"] == 300 and res["data"]["tokenizer"]["loaded_from_cache"] is False
    assert res["data"]["train_tokens"] < res["data"]["train_bytes"]
    tokenizer._MEMO.clear()  # as a new process would start
    assert main(args) == 0  # the second run loads the tokenizer trained by the first
    again = json.loads((out / "results.json").read_text())
    assert again["data"]["tokenizer"]["loaded_from_cache"] is True
    assert again["modes"]["diloco"]["heldout_loss"] == res["modes"]["diloco"]["heldout_loss"]


def test_iso_skip_keeps_the_named_matrices_out_of_iso_c():
    from isoloco_kernels.reference import iso_flatten_ref
    from isoloco_kernels.train.loop import outer_optimizer, outer_params

    cfg = TrainConfig(**SMALL, iso_skip=("tok.", "head."))
    cfg.validate()
    torch.manual_seed(0)
    model = ByteLM(cfg.model_config())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    names, params = zip(*model.named_parameters())
    assert outer_params("diloco", names, params, cfg) == list(params)  # SGD modes: no groups
    opt = outer_optimizer("isoloco", outer_params("isoloco", names, params, cfg), cfg)
    opt.step()
    lr, mu = cfg.outer("isoloco")
    for n, p in model.named_parameters():  # first step: buf = M, p ← p − lr·(1 + μ)·M
        iso = p.ndim == 2 and not n.startswith(("tok.", "head."))
        m = iso_flatten_ref(grads[n]) if iso else grads[n].double()
        tol = TOL[("exact" if iso else "update", torch.float32)]
        assert rel_err(before[n] - p.detach(), lr * (1 + mu) * m) < tol, n
    # their own outer step: lr 0.35, μ 0.9 on the unflattened matrices, the mode's on the others
    own = replace(cfg, iso_skip_outer=(0.35, 0.9))
    own.validate()
    groups = outer_params("isoloco", names, params, own)
    assert (groups[1]["lr"], groups[1]["momentum"]) == (0.35, 0.9) and "lr" not in groups[0]
    opt = outer_optimizer("isoloco", groups, own)
    assert [(g["lr"], g["momentum"], g["iso"]) for g in opt.param_groups] == [(lr, mu, True), (0.35, 0.9, False)]
    # and through the loop: a run with the embedding and head unflattened trains, differently
    a = run_mode("isoloco", Setup(replace(cfg, iso_skip=()), load_corpus(max_bytes=60_000)))
    b = run_mode("isoloco", Setup(cfg, load_corpus(max_bytes=60_000)))
    assert math.isfinite(b["final_loss"]) and b["final_loss"] < b["heldout_loss"][0]
    assert a["heldout_loss"][0] == b["heldout_loss"][0] and a["final_loss"] != b["final_loss"]


def test_init_choices_differ_in_scale():
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=2, seq_len=16)
    torch.manual_seed(0)
    g = ByteLM(cfg).requires_grad_(False)
    torch.manual_seed(0)
    t = ByteLM(replace(cfg, init="torch")).requires_grad_(False)
    assert g.tok.weight.std() == pytest.approx(0.02, rel=0.1)
    assert t.tok.weight.std() == pytest.approx(1.0, rel=0.1)  # nn.Embedding's N(0, 1)
    bound = 1 / math.sqrt(64)  # nn.Linear's Kaiming-uniform: U(−1/sqrt(fan_in), 1/sqrt(fan_in))
    w = t.blocks[0].up.weight
    assert float(w.abs().max()) <= bound and w.std() == pytest.approx(bound / math.sqrt(3), rel=0.1)
    assert g.blocks[0].proj.weight.std() == pytest.approx(0.02 / 2, rel=0.15)  # 0.02/sqrt(2·layers)


def test_cli_saves_pseudo_gradients_and_records_divergence(tmp_path):
    out, cap = tmp_path / "run", tmp_path / "cap"
    args = [*CLI_SMALL, "--out", str(out), "--save-pseudo-gradients", str(cap)]
    args += "--mode ddp,isoloco,avg --save-rounds all --save-dtype float16".split()
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert "divergence" not in res["modes"]["ddp"]
    saved = load_pseudo_gradients(cap)
    assert [(b["run"], b["round"]) for b in saved] == [("avg", 1), ("avg", 2), ("isoloco", 1), ("isoloco", 2)]
    names = [n for n, _ in ByteLM(TrainConfig(**SMALL).model_config()).named_parameters()]
    for b in saved:
        assert list(b["delta"]) == names and all(t.dtype == torch.float16 for t in b["delta"].values())
        div = res["modes"][b["mode"]]["divergence"][b["round"] - 1]
        norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in b["delta"].values()))
        assert norm == pytest.approx(div["norm"]["all"], rel=1e-3)
        assert b["cond"]["head.weight"] == pytest.approx(div["spectrum"]["head.weight"]["cond"], rel=1e-9)
    for m in ("isoloco", "avg"):
        rounds = res["modes"][m]["divergence"]
        assert [d["round"] for d in rounds] == [1, 2]
        for d in rounds:
            for g in ("all", "embedding", "head", "middle"):
                assert -1 <= d["cosine"][g] <= 1 and 0 < d["shrinkage"][g] <= 1
    # avg is θ ← mean_k θ_k: after round 1 the global model is the workers' mean
    assert res["modes"]["avg"]["outer_lr"] == 1.0 and res["modes"]["avg"]["outer_momentum"] == 0.0


def test_one_worker_has_no_pairs_and_no_shrinkage(corpus):
    r = run_mode("diloco", Setup(TrainConfig(**{**SMALL, "workers": 1}), corpus))
    for d in r["divergence"]:
        assert d["cosine"]["all"] is None
        assert d["shrinkage"]["all"] == pytest.approx(1.0, rel=1e-6)


def test_runs_without_the_train_extra(tmp_path):
    """The package and a byte-level run need none of tqdm, matplotlib, tokenizers; --vocab says why not."""
    code = f"""
import sys
for name in ("tqdm", "matplotlib", "tokenizers"):
    sys.modules[name] = None  # any import of them raises ImportError
import isoloco_kernels, isoloco_kernels.train
from isoloco_kernels.train.cli import main
args = {CLI_SMALL!r} + ["--mode", "diloco", "--out", {str(tmp_path / "run")!r}]
assert main(args) == 0
try:
    main(args + ["--vocab", "300"])
except SystemExit as e:
    assert e.code == 2
"""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "no PNG: matplotlib is not installed" in p.stdout
    assert 'vocab 300 needs the `tokenizers` package: pip install -e ".[train]"' in p.stderr
    assert (tmp_path / "run" / "results.json").exists() and not (tmp_path / "run" / "loss.png").exists()


# ----------------------------------------------------------------------------------------------
# selection and test splits, Muon inner steps, outer momentum, the torch init's position table


def test_selection_and_test_splits_are_disjoint_halves(corpus, setup):
    from isoloco_kernels.train.data import heldout_splits

    half = corpus.heldout.numel() // 2
    (sx, sy), (tx, ty) = heldout_splits(corpus.heldout, 16, 8)
    assert sx.shape == tx.shape == (8, 16)
    first, second = bytes(corpus.heldout[:half].tolist()), bytes(corpus.heldout[half:].tolist())
    for w in sx:
        assert bytes(w.tolist()) in first
    for w in tx:
        assert bytes(w.tolist()) in second
    r = run_mode("diloco", setup)
    assert len(r["test_loss"]) == len(r["heldout_loss"]) == setup.cfg.rounds + 1
    assert r["final_test_loss"] == r["test_loss"][-1] < r["test_loss"][0]
    assert r["final_test_loss"] != r["final_loss"]  # two samples of the held-out text


def test_cli_eval_windows_sets_both_splits(tmp_path):
    out = tmp_path / "run"
    assert main(CLI_SMALL + ["--eval-windows", "5", "--mode", "ddp", "--out", str(out)]) == 0  # the last wins
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["eval_windows"] == 5
    r = res["modes"]["ddp"]
    assert len(r["test_loss"]) == 3 and r["final_test_loss"] == r["test_loss"][-1]
    assert r["eval_windows_scored"] == [5, 5]


def test_cli_says_when_a_split_holds_fewer_windows_than_asked(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(CLI_SMALL + ["--eval-windows", "100000", "--mode", "ddp", "-R", "1", "--out", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())["modes"]["ddp"]
    assert 0 < min(r["eval_windows_scored"]) < 100000
    assert (
        f"each half of the held-out text holds only {r['eval_windows_scored'][0]} / {r['eval_windows_scored'][1]}"
        in capsys.readouterr().err
    )


def test_muon_inner_steps_the_hidden_matrices_and_adamw_the_rest():
    from isoloco_kernels.train.loop import InnerOptimizers, inner_optimizer, muon_params

    cfg = TrainConfig(**SMALL, inner="muon", weight_decay=0.0)
    cfg.validate()
    torch.manual_seed(0)
    model = ByteLM(cfg.model_config())
    hidden = muon_params(model)
    assert hidden == [n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    assert len(hidden) == 8 and "tok.weight" not in hidden and "head.weight" not in hidden
    opt = inner_optimizer(model, cfg)
    assert isinstance(opt, InnerOptimizers)
    adamw, muon = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    ids = lambda o: {id(p) for g in o.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert ids(muon) == {id(named[n]) for n in hidden}
    assert ids(adamw) == {id(p) for n, p in named.items() if n not in hidden}
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    before = {n: p.detach().clone() for n, p in named.items()}
    x = torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(0))
    model.loss(x, x.roll(-1, 1)).backward()
    grads = {n: p.grad.clone() for n, p in named.items()}
    lr = 1e-3
    for g in opt.param_groups:  # the loop's schedule writes every group's lr, Muon's too
        g["lr"] = lr
    opt.step()
    for n, p in named.items():
        step = before[n] - p.detach()
        if n in hidden:  # Muon: an orthogonalized update, RMS-matched: every direction the gradient
            m, k = p.shape  # has (σ ≥ σ₁/10) moves by ~lr·0.2·sqrt(max(m, n)), the others by less
            s = torch.linalg.svdvals(step.double() / (lr * 0.2 * math.sqrt(max(m, k))))
            sg = torch.linalg.svdvals(grads[n].double())
            r = int((sg >= sg[0] / 10).sum())
            assert 0.5 < float(s[r - 1]) and float(s[0]) < 1.5, (n, r, s[:r])
            assert float(sg[r - 1] / sg[0]) < 0.5  # the gradient itself is far from orthogonal
        elif p.ndim == 2:  # AdamW's first step: lr·g/(|g| + eps) ≈ lr·sign(g) where g ≠ 0
            big = grads[n].abs() > 1e-5  # |g| ≫ eps
            assert big.sum() > 100, n
            assert torch.allclose(step[big], lr * grads[n][big].sign(), rtol=1e-2), n
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_muon_inner_trains_through_the_loop(corpus):
    s = Setup(TrainConfig(**SMALL, inner="muon"), corpus)
    r = run_mode("diloco", s)
    a = run_mode("diloco", Setup(TrainConfig(**SMALL), corpus))
    assert "diverged" not in r and r["final_loss"] < r["heldout_loss"][0] - 0.05
    assert r["heldout_loss"][0] == a["heldout_loss"][0] and r["final_loss"] != a["final_loss"]


@pytest.mark.parametrize(
    "mode, mu",
    [
        pytest.param("diloco", 0.5, id="diloco"),
        pytest.param("avg", 0.3, id="avg"),
        pytest.param("isoloco", 0.0, id="isoloco-0"),
        pytest.param("isoloco-sgd", 0.6, id="isoloco-sgd"),
    ],
)
def test_outer_momentum_for_every_method(mode, mu):
    from isoloco_kernels.train.loop import outer_optimizer

    cfg = TrainConfig(**SMALL, outer_momentum={mode: mu})
    cfg.validate()
    assert cfg.outer(mode)[1] == mu
    opt = outer_optimizer(mode, [torch.nn.Parameter(torch.zeros(3, 2))], cfg)
    g = opt.param_groups[0]
    assert g["momentum"] == mu and g["lr"] == cfg.outer(mode)[0]
    if isinstance(opt, torch.optim.SGD):
        assert g["nesterov"] is (mu > 0)


@pytest.mark.parametrize(
    "value, msg",
    [
        pytest.param({"diloco": 1.0}, r"outer momentum for diloco must be in \[0, 1\), got 1.0", id="one"),
        pytest.param({"isoloco": -0.1}, r"outer momentum for isoloco must be in \[0, 1\)", id="negative"),
        pytest.param({"isoloco": float("nan")}, r"outer momentum for isoloco must be in \[0, 1\)", id="nan"),
        pytest.param({"ddp": 0.5}, "outer momentum given for 'ddp', which has no outer step", id="ddp"),
    ],
)
def test_bad_outer_momentum_is_refused(value, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig(**SMALL, outer_momentum=value).validate()


def test_cli_outer_momentum_and_inner(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            CLI_SMALL
            + [
                "--out",
                str(out),
                "--mode",
                "diloco,isoloco",
                "--outer-momentum",
                "diloco=0.5",
                "--inner",
                "muon",
                "-R",
                "1",
            ]
        )
        == 0
    )
    res = json.loads((out / "results.json").read_text())
    assert res["modes"]["diloco"]["outer_momentum"] == 0.5 and res["modes"]["isoloco"]["outer_momentum"] == 0.8
    assert res["config"]["inner"] == "muon"
    with pytest.raises(SystemExit):
        main(CLI_SMALL + ["--out", str(out), "--outer-momentum", "0.5,0.9"])
    assert "--outer-momentum takes a number or MODE=VALUE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(CLI_SMALL + ["--out", str(out), "--inner", "sgd"])
    assert "invalid choice: 'sgd'" in capsys.readouterr().err


def test_torch_init_position_table():
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=2, seq_len=256)
    models = {}
    for init in ("torch", "torch-pos1"):
        torch.manual_seed(0)
        models[init] = ByteLM(replace(cfg, init=init)).requires_grad_(False)
    assert models["torch"].pos.weight.std() == pytest.approx(0.02, rel=0.05)
    assert models["torch-pos1"].pos.weight.std() == pytest.approx(1.0, rel=0.05)  # nn.Embedding's N(0, 1)
    # every other parameter is PyTorch's default draw in both
    a, b = dict(models["torch"].named_parameters()), dict(models["torch-pos1"].named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a if n != "pos.weight")
    assert a["tok.weight"].std() == pytest.approx(1.0, rel=0.05)


def _summarize():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "study" / "summarize.py"
    spec = importlib.util.spec_from_file_location("study_summarize", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paired_bootstrap_ci_covers_the_true_gap():
    import random

    ci = _summarize().paired_bootstrap_ci
    rng = random.Random(0)
    true, sd, n, trials, hits = 0.05, 0.02, 20, 100, 0
    for t in range(trials):
        base = [rng.gauss(2.5, 0.3) for _ in range(n)]  # the per-seed level is shared by the pair
        a = [x + true + rng.gauss(0, sd) for x in base]
        mean, lo, hi = ci(a, base, n_boot=500, seed=t)
        assert lo <= mean <= hi
        hits += lo <= true <= hi
    assert 0.85 <= hits / trials <= 1.0  # nominal 95 %; a percentile bootstrap at n 20 under-covers a little
    # pairing matters: the shared per-seed level cancels, so the interval is ~ 2·1.96·sd/sqrt(n) wide
    mean, lo, hi = ci(a, base, n_boot=2000)
    assert hi - lo == pytest.approx(2 * 1.96 * sd / math.sqrt(n), rel=0.35)
    assert ci([1.0, 2.0], [1.0, 2.0]) == (0.0, 0.0, 0.0)
    m, lo, hi = ci([1.0], [0.5])
    assert m == 0.5 and math.isnan(lo) and math.isnan(hi)
    with pytest.raises(ValueError, match="same length"):
        ci([1.0, 2.0], [1.0])


def test_study_v2_summary_is_what_the_committed_results_give():
    # study/init_scale/summary_v2.json is summarize.py's v2 summary of study/*/results/*.jsonl, byte for byte
    # (v1 runs included: they join the v2 cells), so the v2 pipeline stands alone from the frozen v1
    import json

    s = _summarize()
    v2, v2_recs = s.summary_v2(s.load(s.HERE))
    assert len(v2_recs) == v2["runs"] > 0 and v2["v1_repeats"]["runs"] > 0
    assert json.dumps(v2, indent=1) == (s.HERE / "init_scale" / "summary_v2.json").read_text()


def test_the_main_job_says_when_diloco_ran_untuned_and_its_study_config_matches_the_study():
    """The note under the main job's table: only when DiLoCo ran at its released config; the tuned configs it
    quotes are the study's 10-round picks (study/cells/summary_v3.json)."""
    import json
    from pathlib import Path

    from isoloco_kernels.train.report import STUDY_DILOCO, outer_note

    cells = json.loads((Path(__file__).resolve().parents[2] / "study" / "cells" / "summary_v3.json").read_text())
    for K, (lr, mu) in STUDY_DILOCO.items():
        pick = cells[f"K {K}, H 30, R 10, batch 4×64, adamw 0.003"]["diloco"]
        assert (pick["lr"], pick["momentum"]) == (lr, mu), K
    runs = [{"mode": "ddp"}, {"mode": "diloco", "outer_lr": 0.7, "outer_momentum": 0.9}]
    note = outer_note(runs, 8)
    assert "released outer config" in note and "--outer-lr diloco=0.7 --outer-momentum diloco=0" in note  # K 4 nearest
    assert "lr 1.4, μ 0" in outer_note(runs, 32)
    assert outer_note([{"mode": "diloco", "outer_lr": 1.0, "outer_momentum": 0.0}], 8) is None  # tuned by the user
    assert outer_note([{"mode": "isoloco", "outer_lr": 1.8, "outer_momentum": 0.8}], 8) is None


# ---- workers as they really arrive: drop, faulty, merge_clip (one process) ----

TINY = dict(workers=4, inner_steps=3, rounds=2, batch=2, seq_len=32, eval_windows=4, divergence=False)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(drop=1.0), "drop must be"),
        (dict(drop=-0.1), "drop must be"),
        (dict(drop=0.9), "leaves none to merge"),
        (dict(faulty=0.0), "faulty must be"),
        (dict(faulty=float("nan")), "faulty must be"),
        (dict(merge_clip="mean"), "merge_clip must be"),
        (dict(merge_clip=-1.0), "merge_clip must be"),
        (dict(drop=0.25, compress="int8"), "leave out compress"),
    ],
)
def test_ragged_settings_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{**TINY, **bad}).validate()


def test_who_misses_a_round_is_drawn_from_the_seed_the_same_for_every_mode(corpus):
    missed = {}
    for mode in ("diloco", "isoloco"):
        cfg = TrainConfig(**TINY, drop=0.5, seed=3)
        missed[mode] = run_mode(mode, Setup(cfg, corpus))["ragged"]["missed"]
    assert missed["diloco"] == missed["isoloco"]
    assert all(len(m) == 2 and len(set(m)) == 2 for m in missed["diloco"])  # round(0.5 · 4) each round
    other = run_mode("diloco", Setup(TrainConfig(**TINY, drop=0.5, seed=4), corpus))["ragged"]["missed"]
    assert other != missed["diloco"] or len(other) == 1  # another seed, (almost surely) another draw


def test_a_round_with_every_worker_weighted_alike_is_todays_round_up_to_rounding(corpus):
    """A cap no Δ reaches takes the ragged path (every worker's Δ kept, the weighted merge) with nothing
    clipped or dropped: the same training as the plain path, up to the summation order."""
    for mode in ("diloco", "isoloco", "tsv"):
        m = "isoloco" if mode == "tsv" else mode
        runs = [
            run_mode(m, Setup(TrainConfig(**TINY, **kw, merge="tsv" if mode == "tsv" else "iso_c"), corpus))
            for kw in ({}, {"merge_clip": 1e30})
        ]
        assert "ragged" not in runs[0] and runs[1]["ragged"]["missed"] == [[], []]
        assert runs[1]["final_loss"] == pytest.approx(runs[0]["final_loss"], rel=1e-4), mode


def test_a_missed_round_steps_on_the_mean_of_the_workers_that_delivered(corpus):
    """Round 1 with workers {1, 3} of 4 missing: the Δ IsoLoCo flattens is the mean of workers 0 and 2's Δ
    (captured), which is the plain run's K 2 mean when workers 0 and 2 train alike: checked through a clip
    cap so large it is inert and a faulty factor 1 — the weighted mean of the delivering workers."""
    seen = {}
    cfg = TrainConfig(**{**TINY, "rounds": 1}, drop=0.5, seed=0)
    out = run_mode(
        "isoloco", Setup(cfg, corpus), capture=lambda r, names, d: seen.setdefault(r, [x.clone() for x in d])
    )
    (missed,) = out["ragged"]["missed"]
    assert len(missed) == 2
    # the faulty worker scales the mean by exactly its share: worker 0's Δ × 3 when worker 0 delivers
    seen3 = {}
    cfg3 = TrainConfig(**{**TINY, "rounds": 1}, drop=0.5, seed=0, faulty=3.0)
    run_mode("isoloco", Setup(cfg3, corpus), capture=lambda r, names, d: seen3.setdefault(r, [x.clone() for x in d]))
    n = 4 - len(missed)
    if 0 not in missed:  # mean' = mean + (3 − 1)·Δ_0 / n  →  Δ_0 = (mean' − mean)·n / 2, finite and nonzero
        d0 = [(b - a) * n / 2 for a, b in zip(seen[1], seen3[1])]
        assert all(torch.isfinite(x).all() for x in d0) and any(x.abs().sum() > 0 for x in d0)
    else:  # worker 0 did not deliver: its factor changes nothing
        assert all(torch.equal(a, b) for a, b in zip(seen[1], seen3[1]))


def test_median_clip_brings_a_faulty_worker_back(corpus):
    """Worker 0's Δ × 100 every round: unclipped, the mean it dominates; clipped to the median, the mean
    of the four stays near the honest run's."""
    norms = {}
    for kw in ({}, {"faulty": 100.0}, {"faulty": 100.0, "merge_clip": "median"}):
        seen = {}
        cfg = TrainConfig(**{**TINY, "rounds": 1}, **kw)
        run_mode("diloco", Setup(cfg, corpus), capture=lambda r, names, d: seen.setdefault(r, [x.clone() for x in d]))
        norms[tuple(kw.items())] = float(torch.sqrt(sum(x.double().pow(2).sum() for x in seen[1])))
    honest, faulty, clipped = norms.values()
    assert faulty > 10 * honest and clipped < 1.5 * honest


def test_ragged_rounds_need_every_worker_in_this_process(corpus):
    class OneRank(Comm):
        def __init__(self):
            super().__init__(4)
            self.local_workers = [0]

    with pytest.raises(ValueError, match="one process"):
        run_mode("diloco", Setup(TrainConfig(**TINY, drop=0.25), corpus), comm=OneRank())


def test_a_merge_optimizer_clips_through_its_own_clip(corpus):
    """With a merge other than iso_c the loop hands the stacks to MergeLoCo(clip=...): worker 0's Δ × 1000 moves
    the model far from the honest run unclipped and back to within the honest run's neighbourhood clipped."""
    cfg = dict(TINY, rounds=1, merge="tsv")
    honest, faulty, clipped = (
        run_mode("isoloco", Setup(TrainConfig(**cfg, **kw), corpus))["final_loss"]
        for kw in ({}, {"faulty": 1000.0}, {"faulty": 1000.0, "merge_clip": "median"})
    )
    assert abs(faulty - honest) > 10 * abs(clipped - honest) and abs(clipped - honest) < 0.05
