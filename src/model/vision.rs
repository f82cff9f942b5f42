//! The vision towers of Qwen2.5-VL and Qwen3-VL (`Qwen2_5_VisionTransformerPretrainedModel`
//! and `Qwen3VLVisionModel` in transformers' `models/qwen2_5_vl`, `models/qwen3_vl`), as
//! compositions of candle ops with autograd, and the multimodal rotary positions of the language
//! model (M-RoPE, `get_rope_index`).
//!
//! An image arrives as patches: `pixel_values` `[patches, C·T·P·P]` (channels, `T` temporal
//! copies, `P×P` pixels), laid out by the processor block-major, each `m×m` block of patches
//! (`m` = `spatial_merge_size`) contiguous, with its grid `(t, h, w)` in patches. The tower:
//!
//! ```text
//! x = patches · W_patchᵀ (+ b)                   (the Conv3d whose stride is its kernel)
//! Qwen3-VL: x += the learned position grid resampled to the image's (bilinear, corners aligned)
//! Qwen2.5-VL: reorder the m×m blocks window by window (windows of window_size pixels a side)
//! for each block i:  x += attn(norm1(x)) over its windows (Qwen2.5-VL, blocks not in
//!                    fullatt_block_indexes) or whole frames;  x += mlp(norm2(x))
//!                    Qwen3-VL: after the blocks of deepstack_visual_indexes, a DeepStack
//!                    feature = merge(x) with its own merger
//! merge each m×m block: y = W₂·gelu(W₁·norm(x)_block + b₁) + b₂   → [patches / m², out_hidden]
//! ```
//!
//! Qwen2.5-VL: RMSNorms, SiLU-gated MLPs, the merger's norm before the blocks are joined.
//! Qwen3-VL: LayerNorms with biases, GELU (tanh) MLPs, the DeepStack mergers' norm after. The
//! language model adds each DeepStack feature to the image tokens' hidden states after its
//! first layers ([`super::CausalLm`]). Attention is bidirectional inside a window (or a frame),
//! with 2-D rotary embeddings: the first half of each head's frequencies turn with the patch's
//! row, the second with its column. The tower knows nothing of files or config: [`VisionArgs`]
//! are read by `config`.

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use super::attention::attention_composed;
use super::block::{gelu_tanh, rotate_half};
use super::config::{Mrope, VisionArgs, VisionStyle};
use super::ops::rms_norm;

/// The epsilon of the towers' norms (fixed in transformers, not in the config).
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

/// A norm over the last axis: Qwen2.5-VL's RMSNorm or Qwen3-VL's LayerNorm with a bias.
#[derive(Clone)]
enum Norm {
    Rms(Tensor),
    Layer(Tensor, Tensor),
}

impl Norm {
    fn new(vb: &VarBuilder, style: VisionStyle, width: usize, name: &str) -> Result<Self> {
        let w = vb.get_with_hints(width, &format!("{name}.weight"), Init::Const(1.0))?;
        Ok(match style {
            VisionStyle::Qwen2_5 => Norm::Rms(w),
            VisionStyle::Qwen3 => Norm::Layer(
                w,
                vb.get_with_hints(width, &format!("{name}.bias"), Init::Const(0.0))?,
            ),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Norm::Rms(w) => rms_norm(x, w, EPS),
            Norm::Layer(w, b) => {
                let mean = x.mean_keepdim(D::Minus1)?;
                let c = x.broadcast_sub(&mean)?;
                let inv = (c.sqr()?.mean_keepdim(D::Minus1)? + EPS)?.sqrt()?.recip()?;
                c.broadcast_mul(&inv)?.broadcast_mul(w)?.broadcast_add(b)
            }
        }
    }

    fn detached(&self) -> Self {
        match self {
            Norm::Rms(w) => Norm::Rms(w.detach()),
            Norm::Layer(w, b) => Norm::Layer(w.detach(), b.detach()),
        }
    }
}

/// A block's MLP: Qwen2.5-VL's SiLU-gated `down(silu(gate(x)) ⊙ up(x))` or Qwen3-VL's
/// `fc2(gelu_tanh(fc1(x)))`, all with biases.
#[derive(Clone)]
enum VisionMlp {
    Gated { gate: Dense, up: Dense, down: Dense },
    Plain { fc1: Dense, fc2: Dense },
}

impl VisionMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            VisionMlp::Gated { gate, up, down } => {
                down.forward(&(gate.forward(x)?.silu()? * up.forward(x)?)?)
            }
            VisionMlp::Plain { fc1, fc2 } => fc2.forward(&gelu_tanh(&fc1.forward(x)?)?),
        }
    }

    fn detached(&self) -> Self {
        match self {
            VisionMlp::Gated { gate, up, down } => VisionMlp::Gated {
                gate: gate.detached(),
                up: up.detached(),
                down: down.detached(),
            },
            VisionMlp::Plain { fc1, fc2 } => VisionMlp::Plain {
                fc1: fc1.detached(),
                fc2: fc2.detached(),
            },
        }
    }
}

/// One block: pre-norm attention and an MLP.
#[derive(Clone)]
struct VisionBlock {
    norm1: Norm,
    norm2: Norm,
    qkv: Dense,
    proj: Dense,
    mlp: VisionMlp,
}

/// The patch merger: a norm (over each patch, or over the joined `m×m` block when
/// `after_join`), then `fc2(gelu(fc1(·)))` on the joined block.
#[derive(Clone)]
struct Merger {
    norm: Norm,
    after_join: bool,
    fc1: Dense,
    fc2: Dense,
}

impl Merger {
    fn new(vb: &VarBuilder, a: &VisionArgs, after_join: bool) -> Result<Self> {
        let joined = a.hidden_size * a.spatial_merge_size * a.spatial_merge_size;
        let (norm, fc1, fc2) = match a.style {
            VisionStyle::Qwen2_5 => ("ln_q", "mlp.0", "mlp.2"),
            VisionStyle::Qwen3 => ("norm", "linear_fc1", "linear_fc2"),
        };
        let width = if after_join { joined } else { a.hidden_size };
        Ok(Self {
            norm: Norm::new(vb, a.style, width, norm)?,
            after_join,
            fc1: Dense::new(vb, joined, joined, fc1)?,
            fc2: Dense::new(vb, joined, a.out_hidden_size, fc2)?,
        })
    }

    /// `x` `[n, hidden]` → `[n / m², out_hidden]`.
    fn forward(&self, x: &Tensor, unit: usize) -> Result<Tensor> {
        let (n, h) = x.dims2()?;
        let joined = match self.after_join {
            true => self.norm.forward(&x.reshape((n / unit, unit * h))?)?,
            false => self.norm.forward(x)?.reshape((n / unit, unit * h))?,
        };
        self.fc2.forward(&gelu_erf(&self.fc1.forward(&joined)?)?)
    }

    fn detached(&self) -> Self {
        Self {
            norm: self.norm.detached(),
            after_join: self.after_join,
            fc1: self.fc1.detached(),
            fc2: self.fc2.detached(),
        }
    }
}

/// What a tower gives for images: the merged features that replace the placeholders'
/// embeddings, and (Qwen3-VL) the DeepStack features added to the image tokens' hidden states
/// after the language model's first layers, one per layer, each `[placeholders, hidden]`.
#[derive(Debug, Clone)]
pub struct VisionFeatures {
    pub merged: Tensor,
    pub deepstack: Vec<Tensor>,
    /// Where the features go: flat indices into the forward's `[batch · seq]` tokens, one per
    /// feature row, in order; `None`: at every image placeholder token of the input, in order
    /// (a prompt alone). A sequence whose response holds a placeholder token the model sampled
    /// must name the prompt's positions.
    pub at: Option<Vec<u32>>,
}

/// The vision tower's weights (names as transformers' `visual.*`).
#[derive(Clone)]
pub struct VisionTower {
    pub args: VisionArgs,
    /// The patch embedding as a matrix `[hidden, C·T·P·P]` (the Conv3d's kernel flattened in
    /// the patches' own order), and its bias (Qwen3-VL).
    patch: Tensor,
    patch_bias: Option<Tensor>,
    /// Qwen3-VL's learned position grid `[side², hidden]`.
    pos_embed: Option<Tensor>,
    blocks: Vec<VisionBlock>,
    merger: Merger,
    deepstack: Vec<Merger>,
}

/// Where each patch attends: consecutive segments `(start, len)` of the (window-ordered)
/// sequence, for window blocks and for full (per-frame) blocks.
struct Layout {
    /// Merged-patch indices in window order (`[patches / m²]`); `None`: processor order.
    window_index: Option<Vec<u32>>,
    windows: Vec<(usize, usize)>,
    frames: Vec<(usize, usize)>,
    /// Each patch's (row, column) in its frame, in the processor's block-major order, and its
    /// frame's grid (h, w).
    rows_cols: Vec<(u32, u32)>,
    grid_of: Vec<(u32, u32)>,
}

impl VisionTower {
    /// Reads the tower from `vb` (at the checkpoint's `visual.` prefix).
    pub fn new(args: &VisionArgs, vb: VarBuilder) -> Result<Self> {
        let h = args.hidden_size;
        let randn = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let (c, t, p) = (args.in_channels, args.temporal_patch_size, args.patch_size);
        let pe = vb.pp("patch_embed.proj");
        let patch = pe
            .get_with_hints((h, c, t, p, p), "weight", randn)?
            .reshape((h, c * t * p * p))?;
        let qwen3 = args.style == VisionStyle::Qwen3;
        let patch_bias = match qwen3 {
            true => Some(pe.get_with_hints(h, "bias", Init::Const(0.0))?),
            false => None,
        };
        let pos_embed = match qwen3 {
            true => Some(vb.get_with_hints(
                (args.num_position_embeddings, h),
                "pos_embed.weight",
                randn,
            )?),
            false => None,
        };
        let mut blocks = Vec::with_capacity(args.depth);
        for i in 0..args.depth {
            let b = vb.pp(format!("blocks.{i}"));
            let (a, m) = (b.pp("attn"), b.pp("mlp"));
            let inter = args.intermediate_size;
            let mlp = match args.style {
                VisionStyle::Qwen2_5 => VisionMlp::Gated {
                    gate: Dense::new(&m, h, inter, "gate_proj")?,
                    up: Dense::new(&m, h, inter, "up_proj")?,
                    down: Dense::new(&m, inter, h, "down_proj")?,
                },
                VisionStyle::Qwen3 => VisionMlp::Plain {
                    fc1: Dense::new(&m, h, inter, "linear_fc1")?,
                    fc2: Dense::new(&m, inter, h, "linear_fc2")?,
                },
            };
            blocks.push(VisionBlock {
                norm1: Norm::new(&b, args.style, h, "norm1")?,
                norm2: Norm::new(&b, args.style, h, "norm2")?,
                qkv: Dense::new(&a, h, 3 * h, "qkv")?,
                proj: Dense::new(&a, h, h, "proj")?,
                mlp,
            });
        }
        let deepstack = (0..args.deepstack_visual_indexes.len())
            .map(|k| Merger::new(&vb.pp(format!("deepstack_merger_list.{k}")), args, true))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            args: args.clone(),
            patch,
            patch_bias,
            pos_embed,
            blocks,
            merger: Merger::new(&vb.pp("merger"), args, false)?,
            deepstack,
        })
    }

    /// The same weights, detached from autograd (a view for forwards without gradient).
    pub fn detached(&self) -> VisionTower {
        VisionTower {
            args: self.args.clone(),
            patch: self.patch.detach(),
            patch_bias: self.patch_bias.as_ref().map(Tensor::detach),
            pos_embed: self.pos_embed.as_ref().map(Tensor::detach),
            blocks: self
                .blocks
                .iter()
                .map(|b| VisionBlock {
                    norm1: b.norm1.detached(),
                    norm2: b.norm2.detached(),
                    qkv: b.qkv.detached(),
                    proj: b.proj.detached(),
                    mlp: b.mlp.detached(),
                })
                .collect(),
            merger: self.merger.detached(),
            deepstack: self.deepstack.iter().map(Merger::detached).collect(),
        }
    }

    /// The features of images: `pixels` `[patches, C·T·P·P]` of every image in order, `grids`
    /// their `(t, h, w)` in patches; image by image in the placeholders' order.
    pub fn forward(&self, pixels: &Tensor, grids: &[[usize; 3]]) -> Result<VisionFeatures> {
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
        let mut x = pixels
            .to_dtype(self.patch.dtype())?
            .matmul(&self.patch.t()?)?; // [n, hidden]
        if let Some(b) = &self.patch_bias {
            x = x.broadcast_add(b)?;
        }
        if let Some(table) = &self.pos_embed {
            x = (x + self.position_embeddings(table, &layout, dev)?)?;
        }
        let (cos, sin) = self.rotary(&layout.rows_cols, dev, x.dtype())?; // [n, 1, head_dim]
        let order = match &layout.window_index {
            Some(w) => Some(Tensor::new(w.as_slice(), dev)?),
            None => None,
        };
        let (x, cos, sin) = match &order {
            Some(o) => (
                permute(&x, o, unit)?,
                permute3(&cos, o, unit)?,
                permute3(&sin, o, unit)?,
            ),
            None => (x, cos, sin),
        };
        let mut x = x;
        let mut deepstack = Vec::with_capacity(self.deepstack.len());
        for (i, b) in self.blocks.iter().enumerate() {
            let windowed = a.style == VisionStyle::Qwen2_5 && !a.fullatt_block_indexes.contains(&i);
            let segs = match windowed {
                true => &layout.windows,
                false => &layout.frames,
            };
            let h = b.norm1.forward(&x)?;
            x = (x + self.attention(b, &h, &cos, &sin, segs)?)?;
            x = (&x + b.mlp.forward(&b.norm2.forward(&x)?)?)?;
            if let Some(k) = a.deepstack_visual_indexes.iter().position(|&l| l == i) {
                deepstack.push(self.deepstack[k].forward(&x, unit)?);
            }
        }
        let merged = self.merger.forward(&x, unit)?; // [n / m², out]
        let merged = match &layout.window_index {
            Some(w) => {
                let mut back = vec![0u32; w.len()];
                for (pos, &i) in w.iter().enumerate() {
                    back[i as usize] = pos as u32;
                }
                merged.index_select(&Tensor::new(back.as_slice(), dev)?, 0)?
            }
            None => merged,
        };
        Ok(VisionFeatures {
            merged,
            deepstack,
            at: None,
        })
    }

    /// Qwen3-VL's learned position grid `[side², hidden]` resampled to each frame's grid
    /// (bilinear, corners aligned: row `r` of `h` samples the table at `r·(side − 1)/(h − 1)`),
    /// per patch in the processor's order: `[n, hidden]`.
    fn position_embeddings(&self, table: &Tensor, layout: &Layout, dev: &Device) -> Result<Tensor> {
        let side = (self.args.num_position_embeddings as f64).sqrt().round() as usize;
        let n = layout.rows_cols.len();
        // Per patch four taps into the table and their weights.
        let (mut idx, mut wts) = (Vec::with_capacity(4 * n), Vec::with_capacity(4 * n));
        let taps = |i: u32, size: u32| -> [(u32, f64); 2] {
            let src = i as f64 * (side - 1) as f64 / (size.max(2) - 1) as f64;
            let f = src.floor();
            let lo = (f as usize).min(side - 1) as u32;
            let hi = (f as usize + 1).min(side - 1) as u32;
            let d = src - f;
            [(lo, 1.0 - d), (hi, d)]
        };
        for (&(r, c), &(h, w)) in layout.rows_cols.iter().zip(&layout.grid_of) {
            for (ri, rw) in taps(r, h) {
                for (ci, cw) in taps(c, w) {
                    idx.push(ri * side as u32 + ci);
                    wts.push(rw * cw);
                }
            }
        }
        let rows = table.index_select(&Tensor::new(idx.as_slice(), dev)?, 0)?; // [4n, hidden]
        let w = Tensor::from_vec(wts, (4 * n, 1), &Device::Cpu)?
            .to_dtype(table.dtype())?
            .to_device(dev)?;
        rows.broadcast_mul(&w)?
            .reshape((n, 4, table.dim(1)?))?
            .sum(1)
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

    /// The window order (Qwen2.5-VL) and the attention segments of images with `grids`.
    fn layout(&self, grids: &[[usize; 3]]) -> Result<Layout> {
        let a = &self.args;
        let m = a.spatial_merge_size;
        let windowed = a.style == VisionStyle::Qwen2_5;
        let side = a.window_size / m / a.patch_size; // merged patches per window side
        if windowed && side == 0 {
            candle_core::bail!(
                "vision tower: window_size {} is smaller than one merged patch ({} pixels)",
                a.window_size,
                m * a.patch_size
            );
        }
        let mut out = Layout {
            window_index: windowed.then(Vec::new),
            windows: Vec::new(),
            frames: Vec::new(),
            rows_cols: Vec::new(),
            grid_of: Vec::new(),
        };
        let mut first_unit = 0usize;
        for &[t, h, w] in grids {
            if h % m != 0 || w % m != 0 || t == 0 {
                candle_core::bail!(
                    "vision tower: grid ({t}, {h}, {w}) is not a whole number of {m}×{m} blocks"
                );
            }
            let (lh, lw) = (h / m, w / m);
            for f in 0..t {
                if let Some(index) = out.window_index.as_mut() {
                    let frame = first_unit + f * lh * lw;
                    windows_of(frame, (lh, lw), side, m * m, index, &mut out.windows);
                }
                out.frames
                    .push((out.frames.last().map_or(0, |&(s, l)| s + l), h * w));
                for br in 0..lh {
                    for bc in 0..lw {
                        for ir in 0..m {
                            for ic in 0..m {
                                out.rows_cols
                                    .push(((br * m + ir) as u32, (bc * m + ic) as u32));
                                out.grid_of.push((h as u32, w as u32));
                            }
                        }
                    }
                }
            }
            first_unit += t * lh * lw;
        }
        Ok(out)
    }
}

/// The windows of one frame of `(lh, lw)` merged patches (its first at `frame`), `side`
/// merged patches a side, row by row (the last row and column of windows partial): their
/// merged patches appended to `index` in window order, their `(start, len)` in patches to
/// `windows`.
fn windows_of(
    frame: usize,
    (lh, lw): (usize, usize),
    side: usize,
    unit: usize,
    index: &mut Vec<u32>,
    windows: &mut Vec<(usize, usize)>,
) {
    let mut start = windows.last().map_or(0, |&(s, l)| s + l);
    for wr in (0..lh).step_by(side) {
        for wc in (0..lw).step_by(side) {
            let mut count = 0;
            for r in wr..(wr + side).min(lh) {
                for c in wc..(wc + side).min(lw) {
                    index.push((frame + r * lw + c) as u32);
                    count += unit;
                }
            }
            windows.push((start, count));
            start += count;
        }
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

/// The features of the rows' images in row order (what the forwards take), each distinct
/// [`Images`] (by identity: a group's rows share one) encoded once; `None` when no row has
/// images.
pub fn row_features(
    model: &super::CausalLm,
    rows: &[Option<std::sync::Arc<Images>>],
) -> Result<Option<VisionFeatures>> {
    let mut done: Vec<(*const Images, VisionFeatures)> = Vec::new();
    let mut parts: Vec<VisionFeatures> = Vec::new();
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
    if parts.is_empty() {
        return Ok(None);
    }
    let merged: Vec<&Tensor> = parts.iter().map(|f| &f.merged).collect();
    let layers = parts[0].deepstack.len();
    let deepstack = (0..layers)
        .map(|l| {
            Tensor::cat(
                &parts.iter().map(|f| &f.deepstack[l]).collect::<Vec<_>>(),
                0,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(VisionFeatures {
        merged: Tensor::cat(&merged, 0)?,
        deepstack,
        at: None,
    }))
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
