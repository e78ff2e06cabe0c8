// q4_1 linear layer for x86 CPUs with AVX2: 4-bit weights in blocks of 32 (a scale and a minimum each, GGUF's
// Q4_1), activations rounded per block of 32 to 8-bit codes, dot products of the codes in integers
// (the arithmetic llama.cpp uses for Q4_1 x Q8_1 on a CPU). Loaded by specula/kernels/q4_1.py.
//
// y[i, n] = sum_b  d[n, b] * dx[i, b] * sum_j qw[n, b, j] * qx[i, b, j]  +  m[n, b] * sx[i, b]
//   weights  w[n, 32b + j] = qw * d + m, qw in 0..15;
//   inputs   dx = max|x_block| / 127, qx = round-half-even(x * 127 / max|x_block|), sx = dx * sum_j qx.
//
// Layout: outputs go in groups of 8, one per 32-bit vector lane, so a block's eight dot products come out
// of the integer units already side by side (no horizontal sums). For group g and block b, packed[g, b] is
// 4 x 32 bytes; byte 4o + t of vector p holds, in its low nibble, qw of output 8g + o at input 8p + t of the
// block and, in its high nibble, the one at input 8p + 4 + t. scales[g, b] is d of the 8 outputs then m, in
// float32, or in float16 where that holds them exactly (a GGUF file's own Q4_1 blocks): a quarter fewer bytes
// to read per weight, and one token's step is bound by reading the weights.
// One step multiplies 4 inputs of a row (broadcast to every lane) by the 8 outputs' 4 codes (maddubs) and
// adds the pairs into int16 lanes: 8 steps per block stay exact in int16 (|sum| <= 16 * 15 * 127 < 2^15).
//
// Every output of a row is computed from that row alone by the same instruction sequence whatever M is and
// whichever rows share its tile, so a row's result does not depend on how many rows are in the call (a
// k-token verify pass and a one-token step agree bit for bit in this layer): per lane, float32
// acc <- fma(block sum, d * dx, acc) and acc_m <- fma(m, sx, acc_m), block after block, then y = acc + acc_m.
//
// On a CPU with AVX-512 VNNI, two groups (16 outputs) share one 512-bit vector and each step's products are
// summed into int32 lanes by one vpdpbusd instead of maddubs + add. The block sums are the same integers
// (exact either way), and every float operation per lane is the AVX2 one in the same order, so both paths
// give the same bits; the layout is the same, and an AVX2 machine runs this build's AVX2 path.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kLanes = 8;       // outputs per group
constexpr int64_t kRowChunk = 32;   // rows whose codes stay in L1 while a thread's groups read them
constexpr int64_t kRowTile = 4;     // rows sharing one unpacked weight vector
// Blocks of a group's weights and scales prefetched ahead of the one being multiplied. A group's row of K / 32
// blocks is short (18 blocks, 2.3 KB, for K = 576) and the next group's follows it, too short a stream for the
// hardware prefetcher to ramp up on. Measured on an Intel Xeon (AVX-512), SmolLM2 compiled q4_1 steps after a
// 300-token prefix, interleaved: 1 / 2 / 4 tokens 8.35 / 10.14 / 12.63 ms without, 7.36 / 8.32 / 9.31 ms with
// 64 blocks (8 KB of weights) ahead; 32 blocks 7.82 / 8.81 / 10.24 without the scales, 128 no better.
constexpr int64_t kAhead = 64;
constexpr size_t kScratchBytes = size_t{1} << 20;  // codes kept between calls: 64 rows of 16,384 inputs

inline __m256i round_to_int(__m256 v) {
  return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Rounds each block of 32 inputs of x [M, K] to int8 codes q [M, K], with dx, sx [M, K / 32].
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, float* sx) {
  const int64_t blocks = K / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + i * K + b * kBlock;
      const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
      const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
      const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      float amax = _mm_cvtss_f32(h);
      // max_ps drops a NaN depending on its lane: look for one, and let it make the block's scales NaN, so a
      // NaN input gives NaN outputs (as a float matmul would) instead of large finite numbers.
      const __m256 unordered = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q),
                                                         _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)),
                                            _mm256_or_ps(_mm256_cmp_ps(v2, v2, _CMP_UNORD_Q),
                                                         _mm256_cmp_ps(v3, v3, _CMP_UNORD_Q)));
      const bool has_nan = _mm256_movemask_ps(unordered) != 0;
      if (has_nan) amax = 0.0f;  // codes 0 below; the NaN goes into dx and sx
      const __m256 inv = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
      const __m256i i0 = round_to_int(_mm256_mul_ps(v0, inv)), i1 = round_to_int(_mm256_mul_ps(v1, inv));
      const __m256i i2 = round_to_int(_mm256_mul_ps(v2, inv)), i3 = round_to_int(_mm256_mul_ps(v3, inv));
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      s4 = _mm_hadd_epi32(s4, s4);
      const float d = has_nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
      dx[i * blocks + b] = d;
      sx[i * blocks + b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
      // The packs interleave 128-bit lanes; the permutation puts the 32 codes back in input order.
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * K + b * kBlock),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
  }
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i broadcast4(const int8_t* codes) {  // 4 input codes repeated in every 32-bit lane
  int32_t four;
  std::memcpy(&four, codes, sizeof(four));
  return _mm256_set1_epi32(four);
}

template <typename S>
inline void prefetch_block(const uint8_t* weights, const S* scales) {  // one group's block: 128 + 32 or 64 bytes
  _mm_prefetch(reinterpret_cast<const char*>(weights), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(weights + 64), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales), _MM_HINT_T0);
}

// The 8 outputs of group g for rows i0 .. i0 + R - 1, written to out[r * out_stride + o].
template <int R, typename S>
inline void group_rows(const uint8_t* packed, const S* scales, const int8_t* q, const float* dx,
                       const float* sx, int64_t g, int64_t i0, int64_t K, float* out, int64_t out_stride) {
  const int64_t blocks = K / kBlock;
  const uint8_t* wg = packed + g * blocks * 4 * 32;
  const S* sg = scales + g * blocks * 2 * kLanes;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R], acc_m[R];  // the scale terms and the minimum terms: two chains of dependent adds, not one
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = acc_m[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_block(wg + (b + kAhead) * 4 * 32, sg + (b + kAhead) * 2 * kLanes);  // never faults, even past the end
    __m256i sums[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (b * 4 + p) * 32));
      const __m256i w0 = _mm256_and_si256(raw, low_nibbles);
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_nibbles);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = q + (i0 + r) * K + b * kBlock + p * 8;
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(w0, broadcast4(xb)));
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(w1, broadcast4(xb + 4)));
      }
    }
    const __m256 d8 = load8(sg + b * 2 * kLanes), m8 = load8(sg + b * 2 * kLanes + kLanes);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const __m256 block_sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));
      acc[r] = _mm256_fmadd_ps(block_sum, _mm256_mul_ps(d8, _mm256_set1_ps(dx[i * blocks + b])), acc[r]);
      acc_m[r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(sx[i * blocks + b]), acc_m[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * out_stride, _mm256_add_ps(acc[r], acc_m[r]));
}

#define SPECULA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

SPECULA_AVX512 inline __m512 load16(const float* first, const float* second) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(first)), _mm256_loadu_ps(second), 1);
}
SPECULA_AVX512 inline __m512 load16(const at::Half* first, const at::Half* second) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(load8(first)), load8(second), 1);
}

// The 16 outputs of groups g and g + 1 for rows i0 .. i0 + R - 1 (as group_rows, lanes 8..15 for group g + 1).
template <int R, typename S>
SPECULA_AVX512 inline void pair_rows(const uint8_t* packed, const S* scales, const int8_t* q, const float* dx,
                                     const float* sx, int64_t g, int64_t i0, int64_t K, float* out,
                                     int64_t out_stride) {
  const int64_t blocks = K / kBlock;
  const uint8_t* wg = packed + g * blocks * 4 * 32;
  const uint8_t* wh = wg + blocks * 4 * 32;
  const S* sg = scales + g * blocks * 2 * kLanes;
  const S* sh = sg + blocks * 2 * kLanes;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[R], acc_m[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = acc_m[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_block(wg + (b + kAhead) * 4 * 32, sg + (b + kAhead) * 2 * kLanes);  // never faults, even past the end
    prefetch_block(wh + (b + kAhead) * 4 * 32, sh + (b + kAhead) * 2 * kLanes);
    __m512i sums[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const int64_t at = (b * 4 + p) * 32;
      const __m512i raw = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + at))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh + at)), 1);
      const __m512i w0 = _mm512_and_si512(raw, low_nibbles);
      const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_nibbles);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = q + (i0 + r) * K + b * kBlock + p * 8;
        int32_t four0, four1;
        std::memcpy(&four0, xb, sizeof(four0));
        std::memcpy(&four1, xb + 4, sizeof(four1));
        sums[r] = _mm512_dpbusd_epi32(sums[r], w0, _mm512_set1_epi32(four0));
        sums[r] = _mm512_dpbusd_epi32(sums[r], w1, _mm512_set1_epi32(four1));
      }
    }
    const __m512 d16 = load16(sg + b * 2 * kLanes, sh + b * 2 * kLanes);
    const __m512 m16 = load16(sg + b * 2 * kLanes + kLanes, sh + b * 2 * kLanes + kLanes);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const __m512 block_sum = _mm512_cvtepi32_ps(sums[r]);
      acc[r] = _mm512_fmadd_ps(block_sum, _mm512_mul_ps(d16, _mm512_set1_ps(dx[i * blocks + b])), acc[r]);
      acc_m[r] = _mm512_fmadd_ps(m16, _mm512_set1_ps(sx[i * blocks + b]), acc_m[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride, _mm512_add_ps(acc[r], acc_m[r]));
}

// The G * 8 outputs of groups g .. g + G - 1 (G = 1: the AVX2 path, G = 2: the AVX-512 one) for rows
// i0 .. i0 + R - 1, written to y; when the last of them is N's partial group, through a tile whose padding
// lanes are dropped.
template <int G, int R, typename S>
inline void write_groups(const uint8_t* packed, const S* scales, const int8_t* q, const float* dx,
                         const float* sx, int64_t g, int64_t i0, int64_t K, float* y, int64_t N) {
  constexpr int64_t width = G * kLanes;
  const auto rows = [&](float* out, int64_t out_stride) {
    if constexpr (G == 1) {
      group_rows<R, S>(packed, scales, q, dx, sx, g, i0, K, out, out_stride);
    } else {
      pair_rows<R, S>(packed, scales, q, dx, sx, g, i0, K, out, out_stride);
    }
  };
  const int64_t n0 = g * kLanes;
  if (n0 + width <= N) {
    rows(y + i0 * N + n0, N);
    return;
  }
  float tile[R * width];
  rows(tile, width);
  for (int r = 0; r < R; ++r) std::memcpy(y + (i0 + r) * N + n0, tile + r * width, (N - n0) * sizeof(float));
}

// Groups g .. g + G - 1 for rows c0 .. c1 - 1: tiles of 4 rows, then one of 3, 2 or 1.
template <int G, typename S>
void row_tiles(const uint8_t* packed, const S* scales, const int8_t* q, const float* dx, const float* sx,
               int64_t g, int64_t c0, int64_t c1, int64_t K, float* y, int64_t N) {
  int64_t i0 = c0;
  for (; i0 + kRowTile <= c1; i0 += kRowTile) write_groups<G, 4, S>(packed, scales, q, dx, sx, g, i0, K, y, N);
  switch (c1 - i0) {
    case 3: write_groups<G, 3, S>(packed, scales, q, dx, sx, g, i0, K, y, N); break;
    case 2: write_groups<G, 2, S>(packed, scales, q, dx, sx, g, i0, K, y, N); break;
    case 1: write_groups<G, 1, S>(packed, scales, q, dx, sx, g, i0, K, y, N); break;
    default: break;
  }
}

bool cpu_has_avx512_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

std::atomic<bool> use_avx512{cpu_has_avx512_vnni()};

template <typename S>
void multiply(const int8_t* q_, const float* dx_, const float* sx_, int64_t M, int64_t K, const torch::Tensor& packed,
              const torch::Tensor& scales, torch::Tensor& y) {
  const int64_t N = y.size(1), groups = packed.size(0);
  const uint8_t* packed_ = packed.data_ptr<uint8_t>();
  const S* scales_ = scales.data_ptr<S>();
  float* y_ = y.data_ptr<float>();
  if (use_avx512.load(std::memory_order_relaxed)) {
    const int64_t pairs = (groups + 1) / 2;  // the last one may be a single group: the AVX2 path below takes it
    at::parallel_for(0, pairs, 1, [&](int64_t u0, int64_t u1) {
      for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
        const int64_t c1 = std::min(M, c0 + kRowChunk);
        for (int64_t u = u0; u < u1; ++u) {
          if (2 * u + 1 < groups) {
            row_tiles<2, S>(packed_, scales_, q_, dx_, sx_, 2 * u, c0, c1, K, y_, N);
          } else {
            row_tiles<1, S>(packed_, scales_, q_, dx_, sx_, 2 * u, c0, c1, K, y_, N);
          }
        }
      }
    });
    return;
  }
  at::parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    // Rows in chunks whose codes stay in cache while every group of the range reads them.
    for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
      const int64_t c1 = std::min(M, c0 + kRowChunk);
      for (int64_t g = g0; g < g1; ++g) row_tiles<1, S>(packed_, scales_, q_, dx_, sx_, g, c0, c1, K, y_, N);
    }
  });
}

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "q4_1_linear: x must be a contiguous float32 [M, K] CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock, groups = (N + kLanes - 1) / kLanes;
  TORCH_CHECK(K % kBlock == 0, "q4_1_linear: K must be a multiple of 32");
  TORCH_CHECK(N >= 0 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == groups && packed.size(1) == blocks && packed.size(2) == 4 && packed.size(3) == 32,
              "q4_1_linear: packed must be contiguous uint8 [ceil(N / 8), K / 32, 4, 32]");
  TORCH_CHECK((scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kFloat16) &&
                  scales.is_contiguous() && scales.dim() == 4 && scales.size(0) == groups &&
                  scales.size(1) == blocks && scales.size(2) == 2 && scales.size(3) == 8,
              "q4_1_linear: scales must be contiguous float32 or float16 [ceil(N / 8), K / 32, 2, 8]");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // The rows' codes and scales in this thread's scratch: a decode step makes ~120 calls of a few KB each, and three
  // tensor allocations a call were a tenth of its time outside the matmuls.
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> dx, sx;
  q.resize(static_cast<size_t>(M * K));
  dx.resize(static_cast<size_t>(M * blocks));
  sx.resize(static_cast<size_t>(M * blocks));
  quantize_rows(x.data_ptr<float>(), M, K, q.data(), dx.data(), sx.data());
  if (scales.scalar_type() == torch::kFloat16) {
    multiply<at::Half>(q.data(), dx.data(), sx.data(), M, K, packed, scales, y);
  } else {
    multiply<float>(q.data(), dx.data(), sx.data(), M, K, packed, scales, y);
  }
  if (q.capacity() > kScratchBytes) {  // a long prompt's codes are not kept for the steps after it
    std::vector<int8_t>().swap(q);
    std::vector<float>().swap(dx);
    std::vector<float>().swap(sx);
  }
  return y;
}

// Whether the AVX-512 path runs (``enabled`` and the CPU has it); for comparing the two paths.
bool q4_1_use_avx512(bool enabled) {
  use_avx512.store(enabled && cpu_has_avx512_vnni());
  return use_avx512.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specula, library) {
  library.def("q4_1_linear(Tensor x, Tensor packed, Tensor scales, int N) -> Tensor");
  library.def("q4_1_use_avx512(bool enabled) -> bool", &q4_1_use_avx512);
}
TORCH_LIBRARY_IMPL(specula, CPU, library) { library.impl("q4_1_linear", &q4_1_linear); }
