"""W8A8 (``activation="e4m3"``, opt-in), two ways (SPEC 8.1 and 8.3):

- dynamic (no ``input_scale``): activations quantized per token to e4m3 in 1x128 groups and multiplied by an e4m3
  weight with fp32 scales in 1x128 groups or (128, 128) blocks through ``torch._scaled_mm``'s blockwise FP8 GEMM
  on sm_90; elsewhere the same math in fp32;
- static per tensor (an fp32 ``input_scale`` ``s``, from a checkpoint: compressed-tensors FP8, ModelOpt FP8,
  AutoFP8 ``activation_scheme: "static"``): ``x_hat = decode(e4m3(sat(fl(x / s)))) * s``, times any e4m3 weight
  with fp32 scales; ``torch._scaled_mm`` with a tensorwise ``scale_a`` on CUDA where torch takes the weight's
  scales (per tensor, per output channel), elsewhere the same math in fp32.

:func:`check_activation` is the one check of an ``activation`` argument (and of the weight and input scale it is
used with) for every layer that takes one.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional

import torch

from ds_fpquant.linear.weight_only import rounded_bias, weight_only_linear
from ds_fpquant.numerics import checks, codec
from ds_fpquant.numerics.choices import ACTIVATIONS
from ds_fpquant.numerics.formats import W8A8_GROUP, get_format, w8a8_weight_problem
from ds_fpquant.tensor.quantize import dequantize, quantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["check_activation", "check_w8a8_weight", "check_static_weight", "check_input_scale",
           "static_quantize_activations", "w8a8_linear", "static_w8a8_linear"]

_log = logging.getLogger("ds_fpquant")

#: Activation formats of the W8A8 path: e4m3 codes with fp32 scales in 1x128 groups per token.
_w8a8_unavailable: Dict[str, str] = {}  # device -> why it cannot run torch's blockwise FP8 GEMM at all


_w8a8_logged: set = set()  # reasons already logged


def check_activation(activation: Optional[str], qt: Optional[QuantizedTensor] = None,
                     input_scale: Optional[torch.Tensor] = None) -> None:
    """Check an ``activation`` argument: ``None`` (weight-only) or one of ``ACTIVATIONS`` (``"e4m3"``: W8A8), and,
    with W8A8 and a weight ``qt``, that the weight fits the W8A8 path: dynamic (``input_scale=None``,
    :func:`check_w8a8_weight`) or static per tensor (:func:`check_input_scale`, :func:`check_static_weight`).

    Raises:
        TypeError, ValueError: naming ``activation``, ``input_scale`` or the weight's settings; an
            ``input_scale`` without ``activation="e4m3"``.
    """
    if activation is None:
        if input_scale is not None:
            raise ValueError("input_scale is given but activation=None; static activation quantization needs "
                             "activation='e4m3' (or give no input_scale for weight-only)")
        return
    checks.check_choice("activation", activation, ACTIVATIONS)
    if input_scale is not None:
        check_input_scale(input_scale)
        if qt is not None:
            check_static_weight(qt)
    elif qt is not None:
        check_w8a8_weight(qt)


def check_input_scale(input_scale) -> None:
    """``TypeError`` / ``ValueError`` unless ``input_scale`` is a static per-tensor activation scale: a 0-dim
    float32 tensor (one value, as checkpoints store it once widened), finite and > 0."""
    if not isinstance(input_scale, torch.Tensor):
        raise TypeError(f"input_scale must be a 0-dim float32 torch.Tensor, got {type(input_scale).__name__}")
    if input_scale.dtype != torch.float32 or input_scale.dim() != 0:
        raise ValueError(f"input_scale must be a 0-dim float32 tensor; got {input_scale.dtype} of shape "
                         f"{tuple(input_scale.shape)}")
    if input_scale.device.type != "meta" and not torch.compiler.is_compiling():  # a traced graph reads no value
        value = float(input_scale)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"input_scale={value!r} must be finite and > 0 (it divides the activations)")


def check_static_weight(qt: QuantizedTensor) -> None:
    """``ValueError`` unless ``qt`` fits static per-tensor W8A8: e4m3 codes with fp32 scales in any layout (per
    tensor, per channel, 2-D blocks, row groups)."""
    if qt.fmt != "e4m3" or qt.scale_format != "fp32":
        raise ValueError(f"qt: static W8A8 (activation='e4m3' with an input_scale) needs e4m3 weights with fp32 "
                         f"scales; got fmt={qt.fmt!r}, scale_format={qt.scale_format!r}")


def check_w8a8_weight(qt: QuantizedTensor) -> None:
    """``ValueError`` unless ``qt`` fits the blockwise FP8 GEMM of the W8A8 path: e4m3 with fp32 scales in
    groups of 128 along ``in_features`` (1x128) or in (128, 128) blocks (DeepSeek-V3 style)."""
    problem = w8a8_weight_problem(qt.fmt, qt.scale_format, qt.group_size, qt.block)
    if problem:
        raise ValueError(f"qt: {problem}")


def _scaled_mm_blockwise(xq: QuantizedTensor, qt: QuantizedTensor, out_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``torch._scaled_mm`` with 1x128 activation scales and 1x128 or 128x128 weight scales, or ``None`` (each
    reason logged once) when it cannot run here.

    Layouts as torch's ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` checks them (``get_joint_scaling`` tests
    ``a`` with ``scale_a`` and ``b.t()`` with ``scale_b.t()``): 1x128 scales of an ``(R, K)`` operand are
    ``(R, ceil(K/128))`` with strides ``(1, R)``; 128x128 scales are ``(ceil(R/128), ceil(K/128))`` row-major.
    ``_check_deepseek_support``: only sm_90 (major 9), cuBLASLt >= 12.9."""
    device = str(xq.codes.device)
    m, k = xq.shape
    n = qt.shape[0]
    if device not in _w8a8_unavailable and torch.cuda.get_device_capability(xq.codes.device)[0] != 9:
        _w8a8_unavailable[device] = "torch runs the 1x128/128x128 blockwise FP8 GEMM on sm_90 only"  # device-wide
    reason = _w8a8_unavailable.get(device)
    if reason is None and (k % 16 or n % 16):
        reason = f"torch._scaled_mm needs in_features and out_features divisible by 16 (got {k}, {n})"
    if reason is None:
        a = xq.codes.view(torch.float8_e4m3fn)  # (m, k) row-major
        b = qt.codes.contiguous().view(torch.float8_e4m3fn).t()  # (k, n) column-major, as torch._scaled_mm wants
        scale_a = xq.scales.t().contiguous().t()  # (m, ceil(k/128)), strides (1, m)
        # scale_b.t() must be the weight's scales: 128x128 as stored (row-major), 1x128 with strides (1, n)
        scale_b = qt.scales.contiguous().t() if qt.block is not None else qt.scales.t().contiguous()
        try:
            return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError) as exc:
            reason = f"torch._scaled_mm refused the blockwise scales: {str(exc).splitlines()[0]}"
    if reason not in _w8a8_logged:  # each distinct reason once; shape reasons are per layer, not cached
        _w8a8_logged.add(reason)
        _log.warning(f"ds_fpquant: W8A8 on {device} runs as dequantized e4m3 activations times the weight, not "
                     f"an FP8 GEMM: {reason}")
    return None


def _w8a8(x2: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    """W8A8: ``x`` quantized per token to e4m3 in 1x128 groups (this project's quantize, fp32 scales), then the
    FP8 GEMM on CUDA; elsewhere (and where the GEMM is not available) the same math in fp32: the dequantized
    activations times the weight, one rounding to ``x``'s dtype."""
    xq = quantize(x2, "e4m3", W8A8_GROUP, backend=backend)
    b32 = None if bias is None else rounded_bias(bias, x2.dtype).float()  # SPEC 8.1: rounded to x's dtype
    y = _scaled_mm_blockwise(xq, qt, torch.float32) if x2.is_cuda and x2.shape[0] else None
    if y is None:
        y = weight_only_linear(dequantize(xq, torch.float32, backend=backend), qt, b32, backend)
    elif b32 is not None:
        y = y + b32  # in fp32, then one rounding to x's dtype, as on every other path
    return y.to(x2.dtype)


def w8a8_linear(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    """The W8A8 forward of :func:`linear` (the body of the ``ds_fpquant::w8a8_linear`` custom op)."""
    n, k = qt.shape
    x2 = x.reshape(math.prod(x.shape[:-1]), k).resolve_neg().resolve_conj().contiguous()
    return _w8a8(x2, qt, bias, backend).reshape(*x.shape[:-1], n)


_E4M3 = get_format("e4m3")


def static_quantize_activations(x: torch.Tensor, input_scale: torch.Tensor):
    """Static per-tensor e4m3 quantization of activations (SPEC 8.3): ``v = fl(x / s)`` (one fp32 division, ``x``
    widened exactly), saturated to ``+-448`` (a finite ``x`` whose ``v`` overflows included), rounded to e4m3 to
    nearest even (SPEC 4, subnormals and the sign of zero kept); NaN and +-Inf ``x`` give the NaN code (``0x7F``,
    ``0xFF`` with the sign bit: SPEC 3.3, e4m3 has no Inf). The dequantized value is ``x_hat = fl(decode(c) * s)``.

    Args:
        x: fp32 / fp16 / bf16 tensor, any shape.
        input_scale: the scale ``s``, a 0-dim fp32 tensor, finite and > 0 (:func:`check_input_scale`), on
            ``x``'s device.

    Returns:
        ``(codes, x_hat)``: uint8 e4m3 codes shaped like ``x``, and ``x_hat`` fp32 shaped like ``x``.
    """
    s = input_scale.to(device=x.device, dtype=torch.float32)
    x32 = x.float()
    v = x32 / s
    finite = torch.isfinite(x32)
    # finite x: saturate (also where x / s overflowed to Inf); NaN / Inf x stay non-finite: NaN code (SPEC 3.3)
    v = torch.where(finite, v.clamp(-_E4M3.fmax, _E4M3.fmax), x32)
    codes = codec.encode(v, torch.ones((), dtype=torch.float32, device=x.device), _E4M3).to(torch.uint8)
    return codes, codec.decode(codes, _E4M3) * s


_static_logged: set = set()  # reasons already logged


def _per_tensor_or_channel(qt: QuantizedTensor) -> Optional[str]:
    """``"tensor"`` (one weight scale), ``"channel"`` (one per output row), or ``None`` (more per row)."""
    n, k = qt.shape
    cols = 1 if qt.group_size >= k else math.ceil(k / qt.group_size)
    if cols != 1:
        return None
    rows = 1 if qt.block is None else min(qt.block[0], max(n, 1))
    return "tensor" if rows >= n else ("channel" if rows == 1 else None)


def _scaled_mm_tensorwise(codes: torch.Tensor, input_scale: torch.Tensor, qt: QuantizedTensor) -> Optional[torch.Tensor]:
    """``torch._scaled_mm`` of the static activation codes ``(M, K)`` (tensorwise ``scale_a``) and the e4m3 weight
    (tensorwise ``scale_b`` for one weight scale; rowwise scales, ``scale_a`` expanded to ``(M, 1)``, for one per
    output channel), fp32 out; ``None`` (each reason logged once) where it cannot run here."""
    m, k = codes.shape
    n = qt.shape[0]
    kind = _per_tensor_or_channel(qt)
    if kind is None:
        reason = "torch._scaled_mm takes one weight scale per tensor or per output channel, not per group or block"
    elif k % 16 or n % 16:
        reason = f"torch._scaled_mm needs in_features and out_features divisible by 16 (got {k}, {n})"
    else:
        a = codes.view(torch.float8_e4m3fn)
        b = qt.codes.contiguous().view(torch.float8_e4m3fn).reshape(n, k).t()  # (k, n) column-major
        s = input_scale.to(device=codes.device, dtype=torch.float32)
        if kind == "tensor":
            scale_a, scale_b = s.reshape(()), qt.scales.reshape(()).float()
        else:  # rowwise: torch pairs rowwise scale_b with a rowwise scale_a
            scale_a = s.reshape(1, 1).expand(m, 1).contiguous()
            scale_b = qt.scales.reshape(1, n).float().contiguous()
        try:
            return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError) as exc:
            reason = f"torch._scaled_mm refused the scales: {str(exc).splitlines()[0]}"
    if reason not in _static_logged:
        _static_logged.add(reason)
        _log.warning(f"ds_fpquant: static W8A8 on {codes.device} runs as dequantized e4m3 activations times the "
                     f"weight, not an FP8 GEMM: {reason}")
    return None


def static_w8a8_linear(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor],
                       input_scale: torch.Tensor, backend: str) -> torch.Tensor:
    """The static per-tensor W8A8 forward of :func:`linear` (the body of the ``ds_fpquant::static_w8a8_linear``
    custom op, SPEC 8.3): ``x_hat`` of :func:`static_quantize_activations` times the weight, fp32 sums, the bias
    added in fp32, one rounding to ``x``'s dtype. On CUDA ``torch._scaled_mm`` (tensorwise / rowwise scales) where
    it runs; elsewhere (CPU, groups or blocks of weight scales) ``x_hat`` in fp32 through the weight-only linear
    (SPEC 8.1)."""
    n, k = qt.shape
    x2 = x.reshape(math.prod(x.shape[:-1]), k).resolve_neg().resolve_conj().contiguous()
    codes, x_hat = static_quantize_activations(x2, input_scale)
    b32 = None if bias is None else rounded_bias(bias, x2.dtype).float()  # rounded to x's dtype, added in fp32
    y = _scaled_mm_tensorwise(codes, input_scale, qt) if x2.is_cuda and x2.shape[0] and n and k else None
    if y is None:
        y = weight_only_linear(x_hat, qt, b32, backend)
    elif b32 is not None:
        y = y + b32
    return y.to(x2.dtype).reshape(*x.shape[:-1], n)
