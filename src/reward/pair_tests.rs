//! The DeBERTa reward model source end to end: the pair encoding equals transformers'
//! `tokenizer(prompts, responses, truncation=True)` and `main_ppo reward score` with the tiny
//! checkpoints as `type: model` sources gives transformers' logits (fixtures and numbers from
//! `scripts/deberta_reference.py`, transformers 5.24 / torch 2.15; see
//! `weights/deberta_tests.rs`).

use candle_core::Device;
use serde_json::{json, Value};

use super::pair_source::PairScorer;
use crate::weights::deberta_tests::{dir, reference, rows_f64, rows_u32};

fn pairs(r: &Value) -> Vec<(String, String)> {
    r["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["prompt"].as_str().unwrap().to_string(),
                p["response"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn pair_token_ids_and_types_equal_transformers() {
    for name in ["deberta_v3", "deberta_v2"] {
        let r = reference(name);
        let s = PairScorer::load(&dir(name), &Device::Cpu).unwrap();
        assert_eq!(s.max_length, Some(24));
        let ids = rows_u32(&r["input_ids"]);
        let types = rows_u32(&r["token_type_ids"]);
        let untruncated: Vec<u64> = r["untruncated_lengths"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert!(
            untruncated.iter().filter(|&&n| n > 24).count() >= 5,
            "truncation exercised"
        );
        for (i, (p, a)) in pairs(&r).iter().enumerate() {
            let e = s.encode(p, a).unwrap();
            assert_eq!(e.ids, ids[i], "{name} pair {i} ids");
            assert_eq!(e.type_ids, types[i], "{name} pair {i} token types");
        }
    }
}

#[test]
fn reward_score_with_a_deberta_model_source_gives_transformers_logits() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["deberta_v3", "deberta_v2"] {
        let r = reference(name);
        let want = rows_f64(&r["logits"]);
        let input = tmp.path().join(format!("{name}.jsonl"));
        let output = tmp.path().join(format!("{name}.scores.jsonl"));
        // Prompts as chat messages (the last user turn is the prompt) and as plain strings.
        let rows: String = pairs(&r)
            .iter()
            .enumerate()
            .map(|(i, (p, a))| {
                let prompt = if i % 2 == 0 {
                    json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}])
                } else {
                    json!(p)
                };
                format!(
                    "{}\n",
                    json!({"data_source": "chat", "prompt": prompt, "response": a, "ground_truth": ""})
                )
            })
            .collect();
        std::fs::write(&input, rows).unwrap();
        let code = crate::cli::main_with_args([
            "main_ppo".to_string(),
            "reward".into(),
            "score".into(),
            "--input".into(),
            input.display().to_string(),
            "--output".into(),
            output.display().to_string(),
            format!(
                "reward.sources=[{{name: rm, type: model, path: {}, micro_batch_size: 3}}]",
                dir(name).display()
            ),
        ]);
        assert_eq!(code, 0, "{name}: reward score failed");
        let lines: Vec<Value> = std::fs::read_to_string(&output)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 8);
        let mut worst = 0f64;
        for (i, l) in lines.iter().enumerate() {
            let got = l["score"]
                .as_f64()
                .unwrap_or_else(|| panic!("{name} row {i}: {l}"));
            worst = worst.max((got - want[i][0]).abs());
        }
        eprintln!("{name}: max |reward score - transformers logit 0| {worst:.2e}");
        assert!(worst < 1e-5, "{name}: {worst:.2e}");
    }
}

#[test]
fn an_unsupported_encoder_reward_model_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    for arch in [
        "BertForSequenceClassification",
        "DebertaForSequenceClassification",
    ] {
        let d = tmp.path().join(arch);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("config.json"),
            json!({"architectures": [arch], "hidden_size": 8}).to_string(),
        )
        .unwrap();
        let e = super::model_source::RewardModel::load(&super::model_source::RewardModelOptions {
            path: d.to_str().unwrap(),
            device: "cpu",
            micro_batch_size: 1,
            normalize: false,
            clip: None,
            prompt_key: "prompt",
        })
        .err()
        .expect("refused")
        .to_string();
        assert!(
            e.contains(&format!(
                "architecture `{arch}` is not supported as a reward model"
            )) && e.contains("DebertaV2ForSequenceClassification")
                && e.contains("LlamaForSequenceClassification"),
            "{e}"
        );
    }
    // As a policy a DeBERTa checkpoint is refused as an encoder.
    let e = crate::model::config::arch_of(
        &json!({"architectures": ["DebertaV2ForSequenceClassification"]}),
    )
    .unwrap_err();
    assert!(
        e.contains("is an encoder, loaded only as a reward model"),
        "{e}"
    );
}
