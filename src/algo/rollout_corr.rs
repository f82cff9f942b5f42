//! Rollout correction (verl 1dda039's `rollout_corr_helper`): importance weights and rejection
//! between the policy that sampled a batch (the rollout's own per-token log-probs) and the
//! trainer's recomputation of the same policy (the old log-probs). The two differ when the
//! rollout runs in other arithmetic (bf16 decode here, vLLM elsewhere) or on older weights.
//!
//! With `log r = old − rollout` per token (`[batch, len]`, masked by the response mask):
//! - **IS weights** (`rollout_is`): per token `exp(log r)`, or per sequence `exp(Σ log r)`
//!   broadcast over its tokens, the log clamped to ±20; then either truncated at the upper
//!   threshold (TIS: `rollout_is_threshold` a number) or zeroed outside `[lower, upper]`
//!   (IcePop: a `"lower_upper"` string); optionally divided by their batch mean.
//! - **Rejection** (`rollout_rs`, comma-separated options, all must pass): token or sequence
//!   statistics of `k1 = −log r`, `k2 = ½ (log r)²`, `k3 = exp(log r) − 1 − log r` (the log
//!   clamped to ±20) against thresholds; a rejected token's (or sequence's) mask becomes 0.
//!   k1 options take ratio bounds `"lower_upper"` (compared as logs; one number `u` means
//!   `[1/u, u]`), k2/k3 an upper bound.
//! - **Metrics**, `rollout_corr/*` with verl's names: weight and statistic summaries, rejected
//!   fractions, and the off-policy diagnostics (KL, perplexities, χ²) that are logged even
//!   with neither correction on.
//!
//! Everything runs on the host in f64; masked means are verl's `Σ(x·m) / (Σm + 1e-8)`.

use std::collections::BTreeMap;

pub use crate::config::rollout_corr::{
    Correction, Divergence, IsLevel, IsThreshold, RsOption, RsScope,
};

/// The clamp on log-ratios before exponentiating (verl's `SAFETY_BOUND`).
pub const SAFETY_BOUND: f64 = 20.0;

/// A `[rows, cols]` row-major matrix of f64.
#[derive(Debug, Clone, PartialEq)]
pub struct Grid {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f64>,
}

impl Grid {
    pub fn new(rows: usize, cols: usize, data: Vec<f64>) -> Self {
        assert_eq!(data.len(), rows * cols, "grid of {rows}x{cols}");
        Self { rows, cols, data }
    }

    fn map(&self, f: impl Fn(f64) -> f64) -> Grid {
        Grid::new(
            self.rows,
            self.cols,
            self.data.iter().map(|&x| f(x)).collect(),
        )
    }

    fn zip(&self, o: &Grid, f: impl Fn(f64, f64) -> f64) -> Grid {
        let data = self
            .data
            .iter()
            .zip(&o.data)
            .map(|(&a, &b)| f(a, b))
            .collect();
        Grid::new(self.rows, self.cols, data)
    }

    pub fn row(&self, r: usize) -> &[f64] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// What [`correct`] gives.
#[derive(Debug, Clone, PartialEq)]
pub struct Corrected {
    /// The IS weights (0 on padding), when `rollout_is` is set.
    pub weights: Option<Grid>,
    /// The response mask with rejected tokens set to 0.
    pub mask: Grid,
    /// `rollout_corr/*` metrics.
    pub metrics: BTreeMap<String, f64>,
}

fn masked_sum_rows(v: &Grid, m: &Grid) -> Vec<f64> {
    (0..v.rows)
        .map(|r| {
            v.row(r)
                .iter()
                .zip(m.row(r))
                .map(|(&x, &w)| if w != 0.0 { x * w } else { 0.0 })
                .sum()
        })
        .collect()
}

fn count_rows(m: &Grid) -> Vec<f64> {
    (0..m.rows).map(|r| m.row(r).iter().sum()).collect()
}

fn masked_mean_rows(v: &Grid, m: &Grid) -> Vec<f64> {
    masked_sum_rows(v, m)
        .iter()
        .zip(count_rows(m))
        .map(|(s, c)| s / (c + 1e-8))
        .collect()
}

fn masked_mean(v: &Grid, m: &Grid) -> f64 {
    let s: f64 = masked_sum_rows(v, m).iter().sum();
    s / (m.data.iter().sum::<f64>() + 1e-8)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// torch's `std` (Bessel-corrected).
fn std_unbiased(v: &[f64]) -> f64 {
    let mu = mean(v);
    (v.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / (v.len() as f64 - 1.0)).sqrt()
}

fn max(v: impl IntoIterator<Item = f64>) -> f64 {
    v.into_iter().fold(f64::NEG_INFINITY, f64::max)
}

fn min(v: impl IntoIterator<Item = f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// The share of `true`s, in f32 as verl takes it (`bool_tensor.float().mean()`).
fn frac32(v: impl IntoIterator<Item = bool>) -> f64 {
    let (mut yes, mut n) = (0usize, 0usize);
    for b in v {
        yes += usize::from(b);
        n += 1;
    }
    (yes as f32 / n as f32) as f64
}

fn indicator(g: &Grid, f: impl Fn(f64) -> bool) -> Grid {
    g.map(|x| f64::from(u8::from(f(x))))
}

/// The masked values of `v` (where `m` is not 0).
fn masked<'a>(v: &'a Grid, m: &'a Grid) -> impl Iterator<Item = f64> + 'a {
    v.data
        .iter()
        .zip(&m.data)
        .filter(|(_, &w)| w != 0.0)
        .map(|(&x, _)| x)
}

/// Rollout correction of one batch: `old` (the trainer's log-probs), `rollout` (the
/// rollout's), `mask` (the response mask), all `[rows, cols]`. An error when the mask holds no
/// token (verl's rule).
pub fn correct(
    old: &Grid,
    rollout: &Grid,
    mask: &Grid,
    c: &Correction,
) -> Result<Corrected, String> {
    if !mask.data.iter().any(|&m| m != 0.0) {
        return Err("the response mask holds no token".into());
    }
    let log_ratio = old.zip(rollout, |a, b| a - b);
    let mut metrics = BTreeMap::new();
    let weights = c.is.map(|(level, t)| {
        is_weights(
            &log_ratio,
            mask,
            level,
            t,
            c.is_batch_normalize,
            &mut metrics,
        )
    });
    let mask_out = if c.rs.is_empty() {
        mask.clone()
    } else {
        rejection(&log_ratio, mask, &c.rs, &mut metrics)
    };
    offpolicy_metrics(old, rollout, mask, &mut metrics);
    let metrics = metrics
        .into_iter()
        .map(|(k, v)| (format!("rollout_corr/{k}"), v))
        .collect();
    Ok(Corrected {
        weights,
        mask: mask_out,
        metrics,
    })
}

fn clamp_log(x: f64) -> f64 {
    x.clamp(-SAFETY_BOUND, SAFETY_BOUND)
}

/// IS weights and their metrics (`compute_rollout_correction_weights`).
fn is_weights(
    log_ratio: &Grid,
    mask: &Grid,
    level: IsLevel,
    t: IsThreshold,
    batch_normalize: bool,
    m: &mut BTreeMap<String, f64>,
) -> Grid {
    let (b, w) = (log_ratio.rows, log_ratio.cols);
    let seq_sums = masked_sum_rows(log_ratio, mask);
    let raw = match level {
        IsLevel::Token => log_ratio.map(|x| clamp_log(x).exp()),
        IsLevel::Sequence => Grid::new(
            b,
            w,
            (0..b * w)
                .map(|i| clamp_log(seq_sums[i / w]).exp())
                .collect(),
        ),
    }
    .zip(mask, |x, k| x * k);
    let weights = match t.lower {
        None => raw.map(|x| x.min(t.upper)),
        Some(lo) => raw.map(|x| if x >= lo && x <= t.upper { x } else { 0.0 }),
    };
    is_metrics(m, &weights, &raw, &seq_sums, mask, level, t);
    match batch_normalize {
        true => normalize(weights, mask, level, m),
        false => weights,
    }
}

/// The metrics of IS `weights` (`compute_is_metrics`): `raw` are the weights before truncation,
/// `seq_sums` each row's summed log-ratio.
fn is_metrics(
    m: &mut BTreeMap<String, f64>,
    weights: &Grid,
    raw: &Grid,
    seq_sums: &[f64],
    mask: &Grid,
    level: IsLevel,
    t: IsThreshold,
) {
    let lower = t.lower.unwrap_or(1.0 / t.upper);
    // verl compares against logs of float32 scalars.
    let (log_up, log_lo) = ((t.upper as f32).ln() as f64, (lower as f32).ln() as f64);
    let mut put = |k: &str, v: f64| {
        m.insert(format!("rollout_is_{k}"), v);
    };
    put("mean", masked_mean(weights, mask));
    let sums = || seq_sums.iter().copied();
    match level {
        IsLevel::Sequence => {
            put("max", max(sums()).min(SAFETY_BOUND).exp());
            put("min", min(sums()).exp());
            put("ratio_fraction_high", frac32(sums().map(|s| s > log_up)));
            put("ratio_fraction_low", frac32(sums().map(|s| s < log_lo)));
        }
        IsLevel::Token => {
            let high = masked_mean(&indicator(raw, |x| x > t.upper), mask);
            put("ratio_fraction_high", high);
            put(
                "ratio_fraction_low",
                masked_mean(&indicator(raw, |x| x < lower), mask),
            );
            put("max", max(masked(weights, mask)));
            put("min", min(masked(weights, mask)));
        }
    }
    put("std", clamped_std(weights, mask, 0.0, t.upper));
    let clamped = weights.map(|x| x.clamp(0.0, t.upper));
    let mu = masked_mean(&clamped, mask);
    let second = masked_mean(&clamped.map(|x| (x / (mu + 1e-8)).powi(2)), mask);
    // Every weight zeroed (an IcePop band no token falls in): no effective sample (verl divides
    // by zero there and stops).
    put(
        "eff_sample_size",
        if second > 0.0 { 1.0 / second } else { 0.0 },
    );
    let seq_mean = masked_mean_rows(weights, mask);
    let rows = || seq_mean.iter().copied();
    put("seq_mean", mean(&seq_mean));
    let seq_std = if seq_mean.len() > 1 {
        std_unbiased(&seq_mean)
    } else {
        0.0
    };
    put("seq_std", seq_std);
    put("seq_max", max(rows()));
    put("seq_min", min(rows()));
    put("seq_max_deviation", max(rows().map(|x| (x - 1.0).abs())));
    let raw_seq = masked_mean_rows(raw, mask);
    put(
        "seq_fraction_high",
        frac32(raw_seq.iter().map(|&x| x > t.upper)),
    );
    put(
        "seq_fraction_low",
        frac32(raw_seq.iter().map(|&x| x < lower)),
    );
    if let Some(lo) = t.lower {
        let oob = indicator(raw, |x| x < lo || x > t.upper);
        put("oob_ratio", masked_mean(&oob, mask));
    }
}

/// `rollout_is_batch_normalize`: the weights divided by their mean over tokens (token level) or
/// over the sequences with a token (sequence level), unless that mean is <= 1e-8.
fn normalize(weights: Grid, mask: &Grid, level: IsLevel, m: &mut BTreeMap<String, f64>) -> Grid {
    let factor = match level {
        IsLevel::Token => masked_mean(&weights, mask),
        IsLevel::Sequence => {
            let seq_mean = masked_mean_rows(&weights, mask);
            let valid: Vec<f64> = count_rows(mask)
                .iter()
                .map(|&c| f64::from(u8::from(c > 0.0)))
                .collect();
            let s: f64 = seq_mean.iter().zip(&valid).map(|(w, v)| w * v).sum();
            s / valid.iter().sum::<f64>().max(1e-8)
        }
    };
    let ok = factor > 1e-8;
    m.insert(
        "rollout_is_batch_norm_factor".into(),
        if ok { factor } else { 1.0 },
    );
    match ok {
        true => weights.map(|x| x / factor),
        false => weights,
    }
}

/// verl's clamped masked deviation: `v` clamped to `[lo, hi]` (`hi` wins where `lo > hi`, as in
/// torch.clamp), `sqrt(max(E[x²] − E[x]², 0))` over the mask; 0 with fewer than two tokens.
fn clamped_std(v: &Grid, mask: &Grid, lo: f64, hi: f64) -> f64 {
    if mask.data.iter().sum::<f64>() <= 1.0 {
        return 0.0;
    }
    let c = v.map(|x| x.max(lo).min(hi));
    let mu = masked_mean(&c, mask);
    (masked_mean(&c.map(|x| x * x), mask) - mu * mu)
        .max(0.0)
        .sqrt()
}

/// The rejection mask and its metrics (`compute_rollout_rejection_mask`, `compute_rs_metrics`).
fn rejection(
    log_ratio: &Grid,
    mask: &Grid,
    options: &[RsOption],
    m: &mut BTreeMap<String, f64>,
) -> Grid {
    let (b, w) = (mask.rows, mask.cols);
    let safe = log_ratio.map(clamp_log);
    let ks = [
        safe.map(|x| -x),
        safe.map(|x| 0.5 * x * x),
        safe.map(|x| x.exp() - 1.0 - x),
    ];
    let counts = count_rows(mask);
    let seq_valid: Vec<bool> = counts.iter().map(|&c| c > 0.0).collect();
    let mut combined = Grid::new(b, w, vec![1.0; b * w]);
    for o in options {
        let k = &ks[o.k as usize];
        let (lo_log, up_log) = match o.lower {
            Some(lo) => (lo.ln(), o.upper.ln()),
            None => (0.0, o.upper),
        };
        let pass = |x: f64| match o.k {
            Divergence::K1 => x >= lo_log && x <= up_log,
            _ => x <= o.upper,
        };
        let per_seq: Option<Vec<f64>> = match o.scope {
            RsScope::Token => None,
            RsScope::SeqSum => Some(masked_sum_rows(k, mask)),
            RsScope::SeqMean => Some(masked_mean_rows(k, mask)),
            RsScope::SeqMax => Some(
                (0..b)
                    .map(|r| {
                        let x = max(k
                            .row(r)
                            .iter()
                            .zip(mask.row(r))
                            .filter(|(_, &q)| q != 0.0)
                            .map(|(&x, _)| x));
                        if x == f64::NEG_INFINITY {
                            0.0
                        } else {
                            x
                        }
                    })
                    .collect(),
            ),
        };
        let stat = match &per_seq {
            None => k.clone(),
            Some(s) => Grid::new(b, w, (0..b * w).map(|i| s[i / w]).collect()),
        };
        let keep = indicator(&stat, pass);
        combined = combined.zip(&keep, |a, k| a * k);
        let seq_keep: Vec<bool> = (0..b)
            .map(|r| {
                keep.row(r)
                    .iter()
                    .zip(mask.row(r))
                    .all(|(&k, &q)| k != 0.0 || q == 0.0)
            })
            .collect();
        let prefix = format!("rollout_rs_{}", o.name());
        let apply_lower = o.k == Divergence::K1;
        let lower_m = if apply_lower { lo_log } else { 0.0 };
        rs_metrics(
            m,
            &prefix,
            &stat,
            mask,
            &seq_valid,
            per_seq.as_deref(),
            up_log,
            lower_m,
            apply_lower,
        );
        m.insert(
            format!("{prefix}_masked_fraction"),
            masked_mean(&keep.map(|k| 1.0 - k), mask),
        );
        let valid = seq_valid.iter().filter(|&&v| v).count() as f64;
        let seq_masked = if valid > 0.0 {
            seq_keep
                .iter()
                .zip(&seq_valid)
                .filter(|(&k, &v)| v && !k)
                .count() as f64
                / valid
        } else {
            0.0
        };
        m.insert(format!("{prefix}_seq_masked_fraction"), seq_masked);
    }
    m.insert(
        "rollout_rs_masked_fraction".into(),
        masked_mean(&combined.map(|k| 1.0 - k), mask),
    );
    let has_masked: Vec<bool> = (0..b)
        .map(|r| {
            combined
                .row(r)
                .iter()
                .zip(mask.row(r))
                .any(|(&k, &q)| q != 0.0 && k <= 0.5)
        })
        .collect();
    m.insert(
        "rollout_rs_seq_masked_fraction".into(),
        frac32(has_masked.iter().copied()),
    );
    mask.zip(&combined, |q, k| q * k)
}

#[allow(clippy::too_many_arguments)]
fn rs_metrics(
    m: &mut BTreeMap<String, f64>,
    prefix: &str,
    stat: &Grid,
    mask: &Grid,
    seq_valid: &[bool],
    per_seq: Option<&[f64]>,
    upper: f64,
    lower: f64,
    apply_lower: bool,
) {
    let seq_values: Vec<f64> = match per_seq {
        Some(s) => s.to_vec(),
        None => masked_mean_rows(stat, mask),
    };
    let valid: Vec<f64> = seq_values
        .iter()
        .zip(seq_valid)
        .filter(|(_, &v)| v)
        .map(|(&x, _)| x)
        .collect();
    let seq_level = per_seq.is_some();
    let mut put = |k: &str, v: f64| {
        m.insert(format!("{prefix}_{k}"), v);
    };
    put("mean", masked_mean(stat, mask));
    if seq_level && !valid.is_empty() {
        put("max", max(valid.iter().copied()));
        put("min", min(valid.iter().copied()));
        put("fraction_high", frac32(valid.iter().map(|&x| x > upper)));
        let low = if apply_lower {
            frac32(valid.iter().map(|&x| x < lower))
        } else {
            0.0
        };
        put("fraction_low", low);
    } else {
        put("max", max(masked(stat, mask)));
        put("min", min(masked(stat, mask)));
        put(
            "fraction_high",
            masked_mean(&indicator(stat, |x| x > upper), mask),
        );
        let low = if apply_lower {
            masked_mean(&indicator(stat, |x| x < lower), mask)
        } else {
            0.0
        };
        put("fraction_low", low);
    }
    let lo = if apply_lower { lower } else { 0.0 };
    put("std", clamped_std(stat, mask, lo, upper));
    if valid.is_empty() {
        for k in [
            "seq_mean",
            "seq_std",
            "seq_max",
            "seq_min",
            "seq_max_deviation",
            "seq_fraction_high",
            "seq_fraction_low",
        ] {
            put(k, 0.0);
        }
        return;
    }
    put("seq_mean", mean(&valid));
    put(
        "seq_std",
        if valid.len() > 1 {
            std_unbiased(&valid)
        } else {
            0.0
        },
    );
    put("seq_max", max(valid.iter().copied()));
    put("seq_min", min(valid.iter().copied()));
    put("seq_max_deviation", max(valid.iter().map(|x| x.abs())));
    put(
        "seq_fraction_high",
        frac32(valid.iter().map(|&x| x > upper)),
    );
    if apply_lower {
        put("seq_fraction_low", frac32(valid.iter().map(|&x| x < lower)));
    }
}

/// The off-policy diagnostics (`compute_offpolicy_metrics`), logged with or without any
/// correction.
pub fn offpolicy_metrics(old: &Grid, rollout: &Grid, mask: &Grid, m: &mut BTreeMap<String, f64>) {
    let lp_train = masked_mean_rows(old, mask);
    let lp_roll = masked_mean_rows(rollout, mask);
    let mut put = |k: &str, v: f64| {
        m.insert(k.to_string(), v);
    };
    put(
        "training_ppl",
        mean(&lp_train.iter().map(|x| (-x).exp()).collect::<Vec<_>>()),
    );
    put(
        "training_log_ppl",
        mean(&lp_train.iter().map(|x| -x).collect::<Vec<_>>()),
    );
    put("kl", masked_mean(&rollout.zip(old, |r, o| r - o), mask));
    let log_ratio = old.zip(rollout, |o, r| o - r);
    put(
        "k3_kl",
        masked_mean(&log_ratio.map(|x| x.exp() - x - 1.0), mask),
    );
    put(
        "rollout_ppl",
        mean(&lp_roll.iter().map(|x| (-x).exp()).collect::<Vec<_>>()),
    );
    put(
        "rollout_log_ppl",
        mean(&lp_roll.iter().map(|x| -x).collect::<Vec<_>>()),
    );
    let diff: Vec<f64> = lp_roll.iter().zip(&lp_train).map(|(r, t)| r - t).collect();
    put("log_ppl_diff", mean(&diff));
    put(
        "log_ppl_abs_diff",
        mean(&diff.iter().map(|x| x.abs()).collect::<Vec<_>>()),
    );
    put("log_ppl_diff_max", max(diff.iter().copied()));
    put("log_ppl_diff_min", min(diff.iter().copied()));
    put(
        "ppl_ratio",
        mean(&diff.iter().map(|x| x.exp()).collect::<Vec<_>>()),
    );
    put(
        "chi2_token",
        masked_mean(&log_ratio.map(|x| clamp_log(x).exp().powi(2)), mask) - 1.0,
    );
    let sums = masked_sum_rows(&log_ratio, mask);
    put(
        "chi2_seq",
        mean(
            &sums
                .iter()
                .map(|&s| (2.0 * clamp_log(s)).exp())
                .collect::<Vec<_>>(),
        ) - 1.0,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rollout_corr::build;
    use crate::config::Threshold;
    use serde_json::Value;

    fn grid(v: &Value) -> Grid {
        let rows: Vec<Vec<f64>> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect()
            })
            .collect();
        let cols = rows[0].len();
        Grid::new(rows.len(), cols, rows.concat())
    }

    fn spec(v: &Value) -> Option<Threshold> {
        match v {
            Value::Null => None,
            Value::Number(x) => Some(Threshold::Number(x.as_f64().unwrap())),
            Value::String(s) => Some(Threshold::Text(s.clone())),
            other => panic!("threshold {other}"),
        }
    }

    fn correction(c: &Value) -> Result<Correction, (&'static str, String)> {
        build(
            c["rollout_is"].as_str(),
            spec(&c["rollout_is_threshold"]).as_ref(),
            c["rollout_is_batch_normalize"].as_bool().unwrap(),
            c["rollout_rs"].as_str(),
            spec(&c["rollout_rs_threshold"]).as_ref(),
        )
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0) || a == b
    }

    fn fixture() -> Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/rollout_corr_verl_1dda039.json"
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// Every case of verl 1dda039's own `compute_rollout_correction_and_rejection_mask` (run in
    /// PyTorch f64 by scripts/verl_rollout_corr_fixtures.py): weights, mask and every metric,
    /// within 1e-9 (fractions verl takes in f32 come out of the same f32 arithmetic here).
    #[test]
    fn weights_masks_and_metrics_equal_verls() {
        let f = fixture();
        let cases = f["cases"].as_array().unwrap();
        assert!(cases.len() >= 39);
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let c = correction(&case["config"]).unwrap_or_else(|e| panic!("{name}: {e:?}"));
            let (old, roll, mask) = (
                grid(&case["old_log_prob"]),
                grid(&case["rollout_log_prob"]),
                grid(&case["response_mask"]),
            );
            let out = correct(&old, &roll, &mask, &c).unwrap();
            match (&out.weights, &case["weights"]) {
                (None, Value::Null) => {}
                (Some(w), expected) => {
                    let e = grid(expected);
                    for (i, (a, b)) in w.data.iter().zip(&e.data).enumerate() {
                        assert!(close(*a, *b), "{name}: weight {i}: {a} vs {b}");
                    }
                }
                (None, _) => panic!("{name}: verl has weights"),
            }
            assert_eq!(out.mask, grid(&case["response_mask_out"]), "{name}: mask");
            let expected = case["metrics"].as_object().unwrap();
            let mine: Vec<&String> = out.metrics.keys().collect();
            let mut theirs: Vec<&String> = expected.keys().collect();
            theirs.sort();
            assert_eq!(mine, theirs, "{name}: metric names");
            for (k, v) in expected {
                let (a, b) = (out.metrics[k], v.as_f64().unwrap());
                assert!(close(a, b), "{name}: {k}: {a} vs verl {b}");
            }
        }
    }

    /// verl's refusals are refusals here, naming the key; the two configurations verl fails on
    /// with a ZeroDivisionError are a named error (k1 threshold 0) and a run that goes on with
    /// an effective sample size of 0 (every weight zeroed).
    #[test]
    fn bad_configurations_are_refused_with_the_key() {
        let f = fixture();
        for e in f["errors"].as_array().unwrap() {
            let c = &e["config"];
            if c["rollout_is_threshold"].is_boolean() {
                continue; // a bool is refused by the config's type (a number or a string)
            }
            let what = e["message"].as_str().unwrap();
            let built = correction(c);
            if e["type"] == "ZeroDivisionError" && c["rollout_rs"].is_null() {
                // Every sequence's ratio is e^0.6 or e^-0.6, outside the band.
                let roll = Grid::new(2, 3, vec![-1.0; 6]);
                let old = Grid::new(2, 3, vec![-0.8, -0.8, -0.8, -1.2, -1.2, -1.2]);
                let mask = Grid::new(2, 3, vec![1.0; 6]);
                let out = correct(&old, &roll, &mask, &built.unwrap()).unwrap();
                let w = out.weights.unwrap();
                assert!(w.data.iter().all(|&x| x == 0.0), "{what}");
                assert_eq!(out.metrics["rollout_corr/rollout_is_eff_sample_size"], 0.0);
                continue;
            }
            let (key, msg) = built.expect_err(what);
            let want = if what.starts_with("Invalid rollout_is:") {
                "rollout_is"
            } else if what.starts_with("Invalid rollout_rs option") {
                "rollout_rs"
            } else if what.contains("rollout_is_threshold") {
                "rollout_is_threshold"
            } else {
                "rollout_rs_threshold"
            };
            assert_eq!(key, want, "{what} -> {msg}");
        }
        let e = correct(
            &Grid::new(1, 2, vec![-1.0; 2]),
            &Grid::new(1, 2, vec![-1.0; 2]),
            &Grid::new(1, 2, vec![0.0; 2]),
            &Correction::default(),
        );
        assert!(e.unwrap_err().contains("no token"));
    }

    /// Equal log-probs (f32 products on both sides): weights 1, nothing rejected, KL 0.
    #[test]
    fn identical_policies_give_unit_weights() {
        let lp = Grid::new(2, 3, vec![-0.5, -1.0, -2.0, -0.1, -0.2, -0.3]);
        let mask = Grid::new(2, 3, vec![1.0, 1.0, 1.0, 1.0, 1.0, 0.0]);
        for level in ["token", "sequence"] {
            let c = build(
                Some(level),
                Some(&Threshold::Number(2.0)),
                true,
                Some("token_k1,seq_max_k3"),
                Some(&Threshold::Text("0.9_1.1,0.01".into())),
            )
            .unwrap();
            let out = correct(&lp, &lp, &mask, &c).unwrap();
            let w = out.weights.unwrap();
            for (x, m) in w.data.iter().zip(&mask.data) {
                assert!((x - m).abs() < 1e-7, "{level}: {x}");
            }
            assert_eq!(out.mask, mask);
            assert_eq!(out.metrics["rollout_corr/kl"], 0.0);
            assert_eq!(out.metrics["rollout_corr/rollout_rs_masked_fraction"], 0.0);
        }
    }
}
