//! YAML → overrides → typed [`Config`]. See the module docs of `config` for the stages.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_yaml_ng::Value;

use super::compat::{self, Compat};
use super::groups;
use super::hydra::{self, GroupOverride, Layer, Primary};
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
    /// `--config FILE`: a YAML file merged over verl's `ppo_trainer` (unless its `defaults`
    /// list names another base).
    File(PathBuf),
    /// `--config-path DIR --config-name NAME`: Hydra's config folder and name. One of verl's own
    /// configs (`ppo_trainer`, `ppo_megatron_trainer`, a group option) that DIR lacks comes from
    /// the built-in defaults.
    Hydra { dir: PathBuf, name: String },
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
    /// The option chosen for each of verl's config groups (`model_engine` → `dp`, ...).
    pub groups: Vec<(String, String)>,
}

/// Loads a configuration: defaults, then `source` (with its Hydra defaults lists and the
/// command line's group selections), then each key override in order.
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

    // A blank argument (a stray `\ ` in a shell script) sets nothing.
    if overrides.iter().any(|o| o.trim().is_empty()) {
        notices.push("a blank command-line argument was ignored".into());
    }
    let parsed = overrides
        .iter()
        .filter(|o| !o.trim().is_empty())
        .map(|raw| {
            parse_override(raw).map_err(|message| ConfigError::Override {
                raw: raw.clone(),
                message,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (groups, keys, searchpath) = split_group_overrides(source, &parsed)?;
    let composed = compose_source(source, &groups, searchpath.as_ref(), &mut notices)?;
    for layer in composed.layers {
        merge_layer(&schema, &mut tree, layer, &mut user_set)?;
    }
    for ov in keys {
        apply_override(&schema, &defaults, &mut tree, ov, &mut user_set)?;
    }

    move_legacy_keys(&mut tree, &user_set, &mut notices)?;
    interpolate_tree(&schema, &mut tree)?;
    super::engines::apply(&mut tree, &user_set, &mut notices)?;
    let no_effect = strip_compat_keys(&schema, &mut tree, &user_set)?;

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
        groups: composed.choices,
    })
}

/// Separates the command line's config-group selections (`model_engine=megatron`,
/// `actor@actor_rollout_ref.actor=dp_actor`, `+group=option`, `~group`) and `hydra.searchpath`
/// from the key overrides.
#[allow(clippy::type_complexity)]
fn split_group_overrides<'a>(
    source: &ConfigSource,
    parsed: &'a [Override],
) -> Result<(Vec<GroupOverride>, Vec<&'a Override>, Option<Value>), ConfigError> {
    let dir = match source {
        ConfigSource::Builtin => None,
        ConfigSource::File(f) => f.parent().map(Path::to_path_buf),
        ConfigSource::Hydra { dir, .. } => Some(dir.clone()),
    };
    let mut groups = Vec::new();
    let mut keys = Vec::new();
    let mut searchpath = None;
    for ov in parsed {
        if ov.key.len() == 2 && ov.key[0] == "hydra" && ov.key[1] == "searchpath" {
            searchpath = ov.value.clone();
            continue;
        }
        // `group@package=option`: the package may hold dots (`actor@actor_rollout_ref.actor`).
        let at = ov.key[0].contains('@');
        let first = &ov.key[0];
        let is_group = at
            || (ov.key.len() == 1
                && (groups::is_group(first)
                    || dir.as_ref().is_some_and(|d| d.join(first).is_dir())));
        if !is_group {
            keys.push(ov);
            continue;
        }
        let (group, package) = match tree::join(&ov.key).split_once('@') {
            Some((g, p)) => (g.to_string(), Some(p.to_string())),
            None => (first.clone(), None),
        };
        let option = match &ov.value {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                return Err(ConfigError::Override {
                    raw: ov.raw.clone(),
                    message: format!(
                        "`{group}` is one of verl's config groups: its value names an option (a config file), not {}",
                        tree::show(other)
                    ),
                })
            }
        };
        groups.push(GroupOverride {
            group,
            package,
            option,
            op: ov.op,
            raw: ov.raw.clone(),
        });
    }
    Ok((groups, keys, searchpath))
}

fn compose_source(
    source: &ConfigSource,
    groups: &[GroupOverride],
    searchpath: Option<&Value>,
    notices: &mut Vec<String>,
) -> Result<hydra::Composed, ConfigError> {
    let primary = match source {
        ConfigSource::Builtin => Primary::Builtin,
        ConfigSource::File(f) => Primary::File(f),
        ConfigSource::Hydra { dir, name } => {
            let stem = name.trim_end_matches(".yaml");
            if !dir.join(format!("{stem}.yaml")).is_file() && groups::builtin(stem).is_some() {
                notices.push(format!(
                    "--config-path {} has no {stem}.yaml: verl's `{stem}` is read from the built-in defaults",
                    dir.display()
                ));
            }
            Primary::Named { dir, name: stem }
        }
    };
    let composed = hydra::compose(primary, groups, searchpath)?;
    let engine: Vec<String> = composed
        .choices
        .iter()
        .filter(|(g, _)| g == "model_engine")
        .map(|(_, o)| o.clone())
        .collect();
    if let Some(e) = engine.last().filter(|e| *e != "dp") {
        notices.push(format!(
            "model_engine={e}: verl's {e} engine runs as main_ppo's single engine; its parallelism and layout keys have no effect"
        ));
    }
    Ok(composed)
}

/// Merges one composed config into the tree at its package: unknown keys are an error naming
/// the file; keys of verl's own files count as defaults (not as set by the user), and those of
/// them that hold verl's GPU-cluster defaults keep main_ppo's own (see
/// [`compat::HOST_DEFAULTS`]).
fn merge_layer(
    schema: &Schema,
    tree: &mut Value,
    layer: Layer,
    user_set: &mut BTreeSet<String>,
) -> Result<(), ConfigError> {
    let mut value = layer.value;
    for seg in layer.package.iter().rev() {
        let mut m = serde_yaml_ng::Mapping::new();
        m.insert(Value::String(seg.clone()), value);
        value = Value::Mapping(m);
    }
    schema
        .check_tree(&value, &mut Vec::new())
        .map_err(|e| match e {
            ConfigError::UnknownKey { key, hint } => ConfigError::File {
                file: layer.origin.clone(),
                message: ConfigError::UnknownKey { key, hint }.to_string(),
            },
            other => other,
        })?;
    if layer.verl_own {
        for (key, verl_default) in compat::HOST_DEFAULTS {
            let path = tree::split(key);
            if tree::get(&value, &path)
                .is_some_and(|v| compat::same_value(v, &compat::default_value(verl_default)))
            {
                tree::remove(&mut value, &path);
            }
        }
    } else {
        let mut leaves = Vec::new();
        tree::leaves(&value, &mut Vec::new(), &mut leaves);
        user_set.extend(leaves.iter().map(|l| tree::join(l)));
    }
    tree::merge(tree, value);
    Ok(())
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
/// `sandbox_fusion.*`) under `reward.*`, as verl's `migrate_legacy_reward_impl` does, and the
/// other keys verl spells two ways (`fsdp_config.dtype`). Values only verl's own files gave
/// (its defaults) are dropped, not moved.
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
        let set_by_user = user_set
            .iter()
            .any(|k| k == from || k.starts_with(&format!("{from}.")));
        if value.is_null() || !set_by_user {
            tree::remove(tree, &from_path);
            continue;
        }
        let to_path = tree::split(to);
        let new_set_by_user = user_set
            .iter()
            .any(|k| k == to || k.starts_with(&format!("{to}.")));
        if new_set_by_user {
            let current = tree::get(tree, &to_path).cloned().unwrap_or(Value::Null);
            if !compat::same_value(&current, &value) {
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

/// Removes every key the compat table covers; returns the no-effect keys the user set (keys
/// only verl's own files gave are its defaults: not reported).
fn strip_compat_keys(
    schema: &Schema,
    tree: &mut Value,
    user_set: &BTreeSet<String>,
) -> Result<Vec<String>, ConfigError> {
    let mut leaves = Vec::new();
    tree::leaves(tree, &mut Vec::new(), &mut leaves);
    let mut no_effect = Vec::new();
    for leaf in leaves {
        if matches!(schema.kind(&leaf), KeyKind::Typed | KeyKind::FreeMap) {
            continue;
        }
        let Some(found) = compat::lookup(&leaf) else {
            // An empty mapping left behind by a removal, or an ancestor of table entries.
            tree::remove(tree, &leaf);
            continue;
        };
        let value = tree::get(tree, &leaf).cloned().unwrap_or(Value::Null);
        let key = tree::join(&leaf);
        if let Compat::Unsupported { default, why } = found.compat {
            // The value at the entry (a mapping when the key is below it).
            let entry = &leaf[..found.depth];
            let at = tree::get(tree, entry).cloned().unwrap_or(Value::Null);
            if !compat::same_value(&at, &compat::default_value(default)) {
                return Err(ConfigError::Unsupported {
                    key: tree::join(entry),
                    value: tree::show(&at),
                    why: why.to_string(),
                });
            }
        }
        tree::remove(tree, &leaf);
        if !found.target && !value.is_null() && user_set.contains(&key) {
            no_effect.push(key);
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
    // `unknown variant `x`, expected one of `a`, `b`` (an enum key).
    if let Some(rest) = m.strip_prefix("unknown variant ") {
        if let Some((value, expected)) = rest.split_once(", expected ") {
            let expected = expected.trim_start_matches("one of ").replace('`', "");
            return format!("{value} is not one of the values implemented here: {expected}");
        }
    }
    m.replace("expected usize", "expected a non-negative integer")
        .replace("expected u64", "expected a non-negative integer")
        .replace("expected i64", "expected an integer")
        .replace("expected f64", "expected a number")
        .replace(
            "expected an array of length 2",
            "expected a list of two numbers",
        )
}
