# Sourced by the study's plans (`source "$(dirname "$0")/plan_env.sh"`): strict variables, the repository root, one
# BLAS thread per runner, the niced study v3 runner ($R), the results folder ($O) and the best-config jobs ($BEST).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
R="nice -n 15 python study/run_study.py --part v3"
O=study/results
BEST=best:diloco,isoloco,ddp
