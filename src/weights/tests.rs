//! Loading and saving tests on tiny random models: HF directories (single and sharded,
//! transformers 4 and 5 layouts) and GGUF files, against the same weights in memory.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

use super::*;
use crate::model::{Arch, CausalLm, ModelArgs};

fn model(arch: Arch, dtype: DType) -> (VarMap, CausalLm) {
    let mut args = ModelArgs::tiny(arch, 61);
    args.tie_word_embeddings = arch == Arch::Llama;
    crate::testing::tiny_model(&args, dtype, 0.3)
}

fn ids(rows: &[Vec<u32>]) -> Tensor {
    Tensor::new(rows.to_vec(), &Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Left-padded batch: (input ids, key mask, positions) for prompts of different lengths.
pub(super) fn left_pad(prompts: &[Vec<u32>], pad: u32) -> (Tensor, Tensor, Tensor) {
    let w = prompts.iter().map(Vec::len).max().unwrap();
    let mut i = Vec::new();
    let mut m = Vec::new();
    let mut p = Vec::new();
    for pr in prompts {
        let padn = w - pr.len();
        i.push([vec![pad; padn], pr.clone()].concat());
        m.push([vec![0u32; padn], vec![1; pr.len()]].concat());
        p.push([vec![0u32; padn], (0..pr.len() as u32).collect()].concat());
    }
    (ids(&i), ids(&m), ids(&p))
}

#[test]
fn save_and_load_round_trip_single_and_sharded() {
    for (arch, shard) in [
        (Arch::Llama, None),
        (Arch::Qwen2, Some(20_000usize)),
        (Arch::Gemma3, None),
    ] {
        let (vm, m) = model(arch, DType::F32);
        let dir = tempfile::tempdir().unwrap();
        let tok = tempfile::tempdir().unwrap();
        crate::testing::write_tokenizer_dir(tok.path()).unwrap();
        hf::save_dir(&vm, &m.args, dir.path(), &[258], Some(tok.path()), shard).unwrap();
        if shard.is_some() {
            assert!(dir.path().join("model.safetensors.index.json").is_file());
            let n = std::fs::read_dir(dir.path())
                .unwrap()
                .filter(|e| {
                    e.as_ref()
                        .unwrap()
                        .file_name()
                        .to_string_lossy()
                        .ends_with(".safetensors")
                })
                .count();
            assert!(n > 1, "sharded into {n} files");
        }
        assert!(
            dir.path().join("tokenizer.json").is_file()
                && dir.path().join("generation_config.json").is_file()
        );
        let loaded = hf::load_dir(
            dir.path(),
            &Default::default(),
            DType::F32,
            &Device::Cpu,
            true,
        )
        .unwrap();
        assert_eq!(loaded.model.args, m.args);
        let (pi, pm, pp) = left_pad(&[vec![3, 1, 4, 1, 5], vec![9, 2]], 0);
        let a = m
            .logits(&m.forward_hidden(&pi, &pp, &pm, None).unwrap())
            .unwrap();
        let b = loaded
            .model
            .logits(&loaded.model.forward_hidden(&pi, &pp, &pm, None).unwrap())
            .unwrap();
        assert_eq!(
            max_diff(&a, &b),
            0.0,
            "{arch:?}: identical outputs after the round trip"
        );
        // The tokenizer bundle reads the saved directory.
        let bundle = crate::data::TokenizerBundle::from_dir(dir.path()).unwrap();
        assert_eq!(bundle.eos_token_ids, vec![258]);
    }
}

#[test]
fn load_errors_name_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let e = hf::load_dir(
        dir.path(),
        &Default::default(),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("no config.json"), "{e}");
    let (vm, m) = model(Arch::Llama, DType::F32);
    hf::save_dir(&vm, &m.args, dir.path(), &[1], None, None).unwrap();
    // Unsupported architecture.
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    cfg["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    cfg["model_type"] = serde_json::json!("gpt2");
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let e = hf::load_dir(
        dir.path(),
        &Default::default(),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("GPT2LMHeadModel") && e.contains("LlamaForCausalLM"),
        "{e}"
    );
    // A shape mismatch names the tensor.
    cfg["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    cfg["model_type"] = serde_json::json!("llama");
    cfg["intermediate_size"] = serde_json::json!(64);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let e = hf::load_dir(
        dir.path(),
        &Default::default(),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("model.layers.0.mlp.down_proj.weight")
            && e.contains("shape [32, 48], expected [32, 64]"),
        "{e}"
    );
    // override_config applies before the check.
    hf::load_dir(
        dir.path(),
        &serde_json::Map::from_iter([("intermediate_size".to_string(), serde_json::json!(48))]),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .unwrap();
    std::fs::write(dir.path().join("model.safetensors"), b"garbage").unwrap();
    let e = hf::load_dir(
        dir.path(),
        &Default::default(),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("safetensors"),
        "{e}"
    );
}

/// The GGUF writer of the tests (llama.cpp's layout): [`crate::testing::write_gguf`].
pub(super) use crate::testing::{write_gguf, write_gguf_with};

/// A GGUF written as llama.cpp writes each family (Llama's permuted q/k rows, Qwen3's q/k
/// norms, Qwen3-MoE's routers and stacked experts with a dense layer between) loads as the same
/// model: F32 logits equal those of the safetensors weights, Q8_0 those of the same weights
/// after the same quantisation round trip.
#[test]
fn a_gguf_loads_and_matches_the_same_weights_from_safetensors() {
    for arch in [Arch::Llama, Arch::Qwen3, Arch::Qwen3Moe] {
        gguf_matches_safetensors(arch);
    }
}

fn gguf_matches_safetensors(arch: Arch) {
    use candle_core::quantized::GgmlDType;
    let mut args = ModelArgs::tiny(arch, 259);
    args.tie_word_embeddings = false;
    args.head_dim = 16; // d/2 = 8: the permutation is not its own inverse at this size
    args.hidden_size = 64;
    args.intermediate_size = 64; // row length a multiple of 32 for Q8_0 blocks
    if let Some(m) = args.moe.as_mut() {
        m.moe_intermediate_size = 64;
    }
    let (vm, m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
    let dir = tempfile::tempdir().unwrap();
    let (pi, pm, pp) = left_pad(&[vec![3, 1, 4, 1, 5, 9, 2], vec![6, 5]], 0);
    drop(m);
    for dtype in [GgmlDType::F32, GgmlDType::Q8_0] {
        let path = dir.path().join(format!("m-{dtype:?}.gguf"));
        write_gguf(&vm, &args, &path, dtype);
        let (loaded, content) = gguf::load(&path, DType::F32, &Device::Cpu, true).unwrap();
        assert_eq!(loaded.model.args, args);
        let got = loaded
            .model
            .logits(&loaded.model.forward_hidden(&pi, &pp, &pm, None).unwrap())
            .unwrap();
        // The reference: the same weights after the same quantisation round trip, in the
        // safetensors-style model (exact for F32).
        let qvm = VarMap::new();
        let qm = CausalLm::new(
            &args,
            VarBuilder::from_varmap(&qvm, DType::F32, &Device::Cpu),
            true,
        )
        .unwrap();
        for (name, var) in qvm.data().lock().unwrap().iter() {
            let src = vm.data().lock().unwrap()[name].as_tensor().clone();
            // (An expert's matrix is quantised as a slice of its stack: Q8_0's blocks run along
            // rows, so the round trip is the same.)
            let t = if src.rank() == 2 {
                candle_core::quantized::QTensor::quantize(&src, dtype)
                    .unwrap()
                    .dequantize(&Device::Cpu)
                    .unwrap()
            } else {
                src
            };
            var.set(&t).unwrap();
        }
        let want = qm
            .logits(&qm.forward_hidden(&pi, &pp, &pm, None).unwrap())
            .unwrap();
        let tol = 1e-5;
        let d = max_diff(&got, &want);
        assert!(d < tol, "{dtype:?}: max logit difference {d}");
        if dtype == GgmlDType::F32 {
            let bundle = gguf::tokenizer(&content, &path).unwrap();
            let reference = crate::testing::byte_tokenizer();
            for text in [
                "Natalia sold 48 clips.<|im_end|>",
                "ünïcödé 12345",
                "<|im_start|>user\nhi",
            ] {
                let a = bundle
                    .tokenizer
                    .encode(text, false)
                    .unwrap()
                    .get_ids()
                    .to_vec();
                let b = reference.encode(text, false).unwrap().get_ids().to_vec();
                // Digits are split one by one, the rest byte by byte: same ids here.
                assert_eq!(a, b, "{text}");
                assert_eq!(bundle.tokenizer.decode(&a, false).unwrap(), text);
            }
            // The file's EOS (`<|im_end|>`), then `<|endoftext|>`, which llama.cpp also ends
            // generation at (the HF directory's generation_config lists both too).
            assert_eq!(bundle.eos_token_ids, vec![258, 256]);
            assert!(bundle.template(None).is_ok());
        }
    }
    // Not a GGUF.
    std::fs::write(dir.path().join("bad.gguf"), b"nope").unwrap();
    let e = gguf::load(&dir.path().join("bad.gguf"), DType::F32, &Device::Cpu, true)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("bad.gguf") && e.contains("GGUF"), "{e}");
}

/// Logits of a fixed left-padded batch under the model in `dir` (config.json as written).
fn dir_logits(dir: &std::path::Path) -> Result<Tensor, String> {
    let loaded = hf::load_dir(dir, &Default::default(), DType::F32, &Device::Cpu, true)
        .map_err(|e| e.to_string())?;
    let (pi, pm, pp) = left_pad(&[vec![3, 1, 4, 1, 5, 9, 2, 6], vec![9, 2]], 0);
    let m = &loaded.model;
    Ok(m.logits(&m.forward_hidden(&pi, &pp, &pm, None).unwrap())
        .unwrap())
}

/// Rewrites `dir/config.json` through `edit`.
fn edit_config(dir: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&path, cfg.to_string()).unwrap();
}

/// transformers 5 writes `rope_parameters: {rope_theta, rope_type}` and no top-level
/// `rope_theta`. A model saved that way must give the logits of the same model in the old
/// layout (reading only the old key silently falls back to theta 10000: other logits).
#[test]
fn transformers_5_rope_parameters_load_like_the_old_layout() {
    // Gemma 3 writes RoPE per layer type; its layout is checked against transformers' own files
    // (weights::family_tests).
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let mut args = ModelArgs::tiny(arch, 61);
        args.rope_theta = 100_000.0;
        let (vm, _m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        let tok = tempfile::tempdir().unwrap();
        crate::testing::write_tokenizer_dir(tok.path()).unwrap();
        let save = |edit: &dyn Fn(&mut serde_json::Value)| {
            let dir = tempfile::tempdir().unwrap();
            hf::save_dir(&vm, &args, dir.path(), &[258], Some(tok.path()), None).unwrap();
            edit_config(dir.path(), edit);
            dir
        };
        // What this crate writes: both layouts.
        let both = save(&|_| {});
        let written: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(both.path().join("config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(written["rope_theta"], 100_000.0);
        assert_eq!(
            written["rope_parameters"],
            serde_json::json!({"rope_type": "default", "rope_theta": 100_000.0})
        );
        let old = save(&|c| {
            let o = c.as_object_mut().unwrap();
            o.remove("rope_parameters");
            o.remove("rope_scaling");
        });
        let v5 = save(&|c| {
            let o = c.as_object_mut().unwrap();
            o.remove("rope_theta");
            o.remove("rope_scaling");
        });
        let plain = save(&|c| {
            let o = c.as_object_mut().unwrap();
            o.remove("rope_theta");
            o.remove("rope_parameters");
            o.remove("rope_scaling");
        });
        let (a, b, c) = (
            dir_logits(old.path()).unwrap(),
            dir_logits(v5.path()).unwrap(),
            dir_logits(both.path()).unwrap(),
        );
        assert_eq!(max_diff(&a, &b), 0.0, "{arch:?}: v5 layout = old layout");
        assert_eq!(max_diff(&a, &c), 0.0, "{arch:?}: both layouts = old layout");
        // The default (10000) really is another model: the test would see a lost theta.
        let d = dir_logits(plain.path()).unwrap();
        assert!(max_diff(&a, &d) > 1e-4, "{arch:?}: theta matters here");
    }
}

/// Rewrites the safetensors file `file` with element `at` of tensor `name` set to `value`.
fn poison(file: &std::path::Path, name: &str, at: usize, value: f32) {
    let mut tensors = candle_core::safetensors::load(file, &Device::Cpu).unwrap();
    let t = &tensors[name];
    let mut v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    v[at] = value;
    let shape = t.shape().clone();
    tensors.insert(
        name.to_string(),
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, file).unwrap();
}

/// A NaN or an infinity in a model's weights is refused where the file is read, naming the
/// file (the shard that holds it), the tensor, how many values and the first index: an HF
/// directory in one file and in shards, and a GGUF file.
#[test]
fn a_non_finite_weight_is_refused_naming_the_file_and_tensor() {
    let load = |dir: &std::path::Path| {
        hf::load_dir(dir, &Default::default(), DType::F32, &Device::Cpu, true)
            .err()
            .expect("a non-finite weight is refused")
            .to_string()
    };
    let (vm, m) = model(Arch::Qwen2, DType::F32);
    let name = "model.layers.1.mlp.up_proj.weight";
    // One file: a NaN at index 5.
    let dir = tempfile::tempdir().unwrap();
    hf::save_dir(&vm, &m.args, dir.path(), &[1], None, None).unwrap();
    poison(&dir.path().join("model.safetensors"), name, 5, f32::NAN);
    let e = load(dir.path());
    assert!(
        e.contains("model.safetensors")
            && e.contains(name)
            && e.contains("1 non-finite")
            && e.contains("index 5"),
        "{e}"
    );
    // Shards: the error names the shard that holds the tensor (two infinities, first at 3).
    let dir = tempfile::tempdir().unwrap();
    hf::save_dir(&vm, &m.args, dir.path(), &[1], None, Some(20_000)).unwrap();
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shard = index["weight_map"][name].as_str().unwrap().to_string();
    poison(&dir.path().join(&shard), name, 7, f32::NEG_INFINITY);
    poison(&dir.path().join(&shard), name, 3, f32::INFINITY);
    let e = load(dir.path());
    assert!(
        e.contains(&shard)
            && e.contains(name)
            && e.contains("2 non-finite")
            && e.contains("index 3"),
        "{e}"
    );
    // GGUF: an infinity in an F32 tensor, named by its GGUF name.
    let mut args = ModelArgs::tiny(Arch::Qwen3, 259);
    args.tie_word_embeddings = false;
    let (vm, _m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
    {
        let data = vm.data().lock().unwrap();
        let var = &data["model.layers.0.mlp.down_proj.weight"];
        let mut v: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        v[2] = f32::INFINITY;
        let t = Tensor::from_vec(v, var.as_tensor().shape(), &Device::Cpu).unwrap();
        var.set(&t).unwrap();
    }
    let path = dir.path().join("m.gguf");
    write_gguf(&vm, &args, &path, candle_core::quantized::GgmlDType::F32);
    let e = gguf::load(&path, DType::F32, &Device::Cpu, true)
        .err()
        .expect("an infinite GGUF weight is refused")
        .to_string();
    assert!(
        e.contains("m.gguf") && e.contains("blk.0.ffn_down.weight") && e.contains("index 2"),
        "{e}"
    );
}

/// A Qwen3-MoE GGUF with each layer's experts' gate and up stacked together
/// (`ffn_gate_up_exps`) loads as the same model as one with them apart.
#[test]
fn a_qwen3moe_gguf_with_fused_gate_up_experts_loads_alike() {
    use candle_core::quantized::GgmlDType;
    let args = ModelArgs::tiny(Arch::Qwen3Moe, 259);
    let (vm, _m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
    let dir = tempfile::tempdir().unwrap();
    let (apart, fused) = (dir.path().join("apart.gguf"), dir.path().join("fused.gguf"));
    write_gguf_with(&vm, &args, &apart, GgmlDType::F32, false);
    write_gguf_with(&vm, &args, &fused, GgmlDType::F32, true);
    let load = |p: &std::path::Path| gguf::load(p, DType::F32, &Device::Cpu, true).unwrap().0;
    let (a, b) = (load(&apart), load(&fused));
    let content = gguf::open(&fused).unwrap().1;
    assert!(content
        .tensor_infos
        .contains_key("blk.0.ffn_gate_up_exps.weight"));
    let (wa, wb) = (
        a.varmap.data().lock().unwrap(),
        b.varmap.data().lock().unwrap(),
    );
    assert_eq!(wa.len(), wb.len());
    for (name, va) in wa.iter() {
        let d = max_diff(va.as_tensor(), wb[name].as_tensor());
        assert_eq!(d, 0.0, "{name}");
    }
}

/// A Qwen3-MoE GGUF whose stacked experts disagree with its `expert_count` is refused naming
/// the tensor and the shape it should have; one without the expert keys names the key.
#[test]
fn a_qwen3moe_gguf_with_inconsistent_experts_is_refused_by_name() {
    use candle_core::quantized::GgmlDType;
    let args = ModelArgs::tiny(Arch::Qwen3Moe, 259);
    let (vm, _m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
    let dir = tempfile::tempdir().unwrap();
    let mut fewer = args.clone();
    fewer.moe.as_mut().unwrap().num_experts = 4;
    let path = dir.path().join("fewer.gguf");
    write_gguf(&vm, &fewer, &path, GgmlDType::F32);
    let e = gguf::load(&path, DType::F32, &Device::Cpu, true)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("fewer.gguf") && e.contains("ffn_") && e.contains("_exps.weight"),
        "{e}"
    );
    assert!(e.contains("[4, out, in]"), "{e}");
    let mut none = args.clone();
    none.moe = None;
    none.arch = Arch::Qwen3Moe;
    let path = dir.path().join("no_keys.gguf");
    write_gguf(&vm, &none, &path, GgmlDType::F32);
    let e = gguf::load(&path, DType::F32, &Device::Cpu, true)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("qwen3moe.expert_count"), "{e}");
}

/// The pre-tokenizers of Qwen GGUF files (`tokenizer.ggml.pre` = `qwen2`, `qwen35`) cut text
/// where their tokenizer.json patterns say (pieces derived by hand from the patterns): a
/// contraction of either case alone, digits one by one, a word with the one non-letter before
/// it, punctuation with the newlines after it, a run of spaces leaving its last space to the
/// next word; `qwen35` keeps combining marks inside their word, `qwen2` cuts them off.
#[test]
fn qwen_gguf_pre_tokenizers_cut_text_as_their_patterns() {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let pieces = |pre: &str, text: &str| -> Vec<String> {
        let p = gguf::pre_tokenizer(pre, std::path::Path::new("m.gguf")).unwrap();
        let mut s = PreTokenizedString::from(text);
        p.pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, (a, b), _)| text[a..b].to_string())
            .collect()
    };
    for pre in ["qwen2", "qwen35"] {
        assert_eq!(
            pieces(pre, "He's 12 apples,\n\n  ok"),
            ["He", "'s", " ", "1", "2", " apples", ",\n\n", " ", " ok"],
            "{pre}"
        );
        assert_eq!(pieces(pre, "HE'S"), ["HE", "'S"], "{pre}");
    }
    assert_eq!(pieces("qwen2", "Cafe\u{301} x"), ["Cafe", "\u{301}", " x"]);
    assert_eq!(pieces("qwen35", "Cafe\u{301} x"), ["Cafe\u{301}", " x"]);
    let e = gguf::pre_tokenizer("llama-bpe", std::path::Path::new("m.gguf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("llama-bpe") && e.contains("m.gguf"), "{e}");
}
