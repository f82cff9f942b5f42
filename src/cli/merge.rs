//! `main_ppo merge` (verl's `python -m verl.model_merger merge --backend fsdp --local_dir DIR
//! --target_dir OUT`): a checkpoint (LoRA or full), a LoRA adapter folder with its base model,
//! or a model, written as one HF model folder ([`crate::weights::merge`]), or with `--gguf
//! f32|f16|bf16` as one GGUF file for llama.cpp, Ollama and LM Studio
//! ([`crate::weights::gguf_write`]): `--target_dir out/` writes `out/model-<type>.gguf`,
//! `--target_dir out/name.gguf` that file.
//!
//! The target is never one of the inputs: it may not be, lie inside or contain the checkpoint,
//! the adapter or the base model; an existing non-empty target is replaced only with
//! `--force`. The model is written into a hidden folder beside the target, made before anything
//! is loaded (a target that cannot be written is refused at once), and renamed into place, so an
//! interrupted merge leaves no half-written model under the target's name; what a killed merge
//! left beside the target is cleaned by the next merge into it. A GGUF file is written the same
//! way: a hidden file beside it, renamed over it when complete.

use std::path::{Component, Path, PathBuf};

use clap::Args;

use crate::config::ConfigError;
use crate::weights::gguf_write::GgufType;
use crate::weights::merge::{self, Source};

#[derive(Debug, Args)]
pub struct MergeArgs {
    /// What to merge: a checkpoint's global_step_N/ (its actor) or its actor/ or critic/ folder
    /// (LoRA or full), a LoRA adapter folder (with its base model), or a model (an HF folder
    /// or a .gguf file, written as an HF model).
    #[arg(long = "local_dir", visible_alias = "local-dir", value_name = "DIR")]
    pub local_dir: PathBuf,
    /// The HF model folder to write: new or empty (an existing one only with --force); not
    /// inside the inputs. With --gguf: the folder to write model-<TYPE>.gguf into, or the
    /// .gguf file itself (an existing file is replaced only with --force).
    #[arg(long = "target_dir", visible_alias = "target-dir", value_name = "DIR")]
    pub target_dir: PathBuf,
    /// Write one GGUF file (llama.cpp, Ollama, LM Studio) instead of an HF folder, its
    /// matrices in TYPE: f32, f16 or bf16 (norms and biases stay f32, as llama.cpp's
    /// converter keeps them); the tokenizer and chat template go inside. Families: llama
    /// (SmolLM2), qwen2, qwen3, qwen3moe, gemma3.
    #[arg(long, value_name = "TYPE")]
    pub gguf: Option<String>,
    /// The base model of LoRA adapters (an HF folder, a .gguf file or a hub id); default: the
    /// adapter's adapter_config.json `base_model_name_or_path`.
    #[arg(long, value_name = "MODEL", visible_alias = "hf_model_path")]
    pub base: Option<String>,
    /// Replace an existing non-empty --target_dir (or, with --gguf, an existing file).
    #[arg(long)]
    pub force: bool,
    /// verl's checkpoint backend: `fsdp` (this program's checkpoint layout) only.
    #[arg(long, value_name = "fsdp", default_value = "fsdp")]
    pub backend: String,
}

fn usage(key: &str, message: String) -> ConfigError {
    ConfigError::Value {
        key: key.into(),
        message,
    }
}

pub fn run(args: &MergeArgs) -> anyhow::Result<()> {
    if !args.backend.eq_ignore_ascii_case("fsdp") {
        return Err(usage(
            "--backend",
            format!(
                "`{}` is not supported: this program's checkpoints are merged as verl's fsdp ones (--backend fsdp)",
                args.backend
            ),
        )
        .into());
    }
    let gguf = match args.gguf.as_deref() {
        None => None,
        Some(t) => Some(GgufType::parse(t).ok_or_else(|| {
            usage(
                "--gguf",
                format!(
                    "`{t}` is not a GGUF tensor type this program writes: {} (quantise the file further with llama.cpp's llama-quantize)",
                    GgufType::NAMES.join(", ")
                ),
            )
        })?),
    };
    let source = merge::resolve(&args.local_dir, args.base.as_deref())
        .map_err(|r| usage(r.flag, r.error.to_string()))?;
    if let Some(ty) = gguf {
        return run_gguf(args, &source, ty);
    }
    // First what killed merges into the target left (a target moved aside is put back, and
    // then checked as any other).
    clean_leftovers(&args.target_dir);
    check_target(&args.target_dir, &inputs(args, &source), args.force)?;
    // The hidden folder is made before anything is loaded: a target that cannot be written is
    // refused now, not after the merge.
    let partial = Partial::create(&args.target_dir)?;
    let merged = merge::merge(&source)?;
    partial.commit(|dir| merge::save(&merged, dir))?;
    println!("merged: {}", merged.summary);
    println!("wrote {}", args.target_dir.display());
    Ok(())
}

/// `merge --gguf`: the GGUF file `--target_dir` names (a `.gguf` path, or
/// `model-<type>.gguf` inside the folder it names), checked as a folder target is, written
/// into a hidden file beside it and renamed over it.
fn run_gguf(args: &MergeArgs, source: &Source, ty: GgufType) -> anyhow::Result<()> {
    let target = gguf_target(&args.target_dir, ty);
    clean_leftovers(&target);
    check_target_file(&target, &inputs(args, source), args.force)?;
    let partial = Partial::create_file(&target)?;
    let merged = merge::merge(source)?;
    let name = model_name(&args.local_dir);
    let mut counts = String::new();
    partial.commit(|file| {
        counts = merge::save_gguf(&merged, ty, &name, file, &target)?;
        Ok(())
    })?;
    println!("merged: {}", merged.summary);
    println!(
        "wrote {} (GGUF {}, general.name `{name}`; tensors: {counts})",
        target.display(),
        ty.name()
    );
    Ok(())
}

/// The file a `--gguf` merge writes: `target` itself when it ends in `.gguf`, else
/// `model-<type>.gguf` inside it.
pub fn gguf_target(target: &Path, ty: GgufType) -> PathBuf {
    if target
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        target.to_path_buf()
    } else {
        target.join(format!("model-{}.gguf", ty.name()))
    }
}

/// `general.name` of a merged model: the last folder of `local_dir` that is not a
/// checkpoint's inner folder (`actor`, `critic`, `huggingface`, `lora_adapter`), with the
/// folder above a `global_step_N` (`ckpt-global_step_N`); a `.gguf` file's stem.
fn model_name(local_dir: &Path) -> String {
    let abs = std::path::absolute(local_dir).unwrap_or_else(|_| local_dir.to_path_buf());
    let mut parts: Vec<String> = abs
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect();
    while parts.len() > 1
        && matches!(
            parts.last().map(String::as_str),
            Some("actor" | "critic" | "huggingface" | "lora_adapter" | "." | "")
        )
    {
        parts.pop();
    }
    let Some(last) = parts.pop() else {
        return "model".into();
    };
    let last = last
        .strip_suffix(".gguf")
        .map(str::to_string)
        .unwrap_or(last);
    match parts.last() {
        Some(parent) if last.starts_with("global_step_") => format!("{parent}-{last}"),
        _ => last,
    }
}

/// The folders and files `source` reads (each with the flag that led to it).
fn inputs(args: &MergeArgs, source: &Source) -> Vec<(&'static str, PathBuf)> {
    let mut v = vec![("--local_dir", args.local_dir.clone())];
    match source {
        Source::Lora {
            adapter,
            base,
            checkpoint,
            ..
        } => {
            v.push(("--local_dir", adapter.clone()));
            v.extend(checkpoint.clone().map(|c| ("--local_dir", c)));
            let local = PathBuf::from(crate::util::expand_home(base));
            if local.exists() {
                v.push(("the base model", local));
            }
        }
        Source::Model { path, .. } => v.push(("--local_dir", path.clone())),
    }
    v
}

/// `path` made absolute with `.` and `..` taken lexically, then the part of it that exists
/// resolved through symlinks, so that two spellings of one place compare equal.
fn real(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut lexical = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                lexical.pop();
            }
            other => lexical.push(other),
        }
    }
    let mut head = lexical.clone();
    let mut tail = Vec::new();
    while !head.exists() {
        match (head.file_name().map(|n| n.to_os_string()), head.parent()) {
            (Some(name), Some(parent)) => {
                tail.push(name);
                head = parent.to_path_buf();
            }
            _ => return lexical,
        }
    }
    let mut out = std::fs::canonicalize(&head).unwrap_or(head);
    out.extend(tail.into_iter().rev());
    out
}

/// Refuses `target` when it is, lies inside or contains one of `inputs`, is a file, or is a
/// non-empty folder and `force` is off.
fn check_target(
    target: &Path,
    inputs: &[(&'static str, PathBuf)],
    force: bool,
) -> Result<(), ConfigError> {
    let key = "--target_dir";
    if target.file_name().is_none() {
        return Err(usage(
            key,
            format!("{}: name the folder to write", target.display()),
        ));
    }
    check_apart(target, inputs)?;
    if target.is_file() {
        return Err(usage(
            key,
            format!("{} is a file; name a folder", target.display()),
        ));
    }
    let non_empty = target.is_dir()
        && std::fs::read_dir(target)
            .map_err(|e| usage(key, format!("{}: {e}", target.display())))?
            .next()
            .is_some();
    if non_empty && !force {
        return Err(usage(
            key,
            format!(
                "{} exists and is not empty: choose a new folder, or pass --force to replace it",
                target.display()
            ),
        ));
    }
    Ok(())
}

/// Refuses `target` when it is, lies inside or contains one of `inputs`.
fn check_apart(target: &Path, inputs: &[(&'static str, PathBuf)]) -> Result<(), ConfigError> {
    let key = "--target_dir";
    let t = real(target);
    for (what, input) in inputs {
        let i = real(input);
        let relation = if t == i {
            "is"
        } else if t.starts_with(&i) {
            "lies inside"
        } else if i.starts_with(&t) {
            "contains"
        } else {
            continue;
        };
        return Err(usage(
            key,
            format!(
                "{} {relation} {} ({what}): writing there would change what is being merged; choose a folder outside it",
                target.display(),
                input.display()
            ),
        ));
    }
    Ok(())
}

/// Refuses the GGUF file `target` when it is, lies inside or contains one of `inputs`, is a
/// folder, or exists and `force` is off.
fn check_target_file(
    target: &Path,
    inputs: &[(&'static str, PathBuf)],
    force: bool,
) -> Result<(), ConfigError> {
    let key = "--target_dir";
    check_apart(target, inputs)?;
    if target.is_dir() {
        return Err(usage(
            key,
            format!(
                "{} is a folder; name the .gguf file to write, or a folder without it",
                target.display()
            ),
        ));
    }
    if target.exists() && !force {
        return Err(usage(
            key,
            format!(
                "{} exists: choose a new file, or pass --force to replace it",
                target.display()
            ),
        ));
    }
    Ok(())
}

/// The hidden folder (or, for a GGUF file, the hidden file) a merge writes into,
/// `.<target name>.merging-<pid>` beside the target,
/// renamed into place by [`Partial::commit`]; dropped uncommitted (an error, a panic), it is
/// removed. A merge killed before it finished leaves its folder (and, killed between the two
/// renames of a replacement, the replaced target as `.<name>.replaced-<pid>`): the next merge
/// into that target removes the first and puts the second back ([`clean_leftovers`]).
struct Partial {
    target: PathBuf,
    parent: PathBuf,
    name: String,
    dir: PathBuf,
    /// A hidden file (a GGUF merge's), not a folder.
    file: bool,
    committed: bool,
}

/// `--target_dir`'s place cannot be written: the target, the folder and the OS error.
fn cannot_write(target: &Path, parent: &Path, e: std::io::Error) -> ConfigError {
    usage(
        "--target_dir",
        format!(
            "{}: cannot write in {}: {e}",
            target.display(),
            parent.display()
        ),
    )
}

impl Partial {
    /// The folder `target` goes in (made, with the folders above it), the target's name, and
    /// the hidden `.<name>.merging-<pid>` beside it that a merge writes first.
    fn beside(target: &Path) -> Result<(PathBuf, String, PathBuf), ConfigError> {
        let parent = match target.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(p) => p.to_path_buf(),
            None => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(|e| cannot_write(target, &parent, e))?;
        let name = target
            .file_name()
            .expect("check_target names a file or folder")
            .to_string_lossy()
            .into_owned();
        let hidden = parent.join(format!(".{name}.merging-{}", std::process::id()));
        Ok((parent, name, hidden))
    }

    /// Creates the hidden folder beside `target` (and the folders above it); a place that
    /// cannot be written is refused naming `--target_dir`, the target and the OS error.
    fn create(target: &Path) -> Result<Self, ConfigError> {
        let (parent, name, dir) = Self::beside(target)?;
        let refuse = |e| cannot_write(target, &parent, e);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).map_err(refuse)?;
        // Replacing a folder renames it aside: that needs the folder itself writable too.
        if target.is_dir() {
            let probe = target.join(format!(".main_ppo-merge-probe-{}", std::process::id()));
            let r = std::fs::write(&probe, b"").and_then(|_| std::fs::remove_file(&probe));
            if let Err(e) = r {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(usage(
                    "--target_dir",
                    format!("{}: cannot replace it: {e}", target.display()),
                ));
            }
        }
        Ok(Partial {
            target: target.to_path_buf(),
            parent,
            name,
            dir,
            file: false,
            committed: false,
        })
    }

    /// Creates the hidden file `.<name>.merging-<pid>` beside the GGUF file `target` (and the
    /// folders above it); a place that cannot be written is refused naming `--target_dir`,
    /// the target and the OS error.
    fn create_file(target: &Path) -> Result<Self, ConfigError> {
        let (parent, name, file) = Self::beside(target)?;
        let refuse = |e| cannot_write(target, &parent, e);
        std::fs::File::create(&file).map_err(refuse)?;
        Ok(Partial {
            target: target.to_path_buf(),
            parent,
            name,
            dir: file,
            file: true,
            committed: false,
        })
    }

    /// Runs `write` into the hidden folder and renames it into place (replacing an existing
    /// target, which [`check_target`] has allowed); on a failure the hidden folder is removed
    /// and the target is left as it was. Errors name the target.
    fn commit(
        mut self,
        write: impl FnOnce(&Path) -> Result<(), crate::model::ModelError>,
    ) -> anyhow::Result<()> {
        let target = self.target.clone();
        let failed = |e: &dyn std::fmt::Display| {
            anyhow::anyhow!("writing the merged model to {}: {e}", target.display())
        };
        write(&self.dir).map_err(|e| failed(&e))?;
        if self.file {
            // One rename puts the complete file in place, over an old one.
            std::fs::rename(&self.dir, &target).map_err(|e| failed(&e))?;
            self.committed = true;
            return Ok(());
        }
        let old = self
            .parent
            .join(format!(".{}.replaced-{}", self.name, std::process::id()));
        let had_target = target.exists();
        if had_target {
            std::fs::rename(&target, &old).map_err(|e| failed(&e))?;
        }
        if let Err(e) = std::fs::rename(&self.dir, &target) {
            if had_target {
                let _ = std::fs::rename(&old, &target);
            }
            return Err(failed(&e));
        }
        self.committed = true;
        if had_target {
            std::fs::remove_dir_all(&old).map_err(|e| anyhow::anyhow!("{}: {e}", old.display()))?;
        }
        Ok(())
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.committed {
            let _ = match self.file {
                true => std::fs::remove_file(&self.dir),
                false => std::fs::remove_dir_all(&self.dir),
            };
        }
    }
}

/// Whether process `pid` is running (or exists under another user).
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// What merges into `target` that were killed left beside it: their hidden folders
/// `.<name>.merging-<pid>` are removed, and a target one moved aside to `.<name>.replaced-<pid>`
/// is put back when the target is missing (it was killed between the two renames), else
/// removed. Folders of a merge still running are left alone.
fn clean_leftovers(target: &Path) {
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
        return;
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let name = name.to_string_lossy();
    let prefix = format!(".{name}.");
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = file.strip_prefix(&prefix) else {
            continue;
        };
        let (kind, pid) = match rest.split_once('-') {
            Some((k @ ("merging" | "replaced"), pid)) => match pid.parse::<u32>() {
                Ok(pid) => (k, pid),
                Err(_) => continue,
            },
            _ => continue,
        };
        if pid == std::process::id() || alive(pid) {
            continue;
        }
        let path = e.path();
        if kind == "replaced" && !target.exists() {
            match std::fs::rename(&path, target) {
                Ok(()) => tracing::warn!(
                    "{}: put back from {}, where a merge (process {pid}) that was killed while replacing it had moved it",
                    target.display(),
                    path.display()
                ),
                Err(e) => tracing::warn!("{}: cannot put it back: {e}", path.display()),
            }
            continue;
        }
        let removed = match path.is_dir() {
            true => std::fs::remove_dir_all(&path),
            false => std::fs::remove_file(&path),
        };
        match removed {
            Ok(()) => tracing::info!(
                "removed {}, left by a merge (process {pid}) that did not finish",
                path.display()
            ),
            Err(e) => tracing::warn!("{}: cannot remove it: {e}", path.display()),
        }
    }
}

#[cfg(test)]
#[path = "merge_tests.rs"]
mod tests;
