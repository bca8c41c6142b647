"""``linear(x, qt, bias)``: the functional quantized linear (docs/api.md, SPEC 8); weight-only
(:mod:`ds_fpquant.linear.weight_only`) or W8A8 (:mod:`ds_fpquant.linear.w8a8`), eager or through the custom ops
(:mod:`ds_fpquant.linear.custom_ops`) when autograd or ``torch.compile`` needs them.
"""

from __future__ import annotations

from typing import Optional

import torch

from ds_fpquant.linear.custom_ops import check_no_func_grad, linear_op, static_w8a8_linear_op, w8a8_linear_op
from ds_fpquant.linear.w8a8 import check_activation, static_w8a8_linear, w8a8_linear
from ds_fpquant.linear.weight_only import weight_only_linear
from ds_fpquant.numerics import checks
from ds_fpquant.numerics.choices import BACKENDS
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["linear"]


def _check(x, qt, bias, backend) -> None:
    checks.check_tensor("x", x)
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a ds_fpquant.QuantizedTensor, got {type(qt).__name__}")
    qt.validate()
    checks.check_choice("backend", backend, BACKENDS)
    if len(qt.shape) != 2 or qt.grouping != "row":
        raise ValueError(f"qt must hold a 2-D (out_features, in_features) weight with row grouping or 2-D blocks; "
                         f"got shape {tuple(qt.shape)}, grouping={qt.grouping!r}")
    if x.dim() < 1 or x.shape[-1] != qt.shape[1]:
        raise ValueError(f"x has shape {tuple(x.shape)}; its last dim must be in_features={qt.shape[1]}")
    checks.check_device("qt.codes", qt.codes, x.device)
    if bias is not None:
        checks.check_tensor("bias", bias)
        if tuple(bias.shape) != (qt.shape[0],):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({qt.shape[0]},)")
        checks.check_device("bias", bias, x.device)


def linear(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           backend: str = "auto", activation: Optional[str] = None,
           input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The quantized linear, weight decoded on the fly (SPEC 8.1): weight-only,
    ``y[m, n] = sum_g s[n, g] * (sum_{j in g} x[m, j] * decode(q[n, j])) + bias[n]`` in fp32, one rounding
    to ``x``'s dtype; within SPEC 8.2's bound of the fp64 ``x @ dequantize(qt, fp64)^T + bias``.

    Args:
        x: fp32 / fp16 / bf16 activations ``(..., in_features)``, any strides.
        qt: the quantized weight, ``qt.shape == (out_features, in_features)``, row grouping or 2-D
            blocks; any element format, fp32 or E8M0 scales, or NVFP4. Codes and scales of any strides, as
            ``dequantize`` takes them (non-contiguous ones are copied once per call).
        bias: optional ``(out_features,)`` tensor, rounded to ``x``'s dtype and added in fp32 before the one
            rounding.
        backend: ``"auto"`` (the compiled op for the tensors' device: the fused CPU kernel, or on CUDA the
            GEMV up to ``GEMV_MAX_ROWS`` rows of ``x`` and panels of decoded rows + cuBLAS beyond),
            ``"cpu"``, ``"cuda"`` or ``"torch"`` (SPEC 8.1's formula in torch: a batched fp32 matmul per group,
            times the scales, summed over groups).
        activation: ``None`` (weight-only, the default) or ``"e4m3"`` (W8A8, opt-in: it changes the numerics):
            ``x`` is quantized per token to e4m3 with fp32 scales in groups of 128, and multiplied by an e4m3
            weight with fp32 scales in groups of 128 or (128, 128) blocks through ``torch._scaled_mm``'s
            blockwise FP8 GEMM on sm_90+; elsewhere the same math in fp32 (dequantized activations times the
            weight); the bias, rounded to ``x``'s dtype, is added in fp32 before the one rounding to ``x``'s dtype
            (the rule of every path). Backward passes the
            activation quantization straight through.
        input_scale: with ``activation="e4m3"``: a 0-dim fp32 tensor ``s`` (finite, > 0, on ``x``'s device) for
            static per-tensor W8A8 (SPEC 8.3) instead of the dynamic 1x128 groups: ``x_hat =
            fl(decode(e4m3(sat(fl(x / s)))) * s)`` times any e4m3 weight with fp32 scales (per tensor, per channel,
            blocks, groups); ``torch._scaled_mm`` with a tensorwise ``scale_a`` on CUDA for one weight scale per
            tensor or per output channel, else (and on CPU) ``x_hat`` in fp32 through the weight-only formula.

    Returns:
        ``(..., out_features)`` tensor of ``x``'s dtype. Differentiable with respect to ``x`` (and
        ``bias``); the quantized weight gets no gradient. With bf16 ``x`` the CPU's bf16 dot product
        (``vdpbf16ps``, and torch's own bf16 matmul in the panel path) reads bf16 values below 2^-126
        (subnormals, about 1e-38) as zero, as torch's bf16 ``F.linear`` on such a CPU does. Safe to call
        from several threads at once. ``FlopCounterMode`` counts ``2 M N K``; ``torch.func.vmap`` runs it over
        batched ``x`` (one call) or batched weights / biases (one call per element).

    Raises:
        TypeError, ValueError: ``x``, ``qt``, ``bias`` or ``input_scale`` of the wrong type, dtype, shape or
            device; an ``input_scale`` without ``activation="e4m3"``.
        NotImplementedError: under ``torch.func.grad`` / ``jacrev`` / ``vjp`` / ``jvp`` (torch runs a custom op's
            backward under ``torch.autograd`` only: use ``loss.backward()`` or ``torch.autograd.grad``).
    """
    _check(x, qt, bias, backend)
    check_activation(activation, qt, input_scale)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if not torch.compiler.is_compiling():  # (traced code always takes the custom ops)
        # the custom op also where a dispatch mode (FlopCounterMode, a profiler's mode) or a torch.func transform
        # (vmap) runs, so that they see one ds_fpquant op (its flop formula, its vmap rule), not the body's calls
        needs_grad = needs_grad or torch._C._len_torch_dispatch_stack() > 0 or \
            torch._C._functorch.maybe_current_level() is not None
        check_no_func_grad(x, bias)
    if input_scale is not None:
        checks.check_device("input_scale", input_scale, x.device)
        if not needs_grad and not torch.compiler.is_compiling():
            return static_w8a8_linear(x, qt, bias, input_scale, backend)
        return static_w8a8_linear_op(x, qt.codes, qt.scales, qt.tensor_scale, bias, input_scale, qt.shape[1], qt.fmt,
                                     qt.group_size, list(qt.block) if qt.block else None, qt.scale_format, backend)
    if not needs_grad and not torch.compiler.is_compiling():  # eager inference: the op's body, no dispatcher
        return weight_only_linear(x, qt, bias, backend) if activation is None else w8a8_linear(x, qt, bias, backend)
    # the custom ops ds_fpquant::linear / ds_fpquant::w8a8_linear: torch.compile and torch.export trace them; autograd
    op = linear_op if activation is None else w8a8_linear_op
    return op(x, qt.codes, qt.scales, qt.tensor_scale, bias, qt.shape[1], qt.fmt, qt.group_size,
              list(qt.block) if qt.block else None, qt.scale_format, backend)
