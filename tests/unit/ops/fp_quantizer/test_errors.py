"""SPEC 7: invalid arguments raise ValueError / TypeError naming the parameter, value and allowed values."""

import pytest
import torch

import ds_fpquant as fpq

X = torch.randn(4, 16)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(fmt="fp8"), ValueError, r"fmt='fp8' is not supported; allowed: e4m3, e5m2, e3m2, e2m3, e2m1, e4m7"),
    (dict(fmt=None), TypeError, r"fmt must be a str"),
    (dict(group_size=0), ValueError, r"group_size=0 is not allowed; it must be an int >= 1"),
    (dict(group_size=-3), ValueError, r"group_size=-3"),
    (dict(group_size=2.0), TypeError, r"group_size must be an int >= 1, got float \(2.0\)"),
    (dict(group_size=True), TypeError, r"group_size must be an int"),
    (dict(grouping="col"), ValueError, r"grouping='col' is not supported; allowed: 'row', 'flat'"),
    (dict(scale_format="fp16"), ValueError, r"scale_format='fp16' is not supported; allowed: 'fp32', 'e8m0'"),
    (dict(rounding="up"), ValueError, r"rounding='up' is not supported; allowed: 'nearest', 'stochastic'"),
    (dict(backend="tpu"), ValueError, r"backend='tpu' is not supported; allowed: 'auto', 'cuda', 'cpu', 'torch'"),
    (dict(seed=1), ValueError, r"seed=1 is only allowed with rounding='stochastic'"),
    (dict(offset=-1), ValueError, r"offset=-1"),
    (dict(backend="cuda"), ValueError, r"backend='cuda' needs a cuda tensor; x is on cpu"),
    (dict(scale_rounding="floor"), ValueError, r"scale_rounding='floor' only applies to scale_format='e8m0'"),
    (dict(scales=torch.ones(4, 2, dtype=torch.float64)), TypeError, r"scales.dtype=torch.float64"),
    (dict(scales=torch.ones(4, 3)), ValueError, r"scales has shape \(4, 3\); expected \(4, 1\)"),
    (dict(scales=torch.zeros(4, 1)), ValueError, r"scales must be finite and >= 2\^-126"),
])
def test_quantize_bad_arguments(kwargs, exc, match):
    args = dict(fmt="e4m3", group_size=16)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        fpq.quantize(X, **args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8, torch.float8_e4m3fn])
def test_unsupported_input_dtype(dtype):
    with pytest.raises(TypeError, match=r"x.dtype=.* is not supported; allowed: torch.float32, torch.float16, "
                                        r"torch.bfloat16"):
        fpq.quantize(torch.zeros(4).to(dtype))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        fpq.quantize([1.0, 2.0])


def test_dequantize_bad_arguments():
    qt = fpq.quantize(X, "e2m1", 16, backend="torch")
    with pytest.raises(TypeError, match="qt must be a ds_fpquant.QuantizedTensor"):
        fpq.dequantize(X)
    with pytest.raises(TypeError, match=r"dtype=torch.float64 is not supported"):
        fpq.dequantize(qt, torch.float64)
    bad = fpq.QuantizedTensor(**{**qt.__dict__, "codes": qt.codes[:, :3]})
    with pytest.raises(ValueError, match=r"qt.codes has shape \(4, 3\); expected \(4, 8\)"):
        bad.dequantize()
    bad = fpq.QuantizedTensor(**{**qt.__dict__, "scales": qt.scales.half()})
    with pytest.raises(TypeError, match="qt.scales must be a float32 tensor"):
        bad.dequantize()
