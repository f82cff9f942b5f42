//! llama.cpp's GGUF layout of the hybrid families (`qwen35`, `qwen35moe`, `qwen3next`: Gated
//! DeltaNet layers between gated full-attention layers) read back into transformers' names and
//! layouts, so that the model builds from them as from an HF directory.
//!
//! What llama.cpp's converter changes (`conversion/qwen.py`, read at llama-cpp-python 0.3.36's
//! vendored copy), and what [`to_hf`] undoes:
//! - every RMSNorm weight but the DeltaNet's gated norm is stored as `1 + w`;
//! - `A_log` is stored as `ssm_a = −exp(A_log)`, `dt_bias` as `ssm_dt.bias`, the convolution
//!   `[channels, 1, width]` squeezed to `[channels, width]`;
//! - Qwen3.5 (dense and MoE), where value heads outnumber key heads: the value heads of
//!   `in_proj_qkv`'s v rows, `in_proj_z`, `in_proj_a`/`in_proj_b`, `A_log`, `dt_bias`, the
//!   convolution's v channels and `out_proj`'s columns are reordered from grouped by key head
//!   (`[g0v0, g0v1, …, g1v0, …]`) to tiled (`[g0v0, g1v0, …, g0v1, …]`);
//! - Qwen3-Next: the fused `in_proj_qkvz` (per key head `[q, k, v…, z…]`) is split into
//!   `attn_qkv` (all q, all k, all v) and `attn_gate` (all z); `in_proj_ba` is kept as it is.
//!
//! A GGUF written with the multi-token-prediction head (`{arch}.nextn_predict_layers`) has
//! those extra layers after the model's; they are not read (`is_mtp_layer`).

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;

use crate::model::config::LinearAttnArgs;
use crate::model::{Arch, ModelArgs, ModelError};

/// The HF name (within `model.layers.N.`) of a hybrid family's GGUF tensor `part`, for the
/// parts that only the hybrids have; `None` for the others (the caller's common table).
pub(super) fn layer_name(part: &str) -> Option<&'static str> {
    Some(match part {
        // The doubled q_proj (each head's queries then its gate values) keeps its name.
        "post_attention_norm.weight" => "post_attention_layernorm.weight",
        "attn_qkv.weight" => "linear_attn.in_proj_qkv.weight",
        "attn_gate.weight" => "linear_attn.in_proj_z.weight",
        "ssm_alpha.weight" => "linear_attn.in_proj_a.weight",
        "ssm_beta.weight" => "linear_attn.in_proj_b.weight",
        "ssm_ba.weight" => "linear_attn.in_proj_ba.weight",
        "ssm_a" => "linear_attn.A_log",
        "ssm_dt.bias" => "linear_attn.dt_bias",
        "ssm_conv1d.weight" => "linear_attn.conv1d.weight",
        "ssm_norm.weight" => "linear_attn.norm.weight",
        "ssm_out.weight" => "linear_attn.out_proj.weight",
        "ffn_gate_shexp.weight" => "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight" => "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight" => "mlp.shared_expert.down_proj.weight",
        "ffn_gate_inp_shexp.weight" => "mlp.shared_expert_gate.weight",
        _ => return None,
    })
}

/// Whether llama.cpp stores the GGUF tensor `name` of a hybrid model as `1 + w` (every RMSNorm
/// but the DeltaNet's gated norm `ssm_norm`).
pub(super) fn stored_plus_one(name: &str) -> bool {
    name.ends_with("norm.weight") && !name.ends_with("ssm_norm.weight")
}

/// The layers of a GGUF's multi-token-prediction head: block indices from `layers` on.
pub(super) fn is_mtp_layer(name: &str, layers: usize) -> bool {
    name.strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(n, _)| n.parse::<usize>().ok())
        .is_some_and(|n| n >= layers)
}

/// Value heads from llama.cpp's tiled order back to transformers' grouped order along `dim`:
/// the axis holds `[per_key, key_heads, width]` (tiled) and becomes `[key_heads, per_key,
/// width]`.
fn grouped(
    t: &Tensor,
    dim: usize,
    key_heads: usize,
    per_key: usize,
    width: usize,
) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let mut split = dims[..dim].to_vec();
    split.extend([per_key, key_heads, width]);
    split.extend(&dims[dim + 1..]);
    t.reshape(split)?
        .transpose(dim, dim + 1)?
        .contiguous()?
        .reshape(dims)
}

/// Rows `[from, to)` of `t` replaced by `f` of them.
fn map_rows(
    t: &Tensor,
    from: usize,
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let n = t.dim(0)?;
    let head = t.narrow(0, 0, from)?;
    let tail = f(&t.narrow(0, from, n - from)?)?;
    Tensor::cat(&[&head, &tail], 0)
}

/// One DeltaNet layer's tensors (HF names under `p`, as [`layer_name`] gave them, values as
/// stored) into transformers' layouts.
fn linear_layer(
    t: &mut HashMap<String, Tensor>,
    p: &str,
    l: &LinearAttnArgs,
    arch: Arch,
    path: &Path,
) -> Result<(), ModelError> {
    let take = |t: &mut HashMap<String, Tensor>, n: &str| {
        t.remove(&format!("{p}{n}")).ok_or_else(|| {
            ModelError::file(
                path,
                format!("GGUF: layer `{p}` is a Gated DeltaNet layer (attention.recurrent_layers) but has no tensor for `{n}`"),
            )
        })
    };
    let (nk, nv, hv) = (l.num_key_heads, l.num_value_heads, l.value_head_dim);
    let r = nv / nk;
    let keys = 2 * l.key_dim();
    let check = |n: &str, x: &Tensor, want: &[usize]| {
        if x.dims() != want {
            return Err(ModelError::file(
                path,
                format!(
                    "GGUF: tensor for `{p}{n}` has shape {:?}, expected {want:?} (from the file's ssm.* metadata)",
                    x.dims()
                ),
            ));
        }
        Ok(())
    };
    // A = −exp(A_log) stored; A_log = ln(−A).
    let a = take(t, "A_log")?;
    check("A_log", &a, &[nv])?;
    let mut a_log = a.neg()?.log()?;
    super::check_finite(path, &format!("{p}A_log (from ssm_a)"), &a_log)?;
    let mut dt = take(t, "dt_bias")?;
    check("dt_bias", &dt, &[nv])?;
    let conv = take(t, "conv1d.weight")?;
    check("conv1d.weight", &conv, &[l.conv_dim(), l.conv_kernel])?;
    let mut conv = conv.unsqueeze(1)?; // [channels, 1, width]
                                       // The model width as in_proj_qkv reads it; the other projections must agree.
    let mut qkv = take(t, "in_proj_qkv.weight")?;
    let h = qkv.dims().last().copied().unwrap_or(0);
    check("in_proj_qkv.weight", &qkv, &[l.conv_dim(), h])?;
    let mut out = take(t, "out_proj.weight")?;
    check("out_proj.weight", &out, &[h, l.value_dim()])?;
    let mut z = take(t, "in_proj_z.weight")?;
    check("in_proj_z.weight", &z, &[l.value_dim(), h])?;
    if arch != Arch::Qwen3Next && r > 1 {
        qkv = map_rows(&qkv, keys, |v| grouped(v, 0, nk, r, hv))?;
        conv = map_rows(&conv, keys, |v| grouped(v, 0, nk, r, hv))?;
        z = grouped(&z, 0, nk, r, hv)?;
        a_log = grouped(&a_log, 0, nk, r, 1)?;
        dt = grouped(&dt, 0, nk, r, 1)?;
        out = grouped(&out, 1, nk, r, hv)?;
    }
    let mut put = |n: &str, x: Tensor| t.insert(format!("{p}{n}"), x);
    put("A_log", a_log);
    put("dt_bias", dt);
    put("conv1d.weight", conv);
    put("out_proj.weight", out);
    if arch == Arch::Qwen3Next {
        // Per key head [q, k, v…, z…] again: [nk, hk | hk | r·hv | r·hv, hidden].
        let kd = l.key_dim();
        let per = |x: Tensor, w: usize| x.reshape((nk, w, h));
        let q = per(qkv.narrow(0, 0, kd)?, l.key_head_dim)?;
        let k = per(qkv.narrow(0, kd, kd)?, l.key_head_dim)?;
        let v = per(qkv.narrow(0, keys, l.value_dim())?, r * hv)?;
        let z = per(z, r * hv)?;
        let qkvz = Tensor::cat(&[&q, &k, &v, &z], 1)?.reshape((keys + 2 * l.value_dim(), h))?;
        put("in_proj_qkvz.weight", qkvz);
        let ba = take(t, "in_proj_ba.weight")?;
        check("in_proj_ba.weight", &ba, &[2 * nv, h])?;
        t.insert(format!("{p}in_proj_ba.weight"), ba);
    } else {
        put("in_proj_qkv.weight", qkv);
        put("in_proj_z.weight", z);
        for n in ["in_proj_a.weight", "in_proj_b.weight"] {
            let x = take(t, n)?;
            check(n, &x, &[nv, h])?;
            let x = if r > 1 { grouped(&x, 0, nk, r, 1)? } else { x };
            t.insert(format!("{p}{n}"), x);
        }
    }
    Ok(())
}

/// Every Gated DeltaNet layer of `args` from llama.cpp's layout into transformers' (see the
/// module's notes); the other tensors are left as they are.
pub(super) fn to_hf(
    args: &ModelArgs,
    t: &mut HashMap<String, Tensor>,
    path: &Path,
) -> Result<(), ModelError> {
    let Some(l) = &args.linear_attn else {
        return Ok(());
    };
    for (i, kind) in args.layer_types.iter().enumerate() {
        if *kind == crate::model::config::LayerKind::Linear {
            linear_layer(
                t,
                &format!("model.layers.{i}.linear_attn."),
                l,
                args.arch,
                path,
            )?;
        }
    }
    Ok(())
}
