//! `algorithm.rollout_correction` checked: verl 1dda039's rules for `rollout_is`,
//! `rollout_is_threshold`, `rollout_rs` and `rollout_rs_threshold` (from its
//! `rollout_corr_helper`), giving the [`Correction`] that `algo::rollout_corr` applies.

use super::algorithm::Threshold;

/// IS weights per token or per sequence (`rollout_is`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsLevel {
    Token,
    Sequence,
}

/// `rollout_is_threshold`: an upper bound (TIS), or IcePop's `[lower, upper]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IsThreshold {
    pub upper: f64,
    pub lower: Option<f64>,
}

impl std::fmt::Display for Threshold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Threshold::Number(x) => write!(f, "{x}"),
            Threshold::Text(s) => write!(f, "{s:?}"),
        }
    }
}

fn number(s: &str) -> Option<f64> {
    s.trim().parse::<f64>().ok()
}

/// `rollout_is_threshold` under verl's rules: a positive number, or `"lower_upper"` with
/// `0 < lower <= upper`.
pub fn parse_is_threshold(spec: &Threshold) -> Result<IsThreshold, String> {
    let (upper, lower) = match spec {
        Threshold::Number(x) => (*x, None),
        Threshold::Text(s) => {
            let s = s.trim();
            if s.is_empty() {
                return Err("must not be an empty string".into());
            }
            match s.split_once('_') {
                Some((lo, up)) => match (number(lo), number(up)) {
                    (Some(lo), Some(up)) => (up, Some(lo)),
                    _ => return Err(format!("{spec} is not a number or \"lower_upper\"")),
                },
                None => (
                    number(s)
                        .ok_or_else(|| format!("{spec} is not a number or \"lower_upper\""))?,
                    None,
                ),
            }
        }
    };
    if upper.is_nan() || upper <= 0.0 {
        return Err(format!("the upper bound must be positive, got {upper}"));
    }
    if let Some(lo) = lower {
        if lo.is_nan() || lo <= 0.0 {
            return Err(format!("the lower bound must be positive, got {lo}"));
        }
        if lo > upper {
            return Err(format!(
                "the lower bound {lo} must be <= the upper bound {upper}"
            ));
        }
    }
    Ok(IsThreshold { upper, lower })
}

/// Which statistic a rejection option reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Divergence {
    K1,
    K2,
    K3,
}

/// Where a rejection option applies its statistic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsScope {
    Token,
    SeqSum,
    SeqMean,
    SeqMax,
}

/// One `rollout_rs` option with its bounds (`lower` only for k1, as a ratio).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RsOption {
    pub scope: RsScope,
    pub k: Divergence,
    pub upper: f64,
    pub lower: Option<f64>,
}

/// verl's option names.
pub const RS_OPTIONS: [&str; 11] = [
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
];

impl RsOption {
    pub fn name(&self) -> String {
        let scope = match self.scope {
            RsScope::Token => "token",
            RsScope::SeqSum => "seq_sum",
            RsScope::SeqMean => "seq_mean",
            RsScope::SeqMax => "seq_max",
        };
        let k = match self.k {
            Divergence::K1 => "k1",
            Divergence::K2 => "k2",
            Divergence::K3 => "k3",
        };
        format!("{scope}_{k}")
    }
}

/// `rollout_rs` (comma-separated, duplicates dropped) with `rollout_rs_threshold` (one entry
/// per option, or one for all), under verl's rules.
/// An error names the key it is about (`rollout_rs` or `rollout_rs_threshold`).
pub fn parse_rs(
    options: &str,
    threshold: Option<&Threshold>,
) -> Result<Vec<RsOption>, (&'static str, String)> {
    const OPTS: &str = "rollout_rs";
    const THR: &str = "rollout_rs_threshold";
    let mut names: Vec<&str> = Vec::new();
    for o in options.split(',').map(str::trim).filter(|o| !o.is_empty()) {
        if !RS_OPTIONS.contains(&o) {
            let known = RS_OPTIONS.join(", ");
            return Err((OPTS, format!("unknown option `{o}`: one of {known}")));
        }
        if !names.contains(&o) {
            names.push(o);
        }
    }
    if names.is_empty() {
        return Err((OPTS, "must name at least one option".into()));
    }
    let threshold = threshold.ok_or((THR, "must be set when rollout_rs is".to_string()))?;
    let mut specs: Vec<String> = match threshold {
        Threshold::Number(x) => vec![x.to_string()],
        Threshold::Text(s) => s
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect(),
    };
    if specs.is_empty() {
        return Err((THR, "holds no value".into()));
    }
    if specs.len() != 1 && specs.len() != names.len() {
        return Err((
            THR,
            format!(
                "holds {} values for {} options: give one for all or one per option",
                specs.len(),
                names.len()
            ),
        ));
    }
    if specs.len() == 1 {
        specs = vec![specs[0].clone(); names.len()];
    }
    names
        .iter()
        .zip(&specs)
        .map(|(name, spec)| option(name, spec).map_err(|e| (THR, e)))
        .collect()
}

fn option(name: &str, spec: &str) -> Result<RsOption, String> {
    let (scope, k) = name.rsplit_once('_').unwrap_or((name, ""));
    let scope = match scope {
        "token" => RsScope::Token,
        "seq_sum" => RsScope::SeqSum,
        "seq_mean" => RsScope::SeqMean,
        _ => RsScope::SeqMax,
    };
    let bad = || format!("`{spec}` is not a valid threshold for `{name}`");
    if k == "k1" {
        let (lo, up) = match spec.split_once('_') {
            Some((lo, up)) => (number(lo).ok_or_else(bad)?, number(up).ok_or_else(bad)?),
            None => {
                let up = number(spec).ok_or_else(bad)?;
                (1.0 / up, up)
            }
        };
        if !(lo > 0.0 && up > 0.0) {
            return Err(format!(
                "the bounds of `{name}` must be positive, got {spec}"
            ));
        }
        if lo > up {
            return Err(format!(
                "the bounds of `{name}` must be lower <= upper, got {spec}"
            ));
        }
        return Ok(RsOption {
            scope,
            k: Divergence::K1,
            upper: up,
            lower: Some(lo),
        });
    }
    if spec.contains('_') {
        return Err(format!(
            "`{name}` takes one upper bound, not `{spec}` (\"lower_upper\" is for the k1 options)"
        ));
    }
    let up = number(spec).ok_or_else(bad)?;
    if up.is_nan() || up <= 0.0 {
        return Err(format!(
            "the bound of `{name}` must be positive, got {spec}"
        ));
    }
    let k = if k == "k2" {
        Divergence::K2
    } else {
        Divergence::K3
    };
    Ok(RsOption {
        scope,
        k,
        upper: up,
        lower: None,
    })
}

/// [`Correction`] from `algorithm.rollout_correction`'s keys; an error names the key
/// (`rollout_is`, `rollout_is_threshold`, `rollout_rs`, `rollout_rs_threshold`) and the rule.
pub fn build(
    rollout_is: Option<&str>,
    is_threshold: Option<&Threshold>,
    is_batch_normalize: bool,
    rollout_rs: Option<&str>,
    rs_threshold: Option<&Threshold>,
) -> Result<Correction, (&'static str, String)> {
    let is = match rollout_is {
        None => None,
        Some(level) => {
            let level = match level {
                "token" => IsLevel::Token,
                "sequence" => IsLevel::Sequence,
                other => {
                    return Err((
                        "rollout_is",
                        format!("`{other}` is not null, token or sequence"),
                    ))
                }
            };
            // verl skips the weights when the threshold is null; here that is an error, as
            // the weights were asked for.
            let spec = is_threshold.ok_or((
                "rollout_is_threshold",
                "must be set when rollout_is is (a number, or \"lower_upper\")".to_string(),
            ))?;
            let t = parse_is_threshold(spec).map_err(|e| ("rollout_is_threshold", e))?;
            Some((level, t))
        }
    };
    let rs = match rollout_rs {
        None => Vec::new(),
        Some(opts) => parse_rs(opts, rs_threshold)?,
    };
    Ok(Correction {
        is,
        is_batch_normalize,
        rs,
    })
}

/// The corrections of a run (`algorithm.rollout_correction`, checked).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Correction {
    pub is: Option<(IsLevel, IsThreshold)>,
    pub is_batch_normalize: bool,
    pub rs: Vec<RsOption>,
}
