//! verl's training engines (`model_engine`, `<role>.strategy`: fsdp, megatron, veomni,
//! torchtitan) on main_ppo's single engine. The model's mathematics is the engine's
//! business only where an engine brings its own optimizer schedule or model-definition
//! overrides; those keys are mapped onto main_ppo's keys here or refused. Layout and
//! parallelism keys stay in the compat table (no effect).

use std::collections::BTreeSet;

use serde_yaml_ng::Value;

use super::tree;
use super::ConfigError;

/// The roles that train (their optimizer is read).
const TRAINED: [&str; 2] = ["actor_rollout_ref.actor", "critic"];

/// Names under `megatron.override_transformer_config` that only choose kernels, recomputation,
/// parallel layout or mixture-of-experts settings (no supported family has experts): no effect.
const MEGATRON_LAYOUT_PREFIXES: [&str; 13] = [
    "recompute",
    "moe_",
    "dsa_",
    "account_for_",
    "num_layers_in_",
    "overlap_",
    "use_fused",
    "cpu_offloading",
    "cuda_graph",
    "enable_cuda_graph",
    "tp_comm",
    "context_parallel",
    "expert_",
];
const MEGATRON_LAYOUT_NAMES: [&str; 12] = [
    "attention_backend",
    "use_flash_attn",
    "persist_layer_norm",
    "deallocate_pipeline_outputs",
    "pipeline_model_parallel_layout",
    "sequence_parallel",
    "use_distributed_optimizer",
    "batch_p2p_comm",
    "variable_seq_lengths",
    "use_te_rng_tracker",
    "use_naive_l2norm",
    "apply_dsa_kernel_fusion",
];

fn get_str(tree: &Value, key: &str) -> Option<String> {
    tree::get(tree, &tree::split(key))
        .and_then(Value::as_str)
        .map(str::to_string)
}

fn unsupported(key: &str, value: &Value, why: String) -> ConfigError {
    ConfigError::Unsupported {
        key: key.to_string(),
        value: tree::show(value),
        why,
    }
}

/// Maps the engine-specific keys of the composed tree (before the compat keys are removed).
pub(super) fn apply(
    tree: &mut Value,
    user_set: &BTreeSet<String>,
    notices: &mut Vec<String>,
) -> Result<(), ConfigError> {
    let model_engine = get_str(tree, "model_engine");
    for role in TRAINED {
        let strategy = get_str(tree, &format!("{role}.strategy"));
        let engine = strategy
            .clone()
            .or_else(|| model_engine.clone())
            .unwrap_or_else(|| "fsdp".into());
        if engine == "torchtitan" {
            let key = if model_engine.as_deref() == Some("torchtitan") {
                "model_engine".to_string()
            } else {
                format!("{role}.strategy")
            };
            return Err(unsupported(
                &key,
                &Value::String(engine),
                "torchtitan's learning-rate schedule (decay after the warm-up, optim.decay_type) is not implemented; model_engine=dp, megatron and veomni run here".into(),
            ));
        }
        optimizer_keys(tree, role, &engine, user_set, notices)?;
        megatron_overrides(tree, role)?;
    }
    for model in ["actor_rollout_ref.model", "critic.model"] {
        lift_megatron_model_overrides(tree, model);
    }
    megatron_overrides(tree, "actor_rollout_ref.ref")
}

/// b178a3c's Megatron engine nests `model.override_config` as `model_config` (entries for the
/// model's config.json) and `moe_config` (the experts' router, which no supported family has):
/// the first become entries of `override_config`, the second is dropped.
fn lift_megatron_model_overrides(tree: &mut Value, model: &str) {
    let path = tree::split(&format!("{model}.override_config"));
    let Some(map) = tree::get(tree, &path).and_then(Value::as_mapping).cloned() else {
        return;
    };
    if !map.contains_key("model_config") && !map.contains_key("moe_config") {
        return;
    }
    let mut out = serde_yaml_ng::Mapping::new();
    for (k, v) in map {
        match tree::key_str(&k).as_str() {
            "model_config" => {
                if let Some(inner) = v.as_mapping() {
                    out.extend(inner.clone());
                }
            }
            "moe_config" => {}
            _ => {
                out.insert(k, v);
            }
        }
    }
    tree::set(tree, &path, Value::Mapping(out));
}

/// Megatron's `adam` (decoupled weight decay), `lr_decay_style`, `min_lr` and VeOmni's
/// `lr_min`, onto `optimizer`, `lr_scheduler_type` and `min_lr_ratio`.
fn optimizer_keys(
    tree: &mut Value,
    role: &str,
    engine: &str,
    user_set: &BTreeSet<String>,
    notices: &mut Vec<String>,
) -> Result<(), ConfigError> {
    let optim = format!("{role}.optim");
    let key = |k: &str| format!("{optim}.{k}");
    if engine == "megatron"
        && get_str(tree, &key("optimizer")).is_some_and(|o| o.eq_ignore_ascii_case("adam"))
    {
        tree::set(
            tree,
            &tree::split(&key("optimizer")),
            Value::String("AdamW".into()),
        );
        notices.push(format!(
            "`{}` = adam is Megatron's Adam with decoupled weight decay: AdamW here",
            key("optimizer")
        ));
    }
    fold_overrides(tree, &optim, notices);
    if let Some(style) = tree::remove(tree, &tree::split(&key("lr_decay_style"))) {
        if !style.is_null() {
            let s = style.as_str().unwrap_or_default().to_string();
            if !matches!(s.as_str(), "constant" | "cosine") {
                return Err(unsupported(
                    &key("lr_decay_style"),
                    &style,
                    "constant and cosine decay are implemented (Megatron's linear, inverse-square-root and WSD are not)".into(),
                ));
            }
            set_checked(
                tree,
                user_set,
                &key("lr_scheduler_type"),
                Value::String(s),
                &key("lr_decay_style"),
            )?;
        }
    }
    let cosine = get_str(tree, &key("warmup_style"))
        .or_else(|| get_str(tree, &key("lr_scheduler_type")))
        .is_some_and(|s| s == "cosine");
    for name in ["min_lr", "lr_min"] {
        let path = tree::split(&key(name));
        let Some(v) = tree::get(tree, &path).and_then(Value::as_f64) else {
            continue;
        };
        // With a constant schedule the floor is never reached (verl's engines ignore it too):
        // left for the no-effect report.
        if !cosine {
            continue;
        }
        tree::remove(tree, &path);
        let lr = tree::get(tree, &tree::split(&key("lr")))
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        let ratio = if lr > 0.0 { v / lr } else { 0.0 };
        if !(0.0..=1.0).contains(&ratio) {
            return Err(ConfigError::Value {
                key: key(name),
                message: format!(
                    "the cosine schedule's floor ({v}) must lie between 0 and `{}` ({lr})",
                    key("lr")
                ),
            });
        }
        set_checked(
            tree,
            user_set,
            &key("min_lr_ratio"),
            serde_yaml_ng::to_value(ratio).unwrap_or(Value::Null),
            &key(name),
        )?;
        notices.push(format!(
            "`{}` = {v} is read as `{}` = {ratio} (the floor over optim.lr)",
            key(name),
            key("min_lr_ratio")
        ));
    }
    Ok(())
}

/// `optim.override_optimizer_config`'s update arguments onto `optim.*`: verl passes lr, weight
/// decay and betas to the optimizer class and then updates them with the override, so the
/// override wins; `eps` has no other key. `decoupled_weight_decay` turns torch's (or
/// Megatron's) Adam into AdamW and back. The entries stay in place (the typed config shows
/// both; resolving checks that they agree).
fn fold_overrides(tree: &mut Value, optim: &str, notices: &mut Vec<String>) {
    let section = format!("{optim}.override_optimizer_config");
    let Some(map) = tree::get(tree, &tree::split(&section))
        .and_then(Value::as_mapping)
        .cloned()
    else {
        return;
    };
    for name in ["lr", "eps", "weight_decay", "betas"] {
        let Some(v) = map.get(name).filter(|v| !v.is_null()) else {
            continue;
        };
        let target = tree::split(&format!("{optim}.{name}"));
        let current = tree::get(tree, &target).cloned().unwrap_or(Value::Null);
        if !super::compat::same_value(&current, v) {
            notices.push(format!(
                "`{section}.{name}` = {} replaces `{optim}.{name}` = {} (verl passes the override to the optimizer last)",
                tree::show(v),
                tree::show(&current)
            ));
        }
        tree::set(tree, &target, v.clone());
    }
    if let Some(d) = map.get("decoupled_weight_decay").and_then(Value::as_bool) {
        let impl_ = get_str(tree, &format!("{optim}.optimizer_impl"))
            .unwrap_or_else(|| "torch.optim".into());
        let name = get_str(tree, &format!("{optim}.optimizer")).unwrap_or_default();
        let is_adam = ["adam", "adamw"].contains(&name.to_ascii_lowercase().as_str());
        if impl_ == "torch.optim" && is_adam {
            let to = if d { "AdamW" } else { "Adam" };
            if !name.eq_ignore_ascii_case(to) {
                notices.push(format!(
                    "`{section}.decoupled_weight_decay` = {d}: `{optim}.optimizer` {name} runs as {to}"
                ));
            }
            tree::set(
                tree,
                &tree::split(&format!("{optim}.optimizer")),
                Value::String(to.into()),
            );
        }
    }
}

/// Sets `key` from the engine key `from`, refusing when the user set `key` to another value.
fn set_checked(
    tree: &mut Value,
    user_set: &BTreeSet<String>,
    key: &str,
    value: Value,
    from: &str,
) -> Result<(), ConfigError> {
    let path = tree::split(key);
    let current = tree::get(tree, &path).cloned().unwrap_or(Value::Null);
    if user_set.contains(key) && !super::compat::same_value(&current, &value) {
        return Err(ConfigError::Invalid(vec![format!(
            "`{from}` ({}) and `{key}` ({}) are both set and disagree: keep one",
            tree::show(&value),
            tree::show(&current)
        )]));
    }
    tree::set(tree, &path, value);
    Ok(())
}

/// `megatron.override_transformer_config`: kernel, recomputation, layout and MoE names have no
/// effect; any other name changes Megatron's model definition and is refused.
fn megatron_overrides(tree: &Value, role: &str) -> Result<(), ConfigError> {
    let section = format!("{role}.megatron.override_transformer_config");
    let Some(map) = tree::get(tree, &tree::split(&section)).and_then(Value::as_mapping) else {
        return Ok(());
    };
    for (k, v) in map {
        let name = tree::key_str(k);
        let layout = MEGATRON_LAYOUT_PREFIXES.iter().any(|p| name.starts_with(p))
            || name.ends_with("_fusion")
            || MEGATRON_LAYOUT_NAMES.contains(&name.as_str());
        if !layout && !v.is_null() {
            return Err(unsupported(
                &format!("{section}.{name}"),
                v,
                "it changes Megatron's model definition; main_ppo builds the model from its config.json (actor_rollout_ref.model.override_config changes that)".into(),
            ));
        }
    }
    Ok(())
}
