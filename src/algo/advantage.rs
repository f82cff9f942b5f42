//! Advantage estimators (`algorithm.adv_estimator`), ports of verl's
//! `verl/trainer/ppo/core_algos.py` `compute_*_advantage*` functions (verl-project/verl
//! 1dda039). Each returns `(advantages, returns)`, both `[batch, response_len]`.
//!
//! No gradient flows through an estimator, so each runs as a single pass over host memory
//! (GAE is a backward scan per row; a per-timestep chain of tensor ops would launch `T` kernels).
//! [`advantages`] works on host matrices ([`Mat`]), which is what the trainer holds;
//! [`compute_advantage`] is the same with verl's tensor signature (the parity tests call it).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::masked::host;
use super::{bail, Result};
use crate::config::{AdvEstimator, AlgorithmConfig};

/// What the estimators read, as tensors. Shapes: `[batch, response_len]`, `index` and
/// `reward_baselines` `[batch]`.
#[derive(Debug, Clone, Copy)]
pub struct AdvantageInputs<'a> {
    /// Rewards placed on tokens (scores, minus the KL penalty when it is in the reward).
    pub token_level_rewards: &'a Tensor,
    /// 1 on response tokens, 0 on padding.
    pub response_mask: &'a Tensor,
    /// Critic values (gae).
    pub values: Option<&'a Tensor>,
    /// Group id of each response: responses to the same prompt share one (verl's `uid`).
    pub index: Option<&'a [u64]>,
    /// Summed reward of the greedy response to the same prompt (remax).
    pub reward_baselines: Option<&'a Tensor>,
}

/// [`AdvantageInputs`] on the host.
#[derive(Debug, Clone, Copy)]
pub struct HostInputs<'a> {
    pub token_level_rewards: &'a Mat,
    pub response_mask: &'a Mat,
    pub values: Option<&'a Mat>,
    pub index: Option<&'a [u64]>,
    pub reward_baselines: Option<&'a [f64]>,
    /// gdpo: each reward component's score per response, `[keys][rows]`, in the order of
    /// `algorithm.gdpo_reward_keys`.
    pub reward_components: Option<&'a [Vec<f64>]>,
    /// The optimal token baselines: log-probs of the sampled tokens under the old policy.
    pub old_log_probs: Option<&'a Mat>,
    /// The optimal token baselines: Σπ² of the old policy at each position.
    pub sum_pi_squared: Option<&'a Mat>,
    /// Rollout correction's IS weights ρ̄ (the optimal token baselines scale the path variance
    /// by ρ̄²); `None` without them.
    pub rollout_is_weights: Option<&'a Mat>,
}

/// A row-major host matrix `[b, t]` of f64.
#[derive(Debug, Clone, PartialEq)]
pub struct Mat {
    pub b: usize,
    pub t: usize,
    pub v: Vec<f64>,
}

impl Mat {
    /// A host copy of a `[batch, len]` tensor; the error names it `name`.
    pub fn from_tensor(t: &Tensor, name: &str) -> Result<Self> {
        let (b, len) = t.dims2().map_err(|_| {
            candle_core::Error::Msg(format!(
                "{name} must be [batch, response_len], got {:?}",
                t.dims()
            ))
        })?;
        // One pass from the tensor's own dtype (no intermediate f64 tensor).
        let flat = t.flatten_all()?.to_device(&Device::Cpu)?;
        let v = match t.dtype() {
            DType::F32 => flat.to_vec1::<f32>()?.into_iter().map(f64::from).collect(),
            DType::F64 => flat.to_vec1::<f64>()?,
            _ => flat.to_dtype(DType::F64)?.to_vec1::<f64>()?,
        };
        Ok(Mat { b, t: len, v })
    }

    /// Rows of f32 values, each zero-padded (or cut) to `width`: `[rows.len(), width]`.
    pub fn from_rows<'r>(rows: impl ExactSizeIterator<Item = &'r [f32]>, width: usize) -> Self {
        let mut m = Mat::zeros(rows.len(), width);
        for (i, r) in rows.enumerate() {
            let n = r.len().min(width);
            for (d, &x) in m.v[i * width..i * width + n].iter_mut().zip(&r[..n]) {
                *d = f64::from(x);
            }
        }
        m
    }

    pub fn row(&self, i: usize) -> &[f64] {
        &self.v[i * self.t..(i + 1) * self.t]
    }

    pub fn zeros(b: usize, t: usize) -> Self {
        Mat {
            b,
            t,
            v: vec![0.0; b * t],
        }
    }

    fn with(&self, v: Vec<f64>) -> Self {
        Mat {
            b: self.b,
            t: self.t,
            v,
        }
    }

    /// As a tensor of `dtype` on `device`.
    pub fn into_tensor(self, dtype: DType, device: &Device) -> Result<Tensor> {
        let shape = (self.b, self.t);
        let t = match dtype {
            DType::F32 => Tensor::from_vec(
                self.v.into_iter().map(|x| x as f32).collect::<Vec<f32>>(),
                shape,
                &Device::Cpu,
            )?,
            DType::F64 => Tensor::from_vec(self.v, shape, &Device::Cpu)?,
            other => Tensor::from_vec(self.v, shape, &Device::Cpu)?.to_dtype(other)?,
        };
        t.to_device(device)
    }
}

/// [`advantages`] with verl's tensor signature: the results in the rewards' dtype and device.
pub fn compute_advantage(
    est: AdvEstimator,
    inp: &AdvantageInputs,
    cfg: &AlgorithmConfig,
) -> Result<(Tensor, Tensor)> {
    let r = Mat::from_tensor(inp.token_level_rewards, "token_level_rewards")?;
    let m = Mat::from_tensor(inp.response_mask, "response_mask")?;
    let values = inp
        .values
        .map(|v| Mat::from_tensor(v, "values"))
        .transpose()?;
    let baselines = inp
        .reward_baselines
        .map(|b| b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>())
        .transpose()?;
    let host = HostInputs {
        token_level_rewards: &r,
        response_mask: &m,
        values: values.as_ref(),
        index: inp.index,
        reward_baselines: baselines.as_deref(),
        reward_components: None,
        old_log_probs: None,
        sum_pi_squared: None,
        rollout_is_weights: None,
    };
    let (adv, ret) = advantages(est, &host, cfg)?;
    let dtype = inp.token_level_rewards.dtype();
    let device = inp.token_level_rewards.device();
    Ok((
        adv.into_tensor(dtype, device)?,
        ret.into_tensor(dtype, device)?,
    ))
}

/// Computes `(advantages, returns)` with the estimator `est`. Outcome estimators return the
/// advantages as the returns (verl's `return scores, scores`).
pub fn advantages(
    est: AdvEstimator,
    inp: &HostInputs,
    cfg: &AlgorithmConfig,
) -> Result<(Mat, Mat)> {
    let (r, m) = (inp.token_level_rewards, inp.response_mask);
    if (r.b, r.t) != (m.b, m.t) {
        return bail(format!(
            "token_level_rewards {:?} and response_mask {:?} differ in shape",
            (r.b, r.t),
            (m.b, m.t)
        ));
    }
    let index = || -> Result<&[u64]> {
        match inp.index {
            Some(ix) if ix.len() == r.b => Ok(ix),
            Some(ix) => bail(format!(
                "index has {} entries for {} responses",
                ix.len(),
                r.b
            )),
            None => bail(format!(
                "adv_estimator={} needs the group index (uid) of each response",
                est.as_str()
            )),
        }
    };
    let scores: Vec<f64> = (0..r.b).map(|i| r.row(i).iter().sum()).collect();
    let outcome = |a: Vec<f64>| (broadcast(&a, m).v, None);
    let (adv, ret) = match est {
        AdvEstimator::Gae => {
            let v = inp.values.ok_or_else(|| {
                candle_core::Error::Msg("adv_estimator=gae needs critic values".into())
            })?;
            if (v.b, v.t) != (r.b, r.t) {
                return bail("values and token_level_rewards differ in shape");
            }
            let (adv, ret) = gae(r, v, m, cfg.gamma, cfg.lam)?;
            (adv, Some(ret))
        }
        AdvEstimator::Grpo => outcome(grpo_scalars(
            &scores,
            index()?,
            cfg.norm_adv_by_std_in_grpo,
            1e-6,
        )),
        AdvEstimator::Gdpo => {
            let comps = inp.reward_components.ok_or_else(|| {
                candle_core::Error::Msg(
                    "adv_estimator=gdpo needs each response's reward components (algorithm.gdpo_reward_keys)".into(),
                )
            })?;
            (
                gdpo(comps, cfg.gdpo_reward_weights.as_deref(), index()?, m, cfg)?,
                None,
            )
        }
        AdvEstimator::Rloo | AdvEstimator::RlooVectorized => {
            let single_gets_score = est == AdvEstimator::Rloo;
            outcome(rloo_scalars(&scores, index()?, single_gets_score))
        }
        AdvEstimator::ReinforcePlusPlus => {
            let (adv, ret) = reinforce_pp(r, m, cfg.gamma)?;
            (adv, Some(ret))
        }
        AdvEstimator::ReinforcePlusPlusBaseline => {
            (reinforce_pp_baseline(&scores, index()?, m)?, None)
        }
        AdvEstimator::Remax => {
            let base = inp.reward_baselines.ok_or_else(|| {
                candle_core::Error::Msg(
                    "adv_estimator=remax needs the greedy baseline rewards".into(),
                )
            })?;
            let (adv, ret) = remax(r, m, base)?;
            (adv, Some(ret))
        }
        AdvEstimator::Opo => outcome(opo_scalars(&scores, index()?, m)),
        AdvEstimator::GrpoPassk => outcome(grpo_passk_scalars(
            &scores,
            index()?,
            cfg.norm_adv_by_std_in_grpo,
        )?),
        AdvEstimator::Gpg => {
            let nonzero = scores.iter().filter(|s| **s != 0.0).count().max(1);
            let alpha = r.b as f64 / nonzero as f64;
            outcome(centered(&scores, index()?, alpha))
        }
        AdvEstimator::OptimalTokenBaseline | AdvEstimator::TirOptimalTokenBaseline => {
            let o = otb_inputs(est, inp)?;
            let tir = est == AdvEstimator::TirOptimalTokenBaseline;
            let (adv, ret) = optimal_token_baseline(r, m, &o, index()?, tir);
            (adv, Some(ret))
        }
    };
    let adv = r.with(adv);
    let ret = match ret {
        Some(ret) => r.with(ret),
        None => adv.clone(),
    };
    Ok((adv, ret))
}

/// The optimal token baselines' ε in `Σ G·W / (Σ W + ε)` (verl's default; its trainer passes
/// no other).
const OTB_EPS: f64 = 1e-8;

/// What the optimal token baselines read besides the rewards and the mask.
struct OtbInputs<'a> {
    old_log_probs: &'a Mat,
    sum_pi_squared: &'a Mat,
    is_weights: Option<&'a Mat>,
}

fn otb_inputs<'a>(est: AdvEstimator, inp: &HostInputs<'a>) -> Result<OtbInputs<'a>> {
    let r = inp.token_level_rewards;
    let need = |m: Option<&'a Mat>, what: &str| -> Result<&'a Mat> {
        let m = m.ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "adv_estimator={} needs {what} of the old policy (set actor_rollout_ref.actor.calculate_sum_pi_squared=True)",
                est.as_str()
            ))
        })?;
        if (m.b, m.t) != (r.b, r.t) {
            return bail(format!(
                "{what} {:?} and token_level_rewards {:?} differ in shape",
                (m.b, m.t),
                (r.b, r.t)
            ));
        }
        Ok(m)
    };
    let is_weights = match inp.rollout_is_weights {
        Some(w) => Some(need(Some(w), "rollout_is_weights")?),
        None => None,
    };
    Ok(OtbInputs {
        old_log_probs: need(inp.old_log_probs, "old_log_probs")?,
        sum_pi_squared: need(inp.sum_pi_squared, "sum_pi_squared")?,
        is_weights,
    })
}

/// Reward-to-go `G_t = Σ_{s≥t} r_s·m_s` and the cumulative path variance
/// `W_t = Σ_{s≤t} w_s·m_s`, `w_s = (1 − 2π_s + Σπ²_s)·ρ̄_s²` (`π_s = exp(old log-prob)`, `ρ̄_s`
/// the rollout IS weight, 1 without): `[b, t]` each. `w_s = Σ_j (δ_j,y_s − π_j)²`, the squared
/// norm of the log-prob's gradient with respect to the logits.
fn returns_and_path_variance(r: &Mat, m: &Mat, o: &OtbInputs) -> (Vec<f64>, Vec<f64>) {
    let (mut g, mut w) = (vec![0.0; r.b * r.t], vec![0.0; r.b * r.t]);
    for i in 0..r.b {
        let row = i * r.t..(i + 1) * r.t;
        let (rr, mm) = (&r.v[row.clone()], &m.v[row.clone()]);
        let mut acc = 0.0;
        for t in (0..r.t).rev() {
            acc += rr[t] * mm[t];
            g[i * r.t + t] = acc;
        }
        let (old, sq) = (o.old_log_probs.row(i), o.sum_pi_squared.row(i));
        let mut cum = 0.0;
        for t in 0..r.t {
            let mut ws = 1.0 - 2.0 * old[t].exp() + sq[t];
            if let Some(rho) = o.is_weights {
                ws *= rho.row(i)[t].powi(2);
            }
            cum += ws * mm[t];
            w[i * r.t + t] = cum;
        }
    }
    (g, w)
}

/// `optimal_token_baseline` (verl's `compute_optimal_token_baseline_advantage`) and, with `tir`,
/// `tir_optimal_token_baseline` (`compute_multi_turn_optimal_token_baseline_advantage`):
/// advantages `(G_t − B_t)·m_t` and the returns `G_t`. In each group of two or more rows the
/// baseline of step `k` is `B_k = Σ G_k·W_k / (Σ W_k + ε)` over the group's rows (a group of one
/// keeps its return). Step `k` is position `k` (rows with no token count in their group), or
/// with `tir` each row's `k`-th token in the mask (rows with no token are in no group).
fn optimal_token_baseline(
    r: &Mat,
    m: &Mat,
    o: &OtbInputs,
    index: &[u64],
    tir: bool,
) -> (Vec<f64>, Vec<f64>) {
    let (g, w) = returns_and_path_variance(r, m, o);
    // Each row's steps: its positions, or (tir) its positions in the mask.
    let steps: Vec<Vec<usize>> = (0..m.b)
        .map(|i| match tir {
            false => (0..m.t).collect(),
            true => (0..m.t).filter(|&t| m.row(i)[t] != 0.0).collect(),
        })
        .collect();
    // verl's lengths: the mask's sum, truncated to an integer.
    let lens: Vec<usize> = (0..m.b)
        .map(|i| m.row(i).iter().sum::<f64>() as usize)
        .collect();
    let width = steps.iter().map(Vec::len).max().unwrap_or(0);
    // G·W·m and W·m at each step of each row, 0 past its steps: [b, width]
    let (mut gw, mut wm) = (vec![0.0; m.b * width], vec![0.0; m.b * width]);
    for (i, st) in steps.iter().enumerate() {
        for (k, &t) in st.iter().enumerate() {
            let (x, mk) = (i * m.t + t, m.v[i * m.t + t]);
            gw[i * width + k] = g[x] * w[x] * mk;
            wm[i * width + k] = w[x] * mk;
        }
    }
    let members: Vec<usize> = (0..m.b).filter(|&i| !tir || lens[i] > 0).collect();
    let base = group_baselines(&gw, &wm, width, &lens, index, &members); // [b, width]
    let mut adv = vec![0.0; m.b * m.t];
    for (i, st) in steps.iter().enumerate() {
        for (k, &t) in st.iter().enumerate() {
            let x = i * m.t + t;
            adv[x] = (g[x] - base[i * width + k]) * m.v[x];
        }
    }
    (adv, g)
}

/// The per-step baselines `[b, width]` of the groups that `members` form: `Σ gw / (Σ wm + ε)`
/// over each group of two or more rows, 0 elsewhere, then verl's zero tail: when one row of a
/// group is strictly the longest (`lens`), its baseline is 0 from the second-longest row's
/// length on (no other response of the group reaches those steps).
fn group_baselines(
    gw: &[f64],
    wm: &[f64],
    width: usize,
    lens: &[usize],
    index: &[u64],
    members: &[usize],
) -> Vec<f64> {
    let mut groups: HashMap<u64, Vec<usize>> = HashMap::new();
    for &i in members {
        groups.entry(index[i]).or_default().push(i);
    }
    let mut base = vec![0.0; lens.len() * width];
    for rows in groups.values().filter(|rows| rows.len() > 1) {
        let (mut num, mut den) = (vec![0.0; width], vec![0.0; width]);
        for &i in rows {
            for k in 0..width {
                num[k] += gw[i * width + k];
                den[k] += wm[i * width + k];
            }
        }
        for &i in rows {
            for k in 0..width {
                base[i * width + k] = num[k] / (den[k] + OTB_EPS);
            }
        }
        let mut sorted: Vec<usize> = rows.iter().map(|&i| lens[i]).collect();
        sorted.sort_unstable();
        let (max, second) = (sorted[sorted.len() - 1], sorted[sorted.len() - 2]);
        let longest: Vec<usize> = rows.iter().copied().filter(|&i| lens[i] == max).collect();
        if let ([one], true) = (longest.as_slice(), max > second) {
            for k in second..width {
                base[one * width + k] = 0.0;
            }
        }
    }
    base
}

/// `scale·(s − mean_g)` per response, the mean over its group (0 for a group of one): GPG's
/// advantage (`scale` = α) and REINFORCE++-baseline's before whitening (`scale` = 1).
fn centered(scores: &[f64], index: &[u64], scale: f64) -> Vec<f64> {
    let mut a = scores.to_vec();
    for rows in group_rows(index).values() {
        let mean = if rows.len() > 1 {
            rows.iter().map(|&i| scores[i]).sum::<f64>() / rows.len() as f64
        } else {
            0.0
        };
        for &i in rows {
            a[i] = scale * (scores[i] - mean);
        }
    }
    a
}

/// REINFORCE++ with a group baseline: scores centred in their group, broadcast over the
/// response, whitened over the batch's tokens, masked.
/// GDPO (arXiv 2601.05242): each reward component normalised within its groups as GRPO does
/// (`norm_adv_by_std_in_grpo`, ε 1e-6), the results summed with `weights` (default 1 each),
/// broadcast over the response tokens, whitened over the batch's valid tokens and masked.
fn gdpo(
    comps: &[Vec<f64>],
    weights: Option<&[f64]>,
    index: &[u64],
    m: &Mat,
    cfg: &AlgorithmConfig,
) -> Result<Vec<f64>> {
    if comps.is_empty() {
        return bail("adv_estimator=gdpo needs at least one reward component");
    }
    if let Some(w) = weights {
        if w.len() != comps.len() {
            return bail(format!(
                "algorithm.gdpo_reward_weights has {} entries for {} reward keys",
                w.len(),
                comps.len()
            ));
        }
    }
    let mut sum = vec![0.0; m.b];
    for (k, c) in comps.iter().enumerate() {
        if c.len() != m.b {
            return bail(format!(
                "reward component {k} has {} scores for {} responses",
                c.len(),
                m.b
            ));
        }
        let w = weights.map_or(1.0, |w| w[k]);
        let a = grpo_scalars(c, index, cfg.norm_adv_by_std_in_grpo, 1e-6);
        for (s, x) in sum.iter_mut().zip(a) {
            *s += w * x;
        }
    }
    let mut adv = broadcast(&sum, m);
    host::whiten(&mut adv.v, &m.v).map_err(candle_core::Error::Msg)?;
    for (x, mk) in adv.v.iter_mut().zip(&m.v) {
        *x *= mk;
    }
    Ok(adv.v)
}

fn reinforce_pp_baseline(scores: &[f64], index: &[u64], m: &Mat) -> Result<Vec<f64>> {
    let mut adv = broadcast(&centered(scores, index, 1.0), m);
    host::whiten(&mut adv.v, &m.v).map_err(candle_core::Error::Msg)?;
    for (x, mk) in adv.v.iter_mut().zip(&m.v) {
        *x *= mk;
    }
    Ok(adv.v)
}

/// ReMax: returns are the reward-to-go `G_t = Σ_{s≥t} r_s·m_s`; advantages `G_t − b·m_t` with
/// `b` the greedy response's reward.
fn remax(r: &Mat, m: &Mat, base: &[f64]) -> Result<(Vec<f64>, Vec<f64>)> {
    if base.len() != r.b {
        return bail(format!(
            "reward_baselines has {} entries for {} responses",
            base.len(),
            r.b
        ));
    }
    let mut ret = Mat::zeros(r.b, r.t);
    let mut adv = Mat::zeros(r.b, r.t);
    for (i, b) in base.iter().enumerate() {
        let (rr, mm) = (r.row(i), m.row(i));
        let mut acc = 0.0;
        for t in (0..r.t).rev() {
            acc += rr[t] * mm[t];
            ret.v[i * r.t + t] = acc;
            adv.v[i * r.t + t] = acc - b * mm[t];
        }
    }
    Ok((adv.v, ret.v))
}

/// OPO: `s − b_g` with the length-weighted group baseline `b_g = Σ len·s / Σ len` (0 for a
/// group of one).
fn opo_scalars(scores: &[f64], index: &[u64], m: &Mat) -> Vec<f64> {
    let lens: Vec<f64> = (0..m.b).map(|i| m.row(i).iter().sum()).collect();
    let mut a = scores.to_vec();
    for rows in group_rows(index).values() {
        let b = if rows.len() > 1 {
            let num: f64 = rows.iter().map(|&i| lens[i] * scores[i]).sum();
            let den: f64 = rows.iter().map(|&i| lens[i]).sum();
            num / den
        } else {
            0.0
        };
        for &i in rows {
            a[i] = scores[i] - b;
        }
    }
    a
}

/// GRPO pass@k: in each group only the best response gets an advantage, its margin over the
/// second best (divided by the group's std + 1e-6 with `norm`); the others 0.
fn grpo_passk_scalars(scores: &[f64], index: &[u64], norm: bool) -> Result<Vec<f64>> {
    let mut a = vec![0.0; scores.len()];
    for (g, rows) in group_rows(index) {
        if rows.len() < 2 {
            return bail(format!(
                "adv_estimator=grpo_passk needs at least 2 responses per prompt; group {g} has {}",
                rows.len()
            ));
        }
        // The first maximum wins ties; a tie for the maximum gives advantage 0 anyway.
        let mut best = rows[0];
        for &i in &rows[1..] {
            if scores[i] > scores[best] {
                best = i;
            }
        }
        let second = rows
            .iter()
            .filter(|&&i| i != best)
            .map(|&i| scores[i])
            .fold(f64::NEG_INFINITY, f64::max);
        let mut adv = scores[best] - second;
        if norm {
            adv /= std_unbiased(rows.iter().map(|&i| scores[i])) + 1e-6;
        }
        a[best] = adv;
    }
    Ok(a)
}

/// GAE backward scan; positions with mask 0 carry `nextvalues` and `lastgaelam` through.
/// Returns are computed before the advantages are whitened.
fn gae(r: &Mat, v: &Mat, m: &Mat, gamma: f64, lam: f64) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut adv = vec![0.0; r.b * r.t];
    let mut ret = vec![0.0; r.b * r.t];
    for i in 0..r.b {
        let (rr, vv, mm) = (r.row(i), v.row(i), m.row(i));
        let mut next_v = 0.0;
        let mut last = 0.0;
        for t in (0..r.t).rev() {
            let delta = rr[t] + gamma * next_v - vv[t];
            let cand = delta + gamma * lam * last;
            next_v = vv[t] * mm[t] + (1.0 - mm[t]) * next_v;
            last = cand * mm[t] + (1.0 - mm[t]) * last;
            adv[i * r.t + t] = last;
            ret[i * r.t + t] = last + vv[t];
        }
    }
    host::whiten(&mut adv, &m.v).map_err(candle_core::Error::Msg)?;
    Ok((adv, ret))
}

/// REINFORCE++ returns: `G_t = R_t + γ G_{t+1}` on response tokens; masked positions get
/// return 0 and pass G through. Advantages are the whitened returns, masked.
fn reinforce_pp(r: &Mat, m: &Mat, gamma: f64) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut ret = vec![0.0; r.b * r.t];
    for i in 0..r.b {
        let (rr, mm) = (r.row(i), m.row(i));
        let mut g = 0.0;
        for t in (0..r.t).rev() {
            if mm[t] != 0.0 {
                g = rr[t] + gamma * g;
                ret[i * r.t + t] = g;
            }
        }
    }
    let mut adv = ret.clone();
    host::whiten(&mut adv, &m.v).map_err(candle_core::Error::Msg)?;
    for (a, mk) in adv.iter_mut().zip(&m.v) {
        *a *= mk;
    }
    Ok((adv, ret))
}

/// Rows of each group, in order of first appearance within the group.
fn group_rows(index: &[u64]) -> HashMap<u64, Vec<usize>> {
    let mut g: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, &id) in index.iter().enumerate() {
        g.entry(id).or_default().push(i);
    }
    g
}

/// torch.std (Bessel-corrected) of at least two values.
fn std_unbiased(xs: impl Iterator<Item = f64> + Clone) -> f64 {
    let n = xs.clone().count() as f64;
    let mean = xs.clone().sum::<f64>() / n;
    (xs.map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0)).sqrt()
}

/// GRPO per-response scalars: `(s - mean_g) / (std_g + eps)` (or without the division);
/// a group of one uses mean 0 and std 1.
fn grpo_scalars(scores: &[f64], index: &[u64], norm: bool, eps: f64) -> Vec<f64> {
    let mut a = scores.to_vec();
    for rows in group_rows(index).values() {
        let (mean, std) = if rows.len() > 1 {
            let vals = rows.iter().map(|&i| scores[i]);
            (
                vals.clone().sum::<f64>() / rows.len() as f64,
                std_unbiased(vals),
            )
        } else {
            (0.0, 1.0)
        };
        for &i in rows {
            a[i] = if norm {
                (scores[i] - mean) / (std + eps)
            } else {
                scores[i] - mean
            };
        }
    }
    a
}

/// RLOO: `s·n/(n-1) - mean·n/(n-1)` in groups of n > 1; a group of one keeps its score
/// (`rloo`) or gets 0 (`rloo_vectorized`).
fn rloo_scalars(scores: &[f64], index: &[u64], single_gets_score: bool) -> Vec<f64> {
    let mut a = scores.to_vec();
    for rows in group_rows(index).values() {
        let n = rows.len() as f64;
        if rows.len() > 1 {
            let mean = rows.iter().map(|&i| scores[i]).sum::<f64>() / n;
            for &i in rows {
                a[i] = scores[i] * n / (n - 1.0) - mean * n / (n - 1.0);
            }
        } else if !single_gets_score {
            a[rows[0]] = 0.0;
        }
    }
    a
}

/// One scalar per row, times the mask.
fn broadcast(a: &[f64], m: &Mat) -> Mat {
    let mut out = Mat::zeros(m.b, m.t);
    for (i, ai) in a.iter().enumerate() {
        for t in 0..m.t {
            out.v[i * m.t + t] = ai * m.v[i * m.t + t];
        }
    }
    out
}
