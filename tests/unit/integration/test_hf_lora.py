"""Issue 45: PEFT LoRA adapters on ``FPQuantizedLinear`` layers of a model ``from_pretrained`` loaded through
ds_fpquant: training changes only the adapters, the loss falls, the adapters' gradients are those of the same LoRA
over a plain ``nn.Linear`` holding the dequantized weight (within the derived bound), merging is refused unless the
base layers are dequantized."""

import copy

import pytest
import torch
import transformers

from ds_fpquant import DsFpQuantConfig
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

peft = pytest.importorskip("peft")
from ds_fpquant.integration.hf.lora import LoraFPQuantizedLinear, merge_and_unload, register_lora  # noqa: E402

EPS = 2.0**-24


def _quantized_model(checkpoints):
    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints.source("llama"), device_map="cpu", dtype=torch.float32,
        quantization_config=DsFpQuantConfig(fmt="nvfp4"))


def _lora(r=4):
    return register_lora(peft.LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                         lora_dropout=0.0))


def _frozen_state(model):
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith(("weight_codes", "weight_scales",
                                                                          "weight_tensor_scale"))}


def test_training_updates_only_the_adapters_and_the_loss_falls(checkpoints):
    torch.manual_seed(0)
    model = peft.get_peft_model(_quantized_model(checkpoints), _lora())
    wrapped = [m for m in model.modules() if isinstance(m, LoraFPQuantizedLinear)]
    assert len(wrapped) == 6 and all(isinstance(m.base_layer, FPQuantizedLinear) for m in wrapped)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = _frozen_state(model)
    others = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(2))  # a toy task: memorise ids
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    model.train()
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    after = _frozen_state(model)
    assert before.keys() == after.keys() and before
    for name, codes in before.items():
        assert torch.equal(after[name], codes), name  # codes and scales: the same bits
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, others[name]), name


def test_a_plain_lora_config_wraps_the_quantized_layers(checkpoints):
    """After ``import ds_fpquant``, ``get_peft_model`` with a plain ``LoraConfig`` (no ``register_lora``) wraps the
    ``FPQuantizedLinear`` targets; a target that is a plain ``nn.Linear`` still gets PEFT's own layer."""
    model = _quantized_model(checkpoints)
    model.model.layers[1].self_attn.q_proj = torch.nn.Linear(model.config.hidden_size, model.config.hidden_size,
                                                             bias=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    wrapped = [m for m in model.modules() if isinstance(m, LoraFPQuantizedLinear)]
    assert len(wrapped) == 3 and all(isinstance(m.base_layer, FPQuantizedLinear) for m in wrapped)
    plain = model.base_model.model.model.layers[1].self_attn.q_proj
    assert isinstance(plain, peft.tuners.lora.Linear) and type(plain.base_layer) is torch.nn.Linear


def test_peft_imported_before_ds_fpquant_wraps_too():
    import subprocess
    import sys

    code = ("import sys, peft, torch; assert 'ds_fpquant' not in sys.modules; import ds_fpquant\n"
            "from ds_fpquant.integration.hf.lora import LoraFPQuantizedLinear\n"
            "m = torch.nn.Sequential(ds_fpquant.FPQuantizedLinear.from_linear(torch.nn.Linear(64, 32), fmt='e4m3',"
            " group_size=32))\n"
            "m = peft.get_peft_model(m, peft.LoraConfig(r=2, target_modules=['0']))\n"
            "print(type(m.base_model.model[0]).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "LoraFPQuantizedLinear"


def test_adapter_gradients_match_lora_on_the_dequantized_linear():
    """One layer: ``y = base(x) + s B A x``, loss ``sum(y^2) / 2`` (so the gradients depend on the base output).
    The LoRA term is the same computation in both layers (same bits); the base outputs of the quantized layer and of
    the ``nn.Linear`` holding its dequantized weight are fp32 dot products of the same exact terms, each within
    ``2 K eps |x| |W|^T`` of the exact value (SPEC 8.2), so ``|dy| <= 4 K eps |x||W|^T + 2 eps |y|`` (the sum with
    the LoRA term rounds once in each). The gradients ``dB = s y^T (A x)`` and ``dA = s (y B)^T x`` differ by at
    most that ``|dy|`` carried through the same products, plus their own fp32 roundings (``2 n eps`` of the
    absolute products, ``n`` the summed length), in each of the two."""
    torch.manual_seed(0)
    n, k, out, r = 12, 64, 48, 4
    linear = torch.nn.Linear(k, out)
    quantized = FPQuantizedLinear.from_linear(linear, "nvfp4")
    plain = torch.nn.Linear(k, out)
    with torch.no_grad():
        plain.weight.copy_(quantized.dequantized_weight(torch.float32))
        plain.bias.copy_(quantized.bias)
    config = peft.LoraConfig(r=r, lora_alpha=8, init_lora_weights=False)  # B random too: both gradients non-zero
    lora_q = LoraFPQuantizedLinear(quantized, "default", config=config, r=r, lora_alpha=8)
    lora_d = peft.tuners.lora.layer.Linear(plain, "default", config=config, r=r, lora_alpha=8)
    lora_d.load_state_dict(lora_q.state_dict(), strict=False)
    assert torch.equal(lora_d.lora_B["default"].weight, lora_q.lora_B["default"].weight)
    x = torch.randn(n, k)
    grads = []
    for layer in (lora_q, lora_d):
        y = layer(x)
        (y.square().sum() / 2).backward()
        grads.append((y.detach(), layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad))
    (y_q, ga_q, gb_q), (y_d, ga_d, gb_d) = grads
    a, b, s = lora_q.lora_A["default"].weight.double(), lora_q.lora_B["default"].weight.double(), lora_q.scaling[
        "default"]
    w, x64 = plain.weight.double(), x.double()
    dy = 4 * k * EPS * (x64.abs() @ w.abs().T) + 2 * EPS * y_q.double().abs().maximum(y_d.double().abs())
    y_abs = y_q.double().abs() + dy
    ax = (x64 @ a.T).abs()
    bound_b = s * dy.T @ ax + 2 * 2 * (n + k) * EPS * s * (y_abs.T @ ax)
    yb = y_abs @ b.abs()
    bound_a = s * (dy @ b.abs()).T @ x64.abs() + 2 * 2 * (n + out) * EPS * s * (yb.T @ x64.abs())
    assert bool(((gb_q.double() - gb_d.double()).abs() <= bound_b).all())
    assert bool(((ga_q.double() - ga_d.double()).abs() <= bound_a).all())
    assert not torch.equal(ga_q, torch.zeros_like(ga_q)) and not torch.equal(gb_q, torch.zeros_like(gb_q))


def test_merge_refused_unless_dequantized(checkpoints):
    model = peft.get_peft_model(_quantized_model(checkpoints), _lora())
    with pytest.raises(ValueError, match="re-quantize"):
        model.merge_and_unload()
    with pytest.raises(ValueError, match="dequantize=True"):
        merge_and_unload(model)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    merged = merge_and_unload(model, dequantize=True)
    assert not any(isinstance(m, LoraFPQuantizedLinear) for m in merged.modules())
    assert isinstance(merged.model.layers[0].self_attn.k_proj, FPQuantizedLinear)  # not a target: still quantized
    layer = merged.model.layers[0].self_attn.q_proj
    wrapped = reference.base_model.model.model.layers[0].self_attn.q_proj
    expected = wrapped.base_layer.dequantized_weight() + wrapped.get_delta_weight("default")
    assert type(layer) is torch.nn.Linear and torch.equal(layer.weight, expected)
    with torch.no_grad():
        assert torch.isfinite(merged(ids).logits).all()
