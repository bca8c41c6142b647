"""Issue 29: checkpoints whose activations are statically quantized per tensor in FP8 load as static W8A8 layers
(SPEC 8.3): compressed-tensors ``FP8`` (written by compressed-tensors 0.20.1 itself; its own ``quantize`` /
``dequantize`` of the activations is the oracle for the codes and ``x_hat``), ModelOpt ``FP8`` (exported by
nvidia-modelopt 0.47 itself; its input quantizer's output is compared within the derived difference of its
reciprocal scaling) and a hand-built AutoFP8 checkpoint; ``activation=None`` loads them weight-only; a static
model written by ``save_quantized`` shares each fused group's input scale and reads back to the same layers."""

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file
from unit.linear_bound import assert_product_within_bound, exact_weight
from unit.safetensors_files import read_tensors, write_autofp8_checkpoint
from unit.tiny_models import tiny_llama

import ds_fpquant as fpq
from ds_fpquant.checkpoint.layouts import StaticActivationScalesWarning, UnsharedInputScalesWarning
from ds_fpquant.linear import linear
from ds_fpquant.linear.w8a8 import static_quantize_activations
from ds_fpquant.nn.model_walk import FUSED_LINEARS
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.numerics.codec import decode
from ds_fpquant.numerics.formats import get_format


def _layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, FPQuantizedLinear)}


def _group_max(scales, name):
    """vLLM's input scale of the fused layer ``name`` belongs to: the largest of its shards' (or its own)."""
    parent, _, leaf = name.rpartition(".")
    group = next((g for g in FUSED_LINEARS if leaf in g), (leaf,))
    members = [f"{parent}.{m}" for m in group if f"{parent}.{m}" in scales]
    return torch.stack([scales[m].float().reshape(()) for m in members]).max()


def _check_static_layer(layer, x):
    """The layer's output against fp64 ``x_hat @ w^T + b`` (SPEC 8.2's bound with x_hat exact in fp32)."""
    _, x_hat = static_quantize_activations(x, layer.input_scale)
    y = layer(x)
    assert_product_within_bound(x_hat, exact_weight(layer.quantized_weight), layer.bias, y)
    assert not torch.equal(y, linear(x, layer.quantized_weight, layer.bias)), "the activations were not quantized"


def _load(path, **kwargs):
    """``load_quantized`` with every warning recorded: (model, warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fpq.load_quantized(path, **kwargs)
    return model, caught


def _of(caught, category):
    return [w for w in caught if issubclass(w.category, category)]


# ---- compressed-tensors FP8 ----

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402
from unit.checkpoint.test_compressed_tensors_layouts import write_ct_checkpoint  # noqa: E402


def test_compressed_tensors_fp8_static_input_scales_are_applied(tmp_path):
    model = tiny_llama().to(torch.bfloat16)
    _, inputs = write_ct_checkpoint(model, "FP8", tmp_path / "ct")
    qconfig = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    input_args = qconfig["config_groups"]["group_0"]["input_activations"]
    assert (input_args["type"], input_args["num_bits"], input_args["strategy"], input_args["dynamic"]) == \
        ("float", 8, "tensor", False)
    args = QuantizationArgs(**input_args)
    loaded, caught = _load(tmp_path / "ct")
    assert not _of(caught, StaticActivationScalesWarning)
    assert len(_of(caught, UnsharedInputScalesWarning)) == 4  # the test's scales differ: q/k/v and gate/up per layer
    stored = {name: parts["input_scale"] for name, parts in inputs.items()}
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)) * 2
    for name, layer in _layers(loaded).items():
        assert layer.activation == "e4m3" and layer.static, name
        assert torch.equal(layer.input_scale, _group_max(stored, name)), name  # vLLM's max of the fused shards
        assert torch.equal(loaded.ds_fpquant_activation_scales[name]["input_scale"], stored[name])  # as stored
        xi = x[:, :layer.in_features] if layer.in_features <= 64 else torch.randn(6, layer.in_features)
        codes, x_hat = static_quantize_activations(xi, layer.input_scale)
        # compressed-tensors' own activation quantization (fp32 x divided by the scale, clamp, cast to e4m3)
        theirs = ct_quantize(xi, scale=layer.input_scale, zero_point=None, args=args, dtype=torch.float8_e4m3fn)
        assert torch.equal(codes, theirs.view(torch.uint8)), name
        # and its dequantization in fp32 (the scale as fp32: its value, widened exactly)
        theirs_hat = ct_dequantize(theirs, scale=layer.input_scale, args=args, dtype=torch.float32)
        assert torch.equal(x_hat.view(torch.int32), theirs_hat.view(torch.int32)), name
        _check_static_layer(layer, xi)
    weight_only, caught = _load(tmp_path / "ct", activation=None)
    assert not _of(caught, StaticActivationScalesWarning) and not _of(caught, UnsharedInputScalesWarning)
    for name, layer in _layers(weight_only).items():
        assert layer.activation is None and not layer.static and layer.input_scale is None, name
        xi = torch.randn(3, layer.in_features)
        assert torch.equal(layer(xi), linear(xi, layer.quantized_weight, layer.bias)), name
    assert set(weight_only.ds_fpquant_activation_scales) == set(stored)  # still recorded


def test_load_quantized_activation_argument_is_checked(tmp_path):
    with pytest.raises(ValueError, match="activation='e4m3' is not supported; allowed: 'checkpoint'"):
        fpq.load_quantized(tmp_path, activation="e4m3")
    with pytest.raises(TypeError, match="activation must be a str, got int"):
        fpq.load_quantized(tmp_path, activation=1)


# ---- ModelOpt FP8 ----

mtq = pytest.importorskip("modelopt.torch.quantization")
export = pytest.importorskip("modelopt.torch.export")


def test_modelopt_fp8_static_input_scales_are_applied(tmp_path):
    """ModelOpt's quantizer fake-quantizes ``x`` as ``e4m3(x * fl(448 / amax)) * fl(1 / fl(448 / amax))`` (its
    ``_fp8_eager``); the exported ``input_scale`` is ``s = fl(amax / 448)`` and SPEC 8.3 divides by it. ``x * fl(448 /
    amax)`` and ``fl(x / s)`` differ by at most 3 fp32 roundings (relative 2^-22 together), so the e4m3 codes agree
    except where ``x / s`` lies within that of a rounding midpoint (then they are neighbours), and the dequantized
    values, where the codes agree, within 2 roundings plus the scales' (2^-21 relative)."""
    model = tiny_llama()
    model.config.architectures = [type(model).__name__]
    ids = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(0))

    def calibrate(m):
        with torch.no_grad():
            m(ids)

    quantized = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, calibrate)
    export.export_hf_checkpoint(quantized, export_dir=tmp_path / "mo")
    tensors = read_tensors(tmp_path / "mo")
    loaded, caught = _load(tmp_path / "mo")
    assert not _of(caught, StaticActivationScalesWarning) and not _of(caught, UnsharedInputScalesWarning)
    e4m3 = get_format("e4m3")
    layers = _layers(loaded)
    assert len(layers) == 14
    for name, layer in layers.items():
        assert layer.static and torch.equal(layer.input_scale, tensors[f"{name}.input_scale"]), name
        s = layer.input_scale
        x = torch.randn(8, layer.in_features, generator=torch.Generator().manual_seed(1)) * 3 * float(s) * 100
        codes, x_hat = static_quantize_activations(x, s)
        quantizer = quantized.get_submodule(name).input_quantizer
        with torch.no_grad():
            theirs = quantizer(x)
        v = x.double() / s.double()
        ours_v = decode(codes.long(), e4m3).double()
        near = (theirs.double() - x_hat.double()).abs() > 2.0**-21 * x_hat.double().abs()
        if bool(near.any()):  # neighbouring codes: x / s was within 2^-22 of the midpoint between them
            step = (theirs.double()[near] / s.double() - ours_v[near])
            mid = ours_v[near] + step / 2
            assert bool(((v[near] - mid).abs() <= 2.0**-21 * v[near].abs()).all()), name
        _check_static_layer(layer, x)
    weight_only, caught = _load(tmp_path / "mo", activation=None)
    assert not _of(caught, StaticActivationScalesWarning)
    assert not any(layer.static for layer in _layers(weight_only).values())


# ---- AutoFP8 (hand-built) and save_quantized ----

def test_autofp8_static_checkpoint(tmp_path):
    """One input scale per fused group (as calibrations give q/k/v, which see the same input): applied as stored,
    no warning; the codes are torch's own saturating e4m3 cast of ``x / s``; ``activation=None``: weight-only."""
    scales = {}

    def scale_of(name):
        parent, _, leaf = name.rpartition(".")
        fused = next((f"{parent}.{'_'.join(g)}" for g in FUSED_LINEARS if leaf in g), name)
        return scales.setdefault(fused, torch.tensor(0.004 * (1 + len(scales)))).clone()

    state = write_autofp8_checkpoint(tmp_path / "fp8", scale_of)
    loaded, caught = _load(tmp_path / "fp8")
    assert not _of(caught, StaticActivationScalesWarning) and not _of(caught, UnsharedInputScalesWarning)
    for name, layer in _layers(loaded).items():
        assert torch.equal(layer.input_scale, state[f"{name}.input_scale"]), name
        x = torch.randn(5, layer.in_features) * 0.3
        codes, _ = static_quantize_activations(x, layer.input_scale)
        torch_cast = (x / layer.input_scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(codes, torch_cast), name
        _check_static_layer(layer, x)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    weight_only, _ = _load(tmp_path / "fp8", activation=None)
    with torch.no_grad():
        a, b = loaded(ids).logits.float(), weight_only(ids).logits.float()
    assert not torch.equal(a, b)  # the static activation quantization changes the model's output
    # a static scale with a weight the static path does not take: refused, naming the module and the override
    bad = dict(state)
    bad["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].float().to(
        torch.float8_e5m2)
    save_file(bad, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: .*needs e4m3 weights.*activation=None"):
        fpq.load_quantized(tmp_path / "fp8")
    assert not _layers(fpq.load_quantized(tmp_path / "fp8", activation=None))["model.layers.0.mlp.down_proj"].static


def _static_model(granularity="tensor", only=None):
    """A tiny Llama quantized to e4m3 whose linears (those matching ``only``) run static W8A8 with distinct scales."""
    model = fpq.apply(tiny_llama(), {"fp_quantization": {"fmt": "e4m3", "granularity": granularity}})
    for i, (name, layer) in enumerate(sorted(_layers(model).items())):
        if only is not None and only not in name:
            continue
        static = FPQuantizedLinear(layer.quantized_weight, layer.bias, activation="e4m3",
                                   input_scale=torch.tensor(0.01 * (1 + i)))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, static)
    return model


@pytest.mark.parametrize("layout", [None, "compressed-tensors", "modelopt"])
def test_save_quantized_shares_fused_input_scales_and_reads_back(tmp_path, layout):
    model = _static_model()
    before = {name: layer.input_scale.clone() for name, layer in _layers(model).items()}
    fpq.save_quantized(model, tmp_path / "out", layout=layout)
    qconfig = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    if layout is None:
        assert qconfig["quant_method"] == "fp8" and qconfig["activation_scheme"] == "static"
    elif layout == "compressed-tensors":  # compressed-tensors' own FP8 preset: static per-tensor input activations
        from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

        group = QuantizationConfig.model_validate(qconfig).config_groups["group_0"]
        calibration = {"observer", "observer_kwargs"}  # how a scale was found, not what it means
        assert group.input_activations.model_dump(exclude=calibration) == \
            preset_name_to_scheme("FP8", ["Linear"]).input_activations.model_dump(exclude=calibration)
    else:  # ModelOpt's FP8: per-tensor weights, static per-tensor input_scale
        hf = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
        assert hf["quant_algo"] == qconfig["quant_algo"] == "FP8"
    tensors = read_tensors(tmp_path / "out")
    stored = {name: tensors[f"{name}.input_scale"].reshape(()) for name in before}
    for name in before:  # compressed-tensors stores a per-tensor scale as (1,), the others 0-dim
        value = tensors[f"{name}.input_scale"]
        assert value.dtype == torch.float32 and value.shape == ((1,) if layout == "compressed-tensors" else ()), name
    for name, value in stored.items():
        assert torch.equal(value, _group_max(before, name)), name  # the group's largest, shared
        assert torch.equal(_group_max(stored, name), value), name  # so vLLM's max of the shards changes nothing
    loaded, caught = _load(tmp_path / "out")
    assert not _of(caught, StaticActivationScalesWarning) and not _of(caught, UnsharedInputScalesWarning)
    layers = _layers(loaded)
    assert sorted(layers) == sorted(before)
    x = torch.randn(4, 64)
    for name, layer in layers.items():
        original = model.get_submodule(name)
        assert layer.static and torch.equal(layer.input_scale, stored[name]), name
        assert torch.equal(layer.quantized_weight.codes, original.quantized_weight.codes), name
        original.input_scale.copy_(stored[name])  # the shared scale: the same calls on the same tensors, same bits
        xi = x if layer.in_features == 64 else torch.randn(4, layer.in_features)
        assert torch.equal(layer(xi), original(xi)), name


@pytest.mark.parametrize("layout, granularity, only, message", [
    ("ds_fpquant", "tensor", None, "has no static activation scales"),
    ("modelopt", "channel", None, "quantizes activations dynamically"),
    ("compressed-tensors", "tensor", "self_attn", "one activation scheme for every quantized linear"),
    ("modelopt", "tensor", "self_attn", "one activation scheme for every quantized linear"),
])
def test_save_quantized_refuses_to_drop_static_input_scales(tmp_path, layout, granularity, only, message):
    """A layout that cannot describe the layers' static input scales is refused before anything is written: the
    scales are never dropped silently."""
    model = _static_model(granularity, only)
    with pytest.raises(ValueError, match=message):
        fpq.save_quantized(model, tmp_path / "out", layout=layout)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
