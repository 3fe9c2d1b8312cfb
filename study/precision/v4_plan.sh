#!/usr/bin/env bash
# Study v4: how exact must the flatten be for training? IsoLoCo at each cell's v3-tuned outer lr and μ
# (0.8), with the flatten method as the only change, 3 seeds, every method paired with the exact "svd"
# on the same seed. Priority order, so a plan stopped early holds whole methods: v1/v2's cell (K 4,
# H 30) with every method; then the pair that decides the default (svd, fast) in H 100, K 16 with Muon
# inner steps and BPE-8192 at K 8; then polar_bf16 and ns5 there; then the rest. The seed-0 svd run of
# each cell also captures Δ in its first, middle and last round and measures every method on it
# (--spectra). One process, nice 15, one thread (run_study.py sets torch's threads to 1); finished runs
# are skipped, so a stopped plan resumes.
set -u
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
R="nice -n 15 python study/run_study.py --part v4 --seeds 0,1,2"
O=study/precision/results
S=$O/spectra/v4_spectra.jsonl
H100="--cells 4:100 --steps 1000 --lrs isoloco=2.4"  # v3's tuned IsoLoCo: 2.4 @ 0.8
MUON="--cells 16:30 --inner muon --lrs isoloco=2.4"  # 2.4 @ 0.8
BPE="--cells 8:30 --vocab 8192 --lrs isoloco=2.4"  # 2.4 @ 0.8
NEXT=polar_bf16,ns5  # the certified bf16 grade, Muon's kernel
REST1=pe_bf16,svd_noise3e-1,svd_cut1e-2  # no checks at all; the noise the base cell tolerated; the mildest cut that bites
REST2=polar,svd_noise1e-1,svd_cut3e-2,svd_cut1e-3,polar_tf32x3
# 1. v1/v2's cell (v3: IsoLoCo 3.2 @ 0.8): every method
$R --cells 4:30 --lrs isoloco=3.2 --iso-method svd,fast,$NEXT,$REST1,$REST2 --spectra $S --out $O/v4_base.jsonl
# 2. the anchor and the training grade in the other cells
$R $H100 --iso-method svd,fast --spectra $S --out $O/v4_h.jsonl
$R $MUON --iso-method svd,fast --spectra $S --out $O/v4_muon.jsonl
$R $BPE --iso-method svd,fast --spectra $S --out $O/v4_bpe.jsonl
# 3. polar_bf16 and ns5 there
$R $H100 --iso-method $NEXT --out $O/v4_h.jsonl
$R $MUON --iso-method $NEXT --out $O/v4_muon.jsonl
$R $BPE --iso-method $NEXT --out $O/v4_bpe.jsonl
# 4. the other methods, as time allows
$R $H100 --iso-method $REST1 --out $O/v4_h.jsonl
$R $MUON --iso-method $REST1 --out $O/v4_muon.jsonl
$R $BPE --iso-method $REST1 --out $O/v4_bpe.jsonl
$R $H100 --iso-method $REST2 --out $O/v4_h.jsonl
$R $MUON --iso-method $REST2 --out $O/v4_muon.jsonl
$R $BPE --iso-method $REST2 --out $O/v4_bpe.jsonl
