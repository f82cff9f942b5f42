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
