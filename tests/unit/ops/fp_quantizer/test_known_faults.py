"""Regressions: faults seen in FP quantizers (DeepSpeed's and this project's own), each with the
exact SPEC answer, on every backend available here."""

import dataclasses

import numpy as np
import pytest
import torch

import ds_fpquant as fpq
from ds_fpquant import FP_Quantize
from unit.oracle import assert_bitwise_equal

FORMATS = list(fpq.FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", [2**40, 10**30])
def test_group_size_far_above_numel_is_cheap_and_exact(target, fmt, group_size):
    """Any G >= 1 is legal (SPEC 2); G >= K means one group per row, with no G-sized work or memory."""
    x = torch.randn(4, 8)
    qt = fpq.quantize(x.to(target.device), fmt, group_size, backend=target.backend)
    ref = fpq.quantize(x, fmt, 8, backend="torch")
    assert_bitwise_equal(qt.codes, ref.codes, "codes")
    assert_bitwise_equal(qt.scales, ref.scales, "scales")
    assert_bitwise_equal(qt.dequantize(backend=target.backend), ref.dequantize(), "dequantized")


def test_numpy_integer_group_size():
    x = torch.randn(2, 64)
    assert torch.equal(fpq.quantize(x, "e4m3", np.int64(32)).codes, fpq.quantize(x, "e4m3", 32).codes)
    assert FP_Quantize(group_size=np.int32(16)).group_size == 16


@pytest.mark.parametrize("q_bits,q_mantisa_bits", [(8, 3), (6, 2), (4, 1), (12, 7)])
@pytest.mark.parametrize("group_size", [3, 5, 6, 7])
def test_fp_quantize_single_group_unaligned_scale(q_bits, q_mantisa_bits, group_size):
    """One group whose code bytes are not a multiple of 4: the scale bytes sit at an odd offset."""
    x = torch.randn(group_size)
    q = FP_Quantize(group_size=group_size)
    buf = q.quantize(x, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    y = q.dequantize(buf, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    fmt = {(8, 3): "e4m3", (6, 2): "e3m2", (4, 1): "e2m1", (12, 7): "e4m7"}[(q_bits, q_mantisa_bits)]
    assert_bitwise_equal(y, fpq.quantize(x, fmt, group_size, grouping="flat").dequantize(), "round trip")


def test_given_scales_non_contiguous_and_not_aliased(target):
    x = torch.randn(2, 12, device=target.device)
    scales = torch.full((3, 2), 0.05, device=target.device).t()  # (2, 3), non-contiguous
    qt = fpq.quantize(x, "e4m3", 4, backend=target.backend, scales=scales)
    ref = fpq.quantize(x.cpu(), "e4m3", 4, backend="torch", scales=scales.contiguous().cpu())
    assert_bitwise_equal(qt.codes, ref.codes, "codes with non-contiguous scales")
    scales.fill_(1.0)  # the caller's tensor is not the stored one
    assert qt.scales.eq(0.05).all()


def test_results_carry_no_autograd(target):
    x = torch.randn(4, 32, device=target.device, requires_grad=True)
    qt = fpq.quantize(x, "e4m3", 16, backend=target.backend)
    y = qt.dequantize(backend=target.backend)
    assert not qt.scales.requires_grad and not y.requires_grad and y.grad_fn is None


def test_cpu_kernel_ignores_flush_denormal():
    """SPEC 3.1: no flush-to-zero on any backend, even after torch.set_flush_denormal(True)."""
    x = torch.tensor([1e-40, -3e-41, 2.0**-140, 0.0])  # fp32 subnormals
    before = fpq.quantize(x, "e4m3", 4, backend="cpu", scales=torch.ones(1) * 2.0**-126)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        after = fpq.quantize(x, "e4m3", 4, backend="cpu", scales=torch.ones(1) * 2.0**-126)
        half = fpq.quantize(torch.tensor([2.0**-24, -(2.0**-20)], dtype=torch.float16), "e4m3", 2, backend="cpu")
    finally:
        torch.set_flush_denormal(False)
    assert_bitwise_equal(after.codes, before.codes, "codes under set_flush_denormal(True)")
    assert after.codes.tolist()[:3] != [0, 0x80, 0]
    half_ref = fpq.quantize(torch.tensor([2.0**-24, -(2.0**-20)], dtype=torch.float16), "e4m3", 2, backend="cpu")
    assert_bitwise_equal(half.codes, half_ref.codes, "fp16 subnormal input under set_flush_denormal(True)")


def test_fp_quantize_flags_must_be_bool():
    q = FP_Quantize(group_size=8)
    with pytest.raises(TypeError, match="return_meta_tensor must be a bool, got str"):
        q.quantize(torch.randn(8), return_meta_tensor="no")
    with pytest.raises(TypeError, match="stochastic_mode must be a bool, got NoneType"):
        q.quantize(torch.randn(8), stochastic_mode=None)
    assert isinstance(q.quantize(torch.randn(8), return_meta_tensor=0), torch.Tensor)


def test_fp_out_checked_before_work():
    q = FP_Quantize(group_size=8)
    buf = q.quantize(torch.randn(4, 8))
    with pytest.raises(ValueError, match="fp_out is on meta"):
        q.dequantize(buf, fp_out=torch.empty(32, device="meta"))
    with pytest.raises(ValueError, match="fp_out is on meta"):
        q.selective_dequantize(buf, torch.tensor([0]), fp_out=torch.empty(8, device="meta"))


def test_tampered_quantized_tensor_fields_are_named():
    qt = fpq.quantize(torch.randn(4, 8), "e4m3", 8)
    with pytest.raises(TypeError, match="qt.shape must be a tuple of ints"):
        dataclasses.replace(qt, shape=None).dequantize()
    with pytest.raises(TypeError, match="qt.dtype=None is not supported"):
        dataclasses.replace(qt, dtype=None).dequantize()
    with pytest.raises(ValueError, match="qt.scale_format='bogus' is not supported"):
        dataclasses.replace(qt, scale_format="bogus").dequantize()


def test_orig_shape_named():
    q = FP_Quantize(group_size=8)
    buf = q.quantize(torch.randn(4, 8))
    q.orig_shape = 8
    with pytest.raises(TypeError, match="orig_shape must be a tuple of ints"):
        q.dequantize(buf)


@pytest.mark.parametrize("fmt,shape", [("e4m3", ()), ("e5m2", ()), ("e2m1", (1,)), ("e4m7", (2,))])
def test_zero_dim_input_codes_shape(fmt, shape):
    """API.md: 8-bit codes have the input's shape, 0-d included."""
    qt = fpq.quantize(torch.tensor(1.5), fmt)
    assert tuple(qt.codes.shape) == shape and qt.dequantize().shape == ()
