#!/usr/bin/env python3
"""Reference of three GRPO updates of a model held in bf16 (verl's
`actor_rollout_ref.actor.fsdp_config.model_dtype=bf16`), in PyTorch: the weights, their
gradients and torch.optim.AdamW's moments all bf16, as verl's FSDP engine keeps them when it
loads the model with that dtype (AdamW creates its state with `zeros_like(param)`).

Writes tests/fixtures/bf16_params/:
  config.json, model.safetensors   a tiny Llama (byte vocabulary, 259 ids) in bf16
  steps.json                       three steps' rows: prompt ids, response ids, reward; the
                                   settings of the update
  expected.safetensors             every weight after each update (`step{s}.<name>`) and each
                                   step's gradients before clipping (`grad{s}.<name>`), bf16

Each step is what verl's trainer does with one GRPO batch of 2 prompts x 2 responses on one
process with one mini- and one micro-batch: token log-probs of the responses (logits in bf16,
log-softmax in f32, as flash-attn's cross entropy computes them from bf16 logits), old
log-probs from the same weights (on-policy, so the ratio is 1), GRPO advantages
`(r - mean) / (std + 1e-6)` per prompt (unbiased std), the vanilla clipped policy loss
aggregated token-mean, backward, `clip_grad_norm_(max_norm=1.0)` and one
`torch.optim.AdamW(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)` step (its
single-tensor form, PyTorch's default on the CPU; the foreach form verl gets on GPUs makes the
same tensor operations). Rows run one at a time, unpadded.

The Rust test (src/trainer/tests_bf16_params.rs) replays the same rows through main_ppo's
trainer. Run with the pinned reference venv (scripts/bench/requirements.txt):
  ~/.cache/main_ppo/bench-venv/bin/python scripts/bf16_params_reference.py
"""
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "bf16_params"
LR, WD, CLIP = 1e-2, 0.01, 1.0


def rows(g, n, lo, hi):
    return [torch.randint(3, 259, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def main():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10000.0,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model = model.to(torch.bfloat16)
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WD, foreach=False)
    steps, expected = [], {}
    for s in range(3):
        prompts = rows(g, 2, 3, 6)
        responses = rows(g, 4, 2, 6)
        # Rewards that differ within each prompt's pair, so every advantage is non-zero.
        rewards = [float(x) for x in torch.rand(4, generator=g)]
        steps.append({"prompts": prompts, "responses": responses, "rewards": rewards})
        r = torch.tensor(rewards, dtype=torch.float32).view(2, 2)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
        opt.zero_grad()
        terms, tokens = [], 0
        for i, resp in enumerate(responses):
            prompt = prompts[i // 2]
            ids = torch.tensor([prompt + resp])
            logits = model(ids).logits[0, len(prompt) - 1:-1]  # bf16 [len(resp), vocab]
            lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(resp)[:, None])[:, 0]
            old = lp.detach()
            ratio = torch.exp(lp - old)
            a = adv[i]
            pg1 = -a * ratio
            pg2 = -a * torch.clamp(ratio, 0.8, 1.2)
            pg = torch.maximum(pg1, pg2)
            if a < 0:
                pg = torch.minimum(-a * 3.0, pg)
            terms.append(pg.sum())
            tokens += len(resp)
        loss = torch.stack(terms).sum() / tokens
        loss.backward()
        for n, p in model.named_parameters():
            expected[f"grad{s + 1}.{n}"] = p.grad.detach().clone().contiguous()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        for n, p in model.named_parameters():
            expected[f"step{s + 1}.{n}"] = p.detach().clone().contiguous()
        steps[-1]["loss"] = float(loss)
        steps[-1]["grad_norm"] = float(norm)
    save_file(expected, str(OUT / "expected.safetensors"))
    meta = {
        "transformers": transformers.__version__, "torch": torch.__version__,
        "lr": LR, "weight_decay": WD, "grad_clip": CLIP, "betas": [0.9, 0.999], "eps": 1e-8,
        "steps": steps,
    }
    (OUT / "steps.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{len(expected)} tensors over 3 steps; losses {[round(x['loss'], 5) for x in steps]}"
          f", grad norms {[round(x['grad_norm'], 4) for x in steps]} -> {OUT}")


if __name__ == "__main__":
    main()
