"""CUDA op vs the torch reference, bit for bit (skipped without a CUDA device).

Shapes cover ragged rows, numel < G, empty tensors, non-contiguous input, misaligned base pointers
(slices at odd offsets), NaN/Inf/zero groups, non-default streams and selective dequantize.
"""

import os

import pytest
import torch
from unit.oracle import assert_bitwise_equal, fp8_values, special_input

import ds_fpquant as fpq

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FORMATS = list(fpq.FORMATS)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GROUP_SIZES = [1, 3, 32, 100, 128, 1536, 1537, 8192]


def _compare(x_cuda, fmt, group_size, grouping="row"):
    ref = fpq.quantize(x_cuda.cpu(), fmt, group_size, grouping=grouping, backend="torch")
    got = fpq.quantize(x_cuda, fmt, group_size, grouping=grouping, backend="cuda")
    what = f"{fmt} G={group_size} {x_cuda.dtype} {tuple(x_cuda.shape)}"
    assert_bitwise_equal(got.codes, ref.codes, what + " codes")
    assert_bitwise_equal(got.scales, ref.scales, what + " scales")
    for dtype in DTYPES:
        y_ref = fpq.dequantize(ref, dtype, backend="torch")
        y = fpq.dequantize(got, dtype, backend="cuda")
        assert y.device.type == "cuda"
        assert_bitwise_equal(y.float(), y_ref.float(), what + f" dequantized {dtype}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_kernel_matches_reference(fmt, dtype, group_size):
    for shape in [(3, 2 * group_size + 5), (1, max(group_size - 1, 1)), (4, 7, 33)]:
        x = special_input(shape, dtype, seed=group_size).cuda()
        _compare(x, fmt, group_size)
    _compare(special_input((5, 301), dtype, 1).cuda(), fmt, group_size, grouping="flat")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("offset", [1, 3, 5, 7])
def test_misaligned_and_non_contiguous(fmt, offset):
    base = special_input((4 * 1024 + 64,), torch.bfloat16, seed=offset).cuda()
    _compare(base[offset:offset + 4 * 1024].view(4, 1024), fmt, 128)  # odd element offset: no 16-byte alignment
    wide = special_input((64, 96), torch.float16, seed=offset).cuda()
    _compare(wide.t(), fmt, 32)  # transposed: quantized in logical order
    _compare(wide[:, offset:], fmt, 16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_and_tiny(fmt):
    for shape in [(0,), (0, 128), (3, 0), (1,), (1, 1)]:
        x = torch.randn(shape).cuda()
        got = fpq.quantize(x, fmt, 128, backend="cuda")
        assert got.dequantize(backend="cuda").shape == x.shape


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_hardware_fp8_conversion_as_emulated(fmt):
    """What the CPU emulation assumes of cvt.rn.satfinite (cuda_emulation.h): every value and every midpoint
    of neighbours (ties to even), beyond the largest finite value (saturates) and Inf, on the real F2FP."""
    values = fp8_values(fmt)
    x = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.tensor([1e30, -1e30, 3.4e38])]).view(1, -1)
    scales = torch.ones(1, 1)
    ref = fpq.quantize(x, fmt, x.shape[1], scales=scales, backend="torch")
    got = fpq.quantize(x.cuda(), fmt, x.shape[1], scales=scales.cuda(), backend="cuda")
    assert_bitwise_equal(got.codes, ref.codes, f"{fmt} codes of every value and midpoint")


def test_non_default_stream():
    x = special_input((64, 4096), torch.bfloat16, seed=9).cuda()
    ref = fpq.quantize(x.cpu(), "e4m3", 128, backend="torch")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.record_stream(stream)
        got = fpq.quantize(x, "e4m3", 128, backend="cuda")
        y = got.dequantize(backend="cuda")
    stream.synchronize()
    assert_bitwise_equal(got.codes, ref.codes, "codes on a side stream")
    assert_bitwise_equal(y.float(), ref.dequantize().float(), "dequantized on a side stream")


@pytest.mark.parametrize("q_bits,q_mantisa_bits", [(8, 3), (8, 2), (6, 2), (4, 1), (12, 7)])
def test_fp_quantize_selective_dequantize_cuda(q_bits, q_mantisa_bits):
    x = special_input((8, 16, 100), torch.bfloat16, seed=4)
    q_cpu, q_gpu = fpq.FP_Quantize(group_size=512), fpq.FP_Quantize(group_size=512)
    buf_cpu = q_cpu.quantize(x, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    buf_gpu = q_gpu.quantize(x.cuda(), q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    assert_bitwise_equal(buf_gpu, buf_cpu, "FP_Quantize buffer")
    idx = torch.tensor([7, 0, 3], dtype=torch.int64, device="cuda")
    y = q_gpu.selective_dequantize(buf_gpu, idx, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    y_ref = q_cpu.selective_dequantize(buf_cpu, idx.cpu().int(), q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    assert_bitwise_equal(y.float(), y_ref.float(), "selective dequantize")


@pytest.mark.skipif(os.environ.get("DS_FPQUANT_LARGE_TESTS") != "1", reason="set DS_FPQUANT_LARGE_TESTS=1 (needs ~20 GB)")
def test_more_than_2_31_elements():
    """64-bit indexing: a tensor of 2^31 + 3 * 128 + 5 elements; check the far end against the reference."""
    n = 2**31 + 3 * 128 + 5
    x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    got = fpq.quantize(x, "e4m3", 128, backend="cuda")
    tail = x[-(2 * 128 + 5 + 128 * 4):]  # starts at a group boundary (n - len(tail) is a multiple of 128)
    ref = fpq.quantize(tail.cpu(), "e4m3", 128, backend="torch")
    assert_bitwise_equal(got.codes[-tail.numel():], ref.codes, "codes past 2^31")
    assert_bitwise_equal(got.scales[-ref.scales.numel():], ref.scales, "scales past 2^31")
    y = got.dequantize(backend="cuda")
    assert_bitwise_equal(y[-tail.numel():].float(), ref.dequantize().float(), "dequantized past 2^31")
