//! Fixtures for tests (unit and integration): a tiny byte-level tokenizer and an HF-style model
//! directory holding it. Not part of the public API.

use std::path::Path;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// Qwen2-style ChatML template (system turn defaulted, generation prompt on request).
/// Every decoder family, for tests that check a property of each (tiny models from
/// `ModelArgs::tiny`).
pub const DECODER_ARCHS: [crate::model::Arch; 8] = [
    crate::model::Arch::Llama,
    crate::model::Arch::Qwen2,
    crate::model::Arch::SeedOss,
    crate::model::Arch::MiMo,
    crate::model::Arch::Qwen3,
    crate::model::Arch::Gemma3,
    crate::model::Arch::Qwen3Moe,
    crate::model::Arch::Qwen2Moe,
];

/// `n` pseudo-random values in [-1, 1) from `seed` (splitmix), for reproducible test inputs.
pub fn uniform(n: usize, seed: u64) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let x = crate::model::proj::mix64(seed ^ (i as u64).wrapping_mul(0x9e37));
            (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

/// The largest `|a − b|` over two tensors of one shape, in f64.
pub fn max_abs_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f64 {
    let d: Vec<f64> = (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.to_dtype(candle_core::DType::F64))
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.to_vec1())
        .expect("tensors of one shape");
    d.into_iter().fold(0.0, f64::max)
}

/// The largest absolute difference of `got` from `want`, and `want`'s largest entry (at least
/// 1e-12): an error and the scale it is judged against.
pub fn worst_of(got: &[f64], want: &[f64]) -> (f64, f64) {
    let scale = want.iter().fold(0f64, |s, x| s.max(x.abs())).max(1e-12);
    let worst = got
        .iter()
        .zip(want)
        .fold(0f64, |s, (a, b)| s.max((a - b).abs()));
    (worst, scale)
}

/// The Gated DeltaNet hybrids (their own paths: the op composition, the composition's cache).
pub const HYBRID_ARCHS: [crate::model::Arch; 3] = [
    crate::model::Arch::Qwen3_5,
    crate::model::Arch::Qwen3_5Moe,
    crate::model::Arch::Qwen3Next,
];

pub const CHATML: &str = "{%- if messages[0]['role'] == 'system' %}\n    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n{%- else %}\n    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n{%- endif %}\n{%- for message in messages %}\n    {%- if not (message.role == 'system' and loop.first) %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

/// GPT-2's byte → printable-character table.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut map: Vec<Option<char>> = vec![None; 256];
    for &b in &printable {
        map[b as usize] = char::from_u32(b);
    }
    let mut n = 0;
    for b in 0..256u32 {
        if map[b as usize].is_none() {
            map[b as usize] = char::from_u32(256 + n);
            printable.push(b);
            n += 1;
        }
    }
    map.into_iter()
        .map(|c| c.expect("every byte mapped"))
        .collect()
}

/// A byte-level BPE tokenizer without merges: one token per UTF-8 byte (ids 0..256), plus the
/// special tokens `<|endoftext|>` (256), `<|im_start|>` (257), `<|im_end|>` (258).
pub fn byte_tokenizer() -> Tokenizer {
    let vocab: tokenizers::models::bpe::Vocab = byte_chars()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, vec![])
        .build()
        .expect("valid BPE");
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, false)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.add_special_tokens([
        AddedToken::from("<|endoftext|>", true),
        AddedToken::from("<|im_start|>", true),
        AddedToken::from("<|im_end|>", true),
    ])
    .expect("special tokens are added");
    tok
}

/// Writes tokenizer.json, tokenizer_config.json (ChatML template, `<|im_end|>` as EOS) and
/// generation_config.json into `dir`.
pub fn write_tokenizer_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    byte_tokenizer()
        .save(dir.join("tokenizer.json"), false)
        .map_err(std::io::Error::other)?;
    let cfg = serde_json::json!({
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&cfg)?,
    )?;
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [258, 256]}"#,
    )?;
    Ok(())
}

/// A verl-format row with a user prompt and a gsm8k-style ground truth.
pub fn verl_row(question: &str, answer: &str) -> serde_json::Value {
    serde_json::json!({
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "test", "index": 0},
    })
}

/// Writes rows as JSONL.
pub fn write_jsonl(path: &Path, rows: &[serde_json::Value]) -> std::io::Result<()> {
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(path, text)
}

/// A model of `args` with trainable weights drawn from N(0, `stdev`²) (norm weights stay 1),
/// larger than the 0.02 init so attention patterns and logits are far from uniform.
pub fn tiny_model(
    args: &crate::model::ModelArgs,
    dtype: candle_core::DType,
    stdev: f32,
) -> (candle_nn::VarMap, crate::model::CausalLm) {
    use candle_core::{Device, Tensor};
    let varmap = candle_nn::VarMap::new();
    let m = crate::model::CausalLm::new(
        args,
        candle_nn::VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu),
        true,
    )
    .expect("tiny model");
    // Normal(0, stdev) weights from a stream seeded by each tensor's name (Box-Muller), so every
    // test sees the same model on every run (candle's randn is not seedable).
    use rand::{Rng, SeedableRng};
    for (name, var) in varmap.data().lock().expect("varmap lock").iter() {
        if !name.ends_with("norm.weight") {
            let t = var.as_tensor();
            let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            });
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let vals: Vec<f32> = (0..t.elem_count())
                .map(|_| {
                    let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
                    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
                        * stdev
                })
                .collect();
            var.set(
                &Tensor::from_vec(vals, t.shape(), &Device::Cpu)
                    .and_then(|r| r.to_dtype(dtype))
                    .expect("random weights"),
            )
            .expect("set");
        }
    }
    (varmap, m)
}

/// A tiny sequence-classification reward model (random backbone, random `score.weight` with
/// one label) saved as an HF directory with the byte-level test tokenizer.
pub fn tiny_reward_model_dir(dir: &Path, seed_stdev: f32) {
    use candle_core::{DType, Device, Tensor};
    let args = crate::model::ModelArgs::tiny(crate::model::Arch::Llama, 259);
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let _m = crate::model::CausalLm::new(&args, vb.clone(), false).expect("backbone");
    let _h = crate::model::ScoreHead::new(args.hidden_size, 1, vb).expect("score head");
    for (name, var) in varmap.data().lock().expect("varmap lock").iter() {
        if !name.ends_with("norm.weight") {
            let t = var.as_tensor();
            var.set(&Tensor::randn(0f32, seed_stdev, t.shape(), &Device::Cpu).expect("randn"))
                .expect("set");
        }
    }
    write_tokenizer_dir(dir).expect("tokenizer files");
    crate::weights::hf::save_dir(&varmap, &args, dir, &[258], Some(dir), None).expect("save");
}

/// The Qwen3-MoE shape of the MoE benchmarks (`benches/moe.rs`, `benches/moe_decode.rs`): 8
/// experts top-2, hidden 256, 4 heads of 64 (2 key/value heads), expert and dense width 512,
/// 2 layers of experts, vocabulary 512.
pub fn moe_bench_args() -> crate::model::ModelArgs {
    let mut args = crate::model::ModelArgs::tiny(crate::model::Arch::Qwen3Moe, 512);
    args.hidden_size = 256;
    args.num_attention_heads = 4;
    args.num_key_value_heads = 2;
    args.head_dim = 64;
    args.intermediate_size = 512;
    args.num_hidden_layers = 2;
    let moe = args.moe.as_mut().expect("a MoE config");
    moe.num_experts = 8;
    moe.num_experts_per_tok = 2;
    moe.moe_intermediate_size = 512;
    moe.mlp_only_layers.clear();
    args
}

/// Writes a model as llama.cpp would: GGUF names, permuted Llama Q/K rows, a layer's experts
/// stacked per projection (`ffn_gate_exps` `[experts, out, in]`, ...), `dtype` storage, and a
/// byte-level tokenizer in the metadata.
pub fn write_gguf(
    vm: &candle_nn::VarMap,
    args: &crate::model::ModelArgs,
    path: &std::path::Path,
    dtype: candle_core::quantized::GgmlDType,
) {
    write_gguf_with(vm, args, path, dtype, false)
}

/// llama.cpp's name of a (non-expert) tensor of an HF checkpoint.
fn gguf_name(name: &str) -> String {
    match name {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.").unwrap();
    let (n, part) = rest.split_once('.').unwrap();
    let p = match part {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "mlp.gate.weight" => "ffn_gate_inp.weight",
        other => panic!("unexpected {other}"),
    };
    format!("blk.{n}.{p}")
}

/// Each stack of experts' matrices (`(expert, [out, in])` under its GGUF name) as one
/// `[experts, out, in]` tensor; with `fused`, a layer's gate and up stacks as one
/// `ffn_gate_up_exps` `[experts, 2·out, in]`, gate rows first.
fn stacked_experts(
    stacks: std::collections::BTreeMap<String, Vec<(usize, candle_core::Tensor)>>,
    fused: bool,
) -> std::collections::BTreeMap<String, candle_core::Tensor> {
    let mut stacked: std::collections::BTreeMap<String, candle_core::Tensor> = Default::default();
    for (gg, mut experts) in stacks {
        experts.sort_by_key(|(e, _)| *e);
        let ts: Vec<candle_core::Tensor> = experts.into_iter().map(|(_, t)| t).collect();
        stacked.insert(gg, candle_core::Tensor::stack(&ts, 0).unwrap());
    }
    if fused {
        let gates: Vec<String> = stacked
            .keys()
            .filter(|k| k.ends_with("ffn_gate_exps.weight"))
            .cloned()
            .collect();
        for g in gates {
            let u = g.replace("ffn_gate_exps", "ffn_up_exps");
            let (gt, ut) = (stacked.remove(&g).unwrap(), stacked.remove(&u).unwrap());
            let both = candle_core::Tensor::cat(&[gt, ut], 1).unwrap();
            stacked.insert(g.replace("ffn_gate_exps", "ffn_gate_up_exps"), both);
        }
    }
    stacked
}

/// [`write_gguf`]; with `fused_experts`, each layer's experts' gate and up projections as one
/// `ffn_gate_up_exps` stack `[experts, 2·inter, hidden]` (gate rows first), as newer llama.cpp
/// converters may write them.
pub fn write_gguf_with(
    vm: &candle_nn::VarMap,
    args: &crate::model::ModelArgs,
    path: &std::path::Path,
    dtype: candle_core::quantized::GgmlDType,
    fused_experts: bool,
) {
    use candle_core::quantized::gguf_file::Value as G;
    use candle_core::quantized::QTensor;
    let data = vm.data().lock().unwrap();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    // Experts' projections by (GGUF name, expert), stacked after the loop.
    let mut stacks: std::collections::BTreeMap<String, Vec<(usize, candle_core::Tensor)>> =
        Default::default();
    for (name, var) in data.iter() {
        let t = var.as_tensor().clone();
        if let Some((layer, rest)) = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once(".mlp.experts."))
        {
            let (e, proj) = rest.split_once('.').unwrap();
            let kind = proj.strip_suffix("_proj.weight").unwrap();
            let gg = format!("blk.{layer}.ffn_{kind}_exps.weight");
            stacks.entry(gg).or_default().push((e.parse().unwrap(), t));
            continue;
        }
        let gg = gguf_name(name);
        // llama.cpp permutes q/k rows for Llama only (Qwen rotates as HF does).
        let llama = args.arch == crate::model::Arch::Llama;
        let t = if llama && gg.ends_with("attn_q.weight") {
            crate::weights::gguf::permute(&t, args.num_attention_heads).unwrap()
        } else if llama && gg.ends_with("attn_k.weight") {
            crate::weights::gguf::permute(&t, args.num_key_value_heads).unwrap()
        } else {
            t
        };
        // 1-D tensors stay F32, as llama.cpp keeps norms.
        let q = QTensor::quantize(
            &t,
            if t.rank() == 1 {
                candle_core::quantized::GgmlDType::F32
            } else {
                dtype
            },
        )
        .unwrap();
        tensors.push((gg, q));
    }
    for (gg, t) in stacked_experts(stacks, fused_experts) {
        tensors.push((gg, QTensor::quantize(&t, dtype).unwrap()));
    }
    let tok = byte_tokenizer();
    let vocab = tok.get_vocab(true);
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, i) in &vocab {
        tokens[*i as usize] = t.clone();
    }
    let types: Vec<G> = (0..tokens.len())
        .map(|i| G::I32(if i >= 256 { 3 } else { 1 }))
        .collect();
    let u = |x: usize| G::U32(x as u32);
    let a = crate::weights::gguf::gguf_arch_name(args.arch).unwrap();
    let k = |s: &str| format!("{a}.{s}");
    let mut meta: Vec<(String, G)> = vec![
        ("general.architecture".into(), G::String(a.into())),
        (k("block_count"), u(args.num_hidden_layers)),
        (k("embedding_length"), u(args.hidden_size)),
        (k("feed_forward_length"), u(args.intermediate_size)),
        (k("attention.head_count"), u(args.num_attention_heads)),
        (k("attention.head_count_kv"), u(args.num_key_value_heads)),
        (k("attention.key_length"), u(args.head_dim)),
        (
            k("attention.layer_norm_rms_epsilon"),
            G::F32(args.rms_norm_eps as f32),
        ),
        (k("rope.freq_base"), G::F32(args.rope_theta as f32)),
        (k("context_length"), u(args.max_position_embeddings)),
        (k("vocab_size"), u(args.vocab_size)),
        ("tokenizer.ggml.model".into(), G::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), G::String("smollm".into())),
        (
            "tokenizer.ggml.tokens".into(),
            G::Array(tokens.iter().map(|t| G::String(t.clone())).collect()),
        ),
        ("tokenizer.ggml.merges".into(), G::Array(vec![])),
        ("tokenizer.ggml.token_type".into(), G::Array(types)),
        ("tokenizer.ggml.eos_token_id".into(), u(258)),
        ("tokenizer.chat_template".into(), G::String(CHATML.into())),
    ];
    if let Some(m) = &args.moe {
        meta.extend([
            (k("expert_count"), u(m.num_experts)),
            (k("expert_used_count"), u(m.num_experts_per_tok)),
            (k("expert_feed_forward_length"), u(m.moe_intermediate_size)),
        ]);
    }
    let meta_refs: Vec<(&str, &G)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    candle_core::quantized::gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
}

#[cfg(test)]
mod tests {
    /// tests/fixtures/byte_tokenizer is what [`super::write_tokenizer_dir`] writes (the GPU
    /// checks' model directory takes its tokenizer from there: scripts/gpu/model.py). With
    /// MAIN_PPO_REGENERATE=1 the fixture is written anew.
    #[test]
    fn the_byte_tokenizer_fixture_is_current() {
        let fixture =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/byte_tokenizer");
        if std::env::var_os("MAIN_PPO_REGENERATE").is_some() {
            super::write_tokenizer_dir(&fixture).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        super::write_tokenizer_dir(dir.path()).unwrap();
        for name in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            let read = |p: &std::path::Path| -> serde_json::Value {
                let text = std::fs::read_to_string(p.join(name)).unwrap_or_else(|e| {
                    panic!("{}: {e} (MAIN_PPO_REGENERATE=1 writes it)", p.display())
                });
                serde_json::from_str(&text).unwrap()
            };
            assert_eq!(
                read(&fixture),
                read(dir.path()),
                "{name} is stale: MAIN_PPO_REGENERATE=1 rewrites it"
            );
        }
    }
}
