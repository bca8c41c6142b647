"""``linear(x, qt, bias)``: ``y = x @ dequantize(W)^T + bias`` without a full-precision copy of ``W``.

On CPU tensors with the compiled op the weight is decoded from its packed codes on the fly
(``csrc/fp_quantizer/fp_linear_cpu.cpp``): for few rows of ``x`` (token-by-token decoding) a fused
kernel streams the codes once, all rows of ``x`` per pass, accumulating in fp32; for many rows
(prefill) cache-sized panels of decoded rows go through torch's matmul in ``x``'s dtype. On CUDA
tensors with the compiled op, up to ``GEMV_MAX_ROWS`` rows of ``x`` take the fused GEMV kernel (one warp
per weight row, codes read once, fp32 sums; ``fp_quantize_kernels.cuh``); more rows decode panels of
``CUDA_PANEL_BYTES`` of weight rows for cuBLAS, never the whole weight. The torch backend is
``F.linear(x, dequantize(W, x.dtype), bias)``.

Numerics (SPEC 5, SPEC 8): every path multiplies by the same weights, ``dequantize(W, x.dtype)``
(``fl(decode(q) * s)`` rounded to ``x``'s dtype); the results differ from
``F.linear(x, dequantize(W, x.dtype), bias)`` only in the order of the fp32 sums (and, in the fused
kernel, one rounding of the fp32 result to ``x``'s dtype).
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from . import backends, checks
from .api import dequantize, quantize
from .quantized_tensor import QuantizedTensor
from .choices import ACTIVATIONS, BACKENDS
from .formats import W8A8_GROUP, w8a8_weight_problem
from .packing import ceil_div, row_bytes
from .slicing import row_slice

__all__ = ["linear", "QuantizedWeight", "DequantizingTensor", "SMALL_M", "PANEL_BYTES", "GEMV_MAX_ROWS", "CUDA_PANEL_BYTES", "ACTIVATIONS", "check_w8a8_weight"]

_log = logging.getLogger("ds_fpquant")

#: Rows of ``x`` (tokens) up to which the fused kernel runs; more rows take the panel path. Measured
#: on the 2-core development machine (``ds-fpquant bench --linear``), per activation dtype: bf16/fp16
#: matmuls use the CPU's bf16/fp16 units in the panel path, fp32 ones do not.
SMALL_M = {torch.float32: 32, torch.bfloat16: 4, torch.float16: 4}
#: Bytes of one panel of decoded weight rows in the large-M path: a quarter of a 4096x4096 bf16 layer,
#: in the last-level cache; smaller panels made torch's matmul slower (measured 2-16 MiB at M=16-1024).
PANEL_BYTES = 8 * 2**20
#: Rows of ``x`` up to which CUDA tensors take the GEMV kernel (``fpq::kGemvMaxRows``).
GEMV_MAX_ROWS = 16
#: Bytes of one panel of decoded weight rows for more rows on CUDA: well inside an H100/H200 L2 (50/60 MB),
#: so cuBLAS reads the panel from L2 right after it is written. A design value, not yet measured on a GPU.
CUDA_PANEL_BYTES = 16 * 2**20


def _scale_layout(qt: QuantizedTensor) -> Tuple[torch.Tensor, str, int, float]:
    """(scales as stored, 2-D; their kind for the op; weight rows per scale row; NVFP4 tensor scale)."""
    n, k = qt.shape
    kind = "e4m3" if qt.fmt == "nvfp4" else qt.scale_format
    block_rows = qt.block[0] if qt.block is not None else 1  # blocks: qt.group_size is Bc
    scales = qt.scales.reshape(ceil_div(n, block_rows), ceil_div(k, qt.group_size)).contiguous()
    tensor_scale = float(qt.tensor_scale) if qt.tensor_scale is not None else 1.0
    return scales, kind, block_rows, tensor_scale


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


def _fused(op, x2: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    scales, kind, block_rows, tensor_scale = _scale_layout(qt)
    n, k = qt.shape
    # the kernels read packed rows: codes of other strides (a view, a slice) are copied once
    codes = qt.codes.view(torch.uint8).reshape(n, row_bytes(k, qt.group_size, qt.format.bits)).contiguous()
    b = None if bias is None else bias.detach().to(x2.dtype).contiguous()
    small_m = GEMV_MAX_ROWS if x2.is_cuda else SMALL_M[x2.dtype]
    return op.linear(x2, codes, scales, kind, block_rows, tensor_scale, b, qt.format.name, qt.group_size,
                     small_m, PANEL_BYTES)


def _panels(x2: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor], backend: str,
            panel_bytes: int) -> torch.Tensor:
    """``F.linear`` of ``x2`` with the weight dequantized ``panel_bytes`` of rows at a time."""
    n, k = qt.shape
    b = None if bias is None else bias.to(x2.dtype)
    block_rows = qt.block[0] if qt.block is not None else 1
    rows = max(1, panel_bytes // max(1, k * x2.element_size()))
    rows = ceil_div(rows, block_rows) * block_rows
    if rows >= n:
        return F.linear(x2, dequantize(qt, x2.dtype, backend=backend), b)
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        weight = dequantize(row_slice(qt, n0, n1), x2.dtype, backend=backend)
        y[:, n0:n1] = F.linear(x2, weight, None if b is None else b[n0:n1])
    return y


# ---- W8A8: activations quantized to e4m3 per token (opt-in) ------------------------------------------

#: Activation formats of the W8A8 path: e4m3 codes with fp32 scales in 1x128 groups per token.
_w8a8_unavailable: Dict[str, str] = {}  # device -> why it cannot run torch's blockwise FP8 GEMM at all
_w8a8_logged: set = set()  # reasons already logged


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
        y = linear(dequantize(xq, torch.float32, backend=backend), qt, b32, backend=backend)
    elif b32 is not None:
        y = y + b32  # in fp32, then one rounding to x's dtype, as on every other path
    return y.to(x2.dtype)


def linear(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           backend: str = "auto", activation: Optional[str] = None) -> torch.Tensor:
    """``y = x @ dequantize(qt, x.dtype)^T + bias`` with the weight decoded on the fly.

    Args:
        x: fp32 / fp16 / bf16 activations ``(..., in_features)``, any strides.
        qt: the quantized weight, ``qt.shape == (out_features, in_features)``, row grouping or 2-D
            blocks; any element format, fp32 or E8M0 scales, or NVFP4. Codes and scales of any strides, as
            ``dequantize`` takes them (non-contiguous ones are copied once per call).
        bias: optional ``(out_features,)`` tensor; added in fp32 before the one rounding to ``x``'s dtype
            (fused kernel) or by the matmul (panels, other devices).
        backend: ``"auto"`` (the compiled op for the tensors' device: the fused CPU kernel, or on CUDA the
            GEMV up to ``GEMV_MAX_ROWS`` rows of ``x`` and panels of decoded rows + cuBLAS beyond),
            ``"cpu"``, ``"cuda"`` or ``"torch"`` (dequantize with the torch reference + ``F.linear``, in panels
            on CUDA).
        activation: ``None`` (weight-only, the default) or ``"e4m3"`` (W8A8, opt-in: it changes the numerics):
            ``x`` is quantized per token to e4m3 with fp32 scales in groups of 128, and multiplied by an e4m3
            weight with fp32 scales in groups of 128 or (128, 128) blocks through ``torch._scaled_mm``'s
            blockwise FP8 GEMM on sm_90+; elsewhere the same math in fp32 (dequantized activations times the
            weight); the bias is added in fp32 before the one rounding to ``x``'s dtype. Backward passes the
            activation quantization straight through.

    Returns:
        ``(..., out_features)`` tensor of ``x``'s dtype. Differentiable with respect to ``x`` (and
        ``bias``); the quantized weight gets no gradient. With bf16 ``x`` the CPU's bf16 dot product
        (``vdpbf16ps``, and torch's own bf16 matmul in the panel path) reads bf16 values below 2^-126
        (subnormals, about 1e-38) as zero, as torch's bf16 ``F.linear`` on such a CPU does.

    Raises:
        TypeError, ValueError: ``x``, ``qt`` or ``bias`` of the wrong type, dtype, shape or device.
    """
    _check(x, qt, bias, backend)
    if activation is not None:
        checks.check_choice("activation", activation, ACTIVATIONS)
        check_w8a8_weight(qt)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if not needs_grad and not torch.compiler.is_compiling():  # eager inference: the op's body, no dispatcher
        return _weight_only_linear(x, qt, bias, backend) if activation is None else _w8a8_linear(x, qt, bias, backend)
    # the custom ops ds_fpquant::linear / ds_fpquant::w8a8_linear: torch.compile and torch.export trace them; autograd
    from . import library

    op = library.linear if activation is None else library.w8a8_linear
    return op(x, qt.codes, qt.scales, qt.tensor_scale, bias, qt.shape[1], qt.fmt, qt.group_size,
              list(qt.block) if qt.block else None, qt.scale_format, backend)


def _w8a8_linear(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    """The W8A8 forward of :func:`linear` (the body of the ``ds_fpquant::w8a8_linear`` custom op)."""
    n, k = qt.shape
    x2 = x.reshape(math.prod(x.shape[:-1]), k).resolve_neg().resolve_conj().contiguous()
    return _w8a8(x2, qt, bias, backend).reshape(*x.shape[:-1], n)


def _weight_only_linear(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    """The weight-only forward of :func:`linear` (the body of the ``ds_fpquant::linear`` custom op): the fused
    CPU kernel, the CUDA GEMV or panels + cuBLAS, or the torch reference's dequantize + ``F.linear``."""
    impl = backends.resolve(backend, x.device)
    n, k = qt.shape
    x2 = x.reshape(math.prod(x.shape[:-1]), k).resolve_neg().resolve_conj().contiguous()
    if x.device.type == "cuda" and (not impl.WITH_CUDA or x2.shape[0] > GEMV_MAX_ROWS):
        y = _panels(x2, qt, bias, backend, CUDA_PANEL_BYTES)  # no GEMV: bounded panels of decoded rows + cuBLAS
    else:
        y = _fused(impl, x2, qt, bias)  # the backend's linear: fused CPU kernel, CUDA GEMV, or the torch reference
    return y.reshape(*x.shape[:-1], n)


class DequantizingTensor(torch.Tensor):
    """Base of the storage-less tensor subclasses that stand in for a quantized weight (:class:`QuantizedWeight`,
    :class:`ds_fpquant.experts.QuantizedExperts`): a subclass handles the calls it runs quantized in its
    ``__torch_function__`` and passes the rest to :meth:`_dense_call`, which sees :meth:`dequantized`."""

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _dense(value):
        return value.dequantized() if isinstance(value, DequantizingTensor) else value

    @classmethod
    def _dense_call(cls, func, args, kwargs):
        args = torch.utils._pytree.tree_map(cls._dense, args)
        kwargs = torch.utils._pytree.tree_map(cls._dense, kwargs or {})
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args = torch.utils._pytree.tree_map(cls._dense, args)
        kwargs = torch.utils._pytree.tree_map(cls._dense, kwargs or {})
        return func(*args, **kwargs)


class QuantizedWeight(DequantizingTensor):
    """An ``(out, in)`` weight held as codes + scales, standing in for ``module.weight`` in layers whose
    forward is ``torch.matmul(x, self.weight.transpose(-1, -2))`` or ``F.linear(x, self.weight)``
    (DeepSpeed's AutoTP ``LinearLayer`` / ``LinearAllreduce``): those calls run :func:`linear` (the
    fused op on CPU tensors). Any other use of the tensor sees ``dequantize(qt, dtype)``.

    A tensor subclass without storage (``torch.Tensor._make_wrapper_subclass``): shape, dtype and
    device are the dequantized weight's.
    """

    @staticmethod
    def __new__(cls, qt: QuantizedTensor, dtype: torch.dtype, backend: str = "auto", transposed: bool = False,
                activation: Optional[str] = None):
        n, k = qt.shape
        self = torch.Tensor._make_wrapper_subclass(cls, (k, n) if transposed else (n, k), dtype=dtype,
                                                   device=qt.codes.device, requires_grad=False)
        # plain attributes: the Tensor properties (dtype, shape) of a subclass go through __torch_function__
        self.qt, self.backend, self.transposed, self.weight_dtype = qt, backend, transposed, dtype
        self.activation = activation
        return self

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype, backend: str = "auto", transposed: bool = False,
                 activation: Optional[str] = None):
        super().__init__()

    def __repr__(self, *, tensor_contents=None):
        n, k = self.qt.shape
        return (f"QuantizedWeight(shape={(k, n) if self.transposed else (n, k)}, dtype={self.weight_dtype}, "
                f"fmt={self.qt.fmt})")

    def dequantized(self) -> torch.Tensor:
        w = dequantize(self.qt, self.weight_dtype, backend=self.backend)
        return w.t() if self.transposed else w

    def _flipped(self) -> "QuantizedWeight":
        return type(self)(self.qt, self.weight_dtype, self.backend, not self.transposed, self.activation)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.transpose, torch.transpose) and isinstance(args[0], cls) and not kwargs:
            if sorted(d % 2 for d in args[1:3]) == [0, 1]:
                return args[0]._flipped()
        if func in (torch.Tensor.t, torch.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__) and isinstance(args[0], cls):
            return args[0]._flipped()
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and len(args) == 2 and not kwargs:
            x, w = args
            if isinstance(w, cls) and w.transposed and isinstance(x, torch.Tensor) and not isinstance(x, cls):
                # in the weight's (compute) dtype, returned in x's, as FPQuantizedLinear.forward does
                return linear(x.to(w.weight_dtype), w.qt, backend=w.backend, activation=w.activation).to(x.dtype)
        if func is F.linear and len(args) >= 2 and isinstance(args[1], cls) and not args[1].transposed:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if not isinstance(args[0], cls) and not isinstance(bias, cls):
                x = args[0]
                w = args[1]
                return linear(x.to(w.weight_dtype), w.qt, bias, backend=w.backend, activation=w.activation).to(x.dtype)
        return cls._dense_call(func, args, kwargs)
