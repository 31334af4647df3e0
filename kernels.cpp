// kernels.py's int4 and int8 matrix-vector products for a CPU: kernels.py says why they exist, how they
// sum (in one order whatever the rows) and what they measure; native_kernels() builds this file.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// Ask for the weights 1 KB ahead of the loop: each 16 bytes of int4 feed ~30 instructions, so the
// core's own lookahead reaches only ~100 bytes ahead and DRAM's latency shows (+20% measured).
#define AHEAD 1024

// The fixed reduction: (a0 + a1) + (a2 + a3), then the 8 lanes pairwise.
static inline float hsum(const __m256* a) {
  __m256 s = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// w[0..3]: 32 weights as fp32, fed to MT rows of x at once (one dequantization, MT uses).
template <int MT>
static inline void feed(const __m256* w, const float* x, int64_t K, __m256 (*acc)[4]) {
  for (int t = 0; t < MT; t++)
    for (int j = 0; j < 4; j++) acc[t][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + t * K + 8 * j), acc[t][j]);
}

// One weight row (int4: 16 bytes per 32 weights, even weight in the low nibble) against MT rows of x.
template <int MT>
static void int4_row(const uint8_t* q, const float* s, const float* lo, int64_t K, int64_t group,
                     const float* x, float* y, int64_t N) {
  __m256 acc[MT][4], w[4];
  for (int t = 0; t < MT; t++) for (int j = 0; j < 4; j++) acc[t][j] = _mm256_setzero_ps();
  const __m128i nib = _mm_set1_epi8(0x0F);
  for (int64_t c = 0; c < K / 32; c++) {
    __m256 vs = _mm256_set1_ps(s[c * 32 / group]), vl = _mm256_set1_ps(lo[c * 32 / group]);
    _mm_prefetch((const char*)(q + c * 16 + AHEAD), _MM_HINT_T0);
    __m128i raw = _mm_loadu_si128((const __m128i*)(q + c * 16));
    __m128i even = _mm_and_si128(raw, nib), odd = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
    __m128i a = _mm_unpacklo_epi8(even, odd), b = _mm_unpackhi_epi8(even, odd);   // weights 0-15, 16-31
    __m128i part[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[j])), vs, vl);
    feed<MT>(w, x + c * 32, K, acc);
  }
  for (int t = 0; t < MT; t++) y[t * N] = hsum(acc[t]);
}

// One int8 row (its scale applied after the sum, as aten's kernel does).
template <int MT>
static void int8_row(const int8_t* q, float scale, int64_t K, const float* x, float* y, int64_t N) {
  __m256 acc[MT][4], w[4];
  for (int t = 0; t < MT; t++) for (int j = 0; j < 4; j++) acc[t][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; c++) {
    _mm_prefetch((const char*)(q + c * 32 + AHEAD), _MM_HINT_T0);
    for (int j = 0; j < 4; j++)
      w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + c * 32 + 8 * j))));
    feed<MT>(w, x + c * 32, K, acc);
  }
  for (int t = 0; t < MT; t++) y[t * N] = hsum(acc[t]) * scale;
}
#else
// Without AVX2 the same sums in the same order, one lane at a time.
static inline float hsum(const float* a) {
  float l[8];
  for (int i = 0; i < 8; i++) l[i] = (a[i] + a[8 + i]) + (a[16 + i] + a[24 + i]);
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
template <int MT>
static void int4_row(const uint8_t* q, const float* s, const float* lo, int64_t K, int64_t group,
                     const float* x, float* y, int64_t N) {
  for (int t = 0; t < MT; t++) {
    float a[32] = {0};
    for (int64_t k = 0; k < K; k++) {
      float w = std::fma(float((q[k / 2] >> (4 * (k % 2))) & 15), s[k / group], lo[k / group]);
      a[k % 32] = std::fma(w, x[t * K + k], a[k % 32]);
    }
    y[t * N] = hsum(a);
  }
}
template <int MT>
static void int8_row(const int8_t* q, float scale, int64_t K, const float* x, float* y, int64_t N) {
  for (int t = 0; t < MT; t++) {
    float a[32] = {0};
    for (int64_t k = 0; k < K; k++) a[k % 32] = std::fma(float(q[k]), x[t * K + k], a[k % 32]);
    y[t * N] = hsum(a) * scale;
  }
}
#endif

// Rows of x in tiles of 4, then 2, then 1: each tile dequantizes the weights once. Four rows
// need 16 accumulators, more than the 16 vector registers with the weights, yet five rows as 4 + 1
// took 0.18 ns/weight against 0.25 as 2 + 2 + 1. Weight rows are split across threads.
// ROW(MT, n, m) computes y[m..m+MT, n].
#define TILED(ROW)                                                                \
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {                       \
    for (int64_t n = n0; n < n1; n++) {                                           \
      int64_t m = 0;                                                              \
      for (; m + 4 <= M; m += 4) ROW(4, n, m);                                    \
      for (; m + 2 <= M; m += 2) ROW(2, n, m);                                    \
      if (m < M) ROW(1, n, m);                                                    \
    }                                                                             \
  });

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const at::Tensor& lo,
                   int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "int4_mm: x (M, K) fp32");
  int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / group;
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0 && q.size(1) * 2 == K && s.size(1) == G, "int4_mm: shapes");
  auto y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = s.data_ptr<float>(), *lp = lo.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
#define INT4(MT, n, m) int4_row<MT>(qp + n * K / 2, sp + n * G, lp + n * G, K, group, xp + m * K, yp + m * N + n, N)
  TILED(INT4)
  return y;
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "int8_mm: x (M, K) fp32");
  int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K && s.numel() == N, "int8_mm: shapes");
  auto y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = s.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
#define INT8(MT, n, m) int8_row<MT>(qp + n * K, sp[n], K, xp + m * K, yp + m * N + n, N)
  TILED(INT8)
  return y;
}

TORCH_LIBRARY(nanoinfer, m) {
  m.def("int4_mm(Tensor x, Tensor q, Tensor scale, Tensor lo, int group) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor q, Tensor scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(nanoinfer, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
}
