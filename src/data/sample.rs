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

/// Which columns a row must hold; the others are read when present and well-formed and left
/// empty otherwise (`data_source` "", `ground_truth` null, `extra_info` {}, no prompt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Training and validation (verl's trainer): the prompt, the data_source and
    /// `reward_model.ground_truth`, each checked.
    All,
    /// `generate` (verl's `main_generation`): the prompt only.
    Prompt,
    /// Scoring a response that already exists (`reward score|test`, `eval`): the data_source
    /// and a ground truth (`reward_model.ground_truth`, or a top-level `ground_truth` column);
    /// no prompt.
    Reward,
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
        Self::parse(file, row, raw, prompt_key, source_key, Need::All)
    }

    /// A row as `need` says: what it needs is checked and an error names the file, the row and
    /// the column; what it does not need is read when present and well-formed.
    pub fn parse(
        file: &str,
        row: usize,
        raw: Value,
        prompt_key: &str,
        source_key: &str,
        need: Need,
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
        let strict = need != Need::Prompt;
        let columns = || obj.keys().cloned().collect::<Vec<_>>().join(", ");
        let prompt = match need {
            Need::Reward => Vec::new(),
            _ => Self::prompt_of(obj, prompt_key, &err)?,
        };
        let data_source = match obj.get(source_key) {
            Some(Value::String(s)) => s.clone(),
            _ if !strict => String::new(),
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
        let ground_truth = Self::ground_truth_of(obj, need, &err)?;
        let extra_info = match obj.get("extra_info") {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) if !strict => Value::Object(Default::default()),
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
            Some(_) if !strict => None,
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

    /// The row as verl's `RLHFDataset.__getitem__` gives it to a custom sampler (`dataset[i]`):
    /// every column of the file, `extra_info` ({} when missing or null), `raw_prompt` (the chat
    /// messages of `prompt_key`), and `index`, `tools_kwargs`, `interaction_kwargs` from
    /// `extra_info` (0, {}, {} when absent). verl's `dummy_tensor` (a torch tensor holding 0) is
    /// left out.
    pub fn dataset_item(&self, prompt_key: &str) -> Value {
        let mut item = self.raw.as_object().cloned().unwrap_or_default();
        let info = &self.extra_info;
        let or = |key: &str, default: Value| info.get(key).cloned().unwrap_or(default);
        item.insert("extra_info".into(), info.clone());
        if let Some(p) = item.get(prompt_key).cloned() {
            item.insert("raw_prompt".into(), p);
        }
        item.insert("index".into(), or("index", Value::from(0)));
        item.insert(
            "tools_kwargs".into(),
            or("tools_kwargs", Value::Object(Default::default())),
        );
        item.insert(
            "interaction_kwargs".into(),
            or("interaction_kwargs", Value::Object(Default::default())),
        );
        Value::Object(item)
    }

    /// The answer the reward checks: top-level `ground_truth` (rows for the reward alone) or
    /// `reward_model.ground_truth`, refused by column where missing or mistyped (not needed for
    /// prompts alone: `Null` then).
    fn ground_truth_of(
        obj: &serde_json::Map<String, Value>,
        need: Need,
        err: &dyn Fn(&str, String) -> DataError,
    ) -> Result<Value, DataError> {
        let columns = || obj.keys().cloned().collect::<Vec<_>>().join(", ");
        let top_level = obj.get("ground_truth").filter(|v| !v.is_null());
        Ok(match (obj.get("reward_model"), need) {
            (_, Need::Prompt) => obj
                .get("reward_model")
                .and_then(|rm| rm.get("ground_truth"))
                .cloned()
                .unwrap_or(Value::Null),
            (_, Need::Reward) if top_level.is_some() => top_level.cloned().unwrap_or_default(),
            (None | Some(Value::Null), Need::Reward) => {
                return Err(err(
                    "ground_truth",
                    format!(
                "missing (the row has: {}); give `ground_truth` or `reward_model.ground_truth`",
                columns()
            ),
                ))
            }
            (Some(Value::Object(rm)), _) => match rm.get("ground_truth") {
                Some(Value::Null) | None => {
                    return Err(err(
                        "reward_model.ground_truth",
                        "missing; each row needs the answer its reward is checked against".into(),
                    ))
                }
                Some(v) => v.clone(),
            },
            (Some(Value::Null) | None, _) => {
                return Err(err(
                    "reward_model",
                    format!(
                        "missing (the row has: {}); expected {{\"ground_truth\": ...}}",
                        columns()
                    ),
                ))
            }
            (Some(other), _) => {
                return Err(err(
                    "reward_model",
                    format!(
                        "expected an object with `ground_truth`, found {}",
                        kind(other)
                    ),
                ))
            }
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
        let s = Sample::parse("f", 0, row.clone(), "q", "data_source", Need::Prompt).unwrap();
        assert_eq!(s.prompt, vec![json!({"role": "user", "content": "hi"})]);
        assert_eq!(
            (s.data_source.as_str(), &s.ground_truth),
            ("", &Value::Null)
        );
        assert_eq!(s.raw, row);
        let full =
            Sample::parse("f", 0, gsm8k_row(), "prompt", "data_source", Need::Prompt).unwrap();
        assert_eq!(
            full,
            Sample::from_row("f", 0, gsm8k_row(), "prompt", "data_source").unwrap()
        );
        let e = Sample::parse(
            "f.jsonl",
            2,
            json!({"id": 1}),
            "q",
            "data_source",
            Need::Prompt,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("f.jsonl, row 2, column `q`") && e.contains("data.prompt_key"),
            "{e}"
        );
    }

    /// The item a custom sampler reads: verl's `__getitem__` columns added to the row (values
    /// from `RLHFDataset.__getitem__` at b178a3c, worked by hand for this row).
    #[test]
    fn dataset_item_has_verls_added_columns() {
        let s = Sample::from_row("f", 0, gsm8k_row(), "prompt", "data_source").unwrap();
        let item = s.dataset_item("prompt");
        assert_eq!(
            item["raw_prompt"],
            json!([{"role": "user", "content": "1+1?"}])
        );
        assert_eq!(item["index"], json!(0));
        assert_eq!(
            (&item["tools_kwargs"], &item["interaction_kwargs"]),
            (&json!({}), &json!({}))
        );
        assert_eq!(item["reward_model"]["ground_truth"], json!("2"));
        let mut row = gsm8k_row();
        row["extra_info"] = json!({"index": 41, "tools_kwargs": {"calc": {"x": 1}}});
        let s = Sample::from_row("f", 0, row, "prompt", "data_source").unwrap();
        let item = s.dataset_item("prompt");
        assert_eq!(
            (item["index"].clone(), item["tools_kwargs"].clone()),
            (json!(41), json!({"calc": {"x": 1}}))
        );
        let mut row = gsm8k_row();
        row["extra_info"] = Value::Null;
        let s = Sample::from_row("f", 0, row, "prompt", "data_source").unwrap();
        assert_eq!(s.dataset_item("prompt")["extra_info"], json!({}));
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

    /// A response file for `reward score|test`: no prompt needed, the ground truth from either
    /// place (the top-level column first), and what is missing named with file, row and column.
    #[test]
    fn reward_rows_need_a_data_source_and_a_ground_truth() {
        let parse =
            |row: Value| Sample::parse("r.jsonl", 4, row, "prompt", "data_source", Need::Reward);
        let s =
            parse(json!({"data_source": "openai/gsm8k", "ground_truth": "4", "solution_str": "x"}))
                .unwrap();
        assert_eq!((s.ground_truth.clone(), s.prompt.len()), (json!("4"), 0));
        assert_eq!(s.extra_info, json!({}));
        let s = parse(json!({"data_source": "d", "reward_model": {"ground_truth": [1]}})).unwrap();
        assert_eq!(s.ground_truth, json!([1]));
        let s = parse(json!({"data_source": "d", "ground_truth": "top", "reward_model": {"ground_truth": "nested"}})).unwrap();
        assert_eq!(s.ground_truth, json!("top"));
        let e = parse(json!({"data_source": "d", "response": "x"}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("r.jsonl, row 4, column `ground_truth`")
                && e.contains("reward_model.ground_truth"),
            "{e}"
        );
        let e = parse(json!({"ground_truth": "4"})).unwrap_err().to_string();
        assert!(e.contains("row 4, column `data_source`: missing"), "{e}");
        let e = parse(json!({"data_source": 3, "ground_truth": "4"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("column `data_source`: expected a string"), "{e}");
    }
}
