//! The checkpoint folder (verl's layout) and its safety rules.
//!
//! ```text
//! {default_local_dir}/
//!   latest_checkpointed_iteration.txt      the newest complete step, N
//!   global_step_N/
//!     actor/huggingface/                   HF model directory (config, weights, tokenizer)
//!     actor/optim.safetensors, optim.json  AdamW moments and step
//!     critic/huggingface/, critic/optim.*  the same for the critic (value head `score.*`)
//!     actor/lora_adapter/                  with LoRA, instead of the weights: PEFT's
//!                                          adapter_config.json + adapter_model.safetensors
//!                                          (huggingface/ then holds config and tokenizer only;
//!                                          optim.* the adapters' moments)
//!     trainer_state.json                   step, loader cursor, sampler RNG, KL controller
//!     config.yaml                          the resolved configuration
//! ```
//!
//! A save writes everything into a hidden `.global_step_N.partial` folder, records the step in
//! `.checkpoint_commit`, renames the folder into place, rewrites the tracker file (itself
//! through a temporary file and a rename) and removes the record. A crash before the record
//! leaves the previous checkpoint and tracker; a crash after it is finished by the next start
//! ([`recover`]): the folder and the tracker file change as one.

use std::path::{Path, PathBuf};

use crate::config::trainer::ResumeMode;

pub const TRACKER: &str = "latest_checkpointed_iteration.txt";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    #[error("{0}")]
    Invalid(String),
}

fn io(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("global_step_{step}"))
}

/// The step number of a `global_step_N` folder.
pub fn parse_step(dir: &Path) -> Option<u64> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("global_step_")?
        .parse()
        .ok()
}

/// The commit record: a save whose folder is complete writes the step here before it moves
/// anything into place, and removes it once the folder and the tracker file name that step.
/// Whoever finds it (the next start, [`recover`]) finishes the commit, so the folder and the
/// tracker file change as one.
pub const COMMIT: &str = ".checkpoint_commit";

fn partial_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".global_step_{step}.partial"))
}

fn old_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".global_step_{step}.old"))
}

/// Writes a checkpoint for `step` with `write` (given the folder to fill), atomically with the
/// tracker file: the folder is filled as `.global_step_N.partial`, then the commit record
/// names N, then [`commit`] moves the folder into place (an existing `global_step_N` aside
/// first) and rewrites the tracker. A crash before the record leaves the previous checkpoint
/// and tracker; one after it is finished by the next start ([`recover`]); at every moment a
/// complete copy of each step exists.
pub fn save_atomic<E: std::fmt::Display>(
    root: &Path,
    step: u64,
    write: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(root).map_err(|e| io(root, e))?;
    let tmp = partial_dir(root, step);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    write(&tmp).map_err(|e| CheckpointError::Io {
        path: tmp.display().to_string(),
        message: format!("writing the checkpoint failed: {e}"),
    })?;
    sync_dir(&tmp);
    crate::util::fault_point("checkpoint_written", step);
    write_file_atomic(root, COMMIT, &step.to_string())?;
    crate::util::fault_point("commit_recorded", step);
    commit(root, step)
}

/// Finishes the commit of `step` (recorded in [`COMMIT`]): each part is done only if not done
/// yet, so a commit cut short anywhere finishes when run again. Moves the complete
/// `.global_step_N.partial` into place (a `global_step_N` there is moved aside to
/// `.global_step_N.old` first, so a complete copy always exists), rewrites the tracker file,
/// then removes the old copy and the record.
fn commit(root: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    let (tmp, dst, old) = (
        partial_dir(root, step),
        step_dir(root, step),
        old_dir(root, step),
    );
    if tmp.is_dir() {
        if dst.exists() {
            // Saving the same step again (a resumed run that re-saves).
            if old.exists() {
                std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
            }
            std::fs::rename(&dst, &old).map_err(|e| io(&dst, e))?;
            crate::util::fault_point("previous_moved_aside", step);
        }
        std::fs::rename(&tmp, &dst).map_err(|e| io(&tmp, e))?;
        sync_dir(root);
        crate::util::fault_point("renamed", step);
    } else if !dst.exists() && old.is_dir() {
        std::fs::rename(&old, &dst).map_err(|e| io(&old, e))?;
    }
    if !dst.is_dir() {
        return Err(CheckpointError::Invalid(format!(
            "{}: the commit record names step {step}, but neither {} nor its saved copy exists",
            root.join(COMMIT).display(),
            dst.display()
        )));
    }
    write_file_atomic(root, TRACKER, &step.to_string())?;
    crate::util::fault_point("tracker_written", step);
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
        crate::util::fault_point("previous_removed", step);
    }
    let record = root.join(COMMIT);
    std::fs::remove_file(&record).map_err(|e| io(&record, e))?;
    sync_dir(root);
    crate::util::fault_point("committed", step);
    Ok(dst)
}

/// Best-effort fsync of a folder's entries (durability across power loss; the rename order
/// already gives safety against a crash of the process).
fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Writes `text` to `root/name` through a temporary file and a rename.
fn write_file_atomic(root: &Path, name: &str, text: &str) -> Result<(), CheckpointError> {
    let tmp = root.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).map_err(|e| io(&tmp, e))?;
    let dst = root.join(name);
    std::fs::rename(&tmp, &dst).map_err(|e| io(&dst, e))
}

/// Complete checkpoints under `root` (partial and moved-aside folders are hidden), by step.
pub fn list(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .filter_map(|p| parse_step(&p).map(|s| (s, p)))
        .collect();
    out.sort();
    out
}

/// The checkpoint to resume from under `trainer.resume_mode`: `None` = start fresh.
pub fn find_resume(
    root: &Path,
    mode: ResumeMode,
    resume_from_path: Option<&str>,
) -> Result<Option<(u64, PathBuf)>, CheckpointError> {
    match mode {
        ResumeMode::Disable => refuse_to_replace(root).map(|()| None),
        ResumeMode::ResumePath => {
            let p = resume_from_path.ok_or_else(|| {
                CheckpointError::Invalid(
                    "trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N folder)".into(),
                )
            })?;
            let path = PathBuf::from(crate::util::expand_home(p));
            let step = parse_step(&path).ok_or_else(|| {
                CheckpointError::Invalid(format!(
                    "trainer.resume_from_path={p}: the folder name must be global_step_N"
                ))
            })?;
            if !path.is_dir() {
                return Err(CheckpointError::Invalid(format!(
                    "trainer.resume_from_path={p}: no such folder"
                )));
            }
            refuse_newer(root, step, &format!("trainer.resume_from_path={p}"))?;
            Ok(Some((step, path)))
        }
        ResumeMode::Auto => {
            let tracker = root.join(TRACKER);
            let text = match std::fs::read(&tracker) {
                Ok(bytes) => Some(String::from_utf8(bytes).map_err(|e| {
                    CheckpointError::Invalid(format!(
                        "{}: garbled (not UTF-8 text: {e}); it should hold the newest step number; \
                         fix or delete it (the global_step_* folders beside it are kept)",
                        tracker.display()
                    ))
                })?),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(io(&tracker, e)),
            };
            let Some(text) = text else {
                if let Some((s, p)) = list(root).pop() {
                    tracing::warn!(
                        "{} is missing; resuming from the newest checkpoint folder {}",
                        tracker.display(),
                        p.display()
                    );
                    return Ok(Some((s, p)));
                }
                return Ok(None);
            };
            let step: u64 = text.trim().parse().map_err(|_| {
                let shown: String = text.trim().chars().take(80).collect();
                CheckpointError::Invalid(format!(
                    "{}: garbled: expected a step number, found `{shown}`",
                    tracker.display(),
                ))
            })?;
            let dir = step_dir(root, step);
            if dir.is_dir() {
                refuse_newer(root, step, &format!("{} (step {step})", tracker.display()))?;
                return Ok(Some((step, dir)));
            }
            match list(root).pop() {
                Some((s, p)) => {
                    tracing::warn!(
                        "{} names step {step} but {} is missing; resuming from {}",
                        tracker.display(),
                        dir.display(),
                        p.display()
                    );
                    Ok(Some((s, p)))
                }
                None => Err(CheckpointError::Invalid(format!(
                    "{} names step {step} but there is no global_step_* folder in {}; set trainer.resume_mode=disable to start fresh",
                    tracker.display(),
                    root.display()
                ))),
            }
        }
    }
}

/// A run resumed at `step` (chosen by `from`) saves `global_step_{step + k}` into `root`: the
/// complete checkpoints there past `step` would be replaced one by one (and pruning, which
/// keeps the highest steps, could delete the new ones before them). Refused, naming them.
fn refuse_newer(root: &Path, step: u64, from: &str) -> Result<(), CheckpointError> {
    let newer: Vec<u64> = list(root)
        .into_iter()
        .map(|(s, _)| s)
        .filter(|&s| s > step)
        .collect();
    if newer.is_empty() {
        return Ok(());
    }
    Err(CheckpointError::Invalid(format!(
        "resuming from step {step} ({from}), but trainer.default_local_dir ({}) holds later checkpoints ({}) that this run's saves would replace; \
         resume from the newest instead, or move the later folders out of {} to continue from step {step}",
        root.display(),
        show_steps(&newer),
        root.display()
    )))
}

/// `global_step_N` names of `steps`, the middle elided past four.
fn show_steps(steps: &[u64]) -> String {
    let names: Vec<String> = steps.iter().map(|s| format!("global_step_{s}")).collect();
    if names.len() > 4 {
        format!(
            "{}, {}, ..., {} ({} in all)",
            names[0],
            names[1],
            names[names.len() - 1],
            names.len()
        )
    } else {
        names.join(", ")
    }
}

/// `trainer.resume_mode=disable` starts from step 0, and its saves would replace same-numbered
/// `global_step_N` folders and rewind the tracker: refused while `root` holds any checkpoint.
fn refuse_to_replace(root: &Path) -> Result<(), CheckpointError> {
    let existing: Vec<u64> = list(root).into_iter().map(|(s, _)| s).collect();
    if existing.is_empty() {
        return Ok(());
    }
    let shown = show_steps(&existing);
    Err(CheckpointError::Invalid(format!(
        "trainer.resume_mode=disable starts a fresh run, but trainer.default_local_dir ({}) already holds checkpoints ({shown}) that its saves would replace; \
         set trainer.default_local_dir to a new folder for the fresh run, or trainer.resume_mode=auto to continue from the newest one",
        root.display()
    )))
}

/// Deletes `part` (`actor` or `critic`) of all but the newest `keep` checkpoints, and folders
/// left with nothing to resume from.
pub fn prune(root: &Path, part: &str, keep: Option<usize>) -> Result<(), CheckpointError> {
    let Some(keep) = keep else { return Ok(()) };
    let all = list(root);
    let n = all.len();
    for (_, dir) in all.into_iter().take(n.saturating_sub(keep.max(1))) {
        let p = dir.join(part);
        if p.exists() {
            std::fs::remove_dir_all(&p).map_err(|e| io(&p, e))?;
        }
        if !dir.join("actor").exists() && !dir.join("critic").exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| io(&dir, e))?;
        }
    }
    Ok(())
}

/// Deletes all but the newest `keep` checkpoints (verl's SFT layout: whole step folders).
pub fn prune_steps(root: &Path, keep: Option<usize>) -> Result<(), CheckpointError> {
    let Some(keep) = keep else { return Ok(()) };
    let all = list(root);
    let n = all.len();
    for (_, dir) in all.into_iter().take(n.saturating_sub(keep.max(1))) {
        std::fs::remove_dir_all(&dir).map_err(|e| io(&dir, e))?;
    }
    Ok(())
}

/// Puts `root` in the state of its last save that reached its commit record: a save cut short
/// after the record (a crash or kill while moving folders or rewriting the tracker) is
/// finished, so the checkpoint it wrote is the newest; folders of saves that never reached it
/// are removed. A moved-aside copy of a step whose folder is gone (left by a save of an
/// earlier version, cut short between its two renames) is put back, never deleted.
pub fn recover(root: &Path) -> Result<(), CheckpointError> {
    let record = root.join(COMMIT);
    match std::fs::read_to_string(&record) {
        Ok(text) => {
            let step: u64 = text.trim().parse().map_err(|_| {
                CheckpointError::Invalid(format!(
                    "{}: garbled commit record (expected a step number, found `{}`); delete it to resume from {}",
                    record.display(),
                    text.trim().chars().take(80).collect::<String>(),
                    TRACKER
                ))
            })?;
            tracing::warn!(
                "finishing the save of {} that was cut short after its folder was complete",
                step_dir(root, step).display()
            );
            commit(root, step)?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&record, e)),
    }
    for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(".global_step_") else {
            if name.starts_with(&format!(".{TRACKER}.")) || name.starts_with(&format!(".{COMMIT}."))
            {
                let _ = std::fs::remove_file(e.path());
            }
            continue;
        };
        if let Some(step) = rest.strip_suffix(".old").and_then(|s| s.parse().ok()) {
            let dst = step_dir(root, step);
            if !dst.exists() {
                tracing::warn!(
                    "putting back {} from its saved copy {}",
                    dst.display(),
                    e.path().display()
                );
                std::fs::rename(e.path(), &dst).map_err(|err| io(&e.path(), err))?;
                continue;
            }
        } else if !rest.ends_with(".partial") {
            continue;
        }
        tracing::warn!(
            "removing an unfinished checkpoint save: {}",
            e.path().display()
        );
        let _ = std::fs::remove_dir_all(e.path());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn save(root: &Path, step: u64, body: &str) {
        save_atomic(root, step, |d| std::fs::write(d.join("x"), body)).unwrap();
    }

    #[test]
    fn save_writes_folder_and_tracker() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), 2, "a");
        save(dir.path(), 4, "b");
        assert_eq!(
            std::fs::read_to_string(dir.path().join(TRACKER)).unwrap(),
            "4"
        );
        let found = find_resume(dir.path(), ResumeMode::Auto, None)
            .unwrap()
            .unwrap();
        assert_eq!(found.0, 4);
        assert_eq!(std::fs::read_to_string(found.1.join("x")).unwrap(), "b");
        let empty = tempfile::tempdir().unwrap();
        assert!(find_resume(empty.path(), ResumeMode::Disable, None)
            .unwrap()
            .is_none());
        // Re-saving a step replaces it.
        save(dir.path(), 4, "c");
        assert_eq!(
            std::fs::read_to_string(step_dir(dir.path(), 4).join("x")).unwrap(),
            "c"
        );
    }

    /// Every point of the save sequence (a fresh step and a step saved again), crashed at (a
    /// panic from the fault hook stands for SIGKILL: nothing after it runs), then the next
    /// start's recovery: the folder and the tracker file agree, the resumed checkpoint is the
    /// newest complete one (the new save once its commit record exists, else the previous),
    /// and no step ever loses its last complete copy. Before the commit record, a kill after
    /// the rename left a folder the tracker did not name (the resume then refused it), and
    /// a kill between a re-save's two renames left only hidden copies, which the next start
    /// deleted.
    #[test]
    fn a_crash_at_any_point_of_a_save_resumes_from_the_newest_complete_checkpoint() {
        const POINTS: [&str; 7] = [
            "checkpoint_written",
            "commit_recorded",
            "previous_moved_aside",
            "renamed",
            "tracker_written",
            "previous_removed",
            "committed",
        ];
        for resave in [false, true] {
            for (i, point) in POINTS.iter().enumerate() {
                if !resave && point.starts_with("previous_") {
                    continue;
                }
                let dir = tempfile::tempdir().unwrap();
                let root = dir.path();
                save(root, 1, "one");
                if resave {
                    save(root, 2, "two");
                }
                let target = *point;
                let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    crate::util::with_fault_hook(
                        move |name, step| {
                            if name == target && step == 2 {
                                panic!("killed at {name}");
                            }
                        },
                        || save(root, 2, "new"),
                    )
                }));
                assert!(
                    crashed.is_err(),
                    "{point} (re-save {resave}) was never reached"
                );
                recover(root).unwrap();
                let (step, path) = find_resume(root, ResumeMode::Auto, None)
                    .unwrap_or_else(|e| panic!("{point} (re-save {resave}): {e}"))
                    .unwrap();
                let committed = i >= 1;
                let want = match (committed, resave) {
                    (true, _) => (2, "new"),
                    (false, true) => (2, "two"),
                    (false, false) => (1, "one"),
                };
                assert_eq!(
                    (
                        step,
                        std::fs::read_to_string(path.join("x")).unwrap().as_str()
                    ),
                    want,
                    "{point} (re-save {resave})"
                );
                assert_eq!(
                    std::fs::read_to_string(root.join(TRACKER)).unwrap(),
                    want.0.to_string(),
                    "{point} (re-save {resave})"
                );
                let left: Vec<String> = std::fs::read_dir(root)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with('.'))
                    .collect();
                assert!(left.is_empty(), "{point} (re-save {resave}): {left:?}");
                // The recovered folder takes the next save as any other.
                save(root, 3, "three");
                assert_eq!(
                    find_resume(root, ResumeMode::Auto, None)
                        .unwrap()
                        .unwrap()
                        .0,
                    3
                );
            }
        }
        // A moved-aside copy left by an earlier version's re-save cut between its renames (no
        // commit record) is the step's only complete copy: put back, not deleted.
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), 2, "two");
        std::fs::rename(step_dir(dir.path(), 2), old_dir(dir.path(), 2)).unwrap();
        std::fs::create_dir_all(partial_dir(dir.path(), 2)).unwrap();
        recover(dir.path()).unwrap();
        let (step, path) = find_resume(dir.path(), ResumeMode::Auto, None)
            .unwrap()
            .unwrap();
        assert_eq!(
            (step, std::fs::read_to_string(path.join("x")).unwrap()),
            (2, "two".into())
        );
        assert!(!partial_dir(dir.path(), 2).exists());
    }

    #[test]
    fn a_failed_save_keeps_the_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), 1, "a");
        let r = save_atomic(dir.path(), 2, |d| {
            std::fs::write(d.join("x"), "half")?;
            Err::<(), _>(std::io::Error::other("disk full"))
        });
        assert!(r.unwrap_err().to_string().contains("disk full"));
        let (step, p) = find_resume(dir.path(), ResumeMode::Auto, None)
            .unwrap()
            .unwrap();
        assert_eq!(step, 1);
        assert_eq!(std::fs::read_to_string(p.join("x")).unwrap(), "a");
        assert_eq!(list(dir.path()).len(), 1, "the partial folder is hidden");
        recover(dir.path()).unwrap();
        assert!(!dir.path().join(".global_step_2.partial").exists());
    }

    #[test]
    fn resume_path_and_tracker_errors_name_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let e = find_resume(dir.path(), ResumeMode::ResumePath, Some("/x/step_3")).unwrap_err();
        assert!(e.to_string().contains("global_step_N"), "{e}");
        let e = find_resume(dir.path(), ResumeMode::ResumePath, None).unwrap_err();
        assert!(e.to_string().contains("resume_from_path"), "{e}");
        std::fs::write(dir.path().join(TRACKER), "seven").unwrap();
        let e = find_resume(dir.path(), ResumeMode::Auto, None).unwrap_err();
        assert!(e.to_string().contains("seven"), "{e}");
        std::fs::write(dir.path().join(TRACKER), "7").unwrap();
        let e = find_resume(dir.path(), ResumeMode::Auto, None).unwrap_err();
        assert!(e.to_string().contains("resume_mode=disable"), "{e}");
        save(dir.path(), 3, "a");
        std::fs::write(dir.path().join(TRACKER), "7").unwrap();
        assert_eq!(
            find_resume(dir.path(), ResumeMode::Auto, None)
                .unwrap()
                .unwrap()
                .0,
            3
        );
    }

    #[test]
    fn disable_refuses_to_replace_existing_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), 2, "a");
        save(dir.path(), 4, "b");
        let e = find_resume(dir.path(), ResumeMode::Disable, None)
            .unwrap_err()
            .to_string();
        for want in [
            "global_step_2, global_step_4",
            "trainer.default_local_dir",
            "trainer.resume_mode=auto",
        ] {
            assert!(e.contains(want), "{want} missing from: {e}");
        }
        // Nothing was touched.
        assert_eq!(
            std::fs::read_to_string(dir.path().join(TRACKER)).unwrap(),
            "4"
        );
        assert_eq!(
            std::fs::read_to_string(step_dir(dir.path(), 2).join("x")).unwrap(),
            "a"
        );
        // Many checkpoints are summarised, newest named.
        for s in [6, 8, 10] {
            save(dir.path(), s, "c");
        }
        let e = find_resume(dir.path(), ResumeMode::Disable, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("global_step_10 (5 in all)"), "{e}");
    }

    #[test]
    fn a_garbled_tracker_is_reported_as_garbled_not_missing() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), 3, "a");
        // Bytes that are not UTF-8 (a disk error, a binary file copied over it).
        std::fs::write(dir.path().join(TRACKER), [0xff, 0xfe, 0x00, 0x33]).unwrap();
        let e = find_resume(dir.path(), ResumeMode::Auto, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("garbled") && e.contains(TRACKER), "{e}");
        // A tracker that is a folder cannot be read: an I/O error naming it, not "missing".
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), 3, "a");
        std::fs::remove_file(dir.path().join(TRACKER)).unwrap();
        std::fs::create_dir(dir.path().join(TRACKER)).unwrap();
        let e = find_resume(dir.path(), ResumeMode::Auto, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains(TRACKER), "{e}");
    }

    /// Resuming from an older checkpoint while later ones sit in the folder (a tracker that
    /// names an older step, a resume_from_path to one) is refused naming the later ones: the
    /// run's saves would replace them one by one (they used to be replaced silently). The
    /// newest resumes as before.
    #[test]
    fn resuming_behind_later_checkpoints_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for step in [2, 4, 6] {
            save(dir.path(), step, "x");
        }
        std::fs::write(dir.path().join(TRACKER), "2").unwrap();
        let e = find_resume(dir.path(), ResumeMode::Auto, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("global_step_4, global_step_6") && e.contains("step 2"),
            "{e}"
        );
        let older = step_dir(dir.path(), 4).display().to_string();
        let e = find_resume(dir.path(), ResumeMode::ResumePath, Some(&older))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("global_step_6") && e.contains("resume_from_path"),
            "{e}"
        );
        std::fs::write(dir.path().join(TRACKER), "6").unwrap();
        let (step, _) = find_resume(dir.path(), ResumeMode::Auto, None)
            .unwrap()
            .unwrap();
        assert_eq!(step, 6);
    }

    #[test]
    fn prune_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        for s in 1..=4 {
            save_atomic(dir.path(), s, |d| {
                std::fs::create_dir_all(d.join("actor"))?;
                std::fs::create_dir_all(d.join("critic"))
            })
            .unwrap();
        }
        prune(dir.path(), "actor", Some(2)).unwrap();
        assert!(!step_dir(dir.path(), 1).join("actor").exists());
        assert!(step_dir(dir.path(), 1).join("critic").exists());
        assert!(step_dir(dir.path(), 3).join("actor").exists());
        prune(dir.path(), "critic", Some(2)).unwrap();
        let left: Vec<u64> = list(dir.path()).into_iter().map(|(s, _)| s).collect();
        assert_eq!(left, vec![3, 4]);
    }
}
