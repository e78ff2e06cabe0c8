// A Llama-style decoder stack over a small block, run from C++ in one call. Loaded by specula/kernels/decoder.py.
//
// torch.classes.specula.DecoderStack(weights, sizes, epsilons): every layer's norms and linears (q4_1, or float32
// through the row-invariant float32 kernel), held once.
// stack.run(x [1, n, H], cos, sin [1, n, d], keys, values (per layer [1, Hkv, A, d]), length, mask, capture)
//   -> [x after the last layer, then the input of each layer in ``capture``];
// stack.run_packed(...): the same for several sequences' blocks packed in one x, each over its own cache.
//
// Why: an eager SmolLM2 step in q4_1 is ~60 small torch calls per layer from Python, 30 layers, ~9 ms of a 17 ms
// one-token step around ~8 ms of matmuls. Here a layer makes five ATen computations of its own, those whose
// arithmetic is hard to repeat bit for bit (each of the two norms' pow and mean, with ATen's reduction order, and
// SiLU, with its vector exp, cut into the same row chunks), plus the same q4_1 and cached-attention ops, from C++. Everything else is a
// plain loop doing each element's ATen arithmetic (one rounding per operation) or moving floats where the Python
// path's split, view, transpose, narrow and copy_ put them: the norms' elementwise tail, rotary, the cache writes,
// the heads side by side, SiLU times up, the residual adds. Every output bit equals the Python path's
// (`specula.runtime.native_decoder` holds the conditions; tests pin it). Those loops instead of ~40 ATen calls a
// layer: a one-token step with 2 threads 7.6 -> 6.7 ms (AMD EPYC, alternating runs of both builds).
#include <torch/extension.h>
#include <torch/custom_class.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using LinearOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using AttentionOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, const at::Tensor&, double);

const c10::TypedOperatorHandle<LinearOp>& q4_1_linear() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("specula::q4_1_linear", "").typed<LinearOp>();
  return op;
}

using PackedAttentionOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList,
                                     at::TensorList, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, double);

const c10::TypedOperatorHandle<PackedAttentionOp>& packed_attention() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("specula::packed_attention", "")
                             .typed<PackedAttentionOp>();
  return op;
}

const c10::TypedOperatorHandle<AttentionOp>& cached_attention() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("specula::cached_attention", "").typed<AttentionOp>();
  return op;
}

using Float32LinearOp = at::Tensor(const at::Tensor&, const at::Tensor&);

const c10::TypedOperatorHandle<Float32LinearOp>& float32_linear() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("specula::float32_linear", "").typed<Float32LinearOp>();
  return op;
}

// A q4_1 linear (packed blocks and their scales) or a float32 one (packed is the float32 weight [N, K], scales empty).
struct LinearWeight {
  at::Tensor packed, scales;
  int64_t outputs;
};

// Q4_1Linear.forward, or Float32Linear.forward through the row-invariant float32 kernel, of the rows of x [n, K]
// (contiguous) → [n, N].
at::Tensor linear(const at::Tensor& x, const LinearWeight& w) {
  if (w.packed.scalar_type() == at::kFloat) return float32_linear().call(x, w.packed);
  return q4_1_linear().call(x, w.packed, w.scales, w.outputs);
}

// RMSNorm of x [n, H] (contiguous) in float32 as transformers' Llama norm computes it: weight * (x * rsqrt(mean(x^2)
// + eps)). The mean is ATen's (its reduction order is the one to match); the rest is one loop doing what ATen's add,
// rsqrt and two muls do to each element, each rounded once (IEEE float, no contraction: -ffp-contract=off), so the
// bits are theirs.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor variance = at::mean(x.pow(2), at::IntArrayRef{-1}, /*keepdim=*/true).contiguous();
  const int64_t width = x.size(-1), rows = x.numel() / width;
  at::Tensor result = at::empty_like(x);
  const float *in = x.data_ptr<float>(), *var = variance.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* out = result.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = 1.0f / std::sqrt(var[r] + epsilon);
    for (int64_t j = 0; j < width; ++j) {
      const float normed = in[r * width + j] * scale;
      out[r * width + j] = w[j] * normed;
    }
  }
  return result;
}

// ``heads`` heads of size d starting at column ``offset`` of the rows of ``in`` (n rows, ``width`` floats each)
// into out [heads, n, d], rotary position embedding applied when cos and sin [n, d] are given: x * cos +
// rotate_half(x) * sin, rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]), each product and the sum rounded once,
// as ATen's mul, neg, cat and add give them (the Python path's split, view and transpose move no bits).
void heads_of(const float* in, int64_t width, int64_t offset, int64_t heads, int64_t n, int64_t d, const float* cos,
              const float* sin, float* out) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const float* row = in + i * width + offset + h * d;
      float* target = out + (h * n + i) * d;
      if (cos == nullptr) {
        std::memcpy(target, row, d * sizeof(float));
        continue;
      }
      for (int64_t j = 0; j < d; ++j) {
        const float rotated = j < half ? -row[j + half] : row[j - half];
        const float a = row[j] * cos[i * d + j];
        const float b = rotated * sin[i * d + j];
        target[j] = a + b;
      }
    }
}

// Rows [from, from + rows) of a block's keys or values [1, Hkv, n, d] (contiguous) into cache slots [length,
// length + rows) of ``cache`` [1, Hkv, A, d] (the Python path's narrow and copy_).
void write_cache(const at::Tensor& cache, const at::Tensor& block, int64_t from, int64_t rows, int64_t length) {
  TORCH_CHECK(cache.stride(3) == 1 && length + rows <= cache.size(2), "DecoderStack: a cache slot out of range");
  const int64_t kv_heads = block.size(1), n = block.size(2), d = block.size(3);
  const float* in = block.data_ptr<float>();
  float* out = cache.data_ptr<float>();
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(out + h * cache.stride(1) + (length + i) * cache.stride(2), in + (h * n + from + i) * d,
                  d * sizeof(float));
}

// out = a + b, elementwise over equal-sized contiguous tensors (ATen's add: one rounding per element).
at::Tensor residual(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor out = at::empty_like(a);
  const float *x = a.data_ptr<float>(), *y = b.data_ptr<float>();
  float* z = out.data_ptr<float>();
  for (int64_t j = 0, size = a.numel(); j < size; ++j) z[j] = x[j] + y[j];
  return out;
}

struct DecoderStack : torch::CustomClassHolder {
  std::vector<at::Tensor> input_norms, post_norms;
  std::vector<double> input_eps, post_eps;
  std::vector<LinearWeight> qkv, out, gate_up, down;
  int64_t q_size, kv_size, head_dim, silu_step, silu_grain;
  double scale;

  // weights: per layer [input norm, post norm, then packed and scales of qkv, o, gate_up, down (a float32 linear:
  // its weight and an empty tensor)] (10 tensors);
  // sizes: [q_size, kv_size, head_dim, silu_step, silu_grain, then per layer the outputs of qkv, o, gate_up,
  // down]; epsilons: [scale, then per layer input eps, post eps].
  DecoderStack(std::vector<at::Tensor> weights, std::vector<int64_t> sizes, std::vector<double> epsilons) {
    TORCH_CHECK(weights.size() % 10 == 0 && sizes.size() == 5 + weights.size() / 10 * 4 &&
                    epsilons.size() == 1 + weights.size() / 10 * 2,
                "DecoderStack: 10 tensors, 4 sizes and 2 epsilons per layer");
    q_size = sizes[0], kv_size = sizes[1], head_dim = sizes[2], silu_step = sizes[3], silu_grain = sizes[4];
    scale = epsilons[0];
    const size_t layers = weights.size() / 10;
    for (size_t i = 0; i < layers; ++i) {
      const at::Tensor* w = weights.data() + 10 * i;
      const int64_t* n = sizes.data() + 5 + 4 * i;
      input_norms.push_back(w[0]);
      post_norms.push_back(w[1]);
      qkv.push_back({w[2], w[3], n[0]});
      out.push_back({w[4], w[5], n[1]});
      gate_up.push_back({w[6], w[7], n[2]});
      down.push_back({w[8], w[9], n[3]});
      input_eps.push_back(epsilons[1 + 2 * i]);
      post_eps.push_back(epsilons[2 + 2 * i]);
    }
  }

  // `specula.runtime.static_cache.rowwise(silu, x)`: rows padded to a multiple of silu_step, at most silu_grain
  // elements a call, so that each row's bits do not depend on how many rows the block holds.
  at::Tensor rowwise_silu(const at::Tensor& x) const {
    const int64_t rows = x.size(-2), width = x.size(-1);
    const int64_t padded = (width + silu_step - 1) / silu_step * silu_step;
    const at::Tensor in = padded == width ? x : at::constant_pad_nd(x, {0, padded - width}, 0);
    const int64_t per_call = std::max<int64_t>(1, silu_grain / padded);
    at::Tensor result;
    if (rows <= per_call) {
      result = at::silu(in);
    } else {
      std::vector<at::Tensor> parts;
      for (int64_t i = 0; i < rows; i += per_call) parts.push_back(at::silu(in.narrow(-2, i, std::min(per_call, rows - i))));
      result = at::cat(parts, -2);
    }
    return padded == width ? result : result.narrow(-1, 0, width);
  }

  // The block's queries [1, H, n, d], keys and values [1, Hkv, n, d] of layer i for its input x [n, H], rotary
  // applied (`static_cache.layer_projections`).
  std::vector<at::Tensor> project(size_t i, const at::Tensor& x, const float* cos, const float* sin) const {
    const int64_t n = x.size(0);
    const at::Tensor qkv_rows = linear(rms_norm(x, input_norms[i], input_eps[i]), qkv[i]);
    const int64_t width = qkv_rows.size(1), heads = q_size / head_dim, kv_heads = kv_size / head_dim;
    const float* rows = qkv_rows.data_ptr<float>();
    std::vector<at::Tensor> block = {at::empty({1, heads, n, head_dim}, x.options()),
                                     at::empty({1, kv_heads, n, head_dim}, x.options()),
                                     at::empty({1, kv_heads, n, head_dim}, x.options())};
    heads_of(rows, width, 0, heads, n, head_dim, cos, sin, block[0].data_ptr<float>());
    heads_of(rows, width, q_size, kv_heads, n, head_dim, cos, sin, block[1].data_ptr<float>());
    heads_of(rows, width, q_size + kv_size, kv_heads, n, head_dim, nullptr, nullptr, block[2].data_ptr<float>());
    return block;
  }

  // Layer i's output [n, H] for its input x [n, H] and attention output [1, H, n, d] (`static_cache.layer_output`):
  // the heads side by side, the output projection and the residual, then the MLP and its residual.
  at::Tensor finish(size_t i, const at::Tensor& x, const at::Tensor& attended) const {
    const int64_t n = x.size(0), heads = attended.size(1), d = attended.size(3);
    at::Tensor merged = at::empty({n, heads * d}, x.options());
    const at::Tensor attended_rows = attended.contiguous();
    heads_side_by_side(attended_rows.data_ptr<float>(), heads, n, d, merged.data_ptr<float>());
    const at::Tensor y = residual(x, linear(merged, out[i]));
    const at::Tensor gate_up_rows = linear(rms_norm(y, post_norms[i], post_eps[i]), gate_up[i]);
    const int64_t inner = gate_up_rows.size(1) / 2;
    const at::Tensor activated =
        rowwise_silu(gate_up_rows.view({1, n, 2 * inner}).narrow(-1, 0, inner)).contiguous().view({n, inner});
    at::Tensor mixed = at::empty({n, inner}, x.options());
    const float *act = activated.data_ptr<float>(), *gu = gate_up_rows.data_ptr<float>();
    float* product = mixed.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < inner; ++j) product[r * inner + j] = act[r * inner + j] * gu[r * 2 * inner + inner + j];
    return residual(y, linear(mixed, down[i]));
  }

  // [1, H, n, d] → [n, H * d] (the Python path's transpose and reshape).
  static void heads_side_by_side(const float* in, int64_t heads, int64_t n, int64_t d, float* out) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < heads; ++h) std::memcpy(out + (i * heads + h) * d, in + (h * n + i) * d, d * sizeof(float));
  }

  // `static_cache._cached_attention` through the kernel: rows [from, from + rows) of the block's k, v written
  // after the cache's first ``length`` slots, q attending over the slots before ``end`` (a long scalar tensor).
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t from, int64_t rows,
                    const at::Tensor& keys, const at::Tensor& values, int64_t length, const at::Tensor& end,
                    const std::optional<at::Tensor>& mask) const {
    write_cache(keys, k, from, rows, length);
    write_cache(values, v, from, rows, length);
    return cached_attention().call(q, keys, values, mask, end, scale);
  }

  // Every layer over x [1, n, H] with cos, sin [1, n, d]: the input of each layer in ``capture`` is kept, and
  // ``attention(i, q, k, v)`` gives layer i's attention output [1, H, n, d] → [x after the last layer, the inputs].
  template <typename Attention>
  std::vector<at::Tensor> layers(const at::Tensor& input, const at::Tensor& cos, const at::Tensor& sin,
                                 const std::vector<int64_t>& capture, Attention attention) const {
    const at::Tensor cos2 = cos.reshape({-1, cos.size(-1)}).contiguous();
    const at::Tensor sin2 = sin.reshape({-1, sin.size(-1)}).contiguous();
    at::Tensor x = input.reshape({-1, input.size(-1)}).contiguous();
    std::vector<at::Tensor> outputs(1);
    for (size_t i = 0; i < qkv.size(); ++i) {
      if (std::find(capture.begin(), capture.end(), static_cast<int64_t>(i)) != capture.end()) outputs.push_back(x);
      const std::vector<at::Tensor> p = project(i, x, cos2.data_ptr<float>(), sin2.data_ptr<float>());
      x = finish(i, x, attention(i, p[0], p[1], p[2]));
    }
    outputs[0] = x.unsqueeze(0);
    return outputs;
  }

  std::vector<at::Tensor> run(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                              std::vector<at::Tensor> values, int64_t length, std::optional<at::Tensor> mask,
                              std::vector<int64_t> capture) {
    TORCH_CHECK(keys.size() == qkv.size() && values.size() == qkv.size(), "DecoderStack.run: one cache per layer");
    const int64_t n = x.size(1);
    const at::Tensor end = at::scalar_tensor(length + n, at::kLong);
    return layers(x, cos, sin, capture, [&](size_t i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
      return attend(q, k, v, 0, n, keys[i], values[i], length, end, mask);
    });
  }

  // Several sequences' blocks packed in x [1, N, H]: sequence s holds rows [starts[s], ends[s]) after the first
  // lengths[s] slots of its own caches (keys[i * S + s] for layer i). The linears run over all rows; attention is
  // `static_cache._segments_attention`'s: the chains (chains[s] != 0) in one packed-attention call, every other
  // block alone through the kernel with its mask (masks: one per such block, in order).
  std::vector<at::Tensor> run_packed(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                                     std::vector<at::Tensor> values, std::vector<int64_t> starts,
                                     std::vector<int64_t> ends, std::vector<int64_t> lengths,
                                     std::vector<int64_t> chains, std::vector<at::Tensor> masks,
                                     std::vector<int64_t> capture) {
    const size_t sequences = starts.size();
    TORCH_CHECK(keys.size() == qkv.size() * sequences && values.size() == keys.size() && ends.size() == sequences &&
                    lengths.size() == sequences && chains.size() == sequences,
                "DecoderStack.run_packed: per sequence a start, end, length, chain flag and a cache per layer");
    std::vector<int64_t> chain_starts, chain_ends, chain_lengths;
    std::vector<at::Tensor> tree_ends;
    for (size_t s = 0; s < sequences; ++s) {
      if (chains[s]) chain_starts.push_back(starts[s]), chain_ends.push_back(ends[s]), chain_lengths.push_back(lengths[s]);
      else tree_ends.push_back(at::scalar_tensor(lengths[s] + ends[s] - starts[s], at::kLong));
    }
    TORCH_CHECK(tree_ends.size() <= masks.size(), "DecoderStack.run_packed: a mask for every block that is not a chain");
    return layers(x, cos, sin, capture, [&](size_t i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
      std::vector<at::Tensor> chain_keys, chain_values, alone;
      size_t tree = 0;
      for (size_t s = 0; s < sequences; ++s) {
        const at::Tensor &keys_s = keys[i * sequences + s], &values_s = values[i * sequences + s];
        if (chains[s]) {
          chain_keys.push_back(keys_s), chain_values.push_back(values_s);
          continue;
        }
        const int64_t n = ends[s] - starts[s];
        alone.push_back(attend(q.narrow(2, starts[s], n), k, v, starts[s], n, keys_s, values_s, lengths[s],
                               tree_ends[tree], masks[tree]));
        ++tree;
      }
      if (chain_keys.empty()) return at::cat(alone, 2);
      at::Tensor attended = packed_attention().call(q, k, v, chain_keys, chain_values, chain_starts, chain_ends,
                                                    chain_lengths, scale);
      size_t next = 0;
      for (size_t s = 0; s < sequences; ++s)
        if (!chains[s]) attended.narrow(2, starts[s], ends[s] - starts[s]).copy_(alone[next++]);
      return attended;
    });
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(specula, library) {
  library.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("run", &DecoderStack::run)
      .def("run_packed", &DecoderStack::run_packed);
}
