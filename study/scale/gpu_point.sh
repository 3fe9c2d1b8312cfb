#!/usr/bin/env bash
# Study v6, part D on a lent GPU (one call of its own, ~7 minutes): the ~100M base preset, K 8, H 30, bf16 autocast,
# DiLoCo (official 0.7 @ 0.9 and the study's pick) against IsoLoCo (1.8 @ 0.8), one seed, as many rounds as fit in
# BUDGET_S (default 360 s). Writes study/scale/results/gpu_point/<date>-<device>-gpu_point.jsonl (a folder of its own:
# not run records, which summarize.py reads from results/*.jsonl) and prints the curves.
#
#   bash study/scale/gpu_point.sh              # on the GPU machine
#   bash study/scale/gpu_point.sh --dry-run    # toy size on the CPU (what CI checks)
#   DILOCO_PICK=0.7@0.0 BUDGET_S=300 bash study/scale/gpu_point.sh
set -u -o pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9._\n-' '-' | tr -s '-')
EXTRA=()
if [ "${1:-}" = "--dry-run" ]; then EXTRA=(--dry-run); DEV=dry-run-cpu; fi
OUTF=${OUT:-study/scale/results/gpu_point}/$(date -u +%Y-%m-%d)-${DEV:-nogpu}-gpu_point.jsonl
timeout -k 10 $(( ${BUDGET_S:-360} + 90 )) "$PY" study/scale/gpu_point.py --out "$OUTF" --budget-s "${BUDGET_S:-360}" \
    --diloco-pick "${DILOCO_PICK:-0.7@0.0}" "${EXTRA[@]}"
echo "exit code $?; wrote $OUTF"
