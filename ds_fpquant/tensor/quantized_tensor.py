"""``QuantizedTensor``: the codes and scales of one quantized tensor, the shapes they have (SPEC 2, 6) and the
check that its fields agree (:meth:`QuantizedTensor.validate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ds_fpquant.numerics import checks
from ds_fpquant.numerics.choices import BACKENDS, GROUPINGS, SCALE_FORMATS
from ds_fpquant.numerics.codec import ieee_denormals
from ds_fpquant.numerics.formats import NVFP4_SCALE_FORMAT, PRESETS, FPFormat, element_format
from ds_fpquant.numerics.packing import ceil_div, row_bytes
from ds_fpquant.numerics.scales import fp32_scales
from ds_fpquant.ops import backends

__all__ = ["QuantizedTensor", "rows_and_k", "scales_shape_for", "codes_shape_for", "check_block", "check_quantized_tensor"]


@dataclass
class QuantizedTensor:
    """Codes and scales of one quantized tensor (a plain dataclass, not a tensor subclass).

    Attributes:
        codes: ``torch.uint8``. Row grouping: ``(*shape[:-1], row_bytes)`` with each row's groups
            packed one after another (SPEC 6); for 8-bit formats ``codes.shape == shape`` and
            ``codes.view(torch.float8_e4m3fn)`` (or ``float8_e5m2``) is valid. Flat grouping: 1-D.
        scales: one per group, ``(*shape[:-1], ceil(K/G))`` for row grouping, ``(ceil(numel/G),)``
            for flat grouping: ``torch.float32`` (SPEC 3.1), E8M0 bytes ``torch.uint8`` (SPEC 3.2) or,
            for ``fmt="nvfp4"``, e4m3 codes ``torch.uint8`` (SPEC 3.4; ``.view(torch.float8_e4m3fn)``).
        shape, dtype: the original tensor's shape and dtype.
        fmt, group_size, grouping, block, scale_format: as passed to :func:`ds_fpquant.quantize` (presets
            resolved: an MX preset has ``group_size=32, scale_format="e8m0"``, ``"nvfp4"`` has
            ``group_size=16, scale_format="e4m3"``). Sizes are recorded as given, never clipped to the
            tensor: a group or block side at least the tensor's side means one scale along it (SPEC 2), so
            ``granularity="tensor"`` is ``block=(WHOLE, WHOLE)`` and ``"channel"`` ``group_size=WHOLE``
            (``WHOLE = 2**31 - 1``, :data:`ds_fpquant.numerics.formats.WHOLE`) on every layer whatever its
            shape (:attr:`granularity` names them).
        tensor_scale: ``fmt="nvfp4"`` only: the 0-d fp32 per-tensor scale ``t`` (SPEC 3.4); ``None``
            otherwise.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    fmt: str
    group_size: int
    grouping: str = "row"
    block: Optional[Tuple[int, int]] = None
    scale_format: str = "fp32"
    tensor_scale: Optional[torch.Tensor] = None

    @property
    def format(self) -> FPFormat:
        """The element format's entry of the format table (a preset's element format)."""
        return element_format(self.fmt)

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus scales (plus the NVFP4 tensor scale)."""
        tensors = (self.codes, self.scales) + (() if self.tensor_scale is None else (self.tensor_scale,))
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def granularity(self) -> Optional[str]:
        """``"tensor"`` when one scale covers the whole 2-D tensor (a block at least its shape, ``scales`` ``(1, 1)``),
        ``"channel"`` for one scale per row (row groups at least ``K`` wide, or blocks ``(1, >= K)``), else
        ``None`` (groups / blocks; a tensor with one row or one group may still be either)."""
        rows, k = rows_and_k(self.shape, self.grouping)
        if self.block is not None and len(self.shape) == 2:
            if self.block[0] >= rows and self.block[1] >= k:
                return "tensor"
            return "channel" if self.block[0] == 1 and self.block[1] >= k else None
        return "channel" if self.grouping == "row" and self.group_size >= k else None

    def dequantize(self, dtype: Optional[torch.dtype] = None, *, backend: str = "auto") -> torch.Tensor:
        """The values of ``qt.shape`` (SPEC 5): ``y = fl(decode(q) * s)`` in fp32, then rounded to ``dtype`` (IEEE RNE;
        fp16 overflow gives Inf). NaN codes give NaN, Inf codes +-Inf, a NaN scale NaN for its whole group.
        :func:`ds_fpquant.dequantize` is this method.

        Args:
            dtype: fp32 / fp16 / bf16 output dtype; defaults to ``self.dtype``.
            backend: ``"auto"``, ``"cuda"``, ``"cpu"`` or ``"torch"``, as for :func:`ds_fpquant.quantize`.

        Raises:
            TypeError, ValueError: the fields disagree (codes/scales of the wrong dtype or shape), or ``dtype`` /
                ``backend`` is not supported.
        """
        f = check_quantized_tensor(self)
        dtype = self.dtype if dtype is None else dtype
        checks.check_float_dtype("dtype", dtype)
        checks.check_choice("backend", backend, BACKENDS)
        rows, k = rows_and_k(self.shape, self.grouping)
        packed = self.codes.view(torch.uint8).reshape(rows, row_bytes(k, self.group_size, f.bits))
        impl = backends.resolve(backend, packed.device)
        g_eff = min(self.group_size, max(k, 1))  # as in quantize
        with torch.no_grad(), ieee_denormals():
            # every backend takes one fp32 scale per group
            kind = NVFP4_SCALE_FORMAT if self.fmt == "nvfp4" else self.scale_format
            scales = fp32_scales(self.scales, kind, self.tensor_scale)
            if self.block is not None:  # each tile's scale for each of its rows (a side >= N: one tile)
                scales = scales.repeat_interleave(min(self.block[0], max(rows, 1)), dim=0)[:rows]
            scales = scales.reshape(rows, ceil_div(k, self.group_size))
            y = impl.dequantize(packed.contiguous(), scales.contiguous(), k, f.name, g_eff, dtype)
        return y.reshape(self.shape)

    def validate(self) -> "QuantizedTensor":
        """Check that the fields agree with each other as :func:`ds_fpquant.quantize` makes them (format, preset,
        grouping, block, codes and scales dtypes and shapes, NVFP4 tensor scale, one device); returns
        ``self``. Values are not inspected.

        Raises:
            TypeError, ValueError: naming the field (``qt.codes``, ``qt.scales``, ...).
        """
        check_quantized_tensor(self)
        return self


def rows_and_k(shape, grouping: str) -> Tuple[int, int]:
    """View a tensor of ``shape`` as ``rows x K`` (SPEC 2)."""
    numel = math.prod(shape)
    if grouping == "flat":
        return 1, numel
    k = shape[-1] if len(shape) else 1
    return math.prod(shape[:-1]), k


def scales_shape_for(shape, grouping: str, group_size: int) -> Tuple[int, ...]:
    rows, k = rows_and_k(shape, grouping)
    n_groups = ceil_div(k, group_size)
    return (n_groups,) if grouping == "flat" else (*shape[:-1], n_groups)


def codes_shape_for(shape, grouping: str, group_size: int, bits: int) -> Tuple[int, ...]:
    rows, k = rows_and_k(shape, grouping)
    nbytes = row_bytes(k, group_size, bits)
    if grouping == "flat":
        return (nbytes,)
    if not shape:  # a 0-d tensor is one row of one element; 8-bit codes keep the input's shape
        return () if bits == 8 else (nbytes,)
    return (*shape[:-1], nbytes)


def check_block(block, x, grouping) -> Tuple[int, int]:
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise TypeError(f"block must be a (Br, Bc) pair of ints >= 1, got {block!r}")
    br, bc = checks.check_int("block[0]", block[0], 1), checks.check_int("block[1]", block[1], 1)
    if x is not None and x.dim() != 2:
        raise ValueError(f"block={(br, bc)} needs a 2-D tensor; x has shape {tuple(x.shape)}")
    if grouping != "row":
        raise ValueError(f"block={(br, bc)} lays codes out by rows (SPEC 6); grouping must be 'row', "
                         f"got {grouping!r}")
    return br, bc


def check_quantized_tensor(qt) -> FPFormat:
    """Check that ``qt`` is a :class:`QuantizedTensor` whose fields agree (:meth:`QuantizedTensor.validate`);
    returns its element format.

    Raises:
        TypeError, ValueError: naming the field (``qt.codes``, ``qt.scales``, ...).
    """
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a ds_fpquant.QuantizedTensor, got {type(qt).__name__}")
    f = element_format(qt.fmt)
    checks.check_int("qt.group_size", qt.group_size, 1)
    checks.check_choice("qt.grouping", qt.grouping, GROUPINGS)
    checks.check_shape("qt.shape", qt.shape)
    checks.check_float_dtype("qt.dtype", qt.dtype)
    nvfp4 = qt.fmt == "nvfp4"
    checks.check_choice("qt.scale_format", qt.scale_format, (NVFP4_SCALE_FORMAT,) if nvfp4 else SCALE_FORMATS)
    if qt.fmt in PRESETS:
        _, preset_g, preset_scales = PRESETS[qt.fmt]
        if (qt.group_size, qt.scale_format, qt.block) != (preset_g, preset_scales, None):
            raise ValueError(f"fmt={qt.fmt!r} means group_size={preset_g}, scale_format={preset_scales!r}, no block; "
                             f"qt has group_size={qt.group_size}, scale_format={qt.scale_format!r}, block={qt.block!r}")
    codes_shape = codes_shape_for(qt.shape, qt.grouping, qt.group_size, f.bits)
    checks.check_byte_tensor("qt.codes", qt.codes, codes_shape)
    scales_shape = scales_shape_for(qt.shape, qt.grouping, qt.group_size)
    if qt.block is not None:
        br, bc = check_block(qt.block, None, qt.grouping)
        if len(qt.shape) != 2 or qt.group_size != bc:
            raise ValueError(f"qt.block={qt.block!r} needs a 2-D shape and group_size == Bc; got shape "
                             f"{tuple(qt.shape)}, group_size={qt.group_size}")
        scales_shape = (ceil_div(qt.shape[0], br), ceil_div(qt.shape[1], bc))
    if nvfp4:
        t = qt.tensor_scale
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 0:
            raise TypeError(f"qt.tensor_scale must be a 0-d float32 tensor for fmt='nvfp4' (SPEC 3.4), got "
                            f"{t if not isinstance(t, torch.Tensor) else f'{t.dtype} of shape {tuple(t.shape)}'}")
        checks.check_device("qt.tensor_scale", t, qt.codes.device)
    elif qt.tensor_scale is not None:
        raise ValueError(f"qt.tensor_scale is only used by fmt='nvfp4'; it must be None for fmt={qt.fmt!r}")
    scale_dtype = torch.float32 if qt.scale_format == "fp32" else torch.uint8
    if not isinstance(qt.scales, torch.Tensor) or qt.scales.dtype != scale_dtype:
        raise TypeError(f"qt.scales must be a {str(scale_dtype).replace('torch.', '')} tensor for "
                        f"scale_format={qt.scale_format!r}, got {getattr(qt.scales, 'dtype', type(qt.scales).__name__)}")
    if tuple(qt.scales.shape) != scales_shape:
        raise ValueError(f"qt.scales has shape {tuple(qt.scales.shape)}; expected {scales_shape}")
    checks.check_device("qt.scales", qt.scales, qt.codes.device)
    return f
