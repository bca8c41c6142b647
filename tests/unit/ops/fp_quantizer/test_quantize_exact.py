"""SPEC 2-6 bit for bit against the oracle (numpy fp32 + ml_dtypes), torch backend.

Every bf16 and fp16 bit pattern goes through ``quantize`` with fixed scales; random fp32 tensors go
through the full pipeline (scales from amax) with many group sizes, ragged tails, row and flat
grouping; codes (packed bytes), scales and dequantized values must all be identical.
"""

import dataclasses

import numpy as np
import pytest
import torch
from unit.oracle import (
    assert_bitwise_equal,
    bf16_all_patterns,
    fp16_all_patterns,
    quantize_rows,
    to_numpy32,
    unpack_group,
)

import ds_fpquant as fpq

pytestmark = pytest.mark.usefixtures("quiet_fallback")

FORMATS = list(fpq.FORMATS)
# Fixed scales: 1 (codes are a plain cast), a non-power of two (r = fl(1/s) is inexact), tiny and huge.
FIXED_SCALES = [1.0, 0.3, 2.0**-10, 1000.0]
GROUP = 1024


def _q(target, x, *args, **kwargs):
    """Quantize on the target's device and backend; codes and scales come back on the CPU."""
    kwargs = {k: v.to(target.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    qt = fpq.quantize(x.to(target.device), *args, backend=target.backend, **kwargs)
    assert qt.codes.device.type == target.device and qt.scales.device.type == target.device
    return dataclasses.replace(qt, codes=qt.codes.cpu(), scales=qt.scales.cpu())


def _dq(target, qt, dtype=None):
    """Dequantize on the target's device and backend; the result comes back on the CPU."""
    moved = dataclasses.replace(qt, codes=qt.codes.to(target.device), scales=qt.scales.to(target.device))
    y = fpq.dequantize(moved, dtype, backend=target.backend)
    assert y.device.type == target.device
    return y.cpu()


def _check(target, x: torch.Tensor, fmt: str, group_size: int, grouping: str = "row", given_scale=None):
    """Quantize ``x`` and compare codes, scales and dequantized values with the oracle."""
    shape = tuple(x.shape)
    if grouping == "flat":
        x2 = x.reshape(1, x.numel())
    else:
        x2 = x.reshape(-1, shape[-1]) if x.dim() else x.reshape(1, 1)
    packed, scales, deq = quantize_rows(to_numpy32(x2), fmt, group_size, given_scale)
    kwargs = {}
    if given_scale is not None:
        n_groups = -(-x2.shape[1] // group_size)
        sshape = (n_groups,) if grouping == "flat" else (*shape[:-1], n_groups)
        kwargs["scales"] = torch.full(sshape, given_scale, dtype=torch.float32)
    qt = _q(target, x, fmt, group_size, grouping=grouping, **kwargs)
    assert qt.codes.dtype == torch.uint8 and qt.scales.dtype == torch.float32
    assert_bitwise_equal(qt.codes.reshape(packed.shape), packed, f"{fmt} G={group_size} codes")
    assert_bitwise_equal(qt.scales.reshape(scales.shape), scales, f"{fmt} G={group_size} scales")
    y = _dq(target, qt)
    assert y.dtype == x.dtype and tuple(y.shape) == shape
    expected = torch.from_numpy(deq).to(x.dtype).reshape(shape)
    assert_bitwise_equal(y.float(), expected.float(), f"{fmt} G={group_size} dequantized")
    y32 = _dq(target, qt, torch.float32)
    assert_bitwise_equal(y32, torch.from_numpy(deq).reshape(shape), f"{fmt} G={group_size} dequantized fp32")
    return qt


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", FIXED_SCALES)
@pytest.mark.parametrize("patterns", [bf16_all_patterns, fp16_all_patterns], ids=["bf16", "fp16"])
def test_every_16bit_pattern_fixed_scale(target, fmt, scale, patterns):
    """SPEC 4 + 3.3 + 5 for all 65536 patterns of bf16 and of fp16 (NaN, Inf, subnormals, +-0)."""
    x = patterns().reshape(64, 1024)
    _check(target, x, fmt, GROUP, given_scale=scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", [1, 3, 100, 128, 4096])
@pytest.mark.parametrize("grouping", ["row", "flat"])
def test_random_fp32_full_pipeline(target, fmt, group_size, grouping):
    """SPEC 2-6: scales from amax, ragged last groups (K not a multiple of G), both groupings."""
    gen = torch.Generator().manual_seed(group_size * 7 + len(fmt))
    x = torch.randn(5, 1000, generator=gen) * torch.exp2(torch.randint(-30, 30, (5, 1000), generator=gen).float())
    _check(target, x, fmt, group_size, grouping)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_random_half_inputs(target, fmt, dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 7, 200, generator=gen) * 3).to(dtype)
    _check(target, x, fmt, 64)


class TestScaleRules:
    """SPEC 3.1 and 3.3."""

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_zero_group_scale_one_and_signed_zero_codes(self, target, fmt):
        x = torch.tensor([[0.0, -0.0, 0.0, -0.0, 1.0, -2.0, 0.0, 3.0]])
        qt = _check(target, x, fmt, 4)
        assert qt.scales[0, 0].item() == 1.0
        f = fpq.get_format(fmt)
        y = _dq(target, qt)
        assert torch.equal(torch.signbit(y[0, :4]), torch.tensor([False, True, False, True]))
        assert y[0, 6].item() == 0.0  # exact zero inside a non-zero group stays 0 (not 2*scale)
        assert abs(y[0, 7].item()) == 3.0 and qt.scales[0, 1].item() == np.float32(3.0) / np.float32(f.fmax)

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_tiny_amax_uses_scale_floor(self, target, fmt):
        """bf16 subnormal amax: amax/fmax < 2^-126 -> s = 2^-126, no division by zero, no NaN."""
        x = torch.tensor([[2.0**-133, -(2.0**-130), 2.0**-128, 0.0]], dtype=torch.bfloat16)
        qt = _check(target, x, fmt, 4)
        assert qt.scales.item() == 2.0**-126
        assert torch.isfinite(_dq(target, qt).float()).all()

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_largest_element_is_fmax_code(self, target, fmt):
        f = fpq.get_format(fmt)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(16, 128, generator=gen)
        qt = _q(target, x, fmt, 128)
        y = _dq(target, qt)
        peak = x.abs().argmax(dim=1)
        for row in range(16):
            s = qt.scales[row, 0].item()
            assert abs(y[row, peak[row]].item()) == pytest.approx(f.fmax * s, rel=2**-20)
        assert torch.isfinite(y).all()

    @pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
    def test_nan_inf_codes_fp8(self, target, fmt):
        """SPEC 3.3: NaN -> 0x7F/0xFF, Inf -> Inf (e5m2) or NaN (e4m3); finite neighbours unaffected."""
        vals = [1.0, float("nan"), -float("nan"), float("inf"), -float("inf"), -3.0, 0.5, 2.0]
        x = torch.tensor([vals])
        qt = _check(target, x, fmt, 8)
        codes = qt.codes[0].tolist()
        assert codes[1] == 0x7F and codes[2] == 0xFF
        if fmt == "e5m2":
            assert codes[3] == 0x7C and codes[4] == 0xFC
        else:
            assert codes[3] == 0x7F and codes[4] == 0xFF
        clean = _q(target, torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, -3.0, 0.5, 2.0]]), fmt, 8)
        assert qt.scales.item() == clean.scales.item()
        assert [codes[i] for i in (0, 5, 6, 7)] == [clean.codes[0, i].item() for i in (0, 5, 6, 7)]

    @pytest.mark.parametrize("fmt", ["e3m2", "e2m3", "e2m1", "e4m7"])
    @pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
    def test_nonfinite_group_without_nan_code(self, target, fmt, special):
        """SPEC 3.3: codes from the finite elements, special -> code 0, stored scale NaN, group -> NaN."""
        x = torch.tensor([[1.0, special, -3.0, 0.5], [1.0, 2.0, -3.0, 0.5]])
        qt = _check(target, x, fmt, 4)
        assert torch.isnan(qt.scales[0, 0]) and not torch.isnan(qt.scales[1, 0])
        y = _dq(target, qt)
        assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()
        row0 = unpack_group(qt.codes[0].numpy().tobytes(), 4, fmt)
        row1 = unpack_group(qt.codes[1].numpy().tobytes(), 4, fmt)
        assert row0[1] == 0 and row0[[0, 2, 3]].tolist() == row1[[0, 2, 3]].tolist()

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_stored_scale_is_the_scale_used(self, target, fmt):
        """Re-encoding with the stored scales gives the same codes (r derives from the stored s)."""
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(4, 300, generator=gen)
        qt = _q(target, x, fmt, 128)
        again = _q(target, x, fmt, 128, scales=qt.scales)
        assert torch.equal(again.codes, qt.codes) and torch.equal(again.scales, qt.scales)


class TestRounding:
    """SPEC 4: RNE including the subnormal range, saturation."""

    @pytest.mark.parametrize("value,expected", [
        (1.0625, 1.0),  # tie between 1.0 and 1.125 -> even (1.0)
        (1.1875, 1.25),  # tie between 1.125 and 1.25 -> even (1.25)
        (2.0**-9 * 0.5, 0.0),  # half the smallest subnormal ties to 0
        (2.0**-9 * 1.5, 2.0**-8),  # tie between 1 and 2 subnormal steps -> 2
        (2.0**-10 * 1.0001, 2.0**-9),  # just above half a step rounds up (no flush to zero)
        (460.0, 448.0),  # above fmax saturates, never NaN
        (1e30, 448.0),
    ])
    def test_e4m3_scale_one(self, target, value, expected):
        for sign in (1.0, -1.0):
            x = torch.tensor([sign * value])
            qt = _q(target, x, "e4m3", 1, scales=torch.ones(1))
            assert _dq(target, qt).item() == sign * expected

    def test_subnormals_not_raised_to_min_normal(self, target):
        """DeepSpeed raises small values to the smallest normal; SPEC keeps subnormal codes."""
        x = torch.tensor([448.0, 2.0**-8, 3 * 2.0**-9])
        qt = _q(target, x, "e4m3", 3)
        assert qt.scales.item() == 1.0
        assert qt.codes.tolist() == [0x7E, 0x02, 0x03]


class TestGroupingAndPacking:
    """SPEC 2 and 6."""

    def test_no_element_dropped_ragged(self, target):
        x = torch.arange(1, 11, dtype=torch.float32)  # 10 elements, G=4: groups 4, 4, 2
        qt = _q(target, x, "e4m3", 4)
        assert qt.scales.shape == (3,) and qt.codes.shape == (10,)
        y = _dq(target, qt)
        assert torch.allclose(y, x, rtol=2**-4, atol=0)  # e4m3 relative step is 2^-3; RNE halves it
        assert y[-1].item() == 10.0  # the tail group's amax maps to fmax exactly
        _check(target, x, "e4m3", 4)

    def test_numel_smaller_than_group(self, target):
        x = torch.tensor([[0.5, -1.5, 3.0]])
        _check(target, x, "e2m1", 128)
        _check(target, x, "e2m1", 128, "flat")

    def test_row_vs_flat(self, target):
        x = torch.randn(3, 10)
        row = _q(target, x, "e4m3", 4)
        flat = _q(target, x, "e4m3", 4, grouping="flat")
        assert row.scales.shape == (3, 3) and flat.scales.shape == (8,)
        assert flat.codes.shape == (30,) and row.codes.shape == (3, 10)
        _check(target, x, "e4m3", 4, "flat")

    def test_e2m1_low_nibble_first(self, target):
        x = torch.tensor([1.0, 6.0, -0.5])  # codes 0x2, 0x7, 0x9; scale 1
        qt = _q(target, x, "e2m1", 3, scales=torch.ones(1))
        assert qt.codes.tolist() == [0x72, 0x09]

    def test_e3m2_four_codes_in_three_bytes(self, target):
        # e3m2 codes (scale 1): 1.0 -> 0b001100 (12), 28 -> 31, -0.25 -> 0b100100 (36), 0.0625 -> 1
        x = torch.tensor([1.0, 28.0, -0.25, 0.0625])
        qt = _q(target, x, "e3m2", 4, scales=torch.ones(1))
        stream = 12 | (31 << 6) | (36 << 12) | (1 << 18)
        assert qt.codes.tolist() == [stream & 0xFF, (stream >> 8) & 0xFF, stream >> 16]

    def test_e4m7_two_codes_in_three_bytes_and_short_groups(self, target):
        x = torch.tensor([1.0, -2.0, 3.0])  # G=2: one full group (3 bytes) and one short group (2 bytes)
        qt = _q(target, x, "e4m7", 2, scales=torch.ones(2))
        one, minus_two, three = 7 << 7, 0x800 | (8 << 7), (8 << 7) | 64
        stream = one | (minus_two << 12)
        assert qt.codes.tolist() == [stream & 0xFF, (stream >> 8) & 0xFF, stream >> 16, three & 0xFF, three >> 8]

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0), (2, 0, 4)])
    def test_empty_tensors(self, target, fmt, shape):
        x = torch.empty(shape)
        for grouping in ("row", "flat"):
            qt = _q(target, x, fmt, 4, grouping=grouping)
            y = _dq(target, qt)
            assert y.shape == x.shape and y.dtype == x.dtype

    def test_scalar_tensor(self, target):
        qt = _q(target, torch.tensor(3.0), "e4m3", 4)
        assert qt.scales.shape == (1,) and _dq(target, qt).shape == ()
        assert _dq(target, qt).item() == 3.0

    def test_non_contiguous_input_logical_order(self, target):
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(40, 30, generator=gen)
        t = x.t()  # (30, 40), non-contiguous
        assert torch.equal(_q(target, t, "e4m3", 16).codes,
                           _q(target, t.contiguous(), "e4m3", 16).codes)
        _check(target, t, "e2m1", 16)

    @pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
    def test_codes_view_as_torch_float8(self, target, fmt):
        x = torch.randn(8, 64)
        qt = _q(target, x, fmt, 64, scales=torch.ones(8, 1))
        dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        assert torch.equal(qt.codes.view(dt).float(), x.to(dt).float())


def test_fp16_output_overflow_gives_inf(target):
    """SPEC 5: e5m2 decoded into fp16 near the fp16 limit: 57344 * 2 overflows fp16 -> Inf."""
    qt = _q(target, torch.tensor([57344.0 * 2, 1.0]), "e5m2", 2)
    y = _dq(target, qt, torch.float16)
    assert y[0].item() == float("inf") and y[1].item() == 1.0


def test_zero_scale_from_other_tools_dequantizes_to_zero(target):
    """SPEC 5: a stored fp32 scale of 0 is accepted; the group dequantizes to zeros."""
    qt = _q(target, torch.tensor([1.0, 2.0, 3.0, 4.0]), "e4m3", 2)
    before = _dq(target, qt)
    qt.scales[0] = 0.0
    after = _dq(target, qt)
    assert after[:2].tolist() == [0.0, 0.0] and torch.equal(after[2:], before[2:])
