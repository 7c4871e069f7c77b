// The steps' CPU kernels for AVX2 without AVX-512 (AMD Zen 3), torch ops treespec::...: what they do
// and why is in cpu_kernels.py, which builds this file (or cpu_kernels.cpp) once per machine.
#include "cpu_kernels.h"
#include <immintrin.h>

// y[m][16 columns x NP] for MB rows: the weights come packed as [N/16][K][16] (pack_avx2), so one
// 32-byte load gives a panel's 16 weights at k, and two unpacks with zero widen them to fp32 (bf16 is
// fp32's high half) in the column order pack_avx2 arranged: columns 0-7, then 8-15. Each widened
// vector meets all MB rows' x[k] (fp32, broadcast) from registers. Every output sums its K products
// in order in one fp32 lane, whatever MB and NP, so a row gets the same result in a tree as alone.
// Out of line: inlined into rows_linear's loops, GCC spilled accumulators (37 GFLOP/s a core, not 71).
template <int MB, int NP>
__attribute__((noinline)) static void tile(const float* x, int64_t K, const uint16_t* w, int64_t panel, float (*y)[64]) {
  constexpr int64_t PD = 64;  // k ahead (2 KB): a first read of the panel comes from DRAM
  __m256 acc[MB][2 * NP];
#pragma GCC unroll 8
  for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
    for (int j = 0; j < 2 * NP; j++) acc[m][j] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k++) {
    __m256 b[2 * NP];
#pragma GCC unroll 2
    for (int p = 0; p < NP; p++) {
      __m256i v = _mm256_loadu_si256((const __m256i*)(w + p * panel + 16 * k));
      _mm_prefetch((const char*)(w + p * panel + 16 * (k + PD)), _MM_HINT_T0);
      b[2 * p] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
      b[2 * p + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) {
      __m256 a = _mm256_broadcast_ss(x + m * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < 2 * NP; j++) acc[m][j] = _mm256_fmadd_ps(a, b[j], acc[m][j]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
    for (int j = 0; j < 2 * NP; j++) _mm256_storeu_ps(&y[m][8 * j], acc[m][j]);
}

// 8 fp32 -> 8 bf16, round to nearest even (NaN stays a quiet NaN), as torch's conversion
static inline __m128i to_bf16(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: 4 values twice
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

static inline __m256 load_bf16(const uint16_t* p) {  // 8 bf16 -> fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline __m256 round_bf16(__m256 v) {  // fp32 -> the nearest bf16, as fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16(v)), 16));
}

// What rows_linear and rows_glu share: x [M, K] widened once, read by every task (here, not by aten's
// conversion: a token's 120-150 calls a step); a thread's task is two panels (32 packed columns, read in
// order) of every row, the rows 6 at a time (6 x 2 accumulators, 2 weight vectors and a broadcast fill
// the 16 registers), the panels' later reads from L1/L2; 1 or 2 rows take both panels at once, for more
// independent sums in flight. done(t, m, mb, acc): task t's sums for rows m..m+mb-1, acc[r][0..15] the
// first panel's columns, acc[r][16..31] the second's.
template <class Done>
static void rows_tasks(const at::Tensor& xs, const at::Tensor& wp, const Done& done) {
  int64_t M = xs.size(0), K = xs.size(1), panel = 16 * K;
  // widened 8 at a time into the calling thread's kept buffer, while the other thread waits: a fresh
  // zeroed vector and a scalar loop a call made a 5-row tree step 1.6% slower (Zen 3, side by side)
  static thread_local std::vector<float> xf;
  if ((int64_t)xf.size() < M * K) xf.resize(M * K);
  auto xb = (const uint16_t*)xs.data_ptr<at::BFloat16>();
  int64_t i = 0;
  for (; i + 8 <= M * K; i += 8) _mm256_storeu_ps(xf.data() + i, load_bf16(xb + i));
  for (; i < M * K; i++) xf[i] = bf16_to_float(xb[i]);
  const float* xp = xf.data();
  auto wq = (const uint16_t*)wp.data_ptr<at::BFloat16>();
  at::parallel_for(0, wp.size(0) / 2, 1, [&](int64_t t0, int64_t t1) {
    alignas(32) float acc[6][64];
    for (int64_t t = t0; t < t1; t++) {
      const uint16_t* w = wq + 2 * t * panel;
      for (int64_t m = 0; m < M; m += 6) {
        const float* xm = xp + m * K;
        int mb = (int)std::min<int64_t>(M - m, 6);
        switch (mb) {
          case 1: tile<1, 2>(xm, K, w, panel, acc); break;
          case 2: tile<2, 2>(xm, K, w, panel, acc); break;
          default:
            for (int p = 0; p < 2; p++) {
              float (*a)[64] = (float (*)[64])(&acc[0][16 * p]);
              switch (mb) {
                case 3: tile<3, 1>(xm, K, w + p * panel, panel, a); break;
                case 4: tile<4, 1>(xm, K, w + p * panel, panel, a); break;
                case 5: tile<5, 1>(xm, K, w + p * panel, panel, a); break;
                case 6: tile<6, 1>(xm, K, w + p * panel, panel, a); break;
              }
            }
        }
        done(t, m, mb, acc);
      }
    }
  });
}

// y [..., N] = x [..., K] @ w^T (+ b, in fp32 before the one rounding, as F.linear), w packed by
// pack_avx2 as wp [N/16, K, 16]; bf16 in and out, N a multiple of 32.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 && wp.dim() == 3
              && wp.size(2) == 16 && wp.size(0) % 2 == 0 && x.size(-1) == wp.size(1) && wp.is_contiguous(),
              "rows_linear: bf16 x [..., K] and packed w [N/16, K, 16], N a multiple of 32");
  TORCH_CHECK(!b || (b->scalar_type() == at::kBFloat16 && b->numel() == 16 * wp.size(0)), "rows_linear: bf16 bias [N]");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = xs.size(0), N = 16 * wp.size(0);
  auto y = at::empty({M, N}, x.options());
  auto yp = (uint16_t*)y.data_ptr<at::BFloat16>();
  at::Tensor bc = b ? b->contiguous() : at::Tensor();
  auto bp = b ? (const uint16_t*)bc.data_ptr<at::BFloat16>() : nullptr;
  rows_tasks(xs, wp, [&](int64_t t, int64_t m, int mb, float (*acc)[64]) {
    for (int r = 0; r < mb; r++)
      for (int j = 0; j < 4; j++) {
        __m256 v = _mm256_load_ps(&acc[r][8 * j]);
        if (bp) v = _mm256_add_ps(v, load_bf16(bp + 32 * t + 8 * j));
        _mm_storeu_si128((__m128i*)(yp + (m + r) * N + 32 * t + 8 * j), to_bf16(v));
      }
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

extern "C" __m256 Sleef_expf8_u10(__m256);  // libtorch_cpu's, which inductor's exp calls

// SwiGLU's first half, y [..., N] = silu(x @ w1^T) * (x @ w3^T), w1 and w3 [N, K] packed by
// pack_glu_avx2: per 16 columns w1's panel then w3's, so that a task's two panels are one thread's
// gate and up of the same columns, in one call (two, and inductor's SiLU-mul kernel after them, cost
// a Zen 3 about 9 us a layer more for one row and 26 for five). As the compiled model rounds: each
// product to bf16, then silu and the multiply in fp32 (Sleef's exp, IEEE division) and one rounding.
at::Tensor rows_glu(const at::Tensor& x, const at::Tensor& wp) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 && wp.dim() == 3
              && wp.size(2) == 16 && wp.size(0) % 2 == 0 && x.size(-1) == wp.size(1) && wp.is_contiguous(),
              "rows_glu: bf16 x [..., K] and packed w1, w3 [2N/16, K, 16]");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = xs.size(0), N = 8 * wp.size(0);
  auto y = at::empty({M, N}, x.options());
  auto yp = (uint16_t*)y.data_ptr<at::BFloat16>();
  rows_tasks(xs, wp, [&](int64_t t, int64_t m, int mb, float (*acc)[64]) {
    const __m256 one = _mm256_set1_ps(1.f);
    for (int r = 0; r < mb; r++)
      for (int j = 0; j < 2; j++) {
        __m256 a = round_bf16(_mm256_load_ps(&acc[r][8 * j])), u = round_bf16(_mm256_load_ps(&acc[r][16 + 8 * j]));
        __m256 s = _mm256_div_ps(a, _mm256_add_ps(Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), a)), one));
        _mm_storeu_si128((__m128i*)(yp + (m + r) * N + 16 * t + 8 * j), to_bf16(_mm256_mul_ps(s, u)));
      }
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// e^x for x <= 0: 2^n e^f with |f| <= ln2/2, a degree-6 Taylor polynomial (rel. error ~2e-7); below
// -87 (fp32's least normal power of 2, and a masked -inf) 0
static inline __m256 exp_ps(__m256 x) {
  __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147181f), x);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

// One task: up to 8 query rows (lanes) of one kv head against its J = L + T keys, the L cache slots
// and the T tree rows, allow[j] the lanes that may see key j. The keys and values widened to fp32
// once (kf, vf [J][D]); scores 8 keys at a time, each key's d broadcast onto the rows' scaled q
// (qt [D][8], so no horizontal sums); fp32 softmax; then each row's values summed, its weights broadcast.
template <int D>
static void attend(const uint16_t* const* qrow, int nq, const uint16_t* const* krow, const uint16_t* const* vrow,
                   const uint8_t* allow, int64_t J, float scale, uint16_t* const* yrow,
                   float* qt, float* kf, float* vf, float* S, float* Y) {
  for (int64_t d = 0; d < D; d++)
    for (int l = 0; l < 8; l++) qt[8 * d + l] = l < nq ? bf16_to_float(qrow[l][d]) * scale : 0.f;
  for (int64_t j = 0; j < J; j++)
    for (int d = 0; d < D; d += 8) {
      _mm256_store_ps(kf + j * D + d, load_bf16(krow[j] + d));
      _mm256_store_ps(vf + j * D + d, load_bf16(vrow[j] + d));
    }
  for (int64_t j = J; j < (J + 7) / 8 * 8; j++)  // a last block's keys past J: zeros
    for (int d = 0; d < D; d += 8) _mm256_store_ps(kf + j * D + d, _mm256_setzero_ps());
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < J; j0 += 8) {
    __m256 acc[8];
    const float* kr = kf + j0 * D;
#pragma GCC unroll 8
    for (int jj = 0; jj < 8; jj++) acc[jj] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
      __m256 q = _mm256_load_ps(qt + 8 * d);
#pragma GCC unroll 8
      for (int jj = 0; jj < 8; jj++) acc[jj] = _mm256_fmadd_ps(_mm256_broadcast_ss(kr + jj * D + d), q, acc[jj]);
    }
    for (int jj = 0; jj < 8 && j0 + jj < J; jj++) {
      __m256i a = _mm256_set1_epi32(allow[j0 + jj]);
      __m256 ok = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(a, bit), bit));
      __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), acc[jj], ok);
      _mm256_store_ps(S + 8 * (j0 + jj), s);
      m = _mm256_max_ps(m, s);
    }
  }
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < J; j++) {
    __m256 p = exp_ps(_mm256_sub_ps(_mm256_load_ps(S + 8 * j), m));
    _mm256_store_ps(S + 8 * j, p);
    sum = _mm256_add_ps(sum, p);
  }
  alignas(32) float inv[8];
  _mm256_store_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.f), sum));
  // the values 32 keys at a time (8 KB of vf for D = 64, from L1), two rows at once (each load of
  // values meets both), each row's sums kept in Y between the blocks
  for (int64_t j0 = 0; j0 < J; j0 += 32) {
    int64_t j1 = std::min<int64_t>(J, j0 + 32);
    for (int r = 0; r < nq; r += 2)
      for (int d0 = 0; d0 < D; d0 += 32) {
        float *y0 = Y + r * D + d0, *y1 = y0 + D;
        __m256 acc[2][4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
          acc[0][i] = j0 ? _mm256_load_ps(y0 + 8 * i) : _mm256_setzero_ps();
          acc[1][i] = j0 ? _mm256_load_ps(y1 + 8 * i) : _mm256_setzero_ps();
        }
        for (int64_t j = j0; j < j1; j++) {
          __m256 p0 = _mm256_broadcast_ss(S + 8 * j + r), p1 = _mm256_broadcast_ss(S + 8 * j + r + 1);
          const float* v = vf + j * D + d0;
#pragma GCC unroll 4
          for (int i = 0; i < 4; i++) {
            __m256 vv = _mm256_load_ps(v + 8 * i);
            acc[0][i] = _mm256_fmadd_ps(p0, vv, acc[0][i]);
            acc[1][i] = _mm256_fmadd_ps(p1, vv, acc[1][i]);
          }
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
          _mm256_store_ps(y0 + 8 * i, acc[0][i]);
          _mm256_store_ps(y1 + 8 * i, acc[1][i]);
        }
      }
  }
  for (int r = 0; r < nq; r++)
    for (int64_t d = 0; d < D; d += 8)
      _mm_storeu_si128((__m128i*)(yrow[r] + d), to_bf16(_mm256_mul_ps(_mm256_load_ps(Y + r * D + d), _mm256_set1_ps(inv[r]))));
}

// As model.tree_attention (cpu_kernels.h's tree_attention_tasks): a task is 8 of a kv head's G * T
// query rows; a tree step's 15 (5 rows, 3 query heads a kv head) make 2 tasks a kv head.
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_new,
                          const at::Tensor& v_new, const at::Tensor& prefix, const at::Tensor& tree_mask) {
  int64_t D = q.size(3);
  return tree_attention_tasks<8, uint8_t>(q, k, v, k_new, v_new, prefix, tree_mask,
      [D](const uint16_t* const* qrow, int nq, const uint16_t* const* krow, const uint16_t* const* vrow,
          const uint8_t* allow, int64_t J, float scale, uint16_t* const* yrow) {
    // a thread's scratch, kept: a fresh one (about 140 KB at 256 slots) is mapped and faulted in every call
    static thread_local std::vector<float> buf;
    buf.resize(std::max<size_t>(buf.size(), 16 * D + 2 * (J + 8) * D + 8 * J + 8));
    float* qt = (float*)(((uintptr_t)buf.data() + 31) & ~(uintptr_t)31);
    float *Y = qt + 8 * D, *kf = Y + 8 * D, *vf = kf + (J + 8) * D, *S = vf + J * D;
    if (D == 64) attend<64>(qrow, nq, krow, vrow, allow, J, scale, yrow, qt, kf, vf, S, Y);
    else attend<128>(qrow, nq, krow, vrow, allow, J, scale, yrow, qt, kf, vf, S, Y);
  });
}

// argmax (cpu_kernels.h's argmax_rows) as cpu_kernels.cpp's, with 8 lanes
at::Tensor argmax(const at::Tensor& x) {
  return argmax_rows<8>(x, [](const uint16_t* row, int64_t c0, int64_t c1) {
    __m256 b = _mm256_set1_ps(-INFINITY);
    __m256i i = _mm256_set1_epi32((int)c0), at = _mm256_add_epi32(i, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t c = c0; c < c1; c += 8) {  // lane l: the first of its maxima over columns = l mod 8
      __m256 v = load_bf16(row + c);
      __m256 gt = _mm256_cmp_ps(v, b, _CMP_GT_OQ);
      b = _mm256_blendv_ps(b, v, gt);
      i = _mm256_blendv_epi8(i, at, _mm256_castps_si256(gt));
      at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
    }
    alignas(32) float bl[8];
    alignas(32) int32_t il[8];
    _mm256_store_ps(bl, b);
    _mm256_store_si256((__m256i*)il, i);
    float mx = bl[0];
    int32_t at_mx = il[0];
    for (int l = 1; l < 8; l++)
      if (bl[l] > mx || (bl[l] == mx && il[l] < at_mx)) { mx = bl[l]; at_mx = il[l]; }
    return std::pair<float, int64_t>(mx, at_mx);
  });
}

// topk (cpu_kernels.h's topk_rows) as cpu_kernels.cpp's with 8 lanes: one pass that keeps the k best
// in order, 8 columns at a time compared with the k-th.
at::Tensor topk(const at::Tensor& x, int64_t k) {
  return topk_rows(x, k, [](const uint16_t* row, int64_t V, Best& best) {
    alignas(32) float lane[8];
    for (int64_t c = 0; c < V; c += 8) {
      __m256 v = load_bf16(row + c);
      int in = _mm256_movemask_ps(best.full() ? _mm256_cmp_ps(v, _mm256_set1_ps(best.kth()), _CMP_GT_OQ)
                                              : _mm256_cmp_ps(v, v, _CMP_ORD_Q));
      if (!in) continue;
      _mm256_store_ps(lane, v);
      for (; in; in &= in - 1) best.offer(lane[__builtin_ctz(in)], c + __builtin_ctz(in));
    }
  });
}

TORCH_LIBRARY(treespec, m) {
  m.def("rows_linear(Tensor x, Tensor wp, Tensor? b=None) -> Tensor");
  m.def("rows_glu(Tensor x, Tensor wp) -> Tensor");
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor k_new, Tensor v_new, Tensor prefix, Tensor tree_mask) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("topk(Tensor x, int k) -> Tensor");
}
TORCH_LIBRARY_IMPL(treespec, CPU, m) {
  m.impl("rows_linear", &rows_linear);
  m.impl("rows_glu", &rows_glu);
  m.impl("tree_attention", &tree_attention);
  m.impl("argmax", &argmax);
  m.impl("topk", &topk);
}
