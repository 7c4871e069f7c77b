// What cpu_kernels.cpp (AVX-512) and cpu_kernels_avx2.cpp share: the parts of their ops that do not
// depend on the vector width. Each of them includes it and is built alone, for its own CPU.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

static inline float bf16_to_float(uint16_t h) {  // bf16 is fp32's high half
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// x [..., V] bf16 -> [...] int64, the first index of each row's maximum (torch's argmax; NaNs
// passed over). Each thread takes a run of columns of every row (multiples of LANES), then the
// runs' maxima meet in order, the earlier winning a tie; a row all NaN (or all -inf): column 0.
// run(row, c0, c1) -> (the maximum of row[c0, c1), its first column).
template <int LANES, class Run>
static at::Tensor argmax_rows(const at::Tensor& x, Run run) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) % 16 == 0 && x.size(-1) > 0,
              "argmax: bf16 [..., V], V a multiple of 16");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = xs.size(0), V = xs.size(1), T = std::min<int64_t>(at::get_num_threads(), V / LANES);
  auto xp = (const uint16_t*)xs.data_ptr<at::BFloat16>();
  std::vector<std::pair<float, int64_t>> best(T * M);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      int64_t c0 = V / LANES * t / T * LANES, c1 = V / LANES * (t + 1) / T * LANES;
      for (int64_t m = 0; m < M; m++) best[t * M + m] = run(xp + m * V, c0, c1);
    }
  });
  auto y = at::empty({M}, x.options().dtype(at::kLong));
  auto yp = y.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; m++) {
    int64_t w = 0;
    for (int64_t t = 0; t < T; t++)
      if (best[t * M + m].first > best[w * M + m].first) w = t;
    yp[m] = best[w * M + m].first == -INFINITY ? 0 : best[w * M + m].second;
  }
  return y.view(x.sizes().slice(0, x.dim() - 1));
}

// topk's k best of a row so far, largest first, the earlier column first among equals
struct Best {
  float val[64];
  int64_t* idx;
  int64_t n, k;
  bool full() const { return n == k; }
  float kth() const { return val[k - 1]; }
  void offer(float u, int64_t c) {  // u, not NaN, at column c (past the columns offered before)
    int64_t p;
    if (n < k) p = n++;
    else if (u > val[k - 1]) p = k - 1;  // (the k-th may have risen since the caller's compare)
    else return;
    for (; p > 0 && val[p - 1] < u; p--) { val[p] = val[p - 1]; idx[p] = idx[p - 1]; }
    val[p] = u;
    idx[p] = c;
  }
};

// x [..., V] bf16 -> [..., k] int64: the indices of each row's k largest, largest first, the earlier
// first among equals (torch.sort(stable=True, descending=True)'s first k; NaNs passed over).
// scan(row, V, best) offers best the row's values in column order, or those of them that beat the
// k-th once best is full.
template <class Scan>
static at::Tensor topk_rows(const at::Tensor& x, int64_t k, Scan scan) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) % 16 == 0 && k >= 1 && k <= 64
              && k <= x.size(-1), "topk: bf16 [..., V], V a multiple of 16, 1 <= k <= min(V, 64)");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = xs.size(0), V = xs.size(1);
  auto xp = (const uint16_t*)xs.data_ptr<at::BFloat16>();
  auto y = at::empty({M, k}, x.options().dtype(at::kLong));
  for (int64_t m = 0; m < M; m++) {
    Best best;
    best.idx = y.data_ptr<int64_t>() + m * k;
    best.n = 0;
    best.k = k;
    scan(xp + m * V, V, best);
    for (; best.n < k; best.n++) best.idx[best.n] = 0;  // fewer than k values that are not NaN
  }
  return y.view([&] { auto s = x.sizes().vec(); s.back() = k; return s; }());
}

// tree_attention's tasks, as model.tree_attention: q [B, H, T, D]; k, v [B, H_kv, L, D] (the cache's
// span); k_new, v_new [B, H_kv, T, D]; prefix bool [1 or B, L]; tree_mask bool [T, T]. bf16, any
// strides with the last dim contiguous, D 64 or 128. Returns y [B, H, T, D]. A task is LANES of a
// kv head's G * T query rows against its J = L + T keys, the L cache slots and the T tree rows:
// attend(qrow, nq, krow, vrow, allow, J, scale, yrow), allow[j] the lanes (bits) that may see key j.
template <int LANES, class Mask, class Attend>
static at::Tensor tree_attention_tasks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& prefix,
                                       const at::Tensor& tree_mask, Attend attend) {
  int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hk = k.size(1), L = k.size(2);
  for (auto* t : {&q, &k, &v, &k_new, &v_new})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 4 && t->stride(3) == 1, "tree_attention: bf16, last dim contiguous");
  TORCH_CHECK(D == 64 || D == 128, "tree_attention: head_dim 64 or 128");
  auto pre = prefix.reshape({-1, L}).to(at::kBool).contiguous();
  auto tm = tree_mask.to(at::kBool).contiguous();
  auto y = at::empty({B, H, T, D}, q.options());
  int64_t G = H / Hk, R = G * T, NP = (R + LANES - 1) / LANES, J = L + T;
  auto base = [](const at::Tensor& t) { return (const uint16_t*)t.data_ptr<at::BFloat16>(); };
  const uint16_t *qb = base(q), *kb = base(k), *vb = base(v), *knb = base(k_new), *vnb = base(v_new);
  const bool* preb = pre.data_ptr<bool>();
  const bool* tmb = tm.data_ptr<bool>();
  uint16_t* yb = (uint16_t*)y.data_ptr<at::BFloat16>();
  float scale = 1.f / std::sqrt((float)D);
  const Mask all = (Mask)((1u << LANES) - 1);
  at::parallel_for(0, B * Hk * NP, 1, [&](int64_t i0, int64_t i1) {
    std::vector<const uint16_t*> krow(J), vrow(J);
    std::vector<Mask> allow(J);
    for (int64_t i = i0; i < i1; i++) {
      int64_t b = i / (Hk * NP), h = (i / NP) % Hk, p = i % NP;
      const uint16_t* qrow[LANES];
      uint16_t* yrow[LANES];
      int nq = (int)std::min<int64_t>(LANES, R - LANES * p);
      for (int l = 0; l < LANES; l++) {
        int64_t r = LANES * p + std::min(l, nq - 1), g = r / T, t = r % T;
        qrow[l] = qb + b * q.stride(0) + (h * G + g) * q.stride(1) + t * q.stride(2);
        yrow[l] = yb + ((b * H + h * G + g) * T + t) * D;
      }
      const bool* pb = preb + (pre.size(0) == 1 ? 0 : b) * L;
      for (int64_t j = 0; j < L; j++) {
        krow[j] = kb + b * k.stride(0) + h * k.stride(1) + j * k.stride(2);
        vrow[j] = vb + b * v.stride(0) + h * v.stride(1) + j * v.stride(2);
        allow[j] = pb[j] ? all : 0;
      }
      for (int64_t u = 0; u < T; u++) {
        krow[L + u] = knb + b * k_new.stride(0) + h * k_new.stride(1) + u * k_new.stride(2);
        vrow[L + u] = vnb + b * v_new.stride(0) + h * v_new.stride(1) + u * v_new.stride(2);
        unsigned a = 0;
        for (int l = 0; l < nq; l++) a |= tmb[((LANES * p + l) % T) * T + u] ? 1u << l : 0u;
        allow[L + u] = (Mask)(a | (all & (all << nq)));  // (lanes past the rows: anything finite)
      }
      attend(qrow, nq, krow.data(), vrow.data(), allow.data(), J, scale, yrow);
    }
  });
  return y;
}
