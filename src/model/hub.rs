//! Model-hub ids (`Qwen/Qwen2.5-0.5B-Instruct`) as local HF directories: the snapshot in the
//! Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`,
//! the layout `huggingface_hub` writes), read without any network. Built with the `hub` feature,
//! files missing from the cache are downloaded into it, unless `HF_HUB_OFFLINE` is set.

use std::path::{Path, PathBuf};

use hf_hub::{Cache, Repo, RepoType};

use super::ModelError;

/// Files a model directory needs (the weights are found through these or the index).
const REQUIRED: [&str; 2] = ["config.json", "tokenizer.json"];
/// Files read when present (downloaded with the `hub` feature).
#[cfg_attr(not(feature = "hub"), allow(dead_code))]
const OPTIONAL: [&str; 4] = [
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
];

/// The cache folder: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
pub fn cache_dir() -> PathBuf {
    if let Ok(p) = std::env::var("HF_HUB_CACHE") {
        return PathBuf::from(p);
    }
    Cache::from_env().path().clone()
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
        .unwrap_or(false)
}

/// The weight files of a snapshot: `model.safetensors`, or the shards its index names.
fn weight_names(get: &dyn Fn(&str) -> Option<PathBuf>) -> Result<Vec<String>, String> {
    if get("model.safetensors").is_some() {
        return Ok(vec!["model.safetensors".into()]);
    }
    let index = get("model.safetensors.index.json")
        .ok_or("neither model.safetensors nor model.safetensors.index.json")?;
    let text = std::fs::read_to_string(&index).map_err(|e| format!("{}: {e}", index.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", index.display()))?;
    let mut names: Vec<String> = v["weight_map"]
        .as_object()
        .ok_or_else(|| format!("{}: no weight_map", index.display()))?
        .values()
        .filter_map(|f| f.as_str().map(str::to_string))
        .collect();
    names.sort();
    names.dedup();
    names.push("model.safetensors.index.json".into());
    Ok(names)
}

/// The local snapshot folder of hub model `id` in the cache at `root`, if every file it needs
/// is there.
pub fn cached_snapshot(id: &str, root: &Path) -> Result<PathBuf, String> {
    let repo = Cache::new(root.to_path_buf()).repo(Repo::with_revision(
        id.to_string(),
        RepoType::Model,
        "main".into(),
    ));
    let get = |f: &str| repo.get(f);
    let config = get("config.json").ok_or_else(|| {
        format!(
            "not in the Hugging Face cache {} (no models--{}/snapshots/*/config.json for revision main)",
            root.display(),
            id.replace('/', "--")
        )
    })?;
    let dir = config
        .parent()
        .ok_or("the cached config.json has no folder")?
        .to_path_buf();
    let mut missing: Vec<String> = REQUIRED
        .iter()
        .filter(|f| get(f).is_none())
        .map(|f| f.to_string())
        .collect();
    match weight_names(&get) {
        Ok(names) => missing.extend(names.into_iter().filter(|f| get(f).is_none())),
        Err(e) => missing.push(e),
    }
    if missing.is_empty() {
        Ok(dir)
    } else {
        Err(format!(
            "the cached snapshot {} lacks {}",
            dir.display(),
            missing.join(", ")
        ))
    }
}

#[cfg(feature = "hub")]
fn download(id: &str, root: &Path) -> Result<PathBuf, String> {
    let api = hf_hub::api::sync::ApiBuilder::from_cache(Cache::new(root.to_path_buf()))
        .build()
        .map_err(|e| e.to_string())?;
    let repo = api.model(id.to_string());
    for f in REQUIRED {
        repo.get(f).map_err(|e| format!("{f}: {e}"))?;
    }
    for f in OPTIONAL {
        let _ = repo.get(f);
    }
    let get = |f: &str| repo.get(f).ok();
    for f in weight_names(&get)? {
        repo.get(&f).map_err(|e| format!("{f}: {e}"))?;
    }
    cached_snapshot(id, root)
}

/// The local directory of hub model `id`: the cached snapshot, else (with the `hub` feature and
/// network access allowed) a fresh download into the cache.
pub fn resolve(id: &str) -> Result<PathBuf, ModelError> {
    let root = cache_dir();
    let fail = |message: String| ModelError::File {
        file: id.to_string(),
        message,
    };
    match cached_snapshot(id, &root) {
        Ok(dir) => Ok(dir),
        Err(why) if offline() => Err(fail(format!("{why}; HF_HUB_OFFLINE is set, so nothing is downloaded"))),
        #[cfg(feature = "hub")]
        Err(_) => download(id, &root).map_err(|e| fail(format!("downloading from the hub: {e}"))),
        #[cfg(not(feature = "hub"))]
        Err(why) => Err(fail(format!(
            "{why}; this build does not download (rebuild with --features hub), or put the model there with `huggingface-cli download {id}`, or point the path at a local directory"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cache layout huggingface_hub writes: refs/main holds the commit, files live in
    /// snapshots/<commit>/.
    fn fake_cache(root: &Path, id: &str, files: &[(&str, &[u8])]) -> PathBuf {
        let repo = root.join(format!("models--{}", id.replace('/', "--")));
        let commit = "0123456789abcdef0123456789abcdef01234567";
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), commit).unwrap();
        let snap = repo.join("snapshots").join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        for (name, body) in files {
            std::fs::write(snap.join(name), body).unwrap();
        }
        snap
    }

    #[test]
    fn a_cached_snapshot_loads_as_a_model_directory() {
        let root = tempfile::tempdir().unwrap();
        let src = tempfile::tempdir().unwrap();
        let args = crate::model::ModelArgs::tiny(crate::model::Arch::Qwen2, 259);
        let (vm, _) = crate::testing::tiny_model(&args, candle_core::DType::F32, 0.1);
        crate::testing::write_tokenizer_dir(src.path()).unwrap();
        crate::model::hf::save_dir(&vm, &args, src.path(), &[258], Some(src.path()), None).unwrap();
        let files: Vec<(String, Vec<u8>)> = std::fs::read_dir(src.path())
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        let refs: Vec<(&str, &[u8])> = files
            .iter()
            .map(|(n, b)| (n.as_str(), b.as_slice()))
            .collect();
        let snap = fake_cache(root.path(), "org/tiny", &refs);
        let dir = cached_snapshot("org/tiny", root.path()).unwrap();
        assert_eq!(dir, snap);
        let loaded = crate::model::hf::load_dir(
            &dir,
            &serde_json::Map::new(),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
            true,
        )
        .unwrap();
        assert_eq!(loaded.model.args.hidden_size, args.hidden_size);
    }

    #[test]
    fn missing_files_are_named() {
        let root = tempfile::tempdir().unwrap();
        let e = cached_snapshot("org/none", root.path()).unwrap_err();
        assert!(e.contains("models--org--none"), "{e}");
        fake_cache(
            root.path(),
            "org/half",
            &[
                ("config.json", b"{}"),
                ("model.safetensors.index.json", br#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#),
                ("model-00001-of-00002.safetensors", b""),
            ],
        );
        let e = cached_snapshot("org/half", root.path()).unwrap_err();
        assert!(
            e.contains("tokenizer.json") && e.contains("model-00002-of-00002.safetensors"),
            "{e}"
        );
        assert!(!e.contains("model-00001"), "{e}");
    }
}
