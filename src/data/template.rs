//! Chat templates: the model's Jinja template rendered the way HF transformers'
//! `apply_chat_template` does (a sandboxed Jinja environment with `trim_blocks` and
//! `lstrip_blocks`, `raise_exception`, `strftime_now`, Python-style `tojson`, Python string and
//! dict methods), with `add_generation_prompt`, the special tokens and
//! `data.apply_chat_template_kwargs` as template variables.

use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value;

use super::tokenizer::SpecialTokens;
use super::DataError;

/// The most VM instructions one rendering may run. Real chat templates use a few hundred per
/// message (the ChatML template renders a 3-message chat in under 1,000; see the tests), so this leaves
/// room for ~10^4 messages while a template that loops without end stops within a fraction of a
/// second instead of hanging the run.
pub const TEMPLATE_FUEL: u64 = 10_000_000;

/// A compiled chat template with the special tokens it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    special: SpecialTokens,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`. `origin` names where it came from, for error messages.
    pub fn new(source: &str, special: SpecialTokens, origin: &str) -> Result<Self, DataError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| DataError::Other(format!("internal: Jinja syntax config: {e}")))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<JValue, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String {
            strftime_now(&fmt)
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat_template", source.to_string())
            .map_err(|e| {
                DataError::Other(format!("chat template from {origin} does not compile: {e}"))
            })?;
        Ok(Self { env, special })
    }

    /// Renders `messages` (objects with `role` and `content`). `kwargs` become template
    /// variables (they cannot replace `messages`, `add_generation_prompt` or the special tokens).
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String, String> {
        let tmpl = self
            .env
            .get_template("chat_template")
            .map_err(|e| e.to_string())?;
        let mut ctx: serde_json::Map<String, Value> = kwargs.clone();
        ctx.insert("messages".into(), Value::Array(messages.to_vec()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        for (name, tok) in [
            ("bos_token", &self.special.bos),
            ("eos_token", &self.special.eos),
            ("pad_token", &self.special.pad),
            ("unk_token", &self.special.unk),
        ] {
            if let Some(t) = tok {
                ctx.insert(name.into(), Value::String(t.clone()));
            }
        }
        tmpl.render(JValue::from(minijinja::value::Serde(&ctx)))
            .map_err(|e| {
                if e.kind() == ErrorKind::OutOfFuel {
                    return format!(
                        "the chat template ran more than {TEMPLATE_FUEL} instructions without finishing and was stopped (a loop over a huge range?)"
                    );
                }
                let mut msg = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    msg.push_str(&format!(": {s}"));
                    src = s.source();
                }
                msg
            })
    }
}

impl ChatTemplate {
    /// Whether the template shows `tools` to the model: a one-message conversation renders
    /// differently with them than without (a template that never reads `tools` does not tell
    /// the model the tools exist or how to call them). A rendering error counts as showing
    /// them (the error surfaces where the rows are rendered).
    pub fn renders_tools(&self, tools: &[Value]) -> bool {
        let messages = [serde_json::json!({"role": "user", "content": "?"})];
        let mut with = serde_json::Map::new();
        with.insert("tools".into(), Value::Array(tools.to_vec()));
        match (
            self.render(&messages, true, &serde_json::Map::new()),
            self.render(&messages, true, &with),
        ) {
            (Ok(a), Ok(b)) => a != b,
            _ => true,
        }
    }
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`, which is
/// what transformers registers as `tojson` (separators `, ` and `: `, no HTML escaping).
fn tojson(value: JValue, kwargs: Kwargs) -> Result<JValue, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut v: Value = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    if sort_keys.unwrap_or(false) {
        sort(&mut v);
    }
    let mut out = String::new();
    dump(&v, indent, 0, &mut out);
    Ok(JValue::from_safe_string(out))
}

fn sort(v: &mut Value) {
    match v {
        Value::Object(m) => {
            let mut entries: Vec<(String, Value)> = std::mem::take(m).into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut val) in entries {
                sort(&mut val);
                m.insert(k, val);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(sort),
        _ => {}
    }
}

fn dump(v: &Value, indent: Option<usize>, level: usize, out: &mut String) {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                dump(x, indent, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Value::Object(m) if !m.is_empty() => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                dump(x, indent, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
        Value::Number(n) if n.is_f64() => {
            // Python prints floats with a decimal point (1.0), serde_json as well.
            out.push_str(&n.to_string());
        }
        other => out.push_str(&serde_json::to_string(other).unwrap_or_default()),
    }
}

/// `strftime_now(fmt)` for the directives chat templates use (%d %m %Y %y %b %B %H %M %S %j %%),
/// in UTC.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(fmt, secs)
}

fn strftime(fmt: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (secs / 86_400) as i64;
    let tod = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let is_leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(is_leap && m > 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Qwen2.5-style ChatML (the template's tool branch removed; the rest verbatim in structure).
    const CHATML: &str = "{%- if messages[0]['role'] == 'system' %}\n    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n{%- else %}\n    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n{%- endif %}\n{%- for message in messages %}\n    {%- if not (message.role == 'system' and loop.first) %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

    /// Llama-3-style template (header ids, bos token, `| trim`).
    const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    fn special() -> SpecialTokens {
        SpecialTokens {
            bos: Some("<|begin_of_text|>".into()),
            eos: Some("<|eot_id|>".into()),
            pad: None,
            unk: None,
        }
    }

    /// A template without a tools branch does not render them; one that lists them after the
    /// system turn does (a template that fails counts as rendering them: the rows' own
    /// rendering reports the error).
    #[test]
    fn templates_that_render_tools_are_told_apart() {
        let tools = [json!({"type": "function", "function": {"name": "calc", "parameters": {}}})];
        let plain = ChatTemplate::new(CHATML, special(), "test").unwrap();
        assert!(!plain.renders_tools(&tools));
        let listed = format!("{{%- if tools %}}{{{{ tools | tojson }}}}{{%- endif %}}{CHATML}");
        let listed = ChatTemplate::new(&listed, special(), "test").unwrap();
        assert!(listed.renders_tools(&tools));
        let broken = ChatTemplate::new("{{ raise_exception('no') }}", special(), "test").unwrap();
        assert!(broken.renders_tools(&tools));
    }

    #[test]
    fn chatml_matches_hand_derived_string() {
        let t = ChatTemplate::new(CHATML, special(), "test").unwrap();
        let msgs = vec![json!({"role": "user", "content": "What is 2+3?"})];
        let out = t.render(&msgs, true, &Default::default()).unwrap();
        // Derived by hand from the template: default system turn, the user turn, then the
        // assistant header because add_generation_prompt is true.
        let expected = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(out, expected);
        let no_gen = t.render(&msgs, false, &Default::default()).unwrap();
        assert_eq!(no_gen, expected.trim_end_matches("<|im_start|>assistant\n"));
        let with_system = vec![
            json!({"role": "system", "content": "Be brief."}),
            msgs[0].clone(),
        ];
        let out = t.render(&with_system, true, &Default::default()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn a_runaway_template_is_stopped_by_fuel_and_a_real_one_needs_little() {
        // 10^10 loop iterations: without a bound this renders for hours.
        let src = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(src, special(), "test").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(t.render(&[], true, &Default::default()));
        });
        let out = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the render returns within 30 s");
        let e = out.unwrap_err();
        assert!(e.contains("ran more than") && e.contains("stopped"), "{e}");

        // The real template over a 3-message chat fits in 1,000 instructions (so the budget
        // leaves four orders of magnitude of room).
        let mut t = ChatTemplate::new(CHATML, special(), "test").unwrap();
        t.env.set_fuel(Some(1_000));
        let msgs = vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "What is 2+3?"}),
            json!({"role": "assistant", "content": "5"}),
        ];
        t.render(&msgs, true, &Default::default()).unwrap();
    }

    #[test]
    fn llama3_matches_hand_derived_string() {
        let t = ChatTemplate::new(LLAMA3, special(), "test").unwrap();
        let msgs = vec![
            json!({"role": "system", "content": "Be brief. "}),
            json!({"role": "user", "content": " Hi"}),
        ];
        let out = t.render(&msgs, true, &Default::default()).unwrap();
        // bos once, each content trimmed, then the assistant header.
        let expected = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
        assert_eq!(out, expected);
    }

    #[test]
    fn kwargs_python_methods_and_raise_exception() {
        let src = "{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}{{ messages[0].content.strip().upper() }}{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}";
        let t = ChatTemplate::new(src, special(), "test").unwrap();
        let mut kw = serde_json::Map::new();
        kw.insert("enable_thinking".into(), json!(false));
        assert_eq!(
            t.render(&[json!({"role": "user", "content": "  hi "})], true, &kw)
                .unwrap(),
            "NOTHINK HI"
        );
        let e = t
            .render(&[json!({"role": "system", "content": "x"})], true, &kw)
            .unwrap_err();
        assert!(e.contains("first message must be from the user"), "{e}");
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}",
            special(),
            "t",
        )
        .unwrap();
        let out = t
            .render(
                &[json!({"role": "user", "content": "a<b>é"})],
                false,
                &Default::default(),
            )
            .unwrap();
        assert_eq!(out, "{\"role\": \"user\", \"content\": \"a<b>é\"}|{\n  \"role\": \"user\",\n  \"content\": \"a<b>é\"\n}");
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29T13:05:09Z = 1709211909 (leap day), checked with `date -u -d @1709211909`.
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %j %B %m %y %%", 1_709_211_909),
            "29 Feb 2024 13:05:09 060 February 02 24 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
    }

    #[test]
    fn bad_template_is_an_error() {
        let e =
            ChatTemplate::new("{% for x in %}", special(), "tokenizer_config.json").unwrap_err();
        assert!(e.to_string().contains("tokenizer_config.json"));
    }
}
