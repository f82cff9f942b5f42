//! Output files never replace a command's inputs: `--output` naming the same file as `--input`
//! (or the `--config` file) is refused before any work, however it is spelt (`./x`, a symlink,
//! a hard link), and a missing output folder is reported before hours of generation, not after.

use std::path::Path;

use crate::config::{ConfigError, ConfigSource};

use super::ConfigArgs;

/// Refuses `output` (from `--output`) when it is `input` (from `--input`) or the YAML file the
/// configuration flags name; see [`check_output`].
pub fn check_output_args(
    output: &Path,
    input: &Path,
    config: &ConfigArgs,
) -> Result<(), ConfigError> {
    let yaml = match config.source() {
        Ok(ConfigSource::File(f)) => Some(f),
        Ok(ConfigSource::Hydra { dir, name }) => {
            Some(dir.join(format!("{name}.yaml"))).filter(|f| f.is_file())
        }
        _ => None,
    };
    let mut inputs = vec![("--input", input)];
    if let Some(y) = &yaml {
        inputs.push(("the configuration file", y.as_path()));
    }
    check_output(output, "--output", &inputs)
}

/// Whether `a` and `b` are one file on disk. Both must exist; a path that does not exist is
/// never the same as anything.
pub fn same_file(a: &Path, b: &Path) -> bool {
    let (Ok(ma), Ok(mb)) = (std::fs::metadata(a), std::fs::metadata(b)) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if ma.dev() == mb.dev() && ma.ino() == mb.ino() {
            return true;
        }
    }
    #[cfg(not(unix))]
    let _ = (ma, mb);
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(ca), Ok(cb)) => ca == cb,
        _ => false,
    }
}

/// Refuses `output` (given with `flag`) when it is the same file as one of `inputs` (each with
/// the flag or key that named it), or when the folder it would be written into does not exist.
pub fn check_output(
    output: &Path,
    flag: &str,
    inputs: &[(&str, &Path)],
) -> Result<(), ConfigError> {
    for (what, input) in inputs {
        if same_file(output, input) {
            return Err(ConfigError::Value {
                key: flag.into(),
                message: format!(
                    "{} is the same file as {what} ({}); writing it would destroy the input: choose another output file",
                    output.display(),
                    input.display()
                ),
            });
        }
    }
    if output.is_dir() {
        return Err(ConfigError::Value {
            key: flag.into(),
            message: format!("{} is a folder; name a file", output.display()),
        });
    }
    let parent = output.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(parent) = parent {
        if !parent.is_dir() {
            return Err(ConfigError::Value {
                key: flag.into(),
                message: format!(
                    "{}: the folder {} does not exist",
                    output.display(),
                    parent.display()
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_file_under_any_spelling_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.jsonl");
        std::fs::write(&input, "{}\n").unwrap();
        let inputs = [("--input", input.as_path())];
        // Same path, a `./` spelling, a `..` detour.
        let detour = dir.path().join("sub").join("..").join("in.jsonl");
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        for out in [input.clone(), dir.path().join(".").join("in.jsonl"), detour] {
            let e = check_output(&out, "--output", &inputs)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("--output") && e.contains("--input"), "{e}");
        }
        // A symlink and a hard link to it.
        #[cfg(unix)]
        {
            let link = dir.path().join("link.jsonl");
            std::os::unix::fs::symlink(&input, &link).unwrap();
            assert!(check_output(&link, "--output", &inputs).is_err());
            let hard = dir.path().join("hard.jsonl");
            std::fs::hard_link(&input, &hard).unwrap();
            assert!(same_file(&hard, &input));
            assert!(check_output(&hard, "--output", &inputs).is_err());
        }
        // The input is untouched by all of this.
        assert_eq!(std::fs::read_to_string(&input).unwrap(), "{}\n");
    }

    #[test]
    fn other_files_and_new_files_are_fine_missing_folders_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.jsonl");
        std::fs::write(&input, "{}\n").unwrap();
        let other = dir.path().join("out.jsonl");
        std::fs::write(&other, "old").unwrap();
        let inputs = [("--input", input.as_path())];
        check_output(&other, "--output", &inputs).unwrap();
        check_output(&dir.path().join("new.jsonl"), "--output", &inputs).unwrap();
        check_output(Path::new("relative-new.jsonl"), "--output", &inputs).unwrap();
        let e = check_output(&dir.path().join("no/such/out.jsonl"), "--output", &inputs)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
        let e = check_output(dir.path(), "--output", &inputs)
            .unwrap_err()
            .to_string();
        assert!(e.contains("folder"), "{e}");
        assert!(!same_file(
            &dir.path().join("nope"),
            &dir.path().join("nope")
        ));
    }
}
