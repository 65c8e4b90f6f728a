"""Tiny random models of the architectures people fine-tune, built from transformers' config
classes: the architecture matrix's zoo (tests/test_architectures.py) and bench/architectures.py.

Each entry is a config small enough to load in 4-bit and run a PPO step in about a second, with
the field that makes the architecture different (a logit soft-cap, a logit scale, fused MoE
experts, Conv1D layers, ALiBi, a flattening decoder) set large enough to matter.
"""

from __future__ import annotations

from pathlib import Path

HIDDEN, LAYERS, HEADS = 64, 2, 4
# Soft-cap and scales set far from 1 so a dropped transform moves logprobs by much more than noise.
GEMMA_SOFTCAP = 2.0
GRANITE_LOGITS_SCALING = 4.0
COHERE_LOGIT_SCALE = 3.0


def _common(vocab: int) -> dict:
    return {"vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2}


def _llama_like(vocab: int, **extra) -> dict:
    return {
        **_common(vocab), "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "tie_word_embeddings": True, **extra,
    }


def configs(vocab: int) -> dict:
    """{architecture name: a transformers config} for a tokenizer of `vocab` tokens."""
    import transformers as tf

    return {
        "gpt2": tf.GPT2Config(**_common(vocab), n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=256),
        "gpt_neox": tf.GPTNeoXConfig(**_common(vocab), hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                                     num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=256),
        "opt": tf.OPTConfig(**_common(vocab), hidden_size=HIDDEN, ffn_dim=4 * HIDDEN, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN, max_position_embeddings=256),
        "falcon": tf.FalconConfig(**_common(vocab), hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, new_decoder_architecture=False, multi_query=True,
                                  alibi=False, parallel_attn=True, bias=False),
        "bloom": tf.BloomConfig(**_common(vocab), hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS),
        "llama": tf.LlamaConfig(**_llama_like(vocab)),
        "mistral": tf.MistralConfig(**_llama_like(vocab, sliding_window=None)),
        "qwen2": tf.Qwen2Config(**_llama_like(vocab)),
        "qwen3": tf.Qwen3Config(**_llama_like(vocab, head_dim=16)),
        "qwen3_moe": tf.Qwen3MoeConfig(**_llama_like(vocab, head_dim=16), moe_intermediate_size=32, num_experts=4,
                                       num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
        # Not in the zoo below: the shared experts beside fused ones that PEFT 0.22 reads as transformers-4 names.
        "qwen2_moe": tf.Qwen2MoeConfig(**_llama_like(vocab), moe_intermediate_size=32, num_experts=4,
                                       num_experts_per_tok=2, shared_expert_intermediate_size=48, decoder_sparse_step=1,
                                       mlp_only_layers=[]),
        "gemma2": tf.Gemma2Config(**_llama_like(vocab, head_dim=16), final_logit_softcapping=GEMMA_SOFTCAP,
                                  attn_logit_softcapping=50.0, query_pre_attn_scalar=16, sliding_window=64),
        "gemma3": tf.Gemma3TextConfig(**_llama_like(vocab, head_dim=16), final_logit_softcapping=GEMMA_SOFTCAP,
                                      query_pre_attn_scalar=16, sliding_window=64),
        "phi3": tf.Phi3Config(**_llama_like(vocab), original_max_position_embeddings=256),
        "olmo2": tf.Olmo2Config(**_llama_like(vocab)),
        "smollm3": tf.SmolLM3Config(**_llama_like(vocab)),
        "granite": tf.GraniteConfig(**_llama_like(vocab), logits_scaling=GRANITE_LOGITS_SCALING),
        "cohere": tf.CohereConfig(**_llama_like(vocab), logit_scale=COHERE_LOGIT_SCALE),
    }


ARCHITECTURES = ("gpt2", "gpt_neox", "opt", "falcon", "bloom", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                 "gemma2", "gemma3", "phi3", "olmo2", "smollm3", "granite", "cohere")


def build_model(name: str, folder: Path, vocab: int, seed: int = 0):
    """A random causal LM of architecture `name`, saved to `folder` (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = configs(vocab)[name]
    config.initializer_range = 0.2  # logits spread enough that transforms and mistakes show
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return model
