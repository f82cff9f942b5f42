//! One training step's data on the host (verl's `DataProto` for a step).
//!
//! The rollout creates the rows (prompt and response ids, group ids); every later phase adds
//! per-token [`Column`]s (`old_log_probs`, `values`, `advantages`, ...). Every column has one
//! storage format: each row's values unpadded (`Vec<f32>` of the response's length). Tensors
//! are built from columns where math needs them (a micro-batch: `micro.rs`; rows padded to
//! `[m, r]`: [`pad_rows`]), and results are written back as columns. Between ranks a batch
//! travels in `dist::wire`'s format.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor};

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
    /// Σπ² of that policy at each response position (`actor.calculate_sum_pi_squared`).
    SumPiSquared,
    /// Log-probs under the frozen reference policy.
    RefLogProb,
    /// The critic's value estimates.
    Values,
    /// Scores minus the KL penalty (the scores when the KL is not in the reward).
    TokenLevelRewards,
    Advantages,
    Returns,
    /// Log-probs of the sampled tokens as the rollout computed them (`rollout.calculate_log_probs`).
    RolloutLogProbs,
    /// Rollout correction's importance weights (`algorithm.rollout_correction.rollout_is`).
    RolloutIsWeights,
    /// The response mask after rollout correction's rejection (`rollout_rs`): 0 on rejected
    /// tokens. Absent: 1 on every response token of the rows in the update.
    ResponseMask,
    /// Log-probs of the sampled tokens under the distillation teacher routed to the row
    /// (`distillation.enabled`).
    TeacherLogProbs,
}

impl Column {
    /// Every column, in a fixed order (the wire order of [`StepBatch::to_bytes`]).
    pub const ALL: [Column; 13] = [
        Column::TokenLevelScores,
        Column::OldLogProbs,
        Column::Entropys,
        Column::SumPiSquared,
        Column::RefLogProb,
        Column::Values,
        Column::TokenLevelRewards,
        Column::Advantages,
        Column::Returns,
        Column::RolloutLogProbs,
        Column::RolloutIsWeights,
        Column::ResponseMask,
        Column::TeacherLogProbs,
    ];

    /// verl's key.
    pub fn name(self) -> &'static str {
        match self {
            Column::TokenLevelScores => "token_level_scores",
            Column::OldLogProbs => "old_log_probs",
            Column::Entropys => "entropys",
            Column::SumPiSquared => "sum_pi_squared",
            Column::RefLogProb => "ref_log_prob",
            Column::Values => "values",
            Column::TokenLevelRewards => "token_level_rewards",
            Column::Advantages => "advantages",
            Column::Returns => "returns",
            Column::RolloutLogProbs => "rollout_log_probs",
            Column::RolloutIsWeights => "rollout_is_weights",
            Column::ResponseMask => "response_mask",
            Column::TeacherLogProbs => "teacher_logprobs",
        }
    }

    /// The phase (its `timing_s/*` name) that fills the column.
    pub fn phase(self) -> &'static str {
        match self {
            Column::TokenLevelScores => "reward",
            Column::OldLogProbs | Column::Entropys => "old_log_prob (actor)",
            Column::SumPiSquared => {
                "old_log_prob (actor, with actor_rollout_ref.actor.calculate_sum_pi_squared=True)"
            }
            Column::RefLogProb => "ref (reference policy)",
            Column::Values => "values (critic)",
            Column::TokenLevelRewards | Column::Advantages | Column::Returns => "adv",
            Column::RolloutLogProbs => "gen (actor_rollout_ref.rollout.calculate_log_probs)",
            Column::RolloutIsWeights | Column::ResponseMask => "adv (algorithm.rollout_correction)",
            Column::TeacherLogProbs => "teacher (distillation.enabled)",
        }
    }
}

/// The responses of one step: `prompts × n` rows, each prompt's `n` rows consecutive. Its row
/// fields travel between ranks as the head of `dist::wire`'s format, the columns as f32 bits.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
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
    /// Top-k distillation: the teacher's `k` most likely tokens at each response position
    /// (`distillation.distillation_loss.loss_mode=forward_kl_topk`); travels with the rows.
    #[serde(default)]
    pub teacher_topk: Option<TopkRows>,
    /// How each row's conversation went, when the step ran the tool agent loop.
    #[serde(default)]
    pub turns: Option<Vec<TurnStats>>,
    /// Each row's images and its prompt's 3-D rotary positions (vision-language models; empty
    /// otherwise). Not sent between ranks: each rank attaches its own rows' from the dataset.
    #[serde(skip)]
    pub images: Vec<Option<RowImages>>,
    /// The per-token columns filled so far.
    #[serde(skip)]
    columns: BTreeMap<Column, Ragged>,
}

/// A row's images (shared by the rows of its group) with the 3-D rotary positions of its
/// prompt and its rotary delta (a response token `j` sits at `prompt length + j + delta` on
/// every axis).
#[derive(Debug, Clone)]
pub struct RowImages {
    pub images: std::sync::Arc<crate::model::vision::Images>,
    pub positions: std::sync::Arc<[Vec<u32>; 3]>,
    pub delta: i64,
}

/// One row's conversation in the tool agent loop (metrics and the reward's `extra_info`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TurnStats {
    /// verl's `num_turns` (model turns + tool turns + 1; 2 for a single-turn row).
    pub num_turns: usize,
    pub tool_agent: bool,
    pub tool_calls: usize,
    pub tool_errors: usize,
    pub malformed_calls: usize,
    pub tool_rewards: Vec<f64>,
    /// The interaction's score of each user turn (verl's `turn_scores`).
    #[serde(default)]
    pub turn_scores: Vec<f64>,
    /// Interaction turns that failed (each ended its conversation).
    #[serde(default)]
    pub interaction_errors: usize,
    /// Response tokens the model generated (mask 1).
    pub model_tokens: usize,
    /// The turn-by-turn ids differ from the conversation tokenised at once.
    pub sanity_mismatch: bool,
    /// Seconds the row waited on its tools.
    #[serde(default)]
    pub tool_seconds: f64,
    /// The response as alternating runs of model tokens and appended (template and tool)
    /// tokens, their lengths starting with a model run (for dumps that show each turn).
    #[serde(default)]
    pub spans: Vec<u32>,
}

/// `k` (token id, log-prob) pairs per response position of every row, largest first: row `i`
/// holds `response_len(i) · k` of each, position by position.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TopkRows {
    pub k: usize,
    pub ids: Vec<Vec<u32>>,
    pub log_probs: Vec<Vec<f32>>,
}

impl TopkRows {
    /// Rows `rows` padded to `width` positions: `([m, width, k]` u32 ids (0 past a row's end),
    /// `[m, width, k]` f32 log-probs (0 there)`)`.
    pub fn padded(
        &self,
        rows: &[usize],
        width: usize,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let k = self.k;
        let (mut ids, mut lps) = (
            vec![0u32; rows.len() * width * k],
            vec![0f32; rows.len() * width * k],
        );
        for (i, &r) in rows.iter().enumerate() {
            let n = self.ids[r].len().min(width * k);
            ids[i * width * k..i * width * k + n].copy_from_slice(&self.ids[r][..n]);
            lps[i * width * k..i * width * k + n].copy_from_slice(&self.log_probs[r][..n]);
        }
        Ok((
            Tensor::from_vec(ids, (rows.len(), width, k), device)?,
            Tensor::from_vec(lps, (rows.len(), width, k), device)?,
        ))
    }
}

/// Per-token values of every row, `[rows][response_len]`.
pub type Ragged = Vec<Vec<f32>>;

fn wire_error(msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(crate::dist::wire::WireError(msg.to_string()).to_string())
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

    /// Attaches each row's images from `ds` (rows are its `sample` indices) with its prompt's
    /// 3-D rotary positions for a model of `args`, on `device`: nothing when `ds` has no
    /// images. A group's rows share one copy.
    pub fn attach_images(
        &mut self,
        ds: &crate::data::PromptDataset,
        args: &crate::model::ModelArgs,
        device: &Device,
    ) -> Result<()> {
        let images = crate::rollout::dataset_images(ds, &self.sample, device)?;
        if images.is_empty() {
            self.images.clear();
            return Ok(());
        }
        let Some(v) = &args.vision else {
            candle_core::bail!("the data has images but the model has no vision tower");
        };
        let mut made: std::collections::HashMap<usize, RowImages> = Default::default();
        let mut out = Vec::with_capacity(images.len());
        for (row, im) in images.into_iter().enumerate() {
            let Some(im) = im else {
                out.push(None);
                continue;
            };
            let sample = self.sample[row];
            if let Some(r) = made.get(&sample) {
                out.push(Some(r.clone()));
                continue;
            }
            let (positions, delta) = crate::model::vision::mrope_positions(
                &self.prompts[row],
                v.image_token_id,
                &im.grids,
                v.spatial_merge_size,
            )
            .map_err(|e| candle_core::Error::Msg(format!("batch row {row}: {e}")))?;
            let r = RowImages {
                images: im,
                positions: std::sync::Arc::new(positions),
                delta,
            };
            made.insert(sample, r.clone());
            out.push(Some(r));
        }
        self.images = out;
        Ok(())
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

    /// The batch as bytes for another rank (`dist::wire`): the row fields, then each filled
    /// column.
    pub fn to_bytes(&self) -> Vec<u8> {
        let filled: Vec<(&str, &Ragged)> = Column::ALL
            .into_iter()
            .filter_map(|c| self.columns.get(&c).map(|v| (c.name(), v)))
            .collect();
        crate::dist::wire::encode(self, &filled)
    }

    /// Reads [`StepBatch::to_bytes`]; every length is checked.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let (mut b, columns) = crate::dist::wire::decode::<StepBatch>(bytes, |b| b.response_lens())
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let rows = b.len();
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
        for (name, col) in columns {
            let c = Column::ALL
                .into_iter()
                .find(|c| c.name() == name)
                .ok_or_else(|| wire_error(format!("unknown column `{name}`")))?;
            b.columns.insert(c, col);
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
            // Images do not travel between ranks: a batch gathered from several is given its
            // rows' images again from the dataset (`attach_images`).
            match (out.images.is_empty(), p.images.is_empty()) {
                (false, false) => out.images.extend(p.images),
                _ => out.images.clear(),
            }
            match (&mut out.turns, p.turns) {
                (Some(a), Some(b)) => a.extend(b),
                (None, None) => {}
                _ => return Err(wire_error("agent loop turns on some ranks only")),
            }
            match (&mut out.teacher_topk, p.teacher_topk) {
                (Some(a), Some(b)) if a.k == b.k => {
                    a.ids.extend(b.ids);
                    a.log_probs.extend(b.log_probs);
                }
                (None, None) => {}
                _ => return Err(wire_error("teacher top-k tokens on some ranks only")),
            }
            for (c, v) in p.columns {
                if let Some(col) = out.columns.get_mut(&c) {
                    col.extend(v);
                }
            }
        }
        Ok(out)
    }

    /// Rows `rows` (in that order) as a batch of their own, with every filled column and
    /// ReMax baseline; the update order is dropped (it is set on a whole batch).
    pub fn select(&self, rows: &[usize]) -> StepBatch {
        fn pick<T: Clone>(v: &[T], rows: &[usize]) -> Vec<T> {
            match v.is_empty() {
                true => Vec::new(),
                false => rows.iter().map(|&r| v[r].clone()).collect(),
            }
        }
        StepBatch {
            prompts: pick(&self.prompts, rows),
            responses: pick(&self.responses, rows),
            sample: pick(&self.sample, rows),
            uid: pick(&self.uid, rows),
            truncated: pick(&self.truncated, rows),
            excluded: pick(&self.excluded, rows),
            texts: pick(&self.texts, rows),
            rewards: pick(&self.rewards, rows),
            images: pick(&self.images, rows),
            reward_baselines: self.reward_baselines.as_deref().map(|b| pick(b, rows)),
            update_order: None,
            turns: self.turns.as_deref().map(|t| pick(t, rows)),
            teacher_topk: self.teacher_topk.as_ref().map(|t| TopkRows {
                k: t.k,
                ids: pick(&t.ids, rows),
                log_probs: pick(&t.log_probs, rows),
            }),
            columns: self
                .columns
                .iter()
                .map(|(c, v)| (*c, pick(v, rows)))
                .collect(),
        }
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

    /// Response tokens of `row` in the update (excluded rows count 0, tokens rejected by
    /// rollout correction are left out).
    pub fn mask_len(&self, row: usize) -> usize {
        match (self.excluded[row], self.columns.get(&Column::ResponseMask)) {
            (true, _) => 0,
            (false, None) => self.responses[row].len(),
            (false, Some(m)) => m[row].iter().filter(|&&x| x != 0.0).count(),
        }
    }

    /// Whether token `t` of `row` is in the update (verl's `response_mask` at that position).
    pub fn token_in_update(&self, row: usize, t: usize) -> bool {
        !self.excluded[row]
            && t < self.responses[row].len()
            && self
                .columns
                .get(&Column::ResponseMask)
                .is_none_or(|m| m[row][t] != 0.0)
    }

    /// verl's `response_mask`: 1 per response token, all 0 for an excluded row, 0 on tokens
    /// rollout correction rejected.
    pub fn response_mask(&self) -> Ragged {
        (0..self.len())
            .map(|r| {
                (0..self.response_len(r))
                    .map(|t| f32::from(u8::from(self.token_in_update(r, t))))
                    .collect()
            })
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
