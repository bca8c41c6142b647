"""The weight-only forward of :func:`ds_fpquant.linear.linear`: ``y = x @ dequantize(W)^T + bias`` without a
full-precision copy of ``W`` (SPEC 5, SPEC 8).

On CPU tensors with the compiled op the weight is decoded from its packed codes on the fly (``csrc/fp_quantizer``):
for few rows of ``x`` (token-by-token decoding) a fused kernel streams the codes once, all rows of ``x`` per pass,
accumulating in fp32; for many rows (prefill) cache-sized panels of decoded rows go through torch's matmul in
``x``'s dtype. On CUDA tensors with the compiled op, up to ``GEMV_MAX_ROWS`` rows of ``x`` take the fused GEMV
kernel (one warp per weight row, codes read once, fp32 sums); more rows decode panels of ``CUDA_PANEL_BYTES`` of
weight rows for cuBLAS, never the whole weight. The torch backend is ``F.linear(x, dequantize(W, x.dtype), bias)``.

Numerics (SPEC 5, SPEC 8): every path multiplies by the same weights, ``dequantize(W, x.dtype)``
(``fl(decode(q) * s)`` rounded to ``x``'s dtype); the results differ from ``F.linear(x, dequantize(W, x.dtype),
bias)`` only in the order of the fp32 sums (and, in the fused kernel, one rounding of the fp32 result to ``x``'s
dtype).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ds_fpquant.numerics.packing import ceil_div, row_bytes
from ds_fpquant.ops import backends
from ds_fpquant.tensor.quantize import dequantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor
from ds_fpquant.tensor.slicing import row_slice

__all__ = ["weight_only_linear", "scale_layout", "SMALL_M", "PANEL_BYTES", "GEMV_MAX_ROWS", "CUDA_PANEL_BYTES"]


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


def scale_layout(qt: QuantizedTensor) -> Tuple[torch.Tensor, str, int, float]:
    """(scales as stored, 2-D; their kind for the op; weight rows per scale row; NVFP4 tensor scale)."""
    n, k = qt.shape
    kind = "e4m3" if qt.fmt == "nvfp4" else qt.scale_format
    block_rows = qt.block[0] if qt.block is not None else 1  # blocks: qt.group_size is Bc
    scales = qt.scales.reshape(ceil_div(n, block_rows), ceil_div(k, qt.group_size)).contiguous()
    tensor_scale = float(qt.tensor_scale) if qt.tensor_scale is not None else 1.0
    return scales, kind, block_rows, tensor_scale


def _fused(op, x2: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    scales, kind, block_rows, tensor_scale = scale_layout(qt)
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


def weight_only_linear(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor], backend: str) -> torch.Tensor:
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
