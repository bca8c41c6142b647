"""W8A8 (opt-in ``activation="e4m3"``): activations quantized per token to e4m3 in 1x128 groups, times an
e4m3 weight with fp32 scales in groups of 128 or (128, 128) blocks. On the CPU it runs as the same math in
fp32 (the reference of what torch._scaled_mm computes on sm_90): checked against an fp64 product of the
dequantized activations and weight; the activation codes are this project's quantize (bit-exact on every
backend). The FP8 GEMM itself needs a GPU (test_cuda_linear.py)."""

import pytest
import torch
from unit.linear_bound import assert_linear_within_bound, matmul_within_bound

import ds_fpquant as fpq
from ds_fpquant.config import load_config
from ds_fpquant.integration import inference as integration
from ds_fpquant.linear import linear
from ds_fpquant.nn.in_place import quantize_weight_in_place
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear


def _activations(x):
    """What the W8A8 GEMM multiplies: x quantized per token to e4m3 in groups of 128, in fp32."""
    return fpq.dequantize(fpq.quantize(x, "e4m3", 128), torch.float32)


@pytest.mark.parametrize("layout", [{"group_size": 128}, {"block": (128, 128)}])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_w8a8_is_quantized_activations_times_the_weight(layout, m):
    w, x, bias = torch.randn(200, 384), torch.randn(m, 384) * 3, torch.randn(200)
    qt = fpq.quantize(w, "e4m3", **layout)
    y = linear(x, qt, bias, activation="e4m3")
    assert_linear_within_bound(_activations(x), qt, bias, y)
    assert not torch.equal(y, linear(x, qt, bias)), "the activations were not quantized"


def test_w8a8_bf16_activations_round_once():
    w, x = torch.randn(64, 256), torch.randn(3, 256).to(torch.bfloat16)
    qt = fpq.quantize(w, "e4m3", 128)
    y = linear(x, qt, activation="e4m3")
    xa, w = _activations(x), fpq.dequantize(qt, torch.float32)
    assert y.dtype == torch.bfloat16
    # fp32 sums of the dequantized activations times the weight (the summation bound), then one rounding to
    # bf16: 2^-8 of the value, or half bf16's smallest subnormal
    exact = xa.double() @ w.double().T
    matmul_within_bound(xa, w.T, y, extra=2.0**-8 * exact.abs() + 2.0**-134)


@pytest.mark.parametrize("kwargs", [dict(fmt="e2m1", group_size=128), dict(fmt="e4m3", group_size=64),
                                    dict(fmt="e4m3", group_size=128, scale_format="e8m0"),
                                    dict(fmt="e4m3", block=(64, 128)), dict(fmt="mxfp8_e4m3")])
def test_w8a8_refuses_other_weight_layouts(kwargs):
    fmt = kwargs.pop("fmt")
    qt = fpq.quantize(torch.randn(128, 256), fmt, **kwargs)
    with pytest.raises(ValueError, match="W8A8"):
        linear(torch.randn(2, 256), qt, activation="e4m3")
    with pytest.raises(ValueError, match="W8A8"):
        FPQuantizedLinear(qt, None, activation="e4m3")


def test_unknown_activation_is_refused():
    qt = fpq.quantize(torch.randn(16, 128), "e4m3", 128)
    with pytest.raises(ValueError, match="activation='e5m2'"):
        linear(torch.randn(2, 128), qt, activation="e5m2")
    with pytest.raises(TypeError, match="activation"):
        linear(torch.randn(2, 128), qt, activation=8)


def test_config_apply_and_autotp_hook_carry_the_activation():
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 256))
    x = torch.randn(4, 256)
    config = {"fp_quantization": {"fmt": "e4m3", "activation": "e4m3"}}
    q = integration.apply(model, config)
    assert all(m.activation == "e4m3" for m in q.modules() if isinstance(m, FPQuantizedLinear))
    first = q[0]
    assert torch.equal(first(x), linear(x, first.quantized_weight, first.bias, activation="e4m3"))  # its forward
    layer = torch.nn.Linear(256, 64)  # the AutoTP path: weight replaced by a QuantizedWeight around forward
    expected = linear(x, fpq.quantize(layer.weight.detach(), "e4m3", 128), layer.bias, activation="e4m3")
    quantize_weight_in_place(layer, "e4m3", 128, activation="e4m3")
    assert torch.equal(layer(x), expected)  # the hook's forward is that call
    with pytest.raises(Exception, match="W8A8"):
        load_config({"fp_quantization": {"fmt": "e4m3", "group_size": 32, "activation": "e4m3"}})
    with pytest.raises(Exception, match="W8A8"):
        load_config({"fp_quantization": {"fmt": "e4m3", "activation": "e4m3", "modules": {"0": {"fmt": "e2m1"}}}})


def test_w8a8_backward_passes_the_activation_quantization_straight_through():
    """Gradients flow (a residual branch beside the layer must not see a silently cut graph): d/dx is
    grad_y @ dequantize(W), as for the weight-only layer."""
    lin = torch.nn.Linear(256, 8)
    m = FPQuantizedLinear.from_linear(lin, activation="e4m3")
    x = torch.randn(3, 256, requires_grad=True)
    (m(x * 2) + x[:, :8]).sum().backward()
    w = fpq.dequantize(m.quantized_weight, torch.float32)
    # x.grad = fl(2 fl(ones @ W) + [1 on the first 8 columns]): the summation bound of the K = 8 matmul,
    # doubled (x 2 is exact), plus one rounding of the added branch (2^-24 of the result)
    ones = torch.ones(3, 8)
    exact = 2 * ones.double() @ w.double()
    exact[:, :8] += 1
    size = 2 * ones.double() @ w.double().abs()  # sum of |2 * 1 * w| per element
    tol = 2 * 8 * 2.0**-24 * size + 2.0**-24 * exact.abs()
    assert bool(((x.grad.double() - exact).abs() <= tol).all())
    assert m.bias.grad is None  # the module's bias is frozen


def test_state_dict_keeps_the_activation():
    lin = torch.nn.Linear(256, 8)
    w8a8, weight_only = (FPQuantizedLinear.from_linear(lin, activation=a) for a in ("e4m3", None))
    with pytest.raises(ValueError, match="activation"):
        weight_only.load_state_dict(w8a8.state_dict())
    with pytest.raises(ValueError, match="activation"):
        w8a8.load_state_dict(weight_only.state_dict())
    again = FPQuantizedLinear.from_linear(torch.nn.Linear(256, 8), activation="e4m3")
    again.load_state_dict(w8a8.state_dict())
    x = torch.randn(2, 256)
    assert torch.equal(again(x), w8a8(x))  # the same stored weight, the same calls
