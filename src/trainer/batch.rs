//! One training step's data on the host (verl's `DataProto` for a step), and how rows of it
//! become the tensors of one forward pass.
//!
//! The rollout creates the rows (prompt and response ids, group ids); every later phase adds
//! per-token [`Column`]s (`old_log_probs`, `values`, `advantages`, ...). Every column has one
//! storage format: each row's values unpadded (`Vec<f32>` of the response's length). Tensors
//! are built from columns where math needs them (a micro-batch packed end to end or padded
//! only to its own longest prompt and response, or the whole step `[rows, max_response_len]`
//! for the estimators), and results are written back as columns.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor};

use crate::config::MicroBatching;
use crate::model::CausalLm;
use crate::reward::{RewardBatch, SampleReward};

/// A per-token column of the step, named as verl's `DataProto` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Column {
    /// Each response's reward on its last token.
    TokenLevelScores,
    /// Log-probs of the responses under the policy that sampled them.
    OldLogProbs,
    /// Entropy of that policy at each response position.
    Entropys,
    /// Log-probs under the frozen reference policy.
    RefLogProb,
    /// The critic's value estimates.
    Values,
    /// Scores minus the KL penalty (the scores when the KL is not in the reward).
    TokenLevelRewards,
    Advantages,
    Returns,
}

impl Column {
    /// Every column, in a fixed order (the wire order of [`StepBatch::to_bytes`]).
    pub const ALL: [Column; 8] = [
        Column::TokenLevelScores,
        Column::OldLogProbs,
        Column::Entropys,
        Column::RefLogProb,
        Column::Values,
        Column::TokenLevelRewards,
        Column::Advantages,
        Column::Returns,
    ];

    /// verl's key.
    pub fn name(self) -> &'static str {
        match self {
            Column::TokenLevelScores => "token_level_scores",
            Column::OldLogProbs => "old_log_probs",
            Column::Entropys => "entropys",
            Column::RefLogProb => "ref_log_prob",
            Column::Values => "values",
            Column::TokenLevelRewards => "token_level_rewards",
            Column::Advantages => "advantages",
            Column::Returns => "returns",
        }
    }

    /// The phase (its `timing_s/*` name) that fills the column.
    pub fn phase(self) -> &'static str {
        match self {
            Column::TokenLevelScores => "reward",
            Column::OldLogProbs | Column::Entropys => "old_log_prob (actor)",
            Column::RefLogProb => "ref (reference policy)",
            Column::Values => "values (critic)",
            Column::TokenLevelRewards | Column::Advantages | Column::Returns => "adv",
        }
    }
}

/// The responses of one step: `prompts × n` rows, each prompt's `n` rows consecutive.
#[derive(Debug, Clone, Default)]
pub struct StepBatch {
    /// Prompt ids of each row (unpadded).
    pub prompts: Vec<Vec<u32>>,
    /// Response ids of each row, EOS included when it ended the row.
    pub responses: Vec<Vec<u32>>,
    /// Dataset index of each row's prompt.
    pub sample: Vec<usize>,
    /// Group id (verl's `uid`): rows of the same prompt share it.
    pub uid: Vec<u64>,
    /// Whether the response hit `response_length` without an EOS.
    pub truncated: Vec<bool>,
    /// Rows whose loss mask is zero (a reward `on_error=skip` failure, a `skip_update` gate):
    /// the `response_mask` column is 1 on every response token of the other rows.
    pub excluded: Vec<bool>,
    /// Each response as text, special tokens removed (what reward functions read).
    pub texts: Vec<String>,
    /// Each row's reward (from the reward phase).
    pub rewards: Vec<SampleReward>,
    /// ReMax: each row's baseline (the reward of its prompt's greedy response).
    pub reward_baselines: Option<Vec<f64>>,
    /// The order the updates split rows into mini- and micro-batches in (`trainer.balance_batch`);
    /// `None` = row order. The rows themselves stay grouped by prompt.
    pub update_order: Option<Vec<usize>>,
    /// The per-token columns filled so far.
    columns: BTreeMap<Column, Ragged>,
}

/// Per-token values of every row, `[rows][response_len]`.
pub type Ragged = Vec<Vec<f32>>;

/// The rows of a [`StepBatch`] on the wire (its columns follow as raw f32 bits).
#[derive(serde::Serialize, serde::Deserialize)]
struct WireRows {
    prompts: Vec<Vec<u32>>,
    responses: Vec<Vec<u32>>,
    sample: Vec<usize>,
    uid: Vec<u64>,
    truncated: Vec<bool>,
    excluded: Vec<bool>,
    texts: Vec<String>,
    rewards: Vec<SampleReward>,
    reward_baselines: Option<Vec<f64>>,
    update_order: Option<Vec<usize>>,
    /// Names of the columns that follow, in order.
    columns: Vec<String>,
}

fn wire_error(msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("a step batch from another rank: {msg}"))
}

impl StepBatch {
    /// The rows of a rollout: `uid` groups them, `truncated` says which hit the length limit.
    pub fn new(
        prompts: Vec<Vec<u32>>,
        responses: Vec<Vec<u32>>,
        sample: Vec<usize>,
        uid: Vec<u64>,
        truncated: Vec<bool>,
    ) -> Self {
        let rows = responses.len();
        Self {
            prompts,
            responses,
            sample,
            uid,
            truncated,
            excluded: vec![false; rows],
            ..Self::default()
        }
    }

    /// Takes the reward phase's output: each row's reward, `token_level_scores`, and the rows
    /// left out of the update.
    pub fn add_rewards(&mut self, scored: RewardBatch) -> Result<()> {
        if scored.rewards.len() != self.len() || scored.excluded.len() != self.len() {
            return Err(candle_core::Error::Msg(format!(
                "the reward stage returned {} rewards for {} responses",
                scored.rewards.len(),
                self.len()
            )));
        }
        self.set(Column::TokenLevelScores, scored.token_level_scores)?;
        self.rewards = scored.rewards;
        self.excluded = scored.excluded;
        Ok(())
    }

    /// The batch as bytes for another rank: the rows as JSON (lengths first), then each filled
    /// column's values as little-endian f32 bits, row after row (exact, unlike decimal text).
    pub fn to_bytes(&self) -> Vec<u8> {
        let filled: Vec<Column> = Column::ALL
            .into_iter()
            .filter(|c| self.columns.contains_key(c))
            .collect();
        let rows = WireRows {
            prompts: self.prompts.clone(),
            responses: self.responses.clone(),
            sample: self.sample.clone(),
            uid: self.uid.clone(),
            truncated: self.truncated.clone(),
            excluded: self.excluded.clone(),
            texts: self.texts.clone(),
            rewards: self.rewards.clone(),
            reward_baselines: self.reward_baselines.clone(),
            update_order: self.update_order.clone(),
            columns: filled.iter().map(|c| c.name().to_string()).collect(),
        };
        let json = serde_json::to_vec(&rows).unwrap_or_default();
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&json);
        for c in filled {
            for row in &self.columns[&c] {
                for v in row {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        out
    }

    /// Reads [`StepBatch::to_bytes`]; every length is checked.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let head = bytes
            .get(..8)
            .ok_or_else(|| wire_error("shorter than its header"))?;
        let n = u64::from_le_bytes(head.try_into().map_err(wire_error)?) as usize;
        let json = bytes
            .get(8..8 + n)
            .ok_or_else(|| wire_error("shorter than its row data"))?;
        let w: WireRows = serde_json::from_slice(json).map_err(wire_error)?;
        let rows = w.responses.len();
        let lens: Vec<usize> = w.responses.iter().map(Vec::len).collect();
        let mut b = StepBatch {
            prompts: w.prompts,
            responses: w.responses,
            sample: w.sample,
            uid: w.uid,
            truncated: w.truncated,
            excluded: w.excluded,
            texts: w.texts,
            rewards: w.rewards,
            reward_baselines: w.reward_baselines,
            update_order: w.update_order,
            columns: BTreeMap::new(),
        };
        let per_row = [
            b.prompts.len(),
            b.sample.len(),
            b.uid.len(),
            b.truncated.len(),
            b.excluded.len(),
        ];
        if per_row.iter().any(|&k| k != rows) {
            return Err(wire_error(format!(
                "row fields of unequal lengths {per_row:?} for {rows} responses"
            )));
        }
        let mut at = 8 + n;
        for name in &w.columns {
            let c = Column::ALL
                .into_iter()
                .find(|c| c.name() == name)
                .ok_or_else(|| wire_error(format!("unknown column `{name}`")))?;
            let mut col: Ragged = Vec::with_capacity(rows);
            for &l in &lens {
                let raw = bytes
                    .get(at..at + 4 * l)
                    .ok_or_else(|| wire_error(format!("column `{name}` is cut short")))?;
                col.push(
                    raw.chunks_exact(4)
                        .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                        .collect(),
                );
                at += 4 * l;
            }
            b.columns.insert(c, col);
        }
        if at != bytes.len() {
            return Err(wire_error(format!("{} bytes left over", bytes.len() - at)));
        }
        Ok(b)
    }

    /// The rows of `parts` one after the other (the ranks' shares in rank order). Every part
    /// must hold the same columns; update orders are dropped (they are set on the whole batch).
    pub fn concat(parts: Vec<StepBatch>) -> Result<Self> {
        let mut it = parts.into_iter();
        let mut out = it.next().unwrap_or_default();
        out.update_order = None;
        for (k, p) in it.enumerate() {
            let keys: Vec<Column> = p.columns.keys().copied().collect();
            let mine: Vec<Column> = out.columns.keys().copied().collect();
            if keys != mine {
                return Err(wire_error(format!(
                    "part {} holds columns {keys:?}, part 0 {mine:?}",
                    k + 1
                )));
            }
            match (&mut out.reward_baselines, p.reward_baselines) {
                (Some(a), Some(b)) => a.extend(b),
                (None, None) => {}
                _ => return Err(wire_error("ReMax baselines on some ranks only")),
            }
            out.prompts.extend(p.prompts);
            out.responses.extend(p.responses);
            out.sample.extend(p.sample);
            out.uid.extend(p.uid);
            out.truncated.extend(p.truncated);
            out.excluded.extend(p.excluded);
            out.texts.extend(p.texts);
            out.rewards.extend(p.rewards);
            for (c, v) in p.columns {
                if let Some(col) = out.columns.get_mut(&c) {
                    col.extend(v);
                }
            }
        }
        Ok(out)
    }

    /// A filled column; an error names the column and the phase that fills it.
    pub fn column(&self, c: Column) -> Result<&Ragged> {
        self.columns.get(&c).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "the step has no `{}` yet: the {} phase fills it",
                c.name(),
                c.phase()
            ))
        })
    }

    /// Whether a column is filled.
    pub fn has(&self, c: Column) -> bool {
        self.columns.contains_key(&c)
    }

    /// Fills (or replaces) a column; every row must hold one value per response token.
    pub fn set(&mut self, c: Column, values: Ragged) -> Result<()> {
        let bad =
            (0..self.len()).find(|&r| values.get(r).map(Vec::len) != Some(self.response_len(r)));
        if values.len() != self.len() || bad.is_some() {
            return Err(candle_core::Error::Msg(format!(
                "`{}` must hold one value per response token of each of the {} rows (row {} differs)",
                c.name(),
                self.len(),
                bad.unwrap_or(values.len().min(self.len()))
            )));
        }
        self.columns.insert(c, values);
        Ok(())
    }

    /// A column as one zero-padded tensor `[rows, max_response_len]`.
    pub fn dense(&self, c: Column, device: &Device) -> Result<Tensor> {
        dense(self.column(c)?, self.max_response_len(), device)
    }

    /// Fills a column from a `[rows, max_response_len]` tensor (each row trimmed to its response).
    pub fn set_dense(&mut self, c: Column, t: &Tensor) -> Result<()> {
        let rows: Vec<usize> = (0..self.len()).collect();
        let mut out: Ragged = vec![Vec::new(); self.len()];
        scatter_rows(t, &rows, &self.response_lens(), &mut out)?;
        self.set(c, out)
    }

    /// A column's values of `rows` as a zero-padded `[rows, width]` tensor (one micro-batch).
    pub fn rows(&self, c: Column, rows: &[usize], width: usize, device: &Device) -> Result<Tensor> {
        pad_rows(self.column(c)?, rows, width, device)
    }

    /// Each row's response length in tokens.
    pub fn response_lens(&self) -> Vec<usize> {
        self.responses.iter().map(Vec::len).collect()
    }

    pub fn len(&self) -> usize {
        self.responses.len()
    }

    pub fn is_empty(&self) -> bool {
        self.responses.is_empty()
    }

    pub fn response_len(&self, row: usize) -> usize {
        self.responses[row].len()
    }

    /// Tokens (prompt + response) of each row.
    pub fn seq_len(&self, row: usize) -> usize {
        self.prompts[row].len() + self.responses[row].len()
    }

    /// Response tokens of every row in the update (excluded rows count 0).
    pub fn mask_len(&self, row: usize) -> usize {
        if self.excluded[row] {
            0
        } else {
            self.responses[row].len()
        }
    }

    /// verl's `response_mask`: 1 per response token, all 0 for an excluded row.
    pub fn response_mask(&self) -> Ragged {
        (0..self.len())
            .map(|r| vec![if self.excluded[r] { 0.0 } else { 1.0 }; self.response_len(r)])
            .collect()
    }

    /// The longest response (at least 1, so tensors are never empty).
    pub fn max_response_len(&self) -> usize {
        self.responses
            .iter()
            .map(Vec::len)
            .max()
            .unwrap_or(0)
            .max(1)
    }

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

    /// The forward-pass tensors of `rows` (see [`MicroInputs`]), padded or packed as `layout`
    /// says.
    /// A row with an empty prompt is refused: no token would predict its first response token.
    pub fn inputs(&self, rows: &[usize], layout: Layout, device: &Device) -> Result<MicroInputs> {
        if let Some(&row) = rows.iter().find(|&&r| self.prompts[r].is_empty()) {
            return Err(candle_core::Error::Msg(format!(
                "a prompt with no tokens reached the trainer (batch row {row})"
            )));
        }
        if layout.packed {
            return self.packed_inputs(rows, layout.pad_id, device);
        }
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
            let keep = !self.excluded[row];
            for j in 0..r {
                targets.push(rs.get(j).copied().unwrap_or(pad_id));
                rmask.push(if j < rs.len() && keep { 1f32 } else { 0f32 });
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
    fn packed_inputs(&self, rows: &[usize], pad_id: u32, device: &Device) -> Result<MicroInputs> {
        let m = rows.len();
        let r = self.response_width(rows);
        let (mut ids, mut pos, mut segments) = (Vec::new(), Vec::new(), Vec::with_capacity(m));
        // The real response positions: the token predicting each, its target; and for every
        // position (i, j) of `[m, r]` which of them it is (padding: the zero after the last).
        let (mut at, mut real_targets, mut spread) = (Vec::new(), Vec::new(), Vec::new());
        let mut padding = Vec::new();
        let mut targets = Vec::with_capacity(m * r);
        let mut rmask = Vec::with_capacity(m * r);
        for &row in rows {
            let (pr, rs) = (&self.prompts[row], &self.responses[row]);
            let start = ids.len();
            // Token k of the sequence (prompt, then response but its last token) predicts
            // response token k − (prompt length − 1).
            ids.extend_from_slice(pr);
            ids.extend_from_slice(&rs[..rs.len().saturating_sub(1)]);
            let len = ids.len() - start;
            pos.extend(0..len as u32);
            segments.push((start, len));
            let keep = !self.excluded[row];
            for j in 0..r {
                if j < rs.len() {
                    spread.push(at.len() as u32);
                    at.push((start + pr.len() - 1 + j) as u32);
                    real_targets.push(rs[j]);
                } else {
                    padding.push(spread.len());
                    spread.push(0);
                }
                targets.push(rs.get(j).copied().unwrap_or(pad_id));
                rmask.push(if j < rs.len() && keep { 1f32 } else { 0f32 });
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
        Ok(MicroInputs {
            input_ids: Tensor::from_vec(ids, n, device)?,
            position_ids: Tensor::from_vec(pos, n, device)?,
            tokens: Tokens::Packed {
                segments,
                at: Tensor::from_vec(at, k, device)?,
                targets: Tensor::from_vec(real_targets, (1, k), device)?,
                spread: Tensor::from_vec(spread, m * r, device)?,
            },
            targets: Tensor::from_vec(targets, (m, r), device)?,
            response_mask: Tensor::from_vec(rmask, (m, r), device)?,
            response_width: r,
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
}

impl Layout {
    /// The layout `model` asks for (`use_remove_padding`), with padding id `pad_id`.
    pub fn of(pad_id: u32, model: &crate::config::ModelConfig) -> Layout {
        Layout {
            pad_id,
            packed: model.use_remove_padding,
        }
    }

    /// This layout as a model can run it: packed only where `packs` (the model's
    /// [`CausalLm::packs_without_padding`]), padded otherwise.
    pub fn given(self, packs: bool) -> Layout {
        Layout {
            packed: self.packed && packs,
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
        /// `(first token, length)` of each row's sequence.
        segments: Vec<(usize, usize)>,
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
                let hidden =
                    model.forward_hidden(&self.input_ids, &self.position_ids, key_mask, None)?; // [m, p + r − 1, h]
                hidden.narrow(1, prompt_width - 1, self.response_width)
            }
            Tokens::Packed { segments, at, .. } => model
                .forward_hidden_packed(&self.input_ids, &self.position_ids, segments)? // [n, h]
                .index_select(at, 0)?
                .unsqueeze(0), // [1, k, h]
        }
    }

    /// The targets in [`MicroInputs::response_hidden`]'s layout: `[m, r]` or `[1, k]`.
    pub fn response_targets(&self) -> &Tensor {
        match &self.tokens {
            Tokens::Padded { .. } => &self.targets,
            Tokens::Packed { targets, .. } => targets,
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

/// `[m, r]` tensor of `rows`' ragged values, zero-padded.
pub fn pad_rows(values: &Ragged, rows: &[usize], width: usize, device: &Device) -> Result<Tensor> {
    let mut out = vec![0f32; rows.len() * width];
    for (i, &row) in rows.iter().enumerate() {
        let v = &values[row];
        let n = v.len().min(width);
        out[i * width..i * width + n].copy_from_slice(&v[..n]);
    }
    Tensor::from_vec(out, (rows.len(), width), device)
}

/// Writes a `[m, r]` tensor back into `rows` of `dst`, each trimmed to its response length.
pub fn scatter_rows(t: &Tensor, rows: &[usize], lens: &[usize], dst: &mut Ragged) -> Result<()> {
    let v: Vec<Vec<f32>> = t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec2()?;
    for (i, &row) in rows.iter().enumerate() {
        dst[row] = v[i][..lens[row]].to_vec();
    }
    Ok(())
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

/// All rows' values as one `[rows, width]` tensor (for the advantage estimators).
pub fn dense(values: &Ragged, width: usize, device: &Device) -> Result<Tensor> {
    let rows: Vec<usize> = (0..values.len()).collect();
    pad_rows(values, &rows, width, device)
}

#[cfg(test)]
mod tests {
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
        } = &mi.tokens
        else {
            panic!("packed layout asked for");
        };
        assert_eq!(segments, &vec![(0, 3), (3, 3)]);
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

    #[test]
    fn pad_and_scatter_round_trip() {
        let vals: Ragged = vec![vec![1.0], vec![2.0, 3.0, 4.0]];
        let t = pad_rows(&vals, &[1, 0], 3, &Device::Cpu).unwrap();
        assert_eq!(
            t.to_vec2::<f32>().unwrap(),
            vec![vec![2., 3., 4.], vec![1., 0., 0.]]
        );
        let mut back: Ragged = vec![vec![]; 2];
        scatter_rows(&t, &[1, 0], &[1, 3], &mut back).unwrap();
        assert_eq!(back, vals);
    }

    #[test]
    fn a_missing_column_names_itself_and_its_phase() {
        let mut b = batch();
        let e = b.column(Column::Values).unwrap_err().to_string();
        assert!(e.contains("`values`") && e.contains("critic"), "{e}");
        // One value per response token of every row, or the column is refused.
        let e = b
            .set(Column::Advantages, vec![vec![1.0], vec![1.0, 2.0]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("advantages") && e.contains("row 1"), "{e}");
        b.set(Column::Advantages, vec![vec![1.0], vec![1.0, 2.0, 3.0]])
            .unwrap();
        let t = b.dense(Column::Advantages, &Device::Cpu).unwrap();
        assert_eq!(
            t.to_vec2::<f32>().unwrap(),
            vec![vec![1., 0., 0.], vec![1., 2., 3.]]
        );
        b.set_dense(Column::Returns, &t).unwrap();
        assert_eq!(
            b.column(Column::Returns).unwrap(),
            b.column(Column::Advantages).unwrap()
        );
    }
}
