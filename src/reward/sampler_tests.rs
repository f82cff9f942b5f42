//! The sampler worker with a real `python3` (the reward tests' interpreter; no torch, numpy,
//! omegaconf or verl needed: the samplers here use the standard library only).

use std::path::Path;

use serde_json::{json, Value};

use super::*;

fn write(dir: &Path, name: &str, code: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, code).unwrap();
    p.display().to_string()
}

fn rows(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({"data_source": "d", "prompt": [{"role": "user", "content": format!("q{i}")}], "index": i}))
        .collect()
}

fn start(path: &str, name: &str, n: usize) -> Result<PySampler, DataError> {
    let spec = SamplerSpec {
        class_path: path.into(),
        class_name: name.into(),
        python: "python3".into(),
        data_config: json!({"seed": 7, "shuffle": true}),
    };
    PySampler::start(&spec, rows(n))
}

/// verl's test sampler (`tests/utils/dataset/test_create_rl_sampler_on_cpu.py`,
/// `RandomCurriculumSampler`: a random permutation per epoch, `update` doing nothing), with
/// `random` in place of torch's `RandomSampler`.
const RANDOM_CURRICULUM: &str = r#"
import random

class RandomCurriculumSampler:
    def __init__(self, data_source, data_config):
        self.data_source = data_source
        self.rng = random.Random(data_config["seed"])

    def __iter__(self):
        order = list(range(len(self.data_source)))
        self.rng.shuffle(order)
        return iter(order)

    def __len__(self):
        return len(self.data_source)

    def update(self, batch) -> None:
        return
"#;

/// Draws one whole epoch.
fn epoch(s: &mut PySampler, n: usize) -> Vec<i64> {
    s.begin_epoch().unwrap();
    let got = s.take(n + 1).unwrap();
    assert_eq!(got.len(), n, "an epoch gives len(sampler) indices");
    got
}

/// The shape of verl's example sampler: built with `data_source` and `data_config`, its length
/// is the data's, each epoch a permutation from its own generator, `update` accepted. The
/// orders are Python's own `random.Random(7).shuffle`, computed here by the interpreter.
#[test]
fn random_curriculum_sampler_gives_a_permutation_per_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "curriculum.py", RANDOM_CURRICULUM);
    let mut s = start(&path, "RandomCurriculumSampler", 10).unwrap();
    assert_eq!((s.len(), s.curriculum(), s.stateful()), (10, true, false));
    let (a, b) = (epoch(&mut s, 10), epoch(&mut s, 10));
    let expected = std::process::Command::new("python3")
        .args([
            "-c",
            "import random\nr = random.Random(7)\nfor _ in range(2):\n    o = list(range(10)); r.shuffle(o); print(o)",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8(expected.stdout).unwrap();
    let want: Vec<Vec<i64>> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(vec![a.clone(), b.clone()], want);
    assert_ne!(a, b);
    s.update(
        1,
        &json!({"batch": {}, "non_tensor_batch": {}, "meta_info": {}}),
    )
    .unwrap();
}

/// A non-stateful sampler resumes as the uninterrupted one: the epochs before are drawn again
/// (its generator advances as it did) and the indices already taken in this one are skipped.
#[test]
fn a_position_saved_mid_epoch_resumes_the_same_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "curriculum.py", RANDOM_CURRICULUM);
    let mut straight = start(&path, "RandomCurriculumSampler", 12).unwrap();
    let first = epoch(&mut straight, 12);
    straight.begin_epoch().unwrap();
    let mid = straight.take(5).unwrap();
    let saved = straight.save().unwrap();
    assert_eq!(saved, json!({"epochs": 2, "yielded": 5}));
    let rest = straight.take(7).unwrap();
    let mut resumed = start(&path, "RandomCurriculumSampler", 12).unwrap();
    resumed.restore(&saved).unwrap();
    assert_eq!(resumed.take(7).unwrap(), rest);
    assert_eq!(epoch(&mut resumed, 12), epoch(&mut straight, 12));
    assert_ne!(first[..5], mid[..]);
}

/// A sampler with `state_dict`/`load_state_dict` (torchdata's `Stateful`) is saved through
/// them, pickled; its state (a curriculum's weights changed by `update`) comes back, and it
/// resumes its own position (no skipping, as torchdata does for a stateful sampler).
#[test]
fn a_stateful_curriculum_sampler_keeps_its_state_across_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "stateful.py",
        r#"
class Hardest:
    # Serves the rows the last update scored lowest first; remembers how far it got.
    def __init__(self, data_source, data_config):
        self.n = len(data_source)
        self.score = [0.0] * self.n
        self.pos = 0
    def __len__(self):
        return self.n
    def __iter__(self):
        order = sorted(range(self.n), key=lambda i: (self.score[i], i))
        while self.pos < self.n:
            self.pos += 1
            yield order[self.pos - 1]
        self.pos = 0
    def update(self, batch):
        scores = batch.batch["token_level_scores"]
        for row, index in enumerate(batch.non_tensor_batch["index"]):
            self.score[index] += float(sum(scores[row]))
    def state_dict(self):
        return {"score": list(self.score), "pos": self.pos}
    def load_state_dict(self, state):
        self.score, self.pos = state["score"], state["pos"]
"#,
    );
    let mut s = start(&path, "Hardest", 4).unwrap();
    assert!(s.stateful() && s.curriculum());
    // Row 2 scored 1.0, row 0 scored 0.5: rows 1 and 3 (0.0) come first, then 0, then 2.
    let b64 = |v: &[f32]| {
        use base64::Engine;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        base64::engine::general_purpose::STANDARD.encode(bytes)
    };
    let update = json!({
        "batch": {"token_level_scores": {"dtype": "float32", "shape": [2, 2], "data": b64(&[0.0, 1.0, 0.5, 0.0])}},
        "non_tensor_batch": {"index": [2, 0]},
        "meta_info": {"global_steps": 1},
    });
    s.update(1, &update).unwrap();
    s.begin_epoch().unwrap();
    assert_eq!(s.take(1).unwrap(), vec![1]);
    let saved = s.save().unwrap();
    assert!(saved["sampler_state"].is_string(), "{saved}");
    let rest = s.take(4).unwrap();
    assert_eq!(rest, vec![3, 0, 2]);
    let mut resumed = start(&path, "Hardest", 4).unwrap();
    resumed.restore(&saved).unwrap();
    assert_eq!(resumed.take(4).unwrap(), rest);
}

/// Each way the user's sampler can be wrong is an error naming the keys, the module or file
/// and the class, and what went wrong.
#[test]
fn bad_samplers_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let fail = |path: &str, name: &str| start(path, name, 4).unwrap_err().to_string();
    let e = fail("pkg://no_such_pkg.samplers", "S");
    assert!(
        e.starts_with("data.sampler.class_path = pkg://no_such_pkg.samplers, data.sampler.class_name = S: cannot build the sampler: ModuleNotFoundError: No module named 'no_such_pkg'"),
        "{e}"
    );
    let missing = dir.path().join("nope.py").display().to_string();
    let e = fail(&missing, "S");
    assert!(
        e.contains("sampler file not found") && e.contains(&missing),
        "{e}"
    );
    let path = write(
        dir.path(),
        "s.py",
        r#"
class NotASampler:
    def __init__(self, data_source, data_config):
        pass

class Broken:
    def __init__(self, data_source, data_config):
        raise ValueError("no curriculum for you")

def helper():
    pass

class Floats:
    def __init__(self, data_source, data_config):
        self.n = len(data_source)
    def __len__(self):
        return self.n
    def __iter__(self):
        return iter([0, 1.5, 2, 3])

class Dies:
    def __init__(self, data_source, data_config):
        self.n = len(data_source)
    def __len__(self):
        return self.n
    def __iter__(self):
        import os
        os._exit(3)

class BadUpdate(Floats):
    def __iter__(self):
        return iter(range(self.n))
    def update(self, batch):
        raise KeyError("difficulty")
"#,
    );
    let e = fail(&path, "Missing");
    assert!(
        e.contains("has no class `Missing`")
            && e.contains("BadUpdate, Broken, Dies, Floats, NotASampler"),
        "{e}"
    );
    let e = fail(&path, "helper");
    assert!(
        e.contains("`helper`") && e.contains("is a function, not a class"),
        "{e}"
    );
    let e = fail(&path, "NotASampler");
    assert!(
        e.contains("`NotASampler` is not a sampler: it has no __iter__ and no __len__"),
        "{e}"
    );
    let e = fail(&path, "Broken");
    assert!(
        e.contains("class_name = Broken")
            && e.contains("ValueError: no curriculum for you")
            && e.contains("Traceback"),
        "{e}"
    );
    let mut s = start(&path, "Floats", 4).unwrap();
    s.begin_epoch().unwrap();
    let e = s.take(4).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("data.sampler: `Floats` from {path}: drawing indices: TypeError: the sampler yielded 1.5 (float) as index 1 of epoch 1")),
        "{e}"
    );
    let mut s = start(&path, "Dies", 4).unwrap();
    let e = s.begin_epoch().unwrap_err().to_string();
    assert!(
        e.contains("`Dies`") && e.contains("the Python worker died (exit status: 3)"),
        "{e}"
    );
    let mut s = start(&path, "BadUpdate", 4).unwrap();
    assert!(s.curriculum());
    let e = s
        .update(
            5,
            &json!({"batch": {}, "non_tensor_batch": {}, "meta_info": {}}),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`BadUpdate`")
            && e.contains("update(batch=...) after step 5")
            && e.contains("KeyError: 'difficulty'"),
        "{e}"
    );
}

/// `pkg://` imports the module by name from the interpreter's path (PYTHONPATH), as verl's
/// `load_module` does.
#[test]
fn a_package_path_imports_by_module_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("mypkg")).unwrap();
    write(dir.path(), "mypkg/__init__.py", "");
    write(
        dir.path(),
        "mypkg/order.py",
        "class Reverse:\n    def __init__(self, data_source, data_config):\n        self.n = len(data_source)\n    def __len__(self):\n        return self.n\n    def __iter__(self):\n        return iter(range(self.n - 1, -1, -1))\n",
    );
    let spec = SamplerSpec {
        class_path: "pkg://mypkg.order".into(),
        class_name: "Reverse".into(),
        python: "python3".into(),
        data_config: json!({}),
    };
    // The package on PYTHONPATH for the worker alone, through a wrapper of the interpreter
    // (reward.python may name any executable).
    let wrapper = write(
        dir.path(),
        "py.sh",
        &format!(
            "#!/bin/sh\nPYTHONPATH={} exec python3 \"$@\"\n",
            dir.path().display()
        ),
    );
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mut s = PySampler::start(
        &SamplerSpec {
            python: wrapper,
            ..spec
        },
        rows(3),
    )
    .unwrap();
    assert!(!s.curriculum());
    assert_eq!(epoch(&mut s, 3), vec![2, 1, 0]);
}
