// kernels.py's int4, int8 (per row and in groups, or held six bits a value), fp16 and bf16
// matrix-vector products, the same for int4 and int8 groups with x rounded to 8 bits, a prefill's
// matrix product over tiles of dequantized weights, and one-token attention for a CPU
// (kernels.native_kernels builds this file).
//
// Decoding with int4 weights reads 0.5 byte per weight plus a scale and a minimum per 32 (0.75 B in
// all), int8 1 B, bf16 2 B, fp32 4 B. aten's CPU kernels for int4 and int8 are compute-bound: on a
// 2-core AVX2 EPYC its int4 kernel took 1.16 ns/weight at one row and 8.9 at five (a speculative
// verify pass); its int8 kernel 0.55 and 4.4. Ours, per 32 int4 weights (16 bytes): the bytes
// widened to 32-bit lanes, each lane's two nibbles turned to fp32 (a mask or a shift and a
// conversion; with AVX-512 a 16-entry table lookup), two FMAs against x reordered once per call
// (evens, then odds: no shuffles) and one by the group's scale; the minimum adds lo·Σx per group.
// From DRAM int8 and bf16 stream near the memory's speed, int4 is compute-bound (~4.5 cycles per 32
// weights on a Zen 4 core with AVX-512, 5 with AVX2). llama.cpp rounds x to 8 bits per 32 for
// integer SIMD, which makes int4 a stream again but changes the sums: int4_x8_mm and int8g_x8_mm
// do that when asked (--activations int8), and the default keeps fp32 x, exact to the file.
//
// Each output y[m, n] is summed in one fixed order whatever the number of rows and the instruction
// set (partial sums in fixed lanes, a fixed reduction), so a pass verifying k+1 positions gives
// each position exactly the bits a one-token step gives it: speculative decoding stays exact.

#include <ATen/core/Tensor.h>     // not ATen.h, nor torch/extension.h: 10 s to build, not 48
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

// A helper the loops below must not call: GCC's heuristics leave a helper with several callers
// out of line, and a call per block (its vectors through memory) made a loop 1.5x slower.
#define ALWAYS_INLINE inline __attribute__((always_inline))

// A scale or a minimum as fp32. A GGUF's fp16 ones (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) stay as the
// file stores them, half the bytes of fp32, and every fp16 number is exact in fp32.
static inline float f32(float v) { return v; }
#if defined(__F16C__)
static inline float f32(c10::Half v) { return _cvtsh_ss(v.x); }
#else
static inline float f32(c10::Half v) { return float(v); }
#endif

// A K-quant's scales (or minimums): an int8 per group times its 256-weight super-block's fp16
// number (Q4_K and Q5_K: d·sc and -dmin·m, sc and m 6-bit; Q6_K: d·sc, sc 8-bit), 1.06 bytes a
// group where fp32 takes 4. Each product is exact in fp32 (an 11-bit significand times at most
// 8 bits), so every sum is the one the same scales stored in fp32 give. Read like a pointer to
// fp32 scales (s[g] is group g's, s + n starts n groups on), by as_f32.
struct KScales {
  const c10::Half* d = nullptr;
  const int8_t* sc = nullptr;
  int shift = 0;        // log2 of the groups in a super-block
  int64_t at = 0;       // the group s[0] stands for
  KScales(std::nullptr_t = nullptr) {}
  KScales(const c10::Half* d, const int8_t* sc, int shift, int64_t at = 0)
      : d(d), sc(sc), shift(shift), at(at) {}
  float operator[](int64_t g) const { return f32(d[(at + g) >> shift]) * float(sc[at + g]); }
  KScales operator+(int64_t n) const { return KScales(d, sc, shift, at + n); }
  explicit operator bool() const { return sc != nullptr; }
};

static KScales kscales(const at::Tensor& sc, const at::Tensor& d, int64_t group, const char* op) {
  int64_t per = 256 / group;
  int shift = 0;
  while ((int64_t(1) << shift) < per) shift++;
  TORCH_CHECK(sc.scalar_type() == at::kChar && d.scalar_type() == at::kHalf && sc.dim() == 2 &&
              d.dim() == 2 && sc.is_contiguous() && d.is_contiguous() && group * per == 256 &&
              (int64_t(1) << shift) == per && sc.size(0) == d.size(0) &&
              sc.size(1) == d.size(1) * per,
              op, ": K-quant scales: int8 (N, G) and fp16 (N, G / (256 / group))");
  return KScales(d.data_ptr<c10::Half>(), sc.data_ptr<int8_t>(), shift);
}

// n scales (or minimums) as fp32, for the loops below to read one fp32 a group: fp32 ones as
// they are, fp16 or a K-quant's widened into buf (exactly), WIDEN_ROWS rows at a time (a decode
// step: a few KB that stay in L1 beside the streaming weights, where 64 of SmolLM2's rows, 9 KB,
// did not, and fp16 scales then cost more than fp32 ones; every pass on the row loops, whatever
// its rows of x: row_tiles) or a tile at a time (wide_tiles), so that no loop converts a scale
// per block and row (a K-quant's int4 step took 1.8x as long that way), and none pays a call per
// row (SmolLM2's 576-wide rows: 18 groups). nullptr stays nullptr.
#ifndef WIDEN_ROWS
#define WIDEN_ROWS 8
#endif
// widen_scales(s, n, out) writes them to out; as_f32 returns them, fp32 ones in place.
static inline void widen_scales(const float* s, int64_t n, float* out) {
  std::memcpy(out, s, n * sizeof(float));
}
static inline void widen_scales(const c10::Half* s, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
#endif
  for (; i < n; i++) out[i] = f32(s[i]);
}
#if defined(__AVX2__)
// Whether a K-quant's 8 numbers from group g on share one super-block's d: 8 groups or more to a
// super-block (Q4_K's and Q5_K's 8 of 32, Q6_K's 16 of 16) and g on a multiple of 8 (a row starts
// on a super-block). Those 8 as fp32, exactly: one load, one widening, one multiply.
static inline bool share_d8(KScales s, int64_t g) { return s.shift >= 3 && ((s.at + g) & 7) == 0; }
static inline __m256 kscales8(KScales s, int64_t g) {
  return _mm256_mul_ps(_mm256_set1_ps(f32(s.d[(s.at + g) >> s.shift])),
                       _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                           _mm_loadl_epi64((const __m128i*)(s.sc + s.at + g)))));
}
#endif
#if defined(__AVX512F__)
// 16 of them from such a g (two runs of 8: their d, or two d's), in one register: half the
// instructions of two kscales8, the same numbers.
static inline __m512 kscales16(KScales s, int64_t g) {
  const int64_t at = s.at + g;
  const __m512 d = _mm512_mask_mov_ps(_mm512_set1_ps(f32(s.d[at >> s.shift])), 0xFF00,
                                      _mm512_set1_ps(f32(s.d[(at + 8) >> s.shift])));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128((const __m128i*)(s.sc + at)))));
}
#endif
static inline void widen_scales(KScales s, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n && share_d8(s, i); i += 16) _mm512_storeu_ps(out + i, kscales16(s, i));
#endif
#if defined(__AVX2__)
  for (; i + 8 <= n && share_d8(s, i); i += 8) _mm256_storeu_ps(out + i, kscales8(s, i));
#endif
  for (; i < n; i++) out[i] = s[i];
}
static inline const float* as_f32(const float* s, int64_t, std::vector<float>&) { return s; }
template <typename S>
static inline const float* as_f32(S s, int64_t n, std::vector<float>& buf) {
  if (!s) return nullptr;
  buf.resize(n);
  widen_scales(s, n, buf.data());
  return buf.data();
}

// Items [0, n) of `item_bytes` each (the weight rows a decode step streams), f(i0, i1) for each
// share: where the matrix is small, one contiguous range a thread, as at::parallel_for splits
// them (at least `least` items); where it holds 4 or more runs of RUN_BYTES a thread, in runs that
// the threads take in turn, as llama.cpp's matrix-vector products do: each thread starts on its
// own run and then takes the next free one from an atomic counter. The threads then read
// neighbouring memory, and one that the host slows does fewer runs instead of holding the other at
// the join. A small matrix keeps the plain split: there a shared counter costs more than it
// recovers (SmolLM2's matrices but its head). Which thread computes an item does not change its
// bits: each item's sums are one thread's, in a fixed order.
#ifndef RUN_BYTES
#define RUN_BYTES (256 << 10)
#endif
template <typename F>
static void stream_items(int64_t n, int64_t item_bytes, int64_t least, const F& f) {
  const int64_t T = at::get_num_threads();
  const int64_t run = std::max<int64_t>(least, RUN_BYTES / std::max<int64_t>(1, item_bytes));
  const int64_t runs = (n + run - 1) / run;
  if (T <= 1 || runs < 4 * T || at::in_parallel_region()) {
    at::parallel_for(0, n, least, f);
    return;
  }
  std::atomic<int64_t> next{T};
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    auto one = [&](int64_t c) { f(c * run, std::min(n, (c + 1) * run)); };
    for (int64_t c = t0; c < t1; c++) one(c);       // its own first run (all of them, alone)
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < runs;) one(c);
  });
}

// A thread's rows [r0, r1) of a matrix with G groups a row, `step` rows at a time:
// f(row, its scales, its minimums (null: none)) with the scales as fp32, widened WIDEN_ROWS rows
// at a time (as_f32). The minimums stay as stored: only lo_share reads them, once a row, and it
// widens 8 at a time in registers, with no buffer to write and read back.
template <typename S, typename F>
static void widened_rows(S s, S lo, int64_t G, int64_t r0, int64_t r1, int64_t step, F f) {
  std::vector<float> sb;
  for (int64_t b0 = r0; b0 < r1; b0 += WIDEN_ROWS) {
    int64_t b1 = std::min(r1, b0 + WIDEN_ROWS), n = (b1 - b0) * G;
    const float* sp = as_f32(s + b0 * G, n, sb);
    for (int64_t r = b0; r < b1; r += step) f(r, sp + (r - b0) * G, lo ? lo + r * G : S());
  }
}

// A pass's weight rows [0, N) (row_bytes each) against its M rows of x, split across threads
// (stream_items): each thread widens its own rows' scales, WIDEN_ROWS rows at a time (never the
// whole matrix's on one thread before the loop: 3.5 MB of the tied head's), and takes R weight
// rows at a time against x's rows in tiles of 4, then one of what is left (3, 2 or 1), the weights
// widened once per tile and read from DRAM once.
// f(rows, tile, n, m, scales, minimums) computes y[m .. m + tile, n .. n + rows]; rows and tile
// come as std::integral_constant, for f's kernel template.
template <int R, typename S, typename F>
static void row_tiles(S s, S lo, int64_t G, int64_t N, int64_t M, int64_t row_bytes, F f) {
  auto tiles = [&](auto rows, int64_t n, const float* sn, S ln) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) f(rows, std::integral_constant<int, 4>(), n, m, sn, ln);
    if (M - m == 3) f(rows, std::integral_constant<int, 3>(), n, m, sn, ln);
    if (M - m == 2) f(rows, std::integral_constant<int, 2>(), n, m, sn, ln);
    if (M - m == 1) f(rows, std::integral_constant<int, 1>(), n, m, sn, ln);
  };
  stream_items(N / R, R * row_bytes, std::max(1, 16 / R), [&](int64_t p0, int64_t p1) {
    widened_rows(s, lo, G, p0 * R, p1 * R, R, [&](int64_t n, const float* sn, S ln) {
      tiles(std::integral_constant<int, R>(), n, sn, ln);
    });
  });
  widened_rows(s, lo, G, N / R * R, N, 1, [&](int64_t n, const float* sn, S ln) {
    tiles(std::integral_constant<int, 1>(), n, sn, ln);
  });
}

// Where a kernel's R weight rows lie, each from the one before: its bytes (q, in bytes), its
// scales (s) and minimums (lo, in groups) and its result (y); rows end to end: K / 2, G, G, 1.
struct Pitch {
  int64_t q, s, lo, y;
};

// A decode step's rows taken from P distant parts of the matrix, row i of each of its P parts of
// D = N / P rows at a time: f(rows, i, scales, minimums, pitch) computes y[i + p·D] for p < P,
// with P rows at pitch D (their scales widened WIDEN_ROWS items at a time, part after part); the
// last N % P rows one at a time (rows 1, pitch of rows end to end). Each thread takes runs of
// items (stream_items), so it reads P runs of weight rows at once, far apart.
// Why: on the Xeon of this pool the hardware streams a core's reads from several distant places
// (other pages) faster than from one: rows end to end, even R of them, are one stream there,
// and a decode step's int4, int8 and 16-bit loops, which read rows of 1-8 KB, get more bytes a
// second from 4 parts than from one (`python kernels.py` prints each kernel's GB/s). Which rows go
// together does not change a row's sum: the bits are those of the rows end to end. G = 0: a
// matrix without scales (16-bit weights).
template <int P, typename S, typename F>
static void distant_rows(S s, S lo, int64_t G, int64_t N, int64_t row_bytes, F f) {
  const int64_t D = N / P;
  stream_items(D, P * row_bytes, 4, [&](int64_t i0, int64_t i1) {
    std::vector<float> sb(P * WIDEN_ROWS * G);
    for (int64_t b0 = i0; b0 < i1; b0 += WIDEN_ROWS) {
      const int64_t b1 = std::min(i1, b0 + WIDEN_ROWS);
      for (int p = 0; G && p < P; p++)
        widen_scales(s + (p * D + b0) * G, (b1 - b0) * G, sb.data() + p * WIDEN_ROWS * G);
      for (int64_t i = b0; i < b1; i++)
        f(std::integral_constant<int, P>(), i, sb.data() + (i - b0) * G, lo ? lo + i * G : S(),
          Pitch{D * row_bytes, WIDEN_ROWS * G, D * G, D});
    }
  });
  widened_rows(s, lo, G, P * D, N, 1, [&](int64_t n, const float* sn, S ln) {
    f(std::integral_constant<int, 1>(), n, sn, ln, Pitch{row_bytes, G, G, 1});
  });
}

// run(s, lo) with the scales as the kernels read them: pointers to fp32 or fp16 numbers, or
// KScales where the super-blocks' numbers (sd, lod) are given; lo absent: a null of s's type.
template <typename F>
static void with_scales(const at::Tensor& s, const std::optional<at::Tensor>& lo,
                        const std::optional<at::Tensor>& sd, const std::optional<at::Tensor>& lod,
                        int64_t group, const char* op, F run) {
  const bool has_lo = lo.has_value() && lo->defined(), block = sd.has_value() && sd->defined();
  TORCH_CHECK(s.is_contiguous() && (!has_lo || (lo->sizes() == s.sizes() && lo->is_contiguous() &&
                                                lo->scalar_type() == s.scalar_type())),
              op, ": lo shaped and typed as the scale, or None");
  if (block) {
    TORCH_CHECK(has_lo == (lod.has_value() && lod->defined()),
                op, ": a K-quant's minimums come with their super-blocks' numbers");
    run(kscales(s, *sd, group, op), has_lo ? kscales(*lo, *lod, group, op) : KScales());
  } else if (s.scalar_type() == at::kHalf) {
    run(s.data_ptr<c10::Half>(), has_lo ? lo->data_ptr<c10::Half>() : nullptr);
  } else {
    TORCH_CHECK(s.scalar_type() == at::kFloat,
                op, ": scales fp32, fp16, or int8 with their super-blocks' fp16 numbers");
    run(s.data_ptr<float>(), has_lo ? lo->data_ptr<float>() : nullptr);
  }
}

// Weight rows a decode step's int4 loop takes at a time, sharing x's loads. With AVX-512, 4 rows
// took 4.25 cycles per 32 weights and row from L2 against 4.46 at 2, but the runner's step was
// slower with them (3 of 4 alternating runs; W streams from DRAM). With AVX2, 4 rows would not fit
// its 16 vector registers.
#ifndef ROWS
#define ROWS 2
#endif
static_assert(WIDEN_ROWS % ROWS == 0, "a chunk of widened scales holds whole ROWS-row steps");

// Each group's sum of x, in order; 8 groups' sums side by side, so that each add does not wait on
// the last (a chain of one group's adds at a time took 4 cycles a value).
static void group_sums(const float* x, int64_t K, int64_t group, float* sx) {
  const int64_t G = K / group;
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int64_t n = std::min<int64_t>(8, G - g0);
    float a[8] = {0.f};
    for (int64_t k = 0; k < group; k++)
      for (int64_t j = 0; j < n; j++) a[j] += x[(g0 + j) * group + k];
    for (int64_t j = 0; j < n; j++) sx[g0 + j] = a[j];
  }
}

// int4 weights (two a byte, the even column in the low nibble) and what a nibble stands for:
// `tab` null, the number 0..15 (W = lo + q·s); else tab[q] of 16 fp32 (a GGUF's IQ4_NL and
// IQ4_XS: each nibble picks one of 16 int8 values, W = tab[q]·s), exact in fp32 and in bf16.
// `+ n` moves n bytes; value(n) is nibble n's number, [k] weight k's (the scalar loops').
struct Nibbles {
  const uint8_t* p = nullptr;
  const float* tab = nullptr;
  Nibbles operator+(int64_t n) const { return Nibbles{p + n, tab}; }
  float value(int n) const { return tab ? tab[n] : float(n); }
  float operator[](int64_t k) const { return value(k % 2 ? p[k / 2] >> 4 : p[k / 2] & 15); }
};
// Each 32 weights' x, reordered once per call so that byte i of a block (weights 2i and 2i+1, low
// and high nibble) meets its x in lane i:
// xp[32c + i] = x[32c + 2i], xp[32c + 16 + i] = x[32c + 2i + 1].
// And each group's sum of x, for the minimum's share: sum_k (lo + q_k s) x_k = lo·Σx + s·Σ q_k x_k.
//
// The order every build sums in (AVX-512, AVX2, scalar: the same bits): 16 lanes per row, lane i
// for byte i of each 16-byte block c: acc_i += (hi_i·xp[16 + i] + lo_i·xp[i])·s_c, one fused
// multiply-add each; then lanes i and i + 8 are added, the 8 sums reduced pairwise (hsum8), and the
// minimum's share added.
static void reorder_x(const float* x, int64_t K, int64_t group, float* xp, float* sx) {
  for (int64_t c = 0; c < K; c += 32)
    for (int i = 0; i < 16; i++) { xp[c + i] = x[c + 2 * i]; xp[c + 16 + i] = x[c + 2 * i + 1]; }
  group_sums(x, K, group, sx);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// Loops over a tile's rows, unrolled before register allocation: left as loops, GCC keeps an array
// of accumulators on the stack, and each block's sum waits on a store and a load (AVX-512: 1.3x
// slower).
#define UNROLL _Pragma("GCC unroll 16")

// How the weights stream from DRAM best differs between the CPUs of this pool (the same loops, 2
// threads, a 1 GB set of TinyLlama's matrices, medians of 5 alternating rounds; the bits do not
// depend on it):
// - an Intel Xeon (Sapphire Rapids): bf16 one row at a time 14.3 GB/s, 4 rows 22.0, 8 rows 25.6
//   (aten's fp32 matrix-vector product, 4 B a weight: 27.3); on SmolLM2's rows of 576 (1,152 B) 8
//   rows gain nothing (15.3 against 15.8) and asking for the weights 4 KB ahead does (22.4); int8
//   asked for 1 KB ahead 17.4, 4 KB ahead 21.5; int4 (SmolLM2's matrices) 15.4 against 19.1;
// - an AMD EPYC (Zen 4): bf16 one row 26-30 GB/s, 2 or 4 rows 13-25, prefetching 10-25% slower;
//   int8 within noise either way.
// Each core keeps only so many cache-line misses in flight: on the Xeon one stream and its
// prefetcher do not fill them, 8 rows' streams or a further prefetch do.
static bool intel() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_is("intel"));
  return yes;
}

// Ask for the weights 1 KB ahead of the loop: each 16 bytes of int4 feed ~20 instructions, so the
// core's own lookahead reaches only ~100 bytes ahead (a few % at one row, in alternating runs).
// On the Xeon, 4 KB ahead (above).
#ifndef AHEAD
#define AHEAD 1024
#endif
#define FAR_AHEAD 4096
// 16-bit weights are asked for ahead on the Xeon only (and read from distant parts there:
// half_rows): on the EPYC (Zen 4) the hardware's own prefetcher streams their rows faster alone,
// where the memory has bandwidth to spare (and as fast where it has not), while the int8 and int4
// loops, with more instructions a byte, still gain from their AHEAD.
#define STREAM_AHEAD (intel() ? FAR_AHEAD : AHEAD)    // int8 and int4 with AVX-512

// The fixed reduction of 8 lanes, pairwise; of four vectors, (a0 + a1) + (a2 + a3) first.
static inline float hsum8(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
static inline float hsum(const __m256* a) {
  return hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
}

// Eight bf16 values as fp32: bf16 is fp32's upper half, so a zero-extending load and a shift.
static inline __m256 bf16x8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// A decode loop over R weight rows at a time reads R streams side by side, so a row's bytes `ahead`
// on are another row's, often those in use (TinyLlama's rows are 1 KB, as far as AHEAD). It asks a
// whole number of R-row spans ahead instead: each prefetch lands on its own row of a later span.
static inline int64_t spans_ahead(int64_t ahead, int64_t span) {
  return (ahead + span - 1) / span * span;
}

// 32 weights of one int4 row (16 bytes, even weight in the low nibble) as fp32: per 8 bytes one
// widening load, a mask and a shift give the 8 even (e) and 8 odd (o) nibbles, two conversions.
// The weights `ahead` bytes on are asked for. With a table (Nibbles), each nibble's number by two
// 8-entry lookups and a blend on the nibble's bit 3 instead of a conversion.
static inline __m256 nibbles8(__m256i n, const float* tab) {
  if (!tab) return _mm256_cvtepi32_ps(n);
  const __m256 a = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab), n),
               b = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab + 8), n);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(n, 28)));
}
static inline void widen(const uint8_t* q, const float* tab, int64_t ahead, __m256& e0,
                         __m256& o0, __m256& e1, __m256& o1) {
  const __m256i nib = _mm256_set1_epi32(0x0F);
  _mm_prefetch((const char*)(q + ahead), _MM_HINT_T0);
  __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
  __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8)));
  e0 = nibbles8(_mm256_and_si256(b0, nib), tab), o0 = nibbles8(_mm256_srli_epi32(b0, 4), tab);
  e1 = nibbles8(_mm256_and_si256(b1, nib), tab), o1 = nibbles8(_mm256_srli_epi32(b1, 4), tab);
}

// Eight minimums from group g on as fp32 (exact), read as they are stored: fp32, fp16, or a
// K-quant's int8 m times its super-block's -dmin (kscales8).
static inline __m256 lo8(const float* lo, int64_t g) { return _mm256_loadu_ps(lo + g); }
static inline __m256 lo8(const c10::Half* lo, int64_t g) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(lo + g)));
}
static inline __m256 lo8(KScales lo, int64_t g) {
  if (share_d8(lo, g)) return kscales8(lo, g);
  float v[8];
  for (int j = 0; j < 8; j++) v[j] = lo[g + j];
  return _mm256_loadu_ps(v);
}

// The minimum's share, lo·Σx over the row's groups, 8 groups to a vector: a scalar chain of 18 FMAs
// (SmolLM2's 576 columns) would hold each row back by ~70 cycles. The last G % 8 groups (2 of
// SmolLM2's 18) take one more vector FMA, their lanes loaded as they are and the others 0, which
// adds 0·0 to those lanes: the bits of adding them one lane at a time (the scalar build). Loading
// the tail without a round trip through memory matters: scalar stores read back by one vector
// load stalled each row on the load, a share of a small matrix's product (SmolLM2's). AVX-512
// (VL) loads a masked vector; AVX2 has no 16-bit masked load and inserts the fp16 values one by
// one.
static inline __m256i first_lanes(int64_t n) {     // lanes j < n all ones, the others 0
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline __m256 tail8(const float* p, int64_t n) {
#if defined(__AVX512VL__)
  return _mm256_maskz_loadu_ps(__mmask8((1u << n) - 1), p);
#else
  return _mm256_maskload_ps(p, first_lanes(n));
#endif
}
static inline __m256 tail8(const c10::Half* p, int64_t n) {
#if defined(__AVX512VL__) && defined(__AVX512BW__)
  return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(__mmask8((1u << n) - 1), p));
#else
  __m128i h = _mm_setzero_si128();
  UNROLL
  for (int j = 0; j < 8; j++)
    if (j < n) h = _mm_insert_epi16(h, p[j].x, j);
  return _mm256_cvtph_ps(h);
#endif
}
static inline __m256 tail8(KScales p, int64_t n) {   // a K-quant's rows hold whole 8-group runs
  float v[8] = {0.f};
  for (int64_t j = 0; j < n; j++) v[j] = p[j];
  return _mm256_loadu_ps(v);
}
template <typename L>
static inline float lo_share(L lo, const float* sx, int64_t G) {
  __m256 a = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) a = _mm256_fmadd_ps(lo8(lo, g), _mm256_loadu_ps(sx + g), a);
  if (g < G) a = _mm256_fmadd_ps(tail8(lo + g, G - g), tail8(sx + g, G - g), a);
  return hsum8(a);
}

// int4_rows<R, MT, H16>: R weight rows (at pitch p: end to end, or from distant parts) against MT
// rows of reordered x (xp, K apart; their group sums sx, G apart) into y[t·N + r·p.y]. Each
// (row, row of x) gets the sums of one row against one row, whatever R, MT and p: R weight rows
// share x's loads (a decode step), MT rows of x share a weight block's widening (a pass over
// several rows). H16: groups of 16 (a GGUF's Q3_K and Q2_K), two scales a block: its first 8
// lanes (bytes 0-7, weights 0..15) take the first, the other 8 the second; else one group's scale
// a block (shift: log2 of the blocks a group spans).
#if defined(__AVX512F__)
// A block's 16 lanes in one register: the widened bytes index a 16-entry table of 0..15 (vpermps
// reads an index's low 4 bits: no mask for the low nibble, no conversions). 8 instructions per 32
// weights at one row against AVX2's 17: 4.46 cycles against 5.02 (Zen 4, from L2, one thread).
// A 16-lane sum's upper 8 lanes (its lower 8: _mm512_castps512_ps256).
static inline __m256 upper8(__m512 a) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}
// The table a 4-bit index reads its value from (vpermps): 0..15 as fp32, or a layout's own 16
// numbers (Nibbles.tab) at no extra cost.
static inline __m512 nibble_values() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
// lo_share for a K-quant's minimums: 16 widened at a time (kscales16), fed to the same 8-lane
// chain in the same order (groups g, then g + 8): the bits of the 8-at-a-time loop.
static inline float lo_share(KScales lo, const float* sx, int64_t G) {
  __m256 a = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= G && share_d8(lo, g); g += 16) {
    const __m512 v = kscales16(lo, g);
    a = _mm256_fmadd_ps(_mm512_castps512_ps256(v), _mm256_loadu_ps(sx + g), a);
    a = _mm256_fmadd_ps(upper8(v), _mm256_loadu_ps(sx + g + 8), a);
  }
  for (; g + 8 <= G; g += 8) a = _mm256_fmadd_ps(lo8(lo, g), _mm256_loadu_ps(sx + g), a);
  if (g < G) a = _mm256_fmadd_ps(tail8(lo + g, G - g), tail8(sx + g, G - g), a);
  return hsum8(a);
}
// The 32 lanes of two 16-lane sums, reduced as AVX2's four 8-lane ones (hsum).
static inline float hsum(__m512 a0, __m512 a1) {
  __m256 h[4] = {_mm512_castps512_ps256(a0), upper8(a0), _mm512_castps512_ps256(a1), upper8(a1)};
  return hsum(h);
}

// A block's scales in its 16 lanes: one group's in all, or (H16: groups of 16) s[0] in lanes
// 0-7, whose bytes hold its weights 0..15, and s[1] in lanes 8-15.
template <bool H16>
static inline __m512 block_scales(const float* s) {
  return H16 ? _mm512_mask_mov_ps(_mm512_set1_ps(s[0]), 0xFF00, _mm512_set1_ps(s[1]))
             : _mm512_set1_ps(s[0]);
}
template <int R, int MT, bool H16>
static inline void int4_block_rows(const uint8_t* q, int64_t q_pitch, const float* s,
                                   int64_t s_pitch, const float* xc, int64_t K, __m512 table,
                                   int64_t fetch, __m512 (*acc)[MT]) {
  __m512 xe[MT], xo[MT];
  UNROLL
  for (int t = 0; t < MT; t++)
    xe[t] = _mm512_loadu_ps(xc + t * K), xo[t] = _mm512_loadu_ps(xc + t * K + 16);
  UNROLL
  for (int r = 0; r < R; r++) {
    if (fetch) _mm_prefetch((const char*)(q + r * q_pitch + fetch), _MM_HINT_T0);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + r * q_pitch)));
    __m512 e = _mm512_permutexvar_ps(b, table),
           o = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table),
           vs = block_scales<H16>(s + r * s_pitch);
    UNROLL
    for (int t = 0; t < MT; t++)
      acc[r][t] =
          _mm512_fmadd_ps(_mm512_fmadd_ps(o, xo[t], _mm512_mul_ps(e, xe[t])), vs, acc[r][t]);
  }
}
template <int R, int MT, bool H16, typename L>
static void int4_rows(Nibbles q, const float* s, L lo, int64_t K, int shift,
                      const float* xp, const float* sx, float* y, int64_t N, Pitch p) {
  int64_t G = H16 ? K / 16 : (K / 32) >> shift;
  const __m512 table = q.tab ? _mm512_loadu_ps(q.tab) : nibble_values();
  __m512 acc[R][MT];
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm512_setzero_ps();
  // rows end to end: whole spans of R rows ahead; rows from parts: each its own stream
  const int64_t ahead = p.q == K / 2 ? spans_ahead(STREAM_AHEAD, R * (K / 2)) : AHEAD;
  for (int64_t c = 0; c < K / 32; c++)
    int4_block_rows<R, MT, H16>(q.p + c * 16, p.q, s + (H16 ? 2 * c : c >> shift), p.s,
                                xp + c * 32, K, table, (c & 3) == 0 ? ahead : 0, acc);
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++)
      y[t * N + r * p.y] =
          hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[r][t]), upper8(acc[r][t])))
          + (lo ? lo_share(lo + r * p.lo, sx + t * G, G) : 0.f);
}
// Weight rows a pass over several rows of x takes at a time: R·MT accumulators, MT rows of x in
// two registers each, and the widened block fit AVX-512's 32 registers at R = 2, MT = 4.
// Several rows of x cost a multiply and two FMAs per 32 weights and row. A table of s·0 .. s·15
// (the scale folded in, exact for fp16 scales) leaves two FMAs, but on Zen 4 it made one row 6-9%
// slower for 10-12% at four (2 threads, SmolLM2's and TinyLlama's int4 matrices): one row is the
// runner's step, so not kept.
#define TILE_ROWS 2
#else
// The 16 lanes in two 8-lane halves, two chains: one FMA's latency does not gate the next. Two
// weight rows at a time (R = 2: 9% faster than one, W from DRAM) share x's four loads per 32
// weights.
template <int R, int MT, bool H16, typename L>
static void int4_rows(Nibbles q, const float* s, L lo, int64_t K, int shift,
                      const float* xp, const float* sx, float* y, int64_t N, Pitch p) {
  int64_t G = H16 ? K / 16 : (K / 32) >> shift;
  const int64_t ahead = p.q == K / 2 ? spans_ahead(AHEAD, R * (K / 2)) : AHEAD;
  __m256 acc[R][MT][2];
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; c++) {
    UNROLL
    for (int r = 0; r < R; r++) {
      // the first half's weights are 0..15 of the block (H16: a group of their own)
      __m256 e0, o0, e1, o1, vs = _mm256_set1_ps(s[r * p.s + (H16 ? 2 * c : c >> shift)]),
                             vs1 = H16 ? _mm256_set1_ps(s[r * p.s + 2 * c + 1]) : vs;
      widen(q.p + r * p.q + c * 16, q.tab, ahead, e0, o0, e1, o1);
      UNROLL
      for (int t = 0; t < MT; t++) {
        const float* xc = xp + t * K + c * 32;
        acc[r][t][0] = _mm256_fmadd_ps(_mm256_fmadd_ps(o0, _mm256_loadu_ps(xc + 16),
                                                       _mm256_mul_ps(e0, _mm256_loadu_ps(xc))),
                                       vs, acc[r][t][0]);
        acc[r][t][1] = _mm256_fmadd_ps(_mm256_fmadd_ps(o1, _mm256_loadu_ps(xc + 24),
                                                       _mm256_mul_ps(e1, _mm256_loadu_ps(xc + 8))),
                                       vs1, acc[r][t][1]);
      }
    }
  }
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++)
      y[t * N + r * p.y] = hsum8(_mm256_add_ps(acc[r][t][0], acc[r][t][1]))
                           + (lo ? lo_share(lo + r * p.lo, sx + t * G, G) : 0.f);
}
// 16 registers: a tile of 4 rows of x takes 8 accumulators, so one weight row at a time.
#define TILE_ROWS 1
#endif
// w[0..3]: 32 weights as fp32, fed to MT rows of x at once (one conversion, MT uses).
template <int MT>
static inline void feed(const __m256* w, const float* x, int64_t K, __m256 (*acc)[4]) {
  UNROLL
  for (int t = 0; t < MT; t++)
    for (int j = 0; j < 4; j++)
      acc[t][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + t * K + 8 * j), acc[t][j]);
}

// One int8 row (its scale applied after the sum, as aten's kernel does).
#if defined(__AVX512F__)
// Four 8-lane sums per row, as AVX2's below, two to a register: half the instructions, the same
// bits.
template <int MT>
static void int8_row(const int8_t* q, float scale, int64_t K, const float* x, float* y, int64_t N) {
  __m512 acc[MT][2];
  UNROLL
  for (int t = 0; t < MT; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  const int64_t ahead = STREAM_AHEAD;
  for (int64_t c = 0; c < K / 32; c++) {
    if ((c & 1) == 0) _mm_prefetch((const char*)(q + c * 32 + ahead), _MM_HINT_T0);
    __m512 w0 = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + c * 32))));
    __m512 w1 = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + c * 32 + 16))));
    UNROLL
    for (int t = 0; t < MT; t++) {
      acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * K + c * 32), acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * K + c * 32 + 16), acc[t][1]);
    }
  }
  UNROLL
  for (int t = 0; t < MT; t++) y[t * N] = hsum(acc[t][0], acc[t][1]) * scale;
}
// One bf16 row: bf16 is fp32's upper half, so 16 weights widen with a zero-extending load and a
// shift, and so does x, read as bf16: fp32 x (22 KB at K = 5632) would not stay in L1 beside the
// streaming weights (0.68x the bandwidth at that K). The same 32 lanes as int8_row.
static inline __m512 bf16x16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
template <int MT>
static void bf16_row(const c10::BFloat16* w, int64_t K, const c10::BFloat16* x, c10::BFloat16* y,
                     int64_t N) {
  __m512 acc[MT][2];
  UNROLL
  for (int t = 0; t < MT; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / 32; c++) {
    __m512 w0 = bf16x16(w + c * 32), w1 = bf16x16(w + c * 32 + 16);
    UNROLL
    for (int t = 0; t < MT; t++) {
      acc[t][0] = _mm512_fmadd_ps(w0, bf16x16(x + t * K + c * 32), acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(w1, bf16x16(x + t * K + c * 32 + 16), acc[t][1]);
    }
  }
  UNROLL
  for (int t = 0; t < MT; t++) y[t * N] = hsum(acc[t][0], acc[t][1]);
}
// One row of x (a decode step) against R weight rows at a time, each row with bf16_row<1>'s sums
// and order; `ahead`: bytes ahead to ask for (0: none).
template <int R>
static void bf16_rows(const c10::BFloat16* w, int64_t K, const c10::BFloat16* x, c10::BFloat16* y,
                      int64_t ahead) {
  __m512 acc[R][2];
  UNROLL
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / 32; c++) {
    if (ahead) _mm_prefetch((const char*)(w + c * 32) + ahead, _MM_HINT_T0);
    __m512 x0 = bf16x16(x + c * 32), x1 = bf16x16(x + c * 32 + 16);
    UNROLL
    for (int r = 0; r < R; r++) {
      acc[r][0] = _mm512_fmadd_ps(bf16x16(w + r * K + c * 32), x0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(bf16x16(w + r * K + c * 32 + 16), x1, acc[r][1]);
    }
  }
  UNROLL
  for (int r = 0; r < R; r++) y[r] = hsum(acc[r][0], acc[r][1]);
}
#define BF16_ROWS 8
#else
template <int MT>
static void int8_row(const int8_t* q, float scale, int64_t K, const float* x, float* y, int64_t N) {
  __m256 acc[MT][4], w[4];
  UNROLL
  for (int t = 0; t < MT; t++) for (int j = 0; j < 4; j++) acc[t][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; c++) {
    _mm_prefetch((const char*)(q + c * 32 + AHEAD), _MM_HINT_T0);
    for (int j = 0; j < 4; j++)
      w[j] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + c * 32 + 8 * j))));
    feed<MT>(w, x + c * 32, K, acc);
  }
  UNROLL
  for (int t = 0; t < MT; t++) y[t * N] = hsum(acc[t]) * scale;
}
template <int MT>
static void bf16_row(const c10::BFloat16* w, int64_t K, const c10::BFloat16* x, c10::BFloat16* y,
                     int64_t N) {
  __m256 acc[MT][4];
  UNROLL
  for (int t = 0; t < MT; t++) for (int j = 0; j < 4; j++) acc[t][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; c++) {
    __m256 v[4] = {bf16x8(w + c * 32), bf16x8(w + c * 32 + 8), bf16x8(w + c * 32 + 16),
                   bf16x8(w + c * 32 + 24)};
    UNROLL
    for (int t = 0; t < MT; t++)
      for (int j = 0; j < 4; j++)
        acc[t][j] = _mm256_fmadd_ps(v[j], bf16x8(x + t * K + c * 32 + 8 * j), acc[t][j]);
  }
  UNROLL
  for (int t = 0; t < MT; t++) y[t * N] = hsum(acc[t]);
}
#endif
#else
// Without AVX2 the same sums in the same order, one lane at a time.
static inline float hsum8(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
static inline float hsum(const float* a) {
  float l[8];
  for (int i = 0; i < 8; i++) l[i] = (a[i] + a[8 + i]) + (a[16 + i] + a[24 + i]);
  return hsum8(l);
}
template <int R, int MT, bool H16, typename L>
static void int4_rows(Nibbles q, const float* s, L lo, int64_t K, int shift,
                      const float* xp, const float* sx, float* y, int64_t N, Pitch p) {
  int64_t G = H16 ? K / 16 : (K / 32) >> shift;
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) {
      const uint8_t* qr = q.p + r * p.q;
      const float* sr = s + r * p.s;
      float acc[16] = {0}, l[8];
      for (int64_t c = 0; c < K / 32; c++) {
        const uint8_t* b = qr + c * 16;
        const float* xc = xp + t * K + c * 32;
        for (int i = 0; i < 16; i++)
          acc[i] = std::fma(std::fma(q.value(b[i] >> 4), xc[16 + i], q.value(b[i] & 15) * xc[i]),
                            sr[H16 ? 2 * c + i / 8 : c >> shift], acc[i]);
      }
      for (int i = 0; i < 8; i++) l[i] = 0.f;
      if (lo) {
        L lr = lo + r * p.lo;
        for (int64_t g = 0; g < G; g++) l[g % 8] = std::fma(f32(lr[g]), sx[t * G + g], l[g % 8]);
      }
      float m = hsum8(l);
      for (int i = 0; i < 8; i++) l[i] = acc[i] + acc[8 + i];
      y[t * N + r * p.y] = hsum8(l) + m;
    }
}
#define TILE_ROWS 1
template <int MT>
static void int8_row(const int8_t* q, float scale, int64_t K, const float* x, float* y, int64_t N) {
  for (int t = 0; t < MT; t++) {
    float a[32] = {0};
    for (int64_t k = 0; k < K; k++) a[k % 32] = std::fma(float(q[k]), x[t * K + k], a[k % 32]);
    y[t * N] = hsum(a) * scale;
  }
}
template <int MT>
static void bf16_row(const c10::BFloat16* w, int64_t K, const c10::BFloat16* x, c10::BFloat16* y,
                     int64_t N) {
  for (int t = 0; t < MT; t++) {
    float a[32] = {0};
    for (int64_t k = 0; k < K; k++)
      a[k % 32] = std::fma(float(w[k]), float(x[t * K + k]), a[k % 32]);
    y[t * N] = hsum(a);
  }
}
#endif

// Rows of x in tiles of 4, then 2, then 1, for the kernels without scales to widen (row_tiles is
// this loop for those with them): each tile widens the weights once, for all its rows. int8 keeps
// 4 accumulators per row of x (16 for a tile: more than AVX2's 16 vector registers with the
// weights, yet a loop of that shape took 0.18 ns/weight for five rows as 4 + 1 against 0.25 as
// 2 + 2 + 1). Weight rows (ROW_BYTES each) are split across threads (stream_items).
// ROW(MT, n, m) computes y[m..m+MT, n].
#define TILED(ROW, ROW_BYTES)                                                     \
  stream_items(N, ROW_BYTES, 16, [&](int64_t n0, int64_t n1) {                  \
    for (int64_t n = n0; n < n1; n++) {                                           \
      int64_t m = 0;                                                              \
      for (; m + 4 <= M; m += 4) ROW(4, n, m);                                    \
      for (; m + 2 <= M; m += 2) ROW(2, n, m);                                    \
      if (m < M) ROW(1, n, m);                                                    \
    }                                                                             \
  });

// Rows a decode step's int4 loop takes from distant parts of a matrix (distant_rows; the int8 and
// 16-bit loops': INT8G_PARTS, HALF_PARTS): AVX-512's 32 registers hold 4 rows' sums beside x and
// a widened block, AVX2's 16 two. Taken on an Intel CPU, for a matrix of DISTANT_BYTES or more
// (a smaller one's parts are a few rows each); on the EPYC (Zen 4), whose own prefetcher streams
// rows end to end well (half_rows above), the rows stay end to end (ROWS): parts there are not
// measured yet. The plain C++ build takes them wherever the vector builds may, so that the tests
// compare the same loops.
#ifndef PARTS
#if defined(__AVX512F__)
#define PARTS 4
#else
#define PARTS 2
#endif
#endif
#ifndef DISTANT_BYTES
#define DISTANT_BYTES (256 << 10)
#endif
// Whether a decode step takes a matrix's rows from P parts (P: the loop's count, 1 for none).
template <int P>
static bool distant(int64_t N, int64_t row_bytes) {
#if defined(__AVX2__) && defined(__FMA__)
  if (!intel()) return false;
#endif
  return P > 1 && N >= P && N * row_bytes >= DISTANT_BYTES;
}

// An int4 product's arguments checked (op: its name); log2 of its groups' blocks of 32, -1 for
// groups of 16 (two a block).
static int int4_shift(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t group,
                      const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              op, ": x (M, K) fp32");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 32 == 0 && group % 16 == 0 && q.size(1) * 2 == K && s.size(1) == K / group,
              op, ": shapes");
  if (group == 16) return -1;
  int shift = 0;
  while ((32 << shift) < group) shift++;
  TORCH_CHECK((32 << shift) == group, op, ": group 16, 32, 64 or 128");
  return shift;
}
// f(std::true_type) for groups of 16 (shift -1), else f(std::false_type): a kernel's H16.
template <typename F>
static void by_halves(int shift, F f) {
  if (shift < 0) f(std::true_type());
  else f(std::false_type());
}

// values: the 16 numbers a nibble stands for (Nibbles), or None for 0..15.
static const float* nibble_table(const std::optional<at::Tensor>& values, const char* op) {
  if (!values.has_value() || !values->defined()) return nullptr;
  TORCH_CHECK(values->scalar_type() == at::kFloat && values->numel() == 16 &&
              values->is_contiguous(), op, ": values 16 fp32 numbers, or None");
  return values->data_ptr<float>();
}
static at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                          const std::optional<at::Tensor>& lo, int64_t group,
                          const std::optional<at::Tensor>& sd,
                          const std::optional<at::Tensor>& lod,
                          const std::optional<at::Tensor>& values) {
  const int shift = int4_shift(x, q, s, group, "int4_mm");
  const Nibbles qn{q.data_ptr<uint8_t>(), nibble_table(values, "int4_mm")};
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / group;
  auto y = at::empty({M, N}, x.options());
  std::vector<float> reordered(M * K), sums(M * G);
  float *xp = reordered.data(), *sx = sums.data();
  for (int64_t m = 0; m < M; m++)
    reorder_x(x.data_ptr<float>() + m * K, K, group, xp + m * K, sx + m * G);
  float* yp = y.data_ptr<float>();
  auto kernel = [&](auto rows, auto tile, int64_t n, int64_t m, const float* sn, auto ln) {
    by_halves(shift, [&](auto h16) {
      int4_rows<decltype(rows)::value, decltype(tile)::value, decltype(h16)::value>(
          qn + n * K / 2, sn, ln, K, shift, xp + m * K, sx + m * G, yp + m * N + n, N,
          Pitch{K / 2, G, G, 1});
    });
  };
  auto far = [&](auto rows, int64_t n, const float* sn, auto ln, Pitch p) {
    by_halves(shift, [&](auto h16) {
      int4_rows<decltype(rows)::value, 1, decltype(h16)::value>(qn + n * K / 2, sn, ln, K, shift,
                                                                 xp, sx, yp + n, N, p);
    });
  };
  auto run = [&](auto s_, auto lo_) {
    if (M == 1 && distant<PARTS>(N, K / 2))
      distant_rows<PARTS>(s_, lo_, G, N, K / 2, far);
    else if (M == 1)
      row_tiles<ROWS>(s_, lo_, G, N, M, K / 2, kernel);
    else
      row_tiles<TILE_ROWS>(s_, lo_, G, N, M, K / 2, kernel);
  };
  with_scales(s, lo, sd, lod, group, "int4_mm", run);
  return y;
}

static at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_mm: x (M, K) fp32");
  int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K && s.numel() == N, "int8_mm: shapes");
  auto y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = s.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
#define INT8(MT, n, m) int8_row<MT>(qp + n * K, sp[n], K, xp + m * K, yp + m * N + n, N)
  TILED(INT8, K)
  return y;
}

// bf16 x and weights, fp32 sums, each result rounded to bf16 as it is stored.
static at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
              w.scalar_type() == at::kBFloat16 && x.is_contiguous() && w.is_contiguous() &&
              x.size(1) == w.size(1) && w.size(1) % 32 == 0,
              "bf16_mm: x (M, K) and w (N, K) bf16, K a multiple of 32");
  int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const c10::BFloat16 *xp = x.data_ptr<c10::BFloat16>(), *wp = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
#ifdef BF16_ROWS
  if (M == 1 && intel() && K >= 2048) {       // rows of 4 KB or more: 8 streams at once
    at::parallel_for(0, N / BF16_ROWS, 16 / BF16_ROWS, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; p++)
        bf16_rows<BF16_ROWS>(wp + p * BF16_ROWS * K, K, xp, yp + p * BF16_ROWS, 0);
    });
    for (int64_t n = N / BF16_ROWS * BF16_ROWS; n < N; n++)
      bf16_rows<1>(wp + n * K, K, xp, yp + n, 0);
    return y;
  }
  if (M == 1 && intel()) {     // shorter rows lie end to end: one stream, asked for 4 KB ahead
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; n++) bf16_rows<1>(wp + n * K, K, xp, yp + n, FAR_AHEAD);
    });
    return y;
  }
#endif
#define BF16(MT, n, m) bf16_row<MT>(wp + n * K, K, xp + m * K, yp + m * N + n, N)
  TILED(BF16, 2 * K)
  return y;
}

// ---- int8 in groups, fp16 and bf16 weights: a GGUF at its own bits (kernels.py) ----
// int8g_mm: W = lo + q·s per group of 16 or 32 along a row (llama.cpp's Q8_0, Q5_0/Q5_1, Q5_K,
// Q6_K widened to a byte each; lo optional); half_mm: W in fp16 or bf16, widened in registers
// (exact) as it streams. Both take fp32 x and return fp32.
//
// The order every build sums in (AVX-512, AVX2, scalar: the same bits), whatever the number of
// rows, int8_mm's: 32 lanes per row of x, weight k in lane k % 32, so a group of 32 fills the lanes
// once and two groups of 16 fill their halves. int8g: acc_L = fma(q_k·x_k, s_{k/g}, acc_L), the
// product rounded first; half: acc_L = fma(w_k, x_k, acc_L). Then lanes L, L + 8, L + 16, L + 24
// are added as int8_mm's (hsum), and with a minimum its share Σ_j lo_j·Σx_j is added as int4_mm's
// (lo_share, the group sums of each row of x computed once per call).

// int8 values held in six bits each (safetensors_io.join_sixes: a GGUF's 5- and 6-bit blocks, 0.75
// byte a value where int8 takes 1): per 32 values 24 bytes, first the low 4 bits of value i in
// byte i's low nibble and of value i + 16 in its high one, then the top 2 bits of value 8k + j in
// bits 2k, 2k + 1 of byte 16 + j; each stored plus 32. The kernels widen them to the int8 values
// (so to the same bits as those values stored in int8), 32 at a time; `+ n` moves n bytes.
struct Sixes {
  const uint8_t* p = nullptr;
  int8_t operator[](int64_t k) const {
    const uint8_t* b = p + k / 32 * 24;
    int i = int(k % 32), low = i < 16 ? b[i] & 15 : b[i - 16] >> 4;
    return int8_t((low | ((b[16 + (i & 7)] >> (2 * (i >> 3))) & 3) << 4) - 32);
  }
  Sixes operator+(int64_t n) const { return Sixes{p + n}; }
};
// Where block c (32 values) of a row starts, for a prefetch.
static inline const char* block_at(const int8_t* q, int64_t c) { return (const char*)(q + c * 32); }
static inline const char* block_at(Sixes q, int64_t c) { return (const char*)(q.p + c * 24); }

#if defined(__AVX2__) && defined(__FMA__)
// 8 weights as fp32: int8 by a sign-extending load, fp16 by F16C's conversion, bf16 by a shift.
static inline __m256 widen8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q)));
}
static inline __m256 widen8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
static inline __m256 widen8(const c10::BFloat16* p) { return bf16x8(p); }

// Block c's 32 int8 values: loaded, or a Sixes block's nibbles put beside their top 2 bits (each
// of the 4 qwords takes its own pair of bits from the 8 shared bytes: a variable shift).
static ALWAYS_INLINE __m256i values32(Sixes q, int64_t c) {
  const uint8_t* b = q.p + c * 24;
  const __m128i nib = _mm_set1_epi8(15);
  __m128i v = _mm_loadu_si128((const __m128i*)b);
  __m256i low = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nib), _mm_and_si128(v, nib));
  __m128i tops = _mm_loadl_epi64((const __m128i*)(b + 16));
  __m256i top = _mm256_srlv_epi64(_mm256_broadcastq_epi64(tops), _mm256_setr_epi64x(0, 2, 4, 6));
  top = _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi8(3)), 4);
  return _mm256_sub_epi8(_mm256_or_si256(low, top), _mm256_set1_epi8(32));
}
// Block c's values as four vectors of 8 fp32 (AVX2's loops).
static ALWAYS_INLINE void widen32(const int8_t* q, int64_t c, __m256* w) {
  for (int j = 0; j < 4; j++) w[j] = widen8(q + c * 32 + 8 * j);
}
static ALWAYS_INLINE void widen32(Sixes q, int64_t c, __m256* w) {
  __m256i v = values32(q, c);
  __m128i h[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
  for (int j = 0; j < 4; j++)
    w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(j % 2 ? _mm_srli_si128(h[j / 2], 8) : h[j / 2]));
}

#if defined(__AVX512F__)
// 16 weights as fp32, the same ways.
static inline __m512 widen16(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
}
static inline __m512 widen16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
static inline __m512 widen16(const c10::BFloat16* p) { return bf16x16(p); }
// Block c's values as two vectors of 16 fp32.
static ALWAYS_INLINE void widen32(const int8_t* q, int64_t c, __m512& w0, __m512& w1) {
  w0 = widen16(q + c * 32), w1 = widen16(q + c * 32 + 16);
}
// Six-bit values by two table lookups, added: the low 4 bits index 0..15 as int4's table does;
// the top 2 bits (lanes 0-7 from bits 0-1 of bytes 16..23, lanes 8-15 from bits 2-3, 4 more for
// values 16..31) a table of 16·t - 32, repeated (vpermps reads an index's low 4 bits; the two
// above the pair are the next value's). Each sum is a small integer, exact: the fp32 values the
// widened bytes give, in 11 instructions per 32 values against 16.
static ALWAYS_INLINE void widen32(Sixes q, int64_t c, __m512& w0, __m512& w1) {
  const uint8_t* b = q.p + c * 24;
  const __m512 low = nibble_values();
  const __m512 top = _mm512_setr_ps(-32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16, -32, -16,
                                    0, 16);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)b));
  int64_t tops;
  std::memcpy(&tops, b + 16, 8);
  const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i t = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(tops)), pair);
  w0 = _mm512_add_ps(_mm512_permutexvar_ps(v, low), _mm512_permutexvar_ps(t, top));
  w1 = _mm512_add_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), low),
                     _mm512_permutexvar_ps(_mm512_srli_epi32(t, 4), top));
}

// R int8 rows in groups (at pitch p: end to end, or from distant parts: distant_rows) against MT
// rows of x (K apart; their group sums sx, G apart) into y[t·N + r·p.y]: R rows share x's loads
// (a decode step's parts), MT rows of x a block's widening (a pass over several rows). Lanes
// 0-15 take the scale s[c·step], lanes 16-31 s[c·step + step - 1] (step = 32 / group); each
// (row, row of x) gets the same sums whatever R, MT and p.
template <int R, int MT, typename Q, typename L>
static void int8g_rows(Q q, const float* s, L lo, int64_t K, int64_t group, const float* x,
                       const float* sx, float* y, int64_t N, Pitch p) {
  const int64_t step = 32 / group, G = K / group;
  // one row: STREAM_AHEAD along it; rows from parts: each its own stream
  const int64_t ahead = R == 1 ? STREAM_AHEAD : AHEAD;
  __m512 acc[R][MT][2];
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / 32; c++) {
    UNROLL
    for (int r = 0; r < R; r++) {
      const Q qr = q + r * p.q;
      if ((c & 1) == 0) _mm_prefetch(block_at(qr, c) + ahead, _MM_HINT_T0);
      __m512 w0, w1;
      widen32(qr, c, w0, w1);
      const float* sr = s + r * p.s;
      const __m512 s0 = _mm512_set1_ps(sr[c * step]), s1 = _mm512_set1_ps(sr[c * step + step - 1]);
      UNROLL
      for (int t = 0; t < MT; t++) {
        const float* xc = x + t * K + c * 32;
        acc[r][t][0] = _mm512_fmadd_ps(_mm512_mul_ps(w0, _mm512_loadu_ps(xc)), s0, acc[r][t][0]);
        acc[r][t][1] =
            _mm512_fmadd_ps(_mm512_mul_ps(w1, _mm512_loadu_ps(xc + 16)), s1, acc[r][t][1]);
      }
    }
  }
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) {
      float v = hsum(acc[r][t][0], acc[r][t][1]);
      y[t * N + r * p.y] = lo ? v + lo_share(lo + r * p.lo, sx + t * G, G) : v;
    }
}
// Rows a decode step's int8 loop takes from distant parts (distant_rows).
#define INT8G_PARTS 4
// R fp16 or bf16 rows (at pitch p: end to end, or from distant parts) against MT rows of x,
// int8g_rows' loop without scales: each (row, row of x) gets the same sums whatever R and p.
template <int R, int MT, typename T>
static void half_rows(const T* w, int64_t K, const float* x, float* y, int64_t N, Pitch p) {
  const bool fetch = intel();
  // one row: FAR_AHEAD along it; rows from parts: each its own stream
  const int64_t ahead = R == 1 ? FAR_AHEAD : AHEAD;
  __m512 acc[R][MT][2];
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / 32; c++) {
    UNROLL
    for (int r = 0; r < R; r++) {
      const T* wr = reinterpret_cast<const T*>(reinterpret_cast<const char*>(w) + r * p.q);
      if (fetch) _mm_prefetch((const char*)(wr + c * 32) + ahead, _MM_HINT_T0);
      const __m512 w0 = widen16(wr + c * 32), w1 = widen16(wr + c * 32 + 16);
      UNROLL
      for (int t = 0; t < MT; t++) {
        acc[r][t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * K + c * 32), acc[r][t][0]);
        acc[r][t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * K + c * 32 + 16), acc[r][t][1]);
      }
    }
  }
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) y[t * N + r * p.y] = hsum(acc[r][t][0], acc[r][t][1]);
}
// Rows a decode step's 16-bit loop takes from distant parts (distant_rows).
#define HALF_PARTS 4
#else
template <int MT, typename Q, typename L>
static void int8g_row(Q q, const float* s, L lo, int64_t K, int64_t group,
                      const float* x, const float* sx, float* y, int64_t N) {
  const int64_t step = 32 / group, G = K / group;
  __m256 acc[MT][4], w[4];
  UNROLL
  for (int t = 0; t < MT; t++) for (int j = 0; j < 4; j++) acc[t][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; c++) {
    _mm_prefetch(block_at(q, c) + AHEAD, _MM_HINT_T0);
    __m256 sc[2] = {_mm256_set1_ps(s[c * step]), _mm256_set1_ps(s[c * step + step - 1])};
    widen32(q, c, w);
    UNROLL
    for (int t = 0; t < MT; t++)
      for (int j = 0; j < 4; j++)
        acc[t][j] = _mm256_fmadd_ps(
            _mm256_mul_ps(w[j], _mm256_loadu_ps(x + t * K + c * 32 + 8 * j)), sc[j / 2], acc[t][j]);
  }
  UNROLL
  for (int t = 0; t < MT; t++) {
    float v = hsum(acc[t]);
    y[t * N] = lo ? v + lo_share(lo, sx + t * G, G) : v;
  }
}
template <int MT, typename T>
static void half_row(const T* w, int64_t K, const float* x, float* y, int64_t N) {
  __m256 acc[MT][4], v[4];
  UNROLL
  for (int t = 0; t < MT; t++) for (int j = 0; j < 4; j++) acc[t][j] = _mm256_setzero_ps();
  const bool fetch = intel();
  for (int64_t c = 0; c < K / 32; c++) {
    if (fetch) _mm_prefetch((const char*)(w + c * 32) + AHEAD, _MM_HINT_T0);
    for (int j = 0; j < 4; j++) v[j] = widen8(w + c * 32 + 8 * j);
    feed<MT>(v, x + c * 32, K, acc);
  }
  UNROLL
  for (int t = 0; t < MT; t++) y[t * N] = hsum(acc[t]);
}
#endif
#else
template <typename L>
static inline float lo_share(L lo, const float* sx, int64_t G) {
  float l[8] = {0};
  for (int64_t g = 0; g < G; g++) l[g % 8] = std::fma(f32(lo[g]), sx[g], l[g % 8]);
  return hsum8(l);
}
template <int MT, typename Q, typename L>
static void int8g_row(Q q, const float* s, L lo, int64_t K, int64_t group,
                      const float* x, const float* sx, float* y, int64_t N) {
  const int64_t G = K / group;
  for (int t = 0; t < MT; t++) {
    float a[32] = {0};
    for (int64_t k = 0; k < K; k++) {
      float p = float(q[k]) * x[t * K + k];
      a[k % 32] = std::fma(p, s[k / group], a[k % 32]);
    }
    float v = hsum(a);
    y[t * N] = lo ? v + lo_share(lo, sx + t * G, G) : v;
  }
}
template <int MT, typename T>
static void half_row(const T* w, int64_t K, const float* x, float* y, int64_t N) {
  for (int t = 0; t < MT; t++) {
    float a[32] = {0};
    for (int64_t k = 0; k < K; k++) a[k % 32] = std::fma(float(w[k]), x[t * K + k], a[k % 32]);
    y[t * N] = hsum(a);
  }
}
#endif
#if !defined(__AVX512F__)
// int8g_rows as AVX-512's, one row after another (int8g_row): AVX2's 16 registers hold one row's
// sums beside its widened block, so its decode keeps rows end to end (INT8G_PARTS 1); the plain
// C++ build takes parts, for the tests to compare the same loops.
template <int R, int MT, typename Q, typename L>
static void int8g_rows(Q q, const float* s, L lo, int64_t K, int64_t group, const float* x,
                       const float* sx, float* y, int64_t N, Pitch p) {
  for (int r = 0; r < R; r++)
    int8g_row<MT>(q + r * p.q, s + r * p.s, lo ? lo + r * p.lo : L(), K, group, x, sx,
                  y + r * p.y, N);
}
// half_rows likewise (half_row): AVX2's decode keeps its rows end to end.
template <int R, int MT, typename T>
static void half_rows(const T* w, int64_t K, const float* x, float* y, int64_t N, Pitch p) {
  for (int r = 0; r < R; r++)
    half_row<MT>(reinterpret_cast<const T*>(reinterpret_cast<const char*>(w) + r * p.q), K, x,
                 y + r * p.y, N);
}
#if defined(__AVX2__) && defined(__FMA__)
#define INT8G_PARTS 1
#define HALF_PARTS 1
#else
#define INT8G_PARTS 4
#define HALF_PARTS 4
#endif
#endif

// An int8-in-groups product's arguments checked (op: its name); whether its values are held in
// six bits (Sixes).
static bool int8g_six(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t group,
                      const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              op, ": x (M, K) fp32");
  const int64_t K = x.size(1), N = q.size(0);
  TORCH_CHECK((group == 16 || group == 32) && K % 32 == 0,
              op, ": group 16 or 32, K a multiple of 32");
  const bool six = q.scalar_type() == at::kByte;
  const bool values = six ? q.size(1) * 4 == K * 3 : q.scalar_type() == at::kChar && q.size(1) == K;
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && s.dim() == 2 && s.size(0) == N &&
              s.size(1) == K / group && values,
              op, ": q (N, K) int8 or (N, 3K/4) uint8 (six bits a value), scale (N, K/group)");
  return six;
}
static at::Tensor int8g_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                           const std::optional<at::Tensor>& lo_, int64_t group,
                           const std::optional<at::Tensor>& sd,
                           const std::optional<at::Tensor>& lod) {
  const bool six = int8g_six(x, q, s, group, "int8g_mm");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / group;
  const bool has_lo = lo_.has_value() && lo_->defined();
  auto y = at::empty({M, N}, x.options());
  std::vector<float> sums(has_lo ? M * G : 0);
  const float *xp = x.data_ptr<float>(), *sx = sums.data();
  for (int64_t m = 0; has_lo && m < M; m++) group_sums(xp + m * K, K, group, sums.data() + m * G);
  float* yp = y.data_ptr<float>();
  auto rows = [&](auto qp, int64_t row_len) {
    auto far = [&](auto parts, int64_t n, const float* sn, auto ln, Pitch p) {
      int8g_rows<decltype(parts)::value, 1>(qp + n * row_len, sn, ln, K, group, xp,
                                            ln ? sx : nullptr, yp + n, N, p);
    };
    auto run = [&](auto s_, auto lo_) {
      if (M == 1 && distant<INT8G_PARTS>(N, row_len)) {
        distant_rows<INT8G_PARTS>(s_, lo_, G, N, row_len, far);
        return;
      }
      row_tiles<1>(s_, lo_, G, N, M, row_len, [&](auto, auto tile, int64_t n, int64_t m,
                                                  const float* sn,
                                         auto ln) {
        int8g_rows<1, decltype(tile)::value>(qp + n * row_len, sn, ln, K, group, xp + m * K,
                                             ln ? sx + m * G : nullptr, yp + m * N + n, N,
                                             Pitch{row_len, G, G, 1});
      });
    };
    with_scales(s, lo_, sd, lod, group, "int8g_mm", run);
  };
  if (six) rows(Sixes{q.data_ptr<uint8_t>()}, K / 4 * 3);
  else rows(q.data_ptr<int8_t>(), K);
  return y;
}

template <typename T>
static void half_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  const T* wp = w.data_ptr<T>();
  float* yp = y.data_ptr<float>();
  if (M == 1 && distant<HALF_PARTS>(N, 2 * K)) {
    const float* none = nullptr;    // no scales: groups of none
    distant_rows<HALF_PARTS>(none, none, 0, N, 2 * K, [&](auto parts, int64_t n, const float*,
                                                          const float*, Pitch p) {
      half_rows<decltype(parts)::value, 1>(wp + n * K, K, xp, yp + n, N, p);
    });
    return;
  }
#define HALF(MT, n, m) half_rows<1, MT>(wp + n * K, K, xp + m * K, yp + m * N + n, N, \
                                        Pitch{2 * K, 0, 0, 1})
  TILED(HALF, 2 * K)
}
static at::Tensor half_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == at::kFloat &&
              (w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16) &&
              x.is_contiguous() && w.is_contiguous() && x.size(1) == w.size(1) &&
              w.size(1) % 32 == 0,
              "half_mm: x (M, K) fp32 and w (N, K) fp16 or bf16, K a multiple of 32");
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  if (w.scalar_type() == at::kHalf) half_into<c10::Half>(x, w, y);
  else half_into<c10::BFloat16>(x, w, y);
  return y;
}

// ---- x rounded to 8 bits (asked for: not exact to the file) ----
// llama.cpp's arithmetic for int4 weights: each 32 of x rounded to int8 times its fp32 scale
// d = max|x|/127 (its Q8_0), so that 4 weights times 4 of x sum in one integer instruction (AVX2's
// maddubs and madd, AVX-512BW's), exactly; only the scales are floating point. The minimum's share
// takes the rounded x's sums (rounded_sums). The rounding moves each product by up to d/2 times its
// weight: close to the file's logits, not equal, so greedy answers may part from fp32 decoding of
// the file.
//
// Layout of a row's rounded x, per 4 blocks of 32 (a quad, 128 bytes): the 4 blocks' even x (16
// each: the low nibbles'), then their odd x; past the last block, zeros. Per block its d, 4 times
// (the 4 lanes of a block's partial sums), 16 floats a quad.
// The order every build sums in: per quad, 16 int32 lanes, lane 4b + j holding block b's bytes
// 4j .. 4j + 3 (low nibbles by even x plus high by odd), exact; then one fused multiply-add per
// lane, acc += lane · (s·d_b), s the scale of the lane's group (block b's, or with groups of 16
// the first of its two for j < 2); lanes i and i + 8 added, reduced as hsum8; the minimum's share
// (lo_share) added.
static constexpr int64_t QUAD = 128;
#ifndef X8_CHUNK_BYTES
#define X8_CHUNK_BYTES (256 << 10)
#endif
// One block of 32: v[i] = x[i]/d to the nearest integer (ties to even), |v| ≤ 127; returns d.
static ALWAYS_INLINE float round_block(const float* xc, int32_t* v) {
#if defined(__AVX2__)
  // a chain of 32 scalar maxima took more time than the dot products of a 64-row prefill
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 a[4], m;
  for (int j = 0; j < 4; j++) a[j] = _mm256_loadu_ps(xc + 8 * j);
  m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                    _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  for (int j = 0; j < 4; j++)       // to nearest, ties to even (MXCSR's default): nearbyint's
    _mm256_storeu_si256((__m256i*)(v + 8 * j),
                        _mm256_cvtps_epi32(_mm256_mul_ps(a[j], _mm256_set1_ps(id))));
#else
  float amax = 0.f;
  for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(xc[i]));
  const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  for (int i = 0; i < 32; i++) v[i] = int32_t(std::nearbyint(xc[i] * id));
#endif
  return d;
}
// Each group's sum of the rounded x (d times an exact integer sum; a group of several blocks adds
// them in order), for the minimum's share: with these, a block's product is that of the file's
// dequantized weights (lo + q·s) with the rounded x, as llama.cpp's is. With x's own sums instead,
// the rounding error met q·s, which is not centred on zero as the weights are: twice the error.
static void rounded_sums(const int32_t* v, float d, int64_t c, int64_t group, float* sx) {
  if (group >= 32) {
    int32_t a = 0;
    for (int i = 0; i < 32; i++) a += v[i];
    float& g = sx[c * 32 / group];
    g = c * 32 % group == 0 ? d * float(a) : g + d * float(a);
    return;
  }
  for (int64_t j = 0; j < 32 / group; j++) {
    int32_t a = 0;
    for (int64_t i = j * group; i < (j + 1) * group; i++) a += v[i];
    sx[c * (32 / group) + j] = d * float(a);
  }
}
// A row of x for int4_x8_mm: the quads' layout above; its groups' rounded sums.
static void round_x(const float* x, int64_t K, int64_t group, int8_t* xq, float* dq, float* sx) {
  const int64_t nb = K / 32, nq = (nb + 3) / 4;
  std::fill(xq, xq + nq * QUAD, int8_t(0));
  std::fill(dq, dq + nq * 16, 0.f);
  for (int64_t c = 0; c < nb; c++) {
    int32_t v[32];
    const float d = round_block(x + 32 * c, v);
    rounded_sums(v, d, c, group, sx);
    int8_t* ev = xq + (c / 4) * QUAD + (c % 4) * 16;
    for (int i = 0; i < 16; i++) ev[i] = int8_t(v[2 * i]), ev[64 + i] = int8_t(v[2 * i + 1]);
    for (int j = 0; j < 4; j++) dq[(c / 4) * 16 + (c % 4) * 4 + j] = d;
  }
}

// Ask for the weights 2 KB ahead (a step's int4 matrices from DRAM, one row at a time, Zen 4: 512 B
// to 4 KB within 10% of each other, 2 KB the fastest).
#ifndef X8_AHEAD
#define X8_AHEAD 2048
#endif

#if defined(__AVX512BW__)
// Weight rows a pass over several rows of x takes at a time: 4 rows by 4 of x, 16 accumulators
// (a prefill's 512 rows through a step's int4 matrices: 1.1x faster than 2 rows).
#ifndef X8_TILE_ROWS
#define X8_TILE_ROWS 4
#endif
// A quad of one weight row in one register: its 64 bytes, the low nibbles and the high ones; per
// row of x two VNNI dot products (4 weights by 4 of x into an int32 lane), or without VNNI two
// maddubs (into 2 int16 each, |sum| ≤ 2·15·127), an add (≤ 7620) and a madd by ones: the same
// integers; then a conversion and a multiply-add.
template <int R, int MT, bool H16, typename L>
static void int4_x8_rows(const uint8_t* q, const float* s, L lo, int64_t K, int shift,
                         const int8_t* xq, const float* dq, const float* sx, float* y, int64_t N) {
  const int64_t nb = K / 32, nq = (nb + 3) / 4, G = H16 ? 2 * nb : nb >> shift;
  const __m512i nib = _mm512_set1_epi8(0x0F);
#if !defined(__AVX512VNNI__)
  const __m512i ones = _mm512_set1_epi16(1);
#endif
  // lane 4b + j's group: block b's (j's bytes 4j..4j+3 hold weights 8j..8j+7: H16, the block's
  // first group for j < 2)
  const __m512i sidx =
      H16 ? _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
          : _mm512_srli_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                              shift);
  const int64_t ahead = spans_ahead(X8_AHEAD, R * (K / 2));
  __m512 acc[R][MT];
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm512_setzero_ps();
  const __mmask16 full = H16 ? 0xFF : __mmask16((1u << std::max(1, 4 >> shift)) - 1);
  for (int64_t u = 0; u < nq; u++) {
    const int64_t c = 4 * u, n = std::min<int64_t>(4, nb - c), g0 = H16 ? 2 * c : c >> shift;
    const bool whole = n == 4;
    const __mmask64 qm = whole ? ~__mmask64(0) : (__mmask64(1) << (16 * n)) - 1;
    const __mmask16 sm = whole ? full
                         : H16 ? __mmask16((1u << (2 * n)) - 1)
                               : __mmask16((1u << (((c + n - 1) >> shift) - g0 + 1)) - 1);
    __m512i l4[R], h4[R];
    __m512 sv[R];
    UNROLL
    for (int r = 0; r < R; r++) {
      const uint8_t* qr = q + r * (K / 2) + c * 16;
      _mm_prefetch((const char*)(qr + ahead), _MM_HINT_T0);
      __m512i v = whole ? _mm512_loadu_si512(qr) : _mm512_maskz_loadu_epi8(qm, qr);
      l4[r] = _mm512_and_si512(v, nib), h4[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      sv[r] = _mm512_permutexvar_ps(sidx, _mm512_maskz_loadu_ps(sm, s + r * G + g0));
    }
    UNROLL
    for (int t = 0; t < MT; t++) {
      const int8_t* xt = xq + t * (nq * QUAD) + u * QUAD;
      const __m512i e = _mm512_loadu_si512(xt), o = _mm512_loadu_si512(xt + 64);
      const __m512 d = _mm512_loadu_ps(dq + t * (nq * 16) + u * 16);
      UNROLL
      for (int r = 0; r < R; r++) {
#if defined(__AVX512VNNI__)
        __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l4[r], e),
                                        h4[r], o);
#else
        __m512i p = _mm512_madd_epi16(
            _mm512_add_epi16(_mm512_maddubs_epi16(l4[r], e), _mm512_maddubs_epi16(h4[r], o)),
            ones);
#endif
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sv[r], d), acc[r][t]);
      }
    }
  }
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++)
      y[t * N + r] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[r][t]), upper8(acc[r][t])))
                     + lo_share(lo + r * G, sx + t * G, G);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define X8_TILE_ROWS 1
// A quad as two halves of 2 blocks (32 bytes, 8 lanes each), into two accumulators.
template <int R, int MT, bool H16, typename L>
static void int4_x8_rows(const uint8_t* q, const float* s, L lo, int64_t K, int shift,
                         const int8_t* xq, const float* dq, const float* sx, float* y, int64_t N) {
  const int64_t nb = K / 32, nq = (nb + 3) / 4, G = H16 ? 2 * nb : nb >> shift;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t ahead = spans_ahead(X8_AHEAD, R * (K / 2));
  __m256 acc[R][MT][2];
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < nb; c += 2) {
    const int64_t u = c / 4, h = (c / 2) & 1;
    const bool two = c + 1 < nb;
    UNROLL
    for (int r = 0; r < R; r++) {
      const uint8_t* qr = q + r * (K / 2) + c * 16;
      if ((c & 3) == 0) _mm_prefetch((const char*)(qr + ahead), _MM_HINT_T0);
      __m256i v = two ? _mm256_loadu_si256((const __m256i*)qr)
                      : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)qr));
      __m256i l4 = _mm256_and_si256(v, nib), h4 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      const float* sr = s + r * G;
      // lanes 0-3 block c's, 4-7 block c + 1's; H16: lanes 4b, 4b + 1 its first group
      __m256 sv = H16 ? _mm256_setr_ps(sr[2 * c], sr[2 * c], sr[2 * c + 1], sr[2 * c + 1],
                                       two ? sr[2 * c + 2] : 0.f, two ? sr[2 * c + 2] : 0.f,
                                       two ? sr[2 * c + 3] : 0.f, two ? sr[2 * c + 3] : 0.f)
                      : _mm256_setr_m128(_mm_set1_ps(sr[c >> shift]),
                                         _mm_set1_ps(two ? sr[(c + 1) >> shift] : 0.f));
      UNROLL
      for (int t = 0; t < MT; t++) {
        const int8_t* xt = xq + t * (nq * QUAD) + u * QUAD + h * 32;
        __m256i e = _mm256_loadu_si256((const __m256i*)xt),
                o = _mm256_loadu_si256((const __m256i*)(xt + 64));
        __m256i p = _mm256_madd_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(l4, e), _mm256_maddubs_epi16(h4, o)), ones);
        acc[r][t][h] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(p),
            _mm256_mul_ps(sv, _mm256_loadu_ps(dq + t * (nq * 16) + u * 16 + h * 8)), acc[r][t][h]);
      }
    }
  }
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++)
      y[t * N + r] = hsum8(_mm256_add_ps(acc[r][t][0], acc[r][t][1]))
                     + lo_share(lo + r * G, sx + t * G, G);
}
#else
#define X8_TILE_ROWS 1
template <int R, int MT, bool H16, typename L>
static void int4_x8_rows(const uint8_t* q, const float* s, L lo, int64_t K, int shift,
                         const int8_t* xq, const float* dq, const float* sx, float* y, int64_t N) {
  const int64_t nb = K / 32, nq = (nb + 3) / 4, G = H16 ? 2 * nb : nb >> shift;
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) {
      const uint8_t* qr = q + r * (K / 2);
      const float* sr = s + r * G;
      float acc[16] = {0}, l[8];
      for (int64_t c = 0; c < nb; c += 2) {
        const int64_t u = c / 4, h = (c / 2) & 1;
        const int8_t* xt = xq + t * (nq * QUAD) + u * QUAD + h * 32;
        for (int i = 0; i < 8; i++) {
          const int64_t b = c + i / 4;      // lane i's block
          int32_t p = 0;
          if (b < nb)
            for (int k = 4 * i; k < 4 * i + 4; k++)
              p += int32_t(qr[c * 16 + k] & 15) * xt[k] + int32_t(qr[c * 16 + k] >> 4) * xt[64 + k];
          const float sb = b < nb ? sr[H16 ? 2 * b + (i % 4) / 2 : b >> shift] : 0.f;
          acc[8 * h + i] = std::fma(float(p), sb * dq[t * (nq * 16) + u * 16 + h * 8 + i],
                                    acc[8 * h + i]);
        }
      }
      for (int i = 0; i < 8; i++) l[i] = acc[i] + acc[8 + i];
      y[t * N + r] = hsum8(l) + lo_share(lo + r * G, sx + t * G, G);
    }
}
#endif

// The rounded-x loops' passes: row_tiles over rows of x in chunks of `chunk` whose rounded x stays
// in L2 while every weight row passes them (all 512 rows of a 500-token prompt at once were
// re-read from L3 for every few weight rows: 1.4x slower; a chunk re-reads the weights instead,
// once per chunk); f as row_tiles', m counted over all M. One weight row at a time at one row of
// x: 1.3x faster from DRAM than two side by side (a step's int4 matrices, Zen 4, AVX-512), where
// int4_mm's fp32 loop gains from two.
template <typename S, typename F>
static void x8_tiles(S s, S lo, int64_t G, int64_t N, int64_t M, int64_t chunk,
                     int64_t row_bytes, F f) {
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    auto from_m0 = [&](auto rows, auto tile, int64_t n, int64_t m, const float* sn, S ln) {
      f(rows, tile, n, m0 + m, sn, ln);
    };
    if (M == 1)
      row_tiles<1>(s, lo, G, N, 1, row_bytes, from_m0);
    else
      row_tiles<X8_TILE_ROWS>(s, lo, G, N, std::min(chunk, M - m0), row_bytes, from_m0);
  }
}

static at::Tensor int4_x8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                             const at::Tensor& lo, int64_t group,
                             const std::optional<at::Tensor>& sd,
                             const std::optional<at::Tensor>& lod) {
  const int shift = int4_shift(x, q, s, group, "int4_x8_mm");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / group;
  const int64_t nq = (K / 32 + 3) / 4;
  auto y = at::empty({M, N}, x.options());
  std::vector<int8_t> rounded(M * nq * QUAD);
  std::vector<float> scales(M * nq * 16), sums(M * G);
  const float* xf = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      round_x(xf + m * K, K, group, rounded.data() + m * nq * QUAD, scales.data() + m * nq * 16,
              sums.data() + m * G);
    }
  });
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // a rounded row of x: 1.5 B a value
  const int64_t chunk = std::max<int64_t>(4, (X8_CHUNK_BYTES / (K + K / 2)) / 4 * 4);
  auto kernel = [&](auto rows, auto tile, int64_t n, int64_t m, const float* sn, auto ln) {
    by_halves(shift, [&](auto h16) {
      int4_x8_rows<decltype(rows)::value, decltype(tile)::value, decltype(h16)::value>(
          qp + n * K / 2, sn, ln, K, shift, rounded.data() + m * nq * QUAD,
          scales.data() + m * nq * 16, sums.data() + m * G, yp + m * N + n, N);
    });
  };
  with_scales(s, lo, sd, lod, group, "int4_x8_mm",
              [&](auto s_, auto lo_) { x8_tiles(s_, lo_, G, N, M, chunk, K / 2, kernel); });
  return y;
}

// ---- int8 weights in groups (a GGUF's 5-, 6- and 8-bit blocks) with x rounded to 8 bits
// The same rounding of x, each block's values in order, blocks in pairs (64 bytes; an odd last
// block paired with zeros); per block its d, 8 times (its 8 lanes), and per lane -128 times the sum
// of its 4 values: with VNNI the weights go in as w + 128, unsigned. The order every build sums
// in: per pair of blocks, 16 int32 lanes, lane 8b + j holding block b's values 4j .. 4j + 3 times
// their x, exact; acc += lane · (s·d), s the scale of the lane's group (16 or 32 values); lanes i
// and i + 8 added, reduced as hsum8; the minimum's share added where there is one.
static void round_x_pairs(const float* x, int64_t K, int64_t group, int8_t* xq, float* dq,
                          int32_t* corr, float* sx) {
  const int64_t nb = K / 32, np = (nb + 1) / 2;
  std::fill(xq, xq + np * 64, int8_t(0));
  std::fill(dq, dq + np * 16, 0.f);
  std::fill(corr, corr + np * 16, 0);
  for (int64_t c = 0; c < nb; c++) {
    int32_t v[32];
    const float d = round_block(x + 32 * c, v);
    if (sx) rounded_sums(v, d, c, group, sx);
    for (int i = 0; i < 32; i++) xq[32 * c + i] = int8_t(v[i]);
    for (int j = 0; j < 8; j++) {
      dq[8 * c + j] = d;
      corr[8 * c + j] = -128 * (v[4 * j] + v[4 * j + 1] + v[4 * j + 2] + v[4 * j + 3]);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Block c's 32 values as int8 (values32 above for six bits).
static ALWAYS_INLINE __m256i values32(const int8_t* q, int64_t c) {
  return _mm256_loadu_si256((const __m256i*)(q + c * 32));
}
#endif
#if defined(__AVX512BW__)
// Blocks c and c + 1 in one register; without the second (two false), zeros in its place.
template <typename Q>
static ALWAYS_INLINE __m512i values64(Q q, int64_t c, bool two) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(values32(q, c)),
                            two ? values32(q, c + 1) : _mm256_setzero_si256(), 1);
}
// One weight row against MT rows of x, a pair of blocks a step: per row of x one VNNI dot product
// of w + 128 by x on the lanes' corrections, or without VNNI |w| by x with w's sign (maddubs, then
// madd by ones: |sum| ≤ 2·128·127 in int16), the same integers; a conversion, a multiply-add.
template <int R, int MT, typename Q, typename L>
static void int8g_x8_rows(Q q, int64_t row_len, const float* s, L lo, int64_t K, int64_t group,
                          const int8_t* xq, const float* dq, const int32_t* corr, const float* sx,
                          float* y, int64_t N) {
  const int64_t nb = K / 32, np = (nb + 1) / 2, G = K / group, per = 32 / group;
  const __m512i idx = group == 32
      ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
      : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __mmask16 both = __mmask16((1u << (2 * per)) - 1), one = __mmask16((1u << per) - 1);
#if defined(__AVX512VNNI__)
  const __m512i flip = _mm512_set1_epi8(char(0x80));
#else
  const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
#endif
  __m512 acc[R][MT];
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; p++) {
    const int64_t c = 2 * p;
    const bool two = c + 1 < nb;
#if defined(__AVX512VNNI__)
    __m512i u[R];
#else
    __m512i aw[R];
    __mmask64 neg[R];
#endif
    __m512 sv[R];
    UNROLL
    for (int r = 0; r < R; r++) {
      _mm_prefetch(block_at(q + r * row_len, c) + X8_AHEAD, _MM_HINT_T0);
      const __m512i w = values64(q + r * row_len, c, two);
      sv[r] = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(two ? both : one,
                                                               s + r * G + c * per));
#if defined(__AVX512VNNI__)
      u[r] = _mm512_xor_si512(w, flip);
#else
      aw[r] = _mm512_abs_epi8(w), neg[r] = _mm512_movepi8_mask(w);
#endif
    }
    UNROLL
    for (int t = 0; t < MT; t++) {
      const int64_t at = t * np * 16 + p * 16;
      const __m512i e = _mm512_loadu_si512(xq + t * np * 64 + p * 64);
      const __m512 d = _mm512_loadu_ps(dq + at);
#if defined(__AVX512VNNI__)
      const __m512i k = _mm512_loadu_si512(corr + at);
#endif
      UNROLL
      for (int r = 0; r < R; r++) {
#if defined(__AVX512VNNI__)
        const __m512i v = _mm512_dpbusd_epi32(k, u[r], e);
#else
        const __m512i v = _mm512_madd_epi16(
            _mm512_maddubs_epi16(aw[r], _mm512_mask_sub_epi8(e, neg[r], zero, e)), ones);
#endif
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(sv[r], d), acc[r][t]);
      }
    }
  }
  UNROLL
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) {
      float v = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[r][t]), upper8(acc[r][t])));
      y[t * N + r] = lo ? v + lo_share(lo + r * G, sx + t * G, G) : v;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
// A block a step, into the accumulator of its place in the pair; |w| by x with w's sign. One
// weight row at a time (R = 1: AVX2's 16 registers).
template <int R, int MT, typename Q, typename L>
static void int8g_x8_rows(Q q, int64_t, const float* s, L lo, int64_t K, int64_t group,
                          const int8_t* xq, const float* dq, const int32_t*, const float* sx,
                          float* y, int64_t N) {
  static_assert(R == 1, "one weight row at a time");
  const int64_t nb = K / 32, np = (nb + 1) / 2, G = K / group, per = 32 / group;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT][2];
  UNROLL
  for (int t = 0; t < MT; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < nb; c++) {
    const int h = int(c & 1);
    if (h == 0) _mm_prefetch(block_at(q, c) + X8_AHEAD, _MM_HINT_T0);
    const __m256i w = values32(q, c), aw = _mm256_abs_epi8(w);
    const __m256 sv = _mm256_setr_m128(_mm_set1_ps(s[c * per]), _mm_set1_ps(s[c * per + per - 1]));
    UNROLL
    for (int t = 0; t < MT; t++) {
      const __m256i e = _mm256_loadu_si256((const __m256i*)(xq + t * np * 64 + c * 32));
      const __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(e, w)), ones);
      acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v),
                                  _mm256_mul_ps(sv, _mm256_loadu_ps(dq + t * np * 16 + c * 8)),
                                  acc[t][h]);
    }
  }
  UNROLL
  for (int t = 0; t < MT; t++) {
    float v = hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
    y[t * N] = lo ? v + lo_share(lo, sx + t * G, G) : v;
  }
}
#else
template <int R, int MT, typename Q, typename L>
static void int8g_x8_rows(Q q, int64_t, const float* s, L lo, int64_t K, int64_t group,
                          const int8_t* xq, const float* dq, const int32_t*, const float* sx,
                          float* y, int64_t N) {
  static_assert(R == 1, "one weight row at a time");
  const int64_t nb = K / 32, np = (nb + 1) / 2, G = K / group;
  for (int t = 0; t < MT; t++) {
    float acc[16] = {0}, l[8];
    for (int64_t c = 0; c < nb; c++)
      for (int j = 0; j < 8; j++) {
        int32_t v = 0;
        for (int64_t k = 32 * c + 4 * j; k < 32 * c + 4 * j + 4; k++)
          v += int32_t(q[k]) * xq[t * np * 64 + k];
        float& a = acc[8 * (c & 1) + j];
        a = std::fma(float(v), s[(32 * c + 4 * j) / group] * dq[t * np * 16 + 8 * c + j], a);
      }
    for (int i = 0; i < 8; i++) l[i] = acc[i] + acc[8 + i];
    float v = hsum8(l);
    y[t * N] = lo ? v + lo_share(lo, sx + t * G, G) : v;
  }
}
#endif

static at::Tensor int8g_x8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                              const std::optional<at::Tensor>& lo_, int64_t group,
                              const std::optional<at::Tensor>& sd,
                              const std::optional<at::Tensor>& lod) {
  const bool six = int8g_six(x, q, s, group, "int8g_x8_mm");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / group;
  const bool has_lo = lo_.has_value() && lo_->defined();
  const int64_t np = (K / 32 + 1) / 2;
  auto y = at::empty({M, N}, x.options());
  std::vector<int8_t> rounded(M * np * 64);
  std::vector<float> scales(M * np * 16), sums(has_lo ? M * G : 0);
  std::vector<int32_t> corr(M * np * 16);
  const float* xf = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      round_x_pairs(xf + m * K, K, group, rounded.data() + m * np * 64,
                    scales.data() + m * np * 16, corr.data() + m * np * 16,
                    has_lo ? sums.data() + m * G : nullptr);
    }
  });
  float* yp = y.data_ptr<float>();
  // a rounded row of x: its bytes, d and the corrections, 3 B a value
  const int64_t chunk = std::max<int64_t>(4, (X8_CHUNK_BYTES / (K * 3)) / 4 * 4);
  auto rows = [&](auto qp, int64_t row_len) {
    auto kernel = [&](auto rows, auto tile, int64_t n, int64_t m, const float* sn, auto ln) {
      int8g_x8_rows<decltype(rows)::value, decltype(tile)::value>(
          qp + n * row_len, row_len, sn, ln, K, group, rounded.data() + m * np * 64,
          scales.data() + m * np * 16, corr.data() + m * np * 16,
          ln ? sums.data() + m * G : nullptr, yp + m * N + n, N);
    };
    with_scales(s, lo_, sd, lod, group, "int8g_x8_mm",
                [&](auto s_, auto l_) { x8_tiles(s_, l_, G, N, M, chunk, row_len, kernel); });
  };
  if (six) rows(Sixes{q.data_ptr<uint8_t>()}, K / 4 * 3);
  else rows(q.data_ptr<int8_t>(), K);
  return y;
}

// ---- Many rows of x (a prefill): x·Wᵀ on a matrix-matrix kernel, W widened a tile at a time
// A prefill is compute-bound: the loops above are built for streaming W once per row of x, GEMM
// for reusing each weight across many rows. It wants fp32 W; prepack's fp32 copy costs 4 B a weight
// held for good (int8's 4x, int4's 5x), and widening the whole matrix at each call writes and reads
// back that much again. Here each WIDE_ROWS rows of W are dequantized into one fp32 scratch that
// stays in the caches (256 rows of 2048: 2 MB), then one fp32 matrix product (tile_product) writes
// their columns of y. Unlike the loops above its sums are oneDNN's or BLAS's, in an order that may
// change with the number of rows: a prefill's outputs are not compared with a step's.
#ifndef WIDE_ROWS
#define WIDE_ROWS 256
#endif

// One row of W in fp32, the same values in every build: q·s + lo per group in one fused
// multiply-add (group = K: one scale per row, no lo), int4's two weights a byte (even column in the
// low nibble), fp16 and bf16 widened. quantize.py's dequantized() rounds q·s before adding lo:
// within an ulp. 8 weights a store with AVX2.
#if defined(__AVX2__) && defined(__FMA__)
static inline void put8(float* o, __m256 w, __m256 s, const __m256* lo) {
  _mm256_storeu_ps(o, lo ? _mm256_fmadd_ps(w, s, *lo) : _mm256_mul_ps(w, s));
}
// int8 values, a byte each or six bits (Sixes), 32 at a time (widen32), 8 a store; a group is a
// whole number of stores (16, 32, or a row), so its scale changes between stores.
template <typename Q>
static void dequant_values(Q q, const float* s, const float* lo, int64_t K, int64_t group,
                           float* out) {
  __m256 w[4], vs = _mm256_set1_ps(s[0]), vl = _mm256_set1_ps(lo ? lo[0] : 0.f);
  int64_t j = 0, left = group / 8;
  for (int64_t c = 0; c < K / 32; c++) {
    widen32(q, c, w);
    for (int i = 0; i < 4; i++) {
      put8(out + c * 32 + 8 * i, w[i], vs, lo ? &vl : nullptr);
      if (--left == 0 && ++j < K / group) {
        left = group / 8;
        vs = _mm256_set1_ps(s[j]), vl = _mm256_set1_ps(lo ? lo[j] : 0.f);
      }
    }
  }
}
// 16 bytes: their low and high nibbles interleaved back into the 32 weights' order.
static void dequant_row(Nibbles q, const float* s, const float* lo, int64_t K, int64_t group,
                        float* out) {
  const __m128i nib = _mm_set1_epi8(15);
  for (int64_t k = 0; k < K; k += 32) {
    __m128i b = _mm_loadu_si128((const __m128i*)(q.p + k / 2));
    __m128i e = _mm_and_si128(b, nib), o = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    __m128i w0 = _mm_unpacklo_epi8(e, o), w1 = _mm_unpackhi_epi8(e, o);
    __m128i part[4] = {w0, _mm_srli_si128(w0, 8), w1, _mm_srli_si128(w1, 8)};
    for (int h = 0; h < 2; h++) {         // weights 0..15 and 16..31: a group of 16 each, or one
      const int64_t g = (k + 16 * h) / group;
      __m256 vs = _mm256_set1_ps(s[g]), vl = _mm256_set1_ps(lo ? lo[g] : 0.f);
      for (int i = 2 * h; i < 2 * h + 2; i++)
        put8(out + k + 8 * i, nibbles8(_mm256_cvtepu8_epi32(part[i]), q.tab), vs,
             lo ? &vl : nullptr);
    }
  }
}
template <typename T>
static void dequant_row(const T* w, const float*, const float*, int64_t K, int64_t, float* out) {
  for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(out + k, widen8(w + k));
}
#else
template <typename Q>
static void dequant_values(Q q, const float* s, const float* lo, int64_t K, int64_t group,
                           float* out) {
  for (int64_t k = 0; k < K; k++)
    out[k] = lo ? std::fma(float(q[k]), s[k / group], lo[k / group]) : float(q[k]) * s[k / group];
}
static void dequant_row(Nibbles q, const float* s, const float* lo, int64_t K, int64_t group,
                        float* out) {
  dequant_values(q, s, lo, K, group, out);
}
template <typename T>
static void dequant_row(const T* w, const float*, const float*, int64_t K, int64_t, float* out) {
  for (int64_t k = 0; k < K; k++) out[k] = float(w[k]);
}
#endif
static void dequant_row(const int8_t* q, const float* s, const float* lo, int64_t K, int64_t group,
                        float* out) {
  dequant_values(q, s, lo, K, group, out);
}
static void dequant_row(Sixes q, const float* s, const float* lo, int64_t K, int64_t group,
                        float* out) {
  dequant_values(q, s, lo, K, group, out);
}

// out = x·tileᵀ on oneDNN's fp32 matrix product where torch has it (mkldnn::_linear_pointwise with a
// plain weight, which it reorders for its kernel) and the product is big enough to repay its fixed
// cost a call (ONEDNN_MACS multiply-adds), else BLAS's (at::mm). On this pool's Zen 4, 2 threads,
// alternating runs: a TinyLlama layer's four matrices at 16 to 530 rows of x took 5-20% less time
// in oneDNN than in the BLAS torch links (MKL); SmolLM2's at 16 rows 20% more (tiles of 80 rows by
// 576: microseconds of work a call, below ONEDNN_MACS). Both are fp32 sums, in different orders.
#ifndef ONEDNN_MACS
#define ONEDNN_MACS (int64_t(1) << 22)
#endif
static void tile_product(at::Tensor& out, const at::Tensor& x, const at::Tensor& tile) {
  static const std::optional<c10::OperatorHandle> onednn =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  if (!onednn || x.size(0) * tile.size(0) * x.size(1) < ONEDNN_MACS) {
    at::mm_out(out, x, tile.t());
    return;
  }
  std::vector<c10::IValue> stack{x, tile, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  onednn->callBoxed(stack);
  out.copy_(stack[0].toTensor());
}

// Each thread takes whole tiles, dequantizes them into its own scratch and runs one single-threaded
// product each (inside a parallel region oneDNN and BLAS do not fork again): one fork and join per
// call, not two per tile, which on a busy machine cost a time slice each (a 128-row prefill of a
// 2048×5632 matrix took 6x as long tile by tile). Tiles of WIDE_ROWS rows, fewer where that would
// leave a thread without 4 of them. A tile's scales are widened to fp32 once (as_f32).
template <typename W, typename S>
static void wide_tiles(const at::Tensor& x, W w, int64_t row_len, S s, S lo,
                       int64_t group, at::Tensor& y) {
  int64_t K = x.size(1), N = y.size(1), G = group ? K / group : 0;
  int64_t rows = std::min<int64_t>(WIDE_ROWS, (N + 4 * at::get_num_threads() - 1) /
                                                  (4 * at::get_num_threads()));
  rows = (rows + 15) / 16 * 16;
  at::ThreadLocalState caller;     // inference mode and the like, for the other threads' products
  at::parallel_for(0, (N + rows - 1) / rows, 1, [&](int64_t t0, int64_t t1) {
    at::ThreadLocalStateGuard same(caller);
    auto tile = at::empty({rows, K}, x.options());
    float* tp = tile.data_ptr<float>();
    std::vector<float> sb, lb;
    for (int64_t t = t0; t < t1; t++) {
      int64_t n0 = t * rows, n1 = std::min(N, n0 + rows);
      const float *sp = s ? as_f32(s + n0 * G, (n1 - n0) * G, sb) : nullptr,
                  *lp = lo ? as_f32(lo + n0 * G, (n1 - n0) * G, lb) : nullptr;
      for (int64_t n = n0; n < n1; n++)
        dequant_row(w + n * row_len, sp ? sp + (n - n0) * G : nullptr,
                    lp ? lp + (n - n0) * G : nullptr, K, group, tp + (n - n0) * K);
      auto out = y.narrow(1, n0, n1 - n0);
      tile_product(out, x, tile.narrow(0, 0, n1 - n0));
    }
  });
}

// ---- A prefill on AMX (Intel's tile unit, Sapphire Rapids and later): groups of 32
// AMX multiplies 16×32 bf16 tiles into 16×16 fp32 ones, ~16x the multiply-adds a cycle of
// AVX-512's fp32 FMAs, but in bf16 (8-bit significands). The file's bits survive it: q (int4's
// 0..15, int8's -128..127, at most 8 significant bits) is exact in bf16, and x is cut into three
// bf16 pieces that sum back to it exactly (x's 24-bit significand, 8 bits a piece, each piece
// what the earlier ones leave, truncated). Each product q·piece is then exact in fp32, so Σ_k q·x
// over a group is a sum of exact terms in AMX's order: 3x the multiply-adds, still ~5x AVX-512's
// fp32 rate. A tile's sums are those of one group of 32 (one scale), so each group's 16×16 block
// leaves the tiles for s·Σqx + lo·Σx in fp32 (the decode loops' grouping). Weights are the tiles'
// A operand (16 rows of W × one group, bf16 in row order), x's pieces the B operand (AMX's pair
// layout: row r holds k = 2r, 2r+1 of 16 tokens). Sums in another order than wide_tiles': a
// prefill's outputs are not compared with a step's, and both are fp32 sums of the same products
// (the tests hold them within fp32's noise).
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__linux__)
#define AMX_TILES 1
#ifndef AMX_ROWS     // fewer rows of x than this: wide_tiles (a token tile pair's padding)
#define AMX_ROWS 32
#endif
// The kernel lets a process use AMX's 8 KB of tile registers once it asks (arch_prctl).
static bool amx_ready() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;    // AMX-BF16, AMX-TILE
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return ok;
}

struct TileConfig {   // LDTILECFG's 64 bytes: palette 1, each tile's rows and bytes a row
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// Tiles 0-7 as 16 rows of 64 bytes, for this thread (by hand, as GCC's tile intrinsics are (asm):
// the file needs no AMX flag).
static void configure_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}
// Tiles 0-3 hold a 32×32 block of sums (below): zeroed, and copied out to c[4][16][16].
static inline void zero_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
static inline void copy_tiles(float (*c)[16][16]) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
}
// The 32 rows' sums (acc: 32 tokens each) += their block of C (c, copied out) times each row's
// number v[row], and where lo is given, + lo[row] times the tokens' Σx (sx0: tokens 0-15, sx1:
// 16-31).
static inline void leave_tiles(const float (*c)[16][16], const float* v, const float* lo,
                               __m512 sx0, __m512 sx1, float* acc) {
  for (int h = 0; h < 2; h++)
    for (int n = 0; n < 16; n++) {
      const __m512 sv = _mm512_set1_ps(v[h * 16 + n]);
      float* a = acc + (h * 16 + n) * 32;
      __m512 a0 = _mm512_fmadd_ps(_mm512_load_ps(c[2 * h][n]), sv, _mm512_load_ps(a));
      __m512 a1 = _mm512_fmadd_ps(_mm512_load_ps(c[2 * h + 1][n]), sv, _mm512_load_ps(a + 16));
      if (lo) {
        const __m512 lv = _mm512_set1_ps(lo[h * 16 + n]);
        a0 = _mm512_fmadd_ps(sx0, lv, a0), a1 = _mm512_fmadd_ps(sx1, lv, a1);
      }
      _mm512_store_ps(a, a0);
      _mm512_store_ps(a + 16, a1);
    }
}
// Tiles 0-3 (rows 0-15 and 16-31 of W by tokens 0-15 and 16-31) += W's two A tiles (w0, w1: 16
// rows × 32 deep each) by x's three pieces of two B tiles (x0, x1: tokens 0-15 and 16-31, each
// piece 512 on).
static inline void tile_products(const uint16_t* w0, const uint16_t* w1, const uint16_t* x0,
                                 const uint16_t* x1) {
  _tile_loadd(4, w0, 64);
  _tile_loadd(5, w1, 64);
  for (int p = 0; p < 3; p++) {
    _tile_loadd(6, x0 + p * 512, 64);
    _tile_loadd(7, x1 + p * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// x's rows t·16 .. t·16+15 (zeros past M), group g: three pieces, each 16 pairs × 16 tokens
// (1 KB, AMX's B layout) at xb + ((t·G + g)·3 + p)·512, and each token's Σx over the group at
// sx + (t·G + g)·16 (sx null: no minimum to take it).
static void split_x(const float* x, int64_t M, int64_t K, int64_t T, uint16_t* xb, float* sx) {
  const int64_t G = K / 32;
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  const __m256i pairs = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);   // dwords apart
  at::parallel_for(0, T * G, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      int64_t t = b / G, g = b % G;
      int* out = reinterpret_cast<int*>(xb + b * 3 * 512);
      for (int m = 0; m < 16; m++) {
        int64_t row = t * 16 + m;
        float sum = 0.f;
        for (int h = 0; h < 2; h++) {
          __m512 v = row < M ? _mm512_loadu_ps(x + row * K + g * 32 + h * 16) : _mm512_setzero_ps();
          if (sx) sum = h == 0 ? _mm512_reduce_add_ps(v) : sum + _mm512_reduce_add_ps(v);
          __m512i p1 = _mm512_and_si512(_mm512_castps_si512(v), top);
          __m512 r1 = _mm512_sub_ps(v, _mm512_castsi512_ps(p1));
          __m512i p2 = _mm512_and_si512(_mm512_castps_si512(r1), top);
          __m512i p3 = _mm512_castps_si512(_mm512_sub_ps(r1, _mm512_castsi512_ps(p2)));
          const __m512i piece[3] = {p1, p2, p3};
          for (int p = 0; p < 3; p++) {      // the top halves: 16 bf16, 8 pairs -> rows 8h..8h+7
            __m256i w = _mm512_cvtepi32_epi16(_mm512_srli_epi32(piece[p], 16));
            _mm256_i32scatter_epi32(out + p * 256 + h * 128 + m, pairs, w, 4);
          }
        }
        if (sx) sx[b * 16 + m] = sum;
      }
    }
  });
}

// nb rows of W as bf16 A tiles: 16 rows × one group, 1 KB each, at wb + ((r/16)·G + g)·512;
// put(r, g, out) writes row r's group g (32 bf16), rows from `rows` on are zero.
template <typename F>
static void widen_rows(int64_t K, int64_t rows, int64_t nb, uint16_t* wb, F put) {
  const int64_t G = K / 32;
  for (int64_t r = 0; r < nb; r++) {
    uint16_t* o = wb + (r / 16) * G * 512 + (r % 16) * 32;
    for (int64_t g = 0; g < G; g++) {
      if (r < rows) put(r, g, o + g * 512);
      else _mm512_storeu_si512(o + g * 512, _mm512_setzero_si512());
    }
  }
}
// A block's 32 int4 values (16 bytes, even k in the low nibble) as 32 bytes in order.
static inline __m256i nibbles32(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p), nib = _mm_set1_epi8(15);
  const __m128i e = _mm_and_si128(b, nib), o = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
  return _mm256_set_m128i(_mm_unpackhi_epi8(e, o), _mm_unpacklo_epi8(e, o));
}
// int4 (two a byte, even k in the low nibble): 0..15 by a table of their bf16 numbers.
static void widen_tiles(Nibbles q, int64_t K, int64_t n0, int64_t rows, int64_t nb,
                        uint16_t* wb) {
  // a table's numbers (8 significant bits at most) are their fp32's top halves
  const __m512i bf16_of = q.tab ? _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(
                                      _mm512_castps_si512(_mm512_loadu_ps(q.tab)), 16)))
                                : _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
      0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0);          // 15.0 ... 1.0, 0
  const uint8_t* w = q.p + n0 * (K / 2);
  widen_rows(K, rows, nb, wb, [&](int64_t r, int64_t g, uint16_t* o) {
    const __m256i v = nibbles32(w + r * (K / 2) + g * 16);
    _mm512_storeu_si512(o, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(v), bf16_of));
  });
}
// int8 values (a byte each, or Sixes; row_len bytes a row): each exact in bf16 (at most 8
// significant bits), its fp32's top half.
template <typename Q>
static void widen_values(Q q, int64_t row_len, int64_t K, int64_t rows, int64_t nb, uint16_t* wb) {
  auto top = [](__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
  };
  widen_rows(K, rows, nb, wb, [&](int64_t r, int64_t g, uint16_t* o) {
    __m512 w0, w1;
    widen32(q + r * row_len, g, w0, w1);
    _mm256_storeu_si256((__m256i*)o, top(w0));
    _mm256_storeu_si256((__m256i*)(o + 16), top(w1));
  });
}
static void widen_tiles(const int8_t* q, int64_t K, int64_t n0, int64_t rows, int64_t nb,
                        uint16_t* wb) {
  widen_values(q + n0 * K, K, K, rows, nb, wb);
}
static void widen_tiles(Sixes q, int64_t K, int64_t n0, int64_t rows, int64_t nb, uint16_t* wb) {
  widen_values(q + n0 * (K / 4 * 3), K / 4 * 3, K, rows, nb, wb);
}

// Blocks of nb rows of W (their bf16 tiles ~1 MB, in L2) in turn per thread; for each pair of
// token tiles (32 rows of x) and each group, 2×2 tiles of 16 rows × 16 tokens: 12 tile products
// (3 pieces), then s·C (+ lo·Σx) into the fp32 sums. Groups of 32 only: groups of 16 (Q6_K)
// would leave the tiles twice as often, and tiles half as deep took as long as wide_tiles
// (amx_folded takes a K-quant's groups of 16).
template <typename W, typename S>
static void amx_tiles(const at::Tensor& x, W w, S s, S lo, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), G = K / 32, T = (M + 31) / 32 * 2;
  auto xbt = at::empty({T * G * 3 * 512}, x.options().dtype(at::kShort));
  const bool sums = bool(lo);     // Σx, for the minimum's share
  auto sxt = at::empty({sums ? T * G * 16 : 0}, x.options());
  uint16_t* xb = reinterpret_cast<uint16_t*>(xbt.data_ptr<int16_t>());
  float *sx = sums ? sxt.data_ptr<float>() : nullptr, *yp = y.data_ptr<float>();
  split_x(x.data_ptr<float>(), M, K, T, xb, sx);
  const int64_t nb = std::max<int64_t>(32, std::min<int64_t>(128, (1 << 20) / (2 * K) / 32 * 32));
  at::parallel_for(0, (N + nb - 1) / nb, 1, [&](int64_t b0, int64_t b1) {
    configure_tiles();
    std::vector<uint16_t> wb(nb * K);
    std::vector<float> sb, lb, sc(nb * G), lc(lo ? nb * G : 0), accv(nb * 32 + 16);
    float* acc = reinterpret_cast<float*>((uintptr_t(accv.data()) + 63) & ~uintptr_t(63));
    alignas(64) float c[4][16][16];
    for (int64_t blk = b0; blk < b1; blk++) {
      const int64_t n0 = blk * nb, rows = std::min(nb, N - n0);
      widen_tiles(w, K, n0, rows, nb, wb.data());
      const float *sp = as_f32(s + n0 * G, rows * G, sb),
                  *lp = lo ? as_f32(lo + n0 * G, rows * G, lb) : nullptr;
      for (int64_t r = 0; r < nb; r++)      // [g][r]: a group's scales in one run
        for (int64_t g = 0; g < G; g++) {
          sc[g * nb + r] = r < rows ? sp[r * G + g] : 0.f;
          if (lp) lc[g * nb + r] = r < rows ? lp[r * G + g] : 0.f;
        }
      for (int64_t t = 0; t < T; t += 2) {
        std::fill(acc, acc + nb * 32, 0.f);
        for (int64_t g = 0; g < G; g++) {
          const uint16_t *x0 = xb + (t * G + g) * 1536, *x1 = xb + ((t + 1) * G + g) * 1536;
          const __m512 sx0 = sx ? _mm512_loadu_ps(sx + (t * G + g) * 16) : _mm512_setzero_ps(),
                       sx1 = sx ? _mm512_loadu_ps(sx + ((t + 1) * G + g) * 16)
                                : _mm512_setzero_ps();
          for (int64_t sub = 0; sub < rows; sub += 32) {
            zero_tiles();
            tile_products(wb.data() + ((sub / 16) * G + g) * 512,
                          wb.data() + ((sub / 16 + 1) * G + g) * 512, x0, x1);
            copy_tiles(c);
            leave_tiles(c, sc.data() + g * nb + sub, lp ? lc.data() + g * nb + sub : nullptr,
                        sx0, sx1, acc + sub * 32);
          }
        }
        for (int64_t r = 0; r < rows; r++)
          for (int64_t u = 0; u < 32 && t * 16 + u < M; u++)
            yp[(t * 16 + u) * N + n0 + r] = acc[r * 32 + u];
      }
    }
    __asm__ volatile("tilerelease");
  });
}

// ---- Groups of 16 on AMX: a K-quant's int8 scale folded into the values (Q6_K, Q3_K, Q2_K)
// A tile's 32 deep would span two groups of 16. But a K-quant's scale is d·sc, sc an int8 per
// group and d one fp16 per 256 weights, and sc·q (int8 values: |sc·q| ≤ 2^14, at most 15
// significant bits) is an integer that two bf16 pieces hold exactly: its top 8 bits, and the rest
// (7 bits at most). The tiles then sum Σ sc·q·x over a whole super-block (2 pieces of W by 3 of
// x: 6 products per 32 deep, each exact, where groups of 32 take 3) and leave once per 256
// weights, for d·C: the same products in another order. A prefill of a Q6_K file took 0.8x as
// long as on the fp32 tiles. A minimum that is the scale times a small integer c (Q3_K's -4:
// derived_minimum) folds in too, as sc·(q + c); Q3_K's |sc·(q - 4)| ≤ 128 fits the first piece
// alone, and a block of rows whose second pieces are all zero skips their products (3 per 32
// deep).
// Block c's 32 int4 values as two vectors of 16 fp32.
static ALWAYS_INLINE void widen32(Nibbles q, int64_t c, __m512& w0, __m512& w1) {
  const __m256i v = nibbles32(q.p + c * 16);
  w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(v)));
  w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1)));
}
// hi, lo: the nb rows' values plus c, times their group's sc, as amx_tiles' A tiles, each in two
// pieces. Returns whether any second piece is not zero.
template <typename Q>
static bool widen_folded(Q q, int64_t row_len, KScales s, float c_min, int64_t K, int64_t n0,
                         int64_t rows, int64_t nb, uint16_t* hi, uint16_t* lo) {
  const int64_t G = K / 32;
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  const __m512 cv = _mm512_set1_ps(c_min);
  auto half = [](__m512i v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)); };
  __m512i rest = _mm512_setzero_si512();
  for (int64_t r = 0; r < nb; r++) {
    const int64_t at = (r / 16) * G * 512 + (r % 16) * 32;
    const int8_t* sc = s.sc + s.at + (n0 + r) * (K / 16);
    for (int64_t c = 0; c < G; c++) {
      uint16_t *h = hi + at + c * 512, *l = lo + at + c * 512;
      if (r >= rows) {
        _mm512_storeu_si512(h, _mm512_setzero_si512());
        _mm512_storeu_si512(l, _mm512_setzero_si512());
        continue;
      }
      __m512 w[2];
      widen32(q + (n0 + r) * row_len, c, w[0], w[1]);
      for (int j = 0; j < 2; j++) {
        const __m512 v = _mm512_mul_ps(_mm512_add_ps(w[j], cv),
                                       _mm512_set1_ps(float(sc[2 * c + j])));
        const __m512i vh = _mm512_and_si512(_mm512_castps_si512(v), top),
                      vl = _mm512_castps_si512(_mm512_sub_ps(v, _mm512_castsi512_ps(vh)));
        rest = _mm512_or_si512(rest, vl);
        _mm256_storeu_si256((__m256i*)(h + 16 * j), half(vh));
        _mm256_storeu_si256((__m256i*)(l + 16 * j), half(vl));
      }
    }
  }
  return _mm512_test_epi32_mask(rest, rest) != 0;
}
// The small integer c for which a K-quant's minimums are its scales times c (the same int8
// numbers, and each super-block's number c times the scale's: Q3_K's -4), else 0 (a minimum of its
// own, as Q2_K's).
static float minimum_multiple(KScales s, KScales lo, int64_t N, int64_t K) {
  const int64_t groups = N * (K / 16), blocks = groups >> s.shift;
  if (lo.shift != s.shift || lo.at != s.at ||
      (lo.sc != s.sc && std::memcmp(lo.sc + lo.at, s.sc + s.at, groups) != 0))
    return 0.f;
  float c = 0.f;
  for (int64_t u = 0; u < blocks; u++) {
    const float d = f32(s.d[(s.at >> s.shift) + u]), m = f32(lo.d[(lo.at >> lo.shift) + u]);
    if (d == 0.f) {
      if (m != 0.f) return 0.f;
      continue;
    }
    if (c == 0.f) c = m / d;
    if (m != c * d) return 0.f;
  }
  return c == std::nearbyint(c) && std::fabs(c) <= 16.f ? c : 0.f;
}
// A minimum of its own (Q2_K's -dmin·m: lo, c_min 0) is added after the tiles: its share is
// Σ_g lo_g·Σx_g over the row's groups, as the decode loops' lo_share sums it: one fp32 product of
// x's group sums (group_sums) by the minimums, K/16 deep, a sixteenth of the values' products.
template <typename Q>
static void amx_folded(const at::Tensor& x, Q w, int64_t row_len, KScales s, KScales lo,
                       float c_min, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), G = K / 32, T = (M + 31) / 32 * 2;
  auto xbt = at::empty({T * G * 3 * 512}, x.options().dtype(at::kShort));
  uint16_t* xb = reinterpret_cast<uint16_t*>(xbt.data_ptr<int16_t>());
  float* yp = y.data_ptr<float>();
  split_x(x.data_ptr<float>(), M, K, T, xb, nullptr);
  // W's two pieces in ~2 MB (a core's L2)
  const int64_t nb = std::max<int64_t>(32, std::min<int64_t>(128, (2 << 20) / (4 * K) / 32 * 32));
  at::parallel_for(0, (N + nb - 1) / nb, 1, [&](int64_t b0, int64_t b1) {
    configure_tiles();
    std::vector<uint16_t> wh(nb * K), wl(nb * K);
    std::vector<float> ds(nb * (K / 256)), accv(nb * 32 + 16);
    float* acc = reinterpret_cast<float*>((uintptr_t(accv.data()) + 63) & ~uintptr_t(63));
    alignas(64) float c[4][16][16];
    for (int64_t blk = b0; blk < b1; blk++) {
      const int64_t n0 = blk * nb, rows = std::min(nb, N - n0);
      const int pieces = widen_folded(w, row_len, s, c_min, K, n0, rows, nb, wh.data(), wl.data())
                             ? 2 : 1;
      for (int64_t u = 0; u < K / 256; u++)     // [super-block][row]: its d, 0 past the rows
        for (int64_t r = 0; r < nb; r++)
          ds[u * nb + r] = r < rows ? f32(s.d[(s.at >> s.shift) + (n0 + r) * (K / 256) + u]) : 0.f;
      for (int64_t t = 0; t < T; t += 2) {
        std::fill(acc, acc + nb * 32, 0.f);
        for (int64_t u = 0; u < K / 256; u++)
          for (int64_t sub = 0; sub < rows; sub += 32) {
            zero_tiles();
            for (int64_t g = u * 8; g < u * 8 + 8; g++) {
              const uint16_t *x0 = xb + (t * G + g) * 1536, *x1 = xb + ((t + 1) * G + g) * 1536;
              for (int k = 0; k < pieces; k++) {
                const uint16_t* piece = k ? wl.data() : wh.data();
                tile_products(piece + ((sub / 16) * G + g) * 512,
                              piece + ((sub / 16 + 1) * G + g) * 512, x0, x1);
              }
            }
            copy_tiles(c);
            const __m512 none = _mm512_setzero_ps();
            leave_tiles(c, ds.data() + u * nb + sub, nullptr, none, none, acc + sub * 32);
          }
        for (int64_t r = 0; r < rows; r++)
          for (int64_t v = 0; v < 32 && t * 16 + v < M; v++)
            yp[(t * 16 + v) * N + n0 + r] = acc[r * 32 + v];
      }
    }
    __asm__ volatile("tilerelease");
  });
  if (lo && c_min == 0.f) {
    const int64_t G16 = K / 16;
    auto sums = at::empty({M, G16}, x.options()), mins = at::empty({N, G16}, x.options());
    for (int64_t m = 0; m < M; m++)
      group_sums(x.data_ptr<float>() + m * K, K, 16, sums.data_ptr<float>() + m * G16);
    widen_scales(lo, N * G16, mins.data_ptr<float>());
    y.addmm_(sums, mins.t());
  }
}
#endif

// w: int8 (N, K) with scale (N,) or (N, K/group) and lo None or as scale (or those values in six
// bits: uint8 (N, 3K/4), Sixes); int4 bytes (N, K/2) with scale and lo (N, K/group); fp16 or bf16
// (N, K) alone. amx: int4 or int8 values in groups of 32 on the tile unit where this CPU has one
// and x has AMX_ROWS rows (amx_tiles: the same products, summed in another order), and int4 or
// int8 values in groups of 16 with a K-quant's scales (amx_folded), else the tiles above.
static at::Tensor wide_mm(const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& s_, const std::optional<at::Tensor>& lo_,
                          int64_t group, const std::optional<at::Tensor>& sd,
                          const std::optional<at::Tensor>& lod, bool amx,
                          const std::optional<at::Tensor>& values) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && w.dim() == 2 &&
              w.is_contiguous() && x.size(1) % 32 == 0,
              "wide_mm: x (M, K) fp32, K a multiple of 32, w (N, ·) contiguous");
  int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  auto type = w.scalar_type();
  if (type == at::kHalf || type == at::kBFloat16) {
    TORCH_CHECK(w.size(1) == K, "wide_mm: w (N, K)");
    const float* none = nullptr;
    if (type == at::kHalf) wide_tiles(x, w.data_ptr<c10::Half>(), K, none, none, 0, y);
    else wide_tiles(x, w.data_ptr<c10::BFloat16>(), K, none, none, 0, y);
    return y;
  }
  TORCH_CHECK(s_.has_value() && s_->defined() && s_->size(0) == N,
              "wide_mm: a scale (N,) or (N, K/group)");
  const at::Tensor& s = *s_;
  const bool has_lo = lo_.has_value() && lo_->defined();
  if (s.dim() == 1) group = K;
  TORCH_CHECK(group > 0 && group % 16 == 0 && K % group == 0 && s.numel() == N * (K / group),
              "wide_mm: scale (N, K/group), group a multiple of 16");
  const bool six = type == at::kByte && w.size(1) * 4 == K * 3;   // int8 values in six bits
  if (type == at::kChar) {
    TORCH_CHECK(w.size(1) == K, "wide_mm: int8 w (N, K)");
  } else if (!six) {
    TORCH_CHECK(type == at::kByte && w.size(1) * 2 == K,
                "wide_mm: int4 w (N, K/2) with scale (lo, values), or six-bit int8 (N, 3K/4)");
  }
  TORCH_CHECK(!values.has_value() || !values->defined() || (type == at::kByte && !six),
              "wide_mm: values are an int4 w's");
  const Nibbles wn{static_cast<const uint8_t*>(w.data_ptr()),
                   type == at::kByte ? nibble_table(values, "wide_mm") : nullptr};
  TORCH_CHECK(!six || s.dim() == 2, "wide_mm: six-bit values come in groups");
  auto run = [&](auto sp, auto lp) {
#ifdef AMX_TILES
    if constexpr (std::is_same_v<decltype(sp), KScales>) {
      if (amx && M >= AMX_ROWS && group == 16 && amx_ready() &&
          (type == at::kChar || six || !wn.tab)) {
        const float c = lp ? minimum_multiple(sp, lp, N, K) : 0.f;
        if (type == at::kChar) amx_folded(x, w.data_ptr<int8_t>(), K, sp, lp, c, y);
        else if (six) amx_folded(x, Sixes{w.data_ptr<uint8_t>()}, K / 4 * 3, sp, lp, c, y);
        else amx_folded(x, wn, K / 2, sp, lp, c, y);
        return;
      }
    }
    if (amx && M >= AMX_ROWS && group == 32 && amx_ready()) {
      if (type == at::kChar) amx_tiles(x, w.data_ptr<int8_t>(), sp, lp, y);
      else if (six) amx_tiles(x, Sixes{w.data_ptr<uint8_t>()}, sp, lp, y);
      else amx_tiles(x, wn, sp, lp, y);
      return;
    }
#endif
    if (type == at::kChar) wide_tiles(x, w.data_ptr<int8_t>(), K, sp, lp, group, y);
    else if (six) wide_tiles(x, Sixes{w.data_ptr<uint8_t>()}, K / 4 * 3, sp, lp, group, y);
    else wide_tiles(x, wn, K / 2, sp, lp, group, y);
  };
  with_scales(s, lo_, sd, lod, group, "wide_mm", run);
  return y;
}

// ---- One new token's attention over L cached keys (kernels.py: decode_attention) ----
// softmax(q·kᵀ/√d)·v for each query head; the H/H_kv query heads of a group read their K/V head
// once. Keys go in chunks of 64 (flash-decoding): each chunk keeps its max, its sum of exponentials
// and its weighted sum of V, and the chunks merge in their order, so the sums do not depend on the
// threads.
#define CHUNK 64

#if defined(__AVX2__) && defined(__FMA__)
// Eight dot products reduced into one vector: lane t = Σ a[t]'s lanes.
static inline __m256 reduce8(const __m256* a) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
// Eight keys' or values' entries as fp32: a bf16 cache's widened by a shift (bf16 is fp32's upper
// half).
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) { return bf16x8(p); }
// s[j] = q·k_j · scale for n keys, eight at a time (a tail repeats the last key; s has room). key(j):
// where key j's d entries lie (a row of a contiguous cache, or a slot of a paged pool's block).
template <typename Row>
static inline void scores(const float* q, Row key, int64_t n, int64_t d, float scale, float* s) {
  for (int64_t j = 0; j < n; j += 8) {
    __m256 a[8];
    for (int t = 0; t < 8; t++) {
      auto kj = key(std::min(j + t, n - 1));
      a[t] = _mm256_mul_ps(_mm256_loadu_ps(q), load8(kj));
      for (int64_t i = 8; i < d; i += 8)
        a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(kj + i), a[t]);
    }
    _mm256_storeu_ps(s + j, _mm256_mul_ps(reduce8(a), _mm256_set1_ps(scale)));
  }
}
// e^x for x ≤ 0, 8 lanes: x = n·ln2 + r, e^r by Cephes' degree-6 polynomial (~1 ulp), 2^n in the
// exponent.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
// p[j] = e^(s[j] - m) in place for n ≤ CHUNK scores (a masked key's s is -inf: p 0); returns Σp.
static inline float exp_sum(float* s, float m, int64_t n) {
  __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY), acc = _mm256_setzero_ps();
  for (int64_t j = n; j < (n + 7) / 8 * 8; j++) s[j] = -INFINITY;
  for (int64_t j = 0; j < n; j += 8) {
    __m256 x = _mm256_loadu_ps(s + j);
    __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(x, vm)), _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
    _mm256_storeu_ps(s + j, p);
    acc = _mm256_add_ps(acc, p);
  }
  return hsum8(acc);
}
// o = Σ_j p_j·v_j, 64 columns at a time in 8 registers (a chain of FMAs per register, no stores).
template <typename Row>
static inline void weighted_v(const float* p, Row val, int64_t n, int64_t d, float* o) {
  int64_t i0 = 0;
  for (; i0 + 64 <= d; i0 += 64) {
    __m256 acc[8];
    for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
      __m256 pj = _mm256_set1_ps(p[j]);
      for (int t = 0; t < 8; t++)
        acc[t] = _mm256_fmadd_ps(pj, load8(val(j) + i0 + 8 * t), acc[t]);
    }
    for (int t = 0; t < 8; t++) _mm256_storeu_ps(o + i0 + 8 * t, acc[t]);
  }
  for (; i0 < d; i0 += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(val(j) + i0), acc);
    _mm256_storeu_ps(o + i0, acc);
  }
}
#else
template <typename Row>
static inline void scores(const float* q, Row key, int64_t n, int64_t d, float scale, float* s) {
  for (int64_t j = 0; j < n; j++) {
    float a = 0.f;
    auto kj = key(j);
    for (int64_t i = 0; i < d; i++) a = std::fma(q[i], float(kj[i]), a);
    s[j] = a * scale;
  }
}
static inline float exp_sum(float* s, float m, int64_t n) {
  float acc = 0.f;
  for (int64_t j = 0; j < n; j++) acc += (s[j] = s[j] == -INFINITY ? 0.f : std::exp(s[j] - m));
  return acc;
}
template <typename Row>
static inline void weighted_v(const float* p, Row val, int64_t n, int64_t d, float* o) {
  for (int64_t i = 0; i < d; i++) o[i] = 0.f;
  for (int64_t j = 0; j < n; j++) {
    auto vj = val(j);
    for (int64_t i = 0; i < d; i++) o[i] = std::fma(p[j], float(vj[i]), o[i]);
  }
}
#endif

// One query token per batch row against its keys, in chunks of CHUNK: row b reads keys [0, len(b));
// rows(b, h, j0, n, kr, vr) says where keys j0 ... j0 + n - 1 of KV head h lie (kr[j], vr[j]: key
// j0 + j's K and V rows), a chunk at a time, so a paged pool finds each block once, not each key;
// keep(b, j) masks.
// A chunk past a row's length, or masked whole, is left out of the merge, as a chunk of -inf
// scores would be. q (B, H, 1, d) fp32; the result (B, H, 1, d) fp32.
template <typename T, typename Len, typename Rows, typename Keep>
static at::Tensor attend_chunks(const at::Tensor& q, int64_t Hkv, int64_t L, Len len, Rows rows,
                                Keep keep) {
  int64_t B = q.size(0), H = q.size(1), d = q.size(3), G = H / Hkv;
  int64_t chunks = (L + CHUNK - 1) / CHUNK, units = B * Hkv * chunks;
  std::vector<float> part(units * G * (d + 2));        // per unit and head: max, sum, Σ p·v (d)
  const float* qp = q.data_ptr<float>();
  float scale = 1.f / std::sqrt(float(d));
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> s(G * (CHUNK + 8));
    for (int64_t u = u0; u < u1; u++) {
      int64_t b = u / (Hkv * chunks), h = u / chunks % Hkv, j0 = u % chunks * CHUNK,
              n = std::min<int64_t>(CHUNK, len(b) - j0);
      const float* qg = qp + (b * H + h * G) * d;
      // the chunk's rows found once for its G query heads
      const T *kr[CHUNK], *vr[CHUNK];
      if (n > 0) rows(b, h, j0, n, kr, vr);
      auto key = [&](int64_t j) { return kr[j]; };
      auto val = [&](int64_t j) { return vr[j]; };
      for (int64_t g = 0; g < G; g++) {
        float* sg = s.data() + g * (CHUNK + 8);
        float* out = part.data() + (u * G + g) * (d + 2);
        float m = -INFINITY;
        if (n > 0) {
          scores(qg + g * d, key, n, d, scale, sg);
          for (int64_t j = 0; j < n; j++) sg[j] = keep(b, j0 + j) ? sg[j] : -INFINITY;
          for (int64_t j = 0; j < n; j++) m = std::max(m, sg[j]);
        }
        out[0] = m;
        out[1] = m == -INFINITY ? 0.f : exp_sum(sg, m, n);
        if (m == -INFINITY) std::fill(out + 2, out + 2 + d, 0.f);
        else weighted_v(sg, val, n, d, out + 2);
      }
    }
  });
  auto y = at::empty({B, H, 1, d}, q.options());
  float* yp = y.data_ptr<float>();
  // merge the chunks in order: e^(m_c - M) weights
  for (int64_t bh = 0; bh < B * Hkv; bh++)
    for (int64_t g = 0; g < G; g++) {
      float M = -INFINITY, l = 0.f, *o = yp + (bh * G + g) * d;
      for (int64_t c = 0; c < chunks; c++)
        M = std::max(M, part[((bh * chunks + c) * G + g) * (d + 2)]);
      std::fill(o, o + d, 0.f);
      for (int64_t c = 0; c < chunks; c++) {
        const float* pc = part.data() + ((bh * chunks + c) * G + g) * (d + 2);
        if (pc[0] == -INFINITY) continue;
        float w = std::exp(pc[0] - M);
        l += w * pc[1];
        for (int64_t i = 0; i < d; i++) o[i] = std::fma(w, pc[2 + i], o[i]);
      }
      for (int64_t i = 0; i < d; i++) o[i] = l > 0.f ? o[i] / l : 0.f;
    }
  return y;
}

// q (B, H, 1, d); k, v (B, H_kv, L, d), any strides but d's; mask None or bool, L (all batches) or
// B·L. K and V fp32 or bf16 (read as stored, summed in fp32); q and the result in K's dtype.
template <typename T>
static at::Tensor attend_one(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& mask) {
  at::Tensor q = q_.to(at::kFloat).contiguous();
  int64_t B = q.size(0), H = q.size(1), d = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == d && H % Hkv == 0 && d % 8 == 0 && L > 0,
              "decode_attention: shapes");
  const bool* mp = nullptr;
  int64_t mb = 0;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() &&
                (mask->numel() == L || mask->numel() == B * L),
                "decode_attention: mask bool, L or B·L");
    mp = mask->data_ptr<bool>();
    mb = mask->numel() == L ? 0 : L;
  }
  const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  int64_t sk = k.stride(2), sv = v.stride(2), kb0 = k.stride(0), kb1 = k.stride(1),
          vb0 = v.stride(0), vb1 = v.stride(1);
  auto y = attend_chunks<T>(
      q, Hkv, L, [&](int64_t) { return L; },
      [&](int64_t b, int64_t h, int64_t j0, int64_t n, const T** kr, const T** vr) {
        const T *k0 = kp + b * kb0 + h * kb1 + j0 * sk, *v0 = vp + b * vb0 + h * vb1 + j0 * sv;
        for (int64_t j = 0; j < n; j++) kr[j] = k0 + j * sk, vr[j] = v0 + j * sv;
      },
      [&](int64_t b, int64_t j) { return !mp || mp[b * mb + j]; });
  return y.to(q_.scalar_type());
}
static at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::optional<at::Tensor>& mask) {
  auto type = k.scalar_type();
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && k.dim() == 4 && v.sizes() == k.sizes() &&
              q.scalar_type() == type && v.scalar_type() == type &&
              (type == at::kFloat || type == at::kBFloat16),
              "decode_attention: q (B, H, 1, d), k and v (B, H_kv, L, d), all fp32 or all bf16");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k and v contiguous along d");
  return type == at::kFloat ? attend_one<float>(q, k, v, mask)
                            : attend_one<c10::BFloat16>(q, k, v, mask);
}

// One query token per batch row against a paged pool, read where it lies (kernels.py:
// paged_attention): k, v [blocks, block_size, H_kv, d], one layer's, this step's K/V written;
// tables (B, n) int64 block ids; positions (B,) int64, each row's query position. Row b reads its
// keys 0 ... positions[b], key j in block tables[b][j / block_size], slot j % block_size; window > 0
// keeps only the last `window` of them. The bits of decode_attention on the same keys gathered into
// a padded copy under attention_mask's positional mask: the same chunks, in the same order.
template <typename T>
static at::Tensor attend_paged(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& tables, const at::Tensor& positions,
                               int64_t window) {
  at::Tensor q = q_.to(at::kFloat).contiguous();
  // read through their strides: an engine's tables and positions are columns of one tensor, every
  // layer's, and a copy of its padded tables per layer would cost more than the rows read
  at::Tensor tab = tables.to(at::kLong), pos = positions.to(at::kLong);
  int64_t B = q.size(0), H = q.size(1), d = q.size(3), bs = k.size(1), Hkv = k.size(2),
          n = tab.size(1), L = n * bs, ts = tab.stride(0), tc = tab.stride(1), ps = pos.stride(0);
  TORCH_CHECK(k.size(3) == d && H % Hkv == 0 && d % 8 == 0 && n > 0 && tab.size(0) == B &&
              pos.dim() == 1 && pos.size(0) == B, "paged_attention: shapes");
  const int64_t *tab0 = tab.data_ptr<int64_t>(), *pos0 = pos.data_ptr<int64_t>();
  std::vector<int64_t> pp(B);
  int64_t longest = 0;       // the chunks past every row's position are not visited
  for (int64_t b = 0; b < B; b++) {
    pp[b] = pos0[b * ps];
    TORCH_CHECK(0 <= pp[b] && pp[b] < L, "paged_attention: a position beyond its table");
    longest = std::max(longest, pp[b] + 1);
    for (int64_t i = 0; i <= pp[b] / bs; i++)        // the blocks this row reads
      TORCH_CHECK(0 <= tab0[b * ts + i * tc] && tab0[b * ts + i * tc] < k.size(0),
                  "paged_attention: a block id beyond the pool");
  }
  auto tp = [&](int64_t b, int64_t i) { return tab0[b * ts + i * tc]; };
  const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  int64_t kblk = k.stride(0), kslot = k.stride(1), kh = k.stride(2), vblk = v.stride(0),
          vslot = v.stride(1), vh = v.stride(2);
  auto y = attend_chunks<T>(
      q, Hkv, longest, [&](int64_t b) { return pp[b] + 1; },
      [&](int64_t b, int64_t h, int64_t j0, int64_t n, const T** kr, const T** vr) {
        for (int64_t j = 0; j < n;) {       // a block's run of slots at a time
          int64_t key = j0 + j, blk = tp(b, key / bs), slot = key % bs,
                  run = std::min(n - j, bs - slot);
          const T *k0 = kp + blk * kblk + slot * kslot + h * kh,
                  *v0 = vp + blk * vblk + slot * vslot + h * vh;
          for (int64_t i = 0; i < run; i++, j++) kr[j] = k0 + i * kslot, vr[j] = v0 + i * vslot;
        }
      },
      [&](int64_t b, int64_t j) { return window <= 0 || j > pp[b] - window; });
  return y.to(q_.scalar_type());
}
static at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& tables, const at::Tensor& positions,
                                  int64_t window) {
  auto type = k.scalar_type();
  // a bf16 pool under an fp32 model: its keys widen exactly, as the gather's copy widens them
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && k.dim() == 4 && v.sizes() == k.sizes() &&
              (q.scalar_type() == type || q.scalar_type() == at::kFloat) &&
              v.scalar_type() == type && (type == at::kFloat || type == at::kBFloat16) &&
              tables.dim() == 2,
              "paged_attention: q (B, H, 1, d), k and v [blocks, block_size, H_kv, d], fp32 or "
              "bf16 (q fp32 or as k), tables (B, n)");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "paged_attention: k and v contiguous along d");
  return type == at::kFloat ? attend_paged<float>(q, k, v, tables, positions, window)
                            : attend_paged<c10::BFloat16>(q, k, v, tables, positions, window);
}

// The library's name: nanoinfer, or another for a second build in the same process (the tests
// build this file for AVX2 and for no SIMD as well, and compare their bits).
#ifndef LIBRARY
#define LIBRARY nanoinfer
#endif
#define DEFINE(ns, m) TORCH_LIBRARY(ns, m)
DEFINE(LIBRARY, m) {
  // scale_d, lo_d: a K-quant's super-block numbers (KScales), with int8 scale and lo
  // values: the 16 numbers an int4 nibble stands for (None: 0..15)
  m.def("int4_mm(Tensor x, Tensor q, Tensor scale, Tensor? lo, int group, Tensor? scale_d=None, "
        "Tensor? lo_d=None, Tensor? values=None) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("int8g_mm(Tensor x, Tensor q, Tensor scale, Tensor? lo, int group, Tensor? scale_d=None, "
        "Tensor? lo_d=None) -> Tensor");
  m.def("int4_x8_mm(Tensor x, Tensor q, Tensor scale, Tensor lo, int group, "
        "Tensor? scale_d=None, Tensor? lo_d=None) -> Tensor");
  m.def("int8g_x8_mm(Tensor x, Tensor q, Tensor scale, Tensor? lo, int group, "
        "Tensor? scale_d=None, Tensor? lo_d=None) -> Tensor");
  m.def("half_mm(Tensor x, Tensor w) -> Tensor");
  m.def("wide_mm(Tensor x, Tensor w, Tensor? scale, Tensor? lo, int group, Tensor? scale_d=None, "
        "Tensor? lo_d=None, bool amx=False, Tensor? values=None) -> Tensor");
  m.def("bf16_mm(Tensor x, Tensor w) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor tables, Tensor positions, "
        "int window) -> Tensor");
}
TORCH_LIBRARY_IMPL(LIBRARY, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
  m.impl("int8g_mm", &int8g_mm);
  m.impl("int4_x8_mm", &int4_x8_mm);
  m.impl("int8g_x8_mm", &int8g_x8_mm);
  m.impl("half_mm", &half_mm);
  m.impl("wide_mm", &wide_mm);
  m.impl("bf16_mm", &bf16_mm);
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_attention", &paged_attention);
}
