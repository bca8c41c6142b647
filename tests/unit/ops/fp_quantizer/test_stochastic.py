"""SPEC 4 stochastic rounding: Philox known answers, an exact oracle of the rounding decision,
bit-identical backends, unbiasedness, support, and reproducibility."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from unit.oracle import SPEC_FMAX, assert_bitwise_equal, bits_of, code_values

import ds_fpquant as fpq
from ds_fpquant import FP_Quantize
from ds_fpquant.numerics.philox import philox4x32_10, random_words
from ds_fpquant.ops.backends import load_op

FORMATS = list(fpq.FORMATS)

#: Random123 tests/kat_vectors, "philox4x32 10" lines: counter (4 words), key (2 words) -> output.
PHILOX_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    out = philox4x32_10(tuple(torch.tensor([c], dtype=torch.int64) for c in counter), key)
    assert tuple(int(t) for t in out) == expected
    module, reason = load_op("cpu")
    assert module is not None, reason
    assert tuple(module.philox4x32_10(*counter, *key)) == expected


def test_random_word_layout():
    """Element i takes word i % 4 of the block with counter (offset lo, offset hi, i//4 lo, i//4 hi)."""
    seed, offset = 0x0123456789ABCDEF, 0xFEDCBA9876543210
    words = random_words(13, seed, offset)
    for i in (0, 3, 5, 12):
        block = tuple(torch.tensor([v], dtype=torch.int64) for v in
                      (offset & 0xFFFFFFFF, offset >> 32, (i // 4) & 0xFFFFFFFF, (i // 4) >> 32))
        out = philox4x32_10(block, (seed & 0xFFFFFFFF, seed >> 32))
        assert int(words[i]) == int(out[i % 4])


def _oracle_stochastic(v: float, u: int, fmt: str) -> int:
    """SPEC 4 decision with exact rationals, independent of the implementation (magnitude code)."""
    values = code_values(fmt)
    n = 1 << (bits_of(fmt) - 1)
    mags = [(Fraction(float(values[c])), c) for c in range(n) if math.isfinite(values[c])]
    a = Fraction(abs(float(v)))
    fmax = Fraction(SPEC_FMAX[fmt])
    if a >= fmax:
        return max(c for m, c in mags if m == fmax)
    for m, c in mags:
        if m == a:
            return c
    lo, lo_code = max((m, c) for m, c in mags if m < a)
    hi, hi_code = min((m, c) for m, c in mags if m > a)
    ulp = Fraction(float(np.spacing(np.float32(abs(v)))))
    k = int(math.log2((hi - lo) / ulp))
    assert (hi - lo) / ulp == 2**k
    d = (a - lo) / ulp
    assert d.denominator == 1 and 0 < d < 2**k
    return hi_code if d.numerator * 2**32 > u * 2**k else lo_code


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_decision_matches_exact_oracle(fmt):
    gen = torch.Generator().manual_seed(7)
    fmax = SPEC_FMAX[fmt]
    # values across the normal and subnormal ranges, fp32 subnormals, and near fmax
    x = torch.cat([
        (torch.rand(300, generator=gen) * 2 - 1) * fmax,
        torch.randn(300, generator=gen) * float(np.exp2(-8 if fmt != "e5m2" else -15)),
        torch.randn(100, generator=gen) * 2.0**-140,
        torch.tensor([fmax, -fmax, 0.0, -0.0, 1.0]),
    ])
    seed, offset = 99, 5
    qt = fpq.quantize(x, fmt, x.numel(), backend="torch", rounding="stochastic", seed=seed, offset=offset,
                      scales=torch.ones(1))
    words = random_words(x.numel(), seed, offset)
    from unit.oracle import unpack_group
    codes = unpack_group(qt.codes.numpy().tobytes(), x.numel(), fmt)
    sign_bit = 1 << (bits_of(fmt) - 1)
    for i in range(x.numel()):
        v = float(x[i])
        expected = _oracle_stochastic(v, int(words[i]), fmt) | (sign_bit if math.copysign(1, v) < 0 else 0)
        assert int(codes[i]) == expected, (i, v, int(words[i]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size", [1, 3, 64, 1000])
def test_backends_bit_identical(target, fmt, dtype, group_size):
    gen = torch.Generator().manual_seed(group_size)
    x = (torch.randn(13, 301, generator=gen) * 3).to(dtype)
    x[0, 5], x[1, 7], x[2, 9] = float("nan"), float("inf"), 0.0
    kwargs = dict(rounding="stochastic", seed=2**63 + 12345, offset=2**40 + 3)
    ref = fpq.quantize(x, fmt, group_size, backend="torch", **kwargs)
    got = fpq.quantize(x.to(target.device), fmt, group_size, backend=target.backend, **kwargs)
    assert_bitwise_equal(got.codes, ref.codes, f"{fmt} {dtype} G={group_size} stochastic codes")
    assert_bitwise_equal(got.scales, ref.scales, "scales")


@pytest.mark.parametrize("fmt", FORMATS)
def test_unbiased_and_two_neighbours_only(target, fmt):
    """Mean of 10^4 stochastic roundings of values between codes is within 5 sigma of the value;
    only the two neighbouring codes appear; normal and subnormal ranges."""
    vals = code_values(fmt)
    finite = np.sort(np.unique(vals[np.isfinite(vals) & (vals >= 0)]))
    picks = [(finite[1], finite[2]), (finite[len(finite) // 2], finite[len(finite) // 2 + 1]),
             (finite[-3], finite[-2])]  # subnormal, middle, top
    n = 10_000
    for lo, hi in picks:
        for frac in (0.1, 0.5, 0.77):
            value = np.float32(lo + (hi - lo) * frac)
            x = torch.full((n,), float(value))
            qt = fpq.quantize(x.to(target.device), fmt, n, backend=target.backend, rounding="stochastic",
                              seed=1234, offset=int(frac * 100), scales=torch.ones(1, device=target.device))
            y = qt.dequantize(backend=target.backend).cpu().double()
            assert set(y.unique().tolist()) <= {float(lo), float(hi)}
            p = (float(value) - lo) / (hi - lo)
            sigma = (hi - lo) * math.sqrt(p * (1 - p) / n)
            assert abs(y.mean().item() - float(value)) <= 5 * sigma, (lo, hi, frac)


@pytest.mark.parametrize("fmt", FORMATS)
def test_representable_values_unchanged(target, fmt):
    vals = code_values(fmt)
    x = torch.tensor(vals[np.isfinite(vals)], dtype=torch.float32)
    qt = fpq.quantize(x.to(target.device), fmt, x.numel(), backend=target.backend, rounding="stochastic", seed=3,
                      scales=torch.ones(1, device=target.device))
    assert_bitwise_equal(qt.dequantize(backend=target.backend).cpu(), x, "representable values")


def test_seed_from_torch_generator_is_reproducible():
    x = torch.randn(1000)
    torch.manual_seed(0)
    a = fpq.quantize(x, "e2m1", 32, rounding="stochastic")
    b = fpq.quantize(x, "e2m1", 32, rounding="stochastic")
    torch.manual_seed(0)
    c = fpq.quantize(x, "e2m1", 32, rounding="stochastic")
    assert torch.equal(a.codes, c.codes) and not torch.equal(a.codes, b.codes)


def test_fp_quantize_stochastic_mode():
    x = torch.randn(4096, dtype=torch.bfloat16)
    torch.manual_seed(1)
    q = FP_Quantize(group_size=128)
    first, second = q.quantize(x, stochastic_mode=True), q.quantize(x, stochastic_mode=True)
    assert not torch.equal(first, second), "the counter offset must advance per call"
    torch.manual_seed(1)
    again = FP_Quantize(group_size=128)
    assert torch.equal(again.quantize(x, stochastic_mode=True), first)
    assert torch.equal(again.quantize(x, stochastic_mode=True), second)
    y = q.dequantize(second)
    assert (y.float() - x.float()).abs().max() <= x.float().abs().max() / 448 * 32  # within one e4m3 step


def test_stochastic_arguments_checked():
    x = torch.randn(8)
    with pytest.raises(ValueError, match=r"seed=18446744073709551616 is not allowed"):
        fpq.quantize(x, rounding="stochastic", seed=2**64)
    with pytest.raises(ValueError, match=r"offset=18446744073709551616 is not allowed"):
        fpq.quantize(x, rounding="stochastic", seed=1, offset=2**64)
    with pytest.raises(ValueError, match="seed=1 is only allowed with rounding='stochastic'"):
        fpq.quantize(x, seed=1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_decision_at_crafted_words(fmt):
    """The comparison D * 2^32 > u * 2^k at its edges: u = 0, 1, 2^32 - 1 and u = D * 2^(32-k) +- 1,
    for values with k < 32, k = 32 and k > 32 (deep below the smallest subnormal)."""
    from ds_fpquant.numerics.codec import encode_stochastic
    f = fpq.get_format(fmt)
    base = [f.min_normal * 1.3, f.min_subnormal * 0.7, f.min_subnormal * 2.0**-12, 2.0**-140, 3 * 2.0**-149,
            f.fmax * 0.9]
    xs, us = [], []
    for v in base:
        v32 = float(np.float32(v))
        ulp = Fraction(float(np.spacing(np.float32(v32))))
        for u in (0, 1, 2**32 - 1, 2**31):
            xs.append(v32), us.append(u)
        vals = sorted(Fraction(float(c)) for c in code_values(fmt) if math.isfinite(c) and c >= 0)
        lo = max(m for m in vals if m <= Fraction(v32))
        hi = min(m for m in vals if m > Fraction(v32))
        k = int(math.log2((hi - lo) / ulp))
        d = int((Fraction(v32) - lo) / ulp)
        threshold = d * 2**32 // 2**k if k <= 32 else 0
        for u in (threshold - 1, threshold, threshold + 1):
            if 0 <= u < 2**32:
                xs.append(v32), us.append(u)
    x = torch.tensor(xs, dtype=torch.float32)
    codes = encode_stochastic(x, torch.ones(()), torch.tensor(us, dtype=torch.int64), f)
    for i, (v, u) in enumerate(zip(xs, us)):
        assert int(codes[i]) == _oracle_stochastic(v, u, fmt), (v, u)
