"""Issue 43 (1): one quantized model called from several Python threads at once (a serving thread pool, Gradio,
FastAPI), each thread with its own inputs and dtype, gives every call the bits the same call gives alone. Dense
Llama, the MoE expert stacks of Mixtral, Qwen3-MoE, GPT-OSS and DeepSeek-V3, and AutoTP-style layers quantized in
place; ``torch.compile`` and ``load_state_dict`` still work with the per-thread stand-ins."""

import copy
import sys
import threading

import pytest
import torch
from unit.moe_models import tiny_moe, tiny_qwen3_moe
from unit.tiny_models import tiny_gpt_oss, tiny_llama

import ds_fpquant as fpq
from ds_fpquant.nn.in_place import quantize_weight_in_place
from ds_fpquant.nn.quantized_params import quantized_experts

pytest.importorskip("transformers")

THREADS = 4
ROUNDS = 3
MODELS = {"llama": tiny_llama, "mixtral": lambda: tiny_moe("mixtral"), "qwen3_moe": tiny_qwen3_moe,
          "gpt_oss": tiny_gpt_oss, "deepseek_v3": lambda: tiny_moe("deepseek_v3")}


class TensorParallelLinear(torch.nn.Module):
    """DeepSpeed AutoTP's ``LinearLayer`` forward: ``matmul`` by the transposed ``self.weight``, plus the bias."""

    def __init__(self, n: int, k: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k) / k**0.5)
        self.bias = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.matmul(x, self.weight.transpose(-1, -2)) + self.bias.to(x.dtype)


class FunctionalLinear(TensorParallelLinear):
    """``F.linear(x, self.weight, self.bias)`` with an fp32 bias: the quantized linear rounds it to the compute
    dtype, so a call that ran in another thread's dtype shows."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


def _in_place_stack():
    torch.manual_seed(3)
    layers = torch.nn.Sequential(FunctionalLinear(96, 64), torch.nn.ReLU(), TensorParallelLinear(64, 96))
    for layer in (layers[0], layers[2]):
        quantize_weight_in_place(layer, "e4m3", 32)
    return layers


def _calls(model):
    """``[(name, call)]``: forwards of ``model`` (token ids) and of its first quantized experts module or linear
    layer on bf16 and fp32 hidden states (mixed dtypes share the module)."""
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 97, (1, 6 + i), generator=gen) for i in range(2)]
    calls = [(f"ids{i}", lambda i=i: model(ids[i]).logits) for i in range(2)]
    experts = next((m for m in model.modules() if quantized_experts(m)), None)
    for dtype in (torch.bfloat16, torch.float32):
        tokens = 5
        x = torch.randn(tokens, 64, generator=gen).to(dtype)
        if experts is not None:  # every expert routed: both projections of each run the quantized linear
            index = torch.stack([torch.arange(tokens) % 4, (torch.arange(tokens) + 1) % 4], dim=1)
            weights = torch.rand(tokens, 2, generator=gen).to(dtype)
            calls.append((f"experts-{dtype}", lambda x=x, index=index, weights=weights: experts(x, index, weights)))
        else:
            layer = model.model.layers[0].mlp.gate_proj  # an FPQuantizedLinear
            calls.append((f"linear-{dtype}", lambda x=x, layer=layer: layer(x)))
    return calls


def _run_concurrently(calls, rounds):
    """Each of ``THREADS`` threads runs every call ``rounds`` times (each thread in its own order), all threads
    starting together with a short switch interval so that their forwards interleave; returns ``[(name, result or
    the exception)]``."""
    barrier = threading.Barrier(THREADS)
    results, lock = [], threading.Lock()

    def work(t):
        order = calls[t % len(calls):] + calls[:t % len(calls)]
        barrier.wait()
        for _ in range(rounds):
            for name, call in order:
                try:
                    with torch.no_grad():
                        got = call()
                except Exception as exc:  # noqa: BLE001 - recorded and reported by the test
                    got = exc
                with lock:
                    results.append((name, got))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    return results


def _assert_bits_of_single_calls(calls, rounds=ROUNDS):
    with torch.no_grad():
        alone = {name: call() for name, call in calls}
    results = _run_concurrently(calls, rounds)
    assert len(results) == THREADS * rounds * len(calls)
    failed = [f"{name}: {got!r}" for name, got in results if isinstance(got, Exception)]
    assert not failed, f"{len(failed)} of {len(results)} concurrent calls raised: {failed[:3]}"
    differ = [name for name, got in results if not torch.equal(got, alone[name])]
    assert not differ, f"{len(differ)} of {len(results)} concurrent calls differ from the call alone: {differ[:5]}"


@pytest.mark.parametrize("kind", list(MODELS))
def test_threads_of_mixed_dtypes_give_the_bits_of_single_calls(kind):
    model = fpq.apply(MODELS[kind](), {"fp_quantization": {"fmt": "e4m3", "group_size": 32}})
    _assert_bits_of_single_calls(_calls(model))
    for module in model.modules():  # nothing presented once no forward runs
        for name in quantized_experts(module):
            assert getattr(module, name) is None


def test_threads_of_in_place_layers_of_mixed_dtypes():
    """AutoTP-style layers: a thread's compute dtype is its own input's (a bf16 call computes in bf16 while an fp32
    call runs the same layer)."""
    layers = _in_place_stack()
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(3, 64, generator=gen).to(dtype) for dtype in (torch.bfloat16, torch.float32) * 2]
    _assert_bits_of_single_calls([(f"x{i}-{x.dtype}", lambda x=x: layers(x)) for i, x in enumerate(inputs)], rounds=25)
    assert layers[0].weight is None and layers[2].weight is None


def test_compile_and_load_state_dict_with_per_thread_stand_ins():
    """A compiled in-place layer is the eager one bit for bit (the op on the same operands), before and after
    threads ran it; ``load_state_dict`` of other codes changes what every later forward, in any thread, uses."""
    layers, other = _in_place_stack(), _in_place_stack()
    with torch.no_grad():
        for layer in (other[0], other[2]):
            layer.weight_codes.copy_(torch.roll(layer.weight_codes, 1, 0))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = layers(x)
        compiled = torch.compile(layers, backend="aot_eager")  # the stand-ins break the graph
        assert torch.equal(compiled(x), eager)
        _assert_bits_of_single_calls([("eager", lambda: layers(x)), ("bf16", lambda: layers(x.bfloat16()))])
        assert torch.equal(compiled(x), eager) and layers[0].weight is None
        expected = other(x)
        assert not torch.equal(expected, eager)
        layers.load_state_dict(copy.deepcopy(other.state_dict()))
        _assert_bits_of_single_calls([("loaded", lambda: layers(x))])
        assert torch.equal(layers(x), expected)
