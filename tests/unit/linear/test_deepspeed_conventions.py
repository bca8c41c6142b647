"""DeepSpeed's and vLLM's own calling patterns for ``FP_Quantize``, run against ds_fpquant's drop-in.

DeepSpeed's ``FP_Quantize`` honours ``q_mantisa_bits`` only for ``q_bits=8``; for 12, 6 and 4 it uses
its fp12 / fp6 / fp4 whatever the mantissa bits (their default is 3). Its tests
(``tests/unit/ops/fp_quantizer/test_fp_quant.py``, ``tests/unit/linear/test_linear.py``,
``test_quant_param.py``) and vLLM's ``deepspeedfp`` method rely on that, so these scenarios (written
anew) call with the default mantissa bits and check the exact SPEC result.
"""

import copy

import pytest
import torch
from deepspeed.linear import LoRAConfig, OptimizedLinear, QuantizationConfig
from deepspeed.linear.quantization import QuantizedLinear, QuantizedParameter
from unit.oracle import assert_bitwise_equal

import ds_fpquant as fpq
from ds_fpquant import FP_Quantize
from ds_fpquant.integration import fp_quantizer as fp_quantizer_module

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: What DeepSpeed means by q_bits with its default q_mantisa_bits=3 (and with the format's own bits).
DEEPSPEED_DEFAULT = {8: "e4m3", 12: "e4m7", 6: "e3m2", 4: "e2m1"}
OWN_MANTISSA = {"e4m3": 3, "e4m7": 7, "e3m2": 2, "e2m1": 1}


def _reference(x, fmt, group_size):
    return fpq.quantize(x, fmt, group_size, grouping="flat", backend="torch")


def _buffer_reference(x, fmt, group_size):
    """SPEC 6.1 buffer of ``x`` built from the native reference: codes of each group, padded, then the fp32 scale."""
    qt = _reference(x, fmt, group_size)
    f = fpq.get_format(fmt)
    gbytes = -(-group_size * f.bits // 8)
    n = qt.scales.numel()
    codes = torch.zeros(n * gbytes, dtype=torch.uint8)
    codes[:qt.codes.numel()] = qt.codes
    return torch.cat([codes.view(n, gbytes), qt.scales.view(torch.uint8).view(n, 4)], dim=1)


# ---- FP_Quantize: q_bits with DeepSpeed's default mantissa bits --------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("q_bits", [8, 12, 6, 4])
def test_default_mantissa_bits_mean_deepspeeds_format(q_bits, dtype):
    """``quantize(x, q_bits=b)`` / ``dequantize(buf, q_bits=b)`` as DeepSpeed's test_fp_quant calls them."""
    torch.manual_seed(q_bits)
    x = torch.rand(4, 1024, dtype=dtype).to(DEVICE) * 4 - 2
    q = FP_Quantize(quantization_config=QuantizationConfig(group_size=128))
    buf = q.quantize(x, q_bits=q_bits)
    fmt = DEEPSPEED_DEFAULT[q_bits]
    assert_bitwise_equal(buf.cpu(), _buffer_reference(x.cpu(), fmt, 128), f"buffer of q_bits={q_bits}")
    y = q.dequantize(buf, q_bits=q_bits)
    assert y.dtype == dtype and y.shape == x.shape
    assert_bitwise_equal(y.cpu(), _reference(x.cpu(), fmt, 128).dequantize().reshape(x.shape), "dequantize")


@pytest.mark.parametrize("q_bits", [12, 6, 4])
def test_own_mantissa_bits_equal_the_default(q_bits):
    """(12, 7), (6, 2), (4, 1) name the same format as (12, 3), (6, 3), (4, 3)."""
    x = torch.randn(3, 100).to(DEVICE)
    q = FP_Quantize(group_size=64)
    own = OWN_MANTISSA[DEEPSPEED_DEFAULT[q_bits]]
    buf = q.quantize(x, q_bits=q_bits, q_mantisa_bits=own)
    assert torch.equal(buf, q.quantize(x, q_bits=q_bits))
    assert torch.equal(q.dequantize(buf, q_bits=q_bits), q.dequantize(buf, q_bits=q_bits, q_mantisa_bits=own))


@pytest.mark.parametrize("q_bits,q_mantisa_bits", [(12, 4), (12, 2), (6, 1), (6, 4), (4, 2), (4, 0), (8, 1), (8, 4)])
def test_other_mantissa_bits_are_an_error(q_bits, q_mantisa_bits):
    """Only DeepSpeed's default 3 or the format's own mantissa bits; the message names both numbers."""
    q = FP_Quantize(group_size=8)
    pattern = rf"\(q_bits, q_mantisa_bits\)=\({q_bits}, {q_mantisa_bits}\) is not supported; allowed: .*\(6, 3\) e3m2"
    with pytest.raises(ValueError, match=pattern):
        q.quantize(torch.randn(8), q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)
    buf = q.quantize(torch.randn(8))
    for call in (lambda: q.dequantize(buf, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits),
                 lambda: q.selective_dequantize(buf, torch.tensor([0]), q_bits=q_bits, q_mantisa_bits=q_mantisa_bits)):
        with pytest.raises(ValueError, match=pattern):
            call()


def test_meta_tensor_round_trip():
    """DeepSpeed's test_fp_quant_meta: ``return_meta_tensor=True`` then ``dequantize(codes, scale=meta)``."""
    config = QuantizationConfig()
    config.group_size = 128
    q = FP_Quantize(quantization_config=config)
    x = torch.rand(4, 1024, dtype=torch.bfloat16).to(DEVICE)
    codes, meta = q.quantize(x, q_bits=8, return_meta_tensor=True)
    y = q.dequantize(codes, q_bits=8, scale=meta)
    assert_bitwise_equal(y.cpu(), _reference(x.cpu(), "e4m3", 128).dequantize().reshape(x.shape), "meta round trip")


# ---- QuantizationConfig(q_bits=...) through QuantizedParameter, QuantizedLinear, OptimizedLinear ------


@pytest.mark.parametrize("q_bits", [8, 6, 12])
def test_quantized_parameter_with_default_mantissa_bits(q_bits):
    """DeepSpeed's test_quant_param: ``QuantizationConfig(q_bits=6)`` keeps ``mantissa_bits=3``."""
    cfg = QuantizationConfig(q_bits=q_bits, group_size=64)
    assert cfg.mantissa_bits == 3
    data = torch.rand(8, 24, dtype=torch.bfloat16)
    qp = QuantizedParameter(data, quantization_config=cfg, quantizer=FP_Quantize(cfg)).to(DEVICE)
    assert qp.dtype == torch.uint8
    expected = _reference(data, DEEPSPEED_DEFAULT[q_bits], 64).dequantize()
    assert_bitwise_equal(qp.dequantized().cpu(), expected, "QuantizedParameter.dequantized()")


@pytest.mark.parametrize("q_bits", [8, 6, 12])
def test_patched_quantized_parameter_and_deepcopy(q_bits, patched):
    """After patch_deepspeed, DeepSpeed builds its own quantizer from the config: ours, same bits."""
    cfg = QuantizationConfig(q_bits=q_bits, group_size=32)
    data = torch.randn(6, 40, dtype=torch.bfloat16)
    qp = QuantizedParameter(data, quantization_config=cfg).to(DEVICE)
    assert isinstance(qp.quantizer, FP_Quantize)
    expected = _reference(data, DEEPSPEED_DEFAULT[q_bits], 32).dequantize()
    assert_bitwise_equal(qp.dequantized().cpu(), expected, "patched QuantizedParameter")
    clone = copy.deepcopy(qp)
    assert type(clone) is QuantizedParameter and torch.equal(clone.dequantized(), qp.dequantized())


def test_wrong_mantissa_bits_in_the_config_are_an_error(patched):
    cfg = QuantizationConfig(q_bits=6, mantissa_bits=1)
    with pytest.raises(ValueError, match=r"\(q_bits, q_mantisa_bits\)=\(6, 1\) is not supported"):
        QuantizedParameter(torch.rand(5, 5, dtype=torch.bfloat16), quantization_config=cfg).to(DEVICE)


@pytest.mark.parametrize("q_bits", [8, 6, 12])
def test_quantized_linear_default_config(q_bits, patched):
    """DeepSpeed's TestQuantLinear: ``QuantizationConfig(q_bits=q_bits)``, bf16, forward = linear of the
    dequantized weight; the state dict round-trips into a fresh layer."""
    torch.manual_seed(0)
    cfg = QuantizationConfig(q_bits=q_bits)
    layer = OptimizedLinear(input_dim=64, output_dim=64, quantization_config=cfg, dtype=torch.bfloat16).to(DEVICE)
    assert isinstance(layer, QuantizedLinear) and layer.weight.dtype == torch.uint8
    x = torch.rand(5, 64, dtype=torch.bfloat16, device=DEVICE)
    out = layer(x)
    expected = torch.nn.functional.linear(x, layer.weight.dequantized(), layer.bias)
    # DeepSpeed's QuantizedLinear.forward is this F.linear call on the same operands: the same bits
    assert out.shape == (5, 64) and torch.equal(out, expected)
    state = layer.state_dict()
    fresh = OptimizedLinear(input_dim=64, output_dim=64, quantization_config=cfg, dtype=torch.bfloat16).to(DEVICE)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.weight.data, layer.weight.data)


@pytest.mark.parametrize("q_bits", [8, 6])
def test_lora_on_quantized_base_default_config(q_bits, patched):
    """DeepSpeed's TestOptimizedLinear (base_weight_sharding=1): LoRA trains over a frozen quantized base."""
    torch.manual_seed(0)
    lora = LoRAConfig(lora_r=16, lora_alpha=16, base_weight_sharding=1)
    cfg = QuantizationConfig(q_bits=q_bits)
    layer = OptimizedLinear(input_dim=64, output_dim=64, lora_config=lora, quantization_config=cfg,
                            dtype=torch.bfloat16).to(DEVICE)
    x = torch.rand(5, 64, dtype=torch.bfloat16, device=DEVICE)
    out = layer(x)
    assert out.shape == (5, 64) and torch.isfinite(out.float()).all()
    out.float().sum().backward()
    trained = [n for n, p in layer.named_parameters() if p.grad is not None]
    assert trained and all("lora" in n for n in trained)
    clone = copy.deepcopy(layer)
    assert torch.equal(clone(x), layer(x))  # a copy runs the same calls on the same tensors


# ---- selective_dequantize: only the chosen rows ------------------------------------------------


@pytest.mark.parametrize("shape,group_size", [((8, 1, 256), 128), ((6, 5, 7), 8), ((5, 33), 16), ((4, 10), 64),
                                              ((7, 3), 2), ((3, 4, 4), 1), ((9, 6), 6)])
@pytest.mark.parametrize("q_bits", [8, 6, 4, 12])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_selective_equals_rows_of_full_dequantize(shape, group_size, q_bits, index_dtype):
    """Bit-identical to the same rows of dequantize, with repeated and unsorted ids, group boundaries
    inside a row (R % G != 0) or not, a short last group, and the first and last rows."""
    torch.manual_seed(sum(shape) + q_bits)
    x = (torch.randn(shape) * torch.logspace(-3, 3, shape[0]).view(-1, *[1] * (len(shape) - 1))).to(DEVICE)
    q = FP_Quantize(group_size=group_size)
    buf = q.quantize(x, q_bits=q_bits)
    full = q.dequantize(buf, q_bits=q_bits)
    ids = torch.tensor([shape[0] - 1, 0, 2, 2, shape[0] - 1, 1], dtype=index_dtype)
    got = q.selective_dequantize(buf, ids, q_bits=q_bits)
    assert got.shape == (len(ids), *shape[1:]) and got.dtype == x.dtype
    assert_bitwise_equal(got.cpu(), full.index_select(0, ids.to(full.device).long()).cpu(), "selected rows")


def test_selective_meta_tensors_and_fp_out():
    q = FP_Quantize(group_size=12)
    x = torch.randn(5, 2, 9).to(DEVICE)  # R = 18: groups straddle the rows
    codes, meta = q.quantize(x, return_meta_tensor=True)
    full = q.dequantize(codes, scale=meta)
    ids = torch.tensor([4, 1, 4, 0])
    got = q.selective_dequantize(codes, ids, scale=meta)
    assert_bitwise_equal(got.cpu(), full[ids].cpu(), "meta selective")
    out = torch.empty(4 * 18, dtype=torch.bfloat16, device=DEVICE)
    assert q.selective_dequantize(codes, ids, fp_out=out, scale=meta) is out
    expected = fpq.dequantize(_reference(x.cpu(), "e4m3", 12), torch.bfloat16).reshape(5, 18)[ids]
    assert_bitwise_equal(out.cpu(), expected.reshape(-1), "fp_out rounds once, to its dtype")


def test_selective_of_nothing():
    q = FP_Quantize(group_size=8)
    buf = q.quantize(torch.randn(4, 3, 8).to(DEVICE))
    assert q.selective_dequantize(buf, torch.tensor([], dtype=torch.int64)).shape == (0, 3, 8)
    q0 = FP_Quantize(group_size=8)
    buf0 = q0.quantize(torch.randn(4, 0).to(DEVICE))
    assert q0.selective_dequantize(buf0, torch.tensor([3, 1])).shape == (2, 0)


@pytest.mark.parametrize("shape,group_size", [((64, 32, 32), 128), ((16, 10, 10), 64), ((16, 3, 7), 5)])
def test_selective_decodes_only_the_selected_groups(shape, group_size, monkeypatch):
    """The work is the selected rows' groups: the dequantize call sees at most ``k * (R + 2G)``
    elements, not the whole tensor (DeepSpeed's vLLM path calls this every MoE forward)."""
    seen = []
    real = fp_quantizer_module.dequantize

    def spy(qt, *args, **kwargs):
        seen.append(torch.Size(qt.shape).numel())
        return real(qt, *args, **kwargs)

    monkeypatch.setattr(fp_quantizer_module, "dequantize", spy)
    q = FP_Quantize(group_size=group_size)
    buf = q.quantize(torch.randn(shape).to(DEVICE), q_bits=6)
    ids = torch.tensor([5, 2])
    q.selective_dequantize(buf, ids, q_bits=6)
    r = shape[1] * shape[2]
    assert len(seen) == 1 and seen[0] <= len(ids) * (r + 2 * group_size), (seen, r)


# ---- vLLM's deepspeedfp method: int8 buffer, weight loader, top-k experts ----------------------


class _DeepSpeedFPParameter:
    """What vLLM's ``DeepSpeedFPParameter`` does with DeepSpeed's ``FP_Quantize`` (written anew): an int8
    ``[numel // G, G * bits / 8 + 4]`` buffer, ``orig_shape``/``orig_dtype`` set by hand, ``copy_`` of
    ``quantize(w, q_bits=bits)`` into it, dequantize with ``q_bits`` only."""

    def __init__(self, shape, dtype, bits, group_size):
        self.shape, self.bits = torch.Size(shape), bits
        self.data = torch.empty(self.shape.numel() // group_size, group_size * bits // 8 + 4, dtype=torch.int8,
                                device=DEVICE)
        self.fp_quantizer = FP_Quantize(group_size=group_size)
        self.fp_quantizer.orig_shape = self.shape
        self.fp_quantizer.orig_dtype = dtype

    def ds_quantize_(self, tensor):
        return self.data.copy_(self.fp_quantizer.quantize(tensor.data, q_bits=self.bits))

    def ds_dequantize(self, fp_out=None):
        return self.fp_quantizer.dequantize(self.data, fp_out=fp_out, q_bits=self.bits)

    def ds_selective_dequantize(self, indices, fp_out=None):
        return self.fp_quantizer.selective_dequantize(self.data, indices, fp_out=fp_out, q_bits=self.bits)

    def load_expert(self, expert, weight):
        """vLLM's ``quant_weight_loader``: dequantize, let the model's loader write one shard, re-quantize."""
        full = self.ds_dequantize()
        full[expert].copy_(weight)
        self.ds_quantize_(full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 6])
def test_vllm_deepspeedfp_moe(bits, dtype):
    torch.manual_seed(bits)
    experts, rows, cols, group_size = 8, 16, 64, 128
    w = (torch.randn(experts, rows, cols) * 0.05).to(dtype).to(DEVICE)
    param = _DeepSpeedFPParameter(w.shape, dtype, bits, group_size)
    param.ds_quantize_(w)
    fmt = DEEPSPEED_DEFAULT[bits]
    assert_bitwise_equal(param.data.view(torch.uint8).cpu(), _buffer_reference(w.cpu(), fmt, group_size),
                         "int8 buffer filled by copy_")
    # the weight loader writes expert 3 with new values; every other expert keeps its codes
    before = param.data.clone()
    new_expert = (torch.randn(rows, cols) * 0.05).to(dtype).to(DEVICE)
    param.load_expert(3, new_expert)
    w_loaded = param.ds_dequantize()
    per_expert = rows * cols // group_size
    changed = (param.data != before).any(dim=1).view(experts, per_expert).any(dim=1)
    assert changed.tolist() == [e == 3 for e in range(experts)]
    assert_bitwise_equal(w_loaded[3].cpu(), _reference(new_expert.cpu(), fmt, group_size).dequantize().reshape(rows, cols),
                         "loaded expert")
    # the MoE forward: top-k expert ids per token, decoded one by one
    top_k = torch.tensor([6, 3], dtype=torch.int32, device=DEVICE)
    chosen = param.ds_selective_dequantize(top_k)
    assert chosen.dtype == dtype and chosen.shape == (2, rows, cols)
    assert_bitwise_equal(chosen.cpu(), w_loaded[top_k.long()].cpu(), "top-k experts")
    out = torch.empty(2, rows, cols, dtype=dtype, device=DEVICE)
    assert param.ds_selective_dequantize(top_k, fp_out=out) is out and torch.equal(out, chosen)


@pytest.mark.parametrize("shape,group_size,q_bits", [((4, 5), 5, 8), ((4, 10), 10, 4), ((7,), 3, 6)])
def test_selective_single_group_with_unaligned_scale_bytes(shape, group_size, q_bits):
    """One selected group whose code bytes are not a multiple of 4: its scale bytes still read as fp32."""
    q = FP_Quantize(group_size=group_size)
    buf = q.quantize(torch.randn(shape).to(DEVICE), q_bits=q_bits)
    got = q.selective_dequantize(buf, torch.tensor([2]), q_bits=q_bits)
    assert_bitwise_equal(got.cpu(), q.dequantize(buf, q_bits=q_bits)[[2]].cpu(), "one selected group")


def test_selective_keeps_bf16_nan_bits():
    """Groups straddling the rows are cut by bits: a bf16 NaN stays the one pattern dequantize writes."""
    q = FP_Quantize(group_size=4)
    x = torch.randn(3, 5).bfloat16()
    x[1, 0] = float("inf")
    buf = q.quantize(x.to(DEVICE))
    got = q.selective_dequantize(buf, torch.tensor([1, 0]))
    assert_bitwise_equal(got.cpu(), q.dequantize(buf)[[1, 0]].cpu(), "bf16 NaN bits")


def test_selective_of_small_slices_decodes_once(monkeypatch):
    """Slices much smaller than a group: selecting many of them decodes the tensor once, not per slice."""
    seen = []
    real = fp_quantizer_module.dequantize
    monkeypatch.setattr(fp_quantizer_module, "dequantize", lambda qt, *a, **k: seen.append(qt.shape.numel()) or
                        real(qt, *a, **k))
    q = FP_Quantize(group_size=512)
    buf = q.quantize(torch.randn(2000, 3).to(DEVICE))
    ids = torch.arange(2000).flip(0)
    got = q.selective_dequantize(buf, ids)
    assert seen == [6000]
    assert_bitwise_equal(got.cpu(), q.dequantize(buf)[ids].cpu(), "all rows")


def test_selective_checks_the_buffer_even_for_an_empty_selection():
    q = FP_Quantize(group_size=8)
    q.quantize(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"input_q has shape \(1,\); expected \(4, 12\)"):
        q.selective_dequantize(torch.zeros(1, dtype=torch.uint8), torch.tensor([], dtype=torch.int64))
