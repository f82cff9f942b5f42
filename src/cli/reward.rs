//! Tools for reward authors: `main_ppo reward score`, `main_ppo reward test` and `main_ppo eval`
//! (verl's `main_eval`). They run the configured reward stage (built-in scorers, Python
//! functions, native functions, weights) on files of responses, without any model.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use serde_json::{Map, Value};

use crate::data::sample::Need;
use crate::data::{read_rows, Sample};
use crate::reward::{
    FailurePolicy, ModelContext, NativeRegistry, RewardManager, SampleReward, ScoreRequest as Item,
};

use super::ConfigArgs;

#[derive(Debug, Args)]
pub struct ScoreArgs {
    /// Responses to score: JSONL, JSON or parquet; each row has `data_source`, the response
    /// (`solution_str` or `response`), the ground truth (`ground_truth` or
    /// `reward_model.ground_truth`) and optionally `extra_info`.
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Where to write one JSON object per input row, in input order (default: stdout).
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Column (dotted path) holding the response, e.g. `extra_info.answer` to score a dataset's
    /// reference solutions; default `solution_str`, then `response`.
    #[arg(long, value_name = "KEY")]
    pub response_key: Option<String>,
    #[command(flatten)]
    pub config: ConfigArgs,
}

#[derive(Debug, Args)]
pub struct TestArgs {
    /// Rows as for `reward score`, each with `expected`: a number or {"min": a, "max": b}.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    #[command(flatten)]
    pub config: ConfigArgs,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Generations as `main_ppo generate` writes them: the dataset columns plus `responses`.
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Where to write the rows with a `scores` list aligned with `responses` (JSONL).
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub config: ConfigArgs,
}

/// The reward request of input row `i`: the dataset columns read as [`Sample`]s are (a
/// `data_source`, a ground truth; see [`Need::Reward`]) plus the response, `response` when
/// given, else the `solution_str` or `response` column. The error names the file, the row
/// and the column.
fn row_item(file: &Path, i: usize, row: &Value, response: Option<&Value>) -> Result<Item, String> {
    let at = format!("{}, row {i}", file.display());
    let response = response
        .or_else(|| row.get("solution_str"))
        .or_else(|| row.get("response"));
    let solution_str = match response {
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(format!(
                "{at}: the response must be a string, found {other}"
            ))
        }
        None => {
            return Err(format!(
                "{at}: no response (`solution_str` or `response` column)"
            ))
        }
    };
    let file = file.display().to_string();
    let sample = Sample::parse(&file, i, row.clone(), "prompt", "data_source", Need::Reward)
        .map_err(|e| e.to_string())?;
    Ok(Item::new(&sample, solution_str))
}

/// Training's start-up warning, for the rows of `file` (`(row, item)`, a row counted once):
/// a number as ground truth where the built-in gsm8k scorer compares text scores 0.
fn warn_numeric_ground_truths<'a>(
    manager: &RewardManager,
    file: &Path,
    items: impl Iterator<Item = (usize, &'a Result<Item, String>)>,
) {
    let file = file.display().to_string();
    let mut seen = std::collections::BTreeSet::new();
    let rows = items
        .filter(|(i, _)| seen.insert(*i))
        .filter_map(|(i, p)| p.as_ref().ok().map(|it| (i, it)))
        .map(|(i, it)| (file.as_str(), i, it.data_source.as_str(), &it.ground_truth));
    if let Some(w) = manager.numeric_ground_truth_warning(rows) {
        tracing::warn!("{w}");
    }
}

fn response_len(row: &Value) -> usize {
    row.get("response_length")
        .and_then(Value::as_u64)
        .unwrap_or(0) as usize
}

/// Scores prepared items, keeping rows that failed to parse as errors.
fn score_rows(
    manager: &mut RewardManager,
    prepared: &[Result<Item, String>],
    lens: &[usize],
) -> anyhow::Result<Vec<SampleReward>> {
    let items: Vec<Item> = prepared
        .iter()
        .filter_map(|p| p.as_ref().ok().cloned())
        .collect();
    let item_lens: Vec<usize> = prepared
        .iter()
        .zip(lens)
        .filter(|(p, _)| p.is_ok())
        .map(|(_, l)| *l)
        .collect();
    let mut scored = manager.score(&items, &item_lens)?.into_iter();
    Ok(prepared
        .iter()
        .map(|p| match p {
            Ok(_) => scored.next().expect("one result per item"),
            Err(e) => SampleReward {
                error: Some(e.clone()),
                ..SampleReward::default()
            },
        })
        .collect())
}

fn output_object(r: &SampleReward, several: bool) -> Value {
    let mut o = Map::new();
    o.insert(
        "score".into(),
        r.score.map(Value::from).unwrap_or(Value::Null),
    );
    o.insert(
        "error".into(),
        r.error.clone().map(Value::from).unwrap_or(Value::Null),
    );
    if several {
        for (name, s) in &r.per_source {
            o.insert(
                format!("score/{name}"),
                s.map(Value::from).unwrap_or(Value::Null),
            );
        }
    }
    for (k, v) in &r.extra {
        o.entry(k.clone()).or_insert_with(|| v.clone());
    }
    Value::Object(o)
}

fn manager(config: &ConfigArgs, natives: &NativeRegistry) -> anyhow::Result<RewardManager> {
    let loaded = config.load()?;
    let plan = loaded
        .config
        .reward
        .plan()
        .map_err(crate::config::ConfigError::Invalid)?;
    // Every row is scored; failures are reported on their rows.
    Ok(
        RewardManager::new(&plan, natives, &ModelContext::default())?
            .with_policy(FailurePolicy::Collect),
    )
}

fn writer(path: &Option<PathBuf>) -> anyhow::Result<Box<dyn Write>> {
    Ok(match path {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("cannot write {}", p.display()))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout())),
    })
}

/// `reward score`. Returns whether every row scored.
pub fn score(args: &ScoreArgs, natives: &NativeRegistry) -> anyhow::Result<bool> {
    if let Some(out) = &args.output {
        super::guard::check_output_args(out, &args.input, &args.config)?;
    }
    let mut manager = manager(&args.config, natives)?;
    let rows = read_rows(&args.input)?;
    let t0 = Instant::now();
    let prepared: Vec<Result<Item, String>> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| match &args.response_key {
            Some(key) => match key.split('.').try_fold(r, |v, k| v.get(k)) {
                Some(resp) => row_item(&args.input, i, r, Some(resp)),
                None => Err(format!(
                    "{}, row {i}: no column `{key}` (--response-key)",
                    args.input.display()
                )),
            },
            None => row_item(&args.input, i, r, None),
        })
        .collect();
    warn_numeric_ground_truths(&manager, &args.input, prepared.iter().enumerate());
    let lens: Vec<usize> = rows.iter().map(response_len).collect();
    let results = score_rows(&mut manager, &prepared, &lens)?;
    let secs = t0.elapsed().as_secs_f64();
    let several = manager.sources.len() > 1;
    let mut out = writer(&args.output)?;
    for r in &results {
        writeln!(out, "{}", output_object(r, several))?;
    }
    out.flush()?;
    let mut by_source: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for (p, r) in prepared.iter().zip(&results) {
        if let (Ok(item), Some(s)) = (p, r.score) {
            let e = by_source.entry(item.data_source.clone()).or_default();
            e.0 += s;
            e.1 += 1;
        }
    }
    let failed = results.iter().filter(|r| r.error.is_some()).count();
    eprintln!(
        "scored {} rows in {secs:.2} s ({:.0} rows/s)",
        results.len(),
        results.len() as f64 / secs.max(1e-9)
    );
    for (ds, (sum, n)) in &by_source {
        eprintln!("  {ds}: mean score {:.4} over {n} rows", sum / *n as f64);
    }
    eprintln!("  errors: {failed}, timeouts: {}", manager.stats.timeouts);
    for r in results.iter().filter_map(|r| r.error.as_ref()).take(3) {
        eprintln!("  first errors: {}", r.lines().next().unwrap_or(""));
    }
    Ok(failed == 0)
}

/// What a `reward test` row expects of its score.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expected {
    /// The score, to within 1e-9.
    Exactly(f64),
    /// `min <= score <= max`; a missing bound is open.
    Within(f64, f64),
}

impl Expected {
    /// Reads a row's `expected`: a number, or an object with `min` and/or `max` (numbers,
    /// `min <= max`) and nothing else. Anything else is refused, so a typo (`{"mni": 5}`) or an
    /// empty `{}` cannot make a row pass whatever its score.
    fn parse(v: Option<&Value>) -> Result<Self, String> {
        let bound = |o: &Map<String, Value>, k: &str| -> Result<Option<f64>, String> {
            match o.get(k) {
                None => Ok(None),
                Some(b) => b
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| format!("`expected.{k}` must be a number, found {b}")),
            }
        };
        match v {
            None => Err("no `expected` column".into()),
            Some(Value::Number(n)) => n
                .as_f64()
                .map(Expected::Exactly)
                .ok_or_else(|| format!("`expected` {n} is not a finite number")),
            Some(Value::Object(o)) => {
                if let Some(k) = o.keys().find(|k| *k != "min" && *k != "max") {
                    return Err(format!(
                        "`expected` has an unknown key `{k}` (allowed: min, max)"
                    ));
                }
                let (lo, hi) = (bound(o, "min")?, bound(o, "max")?);
                if lo.is_none() && hi.is_none() {
                    return Err(
                        "`expected` is empty: give a number, or {\"min\": a} and/or {\"max\": b}"
                            .into(),
                    );
                }
                let (lo, hi) = (lo.unwrap_or(f64::NEG_INFINITY), hi.unwrap_or(f64::INFINITY));
                if lo > hi {
                    return Err(format!(
                        "`expected.min` ({lo}) is above `expected.max` ({hi})"
                    ));
                }
                Ok(Expected::Within(lo, hi))
            }
            Some(other) => Err(format!(
                "`expected` must be a number or {{\"min\": a, \"max\": b}}, found {other}"
            )),
        }
    }

    fn holds(self, score: f64) -> bool {
        match self {
            Expected::Exactly(x) => (score - x).abs() <= 1e-9,
            Expected::Within(lo, hi) => lo <= score && score <= hi,
        }
    }
}

/// `reward test`. Returns whether every row matched its expectation.
pub fn test(args: &TestArgs, natives: &NativeRegistry) -> anyhow::Result<bool> {
    let rows = read_rows(&args.file)?;
    // Every expectation is checked before anything is scored.
    let mut bad = Vec::new();
    let mut expectations = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        match Expected::parse(row.get("expected")) {
            Ok(e) => expectations.push(e),
            Err(m) => bad.push(format!("{}, row {i}: {m}", args.file.display())),
        }
    }
    if !bad.is_empty() {
        anyhow::bail!(
            "{} row(s) have no usable expectation:\n  {}",
            bad.len(),
            bad.join("\n  ")
        );
    }
    let mut manager = manager(&args.config, natives)?;
    let prepared: Vec<Result<Item, String>> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| row_item(&args.file, i, r, None))
        .collect();
    warn_numeric_ground_truths(&manager, &args.file, prepared.iter().enumerate());
    let lens: Vec<usize> = rows.iter().map(response_len).collect();
    let results = score_rows(&mut manager, &prepared, &lens)?;
    let (mut passed, mut failed) = (0, 0);
    for (i, ((row, r), want)) in rows.iter().zip(&results).zip(&expectations).enumerate() {
        let expected = row.get("expected");
        let ok = r.score.is_some_and(|s| want.holds(s));
        if ok {
            passed += 1;
            continue;
        }
        failed += 1;
        let response = row
            .get("solution_str")
            .or_else(|| row.get("response"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let shown: String = response.chars().take(200).collect();
        println!(
            "row {i} ({}): FAILED",
            row.get("data_source")
                .and_then(Value::as_str)
                .unwrap_or("?")
        );
        println!(
            "  response: {shown:?}{}",
            if response.chars().count() > 200 {
                " …"
            } else {
                ""
            }
        );
        println!(
            "  expected: {}",
            expected
                .map(|e| e.to_string())
                .unwrap_or_else(|| "(no `expected` column)".into())
        );
        match (&r.score, &r.error) {
            (_, Some(e)) => println!("  actual:   error: {e}"),
            (Some(s), None) => println!("  actual:   {s}"),
            (None, None) => println!("  actual:   no score"),
        }
    }
    println!("{passed} passed, {failed} failed");
    Ok(failed == 0)
}

/// One data source's summary in `eval`.
#[derive(Debug, Default)]
struct EvalLine {
    /// Σ over prompts of the mean score of the prompt's responses.
    mean: f64,
    /// Σ over prompts of the best score.
    best: f64,
    prompts: usize,
    /// Responses per prompt (the largest seen).
    n: usize,
    /// Responses, and those with a non-zero score.
    responses: usize,
    nonzero: usize,
    /// Σ of `response_lengths` and how many responses had one.
    tokens: usize,
    with_length: usize,
}

impl EvalLine {
    /// `mean@n`, `best@n`, `nonzero@n` (share of responses scoring non-zero before DAPO's
    /// overlong penalty: the format rate of gsm8k with `format_score > 0`) and the mean response length in tokens when the
    /// generations carry `response_lengths` for every response.
    fn render(&self, ds: &str) -> String {
        let n = self.n;
        let p = self.prompts.max(1) as f64;
        let mut line = format!(
            "{ds}: mean@{n} {:.4}  best@{n} {:.4}  nonzero@{n} {:.4}",
            self.mean / p,
            self.best / p,
            self.nonzero as f64 / self.responses.max(1) as f64
        );
        if self.with_length == self.responses && self.responses > 0 {
            line += &format!("  length {:.1}", self.tokens as f64 / self.responses as f64);
        }
        line + &format!("  ({} prompts)", self.prompts)
    }
}

/// Row `i`'s `response_lengths[j]`, when the generations carry it (`main_ppo generate` writes
/// it); `None` when absent, an error when present but not a list of counts.
fn response_length(file: &Path, i: usize, row: &Value, j: usize) -> anyhow::Result<Option<usize>> {
    let Some(l) = row.get("response_lengths") else {
        return Ok(None);
    };
    let n = l
        .as_array()
        .and_then(|a| a.get(j))
        .and_then(Value::as_u64)
        .with_context(|| {
            format!(
                "{}, row {i}: `response_lengths` must hold a token count for every response (entry {j}: {})",
                file.display(),
                l.as_array().and_then(|a| a.get(j)).unwrap_or(&Value::Null)
            )
        })?;
    Ok(Some(n as usize))
}

/// `eval`: mean@n, best@n, the share of non-zero scores and the mean response length per
/// data_source over a file of generations.
pub fn eval(args: &EvalArgs, natives: &NativeRegistry) -> anyhow::Result<bool> {
    if let Some(out) = &args.output {
        super::guard::check_output_args(out, &args.input, &args.config)?;
    }
    let mut manager = manager(&args.config, natives)?;
    let rows = read_rows(&args.input)?;
    let mut prepared = Vec::new();
    let mut owner = Vec::new(); // (row, response index)
    let mut lens = Vec::new(); // tokens, when known (the DAPO overlong penalty reads them)
    for (i, row) in rows.iter().enumerate() {
        let responses = row
            .get("responses")
            .and_then(Value::as_array)
            .with_context(|| format!("{}, row {i}: no `responses` list", args.input.display()))?;
        for (j, resp) in responses.iter().enumerate() {
            prepared.push(row_item(&args.input, i, row, Some(resp)));
            owner.push((i, j));
            lens.push(response_length(&args.input, i, row, j)?);
        }
    }
    let by_row = owner.iter().map(|(i, _)| *i).zip(&prepared);
    warn_numeric_ground_truths(&manager, &args.input, by_row);
    let token_lens: Vec<usize> = lens.iter().map(|l| l.unwrap_or(0)).collect();
    let results = score_rows(&mut manager, &prepared, &token_lens)?;
    let mut per_row: Vec<Vec<Option<f64>>> = rows
        .iter()
        .map(|r| vec![None; r["responses"].as_array().map_or(0, Vec::len)])
        .collect();
    // The scores before DAPO's overlong penalty, for nonzero@n (the penalty makes long answers
    // negative, well formed or not).
    let mut base_per_row = per_row.clone();
    let mut failed = 0;
    for ((i, j), r) in owner.iter().zip(&results) {
        per_row[*i][*j] = r.score;
        base_per_row[*i][*j] = r.unpenalised.or(r.score);
        if let Some(e) = &r.error {
            failed += 1;
            eprintln!("row {i}, response {j}: {}", e.lines().next().unwrap_or(""));
        }
    }
    let mut table: BTreeMap<String, EvalLine> = BTreeMap::new();
    let mut k = 0; // index into `lens`, in (row, response) order
    for ((row, scores), base) in rows.iter().zip(&per_row).zip(&base_per_row) {
        let ds = row
            .get("data_source")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string();
        let vals: Vec<f64> = scores.iter().map(|s| s.unwrap_or(0.0)).collect();
        if vals.is_empty() {
            continue;
        }
        let e = table.entry(ds).or_default();
        e.mean += vals.iter().sum::<f64>() / vals.len() as f64;
        e.best += vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        e.prompts += 1;
        e.n = e.n.max(vals.len());
        e.responses += vals.len();
        e.nonzero += base.iter().filter(|v| v.unwrap_or(0.0) != 0.0).count();
        for l in lens[k..k + vals.len()].iter().flatten() {
            e.tokens += l;
            e.with_length += 1;
        }
        k += vals.len();
    }
    for (ds, line) in &table {
        println!("{}", line.render(ds));
    }
    if args.output.is_some() {
        let mut out = writer(&args.output)?;
        for (row, scores) in rows.iter().zip(&per_row) {
            let mut o = row.as_object().cloned().unwrap_or_default();
            o.insert(
                "scores".into(),
                scores
                    .iter()
                    .map(|s| s.map(Value::from).unwrap_or(Value::Null))
                    .collect(),
            );
            writeln!(out, "{}", Value::Object(o))?;
        }
        out.flush()?;
    }
    Ok(failed == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn expectations_refuse_unknown_keys_empty_objects_and_non_numbers() {
        for (v, want) in [
            (json!({"mni": 5}), "unknown key `mni`"),
            (json!({"min": 0, "maximum": 1}), "unknown key `maximum`"),
            (json!({}), "empty"),
            (json!({"min": "0.5"}), "`expected.min` must be a number"),
            (json!({"min": 2, "max": 1}), "above"),
            (json!("1.0"), "must be a number"),
            (json!(null), "must be a number"),
            (json!([1]), "must be a number"),
        ] {
            let e = Expected::parse(Some(&v)).unwrap_err();
            assert!(e.contains(want), "{v}: {e}");
        }
        assert!(Expected::parse(None).unwrap_err().contains("no `expected`"));
    }

    #[test]
    fn valid_expectations_check_the_score() {
        let exact = Expected::parse(Some(&json!(1))).unwrap();
        assert!(exact.holds(1.0) && !exact.holds(0.999));
        let lo = Expected::parse(Some(&json!({"min": 0.5}))).unwrap();
        assert!(lo.holds(0.5) && lo.holds(7.0) && !lo.holds(0.49));
        let both = Expected::parse(Some(&json!({"min": -1, "max": 1}))).unwrap();
        assert!(both.holds(0.0) && !both.holds(1.5) && !both.holds(f64::NAN));
    }
}
