"""Property tests (hypothesis): random shapes, group sizes, formats, dtypes, rounding modes and
special values. Backends agree bit for bit; dequantize(quantize(x)) is within one step of x;
finite inputs never produce a NaN code; re-quantizing the dequantized values with the stored
scales gives the same codes.

Profiles: ``ci`` (default, a few hundred examples) and ``nightly`` (set
``DS_FPQUANT_HYPOTHESIS_PROFILE=nightly``).
"""

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds_fpquant as fpq
from ds_fpquant.ops.backends import load_op

settings.register_profile("ci", max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("DS_FPQUANT_HYPOTHESIS_PROFILE", "ci"))

FORMATS = list(fpq.FORMATS)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SPECIALS = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -1e-45, 65504.0, 3e38]
COMPILED = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@st.composite
def cases(draw, finite_only=False):
    ndim = draw(st.integers(1, 3))
    shape = (*draw(st.lists(st.integers(0, 6), min_size=ndim - 1, max_size=ndim - 1)), draw(st.integers(0, 100)))
    n = math.prod(shape)
    exponent = draw(st.integers(-40, 40))
    values = draw(st.lists(st.floats(-4, 4, width=32), min_size=n, max_size=n))
    x = torch.tensor(values, dtype=torch.float32).reshape(shape) * 2.0**exponent
    if not finite_only and n:
        picks = draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(SPECIALS)), max_size=3))
        for index, value in picks:
            x.view(-1)[index] = value
    dtype = draw(st.sampled_from(DTYPES))
    x = x.to(dtype)
    if finite_only:  # values that overflowed the narrow dtype become 0
        x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    fmt = draw(st.sampled_from(FORMATS))
    group_size = draw(st.integers(1, 70))
    grouping = draw(st.sampled_from(["row", "flat"]))
    stochastic = draw(st.booleans())
    kwargs = dict(rounding="stochastic", seed=draw(st.integers(0, 2**64 - 1)),
                  offset=draw(st.integers(0, 2**64 - 1))) if stochastic else {}
    return x, fmt, group_size, grouping, kwargs


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        return torch.allclose(a.float(), b.float(), rtol=0, atol=0, equal_nan=True) and torch.equal(
            torch.signbit(a), torch.signbit(b))
    return torch.equal(a, b)


@pytest.mark.parametrize("backend", COMPILED)
@given(case=cases())
def test_backends_agree(backend, case):
    x, fmt, group_size, grouping, kwargs = case
    if load_op(backend)[0] is None:
        pytest.skip(f"no compiled {backend} op")
    device = "cuda" if backend == "cuda" else "cpu"
    ref = fpq.quantize(x, fmt, group_size, grouping=grouping, backend="torch", **kwargs)
    got = fpq.quantize(x.to(device), fmt, group_size, grouping=grouping, backend=backend, **kwargs)
    assert torch.equal(got.codes.cpu(), ref.codes)
    assert _same(got.scales.cpu(), ref.scales)
    for dtype in DTYPES:
        assert _same(got.dequantize(dtype, backend=backend).cpu(), ref.dequantize(dtype, backend="torch"))


@pytest.mark.parametrize("backend", COMPILED)
@given(case=cases(), preset=st.sampled_from(list(fpq.PRESETS)))
def test_presets_backends_agree(backend, case, preset):
    """MX presets and NVFP4 (whose tensor scale couples all groups): same bits on every backend."""
    x, _, _, grouping, kwargs = case
    if load_op(backend)[0] is None:
        pytest.skip(f"no compiled {backend} op")
    device = "cuda" if backend == "cuda" else "cpu"
    ref = fpq.quantize(x, preset, grouping=grouping, backend="torch", **kwargs)
    got = fpq.quantize(x.to(device), preset, grouping=grouping, backend=backend, **kwargs)
    assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
    assert (got.tensor_scale is None) == (ref.tensor_scale is None) == (preset != "nvfp4")
    if ref.tensor_scale is not None:
        assert torch.equal(got.tensor_scale.cpu(), ref.tensor_scale)
    for dtype in DTYPES:
        assert _same(got.dequantize(dtype, backend=backend).cpu(), ref.dequantize(dtype, backend="torch"))


def _step(v: np.ndarray, f) -> np.ndarray:
    """The format's spacing at |v| (v already divided by the scale)."""
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.maximum(np.abs(v), f.min_subnormal)))
    return np.exp2(np.maximum(e, f.emin) - f.mbits)


@given(case=cases(finite_only=True))
def test_error_within_one_step_and_no_nan_codes(case):
    x, fmt, group_size, grouping, kwargs = case
    f = fpq.get_format(fmt)
    qt = fpq.quantize(x, fmt, group_size, grouping=grouping, **kwargs)
    y = qt.dequantize(torch.float32).double().numpy().reshape(-1)
    xs = x.double().numpy().reshape(-1)
    # each element's scale, in logical order
    rows, k = (1, x.numel()) if grouping == "flat" else (x.numel() // max(x.shape[-1], 1), x.shape[-1])
    if x.numel() == 0:
        return
    s = qt.scales.double().numpy().reshape(rows, -1).repeat(group_size, axis=1)[:, :k].reshape(-1)
    assert np.isfinite(y).all(), "finite input never decodes to NaN/Inf"
    bound = _step(xs / s, f) * s * (0.5 if not kwargs else 1.0) + np.abs(xs) * 2.0**-20 + 2.0**-149
    assert (np.abs(y - xs) <= bound).all()


@given(case=cases(finite_only=True))
def test_requantizing_dequantized_values_is_idempotent(case):
    x, fmt, group_size, grouping, _ = case
    qt = fpq.quantize(x, fmt, group_size, grouping=grouping)
    if x.numel() == 0 or bool((qt.scales < 2.0**-100).any()):
        return  # c * s may round in fp32's subnormal range there; the property needs exact products
    y = qt.dequantize(torch.float32)
    again = fpq.quantize(y, fmt, group_size, grouping=grouping, scales=qt.scales)
    assert torch.equal(again.codes, qt.codes)
