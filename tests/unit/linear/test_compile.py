"""Issue 16: the quantized linear is a ``torch.library`` custom op (``ds_fpquant::linear``, with
``ds_fpquant::dequantize_weight`` for its backward): ``opcheck`` passes, ``torch.compile(fullgraph=True)``
of an applied model traces it in one graph, and ``torch.export`` of a small quantized model works."""

import copy

import pytest
import torch
from unit.linear_bound import assert_as_accurate_as, dequantized_model, matmul_within_bound

import ds_fpquant as fpq
from ds_fpquant.linear import custom_ops as library
from ds_fpquant.linear import linear as quantized_linear

transformers = pytest.importorskip("transformers")

WEIGHTS = [("e4m3", {"group_size": 32}), ("e2m1", {"block": (16, 32)}), ("nvfp4", {}),
           ("e5m2", {"group_size": 16, "scale_format": "e8m0"})]


def _llama():
    torch.manual_seed(0)
    # eager attention: the mask is built the same way in eager, traced and exported runs (with sdpa, transformers
    # passes no mask and is_causal=True in eager but builds a mask under torch.export: other calls)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=100, max_position_embeddings=64,
                                      attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("fmt,kwargs", WEIGHTS, ids=[w[0] for w in WEIGHTS])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_opcheck(fmt, kwargs, backend):
    torch.manual_seed(1)
    qt = fpq.quantize(torch.randn(48, 64), fmt, kwargs.get("group_size"), block=kwargs.get("block"),
                      scale_format=kwargs.get("scale_format"))
    codes, scales, tensor_scale, k, f, g, block, scale_format = library.as_op_args(qt)
    x = torch.randn(2, 3, 64, requires_grad=True)
    bias = torch.randn(48, requires_grad=True)
    torch.library.opcheck(torch.ops.ds_fpquant.linear.default,
                          (x, codes, scales, tensor_scale, bias, k, f, g, block, scale_format, backend))
    torch.library.opcheck(torch.ops.ds_fpquant.dequantize_weight.default,
                          (codes, scales, tensor_scale, k, f, g, block, scale_format, torch.bfloat16, backend))
    y = torch.ops.ds_fpquant.linear(x, codes, scales, tensor_scale, bias, k, f, g, block, scale_format, backend)
    assert torch.equal(y, quantized_linear(x, qt, bias, backend=backend))  # linear() calls this op: the same call
    y.sum().backward()
    w = fpq.dequantize(qt, torch.float32)
    # d/dx of sum(y) is ones @ W, an fp32 matmul of autograd's choosing: the fp32 summation bound
    matmul_within_bound(torch.ones(6, 48), w, x.grad.reshape(6, 64))
    assert torch.equal(bias.grad, torch.full((48,), 6.0))  # a sum of six ones: exact in any order


def test_compile_fullgraph_of_an_applied_model():
    model = _llama()
    quantized = fpq.apply(copy.deepcopy(model), {"fp_quantization": {"fmt": "e4m3", "group_size": 32}})
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = quantized(ids).logits
        explained = torch._dynamo.explain(quantized)(ids)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        # the traced graph run by eager kernels (aot_eager): the same calls in the same order as eager, so
        # the same bits; this is what fullgraph tracing must not change
        traced = torch.compile(quantized, backend="aot_eager", fullgraph=True)(ids).logits
        assert torch.equal(traced, eager)
        torch._dynamo.reset()
        compiled = torch.compile(quantized, fullgraph=True)(ids).logits
        reference = torch.compile(copy.deepcopy(model), fullgraph=True)(ids).logits
        exact = dequantized_model(model, quantized).double()(ids).logits  # the same function in fp64
    # inductor fuses the norms, softmax and activations around the opaque ds_fpquant::linear, summing in its
    # own order: as close to the fp64 value as eager is (unit/linear_bound.py)
    assert_as_accurate_as(compiled, eager, exact)
    assert torch.isfinite(reference).all()


def test_compiled_layer_is_the_op_bit_for_bit_with_its_backward():
    layer = fpq.FPQuantizedLinear.from_linear(torch.nn.Linear(64, 48), "e2m1", 16)
    x = torch.randn(5, 64, requires_grad=True)
    eager = layer(x)
    eager.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)(x)
    # the compiled forward is the opaque op on the same operands (nothing around it for inductor to fuse):
    # the same call, the same bits
    assert torch.equal(compiled, eager)
    compiled.sum().backward()
    # the backward is ones @ dequantize(W), an fp32 matmul eager autograd and inductor may each order their
    # own way: both within the fp32 summation bound
    w = fpq.dequantize(layer.quantized_weight, torch.float32)
    matmul_within_bound(torch.ones(5, 48), w, grad)
    matmul_within_bound(torch.ones(5, 48), w, x.grad)


def test_export_of_a_small_quantized_model():
    quantized = fpq.apply(_llama(), {"fp_quantization": {"fmt": "nvfp4"}})
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(2))
    exported = torch.export.export(quantized, (ids,), kwargs={"use_cache": False})
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count("ds_fpquant.linear.default") == 2 * 7  # 4 attention + 3 MLP projections per layer
    with torch.no_grad():  # the exported graph runs the ATen ops eager runs, in its order: the same bits
        assert torch.equal(exported.module()(ids, use_cache=False).logits, quantized(ids, use_cache=False).logits)


#: Every layer configuration of docs/api.md's ds_config section that a dense model can hold (issue 25):
#: element formats, fp32 / E8M0 group scales, 2-D blocks, the MX and NVFP4 presets, W8A8, a compute dtype.
LAYER_CONFIGS = {
    "e4m3-g32": {"fmt": "e4m3", "group_size": 32},
    "e2m1-block": {"fmt": "e2m1", "block": [16, 32]},
    "e5m2-e8m0": {"fmt": "e5m2", "group_size": 16, "scale_format": "e8m0"},
    "e3m2-stochastic": {"fmt": "e3m2", "group_size": 64, "rounding": "stochastic"},
    "mxfp4": {"fmt": "mxfp4"},
    "nvfp4": {"fmt": "nvfp4"},
    "w8a8-g128": {"fmt": "e4m3", "activation": "e4m3"},
    "w8a8-128x128": {"fmt": "e4m3", "block": [128, 128], "activation": "e4m3"},
    "bf16-compute": {"fmt": "e4m3", "compute_dtype": "bf16"},
}


def _llama128():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=100, max_position_embeddings=64,
                                      attn_implementation="eager", attention_bias=True)  # biases on q/k/v/o
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
def test_every_layer_configuration_traces_in_one_graph_and_exports(name):
    """Issue 25: W8A8 layers broke the graph (dynamo cannot trace the compiled quantize op); every configuration
    now runs as a custom op: one graph, no break; the traced graph (aot_eager) and the exported program run the
    same calls as eager, so the same bits."""
    quantized = fpq.apply(_llama128(), {"fp_quantization": LAYER_CONFIGS[name]})
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = quantized(ids, use_cache=False).logits
        explained = torch._dynamo.explain(quantized)(ids, use_cache=False)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        traced = torch.compile(quantized, backend="aot_eager", fullgraph=True)(ids, use_cache=False).logits
        assert torch.equal(traced, eager)
    exported = torch.export.export(quantized, (ids,), kwargs={"use_cache": False})
    op = "ds_fpquant.w8a8_linear.default" if "activation" in LAYER_CONFIGS[name] else "ds_fpquant.linear.default"
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count(op) == 7  # 4 attention + 3 MLP projections
    with torch.no_grad():
        assert torch.equal(exported.module()(ids, use_cache=False).logits, eager)


def test_w8a8_opcheck_and_straight_through_backward():
    qt = fpq.quantize(torch.randn(48, 256, generator=torch.Generator().manual_seed(2)), "e4m3", 128)
    codes, scales, tensor_scale, k, f, g, block, scale_format = library.as_op_args(qt)
    x = torch.randn(2, 3, 256, requires_grad=True)
    bias = torch.randn(48, requires_grad=True)
    args = (x, codes, scales, tensor_scale, bias, k, f, g, block, scale_format, "auto")
    torch.library.opcheck(torch.ops.ds_fpquant.w8a8_linear.default, args)
    y = torch.ops.ds_fpquant.w8a8_linear(*args)
    assert torch.equal(y, quantized_linear(x, qt, bias, activation="e4m3"))  # linear() calls this op: the same call
    y.sum().backward()
    matmul_within_bound(torch.ones(6, 48), fpq.dequantize(qt, torch.float32), x.grad.reshape(6, 256))
    assert torch.equal(bias.grad, torch.full((48,), 6.0))  # a sum of six ones: exact in any order
