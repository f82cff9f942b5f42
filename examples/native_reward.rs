//! A binary with a native Rust reward function: register it, then select it from the config.
//!
//! ```sh
//! cargo run --release --example native_reward -- reward score --input rows.jsonl \
//!   'reward.sources=[{name: brevity, type: native, function: brevity, kwargs: {target_chars: 400}}]'
//! ```
//! Any `main_ppo` command works the same way (training included), with `brevity` available.

use main_ppo::reward::{NativeRegistry, RewardError, ScoreInput, ScoreResult};
use serde_json::{Map, Value};

/// 1.0 for responses up to `target_chars` characters, falling linearly to 0 at twice that.
fn brevity(input: &ScoreInput, kwargs: &Map<String, Value>) -> Result<ScoreResult, RewardError> {
    let target = kwargs
        .get("target_chars")
        .and_then(Value::as_f64)
        .unwrap_or(400.0);
    if target <= 0.0 {
        return Err(RewardError::Config(format!(
            "brevity: target_chars must be > 0, got {target}"
        )));
    }
    let n = input.solution_str.chars().count() as f64;
    let score = (1.0 - (n - target).max(0.0) / target).max(0.0);
    let mut extra = Map::new();
    extra.insert("chars".into(), Value::from(n));
    Ok(ScoreResult { score, extra })
}

fn main() {
    let mut natives = NativeRegistry::new();
    natives
        .register("brevity", brevity)
        .expect("registered once");
    std::process::exit(main_ppo::cli::main_with(std::env::args_os(), natives));
}
