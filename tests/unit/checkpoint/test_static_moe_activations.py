"""Issue 29: static per-tensor FP8 activation scales of MoE expert stacks (SPEC 8.3). A Qwen3-MoE exported by
nvidia-modelopt 0.47 itself (``FP8``: per-expert ``input_scale``) and a per-expert compressed-tensors ``FP8``
checkpoint (quantized and compressed by compressed-tensors 0.20.1 itself) load with their experts running static
W8A8: one fp32 scale per stack, the largest of the stored per-expert (gate and up) scales, as vLLM's FP8 MoE layer
takes it; ``activation=None`` keeps them weight-only; ``save_quantized`` writes the shared scale under every
per-expert key and reads back bit for bit."""

import json

import pytest
import torch
import torch.nn.functional as F
from unit.checkpoint.test_static_activation_checkpoints import _load, _of
from unit.linear_bound import assert_product_within_bound, exact_weight
from unit.moe_models import tiny_qwen3_moe
from unit.safetensors_files import read_tensors

import ds_fpquant as fpq
from ds_fpquant.checkpoint.layouts import StaticActivationScalesWarning, UnsharedInputScalesWarning
from ds_fpquant.linear import linear
from ds_fpquant.linear import weights as weights_module
from ds_fpquant.linear.w8a8 import static_quantize_activations, static_w8a8_linear
from ds_fpquant.nn.experts import install_quantized_experts
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.nn.quantized_params import input_scale_of, quantized_experts

BASE = "model.layers.1.mlp.experts"  # tiny_qwen3_moe: layer 1 is the MoE layer, 4 experts
PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _stored_max(tensors, pname):
    """vLLM's scale of the stack: the largest stored input_scale over its experts and parts."""
    values = [tensors[f"{BASE}.{e}.{p}.input_scale"].float().reshape(()) for e in range(4) for p in PARTS[pname]]
    return torch.stack(values).max(), len({v.item() for v in values}) > 1


def _expert_forward(experts, pname, e, x):
    """``F.linear(x, experts.<pname>[e])`` as the experts' forward calls it (inside its forward hooks)."""
    out = {}

    def hook(module, args):
        out["y"] = F.linear(x, getattr(module, pname)[e])

    handle = experts.register_forward_pre_hook(hook)  # after ds_fpquant's own pre-hook: the weights are presented
    try:
        experts(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2))
    finally:
        handle.remove()
    return out["y"]


def _record_calls(monkeypatch):
    calls = []
    original = weights_module.linear

    def recording(x, qt, bias=None, **kwargs):
        y = original(x, qt, bias, **kwargs)
        calls.append((x.detach().clone(), qt, kwargs.get("activation"), kwargs.get("input_scale"), y.detach()))
        return y

    monkeypatch.setattr(weights_module, "linear", recording)
    return calls


def _check_static_experts(model, tensors, monkeypatch):
    """Each stack's scale is the stored maximum; one expert's forward is static_w8a8_linear bit for bit (and not
    the weight-only result); every expert matmul of the MoE block's forward within SPEC 8.2 / 8.3's bound of fp64
    ``x_hat @ w^T`` (``x_hat`` the static quantization of that call's own input, exact in fp32; ``w`` the codes
    times their scales exactly)."""
    experts = model.model.layers[1].mlp.experts
    stacks = quantized_experts(experts)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    for pname, qts in stacks.items():
        scale = input_scale_of(experts, pname)
        want, _ = _stored_max(tensors, pname)
        assert scale.dtype == torch.float32 and scale.shape == () and torch.equal(scale, want), pname
        xi = x if pname == "gate_up_proj" else torch.randn(6, qts[0].shape[1])
        y = _expert_forward(experts, pname, 2, xi)
        assert torch.equal(y, static_w8a8_linear(xi, qts[2], None, scale, "auto")), pname
        assert not torch.equal(y, linear(xi, qts[2])), f"{pname}: the activations were not quantized"
    _check_moe_block(experts, monkeypatch)
    return experts


def _check_moe_block(experts, monkeypatch):
    """The experts' forward (the MoE block after routing) against an fp64 reference: each routed expert's
    ``down(act(gate) * up)`` as ``h_hat @ w_down^T`` (``h_hat`` the static quantization of the block's own ``act(gate)
    * up``, the weights the codes times their scales exactly), times its routing weight, summed per token. Each
    expert matmul first within SPEC 8.2 / 8.3's bound of its fp64 product (``tol_k``); the block output then within
    ``sum_k |w_k| tol_k + 2 (top_k + 1) eps32 sum_k |w_k| (|ref_k| + tol_k)`` of the reference (the model's fp32 product
    by the routing weight and its ``index_add_`` of top_k terms into zeros: top_k + 1 roundings per token,
    gamma_n <= 2 n eps32)."""
    tokens, top_k = 12, 2
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(tokens, 64, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    calls = _record_calls(monkeypatch)
    out = experts(hidden, index, weights)
    mask = F.one_hot(index, num_classes=5).permute(2, 1, 0)
    hit = [e for e in range(4) if mask[e].sum() > 0]
    assert len(calls) == 2 * len(hit)  # one gate_up and one down call per routed expert
    ref = torch.zeros(tokens, 64, dtype=torch.float64)
    tol = torch.zeros(tokens, 64, dtype=torch.float64)
    eps = 2.0**-24
    for e, (gate_up, down) in zip(hit, zip(calls[0::2], calls[1::2])):
        pos, token = torch.where(mask[e])
        assert torch.equal(gate_up[0], hidden[token])  # the routed tokens, as they came in
        for xc, qt, activation, scale, y in (gate_up, down):
            assert activation == "e4m3" and scale is not None
            _, x_hat = static_quantize_activations(xc, scale)
            assert_product_within_bound(x_hat, exact_weight(qt), None, y)
        xc, qt, _, scale, _ = down
        _, h_hat = static_quantize_activations(xc, scale)
        w = exact_weight(qt)
        ref_k = h_hat.double() @ w.T
        tol_k = 2 * (qt.shape[1] + 2) * eps * (h_hat.double().abs() @ w.abs().T) + 2.0**-150
        r = weights[token, pos].double()[:, None]
        ref.index_add_(0, token, r * ref_k)
        tol.index_add_(0, token, r.abs() * tol_k + 2 * (top_k + 1) * eps * r.abs() * (ref_k.abs() + tol_k))
    err = (out.double() - ref).abs()
    assert bool((err <= tol).all()), f"max error {err.max().item():.3e} over bound"


def _check_weight_only(path):
    """``activation=None``: no stack scale, the expert forward is the weight-only linear bit for bit."""
    model, caught = _load(path, activation=None)
    assert not _of(caught, StaticActivationScalesWarning) and not _of(caught, UnsharedInputScalesWarning)
    experts = model.model.layers[1].mlp.experts
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    qts = quantized_experts(experts)["gate_up_proj"]
    assert input_scale_of(experts, "gate_up_proj") is None and "gate_up_proj_input_scale" not in experts.state_dict()
    assert torch.equal(_expert_forward(experts, "gate_up_proj", 1, x), linear(x, qts[1]))


# ---- ModelOpt FP8 (exported by ModelOpt itself) ----

def test_modelopt_fp8_qwen3_moe_experts_run_static_w8a8(tmp_path, monkeypatch):
    pytest.importorskip("modelopt.torch.quantization")
    from unit.checkpoint.test_modelopt_checkpoint import export_with_modelopt

    path = export_with_modelopt(tiny_qwen3_moe(), "FP8_DEFAULT_CFG", tmp_path / "moe", 97)
    assert json.loads((path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    tensors = read_tensors(path)
    for e in range(4):  # ModelOpt writes each expert's own input_scale (0-dim fp32)
        for p in ("gate_proj", "up_proj", "down_proj"):
            scale = tensors[f"{BASE}.{e}.{p}.input_scale"]
            assert scale.dtype == torch.float32 and scale.shape == ()
    model, caught = _load(path)
    assert not _of(caught, StaticActivationScalesWarning)
    # ModelOpt 0.47 calibrates one input quantizer per fused-experts stack: one value per stack (docs/spec.md 8.3)
    assert not any(_stored_max(tensors, p)[1] for p in PARTS)
    assert not _of(caught, UnsharedInputScalesWarning)
    for e in range(4):  # recorded as stored
        scales = model.ds_fpquant_activation_scales[f"{BASE}.gate_up_proj[expert {e}, part 1]"]
        assert torch.equal(scales["input_scale"], tensors[f"{BASE}.{e}.up_proj.input_scale"])
    _check_static_experts(model, tensors, monkeypatch)
    _check_weight_only(path)


# ---- compressed-tensors FP8, per-expert keys (quantized and compressed by compressed-tensors) ----

def _ct_fp8_checkpoint(tmp_path):
    pytest.importorskip("compressed_tensors")
    from unit.checkpoint.test_more_layouts import write_ct_moe_checkpoint

    _, inputs = write_ct_moe_checkpoint(tiny_qwen3_moe().to(torch.bfloat16), "FP8", tmp_path / "ct")
    return tmp_path / "ct", inputs


def test_compressed_tensors_fp8_moe_experts_run_static_w8a8(tmp_path, monkeypatch):
    path, inputs = _ct_fp8_checkpoint(tmp_path)
    tensors = read_tensors(path)
    assert tensors[f"{BASE}.0.gate_proj.input_scale"].shape == (1,)  # compressed-tensors' per-tensor shape
    assert all(f"{BASE}.{e}.{p}" in inputs for e in range(4) for p in ("gate_proj", "up_proj", "down_proj"))
    model, caught = _load(path)
    assert not _of(caught, StaticActivationScalesWarning)
    unshared = [str(w.message) for w in _of(caught, UnsharedInputScalesWarning) if ".experts." in str(w.message)]
    assert len(unshared) == 2 and all("largest" in m for m in unshared)  # distinct scales per module: both stacks
    _check_static_experts(model.float(), tensors, monkeypatch)  # the scale stays fp32 under the cast
    _check_weight_only(path)


def test_static_experts_with_partial_input_scales_are_refused(tmp_path):
    """A stack some of whose matrices carry a static input scale and some none: ValueError naming the stack (the
    weight-only load still works)."""
    from safetensors.torch import save_file

    path, _ = _ct_fp8_checkpoint(tmp_path)
    tensors = read_tensors(path)
    del tensors[f"{BASE}.3.up_proj.input_scale"]
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts.gate_up_proj: .*not for \['expert 3 part 1'\].*activation=None"):
        fpq.load_quantized(path)
    assert input_scale_of(fpq.load_quantized(path, activation=None).model.layers[1].mlp.experts, "gate_up_proj") is None


# ---- the nn layer: state dict, dtype casts, bad scales ----

def _static_moe(granularity="channel", linears=True):
    """A tiny Qwen3-MoE quantized to e4m3 whose expert stacks (and, ``linears``, linears) run static W8A8 with
    distinct scales. (Channel scales: a per-tensor gate_up scale spans gate and up, which no per-expert key holds.)"""
    model = fpq.apply(tiny_qwen3_moe(), {"fp_quantization": {"fmt": "e4m3", "granularity": granularity}})
    layers = sorted((n, m) for n, m in model.named_modules() if isinstance(m, FPQuantizedLinear))
    for i, (name, layer) in enumerate(layers if linears else ()):
        static = FPQuantizedLinear(layer.quantized_weight, layer.bias, activation="e4m3",
                                   input_scale=torch.tensor(0.01 * (1 + i)))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, static)
    experts = model.model.layers[1].mlp.experts
    for i, (pname, qts) in enumerate(sorted(quantized_experts(experts).items())):
        install_quantized_experts(experts, pname, qts, activation="e4m3",
                                  input_scale=torch.tensor(0.003 * (1 + i)))
    return model


def test_static_expert_stack_buffer():
    model = _static_moe()
    experts = model.model.layers[1].mlp.experts
    state = experts.state_dict()
    assert state["gate_up_proj_input_scale"].dtype == torch.float32 and state["gate_up_proj_input_scale"].shape == ()
    model.half()
    assert experts.gate_up_proj_input_scale.dtype == torch.float32  # fp32 bits kept under the cast
    model.to(torch.bfloat16)
    assert torch.equal(experts.down_proj_input_scale, torch.tensor(0.003))
    bad = dict(state, gate_up_proj_input_scale=torch.tensor(float("inf")))
    with pytest.raises(ValueError, match="input_scale=inf must be finite and > 0"):
        experts.load_state_dict(bad)
    qts = quantized_experts(experts)["down_proj"]
    with pytest.raises(ValueError, match="input_scale=0.0 must be finite and > 0"):
        install_quantized_experts(experts, "down_proj", qts, activation="e4m3", input_scale=torch.tensor(0.0))
    with pytest.raises(ValueError, match="input_scale is given but activation=None"):
        install_quantized_experts(experts, "down_proj", qts, input_scale=torch.tensor(1.0))
    mx = fpq.apply(tiny_qwen3_moe(), {"fp_quantization": {"fmt": "mxfp8_e4m3"}}).model.layers[1].mlp.experts
    with pytest.raises(ValueError, match="needs e4m3 weights with fp32 scales"):
        install_quantized_experts(mx, "down_proj", quantized_experts(mx)["down_proj"], activation="e4m3",
                                  input_scale=torch.tensor(1.0))


# ---- save_quantized ----

@pytest.mark.parametrize("layout", [None, "compressed-tensors"])
def test_save_quantized_writes_static_expert_scales_and_reads_back(tmp_path, layout):
    model = _static_moe()
    experts = model.model.layers[1].mlp.experts
    before = {p: input_scale_of(experts, p).clone() for p in PARTS}
    fpq.save_quantized(model, tmp_path / "out", layout=layout)
    tensors = read_tensors(tmp_path / "out")
    for pname, parts in PARTS.items():
        for e in range(4):
            for p in parts:  # the shared scale under every per-expert key, as the layout stores a per-tensor scale
                value = tensors[f"{BASE}.{e}.{p}.input_scale"]
                assert value.dtype == torch.float32 and value.shape == ((1,) if layout == "compressed-tensors" else ())
                assert torch.equal(value.reshape(()), before[pname])
    loaded, caught = _load(tmp_path / "out")
    assert not _of(caught, StaticActivationScalesWarning) and not _of(caught, UnsharedInputScalesWarning)
    again = loaded.model.layers[1].mlp.experts
    x = torch.randn(3, 64)
    for pname, qts in quantized_experts(experts).items():
        scale = input_scale_of(again, pname)
        assert scale.view(torch.int32) == before[pname].view(torch.int32), pname  # bit for bit
        for a, b in zip(qts, quantized_experts(again)[pname]):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32))
        xi = x if pname == "gate_up_proj" else torch.randn(3, qts[0].shape[1])
        assert torch.equal(_expert_forward(again, pname, 1, xi), _expert_forward(experts, pname, 1, xi)), pname


@pytest.mark.parametrize("layout, granularity, message", [
    ("ds_fpquant", "channel", "has no static activation scales"),
    ("compressed-tensors", "channel", "one activation scheme for every quantized linear"),
    ("modelopt", "channel", "quantizes activations dynamically"),
    (None, "tensor", "would be stored as whole"),
])
def test_save_quantized_refuses_to_drop_static_expert_scales(tmp_path, layout, granularity, message):
    """Only the expert stacks static: a layout that cannot describe their scales is refused before anything is
    written (compressed-tensors: one scheme for all, the linears are weight-only; ModelOpt's static scheme is per-tensor
    ``FP8``; a per-tensor gate_up scale is written as a whole stack, which holds no input_scale)."""
    model = _static_moe(granularity, linears=False)
    with pytest.raises(ValueError, match=message):
        fpq.save_quantized(model, tmp_path / "out", layout=layout)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
