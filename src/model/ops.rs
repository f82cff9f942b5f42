//! Element-wise compositions shared by the layers, each of candle ops with a backward pass.

use candle_core::{DType, Result, Tensor, D};

/// `x · rsqrt(mean(x²) + eps) · w`, computed in f32.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = upcast(x)?;
    let inv = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    x32.broadcast_mul(&inv)?.to_dtype(dtype)?.broadcast_mul(w)
}

/// Half-precision values in f32 for softmax-type reductions; f32 and f64 stay as they are.
pub(crate) fn upcast(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// `1 / (1 + e^{−x})`, composed of ops with backward passes.
pub(crate) fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}
