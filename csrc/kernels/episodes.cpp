#include "kernels/episodes.h"

#include <algorithm>
#include <vector>

namespace gear {
namespace {

void check_records(const at::Tensor& t, at::ScalarType dtype, int64_t envs, int64_t slots, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 2 &&
                  t.size(0) == envs && t.size(1) == slots,
              "episodes_append: ", name, " must be a contiguous ", c10::toString(dtype), " CPU tensor [", envs, ", ",
              slots, "]");
}

struct Column {
  int64_t *start, *length;
  bool *closed, *dead;
  int64_t slots;
  int64_t at(int64_t serial) const { return serial % slots; }
};

// Drop the k oldest steps: whole oldest episodes, then the head of the next. Returns the new first serial.
int64_t evict(const Column& c, int64_t first, int64_t next, int64_t k, int64_t ring_rows) {
  if (k <= 0 || next == first) return first;
  int64_t whole = 0, dropped = 0;
  while (first + whole < next && dropped + c.length[c.at(first + whole)] <= k) dropped += c.length[c.at(first + whole++)];
  const int64_t newest = c.at(next - 1);
  if (first + whole == next && !c.closed[newest]) {
    // Every stored step goes, the open episode's too: it stays live, empty, and the rows being written continue it.
    c.length[newest] = 0;
    return next - 1;
  }
  first += whole;
  const int64_t trim = k - dropped;
  if (trim > 0 && first < next) {
    const int64_t s = c.at(first);
    c.start[s] = (c.start[s] + trim) % ring_rows;
    c.length[s] -= trim;
  }
  return first;
}

}  // namespace

at::Tensor episodes_append(const at::Tensor& start, const at::Tensor& length, const at::Tensor& closed,
                           const at::Tensor& dead, const at::Tensor& first, const at::Tensor& next,
                           const at::Tensor& rows, const at::Tensor& ends, int64_t evicted, int64_t ring_rows,
                           bool dead_rows) {
  TORCH_CHECK(start.dim() == 2, "episodes_append: start must be [envs, slots]");
  const int64_t envs = start.size(0), slots = start.size(1), n = rows.numel();
  check_records(start, at::kLong, envs, slots, "start");
  check_records(length, at::kLong, envs, slots, "length");
  check_records(closed, at::kBool, envs, slots, "closed");
  check_records(dead, at::kBool, envs, slots, "dead");
  for (const at::Tensor* t : {&first, &next}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 &&
                    t->numel() == envs,
                "episodes_append: first and next must be contiguous int64 CPU tensors of ", envs, " serials");
  }
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1,
              "episodes_append: rows must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(ends.device().is_cpu() && ends.scalar_type() == at::kBool && ends.is_contiguous() && ends.dim() == 2 &&
                  ends.size(0) == n && ends.size(1) == envs,
              "episodes_append: ends must be a contiguous bool CPU tensor [", n, ", ", envs, "]");
  TORCH_CHECK(slots > 0 && ring_rows > 0 && evicted >= 0, "episodes_append: need slots, ring_rows > 0, evicted >= 0");
  int64_t *f = first.data_ptr<int64_t>(), *x = next.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const bool* end = ends.data_ptr<bool>();
  for (int64_t e = 0; e < envs; ++e) {
    int64_t room = x[e] - f[e] + (n > 0);  // live episodes, one more per end flag before the last row
    for (int64_t t = 0; t + 1 < n; ++t) room += end[t * envs + e];
    TORCH_CHECK(room <= slots, "episodes_append: column ", e, " needs room for ", room,
                " episodes, its records have ", slots, " slots");
  }
  std::vector<int64_t> changed;
  for (int64_t e = 0; e < envs; ++e) {
    const Column c{start.data_ptr<int64_t>() + e * slots, length.data_ptr<int64_t>() + e * slots,
                   closed.data_ptr<bool>() + e * slots, dead.data_ptr<bool>() + e * slots, slots};
    const int64_t first_before = f[e];
    f[e] = evict(c, f[e], x[e], evicted, ring_rows);
    for (int64_t s = first_before; s < std::min(f[e] + 1, x[e]); ++s) changed.push_back(e * slots + c.at(s));
    if (n == 0) continue;
    const bool continuing = x[e] > f[e] && !c.closed[c.at(x[e] - 1)];
    int64_t serial = continuing ? x[e] - 1 : x[e], segment = 0;
    for (int64_t t = 0; t < n; ++t) {
      const bool ends_here = end[t * envs + e];
      if (!ends_here && t + 1 < n) continue;
      const int64_t s = c.at(serial), steps = t - segment + 1;
      if (continuing && serial == x[e] - 1) {
        if (c.length[s] == 0) c.start[s] = row[0];
        c.length[s] += steps;
      } else {
        c.start[s] = row[segment];
        c.length[s] = steps;
        c.dead[s] = dead_rows;
      }
      c.closed[s] = ends_here;
      changed.push_back(e * slots + s);
      ++serial;
      segment = t + 1;
    }
    x[e] = serial;
  }
  return at::tensor(changed, at::kLong);
}

}  // namespace gear
