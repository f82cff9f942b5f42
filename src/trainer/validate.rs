//! Validation (verl's `_validate`): `rollout.val_kwargs.n` responses per validation prompt
//! (greedy by default), scored by the reward stage, summarised as verl's
//! `metric_utils.process_validation_metrics` and `_val_metrics_update` do.
//!
//! Variables: `reward` (each response's score) and every value the scorers reported (`acc`,
//! `pred`, ...; a plain-number score reports `acc = score`) and `format` (1 for a non-zero score:
//! the format rate of verl's `gsm8k` scorer with `format_score > 0`). Per data source, prompt and numeric
//! variable with N responses: `mean@N`; for N > 1 also `std@N` (population) and, for n = 2, 4,
//! 8, … below N and N itself, `best@n/{mean,std}` and `worst@n/{mean,std}` over 1000 bootstrap
//! draws of n responses with replacement (NumPy's legacy `RandomState`, seeded 42 for each n,
//! as verl), and `maj@n/{mean,std}` (the value of the first response of the most frequent
//! `pred` in each draw) when the prompt's responses carry a `pred`. Each metric is then
//! averaged over the prompts. Text variables give no metrics.
//!
//! Names: `val-core/<data_source>/<var>/<metric>` for the core variable (`acc` when the source
//! has one, else `reward`) and its `mean`/`maj`/`best` metrics at the largest n; `val-aux/...`
//! for everything else.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::batch::TurnStats;
use super::dumps::write_jsonl;
use super::phases::{add_turns_to_requests, rollout_rows, turn_stats};
use super::phases::{decode, requests};
use super::step_metrics;
use super::{Result, Trainer};
use crate::data::numpy_rng::RandomState;
use crate::metrics::Metrics;
use crate::rollout::{repeat_rows, Sampler, SamplingParams};

/// verl's bootstrap draws per sample size.
const N_BOOTSTRAP: usize = 1000;
/// verl's bootstrap seed (`process_validation_metrics(seed=42)`).
pub const BOOTSTRAP_SEED: u32 = 42;

/// One value a validation response carries: a number (bools count 0/1) or text.
#[derive(Debug, Clone, PartialEq)]
pub enum ValValue {
    Num(f64),
    Text(String),
}

impl ValValue {
    /// A scorer's JSON value; `None` for null, arrays and objects.
    pub fn from_json(v: &Value) -> Option<Self> {
        match v {
            Value::Number(n) => n.as_f64().map(ValValue::Num),
            Value::Bool(b) => Some(ValValue::Num(f64::from(u8::from(*b)))),
            Value::String(s) => Some(ValValue::Text(s.clone())),
            _ => None,
        }
    }

    /// The value as a vote (`pred`): equal votes, equal keys.
    fn vote(&self) -> String {
        match self {
            ValValue::Num(x) => format!("n:{x}"),
            ValValue::Text(s) => format!("s:{s}"),
        }
    }
}

/// One scored validation response.
#[derive(Debug, Clone)]
pub struct ValSample {
    pub data_source: String,
    /// The prompt it answers (verl's `uid`).
    pub uid: usize,
    /// `reward` and the scorers' extra values.
    pub vars: BTreeMap<String, ValValue>,
}

impl ValSample {
    /// A scored response: `reward` (the score), the scorers' extra values, and, when
    /// `format_rate` (the reward is the built-in gsm8k scorer:
    /// `RewardManager::format_rate_applies`), `format`: 1 when the score before DAPO's overlong
    /// penalty (`base`) is non-zero, else 0 (unless a scorer reported its own `format`): the
    /// penalty makes long answers negative, well formed or not. For any other reward a non-zero
    /// score says nothing about format (a function with a 0.1 floor would read 1.0).
    ///
    /// `format` is the format rate of verl's `gsm8k` scorer with `format_score > 0`: a
    /// well-formed wrong answer scores `format_score`, a right one `score`, one without a
    /// `#### <number>` 0, so the share of non-zero scores is the share of well-formed answers.
    /// As a per-response variable it is summarised like `acc` or `pred`, hence verl's name for
    /// such a value, `val-aux/<data_source>/format/mean@N` (aux: the core variable stays `acc`
    /// or `reward`). With a scorer that has no format credit (`format_score` 0, `math`) a
    /// non-zero score means a right answer, so there it equals the accuracy.
    pub fn scored(
        data_source: &str,
        uid: usize,
        (score, base): (f64, f64),
        extra: &serde_json::Map<String, Value>,
        format_rate: bool,
    ) -> Self {
        let mut vars: BTreeMap<String, ValValue> = extra
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), ValValue::from_json(v)?)))
            .collect();
        vars.insert("reward".into(), ValValue::Num(score));
        if format_rate {
            vars.entry("format".into())
                .or_insert(ValValue::Num(f64::from(u8::from(base != 0.0))));
        }
        ValSample {
            data_source: data_source.to_string(),
            uid,
            vars,
        }
    }
}

/// verl's `gen_ns`: 2, 4, 8, … below `n`, then `n` (none for n ≤ 1).
fn sample_sizes(n: usize) -> Vec<usize> {
    if n <= 1 {
        return Vec::new();
    }
    let mut ns = Vec::new();
    let mut k = 2;
    while k < n {
        ns.push(k);
        k *= 2;
    }
    ns.push(n);
    ns
}

fn mean_std(x: &[f64]) -> (f64, f64) {
    let n = x.len().max(1) as f64;
    let m = x.iter().sum::<f64>() / n;
    (
        m,
        (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / n).sqrt(),
    )
}

/// The value of the first response of the most frequent vote among `picks` (ties: the vote
/// seen first), as verl's `calc_maj_val`.
fn majority(picks: &[usize], vals: &[f64], votes: &[String]) -> f64 {
    let mut order: Vec<(&str, usize, f64)> = Vec::new();
    for &i in picks {
        match order.iter_mut().find(|(v, _, _)| *v == votes[i]) {
            Some(e) => e.1 += 1,
            None => order.push((&votes[i], 1, vals[i])),
        }
    }
    let mut best = &order[0];
    for e in &order[1..] {
        if e.1 > best.1 {
            best = e;
        }
    }
    best.2
}

/// One prompt's metrics of one numeric variable (`votes`: its responses' `pred`, if any).
fn prompt_metrics(vals: &[f64], votes: Option<&[String]>, seed: u32) -> Vec<(String, f64)> {
    let n = vals.len();
    let mut out = vec![(format!("mean@{n}"), mean_std(vals).0)];
    if n < 2 {
        return out;
    }
    out.push((format!("std@{n}"), mean_std(vals).1));
    for k in sample_sizes(n) {
        // [N_BOOTSTRAP, k] indices, row-major, as `np.random.choice(n, size=(1000, k))`.
        let idx = RandomState::new(seed).choice_with_replacement(n, N_BOOTSTRAP * k);
        let (mut best, mut worst, mut maj) = (Vec::new(), Vec::new(), Vec::new());
        for picks in idx.chunks(k) {
            let picked = picks.iter().map(|&i| vals[i]);
            best.push(picked.clone().fold(f64::NEG_INFINITY, f64::max));
            worst.push(picked.fold(f64::INFINITY, f64::min));
            if let Some(votes) = votes {
                maj.push(majority(picks, vals, votes));
            }
        }
        for (name, draws) in [("best", &best), ("worst", &worst), ("maj", &maj)] {
            if draws.is_empty() {
                continue;
            }
            let (m, sd) = mean_std(draws);
            out.push((format!("{name}@{k}/mean"), m));
            out.push((format!("{name}@{k}/std"), sd));
        }
    }
    out
}

/// verl's `process_validation_metrics` then `_val_metrics_update`: the named validation
/// metrics of `samples`, bootstrap seeded with `seed`.
pub fn validation_metrics(samples: &[ValSample], seed: u32) -> Metrics {
    // data source -> prompt -> variable -> values, in response order.
    type Vars = BTreeMap<String, Vec<ValValue>>;
    let mut groups: BTreeMap<&str, BTreeMap<usize, Vars>> = BTreeMap::new();
    for s in samples {
        let vars = groups
            .entry(s.data_source.as_str())
            .or_default()
            .entry(s.uid)
            .or_default();
        for (k, v) in &s.vars {
            vars.entry(k.clone()).or_default().push(v.clone());
        }
    }
    let mut m = Metrics::new();
    for (src, prompts) in groups {
        // variable -> metric -> per-prompt values.
        let mut acc: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
        for vars in prompts.values() {
            let votes: Option<Vec<String>> = vars
                .get("pred")
                .map(|p| p.iter().map(ValValue::vote).collect());
            for (var, vals) in vars {
                let nums: Option<Vec<f64>> = vals
                    .iter()
                    .map(|v| match v {
                        ValValue::Num(x) => Some(*x),
                        ValValue::Text(_) => None,
                    })
                    .collect();
                let Some(nums) = nums.filter(|n| !n.is_empty()) else {
                    continue;
                };
                let votes = votes.as_deref().filter(|v| v.len() == nums.len());
                for (name, v) in prompt_metrics(&nums, votes, seed) {
                    acc.entry(var.clone())
                        .or_default()
                        .entry(name)
                        .or_default()
                        .push(v);
                }
            }
        }
        let core = if acc.contains_key("acc") {
            "acc"
        } else {
            "reward"
        };
        for (var, metrics) in acc {
            let n_max = metrics
                .keys()
                .filter_map(|k| {
                    k.split('@')
                        .nth(1)?
                        .split('/')
                        .next()?
                        .parse::<usize>()
                        .ok()
                })
                .max()
                .unwrap_or(1);
            for (name, vals) in metrics {
                let is_core = var == core
                    && ["mean", "maj", "best"].iter().any(|p| name.starts_with(p))
                    && name.contains(&format!("@{n_max}"));
                let section = if is_core { "val-core" } else { "val-aux" };
                m.insert(format!("{section}/{src}/{var}/{name}"), mean_std(&vals).0);
            }
        }
    }
    m
}

/// The agent loop's metrics over a validation's conversations, under `val-aux/`: verl's
/// `val-aux/num_turns/{min,max,mean}` and the step's `agent/*` shares (tool-call share, parsed
/// share of call blocks, failed share of run calls, the model's own tokens) for the validation
/// set, so that a `val_only` run measures how a checkpoint uses its tools.
fn val_agent_metrics(m: &mut Metrics, turns: &[TurnStats]) {
    let mut agent = Metrics::new();
    step_metrics::agent_metrics(&mut agent, turns);
    for (k, v) in agent {
        if k.starts_with("timing_s/") || k == "num_turns/std" {
            continue;
        }
        m.insert(format!("val-aux/{k}"), v);
    }
}

/// Which `log_val_generations` rows verl's `_maybe_log_val_generations` shows: the rows sorted
/// by input text (stable), shuffled by NumPy's legacy `RandomState(42).shuffle`, the first
/// `n`. Returns indices into `rows`.
pub fn val_generations(rows: &[Value], n: usize) -> Vec<usize> {
    if n == 0 || rows.is_empty() {
        return Vec::new();
    }
    let mut order: Vec<usize> = (0..rows.len()).collect();
    let input = |k: usize| rows[k]["input"].as_str().unwrap_or_default();
    order.sort_by(|&a, &b| input(a).cmp(input(b)));
    // `RandomState.shuffle` of a list: Fisher-Yates from the back, `j` drawn in [0, i].
    let mut rng = RandomState::new(42);
    for i in (1..order.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order.truncate(n);
    order
}

impl Trainer {
    /// Generates for the validation set and returns the `val-core/*` and `val-aux/*` metrics.
    pub fn validate(&mut self) -> Result<Metrics> {
        let Some(ds) = self.val.as_ref() else {
            return Ok(Metrics::new());
        };
        let vk = &self.cfg.actor_rollout_ref.rollout.val_kwargs;
        let n = vk.n.max(1);
        let params = SamplingParams::validation(
            &self.cfg.actor_rollout_ref.rollout,
            self.plan.response_length,
            &self.tokenizer.eos_token_ids,
        );
        // Its own stream: validation never moves the training sampler.
        let mut sampler =
            Sampler::new(self.plan.seeds.rollout ^ self.global_step.wrapping_mul(0x9e37_79b9));
        let per_batch = self.cfg.data.val_batch_size.unwrap_or(ds.len()).max(1);
        let indices: Vec<usize> = (0..ds.len()).collect();
        let mut scored = Vec::new();
        let mut dumps = Vec::new();
        let mut all_turns = Vec::new();
        for (i, chunk) in indices.chunks(per_batch).enumerate() {
            if i > 0 {
                self.check_stop("validation", self.global_step)?;
            }
            crate::util::fault_point("validation", self.global_step);
            let rows = repeat_rows(chunk, n);
            let view = self.actor.rollout_view();
            let agent = self.rollout.agent.as_deref();
            let (out, eps) = rollout_rows(&view, ds, &rows, &params, &mut sampler, 0, agent)?;
            let texts = decode(&self.tokenizer, &out.responses)?;
            let lens: Vec<usize> = out.responses.iter().map(Vec::len).collect();
            let mut reqs = requests(ds, &rows, &texts, self.reward_experiment());
            let turns: Option<Vec<_>> = eps.as_ref().map(|eps| {
                eps.iter()
                    .zip(&rows)
                    .map(|(e, &i)| turn_stats(e, ds.agents[i]))
                    .collect()
            });
            if let Some(turns) = &turns {
                add_turns_to_requests(&mut reqs, turns);
                all_turns.extend(turns.iter().cloned());
            }
            let rewards = self.reward.score(&reqs, &lens)?;
            for (k, r) in rewards.iter().enumerate() {
                let sample = &ds.samples[rows[k]];
                if let Some(score) = r.score {
                    let base = r.unpenalised.unwrap_or(score);
                    scored.push(ValSample::scored(
                        &sample.data_source,
                        rows[k],
                        (score, base),
                        &r.extra,
                        self.reward.format_rate_applies(&sample.data_source),
                    ));
                }
                // Rows are kept only for the log lines, the trackers' generation tables and the
                // dump folder that want them (the generations are drawn from all of them).
                let wanted = self.cfg.trainer.validation_data_dir.is_some()
                    || self.cfg.trainer.log_val_generations > 0;
                if !wanted {
                    continue;
                }
                let mut d = json!({
                    "input": self.tokenizer.tokenizer.decode(&ds.prompt_ids[rows[k]], true).unwrap_or_default(),
                    "output": texts[k],
                    "gts": sample.ground_truth,
                    "score": r.score,
                    "step": self.global_step,
                    "data_source": sample.data_source,
                });
                if let (Some(t), Some(o)) = (turns.as_ref().map(|t| &t[k]), d.as_object_mut()) {
                    super::dumps::add_turns(o, &self.tokenizer, &out.responses[k], t);
                }
                dumps.push(d);
            }
        }
        let mut m = validation_metrics(&scored, BOOTSTRAP_SEED);
        if !all_turns.is_empty() {
            val_agent_metrics(&mut m, &all_turns);
        }
        let shown = val_generations(&dumps, self.cfg.trainer.log_val_generations);
        for &k in &shown {
            let d = &dumps[k];
            tracing::info!(
                "validation sample (step {}):\n[prompt] {}\n[response] {}\n[ground truth] {}\n[score] {}",
                self.global_step,
                d["input"].as_str().unwrap_or_default(),
                d["output"].as_str().unwrap_or_default(),
                d["gts"],
                d["score"]
            );
        }
        let samples: Vec<(String, String, f64)> = shown
            .iter()
            .map(|&k| {
                let d = &dumps[k];
                (
                    d["input"].as_str().unwrap_or_default().to_string(),
                    d["output"].as_str().unwrap_or_default().to_string(),
                    d["score"].as_f64().unwrap_or(f64::NAN),
                )
            })
            .collect();
        self.tracker.log_generations(&samples, self.global_step);
        if let Some(dir) = &self.cfg.trainer.validation_data_dir {
            let dir = std::path::PathBuf::from(crate::util::expand_home(dir));
            write_jsonl(&dir, self.global_step, &dumps)?;
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected: NumPy 2.4.6, `s = sorted(inputs); np.random.RandomState(42).shuffle(s); s[:5]`
    /// with inputs in07 in03 in09 in01 in00 in05 in08 in02 in06 in04 in11 in10.
    #[test]
    fn val_generations_are_verls_seeded_shuffle_of_the_sorted_rows() {
        let rows: Vec<Value> = [7, 3, 9, 1, 0, 5, 8, 2, 6, 4, 11, 10]
            .iter()
            .map(|i| json!({"input": format!("in{i:02}")}))
            .collect();
        let got: Vec<&str> = val_generations(&rows, 5)
            .into_iter()
            .map(|k| rows[k]["input"].as_str().unwrap())
            .collect();
        assert_eq!(got, ["in10", "in09", "in00", "in08", "in05"]);
        assert!(val_generations(&rows, 0).is_empty());
        assert_eq!(val_generations(&rows, 100).len(), 12);
    }

    /// Three tool-agent conversations, by hand: calls 2 / 0 / 1 with one malformed block in the
    /// second and one failed call in the first; turns 6 / 3 / 4.
    #[test]
    fn validation_reports_the_agent_loops_shares_under_val_aux() {
        let t = |num_turns, tool_calls, malformed_calls, tool_errors| TurnStats {
            num_turns,
            tool_agent: true,
            tool_calls,
            malformed_calls,
            tool_errors,
            model_tokens: 10 * num_turns,
            tool_seconds: 0.5,
            ..TurnStats::default()
        };
        let mut m = Metrics::new();
        val_agent_metrics(&mut m, &[t(6, 2, 0, 1), t(3, 0, 1, 0), t(4, 1, 0, 0)]);
        let get = |k: &str| {
            m.get(k)
                .copied()
                .unwrap_or_else(|| panic!("{k} missing: {m:?}"))
        };
        assert_eq!(get("val-aux/num_turns/mean"), 13.0 / 3.0);
        assert_eq!(get("val-aux/num_turns/max"), 6.0);
        assert_eq!(get("val-aux/num_turns/min"), 3.0);
        // Every row wrote a call block (parsed or not); 3 of 4 blocks parsed; 1 of 3 run calls failed.
        assert_eq!(get("val-aux/agent/tool_call_ratio"), 1.0);
        assert_eq!(get("val-aux/agent/tool_call_parse_ratio"), 0.75);
        assert_eq!(get("val-aux/agent/tool_error_ratio"), 1.0 / 3.0);
        assert_eq!(get("val-aux/agent/tool_calls/mean"), 1.0);
        assert!(m
            .keys()
            .all(|k| k.starts_with("val-aux/") && !k.contains("timing_s")));
    }

    /// Printed by `scripts/val_metrics_reference.py` (NumPy 2.4.6's legacy RandomState, an
    /// independent re-computation of verl's process_validation_metrics / _val_metrics_update)
    /// for the responses of [`samples`].
    const REFERENCE: &str = "
val-aux/ds_a/acc/best@2/mean 0.49
val-aux/ds_a/acc/best@2/std 0.47557703292448417
val-aux/ds_a/acc/best@4/mean 0.7315
val-aux/ds_a/acc/best@4/std 0.4069722384887322
val-aux/ds_a/acc/maj@2/mean 0.3015
val-aux/ds_a/acc/maj@2/std 0.441084772747262
val-aux/ds_a/acc/maj@4/mean 0.3045
val-aux/ds_a/acc/maj@4/std 0.44467066941267536
val-aux/ds_a/acc/std@5 0.44494897427831787
val-aux/ds_a/acc/worst@2/mean 0.10500000000000001
val-aux/ds_a/acc/worst@2/std 0.28791648154426397
val-aux/ds_a/acc/worst@4/mean 0.017
val-aux/ds_a/acc/worst@4/std 0.10512173184368656
val-aux/ds_a/acc/worst@5/mean 0.0035
val-aux/ds_a/acc/worst@5/std 0.041686328694189416
val-aux/ds_a/reward/best@2/mean 0.6615
val-aux/ds_a/reward/best@2/std 0.38278717348274593
val-aux/ds_a/reward/best@4/mean 0.868125
val-aux/ds_a/reward/best@4/std 0.25331822470111426
val-aux/ds_a/reward/best@5/mean 0.91475
val-aux/ds_a/reward/best@5/std 0.19684550624018404
val-aux/ds_a/reward/maj@2/mean 0.4455
val-aux/ds_a/reward/maj@2/std 0.41739791580200614
val-aux/ds_a/reward/maj@4/mean 0.453625
val-aux/ds_a/reward/maj@4/std 0.42169067183194087
val-aux/ds_a/reward/maj@5/mean 0.45725
val-aux/ds_a/reward/maj@5/std 0.4247703869699664
val-aux/ds_a/reward/mean@5 0.45
val-aux/ds_a/reward/std@5 0.4179449471770337
val-aux/ds_a/reward/worst@2/mean 0.23275
val-aux/ds_a/reward/worst@2/std 0.32631507722504516
val-aux/ds_a/reward/worst@4/mean 0.087
val-aux/ds_a/reward/worst@4/std 0.16847140378518208
val-aux/ds_a/reward/worst@5/mean 0.05925
val-aux/ds_a/reward/worst@5/std 0.12540136136766453
val-aux/ds_b/reward/best@2/mean 0.6495000000000001
val-aux/ds_b/reward/best@2/std 0.2803564695169348
val-aux/ds_b/reward/std@3 0.2943920288775949
val-aux/ds_b/reward/worst@2/mean 0.3422000000000001
val-aux/ds_b/reward/worst@2/std 0.2193607986856357
val-aux/ds_b/reward/worst@3/mean 0.27980000000000005
val-aux/ds_b/reward/worst@3/std 0.16028711738627033
val-core/ds_a/acc/best@5/mean 0.7965
val-core/ds_a/acc/best@5/std 0.3690107814590162
val-core/ds_a/acc/maj@5/mean 0.3
val-core/ds_a/acc/maj@5/std 0.4493819606874792
val-core/ds_a/acc/mean@5 0.30000000000000004
val-core/ds_b/reward/best@3/mean 0.7433000000000002
val-core/ds_b/reward/best@3/std 0.2425594978556808
val-core/ds_b/reward/mean@3 0.5
";

    /// The script's responses: ds_a with 5 per prompt (reward, acc as bools, a text pred),
    /// ds_b with 3 (reward and a text extra that yields no metric).
    fn samples() -> Vec<ValSample> {
        let a = [
            (0, 1.0, true, "7"),
            (0, 0.0, false, "3"),
            (0, 0.5, false, "7"),
            (0, 1.0, true, "3"),
            (0, 0.25, false, "3"),
            (1, 0.0, false, "1"),
            (1, 0.0, false, "2"),
            (1, 1.0, true, "2"),
            (1, 0.0, false, "1"),
            (1, 0.75, false, "2"),
        ];
        let mut out: Vec<ValSample> = a
            .iter()
            .map(|&(uid, r, acc, pred)| ValSample {
                data_source: "ds_a".into(),
                uid,
                vars: [
                    ("reward".to_string(), ValValue::Num(r)),
                    ("acc".to_string(), ValValue::from_json(&json!(acc)).unwrap()),
                    (
                        "pred".to_string(),
                        ValValue::from_json(&json!(pred)).unwrap(),
                    ),
                ]
                .into_iter()
                .collect(),
            })
            .collect();
        for (r, note) in [(0.2, "x"), (0.9, "y"), (0.4, "z")] {
            out.push(ValSample {
                data_source: "ds_b".into(),
                uid: 2,
                vars: [
                    ("reward".to_string(), ValValue::Num(r)),
                    ("note".to_string(), ValValue::Text(note.into())),
                ]
                .into_iter()
                .collect(),
            });
        }
        out
    }

    #[test]
    fn validation_metrics_match_the_reference_script() {
        let want: BTreeMap<String, f64> = REFERENCE
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let (k, v) = l.split_once(' ').unwrap();
                (k.to_string(), v.parse().unwrap())
            })
            .collect();
        let got = validation_metrics(&samples(), BOOTSTRAP_SEED);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>()
        );
        for (k, w) in &want {
            assert!((got[k] - w).abs() < 1e-12, "{k}: {} vs {w}", got[k]);
        }
        // verl's section rule: the core variable's mean/maj/best at the largest n.
        assert!(got.contains_key("val-core/ds_a/acc/maj@5/std"));
        assert!(got.contains_key("val-aux/ds_a/acc/best@4/mean"));
        assert!(got.contains_key("val-core/ds_b/reward/best@3/mean"));
        assert!(!got.keys().any(|k| k.contains("note")));
    }

    #[test]
    fn format_rate_is_the_share_of_non_zero_scores() {
        // gsm8k with format_score 0.1: right 1.0, well-formed wrong 0.1, no `####` 0.
        // Prompt 0: [0.1, 0.0] -> 1/2 well formed; prompt 1: [1.0, 0.1] -> 2/2; prompt 2:
        // [0.0, 0.0] -> 0/2. By hand: mean@2 = (0.5 + 1 + 0) / 3 = 0.5; the bootstrap draws
        // of a constant prompt are that constant, so best@2/mean lies in [0.5, 1].
        let acc = |s: f64| {
            let mut m = serde_json::Map::new();
            m.insert("acc".into(), json!(s));
            m
        };
        let samples: Vec<ValSample> = [(0, 0.1), (0, 0.0), (1, 1.0), (1, 0.1), (2, 0.0), (2, 0.0)]
            .iter()
            .map(|&(uid, s)| ValSample::scored("openai/gsm8k", uid, (s, s), &acc(s), true))
            .collect();
        let m = validation_metrics(&samples, BOOTSTRAP_SEED);
        assert!((m["val-aux/openai/gsm8k/format/mean@2"] - 0.5).abs() < 1e-12);
        // acc stays the core variable: (0.05 + 0.55 + 0) / 3.
        assert!((m["val-core/openai/gsm8k/acc/mean@2"] - 0.2).abs() < 1e-12);
        assert!(!m
            .keys()
            .any(|k| k.starts_with("val-core/") && k.contains("format")));
        let best = m["val-aux/openai/gsm8k/format/best@2/mean"];
        assert!((0.5..=1.0).contains(&best), "{best}");
        // Greedy (one response per prompt): 2 of 3 well formed.
        let one: Vec<ValSample> = [(0, 0.1), (1, 1.0), (2, 0.0)]
            .iter()
            .map(|&(uid, s)| ValSample::scored("openai/gsm8k", uid, (s, s), &acc(s), true))
            .collect();
        let m = validation_metrics(&one, BOOTSTRAP_SEED);
        assert!((m["val-aux/openai/gsm8k/format/mean@1"] - 2.0 / 3.0).abs() < 1e-12);
        // A scorer's own `format` wins.
        let mut own = acc(0.0);
        own.insert("format".into(), json!(true));
        let s = ValSample::scored("x", 0, (0.0, 0.0), &own, true);
        assert_eq!(s.vars["format"], ValValue::Num(1.0));
        // DAPO's overlong penalty: a long answer without `####` scores 0 − 0.05 and is not well
        // formed; a long well-formed one scores 0.1 − 0.05 and is.
        let s = ValSample::scored("x", 0, (-0.05, 0.0), &acc(0.0), true);
        assert_eq!(s.vars["format"], ValValue::Num(0.0));
        assert_eq!(s.vars["reward"], ValValue::Num(-0.05));
        let s = ValSample::scored("x", 0, (0.05, 0.1), &acc(0.1), true);
        assert_eq!(s.vars["format"], ValValue::Num(1.0));
        // A reward that is not the gsm8k scorer (a Python function with a 0.1 floor): no
        // format rate at all, rather than one that reads 1.0 (it used to).
        let floor: Vec<ValSample> = [(0, 0.1), (1, 1.0), (2, 0.1)]
            .iter()
            .map(|&(uid, s)| ValSample::scored("openai/gsm8k", uid, (s, s), &acc(s), false))
            .collect();
        let m = validation_metrics(&floor, BOOTSTRAP_SEED);
        assert!(!m.keys().any(|k| k.contains("/format/")), "{m:?}");
        assert!((m["val-core/openai/gsm8k/acc/mean@1"] - 0.4).abs() < 1e-12);
    }

    #[test]
    fn sample_sizes_are_powers_of_two_then_n() {
        assert_eq!(sample_sizes(1), Vec::<usize>::new());
        assert_eq!(sample_sizes(2), [2]);
        assert_eq!(sample_sizes(5), [2, 4, 5]);
        assert_eq!(sample_sizes(8), [2, 4, 8]);
    }
}
