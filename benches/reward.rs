//! Reward throughput.
//!
//! - `gsm8k_builtin`: the built-in strict gsm8k scorer on 300-character responses, one core.
//! - `python_ipc/{1,2}_workers`: 10,000 samples through the Python worker pool with a trivial
//!   `compute_score` (`return 1.0`), so the time is the IPC and bridge overhead per sample.
//!   Needs `python3` on PATH. Run: `cargo bench --bench reward`.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use main_ppo::reward::python::{PoolSettings, PythonFunction, PythonPool};
use main_ppo::reward::ScoreRequest;
use main_ppo::reward::{Builtin, ScoreInput};
use serde_json::{json, Map};

fn response(i: usize) -> String {
    // 300 characters of reasoning ending in a GSM8K-style answer.
    let body = format!("Natalia sold {i} clips in April and half as many in May, so she sold <<48/2=24>>24 in May. ");
    let mut s = body.repeat(300 / body.len() + 1);
    s.truncate(300 - 8);
    s.push_str(&format!("#### {:>3}", i % 1000));
    s
}

fn bench(c: &mut Criterion) {
    let responses: Vec<String> = (0..1024).map(response).collect();
    let gt = json!("72");
    let scorer = Builtin::from_name("gsm8k", &Map::new()).unwrap();
    let mut g = c.benchmark_group("reward");
    g.throughput(Throughput::Elements(responses.len() as u64));
    g.bench_function("gsm8k_builtin", |b| {
        b.iter(|| {
            let mut total = 0.0;
            for r in &responses {
                total += scorer
                    .score(&ScoreInput {
                        data_source: "openai/gsm8k",
                        solution_str: r,
                        ground_truth: &gt,
                        extra_info: &json!(null),
                    })
                    .unwrap()
                    .score;
            }
            total
        })
    });

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trivial.py");
    std::fs::write(&path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n").unwrap();
    let items: Vec<ScoreRequest> = (0..10_000)
        .map(|i| ScoreRequest {
            data_source: "openai/gsm8k".into(),
            solution_str: response(i),
            ground_truth: json!("72"),
            extra_info: json!({"index": i}),
            row: json!({}),
        })
        .collect();
    g.throughput(Throughput::Elements(items.len() as u64));
    g.sample_size(10);
    for workers in [1, 2] {
        let mut pool = PythonPool::start(
            PythonFunction {
                path: path.display().to_string(),
                name: "compute_score".into(),
                kwargs: Map::new(),
                batch: false,
                positional: false,
            },
            PoolSettings {
                python: "python3".into(),
                num_workers: workers,
                timeout: Duration::from_secs(60),
            },
        )
        .expect("python3 on PATH");
        g.bench_function(format!("python_ipc/{workers}_workers"), |b| {
            b.iter(|| pool.score(&items).len())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
