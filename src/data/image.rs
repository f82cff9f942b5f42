//! Images of vision-language prompts → the `pixel_values` and `image_grid_thw` a Qwen2-VL,
//! Qwen2.5-VL or Qwen3-VL vision tower takes, bit for bit as transformers 5.24 makes them.
//!
//! All three families load the same processor class, `Qwen2VLImageProcessor`
//! (`transformers/models/qwen2_vl/image_processing_qwen2_vl.py`, on the torchvision backend of
//! `transformers/image_processing_backends.py`); only their `preprocessor_config.json` differs
//! (Qwen3-VL: patch 16, mean = std = 0.5, `size.shortest_edge / longest_edge`). Steps:
//!
//! 1. decoding (PNG, JPEG, WebP, GIF, BMP) to RGB8 with transformers' `convert_to_rgb`: images
//!    with an alpha channel (RGBA, LA, palettes or keys with transparency) are laid over white
//!    with Pillow's integer `alpha_composite` (a gray or RGB PNG's tRNS key matched as Pillow
//!    matches it); 16-bit samples become 8-bit as Pillow reads them.
//!    Pillow's pixels exactly, except JPEG: the `image` crate decodes it with zune-jpeg, whose
//!    IDCT, chroma upsampling and colour conversion round differently from libjpeg-turbo's
//!    (Pillow's), a few levels on some samples (measured in the tests),
//! 2. [`smart_resize`]: the output size, a multiple of `patch_size * merge_size` on both axes,
//!    its pixel count within `[min_pixels, max_pixels]`,
//! 3. [`resize_bicubic_antialias`]: torchvision's bicubic antialiased resize of a uint8 image on
//!    the CPU, which torch runs on uint8 (`_upsample_bicubic2d_aa`: int16 weights, horizontal then
//!    vertical pass, a uint8 image between them; the same numbers on its AVX2 and generic
//!    kernels),
//! 4. rescale and normalise fused as transformers does (`(x - 255·mean) / (255·std)` in f32),
//! 5. patchify: `[num_patches, C·T·P·P]`, patches ordered by merge window, each image repeated
//!    `temporal_patch_size` times on the temporal axis; grid `(1, h / P, w / P)`.
//!
//! Before these steps verl's `RLHFDataset` passes every image through qwen-vl-utils 0.0.14's
//! `fetch_image` (`verl.utils.dataset.vision_utils.process_image`); [`fetch_image`] is that step:
//!
//! 0. decoding as above, but made RGB by qwen-vl-utils' `to_rgb` (only Pillow's "RGBA" images
//!    are laid over white, by `paste` with the alpha as mask; other modes lose their alpha
//!    through `convert("RGB")`), sized by qwen-vl-utils' own [`fetch_smart_resize`] (multiples
//!    of `2 · image_patch_size`) and resized with Pillow's bicubic filter
//!    ([`resize_pil_bicubic`]); then, as the processor's `convert_to_rgb` does, the pixels equal
//!    to the transparent colour Pillow keeps in the image's `info` (a gray / RGB / palette tRNS
//!    key, a GIF's transparent index) turn white. The processor's [`smart_resize`] then normally
//!    returns the same size, and its resize is skipped.
//!
//! [`expand_image_placeholders`] repeats each `<|image_pad|>` of a rendered prompt once per
//! merged patch, as `processing_qwen2_vl.py` (and the Qwen2.5-VL / Qwen3-VL processors) do.

use std::io::Cursor;
use std::path::Path;

use serde::Deserialize;

use super::DataError;

/// The file of an HF model folder that holds the image processor's settings.
pub const PREPROCESSOR_CONFIG: &str = "preprocessor_config.json";

/// The placeholder the Qwen chat templates write for each image.
pub const IMAGE_PAD_TOKEN: &str = "<|image_pad|>";

/// Decoded images above this many pixels are refused before their buffer is allocated.
pub const MAX_DECODED_PIXELS: u64 = 1 << 28;

/// The only resampling filter supported: PIL's BICUBIC (3), the class default.
const RESAMPLE_BICUBIC: u32 = 3;

/// The image processor's settings, as `Qwen2VLImageProcessor` resolves them from
/// `preprocessor_config.json` (keys it does not use are ignored; absent or `null` keys take the
/// class defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessorConfig {
    /// Lower bound of the resized pixel count (`min_pixels`, else `size.shortest_edge`).
    pub min_pixels: u64,
    /// Upper bound of the resized pixel count (`max_pixels`, else `size.longest_edge`).
    pub max_pixels: u64,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    /// One value for all channels, or one per channel (R, G, B).
    pub image_mean: Vec<f64>,
    pub image_std: Vec<f64>,
    pub rescale_factor: f64,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
    pub do_convert_rgb: bool,
    /// PIL resampling code; only 3 (bicubic) is supported.
    pub resample: u32,
}

const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

impl Default for ImageProcessorConfig {
    /// The class defaults (Qwen2-VL's): 56² to 28²·1280 pixels, patch 14, merge 2, CLIP stats.
    fn default() -> Self {
        Self {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            image_mean: CLIP_MEAN.to_vec(),
            image_std: CLIP_STD.to_vec(),
            rescale_factor: 1.0 / 255.0,
            do_resize: true,
            do_rescale: true,
            do_normalize: true,
            do_convert_rgb: true,
            resample: RESAMPLE_BICUBIC,
        }
    }
}

/// `size` as the file writes it: only the two keys the Qwen processor reads.
#[derive(Debug, Deserialize)]
struct RawSize {
    shortest_edge: Option<u64>,
    longest_edge: Option<u64>,
}

/// A number or a list of numbers (`image_mean`, `image_std`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(f64),
    Many(Vec<f64>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<f64> {
        match self {
            OneOrMany::One(x) => vec![x],
            OneOrMany::Many(v) => v,
        }
    }
}

/// The file's keys; `None` is absent or `null` (transformers then takes the class default).
#[derive(Debug, Deserialize)]
struct RawConfig {
    min_pixels: Option<u64>,
    max_pixels: Option<u64>,
    size: Option<RawSize>,
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    image_mean: Option<OneOrMany>,
    image_std: Option<OneOrMany>,
    rescale_factor: Option<f64>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    do_convert_rgb: Option<bool>,
    resample: Option<u32>,
}

impl ImageProcessorConfig {
    /// Reads `preprocessor_config.json` of a model folder.
    pub fn from_model_dir(dir: &Path) -> Result<Self, DataError> {
        Self::from_file(&dir.join(PREPROCESSOR_CONFIG))
    }

    /// Reads a `preprocessor_config.json`.
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        let text = std::fs::read_to_string(path).map_err(|e| DataError::File {
            file: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// Parses the JSON text of a `preprocessor_config.json`; `file` names it in errors.
    pub fn from_json(text: &str, file: &str) -> Result<Self, DataError> {
        let err = |message: String| DataError::File {
            file: file.to_string(),
            message,
        };
        let mut de = serde_json::Deserializer::from_str(text);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let key = e.path().to_string();
            err(format!("key `{key}`: {}", e.into_inner()))
        })?;
        let d = Self::default();
        // `min_pixels` / `max_pixels` override `size`; a `size` without a key leaves it unset
        // (transformers replaces the whole default dict with the file's).
        let (mut lo, mut hi) = match raw.size {
            Some(s) => (s.shortest_edge, s.longest_edge),
            None => (Some(d.min_pixels), Some(d.max_pixels)),
        };
        lo = raw.min_pixels.or(lo);
        hi = raw.max_pixels.or(hi);
        let config = Self {
            min_pixels: lo.ok_or_else(|| {
                err("key `size.shortest_edge` (or `min_pixels`) is missing".into())
            })?,
            max_pixels: hi.ok_or_else(|| {
                err("key `size.longest_edge` (or `max_pixels`) is missing".into())
            })?,
            patch_size: raw.patch_size.unwrap_or(d.patch_size),
            temporal_patch_size: raw.temporal_patch_size.unwrap_or(d.temporal_patch_size),
            merge_size: raw.merge_size.unwrap_or(d.merge_size),
            image_mean: raw.image_mean.map_or(d.image_mean, OneOrMany::into_vec),
            image_std: raw.image_std.map_or(d.image_std, OneOrMany::into_vec),
            rescale_factor: raw.rescale_factor.unwrap_or(d.rescale_factor),
            do_resize: raw.do_resize.unwrap_or(d.do_resize),
            do_rescale: raw.do_rescale.unwrap_or(d.do_rescale),
            do_normalize: raw.do_normalize.unwrap_or(d.do_normalize),
            do_convert_rgb: raw.do_convert_rgb.unwrap_or(d.do_convert_rgb),
            resample: raw.resample.unwrap_or(d.resample),
        };
        config.validate().map_err(err)?;
        Ok(config)
    }

    /// The checks of [`Self::from_json`]; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        for (key, v) in [
            ("patch_size", self.patch_size),
            ("temporal_patch_size", self.temporal_patch_size),
            ("merge_size", self.merge_size),
        ] {
            if v == 0 {
                return Err(format!("key `{key}` must be at least 1"));
            }
        }
        if self.min_pixels == 0 || self.max_pixels == 0 {
            return Err(format!(
                "keys `min_pixels` / `max_pixels` (`size.shortest_edge` / `longest_edge`) must be \
                 at least 1, got {} and {}",
                self.min_pixels, self.max_pixels
            ));
        }
        if self.min_pixels > self.max_pixels {
            return Err(format!(
                "key `min_pixels` ({}) is above `max_pixels` ({})",
                self.min_pixels, self.max_pixels
            ));
        }
        for (key, v) in [
            ("image_mean", &self.image_mean),
            ("image_std", &self.image_std),
        ] {
            if v.len() != 1 && v.len() != 3 {
                return Err(format!(
                    "key `{key}` needs 1 or 3 values (one per RGB channel), got {}",
                    v.len()
                ));
            }
            if v.iter().any(|x| !x.is_finite()) {
                return Err(format!("key `{key}` has a value that is not finite: {v:?}"));
            }
        }
        if self.image_std.contains(&0.0) {
            return Err(format!("key `image_std` has a 0: {:?}", self.image_std));
        }
        if !(self.rescale_factor.is_finite() && self.rescale_factor != 0.0) {
            return Err(format!(
                "key `rescale_factor` must be a finite non-zero number, got {}",
                self.rescale_factor
            ));
        }
        if self.resample != RESAMPLE_BICUBIC {
            return Err(format!(
                "key `resample` is {}: only 3 (bicubic, the Qwen2-VL default) is supported",
                self.resample
            ));
        }
        Ok(())
    }

    /// Side of the resize grid: both output sides are multiples of it.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Length of one row of `pixel_values`: `3 · T · P · P`.
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Placeholder tokens of an image with this grid: `t · gh · gw / merge²`.
    pub fn num_image_tokens(&self, grid_thw: [usize; 3]) -> usize {
        grid_thw[0] * grid_thw[1] * grid_thw[2] / (self.merge_size * self.merge_size)
    }

    /// Decodes and processes encoded images (PNG, JPEG, WebP, GIF, BMP), in order.
    pub fn preprocess_encoded(&self, images: &[&[u8]]) -> Result<ImageBatch, DataError> {
        let decoded = images
            .iter()
            .enumerate()
            .map(|(i, bytes)| {
                decode_image(bytes, self.do_convert_rgb)
                    .map_err(|e| DataError::Other(format!("image {i}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.preprocess(&decoded)
    }

    /// Processes decoded images, in order, into one batch.
    pub fn preprocess(&self, images: &[RgbImage]) -> Result<ImageBatch, DataError> {
        let patch_dim = self.patch_dim();
        let mut batch = ImageBatch {
            pixel_values: Vec::new(),
            patch_dim,
            grid_thw: Vec::with_capacity(images.len()),
        };
        for (i, image) in images.iter().enumerate() {
            let grid = self
                .process_one(image, &mut batch.pixel_values)
                .map_err(|e| DataError::Other(format!("image {i}: {e}")))?;
            batch.grid_thw.push(grid);
        }
        Ok(batch)
    }

    /// The resized `[3, h, w]` uint8 image (`h`, `w` from [`smart_resize`]; unchanged when
    /// `do_resize` is off, if its sides are already multiples of the factor).
    pub fn resize(&self, image: &RgbImage) -> Result<(Vec<u8>, usize, usize), String> {
        let (h, w) = (image.height, image.width);
        if image.pixels.len() != h * w * 3 {
            return Err(format!(
                "has {} bytes, not the 3 x {h} x {w} of an RGB8 image",
                image.pixels.len()
            ));
        }
        let chw = image.to_chw();
        if !self.do_resize {
            let f = self.factor();
            if h % f != 0 || w % f != 0 {
                return Err(format!(
                    "is {h}x{w}, not a multiple of patch_size * merge_size = {f} on both sides, \
                     and do_resize is off"
                ));
            }
            return Ok((chw, h, w));
        }
        let (rh, rw) = smart_resize(h, w, self.factor(), self.min_pixels, self.max_pixels)?;
        if (rh, rw) == (h, w) {
            // torchvision's `resize_image` returns its input tensor itself when the size does not
            // change (and a 1:1 antialiased bicubic pass on uint8 would be an identity anyway:
            // its only non-zero tap has weight 1), so the image is passed on as it is.
            return Ok((chw, h, w));
        }
        Ok((resize_bicubic_antialias(&chw, 3, h, w, rh, rw)?, rh, rw))
    }

    /// Resizes, normalises and patchifies one image, appending its patches; returns its grid.
    fn process_one(&self, image: &RgbImage, out: &mut Vec<f32>) -> Result<[usize; 3], String> {
        let (chw, h, w) = self.resize(image)?;
        let values = self.normalize(&chw, h * w);
        let grid = [1, h / self.patch_size, w / self.patch_size];
        patchify(&values, h, w, self, out);
        Ok(grid)
    }

    /// `[3, H·W]` u8 → `[3, H·W]` f32, rescale and normalise as transformers fuses them: with
    /// both on, `(x - mean·(1/rescale)) / (std·(1/rescale))`, the factors rounded to f32 first
    /// (`torch.tensor(mean) * (1.0 / rescale_factor)` is an f32 tensor).
    fn normalize(&self, chw: &[u8], plane: usize) -> Vec<f32> {
        let channel = |v: &[f64], c: usize| if v.len() == 1 { v[0] } else { v[c] };
        let inv = (1.0 / self.rescale_factor) as f32;
        let mut out = Vec::with_capacity(chw.len());
        for c in 0..3 {
            let src = &chw[c * plane..(c + 1) * plane];
            let mean = channel(&self.image_mean, c) as f32;
            let std = channel(&self.image_std, c) as f32;
            match (self.do_rescale, self.do_normalize) {
                (true, true) => {
                    let (m, s) = (mean * inv, std * inv);
                    out.extend(src.iter().map(|&x| (f32::from(x) - m) / s));
                }
                (false, true) => out.extend(src.iter().map(|&x| (f32::from(x) - mean) / std)),
                (true, false) => {
                    let r = self.rescale_factor as f32;
                    out.extend(src.iter().map(|&x| f32::from(x) * r));
                }
                (false, false) => out.extend(src.iter().map(|&x| f32::from(x))),
            }
        }
        out
    }
}

/// Appends the patches of one normalised `[3, h, w]` image to `out`: rows ordered by merge
/// window (window row, window column, then the `merge × merge` patches inside it), each row
/// `[C, T, P, P]` with the image repeated on the temporal axis `T` times.
fn patchify(values: &[f32], h: usize, w: usize, cfg: &ImageProcessorConfig, out: &mut Vec<f32>) {
    let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let (gh, gw) = (h / p, w / p);
    out.reserve(gh * gw * cfg.patch_dim());
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for c in 0..3 {
                        let plane = &values[c * h * w..(c + 1) * h * w];
                        for _ in 0..t {
                            for py in 0..p {
                                let row = (y0 + py) * w + x0;
                                out.extend_from_slice(&plane[row..row + p]);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The processed images of one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageBatch {
    /// `[num_patches, patch_dim]` row-major, the images one after another.
    pub pixel_values: Vec<f32>,
    /// `3 · temporal_patch_size · patch_size²`.
    pub patch_dim: usize,
    /// `(t, gh, gw)` per image: `t = 1`, `gh · gw` patches.
    pub grid_thw: Vec<[usize; 3]>,
}

impl ImageBatch {
    /// Rows of `pixel_values`.
    pub fn num_patches(&self) -> usize {
        self.pixel_values.len() / self.patch_dim.max(1)
    }
}

/// Output size of the resize: `(height, width)`, each a multiple of `factor`, the aspect ratio
/// kept as closely as the grid allows, the pixel count brought within `[min_pixels,
/// max_pixels]` (sides rounded half to even first, then scaled down with floor or up with
/// ceil). Refuses an aspect ratio above 200 and an empty image.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(usize, usize), String> {
    if height == 0 || width == 0 || factor == 0 {
        return Err(format!(
            "cannot resize a {height}x{width} image to multiples of {factor}"
        ));
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(format!(
            "is {height}x{width}: its aspect ratio {ratio} is above 200, which the Qwen2-VL \
             processor refuses"
        ));
    }
    let mut h_bar = (h / f).round_ties_even() as u64 * factor as u64;
    let mut w_bar = (w / f).round_ties_even() as u64 * factor as u64;
    let pixels = (height as u64) * (width as u64);
    if h_bar.saturating_mul(w_bar) > max_pixels {
        let beta = (pixels as f64 / max_pixels as f64).sqrt();
        h_bar = (factor as u64).max((h / beta / f).floor() as u64 * factor as u64);
        w_bar = (factor as u64).max((w / beta / f).floor() as u64 * factor as u64);
    } else if h_bar.saturating_mul(w_bar) < min_pixels {
        let beta = (min_pixels as f64 / pixels as f64).sqrt();
        h_bar = (h * beta / f).ceil() as u64 * factor as u64;
        w_bar = (w * beta / f).ceil() as u64 * factor as u64;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// One image after decoding: `[H, W, 3]` RGB8, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub height: usize,
    pub width: usize,
    pub pixels: Vec<u8>,
}

impl RgbImage {
    /// `[H, W, 3]` → `[3, H, W]`.
    pub fn to_chw(&self) -> Vec<u8> {
        let plane = self.height * self.width;
        let mut out = vec![0u8; 3 * plane];
        for (i, px) in self.pixels.chunks_exact(3).enumerate() {
            out[i] = px[0];
            out[plane + i] = px[1];
            out[2 * plane + i] = px[2];
        }
        out
    }
}

/// Decodes PNG, JPEG, WebP, GIF or BMP bytes (the first frame of an animation) to RGB8.
///
/// With `convert_rgb` (the processor's `do_convert_rgb`), as transformers' `convert_to_rgb` on a
/// Pillow image: grayscale is repeated on the three channels and images with transparency are
/// laid over white ([`composite_over_white`]); the tRNS key of a gray or RGB PNG whitens the
/// pixels Pillow finds equal to it (see `TransparencyKeys`). Without it the image must already
/// be RGB without alpha. Images above [`MAX_DECODED_PIXELS`] are refused from their header.
pub fn decode_image(bytes: &[u8], convert_rgb: bool) -> Result<RgbImage, String> {
    let decoded = decode_any(bytes)?;
    match TransparencyKeys::of(bytes).opened {
        // gray and RGB PNGs with a tRNS key: Pillow's matching, not the decoder's alpha
        Some(key) if convert_rgb => {
            let mut image = to_rgb8(decoded, true, drop_alpha)?;
            whiten_key(&mut image, key);
            Ok(image)
        }
        _ => to_rgb8(decoded, convert_rgb, composite_over_white),
    }
}

/// Decodes PNG, JPEG, WebP, GIF or BMP bytes in the decoder's own pixel format, refusing images
/// above [`MAX_DECODED_PIXELS`] from their header.
fn decode_any(bytes: &[u8]) -> Result<::image::DynamicImage, String> {
    let reader = || {
        ::image::ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| format!("cannot read the image bytes: {e}"))
    };
    let probe = reader()?;
    if probe.format().is_none() {
        return Err(format!(
            "not a PNG, JPEG, WebP, GIF or BMP image ({} bytes starting {:02x?})",
            bytes.len(),
            &bytes[..bytes.len().min(8)]
        ));
    }
    let (w, h) = probe
        .into_dimensions()
        .map_err(|e| format!("cannot decode the image header: {e}"))?;
    let pixels = u64::from(w) * u64::from(h);
    if pixels == 0 {
        return Err(format!("the image is empty ({w}x{h})"));
    }
    if pixels > MAX_DECODED_PIXELS {
        return Err(format!(
            "the image is {w}x{h} = {pixels} pixels, above the limit of {MAX_DECODED_PIXELS}"
        ));
    }
    let mut limits = ::image::Limits::default();
    // the decoded buffer itself (up to 16-bit RGBA) plus the decoders' own scratch
    limits.max_alloc = Some(MAX_DECODED_PIXELS * 8 + (64 << 20));
    let mut decoder = reader()?;
    decoder.limits(limits);
    let decoded = decoder
        .decode()
        .map_err(|e| format!("cannot decode the image: {e}"))?;
    // a 16-bit gray PNG with a tRNS key comes out as gray + alpha, but Pillow opens it as mode
    // "I;16" (samples clipped at 255, not their high byte) and keeps the key apart
    let gray16 = matches!(::image::guess_format(bytes), Ok(::image::ImageFormat::Png))
        && bytes.get(24..26) == Some(&[16, 0]);
    Ok(match decoded {
        ::image::DynamicImage::ImageLumaA16(_) if gray16 => {
            ::image::DynamicImage::ImageLuma16(decoded.to_luma16())
        }
        other => other,
    })
}

/// A decoded image → RGB8 as Pillow reads it, each pixel's RGBA made RGB by `blend`
/// ([`composite_over_white`] for transformers' `convert_to_rgb`, see [`decode_image`]).
fn to_rgb8(
    img: ::image::DynamicImage,
    convert_rgb: bool,
    blend: fn([u8; 4]) -> [u8; 3],
) -> Result<RgbImage, String> {
    use ::image::DynamicImage as D;
    let (width, height) = (img.width() as usize, img.height() as usize);
    let kind = format!("{:?}", img.color());
    if !convert_rgb && !matches!(img, D::ImageRgb8(_) | D::ImageRgb16(_)) {
        return Err(format!(
            "is {kind}, not RGB, and do_convert_rgb is off in the processor settings"
        ));
    }
    // 16-bit samples: Pillow keeps the high byte of RGB(A) and gray+alpha; 16-bit grayscale
    // opens as mode "I;16" and its conversion to RGB clips at 255. Opaque pixels go through
    // `blend` unchanged, so every format takes the same path.
    let hi = |v: u16| (v >> 8) as u8;
    let n = width * height;
    let pixels = match img {
        D::ImageRgb8(b) => blend_all(b.pixels().map(|p| [p[0], p[1], p[2], 255]), n, blend),
        D::ImageRgba8(b) => blend_all(b.pixels().map(|p| p.0), n, blend),
        D::ImageLuma8(b) => blend_all(b.pixels().map(|p| [p[0], p[0], p[0], 255]), n, blend),
        D::ImageLumaA8(b) => blend_all(b.pixels().map(|p| [p[0], p[0], p[0], p[1]]), n, blend),
        D::ImageRgb16(b) => blend_all(
            b.pixels().map(|p| [hi(p[0]), hi(p[1]), hi(p[2]), 255]),
            n,
            blend,
        ),
        D::ImageRgba16(b) => blend_all(
            b.pixels().map(|p| [hi(p[0]), hi(p[1]), hi(p[2]), hi(p[3])]),
            n,
            blend,
        ),
        D::ImageLuma16(b) => blend_all(
            b.pixels().map(|p| {
                let v = p[0].min(255) as u8;
                [v, v, v, 255]
            }),
            n,
            blend,
        ),
        D::ImageLumaA16(b) => blend_all(
            b.pixels().map(|p| [hi(p[0]), hi(p[0]), hi(p[0]), hi(p[1])]),
            n,
            blend,
        ),
        _ => return Err(format!("has an unsupported pixel format {kind}")),
    };
    Ok(RgbImage {
        height,
        width,
        pixels,
    })
}

/// `n` RGBA pixels → `[n, 3]` RGB8, each made RGB by `blend`.
fn blend_all(
    rgba: impl Iterator<Item = [u8; 4]>,
    n: usize,
    blend: fn([u8; 4]) -> [u8; 3],
) -> Vec<u8> {
    let mut pixels = Vec::with_capacity(n * 3);
    for px in rgba {
        pixels.extend_from_slice(&blend(px));
    }
    pixels
}

/// One RGBA pixel laid over an opaque white background, as Pillow's `alpha_composite` does.
pub fn composite_over_white(px: [u8; 4]) -> [u8; 3] {
    match px[3] {
        0 => [255; 3],
        // what the arithmetic gives for every value (checked by a test)
        255 => [px[0], px[1], px[2]],
        _ => pillow_over_white(px),
    }
}

/// Pillow's `alpha_composite` integer arithmetic over opaque white: 7 extra bits of precision,
/// divisions by 255 done by shifts.
fn pillow_over_white(px: [u8; 4]) -> [u8; 3] {
    const PRECISION_BITS: u32 = 7;
    let a = u32::from(px[3]);
    // with an opaque background, out_alpha·255 = a·255 + 255·(255 - a) = 255²
    let out_a255 = a * 255 + 255 * (255 - a);
    let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / out_a255;
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    let blend = |s: u8| {
        let t = u32::from(s) * coef1 + 255 * coef2 + (0x80 << PRECISION_BITS);
        ((((t >> 8) + t) >> 8) >> PRECISION_BITS) as u8
    };
    [blend(px[0]), blend(px[1]), blend(px[2])]
}

/// The taps of one axis of the resize: for output `i`, input `start[i]..start[i] + len[i]`
/// weighted by `weights[i * stride..][..len[i]]`, int16 with `precision` fractional bits.
struct Taps {
    start: Vec<usize>,
    len: Vec<usize>,
    stride: usize,
    weights: Vec<i16>,
    precision: u32,
}

/// Keys' cubic kernel with `a = -0.5` (the antialiased filter of torch and Pillow).
fn cubic_aa(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

/// torch's antialiased bicubic taps of one axis for uint8 images: f64 weights of the kernel
/// stretched by the reduction factor, each output's weights normalised to sum 1, then
/// quantised to int16 with the most fractional bits that keep the largest weight below 2^15.
fn bicubic_taps(in_size: usize, out_size: usize) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
    let stride = support.ceil() as usize * 2 + 1;
    let inv_scale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let mut start = Vec::with_capacity(out_size);
    let mut len = Vec::with_capacity(out_size);
    let mut wf = vec![0f64; out_size * stride];
    let mut wt_max = 0f64;
    for i in 0..out_size {
        let center = scale * (i as f64 + 0.5);
        // C++ float → int64 casts truncate toward zero
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
        let xsize = (xmax - xmin).clamp(0, stride as i64) as usize;
        let w = &mut wf[i * stride..(i + 1) * stride];
        let mut total = 0f64;
        for (j, wj) in w.iter_mut().enumerate().take(xsize) {
            *wj = cubic_aa(((j as i64 + xmin) as f64 - center + 0.5) * inv_scale);
            total += *wj;
        }
        if total != 0.0 {
            for wj in w.iter_mut().take(xsize) {
                *wj /= total;
                wt_max = wt_max.max(*wj);
            }
        }
        start.push(xmin as usize);
        len.push(xsize);
    }
    let mut precision = 0u32;
    while precision < 22 {
        let next = (0.5 + wt_max * f64::from(1i32 << (precision + 1))) as i32;
        if next >= 1 << 15 {
            break;
        }
        precision += 1;
    }
    let unit = f64::from(1i32 << precision);
    let weights = wf
        .iter()
        .map(|&w| {
            let v = w * unit;
            (if v < 0.0 {
                (v - 0.5) as i32
            } else {
                (v + 0.5) as i32
            }) as i16
        })
        .collect();
    Taps {
        start,
        len,
        stride,
        weights,
        precision,
    }
}

/// One output sample: the rounded, clamped fixed-point sum of `len` inputs `step` apart.
#[inline]
fn tap_sum(src: &[u8], first: usize, step: usize, w: &[i16], precision: u32) -> u8 {
    let mut acc: i32 = 1 << (precision - 1);
    for (j, &wj) in w.iter().enumerate() {
        acc = acc.wrapping_add(i32::from(src[first + j * step]) * i32::from(wj));
    }
    (acc >> precision).clamp(0, 255) as u8
}

/// torchvision's `resize(..., BICUBIC, antialias=True)` of a uint8 `[C, H, W]` image on the CPU
/// → `[C, out_h, out_w]`: the width pass first (if the width changes), then the height pass (if
/// the height changes), each with its own int16 taps, a uint8 image in between.
pub fn resize_bicubic_antialias(
    src: &[u8],
    channels: usize,
    height: usize,
    width: usize,
    out_h: usize,
    out_w: usize,
) -> Result<Vec<u8>, String> {
    if src.len() != channels * height * width || height == 0 || width == 0 {
        return Err(format!(
            "cannot resize {} bytes as a [{channels}, {height}, {width}] image",
            src.len()
        ));
    }
    if out_h == 0 || out_w == 0 {
        return Err(format!("cannot resize to {out_h}x{out_w}"));
    }
    let mut cur = src.to_vec();
    if out_w != width {
        let taps = bicubic_taps(width, out_w);
        // [C·H, W] → [C·H, out_w]
        let mut next = Vec::with_capacity(channels * height * out_w);
        for row in cur.chunks_exact(width) {
            for x in 0..out_w {
                let w = &taps.weights[x * taps.stride..][..taps.len[x]];
                next.push(tap_sum(row, taps.start[x], 1, w, taps.precision));
            }
        }
        cur = next;
    }
    if out_h != height {
        let taps = bicubic_taps(height, out_h);
        // [C, H, out_w] → [C, out_h, out_w]
        let mut next = Vec::with_capacity(channels * out_h * out_w);
        for plane in cur.chunks_exact(height * out_w) {
            for y in 0..out_h {
                let w = &taps.weights[y * taps.stride..][..taps.len[y]];
                let first = taps.start[y] * out_w;
                for x in 0..out_w {
                    next.push(tap_sum(plane, first + x, out_w, w, taps.precision));
                }
            }
        }
        cur = next;
    }
    Ok(cur)
}

/// qwen-vl-utils 0.0.14's `fetch_image` on an image's bytes, as verl's `process_image` calls it
/// for a dataset image (`{"bytes": ...}` opened with Pillow): the image as Pillow opens it, made
/// RGB by qwen-vl-utils' `to_rgb`, then resized with Pillow's default bicubic filter
/// ([`resize_pil_bicubic`]) to the size [`fetch_smart_resize`] picks for
/// `factor = 2 · image_patch_size`. `min_pixels` / `max_pixels` are the entry's own keys; absent,
/// qwen-vl-utils uses `4 · factor²` and `16384 · factor²`.
///
/// `to_rgb` lays only Pillow's mode "RGBA" over white (PNG colour type 6, WebP or BMP with
/// alpha), by `paste` with the alpha band as mask ([`paste_over_white`]). Every other mode goes
/// through Pillow's `convert("RGB")`, which ignores transparency: gray + alpha, palettes with
/// tRNS, colour keys of gray / RGB PNGs and GIF transparent indexes keep their own colour.
///
/// The result is the image as the processor then sees it, `do_convert_rgb` on (every Qwen-VL
/// release): Pillow keeps a gray, RGB or single palette-entry key in the RGB image's `info`, and
/// transformers' `convert_to_rgb` turns the pixels equal to it white, after the resize (see
/// [`fetch_image_with_key`] for qwen-vl-utils' output itself).
pub fn fetch_image(
    bytes: &[u8],
    image_patch_size: usize,
    min_pixels: Option<u64>,
    max_pixels: Option<u64>,
) -> Result<RgbImage, String> {
    let (mut image, key) = fetch_image_with_key(bytes, image_patch_size, min_pixels, max_pixels)?;
    if let Some(key) = key {
        whiten_key(&mut image, key);
    }
    Ok(image)
}

/// qwen-vl-utils' `fetch_image` exactly (see [`fetch_image`]), and the transparent colour Pillow
/// keeps in the result's `info["transparency"]` (a gray, RGB or single-entry palette key of a
/// PNG, a GIF's transparent index), which transformers' `convert_to_rgb` applies: with
/// `do_convert_rgb` off the processor ignores it, and the image is used as it is.
pub fn fetch_image_with_key(
    bytes: &[u8],
    image_patch_size: usize,
    min_pixels: Option<u64>,
    max_pixels: Option<u64>,
) -> Result<(RgbImage, Option<[u8; 3]>), String> {
    if image_patch_size == 0 {
        return Err("image_patch_size must be positive".into());
    }
    let factor = 2 * image_patch_size;
    let area = (factor as u64).saturating_mul(factor as u64);
    let min_pixels = min_pixels.unwrap_or(area.saturating_mul(4));
    let max_pixels = max_pixels.unwrap_or(area.saturating_mul(16384));
    let decoded = decode_any(bytes)?;
    let blend = if pillow_opens_rgba(bytes, &decoded) {
        paste_over_white
    } else {
        drop_alpha
    };
    let image = to_rgb8(decoded, true, blend)?;
    let (h, w) = fetch_smart_resize(image.height, image.width, factor, min_pixels, max_pixels)?;
    if h == 0 || w == 0 {
        return Err(format!(
            "is {}x{}: qwen-vl-utils' smart_resize gives {h}x{w} for max_pixels = {max_pixels}, \
             and Pillow refuses to resize to it (height and width must be > 0)",
            image.height, image.width
        ));
    }
    let key = TransparencyKeys::of(bytes).fetched;
    Ok((resize_pil_bicubic(&image, w, h), key))
}

/// The transparent colour of an image without an alpha band (a PNG's tRNS key or single
/// transparent palette entry, a GIF's transparent index), as transformers' `convert_to_rgb`
/// compares pixels with it: Pillow keeps it in `info["transparency"]`, and `convert("RGBA")`
/// makes the pixels equal to it transparent, which the compositing turns white. Pillow matches
/// only each value's low byte, and a bare number `n` as the colour `(n, 0, 0)` (the C side reads
/// it as red).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct TransparencyKeys {
    /// On the image as Pillow opens it (transformers' own decoding path, [`decode_image`]), where
    /// it differs from the decoder's alpha: gray and RGB PNGs (Pillow compares the raw tRNS value
    /// with 2- and 4-bit gray already scaled to 8 bits, and the low byte of a 16-bit key with
    /// the high byte of each sample).
    opened: Option<[u8; 3]>,
    /// On the RGB image qwen-vl-utils' `fetch_image` returns: `convert("RGB")` turns the key of
    /// "L" and "P" images into a colour, keeps "1" and "I;16" keys as numbers, drops
    /// partial palette alphas.
    fetched: Option<[u8; 3]>,
}

impl TransparencyKeys {
    /// The keys of PNG and GIF bytes; none for other formats, or when the header has none.
    fn of(bytes: &[u8]) -> Self {
        match ::image::guess_format(bytes) {
            Ok(::image::ImageFormat::Png) => png_keys(bytes).unwrap_or_default(),
            Ok(::image::ImageFormat::Gif) => Self {
                opened: None,
                fetched: gif_key(bytes),
            },
            _ => Self::default(),
        }
    }
}

/// Pixels equal to `key` become white (Pillow's compositing of a zero alpha over white).
fn whiten_key(image: &mut RgbImage, key: [u8; 3]) {
    for px in image.pixels.chunks_exact_mut(3) {
        if px == key {
            px.copy_from_slice(&[255; 3]);
        }
    }
}

/// A PNG's chunks before its image data: `(type, data)`, stopping at a malformed one.
fn png_chunks(bytes: &[u8]) -> Vec<([u8; 4], &[u8])> {
    let mut out = Vec::new();
    let mut pos = 8;
    while let Some(head) = bytes.get(pos..pos + 8) {
        let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let kind = [head[4], head[5], head[6], head[7]];
        let Some(data) = bytes.get(pos + 8..(pos + 8).saturating_add(len)) else {
            break;
        };
        if &kind == b"IDAT" || &kind == b"IEND" {
            break;
        }
        out.push((kind, data));
        pos += 12 + len;
    }
    out
}

/// A PNG's transparency keys (see [`TransparencyKeys`]) from its IHDR, PLTE and tRNS chunks, as
/// Pillow's PNG plugin records tRNS: mode "1" as 0 or 255, "L" and "I;16" as the raw 16-bit
/// value, RGB as three raw values, a palette as the index of its one transparent entry when
/// every other entry is opaque (and otherwise as per-entry alphas, which `convert("RGB")` drops).
fn png_keys(bytes: &[u8]) -> Option<TransparencyKeys> {
    let chunks = png_chunks(bytes);
    let find = |kind: &[u8; 4]| chunks.iter().find(|c| &c.0 == kind).map(|c| c.1);
    let (ihdr, trns) = (find(b"IHDR")?, find(b"tRNS")?);
    let (depth, color) = (*ihdr.get(8)?, *ihdr.get(9)?);
    let word = |k: usize| {
        trns.get(2 * k..2 * k + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
    };
    // `as u8` keeps the low byte, as Pillow's C side does
    let keys = |opened: [u8; 3], fetched: [u8; 3]| TransparencyKeys {
        opened: Some(opened),
        fetched: Some(fetched),
    };
    Some(match (color, depth) {
        (0, 1) => {
            let k = if word(0)? != 0 { 255 } else { 0 };
            keys([k; 3], [k, 0, 0])
        }
        (0, 16) => {
            let t = word(0)? as u8;
            keys([t; 3], [t, 0, 0])
        }
        (0, _) => {
            let t = u8::try_from(word(0)?).ok()?;
            keys([t; 3], [t; 3])
        }
        (2, _) => {
            let rgb = [word(0)? as u8, word(1)? as u8, word(2)? as u8];
            keys(rgb, rgb)
        }
        (3, _) => {
            // Pillow's `^\xff*\x00\xff*$` (whose `$` also matches before a final newline)
            let body = trns.strip_suffix(b"\n").unwrap_or(trns);
            let simple = trns.iter().filter(|&&a| a == 0).count() == 1
                && body.iter().all(|&a| a == 0 || a == 255);
            let i = trns.iter().position(|&a| a == 0)?;
            let color = find(b"PLTE")?.get(3 * i..3 * i + 3)?;
            TransparencyKeys {
                opened: None,
                fetched: simple.then(|| [color[0], color[1], color[2]]),
            }
        }
        _ => return None,
    })
}

/// The colour of a GIF's transparent index in its first frame (the last graphic control
/// extension before the first image that sets one, the frame's local colour table or else the
/// global one), which Pillow keeps as `info["transparency"]` through `convert("RGB")`. A
/// palette that Pillow opens as mode "L" (entry `i` is gray `i`) gives gray `t`.
fn gif_key(bytes: &[u8]) -> Option<[u8; 3]> {
    let table_len = |flags: u8| 3usize << ((flags & 7) + 1);
    let flags = *bytes.get(10)?;
    let mut pos = 13;
    let mut palette = None;
    if flags & 0x80 != 0 {
        palette = Some(bytes.get(pos..pos + table_len(flags))?);
        pos += table_len(flags);
    }
    let mut index = None;
    loop {
        match *bytes.get(pos)? {
            0x21 => {
                let label = *bytes.get(pos + 1)?;
                pos += 2;
                if label == 0xF9 && *bytes.get(pos)? >= 4 && bytes.get(pos + 1)? & 1 != 0 {
                    index = Some(usize::from(*bytes.get(pos + 4)?));
                }
                loop {
                    let n = usize::from(*bytes.get(pos)?);
                    pos += 1 + n;
                    if n == 0 {
                        break;
                    }
                }
            }
            0x2C => {
                let local = *bytes.get(pos + 9)?;
                if local & 0x80 != 0 {
                    palette = Some(bytes.get(pos + 10..pos + 10 + table_len(local))?);
                }
                let (t, palette) = (index?, palette?);
                let gray = palette
                    .chunks_exact(3)
                    .enumerate()
                    .all(|(i, c)| usize::from(c[0]) == i && c[0] == c[1] && c[1] == c[2]);
                if gray {
                    return u8::try_from(t).ok().map(|t| [t; 3]);
                }
                let c = palette.get(3 * t..3 * t + 3)?;
                return Some([c[0], c[1], c[2]]);
            }
            _ => return None,
        }
    }
}

/// Whether Pillow opens these bytes in mode "RGBA": PNGs by their header's colour type (6; a
/// palette, gray or RGB PNG with tRNS keeps its own mode, which the image crate expands to
/// alpha), GIFs never (mode "P" or "L"), other formats when the decoder returns an alpha channel.
fn pillow_opens_rgba(bytes: &[u8], decoded: &::image::DynamicImage) -> bool {
    if !decoded.color().has_alpha() {
        return false;
    }
    match ::image::guess_format(bytes) {
        // signature (8) + chunk length (4) + "IHDR" + width, height (8) + bit depth (1)
        Ok(::image::ImageFormat::Png) => bytes.get(25) == Some(&6),
        Ok(::image::ImageFormat::Gif) => false,
        _ => true,
    }
}

/// Pillow's `convert("RGB")` of a pixel whose mode has transparency: the alpha is dropped.
fn drop_alpha(px: [u8; 4]) -> [u8; 3] {
    [px[0], px[1], px[2]]
}

/// One RGBA pixel pasted onto white with its alpha as the mask, as Pillow's `paste(im, mask=a)`
/// blends: `(c·a + 255·(255 − a)) / 255` per channel, the division by 255 done as Pillow does it
/// (add 128, then `((t >> 8) + t) >> 8`). Over white it gives what [`composite_over_white`]
/// gives, for every value and alpha (tested); it is kept as Pillow runs it.
pub fn paste_over_white(px: [u8; 4]) -> [u8; 3] {
    let a = u32::from(px[3]);
    let blend = |c: u8| {
        let t = u32::from(c) * a + 255 * (255 - a) + 128;
        (((t >> 8) + t) >> 8) as u8
    };
    [blend(px[0]), blend(px[1]), blend(px[2])]
}

/// qwen-vl-utils' `smart_resize` → `(height, width)`, multiples of `factor`. Unlike
/// transformers' [`smart_resize`] it checks `max_pixels >= min_pixels` (an assertion there), and
/// when reducing it floors each side to a multiple of `factor` without keeping at least one
/// `factor`, so a side can come out 0 (Pillow then refuses the resize, see [`fetch_image`]).
/// Refuses aspect ratios above 200 and a zero `max_pixels` (a division by zero there).
pub fn fetch_smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(usize, usize), String> {
    if max_pixels < min_pixels {
        return Err(format!(
            "max_pixels = {max_pixels} is below min_pixels = {min_pixels}: the max_pixels of \
             image must be greater than or equal to min_pixels"
        ));
    }
    if height == 0 || width == 0 || factor == 0 {
        return Err(format!(
            "cannot resize a {height}x{width} image to multiples of {factor}"
        ));
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(format!(
            "is {height}x{width}: absolute aspect ratio must be smaller than 200, got {ratio:?}"
        ));
    }
    let fu = factor as u64;
    let mut h_bar = fu.max((h / f).round_ties_even() as u64 * fu);
    let mut w_bar = fu.max((w / f).round_ties_even() as u64 * fu);
    let pixels = (height as u64) * (width as u64);
    if h_bar.saturating_mul(w_bar) > max_pixels {
        if max_pixels == 0 {
            return Err(format!(
                "is {height}x{width}: max_pixels is 0, which qwen-vl-utils divides by"
            ));
        }
        let beta = (pixels as f64 / max_pixels as f64).sqrt();
        h_bar = (h / beta / f).floor() as u64 * fu;
        w_bar = (w / beta / f).floor() as u64 * fu;
    } else if h_bar.saturating_mul(w_bar) < min_pixels {
        let beta = (min_pixels as f64 / pixels as f64).sqrt();
        h_bar = (h * beta / f).ceil() as u64 * fu;
        w_bar = (w * beta / f).ceil() as u64 * fu;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// Fractional bits of Pillow's fixed-point coefficients for 8-bit images: 32 bits less 8 for
/// the sample and 2 of headroom for sums outside `[0, 1]` (the kernel has negative lobes).
const PIL_PRECISION_BITS: u32 = 22;

/// The taps of one axis of Pillow's resampling: output `i` reads inputs
/// `start[i]..start[i] + len[i]`, weighted by `coeffs[i * ksize..][..len[i]]`.
struct PilTaps {
    start: Vec<usize>,
    len: Vec<usize>,
    ksize: usize,
    coeffs: Vec<i32>,
}

/// Pillow's bicubic kernel (`a = -0.5`), its outer lobe evaluated in Pillow's own order
/// (`(((x - 5)·x + 8)·x - 4)·a`, not torch's), which the f64 weights depend on.
fn pil_bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Pillow's bicubic taps from `in_size` to `out_size` samples over the whole axis: the kernel
/// stretched by the reduction factor (never narrowed when enlarging), each output's f64 weights
/// normalised to sum 1, then rounded half away from zero to [`PIL_PRECISION_BITS`] bits.
fn pil_bicubic_taps(in_size: usize, out_size: usize) -> PilTaps {
    // the box edges are C floats: `(double)(in1 - in0) / outSize`
    let scale = f64::from(in_size as f32) / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let inv_filterscale = 1.0 / filterscale;
    let unit = f64::from(1u32 << PIL_PRECISION_BITS);
    let mut taps = PilTaps {
        start: Vec::with_capacity(out_size),
        len: Vec::with_capacity(out_size),
        ksize,
        coeffs: vec![0; out_size * ksize],
    };
    let mut k = vec![0f64; ksize];
    for i in 0..out_size {
        let center = (i as f64 + 0.5) * scale;
        // C's (int) casts truncate toward zero
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
        let n = (xmax - xmin).clamp(0, ksize as i64) as usize;
        let mut total = 0f64;
        for (j, kj) in k.iter_mut().enumerate().take(n) {
            *kj = pil_bicubic(((j as i64 + xmin) as f64 - center + 0.5) * inv_filterscale);
            total += *kj;
        }
        let row = &mut taps.coeffs[i * ksize..(i + 1) * ksize];
        for (c, &kj) in row.iter_mut().zip(&k[..n]) {
            let kj = if total != 0.0 { kj / total } else { kj };
            *c = if kj < 0.0 {
                (-0.5 + kj * unit) as i32
            } else {
                (0.5 + kj * unit) as i32
            };
        }
        taps.start.push(xmin as usize);
        taps.len.push(n);
    }
    taps
}

/// Pillow's `clip8`: the fixed-point sum's integer part, clamped to `0..=255` (its lookup table
/// holds exactly that for the sums a bicubic pass can reach).
#[inline]
fn pil_clip8(acc: i32) -> u8 {
    (acc >> PIL_PRECISION_BITS).clamp(0, 255) as u8
}

/// Pillow's horizontal pass: `[rows, in_w, 3]` → `[rows, out_w, 3]`.
fn pil_horizontal(src: &[u8], in_w: usize, taps: &PilTaps) -> Vec<u8> {
    let out_w = taps.len.len();
    let mut out = Vec::with_capacity(src.len() / (3 * in_w) * out_w * 3);
    for row in src.chunks_exact(3 * in_w) {
        for x in 0..out_w {
            let k = &taps.coeffs[x * taps.ksize..][..taps.len[x]];
            let mut acc = [1i32 << (PIL_PRECISION_BITS - 1); 3];
            for (px, &kj) in row[3 * taps.start[x]..].chunks_exact(3).zip(k) {
                for (a, &v) in acc.iter_mut().zip(px) {
                    *a = a.wrapping_add(i32::from(v).wrapping_mul(kj));
                }
            }
            out.extend(acc.map(pil_clip8));
        }
    }
    out
}

/// Pillow's vertical pass: `[in_h, row_len]` → `[out_h, row_len]` (`row_len = 3 · width`).
fn pil_vertical(src: &[u8], row_len: usize, taps: &PilTaps) -> Vec<u8> {
    let out_h = taps.len.len();
    let mut out = Vec::with_capacity(out_h * row_len);
    let mut acc = vec![0i32; row_len];
    for y in 0..out_h {
        acc.fill(1 << (PIL_PRECISION_BITS - 1));
        let k = &taps.coeffs[y * taps.ksize..][..taps.len[y]];
        for (j, &kj) in k.iter().enumerate() {
            let row = &src[(taps.start[y] + j) * row_len..][..row_len];
            for (a, &v) in acc.iter_mut().zip(row) {
                *a = a.wrapping_add(i32::from(v).wrapping_mul(kj));
            }
        }
        out.extend(acc.iter().map(|&a| pil_clip8(a)));
    }
    out
}

/// Pillow 13's `Image.resize((width, height))` of an RGB image with its default filter, BICUBIC
/// (`ImagingResample` on 8-bit samples), bit for bit: separable passes with fixed-point taps
/// ([`pil_bicubic_taps`]), each rounded and clipped to uint8. Only the axes whose size changes
/// are resampled; the vertical pass runs first when the height shrinks by more than twice as
/// many pixels as the width does, the horizontal one first otherwise (Pillow limits that first
/// pass to the rows the second reads, which for the whole image is all of them).
///
/// The same size returns a copy, as Pillow does. A zero output side gives an empty image (Pillow
/// refuses it; [`fetch_image`] checks first), and an input without pixels, or whose buffer is
/// not `3 · height · width` bytes, gives black, what Pillow's taps give for no input samples.
pub fn resize_pil_bicubic(img: &RgbImage, width: usize, height: usize) -> RgbImage {
    let (in_h, in_w) = (img.height, img.width);
    if (height, width) == (in_h, in_w) {
        return img.clone();
    }
    let black = || RgbImage {
        height,
        width,
        pixels: vec![0; 3 * height * width],
    };
    if in_h == 0 || in_w == 0 || img.pixels.len() != 3 * in_h * in_w {
        return black();
    }
    if height == 0 || width == 0 {
        return black();
    }
    let horizontal = |src: &[u8]| pil_horizontal(src, in_w, &pil_bicubic_taps(in_w, width));
    let vertical = |src: &[u8], w: usize| pil_vertical(src, 3 * w, &pil_bicubic_taps(in_h, height));
    let shrink_h = in_h as i64 - height as i64;
    let shrink_w = in_w as i64 - width as i64;
    let vertical_first = shrink_h > 0 && shrink_h > 2 * shrink_w;
    let pixels = match (width != in_w, height != in_h) {
        (true, false) => horizontal(&img.pixels),
        (false, _) => vertical(&img.pixels, in_w),
        (true, true) if vertical_first => horizontal(&vertical(&img.pixels, in_w)),
        (true, true) => vertical(&horizontal(&img.pixels), width),
    };
    RgbImage {
        height,
        width,
        pixels,
    }
}

/// Repeats each `image_token` of `prompt` as many times as its image has placeholder tokens
/// (`tokens_per_image[i]` for the i-th occurrence), as the Qwen-VL processors expand a rendered
/// prompt. The number of occurrences must equal the number of images.
pub fn expand_image_placeholders(
    prompt: &str,
    image_token: &str,
    tokens_per_image: &[usize],
) -> Result<String, DataError> {
    if image_token.is_empty() {
        return Err(DataError::Other(
            "the image placeholder token is empty".into(),
        ));
    }
    let found = prompt.matches(image_token).count();
    if found != tokens_per_image.len() {
        return Err(DataError::Other(format!(
            "the prompt has {found} image placeholder(s) `{image_token}` but {} image(s) were given",
            tokens_per_image.len()
        )));
    }
    let extra: usize = tokens_per_image.iter().map(|n| n.saturating_sub(1)).sum();
    let mut out = String::with_capacity(prompt.len() + extra * image_token.len());
    let mut counts = tokens_per_image.iter();
    let mut rest = prompt;
    while let Some(at) = rest.find(image_token) {
        out.push_str(&rest[..at]);
        let n = counts.next().copied().unwrap_or(0);
        for _ in 0..n {
            out.push_str(image_token);
        }
        rest = &rest[at + image_token.len()..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
#[path = "image_tests.rs"]
mod tests;
