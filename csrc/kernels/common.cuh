// Device-side building blocks shared by the isoloco CUDA kernels.
//
// Everything under csrc/kernels/ is plain CUDA C++ with no includes beyond this directory: the
// same text is compiled by nvcc (through the torch wrappers in csrc/*.cu) and by NVRTC at run
// time (isoloco_kernels/_cupy.py). So half and bfloat16 are our own 16-bit storage types with
// PTX conversions, not cuda_fp16.h / cuda_bf16.h, which NVRTC does not ship.
#pragma once

namespace ik {

// Storage types with the bit layout of IEEE binary16 and bfloat16 (at::Half / at::BFloat16).
struct half_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

constexpr int kBlock = 256;  // threads per block for every kernel here
constexpr int kVec = 4;      // elements per vector load/store

// ---- conversions: load any storage type into the compute type C, store C into any storage type

template <typename C> __device__ __forceinline__ C to_compute(float v) { return static_cast<C>(v); }
template <typename C> __device__ __forceinline__ C to_compute(double v) { return static_cast<C>(v); }
template <typename C> __device__ __forceinline__ C to_compute(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return static_cast<C>(f);
}
template <typename C> __device__ __forceinline__ C to_compute(bf16_t v) {
  return static_cast<C>(__uint_as_float(static_cast<unsigned int>(v.bits) << 16));
}

template <typename T> struct Store;
template <> struct Store<float> {
  template <typename C> __device__ __forceinline__ static float from(C v) { return static_cast<float>(v); }
};
template <> struct Store<double> {
  template <typename C> __device__ __forceinline__ static double from(C v) { return static_cast<double>(v); }
};
template <> struct Store<half_t> {  // round to nearest even (double goes through float first)
  template <typename C> __device__ __forceinline__ static half_t from(C v) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(static_cast<float>(v)));
    return h;
  }
};
template <> struct Store<bf16_t> {  // round to nearest even; needs sm_80+
  template <typename C> __device__ __forceinline__ static bf16_t from(C v) {
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(static_cast<float>(v)));
    return h;
  }
};
template <typename T, typename C> __device__ __forceinline__ T from_compute(C v) {
  return Store<T>::template from<C>(v);
}

// ---- vector access: kVec consecutive elements in one load when the address allows it

template <typename T> struct alignas(sizeof(T) * kVec) Pack { T v[kVec]; };

template <typename T> __device__ __forceinline__ bool vec_aligned(const T* p) {
  return (reinterpret_cast<unsigned long long>(p) % (sizeof(T) * kVec)) == 0;
}

// ---- deterministic block sum (fixed order for a fixed blockDim); the result goes to every thread

template <typename C> __device__ __forceinline__ C warp_sum(C v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

template <typename C> __device__ C block_sum(C v) {
  __shared__ C warp_part[32];
  __shared__ C total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) >> 5;
    C w = lane < nwarps ? warp_part[lane] : C(0);
    w = warp_sum(w);
    if (lane == 0) total = w;
  }
  __syncthreads();
  return total;
}

}  // namespace ik
