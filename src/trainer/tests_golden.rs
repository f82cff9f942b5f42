//! Behaviour lock for restructurings of the trainer: three 3-step runs (PPO with a critic, KL
//! loss, adaptive KL in reward, shuffled mini-batches and entropy bonus over two weighted
//! sources; GRPO; ReMax; the last two on a reward half the responses get) on a tiny Llama whose weights come from a seeded stream, compared
//! with `golden_3step.json`.
//!
//! Provenance: `golden_3step.json` was written by this test (`MAIN_PPO_WRITE_GOLDEN=1 cargo test
//! --lib trainer::tests::golden`) running the trainer as it stood at commit 71b6f5f, before the
//! `StepBatch` columns / `Trainable` / reward-boundary restructuring (issue #13). Every metric
//! that does not depend on the wall clock is compared bit for bit, and so is every actor and
//! critic weight (through a 64-bit FNV-1a hash of their f32 bits). Matrix products may round
//! differently on another CPU (the SIMD kernels are chosen at run time), so where the CPU
//! features differ from the recording machine's the comparison falls back to a relative
//! tolerance of 1e-3 and says so.
//!
//! Re-recorded once since, on purpose: when the vocabulary matrices' gradients began to be
//! summed in place over micro-batches (`model::grad_sink`), the sum's order changed from
//! `acc + (head + lookup)` to `(acc + head) + lookup`: 47 recorded values moved, each by at most
//! 7.5e-8 absolute (f32 rounding; the largest relative moves are advantage means that cancel to
//! ~1e-8), and the weight hashes with them.

use std::collections::BTreeMap;

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::*;

/// The recording, beside this file.
fn golden_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/trainer/golden_3step.json")
}

/// The SIMD features that decide how the matrix kernels round: those of the instruction set
/// the kernels run (`kernels::cpu::isa`, which `MAIN_PPO_CPU` may narrow), written as the
/// recording names them.
fn cpu_features() -> String {
    use crate::kernels::cpu::Isa;
    let mut f = vec![std::env::consts::ARCH];
    match crate::kernels::cpu::isa() {
        Isa::Avx512 => f.extend(["avx2", "fma", "avx512f"]),
        Isa::Avx2 => f.extend(["avx2", "fma"]),
        Isa::Neon | Isa::Portable => {}
    }
    f.join(",")
}

/// [`fixture`] with every weight drawn from a seeded ChaCha stream (uniform, ±0.17: std ≈ 0.1),
/// norms at 1, so two runs of the test start from the same model.
fn seeded_fixture() -> Fixture {
    let fx = fixture();
    let args = ModelArgs::tiny(Arch::Llama, 259);
    let (vm, _) = tiny_model(&args, DType::F32, 0.1);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
    {
        let data = vm.data().lock().unwrap();
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for name in names {
            let var = &data[name];
            let t = var.as_tensor();
            let n = t.elem_count();
            let vals: Vec<f32> = if name.ends_with("norm.weight") {
                vec![1.0; n]
            } else {
                (0..n).map(|_| rng.random_range(-0.17f32..0.17)).collect()
            };
            var.set(&Tensor::from_vec(vals, t.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    crate::weights::hf::save_dir(&vm, &args, &fx.model, &[258], Some(&fx.model), None).unwrap();
    fx
}

/// 64-bit FNV-1a over every variable's name and f32 bits (sorted by name), and the sum of all
/// weights (for the tolerance fallback).
fn weight_print(vm: &candle_nn::VarMap) -> Value {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    let mut sum = 0f64;
    for (name, vals) in weights(vm) {
        eat(name.as_bytes());
        for v in vals {
            eat(&v.to_bits().to_le_bytes());
            sum += f64::from(v);
        }
    }
    json!({ "fnv1a": format!("{h:016x}"), "sum": sum })
}

/// A reward about half the responses get (the tiny model rarely writes an `a`).
const EVEN: &str = "reward.sources=[{name: even, type: native, function: even_length}]";

const CASES: [(&str, &[&str]); 3] = [
    (
        "ppo",
        &[
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "algorithm.use_kl_in_reward=True",
            "algorithm.kl_ctrl.type=adaptive",
            "actor_rollout_ref.actor.shuffle=True",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "reward.sources=[{name: a, type: native, function: share_of_a}, {name: even, weight: 0.5, type: native, function: even_length}]",
        ],
    ),
    ("grpo", &["algorithm.adv_estimator=grpo", EVEN]),
    ("remax", &["algorithm.adv_estimator=remax", EVEN]),
];

/// One case's metrics (per step, as f64 bits) and weights. Micro-batches are padded, as
/// when the recording was made: packed sequences (`use_remove_padding`, the default since)
/// round a few sums in another order, and `packed_and_padded_runs_agree` ties them to this.
/// The rollout keeps no log-probs, as then: they add diagnostics only (rollout correction's
/// tests check that training is the same with them).
fn run_case(extra: &[&str]) -> Value {
    let fx = seeded_fixture();
    let mut extra = extra.to_vec();
    extra.extend([
        "actor_rollout_ref.model.use_remove_padding=False",
        "critic.model.use_remove_padding=False",
        "actor_rollout_ref.rollout.calculate_log_probs=False",
    ]);
    let mut t = trainer(&fx, &extra, None);
    assert_eq!(t.fit().unwrap(), FitOutcome::Finished { steps: 3 });
    let steps: Vec<Value> = t
        .history
        .iter()
        .map(|(s, m)| {
            let m: BTreeMap<String, String> = deterministic(m)
                .into_iter()
                .map(|(k, v)| (k, format!("{:016x}", v.to_bits())))
                .collect();
            json!({ "step": s, "metrics": m })
        })
        .collect();
    json!({
        "steps": steps,
        "actor": weight_print(&t.actor.trainable.varmap),
        "critic": t.critic.as_ref().map(|c| weight_print(&c.trainable.varmap)),
    })
}

fn close(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-3 * a.abs().max(b.abs()).max(1e-3)
}

fn bits(v: &Value) -> f64 {
    f64::from_bits(u64::from_str_radix(v.as_str().unwrap(), 16).unwrap())
}

/// Compares a case's run with its recording: exactly, or within tolerance (`exact` false).
fn compare(name: &str, got: &Value, want: &Value, exact: bool) {
    let (gs, ws) = (
        got["steps"].as_array().unwrap(),
        want["steps"].as_array().unwrap(),
    );
    assert_eq!(gs.len(), ws.len(), "{name}: steps");
    for (g, w) in gs.iter().zip(ws) {
        let (gm, wm) = (
            g["metrics"].as_object().unwrap(),
            w["metrics"].as_object().unwrap(),
        );
        let keys = |m: &serde_json::Map<String, Value>| m.keys().cloned().collect::<Vec<_>>();
        assert_eq!(
            keys(gm),
            keys(wm),
            "{name} step {}: metric names",
            g["step"]
        );
        for (k, wv) in wm {
            let (a, b) = (bits(&gm[k]), bits(wv));
            if exact {
                assert!(
                    a.to_bits() == b.to_bits(),
                    "{name} step {}: {k} = {a}, recorded {b}",
                    g["step"]
                );
            } else {
                assert!(
                    close(a, b),
                    "{name} step {}: {k} = {a}, recorded {b}",
                    g["step"]
                );
            }
        }
    }
    for model in ["actor", "critic"] {
        let (g, w) = (&got[model], &want[model]);
        assert_eq!(g.is_null(), w.is_null(), "{name}: {model} present");
        if w.is_null() {
            continue;
        }
        if exact {
            assert_eq!(g["fnv1a"], w["fnv1a"], "{name}: {model} weights differ");
        } else {
            let (a, b) = (g["sum"].as_f64().unwrap(), w["sum"].as_f64().unwrap());
            assert!(close(a, b), "{name}: {model} weight sum {a}, recorded {b}");
        }
    }
}

#[test]
fn golden_three_step_runs_are_unchanged() {
    let runs: BTreeMap<&str, Value> = CASES
        .iter()
        .map(|(name, extra)| (*name, run_case(extra)))
        .collect();
    if std::env::var_os("MAIN_PPO_WRITE_GOLDEN").is_some() {
        let doc = json!({ "cpu": cpu_features(), "cases": runs });
        std::fs::write(
            golden_path(),
            serde_json::to_string_pretty(&doc).unwrap() + "\n",
        )
        .unwrap();
        return;
    }
    let text = std::fs::read_to_string(golden_path()).unwrap();
    let golden: Value = serde_json::from_str(&text).unwrap();
    let exact = golden["cpu"].as_str() == Some(cpu_features().as_str());
    if !exact {
        eprintln!(
            "golden recorded on `{}`, this CPU is `{}`: comparing within 1e-3",
            golden["cpu"],
            cpu_features()
        );
    }
    for (name, got) in &runs {
        compare(name, got, &golden["cases"][*name], exact);
    }
}
