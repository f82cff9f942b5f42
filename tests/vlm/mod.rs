//! A vision-language model end to end through `main_ppo train`: the tiny Qwen2.5-VL of
//! `tests/fixtures/vlm/qwen2_5_vl/chat/` (written by `scripts/vlm_reference.py`: the byte-level
//! test tokenizer with the vision tokens, a chat template writing image items, a processor
//! sized for the tower) on a parquet file in verl's geo3k layout (images as `{bytes, path}`
//! structs, `<image>` markers in the prompt): GRPO with a KL loss against the reference,
//! validation before and after, a checkpoint with the HF export.

use std::path::{Path, PathBuf};

use super::{bin_in, text};

fn chat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm/qwen2_5_vl/chat")
}

fn train_args(dir: &Path, freeze: bool, critic: bool) -> Vec<String> {
    let chat = chat_dir();
    let data = chat.join("geo3k_layout.parquet").display().to_string();
    std::fs::write(
        dir.join("reward.py"),
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(len(solution_str) % 3) / 2\n",
    )
    .unwrap();
    let mut args: Vec<String> = [
        "algorithm.adv_estimator=grpo".to_string(),
        format!("data.train_files={data}"),
        format!("data.val_files={data}"),
        "data.image_key=images".into(),
        "data.image_patch_size=4".into(),
        "data.train_batch_size=2".into(),
        "data.max_prompt_length=160".into(),
        "data.max_response_length=4".into(),
        "data.truncation=error".into(),
        format!("actor_rollout_ref.model.path={}", chat.display()),
        "actor_rollout_ref.model.use_remove_padding=True".into(),
        "actor_rollout_ref.actor.optim.lr=1e-2".into(),
        "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2".into(),
        "actor_rollout_ref.actor.use_kl_loss=True".into(),
        "actor_rollout_ref.actor.kl_loss_coef=0.01".into(),
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl".into(),
        format!("actor_rollout_ref.actor.freeze_vision_tower={freeze}"),
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]".into(),
        "actor_rollout_ref.rollout.n=2".into(),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4".into(),
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4".into(),
        "custom_reward_function.path=reward.py".into(),
        "trainer.val_before_train=True".into(),
        "trainer.test_freq=2".into(),
        "trainer.save_freq=2".into(),
        "trainer.default_local_dir=ckpt".into(),
        "trainer.device=cpu".into(),
        "trainer.logger=[console,file]".into(),
        "trainer.total_training_steps=2".into(),
        "trainer.experiment_name=geo3k".into(),
    ]
    .to_vec();
    if critic {
        args[0] = "algorithm.adv_estimator=gae".into();
        args.extend([
            format!("critic.model.path={}", chat.display()),
            "critic.optim.lr=1e-3".into(),
            "critic.ppo_micro_batch_size_per_gpu=2".into(),
        ]);
    }
    args
}

/// Every tensor of a safetensors file whose name starts with `prefix`, in f32.
fn tensors(file: &Path, prefix: &str) -> Vec<(String, Vec<f32>)> {
    let mut all: Vec<(String, Vec<f32>)> =
        candle_core::safetensors::load(file, &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .map(|(n, t)| {
                let v = t.to_dtype(candle_core::DType::F32).unwrap();
                (n, v.flatten_all().unwrap().to_vec1().unwrap())
            })
            .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

/// Two steps train, GRPO, and PPO with a vision-language critic (GAE) and the tower frozen:
/// the step's metrics and validation are logged, the exported actor is a vision-language folder
/// whose tower moved (and, with `freeze_vision_tower`, is the one it started from) while the
/// language model moved in both runs.
#[test]
fn a_vision_language_model_trains_on_geo3k_layout_data() {
    for (freeze, critic) in [(false, false), (true, true)] {
        let root = tempfile::tempdir().unwrap();
        let out = bin_in(root.path())
            .args(train_args(root.path(), freeze, critic))
            .output()
            .unwrap();
        let (_, stderr) = text(&out);
        assert!(out.status.success(), "freeze {freeze}: {stderr}");
        let log = root.path().join("verl_examples/geo3k.jsonl");
        let rows: Vec<serde_json::Value> = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let last = &rows.last().unwrap()["data"];
        let mut keys = vec!["actor/pg_loss", "actor/kl_loss", "actor/grad_norm"];
        if critic {
            keys.extend(["critic/vf_loss", "critic/values/mean"]);
        }
        for k in keys {
            assert!(last[k].as_f64().is_some_and(f64::is_finite), "{k}: {last}");
        }
        assert!(
            rows.iter().any(|r| r["data"]
                .as_object()
                .unwrap()
                .keys()
                .any(|k| k.starts_with("val-core/"))),
            "no validation metrics"
        );
        let export = root.path().join("ckpt/global_step_2/actor/huggingface");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(
            cfg["architectures"][0],
            "Qwen2_5_VLForConditionalGeneration"
        );
        assert!(export.join("preprocessor_config.json").is_file());
        let (before, after) = (
            chat_dir().join("model.safetensors"),
            export.join("model.safetensors"),
        );
        let tower = (tensors(&before, "visual."), tensors(&after, "visual."));
        assert_eq!(tower.0.len(), tower.1.len());
        assert_eq!(tower.0 == tower.1, freeze, "freeze {freeze}: the tower");
        let lm = (
            tensors(&before, "model.layers.0.mlp"),
            tensors(&after, "model.layers.0.mlp"),
        );
        assert_ne!(
            lm.0, lm.1,
            "freeze {freeze}: the language model did not move"
        );
    }
}

/// `main_ppo generate --dtype f64 --log-probs` on the geo3k-layout file: each row's greedy
/// answer has transformers' token log-probs (the images read, encoded and placed as in
/// training). The greedy steps' top-2 gaps are all above 0.02, so the tokens are transformers'.
#[test]
fn generate_reads_images_like_transformers() {
    let root = tempfile::tempdir().unwrap();
    let chat = chat_dir();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chat.join("reference.json")).unwrap())
            .unwrap();
    let output = root.path().join("out.jsonl");
    let out = bin_in(root.path())
        .args([
            "generate".to_string(),
            "--input".into(),
            chat.join("geo3k_layout.parquet").display().to_string(),
            "--output".into(),
            output.display().to_string(),
            "--log-probs".into(),
            "--dtype".into(),
            "f64".into(),
            format!("actor_rollout_ref.model.path={}", chat.display()),
            "actor_rollout_ref.rollout.temperature=0".into(),
            "actor_rollout_ref.rollout.n=1".into(),
            "actor_rollout_ref.rollout.ignore_eos=True".into(),
            "data.image_patch_size=4".into(),
            "data.max_prompt_length=160".into(),
            "data.max_response_length=6".into(),
            "trainer.device=cpu".into(),
        ])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let rows = main_ppo::data::read_rows(&output).unwrap();
    let answers = reference["answers"].as_array().unwrap();
    assert_eq!(rows.len(), answers.len());
    for (i, (row, want)) in rows.iter().zip(answers).enumerate() {
        let got = row["response_log_probs"][0].as_array().unwrap();
        let greedy = want["greedy"].as_array().unwrap();
        assert_eq!(got.len(), greedy.len(), "row {i}");
        for (t, (g, w)) in got.iter().zip(greedy).enumerate() {
            let (g, w) = (g.as_f64().unwrap(), w["logprob"].as_f64().unwrap());
            assert!((g - w).abs() <= 1e-6, "row {i} token {t}: {g} vs {w}");
        }
    }
}

/// The geo3k recipe on a CPU (`configs/geo3k_grpo_vlm_cpu.yaml`, docs/src/data.md "geo3k on
/// the CPU") on a sample of `scripts/geo3k_synthetic.py`'s output (`--train 6 --test 3 --short`,
/// in `tests/fixtures/vlm/geo3k_synthetic/`): `config check` reads it as a training set for the
/// chat fixture (every prompt within the budget with its image at the recipe's processor bound;
/// at the processor's own bound, 64 image tokens instead of 16, none fits), and
/// `scripts/geo3k_reward.py` scores as geo3k's formula, 0.9 · accuracy + 0.1 · format, gives by
/// hand.
#[test]
fn the_geo3k_cpu_recipe_reads_the_synthetic_set_and_its_reward_follows_geo3k() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sample = repo.join("tests/fixtures/vlm/geo3k_synthetic");
    let check = |extra: &[&str]| {
        let mut args: Vec<String> = [
            "config",
            "check",
            "--config",
            "configs/geo3k_grpo_vlm_cpu.yaml",
        ]
        .map(String::from)
        .to_vec();
        args.push(format!(
            "data.train_files={}",
            sample.join("train.parquet").display()
        ));
        args.push(format!(
            "data.val_files={}",
            sample.join("test.parquet").display()
        ));
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = bin_in(repo).args(&args).output().unwrap();
        let (stdout, stderr) = text(&out);
        (out.status.success(), stdout, stderr)
    };
    let (ok, stdout, stderr) = check(&[]);
    assert!(ok, "{stderr}");
    for want in [
        "training prompts: 6",
        "validation prompts: 3",
        "dropped as longer than 192 prompt tokens: 0",
        "custom function compute_score from scripts/geo3k_reward.py",
    ] {
        assert!(stdout.contains(want), "{want:?} not in:\n{stdout}");
    }
    let (ok, _, stderr) = check(&["data.mm_processor_kwargs.max_pixels=4096"]);
    assert!(
        !ok && stderr.contains("no prompts left after filtering"),
        "{stderr}"
    );

    // Each row: the response, the ground truth, geo3k's score by hand.
    let cases = [
        // Boxed answer right (accuracy 1), <think>..</think> then \boxed{} (format 1).
        (
            "<think>5 + 7 = 12</think> The sum is \\boxed{12}.",
            "12",
            0.9 + 0.1,
        ),
        // Wrong answer, well formed: the format's share only.
        ("<think>5 + 7 = 13</think> \\boxed{13}", "12", 0.1),
        // Right answer without the thinking tags: the accuracy's share only.
        ("The sum is \\boxed{12}.", "12", 0.9),
        // Equal as numbers.
        ("<think>12</think>\n\\boxed{ 12.0 }", "12", 1.0),
        // No box: neither accuracy nor format.
        ("<think>5 + 7</think> 12", "12", 0.0),
        // The last box counts; braces inside it balance.
        ("<think>x</think> \\boxed{13}, no: \\boxed{12}", "12", 1.0),
        (
            "<think>x</think> \\boxed{\\frac{1}{2}}",
            "\\frac{1}{2}",
            1.0,
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("geo3k_reward_tests.jsonl");
    let rows: String = cases
        .iter()
        .map(|(response, truth, score)| {
            serde_json::json!({"data_source": "geo3k_synthetic", "solution_str": response,
                "ground_truth": truth, "expected": score})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(&file, rows).unwrap();
    let out = bin_in(repo)
        .args([
            "reward".to_string(),
            "test".into(),
            file.display().to_string(),
            "reward.custom_reward_function.path=scripts/geo3k_reward.py".into(),
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
}

/// A vision-language run resumes exactly: two steps in one go, and the same run stopped after
/// step 1 (its step-2 checkpoint removed) then started again, end with the same weights (the
/// tower's included), optimizer state and trainer state, bit for bit.
#[test]
fn a_vision_language_run_resumes_bit_identical() {
    let root = tempfile::tempdir().unwrap();
    let mut args = train_args(root.path(), false, false);
    args.extend([
        "trainer.save_freq=1".to_string(),
        "trainer.test_freq=-1".into(),
    ]);
    let run = || {
        let out = bin_in(root.path()).args(&args).output().unwrap();
        let (_, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        stderr
    };
    run();
    let ckpt = root.path().join("ckpt");
    let files = [
        "actor/huggingface/model.safetensors",
        "actor/optim.safetensors",
        "trainer_state.json",
    ];
    let read = |step: &str| -> Vec<Vec<u8>> {
        files
            .iter()
            .map(|f| std::fs::read(ckpt.join(step).join(f)).unwrap())
            .collect()
    };
    let whole = read("global_step_2");
    std::fs::remove_dir_all(ckpt.join("global_step_2")).unwrap();
    std::fs::write(ckpt.join("latest_checkpointed_iteration.txt"), "1").unwrap();
    let stderr = run();
    assert!(stderr.contains("global_step_1 (step 1)"), "{stderr}");
    let resumed = read("global_step_2");
    for ((f, a), b) in files.iter().zip(&whole).zip(&resumed) {
        assert!(a == b, "{f} differs after resuming");
    }
}
