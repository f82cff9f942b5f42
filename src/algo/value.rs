//! The clipped value loss (verl's `core_algos.compute_value_loss`) and per-token entropy
//! (`verl/utils/torch_functional.py::entropy_from_logits`).

use candle_core::{Tensor, D};

use super::agg::{agg_loss, scalar, AggNorm};
use super::masked::masked_mean;
use super::Result;
use crate::config::LossAggMode;

/// `0.5 · agg(max((v − R)², (clip(v, V − c, V + c) − R)²))` and `vf_clipfrac`, the masked
/// fraction of tokens where the clipped term is the larger. Shapes `[batch, len]`:
/// `vpreds` (new values, differentiable), `returns`, `values` (old values), `mask`.
pub fn value_loss(
    vpreds: &Tensor,
    returns: &Tensor,
    values: &Tensor,
    mask: &Tensor,
    cliprange_value: f64,
    mode: LossAggMode,
    norm: AggNorm,
) -> Result<(Tensor, f64)> {
    let lo = (values - cliprange_value)?;
    let hi = (values + cliprange_value)?;
    let clipped = vpreds.minimum(&hi)?.maximum(&lo)?;
    let l1 = vpreds.sub(returns)?.sqr()?;
    let l2 = clipped.sub(returns)?.sqr()?;
    let loss = (agg_loss(&l1.maximum(&l2)?, mask, mode, norm)? * 0.5)?;
    let clipfrac = scalar(&masked_mean(&l2.gt(&l1)?.to_dtype(mask.dtype())?, mask)?)?;
    Ok((loss, clipfrac))
}

/// Entropy of the softmax of each row of `logits` `[n, vocab]` → `[n]`:
/// `−Σ p log p` with `log p` from a (differentiable) log-softmax. Callers that hold
/// `[batch, len, vocab]` logits pass them in chunks of rows so the whole tensor never exists.
pub fn entropy_from_logits(logits: &Tensor) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    (logp.exp()? * &logp)?.sum(D::Minus1)?.neg()
}
