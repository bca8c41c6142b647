"""NVIDIA ModelOpt checkpoints (``quant_method: "modelopt"``): a tiny random Llama quantized and exported by
nvidia-modelopt itself on CPU (``mtq.quantize`` with its FP8 / NVFP4 default configs and a calibration forward, then
``export_hf_checkpoint``), loaded with ``ds_fpquant.load_quantized``; every dequantized weight is compared with
ModelOpt's own dequantization (``FP8QTensor`` / ``NVFP4QTensor.dequantize``) bit for bit."""

import json
import shutil
import warnings

import pytest
import torch
from unit.moe_models import tiny_qwen3_moe
from unit.safetensors_files import read_tensors
from unit.tiny_models import tiny_llama

import ds_fpquant as fpq
from ds_fpquant.checkpoint.layouts.modelopt import read as layout_modelopt
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.nn.quantized_params import quantized_experts

mtq = pytest.importorskip("modelopt.torch.quantization")
export = pytest.importorskip("modelopt.torch.export")
qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")

ALGOS = {"FP8": "FP8_DEFAULT_CFG", "FP8_PER_CHANNEL_PER_TOKEN": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
         "NVFP4": "NVFP4_DEFAULT_CFG", "W4A16_NVFP4": "W4A16_NVFP4_CFG"}
#: the algos whose checkpoints carry static activation scales (input_scale); FP8's are applied (static W8A8),
#: NVFP4's (FP4 activations) recorded and warned
STATIC = ("FP8", "NVFP4")


def export_with_modelopt(model, cfg, path, vocab):
    model.config.architectures = [type(model).__name__]  # ModelOpt's export reads it
    ids = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(0))

    def calibrate(m):
        with torch.no_grad():
            m(ids)

    export.export_hf_checkpoint(mtq.quantize(model, getattr(mtq, cfg), calibrate), export_dir=path)
    return path


#: a Qwen3-MoE's expert parameters -> the per-expert checkpoint parts they stack (gate over up)
EXPERT_PARTS = [("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))]


def modelopt_expert_dequantize(tensors, base, e, parts, algo, dequantize, cols):
    """``dequantize`` (a ModelOpt oracle) of expert ``e``'s ``parts`` under ``base``, stacked: the matrix of a
    quantized expert stack, ``cols`` columns."""
    return torch.cat([dequantize(tensors, f"{base}.{e}.{p}", algo, (tensors[f"{base}.{e}.{p}.weight"].shape[0], cols))
                      for p in parts])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """quant_algo -> directory that ModelOpt's export wrote."""
    return {algo: export_with_modelopt(tiny_llama(), cfg, tmp_path_factory.mktemp(algo), 100)
            for algo, cfg in ALGOS.items()}


def modelopt_dequantize(tensors, base, algo, shape):
    """ModelOpt's own dequantization of one weight, fp32."""
    if algo.startswith("FP8"):
        scale = tensors[f"{base}.weight_scale"]
        return qtensor.FP8QTensor(torch.Size(shape), torch.float32, tensors[f"{base}.weight"]).dequantize(
            torch.float32, scale=scale if scale.dim() == 0 else scale.reshape(-1, 1))
    return qtensor.NVFP4QTensor(torch.Size(shape), torch.float32, tensors[f"{base}.weight"]).dequantize(
        torch.float32, scale=tensors[f"{base}.weight_scale"], double_scale=tensors[f"{base}.weight_scale_2"],
        block_sizes={-1: 16})


@pytest.mark.parametrize("algo", list(ALGOS))
def test_modelopt_export_loads_bit_exact(exported, algo):
    path = exported[algo]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "modelopt" and config["quant_algo"] == algo
    tensors = read_tensors(path)
    if algo not in STATIC:  # no input_scale, nothing to warn about
        assert not any(k.endswith(".input_scale") for k in tensors)
        with warnings.catch_warnings():
            warnings.simplefilter("error", layout_modelopt.StaticInputScaleWarning)
            model = fpq.load_quantized(path)
        assert not hasattr(model, "ds_fpquant_activation_scales")
    elif algo == "NVFP4":
        with pytest.warns(layout_modelopt.StaticInputScaleWarning, match="weight-only"):
            model = fpq.load_quantized(path)
    else:  # FP8: applied, not warned
        with warnings.catch_warnings():
            warnings.simplefilter("error", layout_modelopt.StaticInputScaleWarning)
            model = fpq.load_quantized(path)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FPQuantizedLinear)}
    assert len(layers) == 14 and type(model.lm_head) is torch.nn.Linear  # lm_head is in exclude_modules
    for name, layer in layers.items():
        ours = fpq.dequantize(layer.quantized_weight, torch.float32)
        theirs = modelopt_dequantize(tensors, name, algo, ours.shape)
        assert torch.equal(ours, theirs), name
        # bit for bit, but for the sign of zero: ModelOpt's e2m1 table decodes the code 0x8 as +0, SPEC 1 as -0
        nonzero = theirs != 0
        assert torch.equal(ours[nonzero].view(torch.int32), theirs[nonzero].view(torch.int32)), name
        if "NVFP4" in algo:
            assert torch.equal(layer.quantized_weight.tensor_scale, tensors[f"{name}.weight_scale_2"])
        if algo == "FP8_PER_CHANNEL_PER_TOKEN":
            assert layer.quantized_weight.block == (1, ours.shape[1])
        if algo in STATIC:
            assert torch.equal(model.ds_fpquant_activation_scales[name]["input_scale"], tensors[f"{name}.input_scale"]), name
        # FP8: static W8A8 with the stored scale (ModelOpt's export already shares it across q/k/v and gate/up,
        # so vLLM's max-of-shards changes nothing); NVFP4: weight-only
        assert layer.static == (algo == "FP8"), name
        if algo == "FP8":
            assert torch.equal(layer.input_scale, tensors[f"{name}.input_scale"]), name
    for name, tensor in model.state_dict().items():  # everything else as stored
        if name in tensors and not any(name.startswith(f"{n}.") for n in layers):
            assert torch.equal(tensor, tensors[name]), name


def test_modelopt_nvfp4_export_shares_tensor_scales_like_ds_fpquant(exported):
    """ModelOpt's export itself gives q/k/v and gate/up one weight_scale_2 (what SPEC 3.4's shared scale follows)."""
    tensors = read_tensors(exported["NVFP4"])
    for layer in range(2):
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parent = "self_attn" if "q_proj" in group else "mlp"
            scales = [tensors[f"model.layers.{layer}.{parent}.{p}.weight_scale_2"] for p in group]
            assert all(torch.equal(s, scales[0]) for s in scales)


def test_modelopt_config_errors(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W4A16_AWQ"}}))
    with pytest.raises(ValueError, match="quant_algo='W4A16_AWQ'; ds_fpquant reads FP8, FP8_PER_CHANNEL_PER_TOKEN, NVFP4, W4A16_NVFP4"):
        layout_modelopt.check_config({"quant_method": "modelopt"}, tmp_path)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4",
                                                                                 "group_size": 32}}))
    with pytest.raises(ValueError, match="group_size=32; NVFP4 has groups of 16"):
        layout_modelopt.check_config(None, tmp_path)
    config = layout_modelopt.check_config({"quant_method": "modelopt", "quant_algo": "FP8",
                                           "ignore": ["lm_head", "model.layers.*.mlp.gate"]}, tmp_path / "none")
    assert layout_modelopt.excluded("model.layers.3.mlp.gate", config)
    assert not layout_modelopt.excluded("model.layers.3.mlp.gate_proj", config)
    weight = torch.zeros(4, 32, dtype=torch.float8_e4m3fn)
    for parts, message in [({"weight": weight}, r"missing: \['m.weight_scale'\]"),
                           ({"weight": weight, "weight_scale": torch.tensor(0.0)}, "finite and > 0"),
                           ({"weight": weight, "weight_scale": torch.ones(3)}, r"float32 of shape \(\) or \(4,\)"),
                           ({"weight": weight, "weight_scale": torch.ones(()), "bias": torch.ones(4)}, "unexpected")]:
        with pytest.raises(ValueError, match=message):
            layout_modelopt.from_parts("m", parts, (4, 32), config, torch.float32)
    per_channel, _ = layout_modelopt.from_parts("m", {"weight": weight, "weight_scale": torch.arange(1.0, 5.0)},
                                                (4, 32), config, torch.float32)
    assert per_channel.block == (1, 32) and torch.equal(per_channel.scales, torch.arange(1.0, 5.0).reshape(4, 1))


def test_modelopt_nvfp4_qwen3_moe_experts_load_bit_exact(tmp_path):
    """ModelOpt's export of a Qwen3-MoE writes per-expert gate/up/down (one weight_scale_2 for an expert's gate and
    up) and excludes the router; ds_fpquant installs them as quantized expert stacks, each expert's matrix the
    ModelOpt dequantization of its parts stacked (gate over up)."""
    path = export_with_modelopt(tiny_qwen3_moe(), "NVFP4_DEFAULT_CFG", tmp_path / "moe", 97)
    tensors = read_tensors(path)
    with pytest.warns(layout_modelopt.StaticInputScaleWarning):
        model = fpq.load_quantized(path)
    experts = quantized_experts(model.model.layers[1].mlp.experts)
    assert set(experts) == {"gate_up_proj", "down_proj"}
    base = "model.layers.1.mlp.experts"
    for pname, parts in EXPERT_PARTS:
        for e, qt in enumerate(experts[pname]):
            ours = fpq.dequantize(qt, torch.float32)
            theirs = modelopt_expert_dequantize(tensors, base, e, parts, "NVFP4", modelopt_dequantize, ours.shape[1])
            nonzero = theirs != 0
            assert torch.equal(ours, theirs) and torch.equal(ours[nonzero].view(torch.int32),
                                                             theirs[nonzero].view(torch.int32)), (pname, e)
    assert type(model.model.layers[1].mlp.gate).__name__ != "FPQuantizedLinear"  # the router, excluded


def test_exclude_modules_that_contradict_the_files_are_refused(exported, tmp_path):
    path = shutil.copytree(exported["NVFP4"], tmp_path / "edited")
    hf = json.loads((path / "hf_quant_config.json").read_text())
    hf["quantization"]["exclude_modules"].append("model.layers.0.self_attn.*")
    (path / "hf_quant_config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"\['model.layers.0.self_attn.k_proj'.* are stored quantized but .* not converted"):
        fpq.load_quantized(path)
