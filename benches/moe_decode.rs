//! Qwen3-MoE greedy generation: the packed decode engine (continuous batching, each expert on
//! the rows routed to it, weights packed once per call) against the tensor composition
//! (`rollout::generate`, one padded batch, the path MoE models took before), f32 on the CPU,
//! 8 experts top-2, hidden 256, expert width 512, 2 layers, vocabulary 512; 32 prompts of 16-31
//! tokens, 64 new tokens each (EOS ignored). Prints the median of 3 timed runs of each (after
//! one warm-up, alternating), tokens/s, the ratio, and whether both generated the same tokens.
//! Run: `cargo bench --bench moe_decode`.

use std::time::Instant;

use candle_core::DType;
use main_ppo::rollout::{generate, generate_all, Limits, Sampler, SamplingParams};

fn main() {
    let args = main_ppo::testing::moe_bench_args();
    let (_vm, m) = main_ppo::testing::tiny_model(&args, DType::F32, 0.05);
    let prompts: Vec<Vec<u32>> = (0..32)
        .map(|r| {
            (0..16 + r % 16)
                .map(|i| ((r * 131 + i * 7919 + 13) % 509) as u32 + 1)
                .collect()
        })
        .collect();
    let new = 64;
    let p = SamplingParams {
        greedy: true,
        temperature: 1.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: new,
        eos_ids: vec![],
        ignore_eos: true,
        limits: Limits::default(),
    };
    let w = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for t in &prompts {
        ids.extend(std::iter::repeat_n(0u32, w - t.len()));
        ids.extend(t);
        mask.extend(std::iter::repeat_n(0u8, w - t.len()));
        mask.extend(std::iter::repeat_n(1u8, t.len()));
    }
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let packed = || generate_all(&m, &refs, &p, &mut Sampler::new(1), None).unwrap();
    let composed =
        || generate(&m, &ids, &mask, prompts.len(), w, &p, &mut Sampler::new(1)).unwrap();
    let same = packed().responses == composed().responses;
    let (mut tp, mut tc) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = Instant::now();
        packed();
        tp.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        composed();
        tc.push(t.elapsed().as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (sp, sc) = (median(&mut tp), median(&mut tc));
    let tokens = (prompts.len() * new) as f64;
    println!(
        "Qwen3-MoE greedy generation, 32 x {new} new tokens, {} threads",
        rayon::current_num_threads()
    );
    println!("  packed engine: {sp:.3} s ({:.0} tokens/s)", tokens / sp);
    println!("  composition:   {sc:.3} s ({:.0} tokens/s)", tokens / sc);
    println!("  ratio: {:.2}x; same tokens: {same}", sc / sp);
}
