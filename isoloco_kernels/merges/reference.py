"""The paper's five merges of K worker pseudo-gradients and the norm-preserving mean, in float64: the truth the batched merges
(merges/spectral.py, merges/sparse.py) are tested against.

Every function takes one worker stack x = [K, m, n] (Δ_1..Δ_K, global − local; K ≥ 1) and returns the
merged [m, n] pseudo-gradient in float64 on the CPU, at the scale of the mean (so one outer learning rate
means the same step size for every merge). Tensors that are not 2-D are merged by the mean (`merge_ref`).
At K = 1 each rule below is its value for one worker: tsv keeps all r triplets (the delta, recombined),
iso_cts's common and own spaces span all of the delta's directions (its Iso-C), ties trims the delta,
dare drops and rescales it.
Weights w_1..w_K ≥ 0 (`merge_ref(..., weights=)`): the workers with w_i = 0 are removed first (K' workers
remain, and K' is the K of every rule below: TSV-M's ⌊r/K'⌋, Iso-CTS's task share; DARE's drops keep
each worker's own index i), then ω_i = w_i / Σ w replaces 1/K: each worker's share Δ_i/K becomes
ω_i·Δ_i, so every "mean" below is the weighted mean Σ ω_i Δ_i, norm_mean's mean norm is Σ ω_i ‖Δ_i‖_F,
TIES and DARE elect sign(Σ ω_i t_i) and combine Σ ω_i t_i (DARE) or Σ_agree ω_i t_i / Σ_agree ω_i
(TIES). Equal weights are the rules as written.
A clip (`merge_ref(..., clip=)`, `clip_ref`) comes first: per tensor, each worker's Δ_i scaled by
min(1, cap / ‖Δ_i‖) (‖·‖ the 2-norm of all its entries), cap = the median of ‖Δ_i‖ over the workers with
w_i > 0 (the mean of the two middle values for an even count) for clip="median", or the number given; the
clipped Δ_i rounded to the stack's dtype is what the merge reads.
Orthogonalizations are reference.py's polar factor (U_r V_rᵀ with its rank cut), so every result is
basis-free: directions whose singular value is zero (σ ≤ τ·σ_1, reference.rank_tol) carry no
arbitrary LAPACK basis into a result. docs/merges.md says where each departs from the official code.

    mean    (1/K) Σ Δ_i                                          DiLoCo
    iso_c   iso(mean)                     Iso-C (reference.iso_flatten_ref, the rank cut of the input's dtype)
    norm_mean  mean · (mean_i ‖Δ_i‖_F / ‖mean‖_F), 0 where mean = 0: the mean's direction at the
            workers' mean Frobenius norm                            Decoupled DiLoCo's norm rule
    tsv     Δ_i/K = U_i Σ_i V_iᵀ; keep the top k = ⌊r/K⌋ triplets of each (`keep`), U = [U_1,k … U_K,k],
            V likewise, Σ = diag(Σ_1,k … Σ_K,k); result polar(U) Σ polar(V)ᵀ        TSV-M
    iso_cts the mean's top c directions (common space), c = r − (task share), task share =
            round((r − ⌊f·r⌋)/K)·K (f = `common_fraction`, 0.8; round half to even); from each
            Δ_i/K's residual outside the common left space its top (task share)/K triplets;
            U = [U_task… U_common], S = their σ's (r values); result mean(S)·polar(U)·polar(V)ᵀ  Iso-CTS
    ties    trim: each Δ_i keeps its k = max(1, ⌊(1 − p)·n⌋) largest entries by magnitude
            (p = `sparsity`; per matrix, or rows/columns by their 2-norm with `dim`); elect: the sign
            of the sum of the trimmed values; disjoint mean: the mean of the trimmed values that
            agree with it (zeros never agree; none → 0)                           TIES
    dare    drop: each entry (row, column with `dim`) of each Δ_i dropped with probability p
            (`sparsity`), independently, from a counter-based hash of (seed, stack, worker, index)
            (`keep_mask`); the kept ones rescaled by 1/(1 − p); then the mean    DARE
"""

from __future__ import annotations

import torch

from ..reference import polar_ref, rank_tol
from .options import resolve_options

__all__ = [
    "clip_ref",
    "merge_ref",
    "norm_mean_ref",
    "tsv_ref",
    "iso_cts_ref",
    "sparse_ref",
    "keep_mask",
    "task_share",
    "mix32",
]

F64 = torch.float64
_M32 = 0xFFFFFFFF


def task_share(r: int, workers: int, common_fraction: float) -> tuple[int, int]:
    """(common directions, task-specific directions per worker) of Iso-CTS for short side r."""
    common = int(r * common_fraction)
    total = round((r - common) / workers) * workers
    return r - total, total // workers


def _svd_cut(x: torch.Tensor, dtype: torch.dtype):
    """float64 SVD of one matrix with the columns of U and V whose σ is below the rank cut zeroed."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    m, n = x.shape
    keep = (s > rank_tol(m, n, dtype) * s[:1]).to(F64)
    return u * keep, s * keep, vh.mT * keep


def _polar(a: torch.Tensor) -> torch.Tensor:
    return polar_ref(a)[0]


def _omega(K: int, weights) -> torch.Tensor:
    """The rows' normalized weights as float64 [K]: 1/K each for None."""
    if weights is None:
        return torch.full((K,), 1.0 / K, dtype=F64)
    w = torch.as_tensor(weights, dtype=F64).flatten()
    return w / w.sum()


def _shares(x: torch.Tensor, weights) -> torch.Tensor:
    """Each worker's share of the merge, ω_i·Δ_i (Δ_i / K unweighted), in float64."""
    xs = x.detach().to("cpu", F64)
    if weights is None:
        return xs / xs.shape[0]
    return xs * _omega(xs.shape[0], weights).reshape(-1, *[1] * (xs.ndim - 1))


def norm_mean_ref(x: torch.Tensor, weights=None) -> torch.Tensor:
    """norm_mean of a [K, m, n] stack (module docstring), in float64; weights: the rows' (all > 0; None: equal)."""
    xs = x.detach().to("cpu", F64)
    w = _omega(xs.shape[0], weights)
    mean = (xs * w[:, None, None]).sum(0)
    size = torch.linalg.matrix_norm(mean)
    if size == 0:
        return torch.zeros_like(mean)
    return mean * ((torch.linalg.matrix_norm(xs) * w).sum() / size)


def tsv_ref(x: torch.Tensor, keep: int | None = None, weights=None) -> torch.Tensor:
    """TSV-M of a [K, m, n] stack (module docstring); weights: the rows' (all > 0; None: equal)."""
    K, m, n = x.shape
    r = min(m, n)
    k = min(r, keep if keep is not None else max(1, r // K))
    us, ss, vs = [], [], []
    for d in _shares(x, weights):
        u, s, v = _svd_cut(d, x.dtype)
        us.append(u[:, :k])
        ss.append(s[:k])
        vs.append(v[:, :k])
    u, s, v = torch.cat(us, 1), torch.cat(ss), torch.cat(vs, 1)
    return (_polar(u) * s) @ _polar(v).mT


def iso_cts_ref(x: torch.Tensor, common_fraction: float = 0.8, weights=None) -> torch.Tensor:
    """Iso-CTS of a [K, m, n] stack (module docstring); weights: the rows' (all > 0; None: equal)."""
    K, m, n = x.shape
    r = min(m, n)
    common, per = task_share(r, K, common_fraction)
    xs = _shares(x, weights)
    u, s, v = _svd_cut(xs.sum(0), x.dtype)
    uc, sc, vc = u[:, :common], s[:common], v[:, :common]
    us, ss, vs = [], [], []
    for d in xs:
        ut, st, vt = _svd_cut(d - uc @ (uc.mT @ d), x.dtype)
        us.append(ut[:, :per])
        ss.append(st[:per])
        vs.append(vt[:, :per])
    u, s, v = torch.cat(us + [uc], 1), torch.cat(ss + [sc]), torch.cat(vs + [vc], 1)
    return s.mean() * (_polar(u) @ _polar(v).mT)


def mix32(v: int) -> int:
    """A 32-bit integer mixer (xor-shift-multiply): the hash behind DARE's random drops. The
    batched merges compute the same bits on tensors (merges/sparse.py, the Triton kernel)."""
    v &= _M32
    v ^= v >> 16
    v = (v * 0x7FEB352D) & _M32
    v ^= v >> 15
    v = (v * 0x846CA68B) & _M32
    v ^= v >> 16
    return v


def stream_key(seed: int, stack: int, worker: int) -> int:
    """The 32-bit key of one worker's drops in one stack (seed: the caller's, per outer step)."""
    return mix32(mix32(mix32(seed & _M32) ^ (stack & _M32)) ^ (worker & _M32))


def keep_mask(shape, sparsity: float, seed: int, stack: int, worker: int, dim: str = "all") -> torch.Tensor:
    """DARE's keep mask of one worker's [m, n] (or any-shape, dim "all") delta, as booleans: an entry
    (a row, a column) is kept when mix32(key ^ index) / 2³² ≥ sparsity, index its row-major position."""
    key = stream_key(seed, stack, worker)
    count = torch.Size(shape).numel() if dim == "all" else shape[0] if dim == "row" else shape[-1]
    u = torch.tensor([mix32(key ^ i) for i in range(count)], dtype=F64) / 2.0**32
    keep = u >= sparsity
    if dim == "all":
        return keep.reshape(shape)
    return keep[:, None].expand(shape) if dim == "row" else keep[None, :].expand(shape)


def _trim_mask(d: torch.Tensor, sparsity: float, dim: str) -> torch.Tensor:
    """TIES's trim of one delta: entries (rows, columns) whose magnitude (2-norm) is at least the
    k-th largest, k = max(1, ⌊(1 − p)·count⌋); entries tied at the cut are all kept."""
    score = d.abs().flatten() if dim == "all" else d.norm(dim=-1 if dim == "row" else 0)
    k = max(1, int((1 - sparsity) * score.numel()))
    keep = score >= torch.topk(score, k).values[-1]
    if dim == "all":
        return keep.reshape(d.shape)
    return keep[:, None].expand(d.shape) if dim == "row" else keep[None, :].expand(d.shape)


def sparse_ref(
    x: torch.Tensor,
    *,
    sparsity: float,
    prune: str,
    dim: str = "all",
    rescale: bool = False,
    disjoint: bool = False,
    seed: int = 0,
    stack: int = 0,
    masks: torch.Tensor | None = None,
    weights=None,
    workers=None,
) -> torch.Tensor:
    """TIES (prune="magnitude", disjoint) and DARE (prune="random", rescale) of a [K, ...] stack.
    masks: [K, ...] keep masks to use instead of the pruning rule (to replay another's drops).
    weights: the rows' (all > 0; None: equal); workers: each row's worker index in DARE's stream
    (None: its position)."""
    xs = x.detach().to("cpu", F64)
    dim = dim if xs.ndim == 3 else "all"
    ids = list(range(xs.shape[0])) if workers is None else list(workers)
    if masks is None and sparsity > 0:
        if prune == "magnitude":
            masks = torch.stack([_trim_mask(d, sparsity, dim) for d in xs])
        else:
            masks = torch.stack([keep_mask(d.shape, sparsity, seed, stack, i, dim) for i, d in zip(ids, xs)])
    t = xs if masks is None else xs * masks
    if rescale and sparsity > 0:
        t = t / (1 - sparsity)
    if weights is None:
        if not disjoint:
            return t.mean(0)
        agree = torch.sign(t) == torch.sign(t.sum(0))
        return (t * agree).sum(0) / agree.sum(0).clamp_min(1)
    w = _omega(xs.shape[0], weights).reshape(-1, *[1] * (xs.ndim - 1))
    total = (w * t).sum(0)
    if not disjoint:
        return total
    agree = (torch.sign(t) == torch.sign(total)) & (t != 0)
    mass = (w * agree).sum(0)
    return torch.where(mass > 0, (w * t * agree).sum(0) / torch.where(mass > 0, mass, 1), 0)


def clip_ref(x: torch.Tensor, clip, weights=None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The clip of one [K, *shape] stack (module docstring), in float64: (the clipped stack, each worker's
    norm before the clip, the cap). clip: "median" or a number > 0; weights: the median is over w > 0."""
    xs = x.detach().to("cpu", F64)
    norms = (
        torch.stack([torch.linalg.vector_norm(d) for d in xs]) if xs.numel() else torch.zeros(xs.shape[0], dtype=F64)
    )
    if clip == "median":
        pool = norms if weights is None else norms[torch.as_tensor(weights, dtype=F64).flatten() > 0]
        v = pool.sort().values
        n = v.numel()
        cap = float(v[n // 2]) if n % 2 else float((v[n // 2 - 1] + v[n // 2]) / 2)
    else:
        cap = float(clip)
    factor = torch.where(norms > cap, cap / torch.where(norms > 0, norms, 1), torch.ones_like(norms))
    return xs * factor.reshape(-1, *[1] * (xs.ndim - 1)), norms, cap


def merge_ref(x: torch.Tensor, method: str, stack: int = 0, weights=None, clip=None, **options) -> torch.Tensor:
    """The merge `method` of one [K, *shape] stack in float64; not 2-D: the mean (iso_c, norm_mean, tsv,
    iso_cts). weights: K values ≥ 0, one > 0 (None: equal): the workers with weight 0 removed, the rest
    weighted by ω = w / Σ w; clip: None, "median" or a number > 0, applied first (module docstring)."""
    opts = resolve_options(method, options)
    if clip is not None:
        x = clip_ref(x, clip, weights)[0].to(x.dtype)  # the clipped deltas in the stack's dtype: the merge's input
    workers = None
    if weights is not None:
        w = torch.as_tensor(weights, dtype=F64).flatten()
        keep = (w > 0).nonzero().flatten()
        x, weights, workers = x[keep], w[keep] / w[keep].sum(), keep.tolist()
    x64 = x.detach().to("cpu", F64)
    if method in ("ties", "dare"):
        return sparse_ref(x64, stack=stack, weights=weights, workers=workers, **opts)
    if method == "mean" or x.ndim != 3:
        return _shares(x64, weights).sum(0) if weights is not None else x64.mean(0)
    if method == "iso_c":  # reference.iso_flatten_ref of the mean, with the rank cut of x's dtype
        u, s, v = _svd_cut(_shares(x64, weights).sum(0) if weights is not None else x64.mean(0), x.dtype)
        return s.sum() / min(x.shape[-2:]) * (u @ v.mT)
    if method == "norm_mean":
        return norm_mean_ref(x, weights)
    if method == "tsv":
        return tsv_ref(x, weights=weights, **opts)
    return iso_cts_ref(x, weights=weights, **opts)
