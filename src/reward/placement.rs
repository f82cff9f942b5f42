//! Scores on tokens: each response's reward on its last valid response token
//! (`token_level_scores`, verl's `rm_scores`).
//!
//! A zero-length response has no token to carry its reward: its row stays all zero (verl
//! writes such a score into the last, padded column, where the response mask hides it anyway;
//! we keep the padding clean). A response that is only an EOS token has length 1 and gets its
//! score on that token.

use candle_core::{DType, Device, Tensor};

/// `[batch, width]` scores: row i holds `scores[i]` at column `lens[i] - 1`.
pub fn place_on_tokens(
    scores: &[f64],
    lens: &[usize],
    width: usize,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    if scores.len() != lens.len() {
        return Err(candle_core::Error::Msg(format!(
            "{} scores for {} responses",
            scores.len(),
            lens.len()
        )));
    }
    let mut m = vec![0f64; scores.len() * width];
    for (i, (&s, &len)) in scores.iter().zip(lens).enumerate() {
        if len > width {
            return Err(candle_core::Error::Msg(format!(
                "response {i} has {len} tokens, more than the width {width}"
            )));
        }
        if len > 0 {
            m[i * width + len - 1] = s;
        }
    }
    Tensor::from_vec(m, (scores.len(), width), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_valid_token_and_empty_rows() {
        let t =
            place_on_tokens(&[1.0, -2.0, 5.0], &[3, 0, 1], 4, DType::F32, &Device::Cpu).unwrap();
        let rows: Vec<Vec<f32>> = t.to_vec2().unwrap();
        assert_eq!(rows[0], vec![0.0, 0.0, 1.0, 0.0]);
        assert_eq!(
            rows[1],
            vec![0.0; 4],
            "an empty response writes no padded column"
        );
        assert_eq!(rows[2], vec![5.0, 0.0, 0.0, 0.0]);
        assert!(place_on_tokens(&[1.0], &[5], 4, DType::F32, &Device::Cpu).is_err());
    }
}
