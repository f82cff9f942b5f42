//! `${...}` interpolations in string values (the part of OmegaConf that verl's YAML uses):
//! `${a.b}`, `${oc.select:a.b,default}`, `${oc.env:VAR,default}`, relative `${.key}`, with
//! limits on nesting and on the expanded size.

use serde_yaml_ng::Value;

use super::schema::{KeyKind, Schema};
use super::tree;
use super::ConfigError;

/// Resolves `${...}` interpolations in typed string values: `${a.b}`, `${oc.select:a.b,default}`,
/// `${oc.env:VAR,default}`, relative `${.key}`. Other resolvers are errors naming the key.
pub(super) fn interpolate_tree(schema: &Schema, tree: &mut Value) -> Result<(), ConfigError> {
    let mut leaves = Vec::new();
    tree::leaves(tree, &mut Vec::new(), &mut leaves);
    let snapshot = tree.clone();
    for leaf in leaves {
        if !matches!(schema.kind(&leaf), KeyKind::Typed | KeyKind::FreeMap) {
            continue;
        }
        let Some(Value::String(s)) = tree::get(tree, &leaf) else {
            continue;
        };
        if !s.contains("${") {
            continue;
        }
        let resolved =
            resolve_string(&snapshot, &leaf, s, 0).map_err(|message| ConfigError::Value {
                key: tree::join(&leaf),
                message,
            })?;
        tree::set(tree, &leaf, resolved);
    }
    Ok(())
}

/// The longest string an interpolation may expand to (a few references that each repeat
/// others would otherwise grow exponentially with the nesting).
const MAX_EXPANSION: usize = 1 << 20;

fn resolve_string(root: &Value, at: &[String], s: &str, depth: usize) -> Result<Value, String> {
    if depth > 16 {
        return Err("interpolation nests more than 16 deep (a cycle?)".into());
    }
    let mut out = String::new();
    let mut rest = s;
    let mut whole: Option<Value> = None;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let body_start = start + 2;
        let mut level = 1;
        let mut end = None;
        let bytes = rest.as_bytes();
        let mut i = body_start;
        while i < bytes.len() {
            if bytes[i..].starts_with(b"${") {
                level += 1;
                i += 2;
                continue;
            }
            if bytes[i] == b'}' {
                level -= 1;
                if level == 0 {
                    end = Some(i);
                    break;
                }
            }
            i += 1;
        }
        let end = end.ok_or_else(|| format!("unclosed `${{` in {s:?}"))?;
        let value = resolve_expr(root, at, &rest[body_start..end], depth)?;
        if start == 0
            && end + 1 == rest.len()
            && out.is_empty()
            && whole.is_none()
            && rest.len() == s.len()
        {
            whole = Some(value.clone());
        }
        out.push_str(&match &value {
            Value::String(v) => v.clone(),
            Value::Null => "None".into(),
            other => serde_yaml_ng::to_string(other)
                .unwrap_or_default()
                .trim()
                .to_string(),
        });
        rest = &rest[end + 1..];
        if out.len() > MAX_EXPANSION {
            return Err(format!(
                "interpolation expands to more than {MAX_EXPANSION} bytes (references repeating references?)"
            ));
        }
    }
    if let Some(v) = whole {
        return Ok(v);
    }
    out.push_str(rest);
    Ok(Value::String(out))
}

fn resolve_expr(root: &Value, at: &[String], expr: &str, depth: usize) -> Result<Value, String> {
    let expr = expr.trim();
    let (func, args) = match expr.split_once(':') {
        Some((f, a)) if f.starts_with("oc.") => (Some(f), a),
        _ => (None, expr),
    };
    let (first, default) = split_default(args);
    let lookup = |path: &str| -> Option<Value> {
        let p = path.trim();
        let segs: Vec<String> = if let Some(rel) = p.strip_prefix('.') {
            let ups = rel.chars().take_while(|c| *c == '.').count();
            let mut base: Vec<String> = at[..at.len().saturating_sub(1 + ups)].to_vec();
            base.extend(rel[ups..].split('.').map(str::to_string));
            base
        } else {
            tree::split(p)
        };
        tree::get(root, &segs).cloned()
    };
    let parse_default = |d: &str| -> Result<Value, String> {
        let d = d.trim();
        if d.contains("${") {
            resolve_string(root, at, d, depth + 1)
        } else {
            super::overrides::parse_value(d).or_else(|_| Ok(Value::String(d.to_string())))
        }
    };
    let value = match func {
        None => lookup(first).ok_or_else(|| format!("interpolation `${{{expr}}}`: no key `{first}`"))?,
        Some("oc.select") => match lookup(first) {
            Some(v) => v,
            None => match default {
                Some(d) => parse_default(d)?,
                None => Value::Null,
            },
        },
        Some("oc.env") => match std::env::var(first.trim()) {
            Ok(v) => Value::String(v),
            Err(_) => match default {
                Some(d) => parse_default(d)?,
                None => return Err(format!("interpolation `${{{expr}}}`: environment variable `{first}` is not set")),
            },
        },
        Some(other) => return Err(format!("interpolation `${{{expr}}}`: resolver `{other}` is not supported (oc.select and oc.env are)")),
    };
    match value {
        Value::String(s) if s.contains("${") => resolve_string(root, at, &s, depth + 1),
        v => Ok(v),
    }
}

/// Splits `path,default` at the first top-level comma.
fn split_default(args: &str) -> (&str, Option<&str>) {
    let mut level = 0;
    for (i, c) in args.char_indices() {
        match c {
            '{' | '[' => level += 1,
            '}' | ']' => level -= 1,
            ',' if level == 0 => return (&args[..i], Some(&args[i + 1..])),
            _ => {}
        }
    }
    (args, None)
}
