//! Our side of `scripts/bench_vs_torch.sh`: one measurement per process, so that the peak
//! resident memory (VmHWM) of each measurement is its own. The PyTorch side of the same
//! measurements is `scripts/bench/vs_torch.py`; the script runs both back to back and prints
//! the table. Each command prints one line `RESULT {json}`; numbers are reported, never asserted.
//!
//! ```text
//! cargo bench --bench vs_torch -- check  [--out FILE]                 prompt ids, last logits, greedy ids
//! cargo bench --bench vs_torch -- fwdbwd [--batch 8] [--seq 256] [--warmup 1] [--reps 2] [--bf16 0] [--grad-sinks 1]
//! cargo bench --bench vs_torch -- gen    [--batch 32] [--new 128] [--warmup-new 4] [--bf16 0]
//! cargo bench --bench vs_torch -- adamw  [--warmup 1] [--reps 3]
//! ```
//! Common options: `--model FILE.gguf` or an HF folder (default MAIN_PPO_SMOLLM2, else the cache of
//! `scripts/fetch_smollm2.sh`), `--prompt FILE` (the text to tokenise; default: a GSM8K question
//! in SmolLM2's chat format). Threads: candle's CPU kernels follow `RAYON_NUM_THREADS`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use main_ppo::config::OptimConfig;
use main_ppo::model::grad_sink::GradSinks;
use main_ppo::rollout::{generate, generate_all, Limits, Sampler, SamplingParams};
use main_ppo::trainer::AdamW;
use serde_json::{json, Value};

const DEFAULT_PROMPT: &str = "<|im_start|>user\nNatalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?<|im_end|>\n<|im_start|>assistant\n";

type BoxError = Box<dyn std::error::Error>;

/// Peak resident memory of this process so far (Linux `VmHWM`), in bytes.
fn peak_rss_bytes() -> Option<u64> {
    main_ppo::metrics::peak_rss_bytes()
}

struct Args {
    cmd: String,
    opts: HashMap<String, String>,
}

impl Args {
    fn parse() -> Result<Self, BoxError> {
        // `cargo bench` appends `--bench`; it is not ours.
        let raw: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| a != "--bench")
            .collect();
        let mut it = raw.into_iter();
        // A plain `cargo bench` (all benches) passes no command: nothing to do here.
        let cmd = it.next().unwrap_or_default();
        let mut opts = HashMap::new();
        while let Some(k) = it.next() {
            let Some(name) = k.strip_prefix("--") else {
                return Err(
                    format!("unexpected argument `{k}`: options are `--name value`").into(),
                );
            };
            let v = it
                .next()
                .ok_or_else(|| format!("option `--{name}` needs a value"))?;
            opts.insert(name.to_string(), v);
        }
        Ok(Self { cmd, opts })
    }

    fn usize(&self, name: &str, default: usize) -> Result<usize, BoxError> {
        match self.opts.get(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| {
                format!("option `--{name}`: `{v}` is not a non-negative integer").into()
            }),
        }
    }

    fn str(&self, name: &str) -> Option<&str> {
        self.opts.get(name).map(String::as_str)
    }
}

fn model_path(a: &Args) -> PathBuf {
    if let Some(p) = a.str("model") {
        return PathBuf::from(p);
    }
    PathBuf::from(std::env::var("MAIN_PPO_SMOLLM2").unwrap_or_else(|_| {
        format!(
            "{}/.cache/main_ppo/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap_or_default()
        )
    }))
}

fn prompt_text(a: &Args) -> Result<String, BoxError> {
    match a.str("prompt") {
        None => Ok(DEFAULT_PROMPT.to_string()),
        Some(p) => std::fs::read_to_string(p).map_err(|e| format!("--prompt {p}: {e}").into()),
    }
}

fn emit(v: Value) {
    println!("RESULT {v}");
}

fn main() {
    // As the binary does at start-up.
    main_ppo::kernels::alloc::keep_freed_memory();
    if let Err(e) = run() {
        eprintln!("vs_torch: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), BoxError> {
    let a = Args::parse()?;
    if a.cmd.is_empty() {
        println!(
            "vs_torch: no command, nothing measured (scripts/bench_vs_torch.sh drives it: \
             `cargo bench --bench vs_torch -- check|fwdbwd|gen|adamw`)"
        );
        return Ok(());
    }
    let path = model_path(&a);
    if !path.is_file() && !path.is_dir() {
        return Err(format!(
            "no model at {} (run scripts/fetch_smollm2.sh or pass --model FILE.gguf or an HF folder)",
            path.display()
        )
        .into());
    }
    let threads = candle_core::utils::get_num_threads();
    let t_load = Instant::now();
    // A GGUF file, or an HF folder (random-weight checkpoints of other shapes:
    // scripts/bench_qwen3_5.py).
    let (loaded, tok) = if path.is_dir() {
        let l = main_ppo::weights::hf::load_dir(
            &path,
            &Default::default(),
            DType::F32,
            &Device::Cpu,
            true,
        )?;
        (
            l,
            main_ppo::weights::load_tokenizer(&path.display().to_string())?,
        )
    } else {
        let (l, content) = main_ppo::weights::gguf::load(&path, DType::F32, &Device::Cpu, true)?;
        let tok = main_ppo::weights::gguf::tokenizer(&content, &path)?;
        (l, tok)
    };
    let load_s = t_load.elapsed().as_secs_f64();
    let prompt = tok.encode(&prompt_text(&a)?)?;
    let base = json!({
        "side": "main_ppo",
        "threads": threads,
        "load_s": load_s,
        "prompt_tokens": prompt.len(),
    });
    let mut out = match a.cmd.as_str() {
        "check" => check(&a, &loaded.model, &prompt, &tok.eos_token_ids)?,
        "fwdbwd" => {
            // Training's default (verl's enable_gradient_checkpointing=true); `--checkpointing 0`
            // keeps every activation instead.
            let mut model = loaded.model;
            model.set_exec(main_ppo::model::Exec {
                recompute: a.usize("checkpointing", 1)? != 0,
                composed: a.usize("composed", 0)? != 0,
                ..model.exec()
            });
            // `--bf16 1`: verl's mixed precision (bf16 products, f32 sums; AMX CPUs).
            model.set_exec(main_ppo::model::Exec {
                bf16: a.usize("bf16", 0)? != 0,
                ..model.exec()
            });
            fwdbwd(&a, &model, &loaded.varmap)?
        }
        "gen" => {
            let mut model = loaded.model;
            model.set_exec(main_ppo::model::Exec {
                bf16: a.usize("bf16", 0)? != 0,
                ..model.exec()
            });
            gen(&a, &model, &prompt, &tok.eos_token_ids)?
        }
        "adamw" => adamw(&a, &loaded.varmap)?,
        other => {
            return Err(
                format!("unknown command `{other}`: expected check, fwdbwd, gen or adamw").into(),
            )
        }
    };
    let obj = out.as_object_mut().expect("measurements are JSON objects");
    for (k, v) in base.as_object().expect("object") {
        obj.insert(k.clone(), v.clone());
    }
    obj.insert("peak_rss_bytes".into(), json!(peak_rss_bytes()));
    emit(out);
    Ok(())
}

fn greedy(max_new_tokens: usize, eos: &[u32]) -> SamplingParams {
    SamplingParams {
        greedy: true,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens,
        eos_ids: eos.to_vec(),
        ignore_eos: true,
        limits: Limits::default(),
    }
}

/// The prompt's ids, the logits at its last position (`[vocab]`) and a greedy continuation,
/// written to `--out` for the PyTorch side to compare against.
fn check(
    a: &Args,
    model: &main_ppo::model::CausalLm,
    prompt: &[u32],
    eos: &[u32],
) -> Result<Value, BoxError> {
    let model = model.no_grad();
    let n = prompt.len();
    let ids = Tensor::from_vec(prompt.to_vec(), (1, n), &Device::Cpu)?;
    let pos = Tensor::arange(0u32, n as u32, &Device::Cpu)?.unsqueeze(0)?;
    let mask = Tensor::ones((1, n), DType::U32, &Device::Cpu)?;
    let h = model.forward_hidden(&ids, &pos, &mask, None)?; // [1, n, hidden]
    let last = model.logits(&h.narrow(1, n - 1, 1)?)?; // [1, 1, vocab]
    let logits: Vec<f32> = last.flatten_all()?.to_vec1()?;
    let new = a.usize("new", 32)?;
    let r = generate(
        &model,
        prompt,
        &vec![1u8; n],
        1,
        n,
        &greedy(new, eos),
        &mut Sampler::new(0),
    )?;
    let v = json!({
        "what": "check",
        "prompt_ids": prompt,
        "last_logits": logits,
        "greedy_ids": r.responses[0],
        "eos_ids": eos,
    });
    if let Some(p) = a.str("out") {
        std::fs::write(Path::new(p), serde_json::to_vec(&v)?)
            .map_err(|e| format!("--out {p}: {e}"))?;
    }
    Ok(
        json!({"what": "check", "out": a.str("out"), "greedy_ids": r.responses[0], "prompt_ids": prompt}),
    )
}

/// Forward + backward of the mean log-probability of `[batch, seq]` tokens (every position
/// scored, as a policy-gradient loss does), `warmup` untimed then `reps` timed repetitions.
/// Each backward sums the weights' gradients as the trainer's micro-batches do (in
/// `model::grad_sink`'s buffers, taken out as tensors at the end, inside the timing);
/// `--grad-sinks 0` leaves them to candle's gradient store instead (the path before the sinks,
/// for an A/B on one binary).
fn fwdbwd(
    a: &Args,
    model: &main_ppo::model::CausalLm,
    varmap: &candle_nn::VarMap,
) -> Result<Value, BoxError> {
    let (b, t) = (a.usize("batch", 8)?, a.usize("seq", 256)?);
    let (warmup, reps) = (a.usize("warmup", 1)?, a.usize("reps", 2)?.max(1));
    // The same ids as the PyTorch side: (i * 7919) mod 49000 over the row-major [b, t] grid.
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7919 % 49000) as u32).collect();
    let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu)?;
    let pos = Tensor::arange(0u32, t as u32, &Device::Cpu)?
        .unsqueeze(0)?
        .repeat((b, 1))?; // [b, t]
    let mask = Tensor::ones((b, t), DType::U32, &Device::Cpu)?;
    let (mut fwd_s, mut bwd_s, mut loss_v) = (Vec::new(), Vec::new(), 0f32);
    // As the trainer's update runs its micro-batches: large blocks on huge pages and recycled
    // from one forward+backward to the next (`kernels::alloc::huge_pages`).
    let chunk = main_ppo::trainer::actor::logit_chunk(model.args.vocab_size); // as training
    let vars = match a.usize("grad-sinks", 1)? {
        0 => Vec::new(),
        _ => varmap.all_vars(),
    };
    main_ppo::kernels::alloc::huge_pages(|| -> Result<(), BoxError> {
        for i in 0..warmup + reps {
            let t0 = Instant::now();
            let sinks = GradSinks::open(vars.iter().map(|v| v.as_tensor()));
            let h = model.forward_hidden(&ids, &pos, &mask, None)?; // [b, t, hidden]
            let (lp, _) = model.token_logprobs(&h, &ids, chunk, false)?; // [b, t]
            let loss = lp.mean_all()?.neg()?;
            let f = t0.elapsed().as_secs_f64();
            let mut grads = loss.backward()?;
            sinks.drain_into(&mut grads)?;
            let total = t0.elapsed().as_secs_f64();
            loss_v = loss.to_scalar::<f32>()?;
            drop(grads);
            if i >= warmup {
                fwd_s.push(f);
                bwd_s.push(total - f);
            }
        }
        Ok(())
    })?;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let secs: Vec<f64> = fwd_s.iter().zip(&bwd_s).map(|(f, b)| f + b).collect();
    Ok(json!({
        "what": "fwdbwd", "batch": b, "seq": t, "warmup": warmup, "reps": reps,
        "seconds": secs, "forward_s": mean(&fwd_s), "backward_s": mean(&bwd_s),
        "tokens_per_s": (b * t) as f64 / mean(&secs), "loss": loss_v,
    }))
}

/// Greedy generation of `new` tokens for `batch` copies of the prompt, EOS ignored, prefill
/// included in the time; a short untimed warm-up generation first.
fn gen(
    a: &Args,
    model: &main_ppo::model::CausalLm,
    prompt: &[u32],
    eos: &[u32],
) -> Result<Value, BoxError> {
    let (batch, new) = (a.usize("batch", 32)?, a.usize("new", 128)?);
    let warm = a.usize("warmup-new", 4)?;
    // The production path: the scheduler (continuous batching, packed decode on the CPU).
    let prompts: Vec<&[u32]> = (0..batch).map(|_| prompt).collect();
    if warm > 0 {
        generate_all(
            model,
            &prompts,
            &greedy(warm, eos),
            &mut Sampler::new(0),
            None,
        )?;
    }
    let t0 = Instant::now();
    let r = generate_all(
        model,
        &prompts,
        &greedy(new, eos),
        &mut Sampler::new(0),
        None,
    )?;
    let secs = t0.elapsed().as_secs_f64();
    let tokens: usize = r.responses.iter().map(Vec::len).sum();
    Ok(json!({
        "what": "gen", "batch": batch, "new": new, "seconds": secs, "tokens": tokens,
        "tokens_per_s": tokens as f64 / secs, "row0_ids": r.responses[0],
    }))
}

/// One `trainer::AdamW` step over every parameter of the model (random gradients), verl's
/// actor defaults (lr 1e-6, betas 0.9/0.999, eps 1e-8, weight decay 0.01).
fn adamw(a: &Args, varmap: &candle_nn::VarMap) -> Result<Value, BoxError> {
    let (warmup, reps) = (a.usize("warmup", 1)?, a.usize("reps", 3)?.max(1));
    let vars = varmap.data().lock().map_err(|_| "var map lock")?.clone();
    let params: usize = vars.values().map(|v| v.elem_count()).sum();
    let mut grads = GradStore::default();
    for v in vars.values() {
        let g = (Tensor::randn(0f32, 1.0, v.shape(), &Device::Cpu)? * 1e-3)?;
        grads.insert(v.as_tensor(), g);
    }
    let cfg = OptimConfig::with_lr(1e-6);
    let mut opt = AdamW::new(vars, &cfg).unwrap();
    let mut secs = Vec::new();
    for i in 0..warmup + reps {
        let t0 = Instant::now();
        opt.step(&grads, cfg.lr)?;
        if i >= warmup {
            secs.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(json!({
        "what": "adamw", "params": params, "tensors": opt.vars().len(), "warmup": warmup,
        "reps": reps, "seconds": secs,
        "step_s": secs.iter().sum::<f64>() / secs.len() as f64,
    }))
}
