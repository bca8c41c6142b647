"""Mixture-of-experts weights quantized in place: transformers 5 keeps each expert projection of a MoE
layer as one 3-D parameter ``(num_experts, out_features, in_features)`` (``MixtralExperts.gate_up_proj``
and ``.down_proj``, likewise Qwen2-MoE and DeepSeek-V3), not as ``nn.Linear`` modules.

Each expert's matrix is quantized on its own (its own groups or 2-D blocks, never spanning two experts)
and stored in buffers ``<name>_codes`` ``(E, out, row_bytes)``, ``<name>_scales`` (the scales' bytes, one
row per expert) and, for NVFP4, ``<name>_tensor_scale`` ``(E, 4)``. Around each forward the attribute
``<name>`` is a :class:`QuantizedExperts`: indexing it with an expert number (what the experts' forward
does, ``F.linear(x, self.gate_up_proj[e])``) gives that expert's
:class:`~ds_fpquant.linear.weights.QuantizedWeight`, so the matmul runs the fused quantized linear and routing is
unchanged; any other use of the tensor sees the dequantized ``(E, out, in)`` weight. A quantized experts
module runs transformers' eager per-expert forward (its ``grouped_mm`` default would multiply the whole
dequantized stack).

gpt-oss (``GptOssExperts``, declared ``is_transposed=True`` by transformers' ``use_experts_implementation``)
holds its experts as ``(E, in, out)`` and computes ``x @ w[e]``. Its experts are quantized as the ``(out, in)``
matrices ``w[e].T`` (groups along ``in``, as for every other linear weight and as gpt-oss's own MXFP4
checkpoints store them), the buffers hold those, and the stack is presented as the ``(E, in, out)`` parameter
(:func:`expert_matrix_shape`, :func:`is_transposed_experts`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ds_fpquant.linear.w8a8 import check_activation
from ds_fpquant.nn.quantized_params import install
from ds_fpquant.tensor.quantize import quantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["install_quantized_experts", "quantize_experts_in_place", "EagerExpertsForward", "is_transposed_experts",
           "expert_matrix_shape", "expert_matrix"]


def is_transposed_experts(module: torch.nn.Module) -> bool:
    """Whether the 3-D expert parameters of ``module`` are ``(E, in, out)`` (transformers' ``is_transposed``
    experts, e.g. ``GptOssExperts``) rather than ``(E, out, in)``."""
    return getattr(module, "is_transposed", False) is True


def expert_matrix_shape(module: torch.nn.Module, name: str) -> Tuple[int, int]:
    """``(out, in)`` of each expert's matrix of the 3-D parameter ``module.<name>`` (read from the parameter,
    which may be on the meta device): its last two sides, swapped for transposed experts."""
    _, a, b = module._parameters[name].shape
    return (b, a) if is_transposed_experts(module) else (a, b)


def expert_matrix(module: torch.nn.Module, stack: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e``'s ``(out, in)`` matrix of ``stack``, a tensor laid out as ``module``'s expert parameters
    (a view: ``stack[e]``, transposed for transposed experts)."""
    return stack[e].t() if is_transposed_experts(module) else stack[e]


def quantize_experts_in_place(module: torch.nn.Module, name: str, fmt: str = "e4m3", group_size: Optional[int] = None,
                              *, compute_dtype: Optional[str] = None, backend: str = "auto",
                              activation: Optional[str] = None, input_scale: Optional[torch.Tensor] = None,
                              **quantize_kwargs) -> Tuple[int, int]:
    """Quantize the 3-D expert parameter ``module.<name>`` ``(E, out, in)`` (``(E, in, out)`` for transposed
    experts, quantized as the ``(out, in)`` matrices), each expert on its own.

    Returns ``(bytes before, bytes after)``. Raises ``ValueError`` when ``name`` is not a 3-D parameter of
    ``module`` or for invalid quantization settings (before anything is changed).
    """
    weight = module._parameters.get(name)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"{type(module).__name__}.{name} must be a 3-D (experts, out, in) parameter to be "
                         f"quantized as experts")
    check_activation(activation, input_scale=input_scale)
    experts = [quantize(expert_matrix(module, weight.detach(), e), fmt, group_size, backend=backend, **quantize_kwargs)
               for e in range(weight.shape[0])]
    before = weight.numel() * weight.element_size()
    install_quantized_experts(module, name, experts, compute_dtype=compute_dtype, backend=backend,
                              activation=activation, input_scale=input_scale)
    return before, sum(qt.nbytes for qt in experts)


def _layout(qt: QuantizedTensor) -> tuple:
    """What must agree between the experts of one stack."""
    return (qt.shape, tuple(qt.scales.shape), qt.scales.dtype, qt.codes.shape, qt.codes.dtype, qt.fmt, qt.group_size,
            qt.block, qt.scale_format, qt.tensor_scale is None)


def install_quantized_experts(module: torch.nn.Module, name: str, experts: List[QuantizedTensor], *,
                              compute_dtype: Optional[str] = None, backend: str = "auto",
                              activation: Optional[str] = None, input_scale: Optional[torch.Tensor] = None) -> None:
    """Make ``module.<name>`` (a 3-D expert parameter, or its place on the meta device) the quantized
    experts ``experts`` (one :class:`QuantizedTensor` per expert of its ``(out, in)`` matrix,
    :func:`expert_matrix_shape`, all of one shape and layout): the
    buffers described in the module docstring, and the hooks that present them to the forward.
    Used by :func:`quantize_experts_in_place` and by :func:`ds_fpquant.load_quantized`, which passes the
    codes and scales read from a checkpoint (no full-precision expert tensor is made).

    Static per-tensor W8A8 (SPEC 8.3): ``activation="e4m3"`` with ``input_scale``, one 0-dim fp32 scale (finite, > 0)
    for the whole stack, kept as the buffer ``<name>_input_scale`` (fp32 under ``model.half()``); every expert's
    ``F.linear`` then runs :func:`~ds_fpquant.linear.w8a8.static_w8a8_linear` with it. Only e4m3 experts with fp32
    scales.

    Raises ``TypeError`` / ``ValueError`` for experts of different shapes or layouts, or W8A8 (``activation``,
    ``input_scale``) settings the weights do not allow, before ``module`` is changed.
    """
    check_activation(activation, experts[0], input_scale)
    first = experts[0]
    held = module._parameters.get(name)
    if isinstance(held, torch.Tensor) and held.dim() == 3 and (
            len(experts) != held.shape[0] or tuple(first.shape) != expert_matrix_shape(module, name)):
        raise ValueError(f"{type(module).__name__}.{name} {tuple(held.shape)} needs {held.shape[0]} experts of "
                         f"{expert_matrix_shape(module, name)} (out, in); got {len(experts)} of {tuple(first.shape)}")
    odd = [e for e, qt in enumerate(experts) if _layout(qt) != _layout(first)]
    if odd:
        raise ValueError(f"{type(module).__name__}.{name}: every expert must have the shape and layout of expert 0 "
                         f"({_layout(first)}); experts {odd} differ")
    install(module, name, experts, stacked=True, compute_dtype=compute_dtype, backend=backend, activation=activation,
            transposed=is_transposed_experts(module), input_scale=input_scale)
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
