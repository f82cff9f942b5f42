//! Parity with transformers and PyTorch autograd, family by family, on tiny random checkpoints
//! that transformers itself wrote (`tests/fixtures/families/<name>/`, made by
//! `scripts/family_reference.py` with transformers 5.24 / torch 2.15, float64 weights).
//!
//! For each checkpoint: greedy continuations (tokens and log-probs) through the rollout engine,
//! and the training forward's token log-probs and every parameter's gradient of
//! `L = Σ_i Σ_t c_it · log p(s_i,t+1 | s_i,≤t)`, padded and packed, through the hand-written
//! layer (with and without recomputation) and the op composition.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use crate::model::{CausalLm, Exec};
use crate::rollout::{generate_all, Limits, Sampler, SamplingParams};

fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(name)
}

fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(dir(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

pub(crate) fn ids(v: &Value) -> Vec<Vec<u32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

pub(crate) fn floats(v: &Value) -> Vec<Vec<f64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

fn load(name: &str, dtype: DType) -> crate::weights::hf::Loaded {
    crate::weights::hf::load_dir(&dir(name), &Default::default(), dtype, &Device::Cpu, true)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The fixture `name`'s config.json.
fn config_of(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir(name).join("config.json")).unwrap()).unwrap()
}

/// A closure asserting that `cfg` with an edit applied is refused by `ModelArgs::from_hf`, the
/// error naming the key given.
fn refusal_of(cfg: &Value) -> impl Fn(&dyn Fn(&mut Value), &str) + '_ {
    move |edit, key| {
        let mut c = cfg.clone();
        edit(&mut c);
        let e = crate::model::ModelArgs::from_hf(&c).unwrap_err();
        assert!(e.contains(key), "{key}: {e}");
    }
}

/// The error of loading fixture `name` (f64) with its config.json replaced by `cfg` and, when
/// given, its weights by `tensors`: a folder written under `under`.
fn load_error(
    name: &str,
    under: &Path,
    cfg: &Value,
    tensors: Option<&std::collections::HashMap<String, Tensor>>,
) -> String {
    let to = under.join(format!("{name}-broken"));
    std::fs::create_dir_all(&to).unwrap();
    std::fs::copy(
        dir(name).join("generation_config.json"),
        to.join("generation_config.json"),
    )
    .unwrap();
    match tensors {
        Some(t) => candle_core::safetensors::save(t, to.join("model.safetensors")).unwrap(),
        None => drop(
            std::fs::copy(
                dir(name).join("model.safetensors"),
                to.join("model.safetensors"),
            )
            .unwrap(),
        ),
    }
    std::fs::write(to.join("config.json"), cfg.to_string()).unwrap();
    crate::weights::hf::load_dir(&to, &Default::default(), DType::F64, &Device::Cpu, true)
        .err()
        .unwrap()
        .to_string()
}

/// Greedy continuations as transformers' full-forward argmax gives them: the same tokens and
/// log-probs within `tol` (absolute). A step whose top-2 logit gap is below `gap` may pick the
/// other token; the row is compared up to there.
fn greedy_matches(name: &str, dtype: DType, tol: f64, gap: f64) {
    let r = reference(name);
    let loaded = load(name, dtype);
    let prompts = ids(&r["prompts"]);
    let steps = r["greedy"].as_array().unwrap();
    let n = steps[0].as_array().unwrap().len();
    let p = SamplingParams {
        greedy: true,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: n,
        eos_ids: vec![],
        ignore_eos: true,
        limits: Limits::default(),
    };
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let out = generate_all(
        &loaded.model.no_grad(),
        &refs,
        &p,
        &mut Sampler::new(0),
        None,
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut worst = 0f64;
    for (i, want) in steps.iter().enumerate() {
        for (t, w) in want.as_array().unwrap().iter().enumerate() {
            let tok = w["token"].as_u64().unwrap() as u32;
            let lp = w["logprob"].as_f64().unwrap();
            worst = worst.max((f64::from(out.log_probs[i][t]) - lp).abs());
            assert!(
                (f64::from(out.log_probs[i][t]) - lp).abs() <= tol,
                "{name} {dtype:?} row {i} step {t}: log-prob {} vs transformers {lp}",
                out.log_probs[i][t]
            );
            if out.responses[i][t] != tok {
                assert!(
                    w["gap"].as_f64().unwrap() <= gap,
                    "{name} {dtype:?} row {i} step {t}: token {} vs transformers {tok}",
                    out.responses[i][t]
                );
                break;
            }
        }
    }
    eprintln!("{name} {dtype:?}: greedy log-probs within {worst:.1e} of transformers'");
}

/// The token log-probs of the reference's training sequences `[rows][len − 1]` and the loss,
/// padded (left, as the trainer pads prompts) or packed end to end.
fn loss_and_logprobs(m: &CausalLm, r: &Value, packed: bool) -> (Tensor, Vec<Vec<f64>>) {
    let seqs = ids(&r["sequences"]);
    let weights = floats(&r["loss_weights"]);
    let dev = &Device::Cpu;
    let (lp, spans): (Tensor, Vec<(usize, usize)>) = if packed {
        let (mut toks, mut pos, mut tgt, mut segs) = (vec![], vec![], vec![], vec![]);
        for s in &seqs {
            segs.push((toks.len(), s.len() - 1));
            toks.extend_from_slice(&s[..s.len() - 1]);
            pos.extend(0..s.len() as u32 - 1);
            tgt.extend_from_slice(&s[1..]);
        }
        let n = toks.len();
        let h = m
            .forward_hidden_packed(
                &Tensor::from_vec(toks, n, dev).unwrap(),
                &Tensor::from_vec(pos, n, dev).unwrap(),
                &segs,
            )
            .unwrap()
            .unsqueeze(0)
            .unwrap(); // [1, n, h]
        let tgt = Tensor::from_vec(tgt, (1, n), dev).unwrap();
        let (lp, _) = m.token_logprobs(&h, &tgt, 7, false).unwrap();
        (lp.squeeze(0).unwrap(), segs)
    } else {
        let w = seqs.iter().map(Vec::len).max().unwrap() - 1;
        let (mut toks, mut mask, mut pos, mut tgt) = (vec![], vec![], vec![], vec![]);
        for s in &seqs {
            let lead = w - (s.len() - 1);
            for k in 0..w {
                let real = k >= lead;
                toks.push(if real { s[k - lead] } else { 0 });
                mask.push(u32::from(real));
                pos.push(k.saturating_sub(lead) as u32);
                tgt.push(if real { s[k - lead + 1] } else { 0 });
            }
        }
        let b = seqs.len();
        let t = |v: Vec<u32>| Tensor::from_vec(v, (b, w), dev).unwrap();
        let h = m.forward_hidden(&t(toks), &t(pos), &t(mask), None).unwrap();
        let (lp, _) = m.token_logprobs(&h, &t(tgt), 5, false).unwrap();
        let lp = lp.flatten_all().unwrap();
        let spans = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| (i * w + w - (s.len() - 1), s.len() - 1))
            .collect();
        (lp, spans)
    };
    let mut c = vec![0f64; lp.dim(0).unwrap()];
    for ((a, l), wr) in spans.iter().zip(&weights) {
        c[*a..a + l].copy_from_slice(wr);
    }
    let c = Tensor::from_vec(c, lp.dim(0).unwrap(), dev)
        .unwrap()
        .to_dtype(lp.dtype())
        .unwrap();
    let loss = (&lp * c).unwrap().sum_all().unwrap();
    let all: Vec<f64> = lp.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
    let rows = spans.iter().map(|&(a, l)| all[a..a + l].to_vec()).collect();
    (loss, rows)
}

/// The execution paths every family's training is checked on: the hand-written layer keeping
/// its activations, the same recomputed in backward, and the op composition.
pub(crate) const EXEC_PATHS: [Exec; 3] = [
    Exec {
        recompute: false,
        composed: false,
        bf16: false,
        dense_experts: false,
    },
    Exec {
        recompute: true,
        composed: false,
        bf16: false,
        dense_experts: false,
    },
    Exec {
        recompute: false,
        composed: true,
        bf16: false,
        dense_experts: false,
    },
];

/// Log-probs, loss and every parameter's gradient equal PyTorch's: values within `tol`
/// relative (absolute below 1), each gradient within `rel` of its tensor's largest entry, for every execution
/// path and layout.
fn training_matches(name: &str, dtype: DType, tol: f64, rel: f64) {
    let r = reference(name);
    let want_lp = floats(&r["token_logprobs"]);
    let grads =
        candle_core::safetensors::load(dir(name).join("grads.safetensors"), &Device::Cpu).unwrap();
    let mut loaded = load(name, dtype);
    let (mut worst_lp, mut worst_grad) = (0f64, 0f64);
    for e in EXEC_PATHS {
        for packed in [false, true] {
            loaded.model.set_exec(e);
            let case = format!("{name} {dtype:?} {e:?} packed {packed}");
            let (loss, lps) = loss_and_logprobs(&loaded.model, &r, packed);
            for (i, (got, want)) in lps.iter().zip(&want_lp).enumerate() {
                for (t, (g, w)) in got.iter().zip(want).enumerate() {
                    worst_lp = worst_lp.max((g - w).abs());
                    let ok = (g - w).abs() <= tol * w.abs().max(1.0);
                    assert!(ok, "{case}: row {i} token {t}: {g} vs {w}");
                }
            }
            let l: f64 = loss.to_dtype(DType::F64).unwrap().to_scalar().unwrap();
            let wl = r["loss"].as_f64().unwrap();
            let ok = (l - wl).abs() <= tol * 10.0 * wl.abs().max(1.0);
            assert!(ok, "{case}: loss {l} vs {wl}");
            let g = loss.backward().unwrap();
            let vars = loaded.varmap.data().lock().unwrap();
            // GPT-OSS's experts: the gradients under the checkpoint's fused names.
            let fused = fused_expert_grads(&vars, &g, &loaded.model.args);
            for pname in r["parameters"].as_array().unwrap() {
                let pname = pname.as_str().unwrap();
                let want: Vec<f64> = grads[pname].flatten_all().unwrap().to_vec1().unwrap();
                // Tied embeddings: PyTorch reports the shared tensor once, as the embedding.
                let got = match fused.get(pname) {
                    Some(t) => Some(t),
                    None => vars
                        .get(pname)
                        .map(|v| g.get(v.as_tensor()))
                        .unwrap_or_else(|| panic!("{case}: no variable `{pname}`")),
                };
                let Some(got) = got else {
                    // An expert no token was routed to: PyTorch's fused expert tensors give it
                    // a gradient of zeros, candle none.
                    let zero = want.iter().all(|&w| w == 0.0);
                    assert!(zero, "{case}: `{pname}` got no gradient");
                    continue;
                };
                let got: Vec<f64> = got
                    .to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let (worst, scale) = crate::testing::worst_of(&got, &want);
                worst_grad = worst_grad.max(worst / scale);
                assert!(
                    worst <= rel * scale,
                    "{case}: ∂L/∂{pname} off by {worst:.3e} (largest entry {scale:.3e})"
                );
            }
            // MiMo's multi-token-prediction layers and DeepSeek-V3's score-correction biases:
            // variables no gradient reaches (PyTorch has none for them either).
            let kept = |n: &str| loaded.model.args.kept_as_read(n);
            for (pname, var) in vars.iter().filter(|(n, _)| kept(n)) {
                assert!(g.get(var.as_tensor()).is_none(), "{case}: ∂L/∂{pname}");
            }
            let per_expert = |n: &str| !fused.is_empty() && n.contains(".mlp.experts.");
            assert_eq!(
                vars.keys().filter(|n| !kept(n) && !per_expert(n)).count() + fused.len(),
                r["parameters"].as_array().unwrap().len(),
                "{case}: variables {:?}",
                vars.keys().collect::<Vec<_>>()
            );
        }
    }
    eprintln!("{name} {dtype:?}: log-probs within {worst_lp:.1e}, gradients within {worst_grad:.1e} of scale of PyTorch's");
}

/// GPT-OSS's expert gradients assembled into its checkpoint's fused tensors (an expert no
/// token reached contributes zeros, as PyTorch's fused parameters get); empty for other
/// families.
fn fused_expert_grads(
    vars: &std::collections::HashMap<String, candle_core::Var>,
    g: &candle_core::backprop::GradStore,
    args: &crate::model::ModelArgs,
) -> std::collections::BTreeMap<String, Tensor> {
    if !args.gpt_oss_experts() {
        return Default::default();
    }
    let mut named: std::collections::BTreeMap<String, Tensor> = vars
        .iter()
        .filter(|(n, _)| n.contains(".mlp.experts."))
        .map(|(n, v)| {
            let t = v.as_tensor();
            let grad = g.get(t).cloned().unwrap_or_else(|| t.zeros_like().unwrap());
            (n.clone(), grad)
        })
        .collect();
    crate::weights::hf::fuse_gpt_oss_experts(&mut named, args).unwrap();
    named
}

const FAMILIES: [&str; 26] = [
    "llama",
    "qwen2",
    "seed_oss",
    "mimo",
    "qwen3",
    "qwen3_tied_bias",
    "qwen3_window",
    "mistral_window",
    "gemma3",
    "gemma2",
    "gemma2_nocap",
    "qwen3_moe",
    "qwen3_moe_step2",
    "qwen2_moe",
    "qwen2_moe_window",
    "qwen3_5",
    "qwen3_5_tied",
    "qwen3_5_moe",
    "qwen3_next",
    "deepseek_v3",
    "deepseek_v3_qnull",
    "glm4_moe",
    "glm4_moe_plain",
    "gpt_oss",
    "gpt_oss_plain",
    "gpt_oss_mxfp4",
];

/// f64: transformers' greedy tokens and log-probs within 1e-6.
#[test]
fn greedy_generation_equals_transformers_in_f64() {
    for name in FAMILIES {
        greedy_matches(name, DType::F64, 1e-6, 0.0);
    }
}

/// f32: log-probs within 1e-4; a token may differ only where transformers' top-2 gap is
/// within f32 rounding (1e-4).
#[test]
fn greedy_generation_equals_transformers_in_f32() {
    for name in FAMILIES {
        greedy_matches(name, DType::F32, 1e-4, 1e-4);
    }
}

/// f64: log-probs within 1e-8 relative, every gradient within 1e-8 of its tensor's scale
/// (PyTorch autograd), on every execution path, padded and packed.
#[test]
fn training_forward_and_gradients_equal_pytorch_in_f64() {
    for name in FAMILIES {
        training_matches(name, DType::F64, 1e-8, 1e-8);
    }
}

/// f32: log-probs within 1e-4 and gradients within 1e-4 of scale; the Gated DeltaNet hybrids'
/// within 1e-3 of scale: their tiny checkpoints are ill-conditioned in f32 (PyTorch's own f32
/// gradients are 3.0e-4 of scale off its f64 ones on `qwen3_5`, measured with the fixture's
/// loss; ours 4.3e-4).
#[test]
fn training_forward_and_gradients_equal_pytorch_in_f32() {
    for name in FAMILIES {
        let rel = match name.starts_with("qwen3_5") || name.starts_with("qwen3_next") {
            true => 1e-3,
            false => 1e-4,
        };
        training_matches(name, DType::F32, 1e-4, rel);
    }
}

/// The tensor names and values of the safetensors weights of HF folder `dir` (one file).
pub(crate) fn file_tensors(dir: &Path) -> std::collections::BTreeMap<String, Vec<f64>> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            let v = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
            (n, v.to_vec1().unwrap())
        })
        .collect()
}

/// Seed-OSS and MiMo saved back as HF folders (as checkpoints and the HF export write them)
/// hold every tensor transformers wrote, names and values bit for bit, MiMo's
/// multi-token-prediction layers (`model.mtp_layers.{0,1}.*`, 32 tensors) included; their
/// config names the family (MiMoForCausalLM with `num_nextn_predict_layers`, Seed-OSS with
/// its two bias keys) and reads back as the same arguments, and the folder loads again as the
/// same variables.
#[test]
fn seed_oss_and_mimo_save_back_every_tensor() {
    for (name, arch, mtp) in [
        ("seed_oss", "SeedOssForCausalLM", 0),
        ("mimo", "MiMoForCausalLM", 32),
    ] {
        let is_mtp = |n: &str| n.starts_with(crate::model::config::MTP_PREFIX);
        assert_saves_back(name, arch, is_mtp, mtp);
    }
}

/// Fixture `name` loaded in f64 and saved as an HF folder: the same tensor names and values,
/// bit for bit, `kept` of them matching `is_kept` (tensors read and written back untrained); the
/// config names `arch` and reads back as the same arguments; the folder loads again as the same
/// variables. Returns the arguments read back.
fn assert_saves_back(
    name: &str,
    arch: &str,
    is_kept: impl Fn(&str) -> bool,
    kept: usize,
) -> crate::model::ModelArgs {
    let loaded = load(name, DType::F64);
    let tmp = tempfile::tempdir().unwrap();
    crate::weights::hf::save_dir(
        &loaded.varmap,
        &loaded.model.args,
        tmp.path(),
        &[],
        None,
        None,
    )
    .unwrap();
    let (want, got) = (file_tensors(&dir(name)), file_tensors(tmp.path()));
    assert_eq!(
        want.keys().collect::<Vec<_>>(),
        got.keys().collect::<Vec<_>>(),
        "{name}"
    );
    assert!(want == got, "{name}: a saved value differs");
    assert_eq!(got.keys().filter(|n| is_kept(n)).count(), kept, "{name}");
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["architectures"][0], arch, "{name}");
    let args = crate::model::ModelArgs::from_hf(&cfg).unwrap();
    assert_eq!(args, loaded.model.args, "{name}");
    let again = crate::weights::hf::load_dir(
        tmp.path(),
        &Default::default(),
        DType::F64,
        &Device::Cpu,
        true,
    )
    .unwrap();
    assert_same_variables(&loaded.varmap, &again.varmap, name);
    args
}

/// A MiMo folder as the hub publishes it (`auto_map` naming its own `configuration_mimo.py`
/// and `modeling_mimo.py`, for transformers' `trust_remote_code`) is saved back with the same
/// `auto_map` and those files' text, so the saved folder loads in transformers as the original
/// does; an entry naming another repository (`org/repo--module.Class`) is written back as it
/// is, with no file.
#[test]
fn a_mimo_folder_keeps_its_remote_code_when_saved() {
    let src = tempfile::tempdir().unwrap();
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir("mimo").join("config.json")).unwrap())
            .unwrap();
    cfg["auto_map"] = serde_json::json!({
        "AutoConfig": "configuration_mimo.MiMoConfig",
        "AutoModel": "modeling_mimo.MiMoModel",
        "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM",
        "AutoTokenizer": ["XiaomiMiMo/MiMo-7B-RL--tokenization.Tok", null],
    });
    std::fs::write(src.path().join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        dir("mimo").join("model.safetensors"),
        src.path().join("model.safetensors"),
    )
    .unwrap();
    let code = [
        ("configuration_mimo.py", "class MiMoConfig: pass\n"),
        ("modeling_mimo.py", "class MiMoForCausalLM: pass\n"),
    ];
    for (f, text) in code {
        std::fs::write(src.path().join(f), text).unwrap();
    }
    let loaded = crate::weights::hf::load_dir(
        src.path(),
        &Default::default(),
        DType::F64,
        &Device::Cpu,
        true,
    )
    .unwrap();
    let out = tempfile::tempdir().unwrap();
    crate::weights::hf::save_dir(
        &loaded.varmap,
        &loaded.model.args,
        out.path(),
        &[],
        None,
        None,
    )
    .unwrap();
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(saved["auto_map"], cfg["auto_map"]);
    for (f, text) in code {
        assert_eq!(
            std::fs::read_to_string(out.path().join(f)).unwrap(),
            text,
            "{f}"
        );
    }
    assert!(!out.path().join("tokenization.py").exists());
    assert_eq!(file_tensors(out.path()), file_tensors(&dir("mimo")));
}

/// MiMo's forward is Qwen2's: the same weights read as a `Qwen2ForCausalLM` (the
/// multi-token-prediction tensors left out) give bit-identical log-probs; read with MiMo's
/// tensors under Qwen2's name, the unread MTP layers are refused naming the first of them
/// rather than dropped from what would be saved.
#[test]
fn mimo_runs_as_qwen2_and_its_mtp_layers_are_never_dropped() {
    let mimo = load("mimo", DType::F64);
    assert_eq!(mimo.model.args.mtp_layers, 2);
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir("mimo").join("config.json")).unwrap())
            .unwrap();
    cfg["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    cfg["model_type"] = serde_json::json!("qwen2");
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        dir("mimo").join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    let read = |p: &Path| {
        crate::weights::hf::load_dir(p, &Default::default(), DType::F64, &Device::Cpu, true)
    };
    let e = read(tmp.path()).err().expect("refused").to_string();
    assert!(
        e.contains("model.mtp_layers.0.") && e.contains("32 layer tensor(s)"),
        "{e}"
    );
    let main: std::collections::HashMap<String, Tensor> =
        candle_core::safetensors::load(dir("mimo").join("model.safetensors"), &Device::Cpu)
            .unwrap()
            .into_iter()
            .filter(|(n, _)| !n.starts_with(crate::model::config::MTP_PREFIX))
            .collect();
    candle_core::safetensors::save(&main, tmp.path().join("model.safetensors")).unwrap();
    let qwen2 = read(tmp.path()).unwrap();
    let r = reference("mimo");
    for packed in [false, true] {
        let (_, a) = loss_and_logprobs(&mimo.model, &r, packed);
        let (_, b) = loss_and_logprobs(&qwen2.model, &r, packed);
        assert!(a == b, "packed {packed}");
    }
}

/// MiMo's multi-token-prediction layers are not among the variables the trainer's optimizer
/// updates (verl's MTP loss is not implemented here, and no other loss reaches them): after an
/// AdamW step with weight decay on the training loss every other variable moved and each MTP
/// tensor is bit for bit as read.
#[test]
fn mimo_mtp_layers_are_left_out_of_the_update() {
    let loaded = load("mimo", DType::F64);
    let mtp = crate::model::config::MTP_PREFIX;
    let vars =
        crate::trainer::trainable::trainable_variables(&loaded.varmap, None, &loaded.model.args);
    let all = loaded.varmap.data().lock().unwrap().len();
    assert!(vars.keys().all(|n| !n.starts_with(mtp)));
    assert_eq!(vars.len(), all - 32);
    let before = file_tensors(&dir("mimo"));
    let opt = crate::config::OptimConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut adamw = crate::trainer::optim::AdamW::new(vars, &opt).unwrap();
    let (loss, _) = loss_and_logprobs(&loaded.model, &reference("mimo"), false);
    adamw.step(&loss.backward().unwrap(), opt.lr).unwrap();
    for (name, var) in loaded.varmap.data().lock().unwrap().iter() {
        let now: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(now == before[name], name.starts_with(mtp), "{name}");
    }
}

/// Seed-OSS's dropouts (0.1 each in its config, transformers' SeedOssConfig defaults) are read; a run
/// that would train such a model is refused naming the actor's path, the config key and the
/// `override_config` that turns it off, one key after the other; with both at 0 it is
/// accepted. Inference reads the same config without complaint (the parity tests above).
#[test]
fn seed_oss_dropout_is_refused_for_training_by_key() {
    let check = |overrides: serde_json::Value| {
        let args =
            crate::weights::hf::read_config(&dir("seed_oss"), overrides.as_object().unwrap())
                .unwrap();
        crate::trainer::preflight::train_dropout("actor_rollout_ref.model", "seed_oss", &args)
            .map_err(|e| e.to_string())
    };
    let e = check(serde_json::json!({})).unwrap_err();
    assert!(
        e.contains("actor_rollout_ref.model.path")
            && e.contains("attention_dropout 0.1")
            && e.contains("actor_rollout_ref.model.override_config.attention_dropout=0.0"),
        "{e}"
    );
    let e = check(serde_json::json!({"attention_dropout": 0.0})).unwrap_err();
    assert!(e.contains("residual_dropout 0.1"), "{e}");
    check(serde_json::json!({"attention_dropout": 0.0, "residual_dropout": 0.0})).unwrap();
}

/// Seed-OSS's biases as transformers' `SeedOssConfig` defaults them: q/k/v biases unless
/// `attention_bias` is false, an o_proj bias only with `attention_out_bias`, each on its own
/// (Llama's `attention_bias` sets both); a bias key that is not a flag is refused by name.
#[test]
fn seed_oss_bias_keys_are_read_on_their_own() {
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(dir("seed_oss").join("config.json")).unwrap(),
    )
    .unwrap();
    let read = |edit: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        let mut c = cfg.clone();
        edit(c.as_object_mut().unwrap());
        crate::model::ModelArgs::from_hf(&c).map(|a| (a.qkv_bias, a.o_bias))
    };
    assert_eq!(read(&|_| {}), Ok((true, true)));
    let defaults = read(&|c| {
        c.remove("attention_bias");
        c.remove("attention_out_bias");
    });
    assert_eq!(defaults, Ok((true, false)));
    assert_eq!(
        read(&|c| {
            c.insert("attention_bias".into(), false.into());
        }),
        Ok((false, true))
    );
    let e = read(&|c| {
        c.insert("attention_out_bias".into(), "yes".into());
    })
    .unwrap_err();
    assert!(e.contains("attention_out_bias"), "{e}");
}

/// A Qwen3 checkpoint read under another layout leaves its q/k norms unread: refused, naming
/// the tensor, instead of running without them.
#[test]
fn unread_layer_tensors_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(dir("qwen3").join(f), tmp.path().join(f)).unwrap();
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
            .unwrap();
    cfg["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    cfg["model_type"] = serde_json::json!("llama");
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let e = crate::weights::hf::load_dir(
        tmp.path(),
        &Default::default(),
        DType::F64,
        &Device::Cpu,
        true,
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        e.contains("self_attn.k_norm.weight") && e.contains("Llama"),
        "{e}"
    );
}

/// An architecture outside the supported list is refused before any weight is read, naming it
/// and listing what is supported.
#[test]
fn an_unsupported_architecture_is_refused_by_name() {
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir("qwen3").join("config.json")).unwrap())
            .unwrap();
    cfg["architectures"] = serde_json::json!(["FalconForCausalLM"]);
    let e = crate::model::ModelArgs::from_hf(&cfg).unwrap_err();
    assert!(
        e.contains("`FalconForCausalLM` is not supported") && e.contains("Qwen3ForCausalLM"),
        "{e}"
    );
    cfg.as_object_mut().unwrap().remove("architectures");
    cfg["model_type"] = serde_json::json!("falcon");
    let e = crate::model::ModelArgs::from_hf(&cfg).unwrap_err();
    assert!(
        e.contains("\"falcon\"") && e.contains("LlamaForCausalLM"),
        "{e}"
    );
}

/// A Gemma 3 config written back is one transformers' strict config class reads: an integer
/// `query_pre_attn_scalar` (transformers 5.24 refused 256.0 in a checkpoint of ours, checked by
/// hand: with the integer it loads the exported 270M model and reproduces its greedy tokens),
/// and it reads back as the same arguments.
#[test]
fn a_saved_gemma3_config_reads_back_and_keeps_integers() {
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir("gemma3").join("config.json")).unwrap())
            .unwrap();
    let args = crate::model::ModelArgs::from_hf(&cfg).unwrap();
    let out = args.to_hf();
    assert!(out["query_pre_attn_scalar"].is_u64(), "{out}");
    assert_eq!(out["query_pre_attn_scalar"], cfg["query_pre_attn_scalar"]);
    assert_eq!(out["layer_types"], cfg["layer_types"]);
    assert_eq!(crate::model::ModelArgs::from_hf(&out).unwrap(), args);
}

/// Qwen3-MoE experts as transformers 5 holds them (`mlp.experts.gate_up_proj`
/// `[experts, 2·inter, hidden]`, `mlp.experts.down_proj`, written by its
/// `save_pretrained(save_original_format=False)`) load as the same variables, bit for bit, as
/// the hub's per-expert tensors transformers writes by default.
#[test]
fn fused_and_per_expert_layouts_load_alike() {
    for (name, probe) in [
        ("qwen3_moe", "model.layers.2.mlp.experts.7.up_proj.weight"),
        ("qwen2_moe", "model.layers.2.mlp.experts.7.up_proj.weight"),
        ("qwen3_5_moe", "model.layers.3.mlp.experts.7.up_proj.weight"),
        (
            "qwen3_next",
            "model.layers.2.mlp.experts.3.down_proj.weight",
        ),
        ("deepseek_v3", "model.layers.2.mlp.experts.7.up_proj.weight"),
        ("glm4_moe", "model.layers.2.mlp.experts.7.up_proj.weight"),
    ] {
        let per_expert = load(name, DType::F64);
        let fused = crate::weights::hf::load_dir(
            &dir(name).join("fused"),
            &Default::default(),
            DType::F64,
            &Device::Cpu,
            true,
        )
        .unwrap();
        assert!(per_expert.varmap.data().lock().unwrap().contains_key(probe));
        assert_same_variables(&per_expert.varmap, &fused.varmap, name);
    }
}

/// `a` and `b` hold the same variable names with bit-identical f64 values.
fn assert_same_variables(a: &candle_nn::VarMap, b: &candle_nn::VarMap, what: &str) {
    let (a, b) = (a.data().lock().unwrap(), b.data().lock().unwrap());
    assert_eq!(a.len(), b.len(), "{what}");
    for (name, v) in a.iter() {
        let w = b.get(name).unwrap_or_else(|| panic!("{what}: no `{name}`"));
        let (x, y): (Vec<f64>, Vec<f64>) = (
            v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            w.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert_eq!(x, y, "{what}: {name}");
    }
}

/// `output_router_logits: true` asks for the router's load-balancing loss: read with its
/// coefficient (transformers' 0.001 where `router_aux_loss_coef` is absent), written back, and
/// a value that is not a flag or a non-negative number refused naming the key.
#[test]
fn a_router_loss_request_is_read_and_checked() {
    let mut cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(dir("qwen3_moe").join("config.json")).unwrap(),
    )
    .unwrap();
    let args = crate::model::ModelArgs::from_hf(&cfg).unwrap();
    let moe = args.moe.as_ref().expect("experts");
    assert_eq!((moe.num_experts, moe.num_experts_per_tok), (8, 2));
    assert_eq!(moe.mlp_only_layers, vec![1]);
    assert_eq!(
        moe.router_aux_loss_coef, None,
        "output_router_logits is false"
    );
    assert_eq!(
        crate::model::ModelArgs::from_hf(&args.to_hf()).unwrap(),
        args
    );
    cfg["output_router_logits"] = serde_json::json!(true);
    cfg["router_aux_loss_coef"] = serde_json::json!(0.02);
    let on = crate::model::ModelArgs::from_hf(&cfg).unwrap();
    assert_eq!(on.moe.as_ref().unwrap().router_aux_loss_coef, Some(0.02));
    let back = on.to_hf();
    assert_eq!(back["output_router_logits"], serde_json::json!(true));
    assert_eq!(crate::model::ModelArgs::from_hf(&back).unwrap(), on);
    cfg.as_object_mut().unwrap().remove("router_aux_loss_coef");
    let default = crate::model::ModelArgs::from_hf(&cfg).unwrap();
    assert_eq!(default.moe.unwrap().router_aux_loss_coef, Some(0.001));
    for (key, bad) in [
        ("router_aux_loss_coef", serde_json::json!(-0.5)),
        ("router_aux_loss_coef", serde_json::json!("0.1")),
        ("output_router_logits", serde_json::json!("yes")),
    ] {
        let mut c = cfg.clone();
        c[key] = bad.clone();
        let e = crate::model::ModelArgs::from_hf(&c).unwrap_err();
        assert!(e.contains(key), "{key} = {bad}: {e}");
    }
}

/// The router's load-balancing loss of the training sequences (each a whole sequence; padded
/// left in one batch, or packed end to end) and its gradient, with the model asking for it.
fn router_aux(m: &CausalLm, seqs: &[Vec<u32>], packed: bool) -> Tensor {
    let dev = &Device::Cpu;
    if packed {
        let (mut toks, mut pos, mut segs) = (vec![], vec![], vec![]);
        for s in seqs {
            segs.push((toks.len(), s.len()));
            toks.extend_from_slice(s);
            pos.extend(0..s.len() as u32);
        }
        let n = toks.len();
        let t = |v: Vec<u32>| Tensor::from_vec(v, n, dev).unwrap();
        m.forward_hidden_packed(&t(toks), &t(pos), &segs).unwrap();
    } else {
        let w = seqs.iter().map(Vec::len).max().unwrap();
        let (mut toks, mut mask, mut pos) = (vec![], vec![], vec![]);
        for s in seqs {
            let lead = w - s.len();
            for k in 0..w {
                toks.push(if k >= lead { s[k - lead] } else { 0 });
                mask.push(u32::from(k >= lead));
                pos.push(k.saturating_sub(lead) as u32);
            }
        }
        let t = |v: Vec<u32>| Tensor::from_vec(v, (seqs.len(), w), dev).unwrap();
        m.forward_hidden(&t(toks), &t(pos), &t(mask), None).unwrap();
    }
    m.take_router_aux_loss()
        .unwrap()
        .expect("a training forward of a model asking for the router loss")
}

/// The router's load-balancing loss and every parameter's gradient of it equal transformers'
/// `load_balancing_loss_func` over the same tokens with PyTorch autograd
/// (`scripts/router_aux_reference.py`): the value within `tol` relative, each gradient within
/// `rel` of its tensor's largest entry, parameters it does not reach without a gradient (or a
/// zero one), on every execution path, padded (padding left out) and packed.
fn router_aux_matches(name: &str, dtype: DType, tol: f64, rel: f64) {
    let r = reference(name);
    let aux: Value =
        serde_json::from_str(&std::fs::read_to_string(dir(name).join("router_aux.json")).unwrap())
            .unwrap();
    let want_loss = aux["aux_loss"].as_f64().unwrap();
    let grads = candle_core::safetensors::load(
        dir(name).join("router_aux_grads.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let mut loaded = load(name, dtype);
    loaded.model.args.moe.as_mut().unwrap().router_aux_loss_coef = Some(0.001);
    let seqs = ids(&r["sequences"]);
    let dense = Exec {
        dense_experts: true,
        ..Exec::default()
    };
    for e in EXEC_PATHS.into_iter().chain([dense]) {
        for packed in [false, true] {
            loaded.model.set_exec(e);
            let case = format!("{name} {dtype:?} {e:?} packed {packed}");
            let loss = router_aux(&loaded.model, &seqs, packed);
            let l: f64 = loss.to_dtype(DType::F64).unwrap().to_scalar().unwrap();
            assert!(
                (l - want_loss).abs() <= tol * want_loss.abs(),
                "{case}: loss {l} vs {want_loss}"
            );
            let g = loss.backward().unwrap();
            let vars = loaded.varmap.data().lock().unwrap();
            for (pname, var) in vars.iter() {
                let got: Vec<f64> = match g.get(var.as_tensor()) {
                    Some(t) => t
                        .to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap(),
                    None => vec![0.0; var.elem_count()],
                };
                let Some(want) = grads.get(pname.as_str()) else {
                    assert!(
                        got.iter().all(|&x| x == 0.0),
                        "{case}: ∂aux/∂{pname} should be none"
                    );
                    continue;
                };
                let want: Vec<f64> = want.flatten_all().unwrap().to_vec1().unwrap();
                let (worst, scale) = crate::testing::worst_of(&got, &want);
                assert!(
                    worst <= rel * scale,
                    "{case}: ∂aux/∂{pname} off by {worst:.3e} (largest entry {scale:.3e})"
                );
            }
        }
    }
    // A model whose config does not ask for it computes none.
    loaded.model.args.moe.as_mut().unwrap().router_aux_loss_coef = None;
    loaded.model.set_exec(Exec::default());
    let ids0 = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu).unwrap();
    let pos0 = Tensor::new(&[[0u32, 1, 2]], &Device::Cpu).unwrap();
    let mask0 = Tensor::new(&[[1u32, 1, 1]], &Device::Cpu).unwrap();
    loaded
        .model
        .forward_hidden(&ids0, &pos0, &mask0, None)
        .unwrap();
    assert!(
        loaded.model.take_router_aux_loss().unwrap().is_none(),
        "{name}"
    );
}

const MOE_FAMILIES: [&str; 2] = ["qwen3_moe", "qwen3_moe_step2"];

/// f64: the router loss within 1e-10 and its gradients within 1e-8 of scale.
#[test]
fn router_loss_and_gradients_equal_transformers_in_f64() {
    for name in MOE_FAMILIES {
        router_aux_matches(name, DType::F64, 1e-10, 1e-8);
    }
}

/// f32: the router loss within 1e-5 and its gradients within 1e-4 of scale.
#[test]
fn router_loss_and_gradients_equal_transformers_in_f32() {
    for name in MOE_FAMILIES {
        router_aux_matches(name, DType::F32, 1e-5, 1e-4);
    }
}

/// A Qwen3-MoE model saved back as an HF directory has the hub's per-expert tensors and a
/// config naming its experts, and reads back as the same weights.
#[test]
fn a_saved_qwen3_moe_checkpoint_reads_back() {
    let loaded = load("qwen3_moe", DType::F64);
    let tmp = tempfile::tempdir().unwrap();
    crate::weights::hf::save_dir(
        &loaded.varmap,
        &loaded.model.args,
        tmp.path(),
        &[],
        None,
        None,
    )
    .unwrap();
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["architectures"][0], "Qwen3MoeForCausalLM");
    assert_eq!(cfg["num_experts"], 8);
    let again = crate::weights::hf::load_dir(
        tmp.path(),
        &Default::default(),
        DType::F64,
        &Device::Cpu,
        true,
    )
    .unwrap();
    assert_same_variables(&loaded.varmap, &again.varmap, "saved and read back");
}

/// Critics and reward models of these families are read under transformers' class names (a
/// Qwen3.5 critic verl saves is `Qwen3_5ForTokenClassification`; reward models
/// `Qwen3_5TextForSequenceClassification`, or `Qwen3_5ForSequenceClassification` around the
/// multimodal backbone): the same layout as the causal LM.
#[test]
fn qwen3_5_critic_and_reward_model_names_are_read() {
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir("qwen3_5").join("config.json")).unwrap())
            .unwrap();
    let causal = crate::model::ModelArgs::from_hf(&cfg).unwrap();
    for name in [
        "Qwen3_5ForTokenClassification",
        "Qwen3_5TextForSequenceClassification",
        "Qwen3_5ForSequenceClassification",
    ] {
        let mut c = cfg.clone();
        c["architectures"] = serde_json::json!([name]);
        assert_eq!(
            crate::model::ModelArgs::from_hf(&c).unwrap(),
            causal,
            "{name}"
        );
        if name.ends_with("ForSequenceClassification") {
            assert_eq!(
                crate::model::config::reward_arch_of(&c).unwrap(),
                crate::model::config::RewardArch::Causal(crate::model::Arch::Qwen3_5)
            );
        }
    }
}

/// Qwen3.5 settings that cannot run are refused naming the key: a missing DeltaNet size, value
/// heads that are not a multiple of the key heads, a rotary factor that leaves an odd or empty
/// rotary width, layer types that do not cover the layers.
#[test]
fn broken_qwen3_5_settings_are_refused_by_key() {
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir("qwen3_5").join("config.json")).unwrap())
            .unwrap();
    let refused = |edit: &dyn Fn(&mut Value)| {
        let mut c = cfg.clone();
        edit(&mut c);
        crate::model::ModelArgs::from_hf(&c).unwrap_err()
    };
    let e = refused(&|c| {
        c.as_object_mut().unwrap().remove("linear_key_head_dim");
    });
    assert!(e.contains("linear_key_head_dim"), "{e}");
    let e = refused(&|c| c["linear_num_value_heads"] = 3.into());
    assert!(
        e.contains("linear_num_value_heads") && e.contains("linear_num_key_heads"),
        "{e}"
    );
    let e = refused(&|c| c["rope_parameters"]["partial_rotary_factor"] = 0.1.into());
    assert!(e.contains("partial_rotary_factor"), "{e}");
    let e = refused(&|c| c["partial_rotary_factor"] = 0.5.into());
    assert!(e.contains("disagree"), "{e}");
    let e = refused(&|c| c["num_hidden_layers"] = 5.into());
    assert!(e.contains("layer_types") && e.contains('5'), "{e}");
    // Without layer_types, transformers' default: every full_attention_interval-th layer full.
    let mut c = cfg.clone();
    c.as_object_mut().unwrap().remove("layer_types");
    c["full_attention_interval"] = 2.into();
    let a = crate::model::ModelArgs::from_hf(&c).unwrap();
    let linear: Vec<bool> = (0..4).map(|i| a.is_linear(i)).collect();
    assert_eq!(linear, [true, false, true, false]);
}

/// A multimodal Qwen3.5 checkpoint (`Qwen3_5ForConditionalGeneration` as the hub publishes it:
/// the language model under `model.language_model.`, a vision tower, the text settings in
/// `text_config`; written by transformers from the `qwen3_5` fixture's weights) loads as the
/// same language model, its variables bit for bit the causal LM checkpoint's, plus its vision
/// tower (`visual.*`, interleaved M-RoPE sections: transformers' default [11, 11, 10] when the
/// config names none); the vision parity is `weights::vlm_tests`'.
#[test]
fn a_multimodal_qwen3_5_checkpoint_loads_its_language_model() {
    let text = load("qwen3_5", DType::F64);
    let mm = crate::weights::hf::load_dir(
        &dir("qwen3_5").join("multimodal"),
        &Default::default(),
        DType::F64,
        &Device::Cpu,
        true,
    )
    .unwrap();
    let m = mm.model.args.mrope.clone().unwrap();
    assert_eq!((m.section, m.interleaved), (vec![11, 11, 10], true));
    assert_eq!(mm.model.args.vision.as_ref().unwrap().depth, 1);
    let text_args = crate::model::ModelArgs {
        mrope: None,
        vision: None,
        ..mm.model.args.clone()
    };
    assert_eq!(text_args, text.model.args);
    let a = text.varmap.data().lock().unwrap();
    let b = mm.varmap.data().lock().unwrap();
    let tower = b.keys().filter(|n| n.starts_with("visual.")).count();
    assert!(tower > 0);
    assert_eq!(a.len() + tower, b.len());
    for (name, var) in a.iter() {
        let other = b.get(name).unwrap_or_else(|| panic!("no `{name}`"));
        let x: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let y: Vec<f64> = other.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        assert!(x == y, "`{name}` differs");
    }
}

/// A Qwen3.5 config written back (`Qwen3_5ForCausalLM`, layer types, the DeltaNet sizes, the
/// partial rotary factor) reads back as the same arguments; one with layer types that are
/// neither linear nor full attention is refused by name.
#[test]
fn a_saved_qwen3_5_config_reads_back() {
    for name in ["qwen3_5", "qwen3_5_tied", "qwen3_5_moe", "qwen3_next"] {
        let cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(dir(name).join("config.json")).unwrap())
                .unwrap();
        let args = crate::model::ModelArgs::from_hf(&cfg).unwrap();
        assert_eq!(
            crate::model::ModelArgs::from_hf(&args.to_hf()).unwrap(),
            args
        );
        let mut bad = cfg.clone();
        bad["layer_types"][1] = serde_json::json!("sliding_attention");
        let e = crate::model::ModelArgs::from_hf(&bad).unwrap_err();
        assert!(
            e.contains("layer_types[1]") && e.contains("linear_attention"),
            "{e}"
        );
    }
}

/// verl's mixed precision on the CPU for the DeltaNet hybrids and DeepSeek-V3 (their
/// composition's products on the CPU's bf16 kernels), on tiny Qwen3.5, Qwen3-Next and
/// DeepSeek-V3 models at initialisation-like scale
/// (weights N(0, 0.1²); the parity fixtures' larger weights are too ill-conditioned for bf16:
/// PyTorch's own f32 gradients there are 3e-4 of scale off f64, and Qwen3-Next's router picks
/// other experts): the loss within 1e-2 relative and every gradient within 5e-2 of its tensor's
/// largest entry of f32's, and not equal to them (the bf16 path ran).
#[test]
fn hybrid_training_in_bf16_stays_near_f32() {
    if !crate::kernels::bf16::available() {
        eprintln!("skipped: MAIN_PPO_BF16_KERNEL=none");
        return;
    }
    let r = reference("qwen3_5"); // its sequences and loss weights (vocabulary 96)
    for arch in [
        crate::model::Arch::Qwen3_5,
        crate::model::Arch::Qwen3Next,
        crate::model::Arch::DeepseekV3,
        crate::model::Arch::GptOss,
    ] {
        let mut args = crate::model::ModelArgs::tiny(arch, 96);
        if let Some(c) = args.moe.as_mut().and_then(|m| m.swiglu.as_mut()) {
            // GPT-OSS's published clamp: the tiny model's lower one acts on a few values, and a
            // value on the other side of it in bf16 flips its gradient to zero (the f32 and bf16
            // gradients then differ by design, not by rounding).
            c.limit = 7.0;
        }
        let (varmap, mut model) = crate::testing::tiny_model(&args, DType::F32, 0.1);
        let mut run = |bf16: bool| {
            model.set_exec(Exec {
                bf16,
                ..Exec::default()
            });
            let (loss, _) = loss_and_logprobs(&model, &r, false);
            let g = loss.backward().unwrap();
            let vars = varmap.data().lock().unwrap();
            let mut grads: Vec<(String, Vec<f64>)> = vars
                .iter()
                .filter_map(|(n, v)| {
                    let t = g.get(v.as_tensor())?;
                    let t = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
                    Some((n.clone(), t.to_vec1().unwrap()))
                })
                .collect();
            grads.sort_by(|a, b| a.0.cmp(&b.0));
            let l: f64 = loss.to_dtype(DType::F64).unwrap().to_scalar().unwrap();
            (l, grads)
        };
        let (l32, g32) = run(false);
        let (l16, g16) = run(true);
        let rel = (l16 - l32).abs() / l32.abs();
        assert!(
            rel > 0.0 && rel <= 1e-2,
            "{arch:?}: bf16 loss {l16} vs f32 {l32}"
        );
        assert_eq!(g16.len(), g32.len());
        let mut worst = 0f64;
        for ((n, a), (_, b)) in g16.iter().zip(&g32) {
            let (w, s) = crate::testing::worst_of(a, b);
            worst = worst.max(w / s);
            assert!(w <= 5e-2 * s, "{arch:?}: ∂L/∂{n} off by {w:.3e} of {s:.3e}");
        }
        eprintln!("{arch:?}: bf16 loss {rel:.2e} relative, worst gradient {worst:.2e} of scale");
    }
}

/// GGUF files that llama.cpp's own converter wrote of the hybrid chat fixtures
/// (`scripts/gguf_reference.sh`: float32, llama.cpp's names and layouts) read back into the
/// same model as the HF directory: the same hyper-parameters, and every variable equal to
/// transformers' float64 value within float32 rounding (`1 + w` norms and `−exp(A_log)` stored
/// as float32 are within a few float32 ulps of 1 + w and A; a misplaced value head, channel or
/// norm is off by the weights' scale, 0.3).
#[test]
fn llama_cpp_gguf_files_of_the_hybrids_load_as_the_hf_directory() {
    for name in ["qwen3_5", "qwen3_5_moe", "qwen3_next"] {
        let chat = dir(name).join("chat");
        let hf = crate::weights::hf::load_dir(
            &chat,
            &Default::default(),
            DType::F64,
            &Device::Cpu,
            true,
        )
        .unwrap();
        let (gguf, _) = crate::weights::gguf::load(
            &chat.join("model-f32.gguf"),
            DType::F64,
            &Device::Cpu,
            true,
        )
        .unwrap();
        let (a, b) = (&hf.model.args, &gguf.model.args);
        assert_eq!(a.arch, b.arch, "{name}");
        assert_eq!(a.layer_types, b.layer_types, "{name}");
        assert_eq!(a.linear_attn, b.linear_attn, "{name}");
        assert_eq!(a.moe, b.moe, "{name}");
        assert_eq!(
            (
                a.rotary_dim,
                a.head_dim,
                a.num_attention_heads,
                a.num_key_value_heads
            ),
            (
                b.rotary_dim,
                b.head_dim,
                b.num_attention_heads,
                b.num_key_value_heads
            ),
            "{name}"
        );
        assert_eq!(a.tie_word_embeddings, b.tie_word_embeddings, "{name}");
        assert!((a.rms_norm_eps - b.rms_norm_eps).abs() < 1e-12, "{name}");
        let (x, y) = (
            hf.varmap.data().lock().unwrap(),
            gguf.varmap.data().lock().unwrap(),
        );
        let mut names: Vec<&String> = x.keys().collect();
        names.sort();
        assert_eq!(
            names,
            {
                let mut n: Vec<&String> = y.keys().collect();
                n.sort();
                n
            },
            "{name}"
        );
        for n in names {
            let want: Vec<f64> = x[n].as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            let got: Vec<f64> = y[n].as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(
                x[n].as_tensor().dims(),
                y[n].as_tensor().dims(),
                "{name}: {n}"
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // float32 rounding of the stored value (of 1 + w for norms, of e^A_log for A).
                let stored = if n.ends_with("A_log") {
                    w.exp()
                } else {
                    w.abs() + 1.0
                };
                let tol = 4.0 * f32::EPSILON as f64 * stored.max(1.0);
                assert!(
                    (g - w).abs() <= tol,
                    "{name}: {n}[{i}] = {g} from the GGUF, {w} in the HF directory"
                );
            }
        }
    }
}

/// A hybrid GGUF that lacks one of a DeltaNet layer's tensors, or whose `ssm.*` metadata
/// disagrees with its tensors, is refused naming the file, the layer's tensor and the metadata.
#[test]
fn a_broken_hybrid_gguf_is_refused_by_name() {
    use candle_core::quantized::gguf_file;
    let src = dir("qwen3_5").join("chat/model-f32.gguf");
    let tmp = tempfile::tempdir().unwrap();
    // The fixture rewritten: `skip` left out, `meta` set, `copy` = (new name, tensor copied).
    let rewrite =
        |out: &Path, skip: &str, meta: &[(&str, gguf_file::Value)], copy: &[(String, String)]| {
            let mut f = std::fs::File::open(&src).unwrap();
            let c = gguf_file::Content::read(&mut f).unwrap();
            let mut names: Vec<(String, String)> = c
                .tensor_infos
                .keys()
                .filter(|n| n.as_str() != skip)
                .map(|n| (n.clone(), n.clone()))
                .chain(copy.iter().cloned())
                .collect();
            names.sort();
            let tensors: Vec<(String, candle_core::quantized::QTensor)> = names
                .iter()
                .map(|(to, from)| (to.clone(), c.tensor(&mut f, from, &Device::Cpu).unwrap()))
                .collect();
            let mut md: Vec<(String, gguf_file::Value)> = c.metadata.clone().into_iter().collect();
            for (k, v) in meta {
                md.retain(|(n, _)| n != k);
                md.push((k.to_string(), v.clone()));
            }
            let md_refs: Vec<(&str, &gguf_file::Value)> =
                md.iter().map(|(k, v)| (k.as_str(), v)).collect();
            let t_refs: Vec<(&str, &candle_core::quantized::QTensor)> =
                tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
            gguf_file::write(&mut std::fs::File::create(out).unwrap(), &md_refs, &t_refs).unwrap();
        };
    let load = |p: &Path| {
        crate::weights::gguf::load(p, DType::F32, &Device::Cpu, true)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let missing = tmp.path().join("missing.gguf");
    rewrite(&missing, "blk.1.ssm_a", &[], &[]);
    let e = load(&missing);
    assert!(
        e.contains("missing.gguf")
            && e.contains("model.layers.1.linear_attn.")
            && e.contains("A_log")
            && e.contains("recurrent_layers"),
        "{e}"
    );
    let rank = |n: u32| [("qwen35.ssm.time_step_rank", gguf_file::Value::U32(n))];
    let wrong = tmp.path().join("wrong.gguf");
    rewrite(&wrong, "", &rank(2), &[]);
    let e = load(&wrong);
    assert!(
        e.contains("wrong.gguf") && e.contains("A_log") && e.contains("ssm.*"),
        "{e}"
    );
    let uneven = tmp.path().join("uneven.gguf");
    rewrite(&uneven, "", &rank(3), &[]);
    let e = load(&uneven);
    assert!(
        e.contains("uneven.gguf")
            && e.contains("qwen35.ssm.time_step_rank")
            && e.contains("qwen35.ssm.group_count"),
        "{e}"
    );
    // llama.cpp's default output keeps the multi-token-prediction head as extra layers
    // (`nextn_predict_layers`): here a copy of the last layer plus a `nextn` tensor, not read.
    let copies: Vec<(String, String)> = {
        let c = gguf_file::Content::read(&mut std::fs::File::open(&src).unwrap()).unwrap();
        let mut v: Vec<(String, String)> = c
            .tensor_infos
            .keys()
            .filter_map(|n| {
                n.strip_prefix("blk.3.")
                    .map(|p| (format!("blk.4.{p}"), n.clone()))
            })
            .collect();
        v.push((
            "blk.4.nextn.eh_proj.weight".into(),
            "blk.3.attn_k.weight".into(),
        ));
        v
    };
    let mtp = tmp.path().join("mtp.gguf");
    let counts = [
        ("qwen35.block_count", gguf_file::Value::U32(5)),
        ("qwen35.nextn_predict_layers", gguf_file::Value::U32(1)),
    ];
    rewrite(&mtp, "", &counts, &copies);
    let with = crate::weights::gguf::load(&mtp, DType::F64, &Device::Cpu, true)
        .unwrap()
        .0;
    let without = crate::weights::gguf::load(&src, DType::F64, &Device::Cpu, true)
        .unwrap()
        .0;
    assert_eq!(with.model.args, without.model.args);
    assert_same_variables(
        &with.varmap,
        &without.varmap,
        "with and without the MTP layer",
    );
}

/// DeepSeek-V3 saved back as an HF folder holds every tensor transformers wrote, bit for bit,
/// the score-correction buffers (`mlp.gate.e_score_correction_bias`, one per layer of experts)
/// included; its config names DeepseekV3ForCausalLM and reads back as the same arguments (latent
/// attention, routing, yarn), and the folder loads again as the same variables.
#[test]
fn deepseek_v3_saves_back_every_tensor() {
    for name in ["deepseek_v3", "deepseek_v3_qnull"] {
        let kept = |n: &str| crate::model::config::kept_as_read(n);
        let args = assert_saves_back(name, "DeepseekV3ForCausalLM", kept, 2);
        assert!(args.mla.is_some() && args.moe.as_ref().unwrap().deepseek.is_some());
    }
}

/// Gemma 2 saves back every tensor as read under Gemma2ForCausalLM, and its config (soft-caps,
/// layer types, an integer `query_pre_attn_scalar` as transformers' strict class takes it)
/// reads back as the same arguments; a soft-cap that is not a positive number is refused.
#[test]
fn gemma2_saves_back_every_tensor_and_its_caps() {
    for name in ["gemma2", "gemma2_nocap"] {
        let args = assert_saves_back(name, "Gemma2ForCausalLM", |_| false, 0);
        assert_eq!(
            args.final_logit_softcapping.is_some(),
            name == "gemma2",
            "{name}"
        );
    }
    let mut cfg = config_of("gemma2");
    cfg["attn_logit_softcapping"] = (-1.0).into();
    let e = crate::model::ModelArgs::from_hf(&cfg).unwrap_err();
    assert!(e.contains("attn_logit_softcapping"), "{e}");
}

/// GLM-4.5 saves back every tensor as read (its score-correction buffers included), under
/// Glm4MoeForCausalLM, and its config reads back as the same arguments (optional q/k norms,
/// partial rotary width, DeepSeek's routing).
#[test]
fn glm4_moe_saves_back_every_tensor() {
    for (name, qk_norm, rotary) in [("glm4_moe", true, 4), ("glm4_moe_plain", false, 4)] {
        let kept = |n: &str| crate::model::config::kept_as_read(n);
        let sparse = if name == "glm4_moe" { 2 } else { 1 };
        let args = assert_saves_back(name, "Glm4MoeForCausalLM", kept, sparse);
        assert!(args.mla.is_none() && args.deepseek_routing(), "{name}");
        assert_eq!(
            (args.qk_norm(), args.rotary_dim()),
            (qk_norm, rotary),
            "{name}"
        );
    }
}

/// A GLM-4.5 config.json with a broken key is refused naming it: a rotary fraction giving an
/// odd width, `use_qk_norm` that is not a boolean, a missing routing key; q/k norm tensors
/// present while `use_qk_norm` is false are refused as unread layer tensors.
#[test]
fn broken_glm4_moe_settings_are_refused_by_key() {
    let cfg = config_of("glm4_moe");
    let refused = refusal_of(&cfg);
    refused(
        &|c| c["rope_parameters"]["partial_rotary_factor"] = 0.375.into(),
        "partial_rotary_factor",
    );
    refused(&|c| c["use_qk_norm"] = "yes".into(), "use_qk_norm");
    refused(
        &|c| drop(c.as_object_mut().unwrap().remove("n_group")),
        "n_group",
    );
    refused(&|c| c["topk_group"] = 3.into(), "topk_group");
    let tmp = tempfile::tempdir().unwrap();
    let mut c = cfg.clone();
    c["use_qk_norm"] = false.into();
    let e = load_error("glm4_moe", tmp.path(), &c, None);
    assert!(e.contains("norm.weight") && e.contains("Glm4Moe"), "{e}");
}

/// GPT-OSS saves back every tensor as read: its experts in the fused, interleaved layout of
/// its checkpoints (`mlp.experts.gate_up_proj` `[experts, hidden, 2·inter]` and the rest, which
/// the model holds per expert), the router's bias and the sinks; the config reads back as the
/// same arguments (layer types, yarn, clamp).
#[test]
fn gpt_oss_saves_back_every_tensor_in_its_fused_layout() {
    for name in ["gpt_oss", "gpt_oss_plain"] {
        let args = assert_saves_back(name, "GptOssForCausalLM", |_| false, 0);
        assert!(args.arch.sinks() && args.moe.as_ref().unwrap().swiglu.is_some());
        let saved = file_tensors(&dir(name));
        assert!(saved.contains_key("model.layers.1.mlp.experts.gate_up_proj"));
        assert!(!saved.keys().any(|k| k.contains(".experts.0.")));
    }
}

/// A GPT-OSS checkpoint as published (experts as MXFP4 blocks and scales, `quantization_config`
/// `mxfp4`; its parity with transformers is `gpt_oss_mxfp4` in [`FAMILIES`]) is saved back
/// dequantized: the fused experts in the model's dtype, no blocks, scales or
/// `quantization_config`, and that folder loads as the same variables. Blocks without their
/// scales are refused naming both.
#[test]
fn a_gpt_oss_mxfp4_checkpoint_loads_and_saves_dequantized() {
    let loaded = load("gpt_oss_mxfp4", DType::F64);
    let tmp = tempfile::tempdir().unwrap();
    let args = &loaded.model.args;
    crate::weights::hf::save_dir(&loaded.varmap, args, tmp.path(), &[], None, None).unwrap();
    let saved = file_tensors(tmp.path());
    assert!(saved.contains_key("model.layers.1.mlp.experts.gate_up_proj"));
    assert!(!saved
        .keys()
        .any(|k| k.ends_with("_blocks") || k.ends_with("_scales")));
    let cfg = std::fs::read_to_string(tmp.path().join("config.json")).unwrap();
    assert!(!cfg.contains("quantization_config"), "{cfg}");
    let again = crate::weights::hf::load_dir(
        tmp.path(),
        &Default::default(),
        DType::F64,
        &Device::Cpu,
        true,
    )
    .unwrap();
    assert_same_variables(&loaded.varmap, &again.varmap, "gpt_oss_mxfp4");
    // Blocks without scales.
    let src = dir("gpt_oss_mxfp4");
    let mut tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    tensors.remove("model.layers.0.mlp.experts.down_proj_scales");
    let e = load_error(
        "gpt_oss_mxfp4",
        tmp.path(),
        &config_of("gpt_oss_mxfp4"),
        Some(&tensors),
    );
    assert!(
        e.contains("down_proj_blocks") && e.contains("down_proj_scales"),
        "{e}"
    );
}

/// A GPT-OSS config.json or folder with a broken setting is refused naming it: a clamp that is
/// not a positive number, a layer list of another length, fused expert tensors of another
/// layout (the tensor named), a `quantization_config` other than MXFP4 (and MXFP4 on another
/// family).
#[test]
fn broken_gpt_oss_settings_are_refused_by_key() {
    let cfg = config_of("gpt_oss");
    let refused = refusal_of(&cfg);
    refused(&|c| c["swiglu_limit"] = (-1.0).into(), "swiglu_limit");
    refused(
        &|c| c["layer_types"] = serde_json::json!(["full_attention"]),
        "layer_types",
    );
    let fp8 = serde_json::json!({"quant_method": "fp8"});
    refused(
        &|c| c["quantization_config"] = fp8.clone(),
        "quantization_config",
    );
    // MXFP4 is GPT-OSS's own: another family naming it is refused.
    let mut qwen = cfg.clone();
    qwen["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    qwen["quantization_config"] = serde_json::json!({"quant_method": "mxfp4"});
    qwen["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e4});
    let e = crate::model::ModelArgs::from_hf(&qwen).unwrap_err();
    assert!(
        e.contains("quantization_config") && e.contains("mxfp4"),
        "{e}"
    );
    // Without layer_types, transformers' default: sliding, full, sliding.
    let mut c = cfg.clone();
    c.as_object_mut().unwrap().remove("layer_types");
    let args = crate::model::ModelArgs::from_hf(&c).unwrap();
    let kinds: Vec<_> = (0..3).map(|i| args.layer_kind(i)).collect();
    use crate::model::config::LayerKind::{Full, Sliding};
    assert_eq!(kinds, [Sliding, Full, Sliding]);
    // The experts' down projection stored per-expert-transposed: refused naming the tensor.
    let tmp = tempfile::tempdir().unwrap();
    let mut tensors =
        candle_core::safetensors::load(dir("gpt_oss").join("model.safetensors"), &Device::Cpu)
            .unwrap();
    let name = "model.layers.1.mlp.experts.down_proj_bias";
    let b = tensors[name].unsqueeze(2).unwrap();
    tensors.insert(name.into(), b);
    let e = load_error("gpt_oss", tmp.path(), &cfg, Some(&tensors));
    assert!(e.contains(name) && e.contains("GPT-OSS"), "{e}");
}

/// DeepSeek-V3's score-correction biases are not among the variables the optimizer updates
/// (transformers keeps them as buffers): an AdamW step with weight decay leaves them as read
/// while the router, the latent attention's projections and norms and the shared experts move.
#[test]
fn deepseek_v3_correction_bias_is_left_out_of_the_update() {
    let loaded = load("deepseek_v3", DType::F64);
    let vars =
        crate::trainer::trainable::trainable_variables(&loaded.varmap, None, &loaded.model.args);
    let all = loaded.varmap.data().lock().unwrap().len();
    assert!(vars.keys().all(|n| !n.ends_with("e_score_correction_bias")));
    assert_eq!(vars.len(), all - 2);
    let before = file_tensors(&dir("deepseek_v3"));
    let opt = crate::config::OptimConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut adamw = crate::trainer::optim::AdamW::new(vars, &opt).unwrap();
    let (loss, _) = loss_and_logprobs(&loaded.model, &reference("deepseek_v3"), false);
    adamw.step(&loss.backward().unwrap(), opt.lr).unwrap();
    let now = |name: &str| -> Vec<f64> {
        let vars = loaded.varmap.data().lock().unwrap();
        vars[name]
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    for layer in [1, 2] {
        let bias = format!("model.layers.{layer}.mlp.gate.e_score_correction_bias");
        assert_eq!(now(&bias), before[&bias], "{bias}");
    }
    for moved in [
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.1.self_attn.q_b_proj.weight",
        "model.layers.2.self_attn.kv_b_proj.weight",
        "model.layers.2.mlp.shared_experts.down_proj.weight",
    ] {
        assert_ne!(now(moved), before[moved], "{moved}");
    }
}

/// A DeepSeek-V3 config.json with a key missing, a value out of range, a spacing this
/// implementation does not follow or quantized (fp8) weights, which would read as wrong
/// numbers, is refused naming the key; a tensor whose shape the config contradicts is refused
/// naming the tensor; yarn RoPE on another family is refused.
#[test]
fn broken_deepseek_v3_settings_are_refused_by_key() {
    let cfg = config_of("deepseek_v3");
    let refused = refusal_of(&cfg);
    for key in [
        "kv_lora_rank",
        "qk_rope_head_dim",
        "n_group",
        "first_k_dense_replace",
    ] {
        refused(&|c| drop(c.as_object_mut().unwrap().remove(key)), key);
    }
    refused(&|c| c["n_group"] = 3.into(), "n_group");
    refused(&|c| c["topk_group"] = 5.into(), "topk_group");
    refused(&|c| c["moe_layer_freq"] = 2.into(), "moe_layer_freq");
    refused(&|c| c["q_lora_rank"] = 0.into(), "q_lora_rank");
    refused(&|c| c["qk_rope_head_dim"] = 3.into(), "qk_rope_head_dim");
    // The hub's DeepSeek-V3 / Kimi-K2 weights are fp8 blocks.
    let fp8 = serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]});
    refused(
        &|c| c["quantization_config"] = fp8.clone(),
        "quantization_config",
    );
    refused(
        &|c| {
            drop(
                c["rope_parameters"]
                    .as_object_mut()
                    .unwrap()
                    .remove("factor"),
            )
        },
        "rope_parameters.factor",
    );
    let mut llama = cfg.clone();
    llama["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    let e = crate::model::ModelArgs::from_hf(&llama).unwrap_err();
    assert!(e.contains("yarn") && e.contains("DeepseekV3"), "{e}");
    // A latent width the tensors do not have: refused naming the tensor.
    let tmp = tempfile::tempdir().unwrap();
    let mut c = cfg.clone();
    c["kv_lora_rank"] = 10.into();
    let e = load_error("deepseek_v3", tmp.path(), &c, None);
    assert!(e.contains("model.layers.0.self_attn.kv_a_"), "{e}");
}

/// DeepSeek-V3 decodes from its compressed cache: each layer keeps per position the latent and
/// the rope key (`kv_lora_rank + qk_rope_head_dim` = 16 values, 384 bytes over 3 layers in f64,
/// where expanded keys and values would take 4·(12 + 6) = 72 per layer), and a prompt
/// prefilled into the cache then extended a token at a time gives the hidden states of one
/// forward over the whole sequence, within 1e-12 (f64), for a left-padded batch of two.
#[test]
fn deepseek_v3_decodes_from_its_compressed_cache() {
    let loaded = load("deepseek_v3", DType::F64);
    let m = loaded.model.no_grad();
    assert_eq!(
        crate::model::decode::kv_bytes_per_position(&m.args, 8),
        3 * 16 * 8
    );
    let dev = &Device::Cpu;
    // Row 0: 7 tokens; row 1: 5 tokens after 2 of padding.
    let toks: Vec<u32> = vec![5, 17, 42, 8, 91, 3, 60, 0, 0, 11, 29, 74, 2, 38];
    let mask: Vec<u32> = vec![1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1];
    let pos: Vec<u32> = vec![0, 1, 2, 3, 4, 5, 6, 0, 0, 0, 1, 2, 3, 4];
    let t = |v: &[u32], w: usize| Tensor::from_vec(v.to_vec(), (2, w), dev).unwrap();
    let cols = |v: &[u32], a: usize, n: usize| -> Vec<u32> {
        (0..2)
            .flat_map(|r| v[r * 7 + a..r * 7 + a + n].to_vec())
            .collect()
    };
    let full = m
        .forward_hidden(&t(&toks, 7), &t(&pos, 7), &t(&mask, 7), None)
        .unwrap(); // [2, 7, hidden]
    let mut cache = crate::model::KvCache::new(m.args.num_hidden_layers);
    let mut parts = vec![m
        .forward_hidden(
            &t(&cols(&toks, 0, 4), 4),
            &t(&cols(&pos, 0, 4), 4),
            &t(&cols(&mask, 0, 4), 4),
            Some(&mut cache),
        )
        .unwrap()];
    for i in 4..7 {
        let step = m
            .forward_hidden(
                &t(&cols(&toks, i, 1), 1),
                &t(&cols(&pos, i, 1), 1),
                &t(&cols(&mask, 0, i + 1), i + 1),
                Some(&mut cache),
            )
            .unwrap();
        parts.push(step);
    }
    assert_eq!(cache.len(), 7);
    let cached = Tensor::cat(&parts, 1).unwrap();
    // Real positions only (padding rows attend to nothing and differ in both).
    for (r, first) in [(0usize, 0usize), (1, 2)] {
        let a = full.get(r).unwrap().narrow(0, first, 7 - first).unwrap();
        let b = cached.get(r).unwrap().narrow(0, first, 7 - first).unwrap();
        let d = crate::testing::max_abs_diff(&a, &b);
        assert!(d <= 1e-12, "row {r}: cached decoding off by {d}");
    }
}

/// A GGUF file of an architecture this reader leaves to the HF folder (llama.cpp's `deepseek2`:
/// DeepSeek-V2/V3, Kimi-K2, Moonlight; `glm4moe`; `qwen2moe`; `gemma2`) is refused naming the
/// file, the architecture and the HF folder to load instead.
#[test]
fn hf_only_gguf_architectures_are_refused_by_name() {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    for (name, hf) in [
        ("deepseek2", "DeepseekV3ForCausalLM"),
        ("glm4moe", "Glm4MoeForCausalLM"),
        ("qwen2moe", "Qwen2MoeForCausalLM"),
        ("gemma2", "Gemma2ForCausalLM"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("model.gguf");
        let arch = gguf_file::Value::String(name.into());
        let embd = Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap();
        let embd = QTensor::quantize(&embd, GgmlDType::F32).unwrap();
        gguf_file::write(
            &mut std::fs::File::create(&path).unwrap(),
            &[("general.architecture", &arch)],
            &[("token_embd.weight", &embd)],
        )
        .unwrap();
        let e = crate::weights::gguf::load(&path, DType::F32, &Device::Cpu, true)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.gguf")
                && e.contains(&format!("`{name}`"))
                && e.contains(hf)
                && e.contains("HF folder"),
            "{e}"
        );
    }
}

/// A DeepSeek-V3 or GLM-4.5 folder with a multi-token-prediction layer after its decoder layers
/// (as the hub's DeepSeek-V3 and Kimi-K2 keep layer 61 and GLM-4.5 layer 92: `model.layers.3.*` here, a decoder layer plus
/// `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}`, `embed_tokens`) and
/// `num_nextn_predict_layers: 1` loads: its log-probs equal the folder without that layer bit for
/// bit, the layer's tensors are variables left out of the update, and saving back writes every
/// tensor as read with the key; with `num_nextn_predict_layers: 0` the same folder is refused
/// naming the first unread tensor.
#[test]
fn deepseek_v3_and_glm4_moe_mtp_layers_are_kept_as_read() {
    for name in ["deepseek_v3", "glm4_moe"] {
        mtp_layer_kept_as_read(name);
    }
}

fn mtp_layer_kept_as_read(family: &str) {
    let src = dir(family);
    let mut tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let layer2: Vec<(String, Tensor)> = tensors
        .iter()
        .filter_map(|(n, t)| {
            let rest = n.strip_prefix("model.layers.2.")?;
            Some((format!("model.layers.3.{rest}"), (t * 0.5).unwrap()))
        })
        .collect();
    tensors.extend(layer2);
    let h = 32;
    for (name, shape) in [
        ("enorm.weight", vec![h]),
        ("hnorm.weight", vec![h]),
        ("eh_proj.weight", vec![h, 2 * h]),
        ("shared_head.norm.weight", vec![h]),
        ("shared_head.head.weight", vec![96, h]),
        ("embed_tokens.weight", vec![96, h]),
    ] {
        let t = Tensor::randn(0f64, 0.3, shape, &Device::Cpu).unwrap();
        tensors.insert(format!("model.layers.3.{name}"), t);
    }
    let tmp = tempfile::tempdir().unwrap();
    let folder = |nextn: u64| {
        let d = tmp.path().join(format!("nextn{nextn}"));
        std::fs::create_dir_all(&d).unwrap();
        candle_core::safetensors::save(&tensors, d.join("model.safetensors")).unwrap();
        std::fs::copy(
            src.join("generation_config.json"),
            d.join("generation_config.json"),
        )
        .unwrap();
        let mut cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap())
                .unwrap();
        cfg["num_nextn_predict_layers"] = nextn.into();
        std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
        d
    };
    let read = |d: &Path| {
        crate::weights::hf::load_dir(d, &Default::default(), DType::F64, &Device::Cpu, true)
    };
    let e = read(&folder(0)).err().unwrap().to_string();
    assert!(e.contains("`model.layers.3."), "{family}: {e}");
    let with = read(&folder(1)).unwrap();
    let plain = load(family, DType::F64);
    let r = reference(family);
    let (_, a) = loss_and_logprobs(&with.model, &r, false);
    let (_, b) = loss_and_logprobs(&plain.model, &r, false);
    assert_eq!(a, b, "{family}");
    let mtp = tensors
        .keys()
        .filter(|n| n.starts_with("model.layers.3."))
        .count();
    let all = with.varmap.data().lock().unwrap().len();
    let vars = crate::trainer::trainable::trainable_variables(&with.varmap, None, &with.model.args);
    assert_eq!(vars.len(), all - 2 - mtp);
    assert!(vars.keys().all(|n| !n.starts_with("model.layers.3.")));
    let out = tmp.path().join("saved");
    crate::weights::hf::save_dir(&with.varmap, &with.model.args, &out, &[], None, None).unwrap();
    let (want, got) = (file_tensors(&folder(1)), file_tensors(&out));
    assert_eq!(want.len(), got.len());
    assert!(want == got, "a saved value differs");
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["num_nextn_predict_layers"], 1);
    let args = crate::model::ModelArgs::from_hf(&cfg).unwrap();
    assert_eq!(args, with.model.args);
}
