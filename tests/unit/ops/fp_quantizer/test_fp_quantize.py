"""``FP_Quantize`` drop-in (docs/api.md, SPEC 6.1): buffer layout, meta tensors, selective dequantize."""

import copy
import pickle
import struct

import numpy as np
import pytest
import torch
from deepspeed.linear import QuantizationConfig
from unit.oracle import assert_bitwise_equal, bits_of, encode, pack_group, quantize_rows, to_numpy32

import ds_fpquant as fpq
from ds_fpquant import FP_Quantize

pytestmark = pytest.mark.usefixtures("quiet_fallback")

DS_FORMATS = [(8, 3, "e4m3"), (8, 2, "e5m2"), (6, 2, "e3m2"), (4, 1, "e2m1"), (12, 7, "e4m7")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _expected_buffer(x: torch.Tensor, fmt: str, g: int) -> np.ndarray:
    """SPEC 6.1 from the oracle: per group, its codes padded to ceil(G*b/8) bytes, then the LE fp32 scale."""
    flat = to_numpy32(x.reshape(1, -1))
    _, scales, _ = quantize_rows(flat, fmt, g)
    rows = []
    n = scales.shape[1]
    gbytes = (g * bits_of(fmt) + 7) // 8
    for j in range(n):
        chunk = flat[0, j * g:(j + 1) * g]
        codes = encode(chunk, np.full(chunk.shape, scales[0, j], np.float32), fmt)
        body = pack_group(codes, fmt).ljust(gbytes, b"\0")
        rows.append(body + struct.pack("<f", float(scales[0, j])))
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(n, gbytes + 4)


@pytest.mark.parametrize("q_bits,q_mantisa_bits,fmt", DS_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,group_size", [((4, 256), 128), ((3, 100), 64), ((7,), 512), ((2, 3, 5), 4)])
def test_buffer_layout_bytes(q_bits, q_mantisa_bits, fmt, dtype, shape, group_size):
    """Each row: the group's code bytes, then its little-endian fp32 scale; the tail is kept."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    q = FP_Quantize(group_size=group_size)
    buf = q.quantize(x, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    expected = _expected_buffer(x, fmt, group_size)
    assert buf.dtype == torch.uint8 and tuple(buf.shape) == expected.shape
    assert_bitwise_equal(buf, expected, "FP_Quantize buffer")
    y = q.dequantize(buf, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    assert y.dtype == dtype and y.shape == x.shape
    native = fpq.quantize(x, fmt, group_size, grouping="flat", backend="torch").dequantize()
    assert_bitwise_equal(y, native, "FP_Quantize dequantize vs native flat")


def test_both_constructors_and_config():
    assert FP_Quantize(QuantizationConfig(group_size=64)).group_size == 64
    assert FP_Quantize(group_size=32).group_size == 32
    assert FP_Quantize(16).group_size == 16
    assert FP_Quantize().group_size == 512
    with pytest.raises(ValueError, match="group_size=0"):
        FP_Quantize(group_size=0)
    with pytest.raises(TypeError, match="group_size must be an int"):
        FP_Quantize(group_size=2.5)
    with pytest.raises(TypeError, match="quantization_config"):
        FP_Quantize("512")


def test_is_a_deepspeed_quantizer():
    from deepspeed.ops.fp_quantizer import Quantizer
    assert isinstance(FP_Quantize(group_size=8), Quantizer)


@pytest.mark.parametrize("q_bits,q_mantisa_bits", [(8, 3), (8, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_meta_tensor_round_trip(q_bits, q_mantisa_bits, dtype):
    x = torch.randn(6, 50).to(dtype)
    q = FP_Quantize(group_size=64)
    buf = q.quantize(x, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    codes, scales = q.quantize(x, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits, return_meta_tensor=True)
    assert codes.shape == x.shape and codes.dtype == torch.uint8
    assert scales.shape == (5, 4) and scales.dtype == torch.uint8
    y_meta = q.dequantize(codes, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits, scale=scales)
    y_buf = q.dequantize(buf, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    assert_bitwise_equal(y_meta, y_buf, "meta vs buffer")
    # fp32 scales (e.g. from get_scales) are accepted too
    y_f32 = q.dequantize(codes, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits, scale=q.get_scales())
    assert_bitwise_equal(y_f32, y_buf, "fp32 scales")


def test_meta_tensor_needs_8_bits():
    with pytest.raises(ValueError, match="return_meta_tensor=True needs q_bits=8"):
        FP_Quantize(group_size=8).quantize(torch.randn(16), q_bits=4, q_mantisa_bits=1, return_meta_tensor=True)


def test_get_scales_owning_fp32():
    q = FP_Quantize(group_size=4)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 8.0, 0.0, 0.0, 0.0, 0.5])
    buf = q.quantize(x)
    s = q.get_scales()
    assert s.dtype == torch.float32 and s.shape == (3, 1)
    assert s[:, 0].tolist() == [np.float32(4.0) / np.float32(448.0), np.float32(8.0) / np.float32(448.0),
                                np.float32(0.5) / np.float32(448.0)]
    s.zero_()  # an owning copy: the buffer and the quantizer are untouched
    assert q.get_scales()[0, 0].item() != 0.0
    assert buf[0, 4:].contiguous().view(torch.float32).item() != 0.0


def test_no_tail_dropped():
    """DeepSpeed drops the last numel % G elements; here the short last group has its own scale."""
    x = torch.arange(1, 1030, dtype=torch.bfloat16)  # 1029 = 2 * 512 + 5
    q = FP_Quantize(group_size=512)
    buf = q.quantize(x)
    assert buf.shape == (3, 516)
    y = q.dequantize(buf)
    assert torch.allclose(y.float(), x.float(), rtol=2**-4, atol=0)
    assert buf[2, 5:512].eq(0).all()  # padding codes of the short group are zero


def test_group_larger_than_1536():
    x = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0))
    q = FP_Quantize(group_size=4096)
    y = q.dequantize(q.quantize(x))
    native = fpq.quantize(x, "e4m3", 4096, grouping="flat").dequantize()
    assert torch.equal(y, native)
    # e4m3 RNE: half an ulp (2^-4 relative) for normals, half the subnormal step 2^-9 * s below 2^-6 * s
    s = x[0].abs().max().item() / 448
    assert torch.allclose(y[0], x[0], rtol=2**-4, atol=2**-10 * s)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("q_bits,q_mantisa_bits,fmt", DS_FORMATS)
def test_selective_dequantize(index_dtype, q_bits, q_mantisa_bits, fmt):
    x = torch.randn(5, 12, 10, dtype=torch.bfloat16)  # 120 elements per expert: groups cross experts at G=64
    q = FP_Quantize(group_size=64)
    buf = q.quantize(x, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    full = q.dequantize(buf, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    idx = torch.tensor([4, 0, 2, 2], dtype=index_dtype)
    y = q.selective_dequantize(buf, idx, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    assert y.shape == (4, 12, 10) and y.dtype == torch.bfloat16
    assert_bitwise_equal(y.float(), full[idx.long()].float(), "selective")
    out = torch.empty(4, 12, 10, dtype=torch.float32)
    assert q.selective_dequantize(buf, idx, fp_out=out, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits) is out
    full32 = q.dequantize(buf, fp_out=torch.empty(5, 12, 10), q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    assert_bitwise_equal(out, full32[idx.long()], "selective into fp32 fp_out: rounded once, to fp32")


def test_selective_dequantize_bad_indexes():
    q = FP_Quantize(group_size=8)
    buf = q.quantize(torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"indexes must lie in \[0, 3\)"):
        q.selective_dequantize(buf, torch.tensor([3]))
    with pytest.raises(TypeError, match="indexes must be an int32 or int64"):
        q.selective_dequantize(buf, torch.tensor([0.0]))


def test_int8_buffer_and_external_orig_shape():
    x = torch.randn(4, 33, dtype=torch.float16)
    q = FP_Quantize(group_size=32)
    buf = q.quantize(x, q_bits=6, q_mantisa_bits=2)
    expected = q.dequantize(buf, q_bits=6, q_mantisa_bits=2)
    fresh = FP_Quantize(group_size=32)  # e.g. after loading a checkpoint
    fresh.orig_shape, fresh.orig_dtype = x.shape, x.dtype
    y = fresh.dequantize(buf.view(torch.int8), q_bits=6, q_mantisa_bits=2)
    assert_bitwise_equal(y, expected, "int8 buffer, external orig_shape")


def test_fp_out_and_to_before_quantize():
    q = FP_Quantize(group_size=16)
    q.to("cpu")  # before any quantize: no error
    x = torch.randn(2, 40)
    buf = q.quantize(x)
    q.to(torch.float16)  # a dtype must not reinterpret the stored scale bytes
    out = torch.empty(80, dtype=torch.bfloat16)
    y = q.dequantize(buf, fp_out=out)
    assert y is out
    assert_bitwise_equal(out, q.dequantize(buf).to(torch.bfloat16).reshape(80), "fp_out")


def test_dequantize_without_shape_is_an_error():
    q = FP_Quantize(group_size=8)
    with pytest.raises(ValueError, match="call quantize"):
        q.dequantize(torch.zeros(1, 12, dtype=torch.uint8))


@pytest.mark.parametrize("q_bits,q_mantisa_bits", [(8, 4), (4, 2), (6, 1), (12, 4), (16, 7), (5, 2), (16, 3)])
def test_unsupported_bit_pairs_raise(q_bits, q_mantisa_bits):
    """No silent re-dispatch of a pair that names no format (DeepSpeed turns q_bits=4 with any mantissa
    into e2m1); only DeepSpeed's default 3 or the format's own mantissa bits are accepted."""
    with pytest.raises(ValueError, match=rf"\(q_bits, q_mantisa_bits\)=\({q_bits}, {q_mantisa_bits}\)"):
        FP_Quantize(group_size=8).quantize(torch.randn(8), q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)


def test_bad_input_dtype_and_buffer_shape():
    q = FP_Quantize(group_size=8)
    with pytest.raises(TypeError, match=r"input.dtype=torch.float64"):
        q.quantize(torch.randn(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        q.quantize([1.0, 2.0])
    buf = q.quantize(torch.randn(16))
    with pytest.raises(ValueError, match=r"input_q has shape \(2, 11\); expected \(2, 12\)"):
        q.dequantize(buf[:, :11])
    with pytest.raises(TypeError, match="input_q.dtype=torch.float32"):
        q.dequantize(buf.float())


def test_deepcopy_and_pickle():
    q = FP_Quantize(group_size=8)
    buf = q.quantize(torch.randn(3, 8))
    for clone in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
        assert torch.equal(clone.dequantize(buf), q.dequantize(buf))
