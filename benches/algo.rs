//! Advantage estimators on a [256, 1024] batch (256 responses of up to 1024 tokens).
//!
//! `gae/one_pass` is main_ppo's host scan; `gae/tensor_chain` is the baseline it replaces, the
//! per-timestep chain of tensor ops that a direct port of verl's loop gives (1024 steps of
//! slicing and arithmetic). `grpo` groups 64 prompts × 4 responses. Run: `cargo bench --bench algo`.

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use main_ppo::algo::{compute_advantage, masked_whiten, AdvantageInputs};
use main_ppo::config::{AdvEstimator, AlgorithmConfig};

const B: usize = 256;
const T: usize = 1024;

fn inputs() -> (Tensor, Tensor, Tensor, Vec<u64>) {
    let dev = Device::Cpu;
    let rewards = Tensor::randn(0f32, 1.0, (B, T), &dev).unwrap();
    let values = Tensor::randn(0f32, 1.0, (B, T), &dev).unwrap();
    // Responses of varied length: row i has 512 + (i * 37 % 512) valid tokens.
    let mut m = vec![0f32; B * T];
    for i in 0..B {
        let len = 512 + (i * 37 % 512);
        m[i * T..i * T + len].iter_mut().for_each(|x| *x = 1.0);
    }
    let mask = Tensor::from_vec(m, (B, T), &dev).unwrap();
    let index: Vec<u64> = (0..B as u64).map(|i| i / 4).collect();
    (rewards, values, mask, index)
}

/// verl's loop written literally with tensor ops: one slice, five arithmetic ops and a stack
/// per timestep.
fn gae_tensor_chain(r: &Tensor, v: &Tensor, m: &Tensor, gamma: f64, lam: f64) -> Tensor {
    let mut next_v = Tensor::zeros(B, DType::F32, &Device::Cpu).unwrap();
    let mut last = Tensor::zeros(B, DType::F32, &Device::Cpu).unwrap();
    let mut out = Vec::with_capacity(T);
    for t in (0..T).rev() {
        let rt = r.narrow(1, t, 1).unwrap().squeeze(1).unwrap();
        let vt = v.narrow(1, t, 1).unwrap().squeeze(1).unwrap();
        let mt = m.narrow(1, t, 1).unwrap().squeeze(1).unwrap();
        let delta = ((rt + (&next_v * gamma).unwrap()).unwrap() - &vt).unwrap();
        let cand = (delta + (&last * (gamma * lam)).unwrap()).unwrap();
        let keep = (1.0 - &mt).unwrap();
        next_v = ((&vt * &mt).unwrap() + (&keep * &next_v).unwrap()).unwrap();
        last = ((&cand * &mt).unwrap() + (&keep * &last).unwrap()).unwrap();
        out.push(last.clone());
    }
    out.reverse();
    let adv = Tensor::stack(&out, 1).unwrap();
    masked_whiten(&adv, m, true).unwrap()
}

fn bench(c: &mut Criterion) {
    let (r, v, m, index) = inputs();
    let cfg = AlgorithmConfig {
        gamma: 0.99,
        lam: 0.95,
        ..Default::default()
    };
    let mut g = c.benchmark_group("advantage_256x1024");
    g.sample_size(20);
    g.bench_function("gae/one_pass", |b| {
        b.iter(|| {
            let inp = AdvantageInputs {
                token_level_rewards: &r,
                response_mask: &m,
                values: Some(&v),
                index: None,
                reward_baselines: None,
            };
            compute_advantage(AdvEstimator::Gae, &inp, &cfg).unwrap()
        })
    });
    g.bench_function("gae/tensor_chain", |b| {
        b.iter(|| gae_tensor_chain(&r, &v, &m, 0.99, 0.95))
    });
    g.bench_function("grpo", |b| {
        b.iter(|| {
            let inp = AdvantageInputs {
                token_level_rewards: &r,
                response_mask: &m,
                values: None,
                index: Some(&index),
                reward_baselines: None,
            };
            compute_advantage(AdvEstimator::Grpo, &inp, &cfg).unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
