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
/// reads the configuration only (and, for the vision-language family, the tokenizer and image
/// processor, with which it tokenises the prompts and processes their images).
pub(super) fn model_dir(root: &Path, family: &str) -> PathBuf {
    use main_ppo::model::{Arch, ModelArgs};
    let dir = root.join("models").join(family);
    if dir.is_dir() {
        return dir;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let config = match family {
        "qwen2" | "qwen3" | "qwen3_moe" | "qwen3_5" | "qwen3_next" | "llama" | "mistral"
        | "seed_oss" | "mimo" | "deepseek_v3" | "glm4_moe" | "gpt_oss" | "qwen2_moe" | "gemma2" => {
            let arch = match family {
                "qwen2" => Arch::Qwen2,
                "seed_oss" => Arch::SeedOss,
                "mimo" => Arch::MiMo,
                "qwen3" => Arch::Qwen3,
                "qwen3_moe" => Arch::Qwen3Moe,
                "qwen3_5" => Arch::Qwen3_5,
                "qwen3_next" => Arch::Qwen3Next,
                "deepseek_v3" => Arch::DeepseekV3,
                "glm4_moe" => Arch::Glm4Moe,
                "gpt_oss" => Arch::GptOss,
                "qwen2_moe" => Arch::Qwen2Moe,
                "gemma2" => Arch::Gemma2,
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
            if let Some(m) = args.mla.as_mut() {
                // DeepSeek-V3's latent attention: every low-rank side 128 wide too.
                (m.q_lora_rank, m.kv_lora_rank) = (Some(128), 128);
                (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) = (64, 64, 64);
            }
            let mut c = args.to_hf();
            c["max_position_embeddings"] = (1usize << 20).into();
            if family == "mistral" {
                c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
                c["model_type"] = "mistral".into();
            }
            c
        }
        "qwen2_5_vl" => qwen2_5_vl_folder(&dir),
        "qwen3_vl" | "qwen3_vl_moe" => qwen3_vl_folder(&dir, family == "qwen3_vl_moe"),
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

/// The chat fixture's Qwen2.5-VL folder without its weights (tokenizer with the vision tokens,
/// chat template, image processor) in `dir`, and its `config.json` with the language model
/// widened as the text families' above: 128 wide with two heads of 64 (`mrope_section` spans
/// the head's 32 frequencies), the tower's output as wide, positions as far as theirs.
fn qwen2_5_vl_folder(dir: &Path) -> Value {
    let chat = repo().join("tests/fixtures/vlm/qwen2_5_vl/chat");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "preprocessor_config.json",
    ] {
        std::fs::copy(chat.join(f), dir.join(f)).unwrap();
    }
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(chat.join("config.json")).unwrap()).unwrap();
    let t = &mut c["text_config"];
    (t["hidden_size"], t["intermediate_size"]) = (128.into(), 128.into());
    (t["num_attention_heads"], t["num_key_value_heads"]) = (2.into(), 2.into());
    t["rope_parameters"]["mrope_section"] = serde_json::json!([8, 12, 12]);
    t["max_position_embeddings"] = (1usize << 20).into();
    c["vision_config"]["out_hidden_size"] = 128.into();
    c
}

/// A Qwen3-VL (`moe`: Qwen3-VL-MoE) folder as [`qwen2_5_vl_folder`]'s: the same tokenizer and
/// processor, Qwen3-VL's config (q/k norms, interleaved rotary sections, the tower of the
/// `qwen3_vl` fixture with its DeepStack, 128 wide out; with `moe` eight experts of 64, top 2).
fn qwen3_vl_folder(dir: &Path, moe: bool) -> Value {
    let mut c = qwen2_5_vl_folder(dir);
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/fixtures/vlm/qwen3_vl/config.json")).unwrap(),
    )
    .unwrap();
    let (arch, model_type) = match moe {
        true => ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"),
        false => ("Qwen3VLForConditionalGeneration", "qwen3_vl"),
    };
    c["architectures"] = serde_json::json!([arch]);
    c["model_type"] = model_type.into();
    let t = &mut c["text_config"];
    t["model_type"] = format!("{model_type}_text").into();
    t["head_dim"] = 64.into();
    t["rope_parameters"]["mrope_interleaved"] = true.into();
    if moe {
        t["num_experts"] = 8.into();
        t["num_experts_per_tok"] = 2.into();
        t["moe_intermediate_size"] = 64.into();
    }
    let mut v = fixture["vision_config"].clone();
    v["out_hidden_size"] = 128.into();
    c["vision_config"] = v;
    c
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

/// verl's geo3k data for the vision-language lines (`$HOME/data/geo3k/{train,test}.parquet`):
/// the chat fixture's three rows in verl's geo3k layout (images as `{bytes, path}` structs),
/// repeated to 513 training rows (the lines ask for up to 512 prompts a step) and written once
/// as the test file. Their `data_source` becomes `lighteval/MATH`, as the text lines' MATH and
/// code data become GSM8K rows: verl scores `hiyouga/geometry3k` with mathruler (sympy), which
/// main_ppo does not build in (a geo3k run names a reward function: `scripts/geo3k_reward.py`).
fn write_geo3k_layout(root: &Path) {
    use arrow_array::{ArrayRef, RecordBatch, StringArray};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let from = repo().join("tests/fixtures/vlm/qwen2_5_vl/chat/geo3k_layout.parquet");
    let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(from).unwrap())
        .unwrap()
        .build()
        .unwrap();
    let batches: Vec<RecordBatch> = reader
        .map(|b| {
            let b = b.unwrap();
            let at = b.schema().index_of("data_source").unwrap();
            let mut columns = b.columns().to_vec();
            columns[at] =
                std::sync::Arc::new(StringArray::from(vec!["lighteval/MATH"; b.num_rows()]))
                    as ArrayRef;
            RecordBatch::try_new(b.schema(), columns).unwrap()
        })
        .collect();
    let dir = root.join("data/geo3k");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, copies) in [("train.parquet", 171), ("test.parquet", 1)] {
        let file = std::fs::File::create(dir.join(name)).unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(file, batches[0].schema(), None).unwrap();
        for _ in 0..copies {
            for b in &batches {
                w.write(b).unwrap();
            }
        }
        w.close().unwrap();
    }
}

/// verl's geo3k tool config, as verl ships it (`config: {}`), at the path its multi-turn geo3k
/// lines name (relative to where they run): main_ppo's tool workers ship no geo3k tool (verl's
/// `verl.tools.geo3k_tool.Geo3kTool` scores with mathruler), and those lines are refused naming
/// the key.
fn write_geo3k_tool_config(cwds: &[PathBuf]) {
    let config = [
        "tools:",
        "  - class_name: verl.tools.geo3k_tool.Geo3kTool",
        "    config: {}",
        "    tool_schema:",
        "      type: function",
        "      function:",
        "        name: calc_geo3k_reward",
        "        description: the reward of a geo3k answer",
        "        parameters:",
        "          type: object",
        "          properties:",
        "            answer: {type: string, description: the answer}",
        "          required: [answer]",
    ]
    .join("\n");
    for cwd in cwds {
        let p = cwd.join("examples/sglang_multiturn/config/tool_config/geo3k_tool_config.yaml");
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, &config).unwrap();
    }
}

/// The line with its paths swapped: data files, model folders of the same family, the reward
/// file, LoRA adapter folders, output folders and example config folders; the actor's and critic's model paths and the
/// data files are added where the line leaves verl's defaults (`~/models/...`, `~/data/...`).
fn swapped(entry: &Value, root: &Path) -> Vec<String> {
    let commit = entry["commit"].as_str().unwrap();
    let models = entry["models"].as_object().unwrap();
    let data = root.join("data");
    // A vision-language line reads geo3k-layout data, as verl's geo3k lines do; the others GSM8K.
    let files = match models["actor_rollout_ref.model.path"].as_str() {
        Some("qwen2_5_vl" | "qwen3_vl" | "qwen3_vl_moe") => {
            ["geo3k/train.parquet", "geo3k/test.parquet"]
        }
        _ => ["train.jsonl", "test.jsonl"],
    };
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
            Some(file(files[0]))
        } else if key == DATA_KEYS[1] {
            Some(file(files[1]))
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
    for (key, name) in DATA_KEYS.iter().zip(files) {
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
    write_geo3k_layout(root.path());
    write_geo3k_tool_config(&[
        root.path().to_path_buf(),
        root.path().join("with-verl-b178a3c"),
    ]);
    // Most lines log to wandb (verl's default `trainer.logger`), whose SDK `config check`
    // imports: stand-ins, as a user running them has the SDK installed.
    let sdks = super::stub_sdks(root.path());
    verl_test_sampler_module(&sdks);
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

/// The module two lines name as their sampler (`data.sampler.class_path=pkg://tests.utils.
/// dataset.test_create_rl_sampler_on_cpu`, `class_name=RandomCurriculumSampler`) is verl's own
/// test file, importable where those scripts run (verl's repository root). Under the same
/// import path, a stand-in with the same class: a random permutation per epoch and an `update`
/// that does nothing, written with `random` instead of torch's RandomSampler (no torch here).
/// The lines stay as written: `config check` imports the module by that name and builds the
/// class over the training data.
fn verl_test_sampler_module(python_path: &Path) {
    let dir = python_path.join("tests/utils/dataset");
    std::fs::create_dir_all(&dir).unwrap();
    for pkg in ["tests", "tests/utils", "tests/utils/dataset"] {
        std::fs::write(python_path.join(pkg).join("__init__.py"), "").unwrap();
    }
    std::fs::write(
        dir.join("test_create_rl_sampler_on_cpu.py"),
        "import random\n\n\nclass RandomCurriculumSampler:\n    def __init__(self, data_source, data_config):\n        self.data_source = data_source\n        self.rng = random.Random(1)\n\n    def __iter__(self):\n        order = list(range(len(self.data_source)))\n        self.rng.shuffle(order)\n        return iter(order)\n\n    def __len__(self):\n        return len(self.data_source)\n\n    def update(self, batch):\n        return\n",
    )
    .unwrap();
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

/// verl b178a3c's example lines with interactions (`run_qwen2.5-3b_gsm8k_multiturn_4xgpu.sh`
/// and its `_server` variant: the GSM8K tool, verl's GSM8K interaction, `max_user_turns=1`;
/// `run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh`, with bf16 weights: `model_dtype`)
/// train two steps as written, with the model, data, output and the example config folder
/// swapped, their tool and interaction configs (this repository's copies of verl's) at the
/// relative paths the lines name, and the batch, response length, step count, GPU count and
/// loggers shrunk at the end. The data are GSM8K rows with verl's `tools_kwargs` and
/// `interaction_kwargs` (with the `name` verl's agent loop requires). Every conversation whose
/// first turn ended without a tool call got the interaction's verdict as a user turn (the
/// model is never right here: "Your response is incorrect! ...", cut where the response
/// length ends), scored 0 in `turn_scores`, and then one more model turn at most, for at most
/// the line's `max_user_turns` verdicts where its command line sets one. The model is a tiny Llama with the byte tokenizer, or
/// SmolLM2-135M-Instruct when MAIN_PPO_INTERACTION_SMOLLM2 is set as well as MAIN_PPO_SMOLLM2.
#[test]
fn verls_interaction_lines_train_two_steps() {
    let root = tempfile::tempdir().unwrap();
    write_example_configs(root.path());
    // SmolLM2 takes ~18 CPU-minutes for the two lines: asked for on its own, not in CI.
    let model = match std::env::var_os("MAIN_PPO_INTERACTION_SMOLLM2").and(super::smollm2()) {
        Some(p) => p,
        None => {
            let m = root.path().join("model");
            super::tiny_model_dir(&m);
            m
        }
    };
    let data = root.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let rows = main_ppo::data::read_rows(&super::data_dir().join("train.parquet")).unwrap();
    let rows: Vec<Value> = rows[..8]
        .iter()
        .map(|r| {
            let mut r = r.clone();
            let gt = r["reward_model"]["ground_truth"].clone();
            let q = r["prompt"][0]["content"].clone();
            r["extra_info"]["tools_kwargs"] =
                serde_json::json!({"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": gt}}});
            r["extra_info"]["interaction_kwargs"] =
                serde_json::json!({"name": "gsm8k", "query": q, "ground_truth": gt});
            r
        })
        .collect();
    for f in ["train.jsonl", "test.jsonl"] {
        super::write_jsonl(&data.join(f), &rows);
    }
    let lines: Vec<Value> = std::fs::read_to_string(fixtures().join("b178a3c.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| {
            e["argv"].to_string().contains("interaction_config_path") && e["expect"] == "pass"
        })
        .collect();
    assert_eq!(lines.len(), 3, "the three interaction lines that pass");
    for entry in &lines {
        let name = entry["script"].as_str().unwrap();
        let run = tempfile::tempdir_in(root.path()).unwrap();
        for (to, from) in [
            (
                "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml",
                "configs/tool_config/gsm8k_tool_config.yaml",
            ),
            (
                "examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml",
                "configs/interaction_config/gsm8k_interaction_config.yaml",
            ),
        ] {
            let to = run.path().join(to);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(super::repo().join(from), to).unwrap();
        }
        let max_user_turns: usize = entry["argv"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|a| a.as_str()?.split_once("multi_turn.max_user_turns="))
            .map_or(usize::MAX, |(_, n)| n.parse().unwrap());
        let dumps = run.path().join("rollouts");
        let mut args: Vec<String> = swapped(entry, root.path())
            .into_iter()
            .map(|a| match a.split_once('=') {
                Some(("actor_rollout_ref.model.path", _)) => {
                    format!("actor_rollout_ref.model.path={}", model.display())
                }
                _ => a,
            })
            .collect();
        args.extend(
            [
                "data.train_batch_size=4",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                "data.max_response_length=192",
                "trainer.total_training_steps=2",
                "trainer.n_gpus_per_node=1",
                "trainer.test_freq=-1",
                "trainer.val_before_train=False",
                "trainer.logger=[console]",
            ]
            .map(String::from),
        );
        args.push(format!("trainer.rollout_data_dir={}", dumps.display()));
        let out = super::bin_in(run.path()).args(&args).output().unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{name}: {stderr}");
        let step2 = stdout
            .lines()
            .find(|l| l.starts_with("step:2 "))
            .unwrap_or_else(|| panic!("{name}: {stdout}"));
        assert!(step2.contains("num_turns/mean:"), "{name}: {step2}");
        let mut asked = 0;
        for step in [1, 2] {
            let text_ = std::fs::read_to_string(dumps.join(format!("{step}.jsonl"))).unwrap();
            for row in text_
                .lines()
                .map(|l| serde_json::from_str::<Value>(l).unwrap())
            {
                let turns = row["turns"].as_array().unwrap();
                let first_called = row["tool_calls"].as_u64().unwrap() > 0;
                let first_ended = turns[0]["text"].as_str().unwrap().ends_with("<|im_end|>");
                // The interaction's verdict as a user turn, perhaps cut where the response
                // length ends.
                const VERDICT: &str =
                    "Your response is incorrect! You need to reflect on your answer and try again.";
                let verdict = turns.iter().any(|t| {
                    let text = t["text"].as_str().unwrap();
                    let said = text.split_once("user\n").map(|(_, x)| x);
                    let said = said.map(|x| x.split("<|im_end|>").next().unwrap());
                    said.is_some_and(|x| !x.is_empty() && VERDICT.starts_with(x))
                });
                if first_ended && !first_called {
                    asked += 1;
                    assert!(verdict, "{name}: {row}");
                    // One verdict per user turn, each 0, at most the line's max_user_turns;
                    // a model turn after each (num_turns = model + user turns + 1).
                    let scores = row["turn_scores"].as_array().unwrap();
                    assert!(
                        !scores.is_empty() && scores.len() <= max_user_turns,
                        "{name}: {row}"
                    );
                    assert!(scores.iter().all(|x| x == 0.0), "{name}: {row}");
                    let most = 2 * scores.len() as u64 + 2;
                    assert!(row["num_turns"].as_u64().unwrap() <= most, "{name}: {row}");
                }
            }
        }
        assert!(asked > 0, "{name}: no conversation reached the interaction");
    }
}
