//! Batched generation with a KV cache: left-padded prompts in, sampled responses out, with the
//! log-probability of each sampled token and why each row stopped. Rows that finish leave the
//! batch (their cache rows are dropped), so they stop costing compute.
//!
//! Sampling follows vLLM semantics: temperature, then top-k, then top-p (nucleus) on the
//! remaining probabilities; temperature 0 decodes greedily. As in verl's agent loop, the
//! temperature alone decides: `do_sample` is accepted in the config but never read here (verl
//! passes only temperature, top-k and top-p to its rollout engine).

pub mod agent;
pub mod scheduler;
pub mod tool_parser;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

pub use scheduler::{generate_all, Limits};

use crate::config::{RolloutConfig, SamplingConfig};
use crate::kernels::elem::exp_f32;
use crate::model::vision::{padded_positions, row_features, Images};
use crate::model::{CausalLm, KvCache};

/// How tokens are chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub greedy: bool,
    pub temperature: f64,
    /// Keep the k most likely tokens (`None` = all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches p.
    pub top_p: f64,
    pub max_new_tokens: usize,
    pub eos_ids: Vec<u32>,
    /// Keep generating after EOS, up to max_new_tokens.
    pub ignore_eos: bool,
    /// How many sequences and how much key/value memory generation may hold at once.
    pub limits: Limits,
}

impl SamplingParams {
    fn from_parts(
        temperature: f64,
        top_k: i64,
        top_p: f64,
        max_new_tokens: usize,
        eos_ids: &[u32],
        ignore_eos: bool,
    ) -> Self {
        Self {
            greedy: temperature <= 0.0,
            temperature,
            top_k: if top_k > 0 {
                Some(top_k as usize)
            } else {
                None
            },
            top_p,
            max_new_tokens,
            eos_ids: eos_ids.to_vec(),
            ignore_eos,
            limits: Limits::default(),
        }
    }

    /// Training rollouts (`actor_rollout_ref.rollout.*`).
    pub fn train(r: &RolloutConfig, max_new_tokens: usize, eos_ids: &[u32]) -> Self {
        Self::from_parts(
            r.temperature,
            r.top_k,
            r.top_p,
            max_new_tokens,
            eos_ids,
            r.ignore_eos,
        )
        .with_limits(r)
    }

    /// Validation (`rollout.val_kwargs`, with the rollout's `ignore_eos` and limits).
    pub fn validation(r: &RolloutConfig, max_new_tokens: usize, eos_ids: &[u32]) -> Self {
        let v: &SamplingConfig = &r.val_kwargs;
        Self::from_parts(
            v.temperature,
            v.top_k,
            v.top_p,
            max_new_tokens,
            eos_ids,
            r.ignore_eos,
        )
        .with_limits(r)
    }

    /// `rollout.max_num_seqs`, `max_num_batched_tokens`, `kv_cache_memory_gb` and
    /// `gpu_memory_utilization`.
    fn with_limits(mut self, r: &RolloutConfig) -> Self {
        self.limits = Limits {
            max_num_seqs: r.max_num_seqs.max(1),
            max_num_batched_tokens: r.max_num_batched_tokens.max(1),
            kv_cache_bytes: (r.kv_cache_memory_gb.max(0.0) * 1e9) as usize,
            gpu_memory_utilization: r.gpu_memory_utilization,
        };
        self
    }
}

/// Why a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// An EOS token was sampled (it is the response's last token).
    Eos,
    /// `max_new_tokens` were generated.
    Length,
}

/// Generated responses, one per prompt row.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    /// Sampled tokens, EOS included when it ended the row.
    pub responses: Vec<Vec<u32>>,
    /// Log-probability of each sampled token under the distribution it was sampled from:
    /// `log_softmax(logits / temperature)` over the full vocabulary (before top-k/top-p), the
    /// quantity the trainer recomputes as old log-probs; greedy rows use temperature 1.
    pub log_probs: Vec<Vec<f32>>,
    pub stop: Vec<StopReason>,
}

/// The sampler's random state: a seed and a position in its stream, so a checkpoint can resume
/// the exact sequence of draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SamplerState {
    pub seed: u64,
    pub word_pos: u128,
}

/// A seeded sampler RNG.
pub struct Sampler {
    rng: ChaCha8Rng,
    seed: u64,
}

/// The random streams of one generation call: row `i` samples from ChaCha stream `i` of a seed
/// drawn once from the [`Sampler`], so what a row draws depends on the sampler's position and
/// the row's index only — not on which rows share its batch, nor on the scheduler's limits.
/// With data parallelism each rank generates a slice of the step's rows: `first` is the global
/// index of its first row, so a row draws the same numbers whatever the number of ranks.
pub struct RowStreams {
    seed: u64,
    first: usize,
}

impl RowStreams {
    pub fn rng(&self, row: usize) -> ChaCha8Rng {
        let mut r = ChaCha8Rng::seed_from_u64(self.seed);
        r.set_stream((self.first + row) as u64);
        r
    }

    /// The same streams, with local row 0 being global row `first`.
    pub fn starting_at(self, first: usize) -> Self {
        Self { first, ..self }
    }
}

impl Sampler {
    /// Starts a generation call (advances the sampler by one draw).
    pub fn rows(&mut self) -> RowStreams {
        RowStreams {
            seed: self.rng.next_u64(),
            first: 0,
        }
    }

    pub fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            seed,
        }
    }
    pub fn state(&self) -> SamplerState {
        SamplerState {
            seed: self.seed,
            word_pos: self.rng.get_word_pos(),
        }
    }
    pub fn restore(s: SamplerState) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(s.seed);
        rng.set_word_pos(s.word_pos);
        Self { rng, seed: s.seed }
    }
}

/// One term `e^(l/t − m)` of the sampler's normaliser: the argument in f32, the exponential
/// by [`exp_f32`] (within 2 ulp of the exact one; a libm call per vocabulary entry was 6 % of
/// generating with a 151,936-token vocabulary), widened to f64 for the sums.
#[inline(always)]
fn exp_term(l: f32, t: f32, m: f32) -> f64 {
    exp_f32(l / t - m) as f64
}

/// `Σ_i e^(l_i/t − m)`, the terms as [`exp_term`], accumulated in 16 f64 lanes at the CPU's
/// vector width. In f64 because summed in f32 every term below half an ulp of the running
/// total (≈ 6e-8 once the top token's 1 is in) is lost, which over 49,152 terms biased
/// SmolLM2's log-probs by up to ~2e-4. [`sum_exp_reference`] is the same sum one libm `exp` at a
/// time.
pub fn sum_exp(logits: &[f32], t: f32, m: f32) -> f64 {
    crate::kernels::simd::vectorized(
        #[inline(always)]
        || {
            let mut lanes = [0f64; 16];
            let chunks = logits.chunks_exact(16);
            let tail: f64 = chunks.remainder().iter().map(|&l| exp_term(l, t, m)).sum();
            for c in chunks {
                // The 16 exponentials in f32 first (one vector), then widened and added.
                let mut e = [0f32; 16];
                for (e, &l) in e.iter_mut().zip(c) {
                    *e = exp_f32(l / t - m);
                }
                for (s, &e) in lanes.iter_mut().zip(&e) {
                    *s += e as f64;
                }
            }
            lanes.iter().sum::<f64>() + tail
        },
    )
}

/// [`sum_exp`] with f64 exponentials, one at a time (the reference it is tested and benchmarked
/// against, `cargo bench --bench sampler`).
pub fn sum_exp_reference(logits: &[f32], t: f32, m: f32) -> f64 {
    logits.iter().map(|&l| ((l / t - m) as f64).exp()).sum()
}

/// Chooses a token from one row of logits; returns (token, its log-prob under
/// `softmax(logits / temperature)`, temperature 1 when greedy).
pub fn sample_row(logits: &[f32], p: &SamplingParams, rng: &mut ChaCha8Rng) -> (u32, f32) {
    let t = if p.greedy || p.temperature <= 0.0 {
        1.0
    } else {
        p.temperature as f32
    };
    // The largest logit (NaNs ignored, as `f32::max` does), in 16 lanes at vector width.
    let top = crate::kernels::simd::vectorized(
        #[inline(always)]
        || crate::kernels::elem::max(logits),
    );
    let max = top / t;
    let sum = sum_exp(logits, t, max);
    let lse = max as f64 + sum.ln();
    let pick = if p.greedy {
        // First maximum (lowest id) on ties: the first entry equal to the largest (a row that
        // starts with NaN picks 0, as a scan keeping the first of strictly larger entries does).
        match logits[0].is_nan() {
            true => 0,
            false => logits.iter().position(|&l| l == top).unwrap_or(0),
        }
    } else {
        let filtering = p.top_k.is_some_and(|k| k < logits.len()) || p.top_p < 1.0;
        if !filtering {
            // The whole distribution: two passes over the logits, no allocation; the same
            // probabilities and cumulative order as the general path below. `max` above is
            // max(l / t) (division by t > 0 keeps the order, also after rounding).
            let (m, total) = (max, sum);
            let u: f64 = rng.random();
            let mut acc = 0.0;
            let mut chosen = logits.len() - 1;
            for (i, &l) in logits.iter().enumerate() {
                acc += exp_term(l, t, m) / total;
                if u < acc {
                    chosen = i;
                    break;
                }
            }
            return (chosen as u32, ((logits[chosen] / t) as f64 - lse) as f32);
        }
        let mut cand: Vec<(usize, f32)> = logits.iter().map(|&l| l / t).enumerate().collect();
        if filtering {
            cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            if let Some(k) = p.top_k {
                cand.truncate(k.max(1));
            }
        }
        let m = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 - m) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, x) in probs.iter().enumerate() {
                acc += x;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
            probs.truncate(keep);
            let t: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= t);
        }
        let u: f64 = rng.random();
        let mut acc = 0.0;
        let mut chosen = cand[cand.len() - 1].0;
        for (c, pr) in cand.iter().zip(&probs) {
            acc += pr;
            if u < acc {
                chosen = c.0;
                break;
            }
        }
        chosen
    };
    (pick as u32, ((logits[pick] / t) as f64 - lse) as f32)
}

/// One token per row of `logits` `[rows, vocab]` for the batch rows `active` (row `active[i]`
/// of `rngs` draws for logits row `i`), as [`sample_row`] chooses them. On a GPU the rows are
/// sampled where the logits are (`kernels::cuda::sample_rows`, the same rule with the same
/// uniforms) and only (token, log-prob) pairs come back; elsewhere each row is copied to the
/// host and sampled there.
fn sample_rows(
    logits: &Tensor,
    active: &[usize],
    p: &SamplingParams,
    rngs: &mut [ChaCha8Rng],
) -> candle_core::Result<Vec<(u32, f32)>> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        use crate::kernels::cuda::{sample_rows, RowSampling};
        // One uniform per sampled token, drawn exactly where `sample_row` draws it.
        let u: Vec<f64> = active
            .iter()
            .map(|&r| match p.greedy {
                true => 0.0,
                false => rngs[r].random(),
            })
            .collect();
        let s = RowSampling {
            greedy: p.greedy,
            temperature: p.temperature as f32,
            top_k: p.top_k.map_or(0, |k| k.clamp(1, u32::MAX as usize) as u32),
            top_p: p.top_p,
        };
        let (tokens, lps) = sample_rows(&logits.to_dtype(DType::F32)?, s, &u)?;
        return Ok(tokens.into_iter().zip(lps).collect());
    }
    let host: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_vec2()?;
    // Rows in parallel, each with its own generator (taken out and put back: the same draws as
    // one row after another).
    let mut mine: Vec<ChaCha8Rng> = active.iter().map(|&r| rngs[r].clone()).collect();
    let picks = mine
        .par_iter_mut()
        .zip(host.par_iter())
        .map(|(rng, row)| sample_row(row, p, rng))
        .collect();
    for (&r, rng) in active.iter().zip(mine) {
        rngs[r] = rng;
    }
    Ok(picks)
}

/// Each dataset row of `prompts` `n` times in a row (the rows of one prompt's group together).
pub fn repeat_rows(prompts: &[usize], n: usize) -> Vec<usize> {
    prompts
        .iter()
        .flat_map(|&i| std::iter::repeat_n(i, n.max(1)))
        .collect()
}

impl Rollout {
    fn empty(rows: usize) -> Self {
        Rollout {
            responses: vec![Vec::new(); rows],
            log_probs: vec![Vec::new(); rows],
            stop: vec![StopReason::Length; rows],
        }
    }
}

/// Generates for dataset rows `rows` of `ds` through the scheduler ([`generate_all`]), which
/// pads only where a device needs it (with 0s it masks out).
pub fn generate_rows(
    model: &CausalLm,
    ds: &crate::data::PromptDataset,
    rows: &[usize],
    p: &SamplingParams,
    sampler: &mut Sampler,
) -> candle_core::Result<Rollout> {
    generate_rows_from(model, ds, rows, p, sampler, 0)
}

/// [`generate_rows`] for a slice of a step's rows whose first is global row `first_row` (a
/// data-parallel rank's share): row `i` samples from stream `first_row + i`.
pub fn generate_rows_from(
    model: &CausalLm,
    ds: &crate::data::PromptDataset,
    rows: &[usize],
    p: &SamplingParams,
    sampler: &mut Sampler,
    first_row: usize,
) -> candle_core::Result<Rollout> {
    generate_dataset_rows(
        model,
        ds,
        rows,
        p,
        sampler.rows().starting_at(first_row),
        None,
    )
}

/// Generates dataset rows `rows` of `ds` with their images through the scheduler, row `i`
/// from stream `i` of `streams`, ticking `progress` as rows finish (`main_ppo generate`).
pub fn generate_dataset_rows(
    model: &CausalLm,
    ds: &crate::data::PromptDataset,
    rows: &[usize],
    p: &SamplingParams,
    streams: RowStreams,
    progress: Option<&indicatif::ProgressBar>,
) -> candle_core::Result<Rollout> {
    let prompts = prompt_slices(ds, rows);
    let images = dataset_images(ds, rows, model.device())?;
    let out = scheduler::generate_turns(model, &prompts, p, streams, progress, None, &images)?;
    Ok(out.0)
}

/// The images of dataset rows `rows` as the model takes them, on `device`: one shared value
/// per dataset row (a group's rows encode it once); empty when the dataset has none.
pub fn dataset_images(
    ds: &crate::data::PromptDataset,
    rows: &[usize],
    device: &Device,
) -> candle_core::Result<Vec<Option<Arc<Images>>>> {
    if ds.images.is_empty() {
        return Ok(Vec::new());
    }
    let mut made: std::collections::HashMap<usize, Arc<Images>> = Default::default();
    let mut out = Vec::with_capacity(rows.len());
    for &i in rows {
        let Some(b) = ds.images.get(i).and_then(Option::as_ref) else {
            out.push(None);
            continue;
        };
        if let Some(im) = made.get(&i) {
            out.push(Some(im.clone()));
            continue;
        }
        let n = b.num_patches();
        let pixels = Tensor::from_slice(&b.pixel_values, (n, b.patch_dim), device)?;
        let im = Arc::new(Images {
            pixels,
            grids: b.grid_thw.clone(),
        });
        made.insert(i, im.clone());
        out.push(Some(im));
    }
    Ok(out)
}

/// The prompt ids of dataset rows `rows`.
fn prompt_slices<'a>(ds: &'a crate::data::PromptDataset, rows: &[usize]) -> Vec<&'a [u32]> {
    rows.iter().map(|&i| ds.prompt_ids[i].as_slice()).collect()
}

/// Generates for dataset rows `rows` of `ds` (global rows from `first_row`), running each
/// row's conversation through the agent loop (`convs`: one per row); returns the rollout and
/// each row's episode (its response mask, turns and tool calls).
#[allow(clippy::too_many_arguments)]
pub fn generate_agent_rows(
    model: &CausalLm,
    ds: &crate::data::PromptDataset,
    rows: &[usize],
    p: &SamplingParams,
    sampler: &mut Sampler,
    first_row: usize,
    ctx: &agent::AgentContext,
    convs: Vec<agent::Conversation>,
) -> candle_core::Result<(Rollout, Vec<agent::Episode>)> {
    let prompts = prompt_slices(ds, rows);
    let owned: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    let mut agent = agent::ToolAgent::new(ctx, convs, owned, p.max_new_tokens, p.eos_ids.clone());
    let streams = sampler.rows().starting_at(first_row);
    let images = dataset_images(ds, rows, model.device())?;
    if images.iter().any(Option::is_some) {
        candle_core::bail!(
            "the tool agent loop does not run rows with images (a multi-turn rollout re-reads its responses, where sampled placeholder tokens would be taken for images); run those rows with the single-turn agent"
        );
    }
    let (mut out, _) =
        scheduler::generate_turns(model, &prompts, p, streams, None, Some(&mut agent), &images)?;
    let episodes = agent.finish(&mut out);
    Ok((out, episodes))
}

/// Generates for a left-padded batch: `input_ids`, `attention_mask` (1 real / 0 pad), both
/// `[batch, width]` row-major, as one padded batch through the tensor composition (the
/// reference the scheduler's packed path is tested against). Row `i` samples from stream `i` of
/// this call, as in [`generate_all`].
pub fn generate(
    model: &CausalLm,
    input_ids: &[u32],
    attention_mask: &[u8],
    batch: usize,
    width: usize,
    p: &SamplingParams,
    sampler: &mut Sampler,
) -> candle_core::Result<Rollout> {
    let streams = sampler.rows();
    let mut rngs: Vec<ChaCha8Rng> = (0..batch).map(|r| streams.rng(r)).collect();
    generate_with(
        model,
        input_ids,
        attention_mask,
        batch,
        width,
        p,
        &mut rngs,
        &[],
    )
}

/// [`generate`] with one random stream per row, and each row's images (`images` empty: none;
/// else one entry per row) encoded once per distinct [`Images`] and placed over its
/// placeholders, with the rows' multimodal rotary positions.
#[allow(clippy::too_many_arguments)]
fn generate_with(
    model: &CausalLm,
    input_ids: &[u32],
    attention_mask: &[u8],
    batch: usize,
    width: usize,
    p: &SamplingParams,
    rngs: &mut [ChaCha8Rng],
    images: &[Option<Arc<Images>>],
) -> candle_core::Result<Rollout> {
    // Generation needs no gradient: a detached view keeps no activations alive.
    let model = &model.no_grad();
    let dev = model.device().clone();
    let mut rollout = Rollout::empty(batch);
    if batch == 0 || p.max_new_tokens == 0 {
        return Ok(rollout);
    }
    let u32s = |v: Vec<u32>, shape: (usize, usize)| {
        Tensor::from_vec(v, shape, &Device::Cpu).and_then(|t| t.to_device(&dev))
    };
    let prompt_len: Vec<usize> = (0..batch)
        .map(|r| {
            attention_mask[r * width..(r + 1) * width]
                .iter()
                .filter(|&&m| m == 1)
                .count()
        })
        .collect();
    let (positions, deltas, features) = match images.iter().any(Option::is_some) {
        true => {
            let rows: Vec<&[u32]> = (0..batch)
                .map(|r| &input_ids[r * width + width - prompt_len[r]..(r + 1) * width])
                .collect();
            let ims: Vec<Option<&Images>> = images.iter().map(Option::as_deref).collect();
            let (pos, deltas) = padded_positions(&model.args, &rows, &ims, width)
                .map_err(candle_core::Error::Msg)?;
            let pos = Tensor::from_vec(pos, (3, batch, width), &Device::Cpu)?.to_device(&dev)?;
            (pos, deltas, row_features(model, images)?)
        }
        false => {
            let mut positions = Vec::with_capacity(batch * width);
            for &len in &prompt_len {
                positions.extend(std::iter::repeat_n(0u32, width - len));
                positions.extend(0..len as u32);
            }
            (u32s(positions, (batch, width))?, vec![0; batch], None)
        }
    };
    let mut masks: Vec<Vec<u32>> = (0..batch)
        .map(|r| {
            attention_mask[r * width..(r + 1) * width]
                .iter()
                .map(|&m| m as u32)
                .collect()
        })
        .collect();
    // Room for every position at once: the cache never grows (a copy of the past) mid-call.
    let mut cache = KvCache::with_capacity(model.args.num_hidden_layers, width + p.max_new_tokens);
    let hidden = model.forward_hidden_images(
        &u32s(input_ids.to_vec(), (batch, width))?,
        &positions,
        &u32s(masks.concat(), (batch, width))?,
        features.as_ref(),
        Some(&mut cache),
    )?;
    let mut last = hidden.narrow(1, width - 1, 1)?.squeeze(1)?.detach(); // [active, hidden]
    let mut active: Vec<usize> = (0..batch).collect();
    for step in 0..p.max_new_tokens {
        let logits = model.logits(&last.unsqueeze(1)?)?.squeeze(1)?; // [active, vocab]
        let picks = sample_rows(&logits, &active, p, rngs)?;
        let mut next = Vec::with_capacity(active.len());
        let mut still = Vec::with_capacity(active.len());
        for (slot, &row) in active.iter().enumerate() {
            let (tok, lp) = picks[slot];
            rollout.responses[row].push(tok);
            rollout.log_probs[row].push(lp);
            if !p.ignore_eos && p.eos_ids.contains(&tok) {
                rollout.stop[row] = StopReason::Eos;
            } else if step + 1 < p.max_new_tokens {
                still.push(slot);
                next.push(tok);
            }
        }
        if still.is_empty() {
            break;
        }
        if still.len() < active.len() {
            let keep = Tensor::from_vec(
                still.iter().map(|&s| s as u32).collect::<Vec<u32>>(),
                still.len(),
                &Device::Cpu,
            )?
            .to_device(&dev)?;
            cache.select_rows(&keep)?;
        }
        active = still.iter().map(|&s| active[s]).collect();
        let n = active.len();
        // After the prompt every position axis counts on alike, shifted by the row's delta.
        let pos: Vec<u32> = active
            .iter()
            .map(|&r| ((prompt_len[r] + step) as i64 + deltas[r]) as u32)
            .collect();
        for &r in &active {
            masks[r].push(1);
        }
        let key_mask: Vec<u32> = active
            .iter()
            .flat_map(|&r| masks[r].iter().copied())
            .collect();
        let w = masks[active[0]].len();
        let h = model.forward_hidden(
            &u32s(next, (n, 1))?,
            &u32s(pos, (n, 1))?,
            &u32s(key_mask, (n, w))?,
            Some(&mut cache),
        )?;
        last = h.squeeze(1)?.detach();
    }
    Ok(rollout)
}

#[cfg(test)]
mod tests;
