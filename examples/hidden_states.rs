//! Every stage of our forward on given token ids, for comparing with another implementation
//! layer by layer (`scripts/peft_check.py` compares it with transformers and PEFT):
//!
//! ```sh
//! cargo run --release --example hidden_states -- --model DIR_OR_GGUF --ids ids.json \
//!   --out stages.safetensors [--adapter LORA_DIR] [--dtype f32|f64] [--merged] [--composed]
//! ```
//! `ids.json` is a list of token-id lists (one forward each, no padding). The output holds, for
//! sequence `k`: `seq{k}.stage{i}` `[len, hidden]` (stage 0 the embedding output, stage i the
//! output of layer i−1, the last stage the final norm's output) and `seq{k}.logits`
//! `[len, vocab]`. `--merged` folds the adapter into the weights (W + s·B·A) first;
//! `--composed` runs the layers as the candle op composition instead of the hand-written layer.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

struct Args {
    model: String,
    ids: PathBuf,
    out: PathBuf,
    adapter: Option<PathBuf>,
    dtype: DType,
    merged: bool,
    composed: bool,
}

fn parse() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let (mut model, mut ids, mut out, mut adapter) = (None, None, None, None);
    let (mut dtype, mut merged, mut composed) = (DType::F32, false, false);
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--model" => model = Some(value()?),
            "--ids" => ids = Some(PathBuf::from(value()?)),
            "--out" => out = Some(PathBuf::from(value()?)),
            "--adapter" => adapter = Some(PathBuf::from(value()?)),
            "--dtype" => {
                dtype = match value()?.as_str() {
                    "f32" => DType::F32,
                    "f64" => DType::F64,
                    other => bail!("--dtype: f32 or f64, got {other:?}"),
                }
            }
            "--merged" => merged = true,
            "--composed" => composed = true,
            other => bail!("unknown argument {other:?} (see the file's header for usage)"),
        }
    }
    Ok(Args {
        model: model.context("--model is required")?,
        ids: ids.context("--ids is required")?,
        out: out.context("--out is required")?,
        adapter,
        dtype,
        merged,
        composed,
    })
}

fn main() -> Result<()> {
    let a = parse()?;
    let dev = Device::Cpu;
    let overrides = serde_json::Map::new();
    let (mut loaded, _tok) = main_ppo::weights::load_model_and_tokenizer(
        &a.model, None, &overrides, a.dtype, &dev, true,
    )
    .with_context(|| format!("--model {}", a.model))?;
    let adapters = candle_nn::VarMap::new();
    if let Some(dir) = &a.adapter {
        let ctx = || format!("--adapter {}", dir.display());
        let file = main_ppo::weights::peft::read_adapter(dir).with_context(ctx)?;
        main_ppo::weights::peft::attach(&mut loaded.model, &file.spec, &adapters, 0, "--adapter")
            .with_context(ctx)?;
        main_ppo::weights::peft::assign_adapter(&adapters, &file.tensors, dir).with_context(ctx)?;
    }
    let exec = main_ppo::model::Exec {
        composed: a.composed,
        ..loaded.model.exec()
    };
    loaded.model.set_exec(exec);
    let model = if a.merged {
        loaded.model.merged()?
    } else {
        loaded.model.no_grad()
    };
    let text = std::fs::read_to_string(&a.ids).with_context(|| a.ids.display().to_string())?;
    let seqs: Vec<Vec<u32>> = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: expected a JSON list of token-id lists",
            a.ids.display()
        )
    })?;
    let mut out: HashMap<String, Tensor> = HashMap::new();
    for (k, ids) in seqs.iter().enumerate() {
        let n = ids.len();
        if n == 0 {
            bail!("{}: sequence {k} is empty", a.ids.display());
        }
        let input = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?; // [1, n]
        let pos = Tensor::arange(0u32, n as u32, &dev)?.unsqueeze(0)?; // [1, n]
        let mask = Tensor::ones((1, n), DType::U32, &dev)?; // [1, n]
        let stages = model.hidden_states(&input, &pos, &mask)?; // each [1, n, hidden]
        let logits = model.logits(stages.last().context("no stages")?)?; // [1, n, vocab]
        for (i, s) in stages.iter().enumerate() {
            out.insert(format!("seq{k}.stage{i}"), s.squeeze(0)?);
        }
        out.insert(format!("seq{k}.logits"), logits.squeeze(0)?);
    }
    candle_core::safetensors::save(&out, &a.out)
        .with_context(|| format!("--out {}", a.out.display()))?;
    Ok(())
}
