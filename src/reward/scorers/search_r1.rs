//! Search-R1 exact match, verl's `verl/utils/reward_score/search_r1_like_qa_em.py`: the last
//! `<answer>...</answer>` (across lines), normalised (lower case, ASCII punctuation removed,
//! articles removed, whitespace collapsed), equal to a normalised target: `score`, or `score/4`
//! when there are more than 10 opening or closing tags; else `format_score`; no answer 0.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use crate::reward::pystr::{split_ws, strip};

static ANSWER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)<answer>(.*?)</answer>").expect("valid regex"));
static ARTICLES: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b(a|an|the)\b").expect("valid regex"));

/// Python's `string.punctuation`.
const PUNCTUATION: &str = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";

pub fn normalize_answer(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punc: String = lower
        .chars()
        .filter(|c| !PUNCTUATION.contains(*c))
        .collect();
    let no_articles = ARTICLES.replace_all(&no_punc, " ");
    split_ws(&no_articles).join(" ")
}

pub fn extract_solution(s: &str) -> Option<String> {
    ANSWER
        .captures_iter(s)
        .last()
        .map(|c| strip(&c[1]).to_string())
}

/// The targets: `ground_truth["target"]`, a string or a list of strings.
fn targets(ground_truth: &Value) -> Result<Vec<String>, String> {
    let t = ground_truth
        .get("target")
        .ok_or("search_r1 needs ground_truth = {\"target\": [...]}")?;
    match t {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| "ground_truth.target must hold strings".to_string())
            })
            .collect(),
        _ => Err("ground_truth.target must be a string or a list of strings".into()),
    }
}

pub fn compute_score(
    solution: &str,
    ground_truth: &Value,
    format_score: f64,
    score: f64,
) -> Result<f64, String> {
    let targets = targets(ground_truth)?;
    let Some(answer) = extract_solution(solution) else {
        return Ok(0.0);
    };
    let pred = normalize_answer(&answer);
    if targets.iter().any(|t| normalize_answer(t) == pred) {
        let opening = solution.matches("<answer>").count();
        let closing = solution.matches("</answer>").count();
        Ok(if opening > 10 || closing > 10 {
            score / 4.0
        } else {
            score
        })
    } else {
        Ok(format_score)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn exact_match_rules() {
        let gt = json!({"target": ["The Eiffel Tower", "eiffel tower"]});
        assert_eq!(
            compute_score("<answer> the Eiffel-Tower! </answer>", &gt, 0.0, 1.0).unwrap(),
            0.0,
            "the hyphen is removed, joining the words"
        );
        assert_eq!(
            compute_score("<answer>Eiffel Tower.</answer>", &gt, 0.0, 1.0).unwrap(),
            1.0
        );
        assert_eq!(
            compute_score(
                "<answer>a\nb</answer> then <answer>An Eiffel   tower</answer>",
                &gt,
                0.0,
                1.0
            )
            .unwrap(),
            1.0,
            "last answer, across lines"
        );
        assert_eq!(
            compute_score("<answer>Paris</answer>", &gt, 0.2, 1.0).unwrap(),
            0.2
        );
        assert_eq!(compute_score("no tags", &gt, 0.2, 1.0).unwrap(), 0.0);
        let spam = format!("{}<answer>eiffel tower</answer>", "</answer>".repeat(10));
        assert_eq!(
            compute_score(&spam, &gt, 0.0, 1.0).unwrap(),
            0.25,
            "11 closing tags"
        );
        let ten = format!("{}<answer>eiffel tower</answer>", "</answer>".repeat(9));
        assert_eq!(
            compute_score(&ten, &gt, 0.0, 1.0).unwrap(),
            1.0,
            "10 tags is fine"
        );
        // Repeated opening tags end up inside the lazy capture, so the answer no longer matches.
        let nested = format!("{}<answer>eiffel tower</answer>", "<answer>".repeat(10));
        assert_eq!(compute_score(&nested, &gt, 0.0, 1.0).unwrap(), 0.0);
        assert_eq!(normalize_answer("THE Über-Café, an Ode"), "übercafé ode");
        assert!(compute_score("<answer>x</answer>", &json!("x"), 0.0, 1.0).is_err());
    }
}
