"""The weight-only forward of :func:`ds_fpquant.linear.linear`: ``y = x @ W^T + bias`` without a full-precision
copy of ``W`` (SPEC 8).

On CPU tensors with the compiled op the weight is decoded from its packed codes on the fly (``csrc/fp_quantizer``):
up to ``SMALL_M`` rows of ``x`` (token-by-token decoding) the fused kernel streams the codes once, decodes each code
exactly and multiplies each group's partial sum by the group's scale, in fp32; for more rows (prefill) panels of
weight rows decoded in fp32 (``fl(decode(q) * s)``) go through torch's fp32 matmul. The torch backend computes the
fused kernel's formula in plain torch (``ds_fpquant.ops.torch_backend.linear``), on any device.

On CUDA tensors with the compiled op, up to ``GEMV_MAX_ROWS`` rows of ``x`` take the fused GEMV kernel, which computes
SPEC 8.1's formula like the CPU kernel (each code decoded exactly, group partial sums times the group scale, fp32;
on tensor cores for bf16 / fp16 ``x``, codes read once through a ``cp.async`` ring, every decoded weight used by every
row of x; SPEC 8.2's tensor-core bound);
more rows decode panels of ``CUDA_PANEL_BYTES`` of weight rows in ``x``'s dtype for cuBLAS, never the whole weight
(those still multiply by ``dequantize(W, x.dtype)``, the weights rounded to ``x``'s dtype: SPEC 8.1 says what that
costs).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from ds_fpquant.numerics.packing import ceil_div, row_bytes
from ds_fpquant.ops import backends
from ds_fpquant.tensor.quantize import dequantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor
from ds_fpquant.tensor.slicing import row_slice

__all__ = ["weight_only_linear", "rounded_bias", "scale_layout", "cpu_gemm", "SMALL_M", "PANEL_BYTES", "GEMV_MAX_ROWS", "CUDA_PANEL_BYTES"]


#: Rows of ``x`` (tokens) up to which the fused CPU kernel runs; more rows take the fp32 panel path. Per activation
#: dtype (the crossover is measured with ``ds-fpquant bench --linear``; results in ``benchmarks/results/``).
SMALL_M = {torch.float32: 32, torch.bfloat16: 32, torch.float16: 32}


#: Bytes of one panel of decoded weight rows in the large-M CPU path: an eighth of a 4096x4096 fp32 layer, so that
#: a panel stays in the last-level cache while torch's matmul reads it.
PANEL_BYTES = 8 * 2**20


#: Rows of ``x`` up to which CUDA tensors take the GEMV kernel (``fpq::kGemvMaxRows``): up to 16 rows share each
#: decoded weight (the mma's 8-column side, two n-tiles past 8); more rows take the panels + cuBLAS.
GEMV_MAX_ROWS = 16


#: Bytes of one panel of decoded weight rows for more rows on CUDA: well inside an H100/H200 L2 (50/60 MB),
#: so cuBLAS reads the panel from L2 right after it is written (a design value; docs/gpu.md).
CUDA_PANEL_BYTES = 16 * 2**20


def cpu_gemm(op) -> bool:
    """Whether the compiled CPU op ``op`` runs every M itself (its AVX2 GEMV and GEMM, ``"avx2_fma"`` in
    ``op.cpu_paths()``: every x86-64-v3 or newer build), so that no rows of ``x`` take the fp32 panels."""
    cached = _cpu_gemm.get(id(op))
    if cached is None:
        cached = _cpu_gemm[id(op)] = "avx2_fma" in op.cpu_paths()
    return cached


_cpu_gemm: dict = {}  # id(op) -> cpu_gemm(op)


def scale_layout(qt: QuantizedTensor) -> Tuple[torch.Tensor, str, int, float]:
    """(scales as stored, 2-D; their kind for the op; weight rows per scale row; NVFP4 tensor scale)."""
    n, k = qt.shape
    kind = "e4m3" if qt.fmt == "nvfp4" else qt.scale_format
    block_rows = min(qt.block[0], max(n, 1)) if qt.block is not None else 1  # blocks: qt.group_size is Bc
    scales = qt.scales.reshape(ceil_div(n, block_rows), ceil_div(k, qt.group_size)).contiguous()
    tensor_scale = float(qt.tensor_scale) if qt.tensor_scale is not None else 1.0
    return scales, kind, block_rows, tensor_scale


def _group(qt: QuantizedTensor) -> int:
    """The group size the kernels take: ``qt.group_size``, or ``K`` where the group spans the row (SPEC 2: one group
    of ``K``, the same packing)."""
    return min(qt.group_size, max(qt.shape[1], 1))


def _packed_codes(qt: QuantizedTensor) -> torch.Tensor:
    """The codes as the kernels read them: packed rows ``(n, row_bytes)``, contiguous (a view or a slice of other
    strides is copied once)."""
    n, k = qt.shape
    return qt.codes.view(torch.uint8).reshape(n, row_bytes(k, qt.group_size, qt.format.bits)).contiguous()


def rounded_bias(bias: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """SPEC 8.1's bias: ``bias`` rounded to ``dtype`` (``x``'s dtype; RNE), which every path then adds in fp32 (a
    bf16 / fp16 value widens exactly). The one place the rule is applied: the weight-only forward and both W8A8
    forwards take their bias from here, whatever kernel or build then runs."""
    return None if bias is None else bias.detach().to(dtype).contiguous()


def _fused(op, x2: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The backend's own linear: the fused CPU kernel, the CUDA GEMV, or the torch reference's formula (``bias``
    already rounded to ``x2``'s dtype)."""
    scales, kind, block_rows, tensor_scale = scale_layout(qt)
    return op.linear(x2, _packed_codes(qt), scales, kind, block_rows, tensor_scale, bias, qt.format.name, _group(qt))


def _op_decoder(op, qt: QuantizedTensor, x2: torch.Tensor) -> Callable[[int, int, int], torch.Tensor]:
    """``decode(n0, n1, rows)``: rows ``n0 .. n1-1`` of the weight decoded by the compiled CPU op in ``x2``'s dtype
    (``fl(decode(q) * s)`` rounded to it, SPEC 5), into one buffer of ``rows`` rows reused by every panel."""
    scales, kind, block_rows, tensor_scale = scale_layout(qt)
    codes = _packed_codes(qt)
    buffer = []

    def decode(n0: int, n1: int, rows: int) -> torch.Tensor:
        if not buffer:
            buffer.append(torch.empty(rows, qt.shape[1], dtype=x2.dtype, device=x2.device))
        out = buffer[0][:n1 - n0]
        op.decode_rows(codes, scales, kind, block_rows, tensor_scale, qt.format.name, _group(qt), n0, n1, out)
        return out

    return decode


def _dequantizing_decoder(qt: QuantizedTensor, x2: torch.Tensor, backend: str) -> Callable[[int, int, int], torch.Tensor]:
    """``decode(n0, n1, rows)``: rows ``n0 .. n1-1`` of the weight as ``dequantize`` gives them in ``x2``'s dtype
    (a new tensor per panel)."""
    def decode(n0: int, n1: int, rows: int) -> torch.Tensor:
        return dequantize(row_slice(qt, n0, n1), x2.dtype, backend=backend)

    return decode


def _panels(x2: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor], panel_bytes: int,
            decode: Callable[[int, int, int], torch.Tensor]) -> torch.Tensor:
    """``F.linear`` of ``x2`` with the weight decoded ``panel_bytes`` of rows at a time (whole 2-D blocks of rows),
    the one panel loop of every device: ``y[:, n0:n1] = F.linear(x2, W[n0:n1], bias[n0:n1])`` with ``W[n0:n1] =
    decode(n0, n1, rows per panel)`` in ``x2``'s dtype (the caller's compute dtype; ``bias``, already rounded to the
    caller's ``x`` dtype, widens exactly to it). (Not ``W @ x^T``: in torch 2.13 that bf16 GEMM lets a NaN/Inf weight
    row spoil its neighbour row's result.)"""
    n, k = qt.shape
    b = None if bias is None else bias.to(x2.dtype)
    block_rows = min(qt.block[0], max(n, 1)) if qt.block is not None else 1
    rows = max(1, panel_bytes // max(1, k * x2.element_size()))
    rows = min(n, ceil_div(rows, block_rows) * block_rows)
    if rows >= n:
        return F.linear(x2, decode(0, n, n), b)
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        y[:, n0:n1] = F.linear(x2, decode(n0, n1, rows), None if b is None else b[n0:n1])
    return y


def weight_only_linear(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    """The weight-only forward of :func:`linear` (the body of the ``ds_fpquant::linear`` custom op): the fused
    CPU kernel up to ``SMALL_M`` rows of ``x`` and the CUDA GEMV up to ``GEMV_MAX_ROWS``; beyond, panels of decoded
    rows through torch's matmul (decoded in fp32 by the CPU op, or dequantized in ``x``'s dtype on CUDA); the torch
    reference's formula with the torch backend."""
    impl = backends.resolve(backend, x.device)
    n, k = qt.shape
    x2 = x.reshape(math.prod(x.shape[:-1]), k).resolve_neg().resolve_conj().contiguous()
    bias = rounded_bias(bias, x.dtype)  # SPEC 8.1, on every path below (the fp32 panels add it widened from x's dtype)
    m = x2.shape[0]
    torch_reference = not hasattr(impl, "decode_rows")  # the torch backend: its formula on any device
    if torch_reference or n == 0 or k == 0 or m == 0:
        y = _fused(impl, x2, qt, bias)
    elif x.device.type == "cuda":  # the GEMV, or panels in x's dtype for cuBLAS
        if impl.WITH_CUDA and m <= GEMV_MAX_ROWS:
            y = _fused(impl, x2, qt, bias)
        else:
            y = _panels(x2, qt, bias, CUDA_PANEL_BYTES, _dequantizing_decoder(qt, x2, backend))
    elif m <= SMALL_M[x2.dtype] or cpu_gemm(impl):
        y = _fused(impl, x2, qt, bias)
    else:  # panels decoded in fp32 (fl(decode(q) * s)), fp32 matmul, one rounding to x's dtype
        x32 = x2.float()
        y = _panels(x32, qt, bias, PANEL_BYTES, _op_decoder(impl, qt, x32)).to(x2.dtype)
    return y.reshape(*x.shape[:-1], n)
