"""One linear module for several that read the same input (q/k/v, gate/up): one kernel call, not three.

`fuse_outputs` concatenates the modules' output rows (and their per-row scales or biases) into one module of
the same kind, or returns None where the kinds or layouts differ; each output row is computed exactly as in
its own module, so the fused outputs are the parts' outputs bit for bit.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from specula.runtime.quantized_linear import (
    INT4_N_MULTIPLE,
    Q4_1_N_MULTIPLE,
    BFloat16Linear,
    Float32Linear,
    Int4Linear,
    Int8Linear,
    Q4_1Linear,
)

_ROW_TENSORS = {nn.Linear: ("weight", "bias"), Float32Linear: ("weight", "bias"), BFloat16Linear: ("weight", "bias"),
                Int8Linear: ("qweight", "scales", "bias"), Int4Linear: ("packed", "bias"),
                Q4_1Linear: ("packed", "scales", "bias")}
_COLUMN_TENSORS = {Int4Linear: ("scale_and_zero",)}


def fuse_outputs(parts: list[nn.Module]) -> nn.Module | None:
    """One linear layer computing ``torch.cat([part(x) for part in parts], -1)`` as one matmul, or None.

    The fused weight is the parts' weights stacked by output row, and each part's weight becomes a view of
    that stack, so memory is not doubled and the parts still run on their own (a `transformers` forward of
    the same model). Every kernel here computes an output column from its own weight row only, so the fused
    outputs equal the parts' bit for bit (pinned by tests on this device). None where the parts cannot be
    stacked: different kinds, input widths or compute dtypes, bias on some only, int4 rows padded to the
    kernel's multiple of 16 (q4_1's of 8), the CUDA int4 layout (tiled across rows), or any other layout
    where a probe through the fused layer does not give the parts' outputs bit for bit (torch's int4 CPU
    packing on an AVX-512 CPU tiles 64 rows, so parts of 32 rows cannot be stacked there).
    """
    first = parts[0]
    kind = type(first)
    if kind not in _ROW_TENSORS or any(type(p) is not kind or p.in_features != first.in_features
                                       or getattr(p, "compute_dtype", None) != getattr(first, "compute_dtype", None)
                                       or (p.bias is None) != (first.bias is None) for p in parts):
        return None
    if kind is Int4Linear and (first.cuda or any(p.out_features % INT4_N_MULTIPLE for p in parts)):
        return None
    if kind is Q4_1Linear and any(p.out_features % Q4_1_N_MULTIPLE for p in parts):
        return None  # a padded group of outputs would land inside the stack
    fused = copy.copy(first)  # its settings (input width, compute dtype); its tensors are replaced below
    fused._parameters, fused._buffers = dict(first._parameters), dict(first._buffers)
    fused.out_features = sum(p.out_features for p in parts)
    for name in _COLUMN_TENSORS.get(kind, ()):
        setattr(fused, name, torch.cat([getattr(p, name) for p in parts], dim=1).contiguous())
    stacks = {name: torch.cat([getattr(p, name).detach() for p in parts])
              for name in _ROW_TENSORS[kind] if getattr(first, name) is not None}
    for name, stacked in stacks.items():
        _set_tensor(fused, name, stacked)
    # A kernel may lay a weight out in tiles across rows by CPU (torch's int4 CPU packing interleaves 64 rows
    # on an AVX-512 CPU: parts of 32 rows then mix): the fused layer must give the parts' bits on a probe.
    weight = getattr(first, "weight", None)  # plain linears take inputs in their weight's dtype; kernels cast
    dtype = weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.float32
    probe = torch.randn(2, first.in_features, generator=torch.Generator().manual_seed(0)).to(stacked.device, dtype)
    with torch.no_grad():
        if not torch.equal(fused(probe), torch.cat([part(probe) for part in parts], dim=-1)):
            return None
    for name, stacked in stacks.items():
        for part, rows in zip(parts, stacked.split([getattr(p, name).shape[0] for p in parts]), strict=True):
            _set_tensor(part, name, rows)
    return fused


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Rebind a parameter or buffer ``name`` of ``module`` to ``value``, keeping which of the two it is."""
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[name] = value
