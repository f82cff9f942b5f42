//! Model files on disk ↔ [`CausalLm`](crate::model::CausalLm): HF directories (config.json +
//! safetensors, sharded or not; load and save), the HF hub cache and downloads, llama.cpp's
//! GGUF (dequantised; tokenizer and chat template from its metadata), and PEFT's LoRA adapter
//! folders. This room reads paths, configs and tokenizers; `model` knows none of them.
//!
//! - `hf`: HF directories, load and save,
//! - `hub`: hub ids resolved in the HF cache, downloaded when allowed,
//! - `gguf`: llama.cpp files, read,
//! - `gguf_write`: llama.cpp files, written (`main_ppo merge --gguf`),
//! - `peft`: which projections get adapters, attaching them, PEFT's adapter folder,
//! - `merge`: a checkpoint or base + adapters written as one HF model (`main_ppo merge`).

pub mod gguf;
mod gguf_hybrid;
pub mod gguf_write;
pub mod hf;
pub mod hub;
pub mod merge;
pub mod peft;

use std::path::{Path, PathBuf};

use crate::model::{ModelArgs, ModelError};

#[cfg(test)]
pub(crate) mod deberta_tests;
#[cfg(test)]
mod family_tests;
#[cfg(test)]
mod gguf_write_tests;
#[cfg(test)]
pub(crate) mod merge_tests;
#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod vlm_tests;

/// The HF model folder a local model path names: the folder itself, or the `huggingface/`
/// folder of a checkpoint given as its step folder (`global_step_N/`: an SFT checkpoint, or an
/// RL checkpoint's `actor/`) when that holds full weights. Anything else is read as given (a
/// LoRA checkpoint is then refused saying what to pass instead).
pub fn checkpoint_model_dir(p: &Path) -> PathBuf {
    if !p.is_dir() || p.join("config.json").is_file() {
        return p.to_path_buf();
    }
    for role in [p.to_path_buf(), p.join("actor")] {
        let hf_dir = role.join("huggingface");
        if hf_dir.join("config.json").is_file() && hf::has_weights(&hf_dir) {
            return hf_dir;
        }
    }
    p.to_path_buf()
}

/// The tokenizer of a model path as [`load_model_and_tokenizer`] would read it (an HF folder's
/// tokenizer files, a GGUF file's metadata, a hub id's folder), without reading any weights.
pub fn load_tokenizer(path: &str) -> Result<crate::data::TokenizerBundle, ModelError> {
    let expanded = crate::util::expand_home(path);
    let dir = checkpoint_model_dir(Path::new(&expanded));
    let p = dir.as_path();
    if p.is_file() && expanded.ends_with(".gguf") {
        let (_, content) = gguf::open(p)?;
        return gguf::tokenizer(&content, p);
    }
    let dir = if p.is_dir() {
        p.to_path_buf()
    } else if is_hub_id(path) {
        hub::resolve(path)?
    } else {
        return Err(ModelError::file(p, "no such model: expected an HF model directory (config.json, model.safetensors, tokenizer.json) or a .gguf file".into()));
    };
    crate::data::TokenizerBundle::from_dir(&dir).map_err(|e| match e {
        // Already names its file (the folder or its tokenizer.json).
        crate::data::DataError::File { file, message } => ModelError::File { file, message },
        other => ModelError::file(&dir, other.to_string()),
    })
}

/// A model and its tokenizer from `path`: a `.gguf` file, an HF directory, or a hub id found in
/// the HF cache (downloaded with the `hub` feature); tokenizer from `tokenizer_path` when given.
pub fn load_model_and_tokenizer(
    path: &str,
    tokenizer_path: Option<&str>,
    overrides: &serde_json::Map<String, serde_json::Value>,
    dtype: candle_core::DType,
    device: &candle_core::Device,
    with_lm_head: bool,
) -> Result<(hf::Loaded, crate::data::TokenizerBundle), ModelError> {
    let (loaded, tok) = load_both(path, tokenizer_path, overrides, dtype, device, with_lm_head)?;
    check_vocab(&loaded.model.args, &tok, path)?;
    Ok((loaded, tok))
}

/// A tokenizer whose ids reach past the model's embedding rows (another model's tokenizer, or a
/// config whose `vocab_size` was cut) is refused when both are loaded, naming both, instead of
/// failing at the first such token in a rollout. (Models often have more rows than the
/// tokenizer has ids: padding for fast kernels; that is fine.)
pub(crate) fn check_vocab(
    args: &ModelArgs,
    tok: &crate::data::TokenizerBundle,
    path: &str,
) -> Result<(), ModelError> {
    let Some(max) = tok.tokenizer.get_vocab(true).into_values().max() else {
        return Ok(());
    };
    if max as usize >= args.vocab_size {
        return Err(ModelError::File {
            file: path.to_string(),
            message: format!(
                "the tokenizer ({}) has token ids up to {max}, but the model's vocab_size is {}: they belong to different models (give the model's own tokenizer: actor_rollout_ref.model.tokenizer_path / data.tokenizer)",
                tok.source.display(),
                args.vocab_size
            ),
        });
    }
    Ok(())
}

fn load_both(
    path: &str,
    tokenizer_path: Option<&str>,
    overrides: &serde_json::Map<String, serde_json::Value>,
    dtype: candle_core::DType,
    device: &candle_core::Device,
    with_lm_head: bool,
) -> Result<(hf::Loaded, crate::data::TokenizerBundle), ModelError> {
    let expanded = crate::util::expand_home(path);
    let dir = checkpoint_model_dir(Path::new(&expanded));
    let p = dir.as_path();
    let tok_from = |fallback: Option<crate::data::TokenizerBundle>| -> Result<crate::data::TokenizerBundle, ModelError> {
        match tokenizer_path {
            // An HF folder, a `.gguf` file (its own tokenizer) or a hub id, as a model's.
            Some(t) => load_tokenizer(t),
            None => fallback.ok_or_else(|| ModelError::file(p, "no tokenizer".into())),
        }
    };
    if p.is_file() && expanded.ends_with(".gguf") {
        let (loaded, content) = gguf::load(p, dtype, device, with_lm_head)?;
        let tok = if tokenizer_path.is_some() {
            tok_from(None)?
        } else {
            gguf::tokenizer(&content, p)?
        };
        return Ok((loaded, tok));
    }
    if p.is_dir() {
        let loaded = hf::load_dir(p, overrides, dtype, device, with_lm_head)?;
        let own = if tokenizer_path.is_none() {
            Some(
                crate::data::TokenizerBundle::from_dir(p)
                    .map_err(|e| ModelError::file(p, e.to_string()))?,
            )
        } else {
            None
        };
        return Ok((loaded, tok_from(own)?));
    }
    if is_hub_id(path) {
        let dir = hub::resolve(path)?;
        let loaded = hf::load_dir(&dir, overrides, dtype, device, with_lm_head)?;
        let own = if tokenizer_path.is_none() {
            Some(
                crate::data::TokenizerBundle::from_dir(&dir)
                    .map_err(|e| ModelError::file(&dir, e.to_string()))?,
            )
        } else {
            None
        };
        return Ok((loaded, tok_from(own)?));
    }
    Err(ModelError::file(p, "no such model: expected an HF model directory (config.json, model.safetensors, tokenizer.json) or a .gguf file".into()))
}

/// The hyper-parameters of the model at `path` (as [`load_model_and_tokenizer`] would read
/// them) without reading any weights: a GGUF file's header, an HF directory's `config.json`
/// (with `overrides`), or a hub id's cached `config.json`. `Ok(None)` when there is nothing to
/// read without a download (a hub id not in the cache).
pub fn read_args(
    path: &str,
    overrides: &serde_json::Map<String, serde_json::Value>,
) -> Result<Option<ModelArgs>, ModelError> {
    let expanded = crate::util::expand_home(path);
    let p = Path::new(&expanded);
    if p.is_file() && expanded.ends_with(".gguf") {
        let (_, c) = gguf::open(p)?;
        return gguf::read_args(&c, p).map(Some);
    }
    if p.is_dir() {
        let args = hf::read_config(p, overrides)?;
        // A LoRA checkpoint's `huggingface/` has a config and no weights: named before a run.
        if !hf::has_weights(p) {
            if let Some(e) = peft::adapter_instead_of_model(p) {
                return Err(e);
            }
        }
        return Ok(Some(args));
    }
    if is_hub_id(path) {
        return match hub::cached_snapshot(path, &hub::cache_dir()) {
            Ok(dir) => hf::read_config(&dir, overrides).map(Some),
            Err(_) => Ok(None),
        };
    }
    Ok(None)
}

/// Refuses the tensor `name` read from `file` when it holds NaN or ±infinity: such a weight,
/// adapter or optimizer moment makes every forward and update that touches it NaN (rollouts of
/// junk, every step skipped) without stopping the run. The error names the file, the tensor,
/// how many values and the first one's row-major index. Every reader of tensor files calls it
/// once per tensor, on the host values it has just read (one pass, [`non_finite`]).
///
/// [`non_finite`]: crate::kernels::storage::non_finite
pub fn check_finite(file: &Path, name: &str, t: &candle_core::Tensor) -> Result<(), ModelError> {
    let Some(bad) = crate::kernels::storage::non_finite(t)? else {
        return Ok(());
    };
    Err(ModelError::file(
        file,
        format!(
            "tensor `{name}` (shape {:?}) holds {} non-finite value(s) (NaN or ±inf) among {}, the first ({}) at index {}: the file is damaged or was saved from a diverged run",
            t.dims(),
            bad.count,
            t.elem_count(),
            bad.value,
            bad.first
        ),
    ))
}

/// [`check_finite`] over every tensor of `file`, in name order (the same tensor is reported
/// first every time).
pub fn check_all_finite(
    file: &Path,
    tensors: &std::collections::HashMap<String, candle_core::Tensor>,
) -> Result<(), ModelError> {
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    names
        .into_iter()
        .try_for_each(|n| check_finite(file, n, &tensors[n]))
}

/// The umask of this process, from `/proc/self/status` (read without changing it, which
/// `umask(2)` would do for every thread); 0o022 where that file does not say.
fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

/// Writes `tensors` as a safetensors file at `path`, with the permissions a new file of this
/// process gets (0o666 less the umask), as `std::fs::write` gives the JSON beside it. The
/// safetensors crate writes through a temporary file that is readable by its owner only and
/// renames it into place: checkpoint and merged weights were then unreadable to the group a
/// shared cluster folder is for.
pub fn save_safetensors<S: AsRef<str> + Ord + std::fmt::Display>(
    tensors: &std::collections::HashMap<S, candle_core::Tensor>,
    path: &Path,
) -> Result<(), ModelError> {
    use std::os::unix::fs::PermissionsExt;
    candle_core::safetensors::save(tensors, path)
        .map_err(|e| ModelError::file(path, e.to_string()))?;
    let mode = 0o666 & !umask();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| ModelError::file(path, e.to_string()))
}

/// `org/name` that is no local path and no `.gguf` file: a model-hub id.
pub fn is_hub_id(path: &str) -> bool {
    let expanded = crate::util::expand_home(path);
    !Path::new(&expanded).exists()
        && !path.starts_with(['/', '.', '~'])
        && path.matches('/').count() == 1
        && !path.ends_with(".gguf")
}
