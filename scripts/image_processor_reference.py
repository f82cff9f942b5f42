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
  verl/                         verl's image path: qwen-vl-utils 0.0.14's `fetch_image` (what
                                `verl.utils.dataset.vision_utils.process_image` calls) on a Pillow
                                image opened from the bytes, then the processor
    images/*                    more small images, one per Pillow mode that qwen-vl-utils' `to_rgb`
                                treats differently from transformers' `convert_to_rgb` (16-bit
                                RGBA, 16-bit gray, palette with partial alpha, RGB / gray colour
                                keys, GIF with a transparent index, lossless WebP with alpha), and
                                a 301 x 407 image of sharp stripes for a strong reduction
    qwen2_5_vl/, qwen3_vl/      preprocessor_config.json with the released models' pixel bounds
    reference.json              per case (image, image_patch_size, per-image min/max_pixels,
                                processor): Pillow's mode, fetch_image's size and SHA-256 (`[H, W,
                                3]` u8), the `info["transparency"]` Pillow leaves on it (which
                                transformers' convert_to_rgb applies), image_grid_thw and the SHA-256 of transformers'
                                pixel_values (`[patches, C*T*P*P]` f32, little-endian)
    fetched.safetensors         fetch_image's output of the patch-14 cases and of the JPEG
                                (`fetched_<case>`, `[H, W, 3]` u8)
    smart_resize.json           qwen-vl-utils' `smart_resize` on its edge cases (or the error)
    pil_resize_sweep.json       SHA-256 of Pillow's `Image.resize` (default BICUBIC) of the sweep
                                image (`[H, W, 3]`) for many size pairs, and of `to_rgb` on an RGBA
                                image holding every (value, alpha) pair

Run with the bench venv (torch 2.15, transformers 5.24, torchvision 0.29, pillow 13,
qwen-vl-utils 0.0.14 installed with `pip install --no-deps qwen-vl-utils==0.0.14`):
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


def png_raw(w, h, color_type, depth, rows, trns=None, plte=None):
    """A PNG written by hand (Pillow cannot write 16-bit RGBA): rows of raw big-endian samples."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\0" + r for r in rows)
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, 0))
    if plte is not None:
        out += chunk(b"PLTE", plte)
    if trns is not None:
        out += chunk(b"tRNS", trns)
    return out + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def write_verl_images(img_dir):
    """The images of the verl-path cases beyond the processor's ten; their own RNG, so that the
    processor fixtures do not change."""
    from PIL import Image

    rng = np.random.RandomState(20250607)
    img_dir.mkdir(parents=True, exist_ok=True)
    files = []

    def put(name, data):
        (img_dir / name).write_bytes(data)
        files.append(name)

    def smooth(h, w):
        y, x = np.mgrid[0:h, 0:w]
        return np.stack([(x * 255) // max(w - 1, 1), (y * 255) // max(h - 1, 1), (x * y) % 256], -1)

    # 16-bit RGBA (Pillow: "RGBA" from the high bytes), every alpha level
    h, w = 31, 41
    v = (smooth(h, w) * 257 + rng.randint(0, 257, (h, w, 3))).astype(">u2")
    a = rng.randint(0, 65536, (h, w, 1)).astype(">u2")
    a[:4] = 0
    a[-4:] = 65535
    put("rgba16_31x41.png", png_raw(w, h, 6, 16, [r.tobytes() for r in np.concatenate([v, a], -1)]))
    # 16-bit gray (Pillow: "I;16", clipped at 255 by convert("RGB")); half the values above 255
    h, w = 29, 37
    g = rng.randint(0, 512, (h, w)).astype(">u2")
    put("gray16_29x37.png", png_raw(w, h, 0, 16, [r.tobytes() for r in g]))
    # palette with partial alpha in tRNS (Pillow: "P", transparency as bytes, dropped)
    h, w = 33, 26
    plte = rng.randint(0, 256, (16, 3)).astype(np.uint8)
    idx = rng.randint(0, 16, (h, w)).astype(np.uint8)
    put("palette_alpha_33x26.png", png_raw(w, h, 3, 8, [r.tobytes() for r in idx],
                                           trns=bytes(rng.randint(0, 256, 12).astype(np.uint8)),
                                           plte=plte.tobytes()))
    # RGB with a colour key and gray with a gray key (Pillow: "RGB" / "L", keys ignored)
    rgb = (smooth(27, 35) // 32 * 32).astype(np.uint8)
    b = io.BytesIO()
    Image.fromarray(rgb).save(b, "PNG", transparency=tuple(int(c) for c in rgb[5, 7]))
    put("rgb_key_27x35.png", b.getvalue())
    gray = (rng.randint(0, 4, (30, 23)) * 60).astype(np.uint8)
    b = io.BytesIO()
    Image.fromarray(gray, "L").save(b, "PNG", transparency=60)
    put("gray_key_30x23.png", b.getvalue())
    # GIF with a transparent index that is used (Pillow: "P", its colour kept)
    pal = Image.fromarray(smooth(25, 39).astype(np.uint8)).quantize(colors=8, dither=Image.Dither.NONE)
    b = io.BytesIO()
    pal.save(b, "GIF", transparency=int(np.asarray(pal)[3, 3]))
    put("gif_trns_25x39.gif", b.getvalue())
    # lossless WebP with alpha (Pillow: "RGBA")
    rgba = np.dstack([smooth(34, 30), rng.randint(0, 256, (34, 30))]).astype(np.uint8)
    b = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(b, "WEBP", lossless=True)
    put("rgba_lossless_34x30.webp", b.getvalue())
    # sharp coloured stripes and rings (the bicubic overshoot gets clipped), 301 x 407
    y, x = np.mgrid[0:301, 0:407]
    st = np.stack([((x // 5) % 2) * 255, ((y // 7) % 2) * 255, (((x - 200) ** 2 + (y - 150) ** 2) // 900 % 2) * 255], -1)
    b = io.BytesIO()
    Image.fromarray(st.astype(np.uint8)).save(b, "PNG", optimize=True)
    put("stripes_301x407.png", b.getvalue())
    return files


# verl-path cases: (file, image_patch_size, per-image min_pixels, max_pixels, processor); the
# patch-14 cases go through the Qwen2.5-VL settings, patch 16 through Qwen3-VL's
VERL_PROCESSORS = {
    "qwen2_5_vl": {
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
    },
    "qwen3_vl": {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    },
}


def verl_cases(base_files, extra_files):
    cases = [(f"images/{f}", 14, None, None, "qwen2_5_vl") for f in base_files]
    cases += [(f"verl/images/{f}", 14, None, None, "qwen2_5_vl") for f in extra_files if not f.startswith("stripes")]
    cases += [
        # strong reductions by the entry's own max_pixels: 5.4x, and 90 x 120 -> 28 x 56, which the
        # processor enlarges again to its min_pixels
        ("verl/images/stripes_301x407.png", 14, None, 6272, "qwen2_5_vl"),
        ("images/rgba_90x120.png", 14, None, 3136, "qwen2_5_vl"),
        ("images/photo_100x150.jpg", 14, None, 4704, "qwen2_5_vl"),
        # the entry's own min_pixels: enlarged 3 x 2 -> 112 x 84
        ("images/tiny_3x2.png", 14, 9000, None, "qwen2_5_vl"),
        # Qwen3-VL: factor 32, then the processor enlarges to its 65536-pixel minimum
        ("images/rgb_45x70.png", 16, None, None, "qwen3_vl"),
        ("images/rgba_90x120.png", 16, None, None, "qwen3_vl"),
        ("images/la_40x52.png", 16, None, None, "qwen3_vl"),
        ("images/photo_100x150.jpg", 16, None, None, "qwen3_vl"),
        ("verl/images/stripes_301x407.png", 16, None, 8192, "qwen3_vl"),
    ]
    return cases


QVU_SMART_CASES = [
    # (height, width, factor, min_pixels, max_pixels)
    (45, 70, 28, 3136, 12845056), (42, 70, 28, 3136, 12845056), (14, 14, 28, 0, 12845056),
    (1, 1, 28, 3136, 12845056), (3, 2, 28, 3136, 12845056), (1, 200, 28, 3136, 12845056),
    (1, 201, 28, 3136, 12845056), (201, 1, 28, 3136, 12845056), (28, 5600, 28, 3136, 12845056),
    (1, 150, 28, 0, 100), (150, 1, 28, 0, 100), (10, 10, 28, 3136, 3135), (1080, 1920, 28, 3136, 12845056),
    (4000, 3000, 28, 3136, 12845056), (12000, 9000, 28, 3136, 12845056), (1080, 1920, 28, 3136, 1003520),
    (301, 407, 28, 3136, 6272), (90, 120, 28, 3136, 3136), (100, 150, 28, 3136, 4704),
    (3, 2, 28, 9000, 12845056), (1080, 1920, 32, 4096, 16777216), (100, 100, 32, 4096, 16777216),
    (20000, 15000, 32, 4096, 16777216), (37, 61, 28, 3136, 12845056), (20, 300, 28, 3136, 12845056),
    (2, 400, 28, 3136, 12845056), (28, 28, 28, 784, 784), (29, 29, 28, 784, 784), (100, 100, 28, 1, 1),
]


def qvu_smart_cases():
    from qwen_vl_utils.vision_process import smart_resize

    rows = []
    for h, w, f, lo, hi in QVU_SMART_CASES:
        try:
            rh, rw = smart_resize(h, w, factor=f, min_pixels=lo, max_pixels=hi)
            rows.append({"in": [h, w, f, lo, hi], "out": [rh, rw]})
        except (ValueError, AssertionError) as e:
            rows.append({"in": [h, w, f, lo, hi], "error": f"{type(e).__name__}: {e}"})
    return rows


PIL_SWEEP_EXTRA = [
    # vertical pass first (height shrinks by more than twice the width's reduction), one axis,
    # strong reductions, enlargements, the 1-pixel input
    (300, 40, 28, 28), (300, 40, 28, 56), (97, 203, 28, 200), (1000, 999, 28, 996), (40, 300, 28, 28),
    (64, 64, 64, 63), (64, 64, 63, 64), (1, 1, 3, 5), (5, 1, 1, 7), (2, 2, 1, 1), (407, 301, 84, 56),
    (301, 407, 56, 84), (11, 13, 308, 112), (1200, 17, 28, 28), (17, 1200, 28, 28),
]


def pil_sweep():
    from PIL import Image

    rows = []
    for ih, iw, oh, ow in SWEEP_SIZES + PIL_SWEEP_EXTRA:
        im = Image.fromarray(np.ascontiguousarray(sweep_image(ih, iw).transpose(1, 2, 0)))
        out = np.asarray(im.resize((ow, oh)))
        assert out.shape == (oh, ow, 3)
        rows.append([ih, iw, oh, ow, hashlib.sha256(out.tobytes()).hexdigest()])
    return rows


def paste_table():
    """qwen-vl-utils' to_rgb of a 256 x 256 RGBA image holding every (value, alpha) pair: R = x,
    G = 255 - x, B = (7x + y) mod 256, A = y."""
    from PIL import Image
    from qwen_vl_utils.vision_process import to_rgb

    y, x = np.mgrid[0:256, 0:256]
    rgba = np.stack([x, 255 - x, (7 * x + y) % 256, y], -1).astype(np.uint8)
    out = np.asarray(to_rgb(Image.fromarray(rgba, "RGBA")))
    return hashlib.sha256(out.tobytes()).hexdigest()


def run_verl(base_files):
    import torch
    from PIL import Image
    from safetensors.torch import save_file
    from transformers import AutoImageProcessor
    import qwen_vl_utils
    from qwen_vl_utils import fetch_image

    d = OUT / "verl"
    extra = write_verl_images(d / "images")
    procs = {}
    for name, cfg in VERL_PROCESSORS.items():
        (d / name).mkdir(parents=True, exist_ok=True)
        (d / name / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        procs[name] = AutoImageProcessor.from_pretrained(d / name)
        assert type(procs[name]).__name__ == "Qwen2VLImageProcessor" and procs[name].backend == "torchvision"
    rows, fetched = [], {}
    for i, (path, patch, lo, hi, name) in enumerate(verl_cases(base_files, extra)):
        pil = Image.open(io.BytesIO((OUT / path).read_bytes()))
        ele = {"image": pil}
        if lo is not None:
            ele["min_pixels"] = lo
        if hi is not None:
            ele["max_pixels"] = hi
        img = fetch_image(ele, image_patch_size=patch)
        assert img.mode == "RGB"
        arr = np.asarray(img)
        if patch == 14 or path.endswith(".jpg"):
            fetched[f"fetched_{i}"] = torch.from_numpy(arr.copy())
        out = procs[name](images=[img], return_tensors="pt")
        pv = out["pixel_values"]
        assert pv.dtype == torch.float32
        rows.append({
            "file": path, "image_patch_size": patch, "min_pixels": lo, "max_pixels": hi,
            "processor": name, "pillow_mode": pil.mode, "fetched": list(arr.shape[:2]),
            # what transformers' convert_to_rgb then makes transparent (a tuple or a bare number)
            "fetched_transparency": img.info.get("transparency"),
            "fetched_sha256": hashlib.sha256(arr.tobytes()).hexdigest(),
            "image_grid_thw": out["image_grid_thw"][0].tolist(),
            "pixel_values_sha256": hashlib.sha256(pv.contiguous().numpy().tobytes()).hexdigest(),
        })
    save_file(fetched, d / "fetched.safetensors")
    ref = {
        "source": "qwen-vl-utils %s fetch_image, Pillow %s, then transformers %s (torchvision backend, CPU)"
        % (qwen_vl_utils.__version__ if hasattr(qwen_vl_utils, "__version__") else "0.0.14",
           Image.__version__, __import__("transformers").__version__),
        "cases": rows,
    }
    (d / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    (d / "smart_resize.json").write_text(json.dumps(qvu_smart_cases(), indent=1) + "\n")
    sweep = {
        "source": f"PIL.Image.resize (BICUBIC), Pillow {Image.__version__}",
        "cases": pil_sweep(),
        "to_rgb_rgba_table_sha256": paste_table(),
    }
    (d / "pil_resize_sweep.json").write_text(json.dumps(sweep, indent=1) + "\n")


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
    run_verl(files)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()
