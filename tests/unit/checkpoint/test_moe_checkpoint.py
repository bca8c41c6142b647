"""Mixture-of-experts checkpoints: ``ds-fpquant quantize`` quantizes every expert under the checkpoint's own
per-expert keys, ``load_quantized`` reads them back bit-identical to ``apply``, transformers' own FP8 loader
reads the same files to the same weights, and hand-written DeepSeek-V3-style checkpoints (fp32 and E8M0
``weight_scale_inv``) load exactly. Tiny random Mixtral, Qwen2-MoE and DeepSeek-V3 models (no downloads)."""

import copy
import json
import math

import pytest
import torch
from safetensors.torch import save_file
from unit.linear_bound import LinearCalls, assert_as_accurate_as
from unit.moe_models import KINDS, tiny_moe
from unit.safetensors_files import read_tensors as _tensors

import ds_fpquant as fpq
from ds_fpquant.checkpoint import writer as checkpoint
from ds_fpquant.cli.quantize import quantize_main
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.nn.quantized_params import quantized_experts

#: Per-expert checkpoint keys of expert 0 in layer 1, as save_pretrained writes them.
EXPERT_KEYS = {"mixtral": ["model.layers.1.block_sparse_moe.experts.0.w1", "model.layers.1.block_sparse_moe.experts.0.w2",
                           "model.layers.1.block_sparse_moe.experts.0.w3"],
               "qwen2_moe": [f"model.layers.1.mlp.experts.0.{p}_proj" for p in ("gate", "up", "down")],
               "deepseek_v3": [f"model.layers.1.mlp.experts.0.{p}_proj" for p in ("gate", "up", "down")]}
IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """kind -> (directory written by save_pretrained, the model)."""
    out = {}
    for kind in KINDS:
        model = tiny_moe(kind)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = (path, model)
    return out


def _dequantized_weights(model):
    """Every quantized weight of a loaded model, dequantized to fp32, by its parameter name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, FPQuantizedLinear):
            out[f"{name}.weight"] = fpq.dequantize(module.quantized_weight, torch.float32)
        for pname, experts in quantized_experts(module).items():
            out[f"{name}.{pname}"] = torch.stack([fpq.dequantize(qt, torch.float32) for qt in experts])
    return out


def _n_expert_stacks(model):
    return sum(len(quantized_experts(m)) for m in model.modules())


#: (CLI arguments, the same settings as an fp_quantization section)
SETTINGS = [(["--fmt", "e4m3", "--block", "8", "32"], {"fmt": "e4m3", "block": [8, 32]}),
            (["--fmt", "e5m2", "--group-size", "32"], {"fmt": "e5m2", "group_size": 32}),
            (["--fmt", "nvfp4"], {"fmt": "nvfp4"}),
            (["--fmt", "e2m1", "--group-size", "16"], {"fmt": "e2m1", "group_size": 16})]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("args,section", SETTINGS, ids=[s[1]["fmt"] for s in SETTINGS])
def test_cli_quantizes_every_expert_and_loads_bit_identical_to_apply(moe_dirs, tmp_path, kind, args, section, capsys):
    src, model = moe_dirs[kind]
    assert quantize_main([str(src), str(tmp_path / "q"), "--no-progress", *args]) == 0
    assert "kept because" not in capsys.readouterr().out  # every side is whole blocks here
    files = _tensors(tmp_path / "q")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    method = "fp8" if section["fmt"] in ("e4m3", "e5m2") else "ds_fpquant"
    assert qc["quant_method"] == method
    for base in EXPERT_KEYS[kind]:  # per-expert keys as the model was released, quantized
        assert files[f"{base}.weight"].dtype == ({"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[section["fmt"]]
                                                 if method == "fp8" else torch.uint8)
        assert f"{base}.weight_scale_inv" in files if method == "fp8" else f"{base}.weight_scale" in files
    assert not [k for k, t in files.items() if ".experts." in k and k.endswith(".weight") and t.is_floating_point()
                and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)]
    assert not [n for n in qc["modules_to_not_convert"] if "experts" in n]

    loaded = fpq.load_quantized(tmp_path / "q")
    stacks = sum(1 for _, m in model.named_modules() for p in m.named_parameters(recurse=False) if p[1].dim() == 3)
    assert stacks > 0 and _n_expert_stacks(loaded) == stacks
    assert not [n for n, p in loaded.named_parameters() if p.dim() == 3]  # no full-precision expert tensor
    reference = fpq.apply(copy.deepcopy(model), {"fp_quantization": section})
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, reference(IDS).logits)  # the same modules and calls
    ours, theirs = _dequantized_weights(loaded), _dequantized_weights(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kwargs", [{}, {"block": (8, 32)}, {"group_size": 16}], ids=["128x128", "8x32", "g16"])
def test_transformers_fp8_loader_reads_the_same_weights(moe_dirs, tmp_path, kind, kwargs):
    pytest.importorskip("accelerate")  # transformers' FP8 quantizer needs it
    import transformers

    src, _ = moe_dirs[kind]
    checkpoint.quantize_checkpoint(src, tmp_path / "q", "e4m3", progress=False, **kwargs)
    ours = _dequantized_weights(fpq.load_quantized(tmp_path / "q"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).state_dict()
    assert any(".experts." in k for k in ours) and len(ours) > 10
    differ = [k for k, w in ours.items() if not torch.equal(theirs[k], w)]
    assert not differ


def test_partial_blocks_are_kept_by_default_and_written_on_request(moe_dirs, tmp_path):
    """Mixtral's gate and up (96 rows) and DeepSeek's kv_a_proj (24 rows) with 64-row (16-row) blocks:
    transformers infers the block as rows // scale_rows and misreads them, so by default they stay in
    full precision and are listed; with allow_partial_blocks ds_fpquant writes them and reads them exactly."""
    pytest.importorskip("accelerate")
    import transformers

    src, model = moe_dirs["mixtral"]
    with pytest.warns(checkpoint.PartialBlocksWarning, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        summary = checkpoint.quantize_checkpoint(src, tmp_path / "kept", "e4m3", block=(64, 32), progress=False)
    assert summary["kept_partial"] == [f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(2)]
    files = _tensors(tmp_path / "kept")
    assert files["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dtype == torch.float32
    assert files["model.layers.0.block_sparse_moe.experts.0.w2.weight"].dtype == torch.float8_e4m3fn  # 64 x 96: whole
    kept = fpq.load_quantized(tmp_path / "kept")
    gate_up = kept.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(gate_up, torch.nn.Parameter) and torch.equal(gate_up, model.model.layers[0].mlp.experts.gate_up_proj)
    assert set(quantized_experts(kept.model.layers[0].mlp.experts)) == {"down_proj"}

    summary = checkpoint.quantize_checkpoint(src, tmp_path / "all", "e4m3", block=(64, 32), allow_partial_blocks=True,
                                             progress=False)
    assert summary["kept_partial"] == []
    files = _tensors(tmp_path / "all")
    loaded = _dequantized_weights(fpq.load_quantized(tmp_path / "all"))
    for e in range(4):  # gate and up quantized each with its own 64x32 blocks (a block would span both)
        pieces = []
        for w in ("w1", "w3"):
            key = f"model.layers.0.block_sparse_moe.experts.{e}.{w}"
            codes, scales = files[f"{key}.weight"].float(), files[f"{key}.weight_scale_inv"]
            assert scales.shape == (2, 2)
            pieces.append(codes * scales.repeat_interleave(64, 0)[:96].repeat_interleave(32, 1))
        assert torch.equal(loaded["model.layers.0.mlp.experts.gate_up_proj"][e], torch.cat(pieces))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "all", dtype=torch.float32).state_dict()
    assert not torch.equal(theirs["model.layers.0.mlp.experts.gate_up_proj"], loaded["model.layers.0.mlp.experts.gate_up_proj"])


def test_conv1d_weights_follow_the_same_rule(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16)).save_pretrained(
        tmp_path / "gpt2")
    with pytest.warns(checkpoint.PartialBlocksWarning, match="Conv1D"):
        summary = checkpoint.quantize_checkpoint(tmp_path / "gpt2", tmp_path / "q", progress=False)
    assert summary["quantized"] == 0 and len(summary["kept_partial"]) == 4
    out = checkpoint.quantize_checkpoint(tmp_path / "gpt2", tmp_path / "q2", "e2m1", progress=False)  # own layout
    assert out["quantized"] == 4 and out["kept_partial"] == []


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("released_keys", [True, False], ids=["per-expert-keys", "stacks"])
def test_fused_expert_stacks_on_disk(moe_dirs, tmp_path, kind, released_keys, monkeypatch):
    """A source checkpoint holding transformers' fused (E, out, in) parameters. Written under the per-expert
    keys the model is released with (transformers' reverse conversion); for a model without such keys
    (simulated here) as stacks ``experts.gate_up_proj`` + ``experts.gate_up_proj_scale_inv``, transformers'
    FP8Experts layout. Both read back bit-identical to apply."""
    released, model = moe_dirs[kind]
    src = tmp_path / "fused"
    src.mkdir()
    (src / "config.json").write_text((released / "config.json").read_text())
    save_file({k: v.clone() for k, v in model.state_dict().items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    if not released_keys:
        monkeypatch.setattr(checkpoint.CheckpointKeys, "unfuse", lambda self, key, shape: None)
    checkpoint.quantize_checkpoint(src, tmp_path / "q", "nvfp4", progress=False)
    files = _tensors(tmp_path / "q")
    if released_keys:  # the experts as quantizing the released (save_pretrained) checkpoint writes them
        checkpoint.quantize_checkpoint(released, tmp_path / "from_released", "nvfp4", progress=False)
        expected = {k: t for k, t in _tensors(tmp_path / "from_released").items() if ".experts." in k}
        assert expected.keys() == {k for k in files if ".experts." in k} and f"{EXPERT_KEYS[kind][0]}.weight" in files
        assert all(torch.equal(files[k].reshape(-1).view(torch.uint8), expected[k].reshape(-1).view(torch.uint8))
                   for k in expected)
    else:
        assert files["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.uint8
        assert files["model.layers.1.mlp.experts.gate_up_proj_scale_2"].shape == (4,)
    loaded = fpq.load_quantized(tmp_path / "q")
    assert _n_expert_stacks(loaded) == 4
    reference = fpq.apply(copy.deepcopy(model), {"fp_quantization": {"fmt": "nvfp4"}})
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, reference(IDS).logits)  # the same modules and calls


def _hand_quantize(w: torch.Tensor, block, e8m0: bool):
    """Block FP8 the way DeepSeek-V3's conversion script writes it (independent of ds_fpquant):
    s = amax / 448 per block (E8M0: rounded up to a power of two), codes = e4m3(w / s)."""
    rows, cols = w.shape
    br, bc = block
    sr, sc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = torch.zeros(sr * br, sc * bc)
    padded[:rows, :cols] = w
    amax = padded.reshape(sr, br, sc, bc).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    if e8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    codes = (w / full).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * full


@pytest.mark.parametrize("scale_dtype", ["float32", "float8_e8m0fnu", "uint8"])
def test_hand_written_deepseek_v3_checkpoint(moe_dirs, tmp_path, scale_dtype, monkeypatch):
    """Per-expert ``experts.{e}.gate_proj.weight`` + ``weight_scale_inv`` as DeepSeek-V3 (fp32 scales) and
    V3.1-style ue8m0 releases (E8M0 bytes as float8_e8m0fnu or uint8) ship them, 16x16 blocks with partial
    edge blocks: load_quantized holds exactly codes x 2^(byte - 127) (or x scale), and its forward equals
    the model holding those weights."""
    src, model = moe_dirs["deepseek_v3"]
    e8m0 = scale_dtype != "float32"
    block = (16, 16)
    files, expected = {}, copy.deepcopy(model)
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.")
    for key, tensor in _tensors(src).items():
        if key.endswith(".weight") and tensor.dim() == 2 and not any(s in key for s in skip):
            codes, scale, dequantized = _hand_quantize(tensor, block, e8m0)
            if scale_dtype == "uint8":
                scale = (torch.log2(scale) + 127).to(torch.uint8)
            elif e8m0:
                scale = scale.to(torch.float8_e8m0fnu)
            files[key], files[key[:-len("weight")] + "weight_scale_inv"] = codes, scale
            files[f"{key}.dequantized"] = dequantized
        else:
            files[key] = tensor
    dequantized = {k[:-len(".dequantized")]: files.pop(k) for k in list(files) if k.endswith(".dequantized")}
    dst = tmp_path / "ds3"
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block), **({"scale_fmt": "ue8m0"} if e8m0 else {})}
    (dst / "config.json").write_text(json.dumps(config))
    save_file(files, str(dst / "model.safetensors"), metadata={"format": "pt"})
    # the full-precision model holding the hand-dequantized weights, per-expert matrices stacked as transformers does
    state = expected.state_dict()
    for name, module in expected.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{name}.{pname}"
            if f"{full}" in dequantized:
                p.data.copy_(dequantized[full])
            elif p.dim() == 3:
                n = p.shape[0]
                parts = (["gate_proj", "up_proj"] if pname == "gate_up_proj" else ["down_proj"])
                p.data.copy_(torch.stack([torch.cat([dequantized[f"{name}.{e}.{q}.weight"] for q in parts])
                                          for e in range(n)]))
    # the quantized experts run transformers' eager per-expert loop; so must the model they are compared with
    # (its grouped_mm default sums in another order, chosen by the CPU's BLAS)
    expected.set_experts_implementation("eager")
    loaded = fpq.load_quantized(dst, backend="torch")
    weights = _dequantized_weights(loaded)
    assert _n_expert_stacks(loaded) == 2 and len(weights) == len(dequantized) - 4 * 3 + 2
    for key, w in weights.items():
        assert torch.equal(w, state[key]), key
    # the torch backend computes SPEC 8.1's formula (scales on group sums), not F.linear(x, dequantized W): each
    # of its calls within the fp32 bound of its own inputs, the forward as close to the fp64 model holding the
    # dequantized weights as that model in fp32 is (SPEC 8.2; unit/linear_bound.py)
    calls = LinearCalls(monkeypatch)
    with torch.no_grad():
        got, baseline = loaded(IDS).logits, expected(IDS).logits
        exact = copy.deepcopy(expected).double()(IDS).logits
    calls.assert_each_within_bound()
    assert_as_accurate_as(got, baseline, exact)


P = "model.layers.1.mlp.experts"


def _rewrite(directory, edit):
    tensors = _tensors(directory)
    edit(tensors)
    for path in directory.glob("*.safetensors"):
        path.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})


def _zero_copy(t, old, new):
    for k in [k for k in t if old in k]:
        t[k.replace(old, new)] = torch.zeros_like(t[k]) if k.endswith(".weight") else t[k].clone()


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop(f"{P}.1.up_proj.weight"), r"gate_up_proj: the checkpoint has scales but no weight for \['expert 1 part 1'\]"),
    (lambda t: t.pop(f"{P}.1.down_proj.weight_scale"), r"down_proj\[expert 1, part 0\].*missing"),
    (lambda t: t.__setitem__(f"{P}.1.down_proj.weight", t[f"{P}.1.down_proj.weight"].view(torch.int8)),
     "a 'ds_fpquant' weight is uint8 packed codes, got torch.int8"),
    (lambda t: _zero_copy(t, ".experts.1.", ".experts.01."), "experts.01.down_proj.weight and .*experts.1.down_proj.weight are both"),
    (lambda t: _zero_copy(t, "model.layers.1.", "layers.1."), "are both weight of"),
    (lambda t: t.__setitem__(f"{P}.gate_up_proj", torch.zeros(4, 64, 64)), "stored both per expert and as a stack"),
    (lambda t: [t.pop(k) for k in list(t) if f"{P}.3." in k], r"missing: \['expert 3 part 0'\]"),
    (lambda t: t.__setitem__(f"{P}.1.up_proj.weight_scale_2", t[f"{P}.1.up_proj.weight_scale_2"] * 2),
     "different tensor scales"),
], ids=["no-weight", "no-scale", "int8-codes", "duplicate-01", "duplicate-unprefixed", "stack-and-parts",
        "expert-missing", "nvfp4-tensor-scales-differ"])
def test_tampered_moe_checkpoints_are_refused(moe_dirs, tmp_path, edit, message):
    src, _ = moe_dirs["qwen2_moe"]
    checkpoint.quantize_checkpoint(src, tmp_path / "q", "nvfp4", progress=False)
    _rewrite(tmp_path / "q", edit)
    with pytest.raises(ValueError, match=message):
        fpq.load_quantized(tmp_path / "q")


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop(f"{P}.1.down_proj.weight"), r"missing: \['expert 1 part 0'\]"),
    (lambda t: [t.__setitem__(k.replace(".0.", ".4."), t[k].clone()) for k in list(t) if f"{P}.0." in k],
     r"beyond its 4 experts: \['model.layers.1.mlp.experts.4"),
    (lambda t: t.__setitem__(f"{P}.1.gate_proj.weight", t[f"{P}.1.gate_proj.weight"][:24].clone()),
     "expert 1's matrices .* do not make the"),
    (lambda t: t.__setitem__(f"{P}.1.gate_proj.weight", t[f"{P}.1.gate_proj.weight"][None].clone()),
     r"experts.1.gate_proj.weight: an expert's matrix is 2-D"),
    (lambda t: _zero_copy(t, ".experts.1.", ".experts.01."), "are both part 0 of expert 1"),
    (lambda t: t.pop(f"{P}.2.up_proj.weight"), "lack some of their matrices|missing"),
], ids=["down-missing", "extra-expert", "short-gate", "3-d", "duplicate", "up-missing"])
def test_broken_moe_sources_are_refused_before_writing(moe_dirs, tmp_path, edit, message):
    src, _ = moe_dirs["qwen2_moe"]
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "config.json").write_text((src / "config.json").read_text())
    save_file(_tensors(src), str(broken / "model.safetensors"), metadata={"format": "pt"})
    _rewrite(broken, edit)
    with pytest.raises(ValueError, match=message):
        checkpoint.quantize_checkpoint(broken, tmp_path / "q", "e4m3", block=(8, 32), progress=False)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("kind,section", [("mixtral", {"fmt": "e4m3", "block": [8, 32]}), ("qwen2_moe", {"fmt": "nvfp4"}),
                                          ("deepseek_v3", {"fmt": "e2m1", "group_size": 16})])
def test_save_pretrained_of_a_quantized_model(moe_dirs, tmp_path, kind, section):
    """Issue 16: ``save_pretrained`` of a model from apply writes the checkpoint quantize_checkpoint would
    (save_quantized: codes and scales as held, per-expert keys), which load_quantized reads back bit-identical;
    saving the loaded model again gives the same files."""
    src, model = moe_dirs[kind]
    quantized = fpq.apply(copy.deepcopy(model), {"fp_quantization": section})
    quantized.save_pretrained(tmp_path / "saved")
    loaded = fpq.load_quantized(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, quantized(IDS).logits)  # the same modules and calls
    files = _tensors(tmp_path / "saved")
    assert f"{EXPERT_KEYS[kind][0]}.weight" in files
    checkpoint.quantize_checkpoint(src, tmp_path / "cli", section["fmt"], block=section.get("block"),
                                   group_size=section.get("group_size"), progress=False)
    cli = _tensors(tmp_path / "cli")
    for key in [k for k in cli if ".experts." in k]:  # the experts exactly as the command writes them
        assert torch.equal(files[key].reshape(-1).view(torch.uint8), cli[key].reshape(-1).view(torch.uint8)), key
    loaded.save_pretrained(tmp_path / "again")
    again = _tensors(tmp_path / "again")
    assert again.keys() == files.keys()
    assert all(torch.equal(again[k].reshape(-1).view(torch.uint8), files[k].reshape(-1).view(torch.uint8)) for k in files)
    with pytest.raises(ValueError, match="cannot honour {'push_to_hub': True}.*ds-fpquant quantize"):
        loaded.save_pretrained(tmp_path / "hub", push_to_hub=True)
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        loaded.save_pretrained(tmp_path / "again")


def test_save_quantized_refuses_what_one_checkpoint_cannot_hold(moe_dirs, tmp_path):
    _, model = moe_dirs["qwen2_moe"]
    mixed = fpq.apply(copy.deepcopy(model), {"fp_quantization": {"fmt": "e4m3", "modules": {"experts": {"fmt": "e2m1"}}}})
    with pytest.raises(ValueError, match="a checkpoint holds one format and scaling"):
        checkpoint.save_quantized(mixed, tmp_path / "q")
    with pytest.raises(ValueError, match="holds no ds_fpquant-quantized layers"):
        checkpoint.save_quantized(copy.deepcopy(model), tmp_path / "q")
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel"):
        checkpoint.save_quantized(torch.nn.Linear(2, 2), tmp_path / "q")
    assert not (tmp_path / "q").exists()
