//! PEFT's LoRA on a model: which projections get adapters, attaching them, and PEFT's adapter
//! folder (read and write). The adapter arithmetic itself is `model::proj`.
//!
//! Which projections get one follows PEFT's `check_target_module_exists` on HF module names
//! (`model.layers.3.self_attn.q_proj`): a string target is a regular expression that must
//! match the whole name (`all-linear` = every projection), a list matches a name equal to an
//! entry or ending in `.entry`; `exclude_modules` uses the same two rules and wins. `A` starts
//! Kaiming-uniform (bound `1/√in`, what PyTorch's `kaiming_uniform_(a=√5)` gives), `B` at
//! zero, so a fresh adapter leaves the model unchanged.
//!
//! On disk an adapter is PEFT's folder: `adapter_config.json` and `adapter_model.safetensors`
//! with tensors `base_model.model.<module>.lora_A.weight` `[r, in]` and `...lora_B.weight`
//! `[out, r]` (PEFT's `get_peft_model_state_dict` names), which PEFT, vLLM and transformers load.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use serde_json::{json, Value};

use crate::config::fields::OneOrMany;
use crate::model::proj::Lora;
use crate::model::ModelError;
use crate::model::{CausalLm, ModelArgs};

/// What LoRA adds and where: verl's `lora_rank`, `lora_alpha`, `target_modules`,
/// `exclude_modules`, and PEFT's `use_rslora`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f64,
    pub use_rslora: bool,
    pub target_modules: OneOrMany,
    pub exclude_modules: Option<OneOrMany>,
    /// PEFT's `lora_dropout`: the probability of zeroing each adapter input in training
    /// forwards (0 = off); see [`crate::model::proj::Dropout`].
    pub dropout: f64,
}

/// PEFT's shorthand for every linear layer but the output one.
pub const ALL_LINEAR: &str = "all-linear";

/// Whether `targets` (a `target_modules` / `exclude_modules` value) is usable: a single
/// string other than `all-linear` is a regular expression full-matched against module names
/// (PEFT's rule), so it must compile. An error names the pattern and the regex error.
pub fn check_pattern(targets: &OneOrMany) -> std::result::Result<(), String> {
    match targets {
        OneOrMany::One(p) if p != ALL_LINEAR => full_match(p, "").map(|_| ()),
        _ => Ok(()),
    }
}

fn full_match(pattern: &str, key: &str) -> std::result::Result<bool, String> {
    regex::Regex::new(&format!("^(?:{pattern})$"))
        .map(|r| r.is_match(key))
        .map_err(|e| format!("`{pattern}` is not a regular expression: {e}"))
}

fn list_match(list: &[String], key: &str) -> bool {
    list.iter()
        .any(|t| key == t || key.ends_with(&format!(".{t}")))
}

impl LoraSpec {
    /// `alpha / r`, or `alpha / √r` with `use_rslora`.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// Whether the projection named `key` (HF module name) gets an adapter, by PEFT's rules.
    pub fn targets(&self, key: &str) -> std::result::Result<bool, String> {
        match &self.exclude_modules {
            Some(OneOrMany::One(p)) if full_match(p, key)? => return Ok(false),
            Some(OneOrMany::Many(l)) if list_match(l, key) => return Ok(false),
            _ => {}
        }
        Ok(match &self.target_modules {
            OneOrMany::One(s) if s.eq_ignore_ascii_case(ALL_LINEAR) => true,
            OneOrMany::One(p) => full_match(p, key)?,
            OneOrMany::Many(l) => list_match(l, key),
        })
    }
}

/// PEFT's file name of a module's adapter matrix (`which` = `lora_A` or `lora_B`).
pub fn tensor_name(module: &str, which: &str) -> String {
    format!("base_model.model.{module}.{which}.weight")
}

/// Whether the projection `name` of a layer (`mlp.experts.3.up_proj`) is a module PEFT can
/// adapt: not GPT-OSS's experts, which transformers holds as fused parameters rather than
/// linear modules (PEFT's `target_modules` cannot name them).
fn adaptable(args: &ModelArgs, name: &str) -> bool {
    !(args.gpt_oss_experts() && name.starts_with("mlp.experts."))
}

/// The projections of `model` that can carry an adapter: HF module name and weight shape
/// `(out, in)`, in [`attach`]'s order. Reads shapes only.
pub fn projections(
    model: &mut CausalLm,
) -> std::result::Result<Vec<(String, usize, usize)>, ModelError> {
    let mut all = Vec::new();
    let args = model.args.clone();
    for (i, block) in model.blocks_mut().iter_mut().enumerate() {
        for (name, p) in block.projs_mut() {
            if !adaptable(&args, &name) {
                continue;
            }
            let (out, inp) = p.weight().dims2()?;
            all.push((format!("model.layers.{i}.{name}"), out, inp));
        }
    }
    Ok(all)
}

/// The projections a model of `args` has, as [`projections`] lists them, from the
/// hyper-parameters alone (`config check` reads no weights).
pub fn projections_of(args: &ModelArgs) -> impl Iterator<Item = (String, usize, usize)> + '_ {
    let h = args.hidden_size;
    let gate = if args.attn_output_gate { 2 } else { 1 };
    let q = args.num_attention_heads * args.head_dim;
    let kv = args.num_key_value_heads * args.head_dim;
    (0..args.num_hidden_layers).flat_map(move |i| {
        let at = move |n: &str| format!("model.layers.{i}.{n}");
        let gated = move |prefix: String, inter: usize| {
            [
                (format!("{prefix}.gate_proj"), inter, h),
                (format!("{prefix}.up_proj"), inter, h),
                (format!("{prefix}.down_proj"), h, inter),
            ]
        };
        let mixer: Vec<(String, usize, usize)> = match &args.linear_attn {
            Some(la) if args.is_linear(i) => {
                let (cd, vd, nv) = (la.conv_dim(), la.value_dim(), la.num_value_heads);
                let mut v = match la.grouped {
                    false => vec![
                        (at("linear_attn.in_proj_qkv"), cd, h),
                        (at("linear_attn.in_proj_z"), vd, h),
                        (at("linear_attn.in_proj_b"), nv, h),
                        (at("linear_attn.in_proj_a"), nv, h),
                    ],
                    true => vec![
                        (at("linear_attn.in_proj_qkvz"), cd + vd, h),
                        (at("linear_attn.in_proj_ba"), 2 * nv, h),
                    ],
                };
                v.push((at("linear_attn.out_proj"), h, vd));
                v
            }
            _ if args.mla.is_some() => latent_projections(args, &at),
            _ => vec![
                (at("self_attn.q_proj"), gate * q, h),
                (at("self_attn.k_proj"), kv, h),
                (at("self_attn.v_proj"), kv, h),
                (at("self_attn.o_proj"), h, q),
            ],
        };
        let mlp: Vec<(String, usize, usize)> = match &args.moe {
            // GPT-OSS's experts: fused parameters, not modules ([`adaptable`]).
            Some(m) if m.swiglu.is_some() => Vec::new(),
            Some(m) if m.sparse(i) => {
                let mut v: Vec<_> = (0..m.num_experts)
                    .flat_map(|e| gated(at(&format!("mlp.experts.{e}")), m.moe_intermediate_size))
                    .collect();
                if let Some(w) = m.shared_expert_intermediate_size {
                    v.extend(gated(at("mlp.shared_expert"), w));
                    v.push((at("mlp.shared_expert_gate"), 1, h));
                }
                if let Some(d) = &m.deepseek {
                    let w = d.n_shared_experts * m.moe_intermediate_size;
                    v.extend(gated(at("mlp.shared_experts"), w));
                }
                v
            }
            _ => gated(at("mlp"), args.intermediate_size).into(),
        };
        mixer.into_iter().chain(mlp)
    })
}

/// DeepSeek-V3's latent attention projections of one layer (module names through `at`), as
/// `Mla::projs_mut` lists them.
fn latent_projections(
    args: &ModelArgs,
    at: &dyn Fn(&str) -> String,
) -> Vec<(String, usize, usize)> {
    let Some(m) = &args.mla else {
        return Vec::new();
    };
    let (h, nh) = (args.hidden_size, args.num_attention_heads);
    let (c, r) = (m.kv_lora_rank, m.qk_rope_head_dim);
    let mut v = match m.q_lora_rank {
        None => vec![(at("self_attn.q_proj"), nh * m.qk_head_dim(), h)],
        Some(rank) => vec![
            (at("self_attn.q_a_proj"), rank, h),
            (at("self_attn.q_b_proj"), nh * m.qk_head_dim(), rank),
        ],
    };
    v.extend([
        (at("self_attn.kv_a_proj_with_mqa"), c + r, h),
        (
            at("self_attn.kv_b_proj"),
            nh * (m.qk_nope_head_dim + m.v_head_dim),
            c,
        ),
        (at("self_attn.o_proj"), h, nh * m.v_head_dim),
    ]);
    v
}

/// Why adapters of rank `spec.rank` cannot go on the projections `spec` targets among
/// `projections` (HF module name, `out`, `in`); `None` when they can.
///
/// The rule: the rank may not exceed the smaller side of every projection it adapts. `B·A` of
/// rank `min(in, out)` already reaches every change of an `[out, in]` weight, so a rank above
/// that of all adapted projections adds parameters, memory and optimizer state but no
/// capacity anywhere. It is checked before anything is allocated: `lora_rank=10000000` asked
/// for tens of gigabytes of adapters and aborted the process. A rank above some projections'
/// smaller side only is accepted with a warning naming them, as PEFT accepts it: Qwen3.5's
/// `linear_attn.in_proj_b`/`in_proj_a` have one row per value head (16 to 64) and the shared
/// expert's gate one row, below the ranks 32 and 64 of verl's LoRA examples.
pub fn rank_problem(
    spec: &LoraSpec,
    projections: impl IntoIterator<Item = (String, usize, usize)>,
) -> std::result::Result<Option<String>, String> {
    let mut widest: Option<(String, usize, usize)> = None;
    let mut narrow: Vec<(String, usize, usize)> = Vec::new();
    for (module, out, inp) in projections {
        if !spec.targets(&module)? {
            continue;
        }
        let side = out.min(inp);
        if spec.rank > side {
            narrow.push((module.clone(), out, inp));
        }
        if widest.as_ref().is_none_or(|(_, o, i)| side > (*o).min(*i)) {
            widest = Some((module, out, inp));
        }
    }
    let Some((module, out, inp)) = widest else {
        return Ok(None);
    };
    let limit = out.min(inp);
    if spec.rank > limit {
        return Ok(Some(format!(
            "rank {} is larger than {limit}, the smaller side of `{module}` ([{out}, {inp}]), the widest of the projections it adapts: a rank above min(in, out) of every adapted projection adds parameters but no capacity; use at most {limit}",
            spec.rank
        )));
    }
    if let Some((m, o, i)) = narrow.first() {
        tracing::warn!(
            "LoRA rank {} exceeds min(in, out) of {} adapted projection(s), e.g. `{m}` ([{o}, {i}]): adapted as asked (as PEFT does), with more parameters than that projection can use",
            spec.rank,
            narrow.len()
        );
    }
    Ok(None)
}

/// Adds adapters to the projections of `model` that `spec` targets (A seeded Kaiming-uniform
/// from `seed` and the tensor's name, B zero), as variables of `adapters`, and freezes every
/// base weight. Returns the adapted module names; none is an error naming the rule, and so is
/// a rank [`rank_problem`] refuses (before anything is allocated).
pub fn attach(
    model: &mut CausalLm,
    spec: &LoraSpec,
    adapters: &VarMap,
    seed: u64,
    key: &str,
) -> std::result::Result<Vec<String>, ModelError> {
    let bad = |message: String| ModelError::File {
        file: key.to_string(),
        message,
    };
    if spec.rank == 0 {
        return Err(bad("lora_rank must be positive to add adapters".into()));
    }
    if let Some(why) = rank_problem(spec, projections(model)?).map_err(bad)? {
        return Err(bad(format!("LoRA {why}")));
    }
    let (dtype, device) = (model.dtype(), model.device().clone());
    let scale = spec.scale();
    let mut adapted = Vec::new();
    let mut data = adapters.data().lock().expect("varmap lock");
    let args = model.args.clone();
    for (i, block) in model.blocks_mut().iter_mut().enumerate() {
        for (name, p) in block.projs_mut() {
            let module = format!("model.layers.{i}.{name}");
            if !adaptable(&args, &name) || !spec.targets(&module).map_err(bad)? {
                continue;
            }
            let (out, inp) = p.weight().dims2()?;
            let a_name = tensor_name(&module, "lora_A");
            let bound = 1.0 / (inp as f64).sqrt();
            let a = uniform(spec.rank * inp, bound, seed, &a_name);
            let a = Tensor::from_vec(a, (spec.rank, inp), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(&device)?;
            let a = candle_core::Var::from_tensor(&a)?;
            let b = candle_core::Var::zeros((out, spec.rank), dtype, &device)?;
            p.lora = Some(Lora {
                a: a.as_tensor().clone(),
                b: b.as_tensor().clone(),
                scale,
                dropout: None,
            });
            data.insert(a_name, a);
            data.insert(tensor_name(&module, "lora_B"), b);
            adapted.push(module);
        }
    }
    drop(data);
    if adapted.is_empty() {
        return Err(bad(format!(
            "target_modules={} (exclude_modules={}) matches none of this model's projections (model.layers.N.self_attn.{{q,k,v,o}}_proj, model.layers.N.mlp.{{gate,up,down}}_proj)",
            show(&spec.target_modules),
            spec.exclude_modules.as_ref().map(show).unwrap_or("null".into())
        )));
    }
    model.freeze_base();
    Ok(adapted)
}

fn show(v: &OneOrMany) -> String {
    match v {
        OneOrMany::One(s) => s.clone(),
        OneOrMany::Many(l) => format!("{l:?}"),
    }
}

/// `n` draws of U(−bound, bound) from a ChaCha stream seeded by `seed` and `name`.
fn uniform(n: usize, bound: f64, seed: u64, name: &str) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64 ^ seed, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(h);
    (0..n)
        .map(|_| ((rng.random::<f64>() * 2.0 - 1.0) * bound) as f32)
        .collect()
}

/// Target names PEFT writes for an expanded `all-linear`: the last part of each module name.
fn module_suffixes(modules: &[String]) -> Vec<String> {
    let mut v: Vec<String> = modules
        .iter()
        .map(|m| m.rsplit('.').next().unwrap_or(m).to_string())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// `adapter_config.json` as PEFT writes it for `spec` (with `all-linear` expanded to the
/// adapted modules' names, as PEFT does). `task_type`: `CAUSAL_LM` or `TOKEN_CLS`;
/// `modules_to_save`: fully trained modules saved beside the adapters (the critic's `score`).
pub fn adapter_config(
    spec: &LoraSpec,
    adapted: &[String],
    base_model: &str,
    task_type: &str,
    modules_to_save: Option<Vec<String>>,
) -> Value {
    let targets = match &spec.target_modules {
        OneOrMany::One(s) if s.eq_ignore_ascii_case(ALL_LINEAR) => json!(module_suffixes(adapted)),
        OneOrMany::One(s) => json!(s),
        OneOrMany::Many(l) => json!(l),
    };
    let exclude = match &spec.exclude_modules {
        None => Value::Null,
        Some(OneOrMany::One(s)) => json!(s),
        Some(OneOrMany::Many(l)) => json!(l),
    };
    json!({
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "use_rslora": spec.use_rslora,
        "target_modules": targets,
        "exclude_modules": exclude,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": false,
        "modules_to_save": modules_to_save,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": null,
        "layers_pattern": null,
    })
}

/// Writes PEFT's adapter folder: `config` as `adapter_config.json` and `tensors` as
/// `adapter_model.safetensors`.
pub fn save_adapter(
    dir: &Path,
    config: &Value,
    tensors: &HashMap<String, Tensor>,
) -> std::result::Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::file(dir, e.to_string()))?;
    let cfg = dir.join("adapter_config.json");
    std::fs::write(&cfg, serde_json::to_string_pretty(config).expect("json"))
        .map_err(|e| ModelError::file(&cfg, e.to_string()))?;
    let p = dir.join("adapter_model.safetensors");
    super::save_safetensors(tensors, &p)
}

/// An adapter read from disk: its settings, tensors (PEFT names, on the CPU) and the modules
/// saved whole beside it.
pub struct AdapterFile {
    pub spec: LoraSpec,
    pub tensors: HashMap<String, Tensor>,
    pub modules_to_save: Vec<String>,
}

/// The adapter folder at `path`: a folder with `adapter_config.json`, or a checkpoint folder
/// holding `lora_adapter/`.
pub fn adapter_dir(path: &Path) -> std::result::Result<PathBuf, ModelError> {
    for p in [path.to_path_buf(), path.join("lora_adapter")] {
        if p.join("adapter_config.json").is_file() {
            return Ok(p);
        }
    }
    Err(ModelError::file(
        path,
        "no adapter_config.json here or in lora_adapter/ (a PEFT adapter folder has adapter_config.json and adapter_model.safetensors)".into(),
    ))
}

/// The adapter folder behind `dir` when `dir`, given where a model was expected, holds an
/// adapter instead: `dir` itself (PEFT's folder, a checkpoint's `lora_adapter/`), its
/// `lora_adapter/` (a LoRA checkpoint's `actor/`), the `lora_adapter/` beside it (a LoRA
/// checkpoint's `huggingface/`, which keeps only config and tokenizer) or `actor/lora_adapter/`
/// (a LoRA checkpoint's `global_step_N/`). Callers ask only once they found no model weights.
pub fn adapter_behind(dir: &Path) -> Option<PathBuf> {
    let mut places = vec![
        dir.to_path_buf(),
        dir.join("lora_adapter"),
        dir.join("actor").join("lora_adapter"),
    ];
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        places.push(parent.join("lora_adapter"));
    }
    places
        .into_iter()
        .find(|p| p.join("adapter_config.json").is_file())
}

/// `base_model_name_or_path` of the adapter folder `dir`'s `adapter_config.json` (the model it
/// was trained on, as training was given it); `None` when absent, empty or unreadable.
pub fn adapter_base(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("adapter_config.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v.get("base_model_name_or_path")
        .and_then(Value::as_str)
        .filter(|s| !s.trim().is_empty())
        .map(str::to_string)
}

/// The error for `dir`, given where a model was expected, when it is a LoRA adapter folder or
/// part of a LoRA checkpoint ([`adapter_behind`]): it names the adapter folder and its base
/// model, and says what to pass instead (the two model keys, or `main_ppo merge`). The loader
/// does not know which configuration group it serves, so the keys are named by their last
/// parts. `None` when `dir` holds no adapter.
pub fn adapter_instead_of_model(dir: &Path) -> Option<ModelError> {
    let adapter = adapter_behind(dir)?;
    let base = match adapter_base(&adapter) {
        Some(b) => b,
        None => "<the model it was trained from: its adapter_config.json names none>".into(),
    };
    let what = if adapter == dir {
        "a LoRA adapter folder, not a model"
    } else {
        "part of a LoRA checkpoint, with a LoRA adapter and no model weights"
    };
    Some(ModelError::file(
        dir,
        format!(
            "{what} (a LoRA checkpoint holds adapters in lora_adapter/ and no base weights): load the base model with the adapter on it, `model.path={base}` and `model.lora_adapter_path={}` (under actor_rollout_ref or critic), or write base + adapter as one HF model with `main_ppo merge --local_dir {} --target_dir <new folder>` and load that",
            adapter.display(),
            dir.display()
        ),
    ))
}

fn str_or_list(
    v: &Value,
    key: &str,
    file: &Path,
) -> std::result::Result<Option<OneOrMany>, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(OneOrMany::One(s.clone()))),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .map(|l| Some(OneOrMany::Many(l)))
            .ok_or_else(|| {
                ModelError::file(
                    file,
                    format!("`{key}` must be a string or a list of strings"),
                )
            }),
        Some(other) => Err(ModelError::file(
            file,
            format!("`{key}` must be a string or a list of strings, got {other}"),
        )),
    }
}

/// Reads a PEFT LoRA adapter (ours or PEFT's). Settings this implementation cannot reproduce
/// (DoRA, biases, per-module ranks, `fan_in_fan_out`, layer selection) are refused by name, and
/// so is a tensor holding NaN or ±infinity.
pub fn read_adapter(path: &Path) -> std::result::Result<AdapterFile, ModelError> {
    let (dir, spec, modules_to_save) = read_adapter_config(path)?;
    let weights = dir.join("adapter_model.safetensors");
    if !weights.is_file() {
        return Err(ModelError::file(
            &dir,
            "no adapter_model.safetensors (PyTorch adapter_model.bin is not supported: save with safe_serialization=True)".into(),
        ));
    }
    let tensors = candle_core::safetensors::load(&weights, &Device::Cpu)
        .map_err(|e| ModelError::file(&weights, format!("not a readable safetensors file: {e}")))?;
    super::check_all_finite(&weights, &tensors)?;
    Ok(AdapterFile {
        spec,
        tensors,
        modules_to_save,
    })
}

/// The adapter folder of `path` ([`adapter_dir`]) with the settings of its
/// `adapter_config.json` and the modules it saves whole, without reading its tensors; refused
/// settings as [`read_adapter`] refuses them.
pub fn read_adapter_config(
    path: &Path,
) -> std::result::Result<(PathBuf, LoraSpec, Vec<String>), ModelError> {
    let dir = adapter_dir(path)?;
    let file = dir.join("adapter_config.json");
    let text =
        std::fs::read_to_string(&file).map_err(|e| ModelError::file(&file, e.to_string()))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::file(&file, format!("not valid JSON: {e}")))?;
    let err = |m: String| ModelError::file(&file, m);
    if let Some(t) = v.get("peft_type").and_then(Value::as_str) {
        if !t.eq_ignore_ascii_case("LORA") {
            return Err(err(format!(
                "`peft_type` is {t}: only LORA adapters are supported"
            )));
        }
    }
    let rank = v
        .get("r")
        .and_then(Value::as_u64)
        .filter(|&r| r > 0)
        .ok_or_else(|| err("`r` must be a positive integer".into()))? as usize;
    let alpha = v
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| err("`lora_alpha` must be a number".into()))?;
    let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
    for k in ["use_dora", "fan_in_fan_out", "lora_bias", "use_qalora"] {
        if flag(k) {
            return Err(err(format!(
                "`{k}: true` is not supported (plain LoRA only)"
            )));
        }
    }
    if let Some(b) = v.get("bias").and_then(Value::as_str) {
        if b != "none" {
            return Err(err(format!("`bias: {b}` is not supported (only \"none\")")));
        }
    }
    for k in ["rank_pattern", "alpha_pattern"] {
        if v.get(k)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(err(format!("`{k}` (per-module ranks) is not supported")));
        }
    }
    for k in [
        "layers_to_transform",
        "layer_replication",
        "trainable_token_indices",
        "target_parameters",
    ] {
        if v.get(k).is_some_and(|x| !x.is_null()) {
            return Err(err(format!(
                "`{k}` is not supported (adapters on whole projections only; exclude_modules selects them)"
            )));
        }
    }
    let target_modules = str_or_list(&v, "target_modules", &file)?
        .ok_or_else(|| err("`target_modules` is missing".into()))?;
    let dropout = match v.get("lora_dropout") {
        None | Some(Value::Null) => 0.0,
        Some(x) => match x.as_f64() {
            Some(p) if (0.0..1.0).contains(&p) => p,
            _ => {
                return Err(err(format!(
                    "`lora_dropout` must be a number in [0, 1), found {x}"
                )))
            }
        },
    };
    let spec = LoraSpec {
        rank,
        alpha,
        use_rslora: flag("use_rslora"),
        target_modules,
        exclude_modules: str_or_list(&v, "exclude_modules", &file)?,
        dropout,
    };
    let modules_to_save = match str_or_list(&v, "modules_to_save", &file)? {
        None => Vec::new(),
        Some(m) => m.to_vec(),
    };
    Ok((dir, spec, modules_to_save))
}

/// Copies an adapter file's `lora_A` / `lora_B` tensors into `adapters` (from [`attach`] with the
/// file's spec): every variable must be in the file with its shape, and every LoRA tensor of
/// the file must belong to a variable.
pub fn assign_adapter(
    adapters: &VarMap,
    tensors: &HashMap<String, Tensor>,
    source: &Path,
) -> std::result::Result<(), ModelError> {
    super::hf::assign(adapters, tensors, source).map_err(|e| rank_disagreement(e, source))?;
    let data = adapters.data().lock().expect("varmap lock");
    let mut stray: Vec<&String> = tensors
        .keys()
        .filter(|k| (k.contains(".lora_A.") || k.contains(".lora_B.")) && !data.contains_key(*k))
        .collect();
    stray.sort();
    if let Some(k) = stray.first() {
        return Err(ModelError::file(
            source,
            format!("tensor `{k}` is for a module this model has no adapter on (check target_modules / exclude_modules, and that the adapter was made for this architecture)"),
        ));
    }
    Ok(())
}

/// A shape error of an adapter tensor whose rank side differs from the rank the variables were
/// made with (`r` of `adapter_config.json`), said as that: the file, the tensor, its rank and
/// `r`. Other errors pass unchanged.
fn rank_disagreement(e: ModelError, source: &Path) -> ModelError {
    let ModelError::Shape {
        name,
        expected,
        found,
    } = &e
    else {
        return e;
    };
    // lora_A is [r, in], lora_B [out, r].
    let side = match name {
        n if n.contains(".lora_A.") => 0,
        n if n.contains(".lora_B.") => 1,
        _ => return e,
    };
    let (Some(r), Some(got)) = (expected.get(side), found.get(side)) else {
        return e;
    };
    if r == got || expected.len() != found.len() {
        return e;
    }
    let dir = adapter_dir(source).unwrap_or_else(|_| source.to_path_buf());
    ModelError::file(
        &dir.join("adapter_model.safetensors"),
        format!(
            "tensor `{name}` has rank {got} (shape {found:?}), but `r` in {} is {r}: the weights and their adapter_config.json disagree (set `r` to the rank the adapter was trained with)",
            dir.join("adapter_config.json").display()
        ),
    )
}

/// The adapter variables as PEFT's tensors, in the model's dtype.
pub fn adapter_tensors(adapters: &VarMap) -> HashMap<String, Tensor> {
    adapters
        .data()
        .lock()
        .expect("varmap lock")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::proj::Dropout;
    use crate::model::{Arch, ModelArgs};
    use candle_core::{DType, Var};

    pub(crate) fn spec(rank: usize, targets: OneOrMany, exclude: Option<OneOrMany>) -> LoraSpec {
        LoraSpec {
            rank,
            alpha: 16.0,
            use_rslora: false,
            target_modules: targets,
            exclude_modules: exclude,
            dropout: 0.0,
        }
    }

    fn all() -> OneOrMany {
        OneOrMany::One(ALL_LINEAR.into())
    }

    /// Sets every `lora_B` to seeded values of spread `stdev` (a trained adapter).
    pub(crate) fn randomize_b(adapters: &VarMap, stdev: f64) {
        for (name, var) in adapters.data().lock().unwrap().iter() {
            if name.contains("lora_B") {
                let t = var.as_tensor();
                let v = uniform(t.elem_count(), stdev, 11, name);
                let v = Tensor::from_vec(v, t.shape(), &Device::Cpu).unwrap();
                var.set(&v.to_dtype(t.dtype()).unwrap()).unwrap();
            }
        }
    }

    fn batch() -> (Tensor, Tensor, Tensor) {
        let dev = Device::Cpu;
        // Row 1 is left-padded by 2.
        let ids = Tensor::new(&[[3u32, 7, 1, 9, 4, 2], [0, 0, 5, 6, 8, 11]], &dev).unwrap();
        let pos = Tensor::new(&[[0u32, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]], &dev).unwrap();
        let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], &dev).unwrap();
        (ids, pos, mask)
    }

    fn logits(m: &CausalLm) -> Vec<f64> {
        let (ids, pos, mask) = batch();
        let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
        m.logits(&h)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// PEFT's matching rules (tuners_utils.check_target_module_exists), case by case.
    #[test]
    fn target_and_exclude_rules_follow_peft() {
        let k = "model.layers.3.self_attn.q_proj";
        let many = |v: &[&str]| OneOrMany::Many(v.iter().map(|s| s.to_string()).collect());
        let one = |s: &str| OneOrMany::One(s.into());
        assert!(spec(4, all(), None).targets(k).unwrap());
        assert!(spec(4, one("ALL-LINEAR"), None).targets(k).unwrap());
        assert!(spec(4, many(&["q_proj"]), None).targets(k).unwrap());
        assert!(spec(4, many(&["self_attn.q_proj"]), None)
            .targets(k)
            .unwrap());
        assert!(spec(4, many(&[k]), None).targets(k).unwrap());
        // A list entry must match a whole dotted component: `_proj` is not `.q_proj`'s suffix.
        assert!(!spec(4, many(&["proj", "_proj"]), None).targets(k).unwrap());
        // A string is a regular expression over the whole name.
        assert!(spec(4, one(r".*\.layers\.3\..*"), None).targets(k).unwrap());
        assert!(!spec(4, one("q_proj"), None).targets(k).unwrap());
        assert!(!spec(4, one(r"layers\.3"), None).targets(k).unwrap());
        // Exclusions win, with the same two rules.
        assert!(!spec(4, all(), Some(many(&["q_proj"]))).targets(k).unwrap());
        assert!(spec(4, all(), Some(many(&["k_proj"]))).targets(k).unwrap());
        assert!(!spec(4, all(), Some(one(r".*layers\.3\..*")))
            .targets(k)
            .unwrap());
        assert!(spec(4, all(), Some(one("q_proj"))).targets(k).unwrap());
        let e = spec(4, one("q_proj("), None).targets(k).unwrap_err();
        assert!(
            e.contains("q_proj(") && e.contains("regular expression"),
            "{e}"
        );
        // Scales: alpha / r and alpha / sqrt(r).
        let mut s = spec(4, all(), None);
        assert_eq!(s.scale(), 4.0);
        s.use_rslora = true;
        assert_eq!(s.scale(), 8.0);
    }

    /// Which projections a tiny model adapts, and the refusal when nothing matches.
    #[test]
    fn attach_adapts_what_the_rules_select_and_refuses_nothing() {
        let args = ModelArgs::tiny(Arch::Llama, 30);
        let (_vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        let ad = VarMap::new();
        let sp = spec(
            4,
            OneOrMany::Many(vec!["q_proj".into(), "down_proj".into()]),
            Some(OneOrMany::One(r".*layers\.1\.mlp\..*".into())),
        );
        let got = attach(&mut m, &sp, &ad, 0, "actor_rollout_ref.model").unwrap();
        assert_eq!(
            got,
            vec![
                "model.layers.0.self_attn.q_proj",
                "model.layers.0.mlp.down_proj",
                "model.layers.1.self_attn.q_proj"
            ]
        );
        let data = ad.data().lock().unwrap();
        assert_eq!(data.len(), 6);
        let a = &data["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"];
        let b = &data["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"];
        assert_eq!(a.as_tensor().dims(), &[4, 48]); // [r, in]
        assert_eq!(b.as_tensor().dims(), &[32, 4]); // [out, r]
                                                    // A is U(−1/√in, 1/√in) and not constant; B is zero.
        let av: Vec<f32> = a.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let bound = 1.0 / (48f32).sqrt();
        assert!(av.iter().all(|x| x.abs() <= bound));
        assert!(av.iter().any(|x| x.abs() > bound / 2.0));
        assert_eq!(
            b.as_tensor()
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
        drop(data);
        let (_vm, mut m2) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        let none = spec(4, OneOrMany::Many(vec!["c_attn".into()]), None);
        let e = attach(&mut m2, &none, &VarMap::new(), 0, "critic.model")
            .unwrap_err()
            .to_string();
        assert!(e.contains("critic.model") && e.contains("c_attn"), "{e}");
    }

    /// With B = 0 the adapted model's logits equal the base model's bit for bit (the adapter
    /// adds exact zeros), for Llama, Qwen2 (biased q/k/v), Seed-OSS (biased q/k/v and o) and
    /// MiMo (Qwen2's layer, its multi-token-prediction layers beside), through the hand-written
    /// layers and through the composition.
    #[test]
    fn zero_b_gives_the_base_logits_exactly() {
        for (arch, composed) in [
            (Arch::Llama, false),
            (Arch::Qwen2, false),
            (Arch::SeedOss, false),
            (Arch::MiMo, false),
            (Arch::DeepseekV3, false),
            (Arch::Glm4Moe, false),
            (Arch::GptOss, false),
            (Arch::Llama, true),
            (Arch::SeedOss, true),
        ] {
            let args = ModelArgs::tiny(arch, 30);
            let (_vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
            m.set_exec(crate::model::Exec {
                composed,
                ..m.exec()
            });
            let base = logits(&m);
            attach(&mut m, &spec(4, all(), None), &VarMap::new(), 1, "k").unwrap();
            assert!(m.has_adapters());
            assert_eq!(logits(&m), base, "{arch:?} composed {composed}");
        }
    }

    /// Merged weights (W + s·B·A) against the adapter applied on the side, f32: ≤ 1e-5; the
    /// disabled-adapter view equals the base model exactly.
    #[test]
    fn merged_equals_unmerged_and_disabled_equals_base() {
        for arch in [
            Arch::Llama,
            Arch::Qwen2,
            Arch::SeedOss,
            Arch::MiMo,
            Arch::Qwen3,
            Arch::Gemma3,
            Arch::DeepseekV3,
            Arch::Glm4Moe,
            Arch::GptOss,
        ] {
            let args = ModelArgs::tiny(arch, 30);
            let (_vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
            let base = logits(&m);
            let ad = VarMap::new();
            attach(&mut m, &spec(4, all(), None), &ad, 1, "k").unwrap();
            randomize_b(&ad, 0.2);
            let side = logits(&m);
            let merged = logits(&m.merged().unwrap());
            let diff = side
                .iter()
                .zip(&merged)
                .fold(0f64, |d, (a, b)| d.max((a - b).abs()));
            assert!(diff <= 1e-5, "{arch:?}: {diff}");
            let moved = side
                .iter()
                .zip(&base)
                .fold(0f64, |d, (a, b)| d.max((a - b).abs()));
            assert!(moved > 1e-2, "the adapter changes the logits: {moved}");
            assert_eq!(logits(&m.without_adapters()), base);
        }
    }

    /// Autograd gradients of A and B against central finite differences (f64), with and
    /// without per-layer recomputation; the frozen base weights get no gradient.
    #[test]
    fn adapter_gradients_match_finite_differences() {
        for (arch, recompute) in [
            (Arch::Llama, false),
            (Arch::Qwen2, false),
            (Arch::SeedOss, false),
            (Arch::DeepseekV3, false),
            (Arch::Glm4Moe, false),
            (Arch::GptOss, false),
            (Arch::Llama, true),
            (Arch::SeedOss, true),
            (Arch::DeepseekV3, true),
        ] {
            let args = ModelArgs::tiny(arch, 30);
            let (vm, mut m) = crate::testing::tiny_model(&args, DType::F64, 0.3);
            let ad = VarMap::new();
            let mut sp = spec(3, all(), None);
            sp.use_rslora = true;
            attach(&mut m, &sp, &ad, 2, "k").unwrap();
            randomize_b(&ad, 0.3);
            m.set_exec(crate::model::Exec {
                recompute,
                ..m.exec()
            });
            let (ids, pos, mask) = batch();
            let loss = |m: &CausalLm| {
                let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
                let (lp, ent) = m.token_logprobs(&h, &ids, 5, true).unwrap();
                // Padded positions attend to nothing (all keys at −1e9, rounded in f64): they
                // are left out, as a response mask leaves them out.
                let keep = mask.to_dtype(DType::F64).unwrap();
                ((lp * &keep).unwrap().sum_all().unwrap()
                    + (ent.unwrap() * &keep).unwrap().sum_all().unwrap())
                .unwrap()
            };
            let grads = loss(&m).backward().unwrap();
            for (_, v) in vm.data().lock().unwrap().iter() {
                assert!(
                    grads.get(v.as_tensor()).is_none(),
                    "a base weight got a gradient"
                );
            }
            let data: Vec<(String, Var)> = ad.data().lock().unwrap().clone().into_iter().collect();
            // A and B of every projection (DeepSeek-V3's: the latent attention's five, the
            // dense MLP's, eight experts' and the shared experts'; GPT-OSS's attention only).
            assert_eq!(data.len(), 2 * projections_of(&args).count());
            assert!(data.len() >= 2 * 4 * 2);
            for (name, var) in &data {
                // An expert no token was routed to has no gradient.
                let Some(g) = grads.get(var.as_tensor()) else {
                    assert!(name.contains(".experts."), "{name}: no gradient");
                    continue;
                };
                let g: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
                assert!(g.iter().any(|x| x.abs() > 1e-8), "{name}: zero gradient");
                let orig: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                let shape = var.as_tensor().shape().clone();
                for idx in [0, orig.len() / 2, orig.len() - 1] {
                    let eps = 1e-5;
                    let at = |d: f64| {
                        let mut w = orig.clone();
                        w[idx] += d;
                        var.set(&Tensor::from_vec(w, shape.clone(), &Device::Cpu).unwrap())
                            .unwrap();
                        loss(&m).to_scalar::<f64>().unwrap()
                    };
                    let fd = (at(eps) - at(-eps)) / (2.0 * eps);
                    var.set(&Tensor::from_vec(orig.clone(), shape.clone(), &Device::Cpu).unwrap())
                        .unwrap();
                    assert!(
                        (fd - g[idx]).abs() <= 1e-6 * (1.0 + fd.abs()),
                        "{arch:?} recompute={recompute} {name}[{idx}]: autograd {} vs fd {fd}",
                        g[idx]
                    );
                }
            }
        }
    }

    /// An adapter PEFT wrote (`tests/fixtures/peft_lora`, made by `scripts/peft_check.sh
    /// --make-fixture`: a tiny Llama base, rsLoRA r=4 on q_proj/v_proj/down_proj except layer 1's
    /// v_proj, random A and B) is read with PEFT's names, shapes and config keys, and the adapted
    /// model's logits equal PEFT's (PyTorch, f32) on the stored input; the base's logits equal
    /// transformers'. Writing it back with our writer and reading again gives the same tensors.
    #[test]
    fn reads_a_peft_adapter_fixture() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/peft_lora");
        let base = crate::weights::hf::load_dir(
            &dir.join("base"),
            &serde_json::Map::new(),
            DType::F32,
            &Device::Cpu,
            true,
        )
        .unwrap();
        let file = read_adapter(&dir.join("adapter")).unwrap();
        assert_eq!((file.spec.rank, file.spec.alpha), (4, 8.0));
        assert!(file.spec.use_rslora);
        let mut targets = file.spec.target_modules.to_vec();
        targets.sort();
        assert_eq!(targets, vec!["down_proj", "q_proj", "v_proj"]);
        assert_eq!(
            file.spec.exclude_modules,
            Some(OneOrMany::One(r".*layers\.1\.self_attn\.v_proj".into()))
        );
        let t = |n: &str| file.tensors[n].dims().to_vec();
        assert_eq!(
            t("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
            [4, 32]
        );
        assert_eq!(
            t("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"),
            [32, 4]
        );
        assert_eq!(
            t("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"),
            [16, 4]
        );
        assert!(!file
            .tensors
            .contains_key("base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"));
        assert_eq!(file.tensors.len(), 2 * (3 * 2 - 1));

        let expected: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        let ids: Vec<u32> = serde_json::from_value(expected["input_ids"].clone()).unwrap();
        let n = ids.len();
        let run = |m: &CausalLm| -> Vec<f32> {
            let dev = Device::Cpu;
            let pos: Vec<u32> = (0..n as u32).collect();
            let h = m
                .forward_hidden(
                    &Tensor::from_vec(ids.clone(), (1, n), &dev).unwrap(),
                    &Tensor::from_vec(pos, (1, n), &dev).unwrap(),
                    &Tensor::ones((1, n), DType::U32, &dev).unwrap(),
                    None,
                )
                .unwrap();
            m.logits(&h)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let flat = |k: &str| -> Vec<f32> {
            let rows: Vec<Vec<f32>> = serde_json::from_value(expected[k].clone()).unwrap();
            rows.concat()
        };
        let close = |a: &[f32], b: &[f32], what: &str| {
            assert_eq!(a.len(), b.len());
            let d = a.iter().zip(b).fold(0f32, |d, (x, y)| d.max((x - y).abs()));
            assert!(d <= 1e-4, "{what}: max |diff| {d}");
        };
        let mut m = base.model;
        close(&run(&m), &flat("base_logits"), "base vs transformers");
        let ad = VarMap::new();
        let adapted = attach(&mut m, &file.spec, &ad, 0, "fixture").unwrap();
        assert_eq!(adapted.len(), 5);
        assign_adapter(&ad, &file.tensors, &dir).unwrap();
        close(&run(&m), &flat("logits"), "adapted vs PEFT");
        close(
            &run(&m.merged().unwrap()),
            &flat("logits"),
            "merged vs PEFT",
        );

        let out = tempfile::tempdir().unwrap();
        let cfg = adapter_config(&file.spec, &adapted, "base", "CAUSAL_LM", None);
        save_adapter(out.path(), &cfg, &adapter_tensors(&ad)).unwrap();
        let again = read_adapter(out.path()).unwrap();
        assert_eq!(again.spec, file.spec);
        for (k, v) in &file.tensors {
            let a: Vec<f32> = again.tensors[k].flatten_all().unwrap().to_vec1().unwrap();
            let b: Vec<f32> = v.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(a, b, "{k}");
        }
    }

    /// Settings PEFT can write but this implementation cannot reproduce are refused by name.
    #[test]
    fn unsupported_adapter_settings_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let base =
            json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]});
        for (key, value, says) in [
            ("use_dora", json!(true), "use_dora"),
            ("bias", json!("all"), "bias"),
            ("rank_pattern", json!({"q_proj": 8}), "rank_pattern"),
            ("r", json!(0), "`r`"),
            ("peft_type", json!("IA3"), "IA3"),
            ("lora_dropout", json!(1.0), "lora_dropout"),
            ("lora_dropout", json!(-0.1), "lora_dropout"),
            ("lora_dropout", json!("0.1"), "lora_dropout"),
        ] {
            let mut c = base.clone();
            c[key] = value;
            std::fs::write(dir.path().join("adapter_config.json"), c.to_string()).unwrap();
            let e = read_adapter(dir.path()).err().unwrap().to_string();
            assert!(e.contains(says) && e.contains("adapter_config.json"), "{e}");
        }
        std::fs::write(dir.path().join("adapter_config.json"), base.to_string()).unwrap();
        let e = read_adapter(dir.path()).err().unwrap().to_string();
        assert!(e.contains("adapter_model.safetensors"), "{e}");
    }

    /// Rewrites `file` (safetensors) with element `at` of tensor `name` set to `value`.
    fn poison(file: &Path, name: &str, at: usize, value: f32) {
        let mut tensors = candle_core::safetensors::load(file, &Device::Cpu).unwrap();
        let t = &tensors[name];
        let mut v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v[at] = value;
        let shape = t.shape().clone();
        tensors.insert(
            name.to_string(),
            Tensor::from_vec(v, shape, &Device::Cpu).unwrap(),
        );
        candle_core::safetensors::save(&tensors, file).unwrap();
    }

    /// An adapter whose `adapter_model.safetensors` holds a NaN or an infinity is refused when
    /// it is read, naming the file and the tensor: ours (saved by [`save_adapter`]) and PEFT's
    /// (the `tests/fixtures/peft_lora` adapter).
    #[test]
    fn a_non_finite_adapter_is_refused_naming_the_file_and_tensor() {
        let (_vm, _m, ad) = adapted(DType::F32);
        let ours = tempfile::tempdir().unwrap();
        let cfg = adapter_config(&spec(3, all(), None), &[], "base", "CAUSAL_LM", None);
        save_adapter(ours.path(), &cfg, &adapter_tensors(&ad)).unwrap();
        let b = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight";
        let file = ours.path().join("adapter_model.safetensors");
        poison(&file, b, 4, f32::INFINITY);
        let e = read_adapter(ours.path())
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("adapter_model.safetensors") && e.contains(b) && e.contains("index 4"),
            "{e}"
        );
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/peft_lora/adapter");
        let peft = tempfile::tempdir().unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(fixture.join(f), peft.path().join(f)).unwrap();
        }
        let a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
        poison(
            &peft.path().join("adapter_model.safetensors"),
            a,
            0,
            f32::NAN,
        );
        let e = read_adapter(peft.path())
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("adapter_model.safetensors") && e.contains(a) && e.contains("index 0"),
            "{e}"
        );
    }

    /// A rank larger than every projection it adapts is refused before anything is allocated
    /// (`lora_rank=10000000` asked for tens of gigabytes of adapters and aborted the process),
    /// naming the rank and the limit; a rank of exactly the widest projection's smaller side is
    /// accepted, and so is one above some projections' smaller side only (Qwen3.5's
    /// `in_proj_b`/`in_proj_a`, one row per value head), as PEFT accepts it.
    #[test]
    fn a_rank_larger_than_the_projections_is_refused_before_allocating() {
        let args = ModelArgs::tiny(Arch::Llama, 30);
        let (_vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        let ad = VarMap::new();
        let e = attach(
            &mut m,
            &spec(10_000_000, all(), None),
            &ad,
            0,
            "actor_rollout_ref.model",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("actor_rollout_ref.model") && e.contains("10000000") && e.contains("32"),
            "{e}"
        );
        assert!(ad.data().lock().unwrap().is_empty(), "nothing attached");
        assert!(!m.has_adapters());
        // q_proj, o_proj and the MLP's have a smaller side of 32 (k_proj, v_proj 16): 32 is the
        // largest rank all-linear allows; k_proj's 16 the largest when only k_proj is adapted.
        let k = || OneOrMany::Many(vec!["k_proj".into()]);
        attach(&mut m, &spec(32, all(), None), &VarMap::new(), 0, "k").unwrap();
        let (_vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        let e = attach(&mut m, &spec(33, all(), None), &VarMap::new(), 0, "k")
            .unwrap_err()
            .to_string();
        assert!(e.contains("33") && e.contains("32"), "{e}");
        let (_vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        attach(&mut m, &spec(16, k(), None), &VarMap::new(), 0, "k").unwrap();
        let (_vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        let e = attach(&mut m, &spec(17, k(), None), &VarMap::new(), 0, "k")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("17") && e.contains("16") && e.contains("k_proj"),
            "{e}"
        );
        // Qwen3.5: in_proj_b and in_proj_a are [4, 32]; rank 8 adapts them (and the rest).
        let args = ModelArgs::tiny(Arch::Qwen3_5, 30);
        let (_vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        let ad = VarMap::new();
        let names = attach(&mut m, &spec(8, all(), None), &ad, 0, "k").unwrap();
        assert!(
            names.iter().any(|n| n.ends_with("linear_attn.in_proj_b")),
            "{names:?}"
        );
    }

    /// The projections listed from the hyper-parameters (what `config check` checks ranks
    /// against) are the model's own, names and shapes, for every family (Qwen3-MoE with a
    /// dense layer among its expert layers included; the DeltaNet hybrids' split and grouped
    /// inputs, gated attention and shared experts; DeepSeek-V3's latent attention and shared
    /// experts).
    #[test]
    fn projections_from_the_config_are_the_models() {
        let all = crate::testing::DECODER_ARCHS.into_iter();
        let deepseek = [Arch::DeepseekV3, Arch::Glm4Moe, Arch::GptOss];
        for arch in all.chain(crate::testing::HYBRID_ARCHS).chain(deepseek) {
            let mut args = ModelArgs::tiny(arch, 30);
            args.head_dim = 4; // q_proj [16, 32]: not square (DeepSeek's rope width already)
            args.rotary_dim = args.rotary_dim.map(|_| 2);
            let (_vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
            let want = projections(&mut m).unwrap();
            assert_eq!(projections_of(&args).collect::<Vec<_>>(), want, "{arch:?}");
        }
    }

    /// Σ log p + Σ entropy over the real tokens of [`batch`]: a loss whose gradient reaches
    /// every adapter (padded positions left out, as a response mask leaves them out).
    fn lp_loss(m: &CausalLm) -> Tensor {
        let (ids, pos, mask) = batch();
        let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
        let (lp, ent) = m.token_logprobs(&h, &ids, 5, true).unwrap();
        let keep = mask.to_dtype(h.dtype()).unwrap();
        ((lp * &keep).unwrap().sum_all().unwrap()
            + (ent.unwrap() * &keep).unwrap().sum_all().unwrap())
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
    }

    /// Every adapter variable's gradient of [`lp_loss`], by name.
    fn adapter_grads(m: &CausalLm, ad: &VarMap) -> Vec<(String, Vec<f64>)> {
        let g = lp_loss(m).backward().unwrap();
        let mut out: Vec<(String, Vec<f64>)> = ad
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(n, v)| {
                // The composition gives no gradient to an expert no token was routed to.
                let zero = || v.as_tensor().zeros_like().unwrap();
                let t = match g.get(v.as_tensor()) {
                    Some(t) => t.clone(),
                    None if n.contains(".experts.") => zero(),
                    None => panic!("{n}: no gradient"),
                };
                (
                    n.clone(),
                    t.to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap(),
                )
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// A tiny model with trained-looking adapters on every projection (dtype `dtype`).
    fn adapted(dtype: DType) -> (VarMap, CausalLm, VarMap) {
        adapted_arch(Arch::Llama, dtype)
    }

    fn adapted_arch(arch: Arch, dtype: DType) -> (VarMap, CausalLm, VarMap) {
        let args = ModelArgs::tiny(arch, 30);
        let (vm, mut m) = crate::testing::tiny_model(&args, dtype, 0.3);
        let ad = VarMap::new();
        attach(&mut m, &spec(3, all(), None), &ad, 2, "k").unwrap();
        randomize_b(&ad, 0.3);
        (vm, m, ad)
    }

    fn max_abs_diff(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)]) -> f64 {
        a.iter()
            .zip(b)
            .flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
            .fold(0.0, f64::max)
    }

    /// The mask: a fraction p of zeros (binomial: within 5σ over 2·10⁵ draws), survivors
    /// scaled by exactly 1/(1−p), the same elements as `keeps` across the parallel chunks,
    /// different seeds giving different masks, and p = 0 keeping every value bit for bit.
    #[test]
    fn dropout_masks_zero_the_expected_fraction() {
        let n = 200_000usize;
        for (p, seed) in [(0.1, 1u64), (0.5, 2), (0.9, 3)] {
            let d = Dropout { p, seed };
            let mut v = vec![1f64; n];
            d.apply(&mut v);
            let zeros = v.iter().filter(|&&x| x == 0.0).count() as f64 / n as f64;
            let sigma = (p * (1.0 - p) / n as f64).sqrt();
            assert!((zeros - p).abs() <= 5.0 * sigma, "p {p}: zeroed {zeros}");
            let s = 1.0 / (1.0 - p);
            for (i, &x) in v.iter().enumerate() {
                assert_eq!(x, if d.keeps(i) { s } else { 0.0 }, "element {i}");
            }
            let other = Dropout {
                p,
                seed: seed + 100,
            };
            let same = (0..n).filter(|&i| d.keeps(i) == other.keeps(i)).count() as f64;
            // Independent masks agree on a fraction p² + (1−p)² of the elements.
            let agree = p * p + (1.0 - p) * (1.0 - p);
            assert!((same / n as f64 - agree).abs() < 0.01, "p {p}: {same}");
        }
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = x.clone();
        Dropout { p: 0.0, seed: 5 }.apply(&mut y);
        assert_eq!(x, y);
    }

    /// A p = 0 mask on every adapter (forced onto the layers, so the masked code runs) gives
    /// the unmasked path's logits and adapter gradients bit for bit, in the hand-written layer
    /// and in the composition.
    #[test]
    fn dropout_zero_is_the_plain_path_bit_for_bit() {
        for composed in [false, true] {
            let (_vm, mut m, ad) = adapted(DType::F32);
            m.set_exec(crate::model::Exec {
                composed,
                ..m.exec()
            });
            let (want_logits, want) = (logits(&m), adapter_grads(&m, &ad));
            for (i, b) in m.blocks_mut().iter_mut().enumerate() {
                *b = b.with_dropout(0.0, 9, i);
            }
            assert_eq!(logits(&m), want_logits, "composed {composed}");
            assert_eq!(adapter_grads(&m, &ad), want, "composed {composed}");
        }
    }

    /// With p = 0.3 and a fixed mask (the stream put back at the same position before every
    /// forward), autograd's A and B gradients match central finite differences (f64), in the
    /// hand-written layer without and with recomputation and in the composition; the masks
    /// matter (another position gives another loss).
    #[test]
    fn dropout_gradients_match_finite_differences() {
        for (recompute, composed) in [(false, false), (true, false), (false, true)] {
            let (_vm, mut m, ad) = adapted(DType::F64);
            m.set_exec(crate::model::Exec {
                recompute,
                composed,
                ..m.exec()
            });
            m.set_adapter_dropout(0.3, 17).unwrap();
            let loss = |m: &CausalLm| {
                m.set_dropout_position(0);
                lp_loss(m).to_scalar::<f64>().unwrap()
            };
            m.set_dropout_position(1);
            let other = lp_loss(&m).to_scalar::<f64>().unwrap();
            assert!((loss(&m) - other).abs() > 1e-6, "the mask changes the loss");
            m.set_dropout_position(0);
            let grads = adapter_grads(&m, &ad);
            let vars: Vec<(String, Var)> = {
                let mut v: Vec<_> = ad.data().lock().unwrap().clone().into_iter().collect();
                v.sort_by(|a, b| a.0.cmp(&b.0));
                v
            };
            for ((name, var), (_, g)) in vars.iter().zip(&grads) {
                let orig: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                let shape = var.as_tensor().shape().clone();
                let set = |w: Vec<f64>| {
                    var.set(&Tensor::from_vec(w, shape.clone(), &Device::Cpu).unwrap())
                        .unwrap()
                };
                for idx in [0, orig.len() / 3, orig.len() - 1] {
                    let eps = 1e-5;
                    let at = |d: f64| {
                        let mut w = orig.clone();
                        w[idx] += d;
                        set(w);
                        loss(&m)
                    };
                    let fd = (at(eps) - at(-eps)) / (2.0 * eps);
                    set(orig.clone());
                    assert!(
                        (fd - g[idx]).abs() <= 1e-6 * (1.0 + fd.abs()),
                        "recompute={recompute} composed={composed} {name}[{idx}]: autograd {} vs fd {fd}",
                        g[idx]
                    );
                }
            }
        }
    }

    /// With dropout on, recomputation on and off give the same adapter gradients (the mask is
    /// drawn again from its seed, not stored), and the composition draws the same mask as the
    /// hand-written layer (same gradients to rounding, f64); for a dense model and for
    /// Qwen3-MoE, whose experts' adapters see only their tokens' rows.
    #[test]
    fn dropout_masks_agree_across_recomputation_and_the_composition() {
        for arch in [Arch::Llama, Arch::Qwen3Moe] {
            let run = |recompute: bool, composed: bool| {
                let (_vm, mut m, ad) = adapted_arch(arch, DType::F64);
                m.set_adapter_dropout(0.25, 3).unwrap();
                m.set_exec(crate::model::Exec {
                    recompute,
                    composed,
                    ..m.exec()
                });
                m.set_dropout_position(42);
                adapter_grads(&m, &ad)
            };
            let kept = run(false, false);
            if arch == Arch::Qwen3Moe {
                let experts = kept.iter().filter(|(n, _)| n.contains(".experts.")).count();
                assert_eq!(experts, 8 * 3 * 2, "adapters on every expert's projections");
            }
            assert_eq!(
                run(true, false),
                kept,
                "{arch:?}: recomputation changed the gradients"
            );
            let d = max_abs_diff(&run(false, true), &kept);
            assert!(d <= 1e-10, "{arch:?}: composition vs hand-written: {d}");
            // And the mask matters: without dropout the gradients differ.
            let (_vm, m, ad) = adapted_arch(arch, DType::F64);
            assert!(max_abs_diff(&adapter_grads(&m, &ad), &kept) > 1e-4);
        }
    }

    /// Evaluation passes never drop: the no-grad view (rollout, log-prob recomputation), the
    /// adapters-off view (reference) and the merged view of a model with dropout 0.5 give the
    /// logits of the same model without dropout, bit for bit; its training forwards do drop,
    /// each with a new mask.
    #[test]
    fn dropout_leaves_evaluation_passes_alone() {
        let (_vm, mut m, _ad) = adapted(DType::F32);
        let plain = logits(&m);
        let (off, merged) = (logits(&m.without_adapters()), logits(&m.merged().unwrap()));
        m.set_adapter_dropout(0.5, 8).unwrap();
        assert_eq!(m.adapter_dropout(), 0.5);
        assert_eq!(logits(&m.no_grad()), plain);
        assert_eq!(logits(&m.without_adapters()), off);
        assert_eq!(logits(&m.merged().unwrap()), merged);
        let (t1, t2) = (logits(&m), logits(&m));
        let moved =
            |a: &[f64], b: &[f64]| a.iter().zip(b).fold(0f64, |d, (x, y)| d.max((x - y).abs()));
        assert!(moved(&t1, &plain) > 1e-3, "a training forward drops");
        assert!(
            moved(&t1, &t2) > 1e-3,
            "each training forward draws a new mask"
        );
        assert!(m
            .set_adapter_dropout(1.0, 0)
            .unwrap_err()
            .contains("lora_dropout"));
        m.set_adapter_dropout(0.0, 0).unwrap();
        assert_eq!(logits(&m), plain);
    }
}
