//! DAPO's math check, verl's `verl/utils/reward_score/math_dapo.py` (newest: Minerva
//! `Answer:` extraction, then a raw `\boxed{}` fallback in the last 100 code points). Returns
//! score ±1 with `acc` and `pred`.

use std::sync::LazyLock;

use regex::Regex;

use crate::reward::pystr::{is_digit, last_chars, strip};

const SUBSTITUTIONS: [(&str, &str); 10] = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
];

const REMOVED: [&str; 41] = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    "\"",
    "\\dots",
];

fn re(p: &str) -> Regex {
    Regex::new(p).expect("valid regex")
}

static MATH_SPAN: LazyLock<Regex> = LazyLock::new(|| re(r"(.*?)(\$)(.*?)(\$)(.*)"));
static TEXT: LazyLock<Regex> = LazyLock::new(|| re(r"(\\text\{)(.*?)(\})"));
static TEXTBF: LazyLock<Regex> = LazyLock::new(|| re(r"(\\textbf\{)(.*?)(\})"));
static OVERLINE: LazyLock<Regex> = LazyLock::new(|| re(r"(\\overline\{)(.*?)(\})"));
static BOXED: LazyLock<Regex> = LazyLock::new(|| re(r"(\\boxed\{)(.*)(\})"));
static FRAC: LazyLock<Regex> = LazyLock::new(|| re(r"(frac)([^{])(.)"));
static SQRT: LazyLock<Regex> = LazyLock::new(|| re(r"(sqrt)([^{])"));
/// `(?i)Answer\s*:\s*([^\n]+)` with Python's `\s` (which also matches U+001C..U+001F).
static ANSWER: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?i)Answer[\s\x1c-\x1f]*:[\s\x1c-\x1f]*([^\n]+)"));

pub fn normalize_final_answer(answer: &str) -> String {
    let mut s = answer.rsplit('=').next().unwrap_or("").to_string();
    for (before, after) in SUBSTITUTIONS {
        s = s.replace(before, after);
    }
    for expr in REMOVED {
        s = s.replace(expr, "");
    }
    s = MATH_SPAN.replace_all(&s, "$$$3$$").into_owned();
    s = TEXT.replace_all(&s, "$2").into_owned();
    s = TEXTBF.replace_all(&s, "$2").into_owned();
    s = OVERLINE.replace_all(&s, "$2").into_owned();
    s = BOXED.replace_all(&s, "$2").into_owned();
    s = FRAC.replace_all(&s, "frac{$2}{$3}").into_owned();
    s = SQRT.replace_all(&s, "sqrt{$2}").into_owned();
    s = s.replace('$', "");
    if is_digit(&s.replace(',', "")) {
        s = s.replace(',', "");
    }
    strip(&s).to_string()
}

/// The last `\boxed{...}` (braces balanced), as math_dapo's `last_boxed_only_string`.
fn last_boxed(s: &str) -> Option<&str> {
    let idx = s.rfind("\\boxed{")?;
    super::balanced_from(s, idx)
}

/// The verdict and the prediction.
pub fn verify(
    solution: &str,
    ground_truth: &str,
    strict_box_verify: bool,
) -> (bool, Option<String>) {
    let boxed_pred = || {
        last_boxed(last_chars(solution, 100)).map(|b| b["\\boxed{".len()..b.len() - 1].to_string())
    };
    if strict_box_verify {
        let pred = boxed_pred();
        return (pred.as_deref() == Some(ground_truth), pred);
    }
    let extracted = ANSWER
        .captures_iter(solution)
        .last()
        .map(|c| c[1].to_string())
        .unwrap_or_else(|| "[INVALID]".into());
    let pred = normalize_final_answer(&extracted);
    let correct = pred == normalize_final_answer(ground_truth);
    if pred != "[INVALID]" {
        return (correct, Some(pred));
    }
    match boxed_pred() {
        Some(b) => (b == ground_truth, Some(b)),
        None => (correct, Some(pred)),
    }
}

/// `{score: ±1, acc, pred}`.
pub fn compute_score(
    solution: &str,
    ground_truth: &str,
    strict_box_verify: bool,
) -> (f64, bool, String) {
    let s = last_chars(solution, 300);
    let (correct, pred) = verify(s, ground_truth, strict_box_verify);
    (
        if correct { 1.0 } else { -1.0 },
        correct,
        pred.unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minerva_answers() {
        assert_eq!(
            compute_score("work...\nAnswer: 42", "42", false),
            (1.0, true, "42".into())
        );
        assert_eq!(
            compute_score("answer:\n 1,234", "1234", false).0,
            1.0,
            "\\s* spans the newline; commas of a number removed"
        );
        assert_eq!(
            compute_score("Answer: 12 inches", "12", false).0,
            1.0,
            "unit words deleted"
        );
        assert_eq!(
            normalize_final_answer("issue"),
            "is",
            "`sue` is deleted anywhere"
        );
        assert_eq!(normalize_final_answer("always"), "al");
        assert_eq!(normalize_final_answer("x = \\frac12"), "\\frac{1}{2}");
        assert_eq!(normalize_final_answer("\\text{(B)}"), "(B)");
        assert_eq!(normalize_final_answer("$\\sqrt3$"), "\\sqrt{3}");
        assert_eq!(normalize_final_answer("1,²"), "1²", "isdigit accepts ²");
        assert_eq!(
            compute_score("Answer: 7", "8", false),
            (-1.0, false, "7".into())
        );
    }

    #[test]
    fn boxed_fallback_is_raw() {
        assert_eq!(
            compute_score("so the result is \\boxed{42}", "42", false),
            (1.0, true, "42".into())
        );
        assert_eq!(
            compute_score("\\boxed{\\frac{1}{2}}", "\\frac12", false).0,
            -1.0,
            "no normalisation in the fallback"
        );
        let far = format!("\\boxed{{42}}{}", "x".repeat(100));
        assert_eq!(
            compute_score(&far, "42", false),
            (-1.0, false, "[INVALID]".into()),
            "outside the last 100 code points"
        );
        assert_eq!(
            compute_score("Answer: 3 and \\boxed{4}", "4", false).0,
            -1.0,
            "Minerva wins when it finds an answer"
        );
        assert_eq!(compute_score("\\boxed{4}", "4", true).0, 1.0);
    }
}
