//! `main_ppo sft` against verl: the dataset's ids and loss mask, the loss and every gradient
//! equal a PyTorch reference of verl's masked SFT loss in f64 (`tests/fixtures/sft_tool/`,
//! written by `scripts/sft_reference.py` with transformers 5.24 / torch 2.15: a tiny Qwen2, the
//! byte tokenizer with Qwen2.5's chat template, a conversation with a calculator tool call),
//! packed and padded micro-batches alike; the named errors of bad rows; a run that resumes
//! exactly and one with LoRA.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Var};

use super::*;
use crate::config::sft::{load_sft, resolve_sft};
use crate::data::sft::SftDataset;
use crate::trainer::update::{mini_batch_grads, mini_batch_norm, UpdateScalars};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sft_tool")
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn config(extra: &[&str]) -> SftConfig {
    let mut o: Vec<String> = vec![
        format!("model.path={}", fixture().display()),
        format!(
            "data.train_files={}",
            fixture().join("data.jsonl").display()
        ),
        "data.max_length=4096".into(),
        "data.max_token_len_per_gpu=4096".into(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    load_sft(None, &o).unwrap().config
}

fn dataset(
    cfg: &SftConfig,
    files: &[String],
) -> std::result::Result<SftDataset, crate::data::DataError> {
    let tok = TokenizerBundle::from_dir(&fixture()).unwrap();
    let template = tok.template(None).unwrap();
    SftDataset::build(files, &sft_options(cfg, -1), &tok, &template)
}

/// The ids and loss mask are verl's (transformers' rendering, verl's rules), and the mask
/// covers exactly the assistant turns' tokens after their `<|im_start|>assistant\n` header:
/// the tool call block and the answer, each with its closing `<|im_end|>\n` (the template's
/// newline after it included, as verl trains it); nothing of the system, user or tool turns.
#[test]
fn ids_and_loss_mask_are_verls() {
    let r = reference();
    let cfg = config(&[]);
    let ds = dataset(&cfg, &[fixture().join("data.jsonl").display().to_string()]).unwrap();
    let tok = TokenizerBundle::from_dir(&fixture()).unwrap();
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(ds.len(), rows.len());
    let mut trained = Vec::new();
    for (ex, want) in ds.examples.iter().zip(rows) {
        let ids: Vec<u32> = serde_json::from_value(want["input_ids"].clone()).unwrap();
        let mask: Vec<u8> = serde_json::from_value(want["loss_mask"].clone()).unwrap();
        assert_eq!(ex.input_ids, ids);
        assert_eq!(ex.loss_mask, mask);
        // The trained runs, decoded.
        let mut run = Vec::new();
        let mut spans = Vec::new();
        for (&t, &m) in ex.input_ids.iter().zip(&ex.loss_mask) {
            if m == 1 {
                run.push(t);
            } else if !run.is_empty() {
                spans.push(tok.tokenizer.decode(&run, false).unwrap());
                run.clear();
            }
        }
        if !run.is_empty() {
            spans.push(tok.tokenizer.decode(&run, false).unwrap());
        }
        trained.push(spans);
    }
    assert_eq!(
        trained,
        vec![
            vec![
                "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"48/2\"}}\n</tool_call><|im_end|>\n".to_string(),
                "It is 24.\n#### 24<|im_end|>\n".to_string(),
            ],
            vec!["#### 5<|im_end|>\n".to_string(), "#### 20<|im_end|>\n".to_string()],
        ]
    );
    let tokens: usize = ds
        .examples
        .iter()
        .map(|e| e.loss_mask.iter().map(|&m| m as usize).sum::<usize>())
        .sum();
    assert_eq!(tokens as f64, r["batch_num_tokens"].as_f64().unwrap());
}

/// verl's `sft_loss` and its gradient with respect to every parameter equal PyTorch autograd's
/// (f64, within 1e-8 absolute or relative), for one step of both conversations cut into
/// micro-batches of 1 and 2 rows and by a token budget, packed and padded.
#[test]
fn loss_and_gradients_equal_pytorch_in_f64_packed_and_padded() {
    let r = reference();
    let dir = fixture();
    let loaded =
        crate::weights::hf::load_dir(&dir, &Default::default(), DType::F64, &Device::Cpu, true)
            .unwrap();
    assert!(
        loaded.model.packs_without_padding(),
        "packing must run here"
    );
    let want = candle_core::safetensors::load(dir.join("grads.safetensors"), &Device::Cpu).unwrap();
    let cfg = config(&[]);
    let ds = dataset(&cfg, &[dir.join("data.jsonl").display().to_string()]).unwrap();
    let rows: Vec<&SftExample> = ds.examples.iter().collect();
    let batch = sft_batch(&rows).unwrap();
    let vars: Vec<(String, Var)> = loaded
        .varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(
        vars.len(),
        want.len(),
        "every parameter has a reference gradient"
    );
    let want_loss = r["loss"].as_f64().unwrap();
    for packed in [true, false] {
        for micro in [
            MicroBatching::Sequences(1),
            MicroBatching::Sequences(2),
            MicroBatching::TokenBudget(1000),
        ] {
            let settings = UpdateSettings {
                prefix: "train",
                plan: sft_update_plan(micro, 2, 1.0),
                seed: 0,
                loss_scale_factor: None,
                inputs: Layout {
                    pad_id: 256,
                    packed,
                    share_prefixes: false,
                    image_token: None,
                },
                shard: (0, 1),
            };
            let mini = [0usize, 1];
            let norm = mini_batch_norm(&batch, &mini, &settings.plan, None);
            let ctx = MicroCtx {
                norm,
                on_policy: false,
            };
            let mut scalars = UpdateScalars::default();
            let grads = mini_batch_grads(
                &loaded.model,
                &vars,
                (&batch, &mini),
                &settings,
                ctx,
                &mut scalars,
                &mut |m, mi, _, ctx| sft_micro_loss(m, mi, ctx),
            )
            .unwrap()
            .unwrap();
            let what = format!("packed={packed} {micro:?}");
            let loss = scalars.totals["train/loss"];
            assert!(
                (loss - want_loss).abs() < 1e-10,
                "{what}: loss {loss} vs {want_loss}"
            );
            for (name, var) in &vars {
                let got = grads
                    .get(var.as_tensor())
                    .unwrap_or_else(|| panic!("{what}: no gradient for {name}"));
                let got: Vec<f64> = got.flatten_all().unwrap().to_vec1().unwrap();
                let exp: Vec<f64> = want[name].flatten_all().unwrap().to_vec1().unwrap();
                for (g, e) in got.iter().zip(&exp) {
                    assert!(
                        (g - e).abs() <= 1e-8 * e.abs().max(1.0),
                        "{what}: d loss / d {name}: {g} vs {e}"
                    );
                }
            }
        }
    }
}

fn write_rows(dir: &Path, name: &str, rows: &[serde_json::Value]) -> String {
    let p = dir.join(name);
    crate::testing::write_jsonl(&p, rows).unwrap();
    p.display().to_string()
}

/// A row without `messages`, a call to a tool the row does not offer, and a conversation
/// longer than max_length with truncation=error each stop with the file, the row and the rule;
/// left and right truncation keep the last and first max_length tokens.
#[test]
fn bad_rows_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let ok = serde_json::json!({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]});
    let no_messages = serde_json::json!({"prompt": "hi", "answer": "hello"});
    let f = write_rows(tmp.path(), "a.jsonl", &[ok.clone(), no_messages.clone()]);
    let e = dataset(&config(&[]), std::slice::from_ref(&f))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&f)
            && e.contains("row 1")
            && e.contains("`messages`")
            && e.contains("data.messages_key"),
        "{e}"
    );
    // The same row in the single-turn form trains as user + assistant.
    let single = config(&["data.prompt_key=prompt", "data.response_key=answer"]);
    let ds = dataset(&single, &[f]).unwrap();
    assert_eq!(ds.examples[0], ds.examples[1]);

    let unknown = serde_json::json!({"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "python", "arguments": {"code": "2+2"}}}]}],
        "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]});
    let f = write_rows(tmp.path(), "b.jsonl", &[ok.clone(), ok.clone(), unknown]);
    let e = dataset(&config(&[]), std::slice::from_ref(&f))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&f) && e.contains("row 2") && e.contains("`python`") && e.contains("calculator"),
        "{e}"
    );

    let long = serde_json::json!({"messages": [
        {"role": "user", "content": "x".repeat(300)}, {"role": "assistant", "content": "y"}]});
    let f = write_rows(tmp.path(), "c.jsonl", &[ok, long]);
    let e = dataset(&config(&["data.max_length=200"]), std::slice::from_ref(&f))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&f)
            && e.contains("row 1")
            && e.contains("data.max_length = 200")
            && e.contains("truncation=error"),
        "{e}"
    );
    let whole = dataset(&config(&[]), std::slice::from_ref(&f))
        .unwrap()
        .examples[1]
        .clone();
    let n = whole.input_ids.len();
    for (mode, range) in [("left", n - 200..n), ("right", 0..200)] {
        let t = format!("data.truncation={mode}");
        let ds = dataset(
            &config(&["data.max_length=200", &t]),
            std::slice::from_ref(&f),
        )
        .unwrap();
        assert_eq!(ds.truncated, 1);
        assert_eq!(ds.examples[1].input_ids, whole.input_ids[range.clone()]);
        assert_eq!(ds.examples[1].loss_mask, whole.loss_mask[range]);
    }
}

fn weights_of(t: &SftTrainer) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<(String, Vec<f32>)> = t
        .model
        .optimizer
        .vars()
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn trainer(out: &Path, extra: &[&str]) -> SftTrainer {
    let mut o = vec![
        "data.train_batch_size=1",
        "optim.lr=1e-3",
        "trainer.total_training_steps=4",
    ];
    let d = format!("trainer.default_local_dir={}", out.display());
    o.push(&d);
    o.extend(extra);
    let cfg = config(&o);
    let plan = resolve_sft(&cfg).unwrap();
    SftTrainer::new(cfg, plan, false).unwrap()
}

/// Four steps (two epochs of two conversations) in one run equal two steps, a checkpoint and
/// two resumed steps: the same losses and bit-identical weights; the loss falls. The saved
/// `global_step_N/` loads as a model path with the trainer's weights.
#[test]
fn a_resumed_run_equals_an_uninterrupted_one() {
    let tmp = tempfile::tempdir().unwrap();
    let mut full = trainer(&tmp.path().join("a"), &[]);
    let losses: Vec<f64> = (0..4).map(|_| full.step().unwrap()["train/loss"]).collect();

    let mut first = trainer(&tmp.path().join("b"), &[]);
    let mut resumed_losses: Vec<f64> = (0..2)
        .map(|_| first.step().unwrap()["train/loss"])
        .collect();
    let saved = first.save_checkpoint().unwrap();
    assert!(saved.join("huggingface/model.safetensors").is_file());
    assert!(saved.join("trainer_state.json").is_file());
    // The step folder is a model path, as RL, generate and eval read one.
    let (loaded, _) = crate::weights::load_model_and_tokenizer(
        saved.to_str().unwrap(),
        None,
        &Default::default(),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .unwrap();
    let read: Vec<(String, Vec<f32>)> = {
        let mut v: Vec<(String, Vec<f32>)> = loaded
            .varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    assert_eq!(read, weights_of(&first));
    drop(first);
    let mut second = trainer(&tmp.path().join("b"), &[]);
    assert_eq!(second.global_step, 2);
    resumed_losses.extend((0..2).map(|_| second.step().unwrap()["train/loss"]));
    assert_eq!(losses, resumed_losses);
    assert_eq!(weights_of(&full), weights_of(&second));
    // The same conversation again an epoch later: its loss fell.
    assert!(losses[2] < losses[0] || losses[3] < losses[1], "{losses:?}");
}

/// Ctrl-C / SIGTERM (the stop flag) ends `fit` after the step under way with a checkpoint of
/// it, even with periodic saving off; a second `fit` resumes there and ends with the weights of
/// an uninterrupted run. A stop at a step saved anyway (save_freq=1) names that checkpoint.
#[test]
fn a_stop_request_saves_the_step_and_the_run_resumes_from_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let no_saves = ["trainer.save_freq=-1"];
    let mut full = trainer(&tmp.path().join("a"), &no_saves);
    assert_eq!(full.fit().unwrap(), SftOutcome::Finished { steps: 4 });

    let out = tmp.path().join("b");
    let mut first = trainer(&out, &no_saves);
    let flag = Arc::new(AtomicBool::new(true));
    first.stop_on(flag.clone());
    let saved = crate::checkpoint::step_dir(&out, 1);
    assert_eq!(
        first.fit().unwrap(),
        SftOutcome::Interrupted {
            steps: 1,
            checkpoint: Some(saved.clone())
        }
    );
    assert!(saved.join("trainer_state.json").is_file());
    drop(first);
    let mut second = trainer(&out, &no_saves);
    assert_eq!(second.global_step, 1);
    assert_eq!(second.fit().unwrap(), SftOutcome::Finished { steps: 4 });
    assert_eq!(weights_of(&full), weights_of(&second));

    // Saving every step: the stop reuses the step's own checkpoint.
    let out = tmp.path().join("c");
    let mut every = trainer(&out, &["trainer.save_freq=1"]);
    every.stop_on(flag.clone());
    let got = every.fit().unwrap();
    assert_eq!(
        got,
        SftOutcome::Interrupted {
            steps: 1,
            checkpoint: Some(crate::checkpoint::step_dir(&out, 1))
        }
    );
    flag.store(false, Ordering::SeqCst);
}

/// With LoRA only the adapters train and are saved in PEFT's folder; `hf_model` in
/// checkpoint.save_contents adds the merged model, which `merge`'s resolver reads as a
/// checkpoint; validation reports `val/loss` at the last step.
#[test]
fn lora_sft_writes_adapters_and_a_merged_model() {
    let tmp = tempfile::tempdir().unwrap();
    let val = format!("data.val_files={}", fixture().join("data.jsonl").display());
    let mut t = trainer(
        &tmp.path().join("lora"),
        &[
            "model.lora_rank=4",
            "model.lora_alpha=8",
            "trainer.total_training_steps=2",
            "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            &val,
        ],
    );
    assert!(t
        .model
        .optimizer
        .vars()
        .iter()
        .all(|(k, _)| k.contains("lora_")));
    let before = t.validate().unwrap().unwrap();
    t.fit().unwrap();
    let after = t.validate().unwrap().unwrap();
    assert!(after < before, "val/loss {before} -> {after}");
    let dir = tmp.path().join("lora/global_step_2");
    assert!(dir.join("lora_adapter/adapter_model.safetensors").is_file());
    assert!(dir.join("huggingface/model.safetensors").is_file());
    let src = crate::weights::merge::resolve(&dir, None)
        .map_err(|e| e.error)
        .unwrap();
    assert!(matches!(src, crate::weights::merge::Source::Lora { .. }));
}
