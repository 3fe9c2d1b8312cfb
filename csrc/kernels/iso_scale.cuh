// The Iso-C epilogue on a batch of B contiguous matrices of L = m*n elements each:
//
//     s̄_b = ⟨x_b, q_b⟩ / min(m, n),    x_b ← s̄_b · q_b
//
// Since q is the polar factor of x, ⟨x, q⟩ is the nuclear norm Σσ, so this turns a polar factor into
// the Iso-C result (Marczak et al., 2025) without an SVD.
//
// Two launches, no atomics, bit-reproducible for a given shape:
//   1. iso_scale_partial: block (b, c) sums x·q over chunk c of matrix b into partial[b*nchunks + c];
//   2. iso_scale_apply:   block (b, c) adds matrix b's nchunks partials in a fixed order (every block
//      of the matrix does the same cheap sum), writes s̄_b (block c == 0) and x ← s̄_b·q over chunk c.
// Grid: B * nchunks blocks of kBlock threads; chunk_len is a multiple of kVec (see launch_plan in
// csrc/iso_scale.cu and isoloco_kernels/_cupy.py, which must agree).
// TX, TQ: storage types of x and q; C: the accumulation type (float, or double for double x).
#pragma once
#include "common.cuh"

namespace ik {

template <typename TX, typename TQ, typename C>
__global__ void __launch_bounds__(kBlock) iso_scale_partial(const TX* __restrict__ x,
                                                            const TQ* __restrict__ q,
                                                            C* __restrict__ partial, long long L,
                                                            int nchunks, long long chunk_len) {
  const long long mat = blockIdx.x / nchunks;
  const long long lo = (blockIdx.x % nchunks) * chunk_len;
  const long long hi = lo + chunk_len < L ? lo + chunk_len : L;
  const TX* xm = x + mat * L;
  const TQ* qm = q + mat * L;
  C acc = C(0);
  long long i = lo;
  if (vec_aligned(xm + lo) && vec_aligned(qm + lo)) {
    const long long vend = lo + (hi > lo ? (hi - lo) / kVec * kVec : 0);
    for (long long j = lo + threadIdx.x * kVec; j < vend; j += kBlock * kVec) {
      const Pack<TX> xv = *reinterpret_cast<const Pack<TX>*>(xm + j);
      const Pack<TQ> qv = *reinterpret_cast<const Pack<TQ>*>(qm + j);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc += to_compute<C>(xv.v[k]) * to_compute<C>(qv.v[k]);
    }
    i = vend;
  }
  for (long long j = i + threadIdx.x; j < hi; j += kBlock)
    acc += to_compute<C>(xm[j]) * to_compute<C>(qm[j]);
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

template <typename TX, typename TQ, typename C>
__global__ void __launch_bounds__(kBlock) iso_scale_apply(TX* x, const TQ* q,
                                                          const C* __restrict__ partial,
                                                          C* __restrict__ sbar, long long L,
                                                          int nchunks, long long chunk_len, C r0) {
  const long long mat = blockIdx.x / nchunks;
  const int chunk = blockIdx.x % nchunks;
  C v = C(0);
  for (int k = threadIdx.x; k < nchunks; k += kBlock) v += partial[mat * nchunks + k];
  const C s = block_sum(v) / r0;
  if (chunk == 0 && threadIdx.x == 0) sbar[mat] = s;

  const long long lo = chunk * chunk_len;
  const long long hi = lo + chunk_len < L ? lo + chunk_len : L;
  TX* xm = x + mat * L;
  const TQ* qm = q + mat * L;
  long long i = lo;
  if (vec_aligned(xm + lo) && vec_aligned(qm + lo)) {
    const long long vend = lo + (hi > lo ? (hi - lo) / kVec * kVec : 0);
    for (long long j = lo + threadIdx.x * kVec; j < vend; j += kBlock * kVec) {
      const Pack<TQ> qv = *reinterpret_cast<const Pack<TQ>*>(qm + j);
      Pack<TX> xv;
#pragma unroll
      for (int k = 0; k < kVec; ++k) xv.v[k] = from_compute<TX>(s * to_compute<C>(qv.v[k]));
      *reinterpret_cast<Pack<TX>*>(xm + j) = xv;
    }
    i = vend;
  }
  for (long long j = i + threadIdx.x; j < hi; j += kBlock) xm[j] = from_compute<TX>(s * to_compute<C>(qm[j]));
}

}  // namespace ik
