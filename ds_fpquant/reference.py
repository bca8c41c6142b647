"""Pure-torch implementation of SPEC 3-5: the readable reference and the fallback backend.

Everything here is plain fp32 IEEE arithmetic on torch tensors (CPU or CUDA) plus integer bit
manipulation, with no data-dependent Python branches. The compiled backends must match it bit
for bit.

Bit picture of the round-to-nearest-even step (SPEC 4) for a target with ``m`` mantissa bits::

    fp32 |v|:  0 | eeeeeeee | mmm  r  ssss...s      (23 mantissa bits)
                              \\_/  |  \\______/
                     kept m bits   |   sticky bits (23 - m - 1 of them)
                                   round bit

    RNE adds (2^(22-m) - 1) + (lowest kept bit) and truncates the 23-m low bits; a carry out of
    the mantissa moves into the exponent field, which is exactly rounding up to the next binade.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import Optional, Tuple

import torch

from .formats import NVFP4_SCALE_FORMAT, FPFormat, get_format
from .packing import ceil_div

__all__ = [
    "SCALE_FLOOR",
    "group_amax",
    "scales_from_amax",
    "encode",
    "decode_table",
    "decode",
]

#: Smallest stored fp32 scale, ``2^-126`` (SPEC 3.1): keeps ``r = 1/s`` finite.
SCALE_FLOOR = 2.0**-126

_F32_MBITS = 23
_F32_BIAS = 127


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


def encode(x: torch.Tensor, r: torch.Tensor, fmt: FPFormat) -> torch.Tensor:
    """Element encoding of SPEC 4 (round to nearest even) with the specials of SPEC 3.3.

    Args:
        x: fp32 input elements, any shape.
        r: fp32 encoding multiplier ``1/s``, broadcastable to ``x``, finite and > 0.
        fmt: element format.

    Returns:
        int32 codes shaped like ``x``, each in ``[0, 2^fmt.bits)``.
    """
    # 1. scale: one fp32 multiply, RNE; the sign comes from x (r > 0).
    v = x * r
    sign = ((x.view(torch.int32) >> 31) & 1) << (fmt.bits - 1)
    # 2. saturate: RNE is monotonic and fmax is representable, so clamping before rounding equals
    #    rounding then clamping (and turns an overflowed product of a finite x into fmax).
    a = torch.clamp(v.abs(), max=fmt.fmax)
    a_bits = a.view(torch.int32)
    # 3. normal range: RNE on the fp32 bit pattern (see the module docstring), then re-bias.
    shift = _F32_MBITS - fmt.mbits
    rounded = a_bits + ((1 << (shift - 1)) - 1) + ((a_bits >> shift) & 1)
    normal = (rounded >> shift) - ((_F32_BIAS - fmt.bias) << fmt.mbits)
    # 4. subnormal range: adding M = 2^(emin - m + 23), whose ulp is the target's subnormal step,
    #    makes the fp32 adder do the RNE; the low bits of the sum are the code (the top one, 2^m,
    #    is the smallest normal, reached by rounding up).
    magic = 2.0 ** (fmt.emin - fmt.mbits + _F32_MBITS)
    magic_bits = torch.tensor(magic, dtype=torch.float32).view(torch.int32).item()
    subnormal = (a + magic).view(torch.int32) - magic_bits
    mag = torch.where(a < fmt.min_normal, subnormal, normal)
    # 5. non-finite inputs (SPEC 3.3): NaN code, Inf code, or 0 for formats without them.
    nan_code = fmt.nan_code if fmt.has_nan else 0
    inf_code = fmt.inf_code if fmt.has_inf else nan_code
    mag = torch.where(torch.isnan(x), nan_code, torch.where(torch.isinf(x), inf_code, mag))
    code = mag | sign
    if not fmt.has_nan:  # formats without specials: non-finite elements get code 0
        code = torch.where(torch.isfinite(x), code, 0)
    return code


@lru_cache(maxsize=None)
def _decode_table_cached(fmt: FPFormat, device: torch.device) -> torch.Tensor:
    return torch.tensor(fmt.decode_table, dtype=torch.float32, device=device)


def decode_table(fmt: FPFormat, device=None) -> torch.Tensor:
    """fp32 tensor of the value of every code of ``fmt`` (``2^bits`` entries), on ``device``."""
    return _decode_table_cached(fmt, torch.device(device if device is not None else "cpu"))


def decode(codes: torch.Tensor, fmt: FPFormat) -> torch.Tensor:
    """Integer codes -> exact fp32 values (NaN codes -> NaN, Inf codes -> +-Inf), SPEC 5."""
    return decode_table(fmt, codes.device)[codes.long()]


# ---- stochastic rounding (SPEC 4) ---------------------------------------------------------------

#: Philox4x32 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
_U32 = 0xFFFFFFFF


def _mulhilo32(a: torch.Tensor, m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of ``a * m`` for int64 tensors holding uint32 values.

    The 64-bit product would overflow int64, so it is built from 16-bit partial products.
    """
    a1, a0 = a >> 16, a & 0xFFFF
    m1, m0 = m >> 16, m & 0xFFFF
    mid = a1 * m0 + a0 * m1  # < 2^33
    low = a0 * m0 + ((mid & 0xFFFF) << 16)  # < 2^33
    hi = a1 * m1 + (mid >> 16) + (low >> 32)
    return hi & _U32, low & _U32


def philox4x32_10(counter, key) -> Tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors of uint32 values: ``counter`` 4 tensors, ``key`` 2 ints."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for rnd in range(PHILOX_ROUNDS):
        if rnd:
            k0, k1 = (k0 + PHILOX_W0) & _U32, (k1 + PHILOX_W1) & _U32
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def random_words(n: int, seed: int, offset: int, device=None) -> torch.Tensor:
    """The 32-bit random words of elements ``0 .. n-1`` (SPEC 4), as int64 in ``[0, 2^32)``.

    Element ``i`` takes output word ``i % 4`` of Philox4x32-10 with key ``(seed lo, seed hi)``
    and counter ``(offset lo, offset hi, (i // 4) lo, (i // 4) hi)``.
    """
    blocks = torch.arange(ceil_div(n, 4), dtype=torch.int64, device=device)
    zeros = torch.zeros_like(blocks)
    counter = (zeros + (offset & _U32), zeros + (offset >> 32), blocks & _U32, blocks >> 32)
    words = torch.stack(philox4x32_10(counter, (seed & _U32, seed >> 32)), dim=1)
    return words.reshape(-1)[:n]


def encode_stochastic(x: torch.Tensor, r: torch.Tensor, u: torch.Tensor, fmt: FPFormat) -> torch.Tensor:
    """Stochastic rounding of SPEC 4 on integers: codes shaped like ``x`` (int64).

    For ``|v| = M * 2^eu`` (fp32 significand ``M``, ulp ``2^eu``) and the target's step ``2^eq``
    at ``|v|``, ``k = eq - eu`` bits are dropped: ``lo = M >> k`` steps, ``D = M mod 2^k``. The
    result is one step up iff ``D * 2^32 > u * 2^k``; both sides are shifted so the comparison
    stays exact in int64 (``D < 2^24``, so clamping the shift of ``u`` at 31 changes nothing).
    """
    v = x * r
    a_bits = (v.abs().view(torch.int32)).to(torch.int64)
    exp_field = a_bits >> 23
    significand = torch.where(exp_field == 0, a_bits & 0x7FFFFF, (a_bits & 0x7FFFFF) | 0x800000)
    e_unbiased = torch.where(exp_field == 0, -126, exp_field - 127)
    e_target = torch.clamp(e_unbiased, min=fmt.emin)
    k = torch.clamp((e_target - fmt.mbits) - (e_unbiased - 23), max=62)
    dropped = significand & ((torch.ones_like(k) << k) - 1)
    code = ((e_target - fmt.emin) << fmt.mbits) + (significand >> k)
    up = (dropped << torch.clamp(32 - k, min=0)) > (u << torch.clamp(k - 32, min=0, max=31))
    code = code + up.to(torch.int64)
    code = torch.where(v.abs() >= fmt.fmax, fmt.max_code, code)
    sign = ((x.view(torch.int32) >> 31) & 1).to(torch.int64) << (fmt.bits - 1)
    nan_code = fmt.nan_code if fmt.has_nan else 0
    inf_code = fmt.inf_code if fmt.has_inf else nan_code
    special = torch.where(torch.isnan(x), nan_code, inf_code) | sign
    finite = torch.isfinite(x)
    return torch.where(finite, code | sign, special if fmt.has_nan else torch.zeros_like(code))


# ---- E8M0 power-of-two scales (SPEC 3.2) -----------------------------------------------------------

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


# ---- NVFP4 (SPEC 3.4) -----------------------------------------------------------------------------

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


# ---- IEEE subnormals on every backend (SPEC 3.1) --------------------------------------------------

_SUBNORMAL = 2.0**-140


@contextlib.contextmanager
def ieee_denormals():
    """Undo ``torch.set_flush_denormal(True)`` for the calling thread while in scope (SPEC 3.1: no
    backend flushes subnormals); torch has no getter, so the state is probed with one subnormal."""
    probe = torch.tensor([_SUBNORMAL]) * torch.tensor([1.0])
    flushing = probe.item() == 0.0
    if flushing:
        torch.set_flush_denormal(False)
    try:
        yield
    finally:
        if flushing:
            torch.set_flush_denormal(True)
