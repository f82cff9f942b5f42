//! Fuzz-style property tests of the two configuration inputs a user types: the override grammar
//! and YAML files. Whatever the bytes, loading returns a configuration or a named error; it
//! never panics. Case counts are modest so `cargo test` stays fast (each case is one load).

use proptest::prelude::*;

use super::overrides::parse_override;
use super::{load, ConfigError, ConfigSource};

/// Keys a run script really sets, plus a few that do not exist.
const KEYS: [&str; 12] = [
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.train_files",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.rollout.n",
    "algorithm.adv_estimator",
    "algorithm.kl_ctrl.kl_coef",
    "trainer.logger",
    "reward.sources",
    "custom_reward_function.path",
    "trainer.no_such_key",
    "nope",
];

/// Pieces of values: numbers, words, brackets, quotes, separators and odd characters.
fn value() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("1".to_string()),
        Just("-1".to_string()),
        Just("1e-6".to_string()),
        Just("1e999".to_string()),
        Just("nan".to_string()),
        Just("null".to_string()),
        Just("True".to_string()),
        Just("grpo".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just("{".to_string()),
        Just("}".to_string()),
        Just(",".to_string()),
        Just(":".to_string()),
        Just("'".to_string()),
        Just("\"".to_string()),
        Just(" ".to_string()),
        Just("${data.x}".to_string()),
        Just("choice(1,2)".to_string()),
        Just("\u{0}".to_string()),
        Just("é".to_string()),
        "[a-z0-9_./-]{0,8}",
    ];
    proptest::collection::vec(piece, 0..8).prop_map(|v| v.concat())
}

/// An override as a user might type it (or mistype it).
fn override_arg() -> impl Strategy<Value = String> {
    (
        prop_oneof![Just(""), Just("+"), Just("++"), Just("~")],
        prop_oneof![
            proptest::sample::select(KEYS.to_vec()).prop_map(str::to_string),
            "[a-z_.]{0,12}",
            ".*",
        ],
        prop_oneof![Just("="), Just(""), Just("=="), Just(" = ")],
        value(),
    )
        .prop_map(|(op, key, eq, v)| format!("{op}{key}{eq}{v}"))
}

/// YAML-like text: mappings, lists, flow collections, anchors, tags, odd scalars, bounded depth.
fn yaml_text() -> impl Strategy<Value = String> {
    let line = (
        0usize..6,
        prop_oneof![
            proptest::sample::select(vec![
                "data:",
                "trainer:",
                "algorithm:",
                "actor_rollout_ref:",
                "train_batch_size: 8",
                "max_prompt_length: -3",
                "adv_estimator: grpo",
                "kl_ctrl: {kl_coef: .nan}",
                "logger: [console, file",
                "- 1",
                "- {a: 1}",
                "&a x: 1",
                "y: *a",
                "z: *missing",
                "t: !!binary aGk=",
                "u: !custom 3",
                "? complex",
                ": value",
                "'quoted: key': 1",
                "k: |",
                "  block",
                "---",
                "...",
                "%YAML 1.2",
                "\t tab: 1",
                "",
            ])
            .prop_map(str::to_string),
            "[ -~]{0,20}",
        ],
    )
        .prop_map(|(indent, l)| format!("{}{l}", "  ".repeat(indent)));
    proptest::collection::vec(line, 0..16).prop_map(|v| v.join("\n"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The parser alone: any string is parsed or refused with a message, never a panic; what it
    /// accepts has a non-empty dotted key.
    #[test]
    fn any_string_parses_or_is_refused(raw in prop_oneof![override_arg(), ".*"]) {
        if let Ok(ov) = parse_override(&raw) {
            prop_assert!(!ov.key.is_empty());
            prop_assert!(ov.key.iter().all(|s| !s.is_empty()));
            prop_assert_eq!(ov.raw, raw);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Whole command lines through the loader: a configuration, or an error; an error about
    /// an override quotes it.
    #[test]
    fn any_command_line_loads_or_names_the_problem(args in proptest::collection::vec(override_arg(), 0..4)) {
        match load(&ConfigSource::Builtin, &args) {
            Ok(_) => {}
            Err(ConfigError::Override { raw, message }) => {
                prop_assert!(args.contains(&raw), "{raw}");
                prop_assert!(!message.is_empty());
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    /// YAML files: loaded or refused; a file-level error names the file.
    #[test]
    fn any_yaml_file_loads_or_names_the_file(text in yaml_text()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.yaml");
        std::fs::write(&path, &text).unwrap();
        match load(&ConfigSource::File(path.clone()), &[]) {
            Ok(_) => {}
            Err(ConfigError::File { file, .. }) => {
                prop_assert!(file.contains("run.yaml"), "{file}");
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }
}
