//! Every configuration key main_ppo knows, for the configuration reference
//! (`main_ppo config reference`, `docs/src/reference/config.md`): the typed keys of the
//! defaults and the verl keys of the compat table, each with its type, default, what it means
//! and what main_ppo does with it.
//!
//! Nothing here is a second list of keys. The typed keys are the leaves of the defaults tree;
//! their types are found by trying values of each kind through the typed deserialisation (the
//! same `Config` that loading fills); their descriptions are the field docs that
//! `scripts/gen_ppo_trainer_yaml.py` writes into `configs/ppo_trainer.yaml` (a test keeps that
//! file's keys and values equal to the defaults). The other keys are the compat table's
//! entries with their treatment.

use serde_yaml_ng::{Mapping, Value};

use super::compat::{self, Compat};
use super::tree;
use super::Config;

/// The commented defaults: the typed keys' descriptions.
const COMMENTED_DEFAULTS: &str = include_str!("../../configs/ppo_trainer.yaml");

/// What main_ppo does with a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// A typed key: read and acted on.
    Implemented,
    /// A typed key kept for verl's configs that nothing reads (verl's own code does not either).
    NotRead,
    /// A verl key accepted with any value and reported once as having no effect.
    NoEffect,
    /// A verl key accepted while it holds verl's default (`default`); any other value stops the
    /// run at start-up naming the key and `why`.
    RefusedUnlessDefault { why: String },
    /// A legacy spelling, read as `to`.
    Moved { to: String },
}

impl Status {
    /// The status as the reference's table shows it.
    pub fn label(&self) -> &'static str {
        match self {
            Status::Implemented => "implemented",
            Status::NotRead => "accepted, not read",
            Status::NoEffect => "no effect",
            Status::RefusedUnlessDefault { .. } => "refused unless default",
            Status::Moved { .. } => "legacy spelling",
        }
    }
}

/// One key of the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyDoc {
    /// The dotted key.
    pub key: String,
    /// A compat entry, which covers every key below it too (`actor_rollout_ref.actor.megatron`).
    pub subtree: bool,
    /// The values it takes, in words (`integer`, `bool or null`, `one of error, left, ...`).
    pub kind: String,
    /// Its default, rendered on one line; `None` where it has none of main_ppo's.
    pub default: Option<String>,
    pub status: Status,
    /// What it means (the field's doc; for a compat entry, the part of verl it belongs to).
    pub meaning: String,
}

/// Every key: the typed leaves of the defaults, then the compat entries not among them, in
/// dotted order.
pub fn catalogue() -> Vec<KeyDoc> {
    let mut defaults =
        serde_yaml_ng::to_value(Config::default()).expect("the defaults serialise to YAML");
    let docs = descriptions(COMMENTED_DEFAULTS);
    let mut leaves = Vec::new();
    tree::leaves(&defaults, &mut Vec::new(), &mut leaves);
    let mut out: Vec<KeyDoc> = Vec::new();
    for path in &leaves {
        let key = tree::join(path);
        let value = tree::get(&defaults, path).cloned().unwrap_or(Value::Null);
        let meaning = docs.get(&key).cloned().unwrap_or_default();
        let status = if meaning.starts_with("Accepted for verl's configs") {
            Status::NotRead
        } else {
            Status::Implemented
        };
        out.push(KeyDoc {
            kind: probe_kind(&mut defaults, path, &value),
            default: Some(tree::show(&value)),
            status,
            meaning: with_host_default(&key, meaning),
            subtree: false,
            key,
        });
    }
    for (entry, treatment) in compat_entries() {
        if out.iter().any(|d| d.key == entry) {
            continue;
        }
        let typed_node = tree::get(&defaults, &tree::split(&entry)).is_some();
        out.push(compat_doc(entry, treatment, typed_node));
    }
    out.sort_by_key(|d| tree::split(&d.key));
    out
}

/// The compat table's entries, each role entry under each role.
pub fn compat_entries() -> Vec<(String, Compat)> {
    let mut all: Vec<(String, Compat)> = compat::TABLE
        .iter()
        .map(|(e, c)| (e.to_string(), *c))
        .collect();
    for role in compat::ROLES {
        all.extend(
            compat::ROLE_TABLE
                .iter()
                .map(|(e, c)| (format!("{role}.{e}"), *c)),
        );
    }
    all
}

fn compat_doc(key: String, treatment: Compat, typed_node: bool) -> KeyDoc {
    let area = verl_area(&key);
    let (kind, default, status, meaning) = match treatment {
        Compat::NoEffect => {
            let meaning = if typed_node {
                format!("{area}; its keys not listed here have no effect")
            } else {
                area.to_string()
            };
            ("any".to_string(), None, Status::NoEffect, meaning)
        }
        Compat::Unsupported { default, why } => {
            let value = compat::default_value(default);
            (
                yaml_kind(&value).to_string(),
                Some(tree::show(&value)),
                Status::RefusedUnlessDefault {
                    why: why.to_string(),
                },
                format!("{area}. Any other value is refused: {why}"),
            )
        }
        Compat::MovedTo(to) => (
            "as the new key".to_string(),
            None,
            Status::Moved { to: to.to_string() },
            format!("read as `{to}` (verl's legacy or other spelling of it)"),
        ),
    };
    KeyDoc {
        // An entry covers every key below it (`compat::lookup`).
        subtree: true,
        kind,
        default,
        status,
        meaning: with_host_default(&key, meaning),
        key,
    }
}

/// The part of verl a compat entry belongs to, from where it sits.
fn verl_area(key: &str) -> &'static str {
    let segs: Vec<&str> = key.split('.').collect();
    let has = |s: &str| segs.contains(&s);
    if has("megatron") {
        "Megatron engine setting (parallel sizes, offload, model-definition overrides)"
    } else if has("fsdp_config") || has("fsdp") {
        "FSDP engine setting (sharding, offload, wrapping, precision)"
    } else if has("veomni") {
        "VeOmni engine setting"
    } else if has("torchtitan") {
        "TorchTitan engine setting"
    } else if has("override_optimizer_config") {
        "keyword argument verl passes to the optimizer class"
    } else if has("optim") {
        "optimizer setting of verl's Megatron, VeOmni or TorchTitan engine"
    } else if has("profiler") || segs[0] == "global_profiler" {
        "profiler setting"
    } else if has("qat") || has("router_replay") {
        "quantization-aware training / MoE routing replay"
    } else if segs[0] == "distillation" {
        "the teachers' inference servers (resource pool, replicas, chunking)"
    } else if key.starts_with("actor_rollout_ref.rollout") {
        "inference-server (vLLM/SGLang) setting of the rollout"
    } else if key.starts_with("actor_rollout_ref.model") || key.starts_with("critic.model") {
        "model loading option of HF transformers / FSDP (kernels, offload, remote code)"
    } else if segs.len() > 1 && ["actor_rollout_ref", "critic"].contains(&segs[0]) {
        "training-engine setting of the worker (parallelism, compilation, chunking, checkpoint I/O)"
    } else if segs[0] == "data" {
        "option of verl's Python data loader (workers, shared memory, multimodal inputs, custom classes)"
    } else if segs[0] == "reward" || segs[0] == "reward_model" || segs[0] == "reward_manager" {
        "verl's reward workers and reward-model servers"
    } else if segs[0] == "sandbox_fusion" {
        "verl's SandboxFusion code-execution service"
    } else if segs[0] == "algorithm" {
        "algorithm extension of verl"
    } else if segs[0] == "trainer" {
        "runtime setting of verl's Ray trainer"
    } else {
        "section of verl's distributed runtime (Ray, Hydra, engines, transfer queue)"
    }
}

/// Notes verl's own default where main_ppo keeps another ([`compat::HOST_DEFAULTS`]).
fn with_host_default(key: &str, meaning: String) -> String {
    match compat::HOST_DEFAULTS.iter().find(|(k, _)| *k == key) {
        Some((_, verl)) => format!(
            "{meaning} verl's default is `{verl}`; main_ppo keeps its own unless you set it."
        ),
        None => meaning,
    }
}

/// The dotted key → the comment lines above it in the commented defaults (joined).
fn descriptions(commented: &str) -> std::collections::HashMap<String, String> {
    let mut out = std::collections::HashMap::new();
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut pending: Vec<&str> = Vec::new();
    for line in commented.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() {
            pending.clear();
            continue;
        }
        if let Some(comment) = trimmed.strip_prefix('#') {
            pending.push(comment.trim());
            continue;
        }
        let Some((key, _)) = trimmed.split_once(':') else {
            continue;
        };
        if trimmed.starts_with("- ") {
            pending.clear();
            continue;
        }
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        stack.push((indent, key.trim().trim_matches('\'').to_string()));
        let path: Vec<String> = stack.iter().map(|(_, k)| k.clone()).collect();
        if !pending.is_empty() {
            out.insert(tree::join(&path), pending.join(" "));
        }
        pending.clear();
    }
    out
}

/// The description of a section (`data`, `actor_rollout_ref.rollout`, ...), if it has one.
pub fn section_description(key: &str) -> Option<String> {
    descriptions(COMMENTED_DEFAULTS).remove(key)
}

/// The kinds of value the typed deserialisation accepts at `path`, in words: each probe is put
/// at `path` of the defaults and the whole configuration deserialised.
fn probe_kind(defaults: &mut Value, path: &[String], default: &Value) -> String {
    let probes: [(&str, Value); 8] = [
        ("null", Value::Null),
        ("bool", Value::Bool(true)),
        ("integer", Value::Number(3.into())),
        ("number", Value::Number(0.5.into())),
        ("string", Value::String("\u{1}probe".into())),
        // Two elements: fixed pairs (`optim.betas`) take two.
        (
            "list",
            Value::Sequence(vec![Value::String("probe".into()); 2]),
        ),
        (
            "numbers",
            Value::Sequence(vec![Value::Number(0.5.into()); 2]),
        ),
        ("mapping", {
            let mut m = Mapping::new();
            m.insert(Value::String("probe".into()), Value::Number(1.into()));
            Value::Mapping(m)
        }),
    ];
    let mut accepted = Vec::new();
    let mut variants = None;
    for (name, probe) in probes {
        tree::set(defaults, path, probe);
        match serde_path_to_error::deserialize::<_, Config>(&*defaults) {
            Ok(_) => accepted.push(name),
            Err(e) if name == "string" => variants = expected_values(&e.inner().to_string()),
            Err(_) => {}
        }
    }
    tree::set(defaults, path, default.clone());
    describe_kind(&accepted, variants, default)
}

/// The values an enum-like key names in its error (`unknown variant `x`, expected one of `a`,
/// `b``; the KL estimators' own `expected one of kl, k1, ...`).
fn expected_values(message: &str) -> Option<String> {
    let (_, rest) = message.split_once("expected ")?;
    if !message.contains("unknown variant") && !rest.starts_with("one of") {
        return None;
    }
    // serde names two variants as "`a` or `b`".
    let rest = rest
        .trim_start_matches("one of ")
        .replace("` or `", "`, `")
        .replace('`', "");
    Some(rest.trim().trim_end_matches('.').to_string())
}

fn describe_kind(accepted: &[&str], variants: Option<String>, default: &Value) -> String {
    let has = |k: &str| accepted.contains(&k);
    let mut parts: Vec<String> = Vec::new();
    if has("bool") {
        parts.push("bool".into());
    }
    if has("number") {
        parts.push("number".into());
    } else if has("integer") {
        parts.push("integer".into());
    }
    if has("string") {
        parts.push("string".into());
    } else if let Some(v) = variants {
        parts.push(format!("one of {v}"));
    } else if matches!(default, Value::String(_)) {
        parts.push("string (checked values)".into());
    }
    match (has("list"), has("numbers")) {
        (true, true) => parts.push("list".into()),
        (true, false) => parts.push("list of strings".into()),
        (false, true) => parts.push("list of numbers".into()),
        (false, false) => {}
    }
    if has("mapping") {
        parts.push("mapping".into());
    }
    if parts.is_empty() && !default.is_null() {
        parts.push(yaml_kind(default).into());
    }
    if parts.is_empty() {
        return "null (see meaning)".into();
    }
    let mut kind = parts.join(" or ");
    if has("null") {
        kind.push_str(" or null");
    }
    kind
}

/// The YAML kind of a value.
fn yaml_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Sequence(_) => "list",
        Value::Mapping(_) => "mapping",
        Value::Tagged(_) => "tagged value",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find<'a>(docs: &'a [KeyDoc], key: &str) -> &'a KeyDoc {
        docs.iter()
            .find(|d| d.key == key)
            .unwrap_or_else(|| panic!("{key} is not in the catalogue"))
    }

    #[test]
    fn kinds_come_from_the_typed_deserialisation() {
        let docs = catalogue();
        assert_eq!(find(&docs, "data.train_batch_size").kind, "integer");
        assert_eq!(find(&docs, "data.shuffle").kind, "bool");
        assert_eq!(
            find(&docs, "data.truncation").kind,
            "one of error, left, right, middle"
        );
        assert_eq!(
            find(&docs, "data.train_files").kind,
            "string or list of strings"
        );
        assert!(find(&docs, "data.seed").kind.ends_with("or null"));
        assert!(find(&docs, "algorithm.kl_penalty")
            .kind
            .starts_with("one of kl, k1"));
    }

    #[test]
    fn every_typed_key_has_a_description_and_compat_keys_their_treatment() {
        let docs = catalogue();
        let missing: Vec<&str> = docs
            .iter()
            .filter(|d| d.meaning.trim().is_empty())
            .map(|d| d.key.as_str())
            .collect();
        assert!(
            missing.is_empty(),
            "keys without a description (run scripts/gen_ppo_trainer_yaml.py after documenting the field): {missing:?}"
        );
        let megatron = find(&docs, "actor_rollout_ref.actor.megatron");
        assert_eq!(megatron.status, Status::NoEffect);
        assert!(megatron.subtree);
        let moved = find(&docs, "custom_reward_function.path");
        assert_eq!(
            moved.status,
            Status::Moved {
                to: "reward.custom_reward_function.path".into()
            }
        );
        let refused = find(&docs, "actor_rollout_ref.rollout.quantization");
        assert!(matches!(
            refused.status,
            Status::RefusedUnlessDefault { .. }
        ));
        assert_eq!(refused.default.as_deref(), Some("null"));
        assert_eq!(
            find(&docs, "actor_rollout_ref.rollout.do_sample").status,
            Status::NotRead
        );
        assert!(find(&docs, "trainer.device").meaning.contains("`cuda`"));
    }
}
