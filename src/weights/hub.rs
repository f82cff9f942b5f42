//! Model-hub ids (`Qwen/Qwen2.5-0.5B-Instruct`) as local HF directories, the way transformers
//! and verl resolve them: the snapshot in the Hugging Face cache (`$HF_HUB_CACHE`, else
//! `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, the layout `huggingface_hub` writes:
//! `models--org--name/{blobs,snapshots/<commit>,refs/main}`), and files missing there downloaded
//! into it from `$HF_ENDPOINT` (default `https://huggingface.co`) with a progress bar, sending
//! `$HF_TOKEN` (else the saved login token) for gated and private repositories. With
//! `HF_HUB_OFFLINE=1` nothing is downloaded.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use crate::model::ModelError;

/// Files a model directory needs (the weights are found through these or the index).
const REQUIRED: [&str; 2] = ["config.json", "tokenizer.json"];
/// Files read when present (a 404 for them is not an error).
const OPTIONAL: [&str; 4] = [
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
];

/// Where and how the hub is reached: huggingface_hub's environment variables.
#[derive(Debug, Clone, PartialEq)]
pub struct HubSettings {
    /// The cache folder (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`).
    pub cache: PathBuf,
    /// `HF_ENDPOINT` without a trailing slash (default `https://huggingface.co`).
    pub endpoint: String,
    /// `HF_TOKEN` (or the legacy `HUGGING_FACE_HUB_TOKEN`), else the token file
    /// (`HF_TOKEN_PATH`, else `HF_HOME/token`) that `huggingface-cli login` writes.
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE` set to 1/true/yes/on.
    pub offline: bool,
    /// Draw a progress bar (stderr is a terminal); otherwise each file is logged.
    pub progress: bool,
}

fn truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

impl HubSettings {
    /// From the process environment.
    pub fn from_env() -> Self {
        let mut s = Self::from_vars(|k| std::env::var(k).ok());
        s.progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
        s
    }

    /// From an environment given as a lookup function (empty values count as unset).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Self {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let hf_home = get("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let base = get("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(get("HOME").unwrap_or_default()).join(".cache"));
            base.join("huggingface")
        });
        let cache = get("HF_HUB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let token = get("HF_TOKEN")
            .or_else(|| get("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| {
                let file = get("HF_TOKEN_PATH")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| hf_home.join("token"));
                std::fs::read_to_string(file)
                    .ok()
                    .map(|t| t.trim().to_string())
                    .filter(|t| !t.is_empty())
            })
            .map(|t| t.trim().to_string());
        Self {
            cache,
            endpoint: get("HF_ENDPOINT")
                .map(|e| e.trim().trim_end_matches('/').to_string())
                .unwrap_or_else(|| "https://huggingface.co".into()),
            token,
            offline: get("HF_HUB_OFFLINE").is_some_and(|v| truthy(&v)),
            progress: false,
        }
    }
}

/// The cache folder of the process environment.
pub fn cache_dir() -> PathBuf {
    HubSettings::from_vars(|k| std::env::var(k).ok()).cache
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

fn cache_repo(id: &str, root: &Path) -> hf_hub::CacheRepo {
    Cache::new(root.to_path_buf()).repo(Repo::with_revision(
        id.to_string(),
        RepoType::Model,
        "main".into(),
    ))
}

/// The local snapshot folder of hub model `id` in the cache at `root`, if every file it needs
/// is there.
pub fn cached_snapshot(id: &str, root: &Path) -> Result<PathBuf, String> {
    let repo = cache_repo(id, root);
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

/// A download's progress: a bar on a terminal, otherwise one log line per file.
struct Bar {
    bar: Option<indicatif::ProgressBar>,
}

impl hf_hub::api::Progress for Bar {
    fn init(&mut self, size: usize, filename: &str) {
        match &self.bar {
            Some(bar) => {
                bar.set_length(size as u64);
                bar.set_message(filename.to_string());
            }
            None => tracing::info!("downloading {filename} ({:.1} MB)", size as f64 / 1e6),
        }
    }
    fn update(&mut self, size: usize) {
        if let Some(bar) = &self.bar {
            bar.inc(size as u64);
        }
    }
    fn finish(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Bar {
    fn new(show: bool) -> Self {
        let bar = show.then(|| {
            let b = indicatif::ProgressBar::new(0);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{msg:>24} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            ) {
                b.set_style(style.progress_chars("=> "));
            }
            b
        });
        Self { bar }
    }
}

/// One file's failure, in words a user can act on.
fn explain(file: &str, url: &str, e: hf_hub::api::sync::ApiError, s: &HubSettings) -> String {
    use hf_hub::api::sync::ApiError;
    match e {
        ApiError::RequestError(r) => match *r {
            ureq::Error::Status(code @ (401 | 403), _) => format!(
                "{file}: HTTP {code} from {url}: the repository is gated or private; {}",
                if s.token.is_some() {
                    "the token sent (HF_TOKEN or the saved login) was refused"
                } else {
                    "set HF_TOKEN (or run `huggingface-cli login`)"
                }
            ),
            ureq::Error::Status(404, _) => {
                format!("{file}: not found at {url} (HTTP 404); check the model id")
            }
            ureq::Error::Status(code, _) => format!("{file}: HTTP {code} from {url}"),
            ureq::Error::Transport(t) => format!(
                "{file}: cannot reach {} ({t}); set HF_HUB_OFFLINE=1 to use only the local cache, or HF_ENDPOINT for a mirror",
                s.endpoint
            ),
        },
        other => format!("{file}: {other}"),
    }
}

fn is_404(e: &hf_hub::api::sync::ApiError) -> bool {
    matches!(e, hf_hub::api::sync::ApiError::RequestError(r) if matches!(**r, ureq::Error::Status(404, _)))
}

/// Downloads what the cache lacks of hub model `id` (revision main) and returns the snapshot.
fn download(id: &str, s: &HubSettings) -> Result<PathBuf, String> {
    let api = ApiBuilder::from_cache(Cache::new(s.cache.clone()))
        .with_endpoint(s.endpoint.clone())
        .with_token(s.token.clone())
        .with_progress(false)
        .build()
        .map_err(|e| e.to_string())?;
    let repo = api.model(id.to_string());
    let cached = cache_repo(id, &s.cache);
    let fetch = |f: &str| -> Result<PathBuf, hf_hub::api::sync::ApiError> {
        match cached.get(f) {
            Some(p) => Ok(p),
            None => repo.download_with_progress(f, Bar::new(s.progress)),
        }
    };
    tracing::info!(
        "downloading {id} from {} into {}",
        s.endpoint,
        s.cache.display()
    );
    for f in REQUIRED {
        fetch(f).map_err(|e| explain(f, &repo.url(f), e, s))?;
    }
    for f in OPTIONAL {
        match fetch(f) {
            Ok(_) => {}
            Err(e) if is_404(&e) => {}
            Err(e) => return Err(explain(f, &repo.url(f), e, s)),
        }
    }
    // The index (when sharded) is needed to know the shards.
    let get = |f: &str| match fetch(f) {
        Ok(p) => Some(p),
        Err(e) if is_404(&e) => None,
        Err(e) => {
            tracing::warn!("{}", explain(f, &repo.url(f), e, s));
            None
        }
    };
    for f in weight_names(&get)? {
        fetch(&f).map_err(|e| explain(&f, &repo.url(&f), e, s))?;
    }
    cached_snapshot(id, &s.cache)
}

/// The local directory of hub model `id` under `settings`: the cached snapshot, else (unless
/// offline) a fresh download into the cache.
pub fn resolve_with(id: &str, settings: &HubSettings) -> Result<PathBuf, ModelError> {
    let fail = |message: String| ModelError::File {
        file: id.to_string(),
        message,
    };
    match cached_snapshot(id, &settings.cache) {
        Ok(dir) => Ok(dir),
        Err(why) if settings.offline => Err(fail(format!(
            "{why}; HF_HUB_OFFLINE is set, so nothing is downloaded (unset it, or put the model there with `huggingface-cli download {id}`, or point the path at a local directory)"
        ))),
        Err(_) => download(id, settings).map_err(|e| fail(format!("downloading from the hub: {e}"))),
    }
}

/// The local directory of hub model `id` under the process environment.
pub fn resolve(id: &str) -> Result<PathBuf, ModelError> {
    resolve_with(id, &HubSettings::from_env())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};

    const COMMIT: &str = "89abcdef0123456789abcdef0123456789abcdef";

    /// Requests the fake hub saw: path and Authorization header.
    type Log = Arc<Mutex<Vec<(String, Option<String>)>>>;

    /// A stand-in for the hub on 127.0.0.1, answering `/{org}/{name}/resolve/main/{file}` as
    /// huggingface.co does for the requests huggingface_hub makes: an `ETag` (the blob name),
    /// `X-Repo-Commit`, and `Range` requests answered 206 with `Content-Range`; 404 for files it
    /// lacks. Repositories named `*gated*` answer 401 unless `Bearer hf_ok` is sent. Every
    /// request is logged with its Authorization header.
    struct FakeHub {
        addr: SocketAddr,
        log: Log,
        _stop: tokio::sync::oneshot::Sender<()>,
    }

    fn etag(body: &[u8]) -> String {
        // FNV-1a: any stable content hash names the blob.
        let h = body.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
        format!("{h:016x}")
    }

    impl FakeHub {
        fn start(repos: HashMap<String, HashMap<String, Vec<u8>>>) -> Self {
            use axum::body::Body;
            use axum::http::{header, StatusCode};
            use axum::response::Response;
            let log: Log = Arc::default();
            let repos = Arc::new(repos);
            let app = {
                let log = log.clone();
                axum::Router::new().fallback(move |req: axum::extract::Request| {
                    let (log, repos) = (log.clone(), repos.clone());
                    async move {
                        let path = req.uri().path().to_string();
                        let auth = req
                            .headers()
                            .get(header::AUTHORIZATION)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string);
                        log.lock().unwrap().push((path.clone(), auth.clone()));
                        let status = |code: StatusCode| {
                            Response::builder()
                                .status(code)
                                .body(Body::empty())
                                .unwrap()
                        };
                        let Some((id, file)) =
                            path.trim_start_matches('/').split_once("/resolve/main/")
                        else {
                            return status(StatusCode::NOT_FOUND);
                        };
                        if id.contains("gated") && auth.as_deref() != Some("Bearer hf_ok") {
                            return status(StatusCode::UNAUTHORIZED);
                        }
                        let Some(body) = repos.get(id).and_then(|r| r.get(file)) else {
                            return status(StatusCode::NOT_FOUND);
                        };
                        let len = body.len();
                        let range = req
                            .headers()
                            .get(header::RANGE)
                            .and_then(|v| v.to_str().ok())
                            .and_then(|r| r.strip_prefix("bytes="))
                            .and_then(|r| r.split_once('-'))
                            .map(|(a, b)| {
                                let a: usize = a.parse().unwrap_or(0);
                                let b: usize = b.parse().unwrap_or(len - 1).min(len - 1);
                                (a, b)
                            });
                        let b = Response::builder()
                            .header(header::ETAG, format!("\"{}\"", etag(body)))
                            .header("x-repo-commit", COMMIT);
                        match range {
                            Some((a, e)) => b
                                .status(StatusCode::PARTIAL_CONTENT)
                                .header(header::CONTENT_RANGE, format!("bytes {a}-{e}/{len}"))
                                .body(Body::from(body[a..=e].to_vec()))
                                .unwrap(),
                            None => b
                                .status(StatusCode::OK)
                                .body(Body::from(body.clone()))
                                .unwrap(),
                        }
                    }
                })
            };
            let (tx_addr, rx_addr) = std::sync::mpsc::channel();
            let (stop, rx_stop) = tokio::sync::oneshot::channel::<()>();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                    tx_addr.send(l.local_addr().unwrap()).unwrap();
                    axum::serve(l, app)
                        .with_graceful_shutdown(async {
                            let _ = rx_stop.await;
                        })
                        .await
                        .unwrap();
                });
            });
            Self {
                addr: rx_addr.recv().unwrap(),
                log,
                _stop: stop,
            }
        }

        fn settings(&self, cache: &Path, token: Option<&str>) -> HubSettings {
            HubSettings {
                cache: cache.to_path_buf(),
                endpoint: format!("http://{}", self.addr),
                token: token.map(str::to_string),
                offline: false,
                progress: false,
            }
        }

        fn requests(&self) -> Vec<(String, Option<String>)> {
            self.log.lock().unwrap().clone()
        }
    }

    /// The files of a tiny saved model (config, tokenizer, weights).
    fn tiny_model_files() -> HashMap<String, Vec<u8>> {
        let src = tempfile::tempdir().unwrap();
        let args = crate::model::ModelArgs::tiny(crate::model::Arch::Qwen2, 259);
        let (vm, _) = crate::testing::tiny_model(&args, candle_core::DType::F32, 0.1);
        crate::testing::write_tokenizer_dir(src.path()).unwrap();
        crate::weights::hf::save_dir(&vm, &args, src.path(), &[258], Some(src.path()), None)
            .unwrap();
        std::fs::read_dir(src.path())
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect()
    }

    /// A hub id downloads into the HF cache layout (blobs, snapshots/<commit>, refs/main),
    /// sends the token, tolerates optional files the repository lacks, loads as a model, and
    /// is served from the cache afterwards without a request (also offline).
    #[test]
    fn a_hub_id_downloads_into_the_cache_and_loads() {
        let files = tiny_model_files();
        assert!(
            !files.contains_key("chat_template.jinja"),
            "an optional file is missing"
        );
        let hub = FakeHub::start(HashMap::from([("org/tiny".to_string(), files.clone())]));
        let cache = tempfile::tempdir().unwrap();
        let s = hub.settings(cache.path(), Some("hf_secret"));
        let dir = resolve_with("org/tiny", &s).unwrap();
        let repo = cache.path().join("models--org--tiny");
        assert_eq!(dir, repo.join("snapshots").join(COMMIT));
        assert_eq!(
            std::fs::read_to_string(repo.join("refs/main")).unwrap(),
            COMMIT
        );
        for (name, body) in &files {
            assert_eq!(&std::fs::read(dir.join(name)).unwrap(), body, "{name}");
            assert!(
                repo.join("blobs").join(etag(body)).is_file(),
                "blob of {name}"
            );
        }
        let reqs = hub.requests();
        assert!(reqs
            .iter()
            .any(|(p, _)| p == "/org/tiny/resolve/main/model.safetensors"));
        assert!(
            reqs.iter()
                .all(|(_, a)| a.as_deref() == Some("Bearer hf_secret")),
            "{reqs:?}"
        );
        let loaded = crate::weights::hf::load_dir(
            &dir,
            &serde_json::Map::new(),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
            true,
        )
        .unwrap();
        assert_eq!(loaded.model.args.vocab_size, 259);
        // Cached now: no further request, even with HF_HUB_OFFLINE.
        let n = hub.requests().len();
        let offline = HubSettings {
            offline: true,
            ..s.clone()
        };
        assert_eq!(resolve_with("org/tiny", &offline).unwrap(), dir);
        assert_eq!(resolve_with("org/tiny", &s).unwrap(), dir);
        assert_eq!(hub.requests().len(), n);
    }

    /// Offline with an empty cache asks nothing; an unknown id, a gated repository without a
    /// token, and an unreachable endpoint are each explained.
    #[test]
    fn hub_failures_are_explained() {
        let hub = FakeHub::start(HashMap::from([(
            "org/gated-model".to_string(),
            tiny_model_files(),
        )]));
        let cache = tempfile::tempdir().unwrap();
        let offline = HubSettings {
            offline: true,
            ..hub.settings(cache.path(), None)
        };
        let e = resolve_with("org/tiny", &offline).unwrap_err().to_string();
        assert!(
            e.contains("HF_HUB_OFFLINE is set") && e.contains("models--org--tiny"),
            "{e}"
        );
        assert!(hub.requests().is_empty());
        let e = resolve_with("org/nothing", &hub.settings(cache.path(), None))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("config.json: not found at http://") && e.contains("HTTP 404"),
            "{e}"
        );
        let e = resolve_with("org/gated-model", &hub.settings(cache.path(), None))
            .unwrap_err()
            .to_string();
        assert!(e.contains("HTTP 401") && e.contains("set HF_TOKEN"), "{e}");
        resolve_with(
            "org/gated-model",
            &hub.settings(cache.path(), Some("hf_ok")),
        )
        .unwrap();
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let unreachable = HubSettings {
            endpoint: format!("http://{closed}"),
            ..hub.settings(cache.path(), None)
        };
        let e = resolve_with("org/other", &unreachable)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot reach") && e.contains("HF_HUB_OFFLINE=1"),
            "{e}"
        );
    }

    /// huggingface_hub's variables: HF_HUB_CACHE over HF_HOME/hub over ~/.cache/huggingface/hub,
    /// HF_ENDPOINT (trailing slash dropped), HF_TOKEN over the legacy name over the token file,
    /// HF_HUB_OFFLINE truthy spellings.
    #[test]
    fn settings_follow_the_hf_environment_variables() {
        let home = tempfile::tempdir().unwrap();
        let vars = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            HubSettings::from_vars(move |k| m.get(k).cloned())
        };
        let s = vars(&[("HOME", "/home/u")]);
        assert_eq!(s.cache, PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert_eq!(s.endpoint, "https://huggingface.co");
        assert!(!s.offline && s.token.is_none());
        let hf_home = home.path().display().to_string();
        std::fs::write(home.path().join("token"), "hf_saved\n").unwrap();
        let s = vars(&[
            ("HF_HOME", &hf_home),
            ("HF_ENDPOINT", "https://mirror.example/"),
            ("HF_HUB_OFFLINE", "1"),
        ]);
        assert_eq!(s.cache, home.path().join("hub"));
        assert_eq!(s.endpoint, "https://mirror.example");
        assert_eq!(s.token.as_deref(), Some("hf_saved"));
        assert!(s.offline);
        let s = vars(&[
            ("HF_HOME", &hf_home),
            ("HF_HUB_CACHE", "/c"),
            ("HF_TOKEN", "hf_env"),
            ("HUGGING_FACE_HUB_TOKEN", "hf_old"),
            ("HF_HUB_OFFLINE", "0"),
        ]);
        assert_eq!(s.cache, PathBuf::from("/c"));
        assert_eq!(s.token.as_deref(), Some("hf_env"));
        assert!(!s.offline);
        for on in ["true", "YES", "on"] {
            assert!(vars(&[("HF_HUB_OFFLINE", on)]).offline, "{on}");
        }
    }

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
        crate::weights::hf::save_dir(&vm, &args, src.path(), &[258], Some(src.path()), None)
            .unwrap();
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
        let loaded = crate::weights::hf::load_dir(
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
