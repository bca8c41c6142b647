"""Issue 16: the quantized linear is a ``torch.library`` custom op (``ds_fpquant::linear``, with
``ds_fpquant::dequantize_weight`` for its backward): ``opcheck`` passes, ``torch.compile(fullgraph=True)``
of an applied model traces it in one graph, and ``torch.export`` of a small quantized model works."""

import copy

import pytest
import torch

import ds_fpquant as fpq
from ds_fpquant import library
from ds_fpquant.linear import linear as quantized_linear

transformers = pytest.importorskip("transformers")

WEIGHTS = [("e4m3", {"group_size": 32}), ("e2m1", {"block": (16, 32)}), ("nvfp4", {}),
           ("e5m2", {"group_size": 16, "scale_format": "e8m0"})]


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=100, max_position_embeddings=64)
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
    assert torch.equal(y, quantized_linear(x, qt, bias, backend=backend))
    y.sum().backward()
    w = fpq.dequantize(qt, torch.float32)
    torch.testing.assert_close(x.grad, torch.ones(2, 3, 48) @ w)
    assert torch.equal(bias.grad, torch.full((48,), 6.0))


def test_compile_fullgraph_of_an_applied_model():
    model = _llama()
    quantized = fpq.apply(copy.deepcopy(model), {"fp_quantization": {"fmt": "e4m3", "group_size": 32}})
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = quantized(ids).logits
        explained = torch._dynamo.explain(quantized)(ids)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(quantized, fullgraph=True)(ids).logits
        reference = torch.compile(copy.deepcopy(model), fullgraph=True)(ids).logits
    # inductor fuses the norms and activations as it does for the unquantized model: same size of difference
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
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
    assert torch.equal(compiled, eager)
    compiled.sum().backward()
    assert torch.equal(x.grad, grad)


def test_export_of_a_small_quantized_model():
    quantized = fpq.apply(_llama(), {"fp_quantization": {"fmt": "nvfp4"}})
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(2))
    exported = torch.export.export(quantized, (ids,), kwargs={"use_cache": False})
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count("ds_fpquant.linear.default") == 2 * 7  # 4 attention + 3 MLP projections per layer
    with torch.no_grad():
        assert torch.equal(exported.module()(ids, use_cache=False).logits, quantized(ids, use_cache=False).logits)
