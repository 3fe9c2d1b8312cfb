// Multi-tensor Nesterov outer update, one launch over a list of tensors of equal dtypes: the step
// of isoloco_kernels/reference.py's nesterov_ref with g = u in place of the gradient: SGD with
// momentum μ, nesterov=True, dampening 0.
//
// The tensor list lives in device memory as a table of kNesterovFields int64 per tensor, non-empty
// tensors only, in order: p, buf, update (addresses), numel, first chunk. Tensor t owns
// blocks [first_chunk_t, first_chunk_t + ceil(numel_t / kNesterovChunk)); each block binary-searches
// the table for its tensor and updates one chunk of kNesterovChunk elements, with vector loads when
// the three addresses allow. TP, TB, TU: storage types of params, bufs, updates; C: the math type
// (float, or double for double params).
#pragma once
#include "common.cuh"

namespace ik {

constexpr int kNesterovFields = 5;
constexpr long long kNesterovChunk = 8192;  // elements per block

// Explicitly rounded operations: the compiler does not contract them, so every build (nvcc, NVRTC)
// and every call site (vector loop, tail) rounds the same way.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }

// In the compute type C: buf' = rn(rn(μ·buf) + u);  p' = fma(−lr, rn(rn(μ·buf') + u), p).
template <typename TP, typename TB, typename TU, typename C>
__device__ __forceinline__ void nesterov_one(TP& p, TB& b, const TU u, C lr, C mu) {
  const C g = to_compute<C>(u);
  const C nb = add_rn(mul_rn(mu, to_compute<C>(b)), g);
  b = from_compute<TB>(nb);
  p = from_compute<TP>(fma_rn(-lr, add_rn(mul_rn(mu, nb), g), to_compute<C>(p)));
}

template <typename TP, typename TB, typename TU, typename C>
__global__ void __launch_bounds__(kBlock) nesterov_outer(const long long* __restrict__ table,
                                                         int ntensors, C lr, C mu) {
  // Last tensor whose first chunk is <= this block (first chunks ascend strictly: no empty tensors).
  const long long bid = blockIdx.x;
  int lo = 0, hi = ntensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table[mid * kNesterovFields + 4] <= bid) lo = mid; else hi = mid - 1;
  }
  const long long* row = table + lo * kNesterovFields;
  TP* p = reinterpret_cast<TP*>(row[0]);
  TB* b = reinterpret_cast<TB*>(row[1]);
  const TU* u = reinterpret_cast<const TU*>(row[2]);
  const long long numel = row[3];
  const long long start = (bid - row[4]) * kNesterovChunk;
  const long long end = start + kNesterovChunk < numel ? start + kNesterovChunk : numel;

  long long i = start;
  if (vec_aligned(p + start) && vec_aligned(b + start) && vec_aligned(u + start)) {
    const long long vend = start + (end - start) / kVec * kVec;
    for (long long j = start + threadIdx.x * kVec; j < vend; j += kBlock * kVec) {
      Pack<TP> pv = *reinterpret_cast<const Pack<TP>*>(p + j);
      Pack<TB> bv = *reinterpret_cast<const Pack<TB>*>(b + j);
      const Pack<TU> uv = *reinterpret_cast<const Pack<TU>*>(u + j);
#pragma unroll
      for (int k = 0; k < kVec; ++k) nesterov_one<TP, TB, TU, C>(pv.v[k], bv.v[k], uv.v[k], lr, mu);
      *reinterpret_cast<Pack<TP>*>(p + j) = pv;
      *reinterpret_cast<Pack<TB>*>(b + j) = bv;
    }
    i = vend;
  }
  for (long long j = i + threadIdx.x; j < end; j += kBlock) nesterov_one<TP, TB, TU, C>(p[j], b[j], u[j], lr, mu);
}

}  // namespace ik
