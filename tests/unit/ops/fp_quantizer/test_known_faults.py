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


def test_bf16_nan_has_one_pattern_on_every_backend(target):
    """torch's own fp32->bf16 cast writes NaN as 0xFFFF on some CPUs; every backend writes 0x7FC0."""
    x = torch.tensor([[1.0, float("nan"), -2.0, 0.5]], dtype=torch.bfloat16, device=target.device)
    for fmt in ("e4m3", "e2m1"):  # a NaN code; a NaN group scale
        y = fpq.quantize(x, fmt, 4, backend=target.backend).dequantize(backend=target.backend)
        nan_bits = (y.view(torch.int16)[torch.isnan(y)].int() & 0xFFFF).unique().tolist()
        assert nan_bits == [0x7FC0], (fmt, [hex(b) for b in nan_bits])


def test_lazily_negated_input(target):
    z = torch.tensor([[1 + 2j], [3 - 4j]], dtype=torch.complex64)
    y = z.conj().imag  # logical [[-2.], [4.]], stored as [[2.], [-4.]] with the negative bit
    qt = fpq.quantize(y.to(target.device), "e4m3", 8, backend=target.backend)
    assert qt.dequantize(backend=target.backend).cpu().flatten().tolist() == [-2.0, 4.0]


def test_torch_backend_ignores_flush_denormal():
    x = torch.tensor([3e-39, 1e-40, 1e-41, 2e-39])
    expected = fpq.quantize(x, "e4m3", 4, backend="torch")
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = fpq.quantize(x, "e4m3", 4, backend="torch")
        y = got.dequantize(backend="torch")
        flushing_after = (torch.tensor([2.0**-140]) * torch.tensor([1.0])).item() == 0.0
    finally:
        torch.set_flush_denormal(False)
    assert_bitwise_equal(got.codes, expected.codes, "codes under set_flush_denormal(True)")
    assert_bitwise_equal(y, expected.dequantize(backend="torch"), "dequantized under set_flush_denormal(True)")
    assert flushing_after, "the caller's flush-denormal setting is restored"


def test_raw_op_huge_group_size_is_clamped():
    from ds_fpquant.backends import load_op
    module, reason = load_op("cpu")
    assert module is not None, reason
    x = torch.randn(4, 10)
    codes, scales = module.quantize(x, "e4m3", 2**63 - 1, None, False, 0, 0)
    ref = fpq.quantize(x, "e4m3", 10, backend="torch")
    assert torch.equal(codes, ref.codes) and torch.equal(scales, ref.scales)


@pytest.mark.parametrize("seed", [np.int8(5), np.uint64(2**64 - 1), 0])
def test_numpy_seed_same_on_backends(seed):
    x = torch.randn(64)
    a = fpq.quantize(x, "e2m1", 16, rounding="stochastic", seed=seed, backend="torch")
    b = fpq.quantize(x, "e2m1", 16, rounding="stochastic", seed=seed, backend="cpu")
    assert torch.equal(a.codes, b.codes)


@pytest.mark.parametrize("args", [["--sizes", "nan"], ["--sizes", "1e-9"], ["--sizes", "inf"], ["--device", "meta"],
                                  ["--json", "/nonexistent/dir/x.json"], ["--group-sizes", "0"]])
def test_bench_bad_arguments_exit_2(args):
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "ds_fpquant", "bench", *args], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
