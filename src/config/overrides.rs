//! Hydra's command-line override grammar, as verl run scripts use it:
//! `a.b=v` (set), `+a.b=v` (add), `++a.b=v` (add or set), `~a.b` / `~a.b=v` (delete).
//! Values are parsed like Hydra's: `null`, `true`/`false` (any case), numbers (`1e-6`, `-1`),
//! `[a,b]`, `{k: v}`, quoted strings, and an empty value as the empty string. A comma outside
//! brackets or quotes is a Hydra sweep, which a single run cannot do: rejected.

use serde_yaml_ng::Value;

/// What an override does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverrideOp {
    /// `key=value`: the key must exist.
    Set,
    /// `+key=value`: add a key.
    Add,
    /// `++key=value`: add or set.
    ForceAdd,
    /// `~key` or `~key=value`: delete (reset to the default).
    Delete,
}

/// One parsed override.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub op: OverrideOp,
    /// The dotted key, split into segments.
    pub key: Vec<String>,
    /// The value (`None` only for a delete without `=value`).
    pub value: Option<Value>,
    /// The override as typed, for messages.
    pub raw: String,
}

/// Parses one `key=value` argument. The error is a message without the override itself.
pub fn parse_override(raw: &str) -> Result<Override, String> {
    let (op, rest) = if let Some(r) = raw.strip_prefix("++") {
        (OverrideOp::ForceAdd, r)
    } else if let Some(r) = raw.strip_prefix('+') {
        (OverrideOp::Add, r)
    } else if let Some(r) = raw.strip_prefix('~') {
        (OverrideOp::Delete, r)
    } else {
        (OverrideOp::Set, raw)
    };
    let (key, value) = match rest.split_once('=') {
        Some((k, v)) => (k.trim(), Some(v)),
        None if op == OverrideOp::Delete => (rest.trim(), None),
        None => {
            return Err("expected key=value (an override needs `=`; `~key` deletes a key)".into());
        }
    };
    let key = parse_key(key)?;
    let value = match value {
        Some(v) => Some(parse_value(v)?),
        None => None,
    };
    Ok(Override {
        op,
        key,
        value,
        raw: raw.to_string(),
    })
}

/// The most nesting a configuration may have: dotted key parts here, YAML levels in
/// `serde_yaml_ng` (its own limit, also 128).
pub const MAX_DEPTH: usize = 128;

fn parse_key(key: &str) -> Result<Vec<String>, String> {
    if key.is_empty() {
        return Err("the key is empty".into());
    }
    let parts = key.split('.').count();
    if parts > MAX_DEPTH {
        return Err(format!(
            "the key has {parts} dotted parts; at most {MAX_DEPTH} are allowed"
        ));
    }
    let segs: Vec<String> = key.split('.').map(str::to_string).collect();
    for seg in &segs {
        if seg.is_empty() {
            return Err(format!("the key `{key}` has an empty segment"));
        }
        if let Some(c) = seg
            .chars()
            .find(|c| !(c.is_alphanumeric() || matches!(c, '_' | '-' | '@' | '/')))
        {
            return Err(format!(
                "the key `{key}` contains `{c}`; keys are dotted names like data.train_batch_size"
            ));
        }
    }
    Ok(segs)
}

const SWEEP_FUNCTIONS: [&str; 7] = [
    "choice(",
    "range(",
    "interval(",
    "glob(",
    "shuffle(",
    "sort(",
    "tag(",
];

/// Parses an override value with Hydra's rules (see the module docs).
pub fn parse_value(text: &str) -> Result<Value, String> {
    let t = text.trim();
    if t.is_empty() {
        return Ok(Value::String(String::new()));
    }
    if SWEEP_FUNCTIONS.iter().any(|f| t.starts_with(f)) {
        return Err(format!(
            "`{t}` is a Hydra sweep function; main_ppo runs one configuration at a time"
        ));
    }
    if has_top_level_comma(t) {
        return Err(format!(
            "`{t}` has a comma outside brackets, which Hydra reads as a sweep over several runs; \
             for a list write [{t}], for a string with a comma quote it: '{t}'"
        ));
    }
    let lower = t.to_ascii_lowercase();
    match lower.as_str() {
        "true" => return Ok(Value::Bool(true)),
        "false" => return Ok(Value::Bool(false)),
        "null" => return Ok(Value::Null),
        "inf" | "+inf" => return Ok(Value::Number(f64::INFINITY.into())),
        "-inf" => return Ok(Value::Number(f64::NEG_INFINITY.into())),
        "nan" => return Ok(Value::Number(f64::NAN.into())),
        _ => {}
    }
    if let Ok(i) = t.parse::<i64>() {
        return Ok(Value::Number(i.into()));
    }
    if t.bytes().any(|b| b.is_ascii_digit())
        && !t
            .bytes()
            .any(|b| b.is_ascii_alphabetic() && b != b'e' && b != b'E')
    {
        if let Ok(f) = t.parse::<f64>() {
            return Ok(Value::Number(f.into()));
        }
    }
    let structured =
        t.starts_with('[') || t.starts_with('{') || t.starts_with('\'') || t.starts_with('"');
    if structured {
        check_nesting(t).map_err(|e| format!("cannot parse `{}`: {e}", clip(t)))?;
    }
    // Hydra's own grammar for unquoted elements (`\{`, `\,` escapes, `*` in a name), which YAML
    // reads otherwise: the elements are quoted and the containers parsed (again).
    let container = t.starts_with('[') || t.starts_with('{');
    let parsed = if container && t.contains('\\') {
        serde_yaml_ng::from_str::<Value>(&quote_hydra_elements(t))
    } else {
        serde_yaml_ng::from_str::<Value>(t)
    };
    let parsed = match parsed {
        Err(_) if container => {
            serde_yaml_ng::from_str::<Value>(&quote_hydra_elements(t)).or(parsed)
        }
        other => other,
    };
    match parsed {
        Ok(v @ (Value::Sequence(_) | Value::Mapping(_))) if structured => Ok(v),
        Ok(Value::String(s)) if structured => Ok(Value::String(s)),
        Ok(v @ (Value::Number(_) | Value::Bool(_) | Value::Null)) => Ok(v),
        Ok(Value::Tagged(_)) => Ok(Value::String(t.to_string())),
        Ok(_) if !structured => Ok(Value::String(t.to_string())),
        Ok(v) => Ok(v),
        Err(e) if structured => Err(format!("cannot parse `{}`: {}", clip(t), yaml_message(&e))),
        Err(_) => Ok(Value::String(t.to_string())),
    }
}

/// A flow list or dict in Hydra's override grammar rewritten as YAML: each unquoted element is
/// single-quoted with Hydra's backslash escapes removed (`\{*\}` is `{*}`), and a dict's `key:`
/// gets the space YAML wants.
fn quote_hydra_elements(t: &str) -> String {
    let mut out = String::with_capacity(t.len() + 16);
    let mut token = String::new();
    let mut stack: Vec<char> = Vec::new();
    let mut key_done = false;
    let mut chars = t.chars();
    let flush = |token: &mut String, out: &mut String| {
        let tok = token.trim();
        if !tok.is_empty() {
            out.push('\'');
            out.push_str(&tok.replace('\'', "''"));
            out.push('\'');
        }
        token.clear();
    };
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    token.push(n);
                }
            }
            '\'' | '"' if token.trim().is_empty() => {
                // A quoted element stays as written.
                out.push(c);
                for q in chars.by_ref() {
                    out.push(q);
                    if q == c {
                        break;
                    }
                }
            }
            '[' | '{' if token.trim().is_empty() => {
                stack.push(c);
                key_done = false;
                out.push(c);
            }
            ']' | '}' | ',' => {
                flush(&mut token, &mut out);
                if c != ',' {
                    stack.pop();
                }
                key_done = false;
                out.push(c);
                if c == ',' {
                    out.push(' ');
                }
            }
            ':' if stack.last() == Some(&'{') && !key_done => {
                flush(&mut token, &mut out);
                key_done = true;
                out.push_str(": ");
            }
            c => token.push(c),
        }
    }
    flush(&mut token, &mut out);
    out
}

/// Refuses YAML text that nests more than [`MAX_DEPTH`] levels, in one linear pass before the
/// parser sees it (the parser's own limit is reached only after a scan that grows with the
/// square of the depth). Counts flow brackets outside quotes and comments, plus block levels
/// by indentation and `- ` items; generous for any real configuration.
pub fn check_nesting(text: &str) -> Result<(), String> {
    let mut indents: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    for (n, line) in text.lines().enumerate() {
        let body = line.trim_start_matches(' ');
        if flow == 0 && !(body.is_empty() || body.starts_with('#')) {
            let indent = line.len() - body.len();
            while indents.last().is_some_and(|&i| i >= indent) {
                indents.pop();
            }
            indents.push(indent);
        }
        let items = body
            .as_bytes()
            .chunks(2)
            .take_while(|c| *c == b"- ")
            .count();
        let mut quote: Option<char> = None;
        let (mut prev, mut escaped) = (' ', false);
        for c in body.chars() {
            match (quote, c) {
                _ if escaped => escaped = false,
                (Some('"'), '\\') => escaped = true,
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '#') if prev == ' ' || prev == '\t' => break,
                (None, '\'' | '"') => quote = Some(c),
                (None, '[' | '{') => flow += 1,
                (None, ']' | '}') => flow = flow.saturating_sub(1),
                _ => {}
            }
            prev = c;
            if indents.len() + items + flow > MAX_DEPTH {
                return Err(format!(
                    "line {}: the YAML nests more than {MAX_DEPTH} levels deep",
                    n + 1
                ));
            }
        }
    }
    Ok(())
}

/// A YAML parser message, with its limits said in words: nesting, and aliases that expand to
/// far more than the text holds (an "alias bomb", refused by the parser before it expands).
pub fn yaml_message(e: &serde_yaml_ng::Error) -> String {
    let m = e.to_string();
    if m.contains("recursion limit exceeded") {
        format!("{m}: the value nests more than {MAX_DEPTH} levels deep")
    } else if m.contains("repetition limit exceeded") {
        format!(
            "{m}: its aliases (`*name`) repeat anchored values (`&name`) so often that the document would expand to far more values than it holds (an alias bomb); refused before expanding it. Write the values out, or repeat anchors less"
        )
    } else {
        m
    }
}

/// At most 80 characters of `s` (an error message quotes the start of a long value).
fn clip(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// True when `s` has a `,` that is not inside `[]`, `{}`, `()` or quotes.
fn has_top_level_comma(s: &str) -> bool {
    let mut depth = 0i32;
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            escaped = false;
            continue;
        }
        match (quote, c) {
            (_, '\\') => escaped = true,
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '[' | '{' | '(') => depth += 1,
            (None, ']' | '}' | ')') => depth -= 1,
            (None, ',') if depth == 0 => return true,
            _ => {}
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn val(s: &str) -> Value {
        parse_value(s).unwrap()
    }

    fn yaml(s: &str) -> Value {
        serde_yaml_ng::from_str(s).unwrap()
    }

    #[test]
    fn operators() {
        let o = parse_override("data.train_batch_size=256").unwrap();
        assert_eq!(o.op, OverrideOp::Set);
        assert_eq!(o.key, vec!["data", "train_batch_size"]);
        assert_eq!(o.value, Some(Value::Number(256.into())));
        assert_eq!(parse_override("+a.b=1").unwrap().op, OverrideOp::Add);
        assert_eq!(parse_override("++a.b=1").unwrap().op, OverrideOp::ForceAdd);
        let d = parse_override("~a.b").unwrap();
        assert_eq!((d.op, d.value), (OverrideOp::Delete, None));
        let d = parse_override("~a.b=3").unwrap();
        assert_eq!(
            (d.op, d.value),
            (OverrideOp::Delete, Some(Value::Number(3.into())))
        );
    }

    #[test]
    fn scalar_values_follow_hydra() {
        assert_eq!(val("null"), Value::Null);
        assert_eq!(val("True"), Value::Bool(true));
        assert_eq!(val("false"), Value::Bool(false));
        assert_eq!(val("FALSE"), Value::Bool(false));
        assert_eq!(val("1e-6").as_f64(), Some(1e-6));
        assert_eq!(val("-1").as_i64(), Some(-1));
        assert_eq!(val("0.5").as_f64(), Some(0.5));
        assert_eq!(val(""), Value::String(String::new()));
        assert_eq!(val("console"), Value::String("console".into()));
        assert_eq!(
            val("'quoted string'"),
            Value::String("quoted string".into())
        );
        assert_eq!(val("\"1\""), Value::String("1".into()));
        assert_eq!(
            val("~/data/gsm8k/train.parquet"),
            Value::String("~/data/gsm8k/train.parquet".into())
        );
        assert_eq!(
            val("http://host:8000/x"),
            Value::String("http://host:8000/x".into())
        );
        assert!(val("inf").as_f64().unwrap().is_infinite());
    }

    #[test]
    fn structured_values() {
        assert_eq!(val("['console']"), yaml("[console]"));
        assert_eq!(val("[console,wandb]"), yaml("[console, wandb]"));
        assert_eq!(val("[]"), yaml("[]"));
        assert_eq!(val("{k: v, n: 2}"), yaml("{k: v, n: 2}"));
        assert_eq!(
            val("[{name: acc, type: builtin, scorer: gsm8k, kwargs: {method: flexible}}]"),
            yaml("[{name: acc, type: builtin, scorer: gsm8k, kwargs: {method: flexible}}]")
        );
        assert!(parse_value("[unclosed").is_err());
        // Hydra's escapes and a `*` in unquoted names (verl's FSDP-turbo example scripts).
        assert_eq!(
            val(r"{model.layers.\{*\}:{},lm_head:{}}"),
            yaml("{'model.layers.{*}': {}, 'lm_head': {}}")
        );
        assert_eq!(val(r"[a\,b,c*]"), yaml("['a,b', 'c*']"));
    }

    #[test]
    fn sweeps_are_rejected_with_a_hint() {
        let e = parse_value("console,wandb").unwrap_err();
        assert!(e.contains("[console,wandb]"), "{e}");
        assert!(parse_value("choice(1,2)").is_err());
        assert!(parse_value("'a,b'").is_ok());
    }

    #[test]
    fn malformed_overrides() {
        assert!(parse_override("data.train_batch_size")
            .unwrap_err()
            .contains("key=value"));
        assert!(parse_override("=3").is_err());
        assert!(parse_override("a..b=3")
            .unwrap_err()
            .contains("empty segment"));
        assert!(parse_override("a b=3").is_err());
    }

    #[test]
    fn deep_nesting_fails_fast_with_the_limit_named() {
        let t = std::time::Instant::now();
        let deep = format!("a={}1{}", "[".repeat(200_000), "]".repeat(200_000));
        let e = parse_override(&deep).unwrap_err();
        assert!(
            e.contains("more than 128 levels"),
            "{}",
            &e[..e.len().min(300)]
        );
        assert!(
            e.len() < 400,
            "the message quotes only the start of the value"
        );
        let key = vec!["a"; 10_000].join(".");
        let e = parse_override(&format!("+{key}=1")).unwrap_err();
        assert!(e.contains("10000 dotted parts"), "{e}");
        assert!(t.elapsed().as_secs_f64() < 2.0, "{:?}", t.elapsed());
    }
}
