"""W8A8 (``activation="e4m3"``, opt-in): activations quantized per token to e4m3 in 1x128 groups and multiplied
by an e4m3 weight with fp32 scales in 1x128 groups or (128, 128) blocks through ``torch._scaled_mm``'s blockwise
FP8 GEMM on sm_90; elsewhere the same math in fp32. :func:`check_activation` is the one check of an
``activation`` argument (and of the weight it is used with) for every layer that takes one.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional

import torch

from ds_fpquant.linear.weight_only import weight_only_linear
from ds_fpquant.numerics import checks
from ds_fpquant.numerics.choices import ACTIVATIONS
from ds_fpquant.numerics.formats import W8A8_GROUP, w8a8_weight_problem
from ds_fpquant.tensor.quantize import dequantize, quantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["check_activation", "check_w8a8_weight", "w8a8_linear"]

_log = logging.getLogger("ds_fpquant")

#: Activation formats of the W8A8 path: e4m3 codes with fp32 scales in 1x128 groups per token.
_w8a8_unavailable: Dict[str, str] = {}  # device -> why it cannot run torch's blockwise FP8 GEMM at all


_w8a8_logged: set = set()  # reasons already logged


def check_activation(activation: Optional[str], qt: Optional[QuantizedTensor] = None) -> None:
    """Check an ``activation`` argument: ``None`` (weight-only) or one of ``ACTIVATIONS`` (``"e4m3"``: W8A8), and,
    with W8A8 and a weight ``qt``, that the weight fits the W8A8 path (:func:`check_w8a8_weight`).

    Raises:
        TypeError, ValueError: naming ``activation`` or the weight's settings.
    """
    if activation is None:
        return
    checks.check_choice("activation", activation, ACTIVATIONS)
    if qt is not None:
        check_w8a8_weight(qt)


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
    b32 = None if bias is None else bias.detach().float()
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
