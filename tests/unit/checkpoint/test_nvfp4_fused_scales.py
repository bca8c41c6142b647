"""NVFP4 tensor scales shared across the layers serving engines fuse (SPEC 3.4).

vLLM and SGLang load q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (MoE experts' w1/w3 as
``w13``), with one per-tensor scale: the largest of the shards' ``weight_scale_2``, each shard's e4m3 group scales
unchanged. So every writer of ds_fpquant (``apply`` + ``save_quantized``, ``quantize_checkpoint``,
quantize-while-loading) gives each fused group one tensor scale, and the tests apply that max rule to the
checkpoint files and check that it changes no bit of any dequantized weight. Tiny random Llama and Qwen3-MoE
(a dense MLP layer and a MoE layer) from configs."""

import copy
import json
import warnings

import numpy as np
import pytest
import torch
from unit.moe_models import tiny_qwen3_moe
from unit.oracle import assert_bitwise_equal, code_values, quantize_nvfp4_rows
from unit.safetensors_files import read_tensors
from unit.tiny_models import tiny_llama

import ds_fpquant as fpq
from ds_fpquant.checkpoint import writer as checkpoint
from ds_fpquant.nn.model_walk import fused_groups, shared_scale_groups
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.tensor.quantize import nvfp4_shared_tensor_scale

E2M1 = torch.tensor(code_values("e2m1"), dtype=torch.float32)


MODELS = {"llama": tiny_llama, "qwen3_moe": tiny_qwen3_moe}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """kind -> (directory written by save_pretrained, the model)."""
    out = {}
    for kind, build in MODELS.items():
        model = build()
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = (path, model)
    return out


def checkpoint_groups(tensors):
    """The fused groups of a checkpoint's NVFP4 weights (by base name): dense q/k/v and gate/up, and each expert's
    gate/up (per-expert keys ``mlp.experts.{e}.gate_proj`` / ``up_proj``, siblings like a dense MLP's)."""
    bases = [k[:-len(".weight_scale_2")] for k in tensors if k.endswith(".weight_scale_2")]
    return fused_groups(bases)


def dequantize_shard(tensors, base, t):
    """vLLM's NVFP4 weight of one shard, written independently of ds_fpquant: e2m1 codes two per byte (the first
    of a pair in the low nibble), times the e4m3 group scale, times the fused layer's tensor scale ``t``; fp32."""
    packed, scale = tensors[f"{base}.weight"], tensors[f"{base}.weight_scale"]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    q = E2M1[codes]
    group_scale = scale.to(torch.float32).repeat_interleave(16, dim=1)[:, :q.shape[1]]
    return (q * group_scale) * t


def assert_max_rule_changes_nothing(tensors, expect_groups):
    groups = checkpoint_groups(tensors)
    assert len(groups) == expect_groups
    for group in groups:
        scales = [tensors[f"{base}.weight_scale_2"] for base in group]
        assert all(torch.equal(s, scales[0]) for s in scales), group  # one tensor scale per fused group
        fused_t = torch.stack(scales).max()  # the rule of vLLM / SGLang
        for base in group:
            own = dequantize_shard(tensors, base, tensors[f"{base}.weight_scale_2"])
            assert_bitwise_equal(dequantize_shard(tensors, base, fused_t), own, base)


@pytest.mark.parametrize("kind,expect_groups", [("llama", 4), ("qwen3_moe", 2 + 1 + 4)])
def test_every_writer_shares_the_tensor_scale_of_fused_layers(sources, tmp_path, kind, expect_groups):
    src, model = sources[kind]
    checkpoint.quantize_checkpoint(src, tmp_path / "q", "nvfp4", progress=False)
    written = read_tensors(tmp_path / "q")
    assert_max_rule_changes_nothing(written, expect_groups)

    applied = fpq.apply(copy.deepcopy(model), {"fp_quantization": {"fmt": "nvfp4"}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkpoint.UnsharedTensorScaleWarning)
        checkpoint.save_quantized(applied, tmp_path / "saved")
    saved = read_tensors(tmp_path / "saved")
    assert_max_rule_changes_nothing(saved, expect_groups)
    quantized = [k for k in written if k.endswith((".weight_scale", ".weight_scale_2"))]
    for key in quantized + [k[:-len("_scale")] for k in quantized if k.endswith(".weight_scale")]:
        assert torch.equal(saved[key].reshape(-1).view(torch.uint8), written[key].reshape(-1).view(torch.uint8)), key

    loaded = fpq.load_quantized(src, fp_quantization={"fmt": "nvfp4"})  # quantize while loading
    ours, theirs = dict(loaded.named_buffers()), dict(applied.named_buffers())
    assert ours.keys() == theirs.keys()
    for key, buffer in theirs.items():
        assert torch.equal(ours[key], buffer), key


def test_one_group_against_the_oracle(sources, tmp_path):
    """The q/k/v of a layer, written with their shared scale, are the rows of the oracle's NVFP4 of the stacked
    [q; k; v] matrix (one tensor scale from the joint amax, SPEC 3.4; numpy + ml_dtypes)."""
    src, model = sources["llama"]
    checkpoint.quantize_checkpoint(src, tmp_path / "q", "nvfp4", progress=False)
    written = read_tensors(tmp_path / "q")
    attention = model.model.layers[1].self_attn
    weights = [getattr(attention, p).weight.detach() for p in ("q_proj", "k_proj", "v_proj")]
    packed, codes, t, _ = quantize_nvfp4_rows(torch.cat(weights).numpy())
    start = 0
    for p, w in zip(("q_proj", "k_proj", "v_proj"), weights):
        base, rows = f"model.layers.1.self_attn.{p}", slice(start, start + w.shape[0])
        assert_bitwise_equal(written[f"{base}.weight"], packed[rows], f"{base}.weight")
        assert_bitwise_equal(written[f"{base}.weight_scale"].view(torch.uint8), codes[rows], f"{base}.weight_scale")
        assert_bitwise_equal(written[f"{base}.weight_scale_2"], np.array(t, dtype=np.float32), f"{base}.weight_scale_2")
        start += w.shape[0]
    own_t = [quantize_nvfp4_rows(w.numpy())[2] for w in weights]
    assert len(set(own_t)) > 1  # each alone would have had its own tensor scale: the test can tell


def test_layers_quantized_one_by_one_break_the_max_rule_and_warn(sources, tmp_path):
    """The defect this guards against: q/k/v and gate/up quantized each with its own tensor scale (what earlier
    versions wrote) change under vLLM's max rule, and save_quantized says so."""
    _, model = sources["llama"]
    one_by_one = copy.deepcopy(model)
    for name, module in list(one_by_one.named_modules()):
        if type(module) is torch.nn.Linear and name != "lm_head":
            parent, _, child = name.rpartition(".")
            setattr(one_by_one.get_submodule(parent), child, FPQuantizedLinear.from_linear(module, "nvfp4"))
    with pytest.warns(checkpoint.UnsharedTensorScaleWarning, match="self_attn.q_proj"):
        checkpoint.save_quantized(one_by_one, tmp_path / "q")
    tensors = read_tensors(tmp_path / "q")
    changed = 0
    for group in checkpoint_groups(tensors):
        fused_t = torch.stack([tensors[f"{b}.weight_scale_2"] for b in group]).max()
        for base in group:
            own = dequantize_shard(tensors, base, tensors[f"{base}.weight_scale_2"])
            changed += not torch.equal(dequantize_shard(tensors, base, fused_t), own)
    assert changed >= 4


def test_shared_tensor_scale_api():
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 64, generator=gen), torch.randn(4, 40, generator=gen) * 5
    x[0, 0] = float("nan")  # non-finite elements do not count towards the amax (SPEC 3)
    alone = fpq.quantize(x, "nvfp4")
    again = fpq.quantize(x, "nvfp4", tensor_scale=nvfp4_shared_tensor_scale([x]))
    assert torch.equal(alone.codes, again.codes) and torch.equal(alone.scales, again.scales)
    assert torch.equal(alone.tensor_scale, again.tensor_scale)
    t = nvfp4_shared_tensor_scale([x, y.to(torch.bfloat16)])
    assert t.item() == np.float32(np.float32(y.to(torch.bfloat16).abs().max().item()) / np.float32(2688.0))
    assert torch.equal(fpq.quantize(y, "nvfp4", tensor_scale=t).tensor_scale, t)
    for bad, error, message in [(0.5, TypeError, "0-d torch.float32 tensor, got float"),
                                (torch.tensor([0.5]), TypeError, r"got torch.float32 of shape \(1,\)"),
                                (torch.tensor(0.5, dtype=torch.float64), TypeError, "got torch.float64"),
                                (torch.tensor(float("inf")), ValueError, "finite and >= 2"),
                                (torch.tensor(2.0**-127), ValueError, "finite and >= 2")]:
        with pytest.raises(error, match=message):
            fpq.quantize(x, "nvfp4", tensor_scale=bad)
    with pytest.raises(ValueError, match="tensor_scale= is NVFP4's per-tensor scale"):
        fpq.quantize(x, "e4m3", tensor_scale=t)
    with pytest.raises(TypeError, match="non-empty list or tuple"):
        nvfp4_shared_tensor_scale([])
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        nvfp4_shared_tensor_scale([x, torch.zeros(3, dtype=torch.int32)])


def test_fused_groups_follow_the_engines_names():
    names = ["m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj",
             "m.layers.0.self_attn.o_proj", "m.layers.0.mlp.up_proj", "m.layers.0.mlp.gate_proj", "m.layers.1.mlp.gate_proj",
             "m.layers.1.self_attn.q_a_proj", "m.layers.1.self_attn.kv_a_proj_with_mqa", "moe.experts.3.w3",
             "moe.experts.3.w1", "moe.experts.3.w2"]
    assert sorted(fused_groups(names)) == sorted([
        ("m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj"),
        ("m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj"),
        ("m.layers.1.self_attn.q_a_proj", "m.layers.1.self_attn.kv_a_proj_with_mqa"),
        ("moe.experts.3.w1", "moe.experts.3.w3")])  # a lone gate_proj (layer 1) is no group

    def settings_for(name):  # k_proj overridden, v_proj excluded: q_proj is left alone
        return None if "v_proj" in name else {"fmt": "e4m3" if "k_proj" in name else "nvfp4"}

    assert shared_scale_groups(names[:5] + names[5:6], settings_for) == [
        ("m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj")]


def test_a_group_spread_over_shards_is_read_together(sources, tmp_path):
    """q/k/v and gate/up in different shards of an indexed checkpoint: read together when the first comes, each
    written once, the same files as from one shard."""
    _, model = sources["llama"]
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    attention = [index[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
    assert len(set(attention)) > 1  # the group is spread over shards
    summary = checkpoint.quantize_checkpoint(tmp_path / "sharded", tmp_path / "q", "nvfp4", progress=False)
    assert summary["quantized"] == 14
    written = read_tensors(tmp_path / "q")
    assert_max_rule_changes_nothing(written, 4)
    checkpoint.quantize_checkpoint(sources["llama"][0], tmp_path / "q1", "nvfp4", progress=False)
    one_shard = read_tensors(tmp_path / "q1")
    assert written.keys() == one_shard.keys()
    for key, tensor in one_shard.items():
        assert torch.equal(written[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), key
    loaded = fpq.load_quantized(tmp_path / "sharded", fp_quantization={"fmt": "nvfp4"})  # quantize while loading
    applied = fpq.apply(copy.deepcopy(model), {"fp_quantization": {"fmt": "nvfp4"}})
    ours, theirs = dict(loaded.named_buffers()), dict(applied.named_buffers())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], b) for k, b in theirs.items())
