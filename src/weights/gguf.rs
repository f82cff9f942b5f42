//! `.gguf` files (llama.cpp): hyper-parameters from the metadata, tensors dequantised to the
//! working dtype (any type candle reads: F32, F16, BF16, Q4_0, Q4_1, Q5_*, Q8_0, K-quants), Q/K
//! rows un-permuted for the Llama layout, a Qwen3-MoE layer's stacked experts
//! (`ffn_{gate,up,down}_exps`, `[experts, out, in]`, or gate and up in one `ffn_gate_up_exps`)
//! split into the hub's per-expert tensors, and
//! the tokenizer and chat template rebuilt from the `tokenizer.ggml.*` metadata.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::gguf_hybrid;
use super::hf::{build, Loaded};
use crate::data::{SpecialTokens, TokenizerBundle};
use crate::model::config::{LayerKind, LinearAttnArgs, MoeArgs, RopeScaling};
use crate::model::{Arch, ModelArgs, ModelError};

fn meta<'a>(c: &'a Content, key: &str, path: &Path) -> Result<&'a Value, ModelError> {
    c.metadata
        .get(key)
        .ok_or_else(|| ModelError::file(path, format!("GGUF metadata has no `{key}`")))
}

fn meta_u(c: &Content, key: &str, path: &Path) -> Result<usize, ModelError> {
    let v = meta(c, key, path)?;
    v.to_u64()
        .map(|x| x as usize)
        .or_else(|_| v.to_u32().map(|x| x as usize))
        .map_err(|e| ModelError::file(path, format!("`{key}`: {e}")))
}

/// A float from the metadata; f32 values are read as their shortest decimal (1e-6, not
/// 9.99999997e-7), which is what the HF config they came from said.
fn meta_f(c: &Content, key: &str) -> Option<f64> {
    let v = c.metadata.get(key)?;
    v.to_f32()
        .ok()
        .and_then(|x| x.to_string().parse().ok())
        .or_else(|| v.to_f64().ok())
}

pub(crate) fn open(path: &Path) -> Result<(File, Content), ModelError> {
    let mut f = File::open(path).map_err(|e| ModelError::file(path, e.to_string()))?;
    // candle divides by `general.alignment` without checking it: refuse 0 before it reads.
    let file_len = f
        .metadata()
        .map_err(|e| ModelError::file(path, e.to_string()))?
        .len();
    // candle allocates by the header's length fields and divides by `general.alignment`
    // without checking them: refuse what would abort or panic before it reads.
    match scan_header(&mut std::io::BufReader::new(&mut f), file_len) {
        Ok(Some(0)) => {
            return Err(ModelError::file(
                path,
                "not a readable GGUF file: `general.alignment` is 0".into(),
            ))
        }
        Err(Stop::Bad(why)) => {
            return Err(ModelError::file(
                path,
                format!("not a readable GGUF file: {why}"),
            ))
        }
        _ => {}
    }
    std::io::Seek::rewind(&mut f).map_err(|e| ModelError::file(path, e.to_string()))?;
    let c = Content::read(&mut f)
        .map_err(|e| ModelError::file(path, format!("not a readable GGUF file: {e}")))?;
    // Each tensor's element count must not overflow and its bytes must lie inside the file
    // (candle multiplies the dimensions unchecked when it reads a tensor).
    for (name, info) in &c.tensor_infos {
        let elems = info
            .shape
            .dims()
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(*d as u64));
        let block = info.ggml_dtype.block_size() as u64;
        let bytes = elems
            .filter(|e| block > 0 && e % block == 0)
            .and_then(|e| (e / block).checked_mul(info.ggml_dtype.type_size() as u64));
        let end = bytes
            .and_then(|b| b.checked_add(info.offset))
            .and_then(|b| b.checked_add(c.tensor_data_offset));
        // A tensor without elements is never written by llama.cpp, and candle's reader builds
        // a typed slice from its empty buffer, which panics on the dangling pointer's alignment.
        if elems == Some(0) {
            return Err(ModelError::file(
                path,
                format!(
                    "not a readable GGUF file: tensor `{name}` has no elements (shape {:?})",
                    info.shape.dims()
                ),
            ));
        }
        if end.is_none_or(|end| end > file_len) {
            return Err(ModelError::file(
                path,
                format!(
                    "not a readable GGUF file: tensor `{name}` (shape {:?}, {:?}) does not fit in the file ({file_len} bytes)",
                    info.shape.dims(),
                    info.ggml_dtype
                ),
            ));
        }
    }
    Ok((f, c))
}

/// Why a header walk stopped early.
enum Stop {
    /// The header ends before the walk does: candle's reader reports it.
    Short,
    /// A length that cannot fit in the file (candle would try to allocate it and abort).
    Bad(String),
}

/// Walks a GGUF header (metadata and tensor infos) as candle's reader will, checking every
/// length field against the file size before candle allocates by it; returns the integer value
/// of `general.alignment` when the header declares one.
fn scan_header(r: &mut impl std::io::Read, file_len: u64) -> Result<Option<u64>, Stop> {
    fn bytes<const N: usize>(r: &mut impl std::io::Read) -> Result<[u8; N], Stop> {
        let mut b = [0u8; N];
        r.read_exact(&mut b).map_err(|_| Stop::Short)?;
        Ok(b)
    }
    fn u32_(r: &mut impl std::io::Read) -> Result<u32, Stop> {
        bytes::<4>(r).map(u32::from_le_bytes)
    }
    /// A count or byte length, which can never exceed the file's size.
    fn len(r: &mut impl std::io::Read, v1: bool, file_len: u64, what: &str) -> Result<u64, Stop> {
        let n = if v1 {
            u64::from(u32_(r)?)
        } else {
            u64::from_le_bytes(bytes::<8>(r)?)
        };
        if n > file_len {
            return Err(Stop::Bad(format!(
                "{what} is {n}, more than the file's {file_len} bytes"
            )));
        }
        Ok(n)
    }
    fn skip(r: &mut impl std::io::Read, n: u64) -> Result<(), Stop> {
        let copied = std::io::copy(&mut std::io::Read::take(&mut *r, n), &mut std::io::sink())
            .map_err(|_| Stop::Short)?;
        if copied == n {
            Ok(())
        } else {
            Err(Stop::Short)
        }
    }
    /// Skips one value of type `t`, or returns it when it is an integer.
    fn value(
        r: &mut impl std::io::Read,
        t: u32,
        v1: bool,
        file_len: u64,
        depth: usize,
    ) -> Result<Option<i128>, Stop> {
        Ok(match t {
            0 => Some(i128::from(bytes::<1>(r)?[0])),
            1 => Some(i128::from(bytes::<1>(r)?[0] as i8)),
            2 => Some(i128::from(u16::from_le_bytes(bytes::<2>(r)?))),
            3 => Some(i128::from(i16::from_le_bytes(bytes::<2>(r)?))),
            4 => Some(i128::from(u32_(r)?)),
            5 => Some(i128::from(u32_(r)? as i32)),
            6 => skip(r, 4).map(|_| None)?,
            7 => skip(r, 1).map(|_| None)?,
            8 => {
                let n = len(r, v1, file_len, "a string's length")?;
                skip(r, n).map(|_| None)?
            }
            9 if depth < 4 => {
                let inner = u32_(r)?;
                let n = len(r, v1, file_len, "an array's length")?;
                for _ in 0..n {
                    value(r, inner, v1, file_len, depth + 1)?;
                }
                None
            }
            10..=12 => skip(r, 8).map(|_| None)?,
            _ => return Err(Stop::Short),
        })
    }
    let magic = u32_(r)?;
    if magic != 0x4655_4747 && magic != 0x4747_5546 {
        return Err(Stop::Short);
    }
    let v1 = u32_(r)? == 1;
    let tensors = len(r, v1, file_len, "the tensor count")?;
    let kvs = len(r, v1, file_len, "the metadata count")?;
    let mut alignment = None;
    for _ in 0..kvs {
        let n = len(r, v1, file_len, "a metadata key's length")?;
        let mut key = vec![0u8; n as usize];
        r.read_exact(&mut key).map_err(|_| Stop::Short)?;
        let t = u32_(r)?;
        let v = value(r, t, v1, file_len, 0)?;
        if key == b"general.alignment" {
            // candle uses the value of these integer types (signed ones when >= 0).
            alignment = v.filter(|x| *x >= 0).map(|x| x as u64);
        }
    }
    for _ in 0..tensors {
        let n = len(r, v1, file_len, "a tensor name's length")?;
        skip(r, n)?;
        let dims = u32_(r)?;
        if dims > 8 {
            return Err(Stop::Bad(format!("a tensor has {dims} dimensions")));
        }
        for _ in 0..dims {
            len(r, v1, file_len, "a tensor dimension")?;
        }
        skip(r, 4 + 8)?; // dtype, offset
    }
    Ok(alignment)
}

/// llama.cpp's `general.architecture` for each family it writes (Mistral is written as
/// `llama`).
const GGUF_ARCHS: [(&str, Arch); 8] = [
    ("llama", Arch::Llama),
    ("qwen2", Arch::Qwen2),
    ("qwen3", Arch::Qwen3),
    ("qwen3moe", Arch::Qwen3Moe),
    ("gemma3", Arch::Gemma3),
    ("qwen35", Arch::Qwen3_5),
    ("qwen35moe", Arch::Qwen3_5Moe),
    ("qwen3next", Arch::Qwen3Next),
];

/// llama.cpp's architectures whose files this reader refuses although the family loads from its
/// HF folder: `deepseek2` (DeepSeek-V2/V3, Kimi-K2, Moonlight), where llama.cpp stores latent
/// attention its own way (`kv_b_proj` split into per-head `attn_k_b`/`attn_v_b`, rope values
/// permuted), `glm4moe` (GLM-4.5), `gpt-oss` (its experts in MXFP4) and `qwen2moe`, which
/// stack their experts per layer (`ffn_*_exps`), mostly quantised, which this reader does not
/// undo; and `gemma2`, whose soft-capping this reader does not read.
const HF_ONLY: [(&str, &str); 5] = [
    (
        "deepseek2",
        "DeepSeek-V2/V3, Kimi-K2, Moonlight as llama.cpp writes them; DeepseekV3ForCausalLM",
    ),
    (
        "glm4moe",
        "GLM-4.5 as llama.cpp writes it; Glm4MoeForCausalLM",
    ),
    (
        "gpt-oss",
        "gpt-oss as llama.cpp writes it; GptOssForCausalLM, in bf16",
    ),
    (
        "qwen2moe",
        "Qwen1.5-MoE / Qwen2-MoE as llama.cpp writes them; Qwen2MoeForCausalLM",
    ),
    (
        "gemma2",
        "Gemma 2 as llama.cpp writes it; Gemma2ForCausalLM",
    ),
];

/// Why a GGUF file of an [`HF_ONLY`] architecture is not read, `None` for the others.
pub fn hf_only_refusal(arch_name: &str) -> Option<String> {
    let (name, what) = HF_ONLY.iter().find(|(n, _)| *n == arch_name)?;
    Some(format!("GGUF architecture `{name}` ({what}) is not read here: load the model's HF folder (config.json + safetensors) instead"))
}

/// The `general.architecture` llama.cpp writes for `arch`.
pub fn gguf_arch_name(arch: Arch) -> Option<&'static str> {
    GGUF_ARCHS.iter().find(|(_, a)| *a == arch).map(|(n, _)| *n)
}

/// Hyper-parameters from the metadata (`general.architecture` = llama, qwen2, qwen3, qwen3moe,
/// gemma3, qwen35, qwen35moe or qwen3next).
pub fn read_args(c: &Content, path: &Path) -> Result<ModelArgs, ModelError> {
    let arch_name = meta(c, "general.architecture", path)?
        .to_string()
        .map_err(|e| ModelError::file(path, e.to_string()))?
        .clone();
    if let Some(why) = hf_only_refusal(&arch_name) {
        return Err(ModelError::file(path, why));
    }
    let Some(&(_, arch)) = GGUF_ARCHS.iter().find(|(n, _)| *n == arch_name) else {
        let names: Vec<&str> = GGUF_ARCHS.iter().map(|(n, _)| *n).collect();
        return Err(ModelError::file(
            path,
            format!(
                "unsupported GGUF architecture `{arch_name}`; supported: {}",
                names.join(", ")
            ),
        ));
    };
    let k = |s: &str| format!("{arch_name}.{s}");
    let hidden = meta_u(c, &k("embedding_length"), path)?;
    let heads = meta_u(c, &k("attention.head_count"), path)?;
    let kv = meta_u(c, &k("attention.head_count_kv"), path).unwrap_or(heads);
    if hidden == 0 || heads == 0 || kv == 0 || heads % kv != 0 {
        return Err(ModelError::file(
            path,
            format!(
                "GGUF metadata: `{}` ({heads}) must be a positive multiple of `{}` ({kv}) and `{}` ({hidden}) positive",
                k("attention.head_count"),
                k("attention.head_count_kv"),
                k("embedding_length")
            ),
        ));
    }
    let vocab = match c.metadata.get(&k("vocab_size")) {
        Some(_) => meta_u(c, &k("vocab_size"), path)?,
        None => meta(c, "tokenizer.ggml.tokens", path)?
            .to_vec()
            .map_err(|e| ModelError::file(path, e.to_string()))?
            .len(),
    };
    let tied = !c.tensor_infos.contains_key("output.weight");
    let rope_scaling = rope_scaling(c, arch, &arch_name, path)?;
    if c.tensor_infos.contains_key("rope_freqs.weight") {
        return Err(ModelError::file(
            path,
            "tensor `rope_freqs.weight` (RoPE frequency scaling, Llama 3.1+) is not supported in GGUF files; load the HF directory instead (its rope_scaling/rope_parameters llama3 entry is supported)".into(),
        ));
    }
    let head_dim = meta_u(c, &k("attention.key_length"), path).unwrap_or(hidden / heads);
    let layers = model_layers(c, &arch_name, arch, path)?;
    // Gemma 3 as llama.cpp runs it: every sixth layer global, the others a sliding window with
    // plain RoPE at base 10000, scores scaled by head_dim^-½ (hidden/heads for the 62-layer
    // 27B).
    let (sliding_window, layer_types, rope_local_theta, query_pre_attn_scalar) =
        match arch == Arch::Gemma3 {
            true => gemma_layers(
                c,
                &k("attention.sliding_window"),
                path,
                (layers, hidden / heads, head_dim),
            )?,
            false => (None, Vec::new(), None, None),
        };
    let (layer_types, rotary_dim, linear_attn) = match arch.hybrid() {
        true => hybrid_parts(c, &arch_name, arch, (layers, head_dim), path)?,
        false => (layer_types, None, None),
    };
    Ok(ModelArgs {
        arch,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: meta_u(c, &k("feed_forward_length"), path)?,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        head_dim,
        rms_norm_eps: meta_f(c, &k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
        rope_theta: meta_f(c, &k("rope.freq_base")).unwrap_or(10000.0),
        rope_scaling,
        tie_word_embeddings: tied,
        qkv_bias: arch == Arch::Qwen2 || c.tensor_infos.contains_key("blk.0.attn_q.bias"),
        o_bias: c.tensor_infos.contains_key("blk.0.attn_output.bias"),
        max_position_embeddings: meta_u(c, &k("context_length"), path).unwrap_or(4096),
        num_labels: None,
        query_pre_attn_scalar,
        sliding_window,
        layer_types,
        rope_local_theta,
        moe: match arch {
            Arch::Qwen3Moe | Arch::Qwen3_5Moe | Arch::Qwen3Next => {
                Some(read_moe(c, path, &arch_name, layers)?)
            }
            _ => None,
        },
        rotary_dim,
        attn_output_gate: arch.hybrid(),
        linear_attn,
        mtp_layers: 0,
        attention_dropout: 0.0,
        residual_dropout: 0.0,
        mla: None,
        auto_map: None,
        remote_code: Default::default(),
        use_qk_norm: false,
        trailing_mtp_layers: 0,
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
        mrope: None,
        vision: None,
    })
}

/// A hybrid's layer kinds, rotary width and Gated DeltaNet sizes.
type HybridParts = (Vec<LayerKind>, Option<usize>, Option<LinearAttnArgs>);

/// [`HybridParts`] of a `qwen35`, `qwen35moe` or `qwen3next` file, `(layers, head_dim)` read.
fn hybrid_parts(
    c: &Content,
    arch_name: &str,
    arch: Arch,
    (layers, head_dim): (usize, usize),
    path: &Path,
) -> Result<HybridParts, ModelError> {
    let rope = format!("{arch_name}.rope.dimension_count");
    Ok((
        hybrid_layers(c, arch_name, layers, path)?,
        Some(rotary_dim(c, &rope, head_dim, path)?),
        Some(linear_attn(c, arch_name, arch, path)?),
    ))
}

/// `{arch}.rope.scaling.*`: Llama 3.1+ GGUFs carry their RoPE scaling as per-frequency
/// divisors, refused rather than run with plain RoPE; Gemma 3's linear scaling of its global
/// layers is read.
fn rope_scaling(
    c: &Content,
    arch: Arch,
    arch_name: &str,
    path: &Path,
) -> Result<Option<RopeScaling>, ModelError> {
    let k = |s: &str| format!("{arch_name}.{s}");
    let mut rope_scaling = None;
    if let Some(kind) = c
        .metadata
        .get(&k("rope.scaling.type"))
        .and_then(|v| v.to_string().ok())
        .filter(|t| t.as_str() != "none")
    {
        let factor = meta_f(c, &k("rope.scaling.factor")).filter(|f| *f > 0.0);
        match (arch, kind.as_str(), factor) {
            (Arch::Gemma3, "linear", Some(factor)) => {
                rope_scaling = Some(RopeScaling::Linear { factor })
            }
            _ => {
                return Err(ModelError::file(
                    path,
                    format!(
                        "metadata `{}` = {kind:?}: RoPE scaling is not supported in GGUF files (Gemma 3's linear scaling with `{}` is)",
                        k("rope.scaling.type"),
                        k("rope.scaling.factor")
                    ),
                ))
            }
        }
    }
    Ok(rope_scaling)
}

/// The model's own layers: `{arch}.block_count` less the multi-token-prediction layers
/// (`{arch}.nextn_predict_layers`) llama.cpp appends to the hybrids by default.
fn model_layers(
    c: &Content,
    arch_name: &str,
    arch: Arch,
    path: &Path,
) -> Result<usize, ModelError> {
    let blocks = meta_u(c, &format!("{arch_name}.block_count"), path)?;
    let key = format!("{arch_name}.nextn_predict_layers");
    let mtp = match (arch.hybrid(), c.metadata.contains_key(&key)) {
        (true, true) => meta_u(c, &key, path)?,
        _ => 0,
    };
    match blocks.checked_sub(mtp) {
        Some(n) if n > 0 => Ok(n),
        _ => Err(ModelError::file(
            path,
            format!("GGUF metadata: `{key}` ({mtp}) leaves no layers of `{arch_name}.block_count` ({blocks})"),
        )),
    }
}

/// A hybrid's layer kinds: `{arch}.attention.recurrent_layers` (true: Gated DeltaNet), or
/// every `{arch}.full_attention_interval`-th layer (default 4) full attention.
fn hybrid_layers(
    c: &Content,
    arch: &str,
    layers: usize,
    path: &Path,
) -> Result<Vec<LayerKind>, ModelError> {
    let key = format!("{arch}.attention.recurrent_layers");
    if let Some(v) = c.metadata.get(&key) {
        let flags = v
            .to_vec()
            .map_err(|e| ModelError::file(path, format!("GGUF metadata `{key}`: {e}")))?;
        if flags.len() < layers {
            return Err(ModelError::file(
                path,
                format!(
                    "GGUF metadata `{key}` lists {} layers, the model has {layers}",
                    flags.len()
                ),
            ));
        }
        return flags[..layers]
            .iter()
            .map(|f| match f.to_bool() {
                Ok(true) => Ok(LayerKind::Linear),
                Ok(false) => Ok(LayerKind::Full),
                Err(e) => Err(ModelError::file(
                    path,
                    format!("GGUF metadata `{key}`: {e}"),
                )),
            })
            .collect();
    }
    let ikey = format!("{arch}.full_attention_interval");
    let every = match c.metadata.contains_key(&ikey) {
        true => meta_u(c, &ikey, path)?,
        false => 4,
    };
    if every == 0 {
        return Err(ModelError::file(
            path,
            format!("GGUF metadata `{ikey}` must be positive"),
        ));
    }
    Ok(LayerKind::full_every(layers, every))
}

/// The rotary width of a hybrid's attention heads (`{arch}.rope.dimension_count`): even, at
/// most `head_dim`.
fn rotary_dim(c: &Content, key: &str, head_dim: usize, path: &Path) -> Result<usize, ModelError> {
    let d = meta_u(c, key, path)?;
    if d == 0 || d > head_dim || d % 2 != 0 {
        return Err(ModelError::file(
            path,
            format!("GGUF metadata `{key}` ({d}) must be an even number of values up to the head's {head_dim}"),
        ));
    }
    Ok(d)
}

/// The Gated DeltaNet's sizes from llama.cpp's `ssm.*` metadata: key heads `group_count`,
/// value heads `time_step_rank`, key head width `state_size`, all value heads together
/// `inner_size`, convolution width `conv_kernel`.
fn linear_attn(
    c: &Content,
    arch_name: &str,
    arch: Arch,
    path: &Path,
) -> Result<LinearAttnArgs, ModelError> {
    let k = |s: &str| format!("{arch_name}.ssm.{s}");
    let key_heads = meta_u(c, &k("group_count"), path)?;
    let value_heads = meta_u(c, &k("time_step_rank"), path)?;
    let inner = meta_u(c, &k("inner_size"), path)?;
    let a = LinearAttnArgs {
        num_key_heads: key_heads,
        num_value_heads: value_heads,
        key_head_dim: meta_u(c, &k("state_size"), path)?,
        value_head_dim: inner.checked_div(value_heads).unwrap_or(0),
        conv_kernel: meta_u(c, &k("conv_kernel"), path)?,
        grouped: arch == Arch::Qwen3Next,
    };
    if key_heads == 0
        || value_heads == 0
        || value_heads % key_heads != 0
        || inner % value_heads != 0
    {
        return Err(ModelError::file(
            path,
            format!(
                "GGUF metadata: `{}` ({value_heads}) must be a positive multiple of `{}` ({key_heads}) and divide `{}` ({inner})",
                k("time_step_rank"),
                k("group_count"),
                k("inner_size")
            ),
        ));
    }
    if a.key_head_dim == 0 || a.value_head_dim == 0 || a.conv_kernel == 0 {
        return Err(ModelError::file(
            path,
            format!(
                "GGUF metadata: `{}`, `{}` and `{}` must be positive",
                k("state_size"),
                k("inner_size"),
                k("conv_kernel")
            ),
        ));
    }
    Ok(a)
}

/// Sliding window, layer kinds, local RoPE base, `query_pre_attn_scalar`.
type GemmaLayers = (Option<usize>, Vec<LayerKind>, Option<f64>, Option<f64>);

/// Gemma 3's layers as llama.cpp runs them (`window_key` names the sliding window): every
/// sixth layer global, the others a sliding window with plain RoPE at base 10000, scores scaled
/// by head_dim^-½ (hidden/heads for the 62-layer 27B). `(layers, hidden / heads, head_dim)`.
fn gemma_layers(
    c: &Content,
    window_key: &str,
    path: &Path,
    (layers, per_head, head_dim): (usize, usize, usize),
) -> Result<GemmaLayers, ModelError> {
    let window = meta_u(c, window_key, path)?;
    let kinds = (0..layers)
        .map(|i| match (i + 1) % 6 {
            0 => LayerKind::Full,
            _ => LayerKind::Sliding,
        })
        .collect();
    let scalar = if layers == 62 { per_head } else { head_dim };
    Ok((Some(window), kinds, Some(1e4), Some(scalar as f64)))
}

/// A Qwen3-MoE GGUF's experts: `{arch}.expert_count`, `expert_used_count`,
/// `expert_feed_forward_length`; renormalised top-k weights unless `expert_weights_norm` says
/// false (llama.cpp runs qwen3moe renormalised); a layer has experts where its router
/// `blk.N.ffn_gate_inp.weight` is stored (the others keep the dense MLP).
fn read_moe(c: &Content, path: &Path, arch: &str, layers: usize) -> Result<MoeArgs, ModelError> {
    let k = |s: &str| format!("{arch}.{s}");
    let experts = meta_u(c, &k("expert_count"), path)?;
    let used = meta_u(c, &k("expert_used_count"), path)?;
    if experts == 0 || used == 0 || used > experts {
        return Err(ModelError::file(
            path,
            format!(
                "GGUF metadata: `{}` ({used}) must be between 1 and `{}` ({experts})",
                k("expert_used_count"),
                k("expert_count")
            ),
        ));
    }
    let norm = match c.metadata.get(&k("expert_weights_norm")) {
        None => true,
        Some(v) => v.to_bool().map_err(|e| {
            ModelError::file(
                path,
                format!("GGUF metadata `{}`: {e}", k("expert_weights_norm")),
            )
        })?,
    };
    let dense: Vec<usize> = (0..layers)
        .filter(|i| {
            !c.tensor_infos
                .contains_key(&format!("blk.{i}.ffn_gate_inp.weight"))
        })
        .collect();
    Ok(MoeArgs {
        num_experts: experts,
        num_experts_per_tok: used,
        norm_topk_prob: norm,
        moe_intermediate_size: meta_u(c, &k("expert_feed_forward_length"), path)?,
        decoder_sparse_step: 1,
        mlp_only_layers: dense,
        router_aux_loss_coef: None,
        // Qwen3.5-MoE's and Qwen3-Next's shared expert.
        shared_expert_intermediate_size: match c
            .metadata
            .contains_key(&k("expert_shared_feed_forward_length"))
        {
            true => Some(meta_u(c, &k("expert_shared_feed_forward_length"), path)?),
            false => None,
        },
        deepseek: None,
        swiglu: None,
    })
}

/// The families a row of [`NAMES`] or [`LAYER_NAMES`] holds for.
#[derive(Clone, Copy)]
enum Only {
    All,
    /// Gemma 3 (its norms around the attention and the MLP).
    Gemma,
    /// Every family but Gemma.
    NotGemma,
    /// The families with a layer of experts (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next).
    Moe,
}

impl Only {
    fn holds(self, arch: Arch) -> bool {
        match self {
            Only::All => true,
            Only::Gemma => arch.gemma(),
            Only::NotGemma => !arch.gemma(),
            Only::Moe => matches!(arch, Arch::Qwen3Moe | Arch::Qwen3_5Moe | Arch::Qwen3Next),
        }
    }
}

/// llama.cpp's name and transformers' name of each tensor outside the layers.
const NAMES: [(&str, &str); 3] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// llama.cpp's name (after `blk.N.`) and transformers' name (after `model.layers.N.`) of each
/// layer tensor, and the families the pair holds for: read one way by [`hf_name`], the other by
/// [`gguf_name`] (the GGUF writer). For one family each name appears at most once on each side.
/// `{}` stands for an expert's index: GGUF stacks a layer's experts per projection
/// (`[experts, out, in]`), transformers names each expert's matrix.
const LAYER_NAMES: [(&str, &str, Only); 23] = [
    ("attn_norm.weight", "input_layernorm.weight", Only::All),
    // The pre-MLP norm: Gemma's `pre_feedforward_layernorm`, Llama's
    // `post_attention_layernorm`.
    (
        "ffn_norm.weight",
        "pre_feedforward_layernorm.weight",
        Only::Gemma,
    ),
    (
        "ffn_norm.weight",
        "post_attention_layernorm.weight",
        Only::NotGemma,
    ),
    (
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
        Only::Gemma,
    ),
    (
        "post_ffw_norm.weight",
        "post_feedforward_layernorm.weight",
        Only::Gemma,
    ),
    ("attn_q.weight", "self_attn.q_proj.weight", Only::All),
    ("attn_k.weight", "self_attn.k_proj.weight", Only::All),
    ("attn_v.weight", "self_attn.v_proj.weight", Only::All),
    ("attn_q.bias", "self_attn.q_proj.bias", Only::All),
    ("attn_k.bias", "self_attn.k_proj.bias", Only::All),
    ("attn_v.bias", "self_attn.v_proj.bias", Only::All),
    ("attn_output.weight", "self_attn.o_proj.weight", Only::All),
    ("attn_output.bias", "self_attn.o_proj.bias", Only::All),
    // Qwen3's per-head q/k norms.
    ("attn_q_norm.weight", "self_attn.q_norm.weight", Only::All),
    ("attn_k_norm.weight", "self_attn.k_norm.weight", Only::All),
    ("ffn_gate.weight", "mlp.gate_proj.weight", Only::All),
    ("ffn_up.weight", "mlp.up_proj.weight", Only::All),
    ("ffn_down.weight", "mlp.down_proj.weight", Only::All),
    // A layer of experts: the router, and each projection of every expert stacked.
    ("ffn_gate_inp.weight", "mlp.gate.weight", Only::Moe),
    (
        "ffn_gate_exps.weight",
        "mlp.experts.{}.gate_proj.weight",
        Only::Moe,
    ),
    // Gate and up of every expert in one stack `[experts, 2·inter, in]`, gate rows first
    // (read only: see `load`).
    (
        "ffn_gate_up_exps.weight",
        "mlp.experts.{}.gate_up",
        Only::Moe,
    ),
    (
        "ffn_up_exps.weight",
        "mlp.experts.{}.up_proj.weight",
        Only::Moe,
    ),
    (
        "ffn_down_exps.weight",
        "mlp.experts.{}.down_proj.weight",
        Only::Moe,
    ),
];

/// HF name of a GGUF tensor of an `arch` model.
fn hf_name(gguf: &str, arch: Arch) -> Option<String> {
    if let Some((_, hf)) = NAMES.iter().find(|(g, _)| *g == gguf) {
        return Some(hf.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (n, part) = rest.split_once('.')?;
    let hf = match LAYER_NAMES
        .iter()
        .find(|(g, _, only)| *g == part && only.holds(arch))
    {
        Some((_, hf, _)) => *hf,
        None if arch.hybrid() => super::gguf_hybrid::layer_name(part)?,
        None => return None,
    };
    Some(format!("model.layers.{n}.{hf}"))
}

/// GGUF name of a transformers tensor of an `arch` model (the inverse of [`hf_name`]); an
/// expert's matrix is named with `{}` for its index (`model.layers.0.mlp.experts.{}.up_proj.weight`
/// → `blk.0.ffn_up_exps.weight`). `None`: llama.cpp has no place for it in this family.
pub(crate) fn gguf_name(hf: &str, arch: Arch) -> Option<String> {
    if let Some((g, _)) = NAMES.iter().find(|(_, h)| *h == hf) {
        return Some(g.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (n, part) = rest.split_once('.')?;
    n.parse::<usize>().ok()?;
    let (g, _, _) = LAYER_NAMES
        .iter()
        .find(|(_, h, only)| *h == part && only.holds(arch))?;
    Some(format!("blk.{n}.{g}"))
}

/// llama.cpp stores Llama Q/K rows permuted (`[heads, 2, d/2] → [heads, d/2, 2]`); this is the
/// inverse, back to HF's rotate-half layout. Works on weights `[rows, in]` and biases `[rows]`.
pub fn unpermute(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    let d = rows / heads;
    let rest: usize = dims[1..].iter().product();
    t.reshape((heads, d / 2, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// The forward permutation (HF → GGUF), for writing test files the way llama.cpp does.
pub fn permute(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let d = dims[0] / heads;
    let rest: usize = dims[1..].iter().product();
    t.reshape((heads, 2, d / 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// Loads a `.gguf` as trainable variables (dequantised to `dtype`); a NaN or infinite value
/// (after dequantisation: a block scale can be one) is an error naming the GGUF tensor.
pub fn load(
    path: &Path,
    dtype: DType,
    device: &Device,
    with_lm_head: bool,
) -> Result<(Loaded, Content), ModelError> {
    let (mut f, c) = open(path)?;
    let args = read_args(&c, path)?;
    let mut tensors = HashMap::new();
    let mut mtp = 0;
    for name in c.tensor_infos.keys() {
        if args.arch.hybrid() && gguf_hybrid::is_mtp_layer(name, args.num_hidden_layers) {
            mtp += 1;
            continue;
        }
        let Some(hf) = hf_name(name, args.arch) else {
            return Err(ModelError::file(
                path,
                format!(
                    "tensor `{name}` is not one this {:?} layout reads",
                    args.arch
                ),
            ));
        };
        let q = c
            .tensor(&mut f, name, &Device::Cpu)
            .map_err(|e| ModelError::file(path, format!("tensor `{name}`: {e}")))?;
        let mut t = q.dequantize(&Device::Cpu)?;
        super::check_finite(path, name, &t)?;
        // llama.cpp stores Gemma's norms as 1 + w (it multiplies by the weight as it is).
        // So does it store the hybrids' norms (but the DeltaNet's gated norm).
        if (args.arch.gemma() && name.ends_with("norm.weight"))
            || (args.arch.hybrid() && gguf_hybrid::stored_plus_one(name))
        {
            t = (t - 1.0)?;
        }
        if args.arch == Arch::Llama {
            if name.contains("attn_q.") {
                t = unpermute(&t, args.num_attention_heads)?;
            } else if name.contains("attn_k.") {
                t = unpermute(&t, args.num_key_value_heads)?;
            }
        }
        if hf.contains("{}") {
            // Stacked experts `[experts, out, in]`: one `[out, in]` tensor per expert.
            let experts = args.moe.as_ref().map_or(0, |m| m.num_experts);
            if t.rank() != 3 || t.dim(0)? != experts {
                return Err(ModelError::file(
                    path,
                    format!(
                        "tensor `{name}` has shape {:?}, expected [{experts}, out, in] (one matrix per expert)",
                        t.dims()
                    ),
                ));
            }
            for e in 0..experts {
                let at = hf.replace("{}", &e.to_string());
                let m = t.get(e)?; // [out, in]
                match at.strip_suffix("gate_up") {
                    Some(stem) => {
                        let rows = m.dim(0)?;
                        if rows % 2 != 0 {
                            return Err(ModelError::file(
                                path,
                                format!("tensor `{name}`: {rows} rows do not split into gate and up halves"),
                            ));
                        }
                        tensors
                            .insert(format!("{stem}gate_proj.weight"), m.narrow(0, 0, rows / 2)?);
                        tensors.insert(
                            format!("{stem}up_proj.weight"),
                            m.narrow(0, rows / 2, rows / 2)?,
                        );
                    }
                    None => {
                        tensors.insert(at, m);
                    }
                }
            }
            continue;
        }
        tensors.insert(hf, t);
    }
    if mtp > 0 {
        tracing::info!(
            "{}: {mtp} tensors of the multi-token-prediction layers not read (training and sampling use the model's own layers)",
            path.display()
        );
    }
    gguf_hybrid::to_hf(&args, &mut tensors, path)?;
    Ok((
        build(&args, &tensors, path, dtype, device, with_lm_head)?,
        c,
    ))
}

/// The tokenizer, special tokens and chat template of a GGUF file's metadata (GPT-2 style
/// byte-level BPE: `tokenizer.ggml.model = gpt2`).
pub fn tokenizer(c: &Content, path: &Path) -> Result<TokenizerBundle, ModelError> {
    let s = |key: &str| {
        c.metadata
            .get(key)
            .and_then(|v| v.to_string().ok().cloned())
    };
    let model = s("tokenizer.ggml.model").unwrap_or_default();
    let arch = s("general.architecture").unwrap_or_default();
    let gemma = model == "llama" && arch == "gemma3";
    if model != "gpt2" && !gemma {
        return Err(ModelError::file(path, format!("GGUF tokenizer model `{model}` (architecture `{arch}`) is not supported (byte-level BPE `gpt2`, and Gemma 3's sentencepiece vocabulary, are); use an HF directory with tokenizer.json")));
    }
    let strings = |key: &str| -> Result<Vec<String>, ModelError> {
        meta(c, key, path)?
            .to_vec()
            .map_err(|e| ModelError::file(path, e.to_string()))?
            .iter()
            .map(|v| {
                v.to_string()
                    .cloned()
                    .map_err(|e| ModelError::file(path, format!("`{key}`: {e}")))
            })
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let types: Vec<i64> = c
        .metadata
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.to_vec().ok())
        .map(|v| {
            v.iter()
                .map(|x| x.to_i32().map(i64::from).unwrap_or(1))
                .collect()
        })
        .unwrap_or_default();
    let tok = if gemma {
        gemma_tokenizer(&tokens, &types, path)?
    } else {
        byte_level_tokenizer(c, &tokens, &types, path, &strings)?
    };
    let id = |key: &str| c.metadata.get(key).and_then(|v| v.to_u32().ok());
    let name = |i: Option<u32>| i.and_then(|i| tokens.get(i as usize).cloned());
    let eos = id("tokenizer.ggml.eos_token_id");
    let special = SpecialTokens {
        bos: name(id("tokenizer.ggml.bos_token_id")),
        eos: name(eos),
        pad: name(id("tokenizer.ggml.padding_token_id")),
        unk: name(id("tokenizer.ggml.unknown_token_id")),
    };
    // Generation ends at any end-of-generation token as llama.cpp counts them: the EOS, the
    // end-of-turn/-message ids, and the tokens spelled as one of the known end markers
    // (`<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`, ...), whatever the file's EOS.
    let mut eos_token_ids: Vec<u32> = eos.into_iter().collect();
    let marked = ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
        .into_iter()
        .filter_map(id);
    let spelled = tokens
        .iter()
        .enumerate()
        .filter(|(_, t)| END_MARKERS.contains(&t.as_str()))
        .map(|(i, _)| i as u32);
    for t in marked.chain(spelled) {
        if !eos_token_ids.contains(&t) {
            eos_token_ids.push(t);
        }
    }
    let pad_token_id = id("tokenizer.ggml.padding_token_id").or(eos).unwrap_or(0);
    Ok(TokenizerBundle {
        tokenizer: tok,
        chat_template: s("tokenizer.chat_template"),
        chat_template_origin: format!("{} (tokenizer.chat_template)", path.display()),
        special,
        eos_token_ids,
        pad_token_id,
        source: path.to_path_buf(),
    })
}

/// Tokens that end a generation wherever a vocabulary has them (llama.cpp's end-of-generation
/// spellings).
const END_MARKERS: [&str; 10] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<EOT>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "<eos>",
];

/// The pre-tokenizer pattern of Qwen2/2.5/3's tokenizer.json (llama.cpp's `qwen2`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's (llama.cpp's `qwen35`): letters with their combining marks (`\p{M}`) as words.
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer that `tokenizer.ggml.pre` names: how text is cut into pieces before the
/// merges, then bytes mapped to characters.
pub(crate) fn pre_tokenizer(pre: &str, path: &Path) -> Result<PreTokenizerWrapper, ModelError> {
    let byte_level = ByteLevel::new(false, true, true);
    Ok(match pre {
        "smollm" | "smaug-bpe" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(byte_level),
        ])),
        // GPT-2's own split (llama.cpp names it `gpt-2`).
        "" | "default" | "gpt2" | "gpt-2" => PreTokenizerWrapper::ByteLevel(byte_level),
        "qwen2" | "qwen35" => {
            // Qwen's split (its tokenizer.json's `Split` pattern, isolated pieces), then bytes
            // to characters without GPT-2's own split.
            let re = if pre == "qwen2" { QWEN2_SPLIT } else { QWEN35_SPLIT };
            let split = Split::new(SplitPattern::Regex(re.into()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| ModelError::file(path, format!("pre-tokenizer `{pre}`: {e}")))?;
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Split(split),
                PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
            ]))
        }
        other => {
            return Err(ModelError::file(path, format!("GGUF pre-tokenizer `{other}` is not supported (smollm, gpt-2, qwen2, qwen35 are); use an HF directory with tokenizer.json")))
        }
    })
}

/// The byte-level BPE tokenizer of a `gpt2` vocabulary (SmolLM2's): the file's merges, the
/// byte-level pre-tokenizer its `tokenizer.ggml.pre` names, control tokens special.
fn byte_level_tokenizer(
    c: &Content,
    tokens: &[String],
    types: &[i64],
    path: &Path,
    strings: &dyn Fn(&str) -> Result<Vec<String>, ModelError>,
) -> Result<Tokenizer, ModelError> {
    let s = |key: &str| {
        c.metadata
            .get(key)
            .and_then(|v| v.to_string().ok().cloned())
    };
    // A vocabulary without `tokenizer.ggml.merges` (llama.cpp's converter leaves the key out
    // when the tokenizer has none) tokenizes into its single tokens.
    let merges = match c.metadata.contains_key("tokenizer.ggml.merges") {
        true => strings("tokenizer.ggml.merges")?,
        false => Vec::new(),
    };
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .filter_map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
        })
        .collect();
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| ModelError::file(path, format!("cannot build the BPE tokenizer: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    let pre = s("tokenizer.ggml.pre").unwrap_or_default();
    tok.with_pre_tokenizer(Some(pre_tokenizer(&pre, path)?));
    tok.with_decoder(Some(ByteLevel::default()));
    let specials: Vec<AddedToken> = types
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == 3)
        .map(|(i, _)| AddedToken::from(tokens[i].clone(), true))
        .collect();
    tok.add_special_tokens(specials)
        .map_err(|e| ModelError::file(path, format!("special tokens: {e}")))?;
    Ok(tok)
}

/// Gemma 3's tokenizer from a GGUF's sentencepiece vocabulary, as transformers builds it for
/// such a file (its `GemmaTokenizer`: BPE with byte fallback, spaces as `▁`, split after each
/// space, no prefix space): tokens of spaces only are respelled with `▁`; the file has no
/// merges, so they come from the vocabulary (every split of a token into two tokens, ranked by
/// the token's place in the file, then the longer left part, then the longer right part, then
/// the parts' ids); control tokens (type 3) are special, user-defined ones (type 4) whole.
fn gemma_tokenizer(tokens: &[String], types: &[i64], path: &Path) -> Result<Tokenizer, ModelError> {
    use std::collections::hash_map::Entry;
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence as DecoderSequence;
    use tokenizers::normalizers::replace::Replace;
    use tokenizers::DecoderWrapper;
    let bad =
        |what: &str, e: String| ModelError::file(path, format!("Gemma tokenizer: {what}: {e}"));
    let spelled: Vec<String> = tokens
        .iter()
        .map(|t| {
            if t.contains(' ') && t.trim().is_empty() {
                "\u{2581}".repeat(t.chars().count())
            } else {
                t.clone()
            }
        })
        .collect();
    // As a Python dict: a token's id is its last place, its rank its first place's order with
    // the last place's score.
    let mut vocab: HashMap<String, u32> = HashMap::with_capacity(spelled.len());
    let mut order: Vec<&str> = Vec::with_capacity(spelled.len());
    for (i, t) in spelled.iter().enumerate() {
        match vocab.entry(t.clone()) {
            Entry::Occupied(mut e) => {
                e.insert(i as u32);
            }
            Entry::Vacant(e) => {
                e.insert(i as u32);
                order.push(t);
            }
        }
    }
    let mut merges: Vec<(i64, usize, usize, &str, &str)> = Vec::new();
    for merge in &order {
        let score = -i64::from(vocab[*merge]);
        let mut local: Vec<(u32, u32, &str, &str)> = merge
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = merge.split_at(at);
                Some((*vocab.get(l)?, *vocab.get(r)?, l, r))
            })
            .collect();
        local.sort_by_key(|&(a, b, _, _)| (a, b));
        merges.extend(
            local
                .into_iter()
                .map(|(_, _, l, r)| (score, l.chars().count(), r.chars().count(), l, r)),
        );
    }
    // Best first: highest score, then the longer left and right parts; ties keep their order.
    merges.sort_by_key(|m| std::cmp::Reverse((m.0, m.1, m.2)));
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .map(|(_, _, _, l, r)| (l.to_string(), r.to_string()))
        .collect();
    let vocab: tokenizers::models::bpe::Vocab = vocab.into_iter().collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token("<unk>".into())
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| bad("BPE", e.to_string()))?;
    let mut tok = Tokenizer::new(bpe);
    let normalizer = Replace::new(" ", "\u{2581}").map_err(|e| bad("normalizer", e.to_string()))?;
    tok.with_normalizer(Some(normalizer))
        .map_err(|e| bad("normalizer", e.to_string()))?;
    tok.with_pre_tokenizer(Some(
        Split::new(
            SplitPattern::String(" ".into()),
            SplitDelimiterBehavior::MergedWithPrevious,
            false,
        )
        .map_err(|e| bad("pre-tokenizer", e.to_string()))?,
    ));
    tok.with_decoder(Some(DecoderSequence::new(vec![
        DecoderWrapper::Replace(
            Replace::new("\u{2581}", " ").map_err(|e| bad("decoder", e.to_string()))?,
        ),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ])));
    let kind = |t: i64| {
        types
            .iter()
            .enumerate()
            .filter(move |(_, &k)| k == t)
            .map(|(i, _)| tokens[i].clone())
    };
    let specials: Vec<AddedToken> = kind(3).map(|t| AddedToken::from(t, true)).collect();
    tok.add_special_tokens(specials)
        .map_err(|e| bad("special tokens", e.to_string()))?;
    // Only those the vocabulary spells as the file does (a respelled run of spaces is a plain
    // vocabulary token, not an added one).
    let user: Vec<AddedToken> = kind(4)
        .filter(|t| tok.token_to_id(t).is_some())
        .map(|t| AddedToken::from(t, false).normalized(false))
        .collect();
    tok.add_tokens(user)
        .map_err(|e| bad("user-defined tokens", e.to_string()))?;
    Ok(tok)
}
