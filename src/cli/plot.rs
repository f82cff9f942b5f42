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
    /// (val-aux/<source>/format/mean@N) if logged, response_length/mean,
    /// actor/entropy, actor/kl_loss or actor/ppo_kl, timing_s/step).
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
