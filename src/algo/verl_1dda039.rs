//! Against verl itself: the numbers verl-project/verl 1dda039's `core_algos.py` gives in
//! PyTorch f64 (`agg_loss` with and without the global-batch arguments, ten policy losses with
//! and without rollout IS weights, their gradients with respect to the log-probs from torch's
//! autograd, the clipped value loss), written to `tests/fixtures/algo_verl_1dda039.json` by
//! `scripts/verl_algo_fixtures.py`. The inputs hold a row without a valid token. f64, 1e-9.
//! Also gdpo and the optimal token baselines (`compute_optimal_token_baseline_advantage`,
//! `compute_multi_turn_optimal_token_baseline_advantage`) on inputs of their own, and PF-PPO's
//! resampling weights (`compute_pf_ppo_reweight_data`, float32 in verl: 1e-6 relative).

use candle_core::{DType, Device, Tensor, Var};
use serde_json::Value;

use super::agg::{agg_loss, scalar, AggNorm};
use super::*;
use crate::config::{AdvEstimator, LossAggMode, PolicyLossMode};

const TOL: f64 = 1e-9;

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/algo_verl_1dda039.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture file")).expect("JSON")
}

fn mat(v: &Value) -> Tensor {
    let rows: Vec<Vec<f64>> = serde_json::from_value(v.clone()).expect("a matrix");
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap()
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("a number: {v}"))
}

fn close(case: &str, got: f64, want: f64) {
    assert!(
        (got - want).abs() <= TOL * (1.0 + want.abs()),
        "{case}: {got}, verl {want}"
    );
}

fn mode(s: &str) -> LossAggMode {
    serde_yaml_ng::from_str(s).unwrap()
}

/// verl's `global_batch_info` as our normalisers (1dda039's aggregation).
fn norm(info: &Value) -> AggNorm {
    AggNorm {
        batch_num_tokens: info.get("batch_num_tokens").and_then(Value::as_f64),
        global_batch_size: info.get("global_batch_size").and_then(Value::as_f64),
        loss_scale_factor: info.get("loss_scale_factor").and_then(Value::as_f64),
        dp_size: info.get("dp_size").and_then(Value::as_f64),
        legacy_sum_norm: false,
    }
}

#[test]
fn aggregation_equals_verl() {
    let f = fixture();
    let (l, m) = (mat(&f["loss_mat"]), mat(&f["mask"]));
    for c in f["agg"].as_array().unwrap() {
        let (md, info) = (c["mode"].as_str().unwrap(), c["info"].as_str().unwrap());
        let got = agg_loss(&l, &m, mode(md), norm(&f["infos"][info])).unwrap();
        close(
            &format!("agg {md} {info}"),
            scalar(&got).unwrap(),
            num(&c["loss"]),
        );
    }
}

#[test]
fn policy_losses_and_gradients_equal_verl() {
    let f = fixture();
    let p = &f["params"];
    let (old, adv, m, w) = (
        mat(&f["old"]),
        mat(&f["adv"]),
        mat(&f["mask"]),
        mat(&f["weights"]),
    );
    let cases = f["policy"].as_array().unwrap();
    assert_eq!(cases.len(), 120);
    for c in cases {
        let lm = c["mode"].as_str().unwrap();
        let (agg, info) = (c["agg"].as_str().unwrap(), c["info"].as_str().unwrap());
        let weighted = c["weighted"].as_bool().unwrap();
        let name = format!("{lm} {agg} {info} weighted={weighted}");
        let params = PolicyLossParams {
            mode: serde_yaml_ng::from_str::<PolicyLossMode>(lm).unwrap(),
            clip_low: num(&p["clip_low"]),
            clip_high: num(&p["clip_high"]),
            clip_ratio_c: num(&p["clip_ratio_c"]),
            tau_pos: num(&p["tau_pos"]),
            tau_neg: num(&p["tau_neg"]),
            clip_cov_ratio: num(&p["clip_cov_ratio"]),
            clip_cov_lb: num(&p["clip_cov_lb"]),
            clip_cov_ub: num(&p["clip_cov_ub"]),
            kl_cov_ratio: num(&p["kl_cov_ratio"]),
            ppo_kl_coef: num(&p["ppo_kl_coef"]),
            dro_beta: p["dro_beta"].as_f64(),
            loss_agg_mode: mode(agg),
            norm: norm(&f["infos"][info]),
            seed: 0,
        };
        let logp = Var::from_tensor(&mat(&f["logp"])).unwrap();
        let weights = weighted.then_some(&w);
        let out = policy::policy_loss_weighted(&old, logp.as_tensor(), &adv, &m, &params, weights)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        close(
            &format!("{name}: loss"),
            scalar(&out.loss).unwrap(),
            num(&c["loss"]),
        );
        let grads = out.loss.backward().unwrap();
        let g: Vec<f64> = grads
            .get(logp.as_tensor())
            .expect("a gradient")
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want: Vec<Vec<f64>> = serde_json::from_value(c["grad"].clone()).unwrap();
        for (i, (a, b)) in g.iter().zip(want.concat()).enumerate() {
            close(&format!("{name}: d loss / d logp[{i}]"), *a, b);
        }
        let metrics = c["metrics"].as_object().unwrap();
        for (key, got) in [
            ("pg_clipfrac", out.pg_clipfrac),
            ("ppo_kl", out.ppo_kl),
            ("pg_clipfrac_lower", out.pg_clipfrac_lower),
        ] {
            match (metrics.get(key), got) {
                (Some(v), Some(g)) => close(&format!("{name}: {key}"), g, num(v)),
                // verl reports nothing: we report nothing, or 0 where an older verl had 0.
                (None, g) => assert!(g.is_none_or(|g| g == 0.0), "{name}: {key} {g:?}"),
                (Some(v), None) => panic!("{name}: verl reports {key} = {v}, we do not"),
            }
        }
    }
}

#[test]
fn value_loss_equals_verl() {
    let f = fixture();
    let (v, r, vals, m) = (
        mat(&f["vpreds"]),
        mat(&f["returns"]),
        mat(&f["values"]),
        mat(&f["mask"]),
    );
    for c in f["value"].as_array().unwrap() {
        let (agg, info) = (c["agg"].as_str().unwrap(), c["info"].as_str().unwrap());
        let (loss, clipfrac) =
            value_loss(&v, &r, &vals, &m, 0.5, mode(agg), norm(&f["infos"][info])).unwrap();
        let name = format!("value {agg} {info}");
        close(
            &format!("{name}: loss"),
            scalar(&loss).unwrap(),
            num(&c["loss"]),
        );
        close(
            &format!("{name}: vf_clipfrac"),
            clipfrac,
            num(&c["vf_clipfrac"]),
        );
    }
}

/// The same checks hold in f32 to single precision (the losses' dtype follows the inputs).
#[test]
fn f32_inputs_follow_verl_to_single_precision() {
    let f = fixture();
    let to32 = |t: Tensor| t.to_dtype(DType::F32).unwrap();
    let (l, m) = (to32(mat(&f["loss_mat"])), to32(mat(&f["mask"])));
    for c in f["agg"].as_array().unwrap() {
        let (md, info) = (c["mode"].as_str().unwrap(), c["info"].as_str().unwrap());
        let got = scalar(&agg_loss(&l, &m, mode(md), norm(&f["infos"][info])).unwrap()).unwrap();
        let want = num(&c["loss"]);
        assert!(
            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "agg {md} {info}: {got} vs {want}"
        );
    }
}

/// gdpo: verl builds each component's token scores in f32 and normalises them in f32, so its
/// advantages carry single precision (tolerance 1e-5); inputs are exact in f32. The second
/// group's `format` component is all-equal: it adds 0 whatever the std division.
#[test]
fn gdpo_equals_verl() {
    let f = fixture();
    let m = Mat::from_tensor(&mat(&f["mask"]), "mask").unwrap();
    let comps: Vec<Vec<f64>> = ["accuracy", "format"]
        .iter()
        .map(|k| serde_json::from_value(f["gdpo_components"][k].clone()).unwrap())
        .collect();
    let index: Vec<u64> = serde_json::from_value(f["gdpo_index"].clone()).unwrap();
    let zeros = Mat::zeros(m.b, m.t);
    let inp = HostInputs {
        token_level_rewards: &zeros,
        response_mask: &m,
        values: None,
        index: Some(&index),
        reward_baselines: None,
        reward_components: Some(&comps),
        old_log_probs: None,
        sum_pi_squared: None,
        rollout_is_weights: None,
    };
    for c in f["gdpo"].as_array().unwrap() {
        let cfg = crate::config::AlgorithmConfig {
            adv_estimator: crate::config::AdvEstimator::Gdpo,
            norm_adv_by_std_in_grpo: c["norm"].as_bool().unwrap(),
            gdpo_reward_weights: serde_json::from_value(c["weights"].clone()).unwrap(),
            ..Default::default()
        };
        let (adv, ret) = advantages(cfg.adv_estimator, &inp, &cfg).unwrap();
        let want: Vec<Vec<f64>> = serde_json::from_value(c["adv"].clone()).unwrap();
        for (i, (a, w)) in adv.v.iter().zip(want.concat()).enumerate() {
            assert!((a - w).abs() <= 1e-5, "gdpo {c:?}[{i}]: {a} vs {w}");
        }
        assert_eq!(adv.v, ret.v, "gdpo's returns are its advantages");
    }
    // One weight per key, and the components are needed.
    let cfg = crate::config::AlgorithmConfig {
        gdpo_reward_weights: Some(vec![1.0]),
        ..Default::default()
    };
    let e = advantages(crate::config::AdvEstimator::Gdpo, &inp, &cfg).unwrap_err();
    assert!(e.to_string().contains("1 entries for 2 reward keys"), "{e}");
    let inp = HostInputs {
        reward_components: None,
        ..inp
    };
    let e = advantages(crate::config::AdvEstimator::Gdpo, &inp, &cfg).unwrap_err();
    assert!(e.to_string().contains("gdpo_reward_keys"), "{e}");
}

fn host(v: &Value) -> Mat {
    Mat::from_tensor(&mat(v), "fixture").unwrap()
}

/// optimal_token_baseline and tir_optimal_token_baseline against verl's
/// `compute_optimal_token_baseline_advantage` and
/// `compute_multi_turn_optimal_token_baseline_advantage` (1dda039, torch f64; the fixture's
/// `otb` part): 12 responses in five groups — one with a strictly longest response (zero
/// tail) and rewards on every token, one all-equal, one holding an empty response, a group of
/// one, a tie for the longest — with and without rollout IS weights, on prefix masks and on
/// masks with tokens left out inside two responses. Advantages and returns within 1e-9
/// (relative above 1). On prefix masks verl's two functions agree, and so do ours.
#[test]
fn optimal_token_baselines_equal_verl() {
    let f = fixture();
    let o = &f["otb"];
    let (r, old, spi2, w) = (
        host(&o["rewards"]),
        host(&o["old_log_probs"]),
        host(&o["sum_pi_squared"]),
        host(&o["rollout_is_weights"]),
    );
    let index: Vec<u64> = serde_json::from_value(o["index"].clone()).unwrap();
    let cases = o["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 8);
    let mut ours = Vec::new();
    for c in cases {
        let est: AdvEstimator = serde_yaml_ng::from_str(c["estimator"].as_str().unwrap()).unwrap();
        let mask_name = c["mask"].as_str().unwrap();
        let weighted = c["weighted"].as_bool().unwrap();
        let m = host(&o["masks"][mask_name]);
        let inp = HostInputs {
            token_level_rewards: &r,
            response_mask: &m,
            values: None,
            index: Some(&index),
            reward_baselines: None,
            reward_components: None,
            old_log_probs: Some(&old),
            sum_pi_squared: Some(&spi2),
            rollout_is_weights: weighted.then_some(&w),
        };
        let cfg = crate::config::AlgorithmConfig {
            adv_estimator: est,
            ..Default::default()
        };
        let (adv, ret) = advantages(est, &inp, &cfg).unwrap();
        let name = format!("{} {mask_name} weighted={weighted}", est.as_str());
        for (what, got) in [("adv", &adv), ("ret", &ret)] {
            let want: Vec<Vec<f64>> = serde_json::from_value(c[what].clone()).unwrap();
            for (i, (g, v)) in got.v.iter().zip(want.concat()).enumerate() {
                close(&format!("{name}: {what}[{}, {}]", i / r.t, i % r.t), *g, v);
            }
        }
        ours.push(((est, mask_name, weighted), adv, c["adv"].clone()));
    }
    // The tir variant differs from the plain one only where masks have holes.
    for ((est, mask, weighted), adv, verl) in &ours {
        if *est != AdvEstimator::TirOptimalTokenBaseline {
            continue;
        }
        let (_, plain, plain_verl) = ours
            .iter()
            .find(|(k, ..)| *k == (AdvEstimator::OptimalTokenBaseline, *mask, *weighted))
            .unwrap();
        assert_eq!(
            *mask == "prefix",
            adv == plain,
            "{mask} weighted={weighted}"
        );
        assert_eq!(*mask == "prefix", verl == plain_verl, "verl: {mask}");
    }
}

/// The optimal token baselines need Σπ² and the old log-probs: without them the error names
/// the key that computes them.
#[test]
fn optimal_token_baselines_name_calculate_sum_pi_squared() {
    let m = Mat::zeros(2, 3);
    let inp = HostInputs {
        token_level_rewards: &m,
        response_mask: &m,
        values: None,
        index: Some(&[0, 0]),
        reward_baselines: None,
        reward_components: None,
        old_log_probs: Some(&m),
        sum_pi_squared: None,
        rollout_is_weights: None,
    };
    let e = advantages(
        AdvEstimator::OptimalTokenBaseline,
        &inp,
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("calculate_sum_pi_squared=True") && e.contains("sum_pi_squared"),
        "{e}"
    );
    let short = Mat::zeros(2, 2);
    let inp = HostInputs {
        sum_pi_squared: Some(&short),
        ..inp
    };
    let e = advantages(
        AdvEstimator::TirOptimalTokenBaseline,
        &inp,
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("sum_pi_squared (2, 2)"), "{e}");
}

/// PF-PPO's weights for each method against the ones verl hands `torch.multinomial` (float32
/// there, so 1e-6 relative; `1 + 1e-8` is 1 in float32).
#[test]
fn pf_ppo_weights_equal_verl() {
    let f = fixture();
    let pf = &f["pf_ppo"];
    let rows: Vec<Vec<f64>> = serde_json::from_value(pf["token_level_scores"].clone()).unwrap();
    let scores: Vec<f64> = rows.iter().map(|r| r.iter().sum()).collect();
    let kept = vec![true; scores.len()];
    let cases = pf["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let method: crate::config::PfPpoReweight =
            serde_yaml_ng::from_str(case["method"].as_str().unwrap()).unwrap();
        let pow = num(&case["weight_pow"]);
        let got = pf_ppo::weights(&scores, &kept, method, pow);
        let want: Vec<f64> = serde_json::from_value(case["weights"].clone()).unwrap();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1e-8),
                "{method:?} pow {pow}, row {i}: {g}, verl {w}"
            );
        }
    }
}
