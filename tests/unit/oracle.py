"""Independent oracle for the tests: numpy fp32 arithmetic + ml_dtypes casts (SPEC 1-6).

Nothing here imports the code under test except the format *names*: the element casts come from
ml_dtypes (e4m7, which ml_dtypes lacks, is rounded by nearest-value search over its code table
built from the bit formula), the scale arithmetic is numpy float32, and the bit-stream packing is
``np.packbits``/``np.unpackbits`` with little-endian bit order.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

#: name -> (ebits, mbits, ml_dtypes type or None). Written out here, independent of formats.py.
ORACLE_FORMATS = {
    "e4m3": (4, 3, ml_dtypes.float8_e4m3fn),
    "e5m2": (5, 2, ml_dtypes.float8_e5m2),
    "e3m2": (3, 2, ml_dtypes.float6_e3m2fn),
    "e2m3": (2, 3, ml_dtypes.float6_e2m3fn),
    "e2m1": (2, 1, ml_dtypes.float4_e2m1fn),
    "e4m7": (4, 7, None),
}
#: SPEC 1 max finite per format, typed from the SPEC table.
SPEC_FMAX = {"e4m3": 448.0, "e5m2": 57344.0, "e3m2": 28.0, "e2m3": 7.5, "e2m1": 6.0, "e4m7": 510.0}


def bits_of(fmt: str) -> int:
    e, m, _ = ORACLE_FORMATS[fmt]
    return 1 + e + m


def _e4m7_values() -> np.ndarray:
    """float64 value of every e4m7 code: bias 7, all exponent codes finite (SPEC 1)."""
    codes = np.arange(4096)
    sign = np.where(codes & 0x800, -1.0, 1.0)
    exp = (codes >> 7) & 0xF
    man = codes & 0x7F
    mag = np.where(exp == 0, man * 2.0**(-6 - 7), (1 + man / 128.0) * np.exp2(exp - 7.0))
    return sign * mag


def code_values(fmt: str) -> np.ndarray:
    """float64 value of every code of ``fmt`` (NaN codes -> NaN)."""
    e, m, mt = ORACLE_FORMATS[fmt]
    if mt is None:
        return _e4m7_values()
    n = 1 << (1 + e + m)
    return np.arange(n, dtype=np.uint8).view(mt).astype(np.float64)


def cast_codes(v: np.ndarray, fmt: str) -> np.ndarray:
    """RNE cast of finite float32 ``v`` to codes (int64), saturating at fmax (SPEC 4)."""
    fmax = SPEC_FMAX[fmt]
    v = np.clip(v.astype(np.float32), -fmax, fmax)
    _, _, mt = ORACLE_FORMATS[fmt]
    if mt is not None:
        return v.astype(mt).view(np.uint8).astype(np.int64)
    # e4m7: nearest magnitude in the code table, ties to the even code.
    vals = _e4m7_values()[:2048]  # positive codes, increasing
    a = np.abs(v).astype(np.float64)
    hi = np.clip(np.searchsorted(vals, a, side="left"), 0, 2047)
    lo = np.clip(hi - 1, 0, 2047)
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    mag = np.where(pick_hi, hi, lo)
    return np.where(np.signbit(v), mag | 0x800, mag).astype(np.int64)


def scales_fp32(x_groups: np.ndarray, fmt: str) -> np.ndarray:
    """SPEC 3.1 scales for float32 groups ``(..., G)`` (padding must be 0)."""
    finite = np.isfinite(x_groups)
    amax = np.where(finite, np.abs(x_groups), np.float32(0)).max(axis=-1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.maximum(amax / np.float32(SPEC_FMAX[fmt]), np.float32(2.0**-126)).astype(np.float32)
    return np.where(amax == 0, np.float32(1.0), s).astype(np.float32)


def encode(x: np.ndarray, s: np.ndarray, fmt: str) -> np.ndarray:
    """Codes of float32 ``x`` with per-element fp32 scale ``s`` (SPEC 3.3, 4): int64."""
    x = x.astype(np.float32)
    r = (np.float32(1.0) / s.astype(np.float32)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        v = (x * r).astype(np.float32)
    bits = bits_of(fmt)
    sign = np.signbit(x).astype(np.int64) << (bits - 1)
    codes = cast_codes(np.where(np.isfinite(x), v, np.float32(0)), fmt)
    if fmt == "e4m3":
        codes = np.where(np.isfinite(x), codes, 0x7F | sign)
    elif fmt == "e5m2":
        codes = np.where(np.isnan(x), 0x7F | sign, np.where(np.isinf(x), 0x7C | sign, codes))
    else:
        codes = np.where(np.isfinite(x), codes, 0)
    return codes.astype(np.int64)


def pack_group(codes: np.ndarray, fmt: str) -> bytes:
    """Little-endian bit stream of one group's codes (SPEC 6), ``ceil(g*b/8)`` bytes."""
    b = bits_of(fmt)
    if len(codes) == 0:
        return b""
    bit_matrix = ((codes[:, None].astype(np.int64) >> np.arange(b)) & 1).astype(np.uint8)
    return np.packbits(bit_matrix.reshape(-1), bitorder="little").tobytes()[: (len(codes) * b + 7) // 8]


def unpack_group(data: bytes, g: int, fmt: str) -> np.ndarray:
    """Inverse of :func:`pack_group`."""
    b = bits_of(fmt)
    bitstream = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")[: g * b]
    return (bitstream.reshape(g, b).astype(np.int64) << np.arange(b)).sum(axis=1)


def quantize_rows(x: np.ndarray, fmt: str, g: int, given_scale=None):
    """Oracle of the native row pipeline on float32 ``(R, K)``: (packed bytes ``(R, nbytes)``,
    scales ``(R, ceil(K/G))``, dequantized float32 ``(R, K)``)."""
    rows, k = x.shape
    n = -(-k // g)
    padded = np.zeros((rows, n * g), dtype=np.float32)
    padded[:, :k] = x
    groups = padded.reshape(rows, n, g)
    if given_scale is None:
        s = scales_fp32(groups, fmt)
    else:
        s = np.full((rows, n), np.float32(given_scale), dtype=np.float32)
    codes = encode(groups, s[..., None], fmt).reshape(rows, n * g)[:, :k]
    has_specials = fmt in ("e4m3", "e5m2")  # SPEC 3.3: formats with a NaN code
    nonfinite = ~np.isfinite(groups).all(axis=-1)
    stored = s if has_specials else np.where(nonfinite, np.float32(np.nan), s).astype(np.float32)
    packed = []
    for row in codes:
        packed.append(b"".join(pack_group(row[j:j + g], fmt) for j in range(0, k, g)))
    packed = np.frombuffer(b"".join(packed), dtype=np.uint8).reshape(rows, -1) if rows else np.zeros((0, 0), np.uint8)
    values = code_values(fmt)[codes].astype(np.float32)
    per_elem = np.repeat(stored, g, axis=1)[:, :k]
    with np.errstate(invalid="ignore", over="ignore"):
        deq = (values * per_elem).astype(np.float32)
    return packed, stored, deq


def to_numpy32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _as_numpy(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:  # numpy has no bf16; the widening to fp32 is exact and injective
            t = t.float()
        return t.numpy()
    return np.asarray(t)


def assert_bitwise_equal(actual, expected, what: str = "tensor") -> None:
    """Exact equality (NaN == NaN, -0 != +0 for floats); reports the first differing element."""
    a, e = _as_numpy(actual), _as_numpy(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    if a.dtype.kind == "f":
        assert e.dtype == a.dtype, f"{what}: dtype {a.dtype} != expected {e.dtype}"
        a_bits = a.view(np.dtype(f"u{a.itemsize}"))
        e_bits = e.view(np.dtype(f"u{e.itemsize}"))
        same = (a_bits == e_bits) | (np.isnan(a) & np.isnan(e))
    else:
        same = a.astype(np.int64) == e.astype(np.int64)
    if not same.all():
        idx = np.argwhere(~same)
        first = tuple(int(i) for i in idx[0])
        raise AssertionError(f"{what}: {len(idx)} of {a.size} elements differ; first at {first}: "
                             f"got {a[first]!r}, expected {e[first]!r}")


def bf16_all_patterns() -> torch.Tensor:
    """Every bf16 bit pattern (65536 values, NaN/Inf included)."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def fp16_all_patterns() -> torch.Tensor:
    """Every fp16 bit pattern (65536 values, NaN/Inf included)."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)


def numel(shape) -> int:
    return math.prod(shape)


def quantize_nvfp4_rows(x: np.ndarray, g: int = 16):
    """Oracle of SPEC 3.4 (NVFP4) on float32 ``(R, K)`` in groups of ``g``: (packed bytes, e4m3 group
    scale codes ``(R, ceil(K/g))``, tensor scale t (np.float32), dequantized float32 ``(R, K)``).

    A group whose effective scale ``s`` is 0, or so small that ``fl(1/s)`` overflows, gets all codes 0.
    """
    rows, k = x.shape
    n = -(-k // g)
    padded = np.zeros((rows, n * g), dtype=np.float32)
    padded[:, :k] = x
    groups = padded.reshape(rows, n, g)
    finite = np.isfinite(groups)
    amax = np.where(finite, np.abs(groups), np.float32(0)).max(axis=-1).astype(np.float32)
    amax_t = np.float32(amax.max()) if amax.size else np.float32(0)
    t = np.float32(1.0) if amax_t == 0 else max(np.float32(amax_t / np.float32(448.0 * 6.0)), np.float32(2.0**-126))
    ratio = ((amax / np.float32(6.0)).astype(np.float32) / t).astype(np.float32)
    c = cast_codes(ratio, "e4m3")
    # decode(c) has 4 significant bits and t 24: the float64 product is exact, then one RNE to fp32
    s = (code_values("e4m3")[c] * np.float64(t)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        zero = ~np.isfinite(np.float32(1.0) / s)
    codes = encode(groups, np.where(zero, np.float32(1.0), s)[..., None], "e2m1")
    codes = np.where(zero[..., None], 0, codes).reshape(rows, n * g)[:, :k]
    stored = np.where(finite.all(axis=-1), c, 0x7F).astype(np.uint8)
    s_deq = (code_values("e4m3")[stored] * np.float64(t)).astype(np.float32)
    packed = b"".join(b"".join(pack_group(row[j:j + g], "e2m1") for j in range(0, k, g)) for row in codes)
    packed = np.frombuffer(packed, dtype=np.uint8).reshape(rows, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        deq = (code_values("e2m1")[codes].astype(np.float32) * np.repeat(s_deq, g, axis=1)[:, :k]).astype(np.float32)
    return packed, stored, np.float32(t), deq


def special_input(shape, dtype, seed):
    """randn times powers of two in [2^-12, 2^12), with NaN, -NaN, a NaN with a payload, +-Inf, a run of
    zeros (an all-zero group for small G) and a -0 when there are >= 64 elements: the values every kernel
    test feeds."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-12, 12, shape, generator=gen).float())
    flat = x.view(-1)
    n = flat.numel()
    if n >= 64:
        flat[n // 7] = float("nan")
        flat.view(torch.int32)[n // 11] = 0xFFC00000 - 2**32  # -NaN
        flat.view(torch.int32)[n // 13] = 0x7FC12345  # a quiet NaN with a payload
        flat[n // 5] = float("inf")
        flat[n // 3] = -float("inf")
        flat[n // 2: n // 2 + min(40, n // 4)] = 0.0  # a run of zeros (an all-zero group for small G)
        flat[-1] = -0.0
    return x.to(dtype)


def fp8_values(fmt: str) -> torch.Tensor:
    """Every finite value of ``fmt`` ("e4m3" or "e5m2") in increasing order, fp32, from torch's float8 dtypes."""
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return values[torch.isfinite(values)].unique()
