// gear_torchrl: one CUDA kernel that gathers rows / windows of every column of
// a table into a batch (zero copy from pinned host memory, or from device
// memory), zero-fills head/tail padding and writes the validity mask.
//
// This file is standalone on purpose: no torch or std headers, so that
//   * csrc/kernels/cuda/gather_cuda.cu includes it (nvcc, the compiled extension), and
//   * the package's CuPy fallback compiles the very same text at run time with
//     NVRTC (cupy.RawModule(code=..., options=("--std=c++17",)),
//     name_expressions not needed: the entry point is extern "C").
//
// Semantics (csrc/kernels/gather.cpp is the reference): window i, position j in
// [0, window_len): if begin_i <= j < end_i (begin clamped to [0, window_len], end to
// [begin, window_len]; no bounds -> 0 / window_len) then out row i*window_len+j = column
// row (starts[i]+j) mod capacity (non-negative), else zeros;
// mask[i*window_len+j] = (begin_i <= j < end_i). Rows are windows of window_len 1.
//
// Hot tier (optional): for each column a device copy of some rows in
// hot_rows slots, row r in slot r % hot_rows when hot_owner[r % hot_rows] == r.
// Rows in their slot are read from there (GPU memory), the rest from the column.
//
// Calling convention of gear_gather_kernel (for any host, torch or CuPy):
//   desc         GEAR_DESC_WORDS u64 per column, per column c at 5c:
//                  +0 source base address (device pointer; for pinned host
//                     memory the mapped device pointer),
//                  +1 output base address (device memory),
//                  +2 row bytes,
//                  +3 first work item of column c (exclusive prefix sum of
//                     num_windows * ceil(window_len * row_bytes / chunk_bytes)),
//                  +4 hot tier base address (device memory), or 0 without one.
//                num_columns <= GEAR_MAX_LAUNCH_COLUMNS; dynamic shared memory
//                of num_columns * GEAR_DESC_WORDS * 8 bytes.
//   starts       int64 [num_windows]
//   begins/ends  int64 [num_windows], or null (0 / window_len)
//   mask         device bool/uint8 [num_windows * window_len], or null
//   desc, starts, begins and ends may live in device memory or in mapped pinned
//   host memory (read in place: a launch needs no copy before it).
//   chunk_bytes  bytes of one window's output span one warp copies per item,
//                a power of two >= 512 (gear_gather_chunk_bytes below suggests one)
//   copy_items   total items of all columns (= the prefix sum's end)
//   total_items  copy_items + (mask ? ceil(num_windows / 32) : 0)
//   hot_owner    device int64 [hot_rows] (see above), or null for no hot tier
//   launch       block GEAR_GATHER_THREADS threads, any grid (warps stride over
//                the items); GEAR_GATHER_THREADS/32 items per block per round.
// All offsets are 64-bit: tables above 4 GiB are fine.

#ifndef GEAR_GATHER_KERNEL_CUH
#define GEAR_GATHER_KERNEL_CUH

#define GEAR_GATHER_THREADS 256
#define GEAR_MASK_WINDOWS 32  // windows whose mask one warp writes per item
#define GEAR_DESC_WORDS 5
#define GEAR_MAX_LAUNCH_COLUMNS 1024  // 40 KiB of descriptors in shared memory

namespace gear_kernel {

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 imax(i64 a, i64 b) { return a > b ? a : b; }

__device__ __forceinline__ i64 ring_row(i64 row, i64 capacity) {
  const i64 r = row % capacity;
  return r < 0 ? r + capacity : r;
}

// Copy n units of T from src to dst (both T-aligned), lanes of a warp striding;
// U independent loads in flight per lane before the first store (reads of
// pinned host memory cross PCIe: latency wants many outstanding requests).
// Loads are streaming (read once, evict first), stores cache in L2 only: the
// batch is read next by the learner's kernels.
template <typename T, int U>
__device__ __forceinline__ void warp_copy_units(T* __restrict__ dst, const T* __restrict__ src, i64 n,
                                                int lane) {
  i64 base = 0;
  for (; base + 32 * U <= n; base += 32 * U) {
    T v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldcs(src + base + u * 32 + lane);
#pragma unroll
    for (int u = 0; u < U; ++u) __stcg(dst + base + u * 32 + lane, v[u]);
  }
  // Remainder (< 32*U units): still issue all loads before the stores.
  T v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const i64 k = base + u * 32 + lane;
    if (k < n) v[u] = __ldcs(src + k);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const i64 k = base + u * 32 + lane;
    if (k < n) __stcg(dst + k, v[u]);
  }
}

// Copy n bytes, any alignment. The widest unit that the mutual alignment of
// src and dst allows (16, 8, 4, 2 or 1 bytes); head and tail bytes by lanes.
__device__ __forceinline__ void warp_copy(char* dst, const char* src, i64 n, int lane) {
  if (n <= 0) return;
  const u64 d = (u64)dst, s = (u64)src;
  const u32 mis = (u32)((d ^ s) & 15u);
  u32 w = 16;
  if (mis & 1u) w = 1;
  else if (mis & 2u) w = 2;
  else if (mis & 4u) w = 4;
  else if (mis & 8u) w = 8;
  i64 head = (i64)((w - (u32)(d & (w - 1))) & (w - 1));
  if (head > n) head = n;
  const i64 units = (n - head) / w;
  const i64 body = units * w;
  const i64 tail = n - head - body;
  if (lane < head) dst[lane] = src[lane];
  if (lane < tail) dst[head + body + lane] = src[head + body + lane];
  char* bd = dst + head;
  const char* bs = src + head;
  switch (w) {
    case 16: warp_copy_units<uint4, 4>((uint4*)bd, (const uint4*)bs, units, lane); break;
    case 8: warp_copy_units<u64, 8>((u64*)bd, (const u64*)bs, units, lane); break;
    case 4: warp_copy_units<u32, 8>((u32*)bd, (const u32*)bs, units, lane); break;
    case 2: warp_copy_units<u16, 8>((u16*)bd, (const u16*)bs, units, lane); break;
    default: warp_copy_units<u8, 8>((u8*)bd, (const u8*)bs, units, lane); break;
  }
}

__device__ __forceinline__ void warp_zero(char* dst, i64 n, int lane) {
  if (n <= 0) return;
  const u64 d = (u64)dst;
  i64 head = (i64)((16u - (u32)(d & 15u)) & 15u);
  if (head > n) head = n;
  const i64 units = (n - head) >> 4;
  const i64 body = units << 4;
  const i64 tail = n - head - body;
  if (lane < head) dst[lane] = 0;
  if (lane < tail) dst[head + body + lane] = 0;
  uint4* bd = (uint4*)(dst + head);
  const uint4 z = make_uint4(0u, 0u, 0u, 0u);
  for (i64 k = lane; k < units; k += 32) bd[k] = z;
}

// Intersect [lo, hi) of the window's output span with the chunk [c0, c1) and
// copy it from src_at_lo (the source address of byte lo).
__device__ __forceinline__ void copy_part(char* wdst, const char* src_at_lo, i64 lo, i64 hi, i64 c0, i64 c1,
                                          int lane) {
  const i64 a = imax(lo, c0), b = imin(hi, c1);
  if (a < b) warp_copy(wdst + a, src_at_lo + (a - lo), b - a, lane);
}

__device__ __forceinline__ void zero_part(char* wdst, i64 lo, i64 hi, i64 c0, i64 c1, int lane) {
  const i64 a = imax(lo, c0), b = imin(hi, c1);
  if (a < b) warp_zero(wdst + a, b - a, lane);
}

__device__ __forceinline__ void window_bounds(const i64* begins, const i64* ends, i64 i, i64 window_len, i64* begin,
                                              i64* end) {
  i64 b = begins ? begins[i] : 0;
  b = imin(imax(b, 0), window_len);
  i64 e = ends ? ends[i] : window_len;
  e = imin(imax(e, b), window_len);
  *begin = b;
  *end = e;
}

// The mask of windows [i0, i0 + 32): each lane reads one window's bounds
// (one round trip for all, wherever the bounds live), then the warp writes the
// positions in order, taking each position's bounds from its window's lane.
__device__ __forceinline__ void write_mask(unsigned char* mask, const i64* begins, const i64* ends, i64 i0,
                                           i64 num_windows, i64 window_len, int lane) {
  const i64 n = imin(GEAR_MASK_WINDOWS, num_windows - i0);
  i64 b = 0, e = 0;
  if (lane < n) window_bounds(begins, ends, i0 + lane, window_len, &b, &e);
  const i64 total = n * window_len;
  for (i64 q0 = 0; q0 < total; q0 += 32) {  // the same trip count on every lane (shuffles)
    const i64 q = q0 + lane;
    const int w = q < total ? (int)(q / window_len) : 0;
    const i64 bw = __shfl_sync(0xffffffffu, b, w);
    const i64 ew = __shfl_sync(0xffffffffu, e, w);
    const i64 j = q - (i64)w * window_len;
    if (q < total) mask[i0 * window_len + q] = (j >= bw && j < ew) ? 1 : 0;
  }
}

// How many of the rows [row, row + run) (at most 32, not crossing the hot
// tier's last slot) are all in the hot tier or all not, as row is; *hot says
// which. One owner lookup per lane, one ballot.
__device__ __forceinline__ i64 tier_run(const i64* hot_owner, i64 hot_rows, i64 row, i64 run, int lane,
                                        bool* hot) {
  const i64 slot = row % hot_rows;
  const i64 n = imin(imin(run, 32), hot_rows - slot);
  const bool mine = lane < n && hot_owner[slot + lane] == row + lane;
  const unsigned bits = __ballot_sync(0xffffffffu, mine);
  *hot = bits & 1u;
  const unsigned same = *hot ? bits : ~bits;  // lanes in the tier of the first row
  const int first_other = __ffs(~same) - 1;   // -1: all 32 lanes agree
  return first_other < 0 ? n : imin(first_other, n);
}

}  // namespace gear_kernel

extern "C" __global__ void __launch_bounds__(GEAR_GATHER_THREADS)
gear_gather_kernel(const unsigned long long* __restrict__ desc, int num_columns, const long long* __restrict__ starts,
                   const long long* __restrict__ begins, const long long* __restrict__ ends,
                   unsigned char* __restrict__ mask, long long num_windows, long long window_len, long long capacity,
                   long long chunk_bytes, long long copy_items, long long total_items,
                   const long long* __restrict__ hot_owner, long long hot_rows) {
  using namespace gear_kernel;
  // Descriptors to shared memory once per block: they may be in host memory.
  extern __shared__ u64 sdesc[];
  for (int k = threadIdx.x; k < num_columns * GEAR_DESC_WORDS; k += GEAR_GATHER_THREADS) sdesc[k] = desc[k];
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const i64 warps_per_block = GEAR_GATHER_THREADS / 32;
  const i64 first_warp = (i64)blockIdx.x * warps_per_block + (threadIdx.x >> 5);
  const i64 num_warps = (i64)gridDim.x * warps_per_block;

  for (i64 item = first_warp; item < total_items; item += num_warps) {
    if (item >= copy_items) {
      write_mask(mask, begins, ends, (item - copy_items) * GEAR_MASK_WINDOWS, num_windows, window_len, lane);
      continue;
    }
    // Which column: the last c with first_item(c) <= item (binary search).
    int lo = 0, hi = num_columns - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if ((i64)sdesc[GEAR_DESC_WORDS * mid + 3] <= item) lo = mid;
      else hi = mid - 1;
    }
    const u64* d = sdesc + GEAR_DESC_WORDS * lo;
    const char* src = (const char*)d[0];
    char* dst = (char*)d[1];
    const i64 rb = (i64)d[2];
    const char* hot_src = (const char*)d[4];
    const i64 span = window_len * rb;  // bytes of one window's output
    const i64 chunks = (span + chunk_bytes - 1) / chunk_bytes;
    const i64 local = item - (i64)d[3];
    const i64 i = local / chunks;
    const i64 c0 = (local - i * chunks) * chunk_bytes;
    const i64 c1 = imin(c0 + chunk_bytes, span);

    const i64 start = starts[i];
    i64 begin, end;
    window_bounds(begins, ends, i, window_len, &begin, &end);
    char* wdst = dst + i * span;
    zero_part(wdst, 0, begin * rb, c0, c1, lane);
    zero_part(wdst, end * rb, span, c0, c1, lane);
    // Source runs from the first row that reaches this chunk: contiguous
    // stretches of the ring, split where the hot tier starts or stops holding them.
    i64 pos = imax(begin, c0 / rb);
    while (pos < end && pos * rb < c1) {
      const i64 row = ring_row(start + pos, capacity);
      i64 run = imin(end - pos, capacity - row);
      const char* from = src + row * rb;
      if (hot_owner) {
        bool hot;
        run = tier_run(hot_owner, hot_rows, row, run, lane, &hot);
        if (hot) from = hot_src + (row % hot_rows) * rb;
      }
      copy_part(wdst, from, pos * rb, (pos + run) * rb, c0, c1, lane);
      pos += run;
    }
  }
}

#if !defined(__CUDACC_RTC__)
// Host helper (not for NVRTC): a chunk size that gives every SM a few warps of
// work per round while keeping per-item overhead small.
static inline long long gear_gather_chunk_bytes(long long total_bytes, int num_sms) {
  const long long target_items = (long long)num_sms * 64;  // 2 rounds of 32 warps/SM
  long long per = total_bytes / (target_items > 0 ? target_items : 1);
  long long chunk = 2048;
  while (chunk < per && chunk < 65536) chunk <<= 1;
  return chunk;
}
#endif

#endif  // GEAR_GATHER_KERNEL_CUH
