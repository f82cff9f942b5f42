#!/usr/bin/env python3
"""Reference outputs of transformers' Qwen2-VL image processor for src/data/image.rs.

The processor is the one `AutoImageProcessor.from_pretrained` gives for a Qwen2-VL, Qwen2.5-VL or
Qwen3-VL folder in transformers 5.24: `Qwen2VLImageProcessor`, the torchvision backend (uint8
CHW tensors on the CPU, bicubic antialiased resize, fused rescale + normalize, patchify).

Writes tests/fixtures/image_processor/:
  images/*.{png,jpg,gif,webp}   small images made here from a fixed seed (gradients + noise): RGB,
                                RGBA, LA, grayscale, palette with transparency, GIF, JPEG, WebP
  <config>/preprocessor_config.json
                                two processor settings with small min/max pixels (patch 14 as
                                Qwen2.5-VL, patch 16 with mean = std = 0.5 as Qwen3-VL), so that
                                images are both enlarged and reduced and the fixtures stay small
  <config>/reference.safetensors
                                `pixel_values_t0` `[patches, C*P*P]` f32: transformers'
                                pixel_values `[patches, C*T*P*P]` of all images in one call, with
                                the temporal axis folded (the script checks that the T copies are
                                equal bit for bit; this halves the fixture), image_grid_thw
                                `[images, 3]` i64, and per image the RGB image after the resize
                                (`resized_<i>`, `[3, h, w]` u8)
  decoded.safetensors           per image the RGB image after decoding and transformers'
                                convert_to_rgb (`decoded_<i>`, `[3, H, W]` u8)
  <config>/reference.json       image files in order, grids, placeholder counts, and the prompt
                                before and after placeholder expansion (Qwen2VLProcessor's own
                                validate / replace / expand steps, on a tiny word-level tokenizer)
  smart_resize.json             (height, width, factor, min, max) -> (h, w) or the error, from
                                transformers' `smart_resize`
  resize_sweep.json             SHA-256 of torchvision's uint8 bicubic antialiased resize of a
                                synthetic image for many size pairs, checked equal under
                                ATEN_CPU_CAPABILITY=default, avx2 and avx512 (torch's generic
                                separable kernel and its AVX2 kernel)

Run with the bench venv (torch 2.15, transformers 5.24, torchvision 0.29, pillow):
  ~/.cache/main_ppo/bench-venv/bin/python scripts/image_processor_reference.py
CI does not run it; the Rust tests in src/data/image_tests.rs read the fixtures.
"""
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "image_processor"

# The synthetic image of the resize sweep, `[3, H, W]` u8; src/data/image_tests.rs computes the
# same values.
def sweep_image(h, w):
    y = np.arange(h, dtype=np.int64)[:, None]
    x = np.arange(w, dtype=np.int64)[None, :]
    chans = []
    for c in range(3):
        v = (x * (37 + 16 * c) + y * (91 - 20 * c) + ((x * y * (c + 3)) ^ (x + 7 * y))) & 255
        chans.append(v.astype(np.uint8))
    return np.stack(chans)


SWEEP_SIZES = [
    # (in_h, in_w, out_h, out_w): reductions by large and odd factors, enlargements, one-axis
    (1, 1, 28, 56), (2, 3, 56, 28), (7, 5, 28, 28), (28, 28, 56, 84), (45, 70, 56, 56),
    (100, 100, 28, 28), (100, 37, 56, 28), (333, 17, 84, 28), (17, 333, 28, 84), (64, 64, 64, 32),
    (64, 64, 32, 64), (301, 299, 56, 56), (1000, 30, 140, 28), (30, 1000, 28, 140),
    (257, 129, 252, 112), (97, 203, 112, 224), (640, 480, 56, 28), (480, 640, 28, 56),
    (31, 31, 308, 308), (3, 600, 28, 2800), (600, 3, 2800, 28), (128, 96, 112, 84),
    (255, 255, 32, 32), (512, 384, 448, 320), (90, 160, 64, 96), (1, 200, 32, 6400),
]


def sweep_hashes():
    import torch
    from torchvision.transforms.v2 import functional as tvF

    torch.set_num_threads(1)
    rows = []
    for ih, iw, oh, ow in SWEEP_SIZES:
        img = torch.from_numpy(sweep_image(ih, iw))
        out = tvF.resize(img, [oh, ow], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        assert out.dtype == torch.uint8 and tuple(out.shape) == (3, oh, ow)
        rows.append([ih, iw, oh, ow, hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest()])
    return rows


def write_images(img_dir):
    from PIL import Image

    rng = np.random.RandomState(20240531)
    img_dir.mkdir(parents=True, exist_ok=True)

    def rgb(h, w, noise=40):
        y = np.linspace(0, 1, h)[:, None]
        x = np.linspace(0, 1, w)[None, :]
        base = np.stack([255 * x * np.ones_like(y), 255 * y * np.ones_like(x), 128 + 100 * np.sin(9 * x + 5 * y)], -1)
        return np.clip(base + rng.normal(0, noise, (h, w, 3)), 0, 255).astype(np.uint8)

    files = []

    def save(name, im, **kw):
        im.save(img_dir / name, **kw)
        files.append(name)

    # 45 x 70: 70 / 28 = 2.5 rounds (half to even) to 2, enlarged to 56 x 56
    save("rgb_45x70.png", Image.fromarray(rgb(45, 70)))
    # RGBA with every kind of alpha, reduced
    a = np.clip(rng.randint(0, 256, (90, 120)) * (np.arange(120)[None, :] % 4 != 0), 0, 255).astype(np.uint8)
    a[:10] = 0
    a[-10:] = 255
    save("rgba_90x120.png", Image.fromarray(np.dstack([rgb(90, 120), a]), "RGBA"))
    # grayscale, tall
    save("gray_100x33.png", Image.fromarray(rgb(100, 33)[..., 1], "L"))
    # grayscale + alpha
    la = np.dstack([rgb(40, 52)[..., 0], rng.randint(0, 256, (40, 52)).astype(np.uint8)])
    save("la_40x52.png", Image.fromarray(la, "LA"))
    # palette with a transparent entry (tRNS)
    pal = Image.fromarray(rgb(48, 64)).quantize(colors=16, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    save("palette_48x64.png", pal, transparency=3)
    # palette without transparency, as GIF
    save("gif_37x61.gif", Image.fromarray(rgb(37, 61, noise=10)).quantize(colors=64, dither=Image.Dither.NONE))
    # JPEG (4:2:0 chroma, libjpeg-turbo's default quality 75 settings + quality 90)
    save("photo_100x150.jpg", Image.fromarray(rgb(100, 150, noise=25)), quality=90)
    # lossy WebP
    save("photo_60x80.webp", Image.fromarray(rgb(60, 80, noise=25)), quality=80)
    # very wide (aspect 15), and tiny (3 x 2): both enlarged
    save("wide_20x300.png", Image.fromarray(rgb(20, 300)))
    save("tiny_3x2.png", Image.fromarray(rgb(3, 2)))
    return files


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|image_pad|>": 1, "<|video_pad|>": 2, "<|vision_start|>": 3, "<|vision_end|>": 4}
    for w in "describe the picture and compare it with this one .".split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        additional_special_tokens=["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"],
    )


def run_config(name, cfg, files):
    import torch
    from PIL import Image
    from safetensors.torch import save_file
    from transformers import AutoImageProcessor, Qwen2VLProcessor

    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    proc = AutoImageProcessor.from_pretrained(d)
    assert type(proc).__name__ == "Qwen2VLImageProcessor", type(proc)
    assert proc.backend == "torchvision"

    images = [Image.open(io.BytesIO((OUT / "images" / f).read_bytes())) for f in files]
    out = proc(images=images, return_tensors="pt")
    pv = out["pixel_values"]
    assert pv.dtype == torch.float32
    p, t = proc.patch_size, proc.temporal_patch_size
    folded = pv.view(pv.shape[0], 3, t, p * p)
    for k in range(1, t):
        assert torch.equal(folded[:, :, k].view(torch.int32), folded[:, :, 0].view(torch.int32))
    tensors = {
        "pixel_values_t0": folded[:, :, 0].reshape(pv.shape[0], 3 * p * p).contiguous(),
        "image_grid_thw": out["image_grid_thw"].contiguous(),
    }
    decoded = {}
    factor = proc.patch_size * proc.merge_size
    for i, im in enumerate(images):
        dec = proc.process_image(im, do_convert_rgb=True)
        res = proc.resize(images=dec[None], size=proc.size, resample=proc.resample, factor=factor)[0]
        decoded[f"decoded_{i}"] = dec.contiguous()
        tensors[f"resized_{i}"] = res.contiguous()
    save_file(tensors, d / "reference.safetensors")
    save_file(decoded, OUT / "decoded.safetensors")

    # The processor's own text side: count check, per-image replacement, in-order expansion.
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    processor = Qwen2VLProcessor(
        image_processor=proc, tokenizer=tiny_tokenizer(), video_processor=Qwen2VLVideoProcessor()
    )
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    prompt = f"describe the picture {pad} and compare it with this one {pad} ."
    n = 2
    sub = images[:n]
    processor.validate_inputs(images=sub, text=[prompt])
    processed, replacements = processor._process_images(sub, **{})
    expanded, _ = processor.get_text_with_replacements([prompt], replacements)
    ids = processor(images=sub, text=[prompt])["input_ids"][0]
    counts = [len(r) // len("<|image_pad|>") for r in replacements]
    assert sum(1 for t in ids if t == processor.image_token_id) == sum(counts)
    for bad in (1, 3):
        try:
            processor.validate_inputs(images=images[:bad], text=[prompt])
            raise AssertionError("transformers accepted a mismatched image count")
        except ValueError:
            pass
    ref = {
        "source": "transformers %s, torch %s, torchvision %s (torchvision backend, CPU)"
        % (__import__("transformers").__version__, torch.__version__, __import__("torchvision").__version__),
        "files": files,
        "image_grid_thw": out["image_grid_thw"].tolist(),
        "num_image_tokens": [int(g.prod()) // proc.merge_size**2 for g in out["image_grid_thw"]],
        "prompt": prompt,
        "prompt_images": n,
        "expanded_prompt": expanded[0],
        "expanded_counts": counts,
    }
    (d / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")


SMART_CASES = [
    # (height, width, factor, min_pixels, max_pixels)
    (45, 70, 28, 1568, 3136), (70, 70, 28, 1568, 3136), (42, 126, 28, 1568, 3136),
    (98, 14, 28, 56 * 56, 28 * 28 * 1280), (1, 1, 28, 56 * 56, 28 * 28 * 1280),
    (3, 2, 28, 1568, 3136), (1, 200, 28, 56 * 56, 28 * 28 * 1280), (1, 201, 28, 56 * 56, 28 * 28 * 1280),
    (201, 1, 28, 56 * 56, 28 * 28 * 1280), (20, 4000, 28, 56 * 56, 28 * 28 * 1280),
    (1080, 1920, 28, 3136, 12845056), (4000, 3000, 28, 3136, 12845056), (12000, 9000, 28, 3136, 12845056),
    (1080, 1920, 28, 3136, 28 * 28 * 1280), (4000, 3000, 28, 3136, 28 * 28 * 1280),
    (1080, 1920, 32, 65536, 16777216), (640, 480, 32, 65536, 16777216), (100, 100, 32, 65536, 16777216),
    (20000, 15000, 32, 65536, 16777216), (333, 777, 28, 1568, 3136), (777, 333, 16, 256, 1024),
    (90, 120, 28, 1568, 3136), (14, 2800, 28, 56 * 56, 28 * 28 * 1280), (50, 10, 28, 1568, 784),
    (16384, 16384, 28, 3136, 12845056), (65, 99, 14, 196, 196 * 4),
]


def smart_cases():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    rows = []
    for h, w, f, lo, hi in SMART_CASES:
        try:
            rh, rw = smart_resize(h, w, factor=f, min_pixels=lo, max_pixels=hi)
            rows.append({"in": [h, w, f, lo, hi], "out": [rh, rw]})
        except ValueError as e:
            rows.append({"in": [h, w, f, lo, hi], "error": str(e)})
    return rows


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--sweep":
        print(json.dumps(sweep_hashes()))
        return
    import torch

    OUT.mkdir(parents=True, exist_ok=True)
    files = write_images(OUT / "images")
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    run_config("qwen2_5_vl", {
        "min_pixels": 1568, "max_pixels": 3136, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": mean, "image_std": std,
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
    }, files)
    run_config("qwen3_vl", {
        "size": {"longest_edge": 2048, "shortest_edge": 1024}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }, files)
    (OUT / "smart_resize.json").write_text(json.dumps(smart_cases(), indent=1) + "\n")

    # The uint8 resize under each CPU kernel torch can pick on this machine.
    per_cap = {}
    for cap in ("default", "avx2", "avx512"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
        got = subprocess.run([sys.executable, __file__, "--sweep"], env=env, check=True,
                             capture_output=True, text=True).stdout
        per_cap[cap] = json.loads(got)
    assert per_cap["default"] == per_cap["avx2"] == per_cap["avx512"], "resize differs across CPU kernels"
    sweep = {
        "source": f"torchvision.transforms.v2.functional.resize, torch {torch.__version__}, "
                  f"native capability {torch.backends.cpu.get_cpu_capability()}; equal under "
                  "ATEN_CPU_CAPABILITY=default, avx2, avx512",
        "cases": per_cap["default"],
    }
    (OUT / "resize_sweep.json").write_text(json.dumps(sweep, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()
