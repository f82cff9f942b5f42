//! SmolLM2-135M on this machine: generation tokens/s at batch 1, 8 and 32 with 128 new tokens
//! (greedy, EOS ignored so every row generates 128), forward+backward tokens/s at 8 × 256
//! tokens, an AdamW step over all parameters, and peak memory (VmHWM). `cargo bench --bench
//! model -- gen|train|adamw` runs one part. Needs the model: `scripts/fetch_smollm2.sh` (or
//! MAIN_PPO_SMOLLM2). Run: `cargo bench --bench model`. `MAIN_PPO_BENCH_DEVICE=cuda` (a build
//! with `--features cuda`) runs it on the GPU (`trainer.device`'s spellings: cpu, cuda, cuda:N),
//! with CUDA synchronised before each timer reads.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use main_ppo::config::OptimConfig;
use main_ppo::rollout::{generate, generate_all, Sampler, SamplingParams};
use main_ppo::trainer::AdamW;

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map(|kib| kib / 1024.0)
        .unwrap_or(f64::NAN)
}

fn main() {
    let path = std::env::var("MAIN_PPO_SMOLLM2").unwrap_or_else(|_| {
        format!(
            "{}/.cache/main_ppo/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    if !std::path::Path::new(&path).is_file() {
        eprintln!("model bench skipped: no {path} (run scripts/fetch_smollm2.sh)");
        return;
    }
    // As the binary does (MAIN_PPO_GLIBC_MALLOC=1 keeps glibc's defaults, to measure the difference).
    if std::env::var_os("MAIN_PPO_GLIBC_MALLOC").is_none() {
        main_ppo::kernels::alloc::keep_freed_memory();
    }
    let only: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let spec = std::env::var("MAIN_PPO_BENCH_DEVICE").unwrap_or_else(|_| "cpu".into());
    let dev = match main_ppo::model::device(&spec) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("model bench: MAIN_PPO_BENCH_DEVICE={spec}: {e}");
            std::process::exit(2);
        }
    };
    let sync = |d: &Device| d.synchronize().unwrap();
    println!("device: {dev:?}");
    let (loaded, content) =
        main_ppo::weights::gguf::load(std::path::Path::new(&path), DType::F32, &dev, true).unwrap();
    let tok = main_ppo::weights::gguf::tokenizer(&content, std::path::Path::new(&path)).unwrap();
    let prompt = tok.encode("<|im_start|>user\nNatalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?<|im_end|>\n<|im_start|>assistant\n").unwrap();
    println!(
        "model loaded, peak RSS {:.0} MiB; prompt {} tokens",
        peak_rss_mib(),
        prompt.len()
    );
    let p = SamplingParams {
        greedy: true,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: 128,
        eos_ids: tok.eos_token_ids.clone(),
        ignore_eos: true,
        limits: main_ppo::rollout::Limits::default(),
    };
    for batch in [1usize, 8, 32] {
        if only.as_deref().is_some_and(|o| o != "gen") {
            break;
        }
        // Back to back: the tensor composition (one padded batch) and the scheduler's packed
        // decode path, on the same prompts.
        let ids: Vec<u32> = (0..batch).flat_map(|_| prompt.clone()).collect();
        let mask = vec![1u8; ids.len()];
        let t0 = Instant::now();
        let out = generate(
            &loaded.model,
            &ids,
            &mask,
            batch,
            prompt.len(),
            &p,
            &mut Sampler::new(0),
        )
        .unwrap();
        let secs = t0.elapsed().as_secs_f64();
        let n: usize = out.responses.iter().map(Vec::len).sum();
        println!("generation batch {batch:>2} (composition): {n} tokens in {secs:.1} s = {:.1} tokens/s (prefill included), peak RSS {:.0} MiB", n as f64 / secs, peak_rss_mib());
        let prompts: Vec<&[u32]> = (0..batch).map(|_| prompt.as_slice()).collect();
        let t0 = Instant::now();
        let fast = generate_all(&loaded.model, &prompts, &p, &mut Sampler::new(0), None).unwrap();
        let secs = t0.elapsed().as_secs_f64();
        let n: usize = fast.responses.iter().map(Vec::len).sum();
        let same = fast.responses == out.responses;
        println!("generation batch {batch:>2} (scheduler):   {n} tokens in {secs:.1} s = {:.1} tokens/s (prefill included), peak RSS {:.0} MiB, same tokens: {same}", n as f64 / secs, peak_rss_mib());
    }
    if only.as_deref().is_none_or(|o| o == "adamw") {
        let vars = loaded.varmap.all_vars();
        let named: std::collections::HashMap<String, candle_core::Var> = vars
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("p{i:04}"), v.clone()))
            .collect();
        let params: usize = vars.iter().map(|v| v.elem_count()).sum();
        let loss = vars
            .iter()
            .map(|v| v.as_tensor().sqr().unwrap().sum_all().unwrap())
            .reduce(|a, b| (a + b).unwrap())
            .unwrap();
        let grads = loss.backward().unwrap();
        let mut opt = AdamW::new(named, &OptimConfig::default()).unwrap();
        for i in 0..3 {
            let t0 = Instant::now();
            opt.step(&grads, 1e-6).unwrap();
            sync(&dev);
            println!(
                "AdamW step {i} over {params} parameters: {:.3} s",
                t0.elapsed().as_secs_f64()
            );
        }
    }
    if only.as_deref().is_none_or(|o| o == "train") {
        let (b, t) = (8usize, 256usize);
        let ids = Tensor::from_vec(
            (0..b * t)
                .map(|i| (i * 7919 % 49000) as u32)
                .collect::<Vec<u32>>(),
            (b, t),
            &dev,
        )
        .unwrap();
        let pos = Tensor::arange(0u32, t as u32, &dev)
            .unwrap()
            .unsqueeze(0)
            .unwrap()
            .repeat((b, 1))
            .unwrap();
        let mask = Tensor::ones((b, t), DType::U32, &dev).unwrap();
        let t0 = Instant::now();
        let h = loaded
            .model
            .forward_hidden(&ids, &pos, &mask, None)
            .unwrap();
        let (lp, _) = loaded.model.token_logprobs(&h, &ids, 256, false).unwrap();
        let loss = lp.mean_all().unwrap().neg().unwrap();
        sync(&dev);
        let fwd = t0.elapsed().as_secs_f64();
        let grads = loss.backward().unwrap();
        sync(&dev);
        let total = t0.elapsed().as_secs_f64();
        drop(grads);
        println!(
            "forward+backward {b} x {t}: forward {fwd:.1} s, backward {:.1} s, {:.1} tokens/s, peak RSS {:.0} MiB",
            total - fwd,
            (b * t) as f64 / total,
            peak_rss_mib()
        );
    }
}
