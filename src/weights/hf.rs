//! HF model directories: `config.json` + `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`), loaded into trainable variables, and saved back in the same
//! layout (with the tokenizer files and `generation_config.json`) so that this program and HF
//! transformers both load the result.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use serde_json::Value;

use crate::model::config::MTP_PREFIX;
use crate::model::config::VISUAL;
use crate::model::deberta::{DebertaConfig, DebertaV2Classifier};
use crate::model::{CausalLm, ModelArgs, ModelError};

/// A model with its variables (the trainer's optimizer updates these).
pub struct Loaded {
    pub model: CausalLm,
    pub varmap: VarMap,
}

fn read_json(path: &Path) -> Result<Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::file(path, e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| ModelError::file(path, format!("not valid JSON: {e}")))
}

/// `config.json` with `override_config` entries applied.
pub fn read_config(
    dir: &Path,
    overrides: &serde_json::Map<String, Value>,
) -> Result<ModelArgs, ModelError> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Err(no_config(dir));
    }
    let mut v = read_json(&path)?;
    if let Some(obj) = v.as_object_mut() {
        for (k, val) in overrides {
            obj.insert(k.clone(), val.clone());
        }
    }
    let mut args = ModelArgs::from_hf(&v).map_err(|m| ModelError::file(&path, m))?;
    args.remote_code = remote_code(dir, args.auto_map.as_ref())?;
    Ok(args)
}

/// The Python files of `dir` that `auto_map` names (`"modeling_mimo.MiMoForCausalLM"` →
/// `modeling_mimo.py`), file name → text; entries naming another repository
/// (`"org/repo--module.Class"`) and files not in `dir` are left to transformers.
fn remote_code(
    dir: &Path,
    auto_map: Option<&Value>,
) -> Result<BTreeMap<String, String>, ModelError> {
    let mut out = BTreeMap::new();
    let Some(map) = auto_map.and_then(Value::as_object) else {
        return Ok(out);
    };
    let names = map.values().flat_map(|v| match v {
        Value::Array(a) => a.iter().filter_map(Value::as_str).collect::<Vec<_>>(),
        v => v.as_str().into_iter().collect(),
    });
    for class in names.filter(|c| !c.contains("--")) {
        let Some((module, _)) = class.rsplit_once('.') else {
            continue;
        };
        let file = format!("{module}.py");
        let path = dir.join(&file);
        if module.contains(['/', '\\']) || !path.is_file() || out.contains_key(&file) {
            continue;
        }
        let text =
            std::fs::read_to_string(&path).map_err(|e| ModelError::file(&path, e.to_string()))?;
        out.insert(file, text);
    }
    Ok(out)
}

/// `config.json` of `dir` as written, for choosing how to run the checkpoint.
pub fn read_config_json(dir: &Path) -> Result<Value, ModelError> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Err(no_config(dir));
    }
    read_json(&path)
}

/// A DeBERTa-v2/v3 sequence-classification checkpoint (`DebertaV2ForSequenceClassification`),
/// f32 on `device`, for inference.
pub fn load_deberta(dir: &Path, device: &Device) -> Result<DebertaV2Classifier, ModelError> {
    let v = read_config_json(dir)?;
    let config =
        DebertaConfig::from_json(&v).map_err(|m| ModelError::file(&dir.join("config.json"), m))?;
    let tensors = read_weights(dir)?;
    let files = weight_files(dir)?;
    let label = match files.as_slice() {
        [one] => one.display().to_string(),
        _ => dir
            .join("model.safetensors.index.json")
            .display()
            .to_string(),
    };
    DebertaV2Classifier::new(config, &tensors, &label, device)
}

/// Whether `dir` holds model weights: `model.safetensors` or a shard index.
pub fn has_weights(dir: &Path) -> bool {
    dir.join("model.safetensors").is_file() || dir.join("model.safetensors.index.json").is_file()
}

/// The safetensors files of a checkpoint directory.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| ModelError::file(&index, "no `weight_map` object".into()))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect();
        files.sort();
        files.dedup();
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        if let Some(missing) = paths.iter().find(|p| !p.is_file()) {
            return Err(ModelError::file(
                missing,
                "listed in model.safetensors.index.json but missing".into(),
            ));
        }
        return Ok(paths);
    }
    // A LoRA checkpoint's `huggingface/` has a config and no weights: its adapters are beside it.
    if let Some(e) = super::peft::adapter_instead_of_model(dir) {
        return Err(e);
    }
    Err(ModelError::file(dir, "no model.safetensors or model.safetensors.index.json (PyTorch .bin checkpoints are not supported: convert them to safetensors)".into()))
}

/// Why `dir` has no `config.json`: a LoRA adapter folder or LoRA checkpoint part is named as
/// such ([`super::peft::adapter_instead_of_model`]), a checkpoint's `actor/` (or `critic/`) or
/// `global_step_N/` folder points at the `huggingface/` model inside it.
fn no_config(dir: &Path) -> ModelError {
    if let Some(e) = super::peft::adapter_instead_of_model(dir) {
        return e;
    }
    for inner in ["huggingface", "actor/huggingface"] {
        let model = dir.join(inner);
        if model.join("config.json").is_file() {
            return ModelError::file(
                dir,
                format!(
                    "no config.json: a checkpoint folder, whose model is {}",
                    model.display()
                ),
            );
        }
    }
    ModelError::file(
        dir,
        "no config.json (an HF model directory has config.json and model.safetensors)".into(),
    )
}

/// Copies `tensors` into the model's variables; every variable must be found with its shape.
/// GPT-OSS's fused experts (as [`save_dir`] writes them) are read per expert.
pub fn assign(
    varmap: &VarMap,
    tensors: &HashMap<String, Tensor>,
    source: &Path,
) -> Result<(), ModelError> {
    let split = split_gpt_oss_experts(tensors, source)?;
    let tensors = split.as_ref().unwrap_or(tensors);
    let data = varmap.data().lock().expect("varmap lock");
    // In name order, so the first problem reported is always the same one.
    let sorted: BTreeMap<&String, &candle_core::Var> = data.iter().collect();
    for (name, var) in sorted {
        let t = tensors.get(name).ok_or_else(|| ModelError::Missing {
            name: name.clone(),
            file: source.display().to_string(),
        })?;
        if t.dims() != var.as_tensor().dims() {
            return Err(ModelError::Shape {
                name: name.clone(),
                expected: var.as_tensor().dims().to_vec(),
                found: t.dims().to_vec(),
            });
        }
        var.set(
            &t.to_dtype(var.as_tensor().dtype())?
                .to_device(var.as_tensor().device())?,
        )?;
    }
    Ok(())
}

/// Loads an HF directory as trainable variables of `dtype` on `device`. Without an LM head the
/// backbone is loaded alone (critic, reward model).
pub fn load_dir(
    dir: &Path,
    overrides: &serde_json::Map<String, Value>,
    dtype: DType,
    device: &Device,
    with_lm_head: bool,
) -> Result<Loaded, ModelError> {
    let args = read_config(dir, overrides)?;
    let tensors = read_weights(dir)?;
    build(&args, &tensors, dir, dtype, device, with_lm_head)
}

/// Every tensor of an HF directory's safetensors weights (one file or shards), on the CPU; a
/// NaN or infinite value is an error naming the file (the shard) and the tensor.
pub fn read_weights(dir: &Path) -> Result<HashMap<String, Tensor>, ModelError> {
    let mut tensors = HashMap::new();
    for f in weight_files(dir)? {
        let part = candle_core::safetensors::load(&f, &Device::Cpu)
            .map_err(|e| ModelError::file(&f, format!("not a readable safetensors file: {e}")))?;
        super::check_all_finite(&f, &part)?;
        tensors.extend(part);
    }
    Ok(tensors)
}

/// A model of `args` whose variables take the values of `tensors` (HF names) read from `source`.
pub fn build(
    args: &ModelArgs,
    tensors: &HashMap<String, Tensor>,
    source: &Path,
    dtype: DType,
    device: &Device,
    with_lm_head: bool,
) -> Result<Loaded, ModelError> {
    let lifted = language_model_of(tensors, source, args.vision.is_some());
    let tensors = lifted.as_ref().unwrap_or(tensors);
    let split = match args.gpt_oss_experts() {
        true => split_gpt_oss_experts(tensors, source)?,
        false => split_fused_experts(tensors, source, args.hidden_size)?,
    };
    let tensors = split.as_ref().unwrap_or(tensors);
    let varmap = VarMap::new();
    let vars = CheckpointVars {
        varmap: &varmap,
        tensors,
        source,
        problems: std::sync::Mutex::new(BTreeMap::new()),
    };
    let built = CausalLm::new(
        args,
        VarBuilder::from_backend(Box::new(&vars), dtype, device.clone()),
        with_lm_head,
    );
    // The first problem in name order, so the one reported is always the same one.
    let first = vars.problems.lock().expect("problems lock").pop_first();
    match (built, first) {
        (_, Some((_, problem))) => Err(problem),
        (Err(e), None) => Err(ModelError::Candle(e)),
        (Ok(model), None) => {
            keep_deepseek_mtp_layers(args, tensors, &varmap, dtype, device)?;
            // A layer tensor the model did not read would be weights silently left out of
            // the computation (e.g. q/k norms under a layout without them), or, for MiMo's
            // multi-token-prediction layers, out of what is saved back.
            let used = varmap.data().lock().expect("varmap lock");
            let layer = |n: &str| {
                n.starts_with("model.layers.")
                    || n.starts_with(MTP_PREFIX)
                    || (args.vision.is_some() && n.starts_with(VISUAL))
            };
            let mut unread: Vec<&String> = tensors
                .keys()
                .filter(|n| layer(n) && !used.contains_key(*n))
                .filter(|n| !n.ends_with("rotary_emb.inv_freq"))
                .collect();
            unread.sort();
            if let Some(first) = unread.first() {
                return Err(ModelError::file(
                    source,
                    format!(
                        "{} layer tensor(s) this {:?} layout does not use, first `{first}`: the checkpoint is of another architecture than its config says",
                        unread.len(),
                        args.arch
                    ),
                ));
            }
            drop(used);
            Ok(Loaded { model, varmap })
        }
    }
}

/// DeepSeek's multi-token-prediction layers (`model.layers.{num_hidden_layers + j}.*` for `j`
/// below `num_nextn_predict_layers`): variables of the model's map under their own names and
/// shapes, so that they are saved back as read; the forward never runs them and the trainer
/// leaves them out of its update (`ModelArgs::kept_as_read`). transformers drops them.
fn keep_deepseek_mtp_layers(
    args: &ModelArgs,
    tensors: &HashMap<String, Tensor>,
    varmap: &VarMap,
    dtype: DType,
    device: &Device,
) -> Result<(), ModelError> {
    let mut data = varmap.data().lock().expect("varmap lock");
    for (name, t) in tensors.iter().filter(|(n, _)| args.deepseek_mtp_layer(n)) {
        let var = candle_core::Var::from_tensor(&t.to_dtype(dtype)?.to_device(device)?)?;
        data.insert(name.clone(), var);
    }
    Ok(())
}

/// Qwen3-VL-MoE's experts as transformers writes them: per layer of experts
/// `mlp.experts.gate_up_proj` `[experts, 2·inter, hidden]` (each expert's gate rows, then its up
/// rows) and `mlp.experts.down_proj` `[experts, hidden, inter]`, from the per-expert tensors.
fn fuse_qwen3_vl_moe_experts(
    named: &mut BTreeMap<String, Tensor>,
    args: &ModelArgs,
) -> candle_core::Result<()> {
    let Some(moe) = args
        .moe
        .as_ref()
        .filter(|_| args.arch == crate::model::Arch::Qwen3VlMoe)
    else {
        return Ok(());
    };
    for layer in (0..args.num_hidden_layers).filter(|&l| moe.sparse(l)) {
        let prefix = format!("model.layers.{layer}.mlp.experts");
        let mut take = |e: usize, p: &str| {
            let k = format!("{prefix}.{e}.{p}.weight");
            named
                .remove(&k)
                .ok_or_else(|| candle_core::Error::Msg(format!("no `{k}` to save")))
        };
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..moe.num_experts {
            gate_up.push(Tensor::cat(
                &[take(e, "gate_proj")?, take(e, "up_proj")?],
                0,
            )?);
            down.push(take(e, "down_proj")?);
        }
        named.insert(
            format!("{prefix}.gate_up_proj"),
            Tensor::stack(&gate_up, 0)?,
        );
        named.insert(format!("{prefix}.down_proj"), Tensor::stack(&down, 0)?);
    }
    Ok(())
}

/// The names a model of `args` is saved under: Qwen3-VL's and multimodal Qwen3.5's checkpoints
/// (as the hub publishes them and transformers writes them, with no conversion back from the
/// older layout) name the language model `model.language_model.*` and the tower
/// `model.visual.*`; other families keep the names they are held under (the hub's `model.*`,
/// `visual.*`).
fn saved_names(named: BTreeMap<String, Tensor>, args: &ModelArgs) -> BTreeMap<String, Tensor> {
    let nested = matches!(
        args.arch,
        crate::model::Arch::Qwen3Vl | crate::model::Arch::Qwen3VlMoe
    ) || (args.arch.hybrid() && args.vision.is_some());
    if !nested {
        return named;
    }
    named
        .into_iter()
        .map(
            |(n, t)| match (n.strip_prefix("model."), n.strip_prefix(VISUAL)) {
                (Some(rest), _) => (format!("model.language_model.{rest}"), t),
                (_, Some(rest)) => (format!("model.visual.{rest}"), t),
                _ => (n, t),
            },
        )
        .collect()
}

/// A multimodal checkpoint in transformers 5's in-memory layout (`model.language_model.*`,
/// `model.visual.*`; Qwen3.5's `Qwen3_5ForConditionalGeneration` as the hub publishes it) under
/// the hub's names: the language model as `model.*`, `lm_head.*` kept. With `vision` (a
/// vision-language model) the tower becomes `visual.*`; without, the tower and the
/// multi-token-prediction head (`mtp.*`) are left out with a note (text-only training).
/// `None` when the checkpoint has no such prefix.
fn language_model_of(
    tensors: &HashMap<String, Tensor>,
    source: &Path,
    vision: bool,
) -> Option<HashMap<String, Tensor>> {
    const PREFIX: &str = "model.language_model.";
    if !tensors
        .keys()
        .any(|n| n.starts_with(PREFIX) || n.starts_with("model.visual."))
    {
        return None;
    }
    let mut out = HashMap::with_capacity(tensors.len());
    let mut left = 0usize;
    for (n, t) in tensors {
        if let Some(rest) = n.strip_prefix(PREFIX) {
            out.insert(format!("model.{rest}"), t.clone());
        } else if let Some(rest) = n.strip_prefix("model.visual.").filter(|_| vision) {
            out.insert(format!("{VISUAL}{rest}"), t.clone());
        } else if n.starts_with("model.visual.") || n.starts_with("mtp.") {
            left += 1;
        } else {
            out.insert(n.clone(), t.clone());
        }
    }
    if left > 0 {
        tracing::info!(
            "{}: a multimodal checkpoint; its language model is loaded, {left} vision / multi-token-prediction tensor(s) are not used (text-only training)",
            source.display()
        );
    }
    Some(out)
}

/// Experts stored fused as transformers 5 holds them in memory (and writes them with
/// `save_original_format=False`, or for Qwen3-VL-MoE always): `mlp.experts.gate_up_proj`
/// `[experts, 2·inter, hidden]` (each expert's gate rows, then its up rows) and
/// `mlp.experts.down_proj` `[experts, hidden, inter]`, or each expert transposed as Qwen3-VL-MoE's
/// hub checkpoints hold them (told by which side is `hidden` wide), cut into per-expert tensors
/// `mlp.experts.N.{gate,up,down}_proj.weight`. `None` when there are none.
fn split_fused_experts(
    tensors: &HashMap<String, Tensor>,
    source: &Path,
    hidden: usize,
) -> Result<Option<HashMap<String, Tensor>>, ModelError> {
    let fused = |n: &String| {
        n.ends_with(".mlp.experts.gate_up_proj") || n.ends_with(".mlp.experts.down_proj")
    };
    if !tensors.keys().any(fused) {
        return Ok(None);
    }
    let bad = |name: &str, m: String| ModelError::file(source, format!("`{name}`: {m}"));
    let mut out = HashMap::with_capacity(tensors.len());
    for (name, t) in tensors {
        if !fused(name) {
            out.insert(name.clone(), t.clone());
            continue;
        }
        let (prefix, which) = name.rsplit_once('.').expect("has a dot");
        let (experts, rows, _) = t.dims3().map_err(|_| {
            bad(
                name,
                format!("expected [experts, out, in], found {:?}", t.dims()),
            )
        })?;
        // Qwen3-VL-MoE's hub checkpoints hold each expert transposed (`[in, out]`:
        // gate_up_proj `[experts, hidden, 2·inter]`, down_proj `[experts, inter, hidden]`).
        let transposed = match which {
            "gate_up_proj" => rows == hidden && t.dim(2)? != hidden,
            _ => t.dim(2)? == hidden && rows != hidden,
        };
        let rows = if transposed { t.dim(2)? } else { rows };
        for e in 0..experts {
            let w = match transposed {
                true => t.get(e)?.t()?,
                false => t.get(e)?,
            }; // [out, in]
            let parts: Vec<(&str, Tensor)> = if which == "gate_up_proj" {
                if rows % 2 != 0 {
                    return Err(bad(
                        name,
                        format!("{rows} rows do not split into gate and up halves"),
                    ));
                }
                vec![
                    ("gate_proj", w.narrow(0, 0, rows / 2)?),
                    ("up_proj", w.narrow(0, rows / 2, rows / 2)?),
                ]
            } else {
                vec![("down_proj", w)]
            };
            for (p, w) in parts {
                let key = format!("{prefix}.{e}.{p}.weight");
                if tensors.contains_key(&key) {
                    return Err(bad(
                        &key,
                        format!("stored both per expert and fused in `{name}`"),
                    ));
                }
                out.insert(key, w.contiguous()?);
            }
        }
    }
    Ok(Some(out))
}

/// The four fused tensors of GPT-OSS's experts, by suffix of `….mlp.experts.`.
const GPT_OSS_FUSED: [&str; 4] = [
    "gate_up_proj",
    "gate_up_proj_bias",
    "down_proj",
    "down_proj_bias",
];

/// GPT-OSS's experts as its checkpoints store them (`mlp.experts.gate_up_proj` `[experts,
/// hidden, 2·inter]` whose columns alternate gate, up, gate, up…; `gate_up_proj_bias`
/// `[experts, 2·inter]` alike; `down_proj` `[experts, inter, hidden]`; `down_proj_bias`
/// `[experts, hidden]`) cut into per-expert projections in nn.Linear's `[out, in]` layout,
/// `mlp.experts.N.{gate,up,down}_proj.{weight,bias}`. [`fuse_gpt_oss_experts`] is the
/// inverse. `None` when there are none.
fn split_gpt_oss_experts(
    tensors: &HashMap<String, Tensor>,
    source: &Path,
) -> Result<Option<HashMap<String, Tensor>>, ModelError> {
    let dequantized = dequantize_mxfp4_experts(tensors, source)?;
    let tensors = dequantized.as_ref().unwrap_or(tensors);
    fn part(n: &str) -> Option<(&str, &str)> {
        let (prefix, which) = n.rsplit_once(".mlp.experts.")?;
        GPT_OSS_FUSED.contains(&which).then_some((prefix, which))
    }
    if !tensors.keys().any(|n| part(n).is_some()) {
        return Ok(None);
    }
    let bad = |name: &str, m: String| ModelError::file(source, format!("`{name}`: {m}"));
    let mut out = HashMap::with_capacity(tensors.len());
    for (name, t) in tensors {
        let Some((prefix, which)) = part(name) else {
            out.insert(name.clone(), t.clone());
            continue;
        };
        let experts = t.dim(0).map_err(|_| bad(name, "a scalar".into()))?;
        let key = |e: usize, p: &str, kind: &str| format!("{prefix}.mlp.experts.{e}.{p}.{kind}");
        for e in 0..experts {
            let x = t.get(e)?;
            // (projection, tensor) pairs in nn.Linear's layout.
            let parts: Vec<(String, Tensor)> = match (which, x.dims()) {
                ("gate_up_proj", &[h, two]) if two % 2 == 0 => {
                    let x = x.reshape((h, two / 2, 2))?; // [hidden, inter, (gate, up)]
                    vec![
                        (key(e, "gate_proj", "weight"), x.narrow(2, 0, 1)?.squeeze(2)?.t()?),
                        (key(e, "up_proj", "weight"), x.narrow(2, 1, 1)?.squeeze(2)?.t()?),
                    ]
                }
                ("gate_up_proj_bias", &[two]) if two % 2 == 0 => {
                    let x = x.reshape((two / 2, 2))?;
                    vec![
                        (key(e, "gate_proj", "bias"), x.narrow(1, 0, 1)?.squeeze(1)?),
                        (key(e, "up_proj", "bias"), x.narrow(1, 1, 1)?.squeeze(1)?),
                    ]
                }
                ("down_proj", &[_, _]) => vec![(key(e, "down_proj", "weight"), x.t()?)],
                ("down_proj_bias", &[_]) => vec![(key(e, "down_proj", "bias"), x)],
                _ => {
                    return Err(bad(
                        name,
                        format!(
                            "{:?} is not GPT-OSS's layout ([experts, hidden, 2·inter], [experts, 2·inter], [experts, inter, hidden], [experts, hidden])",
                            t.dims()
                        ),
                    ))
                }
            };
            for (k, w) in parts {
                if tensors.contains_key(&k) {
                    return Err(bad(
                        &k,
                        format!("stored both per expert and fused in `{name}`"),
                    ));
                }
                out.insert(k, w.contiguous()?);
            }
        }
    }
    Ok(Some(out))
}

/// The values of MXFP4's 4-bit codes (E2M1: sign, two exponent bits, one mantissa bit).
const FP4: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// GPT-OSS's experts as its published checkpoints store them (`quantization_config`
/// `quant_method: mxfp4`): `mlp.experts.{gate_up,down}_proj_blocks` `[experts, rows, groups,
/// 16]` bytes, two 4-bit codes each (low nibble first), and `…_scales` `[experts, rows, groups]`
/// with each group's power of two (`2^(s − 127)`), dequantized as transformers dequantizes
/// them (`convert_moe_packed_tensors`): value `FP4[code] · 2^(s − 127)` in f32 (exact: a code
/// times a power of two), rows × 32 values per group, then transposed to the fused layout
/// `[experts, in, out]`. `None` when there are no such tensors.
fn dequantize_mxfp4_experts(
    tensors: &HashMap<String, Tensor>,
    source: &Path,
) -> Result<Option<HashMap<String, Tensor>>, ModelError> {
    if !tensors.keys().any(|n| n.ends_with("_blocks")) {
        return Ok(None);
    }
    let bad = |name: &str, m: String| ModelError::file(source, format!("`{name}`: {m}"));
    let mut out = HashMap::with_capacity(tensors.len());
    for (name, t) in tensors {
        if name.ends_with("_scales") && tensors.contains_key(&name.replace("_scales", "_blocks")) {
            continue;
        }
        let Some(stem) = name.strip_suffix("_blocks") else {
            out.insert(name.clone(), t.clone());
            continue;
        };
        let scales_name = format!("{stem}_scales");
        let scales = tensors.get(&scales_name).ok_or_else(|| {
            bad(
                name,
                format!("MXFP4 blocks without their scales `{scales_name}`"),
            )
        })?;
        let (e, rows, groups, bytes) = t.dims4().map_err(|_| {
            bad(
                name,
                format!(
                    "MXFP4 blocks are [experts, rows, groups, 16], found {:?}",
                    t.dims()
                ),
            )
        })?;
        if t.dtype() != DType::U8
            || scales.dtype() != DType::U8
            || scales.dims() != [e, rows, groups]
        {
            return Err(bad(
                name,
                format!(
                    "MXFP4 blocks {:?} {:?} and scales {:?} {:?}: u8, scales [experts, rows, groups]",
                    t.dims(),
                    t.dtype(),
                    scales.dims(),
                    scales.dtype()
                ),
            ));
        }
        let (codes, exps): (Vec<u8>, Vec<u8>) = (
            t.flatten_all()?.to_vec1()?,
            scales.flatten_all()?.to_vec1()?,
        );
        let mut values = vec![0f32; codes.len() * 2];
        for (g, (row, &s)) in codes.chunks(bytes).zip(&exps).enumerate() {
            let scale = 2f32.powi(i32::from(s) - 127);
            for (j, &b) in row.iter().enumerate() {
                values[g * 2 * bytes + 2 * j] = FP4[usize::from(b & 0x0f)] * scale;
                values[g * 2 * bytes + 2 * j + 1] = FP4[usize::from(b >> 4)] * scale;
            }
        }
        let w = Tensor::from_vec(values, (e, rows, groups * bytes * 2), &Device::Cpu)?;
        out.insert(stem.to_string(), w.transpose(1, 2)?.contiguous()?);
    }
    Ok(Some(out))
}

/// The inverse of [`split_gpt_oss_experts`] on a model's named tensors: every layer's
/// per-expert projections back into GPT-OSS's four fused tensors.
pub(crate) fn fuse_gpt_oss_experts(
    named: &mut BTreeMap<String, Tensor>,
    args: &ModelArgs,
) -> candle_core::Result<()> {
    let Some(moe) = args.moe.as_ref().filter(|m| m.swiglu.is_some()) else {
        return Ok(());
    };
    for layer in 0..args.num_hidden_layers {
        let prefix = format!("model.layers.{layer}.mlp.experts");
        let mut take = |e: usize, p: &str, kind: &str| {
            let k = format!("{prefix}.{e}.{p}.{kind}");
            named
                .remove(&k)
                .ok_or_else(|| candle_core::Error::Msg(format!("no variable `{k}` to save")))
        };
        let mut fused: [Vec<Tensor>; 4] = Default::default();
        for e in 0..moe.num_experts {
            let (gw, uw) = (
                take(e, "gate_proj", "weight")?,
                take(e, "up_proj", "weight")?,
            );
            let (gb, ub) = (take(e, "gate_proj", "bias")?, take(e, "up_proj", "bias")?);
            let (dw, db) = (
                take(e, "down_proj", "weight")?,
                take(e, "down_proj", "bias")?,
            );
            let (inter, h) = gw.dims2()?;
            // [inter, 2, hidden] → rows gate₀, up₀, gate₁, … → [hidden, 2·inter].
            let gate_up = Tensor::stack(&[&gw, &uw], 1)?
                .reshape((2 * inter, h))?
                .t()?;
            fused[0].push(gate_up);
            fused[1].push(Tensor::stack(&[&gb, &ub], 1)?.reshape(2 * inter)?);
            fused[2].push(dw.t()?);
            fused[3].push(db);
        }
        for (which, parts) in GPT_OSS_FUSED.iter().zip(fused) {
            named.insert(
                format!("{prefix}.{which}"),
                Tensor::stack(&parts, 0)?.contiguous()?,
            );
        }
    }
    Ok(())
}

/// The variables of a model built from a checkpoint. A variable the model asks for must be
/// one of `tensors` with the shape asked for; it becomes a trainable variable of `varmap`
/// holding that tensor. Anything else is a problem recorded under the variable's name and
/// answered with a placeholder (the file's tensor, or one element) rather than allocated by
/// the size asked for, so the sizes in a configuration or a GGUF header (layers, widths,
/// vocabulary) can never make the model allocate more than the file holds.
struct CheckpointVars<'a> {
    varmap: &'a VarMap,
    tensors: &'a HashMap<String, Tensor>,
    source: &'a Path,
    /// Missing tensors and shape mismatches, by variable name.
    problems: std::sync::Mutex<BTreeMap<String, ModelError>>,
}

impl CheckpointVars<'_> {
    fn var(
        &self,
        name: &str,
        shape: Option<&[usize]>,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let problem = match self.tensors.get(name) {
            None => ModelError::Missing {
                name: name.to_string(),
                file: self.source.display().to_string(),
            },
            Some(t) if shape.is_some_and(|s| s != t.dims()) => ModelError::Shape {
                name: name.to_string(),
                expected: shape.unwrap_or_default().to_vec(),
                found: t.dims().to_vec(),
            },
            Some(t) => {
                let var = candle_core::Var::from_tensor(&t.to_dtype(dtype)?.to_device(dev)?)?;
                let tensor = var.as_tensor().clone();
                self.varmap
                    .data()
                    .lock()
                    .expect("varmap lock")
                    .insert(name.to_string(), var);
                return Ok(tensor);
            }
        };
        let mut problems = self.problems.lock().expect("problems lock");
        problems.insert(name.to_string(), problem);
        // A header may ask for billions of layers: stop well before that many problems.
        if problems.len() > self.tensors.len() + 64 {
            candle_core::bail!("{}: far more variables than tensors", self.source.display());
        }
        match self.tensors.get(name) {
            Some(t) => Ok(t.clone()),
            None => Tensor::zeros(1, dtype, dev),
        }
    }
}

impl candle_nn::var_builder::SimpleBackend for &CheckpointVars<'_> {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.var(name, Some(s.dims()), dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.var(name, None, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// Token files copied next to saved weights.
const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
];

/// Writes an HF directory: `config.json`, weights (one `model.safetensors`, or shards of at most
/// `shard_bytes` with `model.safetensors.index.json`), `generation_config.json`, and the
/// tokenizer files found in `tokenizer_dir`.
pub fn save_dir(
    varmap: &VarMap,
    args: &ModelArgs,
    dir: &Path,
    eos_token_ids: &[u32],
    tokenizer_dir: Option<&Path>,
    shard_bytes: Option<usize>,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::file(dir, e.to_string()))?;
    let io = |p: &Path, e: std::io::Error| ModelError::file(p, e.to_string());
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        serde_json::to_string_pretty(&args.to_hf()).expect("json"),
    )
    .map_err(|e| io(&cfg, e))?;
    let gen = dir.join("generation_config.json");
    std::fs::write(
        &gen,
        serde_json::to_string_pretty(&serde_json::json!({"eos_token_id": eos_token_ids}))
            .expect("json"),
    )
    .map_err(|e| io(&gen, e))?;
    let data = varmap.data().lock().expect("varmap lock");
    let mut named: BTreeMap<String, Tensor> = data
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    drop(data);
    fuse_gpt_oss_experts(&mut named, args)?;
    fuse_qwen3_vl_moe_experts(&mut named, args)?;
    let named = saved_names(named, args);
    let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
    let mut shards: Vec<Vec<(String, Tensor)>> = vec![Vec::new()];
    let mut size = 0;
    for (k, t) in named {
        if let Some(limit) = shard_bytes {
            if size > 0 && size + bytes(&t) > limit {
                shards.push(Vec::new());
                size = 0;
            }
        }
        size += bytes(&t);
        shards.last_mut().expect("non-empty").push((k, t));
    }
    if shards.len() == 1 {
        let p = dir.join("model.safetensors");
        let map: HashMap<String, Tensor> = shards.pop().expect("one").into_iter().collect();
        super::save_safetensors(&map, &p)?;
    } else {
        let n = shards.len();
        let mut weight_map = serde_json::Map::new();
        let mut total = 0usize;
        for (i, shard) in shards.into_iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            for (k, t) in &shard {
                weight_map.insert(k.clone(), Value::String(name.clone()));
                total += bytes(t);
            }
            let p = dir.join(&name);
            let map: HashMap<String, Tensor> = shard.into_iter().collect();
            super::save_safetensors(&map, &p)?;
        }
        let idx = dir.join("model.safetensors.index.json");
        let v = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(&idx, serde_json::to_string_pretty(&v).expect("json"))
            .map_err(|e| io(&idx, e))?;
    }
    // The modeling code `auto_map` names (MiMo's), for transformers' `trust_remote_code`.
    for (file, text) in &args.remote_code {
        let p = dir.join(file);
        std::fs::write(&p, text).map_err(|e| io(&p, e))?;
    }
    if let Some(src) = tokenizer_dir {
        // With a vision-language model's processor (image preprocessing, its chat template).
        for f in TOKENIZER_FILES
            .iter()
            .chain(&crate::data::tokenizer::PROCESSOR_FILES)
        {
            let from = src.join(f);
            if from.is_file() && src != dir {
                std::fs::copy(&from, dir.join(f)).map_err(|e| io(&from, e))?;
            }
        }
    }
    Ok(())
}
