"""DeepSpeed's ``tests/unit/linear/test_linear.py`` scenarios (``OptimizedLinear`` with and without
LoRA, quantized), run with ds_fpquant's quantizer through ``patch_deepspeed`` (written anew)."""

import pytest
import torch
from deepspeed.linear import LoRAConfig, OptimizedLinear, QuantizationConfig

pytestmark = pytest.mark.usefixtures("patched")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(layer, batch=5, features=64):
    x = torch.rand(batch, features, dtype=torch.bfloat16, device=DEVICE)
    out = layer.to(DEVICE)(x)
    assert out.shape == (batch, 64) and torch.isfinite(out.float()).all()
    return out


def test_basic_linear():
    _check(OptimizedLinear(input_dim=64, output_dim=64, dtype=torch.bfloat16), batch=1)


@pytest.mark.parametrize("q_bits,mantissa_bits", [(8, 3), (6, 2), (4, 1)])
def test_quant_linear_matches_dequantized_weight(q_bits, mantissa_bits):
    torch.manual_seed(0)
    cfg = QuantizationConfig(q_bits=q_bits, mantissa_bits=mantissa_bits, group_size=64)
    layer = OptimizedLinear(input_dim=64, output_dim=64, quantization_config=cfg, dtype=torch.bfloat16)
    out = _check(layer)
    assert layer.weight.dtype == torch.uint8
    x = torch.rand(3, 64, dtype=torch.bfloat16, device=DEVICE)
    expected = torch.nn.functional.linear(x, layer.weight.dequantized(), layer.bias)
    # DeepSpeed's QuantizedLinear.forward is this F.linear call on the same operands: the same bits
    assert torch.equal(layer(x), expected) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("q_bits,mantissa_bits", [(8, 3), (6, 2)])
def test_lora_on_quantized_base(q_bits, mantissa_bits):
    lora = LoRAConfig(lora_r=16, lora_alpha=16, base_weight_sharding=1)
    cfg = QuantizationConfig(q_bits=q_bits, mantissa_bits=mantissa_bits, group_size=64)
    _check(OptimizedLinear(input_dim=64, output_dim=64, lora_config=lora, quantization_config=cfg,
                           dtype=torch.bfloat16))
