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
from family_reference import exact_f64, per_expert  # noqa: E402

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


def qwen3_vl():
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        # 8 rotary frequencies, interleaved: height at 1, 4 (and 7 outside its 2·3), width at
        # 2, 5; temporal elsewhere.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True},
        attention_bias=False,
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
        out_hidden_size=64,
        hidden_act="gelu_pytorch_tanh",
        # A 5x5 learned position grid, resampled (bilinear, corners aligned) to each image's.
        num_position_embeddings=25,
        # Features of blocks 0 and 1 added to the language model's first two layers' outputs.
        deepstack_visual_indexes=[0, 1],
    )
    return transformers.Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        tie_word_embeddings=False,
    )


def qwen3_5_vl():
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        # Gated DeltaNet layers between gated attention layers; rotary over half of each head
        # (8 values: 4 frequencies, interleaved sections 2/1/1).
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=40,
        num_heads=2,
        in_channels=3,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=64,
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=16,
    )
    return transformers.Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        tie_word_embeddings=False,
    )


def qwen3_vl_moe():
    cfg = qwen3_vl()
    text = cfg.text_config.to_dict()
    for k in ("model_type", "transformers_version", "architectures"):
        text.pop(k, None)
    # Experts on layers 0 and 2 (layer 1 dense, mlp_only_layers), 8 of them, top-2.
    text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                decoder_sparse_step=1)
    vision = cfg.vision_config.to_dict()
    vision.pop("model_type", None)
    out = transformers.Qwen3VLMoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        tie_word_embeddings=False,
    )
    out.text_config._experts_implementation = "eager"
    return out


def qwen3_5_moe_vl():
    cfg = qwen3_5_vl()
    text = cfg.text_config.to_dict()
    for k in ("model_type", "transformers_version", "architectures"):
        text.pop(k, None)
    text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=24)
    text.pop("intermediate_size", None)
    vision = cfg.vision_config.to_dict()
    vision.pop("model_type", None)
    out = transformers.Qwen3_5MoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        tie_word_embeddings=False,
    )
    out.text_config._experts_implementation = "eager"
    return out


MODEL_CLASS = {
    "Qwen2_5_VLConfig": "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLConfig": "Qwen3VLForConditionalGeneration",
    "Qwen3_5Config": "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeConfig": "Qwen3_5MoeForConditionalGeneration",
    "Qwen3VLMoeConfig": "Qwen3VLMoeForConditionalGeneration",
}


def checkpoints():
    return {
        # Window attention on blocks 0 and 2 (windows of 2x2 merged patches, partial ones at
        # the edges), full attention on block 1.
        "qwen2_5_vl": qwen2_5_vl(),
        # LayerNorm blocks with GELU MLPs, learned position embeddings, DeepStack features,
        # Qwen3's q/k norms and interleaved M-RoPE.
        "qwen3_vl": qwen3_vl(),
        # The same over Qwen3-VL-MoE's language model: experts (always renormalised) on layers
        # 0 and 2, the fused expert tensors of its checkpoints.
        "qwen3_vl_moe": qwen3_vl_moe(),
        # Qwen3.5 with its vision tower (Qwen3-VL's without DeepStack): Gated DeltaNet layers,
        # gated attention with partial rotary embeddings under interleaved M-RoPE.
        "qwen3_5_vl": qwen3_5_vl(),
        # The same with Qwen3.5-MoE's experts (8, top-2) and shared expert on every layer.
        "qwen3_5_moe_vl": qwen3_5_moe_vl(),
    }


# Image grids (t, h, w) in patches: merged tokens 4*6, 2*2, 3*5; windows of 2x2 merged patches
# cut the first into 2x3, the third into 2x3 with partial windows.
GRIDS = [(1, 8, 12), (1, 4, 4), (1, 6, 10)]


def spread(model, seed):
    """Weights N(0, 0.3²) and norms 1 + N(0, 0.3²), so every path carries signal (as
    scripts/family_reference.py spreads its checkpoints, Qwen3.5's `1 + w` norms included)."""
    norms = ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "layernorm.weight",
             "q_norm.weight", "k_norm.weight")
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
    model = getattr(transformers, MODEL_CLASS[type(cfg).__name__])(cfg).to(torch.float64).eval()
    # A seed whose greedy continuations never pick an image token (which would be a
    # placeholder without an image in the next forward).
    spread(model, {"qwen3_5_moe_vl": 101}.get(name, 99))
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
            # DeepStack: one feature per chosen block, split per image like the merged output.
            for k, d in enumerate(getattr(o, "deepstack_features", None) or []):
                d = d[0] if isinstance(d, (tuple, list)) else d
                feats[f"image_{i}_deepstack_{k}"] = d.contiguous()
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
    # Experts under the checkpoint's per-expert names (transformers 5 holds them fused).
    grads = per_expert(grads)
    save_file(grads, str(out / "grads.safetensors"))
    ref = {
        "family": name,
        "architectures": cfg.architectures or [MODEL_CLASS[type(cfg).__name__]],
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


# `<name>/chat/`: the same architecture over the byte-level test tokenizer
# (tests/fixtures/byte_tokenizer) with the vision tokens added (259 <|vision_start|>,
# 260 <|vision_end|>, 261 <|image_pad|>, 262 <|video_pad|>), a ChatML template that writes
# `<|vision_start|><|image_pad|><|vision_end|>` for each image item (as Qwen2.5-VL's does), a
# preprocessor_config.json sized for the tiny tower (patch 4: factor 8, 64..4096 pixels), PNG
# images, and what transformers' Qwen2_5_VLProcessor gives for chat prompts with those images
# after qwen-vl-utils' fetch_image (verl's path, image_patch_size 4): input ids, pixel values,
# grids, and greedy continuations by full forwards.
TOKENIZER = OUT.parent / "byte_tokenizer"
VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_IMAGES = [(32, 48), (45, 30), (24, 40)]  # (height, width); 45x30 is resized by fetch_image


def chat_images(out):
    from PIL import Image
    g = torch.Generator().manual_seed(41)
    paths = []
    for i, (h, w) in enumerate(CHAT_IMAGES):
        ys = torch.linspace(0, 1, h).unsqueeze(1)
        xs = torch.linspace(0, 1, w).unsqueeze(0)
        base = torch.stack([ys * xs, (1 - ys).expand(h, w), xs.expand(h, w)], dim=-1) * 200
        noise = torch.randint(0, 55, (h, w, 3), generator=g)
        px = (base + noise).clamp(0, 255).to(torch.uint8).numpy()
        p = out / f"image_{i}.png"
        Image.fromarray(px, "RGB").save(p)
        paths.append(p)
    return paths


def chat(name, cfg):
    import shutil
    from PIL import Image
    from qwen_vl_utils import fetch_image
    from tokenizers import AddedToken, Tokenizer

    out = OUT / name / "chat"
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    tc = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1) + "\n")
    shutil.copy(TOKENIZER / "generation_config.json", out / "generation_config.json")
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "temporal_patch_size": 2,
           "merge_size": 2, "min_pixels": 64, "max_pixels": 4096,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=1) + "\n")
    d = cfg.to_dict()
    d["text_config"]["vocab_size"] = 263
    d.update(image_token_id=261, video_token_id=262, vision_start_token_id=259, vision_end_token_id=260)
    ccfg = transformers.Qwen2_5_VLConfig.from_dict(d)
    torch.manual_seed(4321)
    model = transformers.Qwen2_5_VLForConditionalGeneration(ccfg).to(torch.float64).eval()
    spread(model, 77)
    model.save_pretrained(out, safe_serialization=True)
    paths = chat_images(out)
    processor = transformers.Qwen2_5_VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(**{k: v for k, v in pre.items() if k != "image_processor_type"}),
        tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json")),
        video_processor=transformers.Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    prompts = [
        ([{"role": "user", "content": "<image>What shape is this?"}], [0]),
        ([{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Compare <image> and <image>."}], [1, 2]),
        ([{"role": "user", "content": "No image here."}], []),
    ]
    answers = []
    with torch.no_grad():
        for messages, which in prompts:
            # verl's _build_messages: string contents split at <image> into content items.
            built = []
            for m in messages:
                if which:
                    parts = []
                    for k, piece in enumerate(m["content"].split("<image>")):
                        if k:
                            parts.append({"type": "image"})
                        if piece:
                            parts.append({"type": "text", "text": piece})
                    built.append({"role": m["role"], "content": parts})
                else:
                    built.append(m)
            with plain_torch():
                text = processor.apply_chat_template(built, add_generation_prompt=True, tokenize=False)
                images = [fetch_image({"image": Image.open(paths[i])}, image_patch_size=4) for i in which]
                enc = processor(text=[text], images=images or None, return_tensors="pt")
            assert not which or enc["pixel_values"].dtype == torch.float32
            ids = enc["input_ids"][0].tolist()
            kw = {"input_ids": enc["input_ids"]}
            if which:
                kw.update(pixel_values=enc["pixel_values"].to(torch.float64), image_grid_thw=enc["image_grid_thw"],
                          mm_token_type_ids=(enc["input_ids"] == 261).to(torch.int32))
            seq, steps = list(ids), []
            for _ in range(6):
                kw["input_ids"] = torch.tensor([seq])
                if which:
                    kw["mm_token_type_ids"] = (kw["input_ids"] == 261).to(torch.int32)
                lp = torch.log_softmax(model(**kw).logits[0, -1], -1)
                t = int(torch.argmax(lp))
                top2 = torch.topk(lp, 2).values
                steps.append({"token": t, "logprob": float(lp[t]), "gap": float(top2[0] - top2[1])})
                seq.append(t)
            answers.append({
                "messages": messages,
                "images": [paths[i].name for i in which],
                "input_ids": ids,
                "image_grid_thw": enc["image_grid_thw"].tolist() if which else [],
                "greedy": steps,
            })
            if which:
                save_file({"pixel_values": enc["pixel_values"].contiguous()}, str(out / f"pixel_values_{len(answers) - 1}.safetensors"))
    ref = {"family": name, "transformers": transformers.__version__, "torch": torch.__version__, "answers": answers}
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    geo3k_layout(out, prompts, paths)
    print(f"{name}/chat: {[len(a['input_ids']) for a in answers]} prompt tokens -> {out}")


def geo3k_layout(out, prompts, paths):
    """The chat prompts as rows of verl's geo3k parquet (examples/data_preprocess/geo3k.py):
    `images` a list of {bytes, path} structs (as HF datasets writes image columns), the
    prompt's `<image>` markers in the text, the reward and extra_info columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i, (messages, which) in enumerate(prompts):
        rows.append({
            "data_source": "hiyouga/geometry3k",
            "prompt": messages,
            "images": [{"bytes": paths[k].read_bytes(), "path": None} for k in which],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"split": "train", "index": i},
        })
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(message)),
        ("images", pa.list_(image)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
    ])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out / "geo3k_layout.parquet")


# torch as it is, before exact_f64() patches it: the processor must run in its own float32.
ORIGINAL = {}


class plain_torch:
    """Within: torch's own casts (exact_f64 undone), as the processor runs in verl."""

    def __enter__(self):
        self.patched = {k: getattr(o, n) for k, (o, n, _) in ORIGINAL.items()}
        for o, n, f in ORIGINAL.values():
            setattr(o, n, f)

    def __exit__(self, *exc):
        for k, (o, n, _) in ORIGINAL.items():
            setattr(o, n, self.patched[k])


def main():
    for o, n in [(torch.Tensor, "to"), (torch.Tensor, "type"), (torch.Tensor, "float"), (torch, "arange"),
                 (torch.nn.functional, "softmax")]:
        ORIGINAL[f"{o.__name__}.{n}"] = (o, n, getattr(o, n))
    exact_f64()
    want = sys.argv[1:]
    for name, cfg in checkpoints().items():
        if not want or name in want:
            make(name, cfg)
        if name == "qwen2_5_vl" and (not want or name in want or f"{name}/chat" in want):
            chat(name, cfg)


if __name__ == "__main__":
    main()
