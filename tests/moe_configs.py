"""Tiny random configs of the MoE families the CPU tests build (``test_experts.py``, ``test_router.py``).

Odd sizes on purpose: Mixtral's intermediate 80 makes gate_up 160 rows (padded to 256) and down 3
blocks (one padded); the expert counts are not powers of two.
"""

from __future__ import annotations

from typing import Any

VOCAB = 96


def tiny_moe_config(family: str, norm_topk_prob: bool | None = None) -> Any:
    """Two layers, hidden size 64, of ``family`` (``mixtral``, ``qwen3_moe``, ``qwen2_moe``, ``olmoe``).
    ``norm_topk_prob``: the routers' renormalisation where the family has the option (``None``:
    Qwen3-MoE's True, the others' config default); Mixtral always renormalises."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.05)
    norm = {} if norm_topk_prob is None else {"norm_topk_prob": norm_topk_prob}
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=80, num_key_value_heads=2, num_local_experts=4,
                                          num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=40, head_dim=16,
                                           num_key_value_heads=2, num_experts=6, num_experts_per_tok=3,
                                           **({"norm_topk_prob": True} | norm))
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, num_key_value_heads=2, num_experts=4,
                                           num_experts_per_tok=2, **norm)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=48, num_key_value_heads=4, num_experts=5,
                                        num_experts_per_tok=2, **norm)
    raise ValueError(family)
