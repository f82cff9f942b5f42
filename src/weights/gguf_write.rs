//! `.gguf` files written as llama.cpp's converter (`convert_hf_to_gguf.py`, read at
//! llama-cpp-python 0.3.36's vendored copy) writes them, for `main_ppo merge --gguf`: the
//! inverse of [`super::gguf`]'s reading, through the same name table ([`gguf::gguf_name`]) and
//! the same Llama Q/K row permutation ([`gguf::permute`]), serialised by candle's GGUF writer.
//!
//! What the converter does and this writer does alike:
//! - tensors in f32, f16 or bf16 (`--outtype`), but 1-D tensors, norms, biases and MoE routers
//!   in f32 (`general.file_type` says the requested type: 0, 1 or 32);
//! - Llama's q and k rows permuted for llama.cpp's interleaved RoPE; Gemma 3's norms stored as
//!   `1 + w`; a layer's experts stacked per projection (`[experts, out, in]`); a tied LM head
//!   left out (no `output.weight`);
//! - hyper-parameters under `<arch>.*`, the tokenizer under `tokenizer.ggml.*` (a byte-level
//!   BPE as `gpt2`, with its merges, its pre-tokenizer's llama.cpp name and token types; Gemma's
//!   sentencepiece vocabulary as `llama`, with scores), the chat template as
//!   `tokenizer.chat_template`; token ids past the tokenizer up to `vocab_size` as `[PAD<i>]`.
//!
//! Before a byte is written the file's metadata is read back by this program's GGUF reader
//! ([`gguf::read_args`], [`gguf::tokenizer`]): the hyper-parameters must come back as the
//! model's and the tokenizer must encode a set of texts to the same ids, else the model is
//! refused naming what the GGUF layout cannot say (a RoPE base llama.cpp fixes, a pre-tokenizer
//! llama.cpp has no name for, ...), never written as a file that runs differently.

use std::collections::{BTreeMap, HashMap};
use std::io::{Seek, Write};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};
use candle_nn::VarMap;
use serde_json::Value as Json;

use super::gguf;
use crate::data::TokenizerBundle;
use crate::model::{Arch, ModelArgs, ModelError};

/// The tensor types written (the converter's `--outtype f32|f16|bf16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufType {
    F32,
    F16,
    Bf16,
}

impl GgufType {
    /// The names [`GgufType::parse`] accepts, as `--gguf` spells them.
    pub const NAMES: [&'static str; 3] = ["f32", "f16", "bf16"];

    /// `f32`, `f16` or `bf16` (any case); `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(GgufType::F32),
            "f16" => Some(GgufType::F16),
            "bf16" => Some(GgufType::Bf16),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgufType::F32 => "f32",
            GgufType::F16 => "f16",
            GgufType::Bf16 => "bf16",
        }
    }

    fn ggml(self) -> GgmlDType {
        match self {
            GgufType::F32 => GgmlDType::F32,
            GgufType::F16 => GgmlDType::F16,
            GgufType::Bf16 => GgmlDType::BF16,
        }
    }

    /// `general.file_type` (llama.cpp's `LlamaFileType`: `ALL_F32`, `MOSTLY_F16`,
    /// `MOSTLY_BF16`).
    fn file_type(self) -> u32 {
        match self {
            GgufType::F32 => 0,
            GgufType::F16 => 1,
            GgufType::Bf16 => 32,
        }
    }
}

/// A model laid out as a GGUF file: metadata and tensors in the order they are written.
pub struct GgufModel {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<(String, QTensor)>,
}

impl GgufModel {
    /// The header as a reader sees it (tensor offsets left at 0): what [`gguf::read_args`] and
    /// [`gguf::tokenizer`] read.
    fn content(&self) -> Content {
        Content {
            magic: VersionedMagic::GgufV3,
            metadata: self.metadata.iter().cloned().collect(),
            tensor_infos: self
                .tensors
                .iter()
                .map(|(n, t)| {
                    let info = TensorInfo {
                        ggml_dtype: t.dtype(),
                        shape: t.shape().clone(),
                        offset: 0,
                    };
                    (n.clone(), info)
                })
                .collect(),
            tensor_data_offset: 0,
        }
    }

    /// Serialises the file with candle's GGUF writer.
    pub fn write_to<W: Write + Seek>(&self, w: &mut W) -> candle_core::Result<()> {
        let meta: Vec<(&str, &Value)> =
            self.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensors: Vec<(&str, &QTensor)> =
            self.tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        candle_core::quantized::gguf_file::write(w, &meta, &tensors)
    }

    /// Writes the file at `path` (created or truncated) and flushes it to disk.
    pub fn write_file(&self, path: &Path) -> Result<(), ModelError> {
        let io = |e: std::io::Error| ModelError::file(path, e.to_string());
        let file = std::fs::File::create(path).map_err(io)?;
        let mut w = std::io::BufWriter::new(file);
        self.write_to(&mut w)
            .map_err(|e| ModelError::file(path, format!("writing GGUF: {e}")))?;
        let file = w.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)
    }
}

/// The families written, by their `general.architecture`.
const WRITTEN: [Arch; 5] = [
    Arch::Llama,
    Arch::Qwen2,
    Arch::Qwen3,
    Arch::Qwen3Moe,
    Arch::Gemma3,
];

/// `model` (weights under transformers' names, as [`super::merge::Merged`] holds them), its
/// hyper-parameters and tokenizer as a GGUF file of `ty` tensors named `name`; errors name
/// `target`, the file to be written.
pub fn build(
    varmap: &VarMap,
    args: &ModelArgs,
    tokenizer: &TokenizerBundle,
    name: &str,
    ty: GgufType,
    target: &Path,
) -> Result<GgufModel, ModelError> {
    let arch = arch_name(args, target)?;
    check_family(args, arch, target)?;
    let tensors = tensors(varmap, args, ty, target)?;
    let mut metadata = model_metadata(args, arch, name, ty);
    let base = GgufModel {
        metadata: metadata.clone(),
        tensors,
    };
    let Some(vocab) = tokenizer_metadata(&base, args, tokenizer, target)? else {
        return Err(ModelError::file(
            target,
            format!(
                "the tokenizer ({}) splits text before its merges as none of llama.cpp's pre-tokenizers this program reads does ({}): llama.cpp would tokenize differently; write an HF folder (without --gguf) instead",
                tokenizer.source.display(),
                PRE_TOKENIZERS.join(", ")
            ),
        ));
    };
    metadata.extend(vocab);
    metadata.push(("general.quantization_version".into(), Value::U32(2)));
    let model = GgufModel {
        metadata,
        tensors: base.tensors,
    };
    check_args(&model, args, arch, target)?;
    Ok(model)
}

/// llama.cpp's `general.architecture` of a family the writer lays out.
fn arch_name(args: &ModelArgs, target: &Path) -> Result<&'static str, ModelError> {
    let laid_out_elsewhere = match args.arch {
        crate::model::Arch::DeepseekV3 => Some(("deepseek2", "latent attention and experts")),
        crate::model::Arch::Glm4Moe => Some(("glm4moe", "experts")),
        crate::model::Arch::GptOss => Some(("gpt-oss", "experts and attention sinks")),
        crate::model::Arch::Qwen2Moe => Some(("qwen2moe", "experts and shared experts")),
        crate::model::Arch::Gemma2 => Some(("gemma2", "soft-capping settings")),
        _ => None,
    };
    if let Some((name, what)) = laid_out_elsewhere {
        return Err(ModelError::file(
            target,
            format!("a {:?} model (llama.cpp's `{name}`) is not written as GGUF by this program (its {what} are laid out by llama.cpp's converter only): write an HF folder (without --gguf) and convert it with llama.cpp's convert_hf_to_gguf.py", args.arch),
        ));
    }
    let name = gguf::gguf_arch_name(args.arch);
    match name {
        Some(n) if WRITTEN.contains(&args.arch) => Ok(n),
        Some(n) => Err(ModelError::file(
            target,
            format!(
                "a {:?} model (llama.cpp's `{n}`) is not written as GGUF by this program (its Gated DeltaNet layers are laid out by llama.cpp's converter only; GGUF is written for {}): write an HF folder (without --gguf) and convert it with llama.cpp's convert_hf_to_gguf.py",
                args.arch,
                written_names()
            ),
        )),
        None => Err(ModelError::file(
            target,
            format!(
                "llama.cpp has no GGUF architecture for a {:?} model (GGUF is written for {})",
                args.arch,
                written_names()
            ),
        )),
    }
}

fn written_names() -> String {
    WRITTEN
        .iter()
        .filter_map(|a| gguf::gguf_arch_name(*a))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What a family's GGUF layout in llama.cpp cannot hold, refused by name: RoPE scaling but
/// Gemma 3's linear one, an output-projection bias outside Llama, and a Qwen3-MoE model whose
/// layers are not all experts with renormalised top-k weights (llama.cpp's `qwen3moe`).
fn check_family(args: &ModelArgs, arch: &str, target: &Path) -> Result<(), ModelError> {
    let refuse = |what: String| {
        Err(ModelError::file(
            target,
            format!("this model cannot be written as a `{arch}` GGUF file: {what}; write an HF folder (without --gguf) instead"),
        ))
    };
    match (&args.rope_scaling, args.arch) {
        (None, _) | (Some(crate::model::config::RopeScaling::Linear { .. }), Arch::Gemma3) => {}
        (Some(r), _) => {
            return refuse(format!(
                "its RoPE scaling ({r:?}) is not one this program reads from GGUF (Gemma 3's linear scaling is)"
            ))
        }
    }
    if args.o_bias && args.arch != Arch::Llama {
        return refuse(format!(
            "llama.cpp's `{arch}` has no bias on the attention's output projection (attention_bias)"
        ));
    }
    if let Some(m) = &args.moe {
        if !m.mlp_only_layers.is_empty() || m.decoder_sparse_step != 1 {
            return refuse(format!(
                "llama.cpp's `{arch}` has experts on every layer (mlp_only_layers {:?}, decoder_sparse_step {})",
                m.mlp_only_layers, m.decoder_sparse_step
            ));
        }
        if !m.norm_topk_prob {
            return refuse(format!(
                "llama.cpp's `{arch}` renormalises the top-k expert weights (norm_topk_prob is false)"
            ));
        }
    }
    Ok(())
}

/// Where a GGUF tensor goes in the file: the embedding, the layers in order, then the final
/// norm and the LM head (the converter's order).
fn file_order(name: &str) -> (u8, usize, String) {
    if name == "token_embd.weight" {
        return (0, 0, String::new());
    }
    match name
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(n, part)| Some((n.parse::<usize>().ok()?, part)))
    {
        Some((n, part)) => (1, n, part.to_string()),
        None => (2, 0, name.to_string()),
    }
}

/// The model's tensors under GGUF names, in the layout llama.cpp reads (see the module
/// header), each in `ty` or f32.
fn tensors(
    varmap: &VarMap,
    args: &ModelArgs,
    ty: GgufType,
    target: &Path,
) -> Result<Vec<(String, QTensor)>, ModelError> {
    let data = varmap.data().lock().expect("varmap lock");
    let mut out: Vec<(String, Tensor)> = Vec::new();
    // A layer's experts by GGUF name: (expert index, its matrix [out, in]).
    let mut experts: BTreeMap<String, Vec<(usize, Tensor)>> = BTreeMap::new();
    for (hf, var) in data.iter() {
        if hf == "lm_head.weight" && args.tie_word_embeddings {
            continue; // tied: llama.cpp reads the embedding as the LM head
        }
        // An expert's matrix: its index out of the name, `{}` in its place.
        let (pattern, expert) = match expert_index(hf) {
            Some((p, e)) => (p, Some(e)),
            None => (hf.clone(), None),
        };
        let Some(name) = gguf::gguf_name(&pattern, args.arch) else {
            let what = if hf.starts_with("model.") || hf.starts_with("lm_head.") {
                String::new()
            } else {
                " (not part of a language model, such as a critic's value head: llama.cpp runs the LM only)".to_string()
            };
            return Err(ModelError::file(
                target,
                format!(
                    "tensor `{hf}`{what} has no name in llama.cpp's `{}` layout; write an HF folder (without --gguf) instead",
                    gguf::gguf_arch_name(args.arch).unwrap_or("?")
                ),
            ));
        };
        let mut t = var.as_tensor().to_dtype(DType::F32)?;
        // llama.cpp multiplies by Gemma's norm weights as they are: stored as 1 + w.
        if args.arch.gemma() && name.ends_with("norm.weight") {
            t = (t + 1.0)?;
        }
        if args.arch == Arch::Llama {
            // Rows of q `[heads·d, in]` and k `[kv_heads·d, in]` (and their biases) to
            // llama.cpp's interleaved RoPE order.
            if name.contains(".attn_q.") {
                t = gguf::permute(&t, args.num_attention_heads)?;
            } else if name.contains(".attn_k.") {
                t = gguf::permute(&t, args.num_key_value_heads)?;
            }
        }
        match expert {
            Some(e) => experts.entry(name).or_default().push((e, t)),
            None => out.push((name, t)),
        }
    }
    drop(data);
    let want = args.moe.as_ref().map_or(0, |m| m.num_experts);
    for (name, mut list) in experts {
        list.sort_by_key(|(e, _)| *e);
        let found: Vec<usize> = list.iter().map(|(e, _)| *e).collect();
        if found != (0..want).collect::<Vec<_>>() {
            return Err(ModelError::file(
                target,
                format!("`{name}` stacks experts {found:?}; the model has {want} (0..{want})"),
            ));
        }
        let mats: Vec<Tensor> = list.into_iter().map(|(_, t)| t).collect();
        out.push((name, Tensor::stack(&mats, 0)?)); // [experts, out, in]
    }
    out.sort_by_key(|(n, _)| file_order(n));
    out.into_iter()
        .map(|(name, t)| {
            let keep_f32 = t.rank() <= 1
                || name.ends_with("_norm.weight")
                || name.contains(".ffn_gate_inp.")
                || !name.ends_with(".weight");
            let dtype = if keep_f32 { GgmlDType::F32 } else { ty.ggml() };
            let q = QTensor::quantize(&t, dtype)
                .map_err(|e| ModelError::file(target, format!("tensor `{name}`: {e}")))?;
            Ok((name, q))
        })
        .collect()
}

/// `model.layers.N.mlp.experts.E.rest` → (`model.layers.N.mlp.experts.{}.rest`, E).
fn expert_index(hf: &str) -> Option<(String, usize)> {
    let (head, tail) = hf.split_once(".mlp.experts.")?;
    let (e, rest) = tail.split_once('.')?;
    let e = e.parse::<usize>().ok()?;
    Some((format!("{head}.mlp.experts.{{}}.{rest}"), e))
}

/// `general.*` and `<arch>.*`: the hyper-parameters as the converter writes them for the
/// family.
fn model_metadata(args: &ModelArgs, arch: &str, name: &str, ty: GgufType) -> Vec<(String, Value)> {
    let k = |s: &str| format!("{arch}.{s}");
    let u = |x: usize| Value::U32(x as u32);
    let mut m: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name.into())),
        (k("block_count"), u(args.num_hidden_layers)),
        (k("context_length"), u(args.max_position_embeddings)),
        (k("embedding_length"), u(args.hidden_size)),
        (k("feed_forward_length"), u(args.intermediate_size)),
        (k("attention.head_count"), u(args.num_attention_heads)),
        (k("attention.head_count_kv"), u(args.num_key_value_heads)),
        (k("rope.freq_base"), Value::F32(args.rope_theta as f32)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(args.rms_norm_eps as f32),
        ),
        (k("attention.key_length"), u(args.head_dim)),
        (k("attention.value_length"), u(args.head_dim)),
    ];
    if args.arch == Arch::Llama {
        m.push((k("vocab_size"), u(args.vocab_size)));
        m.push((k("rope.dimension_count"), u(args.head_dim)));
    }
    if let Some(m_args) = &args.moe {
        m.push((k("expert_count"), u(m_args.num_experts)));
        m.push((k("expert_used_count"), u(m_args.num_experts_per_tok)));
        m.push((
            k("expert_feed_forward_length"),
            u(m_args.moe_intermediate_size),
        ));
    }
    if args.arch == Arch::Gemma3 {
        if let Some(w) = args.sliding_window {
            m.push((k("attention.sliding_window"), u(w)));
        }
        if let Some(theta) = args.rope_local_theta {
            m.push((k("rope.freq_base_swa"), Value::F32(theta as f32)));
        }
        if let Some(crate::model::config::RopeScaling::Linear { factor }) = args.rope_scaling {
            m.push((k("rope.scaling.type"), Value::String("linear".into())));
            m.push((k("rope.scaling.factor"), Value::F32(factor as f32)));
        }
    }
    m.push(("general.file_type".into(), Value::U32(ty.file_type())));
    m
}

/// The hyper-parameters the file's metadata reads back as must be the model's, its floats as
/// f32 (but what a GGUF never carries: a classification head's labels, the router's auxiliary
/// loss weight); otherwise the fields that differ are named.
fn check_args(
    model: &GgufModel,
    args: &ModelArgs,
    arch: &str,
    target: &Path,
) -> Result<(), ModelError> {
    let mut want = args.clone();
    want.num_labels = None;
    if let Some(m) = want.moe.as_mut() {
        m.router_aux_loss_coef = None;
    }
    // Floats are f32 in the metadata (as the converter writes them), read back as their
    // shortest decimal: an eps saved as 9.999999747378752e-6 is llama.cpp's 1e-5.
    let f32_decimal = |x: f64| (x as f32).to_string().parse::<f64>().unwrap_or(x);
    want.rms_norm_eps = f32_decimal(want.rms_norm_eps);
    want.rope_theta = f32_decimal(want.rope_theta);
    want.rope_local_theta = want.rope_local_theta.map(f32_decimal);
    if let Some(crate::model::config::RopeScaling::Linear { factor }) = want.rope_scaling.as_mut() {
        *factor = f32_decimal(*factor);
    }
    let got = gguf::read_args(&model.content(), target)?;
    if got == want {
        return Ok(());
    }
    let (Ok(Json::Object(g)), Ok(Json::Object(w))) =
        (serde_json::to_value(&got), serde_json::to_value(&want))
    else {
        return Err(ModelError::file(
            target,
            format!(
                "the `{arch}` GGUF metadata reads back as {got:?}, not as the model's {want:?}"
            ),
        ));
    };
    let differ: Vec<String> = w
        .iter()
        .filter(|(key, v)| g.get(*key) != Some(*v))
        .map(|(key, v)| {
            format!(
                "{key} is {v} in the model, {} as llama.cpp's `{arch}` layout reads it",
                g.get(key).unwrap_or(&Json::Null)
            )
        })
        .collect();
    Err(ModelError::file(
        target,
        format!(
            "this model cannot be written as a `{arch}` GGUF file without changing it: {}; write an HF folder (without --gguf) instead",
            differ.join("; ")
        ),
    ))
}

/// llama.cpp's pre-tokenizer names this program reads, tried in this order.
const PRE_TOKENIZERS: [&str; 4] = ["smollm", "qwen2", "qwen35", "gpt-2"];

/// llama.cpp's token types (`gguf.TokenType`).
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// Texts the tokenizer written must encode as the model's own does: digits, contractions,
/// runs of spaces and newlines, scripts with combining marks, emoji, code.
const CHECK_TEXTS: [&str; 7] = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?",
    "  two leading spaces\n\n\ttab, then\r\nCRLF   three spaces  \n \n",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like tea? We'Ve a'lL",
    "3 33 333 3333 33333 1.5 3..3 1,000,000 -7 12:30 2024-05-01 $4.50 50%",
    "ünïcödé Ελληνικά русский 中文测试 日本語 한국어 नमस्ते दुनिया ภาษาไทย 🦙🚀😶‍🌫️ ✅",
    "```python\ndef f(x):\n    return x ** 2  # square\n```\n<tag attr=\"v\">text</tag>",
    "------======= ''''''```````\"\"\"\"......!!!!!!?????? ~~~",
];

/// The ids `tok` gives `text` (no special tokens added).
fn ids(tok: &tokenizers::Tokenizer, text: &str) -> Option<Vec<u32>> {
    tok.encode(text, false).ok().map(|e| e.get_ids().to_vec())
}

/// Every check text, and each added token between two words.
fn check_texts(bundle: &TokenizerBundle) -> Vec<String> {
    let mut texts: Vec<String> = CHECK_TEXTS.iter().map(|s| s.to_string()).collect();
    let mut added: Vec<(u32, String)> = bundle
        .tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(i, t)| (i, t.content))
        .collect();
    added.sort();
    texts.extend(
        added
            .iter()
            .take(64)
            .map(|(_, c)| format!("Hello{c}world {c}\n{c}")),
    );
    texts
}

/// The tokenizer's `tokenizer.ggml.*` metadata and chat template, read back by
/// [`gguf::tokenizer`] with `base`'s metadata and checked against the model's tokenizer;
/// `None` when no pre-tokenizer name reproduces it.
fn tokenizer_metadata(
    base: &GgufModel,
    args: &ModelArgs,
    bundle: &TokenizerBundle,
    target: &Path,
) -> Result<Option<Vec<(String, Value)>>, ModelError> {
    let bad = |m: String| {
        ModelError::file(
            target,
            format!("the tokenizer ({}): {m}", bundle.source.display()),
        )
    };
    let json = serde_json::to_value(&bundle.tokenizer).map_err(|e| bad(e.to_string()))?;
    let model = &json["model"];
    if model["type"] != "BPE" {
        return Err(bad(format!(
            "a {} model; GGUF is written for BPE tokenizers (byte-level, or Gemma's with byte fallback)",
            model["type"]
        )));
    }
    let spm = model["byte_fallback"] == true;
    if spm && args.arch != Arch::Gemma3 {
        return Err(bad(format!(
            "a sentencepiece-style BPE (byte fallback) is written to GGUF for Gemma 3 only, this is a {:?} model; write an HF folder (without --gguf) instead",
            args.arch
        )));
    }
    let (names, types) = vocabulary(bundle, args.vocab_size, spm);
    let mut common: Vec<(String, Value)> = vec![(
        "tokenizer.ggml.tokens".into(),
        Value::Array(names.into_iter().map(Value::String).collect()),
    )];
    if spm {
        common.push(("tokenizer.ggml.scores".into(), scores(&types)));
    }
    common.push((
        "tokenizer.ggml.token_type".into(),
        Value::Array(types.iter().map(|t| Value::I32(*t)).collect()),
    ));
    if !spm {
        let merges = merges(model).map_err(bad)?;
        if !merges.is_empty() {
            common.push((
                "tokenizer.ggml.merges".into(),
                Value::Array(merges.into_iter().map(Value::String).collect()),
            ));
        }
    }
    common.extend(special_metadata(bundle, spm));
    let candidates: &[&str] = if spm { &["default"] } else { &PRE_TOKENIZERS };
    read_back(base, bundle, &common, spm, candidates, target)
}

/// The token list up to `vocab_size` (at least the tokenizer's ids) and llama.cpp's type of
/// each, as the converter types them: added tokens that are special (or look like control
/// tokens) CONTROL, other added tokens USER_DEFINED (sentencepiece's spelled with plain
/// spaces), sentencepiece byte tokens BYTE, ids without a token UNUSED `[PAD<i>]`, the rest
/// NORMAL.
fn vocabulary(bundle: &TokenizerBundle, vocab_size: usize, spm: bool) -> (Vec<String>, Vec<i32>) {
    let vocab = bundle.tokenizer.get_vocab(true);
    let added = bundle.tokenizer.get_added_tokens_decoder();
    let n = vocab_size.max(vocab.values().max().map_or(0, |m| *m as usize + 1));
    let mut tokens: Vec<Option<String>> = vec![None; n];
    for (t, i) in vocab {
        tokens[i as usize] = Some(t);
    }
    tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| match (t, added.get(&(i as u32))) {
            (None, _) => (format!("[PAD{i}]"), UNUSED),
            (Some(t), Some(a)) if a.special || looks_special(&t) => (t, CONTROL),
            (Some(t), Some(_)) if spm => (t.replace('\u{2581}', " "), USER_DEFINED),
            (Some(t), Some(_)) => (t, USER_DEFINED),
            (Some(t), None) if spm && is_byte_token(&t) => (t, BYTE),
            (Some(t), None) => (t, NORMAL),
        })
        .unzip()
}

/// Sentencepiece scores as the converter wrote Gemma 3's: control and user-defined tokens
/// -1000, bytes 0, the others minus their rank among them (what orders llama.cpp's merges).
fn scores(types: &[i32]) -> Value {
    let mut rank = 0.0f32;
    let scores = types
        .iter()
        .map(|t| match *t {
            NORMAL => {
                rank += 1.0;
                Value::F32(1.0 - rank)
            }
            BYTE | UNUSED => Value::F32(0.0),
            _ => Value::F32(-1000.0),
        })
        .collect();
    Value::Array(scores)
}

/// The BOS, EOS, unknown and padding ids, whether BOS and EOS are added, and the chat
/// template.
fn special_metadata(bundle: &TokenizerBundle, spm: bool) -> Vec<(String, Value)> {
    let id = |name: &Option<String>| {
        name.as_ref()
            .and_then(|n| bundle.tokenizer.token_to_id(n))
            .map(Value::U32)
    };
    let eos =
        id(&bundle.special.eos).or_else(|| bundle.eos_token_ids.first().map(|i| Value::U32(*i)));
    let specials = [
        ("tokenizer.ggml.bos_token_id", id(&bundle.special.bos)),
        ("tokenizer.ggml.eos_token_id", eos),
        ("tokenizer.ggml.unknown_token_id", id(&bundle.special.unk)),
        ("tokenizer.ggml.padding_token_id", id(&bundle.special.pad)),
    ];
    let mut out: Vec<(String, Value)> = specials
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
        .collect();
    let (add_bos, add_eos) = match spm {
        // Gemma's tokenizer begins every text with <bos> (what the converter writes for it).
        true => (bundle.special.bos.is_some(), false),
        false => adds_special(bundle),
    };
    out.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(add_bos)));
    out.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(add_eos)));
    if spm {
        out.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)));
    }
    if let Some(t) = &bundle.chat_template {
        out.push(("tokenizer.chat_template".into(), Value::String(t.clone())));
    }
    out
}

/// The tokenizer metadata (`common` with the model and the first of `candidates` as
/// `tokenizer.ggml.pre`) that [`gguf::tokenizer`] reads back as a tokenizer giving the model's
/// ids on every check text; `None` when no candidate does. Every id the model ends generation
/// at must end it in the file too.
fn read_back(
    base: &GgufModel,
    bundle: &TokenizerBundle,
    common: &[(String, Value)],
    spm: bool,
    candidates: &[&str],
    target: &Path,
) -> Result<Option<Vec<(String, Value)>>, ModelError> {
    let texts = check_texts(bundle);
    let want: Vec<Option<Vec<u32>>> = texts.iter().map(|t| ids(&bundle.tokenizer, t)).collect();
    for pre in candidates {
        let mut meta = vec![
            (
                "tokenizer.ggml.model".to_string(),
                Value::String(if spm { "llama" } else { "gpt2" }.into()),
            ),
            ("tokenizer.ggml.pre".into(), Value::String(pre.to_string())),
        ];
        meta.extend(common.iter().cloned());
        let mut probe = base.content();
        probe.metadata.extend(meta.iter().cloned());
        let back = gguf::tokenizer(&probe, target)?;
        let same = texts
            .iter()
            .zip(&want)
            .all(|(t, w)| w.is_some() && ids(&back.tokenizer, t) == *w);
        if !same {
            continue;
        }
        if let Some(lost) = bundle
            .eos_token_ids
            .iter()
            .find(|i| !back.eos_token_ids.contains(i))
        {
            return Err(ModelError::file(
                target,
                format!(
                    "the tokenizer ({}): generation ends at token {lost} ({:?}), which a GGUF file cannot mark as an end of generation (it marks the EOS `tokenizer.ggml.eos_token_id`, and the tokens llama.cpp knows by their spelling)",
                    bundle.source.display(),
                    bundle.tokenizer.id_to_token(*lost)
                ),
            ));
        }
        return Ok(Some(meta));
    }
    Ok(None)
}

/// Whether the converter types an added token CONTROL though it is not marked special
/// (`<|...|>` and the like).
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// A sentencepiece byte token, `<0x00>` … `<0xFF>`.
fn is_byte_token(t: &str) -> bool {
    t.len() == 6
        && t.starts_with("<0x")
        && t.ends_with('>')
        && t[3..5].chars().all(|c| c.is_ascii_hexdigit())
}

/// A BPE model's merges as GGUF writes them, `"left right"`, best first (a space inside a
/// part spelled `U+0120`, as the converter does).
fn merges(model: &Json) -> Result<Vec<String>, String> {
    let Some(list) = model["merges"].as_array() else {
        return Ok(Vec::new());
    };
    let spell = |s: &str| s.replace(' ', "\u{0120}");
    list.iter()
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(p) => match (
                p.first().and_then(Json::as_str),
                p.get(1).and_then(Json::as_str),
            ) {
                (Some(a), Some(b)) if p.len() == 2 => Ok(format!("{} {}", spell(a), spell(b))),
                _ => Err(format!("a merge that is not a pair of strings: {m}")),
            },
            _ => Err(format!("a merge that is not a pair of strings: {m}")),
        })
        .collect()
}

/// Whether encoding a text with special tokens puts the BOS first and the EOS last (the
/// tokenizer's post-processor): `tokenizer.ggml.add_bos_token` and `add_eos_token`.
fn adds_special(bundle: &TokenizerBundle) -> (bool, bool) {
    let Ok(enc) = bundle.tokenizer.encode("Hello", true) else {
        return (false, false);
    };
    let idof = |n: &Option<String>| n.as_ref().and_then(|n| bundle.tokenizer.token_to_id(n));
    let ids = enc.get_ids();
    let bos = idof(&bundle.special.bos).is_some_and(|b| ids.first() == Some(&b));
    let eos = idof(&bundle.special.eos).is_some_and(|e| ids.len() > 1 && ids.last() == Some(&e));
    (bos, eos)
}

/// Counts for a summary line: tensors by GGUF type.
pub fn type_counts(model: &GgufModel) -> String {
    let mut by: HashMap<String, usize> = HashMap::new();
    for (_, t) in &model.tensors {
        *by.entry(format!("{:?}", t.dtype())).or_default() += 1;
    }
    let mut v: Vec<(String, usize)> = by.into_iter().collect();
    v.sort();
    v.into_iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect::<Vec<_>>()
        .join(", ")
}
