"""Tiny random dense models built from transformers configs (no downloads), and what a model holds, shared by
the checkpoint and serialization tests (the MoE ones are in ``moe_models.py``)."""

import torch
import transformers


def tiny_llama(tie: bool = False):
    """A 2-layer Llama (hidden 64), seeded; ``tie``: the head tied to the embeddings."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=100, max_position_embeddings=64,
                                      tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_qwen3():
    """A 2-layer Qwen3 (q/k norms, head_dim 16), seeded."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=64)
    return transformers.Qwen3ForCausalLM(config).eval()


def tiny_gpt2():
    """A 2-layer GPT-2 (Conv1D weights, tied head), seeded."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_gpt_oss():
    """A 2-layer GPT-OSS (MoE experts with biases, stored transposed), seeded."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, max_position_embeddings=64,
                                       layer_types=["full_attention"] * 2)
    return transformers.GptOssForCausalLM(config).eval()


def stored_tensors(model) -> dict:
    """Every parameter and buffer of ``model``, by name (quantized weights' codes and scales among them)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def assert_same_tensors(a, b, what: str = "") -> None:
    """``a`` and ``b`` hold the same parameters and buffers: the same names, dtypes and bytes."""
    ours, theirs = stored_tensors(a), stored_tensors(b)
    assert ours.keys() == theirs.keys(), what
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype, f"{what}: {key}"
        assert torch.equal(ours[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), f"{what}: {key}"
