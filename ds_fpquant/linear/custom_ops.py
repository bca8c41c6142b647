"""The quantized linear and the weight dequantize as ``torch.library`` custom ops, so that
``torch.compile(model, fullgraph=True)`` and ``torch.export`` trace a quantized model in one graph.

- ``ds_fpquant::linear(x, codes, scales, tensor_scale, bias, in_features, fmt, group_size, block,
  scale_format, backend) -> Tensor``: :func:`ds_fpquant.linear.linear` without W8A8, ``(..., out)`` of
  ``x``'s dtype. Differentiable in ``x`` and ``bias`` (the backward multiplies by the dequantized weight;
  the quantized weight gets no gradient).
- ``ds_fpquant::w8a8_linear(...)``: the same arguments, :func:`ds_fpquant.linear.linear` with
  ``activation="e4m3"`` (W8A8: x quantized per token to e4m3); its backward passes the activation
  quantization straight through (the gradient of the weight-only op).
- ``ds_fpquant::static_w8a8_linear(x, codes, scales, tensor_scale, bias, input_scale, in_features, fmt,
  group_size, block, scale_format, backend)``: :func:`ds_fpquant.linear.linear` with ``activation="e4m3"`` and
  an ``input_scale`` (static per-tensor W8A8, SPEC 8.3); backward as ``w8a8_linear``'s (straight through).
- ``ds_fpquant::dequantize_weight(codes, scales, tensor_scale, in_features, fmt, group_size, block,
  scale_format, dtype, backend) -> Tensor``: :func:`ds_fpquant.dequantize` of a 2-D weight.

Each linear op has a flop formula (``torch.utils.flop_counter``: ``2 M N K`` as for ``mm``, ``M`` the rows of ``x``,
``N`` the weight's rows, ``K`` its columns), so ``FlopCounterMode`` counts a quantized forward as the dense one; and a
vmap rule (``torch.func.vmap``): a batched ``x`` is one call over the batch as more rows; batched weights, biases or
input scales run one call per batch element, stacked (the same bits as the calls one by one).

The arguments are the fields of a 2-D row-grouped or 2-D-blocked :class:`~ds_fpquant.QuantizedTensor`
(``block`` as ``[Br, Bc]`` or ``None``). Each op has a fake (meta) implementation giving the output's
shape and dtype; the real one picks the backend (compiled op or torch reference) at run time, outside
the traced graph, so no lock, ``.item()`` or denormal probe is traced.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch.utils.flop_counter import register_flop_formula

from ds_fpquant.linear.w8a8 import static_w8a8_linear, w8a8_linear
from ds_fpquant.linear.weight_only import weight_only_linear
from ds_fpquant.tensor.quantize import dequantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["linear_op", "w8a8_linear_op", "static_w8a8_linear_op", "dequantize_weight", "as_op_args",
           "check_no_func_grad"]


def _weight(codes, scales, tensor_scale, in_features: int, fmt: str, group_size: int, block, scale_format: str,
            dtype: torch.dtype) -> QuantizedTensor:
    return QuantizedTensor(codes=codes, scales=scales, shape=torch.Size((codes.shape[0], in_features)), dtype=dtype,
                           fmt=fmt, group_size=group_size, block=tuple(block) if block else None,
                           scale_format=scale_format, tensor_scale=tensor_scale)


def as_op_args(qt: QuantizedTensor):
    """The weight arguments of the ops for ``qt``: ``(codes, scales, tensor_scale, in_features, fmt,
    group_size, block, scale_format)``."""
    return (qt.codes, qt.scales, qt.tensor_scale, qt.shape[1], qt.fmt, qt.group_size,
            list(qt.block) if qt.block else None, qt.scale_format)


@torch.library.custom_op("ds_fpquant::dequantize_weight", mutates_args=())
def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: Optional[torch.Tensor], in_features: int,
                      fmt: str, group_size: int, block: Optional[List[int]], scale_format: str, dtype: torch.dtype,
                      backend: str) -> torch.Tensor:
    qt = _weight(codes, scales, tensor_scale, in_features, fmt, group_size, block, scale_format, dtype)
    return dequantize(qt, dtype, backend=backend)


@dequantize_weight.register_fake
def _dequantize_weight_fake(codes, scales, tensor_scale, in_features, fmt, group_size, block, scale_format, dtype,
                            backend):
    return codes.new_empty((codes.shape[0], in_features), dtype=dtype)


def _linear_fake(x, codes, scales, tensor_scale, bias, in_features, fmt, group_size, block, scale_format, backend):
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, codes, scales, tensor_scale, bias, *weight_args = inputs
    ctx.save_for_backward(codes, scales, tensor_scale)
    ctx.weight_args = weight_args  # in_features, fmt, group_size, block, scale_format, backend
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad_y):
    codes, scales, tensor_scale = ctx.saved_tensors
    in_features, fmt, group_size, block, scale_format, backend = ctx.weight_args
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        weight = dequantize_weight(codes, scales, tensor_scale, in_features, fmt, group_size, block, scale_format,
                                   grad_y.dtype, backend)
        grad_x = grad_y @ weight
    if ctx.has_bias and ctx.needs_input_grad[4]:
        grad_bias = grad_y.reshape(-1, grad_y.shape[-1]).sum(0)
    return grad_x, None, None, None, grad_bias, None, None, None, None, None, None


def _linear_op(name: str, body):
    """The custom op ``ds_fpquant::<name>`` running ``body(x, qt, bias, backend)``, with the
    fake implementation and the backward (through the dequantized weight; for W8A8 the activation quantization
    passes the gradient straight through) that both linears share."""

    def forward(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tensor_scale: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], in_features: int, fmt: str, group_size: int, block: Optional[List[int]],
                scale_format: str, backend: str) -> torch.Tensor:
        qt = _weight(codes, scales, tensor_scale, in_features, fmt, group_size, block, scale_format, x.dtype)
        return body(x, qt, bias, backend)

    forward.__name__ = forward.__qualname__ = name
    op = torch.library.custom_op(f"ds_fpquant::{name}", forward, mutates_args=())
    op.register_fake(_linear_fake)
    op.register_autograd(_linear_backward, setup_context=_linear_setup)
    return op


#: ``ds_fpquant::linear``: the weight-only forward.
linear_op = _linear_op("linear", weight_only_linear)
#: ``ds_fpquant::w8a8_linear``: the W8A8 forward.
w8a8_linear_op = _linear_op("w8a8_linear", w8a8_linear)


@torch.library.custom_op("ds_fpquant::static_w8a8_linear", mutates_args=())
def static_w8a8_linear_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                          tensor_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor], input_scale: torch.Tensor,
                          in_features: int, fmt: str, group_size: int, block: Optional[List[int]], scale_format: str,
                          backend: str) -> torch.Tensor:
    """``ds_fpquant::static_w8a8_linear``: the static per-tensor W8A8 forward (SPEC 8.3)."""
    qt = _weight(codes, scales, tensor_scale, in_features, fmt, group_size, block, scale_format, x.dtype)
    return static_w8a8_linear(x, qt, bias, input_scale, backend)


@static_w8a8_linear_op.register_fake
def _static_w8a8_linear_fake(x, codes, scales, tensor_scale, bias, input_scale, in_features, fmt, group_size, block,
                             scale_format, backend):
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def _static_setup(ctx, inputs, output):
    x, codes, scales, tensor_scale, bias, input_scale, *rest = inputs
    _linear_setup(ctx, (x, codes, scales, tensor_scale, bias, *rest), output)


def _static_backward(ctx, grad_y):
    grads = _linear_backward(ctx, grad_y)  # the activation quantization passes the gradient straight through
    return (*grads[:5], None, *grads[5:])


static_w8a8_linear_op.register_autograd(_static_backward, setup_context=_static_setup)


def _linear_flops(x_shape, *args, out_shape=None, **kwargs) -> int:
    """``2 M N K`` (as ``torch.utils.flop_counter`` counts ``mm``): ``x`` ``(..., K)``, out ``(..., N)``."""
    return 2 * math.prod(out_shape) * x_shape[-1]


def check_no_func_grad(*tensors) -> None:
    """``NotImplementedError`` where a ``torch.func`` gradient transform (``grad``, ``jacrev``, ``vjp``, ``jvp``)
    tracks one of ``tensors``: torch runs a custom op's ``register_autograd`` backward under ``torch.autograd`` only
    (torch 2.13 makes it an ``autograd.Function`` without ``setup_context``, which ``torch.func`` refuses). ``vmap``
    is supported; gradients come from ``loss.backward()`` / ``torch.autograd.grad``."""
    if any(isinstance(t, torch.Tensor) and torch._C._functorch.is_gradtrackingtensor(t) for t in tensors):
        raise NotImplementedError("ds_fpquant's quantized linear under torch.func.grad / jacrev / vjp / jvp: torch "
                                  "runs a custom op's backward (ds_fpquant::linear, w8a8_linear, static_w8a8_linear) "
                                  "under torch.autograd only; use loss.backward() or torch.autograd.grad (vmap works)")


def _vmap_rule(op):
    """``torch.library.register_vmap`` rule of ``op`` (``x`` first): a batched ``x`` alone is one call with the batch
    as leading rows (the op takes any leading dims); any other batched argument: one call per batch element."""
    def rule(info, in_dims, *args):
        check_no_func_grad(args[0], args[4])  # x, bias (grad of vmap)
        if all(d is None for d in in_dims[1:]):
            return op(args[0].movedim(in_dims[0], 0), *args[1:]), 0
        calls = [op(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims)))
                 for i in range(info.batch_size)]
        return torch.stack(calls), 0

    return rule


register_flop_formula([torch.ops.ds_fpquant.linear, torch.ops.ds_fpquant.w8a8_linear,
                       torch.ops.ds_fpquant.static_w8a8_linear])(_linear_flops)
for _op in (linear_op, w8a8_linear_op, static_w8a8_linear_op):
    torch.library.register_vmap(_op, _vmap_rule(_op))
