//! Rows of a step → the tensors of one forward pass: cutting rows into micro-batches (a row
//! count or a token budget), the micro-batch's inputs packed end to end (`use_remove_padding`)
//! or padded only to its own longest prompt and response, and verl's sequence balancing of the
//! update order (`trainer.balance_batch`).

use candle_core::{Device, Result, Tensor};

use super::batch::StepBatch;
use crate::config::MicroBatching;
use crate::model::CausalLm;

impl StepBatch {
    /// Cuts `rows` into micro-batches: a fixed number of rows, or as many rows as fit in a token
    /// budget (a row longer than the budget goes alone).
    pub fn micro_batches(&self, rows: &[usize], micro: MicroBatching) -> Vec<Vec<usize>> {
        match micro {
            MicroBatching::Sequences(n) => rows.chunks(n.max(1)).map(<[usize]>::to_vec).collect(),
            MicroBatching::TokenBudget(budget) => {
                let mut out: Vec<Vec<usize>> = Vec::new();
                let mut cur = Vec::new();
                let (mut p, mut r) = (0usize, 0usize);
                for &row in rows {
                    let np = p.max(self.prompts[row].len());
                    let nr = r.max(self.responses[row].len());
                    if !cur.is_empty() && (cur.len() + 1) * (np + nr) > budget {
                        out.push(std::mem::take(&mut cur));
                        p = self.prompts[row].len();
                        r = self.responses[row].len();
                    } else {
                        p = np;
                        r = nr;
                    }
                    cur.push(row);
                }
                if !cur.is_empty() {
                    out.push(cur);
                }
                out
            }
        }
    }

    /// [`StepBatch::micro_batches`] for micro-batches laid out as `layout`: with shared prompts
    /// (`use_prefix_grouper`) a token budget counts the tokens the micro-batch really computes,
    /// each distinct prompt once and every response, so a group's rows fit together where the
    /// padded count would split them (a row longer than the budget still goes alone).
    pub fn micro_batches_for(
        &self,
        rows: &[usize],
        micro: MicroBatching,
        layout: Layout,
    ) -> Vec<Vec<usize>> {
        let budget = match micro {
            MicroBatching::TokenBudget(b) if layout.share_prefixes => b,
            _ => return self.micro_batches(rows, micro),
        };
        let mut out: Vec<Vec<usize>> = Vec::new();
        let mut cur: Vec<usize> = Vec::new();
        let mut prompts: std::collections::HashSet<&[u32]> = Default::default();
        let mut cost = 0usize;
        for &row in rows {
            let (p, r) = (self.prompts[row].as_slice(), self.responses[row].len());
            let prompt_cost = |seen: &std::collections::HashSet<&[u32]>| match seen.contains(p) {
                true => 0,
                false => p.len(),
            };
            if !cur.is_empty() && cost + r + prompt_cost(&prompts) > budget {
                out.push(std::mem::take(&mut cur));
                prompts.clear();
                cost = 0;
            }
            cost += r + prompt_cost(&prompts);
            prompts.insert(p);
            cur.push(row);
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out
    }

    /// The forward-pass tensors of `rows` (see [`MicroInputs`]), padded or packed as `layout`
    /// says.
    /// A row with an empty prompt is refused: no token would predict its first response token.
    pub fn inputs(&self, rows: &[usize], layout: Layout, device: &Device) -> Result<MicroInputs> {
        if let Some(&row) = rows.iter().find(|&&r| self.prompts[r].is_empty()) {
            return Err(candle_core::Error::Msg(format!(
                "a prompt with no tokens reached the trainer (batch row {row})"
            )));
        }
        let images = self.images_of(rows, layout)?;
        // Shared prompts run through the grouped forward, which takes no images.
        let layout = match images.is_empty() {
            true => layout,
            false => layout.sharing(false),
        };
        let mut mi = match layout.packed {
            true => self.packed_inputs(rows, layout, device)?,
            false => self.padded_inputs(rows, layout, device)?,
        };
        if !images.is_empty() {
            let (positions, at) = self.rope_positions(rows, &mi, layout.image_token, device)?;
            mi.position_ids = positions;
            mi.image_at = at;
            mi.images = images;
        }
        Ok(mi)
    }

    /// The images of `rows` in order (empty when none has any); a prompt with image
    /// placeholders (`layout.image_token`) and no images is refused naming the row.
    fn images_of(
        &self,
        rows: &[usize],
        layout: Layout,
    ) -> Result<Vec<Option<std::sync::Arc<crate::model::vision::Images>>>> {
        let of = |r: usize| self.images.get(r).and_then(Option::as_ref);
        if let Some(id) = layout.image_token {
            let bare = rows
                .iter()
                .find(|&&r| of(r).is_none() && self.prompts[r].contains(&id));
            if let Some(&r) = bare {
                candle_core::bail!(
                    "batch row {r}: its prompt has image placeholder tokens (id {id}) but no images"
                );
            }
        }
        Ok(match rows.iter().any(|&r| of(r).is_some()) {
            true => rows
                .iter()
                .map(|&r| of(r).map(|i| i.images.clone()))
                .collect(),
            false => Vec::new(),
        })
    }

    /// The 3-D rotary positions of `mi`'s tokens (`[3, m, t]` padded, `[3, n]` packed): a
    /// row's prompt at its images' positions, its response counting on from the prompt's
    /// length plus the row's delta on every axis; rows without images at their 1-D positions.
    /// With the model's `image_token`, also where the image features go: the flat positions of
    /// the placeholders in the prompts (a response may hold a placeholder the model sampled,
    /// which is a token like any other).
    #[allow(clippy::type_complexity)]
    fn rope_positions(
        &self,
        rows: &[usize],
        mi: &MicroInputs,
        image_token: Option<u32>,
        device: &Device,
    ) -> Result<(Tensor, Option<Vec<u32>>)> {
        let flat: Vec<u32> = mi.position_ids.flatten_all()?.to_vec1()?;
        let mut pos = [flat.clone(), flat.clone(), flat];
        // Each row's run of real tokens in the flat layout, `(start, length)`: padded, the row's
        // prompt ends at the prompt width and its response follows, up to the layout's last
        // position (`response width − 1` tokens: the longest response's last one predicts
        // nothing).
        let runs: Vec<(usize, usize)> = match &mi.tokens {
            Tokens::Padded { prompt_width, .. } => {
                let t = mi.input_ids.dim(1)?;
                let width = mi.response_width - 1;
                let real = |r: usize| self.prompts[r].len() + self.responses[r].len().min(width);
                rows.iter()
                    .enumerate()
                    .map(|(i, &r)| (i * t + prompt_width - self.prompts[r].len(), real(r)))
                    .collect()
            }
            Tokens::Packed { segments, .. } => segments.clone(),
        };
        let mut at = Vec::new();
        for (&row, &(start, len)) in rows.iter().zip(&runs) {
            let Some(ri) = self.images.get(row).and_then(Option::as_ref) else {
                continue;
            };
            let p = self.prompts[row].len();
            let placeholders = self.prompts[row].iter().enumerate();
            at.extend(
                placeholders
                    .filter(|&(_, &t)| Some(t) == image_token)
                    .map(|(k, _)| (start + k) as u32),
            );
            for (axis, a) in pos.iter_mut().enumerate() {
                for k in 0..len {
                    a[start + k] = match k < p {
                        true => ri.positions[axis][k],
                        false => (k as i64 + ri.delta) as u32,
                    };
                }
            }
        }
        let shape: Vec<usize> = std::iter::once(3)
            .chain(mi.position_ids.dims().iter().copied())
            .collect();
        let at = image_token.map(|_| at);
        Ok((Tensor::from_vec(pos.concat(), shape, device)?, at))
    }

    /// [`StepBatch::inputs`] padded: prompts left-padded to the longest, responses right-padded.
    fn padded_inputs(
        &self,
        rows: &[usize],
        layout: Layout,
        device: &Device,
    ) -> Result<MicroInputs> {
        let pad_id = layout.pad_id;
        let m = rows.len();
        let p = rows
            .iter()
            .map(|&r| self.prompts[r].len())
            .max()
            .unwrap_or(0);
        let r = self.response_width(rows);
        // The model reads prompt + response without its last token: position p − 1 + j
        // predicts response token j.
        let t = p + r - 1;
        let mut ids = Vec::with_capacity(m * t);
        let mut mask = Vec::with_capacity(m * t);
        let mut pos = Vec::with_capacity(m * t);
        let mut targets = Vec::with_capacity(m * r);
        let mut rmask = Vec::with_capacity(m * r);
        for &row in rows {
            let pr = &self.prompts[row];
            let rs = &self.responses[row];
            let lead = p - pr.len();
            for k in 0..t {
                let (id, real) = if k < lead {
                    (pad_id, false)
                } else if k < p {
                    (pr[k - lead], true)
                } else {
                    match rs.get(k - p) {
                        Some(&id) => (id, true),
                        None => (pad_id, false),
                    }
                };
                ids.push(id);
                mask.push(u32::from(real));
                pos.push(k.saturating_sub(lead) as u32);
            }
            for j in 0..r {
                targets.push(rs.get(j).copied().unwrap_or(pad_id));
                rmask.push(f32::from(u8::from(self.token_in_update(row, j))));
            }
        }
        Ok(MicroInputs {
            input_ids: Tensor::from_vec(ids, (m, t), device)?,
            position_ids: Tensor::from_vec(pos, (m, t), device)?,
            tokens: Tokens::Padded {
                key_mask: Tensor::from_vec(mask, (m, t), device)?,
                prompt_width: p,
            },
            targets: Tensor::from_vec(targets, (m, r), device)?,
            response_mask: Tensor::from_vec(rmask, (m, r), device)?,
            response_width: r,
            images: Vec::new(),
            image_at: None,
        })
    }

    /// The micro-batch's response width: its longest response, at least 1.
    fn response_width(&self, rows: &[usize]) -> usize {
        rows.iter()
            .map(|&r| self.responses[r].len())
            .max()
            .unwrap_or(0)
            .max(1)
    }

    /// [`StepBatch::inputs`] packed: each row's prompt and response (without its last token)
    /// laid end to end, no padding; only the real response positions reach the LM head or
    /// value head. `targets` and `response_mask` stay `[m, r]`. Every prompt has a token.
    /// With `layout.share_prefixes` (`actor.use_prefix_grouper`) the rows of the micro-batch
    /// with the same prompt (a GRPO group) share one copy of it: the prompt is laid once, where
    /// its first row is, and each of its rows' responses is a sequence continuing it.
    fn packed_inputs(
        &self,
        rows: &[usize],
        layout: Layout,
        device: &Device,
    ) -> Result<MicroInputs> {
        let pad_id = layout.pad_id;
        let m = rows.len();
        let r = self.response_width(rows);
        let (mut ids, mut pos, mut segments) = (Vec::new(), Vec::new(), Vec::with_capacity(m));
        let mut continues: Vec<Option<usize>> = Vec::with_capacity(m);
        // Shared prompts already laid: the prompt's ids → its sequence's index.
        let mut laid: std::collections::HashMap<&[u32], usize> = Default::default();
        // The real response positions: the token predicting each, its target; and for every
        // position (i, j) of `[m, r]` which of them it is (padding: the zero after the last).
        let (mut at, mut real_targets, mut spread) = (Vec::new(), Vec::new(), Vec::new());
        let mut padding = Vec::new();
        let mut targets = Vec::with_capacity(m * r);
        let mut rmask = Vec::with_capacity(m * r);
        for &row in rows {
            let (pr, rs) = (&self.prompts[row], &self.responses[row]);
            let body = &rs[..rs.len().saturating_sub(1)];
            // Token `first + k` predicts response token k (`first`: the prompt's last token,
            // then the response's own tokens follow it).
            let first = if layout.share_prefixes {
                let j = match laid.get(pr.as_slice()) {
                    Some(&j) => j,
                    None => {
                        segments.push((ids.len(), pr.len()));
                        continues.push(None);
                        ids.extend_from_slice(pr);
                        pos.extend(0..pr.len() as u32);
                        laid.insert(pr.as_slice(), segments.len() - 1);
                        segments.len() - 1
                    }
                };
                let (p0, pl) = segments[j];
                if !body.is_empty() {
                    segments.push((ids.len(), body.len()));
                    continues.push(Some(j));
                    ids.extend_from_slice(body);
                    pos.extend(pl as u32..(pl + body.len()) as u32);
                }
                // k = 0 reads the prompt's last token; k ≥ 1 the body's token k − 1.
                let body_start = ids.len() - body.len();
                (p0 + pl - 1, body_start)
            } else {
                let start = ids.len();
                ids.extend_from_slice(pr);
                ids.extend_from_slice(body);
                let len = ids.len() - start;
                pos.extend(0..len as u32);
                segments.push((start, len));
                continues.push(None);
                (start + pr.len() - 1, start + pr.len())
            };
            for j in 0..r {
                if j < rs.len() {
                    spread.push(at.len() as u32);
                    at.push(if j == 0 { first.0 } else { first.1 + j - 1 } as u32);
                    real_targets.push(rs[j]);
                } else {
                    padding.push(spread.len());
                    spread.push(0);
                }
                targets.push(rs.get(j).copied().unwrap_or(pad_id));
                rmask.push(f32::from(u8::from(self.token_in_update(row, j))));
            }
        }
        if at.is_empty() {
            // No response token at all: one position (the first token, a padding target) keeps
            // the heads' inputs non-empty; every output position reads the zero.
            at.push(0);
            real_targets.push(pad_id);
        }
        let k = at.len();
        for i in padding {
            spread[i] = k as u32;
        }
        let n = ids.len();
        let shared = continues.iter().any(Option::is_some);
        Ok(MicroInputs {
            input_ids: Tensor::from_vec(ids, n, device)?,
            position_ids: Tensor::from_vec(pos, n, device)?,
            tokens: Tokens::Packed {
                segments,
                continues: shared.then_some(continues),
                at: Tensor::from_vec(at, k, device)?,
                targets: Tensor::from_vec(real_targets, (1, k), device)?,
                spread: Tensor::from_vec(spread, m * r, device)?,
            },
            targets: Tensor::from_vec(targets, (m, r), device)?,
            response_mask: Tensor::from_vec(rmask, (m, r), device)?,
            response_width: r,
            images: Vec::new(),
            image_at: None,
        })
    }
}

/// How a micro-batch's sequences reach the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The token id of padding positions (and of the targets past a response's end).
    pub pad_id: u32,
    /// Sequences packed end to end (`use_remove_padding`, where the model supports it),
    /// else padded to the longest prompt (left) and response (right).
    pub packed: bool,
    /// Rows of a micro-batch with the same prompt share one copy of it
    /// (`actor.use_prefix_grouper`, where the model supports it; packed then).
    pub share_prefixes: bool,
    /// A vision-language model's image placeholder token: a prompt holding it must come with
    /// its images.
    pub image_token: Option<u32>,
}

impl Layout {
    /// The layout `model` asks for (`use_remove_padding`), with padding id `pad_id`.
    pub fn of(pad_id: u32, model: &crate::config::ModelConfig) -> Layout {
        Layout {
            pad_id,
            packed: model.use_remove_padding,
            share_prefixes: false,
            image_token: None,
        }
    }

    /// This layout for a model of `args`: a vision-language model's prompts with image
    /// placeholders must come with their images.
    pub fn for_model(self, args: &crate::model::ModelArgs) -> Layout {
        Layout {
            image_token: args.vision.as_ref().map(|v| v.image_token_id),
            ..self
        }
    }

    /// This layout with shared prompts asked for or not (`actor.use_prefix_grouper`).
    pub fn sharing(self, share_prefixes: bool) -> Layout {
        Layout {
            share_prefixes,
            ..self
        }
    }

    /// This layout as a model can run it: packed only where `packs` (the model's
    /// [`CausalLm::packs_without_padding`]), padded otherwise; prompts shared where asked for
    /// and `shares` ([`CausalLm::shares_prefixes`]), which packs the sequences whatever
    /// `use_remove_padding` says (the numbers are the padded layout's either way).
    pub fn given(self, packs: bool, shares: bool) -> Layout {
        let share = self.share_prefixes && packs && shares;
        Layout {
            packed: (self.packed && packs) || share,
            share_prefixes: share,
            ..self
        }
    }
}

/// Tensors of one micro-batch of `m` rows and response width `r` (the longest response):
/// padded (prompts left-padded to width `p`, responses right-padded) or packed (no padding).
pub struct MicroInputs {
    /// Padded: `[m, p + r − 1]` u32; packed: `[n]`, the rows' tokens end to end.
    pub input_ids: Tensor,
    /// As `input_ids`: u32 positions counted from each row's first real token.
    pub position_ids: Tensor,
    /// What the model needs besides ids and positions.
    pub tokens: Tokens,
    /// `[m, r]` u32: the response tokens whose log-probs are wanted.
    pub targets: Tensor,
    /// `[m, r]` f32: 1 on response tokens that count in the loss.
    pub response_mask: Tensor,
    pub response_width: usize,
    /// Each row's images (in row order; empty when no row has any): their features replace
    /// the placeholders' embeddings, and `position_ids` are then 3-D (`[3, ..]`).
    pub images: Vec<Option<std::sync::Arc<crate::model::vision::Images>>>,
    /// Where the images' features go (flat token positions of the prompts' placeholders);
    /// `None`: at every placeholder token of the input.
    pub image_at: Option<Vec<u32>>,
}

/// The layout of [`MicroInputs`]' tokens.
pub enum Tokens {
    Padded {
        /// `[m, p + r − 1]` u32, 1 on real tokens.
        key_mask: Tensor,
        /// `p`: the longest prompt.
        prompt_width: usize,
    },
    Packed {
        /// `(first token, length)` of each sequence: each row's prompt and response, or with
        /// shared prompts each prompt once and each response continuing it.
        segments: Vec<(usize, usize)>,
        /// With shared prompts: for each sequence, the prompt's sequence it continues
        /// ([`CausalLm::forward_hidden_grouped`]); `None` when nothing is shared.
        continues: Option<Vec<Option<usize>>>,
        /// `[k]` u32: for each of the `k` real response positions (row by row), the token whose
        /// hidden state predicts it.
        at: Tensor,
        /// `[1, k]` u32: their target tokens.
        targets: Tensor,
        /// `[m · r]` u32: which real position `(i, j)` is, `k` for padding.
        spread: Tensor,
    },
}

impl MicroInputs {
    /// The hidden states that predict response tokens, from `model`'s forward: `[m, r, h]`
    /// (padded: every position) or `[1, k, h]` (packed: the `k` real positions only). Per-
    /// position results on them go back to `[m, r]` with [`MicroInputs::to_rows`].
    pub fn response_hidden(&self, model: &CausalLm) -> Result<Tensor> {
        match &self.tokens {
            Tokens::Padded {
                key_mask,
                prompt_width,
            } => {
                let features = self.features(model)?;
                let (ids, pos) = (&self.input_ids, &self.position_ids);
                let hidden =
                    model.forward_hidden_images(ids, pos, key_mask, features.as_ref(), None)?; // [m, p + r − 1, h]
                hidden.narrow(1, prompt_width - 1, self.response_width)
            }
            Tokens::Packed {
                segments,
                continues,
                at,
                ..
            } => {
                let (ids, pos) = (&self.input_ids, &self.position_ids);
                let features = self.features(model)?;
                let h = match continues {
                    Some(c) => model.forward_hidden_grouped(ids, pos, segments, c)?,
                    None => {
                        model.forward_hidden_packed_images(ids, pos, segments, features.as_ref())?
                    }
                }; // [n, h]
                h.index_select(at, 0)?.unsqueeze(0) // [1, k, h]
            }
        }
    }

    /// The rows' image features from `model`'s tower, placed at the prompts' placeholders.
    fn features(&self, model: &CausalLm) -> Result<Option<crate::model::vision::VisionFeatures>> {
        let f = crate::model::vision::row_features(model, &self.images)?;
        Ok(f.map(|f| crate::model::vision::VisionFeatures {
            at: self.image_at.clone(),
            ..f
        }))
    }

    /// The targets in [`MicroInputs::response_hidden`]'s layout: `[m, r]` or `[1, k]`.
    pub fn response_targets(&self) -> &Tensor {
        match &self.tokens {
            Tokens::Padded { .. } => &self.targets,
            Tokens::Packed { targets, .. } => targets,
        }
    }

    /// `k` values per position in [`MicroInputs::response_hidden`]'s layout (`[positions, k]`)
    /// as `[m, r, k]` (packed: zeros at padding positions).
    pub fn to_rows_k(&self, values: &Tensor) -> Result<Tensor> {
        let (m, r) = self.targets.dims2()?;
        let k = values.dim(1)?;
        match &self.tokens {
            Tokens::Padded { .. } => values.reshape((m, r, k)),
            Tokens::Packed { spread, .. } => {
                let zero = Tensor::zeros((1, k), values.dtype(), values.device())?;
                Tensor::cat(&[values, &zero], 0)? // [positions + 1, k]
                    .index_select(spread, 0)?
                    .reshape((m, r, k))
            }
        }
    }

    /// `[m, r, k]` values as `[positions, k]` in [`MicroInputs::response_hidden`]'s layout (the
    /// inverse of [`MicroInputs::to_rows_k`] on real positions).
    pub fn from_rows_k(&self, values: &Tensor) -> Result<Tensor> {
        let (m, r, k) = values.dims3()?;
        let flat = values.reshape((m * r, k))?;
        match &self.tokens {
            Tokens::Padded { .. } => Ok(flat),
            Tokens::Packed { spread, at, .. } => {
                let positions = at.dim(0)?;
                let spread = spread.to_vec1::<u32>()?;
                let mut from = vec![0u32; positions];
                for (row_pos, &p) in spread.iter().enumerate() {
                    if (p as usize) < positions {
                        from[p as usize] = row_pos as u32;
                    }
                }
                let from = Tensor::from_vec(from, positions, values.device())?;
                flat.index_select(&from, 0)
            }
        }
    }

    /// Per-position values in [`MicroInputs::response_hidden`]'s layout as `[m, r]` (packed:
    /// zero at padding positions; padded: as computed there; the response mask hides both).
    pub fn to_rows(&self, values: &Tensor) -> Result<Tensor> {
        match &self.tokens {
            Tokens::Padded { .. } => Ok(values.clone()),
            Tokens::Packed { spread, .. } => {
                let flat = values.flatten_all()?; // [k]
                let zero = Tensor::zeros(1, flat.dtype(), flat.device())?;
                Tensor::cat(&[&flat, &zero], 0)? // [k + 1]: padding reads the zero
                    .index_select(spread, 0)?
                    .reshape(self.targets.shape())
            }
        }
    }
}

/// verl's `_balance_batch` on one data-parallel rank (`seqlen_balancing`): each row's workload
/// is `24576·s + s²` for its `s` prompt + response tokens; rows sorted by (workload, index) are
/// dealt out as the even positions, then the odd ones reversed (short, ..., long, ..., short).
pub fn balanced_order(seqlens: &[usize]) -> Vec<usize> {
    let workload = |s: usize| 24576u128 * s as u128 + (s as u128) * (s as u128);
    let mut sorted: Vec<usize> = (0..seqlens.len()).collect();
    sorted.sort_by_key(|&i| (workload(seqlens[i]), i));
    let evens = sorted.iter().step_by(2).copied();
    let odds: Vec<usize> = sorted.iter().skip(1).step_by(2).copied().collect();
    evens.chain(odds.into_iter().rev()).collect()
}

/// verl's `log_seqlen_unbalance` metrics (`global_seqlen/*`) for one rank: the step's token
/// total before and after balancing, their spread (0 with one rank) and the mean per rank.
pub fn seqlen_metrics(seqlens: &[usize]) -> Vec<(String, f64)> {
    let total = seqlens.iter().sum::<usize>() as f64;
    [
        ("min", total),
        ("max", total),
        ("minmax_diff", 0.0),
        ("balanced_min", total),
        ("balanced_max", total),
        ("mean", total),
    ]
    .into_iter()
    .map(|(k, v)| (format!("global_seqlen/{k}"), v))
    .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn batch() -> StepBatch {
        StepBatch::new(
            vec![vec![1, 2, 3], vec![4]],
            vec![vec![5], vec![6, 7, 8]],
            vec![0, 1],
            vec![0, 1],
            vec![false, true],
        )
    }

    const PADDED: Layout = Layout {
        pad_id: 0,
        packed: false,
        share_prefixes: false,
        image_token: None,
    };

    #[test]
    fn inputs_left_pad_prompts_and_right_pad_responses() {
        let b = batch();
        let mi = b.inputs(&[0, 1], PADDED, &Device::Cpu).unwrap();
        // p = 3, r = 3, t = 5. Row 0: 1 2 3 | 5 pad; row 1: pad pad 4 | 6 7 (8 is only a target).
        let ids: Vec<Vec<u32>> = mi.input_ids.to_vec2().unwrap();
        assert_eq!(ids, vec![vec![1, 2, 3, 5, 0], vec![0, 0, 4, 6, 7]]);
        let Tokens::Padded {
            key_mask,
            prompt_width,
        } = &mi.tokens
        else {
            panic!("padded layout asked for");
        };
        assert_eq!(*prompt_width, 3);
        let mask: Vec<Vec<u32>> = key_mask.to_vec2().unwrap();
        assert_eq!(mask, vec![vec![1, 1, 1, 1, 0], vec![0, 0, 1, 1, 1]]);
        let pos: Vec<Vec<u32>> = mi.position_ids.to_vec2().unwrap();
        assert_eq!(pos[1], vec![0, 0, 0, 1, 2]);
        assert_eq!(pos[0], vec![0, 1, 2, 3, 4]);
        let tg: Vec<Vec<u32>> = mi.targets.to_vec2().unwrap();
        assert_eq!(tg, vec![vec![5, 0, 0], vec![6, 7, 8]]);
        let rm: Vec<Vec<f32>> = mi.response_mask.to_vec2().unwrap();
        assert_eq!(rm, vec![vec![1., 0., 0.], vec![1., 1., 1.]]);
    }

    /// The same rows packed, by hand: row 0 is `1 2 3 | (5 is only a target)` (3 tokens from
    /// 0), row 1 is `4 | 6 7` (3 tokens from 3); position (i, j) reads token start_i + p_i − 1
    /// + j, padding positions read the row's first token.
    #[test]
    fn packed_inputs_lay_rows_end_to_end() {
        let b = batch();
        let packed = Layout {
            packed: true,
            ..PADDED
        };
        let mi = b.inputs(&[0, 1], packed, &Device::Cpu).unwrap();
        assert_eq!(
            mi.input_ids.to_vec1::<u32>().unwrap(),
            vec![1, 2, 3, 4, 6, 7]
        );
        assert_eq!(
            mi.position_ids.to_vec1::<u32>().unwrap(),
            vec![0, 1, 2, 0, 1, 2]
        );
        let Tokens::Packed {
            segments,
            at,
            targets,
            spread,
            continues,
        } = &mi.tokens
        else {
            panic!("packed layout asked for");
        };
        assert_eq!(segments, &vec![(0, 3), (3, 3)]);
        assert!(continues.is_none());
        // Real positions: (0, 0) read by token 2; (1, 0..3) by tokens 3, 4, 5.
        assert_eq!(at.to_vec1::<u32>().unwrap(), vec![2, 3, 4, 5]);
        assert_eq!(targets.to_vec2::<u32>().unwrap(), vec![vec![5, 6, 7, 8]]);
        assert_eq!(spread.to_vec1::<u32>().unwrap(), vec![0, 4, 4, 1, 2, 3]);
        let v = Tensor::new(&[[1f32, 2., 3., 4.]], &Device::Cpu).unwrap();
        assert_eq!(
            mi.to_rows(&v).unwrap().to_vec2::<f32>().unwrap(),
            vec![vec![1., 0., 0.], vec![2., 3., 4.]]
        );
        // Targets and the loss mask are those of the padded layout.
        let padded = b.inputs(&[0, 1], PADDED, &Device::Cpu).unwrap();
        assert_eq!(
            mi.targets.to_vec2::<u32>().unwrap(),
            padded.targets.to_vec2::<u32>().unwrap()
        );
        assert_eq!(
            mi.response_mask.to_vec2::<f32>().unwrap(),
            padded.response_mask.to_vec2::<f32>().unwrap()
        );
        assert_eq!(mi.response_width, padded.response_width);
        // An empty prompt is refused in both layouts, also beside a non-empty one (padded, it
        // would otherwise read a padding position as its last prompt token).
        let empty = StepBatch::new(
            vec![vec![1], vec![]],
            vec![vec![5], vec![6]],
            vec![0, 1],
            vec![0, 0],
            vec![false, false],
        );
        for l in [PADDED, packed] {
            for rows in [&[1usize][..], &[0, 1]] {
                let e = empty.inputs(rows, l, &Device::Cpu).err().unwrap();
                assert!(e.to_string().contains("no tokens"), "{e}");
                assert!(e.to_string().contains("batch row 1"), "{e}");
            }
        }
    }

    /// Shared prompts by hand: rows 0, 1 and 3 have prompt `1 2 3`, row 2 prompt `4`. The
    /// prompt is laid once where its first row is; each response (but its last token)
    /// continues it with positions counted on; a one-token response needs no sequence (the
    /// prompt's last token predicts it). Position (i, 0) reads the prompt's last token.
    #[test]
    fn shared_prompts_are_laid_once() {
        let b = StepBatch::new(
            vec![vec![1, 2, 3], vec![1, 2, 3], vec![4], vec![1, 2, 3]],
            vec![vec![5], vec![6, 7], vec![8, 9], vec![10, 11, 12]],
            vec![0, 0, 1, 0],
            vec![0, 0, 1, 0],
            vec![false; 4],
        );
        let shared = Layout {
            packed: true,
            share_prefixes: true,
            ..PADDED
        };
        let mi = b.inputs(&[0, 1, 2, 3], shared, &Device::Cpu).unwrap();
        assert_eq!(
            mi.input_ids.to_vec1::<u32>().unwrap(),
            vec![1, 2, 3, 6, 4, 8, 10, 11]
        );
        assert_eq!(
            mi.position_ids.to_vec1::<u32>().unwrap(),
            vec![0, 1, 2, 3, 0, 1, 3, 4]
        );
        let Tokens::Packed {
            segments,
            continues,
            at,
            targets,
            spread,
        } = &mi.tokens
        else {
            panic!("packed layout asked for");
        };
        assert_eq!(segments, &vec![(0, 3), (3, 1), (4, 1), (5, 1), (6, 2)]);
        assert_eq!(
            continues.as_deref(),
            Some(&[None, Some(0), None, Some(2), Some(0)][..])
        );
        assert_eq!(at.to_vec1::<u32>().unwrap(), vec![2, 2, 3, 4, 5, 2, 6, 7]);
        assert_eq!(
            targets.to_vec2::<u32>().unwrap(),
            vec![vec![5, 6, 7, 8, 9, 10, 11, 12]]
        );
        assert_eq!(
            spread.to_vec1::<u32>().unwrap(),
            vec![0, 8, 8, 1, 2, 8, 3, 4, 8, 5, 6, 7]
        );
        // Targets and mask as the padded layout's; a layout given a model that cannot share
        // stays as asked otherwise.
        let padded = b.inputs(&[0, 1, 2, 3], PADDED, &Device::Cpu).unwrap();
        assert_eq!(
            mi.targets.to_vec2::<u32>().unwrap(),
            padded.targets.to_vec2::<u32>().unwrap()
        );
        let asked = PADDED.sharing(true);
        assert_eq!(asked.given(true, true), shared);
        assert_eq!(asked.given(true, false), PADDED);
        assert_eq!(asked.given(false, true), PADDED);
    }

    #[test]
    fn excluded_rows_have_an_empty_loss_mask() {
        let mut b = batch();
        b.excluded[1] = true;
        for packed in [false, true] {
            let l = Layout { packed, ..PADDED };
            let mi = b.inputs(&[1], l, &Device::Cpu).unwrap();
            let rm: Vec<Vec<f32>> = mi.response_mask.to_vec2().unwrap();
            assert_eq!(rm, vec![vec![0., 0., 0.]]);
        }
        assert_eq!(b.mask_len(1), 0);
    }

    /// By hand: lengths [5, 2, 9, 2, 7] sort (workload grows with length; ties by index) to
    /// rows 1, 3, 0, 4, 2; the even positions 1, 0, 2 then the odd ones reversed 4, 3.
    #[test]
    fn balance_batch_orders_short_long_short() {
        assert_eq!(balanced_order(&[5, 2, 9, 2, 7]), vec![1, 0, 2, 4, 3]);
        assert_eq!(balanced_order(&[3]), vec![0]);
        assert!(balanced_order(&[]).is_empty());
        let m: BTreeMap<String, f64> = seqlen_metrics(&[5, 2, 9, 2, 7]).into_iter().collect();
        for k in ["min", "max", "balanced_min", "balanced_max", "mean"] {
            assert_eq!(m[&format!("global_seqlen/{k}")], 25.0, "{k}");
        }
        assert_eq!(m["global_seqlen/minmax_diff"], 0.0);
    }

    /// With shared prompts the budget counts each prompt once: three rows of one 4-token
    /// prompt with 4-token responses cost 4 + 12 = 16 together (padded: 3 × 8 = 24, so two
    /// micro-batches); a new prompt counts in full. Without sharing, or with a row count, the
    /// micro-batches are the padded rule's.
    #[test]
    fn token_budget_counts_a_shared_prompt_once() {
        let b = StepBatch::new(
            vec![vec![1; 4], vec![1; 4], vec![1; 4], vec![2; 4], vec![2; 4]],
            vec![vec![1; 4], vec![1; 4], vec![1; 4], vec![1; 9], vec![1; 3]],
            vec![0, 0, 0, 1, 1],
            vec![0, 0, 0, 1, 1],
            vec![false; 5],
        );
        let rows = [0, 1, 2, 3, 4];
        let budget = MicroBatching::TokenBudget(16);
        let shared = PADDED.sharing(true).given(true, true);
        // Rows 0-2: 4 + 3·4 = 16; row 3 starts anew (4 + 9 = 13), row 4 adds 3 → 16.
        assert_eq!(
            b.micro_batches_for(&rows, budget, shared),
            vec![vec![0, 1, 2], vec![3, 4]]
        );
        assert_eq!(
            b.micro_batches_for(&rows, budget, PADDED),
            b.micro_batches(&rows, budget)
        );
        assert_eq!(
            b.micro_batches(&rows, budget),
            vec![vec![0, 1], vec![2], vec![3], vec![4]]
        );
        let fixed = MicroBatching::Sequences(2);
        assert_eq!(
            b.micro_batches_for(&rows, fixed, shared),
            b.micro_batches(&rows, fixed)
        );
    }

    #[test]
    fn token_budget_packs_rows_by_padded_size() {
        let b = StepBatch::new(
            vec![vec![1; 4]; 5],
            vec![vec![1; 4], vec![1; 4], vec![1; 12], vec![1; 2], vec![1; 2]],
            vec![0; 5],
            vec![0; 5],
            vec![false; 5],
        );
        // Budget 16: rows 0+1 (2 × 8 = 16); row 2 alone (16 > budget but alone); rows 3+4 (2 × 6).
        let mbs = b.micro_batches(&[0, 1, 2, 3, 4], MicroBatching::TokenBudget(16));
        assert_eq!(mbs, vec![vec![0, 1], vec![2], vec![3, 4]]);
        let fixed = b.micro_batches(&[0, 1, 2, 3, 4], MicroBatching::Sequences(2));
        assert_eq!(fixed, vec![vec![0, 1], vec![2, 3], vec![4]]);
    }
}
