//! The CPU sampler's normaliser `Σ e^(l/t − m)` over one row of logits of Qwen's vocabulary
//! (151,936 entries): `vectorized` is `rollout::sum_exp` (exp_f32 at the CPU's vector width, f64
//! lanes), `libm_f64` the reference it replaced (`rollout::sum_exp_reference`, one f64 `exp` per
//! entry); `greedy_row` is a whole greedy `sample_row` (max, normaliser, argmax) on that row.
//! Run: `cargo bench --bench sampler`.

use criterion::{criterion_group, criterion_main, Criterion};
use main_ppo::rollout::{sample_row, sum_exp, sum_exp_reference, SamplingParams};
use rand::{Rng, SeedableRng};

const VOCAB: usize = 151_936;

fn bench(c: &mut Criterion) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let logits: Vec<f32> = (0..VOCAB)
        .map(|_| rng.random::<f32>() * 30.0 - 15.0)
        .collect();
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut g = c.benchmark_group("sampler/normaliser_151936");
    g.bench_function("vectorized", |b| {
        b.iter(|| sum_exp(std::hint::black_box(&logits), 1.0, m))
    });
    g.bench_function("libm_f64", |b| {
        b.iter(|| sum_exp_reference(std::hint::black_box(&logits), 1.0, m))
    });
    g.finish();
    let p = SamplingParams {
        greedy: true,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: 1,
        eos_ids: vec![],
        ignore_eos: false,
        limits: Default::default(),
    };
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    c.bench_function("sampler/greedy_row_151936", |b| {
        b.iter(|| sample_row(std::hint::black_box(&logits), &p, &mut r))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
