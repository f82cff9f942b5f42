//! Heads on top of the transformer's hidden states: the critic's value head (one value per
//! token, HF `*ForTokenClassification` with one label: `score.weight`, `score.bias`) and a
//! reward model's score head (HF `*ForSequenceClassification`: `score.weight`, read at the last
//! real token).

use candle_core::{DType, Result, Tensor};
use candle_nn::{Init, Linear, VarBuilder};

/// `[batch, seq, hidden] → [batch, seq]` values.
pub struct ValueHead {
    lin: Linear,
}

impl ValueHead {
    pub fn new(hidden: usize, vb: VarBuilder) -> Result<Self> {
        let w = vb.get_with_hints(
            (1, hidden),
            "score.weight",
            Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
        )?;
        let b = vb.get_with_hints(1, "score.bias", Init::Const(0.0))?;
        Ok(Self {
            lin: Linear::new(w, Some(b)),
        })
    }

    /// A view whose weights are detached from autograd (shares their storage).
    pub fn no_grad(&self) -> ValueHead {
        ValueHead {
            lin: Linear::new(
                self.lin.weight().detach(),
                self.lin.bias().map(Tensor::detach),
            ),
        }
    }

    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let (b, t, h) = hidden.dims3()?;
        let v = hidden
            .reshape((b * t, h))?
            .matmul(&self.lin.weight().t()?)?;
        let v = match self.lin.bias() {
            Some(bias) => v.broadcast_add(bias)?,
            None => v,
        };
        v.reshape((b, t))
    }
}

/// `[batch, seq, hidden] → [batch, labels]` scores at each row's last real token.
pub struct ScoreHead {
    weight: Tensor,
}

impl ScoreHead {
    pub fn new(hidden: usize, labels: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(
                (labels, hidden),
                "score.weight",
                Init::Randn {
                    mean: 0.0,
                    stdev: 0.02,
                },
            )?,
        })
    }

    /// A head over a given `[labels, hidden]` weight (read from a checkpoint).
    pub fn from_weight(weight: Tensor) -> Self {
        Self { weight }
    }

    /// `attention_mask` `[batch, seq]` (1 real, 0 padding, left or right).
    pub fn forward(&self, hidden: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let (b, t, h) = hidden.dims3()?;
        let mask: Vec<Vec<u32>> = attention_mask.to_dtype(DType::U32)?.to_vec2()?;
        let last: Vec<u32> = mask
            .iter()
            .map(|row| row.iter().rposition(|&m| m != 0).unwrap_or(t - 1) as u32)
            .collect();
        let idx = Tensor::from_vec(last, (b, 1, 1), hidden.device())?
            .broadcast_as((b, 1, h))?
            .contiguous()?;
        let picked = hidden.contiguous()?.gather(&idx, 1)?.squeeze(1)?; // [batch, hidden]
        picked.matmul(&self.weight.t()?)
    }
}
