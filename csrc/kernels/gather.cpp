// CPU gather: windows split across threads, one memcpy per contiguous run.
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>

#include "kernels/gather.h"

namespace gear {
namespace {

inline int64_t ring_row(int64_t row, int64_t capacity) {
  if (static_cast<uint64_t>(row) < static_cast<uint64_t>(capacity)) return row;  // most rows: no division
  if (row >= capacity && row - capacity < capacity) return row - capacity;       // a window past the ring's end
  const int64_t r = row % capacity;
  return r < 0 ? r + capacity : r;
}

// RowBytes > 0 fixes the row size at compile time so that one-row copies of
// small columns (rewards, flags) become single loads instead of memcpy calls.
template <int64_t RowBytes>
void copy_window(char* dst, const char* column, int64_t dynamic_row_bytes, int64_t capacity,
                 int64_t start, int64_t begin, int64_t end, int64_t window_len) {
  const int64_t rb = RowBytes > 0 ? RowBytes : dynamic_row_bytes;
  if (begin > 0) std::memset(dst, 0, begin * rb);
  if (end < window_len) std::memset(dst + end * rb, 0, (window_len - end) * rb);
  int64_t pos = begin;
  while (pos < end) {  // at most two runs unless the window is longer than the ring
    const int64_t row = ring_row(start + pos, capacity);
    const int64_t run = std::min(end - pos, capacity - row);
    if constexpr (RowBytes > 0) {
      if (run == 1) {
        std::memcpy(dst + pos * RowBytes, column + row * RowBytes, RowBytes);
        pos += 1;
        continue;
      }
    }
    std::memcpy(dst + pos * rb, column + row * rb, run * rb);
    pos += run;
  }
}

// Calls f(std::integral_constant<int64_t, N>) with N the row size when it is one
// of the small sizes worth a fixed-size copy, else N = 0 (size known at run time).
template <typename F>
auto dispatch_row_bytes(int64_t row_bytes, F&& f) {
  switch (row_bytes) {
    case 1: return f(std::integral_constant<int64_t, 1>{});
    case 2: return f(std::integral_constant<int64_t, 2>{});
    case 4: return f(std::integral_constant<int64_t, 4>{});
    case 8: return f(std::integral_constant<int64_t, 8>{});
    case 16: return f(std::integral_constant<int64_t, 16>{});
    default: return f(std::integral_constant<int64_t, 0>{});
  }
}

using CopyFn = void (*)(char*, const char*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

CopyFn copy_fn_for(int64_t row_bytes) {
  return dispatch_row_bytes(row_bytes, [](auto n) -> CopyFn { return copy_window<decltype(n)::value>; });
}

// Rows are the hot path (uniform and prioritized sampling): one copy per row,
// the ring modulo only for out-of-range starts, and the rows a few iterations
// ahead prefetched so that random reads overlap their cache misses (windows
// prefetch their first rows likewise).
constexpr int64_t kPrefetchDistance = 8;

// The valid range [begin, end) of window i, clamped to [0, window_len) (no bounds: the whole window).
struct ValidRanges {
  const int64_t* begins;
  const int64_t* ends;
  int64_t window_len;

  int64_t begin(int64_t i) const { return begins ? std::clamp<int64_t>(begins[i], 0, window_len) : 0; }
  int64_t end(int64_t i) const { return ends ? std::clamp<int64_t>(ends[i], begin(i), window_len) : window_len; }
  // A window of one row: whether that row is read (else it is padding).
  bool holds_row(int64_t i) const { return begin(i) == 0 && end(i) == 1; }
};

// Runs = true: rows that follow each other in the ring and in the batch (a packed sequence's tokens) go in
// one copy. Random rows take the loop without that check (it costs them about a fifth).
template <int64_t RowBytes, bool Runs>
void copy_rows(char* dst, const char* column, int64_t dynamic_row_bytes, int64_t capacity,
               const int64_t* rows, const ValidRanges& valid, int64_t first, int64_t last) {
  const int64_t rb = RowBytes > 0 ? RowBytes : dynamic_row_bytes;
  const int64_t prefetch_lines = std::min<int64_t>((rb + 63) / 64, 16);
  for (int64_t i = first; i < last;) {
    if (i + kPrefetchDistance < last) {
      const int64_t ahead = rows[i + kPrefetchDistance];
      if (static_cast<uint64_t>(ahead) < static_cast<uint64_t>(capacity)) {
        const char* p = column + ahead * rb;
        for (int64_t line = 0; line < prefetch_lines; ++line) __builtin_prefetch(p + line * 64);
      }
    }
    if (!valid.holds_row(i)) {
      std::memset(dst + i * rb, 0, RowBytes > 0 ? RowBytes : rb);
      ++i;
      continue;
    }
    const int64_t row = ring_row(rows[i], capacity);
    int64_t run = 1;
    if constexpr (Runs) {
      while (i + run < last && row + run < capacity && rows[i + run] == rows[i] + run && valid.holds_row(i + run)) {
        ++run;
      }
    }
    if (run == 1) {
      std::memcpy(dst + i * rb, column + row * rb, RowBytes > 0 ? RowBytes : rb);
    } else {
      std::memcpy(dst + i * rb, column + row * rb, run * rb);
    }
    i += run;
  }
}

// Whether the rows mostly follow each other: a look at the first 64 settles which loop copies them.
bool mostly_runs(const int64_t* rows, int64_t n) {
  const int64_t look = std::min<int64_t>(n, 65);
  int64_t following = 0;
  for (int64_t i = 1; i < look; ++i) following += rows[i] == rows[i - 1] + 1;
  return 2 * following > look - 1;
}

using RowsFn = void (*)(char*, const char*, int64_t, int64_t, const int64_t*, const ValidRanges&, int64_t, int64_t);

RowsFn rows_fn_for(int64_t row_bytes, bool runs) {
  return dispatch_row_bytes(row_bytes, [runs](auto n) -> RowsFn {
    return runs ? copy_rows<decltype(n)::value, true> : copy_rows<decltype(n)::value, false>;
  });
}

}  // namespace

void gather_cpu(const GatherArgs& a) {
  const int64_t num_windows = a.num_windows();
  if (num_windows == 0) return;
  const int64_t capacity = a.capacity();
  const int64_t window_len = a.window_len;
  const at::Tensor starts = a.starts.contiguous();
  const at::Tensor begins = a.valid_begin ? a.valid_begin->contiguous() : at::Tensor();
  const at::Tensor ends = a.valid_end ? a.valid_end->contiguous() : at::Tensor();
  const int64_t* start_p = starts.data_ptr<int64_t>();
  const int64_t* begin_p = begins.defined() ? begins.data_ptr<int64_t>() : nullptr;
  const int64_t* end_p = ends.defined() ? ends.data_ptr<int64_t>() : nullptr;
  bool* mask_p = a.mask ? a.mask->data_ptr<bool>() : nullptr;

  const size_t num_columns = a.columns.size();
  std::vector<const char*> src(num_columns);
  std::vector<char*> dst(num_columns);
  std::vector<int64_t> row_bytes(num_columns);
  std::vector<CopyFn> copy(num_columns);
  int64_t window_bytes = 0;
  for (size_t c = 0; c < num_columns; ++c) {
    src[c] = static_cast<const char*>(a.columns[c].data_ptr());
    dst[c] = static_cast<char*>(a.out[c].data_ptr());
    row_bytes[c] = a.row_bytes(c);
    copy[c] = copy_fn_for(row_bytes[c]);
    window_bytes += row_bytes[c] * window_len;
  }
  // About 64 KiB per task: enough to amortize scheduling, small enough to balance.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(window_bytes, 1));

  const ValidRanges valid{begin_p, end_p, window_len};
  const auto fill_mask = [&](int64_t first, int64_t last) {
    if (!mask_p) return;
    for (int64_t i = first; i < last; ++i) {
      const int64_t begin = valid.begin(i), end = valid.end(i);
      bool* m = mask_p + i * window_len;
      for (int64_t j = 0; j < window_len; ++j) m[j] = j >= begin && j < end;
    }
  };
  if (window_len == 1) {  // rows, and windows of one row: a copy (or padding) each, or one for a run of them
    const bool runs = mostly_runs(start_p, num_windows);
    at::parallel_for(0, num_windows, grain, [&](int64_t first, int64_t last) {
      for (size_t c = 0; c < num_columns; ++c) {
        rows_fn_for(row_bytes[c], runs)(dst[c], src[c], row_bytes[c], capacity, start_p, valid, first, last);
      }
      fill_mask(first, last);
    });
    return;
  }
  at::parallel_for(0, num_windows, grain, [&](int64_t first, int64_t last) {
    for (size_t c = 0; c < num_columns; ++c) {
      const int64_t rb = row_bytes[c];
      const int64_t prefetch_lines = std::min<int64_t>((rb + 63) / 64, 16);
      for (int64_t i = first; i < last; ++i) {
        if (i + kPrefetchDistance < last) {  // a window's first row is a random read, as a row pick's is
          const int64_t ahead = i + kPrefetchDistance;
          const char* p = src[c] + ring_row(start_p[ahead] + valid.begin(ahead), capacity) * rb;
          for (int64_t line = 0; line < prefetch_lines; ++line) __builtin_prefetch(p + line * 64);
        }
        const int64_t begin = valid.begin(i);
        copy[c](dst[c] + i * window_len * rb, src[c], rb, capacity, start_p[i], begin, valid.end(i), window_len);
      }
    }
    fill_mask(first, last);
  });
}

}  // namespace gear
