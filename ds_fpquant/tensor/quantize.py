"""Native API (docs/api.md): ``quantize``, ``dequantize`` and ``check_settings`` (``QuantizedTensor`` is in
:mod:`ds_fpquant.tensor.quantized_tensor`)."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from ds_fpquant.numerics import checks
from ds_fpquant.numerics.choices import BACKENDS, GROUPINGS, ROUNDINGS, SCALE_FORMATS, SCALE_ROUNDINGS
from ds_fpquant.numerics.codec import ieee_denormals
from ds_fpquant.numerics.formats import (
    NVFP4_ELEMENT_FORMAT,
    NVFP4_SCALE_FORMAT,
    FPFormat,
    element_format,
    get_format,
    resolve_granularity,
    resolve_scaling,
)
from ds_fpquant.numerics.packing import ceil_div
from ds_fpquant.numerics.scales import (
    SCALE_FLOOR,
    block_scales,
    check_given_scales,
    clear_groups,
    group_amax,
    nvfp4_scales,
    nvfp4_tensor_scale,
)
from ds_fpquant.ops import backends
from ds_fpquant.tensor.quantized_tensor import (
    QuantizedTensor,
    check_block,
    check_quantized_tensor,
    codes_shape_for,
    rows_and_k,
    scales_shape_for,
)

__all__ = ["quantize", "dequantize", "check_settings", "nvfp4_shared_tensor_scale"]


def check_settings(fmt: str = "e4m3", group_size: Optional[int] = None, *, grouping: str = "row",
                   block: Optional[Tuple[int, int]] = None, scale_format: Optional[str] = None,
                   scale_rounding: str = "ceil", rounding: str = "nearest", seed: Optional[int] = None,
                   backend: str = "auto", granularity: Optional[str] = None) -> Tuple[int, str, Optional[Tuple[int, int]]]:
    """Check the arguments of :func:`quantize` that do not depend on the tensor, as it does (same errors),
    and resolve them: returns ``(group_size, scale_format, block)`` with a preset's own values, ``granularity``
    as its block / group (:func:`ds_fpquant.numerics.formats.resolve_granularity`) and, with ``block``, its
    ``Bc`` as the group size.

    Raises:
        TypeError, ValueError: as :func:`quantize` (SPEC 7).
    """
    if block is not None:
        block = check_block(block, None, "row")
    if granularity is not None and group_size is not None:
        group_size = checks.check_int("group_size", group_size, 1)
    group_size, block = resolve_granularity(fmt, granularity, group_size, block)
    if granularity is not None:
        checks.check_choice("grouping", grouping, GROUPINGS)
        if grouping != "row":
            raise ValueError(f"granularity={granularity!r} scales rows or 2-D matrices; grouping must be 'row', "
                             f"got {grouping!r}")
    group_size, scale_format, block = resolve_scaling(fmt, group_size, block, scale_format)
    _check_quantize_args(fmt, grouping, block, scale_format, scale_rounding, rounding, seed, backend)
    if block is not None:
        check_block(block, None, grouping)  # rows of codes are cut into segments of Bc (SPEC 6)
    return group_size, scale_format, block


def _check_quantize_args(fmt, grouping, block, scale_format, scale_rounding, rounding, seed, backend) -> FPFormat:
    f = element_format(fmt)
    checks.check_choice("grouping", grouping, GROUPINGS)
    checks.check_choice("scale_format", scale_format,
                        (*SCALE_FORMATS, NVFP4_SCALE_FORMAT) if fmt == "nvfp4" else SCALE_FORMATS)
    checks.check_choice("scale_rounding", scale_rounding, SCALE_ROUNDINGS)
    checks.check_choice("rounding", rounding, ROUNDINGS)
    checks.check_choice("backend", backend, BACKENDS)
    if seed is not None and rounding != "stochastic":
        raise ValueError(f"seed={seed!r} is only allowed with rounding='stochastic' (got rounding={rounding!r})")
    if scale_rounding != "ceil" and scale_format != "e8m0":
        raise ValueError(f"scale_rounding={scale_rounding!r} only applies to scale_format='e8m0' "
                         f"(got fmt={fmt!r}, scale_format={scale_format!r}); leave it at 'ceil'")
    return f


def draw_seed() -> int:
    """A 64-bit stochastic-rounding seed from torch's default CPU generator, so that
    ``torch.manual_seed`` makes stochastic quantization reproducible."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64)) * 4 + int(torch.randint(0, 4, ()))


def quantize(
    x: torch.Tensor,
    fmt: str = "e4m3",
    group_size: Optional[int] = None,
    *,
    grouping: str = "row",
    block: Optional[Tuple[int, int]] = None,
    scale_format: Optional[str] = None,
    scale_rounding: str = "ceil",
    rounding: str = "nearest",
    seed: Optional[int] = None,
    offset: int = 0,
    backend: str = "auto",
    scales: Optional[torch.Tensor] = None,
    granularity: Optional[str] = None,
    tensor_scale: Optional[torch.Tensor] = None,
) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt`` codes with one scale per group of ``group_size`` elements.

    Args:
        x: fp32 / fp16 / bf16 tensor of any shape on any device; non-contiguous input is read
            in logical (row-major) order.
        fmt: element format, one of ``"e4m3" "e5m2" "e3m2" "e2m3" "e2m1" "e4m7"`` (SPEC 1), or a
            preset: ``"mxfp8_e4m3" "mxfp8_e5m2" "mxfp6_e3m2" "mxfp6_e2m3" "mxfp4"`` (G=32, E8M0
            scales, OCP MX v1.0) or ``"nvfp4"`` (SPEC 3.4: e2m1 in groups of 16, e4m3 group scale codes
            times the fp32 per-tensor scale ``tensor_scale``; with ``grouping="flat"`` the groups run
            over ``numel``).
        group_size: elements per group ``G >= 1``; the last group of a row may be shorter (SPEC 2).
            ``None`` (not given): 128, or the preset's (32 for MX, 16 for NVFP4); a preset refuses any
            other value (``ValueError``).
        grouping: ``"row"`` (groups tile the last dim) or ``"flat"`` (groups run over ``numel``).
        scale_format: ``"fp32"`` (SPEC 3.1) or ``"e8m0"`` (SPEC 3.2, power-of-two scales stored as
            bytes). ``None`` (not given): ``"fp32"``, or the preset's (``"e8m0"`` for the MX presets,
            ``"e4m3"`` for NVFP4); a preset refuses any other value (``ValueError``).
        scale_rounding: E8M0 only: ``"ceil"`` (no element saturates, except within a factor 2 of FLT_MAX
            where the exponent is capped at ``127 - emax_elem`` so that nothing dequantizes to Inf) or
            ``"floor"`` (OCP MX rule); SPEC 3.2.
        rounding: ``"nearest"`` (RNE) or ``"stochastic"`` (SPEC 4: unbiased, one Philox4x32-10 word
            per element; all backends give the same bits for the same ``seed`` and ``offset``).
        seed: 64-bit stochastic-rounding key; ``None`` draws one from torch's default generator
            (so ``torch.manual_seed`` makes runs reproducible). Only with ``rounding="stochastic"``.
        offset: 64-bit counter offset: use a new one per call to get fresh random words.
        block: ``(Br, Bc)`` for 2-D block scaling of a 2-D tensor (weights, DeepSeek-V3 style
            ``(128, 128)``): one scale per tile, edge tiles smaller; the groups are then ``Bc`` wide (codes
            are laid out as row grouping with ``G = Bc``, scales are ``(ceil(N/Br), ceil(K/Bc))``), so
            ``group_size`` is left out (or equals ``Bc``). Not with the presets. A side at least the
            matrix's (``Br >= N``, ``Bc >= K``) is one tile along it, with no padding: ``block=(2**20, 2**20)``
            gives the codes and scales of ``block=(N, K)``, scales ``(1, 1)``; the block is recorded as given.
        granularity: ``"tensor"`` (one scale per 2-D matrix: ``block=(WHOLE, WHOLE)``, scales ``(1, 1)``) or
            ``"channel"`` (one scale per row, the output channel of a weight: ``group_size=WHOLE``, scales
            ``(*shape[:-1], 1)``); ``WHOLE = 2**31 - 1`` (:data:`ds_fpquant.numerics.formats.WHOLE`). Not with
            ``group_size``, ``block``, a preset or ``grouping="flat"``.
        backend: ``"auto"`` (the compiled op for ``x``'s device when it builds, else the torch
            reference with one warning), ``"cpu"``/``"cuda"`` (the compiled op, ``RuntimeError``
            when it cannot be built) or ``"torch"``. All give identical bits.
        scales: optional caller-given fp32 scales shaped like the result's ``scales`` (finite,
            ``>= 2^-126``); elements are then encoded with ``r = fl(1/s)`` of these (SPEC 4,
            saturating where they are too small) and they are stored as given.
        tensor_scale: ``fmt="nvfp4"`` only: a given fp32 per-tensor scale ``t`` (0-d, finite, ``>= 2^-126``,
            any device), used instead of ``t`` of ``x``'s own amax and stored as given. The layers that
            serving engines fuse (q/k/v, gate/up) share one: pass each of them
            :func:`nvfp4_shared_tensor_scale` of all of them (SPEC 3.4).

    Returns:
        :class:`QuantizedTensor` with codes packed as SPEC 6 and the scales of SPEC 3.1 (fp32; NaN
        for a group with NaN/Inf in formats that have no NaN code, SPEC 3.3), 3.2 (E8M0 bytes) or 3.4
        (NVFP4: e4m3 codes, ``0x7F`` for a group with NaN/Inf, plus ``tensor_scale``).

    Raises:
        TypeError, ValueError: invalid arguments (SPEC 7), before any work is done.
    """
    group_size, scale_format, block = check_settings(fmt, group_size, grouping=grouping, block=block,
                                                     scale_format=scale_format, scale_rounding=scale_rounding,
                                                     rounding=rounding, seed=seed, backend=backend,
                                                     granularity=granularity)
    offset = checks.check_u64("offset", offset)
    checks.check_tensor("x", x)
    if backend in ("cpu", "cuda") and x.device.type != backend:
        raise ValueError(f"backend={backend!r} needs a {backend} tensor; x is on {x.device}")
    f = element_format(fmt)
    seed = None if seed is None else checks.check_u64("seed", seed)
    nvfp4 = fmt == "nvfp4"
    if scales is not None and (scale_format != "fp32" or nvfp4):
        raise ValueError(f"scales= takes fp32 scales; it cannot be combined with fmt={fmt!r}, "
                         f"scale_format={scale_format!r}")
    given_t = None
    if tensor_scale is not None:
        given_t = _check_tensor_scale(tensor_scale, fmt).to(x.device)
    e8m0 = scale_rounding if scale_format == "e8m0" else None
    if block is not None:
        if granularity is not None and x.dim() != 2:
            raise ValueError(f"granularity={granularity!r} needs a 2-D tensor (one scale per matrix); x has shape "
                             f"{tuple(x.shape)}")
        check_block(block, x, grouping)
        if scales is not None:
            raise ValueError("scales= cannot be combined with block=: the block scales come from the tiles' amax")
    shape = tuple(x.shape)
    scales_shape = scales_shape_for(shape, grouping, group_size)
    rows, k = rows_and_k(shape, grouping)
    if scales is not None:  # an owning contiguous copy: the result never aliases the caller's tensor
        scales = check_given_scales(scales, scales_shape, x.device).reshape(rows, ceil_div(k, group_size))
        scales = scales.clone(memory_format=torch.contiguous_format)
    impl = backends.resolve(backend, x.device)
    stream = None
    if rounding == "stochastic":
        stream = (draw_seed() if seed is None else seed, offset)
    # A group never spans rows, so G >= K means one group of K per row: same layout, bounded work.
    g_eff = min(group_size, max(k, 1))
    # Not differentiable: results never carry autograd history. IEEE subnormals on every backend.
    with torch.no_grad(), ieee_denormals():
        x2 = x.detach().resolve_neg().resolve_conj().contiguous().reshape(rows, k)
        stored = tensor_scale = zero = None
        if block is not None:
            stored, scales = block_scales(x2, f, block, e8m0)
            scales_shape, e8m0 = tuple(stored.shape), None  # encode with the per-segment fp32 scales
        elif nvfp4:  # group scales from two-level scaling, then the row kernels with those scales
            stored, tensor_scale, scales, zero = nvfp4_scales(x2, g_eff, given_t)
        seed_, offset_ = stream if stream is not None else (0, 0)
        packed, s = impl.quantize(x2, f.name, g_eff, scales, stream is not None, seed_, offset_, e8m0 or "")
        if zero is not None:
            packed = clear_groups(packed, zero, g_eff, f.bits)
    return QuantizedTensor(
        codes=packed.reshape(codes_shape_for(shape, grouping, group_size, f.bits)),
        scales=(s if stored is None else stored).reshape(scales_shape),
        shape=torch.Size(shape),
        dtype=x.dtype,
        fmt=fmt,
        group_size=group_size,
        grouping=grouping,
        block=block,
        scale_format=scale_format,
        tensor_scale=tensor_scale,
    )


def _check_tensor_scale(tensor_scale, fmt: str) -> torch.Tensor:
    if fmt != "nvfp4":
        raise ValueError(f"tensor_scale= is NVFP4's per-tensor scale (SPEC 3.4); got fmt={fmt!r}")
    if not isinstance(tensor_scale, torch.Tensor) or tensor_scale.dtype != torch.float32 or tensor_scale.dim() != 0:
        got = (f"{tensor_scale.dtype} of shape {tuple(tensor_scale.shape)}" if isinstance(tensor_scale, torch.Tensor)
               else type(tensor_scale).__name__)
        raise TypeError(f"tensor_scale must be a 0-d torch.float32 tensor, got {got}")
    t = tensor_scale.item()
    if not (math.isfinite(t) and t >= SCALE_FLOOR):
        raise ValueError(f"tensor_scale={t!r} must be finite and >= 2^-126 (SPEC 3.4)")
    return tensor_scale.detach().clone()


def nvfp4_shared_tensor_scale(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The NVFP4 tensor scale that the matrices ``tensors`` share (SPEC 3.4): ``t`` of their joint amax, the
    largest ``|x|`` over the finite elements of all of them; a 0-d fp32 tensor on the first one's device.

    ``quantize(x, "nvfp4", tensor_scale=nvfp4_shared_tensor_scale([x]))`` is ``quantize(x, "nvfp4")``; for the
    layers a serving engine fuses into one (vLLM and SGLang fuse q/k/v and gate/up, and use the largest of the
    shards' tensor scales with each shard's group scales unchanged), quantize each with the scale of the
    group, as NVIDIA ModelOpt's export does.

    Args:
        tensors: a non-empty sequence of fp32 / fp16 / bf16 tensors, any shapes, on one device.

    Raises:
        TypeError, ValueError: an empty sequence, a non-tensor or a tensor of another dtype, tensors on
            different devices.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"tensors must be a non-empty list or tuple of tensors, got {type(tensors).__name__}")
    for i, x in enumerate(tensors):
        checks.check_tensor(f"tensors[{i}]", x)
        checks.check_device(f"tensors[{i}]", x, tensors[0].device)
    with torch.no_grad():
        amax = torch.stack([group_amax(x.detach().reshape(1, -1).to(torch.float32))[0][0] if x.numel()
                            else torch.zeros((), dtype=torch.float32, device=x.device) for x in tensors]).amax()
        return nvfp4_tensor_scale(amax, get_format(NVFP4_ELEMENT_FORMAT), get_format(NVFP4_SCALE_FORMAT))


def dequantize(qt: QuantizedTensor, dtype: Optional[torch.dtype] = None, *, backend: str = "auto") -> torch.Tensor:
    """Dequantize ``qt`` to a tensor of ``qt.shape`` (SPEC 5).

    ``y = fl(decode(q) * s)`` in fp32, then rounded to ``dtype`` (IEEE RNE; fp16 overflow gives
    Inf). NaN codes give NaN, Inf codes +-Inf, a NaN scale NaN for its whole group.

    Args:
        qt: result of :func:`quantize`.
        dtype: fp32 / fp16 / bf16 output dtype; defaults to ``qt.dtype``.
        backend: ``"auto"``, ``"cuda"``, ``"cpu"`` or ``"torch"``, as for :func:`quantize`.

    Raises:
        TypeError, ValueError: ``qt`` is inconsistent (codes/scales of the wrong dtype or shape) or
            ``dtype`` is not supported.
    """
    check_quantized_tensor(qt)
    return qt.dequantize(dtype, backend=backend)
