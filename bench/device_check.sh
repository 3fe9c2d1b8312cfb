#!/usr/bin/env bash
# One script for a lent GPU machine (one GPU, CUDA torch, nvcc, nothing downloadable), at most
# 8 minutes wall: build the CUDA extension, run the CUDA/Triton/polar/gram tests, time gram against
# polar, run the GPU benchmarks, write bench/results/<date>-<device>.{json,log,png} (and copy them
# to $OUT if set), print a short table last.
#
#   bash bench/device_check.sh              # from anywhere; runs in the repository root
#   BUDGET_S=300 bash bench/device_check.sh # a tighter wall-clock budget (default 470 s)
#
# Every step runs under `timeout`, so the script ends within BUDGET_S + ~20 s whatever hangs. The
# benchmark step is stopped with SIGINT, which lets pytest-benchmark write the JSON of the cases
# that finished; cases run in the order of --bench-sets, the ones behind the targets first.
set -u -o pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
PY=${PYTHON:-python3}
left() { echo $(( START + BUDGET_S - $(date +%s) )); }

DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9._\n-' '-' | tr -s '-')
DEV=${DEV:-nogpu}
NAME="$(date -u +%Y-%m-%d)-${DEV}"
RES=bench/results
mkdir -p "$RES"
LOG="$RES/$NAME.log"
JSON="$RES/$NAME.json"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

step() { echo; echo "=== [$(( $(date +%s) - START )) s] $*"; }

step "machine"
nvidia-smi -L || echo "nvidia-smi failed"
timeout 60 "$PY" - <<'EOF'
import torch, triton
print("torch", torch.__version__, "| triton", triton.__version__, "| cuda", torch.version.cuda,
      "| gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
EOF

step "build the CUDA extension (sm_90 only, to save time)"
BUILD_RC=0
timeout 200 env ISOLOCO_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS=16 \
    "$PY" -m pip install --no-build-isolation --no-deps -e . -q || BUILD_RC=$?
echo "build exit code: $BUILD_RC (non-zero: the torch/Triton fallbacks serve the benchmarks)"
timeout 60 "$PY" -c "import isoloco_kernels as ik; print(ik.backends())"

step "CUDA, Triton, polar and gram tests"
TEST_S=$(( $(left) > 360 ? 130 : 60 ))
timeout -s INT -k 10 "$TEST_S" "$PY" -m pytest tests -q -p no:cacheprovider -k "cuda or triton or polar or gram" \
    -o addopts="" --durations=5
TEST_RC=$?
echo "tests exit code: $TEST_RC"

step "gram vs polar on this GPU (float64 Gram space vs float32 direct iteration; auto's choice)"
timeout 90 "$PY" - <<'EOF' || echo "gram probe failed"
import time, torch, warnings
import isoloco_kernels as ik
from isoloco_kernels import flatten
from isoloco_kernels.reference import iso_flatten_ref
warnings.simplefilter("ignore")
dev = torch.device("cuda")
cap = torch.cuda.get_device_capability(dev)
print("compute capability", cap, "| FP64_RATE table:", flatten.FP64_RATE.get(cap, 0.0))
for shape in [(8, 1024, 1024), (4, 1024, 4096), (2, 2048, 32000), (16, 256, 256)]:
    g = torch.Generator(device=dev).manual_seed(0)
    b, m, n = shape
    u, _ = torch.linalg.qr(torch.randn(b, m, m, device=dev, generator=g))
    v, _ = torch.linalg.qr(torch.randn(b, n, m, device=dev, generator=g))
    x = (u * torch.logspace(0, -4, m, device=dev)) @ v.mT  # cond 1e4
    ref = iso_flatten_ref(x[:1])
    row = []
    for meth in ("polar", "gram"):
        y = x.clone(); ik.iso_merge_([y], method=meth); torch.cuda.synchronize()
        err = float((y[:1].double().cpu() - ref).norm() / ref.norm())
        ts = []
        for _ in range(5):
            y.copy_(x); torch.cuda.synchronize(); t = time.perf_counter()
            ik.iso_merge_([y], method=meth); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
        row.append(f"{meth} {min(ts) * 1e3:.2f} ms err {err:.1e}")
    print(shape, " | ".join(row), "| auto ->", flatten.resolve_method("auto", x))
EOF

step "GPU benchmarks ($(( $(left) - 35 )) s left for them)"
BENCH_S=$(( $(left) - 35 ))
if [ "$BENCH_S" -gt 30 ]; then
    timeout -s INT -k 15 "$BENCH_S" "$PY" -m pytest bench -q -p no:cacheprovider -o addopts="" \
        --benchmark-only --bench-devices cuda --bench-seconds 0.4 \
        --bench-sets llama-178m,ref-tiny,llama-tiny,llama-1b,wide-vocab \
        --benchmark-json "$JSON" --benchmark-columns=median,rounds --benchmark-sort=name
    echo "benchmarks exit code: $? (2 or 130: stopped at the time budget; finished cases are in the JSON)"
else
    echo "no time left for the benchmarks"
fi

step "report"
if [ -s "$JSON" ]; then
    timeout 60 "$PY" bench/report.py "$JSON" --table --out "$RES/$NAME.md" || echo "report failed"
else
    echo "no benchmark JSON was written"
fi

if [ -n "${OUT:-}" ]; then
    cp "$RES/$NAME".* "$OUT"/ 2>/dev/null
    echo "copied $(ls "$RES/$NAME".* 2>/dev/null | tr '\n' ' ') to \$OUT"
fi
echo "total $(( $(date +%s) - START )) s (budget $BUDGET_S s); build $BUILD_RC, tests $TEST_RC"
