// isoloco::iso_scale_ on CUDA: the fused Iso-C epilogue (kernels in kernels/iso_scale.cuh).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "common.h"
#include "kernels/iso_scale.cuh"

namespace isoloco {
namespace {

void check_operand(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "iso_scale_: ", name, " is undefined");
  TORCH_CHECK_TYPE(supported_dtype(t.scalar_type()), "iso_scale_: ", name, " has unsupported dtype ",
                   t.scalar_type(), "; use float16, bfloat16, float32 or float64");
  TORCH_CHECK_VALUE(t.dim() == 2 || t.dim() == 3, "iso_scale_: ", name,
                    " must be a [m, n] matrix or a [B, m, n] batch, got shape ", t.sizes());
  TORCH_CHECK(t.is_cuda(), "iso_scale_: ", name, " must be a CUDA tensor, got one on ", t.device());
}

// Split each matrix of L elements into nchunks chunks of chunk_len (a multiple of ik::kVec):
// at least 8192 elements a block, at most 256 blocks a matrix. _cupy.py mirrors this.
struct Plan {
  int64_t nchunks, chunk_len;
};
Plan launch_plan(int64_t L) {
  const int64_t want = std::clamp<int64_t>((L + 8191) / 8192, 1, 256);
  int64_t len = (L + want - 1) / want;
  len = (len + ik::kVec - 1) / ik::kVec * ik::kVec;
  return {(L + len - 1) / len, len};
}

at::Tensor iso_scale_cuda(const at::Tensor& x, const at::Tensor& q) {
  check_operand(x, "x");
  check_operand(q, "q");
  TORCH_CHECK_VALUE(x.sizes() == q.sizes(), "iso_scale_: q must have x's shape ", x.sizes(),
                    ", got ", q.sizes());
  TORCH_CHECK(q.device() == x.device(), "iso_scale_: x is on ", x.device(), " but q is on ",
              q.device());
  const c10::cuda::CUDAGuard guard(x.device());

  const bool f64 = x.scalar_type() == at::kDouble;
  const auto opts = x.options().dtype(f64 ? at::kDouble : at::kFloat);
  const int64_t m = x.size(-2), n = x.size(-1), L = m * n;
  const int64_t B = x.dim() == 3 ? x.size(0) : 1;
  at::Tensor sbar = at::zeros(x.sizes().slice(0, x.dim() - 2), opts);
  if (x.numel() == 0) return sbar;  // no elements: s̄ = 0, nothing to write

  at::Tensor xc = x.contiguous();  // x itself when contiguous; otherwise copied back below
  const at::Tensor qc = q.contiguous();
  const Plan plan = launch_plan(L);
  const int64_t blocks = B * plan.nchunks;
  TORCH_CHECK(blocks < (int64_t{1} << 31), "iso_scale_: too many matrices (", B, ")");
  at::Tensor partial = at::empty({blocks}, opts);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  dispatch_storage(x.scalar_type(), "iso_scale_: x", [&]<typename TX>(std::type_identity<TX>) {
    dispatch_storage(q.scalar_type(), "iso_scale_: q", [&]<typename TQ>(std::type_identity<TQ>) {
      using C = compute_t<TX>;
      ik::iso_scale_partial<TX, TQ, C><<<blocks, ik::kBlock, 0, stream>>>(
          static_cast<const TX*>(xc.const_data_ptr()), static_cast<const TQ*>(qc.const_data_ptr()),
          partial.mutable_data_ptr<C>(), L, static_cast<int>(plan.nchunks), plan.chunk_len);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      ik::iso_scale_apply<TX, TQ, C><<<blocks, ik::kBlock, 0, stream>>>(
          static_cast<TX*>(xc.mutable_data_ptr()), static_cast<const TQ*>(qc.const_data_ptr()),
          partial.const_data_ptr<C>(), sbar.mutable_data_ptr<C>(), L,
          static_cast<int>(plan.nchunks), plan.chunk_len, static_cast<C>(std::min(m, n)));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  if (!xc.is_same(x)) x.copy_(xc);
  return sbar;
}

}  // namespace
}  // namespace isoloco

TORCH_LIBRARY_IMPL(isoloco, CUDA, m) {
  m.impl("csrc_iso_scale_", &isoloco::iso_scale_cuda);
}

// The GPU code this library carries ("sm_80,sm_90,compute_90": nvcc's -gencode targets, recorded
// by CMakeLists.txt), read by _ext.built_archs() so that dispatch falls back to another backend on
// a device without a matching cubin or PTX instead of failing with "no kernel image".
#ifndef ISOLOCO_CUDA_ARCHS
#define ISOLOCO_CUDA_ARCHS ""
#endif
extern "C" __attribute__((visibility("default"))) const char* isoloco_cuda_archs() {
  return ISOLOCO_CUDA_ARCHS;
}
