// isoloco::nesterov_outer_ on CUDA: one multi-tensor launch per dtype combination (normally one);
// kernel in kernels/nesterov.cuh.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "kernels/nesterov.cuh"

namespace isoloco {
namespace {

// Only what memory safety needs, with ops.check_nesterov_args' rules (which run first, with the
// finiteness, written-tensor and overlap checks): sizes, dtypes, devices.
void check_args(at::TensorList params, at::TensorList bufs, at::TensorList updates) {
  TORCH_CHECK_VALUE(params.size() == bufs.size() && bufs.size() == updates.size(),
                    "nesterov_outer_: params, bufs and updates must have one entry each per tensor, got ",
                    params.size(), ", ", bufs.size(), " and ", updates.size());
  if (params.empty()) return;
  const at::Device dev = params[0].device();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::pair<const char*, const at::Tensor*> named[] = {
        {"param", &params[i]}, {"buf", &bufs[i]}, {"update", &updates[i]}};
    for (const auto& [name, t] : named) {
      TORCH_CHECK(t->defined(), "nesterov_outer_: ", name, " ", i, " is undefined");
      TORCH_CHECK_TYPE(supported_dtype(t->scalar_type()), "nesterov_outer_: ", name, " ", i,
                       " has unsupported dtype ", t->scalar_type());
      TORCH_CHECK(t->device() == dev, "nesterov_outer_: ", name, " ", i, " is on ", t->device(),
                  " but param 0 is on ", dev);
    }
    TORCH_CHECK_VALUE(params[i].sizes() == bufs[i].sizes() && bufs[i].sizes() == updates[i].sizes(),
                      "nesterov_outer_: tensor ", i, ": param ", params[i].sizes(), ", buf ",
                      bufs[i].sizes(), " and update ", updates[i].sizes(), " must have the same shape");
    const auto pt = params[i].scalar_type(), bt = bufs[i].scalar_type();
    TORCH_CHECK_TYPE(bt == at::kFloat || bt == pt, "nesterov_outer_: buf ", i, " is ", bt,
                     "; it must be float32 or the param's dtype (", pt, ")");
  }
  TORCH_CHECK(dev.is_cuda(), "nesterov_outer_: params must be CUDA tensors, got ", dev);
}

void nesterov_outer_cuda(at::TensorList params, at::TensorList bufs, at::TensorList updates,
                         double lr, double momentum) {
  check_args(params, bufs, updates);  // everything before anything is written
  if (params.empty()) return;
  const at::Device dev = params[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  // Contiguous views of every operand; non-contiguous params/bufs are copied back at the end.
  std::vector<at::Tensor> p(params.size()), b(params.size()), u(params.size());
  // Non-empty tensors, grouped by dtype combination in first-seen order.
  std::vector<std::tuple<at::ScalarType, at::ScalarType, at::ScalarType>> kinds;
  std::vector<std::vector<int>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    p[i] = params[i].contiguous();
    b[i] = bufs[i].contiguous();
    u[i] = updates[i].contiguous();
    const auto kind = std::make_tuple(params[i].scalar_type(), bufs[i].scalar_type(),
                                      updates[i].scalar_type());
    size_t g = 0;
    while (g < kinds.size() && kinds[g] != kind) ++g;
    if (g == kinds.size()) {
      kinds.push_back(kind);
      groups.emplace_back();
    }
    groups[g].push_back(static_cast<int>(i));
  }
  if (kinds.empty()) return;

  // One table for all groups, filled on the host (pinned) and copied to the device asynchronously.
  int64_t rows = 0;
  for (const auto& g : groups) rows += static_cast<int64_t>(g.size());
  at::Tensor host = at::empty({rows * ik::kNesterovFields},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.mutable_data_ptr<int64_t>();
  std::vector<int64_t> group_blocks;
  for (const auto& g : groups) {
    int64_t chunk = 0;
    for (int i : g) {
      h[0] = reinterpret_cast<int64_t>(p[i].data_ptr());
      h[1] = reinterpret_cast<int64_t>(b[i].data_ptr());
      h[2] = reinterpret_cast<int64_t>(u[i].data_ptr());
      h[3] = p[i].numel();
      h[4] = chunk;
      chunk += (p[i].numel() + ik::kNesterovChunk - 1) / ik::kNesterovChunk;
      h += ik::kNesterovFields;
    }
    TORCH_CHECK(chunk < (int64_t{1} << 31), "nesterov_outer_: too many elements in one call");
    group_blocks.push_back(chunk);
  }
  const at::Tensor table = host.to(dev, /*non_blocking=*/true);

  const int64_t* tp = table.const_data_ptr<int64_t>();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto [pt, bt, ut] = kinds[g];
    const auto* gtable = reinterpret_cast<const long long*>(tp);
    const int n = static_cast<int>(groups[g].size());
    dispatch_storage(pt, "nesterov_outer_: param", [&]<typename TP>(std::type_identity<TP>) {
      using C = compute_t<TP>;
      auto launch = [&]<typename TB>(std::type_identity<TB>) {
        dispatch_storage(ut, "nesterov_outer_: update", [&]<typename TU>(std::type_identity<TU>) {
          ik::nesterov_outer<TP, TB, TU, C><<<group_blocks[g], ik::kBlock, 0, stream>>>(
              gtable, n, static_cast<C>(lr), static_cast<C>(momentum));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      };
      // bufs are float32 or the param dtype (checked above): two instantiations, not four.
      if (bt == pt) launch(std::type_identity<TP>{});
      else launch(std::type_identity<float>{});
    });
    tp += n * ik::kNesterovFields;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!p[i].defined()) continue;
    if (!p[i].is_same(params[i])) params[i].copy_(p[i]);
    if (!b[i].is_same(bufs[i])) bufs[i].copy_(b[i]);
  }
}

}  // namespace
}  // namespace isoloco

TORCH_LIBRARY_IMPL(isoloco, CUDA, m) {
  m.impl("csrc_nesterov_outer_", &isoloco::nesterov_outer_cuda);
}
