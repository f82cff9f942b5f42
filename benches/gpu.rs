//! The model's phases on a device at a real model's size, each against its baseline in the same
//! run: generation (tokens/s at 256 rows, device sampling against copying the logits to the
//! host), forward+backward (tokens/s and peak device memory at verl's micro-batch 16 × 768 with
//! bf16 products, blocked attention, the fused LM head and recomputation, against the plain
//! f32 composition at a size it fits), and an AdamW step over every parameter.
//!
//! Needs a model directory (HF layout: config.json, safetensors, tokenizer): MAIN_PPO_GPU_MODEL
//! (scripts/gpu_model.py writes a Qwen2.5-0.5B-shaped one with random weights, which every row
//! decodes to its length limit). `MAIN_PPO_BENCH_DEVICE` as `trainer.device` (default cuda).
//! `cargo bench --features cuda --bench gpu -- gen|train|adamw` runs one part. Numbers are
//! printed; nothing is asserted.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use main_ppo::config::OptimConfig;
use main_ppo::model::{CausalLm, Exec};
use main_ppo::rollout::{generate_all, Limits, Sampler, SamplingParams};
use main_ppo::trainer::AdamW;

/// (peak bytes in use, peak bytes reserved) of the device's memory pool, in GiB, reset after.
fn peaks(dev: &Device) -> (f64, f64) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        use main_ppo::kernels::cuda::memory;
        let (u, r) = memory::peaks(d).unwrap();
        memory::reset_peaks(d).unwrap();
        let gib = (1u64 << 30) as f64;
        return (u as f64 / gib, r as f64 / gib);
    }
    let _ = dev;
    (f64::NAN, f64::NAN)
}

/// Forward+backward of a `b × t` batch of random tokens with `exec`: (seconds, peak GiB).
fn train_step(model: &mut CausalLm, exec: Exec, b: usize, t: usize, dev: &Device) -> (f64, f64) {
    model.set_exec(exec);
    let vocab = model.args.vocab_size;
    let ids = Tensor::from_vec(
        (0..b * t)
            .map(|i| ((i * 7919) % vocab) as u32)
            .collect::<Vec<u32>>(),
        (b, t),
        dev,
    )
    .unwrap();
    let pos = Tensor::arange(0u32, t as u32, dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((b, 1))
        .unwrap();
    let mask = Tensor::ones((b, t), DType::U32, dev).unwrap();
    peaks(dev);
    dev.synchronize().unwrap();
    let t0 = Instant::now();
    let h = model.forward_hidden(&ids, &pos, &mask, None).unwrap();
    let (lp, ent) = model.token_logprobs(&h, &ids, 1 << 22, true).unwrap();
    let loss = (lp.mean_all().unwrap().neg().unwrap() + ent.unwrap().mean_all().unwrap()).unwrap();
    let grads = loss.backward().unwrap();
    dev.synchronize().unwrap();
    let secs = t0.elapsed().as_secs_f64();
    drop(grads);
    (secs, peaks(dev).0)
}

fn main() {
    let Ok(path) = std::env::var("MAIN_PPO_GPU_MODEL") else {
        eprintln!(
            "gpu bench skipped: MAIN_PPO_GPU_MODEL is not set (scripts/gpu_model.py writes one)"
        );
        return;
    };
    let only: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let part = |p: &str| only.as_deref().is_none_or(|o| o == p);
    let spec = std::env::var("MAIN_PPO_BENCH_DEVICE").unwrap_or_else(|_| "cuda".into());
    let dev = main_ppo::model::device(&spec).unwrap_or_else(|e| {
        eprintln!("gpu bench: MAIN_PPO_BENCH_DEVICE={spec}: {e}");
        std::process::exit(2);
    });
    let t0 = Instant::now();
    let (mut loaded, _tok) = main_ppo::weights::load_model_and_tokenizer(
        &path,
        None,
        &Default::default(),
        DType::F32,
        &dev,
        true,
    )
    .unwrap();
    let params: usize = loaded
        .varmap
        .all_vars()
        .iter()
        .map(|v| v.elem_count())
        .sum();
    println!(
        "device {dev:?}; {path}: {params} parameters loaded in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let fast = Exec {
        recompute: true,
        composed: false,
        bf16: true,
        dense_experts: false,
    };
    let plain = Exec {
        recompute: false,
        composed: true,
        bf16: false,
        dense_experts: false,
    };
    if part("gen") {
        // 256 rows of a 128-token prompt, 128 new tokens each (EOS ignored), sampled at
        // temperature 1: device sampling (bf16 products) against the plain composition that
        // copies every step's logits to the host (rows 32, the same per-row work).
        let vocab = loaded.model.args.vocab_size;
        for (name, exec, rows) in [
            ("device sampling, bf16", fast, 256usize),
            ("host sampling, f32 composition", plain, 32),
        ] {
            let mut m = loaded.model.no_grad();
            m.set_exec(Exec {
                recompute: false,
                ..exec
            });
            let prompts: Vec<Vec<u32>> = (0..rows)
                .map(|r| {
                    (0..128)
                        .map(|i| ((r * 131 + i * 7) % vocab) as u32)
                        .collect()
                })
                .collect();
            let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
            let p = SamplingParams {
                greedy: false,
                temperature: 1.0,
                top_k: None,
                top_p: 1.0,
                max_new_tokens: 128,
                eos_ids: vec![],
                ignore_eos: true,
                limits: Limits {
                    max_num_seqs: 1024,
                    max_num_batched_tokens: 1 << 20,
                    kv_cache_bytes: 64 << 30,
                    gpu_memory_utilization: 0.5,
                },
            };
            peaks(&dev);
            let t0 = Instant::now();
            let out = generate_all(&m, &refs, &p, &mut Sampler::new(0), None).unwrap();
            dev.synchronize().unwrap();
            let secs = t0.elapsed().as_secs_f64();
            let n: usize = out.responses.iter().map(Vec::len).sum();
            println!(
                "generation, {name}: {rows} rows x 128 new tokens: {n} tokens in {secs:.2} s = {:.0} tokens/s (prefill included), peak {:.1} GiB",
                n as f64 / secs,
                peaks(&dev).0
            );
        }
    }
    if part("train") {
        for (name, exec, b, t) in [
            (
                "bf16 + blocked attention + fused head + recompute",
                fast,
                16usize,
                768usize,
            ),
            (
                "bf16 + blocked attention + fused head + recompute",
                fast,
                4,
                512,
            ),
            ("plain f32 composition", plain, 4, 512),
        ] {
            for rep in 0..2 {
                let (secs, peak) = train_step(&mut loaded.model, exec, b, t, &dev);
                println!(
                    "forward+backward {b} x {t}, {name} (run {rep}): {secs:.3} s = {:.0} tokens/s, peak {peak:.1} GiB",
                    (b * t) as f64 / secs
                );
            }
        }
    }
    if part("adamw") {
        let vars = loaded.varmap.all_vars();
        let named: std::collections::HashMap<String, candle_core::Var> = vars
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("p{i:04}"), v.clone()))
            .collect();
        let loss = vars
            .iter()
            .map(|v| v.as_tensor().sqr().unwrap().sum_all().unwrap())
            .reduce(|a, b| (a + b).unwrap())
            .unwrap();
        let grads = loss.backward().unwrap();
        let mut opt = AdamW::new(named, &OptimConfig::default()).unwrap();
        for i in 0..4 {
            dev.synchronize().unwrap();
            let t0 = Instant::now();
            let norm = main_ppo::trainer::optim::grad_norm(opt.vars(), &grads).unwrap();
            dev.synchronize().unwrap();
            let tn = t0.elapsed().as_secs_f64();
            opt.step(&grads, 1e-6).unwrap();
            dev.synchronize().unwrap();
            println!(
                "AdamW step {i} over {params} parameters: {:.1} ms (gradient norm {norm:.3e} in {:.1} ms)",
                (t0.elapsed().as_secs_f64() - tn) * 1e3,
                tn * 1e3
            );
        }
    }
}
