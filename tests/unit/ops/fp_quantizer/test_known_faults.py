"""Regressions: faults seen in FP quantizers (DeepSpeed's and this project's own), each with the
exact SPEC answer, on every backend available here."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from unit.oracle import assert_bitwise_equal

import ds_fpquant as fpq
from ds_fpquant import FP_Quantize

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
    """docs/api.md: 8-bit codes have the input's shape, 0-d included."""
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
    from ds_fpquant.ops.backends import load_op
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


# ---- the fault classes of FP quantizers seen in the field, each with its exact SPEC answer ------


def _roundtrip(target, x, fmt, group_size, dtype=torch.float32, **kw):
    qt = fpq.quantize(x.to(target.device), fmt, group_size, backend=target.backend, **kw)
    return qt, qt.dequantize(dtype, backend=target.backend).cpu()


@pytest.mark.parametrize("fmt", FORMATS)
def test_fault_zero_inside_nonzero_group_stays_zero(target, fmt):
    """DeepSpeed decodes an exact 0 as 2*scale."""
    _, y = _roundtrip(target, torch.tensor([0.0, 3.0, -0.0, 1.5]), fmt, 4)
    assert y[0].item() == 0.0 and y[2].item() == 0.0 and torch.signbit(y[2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_fault_all_zero_group_scale_one(target, fmt):
    """DeepSpeed divides by amax = 0 and returns NaN."""
    qt, y = _roundtrip(target, torch.zeros(2, 8), fmt, 4)
    assert qt.scales.eq(1.0).all() and y.eq(0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_fault_tiny_amax_scale_floor(target, fmt):
    """amax a bf16 subnormal: fmax / amax overflows; the scale is floored at 2^-126 (SPEC 3.1)."""
    x = torch.tensor([2.0**-133, 0.0, -(2.0**-130), 2.0**-128]).to(torch.bfloat16)
    qt, y = _roundtrip(target, x, fmt, 4)
    assert qt.scales.item() == 2.0**-126 and torch.isfinite(y).all()


def test_fault_subnormal_codes_not_raised_to_min_normal(target):
    qt, y = _roundtrip(target, torch.tensor([2.0**-8, 3 * 2.0**-9, 2.0**-10]), "e4m3", 3, scales=torch.ones(1))
    assert qt.codes.tolist() == [2, 3, 0] and y.tolist() == [2.0**-8, 3 * 2.0**-9, 0.0]  # 2^-10 ties to 0


def test_fault_ties_to_even(target):
    """DeepSpeed rounds ties away from zero: 1.0625 is halfway between 1.0 and 1.125 in e4m3."""
    _, y = _roundtrip(target, torch.tensor([1.0625, -1.0625, 1.1875]), "e4m3", 3, scales=torch.ones(1))
    assert y.tolist() == [1.0, -1.0, 1.25]


@pytest.mark.parametrize("fmt", FORMATS)
def test_fault_group_max_is_fmax_never_nan(target, fmt):
    """DeepSpeed's e4m3 'max' of 480 is the NaN code in torch.float8_e4m3fn."""
    f = fpq.get_format(fmt)
    qt, y = _roundtrip(target, torch.tensor([[3.0, -7.0, 1.0, 0.5]]), fmt, 4)
    assert y[0, 1].item() == pytest.approx(-7.0, rel=2**-20) and torch.isfinite(y).all()
    if f.bits == 8:
        assert qt.codes[0, 1].item() == f.max_code | f.sign_bit


@pytest.mark.parametrize("fmt", FORMATS)
def test_fault_nan_inf_every_format(target, fmt):
    f = fpq.get_format(fmt)
    qt, y = _roundtrip(target, torch.tensor([1.0, float("nan"), -float("inf"), 2.0]), fmt, 4)
    if f.has_nan:
        assert math.isnan(y[1].item()) and (y[2].item() == -math.inf if f.has_inf else math.isnan(y[2].item()))
        assert y[0].item() == pytest.approx(1.0, rel=2**-f.mbits) and y[3].item() == pytest.approx(2.0, rel=2**-20)
    else:
        assert math.isnan(qt.scales.item()) and torch.isnan(y).all()  # the fault stays visible


def test_fault_e5m2_into_fp16_near_the_limit(target):
    qt, y16 = _roundtrip(target, torch.tensor([61440.0, 1.0]), "e5m2", 2, dtype=torch.float16)
    assert y16[0].item() == 61440.0  # 1.875 * 2^15: representable in both
    big = fpq.quantize(torch.tensor([57344.0 * 2, 1.0]).to(target.device), "e5m2", 2, backend=target.backend)
    assert big.dequantize(torch.float16, backend=target.backend)[0].item() == math.inf  # fp16 overflow gives Inf


@pytest.mark.parametrize("numel,group_size", [(10, 4), (3, 128), (1537, 1536), (5, 1), (4100, 2048), (70, 7)])
def test_fault_tails_and_odd_group_sizes(target, numel, group_size):
    """DeepSpeed drops numel % G elements, and launches nothing for G > 1536."""
    x = torch.arange(1, numel + 1, dtype=torch.float32)
    qt, y = _roundtrip(target, x, "e4m3", group_size)
    assert qt.scales.numel() == -(-numel // group_size) and y.shape == x.shape
    assert torch.allclose(y, x, rtol=2**-4, atol=0) and y[-1].item() == numel  # the tail's amax maps to fmax


def test_fault_transposed_input_logical_order(target):
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    qt_t, _ = _roundtrip(target, x.t(), "e4m3", 3)
    qt_c, _ = _roundtrip(target, x.t().contiguous(), "e4m3", 3)
    assert torch.equal(qt_t.codes, qt_c.codes) and torch.equal(qt_t.scales, qt_c.scales)


def test_fault_stochastic_rounding_unbiased(target):
    """DeepSpeed's 'stochastic' rounding is biased; here the mean of 10^4 draws is the value."""
    x = torch.full((10_000,), 1.0 + 0.125 / 3)  # a third of the way from 1.0 to 1.125 in e4m3
    _, y = _roundtrip(target, x, "e4m3", 10_000, rounding="stochastic", seed=11, scales=torch.ones(1))
    sigma = 0.125 * math.sqrt((1 / 3) * (2 / 3) / 10_000)
    assert abs(y.double().mean().item() - (1.0 + 0.125 / 3)) < 5 * sigma
