//! The worker pool with a real `python3`.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Map, Value};

use super::*;

fn write(dir: &Path, name: &str, code: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, code).unwrap();
    p.display().to_string()
}

fn pool(
    path: &str,
    name: &str,
    kwargs: Map<String, Value>,
    batch: bool,
    workers: usize,
    timeout_s: f64,
) -> Result<PythonPool, RewardError> {
    PythonPool::start(
        PythonFunction {
            path: path.into(),
            name: name.into(),
            kwargs,
            batch,
            positional: false,
        },
        PoolSettings {
            python: "python3".into(),
            num_workers: workers,
            timeout: Duration::from_secs_f64(timeout_s),
        },
    )
}

fn item(sol: &str, gt: &str) -> Item {
    Item {
        data_source: "openai/gsm8k".into(),
        solution_str: sol.into(),
        ground_truth: json!(gt),
        extra_info: json!({"index": 3}),
        row: json!({"data_source": "openai/gsm8k", "reward_model": {"ground_truth": gt}, "extra_info": {"index": 3}}),
    }
}

fn alive(pid: u32) -> bool {
    // A reaped child has no /proc entry; a zombie would show state Z.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

fn assert_all_gone(pids: &[u32]) {
    for pid in pids {
        assert!(!alive(*pid), "python worker {pid} is still running");
    }
}

const VERL: &str = r#"
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(solution_str == ground_truth) + bonus, "source": data_source, "idx": extra_info["index"]}
"#;

#[test]
fn verl_signature_dict_return_and_kwargs() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "r.py", VERL);
    let mut kw = Map::new();
    kw.insert("bonus".into(), json!(0.5));
    let mut p = pool(&f, "compute_score", kw, false, 2, 30.0).unwrap();
    let pids = p.pids();
    assert_eq!(pids.len(), 2);
    let items: Vec<Item> = (0..7).map(|i| item(&i.to_string(), "3")).collect();
    let out = p.score(&items);
    assert_eq!(out.len(), 7);
    for (i, r) in out.iter().enumerate() {
        let r = r.as_ref().unwrap();
        assert_eq!(r.score, if i == 3 { 1.5 } else { 0.5 }, "item {i}");
        assert_eq!(r.extra["source"], json!("openai/gsm8k"));
        assert_eq!(r.extra["idx"], json!(3));
    }
    // Workers are reused across calls.
    assert_eq!(p.score(&items[..2]).len(), 2);
    assert_eq!(p.pids(), pids);
    drop(p);
    assert_all_gone(&pids);
}

#[test]
fn blog_style_signatures_bind_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "r.py",
        "def compute_score(data, generation):\n    return len(generation) + (data['reward_model']['ground_truth'] == '3')\n\ndef two(row, response):\n    return True\n",
    );
    let mut p = pool(&f, "compute_score", Map::new(), false, 1, 30.0).unwrap();
    assert_eq!(
        p.score(&[item("abcd", "3")])[0].as_ref().unwrap().score,
        5.0
    );
    let mut p2 = pool(&f, "two", Map::new(), false, 1, 30.0).unwrap();
    assert_eq!(
        p2.score(&[item("x", "3")])[0].as_ref().unwrap().score,
        1.0,
        "a bool is a score"
    );
    let bad = write(
        dir.path(),
        "bad.py",
        "def f(prediction, label):\n    return 0\n",
    );
    let e = pool(&bad, "f", Map::new(), false, 1, 30.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot bind parameter `prediction`"), "{e}");
    let e = pool(
        &f,
        "compute_score",
        Map::from_iter([("nope".to_string(), json!(1))]),
        false,
        1,
        30.0,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("reward kwarg `nope`"), "{e}");
}

#[test]
fn async_and_batch_functions() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "r.py",
        "import asyncio\nasync def a(solution_str, ground_truth, **kw):\n    await asyncio.sleep(0.01)\n    return float(solution_str == ground_truth)\n\n\
         def b(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):\n    return [scale * (s == g) for s, g in zip(solution_strs, ground_truths)]\n",
    );
    let mut p = pool(&f, "a", Map::new(), false, 2, 30.0).unwrap();
    let out: Vec<f64> = p
        .score(&[item("1", "1"), item("2", "1"), item("1", "1")])
        .into_iter()
        .map(|r| r.unwrap().score)
        .collect();
    assert_eq!(out, vec![1.0, 0.0, 1.0]);
    let mut kw = Map::new();
    kw.insert("scale".into(), json!(2.0));
    let mut p = pool(&f, "b", kw, true, 2, 30.0).unwrap();
    let out: Vec<f64> = p
        .score(&[item("1", "1"), item("2", "1"), item("1", "1")])
        .into_iter()
        .map(|r| r.unwrap().score)
        .collect();
    assert_eq!(out, vec![2.0, 0.0, 2.0]);
}

#[test]
fn exceptions_nan_and_wrong_types_are_per_item_errors() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "r.py",
        "def f(solution_str, ground_truth):\n    if solution_str == 'boom':\n        return 1 / 0\n    if solution_str == 'nan':\n        return float('nan')\n    if solution_str == 'str':\n        return 'high'\n    if solution_str == 'nodict':\n        return {'acc': 1}\n    return 1.0\n",
    );
    let mut p = pool(&f, "f", Map::new(), false, 1, 30.0).unwrap();
    let out = p.score(&[
        item("boom", ""),
        item("ok", ""),
        item("nan", ""),
        item("str", ""),
        item("nodict", ""),
    ]);
    let e = out[0].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("ZeroDivisionError") && e.contains("Traceback") && e.contains("line 3"),
        "{e}"
    );
    assert_eq!(
        out[1].as_ref().unwrap().score,
        1.0,
        "the run continues after an exception"
    );
    assert!(out[2]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("non-finite"));
    assert!(out[3]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("returned str"));
    assert!(out[4]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("without `score`"));
    assert_eq!(p.stats.errors, 4);
}

#[test]
fn a_slow_call_times_out_and_the_worker_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "r.py", "import time\ndef f(solution_str):\n    if solution_str == 'slow':\n        time.sleep(60)\n    return 1.0\n");
    let mut kw = Map::new();
    let _ = &mut kw;
    let mut p = pool(&f, "f", Map::new(), false, 1, 0.5).unwrap();
    let before = p.pids();
    let t0 = std::time::Instant::now();
    let out = p.score(&[item("a", ""), item("slow", ""), item("b", "")]);
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "the hung call was cut short"
    );
    assert_eq!(out[0].as_ref().unwrap().score, 1.0);
    assert!(
        matches!(out[1], Err(CallError::Timeout { .. })),
        "{:?}",
        out[1]
    );
    assert_eq!(
        out[2].as_ref().unwrap().score,
        1.0,
        "the rest ran on a fresh worker"
    );
    assert_eq!((p.stats.timeouts, p.stats.restarts), (1, 1));
    assert_ne!(p.pids(), before);
    assert_all_gone(&before);
    let after = p.pids();
    drop(p);
    assert_all_gone(&after);
}

#[test]
fn a_malformed_reply_is_a_protocol_error_at_once_not_a_timeout() {
    let dir = tempfile::tempdir().unwrap();
    // The function writes into the reply channel itself (the bridge's `_proto`, reachable as
    // `__main__._proto`): a line that is not JSON, and a JSON line that is no reply.
    for (line, want) in [("not json", "not JSON"), (r#"{\"hello\": 1}"#, "no id")] {
        let code = format!(
            "import __main__\ndef f(solution_str):\n    if solution_str == 'bad':\n        __main__._proto.write('{line}\\n')\n        __main__._proto.flush()\n        return 1.0\n    return 2.0\n"
        );
        let f = write(dir.path(), "r.py", &code);
        let mut p = pool(&f, "f", Map::new(), false, 1, 30.0).unwrap();
        let before = p.pids();
        let t0 = std::time::Instant::now();
        let out = p.score(&[item("a", ""), item("bad", ""), item("b", "")]);
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "reported at once, not after timeout_s (30 s): took {:?}",
            t0.elapsed()
        );
        assert_eq!(out[0].as_ref().unwrap().score, 2.0);
        let e = out[1].as_ref().unwrap_err();
        assert!(matches!(e, CallError::Protocol { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("protocol error") && msg.contains("`f from ") && msg.contains(want),
            "{msg}"
        );
        assert_eq!(
            out[2].as_ref().unwrap().score,
            2.0,
            "the rest ran on a fresh worker"
        );
        assert_eq!(
            (p.stats.errors, p.stats.timeouts, p.stats.restarts),
            (1, 0, 1)
        );
        assert_all_gone(&before);
    }
}

#[test]
fn a_dying_worker_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "r.py", "import os\ndef f(solution_str):\n    if solution_str == 'die':\n        os._exit(1)\n    return 2.0\n");
    let mut p = pool(&f, "f", Map::new(), false, 1, 30.0).unwrap();
    let out = p.score(&[item("a", ""), item("die", ""), item("b", "")]);
    assert_eq!(out[0].as_ref().unwrap().score, 2.0);
    let e = out[1].as_ref().unwrap_err().to_string();
    assert!(e.contains("died") && e.contains("exit status: 1"), "{e}");
    assert_eq!(out[2].as_ref().unwrap().score, 2.0);
    assert_eq!(p.stats.restarts, 1);
}

#[test]
fn start_up_failures_carry_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let e = pool(
        &dir.path().join("missing.py").display().to_string(),
        "f",
        Map::new(),
        false,
        1,
        30.0,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("FileNotFoundError") && e.contains("missing.py"),
        "{e}"
    );
    let f = write(dir.path(), "r.py", "def g(solution_str):\n    return 0\n");
    let e = pool(&f, "compute_score", Map::new(), false, 1, 30.0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("has no function `compute_score`") && e.contains("g"),
        "{e}"
    );
    let f = write(dir.path(), "imp.py", "import no_such_module_xyz\n");
    let e = pool(&f, "f", Map::new(), false, 1, 30.0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ModuleNotFoundError")
            && e.contains("no_such_module_xyz")
            && e.contains("Traceback"),
        "{e}"
    );
    let e = PythonPool::start(
        PythonFunction {
            path: f.clone(),
            name: "f".into(),
            kwargs: Map::new(),
            batch: false,
            positional: false,
        },
        PoolSettings {
            python: "/no/such/python".into(),
            num_workers: 1,
            timeout: Duration::from_secs(1),
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("/no/such/python") && e.contains("reward.python"),
        "{e}"
    );
}

/// JSON has no NaN: a dict reward whose extras hold non-finite floats used to break the
/// protocol line (Python wrote `NaN`, which no JSON parser accepts), failing the sample as a
/// protocol error. The extras now arrive as the strings Python prints ("nan", "inf", "-inf"),
/// the score intact, in both the per-item and the batch calling convention.
#[test]
fn non_finite_extras_arrive_as_strings_with_the_score_intact() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "r.py",
        "def f(solution_str, ground_truth):\n    return {'score': 0.25, 'ratio': float('nan'), 'best': float('inf'), 'seq': [float('-inf'), 2.0], 'ok': 1.5}\n\ndef fb(data_sources, solution_strs, ground_truths, extra_infos):\n    return [f(s, g) for s, g in zip(solution_strs, ground_truths)]\n",
    );
    for (name, batch) in [("f", false), ("fb", true)] {
        let mut p = pool(&f, name, Map::new(), batch, 1, 30.0).unwrap();
        let out = p.score(&[item("a", ""), item("b", "")]);
        for r in out {
            let r = r.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(r.score, 0.25, "{name}");
            assert_eq!(r.extra["ratio"], json!("nan"), "{name}");
            assert_eq!(r.extra["best"], json!("inf"), "{name}");
            assert_eq!(r.extra["seq"], json!(["-inf", 2.0]), "{name}");
            assert_eq!(r.extra["ok"], json!(1.5), "{name}");
        }
    }
}

/// Polls `pid` until it is gone (true) or `within` has passed (false).
fn gone_within(pid: u32, within: Duration) -> bool {
    let deadline = std::time::Instant::now() + within;
    while std::time::Instant::now() < deadline {
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    !alive(pid)
}

/// The pid a function wrote into `file`.
fn pid_in(file: &Path) -> u32 {
    std::fs::read_to_string(file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Ends a process a test left behind (only when it failed, so the next run starts clean).
fn end(pid: u32) {
    if alive(pid) {
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
}

/// Processes a reward function starts run in its worker's process group, which is killed with
/// the worker: when the pool is dropped, and when a hung call's worker is replaced. They used
/// to outlive main_ppo (a `sleep 600` stayed for ten minutes).
#[test]
fn processes_a_function_starts_end_with_its_worker() {
    let dir = tempfile::tempdir().unwrap();
    let code = format!(
        "import subprocess, time\ndef f(solution_str):\n    p = subprocess.Popen(['sleep', '600'])\n    with open({dir:?} + '/' + solution_str + '.pid', 'w') as out:\n        out.write(str(p.pid))\n    if solution_str == 'hang':\n        time.sleep(60)\n    return 1.0\n",
        dir = dir.path().display().to_string()
    );
    let f = write(dir.path(), "r.py", &code);
    let mut p = pool(&f, "f", Map::new(), false, 1, 1.0).unwrap();
    let out = p.score(&[item("hang", ""), item("idle", "")]);
    assert!(
        matches!(out[0], Err(CallError::Timeout { .. })),
        "{:?}",
        out[0]
    );
    assert_eq!(out[1].as_ref().unwrap().score, 1.0);
    let hung = pid_in(&dir.path().join("hang.pid"));
    let hung_gone = gone_within(hung, Duration::from_secs(5));
    end(hung);
    assert!(
        hung_gone,
        "the hung call's child {hung} outlived its replaced worker"
    );
    let idle = pid_in(&dir.path().join("idle.pid"));
    assert!(alive(idle), "the child runs while its worker does");
    drop(p);
    let idle_gone = gone_within(idle, Duration::from_secs(5));
    end(idle);
    assert!(idle_gone, "the child {idle} outlived the dropped pool");
}

/// A function that reads stdin gets end-of-file at once: the worker's stdin is /dev/null and
/// requests arrive on a descriptor of their own. It used to read the request pipe and hang
/// until `timeout_s`.
#[test]
fn a_function_reading_stdin_gets_eof_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "r.py",
        "import sys\ndef f(solution_str):\n    data = sys.stdin.read()\n    try:\n        input()\n    except EOFError:\n        pass\n    return 3.0 if data == '' else 4.0\n",
    );
    let mut p = pool(&f, "f", Map::new(), false, 1, 5.0).unwrap();
    let t0 = std::time::Instant::now();
    let out = p.score(&[item("a", ""), item("b", "")]);
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "took {:?} (timeout_s is 5)",
        t0.elapsed()
    );
    for r in out {
        assert_eq!(r.unwrap().score, 3.0);
    }
    assert_eq!((p.stats.errors, p.stats.timeouts), (0, 0));
}

/// What a function prints (print(), a raw write to descriptor 1, a child process's stdout)
/// goes to the log, never into the replies.
#[test]
fn prints_to_stdout_do_not_disturb_the_replies() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "r.py",
        "import os, subprocess, sys\ndef f(solution_str):\n    print('a user print', solution_str)\n    print('{\"id\": 99, \"index\": 0, \"score\": 7.0}')\n    print('no newline', end='')\n    sys.stdout.flush()\n    os.write(1, b'raw descriptor 1\\n')\n    subprocess.run(['echo', 'from a child'])\n    return 2.0\n",
    );
    let mut p = pool(&f, "f", Map::new(), false, 2, 30.0).unwrap();
    let out = p.score(&[item("a", ""), item("b", ""), item("c", "")]);
    for r in out {
        assert_eq!(r.unwrap().score, 2.0);
    }
    assert_eq!(p.stats, PoolStats::default());
}

/// A worker killed from outside while idle never received the next request: the request is
/// re-sent once to its replacement and every sample scores. It used to fail the sample ("the
/// Python worker died (stdin closed: Broken pipe)").
#[test]
fn a_worker_killed_while_idle_is_replaced_without_losing_a_sample() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "r.py", VERL);
    let mut p = pool(&f, "compute_score", Map::new(), false, 2, 30.0).unwrap();
    let items: Vec<Item> = (0..6).map(|i| item(&i.to_string(), "3")).collect();
    assert!(p.score(&items).iter().all(Result::is_ok));
    let killed = p.pids()[0];
    unsafe { libc::kill(killed as i32, libc::SIGKILL) };
    assert!(gone_within(killed, Duration::from_secs(5)));
    let out = p.score(&items);
    for (i, r) in out.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("item {i}: {e}"));
        assert_eq!(r.score, if i == 3 { 1.0 } else { 0.0 }, "item {i}");
    }
    assert_eq!((p.stats.errors, p.stats.restarts), (0, 1));
    assert_ne!(p.pids()[0], killed);
    // The batch and async conventions re-send the same way.
    let b = write(
        dir.path(),
        "b.py",
        "import asyncio\nasync def a(solution_str):\n    return 1.0\n\ndef b(data_sources, solution_strs, ground_truths, extra_infos):\n    return [1.0 for _ in solution_strs]\n",
    );
    for (name, batch) in [("a", false), ("b", true)] {
        let mut p = pool(&b, name, Map::new(), batch, 1, 30.0).unwrap();
        let killed = p.pids()[0];
        unsafe { libc::kill(killed as i32, libc::SIGKILL) };
        assert!(gone_within(killed, Duration::from_secs(5)));
        for r in p.score(&items) {
            assert_eq!(r.unwrap_or_else(|e| panic!("{name}: {e}")).score, 1.0);
        }
        assert_eq!((p.stats.errors, p.stats.restarts), (0, 1), "{name}");
    }
}
