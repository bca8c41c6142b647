"""DeepSpeed's ``tests/unit/linear/test_quant_param.py`` scenarios, run against ds_fpquant's
``FP_Quantize`` (written anew). DeepSpeed treats the CPU as the accelerator here, so parameters
really are quantized on CPU."""

import copy
import pickle

import pytest
import torch
from deepspeed.linear import QuantizationConfig
from deepspeed.linear.quantization import QuantizedParameter
from unit.oracle import assert_bitwise_equal

import ds_fpquant as fpq
from ds_fpquant import FP_Quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _param(data, q_bits=8, mantissa_bits=3, group_size=64):
    cfg = QuantizationConfig(q_bits=q_bits, mantissa_bits=mantissa_bits, group_size=group_size)
    return QuantizedParameter(data, quantization_config=cfg, quantizer=FP_Quantize(cfg))


def test_requires_grad():
    with pytest.raises(ValueError):
        QuantizedParameter(torch.rand(5, 5, dtype=torch.bfloat16), requires_grad=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("q_bits,mantissa_bits", [(8, 3), (8, 2), (6, 2), (4, 1), (12, 7)])
def test_move_to_accelerator_quantizes_exactly(dtype, q_bits, mantissa_bits):
    """Unlike DeepSpeed's op (bf16 only), every input dtype works; the dequantized weight is the SPEC's."""
    data = torch.rand(8, 24, dtype=dtype)
    qp = _param(data, q_bits, mantissa_bits).to(DEVICE)
    assert qp.dtype == torch.uint8 and qp.device.type == DEVICE
    fmt = {(8, 3): "e4m3", (8, 2): "e5m2", (6, 2): "e3m2", (4, 1): "e2m1", (12, 7): "e4m7"}[(q_bits, mantissa_bits)]
    expected = fpq.quantize(data, fmt, 64, grouping="flat", backend="torch").dequantize()
    assert_bitwise_equal(qp.dequantized().cpu(), expected, "QuantizedParameter.dequantized()")


def test_hf_clone():
    qp = _param(torch.rand(5, 5, dtype=torch.bfloat16), q_bits=6, mantissa_bits=2).to(DEVICE)
    clone = QuantizedParameter(qp.data, **qp.__dict__)  # the Hugging Face clone pattern
    assert torch.equal(clone.data, qp.data) and clone.quantization_config == qp.quantization_config
    assert torch.equal(clone.dequantized(), qp.dequantized())


def test_deepcopy_and_pickle(patched):
    qp = _param(torch.rand(6, 40, dtype=torch.bfloat16)).to(DEVICE)
    for other in (copy.deepcopy(qp), pickle.loads(pickle.dumps(qp))):
        assert type(other) is QuantizedParameter
        assert torch.equal(other.dequantized(), qp.dequantized())


def test_patch_and_unpatch():
    import deepspeed.linear.quantization as ds_linear_quant
    original = ds_linear_quant.FP_Quantize
    fpq.patch_deepspeed()
    try:
        assert ds_linear_quant.FP_Quantize is FP_Quantize
        qp = QuantizedParameter(torch.rand(4, 8, dtype=torch.bfloat16))  # no quantizer=: DeepSpeed's name
        assert isinstance(qp.quantizer, FP_Quantize) and qp.dtype == torch.uint8
    finally:
        fpq.unpatch_deepspeed()
    assert ds_linear_quant.FP_Quantize is original
    assert "__reduce_ex__" not in QuantizedParameter.__dict__
