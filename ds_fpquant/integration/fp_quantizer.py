"""Drop-in replacement for ``deepspeed.ops.fp_quantizer.FP_Quantize`` (docs/api.md, SPEC 6.1).

Same methods and buffer layout as DeepSpeed's class, with SPEC numerics: flat grouping over the
whole tensor, one fp32 scale per group, no element ever dropped (a short last group is padded
with zero codes in the buffer), fp32/fp16/bf16 input, any group size.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from deepspeed.ops.fp_quantizer import Quantizer

from ds_fpquant.numerics import checks
from ds_fpquant.numerics.formats import FPFormat, format_from_deepspeed
from ds_fpquant.numerics.packing import ceil_div, group_bytes
from ds_fpquant.tensor.quantize import dequantize, draw_seed, quantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["FP_Quantize"]

#: Bytes of the little-endian fp32 scale that ends each buffer row (SPEC 6.1).
SCALE_BYTES = 4


class FP_Quantize(Quantizer):
    """Group FP quantizer with DeepSpeed's ``FP_Quantize`` interface.

    Args:
        quantization_config: a ``deepspeed.linear.QuantizationConfig`` (its ``group_size`` is
            read), or an int group size (older DeepSpeed constructor, positional).
        group_size: the older keyword form ``FP_Quantize(group_size=512)``.

    Raises:
        TypeError, ValueError: no usable group size (must be an int >= 1).
    """

    def __init__(self, quantization_config=None, group_size: Optional[int] = None) -> None:
        if isinstance(quantization_config, int) and not isinstance(quantization_config, bool):
            quantization_config, group_size = None, quantization_config
        if quantization_config is not None:
            if group_size is not None:
                raise ValueError("pass either quantization_config or group_size, not both "
                                 f"(got group_size={group_size!r})")
            if not hasattr(quantization_config, "group_size"):
                raise TypeError("quantization_config must have a group_size attribute (a "
                                "deepspeed.linear.QuantizationConfig), got "
                                f"{type(quantization_config).__name__}")
            group_size = quantization_config.group_size
        elif group_size is None:
            group_size = 512  # DeepSpeed's Quantizer default
        super().__init__(group_size=checks.check_int("group_size", group_size, 1))
        self.q_config = quantization_config
        self.orig_dtype: Optional[torch.dtype] = None
        self.orig_shape: Optional[torch.Size] = None
        self.num_groups: Optional[int] = None
        #: uint8 ``(num_groups, 4)``: the last quantize call's fp32 scales as little-endian bytes.
        self.scale: Optional[torch.Tensor] = None
        #: Stochastic-rounding key; drawn from torch's default generator at the first
        #: ``stochastic_mode=True`` call (so ``torch.manual_seed`` makes runs reproducible).
        self.seed: Optional[int] = None
        #: Philox counter offset of the next stochastic call; advanced by one per call.
        self.offset: int = 0

    # ---- helpers ------------------------------------------------------------------------------
    def _row_layout(self, f: FPFormat) -> Tuple[int, int]:
        """(code bytes per group, buffer row bytes) of SPEC 6.1."""
        gbytes = group_bytes(self.group_size, f.bits)
        return gbytes, gbytes + SCALE_BYTES

    def _num_groups(self, numel: int) -> int:
        return ceil_div(numel, self.group_size)

    def _orig(self) -> Tuple[Optional[tuple], Optional[torch.dtype]]:
        """``orig_shape`` and ``orig_dtype`` (set by quantize or by the caller), checked."""
        shape = None if self.orig_shape is None else checks.check_shape("orig_shape", self.orig_shape)
        if self.orig_dtype is not None:
            checks.check_float_dtype("orig_dtype", self.orig_dtype)
        return shape, self.orig_dtype

    @staticmethod
    def _check_fp_out(fp_out, numel: int, device) -> None:
        checks.check_tensor("fp_out", fp_out)
        if fp_out.numel() != numel:
            raise ValueError(f"fp_out has {fp_out.numel()} elements; expected {numel}")
        checks.check_device("fp_out", fp_out, device)

    def _target(self, fp_out, device) -> Tuple[torch.Size, torch.dtype]:
        """Shape and dtype of the dequantized output (from ``fp_out`` or the last quantize)."""
        shape, dtype = self._orig()
        if fp_out is not None:
            self._check_fp_out(fp_out, fp_out.numel() if shape is None else math.prod(shape), device)
            return fp_out.shape, fp_out.dtype
        if shape is None or dtype is None:
            raise ValueError("nothing to dequantize into: call quantize() first, set orig_shape and "
                             "orig_dtype, or pass fp_out")
        return torch.Size(shape), dtype

    def _check_buffer(self, input_q, f: FPFormat, num_groups: int, row: int) -> None:
        try:
            checks.check_byte_tensor("input_q", input_q, (num_groups, row))
        except ValueError as exc:
            raise ValueError(f"{exc} (the buffer of {num_groups} groups of {self.group_size} {f.name} codes; "
                             f"check q_bits / q_mantisa_bits and the group size it was quantized with)") from None

    @staticmethod
    def _check_meta_codes(input_q, f: FPFormat, numel: int) -> None:
        """Meta codes (``return_meta_tensor=True``): one byte per element of an 8-bit format."""
        if f.bits != 8:
            raise ValueError(f"scale= (meta tensors) needs an 8-bit format, got q_bits={f.bits}")
        checks.check_byte_tensor("input_q", input_q, device=None)
        if input_q.numel() != numel:
            raise ValueError(f"input_q has {input_q.numel()} codes; expected {numel} (one per element)")

    def _to_quantized(self, input_q, scale, f: FPFormat, numel: int, dtype) -> QuantizedTensor:
        """Rebuild the native flat-grouped :class:`QuantizedTensor` from a buffer (SPEC 6.1)."""
        num_groups = self._num_groups(numel)
        gbytes, row = self._row_layout(f)
        if scale is None:
            self._check_buffer(input_q, f, num_groups, row)
            buf = input_q.view(torch.uint8)
            codes = buf[:, :gbytes]
            scales = buf[:, gbytes:].clone(memory_format=torch.contiguous_format)  # aligned for the fp32 view
            n_full, tail = divmod(numel, self.group_size)
            flat = codes.reshape(num_groups * gbytes)
            if tail:  # the native layout keeps only the bytes the short last group needs
                flat = flat[:n_full * gbytes + group_bytes(tail, f.bits)]
        else:
            self._check_meta_codes(input_q, f, numel)
            flat = input_q.view(torch.uint8).reshape(numel)
            scales = self._scale_bytes(scale, num_groups, input_q.device)
        scales = scales.contiguous().view(torch.float32).reshape(num_groups)
        return QuantizedTensor(codes=flat.contiguous(), scales=scales, shape=torch.Size((numel,)), dtype=dtype,
                               fmt=f.name, group_size=self.group_size, grouping="flat")

    def _selected_groups(self, input_q, scale, f: FPFormat, numel: int, group_ids: torch.Tensor,
                         dtype) -> QuantizedTensor:
        """Only the groups ``group_ids`` (int64, ``(n,)``, each in ``[0, num_groups)``) of a buffer (or of
        meta codes + ``scale``) as a flat :class:`QuantizedTensor` of ``n * G`` elements (SPEC 6.1).

        A short last group comes with the buffer's zero padding (meta codes: its last code repeated);
        the caller drops those elements. Nothing but the selected groups' bytes is read or copied.
        """
        num_groups = self._num_groups(numel)
        gbytes, row = self._row_layout(f)
        if scale is None:
            self._check_buffer(input_q, f, num_groups, row)
            rows = input_q.view(torch.uint8).index_select(0, group_ids)
            # an owning copy: the fp32 view needs 4-byte aligned scale bytes (a 1-row slice is "contiguous")
            codes, scales = rows[:, :gbytes], rows[:, gbytes:].clone(memory_format=torch.contiguous_format)
        else:
            self._check_meta_codes(input_q, f, numel)
            g = self.group_size
            elements = (group_ids.unsqueeze(1) * g + torch.arange(g, device=group_ids.device)).clamp_(max=numel - 1)
            codes = input_q.view(torch.uint8).reshape(numel).index_select(0, elements.reshape(-1))
            scales = self._scale_bytes(scale, num_groups, input_q.device).index_select(0, group_ids)
        n = group_ids.numel()
        return QuantizedTensor(codes=codes.reshape(n * gbytes), scales=scales.view(torch.float32).reshape(n),
                               shape=torch.Size((n * self.group_size,)), dtype=dtype, fmt=f.name,
                               group_size=self.group_size, grouping="flat")

    @staticmethod
    def _scale_bytes(scale, num_groups: int, device) -> torch.Tensor:
        """Meta scales as uint8 ``(num_groups, 4)``; fp32 ``(num_groups,)``/``(num_groups, 1)`` also accepted."""
        if isinstance(scale, torch.Tensor) and scale.dtype == torch.float32:
            if scale.numel() != num_groups:
                raise ValueError(f"scale has {scale.numel()} fp32 values; expected {num_groups} (one per group)")
            checks.check_device("scale", scale, device)
            return scale.reshape(num_groups).clone().view(torch.uint8).reshape(num_groups, SCALE_BYTES)
        checks.check_byte_tensor("scale", scale, (num_groups, SCALE_BYTES), device)
        return scale.view(torch.uint8).clone(memory_format=torch.contiguous_format)

    # ---- DeepSpeed interface ------------------------------------------------------------------
    def quantize(self,
                 input: torch.Tensor,
                 q_bits: int = 8,
                 q_mantisa_bits: int = 3,
                 stochastic_mode: bool = False,
                 return_meta_tensor: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Quantize ``input`` (any shape, fp32/fp16/bf16) with flat grouping (SPEC 2, 6.1).

        ``stochastic_mode=True`` rounds stochastically (SPEC 4): unbiased, with the quantizer's
        ``seed`` and a counter ``offset`` that advances per call, so two calls never reuse words.

        Returns:
            uint8 ``(num_groups, ceil(G*b/8) + 4)``: each row one group's codes, then its fp32 scale
            (little-endian); ``num_groups = ceil(numel / G)``. With ``return_meta_tensor=True``
            (8-bit formats only): ``(codes uint8 shaped like input, scales uint8 (num_groups, 4))``.

        Raises:
            TypeError, ValueError: unsupported dtype, ``(q_bits, q_mantisa_bits)`` pair not in SPEC 1,
                ``return_meta_tensor`` with a sub-byte format.
        """
        checks.check_tensor("input", input)
        f = format_from_deepspeed(q_bits, q_mantisa_bits)
        stochastic_mode = checks.check_flag("stochastic_mode", stochastic_mode)
        return_meta_tensor = checks.check_flag("return_meta_tensor", return_meta_tensor)
        if return_meta_tensor and f.bits != 8:
            raise ValueError(f"return_meta_tensor=True needs q_bits=8 (one byte per code); got q_bits={q_bits}")
        rounding = {}
        if stochastic_mode:  # SPEC 4: a fresh Philox counter offset per call, one seed per quantizer
            if self.seed is None:
                self.seed = draw_seed()
            rounding = dict(rounding="stochastic", seed=self.seed, offset=self.offset)
            self.offset += 1
        qt = quantize(input.reshape(-1), f.name, self.group_size, grouping="flat", **rounding)
        num_groups = qt.scales.numel()
        scale_bytes = qt.scales.view(torch.uint8).reshape(num_groups, SCALE_BYTES)
        self.orig_dtype, self.orig_shape, self.num_groups = input.dtype, input.shape, num_groups
        self.scale = scale_bytes
        if return_meta_tensor:
            return qt.codes.reshape(input.shape), scale_bytes.clone()
        gbytes, row = self._row_layout(f)
        codes = torch.zeros(num_groups * gbytes, dtype=torch.uint8, device=input.device)
        codes[:qt.codes.numel()] = qt.codes  # a short last group is padded with zero codes
        return torch.cat([codes.view(num_groups, gbytes), scale_bytes], dim=1)

    def dequantize(self,
                   input_q: torch.Tensor,
                   fp_out: Optional[torch.Tensor] = None,
                   q_bits: int = 8,
                   q_mantisa_bits: int = 3,
                   scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Dequantize a buffer (or meta ``codes`` with ``scale=``) into ``fp_out`` or a new tensor.

        Output shape and dtype come from ``fp_out`` when given, else from the last ``quantize`` (or
        ``orig_shape``/``orig_dtype`` assigned by the caller). ``input_q`` may be uint8 or int8.
        """
        f = format_from_deepspeed(q_bits, q_mantisa_bits)
        checks.check_byte_tensor("input_q", input_q)
        shape, dtype = self._target(fp_out, input_q.device)
        numel = math.prod(shape)
        y = dequantize(self._to_quantized(input_q, scale, f, numel, dtype), dtype).reshape(shape)
        if fp_out is None:
            return y
        with torch.no_grad():
            fp_out.copy_(y)
        return fp_out

    def selective_dequantize(self,
                             input_q: torch.Tensor,
                             indexes: torch.Tensor,
                             fp_out: Optional[torch.Tensor] = None,
                             q_bits: int = 8,
                             q_mantisa_bits: int = 3,
                             scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Dequantize only the slices ``orig[indexes]`` along dim 0 (e.g. the chosen MoE experts).

        Only the groups that hold the selected slices are read and decoded (a slice of ``R`` elements
        touches ``R/G`` groups when ``G`` divides ``R``, at most ``ceil((R + G - 1) / G)`` otherwise), so
        the work and the temporary memory scale with ``len(indexes)``, not with ``orig_shape[0]`` (a
        selection that would touch as many elements as the whole tensor decodes it once instead). The
        result is bit-identical to the same rows of :meth:`dequantize` (SPEC 5).

        Args:
            input_q: the buffer of :meth:`quantize` (uint8 or int8), or meta codes with ``scale=``.
            indexes: 1-D int32 or int64 tensor of dim-0 positions in ``[0, orig_shape[0])``; any order,
                repeats allowed; on the CPU or on ``input_q``'s device.
            fp_out: optional output of ``len(indexes) * prod(orig_shape[1:])`` elements; its dtype is
                the one the values are rounded to.
            q_bits, q_mantisa_bits, scale: as for :meth:`dequantize`.

        Returns:
            ``(len(indexes), *orig_shape[1:])`` tensor of ``orig_dtype`` (or ``fp_out``).

        Raises:
            TypeError, ValueError: no ``orig_shape``/``orig_dtype``, ``indexes`` of the wrong dtype, rank,
                device or range, a buffer of the wrong shape, or a ``(q_bits, q_mantisa_bits)`` pair
                that names no format.
        """
        shape, dtype = self._orig()
        if shape is None or dtype is None or len(shape) < 1:
            raise ValueError("selective_dequantize needs orig_shape (ndim >= 1) and orig_dtype: call quantize() "
                             "first or set them")
        checks.check_byte_tensor("input_q", input_q)
        if not isinstance(indexes, torch.Tensor) or indexes.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"indexes must be an int32 or int64 tensor, got "
                            f"{getattr(indexes, 'dtype', type(indexes).__name__)}")
        if indexes.dim() != 1:
            raise ValueError(f"indexes must be 1-D, got shape {tuple(indexes.shape)}")
        if indexes.device.type not in ("cpu", input_q.device.type):
            raise ValueError(f"indexes is on {indexes.device}; expected cpu or {input_q.device}")
        n0 = shape[0]
        if indexes.numel() and (int(indexes.min()) < 0 or int(indexes.max()) >= n0):
            raise ValueError(f"indexes must lie in [0, {n0}) (orig_shape[0]); got values in "
                             f"[{int(indexes.min())}, {int(indexes.max())}]")
        out_shape = torch.Size((indexes.numel(), *shape[1:]))
        if fp_out is not None:
            self._check_fp_out(fp_out, math.prod(out_shape), input_q.device)
            dtype = fp_out.dtype  # round once, straight to the output dtype (SPEC 5)
        f = format_from_deepspeed(q_bits, q_mantisa_bits)
        numel, slice_numel, g = math.prod(shape), math.prod(shape[1:]), self.group_size
        span = slice_numel // g if slice_numel % g == 0 else ceil_div(slice_numel + g - 1, g)  # rows can start mid-group
        if indexes.numel() == 0 or slice_numel == 0:
            self._to_quantized(input_q, scale, f, numel, dtype)  # the buffer is checked all the same
            y = torch.empty(out_shape, dtype=dtype, device=input_q.device)
        elif indexes.numel() * span * g >= numel:  # the selection covers as much as the whole tensor
            full = dequantize(self._to_quantized(input_q, scale, f, numel, dtype), dtype)
            y = full.reshape(shape).index_select(0, indexes.to(full.device).long())
        else:
            start = indexes.to(input_q.device, torch.int64) * slice_numel  # first element of each slice
            first_group = start // g
            last = self._num_groups(numel) - 1
            group_ids = (first_group.unsqueeze(1) + torch.arange(span, device=start.device)).clamp_(max=last)
            qt = self._selected_groups(input_q, scale, f, numel, group_ids.reshape(-1), dtype)
            y = dequantize(qt, dtype).view(indexes.numel(), span * g)
            if slice_numel % g:  # each slice starts `start - first_group * G` elements into its first group
                columns = (start - first_group * g).unsqueeze(1) + torch.arange(slice_numel, device=start.device)
                bits = {2: torch.int16, 4: torch.int32}[y.element_size()]  # gather the bits: NaNs stay as they are
                y = y.view(bits).gather(1, columns).view(dtype)
            y = y.reshape(out_shape)
        if fp_out is None:
            return y
        with torch.no_grad():
            fp_out.copy_(y.reshape(fp_out.shape))
        return fp_out

    def get_scales(self) -> torch.Tensor:
        """fp32 ``(num_groups, 1)`` scales of the last ``quantize`` call (an owning copy)."""
        if self.scale is None:
            raise ValueError("no scales yet: call quantize() first")
        return self.scale.contiguous().view(torch.float32).reshape(self.scale.shape[0], 1).clone()

    def to(self, *args, **kwargs) -> "FP_Quantize":
        """Move the stored scales (if any) to the device named in ``Tensor.to`` arguments.

        Only the device is honoured: a dtype (e.g. from ``QuantizedParameter.to(torch.half)``) must
        not reinterpret the scale bytes. Safe before any quantize.
        """
        device, _dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args, **kwargs)
        if self.scale is not None and device is not None:
            self.scale = self.scale.to(device, non_blocking=non_blocking)
        return self
