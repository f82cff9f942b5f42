//! verl keys that this implementation accepts without a typed field: keys with no effect here
//! (distributed-engine and inference-server settings), keys whose non-default values would change
//! behaviour we do not implement (an error, never a silent ignore), and the legacy top-level
//! reward keys that move under `reward.*` (verl's `migrate_legacy_reward_impl`).
//!
//! Key names are verl's (`verl/trainer/config/_generated_ppo_trainer.yaml`, newest snapshot).

use serde_yaml_ng::Value;

/// How a verl key without a typed field is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compat {
    /// Accepted with any value under it, reported once in the no-effect warning.
    NoEffect,
    /// Accepted while it holds verl's default (a YAML literal); any other value is an error.
    Unsupported {
        default: &'static str,
        why: &'static str,
    },
    /// Legacy top-level key: moved to this path before typing.
    MovedTo(&'static str),
}

use Compat::*;

const DIST: Compat = NoEffect;

/// Key paths (an entry covers everything below it) and their treatment.
pub const TABLE: &[(&str, Compat)] = &[
    // whole sections of the distributed runtime
    ("model_engine", DIST),
    ("global_profiler", DIST),
    ("skip", DIST),
    ("transfer_queue", DIST),
    ("ray_kwargs", DIST),
    ("hydra", DIST),
    // on-policy distillation: the teachers run in the trainer's process (no resource pool, no
    // inference server); the student's top-k log-probs are always computed in chunks
    ("distillation.n_gpus_per_node", DIST),
    ("distillation.nnodes", DIST),
    ("distillation.teacher_models.teacher_model.num_replicas", DIST),
    ("distillation.teacher_models.teacher_model.inference", DIST),
    ("distillation.distillation_loss.use_chunked_topk", DIST),
    ("distillation.distillation_loss.chunked_topk_chunk_size", DIST),
    ("actor_rollout_ref.hybrid_engine", DIST),
    // model loading options of HF/FSDP
    ("actor_rollout_ref.model.lora.rank", Unsupported { default: "0", why: "Megatron's LoRA section is not read: use actor_rollout_ref.model.lora_rank (the FSDP keys)" }),
    ("actor_rollout_ref.model.lora", DIST),
    ("actor_rollout_ref.model.hf_config_path", DIST),
    ("actor_rollout_ref.model.use_shm", DIST),
    ("actor_rollout_ref.model.trust_remote_code", DIST),
    ("actor_rollout_ref.model.external_lib", DIST),
    ("actor_rollout_ref.model.enable_activation_offload", DIST),
    ("actor_rollout_ref.model.use_liger", DIST),
    ("actor_rollout_ref.model.use_fused_kernels", DIST),
    ("actor_rollout_ref.model.fused_kernel_options", DIST),
    ("actor_rollout_ref.model.tiled_mlp", DIST),
    ("actor_rollout_ref.model.mtp", DIST),
    ("actor_rollout_ref.model.mtp.enable", Unsupported { default: "false", why: "verl then trains the model's multi-token-prediction layers with an extra loss (mtp_loss_scaling_factor times their next-next-token cross-entropy, Megatron's MTP) and may draft with them in the rollout; main_ppo implements neither: it loads a MiMo checkpoint's MTP layers, keeps them frozen and saves them back unchanged (set mtp.enable=false to train the main model alone)" }),
    ("critic.model.lora", DIST),
    ("critic.model.hf_config_path", DIST),
    ("critic.model.use_shm", DIST),
    ("critic.model.trust_remote_code", DIST),
    ("critic.model.external_lib", DIST),
    ("critic.model.enable_activation_offload", DIST),
    ("critic.model.use_liger", DIST),
    ("critic.model.use_fused_kernels", DIST),
    ("critic.model.fused_kernel_options", DIST),
    ("critic.model.tiled_mlp", DIST),
    ("critic.model.mtp", DIST),
    // actor engine
    ("actor_rollout_ref.actor.fsdp_config", DIST),
    ("actor_rollout_ref.actor.megatron", DIST),
    ("actor_rollout_ref.actor.strategy", DIST),
    ("actor_rollout_ref.actor.rollout_n", DIST),
    ("actor_rollout_ref.actor.use_torch_compile", DIST),
    ("actor_rollout_ref.actor.profiler", DIST),
    ("actor_rollout_ref.actor.router_replay", DIST),
    ("actor_rollout_ref.actor.qat", DIST),
    ("actor_rollout_ref.actor.sum_pi_squared_checkpointing", DIST),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", DIST),
    ("actor_rollout_ref.actor.entropy_from_logits_with_chunking", DIST),
    ("actor_rollout_ref.actor.entropy_from_logits_chunk_size", DIST),
    ("actor_rollout_ref.actor.entropy_checkpointing", DIST),
    ("actor_rollout_ref.actor.pad_to_length", DIST),
    ("actor_rollout_ref.actor.use_remove_padding", DIST),
    ("actor_rollout_ref.actor.use_fused_kernels", DIST),
    ("actor_rollout_ref.actor.checkpoint.async_save", DIST),
    ("actor_rollout_ref.actor.checkpoint.strict", DIST),
    // reference engine
    ("actor_rollout_ref.ref.fsdp_config", DIST),
    ("actor_rollout_ref.ref.megatron", DIST),
    ("actor_rollout_ref.ref.strategy", DIST),
    ("actor_rollout_ref.ref.rollout_n", DIST),
    ("actor_rollout_ref.ref.use_torch_compile", DIST),
    ("actor_rollout_ref.ref.profiler", DIST),
    ("actor_rollout_ref.ref.router_replay", DIST),
    ("actor_rollout_ref.ref.ulysses_sequence_parallel_size", DIST),
    ("actor_rollout_ref.ref.entropy_from_logits_with_chunking", DIST),
    ("actor_rollout_ref.ref.entropy_from_logits_chunk_size", DIST),
    ("actor_rollout_ref.ref.entropy_checkpointing", DIST),
    ("actor_rollout_ref.ref.pad_to_length", DIST),
    ("actor_rollout_ref.ref.optim", DIST),
    // inference server (vLLM/SGLang) settings
    // declared by verl's RolloutConfig but read by nothing since its SGLang multi-turn rollout
    // was removed (b178a3c and 1dda039 alike): a value has no effect there either
    ("actor_rollout_ref.rollout.over_sample_rate", NoEffect),
    ("actor_rollout_ref.rollout.name", DIST),
    ("actor_rollout_ref.rollout.mode", DIST),
    ("actor_rollout_ref.rollout.nnodes", DIST),
    ("actor_rollout_ref.rollout.n_gpus_per_node", DIST),
    ("actor_rollout_ref.rollout.full_determinism", DIST),
    ("actor_rollout_ref.rollout.enforce_eager", DIST),
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes", DIST),
    ("actor_rollout_ref.rollout.free_cache_engine", DIST),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", DIST),
    ("actor_rollout_ref.rollout.data_parallel_size", DIST),
    ("actor_rollout_ref.rollout.expert_parallel_size", DIST),
    ("actor_rollout_ref.rollout.pipeline_model_parallel_size", DIST),
    ("actor_rollout_ref.rollout.max_model_len", DIST),
    ("actor_rollout_ref.rollout.enable_chunked_prefill", DIST),
    ("actor_rollout_ref.rollout.enable_prefix_caching", DIST),
    ("actor_rollout_ref.rollout.logprobs_mode", DIST),
    ("actor_rollout_ref.rollout.scheduling_policy", DIST),
    ("actor_rollout_ref.rollout.load_format", DIST),
    ("actor_rollout_ref.rollout.layered_summon", DIST),
    ("actor_rollout_ref.rollout.disable_log_stats", DIST),
    ("actor_rollout_ref.rollout.multi_stage_wake_up", DIST),
    ("actor_rollout_ref.rollout.engine_kwargs", DIST),
    ("actor_rollout_ref.rollout.checkpoint_engine", DIST),
    ("actor_rollout_ref.rollout.trace", DIST),
    ("actor_rollout_ref.rollout.skip_tokenizer_init", DIST),
    ("actor_rollout_ref.rollout.enable_rollout_routing_replay", DIST),
    ("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", DIST),
    ("actor_rollout_ref.rollout.profiler", DIST),
    ("actor_rollout_ref.rollout.prometheus", DIST),
    ("actor_rollout_ref.rollout.quantization", Unsupported { default: "null", why: "quantized generation (fp8 and the like) is not implemented: rollouts use the policy's own weights" }),
    ("actor_rollout_ref.rollout.quantization_config_file", DIST),
    ("actor_rollout_ref.rollout.mtp", DIST),
    ("actor_rollout_ref.rollout.qat", DIST),
    ("actor_rollout_ref.rollout.qat.enable", Unsupported { default: "false", why: "quantization-aware training is not implemented" }),
    ("actor_rollout_ref.rollout.layer_name_map", DIST),
    ("actor_rollout_ref.rollout.skip_rollout", Unsupported { default: "false", why: "replaying dumped rollouts instead of generating is not implemented" }),
    ("actor_rollout_ref.rollout.skip_dump_dir", DIST),
    ("actor_rollout_ref.rollout.moe_tensor_parallel_size", DIST),
    ("actor_rollout_ref.rollout.router_config_path", DIST),
    ("actor_rollout_ref.rollout.update_weights_bucket_megabytes", DIST),
    ("actor_rollout_ref.rollout.sglang_rollout_mode", DIST),
    ("actor_rollout_ref.rollout.server", DIST),
    ("actor_rollout_ref.rollout.custom_async_server", DIST),
    ("actor_rollout_ref.rollout.disaggregation", DIST),
    // critic engine
    ("critic.fsdp", DIST),
    ("critic.megatron", DIST),
    ("critic.strategy", DIST),
    ("critic.rollout_n", DIST),
    ("critic.ulysses_sequence_parallel_size", DIST),
    ("critic.profiler", DIST),
    ("critic.forward_micro_batch_size", DIST),
    ("critic.nccl_timeout", DIST),
    ("critic.model.fsdp_config", DIST),
    ("critic.checkpoint.async_save", DIST),
    // data loader options of the Python implementation
    ("data.custom_cls.path", Unsupported { default: "null", why: "custom Python dataset classes cannot run here; convert the data to verl's parquet/JSONL format" }),
    ("data.custom_cls", DIST),
    ("data.datagen.path", Unsupported { default: "null", why: "custom Python data generators cannot run here" }),
    ("data.datagen", DIST),
    ("data.use_shm", DIST),
    ("data.tool_config_path", DIST),
    ("data.function_tool_path", DIST),
    ("data.return_raw_input_ids", DIST),
    ("data.return_raw_chat", DIST),
    ("data.return_full_prompt", DIST),
    ("data.filter_overlong_prompts_workers", DIST),
    ("data.audio_key", DIST),
    ("data.trust_remote_code", DIST),
    ("data.return_multi_modal_inputs", DIST),
    // reward engine
    ("reward.reward_manager.module.path", Unsupported { default: "null", why: "Python reward-manager classes are not supported; use reward.sources or reward.custom_reward_function" }),
    ("reward.reward_manager.module", DIST),
    ("reward.reward_model.enable_resource_pool", DIST),
    ("reward.reward_model.n_gpus_per_node", DIST),
    ("reward.reward_model.nnodes", DIST),
    ("reward.reward_model.rollout", DIST),
    ("reward.sandbox_fusion.url", Unsupported { default: "null", why: "sandbox-fusion code execution is not implemented" }),
    ("reward.sandbox_fusion", DIST),
    // verl 0.7's rollout-correction keys (gone at 1dda039, which reads both rejection bounds
    // from rollout_rs_threshold)
    ("algorithm.rollout_correction.rollout_rs_threshold_lower", Unsupported { default: "null", why: "verl 0.7's separate lower rejection bound: write both bounds in rollout_rs_threshold as \"lower_upper\" (verl 1dda039)" }),
    ("algorithm.rollout_correction.rollout_token_veto_threshold", Unsupported { default: "null", why: "verl 0.7's catastrophic-token veto is not implemented (verl 1dda039 removed it; rollout_rs=token_k1 with a lower bound rejects such tokens)" }),
    // trainer runtime
    ("trainer.esi_redundant_time", DIST),
    ("trainer.default_hdfs_dir", DIST),
    ("trainer.ray_wait_register_center_timeout", DIST),
    ("trainer.checkpoint_callback_class", Unsupported { default: "null", why: "custom Python checkpoint callbacks cannot run here" }),
    ("trainer.use_v1", DIST),
    ("trainer.v1.trainer_mode", Unsupported { default: "sync", why: "the asynchronous trainers (colocate_async, separate_async) train on rollouts of older policies; main_ppo's loop is verl's synchronous one (trainer_mode: sync)" }),
    ("trainer.v1.sampler.custom_sampler.path", Unsupported { default: "null", why: "custom Python replay-buffer samplers cannot run here" }),
    ("trainer.v1", DIST),
    // legacy top-level reward keys
    ("custom_reward_function.path", MovedTo("reward.custom_reward_function.path")),
    ("custom_reward_function.name", MovedTo("reward.custom_reward_function.name")),
    ("custom_reward_function.reward_kwargs", MovedTo("reward.custom_reward_function.reward_kwargs")),
    ("reward_model.enable", MovedTo("reward.reward_model.enable")),
    ("reward_model.model.path", MovedTo("reward.reward_model.model_path")),
    ("reward_model.reward_manager", MovedTo("reward.reward_manager.name")),
    ("reward_model.num_workers", MovedTo("reward.num_workers")),
    ("reward_model.reward_kwargs", MovedTo("reward.reward_kwargs")),
    ("reward_model.reward_loop_source", MovedTo("reward.reward_manager.source")),
    ("reward_model.reward_loop_module_path", Unsupported { default: "null", why: "Python reward-manager classes are not supported; use reward.sources or reward.custom_reward_function" }),
    ("reward_model.sandbox_fusion.url", MovedTo("reward.sandbox_fusion.url")),
    ("reward_model", DIST),
    ("sandbox_fusion.url", MovedTo("reward.sandbox_fusion.url")),
    ("sandbox_fusion", DIST),
    // b178a3c's top-level reward manager (verl 1dda039 keeps it under reward.*)
    ("reward_manager.source", MovedTo("reward.reward_manager.source")),
    ("reward_manager.name", MovedTo("reward.reward_manager.name")),
    ("reward_manager.module.path", Unsupported { default: "null", why: "Python reward-manager classes are not supported; use reward.sources or reward.custom_reward_function" }),
    ("reward_manager", DIST),
    // verl 1dda039's spelling of the FSDP engines' compute precision
    ("actor_rollout_ref.actor.fsdp_config.dtype", MovedTo("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype")),
    ("actor_rollout_ref.ref.fsdp_config.dtype", MovedTo("actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype")),
    ("critic.fsdp.dtype", MovedTo("critic.model.fsdp_config.mixed_precision.param_dtype")),
    ("critic.fsdp.model_dtype", MovedTo("critic.model.fsdp_config.model_dtype")),
    ("critic.fsdp_config.model_dtype", MovedTo("critic.model.fsdp_config.model_dtype")),
    ("critic.fsdp.mixed_precision.param_dtype", MovedTo("critic.model.fsdp_config.mixed_precision.param_dtype")),
    ("critic.model.fsdp_config.dtype", MovedTo("critic.model.fsdp_config.mixed_precision.param_dtype")),
];

/// The roles that own an engine section (`fsdp_config`, `megatron`, `veomni`, `torchtitan`) and
/// an optimizer; [`ROLE_TABLE`]'s entries apply below each.
pub const ROLES: [&str; 3] = ["actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"];

/// Entries below each of [`ROLES`]: the engine sections (their layout keys have no effect) and
/// the engine-specific optimizer keys (verl's `optim/megatron.yaml`, `optim/veomni.yaml`,
/// `optim/torchtitan.yaml`). `lr_decay_style`, `min_lr` and `lr_min` map onto the schedule
/// (`engines.rs`); keys that would change the update are refused unless at verl's default.
pub const ROLE_TABLE: &[(&str, Compat)] = &[
    ("fsdp_config", DIST),
    ("fsdp_config.qat.enable", Unsupported { default: "false", why: "quantization-aware training is not implemented" }),
    ("fsdp", DIST),
    ("fsdp.model_dtype", Unsupported { default: "fp32", why: "the weights' dtype is read from the role's fsdp_config.model_dtype" }),
    ("fsdp.qat.enable", Unsupported { default: "false", why: "quantization-aware training is not implemented" }),
    ("megatron", DIST),
    ("megatron.qat.enable", Unsupported { default: "false", why: "quantization-aware training is not implemented" }),
    ("megatron.router_replay.mode", Unsupported { default: "disabled", why: "MoE routing replay needs a mixture-of-experts model; no MoE family is supported" }),
    ("megatron.override_mcore_model_config", Unsupported { default: "{}", why: "it changes Megatron's model definition; main_ppo builds the model from config.json (actor_rollout_ref.model.override_config changes that)" }),
    ("veomni", DIST),
    ("veomni.router_replay.mode", Unsupported { default: "disabled", why: "MoE routing replay needs a mixture-of-experts model; no MoE family is supported" }),
    ("veomni.load_checkpoint_path", Unsupported { default: "null", why: "the weights come from the model path here (actor_rollout_ref.model.path)" }),
    ("torchtitan", DIST),
    ("router_replay", DIST),
    ("router_replay.mode", Unsupported { default: "disabled", why: "MoE routing replay needs a mixture-of-experts model; no MoE family is supported" }),
    ("qat", DIST),
    ("qat.enable", Unsupported { default: "false", why: "quantization-aware training is not implemented" }),
    ("load_weight", Unsupported { default: "true", why: "load_weight=false starts from random weights; main_ppo always loads the model path" }),
    ("checkpoint.mbridge_config", DIST),
    ("strategy", DIST),
    ("optim.lr_decay_style", DIST),
    ("optim.min_lr", DIST),
    ("optim.lr_min", DIST),
    ("optim.lr_warmup_init", Unsupported { default: "0.0", why: "a warm-up that starts above 0 (Megatron's lr_warmup_init) is not implemented" }),
    ("optim.lr_decay_steps", Unsupported { default: "null", why: "a decay shorter or longer than the run is not implemented: the schedule spans optim.total_training_steps" }),
    ("optim.weight_decay_incr_style", Unsupported { default: "constant", why: "a changing weight decay is not implemented" }),
    ("optim.lr_wsd_decay_style", DIST),
    ("optim.lr_wsd_decay_steps", DIST),
    ("optim.use_checkpoint_opt_param_scheduler", DIST),
    ("optim.use_precision_aware_optimizer", DIST),
    ("optim.use_layer_wise_distributed_optimizer", DIST),
    ("optim.main_grads_dtype", Unsupported { default: "fp32", why: "gradients are fp32 here" }),
    ("optim.exp_avg_dtype", Unsupported { default: "fp32", why: "Megatron's low-precision moments are not implemented; torchao's are (optim.optimizer_impl=torchao.optim optim.optimizer=AdamW8bit, AdamW4bit or AdamWFp8)" }),
    ("optim.exp_avg_sq_dtype", Unsupported { default: "fp32", why: "Megatron's low-precision moments are not implemented; torchao's are (optim.optimizer_impl=torchao.optim optim.optimizer=AdamW8bit, AdamW4bit or AdamWFp8)" }),
    // optimizer keyword arguments that choose an implementation, not the update
    ("optim.override_optimizer_config.foreach", DIST),
    ("optim.override_optimizer_config.fused", DIST),
    ("optim.override_optimizer_config.capturable", DIST),
    ("optim.override_optimizer_config.differentiable", DIST),
    ("optim.override_optimizer_config.optimizer_cpu_offload", DIST),
    ("optim.override_optimizer_config.optimizer_offload_fraction", DIST),
    ("optim.override_optimizer_config.offload_fraction", DIST),
    ("optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d", DIST),
    // Megatron's precision-aware optimizer keeps the dtypes optim.*_dtype name (fp32 here)
    ("optim.override_optimizer_config.use_precision_aware_optimizer", DIST),
    // torchao rounds bf16 weights stochastically; the weights are f32 here
    ("optim.override_optimizer_config.bf16_stochastic_round", DIST),
    ("optim.override_optimizer_config.amsgrad", Unsupported { default: "false", why: "AMSGrad (the running maximum of the second moment) is not implemented" }),
    ("optim.override_optimizer_config.maximize", Unsupported { default: "false", why: "the optimizer minimises the loss here" }),
    ("optim.override_optimizer_config.fp8_recipe", Unsupported { default: "null", why: "Megatron's FP8 optimizer is not implemented; torchao's AdamWFp8 is (optim.optimizer_impl=torchao.optim optim.optimizer=AdamWFp8)" }),
    ("optim.lr_start", Unsupported { default: "0.0", why: "a warm-up that starts above 0 (VeOmni's lr_start) is not implemented" }),
    ("optim.lr_decay_ratio", Unsupported { default: "1.0", why: "a decay over part of the run (VeOmni's lr_decay_ratio) is not implemented" }),
    ("optim.name", DIST),
    ("optim.decay_type", DIST),
    ("optim.min_lr_factor", DIST),
    ("optim.muon_momentum", DIST),
    ("optim.muon_nesterov", DIST),
    ("optim.muon_split_qkv", DIST),
    ("optim.muon_scale_mode", DIST),
    ("optim.muon_coefficient_type", DIST),
    ("optim.muon_num_ns_steps", DIST),
    ("optim.muon_tp_mode", DIST),
    ("optim.muon_fp32_matmul_prec", DIST),
    ("optim.muon_extra_scale_factor", DIST),
    ("optim.muon_scalar_optimizer", DIST),
    ("optim.muon_match_adamw_update_rms", DIST),
];

/// verl's defaults for a GPU cluster that main_ppo replaces with its own (a CPU or one GPU per
/// process, the launcher's process count, fp32 generation) when they come from verl's own config
/// files; a value the user sets is honoured. `(key, verl's default)`.
pub const HOST_DEFAULTS: &[(&str, &str)] = &[
    ("trainer.device", "cuda"),
    ("trainer.nnodes", "1"),
    ("trainer.n_gpus_per_node", "8"),
    ("actor_rollout_ref.rollout.dtype", "bfloat16"),
];

/// Every entry: [`TABLE`], then [`ROLE_TABLE`] below each role.
fn entries() -> &'static [(String, Compat)] {
    static ALL: std::sync::OnceLock<Vec<(String, Compat)>> = std::sync::OnceLock::new();
    ALL.get_or_init(|| {
        let mut all: Vec<(String, Compat)> =
            TABLE.iter().map(|(e, c)| (e.to_string(), *c)).collect();
        for role in ROLES {
            all.extend(ROLE_TABLE.iter().map(|(e, c)| (format!("{role}.{e}"), *c)));
        }
        all
    })
}

/// The table entry that covers a key.
#[derive(Debug, Clone, Copy)]
pub struct Found {
    pub compat: Compat,
    /// How many leading segments of the key the entry names.
    pub depth: usize,
    /// The key is the entry itself (not a key below it).
    pub exact: bool,
    /// A Hydra class marker (`_target_`), never reported.
    pub target: bool,
}

/// Maps whose entries all follow one schema, verl's dicts of named sections: `(the map's path,
/// the entry the defaults hold)`. `distillation.teacher_models.gsm8k.model_path` is typed (and
/// covered by the table) as `distillation.teacher_models.teacher_model.model_path` is.
pub const KEYED_MAPS: &[(&str, &str)] = &[("distillation.teacher_models", "teacher_model")];

/// `path` with the entry name of a [`KEYED_MAPS`] map replaced by the entry the defaults hold.
pub fn canonical(path: &[String]) -> Vec<String> {
    let mut out = path.to_vec();
    for (map, entry) in KEYED_MAPS {
        let segs: Vec<&str> = map.split('.').collect();
        let under = path.len() > segs.len() && segs.iter().zip(path).all(|(a, b)| *a == b);
        if under {
            out[segs.len()] = entry.to_string();
        }
    }
    out
}

/// The table entry covering `path` (the most specific one), if any. Segments named `_target_`
/// (Hydra's class markers) are always covered.
pub fn lookup(path: &[String]) -> Option<Found> {
    let path = &canonical(path)[..];
    if path.iter().any(|s| s == "_target_") {
        return Some(Found {
            compat: NoEffect,
            depth: path.len(),
            exact: true,
            target: true,
        });
    }
    let mut best: Option<Found> = None;
    for (entry, compat) in entries() {
        let segs: Vec<&str> = entry.split('.').collect();
        let covers = segs.len() <= path.len() && segs.iter().zip(path).all(|(a, b)| *a == b);
        if covers && best.is_none_or(|b| b.depth < segs.len()) {
            best = Some(Found {
                compat: *compat,
                depth: segs.len(),
                exact: segs.len() == path.len(),
                target: false,
            });
        }
    }
    best
}

/// True when `path` is an ancestor of some table entry (`reward_model` for `reward_model.enable`),
/// so that setting a mapping there is acceptable.
pub fn is_table_prefix(path: &[String]) -> bool {
    let path = &canonical(path)[..];
    entries().iter().any(|(entry, _)| {
        let segs: Vec<&str> = entry.split('.').collect();
        segs.len() > path.len() && segs.iter().zip(path).all(|(a, b)| *a == b)
    })
}

/// Every key the table names (for "did you mean" suggestions of a key given in the wrong place).
pub fn entry_keys() -> impl Iterator<Item = &'static str> {
    entries().iter().map(|(e, _)| e.as_str())
}

/// The top-level and nested names the table knows at the level below `parent`
/// (for "did you mean" suggestions).
pub fn names_under(parent: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for (entry, _) in entries() {
        let segs: Vec<&str> = entry.split('.').collect();
        if segs.len() > parent.len() && segs.iter().zip(parent).all(|(a, b)| *a == b) {
            let name = segs[parent.len()].to_string();
            if !out.contains(&name) {
                out.push(name);
            }
        }
    }
    out
}

/// Whether two values are the same setting: numbers by value (`0` is `0.0`), strings without
/// regard to case and with verl's two spellings of a precision (`fp32`/`float32`,
/// `bf16`/`bfloat16`) taken as one, mappings and lists element by element.
pub fn same_value(a: &Value, b: &Value) -> bool {
    fn canon(s: &str) -> String {
        let l = s.to_ascii_lowercase();
        match l.as_str() {
            "float32" => "fp32".into(),
            "bfloat16" => "bf16".into(),
            "float16" => "fp16".into(),
            _ => l,
        }
    }
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::String(x), Value::String(y)) => canon(x) == canon(y),
        (Value::Sequence(x), Value::Sequence(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_value(p, q))
        }
        (Value::Mapping(x), Value::Mapping(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => a == b,
    }
}

/// Parses an `Unsupported` default literal.
pub fn default_value(literal: &str) -> Value {
    serde_yaml_ng::from_str(literal).unwrap_or(Value::Null)
}
