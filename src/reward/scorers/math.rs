//! Hendrycks MATH answer check, verl's `verl/utils/reward_score/math_reward.py` (from
//! lm-evaluation-harness): the last `\boxed{...}` (or the `\boxed ` form), unwrapped, compared
//! after `strip_string` normalisation; 1.0 or 0.0, and any failure (an unclosed box, an `\fbox`,
//! ...) scores 0.0 as verl's `except` does.

/// `last_boxed_only_string`.
pub fn last_boxed_only_string(s: &str) -> Option<String> {
    if s.contains("\\boxed ") {
        let after = s.rsplit("\\boxed ").next().unwrap_or("");
        return Some(format!("\\boxed {}", after.split('$').next().unwrap_or("")));
    }
    let idx = s.rfind("\\boxed").or_else(|| s.rfind("\\fbox"))?;
    super::balanced_from(s, idx).map(str::to_string)
}

/// `remove_boxed`; `None` where verl's assertions fail.
pub fn remove_boxed(s: &str) -> Option<String> {
    if s.contains("\\boxed ") {
        return s.strip_prefix("\\boxed ").map(str::to_string);
    }
    s.strip_prefix("\\boxed{")?
        .strip_suffix('}')
        .map(str::to_string)
}

/// `fix_fracs`; `None` where Python raises (a `\frac` at the very end).
fn fix_fracs(s: &str) -> Option<String> {
    let mut parts = s.split("\\frac");
    let mut out = parts.next().unwrap_or("").to_string();
    for sub in parts {
        out.push_str("\\frac");
        let chars: Vec<char> = sub.chars().collect();
        let first = *chars.first()?; // IndexError in Python
        if first == '{' {
            out.push_str(sub);
            continue;
        }
        if chars.len() < 2 {
            return Some(s.to_string());
        }
        let (a, b) = (chars[0], chars[1]);
        let post: String = chars[2..].iter().collect();
        if b != '{' {
            out.push_str(&format!("{{{a}}}{{{b}}}{post}"));
        } else {
            out.push_str(&format!("{{{a}}}{b}{post}"));
        }
    }
    Some(out)
}

/// A canonical Python `int` repr (what `"{}".format(int(x)) == x` accepts).
fn canonical_int(x: &str) -> bool {
    let digits = x.strip_prefix('-').unwrap_or(x);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
        && x != "-0"
}

/// `fix_a_slash_b`: `a/b` with integers → `\frac{a}{b}`.
fn fix_a_slash_b(s: &str) -> String {
    let parts: Vec<&str> = s.split('/').collect();
    if parts.len() == 2 && canonical_int(parts[0]) && canonical_int(parts[1]) {
        format!("\\frac{{{}}}{{{}}}", parts[0], parts[1])
    } else {
        s.to_string()
    }
}

/// `remove_right_units`; `None` where Python's assertion fails (two `\text{ `).
fn remove_right_units(s: &str) -> Option<String> {
    if s.contains("\\text{ ") {
        let splits: Vec<&str> = s.split("\\text{ ").collect();
        if splits.len() != 2 {
            return None;
        }
        return Some(splits[0].to_string());
    }
    Some(s.to_string())
}

/// `fix_sqrt`; `None` where Python raises (a `\sqrt` at the very end).
fn fix_sqrt(s: &str) -> Option<String> {
    if !s.contains("\\sqrt") {
        return Some(s.to_string());
    }
    let mut parts = s.split("\\sqrt");
    let mut out = parts.next().unwrap_or("").to_string();
    for sp in parts {
        let mut chars = sp.chars();
        let first = chars.next()?;
        if first != '{' {
            out.push_str(&format!("\\sqrt{{{first}}}{}", chars.as_str()));
        } else {
            out.push_str("\\sqrt");
            out.push_str(sp);
        }
    }
    Some(out)
}

/// `strip_string`, step by step; `None` where Python raises.
pub fn strip_string(s: &str) -> Option<String> {
    let mut s = s.replace('\n', "");
    s = s.replace("\\!", "");
    s = s.replace("\\\\", "\\");
    s = s.replace("tfrac", "frac").replace("dfrac", "frac");
    s = s.replace("\\left", "").replace("\\right", "");
    s = s.replace("^{\\circ}", "").replace("^\\circ", "");
    s = s.replace("\\$", "");
    s = remove_right_units(&s)?;
    s = s.replace("\\\\%", "").replace("\\%", "");
    s = s.replace(" .", " 0.").replace("{.", "{0.");
    if s.is_empty() {
        return Some(s);
    }
    if s.starts_with('.') {
        s = format!("0{s}");
    }
    let eq: Vec<&str> = s.split('=').collect();
    if eq.len() == 2 && eq[0].chars().count() <= 2 {
        s = eq[1].to_string();
    }
    s = fix_sqrt(&s)?;
    s = s.replace(' ', "");
    s = fix_fracs(&s)?;
    if s == "0.5" {
        s = "\\frac{1}{2}".into();
    }
    Some(fix_a_slash_b(&s))
}

/// `is_equiv`: normalised equality, or raw equality when normalisation raises.
pub fn is_equiv(a: &str, b: &str) -> bool {
    match (strip_string(a), strip_string(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

pub fn compute_score(solution: &str, ground_truth: &str) -> f64 {
    let Some(boxed) = last_boxed_only_string(solution) else {
        return 0.0;
    };
    match remove_boxed(&boxed) {
        Some(answer) if is_equiv(&answer, ground_truth) => 1.0,
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxed_forms() {
        assert_eq!(compute_score("so \\boxed{\\frac{1}{2}}", "\\frac12"), 1.0);
        assert_eq!(
            compute_score("\\boxed{0.5}", "\\frac{1}{2}"),
            1.0,
            "0.5 is rewritten"
        );
        assert_eq!(
            compute_score("\\boxed 5$ and more", "5"),
            1.0,
            "the `\\boxed ` form up to `$`"
        );
        assert_eq!(
            compute_score("\\boxed{3} but \\boxed 5", "5"),
            1.0,
            "the `\\boxed ` branch wins even after a brace box"
        );
        assert_eq!(
            compute_score("\\fbox{7}", "7"),
            0.0,
            "an \\fbox fails remove_boxed's assertion"
        );
        assert_eq!(compute_score("\\boxed{3", "3"), 0.0, "unclosed");
        assert_eq!(
            compute_score("\\boxed{\\text{(A)}}", "A"),
            0.0,
            "\\text is not unwrapped"
        );
        assert_eq!(compute_score("\\boxed{1,000}", "1000"), 0.0);
        assert_eq!(
            compute_score("\\boxed{x = 3}", "3"),
            1.0,
            "short left-hand side dropped"
        );
        assert_eq!(compute_score("\\boxed{3/4}", "\\frac{3}{4}"), 1.0);
        assert_eq!(
            compute_score("\\boxed{03/4}", "\\frac{3}{4}"),
            0.0,
            "int('03') reprs as 3: no rewrite"
        );
        assert_eq!(compute_score("\\boxed{\\sqrt2}", "\\sqrt{2}"), 1.0);
        assert_eq!(compute_score("\\boxed{90^\\circ}", "90"), 1.0);
        assert_eq!(
            compute_score("\\boxed{5\\text{ cm}}", "5"),
            1.0,
            "units on the right removed"
        );
        assert_eq!(
            compute_score("\\boxed{{1}}", "{1}"),
            1.0,
            "nested braces balanced"
        );
    }

    #[test]
    fn normalisation_that_raises_falls_back_to_raw_equality() {
        assert_eq!(strip_string("1\\text{ a}\\text{ b}"), None);
        assert_eq!(strip_string("2\\sqrt"), None);
        assert_eq!(strip_string("\\frac"), None);
        assert!(is_equiv("2\\sqrt", "2\\sqrt"));
        assert!(!is_equiv("2\\sqrt", "2 \\sqrt"));
        assert_eq!(
            strip_string("\\frac1{72}").as_deref(),
            Some("\\frac{1}{72}")
        );
        assert_eq!(
            strip_string("\\frac{1}2").as_deref(),
            Some("\\frac{1}2"),
            "not fixed, as verl"
        );
        assert_eq!(
            strip_string("a\u{a0}b").as_deref(),
            Some("a\u{a0}b"),
            "only ASCII spaces removed"
        );
    }
}
