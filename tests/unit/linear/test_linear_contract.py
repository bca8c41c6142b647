"""SPEC 8.1's weight-only linear, ``y = sum_g s_g * (sum_{j in g} x_j * decode(q_j)) + b`` in fp32 with one rounding,
on every path (the compiled CPU op's fused kernel and its fp32 panels, the torch backend) against the fp64 value
``x @ (decode(q) * s)^T + b`` with SPEC 8.2's bound, over the issue-27 matrix: every element format, every scale
layout (fp32, E8M0 ceil / floor, NVFP4, 2-D blocks), G in {16, 32, 64, 100, 128, 256} with ragged K, M in
{1, 2, 3, 4, 5, 8, 16, 17, 64, 300}, x in fp32 / bf16 / fp16, bias or not, 3-D and non-contiguous x.

The bound (``unit.linear_bound``): ``|y - exact| <= 2 K 2^-24 sum|x||w| + eps(dtype) |exact| + tiny(dtype)``.
:func:`test_group_scale_multiplies_the_partial_sum` shows that the bound tells the formula from the former
one (weights rounded to x's dtype before the matmul): it fails that one.
"""

import dataclasses

import pytest
import torch
from unit.linear_bound import EPS_OUT, TINY_OUT, assert_linear_within_bound, exact_weight

import ds_fpquant as fpq
from ds_fpquant.linear import linear
from ds_fpquant.linear import weight_only as weight_only_module
from ds_fpquant.numerics.packing import pack_rows, unpack_rows

TOKENS = (1, 2, 3, 4, 5, 8, 16, 17, 64, 300)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ELEMENTS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e4m7")
GROUPS = (16, 32, 64, 100, 128, 256)
BACKENDS = ("auto", "torch")


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k).clamp(max=4)


def _inputs(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype)


# (format, quantize kwargs): every scale layout of SPEC 3
LAYOUTS = [(f, {"group_size": g}) for f in ELEMENTS for g in GROUPS] + [
    ("mxfp8_e4m3", {"scale_rounding": "ceil"}), ("mxfp8_e5m2", {"scale_rounding": "floor"}),
    ("mxfp6_e3m2", {}), ("mxfp6_e2m3", {"scale_rounding": "floor"}), ("mxfp4", {}),
    ("mxfp4", {"scale_rounding": "floor"}), ("nvfp4", {}),
    ("e4m3", {"block": (128, 128)}), ("e2m1", {"block": (16, 32), "scale_format": "e8m0"}),
    ("e3m2", {"block": (5, 48)}), ("e5m2", {"block": (3, 100), "scale_format": "e8m0", "scale_rounding": "floor"}),
]


def _layout_id(layout):
    fmt, kwargs = layout
    return fmt + "".join(f"-{key}={value}" for key, value in kwargs.items())


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("m", TOKENS)
def test_every_layout_and_row_count_within_the_bound(layout, m):
    fmt, kwargs = layout
    index = LAYOUTS.index(layout) * len(TOKENS) + TOKENS.index(m)
    dtype = DTYPES[index % 3]
    k = (300, 256, 1000, 129)[index % 4]  # ragged: not a multiple of G, 16, 64 or the pack unit
    n = 33 if m < 64 else 20
    qt = fpq.quantize(_weight(n, k, index), fmt, **kwargs)
    x = _inputs(m, k, dtype, index)
    bias = _inputs(1, n, dtype, index + 1)[0] if index % 2 else None
    for backend in BACKENDS:
        assert_linear_within_bound(x, qt, bias, linear(x, qt, bias, backend=backend))


@pytest.mark.parametrize("m", [1, 4, 17, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_path_follows_the_formula(monkeypatch, m, dtype):
    """Small panels (several per call) and a zero SMALL_M: every M takes the fp32 panels."""
    monkeypatch.setattr(weight_only_module, "PANEL_BYTES", 7 * 200 * 4)
    monkeypatch.setattr(weight_only_module, "SMALL_M", {d: 0 for d in DTYPES})
    qt = fpq.quantize(_weight(45, 200, m), "e2m1", 32)
    x = _inputs(m, 200, dtype, m)
    bias = torch.randn(45).to(dtype)
    assert_linear_within_bound(x, qt, bias, linear(x, qt, bias))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_3d_and_non_contiguous_x(dtype, backend):
    qt = fpq.quantize(_weight(40, 256, 3), "e4m3", 64)
    x = _inputs(2 * 3 * 512, 1, dtype, 5).reshape(2, 3, 512)[..., ::2]  # (2, 3, 256), stride 2
    assert not x.is_contiguous()
    y = linear(x, qt, backend=backend)
    assert y.shape == (2, 3, 40)
    assert_linear_within_bound(x.reshape(6, 256), qt, None, y.reshape(6, 40))
    xt = _inputs(256, 5, dtype, 6).t()  # (5, 256) transposed
    assert_linear_within_bound(xt, qt, None, linear(xt, qt, backend=backend))


# Codes whose exact products cancel: x . decode(q) = 0 in exact arithmetic for both weights of a group.
CANCELLING = {"e4m3": ((1.75, 1.5), (1.5, -1.75)), "e5m2": ((1.75, 1.5), (1.5, -1.75)),
              "e3m2": ((1.75, 1.5), (1.5, -1.75)), "e2m3": ((1.875, 1.25), (1.25, -1.875)),
              "e2m1": ((3.0, 2.0), (2.0, -3.0)), "e4m7": ((1.25, 1.75), (1.75, -1.25))}


@pytest.mark.parametrize("fmt", sorted(CANCELLING))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 300])
@pytest.mark.parametrize("backend", BACKENDS)
def test_group_scale_multiplies_the_partial_sum(fmt, dtype, m, backend):
    """With a scale of 1/3 the weights ``decode(q) * s`` are not bf16/fp16 values. SPEC 8.1 multiplies the exact
    codes and scales the group's partial sum, so a group whose products cancel gives 0 (up to fp32 rounding of
    the scale); weights rounded to x's dtype first give about 2^-9 (2^-12 for fp16) of s, far outside the
    bound. The test checks both, so the bound cannot pass the former formula."""
    (d0, d1), (x0, x1) = CANCELLING[fmt]
    k, n, s = 64, 24, torch.tensor(1.0 / 3.0)
    w = torch.zeros(n, k)
    w[:, 0], w[:, 1] = d0 * s, d1 * s  # one group of 64 columns, the rest zero
    qt = fpq.quantize(w, fmt, 64, scales=torch.full((n, 1), float(s)))
    assert torch.equal(exact_weight(qt)[:, :2].float(), w[:, :2])
    x = torch.zeros(m, k, dtype=dtype)
    x[:, 0], x[:, 1] = x0, x1
    y = linear(x, qt, backend=backend)
    assert_linear_within_bound(x, qt, None, y)
    rounded = torch.nn.functional.linear(x.float(), fpq.dequantize(qt, dtype).float())
    tol = 2 * k * 2.0**-24 * (x.double().abs() @ exact_weight(qt).abs().T) + TINY_OUT[dtype]
    assert bool((rounded.double().abs() > tol).all()), "the former formula's error is not visible here"
    assert EPS_OUT[dtype] > 0


@pytest.mark.parametrize("layout", [("e4m3", {"group_size": 128}), ("e2m1", {"group_size": 32}), ("nvfp4", {}),
                                    ("mxfp6_e3m2", {}), ("e4m3", {"block": (16, 64)}), ("e4m7", {"group_size": 100})],
                         ids=_layout_id)
@pytest.mark.parametrize("m", [1, 5, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_codes_and_nan_scales_make_their_outputs_nan(layout, m, dtype):
    """A NaN input gives a NaN scale in formats without a NaN code (SPEC 3.3) and a NaN code in e4m3 / e5m2; either
    way the outputs of that weight row are NaN on every path, and only those."""
    fmt, kwargs = layout
    w = _weight(48, 256, m)
    w[7, 3] = float("nan")
    w[30, 200] = float("inf")
    qt = fpq.quantize(w, fmt, **kwargs)
    x = _inputs(m, 256, dtype, m)
    for backend in BACKENDS:
        y = linear(x, qt, backend=backend)
        assert_linear_within_bound(x, qt, None, y)
        bad = torch.isnan(exact_weight(qt)).any(dim=1)
        assert bad[7] and bad.sum() <= 2 * (kwargs.get("block", (1, 1))[0])
        assert torch.equal(torch.isnan(y), bad.expand(m, -1))


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e3m2", "e5m2"])
def test_the_bias_is_added_in_fp32_before_the_one_rounding(fmt):
    """y = round(sum + b): with a bias that cancels the sum to below bf16's resolution of either, the result is
    the small difference, not 0 (which rounding the sum to bf16 first would give)."""
    qt = fpq.quantize(_weight(8, 64, 1), fmt, 64)
    x = _inputs(3, 64, torch.bfloat16, 2)
    y32 = (x.double() @ exact_weight(qt).T).float()
    bias = (-y32[0]).bfloat16()
    for backend in BACKENDS:
        y = linear(x, qt, bias, backend=backend)
        assert_linear_within_bound(x, qt, bias, y)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_every_code_of_every_format(fmt, dtype, m):
    """Every code of the 4-, 6- and 8-bit formats, 64 per weight row in order, against its value: the byte-table
    decode of the fused kernel covers subnormals, the largest codes, signed zeros, Inf and NaN. x is a power of
    two per column, so each output is one code times x plus the others."""
    bits = fpq.get_format(fmt).bits
    rows = max(1, (1 << bits) // 64)
    template = fpq.quantize(torch.zeros(rows, 64), fmt, 64, scales=torch.full((rows, 1), 0.5))
    codes = torch.arange(rows * 64).remainder(1 << bits).view(rows, 64).to(torch.int32)
    packed = pack_rows(codes, 64, bits)
    qt = dataclasses.replace(template, codes=packed.view(template.codes.dtype).reshape(template.codes.shape))
    assert torch.equal(unpack_rows(qt.codes.view(torch.uint8).reshape(rows, -1), 64, 64, bits).long(), codes.long())
    for column in range(64):  # one code at a time: y = decode(q) * s * x exactly
        x = torch.zeros(m, 64, dtype=dtype)
        x[:, column] = 2.0 ** -(column % 5)
        for backend in BACKENDS:
            assert_linear_within_bound(x, qt, None, linear(x, qt, backend=backend))
