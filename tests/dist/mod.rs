//! Data parallelism over MPI (cargo feature `mpi`): runs under `mpirun -np 2` compared with one
//! process. Each test spawns mpirun; without it (or without the feature) the tests print why
//! they did not run and pass.
//!
//! Two kinds of runs: the `main_ppo` binary itself (metrics, resume, a killed rank), and this
//! test binary re-launched under mpirun for one `#[ignore]`d inner test that checks gradients and
//! weights of an f64 tiny model rank by rank (`MAIN_PPO_MPI_INNER=1` marks the inner run).

#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Var};
use main_ppo::config::{LossAggMode, MicroBatching, OptimConfig, UpdatePlan};
use main_ppo::dist::grads::all_reduce_grads;
use main_ppo::dist::Comm;
use main_ppo::model::{Arch, CausalLm, ModelArgs};
use main_ppo::trainer::batch::StepBatch;
use main_ppo::trainer::micro::{Layout, MicroInputs};
use main_ppo::trainer::trainable::{Trainable, UpdateSettings};
use main_ppo::trainer::update::{
    mini_batch_grads, mini_batch_norm, MicroCtx, MicroLoss, UpdateScalars,
};

/// `mpirun` with the options this machine needs, or `None` (printed) when there is none.
fn mpirun(np: usize) -> Option<Command> {
    let version = match Command::new("mpirun").arg("--version").output() {
        Ok(o) => {
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
        }
        Err(e) => {
            println!("skipped: no mpirun on PATH ({e}); install Open MPI or MPICH to run it");
            return None;
        }
    };
    // Every launch is bounded: coreutils' `timeout` ends the whole process group (launcher and
    // ranks) after 10 minutes, so a launcher that never returns fails its test instead of
    // holding the test run forever.
    let mut c = if Command::new("timeout").arg("--version").output().is_ok() {
        let mut t = Command::new("timeout");
        t.args(["-k", "10", "600", "mpirun"]);
        t
    } else {
        Command::new("mpirun")
    };
    if version.contains("Open MPI") || version.contains("OpenRTE") {
        // Open MPI refuses root unless told, and more ranks than cores unless oversubscribed;
        // shared-memory single-copy (CMA) is not allowed in many containers.
        c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
            .args(["--oversubscribe", "--bind-to", "none"]);
    }
    c.args(["-np", &np.to_string()])
        .env("RAYON_NUM_THREADS", "1")
        .env("RUST_LOG", "info");
    Some(c)
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

// ---------------------------------------------------------------------------------------------
// The inner test: gradients and weights of an f64 tiny model, rank by rank.

/// Eight rows (prompts of 1-3 tokens, responses of 1-5 tokens): two ranks take alternate
/// micro-batches of each mini-batch.
fn rows() -> StepBatch {
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| (1..=1 + i % 3).collect()).collect();
    let responses: Vec<Vec<u32>> = (0..8)
        .map(|i| (0..1 + (i * 3) % 5).map(|k| 5 + (i + k) as u32).collect())
        .collect();
    StepBatch::new(
        prompts,
        responses,
        (0..8).collect(),
        (0..8).map(|i| i / 2).collect(),
        vec![false; 8],
    )
}

fn plan(global_norm: bool) -> UpdatePlan {
    UpdatePlan {
        mini_batch_prompts: 4,
        mini_batch_responses: 4,
        mini_batches_per_epoch: 2,
        micro: MicroBatching::Sequences(1),
        grad_accum: Some(4),
        epochs: 1,
        loss_agg_mode: LossAggMode::TokenMean,
        shuffle: false,
        grad_clip: 1.0,
        global_norm,
    }
}

fn settings(global_norm: bool, shard: (usize, usize)) -> UpdateSettings {
    UpdateSettings {
        prefix: "actor",
        plan: plan(global_norm),
        seed: 0,
        loss_scale_factor: None,
        // verl's default layout: the ranks' packed micro-batches sum to one process's.
        inputs: Layout {
            pad_id: 0,
            packed: true,
            share_prefixes: false,
            image_token: None,
        },
        shard,
    }
}

/// Token-mean of −log p over the micro-batch (the mini-batch's normalisers on the global path).
fn nll(
    m: &CausalLm,
    mi: &MicroInputs,
    _: &[usize],
    ctx: MicroCtx,
) -> candle_core::Result<MicroLoss> {
    let (lp, _) = main_ppo::trainer::actor::response_logprobs(m, mi, 1.0, false)?;
    let mask = mi.response_mask.to_dtype(lp.dtype())?;
    let loss = main_ppo::algo::agg_loss(&lp.neg()?, &mask, LossAggMode::TokenMean, ctx.norm)?;
    Ok(MicroLoss {
        scalars: vec![("actor/pg_loss", main_ppo::algo::agg::scalar(&loss)?)],
        extra: Default::default(),
        loss,
    })
}

fn model() -> (candle_nn::VarMap, CausalLm, Vec<(String, Var)>) {
    let args = ModelArgs::tiny(Arch::Llama, 32);
    let (vm, m) = main_ppo::testing::tiny_model(&args, DType::F64, 0.3);
    let mut vars: Vec<(String, Var)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    (vm, m, vars)
}

fn flat(g: &GradStore, vars: &[(String, Var)]) -> Vec<f64> {
    vars.iter()
        .flat_map(|(_, v)| {
            g.get(v.as_tensor())
                .map(|t| t.flatten_all().unwrap().to_vec1::<f64>().unwrap())
                .unwrap_or_else(|| vec![0.0; v.elem_count()])
        })
        .collect()
}

fn weights(vars: &[(String, Var)]) -> Vec<f64> {
    vars.iter()
        .flat_map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
        })
        .collect()
}

fn rel_diff(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-300);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Under `mpirun -np 2` only (see [`two_ranks_give_one_process_gradients_and_weights`]).
#[test]
#[ignore = "runs under mpirun, started by two_ranks_give_one_process_gradients_and_weights"]
fn inner_two_rank_gradients() {
    if std::env::var_os("MAIN_PPO_MPI_INNER").is_none() {
        println!("skipped: only meaningful under mpirun (MAIN_PPO_MPI_INNER unset)");
        return;
    }
    let comm: Comm = std::sync::Arc::new(main_ppo::dist::Mpi::init().unwrap());
    let (rank, world) = (comm.rank(), comm.world_size());
    assert_eq!(world, 2);
    let b = rows();
    let mini: Vec<usize> = (0..4).collect();
    for global in [false, true] {
        let (_vm, m, vars) = model();
        // One process: the whole mini-batch's gradient.
        let one = settings(global, (0, 1));
        let ctx = MicroCtx {
            norm: mini_batch_norm(&b, &mini, &one.plan, None),
            on_policy: false,
        };
        let mut sc = UpdateScalars::default();
        let g1 = mini_batch_grads(&m, &vars, (&b, &mini), &one, ctx, &mut sc, &mut nll)
            .unwrap()
            .unwrap();
        // This rank's share, then the sum over the ranks.
        let mine = settings(global, (rank, world));
        let mut sc = UpdateScalars::default();
        let mut g2 = mini_batch_grads(&m, &vars, (&b, &mini), &mine, ctx, &mut sc, &mut nll)
            .unwrap()
            .unwrap();
        let local = flat(&g2, &vars);
        all_reduce_grads(comm.as_ref(), &vars, &mut g2).unwrap();
        let (want, got) = (flat(&g1, &vars), flat(&g2, &vars));
        let d = rel_diff(&got, &want);
        println!("rank {rank} global_norm={global}: relative gradient difference {d:e}");
        assert!(d <= 1e-10, "rank {rank} global_norm={global}: {d}");
        // The share alone is not the whole (the test would pass vacuously otherwise).
        assert!(rel_diff(&local, &want) > 1e-3);
    }
    // Three updates on two ranks vs one process: weights equal to 1e-10 (relative to the
    // largest weight), and bit-identical between the ranks.
    let optim = OptimConfig {
        lr: 1e-2,
        ..OptimConfig::default()
    };
    let args = ModelArgs::tiny(Arch::Llama, 32);
    let trainable = |shard: (usize, usize)| {
        let (vm, m, _) = model();
        Trainable::new(
            m,
            vm,
            None,
            args.clone(),
            &optim,
            10,
            settings(false, shard),
        )
        .unwrap()
    };
    let mut single = trainable((0, 1));
    let mut dp = trainable((rank, world));
    dp.set_comm(comm.clone());
    let mut loss = |m: &CausalLm, mi: &MicroInputs, r: &[usize], c: MicroCtx| nll(m, mi, r, c);
    for step in 1..=3 {
        let m1 = single.update(&b, step, &mut loss).unwrap();
        let m2 = dp.update(&b, step, &mut loss).unwrap();
        for (k, v) in &m1 {
            let w = m2[k];
            assert!(
                (v - w).abs() <= 1e-10 * v.abs().max(1.0),
                "step {step} {k}: {v} vs {w}"
            );
        }
    }
    let w1 = weights(single.optimizer.vars());
    let w2 = weights(dp.optimizer.vars());
    let d = rel_diff(&w2, &w1);
    println!("rank {rank}: relative weight difference after 3 updates {d:e}");
    assert!(d <= 1e-10, "rank {rank}: {d}");
    // Rank 0's weights, byte for byte, on rank 1.
    let mut bytes: Vec<u8> = w2.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mine = bytes.clone();
    comm.broadcast_bytes(&mut bytes, 0).unwrap();
    assert_eq!(bytes, mine, "rank {rank} holds other weights than rank 0");
    println!("rank {rank}: inner test passed");
}

#[test]
fn two_ranks_give_one_process_gradients_and_weights() {
    let Some(mut c) = mpirun(2) else { return };
    let exe = std::env::current_exe().unwrap();
    let out = c
        .env("MAIN_PPO_MPI_INNER", "1")
        .arg(exe)
        .args([
            "--exact",
            "dist::inner_two_rank_gradients",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert_eq!(t.matches("inner test passed").count(), 2, "{t}");
}

// ---------------------------------------------------------------------------------------------
// Whole runs of the binary.

/// A tiny model, 8 prompts, a Python-free native-free reward (a Python file) in `dir`.
fn setup(dir: &Path) {
    let model = dir.join("model");
    if model.exists() {
        return;
    }
    let args = ModelArgs::tiny(Arch::Llama, 259);
    let (vm, _) = main_ppo::testing::tiny_model(&args, DType::F32, 0.1);
    main_ppo::testing::write_tokenizer_dir(&model).unwrap();
    main_ppo::weights::hf::save_dir(&vm, &args, &model, &[258], Some(&model), None).unwrap();
    let rows: Vec<serde_json::Value> = (0..8)
        .map(|i| main_ppo::testing::verl_row(&format!("What is {i} + {i}?"), &(2 * i).to_string()))
        .collect();
    main_ppo::testing::write_jsonl(&dir.join("train.jsonl"), &rows).unwrap();
    std::fs::write(
        dir.join("reward.py"),
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(len(solution_str) % 3) / 2\n",
    )
    .unwrap();
}

/// The arguments of a short run in `dir` (metrics in `dir/verl_examples/gsm8k.jsonl`).
fn run_args(dir: &Path, steps: u64, extra: &[&str]) -> Vec<String> {
    setup(dir);
    let mut a = super::short_run_args(dir, &dir.join("model"), steps);
    a.push("trainer.logger=[file]".into());
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_main_ppo"));
    c.env("RUST_LOG", "info").env("RAYON_NUM_THREADS", "1");
    c
}

/// Runs `main_ppo` in `dir` on `np` ranks (0 = plain, no launcher).
fn train(dir: &Path, np: usize, args: &[String]) -> Output {
    let mut c = if np == 0 {
        bin()
    } else {
        let mut c = mpirun(np).expect("mpirun checked by the caller");
        c.arg(env!("CARGO_BIN_EXE_main_ppo"));
        c
    };
    c.current_dir(dir)
        .env_remove("VERL_FILE_LOGGER_PATH")
        .env_remove("VERL_FILE_LOGGER_ROOT")
        .args(args)
        .output()
        .unwrap()
}

/// Each logged step's metrics (`dir/verl_examples/gsm8k.jsonl`).
fn metrics(dir: &Path) -> Vec<serde_json::Map<String, serde_json::Value>> {
    let s = std::fs::read_to_string(dir.join("verl_examples/gsm8k.jsonl")).unwrap_or_default();
    s.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["data"].as_object().unwrap().clone()
        })
        .collect()
}

/// Every metric but times, throughput and memory agrees to `tol` (relative, floor 1); the
/// rollout-correction statistics to at least 1e-5: they compare two f32 log-prob passes over
/// whole sequences (`chi2_seq` squares a ratio of products over up to 128 tokens), so the
/// last-bit differences that summing gradients in another order leaves in the weights after a
/// step move them by ~1e-6 (measured: 1.2e-6 on `chi2_seq`, two ranks against one process).
fn assert_same_metrics(
    a: &[serde_json::Map<String, serde_json::Value>],
    b: &[serde_json::Map<String, serde_json::Value>],
    tol: f64,
    what: &str,
) {
    assert_eq!(a.len(), b.len(), "{what}: steps logged");
    let timing = |k: &str| k.starts_with("timing") || k.starts_with("perf/");
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        let kx: Vec<&String> = x.keys().filter(|k| !timing(k)).collect();
        let ky: Vec<&String> = y.keys().filter(|k| !timing(k)).collect();
        assert_eq!(kx, ky, "{what}: metric names of step {}", step + 1);
        for k in kx {
            let (u, v) = (
                x[k].as_f64().unwrap_or(f64::NAN),
                y[k].as_f64().unwrap_or(f64::NAN),
            );
            let tol = match k.starts_with("rollout_corr/") {
                true => tol.max(1e-5),
                false => tol,
            };
            let ok = (u - v).abs() <= tol * u.abs().max(1.0) || (u.is_nan() && v.is_nan());
            assert!(ok, "{what}: step {} {k}: {u} vs {v}", step + 1);
        }
    }
}

fn checkpoint_bytes(dir: &Path, step: u64) -> Vec<u8> {
    let f = dir.join(format!(
        "checkpoints/verl_examples/gsm8k/global_step_{step}/actor/huggingface/model.safetensors"
    ));
    std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()))
}

/// 3 steps of PPO with a critic (gae), of GRPO, of GRPO with one mini-batch per step (an
/// on-policy update, whose own forward gives the old log-probs: each rank fills the rows of its
/// micro-batches and the ranks exchange them, so no `old_log_prob` pass runs), and of GRPO with
/// DAPO's dynamic sampling (each rank generates half of every batch): 2 ranks, 1 rank
/// through MPI and a plain process log the same metrics (1e-6; `actor/entropy` is read from
/// the exchanged rows) and save the same actor.
#[test]
fn two_ranks_and_one_log_the_same_metrics_for_gae_and_grpo() {
    if mpirun(1).is_none() {
        return;
    }
    for (est, mini, dapo, distill) in [
        ("gae", 2, false, None),
        ("grpo", 2, false, None),
        ("grpo", 4, false, None),
        ("grpo", 2, true, None),
        ("grpo", 2, false, Some("k3")),
        ("grpo", 2, false, Some("forward_kl_topk")),
    ] {
        let mut extra = vec![
            format!("algorithm.adv_estimator={est}"),
            format!("actor_rollout_ref.actor.ppo_mini_batch_size={mini}"),
            "trainer.save_freq=3".into(),
        ];
        if dapo {
            // Dynamic sampling: batches of 2 prompts (one per rank), gathered and filtered on
            // every rank alike, until 4 groups whose scores differ are kept.
            extra.extend([
                "algorithm.filter_groups.enable=True".into(),
                "algorithm.filter_groups.metric=score".into(),
                "data.gen_batch_size=2".into(),
            ]);
        }
        if let Some(mode) = distill {
            // Distillation from the model itself (set per run below: its folder), the
            // teacher's log-probs or top-k tokens computed on each rank and gathered.
            extra.extend([
                "distillation.enabled=True".to_string(),
                format!("distillation.distillation_loss.loss_mode={mode}"),
                "distillation.distillation_loss.topk=4".into(),
                "distillation.distillation_loss.distillation_loss_coef=0.5".into(),
            ]);
        }
        let est = format!(
            "{est} mini-batch {mini}{}{}",
            if dapo { " dapo" } else { "" },
            distill
                .map(|d| format!(" distillation {d}"))
                .unwrap_or_default()
        );
        // One mini-batch of the step's 8 rows: the on-policy update.
        let on_policy = mini == 4;
        let mut runs = Vec::new();
        for np in [0, 1, 2] {
            let dir = tempfile::tempdir().unwrap();
            let mut extra = extra.clone();
            if distill.is_some() {
                extra.push(format!(
                    "distillation.teacher_models.teacher_model.model_path={}",
                    dir.path().join("model").display()
                ));
            }
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            let out = train(dir.path(), np, &run_args(dir.path(), 3, &extra));
            assert!(out.status.success(), "{est} np={np}: {}", text(&out));
            runs.push((
                np,
                metrics(dir.path()),
                checkpoint_bytes(dir.path(), 3),
                dir,
            ));
        }
        let (_, base, actor, _) = &runs[0];
        assert_eq!(base.len(), 3);
        if dapo {
            let batches: f64 = base
                .iter()
                .map(|m| m["train/num_gen_batches"].as_f64().unwrap())
                .sum();
            assert!(
                batches >= 6.0,
                "{est}: at least 2 batches a step, {batches} in all"
            );
        }
        assert!(
            base[2].contains_key("actor/pg_loss"),
            "{:?}",
            base[2].keys()
        );
        if distill.is_some() {
            assert!(
                base[2]["distillation/loss"].as_f64().unwrap() > 0.0,
                "{est}"
            );
        }
        for (np, m, a, _) in &runs[1..] {
            for (i, step) in m.iter().enumerate() {
                assert_eq!(
                    step.contains_key("timing_s/old_log_prob"),
                    !on_policy,
                    "{est} np={np} step {}: the old_log_prob pass runs unless on-policy",
                    i + 1
                );
                assert!(step.contains_key("actor/entropy"), "{est} np={np}");
            }
            assert_same_metrics(
                m,
                base,
                1e-6,
                &format!("{est}: {np} rank(s) vs one process"),
            );
            if *np == 1 {
                assert_eq!(
                    a, actor,
                    "{est}: the MPI path with one rank saves the same actor"
                );
            }
        }
    }
}

/// Two ranks save at step 2 and stop; two ranks resume from that checkpoint and run to step
/// 4: steps 3-4 log the metrics of an uninterrupted 2-rank run, and the step-4 actors match.
#[test]
fn two_ranks_resume_from_a_two_rank_checkpoint_exactly() {
    if mpirun(2).is_none() {
        return;
    }
    let extra = ["algorithm.adv_estimator=gae", "trainer.save_freq=2"];
    let straight = tempfile::tempdir().unwrap();
    let out = train(straight.path(), 2, &run_args(straight.path(), 4, &extra));
    assert!(out.status.success(), "{}", text(&out));
    let resumed = tempfile::tempdir().unwrap();
    let out = train(resumed.path(), 2, &run_args(resumed.path(), 2, &extra));
    assert!(out.status.success(), "{}", text(&out));
    let out = train(resumed.path(), 2, &run_args(resumed.path(), 4, &extra));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert_eq!(
        t.matches("(step 2)").count(),
        2,
        "both ranks resumed from step 2: {t}"
    );
    let (a, b) = (metrics(straight.path()), metrics(resumed.path()));
    assert_eq!(b.len(), 4, "two runs of two steps");
    assert_same_metrics(&b[2..], &a[2..], 0.0, "resumed vs straight (steps 3-4)");
    assert_eq!(
        checkpoint_bytes(resumed.path(), 4),
        checkpoint_bytes(straight.path(), 4)
    );
}

/// The pid of the `main_ppo` process whose environment holds `marker` and
/// `OMPI_COMM_WORLD_RANK=rank` (or MPICH's `PMI_RANK=rank`). The rank's Python reward workers
/// inherit both variables, and once pids wrap around (pid_max is 32768 here) a worker can be
/// listed first: only the trainer's own process counts.
fn rank_pid(marker: &str, rank: usize) -> Option<u32> {
    let want = [
        format!("OMPI_COMM_WORLD_RANK={rank}"),
        format!("PMI_RANK={rank}"),
    ];
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let is_trainer = std::fs::read_to_string(e.path().join("comm"))
            .is_ok_and(|comm| comm.trim_end() == "main_ppo");
        if !is_trainer {
            continue;
        }
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        let vars: Vec<String> = env
            .split(|&b| b == 0)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect();
        if vars.iter().any(|v| v == marker) && vars.iter().any(|v| want.contains(v)) {
            return Some(pid);
        }
    }
    None
}

/// What [`signal_rank_1_after_a_step`] saw: the job's output, the time from the signal to the
/// end, rank 1's pid, the run's process marker (for [`rank_pid`]) and its folder.
struct Signalled {
    out: std::process::Output,
    waited: Duration,
    pid: u32,
    marker: String,
    dir: tempfile::TempDir,
}

/// Starts a long 2-rank run under `c` (mpirun) with `nccl_timeout` seconds, waits for its first
/// step, sends `signal` to rank 1 and waits for the job.
fn signal_rank_1_after_a_step(mut c: Command, nccl_timeout: u64, signal: &str) -> Signalled {
    let dir = tempfile::tempdir().unwrap();
    let marker = format!("MAIN_PPO_TEST_RUN={}", dir.path().display());
    let (k, v) = marker.split_once('=').unwrap();
    let timeout = format!("actor_rollout_ref.nccl_timeout={nccl_timeout}");
    let args = run_args(dir.path(), 1000, &[timeout.as_str()]);
    let child = c
        .env(k, v)
        .arg(env!("CARGO_BIN_EXE_main_ppo"))
        .args(&args)
        .current_dir(dir.path())
        .env_remove("VERL_FILE_LOGGER_PATH")
        .env_remove("VERL_FILE_LOGGER_ROOT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while metrics(dir.path()).is_empty() {
        assert!(t.elapsed() < Duration::from_secs(180), "no step finished");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = rank_pid(&marker, 1).expect("rank 1's process");
    assert!(Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let sent = Instant::now();
    let out = child.wait_with_output().unwrap();
    Signalled {
        out,
        waited: sent.elapsed(),
        pid,
        marker,
        dir,
    }
}

/// SIGKILL on rank 1 in the middle of a run: the job ends with an error that names the dead
/// rank, well within the timeout, instead of rank 0 waiting forever.
#[test]
fn a_killed_rank_ends_the_others_with_an_error() {
    let Some(c) = mpirun(2) else { return };
    let Signalled {
        out,
        waited,
        marker,
        ..
    } = signal_rank_1_after_a_step(c, 30, "-KILL");
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(waited < Duration::from_secs(60), "took {waited:?}: {t}");
    assert!(
        t.contains("rank 1") || t.contains("rank: 1"),
        "the dead rank is named: {t}"
    );
    println!("the job ended {waited:?} after rank 1 was killed:\n{t}");
    // Rank 0 did not go on alone.
    assert!(rank_pid(&marker, 0).is_none(), "rank 0 still runs");
}

/// Two ranks with a remote tracker (the fake `wandb` SDK of the tracker tests, which records
/// every call with its pid): only rank 0 starts a tracker worker and opens a run; its 3 steps
/// are logged once each, and the run is finished.
#[test]
fn with_two_ranks_only_rank_0_opens_a_tracker_run() {
    if mpirun(2).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sdk = super::trackers::fake_sdk(dir.path());
    let log = dir.path().join("fake_wandb.jsonl");
    let mut args = run_args(dir.path(), 3, &[]);
    args.push("trainer.logger=[file,wandb]".into());
    let out = mpirun(2)
        .unwrap()
        .arg(env!("CARGO_BIN_EXE_main_ppo"))
        .current_dir(dir.path())
        .env_remove("VERL_FILE_LOGGER_PATH")
        .env_remove("VERL_FILE_LOGGER_ROOT")
        .env("PYTHONPATH", &sdk)
        .env("FAKE_TRACKER_LOG", &log)
        .args(&args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let calls: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let inits: Vec<_> = calls.iter().filter(|c| c.get("init").is_some()).collect();
    assert_eq!(inits.len(), 1, "one run opened: {calls:?}");
    let pids: std::collections::BTreeSet<_> = calls
        .iter()
        .filter_map(|c| c.get("pid").and_then(|p| p.as_u64()))
        .collect();
    assert_eq!(pids.len(), 1, "one worker process: {calls:?}");
    let steps: Vec<u64> = calls
        .iter()
        .filter_map(|c| c.get("step").and_then(|s| s.as_u64()))
        .collect();
    assert_eq!(steps, vec![1, 2, 3], "{calls:?}");
    assert_eq!(
        calls.iter().filter(|c| c.get("finish").is_some()).count(),
        1,
        "{calls:?}"
    );
    assert_eq!(metrics(dir.path()).len(), 3);
}

/// Launched as 2 ranks, a configuration that asks for another world size is refused naming
/// both keys; a batch that does not split into whole prompts per rank names its key.
#[test]
fn world_size_rules_name_their_keys() {
    let Some(_) = mpirun(2) else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = train(
        dir.path(),
        2,
        &run_args(
            dir.path(),
            1,
            &["trainer.nnodes=1", "trainer.n_gpus_per_node=8"],
        ),
    );
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("trainer.nnodes (1) × trainer.n_gpus_per_node (8)"),
        "{t}"
    );
    let out = train(
        dir.path(),
        2,
        &run_args(
            dir.path(),
            1,
            &[
                "data.train_batch_size=3",
                "actor_rollout_ref.actor.ppo_mini_batch_size=3",
            ],
        ),
    );
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("data.train_batch_size (3) must be divisible by the number of processes (2)"),
        "{t}"
    );
}

/// Rank 1 stopped (SIGSTOP: alive but silent, which no launcher notices): rank 0's watchdog
/// ends it after `actor_rollout_ref.nccl_timeout` seconds with an error naming the collective
/// and the key, and the launcher then ends the job.
#[test]
fn a_hung_rank_is_caught_by_the_collective_timeout() {
    let Some(c) = mpirun(2) else { return };
    let Signalled {
        out, waited, pid, ..
    } = signal_rank_1_after_a_step(c, 3, "-STOP");
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(waited < Duration::from_secs(60), "took {waited:?}: {t}");
    assert!(t.contains("error: rank 0 of 2: collective"), "{t}");
    assert!(t.contains("past actor_rollout_ref.nccl_timeout=3 s"), "{t}");
    println!("the job ended {waited:?} after rank 1 was stopped:\n{t}");
}

/// SIGTERM on rank 1 only (as a scheduler's preemption or one Ctrl-C reaching one process):
/// both ranks stop after the same step, the job ends cleanly, and that step's checkpoint is
/// written and named as the latest.
#[test]
fn sigterm_on_rank_1_stops_both_ranks_after_the_same_step_with_a_checkpoint() {
    let Some(c) = mpirun(2) else { return };
    let Signalled {
        out, waited, dir, ..
    } = signal_rank_1_after_a_step(c, 120, "-TERM");
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(waited < Duration::from_secs(120), "took {waited:?}: {t}");
    // Each rank logs where it stopped; both name the same step.
    let steps: Vec<u64> = t
        .lines()
        .filter_map(|l| l.split("stopped after step ").nth(1))
        .filter(|rest| rest.contains("on request"))
        .map(|rest| {
            let n: String = rest.chars().take_while(char::is_ascii_digit).collect();
            n.parse().unwrap()
        })
        .collect();
    assert_eq!(steps.len(), 2, "one stop line per rank: {t}");
    assert_eq!(steps[0], steps[1], "{t}");
    let step = steps[0];
    assert!((1..1000).contains(&step), "{t}");
    let ckpts = dir.path().join("checkpoints");
    let latest = walk_find(&ckpts, "latest_checkpointed_iteration.txt").expect("a tracker file");
    assert_eq!(
        std::fs::read_to_string(&latest).unwrap().trim(),
        step.to_string()
    );
    assert!(latest
        .parent()
        .unwrap()
        .join(format!("global_step_{step}"))
        .is_dir());
    // The metrics end at that step (rank 0 logged every step up to it).
    let logged = metrics(dir.path());
    assert_eq!(logged.len() as u64, step, "{t}");
}

/// The first file called `name` under `root`.
fn walk_find(root: &Path, name: &str) -> Option<std::path::PathBuf> {
    for e in std::fs::read_dir(root).ok()?.flatten() {
        let p = e.path();
        if p.is_dir() {
            if let Some(f) = walk_find(&p, name) {
                return Some(f);
            }
        } else if p.file_name().is_some_and(|n| n == name) {
            return Some(p);
        }
    }
    None
}

/// `main_ppo sft` on two ranks against one process: each rank trains on half of every step's
/// conversations and the gradients are summed, so the logged loss, gradient norm and learning
/// rate agree to 1e-6 over three steps (the loss of steps 2 and 3 is computed with the weights
/// the ranks updated), rank 0 alone writes the checkpoint, and a batch the ranks cannot share
/// evenly is refused naming `data.train_batch_size`.
#[test]
fn sft_on_two_ranks_equals_one_process() {
    if mpirun(2).is_none() {
        return;
    }
    let conversations: Vec<serde_json::Value> = (0..8)
        .map(|i| {
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("What is {i} + {i}?")},
                {"role": "assistant", "content": format!("{i} + {i} = {}\n#### {}", 2 * i, 2 * i)}]})
        })
        .collect();
    let args = |dir: &Path, bsz: usize| -> Vec<String> {
        setup(dir);
        main_ppo::testing::write_jsonl(&dir.join("sft.jsonl"), &conversations).unwrap();
        [
            "sft".to_string(),
            format!("data.train_files={}", dir.join("sft.jsonl").display()),
            format!("model.path={}", dir.join("model").display()),
            format!("data.train_batch_size={bsz}"),
            "data.micro_batch_size_per_gpu=1".into(),
            "data.max_length=128".into(),
            "optim.lr=1e-3".into(),
            "trainer.total_training_steps=3".into(),
            "trainer.logger=[file]".into(),
            "trainer.project_name=verl_examples".into(),
            "trainer.experiment_name=gsm8k".into(),
            format!("trainer.default_local_dir={}", dir.join("ckpt").display()),
        ]
        .to_vec()
    };
    let mut runs = Vec::new();
    for np in [0, 2] {
        let dir = tempfile::tempdir().unwrap();
        let out = train(dir.path(), np, &args(dir.path(), 4));
        let said = text(&out);
        assert!(out.status.success(), "np={np}: {said}");
        if np == 2 {
            assert!(said.contains("data parallel: rank 1 of 2"), "{said}");
        }
        assert!(dir
            .path()
            .join("ckpt/global_step_3/huggingface/model.safetensors")
            .is_file());
        runs.push((metrics(dir.path()), dir));
    }
    let (one, two) = (&runs[0].0, &runs[1].0);
    assert_eq!(one.len(), 3, "three steps logged once (rank 0)");
    assert!(one[2]["train/loss"].as_f64().unwrap() > 0.0);
    assert_same_metrics(two, one, 1e-6, "sft: 2 ranks vs one process");

    let dir = tempfile::tempdir().unwrap();
    let out = train(dir.path(), 2, &args(dir.path(), 3));
    assert!(!out.status.success());
    let said = text(&out);
    assert!(
        said.contains("data.train_batch_size")
            && said.contains("divisible by the number of processes (2)"),
        "{said}"
    );
}
