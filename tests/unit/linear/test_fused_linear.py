"""The fused quantized linear (``ds_fpquant.linear.linear``, the CPU op's ``linear``) against an fp64
reference of ``x @ dequantize(W, x.dtype)^T + b``.

Every path multiplies by the SPEC 5 weights in ``x``'s dtype; only the fp32 summation order differs
(plus one rounding to ``x``'s dtype), so the bound is ``2 K eps32 sum|x||w|`` plus the output
dtype's rounding error (relative, or half its smallest subnormal). M covers the fused kernel (M <= SMALL_M) and the panel path; K covers ragged rows
(not a multiple of G, of 16 or of the pack unit) and groups that do not start on 16 codes.
"""

import pytest
import torch
from unit.linear_bound import assert_linear_within_bound as _check
from unit.linear_bound import matmul_within_bound
from unit.oracle import assert_bitwise_equal

import ds_fpquant as fpq
from ds_fpquant.linear import linear
from ds_fpquant.linear import weight_only as linear_module
from ds_fpquant.linear.weight_only import SMALL_M
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

TOKENS = (1, 2, 3, 16, 17, 300)


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k).clamp(max=4)


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e4m7"])
@pytest.mark.parametrize("k,group_size", [(300, 128), (129, 16), (7, 3), (100, 100), (256, 32), (1, 1), (96, 48),
                                          (40, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_element_formats_fp32_scales(fmt, k, group_size, m, dtype):
    torch.manual_seed(m + k)
    qt = fpq.quantize(_weight(37, k), fmt, group_size)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(37).to(dtype) if m % 2 else None
    _check(x, qt, bias, linear(x, qt, bias))


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("k", [300, 64, 5])
def test_presets_e8m0_and_nvfp4_scales(fmt, k, m):
    torch.manual_seed(k)
    qt = fpq.quantize(_weight(20, k, seed=k), fmt)
    x = torch.randn(m, k).bfloat16()
    _check(x, qt, None, linear(x, qt))


@pytest.mark.parametrize("m", [1, 17, 300])
@pytest.mark.parametrize("block,fmt,scale_format", [((128, 128), "e4m3", "fp32"), ((3, 16), "e2m1", "e8m0"),
                                                    ((5, 7), "e3m2", "fp32"), ((1, 32), "e5m2", "e8m0")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2d_blocks(block, fmt, scale_format, m, dtype):
    qt = fpq.quantize(_weight(33, 300), fmt, block=block, scale_format=scale_format)
    x = torch.randn(m, 300).to(dtype)
    bias = torch.randn(33).to(dtype)
    _check(x, qt, bias, linear(x, qt, bias))


@pytest.mark.parametrize("m", [1, 40])
def test_3d_and_non_contiguous_inputs(m):
    qt = fpq.quantize(_weight(24, 64), "e2m1", 32)
    x = torch.randn(64, 3, m).transpose(0, 2)  # (m, 3, 64), non-contiguous
    y = linear(x, qt)
    assert y.shape == (m, 3, 24)
    _check(x.contiguous(), qt, None, y)
    neg = torch.randn(2, 64)._neg_view()  # a lazily negated view
    _check(neg.resolve_neg(), qt, None, linear(neg, qt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,group_size", [("e2m1", 16), ("e2m1", 32), ("e4m3", 32), ("e4m3", 48), ("e5m2", 64),
                                            ("mxfp4", None), ("nvfp4", None), ("mxfp8_e4m3", None)])
def test_nan_weights_give_nan_outputs(fmt, group_size, dtype):
    """A NaN code (e4m3, e5m2) or a NaN group scale (e2m1, SPEC 3.3) makes its output feature NaN on every
    path; the other features stay finite."""
    w = _weight(6, 70)
    w[2, 35] = float("nan")
    qt = fpq.quantize(w, fmt, group_size)
    for m in (1, 5, 300):
        y = linear(torch.randn(m, 70).to(dtype), qt)
        assert torch.isnan(y[:, 2]).all() and not torch.isnan(y[:, [0, 1, 3, 4, 5]]).any()


def test_empty_inputs():
    qt = fpq.quantize(_weight(6, 40), "e2m1", 16)
    assert linear(torch.randn(0, 40), qt).shape == (0, 6)
    assert linear(torch.randn(2, 0, 40), qt).shape == (2, 0, 6)
    empty = fpq.quantize(torch.randn(5, 0), "e4m3", 16)
    bias = torch.randn(5)
    assert_bitwise_equal(linear(torch.randn(3, 0), empty, bias), bias.expand(3, 5), "K = 0 gives the bias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_backend(dtype):
    """The torch backend's F.linear(x, dequantize(W)) and the fused op agree within the bound."""
    qt = fpq.quantize(_weight(50, 200), "e4m3", 64)
    x = torch.randn(5, 200).to(dtype)
    _check(x, qt, None, linear(x, qt, backend="torch"))
    _check(x, qt, None, linear(x, qt, backend="cpu"))


def test_backward_through_the_dequantized_weight():
    """Gradients w.r.t. x (frozen quantized base, as under LoRA) and a trainable bias."""
    qt = fpq.quantize(_weight(12, 48), "e3m2", 16)
    x = torch.randn(3, 48, requires_grad=True)
    bias = torch.randn(12, requires_grad=True)
    y = linear(x, qt, bias)
    g = torch.randn_like(y)
    y.backward(g)
    w = fpq.dequantize(qt, torch.float32)
    matmul_within_bound(g, w, x.grad)  # g @ W in autograd's fp32 order: the summation bound
    matmul_within_bound(torch.ones(1, 3), g, bias.grad[None])  # the sum of g's rows, likewise


def test_bad_arguments():
    qt = fpq.quantize(_weight(4, 16), "e4m3", 8)
    with pytest.raises(ValueError, match=r"x has shape \(2, 15\); its last dim must be in_features=16"):
        linear(torch.randn(2, 15), qt)
    with pytest.raises(TypeError, match="x.dtype=torch.float64 is not supported"):
        linear(torch.randn(2, 16).double(), qt)
    with pytest.raises(ValueError, match=r"bias has shape \(3,\); expected \(4,\)"):
        linear(torch.randn(2, 16), qt, torch.randn(3))
    with pytest.raises(ValueError, match="2-D .* weight with row grouping"):
        linear(torch.randn(2, 64), fpq.quantize(torch.randn(64), "e4m3", 8, grouping="flat"))
    with pytest.raises(TypeError, match="qt must be a ds_fpquant.QuantizedTensor"):
        linear(torch.randn(2, 16), torch.randn(4, 16))


def test_fpquantizedlinear_forward_uses_the_fused_op(monkeypatch):
    """On CPU tensors the forward never dequantizes the whole weight (no-grad inference)."""
    layer = FPQuantizedLinear.from_linear(torch.nn.Linear(64, 32), "e2m1", 32)
    x = torch.randn(2, 64)
    expected = layer(x)

    def no_full_dequantize(*args, **kwargs):
        raise AssertionError("forward dequantized the whole weight")

    monkeypatch.setattr(linear_module, "dequantize", no_full_dequantize)
    with torch.no_grad():
        for m in (1, SMALL_M[torch.float32] + 1):
            xm = torch.randn(m, 64)
            _check(xm, layer.quantized_weight, layer.bias, layer(xm))
        assert torch.equal(layer(x), expected)  # the same call again: the same bits


def test_weight_without_rows():
    for qt in (fpq.quantize(torch.randn(0, 16), "e4m3", 8), fpq.quantize(torch.randn(0, 16), "e4m3", block=(4, 8))):
        for m in (0, 3, 300):
            assert linear(torch.randn(m, 16), qt, torch.randn(0)).shape == (m, 0)


@pytest.mark.parametrize("m", [5, 300])
@pytest.mark.parametrize("fmt,value", [("e4m3", float("nan")), ("e5m2", float("inf")), ("e5m2", float("-inf"))])
def test_a_non_finite_weight_row_stays_in_its_feature(fmt, value, m):
    """K not a multiple of 32, bf16 panels: only the feature whose weight is NaN/Inf is affected (torch's
    bf16 W @ x^T leaked it into the neighbouring row)."""
    w = torch.ones(20, 65)
    w[1, 0] = value
    y = linear(torch.ones(m, 65).bfloat16(), fpq.quantize(w, fmt, 32))
    ref = linear(torch.ones(m, 65).bfloat16(), fpq.quantize(w, fmt, 32), backend="torch")
    # bits, not a bound: each finite feature sums 65 products 1 x w, w a bf16 weight (8 significant bits), and
    # every partial sum (at most 8 + 7 bits) is exact in fp32, so every summation order gives the same value
    assert_bitwise_equal(y[:, [0, 2]], ref[:, [0, 2]], "finite features")
    assert torch.equal(torch.isnan(y[:, 1]), torch.isnan(ref[:, 1])) and torch.equal(y[:, 1].isinf(), ref[:, 1].isinf())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [float("inf"), float("-nan"), 0.0])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2", "e2m1"])
def test_dequantize_of_given_odd_scales_matches_the_torch_backend(fmt, scale, dtype):
    """Scales from other tools (Inf, a negative NaN, 0): the CPU decoder writes the same bits as the torch
    backend, one NaN pattern included."""
    import dataclasses
    qt = fpq.quantize(torch.randn(3, 96), fmt, 32)
    odd = qt.scales.clone()
    odd[1, 1] = scale
    qt = dataclasses.replace(qt, scales=odd)
    assert_bitwise_equal(fpq.dequantize(qt, dtype, backend="cpu"), fpq.dequantize(qt, dtype, backend="torch"),
                         f"{fmt} scale {scale}")


def test_torch_backend_3d_strided_bf16_with_bias():
    qt = fpq.quantize(_weight(24, 64), "e4m3", 32)
    x = torch.randn(2, 64, 4).bfloat16().transpose(1, 2)  # (2, 4, 64), non-contiguous
    bias = torch.randn(24).bfloat16()
    _check(x.contiguous(), qt, bias, linear(x, qt, bias, backend="torch"))


def test_quantized_weight_stands_in_for_a_weight():
    """DeepSpeed's AutoTP forward shapes: matmul with .transpose(-1, -2), .t(), .T, .mT and F.linear run the
    fused op in the weight's (compute) dtype and return x's dtype; anything else sees the dequantized weight."""
    from ds_fpquant.linear.weights import QuantizedWeight

    qt = fpq.quantize(_weight(8, 32), "e4m3", 16)
    x = torch.randn(3, 32)
    for dtype in (torch.float32, torch.bfloat16):
        w = QuantizedWeight(qt, dtype)
        expected = linear(x.to(dtype), qt).to(x.dtype)
        for y in (torch.matmul(x, w.transpose(-1, -2)), x @ w.t(), x @ w.T, x @ w.mT,
                  torch.nn.functional.linear(x, w)):
            assert y.dtype == x.dtype and torch.equal(y, expected)  # each of them is that linear() call
        assert w.shape == (8, 32) and w.T.shape == (32, 8) and "QuantizedWeight" in repr(w)
        assert torch.equal(w + 0, fpq.dequantize(qt, dtype))


@pytest.mark.parametrize("m", [1, 300])
@pytest.mark.parametrize("fmt,kwargs", [("e4m3", {"group_size": 32}), ("e2m1", {"block": (8, 32)}), ("nvfp4", {})])
def test_codes_and_scales_of_any_strides(fmt, kwargs, m):
    """Issue 25: linear took only contiguous codes (its error showed the matching shapes, not the strides), while
    dequantize takes any: both take views now, with the same result as the contiguous weight."""
    import dataclasses

    qt = fpq.quantize(_weight(16, 64), fmt, kwargs.get("group_size"), block=kwargs.get("block"))
    codes = torch.empty(qt.codes.shape[0], 2 * qt.codes.shape[1], dtype=qt.codes.dtype)[:, ::2]
    scales = torch.empty(*qt.scales.shape[:-1], 2 * qt.scales.shape[-1], dtype=qt.scales.dtype)[..., ::2]
    codes.copy_(qt.codes)
    scales.copy_(qt.scales)
    strided = dataclasses.replace(qt, codes=codes, scales=scales)
    assert not codes.is_contiguous() and not scales.is_contiguous()
    x = torch.randn(m, 64)
    for backend in ("auto", "torch"):  # the same operands in the same kernel: the same bits
        assert torch.equal(linear(x, strided, backend=backend), linear(x, qt, backend=backend)), backend
    assert torch.equal(fpq.dequantize(strided), fpq.dequantize(qt))
