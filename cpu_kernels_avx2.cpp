// The steps' CPU kernels for AVX2 without AVX-512 (AMD Zen 3), torch ops treespec::...: what they do
// and why is in cpu_kernels.py, which builds this file (or cpu_kernels.cpp) once per machine.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

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

// y [..., N] = x [..., K] @ w^T, w packed by pack_avx2 as wp [N/16, K, 16]; bf16 in and out, N a
// multiple of 32. A thread's task is 32 columns (two panels, read in order); its rows go 6 at a time
// (6 x 2 accumulators, 2 weight vectors and a broadcast fill the 16 registers), the panels' later
// reads from L1/L2; 1 or 2 rows take both panels at once, for more independent sums in flight.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& wp) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 && wp.dim() == 3
              && wp.size(2) == 16 && wp.size(0) % 2 == 0 && x.size(-1) == wp.size(1) && wp.is_contiguous(),
              "rows_linear: bf16 x [..., K] and packed w [N/16, K, 16], N a multiple of 32");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = xs.size(0), K = xs.size(1), N = 16 * wp.size(0), panel = 16 * K;
  auto y = at::empty({M, N}, x.options());
  // x widened once, read by every task (here, not by aten's conversion: a token's 150 calls a step)
  std::vector<float> xf(M * K);
  auto xb = (const uint16_t*)xs.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * K; i++) {
    uint32_t u = (uint32_t)xb[i] << 16;
    std::memcpy(&xf[i], &u, 4);
  }
  const float* xp = xf.data();
  auto wq = (const uint16_t*)wp.data_ptr<at::BFloat16>();
  auto yp = (uint16_t*)y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / 32, 1, [&](int64_t t0, int64_t t1) {
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
        for (int r = 0; r < mb; r++)
          for (int j = 0; j < 4; j++)
            _mm_storeu_si128((__m128i*)(yp + (m + r) * N + 32 * t + 8 * j), to_bf16(_mm256_load_ps(&acc[r][8 * j])));
      }
    }
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

static inline __m256 load_bf16(const uint16_t* p) {  // 8 bf16 -> fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// logits [..., V] bf16 -> [...] int64, the first index of each row's maximum (torch's argmax; NaNs
// passed over), as cpu_kernels.cpp's with 8 lanes: each thread a run of columns of every row, then
// the runs' maxima meet in order, the earlier winning a tie.
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) % 16 == 0 && x.size(-1) > 0,
              "argmax: bf16 [..., V], V a multiple of 16");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = xs.size(0), V = xs.size(1), T = std::min<int64_t>(at::get_num_threads(), V / 8);
  auto xp = (const uint16_t*)xs.data_ptr<at::BFloat16>();
  std::vector<float> best(T * M);
  std::vector<int64_t> where(T * M);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      int64_t c0 = V / 8 * t / T * 8, c1 = V / 8 * (t + 1) / T * 8;
      for (int64_t m = 0; m < M; m++) {
        __m256 b = _mm256_set1_ps(-INFINITY);
        __m256i i = _mm256_set1_epi32((int)c0), at = _mm256_add_epi32(i, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int64_t c = c0; c < c1; c += 8) {  // lane l: the first of its maxima over columns = l mod 8
          __m256 v = load_bf16(xp + m * V + c);
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
        best[t * M + m] = mx;
        where[t * M + m] = at_mx;
      }
    }
  });
  auto y = at::empty({M}, x.options().dtype(at::kLong));
  auto yp = y.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; m++) {
    int64_t w = 0;  // all NaN (or all -inf): column 0
    for (int64_t t = 0; t < T; t++)
      if (best[t * M + m] > best[w * M + m]) w = t;
    yp[m] = best[w * M + m] == -INFINITY ? 0 : where[w * M + m];
  }
  return y.view(x.sizes().slice(0, x.dim() - 1));
}

// x [..., V] bf16 -> [..., k] int64: the indices of each row's k largest, largest first, the earlier
// first among equals (torch.sort(stable=True, descending=True)'s first k; NaNs passed over), as
// cpu_kernels.cpp's with 8 lanes: one pass that keeps the k best in order, 8 columns at a time
// compared with the k-th.
at::Tensor topk(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) % 16 == 0 && k >= 1 && k <= 64
              && k <= x.size(-1), "topk: bf16 [..., V], V a multiple of 16, 1 <= k <= min(V, 64)");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = xs.size(0), V = xs.size(1);
  auto xp = (const uint16_t*)xs.data_ptr<at::BFloat16>();
  auto y = at::empty({M, k}, x.options().dtype(at::kLong));
  auto yp = y.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; m++) {
    float val[64];
    int64_t* idx = yp + m * k;
    int64_t n = 0;
    alignas(32) float lane[8];
    for (int64_t c = 0; c < V; c += 8) {
      __m256 v = load_bf16(xp + m * V + c);
      int in = _mm256_movemask_ps(n < k ? _mm256_cmp_ps(v, v, _CMP_ORD_Q)
                                        : _mm256_cmp_ps(v, _mm256_set1_ps(val[k - 1]), _CMP_GT_OQ));
      if (!in) continue;
      _mm256_store_ps(lane, v);
      for (; in; in &= in - 1) {
        int j = __builtin_ctz(in);
        float u = lane[j];
        int64_t p;
        if (n < k) p = n++;
        else if (u > val[k - 1]) p = k - 1;  // (the k-th may have risen since the compare)
        else continue;
        for (; p > 0 && val[p - 1] < u; p--) { val[p] = val[p - 1]; idx[p] = idx[p - 1]; }
        val[p] = u;
        idx[p] = c + j;
      }
    }
    for (; n < k; n++) idx[n] = 0;  // fewer than k values that are not NaN
  }
  return y.view([&] { auto s = x.sizes().vec(); s.back() = k; return s; }());
}

TORCH_LIBRARY(treespec, m) {
  m.def("rows_linear(Tensor x, Tensor wp) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("topk(Tensor x, int k) -> Tensor");
}
TORCH_LIBRARY_IMPL(treespec, CPU, m) {
  m.impl("rows_linear", &rows_linear);
  m.impl("argmax", &argmax);
  m.impl("topk", &topk);
}
