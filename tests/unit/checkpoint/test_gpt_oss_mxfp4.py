"""Issue 29: gpt-oss's MXFP4 layout (``quant_method: "mxfp4"``: experts only, ``<p>_blocks`` uint8 (E, out, in/32,
16) and ``<p>_scales`` E8M0 uint8 (E, out, in/32) of each expert's (out, in) matrix, the model holding (E, in, out)).

The oracle is transformers' own reader, ``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))``
(the CPU path without triton): ds_fpquant's dequantized experts equal its parameters bit for bit. The official
files are built here by an independent packer written from the quantizer gpt-oss and transformers use
(triton_kernels' ``downcast_to_mxfp_torch``, default ROUND_UP scales): the scale is ``fl(amax / 6)`` rounded up
to a power of two (not OCP MX's ``floor(log2(amax)) - 2``), codes round to nearest with ties away from zero,
and an all-zero group gets the scale byte 0."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file
from unit.linear_bound import LinearCalls, assert_as_accurate_as
from unit.safetensors_files import read_tensors
from unit.tiny_models import tiny_gpt_oss

import ds_fpquant as fpq
from ds_fpquant.checkpoint import writer as checkpoint
from ds_fpquant.nn.quantized_params import quantized_experts

GPT_OSS_QCONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
PROJS = ("gate_up_proj", "down_proj")
IDS = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def official_pack(w: torch.Tensor):
    """(blocks (N, K/32, 16), scales (N, K/32)) of an (N, K) matrix by gpt-oss's quantizer's rule, written from its
    definition (bf16 input as it casts, fp32 arithmetic): independent of ds_fpquant."""
    x = w.to(torch.bfloat16).float().reshape(w.shape[0], -1, 32)
    amax = x.abs().amax(-1, keepdim=True)
    bits = (amax / 6.0).view(torch.int32)
    rounded = (bits + 0x7FFFFF) & 0x7F800000  # up to a power of two; 0 stays 0 (byte 0)
    scale = rounded.view(torch.float32)
    v = (x * torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)).double()
    midpoints = (E2M1[1:] + E2M1[:-1]) / 2
    magnitude = (v.abs().unsqueeze(-1) >= midpoints).sum(-1)  # nearest, ties away from zero, saturating at 6
    codes = (magnitude | (torch.signbit(v).long() << 3)).to(torch.uint8).reshape(w.shape[0], -1, 16, 2)
    return codes[..., 0] | (codes[..., 1] << 4), (rounded >> 23).to(torch.uint8).squeeze(-1)


def official_decode(blocks, scales):
    """``decode(nibble) * 2^(byte - 127)`` in fp64 for (N, K/32, 16) blocks, as an (N, K) matrix."""
    values = torch.cat([E2M1, -E2M1])
    pairs = torch.stack([values[(blocks & 0xF).long()], values[(blocks >> 4).long()]], -1).reshape(*scales.shape, 32)
    return (pairs * torch.exp2(scales.double() - 127).unsqueeze(-1)).reshape(scales.shape[0], -1)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """The tiny GptOss in bf16, as save_pretrained writes it."""
    path = tmp_path_factory.mktemp("gpt_oss") / "src"
    tiny_gpt_oss().to(torch.bfloat16).save_pretrained(path)
    return path


def _official(src, dst, qconfig=GPT_OSS_QCONFIG, edit=None):
    """gpt-oss's layout of ``src`` by :func:`official_pack` (each expert's (out, in) matrix ``w[e].T``)."""
    tensors = read_tensors(src)
    for key in [k for k in tensors if k.endswith(tuple(f"experts.{p}" for p in PROJS))]:
        stack = tensors.pop(key)
        packed = [official_pack(stack[e].t()) for e in range(stack.shape[0])]
        tensors[key + "_blocks"] = torch.stack([b for b, _ in packed])
        tensors[key + "_scales"] = torch.stack([s for _, s in packed])
    if edit is not None:
        edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config))
    return tensors


def _transformers(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16,
        experts_implementation="eager").eval()  # the per-expert loop (grouped_mm has no fp64)


def _bits(t):
    return t.contiguous().view(torch.int16)


def _assert_same_experts(ours, theirs):
    """Every expert weight of ``ours`` (ds_fpquant), dequantized in bf16, bit-equal to ``theirs`` (transformers)."""
    checked = 0
    for name, module in ours.named_modules():
        for pname, experts in quantized_experts(module).items():
            mine = torch.stack([fpq.dequantize(qt, torch.bfloat16).t() for qt in experts])
            reference = theirs.get_submodule(name)._parameters[pname]
            assert reference.dtype == torch.bfloat16 and torch.equal(_bits(mine), _bits(reference)), f"{name}.{pname}"
            checked += 1
    assert checked == 2 * len(ours.model.layers)


def test_official_file_loads_bit_exact_against_transformers(src, tmp_path, monkeypatch):
    stored = _official(src, tmp_path / "official")
    ours, theirs = fpq.load_quantized(tmp_path / "official"), _transformers(tmp_path / "official")
    for layer, block in enumerate(ours.model.layers):  # the codes and scales as stored, no requantization
        for proj in PROJS:
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            for e, qt in enumerate(quantized_experts(block.mlp.experts)[proj]):
                assert (qt.fmt, qt.group_size, qt.scale_format) == ("mxfp4", 32, "e8m0")
                assert torch.equal(qt.codes.reshape(stored[key + "_blocks"][e].shape), stored[key + "_blocks"][e])
                assert torch.equal(qt.scales, stored[key + "_scales"][e])
                assert torch.equal(fpq.dequantize(qt, torch.float32).double(), official_decode(
                    stored[key + "_blocks"][e], stored[key + "_scales"][e]))  # what the packer meant
    _assert_same_experts(ours, theirs)
    held = {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())}
    rest = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
    assert all(torch.equal(t, held[k]) for k, t in rest.items() if k in held)
    assert {k for k in held if k not in rest} == {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in PROJS}
    # the forward: ours (the quantized linear, x @ w[e] of the (E, in, out) stand-in) against transformers'
    # model holding the same dequantized weights, both in fp32, with that model in fp64 as the exact value
    calls = LinearCalls(monkeypatch)
    with torch.no_grad():
        got = ours.float()(IDS).logits
        baseline = theirs.float()(IDS).logits
        exact = theirs.double()(IDS).logits
    calls.assert_each_within_bound()
    assert len(calls.calls) >= 2 * 2 * 2  # both layers, gate_up and down, more than one routed expert
    assert_as_accurate_as(got, baseline, exact)


def test_our_mxfp4_preset_against_gpt_oss_quantizer_rule():
    """Same scales for every group with a nonzero element; the codes differ only at exact ties that round to an
    odd e2m1 code's neighbour (0.25, 1.25, 2.5, 5 times the scale: ties to even down, gpt-oss's quantizer away
    from zero); an all-zero group: byte 127 here, 0 there, both decode to zeros."""
    torch.manual_seed(0)
    w = torch.randn(64, 128).to(torch.bfloat16)
    w[0, :32] = 0  # an all-zero group
    w[1, :8] = torch.tensor([6.0, 0.25, 1.25, 2.5, 5.0, -2.5, 0.75, 3.5])  # scale 2^0: ties of each kind
    qt = fpq.quantize(w, "mxfp4")
    blocks, scales = official_pack(w)
    zero = (w.reshape(64, -1, 32) == 0).all(-1)
    assert torch.equal(qt.scales[~zero], scales[~zero]) and bool((qt.scales[zero] == 127).all())
    assert bool((scales[zero] == 0).all())
    ours = fpq.dequantize(qt, torch.float32).double()
    theirs = official_decode(blocks, scales)
    differ = ours != theirs
    s = torch.exp2(qt.scales.double() - 127).repeat_interleave(32, 1)
    v = w.double() / s
    down_ties = torch.zeros_like(differ)
    for tie in (0.25, 1.25, 2.5, 5.0):
        down_ties |= v.abs() == tie
    assert torch.equal(differ, down_ties) and bool(differ[1, 1:6].all()) and not bool(differ[1, [0, 6, 7]].any())
    assert bool((theirs[differ].abs() > ours[differ].abs()).all())  # away from zero there, to even here
    assert 0 < int(differ.sum()) < differ.numel() // 10


def test_quantize_checkpoint_writes_gpt_oss_layout_that_transformers_reads(src, tmp_path):
    summary = checkpoint.quantize_checkpoint(src, tmp_path / "q", "mxfp4", progress=False)
    assert summary["quantization_config"] == GPT_OSS_QCONFIG and summary["quantized"] == 4
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"] == GPT_OSS_QCONFIG
    written, source = read_tensors(tmp_path / "q"), read_tensors(src)
    stacks = {k for k in source if k.endswith(tuple(f"experts.{p}" for p in PROJS))}
    assert set(written) == (set(source) - stacks) | {k + s for k in stacks for s in ("_blocks", "_scales")}
    assert all(torch.equal(written[k], t) for k, t in source.items() if k not in stacks)  # attention etc. as stored
    for key in stacks:  # along the input dim: each expert's (out, in) matrix, ds_fpquant's mxfp4 codes as they are
        for e in range(source[key].shape[0]):
            qt = fpq.quantize(source[key][e].t(), "mxfp4")
            assert torch.equal(written[key + "_blocks"][e].reshape(qt.codes.shape), qt.codes)
            assert torch.equal(written[key + "_scales"][e], qt.scales)
    ours = fpq.load_quantized(tmp_path / "q")
    _assert_same_experts(ours, _transformers(tmp_path / "q"))
    with torch.no_grad():
        logits = ours(IDS).logits
    # save_quantized of the loaded model writes the same files, byte for byte
    saved = checkpoint.save_quantized(ours, tmp_path / "saved")
    assert saved["quantization_config"] == GPT_OSS_QCONFIG
    again = read_tensors(tmp_path / "saved")
    assert again.keys() == written.keys() and all(torch.equal(again[k].view(-1).view(torch.uint8),
                                                              written[k].view(-1).view(torch.uint8)) for k in again)
    with torch.no_grad():
        assert torch.equal(fpq.load_quantized(tmp_path / "saved")(IDS).logits, logits)


def test_apply_quantizes_gpt_oss_experts_along_the_input_dim(src):
    """apply (and so save_quantized in ds_fpquant's layout) quantizes each expert's (out, in) matrix; before,
    the groups ran along the output dim of the (E, in, out) parameter."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(PROJS)}
    fpq.apply(model, {"fp_quantization": {"fmt": "mxfp4"}})
    experts = quantized_experts(model.model.layers[1].mlp.experts)
    for proj in PROJS:
        stack = weights[f"model.layers.1.mlp.experts.{proj}"]
        for e, qt in enumerate(experts[proj]):
            reference = fpq.quantize(stack[e].t(), "mxfp4")
            assert qt.shape == reference.shape and torch.equal(qt.codes, reference.codes)
    assert model.model.layers[1].mlp.experts.gate_up_proj is None  # presented only around the forward


@pytest.mark.parametrize("qconfig,edit,message", [
    ({**GPT_OSS_QCONFIG, "group_size": 32}, None, r"fields \['group_size'\] that the gpt-oss 'mxfp4' layout"),
    ({**GPT_OSS_QCONFIG, "modules_to_not_convert": [*GPT_OSS_QCONFIG["modules_to_not_convert"], "model.layers.1.mlp"]},
     None, r"model\.layers\.1\.mlp\.experts\.(down|gate_up)_proj_blocks: stored quantized, but .*modules_to_not_convert"),
    (GPT_OSS_QCONFIG, lambda t: t.pop("model.layers.0.mlp.experts.down_proj_scales"),
     r"model\.layers\.0\.mlp\.experts\.down_proj: the checkpoint has .*_blocks'\] but not .*_scales'\]"),
    (GPT_OSS_QCONFIG, lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales": torch.zeros(4, 64, 2)}),
     r"down_proj\[expert 0\]: the gpt-oss mxfp4 layout stores an \(64, 64\) expert matrix as uint8 blocks"),
])
def test_bad_gpt_oss_checkpoints_are_refused(src, tmp_path, qconfig, edit, message):
    _official(src, tmp_path / "bad", qconfig, edit)
    with pytest.raises(ValueError, match=message):
        fpq.load_quantized(tmp_path / "bad")


def test_an_excluded_experts_module_stays_bf16_and_is_listed(src, tmp_path):
    summary = checkpoint.quantize_checkpoint(src, tmp_path / "q", "mxfp4", exclude=[r"layers\.1\.mlp\.experts"],
                                             progress=False)
    assert summary["quantization_config"]["modules_to_not_convert"] == [
        *GPT_OSS_QCONFIG["modules_to_not_convert"], "model.layers.1.mlp.experts"]
    written, source = read_tensors(tmp_path / "q"), read_tensors(src)
    for proj in PROJS:
        assert torch.equal(written[f"model.layers.1.mlp.experts.{proj}"], source[f"model.layers.1.mlp.experts.{proj}"])
        assert f"model.layers.0.mlp.experts.{proj}_blocks" in written
    ours, theirs = fpq.load_quantized(tmp_path / "q"), _transformers(tmp_path / "q")
    assert not quantized_experts(ours.model.layers[1].mlp.experts)
    assert torch.equal(ours.model.layers[1].mlp.experts.down_proj, theirs.model.layers[1].mlp.experts.down_proj)
    for proj in PROJS:  # layer 0: ours against transformers, bit for bit
        mine = torch.stack([fpq.dequantize(qt, torch.bfloat16).t()
                            for qt in quantized_experts(ours.model.layers[0].mlp.experts)[proj]])
        assert torch.equal(_bits(mine), _bits(getattr(theirs.model.layers[0].mlp.experts, proj)))
    with pytest.raises(ValueError, match=r"converts an experts module whole; .*\['model\.layers\.1\.mlp\.experts'\]"):
        checkpoint.quantize_checkpoint(src, tmp_path / "half", "mxfp4", exclude=[r"layers\.1\.mlp\.experts\.down"],
                                       progress=False)
    assert not (tmp_path / "half").exists()
