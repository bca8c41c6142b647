"""Issue 29: compressed-tensors and AutoFP8 checkpoints load through ``ds_fpquant.load_quantized`` bit-identical to
their own library's dequantization. The compressed-tensors checkpoints are written by compressed-tensors 0.20.1
itself (``apply_quantization_config``, its ``calculate_qparams`` / ``generate_gparam`` for the scales,
``ModelCompressor.compress_model``); its ``decompress_model`` is the oracle."""

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ds_fpquant as fpq
from ds_fpquant.checkpoint.layouts import StaticActivationScalesWarning, UnsharedInputScalesWarning
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import tiny_llama, tiny_qwen3  # noqa: E402
from unit.safetensors_files import write_autofp8_checkpoint  # noqa: E402

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStrategy,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

MODELS = {"llama": tiny_llama, "qwen3": tiny_qwen3}


def _fp8(strategy, **extra):
    return QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False, **extra)


#: name -> (the scheme dict of compressed-tensors, the format its ModelCompressor writes)
SCHEMES = {
    "FP8": ("FP8", "float-quantized"),  # per-tensor weights, static per-tensor input_scale
    "FP8_DYNAMIC": ("FP8_DYNAMIC", "float-quantized"),  # per-channel (N, 1)
    "FP8_BLOCK": ("FP8_BLOCK", "float-quantized"),  # 128x128 (one block for these 64-wide matrices)
    "FP8_BLOCK_32x16": ({"weights": _fp8("block", block_structure=[32, 16])}, "naive-quantized"),
    "FP8_GROUP_32": ({"weights": _fp8("group", group_size=32)}, "naive-quantized"),
    "NVFP4A16": ("NVFP4A16", "nvfp4-pack-quantized"),
    "NVFP4": ("NVFP4", "nvfp4-pack-quantized"),  # plus input_global_scale (FP4 activations: recorded, not applied)
    "MXFP4": ("MXFP4", "mxfp4-pack-quantized"),
    "MXFP8": ("MXFP8", "mxfp8-quantized"),
    "MXFP6": ("MXFP6A16", "mxfp6-pack-quantized"),  # e2m3, four codes in three bytes: read as mxfp6_e2m3
}


def _scheme(name):
    spec, _ = SCHEMES[name]
    if isinstance(spec, str):
        return preset_name_to_scheme(spec, ["Linear"])
    return QuantizationScheme(targets=["Linear"], **spec)


def _min_max(w, args):
    if args.strategy == QuantizationStrategy.TENSOR:
        return w.amin(), w.amax()
    if args.strategy == QuantizationStrategy.CHANNEL:
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == QuantizationStrategy.BLOCK:
        br, bc = args.block_structure
        n, k = w.shape
        blocks = torch.nn.functional.pad(w, (0, -k % bc, 0, -n % br)).unflatten(0, (-1, br)).unflatten(-1, (-1, bc))
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    groups = w.unflatten(-1, (-1, args.group_size))
    return groups.amin(-1), groups.amax(-1)


def write_ct_checkpoint(model, scheme: str, out: Path, pow2_global: bool = False):
    """``model`` quantized, compressed and saved by compressed-tensors; returns its own decompression of every
    quantized weight (``{module: weight}``) and the stored input scales."""
    config = QuantizationConfig(config_groups={"group_0": _scheme(scheme)}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    inputs = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            qscheme = getattr(module, "quantization_scheme", None)
            if qscheme is None:
                continue
            w = module.weight.data
            global_scale = None
            if hasattr(module, "weight_global_scale"):
                global_scale = generate_gparam(w.amin(), w.amax())
                if pow2_global:  # a power of two: 1/g is exact, so ds_fpquant's nvfp4 holds it as is
                    global_scale = torch.exp2(torch.round(torch.log2(global_scale)))
                module.weight_global_scale.data.copy_(global_scale)
            scale, _ = calculate_qparams(*_min_max(w, qscheme.weights), qscheme.weights, global_scale=global_scale)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            for part in ("input_scale", "input_global_scale"):
                if hasattr(module, part):  # a static activation scale, as a calibration would set it
                    getattr(module, part).data.fill_(0.0123 * (1 + len(inputs)))
                    inputs.setdefault(name, {})[part] = getattr(module, part).data.clone()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    compressor.decompress_model(model)
    oracle = {name: module.weight.data.clone() for name, module in model.named_modules()
              if getattr(module, "quantization_scheme", None) is not None}
    return oracle, inputs


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _load(path, expect_activation_scales: bool, **kwargs):
    """``load_quantized(path, **kwargs)``, expecting one StaticActivationScalesWarning (scales it does not apply)
    or none."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fpq.load_quantized(path, **kwargs)
    static = [w for w in caught if issubclass(w.category, StaticActivationScalesWarning)]
    assert len(static) == (1 if expect_activation_scales else 0), [str(w.message) for w in caught]
    return model


def _layer_bound_check(layer: FPQuantizedLinear, w_ref: torch.Tensor):
    """The layer's output on fp32 inputs against ``x @ w_ref.T`` in fp64. ``w_ref`` is the library's weight,
    the fp32 dequantized value ``fl(decode(q) * s)`` rounded to bf16: so the two differ by at most
    ``2^-8 |w|`` per weight (bf16 rounding, relative 2^-9, on either side of the exact ``decode(q) * s``
    whose fp32 rounding adds 2^-24) plus the fp32 sums of SPEC 8.1 (``K * 2^-24`` of ``sum |x| |w|``)."""
    torch.manual_seed(1)
    x = torch.randn(5, layer.in_features)
    y = layer(x).double()
    ref = x.double() @ w_ref.double().T
    magnitude = x.double().abs() @ w_ref.double().abs().T
    bound = (2 ** -8 + (layer.in_features + 2) * 2 ** -24) * magnitude + 2 ** -24 * ref.abs() + 1e-30
    assert bool(((y - ref).abs() <= bound).all()), float(((y - ref).abs() / bound).max())


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_compressed_tensors_checkpoint_loads_bit_identical(tmp_path, kind, scheme):
    model = MODELS[kind]().to(torch.bfloat16)
    reference = MODELS[kind]().to(torch.bfloat16)
    oracle, inputs = write_ct_checkpoint(model, scheme, tmp_path / "ct")
    qconfig = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors" and qconfig["format"] == SCHEMES[scheme][1]
    # weight-only (activation=None) to compare the weights' products; FP8's static input_scale applied (the
    # default) is tests/unit/checkpoint/test_static_activation_checkpoints.py. NVFP4's input_global_scale (FP4
    # activations) is not applied either way: warned
    loaded = _load(tmp_path / "ct", expect_activation_scales=scheme == "NVFP4", activation=None)
    layers = {n: m for n, m in loaded.named_modules() if isinstance(m, FPQuantizedLinear)}
    assert sorted(layers) == sorted(oracle) and "lm_head" not in layers  # ignore=["lm_head"] kept full precision
    for name, weight in oracle.items():
        mine = fpq.dequantize(layers[name].quantized_weight, weight.dtype)
        assert torch.equal(_bits(mine), _bits(weight)), name
        _layer_bound_check(layers[name], weight)
    if not inputs:
        assert not hasattr(loaded, "ds_fpquant_activation_scales")
    for name, parts in inputs.items():  # recorded as stored (weight-only here)
        for part, value in parts.items():
            assert torch.equal(loaded.ds_fpquant_activation_scales[name][part], value)
    # the whole model: the same forward as the library's decompressed model, up to the linears' fp32 sums
    # (SPEC 8.1) against bf16 matmuls on bf16-rounded weights: a sanity bound (relative RMS 2^-5), not bits
    reference.load_state_dict({k: v for k, v in model.state_dict().items() if k in reference.state_dict()},
                              strict=False)
    for name, weight in oracle.items():
        reference.get_submodule(name).weight.data.copy_(weight)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = loaded(ids).logits.float(), reference(ids).logits.float()
    assert float((ours - theirs).norm() / theirs.norm()) < 2 ** -5


@pytest.mark.parametrize("pow2", [True, False])
def test_nvfp4_global_scale_is_a_divisor(tmp_path, pow2):
    """compressed-tensors divides the e4m3 group scale by ``weight_global_scale``: ``fl(decode(c) / g)``. With a
    power-of-two ``g`` that is ``decode(c) * t`` for ``t = 1/g`` exactly, and the weight is held as nvfp4; a
    ``g`` where some used code rounds otherwise is held as e2m1 with fp32 group scales: bit-identical both ways."""
    model = tiny_llama().to(torch.bfloat16)
    oracle, _ = write_ct_checkpoint(model, "NVFP4A16", tmp_path / "ct", pow2_global=pow2)
    loaded = _load(tmp_path / "ct", expect_activation_scales=False)
    fmts = set()
    for name, weight in oracle.items():
        qt = loaded.get_submodule(name).quantized_weight
        fmts.add(qt.fmt)
        assert torch.equal(_bits(fpq.dequantize(qt, weight.dtype)), _bits(weight)), name
    if pow2:
        assert fmts == {"nvfp4"}
    else:
        assert "e2m1" in fmts  # generate_gparam's 2688/amax: some used code scales differently through 1/g


def _edit_config(path: Path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit,message", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"), "weights.type='int'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "asymmetric"),
    (lambda q: q["config_groups"]["group_0"].update(format="pack-quantized"), "format='pack-quantized'"),
    (lambda q: q.update(quantization_status="frozen"), "quantization_status='frozen'"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    (lambda q: q.update(ignore=["re:.*q_proj"]), "stored quantized but .* not converted"),
    (lambda q: q["config_groups"]["group_0"].update(targets=["re:.*mlp.*"]), "no quantization_config.config_groups"),
])
def test_bad_compressed_tensors_configs_are_refused(tmp_path, edit, message):
    write_ct_checkpoint(tiny_llama().to(torch.bfloat16), "FP8_DYNAMIC", tmp_path / "ct")
    _edit_config(tmp_path / "ct", edit)
    with pytest.raises(ValueError, match=message):
        fpq.load_quantized(tmp_path / "ct")


def test_autofp8_per_tensor_checkpoint(tmp_path):
    """AutoFP8 / older transformers FP8: ``quant_method: "fp8"`` without ``weight_block_size``, e4m3 ``weight``,
    one fp32 ``weight_scale`` and a static ``input_scale`` (0-d): read as one block per matrix,
    ``w = fp32(q) * scale`` bit for bit; the input scales are recorded and applied (static W8A8, no warning), the
    largest of q/k/v's and of gate/up's as vLLM takes it."""
    out = tmp_path / "autofp8"
    inputs = {}
    state = write_autofp8_checkpoint(out, lambda name: inputs.setdefault(name, torch.tensor(0.01 + len(inputs) / 1024)))
    expected = {name: state[f"{name}.weight"].float() * state[f"{name}.weight_scale"] for name in inputs}
    with pytest.warns(UnsharedInputScalesWarning) as caught:  # every module got its own input_scale above
        loaded = fpq.load_quantized(out)
    assert not [w for w in caught if issubclass(w.category, StaticActivationScalesWarning)]
    for name, w in expected.items():
        layer = loaded.get_submodule(name)
        qt = layer.quantized_weight
        assert qt.block == tuple(w.shape) and qt.scales.shape == (1, 1)
        assert torch.equal(fpq.dequantize(qt, torch.float32).view(torch.int32), w.view(torch.int32)), name
        assert torch.equal(loaded.ds_fpquant_activation_scales[name]["input_scale"], inputs[name])
        parent, _, leaf = name.rpartition(".")
        group = [g for g in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) if leaf in g]
        shared = max(inputs[f"{parent}.{m}"] for m in group[0]) if group else inputs[name]
        assert layer.activation == "e4m3" and torch.equal(layer.input_scale, shared), name
    # a scale that is not one value is refused, naming the module
    bad = dict(state)
    bad["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(2)
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight_scale: a per-tensor FP8 scale is one"):
        fpq.load_quantized(out)
