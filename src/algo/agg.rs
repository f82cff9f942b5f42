//! Loss aggregation (`loss_agg_mode`), verl's `core_algos.agg_loss` (newest semantics).

use candle_core::{Tensor, D};

use super::masked::{masked_sum, masked_values};
use super::Result;
use crate::config::LossAggMode;

/// Normalisers of a global mini-batch, so that micro-batches accumulated with gradient
/// accumulation add up to the mini-batch loss. `None` = this micro-batch's own count.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AggNorm {
    /// Valid tokens in the whole mini-batch (token-mean).
    pub batch_num_tokens: Option<f64>,
    /// Sequences with at least one valid token in the whole mini-batch (seq-mean-*).
    pub global_batch_size: Option<f64>,
    /// Divisor of seq-mean-token-sum-norm; `None` = the padded response length.
    pub loss_scale_factor: Option<f64>,
    /// verl's `dp_size`: the mean modes (token-mean, seq-mean-*) multiply the loss by it, for
    /// data parallelism whose gradient reduction averages over the ranks (FSDP/DDP), so that
    /// the average of the ranks' gradients is the global mini-batch's. `None` = 1: main_ppo's
    /// own reduction sums over the ranks (see `trainer::update`), so it leaves this unset.
    pub dp_size: Option<f64>,
}

/// Aggregates `loss_mat` `[batch, len]` over `mask` `[batch, len]` into a scalar.
///
/// - `token-mean`: Σ_M L / tokens,
/// - `token-sum`: Σ_M L,
/// - `seq-mean-token-sum`: per-row Σ_M L, averaged over rows with a valid token,
/// - `seq-mean-token-mean`: per-row mean_M L (denominator + 1e-8), averaged likewise,
/// - `seq-mean-token-sum-norm`: Σ_rows (per-row Σ_M L) / loss_scale_factor (default: the padded
///   width `len`); no mean over rows, so the normaliser is a constant of the run, not of the batch.
///
/// A zero denominator (no valid token at all) gives 0 rather than verl's NaN.
pub fn agg_loss(
    loss_mat: &Tensor,
    mask: &Tensor,
    mode: LossAggMode,
    norm: AggNorm,
) -> Result<Tensor> {
    let safe = |d: f64| if d == 0.0 { 1.0 } else { d };
    let dp = norm.dp_size.unwrap_or(1.0);
    match mode {
        LossAggMode::TokenMean => {
            let tokens = match norm.batch_num_tokens {
                Some(n) => n,
                None => scalar(&mask.sum_all()?)?,
            };
            masked_sum(loss_mat, mask)? / (safe(tokens) / dp)
        }
        LossAggMode::TokenSum => masked_sum(loss_mat, mask),
        LossAggMode::SeqMeanTokenSumNorm => {
            let horizon = norm
                .loss_scale_factor
                .unwrap_or(loss_mat.dim(D::Minus1)? as f64);
            masked_sum(loss_mat, mask)? / horizon
        }
        LossAggMode::SeqMeanTokenSum | LossAggMode::SeqMeanTokenMean => {
            let tokens_per_row = mask.sum(D::Minus1)?; // [batch]
            let mut seq_losses = (masked_values(loss_mat, mask)? * mask)?.sum(D::Minus1)?; // [batch]
            if mode == LossAggMode::SeqMeanTokenMean {
                seq_losses = seq_losses.div(&(&tokens_per_row + 1e-8)?)?;
            }
            let seq_mask = tokens_per_row.gt(0.0)?.to_dtype(mask.dtype())?;
            let seqs = match norm.global_batch_size {
                Some(n) => n,
                None => scalar(&seq_mask.sum_all()?)?,
            };
            masked_sum(&seq_losses, &seq_mask)? / (safe(seqs) / dp)
        }
    }
}

/// A 0-d tensor's value as f64, whatever its dtype.
pub fn scalar(t: &Tensor) -> Result<f64> {
    t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// verl's `dp_size` with global normalisers, by hand: L = [[1, 2], [3, 4]], mask =
    /// [[1, 1], [1, 0]] on one of two ranks whose whole mini-batch holds 6 tokens and 4
    /// sequences. token-mean: (1 + 2 + 3)/6 × 2 = 2; seq-mean-token-sum: (3 + 3)/4 × 2 = 3;
    /// seq-mean-token-mean: (3/2 + 3/1)/4 × 2 = 2.25 (the 1e-8 of the per-row denominator
    /// aside). Averaging the two ranks' values then gives the global mean.
    #[test]
    fn dp_size_scales_the_mean_modes() {
        let dev = Device::Cpu;
        let l = Tensor::new(&[[1f64, 2.], [3., 4.]], &dev).unwrap();
        let m = Tensor::new(&[[1f64, 1.], [1., 0.]], &dev).unwrap();
        let norm = AggNorm {
            batch_num_tokens: Some(6.0),
            global_batch_size: Some(4.0),
            loss_scale_factor: None,
            dp_size: Some(2.0),
        };
        for (mode, want) in [
            (LossAggMode::TokenMean, 2.0),
            (LossAggMode::SeqMeanTokenSum, 3.0),
            (LossAggMode::SeqMeanTokenMean, 2.25),
        ] {
            let got = scalar(&agg_loss(&l, &m, mode, norm).unwrap()).unwrap();
            assert!((got - want).abs() < 1e-7, "{mode:?}: {got} vs {want}");
        }
    }

    /// seq-mean-token-sum-norm by hand: L = [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
    /// mask = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]: row sums 3, 4, 0 add up to 7 (the empty row
    /// counts nothing and is not averaged over), divided by the padded width 3 = 7/3, or by
    /// loss_scale_factor 2 = 7/2 (verl's `agg_loss`: `sum(seq_losses) / loss_scale_factor`).
    #[test]
    fn seq_mean_token_sum_norm_sums_the_rows() {
        let dev = Device::Cpu;
        let l = Tensor::new(&[[1f64, 2., 3.], [4., 5., 6.], [7., 8., 9.]], &dev).unwrap();
        let m = Tensor::new(&[[1f64, 1., 0.], [1., 0., 0.], [0., 0., 0.]], &dev).unwrap();
        let mode = LossAggMode::SeqMeanTokenSumNorm;
        let got = scalar(&agg_loss(&l, &m, mode, AggNorm::default()).unwrap()).unwrap();
        assert!((got - 7.0 / 3.0).abs() < 1e-12, "{got}");
        let norm = AggNorm {
            loss_scale_factor: Some(2.0),
            // The mini-batch counts of the other modes play no part here.
            batch_num_tokens: Some(10.0),
            global_batch_size: Some(5.0),
            dp_size: None,
        };
        let got = scalar(&agg_loss(&l, &m, mode, norm).unwrap()).unwrap();
        assert!((got - 3.5).abs() < 1e-12, "{got}");
    }
}
