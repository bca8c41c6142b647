"""Issue 45: ``AutoModelForCausalLM.from_pretrained`` of ds_fpquant checkpoints, quantizing while loading through
``quantization_config=DsFpQuantConfig(...)``, ``save_pretrained`` / ``dequantize`` of the result, and ``generate``,
``torch.compile`` and ``device_map`` on it: the same codes, scales and logits as ``ds_fpquant.load_quantized``."""

import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from unit.integration.hf_checkpoints import FORMATS, FP8_LAYOUT
from unit.tiny_models import assert_same_tensors

import ds_fpquant as fpq
from ds_fpquant import DsFpQuantConfig
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.nn.quantized_params import quantized_experts, quantized_params

IDS = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))

#: (model, format) pairs: every format on Llama, the MoE and Conv1D models on a few (CI time).
CASES = [("llama", fmt) for fmt in FORMATS] + [("qwen3_moe", "nvfp4"), ("qwen3_moe", "e4m3_128x128"),
                                               ("gpt2", "e2m1"), ("gpt2", "e4m3")]


def _from_pretrained(path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **kwargs)


def _assert_same_model(got, ref, what):
    """The same tensors (codes, scales, everything else: names, dtypes, bytes) and the same logits, bit for bit."""
    assert_same_tensors(got, ref, what)
    with torch.no_grad():
        assert torch.equal(got(IDS).logits, ref(IDS).logits), what


def _quantized_modules(model) -> int:
    return sum(isinstance(m, FPQuantizedLinear) or bool(quantized_params(m)) for m in model.modules())


@pytest.mark.parametrize("model,fmt", CASES)
def test_prequantized_checkpoint_is_load_quantized(checkpoints, model, fmt, caplog):
    path = checkpoints.quantized(model, fmt)
    reference = fpq.load_quantized(path)
    with caplog.at_level(logging.WARNING, logger="ds_fpquant.integration.hf.quantizer"):
        # block FP8 is transformers' own layout: ds_fpquant takes it when asked (and says so once)
        got = _from_pretrained(path, **({"quantization_config": DsFpQuantConfig()} if fmt in FP8_LAYOUT else {}))
    said = [r for r in caplog.records if "through ds_fpquant" in r.getMessage()]
    assert len(said) == (fmt in FP8_LAYOUT)
    assert _quantized_modules(got) == _quantized_modules(reference) > 0
    assert got.config.quantization_config.quant_method == "ds_fpquant" and got.is_quantized
    _assert_same_model(got, reference, f"{model} {fmt}")


def test_fp8_checkpoint_stays_transformers_by_default(checkpoints):
    got = _from_pretrained(checkpoints.quantized("llama", "e4m3_128x128"))
    # transformers' FP8 quantizer (on a CPU it dequantizes to bf16, its own choice), not ds_fpquant's layers
    assert not any(isinstance(m, FPQuantizedLinear) for m in got.modules())
    assert getattr(got, "quantization_method", "fp8") == "fp8"


@pytest.mark.parametrize("model,fmt", [("llama", "nvfp4"), ("llama", "e4m3_128x128"), ("qwen3_moe", "e2m1"),
                                       ("qwen3_moe", "mxfp4"), ("gpt2", "nvfp4"), ("gpt2", "e4m3")])
def test_quantize_while_loading_is_load_quantized(checkpoints, model, fmt):
    src = checkpoints.source(model)
    section = dict(FORMATS[fmt])
    reference = fpq.load_quantized(src, fp_quantization=section)
    got = _from_pretrained(src, quantization_config=DsFpQuantConfig(**section))
    assert _quantized_modules(got) == _quantized_modules(reference) > 0
    if model == "qwen3_moe":
        assert any(quantized_experts(m) for m in got.modules())
    _assert_same_model(got, reference, f"{model} {fmt}")


def test_quantize_while_loading_from_a_dict_with_patterns(checkpoints):
    src = checkpoints.source("llama")
    section = {"fmt": "e2m1", "group_size": 16, "modules": {"mlp": {"fmt": "mxfp4"}}, "exclude": ["lm_head", "o_proj"]}
    got = _from_pretrained(src, quantization_config={"quant_method": "ds_fpquant", **section})
    reference = fpq.load_quantized(src, fp_quantization=section)
    assert isinstance(got.model.layers[0].self_attn.o_proj, torch.nn.Linear)
    assert got.model.layers[0].mlp.up_proj.fmt == "mxfp4"
    _assert_same_model(got, reference, "patterns")


@pytest.mark.parametrize("model", ["llama", "qwen3_moe", "gpt2"])
def test_save_pretrained_round_trip_and_dequantize(checkpoints, model, tmp_path):
    src = checkpoints.source(model)
    got = _from_pretrained(src, quantization_config=DsFpQuantConfig(fmt="nvfp4"))
    got.save_pretrained(tmp_path / "saved")
    stored = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert stored["quant_method"] == "ds_fpquant" and stored["fmt"] == "nvfp4"
    again = _from_pretrained(tmp_path / "saved")
    _assert_same_model(again, got, f"{model} round trip")
    _assert_same_model(again, fpq.load_quantized(tmp_path / "saved"), f"{model} saved")
    quantized = {n: m.dequantized_weight() for n, m in again.named_modules() if isinstance(m, FPQuantizedLinear)}
    stacks = {(n, p): torch.stack([qt.dequantize(torch.bfloat16 if model == "llama" else torch.float32)
                                   for qt in qts]) for n, m in again.named_modules()
              for p, qts in quantized_experts(m).items()}
    plain = again.dequantize()
    assert not getattr(plain, "is_quantized", False) and not hasattr(plain.config, "quantization_config")
    for name, weight in quantized.items():
        layer = plain.get_submodule(name)
        assert type(layer) is torch.nn.Linear and torch.equal(layer.weight, weight), name
    for (name, pname), weight in stacks.items():
        assert torch.equal(getattr(plain.get_submodule(name), pname), weight), (name, pname)
    assert torch.isfinite(plain(IDS).logits).all()
    plain.save_pretrained(tmp_path / "plain")  # transformers' own save again: a full-precision checkpoint
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_generate_compile_and_device_maps(checkpoints):
    path = checkpoints.quantized("llama", "nvfp4")
    reference = fpq.load_quantized(path)
    got = _from_pretrained(path)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got.generate(IDS, **kwargs), reference.generate(IDS, **kwargs))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = got(IDS).logits
        # the traced graph run by eager kernels: the same calls as eager, the same bits
        assert torch.equal(torch.compile(got, backend="aot_eager", fullgraph=True)(IDS).logits, eager)
    torch._dynamo.reset()
    for device_map in ("auto", {"": "cpu"}, {"model": "cpu", "lm_head": "cpu"}):
        other = transformers.AutoModelForCausalLM.from_pretrained(path, device_map=device_map)
        _assert_same_model(other, reference, f"device_map={device_map}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_map_cuda(checkpoints):
    path = checkpoints.quantized("llama", "nvfp4")
    got = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cuda")
    reference = fpq.load_quantized(path).cuda()
    assert all(t.is_cuda for t in [*got.parameters(), *got.buffers()])
    _assert_same_model(got, reference, "cuda")


def test_unknown_field_or_format_refused_before_any_weight_is_read(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="fmtt"):
        DsFpQuantConfig(fmtt="e4m3")
    with pytest.raises(ValueError, match="e9m9"):
        DsFpQuantConfig(fmt="e9m9")
    broken = tmp_path / "broken"  # a checkpoint whose weights cannot be read: any read would fail differently
    broken.mkdir()
    (broken / "config.json").write_text((checkpoints.source("llama") / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    for config in ({"quant_method": "ds_fpquant", "fmt": "e9m9"}, {"quant_method": "ds_fpquant", "granularty": "x"}):
        with pytest.raises(ValueError, match="e9m9|granularty"):
            _from_pretrained(broken, quantization_config=config)


def test_mismatched_tensor_named(checkpoints, tmp_path):
    src = checkpoints.quantized("llama", "nvfp4")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj"):
        _from_pretrained(bad)


def test_import_registers_without_importing_transformers():
    import subprocess
    import sys

    code = ("import sys, ds_fpquant; assert 'transformers' not in sys.modules and 'peft' not in sys.modules; "
            "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as m; print(m['ds_fpquant'].__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "DsFpQuantHfQuantizer"
