//! Scores on tokens: each response's reward on its last valid response token
//! (`token_level_scores`, verl's `rm_scores`).
//!
//! A zero-length response has no token to carry its reward: its row stays all zero (verl
//! writes such a score into the last, padded column, where the response mask hides it anyway;
//! we keep the padding clean). A response that is only an EOS token has length 1 and gets its
//! score on that token.

/// Each row's scores, one value per response token: row i holds `scores[i]` on its last token
/// (token `lens[i] - 1`) and zeros elsewhere; a zero-length response holds nothing.
pub fn place_rows(scores: &[f64], lens: &[usize]) -> Result<Vec<Vec<f32>>, String> {
    if scores.len() != lens.len() {
        return Err(format!(
            "{} scores for {} responses",
            scores.len(),
            lens.len()
        ));
    }
    Ok(scores
        .iter()
        .zip(lens)
        .map(|(&s, &len)| {
            let mut row = vec![0f32; len];
            if let Some(last) = row.last_mut() {
                *last = s as f32;
            }
            row
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_valid_token_and_empty_rows() {
        let rows = place_rows(&[1.0, -2.0, 5.0], &[3, 0, 1]).unwrap();
        assert_eq!(rows[0], vec![0.0, 0.0, 1.0]);
        assert!(rows[1].is_empty(), "an empty response holds no score");
        assert_eq!(rows[2], vec![5.0]);
        assert!(place_rows(&[1.0], &[5, 2]).is_err());
    }
}
