"""The weight a linear layer applies, read back, and the backward a quantized kernel lacks.

A trainer sometimes differentiates through a frozen target's layer (Medusa heads sharing a q4_1 LM head, EAGLE-1's
loss through the LM head). The int8, int4 and q4_1 kernels (`specula.runtime.quantized_linear`) have no backward:
torch raised for int8 and int4, and for q4_1 only warned and gave no gradient, so the heads trained nothing.
`KernelInputGradient` gives them one for their input, grad @ W, W the float32 matrix the kernel applies, read once
through the kernel (`dequantized_weight`) and kept on the layer (``KEPT_WEIGHT``, never pickled with it).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

KEPT_WEIGHT = "_input_gradient_weight"  # the layer's __dict__ key of its kept float32 matrix


def float_weight(module: nn.Module) -> torch.Tensor | None:
    """A float linear layer's own weight [N, K] (its dtype is the one it computes in); None for a kernel-backed
    (quantized) layer, which has no float weight and casts its input to its compute dtype itself."""
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.is_floating_point() else None


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """float32 [N, K]: the weight a (quantized or plain) linear layer applies, read back through its own kernel.

    Multiplying the identity through a quantized layer gives exactly what its kernel computes for each input
    column (every module casts its input to its compute dtype, in which 0 and 1 are exact), packing
    included, so this checks the whole path rather than a reconstruction of it. A float layer (any dtype:
    a bfloat16 `nn.Linear` would refuse a float32 identity) applies its weight as it is.
    """
    weight = float_weight(module)
    if weight is not None:  # a float layer applies its weight as it is
        return weight.detach().float()
    device = next(itertools.chain(module.parameters(), module.buffers())).device
    out = module(torch.eye(module.in_features, device=device))
    if module.bias is not None:
        out = out - module.bias.to(out.dtype)
    return out.t().float()


def kept_weight(layer: nn.Module) -> torch.Tensor:
    """float32 [N, K]: `dequantized_weight` of ``layer``, read once and kept (a trainer differentiates through the
    same frozen layer every step), again after the layer moved to another device."""
    kept = layer.__dict__.get(KEPT_WEIGHT)
    if kept is None or kept.device != next(layer.buffers()).device:
        with torch.no_grad():
            kept = dequantized_weight(layer)
        layer.__dict__[KEPT_WEIGHT] = kept
    return kept


class KernelInputGradient(torch.autograd.Function):
    """A kernel layer's product, rows [M, K'] -> [M, N'] (K', N' padded), with a backward for its input only (the
    weights are frozen buffers): grad [M, N'] -> grad [M, N] @ W, padded back to K'. For q4_1, whose kernel rounds
    each row to 8-bit codes first, that rounding passes the gradient straight through. The layer has ``kernel``,
    ``in_features``, ``out_features``, ``padded_in`` and ``input_dtype`` (`quantized_linear._KernelLinear`)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        ctx.layer = layer
        return layer.kernel(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layer = ctx.layer
        grad_rows = grad[:, :layer.out_features].float() @ kept_weight(layer)
        if layer.padded_in != layer.in_features:
            grad_rows = F.pad(grad_rows, (0, layer.padded_in - layer.in_features))
        return grad_rows.to(layer.input_dtype), None
