//! A LoRA checkpoint given where a model is read is named as one, and `merge` folds its
//! adapters into the base (tiny models built here).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::VarMap;

use crate::config::fields::OneOrMany;
use crate::model::{Arch, ModelArgs};
use crate::weights::{hf, merge, peft};

/// A tiny Qwen2 base model folder (`root/base`, q/k/v biases, untied head) and a LoRA
/// checkpoint made from it as training writes one (`root/ckpt/global_step_1/actor`:
/// `huggingface/` with config and tokenizer but no weights, `lora_adapter/` with rank-4
/// adapters on every projection whose B is non-zero). Returns (base, actor folder).
pub(crate) fn lora_checkpoint(root: &Path) -> (PathBuf, PathBuf) {
    lora_checkpoint_of(root, Arch::Qwen2)
}

/// [`lora_checkpoint`] of `ModelArgs::tiny(arch)`.
fn lora_checkpoint_of(root: &Path, arch: Arch) -> (PathBuf, PathBuf) {
    let args = ModelArgs::tiny(arch, 259);
    let base = root.join("base");
    let (vm, mut m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
    crate::testing::write_tokenizer_dir(&base).unwrap();
    hf::save_dir(&vm, &args, &base, &[258], Some(&base), None).unwrap();
    let spec = peft::LoraSpec {
        rank: 4,
        alpha: 8.0,
        use_rslora: false,
        target_modules: OneOrMany::One(peft::ALL_LINEAR.into()),
        exclude_modules: None,
        dropout: 0.0,
    };
    let ad = VarMap::new();
    let adapted = peft::attach(&mut m, &spec, &ad, 3, "test").unwrap();
    peft::tests::randomize_b(&ad, 0.3);
    let actor = root.join("ckpt/global_step_1/actor");
    let hf_dir = actor.join("huggingface");
    hf::save_dir(&VarMap::new(), &args, &hf_dir, &[258], Some(&base), None).unwrap();
    std::fs::remove_file(hf_dir.join("model.safetensors")).unwrap();
    let cfg = peft::adapter_config(
        &spec,
        &adapted,
        &base.display().to_string(),
        "CAUSAL_LM",
        None,
    );
    peft::save_adapter(
        &actor.join("lora_adapter"),
        &cfg,
        &peft::adapter_tensors(&ad),
    )
    .unwrap();
    (base, actor)
}

/// A LoRA checkpoint's `actor/huggingface/` (what a full checkpoint's would be), its
/// `actor/lora_adapter/` and the `actor/` folder itself, given as a model path, are refused as
/// LoRA adapter folders naming the base model, the adapter folder, the two keys to set and
/// `main_ppo merge`; never a panic. (Before: "no model.safetensors or
/// model.safetensors.index.json" for `huggingface/` and "no config.json" for the others,
/// nothing about LoRA.)
#[test]
fn a_lora_checkpoint_given_as_a_model_is_named_with_what_to_pass() {
    let root = tempfile::tempdir().unwrap();
    let (base, actor) = lora_checkpoint(root.path());
    let adapter = actor.join("lora_adapter");
    for given in [actor.join("huggingface"), adapter.clone(), actor.clone()] {
        let e = crate::weights::load_model_and_tokenizer(
            &given.display().to_string(),
            None,
            &Default::default(),
            DType::F32,
            &Device::Cpu,
            true,
        )
        .err()
        .expect("refused")
        .to_string();
        for want in [
            "LoRA adapter".to_string(),
            base.display().to_string(),
            adapter.display().to_string(),
            "model.path=".into(),
            "model.lora_adapter_path=".into(),
            "main_ppo merge".into(),
        ] {
            assert!(
                e.contains(&want),
                "{}: `{want}` missing from: {e}",
                given.display()
            );
        }
    }
}

/// The logits of `model` on two rows of byte tokens (one left-padded), flattened.
pub(crate) fn logits(model: &crate::model::CausalLm) -> Vec<f32> {
    use candle_core::Tensor;
    let dev = Device::Cpu;
    let ids = Tensor::new(
        &[[72u32, 101, 108, 108, 111, 33], [0, 0, 50, 43, 50, 61]],
        &dev,
    )
    .unwrap();
    let pos = Tensor::new(&[[0u32, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]], &dev).unwrap();
    let mask = Tensor::new(&[[1u32; 6], [0, 0, 1, 1, 1, 1]], &dev).unwrap();
    let h = model.forward_hidden(&ids, &pos, &mask, None).unwrap();
    let l = model.logits(&h).unwrap();
    // Padded positions carry no meaning: compare the real ones only.
    let rows: Vec<Vec<Vec<f32>>> = l.to_dtype(DType::F32).unwrap().to_vec3().unwrap();
    rows[0]
        .iter()
        .chain(&rows[1][2..])
        .flatten()
        .copied()
        .collect()
}

/// The model loaded from `path` (f32, as `generate` loads it).
pub(crate) fn load(path: &Path) -> crate::model::CausalLm {
    crate::weights::load_model_and_tokenizer(
        &path.display().to_string(),
        None,
        &Default::default(),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    .0
    .model
}

/// The base model at `base` with the adapter folder `adapter` on it, attached as `generate`
/// attaches one.
pub(crate) fn with_adapter(base: &Path, adapter: &Path) -> crate::model::CausalLm {
    let mut m = load(base);
    let file = peft::read_adapter(adapter).unwrap();
    let ad = VarMap::new();
    peft::attach(&mut m, &file.spec, &ad, 0, "test").unwrap();
    peft::assign_adapter(&ad, &file.tensors, adapter).unwrap();
    m
}

pub(crate) fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every spelling of a LoRA checkpoint resolves to the same base + adapter, with the
/// checkpoint's `huggingface/` for config and tokenizer; merged and saved, the folder loads as
/// a model whose logits are base + adapter's (f32, 1e-5) and differ from the base's.
#[test]
fn a_merged_lora_checkpoint_gives_base_plus_adapter_logits() {
    let root = tempfile::tempdir().unwrap();
    let (base, actor) = lora_checkpoint(root.path());
    let adapter = actor.join("lora_adapter");
    let want = merge::Source::Lora {
        adapter: adapter.clone(),
        base: base.display().to_string(),
        base_from: format!(
            "base_model_name_or_path of {}",
            adapter.join("adapter_config.json").display()
        ),
        checkpoint: Some(actor.join("huggingface")),
        critic: false,
    };
    let step = actor.parent().unwrap().to_path_buf();
    for given in [
        step,
        actor.clone(),
        actor.join("huggingface"),
        adapter.clone(),
    ] {
        let got = merge::resolve(&given, None).unwrap();
        assert_eq!(got, want, "{}", given.display());
    }
    let merged = merge::merge(&want).unwrap();
    assert_eq!(merged.projections, 2 * 7);
    let out = root.path().join("merged");
    merge::save(&merged, &out).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    let adapted = logits(&with_adapter(&base, &adapter));
    let d = max_diff(&logits(&load(&out)), &adapted);
    assert!(d <= 1e-5, "merged vs base + adapter: {d}");
    assert!(
        max_diff(&logits(&load(&base)), &adapted) > 1e-2,
        "the adapters matter"
    );
}

/// A DeepSeek-V3 LoRA checkpoint (adapters on the latent attention's five projections, the
/// dense MLP, every expert and the shared experts) merged and saved loads as base + adapter
/// (f32, 1e-5), and the merged folder keeps the base's score-correction bias bit for bit.
#[test]
fn a_merged_deepseek_v3_lora_checkpoint_keeps_its_correction_bias() {
    let root = tempfile::tempdir().unwrap();
    let (base, actor) = lora_checkpoint_of(root.path(), Arch::DeepseekV3);
    let adapter = actor.join("lora_adapter");
    let source = merge::resolve(&actor, None).unwrap();
    let merged = merge::merge(&source).unwrap();
    let args = ModelArgs::tiny(Arch::DeepseekV3, 259);
    assert_eq!(merged.projections, peft::projections_of(&args).count());
    let out = root.path().join("merged");
    merge::save(&merged, &out).unwrap();
    let adapted = logits(&with_adapter(&base, &adapter));
    let d = max_diff(&logits(&load(&out)), &adapted);
    assert!(d <= 1e-5, "merged vs base + adapter: {d}");
    assert!(max_diff(&logits(&load(&base)), &adapted) > 1e-2);
    let read = |dir: &Path| {
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
    };
    let (b, m) = (read(&base), read(&out));
    let bias = "model.layers.1.mlp.gate.e_score_correction_bias";
    let v = |t: &candle_core::Tensor| t.to_vec1::<f32>().unwrap();
    assert!(v(&b[bias]).iter().any(|&x| x != 0.0), "a random bias");
    assert_eq!(v(&b[bias]), v(&m[bias]));
    assert_eq!(b.len(), m.len());
}
