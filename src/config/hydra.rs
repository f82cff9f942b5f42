//! Hydra's defaults lists, as verl's config folder uses them: entries `name`,
//! `group: option`, `group@package: option`, `optional group: option`, `override group: option`,
//! `_self_` (where the file's own keys merge; at the end when absent), `${group}` in an option
//! (the option chosen for another group), `# @package _global_` headers, `hydra.searchpath`, and
//! the command line's group selections (`group=option`, `group@package=option`, `+group=option`,
//! `~group`).
//!
//! A config is looked up in the search path (the `--config-path` folder, the `--config` file's
//! folder, then `hydra.searchpath` folders); one of verl's own configs that no folder holds is
//! read from the built-in defaults (see `groups.rs`). The result is a list of layers in merge
//! order, each a mapping placed at its package.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_yaml_ng::Value;

use super::groups;
use super::overrides::OverrideOp;
use super::tree;
use super::ConfigError;

/// One config's own keys, placed at `package`, in merge order.
#[derive(Debug, Clone)]
pub(super) struct Layer {
    pub package: Vec<String>,
    pub value: Value,
    /// The file (or `built-in NAME`) it came from, for messages.
    pub origin: String,
    /// A config verl itself defines (a file of verl's config folder, or its built-in stand-in):
    /// its values are verl's defaults, not the user's choices.
    pub verl_own: bool,
}

/// A group selection from the command line.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct GroupOverride {
    pub group: String,
    pub package: Option<String>,
    /// `None`: `~group` or `group=null` (nothing selected).
    pub option: Option<String>,
    pub op: OverrideOp,
    pub raw: String,
}

/// Where the primary config comes from.
#[derive(Debug, Clone, Copy)]
pub(super) enum Primary<'a> {
    /// verl's `ppo_trainer` from the built-in defaults (plus a `--config` file on top).
    Builtin,
    /// `--config FILE`: the file, over verl's `ppo_trainer` unless its defaults name a base.
    File(&'a Path),
    /// `--config-path DIR --config-name NAME`.
    Named { dir: &'a Path, name: &'a str },
}

/// The composed configuration.
#[derive(Debug, Clone, Default)]
pub(super) struct Composed {
    pub layers: Vec<Layer>,
    /// The option chosen for each group (`model_engine` → `megatron`), in order of choice.
    pub choices: Vec<(String, String)>,
}

/// verl's top-level config files (besides the group folders).
const VERL_TOP_LEVEL: [&str; 4] = [
    "ppo_trainer",
    "ppo_megatron_trainer",
    "legacy_reward_impl",
    "reward_manager",
];

#[derive(Debug, Clone)]
struct Root {
    dir: PathBuf,
    verl_layout: bool,
}

/// A parsed defaults-list entry.
#[derive(Debug, Clone)]
enum Entry {
    SelfRef,
    Config {
        path: String,
        package: Option<String>,
        optional: bool,
    },
    Group {
        group: String,
        package: Option<String>,
        option: Option<String>,
        optional: bool,
        is_override: bool,
    },
}

/// An override of a group's option (from the command line or an `override` entry).
#[derive(Debug, Clone)]
struct Choice {
    group: String,
    package: Option<String>,
    option: Option<String>,
    origin: String,
    used: bool,
    /// `++group=option`: selects, or adds an entry when none matches.
    add_if_unused: bool,
}

/// A config read from a folder or from the built-in stand-ins.
struct Source {
    value: Value,
    header: Option<Vec<String>>,
    origin: String,
    verl_own: bool,
}

struct Composer {
    roots: Vec<Root>,
    /// Search-path entries that cannot be read here (`pkg://python.module`).
    unreadable: Vec<String>,
    overrides: Vec<Choice>,
    choices: BTreeMap<String, Option<String>>,
    order: Vec<(String, String)>,
    layers: Vec<Layer>,
}

/// Composes the primary config with the command line's group selections.
pub(super) fn compose(
    primary: Primary,
    groups_cli: &[GroupOverride],
    searchpath_cli: Option<&Value>,
) -> Result<Composed, ConfigError> {
    let mut c = Composer {
        roots: Vec::new(),
        unreadable: Vec::new(),
        overrides: Vec::new(),
        choices: BTreeMap::new(),
        order: Vec::new(),
        layers: Vec::new(),
    };
    let mut added = Vec::new();
    for g in groups_cli {
        let entry = || Entry::Group {
            group: g.group.clone(),
            package: g.package.clone(),
            option: g.option.clone(),
            optional: false,
            is_override: false,
        };
        match g.op {
            OverrideOp::Add => added.push(entry()),
            OverrideOp::Set | OverrideOp::Delete | OverrideOp::ForceAdd => {
                c.overrides.push(Choice {
                    group: g.group.clone(),
                    package: g.package.clone(),
                    option: if g.op == OverrideOp::Delete {
                        None
                    } else {
                        g.option.clone()
                    },
                    origin: format!("override `{}`", g.raw),
                    used: false,
                    add_if_unused: g.op == OverrideOp::ForceAdd,
                })
            }
        }
    }
    let (dir, name) = match primary {
        Primary::Builtin => (None, "ppo_trainer".to_string()),
        Primary::File(f) => (
            Some(f.parent().unwrap_or(Path::new(".")).to_path_buf()),
            f.file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default(),
        ),
        Primary::Named { dir, name } => (Some(dir.to_path_buf()), name.to_string()),
    };
    if let Some(d) = &dir {
        c.roots.push(Root {
            dir: d.clone(),
            verl_layout: is_verl_layout(d),
        });
    }
    let stem = name.trim_end_matches(".yaml").to_string();
    let mut source = match primary {
        Primary::File(f) => Some(c.read_file(f, f.display().to_string(), false)?),
        _ => c.find(&[], &stem)?,
    };
    let Some(mut src) = source.take() else {
        return Err(ConfigError::File {
            file: dir
                .map(|d| d.join(format!("{stem}.yaml")).display().to_string())
                .unwrap_or(stem),
            message:
                "no such config file (--config-path DIR --config-name NAME reads DIR/NAME.yaml)"
                    .into(),
        });
    };
    c.add_searchpath(&mut src, searchpath_cli)?;
    // A `--config` file without a base of verl's stands over verl's `ppo_trainer` (the built-in
    // one: a file of that name beside it is read only when its defaults list names it).
    if matches!(primary, Primary::File(_)) && !names_verl_base(&src.value) {
        let text = groups::builtin("ppo_trainer").expect("built-in ppo_trainer");
        let base = parse_source(text, "built-in ppo_trainer".into(), true)?;
        c.expand_source(base, &[], Vec::new(), 0, Vec::new())?;
    }
    c.expand_source(src, &[], Vec::new(), 0, added)?;
    let late: Vec<Choice> = c
        .overrides
        .iter()
        .filter(|o| o.add_if_unused && !o.used)
        .cloned()
        .collect();
    for o in late {
        c.expand_group(
            &o.origin,
            &[],
            &[],
            &o.group,
            o.package.clone(),
            o.option.clone(),
            false,
            0,
        )?;
    }
    if let Some(unused) = c.overrides.iter().find(|o| !o.used && o.option.is_some()) {
        let what = unused
            .package
            .as_ref()
            .map_or(unused.group.clone(), |p| format!("{}@{p}", unused.group));
        return Err(ConfigError::File {
            file: unused.origin.clone(),
            message: format!(
                "no defaults-list entry selects the group `{what}`; add one with `+{what}=OPTION`"
            ),
        });
    }
    Ok(Composed {
        layers: c.layers,
        choices: c.order,
    })
}

/// True when the folder looks like (a copy of) verl's `verl/trainer/config`.
pub(super) fn is_verl_layout(dir: &Path) -> bool {
    dir.join("ppo_trainer.yaml").is_file() && dir.join("actor").is_dir()
}

/// Whether a config's defaults list names verl's base config (`ppo_trainer`, ...).
fn names_verl_base(v: &Value) -> bool {
    let Some(list) = v.get("defaults").and_then(Value::as_sequence) else {
        return false;
    };
    list.iter().any(|e| {
        e.as_str()
            .is_some_and(|s| s.trim_end_matches(".yaml").ends_with("_trainer"))
    })
}

impl Composer {
    fn add_searchpath(&mut self, src: &mut Source, cli: Option<&Value>) -> Result<(), ConfigError> {
        let from_file = src
            .value
            .get("hydra")
            .and_then(|h| h.get("searchpath"))
            .cloned();
        for list in [from_file.as_ref(), cli].into_iter().flatten() {
            let entries: Vec<String> = match list {
                Value::Sequence(s) => s
                    .iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect(),
                Value::String(s) => vec![s.clone()],
                _ => Vec::new(),
            };
            for e in entries {
                if let Some(rest) = e.strip_prefix("file://") {
                    let dir = PathBuf::from(rest);
                    self.roots.push(Root {
                        verl_layout: is_verl_layout(&dir),
                        dir,
                    });
                } else if e.starts_with("pkg://") {
                    self.unreadable.push(e);
                } else {
                    let dir = PathBuf::from(&e);
                    self.roots.push(Root {
                        verl_layout: is_verl_layout(&dir),
                        dir,
                    });
                }
            }
        }
        Ok(())
    }

    fn read_file(
        &self,
        path: &Path,
        origin: String,
        verl_own: bool,
    ) -> Result<Source, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
            file: origin.clone(),
            message: e.to_string(),
        })?;
        parse_source(&text, origin, verl_own)
    }

    /// The config `name` of group `group` (path segments; empty for the top level).
    fn find(&self, group: &[String], name: &str) -> Result<Option<Source>, ConfigError> {
        let rel: PathBuf = group
            .iter()
            .collect::<PathBuf>()
            .join(format!("{name}.yaml"));
        for root in &self.roots {
            let p = root.dir.join(&rel);
            if p.is_file() {
                let own = root.verl_layout && (!group.is_empty() || VERL_TOP_LEVEL.contains(&name));
                return self.read_file(&p, p.display().to_string(), own).map(Some);
            }
        }
        let key = if group.is_empty() {
            name.to_string()
        } else {
            format!("{}/{name}", group.join("/"))
        };
        match groups::builtin(&key) {
            Some(text) => parse_source(text, format!("built-in {key}"), true).map(Some),
            None => Ok(None),
        }
    }

    fn searched(&self) -> String {
        let mut places: Vec<String> = self
            .roots
            .iter()
            .map(|r| r.dir.display().to_string())
            .collect();
        places.push("the built-in defaults".into());
        places.extend(
            self.unreadable
                .iter()
                .map(|u| format!("{u} (a Python package: not readable here)")),
        );
        places.join(", ")
    }

    fn expand_source(
        &mut self,
        src: Source,
        group: &[String],
        package: Vec<String>,
        depth: usize,
        extra: Vec<Entry>,
    ) -> Result<(), ConfigError> {
        if depth > 16 {
            return Err(ConfigError::File {
                file: src.origin,
                message: "`defaults` lists nest more than 16 deep (a cycle?)".into(),
            });
        }
        let package = src.header.clone().unwrap_or(package);
        let mut value = src.value;
        let mut entries = match value.as_mapping_mut().and_then(|m| m.remove("defaults")) {
            None => Vec::new(),
            Some(Value::Sequence(list)) => list
                .iter()
                .map(|e| parse_entry(e).map_err(|m| file_err(&src.origin, m)))
                .collect::<Result<Vec<_>, _>>()?,
            Some(_) => return Err(file_err(&src.origin, "`defaults` must be a list".into())),
        };
        if let Some(m) = value.as_mapping_mut() {
            m.remove("hydra");
        }
        if !entries.iter().any(|e| matches!(e, Entry::SelfRef)) {
            entries.push(Entry::SelfRef);
        }
        entries.extend(extra);
        for e in &entries {
            if let Entry::Group {
                group: g,
                package: p,
                option,
                is_override: true,
                ..
            } = e
            {
                self.overrides.push(Choice {
                    group: resolve_group(group, g),
                    package: p.clone(),
                    option: option.clone(),
                    origin: src.origin.clone(),
                    used: false,
                    add_if_unused: false,
                });
            }
        }
        let own = src.verl_own;
        let mut self_value = Some(value);
        for e in entries {
            match e {
                Entry::SelfRef => {
                    if let Some(v) = self_value.take() {
                        self.layers.push(Layer {
                            package: package.clone(),
                            value: v,
                            origin: src.origin.clone(),
                            verl_own: own,
                        });
                    }
                }
                Entry::Config {
                    path,
                    package: p,
                    optional,
                } => {
                    let pkg = child_package(&package, p.as_deref(), None);
                    let mut segs: Vec<String> = group.to_vec();
                    let parts: Vec<&str> = path.trim_end_matches(".yaml").split('/').collect();
                    let (name, dirs) = parts.split_last().expect("split gives one part");
                    for d in dirs {
                        push_segment(&mut segs, d);
                    }
                    match self.find(&segs, name)? {
                        Some(s) => self.expand_source(s, &segs, pkg, depth + 1, Vec::new())?,
                        None if optional => {}
                        None => {
                            return Err(file_err(
                                &src.origin,
                                format!(
                                    "defaults entry `{path}`: no config `{}` in {}",
                                    rel_name(&segs, name),
                                    self.searched()
                                ),
                            ))
                        }
                    }
                }
                Entry::Group {
                    is_override: true, ..
                } => {}
                Entry::Group {
                    group: g,
                    package: p,
                    option,
                    optional,
                    ..
                } => {
                    self.expand_group(&src.origin, group, &package, &g, p, option, optional, depth)?
                }
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn expand_group(
        &mut self,
        origin: &str,
        parent_group: &[String],
        parent_package: &[String],
        g: &str,
        p: Option<String>,
        option: Option<String>,
        optional: bool,
        depth: usize,
    ) -> Result<(), ConfigError> {
        let group = resolve_group(parent_group, g);
        let package = child_package(parent_package, p.as_deref(), Some(&group));
        let pkg = tree::join(&package);
        let entry_text = match (&p, &option) {
            (Some(p), Some(o)) => format!("{g}@{p}: {o}"),
            (None, Some(o)) => format!("{g}: {o}"),
            (Some(p), None) => format!("{g}@{p}: null"),
            (None, None) => format!("{g}: null"),
        };
        let matches =
            |o: &Choice| o.group == group && o.package.as_ref().is_none_or(|op| *op == pkg);
        // The first matching override wins (the command line, then outer configs); all that
        // match are used up.
        let first = self
            .overrides
            .iter()
            .find(|o| matches(o))
            .map(|o| (o.option.clone(), o.origin.clone()));
        for o in self.overrides.iter_mut().filter(|o| matches(o)) {
            o.used = true;
        }
        let (option, via) = first.unwrap_or((option, origin.to_string()));
        let option = match option {
            Some(o) => Some(
                self.interpolate(&o)
                    .map_err(|m| file_err(origin, format!("defaults entry `{entry_text}`: {m}")))?,
            ),
            None => None,
        };
        self.choices.insert(group.clone(), option.clone());
        let Some(option) = option else {
            return Ok(());
        };
        self.order.push((group.clone(), option.clone()));
        let segs: Vec<String> = group.split('/').map(str::to_string).collect();
        match self.find(&segs, &option)? {
            Some(s) => self.expand_source(s, &segs, package, depth + 1, Vec::new()),
            None if optional => Ok(()),
            None => {
                let options = groups::options(&group);
                let known = if options.is_empty() {
                    String::new()
                } else {
                    format!("; verl's options for `{group}` are: {}", options.join(", "))
                };
                Err(file_err(
                    &via,
                    format!(
                        "defaults entry `{entry_text}`{}: no config `{group}/{option}.yaml` in {}{known}",
                        if via == origin { String::new() } else { format!(" (in {origin})") },
                        self.searched()
                    ),
                ))
            }
        }
    }

    /// `${group}` in an option: the option chosen for that group.
    fn interpolate(&self, option: &str) -> Result<String, String> {
        let mut out = String::new();
        let mut rest = option;
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let end = rest[start..]
                .find('}')
                .ok_or_else(|| format!("unclosed `${{` in `{option}`"))?;
            let name = rest[start + 2..start + end].trim();
            match self.choices.get(name) {
                Some(Some(v)) => out.push_str(v),
                _ => {
                    return Err(format!(
                        "`${{{name}}}` names no group chosen before this entry"
                    ))
                }
            }
            rest = &rest[start + end + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

/// The package of a defaults entry: `@_global_[.x]` is absolute, `@x` is below the containing
/// config's package; without `@`, a group's entry goes below it under the group's name and a
/// config's entry at the same package.
fn child_package(parent: &[String], at: Option<&str>, group: Option<&str>) -> Vec<String> {
    match at {
        Some("_global_") => Vec::new(),
        Some(p) if p.starts_with("_global_.") => tree::split(&p["_global_.".len()..]),
        Some(p) => parent.iter().cloned().chain(tree::split(p)).collect(),
        None => parent
            .iter()
            .cloned()
            .chain(
                group
                    .into_iter()
                    .flat_map(|g| g.split('/'))
                    .map(str::to_string),
            )
            .collect(),
    }
}

fn file_err(origin: &str, message: String) -> ConfigError {
    ConfigError::File {
        file: origin.to_string(),
        message,
    }
}

fn rel_name(group: &[String], name: &str) -> String {
    if group.is_empty() {
        format!("{name}.yaml")
    } else {
        format!("{}/{name}.yaml", group.join("/"))
    }
}

fn push_segment(segs: &mut Vec<String>, s: &str) {
    match s {
        "" | "." => {}
        ".." => {
            segs.pop();
        }
        s => segs.push(s.to_string()),
    }
}

/// A group written in a defaults list, relative to the containing config's group (`/x` is
/// absolute), as a `/`-joined path.
fn resolve_group(parent: &[String], g: &str) -> String {
    let mut segs: Vec<String> = if g.starts_with('/') {
        Vec::new()
    } else {
        parent.to_vec()
    };
    for s in g.trim_start_matches('/').split('/') {
        push_segment(&mut segs, s);
    }
    segs.join("/")
}

fn parse_source(text: &str, origin: String, verl_own: bool) -> Result<Source, ConfigError> {
    super::overrides::check_nesting(text).map_err(|m| file_err(&origin, m))?;
    let value: Value = if text.trim().is_empty() {
        Value::Mapping(Default::default())
    } else {
        serde_yaml_ng::from_str(text)
            .map_err(|e| file_err(&origin, super::overrides::yaml_message(&e)))?
    };
    let value = if value.is_null() {
        Value::Mapping(Default::default())
    } else {
        value
    };
    if !value.is_mapping() {
        return Err(file_err(
            &origin,
            "the top level must be a mapping of keys".into(),
        ));
    }
    Ok(Source {
        value,
        header: header_package(text),
        origin,
        verl_own,
    })
}

/// `# @package _global_` (or `_global_.a.b`) in the comments before the first key.
fn header_package(text: &str) -> Option<Vec<String>> {
    for line in text.lines() {
        let l = line.trim();
        if l.is_empty() {
            continue;
        }
        let Some(comment) = l.strip_prefix('#') else {
            break;
        };
        if let Some(p) = comment.trim().strip_prefix("@package") {
            let p = p.trim();
            return Some(match p.strip_prefix("_global_") {
                Some(rest) => tree::split(rest.trim_start_matches('.'))
                    .into_iter()
                    .filter(|s| !s.is_empty())
                    .collect(),
                None => tree::split(p),
            });
        }
    }
    None
}

fn parse_entry(e: &Value) -> Result<Entry, String> {
    match e {
        Value::String(s) if s == "_self_" => Ok(Entry::SelfRef),
        Value::String(s) => {
            let (optional, path) = match s.strip_prefix("optional ") {
                Some(p) => (true, p.trim()),
                None => (false, s.trim()),
            };
            let (path, package) = match path.split_once('@') {
                Some((p, pkg)) => (p.to_string(), Some(pkg.to_string())),
                None => (path.to_string(), None),
            };
            Ok(Entry::Config {
                path,
                package,
                optional,
            })
        }
        Value::Mapping(m) if m.len() == 1 => {
            let (k, v) = m.iter().next().expect("one entry");
            let k = tree::key_str(k);
            let mut words: Vec<&str> = k.split_whitespace().collect();
            let target = words.pop().ok_or("an empty defaults entry")?;
            let mut optional = false;
            let mut is_override = false;
            for w in words {
                match w {
                    "optional" => optional = true,
                    "override" => is_override = true,
                    other => return Err(format!("defaults entry `{k}`: unknown keyword `{other}` (optional and override are Hydra's)")),
                }
            }
            let (group, package) = match target.split_once('@') {
                Some((g, p)) => (g.to_string(), Some(p.to_string())),
                None => (target.to_string(), None),
            };
            let option = match v {
                Value::Null => None,
                Value::String(s) => Some(s.clone()),
                Value::Bool(_) | Value::Number(_) => Some(tree::key_str(v)),
                _ => {
                    return Err(format!(
                        "defaults entry `{k}`: a list of options (Hydra's multi-select) is not supported; choose one"
                    ))
                }
            };
            Ok(Entry::Group {
                group,
                package,
                option,
                optional,
                is_override,
            })
        }
        other => Err(format!(
            "defaults entry {}: expected `name`, `group: option` or `_self_`",
            tree::show(other)
        )),
    }
}
