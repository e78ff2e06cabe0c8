// Row-invariant float32 linear layer for x86 CPUs with AVX2 and FMA. Loaded by specula/kernels/float32.py.
//
// specula::float32_linear(x [M, K], w [N, K]) -> y [M, N] = x @ w.T, float32, contiguous.
//
// y[i, n] is one fixed sequence of operations on row i of x and row n of w, whatever M is and whichever
// rows or outputs share its tile: an 8-lane accumulator acc <- fma(x[i, 8c:8c+8], w[n, 8c:8c+8], acc) over
// c = 0, 1, ... (a last partial chunk loaded with zeros), then the lanes summed as
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). So a row of a k-token verify pass gets the very bits a
// one-token step gets (a BLAS does not promise that: MKL's products of 1-3, 4-11 and 12 or more rows round
// differently).
//
// Tiles: a one-row call takes 8 outputs at a time (8 independent fma chains per thread: a step reads the
// weights once, and that read is the cost); more rows go in tiles of 3 rows x 4 outputs (12 chains, each weight
// vector loaded once per 3 rows), a block of 16 outputs at a time over every row tile while its weights stay in cache.
// Threads split the outputs, never K.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

inline float lane_sum(__m256 v) {
  alignas(32) float l[8];
  _mm256_store_ps(l, v);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// The load mask of a last chunk of ``tail`` (1..7) floats.
inline __m256i tail_mask(int64_t tail) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(tail)), lanes);
}

// Outputs n0 .. n0 + C - 1 of rows i0 .. i0 + R - 1.
template <int R, int C>
inline void tile(const float* x, const float* w, int64_t i0, int64_t n0, int64_t K, int64_t N, float* y) {
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* xr[R];
  const float* wc[C];
  for (int r = 0; r < R; ++r) xr[r] = x + (i0 + r) * K;
  for (int c = 0; c < C; ++c) wc[c] = w + (n0 + c) * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(xr[r] + k);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 wv = _mm256_loadu_ps(wc[c] + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  if (k < K) {  // the same fma on a chunk whose missing lanes are zeros
    const __m256i mask = tail_mask(K - k);
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_maskload_ps(xr[r] + k, mask);
    for (int c = 0; c < C; ++c) {
      const __m256 wv = _mm256_maskload_ps(wc[c] + k, mask);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(i0 + r) * N + n0 + c] = lane_sum(acc[r][c]);
}

// Outputs n0 .. n0 + 4 * Q - 1 of rows 0 .. M - 1: row tiles of 3 (then 2 or 1), each over Q quads of outputs,
// so a tile's rows stay in L1 while the 4Q weight rows come from L2.
template <int Q>
inline void outputs(const float* x, const float* w, int64_t M, int64_t n0, int64_t K, int64_t N, float* y) {
  int64_t i = 0;
  for (; i + 3 <= M; i += 3)
    for (int q = 0; q < Q; ++q) tile<3, 4>(x, w, i, n0 + 4 * q, K, N, y);
  for (int q = 0; q < Q; ++q) {
    if (M - i == 2) tile<2, 4>(x, w, i, n0 + 4 * q, K, N, y);
    if (M - i == 1) tile<1, 4>(x, w, i, n0 + 4 * q, K, N, y);
  }
}

torch::Tensor float32_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "float32_linear: x must be a contiguous float32 [M, K] CPU tensor");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) == x.size(1),
              "float32_linear: w must be a contiguous float32 [N, K] CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* x_ = x.data_ptr<float>();
  const float* w_ = w.data_ptr<float>();
  float* y_ = y.data_ptr<float>();
  if (M == 1) {
    const int64_t blocks = N / 8;
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) tile<1, 8>(x_, w_, 0, b * 8, K, N, y_);
    });
    for (int64_t n = blocks * 8; n < N; ++n) tile<1, 1>(x_, w_, 0, n, K, N, y_);
    return y;
  }
  const int64_t blocks = N / 16;  // 16 outputs (36 KB of weights for K = 576) per block
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) outputs<4>(x_, w_, M, b * 16, K, N, y_);
  });
  for (int64_t n = blocks * 16; n < N; ++n)
    for (int64_t i = 0; i < M; ++i) tile<1, 1>(x_, w_, i, n, K, N, y_);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specula, library) {
  library.def("float32_linear(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(specula, CPU, library) { library.impl("float32_linear", &float32_linear); }
