#!/usr/bin/env python3
"""Reference numbers for each supported model family, from transformers and PyTorch autograd.

For every family this writes tests/fixtures/families/<name>/:
  config.json, model.safetensors   a tiny random checkpoint, written by transformers'
                                   save_pretrained (float64 weights)
  reference.json                   prompts, greedy continuations and their log-probs (f64),
                                   the training sequences and loss weights, the loss
  grads.safetensors                d(loss)/d(parameter) for every parameter (f64), by autograd
  chat/                            (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) the same architecture with
                                   the byte-level test tokenizer and greedy answers to chat
                                   prompts, for `main_ppo generate` and the GGUF fixtures

The greedy continuation is computed with a plain loop over full forwards (argmax of the last
position's logits, no KV cache, no generation config), so nothing but the model's own forward
decides it. The training loss is L = sum_i sum_t c[i][t] * log p(s_i[t+1] | s_i[..t]) over
sequences s_i run one at a time (no padding), with fixed weights c.

Run with the pinned reference venv (scripts/bench/requirements.txt: torch 2.15, transformers
5.24):  ~/.cache/main_ppo/bench-venv/bin/python scripts/family_reference.py [NAME ...]
The Rust tests (src/weights/family_tests.rs) read the fixtures; CI does not run this script.

transformers computes some parts in float32 whatever the model's dtype (RoPE frequencies and
tables, RMSNorm, the attention softmax): for a float64 reference those casts would only add
float32 rounding (~1e-7) to every number. `exact_f64()` keeps them in float64: a float64
tensor asked to become float32 stays float64, and RoPE's `arange(..., dtype=float)` is float64.
The model code is transformers' own otherwise.
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "families"
VOCAB = 96


def exact_f64():
    """Keeps transformers' float32 upcasts in float64 (see the module docstring)."""
    to, flt, arange, softmax = torch.Tensor.to, torch.Tensor.float, torch.arange, torch.nn.functional.softmax
    typ = torch.Tensor.type

    def to64(self, *args, **kw):
        # float64 tensors, and integer ones (yarn's `arange(...).to(dtype=float)`), asked to
        # become float32 become float64.
        if self.dtype == torch.float64 or not self.dtype.is_floating_point:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kw.get("dtype") is torch.float32:
                kw["dtype"] = torch.float64
        return to(self, *args, **kw)

    def type64(self, dtype=None, *args, **kw):
        # DeepSeek-V3's router: `hidden_states.type(torch.float32)`.
        if dtype is torch.float32 and self.dtype == torch.float64:
            return self
        return typ(self, dtype, *args, **kw) if dtype is not None else typ(self)

    def float64(self, *args, **kw):
        return self if self.dtype == torch.float64 else flt(self, *args, **kw)

    def arange64(*args, dtype=None, **kw):
        return arange(*args, dtype=torch.float64 if dtype is torch.float32 else dtype, **kw)

    def softmax64(x, *args, dtype=None, **kw):
        if x.dtype == torch.float64 and dtype is torch.float32:
            dtype = torch.float64
        return softmax(x, *args, dtype=dtype, **kw)

    torch.Tensor.to = to64
    torch.Tensor.type = type64
    torch.Tensor.float = float64
    torch.arange = arange64
    torch.nn.functional.softmax = softmax64


def families():
    """Tiny configurations, one per family (and variant), with what each must exercise."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    return {
        # Llama with untied embeddings and llama3 RoPE scaling.
        "llama": transformers.LlamaConfig(
            **common,
            head_dim=8,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        # Qwen2: q/k/v biases, tied embeddings.
        "qwen2": transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=10000.0),
        # Seed-OSS: Llama's layer with q/k/v biases (attention_bias) and an o_proj bias of its
        # own (attention_out_bias, on here; false in the published models), an explicit
        # head_dim unlike hidden/heads, untied; its dropouts (0.1 as in the class defaults)
        # act only in train mode, and the reference runs in eval mode.
        "seed_oss": transformers.SeedOssConfig(
            **common,
            head_dim=16,
            attention_bias=True,
            attention_out_bias=True,
            attention_dropout=0.1,
            residual_dropout=0.1,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
        ),
        # MiMo: Qwen2's model (q/k/v biases, untied) plus two multi-token-prediction layers
        # (num_nextn_predict_layers) that its forward never runs; see `mimo_mtp_layers`.
        "mimo": mimo_config(common),
        # Qwen3: per-head q/k RMSNorm, an explicit head_dim unlike hidden/heads, no biases.
        "qwen3": transformers.Qwen3Config(
            **common, head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0
        ),
        # Qwen3 with tied embeddings and attention biases (attention_bias: true).
        "qwen3_tied_bias": transformers.Qwen3Config(
            **common, head_dim=8, tie_word_embeddings=True, attention_bias=True
        ),
        # Qwen3 with a sliding window from layer 1 on (use_sliding_window, max_window_layers).
        "qwen3_window": transformers.Qwen3Config(
            **common, head_dim=8, use_sliding_window=True, sliding_window=4, max_window_layers=1
        ),
        # Mistral: a sliding window on every layer.
        "mistral_window": transformers.MistralConfig(**common, head_dim=8, sliding_window=3),
        # Qwen3-MoE: 8 experts, top-2 renormalised, a dense layer between sparse ones
        # (mlp_only_layers), untied.
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
        # Qwen3-MoE: every second layer sparse (decoder_sparse_step), top-3 of 4 experts without
        # renormalisation, tied embeddings.
        "qwen3_moe_step2": transformers.Qwen3MoeConfig(
            **common,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=3,
            moe_intermediate_size=12,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
        # Qwen2-MoE (Qwen1.5-MoE): q/k/v biases (qkv_bias), 8 experts top-2 unnormalised, a
        # shared expert behind a sigmoid gate, a dense layer between sparse ones, untied.
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **{**common, "num_hidden_layers": 3},
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            qkv_bias=True,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        # Qwen2-MoE without biases, its own sliding-window pattern (every other layer below
        # max_window_layers, the first sliding), 4 experts top-3 renormalised on every second
        # layer, tied embeddings.
        "qwen2_moe_window": transformers.Qwen2MoeConfig(
            **{**common, "num_hidden_layers": 3},
            num_experts=4,
            num_experts_per_tok=3,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            qkv_bias=False,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        # Gemma 3 (text): (1 + w) norms, sandwich norms, GELU-tanh, scaled embeddings,
        # query_pre_attn_scalar, sliding layers with their own RoPE base, linear RoPE scaling on
        # the full layer, tied embeddings.
        "gemma3": transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
        ),
        # Gemma 2: Gemma 3's layer without q/k norms, one RoPE base, sliding layers alternating
        # with full ones (transformers' default), soft-capped scores and logits with caps low
        # enough (5 and 3) that the tanh acts on the tiny model, tied embeddings.
        "gemma2": transformers.Gemma2Config(
            **{**common, "num_hidden_layers": 3},
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=4,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        # Gemma 2 without soft-capping, a full layer first, untied.
        "gemma2_nocap": transformers.Gemma2Config(
            **common,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=3,
            layer_types=["full_attention", "sliding_attention"],
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        # Qwen3.5 (text): three Gated DeltaNet layers then a gated full-attention layer
        # (transformers' default layer_types), partial rotary 0.25, two value heads per key
        # head, untied.
        "qwen3_5": transformers.Qwen3_5TextConfig(
            **{**common, "num_hidden_layers": 4},
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            tie_word_embeddings=False,
        ),
        # Qwen3.5 with an attention layer first, one value head per key head, a width-3
        # convolution, rotary over half of each head, tied embeddings.
        "qwen3_5_tied": transformers.Qwen3_5TextConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=8,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.5},
            linear_conv_kernel_dim=3,
            linear_key_head_dim=6,
            linear_value_head_dim=6,
            linear_num_key_heads=3,
            linear_num_value_heads=3,
            tie_word_embeddings=True,
        ),
        # Qwen3.5-MoE (text): experts on every layer (8, top-2, always renormalised) and a
        # shared expert behind its sigmoid gate; DeltaNet, then gated attention, twice.
        "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig(
            **{**common, "num_hidden_layers": 4},
            head_dim=8,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            tie_word_embeddings=False,
        ),
        # Qwen3-Next: the DeltaNet's fused, per-key-head grouped projections (in_proj_qkvz,
        # in_proj_ba), experts with a shared expert on layers 0 and 2 (mlp_only_layers [1]),
        # top-3 of 4 unnormalised, tied embeddings.
        "qwen3_next": transformers.Qwen3NextConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=16,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=6,
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            num_experts=4,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=True,
        ),
        # DeepSeek-V3: multi-head latent attention with a low-rank q (q_a_proj, q_a_layernorm,
        # q_b_proj), yarn RoPE (mscale unlike mscale_all_dim, so both the cos/sin factor and
        # the softmax scale's adjustment act) on interleaved rope dimensions; a dense first
        # layer (first_k_dense_replace) then experts with sigmoid scores, a score-correction
        # bias (random here) choosing among 2 of 4 groups, top-3 renormalised and scaled,
        # plus two shared experts; untied.
        "deepseek_v3": deepseek_config(
            common,
            q_lora_rank=16,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            attention_bias=False,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        ),
        # DeepSeek-V3 with a plain q_proj (q_lora_rank null, as Moonlight), one group, top-3
        # unnormalised, plain RoPE on half-split rope dimensions, attention biases
        # (q_a/kv_a/o_proj), tied embeddings.
        "deepseek_v3_qnull": deepseek_config(
            common,
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rope_interleave=False,
            attention_bias=True,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        ),
        # GLM-4.5: grouped-query attention with q/k/v biases (none on o_proj), per-head q/k
        # RMSNorms (use_qk_norm), rotary embeddings over the first half of each head
        # (partial_rotary_factor's default 0.5) in two halves; a dense first layer, then
        # DeepSeek-V3's experts: sigmoid scores with a random correction bias, the best of 2
        # groups, top-3 of 8 renormalised and scaled, one shared expert; untied.
        "glm4_moe": transformers.Glm4MoeConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=8,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            num_mtp_layers=0,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        # GLM-4.5 without q/k norms or biases, rotary over a quarter of 16-value heads, two
        # dense layers before the experts, top-2 of 4 unnormalised in one group, two shared
        # experts, tied embeddings.
        "glm4_moe_plain": transformers.Glm4MoeConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=16,
            attention_bias=False,
            use_qk_norm=False,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=12,
            n_shared_experts=2,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            first_k_dense_replace=2,
            num_mtp_layers=0,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
        # GPT-OSS: q/k/v/o biases, a learned sink logit per head in every softmax,
        # sliding-window layers (4 positions) alternating with full ones (transformers'
        # default layer_types), yarn RoPE (factor 32, untruncated, as the published models);
        # every layer a mixture of 4 experts (top 2, softmax over the chosen logits) with a
        # router bias, biased experts and the clamped SwiGLU, its limit low enough (1.0) that
        # the clamps act; untied.
        "gpt_oss": transformers.GptOssConfig(
            **{**common, "num_hidden_layers": 3, "intermediate_size": 12},
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            swiglu_limit=1.0,
            attention_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
        # GPT-OSS as published: its experts stored as MXFP4 codes and scales (`mxfp4_experts`),
        # with a width of 32 (one scale group per row).
        "gpt_oss_mxfp4": transformers.GptOssConfig(
            **{**common, "num_hidden_layers": 2, "intermediate_size": 32},
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            attention_bias=True,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        ),
        # GPT-OSS without biases, plain RoPE, a full layer first then a 3-position sliding
        # one, top-3 of 6 experts, the published clamp (7.0), tied embeddings.
        "gpt_oss_plain": transformers.GptOssConfig(
            **{**common, "intermediate_size": 10},
            head_dim=16,
            num_local_experts=6,
            num_experts_per_tok=3,
            sliding_window=3,
            layer_types=["full_attention", "sliding_attention"],
            attention_bias=False,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    }


def deepseek_config(common, **kw):
    """A tiny DeepSeek-V3 config: 4 heads of 8 no-rope + 4 rope query/key values and 6 value
    values, a 12-wide kv latent; 3 layers, the first dense, then 8 routed experts of width 8
    (top 3) and two shared experts (one MLP of width 16)."""
    return transformers.DeepseekV3Config(
        **{**common, "num_hidden_layers": 3, "num_key_value_heads": 4},
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=8,
        n_shared_experts=2,
        first_k_dense_replace=1,
        num_mtp_layers=0,
        **kw,
    )


def mimo_config(common):
    """MiMo's config: a Qwen2 config (MiMoConfig subclasses Qwen2Config) with
    `num_nextn_predict_layers`. MiMo's modeling code is remote code in the hub's
    XiaomiMiMo/MiMo-7B-* folders (modeling_mimo.py, not part of transformers, and the hub is
    not reachable here), so the checkpoint is a transformers Qwen2 model with MiMo's MTP
    modules attached under the names and shapes MiMo's checkpoints use (`mimo_mtp_layers`),
    and config.json names MiMoForCausalLM / mimo (`make`)."""
    cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=640000.0)
    cfg.num_nextn_predict_layers = 2
    return cfg


def mimo_mtp_layers(cfg):
    """MiMo's multi-token-prediction layers as its remote code builds them (MiMoMTPLayers of
    modeling_mimo.py, XiaomiMiMo/MiMo-7B-RL): RMSNorms `token_layernorm` (of the next token's
    embedding) and `hidden_layernorm` (of the main model's hidden state), `input_proj`
    [hidden, 2·hidden] without bias over their concatenation, a Qwen2 decoder layer
    (`input_layernorm`, `self_attn` with q/k/v biases, `post_attention_layernorm`, `mlp`) and
    `final_layernorm`. MiMoModel keeps them in `mtp_layers` and its forward (Qwen2Model's)
    never calls them: only their tensors matter here."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP, Qwen2RMSNorm

    def one():
        layer = torch.nn.Module()
        h = cfg.hidden_size
        for n in ("token_layernorm", "hidden_layernorm", "input_layernorm",
                  "post_attention_layernorm", "final_layernorm"):
            setattr(layer, n, Qwen2RMSNorm(h, eps=cfg.rms_norm_eps))
        layer.input_proj = torch.nn.Linear(2 * h, h, bias=False)
        layer.self_attn = Qwen2Attention(cfg, layer_idx=0)
        layer.mlp = Qwen2MLP(cfg)
        return layer

    return torch.nn.ModuleList([one() for _ in range(cfg.num_nextn_predict_layers)])


MODEL_CLASS = {
    "SeedOssConfig": transformers.SeedOssForCausalLM,
    "Qwen3_5TextConfig": transformers.Qwen3_5ForCausalLM,
    "Qwen3_5MoeTextConfig": transformers.Qwen3_5MoeForCausalLM,
    "Qwen3NextConfig": transformers.Qwen3NextForCausalLM,
    "LlamaConfig": transformers.LlamaForCausalLM,
    "Qwen2Config": transformers.Qwen2ForCausalLM,
    "Qwen3Config": transformers.Qwen3ForCausalLM,
    "Qwen3MoeConfig": transformers.Qwen3MoeForCausalLM,
    "Qwen2MoeConfig": transformers.Qwen2MoeForCausalLM,
    "MistralConfig": transformers.MistralForCausalLM,
    "Gemma3TextConfig": transformers.Gemma3ForCausalLM,
    "Gemma2Config": transformers.Gemma2ForCausalLM,
    "DeepseekV3Config": transformers.DeepseekV3ForCausalLM,
    "Glm4MoeConfig": transformers.Glm4MoeForCausalLM,
    "GptOssConfig": transformers.GptOssForCausalLM,
}


def per_expert(named):
    """transformers 5's fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, h], gate rows
    first; `mlp.experts.down_proj` [E, h, I]) under the hub's per-expert names, as the
    checkpoint is saved."""
    out = {}
    for n, t in named.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{n[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{n[:-len('gate_up_proj')]}{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif n.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{n[:-len('down_proj')]}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[n] = t
    return out


def rows(seed, n, lo, hi):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def spread(model, seed):
    """Spreads the weights beyond the init's 0.02 so that every path carries signal: N(0, 0.3²),
    norms 1 + N(0, 0.3²), drawn from a generator seeded with `seed`."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
        for n, b in model.named_buffers():
            # DeepSeek-V3's score-correction bias (a buffer saved with the weights, 0 at init).
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g, dtype=torch.float64))


def mxfp4_experts(model):
    """GPT-OSS's experts as its published checkpoints hold them: random MXFP4 codes (two 4-bit
    E2M1 values per byte) and per-32-value power-of-two scales (`2^(s - 127)`, s in 118..124),
    dequantized into the model by transformers' own `convert_moe_packed_tensors` (exact in
    float64: codes times powers of two). Returns the blocks and scales, for the checkpoint."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(31)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for proj, (rows, cols) in (("gate_up_proj", (ex.gate_up_proj.shape[2], ex.gate_up_proj.shape[1])),
                                       ("down_proj", (ex.down_proj.shape[2], ex.down_proj.shape[1]))):
                e = ex.gate_up_proj.shape[0]
                blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
                scales = torch.randint(118, 125, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
                w = convert_moe_packed_tensors(blocks, scales, dtype=torch.float64)
                getattr(ex, proj).copy_(w)
                packed[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    return packed


def make(name, cfg):
    if getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None):
        # transformers' own loop over experts (its grouped_mm kernels take no float64).
        cfg._experts_implementation = "eager"
    torch.manual_seed(1234)
    model = MODEL_CLASS[type(cfg).__name__](cfg)
    # MiMo's (GLM-4.5 and DeepSeek-V3 name theirs alike; their references have none).
    mtp = getattr(cfg, "num_nextn_predict_layers", 0) if type(cfg).__name__ == "Qwen2Config" else 0
    if mtp:
        model.model.mtp_layers = mimo_mtp_layers(cfg)
    model = model.to(torch.float64).eval()
    spread(model, 99)
    packed = mxfp4_experts(model) if name.endswith("mxfp4") else None
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if mtp:
        # MiMo's names for the checkpoint (its config class is Qwen2's plus this key).
        c = json.loads((out / "config.json").read_text())
        c.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=mtp)
        (out / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
        cfg.architectures = ["MiMoForCausalLM"]
    gpt_oss = type(cfg).__name__ == "GptOssConfig"
    if (getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)) and not gpt_oss:
        # The same weights as transformers 5 holds them (experts fused per layer; GPT-OSS's
        # checkpoints are fused already).
        model.save_pretrained(out / "fused", safe_serialization=True, save_original_format=False)
    # Greedy continuations by full forwards.
    prompts = rows(7, 3, 2, 7)
    new = 12
    greedy = []
    with torch.no_grad():
        for pr in prompts:
            seq, lps = list(pr), []
            for _ in range(new):
                logits = model(torch.tensor([seq])).logits[0, -1]
                lp = torch.log_softmax(logits, -1)
                tok = int(torch.argmax(lp))
                top2 = torch.topk(lp, 2).values
                seq.append(tok)
                lps.append({"token": tok, "logprob": float(lp[tok]), "gap": float(top2[0] - top2[1])})
            greedy.append(lps)
    # Training loss and gradients.
    seqs = rows(11, 3, 4, 10)
    g = torch.Generator().manual_seed(5)
    weights = [(torch.rand(len(s) - 1, generator=g, dtype=torch.float64) * 2 - 1).tolist() for s in seqs]
    model.zero_grad()
    loss = torch.zeros((), dtype=torch.float64)
    token_logprobs = []
    for s, c in zip(seqs, weights):
        ids = torch.tensor([s])
        lp = torch.log_softmax(model(ids).logits[0, :-1], -1)
        tl = lp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
        token_logprobs.append(tl.detach().tolist())
        loss = loss + (tl * torch.tensor(c, dtype=torch.float64)).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters() if p.grad is not None}
    if not gpt_oss:
        grads = per_expert(grads)
    save_file(grads, str(out / "grads.safetensors"))
    ref = {
        "family": name,
        "architectures": cfg.architectures or [MODEL_CLASS[type(cfg).__name__].__name__],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompts": prompts,
        "greedy": greedy,
        "sequences": seqs,
        "loss_weights": weights,
        "token_logprobs": token_logprobs,
        "loss": float(loss.detach()),
        "parameters": sorted(grads),
    }
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    if packed:
        # The checkpoint as published: the experts' weights as MXFP4 blocks and scales.
        from safetensors.torch import load_file
        tensors = {k: v for k, v in load_file(str(out / "model.safetensors")).items()
                   if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        tensors.update(packed)
        save_file(tensors, str(out / "model.safetensors"))
        c = json.loads((out / "config.json").read_text())
        c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (out / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    print(f"{name}: {len(grads)} parameters, loss {float(loss.detach()):.6f} -> {out}")
    if type(cfg).__name__ == "Qwen3_5TextConfig" and name == "qwen3_5":
        multimodal(model, cfg, out)


def multimodal(model, text_cfg, out):
    """The same language model inside a Qwen3_5ForConditionalGeneration checkpoint (as the
    hub's Qwen3.5 models are published: `model.language_model.*`, a vision tower
    `model.visual.*`), written by transformers to `<out>/multimodal/`."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text_cfg.hidden_size,
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    cfg = transformers.Qwen3_5Config(text_config=text_cfg.to_dict(), vision_config=vision)
    mm = transformers.Qwen3_5ForConditionalGeneration(cfg).to(torch.float64)
    missing, unexpected = mm.model.language_model.load_state_dict(model.model.state_dict(), strict=True), None
    mm.lm_head.load_state_dict(model.lm_head.state_dict())
    mm.save_pretrained(out / "multimodal", safe_serialization=True)
    with torch.no_grad():
        ids = torch.tensor([[3, 17, 42, 8, 91, 5]])
        diff = (mm(input_ids=ids).logits - model(ids).logits).abs().max()
    assert float(diff) == 0.0, diff


# The hybrid families also get `<name>/chat/`: the same configuration over the byte-level test
# tokenizer's 259 ids (tests/fixtures/byte_tokenizer: one id per byte, then <|endoftext|>,
# <|im_start|>, <|im_end|>), its tokenizer files and ChatML template, and greedy answers to chat
# prompts, so that `main_ppo generate` runs end to end on it (template, tokenizer, model, decode)
# and llama.cpp's converter can write a GGUF of it (scripts/gguf_reference.sh).
CHAT = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
TOKENIZER = OUT.parent / "byte_tokenizer"
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Count: 1, 2,"}],
]


def chat(name, cfg):
    import shutil

    extra = {"vocab_size": 259, "eos_token_id": 258, "pad_token_id": 256}
    if type(cfg).__name__ == "Qwen3NextConfig":
        # Experts on every layer and renormalised top-k weights, as in the published
        # Qwen3-Next (llama.cpp's converter and its qwen3next architecture have no dense layers
        # and always renormalise).
        extra["mlp_only_layers"] = []
        extra["norm_topk_prob"] = True
    cfg = type(cfg).from_dict({**cfg.to_dict(), **extra})
    if getattr(cfg, "num_experts", None):
        cfg._experts_implementation = "eager"
    torch.manual_seed(4321)
    model = MODEL_CLASS[type(cfg).__name__](cfg).to(torch.float64).eval()
    spread(model, 77)
    out = OUT / name / "chat"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    eos = json.loads((TOKENIZER / "generation_config.json").read_text())["eos_token_id"]
    new = 12
    answers = []
    with torch.no_grad():
        for messages in CHAT_PROMPTS:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            seq, steps = list(ids), []
            for _ in range(new):
                lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1], -1)
                t = int(torch.argmax(lp))
                top2 = torch.topk(lp, 2).values
                steps.append({"token": t, "logprob": float(lp[t]), "gap": float(top2[0] - top2[1])})
                if t in eos:
                    break
                seq.append(t)
            tokens = [s["token"] for s in steps]
            answers.append({
                "messages": messages,
                "prompt_ids": list(ids),
                "greedy": steps,
                # What a caller sees: the tokens decoded without special tokens.
                "text": tok.decode(tokens, skip_special_tokens=True),
            })
    ref = {
        "family": name,
        "architectures": [MODEL_CLASS[type(cfg).__name__].__name__],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "max_new_tokens": new,
        "eos_token_ids": eos,
        "answers": answers,
    }
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(f"{name}/chat: {[len(a['greedy']) for a in answers]} tokens -> {out}")


def main():
    exact_f64()
    want = sys.argv[1:]
    for name, cfg in families().items():
        if not want or name in want or (name in CHAT and f"{name}/chat" in want):
            if not want or name in want:
                make(name, cfg)
            if name in CHAT:
                chat(name, cfg)


if __name__ == "__main__":
    main()
