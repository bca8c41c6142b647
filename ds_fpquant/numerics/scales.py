"""Group scales (SPEC 3): amax, fp32 scales, E8M0 power-of-two scales (SPEC 3.2), NVFP4's two levels (SPEC 3.4),
the one scale-and-fault rule :func:`group_scales`, and the scales a quantize call starts from on every backend (a
caller's fp32 scales, the tile scales of 2-D blocks). Plain fp32 IEEE arithmetic on torch tensors; the compiled
backends match it bit for bit."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ds_fpquant.numerics import checks
from ds_fpquant.numerics.codec import decode, encode
from ds_fpquant.numerics.formats import NVFP4_ELEMENT_FORMAT, NVFP4_SCALE_FORMAT, FPFormat, get_format
from ds_fpquant.numerics.packing import ceil_div

__all__ = ["SCALE_FLOOR", "group_amax", "scales_from_amax", "block_scales", "nvfp4_scales", "clear_groups",
           "check_given_scales"]

#: Smallest stored fp32 scale, ``2^-126`` (SPEC 3.1): keeps ``r = 1/s`` finite.
SCALE_FLOOR = 2.0**-126


def group_amax(groups: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``groups`` fp32 ``(..., G)`` -> ``(amax, has_nonfinite)``, each ``(...)`` (SPEC 3).

    ``amax`` is the largest ``|x|`` over the finite elements (0 if there are none).
    """
    finite = torch.isfinite(groups)
    amax = torch.where(finite, groups.abs(), torch.zeros((), dtype=groups.dtype, device=groups.device))
    return amax.amax(dim=-1), ~finite.all(dim=-1)


def scales_from_amax(amax: torch.Tensor, fmt: FPFormat) -> torch.Tensor:
    """fp32 scales of SPEC 3.1: ``max(fl(amax / fmax), 2^-126)``, and 1.0 where ``amax == 0``."""
    fmax = torch.tensor(fmt.fmax, dtype=torch.float32, device=amax.device)
    s = torch.clamp_min(amax / fmax, SCALE_FLOOR)  # one IEEE division, RNE
    return torch.where(amax == 0, torch.ones_like(s), s)


#: E8M0 stores ``e + 127``; byte 255 is NaN, byte 0 is 2^-127 (OCP MX v1.0, ml_dtypes.float8_e8m0fnu).
E8M0_BIAS = 127


E8M0_NAN = 255


#: The largest E8M0 exponent, 2^127 (byte 254).
E8M0_MAX_EXPONENT = 127


def pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2^k`` for integer ``k`` in ``[-149, 127]`` (built from the bit pattern)."""
    k = k.to(torch.int64)
    bits = torch.where(k >= -126, (k + 127) << 23, torch.ones_like(k) << torch.clamp(k + 149, min=0))
    return bits.to(torch.int32).view(torch.float32)


def e8m0_exponents(amax: torch.Tensor, fmt: FPFormat, scale_rounding: str) -> torch.Tensor:
    """int64 ``e`` of SPEC 3.2, clamped to ``[-127, 127]``; ``e = 0`` where ``amax == 0``.

    ``"floor"``: ``e = floor(log2(amax)) - emax_elem`` (OCP MX v1.0). ``"ceil"``: the smallest
    ``e`` with ``amax <= fmax * 2^e``, which is the floor exponent or one more (``fmax < 2^(emax+1)``);
    the comparison is exact in float64. Both are capped at ``127 - emax_elem`` so that ``fmax * 2^e``,
    and with it every decoded value, is finite (it binds only for ceil, within a factor 2 of FLT_MAX;
    the elements above ``fmax * 2^e`` then saturate).
    """
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2) = exponent - 1
    e = exponent.to(torch.int64) - 1 - fmt.emax
    if scale_rounding == "ceil":
        e = e + (amax.double() > fmt.fmax * torch.exp2(e.double())).to(torch.int64)
    e = e.clamp(max=E8M0_MAX_EXPONENT - fmt.emax)
    return torch.where(amax == 0, torch.zeros_like(e), e).clamp(min=-127)


def e8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 scales: ``2^(b - 127)``; 255 -> NaN."""
    b = byte.to(torch.int64)
    return torch.where(b == E8M0_NAN, torch.full_like(b, 0x7FC00000).to(torch.int32).view(torch.float32),
                       pow2(b - E8M0_BIAS))


def fp32_groups(x2: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp ``(R, K)`` -> fp32 ``(R, ceil(K/G), G)``, the short last group of each row padded with zeros
    (zeros never change a group's amax)."""
    rows, k = x2.shape
    n_groups = ceil_div(k, group_size)
    x32 = x2.to(torch.float32)
    if n_groups * group_size != k:
        x32 = torch.nn.functional.pad(x32, (0, n_groups * group_size - k))
    return x32.view(rows, n_groups, group_size)


def fp32_scales(scales: torch.Tensor, kind: str, tensor_scale=None) -> torch.Tensor:
    """Stored group scales as the fp32 scales elements decode with: ``kind`` ``"fp32"`` as stored, ``"e8m0"``
    ``2^(b - 127)`` with 255 NaN (SPEC 3.2, exact), ``"e4m3"`` NVFP4's ``fl(decode(c) * t)`` (SPEC 3.4; the NaN
    code gives NaN)."""
    if kind == "e8m0":
        return e8m0_decode(scales)
    if kind == NVFP4_SCALE_FORMAT:
        return decode(scales, get_format(NVFP4_SCALE_FORMAT)) * tensor_scale
    return scales


def group_scales(amax: torch.Tensor, nonfinite: torch.Tensor, fmt: FPFormat, e8m0: Optional[str] = None,
                 given: Optional[torch.Tensor] = None,
                 tensor_scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scale of each group (SPEC 3.1-3.4), the one rule every Python path uses: ``(stored, used)``.

    ``used`` is the fp32 scale the group's elements encode with (``r = fl(1/used)``): ``given`` (a caller's
    fp32 scales) or ``max(fl(amax/fmax), 2^-126)`` (1 for ``amax == 0``) with fp32 scales, ``2^e`` with E8M0
    (``e8m0``: ``"ceil"`` / ``"floor"``), ``fl(decode(c) * t)`` for NVFP4 (``tensor_scale`` ``t``, SPEC 3.4).
    ``stored`` is what the tensor keeps: ``used`` as fp32, the E8M0 byte ``e + 127``, or NVFP4's e4m3 code
    ``c``; and in a format without a NaN code a group with NaN/Inf (``nonfinite``) stores NaN (fp32 NaN, E8M0
    byte 255, e4m3 code 0x7F), so the fault stays visible (SPEC 3.3).
    """
    fault = nonfinite if not fmt.has_nan else torch.zeros_like(nonfinite)
    if tensor_scale is not None:
        scale_code = get_format(NVFP4_SCALE_FORMAT)
        c, used = nvfp4_group_scales(amax, tensor_scale, fmt, scale_code)
        return torch.where(fault, scale_code.nan_code, c).to(torch.uint8), used
    if e8m0 is not None:
        e = e8m0_exponents(amax, fmt, e8m0)
        return torch.where(fault, E8M0_NAN, e + E8M0_BIAS).to(torch.uint8), pow2(e)
    used = scales_from_amax(amax, fmt) if given is None else given
    return torch.where(fault, torch.full_like(used, float("nan")), used), used


def _device_scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    # A 0-d tensor on the data's device, never a Python/CPU scalar: CUDA torch turns division by a
    # CPU scalar into a multiply by its reciprocal, which is not one IEEE division (SPEC 3.1).
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def nvfp4_tensor_scale(amax_tensor: torch.Tensor, element: FPFormat, scale_code: FPFormat) -> torch.Tensor:
    """0-d fp32 ``t = max(fl(amax_tensor / 2688), 2^-126)``, 1 if ``amax_tensor == 0`` (SPEC 3.4).

    ``2688 = 448 * 6`` is the product of the e4m3 and e2m1 maxima (``scale_code.fmax * element.fmax``).
    """
    t = torch.clamp_min(amax_tensor / _device_scalar(scale_code.fmax * element.fmax, amax_tensor), SCALE_FLOOR)
    return torch.where(amax_tensor == 0, torch.ones_like(t), t)


def nvfp4_group_scales(amax: torch.Tensor, t: torch.Tensor, element: FPFormat,
                       scale_code: FPFormat) -> Tuple[torch.Tensor, torch.Tensor]:
    """Group scale codes and effective scales of SPEC 3.4.

    Args:
        amax: fp32 group amax (finite elements only), any shape.
        t: 0-d fp32 tensor scale from :func:`nvfp4_tensor_scale`.

    Returns:
        ``(c, s)``: int32 e4m3 codes ``c = e4m3(fl(fl(amax / 6) / t))`` (RNE, saturating at 448;
        ``amax >= 0`` so the codes are positive) and fp32 ``s = fl(decode(c) * t)``, shaped like ``amax``.
    """
    ratio = (amax / _device_scalar(element.fmax, amax)) / t
    c = encode(ratio, torch.ones((), dtype=torch.float32, device=amax.device), scale_code)
    return c, decode(c, scale_code) * t


def block_scales(x2: torch.Tensor, f: FPFormat, block: Tuple[int, int], e8m0: Optional[str]):
    """2-D blocks (SPEC 2, 3): (stored tile scales ``(ceil(N/Br), ceil(K/Bc))``, and the fp32 scale of
    each (row, Bc-segment) ``(N, ceil(K/Bc))`` that the row kernels encode with).

    A side at least the matrix side is one tile along that side (``block=(N, K)`` or larger: one scale per
    matrix); the work and memory are bounded by the matrix, never by the block: the amax of each
    (row, Bc-segment) first, then of each ``Br`` of those rows (max and "any NaN/Inf" are exact in any order).
    Codes are laid out exactly as row grouping with ``G = Bc``; only the scales differ, so every
    backend quantizes with these per-segment scales and gives the same bits.
    """
    n, k = x2.shape
    br, bc = min(block[0], max(n, 1)), min(block[1], max(k, 1))
    nr, nc = ceil_div(n, br), ceil_div(k, bc)
    amax, nonfinite = group_amax(fp32_groups(x2, bc))  # (N, nc) per row segment
    if nr * br != n:  # the last tile's missing rows: amax 0 and finite, which change nothing
        amax = torch.nn.functional.pad(amax, (0, 0, 0, nr * br - n))
        nonfinite = torch.nn.functional.pad(nonfinite, (0, 0, 0, nr * br - n))
    amax, nonfinite = amax.view(nr, br, nc).amax(dim=1), nonfinite.view(nr, br, nc).any(dim=1)
    stored, used = group_scales(amax, nonfinite, f, e8m0)
    return stored, used.repeat_interleave(br, dim=0)[:n].contiguous()


def nvfp4_scales(x2: torch.Tensor, group_size: int, tensor_scale: Optional[torch.Tensor] = None):
    """NVFP4 scales (SPEC 3.4) of ``x2`` ``(R, K)`` in groups of ``group_size`` along K.

    ``tensor_scale``: a given 0-d fp32 ``t`` on ``x2``'s device (checked by the caller; the tensor scale a
    fused group shares, SPEC 3.4), else ``t`` of ``x2``'s own amax.

    Returns ``(stored, t, used, zero)``: the stored e4m3 group scale codes (uint8 ``(R, ceil(K/G))``,
    ``0x7F`` for a group with NaN/Inf), the 0-d fp32 tensor scale ``t``, the fp32 scale each group's
    elements encode with (``s = fl(decode(c) * t)``; 1.0 where ``zero``, whose codes are then cleared)
    and the bool mask of the groups whose codes are all 0: ``s == 0``, or ``s`` so small (below
    2^-128) that ``r = fl(1/s)`` overflows (read as ``s == 0``; SPEC 3.4 does not cover it).
    """
    element, scale_code = get_format(NVFP4_ELEMENT_FORMAT), get_format(NVFP4_SCALE_FORMAT)
    amax, nonfinite = group_amax(fp32_groups(x2, group_size))
    if tensor_scale is None:
        amax_tensor = amax.amax() if amax.numel() else torch.zeros((), dtype=torch.float32, device=x2.device)
        tensor_scale = nvfp4_tensor_scale(amax_tensor, element, scale_code)
    t = tensor_scale
    stored, s = group_scales(amax, nonfinite, element, tensor_scale=t)  # 0x7F marks a fault (SPEC 3.4)
    zero = ~torch.isfinite(torch.ones((), dtype=torch.float32, device=s.device) / s)
    return stored, t, torch.where(zero, torch.ones_like(s), s), zero


def clear_groups(packed: torch.Tensor, zero: torch.Tensor, group_size: int, bits: int) -> torch.Tensor:
    """Set every code of the groups in ``zero`` ``(R, n_groups)`` to 0 in the packed rows ``(R, row_bytes)``
    (each group starts on a byte and takes ``ceil(g * bits / 8)`` bytes, SPEC 6)."""
    group_bytes = ceil_div(group_size * bits, 8)
    group_of_byte = torch.arange(packed.shape[1], device=packed.device) // group_bytes
    return packed.masked_fill_(zero[:, group_of_byte], 0)


def check_given_scales(scales, expected_shape, device) -> torch.Tensor:
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"scales must be a torch.Tensor of float32, got {type(scales).__name__}")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales.dtype={scales.dtype} is not supported; allowed: torch.float32")
    if tuple(scales.shape) != tuple(expected_shape):
        raise ValueError(f"scales has shape {tuple(scales.shape)}; expected {tuple(expected_shape)} "
                         f"(one scale per group, SPEC 2)")
    checks.check_device("scales", scales, device)
    bad = ~(torch.isfinite(scales) & (scales >= SCALE_FLOOR))
    if bool(bad.any()):
        first = scales.reshape(-1)[bad.reshape(-1)][0].item()
        raise ValueError(f"scales must be finite and >= 2^-126 (SPEC 3.1) so that r = 1/s is finite; "
                         f"found {first!r}")
    return scales
