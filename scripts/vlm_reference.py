#!/usr/bin/env python3
"""Reference numbers for the vision-language families, from transformers and PyTorch autograd.

For every checkpoint this writes tests/fixtures/vlm/<name>/:
  config.json, model.safetensors   a tiny random checkpoint written by transformers'
                                   save_pretrained (float64 weights)
  inputs.safetensors               the pixel values of the test images, `[patches, C·T·P·P]`
                                   each (`pixel_values_<i>`), as the image processor lays them out
  reference.json                   the image grids, the token sequences (image placeholders
                                   expanded), their 3-D rotary positions and deltas, per-token
                                   log-probs (f64), greedy continuations, the loss weights and loss
  vision.safetensors               the vision tower's merged output per image (`image_<i>`)
  grads.safetensors                d(loss)/d(parameter) for every parameter (f64), vision tower
                                   included, by autograd

The model forward is transformers' own (`Qwen2_5_VLForConditionalGeneration`), fed what its
processor gives: input ids with `<|image_pad|>` repeated per merged patch, `pixel_values`,
`image_grid_thw` and `mm_token_type_ids` (1 at image tokens), with no padding. Greedy tokens come
from a plain loop of full forwards (positions recomputed by the model each step). The loss is
L = sum_i sum_t c[i][t] * log p(s_i[t+1] | s_i[..t]) with c = 0 where the target is an image token.

transformers computes some parts in float32 whatever the dtype (the vision and text RMSNorms,
the rotary tables, `apply_rotary_pos_emb_vision`'s `q.float()`, the attention softmax); as in
scripts/family_reference.py, `exact_f64()` keeps those in float64 for a float64 reference.

Run with the pinned venv (scripts/bench/requirements.txt):
  ~/.cache/main_ppo/bench-venv/bin/python scripts/vlm_reference.py [NAME ...]
The Rust tests (src/weights/vlm_tests.rs) read the fixtures; CI does not run this script.
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_reference import exact_f64  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vlm"
VOCAB = 96
IMAGE, VIDEO, VSTART, VEND = 90, 91, 92, 93


def qwen2_5_vl(window=True):
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        # head_dim 16: 8 rotary frequencies split 2 (temporal) / 3 (height) / 3 (width).
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=40,
        num_heads=2,
        in_channels=3,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        # 16 pixels = 2 merged patches per window side.
        window_size=16 if window else 1024,
        fullatt_block_indexes=[1],
        out_hidden_size=64,
        hidden_act="silu",
        tokens_per_second=2,
    )
    return transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        tie_word_embeddings=False,
    )


def checkpoints():
    return {
        # Window attention on blocks 0 and 2 (windows of 2x2 merged patches, partial ones at
        # the edges), full attention on block 1.
        "qwen2_5_vl": qwen2_5_vl(),
    }


# Image grids (t, h, w) in patches: merged tokens 4*6, 2*2, 3*5; windows of 2x2 merged patches
# cut the first into 2x3, the third into 2x3 with partial windows.
GRIDS = [(1, 8, 12), (1, 4, 4), (1, 6, 10)]


def spread(model, seed):
    """Weights N(0, 0.3²) and norms 1 + N(0, 0.3²), so every path carries signal."""
    norms = ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "layernorm.weight")
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for n, p in model.named_parameters():
            base = 1.0 if n.endswith(norms) else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))


def tokens_of(grid, merge):
    t, h, w = grid
    return t * h * w // (merge * merge)


def sequences(merge):
    """Token sequences with images: (ids, image indices in order)."""
    g = torch.Generator().manual_seed(17)

    def text(n):
        return torch.randint(1, 89, (n,), generator=g).tolist()

    def image(i):
        return [VSTART] + [IMAGE] * tokens_of(GRIDS[i], merge) + [VEND]

    return [
        (text(3) + image(0) + text(5), [0]),
        (image(1) + text(2) + image(2) + text(4), [1, 2]),
        (text(9), []),
    ]


def pixel_values(g, grid, cfg):
    v = cfg.vision_config
    t, h, w = grid
    dim = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size
    return torch.randn(t * h * w, dim, generator=g, dtype=torch.float64)


def forward(model, ids, images, pixels):
    kw = {"input_ids": torch.tensor([ids])}
    if images:
        kw["pixel_values"] = torch.cat([pixels[i] for i in images])
        kw["image_grid_thw"] = torch.tensor([GRIDS[i] for i in images])
        kw["mm_token_type_ids"] = (kw["input_ids"] == IMAGE).to(torch.int32)
    return model(**kw).logits[0]


def make(name, cfg):
    torch.manual_seed(1234)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float64).eval()
    spread(model, 99)
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    merge = cfg.vision_config.spatial_merge_size
    g = torch.Generator().manual_seed(23)
    pixels = [pixel_values(g, grid, cfg) for grid in GRIDS]
    save_file({f"pixel_values_{i}": p.contiguous() for i, p in enumerate(pixels)}, str(out / "inputs.safetensors"))
    with torch.no_grad():
        feats = {}
        for i, grid in enumerate(GRIDS):
            o = model.model.get_image_features(pixels[i], torch.tensor([grid]), return_dict=True)
            feats[f"image_{i}"] = o.pooler_output[0].contiguous()
        save_file(feats, str(out / "vision.safetensors"))
    seqs = sequences(merge)
    # 3-D rotary positions as transformers computes them.
    positions = []
    for ids, images in seqs:
        t = torch.tensor([ids])
        if images:
            pos, delta = model.model.get_rope_index(
                t, mm_token_type_ids=(t == IMAGE).to(torch.int32),
                image_grid_thw=torch.tensor([GRIDS[i] for i in images]))
            positions.append({"positions": pos[:, 0].tolist(), "delta": int(delta[0, 0])})
        else:
            positions.append({"positions": [list(range(len(ids)))] * 3, "delta": 0})
    # Greedy continuations by full forwards.
    greedy = []
    with torch.no_grad():
        for ids, images in seqs:
            seq, steps = list(ids), []
            for _ in range(6):
                lp = torch.log_softmax(forward(model, seq, images, pixels)[-1], -1)
                tok = int(torch.argmax(lp))
                top2 = torch.topk(lp, 2).values
                seq.append(tok)
                steps.append({"token": tok, "logprob": float(lp[tok]), "gap": float(top2[0] - top2[1])})
            greedy.append(steps)
    # Loss and gradients (vision tower included).
    gw = torch.Generator().manual_seed(5)
    weights = []
    for ids, _ in seqs:
        c = torch.rand(len(ids) - 1, generator=gw, dtype=torch.float64) * 2 - 1
        c[torch.tensor(ids[1:]) == IMAGE] = 0.0
        weights.append(c.tolist())
    model.zero_grad()
    loss = torch.zeros((), dtype=torch.float64)
    token_logprobs = []
    for (ids, images), c in zip(seqs, weights):
        lp = torch.log_softmax(forward(model, ids, images, pixels)[:-1], -1)
        tl = lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
        token_logprobs.append(tl.detach().tolist())
        loss = loss + (tl * torch.tensor(c, dtype=torch.float64)).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters() if p.grad is not None}
    save_file(grads, str(out / "grads.safetensors"))
    ref = {
        "family": name,
        "architectures": cfg.architectures or ["Qwen2_5_VLForConditionalGeneration"],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "grids": GRIDS,
        "sequences": [ids for ids, _ in seqs],
        "images": [images for _, images in seqs],
        "positions": positions,
        "greedy": greedy,
        "loss_weights": weights,
        "token_logprobs": token_logprobs,
        "loss": float(loss.detach()),
        "parameters": sorted(grads),
    }
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(f"{name}: {len(grads)} parameters, loss {float(loss.detach()):.6f} -> {out}")


def main():
    exact_f64()
    want = sys.argv[1:]
    for name, cfg in checkpoints().items():
        if not want or name in want:
            make(name, cfg)


if __name__ == "__main__":
    main()
