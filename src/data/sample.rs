//! One dataset row as the trainer and the reward stage see it.

use serde_json::Value;

use super::read::kind;
use super::DataError;

/// One prompt with what the reward needs. `raw` keeps the whole row (every column) for reward
/// functions that take the row (`data`, `row`, `item` parameters).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// File the row came from, and its 0-based row number there.
    pub file: String,
    pub row: usize,
    /// The reward source (column `data.reward_fn_key`, `data_source` by default).
    pub data_source: String,
    /// Chat messages, each an object with string `role` and `content` (other keys kept).
    pub prompt: Vec<Value>,
    /// `reward_model.ground_truth`: any JSON value (a string for gsm8k, `{"target": [...]}` for search-r1).
    pub ground_truth: Value,
    /// `extra_info`, or `{}` when missing or null (as verl).
    pub extra_info: Value,
    /// `ability`, when present.
    pub ability: Option<String>,
    /// The whole row.
    pub raw: Value,
}

impl Sample {
    /// Builds a sample from a row, checking the columns verl's trainer needs.
    pub fn from_row(
        file: &str,
        row: usize,
        raw: Value,
        prompt_key: &str,
        source_key: &str,
    ) -> Result<Sample, DataError> {
        let err = |column: &str, message: String| DataError::Row {
            file: file.to_string(),
            row,
            column: column.to_string(),
            message,
        };
        let obj = raw.as_object().ok_or_else(|| {
            err(
                "*",
                format!("a row must be an object, found {}", kind(&raw)),
            )
        })?;
        let columns = || obj.keys().cloned().collect::<Vec<_>>().join(", ");
        let prompt = Self::prompt_of(obj, prompt_key, &err)?;

        let data_source = match obj.get(source_key) {
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(err(
                    source_key,
                    format!("expected a string, found {}", kind(other)),
                ))
            }
            None => {
                return Err(err(
                    source_key,
                    format!(
                        "missing (the row has: {}); the reward is chosen by it",
                        columns()
                    ),
                ))
            }
        };

        let ground_truth = match obj.get("reward_model") {
            Some(Value::Object(rm)) => match rm.get("ground_truth") {
                Some(Value::Null) | None => {
                    return Err(err(
                        "reward_model.ground_truth",
                        "missing; each row needs the answer its reward is checked against".into(),
                    ))
                }
                Some(v) => v.clone(),
            },
            Some(Value::Null) | None => {
                return Err(err(
                    "reward_model",
                    format!(
                        "missing (the row has: {}); expected {{\"ground_truth\": ...}}",
                        columns()
                    ),
                ))
            }
            Some(other) => {
                return Err(err(
                    "reward_model",
                    format!(
                        "expected an object with `ground_truth`, found {}",
                        kind(other)
                    ),
                ))
            }
        };

        let extra_info = match obj.get("extra_info") {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(other) => {
                return Err(err(
                    "extra_info",
                    format!("expected an object, found {}", kind(other)),
                ))
            }
        };
        let ability = match obj.get("ability") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                return Err(err(
                    "ability",
                    format!("expected a string, found {}", kind(other)),
                ))
            }
        };
        Ok(Sample {
            file: file.to_string(),
            row,
            data_source,
            prompt,
            ground_truth,
            extra_info,
            ability,
            raw,
        })
    }

    /// A row with only its prompt checked (`main_ppo generate`, verl's `main_generation`, needs
    /// nothing else): the reward columns are read when present and well-formed, else left empty
    /// (`data_source` "", `ground_truth` null, `extra_info` {}); every column is kept in `raw`.
    pub fn prompt_only(
        file: &str,
        row: usize,
        raw: Value,
        prompt_key: &str,
        source_key: &str,
    ) -> Result<Sample, DataError> {
        let err = |column: &str, message: String| DataError::Row {
            file: file.to_string(),
            row,
            column: column.to_string(),
            message,
        };
        let obj = raw.as_object().ok_or_else(|| {
            err(
                "*",
                format!("a row must be an object, found {}", kind(&raw)),
            )
        })?;
        let prompt = Self::prompt_of(obj, prompt_key, &err)?;
        let data_source = obj
            .get(source_key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let ground_truth = obj
            .get("reward_model")
            .and_then(|rm| rm.get("ground_truth"))
            .cloned()
            .unwrap_or(Value::Null);
        let extra_info = match obj.get("extra_info") {
            Some(v @ Value::Object(_)) => v.clone(),
            _ => Value::Object(Default::default()),
        };
        let ability = obj
            .get("ability")
            .and_then(Value::as_str)
            .map(str::to_string);
        Ok(Sample {
            file: file.to_string(),
            row,
            data_source,
            prompt,
            ground_truth,
            extra_info,
            ability,
            raw,
        })
    }

    /// The chat messages in column `prompt_key`, checked: a non-empty list of objects with
    /// string `role` and `content`.
    fn prompt_of(
        obj: &serde_json::Map<String, Value>,
        prompt_key: &str,
        err: &dyn Fn(&str, String) -> DataError,
    ) -> Result<Vec<Value>, DataError> {
        Ok(match obj.get(prompt_key) {
            None => return Err(err(prompt_key, format!("missing (the row has: {}); set data.prompt_key to the prompt column", obj.keys().cloned().collect::<Vec<_>>().join(", ")))),
            Some(Value::Array(msgs)) if msgs.is_empty() => return Err(err(prompt_key, "the chat list is empty".into())),
            Some(Value::Array(msgs)) => {
                for (i, m) in msgs.iter().enumerate() {
                    let Some(mo) = m.as_object() else {
                        return Err(err(prompt_key, format!("message {i} must be an object with `role` and `content`, found {}", kind(m))));
                    };
                    match mo.get("role") {
                        Some(Value::String(_)) => {}
                        Some(v) => return Err(err(prompt_key, format!("message {i}: `role` must be a string, found {}", kind(v)))),
                        None => return Err(err(prompt_key, format!("message {i} has no `role`"))),
                    }
                    match mo.get("content") {
                        Some(Value::String(_)) => {}
                        Some(v) => {
                            return Err(err(
                                prompt_key,
                                format!("message {i}: `content` must be a string, found {} (multimodal content is not supported)", kind(v)),
                            ))
                        }
                        None => return Err(err(prompt_key, format!("message {i} has no `content`"))),
                    }
                }
                msgs.clone()
            }
            Some(Value::String(_)) => {
                return Err(err(
                    prompt_key,
                    "expected a chat list like [{\"role\": \"user\", \"content\": \"...\"}], found a plain string".into(),
                ))
            }
            Some(other) => return Err(err(prompt_key, format!("expected a chat list of {{role, content}} messages, found {}", kind(other)))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gsm8k_row() -> Value {
        json!({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "1+1?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"index": 0, "split": "train"}
        })
    }

    fn fail(row: Value) -> String {
        Sample::from_row("f.parquet", 3, row, "prompt", "data_source")
            .unwrap_err()
            .to_string()
    }

    /// `generate` needs the prompt only: a row without reward columns is read, odd extra
    /// columns are kept untouched in `raw`, and a bad prompt is still an error naming it.
    #[test]
    fn prompt_only_rows_need_just_the_prompt() {
        let row = json!({"q": [{"role": "user", "content": "hi"}], "id": 7, "extra_info": "x"});
        assert!(Sample::from_row("f", 0, row.clone(), "q", "data_source").is_err());
        let s = Sample::prompt_only("f", 0, row.clone(), "q", "data_source").unwrap();
        assert_eq!(s.prompt, vec![json!({"role": "user", "content": "hi"})]);
        assert_eq!(
            (s.data_source.as_str(), &s.ground_truth),
            ("", &Value::Null)
        );
        assert_eq!(s.raw, row);
        let full = Sample::prompt_only("f", 0, gsm8k_row(), "prompt", "data_source").unwrap();
        assert_eq!(
            full,
            Sample::from_row("f", 0, gsm8k_row(), "prompt", "data_source").unwrap()
        );
        let e = Sample::prompt_only("f.jsonl", 2, json!({"id": 1}), "q", "data_source")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("f.jsonl, row 2, column `q`") && e.contains("data.prompt_key"),
            "{e}"
        );
    }

    #[test]
    fn reads_a_verl_row() {
        let s = Sample::from_row("f", 0, gsm8k_row(), "prompt", "data_source").unwrap();
        assert_eq!(s.data_source, "openai/gsm8k");
        assert_eq!(s.ground_truth, json!("2"));
        assert_eq!(s.extra_info["index"], json!(0));
        assert_eq!(s.ability.as_deref(), Some("math"));
    }

    #[test]
    fn structured_ground_truth_and_null_extra_info() {
        let mut row = gsm8k_row();
        row["reward_model"]["ground_truth"] = json!({"target": ["Paris", "paris"]});
        row["extra_info"] = Value::Null;
        let s = Sample::from_row("f", 0, row, "prompt", "data_source").unwrap();
        assert_eq!(s.ground_truth["target"][1], json!("paris"));
        assert_eq!(s.extra_info, json!({}));
    }

    #[test]
    fn bad_rows_name_file_row_and_column() {
        let mut r = gsm8k_row();
        r.as_object_mut().unwrap().remove("prompt");
        let e = fail(r);
        assert!(
            e.starts_with("f.parquet, row 3, column `prompt`: missing"),
            "{e}"
        );

        let mut r = gsm8k_row();
        r["prompt"] = json!("just text");
        assert!(fail(r).contains("found a plain string"));

        let mut r = gsm8k_row();
        r["prompt"] = json!([{"role": "user"}]);
        assert!(fail(r).contains("message 0 has no `content`"));

        let mut r = gsm8k_row();
        r["prompt"] = json!([{"role": "user", "content": [{"type": "image"}]}]);
        assert!(fail(r).contains("`content` must be a string"));

        let mut r = gsm8k_row();
        r["reward_model"] = json!({"style": "rule"});
        assert!(fail(r).contains("column `reward_model.ground_truth`: missing"));

        let mut r = gsm8k_row();
        r["data_source"] = json!(7);
        assert!(fail(r).contains("column `data_source`: expected a string, found a number"));

        let mut r = gsm8k_row();
        r["extra_info"] = json!([1]);
        assert!(fail(r).contains("column `extra_info`: expected an object"));
    }
}
