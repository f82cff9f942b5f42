//! Reading verl datasets, tokenising prompts, filtering and truncation.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::dataset::{load_samples, DatasetOptions};
use super::*;
use crate::config::{DataConfig, Truncation};
use crate::testing::{verl_row, write_jsonl, write_tokenizer_dir};

fn gsm8k(split: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("data/gsm8k/{split}.parquet"))
}

fn opts(max_prompt_length: usize) -> DatasetOptions {
    DatasetOptions::train(
        &DataConfig {
            shuffle: false,
            ..DataConfig::default()
        },
        max_prompt_length,
    )
}

#[test]
fn shipped_gsm8k_reads_in_verl_format() {
    for (split, rows) in [("train", 7473), ("test", 1319)] {
        let path = gsm8k(split);
        let samples = load_samples(&[path.display().to_string()], &opts(512)).unwrap();
        assert_eq!(samples.len(), rows, "{split}");
        for s in &samples {
            assert_eq!(s.data_source, "openai/gsm8k");
            assert_eq!(s.prompt.len(), 1);
            assert_eq!(s.prompt[0]["role"], json!("user"));
            let q = s.prompt[0]["content"].as_str().unwrap();
            assert!(
                q.ends_with("Let's think step by step and output the final answer after \"####\"."),
                "{q}"
            );
            assert_eq!(s.extra_info["split"], json!(split));
            assert_eq!(s.extra_info["index"], json!(s.row));
            // verl's preprocessing rule, derived independently from the raw answer column:
            // the text after the first "#### ", commas removed.
            let answer = s.extra_info["answer"].as_str().unwrap();
            let after = answer
                .split("#### ")
                .nth(1)
                .unwrap()
                .trim()
                .replace(',', "");
            assert_eq!(s.ground_truth, json!(after), "row {}", s.row);
            assert_eq!(s.raw["ability"], json!("math"));
        }
    }
}

#[test]
fn jsonl_and_json_copies_read_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let rows = read_rows(&gsm8k("test")).unwrap();
    let head: Vec<Value> = rows[..50].to_vec();
    let jsonl = dir.path().join("test.jsonl");
    write_jsonl(&jsonl, &head).unwrap();
    assert_eq!(read_rows(&jsonl).unwrap(), head);
    let json = dir.path().join("test.json");
    std::fs::write(&json, serde_json::to_string_pretty(&head).unwrap()).unwrap();
    assert_eq!(read_rows(&json).unwrap(), head);
    // HF datasets also reads JSON lines from a .json file.
    let json_lines = dir.path().join("lines.json");
    write_jsonl(&json_lines, &head).unwrap();
    assert_eq!(read_rows(&json_lines).unwrap(), head);
    // Several files concatenate in order.
    let both = load_samples(
        &[jsonl.display().to_string(), json.display().to_string()],
        &opts(512),
    )
    .unwrap();
    assert_eq!(both.len(), 100);
    assert_eq!(
        (both[50].row, both[50].file.ends_with("test.json")),
        (0, true)
    );
}

fn read_err(path: &Path) -> String {
    read_rows(path).unwrap_err().to_string()
}

#[test]
fn bad_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert!(read_err(&d.join("nope.parquet")).ends_with("nope.parquet: no such file"));
    std::fs::write(d.join("garbage.parquet"), b"this is not parquet").unwrap();
    assert!(read_err(&d.join("garbage.parquet"))
        .contains("garbage.parquet: not a readable parquet file"));
    std::fs::write(d.join("empty.jsonl"), b"\n\n").unwrap();
    assert!(read_err(&d.join("empty.jsonl")).contains("empty.jsonl: the file has no rows"));
    std::fs::write(d.join("bad.jsonl"), "{\"a\": 1}\n{oops\n").unwrap();
    assert!(read_err(&d.join("bad.jsonl")).contains("bad.jsonl: line 2: not valid JSON"));
    std::fs::write(d.join("data.csv"), "a,b\n").unwrap();
    assert!(read_err(&d.join("data.csv")).contains("unsupported file type `.csv`"));
    std::fs::write(d.join("scalars.jsonl"), "1\n2\n").unwrap();
    assert!(
        read_err(&d.join("scalars.jsonl")).contains("row 0, column `*`: a row must be an object")
    );
    std::fs::write(d.join("num.json"), "42").unwrap();
    assert!(read_err(&d.join("num.json")).contains("expected a list of row objects"));
    assert!(read_err(d).contains("is a directory"));
    // A row problem names the file, the row and the column.
    let f = d.join("rows.jsonl");
    let mut bad = verl_row("q", "1");
    bad.as_object_mut().unwrap().remove("data_source");
    write_jsonl(&f, &[verl_row("q", "1"), bad]).unwrap();
    let e = load_samples(&[f.display().to_string()], &opts(512))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rows.jsonl, row 1, column `data_source`: missing"),
        "{e}"
    );
    // A custom prompt column that does not exist.
    let o = DatasetOptions {
        prompt_key: "question".into(),
        ..opts(512)
    };
    let e = load_samples(&[f.display().to_string()], &o)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("row 0, column `question`: missing") && e.contains("data.prompt_key"),
        "{e}"
    );
}

fn bundle() -> (tempfile::TempDir, TokenizerBundle) {
    let dir = tempfile::tempdir().unwrap();
    write_tokenizer_dir(dir.path()).unwrap();
    let b = TokenizerBundle::from_dir(dir.path()).unwrap();
    (dir, b)
}

#[test]
fn tokenizer_dir_gives_template_and_ids() {
    let (_d, b) = bundle();
    assert_eq!(b.eos_token_ids, vec![258, 256]);
    assert_eq!(b.pad_token_id, 256);
    assert_eq!(b.special.eos.as_deref(), Some("<|im_end|>"));
    // One token per byte, special tokens atomic.
    assert_eq!(b.encode("<|im_start|>ab").unwrap().len(), 3);
    assert_eq!(b.encode("é").unwrap().len(), 2);
    let t = b.template(None).unwrap();
    let text = t
        .render(
            &[json!({"role": "user", "content": "hi"})],
            true,
            &Default::default(),
        )
        .unwrap();
    assert!(text.ends_with("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"));
    // transformers 5 writes chat_template.jinja, which wins.
    std::fs::write(
        b.source.join("chat_template.jinja"),
        "{{ messages[0].content }}!",
    )
    .unwrap();
    let b2 = TokenizerBundle::from_dir(&b.source).unwrap();
    assert_eq!(
        b2.template(None)
            .unwrap()
            .render(
                &[json!({"role": "user", "content": "x"})],
                true,
                &Default::default()
            )
            .unwrap(),
        "x!"
    );
    // A custom template wins over both.
    assert_eq!(
        b2.template(Some("C{{ messages|length }}"))
            .unwrap()
            .render(
                &[json!({"role": "user", "content": "x"})],
                true,
                &Default::default()
            )
            .unwrap(),
        "C1"
    );
}

#[test]
fn tokenizer_errors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = TokenizerBundle::from_dir(dir.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no tokenizer.json"), "{e}");
    write_tokenizer_dir(dir.path()).unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
    let b = TokenizerBundle::from_dir(dir.path()).unwrap();
    assert!(b
        .template(None)
        .unwrap_err()
        .to_string()
        .contains("custom_chat_template"));
    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
    assert!(TokenizerBundle::from_dir(dir.path())
        .unwrap_err()
        .to_string()
        .contains("tokenizer_config.json: not valid JSON"));
    // A named template list (HF's multi-template form) picks `default`.
    let list = json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
    std::fs::write(dir.path().join("tokenizer_config.json"), list.to_string()).unwrap();
    let b = TokenizerBundle::from_dir(dir.path()).unwrap();
    assert_eq!(
        b.template(None)
            .unwrap()
            .render(&[], false, &Default::default())
            .unwrap(),
        "D"
    );
}

/// Rows whose rendered ChatML prompt is `overhead + len(question)` tokens (one per byte).
fn rows_of_lengths(lens: &[usize]) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<Value> = lens
        .iter()
        .map(|&n| verl_row(&"x".repeat(n), "1"))
        .collect();
    let f = dir.path().join("d.jsonl");
    write_jsonl(&f, &rows).unwrap();
    (dir, f.display().to_string())
}

/// Token count of the ChatML rendering around an empty question: system turn (default text),
/// user header/footer and the assistant header. Counted by hand: `<|im_start|>` 1 +
/// "system\nYou are a helpful assistant." 35 + `<|im_end|>` 1 + "\n" 1, then `<|im_start|>` 1 +
/// "user\n" 5 + `<|im_end|>` 1 + "\n" 1, then `<|im_start|>` 1 + "assistant\n" 10.
const OVERHEAD: usize = 38 + 8 + 11;

#[test]
fn overlong_prompts_filtered_or_truncated() {
    let (_d, b) = bundle();
    let t = b.template(None).unwrap();
    let (_rows_dir, file) = rows_of_lengths(&[1, 10, 20, 30]);
    let max = OVERHEAD + 15;
    let samples = || load_samples(std::slice::from_ref(&file), &opts(max)).unwrap();

    let ds = PromptDataset::build(
        samples(),
        &b,
        &t,
        &DatasetOptions {
            filter_overlong: true,
            ..opts(max)
        },
    )
    .unwrap();
    assert_eq!((ds.len(), ds.filtered_overlong, ds.truncated), (2, 2, 0));
    assert_eq!(
        ds.prompt_ids[0].len(),
        OVERHEAD + 1,
        "the hand count of the template overhead"
    );
    assert_eq!(ds.prompt_ids[1].len(), OVERHEAD + 10);

    let e = PromptDataset::build(
        samples(),
        &b,
        &t,
        &DatasetOptions {
            truncation: Truncation::Error,
            ..opts(max)
        },
    )
    .unwrap_err();
    let e = e.to_string();
    assert!(
        e.contains("d.jsonl, row 2, column `prompt`")
            && e.contains(&format!("{} tokens", OVERHEAD + 20)),
        "{e}"
    );

    let full = b
        .encode(
            &t.render(&samples()[3].prompt, true, &Default::default())
                .unwrap(),
        )
        .unwrap();
    for mode in [Truncation::Left, Truncation::Right, Truncation::Middle] {
        let ds = PromptDataset::build(
            samples(),
            &b,
            &t,
            &DatasetOptions {
                truncation: mode,
                ..opts(max)
            },
        )
        .unwrap();
        assert_eq!((ds.len(), ds.truncated), (4, 2));
        let got = &ds.prompt_ids[3];
        assert_eq!(got.len(), max);
        let expected: Vec<u32> = match mode {
            Truncation::Left => full[full.len() - max..].to_vec(),
            Truncation::Right => full[..max].to_vec(),
            _ => [&full[..max / 2], &full[full.len() - (max - max / 2)..]].concat(),
        };
        assert_eq!(got, &expected, "{mode:?}");
    }
    let e = PromptDataset::build(
        samples(),
        &b,
        &t,
        &DatasetOptions {
            filter_overlong: true,
            ..opts(OVERHEAD)
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("no prompts left"), "{e}");
}

#[test]
fn sample_limits() {
    let (_d, file) = rows_of_lengths(&(1..=20).collect::<Vec<_>>());
    let first = load_samples(
        std::slice::from_ref(&file),
        &DatasetOptions {
            max_samples: Some(5),
            ..opts(999)
        },
    )
    .unwrap();
    assert_eq!(
        first.iter().map(|s| s.row).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    let random = DatasetOptions {
        max_samples: Some(5),
        random_subset: true,
        seed: 3,
        ..opts(999)
    };
    let a: Vec<usize> = load_samples(std::slice::from_ref(&file), &random)
        .unwrap()
        .iter()
        .map(|s| s.row)
        .collect();
    let b: Vec<usize> = load_samples(std::slice::from_ref(&file), &random)
        .unwrap()
        .iter()
        .map(|s| s.row)
        .collect();
    assert_eq!(a, b, "same seed, same subset");
    // verl's rows: `np.random.default_rng(3).choice(20, size=5, replace=False)` printed
    // [3, 12, 1, 4, 19] with NumPy 2.4.6, in that order.
    assert_eq!(a, vec![3, 12, 1, 4, 19]);
    // The validation split draws its subset when `data.shuffle` (as verl's RLHFDataset, built
    // from the same data config), whatever `validation_shuffle` says; seed null falls back to 1.
    let cfg = crate::config::DataConfig {
        val_max_samples: Some(5),
        shuffle: true,
        validation_shuffle: false,
        ..Default::default()
    };
    let val = DatasetOptions::val(&cfg, 999);
    assert!(val.random_subset);
    let rows: Vec<usize> = load_samples(std::slice::from_ref(&file), &val)
        .unwrap()
        .iter()
        .map(|s| s.row)
        .collect();
    // `np.random.default_rng(1).choice(20, size=5, replace=False)`: [8, 0, 13, 18, 7].
    assert_eq!(rows, vec![8, 0, 13, 18, 7]);
    let cfg = crate::config::DataConfig {
        shuffle: false,
        validation_shuffle: true,
        ..cfg
    };
    assert!(!DatasetOptions::val(&cfg, 999).random_subset);
}

#[test]
fn collate_left_pads() {
    let (_d, b) = bundle();
    let t = b.template(None).unwrap();
    let (_rd, file) = rows_of_lengths(&[1, 4]);
    let ds = PromptDataset::build(
        load_samples(&[file], &opts(999)).unwrap(),
        &b,
        &t,
        &opts(999),
    )
    .unwrap();
    let batch = collate(&ds, &[1, 0], b.pad_token_id);
    assert_eq!((batch.batch, batch.width), (2, OVERHEAD + 4));
    let row1 = &batch.input_ids[batch.width..];
    assert_eq!(
        &row1[..3],
        &[256, 256, 256],
        "three pad tokens on the left of the shorter prompt"
    );
    assert_eq!(&row1[3..], ds.prompt_ids[0].as_slice());
    assert_eq!(
        &batch.attention_mask[batch.width..batch.width + 4],
        &[0, 0, 0, 1]
    );
    assert_eq!(
        &batch.position_ids[batch.width + 2..batch.width + 5],
        &[0, 0, 1]
    );
    assert!(batch.attention_mask[..batch.width].iter().all(|&m| m == 1));
}
