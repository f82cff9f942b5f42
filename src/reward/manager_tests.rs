//! Sources, weights, failure policies and the dapo penalty.

use serde_json::json;

use super::*;
use crate::config::{Config, ConfigSource, RewardConfig};
use crate::reward::ScoreInput;

fn cfg(overrides: &[String]) -> RewardConfig {
    crate::config::load(&ConfigSource::Builtin, overrides)
        .unwrap()
        .config
        .reward
}

/// The manager of a reward configuration, its rules checked first as set-up does.
fn manager(c: &RewardConfig, natives: &NativeRegistry) -> Result<RewardManager, RewardError> {
    let plan = c.plan().map_err(|e| RewardError::Config(e.join("; ")))?;
    RewardManager::new(&plan, natives, &ModelContext::default())
}

fn item(sol: &str, gt: &str) -> ScoreRequest {
    ScoreRequest {
        data_source: "openai/gsm8k".into(),
        solution_str: sol.into(),
        ground_truth: json!(gt),
        extra_info: json!({}),
        row: json!({}),
    }
}

fn length_registry() -> NativeRegistry {
    let mut reg = NativeRegistry::new();
    reg.register("short", |i: &ScoreInput, _: &Map<String, Value>| {
        Ok(ScoreResult::number(if i.solution_str.len() < 10 {
            1.0
        } else {
            0.0
        }))
    })
    .unwrap();
    reg
}

#[test]
fn default_is_verls_dispatch() {
    let mut m = manager(&Config::default().reward, &NativeRegistry::new()).unwrap();
    let out = m
        .score(&[item("#### 42", "42"), item("42", "42")], &[3, 2])
        .unwrap();
    assert_eq!(out[0].score, Some(1.0));
    assert_eq!(
        out[0].extra["acc"],
        json!(1.0),
        "a numeric result is also `acc`, as verl"
    );
    assert_eq!(out[1].score, Some(0.0), "strict gsm8k needs ####");
}

#[test]
fn weighted_builtin_python_and_native_sources() {
    let dir = tempfile::tempdir().unwrap();
    let py = dir.path().join("steps.py");
    std::fs::write(&py, "def compute_score(solution_str, ground_truth, per_step=0.1):\n    return {'score': per_step * solution_str.count('\\n'), 'steps': solution_str.count('\\n')}\n").unwrap();
    let c = cfg(&[format!(
        "reward.sources=[{{name: acc, weight: 1.0, type: builtin, scorer: gsm8k, kwargs: {{method: flexible}}}}, {{name: steps, weight: 0.5, type: python, path: {}, kwargs: {{per_step: 0.2}}}}, {{name: short, weight: 2.0, type: native, function: short}}]",
        py.display()
    )]);
    let mut m = manager(&c, &length_registry()).unwrap();
    let out = m
        .score(
            &[
                item("a\nb\nso 42", "42"),
                item("long answer without it\n7", "42"),
            ],
            &[5, 9],
        )
        .unwrap();
    // Hand sums: row 0 = 1.0·1 + 0.5·(0.2·2) + 2.0·0 (9 bytes < 10 → 1) → 1 + 0.2 + 2 = 3.2.
    assert_eq!(
        out[0].per_source,
        vec![
            ("acc".into(), Some(1.0)),
            ("steps".into(), Some(0.4)),
            ("short".into(), Some(1.0))
        ]
    );
    assert!((out[0].score.unwrap() - 3.2).abs() < 1e-12);
    // Row 1: gsm8k 0 (7 != 42, format_score 0), steps 0.2·1, short 0 → 0.1.
    assert!((out[1].score.unwrap() - 0.1).abs() < 1e-12);
    assert_eq!(
        out[0].extra["steps/steps"],
        json!(2),
        "extras are prefixed by the source when there are several"
    );
    let pids = m.python_pids();
    drop(m);
    std::thread::sleep(std::time::Duration::from_millis(50));
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "worker {pid} left behind"
        );
    }
}

fn failing(policy: &str) -> (Result<Vec<SampleReward>, RewardError>, RewardStats) {
    let dir = tempfile::tempdir().unwrap();
    let py = dir.path().join("r.py");
    std::fs::write(
        &py,
        "def compute_score(solution_str, ground_truth):\n    return 1 / int(solution_str)\n",
    )
    .unwrap();
    let c = cfg(&[
        format!("reward.custom_reward_function.path={}", py.display()),
        format!("reward.on_error={policy}"),
        "reward.num_workers=1".into(),
    ]);
    let mut m = manager(&c, &NativeRegistry::new()).unwrap();
    let r = m.score(&[item("2", ""), item("0", ""), item("4", "")], &[1, 1, 1]);
    (r, m.stats)
}

#[test]
fn on_error_raise_zero_skip() {
    let (r, _) = failing("raise");
    let e = r.unwrap_err().to_string();
    assert!(
        e.contains("`compute_score`")
            && e.contains("sample 1")
            && e.contains("openai/gsm8k")
            && e.contains("ZeroDivisionError")
            && e.contains("Traceback"),
        "{e}"
    );
    let (r, stats) = failing("zero");
    let out = r.unwrap();
    assert_eq!(
        out.iter().map(|s| s.score).collect::<Vec<_>>(),
        vec![Some(0.5), Some(0.0), Some(0.25)]
    );
    assert!(out[1].error.is_some() && !out[1].skipped);
    assert_eq!(stats.errors, 1);
    let (r, _) = failing("skip");
    let out = r.unwrap();
    assert_eq!(out[1].score, None);
    assert!(out[1].skipped && !out[0].skipped);
}

/// verl's PRIME manager (`reward_manager.name=prime`): the function is called by position
/// (its parameters may have any names), the reward kwargs by keyword; a number or bool is the
/// score, a tuple or list gives its first item; a failure (an exception, a dict, an unreadable
/// result) scores 0 by default, counted as an error, where naive raises; `reward.on_error` set
/// by hand still decides; the plan's time limit is verl's 300 s unless set.
#[test]
fn prime_calls_by_position_reads_sequences_and_scores_failures_zero() {
    let dir = tempfile::tempdir().unwrap();
    let py = dir.path().join("r.py");
    std::fs::write(
        &py,
        "def score(task, completion, reference, info, bonus=0.0):\n    n = int(completion)\n    if n == 0:\n        raise ValueError('zero')\n    if n == 1:\n        return {'score': 1.0}\n    if n == 2:\n        return (0.5 + bonus, {'detail': task})\n    if n == 3:\n        return [float(reference == '3')]\n    return n > 3\n",
    )
    .unwrap();
    let base = |extra: &[&str]| {
        let mut o = vec![
            format!("reward.custom_reward_function.path={}", py.display()),
            "reward.custom_reward_function.name=score".into(),
            "+reward.custom_reward_function.reward_kwargs.bonus=0.25".into(),
            "reward.reward_manager.name=prime".into(),
            "reward.num_workers=1".into(),
        ];
        o.extend(extra.iter().map(|s| s.to_string()));
        cfg(&o)
    };
    let c = base(&[]);
    let plan = c.plan().unwrap();
    assert!(plan.positional);
    assert_eq!((plan.on_error, plan.timeout_s), (OnError::Zero, 300.0));
    let mut m = manager(&c, &NativeRegistry::new()).unwrap();
    let items = [
        item("0", "0"),
        item("1", "1"),
        item("2", "2"),
        item("3", "3"),
        item("9", "9"),
    ];
    let out = m.score(&items, &[1; 5]).unwrap();
    assert_eq!(
        out.iter().map(|s| s.score).collect::<Vec<_>>(),
        vec![Some(0.0), Some(0.0), Some(0.75), Some(1.0), Some(1.0)]
    );
    assert!(out[0].error.as_deref().unwrap().contains("ValueError"));
    assert!(out[1].error.as_deref().unwrap().contains("returned a dict"));
    assert_eq!(m.stats.errors, 2);
    // Set by hand, the failure policy is the user's; naive keeps raising and 60 s.
    let c = base(&["reward.on_error=raise", "reward.timeout_s=5"]);
    let plan = c.plan().unwrap();
    assert_eq!((plan.on_error, plan.timeout_s), (OnError::Raise, 5.0));
    let naive = cfg(&["reward.num_workers=1".into()]).plan().unwrap();
    assert_eq!(
        (naive.on_error, naive.timeout_s, naive.positional),
        (OnError::Raise, 60.0, false)
    );
}

/// A data source the built-in scorers have no rule for stops the scoring whatever
/// `reward.on_error` says (prime's zero default included): scoring every such row 0 or leaving
/// it out would train on a reward that does not exist.
#[test]
fn an_unscorable_data_source_is_an_error_under_every_policy() {
    for extra in [
        "reward.on_error=zero",
        "reward.on_error=skip",
        "reward.reward_manager.name=prime",
    ] {
        let c = cfg(&[extra.into()]);
        let mut m = manager(&c, &NativeRegistry::new()).unwrap();
        let mut code = item("```python\nprint(1)\n```", "{}");
        code.data_source = "codecontests".into();
        let e = m
            .score(&[item("#### 1", "1"), code], &[1, 1])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("codecontests") && e.contains("reward.custom_reward_function.path"),
            "{extra}: {e}"
        );
    }
}

#[test]
fn dapo_overlong_penalty() {
    let c = cfg(&[
        "reward.reward_manager.name=dapo".into(),
        "+reward.reward_kwargs.overlong_buffer_cfg={enable: true, len: 4, penalty_factor: 1.0, log: true}".into(),
        "+reward.reward_kwargs.max_resp_len=10".into(),
    ]);
    let mut m = manager(&c, &NativeRegistry::new()).unwrap();
    let out = m
        .score(
            &[
                item("#### 1", "1"),
                item("#### 1", "1"),
                item("#### 1", "1"),
            ],
            &[6, 8, 10],
        )
        .unwrap();
    // expected = 10 − 4 = 6; exceed = len − 6; penalty = min(−exceed/4, 0): 0, −0.5, −1.
    assert_eq!(
        out.iter().map(|s| s.score.unwrap()).collect::<Vec<_>>(),
        vec![1.0, 0.5, 0.0]
    );
    assert_eq!(out[1].extra["overlong"], json!(true));
    // The score before the penalty is kept (the format rate reads it).
    assert!(out.iter().all(|s| s.unpenalised == Some(1.0)));
    let bad = cfg(&[
        "reward.reward_manager.name=dapo".into(),
        "+reward.reward_kwargs.overlong_buffer_cfg={enable: true, len: 4}".into(),
    ]);
    assert!(manager(&bad, &NativeRegistry::new())
        .err()
        .unwrap()
        .to_string()
        .contains("max_resp_len"));
}

#[test]
fn start_up_errors() {
    let c = cfg(&["reward.reward_manager.name=batch".into()]);
    assert!(manager(&c, &NativeRegistry::new())
        .err()
        .unwrap()
        .to_string()
        .contains("batch function"));
    let c = cfg(&["reward.sources=[{name: a, type: native, function: nope}]".into()]);
    let e = manager(&c, &length_registry()).err().unwrap().to_string();
    assert!(
        e.contains("reward.sources[0] (a)") && e.contains("short"),
        "{e}"
    );
    let c = cfg(&["reward.custom_reward_function.path=/nonexistent/r.py".into()]);
    assert!(manager(&c, &NativeRegistry::new())
        .err()
        .unwrap()
        .to_string()
        .contains("FileNotFoundError"));
}

#[test]
fn a_timed_out_call_follows_on_error() {
    let dir = tempfile::tempdir().unwrap();
    let py = dir.path().join("slow.py");
    std::fs::write(&py, "import time\ndef compute_score(solution_str, ground_truth):\n    if solution_str == 'slow':\n        time.sleep(60)\n    return 1.0\n").unwrap();
    let items = [item("a", ""), item("slow", ""), item("b", "")];
    for policy in ["zero", "skip", "raise"] {
        let c = cfg(&[
            format!("reward.custom_reward_function.path={}", py.display()),
            format!("reward.on_error={policy}"),
            "reward.num_workers=1".into(),
            "reward.timeout_s=0.5".into(),
        ]);
        let mut m = manager(&c, &NativeRegistry::new()).unwrap();
        let r = m.score(&items, &[1, 1, 1]);
        match policy {
            "zero" => {
                let out = r.unwrap();
                assert_eq!(
                    out.iter().map(|s| s.score).collect::<Vec<_>>(),
                    vec![Some(1.0), Some(0.0), Some(1.0)],
                    "the run continues"
                );
                assert!(out[1].error.as_deref().unwrap().contains("timed out"));
            }
            "skip" => {
                let out = r.unwrap();
                assert!(out[1].skipped && out[1].score.is_none() && out[2].score == Some(1.0));
            }
            _ => {
                let e = r.unwrap_err().to_string();
                assert!(e.contains("sample 1") && e.contains("timed out"), "{e}");
            }
        }
        assert_eq!(m.stats.timeouts, 1, "{policy}");
    }
}

fn chat_item(question: &str, sol: &str) -> ScoreRequest {
    ScoreRequest {
        data_source: "openai/gsm8k".into(),
        solution_str: sol.into(),
        ground_truth: json!("42"),
        extra_info: json!({}),
        row: json!({"prompt": [{"role": "user", "content": question}]}),
    }
}

#[test]
fn a_reward_model_scores_batches_as_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let rm = dir.path().join("rm");
    crate::testing::tiny_reward_model_dir(&rm, 0.3);
    let src = |mb: usize| {
        cfg(&[format!(
            "reward.sources=[{{name: rm, type: model, path: {}, micro_batch_size: {mb}}}]",
            rm.display()
        )])
    };
    let items: Vec<ScoreRequest> = [
        ("What is 6 x 7?", "42"),
        (
            "Name a colour.",
            "Blue, and a much longer answer than the others.",
        ),
        ("Hi", ""),
        ("2+2?", "4"),
        ("Tell me a story.", "Once upon a time."),
    ]
    .iter()
    .map(|(q, a)| chat_item(q, a))
    .collect();
    let lens = vec![1; items.len()];
    let mut batched = manager(&src(2), &NativeRegistry::new()).unwrap();
    let b = batched.score(&items, &lens).unwrap();
    let mut single = manager(&src(1), &NativeRegistry::new()).unwrap();
    for (i, it) in items.iter().enumerate() {
        let one = single.score(std::slice::from_ref(it), &[1]).unwrap();
        let (x, y) = (b[i].score.unwrap(), one[0].score.unwrap());
        // Left padding changes only the masked positions: equal up to f32 summation order.
        assert!((x - y).abs() < 1e-5, "row {i}: batched {x} vs alone {y}");
    }
    let distinct: std::collections::BTreeSet<String> = b
        .iter()
        .map(|r| format!("{:.6}", r.score.unwrap()))
        .collect();
    assert!(
        distinct.len() > 1,
        "the model distinguishes responses: {b:?}"
    );

    // Normalisation: scores of one batch become z-scores of the running statistics; clipping.
    let mut norm = manager(
        &cfg(&[format!(
            "reward.sources=[{{name: rm, type: model, path: {}, normalize: true, clip: 1.0}}]",
            rm.display()
        )]),
        &NativeRegistry::new(),
    )
    .unwrap();
    let n = norm.score(&items, &lens).unwrap();
    let raw: Vec<f64> = b.iter().map(|r| r.score.unwrap()).collect();
    let mean = raw.iter().sum::<f64>() / raw.len() as f64;
    let std = (raw.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / raw.len() as f64).sqrt();
    for (r, x) in n.iter().zip(&raw) {
        let want = ((x - mean) / (std + 1e-8)).clamp(-1.0, 1.0);
        assert!(
            (r.score.unwrap() - want).abs() < 1e-4,
            "{} vs {want}",
            r.score.unwrap()
        );
    }
    assert_eq!(norm.model_stats()["rm"].count, 5.0);
}

#[test]
fn rule_python_and_model_sources_sum_by_weight() {
    let dir = tempfile::tempdir().unwrap();
    let rm = dir.path().join("rm");
    crate::testing::tiny_reward_model_dir(&rm, 0.3);
    let py = dir.path().join("len.py");
    std::fs::write(
        &py,
        "def compute_score(solution_str, **kw):\n    return len(solution_str) / 10\n",
    )
    .unwrap();
    let items = vec![
        chat_item("What is 6 x 7?", "#### 42"),
        chat_item("Q", "#### 7"),
    ];
    let mut alone = manager(
        &cfg(&[format!(
            "reward.sources=[{{name: rm, type: model, path: {}}}]",
            rm.display()
        )]),
        &NativeRegistry::new(),
    )
    .unwrap();
    let rm_scores: Vec<f64> = alone
        .score(&items, &[1, 1])
        .unwrap()
        .iter()
        .map(|r| r.score.unwrap())
        .collect();
    let mut m = manager(
        &cfg(&[format!(
            "reward.sources=[{{name: acc, weight: 2.0, type: builtin, scorer: gsm8k}}, {{name: len, weight: 0.5, type: python, path: {}}}, {{name: rm, weight: 0.25, type: model, path: {}}}]",
            py.display(),
            rm.display()
        )]),
        &NativeRegistry::new(),
    )
    .unwrap();
    let out = m.score(&items, &[1, 1]).unwrap();
    // Row 0: gsm8k 1 (answer 42), len 7/10; row 1: gsm8k 0, len 6/10.
    let want = [
        2.0 * 1.0 + 0.5 * 0.7 + 0.25 * rm_scores[0],
        0.5 * 0.6 + 0.25 * rm_scores[1],
    ];
    for (r, w) in out.iter().zip(want) {
        assert!((r.score.unwrap() - w).abs() < 1e-9, "{r:?} vs {w}");
    }
}

#[test]
fn reward_model_errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    // A causal LM (no score head) is not a reward model.
    let lm = dir.path().join("lm");
    let args = crate::model::ModelArgs::tiny(crate::model::Arch::Llama, 259);
    let (vm, _) = crate::testing::tiny_model(&args, candle_core::DType::F32, 0.1);
    crate::testing::write_tokenizer_dir(&lm).unwrap();
    crate::weights::hf::save_dir(&vm, &args, &lm, &[258], Some(&lm), None).unwrap();
    let c = cfg(&[format!(
        "reward.sources=[{{name: rm, type: model, path: {}}}]",
        lm.display()
    )]);
    let e = manager(&c, &NativeRegistry::new())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("score.weight") && e.contains("reward.sources[0] (rm)"),
        "{e}"
    );
    let c = cfg(&["reward.sources=[{name: rm, type: model, path: /no/such/dir}]".into()]);
    let e = manager(&c, &NativeRegistry::new())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("/no/such/dir"), "{e}");
    // The legacy spelling adds the model to the default scorer.
    let rm = dir.path().join("rm");
    crate::testing::tiny_reward_model_dir(&rm, 0.3);
    let c = cfg(&[
        "reward_model.enable=True".into(),
        format!("reward_model.model.path={}", rm.display()),
    ]);
    let m = manager(&c, &NativeRegistry::new()).unwrap();
    let names: Vec<&str> = m.sources.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, vec!["default", "reward_model"]);
}

#[test]
fn gates_act_on_exactly_the_samples_below_the_threshold() {
    let reg = length_registry(); // `short`: 1 when the response is under 10 bytes, else 0
    let items = vec![
        item("#### 42", "42"),
        item("a long wrong answer #### 7", "42"),
        item("#### 7", "42"),
    ];
    let run = |gate: &str| {
        let c = cfg(&[format!(
            "reward.sources=[{{name: acc, type: builtin, scorer: gsm8k}}, {{name: short, weight: 0.5, type: native, function: short, gate: {gate}}}]"
        )]);
        let mut m = manager(&c, &reg).unwrap();
        m.score(&items, &[1, 1, 1]).unwrap()
    };
    // Without a gate the totals are acc + 0.5·short: 1.5, 0, 0.5. Only row 1 is long.
    let skip = run("{below: 0.5, action: skip_update}");
    let gated: Vec<bool> = skip.iter().map(|r| r.gate_skip).collect();
    assert_eq!(gated, vec![false, true, false]);
    assert_eq!(
        skip.iter().map(|r| r.score.unwrap()).collect::<Vec<_>>(),
        vec![1.5, 0.0, 0.5]
    );
    assert_eq!(skip[1].gated, vec!["short".to_string()]);
    let zero = run("{below: 0.5, action: zero_reward}");
    assert_eq!(
        zero.iter().map(|r| r.score.unwrap()).collect::<Vec<_>>(),
        vec![1.5, 0.0, 0.5]
    );
    assert!(zero.iter().all(|r| !r.gate_skip));
    let pen = run("{below: 0.5, action: penalty, penalty: -2.0}");
    assert_eq!(
        pen.iter().map(|r| r.score.unwrap()).collect::<Vec<_>>(),
        vec![1.5, -2.0, 0.5]
    );
    // zero_reward on a sample with a positive total: the long row of a looser threshold.
    let zero_all = run("{below: 1.5, action: zero_reward}");
    assert_eq!(
        zero_all
            .iter()
            .map(|r| r.score.unwrap())
            .collect::<Vec<_>>(),
        vec![0.0, 0.0, 0.0]
    );
}

/// A numeric ground truth scores 0 with the built-in gsm8k scorer (verl's comparison of text
/// with a number; the score stays verl's) and the manager says so: how many rows, the first
/// one's file, row and value, and what to write instead. String ground truths, other
/// data_sources of the default dispatch, and Python sources say nothing.
#[test]
fn numeric_ground_truths_under_gsm8k_are_named() {
    let mut m = manager(&Config::default().reward, &NativeRegistry::new()).unwrap();
    let mut numeric = item("#### 42", "42");
    numeric.ground_truth = json!(42);
    let out = m.score(&[numeric], &[3]).unwrap();
    assert_eq!(
        out[0].score,
        Some(0.0),
        "verl's score: a number never equals the text"
    );
    let (n42, s42, obj) = (json!(42), json!("42"), json!({"target": ["x"]}));
    let rows = [
        ("train.parquet", 0, "openai/gsm8k", &s42),
        ("train.parquet", 7, "openai/gsm8k", &n42),
        ("train.parquet", 9, "openai/gsm8k", &n42),
        ("train.parquet", 11, "searchR1_nq", &obj),
    ];
    let w = m.numeric_ground_truth_warning(rows).unwrap();
    assert!(w.starts_with("2 row(s)"), "{w}");
    assert!(w.contains("train.parquet, row 7, ground_truth 42"), "{w}");
    assert!(w.contains("(\"42\")"), "{w}");
    assert!(m
        .numeric_ground_truth_warning([("t", 0, "openai/gsm8k", &s42)])
        .is_none());
    // The format rate means format for the default dispatch's gsm8k rows only.
    assert!(m.format_rate_applies("openai/gsm8k"));
    assert!(!m.format_rate_applies("lighteval/MATH"));
    // An explicit gsm8k source scores every data_source so.
    let c = cfg(&["reward.sources=[{name: g, type: builtin, scorer: gsm8k}]".into()]);
    let m = manager(&c, &NativeRegistry::new()).unwrap();
    let w = m.numeric_ground_truth_warning([("t", 3, "my/source", &n42)]);
    assert!(w.is_some_and(|w| w.contains("reward source `g`")));
    assert!(m.format_rate_applies("my/source"));
    // Two sources summed: a non-zero sum says nothing about format.
    let c = cfg(&["reward.sources=[{name: g, type: builtin, scorer: gsm8k}, {name: m, type: builtin, scorer: math}]".into()]);
    let m = manager(&c, &NativeRegistry::new()).unwrap();
    assert!(!m.format_rate_applies("openai/gsm8k"));
}
