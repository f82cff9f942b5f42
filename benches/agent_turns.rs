//! What a multi-turn rollout costs beyond its tools: SmolLM2-135M, 16 GSM8K prompts, sampled at
//! temperature 1, 256 response tokens per row, f32 on the CPU.
//!
//! - single turn: every row generates 256 tokens (EOS ignored);
//! - tool turns: a row that writes EOS gets a tool turn (the tokens of a rendered tool message
//!   and the next generation prompt, 30-odd ids, appended as verl's agent loop appends them)
//!   after `wait` and goes on, again and again until its response holds 256 tokens (or less
//!   when the next tool turn would not fit): the same token count, with turns and waits.
//!
//! Tool turns with `wait` = 0 against the single turn is the loop's own cost (parking a row with
//! its KV cache, feeding the appended ids); with `wait` = 0.5 s the excess over the single turn
//! is compared with the longest time one row spent waiting (the tools of different rows overlap).
//! Prints the median of 3 timed runs of each (after a warm-up, interleaved; AGENT_TURNS_DEBUG=1
//! also prints each run's per-row waits and tool turns). Needs the model:
//! `scripts/fetch_smollm2.sh` (or MAIN_PPO_SMOLLM2). Run: `cargo bench --bench agent_turns`.

use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use main_ppo::model::CausalLm;
use main_ppo::rollout::scheduler::{generate_turns, Turns};
use main_ppo::rollout::{Limits, Rollout, Sampler, SamplingParams, StopReason};

const QUESTIONS: [&str; 4] = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much more money does Betty need to buy the wallet?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
];
const ROWS: usize = 16;
const LEN: usize = 256;

/// Tool turns on every EOS, each answered `wait` after it was asked for.
struct Tools {
    appended: Vec<u32>,
    wait: Duration,
    asked: Vec<Option<Instant>>,
    waited: Vec<Duration>,
    turns: Vec<usize>,
}

impl Turns for Tools {
    fn turn_ended(&mut self, row: usize, out: &Rollout) -> bool {
        let room = out.responses[row].len() + self.appended.len() < LEN;
        if !room || out.stop[row] != StopReason::Eos {
            return false;
        }
        self.asked[row] = Some(Instant::now());
        self.turns[row] += 1;
        true
    }

    fn ready(&mut self, wait: bool) -> Vec<(usize, Option<Vec<u32>>)> {
        loop {
            let now = Instant::now();
            let done: Vec<usize> = (0..self.asked.len())
                .filter(|&r| self.asked[r].is_some_and(|t| now >= t + self.wait))
                .collect();
            if !done.is_empty() || !wait {
                return done
                    .into_iter()
                    .map(|r| {
                        let t = self.asked[r].take().unwrap();
                        self.waited[r] += t.elapsed();
                        (r, Some(self.appended.clone()))
                    })
                    .collect();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

struct Run {
    secs: f64,
    tokens: usize,
    appended: usize,
    turns: usize,
    max_wait: f64,
}

fn tool_run(
    m: &CausalLm,
    prompts: &[&[u32]],
    p: &SamplingParams,
    appended: &[u32],
    wait: Duration,
) -> Run {
    let mut tools = Tools {
        appended: appended.to_vec(),
        wait,
        asked: vec![None; prompts.len()],
        waited: vec![Duration::ZERO; prompts.len()],
        turns: vec![0; prompts.len()],
    };
    let t = Instant::now();
    let (out, _) = generate_turns(
        m,
        prompts,
        p,
        Sampler::new(7).rows(),
        None,
        Some(&mut tools),
        &[],
    )
    .unwrap();
    let secs = t.elapsed().as_secs_f64();
    let turns: usize = tools.turns.iter().sum();
    if std::env::var_os("AGENT_TURNS_DEBUG").is_some() {
        let mut w: Vec<f64> = tools.waited.iter().map(Duration::as_secs_f64).collect();
        w.sort_by(f64::total_cmp);
        eprintln!("waits {w:.2?} turns {:?}", tools.turns);
    }
    Run {
        secs,
        tokens: out.responses.iter().map(Vec::len).sum(),
        appended: turns * appended.len(),
        turns,
        max_wait: tools
            .waited
            .iter()
            .map(Duration::as_secs_f64)
            .fold(0.0, f64::max),
    }
}

fn single_run(m: &CausalLm, prompts: &[&[u32]], p: &SamplingParams) -> Run {
    let mut q = p.clone();
    q.ignore_eos = true;
    let t = Instant::now();
    let (out, _) = generate_turns(m, prompts, &q, Sampler::new(7).rows(), None, None, &[]).unwrap();
    Run {
        secs: t.elapsed().as_secs_f64(),
        tokens: out.responses.iter().map(Vec::len).sum(),
        appended: 0,
        turns: 0,
        max_wait: 0.0,
    }
}

fn median(v: &mut [Run]) -> &Run {
    v.sort_by(|a, b| a.secs.total_cmp(&b.secs));
    &v[v.len() / 2]
}

fn main() {
    let path = std::env::var("MAIN_PPO_SMOLLM2").unwrap_or_else(|_| {
        format!(
            "{}/.cache/main_ppo/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    if !std::path::Path::new(&path).is_file() {
        eprintln!("agent_turns bench skipped: no {path} (run scripts/fetch_smollm2.sh)");
        return;
    }
    main_ppo::kernels::alloc::keep_freed_memory();
    let (loaded, content) =
        main_ppo::weights::gguf::load(std::path::Path::new(&path), DType::F32, &Device::Cpu, true)
            .unwrap();
    let tok = main_ppo::weights::gguf::tokenizer(&content, std::path::Path::new(&path)).unwrap();
    let prompts: Vec<Vec<u32>> = (0..ROWS)
        .map(|r| {
            let q = QUESTIONS[r % QUESTIONS.len()];
            tok.encode(&format!(
                "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
            ))
            .unwrap()
        })
        .collect();
    // What verl's loop appends after a turn that ended on <|im_end|>: the newline, a tool
    // message as SmolLM2's ChatML renders it, the next generation prompt.
    let appended = tok
        .encode("\n<|im_start|>tool\nCurrent parsed answer=72 reward=1.0<|im_end|>\n<|im_start|>assistant\n")
        .unwrap();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let p = SamplingParams {
        greedy: false,
        temperature: 1.0,
        top_k: None,
        top_p: 1.0,
        max_new_tokens: LEN,
        eos_ids: tok.eos_token_ids.clone(),
        ignore_eos: false,
        limits: Limits::default(),
    };
    let wait = Duration::from_millis(500);
    // Warm-up.
    single_run(&loaded.model, &refs, &p);
    let (mut single, mut instant, mut slow) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        single.push(single_run(&loaded.model, &refs, &p));
        instant.push(tool_run(
            &loaded.model,
            &refs,
            &p,
            &appended,
            Duration::ZERO,
        ));
        slow.push(tool_run(&loaded.model, &refs, &p, &appended, wait));
    }
    let (s, i, w) = (median(&mut single), median(&mut instant), median(&mut slow));
    println!(
        "SmolLM2-135M, {ROWS} rows x {LEN} response tokens, f32, {} threads",
        rayon::current_num_threads()
    );
    println!(
        "  single turn:            {:.2} s, {} tokens",
        s.secs, s.tokens
    );
    for (name, r) in [("tool turns, wait 0 s:", i), ("tool turns, wait 0.5 s:", w)] {
        println!(
            "  {name:<24}{:.2} s, {} tokens ({} appended in {} tool turns), longest wait of a row {:.2} s",
            r.secs, r.tokens, r.appended, r.turns, r.max_wait
        );
    }
    // Per token, so that a few tokens short of 256 (no room for another tool turn) do not count.
    let per = |r: &Run| r.secs / r.tokens as f64;
    let excess0 = (per(i) - per(s)) * i.tokens as f64;
    let excess = (per(w) - per(s)) * w.tokens as f64;
    println!(
        "  loop cost (wait 0) over the single turn: {excess0:+.2} s ({:+.1} %)",
        100.0 * (per(i) / per(s) - 1.0)
    );
    println!(
        "  cost over the single turn with 0.5 s tools: {excess:+.2} s; longest wait of a row {:.2} s; within the tool time: {}",
        w.max_wait,
        excess <= w.max_wait
    );
}
