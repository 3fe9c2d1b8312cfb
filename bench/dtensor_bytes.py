"""Bytes per IsoLoCo outer step for FSDP2-sharded models: Gram all-reduce vs gather-to-owner vs all-gather.

Counts, from the shapes alone, what one rank sends for the Iso-C part of one outer step when every
2-D weight is FSDP-sharded along dim 0 (Shard(0), torch.chunk sizes) over W ranks of a 1-D mesh.
Nesterov and the 1-D params send nothing. Ring collectives: an all-gather sends (W−1)·(largest
shard) per rank, an all-reduce of P bytes 2·(W−1)/W·P. The owner route sends the shards out in the
grad's element size b and the results back in the compute dtype's, r = max(b, 4) (float32 for
float16/bfloat16 grads): (W−1)/W²·(b + r)·m·n per rank on average. The route rule and the two
byte counts it weighs are the package's (`isoloco_kernels.distributed.routes`: `route_for`,
`gram_bytes`, `owner_bytes`, `gather_bytes`); the per-model totals are here
(`wire_bytes`). tests/distributed/test_dtensor.py checks that the collectives the step issues
carry exactly the element counts these formulas assume.

    python -m bench.dtensor_bytes > bench/results/<date>-dtensor-bytes.md
"""

from __future__ import annotations

from bench.shapes import SETS, ModelSpec, decoder_weight_shapes
from isoloco_kernels.distributed.routes import gather_bytes, gram_bytes, owner_bytes, route_for

WORLDS = (2, 4, 8)
DTYPES = ((4, "float32"), (2, "bfloat16"))
# Not in bench/shapes.py: a llama-3-8B-sized shape (full-size k, v as the other sets; no GQA).
LLAMA_8B = ModelSpec("llama-8b", vocab=128256, hidden=4096, layers=32, ffn=14336, note="full-size k/v")
# NVLink 4 on an 8×H200 HGX board: 900 GB/s per GPU, both directions together (data sheet), so
# 450 GB/s each way. Ring collectives at the full link rate, no latency: a lower bound on time.
NVLINK_BYTES_PER_S = 450e9


def wire_bytes(shapes, world: int, elem_size: int = 4, mode: str = "auto", dim: int = 0) -> dict[str, float]:
    """Bytes sent per rank (owner: the mean over ranks) in one outer step for the 2-D `shapes` under
    FSDP's Shard(dim) on a 1-D mesh of `world` ranks: each route alone ("gram_or_gather": the Gram
    where the shard is the long side, else the all-gather), and the routes `mode` picks. 1-D params
    cost nothing (Nesterov is local). Keys: "allgather", "owner", "gram_or_gather", "chosen"."""
    out = {"gram_or_gather": 0.0, "owner": 0.0, "allgather": 0.0, "chosen": 0.0}
    for sh in shapes:
        if len(sh) != 2:
            continue
        cost = {
            "gram": gram_bytes(sh, world),
            "gather": gather_bytes(sh, dim, world, elem_size),
            "owner": owner_bytes(sh, dim, world, elem_size),
            "local": 0.0,
        }
        out["allgather"] += cost["gather"]
        out["owner"] += cost["owner"]
        long_side = route_for(sh, dim, world, elem_size, "gram") == "gram"
        out["gram_or_gather"] += cost["gram"] if long_side else cost["gather"]
        out["chosen"] += cost[route_for(sh, dim, world, elem_size, mode)]
    return out


def result_size(elem: int) -> int:
    """Element size of the owner route's results: the compute dtype's (float32 for 2-byte grads)."""
    return max(elem, 4)


def gram_threshold(world: int, elem: int) -> float:
    """The aspect (long/short) above which the Gram all-reduce sends fewer bytes than the owner
    route: 2·(W−1)/W·8d² < (W−1)/W²·(b + r)·k·d  ⇔  k/d > 16·W/(b + r)."""
    return 16 * world / (elem + result_size(elem))


def per_rank(spec: ModelSpec, world: int, elem: int) -> dict[str, float]:
    out = dict(allgather=0.0, owner=0.0, gram_long=0.0, auto=0.0, n_gram=0, n_mat=0)
    for _, sh in decoder_weight_shapes(spec):
        ag = gather_bytes(sh, 0, world, elem)
        gr = gram_bytes(sh, world)
        out["allgather"] += ag
        out["owner"] += owner_bytes(sh, 0, world, elem)
        out["gram_long"] += gr if route_for(sh, 0, world, elem, "gram") == "gram" else ag
        auto = route_for(sh, 0, world, elem, "auto")
        out["auto"] += {"gram": gr, "gather": ag}.get(auto, owner_bytes(sh, 0, world, elem))
        out["n_gram"] += auto == "gram"
        out["n_mat"] += 1
    return out


def _mb(b: float) -> str:
    return f"{b / 1e6:,.1f}"


def table(specs, elem: int) -> list[str]:
    rows = [
        "| set | W | all-gather | owner (mean/rank) | Gram where long side, else all-gather | auto (default) | auto: Gram matrices |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for spec in specs:
        for w in WORLDS:
            r = per_rank(spec, w, elem)
            rows.append(
                f"| {spec.name} | {w} | {_mb(r['allgather'])} | {_mb(r['owner'])} | {_mb(r['gram_long'])} | "
                f"{_mb(r['auto'])} | {r['n_gram']} of {r['n_mat']} |"
            )
    return rows


def _aspect(spec: ModelSpec) -> float:
    return spec.vocab / spec.hidden


def _reading(specs) -> list[str]:
    """The reading of the tables, with every number that depends on them computed here."""
    owner_more = [f"{name} at W = {w}" for elem, name in DTYPES for w in WORLDS if w * elem < elem + result_size(elem)]
    no_gram = [
        f"{name} {spec.name} at W = {w}"
        for elem, name in DTYPES
        for spec in specs
        for w in WORLDS
        if per_rank(spec, w, elem)["n_gram"] == 0
    ]
    aspects = ", ".join(f"{_aspect(s):.0f} for {s.name}" for s in specs)
    lines = [
        "Reading: sending every sharded matrix through the Gram is *worse* than all-gathering it for",
        "square and near-square matrices (8·d² float64 bytes, all-reduced, against b·d² of the matrix);",
        f"it pays for the vocab × hidden embedding and LM head (long/short {aspects}), where one d×d",
        "all-reduce replaces moving the matrix. The owner route sends W·b/(b + r) times fewer bytes than",
        "the all-gather (W/2 for float32, W/3 for bfloat16, whose results come back in float32) and",
        "flattens each matrix once (the all-gather repeats every flatten on every rank); it costs two",
        "all-to-alls and an owner plan balanced by flatten cost.",
    ]
    if owner_more:
        lines.append(
            f"Where W·b < b + r ({', '.join(owner_more)}) the owner route sends *more* than the all-gather; "
            "auto takes it even so: it weighs the bytes over the link with the flatten's work "
            "(`routes.route_seconds`), which the owner route does once and the all-gather on every rank, "
            "and that work outweighs the bytes saved for every matrix with both sides above 2."
        )
    lines.append(
        "The auto rule takes the Gram for the embedding and LM head "
        + (
            f"except where the owner route is already cheaper ({', '.join(no_gram)})"
            if no_gram
            else "in every case above"
        )
        + " and the owner route for all others."
    )
    return lines


def main() -> None:
    specs = [SETS["llama-178m"], SETS["llama-1b"]]
    thresholds = "; ".join(
        f"{name}: " + ", ".join(f"{gram_threshold(w, elem):.3g} at W = {w}" for w in WORLDS) for elem, name in DTYPES
    )
    lines = [
        "# Bytes per IsoLoCo outer step under FSDP2 (DTensor params)",
        "",
        "Counted from the shapes (bench/dtensor_bytes.py; the route rule of isoloco_kernels/distributed/routes.py), not timed.",
        "Every 2-D weight Shard(0) over W ranks of a 1-D mesh (FSDP2's layout, torch.chunk sizes), untied",
        "embedding and LM head, full-size k/v (bench/shapes.py). MB (1e6 bytes) **sent per rank** for the",
        "Iso-C part of one outer step; Nesterov and 1-D params send nothing. b is the grad's element size,",
        "r = max(b, 4) the result's: every route computes in float32 for float16/bfloat16 grads.",
        "",
        "- all-gather: every matrix all-gathered (ring: (W−1) × largest shard per rank), flattened on every rank.",
        "- owner: each matrix's shards sent to one owner by all-to-all (in the grad's dtype), flattened there,",
        "  the result's shards sent back (in float32 for bfloat16 grads); (W−1)/W²·(b + r)·m·n bytes per rank",
        "  on average (owners balanced by flatten cost; the busiest rank sends more).",
        "- Gram where long side: A₀ = Σ XᵢᵀXᵢ (d×d float64) all-reduced (ring: 2·(W−1)/W · 8d² per rank) for",
        "  every matrix sharded along its long side (embedding, LM head, gate, up, and the square q/k/v/o),",
        "  all-gather for the others (down: hidden × ffn is sharded along its short side).",
        "- auto: what `IsoLoCo` does by default, per matrix the cheaper of Gram and owner: the Gram when the",
        f"  shard is the long side and long/short > 16·W/(b + r) ({thresholds}), else the owner route.",
        "",
    ]
    for elem, name in DTYPES:
        lines += [f"## {name} pseudo-gradients", ""] + table(specs, elem) + [""]
    lines += _reading(specs) + [
        "",
        "## Paper estimate: 8 × H200 over NVLink (W = 8, one replica)",
        "",
        f"Inputs: NVLink 4 at {NVLINK_BYTES_PER_S / 1e9:.0f} GB/s per GPU per direction (data sheet: 900 GB/s",
        "bidirectional); ring collectives at the full link rate, latency ignored, so these are lower",
        "bounds on communication time; the owner and auto columns use the mean bytes per rank (the",
        "busiest owner sends more). Nothing here was measured on a GPU.",
        "",
        "| set | dtype | all-gather | auto | Gram where long side, else all-gather | owner |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for spec in (SETS["llama-1b"], LLAMA_8B):
        for elem, dt in DTYPES:
            r = per_rank(spec, 8, elem)
            ms = {k: r[k] / NVLINK_BYTES_PER_S * 1e3 for k in ("allgather", "auto", "gram_long", "owner")}
            lines.append(
                f"| {spec.name} | {dt} | {ms['allgather']:.2f} ms | {ms['auto']:.2f} ms | "
                f"{ms['gram_long']:.2f} ms | {ms['owner']:.2f} ms |"
            )
    lines += [
        "",
        f"{LLAMA_8B.name}: vocab {LLAMA_8B.vocab}, hidden {LLAMA_8B.hidden}, {LLAMA_8B.layers} layers, ffn "
        f"{LLAMA_8B.ffn}, {LLAMA_8B.note} (Llama-3-8B uses grouped k/v: 1024 × 4096, which this overstates).",
        "",
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
