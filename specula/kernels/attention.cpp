// Attention of a short block of queries over a KV cache, for CPUs with AVX2 and FMA.
//
// specula::cached_attention(q [1, H, n, d], keys [1, Hkv, A, d], values [1, Hkv, A, d], mask, end, scale)
//   -> [1, H, n, d] float32, contiguous
//
// Query row i of head h attends over cache slots [0, end) of kv head h / (H / Hkv), the slots its row of
// ``mask`` (bool [.., n, >= end], or None: every slot) marks: softmax(scale * q k^T) v, in float32.
//
// Why a kernel of our own: a decode or verify step of a small model attends a few queries over a few hundred
// cached slots per layer, a microsecond-sized problem; torch's SDPA spends most of its ~50 us per call (in a
// real step, where the cache is cold) around the arithmetic, which on SmolLM2 was a quarter of a compiled
// step. Per query (one row of one query head):
//   1. scores of 8 keys at a time: 8 dot products as 8 vector accumulators over d, summed across lanes
//      together by one transposing reduction (7 shuffles for 8 sums instead of 8 horizontal sums);
//   2. the softmax with a vector exp (Cody-Waite range reduction and a degree-6 polynomial, ~2 ulp);
//   3. the weighted sum of values with the output row held in registers (up to 64 floats per pass).
// The slots every row of the block sees (a verify block's prefix, most of its keys) are taken a tile of 64 keys
// at a time for all the queries of one kv head (its query heads times the rows), so that a tile is read into the
// L1 cache once and not by every query: SmolLM2's shapes (9 heads, 3 kv heads), 10 rows over 1,000 slots,
// 553 -> 430 us a call, one row 62 -> 53 us (one thread, AMD EPYC). Pairing queries to share each loaded key
// and value in registers as well was slower with AVX2's 16 registers (592 us); with AVX-512VL's 32, three queries
// share them (`kGroup`, below). The packed op does the same per sequence: 16 sequences of one row after 400 slots,
// 500 -> 369-381 us a call.
// It is not bit-equal to SDPA (a different order of sums and another exp); the eager and the compiled step
// both call it, so a target attends the same way in both.
//
// Row invariance: a row attends over the keys its mask marks taken in slot order and reduced in chunks of 8 by
// their rank among them, never over the masked slots between them. So a row of a k-token verify pass (a chain:
// the prefix and the block entries before it; a tree: the prefix and its ancestors, wherever the block put
// them) gets the very bits the one-token step over the same tokens gets, whatever the number of rows, the
// slots the block spans, a compiled step's padding, or the other sequences of a packed step.
// Taking the common prefix in tiles shared by many queries changes no row's arithmetic: its scores are the same dot
// products, and its weighted sum the same fused multiply-adds in slot order, the accumulator stored between tiles.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// exp(x) lane by lane; lanes below -87.3 (where float32 exp underflows), -inf included, give exactly 0.
inline __m256 exp8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.3f);
  const __m256 keep = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lowest);
  // x = n ln2 + r with |r| <= ln2 / 2; ln2 split in two so that n * ln2_hi is exact.
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), keep);
}

// Where a row's j-th visible key sits in the cache: slot j itself (a row that sees every slot before ``end``)
// or the j-th entry of a list of the slots its mask marks. Both give the same arithmetic: a row's result is a
// function of its query and of the sequence of keys and values it sees, not of where they sit in the cache,
// how many slots the block spans, nor how many rows the call holds (`row invariance`, below).
struct AllSlots {
  int64_t operator[](int64_t j) const { return j; }
};
struct ListedSlots {
  const int32_t* slots;
  int64_t operator[](int64_t j) const { return slots[j]; }
};

// How many queries share each loaded key and value: three (a GQA group of SmolLM2's shape) where the compiler has
// AVX-512VL's 32 vector registers (3 x 8 accumulators fit), one with AVX2's 16. Every instruction stays an 8-lane
// one either way, and a query's arithmetic is the same whether it is computed alone or in a group (below), so this
// only changes how often a key is loaded. SmolLM2's shapes, one thread, AMD EPYC (Zen 4), warm caches: 8 rows over
// 1,000 slots 341 -> 290 us a call (54 -> 64 GFLOP/s, of ~95 that MKL's float32 matmul reaches), one row 53 -> 41 us.
// In a q4_1 step the cache is cold (30 layers of keys and values are 46 MB at 1,000 slots): 16 rows after 1,000
// tokens 40.2 -> 38.6 ms, 8 rows 23.5 -> 22.9 ms, one 13.2 -> 13.1 ms.
#ifdef __AVX512VL__
constexpr int kGroup = 3;
#else
constexpr int kGroup = 1;
#endif

// result[g] = [q_g . k_0, ..., q_g . k_{take-1}] for the visible keys j .. j + take - 1 (take <= 8; lanes past
// ``take`` repeat the last key and are not used) and each of G queries, d a multiple of 8. Every key's dot product
// is the same sequence of operations whichever lane it takes and whichever queries share the call: 8-lane fma over
// d in order, then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
template <int G, class Slots>
inline void eight_dots(const float* const* q, const float* keys, int64_t stride, Slots slots, int64_t j, int64_t take,
                       int64_t d, __m256* result) {
  const float* k[8];
  for (int i = 0; i < 8; ++i) k[i] = keys + slots[j + std::min<int64_t>(i, take - 1)] * stride;
  __m256 acc[G][8];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 8; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    __m256 qc[G];
    for (int g = 0; g < G; ++g) qc[g] = _mm256_loadu_ps(q[g] + c);
    for (int i = 0; i < 8; ++i) {
      const __m256 kc = _mm256_loadu_ps(k[i] + c);
      for (int g = 0; g < G; ++g) acc[g][i] = _mm256_fmadd_ps(qc[g], kc, acc[g][i]);
    }
  }
  // Pairwise sums, then the two 128-bit halves: lane i of the result is the whole sum of acc[i].
  for (int g = 0; g < G; ++g) {
    const __m256 s01 = _mm256_hadd_ps(acc[g][0], acc[g][1]), s23 = _mm256_hadd_ps(acc[g][2], acc[g][3]);
    const __m256 s45 = _mm256_hadd_ps(acc[g][4], acc[g][5]), s67 = _mm256_hadd_ps(acc[g][6], acc[g][7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    result[g] = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                              _mm256_permute2f128_ps(s0123, s4567, 0x31));
  }
}

// acc_g[c0, c0 + 8 * V) += sum_j p_g[j] * value_j[c0, c0 + 8 * V) over the visible values of ranks [from, to) in order,
// for each of G queries, the columns held in G x V registers and each value loaded once for all G. acc lives in
// memory between calls, so a row's sum may be taken in pieces (a tile of keys at a time, shared with other queries)
// and still be the same sequence of fused multiply-adds per column. A weight that underflowed to 0 is added like any
// other (skipping it for one query of a group and not for another would make a row's bits depend on its group).
template <int V, int G, class Slots>
inline void accumulate_columns(const float* const* p, const float* values, int64_t stride, Slots slots, int64_t from,
                               int64_t to, int64_t c0, float* const* acc) {
  __m256 sum[G][V];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) sum[g][i] = _mm256_loadu_ps(acc[g] + c0 + 8 * i);
  for (int64_t j = from; j < to; ++j) {
    __m256 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm256_set1_ps(p[g][j]);
    const float* v = values + slots[j] * stride + c0;
    for (int i = 0; i < V; ++i) {
      const __m256 vc = _mm256_loadu_ps(v + 8 * i);
      for (int g = 0; g < G; ++g) sum[g][i] = _mm256_fmadd_ps(w[g], vc, sum[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(acc[g] + c0 + 8 * i, sum[g][i]);
}

template <int G, class Slots>
void accumulate_values(const float* const* p, const float* values, int64_t stride, Slots slots, int64_t from,
                       int64_t to, int64_t d, float* const* acc) {
  int64_t c0 = 0;
  for (; c0 + 64 <= d; c0 += 64) accumulate_columns<8, G>(p, values, stride, slots, from, to, c0, acc);
  switch ((d - c0) / 8) {
    case 1: accumulate_columns<1, G>(p, values, stride, slots, from, to, c0, acc); break;
    case 2: accumulate_columns<2, G>(p, values, stride, slots, from, to, c0, acc); break;
    case 3: accumulate_columns<3, G>(p, values, stride, slots, from, to, c0, acc); break;
    case 4: accumulate_columns<4, G>(p, values, stride, slots, from, to, c0, acc); break;
    case 5: accumulate_columns<5, G>(p, values, stride, slots, from, to, c0, acc); break;
    case 6: accumulate_columns<6, G>(p, values, stride, slots, from, to, c0, acc); break;
    case 7: accumulate_columns<7, G>(p, values, stride, slots, from, to, c0, acc); break;
    default: break;
  }
}

// p_g[j] = scale * (q_g . key_j) for the visible keys of ranks [from, to), 8 at a time, for each of G queries.
template <int G, class Slots>
void score_keys(const float* const* q, const float* keys, int64_t stride, Slots slots, int64_t from, int64_t to,
                int64_t d, float scale, float* const* p) {
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int64_t j = from; j < to; j += 8) {
    const int64_t take = std::min<int64_t>(8, to - j);
    __m256 dots[G];
    eight_dots<G>(q, keys, stride, slots, j, take, d, dots);
    for (int g = 0; g < G; ++g) {
      const __m256 scores = _mm256_mul_ps(dots[g], scale8);
      if (take == 8) {
        _mm256_storeu_ps(p[g] + j, scores);
      } else {
        alignas(32) float chunk[8];
        _mm256_store_ps(chunk, scores);
        std::copy(chunk, chunk + take, p[g] + j);
      }
    }
  }
}

// The softmax of scores p[0, count) in place, unnormalised (exp(p - max)), and 1 / their total: a running 8-lane
// total over chunks of 8 by rank, then its lanes in order.
float softmax_in_place(float* p, int64_t count) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  float highest = minus_inf;
  for (int64_t j = 0; j < count; ++j) highest = std::max(highest, p[j]);
  const __m256 shift = _mm256_set1_ps(highest);
  __m256 total8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), shift));
    _mm256_storeu_ps(p + j, e);
    total8 = _mm256_add_ps(total8, e);
  }
  if (j < count) {  // a last partial chunk: its missing lanes are exp(-inf) = 0
    alignas(32) float chunk[8];
    std::fill(chunk, chunk + 8, minus_inf);
    std::copy(p + j, p + count, chunk);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(chunk), shift));
    _mm256_store_ps(chunk, e);
    std::copy(chunk, chunk + (count - j), p + j);
    total8 = _mm256_add_ps(total8, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total8);
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  return 1.0f / total;
}

// out[0, d) = acc[0, d) * norm.
inline void normalise(const float* acc, float norm, int64_t d, float* out) {
  const __m256 scale = _mm256_set1_ps(norm);
  for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_loadu_ps(acc + c), scale));
}

// Keys (and values) per tile of the shared slots: 16 KB of float32 keys, which stay in the L1 cache while every
// query of the task reads them, instead of each query streaming the whole prefix from L2 or further.
inline int64_t tile_keys(int64_t d) { return std::max<int64_t>(8, (4096 / d) / 8 * 8); }

// One query of a kv head: its row, where its output goes, how many keys it sees, and which (``listed``: the slot of
// each visible key by rank; null: slots 0 .. count - 1).
struct Query {
  const float* q;
  float* out;
  int64_t count;
  const int32_t* listed;
};

// What `attend_queries` computes in, kept by a thread across its tasks so that a task allocates nothing: each
// query's scores (then softmax weights), its running weighted sum of values, and its softmax's 1 / total.
struct Scratch {
  std::vector<float> scores, sums, norms;
  std::vector<const float*> query_rows;
  std::vector<float*> score_rows, sum_rows;
};

// Queries of one kv head that all see slots [0, shared) and then each its own further visible keys (ranks
// [shared, count)): the shared slots a tile at a time for all of them, the rest query by query. A query's result
// is the same whichever queries share its call: softmax(scale q k^T) v over its visible keys in rank order, the
// scores in chunks of 8 by rank, the weighted sum in rank order.
void attend_queries(const std::vector<Query>& queries, int64_t shared, const float* k_head, const float* v_head,
                    int64_t key_stride, int64_t value_stride, int64_t d, float scale, Scratch& scratch) {
  const int64_t count_q = static_cast<int64_t>(queries.size()), tile = tile_keys(d);
  int64_t longest = 0;
  for (const Query& query : queries) longest = std::max(longest, query.count);
  std::vector<float>& p = scratch.scores;
  std::vector<float>& acc = scratch.sums;
  std::vector<float>& norms = scratch.norms;
  p.resize(static_cast<size_t>(count_q * longest));
  acc.assign(static_cast<size_t>(count_q * d), 0.0f);
  norms.assign(static_cast<size_t>(count_q), 0.0f);
  // Each query's row, scores and running sums, as the pointer lists the grouped loops take.
  std::vector<const float*>& rows = scratch.query_rows;
  std::vector<float*>& scores = scratch.score_rows;
  std::vector<float*>& sums = scratch.sum_rows;
  rows.resize(static_cast<size_t>(count_q));
  scores.resize(static_cast<size_t>(count_q));
  sums.resize(static_cast<size_t>(count_q));
  for (int64_t a = 0; a < count_q; ++a) {
    rows[a] = queries[a].q;
    scores[a] = p.data() + a * longest;
    sums[a] = acc.data() + a * d;
  }
  // The shared slots: queries kGroup at a time (each loaded key and value serves the group), the last few alone.
  const int64_t grouped = count_q / kGroup * kGroup;
  for (int64_t j0 = 0; j0 < shared; j0 += tile) {
    const int64_t j1 = std::min(shared, j0 + tile);
    for (int64_t a = 0; a < grouped; a += kGroup)
      score_keys<kGroup>(&rows[a], k_head, key_stride, AllSlots{}, j0, j1, d, scale, &scores[a]);
    for (int64_t a = grouped; a < count_q; ++a)
      score_keys<1>(&rows[a], k_head, key_stride, AllSlots{}, j0, j1, d, scale, &scores[a]);
  }
  for (int64_t a = 0; a < count_q; ++a) {
    const Query& query = queries[a];
    if (query.count > shared) {
      if (query.listed)
        score_keys<1>(&rows[a], k_head, key_stride, ListedSlots{query.listed}, shared, query.count, d, scale,
                      &scores[a]);
      else
        score_keys<1>(&rows[a], k_head, key_stride, AllSlots{}, shared, query.count, d, scale, &scores[a]);
    }
    if (query.count > 0) norms[a] = softmax_in_place(scores[a], query.count);
  }
  for (int64_t j0 = 0; j0 < shared; j0 += tile) {
    const int64_t j1 = std::min(shared, j0 + tile);
    for (int64_t a = 0; a < grouped; a += kGroup)
      accumulate_values<kGroup>(&scores[a], v_head, value_stride, AllSlots{}, j0, j1, d, &sums[a]);
    for (int64_t a = grouped; a < count_q; ++a)
      accumulate_values<1>(&scores[a], v_head, value_stride, AllSlots{}, j0, j1, d, &sums[a]);
  }
  for (int64_t a = 0; a < count_q; ++a) {
    const Query& query = queries[a];
    if (query.count == 0) {  // a row that sees nothing (never asked for): zeros rather than NaN
      std::fill(query.out, query.out + d, 0.0f);
      continue;
    }
    if (query.count > shared) {
      if (query.listed)
        accumulate_values<1>(&scores[a], v_head, value_stride, ListedSlots{query.listed}, shared, query.count, d,
                             &sums[a]);
      else
        accumulate_values<1>(&scores[a], v_head, value_stride, AllSlots{}, shared, query.count, d, &sums[a]);
    }
    normalise(sums[a], norms[a], d, query.out);
  }
}

// How many tasks each kv head's ``queries`` are cut into, among ``heads_in_all`` (kv heads, times sequences when
// packed): one on one thread, else about four per thread in all. Which task a query falls in changes nothing in
// its arithmetic.
inline int64_t chunks_per_head(int64_t queries, int64_t heads_in_all) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1) return 1;
  return std::max<int64_t>(1, std::min(queries, (4 * threads + heads_in_all - 1) / heads_in_all));
}

at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const c10::optional<at::Tensor>& mask, const at::Tensor& end_tensor, double scale) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && q.size(0) == 1 && keys.size(0) == 1,
              "cached_attention: q [1, H, n, d], keys and values [1, Hkv, A, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "cached_attention: float32 only");
  const int64_t heads = q.size(1), n = q.size(2), d = q.size(3), kv_heads = keys.size(1);
  const int64_t end = end_tensor.item<int64_t>();
  TORCH_CHECK(d % 8 == 0 && keys.size(3) == d && values.size(3) == d, "cached_attention: head size a multiple of 8");
  TORCH_CHECK(heads % kv_heads == 0 && values.size(1) == kv_heads, "cached_attention: heads a multiple of kv heads");
  TORCH_CHECK(end >= 1 && end <= keys.size(2) && end <= values.size(2), "cached_attention: end outside the cache");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && q.stride(3) == 1,
              "cached_attention: the head dimension must be contiguous");
  // Each row's visible slots, in order (its mask row; no mask: every slot before end), and the leading slots that
  // every row sees (a verify block's common prefix): those are attended tile by tile for all of a kv head's
  // queries together, the rest row by row.
  std::vector<int64_t> counts(static_cast<size_t>(n), end);
  std::vector<int32_t> listed;
  int64_t shared = end;
  if (mask.has_value()) {
    const at::Tensor visible = mask->reshape({-1, mask->size(-1)}).contiguous();
    TORCH_CHECK(visible.scalar_type() == at::kBool && visible.size(0) == n && visible.size(1) >= end,
                "cached_attention: mask bool [.., n, >= end]");
    listed.resize(static_cast<size_t>(n * end));
    const bool* mask_data = visible.data_ptr<bool>();
    for (int64_t i = 0; i < n; ++i) {
      const bool* row = mask_data + i * visible.stride(0);
      int32_t* slots = listed.data() + i * end;
      int64_t count = 0;
      for (int64_t j = 0; j < end; ++j)
        if (row[j]) slots[count++] = static_cast<int32_t>(j);
      int64_t leading = 0;
      while (leading < count && slots[leading] == leading) ++leading;
      counts[i] = count;
      shared = std::min(shared, leading);
    }
  }
  at::Tensor out = at::empty({1, heads, n, d}, q.options());
  const float* q_data = q.data_ptr<float>();
  const float* k_data = keys.data_ptr<float>();
  const float* v_data = values.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t group = heads / kv_heads, queries = group * n;
  const float scale_f = static_cast<float>(scale);
  const int64_t chunks = chunks_per_head(queries, kv_heads), per_task = (queries + chunks - 1) / chunks;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, per_task * end * d));
  at::parallel_for(0, kv_heads * chunks, grain, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    std::vector<Query> task;
    for (int64_t t = t0; t < t1; ++t) {
      // Queries first .. last - 1 of kv head kv, in (query head, row) order.
      const int64_t kv = t / chunks, first = (t % chunks) * per_task, last = std::min(queries, first + per_task);
      task.clear();
      for (int64_t a = first; a < last; ++a) {
        const int64_t h = kv * group + a / n, i = a % n;
        task.push_back({q_data + h * q.stride(1) + i * q.stride(2), out_data + (h * n + i) * d, counts[i],
                        listed.empty() ? nullptr : listed.data() + i * end});
      }
      if (!task.empty())
        attend_queries(task, shared, k_data + kv * keys.stride(1), v_data + kv * values.stride(1), keys.stride(2),
                       values.stride(2), d, scale_f, scratch);
    }
  });
  return out;
}

// Chain blocks of many sequences packed in one forward (`specula.runtime.packed`), in one call instead of one
// per sequence and layer (a batch-32 capture step made 960 calls of ~40 us, most of it around the arithmetic).
// Sequence s owns rows [starts[s], ends[s]) of q, k, v [1, H(kv), N, d] and its own caches [1, Hkv, A_s, d]
// holding prefixes[s] committed slots: its rows' keys and values are written after them, and its row i of the
// block attends over slots [0, prefixes[s] + i + 1), exactly the visible keys cached_attention gives a chain
// row (`AllSlots`, the same count), so each row gets the bits of the one-sequence call. Rows of q outside every
// listed range are left zero (the caller attends them its own way).
at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList key_caches,
                            at::TensorList value_caches, at::IntArrayRef starts, at::IntArrayRef ends,
                            at::IntArrayRef prefixes, double scale) {
  const int64_t sequences = static_cast<int64_t>(starts.size());
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1,
              "packed_attention: q [1, H, N, d], k and v [1, Hkv, N, d]");
  TORCH_CHECK(static_cast<int64_t>(ends.size()) == sequences && static_cast<int64_t>(prefixes.size()) == sequences &&
                  static_cast<int64_t>(key_caches.size()) == sequences &&
                  static_cast<int64_t>(value_caches.size()) == sequences,
              "packed_attention: one start, end, prefix and pair of caches per sequence");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "packed_attention: float32 only");
  const int64_t heads = q.size(1), rows = q.size(2), d = q.size(3), kv_heads = k.size(1);
  TORCH_CHECK(d % 8 == 0 && k.size(3) == d && v.size(3) == d && k.size(2) == rows && v.size(2) == rows,
              "packed_attention: q, k, v rows and head sizes must agree (head size a multiple of 8)");
  TORCH_CHECK(heads % kv_heads == 0 && v.size(1) == kv_heads, "packed_attention: heads a multiple of kv heads");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "packed_attention: the head dimension must be contiguous");
  std::vector<int64_t> sequence_of(static_cast<size_t>(rows), -1);
  int64_t visible_total = 0;
  for (int64_t s = 0; s < sequences; ++s) {
    const at::Tensor& keys = key_caches[s];
    const at::Tensor& values = value_caches[s];
    const int64_t n = ends[s] - starts[s];
    TORCH_CHECK(starts[s] >= 0 && n >= 1 && ends[s] <= rows, "packed_attention: a sequence's rows outside q");
    TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.size(1) == kv_heads && values.size(1) == kv_heads &&
                    keys.size(3) == d && values.size(3) == d && keys.scalar_type() == at::kFloat &&
                    values.scalar_type() == at::kFloat && keys.stride(3) == 1 && values.stride(3) == 1,
                "packed_attention: caches float32 [1, Hkv, A, d] with a contiguous head dimension");
    TORCH_CHECK(prefixes[s] >= 0 && prefixes[s] + n <= keys.size(2) && prefixes[s] + n <= values.size(2),
                "packed_attention: a block past the end of its cache");
    for (int64_t r = starts[s]; r < ends[s]; ++r) {
      TORCH_CHECK(sequence_of[r] < 0, "packed_attention: sequences overlap");
      sequence_of[r] = s;
    }
    // The block's keys and values after the prefix, as StaticKVCache.write stores them.
    float* key_data = keys.data_ptr<float>();
    float* value_data = values.data_ptr<float>();
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t i = 0; i < n; ++i) {
        const float* k_row = k.data_ptr<float>() + h * k.stride(1) + (starts[s] + i) * k.stride(2);
        const float* v_row = v.data_ptr<float>() + h * v.stride(1) + (starts[s] + i) * v.stride(2);
        std::memcpy(key_data + h * keys.stride(1) + (prefixes[s] + i) * keys.stride(2), k_row, d * sizeof(float));
        std::memcpy(value_data + h * values.stride(1) + (prefixes[s] + i) * values.stride(2), v_row,
                    d * sizeof(float));
      }
    }
    visible_total += n * (prefixes[s] + 1) + n * (n - 1) / 2;
  }
  at::Tensor out = at::zeros({1, heads, rows, d}, q.options());
  if (visible_total == 0) return out;
  const float* q_data = q.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t group = heads / kv_heads;
  const float scale_f = static_cast<float>(scale);
  // Tasks: a sequence's queries of one kv head (its rows times the kv head's query heads), cut as in
  // cached_attention; each sequence's rows all see its prefix and their own first block entry.
  int64_t most_queries = 1;
  for (int64_t s = 0; s < sequences; ++s) most_queries = std::max(most_queries, group * (ends[s] - starts[s]));
  const int64_t chunks = chunks_per_head(most_queries, kv_heads * sequences);
  const int64_t per_task = (most_queries + chunks - 1) / chunks;
  const int64_t mean_visible = std::max<int64_t>(1, visible_total / rows);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, per_task * mean_visible * d));
  at::parallel_for(0, sequences * kv_heads * chunks, grain, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    std::vector<Query> task;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = t / (kv_heads * chunks), kv = (t / chunks) % kv_heads, n = ends[s] - starts[s];
      const int64_t first = (t % chunks) * per_task, last = std::min(group * n, first + per_task);
      task.clear();
      for (int64_t a = first; a < last; ++a) {
        const int64_t h = kv * group + a / n, r = starts[s] + a % n;
        task.push_back({q_data + h * q.stride(1) + r * q.stride(2), out_data + (h * rows + r) * d,
                        prefixes[s] + a % n + 1, nullptr});
      }
      if (task.empty()) continue;
      const at::Tensor& keys = key_caches[s];
      const at::Tensor& values = value_caches[s];
      attend_queries(task, prefixes[s] + 1, keys.data_ptr<float>() + kv * keys.stride(1),
                     values.data_ptr<float>() + kv * values.stride(1), keys.stride(2), values.stride(2), d, scale_f,
                     scratch);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specula, library) {
  library.def(
      "cached_attention(Tensor q, Tensor keys, Tensor values, Tensor? mask, Tensor end, float scale) -> Tensor");
  library.def(
      "packed_attention(Tensor q, Tensor k, Tensor v, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
      "int[] starts, int[] ends, int[] prefixes, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specula, CPU, library) {
  library.impl("cached_attention", &cached_attention);
  library.impl("packed_attention", &packed_attention);
}
