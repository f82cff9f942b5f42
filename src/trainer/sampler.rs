//! verl's custom sampler in the trainer: building it over the training data (`reward::sampler`'s
//! Python worker, handed to the loader) and the step's data its `update(batch=...)` receives.
//!
//! verl calls a curriculum sampler's `update` with the step's `DataProto` after the step's
//! metrics; here it is called once the models are updated, before validation and the
//! checkpoint, so that a checkpoint holds the sampler as the next step finds it (verl saves
//! first: its checkpoint misses that step's update). What `update` receives is
//! [`update_payload`]: the tensors verl's batch holds at that point, the non-tensor columns
//! (the dataset items repeated per response, `uid`) and `meta_info`.

use base64::Engine;
use serde_json::{json, Map, Value};

use super::batch::{Column, StepBatch};
use super::{Result, TrainerError};
use crate::config::Config;
use crate::data::{BatchLoader, PromptDataset, Sample};
use crate::reward::sampler::{PySampler, SamplerSpec};

/// The training loader: `sampler`'s order when `data.sampler.class_path` built one (see
/// [`build`]), else the seeded shuffle of `data.shuffle` (`seed`).
pub fn loader(
    cfg: &Config,
    train_len: usize,
    batch_size: usize,
    seed: u64,
    sampler: Option<PySampler>,
    world_size: usize,
) -> Result<BatchLoader> {
    match sampler {
        None => Ok(BatchLoader::new(train_len, batch_size, cfg.data.shuffle, seed)),
        Some(_) if world_size > 1 => Err(TrainerError::Other(format!(
            "data.sampler.class_path with {world_size} data-parallel ranks is not implemented: each rank would run its own sampler; train on one process"
        ))),
        Some(s) => Ok(BatchLoader::with_sampler(train_len, batch_size, Box::new(s))),
    }
}

/// The sampler of `data.sampler.class_path` over `train`'s rows (`None` without one), built
/// with the datasets so that `len(sampler)` sets the steps of an epoch (as verl's
/// `len(train_dataloader)`) and a class that does not load fails before training. Its
/// `data_config` is the resolved `data` section (the keys main_ppo reads; verl's keys without
/// effect here are not in it).
pub fn build(cfg: &Config, train: &[Sample]) -> Result<Option<PySampler>> {
    let s = &cfg.data.sampler;
    let (Some(class_path), Some(class_name)) = (&s.class_path, &s.class_name) else {
        return Ok(None);
    };
    let data_config = serde_json::to_value(&cfg.data)
        .map_err(|e| TrainerError::Other(format!("data section: {e}")))?;
    let spec = SamplerSpec {
        class_path: crate::util::expand_home(class_path),
        class_name: class_name.clone(),
        python: cfg.reward.python.clone(),
        data_config,
    };
    let prompt_key = &cfg.data.prompt_key;
    let rows = train.iter().map(|s| s.dataset_item(prompt_key)).collect();
    Ok(Some(PySampler::start(&spec, rows)?))
}

impl super::Trainer {
    /// A curriculum sampler's `update(batch=...)` after step `step` (nothing otherwise); an
    /// error names the class and the step.
    pub(super) fn update_sampler(&mut self, batch: &StepBatch, step: u64) -> Result<()> {
        if !self
            .loader
            .sampler_info()
            .is_some_and(|(_, curriculum)| curriculum)
        {
            return Ok(());
        }
        let payload = update_payload(
            batch,
            &self.train,
            &self.cfg.data.prompt_key,
            self.tokenizer.pad_token_id,
            step,
            self.cfg.actor_rollout_ref.rollout.temperature,
        );
        Ok(self.loader.update_sampler(step, &payload)?)
    }
}

/// One tensor for the worker: little-endian values, base64, with dtype and shape.
fn tensor(dtype: &str, shape: [usize; 2], bytes: Vec<u8>) -> Value {
    let data = base64::engine::general_purpose::STANDARD.encode(bytes);
    json!({"dtype": dtype, "shape": shape, "data": data})
}

fn ints(rows: &[Vec<i32>], width: usize) -> Value {
    let mut bytes = Vec::with_capacity(rows.len() * width * 4);
    for r in rows {
        debug_assert_eq!(r.len(), width);
        r.iter().for_each(|v| bytes.extend(v.to_le_bytes()));
    }
    tensor("int32", [rows.len(), width], bytes)
}

/// A per-token column, each row right-padded with 0 to `width` (verl's response tensors).
fn floats(rows: &[Vec<f32>], width: usize) -> Value {
    let mut bytes = Vec::with_capacity(rows.len() * width * 4);
    for r in rows {
        for t in 0..width {
            bytes.extend(r.get(t).copied().unwrap_or(0.0).to_le_bytes());
        }
    }
    tensor("float32", [rows.len(), width], bytes)
}

/// What `update(batch=...)` receives after step `step`, shaped as verl's `DataProto` then:
/// - `batch`: `prompts` (left-padded with `pad`), `responses` (right-padded), `input_ids`,
///   `attention_mask`, `position_ids` (`[rows, prompt + response]`), `response_mask`, and each
///   per-token column the step filled (`token_level_scores`, `token_level_rewards`,
///   `advantages`, `returns`, `old_log_probs`, `ref_log_prob`, `values`, ...), `[rows, response]`
///   with 0 past a response's end; integers as int64, the rest float32;
/// - `non_tensor_batch`: each dataset item's columns (`data_source`, `reward_model`,
///   `extra_info`, `index`, `raw_prompt`, ...) repeated for the row's responses, and `uid`
///   (the group id as a string);
/// - `meta_info`: `global_steps`, `temperature`, `global_token_num` (tokens of each row).
pub fn update_payload(
    batch: &StepBatch,
    train: &PromptDataset,
    prompt_key: &str,
    pad: u32,
    step: u64,
    temperature: f64,
) -> Value {
    let rows = batch.len();
    let p = batch.prompts.iter().map(Vec::len).max().unwrap_or(0);
    let r = batch.max_response_len();
    let pad = pad as i32;
    let (mut prompts, mut responses, mut input_ids) = (Vec::new(), Vec::new(), Vec::new());
    let (mut attention, mut positions, mut mask) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..rows {
        let (pr, re) = (&batch.prompts[i], &batch.responses[i]);
        let mut prompt = vec![pad; p - pr.len()];
        prompt.extend(pr.iter().map(|&t| t as i32));
        let mut response: Vec<i32> = re.iter().map(|&t| t as i32).collect();
        response.resize(r, pad);
        let mut att = vec![0; p - pr.len()];
        att.resize(p + re.len(), 1);
        att.resize(p + r, 0);
        let mut pos: Vec<i32> = vec![0; p - pr.len()];
        let real = (pr.len() + re.len()) as i32;
        pos.extend(0..real);
        // Padding after the response continues the count, as verl's position_ids do.
        let last = real.max(1) - 1;
        pos.extend((1..=(p + r - pos.len()) as i32).map(|k| last + k));
        let m: Vec<i32> = (0..r)
            .map(|t| i32::from(batch.token_in_update(i, t)))
            .collect();
        input_ids.push([prompt.as_slice(), response.as_slice()].concat());
        prompts.push(prompt);
        responses.push(response);
        attention.push(att);
        positions.push(pos);
        mask.push(m);
    }
    let mut tensors = Map::new();
    tensors.insert("prompts".into(), ints(&prompts, p));
    tensors.insert("responses".into(), ints(&responses, r));
    tensors.insert("input_ids".into(), ints(&input_ids, p + r));
    tensors.insert("attention_mask".into(), ints(&attention, p + r));
    tensors.insert("position_ids".into(), ints(&positions, p + r));
    tensors.insert("response_mask".into(), ints(&mask, r));
    for c in Column::ALL {
        if c == Column::ResponseMask || !batch.has(c) {
            continue;
        }
        if let Ok(values) = batch.column(c) {
            tensors.insert(c.name().into(), floats(values, r));
        }
    }
    let mut columns: Map<String, Value> = Map::new();
    for (i, &sample) in batch.sample.iter().enumerate() {
        let item = train.samples[sample].dataset_item(prompt_key);
        for (k, v) in item.as_object().into_iter().flatten() {
            let col = columns
                .entry(k.clone())
                .or_insert_with(|| Value::Array(vec![Value::Null; rows]));
            col[i] = v.clone();
        }
    }
    columns.insert(
        "uid".into(),
        Value::Array(batch.uid.iter().map(|u| json!(u.to_string())).collect()),
    );
    let tokens: Vec<usize> = (0..rows).map(|i| batch.seq_len(i)).collect();
    json!({
        "step": step,
        "batch": tensors,
        "non_tensor_batch": columns,
        "meta_info": {"global_steps": step, "temperature": temperature, "global_token_num": tokens},
    })
}
