//! Charts of runs' metrics against the training step (`main_ppo plot`): one small chart per
//! metric in a grid, one line per run, a legend strip of run names on top. PNG and SVG come
//! from the same drawing code (plotters); text uses an embedded DejaVu Sans subset
//! (assets/fonts), so no system font or library is needed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::history::Run;

pub const DEFAULT_WIDTH: u32 = 1200;
pub const DEFAULT_HEIGHT: u32 = 800;
/// Smallest and largest accepted image side, in pixels.
pub const SIZE_RANGE: std::ops::RangeInclusive<u32> = 200..=10_000;
/// Stroke width of a run's line; axes and ticks are drawn 1 px wide.
pub const SERIES_STROKE: u32 = 2;

const FONT: &str = "sans-serif";
const LEGEND_HEIGHT: u32 = 28;
/// Line colours, one per run in argument order (matplotlib's tab10).
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("unknown metric `{metric}`: not in {runs}{}", close_names(.close))]
    UnknownMetric {
        metric: String,
        runs: String,
        close: Vec<String>,
    },
    #[error("metric `{metric}` has no finite values in {runs} (every value is NaN or infinite)")]
    NoFinite { metric: String, runs: String },
    #[error("none of the default metrics ({wanted}) has values in {runs}; choose some with --metrics{}", close_names(.some))]
    NoDefault {
        wanted: String,
        runs: String,
        some: Vec<String>,
    },
    #[error("{flag} {value}: must be between {} and {} pixels", SIZE_RANGE.start(), SIZE_RANGE.end())]
    Size { flag: &'static str, value: u32 },
    #[error("{}: cannot write: {message}", path.display())]
    Write { path: PathBuf, message: String },
    #[error("drawing the chart: {0}")]
    Draw(String),
}

fn close_names(names: &[String]) -> String {
    if names.is_empty() {
        String::new()
    } else {
        format!(" (close names: {})", names.join(", "))
    }
}

/// The default panel, in order; a line lists alternatives (first present wins).
const DEFAULT_PANEL: &str = "critic/score/mean, val-core/*/*/mean@*, val-aux/*/format/mean@* (else *format*), \
                             agent/tool_call_ratio, response_length/mean, actor/entropy, actor/kl_loss|actor/ppo_kl, \
                             train/loss, val/loss, timing_s/step";

/// Every metric name of any run.
fn all_keys(runs: &[Run]) -> BTreeSet<&str> {
    runs.iter()
        .flat_map(|r| r.series.keys().map(String::as_str))
        .collect()
}

fn run_list(runs: &[Run]) -> String {
    runs.iter()
        .map(|r| r.source.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The default panel's metrics that these runs have: score mean, validation score (every
/// `val-core/<source>/<var>/mean@N`: the core variable, `acc` or `reward`), a validation format
/// rate if one is logged (`val-aux/<source>/format/mean@N`, else a `val-*` key naming
/// `format`), the tool agent's call share, response length, entropy, KL (`actor/kl_loss`, else
/// `actor/ppo_kl`), an SFT run's `train/loss` and `val/loss`, seconds per step.
pub fn default_metrics(runs: &[Run]) -> Vec<String> {
    let keys = all_keys(runs);
    let mut out: Vec<String> = Vec::new();
    let mut first = |alternatives: &[&str]| {
        if let Some(k) = alternatives.iter().find(|k| keys.contains(**k)) {
            out.push(k.to_string());
        }
    };
    first(&["critic/score/mean"]);
    // `val-core/<source>/<acc|reward>/mean@N`: the core variable's mean, not its best/maj.
    let is_mean = |k: &str| {
        k.rsplit_once('/')
            .is_some_and(|(_, last)| last.starts_with("mean@"))
    };
    let val_reward: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| k.starts_with("val-core/") && is_mean(k))
        .collect();
    // Validation's `val-aux/<source>/format/mean@N` first, else any `val-*` key naming a format.
    let format_rate = keys
        .iter()
        .copied()
        .find(|k| k.starts_with("val-") && k.contains("/format/") && is_mean(k))
        .or_else(|| {
            ["val-core/", "val-aux/", "val"].iter().find_map(|prefix| {
                let found: Vec<&str> = keys
                    .iter()
                    .copied()
                    .filter(|k| k.starts_with(prefix) && k.contains("format"))
                    .collect();
                found
                    .iter()
                    .find(|k| k.contains("mean@"))
                    .or(found.first())
                    .copied()
            })
        });
    out.extend(val_reward.iter().map(|k| k.to_string()));
    out.extend(format_rate.map(str::to_string));
    let mut first = |alternatives: &[&str]| {
        if let Some(k) = alternatives.iter().find(|k| keys.contains(**k)) {
            out.push(k.to_string());
        }
    };
    first(&["agent/tool_call_ratio"]);
    first(&["response_length/mean"]);
    first(&["actor/entropy"]);
    first(&["actor/kl_loss", "actor/ppo_kl"]);
    first(&["train/loss"]);
    first(&["val/loss"]);
    first(&["timing_s/step"]);
    out
}

/// Up to five names of `keys` closest to `wanted`: those containing it first, then by edit
/// similarity.
fn close_to(wanted: &str, keys: &BTreeSet<&str>) -> Vec<String> {
    let lower = wanted.to_lowercase();
    let mut scored: Vec<(f64, &str)> = keys
        .iter()
        .map(|k| {
            let sub = if k.to_lowercase().contains(&lower) {
                1.0
            } else {
                0.0
            };
            (sub + strsim::normalized_levenshtein(wanted, k), *k)
        })
        .filter(|(s, _)| *s > 0.4)
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
    scored.into_iter().take(5).map(|(_, k)| k.into()).collect()
}

/// The metrics to chart: `requested` (each must be in some run and have a finite value in
/// some run), or the default panel (entries without finite values are left out).
pub fn choose_metrics(
    runs: &[Run],
    requested: Option<&[String]>,
) -> Result<Vec<String>, PlotError> {
    let keys = all_keys(runs);
    let has_finite = |m: &str| runs.iter().any(|r| !r.finite(m).is_empty());
    let Some(requested) = requested else {
        let chosen: Vec<String> = default_metrics(runs)
            .into_iter()
            .filter(|m| {
                let ok = has_finite(m);
                if !ok {
                    tracing::warn!("{m}: no finite values, left out of the chart");
                }
                ok
            })
            .collect();
        if chosen.is_empty() {
            let some = keys.iter().take(8).map(|k| k.to_string()).collect();
            return Err(PlotError::NoDefault {
                wanted: DEFAULT_PANEL.into(),
                runs: run_list(runs),
                some,
            });
        }
        return Ok(chosen);
    };
    let mut out = Vec::new();
    for m in requested.iter().map(|m| m.trim()).filter(|m| !m.is_empty()) {
        if !keys.contains(m) {
            return Err(PlotError::UnknownMetric {
                metric: m.into(),
                runs: run_list(runs),
                close: close_to(m, &keys),
            });
        }
        if !has_finite(m) {
            return Err(PlotError::NoFinite {
                metric: m.into(),
                runs: run_list(runs),
            });
        }
        if !out.iter().any(|o: &String| o == m) {
            out.push(m.to_string());
        }
    }
    Ok(out)
}

/// Checks an image size against [`SIZE_RANGE`].
pub fn check_size(width: u32, height: u32) -> Result<(), PlotError> {
    for (flag, value) in [("--width", width), ("--height", height)] {
        if !SIZE_RANGE.contains(&value) {
            return Err(PlotError::Size { flag, value });
        }
    }
    Ok(())
}

/// Registers the embedded font under [`FONT`] once; false if it could not be read.
fn font_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        let bytes = include_bytes!("../../assets/fonts/DejaVuSans-ASCII.ttf");
        plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok()
    })
}

fn draw_err(e: impl std::fmt::Display) -> PlotError {
    PlotError::Draw(e.to_string())
}

/// Legend names: file stems, or the whole paths where two runs share a stem.
fn legend_names(runs: &[Run]) -> Vec<String> {
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    let unique = names.iter().collect::<BTreeSet<_>>().len() == names.len();
    runs.iter()
        .map(|r| {
            if unique {
                r.name.clone()
            } else {
                r.source.display().to_string()
            }
        })
        .collect()
}

/// A tick label: up to three decimals without trailing zeros (`0.8`, `57.5`, `120`), exponent
/// form for very small or large values.
fn short(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        return "0".into();
    }
    if !(1e-3..1e5).contains(&a) {
        return format!("{v:.1e}");
    }
    let decimals = if a >= 100.0 {
        0
    } else if a >= 1.0 {
        2
    } else {
        3
    };
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// `lo..hi` widened so that a flat series still gets an axis, with a 5 % margin.
fn padded(lo: f64, hi: f64) -> (f64, f64) {
    if hi > lo {
        let m = (hi - lo) * 0.05;
        (lo - m, hi + m)
    } else {
        let m = (lo.abs() * 0.05).max(1e-3);
        (lo - m, hi + m)
    }
}

/// Draws the legend strip and one chart per metric on `root`.
pub fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Run],
    metrics: &[String],
) -> Result<(), PlotError> {
    if !font_ready() {
        return Err(PlotError::Draw(
            "the embedded font could not be read".into(),
        ));
    }
    root.fill(&WHITE).map_err(draw_err)?;
    let (legend, body) = root.split_vertically(LEGEND_HEIGHT);
    let font: TextStyle = (FONT, 14).into_font().into();
    let mut x = 10i32;
    for (i, name) in legend_names(runs).iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        legend
            .draw(&Rectangle::new([(x, 9), (x + 14, 21)], color.filled()))
            .map_err(draw_err)?;
        legend
            .draw(&Text::new(name.clone(), (x + 19, 8), font.clone()))
            .map_err(draw_err)?;
        let (w, _) = legend.estimate_text_size(name, &font).map_err(draw_err)?;
        x += 19 + w as i32 + 24;
    }
    let cols = (metrics.len() as f64).sqrt().ceil().max(1.0) as usize;
    let rows = metrics.len().div_ceil(cols);
    let panels = body.split_evenly((rows, cols));
    for (metric, area) in metrics.iter().zip(panels.iter()) {
        draw_panel(area, runs, metric)?;
    }
    root.present().map_err(draw_err)
}

/// One metric's chart: a line per run that has finite values of it (a dot where only one).
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    runs: &[Run],
    metric: &str,
) -> Result<(), PlotError> {
    let points: Vec<Vec<(f64, f64)>> = runs
        .iter()
        .map(|r| {
            r.finite(metric)
                .into_iter()
                .map(|(s, v)| (s as f64, v))
                .collect()
        })
        .collect();
    let all = points.iter().flatten();
    let (x0, x1) = all
        .clone()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
            (a.min(p.0), b.max(p.0))
        });
    let (y0, y1) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
        (a.min(p.1), b.max(p.1))
    });
    let (x0, x1) = if x1 > x0 {
        (x0, x1)
    } else {
        (x0 - 1.0, x1 + 1.0)
    };
    let (y0, y1) = padded(y0, y1);
    let mut chart = ChartBuilder::on(area)
        .caption(metric, (FONT, 13))
        .margin(6)
        .x_label_area_size(20)
        .y_label_area_size(48)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .x_labels(6)
        .y_labels(5)
        .label_style((FONT, 11))
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(215, 215, 215))
        .x_label_formatter(&|x| format!("{}", x.round() as i64))
        .y_label_formatter(&|y| short(*y))
        .draw()
        .map_err(draw_err)?;
    for (i, pts) in points.into_iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        if pts.len() == 1 {
            chart
                .draw_series(std::iter::once(Circle::new(pts[0], 3, color.filled())))
                .map_err(draw_err)?;
        }
        if !pts.is_empty() {
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(SERIES_STROKE)))
                .map_err(draw_err)?;
        }
    }
    Ok(())
}

fn create_parent(path: &Path) -> Result<(), PlotError> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            std::fs::create_dir_all(dir).map_err(|e| PlotError::Write {
                path: path.to_path_buf(),
                message: e.to_string(),
            })
        }
        _ => Ok(()),
    }
}

/// Draws the chart into a `width x height` RGB PNG at `path`.
pub fn write_png(
    path: &Path,
    runs: &[Run],
    metrics: &[String],
    width: u32,
    height: u32,
) -> Result<(), PlotError> {
    check_size(width, height)?;
    // [height, width, 3] RGB, row-major: the layout BitMapBackend draws into and PNG stores.
    let mut pixels = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (width, height)).into_drawing_area();
        draw(&root, runs, metrics)?;
    }
    create_parent(path)?;
    let werr = |e: &dyn std::fmt::Display| PlotError::Write {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let file = std::fs::File::create(path).map_err(|e| werr(&e))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), width, height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header().map_err(|e| werr(&e))?;
    w.write_image_data(&pixels).map_err(|e| werr(&e))?;
    w.finish().map_err(|e| werr(&e))
}

/// Draws the chart as a `width x height` SVG document.
pub fn svg_string(
    runs: &[Run],
    metrics: &[String],
    width: u32,
    height: u32,
) -> Result<String, PlotError> {
    check_size(width, height)?;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        draw(&root, runs, metrics)?;
    }
    Ok(svg)
}

/// Writes [`svg_string`] to `path`.
pub fn write_svg(
    path: &Path,
    runs: &[Run],
    metrics: &[String],
    width: u32,
    height: u32,
) -> Result<(), PlotError> {
    let svg = svg_string(runs, metrics, width, height)?;
    create_parent(path)?;
    std::fs::write(path, svg).map_err(|e| PlotError::Write {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::history::read_run;
    use crate::metrics::sinks::{JsonFile, MetricSink};
    use crate::metrics::tensorboard::EventWriter;
    use crate::metrics::Metrics;

    const PANEL: [&str; 8] = [
        "critic/score/mean",
        "val-core/openai/gsm8k/reward/mean@1",
        "val-aux/openai/gsm8k/format_rate/mean@1",
        "response_length/mean",
        "actor/entropy",
        "actor/kl_loss",
        "actor/ppo_kl",
        "timing_s/step",
    ];

    /// The metrics of step `s` of a made-up run (`shift` tells runs apart).
    fn step_metrics(s: u64, shift: f64) -> Metrics {
        let mut m: Metrics = PANEL
            .iter()
            .enumerate()
            .map(|(i, k)| (k.to_string(), shift + i as f64 + 0.1 * s as f64))
            .collect();
        m.insert("actor/pg_loss".into(), -0.5);
        m.insert("actor/grad_norm".into(), f64::NAN);
        m
    }

    fn jsonl_run(dir: &Path, name: &str, shift: f64) -> Run {
        let p = dir.join(format!("{name}.jsonl"));
        let mut sink = JsonFile::open(&p).unwrap();
        for s in 1..=5 {
            sink.log(&step_metrics(s, shift), s).unwrap();
        }
        drop(sink);
        read_run(&p).unwrap()
    }

    fn tb_run(dir: &Path, name: &str, shift: f64) -> Run {
        let d = dir.join(name);
        let mut w = EventWriter::create(&d).unwrap();
        for s in 1..=4 {
            let m = step_metrics(s, shift);
            let scalars: Vec<(&str, f32)> =
                m.iter().map(|(k, v)| (k.as_str(), *v as f32)).collect();
            w.scalars(s as i64, &scalars).unwrap();
        }
        read_run(&d).unwrap()
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// `(width, height, RGB pixels)` of a PNG file.
    fn decode(path: &Path) -> (u32, u32, Vec<u8>) {
        let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
        let mut reader = dec.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        buf.truncate(info.buffer_size());
        (info.width, info.height, buf)
    }

    fn has_pixel(pixels: &[u8], c: RGBColor) -> bool {
        pixels.chunks(3).any(|p| p == [c.0, c.1, c.2])
    }

    #[test]
    fn tick_labels() {
        // Expected by hand from the rule: <= 3 decimals, trailing zeros dropped.
        for (v, want) in [
            (0.0, "0"),
            (0.8, "0.8"),
            (1.0, "1"),
            (57.5, "57.5"),
            (120.4, "120"),
            (0.0025, "0.003"),
            (-0.5, "-0.5"),
            (2.5e-5, "2.5e-5"),
            (3.0e6, "3.0e6"),
        ] {
            assert_eq!(short(v), want, "{v}");
        }
    }

    #[test]
    fn default_panel_picks_verl_names() {
        let dir = tempfile::tempdir().unwrap();
        let run = jsonl_run(dir.path(), "a", 0.0);
        // Expected by hand from the panel's rules: kl_loss wins over ppo_kl; pg_loss and
        // grad_norm are not in the panel.
        let want = [
            "critic/score/mean",
            "val-core/openai/gsm8k/reward/mean@1",
            "val-aux/openai/gsm8k/format_rate/mean@1",
            "response_length/mean",
            "actor/entropy",
            "actor/kl_loss",
            "timing_s/step",
        ];
        assert_eq!(choose_metrics(&[run], None).unwrap(), strings(&want));
    }

    /// `main_ppo sft`'s metric names and a tool-agent run's call share, by hand from the
    /// panel's rules (grad_norm and lr are not in it).
    #[test]
    fn default_panel_charts_sft_runs_and_tool_calls() {
        let run = |keys: &[&str]| Run {
            name: "r".into(),
            source: PathBuf::from("r.jsonl"),
            files: vec![PathBuf::from("r.jsonl")],
            series: keys
                .iter()
                .map(|k| (k.to_string(), vec![(1, 0.5)]))
                .collect(),
        };
        let sft = run(&["train/loss", "train/grad_norm", "train/lr", "val/loss"]);
        assert_eq!(
            default_metrics(&[sft]),
            strings(&["train/loss", "val/loss"])
        );
        let agent = run(&[
            "timing_s/step",
            "agent/tool_call_ratio",
            "critic/score/mean",
        ]);
        assert_eq!(
            default_metrics(&[agent]),
            strings(&[
                "critic/score/mean",
                "agent/tool_call_ratio",
                "timing_s/step"
            ])
        );
    }

    #[test]
    fn default_panel_takes_the_core_mean_and_the_format_rate_of_validation() {
        // Names as validation writes them for gsm8k with two responses per prompt (a lone
        // numeric score is `acc`, so acc is the core variable).
        let keys = [
            "critic/score/mean",
            "val-aux/openai/gsm8k/format/best@2/mean",
            "val-aux/openai/gsm8k/format/mean@2",
            "val-aux/openai/gsm8k/format/std@2",
            "val-aux/openai/gsm8k/reward/mean@2",
            "val-core/openai/gsm8k/acc/best@2/mean",
            "val-core/openai/gsm8k/acc/mean@2",
        ];
        let run = Run {
            name: "r".into(),
            source: PathBuf::from("r.jsonl"),
            files: vec![PathBuf::from("r.jsonl")],
            series: keys
                .iter()
                .map(|k| (k.to_string(), vec![(1, 0.5)]))
                .collect(),
        };
        // By hand from the panel's rules: the core mean, then the format rate's mean.
        let want = [
            "critic/score/mean",
            "val-core/openai/gsm8k/acc/mean@2",
            "val-aux/openai/gsm8k/format/mean@2",
        ];
        assert_eq!(default_metrics(&[run]), strings(&want));
    }

    #[test]
    fn png_of_a_file_sink_run_decodes_at_the_requested_size() {
        let dir = tempfile::tempdir().unwrap();
        let run = jsonl_run(dir.path(), "a", 0.0);
        let metrics = choose_metrics(std::slice::from_ref(&run), None).unwrap();
        let out = dir.path().join("charts/a.png");
        write_png(&out, &[run], &metrics, 640, 480).unwrap();
        let (w, h, pixels) = decode(&out);
        assert_eq!((w, h), (640, 480));
        assert_eq!(pixels.len(), 640 * 480 * 3);
        // The run's colour is on the image (legend swatch and lines); the second is not.
        assert!(has_pixel(&pixels, COLORS[0]));
        assert!(!has_pixel(&pixels, COLORS[1]));
    }

    #[test]
    fn png_of_a_tensorboard_run_and_two_runs() {
        let dir = tempfile::tempdir().unwrap();
        let runs = [
            jsonl_run(dir.path(), "a", 0.0),
            tb_run(dir.path(), "tb", 1.0),
        ];
        let metrics = strings(&["actor/entropy", "timing_s/step"]);
        let out = dir.path().join("both.png");
        write_png(&out, &runs, &metrics, 500, 300).unwrap();
        let (w, h, pixels) = decode(&out);
        assert_eq!((w, h), (500, 300));
        assert!(has_pixel(&pixels, COLORS[0]) && has_pixel(&pixels, COLORS[1]));
    }

    #[test]
    fn svg_has_one_series_per_metric_and_run() {
        let dir = tempfile::tempdir().unwrap();
        let runs = [
            jsonl_run(dir.path(), "a", 0.0),
            tb_run(dir.path(), "tb", 1.0),
        ];
        let metrics = strings(&["critic/score/mean", "actor/entropy", "actor/pg_loss"]);
        let svg = svg_string(&runs, &metrics, 900, 600).unwrap();
        assert!(svg.contains("width=\"900\"") && svg.contains("height=\"600\""));
        // Series are the only polylines drawn SERIES_STROKE wide (axes and ticks are 1 px).
        let series: Vec<&str> = svg
            .split("<polyline")
            .skip(1)
            .filter(|p| p.contains(&format!("stroke-width=\"{SERIES_STROKE}\"")))
            .collect();
        assert_eq!(series.len(), metrics.len() * runs.len());
        for c in &COLORS[..2] {
            let hex = format!("stroke=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2);
            assert_eq!(
                series.iter().filter(|p| p.contains(&hex)).count(),
                3,
                "{hex}"
            );
        }
        // Panel titles and legend names are text.
        for t in [
            "\ncritic/score/mean\n",
            "\nactor/pg_loss\n",
            "\na\n",
            "\ntb\n",
        ] {
            assert!(svg.contains(t), "{t}");
        }
        // The file run has 5 points per series, the TensorBoard run 4.
        let points = |p: &str| {
            p.split("points=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .split_whitespace()
                .count()
        };
        let mut counts: Vec<usize> = series.iter().map(|p| points(p)).collect();
        counts.sort();
        assert_eq!(counts, vec![4, 4, 4, 5, 5, 5]);
    }

    #[test]
    fn bad_requests_name_the_metric() {
        let dir = tempfile::tempdir().unwrap();
        let runs = [jsonl_run(dir.path(), "a", 0.0)];
        let e = choose_metrics(&runs, Some(&strings(&["actor/entropyy"])))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown metric `actor/entropyy`") && e.contains("a.jsonl"),
            "{e}"
        );
        assert!(e.contains("close names: actor/entropy"), "{e}");
        let e = choose_metrics(&runs, Some(&strings(&["actor/grad_norm"])))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`actor/grad_norm` has no finite values"), "{e}");
        let e = write_png(
            &dir.path().join("x.png"),
            &runs,
            &strings(&["actor/entropy"]),
            50,
            400,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--width 50"), "{e}");
    }

    #[test]
    fn no_default_metric_lists_what_the_run_has() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("other.jsonl");
        std::fs::write(&p, "{\"step\": 1, \"data\": {\"foo/bar\": 1.0}}\n").unwrap();
        let run = read_run(&p).unwrap();
        let e = choose_metrics(&[run], None).unwrap_err().to_string();
        assert!(
            e.contains("none of the default metrics") && e.contains("foo/bar"),
            "{e}"
        );
    }
}
