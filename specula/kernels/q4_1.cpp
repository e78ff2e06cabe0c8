// q4_1 linear layer for x86 CPUs with AVX2: 4-bit weights in blocks of 32 (a scale and a minimum each, GGUF's
// Q4_1), activations rounded per block of 32 to 8-bit codes, dot products of the codes in integers
// (the arithmetic llama.cpp uses for Q4_1 x Q8_1 on a CPU). Loaded by specula/kernels/q4_1.py.
//
// y[i, n] = sum_b  d[n, b] * dx[i, b] * sum_j qw[n, b, j] * qx[i, b, j]  +  m[n, b] * sx[i, b]
//   weights  w[n, 32b + j] = qw * d + m, qw in 0..15, stored as qs[n, 16b + j] = qw[j] | qw[j + 16] << 4;
//   inputs   dx = max|x_block| / 127, qx = round-half-even(x * 127 / max|x_block|), sx = dx * sum_j qx.
// Every output row is computed from its own input row by the same instruction sequence whatever M is,
// so a row's result does not depend on how many rows are in the call (a k-token verify pass and a
// one-token step agree bit for bit in this layer).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowChunk = 64;  // rows per pass over the outputs (a multiple of 4: dot_rows<4> groups)

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

inline __m256i unpack_block(const uint8_t* codes) {  // 16 bytes -> 32 codes 0..15 in input order
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// Exact int32 dot products of one weight block's codes with one input block's codes, in 8 int32 lanes.
// |qw * qx| <= 15 * 127: pairs sum exactly in int16 (maddubs), then in int32.
inline __m256i block_products(__m256i w, const int8_t* x) {
  const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), _mm256_set1_epi16(1));
}

// Lane j of the result is the sum of p[j]'s 8 lanes.
inline __m256i sum_each(const __m256i p[8]) {
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

// Output n of R consecutive input rows from i0. Blocks go eight at a time: each weight block is unpacked
// once for the R rows, the eight blocks' integer sums land in one vector, and their scales multiply it as
// vectors (d, m and the rows' dx, sx are contiguous per 8 blocks); the last K/32 mod 8 blocks one by one.
template <int R>
inline void dot_rows(const uint8_t* qs, const float* d, const float* m, const int8_t* q, const float* dx,
                     const float* sx, float* y, int64_t n, int64_t i0, int64_t K, int64_t N) {
  const int64_t blocks = K / kBlock;
  const uint8_t* wn = qs + n * (K / 2);
  const float* dn = d + n * blocks;
  const float* mn = m + n * blocks;
  __m256 acc[R];
  float tail[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    tail[r] = 0.0f;
  }
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {
    __m256i w[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) w[j] = unpack_block(wn + (b + j) * 16);
    const __m256 d8 = _mm256_loadu_ps(dn + b), m8 = _mm256_loadu_ps(mn + b);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xi = q + i * K + b * kBlock;
      __m256i p[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) p[j] = block_products(w[j], xi + j * kBlock);
      const __m256 scale = _mm256_mul_ps(d8, _mm256_loadu_ps(dx + i * blocks + b));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_each(p)), scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sx + i * blocks + b), acc[r]);
    }
  }
  for (; b < blocks; ++b) {
    const __m256i w = unpack_block(wn + b * 16);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const __m256 products = _mm256_cvtepi32_ps(block_products(w, q + i * K + b * kBlock));
      tail[r] += dn[b] * dx[i * blocks + b] * horizontal_sum(products) + mn[b] * sx[i * blocks + b];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) y[(i0 + r) * N + n] = horizontal_sum(acc[r]) + tail[r];
}

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                          const torch::Tensor& m) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "q4_1_linear: x must be a contiguous float32 [M, K] CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0, "q4_1_linear: K must be a multiple of 32");
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && qs.dim() == 2 && qs.size(1) == K / 2,
              "q4_1_linear: qs must be contiguous uint8 [N, K / 2]");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && m.scalar_type() == torch::kFloat32 && d.is_contiguous() &&
                  m.is_contiguous() && d.dim() == 2 && m.dim() == 2 && d.size(0) == N && m.size(0) == N &&
                  d.size(1) == blocks && m.size(1) == blocks,
              "q4_1_linear: d and m must be contiguous float32 [N, K / 32]");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({M, blocks}, x.options());
  auto sx = torch::empty({M, blocks}, x.options());
  quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>());
  const uint8_t* qs_ = qs.data_ptr<uint8_t>();
  const float *d_ = d.data_ptr<float>(), *m_ = m.data_ptr<float>();
  const int8_t* q_ = q.data_ptr<int8_t>();
  const float *dx_ = dx.data_ptr<float>(), *sx_ = sx.data_ptr<float>();
  float* y_ = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    // Rows in chunks whose codes stay in cache while every output of the range reads them (a prompt of
    // 1,500 rows is 0.9 MB of codes per 576-wide layer: streamed once per output, it was 10x slower).
    for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
      const int64_t c1 = std::min(M, c0 + kRowChunk);
      for (int64_t n = n0; n < n1; ++n) {
        int64_t i0 = c0;
        for (; i0 + 4 <= c1; i0 += 4) dot_rows<4>(qs_, d_, m_, q_, dx_, sx_, y_, n, i0, K, N);
        switch (c1 - i0) {
          case 3: dot_rows<3>(qs_, d_, m_, q_, dx_, sx_, y_, n, i0, K, N); break;
          case 2: dot_rows<2>(qs_, d_, m_, q_, dx_, sx_, y_, n, i0, K, N); break;
          case 1: dot_rows<1>(qs_, d_, m_, q_, dx_, sx_, y_, n, i0, K, N); break;
          default: break;
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specula, library) {
  library.def("q4_1_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor");
}
TORCH_LIBRARY_IMPL(specula, CPU, library) { library.impl("q4_1_linear", &q4_1_linear); }
