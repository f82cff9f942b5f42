//! Loss aggregation (`loss_agg_mode`), verl's `core_algos.agg_loss` as of verl-project/verl
//! 1dda039, with b178a3c's seq-mean-token-sum-norm kept for the path that follows b178a3c's
//! workers ([`AggNorm::legacy_sum_norm`]).

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
    /// As in verl, `dp_size > 1` needs the global count of the mode (an error otherwise).
    pub dp_size: Option<f64>,
    /// seq-mean-token-sum-norm as volcengine/verl b178a3c's `agg_loss` computed it (the rows'
    /// token sums added, no mean over rows) — what b178a3c's `dp_actor` / `dp_critic` workers
    /// (`trainer.use_legacy_worker_impl=auto|enable`) optimise. `false` = verl 1dda039 (its
    /// only, engine, workers): the mean over rows with a valid token, then the divisor.
    pub legacy_sum_norm: bool,
}

/// Aggregates `loss_mat` `[batch, len]` over `mask` `[batch, len]` into a scalar.
///
/// - `token-mean`: Σ_M L / tokens,
/// - `token-sum`: Σ_M L,
/// - `seq-mean-token-sum`: per-row Σ_M L, averaged over rows with a valid token,
/// - `seq-mean-token-mean`: per-row mean_M L (denominator + 1e-8), averaged likewise,
/// - `seq-mean-token-sum-norm`: `seq-mean-token-sum` / loss_scale_factor (default: the padded
///   width `len`); with [`AggNorm::legacy_sum_norm`], Σ_rows (per-row Σ_M L) / loss_scale_factor
///   (no mean over rows).
///
/// The mean modes and token-sum multiply by `dp_size` (verl 1dda039; b178a3c's token-sum did
/// not, but it never passed a `dp_size`). A zero denominator (no valid token at all) gives 0
/// rather than verl's NaN.
pub fn agg_loss(
    loss_mat: &Tensor,
    mask: &Tensor,
    mode: LossAggMode,
    norm: AggNorm,
) -> Result<Tensor> {
    let safe = |d: f64| if d == 0.0 { 1.0 } else { d };
    let dp = norm.dp_size.unwrap_or(1.0);
    let need = |given: Option<f64>, what: &str| -> Result<()> {
        if given.is_none() && dp > 1.0 {
            return super::bail(format!(
                "agg_loss: loss_agg_mode {} with dp_size {dp} needs the global {what} (as verl's agg_loss)",
                mode.as_str()
            ));
        }
        Ok(())
    };
    match mode {
        LossAggMode::TokenMean => {
            need(norm.batch_num_tokens, "batch_num_tokens")?;
            let tokens = match norm.batch_num_tokens {
                Some(n) => n,
                None => scalar(&mask.sum_all()?)?,
            };
            masked_sum(loss_mat, mask)? / (safe(tokens) / dp)
        }
        LossAggMode::TokenSum => masked_sum(loss_mat, mask)? * dp,
        LossAggMode::SeqMeanTokenSumNorm if norm.legacy_sum_norm => {
            masked_sum(loss_mat, mask)? / horizon(loss_mat, norm)?
        }
        LossAggMode::SeqMeanTokenSum
        | LossAggMode::SeqMeanTokenMean
        | LossAggMode::SeqMeanTokenSumNorm => {
            need(norm.global_batch_size, "global_batch_size")?;
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
            let loss = (masked_sum(&seq_losses, &seq_mask)? / (safe(seqs) / dp))?;
            if mode == LossAggMode::SeqMeanTokenSumNorm {
                loss / horizon(loss_mat, norm)?
            } else {
                Ok(loss)
            }
        }
    }
}

/// The divisor of seq-mean-token-sum-norm: `loss_scale_factor`, else the padded width.
fn horizon(loss_mat: &Tensor, norm: AggNorm) -> Result<f64> {
    Ok(match norm.loss_scale_factor {
        Some(f) => f,
        None => loss_mat.dim(D::Minus1)? as f64,
    })
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
            dp_size: Some(2.0),
            ..AggNorm::default()
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
    /// mask = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]: row sums 3, 4, 0.
    /// - verl 1dda039: their mean over the 2 rows with a valid token, 3.5, over the padded
    ///   width 3 = 7/6; with global_batch_size 5 and loss_scale_factor 2: 7/5/2 = 0.7.
    /// - b178a3c (`legacy_sum_norm`): 3 + 4 = 7 over the width = 7/3, or over the factor 2 = 3.5;
    ///   the mini-batch counts play no part.
    #[test]
    fn seq_mean_token_sum_norm_both_verls() {
        let dev = Device::Cpu;
        let l = Tensor::new(&[[1f64, 2., 3.], [4., 5., 6.], [7., 8., 9.]], &dev).unwrap();
        let m = Tensor::new(&[[1f64, 1., 0.], [1., 0., 0.], [0., 0., 0.]], &dev).unwrap();
        let mode = LossAggMode::SeqMeanTokenSumNorm;
        let global = AggNorm {
            loss_scale_factor: Some(2.0),
            batch_num_tokens: Some(10.0),
            global_batch_size: Some(5.0),
            ..AggNorm::default()
        };
        let legacy = |n: AggNorm| AggNorm {
            legacy_sum_norm: true,
            ..n
        };
        for (norm, want) in [
            (AggNorm::default(), 7.0 / 6.0),
            (global, 0.7),
            (legacy(AggNorm::default()), 7.0 / 3.0),
            (legacy(global), 3.5),
        ] {
            let got = scalar(&agg_loss(&l, &m, mode, norm).unwrap()).unwrap();
            assert!((got - want).abs() < 1e-12, "{norm:?}: {got} vs {want}");
        }
    }

    /// verl's rule: with `dp_size > 1` a mean mode needs its global count, named in the error;
    /// token-sum needs none and is multiplied by dp_size (3 × 2 = 6 here).
    #[test]
    fn dp_size_without_global_counts_is_an_error() {
        let dev = Device::Cpu;
        let l = Tensor::new(&[[1f64, 2.]], &dev).unwrap();
        let m = Tensor::new(&[[1f64, 1.]], &dev).unwrap();
        let norm = AggNorm {
            dp_size: Some(2.0),
            ..AggNorm::default()
        };
        let e = agg_loss(&l, &m, LossAggMode::TokenMean, norm).unwrap_err();
        assert!(e.to_string().contains("batch_num_tokens"), "{e}");
        for mode in [
            LossAggMode::SeqMeanTokenSum,
            LossAggMode::SeqMeanTokenMean,
            LossAggMode::SeqMeanTokenSumNorm,
        ] {
            let e = agg_loss(&l, &m, mode, norm).unwrap_err();
            assert!(e.to_string().contains("global_batch_size"), "{mode:?}: {e}");
        }
        let got = scalar(&agg_loss(&l, &m, LossAggMode::TokenSum, norm).unwrap()).unwrap();
        assert_eq!(got, 6.0);
    }
}
