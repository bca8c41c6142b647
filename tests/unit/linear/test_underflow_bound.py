"""Issue 43 (3): SPEC 8.2's bound with its absolute underflow term. fp32 ``x`` of subnormal size (``k 2^-149``,
``N(0, 1) 2^-135``), subnormal weights and scales, every layout (fp32 group scales, E8M0, NVFP4, 2-D blocks), the
torch backend and the compiled op at M on both sides of its crossovers: within the new bound everywhere; without the
term the bound fails (the products and scale multiplies whose results are subnormal err by up to half fp32's smallest
subnormal each); and a real error in the same range (a flushed subnormal, a dropped group) still fails it."""

import pytest
import torch
from unit.linear_bound import EPS_OUT, TINY_OUT, assert_linear_within_bound, exact_parts

import ds_fpquant as fpq
from ds_fpquant.linear import linear

N, K = 40, 256
LAYOUTS = [("e4m3", {"group_size": 32}), ("e2m1", {"group_size": 32, "scale_format": "e8m0"}), ("nvfp4", {}),
           ("e4m3", {"block": (16, 32)})]
BACKENDS = ("torch", "auto")
M = (1, 5, 40)  # the GEMV, the GEMM / register kernels, beyond SMALL_M (the fp32 panels on a portable build)


def _id(layout):
    return layout[0] + "".join(f"-{k}={v}" for k, v in layout[1].items())


def _old_bound_ratio(x, qt, y) -> float:
    """The largest ``|y - exact|`` over SPEC 8.2's bound without the underflow term (as written before issue 43)."""
    codes, scales = exact_parts(qt)
    w = codes * scales
    x64 = x.double()
    ref = x64 @ w.T
    tol = 2 * (K + 2) * 2.0**-24 * (x64.abs() @ w.abs().T) + EPS_OUT[x.dtype] * ref.abs() + TINY_OUT[x.dtype]
    return float(((y.double() - ref).abs() / tol).max())


def _small_x(m, seed, ulps=16):
    """fp32 ``x = k 2^-149``, ``|k| <= ulps``: every product with a weight below 1 rounds in the subnormal range."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-ulps, ulps + 1, (m, K), generator=g).float() * 2.0**-149


def _weight(seed, scale=1.0):
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_subnormal_x_within_the_new_bound_where_the_old_failed(layout):
    fmt, kwargs = layout
    qt = fpq.quantize(_weight(1), fmt, **kwargs)
    worst = 0.0
    for backend in BACKENDS:
        for m in M:
            x = _small_x(m, m)
            y = linear(x, qt, backend=backend)
            assert_linear_within_bound(x, qt, None, y)
            worst = max(worst, _old_bound_ratio(x, qt, y))
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)) * 2.0**-135
            assert_linear_within_bound(x, qt, None, linear(x, qt, backend=backend))
    assert worst > 1.5, f"the old bound held here (worst {worst:.2f}): the test no longer shows the underflow term"


def _with_subnormal_scales(qt):
    """``qt`` (codes of normal size) with subnormal scales, which quantize never makes (it keeps fp32 and E8M0
    scales at 2^-126 or more): fp32 scales rescaled to at most 2^-130, E8M0 bytes 0 (2^-127), NVFP4's tensor scale
    2^-140 (its ``fl(decode(c) * t)`` subnormal)."""
    scales, tensor_scale = qt.scales, qt.tensor_scale
    if qt.fmt == "nvfp4":
        tensor_scale = torch.full_like(tensor_scale, 2.0**-140)  # fl(decode(c) * t) <= 448 * 2^-140 < 2^-126
    elif qt.scale_format == "fp32":
        scales = qt.scales * (2.0**-130 / qt.scales.max())
    else:
        scales = torch.zeros_like(qt.scales)
    return fpq.QuantizedTensor(codes=qt.codes, scales=scales, shape=qt.shape, dtype=qt.dtype, fmt=qt.fmt,
                               group_size=qt.group_size, scale_format=qt.scale_format, block=qt.block,
                               tensor_scale=tensor_scale)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_subnormal_weights_and_scales_within_the_bound(layout, backend):
    """Subnormal scales (:func:`_with_subnormal_scales`): decoded weights subnormal; ``x`` of normal size and of
    subnormal size."""
    fmt, kwargs = layout
    qt = _with_subnormal_scales(fpq.quantize(_weight(2), fmt, **kwargs))
    _, scales = exact_parts(qt)
    assert bool((scales < 2.0**-126).all()), "a scale of normal size"
    for m in M:
        for x in (torch.randn(m, K, generator=torch.Generator().manual_seed(m)), _small_x(m, m, ulps=2**12)):
            assert_linear_within_bound(x, qt, None, linear(x, qt, backend=backend))


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_real_errors_in_the_subnormal_range_still_fail(layout):
    """A flushed subnormal (``x`` read as zero, or subnormal weights decoded as zero) and a dropped group (one group
    of codes zeroed) differ from the exact result by far more than the underflow term allows."""
    fmt, kwargs = layout
    qt = fpq.quantize(_weight(3), fmt, **kwargs)
    x = _small_x(8, 3, ulps=2**12)  # x subnormal (below 2^-136), products far above the rounding noise
    y = linear(x, qt)
    assert_linear_within_bound(x, qt, None, y)
    with pytest.raises(AssertionError, match="over bound"):  # denormals-are-zero: x read as zero
        assert_linear_within_bound(x, qt, None, linear(torch.zeros_like(x), qt))
    flushed = x.clone()
    flushed[:, :K // 2] = 0  # half of the subnormal x flushed
    with pytest.raises(AssertionError, match="over bound"):
        assert_linear_within_bound(x, qt, None, linear(flushed, qt))
    dropped = qt.codes.clone()
    dropped.view(torch.uint8).reshape(N, -1)[:, : dropped.view(torch.uint8).reshape(N, -1).shape[1] // 8] = 0
    without = fpq.QuantizedTensor(codes=dropped, scales=qt.scales, shape=qt.shape, dtype=qt.dtype, fmt=qt.fmt,
                                  group_size=qt.group_size, scale_format=qt.scale_format, block=qt.block,
                                  tensor_scale=qt.tensor_scale)
    with pytest.raises(AssertionError, match="over bound"):  # the first group's codes zeroed: a dropped group
        assert_linear_within_bound(x, qt, None, linear(x, without))
    # subnormal weights flushed: weights decoded with subnormal scales (codes of normal size), read as zero
    small = _with_subnormal_scales(fpq.quantize(_weight(4), fmt, **kwargs))
    assert bool((exact_parts(small)[0] != 0).any())
    xn = torch.randn(8, K, generator=torch.Generator().manual_seed(4))
    with pytest.raises(AssertionError, match="over bound"):
        assert_linear_within_bound(xn, small, None, torch.zeros(8, N))
