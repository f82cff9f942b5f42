//! The decoder-only transformer shared by actor, reference, critic and reward model:
//! embedding → layers → final norm → LM head, with the choice of how each layer runs (the
//! hand-written layer, its recomputation, or the composition of `block.rs`), the fused LM
//! head, and the execution settings ([`Exec`]). Shapes are noted as `[batch, seq, hidden]` etc.
//!
//! Follows HF transformers' `modeling_llama.py` / `modeling_qwen2.py` (weight names and math).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::{Init, Linear, VarBuilder};

use super::attention::Keys as AttnKeys;
use super::block::{
    block_forward_routed, linear, norm, upcast, Attention, Block, DeepseekMoe, Experts, Gated,
    KvCache, Mask, Mixer, Mlp, Rows, Shared,
};
use super::config::{LayerKind, ModelArgs};
use super::layer::Seg;
use super::lm_head::{HeadOut, HeadStats};
use super::proj::{mix64, Proj};
use super::vision::{VisionFeatures, VisionTower};

/// MiMo's multi-token-prediction layers (`model.mtp_layers.N.*`): read through `m` so that
/// they are variables of the model's map, with the shapes MiMo's checkpoints have (a missing
/// or misshapen one is refused by name when loading), and saved back with the model. The
/// forward never runs them (MiMo's forward does not either), and the trainer leaves them out
/// of what it updates.
fn read_mtp_layers(m: &VarBuilder, args: &ModelArgs) -> Result<()> {
    let (q, kv) = (
        args.num_attention_heads * args.head_dim,
        args.num_key_value_heads * args.head_dim,
    );
    for i in 0..args.mtp_layers {
        let l = m.pp(format!("mtp_layers.{i}"));
        let tensors =
            super::config::mtp_layer_tensors(args.hidden_size, q, kv, args.intermediate_size);
        for (name, shape) in tensors {
            let init = match (name.ends_with("norm.weight"), name.ends_with(".bias")) {
                (true, _) => Init::Const(1.0),
                (_, true) => Init::Const(0.0),
                _ => Init::Randn {
                    mean: 0.0,
                    stdev: 0.02,
                },
            };
            l.get_with_hints(shape, name, init)?;
        }
    }
    Ok(())
}

/// The transformer with an optional LM head (`None` for a critic / reward backbone).
pub struct CausalLm {
    pub args: ModelArgs,
    embed: Tensor,
    layers: Vec<Block>,
    norm: Tensor,
    /// `[vocab, hidden]` when the output embedding is not tied.
    lm_head: Option<Tensor>,
    has_lm_head: bool,
    device: Device,
    dtype: DType,
    /// How forwards run (recomputation, composition, bf16 products).
    exec: Exec,
    /// Adapter dropout of training forwards (`None`: off, and always in views).
    dropout: Option<Arc<DropoutStream>>,
    /// The router's load-balancing loss of the latest forward that built a graph, for a
    /// Qwen3-MoE model whose config asks for it ([`CausalLm::take_router_aux_loss`]).
    router_aux: std::sync::Mutex<Option<Tensor>>,
    /// A vision-language model's vision tower (`visual.*`).
    vision: Option<VisionTower>,
}

/// How a model's forwards run, as opposed to what the model computes: every setting gives the
/// same function (to rounding), at other speeds and memory. Set once where a model is set up
/// ([`CausalLm::set_exec`]); views from [`CausalLm::no_grad`] inherit `composed` and `bf16`
/// (they build no graph, so there is nothing to recompute).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Exec {
    /// Per-layer recomputation (verl's `enable_gradient_checkpointing`): a training forward
    /// keeps only each layer's input, and backward runs the layer again to get its gradients
    /// (`recompute.rs`). Same gradients, far less memory, about one more forward of compute.
    /// Applies on the CPU and on CUDA.
    pub recompute: bool,
    /// Every layer as the plain candle composition (`block.rs`) instead of the hand-written
    /// layer (`layer.rs`, one op per layer with its own backward, on the CPU in f32/f64): the
    /// reference the hand-written layer is tested against (slower; same results to rounding).
    pub composed: bool,
    /// verl's mixed precision (`fsdp_config.mixed_precision.param_dtype: bf16`, the rollout's
    /// `dtype: bfloat16`): the matrix products of the layers' projections, the LM head and
    /// decoding round both operands to bf16 and sum in f32, while weights, norms, softmax,
    /// residuals, losses and optimizer state stay f32. On the CPU the hand-written layers do it
    /// on AMX tiles or AVX512-BF16 (`kernels::bf16`; without them products stay f32); on CUDA
    /// the composition's projections and LM head run as bf16 cuBLAS products of f32 master
    /// weights cast per forward. Applies to f32 models ([`CausalLm::bf16_matmuls`] tells).
    pub bf16: bool,
    /// Layers of experts (Qwen3-MoE) compute every expert on every token, weighted by zero
    /// where a token was not routed: the reference the grouped computation (each expert on
    /// its own tokens only, the default) is tested and benchmarked against.
    pub dense_experts: bool,
}

/// How one layer of one forward runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LayerPath {
    /// Training on the CPU: one op per layer (the hand-written layer when `fused`, else the
    /// composition inside it), recomputed in backward when `recompute`.
    Op { fused: bool, recompute: bool },
    /// No graph wanted (rollout log-probs, reference): the hand-written layer.
    Fused,
    /// The composition of candle ops (CUDA, half precision, a KV cache, or `composed`).
    Composed,
}

impl LayerPath {
    /// The path for a layer of a `dtype` model on `device`: `training` when the forward
    /// builds a graph, `cached` when it reads and extends a KV cache.
    fn choose(
        exec: Exec,
        layer: &Block,
        device: &Device,
        dtype: DType,
        training: bool,
        cached: bool,
    ) -> Self {
        let fused =
            !exec.composed && hand_written(layer) && crate::kernels::supported(device, dtype);
        // The layer as one op (hand-written, or recomputed in backward) where custom ops run:
        // the CPU, and CUDA builds on a GPU (recomputation of the composition only).
        let op_device = device.is_cpu() || (cfg!(feature = "cuda") && device.is_cuda());
        let cpu_train = !cached && op_device && training;
        if cpu_train && (exec.recompute || fused) {
            LayerPath::Op {
                fused,
                recompute: exec.recompute,
            }
        } else if !cached && !cpu_train && fused {
            LayerPath::Fused
        } else {
            LayerPath::Composed
        }
    }
}

/// Whether the hand-written layer serves layer `l`: attention layers (every family's, Qwen3.5's
/// gated ones with partial rotary embeddings included) with a dense MLP or a layer of experts
/// computed per expert (with or without a shared expert). Gated DeltaNet layers, DeepSeek-V3's
/// latent attention and routing, and experts computed densely (the reference,
/// [`Exec::dense_experts`]) run as the composition.
pub(super) fn hand_written(l: &Block) -> bool {
    let plain_experts = |x: &super::block::Experts| {
        !x.dense && x.deepseek.is_none() && x.router_bias.is_none() && x.swiglu.is_none()
    };
    let plain_attention = |a: &super::block::Attention| a.sinks.is_none() && a.softcap.is_none();
    l.attention().is_ok_and(plain_attention) && l.experts().is_none_or(plain_experts)
}

/// PEFT's `lora_dropout` for a model's training forwards: each forward that builds a graph
/// takes the next number of the stream, and every adapted projection of that forward masks
/// its adapter input with a seed mixed from (seed, that number, layer, projection).
struct DropoutStream {
    p: f64,
    seed: u64,
    next: AtomicU64,
}

impl CausalLm {
    /// Builds the model from `vb` (weights named as HF checkpoints: `model.layers.N...`,
    /// `lm_head.weight`). From a `VarMap` the weights are trainable `Var`s.
    pub fn new(args: &ModelArgs, vb: VarBuilder, with_lm_head: bool) -> Result<Self> {
        let h = args.hidden_size;
        let m = vb.pp("model");
        let embed = m.get_with_hints(
            (args.vocab_size, h),
            "embed_tokens.weight",
            Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
        )?;
        // Grown layer by layer, not reserved: the count comes from a file's header, which a
        // checkpoint's variables (see `hf::build`) must back one tensor at a time.
        let mut layers = Vec::new();
        for i in 0..args.num_hidden_layers {
            let l = m.pp(format!("layers.{i}"));
            let a = l.pp("self_attn");
            let p = l.pp("mlp");
            let gemma = args.arch.gemma();
            // Gemma's `post_attention_layernorm` norms the attention's output; its pre-MLP norm
            // is `pre_feedforward_layernorm` (Llama's pre-MLP norm is the former).
            let pre_mlp = match gemma {
                true => "pre_feedforward_layernorm.weight",
                false => "post_attention_layernorm.weight",
            };
            // Gemma's and Qwen3.5's norms scale by 1 + w: a fresh one starts at w = 0.
            let one = Init::Const(1.0 - args.arch.norm_offset());
            layers.push(Block {
                ln1: l.get_with_hints(h, "input_layernorm.weight", one)?,
                ln2: l.get_with_hints(h, pre_mlp, one)?,
                sandwich: match gemma {
                    true => Some((
                        l.get_with_hints(h, "post_attention_layernorm.weight", one)?,
                        l.get_with_hints(h, "post_feedforward_layernorm.weight", one)?,
                    )),
                    false => None,
                },
                window: args.window(i),
                local_rope: args.local_rope() && args.layer_kind(i) == LayerKind::Sliding,
                mixed: false,
                blocked: false,
                mixer: match (&args.linear_attn, args.is_linear(i), &args.mla) {
                    (Some(la), true, _) => {
                        Mixer::Delta(super::delta::DeltaNet::new(&l.pp("linear_attn"), args, la)?)
                    }
                    (_, _, Some(ma)) => Mixer::Mla(super::mla::Mla::new(&a, args, ma)?),
                    _ => Mixer::Attention(attention_weights(&a, args, one)?),
                },
                mlp: match args.moe.as_ref().filter(|m| m.sparse(i)) {
                    None => Mlp::Dense(gated(&p, h, args.intermediate_size)?),
                    Some(moe) => Mlp::Experts(experts(&p, h, moe)?),
                },
            });
        }
        let final_one = Init::Const(1.0 - args.arch.norm_offset());
        let norm = m.get_with_hints(h, "norm.weight", final_one)?;
        read_mtp_layers(&m, args)?;
        let lm_head = if with_lm_head && !args.tie_word_embeddings {
            Some(vb.get_with_hints(
                (args.vocab_size, h),
                "lm_head.weight",
                Init::Randn {
                    mean: 0.0,
                    stdev: 0.02,
                },
            )?)
        } else {
            None
        };
        let vision = match &args.vision {
            Some(v) => Some(VisionTower::new(v, vb.pp("visual"))?),
            None => None,
        };
        let mut m = Self {
            args: args.clone(),
            embed,
            layers,
            norm,
            lm_head,
            has_lm_head: with_lm_head,
            device: vb.device().clone(),
            dtype: vb.dtype(),
            exec: Exec::default(),
            dropout: None,
            router_aux: Default::default(),
            vision,
        };
        // The layers' per-device settings (blocked attention off the CPU) for the defaults.
        m.set_exec(Exec::default());
        Ok(m)
    }

    /// A view of this model whose weights are detached from autograd: it shares their storage
    /// (so it sees every optimizer update) but builds no backward graph, so forward passes keep
    /// no activations alive. Use it for generation and for log-prob passes without gradient.
    pub fn no_grad(&self) -> CausalLm {
        CausalLm {
            args: self.args.clone(),
            embed: self.embed.detach(),
            layers: self.layers.iter().map(Block::detached).collect(),
            norm: self.norm.detach(),
            lm_head: self.lm_head.as_ref().map(Tensor::detach),
            has_lm_head: self.has_lm_head,
            device: self.device.clone(),
            dtype: self.dtype,
            exec: Exec {
                recompute: false,
                ..self.exec
            },
            dropout: None,
            router_aux: Default::default(),
            vision: self.vision.as_ref().map(VisionTower::detached),
        }
    }

    /// The base model: a detached view with every adapter switched off (PEFT's
    /// `disable_adapter()`), sharing the base weights' storage. With LoRA this is the
    /// reference policy, so no second copy of the model is loaded.
    pub fn without_adapters(&self) -> CausalLm {
        let mut m = self.no_grad();
        m.layers = m
            .layers
            .iter()
            .map(|b| {
                b.map_proj(|p| Proj {
                    base: p.base.clone(),
                    lora: None,
                })
            })
            .collect();
        m
    }

    /// A detached copy whose adapted projections hold `W + s·B·A` and no adapter (new tensors
    /// for those projections; everything else shares storage).
    pub fn merged(&self) -> Result<CausalLm> {
        let mut m = self.no_grad();
        for b in m.layers.iter_mut() {
            for (_, p) in b.projs_mut() {
                if p.lora.is_some() {
                    *p = Proj::new(Linear::new(p.merged_weight()?, p.bias().cloned()));
                }
            }
        }
        Ok(m)
    }

    /// PEFT's `lora_dropout` on the adapters' inputs in this model's training forwards
    /// (forwards that build a graph; views from [`CausalLm::no_grad`], and so rollout,
    /// log-prob recomputation and the reference, never drop). `p` = 0 turns it off; `seed`
    /// starts the mask stream (see [`CausalLm::set_dropout_position`]).
    pub fn set_adapter_dropout(&mut self, p: f64, seed: u64) -> std::result::Result<(), String> {
        if !(0.0..1.0).contains(&p) {
            return Err(format!("lora_dropout must be in [0, 1), got {p}"));
        }
        self.dropout = (p > 0.0).then(|| {
            Arc::new(DropoutStream {
                p,
                seed,
                next: AtomicU64::new(0),
            })
        });
        Ok(())
    }

    /// The adapter dropout probability of training forwards (0 when off).
    pub fn adapter_dropout(&self) -> f64 {
        self.dropout.as_ref().map_or(0.0, |d| d.p)
    }

    /// Moves the dropout mask stream to `position` (the trainer sets `step · 2³²` before each
    /// update, so the masks depend on the step and the forward's order within it, and a
    /// resumed run draws the same ones).
    pub fn set_dropout_position(&self, position: u64) {
        if let Some(d) = &self.dropout {
            d.next.store(position, Ordering::Relaxed);
        }
    }

    /// Whether any projection carries an adapter.
    pub fn has_adapters(&self) -> bool {
        self.layers
            .iter()
            .any(|b| b.projs().iter().any(|p| p.lora.is_some()))
    }

    /// Cuts every base weight (embedding, norms, projections, LM head) from autograd, in place:
    /// they keep their storage but receive no gradient; adapters stay trainable.
    pub fn freeze_base(&mut self) {
        self.embed = self.embed.detach();
        self.norm = self.norm.detach();
        self.lm_head = self.lm_head.as_ref().map(Tensor::detach);
        self.freeze_vision();
        for b in self.layers.iter_mut() {
            b.freeze_base();
        }
    }

    /// Cuts the vision tower's weights from autograd, in place (verl's
    /// `freeze_vision_tower`): image features still flow into the language model, but the
    /// tower receives no gradient.
    pub fn freeze_vision(&mut self) {
        self.vision = self.vision.as_ref().map(VisionTower::detached);
    }

    /// The vision tower of a vision-language model.
    pub fn vision(&self) -> Option<&VisionTower> {
        self.vision.as_ref()
    }

    /// The vision features of images whose patches are `pixels` `[patches, C·T·P·P]` and
    /// grids `grids` (`(t, h, w)` each), in order: the merged features `[patches / m², hidden]`
    /// that replace the image placeholder tokens' embeddings, and Qwen3-VL's DeepStack
    /// features. An error for a model without a tower.
    pub fn image_features(&self, pixels: &Tensor, grids: &[[usize; 3]]) -> Result<VisionFeatures> {
        match &self.vision {
            Some(v) => v.forward(&pixels.to_device(&self.device)?, grids),
            None => candle_core::bail!(
                "images given to a {:?} model, which has no vision tower",
                self.args.arch
            ),
        }
    }

    pub(crate) fn blocks_mut(&mut self) -> &mut [Block] {
        &mut self.layers
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How this model's forwards run.
    pub fn exec(&self) -> Exec {
        self.exec
    }

    /// Sets how this model's forwards run (see [`Exec`]).
    pub fn set_exec(&mut self, exec: Exec) {
        self.exec = exec;
        let (mixed, blocked) = (self.mixed_products(), self.blocked_attention());
        for l in self.layers.iter_mut() {
            l.mixed = mixed;
            // Latent attention, sinks and soft-capped scores run as their own composition over
            // a bias.
            l.blocked = blocked && !self.args.special_attention();
            if let Mlp::Experts(e) = &mut l.mlp {
                e.dense = exec.dense_experts;
            }
        }
    }

    /// Whether products actually run in bf16: asked for, an f32 model, and on the CPU a bf16
    /// kernel present (every CPU has one unless MAIN_PPO_BF16_KERNEL=none); on a GPU cuBLAS serves them.
    pub fn bf16_matmuls(&self) -> bool {
        self.exec.bf16
            && self.dtype == DType::F32
            && (self.device.is_cuda() || crate::kernels::bf16::available())
    }

    /// Whether the op composition takes its products in bf16: off the CPU (cuBLAS), and on the
    /// CPU (its bf16 kernels) for the Gated DeltaNet hybrids, whose DeltaNet layers run as the
    /// composition (their attention layers take bf16 products on the hand-written layer), and
    /// for DeepSeek-V3, GLM-4.5 and GPT-OSS, whose latent attention, sinks or experts run as the
    /// composition.
    fn mixed_products(&self) -> bool {
        let composed = !self.args.all_attention()
            || self.args.special_attention()
            || self.args.deepseek_routing();
        let cpu = self.device.is_cpu() && composed && crate::kernels::bf16::available();
        self.exec.bf16 && self.dtype == DType::F32 && (!self.device.is_cpu() || cpu)
    }

    /// `x·Wᵀ` for the LM head's output projection `w` `[vocab, hidden]` on `x` `[n, hidden]`:
    /// bf16 operands when the composition runs mixed precision (see [`Exec::bf16`]).
    /// Gemma 2's `final_logit_softcapping` `c` turns the logits into `c·tanh(z/c)`.
    fn head_matmul(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let z = match self.mixed_products() {
            true => super::proj::bf16_matmul(x, w)?,
            false => x.matmul(&w.t()?)?,
        };
        match self.args.final_logit_softcapping {
            Some(c) => (z / c)?.tanh()? * c,
            None => Ok(z),
        }
    }

    pub(super) fn blocks(&self) -> &[Block] {
        &self.layers
    }

    /// The input embedding `[vocab, hidden]`.
    pub(super) fn embedding(&self) -> &Tensor {
        &self.embed
    }

    /// The final RMSNorm weight `[hidden]`.
    pub(super) fn final_norm(&self) -> &Tensor {
        &self.norm
    }

    /// RoPE inverse frequencies `[head_dim / 2]` (`theta^(-2i / head_dim)`, scaled as the
    /// config's `rope_scaling` says), shared by the composition and the packed decode path.
    pub fn inv_freq(&self) -> Vec<f64> {
        self.args.inv_freq()
    }

    /// The output projection `[vocab, hidden]` (the embedding when tied).
    pub fn output_weight(&self) -> Result<&Tensor> {
        if !self.has_lm_head {
            return Err(candle_core::Error::Msg(
                "this model was built without an LM head".into(),
            ));
        }
        Ok(self.lm_head.as_ref().unwrap_or(&self.embed))
    }

    /// Final hidden states `[batch, seq, hidden]` of `input_ids` `[batch, seq]` (u32) at
    /// `position_ids` `[batch, seq]` (u32). `key_mask` `[batch, past + seq]` marks real tokens
    /// (1) and padding (0) over the cached and the new positions. With a cache, its keys and
    /// values are used and extended.
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        key_mask: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        self.run(
            input_ids,
            position_ids,
            Keys::Mask(key_mask),
            cache,
            None,
            None,
        )
    }

    /// [`CausalLm::forward_hidden`] of a vision-language model with images: `position_ids`
    /// `[3, batch, seq]` (temporal, row, column; [`super::vision::mrope_positions`]) or
    /// `[batch, seq]` for text alone, and `images` the merged vision features
    /// `[placeholders, hidden]` ([`CausalLm::image_features`]) that replace, in order, the
    /// embeddings of the image placeholder tokens of `input_ids` (row by row). Gradients reach
    /// the features, and through them the vision tower.
    pub fn forward_hidden_images(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        key_mask: &Tensor,
        images: Option<&VisionFeatures>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        self.run(
            input_ids,
            position_ids,
            Keys::Mask(key_mask),
            cache,
            None,
            images,
        )
    }

    /// [`CausalLm::forward_hidden_packed`] with images: `position_ids` `[3, n]` (or `[n]`),
    /// `images` as [`CausalLm::forward_hidden_images`] takes them.
    pub fn forward_hidden_packed_images(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        segments: &[(usize, usize)],
        images: Option<&VisionFeatures>,
    ) -> Result<Tensor> {
        let segs: Vec<Seg> = segments.iter().copied().map(Seg::alone).collect();
        self.run_packed_images(input_ids, position_ids, segs, images)
    }

    /// Final hidden states `[n, hidden]` of sequences packed end to end (verl's
    /// `use_remove_padding`): `input_ids` and `position_ids` `[n]` (u32, positions counted from
    /// each sequence's start), `segments` the `(first token, length)` of each sequence, in
    /// order and covering all `n` tokens. Each token attends to the earlier tokens of its own
    /// sequence only, so a sequence's states equal those of the padded batch
    /// ([`CausalLm::forward_hidden`]) at its real tokens, and no padding is computed.
    /// The hand-written layer and the blocked attention (CUDA) run it without an `[n, n]` mask;
    /// the plain composition (half precision on the CPU) builds a block-diagonal bias, so
    /// prefer padding there ([`CausalLm::packs_without_padding`]).
    pub fn forward_hidden_packed(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        segments: &[(usize, usize)],
    ) -> Result<Tensor> {
        let segs: Vec<Seg> = segments.iter().copied().map(Seg::alone).collect();
        self.run_packed(input_ids, position_ids, segs)
    }

    /// [`CausalLm::forward_hidden_packed`] where some sequences continue another one's tokens
    /// (verl's `use_prefix_grouper`: a group's responses after their shared prompt, the prompt
    /// computed once): `continues[i] = Some(j)` makes sequence `i` see all of sequence `j`
    /// (an earlier one that continues none) before its own tokens, causally after them, with
    /// positions counted on from `j`'s length (the caller's `position_ids`). Each continuing
    /// sequence's states equal those of `j`'s tokens followed by its own in a forward of their
    /// own, and in backward the prefix's gradients gather every continuation's. Gated DeltaNet
    /// layers carry no state between sequences and refuse a continuation
    /// ([`CausalLm::shares_prefixes`]).
    pub fn forward_hidden_grouped(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        segments: &[(usize, usize)],
        continues: &[Option<usize>],
    ) -> Result<Tensor> {
        if continues.len() != segments.len() {
            candle_core::bail!(
                "grouped forward: {} sequences but {} continuation entries",
                segments.len(),
                continues.len()
            );
        }
        let mut segs = Vec::with_capacity(segments.len());
        for (i, (&span, &c)) in segments.iter().zip(continues).enumerate() {
            let prefix = match c {
                None => None,
                Some(j) if j < i && continues[j].is_none() => Some(segments[j]),
                Some(j) => candle_core::bail!(
                    "grouped forward: sequence {i} continues sequence {j}, which is not an \
                     earlier sequence continuing none"
                ),
            };
            segs.push(Seg {
                prefix,
                ..Seg::alone(span)
            });
        }
        if segs.iter().any(|s| s.prefix.is_some())
            && self.layers.iter().any(|l| l.delta().is_some())
        {
            candle_core::bail!(
                "grouped forward: this model has Gated DeltaNet layers, which carry no state \
                 between sequences: a shared prefix cannot be continued"
            );
        }
        self.run_packed(input_ids, position_ids, segs)
    }

    /// The packed forwards: `[n]` ids and positions, sequences `segs`.
    fn run_packed(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        segs: Vec<Seg>,
    ) -> Result<Tensor> {
        self.run_packed_images(input_ids, position_ids, segs, None)
    }

    /// [`CausalLm::run_packed`] with image features; `position_ids` `[n]` or `[3, n]`.
    fn run_packed_images(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        segs: Vec<Seg>,
        images: Option<&VisionFeatures>,
    ) -> Result<Tensor> {
        let n = input_ids.dims1()?;
        if position_ids.dim(D::Minus1)? != n || position_ids.rank() > 2 {
            candle_core::bail!(
                "packed forward: {n} token ids but position ids {:?}",
                position_ids.dims()
            );
        }
        if let Err(rule) = super::layer::check_segments(&segs, n) {
            candle_core::bail!("packed forward: {rule}");
        }
        // [1, n], or [3, 1, n] for multimodal positions.
        let positions = position_ids.unsqueeze(position_ids.rank() - 1)?;
        let h = self.run(
            &input_ids.unsqueeze(0)?,
            &positions,
            Keys::Packed(segs.into()),
            None,
            None,
            images,
        )?; // [1, n, h]
        h.squeeze(0)
    }

    /// Whether [`CausalLm::forward_hidden_grouped`] computes a shared prefix once here without
    /// extra work: packed sequences run without padding ([`CausalLm::packs_without_padding`])
    /// on the hand-written layer (CPU), and no layer is a Gated DeltaNet. Elsewhere the grouped
    /// forward still gives the same numbers (through a dense bias) where it runs at all: the
    /// trainer then computes each response with its own copy of the prompt.
    pub fn shares_prefixes(&self) -> bool {
        self.packs_without_padding() && self.device.is_cpu() && self.layers.iter().all(hand_written)
    }

    /// Whether [`CausalLm::forward_hidden_packed`] runs without padding work here: the
    /// hand-written layer serves every attention layer (CPU, f32/f64, not forced to the
    /// composition, no layer of experts computed densely; Gated DeltaNet layers read the
    /// packed sequences as they are), or its attention is the blocked
    /// op (CUDA, not forced to the composition).
    pub fn packs_without_padding(&self) -> bool {
        let cpu = self
            .layers
            .iter()
            .all(|l| l.delta().is_some() || hand_written(l))
            && crate::kernels::supported(&self.device, self.dtype);
        !self.exec.composed && (cpu || self.blocked_attention())
    }

    /// Whether attention without a cache runs as the blocked op of `attention.rs` (off the
    /// CPU, unless forced to the plain composition).
    fn blocked_attention(&self) -> bool {
        !self.exec.composed && !self.device.is_cpu() && self.args.mla.is_none()
    }

    /// The MLP of layer `layer` alone on `h` `[batch, seq, hidden]` (its input after the
    /// pre-MLP norm): the dense MLP, or the layer of experts computed as [`Exec::dense_experts`]
    /// says. For measuring and testing one layer's MLP apart from the rest of the model.
    pub fn mlp_forward(&self, layer: usize, h: &Tensor) -> Result<Tensor> {
        let l = self.layers.get(layer).ok_or_else(|| {
            candle_core::Error::Msg(format!("layer {layer} of {}", self.layers.len()))
        })?;
        super::block::mlp(l, h, self.args.arch.gemma())
    }

    /// Whether some layer is a mixture of experts (Qwen3-MoE).
    pub fn has_experts(&self) -> bool {
        self.layers.iter().any(|l| l.experts().is_some())
    }

    /// Every stage of a forward without cache (transformers' `output_hidden_states`, plus the
    /// final norm): the embedding output, each layer's output, then the normed final hidden
    /// state, `num_hidden_layers + 2` tensors of `[batch, seq, hidden]`. For comparing with
    /// other implementations layer by layer.
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        key_mask: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let mut all = Vec::with_capacity(self.layers.len() + 2);
        let last = self.run(
            input_ids,
            position_ids,
            Keys::Mask(key_mask),
            None,
            Some(&mut all),
            None,
        )?;
        all.push(last);
        Ok(all)
    }

    /// [`CausalLm::forward_hidden`], pushing the embedding and each layer's output to
    /// `stages` when given.
    fn run(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        keys: Keys,
        mut cache: Option<&mut KvCache>,
        mut stages: Option<&mut Vec<Tensor>>,
        images: Option<&VisionFeatures>,
    ) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let past = cache.as_ref().map(|c| c.len()).unwrap_or(0);
        let a = &self.args;
        // Per layer kind (0: full, 1: sliding window): rotary tables [b, 1, t, head_dim] and
        // which keys each query sees.
        let (global, local) = self.rotary_tables(position_ids)?;
        // The real tokens of a padded forward (for the router's load-balancing loss).
        let keys_mask = match &keys {
            Keys::Mask(m) => Some((*m).clone()),
            Keys::Packed(_) => None,
        };
        let rows = self.rows(&keys, past, t)?;
        let masks = self.masks(keys, (b, t), past)?;
        // x: [b, t, hidden]; with images, where their features go too (once per forward).
        let (mut x, placement) = self.embed_inputs(input_ids, images)?;
        // A training forward with adapter dropout: this forward's number in the mask stream.
        let dropout = self.dropout.as_ref().filter(|_| {
            cache.is_none() && self.layers.iter().any(|l| l.trains() && l.has_adapters())
        });
        let forward_seed = dropout.map(|d| {
            let n = d.next.fetch_add(1, Ordering::Relaxed);
            (d.p, mix64(d.seed ^ mix64(n)))
        });
        let mut composed_bias: [Option<AttnKeys>; 2] = [None, None];
        // A training forward of a model whose loss reads the router: each layer of experts'
        // logits `[b·t, experts]`, with their graph.
        // (The LM: a critic's or reward model's backbone has no such term.)
        let aux = self.has_lm_head && self.router_aux_coef().is_some() && cache.is_none();
        let mut router: Vec<Tensor> = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            if let Some(st) = stages.as_deref_mut() {
                st.push(x.clone());
            }
            let masked;
            let layer = match forward_seed {
                Some((p, seed)) => {
                    masked = layer.with_dropout(p, seed, i);
                    &masked
                }
                None => layer,
            };
            let slot = cache.as_deref_mut().map(|c| (c, i));
            let training = layer.trains() || x.track_op();
            let path = LayerPath::choose(
                self.exec,
                layer,
                x.device(),
                x.dtype(),
                training,
                slot.is_some(),
            );
            let kind = usize::from(layer.window.is_some());
            let mask = &masks[kind];
            let (cos, sin) = match (&local, layer.local_rope) {
                (Some(l), true) => l,
                _ => &global,
            };
            // The composition reads a bias tensor (for packed sequences built once per
            // forward and layer kind, not per layer), or packed sequences as they are where
            // its attention is the blocked op.
            let mut keys = || -> Result<AttnKeys> {
                // A Gated DeltaNet layer reads where its sequences lie, never a bias.
                if layer.delta().is_some() {
                    return mask.layer_keys(layer, self.dtype, &self.device);
                }
                if composed_bias[kind].is_none() {
                    composed_bias[kind] = Some(mask.layer_keys(layer, self.dtype, &self.device)?);
                }
                Ok(composed_bias[kind].clone().expect("just set"))
            };
            let bf = self.exec.bf16;
            let routed = aux && training;
            x = match path {
                LayerPath::Op { fused, recompute } => {
                    // The hand-written layer reads the mask as it is: no bias is built for it.
                    let m = match fused {
                        true => mask.clone(),
                        false => match keys()? {
                            AttnKeys::Bias(b) => Mask::Bias(b),
                            AttnKeys::Packed { .. } => mask.clone(),
                        },
                    };
                    let rope_mask = (cos, sin, &m);
                    let flags = (recompute, fused, bf);
                    let (y, logits) = super::recompute::block_routed(
                        &self.args, layer, &x, rope_mask, &rows, flags, routed,
                    )?;
                    router.extend(logits);
                    y
                }
                LayerPath::Fused => {
                    let rope_mask = (cos, sin, mask);
                    super::recompute::fused_forward(&self.args, layer, &x, rope_mask, bf)?
                }
                LayerPath::Composed => {
                    let r = routed.then_some(&mut router);
                    let keys = keys()?;
                    block_forward_routed(&self.args, layer, &x, cos, sin, &keys, &rows, slot, r)?
                }
            };
            x = self.add_deepstack(x, images, placement.as_ref(), i)?;
        }
        if let Some(st) = stages {
            st.push(x.clone());
        }
        self.keep_router_aux(&router, keys_mask)?;
        norm(&x, &self.norm, a)
    }

    /// Where a forward's sequences lie, for Gated DeltaNet layers: the `t` new positions' real
    /// tokens after `past` cached ones, or the packed sequences (nothing for other models).
    fn rows(&self, keys: &Keys, past: usize, t: usize) -> Result<Rows> {
        Ok(match (keys, self.args.linear_attn.is_some()) {
            (_, false) => Rows::Padded(None),
            (Keys::Mask(m), true) => Rows::Padded(Some(
                m.narrow(1, past, t)?
                    .to_dtype(DType::F32)?
                    .to_dtype(self.dtype)?
                    .to_device(&self.device)?,
            )),
            (Keys::Packed(s), true) => match super::layer::spans(s) {
                Some(spans) => Rows::Packed(spans.into()),
                None => candle_core::bail!(
                    "packed sequences with shared prefixes reached a model with Gated DeltaNet \
                     layers"
                ),
            },
        })
    }

    /// The rotary tables of `position_ids` for full layers, and for sliding layers where
    /// those have their own frequencies (Gemma 3's local layers).
    #[allow(clippy::type_complexity)]
    fn rotary_tables(
        &self,
        position_ids: &Tensor,
    ) -> Result<((Tensor, Tensor), Option<(Tensor, Tensor)>)> {
        let global = self.rotary(position_ids, &self.args.inv_freq())?;
        let local = match self.layers.iter().position(|l| l.local_rope) {
            Some(i) => Some(self.rotary(position_ids, &self.args.inv_freq_of(i))?),
            None => None,
        };
        Ok((global, local))
    }

    /// The embeddings of `input_ids` `[b, t]` `[b, t, hidden]`, with `images`' features over the
    /// image placeholders where given, and where those go ([`CausalLm::image_placement`]).
    fn embed_inputs(
        &self,
        input_ids: &Tensor,
        images: Option<&VisionFeatures>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let x = self.embed_ids(input_ids)?;
        let Some(f) = images else {
            return Ok((x, None));
        };
        let select = self.image_placement(input_ids, f)?;
        let (b, t, h) = x.dims3()?;
        let all = Tensor::cat(
            &[&x.reshape((b * t, h))?, &f.merged.to_dtype(x.dtype())?],
            0,
        )?;
        Ok((
            all.index_select(&select, 0)?.reshape((b, t, h))?,
            Some(select),
        ))
    }

    /// `x` `[b, t, hidden]` after layer `layer` with Qwen3-VL's DeepStack feature of that layer
    /// added at the image tokens (unchanged past the last feature or without images).
    fn add_deepstack(
        &self,
        x: Tensor,
        images: Option<&VisionFeatures>,
        placement: Option<&Tensor>,
        layer: usize,
    ) -> Result<Tensor> {
        let (Some(d), Some(select)) = (images.and_then(|f| f.deepstack.get(layer)), placement)
        else {
            return Ok(x);
        };
        let (b, t, h) = x.dims3()?;
        // Text rows read a zero row, image rows their feature.
        let zero = Tensor::zeros((b * t, h), x.dtype(), x.device())?;
        let extra = Tensor::cat(&[&zero, &d.to_dtype(x.dtype())?], 0)?.index_select(select, 0)?;
        x + extra.reshape((b, t, h))?
    }

    /// Where image features go in a forward of `input_ids` `[b, t]`: for each of the `b·t`
    /// tokens its own index (text) or `b·t + k` (feature `k`), as one index tensor over the
    /// rows followed by the features. Feature `k` goes to the `k`-th image placeholder token of
    /// `input_ids`, or to the flat position `images.at[k]` when given; their counts must agree.
    fn image_placement(&self, input_ids: &Tensor, images: &VisionFeatures) -> Result<Tensor> {
        let Some(v) = &self.args.vision else {
            candle_core::bail!("image features given to a model without a vision tower");
        };
        let (b, t) = input_ids.dims2()?;
        let (m, fh) = images.merged.dims2()?;
        let mut select: Vec<u32> = (0..(b * t) as u32).collect();
        let placed = match &images.at {
            Some(at) => {
                for (k, &p) in at.iter().enumerate() {
                    match select.get_mut(p as usize) {
                        Some(s) => *s = (b * t + k) as u32,
                        None => candle_core::bail!(
                            "image feature {k} placed at token {p} of a {b}×{t} input"
                        ),
                    }
                }
                at.len()
            }
            None => {
                let ids: Vec<u32> = input_ids.flatten_all()?.to_vec1()?;
                let mut next = 0;
                for (p, _) in ids
                    .iter()
                    .enumerate()
                    .filter(|(_, &i)| i == v.image_token_id)
                {
                    select[p] = (b * t + next) as u32;
                    next += 1;
                }
                next
            }
        };
        let h = self.args.hidden_size;
        if placed != m || fh != h {
            candle_core::bail!(
                "{placed} image placeholder tokens (id {}) but image features {:?} (expected [{placed}, {h}])",
                v.image_token_id,
                images.merged.dims()
            );
        }
        Tensor::new(select.as_slice(), &self.device)
    }

    /// The embeddings of `input_ids` `[b, t]`: `[b, t, hidden]` (times √hidden for Gemma).
    fn embed_ids(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let x = super::grad_sink::lookup(&self.embed, &input_ids.flatten_all()?)?.reshape((
            b,
            t,
            self.args.hidden_size,
        ))?;
        match self.args.embed_scale() {
            Some(scale) => x * scale,
            None => Ok(x),
        }
    }

    /// Keeps the router's load-balancing loss of a training forward from its layers of
    /// experts' logits `router` (none: nothing to keep), over the real tokens of `key_mask`
    /// (packed sequences have no padding) for [`CausalLm::take_router_aux_loss`].
    fn keep_router_aux(&self, router: &[Tensor], key_mask: Option<Tensor>) -> Result<()> {
        if router.is_empty() {
            return Ok(());
        }
        let real = key_mask.map(|m| m.flatten_all()).transpose()?;
        let loss = self.router_aux_loss(router, real.as_ref())?;
        *self.router_aux_slot()? = Some(loss);
        Ok(())
    }

    /// Which keys each query of a forward sees, per layer kind (0: full, 1: sliding window):
    /// for a key mask `[b, past + t]`, attention biases `[b, 1, t, past + t]` built where the
    /// model is (no host loop, no copy up on a GPU); packed sequences as they are.
    fn masks(&self, keys: Keys, (b, t): (usize, usize), past: usize) -> Result<[Mask; 2]> {
        let s = past + t;
        Ok(match keys {
            Keys::Mask(key_mask) => {
                if key_mask.dims2()? != (b, s) {
                    return Err(candle_core::Error::Msg(format!(
                        "key_mask must be [{b}, {s}] (batch, past + new), got {:?}",
                        key_mask.dims()
                    )));
                }
                let bias = |w: Option<usize>| -> Result<Tensor> {
                    if !self.device.is_cpu() {
                        return self.attention_bias_on_device(key_mask, t, past, w);
                    }
                    let km: Vec<f32> = key_mask.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                    self.attention_bias(&km, b, t, past, w)
                };
                let full = Mask::Bias(bias(None)?);
                let sliding = match self.args.sliding_window {
                    Some(w) => Mask::Bias(bias(Some(w))?),
                    None => full.clone(),
                };
                [full, sliding]
            }
            Keys::Packed(segs) => [Mask::Packed(segs.clone()), Mask::Packed(segs)],
        })
    }

    /// The slot of the latest training forward's router loss, locked.
    fn router_aux_slot(&self) -> Result<std::sync::MutexGuard<'_, Option<Tensor>>> {
        self.router_aux
            .lock()
            .map_err(|_| candle_core::Error::Msg("router loss slot poisoned".into()))
    }

    /// `router_aux_loss_coef` where a Qwen3-MoE model's config asks for the router's
    /// load-balancing loss (`output_router_logits: true`); `None` otherwise.
    pub fn router_aux_coef(&self) -> Option<f64> {
        self.args.moe.as_ref().and_then(|m| m.router_aux_loss_coef)
    }

    /// The router's load-balancing loss of the latest training forward (a scalar with its
    /// gradient to the routers and everything below them), taken out: `None` where the model's
    /// config does not ask for it or no training forward ran since the last take.
    pub fn take_router_aux_loss(&self) -> Result<Option<Tensor>> {
        Ok(self.router_aux_slot()?.take())
    }

    /// The router's load-balancing loss as transformers' `load_balancing_loss_func` computes it
    /// from the layers of experts' logits `logits` (`[n, experts]` each, the same `n` tokens),
    /// over the tokens marked 1 in `real` `[n]` (all without it):
    ///
    /// ```text
    /// p = softmax(logits) per token and layer; top-k experts chosen as the router chooses them
    /// N = real tokens × layers of experts,  f_e = (chosen e over tokens and layers) / N
    /// P_e = (Σ p_e over tokens and layers) / N,  loss = experts · Σ_e f_e · P_e
    /// ```
    ///
    /// with its gradient through `p` (the choice counts are constants). 0 without real tokens.
    pub fn router_aux_loss(&self, logits: &[Tensor], real: Option<&Tensor>) -> Result<Tensor> {
        let Some(moe) = &self.args.moe else {
            candle_core::bail!("router loss: the model has no experts");
        };
        let (e, k) = (moe.num_experts, moe.num_experts_per_tok);
        let n = match logits.first() {
            Some(l) => l.dim(0)?,
            None => candle_core::bail!("router loss: no router logits"),
        };
        let all = upcast(&Tensor::cat(logits, 0)?)?; // [layers·n, experts]
        let probs = candle_nn::ops::softmax(&all, D::Minus1)?;
        let real: Vec<f64> = match real {
            Some(m) => m.to_dtype(DType::F64)?.to_vec1()?,
            None => vec![1.0; n],
        };
        if real.len() != n {
            candle_core::bail!("router loss: {} token marks for {n} tokens", real.len());
        }
        // How often each expert was chosen, over real tokens and layers.
        let p: Vec<f64> = probs.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let mut count = vec![0f64; e];
        let mut order: Vec<usize> = Vec::with_capacity(e);
        for (row, pr) in p.chunks(e).enumerate() {
            if real[row % n] == 0.0 {
                continue;
            }
            order.clear();
            order.extend(0..e);
            order.sort_by(|&a, &b| pr[b].total_cmp(&pr[a]).then(a.cmp(&b)));
            for &c in &order[..k] {
                count[c] += 1.0;
            }
        }
        let total = real.iter().filter(|&&r| r != 0.0).count() * logits.len();
        let dtype = probs.dtype();
        if total == 0 {
            return Tensor::zeros((), dtype, probs.device());
        }
        let nn = total as f64;
        let coef: Vec<f64> = count.iter().map(|c| e as f64 * c / (nn * nn)).collect();
        let coef = Tensor::from_vec(coef, (1, e), probs.device())?.to_dtype(dtype)?;
        let marks: Vec<f64> = (0..logits.len())
            .flat_map(|_| real.iter().copied())
            .collect();
        let marks =
            Tensor::from_vec(marks, (logits.len() * n, 1), probs.device())?.to_dtype(dtype)?;
        probs.broadcast_mul(&marks)?.broadcast_mul(&coef)?.sum_all()
    }

    /// Logits `[batch, seq, vocab]` (f32 for half-precision models) from hidden states. Prefer
    /// [`CausalLm::token_logprobs`] for long sequences: it never holds all the logits at once.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let (b, t, h) = hidden.dims3()?;
        let rows = hidden.reshape((b * t, h))?;
        upcast(
            &self
                .head_matmul(&rows, self.output_weight()?)?
                .reshape((b, t, ()))?,
        )
    }

    /// Log-probabilities of `targets` `[batch, seq]` under the logits at `hidden`
    /// `[batch, seq, hidden]`, and the entropy of each position's distribution when asked,
    /// computed `chunk` positions at a time: `[batch, seq]` each (f32 for half-precision models).
    ///
    /// This is the fused op of `lm_head.rs` (backward recomputes the logits chunk by chunk, so
    /// nothing of size `[positions, vocab]` is kept for it): on host slices on the CPU (f32,
    /// f64), as chunked tensor operations on a GPU; half precision on the CPU, or
    /// [`Exec::composed`] on a GPU, runs the composition
    /// [`CausalLm::token_logprobs_composed`].
    pub fn token_logprobs(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        chunk: usize,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let stats = HeadStats {
            entropy: with_entropy,
            sum_pi_squared: false,
        };
        let out = self.token_stats(hidden, targets, chunk, stats)?;
        Ok((out.log_probs, out.entropy))
    }

    /// [`CausalLm::token_logprobs`] with the statistics `stats` asks for: the entropy and Σ p²
    /// (detached), `[batch, seq]` each.
    pub fn token_stats(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        chunk: usize,
        stats: HeadStats,
    ) -> Result<HeadOut> {
        let cpu = crate::kernels::supported(hidden.device(), hidden.dtype());
        let device = !hidden.device().is_cpu() && !self.exec.composed;
        // The fused op knows no soft-capping: Gemma 2's logits go through the composition.
        if (!cpu && !device) || self.args.final_logit_softcapping.is_some() {
            return self.token_stats_composed(hidden, targets, chunk, stats);
        }
        let (b, t, h) = hidden.dims3()?;
        let out = super::lm_head::token_stats_fused(
            &hidden.reshape((b * t, h))?,
            self.output_weight()?,
            targets,
            chunk,
            stats,
            if cpu {
                self.exec.bf16
            } else {
                self.mixed_products()
            },
        )?;
        let rows = |x: Option<Tensor>| x.map(|e| e.reshape((b, t))).transpose();
        Ok(HeadOut {
            log_probs: out.log_probs.reshape((b, t))?,
            entropy: rows(out.entropy)?,
            sum_pi_squared: rows(out.sum_pi_squared)?,
        })
    }

    /// The log-softmax of the logits at `hidden` (`[b, t, h]`), `chunk` positions at a time:
    /// `f(first position, [n, vocab] log-probs)` for each chunk (f32 for half precision).
    fn log_softmax_chunks(
        &self,
        hidden: &Tensor,
        chunk: usize,
        mut f: impl FnMut(usize, Tensor) -> Result<()>,
    ) -> Result<()> {
        let (b, t, h) = hidden.dims3()?;
        let rows = hidden.reshape((b * t, h))?;
        let w = self.output_weight()?;
        let mut start = 0;
        while start < b * t {
            let n = chunk.max(1).min(b * t - start);
            let logits = upcast(&self.head_matmul(&rows.narrow(0, start, n)?, w)?)?; // [n, vocab]
            f(start, candle_nn::ops::log_softmax(&logits, D::Minus1)?)?;
            start += n;
        }
        Ok(())
    }

    /// The `k` largest log-probs of each position's distribution (log-softmax of the logits at
    /// `hidden` `[b, t, h]`), largest first, and their token ids: `([b·t, k]` f32, `[b·t, k]`
    /// u32`)`, detached, `chunk` positions at a time (the teacher's side of top-k distillation).
    pub fn topk_logprobs(
        &self,
        hidden: &Tensor,
        k: usize,
        chunk: usize,
    ) -> Result<(Tensor, Tensor)> {
        let (b, t, _) = hidden.dims3()?;
        let (mut vals, mut ids) = (Vec::new(), Vec::new());
        self.log_softmax_chunks(&hidden.detach(), chunk, |_, lsm| {
            let (v, i) = host_topk(&lsm, k)?;
            vals.extend(v);
            ids.extend(i);
            Ok(())
        })?;
        let dev = hidden.device();
        Ok((
            Tensor::from_vec(vals, (b * t, k), dev)?,
            Tensor::from_vec(ids, (b * t, k), dev)?,
        ))
    }

    /// Log-probs of the tokens `ids` (`[b·t, k]` u32) at each position of `hidden` (`[b, t, h]`),
    /// with gradient through `hidden` and the output weight (a composition of candle ops,
    /// `chunk` positions at a time), and the ids of each position's own `k` most likely tokens
    /// (detached): `([b·t, k], [b·t, k]` u32`)` (the student's side of top-k distillation).
    pub fn gather_logprobs(
        &self,
        hidden: &Tensor,
        ids: &Tensor,
        chunk: usize,
    ) -> Result<(Tensor, Tensor)> {
        let (b, t, _) = hidden.dims3()?;
        let k = ids.dim(1)?;
        let (mut out, mut own) = (Vec::new(), Vec::new());
        self.log_softmax_chunks(hidden, chunk, |start, lsm| {
            let n = lsm.dim(0)?;
            out.push(
                lsm.contiguous()?
                    .gather(&ids.narrow(0, start, n)?.contiguous()?, 1)?,
            );
            own.extend(host_topk(&lsm.detach(), k)?.1);
            Ok(())
        })?;
        Ok((
            Tensor::cat(&out, 0)?,
            Tensor::from_vec(own, (b * t, k), hidden.device())?,
        ))
    }

    /// [`CausalLm::token_logprobs`] as a composition of candle ops (the reference the fused op
    /// is tested against; the path on CUDA and for half precision).
    pub fn token_logprobs_composed(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        chunk: usize,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let stats = HeadStats {
            entropy: with_entropy,
            sum_pi_squared: false,
        };
        let out = self.token_stats_composed(hidden, targets, chunk, stats)?;
        Ok((out.log_probs, out.entropy))
    }

    /// [`CausalLm::token_stats`] as a composition of candle ops, `chunk` positions at a time.
    pub fn token_stats_composed(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        chunk: usize,
        stats: HeadStats,
    ) -> Result<HeadOut> {
        let (b, t, h) = hidden.dims3()?;
        let rows = hidden.reshape((b * t, h))?;
        let tgt = targets.flatten_all()?;
        let w = self.output_weight()?;
        let chunk = chunk.max(1);
        let (mut lps, mut ents, mut sqs) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        while start < b * t {
            let n = chunk.min(b * t - start);
            let logits = upcast(&self.head_matmul(&rows.narrow(0, start, n)?, w)?)?; // [n, vocab]
            let lsm = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
            let idx = tgt.narrow(0, start, n)?.unsqueeze(1)?;
            lps.push(lsm.contiguous()?.gather(&idx, 1)?.squeeze(1)?);
            if stats.entropy {
                ents.push((lsm.exp()? * &lsm)?.sum(D::Minus1)?.neg()?);
            }
            if stats.sum_pi_squared {
                // Σ p² = Σ exp(2 log p): [n]
                sqs.push((&lsm * 2.0)?.exp()?.sum(D::Minus1)?.detach());
            }
            start += n;
        }
        let cat = |v: Vec<Tensor>, on: bool| -> Result<Option<Tensor>> {
            on.then(|| Tensor::cat(&v, 0)?.reshape((b, t))).transpose()
        };
        Ok(HeadOut {
            log_probs: Tensor::cat(&lps, 0)?.reshape((b, t))?,
            entropy: cat(ents, stats.entropy)?,
            sum_pi_squared: cat(sqs, stats.sum_pi_squared)?,
        })
    }

    /// cos and sin of each row's positions: `[batch, 1, seq, head_dim]` (HF's half-split layout).
    /// Computed in f64 and rounded once to the model's dtype (f32 tables in an f64 model put
    /// ~1e-7 relative noise into every layer).
    pub(super) fn rotary(&self, position_ids: &Tensor, inv: &[f64]) -> Result<(Tensor, Tensor)> {
        if position_ids.rank() == 2 && !self.device.is_cpu() {
            return self.rotary_on_device(position_ids, inv);
        }
        // Which position axis turns each frequency: multimodal positions `[3, b, t]` by the
        // model's sections, one axis `[b, t]` for the others.
        let axes: Vec<usize> = match (position_ids.rank(), &self.args.mrope) {
            (2, _) => vec![0; inv.len()],
            (3, Some(m)) if position_ids.dim(0)? == 3 => (0..inv.len()).map(|j| m.axis_of(j)).collect(),
            _ => candle_core::bail!(
                "position ids {:?}: [3, batch, seq] positions need a model with multimodal rotary sections",
                position_ids.dims()
            ),
        };
        let (b, t) = (position_ids.dim(D::Minus2)?, position_ids.dim(D::Minus1)?);
        let pos: Vec<u32> = position_ids
            .to_dtype(DType::U32)?
            .flatten_all()?
            .to_vec1()?;
        // inv: [rotary width / 2], RoPE scaling applied; yarn's factor on the tables (else 1).
        let hd = 2 * inv.len(); // the rotary width (head_dim unless partial)
        let scale = self.args.rope_table_scale();
        let mut cos = Vec::with_capacity(b * t * hd);
        let mut sin = Vec::with_capacity(b * t * hd);
        for row in 0..b * t {
            for _ in 0..2 {
                for (f, &axis) in inv.iter().zip(&axes) {
                    let a = pos[axis * b * t + row] as f64 * f;
                    cos.push(a.cos() * scale);
                    sin.push(a.sin() * scale);
                }
            }
        }
        let shape = (b, 1, t, hd);
        let table = |v: Vec<f64>| -> Result<Tensor> {
            Tensor::from_vec(v, shape, &Device::Cpu)?
                .to_dtype(self.dtype)?
                .to_device(&self.device)
        };
        Ok((table(cos)?, table(sin)?))
    }

    /// Additive attention bias `[batch, 1, seq, past + seq]` from the key mask `km`
    /// `[batch, past + seq]`: 0 where query `i` may attend key `j` (causal: `j <= past + i`, key
    /// `j` a real token, and within `window` positions: `j > past + i − window`), −1e9 elsewhere.
    pub(super) fn attention_bias(
        &self,
        km: &[f32],
        b: usize,
        t: usize,
        past: usize,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let s = past + t;
        let mut bias = vec![0f32; b * t * s];
        for r in 0..b {
            for i in 0..t {
                for j in 0..s {
                    let old = window.is_some_and(|w| j + w <= past + i);
                    if j > past + i || old || km[r * s + j] == 0.0 {
                        bias[(r * t + i) * s + j] = -1e9;
                    }
                }
            }
        }
        Tensor::from_vec(bias, (b, 1, t, s), &Device::Cpu)?
            .to_dtype(self.dtype)?
            .to_device(&self.device)
    }
}

impl CausalLm {
    /// [`CausalLm::rotary`] computed on the model's device (the GPU path): the same f64
    /// angles, one rounding to the model's dtype.
    pub(super) fn rotary_on_device(
        &self,
        position_ids: &Tensor,
        inv: &[f64],
    ) -> Result<(Tensor, Tensor)> {
        let (b, t) = position_ids.dims2()?;
        let twice: Vec<f64> = inv.iter().chain(inv).copied().collect(); // [hd]
        let hd = twice.len();
        let freq = Tensor::from_vec(twice, (1, 1, hd), &self.device)?;
        let angle = position_ids
            .to_device(&self.device)?
            .to_dtype(DType::F64)?
            .unsqueeze(2)?
            .broadcast_mul(&freq)?; // [b, t, hd]
        let shape = (b, 1, t, hd);
        let scale = self.args.rope_table_scale();
        Ok((
            (angle.cos()? * scale)?
                .to_dtype(self.dtype)?
                .reshape(shape)?,
            (angle.sin()? * scale)?
                .to_dtype(self.dtype)?
                .reshape(shape)?,
        ))
    }

    /// [`CausalLm::attention_bias`] built on the model's device from `key_mask` `[batch,
    /// past + seq]` (the GPU path): `[batch, 1, seq, past + seq]`.
    pub(super) fn attention_bias_on_device(
        &self,
        key_mask: &Tensor,
        t: usize,
        past: usize,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let dev = &self.device;
        let (b, s) = key_mask.dims2()?;
        let pos = |n: usize| Tensor::arange(0u32, n as u32, dev)?.to_dtype(DType::F32);
        let i = (pos(t)? + past as f64)?.reshape((1, t, 1))?; // each query's position
        let j = pos(s)?.reshape((1, 1, s))?; // each key's
        let ahead = i.broadcast_sub(&j)?; // [1, t, s]: how far back key j is
        let mut ok = ahead.ge(0f64)?.to_dtype(DType::F32)?;
        if let Some(w) = window {
            ok = (ok * ahead.lt(w as f64)?.to_dtype(DType::F32)?)?;
        }
        let real = key_mask
            .to_device(dev)?
            .to_dtype(DType::F32)?
            .ne(0f64)?
            .to_dtype(DType::F32)?
            .reshape((b, 1, s))?;
        let ok = ok.broadcast_mul(&real)?.ne(0f64)?; // [b, t, s]
        let zero = Tensor::zeros((b, t, s), self.dtype, dev)?;
        let blocked = Tensor::full(-1e9f32, (b, t, s), dev)?.to_dtype(self.dtype)?;
        ok.where_cond(&zero, &blocked)?.reshape((b, 1, t, s))
    }
}

/// What [`CausalLm::run`] is told about the keys.
enum Keys<'a> {
    /// `[batch, past + seq]`: 1 on real tokens.
    Mask(&'a Tensor),
    /// Packed sequences, some perhaps continuing a shared prefix.
    Packed(Arc<[Seg]>),
}

/// A layer's experts (`mlp.*`): the router `gate.weight`, `experts.N`, and the shared
/// expert(s) of the family (Qwen's gated `shared_expert`, DeepSeek's `shared_experts` and
/// its `gate.e_score_correction_bias`, read as a variable so that it is saved back, and kept
/// detached in the layer, which only chooses with it).
fn experts(p: &VarBuilder, h: usize, moe: &super::config::MoeArgs) -> Result<Experts> {
    let small = Init::Randn {
        mean: 0.0,
        stdev: 0.02,
    };
    let deepseek = match &moe.deepseek {
        Some(d) => Some(Box::new(DeepseekMoe {
            bias: p
                .get_with_hints(
                    moe.num_experts,
                    "gate.e_score_correction_bias",
                    Init::Const(0.0),
                )?
                .detach(),
            n_group: d.n_group,
            topk_group: d.topk_group,
            scale: d.routed_scaling_factor,
            shared: gated(
                &p.pp("shared_experts"),
                h,
                d.n_shared_experts * moe.moe_intermediate_size,
            )?,
        })),
        None => None,
    };
    // GPT-OSS names its router `router` and biases it and its experts.
    let (router, biased) = match moe.swiglu {
        Some(_) => ("router", true),
        None => ("gate", false),
    };
    Ok(Experts {
        router: p.get_with_hints((moe.num_experts, h), &format!("{router}.weight"), small)?,
        router_bias: match biased {
            true => Some(p.get_with_hints(moe.num_experts, "router.bias", small)?),
            false => None,
        },
        swiglu: moe.swiglu.map(|c| (c.alpha, c.limit)),
        experts: (0..moe.num_experts)
            .map(|e| {
                let vb = p.pp(format!("experts.{e}"));
                gated_biased(&vb, h, moe.moe_intermediate_size, biased)
            })
            .collect::<Result<_>>()?,
        top_k: moe.num_experts_per_tok,
        norm_topk_prob: moe.norm_topk_prob,
        dense: false,
        shared: match moe.shared_expert_intermediate_size {
            Some(w) => Some(Shared {
                mlp: gated(&p.pp("shared_expert"), h, w)?,
                gate: linear(p, h, 1, false, "shared_expert_gate")?,
            }),
            None => None,
        },
        deepseek,
    })
}

/// A layer's `self_attn` weights (`q_proj` twice as wide with an output gate).
fn attention_weights(a: &VarBuilder, args: &ModelArgs, one: Init) -> Result<Attention> {
    let (h, hd) = (args.hidden_size, args.head_dim);
    let (nh, nkv) = (args.num_attention_heads, args.num_key_value_heads);
    let q_width = nh * hd * if args.attn_output_gate { 2 } else { 1 };
    Ok(Attention {
        qk_norm: if args.qk_norm() {
            Some((
                a.get_with_hints(hd, "q_norm.weight", one)?,
                a.get_with_hints(hd, "k_norm.weight", one)?,
            ))
        } else {
            None
        },
        softcap: args.attn_logit_softcapping,
        sinks: match args.arch.sinks() {
            true => Some(a.get_with_hints(nh, "sinks", Init::Const(0.0))?),
            false => None,
        },
        q: linear(a, h, q_width, args.qkv_bias, "q_proj")?,
        k: linear(a, h, nkv * hd, args.qkv_bias, "k_proj")?,
        v: linear(a, h, nkv * hd, args.qkv_bias, "v_proj")?,
        o: linear(a, nh * hd, h, args.o_bias, "o_proj")?,
    })
}

/// A gated MLP of width `inter` under `vb` (`gate_proj`, `up_proj`, `down_proj`).
fn gated(vb: &VarBuilder, h: usize, inter: usize) -> Result<Gated> {
    gated_biased(vb, h, inter, false)
}

/// [`gated`], each projection with a bias when `bias` (GPT-OSS's experts).
fn gated_biased(vb: &VarBuilder, h: usize, inter: usize, bias: bool) -> Result<Gated> {
    Ok(Gated {
        gate: linear(vb, h, inter, bias, "gate_proj")?,
        up: linear(vb, h, inter, bias, "up_proj")?,
        down: linear(vb, inter, h, bias, "down_proj")?,
    })
}

/// The `k` largest values of each row of `x` (`[n, v]`), largest first (ties: the lower index),
/// with their column indices: `n·k` of each, row by row.
pub fn host_topk(x: &Tensor, k: usize) -> Result<(Vec<f32>, Vec<u32>)> {
    let (n, v) = x.dims2()?;
    if k > v {
        candle_core::bail!("top-{k} of a distribution over {v} tokens");
    }
    let data = x.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let (mut vals, mut ids) = (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
    let mut idx: Vec<u32> = Vec::with_capacity(v);
    for row in &data {
        idx.clear();
        idx.extend(0..v as u32);
        let order = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        if k < v {
            idx.select_nth_unstable_by(k, order);
        }
        idx.truncate(k);
        idx.sort_unstable_by(order);
        vals.extend(idx.iter().map(|&i| row[i as usize]));
        ids.extend_from_slice(&idx);
    }
    Ok((vals, ids))
}
