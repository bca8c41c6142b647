"""Tiny random mixture-of-experts models built from transformers 5 configs (no downloads), shared by the
MoE tests: Mixtral (per-expert keys ``block_sparse_moe.experts.{e}.w1/w2/w3``), Qwen2-MoE and DeepSeek-V3
(``mlp.experts.{e}.gate_proj/up_proj/down_proj``), each with two fused 3-D expert parameters per MoE layer."""

import torch
import transformers

KINDS = ("mixtral", "qwen2_moe", "deepseek_v3")


def tiny_moe(kind: str):
    """The model in eval mode, seeded."""
    common = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **common)
        model_class = transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, shared_expert_intermediate_size=64,
                                             decoder_sparse_step=1, **common)
        model_class = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.DeepseekV3Config(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                                               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                               n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **common)
        model_class = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    return model_class(config).eval()


def tiny_qwen3_moe():
    """A 2-layer Qwen3-MoE (hidden 64, 4 experts of 32; layer 0 a dense MLP, layer 1 MoE), seeded, eval mode."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
                                         max_position_embeddings=64)
    return transformers.Qwen3MoeForCausalLM(config).eval()
