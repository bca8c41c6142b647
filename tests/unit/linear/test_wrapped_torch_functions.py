"""Issue 35: the stand-in weights (``QuantizedWeight``, ``QuantizedExperts``) recognise the matmul ops themselves, not
the attributes ``torch.nn.functional.linear`` / ``torch.matmul`` / ``torch.Tensor.matmul`` as they are at call time.

A profiler, a tracing shim or an instrumentation hook commonly replaces those attributes by a ``functools.wraps``
wrapper that records the call and calls the original. Under such wrappers every layer keeps its configured numerics:
static W8A8 expert stacks SPEC 8.3, weight-only experts and in-place quantized dense layers SPEC 8.1/8.2 (each call
within SPEC 8.2's bound of its fp64 product). A matrix product the quantized linear does not run warns
(``QuantizedFallbackWarning``) instead of changing the numerics silently.
"""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from unit.checkpoint.test_static_moe_activations import _check_moe_block, _record_calls, _static_moe
from unit.linear_bound import assert_product_within_bound, exact_weight
from unit.moe_models import tiny_qwen3_moe

import ds_fpquant as fpq
from ds_fpquant.linear import QuantizedFallbackWarning, linear
from ds_fpquant.linear.weights import QuantizedWeight
from ds_fpquant.nn.in_place import quantize_weight_in_place
from ds_fpquant.nn.quantized_params import quantized_experts

#: the attributes such a shim replaces: (owner, name)
WRAPPED = [(torch.nn.functional, "linear"), (torch, "matmul"), (torch, "mm"), (torch.Tensor, "matmul"),
           (torch.Tensor, "__matmul__"), (torch.Tensor, "t"), (torch.Tensor, "transpose")]


@pytest.fixture
def shimmed(monkeypatch):
    """Every attribute of :data:`WRAPPED` replaced by a recording ``functools.wraps`` wrapper of the original, as a
    profiler installs them; yields the names called through the wrappers."""
    seen = []

    def wrap(name, original):
        @functools.wraps(original)
        def shim(*args, **kwargs):
            seen.append(name)
            return original(*args, **kwargs)
        return shim

    for owner, name in WRAPPED:
        monkeypatch.setattr(owner, name, wrap(name, getattr(owner, name)))
    assert F.linear is not torch._C._nn.linear  # the shim is what the models call
    return seen


def _check_calls(calls, count):
    """``count`` recorded calls of the quantized linear, each within SPEC 8.2's bound of fp64 ``x @ w^T`` (``w`` the
    codes times their group scales exactly)."""
    assert len(calls) == count, f"{len(calls)} calls of the quantized linear, {count} expected"
    for x, qt, activation, scale, y in calls:
        assert activation is None and scale is None
        assert_product_within_bound(x, exact_weight(qt), None, y)


def test_static_w8a8_experts_keep_spec_8_3_under_wrapped_functions(shimmed, monkeypatch):
    """A static-W8A8 Qwen3-MoE expert stack under the shims: every routed expert's matmul is static W8A8 (its x_hat
    the static quantization of its input), within SPEC 8.3's bound, and the block output within the derived bound
    of the fp64 reference (``_check_moe_block``). Fails where the F.linear shim turned the experts weight-only."""
    experts = _static_moe(linears=False).model.layers[1].mlp.experts
    _check_moe_block(experts, monkeypatch)
    assert "linear" in shimmed


def test_weight_only_experts_keep_spec_8_2_under_wrapped_functions(shimmed, monkeypatch):
    """Weight-only e4m3 experts under the shims: each routed expert's gate_up and down run the quantized linear (no
    dequantized fallback), within SPEC 8.2's bound."""
    model = fpq.apply(tiny_qwen3_moe(), {"fp_quantization": {"fmt": "e4m3", "group_size": 32}})
    experts = model.model.layers[1].mlp.experts
    assert set(quantized_experts(experts)) == {"gate_up_proj", "down_proj"}
    g = torch.Generator().manual_seed(4)
    tokens, top_k = 10, 2
    hidden = torch.randn(tokens, 64, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:top_k] for _ in range(tokens)])
    routing = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    calls = _record_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedFallbackWarning)
        experts(hidden, index, routing)
    _check_calls(calls, 2 * len(index.unique()))
    assert "linear" in shimmed


class _MatmulLayer(torch.nn.Module):
    """DeepSpeed's AutoTP ``LinearLayer`` forward: ``torch.matmul(x, self.weight.transpose(-1, -2))``."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight

    def forward(self, x):
        return torch.matmul(x, self.weight.transpose(-1, -2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["F.linear", "matmul"])
def test_dense_layers_quantized_in_place_keep_spec_8_2_under_wrapped_functions(shimmed, monkeypatch, kind, dtype):
    """An ``nn.Linear`` (``F.linear``) and an AutoTP-style layer (``torch.matmul`` by the transposed weight) quantized
    in place: under the shims both run the quantized linear, within SPEC 8.2's bound."""
    torch.manual_seed(5)
    dense = torch.nn.Linear(96, 40, bias=False).to(dtype)
    layer = dense if kind == "F.linear" else _MatmulLayer(dense)
    quantize_weight_in_place(layer, "e2m1", 32)
    x = torch.randn(2, 3, 96, dtype=dtype)
    qt = _presented(layer, "weight", x).qt
    calls = _record_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedFallbackWarning)
        y = layer(x)
    assert_product_within_bound(x, exact_weight(qt), None, y)  # the layer's output, whichever path gave it
    _check_calls(calls, 1)
    assert torch.equal(y, calls[0][4].reshape(y.shape))  # what the layer returns is that call's result
    assert ("linear" if kind == "F.linear" else "matmul") in shimmed


def test_linear_by_keyword_runs_quantized():
    """``F.linear(input=x, weight=w, bias=b)`` runs the quantized linear like the positional call."""
    qt = fpq.quantize(torch.randn(24, 64), "e4m3", group_size=32)
    w, x, b = QuantizedWeight(qt, torch.float32), torch.randn(3, 64), torch.randn(24)
    want = linear(x, qt, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedFallbackWarning)
        for got in (F.linear(input=x, weight=w, bias=b), F.linear(x, weight=w, bias=b), F.linear(x, w, b)):
            assert torch.equal(got, want)  # the same call of linear on the same tensors


@pytest.mark.parametrize("activation", [None, "static"])
def test_unserved_products_warn(activation):
    """Products the quantized linear does not run (``einsum``, ``torch.mm`` / ``addmm`` of the untransposed weight,
    ``bmm`` of an expert stack) are computed with the dequantized weight and warn, naming the op and the numerics
    the layer was configured for; other uses (``w.sum()``, ``w.shape``) do not warn."""
    qt = fpq.quantize(torch.randn(32, 32), "e4m3", group_size=32)
    scale = torch.tensor(0.02) if activation else None
    w = QuantizedWeight(qt, torch.float32, activation="e4m3" if activation else None, input_scale=scale)
    x = torch.randn(4, 32)
    numerics = "static W8A8" if activation else "SPEC 8.1's formula"
    for call in (lambda: torch.einsum("ij,kj->ik", x, w), lambda: torch.mm(x, w), lambda: torch.addmm(x, x, w)):
        with pytest.warns(QuantizedFallbackWarning, match=numerics):
            call()
    model = fpq.apply(tiny_qwen3_moe(), {"fp_quantization": {"fmt": "e4m3"}})
    experts = model.model.layers[1].mlp.experts
    with pytest.warns(QuantizedFallbackWarning, match="bmm with QuantizedExperts"):
        torch.bmm(torch.randn(4, 2, 64), _presented(experts, "gate_up_proj", *EXPERT_INPUTS))  # (4, 64, 64): gate and up of 32
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedFallbackWarning)
        w.sum(), w.shape, w.float()


#: an experts module's forward arguments for one token: hidden states, routing indices, routing weights
EXPERT_INPUTS = (torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2))


def _presented(module, name, *inputs):
    """``module.<name>`` as its forward on ``inputs`` sees it (inside ds_fpquant's forward pre-hook)."""
    out = {}

    def hook(mod, args):
        out["w"] = getattr(mod, name)

    handle = module.register_forward_pre_hook(hook)
    try:
        module(*inputs)
    finally:
        handle.remove()
    return out["w"]


@pytest.mark.parametrize("cast", [lambda w: w.float(), lambda w: w.to(torch.float32), lambda w: w.to(dtype=torch.float32),
                                  lambda w: w.to("cpu", torch.float32), lambda w: w.type(torch.float32),
                                  lambda w: w.detach().contiguous().float()])
def test_casts_keep_the_stand_in(cast):
    """``x.float() @ w.float().T`` and the other dtype casts / no-ops of a stand-in give a stand-in of the new compute
    dtype (the layer's numerics in that dtype), not the dequantized weight: no warning, the quantized linear runs."""
    qt = fpq.quantize(torch.randn(24, 64), "e4m3", group_size=32)
    w = QuantizedWeight(qt, torch.bfloat16, activation="e4m3", input_scale=torch.tensor(0.01))
    cast_w = cast(w)
    assert isinstance(cast_w, QuantizedWeight) and cast_w.dtype == torch.float32
    x = torch.randn(3, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedFallbackWarning)
        got = x @ cast_w.T
    assert torch.equal(got, linear(x, qt, activation="e4m3", input_scale=torch.tensor(0.01)))  # the same call


def test_metadata_does_not_dequantize(monkeypatch):
    """``w.shape`` / ``dtype`` / ``size()`` / ``numel()`` / ``len(w)`` of a stand-in (what profilers read on every call)
    are its own metadata: nothing is dequantized."""
    import ds_fpquant.linear.weights as weights_module

    qt = fpq.quantize(torch.randn(24, 64), "e4m3", group_size=32)
    w = QuantizedWeight(qt, torch.bfloat16).t()
    monkeypatch.setattr(weights_module, "dequantize", lambda *a, **k: pytest.fail("dequantized"))
    assert (w.shape, w.dtype, w.device, w.size(), w.size(0), w.dim(), w.ndim, w.numel(), len(w), w.requires_grad) == (
        torch.Size([64, 24]), torch.bfloat16, torch.device("cpu"), torch.Size([64, 24]), 64, 2, 2, 1536, 64, False)


def test_expert_index_forms_run_quantized(monkeypatch):
    """``experts[e]`` as a numpy int, a 0-dim tensor, ``[e, :, :]`` / ``[e, ...]``, ``select(0, e)``, ``unbind(0)``
    and ``experts.float()[e]`` give expert ``e``'s stand-in; ``experts.mT[e]`` the transposed one; out of range raises."""
    import numpy as np

    model = fpq.apply(tiny_qwen3_moe(), {"fp_quantization": {"fmt": "e4m3"}})
    experts = _presented(model.model.layers[1].mlp.experts, "down_proj", *EXPERT_INPUTS)  # (4, 64, 32)
    qts = quantized_experts(model.model.layers[1].mlp.experts)["down_proj"]
    x = torch.randn(2, 32)
    forms = [lambda: F.linear(x, experts[np.int64(2)]), lambda: F.linear(x, experts[torch.tensor(2)]),
             lambda: F.linear(x, experts[2, :, :]), lambda: F.linear(x, experts[2, ...]),
             lambda: F.linear(x, experts.select(0, 2)), lambda: F.linear(x, experts.unbind(0)[2]),
             lambda: F.linear(x, experts.float()[2]), lambda: x @ experts.mT[2]]
    calls = _record_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedFallbackWarning)
        outs = [form() for form in forms]
    assert len(calls) == len(forms) and all(torch.equal(c[1].codes, qts[2].codes) for c in calls)
    assert all(torch.equal(o, outs[0]) for o in outs)  # the same call of linear on the same tensors
    with pytest.raises(IndexError):
        experts[4]


def test_wrapper_of_the_c_function_itself(monkeypatch):
    """A ``functools.wraps`` wrapper put on ``torch._C._nn.linear`` itself (which __torch_function__ then receives) is
    followed down its ``__wrapped__`` chain."""
    qt = fpq.quantize(torch.randn(24, 64), "e4m3", group_size=32)
    original = torch._C._nn.linear
    monkeypatch.setattr(torch._C._nn, "linear", functools.wraps(original)(lambda *a, **k: original(*a, **k)))
    x = torch.randn(3, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedFallbackWarning)
        assert torch.equal(torch._C._nn.linear(x, QuantizedWeight(qt, torch.float32)), linear(x, qt))


def test_fallback_warning_names_the_callers_line():
    """The warning points at the caller's line (not into torch), so each call site warns once under the default
    filter."""
    w = QuantizedWeight(fpq.quantize(torch.randn(32, 32), "e4m3", group_size=32), torch.float32)
    with pytest.warns(QuantizedFallbackWarning) as caught:
        torch.einsum("ij,kj->ik", torch.randn(2, 32), w)
    assert caught[0].filename == __file__


@pytest.mark.skipif(not hasattr(transformers, "OpenAIPrivacyFilterConfig"), reason="transformers without the model")
def test_experts_forward_that_casts_the_weights_runs_quantized(monkeypatch):
    """transformers' ``OpenAIPrivacyFilterExperts`` computes ``x.float() @ self.gate_up_proj[e].float()``: the cast
    keeps the stand-in, so every routed expert matmul runs the quantized linear (within SPEC 8.2's bound), no warning."""
    config = transformers.OpenAIPrivacyFilterConfig(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
        eos_token_id=0, bos_token_id=0)
    torch.manual_seed(6)
    model = fpq.apply(transformers.OpenAIPrivacyFilterModel(config).eval(), {"fp_quantization": {"fmt": "e4m3"}})
    calls = _record_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedFallbackWarning)
        model(torch.randint(0, 97, (1, 5)))
    experts = [c for c in calls if c[1].shape in ((128, 64), (64, 64))]  # gate_up (2 x 64, 64) and down
    assert len(experts) >= 2, f"{len(experts)} expert calls of the quantized linear"
    _check_calls(experts, len(experts))
