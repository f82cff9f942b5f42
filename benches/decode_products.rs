//! The decode step's bf16 products at generation's shape: 32 rows (one token per sequence)
//! times SmolLM2-135M's weights (`q|k|v`, `o`, `gate|up`, `down` of one layer, and the
//! 49,152-entry LM head), each weight packed once (`bf16::PackedB`) as the decode engine packs
//! it. Weights of 30 layers are allocated so that the working set exceeds the caches, as in
//! generation. Prints the weights' bytes streamed per second next to a baseline in the same
//! run: a plain parallel sum over the same number of bytes (what the memory system gives
//! two threads), the time of each shape over all layers, and the fixed cost of one call. The
//! products run inside a `kernels::team` session, as the decode engine runs them (the step is
//! also timed through rayon, for comparison). Run:
//! `cargo bench --bench decode_products` (set RAYON_NUM_THREADS; MAIN_PPO_CPU and
//! MAIN_PPO_BF16_KERNEL choose the kernel). The last line also gives the products' GFLOP/s,
//! to set against the CPU's FMA peak where the step is bound by arithmetic (the widening
//! kernels: AVX2, NEON). Skipped with MAIN_PPO_BF16_KERNEL=none.

use std::time::Instant;

use main_ppo::kernels::bf16::{self, PackedB};
use main_ppo::kernels::simd::Par;
use main_ppo::kernels::team;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

fn main() {
    if !bf16::available() {
        eprintln!("skipped: MAIN_PPO_BF16_KERNEL=none");
        return;
    }
    let (m, h, inter, vocab, layers) = (32usize, 576usize, 1536usize, 49_152usize, 30usize);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let mut pack = |k: usize, n: usize| {
        let w: Vec<f32> = (0..k * n).map(|_| rng.random_range(-0.1..0.1)).collect();
        PackedB::new(&w, n, 1, k, n, Par::Rayon)
    };
    // Per layer: (k, n) of q|k|v, o, gate|up, down.
    let shapes = [(h, 960), (h, h), (h, 2 * inter), (inter, h)];
    let mats: Vec<Vec<PackedB>> = (0..layers)
        .map(|_| shapes.iter().map(|&(k, n)| pack(k, n)).collect())
        .collect();
    let head = pack(h, vocab);
    let big = pack(h, 576 * 30);
    let bytes: usize =
        layers * shapes.iter().map(|&(k, n)| 2 * k * n).sum::<usize>() + 2 * h * vocab;
    let a: Vec<f32> = (0..m * inter)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut out = vec![0f32; m * vocab];
    // `dst[m, n] = a[m, k] · p`.
    let product = |out: &mut [f32], p: &PackedB| {
        let (k, n) = p.dims();
        bf16::gemm_packed(&mut out[..m * n], m, &a, k, 1, p, false, Par::Rayon);
    };
    // Seconds per call of `f`, over `reps` calls.
    let timed = |reps: usize, f: &mut dyn FnMut()| {
        let t = Instant::now();
        (0..reps).for_each(|_| f());
        t.elapsed().as_secs_f64() / reps as f64
    };
    let step = |out: &mut [f32]| {
        mats.iter().flatten().for_each(|p| product(out, p));
        product(out, &head);
    };
    let plain: Vec<u64> = vec![1; bytes / 8];
    let sum = || {
        plain
            .par_chunks(1 << 16)
            .map(|c| c.iter().sum::<u64>())
            .sum::<u64>()
    };
    step(&mut out);
    std::hint::black_box(sum());
    let reps = 20;
    let (mut t_step, mut t_sum, mut t_rayon) = (0f64, 0f64, 0f64);
    for _ in 0..reps {
        t_step += timed(1, &mut || team::session(|| step(&mut out)));
        t_rayon += timed(1, &mut || step(&mut out));
        t_sum += timed(1, &mut || {
            std::hint::black_box(sum());
        });
    }
    let gbs = |t: f64| bytes as f64 * reps as f64 / t / 1e9;
    // One small product repeated on a weight that stays in cache: the fixed cost per call
    // (packing the rows, starting and ending the parallel loop) on the team, through rayon
    // from outside its pool, and on this thread alone; then one product as wide as 30 of them.
    let small = &mats[0][1];
    let s = team::session(|| timed(reps * layers, &mut || product(&mut out, small)));
    let r = timed(reps * layers, &mut || product(&mut out, small));
    let one = timed(reps * layers, &mut || {
        let (k, n) = small.dims();
        bf16::gemm_packed(&mut out[..m * n], m, &a, k, 1, small, false, Par::None)
    });
    println!(
        "  576x576 same matrix: {:.1} us per call on the team, {:.1} through rayon, {:.1} on one thread",
        s * 1e6,
        r * 1e6,
        one * 1e6
    );
    let s = team::session(|| timed(reps, &mut || product(&mut out, &big)));
    let wide = 2 * h * 576 * 30;
    println!(
        "  576x(30*576) one call: {:.2} ms, {:.1} GB/s",
        s * 1e3,
        wide as f64 / s / 1e9
    );
    // Each shape over all layers, then the LM head: where the step's time goes.
    let groups: Vec<Vec<&PackedB>> = (0..shapes.len())
        .map(|i| mats.iter().map(|l| &l[i]).collect())
        .chain([vec![&head]])
        .collect();
    for g in &groups {
        let s = team::session(|| timed(reps, &mut || g.iter().for_each(|p| product(&mut out, p))));
        let (k, n) = g[0].dims();
        let b = g.len() * 2 * k * n;
        println!(
            "  {k}x{n}: {:.2} ms per step, {:.1} GB/s",
            s * 1e3,
            b as f64 / s / 1e9
        );
    }
    println!(
        "decode products, {m} rows, {:.0} MB of bf16 weights: {:.2} ms per step = {:.1} GB/s; \
         {:.1} GFLOP/s; plain parallel sum of as many bytes: {:.2} ms = {:.1} GB/s; ratio {:.2} \
         ({} threads, {}, {}); through rayon instead of the team: {:.2} ms",
        bytes as f64 / 1e6,
        t_step / reps as f64 * 1e3,
        gbs(t_step),
        // Two flops per weight (bf16: two bytes) and row.
        gbs(t_step) * m as f64,
        t_sum / reps as f64 * 1e3,
        gbs(t_sum),
        t_sum / t_step,
        rayon::current_num_threads(),
        bf16::describe(),
        main_ppo::kernels::cpu::describe(),
        t_rayon / reps as f64 * 1e3,
    );
    std::hint::black_box(&out);
}
