//! Reading a finished (or running) run's metrics back: the `file` sink's JSONL
//! (`{"step": N, "data": {name: value, ...}}` per line, see [`super::sinks::JsonFile`]) or a
//! TensorBoard log folder / event file written by [`super::tensorboard::EventWriter`].
//! The result is one series of `(step, value)` points per metric name, in step order.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One run: a name for legends, where it came from, and its metrics by verl name.
#[derive(Debug, Clone)]
pub struct Run {
    pub name: String,
    pub source: PathBuf,
    /// Every file read (the JSONL, or each event file of a log folder): what an output must not
    /// replace.
    pub files: Vec<PathBuf>,
    /// `metric -> [(step, value)]`, sorted by step; non-finite values are kept as NaN.
    pub series: BTreeMap<String, Vec<(u64, f64)>>,
}

impl Run {
    /// The finite points of `metric` (empty when the run lacks it).
    pub fn finite(&self, metric: &str) -> Vec<(u64, f64)> {
        self.series
            .get(metric)
            .map(|s| s.iter().copied().filter(|(_, v)| v.is_finite()).collect())
            .unwrap_or_default()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("{}: no such file or folder (give the `file` logger's .jsonl, from trainer.logger=[console,file], or a TensorBoard log folder)", .0.display())]
    Missing(PathBuf),
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}, line {line}: {message}", path.display())]
    Json {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{}, record {record} at byte {offset}: {message}", path.display())]
    Event {
        path: PathBuf,
        record: usize,
        offset: usize,
        message: String,
    },
    #[error("{}: no `events.out.tfevents.*` files in this folder", .0.display())]
    NoEventFiles(PathBuf),
    #[error("{}: the run holds no metrics (no steps logged yet?)", .0.display())]
    Empty(PathBuf),
}

/// Reads a run from `path`: a folder is a TensorBoard log folder (every `*tfevents*` file in
/// it, merged), a file whose name contains `tfevents` one event file, anything else the
/// `file` sink's JSONL.
pub fn read_run(path: &Path) -> Result<Run, HistoryError> {
    if !path.exists() {
        return Err(HistoryError::Missing(path.to_path_buf()));
    }
    let mut points: Vec<(String, u64, f64)> = Vec::new();
    let mut read: Vec<PathBuf> = Vec::new();
    let is_events = |p: &Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.contains("tfevents"))
    };
    if path.is_dir() {
        let io = |source| HistoryError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(io)?
            .map(|e| e.map(|e| e.path()).map_err(io))
            .collect::<Result<_, _>>()?;
        files.retain(|p| p.is_file() && is_events(p));
        files.sort();
        if files.is_empty() {
            return Err(HistoryError::NoEventFiles(path.to_path_buf()));
        }
        for f in &files {
            read_events(f, &mut points)?;
        }
        read = files;
    } else if is_events(path) {
        read_events(path, &mut points)?;
        read.push(path.to_path_buf());
    } else {
        read_jsonl(path, &mut points)?;
        read.push(path.to_path_buf());
    }
    let mut series: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    for (k, step, v) in points {
        series.entry(k).or_default().push((step, v));
    }
    if series.is_empty() {
        return Err(HistoryError::Empty(path.to_path_buf()));
    }
    for s in series.values_mut() {
        // Stable: a step logged twice (a resumed run) keeps the later value last.
        s.sort_by_key(|(step, _)| *step);
    }
    Ok(Run {
        name: run_name(path),
        source: path.to_path_buf(),
        files: read,
        series,
    })
}

/// The legend name of a run: the JSONL file's stem, the log folder's name.
fn run_name(path: &Path) -> String {
    let base = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    base.map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

fn read_jsonl(path: &Path, out: &mut Vec<(String, u64, f64)>) -> Result<(), HistoryError> {
    let text = std::fs::read_to_string(path).map_err(|source| HistoryError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let err = |message: String| HistoryError::Json {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        // Python's json writes NaN, Infinity and -Infinity literals (not JSON): read them as
        // the non-finite values they are instead of refusing the whole run.
        let line = python_literals(line);
        let row: serde_json::Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            // A run being written may end in half a line: plot what is complete.
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {
                tracing::warn!(
                    "{}, line {}: incomplete last line skipped",
                    path.display(),
                    i + 1
                );
                break;
            }
            Err(e) => return Err(err(format!("not JSON: {e}"))),
        };
        let step = row
            .get("step")
            .and_then(|s| s.as_u64())
            .ok_or_else(|| err("`step` must be a non-negative integer".into()))?;
        let data = row.get("data").and_then(|d| d.as_object()).ok_or_else(|| {
            err("`data` must be an object of metric values ({\"step\": N, \"data\": {...}})".into())
        })?;
        for (k, v) in data {
            let value = match v {
                serde_json::Value::Number(n) => n.as_f64().unwrap_or(f64::NAN),
                // serde_json writes NaN and infinities as null.
                serde_json::Value::Null => f64::NAN,
                // Text or nested values (other loggers' extras) are not plottable.
                _ => continue,
            };
            out.push((k.clone(), step, value));
        }
    }
    Ok(())
}

/// `line` with Python's bare `NaN`, `Infinity` and `-Infinity` (outside strings) replaced by
/// `null`, which the reader takes as a non-finite value; anything else is left as it is.
fn python_literals(line: &str) -> std::borrow::Cow<'_, str> {
    if !(line.contains("NaN") || line.contains("Infinity")) {
        return std::borrow::Cow::Borrowed(line);
    }
    let mut out = String::with_capacity(line.len());
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            rest = &rest[c.len_utf8()..];
            continue;
        }
        let literal = ["-Infinity", "Infinity", "NaN"]
            .into_iter()
            .find(|l| rest.starts_with(l));
        match literal {
            Some(l) => {
                out.push_str("null");
                rest = &rest[l.len()..];
            }
            None => {
                in_string = c == '"';
                out.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
    }
    std::borrow::Cow::Owned(out)
}

fn read_events(path: &Path, out: &mut Vec<(String, u64, f64)>) -> Result<(), HistoryError> {
    let data = std::fs::read(path).map_err(|source| HistoryError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let records = super::tensorboard::read_records(&data).map_err(|e| HistoryError::Event {
        path: path.to_path_buf(),
        record: e.record,
        offset: e.offset,
        message: e.message,
    })?;
    let mut negative = 0usize;
    for (step, values) in records {
        // A negative step has no place on the chart's axis (it used to be drawn at 0).
        let Ok(step) = u64::try_from(step) else {
            negative += 1;
            continue;
        };
        for (tag, v) in values {
            out.push((tag, step, f64::from(v)));
        }
    }
    if negative > 0 {
        tracing::warn!(
            "{}: {negative} record(s) with a negative step left out of the chart",
            path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::sinks::{JsonFile, MetricSink};
    use crate::metrics::tensorboard::EventWriter;
    use crate::metrics::Metrics;

    fn metrics(pairs: &[(&str, f64)]) -> Metrics {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn jsonl_of_the_file_sink_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("exp.jsonl");
        let mut sink = JsonFile::open(&p).unwrap();
        sink.log(&metrics(&[("critic/score/mean", 0.25), ("x", f64::NAN)]), 1)
            .unwrap();
        sink.log(&metrics(&[("critic/score/mean", 0.5)]), 2)
            .unwrap();
        drop(sink);
        let run = read_run(&p).unwrap();
        assert_eq!(run.name, "exp");
        assert_eq!(run.series["critic/score/mean"], vec![(1, 0.25), (2, 0.5)]);
        // NaN is written as null and comes back as a non-finite point.
        assert!(run.series["x"][0].1.is_nan());
        assert!(run.finite("x").is_empty());
    }

    #[test]
    fn tensorboard_folder_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let tb = dir.path().join("tb_run");
        let mut w = EventWriter::create(&tb).unwrap();
        w.scalars(1, &[("actor/entropy", 2.5)]).unwrap();
        w.scalars(2, &[("actor/entropy", 2.25)]).unwrap();
        let run = read_run(&tb).unwrap();
        assert_eq!(run.name, "tb_run");
        assert_eq!(run.series["actor/entropy"], vec![(1, 2.5), (2, 2.25)]);
        let one = read_run(&w.path).unwrap();
        assert_eq!(one.series["actor/entropy"].len(), 2);
    }

    #[test]
    fn bad_runs_name_the_file_and_place() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.jsonl");
        let e = read_run(&missing).unwrap_err().to_string();
        assert!(
            e.contains("nope.jsonl") && e.contains("no such file"),
            "{e}"
        );

        let empty = dir.path().join("empty.jsonl");
        std::fs::write(&empty, "").unwrap();
        let e = read_run(&empty).unwrap_err().to_string();
        assert!(e.contains("empty.jsonl") && e.contains("no metrics"), "{e}");

        let bad = dir.path().join("bad.jsonl");
        std::fs::write(&bad, "{\"step\": 1, \"data\": {}}\n[1,2]\n").unwrap();
        let e = read_run(&bad).unwrap_err().to_string();
        assert!(
            e.contains("bad.jsonl, line 2") && e.contains("`step`"),
            "{e}"
        );

        let no_events = dir.path().join("logs");
        std::fs::create_dir(&no_events).unwrap();
        let e = read_run(&no_events).unwrap_err().to_string();
        assert!(e.contains("logs") && e.contains("tfevents"), "{e}");
    }

    #[test]
    fn incomplete_last_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("live.jsonl");
        std::fs::write(
            &p,
            "{\"step\": 1, \"data\": {\"a\": 1.0}}\n{\"step\": 2, \"da",
        )
        .unwrap();
        assert_eq!(read_run(&p).unwrap().series["a"], vec![(1, 1.0)]);
    }

    #[test]
    fn corrupt_event_file_names_file_and_record() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(1, &[("a", 1.0)]).unwrap();
        let mut bytes = std::fs::read(&w.path).unwrap();
        let last = bytes.len() - 6; // inside the second record's payload
        bytes[last] ^= 0xff;
        std::fs::write(&w.path, &bytes).unwrap();
        let e = read_run(dir.path()).unwrap_err().to_string();
        let name = w.path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(e.contains(&name) && e.contains("record 2"), "{e}");
        assert!(e.contains("checksum"), "{e}");
    }
    /// Python's json writes bare NaN / Infinity / -Infinity: those values read as non-finite
    /// (the rest of the run plots) instead of refusing the file; a string holding the words is
    /// left alone.
    #[test]
    fn python_nan_and_infinity_literals_read_as_non_finite() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        let lines = [
            r#"{"step": 1, "data": {"a": NaN, "b": 2.0, "note": "NaN, Infinity"}}"#,
            r#"{"step": 2, "data": {"a": -Infinity, "b": Infinity}}"#,
            r#"{"step": 3, "data": {"a": 0.5, "b": 1e-3}}"#,
        ];
        std::fs::write(&p, lines.join("\n") + "\n").unwrap();
        let run = read_run(&p).unwrap();
        let a = &run.series["a"];
        assert!(a[0].1.is_nan() && a[1].1.is_nan(), "{a:?}");
        assert_eq!(a[2], (3, 0.5));
        assert_eq!(run.series["b"][0], (1, 2.0));
        assert!(run.series["b"][1].1.is_nan());
        assert!(!run.series.contains_key("note"), "text is not plotted");
        assert_eq!(run.files, vec![p]);
    }

    /// A TensorBoard record with a negative step is left out (it was drawn at step 0).
    #[test]
    fn negative_tensorboard_steps_are_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(-3, &[("x", 9.0)]).unwrap();
        w.scalars(2, &[("x", 1.0)]).unwrap();
        drop(w);
        let run = read_run(dir.path()).unwrap();
        assert_eq!(run.series["x"], vec![(2, 1.0)]);
        assert_eq!(run.files.len(), 1);
    }
}
