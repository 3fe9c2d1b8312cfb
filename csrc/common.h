// Host-side helpers shared by the torch wrappers in csrc/*.cu.
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#include "kernels/common.cuh"

namespace isoloco {

// Calls f(std::type_identity<T>{}) with T the kernel storage type of dtype `t` (at::Half maps to
// ik::half_t, at::BFloat16 to ik::bf16_t: same bits, no cuda_fp16.h in the kernels).
template <typename F>
void dispatch_storage(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: return f(std::type_identity<float>{});
    case at::kDouble: return f(std::type_identity<double>{});
    case at::kHalf: return f(std::type_identity<ik::half_t>{});
    case at::kBFloat16: return f(std::type_identity<ik::bf16_t>{});
    default:
      TORCH_CHECK_TYPE(false, what, " has unsupported dtype ", t,
                       "; use float16, bfloat16, float32 or float64");
  }
}

// The math type for a given storage type: double for double, float for everything else.
template <typename T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

inline bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace isoloco
