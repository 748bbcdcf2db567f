// CUDA gather: one launch of gear_gather_kernel for all columns of a batch.
//
// Columns live in device memory or in pinned / registered host memory, which
// the kernel reads in place through its mapped device address (zero copy).
// The column descriptors (and the window indices when they come from the CPU)
// sit in one pinned buffer that the kernel reads in place: small batches pay
// for no copy and no wait before the launch.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CachingHostAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/gather.h"
#include "gather_kernel.cuh"

namespace gear {
namespace {

// Device address through which the kernel reads a column, or an error that
// names the column when the kernel could not read it.
const char* device_address(const at::Tensor& col, size_t c, const at::Device& out_device) {
  const char* base = static_cast<const char*>(col.data_ptr());
  const int64_t bytes = col.numel() * col.element_size();
  if (col.is_cuda()) {
    TORCH_CHECK(col.device() == out_device, "gather: column ", c, " is on ", col.device(),
                " but the outputs are on ", out_device, "; move it or gather on that device");
    return base;
  }
  TORCH_CHECK(col.device().is_cpu(), "gather: column ", c, " is on ", col.device(),
              "; CUDA gather reads CUDA columns or pinned CPU columns");
  if (bytes == 0) return base;
  // The first and the last byte must both be pinned and mapped, contiguously.
  const char* ends[2] = {base, base + bytes - 1};
  const char* mapped[2] = {nullptr, nullptr};
  for (int k = 0; k < 2; ++k) {
    cudaPointerAttributes attr{};
    const cudaError_t err = cudaPointerGetAttributes(&attr, ends[k]);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error state
      TORCH_CHECK(false, "gather: column ", c, " is a CPU tensor that CUDA cannot query (",
                  cudaGetErrorString(err), "); pin it with .pin_memory() or "
                  "gear_torchrl._C.cuda_host_register()");
    }
    TORCH_CHECK(attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr, "gather: column ", c,
                " (", col.scalar_type(), " ", col.sizes(), ", ", bytes, " bytes) is in pageable CPU memory"
                " that the GPU cannot read in place; pin it with .pin_memory() or register it with "
                "gear_torchrl._C.cuda_host_register() (or move it to the GPU)");
    mapped[k] = static_cast<const char*>(attr.devicePointer);
  }
  TORCH_CHECK(mapped[1] - mapped[0] == bytes - 1, "gather: column ", c,
              " spans more than one pinned/registered host allocation; register it as one range");
  return mapped[0];
}

int num_sms(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

// A device address of pinned host memory from torch's caching host allocator
// (the same address under unified addressing), or null when it is not mapped.
const void* mapped_address(const void* host) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, host) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return attr.type == cudaMemoryTypeHost ? attr.devicePointer : nullptr;
}

}  // namespace

void gather_cuda(const GatherArgs& a) {
  const at::Device device = a.out.front().device();
  const c10::cuda::CUDAGuard guard(device);
  const int64_t num_windows = a.num_windows();
  const int64_t window_len = a.window_len;
  const int64_t num_columns = static_cast<int64_t>(a.columns.size());
  if (a.mask) {
    TORCH_CHECK(a.mask->is_cuda(), "gather: the mask must be on the outputs' device");
  }
  if (num_windows == 0) return;
  const int64_t capacity = a.capacity();
  const bool hot = !a.hot_columns.empty();

  // One pinned staging buffer: the descriptors, then the indices when they come
  // from the CPU. The kernel reads it in place, so nothing is copied before the launch.
  const bool idx_on_cpu = a.starts.device().is_cpu();
  const int64_t num_bounds = (a.valid_begin ? 1 : 0) + (a.valid_end ? 1 : 0);
  const int64_t desc_words = GEAR_DESC_WORDS * num_columns;
  const int64_t words = desc_words + (idx_on_cpu ? num_windows * (1 + num_bounds) : 0);
  at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* h = reinterpret_cast<unsigned long long*>(host.data_ptr<int64_t>());

  int64_t total_bytes = 0;
  for (int64_t c = 0; c < num_columns; ++c) total_bytes += a.row_bytes(c) * window_len * num_windows;
  const int64_t chunk = gear_gather_chunk_bytes(total_bytes, num_sms(device.index()));

  // Columns go in launches of at most GEAR_MAX_LAUNCH_COLUMNS (their descriptors
  // fill shared memory); work items are numbered from 0 in each launch.
  std::vector<int64_t> launch_items;
  int64_t items = 0;
  for (int64_t c = 0; c < num_columns; ++c) {
    if (c % GEAR_MAX_LAUNCH_COLUMNS == 0 && c > 0) {
      launch_items.push_back(items);
      items = 0;
    }
    const int64_t rb = a.row_bytes(c);
    unsigned long long* d = h + GEAR_DESC_WORDS * c;
    d[0] = reinterpret_cast<unsigned long long>(device_address(a.columns[c], c, device));
    d[1] = reinterpret_cast<unsigned long long>(a.out[c].data_ptr());
    d[2] = static_cast<unsigned long long>(rb);
    d[3] = static_cast<unsigned long long>(items);
    d[4] = hot ? reinterpret_cast<unsigned long long>(a.hot_columns[c].data_ptr()) : 0ull;
    items += num_windows * ((rb * window_len + chunk - 1) / chunk);
  }
  launch_items.push_back(items);

  const auto idx_options = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor starts, begins, ends;  // device tensors when the indices came from CUDA
  if (idx_on_cpu) {
    int64_t off = desc_words;
    for (const at::Tensor* t : {&a.starts, a.valid_begin ? &*a.valid_begin : nullptr,
                                a.valid_end ? &*a.valid_end : nullptr}) {
      if (!t) continue;
      const at::Tensor ct = t->contiguous();
      std::memcpy(h + off, ct.data_ptr<int64_t>(), num_windows * sizeof(int64_t));
      off += num_windows;
    }
  } else {
    starts = a.starts.to(idx_options).contiguous();
    if (a.valid_begin) begins = a.valid_begin->to(idx_options).contiguous();
    if (a.valid_end) ends = a.valid_end->to(idx_options).contiguous();
  }
  const at::cuda::CUDAStream cuda_stream = at::cuda::getCurrentCUDAStream(device.index());
  const cudaStream_t stream = cuda_stream.stream();
  const auto* staged = static_cast<const unsigned long long*>(mapped_address(host.data_ptr()));
  at::Tensor dev;
  if (staged == nullptr) {  // pinned memory that is not mapped: copy it over instead
    dev = at::empty({words}, idx_options);
    dev.copy_(host, /*non_blocking=*/true);
    staged = reinterpret_cast<const unsigned long long*>(dev.data_ptr<int64_t>());
  } else {
    // The buffer goes back to the allocator on return; it must not be reused
    // before the kernel has read it.
    at::getHostAllocator(at::kCUDA)->record_event(host.data_ptr(), host.storage().data_ptr().get_context(),
                                                  cuda_stream.unwrap());
  }
  const long long* starts_p;
  const long long* begins_p = nullptr;
  const long long* ends_p = nullptr;
  if (idx_on_cpu) {
    const auto* di = reinterpret_cast<const long long*>(staged + desc_words);
    starts_p = di;
    int64_t off = num_windows;
    if (a.valid_begin) { begins_p = di + off; off += num_windows; }
    if (a.valid_end) ends_p = di + off;
  } else {
    starts_p = reinterpret_cast<const long long*>(starts.data_ptr<int64_t>());
    if (begins.defined()) begins_p = reinterpret_cast<const long long*>(begins.data_ptr<int64_t>());
    if (ends.defined()) ends_p = reinterpret_cast<const long long*>(ends.data_ptr<int64_t>());
  }
  unsigned char* mask_p = a.mask ? reinterpret_cast<unsigned char*>(a.mask->data_ptr<bool>()) : nullptr;
  const long long* owner_p = hot ? reinterpret_cast<const long long*>(a.hot_owner->data_ptr<int64_t>()) : nullptr;
  const int64_t hot_rows = hot ? a.hot_owner->numel() : 0;

  const int64_t warps_per_block = GEAR_GATHER_THREADS / 32;
  const int64_t max_blocks = static_cast<int64_t>(num_sms(device.index())) * (2048 / GEAR_GATHER_THREADS);
  for (size_t g = 0; g < launch_items.size(); ++g) {
    const int64_t first = static_cast<int64_t>(g) * GEAR_MAX_LAUNCH_COLUMNS;
    const int64_t cols = std::min<int64_t>(GEAR_MAX_LAUNCH_COLUMNS, num_columns - first);
    const int64_t copy_items = launch_items[g];
    // The mask rides with the first launch.
    const bool with_mask = g == 0 && mask_p != nullptr;
    const int64_t total = copy_items + (with_mask ? (num_windows + GEAR_MASK_WINDOWS - 1) / GEAR_MASK_WINDOWS : 0);
    if (total == 0) continue;
    const int64_t blocks = std::max<int64_t>(1, std::min((total + warps_per_block - 1) / warps_per_block, max_blocks));
    const size_t shared = static_cast<size_t>(cols) * GEAR_DESC_WORDS * sizeof(unsigned long long);
    gear_gather_kernel<<<static_cast<unsigned int>(blocks), GEAR_GATHER_THREADS, shared, stream>>>(
        staged + GEAR_DESC_WORDS * first, static_cast<int>(cols), starts_p, begins_p, ends_p,
        with_mask ? mask_p : nullptr, num_windows, window_len, capacity, chunk, copy_items, total, owner_p, hot_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void cuda_host_register(const at::Tensor& host) {
  TORCH_CHECK(host.device().is_cpu(), "cuda_host_register: expected a CPU tensor, got one on ", host.device());
  TORCH_CHECK(host.is_contiguous(), "cuda_host_register: the tensor must be contiguous");
  const size_t bytes = static_cast<size_t>(host.numel()) * host.element_size();
  if (bytes == 0) return;
  const cudaError_t err =
      cudaHostRegister(host.data_ptr(), bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "cuda_host_register: cudaHostRegister of ", bytes, " bytes at ", host.data_ptr(),
                " failed: ", cudaGetErrorString(err),
                err == cudaErrorHostMemoryAlreadyRegistered
                    ? " (this memory, or part of a page of it, is already pinned/registered)"
                    : "");
  }
}

void cuda_host_unregister(const at::Tensor& host) {
  TORCH_CHECK(host.device().is_cpu(), "cuda_host_unregister: expected a CPU tensor, got one on ", host.device());
  if (host.numel() == 0) return;
  const cudaError_t err = cudaHostUnregister(host.data_ptr());
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "cuda_host_unregister: cudaHostUnregister at ", host.data_ptr(),
                " failed: ", cudaGetErrorString(err),
                err == cudaErrorHostMemoryNotRegistered ? " (it was not registered with cuda_host_register)" : "");
  }
}

}  // namespace gear
