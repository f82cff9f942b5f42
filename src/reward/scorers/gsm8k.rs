//! GSM8K answer check, verl's `verl/utils/reward_score/gsm8k.py` (`extract_solution`,
//! `compute_score`): the last 300 code points are searched for `#### <number>` (strict) or for
//! the last number (flexible); an exact string match with the ground truth scores `score`, any
//! other extraction `format_score`, no extraction 0.

use std::sync::LazyLock;

use regex::Regex;

use crate::reward::pystr::last_chars;

/// Extraction method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `#### <number>` required.
    Strict,
    /// The last number anywhere.
    Flexible,
}

// verl's patterns are `#### (\-?[0-9\.\,]+)` and `(\-?[0-9\.\,]+)`. The capture is the match
// minus the fixed `#### ` prefix, so plain matching (no capture groups, faster) finds the same.
static STRICT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"#### -?[0-9.,]+").expect("valid regex"));
static FLEXIBLE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"-?[0-9.,]+").expect("valid regex"));

/// The extracted answer, as verl's `extract_solution` returns it.
pub fn extract_solution(solution: &str, method: Method) -> Option<String> {
    let s = last_chars(solution, 300);
    match method {
        Method::Strict => STRICT
            .find_iter(s)
            .last()
            .map(|m| m.as_str()["#### ".len()..].replace([',', '$'], "")),
        Method::Flexible => {
            let all: Vec<&str> = FLEXIBLE.find_iter(s).map(|m| m.as_str()).collect();
            if all.is_empty() {
                return None;
            }
            // Walk backwards to the first match that is not "" or "."; if none, Python's loop
            // variable is left at the first match.
            let pick = all
                .iter()
                .rev()
                .find(|a| !matches!(**a, "" | "."))
                .unwrap_or(&all[0]);
            Some(pick.to_string())
        }
    }
}

/// `compute_score(solution_str, ground_truth, method, format_score, score)`.
pub fn compute_score(
    solution: &str,
    ground_truth: &serde_json::Value,
    method: Method,
    format_score: f64,
    score: f64,
) -> f64 {
    match extract_solution(solution, method) {
        None => 0.0,
        Some(a) if ground_truth.as_str() == Some(a.as_str()) => score,
        Some(_) => format_score,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn strict(s: &str, gt: &str) -> f64 {
        compute_score(s, &json!(gt), Method::Strict, 0.0, 1.0)
    }

    #[test]
    fn strict_extraction_corner_cases() {
        // Expected values follow the regex `#### (\-?[0-9\.\,]+)` by hand.
        assert_eq!(strict("so #### 42", "42"), 1.0);
        assert_eq!(strict("#### 1,234", "1234"), 1.0, "commas removed");
        assert_eq!(
            strict("#### $42", "42"),
            0.0,
            "`$` cannot match: no extraction"
        );
        assert_eq!(strict("#### 42.", "42"), 0.0, "the dot is kept: 42. != 42");
        assert_eq!(
            compute_score("#### 42.", &json!("42"), Method::Strict, 0.1, 1.0),
            0.1,
            "format_score"
        );
        assert_eq!(strict("####42", "42"), 0.0, "needs one space");
        assert_eq!(strict("#### 1 then #### 7", "7"), 1.0, "the last match");
        assert_eq!(strict("#### -3", "-3"), 1.0);
        assert_eq!(strict("#### ٤٢", "42"), 0.0, "[0-9] is ASCII only");
        assert_eq!(
            compute_score("#### 42", &json!(42), Method::Strict, 0.5, 1.0),
            0.5,
            "a non-string ground truth never equals"
        );
    }

    #[test]
    fn flexible_extraction_corner_cases() {
        assert_eq!(
            extract_solution("x 1,000 y", Method::Flexible).as_deref(),
            Some("1,000"),
            "commas kept"
        );
        assert_eq!(
            extract_solution("3 apples and 5.", Method::Flexible).as_deref(),
            Some("5.")
        );
        assert_eq!(
            extract_solution("total 7 . .", Method::Flexible).as_deref(),
            Some("7"),
            "skips lone dots"
        );
        assert_eq!(
            extract_solution(". .", Method::Flexible).as_deref(),
            Some("."),
            "all dots: the first match"
        );
        assert_eq!(extract_solution("no numbers", Method::Flexible), None);
    }

    #[test]
    fn last_300_code_points() {
        // The answer sits 301 code points from the end: outside the window. Multi-byte
        // characters count once each.
        let tail = "é".repeat(293);
        let inside = format!("#### 42{tail}");
        assert_eq!(inside.chars().count(), 300);
        assert_eq!(strict(&inside, "42"), 1.0);
        let outside = format!("#### 42é{tail}");
        assert_eq!(strict(&outside, "42"), 0.0, "`#` is cut off");
        let partly = format!("#### 42{}", "é".repeat(294));
        // The window starts at "### 42...": no "#### " left.
        assert_eq!(strict(&partly, "42"), 0.0);
    }
}
