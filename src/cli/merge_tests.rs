//! `main_ppo merge` on tiny LoRA checkpoints: what it writes, that `generate` gives the same
//! tokens from it as from base + adapter, and what it refuses.

use std::path::{Path, PathBuf};

use clap::Parser;

use super::*;
use crate::weights::merge_tests::{lora_checkpoint, max_diff};

fn args(local_dir: &Path, target_dir: &Path) -> MergeArgs {
    MergeArgs {
        local_dir: local_dir.to_path_buf(),
        target_dir: target_dir.to_path_buf(),
        base: None,
        force: false,
        backend: "fsdp".into(),
        gguf: None,
    }
}

fn refused(a: &MergeArgs) -> String {
    run(a).expect_err("refused").to_string()
}

/// The names in `dir`, sorted (hidden partial folders included).
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// `generate` with greedy decoding on 4 prompts, with `overrides` naming the model; the
/// responses and their token log-probabilities.
fn greedy(root: &Path, overrides: &[String]) -> Vec<(String, Vec<f64>)> {
    let input = root.join("prompts.jsonl");
    let rows: Vec<_> = ["2+2?", "Say hello.", "Count to three.", "Name a colour."]
        .iter()
        .map(|q| crate::testing::verl_row(q, "0"))
        .collect();
    crate::testing::write_jsonl(&input, &rows).unwrap();
    let output = root.join("generated.jsonl");
    let mut o = vec![
        "data.max_prompt_length=128".to_string(),
        "data.max_response_length=24".into(),
        "actor_rollout_ref.rollout.temperature=0".into(),
        "actor_rollout_ref.rollout.dtype=fp32".into(),
        "actor_rollout_ref.rollout.ignore_eos=True".into(),
        "trainer.device=cpu".into(),
    ];
    o.extend(overrides.iter().cloned());
    let g = super::super::generate::GenerateArgs {
        input,
        output: output.clone(),
        batch_size: None,
        log_probs: true,
        dtype: "f32".into(),
        config: crate::cli::ConfigArgs {
            overrides: o,
            ..Default::default()
        },
    };
    super::super::generate::run(&g).unwrap();
    crate::data::read_rows(&output)
        .unwrap()
        .iter()
        .map(|r| {
            let lps: Vec<f64> = r["response_log_probs"][0]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            (r["responses"][0].as_str().unwrap().to_string(), lps)
        })
        .collect()
}

/// [`greedy`] with the checkpoint's base model and its adapters (`lora_adapter_path`).
fn greedy_base_plus_adapter(root: &Path, base: &Path, actor: &Path) -> Vec<(String, Vec<f64>)> {
    greedy(
        root,
        &[
            format!("actor_rollout_ref.model.path={}", base.display()),
            format!(
                "actor_rollout_ref.model.lora_adapter_path={}",
                actor.join("lora_adapter").display()
            ),
        ],
    )
}

/// The same greedy text for each of the 4 prompts, 24 log-probs each, within 1e-5.
fn assert_same_greedy(want: &[(String, Vec<f64>)], got: &[(String, Vec<f64>)]) {
    assert_eq!((want.len(), got.len()), (4, 4));
    for (a, m) in want.iter().zip(got) {
        assert_eq!(a.0, m.0, "greedy text");
        assert_eq!((a.1.len(), m.1.len()), (24, 24));
        let d =
            a.1.iter()
                .zip(&m.1)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
        assert!(d <= 1e-5, "log-probs differ by {d}");
    }
}

/// `main_ppo merge --local_dir <checkpoint>/global_step_1 --target_dir OUT` writes an HF
/// folder from which `generate` gives the greedy tokens of `generate` with the base model and
/// `lora_adapter_path` (4 prompts, 24 tokens, f32 products), with log-probabilities within
/// 1e-5; the base alone generates otherwise. No partial folder is left beside the target.
#[test]
fn merge_writes_a_model_that_generates_as_base_plus_adapter() {
    let root = tempfile::tempdir().unwrap();
    let (base, actor) = lora_checkpoint(root.path());
    let out = root.path().join("exported/merged");
    run(&args(actor.parent().unwrap(), &out)).unwrap();
    assert_eq!(names(&root.path().join("exported")), ["merged"]);
    let adapted = greedy_base_plus_adapter(root.path(), &base, &actor);
    let merged = greedy(
        root.path(),
        &[format!("actor_rollout_ref.model.path={}", out.display())],
    );
    let plain = greedy(
        root.path(),
        &[format!("actor_rollout_ref.model.path={}", base.display())],
    );
    assert_same_greedy(&adapted, &merged);
    for ((a, _), (p, _)) in adapted.iter().zip(&plain) {
        assert_ne!(a, p, "the adapters change the text");
    }
}

/// `merge --gguf f32` of a LoRA checkpoint writes `<target_dir>/model-f32.gguf`, from which
/// `generate` gives the greedy tokens of base + adapter (4 prompts, 24 tokens, f32, log-probs
/// within 1e-5); `--target_dir <file>.gguf` writes that file; an existing file is refused
/// without `--force` and replaced with it; no hidden file is left beside the target.
#[test]
fn merge_writes_a_gguf_file_that_generates_as_base_plus_adapter() {
    let root = tempfile::tempdir().unwrap();
    let (base, actor) = lora_checkpoint(root.path());
    let step = actor.parent().unwrap().to_path_buf();
    let out = root.path().join("exported");
    let mut a = args(&step, &out);
    a.gguf = Some("F32".into());
    run(&a).unwrap();
    let file = out.join("model-f32.gguf");
    assert_eq!(names(&out), ["model-f32.gguf"]);
    let adapted = greedy_base_plus_adapter(root.path(), &base, &actor);
    let merged = greedy(
        root.path(),
        &[format!("actor_rollout_ref.model.path={}", file.display())],
    );
    assert_same_greedy(&adapted, &merged);
    // Again: refused without --force, replaced with it.
    let e = refused(&a);
    assert!(
        e.starts_with("--target_dir")
            && e.contains("model-f32.gguf exists")
            && e.contains("--force"),
        "{e}"
    );
    a.force = true;
    run(&a).unwrap();
    // A named file, in bf16.
    let named = root.path().join("named/tiny.gguf");
    let mut b = args(&step, &named);
    b.gguf = Some("bf16".into());
    run(&b).unwrap();
    let (_, c) = crate::weights::gguf::open(&named).unwrap();
    assert_eq!(c.metadata["general.file_type"].to_u32().unwrap(), 32);
    assert_eq!(
        c.metadata["general.name"].to_string().unwrap(),
        "ckpt-global_step_1"
    );
    for dir in [&out, &root.path().join("named")] {
        assert!(
            !names(dir).iter().any(|n| n.starts_with('.')),
            "{:?}",
            names(dir)
        );
    }
}

/// `--gguf` refusals, each naming the flag and the value or path, before anything is loaded
/// (the adapter's weights are garbage here, so that an error about them would mean the merge
/// had started): a type the writer does not write, a target under a file, a target that is a
/// folder named `.gguf`, and the input `.gguf` file itself (also with `--force`).
#[test]
fn merge_refuses_bad_gguf_types_and_targets_before_loading() {
    let root = tempfile::tempdir().unwrap();
    let (base, actor) = lora_checkpoint(root.path());
    std::fs::write(
        actor.join("lora_adapter/adapter_model.safetensors"),
        b"garbage",
    )
    .unwrap();
    let step = actor.parent().unwrap().to_path_buf();
    let mut a = args(&step, &root.path().join("out"));
    a.gguf = Some("q4_0".into());
    let e = refused(&a);
    assert!(
        e.starts_with("--gguf") && e.contains("`q4_0`") && e.contains("f32, f16, bf16"),
        "{e}"
    );
    let file = root.path().join("a_file");
    std::fs::write(&file, "x").unwrap();
    let under = file.join("out.gguf");
    let mut a = args(&step, &under);
    a.gguf = Some("f16".into());
    let e = refused(&a);
    assert!(
        e.starts_with("--target_dir")
            && e.contains(&format!("{}: cannot write in", under.display()))
            && !e.contains("merging-"),
        "{e}"
    );
    let folder = root.path().join("dir.gguf");
    std::fs::create_dir(&folder).unwrap();
    let mut a = args(&step, &folder);
    a.gguf = Some("f16".into());
    let e = refused(&a);
    assert!(e.contains("dir.gguf is a folder"), "{e}");
    // A GGUF model given as the input cannot be its own target.
    let input = root.path().join("in.gguf");
    let mut a = args(&base, &input);
    a.gguf = Some("f32".into());
    run(&a).unwrap();
    let mut a = args(&input, &input);
    a.gguf = Some("f32".into());
    a.force = true;
    let e = refused(&a);
    assert!(e.starts_with("--target_dir") && e.contains(" is "), "{e}");
    assert!(!names(root.path()).iter().any(|n| n.starts_with('.')));
}

/// A model folder is copied as a model (same logits bit for bit); an adapter folder given
/// alone finds its base in adapter_config.json, or takes `--base`.
#[test]
fn merge_copies_a_model_and_takes_an_adapter_alone() {
    use crate::weights::merge_tests::{load, logits, with_adapter};
    let root = tempfile::tempdir().unwrap();
    let (base, actor) = lora_checkpoint(root.path());
    let copy = root.path().join("copy");
    run(&args(&base, &copy)).unwrap();
    assert_eq!(logits(&load(&copy)), logits(&load(&base)));
    // The adapter folder alone (no checkpoint beside it): a copy elsewhere.
    let adapter = root.path().join("adapter");
    std::fs::create_dir(&adapter).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(actor.join("lora_adapter").join(f), adapter.join(f)).unwrap();
    }
    let out = root.path().join("from_adapter");
    run(&args(&adapter, &out)).unwrap();
    let want = logits(&with_adapter(&base, &adapter));
    assert!(max_diff(&logits(&load(&out)), &want) <= 1e-5);
    // `--base` (here the copy, same weights) wins over the recorded base.
    let mut a = args(&adapter, &root.path().join("with_base"));
    a.base = Some(copy.display().to_string());
    run(&a).unwrap();
    assert!(max_diff(&logits(&load(&root.path().join("with_base"))), &want) <= 1e-5);
}

/// Refused before anything is loaded or written, each naming the flag and the path: a target
/// that is inside the checkpoint (verl's own example writes into `actor/huggingface`), that
/// contains it (also with `--force`), an existing non-empty target without `--force` (with it,
/// replaced), an adapter without a recorded base and without `--base`, a base that does not
/// exist, another backend. The inputs are untouched after all of it.
#[test]
fn merge_refuses_targets_that_touch_inputs_and_missing_bases() {
    let root = tempfile::tempdir().unwrap();
    let (base, actor) = lora_checkpoint(root.path());
    let step = actor.parent().unwrap().to_path_buf();
    let before: Vec<Vec<String>> = [&actor, &actor.join("huggingface"), &base]
        .iter()
        .map(|d| names(d))
        .collect();
    for (target, relation) in [
        (actor.join("huggingface"), "lies inside"),
        (actor.join("merged"), "lies inside"),
        (step.join("../global_step_1/actor/x"), "lies inside"),
        (root.path().join("ckpt"), "contains"),
        (base.join("out"), "lies inside"),
    ] {
        for force in [false, true] {
            let mut a = args(&step, &target);
            a.force = force;
            let e = refused(&a);
            assert!(
                e.starts_with("--target_dir")
                    && e.contains(&format!("{} {relation} ", target.display())),
                "{}: {e}",
                target.display()
            );
        }
    }
    // An existing non-empty folder: named, kept; replaced with --force.
    let out = root.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "x").unwrap();
    let e = refused(&args(&step, &out));
    assert!(
        e.contains(&out.display().to_string()) && e.contains("--force"),
        "{e}"
    );
    assert_eq!(names(&out), ["keep.txt"]);
    let mut a = args(&step, &out);
    a.force = true;
    run(&a).unwrap();
    assert!(out.join("model.safetensors").is_file() && !out.join("keep.txt").exists());
    assert!(
        !names(root.path()).iter().any(|n| n.starts_with('.')),
        "{:?}",
        names(root.path())
    );
    // An empty existing folder is fine without --force.
    let empty = root.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    run(&args(&step, &empty)).unwrap();
    // No base recorded, none given; a base that is not there.
    let cfg_path = actor.join("lora_adapter/adapter_config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg.as_object_mut()
        .unwrap()
        .remove("base_model_name_or_path");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let e = refused(&args(&step, &root.path().join("n1")));
    assert!(
        e.contains("base_model_name_or_path") && e.contains("--base"),
        "{e}"
    );
    let mut a = args(&step, &root.path().join("n2"));
    a.base = Some(root.path().join("no/such/base").display().to_string());
    let e = refused(&a);
    assert!(
        e.starts_with("--base") && e.contains("no/such/base") && e.contains("does not exist"),
        "{e}"
    );
    std::fs::write(&cfg_path, text).unwrap();
    let mut a = args(&step, &root.path().join("n3"));
    a.backend = "megatron".into();
    let e = refused(&a);
    assert!(e.starts_with("--backend") && e.contains("megatron"), "{e}");
    // Nothing was written for any refusal, and the inputs are as they were.
    for n in ["n1", "n2", "n3"] {
        assert!(!root.path().join(n).exists(), "{n}");
    }
    let after: Vec<Vec<String>> = [&actor, &actor.join("huggingface"), &base]
        .iter()
        .map(|d| names(d))
        .collect();
    assert_eq!(after, before);
}

/// A target that cannot be written is refused before anything is loaded, naming `--target_dir`
/// and the target (not the hidden folder the merge writes into): here its folder is a file (and,
/// when not run as root, a read-only folder) and the adapter's weights are garbage, so that an
/// error about them would mean the merge had started. Before, the merge loaded and folded
/// everything first and then failed on the folder, naming neither the flag nor the target.
#[test]
fn merge_refuses_an_unwritable_target_before_loading() {
    let root = tempfile::tempdir().unwrap();
    let (_base, actor) = lora_checkpoint(root.path());
    std::fs::write(
        actor.join("lora_adapter/adapter_model.safetensors"),
        b"garbage",
    )
    .unwrap();
    let step = actor.parent().unwrap().to_path_buf();
    let file = root.path().join("a_file");
    std::fs::write(&file, "x").unwrap();
    let mut targets = vec![file.join("merged")];
    // SAFETY: reads the process's effective user id.
    if unsafe { libc::geteuid() } != 0 {
        let ro = root.path().join("read_only");
        std::fs::create_dir(&ro).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        targets.push(ro.join("merged"));
    }
    for target in targets {
        let e = refused(&args(&step, &target));
        assert!(
            e.starts_with("--target_dir")
                && e.contains(&format!("{}: cannot write in", target.display()))
                && !e.contains("merging-"),
            "{e}"
        );
    }
    assert!(!names(root.path()).iter().any(|n| n.starts_with('.')));
}

/// The pid of a process that has ended.
fn dead_pid() -> u32 {
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

/// What a killed merge left beside its target is cleaned by the next merge into it: its hidden
/// folder `.<name>.merging-<pid>` is removed, and a target it had moved aside
/// (`.<name>.replaced-<pid>`, killed between the two renames) is put back, and then refused as
/// any existing folder without `--force`. A running merge's folder is left alone. Before, the
/// hidden folders stayed forever and a target moved aside was never put back.
#[test]
fn merge_cleans_what_a_killed_merge_left() {
    let root = tempfile::tempdir().unwrap();
    let (_base, actor) = lora_checkpoint(root.path());
    let step = actor.parent().unwrap().to_path_buf();
    let out = root.path().join("out");
    let dead = dead_pid();
    let stale = root.path().join(format!(".out.merging-{dead}"));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("model.safetensors"), "half").unwrap();
    let mut running = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let live = root.path().join(format!(".out.merging-{}", running.id()));
    std::fs::create_dir(&live).unwrap();
    run(&args(&step, &out)).unwrap();
    assert!(out.join("model.safetensors").is_file());
    assert!(!stale.exists(), "a killed merge's folder stays");
    assert!(live.exists(), "a running merge's folder was removed");
    running.kill().unwrap();
    running.wait().unwrap();
    // Killed between moving the old target aside and renaming the new one into place.
    let kept = root.path().join("kept");
    let aside = root.path().join(format!(".kept.replaced-{dead}"));
    std::fs::create_dir(&aside).unwrap();
    std::fs::write(aside.join("keep.txt"), "mine").unwrap();
    let half = root.path().join(format!(".kept.merging-{dead}"));
    std::fs::create_dir(&half).unwrap();
    let e = refused(&args(&step, &kept));
    assert!(
        e.contains(&kept.display().to_string()) && e.contains("--force"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_to_string(kept.join("keep.txt")).unwrap(),
        "mine"
    );
    assert!(!aside.exists() && !half.exists());
}

/// An adapter folder's problems are reported as themselves: invalid JSON in
/// `adapter_config.json` names that file (before: "names no base model", the JSON being
/// unreadable), and an `r` that disagrees with the tensors names `adapter_model.safetensors`,
/// the tensor, its rank and `r` (before: a bare shape error naming neither the file nor `r`).
#[test]
fn merge_names_a_broken_adapter_config_and_a_wrong_r() {
    let root = tempfile::tempdir().unwrap();
    let (_base, actor) = lora_checkpoint(root.path());
    let step = actor.parent().unwrap().to_path_buf();
    let cfg_path = actor.join("lora_adapter/adapter_config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(&cfg_path, &text[..text.len() / 2]).unwrap();
    let e = refused(&args(&step, &root.path().join("n1")));
    assert!(
        e.starts_with("--local_dir")
            && e.contains("adapter_config.json")
            && e.contains("not valid JSON")
            && !e.contains("base"),
        "{e}"
    );
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg["r"] = serde_json::json!(2);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let e = format!(
        "{:#}",
        run(&args(&step, &root.path().join("n2"))).unwrap_err()
    );
    assert!(
        e.contains("adapter_model.safetensors")
            && e.contains("rank 4")
            && e.contains("`r` in")
            && e.contains("is 2"),
        "{e}"
    );
    assert!(!names(root.path())
        .iter()
        .any(|n| n.starts_with('.') || n.starts_with('n')));
}

/// verl's spelling (`--local_dir`, `--target_dir`, `--backend fsdp`, `--hf_model_path`) and the
/// dashed one both parse.
#[test]
fn merge_takes_verls_flags_and_dashed_ones() {
    for argv in [
        [
            "main_ppo",
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            "a",
            "--target_dir",
            "b",
            "--hf_model_path",
            "m",
        ],
        [
            "main_ppo",
            "merge",
            "--backend",
            "fsdp",
            "--local-dir",
            "a",
            "--target-dir",
            "b",
            "--base",
            "m",
        ],
    ] {
        let cli = crate::cli::Cli::try_parse_from(argv).unwrap();
        let Some(crate::cli::Command::Merge(a)) = cli.command else {
            panic!("not merge: {argv:?}")
        };
        assert_eq!(
            (a.local_dir, a.target_dir, a.base),
            (
                PathBuf::from("a"),
                PathBuf::from("b"),
                Some("m".to_string())
            )
        );
    }
}

/// `config check` refuses a LoRA checkpoint given as `actor_rollout_ref.model.path` (its
/// `huggingface/`, which has a config.json, and its `lora_adapter/`, which has none) naming the
/// key, the adapter and what to pass, before any model is loaded (it passed, or only logged,
/// before).
#[test]
fn config_check_names_a_lora_checkpoint_given_as_the_model() {
    let root = tempfile::tempdir().unwrap();
    let (_base, actor) = lora_checkpoint(root.path());
    for given in [actor.join("huggingface"), actor.join("lora_adapter")] {
        let o = vec![
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".to_string(),
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8".into(),
            "critic.ppo_micro_batch_size_per_gpu=4".into(),
            "data.max_prompt_length=128".into(),
            "data.max_response_length=6".into(),
            format!("actor_rollout_ref.model.path={}", given.display()),
        ];
        let cfg = crate::config::load(&crate::config::ConfigSource::Builtin, &o)
            .unwrap()
            .config;
        let plan = crate::config::resolve(&cfg).unwrap();
        let e = crate::trainer::preflight::model_context(&cfg, &plan)
            .expect_err("refused")
            .to_string();
        assert!(
            e.starts_with("actor_rollout_ref.model.path")
                && e.contains("LoRA adapter")
                && e.contains("model.lora_adapter_path=")
                && e.contains("main_ppo merge"),
            "{}: {e}",
            given.display()
        );
    }
}
