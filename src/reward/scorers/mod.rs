//! The built-in rule scorers, exact ports of verl's `verl/utils/reward_score/` functions, and
//! verl's `default_compute_score` dispatch on the exact `data_source` string.

pub mod gsm8k;
pub mod math;
pub mod math_dapo;
pub mod search_r1;

use serde_json::{Map, Value};

use super::{RewardError, ScoreInput, ScoreResult};

/// A configured built-in scorer (`reward.sources[*].scorer` with its `kwargs`).
#[derive(Debug, Clone, PartialEq)]
pub enum Builtin {
    Gsm8k {
        method: gsm8k::Method,
        format_score: f64,
        score: f64,
    },
    Math,
    MathDapo {
        strict_box_verify: bool,
    },
    SearchR1 {
        format_score: f64,
        score: f64,
    },
    /// verl's `default_compute_score`: chosen per row by `data_source`.
    Default,
}

/// Names accepted as `scorer`.
pub const SCORER_NAMES: [&str; 5] = ["gsm8k", "math", "math_dapo", "search_r1", "default"];

/// data_source strings `default` knows (verl's `verl/utils/reward_score/__init__.py::default_compute_score`), besides any source starting with `aime`.
pub const KNOWN_SOURCES: [&str; 14] = [
    "openai/gsm8k",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math_dapo",
    "math",
    "math_dapo_reasoning",
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
];

/// verl sources whose scorers need Python libraries or a sandbox (sympy, math-verify, code
/// execution): not built in.
const PYTHON_ONLY: [&str; 11] = [
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
    "codecontests",
    "apps",
    "codeforces",
    "taco",
    "hiyouga/geometry3k",
];

/// `s[start..=end]` where `end` is the `}` that closes the first `{` at or after `start`
/// (counting nested braces, as the MATH scorers' `last_boxed_only_string` scan does).
pub(crate) fn balanced_from(s: &str, start: usize) -> Option<&str> {
    let mut open = 0i64;
    for (i, c) in s[start..].char_indices() {
        if c == '{' {
            open += 1;
        }
        if c == '}' {
            open -= 1;
            if open == 0 {
                return Some(&s[start..start + i + 1]);
            }
        }
    }
    None
}

fn kw_f64(kwargs: &Map<String, Value>, key: &str, default: f64) -> Result<f64, RewardError> {
    match kwargs.get(key) {
        None => Ok(default),
        Some(v) => v.as_f64().ok_or_else(|| {
            RewardError::Config(format!("scorer kwarg `{key}` must be a number, got {v}"))
        }),
    }
}

impl Builtin {
    /// A scorer by name; unknown names and kwargs are errors naming them.
    pub fn from_name(name: &str, kwargs: &Map<String, Value>) -> Result<Self, RewardError> {
        let allowed: &[&str] = match name {
            "gsm8k" => &["method", "format_score", "score"],
            "search_r1" => &["format_score", "score", "method"],
            "math_dapo" => &["strict_box_verify"],
            "math" | "default" => &[],
            other => {
                return Err(RewardError::Config(format!(
                    "unknown built-in scorer `{other}`; the built-in scorers are: {}",
                    SCORER_NAMES.join(", ")
                )))
            }
        };
        if let Some(k) = kwargs.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(RewardError::Config(format!(
                "scorer `{name}` takes no argument `{k}` (it takes: {})",
                if allowed.is_empty() {
                    "none".to_string()
                } else {
                    allowed.join(", ")
                }
            )));
        }
        Ok(match name {
            "gsm8k" => {
                let method = match kwargs
                    .get("method")
                    .and_then(Value::as_str)
                    .unwrap_or("strict")
                {
                    "strict" => gsm8k::Method::Strict,
                    "flexible" => gsm8k::Method::Flexible,
                    other => {
                        return Err(RewardError::Config(format!(
                            "gsm8k `method` must be strict or flexible, got `{other}`"
                        )))
                    }
                };
                Builtin::Gsm8k {
                    method,
                    format_score: kw_f64(kwargs, "format_score", 0.0)?,
                    score: kw_f64(kwargs, "score", 1.0)?,
                }
            }
            "math" => Builtin::Math,
            "math_dapo" => Builtin::MathDapo {
                strict_box_verify: kwargs
                    .get("strict_box_verify")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            },
            "search_r1" => Builtin::SearchR1 {
                format_score: kw_f64(kwargs, "format_score", 0.0)?,
                score: kw_f64(kwargs, "score", 1.0)?,
            },
            _ => Builtin::Default,
        })
    }

    /// The scorer `default` uses for a data_source.
    pub fn for_source(data_source: &str) -> Result<Self, RewardError> {
        Ok(match data_source {
            "openai/gsm8k" => Builtin::Gsm8k { method: gsm8k::Method::Strict, format_score: 0.0, score: 1.0 },
            "lighteval/MATH" | "DigitalLearningGmbH/MATH-lighteval" | "HuggingFaceH4/MATH-500" => Builtin::Math,
            "math_dapo" | "math" | "math_dapo_reasoning" => Builtin::MathDapo { strict_box_verify: false },
            s if s.starts_with("aime") => Builtin::MathDapo { strict_box_verify: false },
            s if s.starts_with("searchR1_") && KNOWN_SOURCES.contains(&s) => Builtin::SearchR1 { format_score: 0.0, score: 1.0 },
            // A source no scorer here reads is the configuration's to fix, whatever
            // `reward.on_error` says (a failure policy would score every such row 0 or drop it).
            s if PYTHON_ONLY.contains(&s) => {
                return Err(RewardError::Config(format!(
                    "data_source `{s}`: verl scores it with a Python-only scorer (sympy / math-verify / code sandbox) that is not built in; \
                     point reward.custom_reward_function.path at a Python function for it"
                )))
            }
            other => {
                return Err(RewardError::Config(format!(
                    "no built-in reward for data_source `{other}` (matched exactly, case-sensitive); known: {}, or any source starting with `aime`. \
                     Set reward.custom_reward_function.path or reward.sources for other data",
                    KNOWN_SOURCES.join(", ")
                )))
            }
        })
    }

    /// Whether this scorer scores a row of `data_source` with verl's gsm8k rule: it compares
    /// the ground truth as text that a JSON number never equals (verl's `answer ==
    /// ground_truth` is False for a number, so such rows score 0 in verl and here; the math
    /// scorers refuse a non-string ground truth by name instead), and its non-zero scores are
    /// exactly the well-formed answers when `format_score > 0`.
    pub fn is_gsm8k_for(&self, data_source: &str) -> bool {
        match self {
            Builtin::Gsm8k { .. } => true,
            Builtin::Default => {
                matches!(Builtin::for_source(data_source), Ok(Builtin::Gsm8k { .. }))
            }
            _ => false,
        }
    }

    /// Scores one response.
    pub fn score(&self, input: &ScoreInput) -> Result<ScoreResult, RewardError> {
        let gt_str = |scorer: &str| -> Result<&str, RewardError> {
            input.ground_truth.as_str().ok_or_else(|| {
                RewardError::Score(format!(
                    "scorer {scorer} needs a string ground truth, got {}",
                    input.ground_truth
                ))
            })
        };
        match self {
            Builtin::Gsm8k {
                method,
                format_score,
                score,
            } => Ok(ScoreResult::number(gsm8k::compute_score(
                input.solution_str,
                input.ground_truth,
                *method,
                *format_score,
                *score,
            ))),
            Builtin::Math => Ok(ScoreResult::number(math::compute_score(
                input.solution_str,
                gt_str("math")?,
            ))),
            Builtin::MathDapo { strict_box_verify } => {
                let (score, acc, pred) = math_dapo::compute_score(
                    input.solution_str,
                    gt_str("math_dapo")?,
                    *strict_box_verify,
                );
                let mut extra = Map::new();
                extra.insert("acc".into(), Value::Bool(acc));
                extra.insert("pred".into(), Value::String(pred));
                Ok(ScoreResult { score, extra })
            }
            Builtin::SearchR1 {
                format_score,
                score,
            } => search_r1::compute_score(
                input.solution_str,
                input.ground_truth,
                *format_score,
                *score,
            )
            .map(ScoreResult::number)
            .map_err(RewardError::Score),
            Builtin::Default => Builtin::for_source(input.data_source)?.score(input),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn input<'a>(ds: &'a str, sol: &'a str, gt: &'a Value) -> ScoreInput<'a> {
        ScoreInput {
            data_source: ds,
            solution_str: sol,
            ground_truth: gt,
            extra_info: &Value::Null,
        }
    }

    #[test]
    fn default_dispatches_on_exact_data_source() {
        let gt = json!("42");
        assert_eq!(
            Builtin::Default
                .score(&input("openai/gsm8k", "#### 42", &gt))
                .unwrap()
                .score,
            1.0
        );
        // `math` goes to math_dapo (±1), not math_reward.
        let r = Builtin::Default
            .score(&input("math", "Answer: 42", &gt))
            .unwrap();
        assert_eq!((r.score, r.extra["acc"].clone()), (1.0, json!(true)));
        assert_eq!(
            Builtin::Default
                .score(&input("aime2024", "Answer: 41", &gt))
                .unwrap()
                .score,
            -1.0
        );
        assert_eq!(
            Builtin::Default
                .score(&input("HuggingFaceH4/MATH-500", "\\boxed{42}", &gt))
                .unwrap()
                .score,
            1.0
        );
        let t = json!({"target": ["x"]});
        assert_eq!(
            Builtin::Default
                .score(&input("searchR1_nq", "<answer>x</answer>", &t))
                .unwrap()
                .score,
            1.0
        );
        let e = Builtin::Default
            .score(&input("OpenAI/GSM8K", "#### 42", &gt))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`OpenAI/GSM8K`") && e.contains("openai/gsm8k"),
            "{e}"
        );
        let e = Builtin::Default
            .score(&input("numina_olympiads", "x", &gt))
            .unwrap_err()
            .to_string();
        assert!(e.contains("Python-only"), "{e}");
    }

    #[test]
    fn named_scorers_and_kwargs() {
        let mut kw = Map::new();
        kw.insert("method".into(), json!("flexible"));
        kw.insert("format_score".into(), json!(0.1));
        let s = Builtin::from_name("gsm8k", &kw).unwrap();
        let gt = json!("42");
        assert_eq!(s.score(&input("any", "it is 42", &gt)).unwrap().score, 1.0);
        assert_eq!(s.score(&input("any", "it is 41", &gt)).unwrap().score, 0.1);
        kw.insert("fromat_score".into(), json!(0.1));
        assert!(Builtin::from_name("gsm8k", &kw)
            .unwrap_err()
            .to_string()
            .contains("`fromat_score`"));
        assert!(Builtin::from_name("gsm9k", &Map::new())
            .unwrap_err()
            .to_string()
            .contains("gsm8k, math"));
        let e = Builtin::from_name("math", &Map::new())
            .unwrap()
            .score(&input("x", "\\boxed{1}", &json!(1)))
            .unwrap_err();
        assert!(e.to_string().contains("string ground truth"));
    }
}
