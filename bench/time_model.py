"""A time model of the Iso-C flatten on a GPU: every candidate costed before a GPU minute is spent.

    time = Σ_unit FLOPs_unit / (ceiling_unit · efficiency_unit)

FLOPs per GEMM unit come from the registry's models (`isoloco_kernels.flatten.METHODS[...].flops`,
`polar.polar_flops`, `gram.gram_flops`, `fast.fast_work`) per bucket of a set in bench/shapes.py.
Units: "fp32" (float32 without tensor cores), "tf32x3" (three TF32 GEMMs: ceiling TF32 / 3), "tf32x2"
(the symmetric products X·Xᵀ and A² of a 3xTF32 step, two TF32 GEMMs: ceiling TF32 / 2), "bf16",
"fp64" (the float64 tensor cores). Ceilings are those a device run measured (its JSON's
"isoloco" → "ceilings"); efficiencies are fitted to that run's medians of fp32 input:
fp32 from "polar", fp64 from "gram", bf16 from "polar_bf16" (its float32 steps at the fp32 fit).
"tf32x3" and "tf32x2" have no measurement yet and take the bf16 fit (both are tensor-core GEMMs of the same
shapes; the split's elementwise passes are ~0.2 % of a step's FLOPs at r = 1024 and are ignored).

    python bench/time_model.py                       # the table, from the 2026-12-04 H200 run
    python bench/time_model.py --run RUN.json --measured NEW.json --out bench/results/time_model.md

With --measured (a later run's JSON), each candidate that run timed gets its measured median beside
the prediction.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.shapes import SETS, bucket_shapes, decoder_weight_shapes  # noqa: E402
from isoloco_kernels.flatten import fast, fast_gram, polar  # noqa: E402
from isoloco_kernels.flatten import registry as flatten

RUN = ROOT / "bench" / "results" / "2026-12-04-NVIDIA-H200.json"
SET_NAMES = ("llama-178m", "llama-1b", "llama-8b")

# Targets (fp32 input, one H200): the tensor-core issue's four numbers.
TARGETS = {("fast", "llama-178m"): 0.015, ("fast", "llama-1b"): 0.25, ("auto", "llama-178m"): 0.060}
TARGETS[("auto", "llama-1b")] = 0.8


def _registry(method: str):
    """A registered method's per-matrix FLOPs by unit (its registry model; "compute" is float32)."""
    return lambda k, r: flatten.flops_per_dtype(method, k, r, "fp32")


def _units(unit: str, steps: int = polar.STEPS):
    return lambda k, r: {unit: polar.polar_flops(k, r, steps)}


def _fast_variant(precise_steps: int, steps: int = fast.STEPS):
    return lambda k, r: fast_gram.direct_work(k, r, precise_steps, steps)


def _fast_gram_everywhere(k, r):
    return fast_gram.gram_work(k, r)


def _fast_one_triangle(k, r):
    """fast with sym="triton" (triton/sym_gram.py): the direct route's bfloat16 steps compute X·Xᵀ
    and the polynomial in A one triangle at a time, half their FLOPs, at the tensor-core efficiency
    of the GEMMs they replace (unmeasured); the 3xTF32 steps and the Gram route as they are."""
    if fast.route_for(r, k, "cuda") == "gram":
        return fast_gram.gram_work(k, r)
    w = fast_gram.direct_work(k, r, fast.PRECISE_STEPS, fast.STEPS)
    sym = (fast.STEPS - fast.PRECISE_STEPS) * (2.0 * k * r * r + 2.0 * r**3)
    return dict(w, bf16=w["bf16"] - sym / 2)


def _polar_bf16_as_run(k, r):
    w = polar.polar_work(k, r, "bf16")
    return {"bf16": w["bf16"], "fp32": w["compute"]}


#: auto's choice per bucket on an H200 (float64 rate 1) between gram and one polar variant.
AUTO = "auto"

# name -> (per-matrix FLOPs by unit, or (AUTO, polar variant), what it is)
CANDIDATES = {
    "polar": (_registry("polar"), "IEEE float32 GEMMs (as run on 2026-12-04)"),
    "gram": (_registry("gram"), "float64 Gram-space iteration (as run)"),
    "auto": ((AUTO, "polar"), "gram where flatten.gram_beats_polar says so, else polar (as run)"),
    "polar_tf32x3": (_registry("polar_tf32x3"), "candidate exact grade: polar on 3xTF32"),
    "auto with polar_tf32x3": ((AUTO, "polar_tf32x3"), "not the default: gram or polar_tf32x3, the cheaper"),
    "polar_bf16 as run": (_polar_bf16_as_run, "8 bf16 + 2 float32 steps, no rank certificate"),
    "polar_bf16": (_registry("polar_bf16"), "now: + float64 rank certificate"),
    "fast": (_registry("fast"), "direct (9 steps) or, from k ≈ 5.5·r, the Gram route (fast_gram.py)"),
    "fast before": (_fast_variant(fast.PRECISE_STEPS, polar.STEPS), "direct only, 10 steps: 3 3xTF32, 7 bf16"),
    "fast, Gram route only": (_fast_gram_everywhere, "fast_gram.py on every bucket (square ones too)"),
    "fast, 2 precise steps": (_fast_variant(2), "not implemented: direct only, 2 precise steps, a lower floor"),
    "fast, sym='triton'": (_fast_one_triangle, "one-triangle bf16 products (sym_gram.py, opt-in, unmeasured)"),
    "bf16 only": (_units("bf16"), "not a method: 10 bf16 steps, misses the contract (a lower bound)"),
}
#: Tensor-core efficiency of a tuned GEMM path, the optimistic side of the bracket.
TUNED_TC_EFFICIENCY = 0.75


def load_run(path: Path) -> dict:
    run = json.loads(Path(path).read_text())
    return run


def ceilings_of(run: dict) -> dict[str, float]:
    """FLOP/s per unit from a run's measured ceilings."""
    ceil = run["isoloco"]["ceilings"]
    cuda = next(v for k, v in ceil.items() if "cuda" in k)
    mm = cuda["matmul_TFLOPs"]
    return {
        "fp32": mm["fp32"] * 1e12,
        "tf32x3": mm["tf32"] * 1e12 / 3,
        "tf32x2": mm["tf32"] * 1e12 / 2,
        "bf16": mm["bf16"] * 1e12,
        "fp64": mm["fp64"] * 1e12,
    }


def _medians(run: dict, dtype: str = "fp32") -> dict[tuple[str, str], dict]:
    out = {}
    for b in run["benchmarks"]:
        e = b["extra_info"]
        if e.get("kind") == "flatten" and e.get("device") == "cuda" and e.get("dtype") == dtype:
            out[(e["impl"], e["set"])] = e
    return out


def fit_efficiency(run: dict) -> dict[str, float]:
    """Per unit: ideal time (FLOPs / ceiling) over the measured median, averaged over the sets."""
    ceil = ceilings_of(run)
    med = _medians(run)

    def mean(xs):
        return sum(xs) / len(xs)

    eff = {}
    eff["fp32"] = mean([e["flops"]["fp32"] / ceil["fp32"] / e["median_s"] for (i, _), e in med.items() if i == "polar"])
    eff["fp64"] = mean([e["flops"]["fp64"] / ceil["fp64"] / e["median_s"] for (i, _), e in med.items() if i == "gram"])
    bf = []
    for (i, _), e in med.items():
        if i == "polar_bf16":
            t_fp32 = e["flops"]["fp32"] / (ceil["fp32"] * eff["fp32"])
            bf.append(e["flops"]["bf16"] / ceil["bf16"] / (e["median_s"] - t_fp32))
    eff["bf16"] = mean(bf)
    eff["tf32x3"] = eff["tf32x2"] = eff["bf16"]
    return eff


def _time(work: dict[str, float], ceil: dict, eff: dict) -> float:
    return sum(f / (ceil[u] * eff[u]) for u, f in work.items())


def predict(name: str, set_name: str, ceil: dict, eff: dict) -> tuple[float, dict[str, float]]:
    """(seconds, FLOPs per unit) of candidate `name` on one bucket set."""
    spec, _ = CANDIDATES[name]
    buckets = bucket_shapes([s for _, s in decoder_weight_shapes(SETS[set_name])])
    total, flops = 0.0, {}
    for b, m, n in buckets:
        k, r = max(m, n), min(m, n)
        if isinstance(spec, tuple):  # auto: gram or the polar variant, as the library's rule picks
            use_gram = flatten.gram_beats_polar(m, n, 1.0) if spec[1] == "polar" else None
            options = {"gram": _registry("gram")(k, r), "polar": _registry(spec[1])(k, r)}
            if use_gram is None:
                work = min(options.values(), key=lambda w: _time(w, ceil, eff))
            else:
                work = options["gram" if use_gram else "polar"]
        else:
            work = spec(k, r)
        work = {("fp32" if u == flatten.COMPUTE else u): f for u, f in work.items()}
        total += b * _time(work, ceil, eff)
        for u, f in work.items():
            flops[u] = flops.get(u, 0.0) + b * f
    return total, flops


MEASURED_NAMES = {"polar": "polar", "gram": "gram", "auto": "auto", "polar_bf16 as run": "polar_bf16"}


def table(run: dict, measured: dict | None = None, names: dict | None = None) -> str:
    """The markdown table: every candidate on every set, predicted at the fitted efficiencies and
    at TUNED_TC_EFFICIENCY on the tensor-core units, beside what a run measured."""
    ceil = ceilings_of(run)
    eff = fit_efficiency(run)
    tuned = dict(eff, bf16=TUNED_TC_EFFICIENCY, tf32x3=TUNED_TC_EFFICIENCY, tf32x2=TUNED_TC_EFFICIENCY)
    src = measured if measured is not None else _medians(run)
    names = names if names is not None else {v: k for k, v in MEASURED_NAMES.items()}
    names = {v: k for k, v in names.items()}  # candidate -> measured impl
    lines = [
        "| candidate | set | predicted (fitted) | predicted (tuned) | measured | TFLOP by unit | target | what it is |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, (_, note) in CANDIDATES.items():
        for set_name in SET_NAMES:
            t, flops = predict(name, set_name, ceil, eff)
            t_tuned, _ = predict(name, set_name, ceil, tuned)
            impl = names.get(name)
            meas = _fmt(src[(impl, set_name)]["median_s"]) if (impl, set_name) in src else "–"
            tgt = TARGETS.get((name.split(" ")[0], set_name)) if name in ("fast", "auto with polar_tf32x3") else None
            verdict = "–"
            if tgt is not None:
                verdict = f"≤ {_fmt(tgt)}: {'met' if t_tuned <= tgt else 'not met'} even tuned"
                if t <= tgt:
                    verdict = f"≤ {_fmt(tgt)}: met"
            by_unit = ", ".join(f"{u} {f / 1e12:.0f}" for u, f in sorted(flops.items()))
            lines.append(
                f"| {name} | {set_name} | {_fmt(t)} | {_fmt(t_tuned)} | {meas} | {by_unit} | {verdict} | {note} |"
            )
    head = [
        f"Ceilings (TFLOP/s): {', '.join(f'{u} {v / 1e12:.1f}' for u, v in ceil.items())}.",
        f"Fitted efficiencies: {', '.join(f'{u} {v:.2f}' for u, v in eff.items())} (tf32x3 and tf32x2 "
        f"have no measurement: they take bf16's); tuned: {TUNED_TC_EFFICIENCY} on bf16, tf32x3 and tf32x2.",
        "",
    ]
    return "\n".join(head + lines) + "\n"


def _fmt(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=str(RUN), help="the device run whose ceilings and medians calibrate the model")
    ap.add_argument("--measured", default=None, help="a later run's JSON: its medians go beside the predictions")
    ap.add_argument("--out", default=None, help="write the table here (markdown) as well as to stdout")
    args = ap.parse_args(argv)
    run = load_run(Path(args.run))
    measured = _medians(load_run(Path(args.measured))) if args.measured else None
    names = None
    if measured is not None:  # a later run: every registered candidate by its own name
        names = {n: n for n in ("polar", "gram", "auto", "polar_tf32x3", "polar_bf16", "fast")}
    text = table(run, measured, names)
    print(text)
    if args.out:
        Path(args.out).write_text(
            "# Predicted flatten times (bench/time_model.py)\n\n"
            f"Calibrated on `{Path(args.run).relative_to(ROOT) if Path(args.run).is_absolute() else args.run}`"
            " (fp32 input). Regenerate: `python bench/time_model.py --out bench/results/time_model.md`.\n\n" + text
        )
    return 0


# -- the Nesterov op: bytes per element of each route -----------------------------------------------
#
# The update itself needs five passes over the tensors (read param, buffer, update; write param, buffer):
# its floor, the bytes `harness` counts as compulsory. What the finiteness rule adds depends on what the
# caller already knows (ops.py, "The finiteness rule"):
#   bare        torch.ops.isoloco.nesterov_outer_(…) with no bounds: one fused amax pass reads the param,
#               the buffer and the update before anything is written (3 reads more);
#   bounds      the same op given `amax` (the optimizers' route: their one pass over grads and params,
#               `outer.core.collect`, found the bounds; a buffer this optimizer wrote last step is not read
#               at all, `_trusted_bound`): nothing more inside the op;
#   step        the optimizers' whole Nesterov half: `collect`'s pass over the grad and the param, then the
#               op with bounds. For a 2-D param the grad is read by the flatten anyway (its pack copy), so a
#               fused pack + amax would take 1 read off; the param read stays: an in-place write that bypasses
#               the version counter cannot be ruled out, and the update must not start on a non-finite param.
# A tensor whose bound cannot show its update fits the compute dtype goes aside in float64 (reads p, b, u,
# three float64 temporaries written and read, p and b written): rare (entries near the dtype's largest),
# and priced here only as its own route.


def nesterov_bytes(route: str, param_bytes: int = 4, buf_bytes: int = 4, update_bytes: int = 4) -> dict:
    """Bytes per element the Nesterov update moves on `route` ("bare", "bounds", "step" above; "aside": the
    float64 path of one tensor), beside its floor (the five compulsory passes) and the share of copy bandwidth the floor
    leaves at best (floor / bytes)."""
    floor = 2 * param_bytes + 2 * buf_bytes + update_bytes
    if route == "aside":
        moved = floor + 3 * 2 * 8  # p, b, u in float64, each written once and read once
    elif route == "bare":
        moved = floor + param_bytes + buf_bytes + update_bytes
    elif route == "bounds":
        moved = floor
    elif route == "step":
        moved = floor + param_bytes + update_bytes  # collect reads the param and the grad (the update)
    else:
        raise ValueError(f"route must be 'bare', 'bounds', 'step' or 'aside', got {route!r}")
    return {"route": route, "bytes": moved, "floor": floor, "best_share_of_copy": floor / moved}


if __name__ == "__main__":
    raise SystemExit(main())
