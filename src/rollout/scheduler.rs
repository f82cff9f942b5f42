//! Continuous batching with bounded memory (what vLLM's scheduler does for verl's rollouts).
//!
//! Every generation — training rollouts, validation, ReMax baselines, `main_ppo generate` — goes
//! through [`generate_all`]: prompts wait in a queue; at each model step the waiting ones enter
//! while fewer than `max_num_seqs` sequences are in flight and their key/value memory fits the
//! budget (each sequence reserves its prompt plus `max_new_tokens` positions when it enters, so
//! the budget can never be overrun mid-flight); a finished sequence leaves at once and frees its
//! room for the next. Entering prompts are prefilled in the same step as the running sequences
//! decode (at most `max_num_batched_tokens` prompt tokens per step).
//!
//! Results do not depend on the limits: each row samples from its own random stream (see
//! [`RowStreams`](super::RowStreams)) and its math never sees another row, so one-by-one and
//! fully batched generation give the same tokens (up to floating-point summation order).
//!
//! On the CPU with f32/f64 weights the steps run on [`crate::model::decode::Packed`] (ragged
//! batches, per-sequence caches). Other devices and dtypes run the tensor composition in waves:
//! up to `max_num_seqs` rows that fit the budget are generated together as one padded batch,
//! then the next wave.

use std::collections::VecDeque;
use std::sync::Arc;

use candle_core::Result;
use indicatif::ProgressBar;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::{generate_with, sample_row, Rollout, RowStreams, Sampler, SamplingParams, StopReason};
use crate::kernels::elem::{Elem, KvElem};
use crate::model::decode::{self, Decoder, Packed, SeqCache};
use crate::model::vision::Images;
use crate::model::{CausalLm, ModelArgs};

/// How much generation may hold at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Sequences in flight at most (`rollout.max_num_seqs`).
    pub max_num_seqs: usize,
    /// Prompt tokens prefilled in one step at most (`rollout.max_num_batched_tokens`); a single
    /// longer prompt is prefilled alone.
    pub max_num_batched_tokens: usize,
    /// Key/value cache bytes of the sequences in flight at most (`rollout.kv_cache_memory_gb`).
    /// A single sequence larger than the budget still runs, alone.
    pub kv_cache_bytes: usize,
    /// On CUDA the budget is instead this share of the GPU's memory less what the process
    /// holds there when generation starts (`rollout.gpu_memory_utilization`).
    pub gpu_memory_utilization: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_num_seqs: 1024,
            max_num_batched_tokens: 8192,
            kv_cache_bytes: 2 << 30,
            gpu_memory_utilization: 0.5,
        }
    }
}

/// What a call held at its fullest (for tests and the debug log).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Most sequences in flight at once.
    pub peak_seqs: usize,
    /// Most key/value bytes reserved at once.
    pub peak_kv_bytes: usize,
    /// Model steps run.
    pub steps: usize,
}

/// Generates a response to each of `prompts` (token ids, unpadded, non-empty) under
/// `p.limits`; `progress` advances by one per finished row.
pub fn generate_all(
    model: &CausalLm,
    prompts: &[&[u32]],
    p: &SamplingParams,
    sampler: &mut Sampler,
    progress: Option<&ProgressBar>,
) -> Result<Rollout> {
    Ok(generate_all_with_stats(model, prompts, p, sampler, progress)?.0)
}

/// [`generate_all`], also returning how much it held at once.
pub fn generate_all_with_stats(
    model: &CausalLm,
    prompts: &[&[u32]],
    p: &SamplingParams,
    sampler: &mut Sampler,
    progress: Option<&ProgressBar>,
) -> Result<(Rollout, Stats)> {
    generate_with_streams(model, prompts, p, sampler.rows(), progress)
}

/// [`generate_all_with_stats`] with the random streams of the call given.
pub fn generate_with_streams(
    model: &CausalLm,
    prompts: &[&[u32]],
    p: &SamplingParams,
    streams: RowStreams,
    progress: Option<&ProgressBar>,
) -> Result<(Rollout, Stats)> {
    generate_turns(model, prompts, p, streams, progress, None, &[])
}

/// Multi-turn generation: what happens between a row's turns (the agent loop implements it).
/// A row's response is every turn's tokens with what [`Turns::ready`] appended between them;
/// the whole response stays within `max_new_tokens`.
pub trait Turns {
    /// Row `row` stopped (EOS, or its response reached `max_new_tokens`); `out` holds its
    /// response so far. `true`: the row waits for a continuation from [`Turns::ready`]
    /// (keeping its cache); `false`: it is finished.
    fn turn_ended(&mut self, row: usize, out: &Rollout) -> bool;
    /// Continuations of waiting rows: `(row, Some(tokens))` appends `tokens` to the row's
    /// response (log-prob 0) and generation continues after them; `(row, None)` finishes the
    /// row. With `wait`, blocks until at least one is ready (nothing else can run).
    fn ready(&mut self, wait: bool) -> Vec<(usize, Option<Vec<u32>>)>;
}

/// [`generate_with_streams`], with the turns of a multi-turn rollout when `turns` is given,
/// and each prompt's images (`images` empty: none; else one entry per prompt). Prompts with
/// images run on the tensor composition (the packed decode engine reads token ids only).
pub fn generate_turns(
    model: &CausalLm,
    prompts: &[&[u32]],
    p: &SamplingParams,
    streams: RowStreams,
    progress: Option<&ProgressBar>,
    turns: Option<&mut dyn Turns>,
    images: &[Option<Arc<Images>>],
) -> Result<(Rollout, Stats)> {
    if let Some(i) = prompts.iter().position(|t| t.is_empty()) {
        candle_core::bail!("prompt {i} has no tokens: nothing to continue from");
    }
    if !images.is_empty() && images.len() != prompts.len() {
        candle_core::bail!(
            "{} prompts but images for {} rows",
            prompts.len(),
            images.len()
        );
    }
    if let Some(v) = &model.args.vision {
        for (i, t) in prompts.iter().enumerate() {
            let n = t.iter().filter(|&&x| x == v.image_token_id).count();
            if n > 0 && images.get(i).is_none_or(Option::is_none) {
                candle_core::bail!(
                    "prompt {i} has {n} image placeholder tokens (id {}) but no images",
                    v.image_token_id
                );
            }
        }
    }
    let with_images = images.iter().any(Option::is_some);
    let mut out = Rollout::empty(prompts.len());
    if prompts.is_empty() || p.max_new_tokens == 0 {
        return Ok((out, Stats::default()));
    }
    let stats = if decode::serves(model) && !with_images {
        let continuous = Continuous {
            prompts,
            p,
            streams: &streams,
            progress,
            out: &mut out,
            turns,
        };
        match decode::with_packed(model, continuous) {
            Some(stats) => stats?,
            None => {
                candle_core::bail!("internal: the packed decode path refused a model it serves")
            }
        }
    } else {
        match turns {
            None => waves(model, prompts, p, &streams, progress, &mut out, images)?,
            Some(t) => wave_turns(model, (prompts, images), p, &streams, progress, &mut out, t)?,
        }
    };
    tracing::debug!(
        "generation: {} rows, {} steps, at most {} sequences and {:.1} MB of keys/values in flight",
        prompts.len(),
        stats.steps,
        stats.peak_seqs,
        stats.peak_kv_bytes as f64 / 1e6
    );
    Ok((out, stats))
}

/// A sequence in flight.
struct Live<C> {
    row: usize,
    cache: SeqCache<C>,
    rng: ChaCha8Rng,
    /// The token to feed next (the last one sampled).
    next: u32,
    /// Tokens to feed when coming back from between turns (the turn's last token and what the
    /// agent loop appended); empty when entering for the first time (the prompt is fed).
    feed: Vec<u32>,
    reserved: usize,
}

/// Records a sampled token; returns whether the row goes on.
fn record(out: &mut Rollout, row: usize, tok: u32, lp: f32, p: &SamplingParams) -> bool {
    out.responses[row].push(tok);
    out.log_probs[row].push(lp);
    if !p.ignore_eos && p.eos_ids.contains(&tok) {
        out.stop[row] = StopReason::Eos;
        false
    } else {
        out.stop[row] = StopReason::Length;
        out.responses[row].len() < p.max_new_tokens
    }
}

/// The continuous-batching loop on the packed decode engine, for [`decode::with_packed`].
struct Continuous<'a, 't> {
    prompts: &'a [&'a [u32]],
    p: &'a SamplingParams,
    streams: &'a RowStreams,
    progress: Option<&'a ProgressBar>,
    out: &'a mut Rollout,
    turns: Option<&'t mut dyn Turns>,
}

impl Decoder for Continuous<'_, '_> {
    type Out = Stats;
    fn run<T: Elem, C: KvElem<T>>(self, packed: Packed<T>) -> Result<Stats> {
        let Continuous {
            prompts,
            p,
            streams,
            progress,
            out,
            turns,
        } = self;
        continuous::<T, C>(&packed, prompts, p, streams, progress, out, turns)
    }
}

/// Rows waiting between turns, with their caches.
struct Parked<C>(Vec<Live<C>>);

impl<C> Parked<C> {
    /// The continuations `turns` has ready: rows to resume (their appended tokens recorded in
    /// `out`, to be fed next) and the key/value bytes of rows it finished.
    fn resume(
        &mut self,
        turns: &mut dyn Turns,
        wait: bool,
        out: &mut Rollout,
        progress: Option<&ProgressBar>,
    ) -> (Vec<Live<C>>, usize) {
        let (mut back, mut freed) = (Vec::new(), 0);
        for (row, next) in turns.ready(wait) {
            let Some(at) = self.0.iter().position(|l| l.row == row) else {
                continue;
            };
            let mut l = self.0.swap_remove(at);
            match next {
                Some(toks) if !toks.is_empty() => {
                    out.responses[row].extend_from_slice(&toks);
                    out.log_probs[row].extend(std::iter::repeat_n(0.0, toks.len()));
                    l.feed = std::iter::once(l.next).chain(toks).collect();
                    back.push(l);
                }
                _ => {
                    freed += l.reserved;
                    if let Some(b) = progress {
                        b.inc(1);
                    }
                }
            }
        }
        (back, freed)
    }
}

fn continuous<T: Elem, C: KvElem<T>>(
    packed: &Packed<T>,
    prompts: &[&[u32]],
    p: &SamplingParams,
    streams: &RowStreams,
    progress: Option<&ProgressBar>,
    out: &mut Rollout,
    mut turns: Option<&mut dyn Turns>,
) -> Result<Stats> {
    let args = packed.args();
    let mut waiting: VecDeque<usize> = (0..prompts.len()).collect();
    let mut active: Vec<Live<C>> = Vec::new();
    let mut parked = Parked::<C>(Vec::new());
    let mut reserved = 0usize;
    let mut stats = Stats::default();
    let mut returned: Vec<Live<C>> = Vec::new();
    loop {
        // Rows whose tools have answered come back first (their memory is already reserved).
        let mut entering: Vec<Live<C>> = std::mem::take(&mut returned);
        if let Some(t) = turns.as_deref_mut() {
            if !parked.0.is_empty() {
                let (back, freed) = parked.resume(t, false, out, progress);
                reserved -= freed;
                entering.extend(back);
            }
        }
        // Admission: fill the free sequence slots within the memory and prefill budgets.
        let running = active.len() + parked.0.len();
        admit(
            &mut waiting,
            &mut entering,
            running,
            &mut reserved,
            (args, prompts, p, streams),
        );
        if active.is_empty() && entering.is_empty() {
            // Nothing can run: wait for a tool, or stop when no row is waiting for one.
            match turns.as_deref_mut() {
                Some(t) if !parked.0.is_empty() => {
                    let (back, freed) = parked.resume(t, true, out, progress);
                    reserved -= freed;
                    returned = back;
                    continue;
                }
                _ => break,
            }
        }
        stats.peak_seqs = stats.peak_seqs.max(active.len() + entering.len());
        stats.peak_kv_bytes = stats.peak_kv_bytes.max(reserved);
        stats.steps += 1;
        // One step: running rows feed their last token, entering rows their prompt (or, back
        // from a tool, what the agent loop appended).
        let nexts: Vec<u32> = active.iter().map(|l| l.next).collect();
        let enter_feeds: Vec<Vec<u32>> = entering
            .iter_mut()
            .map(|l| std::mem::take(&mut l.feed))
            .collect();
        let feeds: Vec<&[u32]> = nexts
            .iter()
            .map(std::slice::from_ref)
            .chain(
                entering
                    .iter()
                    .zip(&enter_feeds)
                    .map(|(l, f)| match f.is_empty() {
                        true => prompts[l.row],
                        false => f.as_slice(),
                    }),
            )
            .collect();
        let mut caches: Vec<&mut SeqCache<C>> = active
            .iter_mut()
            .chain(entering.iter_mut())
            .map(|l| &mut l.cache)
            .collect();
        let logits = packed.step(&feeds, &mut caches)?;
        active.append(&mut entering);
        // Sampling, in parallel: each row draws from its own stream.
        let picks: Vec<(u32, f32)> = active
            .par_iter_mut()
            .zip(logits.par_iter())
            .map(|(l, lg)| sample_row(lg, p, &mut l.rng))
            .collect();
        let mut still = Vec::with_capacity(active.len());
        for (mut l, (tok, lp)) in active.drain(..).zip(picks) {
            if record(out, l.row, tok, lp, p) {
                l.next = tok;
                still.push(l);
            } else if turns
                .as_deref_mut()
                .is_some_and(|t| t.turn_ended(l.row, out))
            {
                // The turn's last token is not in the cache yet: it is fed on return.
                l.next = tok;
                parked.0.push(l);
            } else {
                reserved -= l.reserved;
                if let Some(b) = progress {
                    b.inc(1);
                }
            }
        }
        active = still;
    }
    Ok(stats)
}

/// Moves rows from `waiting` to `entering` while the free sequence slots (`running` rows
/// besides those entering), the KV memory budget (`reserved` bytes so far, grown by each
/// admitted row's need) and the prefill token budget allow; rows already entering (back from
/// a tool) count with what they feed.
fn admit<C: Copy>(
    waiting: &mut VecDeque<usize>,
    entering: &mut Vec<Live<C>>,
    running: usize,
    reserved: &mut usize,
    (args, prompts, p, streams): (&ModelArgs, &[&[u32]], &SamplingParams, &RowStreams),
) {
    let lim = p.limits;
    let mut prefill: usize = entering.iter().map(|l| l.feed.len()).sum();
    while let Some(&row) = waiting.front() {
        let len = prompts[row].len();
        let need = SeqCache::<C>::bytes_needed(args, len, len + p.max_new_tokens);
        let in_flight = running + entering.len();
        if in_flight >= lim.max_num_seqs.max(1)
            || (in_flight > 0 && *reserved + need > lim.kv_cache_bytes)
            || (!entering.is_empty() && prefill + len > lim.max_num_batched_tokens)
        {
            break;
        }
        waiting.pop_front();
        *reserved += need;
        prefill += len;
        entering.push(Live {
            row,
            cache: SeqCache::with_capacity(args, len + p.max_new_tokens),
            rng: streams.rng(row),
            next: 0,
            feed: Vec::new(),
            reserved: need,
        });
    }
}

/// Waves of padded batches through the tensor composition (devices and dtypes without the
/// packed path).
fn waves(
    model: &CausalLm,
    prompts: &[&[u32]],
    p: &SamplingParams,
    streams: &RowStreams,
    progress: Option<&ProgressBar>,
    out: &mut Rollout,
    images: &[Option<Arc<Images>>],
) -> Result<Stats> {
    let mut rngs: Vec<ChaCha8Rng> = (0..prompts.len()).map(|r| streams.rng(r)).collect();
    waves_with(model, (prompts, images), p, &mut rngs, progress, out)
}

/// Multi-turn generation through the tensor composition: round after round, every row still
/// in its conversation generates its next turn from its whole context (prompt and response so
/// far: no cache survives a round on this path), in waves; each row keeps drawing from its
/// own random stream across rounds. Between rounds the rows wait for their tools.
fn wave_turns(
    model: &CausalLm,
    (prompts, images): (&[&[u32]], &[Option<Arc<Images>>]),
    p: &SamplingParams,
    streams: &RowStreams,
    progress: Option<&ProgressBar>,
    out: &mut Rollout,
    turns: &mut dyn Turns,
) -> Result<Stats> {
    let mut rngs: Vec<ChaCha8Rng> = (0..prompts.len()).map(|r| streams.rng(r)).collect();
    let mut stats = Stats::default();
    let mut live: Vec<usize> = (0..prompts.len()).collect();
    while !live.is_empty() {
        let ctx: Vec<Vec<u32>> = live
            .iter()
            .map(|&r| [prompts[r], out.responses[r].as_slice()].concat())
            .collect();
        let room = |r: usize, out: &Rollout| p.max_new_tokens - out.responses[r].len();
        let mut q = p.clone();
        q.max_new_tokens = live.iter().map(|&r| room(r, out)).max().unwrap_or(0);
        let refs: Vec<&[u32]> = ctx.iter().map(Vec::as_slice).collect();
        let mut sub: Vec<ChaCha8Rng> = live.iter().map(|&r| rngs[r].clone()).collect();
        let mut part = Rollout::empty(live.len());
        let ims: Vec<Option<Arc<Images>>> = match images.is_empty() {
            true => Vec::new(),
            false => live.iter().map(|&r| images[r].clone()).collect(),
        };
        let st = waves_with(model, (&refs, &ims), &q, &mut sub, None, &mut part)?;
        stats.steps += st.steps;
        stats.peak_seqs = stats.peak_seqs.max(st.peak_seqs);
        stats.peak_kv_bytes = stats.peak_kv_bytes.max(st.peak_kv_bytes);
        let mut asked = Vec::new();
        for (k, &r) in live.iter().enumerate() {
            // A row with less room than the round's longest stops at its own budget.
            let n = part.responses[k].len().min(room(r, out));
            out.responses[r].extend_from_slice(&part.responses[k][..n]);
            out.log_probs[r].extend_from_slice(&part.log_probs[k][..n]);
            out.stop[r] = if n < part.responses[k].len() {
                StopReason::Length
            } else {
                part.stop[k]
            };
            rngs[r] = sub[k].clone();
            if turns.turn_ended(r, out) {
                asked.push(r);
            } else if let Some(b) = progress {
                b.inc(1);
            }
        }
        let mut next = Vec::new();
        while !asked.is_empty() {
            for (r, cont) in turns.ready(true) {
                let Some(at) = asked.iter().position(|&a| a == r) else {
                    continue;
                };
                asked.swap_remove(at);
                match cont {
                    Some(toks) if !toks.is_empty() => {
                        out.responses[r].extend_from_slice(&toks);
                        out.log_probs[r].extend(std::iter::repeat_n(0.0, toks.len()));
                        next.push(r);
                    }
                    _ => {
                        if let Some(b) = progress {
                            b.inc(1);
                        }
                    }
                }
            }
        }
        next.sort_unstable();
        live = next;
    }
    Ok(stats)
}

/// [`waves`] with one random stream per prompt (`rngs[i]` draws for `prompts[i]`).
fn waves_with(
    model: &CausalLm,
    (prompts, images): (&[&[u32]], &[Option<Arc<Images>>]),
    p: &SamplingParams,
    rngs: &mut [ChaCha8Rng],
    progress: Option<&ProgressBar>,
    out: &mut Rollout,
) -> Result<Stats> {
    let per_pos = decode::kv_bytes_per_position(&model.args, model.dtype().size_in_bytes());
    let mut lim = p.limits;
    if let Some(bytes) = device_kv_budget(model, lim.gpu_memory_utilization)? {
        lim.kv_cache_bytes = bytes;
    }
    let mut stats = Stats::default();
    let mut start = 0;
    while start < prompts.len() {
        // Grow the wave while the padded cache fits (the first row always goes).
        let mut end = start + 1;
        let mut width = prompts[start].len();
        while end < prompts.len() && end - start < lim.max_num_seqs.max(1) {
            let w = width.max(prompts[end].len());
            if (end + 1 - start) * (w + p.max_new_tokens) * per_pos > lim.kv_cache_bytes {
                break;
            }
            width = w;
            end += 1;
        }
        let rows = end - start;
        let mut ids = Vec::with_capacity(rows * width);
        let mut mask = Vec::with_capacity(rows * width);
        for t in &prompts[start..end] {
            ids.extend(std::iter::repeat_n(0u32, width - t.len()));
            ids.extend_from_slice(t);
            mask.extend(std::iter::repeat_n(0u8, width - t.len()));
            mask.extend(std::iter::repeat_n(1u8, t.len()));
        }
        let ims = match images.is_empty() {
            true => &[][..],
            false => &images[start..end],
        };
        let rngs = &mut rngs[start..end];
        let wave = generate_with(model, &ids, &mask, rows, width, p, rngs, ims)?;
        for (k, row) in (start..end).enumerate() {
            out.responses[row] = wave.responses[k].clone();
            out.log_probs[row] = wave.log_probs[k].clone();
            out.stop[row] = wave.stop[k];
        }
        if let Some(b) = progress {
            b.inc(rows as u64);
        }
        stats.peak_seqs = stats.peak_seqs.max(rows);
        stats.peak_kv_bytes = stats
            .peak_kv_bytes
            .max(rows * (width + p.max_new_tokens) * per_pos);
        stats.steps += wave.responses.iter().map(Vec::len).max().unwrap_or(0);
        start = end;
    }
    Ok(stats)
}

/// On a GPU: `utilization` × the device's memory less the bytes this process's memory pool
/// holds in tensors now (weights, optimizer state, the reference and the critic: what vLLM's
/// `gpu_memory_utilization` leaves for the KV cache beside the model); `None` elsewhere.
fn device_kv_budget(model: &CausalLm, utilization: f64) -> Result<Option<usize>> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = model.device() {
        use crate::kernels::cuda::memory;
        let (_, total) = memory::device_info(d)?;
        let (used, _) = memory::current(d)?;
        let budget = (utilization * total as f64 - used as f64).max(0.0) as usize;
        tracing::debug!(
            "generation: KV budget {:.1} GB ({utilization} of {:.1} GB, {:.1} GB in use)",
            budget as f64 / 1e9,
            total as f64 / 1e9,
            used as f64 / 1e9
        );
        return Ok(Some(budget));
    }
    let _ = (model, utilization);
    Ok(None)
}

#[cfg(test)]
mod tests {
    use candle_core::DType;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::model::{Arch, ModelArgs};
    use crate::rollout::generate;

    fn prompts(count: usize, vocab: u32, seed: u64) -> Vec<Vec<u32>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..count)
            .map(|_| {
                let len = rng.random_range(1..14);
                (0..len).map(|_| rng.random_range(0..vocab)).collect()
            })
            .collect()
    }

    fn params(greedy: bool, max_new: usize, eos: Vec<u32>, limits: Limits) -> SamplingParams {
        SamplingParams {
            greedy,
            temperature: if greedy { 0.0 } else { 1.0 },
            top_k: None,
            top_p: if greedy { 1.0 } else { 0.9 },
            max_new_tokens: max_new,
            eos_ids: eos,
            ignore_eos: false,
            limits,
        }
    }

    fn run(m: &CausalLm, ps: &[Vec<u32>], p: &SamplingParams, seed: u64) -> (Rollout, Stats) {
        let refs: Vec<&[u32]> = ps.iter().map(Vec::as_slice).collect();
        generate_all_with_stats(m, &refs, p, &mut Sampler::new(seed), None).unwrap()
    }

    fn assert_same(a: &Rollout, b: &Rollout, tol: f32, what: &str) {
        assert_eq!(a.responses, b.responses, "{what}: tokens");
        assert_eq!(a.stop, b.stop, "{what}: stop reasons");
        for (ra, rb) in a.log_probs.iter().zip(&b.log_probs) {
            for (x, y) in ra.iter().zip(rb) {
                assert!((x - y).abs() <= tol, "{what}: log-prob {x} vs {y}");
            }
        }
    }

    /// Many more rows than `max_num_seqs`: the scheduler never holds more sequences or key/value
    /// bytes than allowed, and every row's tokens equal generating that row alone (f64 weights,
    /// so summation order cannot flip a choice), greedy and sampled.
    #[test]
    fn bounded_and_equal_to_one_by_one() {
        let args = ModelArgs::tiny(Arch::Llama, 40);
        let (_vm, m) = crate::testing::tiny_model(&args, DType::F64, 0.5);
        let ps = prompts(37, 40, 1);
        let per_pos = SeqCache::<f64>::bytes_per_position(&args);
        let budget = 3 * (13 + 9) * per_pos; // room for about three long rows
                                             // An EOS id that row 0 emits early (weights are random per run).
        let free = run(&m, &ps, &params(true, 9, vec![], Limits::default()), 3).0;
        let eos = vec![free.responses[0][2]];
        for greedy in [true, false] {
            let tight = Limits {
                max_num_seqs: 5,
                max_num_batched_tokens: 20,
                kv_cache_bytes: budget,
                ..Limits::default()
            };
            let (got, stats) = run(&m, &ps, &params(greedy, 9, eos.clone(), tight), 3);
            assert!(stats.peak_seqs <= 5, "{stats:?}");
            assert!(stats.peak_seqs >= 2, "rows shared steps: {stats:?}");
            assert!(stats.peak_kv_bytes <= budget, "{stats:?}");
            if greedy {
                assert_eq!(got.stop[0], StopReason::Eos);
            }
            let one = Limits {
                max_num_seqs: 1,
                ..Limits::default()
            };
            let (alone, s1) = run(&m, &ps, &params(greedy, 9, eos.clone(), one), 3);
            assert_eq!(s1.peak_seqs, 1);
            assert_same(&got, &alone, 1e-9, "limited vs one by one");
            let (all, s_all) = run(
                &m,
                &ps,
                &params(greedy, 9, eos.clone(), Limits::default()),
                3,
            );
            assert_eq!(s_all.peak_seqs, ps.len());
            assert_same(&got, &all, 1e-9, "limited vs all at once");
        }
    }

    /// The packed path against the tensor composition (`generate`, one padded batch), f32:
    /// same tokens, log-probs within f32 noise; also for Qwen2 (q/k/v biases, untied head),
    /// Qwen3-MoE (routed experts, one dense layer) and the Gated DeltaNet hybrids (recurrent
    /// states per sequence beside keys and values; gated, partially rotary attention; shared
    /// experts; Qwen3-Next's grouped projections).
    #[test]
    fn packed_path_equals_the_composition() {
        let all = crate::testing::DECODER_ARCHS.into_iter();
        for arch in all.chain(crate::testing::HYBRID_ARCHS) {
            let args = ModelArgs::tiny(arch, 50);
            let (_vm, m) = crate::testing::tiny_model(&args, DType::F32, 0.5);
            let ps = prompts(6, 50, 2);
            for greedy in [true, false] {
                let p = params(greedy, 12, vec![], Limits::default());
                let (packed, _) = run(&m, &ps, &p, 5);
                let w = ps.iter().map(Vec::len).max().unwrap();
                let mut ids = Vec::new();
                let mut mask = Vec::new();
                for t in &ps {
                    ids.extend(std::iter::repeat_n(0u32, w - t.len()));
                    ids.extend(t);
                    mask.extend(std::iter::repeat_n(0u8, w - t.len()));
                    mask.extend(std::iter::repeat_n(1u8, t.len()));
                }
                let composed =
                    generate(&m, &ids, &mask, ps.len(), w, &p, &mut Sampler::new(5)).unwrap();
                assert_same(
                    &packed,
                    &composed,
                    1e-4,
                    &format!("{arch:?} greedy={greedy}"),
                );
            }
        }
    }

    /// With LoRA adapters (B trained, non-zero) the packed path folds W + s·B·A into its
    /// weights once per call; the composition applies the adapters on the side: same tokens.
    #[test]
    fn merged_adapters_give_the_unmerged_tokens() {
        use crate::config::fields::OneOrMany;
        use crate::weights::peft;
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Qwen3Moe] {
            let args = ModelArgs::tiny(arch, 50);
            let (_vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.5);
            let ad = candle_nn::VarMap::new();
            let spec = peft::tests::spec(4, OneOrMany::One("all-linear".into()), None);
            peft::attach(&mut m, &spec, &ad, 3, "k").unwrap();
            peft::tests::randomize_b(&ad, 0.3);
            let view = m.no_grad();
            let ps = prompts(6, 50, 4);
            let p = params(true, 12, vec![], Limits::default());
            let (packed, _) = run(&view, &ps, &p, 5);
            let (plain, _) = run(&view.without_adapters(), &ps, &p, 5);
            assert_ne!(packed.responses, plain.responses, "the adapters matter");
            let w = ps.iter().map(Vec::len).max().unwrap();
            let (mut ids, mut mask) = (Vec::new(), Vec::new());
            for t in &ps {
                ids.extend(std::iter::repeat_n(0u32, w - t.len()));
                ids.extend(t);
                mask.extend(std::iter::repeat_n(0u8, w - t.len()));
                mask.extend(std::iter::repeat_n(1u8, t.len()));
            }
            let composed =
                generate(&view, &ids, &mask, ps.len(), w, &p, &mut Sampler::new(5)).unwrap();
            assert_same(&packed, &composed, 1e-4, &format!("{arch:?} LoRA"));
        }
    }

    /// The wave fallback (other devices and dtypes) honours the limits and gives the packed
    /// path's results.
    #[test]
    fn waves_are_bounded_and_equal_the_packed_path() {
        let args = ModelArgs::tiny(Arch::Qwen2, 40);
        let (_vm, m) = crate::testing::tiny_model(&args, DType::F64, 0.5);
        let ps = prompts(11, 40, 4);
        let lim = Limits {
            max_num_seqs: 3,
            ..Limits::default()
        };
        for greedy in [true, false] {
            let p = params(greedy, 7, vec![3], lim);
            let refs: Vec<&[u32]> = ps.iter().map(Vec::as_slice).collect();
            let mut sampler = Sampler::new(9);
            let streams = sampler.rows();
            let mut out = Rollout::empty(ps.len());
            let stats = waves(&m, &refs, &p, &streams, None, &mut out, &[]).unwrap();
            assert_eq!(stats.peak_seqs, 3);
            let (packed, _) = run(&m, &ps, &p, 9);
            assert_same(&out, &packed, 1e-9, &format!("waves greedy={greedy}"));
        }
    }

    #[test]
    fn empty_prompt_is_an_error_and_zero_tokens_is_empty() {
        let args = ModelArgs::tiny(Arch::Llama, 30);
        let (_vm, m) = crate::testing::tiny_model(&args, DType::F32, 0.5);
        let p = params(true, 4, vec![], Limits::default());
        let empty: &[u32] = &[];
        let err = generate_all(&m, &[&[1, 2], empty], &p, &mut Sampler::new(0), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("prompt 1 has no tokens"), "{err}");
        let none = params(true, 0, vec![], Limits::default());
        let out = generate_all(&m, &[&[1, 2]], &none, &mut Sampler::new(0), None).unwrap();
        assert_eq!(out.responses, vec![Vec::<u32>::new()]);
    }

    /// A scripted between-turns stage: every row gets `rounds` continuations of `appended`
    /// tokens, each `delay` after its turn ended (answered from the clock, as tools answer
    /// from other threads).
    struct Scripted {
        appended: Vec<u32>,
        delay: std::time::Duration,
        left: Vec<usize>,
        due: Vec<(usize, std::time::Instant)>,
        max: usize,
    }

    impl Turns for Scripted {
        fn turn_ended(&mut self, row: usize, out: &Rollout) -> bool {
            let room = out.responses[row].len() + self.appended.len() < self.max;
            if self.left[row] == 0 || !room || out.stop[row] != StopReason::Eos {
                return false;
            }
            self.left[row] -= 1;
            self.due.push((row, std::time::Instant::now() + self.delay));
            true
        }
        fn ready(&mut self, wait: bool) -> Vec<(usize, Option<Vec<u32>>)> {
            loop {
                let now = std::time::Instant::now();
                let (done, rest): (Vec<_>, Vec<_>) = self.due.iter().partition(|d| d.1 <= now);
                self.due = rest;
                if !done.is_empty() || !wait {
                    return done
                        .into_iter()
                        .map(|(r, _)| (r, Some(self.appended.clone())))
                        .collect();
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
    }

    /// A row that waits between turns keeps its cache: what it generates after the appended
    /// tokens equals a fresh greedy generation from prompt + first turn + appended tokens (f64
    /// weights), the appended tokens sit between the turns with log-prob 0, and the packed path
    /// (kept caches) and the composition path (re-prefilled each round) agree.
    #[test]
    fn rows_continue_after_appended_tokens_as_if_prompted_with_them() {
        let args = ModelArgs::tiny(Arch::Llama, 40);
        let (_vm, m) = crate::testing::tiny_model(&args, DType::F64, 0.5);
        let ps = prompts(6, 40, 5);
        let free = run(&m, &ps, &params(true, 20, vec![], Limits::default()), 3).0;
        // End-of-turn ids that the rows emit early.
        let eos: Vec<u32> = vec![free.responses[0][1], free.responses[1][2]];
        let p = params(true, 20, eos.clone(), Limits::default());
        let refs: Vec<&[u32]> = ps.iter().map(Vec::as_slice).collect();
        let appended = vec![7, 8, 9];
        let mut turns = Scripted {
            appended: appended.clone(),
            delay: std::time::Duration::from_millis(5),
            left: vec![1; ps.len()],
            due: Vec::new(),
            max: 20,
        };
        let streams = Sampler::new(3).rows();
        let (out, _) = generate_turns(&m, &refs, &p, streams, None, Some(&mut turns), &[]).unwrap();
        let mut continued = 0;
        for (r, resp) in out.responses.iter().enumerate() {
            let Some(cut) = resp.windows(3).position(|w| w == appended.as_slice()) else {
                continue;
            };
            continued += 1;
            let first = &resp[..cut];
            assert!(
                eos.contains(first.last().unwrap()),
                "row {r}: turn 1 ends on EOS"
            );
            assert_eq!(&out.log_probs[r][cut..cut + 3], &[0.0, 0.0, 0.0]);
            let ctx: Vec<u32> = [ps[r].as_slice(), &resp[..cut + 3]].concat();
            let mut q = p.clone();
            q.max_new_tokens = 20 - (cut + 3);
            let fresh = generate_all(&m, &[&ctx], &q, &mut Sampler::new(0), None).unwrap();
            assert_eq!(
                &resp[cut + 3..],
                fresh.responses[0].as_slice(),
                "row {r}: turn 2"
            );
            for (a, b) in out.log_probs[r][cut + 3..].iter().zip(&fresh.log_probs[0]) {
                assert!((a - b).abs() < 1e-9, "row {r}: {a} vs {b}");
            }
        }
        assert!(continued >= 2, "rows that took a second turn: {continued}");
        // The composition path (no kept cache) gives the same conversation.
        let mut turns2 = Scripted {
            appended,
            delay: std::time::Duration::from_millis(5),
            left: vec![1; ps.len()],
            due: Vec::new(),
            max: 20,
        };
        let mut out2 = Rollout::empty(ps.len());
        wave_turns(
            &m,
            (&refs, &[]),
            &p,
            &Sampler::new(3).rows(),
            None,
            &mut out2,
            &mut turns2,
        )
        .unwrap();
        assert_same(&out, &out2, 1e-9, "kept caches vs re-prefilled rounds");
    }

    /// Rows waiting for slow continuations wait together: 8 rows that each wait 400 ms once
    /// finish in about one wait, not eight (a concurrency check with a wide margin, not a
    /// benchmark).
    #[test]
    fn waiting_rows_do_not_wait_in_turn() {
        let args = ModelArgs::tiny(Arch::Llama, 40);
        let (_vm, m) = crate::testing::tiny_model(&args, DType::F32, 0.5);
        let ps = prompts(8, 40, 9);
        let free = run(&m, &ps, &params(true, 12, vec![], Limits::default()), 3).0;
        let eos: Vec<u32> = free.responses.iter().map(|r| r[0]).collect();
        let p = params(true, 12, eos, Limits::default());
        let refs: Vec<&[u32]> = ps.iter().map(Vec::as_slice).collect();
        let mut turns = Scripted {
            appended: vec![3],
            delay: std::time::Duration::from_millis(400),
            left: vec![1; ps.len()],
            due: Vec::new(),
            max: 12,
        };
        let t0 = std::time::Instant::now();
        let streams = Sampler::new(3).rows();
        let (out, _) = generate_turns(&m, &refs, &p, streams, None, Some(&mut turns), &[]).unwrap();
        let took = t0.elapsed().as_secs_f64();
        assert!(
            out.responses.iter().all(|r| r.contains(&3)),
            "every row waited once"
        );
        assert!(
            took < 1.6,
            "8 waits of 0.4 s took {took:.2} s: rows waited in turn"
        );
    }
}
