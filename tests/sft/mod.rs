//! `main_ppo sft` through the binary: verl's SFT example command lines
//! (`tests/fixtures/verl_scripts/sft_1dda039.jsonl`: the `python -m verl.trainer.sft_trainer`
//! overrides of `examples/sft/gsm8k/run_qwen2_5_0_5b_fsdp.sh`, plain and with its LoRA, Liger
//! and sequence-parallel options, and `examples/sft/multiturn/run_qwen2_5_0_5b_fsdp.sh`), with
//! their data, model and output paths swapped for local ones and nothing else changed, pass
//! `config check --sft` and train two steps (batch size, step count and loggers added at the
//! end). The model is a tiny Llama with the byte tokenizer, or SmolLM2-135M-Instruct when
//! MAIN_PPO_SMOLLM2 is set.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{bin_in, repo, text, tiny_model_dir, write_jsonl};

fn lines() -> Vec<Value> {
    let path = repo().join("tests/fixtures/verl_scripts/sft_1dda039.jsonl");
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Rows in the shape of verl's `gsm8k_multiturn_sft.py` (one user turn, one assistant turn)
/// and of its multi-turn example data (two rounds).
fn write_data(dir: &Path) {
    let q = |i: usize| {
        format!("What is {i} + {i}? Let's think step by step and output the final answer after \"####\".")
    };
    let a = |i: usize| format!("{i} + {i} = <<{i}+{i}={}>>{}\n#### {}", 2 * i, 2 * i, 2 * i);
    let single: Vec<Value> = (0..6)
        .map(|i| {
            serde_json::json!({"messages": [
            {"role": "user", "content": q(i)}, {"role": "assistant", "content": a(i)}]})
        })
        .collect();
    let multi: Vec<Value> = (0..6)
        .map(|i| {
            serde_json::json!({"messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": q(i)}, {"role": "assistant", "content": a(i)},
            {"role": "user", "content": "And twice that?"},
            {"role": "assistant", "content": format!("#### {}", 4 * i)}]})
        })
        .collect();
    write_jsonl(&dir.join("gsm8k.jsonl"), &single);
    write_jsonl(&dir.join("multiturn.jsonl"), &multi);
}

fn model(root: &Path) -> PathBuf {
    if std::env::var_os("MAIN_PPO_SMOLLM2").is_some() {
        if let Some(p) = super::smollm2() {
            return p;
        }
    }
    let m = root.join("model");
    tiny_model_dir(&m);
    m
}

/// The line's arguments with the paths it names replaced by local ones.
fn swapped(argv: &Value, root: &Path, model: &Path) -> Vec<String> {
    argv.as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let a = a.as_str().unwrap();
            let (k, v) = a.split_once('=').unwrap();
            let data = if v.contains("multiturn") {
                "multiturn"
            } else {
                "gsm8k"
            };
            match k {
                "data.train_files" | "data.val_files" => {
                    format!("{k}={}", root.join(format!("{data}.jsonl")).display())
                }
                "model.path" => format!("{k}={}", model.display()),
                "trainer.default_local_dir" => format!("{k}={}", root.join("ckpt").display()),
                _ => a.to_string(),
            }
        })
        .collect()
}

#[test]
fn verls_sft_example_lines_pass_config_check_and_train_two_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model(tmp.path());
    write_data(tmp.path());
    for line in lines() {
        let name = format!("{} ({})", line["script"], line["env"]);
        let run_dir = tempfile::tempdir_in(tmp.path()).unwrap();
        let args = swapped(&line["argv"], run_dir.path(), &model);
        for f in ["gsm8k.jsonl", "multiturn.jsonl"] {
            std::fs::copy(tmp.path().join(f), run_dir.path().join(f)).unwrap();
        }
        let out = bin_in(run_dir.path())
            .args(["config", "check", "--sft"])
            .args(&args)
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{name}: config check: {stderr}");
        assert!(stdout.contains("configuration OK"), "{name}: {stdout}");
        let out = bin_in(run_dir.path())
            .arg("sft")
            .args(&args)
            .args([
                "data.train_batch_size=2",
                "data.max_length=512",
                "trainer.total_training_steps=2",
                "trainer.logger=[console,file]",
            ])
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{name}: {stderr}");
        assert!(
            stderr.contains("have no effect in main_ppo"),
            "{name}: {stderr}"
        );
        let step2 = stdout
            .lines()
            .find(|l| l.starts_with("step:2 "))
            .unwrap_or_else(|| panic!("{name}: {stdout}"));
        for key in [
            "train/loss:",
            "train/grad_norm:",
            "train/lr:",
            "train/global_tokens:",
            "val/loss:",
        ] {
            assert!(step2.contains(key), "{name}: {key} missing from {step2}");
        }
        let ckpt = run_dir.path().join("ckpt/global_step_2");
        assert!(ckpt.join("trainer_state.json").is_file(), "{name}");
        let lora = line["argv"].to_string().contains("lora_rank");
        assert_eq!(ckpt.join("lora_adapter").is_dir(), lora, "{name}");
    }
}
