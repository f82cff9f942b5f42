//! The key schema: which dotted keys exist (the typed defaults, free-form mappings, verl keys
//! in the compat table), and the "did you mean" suggestion for one that does not.

use serde_yaml_ng::Value;

use super::compat;
use super::tree;
use super::ConfigError;

/// What a dotted key is, relative to the typed defaults and the compat table.
#[derive(Debug, PartialEq)]
pub(super) enum KeyKind {
    /// A typed key (its default exists in the tree).
    Typed,
    /// Inside a free-form mapping (`reward_kwargs.x`).
    FreeMap,
    /// Covered by the compat table (or an ancestor of entries in it).
    Compat,
    Unknown,
}

pub(super) struct Schema<'a> {
    pub(super) defaults: &'a Value,
}

impl Schema<'_> {
    pub(super) fn kind(&self, path: &[String]) -> KeyKind {
        let path = &compat::canonical(path)[..];
        if tree::get(self.defaults, path).is_some() {
            return KeyKind::Typed;
        }
        for i in (1..path.len()).rev() {
            if let Some(v) = tree::get(self.defaults, &path[..i]) {
                // Inside a free-form mapping, or inside a list's elements (`reward.sources.1.path`):
                // the typed deserialisation checks those fields.
                if v.as_mapping().is_some_and(|m| m.is_empty()) || v.is_sequence() {
                    return KeyKind::FreeMap;
                }
                break;
            }
        }
        if compat::lookup(path).is_some() || compat::is_table_prefix(path) {
            return KeyKind::Compat;
        }
        KeyKind::Unknown
    }

    /// Rejects unknown keys in a user tree, with suggestions.
    pub(super) fn check_tree(
        &self,
        node: &Value,
        path: &mut Vec<String>,
    ) -> Result<(), ConfigError> {
        let Some(map) = node.as_mapping() else {
            return Ok(());
        };
        for (k, v) in map {
            path.push(tree::key_str(k));
            match self.kind(path) {
                KeyKind::Unknown => return Err(self.unknown(path)),
                KeyKind::Typed => {
                    let is_struct = tree::get(self.defaults, &compat::canonical(path))
                        .and_then(Value::as_mapping)
                        .is_some_and(|m| !m.is_empty());
                    if is_struct {
                        self.check_tree(v, path)?;
                    }
                }
                KeyKind::Compat if compat::is_table_prefix(path) => self.check_tree(v, path)?,
                _ => {}
            }
            path.pop();
        }
        Ok(())
    }

    /// The unknown-key error for `path`, naming the closest valid keys.
    pub(super) fn unknown(&self, path: &[String]) -> ConfigError {
        let key = tree::join(path);
        // Deepest existing typed parent.
        let canon = compat::canonical(path);
        let mut depth = path.len() - 1;
        while depth > 0 && tree::get(self.defaults, &canon[..depth]).is_none() {
            depth -= 1;
        }
        let parent = &path[..depth];
        let name = &path[depth];
        let mut siblings: Vec<String> = tree::get(self.defaults, &canon[..depth])
            .and_then(Value::as_mapping)
            .map(|m| m.keys().map(tree::key_str).collect())
            .unwrap_or_default();
        siblings.extend(
            compat::names_under(&canon[..depth])
                .into_iter()
                .filter(|n| n != "_target_"),
        );
        let mut scored: Vec<(f64, String)> = siblings
            .iter()
            .map(|s| (strsim::jaro_winkler(name, s), s.clone()))
            .filter(|(score, _)| *score >= 0.8)
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0));
        let prefix = if parent.is_empty() {
            String::new()
        } else {
            format!("{}.", tree::join(parent))
        };
        let mut suggestions: Vec<String> = scored
            .iter()
            .take(3)
            .map(|(_, s)| format!("{prefix}{s}"))
            .collect();
        // The same leaf name elsewhere (a key given under the wrong section).
        let mut all = Vec::new();
        tree::leaves(self.defaults, &mut Vec::new(), &mut all);
        let leaf = path.last().expect("non-empty");
        let elsewhere = all
            .iter()
            .map(|p| tree::join(p))
            .chain(compat::entry_keys().map(str::to_string));
        for full in elsewhere {
            if full.rsplit('.').next() == Some(leaf.as_str())
                && depth + 1 == path.len()
                && full != key
                && !suggestions.contains(&full)
                && suggestions.len() < 5
            {
                suggestions.push(full);
            }
        }
        let hint = if !suggestions.is_empty() {
            format!(
                "; did you mean {}?",
                suggestions
                    .iter()
                    .map(|s| format!("`{s}`"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )
        } else if depth + 1 < path.len() {
            format!(
                "; `{}` has no key `{}`",
                tree::join(&path[..=depth]).trim_end_matches('.'),
                path[depth + 1..].join(".")
            )
        } else {
            let mut names: Vec<String> = siblings;
            names.sort();
            names.dedup();
            if names.is_empty() {
                String::new()
            } else {
                let under = if parent.is_empty() {
                    "the top level".to_string()
                } else {
                    format!("`{}`", tree::join(parent))
                };
                format!("; the keys under {under} are: {}", names.join(", "))
            }
        };
        ConfigError::UnknownKey { key, hint }
    }
}
