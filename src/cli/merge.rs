//! `main_ppo merge` (verl's `python -m verl.model_merger merge --backend fsdp --local_dir DIR
//! --target_dir OUT`): a checkpoint (LoRA or full), a LoRA adapter folder with its base model,
//! or a model, written as one HF model folder ([`crate::weights::merge`]).
//!
//! The target is never one of the inputs: it may not be, lie inside or contain the checkpoint,
//! the adapter or the base model; an existing non-empty target is replaced only with
//! `--force`. The model is written into a hidden folder beside the target and renamed into
//! place, so an interrupted merge leaves no half-written model under the target's name.

use std::path::{Component, Path, PathBuf};

use clap::Args;

use crate::config::ConfigError;
use crate::weights::merge::{self, Source};

#[derive(Debug, Args)]
pub struct MergeArgs {
    /// What to merge: a checkpoint's global_step_N/ (its actor) or its actor/ or critic/ folder
    /// (LoRA or full), a LoRA adapter folder (with its base model), or a model (an HF folder
    /// or a .gguf file, written as an HF model).
    #[arg(long = "local_dir", visible_alias = "local-dir", value_name = "DIR")]
    pub local_dir: PathBuf,
    /// The HF model folder to write: new or empty (an existing one only with --force); not
    /// inside the inputs.
    #[arg(long = "target_dir", visible_alias = "target-dir", value_name = "DIR")]
    pub target_dir: PathBuf,
    /// The base model of LoRA adapters (an HF folder, a .gguf file or a hub id); default: the
    /// adapter's adapter_config.json `base_model_name_or_path`.
    #[arg(long, value_name = "MODEL", visible_alias = "hf_model_path")]
    pub base: Option<String>,
    /// Replace an existing non-empty --target_dir.
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
    let source = merge::resolve(&args.local_dir, args.base.as_deref())
        .map_err(|r| usage(r.flag, r.error.to_string()))?;
    check_target(&args.target_dir, &inputs(args, &source), args.force)?;
    let merged = merge::merge(&source)?;
    write_in_place(&args.target_dir, |dir| merge::save(&merged, dir))?;
    println!("merged: {}", merged.summary);
    println!("wrote {}", args.target_dir.display());
    Ok(())
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

/// Runs `write` into a hidden folder beside `target` and renames it into place (replacing an
/// existing `target`, which [`check_target`] has allowed); on a failure the hidden folder is
/// removed and `target` is left as it was.
fn write_in_place(
    target: &Path,
    write: impl FnOnce(&Path) -> Result<(), crate::model::ModelError>,
) -> anyhow::Result<()> {
    let io = |p: &Path, e: std::io::Error| anyhow::anyhow!("{}: {e}", p.display());
    let parent = match target.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => p.to_path_buf(),
        None => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| io(&parent, e))?;
    let name = target.file_name().expect("checked").to_string_lossy();
    let pid = std::process::id();
    let partial = parent.join(format!(".{name}.merging-{pid}"));
    let _ = std::fs::remove_dir_all(&partial);
    if let Err(e) = write(&partial) {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e.into());
    }
    let old = parent.join(format!(".{name}.replaced-{pid}"));
    let had_target = target.exists();
    if had_target {
        std::fs::rename(target, &old).map_err(|e| {
            let _ = std::fs::remove_dir_all(&partial);
            io(target, e)
        })?;
    }
    if let Err(e) = std::fs::rename(&partial, target) {
        if had_target {
            let _ = std::fs::rename(&old, target);
        }
        let _ = std::fs::remove_dir_all(&partial);
        return Err(io(target, e));
    }
    if had_target {
        std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
    }
    Ok(())
}

#[cfg(test)]
#[path = "merge_tests.rs"]
mod tests;
