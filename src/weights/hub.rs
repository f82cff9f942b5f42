//! Model-hub ids (`Qwen/Qwen2.5-0.5B-Instruct`) as local HF directories, the way transformers
//! and verl resolve them: the snapshot in the Hugging Face cache (`$HF_HUB_CACHE`, else
//! `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, the layout `huggingface_hub` writes:
//! `models--org--name/{blobs,snapshots/<commit>,refs/main}`), and files missing there downloaded
//! into it from `$HF_ENDPOINT` (default `https://huggingface.co`) with a progress bar, sending
//! `$HF_TOKEN` (else the saved login token) for gated and private repositories. With
//! `HF_HUB_OFFLINE=1` nothing is downloaded.
//!
//! A download is huggingface_hub's: a HEAD of `{endpoint}/{id}/resolve/main/{file}` (relative
//! redirects followed, an absolute one, the CDN, taken as where the body is) gives the commit
//! (`X-Repo-Commit`), the blob name (`X-Linked-Etag`, else `ETag`) and the size
//! (`X-Linked-Size`, else `Content-Length`); the body goes to `blobs/<etag>.incomplete` and is
//! renamed to `blobs/<etag>` only when its size is the announced one and, for LFS files (whose
//! etag is the SHA-256 of the content), its hash is the etag. Every request has connect and
//! per-read timeouts (`HF_HUB_ETAG_TIMEOUT` for the HEAD, `HF_HUB_DOWNLOAD_TIMEOUT` for the
//! body, 10 s each by default), redirects end after [`MAX_REDIRECTS`], and a stop request
//! ([`request_stop`], the CLI's Ctrl-C / SIGTERM) ends the wait within [`POLL`]. An LFS file
//! cut short keeps its `.incomplete` part, and the next download asks only for the rest.
//! hf-hub's `Cache` reads the snapshots; its download API is not used (no timeouts, relative
//! redirects followed without end, no size check).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hf_hub::{Cache, Repo, RepoType};
use sha2::Digest;

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
/// The weights of an unsharded model, and the index of a sharded one.
const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";
/// Redirects followed for one file, the hub's and the CDN's together (requests, which
/// huggingface_hub uses, allows 30; the hub needs one or two).
pub const MAX_REDIRECTS: usize = 10;
/// How often a wait (for an answer, a read, another process's lock) looks at the stop flag.
pub const POLL: Duration = Duration::from_millis(100);
/// huggingface_hub's default for HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Set by [`request_stop`]: downloads of this process end and no other starts.
static STOP: AtomicBool = AtomicBool::new(false);
/// Downloads under way, so the signal handler can say what it stops.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// Asks this process's hub downloads to stop (the CLI calls it on Ctrl-C / SIGTERM): the one
/// under way returns an "interrupted" error within [`POLL`], and later ones fail at once.
/// True when a download was under way.
pub fn request_stop() -> bool {
    STOP.store(true, Ordering::SeqCst);
    ACTIVE.load(Ordering::SeqCst) > 0
}

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
    /// `HF_HUB_ETAG_TIMEOUT` (default 10 s): the limit to connect for a file's metadata
    /// request, and to wait for its answer.
    pub etag_timeout: Duration,
    /// `HF_HUB_DOWNLOAD_TIMEOUT` (default 10 s): the limit to connect for a file's body, and
    /// to wait for each read of it (a stall, not the whole download).
    pub download_timeout: Duration,
    /// One of the timeout variables set to something that is not a number of seconds (named
    /// with its value): a download is refused before its first request.
    pub invalid: Option<String>,
}

fn truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

/// The timeout variable `var` (`value` when set): seconds, 0 or unset for the default (as
/// huggingface_hub reads it: `int(value) or 10`); fractions are taken too.
fn timeout_var(var: &str, value: Option<&str>) -> Result<Duration, String> {
    let Some(v) = value.map(str::trim) else {
        return Ok(DEFAULT_TIMEOUT);
    };
    match v.parse::<f64>() {
        Ok(0.0) => Ok(DEFAULT_TIMEOUT),
        Ok(x) if x.is_finite() && x > 0.0 && x < 1e9 => Ok(Duration::from_secs_f64(x)),
        _ => Err(format!(
            "{var}={v}: not a number of seconds (a positive number; unset or 0 for the default, 10)"
        )),
    }
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
        let mut invalid = None;
        let mut timeout = |var: &str| {
            timeout_var(var, get(var).as_deref()).unwrap_or_else(|e| {
                invalid.get_or_insert(e);
                DEFAULT_TIMEOUT
            })
        };
        let (etag_timeout, download_timeout) = (
            timeout("HF_HUB_ETAG_TIMEOUT"),
            timeout("HF_HUB_DOWNLOAD_TIMEOUT"),
        );
        Self {
            cache,
            endpoint: get("HF_ENDPOINT")
                .map(|e| e.trim().trim_end_matches('/').to_string())
                .unwrap_or_else(|| "https://huggingface.co".into()),
            token,
            offline: get("HF_HUB_OFFLINE").is_some_and(|v| truthy(&v)),
            progress: false,
            etag_timeout,
            download_timeout,
            invalid,
        }
    }
}

/// The cache folder of the process environment.
pub fn cache_dir() -> PathBuf {
    HubSettings::from_vars(|k| std::env::var(k).ok()).cache
}

/// Whether `name` (a file of a repository, e.g. a shard the index names) stays inside a
/// snapshot folder: relative, no empty, `.` or `..` component, no backslash.
fn inside(name: &str) -> bool {
    !name.starts_with('/')
        && !name.contains('\\')
        && name
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// The shards `index` (a `model.safetensors.index.json`) names, sorted, each once.
fn shards(index: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(index).map_err(|e| format!("{}: {e}", index.display()))?;
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
    if let Some(bad) = names.iter().find(|n| !inside(n)) {
        return Err(format!(
            "{}: the shard {bad:?} is not a file name inside the repository",
            index.display()
        ));
    }
    Ok(names)
}

/// The weight files of a snapshot: `model.safetensors`, or the shards its index names.
fn weight_names(get: &dyn Fn(&str) -> Option<PathBuf>) -> Result<Vec<String>, String> {
    if get(WEIGHTS).is_some() {
        return Ok(vec![WEIGHTS.into()]);
    }
    let index = get(INDEX).ok_or_else(|| format!("{WEIGHTS} (or {INDEX} and its shards)"))?;
    let mut names = shards(&index)?;
    names.push(INDEX.into());
    Ok(names)
}

fn cache_repo(id: &str, root: &Path) -> hf_hub::CacheRepo {
    Cache::new(root.to_path_buf()).repo(Repo::with_revision(
        id.to_string(),
        RepoType::Model,
        "main".into(),
    ))
}

/// The folder of hub model `id` in the cache at `root` (`models--org--name`).
fn repo_folder(id: &str, root: &Path) -> PathBuf {
    root.join(format!("models--{}", id.replace('/', "--")))
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
fn progress_bar(
    show: bool,
    file: &str,
    size: Option<u64>,
    start: u64,
) -> Option<indicatif::ProgressBar> {
    if !show {
        let mb = |n: u64| n as f64 / 1e6;
        match size {
            Some(n) if start > 0 => tracing::info!(
                "downloading {file} ({:.1} MB, from {:.1} MB on)",
                mb(n),
                mb(start)
            ),
            Some(n) => tracing::info!("downloading {file} ({:.1} MB)", mb(n)),
            None => tracing::info!("downloading {file}"),
        }
        return None;
    }
    let b = indicatif::ProgressBar::new(size.unwrap_or(0));
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg:>24} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        b.set_style(style.progress_chars("=> "));
    }
    b.set_message(file.to_string());
    b.set_position(start);
    Some(b)
}

/// Why one file could not be had: the hub lacks it (HTTP 404: an optional file is then
/// skipped), or anything else. Both in words that name the file and the URL.
#[derive(Debug)]
enum Fail {
    Missing(String),
    Error(String),
}

impl Fail {
    fn message(self) -> String {
        match self {
            Fail::Missing(m) | Fail::Error(m) => m,
        }
    }
}

/// Which of the two timeouts a request runs under, for messages.
#[derive(Clone, Copy)]
enum Phase {
    /// The metadata request (HF_HUB_ETAG_TIMEOUT).
    Meta,
    /// The body (HF_HUB_DOWNLOAD_TIMEOUT).
    Body,
}

/// Whether `e` or an error under it is a timeout (a socket read timeout shows as WouldBlock
/// on Unix).
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(err) = at {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ) {
                return true;
            }
        }
        at = err.source();
    }
    e.to_string().contains("timed out")
}

/// The scheme, host and port of `url` (`https://huggingface.co`).
fn origin(url: &str) -> &str {
    let rest = url.find("://").map_or(0, |i| i + 3);
    match url[rest..].find('/') {
        Some(i) => &url[..rest + i],
        None => url,
    }
}

/// Whether a redirect's `location` names a host (huggingface_hub follows only those that do
/// not: the same hub, e.g. a renamed repository).
fn names_host(location: &str) -> bool {
    location.starts_with("//") || location.contains("://")
}

/// A redirect's `location` read against the URL `base` it came from.
fn join(base: &str, location: &str) -> String {
    if location.contains("://") {
        location.to_string()
    } else if location.starts_with("//") {
        let scheme = base.split("://").next().unwrap_or("https");
        format!("{scheme}:{location}")
    } else if location.starts_with('/') {
        format!("{}{location}", origin(base))
    } else {
        let path = base.split(['?', '#']).next().unwrap_or(base);
        let dir = path.rfind('/').map_or(path, |i| &path[..=i]);
        format!("{dir}{location}")
    }
}

/// A header's value as text, when there is one.
fn header(r: &ureq::Response, name: &str) -> Option<String> {
    r.header(name)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Whether `s` (a commit hash or an etag, each the name of a folder or file of the cache) is a
/// plain name: letters, digits, `-`, `_`, `.`, not `.` or `..`.
fn plain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 200
        && s != "."
        && s != ".."
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Whether `etag` is a SHA-256 in hex, as an LFS file's is (the hash of its content).
fn is_sha256(etag: &str) -> bool {
    etag.len() == 64 && etag.chars().all(|c| c.is_ascii_hexdigit())
}

/// What the hub says of one file before its body is read.
struct Meta {
    /// `X-Repo-Commit`: the snapshot folder.
    commit: String,
    /// `X-Linked-Etag` or `ETag`, without quotes or `W/`: the blob name.
    etag: String,
    /// `X-Linked-Size` or `Content-Length`, when sent.
    size: Option<u64>,
    /// Where the body is: the CDN an absolute redirect names, else the resolve URL.
    location: String,
}

/// What a download thread and the caller waiting for it share.
struct Shared {
    /// Set by the waiter on a stop request: the thread ends at its next read.
    cancel: AtomicBool,
    /// Bytes of the file on disk so far, and its announced size (`u64::MAX` while unknown).
    received: AtomicU64,
    size: AtomicU64,
}

impl Shared {
    fn new() -> Self {
        Self {
            cancel: AtomicBool::new(false),
            received: AtomicU64::new(0),
            size: AtomicU64::new(u64::MAX),
        }
    }

    /// " after N of M bytes" (" after N bytes" while the size is unknown; nothing before
    /// anything is known).
    fn after(&self) -> String {
        match (
            self.received.load(Ordering::SeqCst),
            self.size.load(Ordering::SeqCst),
        ) {
            (0, u64::MAX) => String::new(),
            (n, u64::MAX) => format!(" after {n} bytes"),
            (n, m) => format!(" after {n} of {m} bytes"),
        }
    }
}

/// The part of a file on disk while it downloads (`blobs/<etag>.incomplete`), with the hash of
/// what it holds.
struct Part {
    path: PathBuf,
    out: std::fs::File,
    hasher: sha2::Sha256,
}

/// Hashes the part an interrupted download of an LFS file left at `path` into `hasher`: its
/// length, where the download goes on. 0 when there is none, when the file's size is unknown,
/// or when the part is not shorter than the file (it then starts over).
fn resume_from(path: &Path, size: Option<u64>, hasher: &mut sha2::Sha256) -> std::io::Result<u64> {
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(_) => return Ok(0),
    };
    match size {
        Some(n) if len > 0 && len < n => {}
        _ => return Ok(0),
    }
    std::io::copy(&mut std::fs::File::open(path)?, hasher)?;
    Ok(len)
}

/// Seconds of `t` for messages (`10`, `0.5`).
fn secs(t: Duration) -> String {
    format!("{}", t.as_secs_f64())
}

/// One file's download, owned so that it runs on a thread of its own.
struct Job {
    file: String,
    /// `{endpoint}/{id}/resolve/main/{file}`.
    url: String,
    /// The repository's folder in the cache (`models--org--name`) and its lock folder
    /// (`.locks/models--org--name`, where huggingface_hub keeps its locks).
    repo: PathBuf,
    locks: PathBuf,
    s: HubSettings,
    /// Clients with the metadata and the body timeouts; neither follows redirects itself.
    meta: ureq::Agent,
    body: ureq::Agent,
}

impl Job {
    /// The file in the cache: its metadata, its blob (downloaded unless there already),
    /// its snapshot link and refs/main.
    fn run(&self, sh: &Shared) -> Result<PathBuf, Fail> {
        let mut hops = 0;
        let meta = self.metadata(&mut hops)?;
        if let Some(n) = meta.size {
            sh.size.store(n, Ordering::SeqCst);
        }
        let blob = self.repo.join("blobs").join(&meta.etag);
        if !self.complete(&blob, meta.size) {
            let _lock = self.lock(&meta.etag, sh)?;
            // Another process may have downloaded it while this one waited.
            if !self.complete(&blob, meta.size) {
                self.fetch_body(&meta, &blob, &mut hops, sh)?;
            }
        }
        self.link(&meta).map_err(Fail::Error)
    }

    /// Whether `blob` is there with the announced size (a blob of another size, left by an
    /// older client, is downloaded again).
    fn complete(&self, blob: &Path, size: Option<u64>) -> bool {
        match (std::fs::metadata(blob), size) {
            (Ok(m), Some(n)) if m.is_file() && m.len() != n => {
                tracing::warn!(
                    "{}: the cached blob {} has {} bytes, the hub announces {n}: downloading it again",
                    self.file,
                    blob.display(),
                    m.len()
                );
                false
            }
            (Ok(m), _) => m.is_file(),
            (Err(_), _) => false,
        }
    }

    /// One request without following redirects: `Range: bytes=from-` when `from` > 0, the
    /// token only to the endpoint's host (not to the CDN), no compression (sizes are the
    /// file's).
    fn request(
        &self,
        phase: Phase,
        method: &str,
        url: &str,
        from: u64,
    ) -> Result<ureq::Response, Fail> {
        let agent = match phase {
            Phase::Meta => &self.meta,
            Phase::Body => &self.body,
        };
        let mut r = agent
            .request(method, url)
            .set("Accept-Encoding", "identity")
            .set(
                "User-Agent",
                concat!("main_ppo/", env!("CARGO_PKG_VERSION")),
            );
        if from > 0 {
            r = r.set("Range", &format!("bytes={from}-"));
        }
        if let Some(t) = &self.s.token {
            if origin(url) == origin(&self.s.endpoint) {
                r = r.set("Authorization", &format!("Bearer {t}"));
            }
        }
        r.call().map_err(|e| self.explain(phase, url, e))
    }

    /// A request's failure, in words a user can act on.
    fn explain(&self, phase: Phase, url: &str, e: ureq::Error) -> Fail {
        let file = &self.file;
        match e {
            ureq::Error::Status(code, r) => {
                let hub = header(&r, "x-error-message")
                    .map(|m| format!(" (the hub says: {m})"))
                    .unwrap_or_default();
                match code {
                    401 | 403 => Fail::Error(format!(
                        "{file}: HTTP {code} from {url}{hub}: the repository is gated or private; {}",
                        if self.s.token.is_some() {
                            "the token sent (HF_TOKEN or the saved login) was refused"
                        } else {
                            "set HF_TOKEN (or run `huggingface-cli login`)"
                        }
                    )),
                    404 => Fail::Missing(format!(
                        "{file}: not found at {url} (HTTP 404){hub}; check the model id"
                    )),
                    _ => Fail::Error(format!("{file}: HTTP {code} from {url}{hub}")),
                }
            }
            ureq::Error::Transport(t) if timed_out(&t) => {
                Fail::Error(self.timeout_message(phase, url, ""))
            }
            ureq::Error::Transport(t) => Fail::Error(format!(
                "{file}: cannot reach {} ({t}); set HF_HUB_OFFLINE=1 to use only the local cache, or HF_ENDPOINT for a mirror",
                origin(url)
            )),
        }
    }

    fn timeout_message(&self, phase: Phase, url: &str, after: &str) -> String {
        let (var, t) = match phase {
            Phase::Meta => ("HF_HUB_ETAG_TIMEOUT", self.s.etag_timeout),
            Phase::Body => ("HF_HUB_DOWNLOAD_TIMEOUT", self.s.download_timeout),
        };
        format!(
            "{}: nothing from {url} for {} s{after} ({var}={}; raise it for a slow connection)",
            self.file,
            secs(t),
            secs(t)
        )
    }

    /// Counts a redirect to `next`; refused past [`MAX_REDIRECTS`].
    fn hop(&self, hops: &mut usize, next: &str) -> Result<(), Fail> {
        *hops += 1;
        if *hops > MAX_REDIRECTS {
            return Err(Fail::Error(format!(
                "{}: more than {MAX_REDIRECTS} redirects from {}, the last to {next}",
                self.file, self.url
            )));
        }
        Ok(())
    }

    /// The redirect target of `r` (from `url`), when it is a redirect.
    fn redirect(&self, r: &ureq::Response, url: &str) -> Result<Option<String>, Fail> {
        if !(300..400).contains(&r.status()) {
            return Ok(None);
        }
        let to = header(r, "location").ok_or_else(|| {
            Fail::Error(format!(
                "{}: HTTP {} from {url} without a Location header",
                self.file,
                r.status()
            ))
        })?;
        Ok(Some(to))
    }

    /// huggingface_hub's metadata request: HEAD of the resolve URL, relative redirects
    /// followed (a renamed repository), an absolute one (the CDN) not: its headers are the
    /// file's, its target where the body is.
    fn metadata(&self, hops: &mut usize) -> Result<Meta, Fail> {
        let mut url = self.url.clone();
        loop {
            let r = self.request(Phase::Meta, "HEAD", &url, 0)?;
            let location = match self.redirect(&r, &url)? {
                Some(to) => {
                    let next = join(&url, &to);
                    self.hop(hops, &next)?;
                    if !names_host(&to) {
                        url = next;
                        continue;
                    }
                    Some(next)
                }
                None => None,
            };
            return self.meta_of(&r, &url, location);
        }
    }

    /// The metadata in the headers of `r`, the answer from `url`.
    fn meta_of(
        &self,
        r: &ureq::Response,
        url: &str,
        location: Option<String>,
    ) -> Result<Meta, Fail> {
        let file = &self.file;
        let refuse = |what: String| {
            Fail::Error(format!(
                "{file}: {url} {what} (is HF_ENDPOINT={} a Hugging Face hub?)",
                self.s.endpoint
            ))
        };
        let commit = header(r, "x-repo-commit")
            .ok_or_else(|| refuse("sent no X-Repo-Commit header".into()))?;
        let etag = header(r, "x-linked-etag")
            .or_else(|| header(r, "etag"))
            .map(|e| e.trim_start_matches("W/").trim_matches('"').to_string())
            .ok_or_else(|| refuse("sent no ETag header".into()))?;
        if !plain(&commit) {
            return Err(refuse(format!(
                "sent X-Repo-Commit {commit:?}, not a commit hash"
            )));
        }
        if !plain(&etag) {
            return Err(refuse(format!("sent the ETag {etag:?}, not a blob name")));
        }
        // A redirect's Content-Length is its own body's, not the file's.
        let size = header(r, "x-linked-size").or_else(|| {
            location
                .is_none()
                .then(|| header(r, "content-length"))
                .flatten()
        });
        let size = match size {
            Some(v) => Some(
                v.parse::<u64>()
                    .map_err(|_| refuse(format!("sent the size {v:?}, not a number")))?,
            ),
            None => None,
        };
        Ok(Meta {
            commit,
            etag,
            size,
            location: location.unwrap_or_else(|| url.to_string()),
        })
    }

    /// The GET of the body, every redirect followed (within the limit); with the URL that
    /// answered.
    fn open_body(
        &self,
        meta: &Meta,
        from: u64,
        hops: &mut usize,
    ) -> Result<(ureq::Response, String), Fail> {
        let mut url = meta.location.clone();
        loop {
            let r = self.request(Phase::Body, "GET", &url, from)?;
            match self.redirect(&r, &url)? {
                Some(to) => {
                    url = join(&url, &to);
                    self.hop(hops, &url)?;
                }
                None => return Ok((r, url)),
            }
        }
    }

    /// Holds `.locks/models--org--name/<etag>.lock` (huggingface_hub's lock on the blob, an
    /// `flock`), waiting while another process downloads the same blob; gives up when the
    /// download is cancelled. Without locking (a file system that has none) it goes on
    /// unlocked.
    fn lock(&self, etag: &str, sh: &Shared) -> Result<Option<std::fs::File>, Fail> {
        let path = self.locks.join(format!("{etag}.lock"));
        let err = |e: std::io::Error| {
            Fail::Error(format!("{}: the lock {}: {e}", self.file, path.display()))
        };
        std::fs::create_dir_all(&self.locks).map_err(err)?;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(err)?;
        let mut told = false;
        loop {
            match f.try_lock() {
                Ok(()) => return Ok(Some(f)),
                Err(std::fs::TryLockError::WouldBlock) => {
                    if sh.cancel.load(Ordering::SeqCst) {
                        return Err(Fail::Error(format!("{}: download interrupted", self.file)));
                    }
                    if !told {
                        tracing::info!(
                            "{}: waiting for another process downloading it (lock {})",
                            self.file,
                            path.display()
                        );
                        told = true;
                    }
                    std::thread::sleep(POLL);
                }
                Err(std::fs::TryLockError::Error(e)) => {
                    tracing::warn!(
                        "{}: cannot lock {} ({e}); downloading without the lock",
                        self.file,
                        path.display()
                    );
                    return Ok(None);
                }
            }
        }
    }

    /// Downloads the body into `blobs/<etag>.incomplete` and renames it to `blob` when it has
    /// the announced size and (LFS files) the announced SHA-256. A part that fails these is
    /// removed; the part of an LFS file cut short (a timeout, a dropped connection, a stop) is
    /// kept, and the next download asks only for the rest.
    fn fetch_body(
        &self,
        meta: &Meta,
        blob: &Path,
        hops: &mut usize,
        sh: &Shared,
    ) -> Result<(), Fail> {
        let file = &self.file;
        let path = blob.with_file_name(format!("{}.incomplete", meta.etag));
        let io = |what: &str, e: std::io::Error| {
            Fail::Error(format!("{file}: {what} {}: {e}", path.display()))
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io("creating the folder of", e))?;
        }
        let lfs = is_sha256(&meta.etag);
        let mut hasher = sha2::Sha256::new();
        let mut from = match lfs {
            true => resume_from(&path, meta.size, &mut hasher).map_err(|e| io("reading", e))?,
            false => 0,
        };
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| io("creating", e))?;
        let mut part = Part {
            path: path.clone(),
            out,
            hasher,
        };
        let (resp, url) = self.open_body(meta, from, hops)?;
        let resumed = resp.status() == 206
            && header(&resp, "content-range")
                .is_some_and(|r| r.starts_with(&format!("bytes {from}-")));
        if from == 0 || !resumed {
            // A fresh start, or a server that sent the whole file again.
            part.out.set_len(0).map_err(|e| io("emptying", e))?;
            part.hasher = sha2::Sha256::new();
            from = 0;
        }
        sh.received.store(from, Ordering::SeqCst);
        let bar = progress_bar(self.s.progress, file, meta.size, from);
        let got = self.read_body(
            resp.into_reader(),
            &mut part,
            &url,
            meta.size,
            sh,
            bar.as_ref(),
        );
        if let Some(b) = &bar {
            b.finish_and_clear();
        }
        let Part { out, hasher, .. } = part;
        drop(out);
        let remove = || {
            let _ = std::fs::remove_file(&path);
        };
        let received = got.inspect_err(|_| {
            if !lfs {
                remove();
            }
        })?;
        if let Some(size) = meta.size.filter(|&n| n != received) {
            remove();
            return Err(Fail::Error(format!(
                "{file}: received {received} of {size} bytes from {url}: the body ended early; nothing was cached"
            )));
        }
        if lfs {
            let sha = format!("{:x}", hasher.finalize());
            if sha != meta.etag {
                remove();
                return Err(Fail::Error(format!(
                    "{file}: the content from {url} has SHA-256 {sha}, the hub announced {} (X-Linked-Etag); refused, nothing was cached",
                    meta.etag
                )));
            }
        }
        std::fs::rename(&path, blob).map_err(|e| io("renaming to the blob", e))
    }

    /// Copies `body` into `part` (and its hash) read by read, looking at the stop flag before
    /// each: the bytes on disk at the end. More bytes than `size` are refused (the part is
    /// emptied).
    fn read_body(
        &self,
        mut body: impl Read,
        part: &mut Part,
        url: &str,
        size: Option<u64>,
        sh: &Shared,
        bar: Option<&indicatif::ProgressBar>,
    ) -> Result<u64, Fail> {
        let file = &self.file;
        let mut buf = vec![0u8; 1 << 16];
        let mut n = sh.received.load(Ordering::SeqCst);
        loop {
            if sh.cancel.load(Ordering::SeqCst) {
                return Err(Fail::Error(format!(
                    "{file}: download interrupted{}",
                    sh.after()
                )));
            }
            let k = match body.read(&mut buf) {
                Ok(0) => return Ok(n),
                Ok(k) => k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if timed_out(&e) => {
                    return Err(Fail::Error(self.timeout_message(
                        Phase::Body,
                        url,
                        &sh.after(),
                    )))
                }
                Err(e) => {
                    return Err(Fail::Error(format!(
                        "{file}: reading {url} failed{}: {e}",
                        sh.after()
                    )))
                }
            };
            if let Some(m) = size.filter(|&m| n + k as u64 > m) {
                let _ = part.out.set_len(0);
                return Err(Fail::Error(format!(
                    "{file}: {url} sent more than the {m} bytes the hub announced; nothing was cached"
                )));
            }
            part.hasher.update(&buf[..k]);
            part.out.write_all(&buf[..k]).map_err(|e| {
                Fail::Error(format!("{file}: writing {}: {e}", part.path.display()))
            })?;
            n += k as u64;
            sh.received.store(n, Ordering::SeqCst);
            if let Some(b) = bar {
                b.inc(k as u64);
            }
        }
    }

    /// Points `snapshots/<commit>/<file>` at `blobs/<etag>` (a relative symlink, as
    /// huggingface_hub makes it) and `refs/main` at the commit.
    fn link(&self, meta: &Meta) -> Result<PathBuf, String> {
        let pointer = self
            .repo
            .join("snapshots")
            .join(&meta.commit)
            .join(&self.file);
        let io = |what: &str, p: &Path, e: std::io::Error| {
            format!("{}: {what} {}: {e}", self.file, p.display())
        };
        if let Some(dir) = pointer.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, e))?;
        }
        if pointer.symlink_metadata().is_ok() {
            std::fs::remove_file(&pointer).map_err(|e| io("replacing", &pointer, e))?;
        }
        #[cfg(unix)]
        {
            let up = "../".repeat(self.file.split('/').count() + 1);
            let target = format!("{up}blobs/{}", meta.etag);
            std::os::unix::fs::symlink(target, &pointer).map_err(|e| io("linking", &pointer, e))?;
        }
        #[cfg(not(unix))]
        std::fs::copy(self.repo.join("blobs").join(&meta.etag), &pointer)
            .map_err(|e| io("copying the blob to", &pointer, e))?;
        let refs = self.repo.join("refs");
        std::fs::create_dir_all(&refs).map_err(|e| io("creating", &refs, e))?;
        let main = refs.join("main");
        std::fs::write(&main, &meta.commit).map_err(|e| io("writing", &main, e))?;
        Ok(pointer)
    }
}

/// Runs `job` on a thread of its own and waits for it, looking at `stop` every [`POLL`]: a
/// stop request returns at once with an "interrupted" error (the thread sees it at its next
/// read and ends within the read timeout, leaving nothing in the cache but the part of an LFS
/// file).
fn wait_for(job: Job, stop: &AtomicBool) -> Result<PathBuf, Fail> {
    let file = job.file.clone();
    let shared = Arc::new(Shared::new());
    let interrupted = |sh: &Shared| {
        Fail::Error(format!(
            "{file}: download interrupted (a stop was requested: Ctrl-C or SIGTERM){}",
            sh.after()
        ))
    };
    if stop.load(Ordering::SeqCst) {
        return Err(interrupted(&shared));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let sh = shared.clone();
    std::thread::Builder::new()
        .name("hub download".into())
        .spawn(move || {
            let _ = tx.send(job.run(&sh));
        })
        .map_err(|e| Fail::Error(format!("{file}: cannot start a download thread: {e}")))?;
    loop {
        match rx.recv_timeout(POLL) {
            Ok(r) => return r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if stop.load(Ordering::SeqCst) {
                    shared.cancel.store(true, Ordering::SeqCst);
                    return Err(interrupted(&shared));
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Fail::Error(format!(
                    "{file}: the download thread ended without an answer"
                )))
            }
        }
    }
}

/// A client with `timeout` to connect, to send and for each read; it follows no redirect
/// (they are followed one by one, counted).
fn agent(timeout: Duration) -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(timeout)
        .timeout_read(timeout)
        .timeout_write(timeout)
        .redirects(0)
        .try_proxy_from_env(true)
        .build()
}

/// Counts a download under way while it lives (for [`request_stop`]'s answer).
struct Active;

impl Active {
    fn enter() -> Self {
        ACTIVE.fetch_add(1, Ordering::SeqCst);
        Active
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Downloads what the cache lacks of hub model `id` (revision main) and returns the snapshot.
fn download(id: &str, s: &HubSettings, stop: &AtomicBool) -> Result<PathBuf, String> {
    if let Some(bad) = &s.invalid {
        return Err(bad.clone());
    }
    let _active = Active::enter();
    let (meta, body) = (agent(s.etag_timeout), agent(s.download_timeout));
    let cached = cache_repo(id, &s.cache);
    let repo = repo_folder(id, &s.cache);
    let locks = s
        .cache
        .join(".locks")
        .join(repo.file_name().unwrap_or_default());
    let fetch = |file: &str| match cached.get(file) {
        Some(p) => Ok(p),
        None => wait_for(
            Job {
                file: file.to_string(),
                url: format!("{}/{id}/resolve/main/{file}", s.endpoint),
                repo: repo.clone(),
                locks: locks.clone(),
                s: s.clone(),
                meta: meta.clone(),
                body: body.clone(),
            },
            stop,
        ),
    };
    tracing::info!(
        "downloading {id} from {} into {}",
        s.endpoint,
        s.cache.display()
    );
    for f in REQUIRED {
        fetch(f).map_err(Fail::message)?;
    }
    for f in OPTIONAL {
        match fetch(f) {
            Ok(_) | Err(Fail::Missing(_)) => {}
            Err(e) => return Err(e.message()),
        }
    }
    // The weights: model.safetensors, else the index and the shards it names.
    match fetch(WEIGHTS) {
        Ok(_) => {}
        Err(Fail::Missing(_)) => match fetch(INDEX) {
            Ok(index) => {
                for shard in shards(&index)? {
                    fetch(&shard).map_err(Fail::message)?;
                }
            }
            Err(Fail::Missing(_)) => {
                return Err(format!(
                    "the repository has neither {WEIGHTS} nor {INDEX} (HTTP 404 for both under {}/{id}/resolve/main/): only safetensors weights are read",
                    s.endpoint
                ))
            }
            Err(e) => return Err(e.message()),
        },
        Err(e) => return Err(e.message()),
    }
    cached_snapshot(id, &s.cache)
}

/// The local directory of hub model `id` under `settings`: the cached snapshot, else (unless
/// offline) a fresh download into the cache, which a stop request ([`request_stop`]) ends.
pub fn resolve_with(id: &str, settings: &HubSettings) -> Result<PathBuf, ModelError> {
    resolve_with_stop(id, settings, &STOP)
}

/// [`resolve_with`] with its own stop flag: a download returns an "interrupted" error within
/// [`POLL`] of `stop` being set.
pub fn resolve_with_stop(
    id: &str,
    settings: &HubSettings,
    stop: &AtomicBool,
) -> Result<PathBuf, ModelError> {
    let fail = |message: String| ModelError::File {
        file: id.to_string(),
        message,
    };
    match cached_snapshot(id, &settings.cache) {
        Ok(dir) => Ok(dir),
        Err(why) if settings.offline => Err(fail(format!(
            "{why}; HF_HUB_OFFLINE is set, so nothing is downloaded (unset it, or put the model there with `huggingface-cli download {id}`, or point the path at a local directory)"
        ))),
        Err(_) => download(id, settings, stop)
            .map_err(|e| fail(format!("downloading from the hub: {e}"))),
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
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use axum::body::Body;
    use axum::http::{header, Method, StatusCode};
    use axum::response::Response;

    const COMMIT: &str = "89abcdef0123456789abcdef0123456789abcdef";

    /// Requests the fake hub saw: path and Authorization header (or Range header).
    type Log = Arc<Mutex<Vec<(String, Option<String>)>>>;
    /// Repositories of the fake hub: id, then file name and content.
    type Repos = HashMap<String, HashMap<String, Vec<u8>>>;
    /// How the fake hub misbehaves, by `org/name/file`.
    type Faults = HashMap<String, Vec<Fault>>;

    /// One way a file is served otherwise than plainly.
    #[derive(Clone, Debug)]
    enum Fault {
        /// As an LFS file: `X-Linked-Etag` this SHA-256 (the content's or not) and
        /// `X-Linked-Size`.
        Lfs(String),
        /// Announces this many bytes (`X-Linked-Size`, `Content-Range`) and sends the body it has.
        Short(usize),
        /// Sends this many bytes of the body, then nothing for 20 s (the connection stays open).
        Stall(usize),
        /// Answers a metadata request after 20 s only.
        Silent,
        /// Answers every request with 307 to itself (a relative `Location`).
        Loop,
        /// Answers every request with 307 to the same file of this repository (a relative
        /// `Location`, as the hub answers for a renamed repository).
        Renamed(String),
        /// Answers every request with 302 to the same path on this host (an absolute
        /// `Location`, as the hub sends LFS files to its CDN), with the file's headers.
        Cdn(String),
    }

    /// A stand-in for the hub on 127.0.0.1, answering `/{org}/{name}/resolve/main/{file}` as
    /// huggingface.co does for the requests huggingface_hub makes: an `ETag` (the blob name),
    /// `X-Repo-Commit`, `HEAD` answered with the headers and `Content-Length`, and `Range`
    /// requests answered 206 with `Content-Range`; 404 for files it lacks; [`Fault`]s where
    /// asked. Repositories named `*gated*` answer 401 unless `Bearer hf_ok` is sent. Every
    /// request is logged with its Authorization header, and with its Range header.
    struct FakeHub {
        addr: SocketAddr,
        log: Log,
        ranges: Log,
        _stop: tokio::sync::oneshot::Sender<()>,
    }

    fn etag(body: &[u8]) -> String {
        // FNV-1a: any stable content hash names the blob.
        let h = body.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
        format!("{h:016x}")
    }

    fn sha256_hex(body: &[u8]) -> String {
        use sha2::Digest;
        format!("{:x}", sha2::Sha256::digest(body))
    }

    /// A body that sends its first part, then nothing until `wait` ends (then an error).
    struct Stall {
        first: Option<axum::body::Bytes>,
        len: u64,
        wait: std::pin::Pin<Box<tokio::time::Sleep>>,
    }

    impl hyper::body::Body for Stall {
        type Data = axum::body::Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
            use std::future::Future;
            use std::task::Poll;
            if let Some(b) = self.first.take() {
                return Poll::Ready(Some(Ok(hyper::body::Frame::data(b))));
            }
            match self.wait.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(std::io::Error::other("stalled")))),
                Poll::Pending => Poll::Pending,
            }
        }
        fn size_hint(&self) -> hyper::body::SizeHint {
            hyper::body::SizeHint::with_exact(self.len)
        }
    }

    /// The fake hub's answer to one request for `file` of repository `id`.
    async fn answer(
        head: bool,
        range: Option<&str>,
        path: &str,
        body: &[u8],
        faults: &[Fault],
    ) -> Response {
        let len = body.len();
        let range = range
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.split_once('-'))
            .map(|(a, b)| {
                let a: usize = a.parse().unwrap_or(0);
                let b: usize = b.parse().unwrap_or(len - 1).min(len - 1);
                (a, b)
            });
        if faults.iter().any(|f| matches!(f, Fault::Loop)) {
            return Response::builder()
                .status(StatusCode::TEMPORARY_REDIRECT)
                .header(header::LOCATION, path)
                .body(Body::empty())
                .unwrap();
        }
        for f in faults {
            if let Fault::Renamed(to) = f {
                let file = path.split_once("/resolve/main/").map_or("", |(_, f)| f);
                return Response::builder()
                    .status(StatusCode::TEMPORARY_REDIRECT)
                    .header(header::LOCATION, format!("/{to}/resolve/main/{file}"))
                    .body(Body::empty())
                    .unwrap();
            }
        }
        let mut announced = len;
        let mut b = Response::builder()
            .header(header::ETAG, format!("\"{}\"", etag(body)))
            .header("x-repo-commit", COMMIT);
        for f in faults {
            match f {
                Fault::Lfs(sha) => {
                    b = b
                        .header("x-linked-etag", format!("\"{sha}\""))
                        .header("x-linked-size", len)
                }
                Fault::Short(n) => {
                    announced = *n;
                    b = b.header("x-linked-size", *n)
                }
                _ => {}
            }
        }
        if let Some(cdn) = faults.iter().find_map(|f| match f {
            Fault::Cdn(host) => Some(host),
            _ => None,
        }) {
            return b
                .status(StatusCode::FOUND)
                .header(header::LOCATION, format!("{cdn}{path}"))
                .body(Body::empty())
                .unwrap();
        }
        // A metadata request: HEAD (huggingface_hub), or GET of the first byte (hf-hub).
        if head || range == Some((0, 0)) {
            if faults.iter().any(|f| matches!(f, Fault::Silent)) {
                tokio::time::sleep(Duration::from_secs(20)).await;
            }
            return match head {
                true => b.header(header::CONTENT_LENGTH, len).body(Body::empty()),
                false => b
                    .status(StatusCode::PARTIAL_CONTENT)
                    .header(header::CONTENT_RANGE, format!("bytes 0-0/{announced}"))
                    .body(Body::from(body[..1].to_vec())),
            }
            .unwrap();
        }
        let (start, end) = range.unwrap_or((0, len - 1));
        let part = axum::body::Bytes::from(body[start.min(len)..=end].to_vec());
        if range.is_some() {
            b = b.status(StatusCode::PARTIAL_CONTENT).header(
                header::CONTENT_RANGE,
                format!("bytes {start}-{end}/{announced}"),
            );
        }
        let stall = faults.iter().find_map(|f| match f {
            Fault::Stall(n) => Some(n.saturating_sub(start).min(part.len())),
            _ => None,
        });
        match stall {
            Some(n) => b.body(Body::new(Stall {
                first: Some(part.slice(..n)),
                len: part.len() as u64,
                wait: Box::pin(tokio::time::sleep(Duration::from_secs(20))),
            })),
            None => b.body(Body::from(part)),
        }
        .unwrap()
    }

    impl FakeHub {
        fn start(repos: Repos) -> Self {
            Self::with_faults(repos, Faults::new())
        }

        fn with_faults(repos: Repos, faults: Faults) -> Self {
            let (log, ranges): (Log, Log) = Default::default();
            let shared = Arc::new((repos, faults));
            let app = {
                let (log, ranges) = (log.clone(), ranges.clone());
                axum::Router::new().fallback(move |req: axum::extract::Request| {
                    let (log, ranges, shared) = (log.clone(), ranges.clone(), shared.clone());
                    async move {
                        let (repos, faults) = &*shared;
                        let path = req.uri().path().to_string();
                        let (auth, range, head) = {
                            let value = |h: header::HeaderName| {
                                req.headers()
                                    .get(h)
                                    .and_then(|v| v.to_str().ok())
                                    .map(str::to_string)
                            };
                            let head = req.method() == Method::HEAD;
                            (value(header::AUTHORIZATION), value(header::RANGE), head)
                        };
                        log.lock().unwrap().push((path.clone(), auth.clone()));
                        ranges.lock().unwrap().push((path.clone(), range.clone()));
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
                        let faults = faults
                            .get(&format!("{id}/{file}"))
                            .map(Vec::as_slice)
                            .unwrap_or_default();
                        answer(head, range.as_deref(), &path, body, faults).await
                    }
                })
            };
            let (tx_addr, rx_addr) = std::sync::mpsc::channel();
            let (stop, rx_stop) = tokio::sync::oneshot::channel::<()>();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .enable_time()
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
                ranges,
                _stop: stop,
            }
        }

        fn settings(&self, cache: &Path, token: Option<&str>) -> HubSettings {
            HubSettings {
                token: token.map(str::to_string),
                ..self.settings_with(cache, &[])
            }
        }

        /// Settings for this hub and `cache`, with the variables `vars` (HF_HUB_*_TIMEOUT).
        fn settings_with(&self, cache: &Path, vars: &[(&str, &str)]) -> HubSettings {
            let vars: HashMap<String, String> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            HubSettings {
                cache: cache.to_path_buf(),
                endpoint: format!("http://{}", self.addr),
                token: None,
                ..HubSettings::from_vars(|k| vars.get(k).cloned())
            }
        }

        fn requests(&self) -> Vec<(String, Option<String>)> {
            self.log.lock().unwrap().clone()
        }

        /// The Range headers of the requests for `path`, in order.
        fn ranges(&self, path: &str) -> Vec<Option<String>> {
            let log = self.ranges.lock().unwrap();
            log.iter()
                .filter(|(p, _)| p == path)
                .map(|(_, r)| r.clone())
                .collect()
        }
    }

    /// Runs `f` on a thread of its own: its result, or `None` when it has not returned (or
    /// panicked) after `secs` seconds (the thread is then left behind).
    fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(secs)).ok()
    }

    /// `resolve_with` on a thread of its own, given `secs` seconds: its error message.
    fn resolve_fails(id: &str, s: &HubSettings, secs: u64) -> String {
        let (id2, s) = (id.to_string(), s.clone());
        match within(secs, move || resolve_with(&id2, &s)) {
            Some(Ok(dir)) => panic!("{id} resolved to {}", dir.display()),
            Some(Err(e)) => e.to_string(),
            None => panic!("{id}: resolving still runs after {secs} s"),
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

    /// A server that stops sending mid-body, or never answers the metadata request, fails the
    /// download after HF_HUB_DOWNLOAD_TIMEOUT (HF_HUB_ETAG_TIMEOUT) seconds without data, naming
    /// the file and the variable; nothing of it enters the cache.
    #[test]
    fn a_stalled_server_times_out() {
        let files = tiny_model_files();
        let half = files["model.safetensors"].len() / 2;
        let hub = FakeHub::with_faults(
            HashMap::from([
                ("org/stall".to_string(), files.clone()),
                ("org/silent".to_string(), files),
            ]),
            HashMap::from([
                (
                    "org/stall/model.safetensors".into(),
                    vec![Fault::Stall(half)],
                ),
                ("org/silent/config.json".into(), vec![Fault::Silent]),
            ]),
        );
        let cache = tempfile::tempdir().unwrap();
        let s = hub.settings_with(
            cache.path(),
            &[
                ("HF_HUB_DOWNLOAD_TIMEOUT", "1"),
                ("HF_HUB_ETAG_TIMEOUT", "1"),
            ],
        );
        for (id, file, var) in [
            ("org/stall", "model.safetensors", "HF_HUB_DOWNLOAD_TIMEOUT"),
            ("org/silent", "config.json", "HF_HUB_ETAG_TIMEOUT"),
        ] {
            let t = Instant::now();
            let e = resolve_fails(id, &s, 15);
            assert!(
                t.elapsed() < Duration::from_secs(6),
                "{id}: {:?}",
                t.elapsed()
            );
            assert!(e.contains(file) && e.contains(var), "{e}");
        }
        let offline = HubSettings {
            offline: true,
            ..s.clone()
        };
        assert!(resolve_with("org/stall", &offline).is_err());
    }

    /// A relative redirect that leads back to itself is followed up to the limit, then refused
    /// naming the last URL: a handful of requests, not an endless loop.
    #[test]
    fn a_relative_redirect_loop_ends_at_the_limit() {
        let hub = FakeHub::with_faults(
            HashMap::from([("org/loop".to_string(), tiny_model_files())]),
            HashMap::from([("org/loop/config.json".into(), vec![Fault::Loop])]),
        );
        let cache = tempfile::tempdir().unwrap();
        let s = hub.settings(cache.path(), None);
        let r = within(10, move || resolve_with("org/loop", &s));
        let n = hub.requests().len();
        let e = r
            .unwrap_or_else(|| panic!("still following redirects after 10 s ({n} requests)"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("config.json")
                && e.contains("redirects")
                && e.contains("/org/loop/resolve/main/config.json"),
            "{e}"
        );
        assert!(n <= 12, "{n} requests");
    }

    /// A body shorter than the size the hub announced is refused naming the file and both
    /// sizes (not as "neither model.safetensors nor ..."), and nothing of it is usable from the
    /// cache afterwards, offline or not.
    #[test]
    fn a_short_body_is_refused_and_not_cached() {
        let files = tiny_model_files();
        let body = files["model.safetensors"].clone();
        let len = body.len();
        let hub = FakeHub::with_faults(
            HashMap::from([("org/short".to_string(), files)]),
            HashMap::from([(
                "org/short/model.safetensors".into(),
                vec![Fault::Short(2 * len)],
            )]),
        );
        let cache = tempfile::tempdir().unwrap();
        let s = hub.settings(cache.path(), None);
        let e = resolve_fails("org/short", &s, 15);
        let sizes = format!("received {len} of {} bytes", 2 * len);
        assert!(e.contains("model.safetensors") && e.contains(&sizes), "{e}");
        assert!(!e.contains("neither"), "{e}");
        let repo = cache.path().join("models--org--short");
        assert!(!repo.join("blobs").join(etag(&body)).exists());
        assert!(!repo
            .join("snapshots")
            .join(COMMIT)
            .join("model.safetensors")
            .exists());
        let offline = HubSettings {
            offline: true,
            ..s.clone()
        };
        let e = resolve_with("org/short", &offline).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("HF_HUB_OFFLINE"),
            "{e}"
        );
        // Online, it is asked for again (and refused again), not taken from the cache.
        let n = hub.requests().len();
        resolve_fails("org/short", &s, 15);
        assert!(hub.requests().len() > n);
    }

    /// An LFS file (its `X-Linked-Etag` a SHA-256) is stored as blobs/<sha256> when its content
    /// has that hash, and refused naming both hashes when not, leaving nothing in the cache.
    #[test]
    fn an_lfs_file_is_checked_against_its_sha256() {
        let files = tiny_model_files();
        let body = files["model.safetensors"].clone();
        let (right, wrong) = (sha256_hex(&body), sha256_hex(b"other weights"));
        let hub = FakeHub::with_faults(
            HashMap::from([
                ("org/good".to_string(), files.clone()),
                ("org/bad".to_string(), files),
            ]),
            HashMap::from([
                (
                    "org/good/model.safetensors".into(),
                    vec![Fault::Lfs(right.clone())],
                ),
                (
                    "org/bad/model.safetensors".into(),
                    vec![Fault::Lfs(wrong.clone())],
                ),
            ]),
        );
        let cache = tempfile::tempdir().unwrap();
        let s = hub.settings(cache.path(), None);
        let s2 = s.clone();
        let dir = within(15, move || resolve_with("org/good", &s2))
            .expect("org/good: still resolving after 15 s")
            .unwrap();
        let good = cache.path().join("models--org--good/blobs");
        assert!(good.join(&right).is_file());
        assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), body);
        let e = resolve_fails("org/bad", &s, 15);
        assert!(
            e.contains("model.safetensors") && e.contains(&right) && e.contains(&wrong),
            "{e}"
        );
        let bad = cache.path().join("models--org--bad/blobs");
        assert!(!bad.join(&wrong).exists());
        assert!(!bad.join(format!("{wrong}.incomplete")).exists());
        let offline = HubSettings { offline: true, ..s };
        assert!(resolve_with("org/bad", &offline).is_err());
    }

    /// A stop request (the CLI's Ctrl-C / SIGTERM) ends a download stalled mid-body within a
    /// second or so, with an error that says so, without waiting for the read timeout.
    #[test]
    fn a_stop_request_ends_a_stalled_download() {
        let files = tiny_model_files();
        let half = files["model.safetensors"].len() / 2;
        let hub = FakeHub::with_faults(
            HashMap::from([("org/stall".to_string(), files)]),
            HashMap::from([(
                "org/stall/model.safetensors".into(),
                vec![Fault::Stall(half)],
            )]),
        );
        let cache = tempfile::tempdir().unwrap();
        let s = hub.settings(cache.path(), None);
        let stop = Arc::new(AtomicBool::new(false));
        let t = Instant::now();
        {
            let stop = stop.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(1));
                stop.store(true, Ordering::SeqCst);
            });
        }
        let r = within(8, move || resolve_with_stop("org/stall", &s, &stop));
        let e = r
            .expect("still downloading 7 s after the stop request")
            .unwrap_err()
            .to_string();
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        assert!(
            e.contains("model.safetensors") && e.contains("interrupted"),
            "{e}"
        );
    }

    /// An LFS download cut short keeps what arrived as blobs/<sha256>.incomplete (the hash
    /// checks the whole file at the end); the next run asks only for the rest.
    #[test]
    fn an_lfs_download_cut_short_resumes() {
        let files = tiny_model_files();
        let body = files["model.safetensors"].clone();
        let (sha, half) = (sha256_hex(&body), body.len() / 2);
        let key = "org/big/model.safetensors".to_string();
        let repos = HashMap::from([("org/big".to_string(), files)]);
        let stalled = FakeHub::with_faults(
            repos.clone(),
            HashMap::from([(
                key.clone(),
                vec![Fault::Lfs(sha.clone()), Fault::Stall(half)],
            )]),
        );
        let cache = tempfile::tempdir().unwrap();
        let s = stalled.settings_with(cache.path(), &[("HF_HUB_DOWNLOAD_TIMEOUT", "1")]);
        resolve_fails("org/big", &s, 15);
        let blobs = cache.path().join("models--org--big/blobs");
        let part = blobs.join(format!("{sha}.incomplete"));
        assert_eq!(std::fs::metadata(&part).unwrap().len(), half as u64);
        let hub =
            FakeHub::with_faults(repos, HashMap::from([(key, vec![Fault::Lfs(sha.clone())])]));
        let s = hub.settings(cache.path(), None);
        let dir = within(15, move || resolve_with("org/big", &s))
            .expect("still resolving after 15 s")
            .unwrap();
        assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), body);
        assert!(blobs.join(&sha).is_file() && !part.exists());
        let gets: Vec<Option<String>> = hub.ranges("/org/big/resolve/main/model.safetensors");
        assert!(gets.contains(&Some(format!("bytes={half}-"))), "{gets:?}");
    }

    /// A relative redirect (a renamed repository) is followed with the token; an absolute one
    /// (the CDN) ends the metadata request, its headers are the file's, and the body comes
    /// from the CDN without the token.
    #[test]
    fn redirects_are_followed_as_huggingface_hub_follows_them() {
        let files = tiny_model_files();
        let body = files["model.safetensors"].clone();
        let sha = sha256_hex(&body);
        let cdn = FakeHub::start(HashMap::from([("org/new".to_string(), files.clone())]));
        let mut faults: Faults = files
            .keys()
            .map(|f| {
                (
                    format!("org/old/{f}"),
                    vec![Fault::Renamed("org/new".into())],
                )
            })
            .collect();
        faults.insert(
            "org/new/model.safetensors".into(),
            vec![
                Fault::Lfs(sha.clone()),
                Fault::Cdn(format!("http://{}", cdn.addr)),
            ],
        );
        let hub = FakeHub::with_faults(
            HashMap::from([
                ("org/old".to_string(), files.clone()),
                ("org/new".to_string(), files),
            ]),
            faults,
        );
        let cache = tempfile::tempdir().unwrap();
        let s = hub.settings(cache.path(), Some("hf_secret"));
        let dir = within(15, move || resolve_with("org/old", &s))
            .expect("still resolving after 15 s")
            .unwrap();
        assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), body);
        let blobs = cache.path().join("models--org--old/blobs");
        assert!(blobs.join(&sha).is_file());
        let reqs = hub.requests();
        assert!(
            reqs.iter()
                .any(|(p, _)| p == "/org/new/resolve/main/model.safetensors"),
            "{reqs:?}"
        );
        assert!(reqs
            .iter()
            .all(|(_, a)| a.as_deref() == Some("Bearer hf_secret")));
        let at_cdn = cdn.requests();
        assert_eq!(
            at_cdn,
            vec![("/org/new/resolve/main/model.safetensors".to_string(), None)]
        );
    }

    /// HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT: seconds, 10 when unset or 0 (as
    /// huggingface_hub reads them); anything else refuses a download, naming the variable,
    /// before any request (a cached model is still found).
    #[test]
    fn timeout_variables_are_read_as_huggingface_hub_reads_them() {
        let vars = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            HubSettings::from_vars(move |k| m.get(k).cloned())
        };
        let s = vars(&[]);
        let ten = Duration::from_secs(10);
        assert_eq!(
            (s.etag_timeout, s.download_timeout, s.invalid),
            (ten, ten, None)
        );
        let s = vars(&[
            ("HF_HUB_ETAG_TIMEOUT", "0"),
            ("HF_HUB_DOWNLOAD_TIMEOUT", " 2.5 "),
        ]);
        assert_eq!(s.etag_timeout, ten);
        assert_eq!(s.download_timeout, Duration::from_millis(2500));
        for bad in ["abc", "-1", "inf"] {
            let s = vars(&[("HF_HUB_DOWNLOAD_TIMEOUT", bad)]);
            let e = s.invalid.unwrap();
            assert!(e.contains(&format!("HF_HUB_DOWNLOAD_TIMEOUT={bad}")), "{e}");
        }
        let hub = FakeHub::start(HashMap::from([(
            "org/tiny".to_string(),
            tiny_model_files(),
        )]));
        let cache = tempfile::tempdir().unwrap();
        let s = hub.settings_with(cache.path(), &[("HF_HUB_ETAG_TIMEOUT", "soon")]);
        let e = resolve_fails("org/tiny", &s, 15);
        assert!(e.contains("HF_HUB_ETAG_TIMEOUT=soon"), "{e}");
        assert!(hub.requests().is_empty());
    }
}
