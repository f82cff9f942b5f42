//! Parity with transformers and PyTorch autograd for the vision-language families, on tiny
//! random checkpoints that transformers wrote (`tests/fixtures/vlm/<name>/`, made by
//! `scripts/vlm_reference.py` with transformers 5.24 / torch 2.15, float64 weights; the places
//! where transformers computes in float32 inside a float64 model are kept in float64 there, as
//! its docstring lists).
//!
//! For each checkpoint: the vision tower's merged features of images of three sizes (alone and
//! together), the 3-D rotary positions of sequences with one, two and no images, greedy
//! continuations by full forwards, and the training forward's token log-probs and every
//! parameter's gradient (vision tower included) of `L = Σ_i Σ_t c_it · log p(s_i,t+1 | s_i,≤t)`,
//! padded and packed, on every execution path.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::family_tests::{file_tensors, floats, ids, EXEC_PATHS};
use crate::model::vision::{mrope_positions, VisionFeatures};
use crate::model::CausalLm;

fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/vlm")
        .join(name)
}

fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(dir(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn load(name: &str, dtype: DType) -> crate::weights::hf::Loaded {
    crate::weights::hf::load_dir(&dir(name), &Default::default(), dtype, &Device::Cpu, true)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The fixture's image grids `(t, h, w)`.
fn grids(r: &Value) -> Vec<[usize; 3]> {
    ids(&r["grids"])
        .iter()
        .map(|g| [g[0] as usize, g[1] as usize, g[2] as usize])
        .collect()
}

/// The pixel values of image `i` `[patches, C·T·P·P]` (f64).
fn pixels(name: &str, i: usize) -> Tensor {
    let t =
        candle_core::safetensors::load(dir(name).join("inputs.safetensors"), &Device::Cpu).unwrap();
    t[&format!("pixel_values_{i}")].clone()
}

/// The features of images `which` (in order), from the model's tower.
fn features(m: &CausalLm, name: &str, r: &Value, which: &[usize]) -> VisionFeatures {
    let g = grids(r);
    let px: Vec<Tensor> = which.iter().map(|&i| pixels(name, i)).collect();
    let gs: Vec<[usize; 3]> = which.iter().map(|&i| g[i]).collect();
    m.image_features(&Tensor::cat(&px, 0).unwrap(), &gs)
        .unwrap()
}

/// The largest difference of two tensors, and the largest magnitude of `want`.
fn worst(got: &Tensor, want: &Tensor) -> (f64, f64) {
    let g: Vec<f64> = got
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let w: Vec<f64> = want
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(g.len(), w.len());
    crate::testing::worst_of(&g, &w)
}

/// The 3-D positions of `seq` (its images' grids `gs`): `[3][len]`.
fn positions(m: &CausalLm, seq: &[u32], gs: &[[usize; 3]]) -> [Vec<u32>; 3] {
    let v = m.args.vision.as_ref().unwrap();
    mrope_positions(seq, v.image_token_id, gs, v.spatial_merge_size)
        .unwrap()
        .0
}

const NAMES: [&str; 5] = [
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5_vl",
    "qwen3_5_moe_vl",
];

#[test]
fn the_vision_tower_equals_transformers_in_f64() {
    for name in NAMES {
        let r = reference(name);
        let m = load(name, DType::F64).model;
        let want =
            candle_core::safetensors::load(dir(name).join("vision.safetensors"), &Device::Cpu)
                .unwrap();
        let n = grids(&r).len();
        // The merged features, then each DeepStack feature (Qwen3-VL), image by image.
        let outputs = |f: &VisionFeatures| -> Vec<Tensor> {
            std::iter::once(f.merged.clone())
                .chain(f.deepstack.iter().cloned())
                .collect()
        };
        let expected = |i: usize| -> Vec<Tensor> {
            let mut v = vec![want[&format!("image_{i}")].clone()];
            v.extend((0..).map_while(|k| want.get(&format!("image_{i}_deepstack_{k}")).cloned()));
            v
        };
        for i in 0..n {
            let got = outputs(&features(&m, name, &r, &[i]));
            assert_eq!(got.len(), expected(i).len(), "{name} image {i}");
            for (k, (g, e)) in got.iter().zip(expected(i)).enumerate() {
                let (w, scale) = worst(g, &e);
                assert!(
                    w <= 1e-12 * scale.max(1.0),
                    "{name} image {i} output {k}: off by {w:e}"
                );
            }
        }
        // All images in one call: each image attends within itself only.
        let all: Vec<usize> = (0..n).collect();
        let got = outputs(&features(&m, name, &r, &all));
        for (k, g) in got.iter().enumerate() {
            let cat: Vec<Tensor> = all.iter().map(|&i| expected(i)[k].clone()).collect();
            let (w, _) = worst(g, &Tensor::cat(&cat, 0).unwrap());
            assert!(w <= 1e-12, "{name} all images, output {k}: off by {w:e}");
        }
    }
}

#[test]
fn multimodal_rotary_positions_equal_transformers() {
    for name in NAMES {
        let r = reference(name);
        let m = load(name, DType::F64).model;
        let v = m.args.vision.clone().unwrap();
        let g = grids(&r);
        for (i, seq) in ids(&r["sequences"]).iter().enumerate() {
            let which: Vec<usize> = r["images"][i]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            let gs: Vec<[usize; 3]> = which.iter().map(|&k| g[k]).collect();
            let (pos, delta) =
                mrope_positions(seq, v.image_token_id, &gs, v.spatial_merge_size).unwrap();
            let want = ids(&r["positions"][i]["positions"]);
            assert_eq!(pos.to_vec(), want, "{name} sequence {i}");
            assert_eq!(
                delta,
                r["positions"][i]["delta"].as_i64().unwrap(),
                "{name} {i}"
            );
        }
        // A run of placeholders of the wrong length, or more runs than images, is an error.
        let seq = ids(&r["sequences"])[0].clone();
        let short = mrope_positions(&seq, v.image_token_id, &[[1, 4, 4]], 2).unwrap_err();
        assert!(short.contains("needs 4 placeholder tokens"), "{short}");
        let none = mrope_positions(&seq, v.image_token_id, &[], 2).unwrap_err();
        assert!(none.contains("more image placeholder runs"), "{none}");
        let extra = mrope_positions(&[1, 2, 3], v.image_token_id, &[[1, 4, 4]], 2).unwrap_err();
        assert!(extra.contains("fewer placeholder runs"), "{extra}");
    }
}

/// Each sequence's images (indices into the fixture's grids).
fn images_of(r: &Value) -> Vec<Vec<usize>> {
    r["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            a.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect()
        })
        .collect()
}

#[test]
fn greedy_continuations_by_full_forwards_equal_transformers() {
    for name in NAMES {
        let r = reference(name);
        let m = load(name, DType::F64).model;
        let g = grids(&r);
        let dev = &Device::Cpu;
        for (i, (seq, which)) in ids(&r["sequences"]).iter().zip(images_of(&r)).enumerate() {
            let gs: Vec<[usize; 3]> = which.iter().map(|&k| g[k]).collect();
            let f = (!which.is_empty()).then(|| features(&m, name, &r, &which));
            let mut s = seq.clone();
            for (step, want) in r["greedy"][i].as_array().unwrap().iter().enumerate() {
                let pos = positions(&m, &s, &gs);
                let t = s.len();
                let pos: Vec<u32> = pos.concat();
                let h = m
                    .forward_hidden_images(
                        &Tensor::new(s.as_slice(), dev)
                            .unwrap()
                            .unsqueeze(0)
                            .unwrap(),
                        &Tensor::from_vec(pos, (3, 1, t), dev).unwrap(),
                        &Tensor::ones((1, t), DType::U32, dev).unwrap(),
                        f.as_ref(),
                        None,
                    )
                    .unwrap();
                let logits = m.logits(&h.narrow(1, t - 1, 1).unwrap()).unwrap();
                let lp = candle_nn::ops::log_softmax(&logits.flatten_all().unwrap(), 0).unwrap();
                let lp: Vec<f64> = lp.to_vec1().unwrap();
                let tok = (0..lp.len())
                    .max_by(|&a, &b| lp[a].total_cmp(&lp[b]))
                    .unwrap();
                assert_eq!(
                    tok as u64,
                    want["token"].as_u64().unwrap(),
                    "{name} {i} step {step}"
                );
                let wl = want["logprob"].as_f64().unwrap();
                assert!(
                    (lp[tok] - wl).abs() <= 1e-12,
                    "{name} {i} step {step}: {} vs {wl}",
                    lp[tok]
                );
                s.push(tok as u32);
            }
        }
    }
}

/// The loss and per-token log-probs of the fixture's sequences, padded into one batch or
/// packed end to end, with every image's features from the tower (so gradients reach it).
fn loss_and_logprobs(m: &CausalLm, name: &str, r: &Value, packed: bool) -> (Tensor, Vec<Vec<f64>>) {
    let seqs = ids(&r["sequences"]);
    let which = images_of(r);
    let g = grids(r);
    let order: Vec<usize> = which.concat();
    let f = features(m, name, r, &order);
    let dev = &Device::Cpu;
    let inputs: Vec<&[u32]> = seqs.iter().map(|s| &s[..s.len() - 1]).collect();
    let pos: Vec<[Vec<u32>; 3]> = inputs
        .iter()
        .zip(&which)
        .map(|(s, w)| positions(m, s, &w.iter().map(|&k| g[k]).collect::<Vec<_>>()))
        .collect();
    let (lp, spans): (Tensor, Vec<(usize, usize)>) = if packed {
        let (mut toks, mut p3, mut tgt, mut segs) =
            (vec![], [vec![], vec![], vec![]], vec![], vec![]);
        for ((s, p), full) in inputs.iter().zip(&pos).zip(&seqs) {
            segs.push((toks.len(), s.len()));
            toks.extend_from_slice(s);
            for a in 0..3 {
                p3[a].extend_from_slice(&p[a]);
            }
            tgt.extend_from_slice(&full[1..]);
        }
        let n = toks.len();
        let h = m
            .forward_hidden_packed_images(
                &Tensor::from_vec(toks, n, dev).unwrap(),
                &Tensor::from_vec(p3.concat(), (3, n), dev).unwrap(),
                &segs,
                Some(&f),
            )
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let tgt = Tensor::from_vec(tgt, (1, n), dev).unwrap();
        let (lp, _) = m.token_logprobs(&h, &tgt, 7, false).unwrap();
        (lp.squeeze(0).unwrap(), segs)
    } else {
        let w = inputs.iter().map(|s| s.len()).max().unwrap();
        let b = seqs.len();
        let (mut toks, mut mask, mut tgt) = (vec![], vec![], vec![]);
        let mut p3 = [vec![0u32; b * w], vec![0u32; b * w], vec![0u32; b * w]];
        for (i, ((s, p), full)) in inputs.iter().zip(&pos).zip(&seqs).enumerate() {
            let lead = w - s.len();
            for k in 0..w {
                let real = k >= lead;
                toks.push(if real { s[k - lead] } else { 0 });
                mask.push(u32::from(real));
                tgt.push(if real { full[k - lead + 1] } else { 0 });
                for a in 0..3 {
                    if real {
                        p3[a][i * w + k] = p[a][k - lead];
                    }
                }
            }
        }
        let t = |v: Vec<u32>| Tensor::from_vec(v, (b, w), dev).unwrap();
        let p = Tensor::from_vec(p3.concat(), (3, b, w), dev).unwrap();
        let h = m
            .forward_hidden_images(&t(toks), &p, &t(mask), Some(&f), None)
            .unwrap();
        let (lp, _) = m.token_logprobs(&h, &t(tgt), 5, false).unwrap();
        let spans = inputs
            .iter()
            .enumerate()
            .map(|(i, s)| (i * w + w - s.len(), s.len()))
            .collect();
        (lp.flatten_all().unwrap(), spans)
    };
    let weights = floats(&r["loss_weights"]);
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
    (
        loss,
        spans.iter().map(|&(a, l)| all[a..a + l].to_vec()).collect(),
    )
}

/// PyTorch's parameter name under this model's variable names (the hub's layout).
fn hub_name(pname: &str) -> String {
    match (
        pname.strip_prefix("model.visual."),
        pname.strip_prefix("model.language_model."),
    ) {
        (Some(rest), _) => format!("visual.{rest}"),
        (_, Some(rest)) => format!("model.{rest}"),
        _ => pname.to_string(),
    }
}

#[test]
fn training_forward_and_gradients_equal_pytorch_in_f64() {
    for name in NAMES {
        let r = reference(name);
        let want_lp = floats(&r["token_logprobs"]);
        let grads =
            candle_core::safetensors::load(dir(name).join("grads.safetensors"), &Device::Cpu)
                .unwrap();
        let mut loaded = load(name, DType::F64);
        let (mut worst_lp, mut worst_grad) = (0f64, 0f64);
        for e in EXEC_PATHS {
            for packed in [false, true] {
                loaded.model.set_exec(e);
                let case = format!("{name} {e:?} packed {packed}");
                let (loss, lps) = loss_and_logprobs(&loaded.model, name, &r, packed);
                for (i, (got, want)) in lps.iter().zip(&want_lp).enumerate() {
                    for (t, (g, w)) in got.iter().zip(want).enumerate() {
                        worst_lp = worst_lp.max((g - w).abs());
                        assert!(
                            (g - w).abs() <= 1e-12 * w.abs().max(1.0),
                            "{case}: row {i} token {t}: {g} vs {w}"
                        );
                    }
                }
                let l: f64 = loss.to_scalar().unwrap();
                let wl = r["loss"].as_f64().unwrap();
                assert!(
                    (l - wl).abs() <= 1e-11 * wl.abs().max(1.0),
                    "{case}: loss {l} vs {wl}"
                );
                let g = loss.backward().unwrap();
                let vars = loaded.varmap.data().lock().unwrap();
                let names = r["parameters"].as_array().unwrap();
                for pname in names {
                    let pname = pname.as_str().unwrap();
                    let var = vars
                        .get(&hub_name(pname))
                        .unwrap_or_else(|| panic!("{case}: no variable for `{pname}`"));
                    let got = g
                        .get(var.as_tensor())
                        .unwrap_or_else(|| panic!("{case}: no gradient for `{pname}`"));
                    let (w, scale) = worst(got, &grads[pname]);
                    worst_grad = worst_grad.max(w / scale);
                    assert!(
                        w <= 1e-11 * scale,
                        "{case}: ∂L/∂{pname} off by {w:.3e} (largest {scale:.3e})"
                    );
                }
                assert_eq!(
                    vars.len(),
                    names.len(),
                    "{case}: variables {:?}",
                    vars.keys().collect::<Vec<_>>()
                );
            }
        }
        eprintln!("{name}: log-probs within {worst_lp:.1e}, gradients within {worst_grad:.1e} of scale of PyTorch's");
    }
}

/// The training forward in f32 against PyTorch's f64 log-probs: within f32 rounding, 1e-4
/// relative (5e-4 for the Qwen3.5 hybrids, whose DeltaNet recurrences and experts carry it
/// further: PyTorch's own f32 is ~3e-4 off its f64 there, see `family_tests`).
#[test]
fn training_in_f32_stays_near_f64() {
    for name in NAMES {
        let r = reference(name);
        let want_lp = floats(&r["token_logprobs"]);
        let m = load(name, DType::F32).model;
        let tol = match m.args.arch.hybrid() {
            true => 5e-4,
            false => 1e-4,
        };
        for packed in [false, true] {
            let (_, lps) = loss_and_logprobs(&m, name, &r, packed);
            for (got, want) in lps.iter().zip(&want_lp) {
                for (g, w) in got.iter().zip(want) {
                    assert!(
                        (g - w).abs() <= tol * w.abs().max(1.0),
                        "{name} f32: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// Saved as an HF folder (what checkpoints and the HF export write), a vision-language model
/// holds every tensor transformers wrote under the same names (the hub's `model.*` and
/// `visual.*`), bit for bit; its config is transformers 5's nested layout and reads back as
/// the same arguments; the processor's files travel with the tokenizer's.
#[test]
fn a_saved_vision_language_model_reads_back() {
    for name in NAMES {
        let loaded = load(name, DType::F64);
        let tmp = tempfile::tempdir().unwrap();
        let src = tempfile::tempdir().unwrap();
        std::fs::write(
            src.path().join("preprocessor_config.json"),
            "{\"patch_size\": 4}",
        )
        .unwrap();
        let args = &loaded.model.args;
        crate::weights::hf::save_dir(
            &loaded.varmap,
            args,
            tmp.path(),
            &[],
            Some(src.path()),
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
        let text = std::fs::read_to_string(tmp.path().join("config.json")).unwrap();
        let cfg: Value = serde_json::from_str(&text).unwrap();
        let orig: Value =
            serde_json::from_str(&std::fs::read_to_string(dir(name).join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["architectures"], orig["architectures"]);
        assert_eq!(cfg["vision_config"], orig["vision_config"]);
        assert_eq!(
            cfg["text_config"]["rope_parameters"]["mrope_section"],
            orig["text_config"]["rope_parameters"]["mrope_section"]
        );
        assert_eq!(cfg["image_token_id"], orig["image_token_id"]);
        assert_eq!(
            &crate::model::ModelArgs::from_hf(&cfg).unwrap(),
            args,
            "{name}"
        );
        assert!(tmp.path().join("preprocessor_config.json").is_file());
    }
}

/// The hub's Qwen2.5-VL checkpoints keep the text settings at the top of config.json with
/// `rope_scaling: {type: mrope, mrope_section}`; transformers 5 nests them in `text_config` and
/// names the weights `model.language_model.*` / `model.visual.*` in memory. All three read as
/// the same model.
#[test]
fn hub_and_transformers_layouts_read_alike() {
    let name = "qwen2_5_vl";
    let nested: Value =
        serde_json::from_str(&std::fs::read_to_string(dir(name).join("config.json")).unwrap())
            .unwrap();
    let mut flat = nested.clone();
    let o = flat.as_object_mut().unwrap();
    let text = o.remove("text_config").unwrap();
    for (k, v) in text.as_object().unwrap() {
        if k != "rope_parameters" && k != "model_type" {
            o.insert(k.clone(), v.clone());
        }
    }
    o.insert("rope_theta".into(), 10000.0.into());
    o.insert(
        "rope_scaling".into(),
        serde_json::json!({"type": "mrope", "mrope_section": [2, 3, 3]}),
    );
    let a = crate::model::ModelArgs::from_hf(&nested).unwrap();
    let b = crate::model::ModelArgs::from_hf(&flat).unwrap();
    assert_eq!(a, b);
    // transformers 5's in-memory names load as the same variables.
    let tensors =
        candle_core::safetensors::load(dir(name).join("model.safetensors"), &Device::Cpu).unwrap();
    let renamed: std::collections::HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| {
            let n = match (n.strip_prefix("visual."), n.strip_prefix("model.")) {
                (Some(r), _) => format!("model.visual.{r}"),
                (_, Some(r)) => format!("model.language_model.{r}"),
                _ => n.clone(),
            };
            (n, t.clone())
        })
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    candle_core::safetensors::save(&renamed, tmp.path().join("model.safetensors")).unwrap();
    std::fs::write(tmp.path().join("config.json"), flat.to_string()).unwrap();
    let again = crate::weights::hf::load_dir(
        tmp.path(),
        &Default::default(),
        DType::F64,
        &Device::Cpu,
        true,
    )
    .unwrap();
    let orig = load(name, DType::F64);
    let (x, y) = (
        orig.varmap.data().lock().unwrap(),
        again.varmap.data().lock().unwrap(),
    );
    assert_eq!(x.len(), y.len());
    for (n, v) in x.iter() {
        let w = y.get(n).unwrap_or_else(|| panic!("no `{n}`"));
        let (d, _) = worst(v.as_tensor(), w.as_tensor());
        assert_eq!(d, 0.0, "{n}");
    }
}

/// Settings the model cannot run without are refused naming the key.
#[test]
fn broken_vision_settings_are_refused_by_key() {
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(dir("qwen2_5_vl").join("config.json")).unwrap(),
    )
    .unwrap();
    let refused = |edit: &dyn Fn(&mut Value), key: &str| {
        let mut c = cfg.clone();
        edit(&mut c);
        let e = crate::model::ModelArgs::from_hf(&c).unwrap_err();
        assert!(e.contains(key), "{key}: {e}");
    };
    refused(
        &|c| c["text_config"]["rope_parameters"]["mrope_section"] = serde_json::json!([2, 3, 4]),
        "mrope_section",
    );
    refused(
        &|c| c["text_config"]["rope_parameters"]["mrope_section"] = serde_json::json!([4, 4]),
        "mrope_section",
    );
    refused(
        &|c| {
            drop(
                c["text_config"]["rope_parameters"]
                    .as_object_mut()
                    .unwrap()
                    .remove("mrope_section"),
            )
        },
        "mrope_section",
    );
    refused(
        &|c| c["vision_config"]["out_hidden_size"] = 32.into(),
        "out_hidden_size",
    );
    refused(
        &|c| c["vision_config"]["hidden_act"] = "gelu".into(),
        "vision_config.hidden_act",
    );
    refused(
        &|c| c["vision_config"]["fullatt_block_indexes"] = serde_json::json!([3]),
        "fullatt_block_indexes",
    );
    refused(
        &|c| c["vision_config"]["patch_size"] = 0.into(),
        "vision_config.patch_size",
    );
    refused(
        &|c| c["vision_config"]["num_heads"] = 3.into(),
        "vision_config.num_heads",
    );
    refused(&|c| c["image_token_id"] = "x".into(), "image_token_id");
    refused(
        &|c| drop(c.as_object_mut().unwrap().remove("vision_config")),
        "vision_config",
    );
    // A tower tensor the layout does not use is weights left out: refused by name.
    let mut tensors =
        candle_core::safetensors::load(dir("qwen2_5_vl").join("model.safetensors"), &Device::Cpu)
            .unwrap();
    tensors.insert(
        "visual.blocks.3.norm1.weight".into(),
        Tensor::ones(32, DType::F64, &Device::Cpu).unwrap(),
    );
    let tmp = tempfile::tempdir().unwrap();
    candle_core::safetensors::save(&tensors, tmp.path().join("model.safetensors")).unwrap();
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let e = crate::weights::hf::load_dir(
        tmp.path(),
        &Default::default(),
        DType::F64,
        &Device::Cpu,
        true,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("visual.blocks.3.norm1.weight"), "{e}");
}

/// The fixture's sequences as prompts with their images (a group of two rows sharing the first
/// prompt's images, as a GRPO group does), generated greedily by the scheduler: transformers'
/// tokens, log-probs within the rollout's f32 rounding, in one wave or one row per wave.
#[test]
fn greedy_generation_with_images_equals_transformers() {
    use crate::model::vision::Images;
    use crate::rollout::scheduler::generate_turns;
    use crate::rollout::{Limits, Sampler, SamplingParams};
    use std::sync::Arc;
    for name in NAMES {
        let r = reference(name);
        let m = load(name, DType::F64).model;
        let g = grids(&r);
        let seqs = ids(&r["sequences"]);
        let ims: Vec<Option<Arc<Images>>> = images_of(&r)
            .iter()
            .map(|w| {
                (!w.is_empty()).then(|| {
                    let px: Vec<Tensor> = w.iter().map(|&i| pixels(name, i)).collect();
                    Arc::new(Images {
                        pixels: Tensor::cat(&px, 0).unwrap(),
                        grids: w.iter().map(|&i| g[i]).collect(),
                    })
                })
            })
            .collect();
        // Rows: 0, 0 (same images), 1, 2.
        let order = [0usize, 0, 1, 2];
        let prompts: Vec<&[u32]> = order.iter().map(|&i| seqs[i].as_slice()).collect();
        let images: Vec<Option<Arc<Images>>> = order.iter().map(|&i| ims[i].clone()).collect();
        let n = r["greedy"][0].as_array().unwrap().len();
        for max_num_seqs in [4, 1] {
            let p = SamplingParams {
                greedy: true,
                temperature: 0.0,
                top_k: None,
                top_p: 1.0,
                max_new_tokens: n,
                eos_ids: vec![],
                ignore_eos: true,
                limits: Limits {
                    max_num_seqs,
                    ..Limits::default()
                },
            };
            let streams = Sampler::new(0).rows();
            let (out, _) = generate_turns(&m, &prompts, &p, streams, None, None, &images).unwrap();
            for (row, &i) in order.iter().enumerate() {
                for (t, w) in r["greedy"][i].as_array().unwrap().iter().enumerate() {
                    assert_eq!(
                        out.responses[row][t] as u64,
                        w["token"].as_u64().unwrap(),
                        "{name} row {row} step {t}"
                    );
                    let lp = w["logprob"].as_f64().unwrap();
                    assert!(
                        (f64::from(out.log_probs[row][t]) - lp).abs() <= 1e-6,
                        "{name} row {row} step {t}"
                    );
                }
            }
        }
        // A prompt whose placeholders have no images is refused naming the row.
        let e = generate_turns(
            &m,
            &prompts[..1],
            &SamplingParams {
                max_new_tokens: 1,
                ..SamplingParams::validation(&Default::default(), 1, &[])
            },
            Sampler::new(0).rows(),
            None,
            None,
            &[None],
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("placeholder"), "{e}");
    }
}

/// Padded micro-batch inputs `mi` of the fixture's sequences `order` (reference `r`): every
/// real token (the mask's 1s) at transformers' 3-D position in the whole sequence, the
/// response's included (a shorter response's last token too).
fn assert_positions_are_transformers(
    mi: &crate::trainer::micro::MicroInputs,
    order: &[usize],
    r: &Value,
) {
    let crate::trainer::micro::Tokens::Padded { key_mask, .. } = &mi.tokens else {
        return;
    };
    let mask: Vec<Vec<u32>> = key_mask.to_vec2().unwrap();
    let pos: Vec<Vec<Vec<u32>>> = mi.position_ids.to_vec3().unwrap();
    for (row, &i) in order.iter().enumerate() {
        let want = ids(&r["positions"][i]["positions"]);
        let real: Vec<usize> = (0..mask[row].len())
            .filter(|&k| mask[row][k] == 1)
            .collect();
        for axis in 0..3 {
            let got: Vec<u32> = real.iter().map(|&k| pos[axis][row][k]).collect();
            assert_eq!(got, want[axis][..real.len()], "row {row} axis {axis}");
        }
    }
}

/// The trainer's micro-batch inputs of rows with images (a prompt holding its images, the
/// response after it), padded and packed, and with shared prompts asked for (which rows with
/// images run without): the response tokens' log-probs equal transformers' at the same
/// positions of the whole sequence, so the responses' 3-D positions (prompt length + index +
/// delta) are transformers'.
#[test]
fn trainer_inputs_with_images_give_transformers_log_probs() {
    use crate::trainer::batch::{RowImages, StepBatch};
    use crate::trainer::micro::Layout;
    use std::sync::Arc;
    let name = "qwen2_5_vl";
    let r = reference(name);
    let m = load(name, DType::F64).model;
    let v = m.args.vision.clone().unwrap();
    let g = grids(&r);
    let seqs = ids(&r["sequences"]);
    let want = floats(&r["token_logprobs"]);
    let cut = [30, 26, 5];
    let mut images = Vec::new();
    for (seq, which) in seqs.iter().zip(images_of(&r)) {
        images.push((!which.is_empty()).then(|| {
            let px: Vec<Tensor> = which.iter().map(|&i| pixels(name, i)).collect();
            let grids: Vec<[usize; 3]> = which.iter().map(|&i| g[i]).collect();
            let prompt = &seq[..cut[images.len()]];
            let (pos, delta) =
                mrope_positions(prompt, v.image_token_id, &grids, v.spatial_merge_size).unwrap();
            RowImages {
                images: Arc::new(crate::model::vision::Images {
                    pixels: Tensor::cat(&px, 0).unwrap(),
                    grids,
                }),
                positions: Arc::new(pos),
                delta,
            }
        }));
    }
    // Rows: 0, 0 (a group), 1, 2.
    let order = [0usize, 0, 1, 2];
    let mut b = StepBatch::new(
        order.iter().map(|&i| seqs[i][..cut[i]].to_vec()).collect(),
        order.iter().map(|&i| seqs[i][cut[i]..].to_vec()).collect(),
        order.to_vec(),
        vec![0, 0, 1, 2],
        vec![false; 4],
    );
    b.images = order.iter().map(|&i| images[i].clone()).collect();
    let base = Layout {
        pad_id: 0,
        packed: false,
        share_prefixes: false,
        image_token: None,
    }
    .for_model(&m.args);
    for layout in [
        base,
        Layout {
            packed: true,
            ..base
        },
        Layout {
            packed: true,
            ..base
        }
        .sharing(true),
    ] {
        let mi = b.inputs(&[0, 1, 2, 3], layout, &Device::Cpu).unwrap();
        assert_eq!(mi.position_ids.dim(0).unwrap(), 3, "{layout:?}");
        assert_positions_are_transformers(&mi, &order, &r);
        let h = mi.response_hidden(&m).unwrap();
        let (lp, _) = m
            .token_logprobs(&h, mi.response_targets(), 5, false)
            .unwrap();
        let lp: Vec<Vec<f64>> = mi.to_rows(&lp).unwrap().to_vec2().unwrap();
        for (row, &i) in order.iter().enumerate() {
            for j in 0..seqs[i].len() - cut[i] {
                let w = want[i][cut[i] + j - 1];
                assert!(
                    (lp[row][j] - w).abs() <= 1e-12,
                    "{layout:?} row {row} token {j}: {} vs {w}",
                    lp[row][j]
                );
            }
        }
    }
    // A response holding a placeholder token the model sampled is a token like any other:
    // the features go to the prompt's placeholders only (transformers would count it as one
    // more image). The response's first token depends on the prompt alone: transformers'.
    let mut sampled = b.select(&[0, 2]);
    sampled.responses[0][1] = v.image_token_id;
    sampled.images = vec![images[0].clone(), images[1].clone()];
    for layout in [
        base,
        Layout {
            packed: true,
            ..base
        },
    ] {
        let mi = sampled.inputs(&[0, 1], layout, &Device::Cpu).unwrap();
        let h = mi.response_hidden(&m).unwrap();
        let (lp, _) = m
            .token_logprobs(&h, mi.response_targets(), 5, false)
            .unwrap();
        let lp: Vec<Vec<f64>> = mi.to_rows(&lp).unwrap().to_vec2().unwrap();
        let w = want[0][cut[0] - 1];
        assert!(
            (lp[0][0] - w).abs() <= 1e-12,
            "{layout:?}: {} vs {w}",
            lp[0][0]
        );
        for j in 0..seqs[1].len() - cut[1] {
            let w = want[1][cut[1] + j - 1];
            assert!((lp[1][j] - w).abs() <= 1e-12, "{layout:?} row 1 token {j}");
        }
    }
    // A row whose prompt holds placeholders but whose images are missing is refused by row.
    b.images[2] = None;
    let e = b
        .inputs(&[0, 2], base, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("batch row 2") && e.contains("no images"), "{e}");
}

/// The chat fixture (`<name>/chat/`: the tiny model over the byte-level tokenizer with the
/// vision tokens, a ChatML template writing each image item as
/// `<|vision_start|><|image_pad|><|vision_end|>`, a preprocessor sized for the tower) read as
/// verl's geo3k parquet (images as {bytes, path} structs, `<image>` markers in the prompt):
/// the dataset's prompt ids and pixel values equal what transformers' Qwen2_5_VLProcessor
/// gives after qwen-vl-utils' fetch_image (verl's path), and greedy generation from the
/// dataset rows gives transformers' tokens.
#[test]
fn a_geo3k_layout_dataset_tokenizes_and_generates_like_transformers() {
    use crate::config::DataConfig;
    use crate::data::dataset::{load_samples, DatasetOptions, PromptDataset};
    use crate::data::image::ImageProcessorConfig;
    use crate::data::vision::VisionOptions;
    use crate::data::TokenizerBundle;
    use crate::rollout::{generate_rows, Limits, Sampler, SamplingParams};
    let chat = dir("qwen2_5_vl").join("chat");
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(chat.join("reference.json")).unwrap())
            .unwrap();
    let tok = TokenizerBundle::from_dir(&chat).unwrap();
    let template = tok.template(None).unwrap();
    let opts = DatasetOptions {
        vision: Some(VisionOptions {
            image_key: "images".into(),
            video_key: "videos".into(),
            processor: ImageProcessorConfig::from_model_dir(&chat).unwrap(),
            image_patch_size: 4,
            base_dir: None,
        }),
        ..DatasetOptions::train(
            &DataConfig {
                shuffle: false,
                ..DataConfig::default()
            },
            512,
        )
    };
    let file = chat.join("geo3k_layout.parquet").display().to_string();
    let samples = load_samples(&[file], &opts).unwrap();
    let ds = PromptDataset::build(samples, &tok, &template, &opts).unwrap();
    let answers = r["answers"].as_array().unwrap();
    for (i, a) in answers.iter().enumerate() {
        let want: Vec<u32> = a["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ds.prompt_ids[i], want, "prompt {i}");
        let grids = ids(&a["image_grid_thw"]);
        match ds.images[i].as_ref() {
            None => assert!(grids.is_empty(), "prompt {i}"),
            Some(b) => {
                let g: Vec<Vec<u32>> = b
                    .grid_thw
                    .iter()
                    .map(|g| g.iter().map(|&x| x as u32).collect())
                    .collect();
                assert_eq!(g, grids, "prompt {i}");
                let f = chat.join(format!("pixel_values_{i}.safetensors"));
                let want = candle_core::safetensors::load(f, &Device::Cpu).unwrap();
                let want: Vec<f32> = want["pixel_values"]
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert_eq!(b.pixel_values, want, "prompt {i}: pixel values");
            }
        }
    }
    let m =
        crate::weights::hf::load_dir(&chat, &Default::default(), DType::F64, &Device::Cpu, true)
            .unwrap()
            .model;
    let p = SamplingParams {
        greedy: true,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: 6,
        eos_ids: vec![],
        ignore_eos: true,
        limits: Limits::default(),
    };
    let out = generate_rows(&m, &ds, &[0, 1, 2, 0], &p, &mut Sampler::new(0)).unwrap();
    for (row, i) in [0usize, 1, 2, 0].into_iter().enumerate() {
        for (t, w) in answers[i]["greedy"].as_array().unwrap().iter().enumerate() {
            assert_eq!(
                out.responses[row][t] as u64,
                w["token"].as_u64().unwrap(),
                "row {row} step {t}"
            );
            let lp = w["logprob"].as_f64().unwrap();
            assert!(
                (f64::from(out.log_probs[row][t]) - lp).abs() <= 1e-6,
                "row {row} step {t}"
            );
        }
    }
}

/// Rows a vision-language dataset cannot use are refused naming the file, the row and the
/// column: a missing image file (named), undecodable bytes, markers and images that disagree
/// in number, a row with videos, a prompt whose image tokens pass the prompt budget; a text
/// model refuses rows with images.
#[test]
fn bad_image_rows_are_refused_by_row_and_column() {
    use crate::config::DataConfig;
    use crate::data::dataset::{load_samples, DatasetOptions, PromptDataset};
    use crate::data::image::ImageProcessorConfig;
    use crate::data::vision::VisionOptions;
    use crate::data::TokenizerBundle;
    let chat = dir("qwen2_5_vl").join("chat");
    let tok = TokenizerBundle::from_dir(&chat).unwrap();
    let template = tok.template(None).unwrap();
    let vision = VisionOptions {
        image_key: "images".into(),
        video_key: "videos".into(),
        processor: ImageProcessorConfig::from_model_dir(&chat).unwrap(),
        image_patch_size: 4,
        base_dir: None,
    };
    let base = DatasetOptions::train(
        &DataConfig {
            shuffle: false,
            ..DataConfig::default()
        },
        512,
    );
    let tmp = tempfile::tempdir().unwrap();
    let png = chat.join("image_0.png").display().to_string();
    let row = |content: &str, images: Value| {
        serde_json::json!({
            "data_source": "x", "prompt": [{"role": "user", "content": content}],
            "images": images, "reward_model": {"ground_truth": "1"}
        })
    };
    let build = |rows: Vec<Value>, opts: &DatasetOptions| -> String {
        let f = tmp.path().join("rows.jsonl");
        let text: Vec<String> = rows.iter().map(Value::to_string).collect();
        std::fs::write(&f, text.join("\n")).unwrap();
        let samples = load_samples(&[f.display().to_string()], opts).unwrap();
        PromptDataset::build(samples, &tok, &template, opts)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let good = row("<image>ok", serde_json::json!([{"path": png}]));
    let with_vision = DatasetOptions {
        vision: Some(vision),
        ..base.clone()
    };
    for (bad, want) in [
        (
            row("<image>x", serde_json::json!([{"path": "/no/such.png"}])),
            "image file /no/such.png not found",
        ),
        (
            row("<image>x", serde_json::json!([{"bytes": "00ff00"}])),
            "image 0",
        ),
        (
            row("<image><image>x", serde_json::json!([{"path": png}])),
            "2 <image> marker(s) but the row has 1",
        ),
        (
            row("x", serde_json::json!([{"path": png}])),
            "0 <image> marker(s) but the row has 1",
        ),
        (
            row("<image>x", serde_json::json!([])),
            "has an <image> marker but the row has no images",
        ),
    ] {
        let e = build(vec![good.clone(), bad], &with_vision);
        assert!(e.contains("row 1") && e.contains(want), "{want}: {e}");
    }
    let mut video = good.clone();
    video["videos"] = serde_json::json!(["v.mp4"]);
    let e = build(vec![video], &with_vision);
    assert!(
        e.contains("column `videos`") && e.contains("video input is not supported"),
        "{e}"
    );
    let small = DatasetOptions {
        max_prompt_length: 40,
        ..with_vision.clone()
    };
    let e = build(vec![good.clone()], &small);
    assert!(
        e.contains("cannot be truncated") && e.contains("row 0"),
        "{e}"
    );
    let e = build(vec![good], &base);
    assert!(
        e.contains("column `images`") && e.contains("text model"),
        "{e}"
    );
}

/// Qwen3-VL-MoE's hub checkpoints hold each expert transposed (`gate_up_proj`
/// `[experts, hidden, 2·inter]`, `down_proj` `[experts, inter, hidden]`; transformers transposes
/// them on load): read so, the model's variables are those of transformers' own layout, bit
/// for bit.
#[test]
fn qwen3_vl_moe_hub_layout_of_the_experts_reads_alike() {
    let name = "qwen3_vl_moe";
    let tensors =
        candle_core::safetensors::load(dir(name).join("model.safetensors"), &Device::Cpu).unwrap();
    let hub: std::collections::HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| {
            match n.ends_with("mlp.experts.gate_up_proj") || n.ends_with("mlp.experts.down_proj") {
                true => (n.clone(), t.transpose(1, 2).unwrap().contiguous().unwrap()),
                false => (n.clone(), t.clone()),
            }
        })
        .collect();
    assert!(hub.keys().any(|n| n.ends_with("experts.gate_up_proj")));
    let tmp = tempfile::tempdir().unwrap();
    candle_core::safetensors::save(&hub, tmp.path().join("model.safetensors")).unwrap();
    std::fs::copy(
        dir(name).join("config.json"),
        tmp.path().join("config.json"),
    )
    .unwrap();
    let again = crate::weights::hf::load_dir(
        tmp.path(),
        &Default::default(),
        DType::F64,
        &Device::Cpu,
        true,
    )
    .unwrap();
    let orig = load(name, DType::F64);
    let (x, y) = (
        orig.varmap.data().lock().unwrap(),
        again.varmap.data().lock().unwrap(),
    );
    assert_eq!(x.len(), y.len());
    for (n, v) in x.iter() {
        let (d, _) = worst(v.as_tensor(), y[n].as_tensor());
        assert_eq!(d, 0.0, "{n}");
    }
}
