"""Mixture-of-experts weights quantized in place: transformers 5 keeps each expert projection of a MoE
layer as one 3-D parameter ``(num_experts, out_features, in_features)`` (``MixtralExperts.gate_up_proj``
and ``.down_proj``, likewise Qwen2-MoE and DeepSeek-V3), not as ``nn.Linear`` modules.

Each expert's matrix is quantized on its own (its own groups or 2-D blocks, never spanning two experts)
and stored in buffers ``<name>_codes`` ``(E, out, row_bytes)``, ``<name>_scales`` (the scales' bytes, one
row per expert) and, for NVFP4, ``<name>_tensor_scale`` ``(E, 4)``. Around each forward the attribute
``<name>`` is a :class:`QuantizedExperts`: indexing it with an expert number (what the experts' forward
does, ``F.linear(x, self.gate_up_proj[e])``) gives that expert's
:class:`~ds_fpquant.linear.QuantizedWeight`, so the matmul runs the fused quantized linear and routing is
unchanged; any other use of the tensor sees the dequantized ``(E, out, in)`` weight. A quantized experts
module runs transformers' eager per-expert forward (its ``grouped_mm`` default would multiply the whole
dequantized stack).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from . import checks
from .api import dequantize, quantize
from .choices import ACTIVATIONS
from .linear import DequantizingTensor, QuantizedWeight, check_w8a8_weight
from .module import COMPUTE_DTYPES
from .quantized_tensor import QuantizedTensor

__all__ = ["QuantizedExperts", "expert_parameter_names", "expert_views", "install_quantized_experts",
           "quantize_experts_in_place"]


def expert_parameter_names(module: torch.nn.Module) -> List[str]:
    """The 3-D floating-point parameters of a transformers experts module (class name ending in ``Experts``)."""
    if not type(module).__name__.endswith("Experts"):
        return []
    return [name for name, p in module.named_parameters(recurse=False)
            if p is not None and p.dim() == 3 and p.is_floating_point()]


class QuantizedExperts(DequantizingTensor):
    """``(E, out, in)`` expert weights held as per-expert codes + scales; ``experts[e]`` is expert ``e``'s
    :class:`~ds_fpquant.linear.QuantizedWeight`. A tensor subclass without storage."""

    @staticmethod
    def __new__(cls, experts: List[QuantizedTensor], dtype: torch.dtype, backend: str = "auto",
                activation: Optional[str] = None):
        n, k = experts[0].shape
        self = torch.Tensor._make_wrapper_subclass(cls, (len(experts), n, k), dtype=dtype,
                                                   device=experts[0].codes.device, requires_grad=False)
        self.experts, self.weight_dtype, self.backend, self.activation = experts, dtype, backend, activation
        return self

    def __init__(self, experts, dtype, backend="auto", activation=None):
        super().__init__()

    def __repr__(self, *, tensor_contents=None):
        n, k = self.experts[0].shape
        return f"QuantizedExperts(shape={(len(self.experts), n, k)}, dtype={self.weight_dtype}, fmt={self.experts[0].fmt})"

    def dequantized(self) -> torch.Tensor:
        return torch.stack([dequantize(qt, self.weight_dtype, backend=self.backend) for qt in self.experts])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and isinstance(args[0], cls) and not kwargs:
            index = args[1]
            if isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point():
                index = int(index)
            if isinstance(index, int):
                self = args[0]
                return QuantizedWeight(self.experts[index], self.weight_dtype, self.backend, activation=self.activation)
        return cls._dense_call(func, args, kwargs)


def expert_views(module: torch.nn.Module, name: str, meta: Dict) -> List[QuantizedTensor]:
    """Each expert's :class:`QuantizedTensor` as views of the buffers of ``module.<name>`` (``meta``:
    ``module._fpq_experts[name]``)."""
    codes = getattr(module, f"{name}_codes")
    scales = getattr(module, f"{name}_scales")
    tensor_scale = getattr(module, f"{name}_tensor_scale", None)
    views = []
    for e in range(codes.shape[0]):
        s = scales[e].view(torch.float32) if meta["scale_format"] == "fp32" else scales[e]
        t = None if tensor_scale is None else tensor_scale[e].view(torch.float32).reshape(())
        views.append(QuantizedTensor(codes=codes[e], scales=s.reshape(meta["scales_shape"]), shape=meta["shape"],
                                     dtype=meta["dtype"], fmt=meta["fmt"], group_size=meta["group_size"],
                                     scale_format=meta["scale_format"], block=meta["block"], tensor_scale=t))
    return views


def quantize_experts_in_place(module: torch.nn.Module, name: str, fmt: str = "e4m3", group_size: Optional[int] = None,
                              *, compute_dtype: Optional[str] = None, backend: str = "auto",
                              activation: Optional[str] = None, **quantize_kwargs) -> Tuple[int, int]:
    """Quantize the 3-D expert parameter ``module.<name>`` ``(E, out, in)``, each expert on its own.

    Returns ``(bytes before, bytes after)``. Raises ``ValueError`` when ``name`` is not a 3-D parameter of
    ``module`` or for invalid quantization settings (before anything is changed).
    """
    weight = module._parameters.get(name)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"{type(module).__name__}.{name} must be a 3-D (experts, out, in) parameter to be "
                         f"quantized as experts")
    if activation is not None:
        checks.check_choice("activation", activation, ACTIVATIONS)
    experts = [quantize(weight[e].detach(), fmt, group_size, backend=backend, **quantize_kwargs)
               for e in range(weight.shape[0])]
    before = weight.numel() * weight.element_size()
    install_quantized_experts(module, name, experts, compute_dtype=compute_dtype, backend=backend,
                              activation=activation)
    return before, sum(qt.nbytes for qt in experts)


def _layout(qt: QuantizedTensor) -> tuple:
    """What must agree between the experts of one stack."""
    return (qt.shape, tuple(qt.scales.shape), qt.scales.dtype, qt.codes.shape, qt.codes.dtype, qt.fmt, qt.group_size,
            qt.block, qt.scale_format, qt.tensor_scale is None)


def install_quantized_experts(module: torch.nn.Module, name: str, experts: List[QuantizedTensor], *,
                              compute_dtype: Optional[str] = None, backend: str = "auto",
                              activation: Optional[str] = None) -> None:
    """Make ``module.<name>`` (a 3-D expert parameter, or its place on the meta device) the quantized
    experts ``experts`` (one :class:`QuantizedTensor` per expert, all of one shape and layout): the
    buffers described in the module docstring, and the hooks that present them to the forward.
    Used by :func:`quantize_experts_in_place` and by :func:`ds_fpquant.load_quantized`, which passes the
    codes and scales read from a checkpoint (no full-precision expert tensor is made).

    Raises ``ValueError`` for experts of different shapes or layouts, or W8A8 (``activation``) settings
    the weights do not allow, before ``module`` is changed.
    """
    if activation is not None:
        checks.check_choice("activation", activation, ACTIVATIONS)
        check_w8a8_weight(experts[0])
    first = experts[0]
    odd = [e for e, qt in enumerate(experts) if _layout(qt) != _layout(first)]
    if odd:
        raise ValueError(f"{type(module).__name__}.{name}: every expert must have the shape and layout of expert 0 "
                         f"({_layout(first)}); experts {odd} differ")
    module._parameters.pop(name, None)
    module.register_buffer(f"{name}_codes", torch.stack([qt.codes for qt in experts]))
    module.register_buffer(f"{name}_scales", torch.stack([qt.scales.contiguous().view(torch.uint8) for qt in experts]))
    if first.tensor_scale is not None:
        module.register_buffer(f"{name}_tensor_scale",
                               torch.stack([qt.tensor_scale.reshape(1).view(torch.uint8) for qt in experts]))
    setattr(module, name, None)
    metas = module.__dict__.setdefault("_fpq_experts", {})
    metas[name] = dict(shape=first.shape, scales_shape=tuple(first.scales.shape), dtype=first.dtype, fmt=first.fmt,
                       group_size=first.group_size, scale_format=first.scale_format, block=first.block,
                       backend=backend, activation=activation,
                       compute_dtype=COMPUTE_DTYPES[compute_dtype] if compute_dtype else None)
    if len(metas) == 1:  # one pair of hooks per module, for all its quantized expert parameters
        module.register_forward_pre_hook(_materialize)
        module.register_forward_hook(_release)
        # transformers' grouped_mm / batched_mm experts implementations multiply the whole 3-D weight; the
        # eager forward (the one decorated by use_experts_implementation) loops over the routed experts and
        # calls F.linear(x, weight[e]): per instance, that loop runs, each expert through the quantized linear
        if getattr(type(module).forward, "__wrapped__", None) is not None and "forward" not in module.__dict__:
            module.forward = EagerExpertsForward(module)


class EagerExpertsForward:
    """``module.forward`` of a quantized experts module: the class's eager per-expert forward (the function that
    transformers' ``use_experts_implementation`` wraps), bound to ``module``. A plain object rather than a bound
    method, so that the module pickles (a bound method pickles by its name, ``forward``, and would come back as
    the class's dispatching forward) and deep-copies."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return type(self.module).forward.__wrapped__(self.module, *args, **kwargs)


def _materialize(module, args):
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    for name, meta in module._fpq_experts.items():
        dtype = meta["compute_dtype"] or (x.dtype if x is not None else meta["dtype"])
        setattr(module, name, QuantizedExperts(expert_views(module, name, meta), dtype, meta["backend"],
                                               meta["activation"]))


def _release(module, args, output):
    for name in module._fpq_experts:
        setattr(module, name, None)
