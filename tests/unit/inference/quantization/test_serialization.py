"""Issue 25: every module this project installs survives pickle, ``torch.save`` / ``torch.load`` of the whole
module (``weights_only=False``), ``copy.deepcopy``, ``state_dict`` -> fresh model -> ``load_state_dict``, and
``.to(dtype)``: the same codes and scales come back, and the copy runs the same calls (so the same bits).

Before: a model from ``apply`` / ``load_quantized`` pickled, then failed to unpickle (``save_pretrained`` was a
bound method stored on the instance), AutoTP-style layers held closures as hooks, and a quantized experts
module's forward was a bound method that unpickled as the class's dispatching forward."""

import copy
import io
import pickle

import pytest
import torch
from unit.moe_models import tiny_moe
from unit.tiny_models import assert_same_tensors, stored_tensors, tiny_gpt2

import ds_fpquant as fpq
from ds_fpquant.checkpoint.save_hook import QuantizedSavePretrained
from ds_fpquant.nn.experts import EagerExpertsForward
from ds_fpquant.nn.in_place import quantize_weight_in_place
from ds_fpquant.nn.quantized_params import quantized_experts

IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))


def _round_trips(model):
    """(how, copy) for each way a script keeps a whole model."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return [("pickle", pickle.loads(pickle.dumps(model))), ("torch.save", torch.load(buffer, weights_only=False)),
            ("deepcopy", copy.deepcopy(model))]


def _assert_same_model(again, model, how):
    assert_same_tensors(again, model, how)
    with torch.no_grad():  # the same modules and tensors: the same calls, the same bits
        assert torch.equal(again(IDS).logits, model(IDS).logits), how


MODELS = {
    "gpt2-e4m3": (tiny_gpt2, {"fmt": "e4m3", "group_size": 32}),
    "gpt2-nvfp4": (tiny_gpt2, {"fmt": "nvfp4"}),
    "gpt2-blocks-w8a8": (tiny_gpt2, {"fmt": "e4m3", "block": [128, 128], "activation": "e4m3"}),
    "mixtral-e2m1": (lambda: tiny_moe("mixtral"), {"fmt": "e2m1", "group_size": 16}),
    "deepseek_v3-mxfp4": (lambda: tiny_moe("deepseek_v3"), {"fmt": "mxfp4"}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_applied_models_pickle_save_and_copy(name):
    make, section = MODELS[name]
    model = fpq.apply(make(), {"fp_quantization": section})
    for how, again in _round_trips(model):
        _assert_same_model(again, model, how)
        assert isinstance(again.save_pretrained, QuantizedSavePretrained) and again.save_pretrained.model is again
        for module in again.modules():
            if quantized_experts(module):  # still the per-expert loop through the quantized linear
                assert isinstance(module.forward, EagerExpertsForward) and module.forward.module is module


def test_loaded_model_pickles_and_saves_again(tmp_path):
    src = tmp_path / "src"
    tiny_gpt2().save_pretrained(src)
    fpq.quantize_checkpoint(src, tmp_path / "q", "e2m1", group_size=16, progress=False)
    model = fpq.load_quantized(tmp_path / "q")
    for how, again in _round_trips(model):
        _assert_same_model(again, model, how)
    again = pickle.loads(pickle.dumps(model))
    assert again.save_pretrained.model is again
    with torch.no_grad():
        again.transformer.ln_f.weight.add_(1.0)  # now unlike the original: the saved files must be again's
    again.save_pretrained(tmp_path / "resaved")
    _assert_same_model(fpq.load_quantized(tmp_path / "resaved"), again, "resaved")


def test_init_inference_model_pickles():
    engine = fpq.init_inference(tiny_gpt2(), {"fp_quantization": {"fmt": "e3m2", "group_size": 32}, "dtype": torch.float32})
    for how, again in _round_trips(engine.module):
        _assert_same_model(again, engine.module, how)


@pytest.mark.parametrize("fmt,kwargs", [("e4m3", {"group_size": 16}), ("nvfp4", {}), ("e4m3", {"activation": "e4m3"})])
def test_autotp_style_layer_pickles(fmt, kwargs):
    """quantize_weight_in_place (AutoTP's LinearLayer / LinearAllreduce): the hooks are module-level functions."""
    layer = torch.nn.Linear(128, 8)
    quantize_weight_in_place(layer, fmt, kwargs.get("group_size"), activation=kwargs.get("activation"))
    x = torch.randn(3, 128)
    for how, again in _round_trips(layer):
        assert torch.equal(again.weight_codes, layer.weight_codes) and torch.equal(again.weight_scales, layer.weight_scales)
        assert again.weight is None and torch.equal(again(x), layer(x)), how
    fresh = torch.nn.Linear(128, 8)
    quantize_weight_in_place(fresh, fmt, kwargs.get("group_size"), activation=kwargs.get("activation"))
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.weight_codes, layer.weight_codes) and torch.equal(fresh(x), layer(x))
    codes = layer.weight_codes.clone()
    layer.to(torch.bfloat16)
    assert torch.equal(layer.weight_codes, codes) and layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["gpt2-e4m3", "mixtral-e2m1"])
def test_state_dict_into_a_fresh_model_and_dtype_casts(name):
    make, section = MODELS[name]
    model = fpq.apply(make(), {"fp_quantization": section})
    fresh = fpq.apply(make(), {"fp_quantization": section})
    with torch.no_grad():  # a fresh model with other weights, codes and scales: the state dict replaces them all
        for p in fresh.parameters():
            p.add_(1.0)
        for b in fresh.buffers():
            if b.dtype == torch.uint8:
                b.add_(1)
    fresh.load_state_dict(model.state_dict())
    _assert_same_model(fresh, model, "load_state_dict")
    quantized = {k: t.clone() for k, t in stored_tensors(model).items() if t.dtype == torch.uint8}
    model.to(torch.bfloat16)
    assert all(torch.equal(stored_tensors(model)[k], t) for k, t in quantized.items())  # codes and scales are bytes
    with torch.no_grad():
        out = model(IDS).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
