"""Issue 25: a writer never drops a tensor silently. Every parameter and buffer of the model is written, or
tied (and listed in the summary), or the write is refused; ``save_quantized`` (``save_pretrained`` of a
quantized model) and ``quantize_checkpoint`` write the same tensors for the same model, and the saved model
loads back as the model that was saved. One tiny random model per family: dense (Llama), tied head (Llama
with tie_word_embeddings), GPT-2 (Conv1D, tied), MoE without expert biases (Mixtral) and with them (GPT-OSS,
whose ``gate_up_proj_bias`` / ``down_proj_bias`` were dropped by the writer before: every key starting with
``<quantized stack>_`` was skipped)."""

import copy

import pytest
import torch
import transformers
from unit.moe_models import tiny_moe
from unit.safetensors_files import read_tensors
from unit.tiny_models import tiny_gpt2, tiny_gpt_oss, tiny_llama

import ds_fpquant as fpq
from ds_fpquant.checkpoint import writer as checkpoint
from ds_fpquant.nn.quantized_params import quantized_experts

IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(5))


#: family -> (model, quantize_checkpoint settings, whether both writers name every tensor alike)
FAMILIES = {
    "dense": (tiny_llama, {"fmt": "e4m3", "block": (32, 32)}, True),
    "tied-head": (lambda: tiny_llama(tie=True), {"fmt": "e2m1", "group_size": 16}, True),
    "gpt2-conv1d": (tiny_gpt2, {"fmt": "e3m2", "group_size": 32}, True),
    # the router: the command keeps the release's key (block_sparse_moe.gate), save_quantized the model's (mlp.gate)
    "moe": (lambda: tiny_moe("mixtral"), {"fmt": "e4m3", "block": (8, 32)}, False),
    "moe-expert-biases": (tiny_gpt_oss, {"fmt": "e4m3", "group_size": 32}, True),
}


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _quantized_keys(model):
    """The state-dict keys that the quantized parts' own tensors hold (written as codes + scales)."""
    keys = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, fpq.FPQuantizedLinear):
            keys |= {f"{prefix}{k}" for k in ("weight_codes", "weight_scales", "weight_tensor_scale", "_extra_state")}
        for pname in quantized_experts(module):
            keys |= {f"{prefix}{pname}_{k}" for k in ("codes", "scales", "tensor_scale")}
    return keys


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_tensor_is_written_tied_or_refused(family, tmp_path):
    make, settings, same_names = FAMILIES[family]
    model = make()
    model.save_pretrained(tmp_path / "src")
    section = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    quantized = fpq.apply(copy.deepcopy(model), {"fp_quantization": section})
    summary = checkpoint.save_quantized(quantized, tmp_path / "saved")
    files = read_tensors(tmp_path / "saved")
    quantized_keys = _quantized_keys(quantized)
    for key, tensor in quantized.state_dict().items():
        if key in quantized_keys:
            continue
        if key in summary["tied"]:  # written once, under the key it is tied to
            assert summary["tied"][key] in files, key
            continue
        assert key in files and torch.equal(_bytes(files[key]), _bytes(tensor)), f"{family}: {key} not written as held"
    loaded = fpq.load_quantized(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, quantized(IDS).logits)  # the same modules and calls
    checkpoint.quantize_checkpoint(tmp_path / "src", tmp_path / "cli", progress=False, allow_partial_blocks=True,
                                   **settings)
    cli = read_tensors(tmp_path / "cli")
    if same_names:  # both writers: the same tensors, byte for byte
        assert cli.keys() == files.keys(), sorted(cli.keys() ^ files.keys())
    shared = cli.keys() & files.keys()
    assert len(shared) >= len(files) - 2
    assert all(torch.equal(_bytes(cli[k]), _bytes(files[k])) for k in shared), family



def _rewrite(directory, edit):
    from safetensors.torch import save_file

    path = directory / "model.safetensors"
    tensors = read_tensors(directory)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _as_gpt_oss_mxfp4(tensors):
    """The experts as gpt-oss releases store them (``*_blocks`` / ``*_scales`` bytes), without the
    quantization_config that says so."""
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(key)
        tensors[f"{key}_blocks"] = torch.zeros(w.shape[0], w.shape[2], w.shape[1] // 32, 16, dtype=torch.uint8)
        tensors[f"{key}_scales"] = torch.full((w.shape[0], w.shape[2], w.shape[1] // 32), 127, dtype=torch.uint8)


@pytest.mark.parametrize("edit,message", [
    (_as_gpt_oss_mxfp4, r"missing \['model\.layers\.0\.mlp\.experts\.gate_up_proj', 'model\.layers\.0\.mlp\.experts\."
                        r"down_proj'.*another quantized format"),
    (lambda t: t.pop("model.norm.weight"), r"missing \['model\.norm\.weight'\]"),
    (lambda t: t.update({"model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 32)}),
     r"other shapes \(stored, model\) \{'model\.layers\.1\.self_attn\.o_proj\.weight': \(\(64, 32\), \(64, 64\)\)\}"),
])
def test_a_source_that_does_not_fit_its_model_is_refused_before_writing(tmp_path, edit, message):
    """Issue 25: before, a gpt-oss source stored as *_blocks / *_scales was written with no expert weights
    (listed as kept) and its own load_quantized then refused the result."""
    tiny_gpt_oss().save_pretrained(tmp_path / "src")
    _rewrite(tmp_path / "src", edit)
    with pytest.raises(ValueError, match=message):
        checkpoint.quantize_checkpoint(tmp_path / "src", tmp_path / "q", "e4m3", progress=False)
    assert not (tmp_path / "q").exists()


def test_legacy_names_that_transformers_renames_are_found(tmp_path):
    """Old BERT checkpoints name LayerNorm weights gamma / beta (transformers' legacy renamings load them): the
    source fits its model, and the tensors are copied as stored."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128)
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "src")
    tensors = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): t
               for k, t in read_tensors(tmp_path / "src").items()}
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    summary = checkpoint.quantize_checkpoint(tmp_path / "src", tmp_path / "q", "e4m3", group_size=32, progress=False)
    written = read_tensors(tmp_path / "q")
    assert summary["quantized"] == 13 and "bert.embeddings.LayerNorm.gamma" in written


def test_quantize_while_loading_checks_the_source_first(tmp_path):
    """A linear weight of another shape loaded as a layer of other in_features before (and failed at the first
    forward); now the load is refused, naming it."""
    tiny_llama().save_pretrained(tmp_path / "src")
    _rewrite(tmp_path / "src", lambda t: t.update({"model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 32)}))
    with pytest.raises(ValueError, match=r"other shapes \(stored, model\) \{'model\.layers\.1\.self_attn\.o_proj"):
        fpq.load_quantized(tmp_path / "src", fp_quantization={"fmt": "e4m3"})
