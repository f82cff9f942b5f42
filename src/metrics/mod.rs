//! Metrics: verl's names, the statistics behind them, timers, and the sinks `trainer.logger`
//! selects (`console`, `file`, `tensorboard`).
//! verl: `verl/trainer/ppo/metric_utils.py`, `verl/utils/tracking.py`,
//! `verl/utils/logger/aggregate_logger.py`.

pub mod history;
pub mod plot;
pub mod remote;
pub mod sinks;
pub mod tensorboard;

use std::collections::BTreeMap;
use std::time::Instant;

pub use sinks::{check_backends, MetricSink, RemoteOptions, Tracker};

/// One step's metrics, by verl name, sorted (as the console line prints them).
pub type Metrics = BTreeMap<String, f64>;

/// `{prefix}/mean`, `{prefix}/max`, `{prefix}/min` of `values` (nothing when empty).
pub fn add_stats(m: &mut Metrics, prefix: &str, values: &[f64]) {
    if values.is_empty() {
        return;
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    m.insert(format!("{prefix}/mean"), mean);
    m.insert(format!("{prefix}/max"), max);
    m.insert(format!("{prefix}/min"), min);
}

/// Mean of `values`, NaN when empty.
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        f64::NAN
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// Wall-clock phases of a step, reported as `timing_s/<phase>`.
#[derive(Debug, Default)]
pub struct Timings {
    pub seconds: BTreeMap<&'static str, f64>,
}

impl Timings {
    /// Runs `f` as phase `name` (time adds up if the phase runs twice) inside a tracing span of
    /// the same name.
    pub fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let _span = tracing::info_span!("phase", name).entered();
        let t = Instant::now();
        let out = f();
        *self.seconds.entry(name).or_default() += t.elapsed().as_secs_f64();
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(
                "{name}: {:.1} s, resident {:.2} GB, peak {:.2} GB",
                t.elapsed().as_secs_f64(),
                rss_bytes().unwrap_or(0) as f64 / (1u64 << 30) as f64,
                peak_rss_bytes().unwrap_or(0) as f64 / (1u64 << 30) as f64
            );
        }
        out
    }

    pub fn get(&self, name: &str) -> f64 {
        self.seconds.get(name).copied().unwrap_or(0.0)
    }

    /// `timing_s/*` for every phase, and `timing_per_token_ms/*` (gen per response token, the
    /// others per token of the whole batch).
    pub fn write(&self, m: &mut Metrics, response_tokens: usize, all_tokens: usize) {
        for (k, s) in &self.seconds {
            m.insert(format!("timing_s/{k}"), *s);
        }
        for k in [
            "gen",
            "ref",
            "values",
            "adv",
            "update_critic",
            "update_actor",
        ] {
            if let Some(s) = self.seconds.get(k) {
                let tokens = if k == "gen" {
                    response_tokens
                } else {
                    all_tokens
                };
                if tokens > 0 {
                    m.insert(
                        format!("timing_per_token_ms/{k}"),
                        s * 1000.0 / tokens as f64,
                    );
                }
            }
        }
    }
}

fn proc_status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Peak resident memory of this process in bytes (Linux `VmHWM`), when the OS tells.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_bytes("VmHWM:")
}

/// Resident memory of this process now (Linux `VmRSS`).
pub fn rss_bytes() -> Option<u64> {
    proc_status_bytes("VmRSS:")
}

/// A number as Python's `repr` prints it (`1.0`, `0.25`, `1e-05`, `nan`), as verl's console line
/// shows floats.
pub fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let exp = x.abs().log10().floor() as i32;
    if !(-4..16).contains(&exp) {
        // Shortest round-trip digits in exponent form, two-digit exponent at least.
        let s = format!("{x:e}");
        let (mant, e) = s.split_once('e').expect("exponent form");
        let e: i32 = e.parse().expect("exponent");
        let sign = if e < 0 { '-' } else { '+' };
        return format!("{mant}e{sign}{:02}", e.abs());
    }
    let s = format!("{x}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn py_float_matches_python_repr() {
        // Expected strings: Python 3 `repr(float(x))`.
        for (x, want) in [
            (1.0, "1.0"),
            (0.25, "0.25"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (-2.5e-7, "-2.5e-07"),
            (0.1 + 0.2, "0.30000000000000004"),
            (f64::NAN, "nan"),
            (-3.0, "-3.0"),
        ] {
            assert_eq!(py_float(x), want, "{x}");
        }
    }

    #[test]
    fn stats_and_timings() {
        let mut m = Metrics::new();
        add_stats(&mut m, "critic/score", &[1.0, 0.0, 0.5]);
        assert_eq!(m["critic/score/mean"], 0.5);
        assert_eq!(m["critic/score/max"], 1.0);
        assert_eq!(m["critic/score/min"], 0.0);
        let mut t = Timings::default();
        t.seconds.insert("gen", 2.0);
        t.seconds.insert("update_actor", 1.0);
        t.write(&mut m, 1000, 4000);
        assert_eq!(m["timing_s/gen"], 2.0);
        assert_eq!(m["timing_per_token_ms/gen"], 2.0);
        assert_eq!(m["timing_per_token_ms/update_actor"], 0.25);
    }
}
