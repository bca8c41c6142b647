"""Static per-tensor W8A8 (SPEC 8.3): ``linear(x, qt, bias, activation="e4m3", input_scale=s)``. The activation
quantization is checked bit for bit against an oracle written from the convention with ml_dtypes (``fl(x / s)`` in
numpy fp32, saturated to +-448, ml_dtypes' RNE cast to ``float8_e4m3fn``; NaN and +-Inf give the NaN code), the
linear against the fp64 product of those activations and the exact weight within SPEC 8.2's bound."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from unit.linear_bound import EPS_OUT, TINY_OUT, exact_weight

import ds_fpquant as fpq
from ds_fpquant.linear import linear
from ds_fpquant.linear.w8a8 import static_quantize_activations
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

E4M3_MAX = 448.0


def oracle(x: torch.Tensor, s: float):
    """(codes uint8, x_hat fp32) of static per-tensor e4m3 quantization, from the convention with numpy / ml_dtypes."""
    x32 = x.float().numpy()
    s32 = np.float32(s)
    with np.errstate(over="ignore", invalid="ignore"):
        v = (x32 / s32).astype(np.float32)  # one IEEE fp32 division
    finite = np.isfinite(x32)
    v = np.where(finite, np.clip(v, -E4M3_MAX, E4M3_MAX), np.float32(0)).astype(np.float32)
    codes = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    sign = (np.signbit(x32).astype(np.uint8) << 7)
    codes = np.where(finite, codes, np.uint8(0x7F) | sign).astype(np.uint8)  # SPEC 3.3: NaN / Inf -> NaN code
    decoded = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return torch.from_numpy(codes), torch.from_numpy((decoded * s32).astype(np.float32))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    where = (a != b).nonzero()
    return f"first difference at {tuple(where[0].tolist())}: {a[tuple(where[0])]} vs {b[tuple(where[0])]}" if len(where) else ""


def _special_inputs(s: float) -> torch.Tensor:
    """Every e4m3 value and every midpoint between neighbours (ties), their neighbours in fp32, times ``s``; plus
    zeros, saturation, overflow of x / s, NaN and +-Inf."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = values[torch.isfinite(values)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    grid = torch.cat([finite, mids, torch.nextafter(mids, torch.tensor(math.inf)),
                      torch.nextafter(mids, torch.tensor(-math.inf))])
    extra = torch.tensor([0.0, -0.0, 448.0, 464.0, 480.0, 1e6, -1e6, 3e38, -3e38, math.nan, -math.nan, math.inf,
                          -math.inf, 2.0**-10, 2.0**-11, 3 * 2.0**-11, 2.0**-12])
    return torch.cat([grid * s, extra * s if s <= 1 else extra])


@pytest.mark.parametrize("s", [2.0**-3, 1.0, 0.0123, 7.3, 2.0**-130])
def test_activation_codes_are_the_oracle_bit_for_bit(s):
    x = _special_inputs(s)
    x = torch.cat([x, torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 200 * s])
    codes, x_hat = static_quantize_activations(x, torch.tensor(s, dtype=torch.float32))
    want_codes, want_hat = oracle(x, s)
    assert torch.equal(codes, want_codes), _first_difference(codes, want_codes)
    nan = torch.isnan(want_hat)  # NaN where the code is NaN (its payload bits are no part of the contract)
    assert torch.equal(torch.isnan(x_hat), nan)
    assert torch.equal(x_hat[~nan].view(torch.int32), want_hat[~nan].view(torch.int32)), \
        _first_difference(x_hat[~nan], want_hat[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_widen_exactly(dtype):
    x = (torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    s = torch.tensor(0.017)
    codes, x_hat = static_quantize_activations(x, s)
    want_codes, want_hat = oracle(x, s.item())
    assert torch.equal(codes, want_codes) and torch.equal(x_hat.view(torch.int32), want_hat.view(torch.int32))


def test_non_finite_inputs_give_nan_codes_and_saturation_keeps_sign():
    s = torch.tensor(0.5)
    codes, x_hat = static_quantize_activations(torch.tensor([math.nan, math.inf, -math.inf, 1e30, -1e30, -0.0]), s)
    assert codes.tolist() == [0x7F, 0x7F, 0xFF, 0x7E, 0xFE, 0x80]  # +-448 is 0x7E / 0xFE; -0 keeps its sign
    assert torch.isnan(x_hat[:3]).all() and x_hat[3:5].tolist() == [224.0, -224.0]


LAYOUTS = {"tensor": dict(granularity="tensor"), "channel": dict(granularity="channel"),
           "block128": dict(block=(128, 128)), "block32x16": dict(block=(32, 16)), "group32": dict(group_size=32)}


def _check_bound(x, x_hat, qt, bias, y):
    """``y`` against fp64 ``x_hat @ w^T + bias`` (w the exact weight, the bias rounded to x's dtype): each term meets at most
    K + 2 fp32 roundings (SPEC 8.2: product, K - 1 additions, group scale, bias) and x_hat is fp32 exactly as the
    oracle gives it; then one rounding to x's dtype."""
    w = exact_weight(qt)
    a = x_hat.double().reshape(-1, w.shape[1])
    ref = a @ w.T
    size = a.abs() @ w.abs().T
    if bias is not None:
        b = bias.to(x.dtype).double()  # SPEC 8.1: the bias rounded to x's dtype, on every path
        ref, size = ref + b, size + b.abs()
    k = w.shape[1]
    tol = 2 * (k + 2) * 2.0**-24 * size + EPS_OUT[x.dtype] * ref.abs() + TINY_OUT[x.dtype]
    y64 = y.double().reshape(ref.shape)
    assert torch.equal(torch.isnan(y64), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    err = (y64 - ref).abs()[finite]
    assert bool((err <= tol[finite]).all()), f"max error / bound {float((err / tol[finite]).max()):.3f}"
    assert y.dtype == x.dtype


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 40])
def test_static_linear_is_quantized_activations_times_the_weight(layout, dtype, m):
    g = torch.Generator().manual_seed(m)
    w, bias = torch.randn(96, 256, generator=g), torch.randn(96, generator=g)
    x = (torch.randn(m, 256, generator=g) * 3).to(dtype)
    s = torch.tensor(0.031)
    qt = fpq.quantize(w, "e4m3", **LAYOUTS[layout])
    y = linear(x, qt, bias, activation="e4m3", input_scale=s)
    _, x_hat = oracle(x, s.item())
    _check_bound(x, x_hat, qt, bias, y)
    assert not torch.equal(y, linear(x, qt, bias)), "the activations were not quantized"
    if m > 1:  # rows are independent: a NaN row stays in its row
        x2 = x.clone()
        x2[0, 5] = math.nan
        y2 = linear(x2, qt, bias, activation="e4m3", input_scale=s)
        assert torch.isnan(y2[0]).all() and not torch.isnan(y2[1:]).any()


def test_torch_backend_gives_the_same_bound():
    qt = fpq.quantize(torch.randn(32, 64), "e4m3", 32)
    x = torch.randn(2, 3, 64)
    y = linear(x, qt, activation="e4m3", input_scale=torch.tensor(0.01), backend="torch")
    assert y.shape == (2, 3, 32)
    _check_bound(x, oracle(x, 0.01)[1], qt, None, y)


@pytest.mark.parametrize("scale,error,message", [
    (0.5, TypeError, "input_scale must be a 0-dim float32 torch.Tensor, got float"),
    (torch.tensor([0.5]), ValueError, r"0-dim float32 tensor; got torch.float32 of shape \(1,\)"),
    (torch.tensor(0.5, dtype=torch.float64), ValueError, "got torch.float64"),
    (torch.tensor(0.0), ValueError, "input_scale=0.0 must be finite and > 0"),
    (torch.tensor(-1.0), ValueError, "input_scale=-1.0 must be finite and > 0"),
    (torch.tensor(math.inf), ValueError, "input_scale=inf must be finite"),
    (torch.tensor(math.nan), ValueError, "input_scale=nan must be finite"),
])
def test_bad_input_scales_are_refused(scale, error, message):
    qt = fpq.quantize(torch.randn(16, 64), "e4m3", 32)
    with pytest.raises(error, match=message):
        linear(torch.randn(2, 64), qt, activation="e4m3", input_scale=scale)
    with pytest.raises(error, match=message):
        FPQuantizedLinear(qt, None, activation="e4m3", input_scale=scale)


def test_input_scale_needs_activation_and_an_fp8_weight():
    qt = fpq.quantize(torch.randn(16, 64), "e4m3", 32)
    with pytest.raises(ValueError, match="input_scale is given but activation=None"):
        linear(torch.randn(2, 64), qt, input_scale=torch.tensor(1.0))
    for other in (fpq.quantize(torch.randn(16, 64), "e2m1", 32), fpq.quantize(torch.randn(16, 64), "mxfp8_e4m3"),
                  fpq.quantize(torch.randn(16, 64), "e5m2", 32)):
        with pytest.raises(ValueError, match="static W8A8 .* needs e4m3 weights with fp32 scales; got fmt="):
            linear(torch.randn(2, 64), other, activation="e4m3", input_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="input_scale is on meta; expected cpu"):
        linear(torch.randn(2, 64), qt, activation="e4m3", input_scale=torch.tensor(1.0, device="meta"))


def _layer(scale=0.02):
    torch.manual_seed(0)
    return FPQuantizedLinear.from_linear(torch.nn.Linear(64, 32), "e4m3", granularity="tensor", activation="e4m3",
                                         input_scale=torch.tensor(scale))


def test_layer_state_dict_and_dtype_casts():
    layer = _layer()
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), linear(x, layer.quantized_weight, layer.bias, activation="e4m3",
                                        input_scale=torch.tensor(0.02)))
    state = layer.state_dict()
    assert state["input_scale"].dtype == torch.float32 and state["input_scale"].dim() == 0
    other = _layer(0.5)
    other.load_state_dict(state)
    assert torch.equal(other.input_scale, torch.tensor(0.02)) and torch.equal(other(x), layer(x))
    layer.half()  # the scale keeps its fp32 bits
    assert layer.input_scale.dtype == torch.float32 and torch.equal(layer.input_scale, torch.tensor(0.02))
    dynamic = FPQuantizedLinear(fpq.quantize(torch.randn(32, 128), "e4m3", 128), None, activation="e4m3")
    with pytest.raises(ValueError, match="saved with a static input_scale; this module has none"):
        dynamic.load_state_dict({k: v for k, v in state.items() if k != "input_scale"}, strict=False)
    bad = dict(state, input_scale=torch.tensor(-1.0))
    with pytest.raises(ValueError, match="input_scale=-1.0 must be finite and > 0"):
        _layer().load_state_dict(bad)
    assert "input_scale=0.02" in repr(other)


def test_compiled_layer_and_backward():
    """``torch.compile(fullgraph=True)`` traces the custom op ``ds_fpquant::static_w8a8_linear``, whose body is the
    eager forward: the same calls on the same tensors, so the same bits. Backward passes the activation
    quantization straight through: the weight-only op's gradient, the same calls, the same bits."""
    layer = _layer()
    x = torch.randn(5, 64)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))
    xs, xw = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer(xs).sum().backward()
    linear(xw, layer.quantized_weight, layer.bias).sum().backward()
    assert torch.equal(xs.grad, xw.grad)


def test_static_opcheck_and_straight_through_backward():
    from ds_fpquant.linear import custom_ops

    qt = fpq.quantize(torch.randn(48, 256, generator=torch.Generator().manual_seed(2)), "e4m3", granularity="channel")
    codes, scales, tensor_scale, k, f, g, block, scale_format = custom_ops.as_op_args(qt)
    x = torch.randn(2, 3, 256, requires_grad=True)
    bias = torch.randn(48, requires_grad=True)
    s = torch.tensor(0.02)
    args = (x, codes, scales, tensor_scale, bias, s, k, f, g, block, scale_format, "auto")
    torch.library.opcheck(torch.ops.ds_fpquant.static_w8a8_linear.default, args)
    y = torch.ops.ds_fpquant.static_w8a8_linear(*args)
    assert torch.equal(y, linear(x, qt, bias, activation="e4m3", input_scale=s))  # linear() calls this op
    y.sum().backward()
    # the gradient of x is ones @ dequantize(qt): straight through the activation quantization
    w = fpq.dequantize(qt, torch.float32).double()
    exact = torch.ones(6, 48).double() @ w
    tol = 2 * 48 * 2.0**-24 * (torch.ones(6, 48).double() @ w.abs())
    assert bool(((x.grad.reshape(6, 256).double() - exact).abs() <= tol).all())
    assert torch.equal(bias.grad, torch.full((48,), 6.0))  # a sum of six ones: exact in any order


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_scaled_mm_arguments_hold_the_same_math(granularity):
    """The ``torch._scaled_mm`` call the CUDA path makes (tensorwise ``scale_a``; tensorwise or rowwise
    ``scale_b``), run where this torch has it on the CPU: ``s * w_s * sum(decode(c) * decode(q))`` in fp32, within
    SPEC 8.2's bound of the fp64 product of the exact activations ``decode(c) * s`` and the exact weight (exact
    products, K - 1 additions, at most two scale multiplications: K + 1 <= K + 2 roundings)."""
    from ds_fpquant.linear import w8a8
    from ds_fpquant.numerics.codec import decode
    from ds_fpquant.numerics.formats import get_format

    g = torch.Generator().manual_seed(5)
    qt = fpq.quantize(torch.randn(48, 256, generator=g), "e4m3", granularity=granularity)
    x, s = torch.randn(7, 256, generator=g) * 4, torch.tensor(0.013)
    codes, _ = static_quantize_activations(x, s)
    try:
        torch._scaled_mm(torch.zeros(16, 16, dtype=torch.float8_e4m3fn), torch.zeros(16, 16, dtype=torch.float8_e4m3fn).t(),
                         scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch has no CPU _scaled_mm: {exc}")
    y = w8a8._scaled_mm_tensorwise(codes, s, qt)
    assert y is not None and y.dtype == torch.float32
    x_exact = decode(codes.long(), get_format("e4m3")).double() * s.double()
    w = exact_weight(qt)
    ref, size = x_exact @ w.T, x_exact.abs() @ w.abs().T
    assert bool(((y.double() - ref).abs() <= 2 * (256 + 2) * 2.0**-24 * size).all())


def test_refused_state_dict_leaves_the_input_scale_alone():
    """A state dict whose input_scale is refused (SPEC 8.3: finite, > 0) does not overwrite the layer's scale."""
    import ds_fpquant as fpq
    from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

    layer = FPQuantizedLinear(fpq.quantize(torch.randn(64, 64), "e4m3", 128), None, activation="e4m3",
                              input_scale=torch.tensor(0.05))
    for bad in (torch.tensor(-1.0), torch.tensor(float("nan")), torch.tensor(0.0)):
        state = dict(layer.state_dict(), input_scale=bad)
        with pytest.raises(ValueError, match="input_scale"):
            layer.load_state_dict(state)
        assert layer.input_scale.item() == torch.tensor(0.05).item()
