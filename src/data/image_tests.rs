//! Parity with transformers 5.24's `Qwen2VLImageProcessor` (torchvision 0.29 backend, torch
//! 2.15 on the CPU). The expected numbers are in `tests/fixtures/image_processor/`, written by
//! `scripts/image_processor_reference.py` (its docstring lists the files): transformers'
//! `pixel_values`, `image_grid_thw` and expanded prompts for ten small images under two
//! processor settings (Qwen2.5-VL-like and Qwen3-VL-like), the decoded and resized uint8 images
//! on the way, `smart_resize` outputs, and SHA-256 digests of torchvision's uint8 resize for
//! many size pairs. The 16-bit PNG values come from Pillow 13 (noted at that test).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::*;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/image_processor")
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn u8s(t: &Tensor) -> Vec<u8> {
    t.flatten_all().unwrap().to_vec1::<u8>().unwrap()
}

fn image_bytes(reference: &Value) -> Vec<Vec<u8>> {
    reference["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| std::fs::read(fixtures().join("images").join(f.as_str().unwrap())).unwrap())
        .collect()
}

/// JPEG is the one format whose decoding differs from Pillow's: the image crate decodes it with
/// zune-jpeg, whose integer IDCT, chroma upsampling and YCbCr → RGB rounding are not
/// libjpeg-turbo's (Pillow's decoder). Measured on the 4:2:0 fixture with zune-jpeg 0.5.15 (its
/// AVX2 kernels): 12282 of 45000 samples differ, by up to 7; a grayscale JPEG differs by 1 in
/// ~1% of samples, so the IDCT alone already differs. These bounds are what holds.
const JPEG_FILE: &str = "photo_100x150.jpg";
const JPEG_MAX_DECODE_DIFF: u8 = 7;
const JPEG_MAX_DIFFERING_SAMPLES: usize = 12282;

/// Decoding and `convert_to_rgb` give Pillow's + transformers' RGB image exactly for PNG (RGB,
/// RGBA, LA, gray, palette + tRNS), GIF and lossy WebP; JPEG within the bounds above.
#[test]
fn decoding_matches_pillow_and_convert_to_rgb() {
    let reference = json(&fixtures().join("qwen2_5_vl/reference.json"));
    let want = tensors(&fixtures().join("decoded.safetensors"));
    for (i, bytes) in image_bytes(&reference).iter().enumerate() {
        let file = reference["files"][i].as_str().unwrap();
        let got = decode_image(bytes, true).unwrap();
        let w = &want[&format!("decoded_{i}")];
        let (_, h, wd) = w.dims3().unwrap();
        assert_eq!((got.height, got.width), (h, wd), "{file}");
        let (g, e) = (got.to_chw(), u8s(w));
        let max = g.iter().zip(&e).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
        let differing = g.iter().zip(&e).filter(|(a, b)| a != b).count();
        if file == JPEG_FILE {
            assert!(max <= JPEG_MAX_DECODE_DIFF, "{file}: up to {max}");
            assert!(
                differing <= JPEG_MAX_DIFFERING_SAMPLES,
                "{file}: {differing} samples"
            );
        } else {
            assert_eq!(
                max, 0,
                "{file}: decoded RGB differs from Pillow by up to {max}"
            );
        }
    }
}

/// Pillow's decoded image of fixture `i` (`decoded.safetensors`, `[3, H, W]`) as an [`RgbImage`].
fn pillow_image(decoded: &HashMap<String, Tensor>, i: usize) -> RgbImage {
    let t = &decoded[&format!("decoded_{i}")];
    let (_, height, width) = t.dims3().unwrap();
    let chw = u8s(t);
    let plane = height * width;
    let pixels = (0..plane)
        .flat_map(|k| [chw[k], chw[plane + k], chw[2 * plane + k]])
        .collect();
    RgbImage {
        height,
        width,
        pixels,
    }
}

/// Per image: the largest |Δ| between `batch.pixel_values` and transformers' (whose first
/// temporal copy the fixture stores; the script checked that transformers' copies are equal),
/// and whether every float is equal bit for bit.
fn pixel_value_diffs(
    batch: &ImageBatch,
    t0: &[f32],
    cfg: &ImageProcessorConfig,
) -> Vec<(f32, bool)> {
    let (t, p2) = (cfg.temporal_patch_size, cfg.patch_size * cfg.patch_size);
    let half = 3 * p2;
    let mut row = 0;
    let mut out = Vec::new();
    for g in &batch.grid_thw {
        let (mut max, mut exact) = (0f32, true);
        for r in row..row + g[0] * g[1] * g[2] {
            for c in 0..3 {
                for k in 0..t {
                    for q in 0..p2 {
                        let got = batch.pixel_values[r * batch.patch_dim + (c * t + k) * p2 + q];
                        let exp = t0[r * half + c * p2 + q];
                        max = max.max((got - exp).abs());
                        exact &= got.to_bits() == exp.to_bits();
                    }
                }
            }
        }
        row += g[0] * g[1] * g[2];
        out.push((max, exact));
    }
    out
}

/// The whole processor, per settings file: grids, the resized uint8 images, every
/// `pixel_values` float bit for bit (the JPEG within `jpeg_bound`, from its decoding alone),
/// placeholder counts and the expanded prompt.
fn check_processor(name: &str, jpeg_bound: f32) {
    let dir = fixtures().join(name);
    let reference = json(&dir.join("reference.json"));
    let want = tensors(&dir.join("reference.safetensors"));
    let cfg = ImageProcessorConfig::from_model_dir(&dir).unwrap();
    let bytes = image_bytes(&reference);
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let batch = cfg.preprocess_encoded(&refs).unwrap();

    let grids = want["image_grid_thw"].to_dtype(DType::I64).unwrap();
    let grids: Vec<Vec<i64>> = grids.to_vec2().unwrap();
    let got: Vec<Vec<i64>> = batch
        .grid_thw
        .iter()
        .map(|g| g.iter().map(|&v| v as i64).collect())
        .collect();
    assert_eq!(got, grids, "{name}: image_grid_thw");

    let decoded = tensors(&fixtures().join("decoded.safetensors"));
    for i in 0..bytes.len() {
        let (resized, _, _) = cfg.resize(&pillow_image(&decoded, i)).unwrap();
        let w = u8s(&want[&format!("resized_{i}")]);
        assert_eq!(resized.len(), w.len(), "{name} image {i}");
        let max = resized
            .iter()
            .zip(&w)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        assert_eq!(
            max, 0,
            "{name} image {i}: resized differs from torchvision by up to {max}"
        );
    }

    let t0 = &want["pixel_values_t0"];
    let (rows, half) = t0.dims2().unwrap();
    let t0: Vec<f32> = t0.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(batch.num_patches(), rows, "{name}: number of patches");
    assert_eq!(
        batch.patch_dim,
        half * cfg.temporal_patch_size,
        "{name}: patch_dim"
    );
    // from the encoded files: bit for bit, except the JPEG (its decoding differs, see above)
    for (i, (max, exact)) in pixel_value_diffs(&batch, &t0, &cfg).into_iter().enumerate() {
        let file = reference["files"][i].as_str().unwrap();
        if file == JPEG_FILE {
            assert!(
                max <= jpeg_bound,
                "{name} {file}: pixel_values differ by up to {max}"
            );
        } else {
            assert!(exact, "{name} {file}: pixel_values differ by up to {max}");
        }
    }
    // from Pillow's decoded images: every image bit for bit, the JPEG included
    let pil: Vec<RgbImage> = (0..bytes.len())
        .map(|i| pillow_image(&decoded, i))
        .collect();
    let from_pil = cfg.preprocess(&pil).unwrap();
    assert_eq!(from_pil.grid_thw, batch.grid_thw);
    for (i, (max, exact)) in pixel_value_diffs(&from_pil, &t0, &cfg)
        .into_iter()
        .enumerate()
    {
        assert!(
            exact,
            "{name} image {i} from Pillow's pixels: differs by up to {max}"
        );
    }

    let tokens: Vec<usize> = batch
        .grid_thw
        .iter()
        .map(|g| cfg.num_image_tokens(*g))
        .collect();
    let want_tokens: Vec<usize> =
        serde_json::from_value(reference["num_image_tokens"].clone()).unwrap();
    assert_eq!(tokens, want_tokens, "{name}: placeholder tokens per image");

    let n = reference["prompt_images"].as_u64().unwrap() as usize;
    let expanded = expand_image_placeholders(
        reference["prompt"].as_str().unwrap(),
        IMAGE_PAD_TOKEN,
        &tokens[..n],
    )
    .unwrap();
    assert_eq!(
        expanded,
        reference["expanded_prompt"].as_str().unwrap(),
        "{name}"
    );
}

/// The JPEG bounds are the measured largest |Δ| of its pixel_values: its resized uint8 image
/// differs by up to 3 (here) and 2 (Qwen3-VL settings) levels, over 255·std per channel.
#[test]
fn qwen2_5_vl_settings_match_transformers() {
    check_processor("qwen2_5_vl", 0.042_661);
}

#[test]
fn qwen3_vl_settings_match_transformers() {
    check_processor("qwen3_vl", 0.015_687);
}

#[test]
fn smart_resize_matches_transformers() {
    let cases = json(&fixtures().join("smart_resize.json"));
    for case in cases.as_array().unwrap() {
        let i: Vec<u64> = serde_json::from_value(case["in"].clone()).unwrap();
        let got = smart_resize(i[0] as usize, i[1] as usize, i[2] as usize, i[3], i[4]);
        match case.get("out") {
            Some(out) => {
                let out: Vec<usize> = serde_json::from_value(out.clone()).unwrap();
                assert_eq!(got, Ok((out[0], out[1])), "{i:?}");
            }
            None => {
                let e = got.expect_err(&format!("{i:?} should be refused"));
                assert!(e.contains("aspect ratio"), "{e}");
            }
        }
    }
}

/// The synthetic image of `resize_sweep.json` (same formula as the script's `sweep_image`).
fn sweep_image(h: usize, w: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(3 * h * w);
    for c in 0..3i64 {
        for y in 0..h as i64 {
            for x in 0..w as i64 {
                let v = x * (37 + 16 * c) + y * (91 - 20 * c) + ((x * y * (c + 3)) ^ (x + 7 * y));
                out.push((v & 255) as u8);
            }
        }
    }
    out
}

/// torchvision's uint8 bicubic antialiased resize, for reductions and enlargements by many
/// factors (one axis or both), matched by SHA-256 of the whole output. The script found the
/// same digests under torch's generic, AVX2 and AVX-512 kernels.
#[test]
fn resize_matches_torchvision_for_many_sizes() {
    let sweep = json(&fixtures().join("resize_sweep.json"));
    for case in sweep["cases"].as_array().unwrap() {
        let s: Vec<usize> = (0..4).map(|k| case[k].as_u64().unwrap() as usize).collect();
        let out =
            resize_bicubic_antialias(&sweep_image(s[0], s[1]), 3, s[0], s[1], s[2], s[3]).unwrap();
        assert_eq!(out.len(), 3 * s[2] * s[3]);
        let digest: String = Sha256::digest(&out)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(digest, case[4].as_str().unwrap(), "{s:?}");
    }
}

#[test]
fn same_size_resize_is_identity_and_bad_buffers_are_refused() {
    let img = sweep_image(28, 56);
    assert_eq!(
        resize_bicubic_antialias(&img, 3, 28, 56, 28, 56).unwrap(),
        img
    );
    let e = resize_bicubic_antialias(&img, 3, 28, 55, 28, 56).unwrap_err();
    assert!(e.contains("[3, 28, 55]"), "{e}");
    let bad = RgbImage {
        height: 2,
        width: 2,
        pixels: vec![0; 11],
    };
    let e = ImageProcessorConfig::default()
        .preprocess(&[bad])
        .unwrap_err()
        .to_string();
    assert!(e.contains("11 bytes"), "{e}");
}

#[test]
fn composite_over_white_follows_pillow() {
    for v in 0..=255u8 {
        // the opaque shortcut is what Pillow's arithmetic gives
        assert_eq!(pillow_over_white([v, 255 - v, v, 255]), [v, 255 - v, v]);
        assert_eq!(composite_over_white([v, 255 - v, v, 255]), [v, 255 - v, v]);
        assert_eq!(composite_over_white([v, 0, 7, 0]), [255, 255, 255]);
    }
    // Pillow 13: Image.alpha_composite(white, pixel).convert("RGB")
    for (px, want) in [
        ([0, 100, 200, 128], [127, 177, 227]),
        ([10, 200, 255, 1], [254, 255, 255]),
        ([255, 0, 128, 254], [255, 1, 128]),
        ([77, 78, 79, 77], [201, 202, 202]),
    ] {
        assert_eq!(composite_over_white(px), want, "{px:?}");
    }
}

fn png_bytes(w: u32, h: u32, color: png::ColorType, depth: png::BitDepth, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, w, h);
        enc.set_color(color);
        enc.set_depth(depth);
        enc.write_header().unwrap().write_image_data(data).unwrap();
    }
    out
}

/// 16-bit PNGs, as Pillow 13 reads them (measured with Pillow): RGB and gray+alpha keep the
/// high byte of each sample; 16-bit gray opens as mode "I;16", whose RGB conversion clips at 255.
#[test]
fn sixteen_bit_png_follows_pillow() {
    let v: [u16; 4] = [0, 100, 256, 65535];
    let be = |xs: &[u16]| xs.iter().flat_map(|x| x.to_be_bytes()).collect::<Vec<u8>>();
    let gray = png_bytes(
        4,
        1,
        png::ColorType::Grayscale,
        png::BitDepth::Sixteen,
        &be(&v),
    );
    let got = decode_image(&gray, true).unwrap();
    assert_eq!(
        got.pixels,
        [0, 0, 0, 100, 100, 100, 255, 255, 255, 255, 255, 255]
    );

    let rgb: Vec<u16> = v.iter().flat_map(|&x| [x, 65535 - x, 30000]).collect();
    let got = decode_image(
        &png_bytes(4, 1, png::ColorType::Rgb, png::BitDepth::Sixteen, &be(&rgb)),
        true,
    )
    .unwrap();
    assert_eq!(
        got.pixels,
        [0, 255, 117, 0, 255, 117, 1, 254, 117, 255, 0, 117]
    );

    let la: Vec<u16> = v.iter().flat_map(|&x| [x, 65535]).collect();
    let got = decode_image(
        &png_bytes(
            4,
            1,
            png::ColorType::GrayscaleAlpha,
            png::BitDepth::Sixteen,
            &be(&la),
        ),
        true,
    )
    .unwrap();
    assert_eq!(got.pixels, [0, 0, 0, 0, 0, 0, 1, 1, 1, 255, 255, 255]);
}

#[test]
fn undecodable_bytes_are_refused() {
    let e = decode_image(b"definitely not an image", true).unwrap_err();
    assert!(e.contains("not a PNG, JPEG, WebP, GIF or BMP"), "{e}");
    let good = std::fs::read(fixtures().join("images/rgb_45x70.png")).unwrap();
    let e = decode_image(&good[..good.len() / 2], true).unwrap_err();
    assert!(e.contains("cannot decode"), "{e}");
    let cfg = ImageProcessorConfig::default();
    let e = cfg
        .preprocess_encoded(&[&good, b"GIF89a"])
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("image 1: "), "{e}");
}

#[test]
fn huge_images_are_refused_from_the_header() {
    // a PNG header claiming 20000 x 20000 pixels (4e8 > 2^28): refused before decoding
    let mut bytes = png_bytes(1, 1, png::ColorType::Rgb, png::BitDepth::Eight, &[1, 2, 3]);
    bytes[16..20].copy_from_slice(&20000u32.to_be_bytes());
    bytes[20..24].copy_from_slice(&20000u32.to_be_bytes());
    let crc = crc32(&bytes[12..29]);
    bytes[29..33].copy_from_slice(&crc.to_be_bytes());
    let e = decode_image(&bytes, true).unwrap_err();
    assert!(e.contains("above the limit"), "{e}");
}

/// CRC-32 (PNG's) of a chunk's type and data.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn extreme_aspect_ratio_is_refused() {
    let img = RgbImage {
        height: 1,
        width: 201,
        pixels: vec![9; 3 * 201],
    };
    let e = ImageProcessorConfig::default()
        .preprocess(&[img])
        .unwrap_err()
        .to_string();
    assert!(e.contains("image 0") && e.contains("aspect ratio"), "{e}");
}

#[test]
fn tiny_images_are_enlarged_not_refused() {
    // transformers 5.24 has no minimum side: a 1x1 image becomes 56 x 56 (4 patches of 28)
    let img = RgbImage {
        height: 1,
        width: 1,
        pixels: vec![10, 20, 30],
    };
    let cfg = ImageProcessorConfig::default();
    let batch = cfg.preprocess(&[img]).unwrap();
    assert_eq!(batch.grid_thw, [[1, 4, 4]]);
    assert_eq!(cfg.num_image_tokens(batch.grid_thw[0]), 4);
    assert_eq!(batch.pixel_values.len(), 16 * batch.patch_dim);
}

#[test]
fn without_resize_sides_must_fit_the_grid() {
    let cfg = ImageProcessorConfig {
        do_resize: false,
        ..Default::default()
    };
    let ok = RgbImage {
        height: 28,
        width: 56,
        pixels: vec![0; 3 * 28 * 56],
    };
    assert_eq!(cfg.preprocess(&[ok]).unwrap().grid_thw, [[1, 2, 4]]);
    let bad = RgbImage {
        height: 30,
        width: 56,
        pixels: vec![0; 3 * 30 * 56],
    };
    let e = cfg.preprocess(&[bad]).unwrap_err().to_string();
    assert!(
        e.contains("not a multiple") && e.contains("do_resize"),
        "{e}"
    );
}

#[test]
fn non_rgb_without_convert_is_refused() {
    let gray = std::fs::read(fixtures().join("images/gray_100x33.png")).unwrap();
    let e = decode_image(&gray, false).unwrap_err();
    assert!(e.contains("do_convert_rgb"), "{e}");
    let rgb = std::fs::read(fixtures().join("images/rgb_45x70.png")).unwrap();
    assert_eq!(
        decode_image(&rgb, false).unwrap(),
        decode_image(&rgb, true).unwrap()
    );
}

#[test]
fn rescale_and_normalize_switches() {
    let img = RgbImage {
        height: 28,
        width: 28,
        pixels: (0..28 * 28 * 3).map(|i| (i % 251) as u8).collect(),
    };
    let first = |cfg: &ImageProcessorConfig| {
        cfg.preprocess(std::slice::from_ref(&img))
            .unwrap()
            .pixel_values[0]
    };
    let x = f32::from(img.pixels[0]);
    let base = ImageProcessorConfig {
        min_pixels: 28 * 28,
        ..Default::default()
    };
    let only_rescale = ImageProcessorConfig {
        do_normalize: false,
        ..base.clone()
    };
    assert_eq!(first(&only_rescale), x * (1.0f64 / 255.0) as f32);
    let neither = ImageProcessorConfig {
        do_normalize: false,
        do_rescale: false,
        ..base.clone()
    };
    assert_eq!(first(&neither), x);
    let fused = (x - 0.48145466f32 * 255.0) / (0.26862954f32 * 255.0);
    assert_eq!(first(&base), fused);
}

fn config_error(text: &str) -> String {
    ImageProcessorConfig::from_json(text, "model/preprocessor_config.json")
        .unwrap_err()
        .to_string()
}

#[test]
fn config_keys_resolve_as_transformers_does() {
    let f = "preprocessor_config.json";
    assert_eq!(
        ImageProcessorConfig::from_json("{}", f).unwrap(),
        ImageProcessorConfig::default()
    );
    // Qwen2.5-VL's file: top-level min/max pixels; unknown keys ignored
    let c = ImageProcessorConfig::from_json(
        r#"{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2,
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}"#,
        f,
    )
    .unwrap();
    assert_eq!((c.min_pixels, c.max_pixels), (3136, 12845056));
    // Qwen3-VL's file: `size` with mean = std = 0.5 and patch 16
    let c = ImageProcessorConfig::from_json(
        r#"{"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3}"#,
        f,
    )
    .unwrap();
    assert_eq!(
        (c.min_pixels, c.max_pixels, c.factor()),
        (65536, 16777216, 32)
    );
    assert_eq!(c.patch_dim(), 3 * 2 * 16 * 16);
    // top-level keys win over `size`; `null` means the default; a single mean is broadcast
    let c = ImageProcessorConfig::from_json(
        r#"{"size": {"longest_edge": 5000, "shortest_edge": 100}, "max_pixels": 4000,
            "min_pixels": null, "image_mean": 0.5, "do_rescale": null}"#,
        f,
    )
    .unwrap();
    assert_eq!(
        (c.min_pixels, c.max_pixels, c.do_rescale),
        (100, 4000, true)
    );
    assert_eq!(c.image_mean, [0.5]);
}

#[test]
fn bad_config_values_name_the_file_and_key() {
    let cases = [
        (r#"{"patch_size": 0}"#, "`patch_size`"),
        (r#"{"merge_size": 0}"#, "`merge_size`"),
        (r#"{"temporal_patch_size": 0}"#, "`temporal_patch_size`"),
        (
            r#"{"min_pixels": 5000, "max_pixels": 4000}"#,
            "`min_pixels` (5000) is above",
        ),
        (r#"{"min_pixels": 0}"#, "`min_pixels`"),
        (r#"{"image_mean": [0.5, 0.5]}"#, "`image_mean` needs 1 or 3"),
        (r#"{"image_std": [0.5, 0.0, 0.5]}"#, "`image_std` has a 0"),
        (r#"{"resample": 2}"#, "`resample` is 2"),
        (r#"{"rescale_factor": 0}"#, "`rescale_factor`"),
        (
            r#"{"size": {"longest_edge": 4000}}"#,
            "`size.shortest_edge`",
        ),
        (r#"{"patch_size": "14"}"#, "key `patch_size`"),
        (
            r#"{"size": {"shortest_edge": -1, "longest_edge": 9}}"#,
            "key `size.shortest_edge`",
        ),
        (r#"{"patch_size": 14,"#, "model/preprocessor_config.json"),
    ];
    for (text, want) in cases {
        let e = config_error(text);
        assert!(
            e.starts_with("model/preprocessor_config.json: "),
            "{text}: {e}"
        );
        assert!(e.contains(want), "{text}: {e}");
    }
    let missing = ImageProcessorConfig::from_model_dir(Path::new("/nonexistent/model"))
        .unwrap_err()
        .to_string();
    assert!(
        missing.contains("/nonexistent/model/preprocessor_config.json"),
        "{missing}"
    );
}

#[test]
fn placeholders_expand_in_order() {
    let p = "a <|image_pad|> b <|image_pad|><|image_pad|> c";
    let got = expand_image_placeholders(p, IMAGE_PAD_TOKEN, &[2, 1, 3]).unwrap();
    let pad = IMAGE_PAD_TOKEN;
    assert_eq!(got, format!("a {pad}{pad} b {pad}{pad}{pad}{pad} c"));
    assert_eq!(
        expand_image_placeholders("no images", pad, &[]).unwrap(),
        "no images"
    );
}

#[test]
fn placeholder_count_must_match_images() {
    let p = "x <|image_pad|> y <|image_pad|>";
    let more = expand_image_placeholders(p, IMAGE_PAD_TOKEN, &[4])
        .unwrap_err()
        .to_string();
    assert!(
        more.contains("2 image placeholder(s)") && more.contains("1 image(s)"),
        "{more}"
    );
    let fewer = expand_image_placeholders(p, IMAGE_PAD_TOKEN, &[4, 4, 4])
        .unwrap_err()
        .to_string();
    assert!(
        fewer.contains("2 image placeholder(s)") && fewer.contains("3 image(s)"),
        "{fewer}"
    );
}

// ---- verl's image path: qwen-vl-utils' fetch_image, then the processor ----------------------
//
// `tests/fixtures/image_processor/verl/` (the script's `run_verl`): per case, Pillow's mode, the
// size and SHA-256 of qwen-vl-utils 0.0.14's `fetch_image` output (and the image itself for the
// patch-14 cases and the JPEG), and transformers' grid and pixel_values digest on that output.

fn verl_dir() -> PathBuf {
    fixtures().join("verl")
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// SHA-256 of `pixel_values` as the f32 little-endian bytes of transformers' tensor.
fn pixel_values_sha256(batch: &ImageBatch) -> String {
    let bytes: Vec<u8> = batch
        .pixel_values
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    sha256_hex(&bytes)
}

/// `[H, W, 3]` u8 tensor → [`RgbImage`].
fn hwc_image(t: &Tensor) -> RgbImage {
    let (height, width, _) = t.dims3().unwrap();
    RgbImage {
        height,
        width,
        pixels: u8s(t),
    }
}

/// Largest |Δ| between two pixel_values buffers of the same shape.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The colour transformers' `convert_to_rgb` makes transparent for the `info["transparency"]`
/// Pillow left on the fetched image: a colour's low bytes, or a bare number `n` as `(n, 0, 0)`.
fn transparency_key(v: &Value) -> Option<[u8; 3]> {
    match v {
        Value::Null => None,
        Value::Array(c) => Some([0, 1, 2].map(|k| c[k].as_u64().unwrap() as u8)),
        n => Some([n.as_u64().unwrap() as u8, 0, 0]),
    }
}

/// JPEG through fetch_image: zune-jpeg's decoding (see [`JPEG_MAX_DECODE_DIFF`]) spread by
/// Pillow's bicubic resize. Measured largest |Δ| of the fetched uint8 image per case, and of
/// pixel_values (levels over 255·std).
const JPEG_FETCH_BOUNDS: [(usize, u8, f32); 3] =
    [(6, 7, 0.099_541), (19, 5, 0.071_101), (24, 7, 0.062_746)];

/// The whole verl path, per case: our [`fetch_image`] against qwen-vl-utils + Pillow (every
/// byte of the fetched image), then the processor on it against transformers (every float of
/// pixel_values, by digest), the grid, and the processor on Pillow's own fetched image too.
#[test]
fn verl_path_matches_qwen_vl_utils_and_transformers() {
    let reference = json(&verl_dir().join("reference.json"));
    let fetched = tensors(&verl_dir().join("fetched.safetensors"));
    let mut processors = HashMap::new();
    for name in ["qwen2_5_vl", "qwen3_vl"] {
        let cfg = ImageProcessorConfig::from_model_dir(&verl_dir().join(name)).unwrap();
        processors.insert(name, cfg);
    }
    let mut report = Vec::new();
    for (i, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let file = case["file"].as_str().unwrap();
        let bytes = std::fs::read(fixtures().join(file)).unwrap();
        let patch = case["image_patch_size"].as_u64().unwrap() as usize;
        let (lo, hi) = (case["min_pixels"].as_u64(), case["max_pixels"].as_u64());
        let cfg = &processors[case["processor"].as_str().unwrap()];
        let what = format!("case {i} ({file}, patch {patch}, min {lo:?}, max {hi:?})");

        let (raw, key) = fetch_image_with_key(&bytes, patch, lo, hi).unwrap();
        assert_eq!(
            key,
            transparency_key(&case["fetched_transparency"]),
            "{what}: key"
        );
        let ours = fetch_image(&bytes, patch, lo, hi).unwrap();
        let mut keyed = raw.clone();
        if let Some(key) = key {
            whiten_key(&mut keyed, key);
        }
        assert_eq!(
            ours, keyed,
            "{what}: fetch_image = fetch_image_with_key + key"
        );
        let size: Vec<usize> = serde_json::from_value(case["fetched"].clone()).unwrap();
        assert_eq!([ours.height, ours.width], size[..], "{what}: fetched size");
        let want_sha = case["fetched_sha256"].as_str().unwrap();
        let pil = fetched.get(&format!("fetched_{i}")).map(hwc_image);
        let fetch_diff = pil.as_ref().map(|p| {
            (p.pixels.iter().zip(&raw.pixels))
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap()
        });

        let batch = cfg.preprocess(std::slice::from_ref(&ours)).unwrap();
        let grid: Vec<usize> = serde_json::from_value(case["image_grid_thw"].clone()).unwrap();
        assert_eq!(batch.grid_thw[0][..], grid[..], "{what}: image_grid_thw");
        let want_pv = case["pixel_values_sha256"].as_str().unwrap();
        let mut pv_diff = 0f32;
        if let Some(pil) = &pil {
            // the processor on Pillow's fetched image: transformers' floats, bit for bit
            assert_eq!(sha256_hex(&pil.pixels), want_sha, "{what}: fixture");
            let mut pil = pil.clone();
            if let Some(key) = key {
                whiten_key(&mut pil, key);
            }
            let from_pil = cfg.preprocess(std::slice::from_ref(&pil)).unwrap();
            assert_eq!(
                pixel_values_sha256(&from_pil),
                want_pv,
                "{what}: from Pillow's image"
            );
            pv_diff = max_abs_diff(&batch.pixel_values, &from_pil.pixel_values);
        }
        report.push(format!(
            "{what}: fetched Δ {fetch_diff:?}, pixel_values Δ {pv_diff}"
        ));
        match JPEG_FETCH_BOUNDS.iter().find(|b| b.0 == i) {
            Some(&(_, fetch_bound, pv_bound)) => {
                assert!(file.ends_with(".jpg"), "{what}");
                let d = fetch_diff.unwrap();
                assert!(d <= fetch_bound, "{what}: fetched differs by up to {d}");
                assert!(
                    pv_diff <= pv_bound,
                    "{what}: pixel_values differ by {pv_diff}"
                );
            }
            None => {
                assert_eq!(sha256_hex(&raw.pixels), want_sha, "{what}: {fetch_diff:?}");
                assert_eq!(pixel_values_sha256(&batch), want_pv, "{what}: pixel_values");
            }
        }
    }
    println!("{}", report.join("\n"));
}

/// The sweep image as `[H, W, 3]` (the script hands Pillow `sweep_image(h, w).transpose(1, 2, 0)`).
fn sweep_rgb(h: usize, w: usize) -> RgbImage {
    let chw = sweep_image(h, w);
    let plane = h * w;
    RgbImage {
        height: h,
        width: w,
        pixels: (0..plane)
            .flat_map(|k| [chw[k], chw[plane + k], chw[2 * plane + k]])
            .collect(),
    }
}

/// Pillow's `Image.resize` (BICUBIC) for the torchvision sweep's size pairs and more: the
/// vertical pass first, one axis only, strong reductions, enlargements, 1-pixel inputs; matched
/// by SHA-256 of the whole output.
#[test]
fn pil_resize_matches_pillow_for_many_sizes() {
    let sweep = json(&verl_dir().join("pil_resize_sweep.json"));
    for case in sweep["cases"].as_array().unwrap() {
        let s: Vec<usize> = (0..4).map(|k| case[k].as_u64().unwrap() as usize).collect();
        let out = resize_pil_bicubic(&sweep_rgb(s[0], s[1]), s[3], s[2]);
        assert_eq!((out.height, out.width), (s[2], s[3]));
        assert_eq!(sha256_hex(&out.pixels), case[4].as_str().unwrap(), "{s:?}");
    }
}

#[test]
fn pil_resize_edge_sizes_do_not_panic() {
    let img = sweep_rgb(5, 7);
    // the same size: Pillow's copy
    assert_eq!(resize_pil_bicubic(&img, 7, 5), img);
    let empty = resize_pil_bicubic(&img, 0, 3);
    assert_eq!((empty.height, empty.width, empty.pixels.len()), (3, 0, 0));
    // a buffer that does not match its sides: black, no panic
    let bad = RgbImage {
        height: 5,
        width: 7,
        pixels: vec![1; 10],
    };
    assert_eq!(resize_pil_bicubic(&bad, 4, 4).pixels, vec![0; 48]);
}

/// qwen-vl-utils' `smart_resize`: outputs (a side of 0 included) and its two refusals.
#[test]
fn fetch_smart_resize_matches_qwen_vl_utils() {
    let cases = json(&verl_dir().join("smart_resize.json"));
    for case in cases.as_array().unwrap() {
        let i: Vec<u64> = serde_json::from_value(case["in"].clone()).unwrap();
        let got = fetch_smart_resize(i[0] as usize, i[1] as usize, i[2] as usize, i[3], i[4]);
        match case.get("out") {
            Some(out) => {
                let out: Vec<usize> = serde_json::from_value(out.clone()).unwrap();
                assert_eq!(got, Ok((out[0], out[1])), "{i:?}");
            }
            None => {
                let e = got.expect_err(&format!("{i:?} should be refused"));
                let want = case["error"].as_str().unwrap();
                let named = if want.starts_with("ValueError") {
                    "absolute aspect ratio must be smaller than 200"
                } else {
                    "max_pixels of image must be greater than or equal to min_pixels"
                };
                assert!(e.contains(named), "{i:?}: {e} (Python: {want})");
            }
        }
    }
}

/// qwen-vl-utils' `to_rgb` of an RGBA image holding every (value, alpha) pair, against Pillow's
/// `paste` onto white; transformers' `alpha_composite` over white gives the same values.
#[test]
fn to_rgb_pastes_rgba_over_white_as_pillow() {
    let sweep = json(&verl_dir().join("pil_resize_sweep.json"));
    let mut pasted = Vec::with_capacity(256 * 256 * 3);
    let mut differ = 0;
    for y in 0..256usize {
        for x in 0..256usize {
            let px = [x as u8, 255 - x as u8, ((7 * x + y) % 256) as u8, y as u8];
            let rgb = paste_over_white(px);
            differ += usize::from(rgb != composite_over_white(px));
            pasted.extend_from_slice(&rgb);
        }
    }
    assert_eq!(
        sha256_hex(&pasted),
        sweep["to_rgb_rgba_table_sha256"].as_str().unwrap()
    );
    // the two blends' integer arithmetic agree over white, on every pair
    assert_eq!(differ, 0);
}

/// A PNG with optional PLTE and tRNS chunks.
fn png_keyed(
    w: u32,
    color: png::ColorType,
    depth: png::BitDepth,
    data: &[u8],
    palette: Option<&[u8]>,
    trns: &[u8],
) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, w, 1);
        enc.set_color(color);
        enc.set_depth(depth);
        if let Some(p) = palette {
            enc.set_palette(p.to_vec());
        }
        enc.set_trns(trns.to_vec());
        enc.write_header().unwrap().write_image_data(data).unwrap();
    }
    out
}

/// Transparency keys, measured with Pillow 13 + transformers 5.24 on these images: Pillow
/// compares a 2-bit gray key with the scaled samples (so nothing matches here), a 16-bit key by
/// its low byte against the clipped / high-byte samples; after `convert("RGB")` a "1" or "I;16"
/// key stays a number (`(n, 0, 0)`), a palette key becomes its colour.
#[test]
fn transparency_keys_follow_pillow() {
    use png::{BitDepth as D, ColorType as C};
    let gray2 = png_keyed(
        8,
        C::Grayscale,
        D::Two,
        &[0b0001_1011, 0b1110_0100],
        None,
        &[0, 1],
    );
    let got = decode_image(&gray2, true).unwrap().pixels;
    let want: Vec<u8> = [0u8, 85, 170, 255, 255, 170, 85, 0]
        .iter()
        .flat_map(|&v| [v; 3])
        .collect();
    assert_eq!(got, want, "2-bit gray, key 1");
    assert_eq!(TransparencyKeys::of(&gray2).fetched, Some([1, 1, 1]));

    let g16: Vec<u8> = [0u16, 256, 300, 44, 45]
        .iter()
        .flat_map(|v| v.to_be_bytes())
        .collect();
    let gray16 = png_keyed(
        5,
        C::Grayscale,
        D::Sixteen,
        &g16,
        None,
        &300u16.to_be_bytes(),
    );
    let got = decode_image(&gray16, true).unwrap().pixels;
    let want: Vec<u8> = [0u8, 255, 255, 255, 45]
        .iter()
        .flat_map(|&v| [v; 3])
        .collect();
    assert_eq!(got, want, "16-bit gray, key 300");
    assert_eq!(TransparencyKeys::of(&gray16).fetched, Some([44, 0, 0]));

    let px: Vec<u8> = [0x0140u16, 0x0202, 0x0303, 0x0301, 0x0402, 0x0503]
        .iter()
        .flat_map(|v| v.to_be_bytes())
        .collect();
    let rgb16 = png_keyed(2, C::Rgb, D::Sixteen, &px, None, &px[6..]);
    assert_eq!(
        decode_image(&rgb16, true).unwrap().pixels,
        [255, 255, 255, 3, 4, 5]
    );
    assert_eq!(TransparencyKeys::of(&rgb16).fetched, Some([1, 2, 3]));

    for (key, fetched) in [(0u8, [0, 0, 0]), (1, [255, 0, 0])] {
        let bits = png_keyed(8, C::Grayscale, D::One, &[0b1011_0010], None, &[0, key]);
        assert_eq!(
            TransparencyKeys::of(&bits).fetched,
            Some(fetched),
            "1-bit {key}"
        );
    }

    let plte = [10, 20, 30, 40, 50, 60, 70, 80, 90];
    let idx = [0u8, 1, 2];
    for (trns, fetched) in [
        (&b"\xff\x00"[..], Some([40, 50, 60])),
        (b"\xff\x00\n", Some([40, 50, 60])),
        (b"\x00\x00", None),
        (b"\xff\x80", None),
    ] {
        let p = png_keyed(3, C::Indexed, D::Eight, &idx, Some(&plte), trns);
        assert_eq!(
            TransparencyKeys::of(&p).fetched,
            fetched,
            "palette {trns:?}"
        );
    }
}

/// A GIF's first-frame key from its header blocks alone (an index no pixel uses still counts):
/// the local colour table over the global one, a gray identity palette as gray.
#[test]
fn gif_keys_follow_pillow() {
    let gif = |global: &[u8], local: Option<&[u8]>, gce_flags: u8, index: u8| {
        let mut b = b"GIF89a\x01\x00\x01\x00".to_vec();
        b.extend_from_slice(&[0x80 | 0x01, 0, 0]); // 4-entry global table
        b.extend_from_slice(global);
        b.extend_from_slice(&[0x21, 0xFE, 2, b'h', b'i', 0]); // a comment first
        b.extend_from_slice(&[0x21, 0xF9, 4, gce_flags, 0, 0, index, 0]);
        b.extend_from_slice(&[0x2C, 0, 0, 0, 0, 1, 0, 1, 0]);
        match local {
            Some(l) => {
                b.push(0x80 | 0x01);
                b.extend_from_slice(l);
            }
            None => b.push(0),
        }
        b.extend_from_slice(&[2, 2, 0x4C, 0x01, 0, 0x3B]);
        b
    };
    let global = [10, 11, 12, 20, 21, 22, 30, 31, 32, 40, 41, 42];
    let local = [50, 51, 52, 60, 61, 62, 70, 71, 72, 80, 81, 82];
    let gray = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3];
    assert_eq!(gif_key(&gif(&global, None, 1, 3)), Some([40, 41, 42]));
    assert_eq!(
        gif_key(&gif(&global, Some(&local), 1, 2)),
        Some([70, 71, 72])
    );
    assert_eq!(gif_key(&gif(&global, None, 0, 3)), None);
    assert_eq!(gif_key(&gif(&gray, None, 1, 9)), Some([9, 9, 9]));
    assert_eq!(gif_key(&gif(&global, None, 1, 9)), None);
    assert_eq!(gif_key(b"GIF89a"), None);
}

/// fetch_image's refusals, each named as qwen-vl-utils or Pillow raises it, none a panic.
#[test]
fn fetch_image_errors_are_named() {
    let rgb = |w: u32, h: u32| {
        let data = vec![7u8; (3 * w * h) as usize];
        png_bytes(w, h, png::ColorType::Rgb, png::BitDepth::Eight, &data)
    };
    let ok = rgb(45, 70);
    let e = fetch_image(&ok, 0, None, None).unwrap_err();
    assert!(e.contains("image_patch_size"), "{e}");
    let e = fetch_image(&rgb(201, 1), 14, None, None).unwrap_err();
    assert!(e.contains("absolute aspect ratio"), "{e}");
    let e = fetch_image(&ok, 14, Some(5000), Some(4000)).unwrap_err();
    assert!(e.contains("greater than or equal to min_pixels"), "{e}");
    let e = fetch_image(&rgb(150, 1), 14, Some(0), Some(100)).unwrap_err();
    assert!(e.contains("height and width must be > 0"), "{e}");
    let e = fetch_image(&ok, 14, Some(0), Some(0)).unwrap_err();
    assert!(e.contains("max_pixels is 0"), "{e}");
    let e = fetch_image(b"not an image", 14, None, None).unwrap_err();
    assert!(e.contains("not a PNG"), "{e}");
    // the defaults: 4 · 28² ≤ pixels ≤ 16384 · 28²
    let img = fetch_image(&ok, 14, None, None).unwrap();
    assert_eq!((img.height, img.width), (56, 56));
}

/// When its smart_resize keeps the size, the processor passes the image on untouched, as
/// torchvision's resize returns its input.
#[test]
fn processor_resize_is_skipped_at_the_same_size() {
    let cfg = ImageProcessorConfig::from_model_dir(&verl_dir().join("qwen2_5_vl")).unwrap();
    let img = sweep_rgb(56, 84);
    assert_eq!(cfg.resize(&img).unwrap(), (img.to_chw(), 56, 84));
}
