"""Issue 29, more checkpoint readers: ModelOpt block FP8 (``fp8_pb_wo``), ``MXFP8`` and ``mxfp4`` exported by
nvidia-modelopt 0.47 itself on CPU (``mtq.quantize`` with its presets, ``export_hf_checkpoint``), each weight
compared bit for bit with ModelOpt's own ``FP8QTensor`` / ``MXFP8QTensor`` / ``MXFP4QTensor.dequantize``;
compressed-tensors 0.20.1's ``mxfp6-pack-quantized`` and its MoE checkpoints, written by compressed-tensors itself
and compared with its ``decompress_model``."""

import json
import warnings

import pytest
import torch
import transformers
from unit.moe_models import tiny_moe, tiny_qwen3_moe
from unit.safetensors_files import read_tensors
from unit.tiny_models import tiny_llama

import ds_fpquant as fpq
from ds_fpquant.checkpoint.layouts import StaticActivationScalesWarning
from ds_fpquant.checkpoint.layouts.modelopt import read as layout_modelopt
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.nn.quantized_params import quantized_experts

mtq = pytest.importorskip("modelopt.torch.quantization")
export = pytest.importorskip("modelopt.torch.export")
qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
from unit.checkpoint.test_modelopt_checkpoint import EXPERT_PARTS, modelopt_expert_dequantize  # noqa: E402

#: quant_algo as ModelOpt 0.47 writes it -> its preset
MODELOPT_ALGOS = {"fp8_pb_wo": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "MXFP8": "MXFP8_DEFAULT_CFG",
                  "mxfp4": "MXFP4_DEFAULT_CFG", "W4A8_MXFP4_FP8": "W4A8_MXFP4_FP8_CFG"}


def llama_192():
    """A 1-layer Llama with hidden 192 and intermediate 320: 128x128 FP8 blocks with partial edge blocks on both
    sides (q_proj (192, 192): 2x2 blocks; down_proj (192, 320): 2x3; gate_proj (320, 192): 3x2)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=192, intermediate_size=320,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=100,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def export_with_modelopt(model, cfg, path, compress=False):
    model.config.architectures = [type(model).__name__]  # ModelOpt's export reads it
    ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))

    def calibrate(m):
        with torch.no_grad():
            m(ids)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ModelOpt's own deprecation notes
        model = mtq.quantize(model, getattr(mtq, cfg), calibrate)
        if compress:  # real-quantized weights (fp8_pb_real)
            mtq.compress(model)
        export.export_hf_checkpoint(model, export_dir=path)
    return path


@pytest.fixture(scope="module")
def modelopt_exports(tmp_path_factory):
    """(quant_algo, model) -> directory ModelOpt's export wrote."""
    out = {}
    for algo, cfg in MODELOPT_ALGOS.items():
        out[(algo, "llama64")] = export_with_modelopt(tiny_llama(), cfg, tmp_path_factory.mktemp(algo))
    out[("fp8_pb_wo", "llama192")] = export_with_modelopt(llama_192(), MODELOPT_ALGOS["fp8_pb_wo"],
                                                          tmp_path_factory.mktemp("fp8_pb_wo_192"))
    for model, make in (("llama64", tiny_llama), ("llama192", llama_192)):
        out[("fp8_pb_real", model)] = export_with_modelopt(make(), MODELOPT_ALGOS["fp8_pb_wo"],
                                                           tmp_path_factory.mktemp("fp8_pb_real"), compress=True)
    return out


def modelopt_dequantize(tensors, base, algo, shape):
    """ModelOpt's own dequantization of one weight, fp32."""
    weight, scale = tensors[f"{base}.weight"], tensors[f"{base}.weight_scale"]
    if algo.startswith("fp8_pb"):
        nb, kb = -(-shape[0] // 128), -(-shape[1] // 128)
        # ModelOpt's export squeezes its (Nb, 1, Kb, 1) block amax before quantizing; its dequantize takes (Nb, Kb)
        return qtensor.FP8QTensor(torch.Size(shape), torch.float32, weight).dequantize(
            torch.float32, scale=scale.reshape(nb, kb), block_sizes={-1: 128, -2: 128})
    if algo == "MXFP8":
        return qtensor.MXFP8QTensor(torch.Size(shape), torch.float32, weight).dequantize(torch.float32, scale=scale)
    return qtensor.MXFP4QTensor(torch.Size(shape), torch.float32, weight).dequantize(
        torch.float32, scale=scale, block_sizes={-1: 32})


@pytest.mark.parametrize("algo,model", [("fp8_pb_wo", "llama64"), ("fp8_pb_wo", "llama192"), ("fp8_pb_real", "llama64"),
                                        ("fp8_pb_real", "llama192"), ("MXFP8", "llama64"), ("mxfp4", "llama64"),
                                        ("W4A8_MXFP4_FP8", "llama64")])
def test_modelopt_block_fp8_and_mx_exports_load_bit_exact(modelopt_exports, algo, model):
    path = modelopt_exports[(algo, model)]
    hf = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == algo  # the spelling ModelOpt writes
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_algo"] == algo
    tensors = read_tensors(path)
    assert not any(k.endswith(".input_scale") for k in tensors)  # weight-only / dynamic MX activations
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaticActivationScalesWarning)
        loaded = fpq.load_quantized(path)
    layers = {name: m for name, m in loaded.named_modules() if isinstance(m, FPQuantizedLinear)}
    assert len(layers) == (14 if model == "llama64" else 7) and type(loaded.lm_head) is torch.nn.Linear
    partial = 0
    for name, layer in layers.items():
        qt = layer.quantized_weight
        ours = fpq.dequantize(qt, torch.float32)
        theirs = modelopt_dequantize(tensors, name, algo, tuple(ours.shape))
        # bit for bit, the sign of zero included (ModelOpt's MXFP4 table decodes 0x8 as -0 like SPEC 1)
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), name
        if algo.startswith("fp8_pb"):
            n, k = ours.shape
            assert qt.block == (128, 128) and qt.scales.shape == (-(-n // 128), -(-k // 128))
            partial += bool(n % 128 or k % 128)
            stored = tensors[f"{name}.weight_scale"]
            if algo == "fp8_pb_wo":  # ModelOpt's block amax shape, 0-dim for one block
                assert stored.shape == (() if model == "llama64" else (-(-n // 128), 1, -(-k // 128), 1))
            else:  # the real quantizer's _scale
                assert stored.shape == (-(-n // 128), -(-k // 128))
        else:
            assert qt.fmt == {"MXFP8": "mxfp8_e4m3", "mxfp4": "mxfp4", "W4A8_MXFP4_FP8": "mxfp4"}[algo] and qt.group_size == 32
            assert qt.scale_format == "e8m0" and torch.equal(qt.scales, tensors[f"{name}.weight_scale"])
            assert torch.equal(qt.codes, tensors[f"{name}.weight"].view(torch.uint8))  # the bytes as stored
    if model == "llama192":
        assert partial == 7  # every matrix has a partial edge block (192 = 128 + 64, 320 = 2 * 128 + 64)
    for name, tensor in loaded.state_dict().items():  # everything else as stored
        if name in tensors and not any(name.startswith(f"{n}.") for n in layers):
            assert torch.equal(tensor, tensors[name]), name


def test_modelopt_mxfp4_packing_is_spec6():
    """ModelOpt's MXFP4 bytes hold the first e2m1 code in the low nibble, as SPEC 6: its quantizer and ours give
    the same bytes and E8M0 scales for values with no rounding ties (both round to nearest; ties are measure zero
    for these random normals), and the MXFP8 quantizer the same e4m3 codes."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    theirs, scale = qtensor.MXFP4QTensor.quantize(w, block_size=32)
    ours = fpq.quantize(w, fmt="mxfp4")
    assert torch.equal(ours.codes, theirs._quantized_data) and torch.equal(ours.scales, scale.reshape(8, 2))
    one = torch.zeros(1, 32)
    one[0, 0], one[0, 1] = 1.0, -6.0  # e2m1 codes 0x2 and 0xF: byte 0xF2 if the first is in the low nibble
    packed, _ = qtensor.MXFP4QTensor.quantize(one, block_size=32)
    assert packed._quantized_data[0, 0].item() == 0xF2 == fpq.quantize(one, fmt="mxfp4").codes[0, 0].item()
    theirs8, scale8 = qtensor.MXFP8QTensor.quantize(w)
    ours8 = fpq.quantize(w, fmt="mxfp8_e4m3")
    assert torch.equal(ours8.codes, theirs8._quantized_data.view(torch.uint8)) and torch.equal(ours8.scales, scale8)


def test_modelopt_block_and_mx_errors(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "MXFP8",
                                                                                 "group_size": 16}}))
    with pytest.raises(ValueError, match="group_size=16; MXFP8 has groups of 32"):
        layout_modelopt.check_config(None, tmp_path)
    block = layout_modelopt.check_config({"quant_method": "modelopt", "quant_algo": "fp8_pb_wo"}, tmp_path / "none")
    weight = torch.zeros(192, 320, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"m.weight_scale: a ModelOpt fp8_pb_wo weight of shape \(192, 320\) has "
                                         r"float32 scales of 128x128 blocks, shape \(2, 1, 3, 1\) or \(2, 3\) .*; "
                                         r"got torch.float32 of shape \(\)"):
        layout_modelopt.from_parts("m", {"weight": weight, "weight_scale": torch.ones(())}, (192, 320), block,
                                   torch.float32)
    with pytest.raises(ValueError, match="finite and > 0"):
        layout_modelopt.from_parts("m", {"weight": weight, "weight_scale": torch.zeros(2, 1, 3, 1)}, (192, 320),
                                   block, torch.float32)
    mx = layout_modelopt.check_config({"quant_method": "modelopt", "quant_algo": "mxfp4"}, tmp_path / "none")
    with pytest.raises(ValueError, match="in_features=48 is not a multiple of 32"):
        layout_modelopt.from_parts("m", {"weight": torch.zeros(4, 24, dtype=torch.uint8),
                                         "weight_scale": torch.zeros(4, 2, dtype=torch.uint8)}, (4, 48), mx,
                                   torch.float32)
    with pytest.raises(ValueError, match=r"weight_scale: a ModelOpt weight has torch.uint8 of shape \(4, 2\)"):
        layout_modelopt.from_parts("m", {"weight": torch.zeros(4, 32, dtype=torch.uint8),
                                         "weight_scale": torch.ones(4, 2)}, (4, 64), mx, torch.float32)


def test_compressed_tensors_mxfp6_packing_is_spec6():
    """compressed-tensors' ``pack_fp6_to_uint8`` (four e2m3 codes in three bytes) writes SPEC 6's bit stream: the
    same bytes as ds_fpquant's ``mxfp6_e2m3`` codes for the same values (every e2m3 value, both zeros included;
    each group holds 7.5, so its E8M0 scale is 2^0 and the values are their own codes)."""
    helpers = pytest.importorskip("compressed_tensors.compressors.mxfp6.helpers")
    codes = torch.randint(0, 64, (6, 128), generator=torch.Generator().manual_seed(5))
    codes[:, ::32] = 0x0F  # 7.5
    codes[0, 1:65] = torch.arange(64)  # every code once
    magnitude = torch.tensor([m / 8 for m in range(8)] + [(1 + m / 8) * 2 ** e for e in range(3) for m in range(8)])
    values = torch.where(codes >= 32, -magnitude[codes % 32], magnitude[codes % 32])
    ours = fpq.quantize(values, fmt="mxfp6_e2m3")
    assert torch.equal(ours.scales, torch.full((6, 4), 127, dtype=torch.uint8))
    assert torch.equal(fpq.dequantize(ours, torch.float32).view(torch.int32), values.view(torch.int32))
    assert torch.equal(ours.codes, helpers.pack_fp6_to_uint8(values))


# --- compressed-tensors MoE checkpoints ------------------------------------------------------------------------
# compressed-tensors 0.20.1 quantizes Linear (and Embedding) modules only (COMPRESSIBLE_MODULE_TYPES), and
# transformers 5 holds experts as fused 3-D parameters, so it cannot quantize the model as built. llm-compressor's
# MoE releases store experts per expert (``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``), which is
# also what transformers 5's save_pretrained writes: the test builds an ``nn.Linear`` for every 2-D weight of that
# checkpoint under its key, lets compressed-tensors quantize and compress that module tree, and saves its tensors
# with the rest of the checkpoint; ``decompress_model`` of the same tree is the oracle.

def _linear_tree(tensors):
    """An ``nn.Module`` tree with an ``nn.Linear`` (no bias) under every 2-D ``.weight`` key but the embeddings."""
    root = torch.nn.Module()
    for key, tensor in tensors.items():
        if not key.endswith(".weight") or tensor.dim() != 2 or "embed_tokens" in key:
            continue
        *path, leaf = key[:-len(".weight")].split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        linear = torch.nn.Linear(tensor.shape[1], tensor.shape[0], bias=False, dtype=tensor.dtype)
        linear.weight.data.copy_(tensor)
        parent.add_module(leaf, linear)
    return root


#: the modules llm-compressor's MoE recipes leave unquantized: the head and the routers
CT_MOE_IGNORE = ["lm_head", r"re:.*mlp\.gate$"]


def _fused_groups(names):
    """llm-compressor gives q/k/v and each gate/up pair one NVFP4 global scale: module -> its group."""
    out = {}
    for name in names:
        parent, leaf = name.rsplit(".", 1)
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if leaf in group:
                out[name] = [f"{parent}.{p}" for p in group if f"{parent}.{p}" in names]
    return out


def write_ct_moe_checkpoint(model, preset: str, out):
    """``model``'s per-expert checkpoint quantized and compressed by compressed-tensors; returns its own
    decompression of every quantized weight by key (``{module: weight}``) and the static activation scales it
    stored (``{module: {part: value}}``, set as a calibration would)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStrategy,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from safetensors.torch import save_file

    model.save_pretrained(out)
    tensors = read_tensors(out)
    tree = _linear_tree(tensors)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=CT_MOE_IGNORE)
    apply_quantization_config(tree, config)
    modules = {name: m for name, m in tree.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    groups = _fused_groups(set(modules))
    inputs = {}
    with torch.no_grad():
        for name, module in modules.items():
            args, w = module.quantization_scheme.weights, module.weight.data
            global_scale = None
            if hasattr(module, "weight_global_scale"):
                joint = torch.cat([modules[m].weight.data.reshape(-1) for m in groups.get(name, [name])])
                global_scale = generate_gparam(joint.amin(), joint.amax())
                module.weight_global_scale.data.copy_(global_scale)
            if args.strategy == QuantizationStrategy.TENSOR:  # FP8: one scale per weight
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            elif args.strategy == QuantizationStrategy.CHANNEL:  # one scale per output row
                lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            elif args.strategy == QuantizationStrategy.BLOCK:
                br, bc = args.block_structure
                n, k = w.shape
                blocks = torch.nn.functional.pad(w, (0, -k % bc, 0, -n % br)).unflatten(0, (-1, br)).unflatten(-1, (-1, bc))
                lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
            else:
                groups_of = w.unflatten(-1, (-1, args.group_size))
                lo, hi = groups_of.amin(-1), groups_of.amax(-1)
            scale, _ = calculate_qparams(lo, hi, args, global_scale=global_scale)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            for part in ("input_scale", "input_global_scale"):
                if hasattr(module, part):
                    getattr(module, part).data.fill_(0.0123 * (1 + len(inputs)))
                    inputs.setdefault(name, {})[part] = getattr(module, part).data.clone()
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.compress_model(tree)
    state = {k: v for k, v in tensors.items() if not k.endswith(".weight") or v.dim() != 2 or "embed_tokens" in k}
    state.update({k: v.contiguous() for k, v in tree.state_dict().items()})
    for f in out.glob("*.safetensors"):
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(state, str(out / "model.safetensors"))
    compressor.update_config(out)
    compressor.decompress_model(tree)
    return {name: m.weight.data.clone() for name, m in tree.named_modules() if name in modules}, inputs


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


CT_MOE_MODELS = {"qwen3_moe": tiny_qwen3_moe, "deepseek_v3": lambda: tiny_moe("deepseek_v3")}


@pytest.mark.parametrize("kind,preset,fmt", [
    ("qwen3_moe", "FP8_BLOCK", "float-quantized"), ("deepseek_v3", "FP8_BLOCK", "float-quantized"),
    ("qwen3_moe", "NVFP4A16", "nvfp4-pack-quantized"), ("deepseek_v3", "NVFP4A16", "nvfp4-pack-quantized"),
    ("qwen3_moe", "MXFP4", "mxfp4-pack-quantized"), ("qwen3_moe", "NVFP4", "nvfp4-pack-quantized")])  # (DeepSeek-V3's kv_b_proj has K = 16: no MX groups of 32)
def test_compressed_tensors_moe_checkpoint_loads_bit_identical(tmp_path, kind, preset, fmt):
    """Every expert of every MoE layer, every dense linear: the dequantized weight equals compressed-tensors'
    ``decompress_model`` bit for bit; experts are installed as quantized expert stacks (gate over up). NVFP4:
    with ``generate_gparam``'s global scales some experts read as ``nvfp4`` and some as ``e2m1`` with fp32 scales
    (compressed-tensors' divisor, see its reader); the stack holds them all as the latter, the same values."""
    pytest.importorskip("compressed_tensors")
    model = CT_MOE_MODELS[kind]().to(torch.bfloat16)
    oracle, inputs = write_ct_moe_checkpoint(model, preset, tmp_path / "ct")
    qconfig = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors" and qconfig["format"] == fmt
    assert bool(inputs) == (preset == "NVFP4")  # W4A4: static input_global_scale
    if inputs:
        with pytest.warns(StaticActivationScalesWarning, match="weight-only"):
            loaded = fpq.load_quantized(tmp_path / "ct")
        recorded = loaded.ds_fpquant_activation_scales
        for name, parts in inputs.items():  # as stored, not applied; experts under <parameter>[expert e, part p]
            parent, leaf = name.rsplit(".", 1)
            if ".experts." in name:
                base, e = parent.rsplit(".", 1)
                pname = "down_proj" if leaf == "down_proj" else "gate_up_proj"
                name = f"{base}.{pname}[expert {e}, part {int(leaf == 'up_proj')}]"
            assert set(recorded[name]) == set(parts), name
            assert all(torch.equal(recorded[name][p], v) for p, v in parts.items()), name
        assert len(recorded) == len(inputs)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", StaticActivationScalesWarning)
            loaded = fpq.load_quantized(tmp_path / "ct")
    seen = set()
    for name, module in loaded.named_modules():
        if isinstance(module, FPQuantizedLinear):
            ours = fpq.dequantize(module.quantized_weight, torch.bfloat16)
            assert torch.equal(_bits(ours), _bits(oracle[name])), name
            seen.add(name)
        for pname, experts in quantized_experts(module).items():
            parts = ("gate_proj", "up_proj") if pname == "gate_up_proj" else ("down_proj",)
            for e, qt in enumerate(experts):
                theirs = torch.cat([oracle[f"{name}.{e}.{p}"] for p in parts])
                ours = fpq.dequantize(qt, torch.bfloat16)
                assert torch.equal(_bits(ours), _bits(theirs)), (name, pname, e)
                seen.update(f"{name}.{e}.{p}" for p in parts)
    assert seen == set(oracle)  # every weight compressed-tensors quantized, and nothing else
    assert sum(len(quantized_experts(m)) for m in loaded.modules()) == 2  # one MoE layer: gate_up_proj, down_proj
    routers = [m for n, m in loaded.named_modules() if n.endswith("mlp.gate")]
    assert routers and not any(isinstance(m, FPQuantizedLinear) for m in routers)


def test_nvfp4_beside_e2m1_keeps_every_value():
    """``nvfp4_beside_e2m1``: an ``nvfp4`` piece beside an ``e2m1`` one (groups of 16, fp32 scales) becomes
    ``e2m1`` with the fp32 scales its groups dequantize with: the same values bit for bit; without an ``e2m1``
    piece nothing changes."""
    from ds_fpquant.tensor.slicing import nvfp4_beside_e2m1

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(7)) * 1e-3
    nv = fpq.quantize(w, fmt="nvfp4")
    plain = fpq.quantize(w, fmt="e2m1", group_size=16)
    assert nvfp4_beside_e2m1([nv, nv]) == [nv, nv]
    converted, same = nvfp4_beside_e2m1([nv, plain])
    assert same is plain and converted.fmt == "e2m1" and converted.tensor_scale is None
    assert converted.scales.dtype == torch.float32 and converted.group_size == 16
    assert torch.equal(converted.codes, nv.codes)
    assert torch.equal(fpq.dequantize(converted, torch.float32).view(torch.int32),
                       fpq.dequantize(nv, torch.float32).view(torch.int32))


@pytest.mark.parametrize("algo", list(MODELOPT_ALGOS))
def test_modelopt_block_fp8_and_mx_qwen3_moe_experts_load_bit_exact(tmp_path, algo):
    """ModelOpt's export of a Qwen3-MoE in fp8_pb_wo / MXFP8 / mxfp4 writes per-expert gate/up/down and excludes
    the router; ds_fpquant installs them as quantized expert stacks, each expert's matrix ModelOpt's
    dequantization of its parts stacked (gate over up), bit for bit."""
    path = export_with_modelopt(tiny_qwen3_moe(), MODELOPT_ALGOS[algo], tmp_path / "moe")
    assert json.loads((path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == algo
    tensors = read_tensors(path)
    loaded = fpq.load_quantized(path)
    experts = quantized_experts(loaded.model.layers[1].mlp.experts)
    assert set(experts) == {"gate_up_proj", "down_proj"}
    base = "model.layers.1.mlp.experts"
    for pname, parts in EXPERT_PARTS:
        assert len(experts[pname]) == 4
        for e, qt in enumerate(experts[pname]):
            ours = fpq.dequantize(qt, torch.float32)
            theirs = modelopt_expert_dequantize(tensors, base, e, parts, algo, modelopt_dequantize, ours.shape[1])
            assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), (pname, e)
    assert not isinstance(loaded.model.layers[1].mlp.gate, FPQuantizedLinear)  # the router, excluded
    dense = {n: m for n, m in loaded.named_modules() if isinstance(m, FPQuantizedLinear)}
    assert len(dense) == 4 * 2 + 3  # attention of both layers, layer 0's dense MLP
    for name, layer in dense.items():
        ours = fpq.dequantize(layer.quantized_weight, torch.float32)
        theirs = modelopt_dequantize(tensors, name, algo, tuple(ours.shape))
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), name
