//! verl's custom sampler (`data.sampler.class_path`, `class_name`) end to end: the binary trains
//! on the prompts in the order a Python sampler class gives, calls its `update` with the step's
//! data, resumes its order exactly from a checkpoint, and refuses a broken class by name.

use std::path::Path;

use serde_json::Value;

use super::{bin_in, text, tiny_run};

/// A curriculum sampler with a fixed order per epoch (`ORDERS`; epochs after the last repeat
/// it), which appends what each `update` receives to `updates.jsonl`, and keeps its state
/// (updates seen, position in the epoch) through `state_dict`/`load_state_dict`.
const SAMPLER: &str = r#"
import json

ORDERS = [[5, 2, 7, 0, 3, 6, 1, 4], [1, 3, 5, 7, 0, 2, 4, 6]]

class Fixed:
    def __init__(self, data_source, data_config):
        assert len(data_source) == 8
        self.first = data_source[0]
        self.config = data_config
        self.epoch, self.pos, self.updates = -1, 0, 0

    def __len__(self):
        return 8

    def __iter__(self):
        if self.pos == 0:
            self.epoch += 1
        order = ORDERS[min(self.epoch, len(ORDERS) - 1)]
        while self.pos < len(order):
            self.pos += 1
            yield order[self.pos - 1]
        self.pos = 0

    def update(self, batch):
        self.updates += 1
        b = batch.batch
        rows = len(batch)
        with open("updates.jsonl", "a") as f:
            f.write(json.dumps({
                "updates": self.updates,
                "step": batch.meta_info["global_steps"],
                "rows": rows,
                "tensors": sorted(b),
                "responses_shape": [len(b["responses"]), len(b["responses"][0])],
                "columns": sorted(batch.non_tensor_batch),
                "index": list(batch.non_tensor_batch["index"]),
                "uid": list(batch.non_tensor_batch["uid"]),
                "raw_prompt": batch.non_tensor_batch["raw_prompt"][0][0]["content"],
                "score_rows": [sum(r) for r in b["token_level_scores"]],
                "seed": self.config["seed"],
                "first_row_source": self.first["data_source"],
            }) + "\n")

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos, "updates": self.updates}

    def load_state_dict(self, state):
        self.epoch, self.pos, self.updates = state["epoch"], state["pos"], state["updates"]
"#;

/// The dataset indices of each step's prompts, from `trainer.rollout_data_dir` (prompt `i` is
/// "What is i + i?", two responses each, in the step's order).
fn prompt_order(dumps: &Path, steps: u64) -> Vec<Vec<usize>> {
    (1..=steps)
        .map(|s| {
            let rows = main_ppo::data::read_rows(&dumps.join(format!("{s}.jsonl"))).unwrap();
            let mut order: Vec<usize> = Vec::new();
            for r in rows {
                let input = r["input"].as_str().unwrap();
                let at = input.find("What is ").unwrap() + "What is ".len();
                let i: usize = input[at..].split(' ').next().unwrap().parse().unwrap();
                if order.last() != Some(&i) {
                    order.push(i);
                }
            }
            order
        })
        .collect()
}

fn run_with_sampler(dir: &Path, steps: u64, extra: &[&str]) -> std::process::Output {
    std::fs::write(dir.join("fixed_sampler.py"), SAMPLER).unwrap();
    let mut args = tiny_run(
        dir,
        steps,
        &[
            "data.sampler.class_path=fixed_sampler.py",
            "data.sampler.class_name=Fixed",
            "data.dataloader_num_workers=0",
            "data.seed=11",
            "trainer.save_freq=2",
            "trainer.total_epochs=3",
            "trainer.rollout_data_dir=dumps",
        ],
    );
    args.extend(extra.iter().map(|s| s.to_string()));
    bin_in(dir).args(&args).output().unwrap()
}

/// The prompts come in the sampler's order (two batches of four per epoch, the second epoch in
/// its own order); `update` gets verl's tensors and columns for the step's 8 responses; a run
/// stopped after step 2 and resumed serves steps 3 and 4 as the uninterrupted run did.
#[test]
fn training_follows_a_sampler_class_and_resumes_its_order() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_with_sampler(dir.path(), 4, &[]);
    assert!(out.status.success(), "{}", text(&out).1);
    let order = prompt_order(&dir.path().join("dumps"), 4);
    assert_eq!(
        order,
        vec![
            vec![5, 2, 7, 0],
            vec![3, 6, 1, 4],
            vec![1, 3, 5, 7],
            vec![0, 2, 4, 6]
        ]
    );
    let updates: Vec<Value> = std::fs::read_to_string(dir.path().join("updates.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(updates.len(), 4);
    let u = &updates[0];
    assert_eq!((u["step"].as_u64(), u["rows"].as_u64()), (Some(1), Some(8)));
    for t in [
        "prompts",
        "responses",
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_mask",
        "token_level_scores",
        "token_level_rewards",
        "advantages",
        "returns",
        "old_log_probs",
        "values",
    ] {
        assert!(
            u["tensors"].as_array().unwrap().iter().any(|x| x == t),
            "{t} not in {u}"
        );
    }
    for c in [
        "data_source",
        "reward_model",
        "extra_info",
        "index",
        "raw_prompt",
        "uid",
        "tools_kwargs",
    ] {
        assert!(
            u["columns"].as_array().unwrap().iter().any(|x| x == c),
            "{c} not in {u}"
        );
    }
    assert_eq!(u["responses_shape"][0], 8);
    assert!(u["responses_shape"][1].as_u64().unwrap() <= 5);
    // The first prompt's two responses share a uid; `raw_prompt` is the row's chat.
    assert_eq!(u["uid"][0], u["uid"][1]);
    assert_eq!(u["raw_prompt"], "What is 5 + 5?");
    assert_eq!(
        (u["seed"].as_u64(), u["first_row_source"].as_str()),
        (Some(11), Some("openai/gsm8k"))
    );
    assert_eq!(u["score_rows"].as_array().unwrap().len(), 8);

    // Stopped after step 2 (its checkpoint), then the same command resumes steps 3 and 4.
    let dir2 = tempfile::tempdir().unwrap();
    let out = run_with_sampler(dir2.path(), 2, &[]);
    assert!(out.status.success(), "{}", text(&out).1);
    let out = run_with_sampler(dir2.path(), 4, &[]);
    assert!(out.status.success(), "{}", text(&out).1);
    assert_eq!(prompt_order(&dir2.path().join("dumps"), 4), order);
    let resumed: Vec<Value> = std::fs::read_to_string(dir2.path().join("updates.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The sampler's own state (its update count) came back from the checkpoint.
    let counts: Vec<u64> = resumed
        .iter()
        .map(|u| u["updates"].as_u64().unwrap())
        .collect();
    assert_eq!(counts, vec![1, 2, 3, 4]);
}

/// A sampler that cannot be built stops training and `config check` with one error naming the
/// keys, the file and the class; `config check` reports a good one's length.
#[test]
fn config_check_builds_the_sampler_and_names_a_broken_one() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("fixed_sampler.py"), SAMPLER).unwrap();
    let base = tiny_run(dir.path(), 1, &["data.dataloader_num_workers=0"]);
    let check = |extra: &[&str]| {
        let mut args = vec!["config".to_string(), "check".to_string()];
        args.extend(base.iter().cloned());
        args.extend(extra.iter().map(|s| s.to_string()));
        bin_in(dir.path()).args(&args).output().unwrap()
    };
    let out = check(&[
        "data.sampler.class_path=fixed_sampler.py",
        "data.sampler.class_name=Fixed",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("order: data.sampler: `Fixed` from fixed_sampler.py, len(sampler) = 8, update(batch=...) after each step"),
        "{stdout}"
    );
    let out = check(&[
        "data.sampler.class_path=fixed_sampler.py",
        "data.sampler.class_name=Missing",
    ]);
    let stderr = text(&out).1;
    assert!(!out.status.success());
    assert!(
        stderr.contains("data.sampler.class_path = fixed_sampler.py, data.sampler.class_name = Missing: cannot build the sampler: AttributeError:")
            && stderr.contains("has no class `Missing` (it defines: Fixed)"),
        "{stderr}"
    );
    let mut args = base.clone();
    args.extend([
        "data.sampler.class_path=pkg://not_installed.samplers".to_string(),
        "data.sampler.class_name=Fixed".to_string(),
    ]);
    let out = bin_in(dir.path()).args(&args).output().unwrap();
    let stderr = text(&out).1;
    assert!(!out.status.success());
    assert!(
        stderr.contains("data.sampler.class_path = pkg://not_installed.samplers")
            && stderr.contains("No module named 'not_installed'"),
        "{stderr}"
    );
}
