//! A sequence-classification reward model as a reward source (verl's `reward_model`): the
//! prompt's messages plus the response as an assistant turn, rendered with the reward model's own
//! chat template and tokenizer (so a reward model with another tokenizer than the actor's works,
//! as verl's `input_tokenizer` re-rendering does), scored by an HF `*ForSequenceClassification`
//! head (`score.weight`, label 0) at the last token; or a DeBERTa-v2/v3 encoder
//! (`DebertaV2ForSequenceClassification`) reading (prompt, response) as a text pair
//! ([`super::pair_source`]). No gradients; batched in micro-batches. Optional running
//! mean/std normalisation and clipping of the score.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::pair_source::{PairIds, PairScorer};
use super::python::CallError;
use super::ScoreRequest as Item;
use super::{RewardError, ScoreResult};
use crate::data::{ChatTemplate, TokenizerBundle};
use crate::model::config::RewardArch;
use crate::model::{CausalLm, ScoreHead};

/// Running mean and variance (Welford), for score normalisation; saved in checkpoints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RunningStats {
    pub count: f64,
    pub mean: f64,
    pub m2: f64,
}

impl RunningStats {
    pub fn push(&mut self, x: f64) {
        self.count += 1.0;
        let d = x - self.mean;
        self.mean += d / self.count;
        self.m2 += d * (x - self.mean);
    }

    /// Population standard deviation of everything pushed so far.
    pub fn std(&self) -> f64 {
        if self.count < 2.0 {
            0.0
        } else {
            (self.m2 / self.count).sqrt()
        }
    }
}

/// A causal LM with a score head, its tokenizer and chat template.
struct CausalScorer {
    model: CausalLm,
    /// Owns the weights the detached model reads.
    _varmap: VarMap,
    head: ScoreHead,
    tokenizer: TokenizerBundle,
    template: ChatTemplate,
}

enum Backend {
    Causal(Box<CausalScorer>),
    Pair(Box<PairScorer>),
}

/// One item as the backend reads it.
enum Encoded {
    Ids(Vec<u32>),
    Pair(PairIds),
}

pub struct RewardModel {
    backend: Backend,
    micro_batch_size: usize,
    pub normalize: Option<RunningStats>,
    clip: Option<f64>,
    prompt_key: String,
}

/// How a reward model source is set up.
pub struct RewardModelOptions<'a> {
    pub path: &'a str,
    pub device: &'a str,
    pub micro_batch_size: usize,
    pub normalize: bool,
    pub clip: Option<f64>,
    /// The dataset column with the chat messages (`data.prompt_key`).
    pub prompt_key: &'a str,
}

fn err(path: &str, e: impl std::fmt::Display) -> RewardError {
    RewardError::Config(format!("reward model {path}: {e}"))
}

impl CausalScorer {
    /// A causal LM backbone with its `score.weight` head, tokenizer and chat template.
    fn load(path: &str, dir: &Path, device: &Device) -> Result<Self, RewardError> {
        let (loaded, tokenizer) = crate::weights::load_model_and_tokenizer(
            path,
            None,
            &Map::new(),
            DType::F32,
            device,
            false,
        )
        .map_err(|e| err(path, e))?;
        let weights = crate::weights::hf::read_weights(dir).map_err(|e| err(path, e))?;
        let w = weights.get("score.weight").ok_or_else(|| {
            err(
                path,
                "no `score.weight` tensor: not a sequence-classification model (an LM or a base model cannot score)",
            )
        })?;
        let hidden = loaded.model.args.hidden_size;
        if w.dims().len() != 2 || w.dims()[1] != hidden {
            return Err(err(
                path,
                format!(
                    "`score.weight` has shape {:?}, expected [labels, {hidden}]",
                    w.dims()
                ),
            ));
        }
        let template = tokenizer.template(None).map_err(|e| err(path, e))?;
        Ok(Self {
            model: loaded.model.no_grad(),
            _varmap: loaded.varmap,
            head: ScoreHead::from_weight(
                w.to_dtype(DType::F32)
                    .and_then(|w| w.to_device(device))
                    .map_err(|e| err(path, e))?,
            ),
            tokenizer,
            template,
        })
    }

    /// Token ids of one prompt + response conversation in the reward model's template.
    fn encode(&self, item: &Item, prompt_key: &str) -> Result<Vec<u32>, String> {
        let mut messages: Vec<Value> = match item.row.get(prompt_key) {
            Some(Value::Array(m)) => m.clone(),
            Some(Value::String(s)) => vec![json!({"role": "user", "content": s})],
            _ => {
                return Err(format!(
                    "the row has no `{prompt_key}` chat messages to show the reward model"
                ))
            }
        };
        messages.push(json!({"role": "assistant", "content": item.solution_str}));
        let text = self.template.render(&messages, false, &Map::new())?;
        let ids = self.tokenizer.encode(&text)?;
        if ids.is_empty() {
            return Err("the conversation encodes to no tokens".into());
        }
        Ok(ids)
    }

    /// Raw scores (label 0) of `seqs`, left-padded in one forward pass.
    fn forward(&self, seqs: &[&Vec<u32>]) -> candle_core::Result<Vec<f64>> {
        let b = seqs.len();
        let width = seqs.iter().map(|s| s.len()).max().unwrap_or(1);
        let (mut ids, mut mask, mut pos) = (Vec::new(), Vec::new(), Vec::new());
        for s in seqs {
            let pad = width - s.len();
            ids.extend(std::iter::repeat_n(self.tokenizer.pad_token_id, pad));
            ids.extend_from_slice(s);
            mask.extend(std::iter::repeat_n(0u32, pad));
            mask.extend(std::iter::repeat_n(1u32, s.len()));
            pos.extend(std::iter::repeat_n(0u32, pad));
            pos.extend(0..s.len() as u32);
        }
        let dev = self.model.device();
        let ids = Tensor::from_vec(ids, (b, width), dev)?;
        let mask = Tensor::from_vec(mask, (b, width), dev)?;
        let pos = Tensor::from_vec(pos, (b, width), dev)?;
        let hidden = self.model.forward_hidden(&ids, &pos, &mask, None)?; // [b, width, h]
        let scores = self.head.forward(&hidden, &mask)?; // [b, labels]
        let first: Vec<f32> = scores
            .narrow(1, 0, 1)?
            .squeeze(1)?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec1()?;
        Ok(first.into_iter().map(f64::from).collect())
    }
}

impl RewardModel {
    /// Loads an HF directory holding a sequence-classification model: a causal LM with
    /// `score.weight`, or a DeBERTa-v2/v3 encoder; other architectures are refused by name.
    pub fn load(o: &RewardModelOptions) -> Result<Self, RewardError> {
        let device = crate::model::device(o.device).map_err(|e| err(o.path, e))?;
        let expanded = crate::util::expand_home(o.path);
        let dir = Path::new(&expanded);
        if !dir.is_dir() {
            return Err(err(
                o.path,
                "expected an HF directory of a *ForSequenceClassification model (config.json, model.safetensors with `score.weight`, tokenizer.json); GGUF files hold no score head",
            ));
        }
        let config = crate::weights::hf::read_config_json(dir).map_err(|e| err(o.path, e))?;
        let arch = crate::model::config::reward_arch_of(&config).map_err(|e| {
            err(
                o.path,
                format!("{}: {e}", dir.join("config.json").display()),
            )
        })?;
        let backend = match arch {
            RewardArch::DebertaV2 => Backend::Pair(Box::new(
                PairScorer::load(dir, &device).map_err(|e| err(o.path, e))?,
            )),
            RewardArch::Causal(_) => {
                Backend::Causal(Box::new(CausalScorer::load(o.path, dir, &device)?))
            }
        };
        Ok(Self {
            backend,
            micro_batch_size: o.micro_batch_size.max(1),
            normalize: o.normalize.then(RunningStats::default),
            clip: o.clip,
            prompt_key: o.prompt_key.to_string(),
        })
    }

    fn encode(&self, item: &Item) -> Result<Encoded, String> {
        match &self.backend {
            Backend::Causal(c) => c.encode(item, &self.prompt_key).map(Encoded::Ids),
            Backend::Pair(p) => {
                let prompt = PairScorer::prompt_text(&item.row, &self.prompt_key)?;
                p.encode(&prompt, &item.solution_str).map(Encoded::Pair)
            }
        }
    }

    fn forward(&self, items: &[&Encoded]) -> candle_core::Result<Vec<f64>> {
        match &self.backend {
            Backend::Causal(c) => {
                let seqs: Vec<&Vec<u32>> = items
                    .iter()
                    .filter_map(|e| match e {
                        Encoded::Ids(ids) => Some(ids),
                        Encoded::Pair(_) => None,
                    })
                    .collect();
                c.forward(&seqs)
            }
            Backend::Pair(p) => {
                let pairs: Vec<&PairIds> = items
                    .iter()
                    .filter_map(|e| match e {
                        Encoded::Pair(pair) => Some(pair),
                        Encoded::Ids(_) => None,
                    })
                    .collect();
                p.forward(&pairs)
            }
        }
    }

    /// Scores every item: raw scores in micro-batches, then normalisation and clipping.
    pub fn score(&mut self, items: &[Item]) -> Vec<Result<ScoreResult, CallError>> {
        let encoded: Vec<Result<Encoded, String>> = items.iter().map(|i| self.encode(i)).collect();
        let ok: Vec<usize> = (0..items.len()).filter(|&i| encoded[i].is_ok()).collect();
        let mut raw: Vec<Option<Result<f64, String>>> = vec![None; items.len()];
        for chunk in ok.chunks(self.micro_batch_size) {
            let seqs: Vec<&Encoded> = chunk
                .iter()
                .map(|&i| encoded[i].as_ref().expect("filtered"))
                .collect();
            match self.forward(&seqs) {
                Ok(s) => {
                    for (&i, v) in chunk.iter().zip(s) {
                        raw[i] = Some(Ok(v));
                    }
                }
                Err(e) => {
                    for &i in chunk {
                        raw[i] = Some(Err(format!("reward model forward pass failed: {e}")));
                    }
                }
            }
        }
        if let Some(stats) = self.normalize.as_mut() {
            for r in raw.iter().flatten().flatten() {
                stats.push(*r);
            }
        }
        let stats = self.normalize;
        (0..items.len())
            .map(|i| {
                let r = match (&encoded[i], raw[i].take()) {
                    (Err(e), _) => Err(e.clone()),
                    (_, Some(r)) => r,
                    (_, None) => Err("not scored".into()),
                };
                r.map(|x| {
                    let mut extra = Map::new();
                    extra.insert("rm_raw".into(), Value::from(x));
                    let mut s = x;
                    if let Some(st) = stats {
                        s = (s - st.mean) / (st.std() + 1e-8);
                    }
                    if let Some(c) = self.clip {
                        s = s.clamp(-c, c);
                    }
                    ScoreResult { score: s, extra }
                })
                .map_err(|message| CallError::Exception {
                    message,
                    traceback: String::new(),
                })
            })
            .collect()
    }
}
