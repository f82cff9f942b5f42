//! Property tests: the tensor implementations equal plain scalar references written out here
//! (loops over rows and groups), on random shapes, masks and group layouts.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;

use super::agg::{agg_loss, scalar, AggNorm};
use super::*;
use crate::config::{AdvEstimator, AlgorithmConfig, LossAggMode};

#[derive(Debug, Clone)]
struct Batch {
    b: usize,
    t: usize,
    x: Vec<f64>,
    mask: Vec<f64>,
    groups: Vec<u64>,
}

fn batch() -> impl Strategy<Value = Batch> {
    (1usize..7, 1usize..9).prop_flat_map(|(b, t)| {
        (
            proptest::collection::vec(-3.0f64..3.0, b * t),
            proptest::collection::vec(prop::bool::weighted(0.7), b * t),
            proptest::collection::vec(0u64..3, b),
        )
            .prop_map(move |(x, m, groups)| Batch {
                b,
                t,
                x,
                mask: m.into_iter().map(|k| if k { 1.0 } else { 0.0 }).collect(),
                groups,
            })
    })
}

fn tensor(v: &[f64], b: usize, t: usize) -> Tensor {
    Tensor::from_vec(v.to_vec(), (b, t), &Device::Cpu).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

fn scalar_sum(b: &Batch) -> f64 {
    b.x.iter().zip(&b.mask).map(|(x, m)| x * m).sum()
}

fn scalar_agg(bt: &Batch, mode: LossAggMode) -> f64 {
    let n: f64 = bt.mask.iter().sum();
    let row = |i: usize| -> (f64, f64) {
        let s: f64 = (0..bt.t)
            .map(|j| bt.x[i * bt.t + j] * bt.mask[i * bt.t + j])
            .sum();
        let c: f64 = (0..bt.t).map(|j| bt.mask[i * bt.t + j]).sum();
        (s, c)
    };
    let seq_mean = |per_row: &dyn Fn(f64, f64) -> f64| -> f64 {
        let mut total = 0.0;
        let mut rows = 0.0;
        for i in 0..bt.b {
            let (s, c) = row(i);
            if c > 0.0 {
                total += per_row(s, c);
                rows += 1.0;
            }
        }
        if rows == 0.0 {
            0.0
        } else {
            total / rows
        }
    };
    match mode {
        LossAggMode::TokenMean => {
            if n == 0.0 {
                0.0
            } else {
                scalar_sum(bt) / n
            }
        }
        LossAggMode::TokenSum => scalar_sum(bt),
        LossAggMode::SeqMeanTokenSum => seq_mean(&|s, _| s),
        LossAggMode::SeqMeanTokenMean => seq_mean(&|s, c| s / (c + 1e-8)),
        LossAggMode::SeqMeanTokenSumNorm => seq_mean(&|s, _| s) / bt.t as f64,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn masked_mean_matches_scalar(bt in batch()) {
        let got = scalar(&masked_mean(&tensor(&bt.x, bt.b, bt.t), &tensor(&bt.mask, bt.b, bt.t)).unwrap()).unwrap();
        let n: f64 = bt.mask.iter().sum();
        prop_assert!(close(got, scalar_sum(&bt) / (n + 1e-8)));
    }

    #[test]
    fn agg_modes_match_scalar(bt in batch()) {
        for mode in [LossAggMode::TokenMean, LossAggMode::TokenSum, LossAggMode::SeqMeanTokenSum, LossAggMode::SeqMeanTokenMean, LossAggMode::SeqMeanTokenSumNorm] {
            let got = scalar(&agg_loss(&tensor(&bt.x, bt.b, bt.t), &tensor(&bt.mask, bt.b, bt.t), mode, AggNorm::default()).unwrap()).unwrap();
            prop_assert!(close(got, scalar_agg(&bt, mode)), "{:?}: {} vs {}", mode, got, scalar_agg(&bt, mode));
        }
    }

    #[test]
    fn grpo_rloo_opo_match_scalar(bt in batch(), norm in any::<bool>()) {
        let r = tensor(&bt.x, bt.b, bt.t);
        let m = tensor(&bt.mask, bt.b, bt.t);
        let cfg = AlgorithmConfig { norm_adv_by_std_in_grpo: norm, ..Default::default() };
        let inp = AdvantageInputs { token_level_rewards: &r, response_mask: &m, values: None, index: Some(&bt.groups), reward_baselines: None };
        let score = |i: usize| -> f64 { bt.x[i * bt.t..(i + 1) * bt.t].iter().sum() };
        let mut members: HashMap<u64, Vec<usize>> = HashMap::new();
        for (i, g) in bt.groups.iter().enumerate() { members.entry(*g).or_default().push(i); }
        for est in [AdvEstimator::Grpo, AdvEstimator::Rloo, AdvEstimator::Opo] {
            let (adv, _) = compute_advantage(est, &inp, &cfg).unwrap();
            let got: Vec<f64> = adv.flatten_all().unwrap().to_vec1().unwrap();
            for i in 0..bt.b {
                let g = &members[&bt.groups[i]];
                let n = g.len() as f64;
                let mean = g.iter().map(|&j| score(j)).sum::<f64>() / n;
                let want = match est {
                    AdvEstimator::Grpo => {
                        if g.len() == 1 { if norm { score(i) / (1.0 + 1e-6) } else { score(i) } } else {
                            let std = (g.iter().map(|&j| (score(j) - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
                            if norm { (score(i) - mean) / (std + 1e-6) } else { score(i) - mean }
                        }
                    }
                    AdvEstimator::Rloo => if g.len() == 1 { score(i) } else {
                        // The mean of the other responses, scaled: s·n/(n−1) − mean·n/(n−1) = s − mean_of_others.
                        let others = (g.iter().map(|&j| score(j)).sum::<f64>() - score(i)) / (n - 1.0);
                        score(i) - others
                    },
                    _ => {
                        if g.len() == 1 { score(i) } else {
                            let len = |j: usize| -> f64 { bt.mask[j * bt.t..(j + 1) * bt.t].iter().sum() };
                            let total: f64 = g.iter().map(|&j| len(j)).sum();
                            if total == 0.0 { f64::NAN } else { score(i) - g.iter().map(|&j| len(j) * score(j)).sum::<f64>() / total }
                        }
                    }
                };
                for t in 0..bt.t {
                    let w = want * bt.mask[i * bt.t + t];
                    let gv = got[i * bt.t + t];
                    prop_assert!((w.is_nan() && gv.is_nan()) || close(gv, w) || (bt.mask[i * bt.t + t] == 0.0 && gv == 0.0) , "{:?} row {} t {}: {} vs {}", est, i, t, gv, w);
                }
            }
        }
    }

    #[test]
    fn gae_matches_scalar_recursion(bt in batch(), gamma in 0.5f64..1.0, lam in 0.5f64..1.0) {
        prop_assume!(bt.mask.iter().sum::<f64>() >= 2.0);
        let r = tensor(&bt.x, bt.b, bt.t);
        let m = tensor(&bt.mask, bt.b, bt.t);
        let v: Vec<f64> = bt.x.iter().map(|x| (x * 1.7).sin()).collect();
        let vt = tensor(&v, bt.b, bt.t);
        let cfg = AlgorithmConfig { gamma, lam, ..Default::default() };
        let inp = AdvantageInputs { token_level_rewards: &r, response_mask: &m, values: Some(&vt), index: None, reward_baselines: None };
        let (_, ret) = compute_advantage(AdvEstimator::Gae, &inp, &cfg).unwrap();
        let got: Vec<f64> = ret.flatten_all().unwrap().to_vec1().unwrap();
        // Reference: on the valid positions of each row (holes skipped), A_k = δ_k + γλ A_{k+1},
        // δ_k = r_k + γ V_{next valid} − V_k; a hole carries the later advantage; returns = A + V.
        for i in 0..bt.b {
            let mut a_next = 0.0;
            let mut v_next = 0.0;
            for t in (0..bt.t).rev() {
                let k = i * bt.t + t;
                let a = if bt.mask[k] == 1.0 {
                    let a = bt.x[k] + gamma * v_next - v[k] + gamma * lam * a_next;
                    v_next = v[k];
                    a_next = a;
                    a
                } else { a_next };
                prop_assert!(close(got[k], a + v[k]), "row {} t {}: {} vs {}", i, t, got[k], a + v[k]);
            }
        }
    }
}

#[test]
fn f32_inputs_give_f32_outputs() {
    let r = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    let m = Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap();
    let inp = AdvantageInputs {
        token_level_rewards: &r,
        response_mask: &m,
        values: None,
        index: Some(&[1, 1]),
        reward_baselines: None,
    };
    let (a, ret) =
        compute_advantage(AdvEstimator::Grpo, &inp, &AlgorithmConfig::default()).unwrap();
    assert_eq!((a.dtype(), ret.dtype()), (DType::F32, DType::F32));
}
