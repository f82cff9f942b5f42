//! Rust reward functions: implement [`RewardFn`] (or pass a closure), register it under a name
//! in a [`NativeRegistry`], and select it with `{type: native, function: <name>}` in
//! `reward.sources`. A binary built on this library registers its functions before training.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::{RewardError, ScoreInput, ScoreResult};

/// A reward function: one response in, one score out. `kwargs` are the source's `kwargs`.
pub trait RewardFn: Send + Sync {
    fn score(
        &self,
        input: &ScoreInput,
        kwargs: &Map<String, Value>,
    ) -> Result<ScoreResult, RewardError>;
}

impl<F> RewardFn for F
where
    F: Fn(&ScoreInput, &Map<String, Value>) -> Result<ScoreResult, RewardError> + Send + Sync,
{
    fn score(
        &self,
        input: &ScoreInput,
        kwargs: &Map<String, Value>,
    ) -> Result<ScoreResult, RewardError> {
        self(input, kwargs)
    }
}

/// Named native reward functions.
#[derive(Clone, Default)]
pub struct NativeRegistry {
    fns: BTreeMap<String, Arc<dyn RewardFn>>,
}

impl std::fmt::Debug for NativeRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeRegistry")
            .field("names", &self.fns.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl NativeRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `f` as `name`; a second registration of a name is an error.
    pub fn register(&mut self, name: &str, f: impl RewardFn + 'static) -> Result<(), RewardError> {
        if self.fns.contains_key(name) {
            return Err(RewardError::Config(format!(
                "native reward function `{name}` is registered twice"
            )));
        }
        self.fns.insert(name.to_string(), Arc::new(f));
        Ok(())
    }

    /// The function registered as `name`, or an error listing the registered names.
    pub fn get(&self, name: &str) -> Result<Arc<dyn RewardFn>, RewardError> {
        self.fns.get(name).cloned().ok_or_else(|| {
            let known: Vec<&str> = self.fns.keys().map(String::as_str).collect();
            RewardError::Config(format!(
                "no native reward function `{name}`; registered: {}",
                if known.is_empty() {
                    "none (a binary built on main_ppo registers them)".to_string()
                } else {
                    known.join(", ")
                }
            ))
        })
    }

    pub fn names(&self) -> Vec<String> {
        self.fns.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_and_call() {
        let mut reg = NativeRegistry::new();
        reg.register("length", |inp: &ScoreInput, kw: &Map<String, Value>| {
            let per_char = kw.get("per_char").and_then(Value::as_f64).unwrap_or(1.0);
            Ok(ScoreResult::number(
                inp.solution_str.chars().count() as f64 * per_char,
            ))
        })
        .unwrap();
        let gt = Value::Null;
        let inp = ScoreInput {
            data_source: "x",
            solution_str: "héllo",
            ground_truth: &gt,
            extra_info: &gt,
        };
        let mut kw = Map::new();
        kw.insert("per_char".into(), 0.5.into());
        assert_eq!(
            reg.get("length").unwrap().score(&inp, &kw).unwrap().score,
            2.5
        );
        assert!(reg
            .register("length", |_: &ScoreInput, _: &Map<String, Value>| Ok(
                ScoreResult::number(0.0)
            ))
            .is_err());
        let e = match reg.get("lenght") {
            Ok(_) => panic!("lenght is not registered"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("`lenght`") && e.contains("length"), "{e}");
    }
}
