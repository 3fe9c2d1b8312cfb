#!/usr/bin/env bash
# One script for a lent GPU machine (one GPU, CUDA torch, nvcc, nothing downloadable), at most
# 8 minutes wall from a bare machine:
#   1. build the CUDA extension (sm_90 only unless TORCH_CUDA_ARCH_LIST says otherwise);
#   2. every CUDA test (`pytest tests -m cuda`: the tests that skip without a GPU);
#   3. gram against polar on this GPU and auto's choice;
#   4. the FSDP2 outer step on one GPU (NCCL, world size 1, host syncs counted);
#   5. IsoLoCo.step on llama-1b phase by phase per method (checks, pack, flatten, Nesterov as % of
#      copy bandwidth, host syncs; bench/test_bench_step.py);
#   6. memory peaks: one untimed call per method on llama-1b and llama-8b (bench/memory_peaks.py),
#      beside the CPU model (bench/memory_model.py);
#   7. a short training run on the GPU (python -m isoloco_kernels.train, every mode: tokens/s and
#      the outer step's share of the rounds);
#   8. the GPU benchmarks: Nesterov on llama-1b's fp32 params (as % of copy bandwidth), then
#      iso_merge_ per method (with its error against reference.py) on the llama-178m and
#      llama-1b bucket sets until the budget ends;
#   9. a short table, printed last.
# (Between 5 and 6: the merges at K 8; the compression kernels; one-triangle products against cuBLAS and fast's
# two routes.) Study v6's GPU point runs in a call of its own: bash study/scale/gpu_point.sh (~7 minutes).
# Everything goes under $OUT (default bench/results): <date>-<device>.{log,tests.log,json,md},
# <date>-<device>-{fsdp2.json,step.json,memory.jsonl}, <date>-<device>-train/results.json.
#
#   bash bench/device_check.sh              # from anywhere; runs in the repository root
#   BUDGET_S=300 bash bench/device_check.sh # a tighter wall-clock budget (default 470 s)
#   TEST_S=170 bash bench/device_check.sh   # seconds for the CUDA tests (default 150, or 80 when short)
#   bash bench/device_check.sh --dry-run    # (or DRY_RUN=1) end to end on a CPU machine: builds
#                                           # nothing (uses the extension if built), collects the
#                                           # CUDA tests only, runs CPU stand-ins of the rest
#
# Every step runs under `timeout`, so the script ends within BUDGET_S + ~20 s whatever hangs. The
# benchmark step is stopped with SIGINT, which lets pytest-benchmark write the JSON of the cases
# that finished; cases run in the order of --bench-sets, the ones behind the targets first.
set -u -o pipefail
cd "$(dirname "$0")/.."

DRY_RUN=${DRY_RUN:-0}
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
START=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
PY=${PYTHON:-python3}
left() { echo $(( START + BUDGET_S - $(date +%s) )); }
cap() { local t=$(( $(left) - ${2:-0} )); echo $(( t < $1 ? (t > 5 ? t : 5) : $1 )); }  # min(cap, left - reserve), ≥ 5 s

if [ "$DRY_RUN" = 1 ]; then
    DEV=dry-run-cpu
    BENCH_DEVICE=cpu
    FLATTEN_SETS=ref-tiny
    NESTEROV_SETS=ref-tiny
    FSDP_ARGS="--device cpu --set ref-tiny --rounds 2"
    STEP_SETS=ref-tiny
    STEP_SEL='polar and not bf16 and not tf32x3'
    PEAK_ARGS="--device cpu --sets ref-tiny --methods polar"
    TRAIN_ARGS="--device cpu --model tiny -K 2 -H 2 -R 2 --batch 2 --seq-len 16 --eval-windows 8 --max-bytes 60000 --threads 1"
else
    DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9._\n-' '-' | tr -s '-')
    DEV=${DEV:-nogpu}
    BENCH_DEVICE=cuda
    FLATTEN_SETS=llama-178m,llama-1b
    NESTEROV_SETS=llama-1b
    FSDP_ARGS="--device cuda --set llama-178m --rounds 5"
    STEP_SETS=llama-1b
    STEP_SEL='auto or gram or polar or fast'
    PEAK_ARGS="--device cuda"
    TRAIN_ARGS="--device cuda --model small -K 4 -H 20 -R 3 --batch 16 --seq-len 128 --max-bytes 3000000"
fi
NAME="$(date -u +%Y-%m-%d)-${DEV}"
RES=${OUT:-bench/results}
mkdir -p "$RES"
LOG="$RES/$NAME.log"
JSON="$RES/$NAME.json"
JSON_NESTEROV="$RES/$NAME-nesterov.json"
JSON_STEP="$RES/$NAME-step.json"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

step() { echo; echo "=== [$(( $(date +%s) - START )) s] $*"; }

step "machine (dry run: $DRY_RUN)"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: no GPU"
timeout 60 "$PY" - <<'EOF'
import torch, triton
print("torch", torch.__version__, "| triton", triton.__version__, "| cuda", torch.version.cuda,
      "| gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
EOF

BUILD_RC=0
if [ "$DRY_RUN" = 1 ]; then
    step "build: skipped (dry run; the extension as built, if at all)"
else
    step "build the CUDA extension (${TORCH_CUDA_ARCH_LIST:-9.0} only, to save time)"
    timeout 200 env ISOLOCO_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS=16 \
        "$PY" -m pip install --no-build-isolation --no-deps -e . -q || BUILD_RC=$?
    echo "build exit code: $BUILD_RC (non-zero: the CuPy/Triton/torch fallbacks serve the benchmarks)"
fi
timeout 60 "$PY" -c "import isoloco_kernels as ik; [print(f'  {k}: {v}') for k, v in ik.backends().items()]"

step "every CUDA test (pytest tests -m cuda)"
if [ "$DRY_RUN" = 1 ]; then
    timeout 120 "$PY" -m pytest tests -q -p no:cacheprovider -m cuda --collect-only -o addopts="" | tail -3
    TEST_RC=$?
else
    TEST_S=${TEST_S:-$(( $(left) > 360 ? 150 : 80 ))}
    timeout -s INT -k 10 "$TEST_S" "$PY" -m pytest tests -q -p no:cacheprovider -m cuda -o addopts="" \
        -rs --durations=5 2>&1 | tee "$RES/$NAME.tests.log" | tail -60
    TEST_RC=$?
fi
echo "tests exit code: $TEST_RC"

if [ "$DRY_RUN" = 1 ]; then SECS=0.05; else SECS=0.4; fi
bench() {  # bench SECONDS JSON FILE SETS SELECTION
    timeout -s INT -k 15 "$1" "$PY" -m pytest "$3" -q -p no:cacheprovider -o addopts="" ${5:+-k "$5"} \
        --benchmark-only --bench-devices "$BENCH_DEVICE" --bench-seconds "$SECS" --bench-sets "$4" \
        --benchmark-json "$2" --benchmark-columns=median,rounds --benchmark-sort=name 2>&1 | tail -25
    echo "exit code: $? (2 or 130: stopped at the time budget; finished cases are in $2)"
}

step "IsoLoCo.step phase by phase ($STEP_SETS: checks, pack, flatten, Nesterov, host syncs)"
bench "$(cap 70 60)" "$JSON_STEP" bench/test_bench_step.py "$STEP_SETS" "test_step_phases and ($STEP_SEL)"
timeout 30 "$PY" - "$JSON_STEP" <<'EOF' || echo "no step phases to show"
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    e = b["extra_info"]
    ms = lambda k: f"{e[k] * 1e3:.1f}"
    print(f"{e['set']} {e['impl']}: step {b['stats']['median'] * 1e3:.1f} ms | checks {ms('checks_s')} | pack "
          f"{ms('pack_s')} | flatten {ms('flatten_s')} | prepare {ms('prepare_s')} | Nesterov {ms('nesterov_s')} ms "
          f"({e['nesterov_frac_copy']:.0%} of copy) | overhead {e['overhead_frac']:.0%} | syncs {e['host_syncs']} | "
          f"peak extra {(e['peak_extra_bytes'] or 0) / 2**30:.2f} GiB")
EOF

step "memory peaks: one untimed call per method (bench/memory_peaks.py), beside the model"
PEAK_S=$(cap 80 60)
timeout -k 10 "$PEAK_S" "$PY" bench/memory_peaks.py $PEAK_ARGS --seconds $(( PEAK_S > 40 ? PEAK_S - 35 : 5 )) \
    --json "$RES/$NAME-memory.jsonl" || echo "memory peaks stopped at the time budget (finished cases in $NAME-memory.jsonl)"
timeout 30 "$PY" bench/memory_model.py | tail -15

step "training on $BENCH_DEVICE (python -m isoloco_kernels.train, every mode)"
timeout -k 10 "$(cap 45 50)" "$PY" -m isoloco_kernels.train $TRAIN_ARGS --quiet --out "$RES/$NAME-train" 2>&1 | tail -12 \
    || echo "training run failed or timed out"
timeout 30 "$PY" - "$RES/$NAME-train/results.json" <<'EOF' || echo "no training results"
import json, sys
res = json.load(open(sys.argv[1]))
for m, r in res["modes"].items():
    share = r.get("outer_share")
    print(f"{m}: {r['tokens_per_s']:,.0f} tokens/s, final loss {r['final_loss']}, outer step "
          + ("n/a" if share is None else f"{share:.1%} of the rounds ({r['outer_step_s']:.2f} s)"))
EOF

step "FSDP2 outer step, world size 1 ($( [ "$DRY_RUN" = 1 ] && echo gloo on the CPU || echo NCCL on the GPU ))"
timeout -k 10 "$(cap 45 40)" "$PY" bench/fsdp2_step.py $FSDP_ARGS --json "$RES/$NAME-fsdp2.json" 2>&1 \
    | grep -v -i "numpy" || echo "fsdp2 step failed or timed out"

step "the five merges, K 8 (bench/test_bench_merges.py: batched vs a per-matrix loop)"
if [ "$DRY_RUN" = 1 ]; then MERGE_SETS=ref-tiny; MERGE_SEL="8 and (tsv or ties)"; else MERGE_SETS=llama-178m; MERGE_SEL=""; fi
bench "$(cap 45 40)" "$RES/$NAME-merges.json" bench/test_bench_merges.py "$MERGE_SETS" "$MERGE_SEL"

step "compressed exchange kernels (bench/test_bench_compress.py: quantize + error feedback + pack, unpack + add)"
if [ "$DRY_RUN" = 1 ]; then COMPRESS_SEL="int4 and cpu"; else COMPRESS_SEL="cuda"; fi
bench "$(cap 40 60)" "$RES/$NAME-compress.json" bench/test_bench_compress.py "ref-tiny" "$COMPRESS_SEL"

step "one-triangle products and fast's routes (triton/sym_gram.py vs torch's GEMM; fast direct vs Gram)"
# bench/probes.py; the dry run takes Triton's interpreter for the one-triangle kernel (tiny shapes)
PROBE_ARGS=$( [ "$DRY_RUN" = 1 ] && echo --dry-run )
timeout "$(cap 40 60)" env TRITON_INTERPRET="$DRY_RUN" "$PY" bench/probes.py sym-routes $PROBE_ARGS || echo "sym / route probe failed"

step "gram vs polar here (float64 Gram space vs float32 direct iteration; auto's choice)"
timeout "$(cap 40 60)" "$PY" bench/probes.py gram-polar $PROBE_ARGS || echo "gram probe failed"

step "benchmarks ($(( $(left) - 25 )) s left for them)"
if [ "$DRY_RUN" = 1 ]; then
    FLATTEN_SEL='polar or gram or auto'
    NESTEROV_SEL='fused or foreach'
else
    FLATTEN_SEL=''
    NESTEROV_SEL=''
fi
# Nesterov first (short), then the flatten per method with its error until the budget ends.
if [ "$(left)" -gt 90 ]; then
    bench "$(cap 60 30)" "$JSON_NESTEROV" bench/test_bench_optim.py "$NESTEROV_SETS" "test_nesterov${NESTEROV_SEL:+ and ($NESTEROV_SEL)}"
    BENCH_S=$(( $(left) - 25 ))
    if [ "$BENCH_S" -gt 30 ]; then
        bench "$BENCH_S" "$JSON" bench/test_bench_flatten.py "$FLATTEN_SETS" "$FLATTEN_SEL"
    fi
else
    echo "no time left for the benchmarks"
fi

step "report"
JSONS=$(ls "$JSON_NESTEROV" "$JSON" 2>/dev/null | tr '\n' ' ')
if [ -n "$JSONS" ]; then
    timeout 60 "$PY" bench/report.py $JSONS --table --out "$RES/$NAME.md" || echo "report failed"
else
    echo "no benchmark JSON was written"
fi
[ -s "$RES/$NAME-fsdp2.json" ] && { cat "$RES/$NAME-fsdp2.json"; echo; }
# The time model's predictions beside this run's medians (bench/results/time_model.md; printed only:
# `python bench/time_model.py --measured <json>` regenerates it from the returned JSON).
if [ -s "$JSON" ]; then
    timeout 60 "$PY" bench/time_model.py --measured "$JSON" | grep -E "^\| (candidate|fast|polar|auto|gram)" \
        || echo "time model failed"
fi
echo "files: $(ls -d "$RES"/"$NAME"* 2>/dev/null | tr '\n' ' ')"
echo "total $(( $(date +%s) - START )) s (budget $BUDGET_S s); build $BUILD_RC, tests $TEST_RC"
