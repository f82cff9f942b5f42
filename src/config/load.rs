//! YAML → overrides → typed [`Config`]. See the module docs of `config` for the stages.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_yaml_ng::Value;

use super::compat::{self, Compat};
use super::interpolate::interpolate_tree;
use super::overrides::{parse_override, Override, OverrideOp};
use super::schema::{KeyKind, Schema};
use super::tree;
use super::{Config, ConfigError};

/// Where the base YAML comes from (besides the built-in defaults).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ConfigSource {
    /// Only the built-in defaults (`configs/ppo_trainer.yaml`).
    #[default]
    Builtin,
    /// A YAML file merged over the defaults (`--config FILE`, or `--config-path DIR --config-name NAME`).
    File(PathBuf),
}

/// A loaded configuration and what the user should be told about it.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    /// verl keys the user set that have no effect here (reported once, in one warning line).
    pub no_effect: Vec<String>,
    /// Informational lines (legacy keys mapped onto their new place).
    pub notices: Vec<String>,
    /// Dotted keys the user set (in the YAML file or on the command line).
    pub user_set: BTreeSet<String>,
}

/// Loads a configuration: defaults, then `source`, then each override in order.
pub fn load(source: &ConfigSource, overrides: &[String]) -> Result<Loaded, ConfigError> {
    let defaults = serde_yaml_ng::to_value(Config::default()).map_err(|e| ConfigError::Value {
        key: "<defaults>".into(),
        message: e.to_string(),
    })?;
    let schema = Schema {
        defaults: &defaults,
    };
    let mut tree = defaults.clone();
    let mut user_set = BTreeSet::new();
    let mut notices = Vec::new();

    if let ConfigSource::File(path) = source {
        let file_label = path.display().to_string();
        let user = read_yaml_with_defaults(path, 0, &mut notices)?;
        if !user.is_null() && !user.is_mapping() {
            return Err(ConfigError::File {
                file: file_label,
                message: "the top level must be a mapping of keys".into(),
            });
        }
        schema
            .check_tree(&user, &mut Vec::new())
            .map_err(|e| match e {
                ConfigError::UnknownKey { key, hint } => ConfigError::File {
                    file: file_label.clone(),
                    message: ConfigError::UnknownKey { key, hint }.to_string(),
                },
                other => other,
            })?;
        let mut leaves = Vec::new();
        tree::leaves(&user, &mut Vec::new(), &mut leaves);
        user_set.extend(leaves.iter().map(|l| tree::join(l)));
        tree::merge(&mut tree, user);
    }

    for raw in overrides {
        let ov = parse_override(raw).map_err(|message| ConfigError::Override {
            raw: raw.clone(),
            message,
        })?;
        apply_override(&schema, &defaults, &mut tree, &ov, &mut user_set)?;
    }

    move_legacy_keys(&mut tree, &user_set, &mut notices)?;
    interpolate_tree(&schema, &mut tree)?;
    let no_effect = strip_compat_keys(&schema, &mut tree)?;

    let config: Config = serde_path_to_error::deserialize(tree).map_err(|e| {
        let key = e.path().to_string();
        ConfigError::Value {
            key,
            message: friendly_serde_message(&e.inner().to_string()),
        }
    })?;
    Ok(Loaded {
        config,
        no_effect,
        notices,
        user_set,
    })
}

/// Reads a YAML file and expands a Hydra `defaults:` list of sibling files.
fn read_yaml_with_defaults(
    path: &Path,
    depth: usize,
    notices: &mut Vec<String>,
) -> Result<Value, ConfigError> {
    let file = path.display().to_string();
    if depth > 8 {
        return Err(ConfigError::File {
            file,
            message: "`defaults` lists nest more than 8 deep (a cycle?)".into(),
        });
    }
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        file: file.clone(),
        message: e.to_string(),
    })?;
    super::overrides::check_nesting(&text).map_err(|message| ConfigError::File {
        file: file.clone(),
        message,
    })?;
    let mut value: Value = serde_yaml_ng::from_str(&text).map_err(|e| ConfigError::File {
        file: file.clone(),
        message: super::overrides::yaml_message(&e),
    })?;
    let Some(map) = value.as_mapping_mut() else {
        return Ok(value);
    };
    let Some(defaults) = map.remove("defaults") else {
        return Ok(value);
    };
    let Value::Sequence(entries) = defaults else {
        return Err(ConfigError::File {
            file,
            message: "`defaults` must be a list".into(),
        });
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut merged = Value::Mapping(Default::default());
    let mut self_merged = false;
    for entry in entries {
        match entry {
            Value::String(name) if name == "_self_" => {
                tree::merge(&mut merged, value.clone());
                self_merged = true;
            }
            Value::String(name) => {
                let candidates = [dir.join(format!("{name}.yaml")), dir.join(&name)];
                match candidates.iter().find(|p| p.is_file()) {
                    Some(p) => {
                        let sub = read_yaml_with_defaults(p, depth + 1, notices)?;
                        tree::merge(&mut merged, sub);
                    }
                    // verl's own base config: the built-in defaults already are that.
                    None if name == "ppo_trainer" => {}
                    None => {
                        return Err(ConfigError::File {
                            file,
                            message: format!(
                                "`defaults` entry `{name}`: no file {}",
                                candidates[0].display()
                            ),
                        })
                    }
                }
            }
            other => notices.push(format!(
                "{file}: config-group selection {} in `defaults` has no effect in main_ppo",
                tree::show(&other)
            )),
        }
    }
    if !self_merged {
        tree::merge(&mut merged, value);
    }
    Ok(merged)
}

fn apply_override(
    schema: &Schema,
    defaults: &Value,
    tree: &mut Value,
    ov: &Override,
    user_set: &mut BTreeSet<String>,
) -> Result<(), ConfigError> {
    let key = tree::join(&ov.key);
    match schema.kind(&ov.key) {
        KeyKind::Unknown => {
            return Err(match schema.unknown(&ov.key) {
                ConfigError::UnknownKey { key, hint } => ConfigError::Override {
                    raw: ov.raw.clone(),
                    message: format!("unknown key `{key}`{hint}"),
                },
                other => other,
            })
        }
        KeyKind::Typed | KeyKind::FreeMap | KeyKind::Compat => {}
    }
    // A list index must name an element (or the next one, which appends).
    let mut node = &*tree;
    for (i, seg) in ov.key.iter().enumerate() {
        match node {
            Value::Sequence(seq) => {
                let n = seq.len();
                match seg.parse::<usize>() {
                    Ok(k) if k < n => node = &seq[k],
                    Ok(k) if k == n && i + 1 == ov.key.len() => break,
                    _ => {
                        return Err(ConfigError::Override {
                            raw: ov.raw.clone(),
                            message: format!(
                                "`{}` is a list of {n} entries: `{seg}` is not an index of one (0..{n})",
                                tree::join(&ov.key[..i])
                            ),
                        })
                    }
                }
            }
            Value::Mapping(m) => match m.get(seg.as_str()) {
                Some(v) => node = v,
                None => break,
            },
            _ => break,
        }
    }
    match ov.op {
        OverrideOp::Delete => {
            if let Some(expected) = &ov.value {
                let current = tree::get(tree, &ov.key).cloned().unwrap_or(Value::Null);
                if &current != expected {
                    return Err(ConfigError::Override {
                        raw: ov.raw.clone(),
                        message: format!(
                            "`{key}` is {}, not {}; nothing deleted",
                            tree::show(&current),
                            tree::show(expected)
                        ),
                    });
                }
            }
            match tree::get(defaults, &ov.key) {
                Some(default) => tree::set(tree, &ov.key, default.clone()),
                None => {
                    tree::remove(tree, &ov.key);
                }
            }
            user_set.retain(|k| k != &key && !k.starts_with(&format!("{key}.")));
        }
        // `+key` on an existing key is an error in Hydra; here keys verl lacks may exist, so
        // `=`, `+` and `++` all set (a verl script must not fail for it).
        OverrideOp::Set | OverrideOp::Add | OverrideOp::ForceAdd => {
            let value = ov.value.clone().unwrap_or(Value::Null);
            if value.is_mapping() && schema.kind(&ov.key) == KeyKind::Typed {
                schema
                    .check_tree(&value, &mut ov.key.clone())
                    .map_err(|e| ConfigError::Override {
                        raw: ov.raw.clone(),
                        message: e.to_string(),
                    })?;
            }
            let mut leaves = Vec::new();
            tree::leaves(&value, &mut ov.key.clone(), &mut leaves);
            user_set.extend(leaves.iter().map(|l| tree::join(l)));
            user_set.insert(key);
            // A struct-valued override merges (Hydra semantics for dicts); anything else replaces.
            let existing_struct = tree::get(tree, &ov.key)
                .is_some_and(|v| v.as_mapping().is_some_and(|m| !m.is_empty()));
            if value.is_mapping() && existing_struct && schema.kind(&ov.key) == KeyKind::Typed {
                let mut node = tree::get(tree, &ov.key).cloned().unwrap_or(Value::Null);
                tree::merge(&mut node, value);
                tree::set(tree, &ov.key, node);
            } else {
                tree::set(tree, &ov.key, value);
            }
        }
    }
    Ok(())
}

/// Moves the legacy top-level reward keys (`custom_reward_function.*`, `reward_model.*`,
/// `sandbox_fusion.*`) under `reward.*`, as verl's `migrate_legacy_reward_impl` does.
fn move_legacy_keys(
    tree: &mut Value,
    user_set: &BTreeSet<String>,
    notices: &mut Vec<String>,
) -> Result<(), ConfigError> {
    for (from, compat) in compat::TABLE {
        let Compat::MovedTo(to) = compat else {
            continue;
        };
        let from_path = tree::split(from);
        let Some(value) = tree::get(tree, &from_path).cloned() else {
            continue;
        };
        if value.is_null() {
            tree::remove(tree, &from_path);
            continue;
        }
        let to_path = tree::split(to);
        let new_set_by_user = user_set
            .iter()
            .any(|k| k == to || k.starts_with(&format!("{to}.")));
        if new_set_by_user {
            let current = tree::get(tree, &to_path).cloned().unwrap_or(Value::Null);
            if current != value {
                return Err(ConfigError::Invalid(vec![format!(
                    "`{from}` ({}) and `{to}` ({}) are both set and differ; `{from}` is verl's legacy spelling of `{to}`: keep one",
                    tree::show(&value),
                    tree::show(&current)
                )]));
            }
        }
        tree::set(tree, &to_path, value);
        tree::remove(tree, &from_path);
        notices.push(format!("legacy key `{from}` is read as `{to}`"));
    }
    Ok(())
}

/// Removes every key the compat table covers; returns the no-effect keys the user set.
fn strip_compat_keys(schema: &Schema, tree: &mut Value) -> Result<Vec<String>, ConfigError> {
    let mut leaves = Vec::new();
    tree::leaves(tree, &mut Vec::new(), &mut leaves);
    let mut no_effect = Vec::new();
    for leaf in leaves {
        if matches!(schema.kind(&leaf), KeyKind::Typed | KeyKind::FreeMap) {
            continue;
        }
        let Some((entry, compat)) = compat::lookup(&leaf) else {
            // An empty mapping left behind by a removal, or an ancestor of table entries.
            tree::remove(tree, &leaf);
            continue;
        };
        let value = tree::get(tree, &leaf).cloned().unwrap_or(Value::Null);
        if let Compat::Unsupported { default, why } = compat {
            if tree::join(&leaf) == entry && value != compat::default_value(default) {
                return Err(ConfigError::Unsupported {
                    key: entry.to_string(),
                    value: tree::show(&value),
                    why: why.to_string(),
                });
            }
        }
        tree::remove(tree, &leaf);
        if entry != "_target_" && !value.is_null() {
            no_effect.push(tree::join(&leaf));
        }
    }
    // Drop mappings that only held compat keys.
    prune_untyped(schema, tree, &mut Vec::new());
    no_effect.sort();
    no_effect.dedup();
    Ok(no_effect)
}

fn prune_untyped(schema: &Schema, node: &mut Value, path: &mut Vec<String>) {
    let Some(map) = node.as_mapping_mut() else {
        return;
    };
    let keys: Vec<Value> = map.keys().cloned().collect();
    for k in keys {
        path.push(tree::key_str(&k));
        match schema.kind(path) {
            KeyKind::Typed => {
                if let Some(child) = map.get_mut(&k) {
                    prune_untyped(schema, child, path);
                }
            }
            KeyKind::FreeMap => {}
            _ => {
                map.remove(&k);
            }
        }
        path.pop();
    }
}

/// serde's messages speak Rust (`expected usize`); say it in words.
fn friendly_serde_message(m: &str) -> String {
    m.replace("expected usize", "expected a non-negative integer")
        .replace("expected u64", "expected a non-negative integer")
        .replace("expected i64", "expected an integer")
        .replace("expected f64", "expected a number")
        .replace(
            "expected an array of length 2",
            "expected a list of two numbers",
        )
}
