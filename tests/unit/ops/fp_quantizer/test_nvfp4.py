"""SPEC 3.4 NVFP4 (``fmt="nvfp4"``), bit for bit against the numpy + ml_dtypes oracle on every
backend: e2m1 codes, e4m3 group scale codes, the fp32 tensor scale and the dequantized values."""

import ml_dtypes
import numpy as np
import pytest
import torch
from unit.oracle import assert_bitwise_equal, code_values, quantize_nvfp4_rows

import ds_fpquant as fpq


def _check(x: torch.Tensor, target, grouping="row", dtypes=(torch.float32,)):
    rows, k = (1, x.numel()) if grouping == "flat" else (x.numel() // x.shape[-1], x.shape[-1])
    x32 = x.float().reshape(rows, k).numpy()
    packed, scale_codes, t, deq = quantize_nvfp4_rows(x32, min(16, max(k, 1)))
    qt = fpq.quantize(x.to(target.device), "nvfp4", grouping=grouping, backend=target.backend)
    assert qt.fmt == "nvfp4" and qt.group_size == 16 and qt.scale_format == "e4m3" and qt.block is None
    assert qt.scales.dtype == torch.uint8 and qt.tensor_scale.dtype == torch.float32 and qt.tensor_scale.dim() == 0
    assert_bitwise_equal(qt.tensor_scale.cpu(), np.float32(t), "tensor scale t")
    assert_bitwise_equal(qt.scales.cpu().reshape(scale_codes.shape), scale_codes, "e4m3 group scale codes")
    assert_bitwise_equal(qt.codes.cpu().reshape(packed.shape), packed, "e2m1 codes")
    for dtype in dtypes:
        y = qt.dequantize(dtype, backend=target.backend).cpu()
        expected = torch.from_numpy(deq).reshape(x.shape).to(dtype)
        if dtype == torch.bfloat16:
            expected.view(torch.int16).masked_fill_(torch.isnan(expected), 0x7FC0)
        assert_bitwise_equal(y, expected, f"dequantized {dtype}")
    return qt


@pytest.mark.parametrize("shape", [(8, 128), (3, 100), (5, 16), (2, 7), (1, 1), (4, 3, 33)])
def test_nvfp4_exact_random(target, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    # groups spanning 2^-30 .. 2^20 so that some group scales saturate, some are subnormal e4m3 and
    # some underflow to a zero code
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-30, 20, shape[:-1] + (1,), generator=gen).float())
    _check(x, target, dtypes=(torch.float32, torch.bfloat16, torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_exact_low_precision_inputs(target, dtype):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 64, generator=gen) * 3).to(dtype)
    x[0, :16] = 0.0  # an all-zero group: code 0 scale, all codes 0
    x[1, 3] = -0.0
    qt = _check(x, target)
    assert qt.dtype == dtype and qt.scales[0, 0].item() == 0


def test_nvfp4_specials(target):
    x = torch.randn(4, 48) * 100
    x[0, 5] = float("nan")
    x[1, 20] = float("inf")
    x[2, 40] = -float("inf")
    x[3, :] = 0.0
    qt = _check(x, target)
    assert qt.scales[0, 0].item() == 0x7F and qt.scales[1, 1].item() == 0x7F and qt.scales[2, 2].item() == 0x7F
    y = qt.dequantize(backend=target.backend).cpu()
    assert torch.isnan(y[0, :16]).all() and torch.isfinite(y[0, 16:]).all()  # only the faulty group
    assert (y[3] == 0).all()


def test_nvfp4_all_nonfinite_and_zero_tensor(target):
    qt = _check(torch.full((2, 16), float("nan")), target)
    assert qt.tensor_scale.item() == 1.0  # no finite element: amax_tensor = 0, t = 1
    qt = _check(torch.zeros(3, 20), target)
    assert qt.tensor_scale.item() == 1.0 and (qt.codes == 0).all() and (qt.scales == 0).all()


def test_nvfp4_tiny_tensor_scale_floor_and_underflow(target):
    """amax_tensor below 2688 * 2^-126: t = 2^-126, group scales are subnormal e4m3 and s can be 0
    (code 0) or subnormal fp32 so small that r = fl(1/s) overflows: those groups are all-zero codes."""
    x = torch.zeros(1, 64)
    x[0, :16] = 2.0**-118 * torch.linspace(-1, 1, 16)  # the tensor amax
    x[0, 16:32] = 2.0**-131 * torch.linspace(-1, 1, 16)  # s = decode(c) * 2^-126 below 2^-128
    x[0, 32:48] = 2.0**-145  # c rounds to 0
    x[0, 48:64] = 2.0**-122 * torch.linspace(0.1, 1, 16)  # s about 2^-124.6: encoded as usual
    qt = _check(x, target)
    assert qt.tensor_scale.item() == 2.0**-126
    codes = qt.codes.view(4, 8)
    assert qt.scales[0, 1].item() != 0 and (codes[1] == 0).all()  # nonzero scale code, r overflowed
    assert qt.scales[0, 2].item() == 0 and (codes[2] == 0).all()
    assert (codes[3] != 0).any()


def test_nvfp4_scale_saturates_at_448(target):
    """The group holding the tensor amax has fl(fl(amax/6)/t) at or just above 448: e4m3 code 0x7E."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        x = torch.randn(2, 32, generator=gen)
        qt = _check(x, target)
        assert qt.scales.max().item() == 0x7E


def test_nvfp4_flat_grouping(target):
    x = torch.randn(5, 7) * 10
    qt = _check(x, target, grouping="flat")
    assert qt.codes.shape == (18,) and qt.scales.shape == (3,)


def test_nvfp4_stochastic_backends_identical(target):
    x = torch.randn(4, 70, generator=torch.Generator().manual_seed(1))
    qt = fpq.quantize(x.to(target.device), "nvfp4", rounding="stochastic", seed=11, offset=5, backend=target.backend)
    ref = fpq.quantize(x, "nvfp4", rounding="stochastic", seed=11, offset=5, backend="torch")
    nearest = fpq.quantize(x, "nvfp4", backend="torch")
    assert torch.equal(qt.codes.cpu(), ref.codes) and torch.equal(qt.scales.cpu(), ref.scales)
    assert torch.equal(qt.scales.cpu(), nearest.scales) and torch.equal(qt.tensor_scale.cpu(), nearest.tensor_scale)
    # every element rounds to one of the two e2m1 neighbours of x / s
    y, s = qt.dequantize(backend=target.backend).cpu(), nearest.dequantize()
    step = (code_values("e4m3")[nearest.scales.numpy()] * nearest.tensor_scale.item()).repeat(16, axis=1)[:, :70]
    assert ((y - x).abs().numpy() <= 2 * step + 1e-30).all() and not torch.equal(y, s)


def test_nvfp4_scale_codes_view_as_float8(target):
    x = torch.randn(3, 64).to(target.device)
    qt = fpq.quantize(x, "nvfp4", backend=target.backend)
    s = qt.scales.cpu().view(torch.float8_e4m3fn).float() * qt.tensor_scale.cpu()
    ml = qt.scales.cpu().numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32) * qt.tensor_scale.cpu().numpy()
    assert_bitwise_equal(s, ml.astype(np.float32), "decoded group scales")


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(group_size=32), ValueError, "fmt='nvfp4' fixes group_size=16; got group_size=32"),
    (dict(scale_format="e8m0"), ValueError, "fmt='nvfp4' fixes scale_format='e4m3'; got scale_format='e8m0'"),
    (dict(scale_rounding="floor"), ValueError, "scale_rounding='floor' only applies to scale_format='e8m0'"),
    (dict(block=(16, 16)), ValueError, "fmt='nvfp4' fixes groups of 16"),
    (dict(scales=torch.ones(4, 4)), ValueError, "scales= takes fp32 scales"),
])
def test_nvfp4_conflicting_arguments(kwargs, exc, message):
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
        fpq.quantize(torch.randn(4, 64), "nvfp4", **kwargs)


def test_nvfp4_inconsistent_quantized_tensor():
    qt = fpq.quantize(torch.randn(4, 64), "nvfp4")
    with pytest.raises(TypeError, match="qt.tensor_scale must be a 0-d float32 tensor"):
        fpq.dequantize(fpq.QuantizedTensor(**{**qt.__dict__, "tensor_scale": None}))
    with pytest.raises(TypeError, match="qt.tensor_scale must be a 0-d float32 tensor"):
        fpq.dequantize(fpq.QuantizedTensor(**{**qt.__dict__, "tensor_scale": torch.ones(1)}))
    other = fpq.quantize(torch.randn(4, 64), "e2m1", 16)
    with pytest.raises(ValueError, match="tensor_scale is only used by fmt='nvfp4'"):
        fpq.dequantize(fpq.QuantizedTensor(**{**other.__dict__, "tensor_scale": qt.tensor_scale}))
    with pytest.raises(ValueError, match="qt.scale_format='fp32' is not supported"):
        fpq.dequantize(fpq.QuantizedTensor(**{**qt.__dict__, "scale_format": "fp32"}))


def test_preset_layouts_are_enforced():
    x = torch.randn(4, 64)
    assert fpq.quantize(x, "nvfp4", scale_format="e4m3").scale_format == "e4m3"  # what it reports is accepted
    with pytest.raises(ValueError, match=r"fmt='mxfp4' fixes groups of 32 along the last dim \(OCP MX v1.0\)"):
        fpq.quantize(x, "mxfp4", block=(4, 8))
    with pytest.raises(ValueError, match="scale_format='e4m3' is not supported"):
        fpq.quantize(x, "e2m1", scale_format="e4m3")
    qt = fpq.quantize(x, "nvfp4")
    for change in (dict(group_size=8, codes=qt.codes, scales=qt.scales.repeat(1, 2)),
                   dict(block=(1, 16))):
        with pytest.raises(ValueError, match="fmt='nvfp4' means group_size=16, scale_format='e4m3', no block"):
            fpq.dequantize(fpq.QuantizedTensor(**{**qt.__dict__, **change}))
