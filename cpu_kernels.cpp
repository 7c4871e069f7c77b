// The steps' CPU kernels (torch ops treespec::...): what they do and why is in cpu_kernels.py,
// which builds this file once per machine and registers the ops' shapes for torch.compile.
#include "cpu_kernels.h"
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

// A tile of y: MB rows times NB panels of 16 columns. The weights come packed as [N/16][K/2][16][2]
// (a panel's 16 columns, a pair of k at a time: one 64-byte line per pair, each panel one stream);
// vdpbf16ps multiplies a line with a row's pair of x broadcast to all lanes, summing both products
// into the column's fp32 lane. So each weight line loaded meets all MB rows from registers, there is
// no horizontal sum, and a thread reads its panels in order (prefetched PD lines ahead).
template <int MB, int NB>
static void tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t panel, uint16_t* y, int64_t N) {
  constexpr int64_t PD = 16;
  __m512 acc[MB][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K / 2; kk++) {
    __m512bh b[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
      b[j] = (__m512bh)_mm512_loadu_si512(w + j * panel + kk * 32);
      _mm_prefetch((const char*)(w + j * panel + (kk + PD) * 32), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * kk, 4);
      __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < NB; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, b[j]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++)
      _mm256_storeu_si256((__m256i*)(y + m * N + j * 16), (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
}

template <int NB>
static void rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t panel, uint16_t* y, int64_t N) {
  // rows in blocks of 8 (8 x 3 accumulators and 3 weight lines fill the 32 registers); a second
  // block finds this tile's weights in L2
  for (int64_t m = 0; m < M; m += 8) {
    const uint16_t* xm = x + m * K;
    uint16_t* ym = y + m * N;
    switch (std::min<int64_t>(M - m, 8)) {
      case 1: tile<1, NB>(xm, K, w, panel, ym, N); break;
      case 2: tile<2, NB>(xm, K, w, panel, ym, N); break;
      case 3: tile<3, NB>(xm, K, w, panel, ym, N); break;
      case 4: tile<4, NB>(xm, K, w, panel, ym, N); break;
      case 5: tile<5, NB>(xm, K, w, panel, ym, N); break;
      case 6: tile<6, NB>(xm, K, w, panel, ym, N); break;
      case 7: tile<7, NB>(xm, K, w, panel, ym, N); break;
      case 8: tile<8, NB>(xm, K, w, panel, ym, N); break;
    }
  }
}

// y [..., N] = x [..., K] @ w^T, with w packed by pack() below as wp [N/16, K/2, 16, 2]; bf16 in and out
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& wp) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 && wp.dim() == 4
              && wp.size(2) == 16 && wp.size(3) == 2 && x.size(-1) == 2 * wp.size(1) && wp.is_contiguous(),
              "rows_linear: bf16 x [..., K] and packed w [N/16, K/2, 16, 2]");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = xs.size(0), K = xs.size(1), P = wp.size(0), N = 16 * P, panel = 16 * K;
  auto y = at::empty({M, N}, x.options());
  auto xp = (const uint16_t*)xs.data_ptr<at::BFloat16>();
  auto wq = (const uint16_t*)wp.data_ptr<at::BFloat16>();
  auto yp = (uint16_t*)y.data_ptr<at::BFloat16>();
  constexpr int64_t NB = 3;
  at::parallel_for(0, (P + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      int64_t p = b * NB;
      const uint16_t* wb = wq + p * panel;
      switch (std::min<int64_t>(P - p, NB)) {
        case 3: rows<3>(xp, M, K, wb, panel, yp + 16 * p, N); break;
        case 2: rows<2>(xp, M, K, wb, panel, yp + 16 * p, N); break;
        case 1: rows<1>(xp, M, K, wb, panel, yp + 16 * p, N); break;
      }
    }
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// e^x for x in [-100, 0]: 2^n e^f with |f| <= ln2/2, a degree-6 Taylor polynomial (rel. error ~2e-7)
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 widen_bf16(__m256i v) {  // 16 bf16 -> fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline __m512 load_bf16(const uint16_t* p) {
  return widen_bf16(_mm256_loadu_si256((const __m256i*)p));
}

// One task: 16 query rows (lanes) of one kv head against its J = L + T keys, the L cache slots
// the prefix mask lets in and the T tree rows the tree mask lets in. Scores with vdpbf16ps (the 16
// rows' q packed as pairs of d, a key's pair broadcast), fp32 softmax over the keys, and the values
// summed the same way (RB rows at a time, DV vectors of 16 d each).
template <int DV>
static void task(const uint16_t* const* qrow, int nq, const uint16_t* const* krow, const uint16_t* const* vrow,
                 const __mmask16* allow, int64_t J, float scale, uint16_t* const* yrow, float* S) {
  constexpr int D = 16 * DV, RB = 16 / DV;
  alignas(64) uint16_t qp[D / 2][16][2];
  for (int l = 0; l < 16; l++)
    for (int kk = 0; kk < D / 2; kk++)
      for (int e = 0; e < 2; e++) qp[kk][l][e] = l < nq ? qrow[l][2 * kk + e] : 0;
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < J; j0 += 8) {
    __m512 acc[8];
    const uint16_t* kr[8];
    for (int jj = 0; jj < 8; jj++) { acc[jj] = _mm512_setzero_ps(); kr[jj] = krow[std::min<int64_t>(j0 + jj, J - 1)]; }
    for (int kk = 0; kk < D / 2; kk++) {
      __m512bh qv = (__m512bh)_mm512_load_si512(&qp[kk][0][0]);
#pragma GCC unroll 8
      for (int jj = 0; jj < 8; jj++) {
        int32_t pair;
        std::memcpy(&pair, kr[jj] + 2 * kk, 4);
        acc[jj] = _mm512_dpbf16_ps(acc[jj], (__m512bh)_mm512_set1_epi32(pair), qv);
      }
    }
    for (int jj = 0; jj < 8 && j0 + jj < J; jj++) {
      __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), allow[j0 + jj], _mm512_mul_ps(acc[jj], _mm512_set1_ps(scale)));
      _mm512_store_ps(S + 16 * (j0 + jj), s);
      m = _mm512_max_ps(m, s);
    }
  }
  // p = e^(s - max) in fp32 (their sum, too), then rounded to bf16 in pairs of keys, P2[j/2][lane]
  // = (p[j], p[j+1]): the values' sum is a vdpbf16ps as well, on pairs (v[j][d], v[j+1][d])
  __m512 sum = _mm512_setzero_ps();
  int32_t* P2 = (int32_t*)S;  // (overwrites S two rows behind: pair j/2 lands in row j/2 <= j)
  for (int64_t j = 0; j < J; j += 2) {
    __m512 p0 = exp_ps(_mm512_sub_ps(_mm512_load_ps(S + 16 * j), m));
    __m512 p1 = j + 1 < J ? exp_ps(_mm512_sub_ps(_mm512_load_ps(S + 16 * (j + 1)), m)) : _mm512_setzero_ps();
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    __m512i b0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p0));
    __m512i b1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1));
    _mm512_store_si512(P2 + 16 * (j / 2), _mm512_or_si512(b0, _mm512_slli_epi32(b1, 16)));
  }
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
  for (int l0 = 0; l0 < nq; l0 += RB) {
    __m512 acc[RB][DV];
    for (int rr = 0; rr < RB; rr++)
      for (int dv = 0; dv < DV; dv++) acc[rr][dv] = _mm512_setzero_ps();
    for (int64_t j = 0; j < J; j += 2) {
      const uint16_t* v0 = vrow[j];
      const uint16_t* v1 = vrow[std::min<int64_t>(j + 1, J - 1)];  // (an odd J's last pair: p = 0 there)
      __m512bh vp[DV];
#pragma GCC unroll 8
      for (int dv = 0; dv < DV; dv++) {
        __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v0 + 16 * dv)));
        __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v1 + 16 * dv)));
        vp[dv] = (__m512bh)_mm512_or_si512(a, _mm512_slli_epi32(b, 16));
      }
#pragma GCC unroll 8
      for (int rr = 0; rr < RB; rr++) {
        __m512bh p = (__m512bh)_mm512_set1_epi32(P2[16 * (j / 2) + l0 + rr]);
#pragma GCC unroll 8
        for (int dv = 0; dv < DV; dv++) acc[rr][dv] = _mm512_dpbf16_ps(acc[rr][dv], p, vp[dv]);
      }
    }
    for (int rr = 0; rr < RB && l0 + rr < nq; rr++)
      for (int dv = 0; dv < DV; dv++)
        _mm256_storeu_si256((__m256i*)(yrow[l0 + rr] + 16 * dv),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[rr][dv], _mm512_set1_ps(inv[l0 + rr]))));
  }
}

// As model.tree_attention (cpu_kernels.h's tree_attention_tasks): a task is 16 of a kv head's G * T query rows.
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_new,
                          const at::Tensor& v_new, const at::Tensor& prefix, const at::Tensor& tree_mask) {
  int64_t D = q.size(3);
  return tree_attention_tasks<16, __mmask16>(q, k, v, k_new, v_new, prefix, tree_mask,
      [D](const uint16_t* const* qrow, int nq, const uint16_t* const* krow, const uint16_t* const* vrow,
          const __mmask16* allow, int64_t J, float scale, uint16_t* const* yrow) {
    static thread_local std::vector<float> Sbuf;  // a thread's scratch, kept between calls
    Sbuf.resize(std::max<size_t>(Sbuf.size(), 16 * J + 16));
    float* S = (float*)(((uintptr_t)Sbuf.data() + 63) & ~(uintptr_t)63);
    if (D == 64) task<4>(qrow, nq, krow, vrow, allow, J, scale, yrow, S);
    else task<8>(qrow, nq, krow, vrow, allow, J, scale, yrow, S);
  });
}

// 16 x 16 fp32 in registers, transposed in place (unpack, shuffle within lanes, then 128-bit blocks)
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 4; j++) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; j++) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static bool amx_permitted() {  // the kernel may use the tile registers (Linux: ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// C tiles 0-3 (rows 0-15 and 16-31 by 2 x 16 columns), A 4-5, B 6-7, for m0 + m1 rows (shape: the last set)
static inline void tile_config(int& shape, int m0, int m1) {
  if (shape == 32 * m0 + m1) return;
  shape = 32 * m0 + m1;
  alignas(64) TileConfig cfg = {};
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = m0;
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = std::max(m1, 1);
  cfg.rows[6] = cfg.rows[7] = 16;
  _tile_loadconfig(&cfg);
}

// c [rows][32] (fp32) = the rows of xr (row stride K; 16 + m1 of them, or the config's m0 when m1 is 0)
// times one group of 32 packed columns wg [K/32][2][16][16][2]
static inline void tile_group(const uint16_t* xr, int64_t K, const uint16_t* wg, int m1, float (*c)[32]) {
  _tile_zero(0); _tile_zero(1);
  if (m1) { _tile_zero(2); _tile_zero(3); }
  for (int64_t kb = 0; kb < K / 32; kb++) {
    _tile_loadd(4, xr + kb * 32, K * 2);
    _tile_loadd(6, wg + kb * 1024, 64);
    _tile_loadd(7, wg + kb * 1024 + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (m1) {
      _tile_loadd(5, xr + 16 * K + kb * 32, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, &c[0][0], 128);
  _tile_stored(1, &c[0][16], 128);
  if (m1) { _tile_stored(2, &c[16][0], 128); _tile_stored(3, &c[16][16], 128); }
}

// y [..., N] = x [..., K] @ w^T on AMX tiles, w packed by pack_tiles() as [N/32][K/32][2][16][16][2]:
// for 32 columns and 32 k, the two B tiles (16 pairs of k by 16 columns by the pair), 2 KB in a row,
// so that a thread's share of w is one sequential stream (the hardware prefetcher keeps up: software
// prefetches measured no faster). x's rows, up to 32 at a time, are A tiles; each C tile sums a row's
// products in the same order whatever the other rows, so a row gets the same result in a tree step as
// alone. 1-16 rows stream the weights at 25 GB/s on a 2-core Xeon 167, as fast as one row's GEMV.
at::Tensor tiles_linear(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 && wp.dim() == 6
              && wp.size(2) == 2 && wp.size(3) == 16 && wp.size(4) == 16 && wp.size(5) == 2
              && x.size(-1) == 32 * wp.size(1) && wp.is_contiguous(),
              "tiles_linear: bf16 x [..., K] and packed w [N/32, K/32, 2, 16, 16, 2]");
  TORCH_CHECK(!b || (b->scalar_type() == at::kBFloat16 && b->dim() == 1 && b->size(0) == 32 * wp.size(0)
                     && b->is_contiguous()), "tiles_linear: the bias is bf16 [N]");
  TORCH_CHECK(amx_permitted(), "tiles_linear: AMX tiles not permitted");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = xs.size(0), K = xs.size(1), G = wp.size(0), N = 32 * G;
  auto y = at::empty({M, N}, x.options());
  auto xp = (const uint16_t*)xs.data_ptr<at::BFloat16>();
  auto wq = (const uint16_t*)wp.data_ptr<at::BFloat16>();
  auto yp = (uint16_t*)y.data_ptr<at::BFloat16>();
  auto bp = b ? (const uint16_t*)b->data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float c[32][32];
    int shape = -1;
    for (int64_t g = g0; g < g1; g++) {
      for (int64_t r = 0; r < M; r += 32) {  // (past 32 rows the next block finds the group's weights in L1/L2)
        int m0 = (int)std::min<int64_t>(M - r, 16), m1 = (int)std::min<int64_t>(M - r - m0, 16);
        tile_config(shape, m0, m1);
        tile_group(xp + r * K, K, wq + g * K * 32, m1, c);
        __m512 bias[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // summed in fp32, rounded once
        for (int h = 0; bp && h < 2; h++)
          bias[h] = load_bf16(bp + 32 * g + 16 * h);
        for (int m = 0; m < m0 + m1; m++)
          for (int h = 0; h < 2; h++)
            _mm256_storeu_si256((__m256i*)(yp + (r + m) * N + 32 * g + 16 * h),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(&c[m][16 * h]), bias[h])));
      }
    }
    _tile_release();
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

extern "C" __m512 Sleef_expf16_u10(__m512);  // libtorch_cpu's, which inductor's exp calls

static inline __m512 round_bf16(__m512 v) {  // fp32 -> the nearest bf16, as fp32
  return widen_bf16((__m256i)_mm512_cvtneps_pbh(v));
}

// SwiGLU's first half, y [..., N] = silu(x @ w1^T) * (x @ w3^T), with w1 and w3 [N, K] packed by
// pack_glu: per 32 columns, w1's group then w3's, so that one thread has both in the same C tiles'
// rows and the product leaves no [M, 2N] for another kernel (a tree's 13 rows took inductor's
// SiLU-mul kernel 10 us a layer). As the compiled model rounds: each product to bf16, then silu and
// the multiply in fp32 (Sleef's exp, IEEE division) and one rounding.
at::Tensor tiles_glu(const at::Tensor& x, const at::Tensor& wp) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 && wp.dim() == 6
              && wp.size(0) % 2 == 0 && wp.size(2) == 2 && wp.size(3) == 16 && wp.size(4) == 16
              && wp.size(5) == 2 && x.size(-1) == 32 * wp.size(1) && wp.is_contiguous(),
              "tiles_glu: bf16 x [..., K] and packed w1, w3 [2N/32, K/32, 2, 16, 16, 2]");
  TORCH_CHECK(amx_permitted(), "tiles_glu: AMX tiles not permitted");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = xs.size(0), K = xs.size(1), G = wp.size(0) / 2, N = 32 * G;
  auto y = at::empty({M, N}, x.options());
  auto xp = (const uint16_t*)xs.data_ptr<at::BFloat16>();
  auto wq = (const uint16_t*)wp.data_ptr<at::BFloat16>();
  auto yp = (uint16_t*)y.data_ptr<at::BFloat16>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float c[32][32], d[32][32];
    int shape = -1;
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t g = g0; g < g1; g++) {
      for (int64_t r = 0; r < M; r += 32) {
        int m0 = (int)std::min<int64_t>(M - r, 16), m1 = (int)std::min<int64_t>(M - r - m0, 16);
        tile_config(shape, m0, m1);
        tile_group(xp + r * K, K, wq + 2 * g * K * 32, m1, c);
        tile_group(xp + r * K, K, wq + (2 * g + 1) * K * 32, m1, d);
        for (int m = 0; m < m0 + m1; m++)
          for (int h = 0; h < 2; h++) {
            __m512 a = round_bf16(_mm512_load_ps(&c[m][16 * h])), u = round_bf16(_mm512_load_ps(&d[m][16 * h]));
            __m512 s = _mm512_div_ps(a, _mm512_add_ps(Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), a)), one));
            _mm256_storeu_si256((__m256i*)(yp + (r + m) * N + 32 * g + 16 * h),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, u)));
          }
      }
    }
    _tile_release();
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// logits [..., V] bf16 -> [...] int64, the first index of each row's maximum (torch's argmax; NaNs
// are passed over). Each thread takes a run of columns of every row, the run the lm_head's kernel
// wrote from that core, then the runs' maxima meet in order, the earlier winning a tie. (Inductor's
// max-then-min took 200 us over 13 rows of 49,152, as much as 12 of the tree step's 30 layers' norms.)
at::Tensor argmax(const at::Tensor& x) {
  return argmax_rows<16>(x, [](const uint16_t* row, int64_t c0, int64_t c1) {
    __m512 b = _mm512_set1_ps(-INFINITY);
    __m512i i = _mm512_set1_epi32((int)c0), at = _mm512_add_epi32(i, _mm512_set_epi32(
        15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    for (int64_t c = c0; c < c1; c += 16) {  // lane l: the first of its maxima over columns = l mod 16
      __m512 v = load_bf16(row + c);
      __mmask16 gt = _mm512_cmp_ps_mask(v, b, _CMP_GT_OQ);
      b = _mm512_mask_blend_ps(gt, b, v);
      i = _mm512_mask_blend_epi32(gt, i, at);
      at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
    }
    float mx = _mm512_reduce_max_ps(b);
    return std::pair<float, int64_t>(mx, _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(b, _mm512_set1_ps(mx), _CMP_EQ_OQ), i));
  });
}

// x [..., V] bf16 -> [..., k] int64: the indices of each row's k largest, largest first, the earlier
// first among equals (torch.sort(stable=True, descending=True)'s first k; NaNs passed over). A draft's
// few choices over its vocab: one pass that keeps the k best in order, each 16 columns compared at
// once with the k-th (torch's CPU topk copies the row into (value, index) pairs and sorts them: 41 us
// a call over 8,192 in a tree step, 3 calls a step for EAGLE).
at::Tensor topk(const at::Tensor& x, int64_t k) {
  return topk_rows(x, k, [](const uint16_t* row, int64_t V, Best& best) {
    alignas(64) float lane[16];
    for (int64_t c = 0; c < V; c += 16) {
      __m512 v = load_bf16(row + c);
      __mmask16 in = best.full() ? _mm512_cmp_ps_mask(v, _mm512_set1_ps(best.kth()), _CMP_GT_OQ)
                                 : _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
      if (!in) continue;
      _mm512_store_ps(lane, v);
      for (; in; in &= in - 1) best.offer(lane[__builtin_ctz(in)], c + __builtin_ctz(in));
    }
  });
}

// x [16 lanes: 8 pairs (x0, x1)] rotated by f [the 8 pairs' (cos, sin)], as apply_rotary_emb: x0 cos - x1 sin,
// x1 cos + x0 sin, each product rounded to fp32, then one subtraction or addition (inductor: no contraction)
static inline __m512 rope16(__m512 x, __m512 f) {
  __m512 xc = _mm512_mul_ps(x, _mm512_moveldup_ps(f));
  __m512 ws = _mm512_mul_ps(_mm512_permute_ps(x, 0xB1), _mm512_movehdup_ps(f));  // (x1 sin, x0 sin)
  return _mm512_mask_sub_ps(_mm512_add_ps(xc, ws), 0x5555, xc, ws);
}

// An Attention's work for a few query rows on AMX tiles, from its qkv projection on: q and k rotated
// (RoPE in interleaved pairs, in fp32, rounded to bf16, as apply_rotary_emb), this call's k and v
// written into the cache slots pos, then SDPA with a bool mask over the cache's first L slots, the
// output in the layout wo reads. One op instead of inductor's RoPE loops (scalar over the pairs, 14
// us a layer for 13 rows) and a copy of the output (what SDPA's CPU kernel spends on a tree's rows is
// mostly per-head setup: 13 rows over 576 slots cost it 115 us, the attention here 43; Xeon 167).
// qkv [B, T, (H + 2 H_kv) 64] bf16; freqs [T, 32, 2] fp32 (cos, sin); pos [T] int64; mask bool
// [T or 1, L] (or with leading 1s), L <= S; these in any strides; k_cache, v_cache [>= B, H_kv, S,
// 64] bf16, contiguous, written. Returns y [B, T, H 64]. A task is 16 query rows of one kv head (its
// query heads' rows as rows):
// - scores transposed, S^T [16 keys][16 rows] = K (A tiles, straight from the cache) x q^T (B tiles,
//   q in pairs of d), each 16 x 16 turned back in registers;
// - softmax a row at a time in fp32 (as SDPA), the weights unnormalised in bf16, 1/sum kept;
// - Y [16 rows][64] = P (A tiles, 32 keys each) x V (B tiles: the head's values in pairs of keys,
//   laid out once per kv head and task run), then scaled by 1/sum.
at::Tensor rows_attention(const at::Tensor& qkv_in, const at::Tensor& freqs, const at::Tensor& pos,
                          const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& mask, int64_t H) {
  TORCH_CHECK(amx_permitted(), "rows_attention: AMX tiles not permitted");
  TORCH_CHECK(qkv_in.scalar_type() == at::kBFloat16 && qkv_in.dim() == 3, "rows_attention: qkv bf16 [B, T, n]");
  const at::Tensor qkv = qkv_in.stride(2) == 1 ? qkv_in : qkv_in.contiguous();
  for (auto* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == at::kBFloat16 && c->dim() == 4 && c->size(3) == 64 && c->is_contiguous(), "rows_attention: caches bf16 [B, H_kv, S, 64], contiguous");
  int64_t B = qkv.size(0), T = qkv.size(1), D = 64, Hk = k_cache.size(1), S = k_cache.size(2), L = mask.size(-1);
  TORCH_CHECK(qkv.size(2) == (H + 2 * Hk) * D && H % Hk == 0 && k_cache.size(0) >= B && L <= S, "rows_attention: qkv [B, T, (H + 2 H_kv) 64], L <= S");
  TORCH_CHECK(freqs.scalar_type() == at::kFloat && freqs.numel() == T * D && pos.scalar_type() == at::kLong && pos.numel() == T,
              "rows_attention: freqs fp32 [T, 32, 2], pos int64 [T]");
  TORCH_CHECK(mask.scalar_type() == at::kBool && (mask.numel() == T * L || mask.numel() == L), "rows_attention: mask bool [T or 1, L]");
  // (the checks and no dispatcher calls where the inputs are as the model makes them: each costs about a microsecond)
  auto contig = [](const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); };
  auto f = contig(freqs), ps = contig(pos), m = contig(mask);
  int64_t mstride = m.numel() == L ? 0 : L;
  auto qr = at::empty({B, H, T, D}, qkv.options());
  auto y = at::empty({B, T, H * D}, qkv.options());
  {
    const uint16_t* xb = (const uint16_t*)qkv.data_ptr<at::BFloat16>();
    const float* fb = f.data_ptr<float>();
    const int64_t* pb = ps.data_ptr<int64_t>();
    uint16_t *qb = (uint16_t*)qr.data_ptr<at::BFloat16>(), *kc = (uint16_t*)k_cache.data_ptr<at::BFloat16>(),
             *vc = (uint16_t*)v_cache.data_ptr<at::BFloat16>();
    for (int64_t b = 0; b < B; b++)
      for (int64_t t = 0; t < T; t++) {
        TORCH_CHECK(pb[t] >= 0 && pb[t] < S, "rows_attention: cache slot out of range");
        const uint16_t* x = xb + b * qkv.stride(0) + t * qkv.stride(1);
        for (int64_t hh = 0; hh < H + 2 * Hk; hh++) {
          int64_t kv = hh - H - (hh >= H + Hk ? Hk : 0);
          uint16_t* out = hh < H ? qb + ((b * H + hh) * T + t) * D
                                 : (hh < H + Hk ? kc : vc) + ((b * Hk + kv) * S + pb[t]) * D;
          for (int j = 0; j < 4; j++) {
            __m256i xv = _mm256_loadu_si256((const __m256i*)(x + hh * D + 16 * j));
            if (hh < H + Hk)
              xv = (__m256i)_mm512_cvtneps_pbh(rope16(widen_bf16(xv), _mm512_loadu_ps(fb + t * D + 16 * j)));
            _mm256_storeu_si256((__m256i*)(out + 16 * j), xv);
          }
        }
      }
  }
  const at::Tensor& q = qr;
  const at::Tensor &k = k_cache, &v = v_cache;  // their first L slots
  int64_t G = H / Hk, R = G * T, NP = (R + 15) / 16, Jp = (L + 31) / 32 * 32;
  auto base = [](const at::Tensor& t) { return (const uint16_t*)t.data_ptr<at::BFloat16>(); };
  const uint16_t *qb = base(q), *kb = base(k), *vb = base(v);
  const uint8_t* mb = (const uint8_t*)m.data_ptr<bool>();
  uint16_t* yb = (uint16_t*)y.data_ptr<at::BFloat16>();
  const float scale = 1.f / std::sqrt((float)D);
  at::parallel_for(0, B * Hk * NP, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) TileConfig cfg = {};
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
    alignas(64) uint16_t qp[32][16][2];   // B tiles of the scores: q's pairs of d, a row a lane
    alignas(64) uint16_t kpad[16][64];    // the last keys, when fewer than 16
    alignas(64) float ct[16][16], yt[16][64];
    std::vector<float> Sbuf(16 * Jp + 16);
    std::vector<uint16_t> Pbuf(16 * Jp + 32), Vbuf(Jp * 64 + 32);
    float* S = (float*)(((uintptr_t)Sbuf.data() + 63) & ~(uintptr_t)63);          // [16][Jp] scores
    uint16_t* P = (uint16_t*)(((uintptr_t)Pbuf.data() + 63) & ~(uintptr_t)63);    // [16][Jp] bf16 weights
    uint16_t* Vp = (uint16_t*)(((uintptr_t)Vbuf.data() + 63) & ~(uintptr_t)63);   // [Jp/32][4][16][16][2]
    int64_t vhead = -1;
    for (int64_t i = i0; i < i1; i++) {
      int64_t b = i / (Hk * NP), h = (i / NP) % Hk, p = i % NP;
      int nq = (int)std::min<int64_t>(16, R - 16 * p);
      const uint16_t* kh = kb + b * k.stride(0) + h * k.stride(1);
      const uint16_t* vh = vb + b * v.stride(0) + h * v.stride(1);
      const int64_t ks = k.stride(2), vs = v.stride(2);
      for (int l = 0; l < 16; l++) {
        int64_t r = 16 * p + std::min(l, nq - 1), g = r / T, t = r % T;
        const uint16_t* qr = qb + b * q.stride(0) + (h * G + g) * q.stride(1) + t * q.stride(2);
        for (int kk = 0; kk < 32; kk++) { qp[kk][l][0] = qr[2 * kk]; qp[kk][l][1] = qr[2 * kk + 1]; }
      }
      if (vhead != b * Hk + h) {  // (keys past L: zeros, weighed 0)
        vhead = b * Hk + h;
        for (int64_t j = 0; j < Jp; j += 2) {
          const uint16_t* v0 = vh + std::min(j, L - 1) * vs;
          const uint16_t* v1 = vh + std::min(j + 1, L - 1) * vs;
          __mmask16 z0 = j < L ? 0xFFFF : 0, z1 = j + 1 < L ? 0xFFFF : 0;
          for (int db = 0; db < 4; db++) {
            __m512i a = _mm512_maskz_cvtepu16_epi32(z0, _mm256_loadu_si256((const __m256i*)(v0 + 16 * db)));
            __m512i c = _mm512_maskz_cvtepu16_epi32(z1, _mm256_loadu_si256((const __m256i*)(v1 + 16 * db)));
            _mm512_store_si512(Vp + ((j / 32) * 4 + db) * 512 + (j % 32) / 2 * 32, _mm512_or_si512(a, _mm512_slli_epi32(c, 16)));
          }
        }
      }
      _tile_loadd(3, &qp[0][0][0], 64);
      _tile_loadd(4, &qp[16][0][0], 64);
      for (int64_t j0 = 0; j0 < Jp; j0 += 16) {
        const uint16_t* kp = kh + j0 * ks;
        int64_t kstride = ks * 2;
        if (j0 + 16 > L) {
          for (int jj = 0; jj < 16; jj++)
            if (j0 + jj < L) std::memcpy(kpad[jj], kh + (j0 + jj) * ks, 128);
            else std::memset(kpad[jj], 0, 128);
          kp = &kpad[0][0];
          kstride = 128;
        }
        _tile_zero(0);
        _tile_loadd(1, kp, kstride);
        _tile_loadd(2, kp + 32, kstride);
        _tile_dpbf16ps(0, 1, 3);
        _tile_dpbf16ps(0, 2, 4);
        _tile_stored(0, &ct[0][0], 64);
        __m512 r[16];
        for (int jj = 0; jj < 16; jj++) r[jj] = _mm512_load_ps(ct[jj]);
        transpose16(r);
        for (int l = 0; l < 16; l++) _mm512_store_ps(S + l * Jp + j0, r[l]);
      }
      alignas(64) float inv[16];
      for (int l = 0; l < 16; l++) {
        if (l >= nq) { std::memset(P + l * Jp, 0, Jp * 2); continue; }
        int64_t t = (16 * p + l) % T;
        const uint8_t* mr = mb + t * mstride;
        float* s = S + l * Jp;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j0 = 0; j0 < Jp; j0 += 16) {
          __mmask16 in = j0 + 16 <= L ? 0xFFFF : (__mmask16)((1u << std::max<int64_t>(L - j0, 0)) - 1);
          __mmask16 ok = _mm_mask_test_epi8_mask(in, _mm_maskz_loadu_epi8(in, mr + j0), _mm_set1_epi8(1));
          __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), ok, _mm512_load_ps(s + j0), _mm512_set1_ps(scale));
          _mm512_store_ps(s + j0, x);
          mx = _mm512_max_ps(mx, x);
        }
        float mmax = _mm512_reduce_max_ps(mx);
        if (mmax == -INFINITY) mmax = 0.f;
        __m512 mv = _mm512_set1_ps(mmax), sum = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < Jp; j0 += 16) {
          __m512 x = _mm512_load_ps(s + j0);
          __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), exp_ps(_mm512_sub_ps(x, mv)));
          sum = _mm512_add_ps(sum, e);
          _mm256_store_si256((__m256i*)(P + l * Jp + j0), (__m256i)_mm512_cvtneps_pbh(e));
        }
        float ssum = _mm512_reduce_add_ps(sum);
        inv[l] = ssum > 0 ? 1.f / ssum : 0.f;
      }
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int64_t kb0 = 0; kb0 < Jp / 32; kb0++) {
        _tile_loadd(0, P + kb0 * 32, Jp * 2);
        const uint16_t* vk = Vp + kb0 * 4 * 512;
        _tile_loadd(1, vk, 64);        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, vk + 512, 64);  _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, vk + 1024, 64); _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, vk + 1536, 64); _tile_dpbf16ps(7, 0, 1);
      }
      _tile_stored(4, &yt[0][0], 256);
      _tile_stored(5, &yt[0][16], 256);
      _tile_stored(6, &yt[0][32], 256);
      _tile_stored(7, &yt[0][48], 256);
      for (int l = 0; l < nq; l++) {
        int64_t r = 16 * p + l, g = r / T, t = r % T;
        uint16_t* yr = yb + ((b * T + t) * H + h * G + g) * D;
        __m512 s = _mm512_set1_ps(inv[l]);
        for (int db = 0; db < 4; db++)
          _mm256_storeu_si256((__m256i*)(yr + 16 * db), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&yt[l][16 * db]), s)));
      }
    }
    _tile_release();
  });
  return y;
}

TORCH_LIBRARY(treespec, m) {
  m.def("rows_linear(Tensor x, Tensor wp) -> Tensor");
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor k_new, Tensor v_new, Tensor prefix, Tensor tree_mask) -> Tensor");
  // flexible_layout: the op takes its inputs in any strides, so inductor hands every layer the one
  // buffer of the step's mask, positions and RoPE rows; with torch 2.13's default for custom ops
  // (their traced strides exactly) it wrote a copy of each for each of the 30 layers (76 us a step)
  m.def("rows_attention(Tensor qkv, Tensor freqs, Tensor pos, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor mask, int n_head) -> Tensor",
        {at::Tag::flexible_layout});
  // b without a default: compiled with cpp_wrapper, torch 2.13 hands over only the arguments given
  m.def("tiles_linear(Tensor x, Tensor wp, Tensor? b) -> Tensor");
  m.def("tiles_glu(Tensor x, Tensor wp) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("topk(Tensor x, int k) -> Tensor");
}
TORCH_LIBRARY_IMPL(treespec, CPU, m) {
  m.impl("rows_linear", &rows_linear);
  m.impl("tree_attention", &tree_attention);
  m.impl("rows_attention", &rows_attention);
  m.impl("tiles_linear", &tiles_linear);
  m.impl("tiles_glu", &tiles_glu);
  m.impl("argmax", &argmax);
  m.impl("topk", &topk);
}
