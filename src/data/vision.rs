//! Vision-language rows, as verl's `RLHFDataset` reads them (`verl/utils/dataset/rl_dataset.py`,
//! `_build_messages`): the row's images (column `data.image_key`, in order) fill the `<image>`
//! markers of its prompt's messages, which become the chat template's content lists
//! (`[{"type": "image"}, {"type": "text", "text": ..}]`); the images are decoded, resized and
//! patchified by [`super::image`], and each rendered image placeholder is repeated once per
//! merged patch.
//!
//! An image entry is what verl accepts: `{"bytes": ..}` (verl's geo3k parquet: a struct of
//! binary bytes and a path; parquet binary reads as hex text), `{"path": ..}` or `{"image": ..}`
//! naming a file, a plain path string (`file://` allowed), or an array of byte values. A dict's
//! own `min_pixels` / `max_pixels` bound that image's first resize, as qwen-vl-utils reads them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::image::{ImageBatch, ImageProcessorConfig, RgbImage, IMAGE_PAD_TOKEN};
use super::read::kind;

/// How a dataset's images are read and processed.
#[derive(Debug, Clone)]
pub struct VisionOptions {
    /// `data.image_key`.
    pub image_key: String,
    /// `data.video_key`: a row with videos is refused.
    pub video_key: String,
    /// The model folder's `preprocessor_config.json` (with `data.mm_processor_kwargs` applied).
    pub processor: ImageProcessorConfig,
    /// `data.image_patch_size`: with the 2×2 merge, the multiple of qwen-vl-utils' first resize.
    pub image_patch_size: usize,
    /// Where relative image paths are found from (the data file's folder, then the working
    /// directory, as verl's readers resolve them from the working directory).
    pub base_dir: Option<PathBuf>,
}

/// One image of a row, before decoding.
#[derive(Debug, Clone, PartialEq)]
pub enum ImageSource {
    Bytes(Vec<u8>),
    Path(PathBuf),
}

/// One image entry: where its bytes are, and its own pixel bounds.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageEntry {
    pub source: ImageSource,
    pub min_pixels: Option<u64>,
    pub max_pixels: Option<u64>,
}

/// The image entries of a row's `key` column (absent or null: none). Errors say which entry
/// and why.
pub fn image_entries(row: &Value, key: &str) -> Result<Vec<ImageEntry>, String> {
    let items = match row.get(key) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(other) => return Err(format!("expected a list of images, found {}", kind(other))),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| entry(v).map_err(|e| format!("image {i}: {e}")))
        .collect()
}

fn entry(v: &Value) -> Result<ImageEntry, String> {
    let plain = |source| ImageEntry {
        source,
        min_pixels: None,
        max_pixels: None,
    };
    match v {
        Value::String(s) => Ok(plain(ImageSource::Path(path_of(s)))),
        Value::Array(_) => Ok(plain(ImageSource::Bytes(byte_array(v)?))),
        Value::Object(o) => {
            let bound = |k: &str| -> Result<Option<u64>, String> {
                match o.get(k) {
                    None | Some(Value::Null) => Ok(None),
                    Some(x) => x
                        .as_u64()
                        .filter(|&n| n > 0)
                        .map(Some)
                        .ok_or(format!("`{k}` must be a positive integer, found {x}")),
                }
            };
            let source = match (o.get("bytes"), o.get("image"), o.get("path")) {
                (Some(b), _, _) if !b.is_null() => ImageSource::Bytes(bytes_of(b)?),
                (_, Some(Value::String(p)), _) | (_, _, Some(Value::String(p))) => {
                    ImageSource::Path(path_of(p))
                }
                _ => {
                    return Err(format!(
                        "an image entry needs `bytes`, `image` or `path`; found keys {:?}",
                        o.keys().collect::<Vec<_>>()
                    ))
                }
            };
            Ok(ImageEntry {
                source,
                min_pixels: bound("min_pixels")?,
                max_pixels: bound("max_pixels")?,
            })
        }
        other => Err(format!(
            "expected an image (bytes, a path or an object with `bytes`/`path`), found {}",
            kind(other)
        )),
    }
}

/// `file://` dropped.
fn path_of(s: &str) -> PathBuf {
    PathBuf::from(s.strip_prefix("file://").unwrap_or(s))
}

/// The bytes of a `bytes` field: hex text (a parquet binary column as read here) or an array
/// of byte values.
fn bytes_of(v: &Value) -> Result<Vec<u8>, String> {
    match v {
        Value::String(s) => hex(s).ok_or_else(|| {
            "`bytes` is text that is not hex-encoded binary (parquet binary columns read as hex; in JSON give a path or an array of byte values)".to_string()
        }),
        Value::Array(_) => byte_array(v),
        other => Err(format!("`bytes` must be binary, found {}", kind(other))),
    }
}

fn hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn byte_array(v: &Value) -> Result<Vec<u8>, String> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|x| {
            x.as_u64()
                .filter(|&b| b < 256)
                .map(|b| b as u8)
                .ok_or(format!("a byte array holds {x}, not a value in 0..=255"))
        })
        .collect()
}

/// `messages` with each string content holding `<image>` markers split into a content list
/// (text pieces and `{"type": "image"}` items, empty pieces dropped, as verl splits them) when
/// the row has images; with `images` = 0 the messages are returned as they are. The markers
/// must number `images` exactly. A `<video>` marker is refused.
pub fn messages_with_images(messages: &[Value], images: usize) -> Result<Vec<Value>, String> {
    if images == 0 {
        if let Some(i) = messages.iter().position(|m| content_has(m, "<image>")) {
            return Err(format!(
                "message {i} has an <image> marker but the row has no images"
            ));
        }
        return Ok(messages.to_vec());
    }
    let mut seen = 0;
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if content_has(m, "<video>") {
            return Err(format!(
                "message {i} has a <video> marker: video input is not supported"
            ));
        }
        let Some(text) = m.get("content").and_then(Value::as_str) else {
            out.push(m.clone());
            continue;
        };
        let mut parts = Vec::new();
        for (k, piece) in text.split("<image>").enumerate() {
            if k > 0 {
                parts.push(serde_json::json!({"type": "image"}));
                seen += 1;
            }
            if !piece.is_empty() {
                parts.push(serde_json::json!({"type": "text", "text": piece}));
            }
        }
        let mut m = m.clone();
        m["content"] = Value::Array(parts);
        out.push(m);
    }
    if seen != images {
        return Err(format!(
            "the prompt has {seen} <image> marker(s) but the row has {images} image(s); each image fills one marker, in order"
        ));
    }
    Ok(out)
}

fn content_has(m: &Value, marker: &str) -> bool {
    m.get("content")
        .and_then(Value::as_str)
        .is_some_and(|c| c.contains(marker))
}

impl VisionOptions {
    /// The bytes of `source`, a relative path found from [`VisionOptions::base_dir`] first.
    fn read(&self, source: &ImageSource) -> Result<Vec<u8>, String> {
        match source {
            ImageSource::Bytes(b) => Ok(b.clone()),
            ImageSource::Path(p) => {
                let candidates: Vec<PathBuf> = match (&self.base_dir, p.is_relative()) {
                    (Some(d), true) => vec![d.join(p), p.clone()],
                    _ => vec![p.clone()],
                };
                let found = candidates.iter().find(|c| c.is_file());
                let path = found
                    .ok_or_else(|| format!("image file {} not found", display(&candidates)))?;
                std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
            }
        }
    }

    /// A row's images decoded, given qwen-vl-utils' first resize (to multiples of
    /// `2 · image_patch_size` within the entry's pixel bounds, Pillow's bicubic filter, as
    /// verl's `process_image` asks it) and processed as the model's processor does.
    pub fn process(&self, entries: &[ImageEntry]) -> Result<ImageBatch, String> {
        let mut decoded: Vec<RgbImage> = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let bytes = self
                .read(&e.source)
                .map_err(|m| format!("image {i}: {m}"))?;
            let img = super::image::fetch_image(
                &bytes,
                self.image_patch_size,
                e.min_pixels,
                e.max_pixels,
            )
            .map_err(|m| format!("image {i}: {m}"))?;
            decoded.push(img);
        }
        self.processor
            .preprocess(&decoded)
            .map_err(|e| e.to_string())
    }

    /// `rendered` (a prompt through the chat template) with each image placeholder repeated
    /// once per merged patch of its image in `batch`.
    pub fn expand(&self, rendered: &str, batch: &ImageBatch) -> Result<String, String> {
        let counts: Vec<usize> = batch
            .grid_thw
            .iter()
            .map(|&g| self.processor.num_image_tokens(g))
            .collect();
        super::image::expand_image_placeholders(rendered, IMAGE_PAD_TOKEN, &counts)
            .map_err(|e| e.to_string())
    }
}

fn display(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(" or ")
}

/// Whether `dir` is a vision-language model's folder: it holds the image processor's settings.
pub fn has_processor(dir: &Path) -> bool {
    dir.join(super::image::PREPROCESSOR_CONFIG).is_file()
}

/// A dataset's processed images, one entry per row (`None`: a row without images).
pub type RowImageBatches = Vec<Option<Arc<ImageBatch>>>;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// verl's `_build_messages` by hand: `<image>` markers split the content (empty pieces
    /// dropped), image items in order; markers and images must agree in number.
    #[test]
    fn image_markers_become_content_items() {
        let msgs = vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "<image>What is x? Compare <image> please"}),
        ];
        let out = messages_with_images(&msgs, 2).unwrap();
        assert_eq!(
            out[0]["content"],
            json!([{"type": "text", "text": "Be brief."}])
        );
        assert_eq!(
            out[1]["content"],
            json!([
                {"type": "image"},
                {"type": "text", "text": "What is x? Compare "},
                {"type": "image"},
                {"type": "text", "text": " please"}
            ])
        );
        assert!(messages_with_images(&msgs, 1)
            .unwrap_err()
            .contains("2 <image> marker(s) but the row has 1"));
        assert!(messages_with_images(&msgs, 0)
            .unwrap_err()
            .contains("message 1 has an <image> marker"));
        let plain = vec![json!({"role": "user", "content": "no images"})];
        assert_eq!(messages_with_images(&plain, 0).unwrap(), plain);
        assert!(messages_with_images(&plain, 1)
            .unwrap_err()
            .contains("0 <image> marker(s)"));
        let video = vec![json!({"role": "user", "content": "<image><video>"})];
        assert!(messages_with_images(&video, 1)
            .unwrap_err()
            .contains("video input is not supported"));
    }

    #[test]
    fn image_entries_read_every_layout_verl_accepts() {
        let row = json!({"images": [
            {"bytes": "89504e47", "path": null},
            {"bytes": null, "path": "a/b.png", "max_pixels": 1000},
            "file:///x/y.png",
            {"image": "z.jpg"},
            [1, 2, 255]
        ]});
        let e = image_entries(&row, "images").unwrap();
        assert_eq!(
            e[0].source,
            ImageSource::Bytes(vec![0x89, 0x50, 0x4e, 0x47])
        );
        assert_eq!(e[1].source, ImageSource::Path("a/b.png".into()));
        assert_eq!(e[1].max_pixels, Some(1000));
        assert_eq!(e[2].source, ImageSource::Path("/x/y.png".into()));
        assert_eq!(e[3].source, ImageSource::Path("z.jpg".into()));
        assert_eq!(e[4].source, ImageSource::Bytes(vec![1, 2, 255]));
        assert!(image_entries(&json!({}), "images").unwrap().is_empty());
        assert!(image_entries(&json!({"images": null}), "images")
            .unwrap()
            .is_empty());
        for (bad, want) in [
            (json!({"images": "x.png"}), "expected a list of images"),
            (
                json!({"images": [{"bytes": "zz"}]}),
                "image 0: `bytes` is text that is not hex",
            ),
            (
                json!({"images": [{"other": 1}]}),
                "image 0: an image entry needs",
            ),
            (json!({"images": [3]}), "image 0: expected an image"),
            (
                json!({"images": [[300]]}),
                "image 0: a byte array holds 300",
            ),
            (
                json!({"images": [{"path": "p", "max_pixels": -1}]}),
                "`max_pixels` must be a positive integer",
            ),
        ] {
            let e = image_entries(&bad, "images").unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
