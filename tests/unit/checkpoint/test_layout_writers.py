"""Issue 29, writing side: ``quantize_checkpoint`` / ``save_quantized`` with ``layout="compressed-tensors"`` and
``layout="modelopt"``, read back by the other tool: compressed-tensors 0.20.1 (its compressors' ``decompress`` of
the stored tensors, transformers' ``from_pretrained`` of the checkpoint, its presets' weights arguments) and
nvidia-modelopt 0.47 (``FP8QTensor`` / ``NVFP4QTensor`` / ``MXFP8QTensor`` / ``MXFP4QTensor.dequantize``,
``convert_hf_quant_config_format`` for ``config.json``, its own export of the same model for ``hf_quant_config.json``
and the tensors' names, dtypes and shapes), compared with ds_fpquant's ``dequantize`` bit for bit (or within the
derived bound where the consumer rounds); and by ``ds_fpquant.load_quantized``: codes and scales as written. Llama,
Qwen3 and a tiny DeepSeek-V3 (MLA attention, routed and shared experts)."""

import json
import warnings

import pytest
import torch
import transformers
from unit.checkpoint.test_modelopt_checkpoint import EXPERT_PARTS, modelopt_expert_dequantize
from unit.checkpoint.test_modelopt_checkpoint import modelopt_dequantize as modelopt_fp8_nvfp4_dequantize
from unit.moe_models import tiny_qwen3_moe
from unit.safetensors_files import read_tensors
from unit.tiny_models import tiny_gpt2, tiny_llama, tiny_qwen3

import ds_fpquant as fpq
from ds_fpquant.checkpoint.layouts import StaticActivationScalesWarning
from ds_fpquant.checkpoint.layouts.compressed_tensors import write as ct_write
from ds_fpquant.checkpoint.writer import LAYOUTS, GlobalScaleRoundingWarning
from ds_fpquant.cli.quantize import quantize_main
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.nn.quantized_params import quantized_experts

pytest.importorskip("compressed_tensors")
qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
from compressed_tensors.compressors import BaseCompressor, ModelCompressor  # noqa: E402
from compressed_tensors.compressors.mxfp6.helpers import pack_fp6_to_uint8  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize  # noqa: E402
from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format  # noqa: E402
from unit.checkpoint.test_more_layouts import MODELOPT_ALGOS, export_with_modelopt, llama_192  # noqa: E402
from unit.checkpoint.test_more_layouts import modelopt_dequantize as modelopt_block_mx_dequantize  # noqa: E402

MODELS = {"llama": tiny_llama, "qwen3": tiny_qwen3}

#: scheme -> (quantize settings, compressed-tensors format, weights strategy)
CT_SCHEMES = {
    "fp8_tensor": (dict(fmt="e4m3", granularity="tensor"), "float-quantized", "tensor"),
    "fp8_channel": (dict(fmt="e4m3", granularity="channel"), "float-quantized", "channel"),
    "fp8_block": (dict(fmt="e4m3", block=(32, 16)), "float-quantized", "block"),
    "fp8_group": (dict(fmt="e4m3", group_size=32), "float-quantized", "group"),
    "mxfp8": (dict(fmt="mxfp8_e4m3"), "mxfp8-quantized", "group"),
    "mxfp4": (dict(fmt="mxfp4"), "mxfp4-pack-quantized", "group"),
    "mxfp6": (dict(fmt="mxfp6_e2m3"), "mxfp6-pack-quantized", "group"),
    "nvfp4": (dict(fmt="nvfp4"), "nvfp4-pack-quantized", "tensor_group"),
}

#: MX scheme -> compressed-tensors' preset whose weights arguments it writes
CT_PRESETS = {"mxfp8": "MXFP8A16", "mxfp4": "MXFP4A16", "mxfp6": "MXFP6A16"}

#: scheme -> (quantize settings, quant_algo)
MO_SCHEMES = {
    "fp8_tensor": (dict(fmt="e4m3", granularity="tensor"), "FP8"),
    "fp8_channel": (dict(fmt="e4m3", granularity="channel"), "FP8_PER_CHANNEL_PER_TOKEN"),
    "nvfp4": (dict(fmt="nvfp4"), "W4A16_NVFP4"),
    "fp8_block": (dict(fmt="e4m3", block=(128, 128)), "fp8_pb_wo"),
    "mxfp8": (dict(fmt="mxfp8_e4m3"), "MXFP8"),
    "mxfp4": (dict(fmt="mxfp4"), "mxfp4"),
}


def modelopt_dequantize(tensors, base, algo, shape):
    """ModelOpt's own dequantization of one weight, fp32 (its FP8QTensor, NVFP4QTensor, MXFP8QTensor, MXFP4QTensor)."""
    if algo in MODELOPT_ALGOS or algo == "fp8_pb_real":
        return modelopt_block_mx_dequantize(tensors, base, algo, shape)
    return modelopt_fp8_nvfp4_dequantize(tensors, base, algo, shape)


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _mx_scales(qt):
    """The E8M0 group scales of an MX weight as fp32 powers of two, one per element."""
    return torch.ldexp(torch.ones(()), qt.scales.int() - 127).repeat_interleave(qt.group_size, dim=1)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """model kind -> a bf16 full-precision checkpoint directory."""
    out = {}
    for kind, make in MODELS.items():
        out[kind] = tmp_path_factory.mktemp(kind) / "src"
        make().to(torch.bfloat16).save_pretrained(out[kind])
    return out


def _write(how, src, dst, layout, settings):
    """Write ``src`` in ``layout``: ``quantize_checkpoint`` of the directory, or ``save_quantized`` of the model
    ``load_quantized`` quantizes while loading with the same settings. Returns the GlobalScaleRoundingWarnings and
    the weights written (module -> QuantizedTensor): for quantize_checkpoint, the same settings written in
    ds_fpquant's own layout and loaded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "quantize_checkpoint":
            fpq.quantize_checkpoint(src, dst, layout=layout, progress=False, **settings)
            fpq.quantize_checkpoint(src, dst.parent / "own", layout="ds_fpquant", progress=False, **settings)
            reference = _layers(fpq.load_quantized(dst.parent / "own"))
        else:
            model = fpq.load_quantized(src, fp_quantization=settings)
            fpq.save_quantized(model, dst, layout=layout)
            reference = _layers(model)
    return [w for w in caught if issubclass(w.category, GlobalScaleRoundingWarning)], reference


def _layers(model):
    return {n: m.quantized_weight for n, m in model.named_modules() if isinstance(m, FPQuantizedLinear)}


def _same_qt(a, b, name):
    """Codes, scales and tensor scale bit for bit (the other tools' readers name a per-tensor scale block (N, K),
    a per-channel one groups of K, where ds_fpquant records WHOLE sides: the same scaling) and the same weight."""
    assert (a.fmt, a.scale_format, tuple(a.shape)) == (b.fmt, b.scale_format, tuple(b.shape)), name
    assert torch.equal(a.codes, b.codes), name
    assert torch.equal(_bits(fpq.dequantize(a, torch.float32)), _bits(fpq.dequantize(b, torch.float32))), name
    assert torch.equal(_bits(a.scales) if a.scales.is_floating_point() else a.scales,
                       _bits(b.scales) if b.scales.is_floating_point() else b.scales), name
    assert (a.tensor_scale is None) == (b.tensor_scale is None), name
    if a.tensor_scale is not None:
        assert torch.equal(_bits(a.tensor_scale), _bits(b.tensor_scale)), name


# ------------------------------------------------------------------------------------------- compressed-tensors


def _ct_decompress(tensors, base, qconfig, fp32: bool = False):
    """compressed-tensors' own decompression of one stored weight: its format's compressor on the tensors as stored
    (fp32 FP8 scales stay fp32; the FP4 compressors unpack to bf16 and round the fp32 product to it). ``fp32``
    (NVFP4): its ``dequantize`` on the codes unpacked to fp32, ``fl(decode(q) * fl(decode(c) / g))`` unrounded."""
    group = qconfig["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    local = {k[len(base) + 1:]: v for k, v in tensors.items() if k.startswith(base + ".") and "." not in k[len(base) + 1:]}
    if fp32:
        n, half = local["weight_packed"].shape
        codes = unpack_fp4_from_uint8(local["weight_packed"], n, 2 * half, dtype=torch.float32)
        return ct_dequantize(x_q=codes, scale=local["weight_scale"].float(), args=scheme.weights,
                             global_scale=local["weight_global_scale"], dtype=torch.float32)
    return BaseCompressor.get_value_from_registry(qconfig["format"]).decompress(local, scheme)["weight"]


@pytest.mark.parametrize("how", ["quantize_checkpoint", "save_quantized"])
@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("scheme", sorted(CT_SCHEMES))
def test_compressed_tensors_layout_read_by_compressed_tensors(sources, tmp_path, how, kind, scheme):
    settings, fmt, strategy = CT_SCHEMES[scheme]
    inexact, reference = _write(how, sources[kind], tmp_path / "ct", "compressed-tensors", settings)
    qconfig = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)  # compressed-tensors' own reading of the config
    assert parsed.format == fmt and parsed.quantization_status == "compressed" and parsed.ignore == ["lm_head"]
    assert parsed.config_groups["group_0"].weights.strategy == strategy
    assert parsed.config_groups["group_0"].targets == ["Linear"]
    if scheme in CT_PRESETS:  # the weights arguments as compressed-tensors dumps its own preset, scale_dtype included
        preset = preset_name_to_scheme(CT_PRESETS[scheme], ["Linear"]).weights.model_dump()
        assert qconfig["config_groups"]["group_0"]["weights"] == preset == parsed.config_groups["group_0"].weights.model_dump()
    tensors = read_tensors(tmp_path / "ct")
    loaded = _layers(fpq.load_quantized(tmp_path / "ct"))
    assert sorted(loaded) == sorted(reference) and "lm_head" not in loaded
    assert len(inexact) <= 1  # one warning for the checkpoint, counting the weights
    flagged = 0
    for name, qt in reference.items():
        theirs = _ct_decompress(tensors, name, qconfig)
        assert torch.equal(_bits(fpq.dequantize(qt, theirs.dtype)), _bits(theirs)) or qt.fmt == "nvfp4", name
        if qt.fmt == "mxfp6_e2m3":  # the bytes are what compressed-tensors' own packer makes of the e2m3 values
            values = fpq.dequantize(qt, torch.float32) / _mx_scales(qt)
            assert torch.equal(tensors[f"{name}.weight_packed"], pack_fp6_to_uint8(values)), name
        g, exact = (ct_write.global_scale(qt.tensor_scale, qt.scales) if qt.fmt == "nvfp4" else (None, True))
        ours = fpq.dequantize(qt, torch.float32)
        if qt.fmt != "nvfp4":
            theirs = None  # compared above, in the compressor's output dtype (fp32 for FP8, bf16 for MX)
        else:
            if exact:  # the library's own bf16 output too
                assert torch.equal(_bits(fpq.dequantize(qt, theirs.dtype)), _bits(theirs)), name
            theirs = _ct_decompress(tensors, name, qconfig, fp32=True)
        if theirs is None:
            pass
        elif exact:
            assert torch.equal(_bits(ours), _bits(theirs)), name
        else:
            # fl(decode(c) / g) and fl(decode(c) * t) differ by at most one fp32 ulp (|1/g - t| <= 2^-24 t, both
            # rounded): 2^-23 of the scale; decode(q) times each scale rounds once more (2^-24 each): 2^-22 of |w|
            assert qt.fmt == "nvfp4" and inexact, name
            flagged += 1
            assert bool(((ours - theirs).abs() <= 2 ** -22 * ours.abs() * (1 + 2 ** -20)).all()), name
        if qt.fmt == "nvfp4" and not (exact and torch.equal(torch.ones(()) / g, qt.tensor_scale)):
            # ds_fpquant reads back what compressed-tensors dequantizes: the same codes, scales fl(decode(c) / g)
            assert torch.equal(loaded[name].codes, qt.codes), name
            assert torch.equal(_bits(fpq.dequantize(loaded[name], torch.float32)), _bits(theirs)), name
        else:
            _same_qt(loaded[name], qt, name)
    assert flagged == (int(str(inexact[0].message).split()[0]) if inexact else 0)


@pytest.mark.parametrize("scheme", sorted(CT_SCHEMES))
def test_compressed_tensors_layout_through_transformers(sources, tmp_path, scheme):
    """transformers' compressed-tensors loader. With ``dequantize`` (``run_compressed=False``) it dequantizes the
    stored tensors in fp32 and rounds to the model dtype once: ds_fpquant's ``dequantize(qt, bf16)`` bit for bit
    (NVFP4 too, here). Compressed (the default), it holds FP8 ``weight_scale`` in the model dtype (bf16, rounded
    from the fp32 on disk) and its ``decompress_model`` computes ``fl_bf16(decode(q) * bf16(s))``: at most
    ``3 * 2^-8`` of ``|decode(q) * s|`` from ours (bf16's unit roundoff 2^-8 on the scale and on each product)."""
    settings, fmt, _ = CT_SCHEMES[scheme]
    _write("quantize_checkpoint", sources["llama"], tmp_path / "ct", "compressed-tensors", settings)
    ours = _layers(fpq.load_quantized(tmp_path / "ct"))
    config = transformers.CompressedTensorsConfig(run_compressed=False)
    dense = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct", quantization_config=config)
    compressed = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct")
    ModelCompressor.from_pretrained_model(compressed).decompress_model(compressed)
    for name, qt in ours.items():
        mine = fpq.dequantize(qt, torch.bfloat16)
        assert dense.get_submodule(name).weight.dtype == torch.bfloat16
        assert torch.equal(_bits(dense.get_submodule(name).weight), _bits(mine)), name
        theirs = compressed.get_submodule(name).weight
        if fmt == "float-quantized":
            exact = fpq.dequantize(qt, torch.float32).double()
            assert bool(((theirs.double() - mine.double()).abs() <= 3 * 2 ** -8 * exact.abs() * (1 + 2 ** -7)).all())
        else:  # e4m3 / E8M0 scales and fp32 global scales are held as stored
            assert torch.equal(_bits(theirs), _bits(mine)), name


def test_nvfp4_global_scale_divisor():
    """``weight_global_scale`` for a power-of-two tensor scale reproduces every code exactly; for others the
    exactness claimed is checked code by code against fp32 arithmetic, and ``fl(1/g) == t`` when it is."""
    values = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    for k in (-20, -3, 0, 5):
        t = torch.tensor(2.0 ** k)
        g, exact = ct_write.global_scale(t)
        assert exact and g.item() == 2.0 ** -k
    torch.manual_seed(0)
    found = 0
    for t in (torch.rand(64) * 3 / 2688).float():
        g, exact = ct_write.global_scale(t)
        assert exact == torch.equal(values / g, values * t)
        if exact:
            found += 1
            assert torch.equal(torch.ones(()) / g, t)
        # codes 1.0, 2.0 and the NaN code: exact exactly when fl(1 / g) is t (2/g is 2 * (1/g); NaN is NaN)
        codes = torch.tensor([0x38, 0x40, 0x7F], dtype=torch.uint8)
        assert ct_write.global_scale(t, codes)[1] == torch.equal(torch.ones(()) / g, t)
    assert 0 < found < 64


# ------------------------------------------------------------------------------------------------------ ModelOpt


def _check_modelopt_files(path, algo):
    hf = json.loads((path / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt" and hf["quantization"]["quant_algo"] == algo
    assert hf["quantization"]["kv_cache_quant_algo"] is None and hf["quantization"]["exclude_modules"] == ["lm_head"]
    # ModelOpt 0.47's export writes group_size for NVFP4 and MXFP8, none for fp8_pb_wo and mxfp4
    assert hf["quantization"].get("group_size") == {"W4A16_NVFP4": 16, "MXFP8": 32}.get(algo)
    qconfig = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qconfig == convert_hf_quant_config_format(hf)  # what ModelOpt's own export derives from it


@pytest.mark.parametrize("how", ["quantize_checkpoint", "save_quantized"])
@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("scheme", sorted(MO_SCHEMES))
def test_modelopt_layout_read_by_modelopt(sources, tmp_path, how, kind, scheme):
    settings, algo = MO_SCHEMES[scheme]
    _, reference = _write(how, sources[kind], tmp_path / "mo", "modelopt", settings)
    _check_modelopt_files(tmp_path / "mo", algo)
    tensors = read_tensors(tmp_path / "mo")
    assert not any(k.endswith("input_scale") for k in tensors)  # weight-only: no activation scales invented
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaticActivationScalesWarning)
        loaded = _layers(fpq.load_quantized(tmp_path / "mo"))
    assert sorted(loaded) == sorted(reference)
    for name, qt in reference.items():
        ours = fpq.dequantize(qt, torch.float32)
        theirs = modelopt_dequantize(tensors, name, algo, ours.shape)
        nonzero = theirs != 0  # ModelOpt's NVFP4 gives +0 for the code -0
        assert torch.equal(ours == 0, ~nonzero) and torch.equal(_bits(ours[nonzero]), _bits(theirs[nonzero])), name
        _same_qt(loaded[name], qt, name)


def test_modelopt_nvfp4_qwen3_moe_experts(tmp_path):
    """A Qwen3-MoE written in ModelOpt's NVFP4 layout, per-expert keys (``mlp.experts.{e}.gate_proj`` ...): ModelOpt's
    dequantization of each expert's parts stacked is ds_fpquant's expert matrix; gate and up of an expert share
    ``weight_scale_2`` (quantized together, as ModelOpt's export does); load_quantized gets the same codes and
    scales back, from quantize_checkpoint and from save_quantized."""
    src = tmp_path / "src"
    tiny_qwen3_moe().to(torch.bfloat16).save_pretrained(src)
    fpq.quantize_checkpoint(src, tmp_path / "q", "nvfp4", layout="modelopt", progress=False)
    _check_modelopt_files_moe = json.loads((tmp_path / "q" / "hf_quant_config.json").read_text())
    assert _check_modelopt_files_moe["quantization"]["quant_algo"] == "W4A16_NVFP4"
    tensors = read_tensors(tmp_path / "q")
    base = "model.layers.1.mlp.experts"
    assert f"{base}.0.gate_proj.weight_scale_2" in tensors
    model = fpq.load_quantized(tmp_path / "q")
    experts = quantized_experts(model.model.layers[1].mlp.experts)
    for pname, parts in EXPERT_PARTS:
        for e, qt in enumerate(experts[pname]):
            ours = fpq.dequantize(qt, torch.float32)
            theirs = modelopt_expert_dequantize(tensors, base, e, parts, "W4A16_NVFP4", modelopt_dequantize,
                                                ours.shape[1])
            nonzero = theirs != 0
            assert torch.equal(_bits(ours[nonzero]), _bits(theirs[nonzero])) and torch.equal(ours == 0, ~nonzero)
        if pname == "gate_up_proj":
            assert torch.equal(tensors[f"{base}.0.gate_proj.weight_scale_2"], tensors[f"{base}.0.up_proj.weight_scale_2"])
    fpq.save_quantized(model, tmp_path / "again", layout="modelopt")
    again = fpq.load_quantized(tmp_path / "again")
    for pname, qts in experts.items():
        for e, (a, b) in enumerate(zip(qts, quantized_experts(again.model.layers[1].mlp.experts)[pname])):
            _same_qt(b, a, f"{pname}[{e}]")


def test_compressed_tensors_mxfp4_qwen3_moe_experts(tmp_path):
    """The expert machinery in the compressed-tensors layout: per-expert ``weight_packed`` / ``weight_scale``,
    compressed-tensors' MXFP4 compressor's decompression of each is ds_fpquant's matrix bit for bit."""
    src = tmp_path / "src"
    tiny_qwen3_moe().to(torch.bfloat16).save_pretrained(src)
    fpq.quantize_checkpoint(src, tmp_path / "q", "mxfp4", layout="compressed-tensors", progress=False)
    qconfig = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    tensors = read_tensors(tmp_path / "q")
    experts = quantized_experts(fpq.load_quantized(tmp_path / "q").model.layers[1].mlp.experts)
    base = "model.layers.1.mlp.experts"
    for pname, parts in [("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))]:
        for e, qt in enumerate(experts[pname]):
            theirs = torch.cat([_ct_decompress(tensors, f"{base}.{e}.{p}", qconfig).float() for p in parts])
            assert torch.equal(_bits(fpq.dequantize(qt, torch.float32)), _bits(theirs)), (pname, e)


@pytest.mark.parametrize("algo,model", [("fp8_pb_wo", "llama64"), ("fp8_pb_wo", "llama192"), ("MXFP8", "llama64"),
                                        ("mxfp4", "llama64")])
def test_modelopt_layout_is_what_modelopts_export_writes(tmp_path, algo, model):
    """The same model written by ds_fpquant and exported by ModelOpt 0.47 itself (``mtq.quantize`` with the preset,
    ``export_hf_checkpoint``): ``hf_quant_config.json`` and ``config.json``'s ``quantization_config`` equal, key order
    included, but for the excluded modules (ModelOpt also lists the embeddings, which have no quantizer; ds_fpquant
    the linears it kept), and the same tensors under the same names, dtypes and shapes (fp8_pb_wo: its block amax
    shape ``(Nb, 1, Kb, 1)``, 0-dim for one block; llama192's matrices have partial edge blocks)."""
    make = {"llama64": tiny_llama, "llama192": llama_192}[model]
    make().save_pretrained(tmp_path / "src")
    settings = next(s for s, a in MO_SCHEMES.values() if a == algo)
    fpq.quantize_checkpoint(tmp_path / "src", tmp_path / "ours", layout="modelopt", progress=False, **settings)
    export_with_modelopt(make(), MODELOPT_ALGOS[algo], tmp_path / "theirs")
    ours, theirs = ({f: json.loads((tmp_path / d / f).read_text()) for f in ("hf_quant_config.json", "config.json")}
                    for d in ("ours", "theirs"))
    assert ours["hf_quant_config.json"]["quantization"].pop("exclude_modules") == ["lm_head"]
    assert "lm_head" in theirs["hf_quant_config.json"]["quantization"].pop("exclude_modules")
    assert json.dumps(ours["hf_quant_config.json"]) == json.dumps(theirs["hf_quant_config.json"])
    ours_q, theirs_q = ours["config.json"]["quantization_config"], theirs["config.json"]["quantization_config"]
    assert ours_q.pop("ignore") == ["lm_head"] and "lm_head" in theirs_q.pop("ignore")
    assert json.dumps(ours_q) == json.dumps(theirs_q)
    mine, exported = read_tensors(tmp_path / "ours"), read_tensors(tmp_path / "theirs")
    assert sorted(mine) == sorted(exported)
    scales = [k for k in exported if k.endswith(".weight_scale")]
    assert len(scales) == (14 if model == "llama64" else 7)
    for key in mine:
        assert (mine[key].dtype, mine[key].shape) == (exported[key].dtype, exported[key].shape), key
    if algo == "fp8_pb_wo":
        assert {exported[k].dim() for k in scales} == ({0} if model == "llama64" else {4})


def tiny_deepseek_v3():
    """A 2-layer DeepSeek-V3 (MLA with q / kv LoRA ranks 32, layer 0 a dense MLP, layer 1 four routed experts of 32
    and a shared one) whose linears all have in_features a multiple of 32 (MX groups), seeded, eval mode."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                           first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32,
                                           kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                           max_position_embeddings=64)
    return transformers.DeepseekV3ForCausalLM(config).eval()


@pytest.mark.parametrize("layout,fmt,how", [("modelopt", "e4m3", "quantize_checkpoint"),
                                            ("modelopt", "mxfp4", "save_quantized"),
                                            ("compressed-tensors", "mxfp6_e2m3", "quantize_checkpoint"),
                                            ("compressed-tensors", "mxfp6_e2m3", "save_quantized")])
def test_deepseek_v3_in_the_new_layouts(tmp_path, layout, fmt, how):
    """A tiny DeepSeek-V3 in ModelOpt's fp8_pb_wo (e4m3's default 128x128 blocks) / mxfp4 and compressed-tensors'
    mxfp6-pack-quantized: every dense linear (MLA's q_a / q_b / kv_a / kv_b / o, the dense and shared MLPs) and every
    routed expert (per-expert ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, gate over up) dequantized
    by the other tool is ds_fpquant's weight bit for bit; load_quantized reads the same codes and scales back."""
    src = tmp_path / "src"
    tiny_deepseek_v3().to(torch.bfloat16).save_pretrained(src)
    if how == "quantize_checkpoint":
        fpq.quantize_checkpoint(src, tmp_path / "q", fmt, layout=layout, progress=False)
        fpq.quantize_checkpoint(src, tmp_path / "own", fmt, layout="ds_fpquant", progress=False)
        reference = fpq.load_quantized(tmp_path / "own")
    else:
        reference = fpq.load_quantized(src, fp_quantization={"fmt": fmt})
        fpq.save_quantized(reference, tmp_path / "q", layout=layout)
    tensors = read_tensors(tmp_path / "q")
    qconfig = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    if layout == "modelopt":
        hf = json.loads((tmp_path / "q" / "hf_quant_config.json").read_text())
        algo = hf["quantization"]["quant_algo"]
        assert algo == {"e4m3": "fp8_pb_wo", "mxfp4": "mxfp4"}[fmt] and qconfig == convert_hf_quant_config_format(hf)

        def theirs(base, shape):
            return modelopt_dequantize(tensors, base, algo, shape)
    else:
        assert QuantizationConfig.model_validate(qconfig).format == "mxfp6-pack-quantized"

        def theirs(base, shape):
            return _ct_decompress(tensors, base, qconfig)
    loaded = fpq.load_quantized(tmp_path / "q")
    dense, got = _layers(reference), _layers(loaded)
    assert sorted(got) == sorted(dense)
    assert {n.rsplit(".", 1)[1] for n in dense} >= {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    assert any(".shared_experts." in n for n in dense)
    for name, qt in dense.items():
        _same_qt(got[name], qt, name)
        other = theirs(name, tuple(qt.shape))
        assert torch.equal(_bits(fpq.dequantize(qt, other.dtype)), _bits(other)), name
    base = "model.layers.1.mlp.experts"
    ours_experts = quantized_experts(reference.model.layers[1].mlp.experts)
    got_experts = quantized_experts(loaded.model.layers[1].mlp.experts)
    assert set(ours_experts) == set(got_experts) == {"gate_up_proj", "down_proj"}
    for pname, parts in EXPERT_PARTS:
        assert len(ours_experts[pname]) == 4
        for e, qt in enumerate(ours_experts[pname]):
            _same_qt(got_experts[pname][e], qt, f"{pname}[{e}]")
            rows, cols = qt.shape[0] // len(parts), qt.shape[1]  # gate and up: 32 rows each
            other = torch.cat([theirs(f"{base}.{e}.{p}", (rows, cols)) for p in parts])
            assert torch.equal(_bits(fpq.dequantize(qt, other.dtype)), _bits(other)), (pname, e)


# ------------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("layout,settings,message", [
    ("modelopt", dict(fmt="mxfp6_e3m2"), r"layout='modelopt' cannot hold fmt='mxfp6_e3m2'.*it holds e4m3"),
    ("modelopt", dict(fmt="e4m3", block=(64, 64)),
     r"layout='modelopt' cannot hold fmt='e4m3' .*block=\(64, 64\) \(ModelOpt's block FP8, fp8_pb_wo, records no block "
     r"size: its readers assume 128x128\)"),
    ("modelopt", dict(fmt="e4m3", block=(128, 64)), r"layout='modelopt' cannot hold .*block=\(128, 64\).*128x128"),
    ("modelopt", dict(fmt="e4m3", group_size=128), r"layout='modelopt' cannot hold fmt='e4m3' .*(block=\(1, 128\)|group_size=128)"),
    ("modelopt", dict(fmt="e4m3", block=(128, 128), scale_format="e8m0"), r"layout='modelopt' .*'e8m0'"),
    ("modelopt", dict(fmt="e4m3", granularity="tensor", scale_format="e8m0"), r"layout='modelopt' .*'e8m0'"),
    ("modelopt", dict(fmt="e3m2", group_size=32), r"layout='modelopt' cannot hold fmt='e3m2'"),
    ("compressed-tensors", dict(fmt="e5m2", granularity="channel"), r"layout='compressed-tensors' cannot hold fmt='e5m2'"),
    ("compressed-tensors", dict(fmt="e4m3", block=(32, 32), scale_format="e8m0"), r"scale_format='e8m0'.*holds"),
    ("compressed-tensors", dict(fmt="mxfp6_e3m2"), r"cannot hold fmt='mxfp6_e3m2'.*mxfp6_e2m3"),
    ("fp8", dict(fmt="nvfp4"), r"layout='fp8' cannot hold fmt='nvfp4'"),
    ("vllm", dict(fmt="e4m3"), r"layout.*'vllm'"),
])
def test_bad_layout_combinations_are_refused_before_writing(sources, tmp_path, layout, settings, message):
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        fpq.quantize_checkpoint(sources["llama"], dst, layout=layout, progress=False, **settings)
    assert not dst.exists()
    if layout != "vllm":
        model = fpq.load_quantized(sources["llama"], fp_quantization=settings)
        with pytest.raises(ValueError, match=message):
            fpq.save_quantized(model, dst, layout=layout)
        assert not dst.exists()


@pytest.mark.parametrize("layout,settings", [("compressed-tensors", dict(fmt="e4m3", group_size=48)),
                                             ("compressed-tensors", dict(fmt="mxfp4")),
                                             ("compressed-tensors", dict(fmt="mxfp6_e2m3")),
                                             ("modelopt", dict(fmt="nvfp4")),
                                             ("modelopt", dict(fmt="mxfp8_e4m3")),
                                             ("modelopt", dict(fmt="mxfp4"))])
def test_partial_groups_are_refused_where_the_readers_refuse_them(tmp_path, layout, settings):
    """compressed-tensors' group strategies, ModelOpt's NVFP4 and MX need ``K`` a multiple of the group (compressed-
    tensors' decompress raises "tensor column shape must be divisble by the given group_size"; ModelOpt's
    MXFP8QTensor / MXFP4QTensor quantize whole groups of 32, ds_fpquant's reader refuses others): refused before
    writing, naming the weights. A 2-D block cut by the matrix edge is fine (compressed-tensors pads)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=72, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    src = tmp_path / "src"
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(src)  # down_proj has K = 72
    with pytest.raises(ValueError, match=rf"layout='{layout}' stores groups of .*model.layers.0.mlp.down_proj"):
        fpq.quantize_checkpoint(src, tmp_path / "out", layout=layout, progress=False, **settings)
    assert not (tmp_path / "out").exists()
    model = fpq.load_quantized(src, fp_quantization=settings)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj"):
        fpq.save_quantized(model, tmp_path / "out", layout=layout)
    assert not (tmp_path / "out").exists()
    fpq.quantize_checkpoint(src, tmp_path / "blocks", "e4m3", block=(48, 48), layout="compressed-tensors", progress=False)
    qconfig = json.loads((tmp_path / "blocks" / "config.json").read_text())["quantization_config"]
    tensors = read_tensors(tmp_path / "blocks")
    qt = fpq.load_quantized(tmp_path / "blocks").model.layers[0].mlp.down_proj.quantized_weight
    theirs = _ct_decompress(tensors, "model.layers.0.mlp.down_proj", qconfig)
    assert torch.equal(_bits(fpq.dequantize(qt, torch.float32)), _bits(theirs))


def test_conv1d_weights_are_refused_by_the_other_tools_layouts(tmp_path):
    src = tmp_path / "gpt2"
    tiny_gpt2().save_pretrained(src)
    with pytest.raises(ValueError, match=r"layout='modelopt' stores Linear \(out, in\).*Conv1D"):
        fpq.quantize_checkpoint(src, tmp_path / "out", "nvfp4", layout="modelopt", progress=False)
    assert not (tmp_path / "out").exists()


def test_layout_names_are_the_quant_methods_written():
    from ds_fpquant.checkpoint.layouts.modelopt import write as modelopt_write
    from ds_fpquant.checkpoint.layouts.native.read import FP8_METHOD, OWN_METHOD

    assert LAYOUTS == (FP8_METHOD, ct_write.LAYOUT, modelopt_write.LAYOUT, OWN_METHOD)
    assert ct_write.LAYOUT == "compressed-tensors" and modelopt_write.LAYOUT == "modelopt"


def test_default_layout_is_unchanged(sources, tmp_path):
    fpq.quantize_checkpoint(sources["llama"], tmp_path / "a", "e4m3", progress=False)
    fpq.quantize_checkpoint(sources["llama"], tmp_path / "b", "nvfp4", progress=False)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["quant_method"] == "ds_fpquant"


def test_cli_layout(sources, tmp_path, capsys):
    assert quantize_main([str(sources["llama"]), str(tmp_path / "q"), "--fmt", "nvfp4", "--layout", "modelopt",
                          "--no-progress"]) == 0
    assert "quant_method 'modelopt'" in capsys.readouterr().out
    assert (tmp_path / "q" / "hf_quant_config.json").is_file()
    with pytest.raises(SystemExit):
        quantize_main([str(sources["llama"]), str(tmp_path / "r"), "--fmt", "e3m2", "--layout", "modelopt",
                       "--no-progress"])
    assert "layout='modelopt' cannot hold fmt='e3m2'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quantize_main([str(sources["llama"]), str(tmp_path / "s"), "--layout", "awq", "--no-progress"])


@pytest.mark.parametrize("layout,fmt", [("modelopt", "nvfp4"), ("compressed-tensors", "mxfp4")])
def test_stored_expert_stacks_in_the_other_tools_layouts(tmp_path, monkeypatch, layout, fmt):
    """A model without per-expert keys (simulated: ``CheckpointKeys.unfuse`` finds none) gets its experts written as
    stacks ``<p>`` + the layout's suffixes (``_scale``, ``_scale_2`` / ``_packed``), as for the other layouts;
    load_quantized reads the same codes and scales back."""
    from ds_fpquant.checkpoint.keys import CheckpointKeys

    src = tmp_path / "src"
    tiny_qwen3_moe().to(torch.bfloat16).save_pretrained(src)
    model = fpq.load_quantized(src, fp_quantization={"fmt": fmt})
    monkeypatch.setattr(CheckpointKeys, "unfuse", lambda self, key, shape: None)
    fpq.save_quantized(model, tmp_path / "q", layout=layout)
    tensors = read_tensors(tmp_path / "q")
    stack = "model.layers.1.mlp.experts.gate_up_proj"
    assert (f"{stack}_scale_2" if layout == "modelopt" else f"{stack}_packed") in tensors
    assert not any(".experts.0." in k for k in tensors)
    loaded = fpq.load_quantized(tmp_path / "q")
    ours = quantized_experts(model.model.layers[1].mlp.experts)
    for pname, qts in quantized_experts(loaded.model.layers[1].mlp.experts).items():
        for e, qt in enumerate(qts):
            _same_qt(qt, ours[pname][e], f"{pname}[{e}]")
