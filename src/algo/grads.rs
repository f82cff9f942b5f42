//! Gradient checks: autograd against central finite differences in f64, for the PPO, value
//! and KL losses (inputs kept away from the clip boundaries, where the loss has kinks).

use candle_core::{DType, Device, Tensor, Var};

use super::agg::{agg_loss, scalar, AggNorm};
use super::kl::kl_loss;
use super::*;
use crate::config::{KlPenalty, LossAggMode, PolicyLossMode};

const B: usize = 3;
const T: usize = 4;

fn t(v: &[f64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), (B, T), &Device::Cpu).unwrap()
}

/// Deterministic pseudo-random values in [-1, 1).
fn vals(seed: u64) -> Vec<f64> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..B * T)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

fn mask() -> Tensor {
    t(&[1., 1., 1., 1., 1., 1., 0., 0., 1., 0., 1., 0.])
}

/// Compares d f / d x from autograd with central differences of f at `x0`.
fn check(name: &str, x0: &[f64], f: impl Fn(&Tensor) -> Tensor) {
    check_surrogate(name, x0, &f, &f)
}

/// Compares the autograd gradient of `f` at `x0` with central differences of `surrogate`: for
/// losses with stop-gradients, the function whose true gradient autograd must produce.
fn check_surrogate(
    name: &str,
    x0: &[f64],
    f: &dyn Fn(&Tensor) -> Tensor,
    surrogate: &dyn Fn(&Tensor) -> Tensor,
) {
    let var = Var::from_tensor(&t(x0)).unwrap();
    let loss = f(var.as_tensor());
    let grads = loss.backward().unwrap();
    let g: Vec<f64> = grads
        .get(var.as_tensor())
        .expect("a gradient")
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let h = 1e-6;
    for i in 0..x0.len() {
        let mut up = x0.to_vec();
        up[i] += h;
        let mut down = x0.to_vec();
        down[i] -= h;
        let fd = (scalar(&surrogate(&t(&up))).unwrap() - scalar(&surrogate(&t(&down))).unwrap())
            / (2.0 * h);
        assert!(
            (g[i] - fd).abs() < 1e-6 * (1.0 + fd.abs()),
            "{name}: d/dx[{i}] autograd {} vs finite difference {fd}",
            g[i]
        );
    }
}

fn params(mode: PolicyLossMode, agg: LossAggMode) -> PolicyLossParams {
    PolicyLossParams {
        mode,
        clip_low: 0.2,
        clip_high: 0.28,
        clip_ratio_c: 3.0,
        tau_pos: 1.0,
        tau_neg: 1.05,
        clip_cov_ratio: 0.0002,
        clip_cov_lb: 1.0,
        clip_cov_ub: 5.0,
        kl_cov_ratio: 0.0002,
        ppo_kl_coef: 0.1,
        dro_beta: Some(0.5),
        loss_agg_mode: agg,
        norm: AggNorm::default(),
        seed: 0,
    }
}

/// The policy-loss inputs `(old, adv, logp)` of the gradient checks.
/// Ratios exp(±0.1): inside the clip range, so the unclipped branch is active and smooth;
/// plus two tokens far outside where the clipped branch is active (gradient 0 there).
fn inputs() -> (Vec<f64>, Tensor, Vec<f64>) {
    let old: Vec<f64> = vals(1).iter().map(|v| v - 1.5).collect();
    let mut logp: Vec<f64> = old.iter().zip(vals(3)).map(|(o, d)| o + 0.1 * d).collect();
    logp[1] = old[1] + 1.0;
    logp[5] = old[5] - 1.0;
    (old, t(&vals(2)), logp)
}

#[test]
fn policy_loss_gradients_match_finite_differences() {
    let (old, adv, logp) = inputs();
    let old_t = t(&old);
    for mode in [
        PolicyLossMode::Vanilla,
        PolicyLossMode::Gpg,
        PolicyLossMode::Sapo,
        PolicyLossMode::GeoMean,
        PolicyLossMode::KlCov,
        PolicyLossMode::ClipCov,
        PolicyLossMode::Dro,
    ] {
        for agg in [
            LossAggMode::TokenMean,
            LossAggMode::SeqMeanTokenMean,
            LossAggMode::SeqMeanTokenSumNorm,
        ] {
            let p = params(mode, agg);
            check(&format!("{mode:?}/{agg:?}"), &logp, |x| {
                policy_loss(&old_t, x, &adv, &mask(), &p).unwrap().loss
            });
        }
    }
    let x0 = t(&logp);

    // CISPO's ratio is a stop-gradient: the gradient is that of −c₀·A·logp with c₀ frozen at x0.
    let p = params(PolicyLossMode::Cispo, LossAggMode::TokenMean);
    let c0 = x0
        .sub(&old_t)
        .unwrap()
        .exp()
        .unwrap()
        .clamp(0.8, 1.28)
        .unwrap();
    check_surrogate(
        "Cispo",
        &logp,
        &|x| policy_loss(&old_t, x, &adv, &mask(), &p).unwrap().loss,
        &|x| {
            let l = c0.mul(&adv).unwrap().mul(x).unwrap().neg().unwrap();
            agg_loss(&l, &mask(), LossAggMode::TokenMean, AggNorm::default()).unwrap()
        },
    );

    // GSPO: each token carries the frozen sequence ratio s₀ times exp(logp − logp₀).
    let p = params(PolicyLossMode::Gspo, LossAggMode::TokenMean);
    let m = mask();
    let seq0 = x0
        .sub(&old_t)
        .unwrap()
        .mul(&m)
        .unwrap()
        .sum(1)
        .unwrap()
        .div(&m.sum(1).unwrap())
        .unwrap();
    check_surrogate(
        "Gspo",
        &logp,
        &|x| policy_loss(&old_t, x, &adv, &m, &p).unwrap().loss,
        &|x| {
            let r = x
                .sub(&x0)
                .unwrap()
                .broadcast_add(&seq0.unsqueeze(1).unwrap())
                .unwrap()
                .exp()
                .unwrap();
            let l1 = r.mul(&adv).unwrap().neg().unwrap();
            let l2 = r
                .clamp(0.8, 1.28)
                .unwrap()
                .mul(&adv)
                .unwrap()
                .neg()
                .unwrap();
            agg_loss(
                &l1.maximum(&l2).unwrap(),
                &m,
                LossAggMode::SeqMeanTokenMean,
                AggNorm::default(),
            )
            .unwrap()
        },
    );
}

/// DPPO (dppo_tv, dppo_kl) on the inputs of [`policy_loss_gradients_match_finite_differences`].
#[test]
fn dppo_gradients_match_their_surrogate() {
    let (old, adv, logp) = inputs();
    let old_t = t(&old);
    // DPPO: the truncated ratio and the kept-token mask are stop-gradients, so the gradient is
    // that of −A·c₀·v₀·logp, c₀ = min(r₀, clip_ratio_c) and v₀ the mask at x0, worked out here
    // per token from the definitions (TV: p − p_old within [−ε_low, ε_high] on the side the
    // advantage's sign picks; binary KL: KL(Bern(p_old) ‖ Bern(p)) ≤ ε unless p moved the other
    // way). Both kinds of token occur in these inputs.
    let a0 = vals(2);
    for (mode, name) in [
        (PolicyLossMode::DppoTv, "DppoTv"),
        (PolicyLossMode::DppoKl, "DppoKl"),
    ] {
        let p = params(mode, LossAggMode::TokenMean);
        let (mut c, mut v) = (vec![0.0; B * T], vec![0.0; B * T]);
        for i in 0..B * T {
            let (lp, lo) = (logp[i], old[i]);
            let (pr, po) = (lp.exp(), lo.exp());
            c[i] = (lp - lo).exp().min(3.0);
            let kept = match mode {
                PolicyLossMode::DppoTv if a0[i] > 0.0 => pr - po <= 0.28,
                PolicyLossMode::DppoTv => pr - po >= -0.2,
                _ => {
                    let kl =
                        po * (lo - lp) + (1.0 - po) * ((1.0 - po + 1e-8) / (1.0 - pr + 1e-8)).ln();
                    if a0[i] > 0.0 {
                        kl <= 0.28 || pr <= po
                    } else {
                        kl <= 0.2 || pr >= po
                    }
                }
            };
            v[i] = f64::from(u8::from(kept));
        }
        let kept: f64 = v.iter().sum();
        assert!(kept > 0.0 && kept < (B * T) as f64, "{name}: {v:?}");
        let cv = t(&c).mul(&t(&v)).unwrap();
        check_surrogate(
            name,
            &logp,
            &|x| policy_loss(&old_t, x, &adv, &mask(), &p).unwrap().loss,
            &|x| {
                let l = cv.mul(&adv).unwrap().mul(x).unwrap().neg().unwrap();
                agg_loss(&l, &mask(), LossAggMode::TokenMean, AggNorm::default()).unwrap()
            },
        );
    }
}

#[test]
fn value_loss_gradient_matches_finite_differences() {
    let values = t(&vals(4));
    let returns = t(&vals(5));
    // New values within ±0.3 of the old ones (clip range 0.5): unclipped and smooth; one far off.
    let mut vp: Vec<f64> = vals(4)
        .iter()
        .zip(vals(6))
        .map(|(v, d)| v + 0.3 * d)
        .collect();
    vp[2] += 2.0;
    check("value_loss", &vp, |x| {
        value_loss(
            x,
            &returns,
            &values,
            &mask(),
            0.5,
            LossAggMode::TokenMean,
            AggNorm::default(),
        )
        .unwrap()
        .0
    });
}

#[test]
fn kl_loss_gradients() {
    let reference = t(&vals(7));
    let logp: Vec<f64> = vals(7)
        .iter()
        .zip(vals(8))
        .map(|(r, d)| r + 0.5 * d)
        .collect();
    for kind in ["kl", "abs", "mse", "low_var_kl"] {
        let pen: KlPenalty = kind.parse().unwrap();
        check(kind, &logp, |x| {
            kl_loss(
                x,
                &reference,
                &mask(),
                pen,
                LossAggMode::TokenMean,
                AggNorm::default(),
            )
            .unwrap()
        });
    }
    // `k3+` has k3's value but k2's gradient: d/dlogp of mean_M ½(logp−ref)² = (logp−ref)·m / Σm.
    let pen: KlPenalty = "k3+".parse().unwrap();
    let var = Var::from_tensor(&t(&logp)).unwrap();
    let loss = kl_loss(
        var.as_tensor(),
        &reference,
        &mask(),
        pen,
        LossAggMode::TokenMean,
        AggNorm::default(),
    )
    .unwrap();
    let g: Vec<f64> = loss
        .backward()
        .unwrap()
        .get(var.as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let m: Vec<f64> = mask().flatten_all().unwrap().to_vec1().unwrap();
    let r: Vec<f64> = reference.flatten_all().unwrap().to_vec1().unwrap();
    let n: f64 = m.iter().sum();
    for i in 0..g.len() {
        let want = (logp[i] - r[i]) * m[i] / n;
        assert!(
            (g[i] - want).abs() < 1e-12,
            "k3+ gradient [{i}]: {} vs {want}",
            g[i]
        );
    }
    let k3: KlPenalty = "k3".parse().unwrap();
    let v3 = scalar(
        &kl_loss(
            &t(&logp),
            &reference,
            &mask(),
            k3,
            LossAggMode::TokenMean,
            AggNorm::default(),
        )
        .unwrap(),
    )
    .unwrap();
    assert!(
        (scalar(&loss).unwrap() - v3).abs() < 1e-12,
        "k3+ keeps k3's value"
    );
}

#[test]
fn entropy_gradient_matches_finite_differences() {
    let x0 = vals(9);
    check("entropy", &x0, |x| {
        entropy_from_logits(x).unwrap().sum_all().unwrap()
    });
    let _ = DType::F64;
}

/// The losses on CUDA (cargo feature `cuda`, a GPU present; `scripts/gpu/run.sh`): every
/// policy loss, the value loss and every KL penalty give the CPU's value and gradient on the
/// same f64 inputs (≤ 1e-12 relative: the same operations, summed in another order). Without a
/// GPU the test prints why it did not run.
#[cfg(feature = "cuda")]
#[test]
fn losses_on_cuda_equal_the_cpu() {
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    let old: Vec<f64> = vals(1).iter().map(|v| v - 1.5).collect();
    let logp: Vec<f64> = old.iter().zip(vals(3)).map(|(o, d)| o + 0.3 * d).collect();
    let (adv, values, returns) = (vals(2), vals(4), vals(5));
    // (value, gradient) of `f` at `x0`, with every input on `d`.
    let on = |d: &Device, f: &dyn Fn(&Tensor, &[Tensor]) -> Tensor| -> (f64, Vec<f64>) {
        let put = |v: &[f64]| t(v).to_device(d).unwrap();
        let var = Var::from_tensor(&put(&logp)).unwrap();
        let inputs = [
            put(&old),
            put(&adv),
            mask().to_device(d).unwrap(),
            put(&values),
            put(&returns),
        ];
        let loss = f(var.as_tensor(), &inputs);
        let g = loss.backward().unwrap();
        let g = g.get(var.as_tensor()).expect("a gradient");
        (
            scalar(&loss).unwrap(),
            g.to_device(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap(),
        )
    };
    let compare = |name: &str, f: &dyn Fn(&Tensor, &[Tensor]) -> Tensor| {
        let (a, ga) = on(&Device::Cpu, f);
        let (b, gb) = on(&dev, f);
        assert!(
            (a - b).abs() <= 1e-12 * a.abs().max(1.0),
            "{name}: {a} vs {b}"
        );
        for (u, v) in ga.iter().zip(&gb) {
            assert!(
                (u - v).abs() <= 1e-12 * u.abs().max(1.0),
                "{name}: gradient {u} vs {v}"
            );
        }
    };
    for mode in [
        PolicyLossMode::Vanilla,
        PolicyLossMode::Gpg,
        PolicyLossMode::Sapo,
        PolicyLossMode::GeoMean,
        PolicyLossMode::KlCov,
        PolicyLossMode::ClipCov,
        PolicyLossMode::Cispo,
        PolicyLossMode::Gspo,
    ] {
        for agg in [
            LossAggMode::TokenMean,
            LossAggMode::SeqMeanTokenMean,
            LossAggMode::SeqMeanTokenSumNorm,
        ] {
            let p = params(mode, agg);
            compare(&format!("{mode:?}/{agg:?}"), &|x, i| {
                policy_loss(&i[0], x, &i[1], &i[2], &p).unwrap().loss
            });
        }
    }
    compare("value_loss", &|x, i| {
        value_loss(
            x,
            &i[4],
            &i[3],
            &i[2],
            0.5,
            LossAggMode::TokenMean,
            AggNorm::default(),
        )
        .unwrap()
        .0
    });
    for kind in ["kl", "abs", "mse", "low_var_kl", "k3+"] {
        let pen: KlPenalty = kind.parse().unwrap();
        compare(kind, &|x, i| {
            kl_loss(
                x,
                &i[0],
                &i[2],
                pen,
                LossAggMode::TokenMean,
                AggNorm::default(),
            )
            .unwrap()
        });
    }
}
