//! DeBERTa-v2/v3 sequence classification against transformers, on the tiny random checkpoints
//! transformers 5.24 / torch 2.15 wrote (`tests/fixtures/deberta/<name>/`, made by
//! `scripts/deberta_reference.py`, float32): the logits of 8 (prompt, response) pairs in one
//! right-padded batch, as transformers' `DebertaV2ForSequenceClassification` gave them, and
//! transformers' `make_log_bucket_position` table.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::Value;

use crate::model::deberta::log_bucket;

pub(crate) fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/deberta")
        .join(name)
}

pub(crate) fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(dir(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

// Rows of a reference file's JSON arrays, read as the family fixtures read them.
pub(crate) use super::family_tests::{floats as rows_f64, ids as rows_u32};

/// Logits of `rows` (ids, type ids) right-padded with 0 into one batch.
fn logits(
    m: &crate::model::deberta::DebertaV2Classifier,
    ids: &[Vec<u32>],
    types: &[Vec<u32>],
) -> Vec<Vec<f32>> {
    let b = ids.len();
    let w = ids.iter().map(Vec::len).max().unwrap();
    let (mut i, mut t, mut k) = (vec![0u32; b * w], vec![0u32; b * w], vec![0u32; b * w]);
    for r in 0..b {
        let n = ids[r].len();
        i[r * w..r * w + n].copy_from_slice(&ids[r]);
        t[r * w..r * w + n].copy_from_slice(&types[r]);
        k[r * w..r * w + n].fill(1);
    }
    let d = &Device::Cpu;
    m.forward(
        &Tensor::from_vec(i, (b, w), d).unwrap(),
        &Tensor::from_vec(t, (b, w), d).unwrap(),
        &Tensor::from_vec(k, (b, w), d).unwrap(),
    )
    .unwrap()
    .to_vec2()
    .unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(x, y)| (f64::from(*x) - y).abs())
        })
        .fold(0.0, f64::max)
}

/// The 8 pairs' logits equal transformers' within 1e-5 batched (right padding) and each
/// pair alone.
fn logits_match(name: &str) {
    let r = reference(name);
    let m = super::hf::load_deberta(&dir(name), &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let ids = rows_u32(&r["input_ids"]);
    let types = rows_u32(&r["token_type_ids"]);
    let want = rows_f64(&r["logits"]);
    let got = logits(&m, &ids, &types);
    let d = max_diff(&got, &want);
    eprintln!("{name}: max |logit - transformers| batched {d:.2e}");
    assert!(
        d < 1e-5,
        "{name}: batched logits differ by {d:.2e}: {got:?} vs {want:?}"
    );
    let mut alone = Vec::new();
    for (i, t) in ids.iter().zip(&types) {
        alone.extend(logits(&m, std::slice::from_ref(i), std::slice::from_ref(t)));
    }
    let d = max_diff(&alone, &want);
    eprintln!("{name}: max |logit - transformers| one pair at a time {d:.2e}");
    assert!(d < 1e-5, "{name}: logits of pairs alone differ by {d:.2e}");
    // The labels differ between pairs: the check is not passed by a constant.
    let first: Vec<f64> = want.iter().map(|l| l[0]).collect();
    assert!(
        first.iter().any(|x| (x - first[0]).abs() > 1e-2),
        "{first:?}"
    );
}

#[test]
fn deberta_v3_reward_model_logits_equal_transformers() {
    logits_match("deberta_v3");
}

#[test]
fn deberta_v2_switches_logits_equal_transformers() {
    // Separate position projections, clamped distances, absolute positions, token types,
    // embed_proj, the convolution, two labels.
    logits_match("deberta_v2");
}

#[test]
fn log_buckets_equal_transformers() {
    let r = reference("deberta_v3");
    for key in ["fixture", "v3"] {
        let b = &r["buckets"][key];
        let (size, max) = (
            b["bucket_size"].as_i64().unwrap(),
            b["max_position"].as_i64().unwrap(),
        );
        let rel = b["relative"].as_array().unwrap();
        let want = b["bucket"].as_array().unwrap();
        for (x, w) in rel.iter().zip(want) {
            let x = x.as_i64().unwrap();
            assert_eq!(
                log_bucket(x, size, max),
                w.as_i64().unwrap(),
                "bucket of {x} ({size}, {max})"
            );
        }
    }
}
