"""The README and the package agree: every name in its API table exists with the keywords and defaults it
shows, those keywords work, its code runs, its links resolve, its two commands are the ones a newcomer
runs; and the files a library is adopted by (LICENSE, CHANGELOG.md, py.typed, the declared torch range)."""

from __future__ import annotations

import ast
import copy
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import isoloco_kernels as ik

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()

TWO_COMMANDS = """```bash
# 1. the main job: DDP vs DiLoCo vs IsoLoCo on the built-in corpus (K=8 workers, H=30 inner steps, 12 rounds)
pip install -e ".[train]" && python -m isoloco_kernels.train

# 2. the tests
pip install -e ".[test]" && python -m pytest tests -q
```"""


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def _api_rows() -> list[str]:
    """The first cell of each row of the README's API table, split into its entries."""
    cells = re.findall(r"^\| `(.+?)` \|", _section("API at a glance"), re.M)
    return [e for cell in cells for e in cell.split("`, `")]


def _resolve(path: str):
    obj = ik
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _documented_calls() -> list[tuple[str, object, list[str], dict]]:
    """(entry, the callable, positional names, keyword -> evaluated default) of every API row with a call."""
    out = []
    for entry in _api_rows():
        m = re.fullmatch(r"([\w.]+)\((.*)\)", entry)
        if not m:
            continue
        call = ast.parse(f"f({m.group(2)})", mode="eval").body
        pos = [a.id for a in call.args]
        kw = {k.arg: eval(compile(ast.Expression(k.value), "README", "eval"), {}) for k in call.keywords}
        out.append((entry, _resolve(m.group(1)), pos, kw))
    return out


def test_readme_is_at_most_200_lines_with_the_sections_in_order():
    assert len(README.splitlines()) <= 200
    order = ["Install", "Two commands", "Quick start (CPU)", "Drop into your DiLoCo stack", "Performance"]
    order += ["API at a glance", "Distributed in brief", "Guarantees", "The study", "Tests and contributing"]
    at = [README.index(f"\n## {t}\n") for t in order]
    assert at == sorted(at), order


def test_the_two_commands_are_verbatim():
    """The newcomer check runs these two lines as they stand: they must not drift."""
    assert TWO_COMMANDS in README


def test_every_api_name_exists_and_is_exported():
    rows = _api_rows()
    assert len(rows) >= 18, rows
    for entry in rows:
        name = re.match(r"[\w.]+", entry).group(0)
        obj = _resolve(name)  # AttributeError names what the README promises and the package lacks
        top = name.split(".")[0]
        assert top in ik.__all__, f"{top} is in the README's API table but not in isoloco_kernels.__all__"
        assert obj is not None
    for name in ik.__all__:
        assert name == "__version__" or any(re.match(rf"{name}\b", e) for e in rows), f"{name} missing from README"


def test_every_documented_keyword_and_default_is_the_signature():
    calls = _documented_calls()
    assert {e.split("(")[0] for e, *_ in calls} >= {"IsoLoCo", "ShardedIsoLoCo", "iso_flatten", "average_"}
    for entry, fn, pos, kw in calls:
        params = inspect.signature(fn).parameters
        for name in pos + list(kw):
            assert name in params, f"README: {entry}: {fn.__qualname__} has no parameter {name!r}"
        for name, default in kw.items():
            assert params[name].default == default, (
                f"README: {entry}: {name}={default!r}, code: {params[name].default!r}"
            )


def test_documented_keywords_work():
    """Called with the README's keywords (the single-process entry points; the distributed ones run them
    in tests/test_distributed.py): nothing raises, nothing warns."""
    calls = {e.split("(")[0]: kw for e, _, _, kw in _documented_calls()}
    x = torch.randn(3, 6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = ik.iso_flatten(x, **calls["iso_flatten"])
        ik.iso_merge_([x], **calls["iso_merge_"])
        assert torch.allclose(x, y)
        p = nn.Parameter(torch.randn(6, 4))
        opt = ik.IsoLoCo([p], **calls["IsoLoCo"])
        p.grad = torch.randn(6, 4)
        assert opt.step(**calls["IsoLoCo.step"]) is None
        opt.load_state_dict(opt.state_dict())
        assert set(ik.backends()) >= {"cuda_extension"}


def test_the_readme_names_every_flatten_method():
    from isoloco_kernels.flatten.registry import METHODS

    line = re.search(r"^Methods: (.*?)\(\[docs/methods.md\]", _section("API at a glance"), re.M | re.S).group(1)
    assert set(re.findall(r'`"(\w+)"`', line)) == set(METHODS), "README's method list differs from flatten.METHODS"


def test_the_error_classes_are_the_ones_raised():
    assert ik.ResultOverflowError is sys.modules["isoloco_kernels._validate"].ResultOverflowError
    assert issubclass(ik.ResultOverflowError, ValueError) and issubclass(ik.DistributedStepError, RuntimeError)
    assert issubclass(ik.GramFallbackWarning, ik.FlattenFallbackWarning)
    p = torch.randn(4, 3)
    p.grad = torch.randn(4, 3)
    with pytest.raises(ik.ResultOverflowError, match="overflows"):  # the update is beyond float32
        ik.IsoLoCo([p], lr=1e39).step()


def test_dtensor_route_is_checked_when_set():
    p = nn.Parameter(torch.randn(4, 3))
    opt = ik.IsoLoCo([p], dtensor_route="gram")
    assert opt.dtensor_route == "gram"
    with pytest.raises(ValueError, match=r"dtensor_route must be one of .*'gatherr'"):
        opt.dtensor_route = "gatherr"
    assert opt.dtensor_route == "gram"  # unchanged
    with pytest.raises(ValueError, match="dtensor_route must be one of"):
        ik.IsoLoCo([p], dtensor_route="Gram")
    assert copy.deepcopy(opt).dtensor_route == "gram"


def test_quick_start_code_runs():
    """The README's Python blocks, the DiLoCo loop shortened to one round: what a user pastes runs."""
    blocks = re.findall(r"```python\n(.*?)```", _section("Quick start (CPU)"), re.S)
    assert len(blocks) == 2
    exec(compile(blocks[0], "README quick start 1", "exec"), {})
    loop = blocks[1].replace("for rnd in range(10):", "for rnd in range(1):")
    assert loop != blocks[1]
    exec(compile(loop, "README quick start 2", "exec"), {})


def test_relative_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert os.path.exists(os.path.join(ROOT, target)), f"README links to missing {target}"


def test_adoption_files_and_the_declared_torch_range():
    for path in ("LICENSE", "CHANGELOG.md", "isoloco_kernels/py.typed", "mkdocs.yml", "docs/index.md"):
        assert os.path.isfile(os.path.join(ROOT, path)), path
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    declared = re.search(r'TORCH_REQUIREMENT = "torch>=([\d.]+)"', setup).group(1)
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert f'"torch=={declared}"' in ci, "CI must test the lower bound setup.py declares"
    assert f"torch {declared}" in README and "BSD 3-Clause" in open(os.path.join(ROOT, "LICENSE")).read()
    assert 'license="BSD-3-Clause"' in setup


def test_public_signatures_are_typed():
    for fn in (
        ik.IsoLoCo.__init__,
        ik.ShardedIsoLoCo.__init__,
        ik.IsoLoCo.step,
        ik.ShardedIsoLoCo.step,
        ik.average_,
        ik.sharded_iso_merge_,
    ):
        ann = inspect.get_annotations(fn)
        for name in ("params", "process_group", "closure"):
            if name in inspect.signature(fn).parameters:
                assert name in ann, f"{fn.__qualname__}: {name} has no type hint"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or shutil.which("mkdocs") is None,
    reason="mkdocs is not installed (pip install -e '.[docs]'); CI builds the site itself",
)
def test_docs_build_strict(tmp_path):
    """The documentation site builds with every link and anchor resolving (--strict: a warning fails)."""
    proc = subprocess.run(
        ["mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# -- the first screen's numbers, the CPU install line, the quick subset ------------------------------


def _readme_numbers():
    spec = importlib.util.spec_from_file_location("readme_numbers", os.path.join(ROOT, "study", "readme_numbers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_first_screen_numbers_are_generated_from_committed_results():
    """Each number-bearing sentence of the first screen (and the example's losses, the outer step's share)
    is what study/readme_numbers.py computes from the committed result file it names."""
    flat = " ".join(README.split())
    mod = _readme_numbers()
    assert set(mod.SENTENCES) == {"speedup", "study", "where", "horizon", "advice", "example", "outer share"}
    for name, (make, src) in mod.SENTENCES.items():
        assert src.is_file(), f"{name}: {src} is not committed"
        sentence = " ".join(make().split())
        assert re.search(r"\d", sentence), sentence
        assert sentence in flat, f"README lacks the {name} sentence generated from {src}:\n{sentence}"
    first = README.split("\n## ", 1)[0]
    for name in ("speedup", "study", "where"):
        assert mod.SENTENCES[name][0]() in " ".join(first.split()), f"the {name} sentence left the first screen"


def test_readme_numbers_follow_their_files(tmp_path, monkeypatch):
    """The generator reads the file: a changed result changes the sentence (so the check above can fail)."""
    mod = _readme_numbers()
    ex = json.loads(mod.EXAMPLE.read_text())
    ex["held_out_loss"]["IsoLoCo"] = 0.5
    fake = tmp_path / "example.json"
    fake.write_text(json.dumps(ex))
    monkeypatch.setattr(mod, "EXAMPLE", fake)
    assert "0.500 with IsoLoCo" in mod.example() and mod.example() not in " ".join(README.split())
    v6 = json.loads(mod.HORIZON.read_text())
    end = next(g for g in v6["gap"] if g["round"] == v6["rounds"])
    end.update(mean=-0.1, t_lo=-0.15, t_hi=-0.05)
    fake = tmp_path / "summary_v6.json"
    fake.write_text(json.dumps(v6))
    monkeypatch.setattr(mod, "HORIZON", fake)
    assert "the gain holds" in mod.horizon() and "−0.100 [−0.150, −0.050] at the end" in mod.horizon()
    assert "where DiLoCo led most" in mod.horizon()
    for g in v6["curve"]:  # no round with DiLoCo surely ahead: no such clause
        g["t_lo"] = min(g["t_lo"], -0.001)
    fake.write_text(json.dumps(v6))
    assert "DiLoCo led" not in mod.horizon()
    assert mod.horizon().endswith("at round 10 of the same runs, below 0 through round 60")
    for g in v6["curve"]:  # IsoLoCo ahead at every scored round: no clause on when its lead ended
        g["t_hi"] = min(g["t_hi"], -0.001)
    fake.write_text(json.dumps(v6))
    assert mod.horizon().endswith("at round 10 of the same runs")


# -- where the gain lives (study v7) and the tuning advice, at any stage of the study ------------------------------


def _fake_v7(tmp_path, monkeypatch, mod, edit):
    """A study v7 summary, changed by `edit(summary)`, in place of the real one. The starting point is a fixed
    copy (tests/data/summary_v7_screen.json: v7 when its K 16 screen held v6's runs alone), so these known answers
    do not move as the study's runs land."""
    v7 = json.loads((mod.ROOT / "tests" / "data" / "summary_v7_screen.json").read_text())
    edit(v7)
    fake = tmp_path / "summary_v7.json"
    fake.write_text(json.dumps(v7))
    monkeypatch.setattr(mod, "K_SCALING", fake)


def _k16(v7: dict) -> dict:
    return next(r for r in v7["fixed_compute"] if r["workers"] == 16)


def _screen(seeds, sel0, sel01=None, test=1.4):
    return {"seeds": seeds, "selection_seed0": sel0, "selection_seeds01": sel01, "test_mean": test}


def test_where_the_gain_lives_says_what_has_been_run(tmp_path, monkeypatch):
    """The where-the-gain-lives sentence from fake summaries: the verdict follows K 16's interval (gain holds, gap
    closed, DiLoCo ahead), the tuning it names follows the screen (configs, μs, schedules, the pick's rule), the
    seeds follow the picks, and the norm-preserving merge and DDP appear once they ran."""
    mod = _readme_numbers()

    def gap(mean, lo, hi, n=3):
        return {"seeds": n, "mean": mean, "t_lo": lo, "t_hi": hi, "per_seed": [mean] * n}

    # the gain holds at K 16 (v6's K 16 runs as v7's screen): the lead-in, the tuning as run, the seeds
    _fake_v7(
        tmp_path, monkeypatch, mod, lambda v7: _k16(v7)["gaps"].update({"isoloco - diloco": gap(-0.2, -0.3, -0.1)})
    )
    w = mod.where()
    assert w.startswith("**The gain lives in more workers for fewer rounds**: at 19.7 tokens per parameter")
    assert (
        "is −0.006 [−0.038, +0.027] with K 4 workers for 300 rounds and −0.200 [−0.300, −0.100] with K 16 for 75" in w
    )
    assert (
        "each over seeds 0–2, against a DiLoCo tuned at each K over lr × μ (K 4: 10 configs, μ ∈ {0, 0.5, 0.8}, and "
        "K 16: 11 configs, μ ∈ {0, 0.8, 0.9}, each at a constant outer lr, picked by seed 0)" in w
    )
    # the stronger baselines close the gap: an interval holding 0, said plainly in the lead-in
    _fake_v7(
        tmp_path, monkeypatch, mod, lambda v7: _k16(v7)["gaps"].update({"isoloco - diloco": gap(-0.05, -0.2, 0.1)})
    )
    w = mod.where()
    assert (
        w.startswith("**The stronger baselines close the gap at K 16**:") and "−0.050 [−0.200, +0.100] with K 16" in w
    )
    _fake_v7(
        tmp_path, monkeypatch, mod, lambda v7: _k16(v7)["gaps"].update({"isoloco - diloco": gap(0.05, 0.01, 0.09)})
    )
    assert mod.where().startswith("**A tuned DiLoCo is ahead at K 16**:")

    # part B, K 4 for K 16's 75 rounds, each method at its K 4 × 300 pick (DiLoCo 0.5 @ 0.8, IsoLoCo 3.2 @ 0.8)
    def few_rounds(g, n=5, dil="diloco 0.5 @ 0.8"):
        def edit(v7):
            _k16(v7)["gaps"].update({"isoloco - diloco": gap(-0.2, -0.3, -0.1)})
            test = {m: {str(s): 1.5 for s in range(n)} for m in ("isoloco 3.2 @ default", dil, "diloco 0.7 @ 0.8")}
            v7["workers_or_rounds"] = {"workers": 4, "rounds": 75, "tokens_per_param": 4.93, "test": test}
            v7["workers_or_rounds"]["gaps"] = {f"isoloco 3.2 @ default - {d}": g for d in test if d.startswith("dil")}

        _fake_v7(tmp_path, monkeypatch, mod, edit)
        return mod.where()

    w = few_rounds(gap(-0.3, -0.4, -0.2, 5))
    assert w.startswith("**The gain lives in runs of few outer rounds, and more workers fill them with tokens**:")
    assert (
        "; with K 4 for 75 rounds (4.9 tokens per parameter, each method at its K 4 × 300 pick) it is −0.300 [−0.400, "
        "−0.200] over seeds 0–4: the lead follows the rounds, not the workers" in w
    )
    w = few_rounds(gap(-0.01, -0.1, 0.1, 5))
    assert w.startswith("**The gain lives in more workers for fewer rounds**:")
    assert "−0.010 [−0.100, +0.100] over seeds 0–4: at as few rounds with fewer workers the lead is gone" in w
    assert "with K 4 for 75" not in few_rounds(gap(-0.3, -0.4, -0.2, 1), n=1)  # one seed: not yet
    assert "with K 4 for 75" not in few_rounds(gap(-0.3, -0.4, -0.2), dil="diloco 0.7 @ 0.9")  # not K 4's pick

    # v7 under way: μ 0.5 and a warm-up + cosine screened, seed 1 of the three best, seeds 0–4 at the new pick,
    # the norm-preserving merge and DDP tuned
    def later(v7):
        r = _k16(v7)
        d = r["methods"]["diloco"]
        d["screen"] |= {
            "1 @ 0.8, warmup-cosine": _screen([0, 1, 2, 3, 4], 1.60, 1.62),
            "0.7 @ 0.5": _screen([0, 1], 1.65, 1.70),
            "1 @ 0.5": _screen([0], 1.90),
        }
        d["pick"] = "1 @ 0.8, warmup-cosine"
        d["test"] = {str(s): 1.5 for s in range(5)}
        r["methods"]["isoloco"]["test"] = {str(s): 1.4 for s in range(5)}
        r["methods"]["norm_mean"] = {
            "pick": "1.4 @ 0.8",
            "screen": {"1.4 @ 0.8": _screen([0, 1], 1.6, 1.6), "1 @ 0.8": _screen([0, 1], 1.7, 1.7)},
        }
        r["methods"]["ddp"]["screen"] |= {"inner lr 0.0045": _screen([0], 1.52), "inner lr 0.006": _screen([0], 1.6)}
        r["gaps"] = {"isoloco - diloco": gap(-0.1, -0.15, -0.05, 5), "isoloco - norm_mean": gap(-0.08, -0.1, -0.06, 5)}
        r["to_ddp"]["isoloco"] = gap(0.01, -0.02, 0.04, 5)

    _fake_v7(tmp_path, monkeypatch, mod, later)
    w = mod.where()
    assert "over seeds 0–2 at K 4 and seeds 0–4 at K 16, against a DiLoCo tuned at each K over lr × μ (K 4: " in w
    assert (
        "(K 4: 10 configs, μ ∈ {0, 0.5, 0.8}, at a constant outer lr, picked by seed 0; K 16: 14 configs, μ ∈ {0, 0.5, "
        "0.8, 0.9}, with outer schedules constant and warm-up + cosine, picked by the mean of seeds 0–1 over the 3 "
        "configs run on seed 1)" in w
    )
    assert "IsoLoCo is ahead of the norm-preserving merge (`norm_mean`, the mean's direction at the workers' mean " in w
    assert "tuned over lr × μ; K 16: 2 configs, μ 0.8, at a constant outer lr, picked by the mean of seeds 0–1" in w
    assert (
        "on seed 1) at K 16 (−0.080 [−0.100, −0.060]); IsoLoCo is level with DDP (tuned over 3 inner lrs) at K 16" in w
    )
    assert w.endswith(" at K 16 (+0.010 [−0.020, +0.040]).")

    # a new seed-0 best that has not run seed 1 yet: the pick stands on an earlier screen, and the sentence says so
    def between(v7):
        _k16(v7)["methods"]["diloco"]["screen"]["1 @ 0.8, warmup-cosine"] = _screen([0], 1.60)

    _fake_v7(tmp_path, monkeypatch, mod, between)
    assert "picked by seed 0 of an earlier screen (1 @ 0.8, warm-up + cosine, now best on seed 0, awaits seed 1)" in (
        mod.where()
    )
    # no larger K with a pick on 3+ seeds: only K 4, and the lead-in says the rest awaits its seeds (2 seeds, 1
    # degree of freedom, would read "level" whatever the runs say)
    for n in (1, 2):
        _fake_v7(
            tmp_path,
            monkeypatch,
            mod,
            lambda v7: _k16(v7)["gaps"].update({"isoloco - diloco": gap(-0.1, -1.4, 1.2, n)}),
        )
        w = mod.where()
        assert w.startswith("**Beyond K 4 the picks await their seeds**:") and "K 16" not in w
        assert "is −0.006 [−0.038, +0.027] with K 4 workers for 300 rounds, each over seeds 0–2" in w


def test_where_says_the_ks_that_share_a_verdict_or_a_tuning_together():
    """Known answers for the where-sentence's grouping over several K: the Ks with one verdict against a control are
    said together, a changed verdict is said of "it"; the schedules and rule a screen shares are said once, "each"."""
    mod = _readme_numbers()

    def gap(mean, lo, hi):
        return {"seeds": 5, "mean": mean, "t_lo": lo, "t_hi": hi}

    rows = [(8, gap(-0.04, -0.08, 0.002)), (16, gap(-0.1, -0.12, -0.08)), (32, gap(-0.2, -0.3, -0.1))]
    assert mod._standing(rows, "X") == (
        "IsoLoCo is level with X at K 8 (−0.040 [−0.080, +0.002]), and ahead of it at K 16 (−0.100 [−0.120, −0.080]) "
        "and K 32 (−0.200 [−0.300, −0.100])"
    )
    assert mod._standing(rows[:1], "X") == "IsoLoCo is level with X at K 8 (−0.040 [−0.080, +0.002])"
    # only neighbours share a clause: the Ks stay in order
    assert mod._standing([rows[1], rows[0], rows[2]], "X") == (
        "IsoLoCo is ahead of X at K 16 (−0.100 [−0.120, −0.080]), level with it at K 8 (−0.040 [−0.080, +0.002]), "
        "and ahead of it at K 32 (−0.200 [−0.300, −0.100])"
    )
    assert mod._ddp_lrs([(1, 16)]) == "at one inner lr" and mod._ddp_lrs([(3, 16)]) == "tuned over 3 inner lrs"
    assert mod._ddp_lrs([(3, 8), (3, 16)]) == "tuned over 3 inner lrs at each K"
    assert mod._ddp_lrs([(1, 8), (3, 16)]) == "at one inner lr at K 8, tuned over 3 at K 16"
    assert mod._ddp_lrs([(2, 8), (3, 16)]) == "tuned over 2 inner lrs at K 8, tuned over 3 at K 16"
    assert mod._ddp_lrs([(2, 8), (3, 16), (3, 32)]) == "tuned over 2 inner lrs at K 8, tuned over 3 at K 16 and 32"
    sc = [(4, mod._screen([(0.5, 0.0, "constant")], "picked by seed 0"))]
    sc += [(K, mod._screen([(1.0, 0.8, "constant"), (1.0, 0.9, "warmup-cosine")], "R")) for K in (8, 16)]
    assert mod._tuning(sc) == (
        "K 4: 1 config, μ 0, at a constant outer lr, picked by seed 0; K 8: 2 configs, μ ∈ {0.8, 0.9}, and K 16: 2 "
        "configs, μ ∈ {0.8, 0.9}, each with outer schedules constant and warm-up + cosine, R"
    )
    # three Ks that share a rule: a list, not "and … and"
    sc.append((32, mod._screen([(1.0, 0.8, "constant"), (1.0, 0.9, "warmup-cosine")], "R")))
    assert mod._tuning(sc[1:]) == (
        "K 8: 2 configs, μ ∈ {0.8, 0.9}, K 16: 2 configs, μ ∈ {0.8, 0.9}, and K 32: 2 configs, μ ∈ {0.8, 0.9}, each "
        "with outer schedules constant and warm-up + cosine, R"
    )


def test_the_tuning_advice_follows_its_summaries(tmp_path, monkeypatch):
    """The advice's table takes each v7 K's picks as they stand (a scheduled pick shows its schedule), and its
    schedule sentence drops what v6 no longer supports."""
    mod = _readme_numbers()
    today = mod.advice()
    assert "| 16 × 10 (2.6) | 4.2 @ 0.8 | 1 @ 0 | v3: 4 configs, μ 0, seed 0 |" in today
    assert (
        "| 4 × 300 (19.7) | 3.2 @ 0.8, warm-up + cosine | 1 @ 0.8, warm-up + cosine | v6: 3 peak lrs, seed 0 |" in today
    )

    def later(v7):
        d = _k16(v7)["methods"]["diloco"]
        d["screen"]["1 @ 0.8, warmup-cosine"] = _screen([0, 1], 1.60, 1.62)
        d["screen"]["0.7 @ 0.5"] = _screen([0, 1], 1.65, 1.70)
        d["pick"] = "1 @ 0.8, warmup-cosine"
        k32 = json.loads(json.dumps(_k16(v7)))
        k32.update(workers=32, rounds=38, tokens_per_param=19.96)
        k32["methods"]["isoloco"]["pick"] = "4.2 @ default"
        v7["fixed_compute"].append(k32)

    _fake_v7(tmp_path, monkeypatch, mod, later)
    advice = mod.advice()
    row = (
        "| 16 × 75 (19.7) | 3.2 @ 0.8 | 1 @ 0.8, warm-up + cosine | v7: 13 configs, μ ∈ {0, 0.5, 0.8, 0.9}, with outer "
    )
    assert (
        row + "schedules constant and warm-up + cosine, the mean of seeds 0–1 over the 3 configs run on seed 1 |"
        in advice
    )
    assert "| 32 × 38 (20.0) | 4.2 @ 0.8 | 1 @ 0.8, warm-up + cosine |" in advice
    v6 = json.loads(mod.HORIZON.read_text())
    v6["schedules"]["horizon"]["warmup-cosine"].pop("retuned")
    v6["schedules"]["horizon"]["warmup"]["isoloco"]["vs_constant"].update(mean=-0.02, t_lo=-0.03, t_hi=-0.01)
    fake = tmp_path / "summary_v6.json"
    fake.write_text(json.dumps(v6))
    monkeypatch.setattr(mod, "HORIZON", fake)
    advice = mod.advice()
    assert "warm-up + cosine | v6" not in advice and "retune" not in advice and "peak lr raised" not in advice
    assert "Outer-lr schedules over a long run: at K 4 × 300 rounds a warm-up alone helped IsoLoCo (−0.020" in advice


TUNING_PAGES = ("README.md", "docs/drop-in.md", "docs/study.md", "docs/training-loop.md")


def test_every_page_gives_the_same_generated_tuning_advice():
    """README's Tuning paragraph, the drop-in page's ## Tuning, the study page and the training-loop page carry
    the advice exactly as study/readme_numbers.py generates it (the picks against K and the outer schedule)."""
    advice = _readme_numbers().advice()
    for page in TUNING_PAGES:
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        assert text.count(advice) == 1, f"{page} lacks the generated tuning advice (python study/readme_numbers.py)"
    assert advice in _section("Drop into your DiLoCo stack")
    drop_in = open(os.path.join(ROOT, "docs", "drop-in.md"), encoding="utf-8").read()
    assert advice in drop_in.split("\n## Tuning\n", 1)[1]


def test_the_advised_schedule_is_the_loops(recwarn):
    """The advice's torch schedulers give `IsoLoCo` the loop's --outer-schedule warmup-cosine lr at every round."""
    import torch.optim.lr_scheduler as sched

    from isoloco_kernels.train.config import OUTER_SCHEDULES
    from isoloco_kernels.train.optimizers import OuterSchedule

    advice = _readme_numbers().advice()
    assert "`--outer-schedule warmup-cosine`" in advice and "warmup-cosine" in OUTER_SCHEDULES
    warm = re.search(r"W = (max\(2, round\(0\.05 \* R\)\))", advice).group(1)
    recipe = re.search(r"`(SequentialLR\(.*?\))` \(`torch\.optim\.lr_scheduler`", advice).group(1)
    for R in (10, 38, 75, 150, 300):
        mine, ref = nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(3, 2))
        lr = 3.2
        opt, loop = ik.IsoLoCo([mine], lr=lr), ik.IsoLoCo([ref], lr=lr)
        schedule = OuterSchedule(loop, "warmup-cosine", R)
        W = eval(warm, {"R": R})
        assert W == schedule.warm, (R, W, schedule.warm)
        scheduler = eval(recipe, {**vars(sched), "opt": opt, "W": W, "R": R, "lr": lr})
        for r in range(R):
            assert opt.param_groups[0]["lr"] == pytest.approx(loop.param_groups[0]["lr"], rel=1e-12), (R, r)
            mine.grad, ref.grad = torch.zeros(3, 2), torch.zeros(3, 2)
            opt.step(), loop.step()
            scheduler.step(), schedule.step()
        assert loop.param_groups[0]["lr"] == pytest.approx(0.1 * lr)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)], [str(w.message) for w in recwarn]


def test_the_first_sentence_says_what_the_library_is_for_without_jargon():
    first = re.search(r"^\*\*(.+?)\*\*", README.split("\n", 2)[2].lstrip(), re.S).group(1)
    for word in ("DiLoCo", "Iso-C", "pseudo-gradient", "Nesterov", "SVD", "GEMM"):
        assert word not in first, f"the first sentence uses {word!r} before saying what the library is for"


def test_cpu_install_line_matches_the_declared_torch_and_ci_runs_it():
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    req = re.search(r'TORCH_REQUIREMENT = "([^"]+)"', setup).group(1)
    line = f'pip install "{req}" --index-url https://download.pytorch.org/whl/cpu'
    assert f"```bash\n{line}\n```" in _section("Install"), "README's torch-first line for CPU machines"
    check = open(os.path.join(ROOT, ".ci", "wheel_check"), encoding="utf-8").read()
    assert """grep -m1 -E '^pip install "torch[^"]*" --index-url ' README.md""" in check
    assert (
        'eval "${torch_first% --index-url *}"' in check
        and "bash .ci/wheel_check" in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    )


def test_the_quick_subset_is_documented_and_its_slow_files_exist():
    assert 'python -m pytest tests -q -m "not slow"' in README
    tests = os.path.join(ROOT, "tests")
    slow = [
        f
        for d, _, files in os.walk(tests)
        for f in files
        if f.startswith("test_")
        and f.endswith(".py")
        and re.search(
            r"^pytestmark = \[?\s*pytest\.mark\.slow\b", open(os.path.join(d, f), encoding="utf-8").read(), re.M
        )
    ]
    assert slow, "no module under tests/ marks itself slow (pytestmark = pytest.mark.slow): the quick subset is all"


def test_docs_install_page_has_the_readme_quick_start():
    page = open(os.path.join(ROOT, "docs", "install.md"), encoding="utf-8").read()
    for code in re.findall(r"```python\n(.*?)```", _section("Quick start (CPU)"), re.S):
        assert f"```python\n{code}```" in page, "docs/install.md's quick start differs from the README's"
