//! The vision tower of Qwen2.5-VL (`Qwen2_5_VisionTransformerPretrainedModel` in transformers'
//! `models/qwen2_5_vl/modeling_qwen2_5_vl.py`), as a composition of candle ops with autograd,
//! and the multimodal rotary positions of the language model (M-RoPE, `get_rope_index`).
//!
//! An image arrives as patches: `pixel_values` `[patches, C·T·P·P]` (channels, `T` temporal
//! copies, `P×P` pixels), laid out by the processor block-major, each `m×m` block of patches
//! (`m` = `spatial_merge_size`) contiguous, with its grid `(t, h, w)` in patches. The tower:
//!
//! ```text
//! x = patches · W_patchᵀ                         (the Conv3d whose stride is its kernel)
//! reorder the m×m blocks window by window        (windows of window_size pixels a side)
//! for each block i:  x += attn(norm1(x)) over its windows, or whole frames when i is in
//!                    fullatt_block_indexes;  x += mlp(norm2(x))
//! merge each m×m block: y = W₂·gelu(W₁·rms(x)_block + b₁) + b₂   → [patches / m², out_hidden]
//! undo the window order
//! ```
//!
//! Attention is bidirectional inside a window (or a frame), with 2-D rotary embeddings: the
//! first half of each head's frequencies turn with the patch's row, the second with its column.
//! The tower knows nothing of files or config: [`VisionArgs`] are read by `config`.

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use super::attention::attention_composed;
use super::config::{Mrope, VisionArgs};
use super::ops::rms_norm;

/// The RMSNorm epsilon of the tower's norms (fixed in transformers, not in the config).
const EPS: f64 = 1e-6;

/// One linear layer with a bias: `x·Wᵀ + b`.
#[derive(Clone)]
struct Dense {
    w: Tensor,
    b: Tensor,
}

impl Dense {
    fn new(vb: &VarBuilder, inp: usize, out: usize, name: &str) -> Result<Self> {
        let randn = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        Ok(Self {
            w: vb.get_with_hints((out, inp), &format!("{name}.weight"), randn)?,
            b: vb.get_with_hints(out, &format!("{name}.bias"), Init::Const(0.0))?,
        })
    }

    /// `[n, in]` → `[n, out]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.w.t()?)?.broadcast_add(&self.b)
    }

    fn detached(&self) -> Self {
        Self {
            w: self.w.detach(),
            b: self.b.detach(),
        }
    }
}

/// One block: pre-norm attention and a SiLU-gated MLP, both with biases.
#[derive(Clone)]
struct VisionBlock {
    norm1: Tensor,
    norm2: Tensor,
    qkv: Dense,
    proj: Dense,
    gate: Dense,
    up: Dense,
    down: Dense,
}

/// The vision tower's weights (names as transformers' `visual.*`).
#[derive(Clone)]
pub struct VisionTower {
    pub args: VisionArgs,
    /// The patch embedding as a matrix `[hidden, C·T·P·P]` (the Conv3d's kernel flattened in
    /// the patches' own order).
    patch: Tensor,
    blocks: Vec<VisionBlock>,
    ln_q: Tensor,
    merge1: Dense,
    merge2: Dense,
}

/// Where each patch attends: consecutive segments `(start, len)` of the window-ordered
/// sequence, for window blocks and for full (per-frame) blocks.
struct Layout {
    /// Merged-patch indices in window order (`[patches / m²]`).
    window_index: Vec<u32>,
    windows: Vec<(usize, usize)>,
    frames: Vec<(usize, usize)>,
    /// Each patch's (row, column) in its frame, in the processor's block-major order.
    rows_cols: Vec<(u32, u32)>,
}

impl VisionTower {
    /// Reads the tower from `vb` (at the checkpoint's `visual.` prefix).
    pub fn new(args: &VisionArgs, vb: VarBuilder) -> Result<Self> {
        let h = args.hidden_size;
        let one = Init::Const(1.0);
        let randn = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let (c, t, p) = (args.in_channels, args.temporal_patch_size, args.patch_size);
        let patch = vb
            .pp("patch_embed.proj")
            .get_with_hints((h, c, t, p, p), "weight", randn)?
            .reshape((h, c * t * p * p))?;
        let mut blocks = Vec::with_capacity(args.depth);
        for i in 0..args.depth {
            let b = vb.pp(format!("blocks.{i}"));
            let a = b.pp("attn");
            let m = b.pp("mlp");
            let inter = args.intermediate_size;
            blocks.push(VisionBlock {
                norm1: b.get_with_hints(h, "norm1.weight", one)?,
                norm2: b.get_with_hints(h, "norm2.weight", one)?,
                qkv: Dense::new(&a, h, 3 * h, "qkv")?,
                proj: Dense::new(&a, h, h, "proj")?,
                gate: Dense::new(&m, h, inter, "gate_proj")?,
                up: Dense::new(&m, h, inter, "up_proj")?,
                down: Dense::new(&m, inter, h, "down_proj")?,
            });
        }
        let merged = h * args.spatial_merge_size * args.spatial_merge_size;
        let mg = vb.pp("merger");
        Ok(Self {
            args: args.clone(),
            patch,
            blocks,
            ln_q: mg.get_with_hints(h, "ln_q.weight", one)?,
            merge1: Dense::new(&mg, merged, merged, "mlp.0")?,
            merge2: Dense::new(&mg, merged, args.out_hidden_size, "mlp.2")?,
        })
    }

    /// The same weights, detached from autograd (a view for forwards without gradient).
    pub fn detached(&self) -> VisionTower {
        VisionTower {
            args: self.args.clone(),
            patch: self.patch.detach(),
            blocks: self
                .blocks
                .iter()
                .map(|b| VisionBlock {
                    norm1: b.norm1.detach(),
                    norm2: b.norm2.detach(),
                    qkv: b.qkv.detached(),
                    proj: b.proj.detached(),
                    gate: b.gate.detached(),
                    up: b.up.detached(),
                    down: b.down.detached(),
                })
                .collect(),
            ln_q: self.ln_q.detach(),
            merge1: self.merge1.detached(),
            merge2: self.merge2.detached(),
        }
    }

    /// The merged features of images: `pixels` `[patches, C·T·P·P]` of every image in order,
    /// `grids` their `(t, h, w)` in patches. `[patches / m², out_hidden]`, image by image in
    /// the placeholders' order.
    pub fn forward(&self, pixels: &Tensor, grids: &[[usize; 3]]) -> Result<Tensor> {
        let a = &self.args;
        let (n, d) = pixels.dims2()?;
        let want = a.in_channels * a.temporal_patch_size * a.patch_size * a.patch_size;
        let patches: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
        if d != want || n != patches {
            candle_core::bail!(
                "vision tower: pixel values {:?}, expected [{patches}, {want}] for grids {grids:?}",
                pixels.dims()
            );
        }
        let layout = self.layout(grids)?;
        let unit = a.spatial_merge_size * a.spatial_merge_size;
        let dev = pixels.device();
        let order = Tensor::new(layout.window_index.as_slice(), dev)?;
        let x = pixels
            .to_dtype(self.patch.dtype())?
            .matmul(&self.patch.t()?)?; // [n, hidden]
        let x = permute(&x, &order, unit)?;
        let (cos, sin) = self.rotary(&layout.rows_cols, dev, x.dtype())?; // [n, 1, head_dim]
        let (cos, sin) = (permute3(&cos, &order, unit)?, permute3(&sin, &order, unit)?);
        let mut x = x;
        for (i, b) in self.blocks.iter().enumerate() {
            let segs = match a.fullatt_block_indexes.contains(&i) {
                true => &layout.frames,
                false => &layout.windows,
            };
            let h = rms_norm(&x, &b.norm1, EPS)?;
            x = (x + self.attention(b, &h, &cos, &sin, segs)?)?;
            let h = rms_norm(&x, &b.norm2, EPS)?;
            let mlp = b
                .down
                .forward(&(b.gate.forward(&h)?.silu()? * b.up.forward(&h)?)?)?;
            x = (x + mlp)?;
        }
        let h = rms_norm(&x, &self.ln_q, EPS)?.reshape((n / unit, unit * a.hidden_size))?;
        let y = self.merge2.forward(&gelu_erf(&self.merge1.forward(&h)?)?)?; // [n/m², out]
        let mut back = vec![0u32; layout.window_index.len()];
        for (pos, &i) in layout.window_index.iter().enumerate() {
            back[i as usize] = pos as u32;
        }
        y.index_select(&Tensor::new(back.as_slice(), dev)?, 0)
    }

    /// Bidirectional attention of `h` `[n, hidden]` inside each segment, 2-D rotary embedded.
    fn attention(
        &self,
        b: &VisionBlock,
        h: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        segs: &[(usize, usize)],
    ) -> Result<Tensor> {
        let n = h.dim(0)?;
        let heads = self.args.num_heads;
        let hd = self.args.hidden_size / heads;
        let qkv = b.qkv.forward(h)?.reshape((n, 3, heads, hd))?;
        let rope = |x: Tensor| -> Result<Tensor> {
            let x = x.contiguous()?;
            x.broadcast_mul(cos)? + rotate_half(&x)?.broadcast_mul(sin)?
        };
        let q = rope(qkv.narrow(1, 0, 1)?.squeeze(1)?)?; // [n, heads, hd]
        let k = rope(qkv.narrow(1, 1, 1)?.squeeze(1)?)?;
        let v = qkv.narrow(1, 2, 1)?.squeeze(1)?;
        let zero = Tensor::zeros((1, 1, 1, 1), h.dtype(), h.device())?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut outs = Vec::with_capacity(segs.len());
        for &(start, len) in segs {
            // [1, heads, len, hd] each.
            let seg = |x: &Tensor| x.narrow(0, start, len)?.transpose(0, 1)?.unsqueeze(0);
            let o = attention_composed(&seg(&q)?, &seg(&k)?, &seg(&v)?, &zero, scale)?;
            outs.push(o.squeeze(0)?.transpose(0, 1)?.reshape((len, heads * hd))?);
        }
        b.proj.forward(&Tensor::cat(&outs, 0)?)
    }

    /// The rotary tables `[n, 1, head_dim]` of patches at `(row, column)`: frequencies
    /// `θ^(−2j/(head_dim/2))`, `j < head_dim/4`, on the row then on the column, twice over.
    fn rotary(
        &self,
        rows_cols: &[(u32, u32)],
        dev: &Device,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let hd = self.args.hidden_size / self.args.num_heads;
        let half = hd / 2;
        let inv: Vec<f64> = (0..half / 2)
            .map(|j| 1.0 / self.args.rope_theta.powf((2 * j) as f64 / half as f64))
            .collect();
        let n = rows_cols.len();
        let mut cos = Vec::with_capacity(n * hd);
        let mut sin = Vec::with_capacity(n * hd);
        for &(r, c) in rows_cols {
            for _ in 0..2 {
                for p in [r, c] {
                    for f in &inv {
                        let angle = p as f64 * f;
                        cos.push(angle.cos());
                        sin.push(angle.sin());
                    }
                }
            }
        }
        let cos = Tensor::from_vec(cos, (n, 1, hd), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let sin = Tensor::from_vec(sin, (n, 1, hd), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        Ok((cos, sin))
    }

    /// The window order and the attention segments of images with `grids`.
    fn layout(&self, grids: &[[usize; 3]]) -> Result<Layout> {
        let a = &self.args;
        let m = a.spatial_merge_size;
        let unit = m * m;
        let side = a.window_size / m / a.patch_size; // merged patches per window side
        if side == 0 {
            candle_core::bail!(
                "vision tower: window_size {} is smaller than one merged patch ({} pixels)",
                a.window_size,
                m * a.patch_size
            );
        }
        let mut out = Layout {
            window_index: Vec::new(),
            windows: Vec::new(),
            frames: Vec::new(),
            rows_cols: Vec::new(),
        };
        let (mut first_unit, mut start) = (0usize, 0usize);
        for &[t, h, w] in grids {
            if h % m != 0 || w % m != 0 || t == 0 {
                candle_core::bail!(
                    "vision tower: grid ({t}, {h}, {w}) is not a whole number of {m}×{m} blocks"
                );
            }
            let (lh, lw) = (h / m, w / m);
            for f in 0..t {
                let frame = first_unit + f * lh * lw;
                for wr in (0..lh).step_by(side) {
                    for wc in (0..lw).step_by(side) {
                        let mut count = 0;
                        for r in wr..(wr + side).min(lh) {
                            for c in wc..(wc + side).min(lw) {
                                out.window_index.push((frame + r * lw + c) as u32);
                                count += unit;
                            }
                        }
                        out.windows.push((start, count));
                        start += count;
                    }
                }
                out.frames
                    .push((out.frames.last().map_or(0, |&(s, l)| s + l), h * w));
                for br in 0..lh {
                    for bc in 0..lw {
                        for ir in 0..m {
                            for ic in 0..m {
                                out.rows_cols
                                    .push(((br * m + ir) as u32, (bc * m + ic) as u32));
                            }
                        }
                    }
                }
            }
            first_unit += t * lh * lw;
        }
        Ok(out)
    }

    /// Every weight of the tower (for tests and counting).
    pub fn weights(&self) -> Vec<&Tensor> {
        let mut w = vec![&self.patch, &self.ln_q];
        for d in [&self.merge1, &self.merge2] {
            w.extend([&d.w, &d.b]);
        }
        for b in &self.blocks {
            w.extend([&b.norm1, &b.norm2]);
            for d in [&b.qkv, &b.proj, &b.gate, &b.up, &b.down] {
                w.extend([&d.w, &d.b]);
            }
        }
        w
    }
}

/// `x` `[n, d]` with its groups of `unit` rows reordered by `order` `[n / unit]`.
fn permute(x: &Tensor, order: &Tensor, unit: usize) -> Result<Tensor> {
    let (n, d) = x.dims2()?;
    x.reshape((n / unit, unit * d))?
        .index_select(order, 0)?
        .reshape((n, d))
}

/// [`permute`] for `[n, 1, d]` tables.
fn permute3(x: &Tensor, order: &Tensor, unit: usize) -> Result<Tensor> {
    let (n, o, d) = x.dims3()?;
    permute(&x.reshape((n, o * d))?, order, unit)?.reshape((n, o, d))
}

/// The exact GELU, `½x(1 + erf(x/√2))`, composed of ops with exact backward passes
/// (candle's fused `gelu_erf` differentiates about 1e-7 relative off in f64).
fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    (x * 0.5)? * ((x * std::f64::consts::FRAC_1_SQRT_2)?.erf()? + 1.0)?
}

/// `[-x2, x1]` for `x = [x1, x2]` halved on the last axis.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d - d / 2)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// The 3-D rotary positions of a token sequence with images (transformers' `get_rope_index`
/// for images): text tokens count on from the last position, all three axes alike; the
/// `(t·h·w)/m²` placeholder tokens of an image (`image_token`, one run per image, in the order
/// of `grids`) get `(start + frame, start + row, start + column)` over its merged grid, and the
/// text after it continues from `start + max(h, w)/m`. Returns `[3][len]` and the rotary delta
/// (`max position + 1 − len`, what decoding adds to a new token's index).
pub fn mrope_positions(
    ids: &[u32],
    image_token: u32,
    grids: &[[usize; 3]],
    merge: usize,
) -> std::result::Result<([Vec<u32>; 3], i64), String> {
    let mut pos: [Vec<u32>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    let mut next = 0u32; // the position the next text token takes
    let mut images = grids.iter();
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != image_token {
            for axis in &mut pos {
                axis.push(next);
            }
            next += 1;
            i += 1;
            continue;
        }
        let run = ids[i..].iter().take_while(|&&t| t == image_token).count();
        let &[t, h, w] = images.next().ok_or_else(|| {
            format!(
                "more image placeholder runs than the {} image(s) given",
                grids.len()
            )
        })?;
        let (lh, lw) = (h / merge, w / merge);
        if run != t * lh * lw {
            return Err(format!(
                "an image of grid ({t}, {h}, {w}) needs {} placeholder tokens, found a run of {run} at token {i}",
                t * lh * lw
            ));
        }
        for f in 0..t {
            for r in 0..lh {
                for c in 0..lw {
                    pos[0].push(next + f as u32);
                    pos[1].push(next + r as u32);
                    pos[2].push(next + c as u32);
                }
            }
        }
        next += lh.max(lw) as u32;
        i += run;
    }
    if images.next().is_some() {
        return Err(format!(
            "{} image(s) given but fewer placeholder runs in the sequence",
            grids.len()
        ));
    }
    let max = pos.iter().flat_map(|a| a.iter()).copied().max();
    let delta = max.map_or(0, |m| m as i64 + 1 - ids.len() as i64);
    Ok((pos, delta))
}

impl Mrope {
    /// Which position axis (0 temporal, 1 height, 2 width) turns rotary frequency `j`:
    /// consecutive sections `[s_t, s_h, s_w]`, or interleaved (Qwen3-VL: height at `3i + 1`,
    /// width at `3i + 2` within their sections, temporal elsewhere).
    pub fn axis_of(&self, j: usize) -> usize {
        let s = &self.section;
        if self.interleaved {
            for axis in [1, 2] {
                if j % 3 == axis && j < 3 * s.get(axis).copied().unwrap_or(0) {
                    return axis;
                }
            }
            return 0;
        }
        let mut end = 0;
        for (axis, len) in s.iter().enumerate() {
            end += len;
            if j < end {
                return axis % 3;
            }
        }
        0
    }
}

/// One prompt's images as the processor gives them: `pixels` `[patches, C·T·P·P]` of every
/// image in the prompt's placeholder order, `grids` their `(t, h, w)` in patches.
#[derive(Debug, Clone)]
pub struct Images {
    pub pixels: Tensor,
    pub grids: Vec<[usize; 3]>,
}

/// The merged features of the rows' images in row order (`[placeholders, hidden]`, what the
/// forwards take), each distinct [`Images`] (by identity: a group's rows share one) encoded
/// once; `None` when no row has images.
pub fn row_features(
    model: &super::CausalLm,
    rows: &[Option<std::sync::Arc<Images>>],
) -> Result<Option<Tensor>> {
    let mut done: Vec<(*const Images, Tensor)> = Vec::new();
    let mut parts = Vec::new();
    for im in rows.iter().flatten() {
        let key = std::sync::Arc::as_ptr(im);
        let f = match done.iter().find(|(k, _)| *k == key) {
            Some((_, f)) => f.clone(),
            None => {
                let f = model.image_features(&im.pixels, &im.grids)?;
                done.push((key, f.clone()));
                f
            }
        };
        parts.push(f);
    }
    match parts.is_empty() {
        true => Ok(None),
        false => Ok(Some(Tensor::cat(&parts, 0)?)),
    }
}

/// The 3-D rotary positions of a model's token rows `ids` (each unpadded, with its images or
/// none) laid left-padded to `width` (padding at 0): `[3 · rows · width]` (axis-major), and
/// each row's rotary delta. Errors name the row.
pub fn padded_positions(
    args: &super::ModelArgs,
    ids: &[&[u32]],
    images: &[Option<&Images>],
    width: usize,
) -> std::result::Result<(Vec<u32>, Vec<i64>), String> {
    let v = args.vision.as_ref().ok_or_else(|| {
        format!(
            "images given to a {:?} model, which has no vision tower",
            args.arch
        )
    })?;
    let b = ids.len();
    let mut pos = vec![0u32; 3 * b * width];
    let mut deltas = Vec::with_capacity(b);
    for (r, (row, im)) in ids.iter().zip(images).enumerate() {
        let grids = im.map(|i| i.grids.as_slice()).unwrap_or(&[]);
        let (p, delta) = mrope_positions(row, v.image_token_id, grids, v.spatial_merge_size)
            .map_err(|e| format!("row {r}: {e}"))?;
        let lead = width - row.len();
        for (axis, a) in p.iter().enumerate() {
            let at = axis * b * width + r * width + lead;
            pos[at..at + row.len()].copy_from_slice(a);
        }
        deltas.push(delta);
    }
    Ok((pos, deltas))
}
