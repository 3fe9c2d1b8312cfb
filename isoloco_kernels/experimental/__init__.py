"""Kernels kept out of every default path, each with the reason.

- triton_gram.py, triton_polar_steps.py: the polar iteration's GEMMs in Triton (a symmetric Gram
  that computes one triangle of tiles; the step X ← a·X + B·X with the axpy fused into the GEMM).
  Never measured faster than cuBLAS, which serves by default; `ISOLOCO_POLAR_GEMM=triton` opts in
  (dispatch.py, table "polar_gemm"). Tested against torch under Triton's interpreter.
"""
