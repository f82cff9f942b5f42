//! SFT conversations → token ids and loss masks, as verl's `MultiTurnSFTDataset`
//! (`verl/utils/dataset/multiturn_sft_dataset.py`, 1dda039) builds them.
//!
//! Each message is rendered alone by the chat template (`add_generation_prompt=False`; the
//! row's tools only with the first message) and tokenised; every message after the first
//! that is not a system message loses the template's default system prompt (its first
//! `len(system_prompt)` tokens); an assistant message's tokens carry loss mask 1 except its
//! first `len(generation_prompt)` (the header the template writes before a reply), every other
//! message's carry 0. The pieces are concatenated and must equal the whole conversation
//! rendered at once (`ignore_input_ids_mismatch` accepts a difference). `system_prompt` and
//! `generation_prompt` come from verl's `extract_system_prompt_and_generation`: rendering one
//! empty user message, two of them, and one with the generation prompt.
//!
//! Rows without `messages_key` may be single-turn (`prompt_key` + `response_key`, verl's older
//! `SFTDataset`): the prompt (a string, or a list of messages) and the response become a
//! conversation ending in one assistant message, rendered as above.
//!
//! A conversation longer than `max_length` is an error naming the file and row
//! (`truncation=error`), or keeps its last (`left`) or first (`right`) `max_length` tokens.

use std::path::Path;

use serde_json::Value;

use super::read::{kind, read_rows};
use super::{ChatTemplate, DataError, TokenizerBundle};
use crate::config::SftTruncation;

/// How rows become training sequences (`data.*` of the SFT config).
#[derive(Debug, Clone)]
pub struct SftOptions {
    pub messages_key: String,
    pub tools_key: String,
    pub enable_thinking_key: String,
    /// `enable_thinking` for rows without that column (Python truthiness; null: not passed).
    pub enable_thinking_default: Option<Value>,
    pub prompt_key: Option<String>,
    pub response_key: Option<String>,
    pub max_length: usize,
    pub truncation: SftTruncation,
    pub template_kwargs: serde_json::Map<String, Value>,
    pub ignore_input_ids_mismatch: bool,
    /// Keep the first N rows (verl without `data.shuffle`).
    pub max_samples: Option<usize>,
}

/// One training sequence: its ids and verl's `loss_mask` (1 on tokens the loss predicts).
#[derive(Debug, Clone, PartialEq)]
pub struct SftExample {
    pub input_ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
}

/// Tokenised conversations ready for batching.
#[derive(Debug, Clone)]
pub struct SftDataset {
    pub examples: Vec<SftExample>,
    /// Rows cut to `max_length` by `truncation=left|right`.
    pub truncated: usize,
    /// Rows whose message-by-message tokens differ from the whole rendering (accepted with
    /// `ignore_input_ids_mismatch`).
    pub mismatched: usize,
}

/// The tokens a chat template adds around messages (verl's `extract_system_prompt_and_generation`).
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateParts {
    /// The default system turn the template writes before a conversation without one.
    pub system_prompt: Vec<u32>,
    /// The assistant header `add_generation_prompt=True` appends.
    pub generation_prompt: Vec<u32>,
}

/// Renders `messages` and tokenises the text as `apply_chat_template(tokenize=True)` does.
fn render_ids(
    tok: &TokenizerBundle,
    template: &ChatTemplate,
    messages: &[Value],
    generation_prompt: bool,
    kwargs: &serde_json::Map<String, Value>,
) -> Result<Vec<u32>, String> {
    let text = template.render(messages, generation_prompt, kwargs)?;
    tok.encode(&text)
}

impl TemplateParts {
    /// verl's `extract_system_prompt_and_generation` with the template variables `kwargs`.
    pub fn of(
        tok: &TokenizerBundle,
        template: &ChatTemplate,
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<Self, String> {
        let empty = serde_json::json!({"role": "user", "content": ""});
        let one = render_ids(tok, template, std::slice::from_ref(&empty), false, kwargs)?;
        let two = render_ids(
            tok,
            template,
            &[empty.clone(), empty.clone()],
            false,
            kwargs,
        )?;
        let with_gen = render_ids(tok, template, std::slice::from_ref(&empty), true, kwargs)?;
        // token1[: -(len(token2) - len(token1))]: Python's [:-0] is empty.
        let turn = two.len().saturating_sub(one.len());
        let system_prompt = if turn == 0 {
            Vec::new()
        } else {
            one[..one.len().saturating_sub(turn)].to_vec()
        };
        let generation_prompt = with_gen.get(one.len()..).unwrap_or_default().to_vec();
        Ok(Self {
            system_prompt,
            generation_prompt,
        })
    }
}

/// Python's `bool(x)` of a JSON value; `None` for null.
fn truthy(v: &Value) -> Option<bool> {
    match v {
        Value::Null => None,
        Value::Bool(b) => Some(*b),
        Value::Number(n) => Some(n.as_f64().is_some_and(|x| x != 0.0)),
        Value::String(s) => Some(!s.is_empty()),
        Value::Array(a) => Some(!a.is_empty()),
        Value::Object(o) => Some(!o.is_empty()),
    }
}

/// A row's conversation, tools and template variables, checked.
pub struct Conversation {
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub kwargs: serde_json::Map<String, Value>,
}

/// The name of a tool schema (`{"type": "function", "function": {"name": ...}}` or `{"name": ...}`).
fn tool_name(v: &Value) -> Option<&str> {
    v.get("function")
        .and_then(|f| f.get("name"))
        .or_else(|| v.get("name"))
        .and_then(Value::as_str)
}

/// A column that may hold JSON text (parquet writers often store nested values as strings).
fn maybe_json(v: &Value) -> Value {
    match v {
        Value::String(s) if s.trim_start().starts_with(['[', '{']) => {
            serde_json::from_str(s).unwrap_or_else(|_| v.clone())
        }
        other => other.clone(),
    }
}

impl Conversation {
    /// Reads row `row` of `file`: the messages (or the single-turn prompt and response), the
    /// tools, and `enable_thinking`; checks roles and that every tool call names an offered tool.
    pub fn parse(file: &str, row: usize, raw: &Value, o: &SftOptions) -> Result<Self, DataError> {
        let err = |column: &str, message: String| DataError::Row {
            file: file.to_string(),
            row,
            column: column.to_string(),
            message,
        };
        let obj = raw
            .as_object()
            .ok_or_else(|| err("*", format!("a row must be an object, found {}", kind(raw))))?;
        let messages = Self::messages_of(obj, o, &err)?;
        let tools = match obj.get(&o.tools_key).map(maybe_json) {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => Some(a),
            Some(other) => {
                return Err(err(
                    &o.tools_key,
                    format!("expected a list of tool schemas, found {}", kind(&other)),
                ))
            }
        };
        check_tool_calls(&messages, tools.as_deref(), o, &err)?;
        let mut kwargs = o.template_kwargs.clone();
        let thinking = match obj.get(&o.enable_thinking_key) {
            Some(v) if !v.is_null() => truthy(v),
            _ => o.enable_thinking_default.as_ref().and_then(truthy),
        };
        if let Some(t) = thinking {
            kwargs.insert("enable_thinking".into(), Value::Bool(t));
        }
        Ok(Self {
            messages,
            tools,
            kwargs,
        })
    }

    fn messages_of(
        obj: &serde_json::Map<String, Value>,
        o: &SftOptions,
        err: &dyn Fn(&str, String) -> DataError,
    ) -> Result<Vec<Value>, DataError> {
        let key = &o.messages_key;
        let list = match (obj.get(key).map(maybe_json), &o.prompt_key, &o.response_key) {
            (Some(Value::Array(a)), _, _) => a,
            (Some(other), _, _) => {
                return Err(err(
                    key,
                    format!("expected a list of messages, found {}", kind(&other)),
                ))
            }
            (None, Some(p), Some(r)) if obj.contains_key(p) || obj.contains_key(r) => {
                return single_turn(obj, p, r, err)
            }
            (None, p, _) => {
                let columns = obj.keys().cloned().collect::<Vec<_>>().join(", ");
                let single = match p {
                    Some(p) => format!(
                        " nor the single-turn columns data.prompt_key={p} / data.response_key"
                    ),
                    None => String::new(),
                };
                return Err(err(
                    key,
                    format!(
                        "missing: the row has neither `{key}` (data.messages_key){single}; it has: {columns}"
                    ),
                ));
            }
        };
        if list.is_empty() {
            return Err(err(key, "an empty conversation".into()));
        }
        for (i, m) in list.iter().enumerate() {
            let role = m.get("role").and_then(Value::as_str);
            if !matches!(role, Some("system" | "user" | "assistant" | "tool")) {
                return Err(err(
                    key,
                    format!(
                        "message {i} has role {}: expected system, user, assistant or tool",
                        m.get("role")
                            .map(|r| r.to_string())
                            .unwrap_or("(none)".into())
                    ),
                ));
            }
        }
        Ok(list)
    }
}

/// The single-turn form: `[prompt messages..., {assistant: response}]`.
fn single_turn(
    obj: &serde_json::Map<String, Value>,
    p: &str,
    r: &str,
    err: &dyn Fn(&str, String) -> DataError,
) -> Result<Vec<Value>, DataError> {
    let mut messages = match obj.get(p).map(maybe_json) {
        Some(Value::String(s)) => vec![serde_json::json!({"role": "user", "content": s})],
        Some(Value::Array(a)) if !a.is_empty() => a,
        other => {
            return Err(err(
                p,
                format!(
                    "expected the prompt text or a list of messages (data.prompt_key), found {}",
                    other.as_ref().map(kind).unwrap_or("nothing")
                ),
            ))
        }
    };
    match obj.get(r) {
        Some(Value::String(s)) => {
            messages.push(serde_json::json!({"role": "assistant", "content": s}));
            Ok(messages)
        }
        other => Err(err(
            r,
            format!(
                "expected the response text (data.response_key), found {}",
                other.map(kind).unwrap_or("nothing")
            ),
        )),
    }
}

/// Every `tool_calls[*]` of an assistant message names a tool of the row's `tools`.
fn check_tool_calls(
    messages: &[Value],
    tools: Option<&[Value]>,
    o: &SftOptions,
    err: &dyn Fn(&str, String) -> DataError,
) -> Result<(), DataError> {
    let offered: Vec<&str> = tools
        .unwrap_or_default()
        .iter()
        .filter_map(tool_name)
        .collect();
    for (i, m) in messages.iter().enumerate() {
        let Some(calls) = m.get("tool_calls").map(maybe_json) else {
            continue;
        };
        let calls = match calls {
            Value::Null => continue,
            Value::Array(a) => a,
            other => {
                return Err(err(
                    &o.messages_key,
                    format!(
                        "message {i}: tool_calls must be a list, found {}",
                        kind(&other)
                    ),
                ))
            }
        };
        for c in &calls {
            let name = tool_name(c).unwrap_or("");
            if !offered.contains(&name) {
                let offer = if offered.is_empty() {
                    format!(
                        "the row offers no tools (no `{}` column, data.tools_key)",
                        o.tools_key
                    )
                } else {
                    format!("the row's `{}` offer: {}", o.tools_key, offered.join(", "))
                };
                return Err(err(
                    &o.messages_key,
                    format!("message {i} calls the tool `{name}`, which is unknown: {offer}"),
                ));
            }
        }
    }
    Ok(())
}

/// The ids and loss mask of one conversation, message by message as verl builds them, and
/// whether they differ from the whole conversation rendered at once.
pub fn conversation_tokens(
    tok: &TokenizerBundle,
    template: &ChatTemplate,
    parts: &TemplateParts,
    conv: &Conversation,
) -> Result<(SftExample, bool), String> {
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for (i, m) in conv.messages.iter().enumerate() {
        let mut kw = conv.kwargs.clone();
        if let (0, Some(t)) = (i, &conv.tools) {
            kw.insert("tools".into(), Value::Array(t.clone()));
        }
        let mut piece = render_ids(tok, template, std::slice::from_ref(m), false, &kw)
            .map_err(|e| format!("message {i}: {e}"))?;
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        if i != 0 && role != "system" {
            piece.drain(..parts.system_prompt.len().min(piece.len()));
        }
        let header = if role == "assistant" {
            parts.generation_prompt.len().min(piece.len())
        } else {
            piece.len()
        };
        mask.extend((0..piece.len()).map(|t| u8::from(t >= header)));
        ids.extend(piece);
    }
    let mut kw = conv.kwargs.clone();
    if let Some(t) = &conv.tools {
        kw.insert("tools".into(), Value::Array(t.clone()));
    }
    let whole = render_ids(tok, template, &conv.messages, false, &kw)?;
    let mismatch = ids != whole;
    Ok((
        SftExample {
            input_ids: ids,
            loss_mask: mask,
        },
        mismatch,
    ))
}

/// `example` cut to `max` tokens by `mode`; `Err` with the length for `truncation=error`.
pub fn fit(
    example: SftExample,
    max: usize,
    mode: SftTruncation,
) -> Result<(SftExample, bool), usize> {
    let n = example.input_ids.len();
    if n <= max {
        return Ok((example, false));
    }
    let range = match mode {
        SftTruncation::Error => return Err(n),
        SftTruncation::Left => n - max..n,
        SftTruncation::Right => 0..max,
    };
    Ok((
        SftExample {
            input_ids: example.input_ids[range.clone()].to_vec(),
            loss_mask: example.loss_mask[range].to_vec(),
        },
        true,
    ))
}

impl SftDataset {
    /// Reads `files` and builds every row's sequence.
    pub fn build(
        files: &[String],
        o: &SftOptions,
        tok: &TokenizerBundle,
        template: &ChatTemplate,
    ) -> Result<Self, DataError> {
        if files.is_empty() {
            return Err(DataError::Other("no data files given".into()));
        }
        let parts = TemplateParts::of(tok, template, &o.template_kwargs)
            .map_err(|e| DataError::Other(format!("the chat template: {e}")))?;
        let mut out = SftDataset {
            examples: Vec::new(),
            truncated: 0,
            mismatched: 0,
        };
        'files: for f in files {
            let path = crate::util::expand_home(f);
            for (row, raw) in read_rows(Path::new(&path))?.iter().enumerate() {
                if o.max_samples.is_some_and(|m| out.examples.len() >= m) {
                    break 'files;
                }
                out.add_row(&path, row, raw, o, tok, template, &parts)?;
            }
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn add_row(
        &mut self,
        file: &str,
        row: usize,
        raw: &Value,
        o: &SftOptions,
        tok: &TokenizerBundle,
        template: &ChatTemplate,
        parts: &TemplateParts,
    ) -> Result<(), DataError> {
        let err = |message: String| DataError::Row {
            file: file.to_string(),
            row,
            column: o.messages_key.clone(),
            message,
        };
        let conv = Conversation::parse(file, row, raw, o)?;
        let (example, mismatch) = conversation_tokens(tok, template, parts, &conv).map_err(err)?;
        if mismatch {
            if !o.ignore_input_ids_mismatch {
                return Err(err("the messages rendered one by one (as verl's MultiTurnSFTDataset trains them) differ from the whole conversation rendered at once (a template that changes earlier turns, e.g. one that drops <think> blocks); set data.ignore_input_ids_mismatch=True to train the message-by-message tokens".into()));
            }
            if self.mismatched == 0 {
                tracing::warn!("{file}, row {row}: the message-by-message tokens differ from the whole conversation's; trained as verl does (data.ignore_input_ids_mismatch=True)");
            }
            self.mismatched += 1;
        }
        let (example, cut) = fit(example, o.max_length, o.truncation).map_err(|n| {
            err(format!(
                "the conversation is {n} tokens, longer than data.max_length = {} (data.truncation=error; left or right cut it)",
                o.max_length
            ))
        })?;
        self.truncated += usize::from(cut);
        self.examples.push(example);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.examples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }
}
