//! Parity and gradient tests on tiny random models (built here, f32 and f64).

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

use super::*;

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
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3] {
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

/// Σπ² of the model's head (`token_stats`), fused and composed, equals Σ softmax² of the full
/// logits (f64, 1e-12), the tempered logits included; log-probs and entropies are those of
/// `token_logprobs`.
#[test]
fn sum_pi_squared_of_the_head_equals_the_full_softmax() {
    let (_vm, m) = model(Arch::Qwen2, DType::F64);
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
    let stats = crate::model::HeadStats {
        entropy: true,
        sum_pi_squared: true,
    };
    let max_diff = |a: &Tensor, b: &Tensor| -> f64 {
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
        d.max(0).unwrap().to_scalar::<f64>().unwrap()
    };
    for scale in [1.0, 1.0 / 0.7, 25.0] {
        let h = (&h * scale).unwrap();
        let probs = candle_nn::ops::softmax_last_dim(&m.logits(&h).unwrap()).unwrap();
        let want = probs.sqr().unwrap().sum(candle_core::D::Minus1).unwrap(); // [2, 4]
        let fused = m.token_stats(&h, &tgt, 3, stats).unwrap();
        let composed = m.token_stats_composed(&h, &tgt, 3, stats).unwrap();
        for out in [&fused, &composed] {
            let got = out.sum_pi_squared.as_ref().unwrap();
            assert!(
                max_diff(got, &want) < 1e-12,
                "scale {scale}: {}",
                max_diff(got, &want)
            );
        }
        let (lp, ent) = m.token_logprobs(&h, &tgt, 3, true).unwrap();
        assert_eq!(max_diff(&lp, &fused.log_probs), 0.0);
        assert_eq!(
            max_diff(&ent.unwrap(), fused.entropy.as_ref().unwrap()),
            0.0
        );
    }
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3] {
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
fn value_and_score_heads() {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let args = ModelArgs::tiny(Arch::Llama, 40);
    let backbone = CausalLm::new(&args, vb.clone(), false).unwrap();
    assert!(
        backbone.output_weight().is_err(),
        "a critic backbone has no LM head"
    );
    let value = ValueHead::new(args.hidden_size, vb.clone()).unwrap();
    let score = ScoreHead::new(args.hidden_size, 1, vb.pp("rm")).unwrap();
    let (pi, pm, pp) = left_pad(&[vec![1, 2, 3, 4], vec![5, 6]], 0);
    let h = backbone.forward_hidden(&pi, &pp, &pm, None).unwrap();
    let v = value.forward(&h).unwrap();
    assert_eq!(v.dims(), &[2, 4]);
    // Every parameter of backbone + value head gets a gradient from a value loss.
    let grads = v.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    for (name, var) in vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .filter(|(n, _)| !n.starts_with("rm."))
    {
        assert!(
            grads.get(var.as_tensor()).is_some(),
            "no gradient for {name}"
        );
    }
    // The score is read at the last real token: for left padding the last position, and a row
    // scored alone gives the same value.
    let s = score.forward(&h, &pm).unwrap().to_vec2::<f32>().unwrap();
    let alone_h = backbone
        .forward_hidden(
            &ids(&[vec![5, 6]]),
            &ids(&[vec![0, 1]]),
            &ids(&[vec![1, 1]]),
            None,
        )
        .unwrap();
    let alone = score
        .forward(&alone_h, &ids(&[vec![1, 1]]))
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert!((s[1][0] - alone[0][0]).abs() < 1e-5);
    // Right padding: the last 1 of the mask.
    let rh = backbone
        .forward_hidden(
            &ids(&[vec![5, 6, 0, 0]]),
            &ids(&[vec![0, 1, 2, 3]]),
            &ids(&[vec![1, 1, 0, 0]]),
            None,
        )
        .unwrap();
    let r = score
        .forward(&rh, &ids(&[vec![1, 1, 0, 0]]))
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert!((r[0][0] - alone[0][0]).abs() < 1e-5);
}

#[test]
fn bf16_model_tracks_the_f32_model_and_trains() {
    // The same weights in f32 and bf16 (the CUDA working dtype); bf16 keeps 8 bits of mantissa,
    // so logits agree to about 2^-8 relative. Gradients flow to every bf16 parameter too.
    let (vm32, m32) = model(Arch::Qwen2, DType::F32);
    let vm16 = VarMap::new();
    let m16 = CausalLm::new(
        &m32.args,
        VarBuilder::from_varmap(&vm16, DType::BF16, &Device::Cpu),
        true,
    )
    .unwrap();
    {
        let src = vm32.data().lock().unwrap();
        for (name, var) in vm16.data().lock().unwrap().iter() {
            var.set(&src[name].as_tensor().to_dtype(DType::BF16).unwrap())
                .unwrap();
        }
    }
    let (i, mask, pos) = left_pad(&[vec![3, 7, 11, 2, 9], vec![5, 1, 8]], 0);
    let h32 = m32.forward_hidden(&i, &pos, &mask, None).unwrap();
    let h16 = m16.forward_hidden(&i, &pos, &mask, None).unwrap();
    let l32 = m32.logits(&h32).unwrap();
    let l16 = m16.logits(&h16).unwrap();
    assert_eq!(l16.dtype(), DType::F32, "logits are upcast");
    // Compare the real positions of the padded row (the padding's outputs are never read).
    let diff = max_diff(&l32.narrow(1, 2, 3).unwrap(), &l16.narrow(1, 2, 3).unwrap());
    let scale = l32
        .abs()
        .unwrap()
        .max_keepdim(2)
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        diff < 0.05 * scale.max(1.0),
        "bf16 vs f32 logits differ by {diff} (scale {scale})"
    );
    let (lp, _) = m16.token_logprobs(&h16, &i, 7, false).unwrap();
    let grads = lp.sum_all().unwrap().backward().unwrap();
    for (name, var) in vm16.data().lock().unwrap().iter() {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        assert_eq!(g.dtype(), DType::BF16, "{name}");
        let norm = g
            .to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(norm > 0.0, "{name}: zero gradient");
    }
}

/// Conflicting, unsupported or incomplete RoPE settings are refused with the key named.
#[test]
fn rope_settings_are_checked_by_name() {
    let base = ModelArgs::tiny(Arch::Llama, 61).to_hf();
    let err = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = base.clone();
        edit(&mut v);
        ModelArgs::from_hf(&v).unwrap_err()
    };
    let e = err(&|v| v["rope_parameters"]["rope_theta"] = serde_json::json!(5e5));
    assert!(
        e.contains("rope_theta (10000)") && e.contains("rope_parameters.rope_theta (500000)"),
        "{e}"
    );
    let e =
        err(&|v| v["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0}));
    // Yarn is read for DeepSeek-V3 and GPT-OSS only.
    assert!(
        e.contains("rope_type \"yarn\"") && e.contains("DeepseekV3 and GptOss only"),
        "{e}"
    );
    let e = err(&|v| v["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0}));
    assert!(e.contains("disagree"), "{e}");
    let e = err(&|v| {
        v.as_object_mut().unwrap().remove("rope_parameters");
        v["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0});
    });
    assert!(
        e.contains("rope_scaling.type \"dynamic\" is not supported"),
        "{e}"
    );
    let e = err(
        &|v| v["rope_parameters"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    );
    assert!(
        e.contains("rope_parameters.original_max_position_embeddings is missing"),
        "{e}"
    );
    let e = err(&|v| v["partial_rotary_factor"] = serde_json::json!(0.5));
    assert!(e.contains("partial_rotary_factor"), "{e}");
    let e = err(&|v| v["hidden_act"] = serde_json::json!("gelu"));
    assert!(e.contains("hidden_act"), "{e}");
}

/// Llama 3.1's RoPE scaling (theta 500000, head_dim 128, factor 8, low 1, high 4, original
/// context 8192). Expected values from a plain-Python transcription of transformers'
/// `_compute_llama3_parameters`, run for this test:
/// `f = 1/θ^(2i/d); w = 2π/f; f if w < 8192/4 else f/8 if w > 8192/1 else
/// (1−s)·f/8 + s·f with s = (8192/w − 1)/(4 − 1)`.
/// Index 1 is a high frequency (kept), 30 and 33 lie in the smoothed band, 40 and 63 are
/// divided by 8.
#[test]
fn llama3_scaled_inverse_frequencies() {
    let mut v = ModelArgs::tiny(Arch::Llama, 61).to_hf();
    let o = v.as_object_mut().unwrap();
    o.insert("hidden_size".into(), serde_json::json!(256));
    o.insert("num_attention_heads".into(), serde_json::json!(2));
    o.insert("num_key_value_heads".into(), serde_json::json!(1));
    o.insert("head_dim".into(), serde_json::json!(128));
    o.insert("rope_theta".into(), serde_json::json!(500000.0));
    // transformers 4 layout (rope_scaling with rope_type), no rope_parameters.
    o.remove("rope_parameters");
    o.insert(
        "rope_scaling".into(),
        serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    );
    let args = ModelArgs::from_hf(&v).unwrap();
    let inv = args.inv_freq();
    assert_eq!(inv.len(), 64);
    for (i, want) in [
        (0, 1.0),
        (1, 0.8146172338565447),
        (30, 0.0013718935677611381),
        (33, 0.00031269375038406517),
        (40, 3.428102195952591e-05),
        (63, 3.068925988914511e-07),
    ] {
        assert!(
            (inv[i] - want).abs() <= 1e-12 * want,
            "inv_freq[{i}] = {} vs {want}",
            inv[i]
        );
    }
    // The same settings in the transformers 5 layout read identically, and the saved config
    // (both layouts) reads back to the same arguments.
    let mut v5 = v.clone();
    let o = v5.as_object_mut().unwrap();
    o.remove("rope_theta");
    let mut p = o.remove("rope_scaling").unwrap();
    p["rope_theta"] = serde_json::json!(500000.0);
    o.insert("rope_parameters".into(), p);
    assert_eq!(ModelArgs::from_hf(&v5).unwrap(), args);
    assert_eq!(ModelArgs::from_hf(&args.to_hf()).unwrap(), args);
    assert_eq!(args.to_hf()["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(
        args.to_hf()["rope_parameters"]["original_max_position_embeddings"],
        8192
    );
}

/// RoPE tables are cos/sin of p·θ^(−2i/d) computed in f64 and rounded once to the model's
/// dtype: an f64 model holds the f64 values (f32 tables put ~1e-7 relative noise into each
/// layer, the 1e-5 f64 gap the PEFT check once measured), an f32 model their f32 rounding.
#[test]
fn rotary_tables_are_exact_in_the_model_dtype() {
    let positions: Vec<u32> = vec![0, 1, 7, 1000, 4095];
    let pos = Tensor::new(vec![positions.clone()], &Device::Cpu).unwrap();
    let mut f32_would_differ = false;
    for dtype in [DType::F64, DType::F32] {
        let (_vm, m) = model(Arch::Llama, dtype);
        let (cos, sin) = m.rotary(&pos, &m.inv_freq()).unwrap(); // [1, 1, 5, head_dim]
        let hd = m.args.head_dim;
        let cos: Vec<f64> = cos
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let sin: Vec<f64> = sin
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (j, &p) in positions.iter().enumerate() {
            for c in 0..hd {
                let i = c % (hd / 2);
                let a = p as f64 * (1.0 / m.args.rope_theta.powf(2.0 * i as f64 / hd as f64));
                let (want_c, want_s) = match dtype {
                    DType::F64 => (a.cos(), a.sin()),
                    _ => (a.cos() as f32 as f64, a.sin() as f32 as f64),
                };
                f32_would_differ |= a.cos() as f32 as f64 != a.cos();
                assert_eq!(
                    cos[j * hd + c],
                    want_c,
                    "{dtype:?} cos at position {p}, column {c}"
                );
                assert_eq!(
                    sin[j * hd + c],
                    want_s,
                    "{dtype:?} sin at position {p}, column {c}"
                );
            }
        }
    }
    assert!(
        f32_would_differ,
        "the case must tell f32 tables from f64 ones"
    );
}

/// Qwen3-MoE: each expert computed on the tokens routed to it gives the function of every
/// expert computed on every token with zero weight where not routed (the dense reference,
/// `Exec::dense_experts`): log-probs and every weight's gradient (router, experts, attention,
/// input side) within 1e-10 in f64, with and without recomputation.
#[test]
fn grouped_experts_equal_dense_experts() {
    let (vm, mut m) = model(Arch::Qwen3Moe, DType::F64);
    assert!(m.has_experts());
    let rows = vec![vec![5u32, 9, 2, 33, 7, 12], vec![11, 4, 60, 1]];
    let (ii, km, pp) = left_pad(&rows, 0);
    let run = |m: &CausalLm| {
        let h = m.forward_hidden(&ii, &pp, &km, None).unwrap();
        let (lp, _) = m.token_logprobs(&h, &ii, 4, false).unwrap();
        let loss = (lp * km.to_dtype(DType::F64).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let g = loss.backward().unwrap();
        let mut out: Vec<(String, Vec<f64>)> = vm
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(n, v)| {
                // An expert no token was routed to has no gradient on the grouped path (as in
                // PyTorch) and an exact zero on the dense one.
                let t = match g.get(v.as_tensor()) {
                    Some(t) => t.clone(),
                    None => v.as_tensor().zeros_like().unwrap(),
                };
                (n.clone(), t.flatten_all().unwrap().to_vec1().unwrap())
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        (loss.to_scalar::<f64>().unwrap(), out)
    };
    let (grouped_loss, grouped) = run(&m);
    assert!(grouped.iter().any(|(n, _)| n.ends_with("mlp.gate.weight")));
    for recompute in [false, true] {
        m.set_exec(Exec {
            dense_experts: true,
            recompute,
            ..Exec::default()
        });
        let (dense_loss, dense) = run(&m);
        assert!((grouped_loss - dense_loss).abs() <= 1e-10 * grouped_loss.abs());
        for ((name, a), (_, b)) in grouped.iter().zip(&dense) {
            let scale = a.iter().fold(1e-12f64, |s, x| s.max(x.abs()));
            let worst = a.iter().zip(b).fold(0f64, |s, (x, y)| s.max((x - y).abs()));
            assert!(
                worst <= 1e-10 * scale,
                "{name} recompute {recompute}: {worst:e}"
            );
        }
    }
}

/// The GPU path builds the rotary tables and the attention bias with tensor ops on the device;
/// run here on the CPU they equal the host-built ones: the bias exactly (padding, causality,
/// a past of 3 cached positions, a window of 2), the tables within one rounding of the model's
/// dtype (f64 angles on both sides; `cos`/`sin` of two libraries may differ in the last bit).
#[test]
fn device_built_tables_and_masks_equal_the_host_ones() {
    let (_vm, m) = model(Arch::Qwen2, DType::F32);
    let km: Vec<u32> = vec![0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1];
    let key_mask = Tensor::from_vec(km.clone(), (2, 7), &Device::Cpu).unwrap();
    let kmf: Vec<f32> = km.iter().map(|&v| v as f32).collect();
    for (t, past, window) in [(7, 0, None), (4, 3, None), (4, 3, Some(2)), (1, 6, None)] {
        let host = m.attention_bias(&kmf, 2, t, past, window).unwrap();
        let dev = m
            .attention_bias_on_device(&key_mask, t, past, window)
            .unwrap();
        let (h, d): (Vec<f32>, Vec<f32>) = (
            host.flatten_all().unwrap().to_vec1().unwrap(),
            dev.flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert_eq!(h, d, "t {t} past {past} window {window:?}");
    }
    let pos = Tensor::new(&[[0u32, 1, 2, 900], [5, 6, 7, 30000]], &Device::Cpu).unwrap();
    let inv = m.inv_freq();
    let (hc, hs) = m.rotary(&pos, &inv).unwrap();
    let (dc, ds) = m.rotary_on_device(&pos, &inv).unwrap();
    for (a, b) in [(hc, dc), (hs, ds)] {
        assert_eq!(a.dims(), b.dims());
        let d = max_diff(&a, &b);
        assert!(d <= 2.0 * f32::EPSILON, "rotary tables differ by {d}");
    }
}

/// Summed log-probs of a padded batch, or of the same two sequences packed end to end, and the
/// gradient of every parameter (f64), for [`blocked_attention_in_the_model_equals_the_composition`].
fn logprob_grads(vm: &VarMap, m: &CausalLm, packed: bool) -> (f64, Vec<(String, Vec<f64>)>) {
    let (a, b) = (vec![4u32, 8, 15, 16, 23, 42], vec![1u32, 2, 3]);
    let (ta, tb) = (vec![8u32, 15, 16, 23, 42, 1], vec![2u32, 3, 4]);
    let lp = if packed {
        let ids = Tensor::new([a, b].concat(), &Device::Cpu).unwrap();
        let pos = Tensor::new(
            [(0..6u32).collect::<Vec<_>>(), (0..3).collect()].concat(),
            &Device::Cpu,
        )
        .unwrap();
        let h = m
            .forward_hidden_packed(&ids, &pos, &[(0, 6), (6, 3)])
            .unwrap();
        let tgt = Tensor::new([ta, tb].concat(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        m.token_logprobs(&h.unsqueeze(0).unwrap(), &tgt, 4, false)
            .unwrap()
            .0
    } else {
        let (pi, pm, pp) = left_pad(&[a, b], 0);
        let h = m.forward_hidden(&pi, &pp, &pm, None).unwrap();
        let tgt = ids(&[ta, [vec![0u32; 3], tb].concat()]);
        let (lp, _) = m.token_logprobs(&h, &tgt, 4, false).unwrap();
        (lp * pm.to_dtype(DType::F64).unwrap()).unwrap()
    };
    let loss = lp.sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let mut g: Vec<(String, Vec<f64>)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| {
            let t = grads.get(v.as_tensor()).unwrap();
            (n.clone(), t.flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect();
    g.sort_by(|x, y| x.0.cmp(&y.0));
    (loss.to_scalar().unwrap(), g)
}

/// The blocked attention op inside the model (what a GPU runs: `Block::blocked`, switched on
/// here on the CPU over the composition): the composed model's summed log-probs and every
/// parameter's gradient are the plain composition's (f64, 1e-10 of scale), for a padded batch
/// and for the same sequences packed without padding (which the plain composition runs with
/// its block-diagonal bias).
#[test]
fn blocked_attention_in_the_model_equals_the_composition() {
    for arch in [Arch::Qwen2, Arch::Gemma3] {
        let (vm, mut m) = model(arch, DType::F64);
        m.set_exec(Exec {
            composed: true,
            ..Exec::default()
        });
        let (want, gw) = logprob_grads(&vm, &m, false);
        let (want_packed, gwp) = logprob_grads(&vm, &m, true);
        assert!(
            (want - want_packed).abs() < 1e-10 * want.abs(),
            "{arch:?}: packing"
        );
        for l in m.blocks_mut() {
            l.blocked = true;
        }
        for (packed, want, gw) in [(false, want, &gw), (true, want_packed, &gwp)] {
            let (got, gg) = logprob_grads(&vm, &m, packed);
            assert!(
                (got - want).abs() < 1e-10 * want.abs(),
                "{arch:?} packed={packed}: {got} vs {want}"
            );
            for ((n, a), (_, b)) in gw.iter().zip(&gg) {
                let scale = a.iter().fold(1e-30f64, |s, v| s.max(v.abs()));
                for (u, v) in a.iter().zip(b) {
                    assert!(
                        (u - v).abs() <= 1e-10 * scale,
                        "{arch:?} packed={packed} {n}: {u} vs {v}"
                    );
                }
            }
        }
    }
}
