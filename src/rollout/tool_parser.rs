//! Tool calls in a model turn's text (`multi_turn.format`), parsed as verl's agent loop parses
//! them (`verl/experimental/agent_loop/tool_parser.py`; llama3_json as vLLM's parser of that
//! name).

use std::sync::OnceLock;

use regex::Regex;
use serde_json::Value;

use crate::config::ToolFormat;

/// One call the model wrote: the tool's name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

/// What a turn's text holds.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedTurn {
    /// The text without the calls (the assistant message's `content`).
    pub content: String,
    pub calls: Vec<ParsedCall>,
    /// Call blocks that were not a JSON object with `name` and `arguments` (dropped, as verl
    /// drops them, and counted).
    pub malformed: usize,
}

/// Parses `text` as `format` writes calls.
pub fn parse(format: ToolFormat, text: &str) -> ParsedTurn {
    match format {
        ToolFormat::Hermes => hermes(text),
        ToolFormat::Llama3Json => llama3_json(text),
    }
}

/// A call object `{"name": ..., <args_key>: {...}}` (arguments may be an object or a JSON
/// string holding one).
fn call_of(v: &Value, args_keys: &[&str]) -> Option<ParsedCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = args_keys.iter().find_map(|k| v.get(*k))?;
    let arguments = match args {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    Some(ParsedCall { name, arguments })
}

/// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them; the content
/// is the text with every block removed. Without both tags the whole text is content.
fn hermes(text: &str) -> ParsedTurn {
    static BLOCK: OnceLock<Regex> = OnceLock::new();
    let re = BLOCK.get_or_init(|| Regex::new(r"(?s)<tool_call>(.*?)</tool_call>").expect("regex"));
    if !text.contains("<tool_call>") || !text.contains("</tool_call>") {
        return ParsedTurn {
            content: text.to_string(),
            ..Default::default()
        };
    }
    let mut out = ParsedTurn::default();
    for m in re.captures_iter(text) {
        let parsed = serde_json::from_str::<Value>(m[1].trim())
            .ok()
            .and_then(|v| call_of(&v, &["arguments"]));
        match parsed {
            Some(c) => out.calls.push(c),
            None => out.malformed += 1,
        }
    }
    out.content = re.replace_all(text, "").into_owned();
    out
}

/// Llama 3.x JSON calls: the turn is `<|python_tag|>`? followed by one or more objects
/// `{"name": ..., "parameters"|"arguments": {...}}` separated by `;`. A turn that does not start
/// with one is plain content.
fn llama3_json(text: &str) -> ParsedTurn {
    let body = text.trim_start();
    let body = body
        .strip_prefix("<|python_tag|>")
        .unwrap_or(body)
        .trim_start();
    if !body.starts_with('{') {
        return ParsedTurn {
            content: text.to_string(),
            ..Default::default()
        };
    }
    let mut out = ParsedTurn::default();
    let mut rest = body;
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        match stream.next() {
            Some(Ok(v)) => {
                match call_of(&v, &["parameters", "arguments"]) {
                    Some(c) => out.calls.push(c),
                    None => out.malformed += 1,
                }
                rest = rest[stream.byte_offset()..].trim_start();
                rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
            }
            _ => {
                // Not JSON from here on: what is left is content.
                out.malformed += usize::from(rest.starts_with('{'));
                out.content = rest.to_string();
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected values written by hand from verl's HermesToolParser: both tags needed, every
    /// block parsed, a block that is not JSON dropped, content = text without the blocks.
    #[test]
    fn hermes_calls_and_content() {
        let t = "Let me check.\n<tool_call>\n{\"name\": \"calc_gsm8k_reward\", \"arguments\": {\"answer\": \"72\"}}\n</tool_call><tool_call>{oops}</tool_call> done";
        let p = parse(ToolFormat::Hermes, t);
        assert_eq!(
            p.calls,
            vec![ParsedCall {
                name: "calc_gsm8k_reward".into(),
                arguments: "{\"answer\":\"72\"}".into()
            }]
        );
        assert_eq!(p.malformed, 1);
        assert_eq!(p.content, "Let me check.\n done");
        // An opening tag alone is no call.
        let q = parse(
            ToolFormat::Hermes,
            "<tool_call>{\"name\": \"x\", \"arguments\": {}}",
        );
        assert!(q.calls.is_empty());
        assert_eq!(q.malformed, 0);
        // Arguments given as a JSON string are kept as that string.
        let r = parse(
            ToolFormat::Hermes,
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
        );
        assert_eq!(r.calls[0].arguments, "{\"a\": 1}");
    }

    #[test]
    fn llama3_json_calls() {
        let t = "<|python_tag|>{\"name\": \"search\", \"parameters\": {\"q\": \"rust\"}}; {\"name\": \"calc\", \"arguments\": {\"x\": 2}}";
        let p = parse(ToolFormat::Llama3Json, t);
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.calls[0].name, "search");
        assert_eq!(p.calls[0].arguments, "{\"q\":\"rust\"}");
        assert_eq!(p.calls[1].name, "calc");
        assert_eq!(p.content, "");
        let plain = parse(ToolFormat::Llama3Json, "The answer is 4.");
        assert!(plain.calls.is_empty());
        assert_eq!(plain.content, "The answer is 4.");
        let bad = parse(ToolFormat::Llama3Json, "{\"nome\": 1}");
        assert_eq!((bad.calls.len(), bad.malformed), (0, 1));
    }
}
