//! verl's own command lines and config folder, as a user brings them: every example script of
//! verl that launches `main_ppo` (at b178a3c, January 2026, and 1dda039, August 2026), with its
//! paths swapped for local ones and nothing else changed, passes `config check` or is refused in
//! one error line naming one of the keys the line sets that main_ppo does not implement. The
//! lines and what to expect of each are in `tests/fixtures/verl_scripts/`
//! (`scripts/verl_examples.py` extracts them from verl's scripts).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{bin, data_dir, repo, text};

fn fixtures() -> PathBuf {
    repo().join("tests/fixtures/verl_scripts")
}

/// A folder per model family: a `config.json` of a tiny model (the families main_ppo runs) or
/// one naming the family's architecture only (those it refuses). No weights: `config check`
/// reads the configuration only.
pub(super) fn model_dir(root: &Path, family: &str) -> PathBuf {
    use main_ppo::model::{Arch, ModelArgs};
    let dir = root.join("models").join(family);
    if dir.is_dir() {
        return dir;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let config = match family {
        "qwen2" | "qwen3" | "qwen3_moe" | "qwen3_5" | "qwen3_next" | "llama" | "mistral"
        | "seed_oss" | "mimo" => {
            let arch = match family {
                "qwen2" => Arch::Qwen2,
                "seed_oss" => Arch::SeedOss,
                "mimo" => Arch::MiMo,
                "qwen3" => Arch::Qwen3,
                "qwen3_moe" => Arch::Qwen3Moe,
                "qwen3_5" => Arch::Qwen3_5,
                "qwen3_next" => Arch::Qwen3Next,
                _ => Arch::Llama,
            };
            // Tiny, but with every projection at least 128 wide: the lines' LoRA ranks (up to
            // 64) must fit the projections they adapt, which `config check` checks.
            let mut args = ModelArgs::tiny(arch, 256);
            (args.hidden_size, args.head_dim, args.intermediate_size) = (128, 64, 128);
            args.rotary_dim = args.rotary_dim.map(|_| 16); // Qwen3.5's 0.25 of the head
            if let Some(m) = args.moe.as_mut() {
                m.moe_intermediate_size = 128;
            }
            let mut c = args.to_hf();
            c["max_position_embeddings"] = (1usize << 20).into();
            if family == "mistral" {
                c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
                c["model_type"] = "mistral".into();
            }
            c
        }
        other => {
            let arch: String = other
                .split('_')
                .map(|w| w[..1].to_uppercase() + &w[1..])
                .collect();
            serde_json::json!({"architectures": [format!("{arch}ForCausalLM")], "model_type": other})
        }
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

/// The example config files a line names with `--config-path examples/...`, written out.
fn write_example_configs(root: &Path) {
    let all: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("example_configs.json")).unwrap(),
    )
    .unwrap();
    for (commit, files) in all.as_object().unwrap() {
        for (path, tree) in files.as_object().unwrap() {
            let p = root.join(commit).join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, serde_yaml_ng::to_string(tree).unwrap()).unwrap();
        }
    }
}

const DATA_KEYS: [&str; 2] = ["data.train_files", "data.val_files"];
const OUTPUT_KEYS: [&str; 3] = [
    "trainer.default_local_dir",
    "trainer.rollout_data_dir",
    "trainer.validation_data_dir",
];

/// GSM8K for the lines: the first 4096 training rows (as many prompts as the largest
/// `data.train_batch_size` of a line that runs) and 8 test rows, as JSONL (small, quick to read).
fn write_gsm8k_subset(root: &Path) {
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    for (from, to, n) in [
        ("train.parquet", "train.jsonl", 4096),
        ("test.parquet", "test.jsonl", 8),
    ] {
        let rows = main_ppo::data::read_rows(&data_dir().join(from)).unwrap();
        let text_: String = rows[..n].iter().map(|r| format!("{r}\n")).collect();
        std::fs::write(data.join(to), text_).unwrap();
    }
}

/// The line with its paths swapped: data files, model folders of the same family, the reward
/// file, LoRA adapter folders, output folders and example config folders; the actor's and critic's model paths and the
/// data files are added where the line leaves verl's defaults (`~/models/...`, `~/data/...`).
fn swapped(entry: &Value, root: &Path) -> Vec<String> {
    let commit = entry["commit"].as_str().unwrap();
    let models = entry["models"].as_object().unwrap();
    let data = root.join("data");
    let mut out = Vec::new();
    let mut seen = Vec::new();
    for a in entry["argv"].as_array().unwrap() {
        let a = a.as_str().unwrap();
        if let Some(p) = a.strip_prefix("--config-path=") {
            if p.starts_with("examples/") {
                out.push(format!(
                    "--config-path={}",
                    root.join(commit).join(p).display()
                ));
                continue;
            }
        }
        let Some((k, _)) = a.split_once('=') else {
            out.push(a.to_string());
            continue;
        };
        let key = k.trim_start_matches(['+', '~']);
        seen.push(key.to_string());
        let file = |name: &str| format!("{k}={}", data.join(name).display());
        let swap = if key == DATA_KEYS[0] {
            Some(file("train.jsonl"))
        } else if key == DATA_KEYS[1] {
            Some(file("test.jsonl"))
        } else if let Some(fam) = models.get(key).and_then(Value::as_str) {
            Some(format!("{k}={}", model_dir(root, fam).display()))
        } else if key.ends_with("custom_reward_function.path") {
            Some(format!("{k}={}", root.join("reward.py").display()))
        } else if key.ends_with("lora_adapter_path") {
            // An adapter folder that exists (the PEFT fixture's): the lines name their own.
            let adapter =
                Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/peft_lora/adapter");
            Some(format!("{k}={}", adapter.display()))
        } else if OUTPUT_KEYS.contains(&key) {
            Some(format!("{k}={}", root.join("out").display()))
        } else {
            None
        };
        out.push(swap.unwrap_or_else(|| a.to_string()));
    }
    for key in ["actor_rollout_ref.model.path", "critic.model.path"] {
        if !seen.iter().any(|s| s == key) {
            let fam = models[key].as_str().unwrap();
            out.push(format!("{key}={}", model_dir(root, fam).display()));
        }
    }
    for (key, name) in DATA_KEYS.iter().zip(["train.jsonl", "test.jsonl"]) {
        if !seen.iter().any(|s| s == key) {
            out.push(format!("{key}={}", data.join(name).display()));
        }
    }
    out
}

/// What went wrong with one line, if anything: a line expected to pass must, a refused one must
/// end in one error (a single line, or the list of broken rules) naming one of its keys.
fn judge(entry: &Value, ok: bool, stderr: &str) -> Option<String> {
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    match &entry["expect"] {
        Value::String(s) if s == "pass" => (!ok).then(|| format!("expected to pass: {last}")),
        expect => {
            let keys: Vec<&str> = expect["refused"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap())
                .collect();
            let reason = expect["reason"].as_str().unwrap();
            if ok {
                return Some(format!(
                    "passed; expected a refusal naming one of {keys:?} ({reason})"
                ));
            }
            // One error line at the end, or the rule violations' list: `error: invalid
            // configuration:` and one `  - ` line per broken rule, each naming its key.
            let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
            let list_at = lines
                .iter()
                .rposition(|l| *l == "error: invalid configuration:")
                .filter(|&i| {
                    i + 1 < lines.len() && lines[i + 1..].iter().all(|l| l.starts_with("  - "))
                });
            let last = match list_at {
                Some(i) if errors.len() == 1 => lines[i..].join(" "),
                _ if errors.len() == 1 && last.starts_with("error:") => last.to_string(),
                _ => return Some(format!("not one error line at the end: {stderr}")),
            };
            if !keys.iter().any(|k| last.contains(k)) {
                return Some(format!(
                    "the error names none of {keys:?} ({reason}): {last}"
                ));
            }
            let not_verl = reason.contains("not a key of verl's config");
            if last.contains("unknown key") && !not_verl {
                return Some(format!(
                    "an unknown-key error for a key verl defines: {last}"
                ));
            }
            None
        }
    }
}

/// The folder each commit's lines are also composed against: verl's own config folder of the
/// release nearest that commit, when fetched (`scripts/fetch_verl_config.sh`, `.ci/run`).
fn verl_folder_for(commit: &str) -> Option<PathBuf> {
    let var = match commit {
        "1dda039" => "MAIN_PPO_VERL_CONFIG",
        _ => "MAIN_PPO_VERL_CONFIG_OLD",
    };
    std::env::var_os(var).map(PathBuf::from)
}

/// The line composed against verl's folder: its `--config-path` to verl's own folder (`config`,
/// relative to verl's trainer) is that folder, a line without one gets it with `ppo_trainer`.
fn against_folder(args: Vec<String>, folder: &Path) -> Vec<String> {
    let mut named = false;
    let mut out: Vec<String> = args
        .into_iter()
        .map(|a| match a.strip_prefix("--config-path=") {
            Some("config" | "./config") => {
                named = true;
                format!("--config-path={}", folder.display())
            }
            Some(_) => {
                named = true;
                a
            }
            None => a,
        })
        .collect();
    if !named {
        out.splice(
            0..0,
            [
                format!("--config-path={}", folder.display()),
                "--config-name=ppo_trainer".to_string(),
            ],
        );
    }
    out
}

struct Job {
    commit: String,
    entry: Value,
    args: Vec<String>,
    cwd: PathBuf,
    variant: &'static str,
}

#[test]
fn verl_example_command_lines_pass_or_are_refused_in_one_named_line() {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(
        root.path().join("reward.py"),
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
    )
    .unwrap();
    write_example_configs(root.path());
    write_gsm8k_subset(root.path());
    // Most lines log to wandb (verl's default `trainer.logger`), whose SDK `config check`
    // imports: stand-ins, as a user running them has the SDK installed.
    let sdks = super::stub_sdks(root.path());
    let mut jobs = Vec::new();
    for commit in ["b178a3c", "1dda039"] {
        let folder = verl_folder_for(commit);
        // For the example configs' `hydra.searchpath: [file://verl/trainer/config]`.
        let with_verl = root.path().join(format!("with-verl-{commit}"));
        if let Some(f) = &folder {
            std::fs::create_dir_all(with_verl.join("verl/trainer")).unwrap();
            std::os::unix::fs::symlink(f, with_verl.join("verl/trainer/config")).unwrap();
        } else {
            eprintln!("{commit}: verl's config folder not fetched (MAIN_PPO_VERL_CONFIG{}): the lines run on the built-in defaults only", if commit == "1dda039" { "" } else { "_OLD" });
        }
        let text_ = std::fs::read_to_string(fixtures().join(format!("{commit}.jsonl"))).unwrap();
        for line in text_.lines() {
            let entry: Value = serde_json::from_str(line).unwrap();
            let args = swapped(&entry, root.path());
            if let Some(f) = &folder {
                jobs.push(Job {
                    commit: commit.into(),
                    entry: entry.clone(),
                    args: against_folder(args.clone(), f),
                    cwd: with_verl.clone(),
                    variant: "verl's folder",
                });
            }
            // From a folder without verl's config: `--config-path=config` (verl's own folder,
            // relative to its trainer) finds nothing and verl's names come from the defaults.
            jobs.push(Job {
                commit: commit.into(),
                entry,
                args,
                cwd: root.path().to_path_buf(),
                variant: "built-in",
            });
        }
    }
    let results: Vec<(usize, Option<String>)> = std::thread::scope(|s| {
        let workers = 4;
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (jobs, sdks) = (&jobs, &sdks);
                s.spawn(move || {
                    let mut out = Vec::new();
                    for (i, job) in jobs.iter().enumerate().skip(w).step_by(workers) {
                        let mut args = vec!["config".to_string(), "check".to_string()];
                        args.extend(job.args.iter().cloned());
                        let o = bin()
                            .args(&args)
                            .current_dir(&job.cwd)
                            .env("PYTHONPATH", sdks)
                            .output()
                            .unwrap();
                        out.push((i, judge(&job.entry, o.status.success(), &text(&o).1)));
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let mut counts: BTreeMap<(String, &str, String), usize> = BTreeMap::new();
    let mut failures = Vec::new();
    for (i, problem) in results {
        let job = &jobs[i];
        let outcome = match &job.entry["expect"] {
            Value::String(_) => "passed".to_string(),
            e => format!("refused: {}", e["reason"].as_str().unwrap()),
        };
        *counts
            .entry((job.commit.clone(), job.variant, outcome))
            .or_default() += 1;
        if let Some(p) = problem {
            failures.push(format!(
                "{} {} ({}): {p}",
                job.commit, job.entry["script"], job.variant
            ));
        }
    }
    for ((commit, variant, outcome), n) in &counts {
        eprintln!("{commit} ({variant}): {n:4} {outcome}");
    }
    let lines = jobs.iter().filter(|j| j.variant == "built-in").count();
    assert!(lines >= 200, "only {lines} command lines in the fixtures");
    assert!(
        failures.is_empty(),
        "{} of {} runs:\n{}",
        failures.len(),
        jobs.len(),
        failures.join("\n")
    );
}

/// verl's config folder (`verl/trainer/config` of the PyPI wheel 0.9.1, the release nearest
/// 1dda039; `scripts/fetch_verl_config.sh`, which `.ci/run` calls), when fetched.
fn verl_config() -> Option<PathBuf> {
    let found = std::env::var_os("MAIN_PPO_VERL_CONFIG").map(PathBuf::from);
    if found.is_none() {
        eprintln!("skipped: MAIN_PPO_VERL_CONFIG is not set (scripts/fetch_verl_config.sh fetches verl's config folder; .ci/run sets it)");
    }
    found
}

/// The metrics of each step a run's `file` logger wrote, without the timings.
fn logged_metrics(dir: &Path) -> Vec<BTreeMap<String, Value>> {
    let text_ = std::fs::read_to_string(dir.join("verl_examples/gsm8k.jsonl")).unwrap();
    text_
        .lines()
        .map(|l| {
            let row: Value = serde_json::from_str(l).unwrap();
            row["data"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| !k.starts_with("timing") && !k.starts_with("perf/"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .collect()
}

#[test]
fn verls_config_folder_trains_like_the_built_in_defaults() {
    let Some(verl) = verl_config() else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    // A tiny model, GSM8K-style prompts and a reward file (the quickstart's paths, swapped).
    let _ = super::tiny_run(root.path(), 2, &[]);
    let model = root.path().join("model");
    let data = root.path().join("train.jsonl");
    let mut args: Vec<String> = super::quickstart(&model, &root.path().join("reward.py"))
        .into_iter()
        .map(|a| match a.split_once('=') {
            Some((k, _)) if DATA_KEYS.contains(&k) => format!("{k}={}", data.display()),
            _ => a,
        })
        .collect();
    // Sizes for a two-step run on 8 prompts; both runs get the same.
    args.extend(
        [
            "data.train_batch_size=4",
            "data.max_prompt_length=128",
            "data.max_response_length=5",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "critic.ppo_micro_batch_size_per_gpu=2",
            "trainer.total_training_steps=2",
            "trainer.logger=[console,file]",
            "trainer.save_freq=-1",
            "trainer.test_freq=-1",
            "trainer.device=cpu",
        ]
        .map(String::from),
    );
    let mut runs = Vec::new();
    for (name, prefix) in [
        ("builtin", vec![]),
        (
            "verl",
            vec![
                format!("--config-path={}", verl.display()),
                "--config-name=ppo_trainer".to_string(),
            ],
        ),
    ] {
        let dir = root.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let out = super::bin_in(&dir)
            .args(prefix.iter().chain(args.iter()))
            .output()
            .unwrap();
        let (_, stderr) = text(&out);
        assert!(out.status.success(), "{name}: {stderr}");
        let no_effect: Vec<String> = stderr
            .lines()
            .filter(|l| l.contains("have no effect in main_ppo"))
            .map(|l| l.split_once("WARN").map_or(l, |(_, r)| r).to_string())
            .collect();
        runs.push((logged_metrics(&dir), no_effect));
    }
    let (builtin, verl_run) = (&runs[0], &runs[1]);
    assert_eq!(builtin.0.len(), 2, "two steps logged");
    assert!(
        builtin.0[1].contains_key("actor/pg_loss") && builtin.0[1].contains_key("critic/vf_loss")
    );
    assert_eq!(
        builtin.0, verl_run.0,
        "the run from verl's folder logs other metrics than the one from the built-in defaults"
    );
    assert_eq!(
        builtin.1, verl_run.1,
        "only the keys the user set are reported, whatever the base"
    );
}
