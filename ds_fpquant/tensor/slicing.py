"""Pieces of a 2-D quantized matrix without requantizing: rows or columns of its codes and scales, cut on
group / block boundaries, and matrices stacked along rows.

Used where a weight is split or joined as stored: the CUDA linear's panels of rows, an expert's gate and up
rows in checkpoints (``ds-fpquant quantize``, ``load_quantized``, ``save_quantized``), and the shards AutoTP
gives each rank of a pre-quantized model (output rows for column-parallel layers, input columns for
row-parallel ones).
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence

import torch

from ds_fpquant.numerics.codec import ieee_denormals
from ds_fpquant.numerics.formats import NVFP4_SCALE_FORMAT
from ds_fpquant.numerics.packing import ceil_div, codes_per_unit, group_bytes, row_bytes
from ds_fpquant.numerics.scales import fp32_scales
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["row_slice", "column_slice", "split_rows", "join_rows", "nvfp4_beside_e2m1"]


def row_slice(qt: QuantizedTensor, r0: int, r1: int, name: str = "qt") -> QuantizedTensor:
    """Rows ``r0 .. r1-1`` of the 2-D ``qt`` (views of its codes and scales).

    Raises ``ValueError`` when the cut falls inside a block of rows (``name`` names the weight); a block of rows
    at least the matrix's (per-tensor scaling) is cut anywhere, each piece keeping its one row of scales.
    """
    n, k = qt.shape
    block_rows = qt.block[0] if qt.block is not None else 1
    if block_rows >= n:  # one block of rows (per-tensor scaling): every piece keeps that scale row (SPEC 2)
        lo, hi, block_rows = 0, 1, 1
    else:
        lo, hi = r0 // block_rows, ceil_div(r1, block_rows)
    if not (0 <= r0 < r1 <= n) or r0 % block_rows or (r1 % block_rows and r1 != n):
        raise ValueError(f"{name}: rows {r0}..{r1 - 1} of a ({n}, {k}) weight do not start and end on its "
                         f"{block_rows}-row block boundaries")
    return replace(qt, codes=qt.codes[r0:r1], scales=qt.scales[lo:hi],
                   shape=torch.Size((r1 - r0, k)),  # NVFP4: each piece carries the shared tensor scale
                   tensor_scale=None if qt.tensor_scale is None else qt.tensor_scale.clone())


def column_slice(qt: QuantizedTensor, c0: int, c1: int, name: str = "qt") -> QuantizedTensor:
    """Columns ``c0 .. c1-1`` of the 2-D ``qt``: whole groups (or blocks) of each row's codes and their scales.

    Raises ``ValueError`` when the cut falls inside a group of ``group_size`` columns; where one group spans the
    row (``group_size >= K``: per-channel / per-tensor scaling) each piece keeps the row's scale and the cut must
    only fall on a whole pack unit of codes (SPEC 6: any column for 8-bit codes, 2 for 4-bit, 4 for 6-bit).
    """
    n, k = qt.shape
    g = qt.group_size
    bits = qt.format.bits
    if g >= k and 0 <= c0 < c1 <= k:  # one group per row (per-channel / per-tensor): cut on whole pack units
        unit = codes_per_unit(bits)
        if c0 % unit or (c1 % unit and c1 != k):
            raise ValueError(f"{name}: columns {c0}..{c1 - 1} of a ({n}, {k}) weight with one group per row cut its "
                             f"{bits}-bit codes inside a pack unit of {unit} codes (SPEC 6); a shard must start and "
                             f"end on a multiple of {unit} columns")
        start = c0 * bits // 8
        codes = qt.codes[:, start:start + group_bytes(c1 - c0, bits)]
        return replace(qt, codes=codes.contiguous(), scales=qt.scales.contiguous(), shape=torch.Size((n, c1 - c0)),
                       tensor_scale=None if qt.tensor_scale is None else qt.tensor_scale.clone())
    if not (0 <= c0 < c1 <= k) or c0 % g or (c1 % g and c1 != k):
        raise ValueError(f"{name}: columns {c0}..{c1 - 1} of a ({n}, {k}) weight cut its groups of {g} columns; "
                         f"a shard must start and end on a group boundary (use a group_size / block that divides it)")
    start = (c0 // g) * row_bytes(g, g, bits)
    codes = qt.codes[:, start:start + row_bytes(c1 - c0, g, bits)]
    scales = qt.scales[:, c0 // g:ceil_div(c1, g)]
    return replace(qt, codes=codes.contiguous(), scales=scales.contiguous(), shape=torch.Size((n, c1 - c0)),
                   tensor_scale=None if qt.tensor_scale is None else qt.tensor_scale.clone())


def split_rows(qt: QuantizedTensor, rows: Sequence[int]) -> List[QuantizedTensor]:
    """``qt`` (2-D, row groups or 2-D blocks) cut into consecutive row ranges of ``rows`` rows, each a
    :class:`QuantizedTensor` of its own with the same codes and scales (nothing is requantized).

    Raises ``ValueError`` when a cut falls inside a block of rows (the block's one scale would belong
    to two matrices).
    """
    block_rows = qt.block[0] if qt.block else 1
    if block_rows >= qt.shape[0]:  # one block of rows: each piece keeps its scale row (row_slice)
        block_rows = 1
    if sum(rows) != qt.shape[0] or any(n % block_rows for n in rows[:-1]):
        raise ValueError(f"rows {list(rows)} do not cut a {tuple(qt.shape)} matrix with blocks of {block_rows} rows "
                         f"on block boundaries")
    out, start = [], 0
    for n in rows:
        out.append(row_slice(qt, start, start + n))
        start += n
    return out


def _column_layout(qt: QuantizedTensor) -> tuple:
    """What must agree between matrices stacked along rows."""
    return (qt.shape[1], qt.codes.dtype, qt.scales.dtype, qt.fmt, qt.group_size, qt.scale_format, qt.dtype, qt.grouping,
            qt.block[1] if qt.block else None)


def join_rows(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """The matrix of ``parts`` stacked along rows (gate over up), as one :class:`QuantizedTensor` holding
    the same codes and scale values: where a part's rows end inside a block of rows, the block scales are
    repeated per row (blocks ``(1, Bc)``), which dequantizes to the same values. NVFP4 parts must share
    their tensor scale.

    Raises ``ValueError`` for parts of different column counts or layouts.
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(_column_layout(qt) != _column_layout(first) for qt in parts):
        raise ValueError(f"expert parts to join differ in layout: {[_column_layout(qt) for qt in parts]}")
    if first.tensor_scale is not None and any(not torch.equal(qt.tensor_scale, first.tensor_scale) for qt in parts):
        raise ValueError("NVFP4 expert parts to join have different tensor scales (weight_scale_2); ds_fpquant "
                         "joins parts quantized together, with one tensor scale")
    block = first.block
    if block is not None and (any(qt.block != block for qt in parts)
                              or any(qt.shape[0] % block[0] for qt in parts[:-1])):
        block = (1, block[1])  # scales per row: a part ends inside a block of rows
    scales = [qt.scales if block == qt.block else
              qt.scales.repeat_interleave(min(qt.block[0], max(qt.shape[0], 1)), dim=0)[:qt.shape[0]]
              for qt in parts]
    return replace(first, codes=torch.cat([qt.codes for qt in parts]), scales=torch.cat(scales), block=block,
                   shape=torch.Size((sum(qt.shape[0] for qt in parts), first.shape[1])))


def nvfp4_beside_e2m1(pieces: Sequence[QuantizedTensor]) -> List[QuantizedTensor]:
    """``pieces`` (the matrices of one expert parameter) in one layout where they mix ``nvfp4`` with ``e2m1``
    row groups of 16 with fp32 scales (what the compressed-tensors reader makes of an NVFP4 weight whose
    global scale does not divide exactly through ``1/g``): each ``nvfp4`` piece becomes ``e2m1`` with the
    fp32 scales ``fl(decode(c) * t)`` its groups dequantize with (SPEC 3.4), so every value stays bit for bit.
    Other pieces, and lists that do not mix the two, are returned as they are."""
    def fp32_e2m1(qt):
        return qt.fmt == "e2m1" and qt.group_size == 16 and qt.block is None and qt.scale_format == "fp32"

    if not (any(qt.fmt == "nvfp4" for qt in pieces) and any(fp32_e2m1(qt) for qt in pieces)):
        return list(pieces)
    with torch.no_grad(), ieee_denormals():  # the scales dequantize() uses, computed the same way
        return [replace(qt, fmt="e2m1", scale_format="fp32", tensor_scale=None,
                        scales=fp32_scales(qt.scales, NVFP4_SCALE_FORMAT, qt.tensor_scale))
                if qt.fmt == "nvfp4" else qt for qt in pieces]
