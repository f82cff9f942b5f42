//! Generation on tiny random models.

use candle_nn::VarMap;

use super::*;
use crate::model::{Arch, ModelArgs};

fn model() -> (VarMap, CausalLm) {
    crate::testing::tiny_model(&ModelArgs::tiny(Arch::Llama, 50), DType::F32, 0.5)
}

fn left_pad(prompts: &[Vec<u32>]) -> (Vec<u32>, Vec<u8>, usize) {
    let w = prompts.iter().map(Vec::len).max().unwrap();
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for p in prompts {
        ids.extend(std::iter::repeat_n(0u32, w - p.len()));
        ids.extend(p);
        mask.extend(std::iter::repeat_n(0u8, w - p.len()));
        mask.extend(std::iter::repeat_n(1u8, p.len()));
    }
    (ids, mask, w)
}

fn run(m: &CausalLm, prompts: &[Vec<u32>], p: &SamplingParams, seed: u64) -> Rollout {
    let (ids, mask, w) = left_pad(prompts);
    generate(m, &ids, &mask, prompts.len(), w, p, &mut Sampler::new(seed)).unwrap()
}

fn greedy(max: usize, eos: Vec<u32>) -> SamplingParams {
    SamplingParams {
        greedy: true,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: max,
        eos_ids: eos,
        ignore_eos: false,
        limits: Limits::default(),
    }
}

#[test]
fn batched_greedy_equals_each_prompt_alone() {
    let (_vm, m) = model();
    let prompts = vec![vec![3u32, 14, 15, 9, 26], vec![5, 35], vec![8, 9, 7, 9]];
    let p = greedy(12, vec![]);
    let batched = run(&m, &prompts, &p, 0);
    for (i, pr) in prompts.iter().enumerate() {
        let alone = run(&m, std::slice::from_ref(pr), &p, 0);
        assert_eq!(batched.responses[i], alone.responses[0], "prompt {i}");
        for (a, b) in batched.log_probs[i].iter().zip(&alone.log_probs[0]) {
            assert!((a - b).abs() < 1e-4);
        }
    }
}

#[test]
fn eos_stops_a_row_and_others_continue() {
    let (_vm, m) = model();
    let prompts = vec![vec![3u32, 14, 15], vec![5, 35, 2, 7]];
    let free = run(&m, &prompts, &greedy(10, vec![]), 0);
    // Make row 0's third greedy token an EOS id: row 0 stops there, row 1 is unaffected
    // unless it emits that token too.
    let eos = free.responses[0][2];
    let with_eos = run(&m, &prompts, &greedy(10, vec![eos]), 0);
    let first = free.responses[0].iter().position(|&t| t == eos).unwrap();
    assert_eq!(with_eos.responses[0], free.responses[0][..=first].to_vec());
    assert_eq!(with_eos.stop[0], StopReason::Eos);
    let cut1 = free.responses[1]
        .iter()
        .position(|&t| t == eos)
        .map(|i| i + 1)
        .unwrap_or(10);
    assert_eq!(with_eos.responses[1], free.responses[1][..cut1].to_vec());
    assert_eq!(free.stop[1], StopReason::Length);
    assert_eq!(free.responses[1].len(), 10);
    // ignore_eos generates on.
    let mut ig = greedy(10, vec![eos]);
    ig.ignore_eos = true;
    assert_eq!(run(&m, &prompts, &ig, 0).responses[0], free.responses[0]);
}

#[test]
fn sampling_is_seeded_and_log_probs_are_the_models() {
    let (_vm, m) = model();
    let prompts = vec![vec![1u32, 2, 3], vec![1, 2, 3]];
    let p = SamplingParams {
        greedy: false,
        temperature: 1.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: 8,
        eos_ids: vec![],
        ignore_eos: false,
        limits: Limits::default(),
    };
    let a = run(&m, &prompts, &p, 7);
    assert_eq!(a, run(&m, &prompts, &p, 7), "same seed, same samples");
    assert_ne!(
        a.responses,
        run(&m, &prompts, &p, 8).responses,
        "another seed, other samples"
    );
    // The recorded log-probs equal a full forward's log-softmax at the sampled tokens.
    let seq: Vec<u32> = [prompts[0].clone(), a.responses[0].clone()].concat();
    let n = seq.len();
    let ids = Tensor::new(vec![seq.clone()], &Device::Cpu).unwrap();
    let pos = Tensor::new(vec![(0..n as u32).collect::<Vec<_>>()], &Device::Cpu).unwrap();
    let mask = Tensor::new(vec![vec![1u32; n]], &Device::Cpu).unwrap();
    let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
    let tgt = Tensor::new(vec![[seq[1..].to_vec(), vec![0]].concat()], &Device::Cpu).unwrap();
    let (lp, _) = m.token_logprobs(&h, &tgt, 4, false).unwrap();
    let lp: Vec<f32> = lp.get(0).unwrap().to_vec1().unwrap();
    for (k, got) in a.log_probs[0].iter().enumerate() {
        assert!(
            (got - lp[2 + k]).abs() < 1e-4,
            "token {k}: {got} vs {}",
            lp[2 + k]
        );
    }
}

#[test]
fn top_k_one_and_tiny_top_p_are_greedy() {
    let logits = [0.1f32, 2.0, -1.0, 1.9, 0.0];
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let k1 = SamplingParams {
        greedy: false,
        temperature: 1.0,
        top_k: Some(1),
        top_p: 1.0,
        max_new_tokens: 1,
        eos_ids: vec![],
        ignore_eos: false,
        limits: Limits::default(),
    };
    let p0 = SamplingParams {
        top_k: None,
        top_p: 1e-6,
        ..k1.clone()
    };
    for _ in 0..20 {
        assert_eq!(sample_row(&logits, &k1, &mut rng).0, 1);
        assert_eq!(sample_row(&logits, &p0, &mut rng).0, 1);
    }
    // top_k=2 never picks outside the two best; the frequencies follow softmax over them.
    let k2 = SamplingParams {
        top_k: Some(2),
        ..k1.clone()
    };
    let mut counts = [0usize; 5];
    for _ in 0..20_000 {
        counts[sample_row(&logits, &k2, &mut rng).0 as usize] += 1;
    }
    assert_eq!(counts[0] + counts[2] + counts[4], 0);
    let want = 1.0 / (1.0 + (-0.1f64).exp()); // p(1) = e^2 / (e^2 + e^1.9)
    let got = counts[1] as f64 / 20_000.0;
    assert!((got - want).abs() < 0.02, "{got} vs {want}");
    // The log-prob is under the full (unfiltered) distribution at the sampling temperature.
    let lse = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
    assert!((sample_row(&logits, &k1, &mut rng).1 - (2.0 - lse)).abs() < 1e-6);
    let t2 = SamplingParams {
        temperature: 0.5,
        ..k1.clone()
    };
    let lse2 = logits.iter().map(|l| (l / 0.5).exp()).sum::<f32>().ln();
    assert!((sample_row(&logits, &t2, &mut rng).1 - (2.0 / 0.5 - lse2)).abs() < 1e-5);
}

/// verl's agent loop hands only temperature, top-k and top-p to the rollout engine: do_sample
/// is never read, and temperature 0 is greedy. `val_kwargs.temperature=0.6 val_kwargs.n=4`
/// samples although `val_kwargs.do_sample` stays false by default.
#[test]
fn temperature_alone_decides_between_greedy_and_sampling() {
    let mut r = RolloutConfig {
        do_sample: false,
        ..Default::default()
    };
    assert!(
        !SamplingParams::train(&r, 8, &[]).greedy,
        "temperature 1 samples"
    );
    r.do_sample = true;
    r.temperature = 0.0;
    assert!(
        SamplingParams::train(&r, 8, &[]).greedy,
        "temperature 0 is greedy"
    );
    let mut r = RolloutConfig::default();
    let v = &mut r.val_kwargs;
    assert!(!v.do_sample && v.temperature == 0.0);
    assert!(SamplingParams::validation(&r, 8, &[]).greedy);
    r.val_kwargs.temperature = 0.6;
    r.val_kwargs.n = 4;
    let v = &r.val_kwargs;
    let p = SamplingParams::validation(&r, 8, &[]);
    assert!(!p.greedy);
    assert_eq!(p.temperature, 0.6);
    // Four copies of one prompt give more than one distinct response.
    let (_vm, m) = model();
    let prompts = vec![vec![1u32, 2, 3]; v.n];
    let out = run(&m, &prompts, &p, 11);
    let distinct: std::collections::BTreeSet<&Vec<u32>> = out.responses.iter().collect();
    assert!(distinct.len() > 1, "{:?}", out.responses);
}

/// The rollout's log-probs are the tempered ones (what the trainer recomputes as old log-probs
/// with logits / temperature): checked against a full forward whose hidden state is divided by
/// the temperature (h·W / T = (h / T)·W).
#[test]
fn sampled_log_probs_use_the_temperature() {
    let (_vm, m) = model();
    let prompt = vec![4u32, 9, 2];
    let p = SamplingParams {
        greedy: false,
        temperature: 0.6,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: 6,
        eos_ids: vec![],
        ignore_eos: false,
        limits: Limits::default(),
    };
    let a = run(&m, std::slice::from_ref(&prompt), &p, 5);
    let seq: Vec<u32> = [prompt.clone(), a.responses[0].clone()].concat();
    let n = seq.len();
    let ids = Tensor::new(vec![seq.clone()], &Device::Cpu).unwrap();
    let pos = Tensor::new(vec![(0..n as u32).collect::<Vec<_>>()], &Device::Cpu).unwrap();
    let mask = Tensor::new(vec![vec![1u32; n]], &Device::Cpu).unwrap();
    let h = (m.forward_hidden(&ids, &pos, &mask, None).unwrap() / 0.6).unwrap();
    let tgt = Tensor::new(vec![[seq[1..].to_vec(), vec![0]].concat()], &Device::Cpu).unwrap();
    let (lp, _) = m.token_logprobs(&h, &tgt, 4, false).unwrap();
    let lp: Vec<f32> = lp.get(0).unwrap().to_vec1().unwrap();
    for (k, got) in a.log_probs[0].iter().enumerate() {
        let want = lp[prompt.len() - 1 + k];
        assert!((got - want).abs() < 1e-4, "token {k}: {got} vs {want}");
    }
}

#[test]
fn sampler_state_resumes_the_stream() {
    let mut a = Sampler::new(3);
    let _: f64 = a.rng.random();
    let saved = a.state();
    let x: Vec<f64> = (0..5).map(|_| a.rng.random()).collect();
    let mut b = Sampler::restore(saved);
    let y: Vec<f64> = (0..5).map(|_| b.rng.random()).collect();
    assert_eq!(x, y);
}

/// Unfiltered sampling (no top-k/top-p: the allocation-free path) draws each token with
/// probability softmax(logits / temperature), computed here by hand.
#[test]
fn full_distribution_sampling_follows_the_tempered_softmax() {
    let logits = [0.5f32, 1.5, -0.5, 1.0];
    let t = 0.7f64;
    let p = SamplingParams {
        greedy: false,
        temperature: t,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: 1,
        eos_ids: vec![],
        ignore_eos: false,
        limits: Limits::default(),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let n = 40_000;
    let mut counts = [0usize; 4];
    for _ in 0..n {
        counts[sample_row(&logits, &p, &mut rng).0 as usize] += 1;
    }
    let z: f64 = logits.iter().map(|&l| (l as f64 / t).exp()).sum();
    for (i, &l) in logits.iter().enumerate() {
        let want = (l as f64 / t).exp() / z;
        let got = counts[i] as f64 / n as f64;
        assert!((got - want).abs() < 0.01, "token {i}: {got} vs {want}");
    }
}

/// The token's log-prob accumulates the softmax denominator in f64: with one logit 0 and
/// 49,151 at −17, an f32 running sum drops every e^−17 (under half an ulp of 1) and would say
/// log p = 0. Closed form: log p = −ln(1 + 49151·e^−17) ≈ −2.0e-3.
#[test]
fn greedy_log_prob_keeps_the_vocabulary_tail() {
    let mut logits = vec![-17f32; 49_152];
    logits[7] = 0.0;
    let want = -(1.0 + 49_151f64 * (-17f64).exp()).ln();
    let (tok, lp) = sample_row(&logits, &greedy(1, vec![]), &mut Sampler::new(0).rng);
    assert_eq!(tok, 7);
    assert!((lp as f64 - want).abs() < 1e-7, "{lp} vs {want}");
    // Full-distribution sampling reports the same log-prob for the token it draws.
    let p = SamplingParams {
        greedy: false,
        temperature: 1.0,
        ..greedy(1, vec![])
    };
    let (tok, lp) = sample_row(&logits, &p, &mut Sampler::new(3).rng);
    let want = if tok == 7 { want } else { -17.0 + want };
    assert!(
        (lp as f64 - want).abs() < 1e-6,
        "token {tok}: {lp} vs {want}"
    );
}

/// The sampler's normaliser at vector width equals the sum of f64 exponentials one at a time
/// within exp_f32's error (2 ulp of f32, 2.4e-7 relative), for vocabularies around the 16-lane
/// blocks and of SmolLM2's and Qwen's sizes, at two temperatures, with masked (−∞) entries.
#[test]
fn the_vectorized_normaliser_equals_the_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for n in [1usize, 15, 16, 17, 49_152, 151_936] {
        let mut logits: Vec<f32> = (0..n).map(|_| rng.random::<f32>() * 40.0 - 20.0).collect();
        if n > 17 {
            logits[3] = f32::NEG_INFINITY;
        }
        for t in [1.0f32, 0.7] {
            let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) / t;
            let (got, want) = (sum_exp(&logits, t, m), sum_exp_reference(&logits, t, m));
            assert!(want >= 1.0);
            assert!(
                ((got - want) / want).abs() < 2.5e-7,
                "n {n} t {t}: {got} vs {want}"
            );
        }
    }
}

/// Rows sampled in parallel draw exactly what one row after another draws: the same tokens and
/// log-probs, and each row's generator left at the same position.
#[test]
fn rows_sampled_in_parallel_equal_rows_one_by_one() {
    let (rows, vocab) = (6usize, 300usize);
    let mut g = ChaCha8Rng::seed_from_u64(9);
    let flat: Vec<f32> = (0..rows * vocab).map(|_| g.random::<f32>() * 8.0).collect();
    let logits = Tensor::from_vec(flat.clone(), (rows, vocab), &Device::Cpu).unwrap();
    let p = SamplingParams {
        greedy: false,
        temperature: 0.9,
        ..greedy(1, vec![])
    };
    // Batch rows 1, 4, 2, 7, 0, 5 hold logits rows 0..6; rows 3 and 6 are idle.
    let active = [1usize, 4, 2, 7, 0, 5];
    let fresh =
        || -> Vec<ChaCha8Rng> { (0..8).map(|i| ChaCha8Rng::seed_from_u64(100 + i)).collect() };
    let mut par = fresh();
    let got = sample_rows(&logits, &active, &p, &mut par).unwrap();
    let mut seq = fresh();
    let want: Vec<(u32, f32)> = active
        .iter()
        .enumerate()
        .map(|(i, &r)| sample_row(&flat[i * vocab..(i + 1) * vocab], &p, &mut seq[r]))
        .collect();
    assert_eq!(got, want);
    for (a, b) in par.iter().zip(&seq) {
        assert_eq!(a.get_word_pos(), b.get_word_pos());
    }
}

/// Greedy picks the first of equal largest logits (lowest id), passes over NaN entries, and
/// keeps a row that starts with NaN at id 0 (what a scan keeping the first strictly larger entry
/// gives); an all −∞ row picks 0.
#[test]
fn greedy_picks_the_first_largest_logit() {
    let g = greedy(1, vec![]);
    let pick = |l: &[f32]| sample_row(l, &g, &mut Sampler::new(0).rng).0;
    assert_eq!(pick(&[1.0, 3.0, 3.0, 2.0]), 1);
    assert_eq!(pick(&[1.0, f32::NAN, 2.0, 2.0]), 2);
    assert_eq!(pick(&[f32::NAN, 1.0, 2.0]), 0);
    assert_eq!(pick(&[f32::NEG_INFINITY; 40]), 0);
    let mut long = vec![0.5f32; 151_936];
    long[100_000] = 4.0;
    long[150_000] = 4.0;
    assert_eq!(pick(&long), 100_000);
}
