//! `main_ppo generate` (verl's `main_generation`): a verl dataset in, `n` responses per prompt
//! out, with the rollout settings of the configuration.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use serde_json::Value;

use crate::data::dataset::{load_samples, DatasetOptions};
use crate::data::PromptDataset;
use crate::rollout::{generate_rows, repeat_rows, Sampler, SamplingParams};

use super::ConfigArgs;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A verl dataset (parquet, JSONL or JSON with a chat `prompt` column).
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Output: the input columns plus `responses`; `.parquet` writes parquet, anything else JSONL.
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// Prompts generated together.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    super::guard::check_output_args(&args.output, &args.input, &args.config)?;
    let loaded = args.config.load()?;
    let cfg = &loaded.config;
    let plan = crate::config::resolve(cfg).ok();
    let prompt_len = plan
        .as_ref()
        .map(|p| p.prompt_length)
        .unwrap_or(cfg.data.max_prompt_length);
    let response_len = plan
        .as_ref()
        .map(|p| p.response_length)
        .unwrap_or(cfg.data.max_response_length);
    let device = crate::model::device(&cfg.trainer.device)?;
    let model_cfg = &cfg.actor_rollout_ref.model;
    let t0 = Instant::now();
    let (model, tok) = crate::model::load_model_and_tokenizer(
        &model_cfg.path,
        model_cfg.tokenizer_path.as_deref(),
        &model_cfg.override_config,
        candle_core::DType::F32,
        &device,
        true,
    )?;
    crate::config::data::check_model_context(
        prompt_len,
        response_len,
        model.model.args.max_position_embeddings,
        "actor_rollout_ref.model.path",
        &model_cfg.path,
    )?;
    tracing::info!(
        "loaded {} in {:.1} s",
        model_cfg.path,
        t0.elapsed().as_secs_f64()
    );
    let template = tok.template(model_cfg.custom_chat_template.as_deref())?;
    // `data.val_max_samples` limits the rows, as for validation.
    let opts = DatasetOptions::val(&cfg.data, prompt_len);
    let samples = load_samples(&[args.input.display().to_string()], &opts)?;
    let ds = PromptDataset::build(samples, &tok, &template, &opts)?;
    let r = &cfg.actor_rollout_ref.rollout;
    let params = SamplingParams::train(r, response_len, &tok.eos_token_ids);
    let n = r.n.max(1);
    let mut sampler = Sampler::new(r.seed);
    let bar = indicatif::ProgressBar::new(ds.len() as u64);
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut responses: Vec<Vec<String>> = vec![Vec::new(); ds.len()];
    let mut tokens = 0usize;
    let t1 = Instant::now();
    let per_batch = args.batch_size.max(1);
    let indices: Vec<usize> = (0..ds.len()).collect();
    for chunk in indices.chunks(per_batch) {
        // Each prompt n times, consecutively.
        let rows = repeat_rows(chunk, n);
        let out = generate_rows(
            &model.model,
            &ds,
            &rows,
            tok.pad_token_id,
            &params,
            &mut sampler,
        )?;
        for (k, resp) in out.responses.iter().enumerate() {
            tokens += resp.len();
            let text = tok
                .tokenizer
                .decode(resp, true)
                .map_err(|e| anyhow::anyhow!("decoding a response: {e}"))?;
            responses[rows[k]].push(text);
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let secs = t1.elapsed().as_secs_f64();
    let rows: Vec<Value> = ds
        .samples
        .iter()
        .zip(responses)
        .map(|(s, resp)| {
            let mut o = s.raw.as_object().cloned().unwrap_or_default();
            o.insert(
                "responses".into(),
                resp.into_iter().map(Value::String).collect(),
            );
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
