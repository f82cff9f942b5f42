//! Parity and gradient tests on tiny random models (built here, f32 and f64).

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

use super::*;

fn model(arch: Arch, dtype: DType) -> (VarMap, CausalLm) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
    let mut args = ModelArgs::tiny(arch, 61);
    args.tie_word_embeddings = arch == Arch::Llama;
    let m = CausalLm::new(&args, vb, true).unwrap();
    // Larger weights than the 0.02 init, so attention patterns and logits are far from uniform.
    for (name, var) in varmap.data().lock().unwrap().iter() {
        if !name.contains("layernorm") && !name.ends_with("norm.weight") {
            let t = var.as_tensor();
            var.set(
                &(Tensor::randn(0f32, 0.3, t.shape(), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()),
            )
            .unwrap();
        }
    }
    (varmap, m)
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
fn left_pad(prompts: &[Vec<u32>], pad: u32) -> (Tensor, Tensor, Tensor) {
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
fn incremental_decoding_matches_the_full_forward() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let (_vm, m) = model(arch, DType::F32);
        let prompts = vec![vec![5, 9, 2, 33, 7], vec![11, 4]];
        let cont = [vec![8u32, 1, 40], vec![3, 3, 59]];
        let (pi, pm, pp) = left_pad(&prompts, 0);
        let w = 5;
        // Full forward over prompt + continuation.
        let full_ids: Vec<Vec<u32>> = (0..2)
            .map(|r| {
                [
                    pi.get(r).unwrap().to_vec1::<u32>().unwrap(),
                    cont[r].clone(),
                ]
                .concat()
            })
            .collect();
        let full_mask: Vec<Vec<u32>> = (0..2)
            .map(|r| [pm.get(r).unwrap().to_vec1::<u32>().unwrap(), vec![1; 3]].concat())
            .collect();
        let full_pos: Vec<Vec<u32>> = (0..2)
            .map(|r| {
                let base = prompts[r].len() as u32;
                [
                    pp.get(r).unwrap().to_vec1::<u32>().unwrap(),
                    vec![base, base + 1, base + 2],
                ]
                .concat()
            })
            .collect();
        let h = m
            .forward_hidden(&ids(&full_ids), &ids(&full_pos), &ids(&full_mask), None)
            .unwrap();
        let full_logits = m.logits(&h).unwrap(); // [2, 8, V]
                                                 // Prefill the prompt, then decode one token at a time.
        let mut cache = KvCache::new(m.args.num_hidden_layers);
        let h = m.forward_hidden(&pi, &pp, &pm, Some(&mut cache)).unwrap();
        let pre = m.logits(&h).unwrap();
        // Real prompt positions only (padded query positions attend nothing and are ignored).
        assert!(
            max_diff(
                &pre.get(0).unwrap(),
                &full_logits.get(0).unwrap().narrow(0, 0, w).unwrap()
            ) < 1e-4,
            "{arch:?} prefill row 0"
        );
        assert!(
            max_diff(
                &pre.get(1).unwrap().narrow(0, 3, 2).unwrap(),
                &full_logits.get(1).unwrap().narrow(0, 3, 2).unwrap()
            ) < 1e-4,
            "{arch:?} prefill row 1"
        );
        for step in 0..3 {
            let tok = ids(&[vec![cont[0][step]], vec![cont[1][step]]]);
            let pos = ids(&[
                vec![prompts[0].len() as u32 + step as u32],
                vec![prompts[1].len() as u32 + step as u32],
            ]);
            let mask = ids(&(0..2)
                .map(|r| full_mask[r][..w + step + 1].to_vec())
                .collect::<Vec<_>>());
            let h = m
                .forward_hidden(&tok, &pos, &mask, Some(&mut cache))
                .unwrap();
            let step_logits = m.logits(&h).unwrap();
            let d = max_diff(&step_logits, &full_logits.narrow(1, w + step, 1).unwrap());
            assert!(d < 1e-4, "{arch:?} step {step}: {d}");
        }
        assert_eq!(cache.len(), w + 3);
    }
}

#[test]
fn a_left_padded_row_matches_the_unpadded_row() {
    let (_vm, m) = model(Arch::Llama, DType::F32);
    let row = vec![7u32, 3, 9, 12, 5, 30];
    let alone = m
        .forward_hidden(
            &ids(std::slice::from_ref(&row)),
            &ids(&[(0..6).collect()]),
            &ids(&[vec![1; 6]]),
            None,
        )
        .unwrap();
    let (lp_alone, ent_alone) = m
        .token_logprobs(&alone, &ids(&[vec![3, 9, 12, 5, 30, 1]]), 4, true)
        .unwrap();
    let (pi, pm, pp) = left_pad(&[row.clone(), vec![1, 2, 3, 4, 5, 6, 7, 8, 9]], 0);
    let padded = m.forward_hidden(&pi, &pp, &pm, None).unwrap();
    let (lp_pad, ent_pad) = m
        .token_logprobs(
            &padded,
            &ids(&[vec![0, 0, 0, 3, 9, 12, 5, 30, 1], vec![0; 9]]),
            5,
            true,
        )
        .unwrap();
    let a = lp_alone.get(0).unwrap();
    let b = lp_pad.get(0).unwrap().narrow(0, 3, 6).unwrap();
    assert!(
        max_diff(&a, &b) < 1e-4,
        "log-probs differ: {}",
        max_diff(&a, &b)
    );
    let ea = ent_alone.unwrap().get(0).unwrap();
    let eb = ent_pad.unwrap().get(0).unwrap().narrow(0, 3, 6).unwrap();
    assert!(max_diff(&ea, &eb) < 1e-4);
}

#[test]
fn chunked_logprobs_equal_the_full_log_softmax() {
    let (_vm, m) = model(Arch::Qwen2, DType::F32);
    let x = ids(&[vec![1, 2, 3, 4], vec![5, 6, 7, 8]]);
    let h = m
        .forward_hidden(
            &x,
            &ids(&[vec![0, 1, 2, 3], vec![0, 1, 2, 3]]),
            &ids(&[vec![1; 4], vec![1; 4]]),
            None,
        )
        .unwrap();
    let tgt = ids(&[vec![2, 3, 4, 9], vec![6, 7, 8, 0]]);
    let (lp3, ent3) = m.token_logprobs(&h, &tgt, 3, true).unwrap();
    let logits = m.logits(&h).unwrap();
    let lsm = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1).unwrap();
    let want = lsm
        .gather(&tgt.unsqueeze(2).unwrap(), 2)
        .unwrap()
        .squeeze(2)
        .unwrap();
    assert!(max_diff(&lp3, &want) < 1e-5);
    let ent = crate::algo::entropy_from_logits(&logits.reshape((8, 61)).unwrap())
        .unwrap()
        .reshape((2, 4))
        .unwrap();
    assert!(
        max_diff(&ent3.unwrap(), &ent) < 1e-5,
        "agrees with algo::entropy_from_logits"
    );
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let (vm, m) = model(arch, DType::F32);
        let (pi, pm, pp) = left_pad(&[vec![4, 8, 15, 16, 23, 42], vec![1, 2, 3]], 0);
        let h = m.forward_hidden(&pi, &pp, &pm, None).unwrap();
        let (lp, _) = m
            .token_logprobs(
                &h,
                &ids(&[vec![8, 15, 16, 23, 42, 1], vec![0, 0, 0, 2, 3, 4]]),
                5,
                false,
            )
            .unwrap();
        let loss = lp.sum_all().unwrap().neg().unwrap();
        let grads = loss.backward().unwrap();
        let data = vm.data().lock().unwrap();
        assert!(!data.is_empty());
        for (name, var) in data.iter() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{arch:?}: no gradient for {name}"));
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(norm > 0.0, "{arch:?}: zero gradient for {name}");
        }
    }
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    let (vm, m) = model(Arch::Qwen2, DType::F64);
    let (pi, pm, pp) = left_pad(&[vec![4, 8, 15, 16], vec![23, 42]], 0);
    let tgt = ids(&[vec![8, 15, 16, 1], vec![0, 0, 42, 7]]);
    let loss_of = |m: &CausalLm| -> Tensor {
        let h = m.forward_hidden(&pi, &pp, &pm, None).unwrap();
        let (lp, ent) = m.token_logprobs(&h, &tgt, 3, true).unwrap();
        // Masked like a response: the padded positions of row 1 do not count.
        let mask = Tensor::new(&[[1f64, 1., 1., 1.], [0., 0., 1., 1.]], &Device::Cpu).unwrap();
        ((lp * &mask).unwrap().sum_all().unwrap()
            + (ent.unwrap() * &mask).unwrap().sum_all().unwrap() * 0.1)
            .unwrap()
    };
    let grads = loss_of(&m).backward().unwrap();
    let vars: Vec<(String, Var)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let eps = 1e-5;
    for (name, var) in vars.iter().filter(|(n, _)| {
        n.contains("layers.1") || n.contains("embed") || n.ends_with("norm.weight")
    }) {
        let g = grads
            .get(var.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let base = var
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        // Three elements spread over the tensor.
        for &i in &[0, base.len() / 2, base.len() - 1] {
            let mut up = base.clone();
            up[i] += eps;
            var.set(&Tensor::from_vec(up, var.as_tensor().shape(), &Device::Cpu).unwrap())
                .unwrap();
            let lu = loss_of(&m).to_scalar::<f64>().unwrap();
            let mut down = base.clone();
            down[i] -= eps;
            var.set(&Tensor::from_vec(down, var.as_tensor().shape(), &Device::Cpu).unwrap())
                .unwrap();
            let ld = loss_of(&m).to_scalar::<f64>().unwrap();
            var.set(
                &Tensor::from_vec(base.clone(), var.as_tensor().shape(), &Device::Cpu).unwrap(),
            )
            .unwrap();
            let fd = (lu - ld) / (2.0 * eps);
            assert!(
                (g[i] - fd).abs() < 1e-6 * (1.0 + fd.abs()),
                "{name}[{i}]: autograd {} vs finite difference {fd}",
                g[i]
            );
        }
    }
}

#[test]
fn save_and_load_round_trip_single_and_sharded() {
    for (arch, shard) in [(Arch::Llama, None), (Arch::Qwen2, Some(20_000usize))] {
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
        e.contains("mlp") && e.contains("[64, 32]") && e.contains("[48, 32]"),
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
