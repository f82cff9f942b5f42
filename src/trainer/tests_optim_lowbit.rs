//! torchao's low-bit Adam classes against torchao itself: `tests/fixtures/optim_torchao_0.18.json`,
//! written by `scripts/torchao_optim_fixtures.py` (torchao 0.18 on torch 2.15, each class built
//! as verl's `build_optimizer` builds it, `step()` compiled as torchao compiles it), and
//! checkpoints of quantised moments.

use std::collections::HashMap;

use base64::Engine;
use candle_core::{Device, Tensor, Var};

use crate::config::OptimConfig;
use crate::kernels::adam_lowbit::maps;
use crate::trainer::optim::AdamW;

fn fixture() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/optim_torchao_0.18.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn bytes(v: &serde_json::Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(v.as_str().unwrap())
        .unwrap()
}

fn f32s(v: &serde_json::Value) -> Vec<f32> {
    bytes(v)
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The script's inputs: `((i·7919 + salt) mod 2001 − 1000) / 1000`, times 0.5 for the start
/// values or times `2^((i div 256) mod 8 − 4)` for gradients (exact in f32 on both sides).
fn formula(n: usize, salt: i64, scaled: bool) -> Vec<f32> {
    (0..n as i64)
        .map(|i| {
            let x = ((i * 7919 + salt) % 2001 - 1000) as f32 / 1000.0;
            if scaled {
                x * 2f32.powi(((i / 256) % 8) as i32 - 4)
            } else {
                x * 0.5
            }
        })
        .collect()
}

const SHAPES: [(&str, &[usize]); 3] = [("a", &[16, 256]), ("c", &[4100]), ("d", &[300])];

fn config(name: &str) -> OptimConfig {
    OptimConfig {
        optimizer_impl: "torchao.optim".into(),
        optimizer: name.into(),
        lr: 1e-2,
        weight_decay: 0.01,
        betas: [0.9, 0.999],
        eps: 1e-8,
        ..OptimConfig::default()
    }
}

fn vars() -> Vec<(String, Var)> {
    SHAPES
        .iter()
        .map(|(k, shape)| {
            let n = shape.iter().product();
            let t = Tensor::from_vec(formula(n, 0, false), *shape, &Device::Cpu).unwrap();
            (k.to_string(), Var::from_tensor(&t).unwrap())
        })
        .collect()
}

/// One step with the script's gradients of step `t` (the loss Σ p·G has gradient G exactly).
fn step(opt: &mut AdamW, vars: &[(String, Var)], t: i64) {
    let mut loss: Option<Tensor> = None;
    for (_, v) in vars {
        let p = v.as_tensor();
        let g = Tensor::from_vec(
            formula(p.elem_count(), (t + 1) * 104729, true),
            p.shape(),
            &Device::Cpu,
        )
        .unwrap();
        let term = (p * g).unwrap().sum_all().unwrap();
        loss = Some(match loss {
            Some(l) => (l + term).unwrap(),
            None => term,
        });
    }
    let grads = loss.unwrap().backward().unwrap();
    opt.step(&grads, 1e-2).unwrap();
}

/// The quantisation maps equal torchao's, bit for bit (built here from the recipe in the
/// reference's precisions, read there from torchao's own tables).
#[test]
fn quantisation_maps_are_torchaos() {
    let doc = fixture();
    for (k, ours) in ["signed8", "unsigned8", "signed4", "unsigned4"]
        .iter()
        .zip(maps().iter())
    {
        let theirs: Vec<u32> = doc["qmap"][k]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| (x.as_f64().unwrap() as f32).to_bits())
            .collect();
        let ours: Vec<u32> = ours.iter().map(|x| x.to_bits()).collect();
        assert_eq!(ours, theirs, "{k}");
    }
}

/// Five steps of each low-bit class on a quantised 16×256 parameter and two whose moments
/// torchao keeps in f32 (4100 values: not whole blocks; 300: under 4096): every parameter, and
/// the quantised moments' codes and scales, equal torchao's bit for bit (the same f32
/// operations in the same order; the f32 bias corrections and `lerp` included).
#[test]
fn low_bit_adam_equals_torchao_bit_for_bit() {
    let doc = fixture();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for name in ["AdamW8bit", "Adam8bit", "AdamW4bit", "AdamWFp8"] {
        let run = &doc["runs"][name];
        let vars = vars();
        let mut opt = AdamW::new(vars.iter().cloned().collect(), &config(name)).unwrap();
        for t in 0..5 {
            step(&mut opt, &vars, t);
        }
        for (k, v) in &vars {
            let ours: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            let theirs = f32s(&run[k]["param"]);
            let differ = ours
                .iter()
                .zip(&theirs)
                .filter(|(a, b)| a.to_bits() != b.to_bits());
            let worst = differ.map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert_eq!(
                bits(&ours),
                bits(&theirs),
                "{name} {k}: up to {worst} apart"
            );
        }
        let (m, v) = opt
            .block_moments("a")
            .expect("the 16×256 moments are quantised");
        for (moment, ours) in [("exp_avg", m), ("exp_avg_sq", v)] {
            let codes = bytes(&run["a"][moment]["codes"]);
            let differ = ours
                .codes
                .iter()
                .zip(&codes)
                .filter(|(a, b)| a != b)
                .count();
            assert_eq!(ours.codes.len(), codes.len(), "{name} {moment}");
            assert_eq!(differ, 0, "{name} {moment}: code bytes differ");
            let scale = f32s(&run["a"][moment]["scale"]);
            assert_eq!(bits(&ours.scale), bits(&scale), "{name} {moment} scales");
        }
        assert!(opt.block_moments("c").is_none() && opt.block_moments("d").is_none());
    }
}

/// The low-bit classes do change the numbers: AdamW8bit's parameters differ from torch's AdamW
/// (f32 moments) on the quantised parameter after five steps, while on the parameters whose
/// moments stay f32 the two differ only by the two forms' rounding; the moments' bytes are
/// what the formats say.
#[test]
fn quantised_moments_are_not_f32_moments() {
    let (qv, fv) = (vars(), vars());
    let mut q = AdamW::new(qv.iter().cloned().collect(), &config("AdamW8bit")).unwrap();
    let f32_cfg = OptimConfig {
        optimizer_impl: "torch.optim".into(),
        optimizer: "AdamW".into(),
        ..config("AdamW8bit")
    };
    let mut f = AdamW::new(fv.iter().cloned().collect(), &f32_cfg).unwrap();
    for t in 0..5 {
        step(&mut q, &qv, t);
        step(&mut f, &fv, t);
    }
    let gap = |k: usize| {
        let a: Vec<f32> = qv[k]
            .1
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let b: Vec<f32> = fv[k]
            .1
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    assert!(gap(0) > 1e-5, "8-bit moments left no trace: {}", gap(0));
    assert!(gap(1) < 1e-6 && gap(2) < 1e-6, "{} {}", gap(1), gap(2));
    // Hand count: the 16×256 parameter's two moments hold one byte per value and one f32
    // scale per 256 values; the other 4400 values keep two f32 moments.
    assert_eq!(q.state_bytes(), 2 * (4096 + 16 * 4) + 8 * (4100 + 300));
    assert_eq!(f.state_bytes(), 8 * (4096 + 4100 + 300));
}

/// A run saved after two steps and resumed gives the straight run's parameters bit for bit
/// (the codes are restored as saved); resumed under torch's AdamW the f32 moments are the
/// codes read back (compared with `BlockMoment::to_f32`, the decoding the update itself uses,
/// whose bits the torchao test above checks through the parameters); a garbled scale is
/// refused with the file and key named.
#[test]
fn quantised_moments_resume_bit_for_bit() {
    for name in ["AdamW8bit", "AdamW4bit", "AdamWFp8"] {
        let straight = vars();
        let mut a = AdamW::new(straight.iter().cloned().collect(), &config(name)).unwrap();
        for t in 0..4 {
            step(&mut a, &straight, t);
        }
        let resumed = vars();
        let mut b = AdamW::new(resumed.iter().cloned().collect(), &config(name)).unwrap();
        for t in 0..2 {
            step(&mut b, &resumed, t);
        }
        let dir = tempfile::tempdir().unwrap();
        b.save(dir.path()).unwrap();
        let fresh = |vs: &[(String, Var)]| -> HashMap<String, Var> {
            vs.iter()
                .map(|(k, v)| {
                    let t = v.as_tensor().copy().unwrap();
                    (k.clone(), Var::from_tensor(&t).unwrap())
                })
                .collect()
        };
        let cont: HashMap<String, Var> = fresh(&resumed);
        let mut c = AdamW::new(cont.clone(), &config(name)).unwrap();
        c.load(dir.path()).unwrap();
        let cont: Vec<(String, Var)> = {
            let mut v: Vec<_> = cont.into_iter().collect();
            v.sort_by(|x, y| x.0.cmp(&y.0));
            v
        };
        for t in 2..4 {
            step(&mut c, &cont, t);
        }
        for ((k, x), (_, y)) in straight.iter().zip(&cont) {
            let bits = |v: &Var| -> Vec<u32> {
                let f: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                f.iter().map(|x| x.to_bits()).collect()
            };
            assert_eq!(bits(x), bits(y), "{name} {k}: resumed run differs");
        }
        // Into torch's AdamW: the moments are the codes read back.
        let mut t = AdamW::new(
            fresh(&resumed),
            &OptimConfig {
                optimizer_impl: "torch.optim".into(),
                optimizer: "AdamW".into(),
                ..config(name)
            },
        )
        .unwrap();
        t.load(dir.path()).unwrap();
        let (bm, _) = b.block_moments("a").unwrap();
        assert_eq!(t.host_moments("a").unwrap().0, bm.to_f32(), "{name}");
    }
    // A NaN scale is refused, naming the file and the key.
    let vs = vars();
    let mut a = AdamW::new(vs.iter().cloned().collect(), &config("AdamW8bit")).unwrap();
    step(&mut a, &vs, 0);
    let dir = tempfile::tempdir().unwrap();
    a.save(dir.path()).unwrap();
    let file = dir.path().join("optim.safetensors");
    let mut ts = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    let mut s: Vec<f32> = ts["v.a.scale"].to_vec1().unwrap();
    s[3] = f32::NAN;
    ts.insert("v.a.scale".into(), Tensor::new(s, &Device::Cpu).unwrap());
    candle_core::safetensors::save(&ts, &file).unwrap();
    let mut b = AdamW::new(vs.iter().cloned().collect(), &config("AdamW8bit")).unwrap();
    let e = b.load(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("optim.safetensors") && e.contains("v.a.scale"),
        "{e}"
    );
}
