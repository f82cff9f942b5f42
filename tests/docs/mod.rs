//! Documentation that cannot rot: the README and the book (`docs/src`, with the files it
//! includes) are read as a user reads them, and
//! - every `main_ppo ...` command line in their shell blocks is run: training lines and
//!   `config check`/`show` lines through `config check` / `config show` with model, data, reward
//!   and output paths swapped for local fixtures, the other subcommands through clap's parsing
//!   (`--help` after the line) and their overrides through `config show`;
//! - every configuration key they name exists in the configuration reference;
//! - every internal link and anchor resolves, every book page is in SUMMARY.md, and every
//!   repository path they quote exists;
//! - the configuration reference (`docs/src/reference/config.md`) is what
//!   `main_ppo config reference` writes, and holds every key of the schema;
//! - the README stays short and keeps CI's test command.
//!
//! `scripts/docs_check.sh` builds the book with mdBook besides.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use regex::Regex;
use serde_yaml_ng::Value;

use super::{bin, repo, text};

/// CI's test command (`.ci/run`), which the README shows as the way to run the tests.
const TEST_COMMAND: &str = "timeout -k 30 60m cargo test --locked --features mpi";
/// The README's length limit (issue 58: read in five minutes; the rest is the book's).
const README_MAX_LINES: usize = 250;
const REFERENCE: &str = "docs/src/reference/config.md";

/// A Markdown file of the docs with its `{{#include}}`s expanded.
struct Doc {
    /// Relative to the repository root.
    path: PathBuf,
    text: String,
}

fn docs() -> Vec<Doc> {
    let mut paths = vec![PathBuf::from("README.md")];
    let mut stack = vec![repo().join("docs/src")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                paths.push(p.strip_prefix(repo()).unwrap().to_path_buf());
            }
        }
    }
    paths.sort();
    paths
        .into_iter()
        .map(|path| Doc {
            text: expand_includes(&repo().join(&path)),
            path,
        })
        .collect()
}

/// The file's text with mdBook's `{{#include FILE}}` lines replaced by FILE's text.
fn expand_includes(path: &Path) -> String {
    let raw = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    raw.lines()
        .map(|l| match l.trim().strip_prefix("{{#include ") {
            Some(rest) => {
                let target = path
                    .parent()
                    .unwrap()
                    .join(rest.trim_end_matches("}}").trim());
                expand_includes(&target)
            }
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A fenced code block: its language and its lines with their 1-based line numbers.
struct Block {
    lang: String,
    lines: Vec<(usize, String)>,
}

/// The fenced blocks of a Markdown text, and the text with them blanked (for prose checks).
fn split_blocks(text: &str) -> (Vec<Block>, String) {
    let mut blocks = Vec::new();
    let mut prose = String::new();
    let mut current: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        let fence = line.trim_start().starts_with("```");
        match (&mut current, fence) {
            (None, true) => {
                current = Some(Block {
                    lang: line.trim_start().trim_start_matches('`').trim().to_string(),
                    lines: Vec::new(),
                })
            }
            (Some(_), true) => blocks.push(current.take().unwrap()),
            (Some(b), false) => b.lines.push((i + 1, line.to_string())),
            (None, false) => {
                prose.push_str(line);
            }
        }
        prose.push('\n');
    }
    (blocks, prose)
}

/// Shell words of one logical line, up to a comment; quotes removed.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                in_word = true;
                for d in chars.by_ref() {
                    if d == c {
                        break;
                    }
                    word.push(d);
                }
            }
            '#' if !in_word => break,
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// A `main_ppo` command line found in the docs.
struct CommandLine {
    at: String,
    args: Vec<String>,
}

/// Every `main_ppo` command in the shell blocks: the words after the `main_ppo` word (also
/// `target/release/main_ppo` behind a launcher), up to `&&`, `|`, `;` or a redirection.
fn command_lines(docs: &[Doc]) -> Vec<CommandLine> {
    let mut out = Vec::new();
    for doc in docs {
        let (blocks, _) = split_blocks(&doc.text);
        for b in blocks
            .iter()
            .filter(|b| ["sh", "bash", "shell", "console"].contains(&b.lang.as_str()))
        {
            let mut logical = String::new();
            let mut start = 0;
            for (n, line) in &b.lines {
                if logical.is_empty() {
                    start = *n;
                }
                match line.trim_end().strip_suffix('\\') {
                    Some(head) => {
                        logical.push_str(head);
                        logical.push(' ');
                        continue;
                    }
                    None => logical.push_str(line),
                }
                let words = shell_words(&std::mem::take(&mut logical));
                let Some(i) = words
                    .iter()
                    .position(|w| w == "main_ppo" || w.ends_with("/main_ppo"))
                else {
                    continue;
                };
                let args: Vec<String> = words[i + 1..]
                    .iter()
                    .take_while(|w| !["&&", "||", "|", ";", "&", ">", "2>"].contains(&w.as_str()))
                    .cloned()
                    .collect();
                out.push(CommandLine {
                    at: format!("{}:{start}", doc.path.display()),
                    args,
                });
            }
        }
    }
    out
}

/// Local stand-ins for the paths the docs' commands name.
struct Fixtures {
    dir: tempfile::TempDir,
    model: PathBuf,
    /// An interpreter standing in for a virtualenv the docs name: python3 with an empty
    /// module for each tracker SDK (`config check` imports the SDKs of `trainer.logger`).
    python: PathBuf,
}

impl Fixtures {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let model = super::verl::model_dir(dir.path(), "llama");
        std::fs::write(
            dir.path().join("reward.py"),
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
        )
        .unwrap();
        let sdks = super::stub_sdks(dir.path());
        let python = dir.path().join("python");
        std::fs::write(
            &python,
            format!(
                "#!/bin/sh\nexport PYTHONPATH={}\nexec python3 \"$@\"\n",
                sdks.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
        Self { dir, model, python }
    }

    /// `key=value` with the value swapped where it names a model, a missing file, an output
    /// folder or a missing interpreter.
    fn swap(&self, arg: &str) -> String {
        let Some((k, v)) = arg.split_once('=') else {
            return arg.to_string();
        };
        if k.starts_with('-') {
            return arg.to_string();
        }
        let key = k.trim_start_matches(['+', '~']);
        let missing = !repo().join(v).exists() && !Path::new(v).exists();
        let new = if key.ends_with("model.path") || key.ends_with("model_path") {
            self.model.display().to_string()
        } else if (key == "data.train_files" || key == "data.val_files") && missing {
            repo().join("data/gsm8k/test.parquet").display().to_string()
        } else if key.ends_with("custom_reward_function.path") && missing {
            self.dir.path().join("reward.py").display().to_string()
        } else if key == "reward.python" && missing {
            self.python.display().to_string()
        } else if key.ends_with("_dir") && key.starts_with("trainer.") {
            self.dir.path().join("out").display().to_string()
        } else {
            return arg.to_string();
        };
        format!("{k}={new}")
    }

    /// A training or `config` line made runnable here: paths swapped, and the model and data
    /// paths a `--config` file names (the recipes point at the model cache) replaced.
    fn runnable(&self, args: &[String]) -> Vec<String> {
        let mut out: Vec<String> = args.iter().map(|a| self.swap(a)).collect();
        let set = |key: &str| {
            args.iter().any(|a| {
                a.trim_start_matches(['+', '~'])
                    .starts_with(&format!("{key}="))
            })
        };
        for key in ["actor_rollout_ref.model.path", "critic.model.path"] {
            if !set(key) {
                out.push(format!("{key}={}", self.model.display()));
            }
        }
        // The trackers' SDKs installed, as a reader of the line has them (verl's default
        // `trainer.logger` names wandb, whose SDK `config check` imports as training does).
        if !set("reward.python") {
            out.push(format!("reward.python={}", self.python.display()));
        }
        let config = args
            .iter()
            .position(|a| a == "--config")
            .and_then(|i| args.get(i + 1));
        if let Some(file) = config {
            let tree: Value =
                serde_yaml_ng::from_str(&std::fs::read_to_string(repo().join(file)).unwrap())
                    .unwrap();
            for key in ["data.train_files", "data.val_files"] {
                let files = main_ppo::config::tree::get(&tree, &main_ppo::config::tree::split(key));
                let missing = files.is_some_and(|v| {
                    let list: Vec<&Value> = match v {
                        Value::Sequence(s) => s.iter().collect(),
                        other => vec![other],
                    };
                    list.iter()
                        .any(|f| f.as_str().is_some_and(|f| !repo().join(f).exists()))
                });
                if missing && !set(key) {
                    out.push(self.swap(&format!("{key}=/missing")));
                }
            }
        }
        out
    }
}

const SUBCOMMANDS: [&str; 8] = [
    "train", "config", "reward", "eval", "generate", "merge", "plot", "sft",
];

/// What went wrong with one command line, if anything.
fn check_command(fx: &Fixtures, line: &CommandLine) -> Option<String> {
    let args = &line.args;
    let sub = args
        .first()
        .map(String::as_str)
        .filter(|a| SUBCOMMANDS.contains(a));
    let run = |argv: Vec<String>| {
        let out = bin().current_dir(repo()).args(&argv).output().unwrap();
        let (_, err) = text(&out);
        (out.status.success(), argv, err)
    };
    let failed = |(ok, argv, err): (bool, Vec<String>, String)| {
        (!ok).then(|| {
            let tail: Vec<&str> = err.lines().rev().take(4).collect();
            format!(
                "{}: `main_ppo {}` failed:\n    {}",
                line.at,
                argv.join(" "),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n    ")
            )
        })
    };
    match (sub, args.get(1).map(String::as_str)) {
        (None | Some("train"), _) => {
            let rest = if sub.is_some() { &args[1..] } else { &args[..] };
            let mut argv = vec!["config".into(), "check".into()];
            argv.extend(fx.runnable(rest));
            failed(run(argv))
        }
        // SFT lines: through `config check --sft`, paths swapped (no RL model keys added).
        (Some("sft"), _) => {
            let mut argv: Vec<String> = vec!["config".into(), "check".into(), "--sft".into()];
            argv.extend(args[1..].iter().map(|a| fx.swap(a)));
            failed(run(argv))
        }
        (Some("config"), Some("check")) if args.iter().any(|a| a == "--sft") => {
            let mut argv = args[..2].to_vec();
            argv.extend(args[2..].iter().map(|a| fx.swap(a)));
            failed(run(argv))
        }
        (Some("config"), Some("check" | "show")) => {
            let mut argv = args[..2].to_vec();
            argv.extend(fx.runnable(&args[2..]));
            failed(run(argv))
        }
        // Reward tests need no model: run as written (the examples ship their files).
        (Some("reward"), Some("test")) => failed(run(args.clone())),
        _ => {
            let mut argv = args.clone();
            argv.push("--help".into());
            if let Some(e) = failed(run(argv)) {
                return Some(e);
            }
            // The overrides (and --config) of a subcommand, through the typed configuration.
            let mut show: Vec<String> = vec!["config".into(), "show".into()];
            let mut words = args.iter();
            while let Some(w) = words.next() {
                if w == "--config" {
                    show.push(w.clone());
                    show.extend(words.next().cloned());
                } else if !w.starts_with('-') && w.contains('=') {
                    show.push(fx.swap(w));
                }
            }
            failed(run(show))
        }
    }
}

#[test]
fn every_command_line_in_the_docs_runs() {
    let docs = docs();
    let lines = command_lines(&docs);
    assert!(
        lines.len() >= 20,
        "only {} main_ppo command lines found in the docs: is the extraction broken?",
        lines.len()
    );
    let fx = Fixtures::new();
    let failures: Vec<String> = lines.iter().filter_map(|l| check_command(&fx, l)).collect();
    assert!(
        failures.is_empty(),
        "{} of {} command lines in the docs fail:\n{}",
        failures.len(),
        lines.len(),
        failures.join("\n")
    );
}

/// One row of the configuration reference.
struct Row {
    key: String,
    kind: String,
    status: String,
}

fn reference_rows(page: &str) -> Vec<Row> {
    page.lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.split(" | ").collect();
            Row {
                key: cells[0]
                    .trim_start_matches("| ")
                    .trim_matches('`')
                    .to_string(),
                kind: cells[1].to_string(),
                status: cells[3].to_string(),
            }
        })
        .collect()
}

/// Whether a dotted key the docs name is a key of the reference: a row, a section above rows,
/// or a key below a compat entry, a free-form mapping or a list.
fn known_key(rows: &[Row], key: &str) -> bool {
    let mut segs: Vec<&str> = key.split('.').collect();
    if segs.len() > 3 && segs[..2] == ["distillation", "teacher_models"] {
        segs[2] = "teacher_model";
    }
    let key = segs.join(".");
    rows.iter().any(|r| {
        r.key == key
            || r.key.starts_with(&format!("{key}."))
            || (key.starts_with(&format!("{}.", r.key))
                && (r.status != "implemented"
                    || r.kind.contains("mapping")
                    || r.kind.contains("list")))
    })
}

/// Whether a dotted key is one of `main_ppo sft`'s (its typed defaults, a key inside one of
/// its free-form maps, or one of its no-effect keys).
fn sft_key(key: &str) -> bool {
    let tree = serde_yaml_ng::to_value(main_ppo::config::SftConfig::default()).unwrap();
    let segs = main_ppo::config::tree::split(key);
    (1..=segs.len()).rev().any(|i| {
        main_ppo::config::tree::get(&tree, &segs[..i])
            .is_some_and(|v| i == segs.len() || v.as_mapping().is_some_and(|m| m.is_empty()))
    }) || main_ppo::config::sft::SFT_NO_EFFECT
        .iter()
        .any(|p| key == *p || key.starts_with(&format!("{p}.")))
}

/// Every key of `main_ppo sft`'s own sections (`data`, `trainer`, `checkpoint`; `model` and
/// `optim` are the RL trainer's, in the reference) has a row in the SFT chapter's key table.
#[test]
fn every_sft_key_is_documented() {
    let page = std::fs::read_to_string(repo().join("docs/src/sft.md")).unwrap();
    let tree = serde_yaml_ng::to_value(main_ppo::config::SftConfig::default()).unwrap();
    let mut leaves = Vec::new();
    main_ppo::config::tree::leaves(&tree, &mut Vec::new(), &mut leaves);
    let missing: Vec<String> = leaves
        .iter()
        .filter(|l| ["data", "trainer", "checkpoint"].contains(&l[0].as_str()))
        .map(|l| l.join("."))
        .filter(|k| !page.contains(&format!("| `{k}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/src/sft.md has no row for: {missing:?}"
    );
}

/// The dotted configuration keys a text names (in prose, code spans and shell lines).
fn named_keys(text: &str) -> Vec<String> {
    let sections = "data|actor_rollout_ref|critic|reward|algorithm|distillation|trainer|\
                    custom_reward_function|reward_model|sandbox_fusion|reward_manager|\
                    model_engine|global_profiler|transfer_queue|ray_kwargs";
    let re = Regex::new(&format!(
        r"(?:^|[^A-Za-z0-9_./$-])((?:{sections})\.[A-Za-z0-9_][A-Za-z0-9_.]*)"
    ))
    .unwrap();
    let files = [
        ".py", ".yaml", ".json", ".jsonl", ".parquet", ".gguf", ".md", ".rs", ".sh",
    ];
    re.captures_iter(text)
        .map(|c| c[1].trim_end_matches('.').to_string())
        .filter(|k| !files.iter().any(|f| k.ends_with(f)))
        .collect()
}

/// The dotted keys of a YAML block (`reward: {sources: ...}` → `reward.sources`).
fn yaml_keys(block: &str) -> Vec<String> {
    let Ok(tree) = serde_yaml_ng::from_str::<Value>(block) else {
        return Vec::new();
    };
    let mut leaves = Vec::new();
    main_ppo::config::tree::leaves(&tree, &mut Vec::new(), &mut leaves);
    leaves.iter().map(|l| l.join(".")).collect()
}

#[test]
fn every_config_key_the_docs_name_exists() {
    let page = std::fs::read_to_string(repo().join(REFERENCE)).unwrap();
    let rows = reference_rows(&page);
    let mut unknown = BTreeSet::new();
    let mut checked = 0;
    for doc in docs()
        .iter()
        .filter(|d| !d.path.ends_with("reference/config.md"))
    {
        let (blocks, _) = split_blocks(&doc.text);
        let mut keys = named_keys(&doc.text);
        for b in blocks.iter().filter(|b| b.lang == "yaml") {
            let body: Vec<&str> = b.lines.iter().map(|(_, l)| l.as_str()).collect();
            keys.extend(yaml_keys(&body.join("\n")));
        }
        for k in keys {
            checked += 1;
            if !known_key(&rows, &k) && !sft_key(&k) {
                unknown.insert(format!("{}: `{k}`", doc.path.display()));
            }
        }
    }
    assert!(checked >= 200, "only {checked} keys found in the docs");
    assert!(
        unknown.is_empty(),
        "keys the docs name that main_ppo does not know (see {REFERENCE}):\n{}",
        unknown.into_iter().collect::<Vec<_>>().join("\n")
    );
}

/// mdBook's heading ids (`normalize_id`): lower case, spaces to `-`, only alphanumerics, `-`
/// and `_` kept; a repeated id gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let (_, prose) = split_blocks(text);
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    for line in prose.lines() {
        let Some(title) = line.strip_prefix('#').map(|t| t.trim_start_matches('#')) else {
            continue;
        };
        let plain = title.trim().replace('`', "");
        let id: String = plain
            .chars()
            .filter_map(|c| {
                if c.is_alphanumeric() || c == '_' || c == '-' {
                    Some(c.to_lowercase().next().unwrap())
                } else if c.is_whitespace() {
                    Some('-')
                } else {
                    None
                }
            })
            .collect();
        let n = seen.entry(id.clone()).or_insert(0);
        out.insert(if *n == 0 {
            id.clone()
        } else {
            format!("{id}-{n}")
        });
        *n += 1;
    }
    out
}

/// The link targets of a Markdown text outside code: `[text](target)` and `![alt](target)`.
fn links(text: &str) -> Vec<String> {
    let (_, prose) = split_blocks(text);
    let no_code = Regex::new(r"`[^`]*`").unwrap().replace_all(&prose, "");
    Regex::new(r"\]\(([^)\s]+)\)")
        .unwrap()
        .captures_iter(&no_code)
        .map(|c| c[1].to_string())
        .collect()
}

/// The links of a doc whose file or heading does not exist.
fn broken_links(doc: &Doc) -> Vec<String> {
    let dir = repo().join(&doc.path).parent().unwrap().to_path_buf();
    let mut broken = Vec::new();
    for target in links(&doc.text) {
        if target.starts_with("http://") || target.starts_with("https://") {
            continue;
        }
        let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
        let path = if file.is_empty() {
            repo().join(&doc.path)
        } else {
            dir.join(file)
        };
        if !path.exists() {
            broken.push(format!(
                "{}: `{target}`: no file {}",
                doc.path.display(),
                path.display()
            ));
        } else if !anchor.is_empty() && !anchors(&expand_includes(&path)).contains(anchor) {
            broken.push(format!(
                "{}: `{target}`: no heading with id `{anchor}`",
                doc.path.display()
            ));
        }
    }
    broken
}

/// Repository paths a doc quotes in code spans that do not exist (a path of verl's
/// repository is introduced as "verl's `examples/...`" and not checked).
fn missing_paths(doc: &Doc, span: &Regex) -> Vec<String> {
    let (_, prose) = split_blocks(&doc.text);
    span.captures_iter(&prose)
        .filter(|c| c.get(1).is_none())
        .map(|c| c[2].to_string())
        .filter(|p| !p.contains(['<', '{', '*', '…']) && !repo().join(p).exists())
        .map(|p| format!("{}: `{p}` does not exist", doc.path.display()))
        .collect()
}

#[test]
fn every_link_anchor_page_and_quoted_path_resolves() {
    let docs = docs();
    let span = Regex::new(
        r"(verl's )?`((?:configs|scripts|examples|src|tests|data|docs|benches|assets)/[^`\s]*)`",
    )
    .unwrap();
    let mut broken: Vec<String> = docs
        .iter()
        .flat_map(|d| broken_links(d).into_iter().chain(missing_paths(d, &span)))
        .collect();
    // Every page of the book is in its table of contents.
    let summary = std::fs::read_to_string(repo().join("docs/src/SUMMARY.md")).unwrap();
    let listed: BTreeSet<String> = links(&summary).into_iter().collect();
    for doc in docs.iter().filter(|d| d.path.starts_with("docs/src")) {
        let rel = doc
            .path
            .strip_prefix("docs/src")
            .unwrap()
            .display()
            .to_string();
        if rel != "SUMMARY.md" && !listed.contains(&rel) {
            broken.push(format!("docs/src/{rel} is not in docs/src/SUMMARY.md"));
        }
    }
    assert!(
        broken.is_empty(),
        "broken references in the docs:\n{}",
        broken.join("\n")
    );
}

/// The keys of the schema, counted without the reference: the leaves of the defaults
/// (`config show`) and the compat table's entries (each role entry under each role).
fn schema_keys() -> BTreeSet<String> {
    let out = bin().args(["config", "show"]).output().unwrap();
    assert!(out.status.success(), "config show: {}", text(&out).1);
    let tree: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    let mut leaves = Vec::new();
    main_ppo::config::tree::leaves(&tree, &mut Vec::new(), &mut leaves);
    let mut keys: BTreeSet<String> = leaves.iter().map(|l| l.join(".")).collect();
    use main_ppo::config::compat::{ROLES, ROLE_TABLE, TABLE};
    keys.extend(TABLE.iter().map(|(k, _)| k.to_string()));
    for role in ROLES {
        keys.extend(ROLE_TABLE.iter().map(|(k, _)| format!("{role}.{k}")));
    }
    keys
}

#[test]
fn reference_page_is_current() {
    let out = bin().args(["config", "reference"]).output().unwrap();
    assert!(out.status.success(), "config reference: {}", text(&out).1);
    let written = String::from_utf8(out.stdout).unwrap();
    let committed = std::fs::read_to_string(repo().join(REFERENCE)).unwrap();
    let schema = schema_keys();
    let rows = reference_rows(&committed);
    let listed: BTreeSet<String> = rows.iter().map(|r| r.key.clone()).collect();
    assert_eq!(
        rows.len(),
        listed.len(),
        "a key listed twice in {REFERENCE}"
    );
    let missing: Vec<&String> = schema.difference(&listed).collect();
    let extra: Vec<&String> = listed.difference(&schema).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{REFERENCE} against the schema ({} keys): missing {missing:?}, not in the schema {extra:?}",
        schema.len()
    );
    let stated = format!("Every key main_ppo knows: {} keys.", schema.len());
    assert!(
        committed.contains(&stated),
        "{REFERENCE} does not say `{stated}`"
    );
    assert!(
        written == committed,
        "{REFERENCE} is not what the binary writes: run `cargo run -- config reference > {REFERENCE}`"
    );
}

#[test]
fn readme_is_short_and_keeps_the_set_up_commands() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let n = readme.lines().count();
    assert!(
        n <= README_MAX_LINES,
        "README.md has {n} lines (at most {README_MAX_LINES}): move the detail into the book"
    );
    let (blocks, _) = split_blocks(&readme);
    let shell: Vec<&str> = blocks
        .iter()
        .filter(|b| b.lang == "sh")
        .flat_map(|b| b.lines.iter().map(|(_, l)| l.trim()))
        .collect();
    assert!(
        shell.contains(&"scripts/quickstart.sh"),
        "README.md lost the quickstart command"
    );
    assert!(
        shell.contains(&TEST_COMMAND),
        "README.md lost the test command `{TEST_COMMAND}`"
    );
    let ci = std::fs::read_to_string(repo().join(".ci/run")).unwrap();
    assert!(
        ci.lines().any(|l| l.trim() == TEST_COMMAND),
        ".ci/run no longer runs README.md's test command `{TEST_COMMAND}`"
    );
}
