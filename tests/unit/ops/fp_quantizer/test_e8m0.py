"""SPEC 3.2 E8M0 scales and the MX presets, bit for bit against an oracle (ml_dtypes
float8_e8m0fnu for the bytes, exact rationals for the exponent rule), on every backend."""

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from unit.oracle import SPEC_FMAX, assert_bitwise_equal, code_values, encode, pack_group

import ds_fpquant as fpq
from ds_fpquant.numerics.formats import element_format
from ds_fpquant.numerics.scales import e8m0_decode

FORMATS = list(fpq.FORMATS)
EMAX_ELEM = {"e4m3": 8, "e5m2": 15, "e3m2": 4, "e2m3": 2, "e2m1": 2, "e4m7": 8}  # SPEC 3.2, typed from the SPEC


def test_e8m0_decode_every_byte():
    ours = e8m0_decode(torch.arange(256, dtype=torch.uint8)).numpy()
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert_bitwise_equal(ours, ref, "E8M0 decode")
    assert ours[0] == 2.0**-127 and math.isnan(ours[255])


def _oracle_e(amax: float, fmt: str, rounding: str) -> int:
    if amax == 0:
        return 0
    a = Fraction(amax)
    e_floor = math.floor(math.log2(amax))
    while Fraction(2) ** e_floor > a:  # exact floor(log2) with rationals
        e_floor -= 1
    while Fraction(2) ** (e_floor + 1) <= a:
        e_floor += 1
    if rounding == "floor":
        e = e_floor - EMAX_ELEM[fmt]
    else:
        e = e_floor - EMAX_ELEM[fmt] - 1
        while a > Fraction(SPEC_FMAX[fmt]) * Fraction(2) ** e:
            e += 1
        e = min(e, 127 - EMAX_ELEM[fmt])  # SPEC 3.2: fmax * 2^e stays finite
    return max(-127, min(127, e))


def _oracle(x: np.ndarray, fmt: str, g: int, rounding: str):
    """Flat grouping: (packed bytes, scale bytes, dequantized fp32)."""
    out_codes, out_scales, deq = [], [], []
    values = code_values(fmt)
    no_nan_code = fmt not in ("e4m3", "e5m2")
    for start in range(0, len(x), g):
        grp = x[start:start + g].astype(np.float32)
        finite = np.isfinite(grp)
        amax = float(np.abs(np.where(finite, grp, 0)).max()) if len(grp) else 0.0
        e = _oracle_e(amax, fmt, rounding)
        s = np.float32(2.0**e)
        codes = encode(grp, np.full(grp.shape, s, np.float32), fmt)
        out_codes.append(pack_group(codes, fmt))
        fault = no_nan_code and not finite.all()
        out_scales.append(255 if fault else e + 127)
        with np.errstate(invalid="ignore", over="ignore"):
            deq.append((values[codes].astype(np.float32) * (np.float32("nan") if fault else s)).astype(np.float32))
    return (np.frombuffer(b"".join(out_codes), dtype=np.uint8), np.array(out_scales, dtype=np.uint8),
            np.concatenate(deq) if deq else np.zeros(0, np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("group_size", [1, 7, 32])
def test_e8m0_exact(target, fmt, rounding, group_size):
    gen = torch.Generator().manual_seed(group_size)
    x = torch.randn(600, generator=gen) * torch.exp2(torch.randint(-140, 120, (600,), generator=gen).float())
    x[:40] = 0.0  # zero groups
    x[41] = float("nan")
    x[100:104] = torch.tensor([3e38, -1e-45, 2.0**-149, 448.0])
    packed, scale_bytes, deq = _oracle(x.numpy(), fmt, group_size, rounding)
    qt = fpq.quantize(x.to(target.device), fmt, group_size, grouping="flat", scale_format="e8m0",
                      scale_rounding=rounding, backend=target.backend)
    assert qt.scales.dtype == torch.uint8 and qt.scale_format == "e8m0"
    assert_bitwise_equal(qt.scales.cpu(), scale_bytes, f"{fmt} {rounding} E8M0 bytes")
    assert_bitwise_equal(qt.codes.cpu(), packed, f"{fmt} {rounding} codes")
    y = qt.dequantize(torch.float32, backend=target.backend).cpu()
    assert_bitwise_equal(y, deq, f"{fmt} {rounding} dequantized")


@pytest.mark.parametrize("fmt", FORMATS)
def test_ceil_never_saturates_floor_may(fmt):
    f = fpq.get_format(fmt)
    # amax = 1.999 * 2^emax_elem: its significand exceeds fmax's, so ceil gives s = 2 and floor s = 1
    x = torch.tensor([1.999 * 2.0**f.emax, 1.0, -0.5, 0.25])
    ceil = fpq.quantize(x, fmt, 4, scale_format="e8m0")
    floor = fpq.quantize(x, fmt, 4, scale_format="e8m0", scale_rounding="floor")
    assert ceil.scales.item() == 128 and floor.scales.item() == 127
    assert ceil.dequantize()[0].item() <= 2 * f.fmax and floor.dequantize()[0].item() == f.fmax  # saturated


def _cap_boundary(fmt: str) -> np.float32:
    """fmax * 2^(127 - emax_elem): the largest amax whose ceil exponent is not capped (SPEC 3.2)."""
    return np.float32(Fraction(SPEC_FMAX[fmt]) * Fraction(2) ** (127 - EMAX_ELEM[fmt]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_e8m0_exponent_cap_near_flt_max(target, fmt, rounding):
    """SPEC 3.2: amax at FLT_MAX, at the cap boundary and one fp32 step either side of it: the scale byte,
    the codes and finite dequantized values, exactly as the exact-rational oracle; with small values too."""
    flt_max = np.finfo(np.float32).max
    boundary = _cap_boundary(fmt)
    below, above = np.nextafter(boundary, np.float32(0)), np.nextafter(boundary, np.float32(np.inf))
    groups = []
    for amax in [flt_max, above, boundary, below]:
        group = np.array([amax, -amax, np.float32(amax / 3), 1.0, -2.0**-100, 0.0, 2.0**-140, 3.0], np.float32)
        groups.append(np.resize(group, 32))
    x = np.concatenate(groups)
    packed, scale_bytes, deq = _oracle(x, fmt, 32, rounding)
    qt = fpq.quantize(torch.from_numpy(x).to(target.device), fmt, 32, grouping="flat", scale_format="e8m0",
                      scale_rounding=rounding, backend=target.backend)
    assert_bitwise_equal(qt.scales.cpu(), scale_bytes, f"{fmt} {rounding} E8M0 bytes near FLT_MAX")
    assert_bitwise_equal(qt.codes.cpu(), packed, f"{fmt} {rounding} codes near FLT_MAX")
    y = qt.dequantize(torch.float32, backend=target.backend).cpu()
    assert_bitwise_equal(y, deq, f"{fmt} {rounding} dequantized near FLT_MAX")
    assert torch.isfinite(y).all(), f"{fmt} {rounding}: a finite input dequantized to Inf"
    # all four amax lie in fp32's top binade: floor and (capped) ceil both give e = 127 - emax_elem, and
    # every amax from the boundary up decodes to fmax * 2^e = the boundary (saturated above it)
    assert qt.scales.tolist() == [127 + 127 - EMAX_ELEM[fmt]] * 4
    assert y[0].item() == y[32].item() == y[64].item() == float(boundary)


@pytest.mark.parametrize("preset", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4"])
def test_mx_preset_at_flt_max_is_finite(target, preset):
    """The reported case: mxfp4 of [FLT_MAX, 1, ...] gave scale byte 253 and code 4.0, so 4 * 2^126 = Inf."""
    x = torch.tensor([[3.4028235e38] + [1.0] * 31], device=target.device)
    y = fpq.dequantize(fpq.quantize(x, preset, backend=target.backend), backend=target.backend)
    f = element_format(preset)
    assert torch.isfinite(y).all() and y[0, 0].item() == f.fmax * 2.0 ** (127 - f.emax)


@pytest.mark.parametrize("preset,element", [("mxfp8_e4m3", "e4m3"), ("mxfp8_e5m2", "e5m2"), ("mxfp6_e3m2", "e3m2"),
                                            ("mxfp6_e2m3", "e2m3"), ("mxfp4", "e2m1")])
def test_mx_presets(target, preset, element):
    x = torch.randn(3, 100).to(target.device)
    qt = fpq.quantize(x, preset, backend=target.backend)
    same = fpq.quantize(x, element, 32, scale_format="e8m0", backend=target.backend)
    assert qt.group_size == 32 and qt.scale_format == "e8m0" and qt.fmt == preset and qt.format.name == element
    assert torch.equal(qt.codes, same.codes) and torch.equal(qt.scales, same.scales)
    assert torch.equal(qt.dequantize(backend=target.backend), same.dequantize(backend=target.backend))


@pytest.mark.parametrize("preset", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4"])
def test_presets_never_change_a_given_value(preset):
    """Only "not given" takes the preset's value: DeepSpeed-era defaults (G=128, fp32 scales) passed
    explicitly are refused, never silently replaced; the preset's own values are accepted."""
    x = torch.randn(4, 64)
    _, g, scales = fpq.PRESETS[preset]
    for group_size in (128, 1, g * 2):
        with pytest.raises(ValueError, match=f"fmt='{preset}' fixes group_size={g}; got group_size={group_size}"):
            fpq.quantize(x, preset, group_size)
    for scale_format in ("fp32", "e8m0" if scales != "e8m0" else "e4m3"):
        with pytest.raises(ValueError, match=f"fmt='{preset}' fixes scale_format='{scales}'"):
            fpq.quantize(x, preset, scale_format=scale_format)
    qt = fpq.quantize(x, preset, g, scale_format=scales)
    default = fpq.quantize(x, preset)
    assert (qt.group_size, qt.scale_format) == (default.group_size, default.scale_format) == (g, scales)
    assert torch.equal(qt.codes, default.codes) and torch.equal(qt.scales, default.scales)


def test_element_formats_default_to_g128_fp32():
    x = torch.randn(2, 300)
    qt = fpq.quantize(x, "e2m1")
    assert (qt.group_size, qt.scale_format, qt.scales.shape) == (128, "fp32", (2, 3))
    assert torch.equal(qt.codes, fpq.quantize(x, "e2m1", 128, scale_format="fp32").codes)


def test_preset_conflicts_are_errors():
    x = torch.randn(64)
    with pytest.raises(ValueError, match="fmt='mxfp4' fixes group_size=32; got group_size=64"):
        fpq.quantize(x, "mxfp4", 64)
    with pytest.raises(ValueError, match="scales= takes fp32 scales"):
        fpq.quantize(x, "e4m3", 32, scale_format="e8m0", scales=torch.ones(2))
