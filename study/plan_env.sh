# Sourced by the study's plans (`source "$(dirname "$0")/../plan_env.sh"` from study/<question>/): strict variables,
# the repository root, one BLAS thread per runner, the niced study v3 runner ($R) and the best-config jobs ($BEST).
# Each plan names its question's results folder ($O, study/<question>/results) itself.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
R="nice -n 15 python study/run_study.py --part v3"
BEST=best:diloco,isoloco,ddp
