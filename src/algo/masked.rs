//! Masked reductions (verl's `verl/utils/torch_functional.py`: `masked_sum`, `masked_mean`,
//! `masked_var`, `masked_whiten`). Shapes: `values`, `mask` `[batch, response_len]` (any shape,
//! as long as both agree); the results are scalars (0-d tensors) unless an axis is given.

use candle_core::{DType, Tensor, D};

use super::{bail, Result};

/// `values` where `mask` is non-zero, 0 elsewhere (so NaN or inf under padding never leaks).
pub fn masked_values(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let keep = mask.ne(0.0)?;
    keep.where_cond(values, &values.zeros_like()?)
}

/// Σ values·mask over all elements → scalar.
pub fn masked_sum(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    (masked_values(values, mask)? * mask)?.sum_all()
}

/// Σ values·mask / (Σ mask + 1e-8) → scalar (≈0 for an all-zero mask, as verl).
pub fn masked_mean(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let count = (mask.sum_all()? + 1e-8)?;
    masked_sum(values, mask)?.div(&count)
}

/// Per-row masked mean over the last axis: `[batch, len]` → `[batch]`.
pub fn masked_mean_rows(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let sums = (masked_values(values, mask)? * mask)?.sum(D::Minus1)?;
    let counts = (mask.sum(D::Minus1)? + 1e-8)?;
    sums.div(&counts)
}

/// Masked variance, Bessel-corrected when `unbiased` (which needs at least two masked elements;
/// verl raises otherwise, so do we).
pub fn masked_var(values: &Tensor, mask: &Tensor, unbiased: bool) -> Result<Tensor> {
    let mean = masked_mean(values, mask)?;
    let centered = values.broadcast_sub(&mean)?;
    let var = masked_mean(&centered.sqr()?, mask)?;
    if !unbiased {
        return Ok(var);
    }
    let n = mask.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    if n == 0.0 {
        return bail("masked_var: the mask selects no element");
    }
    if n == 1.0 {
        return bail("masked_var: the mask selects one element; the unbiased variance needs at least two (use a larger mini-batch)");
    }
    var * (n / (n - 1.0))
}

/// `(values - mean) / sqrt(var + 1e-8)` with masked statistics (unbiased variance);
/// without `shift_mean` the mean is added back.
pub fn masked_whiten(values: &Tensor, mask: &Tensor, shift_mean: bool) -> Result<Tensor> {
    let mean = masked_mean(values, mask)?;
    let var = masked_var(values, mask, true)?;
    let scale = (var + 1e-8)?.sqrt()?.recip()?;
    let w = values.broadcast_sub(&mean)?.broadcast_mul(&scale)?;
    if shift_mean {
        Ok(w)
    } else {
        w.broadcast_add(&mean)
    }
}

/// Host versions of the same statistics (f64), for the estimators that run on the host.
pub(crate) mod host {
    /// (mean, unbiased variance) over `values[i]` where `mask[i] != 0`.
    pub fn mean_var(values: &[f64], mask: &[f64]) -> Result<(f64, f64), String> {
        let mut s = 0.0;
        let mut n = 0.0;
        for (v, m) in values.iter().zip(mask) {
            if *m != 0.0 {
                s += v * m;
                n += m;
            }
        }
        let mean = s / (n + 1e-8);
        let mut sq = 0.0;
        for (v, m) in values.iter().zip(mask) {
            if *m != 0.0 {
                sq += (v - mean) * (v - mean) * m;
            }
        }
        let var = sq / (n + 1e-8);
        if n == 0.0 {
            return Err("whitening: the mask selects no element".into());
        }
        if n == 1.0 {
            return Err("whitening: the mask selects one element; the unbiased variance needs at least two (use a larger batch)".into());
        }
        Ok((mean, var * n / (n - 1.0)))
    }

    /// In-place masked whitening (mean shifted), as `masked_whiten`.
    pub fn whiten(values: &mut [f64], mask: &[f64]) -> Result<(), String> {
        let (mean, var) = mean_var(values, mask)?;
        let inv = 1.0 / (var + 1e-8).sqrt();
        for v in values.iter_mut() {
            *v = (*v - mean) * inv;
        }
        Ok(())
    }
}
