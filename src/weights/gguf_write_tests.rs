//! The GGUF writer against this program's GGUF reader: tiny models of each written family
//! (built here) written in f32, f16 and bf16 and read back give the same logits as the model
//! (f32) or as the model with its matrices rounded to the file's type (f16, bf16), the same
//! token ids and chat template; what the layout cannot hold is refused by name. With
//! MAIN_PPO_SMOLLM2 (SmolLM2's GGUF, written by llama.cpp's converter), that file written again
//! carries the converter's tokenizer metadata.

use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

use super::gguf;
use super::gguf_write::{self, GgufType};
use crate::data::TokenizerBundle;
use crate::model::config::LayerKind;
use crate::model::{Arch, CausalLm, ModelArgs};

/// The test tokenizer (byte-level BPE, ChatML template, `<|im_end|>` EOS) as a bundle.
fn bundle(dir: &Path) -> TokenizerBundle {
    crate::testing::write_tokenizer_dir(dir).unwrap();
    TokenizerBundle::from_dir(dir).unwrap()
}

/// A tiny model of `arch` as llama.cpp can run it: head width 16 (the Q/K permutation is not
/// its own inverse there), untied for Qwen, Gemma 3's layers as llama.cpp fixes them.
fn family_args(arch: Arch) -> ModelArgs {
    let mut args = ModelArgs::tiny(arch, 259);
    args.head_dim = 16;
    args.hidden_size = 64;
    args.intermediate_size = 64;
    args.tie_word_embeddings = matches!(arch, Arch::Llama | Arch::Gemma3);
    if let Some(m) = args.moe.as_mut() {
        m.mlp_only_layers.clear();
        m.moe_intermediate_size = 32;
    }
    if arch == Arch::Gemma3 {
        // Every sixth layer global, local RoPE base 10000, scores scaled by head_dim^-½.
        args.layer_types = vec![LayerKind::Sliding, LayerKind::Sliding];
        args.rope_local_theta = Some(1e4);
        args.query_pre_attn_scalar = Some(16.0);
    }
    args
}

/// Random weights, norms included (so Gemma's `1 + w` storage is exercised).
fn random_model(args: &ModelArgs) -> VarMap {
    let (vm, _) = crate::testing::tiny_model(args, DType::F32, 0.3);
    for (name, var) in vm.data().lock().unwrap().iter() {
        if name.ends_with("norm.weight") {
            let t = var.as_tensor();
            // 1 ± 0.2, the same on every run (seeded by the name).
            let seed = name
                .bytes()
                .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
            let noise: Vec<f32> = crate::testing::uniform(t.elem_count(), seed)
                .into_iter()
                .map(|u| (0.2 * u) as f32)
                .collect();
            let noise = Tensor::from_vec(noise, t.shape(), &Device::Cpu).unwrap();
            var.set(&(t + noise).unwrap()).unwrap();
        }
    }
    vm
}

/// The model's logits on two left-padded rows.
fn logits(m: &CausalLm) -> Tensor {
    let (pi, pm, pp) =
        crate::weights::tests::left_pad(&[vec![3, 1, 4, 1, 5, 9, 2, 6], vec![6, 5]], 0);
    m.logits(&m.forward_hidden(&pi, &pp, &pm, None).unwrap())
        .unwrap()
}

/// `vm`'s weights as `args`'s model, each first passed through `round`.
fn model_of(vm: &VarMap, args: &ModelArgs, round: impl Fn(&str, &Tensor) -> Tensor) -> CausalLm {
    let out = VarMap::new();
    let m = CausalLm::new(
        args,
        VarBuilder::from_varmap(&out, DType::F32, &Device::Cpu),
        true,
    )
    .unwrap();
    let src = vm.data().lock().unwrap();
    for (name, var) in out.data().lock().unwrap().iter() {
        var.set(&round(name, src[name].as_tensor())).unwrap();
    }
    m
}

fn write(vm: &VarMap, args: &ModelArgs, tok: &TokenizerBundle, ty: GgufType, path: &Path) {
    gguf_write::build(vm, args, tok, "tiny", ty, path)
        .unwrap()
        .write_file(path)
        .unwrap();
}

/// Every written family, f32 / f16 / bf16: the file loads through `gguf::load` as the same
/// hyper-parameters, and its logits equal those of the model with its matrices rounded to the
/// file's type (norms, biases and routers stay f32, as llama.cpp keeps them): exactly for f32
/// (Gemma's `1 + w` norms within 1e-5, the sum rounds); Llama's permuted q/k rows are checked by
/// that equality. The tokenizer read back gives the same ids on the writer's check texts and
/// the same chat template, EOS and padding.
#[test]
fn a_model_written_as_gguf_reads_back_with_its_logits_and_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let tok = bundle(&dir.path().join("tok"));
    for arch in [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Gemma3,
    ] {
        let args = family_args(arch);
        let vm = random_model(&args);
        let exact = logits(&model_of(&vm, &args, |_, t| t.clone()));
        for ty in [GgufType::F32, GgufType::F16, GgufType::Bf16] {
            let path = dir.path().join(format!("{arch:?}-{}.gguf", ty.name()));
            write(&vm, &args, &tok, ty, &path);
            let (loaded, content) = gguf::load(&path, DType::F32, &Device::Cpu, true).unwrap();
            assert_eq!(loaded.model.args, args, "{arch:?} {ty:?}");
            let got = logits(&loaded.model);
            let dtype = match ty {
                GgufType::F32 => DType::F32,
                GgufType::F16 => DType::F16,
                GgufType::Bf16 => DType::BF16,
            };
            let rounded = model_of(&vm, &args, |name, t| {
                let kept = t.rank() <= 1 || name.ends_with(".mlp.gate.weight");
                match kept {
                    true => t.clone(),
                    false => t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap(),
                }
            });
            let d = crate::testing::max_abs_diff(&got, &logits(&rounded)) as f32;
            let tol = if arch == Arch::Gemma3 { 1e-5 } else { 0.0 };
            assert!(
                d <= tol,
                "{arch:?} {ty:?}: logits differ by {d} from the rounded model's"
            );
            // Against the unrounded model: within the type's rounding, relative to the largest
            // logit (f16 keeps 11 significant bits, bf16 8; the exact check is the one above).
            let scale = exact
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let off = crate::testing::max_abs_diff(&got, &exact) as f32 / scale;
            let bound = match ty {
                GgufType::F32 => tol,
                GgufType::F16 => 2e-2,
                GgufType::Bf16 => 1e-1,
            };
            eprintln!(
                "{arch:?} {ty:?}: {off:.2e} of the largest logit ({scale:.2}) from the f32 model's"
            );
            // (A MoE router's top-k may flip under rounding: no bound for it.)
            assert!(
                off <= bound || args.moe.is_some(),
                "{arch:?} {ty:?}: {off} of the largest logit from the f32 model's logits"
            );
            let back = gguf::tokenizer(&content, &path).unwrap();
            for text in [
                "Natalia sold 48 clips.<|im_end|>",
                "ünïcödé 12345\n\n  x",
                "<|im_start|>user\nhi",
            ] {
                let ids = |t: &TokenizerBundle| {
                    t.tokenizer.encode(text, false).unwrap().get_ids().to_vec()
                };
                assert_eq!(ids(&back), ids(&tok), "{text:?}");
            }
            assert_eq!(back.chat_template, tok.chat_template);
            assert_eq!(back.special.eos, tok.special.eos);
            assert_eq!(back.pad_token_id, tok.pad_token_id);
            assert!(tok
                .eos_token_ids
                .iter()
                .all(|i| back.eos_token_ids.contains(i)));
        }
    }
}

/// The metadata and tensor types as llama.cpp's converter writes a Llama model in f16: the
/// `llama.*` hyper-parameters (an eps of 9.999999747378752e-6 written as the f32 1e-5), `general.file_type` 1, matrices F16 and norms F32, no
/// `output.weight` for tied embeddings, the byte-level tokenizer as `gpt2` with its
/// pre-tokenizer, token types (the three added tokens CONTROL) and special ids.
#[test]
fn a_gguf_file_carries_the_converters_keys_and_types() {
    use candle_core::quantized::GgmlDType;
    let dir = tempfile::tempdir().unwrap();
    let tok = bundle(&dir.path().join("tok"));
    let mut args = family_args(Arch::Llama);
    // 1e-5 through f32, as a config.json written from f32 says it (the f32 HF copy of SmolLM2
    // says 9.999999747378752e-6): the f32 the metadata holds, which reads back as 1e-5.
    args.rms_norm_eps = f64::from(1e-5f32);
    let vm = random_model(&args);
    let path = dir.path().join("m.gguf");
    write(&vm, &args, &tok, GgufType::F16, &path);
    let (_, c) = gguf::open(&path).unwrap();
    let u = |k: &str| c.metadata[k].to_u32().unwrap();
    let s = |k: &str| c.metadata[k].to_string().unwrap().clone();
    assert_eq!(s("general.architecture"), "llama");
    assert_eq!(s("general.name"), "tiny");
    assert_eq!(u("general.file_type"), 1);
    assert_eq!(u("general.quantization_version"), 2);
    for (k, v) in [
        ("llama.block_count", 2),
        ("llama.embedding_length", 64),
        ("llama.feed_forward_length", 64),
        ("llama.attention.head_count", 4),
        ("llama.attention.head_count_kv", 2),
        ("llama.attention.key_length", 16),
        ("llama.attention.value_length", 16),
        ("llama.rope.dimension_count", 16),
        ("llama.context_length", 512),
        ("llama.vocab_size", 259),
    ] {
        assert_eq!(u(k), v, "{k}");
    }
    assert_eq!(
        c.metadata["llama.rope.freq_base"].to_f32().unwrap(),
        10000.0
    );
    assert_eq!(
        c.metadata["llama.attention.layer_norm_rms_epsilon"]
            .to_f32()
            .unwrap(),
        1e-5
    );
    assert_eq!(s("tokenizer.ggml.model"), "gpt2");
    // The test tokenizer has no merges: the first name tried reproduces it.
    assert_eq!(s("tokenizer.ggml.pre"), "smollm");
    assert!(!c.metadata.contains_key("tokenizer.ggml.merges"));
    let types: Vec<i32> = c.metadata["tokenizer.ggml.token_type"]
        .to_vec()
        .unwrap()
        .iter()
        .map(|v| v.to_i32().unwrap())
        .collect();
    assert_eq!(types.len(), 259);
    assert!(types[..256].iter().all(|t| *t == 1) && types[256..].iter().all(|t| *t == 3));
    assert_eq!(u("tokenizer.ggml.eos_token_id"), 258);
    assert_eq!(u("tokenizer.ggml.padding_token_id"), 256);
    assert!(!c.metadata.contains_key("tokenizer.ggml.bos_token_id"));
    assert!(!c.metadata["tokenizer.ggml.add_bos_token"]
        .to_bool()
        .unwrap());
    assert_eq!(s("tokenizer.chat_template"), crate::testing::CHATML);
    assert!(
        !c.tensor_infos.contains_key("output.weight"),
        "tied: no LM head"
    );
    assert_eq!(
        c.tensor_infos["token_embd.weight"].ggml_dtype,
        GgmlDType::F16
    );
    assert_eq!(
        c.tensor_infos["blk.1.attn_q.weight"].ggml_dtype,
        GgmlDType::F16
    );
    assert_eq!(
        c.tensor_infos["blk.0.attn_norm.weight"].ggml_dtype,
        GgmlDType::F32
    );
    assert_eq!(
        c.tensor_infos["output_norm.weight"].ggml_dtype,
        GgmlDType::F32
    );
    // GGUF dims are [in, out]: candle reads them back as [out, in].
    assert_eq!(
        c.tensor_infos["blk.0.attn_k.weight"].shape.dims(),
        &[32, 64]
    );
}

fn refused(vm: &VarMap, args: &ModelArgs, tok: &TokenizerBundle, path: &Path) -> String {
    match gguf_write::build(vm, args, tok, "tiny", GgufType::F16, path) {
        Ok(_) => panic!("{:?} written", args.arch),
        Err(e) => e.to_string(),
    }
}

/// What llama.cpp's layout cannot hold is refused naming the file and the reason: a family
/// whose GGUF the writer does not lay out (Qwen3.5's DeltaNet), a critic's value head, Gemma 3
/// layers other than llama.cpp's fixed pattern (the fields named), Llama 3 RoPE scaling and a
/// Qwen3-MoE with a dense layer. Nothing is written.
#[test]
fn what_a_gguf_file_cannot_hold_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let tok = bundle(&dir.path().join("tok"));
    let path = dir.path().join("out.gguf");
    let hybrid = ModelArgs::tiny(Arch::Qwen3_5, 259);
    let e = refused(&VarMap::new(), &hybrid, &tok, &path);
    assert!(
        e.contains("out.gguf")
            && e.contains("Qwen3_5")
            && e.contains("`qwen35`")
            && e.contains("HF folder"),
        "{e}"
    );

    let args = family_args(Arch::Qwen2);
    let vm = random_model(&args);
    let head = Tensor::zeros((1, 64), DType::F32, &Device::Cpu).unwrap();
    vm.data().lock().unwrap().insert(
        "score.weight".into(),
        candle_core::Var::from_tensor(&head).unwrap(),
    );
    let e = refused(&vm, &args, &tok, &path);
    assert!(
        e.contains("`score.weight`") && e.contains("value head") && e.contains("`qwen2`"),
        "{e}"
    );

    // ModelArgs::tiny's Gemma 3: a global second layer, local base 1000, scalar 12.
    let gemma = ModelArgs::tiny(Arch::Gemma3, 259);
    let vm = random_model(&gemma);
    let e = refused(&vm, &gemma, &tok, &path);
    for field in [
        "layer_types",
        "rope_local_theta",
        "query_pre_attn_scalar",
        "`gemma3`",
    ] {
        assert!(e.contains(field), "{field}: {e}");
    }

    let mut llama3 = family_args(Arch::Llama);
    llama3.rope_scaling = Some(crate::model::config::RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    });
    let e = refused(&random_model(&llama3), &llama3, &tok, &path);
    assert!(e.contains("RoPE scaling") && e.contains("`llama`"), "{e}");

    let mut moe = family_args(Arch::Qwen3Moe);
    moe.moe.as_mut().unwrap().mlp_only_layers = vec![1];
    let e = refused(&random_model(&moe), &moe, &tok, &path);
    assert!(
        e.contains("mlp_only_layers") && e.contains("`qwen3moe`"),
        "{e}"
    );

    // DeepSeek-V3 and GLM-4.5: llama.cpp's `deepseek2` and `glm4moe` layouts are its converter's alone.
    let deepseek = ModelArgs::tiny(Arch::DeepseekV3, 259);
    let e = refused(&random_model(&deepseek), &deepseek, &tok, &path);
    assert!(
        e.contains("out.gguf")
            && e.contains("DeepseekV3")
            && e.contains("`deepseek2`")
            && e.contains("HF folder"),
        "{e}"
    );
    let glm = ModelArgs::tiny(Arch::Glm4Moe, 259);
    let e = refused(&random_model(&glm), &glm, &tok, &path);
    assert!(
        e.contains("Glm4Moe") && e.contains("`glm4moe`") && e.contains("HF folder"),
        "{e}"
    );
    assert!(!path.exists());
}

/// A converter-written GGUF and the same model written again by this writer.
struct Rewritten {
    original: candle_core::quantized::gguf_file::Content,
    written: candle_core::quantized::gguf_file::Content,
    loaded: super::hf::Loaded,
    tok: TokenizerBundle,
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// The GGUF file `var` names loaded and written again as `ty`; `None` (said) when `var` is
/// unset (`fetch` writes the file).
fn rewritten(var: &str, fetch: &str, ty: GgufType) -> Option<Rewritten> {
    let Some(orig) = std::env::var_os(var) else {
        eprintln!("{var} is not set ({fetch}): skipped");
        return None;
    };
    let orig = std::path::PathBuf::from(orig);
    let (loaded, original) = gguf::load(&orig, DType::F32, &Device::Cpu, true).unwrap();
    let tok = gguf::tokenizer(&original, &orig).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rewritten.gguf");
    write(&loaded.varmap, &loaded.model.args, &tok, ty, &path);
    let (_, written) = gguf::open(&path).unwrap();
    Some(Rewritten {
        original,
        written,
        loaded,
        tok,
        path,
        _dir: dir,
    })
}

/// SmolLM2-135M-Instruct's GGUF (MAIN_PPO_SMOLLM2, written by llama.cpp's converter) loaded and
/// written again in f32 carries the same tokenizer metadata: tokens, token types, merges,
/// pre-tokenizer, special ids, chat template, and the same hyper-parameter keys.
#[test]
fn smollm2_written_again_keeps_the_converters_tokenizer_metadata() {
    let Some(r) = rewritten(
        "MAIN_PPO_SMOLLM2",
        "scripts/fetch_smollm2.sh",
        GgufType::F32,
    ) else {
        return;
    };
    let (c, w) = (&r.original, &r.written);
    for key in [
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.chat_template",
        "general.architecture",
        "llama.block_count",
        "llama.context_length",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.vocab_size",
        "llama.rope.dimension_count",
    ] {
        let (a, b) = (c.metadata.get(key), w.metadata.get(key));
        assert_eq!(
            a.map(|v| format!("{v:?}")),
            b.map(|v| format!("{v:?}")),
            "{key}"
        );
    }
    let flag = |m: &std::collections::HashMap<String, Value>, k: &str| {
        m.get(k).map(|v| v.to_bool().unwrap())
    };
    if let Some(add_bos) = flag(&c.metadata, "tokenizer.ggml.add_bos_token") {
        assert_eq!(
            flag(&w.metadata, "tokenizer.ggml.add_bos_token"),
            Some(add_bos)
        );
    }
}

/// Gemma 3 270M's GGUF (MAIN_PPO_GEMMA3, written by llama.cpp's converter from its
/// sentencepiece model) loaded and written again in f16: the same architecture keys, the same
/// tokens and token types but for the runs of spaces the reader respells with `▁` (the
/// converter's user-defined `"  "`… come back as the vocabulary's `▁▁`…), the same special ids
/// and flags; the file reads back as the same model and tokenizer.
#[test]
fn gemma3_written_again_keeps_its_vocabulary() {
    let Some(r) = rewritten("MAIN_PPO_GEMMA3", "scripts/fetch_gemma3.sh", GgufType::F16) else {
        return;
    };
    let (c, w) = (&r.original, &r.written);
    for key in [
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.add_space_prefix",
        "general.architecture",
        "gemma3.context_length",
        "gemma3.embedding_length",
        "gemma3.block_count",
        "gemma3.feed_forward_length",
        "gemma3.attention.head_count",
        "gemma3.attention.head_count_kv",
        "gemma3.attention.key_length",
        "gemma3.attention.value_length",
        "gemma3.rope.freq_base",
        "gemma3.attention.sliding_window",
        "gemma3.attention.layer_norm_rms_epsilon",
    ] {
        let (a, b) = (c.metadata.get(key), w.metadata.get(key));
        assert_eq!(
            a.map(|v| format!("{v:?}")),
            b.map(|v| format!("{v:?}")),
            "{key}"
        );
    }
    let strings = |m: &std::collections::HashMap<String, Value>, k: &str| -> Vec<String> {
        m[k].to_vec()
            .unwrap()
            .iter()
            .map(|v| v.to_string().unwrap().clone())
            .collect()
    };
    let ints = |m: &std::collections::HashMap<String, Value>, k: &str| -> Vec<i32> {
        m[k].to_vec()
            .unwrap()
            .iter()
            .map(|v| v.to_i32().unwrap())
            .collect()
    };
    let (ta, tb) = (
        strings(&c.metadata, "tokenizer.ggml.tokens"),
        strings(&w.metadata, "tokenizer.ggml.tokens"),
    );
    let (ya, yb) = (
        ints(&c.metadata, "tokenizer.ggml.token_type"),
        ints(&w.metadata, "tokenizer.ggml.token_type"),
    );
    assert_eq!((ta.len(), ya.len()), (tb.len(), yb.len()));
    let mut respelled = 0;
    for i in 0..ta.len() {
        if ta[i] == tb[i] && ya[i] == yb[i] {
            continue;
        }
        let spaces = ta[i].chars().all(|ch| ch == ' ') && tb[i] == "\u{2581}".repeat(ta[i].len());
        assert!(
            spaces,
            "token {i}: {:?} type {} written as {:?} type {}",
            ta[i], ya[i], tb[i], yb[i]
        );
        respelled += 1;
    }
    eprintln!("{respelled} runs of spaces respelled");
    let (back, wc) = gguf::load(&r.path, DType::F32, &Device::Cpu, true).unwrap();
    assert_eq!(back.model.args, r.loaded.model.args);
    let back_tok = gguf::tokenizer(&wc, &r.path).unwrap();
    for text in [
        "Hello world,   three spaces\n\n\tand <start_of_turn>user\nhi<end_of_turn>",
        "ünïcödé 12345 中文",
    ] {
        let ids = |t: &TokenizerBundle| t.tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(ids(&back_tok), ids(&r.tok), "{text:?}");
    }
}
