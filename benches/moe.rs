//! Qwen3-MoE layers of experts, forward + backward, each expert computed on the tokens routed to
//! it (the default) against every expert computed on every token (`Exec::dense_experts`, the
//! reference with zero weights where a token was not routed), f32 on the CPU, 8 experts top-2,
//! hidden 256, expert width 512, 8 × 256 tokens: (1) one layer of experts alone as candle ops
//! (router and experts, input and weight gradients), (2) a whole 2-layer model of such layers
//! (attention, LM head and log-probs included): the hand-written layer (the default), the
//! grouped composition (`Exec::composed`) and the dense reference. Prints the median of 5
//! timed runs of each (after one warm-up), their ratios, and that all give the same results.
//! Run: `cargo bench --bench moe`.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use main_ppo::model::{CausalLm, Exec};

fn main() {
    let args = main_ppo::testing::moe_bench_args();
    let (vm, mut m) = main_ppo::testing::tiny_model(&args, DType::F32, 0.05);
    let (b, t) = (8usize, 256usize);
    let dev = Device::Cpu;
    let ids: Vec<u32> = (0..b * t)
        .map(|i| ((i * 7919 + 13) % 509) as u32 + 1)
        .collect();
    let ids = Tensor::from_vec(ids, (b, t), &dev).unwrap();
    let pos: Vec<u32> = (0..b).flat_map(|_| 0..t as u32).collect();
    let pos = Tensor::from_vec(pos, (b, t), &dev).unwrap();
    let mask = Tensor::ones((b, t), DType::U32, &dev).unwrap();
    let vars: Vec<_> = vm.all_vars();
    let step = |m: &CausalLm| -> (f64, Vec<Tensor>) {
        let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
        let (lp, _) = m.token_logprobs(&h, &ids, 512, false).unwrap();
        let loss = lp.mean_all().unwrap();
        let g = loss.backward().unwrap();
        let grads = vars
            .iter()
            .map(|v| match g.get(v.as_tensor()) {
                Some(t) => t.clone(),
                None => v.as_tensor().zeros_like().unwrap(),
            })
            .collect();
        (f64::from(loss.to_scalar::<f32>().unwrap()), grads)
    };
    let time = |m: &CausalLm| -> (f64, f64, Vec<Tensor>) {
        let (loss, grads) = step(m);
        let mut ts: Vec<f64> = (0..5)
            .map(|_| {
                let s = Instant::now();
                step(m);
                s.elapsed().as_secs_f64()
            })
            .collect();
        ts.sort_by(f64::total_cmp);
        (ts[2], loss, grads)
    };
    // (1) One layer of experts on a fixed input.
    let hx: Vec<f32> = (0..b * t * 256)
        .map(|i| (((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0) * 0.5)
        .collect();
    let hx =
        candle_core::Var::from_tensor(&Tensor::from_vec(hx, (b, t, 256), &dev).unwrap()).unwrap();
    let layer_step = |m: &CausalLm| -> (f64, Tensor) {
        let y = m.mlp_forward(0, hx.as_tensor()).unwrap();
        let loss = (&y * &y).unwrap().mean_all().unwrap();
        let g = loss.backward().unwrap();
        let gx = g.get(hx.as_tensor()).unwrap().clone();
        (f64::from(loss.to_scalar::<f32>().unwrap()), gx)
    };
    let (mut lg_t, mut ld_t) = (Vec::new(), Vec::new());
    let (mut layer_g, mut layer_d) = (None, None);
    for round in 0..6 {
        for dense in [false, true] {
            m.set_exec(Exec {
                dense_experts: dense,
                ..Exec::default()
            });
            let s = Instant::now();
            let r = layer_step(&m);
            let dt = s.elapsed().as_secs_f64();
            if round > 0 {
                if dense {
                    ld_t.push(dt)
                } else {
                    lg_t.push(dt)
                }
            }
            if dense {
                layer_d = Some(r)
            } else {
                layer_g = Some(r)
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (lgm, ldm) = (median(&mut lg_t), median(&mut ld_t));
    let ((l1, g1), (l2, g2)) = (layer_g.unwrap(), layer_d.unwrap());
    let gdiff = (&g1 - &g2)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        / g1.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
    println!("one layer of experts fwd+bwd, {b}x{t} tokens, 8 experts top-2, hidden 256, expert width 512, f32, {} threads", rayon_threads());
    println!(
        "  grouped: {lgm:.4} s; dense: {ldm:.4} s; speed-up grouped vs dense: {:.2}x",
        ldm / lgm
    );
    println!(
        "  output loss {l1:.8} vs {l2:.8}; input gradient difference {gdiff:.2e} of its scale"
    );
    // (2) The whole model.
    m.set_exec(Exec::default());
    let (grouped, lg, gg) = time(&m);
    m.set_exec(Exec {
        composed: true,
        ..Exec::default()
    });
    let (composed, lc, gc) = time(&m);
    m.set_exec(Exec {
        dense_experts: true,
        ..Exec::default()
    });
    let (dense, ld, gd) = time(&m);
    let worst = |gd: &[Tensor]| {
        gg.iter()
            .zip(gd)
            .map(|(a, b)| {
                let scale = a
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
                d.to_scalar::<f32>().unwrap() / scale.max(1e-30)
            })
            .fold(0f32, f32::max)
    };
    let tokens = (b * t) as f64;
    println!("MoE fwd+bwd, {b}x{t} tokens, 8 experts top-2, hidden 256, expert width 512, 2 layers, f32, {} threads", rayon_threads());
    println!(
        "  grouped, hand-written layer (each expert on its tokens): {grouped:.3} s ({:.0} tokens/s)",
        tokens / grouped
    );
    println!(
        "  grouped, candle ops: {composed:.3} s ({:.0} tokens/s)",
        tokens / composed
    );
    println!(
        "  dense (every expert on every token, candle ops): {dense:.3} s ({:.0} tokens/s)",
        tokens / dense
    );
    println!(
        "  speed-up hand-written grouped vs dense: {:.2}x; vs grouped candle ops: {:.2}x",
        dense / grouped,
        composed / grouped
    );
    println!(
        "  loss {lg:.7} (candle ops {lc:.7}, dense {ld:.7}); largest gradient difference {:.2e} (candle ops), {:.2e} (dense) of its tensor's scale",
        worst(&gc),
        worst(&gd)
    );
}

fn rayon_threads() -> String {
    std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| {
        std::thread::available_parallelism()
            .map(|n| n.get().to_string())
            .unwrap_or_else(|_| "?".into())
    })
}
