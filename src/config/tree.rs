//! Dotted-path access to a YAML tree (the untyped stage of config loading).

use serde_yaml_ng::{Mapping, Value};

/// `a.b.c` as segments.
pub fn split(path: &str) -> Vec<String> {
    path.split('.').map(str::to_string).collect()
}

pub fn join(path: &[String]) -> String {
    path.join(".")
}

/// The node at `path`, if every segment exists (mapping keys, or list indices).
pub fn get<'a>(root: &'a Value, path: &[String]) -> Option<&'a Value> {
    let mut node = root;
    for seg in path {
        node = match node {
            Value::Sequence(seq) => seq.get(seg.parse::<usize>().ok()?)?,
            _ => node.as_mapping()?.get(seg.as_str())?,
        };
    }
    Some(node)
}

/// Sets `path` to `value`, creating (or replacing non-mapping) parents as mappings.
pub fn set(root: &mut Value, path: &[String], value: Value) {
    let mut node = root;
    for seg in &path[..path.len() - 1] {
        // A list element by index (`reward.sources.1.path`, as Hydra writes it); the index one
        // past the end appends an element.
        let index = match (node.as_sequence(), seg.parse::<usize>()) {
            (Some(seq), Ok(i)) if i <= seq.len() => Some(i),
            _ => None,
        };
        if let Some(i) = index {
            let seq = node.as_sequence_mut().expect("checked above");
            if i == seq.len() {
                seq.push(Value::Mapping(Mapping::new()));
            }
            node = &mut seq[i];
            continue;
        }
        if !node.is_mapping() {
            *node = Value::Mapping(Mapping::new());
        }
        let map = node.as_mapping_mut().expect("just made a mapping");
        if !map
            .get(seg.as_str())
            .is_some_and(|v| v.is_mapping() || v.is_sequence())
        {
            map.insert(Value::String(seg.clone()), Value::Mapping(Mapping::new()));
        }
        node = map.get_mut(seg.as_str()).expect("just inserted");
    }
    let last = path.last().expect("non-empty path").clone();
    let index = match (node.as_sequence(), last.parse::<usize>()) {
        (Some(seq), Ok(i)) if i <= seq.len() => Some(i),
        _ => None,
    };
    if let Some(i) = index {
        let seq = node.as_sequence_mut().expect("checked above");
        if i == seq.len() {
            seq.push(value);
        } else {
            seq[i] = value;
        }
        return;
    }
    if !node.is_mapping() {
        *node = Value::Mapping(Mapping::new());
    }
    node.as_mapping_mut()
        .expect("mapping")
        .insert(Value::String(last), value);
}

/// Removes `path` and returns what was there. Parents left empty are kept.
pub fn remove(root: &mut Value, path: &[String]) -> Option<Value> {
    let (last, parents) = path.split_last()?;
    let mut node = root;
    for seg in parents {
        node = node.as_mapping_mut()?.get_mut(seg.as_str())?;
    }
    node.as_mapping_mut()?.remove(last.as_str())
}

/// Merges `src` into `dst`: mappings merge key by key, anything else replaces.
pub fn merge(dst: &mut Value, src: Value) {
    match (dst, src) {
        (Value::Mapping(d), Value::Mapping(s)) => {
            for (k, v) in s {
                match d.get_mut(&k) {
                    Some(existing) if existing.is_mapping() && v.is_mapping() => merge(existing, v),
                    _ => {
                        d.insert(k, v);
                    }
                }
            }
        }
        (d, s) => *d = s,
    }
}

/// Every leaf path under `node` (a leaf is anything that is not a non-empty mapping),
/// with `prefix` prepended.
pub fn leaves(node: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match node {
        Value::Mapping(m) if !m.is_empty() => {
            for (k, v) in m {
                prefix.push(key_str(k));
                leaves(v, prefix, out);
                prefix.pop();
            }
        }
        _ => out.push(prefix.clone()),
    }
}

/// A mapping key as text (YAML allows non-string keys; they are shown as YAML).
pub fn key_str(k: &Value) -> String {
    match k {
        Value::String(s) => s.clone(),
        other => serde_yaml_ng::to_string(other)
            .unwrap_or_default()
            .trim()
            .to_string(),
    }
}

/// A value rendered on one line for messages.
pub fn show(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Null => "null".into(),
        other => {
            let s = serde_json::to_string(other).unwrap_or_else(|_| format!("{other:?}"));
            if s.len() > 80 {
                format!(
                    "{}…",
                    &s[..s.char_indices().nth(77).map(|(i, _)| i).unwrap_or(s.len())]
                )
            } else {
                s
            }
        }
    }
}
