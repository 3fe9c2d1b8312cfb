#!/usr/bin/env bash
# Study v4: how exact must the flatten be for training? IsoLoCo at each cell's v3-tuned outer lr and μ
# (0.8), with the flatten method as the only change, 3 seeds, every method paired with the exact "svd"
# on the same seed. Priority order, so a plan stopped early holds whole methods: v1/v2's cell (K 4,
# H 30) with every method, then H 100, K 16 with Muon inner steps and BPE-8192 at K 8 with the methods
# that decide the default (svd, fast, polar_bf16, ns5) first. The seed-0 svd run of each cell also
# captures Δ in its first, middle and last round and measures every method on it (--spectra).
# One process, nice 15, one thread (run_study.py sets torch's threads to 1); finished runs are skipped,
# so a stopped plan resumes.
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
R="nice -n 15 python study/run_study.py --part v4 --seeds 0,1,2"
O=study/results
S=$O/spectra/v4_spectra.jsonl
KEY=svd,fast,polar_bf16,ns5  # the anchor, the training grade, the certified bf16 grade, Muon's kernel
REST=pe_bf16,polar,svd_cut1e-2,svd_noise1e-1,svd_noise3e-1,svd_cut3e-2,svd_cut1e-3,polar_tf32x3
# 1. v1/v2's cell (v3: IsoLoCo 3.2 @ 0.8): every method
$R --cells 4:30 --lrs isoloco=3.2 --iso-method $KEY,$REST --spectra $S --out $O/v4_base.jsonl
# 2. H 100 at R 10 (v3: 2.4 @ 0.8)
$R --cells 4:100 --steps 1000 --lrs isoloco=2.4 --iso-method $KEY --spectra $S --out $O/v4_h.jsonl
# 3. K 16, Muon inner steps (v3: 2.4 @ 0.8)
$R --cells 16:30 --inner muon --lrs isoloco=2.4 --iso-method $KEY --spectra $S --out $O/v4_muon.jsonl
# 4. BPE-8192 at K 8 (v3: 2.4 @ 0.8)
$R --cells 8:30 --vocab 8192 --lrs isoloco=2.4 --iso-method $KEY --spectra $S --out $O/v4_bpe.jsonl
# 5. the other methods at H 100, K 16 and BPE, as time allows
$R --cells 4:100 --steps 1000 --lrs isoloco=2.4 --iso-method $REST --out $O/v4_h.jsonl
$R --cells 16:30 --inner muon --lrs isoloco=2.4 --iso-method $REST --out $O/v4_muon.jsonl
$R --cells 8:30 --vocab 8192 --lrs isoloco=2.4 --iso-method $REST --out $O/v4_bpe.jsonl
