#include "kernels/packing.h"

#include <algorithm>
#include <cmath>

namespace gear {
namespace {

void check_int64(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(),
              "packing: ", name, " must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(numel < 0 || t.numel() == numel, "packing: ", name, " has ", t.numel(), " entries, expected ", numel);
}

template <typename Offset>
Sequences spans(const at::Tensor& episode_start, const at::Tensor& episode_length, const at::Tensor& slots,
                int64_t max_train, int64_t burn_in, Offset offset_of) {
  check_int64(episode_start, "episode_start", -1);
  check_int64(episode_length, "episode_length", episode_start.numel());
  check_int64(slots, "slots", -1);
  TORCH_CHECK(max_train >= 1 && burn_in >= 0, "packing: need max_train >= 1 and burn_in >= 0, got ", max_train,
              ", ", burn_in);
  const int64_t n = slots.numel(), num_slots = episode_start.numel();
  at::Tensor first = at::empty({n}, at::kLong), length = at::empty({n}, at::kLong);
  at::Tensor head = at::empty({n}, at::kLong), step = at::empty({n}, at::kLong);
  const int64_t *start = episode_start.data_ptr<int64_t>(), *len = episode_length.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  int64_t *f = first.data_ptr<int64_t>(), *l = length.data_ptr<int64_t>(), *h = head.data_ptr<int64_t>(),
          *s = step.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = slot[i];
    TORCH_CHECK(k >= 0 && k < num_slots, "packing: slot ", k, " out of range [0, ", num_slots, ")");
    TORCH_CHECK(len[k] >= 1, "packing: slot ", k, " holds no episode");
    const int64_t spans_in = std::max<int64_t>(len[k] - max_train + 1, 1);
    const int64_t offset = offset_of(i, spans_in);
    TORCH_CHECK(offset >= 0 && offset < spans_in, "packing: offset ", offset, " is not a span start of an episode of ",
                len[k], " steps");
    h[i] = std::min(burn_in, offset);
    f[i] = start[k] + offset - h[i];
    l[i] = h[i] + std::min(len[k] - offset, max_train);
    s[i] = offset - h[i];
  }
  return {first, length, head, step};
}

}  // namespace

Sequences place_spans(const at::Tensor& episode_start, const at::Tensor& episode_length, const at::Tensor& slots,
                      const at::Tensor& offset, int64_t max_train, int64_t burn_in) {
  check_int64(offset, "offset", slots.numel());
  const int64_t* o = offset.data_ptr<int64_t>();
  return spans(episode_start, episode_length, slots, max_train, burn_in, [o](int64_t i, int64_t) { return o[i]; });
}

Sequences uniform_spans(const at::Tensor& episode_start, const at::Tensor& episode_length, const at::Tensor& slots,
                        const at::Tensor& u, int64_t max_train, int64_t burn_in) {
  TORCH_CHECK(u.device().is_cpu() && u.scalar_type() == at::kDouble && u.dim() == 1 && u.numel() == slots.numel() &&
                  u.is_contiguous(),
              "packing: u must be a contiguous 1-D float64 CPU tensor with one entry per slot");
  const double* uu = u.data_ptr<double>();
  return spans(episode_start, episode_length, slots, max_train, burn_in, [uu](int64_t i, int64_t spans_in) {
    // u * spans_in can round up to spans_in itself: clamp to the last span.
    return std::min(static_cast<int64_t>(std::floor(uu[i] * static_cast<double>(spans_in))), spans_in - 1);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> pack_tokens(
    const at::Tensor& first, const at::Tensor& length, const at::Tensor& burn_in, const at::Tensor& step,
    int64_t budget, int64_t window_rows) {
  const int64_t n = first.numel();
  check_int64(first, "first", -1);
  check_int64(length, "length", n);
  check_int64(burn_in, "burn_in", n);
  check_int64(step, "step", n);
  TORCH_CHECK(budget >= 0 && window_rows >= 1, "packing: need budget >= 0 and window_rows >= 1, got ", budget, ", ",
              window_rows);
  at::Tensor rows = at::empty({budget}, at::kLong), valid = at::empty({budget}, at::kLong);
  at::Tensor position = at::empty({budget}, at::kLong), token_step = at::empty({budget}, at::kLong);
  at::Tensor trained = at::empty({budget}, at::kBool), seq = at::empty({budget}, at::kLong);
  at::Tensor last = at::empty({budget}, at::kBool);
  const int64_t *f = first.data_ptr<int64_t>(), *l = length.data_ptr<int64_t>(), *b = burn_in.data_ptr<int64_t>(),
                *s = step.data_ptr<int64_t>();
  int64_t *r = rows.data_ptr<int64_t>(), *v = valid.data_ptr<int64_t>(), *p = position.data_ptr<int64_t>(),
          *ts = token_step.data_ptr<int64_t>(), *q = seq.data_ptr<int64_t>();
  bool *t = trained.data_ptr<bool>(), *e = last.data_ptr<bool>();
  int64_t at_token = 0;
  for (int64_t i = 0; i < n && at_token < budget; ++i) {
    TORCH_CHECK(l[i] >= 1 && b[i] >= 0 && b[i] < l[i], "packing: sequence ", i, " of ", l[i],
                " tokens with a burn-in of ", b[i], " has no step to train on");
    const int64_t room = budget - at_token;
    if (l[i] > room && room <= b[i]) break;  // the room holds no trained step of it: padding
    const int64_t take = std::min(l[i], room);
    int64_t row = f[i] % window_rows;
    if (row < 0) row += window_rows;
    for (int64_t j = 0; j < take; ++j, ++at_token) {
      r[at_token] = row;
      v[at_token] = 1;
      p[at_token] = j;
      ts[at_token] = s[i] + j;
      t[at_token] = j >= b[i];
      q[at_token] = i;
      e[at_token] = j == take - 1;
      if (++row == window_rows) row = 0;
    }
  }
  for (; at_token < budget; ++at_token) {
    r[at_token] = 0;
    v[at_token] = 0;
    p[at_token] = -1;
    ts[at_token] = -1;
    t[at_token] = false;
    q[at_token] = -1;
    e[at_token] = false;
  }
  return {rows, valid, position, token_step, trained, seq, last};
}

}  // namespace gear
