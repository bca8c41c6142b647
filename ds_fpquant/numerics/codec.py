"""The element codec in plain torch (SPEC 4, 5): RNE and stochastic encode, decode; the readable reference the
compiled backends match bit for bit.

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

import torch

from ds_fpquant.numerics.formats import FPFormat

__all__ = ["encode", "decode_table", "decode"]

_F32_MBITS = 23


_F32_BIAS = 127


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
