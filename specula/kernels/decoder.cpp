// A Llama-style decoder stack over a small block, run from C++ in one call. Loaded by specula/kernels/decoder.py.
//
// torch.classes.specula.DecoderStack(weights, sizes, epsilons): every layer's norms and q4_1 linears, held once.
// stack.run(x [1, n, H], cos, sin [1, n, d], keys, values (per layer [1, Hkv, A, d]), length, mask, capture)
//   -> [x after the last layer, then the input of each layer in ``capture``];
// stack.run_packed(...): the same for several sequences' blocks packed in one x, each over its own cache.
//
// Why: an eager SmolLM2 step in q4_1 is ~60 small torch calls per layer from Python, 30 layers, ~9 ms of a 17 ms
// one-token step around ~8 ms of matmuls. Here each layer is the same ATen calls in the same order on the same
// tensors (the norm's pow and mean, the q/k/v split, the cache write, SiLU cut into the same row chunks, the residual
// adds) and the same q4_1 and cached-attention ops, called from C++; the norm's elementwise tail and rotary are plain
// loops doing each element's ATen arithmetic (one rounding per operation). Every output bit equals the Python
// path's (`specula.runtime.native_decoder` holds the conditions; tests pin it).
#include <torch/extension.h>
#include <torch/custom_class.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
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

struct Q4_1Weight {
  at::Tensor packed, scales;
  int64_t outputs;
};

// Q4_1Linear.forward: the rows of x [..., K] through the kernel, back in x's shape with N outputs.
at::Tensor linear(const at::Tensor& x, const Q4_1Weight& w) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = w.outputs;
  return q4_1_linear().call(rows, w.packed, w.scales, w.outputs).reshape(shape);
}

// RMSNorm in float32 as transformers' Llama norm computes it: weight * (x * rsqrt(mean(x^2) + eps)). The mean is
// ATen's (its reduction order is the one to match); the rest is one loop doing what ATen's add, rsqrt and two muls do
// to each element, each rounded once (IEEE float, no contraction: -ffp-contract=off), so the bits are theirs.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor variance = at::mean(x.pow(2), at::IntArrayRef{-1}, /*keepdim=*/true).contiguous();
  const at::Tensor input = x.contiguous();
  const int64_t width = input.size(-1), rows = input.numel() / width;
  at::Tensor result = at::empty_like(input);
  const float *in = input.data_ptr<float>(), *var = variance.data_ptr<float>(), *w = weight.data_ptr<float>();
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

// Rotary position embedding of x [1, heads, n, d] (any strides, the head dimension contiguous) by cos, sin [n, d]
// (contiguous): x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]), each product and
// the sum rounded once, as ATen's mul, neg, cat and add give them. Returns a contiguous [1, heads, n, d].
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t heads = x.size(1), n = x.size(2), d = x.size(3), half = d / 2;
  at::Tensor result = at::empty({1, heads, n, d}, x.options());
  const float *in = x.data_ptr<float>(), *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  float* out = result.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const float* row = in + h * x.stride(1) + i * x.stride(2);
      float* target = out + (h * n + i) * d;
      for (int64_t j = 0; j < d; ++j) {
        const float rotated = j < half ? -row[j + half] : row[j - half];
        const float a = row[j] * c[i * d + j];
        const float b = rotated * s[i * d + j];
        target[j] = a + b;
      }
    }
  return result;
}

struct DecoderStack : torch::CustomClassHolder {
  std::vector<at::Tensor> input_norms, post_norms;
  std::vector<double> input_eps, post_eps;
  std::vector<Q4_1Weight> qkv, out, gate_up, down;
  int64_t q_size, kv_size, head_dim, silu_step, silu_grain;
  double scale;

  // weights: per layer [input norm, post norm, then packed and scales of qkv, o, gate_up, down] (10 tensors);
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

  // The block's queries [1, H, n, d], keys and values [1, Hkv, n, d] of layer i, rotary applied
  // (`static_cache.layer_projections`).
  std::vector<at::Tensor> project(size_t i, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
    const int64_t n = x.size(1);
    const at::Tensor h = rms_norm(x, input_norms[i], input_eps[i]);
    const std::vector<at::Tensor> parts = linear(h, qkv[i]).split_with_sizes({q_size, kv_size, kv_size}, -1);
    return {rotate(parts[0].view({1, n, -1, head_dim}).transpose(1, 2), cos, sin),
            rotate(parts[1].view({1, n, -1, head_dim}).transpose(1, 2), cos, sin),
            parts[2].view({1, n, -1, head_dim}).transpose(1, 2)};
  }

  // Layer i's output for its input x [1, n, H] and attention output [1, H, n, d] (`static_cache.layer_output`).
  at::Tensor finish(size_t i, const at::Tensor& x, const at::Tensor& attended) const {
    const at::Tensor y = x + linear(attended.transpose(1, 2).reshape({1, x.size(1), -1}), out[i]);
    const std::vector<at::Tensor> gate_and_up = linear(rms_norm(y, post_norms[i], post_eps[i]), gate_up[i]).chunk(2, -1);
    return y + linear(rowwise_silu(gate_and_up[0]) * gate_and_up[1], down[i]);
  }

  // `static_cache._cached_attention` through the kernel: the block's k, v written after the cache's first
  // ``length`` slots, q attending over the slots before ``end``.
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keys,
                    const at::Tensor& values, int64_t length, int64_t end, const std::optional<at::Tensor>& mask) const {
    const int64_t n = q.size(2);
    keys.narrow(2, length, n).copy_(k);
    values.narrow(2, length, n).copy_(v);
    return cached_attention().call(q, keys.narrow(2, 0, end), values.narrow(2, 0, end), mask,
                                   at::scalar_tensor(end, at::kLong), scale);
  }

  // Every layer over x [1, n, H] with cos, sin [1, n, d]: the input of each layer in ``capture`` is kept, and
  // ``attention(i, q, k, v)`` gives layer i's attention output [1, H, n, d] → [x after the last layer, the inputs].
  template <typename Attention>
  std::vector<at::Tensor> layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                 const std::vector<int64_t>& capture, Attention attention) const {
    const at::Tensor cos2 = cos.reshape({-1, cos.size(-1)}).contiguous();
    const at::Tensor sin2 = sin.reshape({-1, sin.size(-1)}).contiguous();
    std::vector<at::Tensor> outputs(1);
    for (size_t i = 0; i < qkv.size(); ++i) {
      if (std::find(capture.begin(), capture.end(), static_cast<int64_t>(i)) != capture.end())
        outputs.push_back(x.select(0, 0));
      const std::vector<at::Tensor> p = project(i, x, cos2, sin2);
      x = finish(i, x, attention(i, p[0], p[1], p[2]));
    }
    outputs[0] = x;
    return outputs;
  }

  std::vector<at::Tensor> run(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                              std::vector<at::Tensor> values, int64_t length, std::optional<at::Tensor> mask,
                              std::vector<int64_t> capture) {
    TORCH_CHECK(keys.size() == qkv.size() && values.size() == qkv.size(), "DecoderStack.run: one cache per layer");
    const int64_t end = length + x.size(1);
    return layers(x, cos, sin, capture, [&](size_t i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
      return attend(q, k, v, keys[i], values[i], length, end, mask);
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
    for (size_t s = 0; s < sequences; ++s)
      if (chains[s]) chain_starts.push_back(starts[s]), chain_ends.push_back(ends[s]), chain_lengths.push_back(lengths[s]);
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
        TORCH_CHECK(tree < masks.size(), "DecoderStack.run_packed: a mask for every block that is not a chain");
        alone.push_back(attend(q.narrow(2, starts[s], n), k.narrow(2, starts[s], n), v.narrow(2, starts[s], n),
                               keys_s, values_s, lengths[s], lengths[s] + n, masks[tree++]));
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
