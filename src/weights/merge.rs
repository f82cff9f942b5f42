//! `main_ppo merge` (verl's `model_merger merge`): a checkpoint, a LoRA adapter folder or a
//! whole model, written as one HF model directory that this program and HF transformers load.
//!
//! Adapters are read and attached as training and `generate` attach them
//! ([`peft::read_adapter`], [`peft::attach`], [`peft::assign_adapter`]; the adapter's own
//! `adapter_config.json` sets rank, alpha and targets) on the base model loaded in f32, and
//! folded into the weights they adapt, `W + s·B·A` (the projection merge of
//! [`crate::model::CausalLm::merged`]); the result is written by [`hf::save_dir`], the writer
//! of full checkpoints, so a merged LoRA checkpoint has a full checkpoint's layout, or as one
//! GGUF file for llama.cpp ([`save_gguf`], [`super::gguf_write`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use serde_json::Value;

use super::gguf_write::{self, GgufType};
use super::{hf, peft};
use crate::data::TokenizerBundle;
use crate::model::{ModelArgs, ModelError};

/// Weights are written in shards of at most this many bytes (`save_pretrained`'s 5 GB).
const SHARD_BYTES: usize = 5_000_000_000;

/// What is merged, as [`resolve`] found it.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// A base model with an adapter folder on it.
    Lora {
        /// The adapter folder (`adapter_config.json`, `adapter_model.safetensors`).
        adapter: PathBuf,
        /// The base model as a model path (an HF folder, a `.gguf` file or a hub id).
        base: String,
        /// Where `base` came from: `--base`, or the adapter's `base_model_name_or_path`.
        base_from: String,
        /// A LoRA checkpoint's `huggingface/`: the config and tokenizer training ran with
        /// (its config is laid over the base's, as `override_config` was).
        checkpoint: Option<PathBuf>,
        /// A critic's adapters: the backbone without an LM head, and the value head saved
        /// whole beside the adapters (PEFT's `modules_to_save`).
        critic: bool,
    },
    /// A whole model, written again (as an HF model or a GGUF file): an HF folder (a full checkpoint's
    /// `huggingface/`) or a `.gguf` file.
    Model { path: PathBuf, critic: bool },
}

fn is_adapter(dir: &Path) -> bool {
    dir.join("adapter_config.json").is_file()
}

/// A checkpoint role folder (the one holding `huggingface/` and `lora_adapter/`) named `critic`.
fn is_critic(role: Option<&Path>) -> bool {
    role.and_then(Path::file_name)
        .is_some_and(|n| n == std::ffi::OsStr::new("critic"))
}

/// Why [`resolve`] refused: the flag to change (`--local_dir` or `--base`) and the problem.
#[derive(Debug)]
pub struct Refused {
    pub flag: &'static str,
    pub error: ModelError,
}

impl From<ModelError> for Refused {
    fn from(error: ModelError) -> Self {
        Refused {
            flag: "--local_dir",
            error,
        }
    }
}

/// What `local_dir` holds: a checkpoint's `global_step_N/` (its actor), its `actor/` or
/// `critic/` folder, that folder's `huggingface/` or `lora_adapter/`, a LoRA adapter folder, an
/// HF model folder or a `.gguf` file. An adapter's base model is `base` when given (`--base`),
/// else its `adapter_config.json`'s `base_model_name_or_path`; none, or one that is neither a
/// local path nor a hub id, is an error saying to pass `--base`.
pub fn resolve(local_dir: &Path, base: Option<&str>) -> Result<Source, Refused> {
    let bad = |m: String| ModelError::file(local_dir, m);
    if !local_dir.exists() {
        return Err(bad("does not exist".into()).into());
    }
    if local_dir.is_file() {
        if local_dir.extension().is_some_and(|e| e == "gguf") {
            return Ok(Source::Model {
                path: local_dir.to_path_buf(),
                critic: false,
            });
        }
        return Err(bad("a file: expected a checkpoint folder (global_step_N/, or its actor/ or critic/), a LoRA adapter folder, an HF model folder or a .gguf file".into()).into());
    }
    // A checkpoint's `global_step_N/`: its actor, as verl's merger is given `.../actor`.
    let step = local_dir.join("actor");
    let dir = if step.is_dir() && !local_dir.join("config.json").is_file() && !is_adapter(local_dir)
    {
        step
    } else {
        local_dir.to_path_buf()
    };
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
    let with_config = |d: PathBuf| d.join("config.json").is_file().then_some(d);
    // (adapter folder, the checkpoint's huggingface/, the role folder holding both)
    let lora: Option<(PathBuf, Option<PathBuf>, Option<&Path>)> =
        if is_adapter(&dir.join("lora_adapter")) {
            Some((
                dir.join("lora_adapter"),
                with_config(dir.join("huggingface")),
                Some(&dir),
            ))
        } else if is_adapter(&dir) {
            let ckpt = parent
                .filter(|_| dir.file_name().is_some_and(|n| n == "lora_adapter"))
                .and_then(|p| with_config(p.join("huggingface")));
            let role = ckpt.as_ref().and(parent);
            Some((dir.clone(), ckpt, role))
        } else if !hf::has_weights(&dir)
            && parent.is_some_and(|p| is_adapter(&p.join("lora_adapter")))
        {
            let p = parent.expect("checked");
            Some((p.join("lora_adapter"), with_config(dir.clone()), Some(p)))
        } else {
            None
        };
    let Some((adapter, checkpoint, role)) = lora else {
        return Ok(whole_model(&dir, &bad)?);
    };
    // The adapter's settings first: a broken adapter_config.json is what to fix, not the base
    // it may fail to name.
    peft::read_adapter_config(&adapter)?;
    let (base, base_from) = match (base, peft::adapter_base(&adapter)) {
        (Some(b), _) => (b.to_string(), "--base".to_string()),
        (None, Some(b)) => (
            b,
            format!(
                "base_model_name_or_path of {}",
                adapter.join("adapter_config.json").display()
            ),
        ),
        (None, None) => {
            return Err(Refused {
                flag: "--base",
                error: ModelError::file(
                    &adapter,
                    "a LoRA adapter whose adapter_config.json names no base model (base_model_name_or_path): give the model it was trained on with --base <model path>".into(),
                ),
            })
        }
    };
    let local = PathBuf::from(crate::util::expand_home(&base));
    if !local.exists() && !super::is_hub_id(&base) {
        return Err(Refused {
            flag: "--base",
            error: ModelError::file(
                &local,
                format!("the base model ({base_from}) does not exist: give the model the adapter was trained on with --base <model path>"),
            ),
        });
    }
    let critic = is_critic(role) || adapter_task(&adapter).as_deref() == Some("TOKEN_CLS");
    Ok(Source::Lora {
        adapter,
        base,
        base_from,
        checkpoint,
        critic,
    })
}

/// [`resolve`] of a folder without adapters: a full checkpoint's role folder (its
/// `huggingface/`) or an HF model folder.
fn whole_model(dir: &Path, bad: &dyn Fn(String) -> ModelError) -> Result<Source, ModelError> {
    let (path, role) = if dir.join("huggingface/config.json").is_file() {
        (dir.join("huggingface"), Some(dir))
    } else if dir.join("config.json").is_file() {
        let in_checkpoint = dir.file_name().is_some_and(|n| n == "huggingface");
        (dir.to_path_buf(), dir.parent().filter(|_| in_checkpoint))
    } else {
        return Err(bad("neither a checkpoint (global_step_N/, or its actor/ or critic/), a LoRA adapter folder (adapter_config.json) nor an HF model folder (config.json)".into()));
    };
    if !hf::has_weights(&path) {
        return Err(bad(format!(
            "{} has a config.json but no model.safetensors or model.safetensors.index.json",
            path.display()
        )));
    }
    Ok(Source::Model {
        critic: is_critic(role),
        path,
    })
}

/// PEFT's `task_type` of the adapter folder `dir` (`CAUSAL_LM`, `TOKEN_CLS`), when recorded.
fn adapter_task(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("adapter_config.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v.get("task_type")
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// A merged model, ready for [`save`].
pub struct Merged {
    /// The weights under HF names (adapted projections folded, heads added).
    pub varmap: VarMap,
    pub args: ModelArgs,
    pub tokenizer: TokenizerBundle,
    /// A folder whose tokenizer files are copied as they are; without one the tokenizer is
    /// written from [`Merged::tokenizer`] (a GGUF base's).
    pub tokenizer_dir: Option<PathBuf>,
    /// What was merged, in a sentence.
    pub summary: String,
    /// The number of projections whose adapters were folded in (0 for a whole model).
    pub projections: usize,
}

/// Builds the merged model `source` describes, in f32 on the CPU.
pub fn merge(source: &Source) -> Result<Merged, ModelError> {
    match source {
        Source::Lora {
            adapter,
            base,
            base_from,
            checkpoint,
            critic,
        } => merge_lora(adapter, base, base_from, checkpoint.as_deref(), *critic),
        Source::Model { path, critic } => copy_model(path, *critic),
    }
}

/// A local model folder with a tokenizer (its files are then copied as they are).
fn tokenizer_folder(path: &Path) -> Option<PathBuf> {
    (path.is_dir() && path.join("tokenizer.json").is_file()).then(|| path.to_path_buf())
}

fn merge_lora(
    adapter: &Path,
    base: &str,
    base_from: &str,
    checkpoint: Option<&Path>,
    critic: bool,
) -> Result<Merged, ModelError> {
    let file = peft::read_adapter(adapter)?;
    // The config training ran with (the base's, with `override_config` applied).
    let overrides = match checkpoint {
        Some(c) => match hf::read_config_json(c)? {
            Value::Object(m) => m,
            _ => {
                return Err(ModelError::file(
                    &c.join("config.json"),
                    "not a JSON object".into(),
                ))
            }
        },
        None => serde_json::Map::new(),
    };
    let tok_dir = checkpoint.and_then(tokenizer_folder);
    let tok_arg = tok_dir.as_ref().map(|d| d.display().to_string());
    let (mut loaded, tokenizer) = super::load_model_and_tokenizer(
        base,
        tok_arg.as_deref(),
        &overrides,
        DType::F32,
        &Device::Cpu,
        !critic,
    )
    .map_err(|e| ModelError::File {
        file: base.to_string(),
        message: format!("the base model ({base_from}): {e}"),
    })?;
    let key = adapter.join("adapter_config.json").display().to_string();
    let adapters = VarMap::new();
    let adapted = peft::attach(&mut loaded.model, &file.spec, &adapters, 0, &key)?;
    peft::assign_adapter(&adapters, &file.tensors, adapter)?;
    let varmap = fold_adapters(&mut loaded, adapter)?;
    let heads = saved_heads(&file.tensors, &varmap, critic, adapter)?;
    let spec = &file.spec;
    let summary = format!(
        "LoRA adapter {} (rank {}, alpha {}{}, {} projections{}) merged into the base model {base} ({base_from})",
        adapter.display(),
        spec.rank,
        spec.alpha,
        if spec.use_rslora { ", rsLoRA" } else { "" },
        adapted.len(),
        if heads.is_empty() {
            String::new()
        } else {
            format!(", value head {}", heads.join(", "))
        }
    );
    let local = PathBuf::from(crate::util::expand_home(base));
    Ok(Merged {
        args: loaded.model.args.clone(),
        varmap,
        tokenizer,
        tokenizer_dir: tok_dir.or_else(|| tokenizer_folder(&local)),
        summary,
        projections: adapted.len(),
    })
}

/// The model's variables with every adapted projection's weight replaced by `W + s·B·A`
/// (new tensors; the rest shares the loaded storage).
fn fold_adapters(loaded: &mut hf::Loaded, adapter: &Path) -> Result<VarMap, ModelError> {
    let out = VarMap::new();
    let mut data = out.data().lock().expect("varmap lock");
    for (k, v) in loaded.varmap.data().lock().expect("varmap lock").iter() {
        data.insert(k.clone(), v.clone());
    }
    for (i, block) in loaded.model.blocks_mut().iter_mut().enumerate() {
        for (name, p) in block.projs_mut() {
            if p.lora.is_none() {
                continue;
            }
            let weight = format!("model.layers.{i}.{name}.weight");
            if !data.contains_key(&weight) {
                return Err(ModelError::file(
                    adapter,
                    format!("the adapted projection has no variable `{weight}` to fold into"),
                ));
            }
            let merged = candle_core::Var::from_tensor(&p.merged_weight()?)?;
            data.insert(weight, merged);
        }
    }
    drop(data);
    Ok(out)
}

/// Adds a critic's value head, saved whole beside its adapters (`base_model.model.score.*`,
/// PEFT's `modules_to_save`), to `varmap`; returns the head tensors' names. A critic's adapter
/// folder without one is an error. An actor's adapter file may hold whole modules too (PEFT's
/// `modules_to_save = ["lm_head"]`): training and `generate` do not read them, so neither does
/// the merge, which says so.
fn saved_heads(
    tensors: &std::collections::HashMap<String, Tensor>,
    varmap: &VarMap,
    critic: bool,
    adapter: &Path,
) -> Result<Vec<String>, ModelError> {
    let whole: BTreeMap<&str, &Tensor> = tensors
        .iter()
        .filter(|(k, _)| !k.contains(".lora_A.") && !k.contains(".lora_B."))
        .filter_map(|(k, t)| k.strip_prefix("base_model.model.").map(|n| (n, t)))
        .collect();
    let is_backbone = |n: &str| n.starts_with("model.") || n.starts_with("lm_head.");
    if !critic {
        if !whole.is_empty() {
            let names: Vec<&str> = whole.keys().copied().collect();
            tracing::warn!(
                "{}: {} tensor(s) saved whole beside the adapters ({}) are not merged: training and generate do not read them either",
                adapter.display(),
                names.len(),
                names.join(", ")
            );
        }
        return Ok(Vec::new());
    }
    let mut data = varmap.data().lock().expect("varmap lock");
    let mut heads = Vec::new();
    for (name, t) in whole.into_iter().filter(|(n, _)| !is_backbone(n)) {
        let t = t.to_dtype(DType::F32)?;
        data.insert(name.to_string(), candle_core::Var::from_tensor(&t)?);
        heads.push(name.to_string());
    }
    if heads.is_empty() {
        return Err(ModelError::file(
            adapter,
            "a critic's adapters without its value head (base_model.model.score.* in adapter_model.safetensors): nothing to merge it with".into(),
        ));
    }
    Ok(heads)
}

/// A whole model loaded (and so checked) as training loads it and written back as an HF
/// model; a critic's value head comes along.
fn copy_model(path: &Path, critic: bool) -> Result<Merged, ModelError> {
    let shown = path.display().to_string();
    let (loaded, tokenizer) = super::load_model_and_tokenizer(
        &shown,
        None,
        &serde_json::Map::new(),
        DType::F32,
        &Device::Cpu,
        !critic,
    )?;
    let mut heads = Vec::new();
    if critic {
        let mut data = loaded.varmap.data().lock().expect("varmap lock");
        for (name, t) in hf::read_weights(path)? {
            if !name.starts_with("model.") && !name.starts_with("lm_head.") {
                let t = t.to_dtype(DType::F32)?;
                data.insert(name.clone(), candle_core::Var::from_tensor(&t)?);
                heads.push(name);
            }
        }
        heads.sort();
    }
    let tensors = loaded.varmap.data().lock().expect("varmap lock").len();
    let summary = format!(
        "the whole model {shown} ({tensors} tensors{})",
        if heads.is_empty() {
            String::new()
        } else {
            format!(", value head {}", heads.join(", "))
        }
    );
    Ok(Merged {
        args: loaded.model.args.clone(),
        varmap: loaded.varmap,
        tokenizer,
        tokenizer_dir: tokenizer_folder(path),
        summary,
        projections: 0,
    })
}

/// Writes `merged` into `dir` as an HF model folder: `config.json`, `model.safetensors` (or
/// shards with their index), `generation_config.json` and the tokenizer files.
pub fn save(merged: &Merged, dir: &Path) -> Result<(), ModelError> {
    hf::save_dir(
        &merged.varmap,
        &merged.args,
        dir,
        &merged.tokenizer.eos_token_ids,
        merged.tokenizer_dir.as_deref(),
        Some(SHARD_BYTES),
    )?;
    if merged.tokenizer_dir.is_none() {
        merged
            .tokenizer
            .save(dir)
            .map_err(|e| ModelError::file(dir, e.to_string()))?;
    }
    Ok(())
}

/// Writes `merged` as one GGUF file of `ty` tensors at `file` (llama.cpp's layout, checked by
/// reading its metadata back before a byte is written: [`gguf_write::build`]); `name` is its
/// `general.name`, `target` the file errors name (where `file` will be renamed to). Returns
/// the tensors by type, for the summary.
pub fn save_gguf(
    merged: &Merged,
    ty: GgufType,
    name: &str,
    file: &Path,
    target: &Path,
) -> Result<String, ModelError> {
    let model = gguf_write::build(
        &merged.varmap,
        &merged.args,
        &merged.tokenizer,
        name,
        ty,
        target,
    )?;
    model.write_file(file)?;
    Ok(gguf_write::type_counts(&model))
}
