//! `main_ppo generate` (verl's `main_generation`): a verl dataset in, `n` responses per prompt
//! out, with the rollout settings of the configuration.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use serde_json::Value;

use crate::rollout::{generate_dataset_rows, repeat_rows, Sampler, SamplingParams};
use crate::trainer::setup;

use super::ConfigArgs;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A verl dataset, or any parquet/JSONL/JSON file with a chat `prompt` column
    /// (`data.prompt_key`); other columns are optional and copied to the output.
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Output: the input columns plus `responses` and `response_lengths` (tokens of each
    /// response); `.parquet` writes parquet, anything else JSONL.
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// Sequences generated together at most (default: actor_rollout_ref.rollout.max_num_seqs;
    /// the key/value memory budget rollout.kv_cache_memory_gb applies as well).
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    /// Also write `response_log_probs`: each generated token's log-probability
    /// (`log_softmax(logits / temperature)`, temperature 1 when greedy), one list per response.
    #[arg(long)]
    pub log_probs: bool,
    /// Weights and arithmetic: f32 (default) or f64 (slow; for exact comparisons).
    #[arg(long, value_name = "f32|f64", default_value = "f32", value_parser = ["f32", "f64"])]
    pub dtype: String,
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    super::guard::check_output_args(&args.output, &args.input, &args.config)?;
    let loaded = args.config.load()?;
    let cfg = &loaded.config;
    // The budgets by training's rules; the other training keys need not be set here.
    let (prompt_len, response_len) = crate::config::sequence_budgets(cfg)?;
    let device = crate::model::device(&cfg.trainer.device)?;
    let model_cfg = &cfg.actor_rollout_ref.model;
    // The policy and tokenizer as training loads them (`data.tokenizer` included).
    let t0 = Instant::now();
    let dtype = if args.dtype == "f64" {
        candle_core::DType::F64
    } else {
        candle_core::DType::F32
    };
    let (mut model, tok) = setup::load_policy_as(cfg, &device, dtype).map_err(super::lift)?;
    // verl's main_generation runs the rollout engine: `rollout.dtype` sets the products.
    model.model.set_exec(setup::exec(cfg, setup::Role::Rollout));
    crate::config::data::check_model_context(
        prompt_len,
        response_len,
        model.model.args.max_position_embeddings,
        "actor_rollout_ref.model.path",
        &model_cfg.path,
    )?;
    // A base model plus a LoRA adapter (ours or PEFT's): `model.lora_adapter_path`. The
    // packed decode path folds the adapters into the weights once.
    if let Some(p) = &model_cfg.lora_adapter_path {
        let path = PathBuf::from(crate::util::expand_home(p));
        let file = crate::weights::peft::read_adapter(&path)
            .with_context(|| format!("actor_rollout_ref.model.lora_adapter_path={p}"))?;
        let adapters = candle_nn::VarMap::new();
        crate::weights::peft::attach(
            &mut model.model,
            &file.spec,
            &adapters,
            0,
            "actor_rollout_ref.model.lora_adapter_path",
        )?;
        crate::weights::peft::assign_adapter(&adapters, &file.tensors, &path)
            .with_context(|| format!("actor_rollout_ref.model.lora_adapter_path={p}"))?;
        tracing::info!("LoRA adapter {p}: rank {}", file.spec.rank);
    }
    tracing::info!(
        "loaded {} in {:.1} s",
        model_cfg.path,
        t0.elapsed().as_secs_f64()
    );
    let template = tok.template(model_cfg.custom_chat_template.as_deref())?;
    let ds = setup::generation_prompts(cfg, prompt_len, &args.input, &tok, &template)
        .map_err(super::lift)?;
    let r = &cfg.actor_rollout_ref.rollout;
    let mut params = SamplingParams::train(r, response_len, &tok.eos_token_ids);
    if let Some(b) = args.batch_size {
        params.limits.max_num_seqs = b.max(1);
    }
    let n = r.n.max(1);
    let mut sampler = Sampler::new(r.seed);
    // Each prompt n times, consecutively; the scheduler keeps the batch full and bounded.
    let indices: Vec<usize> = (0..ds.len()).collect();
    let rows = repeat_rows(&indices, n);
    let bar = indicatif::ProgressBar::new(rows.len() as u64);
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let t1 = Instant::now();
    let out = generate_dataset_rows(
        &model.model,
        &ds,
        &rows,
        &params,
        sampler.rows(),
        Some(&bar),
    )?;
    let mut responses: Vec<Vec<String>> = vec![Vec::new(); ds.len()];
    let mut log_probs: Vec<Vec<Value>> = vec![Vec::new(); ds.len()];
    let mut lengths: Vec<Vec<Value>> = vec![Vec::new(); ds.len()];
    let mut tokens = 0usize;
    for (k, resp) in out.responses.iter().enumerate() {
        tokens += resp.len();
        lengths[rows[k]].push(Value::from(resp.len()));
        if args.log_probs {
            log_probs[rows[k]].push(serde_json::json!(out.log_probs[k]));
        }
        let text = tok
            .tokenizer
            .decode(resp, true)
            .map_err(|e| anyhow::anyhow!("decoding a response: {e}"))?;
        responses[rows[k]].push(text);
    }
    bar.finish_and_clear();
    let secs = t1.elapsed().as_secs_f64();
    let rows: Vec<Value> = ds
        .samples
        .iter()
        .zip(responses)
        .zip(log_probs)
        .zip(lengths)
        .map(|(((s, resp), lps), lens)| {
            let mut o = s.raw.as_object().cloned().unwrap_or_default();
            o.insert(
                "responses".into(),
                resp.into_iter().map(Value::String).collect(),
            );
            o.insert("response_lengths".into(), Value::Array(lens));
            if args.log_probs {
                o.insert("response_log_probs".into(), Value::Array(lps));
            }
            Value::Object(o)
        })
        .collect();
    write_rows(&args.output, &rows)?;
    eprintln!(
        "generated {} responses ({n} per prompt, {tokens} tokens) in {secs:.1} s: {:.1} tokens/s; wrote {}",
        rows.len() * n,
        tokens as f64 / secs.max(1e-9),
        args.output.display()
    );
    Ok(())
}

/// JSONL, or parquet when the path ends in `.parquet` (schema inferred from the rows).
pub fn write_rows(path: &PathBuf, rows: &[Value]) -> anyhow::Result<()> {
    if path.extension().and_then(|e| e.to_str()) == Some("parquet") {
        let schema = arrow_json::reader::infer_json_schema_from_iterator(
            rows.iter().map(Ok::<_, arrow_schema::ArrowError>),
        )?;
        let schema = Arc::new(schema);
        let mut decoder = arrow_json::ReaderBuilder::new(schema.clone()).build_decoder()?;
        decoder.serialize(rows)?;
        let file = std::fs::File::create(path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        let mut w = parquet::arrow::ArrowWriter::try_new(file, schema, None)?;
        while let Some(batch) = decoder.flush()? {
            w.write(&batch)?;
        }
        w.close()?;
        return Ok(());
    }
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?,
    );
    for r in rows {
        writeln!(f, "{r}")?;
    }
    f.flush()?;
    Ok(())
}
