//! Tools for reward authors: `main_ppo reward score`, `main_ppo reward test` and `main_ppo eval`
//! (verl's `main_eval`). They run the configured reward stage (built-in scorers, Python
//! functions, native functions, weights) on files of responses, without any model.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use serde_json::{json, Map, Value};

use crate::data::read_rows;
use crate::reward::{
    FailurePolicy, NativeRegistry, RewardManager, SampleReward, ScoreRequest as Item,
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

/// A row that could not be turned into a reward request.
fn row_item(file: &Path, i: usize, row: &Value, response: Option<&Value>) -> Result<Item, String> {
    let at = format!("{}, row {i}", file.display());
    let data_source = match row.get("data_source") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(format!(
                "{at}, column `data_source`: expected a string, found {other}"
            ))
        }
        None => return Err(format!("{at}: no `data_source` column")),
    };
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
    let ground_truth = row
        .get("ground_truth")
        .or_else(|| row.get("reward_model").and_then(|r| r.get("ground_truth")))
        .cloned()
        .ok_or_else(|| {
            format!("{at}: no ground truth (`ground_truth` or `reward_model.ground_truth`)")
        })?;
    let extra_info = match row.get("extra_info") {
        None | Some(Value::Null) => json!({}),
        Some(v) => v.clone(),
    };
    Ok(Item {
        data_source,
        solution_str,
        ground_truth,
        extra_info,
        row: row.clone(),
    })
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
    // Every row is scored; failures are reported on their rows.
    Ok(RewardManager::from_config(&loaded.config.reward, natives)?
        .with_policy(FailurePolicy::Collect))
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

/// `reward test`. Returns whether every row matched its expectation.
pub fn test(args: &TestArgs, natives: &NativeRegistry) -> anyhow::Result<bool> {
    let mut manager = manager(&args.config, natives)?;
    let rows = read_rows(&args.file)?;
    let prepared: Vec<Result<Item, String>> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| row_item(&args.file, i, r, None))
        .collect();
    let lens: Vec<usize> = rows.iter().map(response_len).collect();
    let results = score_rows(&mut manager, &prepared, &lens)?;
    let (mut passed, mut failed) = (0, 0);
    for (i, (row, r)) in rows.iter().zip(&results).enumerate() {
        let expected = row.get("expected");
        let ok = match (expected, r.score) {
            (Some(Value::Number(n)), Some(s)) => (s - n.as_f64().unwrap_or(f64::NAN)).abs() <= 1e-9,
            (Some(Value::Object(o)), Some(s)) => {
                let lo = o
                    .get("min")
                    .and_then(Value::as_f64)
                    .unwrap_or(f64::NEG_INFINITY);
                let hi = o
                    .get("max")
                    .and_then(Value::as_f64)
                    .unwrap_or(f64::INFINITY);
                lo <= s && s <= hi
            }
            _ => false,
        };
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

/// `eval`: mean@n and best@n per data_source over a file of generations.
pub fn eval(args: &EvalArgs, natives: &NativeRegistry) -> anyhow::Result<bool> {
    let mut manager = manager(&args.config, natives)?;
    let rows = read_rows(&args.input)?;
    let mut prepared = Vec::new();
    let mut owner = Vec::new(); // (row, response index)
    for (i, row) in rows.iter().enumerate() {
        let responses = row
            .get("responses")
            .and_then(Value::as_array)
            .with_context(|| format!("{}, row {i}: no `responses` list", args.input.display()))?;
        for (j, resp) in responses.iter().enumerate() {
            prepared.push(row_item(&args.input, i, row, Some(resp)));
            owner.push((i, j));
        }
    }
    let lens = vec![0; prepared.len()];
    let results = score_rows(&mut manager, &prepared, &lens)?;
    let mut per_row: Vec<Vec<Option<f64>>> = rows
        .iter()
        .map(|r| vec![None; r["responses"].as_array().map_or(0, Vec::len)])
        .collect();
    let mut failed = 0;
    for ((i, j), r) in owner.iter().zip(&results) {
        per_row[*i][*j] = r.score;
        if let Some(e) = &r.error {
            failed += 1;
            eprintln!("row {i}, response {j}: {}", e.lines().next().unwrap_or(""));
        }
    }
    // data_source → (Σ mean over responses, Σ best, prompts, n)
    let mut table: BTreeMap<String, (f64, f64, usize, usize)> = BTreeMap::new();
    for (row, scores) in rows.iter().zip(&per_row) {
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
        e.0 += vals.iter().sum::<f64>() / vals.len() as f64;
        e.1 += vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        e.2 += 1;
        e.3 = e.3.max(vals.len());
    }
    for (ds, (mean, best, prompts, n)) in &table {
        println!(
            "{ds}: mean@{n} {:.4}  best@{n} {:.4}  ({prompts} prompts)",
            mean / *prompts as f64,
            best / *prompts as f64
        );
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
