//! main_ppo: verl's PPO trainer (`python -m verl.trainer.main_ppo`) as one Rust binary.
//!
//! Layers, lowest first (a module never imports one above it):
//! `config` (every key and default) → `data` (rows → tokenised prompts) → `model` (the
//! transformer and its files) → `rollout` (generation) → `reward` (scores) and `algo` (PPO
//! mathematics) → `cli` (argv, logging, exit codes). The trainer, checkpoint and metrics layers
//! come between these and `cli`.

pub mod algo;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod data;
pub mod metrics;
pub mod model;
pub mod reward;
pub mod rollout;
#[doc(hidden)]
pub mod testing;
pub mod trainer;
