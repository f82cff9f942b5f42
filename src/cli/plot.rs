//! `main_ppo plot RUN [RUN ...]`: charts of runs' metrics against the step, as PNG and/or SVG.
//! Reading runs is `metrics::history`, drawing is `metrics::plot`; this only maps flags.

use std::path::{Path, PathBuf};

use clap::Args;

use crate::metrics::history::{read_run, Run};
use crate::metrics::plot::{self, DEFAULT_HEIGHT, DEFAULT_WIDTH};

#[derive(Debug, Args)]
pub struct PlotArgs {
    /// Runs: the `file` logger's .jsonl, or a TensorBoard log folder (or one event file).
    /// Several runs share each chart, one line per run.
    #[arg(value_name = "RUN", required = true)]
    pub runs: Vec<PathBuf>,
    /// Metrics to chart, comma-separated verl names (default: critic/score/mean, the
    /// val-core mean (acc or reward), the validation format rate
    /// (val-aux/<source>/format/mean@N) if logged, agent/tool_call_ratio,
    /// response_length/mean, actor/entropy, actor/kl_loss or actor/ppo_kl, an SFT run's
    /// train/loss and val/loss, timing_s/step).
    #[arg(long, value_delimiter = ',', value_name = "A,B,...")]
    pub metrics: Vec<String>,
    /// PNG to write (default: beside the first run, `<run>.png`, or `metrics.png` in a log
    /// folder; not written when only --svg is given).
    #[arg(long, value_name = "FILE.png")]
    pub out: Option<PathBuf>,
    /// Also (or only) write the chart as SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub svg: Option<PathBuf>,
    /// Image width in pixels.
    #[arg(long, default_value_t = DEFAULT_WIDTH)]
    pub width: u32,
    /// Image height in pixels.
    #[arg(long, default_value_t = DEFAULT_HEIGHT)]
    pub height: u32,
}

/// Where the PNG goes when --out is not given.
fn default_png(run: &Run) -> PathBuf {
    if run.source.is_dir() {
        run.source.join("metrics.png")
    } else {
        run.source.with_extension("png")
    }
}

fn has_ext(p: &Path, ext: &str) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case(ext))
}

pub fn run(args: &PlotArgs) -> anyhow::Result<()> {
    plot::check_size(args.width, args.height)?;
    for (flag, path, ext) in [("--out", &args.out, "png"), ("--svg", &args.svg, "svg")] {
        if let Some(p) = path.as_ref().filter(|p| !has_ext(p, ext)) {
            anyhow::bail!(
                "{flag} {}: {flag} writes .{ext} files (--out FILE.png for PNG, --svg FILE.svg for SVG)",
                p.display()
            );
        }
    }
    let runs = args
        .runs
        .iter()
        .map(|p| read_run(p))
        .collect::<Result<Vec<_>, _>>()?;
    let requested = (!args.metrics.is_empty()).then_some(args.metrics.as_slice());
    let metrics = plot::choose_metrics(&runs, requested)?;
    let png = match (&args.out, &args.svg) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(_)) => None,
        (None, None) => Some(default_png(&runs[0])),
    };
    // No chart replaces a file it was drawn from, however the paths are spelt (a symlink, a
    // hard link, an input named `.png` whose default chart is itself).
    // (Identity only: a chart's missing folder is created, as before.)
    let inputs: Vec<&Path> = runs
        .iter()
        .flat_map(|r| r.files.iter())
        .map(PathBuf::as_path)
        .collect();
    for (flag, out) in [("--out", &png), ("--svg", &args.svg)] {
        let Some(out) = out else { continue };
        if let Some(input) = inputs.iter().find(|i| super::guard::same_file(out, i)) {
            anyhow::bail!(
                "{flag} {} is the same file as the run file {}; writing it would destroy the input: choose another output file",
                out.display(),
                input.display()
            );
        }
    }
    if let (Some(a), Some(b)) = (&png, &args.svg) {
        if super::guard::same_file(a, b) || a == b {
            anyhow::bail!("--out and --svg name one file ({}): give two", a.display());
        }
    }
    if let Some(p) = &png {
        plot::write_png(p, &runs, &metrics, args.width, args.height)?;
        println!("{}", p.display());
    }
    if let Some(p) = &args.svg {
        plot::write_svg(p, &runs, &metrics, args.width, args.height)?;
        println!("{}", p.display());
    }
    tracing::info!(
        "charted {} of {} run(s): {}",
        metrics.len(),
        runs.len(),
        metrics.join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(runs: Vec<PathBuf>, out: Option<PathBuf>, svg: Option<PathBuf>) -> PlotArgs {
        PlotArgs {
            runs,
            metrics: vec![],
            out,
            svg,
            width: 320,
            height: 240,
        }
    }

    /// A run file of three steps; returns its path and its bytes.
    fn run_file(dir: &Path, name: &str) -> (PathBuf, Vec<u8>) {
        let p = dir.join(name);
        let text: String = (1..=3)
            .map(|s| {
                format!(
                    "{{\"step\": {s}, \"data\": {{\"critic/score/mean\": {}}}}}\n",
                    s as f64 / 10.0
                )
            })
            .collect();
        std::fs::write(&p, &text).unwrap();
        (p, text.into_bytes())
    }

    /// No chart replaces the run it is drawn from: a run file named `.png` charted to its
    /// default `--out` (itself), `--out` reaching it through a symlink, `--svg` through a hard
    /// link. Each is refused naming the flag, and the run file keeps its bytes.
    #[test]
    fn a_chart_never_replaces_its_run_file() {
        let dir = tempfile::tempdir().unwrap();
        let (png_named, bytes) = run_file(dir.path(), "run.png");
        let e = run(&args(vec![png_named.clone()], None, None))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--out") && e.contains("same file"), "{e}");
        assert_eq!(std::fs::read(&png_named).unwrap(), bytes);

        let (jsonl, bytes) = run_file(dir.path(), "run.jsonl");
        let link = dir.path().join("link.png");
        std::os::unix::fs::symlink(&jsonl, &link).unwrap();
        let e = run(&args(vec![jsonl.clone()], Some(link), None))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--out") && e.contains("same file"), "{e}");
        let hard = dir.path().join("hard.svg");
        std::fs::hard_link(&jsonl, &hard).unwrap();
        let e = run(&args(vec![jsonl.clone()], None, Some(hard)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--svg") && e.contains("same file"), "{e}");
        assert_eq!(std::fs::read(&jsonl).unwrap(), bytes);

        // A fresh output is written as before.
        let fine = dir.path().join("chart.png");
        run(&args(vec![jsonl], Some(fine.clone()), None)).unwrap();
        assert!(std::fs::read(&fine).unwrap().starts_with(b"\x89PNG"));
    }
}
