//! The encoder side of a `type: model` reward source: a DeBERTa-v2/v3 sequence classifier
//! (`DebertaV2ForSequenceClassification`, as the OpenAssistant deberta-v3 reward models are)
//! reads (prompt, response) as a text pair, the way reward-model tutorials call transformers'
//! tokenizer, `tokenizer(prompt, response, truncation=True)`: the checkpoint's `tokenizer.json`
//! with its post-processor template (`[CLS] prompt [SEP] response [SEP]`, token types 0 then
//! 1), truncated longest-first to the tokenizer's `model_max_length`. Rows are padded on the
//! right, as transformers pads them; the score is logit 0 of the classifier on [CLS].
//!
//! The prompt is the row's `prompt_key` column: a string as it is, or chat messages, of which
//! the last `user` message's content is the prompt (an encoder reward model scores one
//! question and its answer, without a chat template).

use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::Value;
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use crate::model::deberta::DebertaV2Classifier;

/// A pair's token ids and token type ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairIds {
    pub ids: Vec<u32>,
    pub type_ids: Vec<u32>,
}

pub struct PairScorer {
    model: DebertaV2Classifier,
    tokenizer: Tokenizer,
    pad_id: u32,
    /// Tokens a pair is truncated to (special tokens included), when the tokenizer sets one.
    pub max_length: Option<usize>,
}

fn read_json(path: &Path) -> Result<Option<Value>, String> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| format!("{}: not valid JSON: {e}", path.display()))
}

/// A special token's text in `tokenizer_config.json` (a string or an added-token object).
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl PairScorer {
    /// The model, its tokenizer (truncating as transformers' `truncation=True` does) and its
    /// padding id, from an HF directory.
    pub fn load(dir: &Path, device: &Device) -> Result<Self, String> {
        let model = crate::weights::hf::load_deberta(dir, device).map_err(|e| e.to_string())?;
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(format!(
                "{}: no tokenizer.json (transformers writes it with the tokenizer's save_pretrained; a DeBERTa-v3 reward model needs its tokenizer to encode the pairs)",
                dir.display()
            ));
        }
        let mut tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| format!("{}: cannot load tokenizer: {e}", tok_path.display()))?;
        let tcfg_path = dir.join("tokenizer_config.json");
        let tcfg = read_json(&tcfg_path)?.unwrap_or(Value::Null);
        // transformers' tokenizers without model_max_length hold a huge number (1e30): no
        // truncation.
        let max_length = tcfg
            .get("model_max_length")
            .and_then(Value::as_f64)
            .filter(|m| (1.0..1e12).contains(m))
            .map(|m| m as usize);
        if let Some(max_length) = max_length {
            tokenizer
                .with_truncation(Some(TruncationParams {
                    max_length,
                    strategy: TruncationStrategy::LongestFirst,
                    stride: 0,
                    direction: TruncationDirection::Right,
                }))
                .map_err(|e| {
                    format!(
                        "{}: model_max_length {max_length}: {e}",
                        tcfg_path.display()
                    )
                })?;
        }
        let pad_id = token_text(tcfg.get("pad_token"))
            .and_then(|t| tokenizer.token_to_id(&t))
            .unwrap_or(model.config.pad_token_id);
        Ok(Self {
            model,
            tokenizer,
            pad_id,
            max_length,
        })
    }

    /// The prompt text of a dataset row (see the module docs).
    pub fn prompt_text(row: &Value, prompt_key: &str) -> Result<String, String> {
        match row.get(prompt_key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Array(messages)) => messages
                .iter()
                .rev()
                .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
                .and_then(|m| m.get("content"))
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| {
                    format!(
                        "the `{prompt_key}` messages hold no user message with a text content to show the reward model"
                    )
                }),
            _ => Err(format!(
                "the row has no `{prompt_key}` (a string or chat messages) to show the reward model"
            )),
        }
    }

    /// The ids and token types of (prompt, response) as transformers' pair encoding gives
    /// them (an empty response still makes a pair: `[CLS] prompt [SEP] [SEP]`).
    pub fn encode(&self, prompt: &str, response: &str) -> Result<PairIds, String> {
        let e = self
            .tokenizer
            .encode((prompt, response), true)
            .map_err(|e| format!("cannot tokenize the pair: {e}"))?;
        Ok(PairIds {
            ids: e.get_ids().to_vec(),
            type_ids: e.get_type_ids().to_vec(),
        })
    }

    /// Logit 0 of each pair (the score).
    pub fn forward(&self, pairs: &[&PairIds]) -> candle_core::Result<Vec<f64>> {
        Ok(self
            .logits(pairs)?
            .iter()
            .map(|row| f64::from(row[0]))
            .collect())
    }

    /// Every logit `[pairs][labels]`, the pairs right-padded into one forward pass.
    pub fn logits(&self, pairs: &[&PairIds]) -> candle_core::Result<Vec<Vec<f32>>> {
        let b = pairs.len();
        let width = pairs.iter().map(|p| p.ids.len()).max().unwrap_or(1).max(1);
        let mut ids = vec![self.pad_id; b * width];
        let mut types = vec![0u32; b * width];
        let mut mask = vec![0u32; b * width];
        for (r, p) in pairs.iter().enumerate() {
            let row = r * width;
            ids[row..row + p.ids.len()].copy_from_slice(&p.ids);
            types[row..row + p.ids.len()].copy_from_slice(&p.type_ids);
            mask[row..row + p.ids.len()].fill(1);
        }
        let dev = self.model.device();
        let logits = self.model.forward(
            &Tensor::from_vec(ids, (b, width), dev)?,
            &Tensor::from_vec(types, (b, width), dev)?,
            &Tensor::from_vec(mask, (b, width), dev)?,
        )?;
        logits.to_device(&Device::Cpu)?.to_vec2()
    }
}
