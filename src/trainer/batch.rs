//! One training step's data on the host (verl's `DataProto` for a step), and how rows of it
//! become the tensors of one forward pass.
//!
//! Every response keeps its own unpadded prompt and response ids and per-token values
//! (`Vec<f32>` of the response's length); tensors are built per micro-batch, padded only to
//! that micro-batch's longest prompt and response, so short rows never pay for long ones.

use candle_core::{DType, Device, Result, Tensor};

use crate::config::MicroBatching;

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
    /// Rows whose loss mask is zero (a reward `on_error=skip` failure).
    pub excluded: Vec<bool>,
}

/// Per-token values of every row, `[rows][response_len]`.
pub type Ragged = Vec<Vec<f32>>;

impl StepBatch {
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

    /// Each row's loss mask: 1 per response token, all 0 for an excluded row.
    pub fn loss_mask_rows(&self) -> Ragged {
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

    /// The forward-pass tensors of `rows` (see [`MicroInputs`]).
    pub fn inputs(&self, rows: &[usize], pad_id: u32, device: &Device) -> Result<MicroInputs> {
        let m = rows.len();
        let p = rows
            .iter()
            .map(|&r| self.prompts[r].len())
            .max()
            .unwrap_or(0);
        let r = rows
            .iter()
            .map(|&r| self.responses[r].len())
            .max()
            .unwrap_or(0)
            .max(1);
        if p == 0 {
            return Err(candle_core::Error::Msg(
                "a prompt with no tokens reached the trainer".into(),
            ));
        }
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
            key_mask: Tensor::from_vec(mask, (m, t), device)?,
            targets: Tensor::from_vec(targets, (m, r), device)?,
            response_mask: Tensor::from_vec(rmask, (m, r), device)?,
            prompt_width: p,
            response_width: r,
        })
    }
}

/// Tensors of one micro-batch of `m` rows, prompt width `p` (left-padded), response width `r`
/// (right-padded).
pub struct MicroInputs {
    /// `[m, p + r − 1]` u32.
    pub input_ids: Tensor,
    /// `[m, p + r − 1]` u32, counted from each row's first real token.
    pub position_ids: Tensor,
    /// `[m, p + r − 1]` u32, 1 on real tokens.
    pub key_mask: Tensor,
    /// `[m, r]` u32: the response tokens whose log-probs are wanted.
    pub targets: Tensor,
    /// `[m, r]` f32: 1 on response tokens that count in the loss.
    pub response_mask: Tensor,
    pub prompt_width: usize,
    pub response_width: usize,
}

impl MicroInputs {
    /// The hidden states that predict the response tokens: `[m, p + r − 1, h] → [m, r, h]`.
    pub fn response_hidden(&self, hidden: &Tensor) -> Result<Tensor> {
        hidden.narrow(1, self.prompt_width - 1, self.response_width)
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
        StepBatch {
            prompts: vec![vec![1, 2, 3], vec![4]],
            responses: vec![vec![5], vec![6, 7, 8]],
            sample: vec![0, 1],
            uid: vec![0, 1],
            truncated: vec![false, true],
            excluded: vec![false, false],
        }
    }

    #[test]
    fn inputs_left_pad_prompts_and_right_pad_responses() {
        let b = batch();
        let mi = b.inputs(&[0, 1], 0, &Device::Cpu).unwrap();
        // p = 3, r = 3, t = 5. Row 0: 1 2 3 | 5 pad; row 1: pad pad 4 | 6 7 (8 is only a target).
        let ids: Vec<Vec<u32>> = mi.input_ids.to_vec2().unwrap();
        assert_eq!(ids, vec![vec![1, 2, 3, 5, 0], vec![0, 0, 4, 6, 7]]);
        let mask: Vec<Vec<u32>> = mi.key_mask.to_vec2().unwrap();
        assert_eq!(mask, vec![vec![1, 1, 1, 1, 0], vec![0, 0, 1, 1, 1]]);
        let pos: Vec<Vec<u32>> = mi.position_ids.to_vec2().unwrap();
        assert_eq!(pos[1], vec![0, 0, 0, 1, 2]);
        assert_eq!(pos[0], vec![0, 1, 2, 3, 4]);
        let tg: Vec<Vec<u32>> = mi.targets.to_vec2().unwrap();
        assert_eq!(tg, vec![vec![5, 0, 0], vec![6, 7, 8]]);
        let rm: Vec<Vec<f32>> = mi.response_mask.to_vec2().unwrap();
        assert_eq!(rm, vec![vec![1., 0., 0.], vec![1., 1., 1.]]);
    }

    #[test]
    fn excluded_rows_have_an_empty_loss_mask() {
        let mut b = batch();
        b.excluded[1] = true;
        let mi = b.inputs(&[1], 0, &Device::Cpu).unwrap();
        let rm: Vec<Vec<f32>> = mi.response_mask.to_vec2().unwrap();
        assert_eq!(rm, vec![vec![0., 0., 0.]]);
        assert_eq!(b.mask_len(1), 0);
    }

    #[test]
    fn token_budget_packs_rows_by_padded_size() {
        let b = StepBatch {
            prompts: vec![vec![1; 4]; 5],
            responses: vec![vec![1; 4], vec![1; 4], vec![1; 12], vec![1; 2], vec![1; 2]],
            sample: vec![0; 5],
            uid: vec![0; 5],
            truncated: vec![false; 5],
            excluded: vec![false; 5],
        };
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
}
