//! Sample dumps: `trainer.rollout_data_dir/{step}.jsonl` (every training response of a step)
//! and `trainer.validation_data_dir/{step}.jsonl` (written by validation).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::batch::{Column, StepBatch, TurnStats};
use super::{Result, Trainer, TrainerError};
use crate::data::TokenizerBundle;

impl Trainer {
    /// `{dir}/{step}.jsonl`: prompt, response, ground truth, score, each source's score and the
    /// mean advantage of every response of the step.
    pub(super) fn dump_rollouts(&self, dir: &str, batch: &StepBatch) -> Result<()> {
        let advantages = batch.column(Column::Advantages)?;
        let rows: Vec<Value> = (0..batch.len())
            .map(|i| {
                let s = &self.train.samples[batch.sample[i]];
                let reward = &batch.rewards[i];
                let prompt = self
                    .tokenizer
                    .tokenizer
                    .decode(&batch.prompts[i], true)
                    .unwrap_or_default();
                let adv = &advantages[i];
                let mean_adv = if adv.is_empty() {
                    Value::Null
                } else {
                    json!(adv.iter().map(|&x| x as f64).sum::<f64>() / adv.len() as f64)
                };
                let mut o = serde_json::Map::new();
                o.insert("input".into(), json!(prompt));
                o.insert("output".into(), json!(batch.texts[i]));
                o.insert("gts".into(), s.ground_truth.clone());
                o.insert("score".into(), json!(reward.score));
                o.insert("step".into(), json!(self.global_step));
                o.insert("data_source".into(), json!(s.data_source));
                o.insert("uid".into(), json!(batch.uid[i]));
                o.insert("advantage".into(), mean_adv);
                for (name, v) in &reward.per_source {
                    o.insert(format!("reward/{name}"), json!(v));
                }
                for (k, v) in &reward.extra {
                    o.entry(k.clone()).or_insert(v.clone());
                }
                if let Some(e) = &reward.error {
                    o.insert("reward_error".into(), json!(e));
                }
                if let Some(t) = batch.turns.as_ref().and_then(|t| t.get(i)) {
                    add_turns(&mut o, &self.tokenizer, &batch.responses[i], t);
                }
                o.insert("gated".into(), json!(reward.gated));
                o.insert("excluded".into(), json!(batch.excluded[i]));
                Value::Object(o)
            })
            .collect();
        write_jsonl(
            &PathBuf::from(crate::util::expand_home(dir)),
            self.global_step,
            &rows,
        )
    }
}

/// A tool-agent row's conversation in a dump: `turns`, the response cut where the model's
/// tokens and the appended ones alternate (`{"role": "assistant" | "tool", "text"}`, special
/// tokens kept so the template's markers show; an interaction's user turn is such an appended
/// span too), `num_turns`, `tool_calls` and the interaction's `turn_scores` when it spoke.
pub(super) fn add_turns(
    o: &mut serde_json::Map<String, Value>,
    tok: &TokenizerBundle,
    response: &[u32],
    t: &TurnStats,
) {
    if !t.tool_agent {
        return;
    }
    let mut turns = Vec::new();
    let mut at = 0usize;
    for (k, &len) in t.spans.iter().enumerate() {
        let end = (at + len as usize).min(response.len());
        if end > at {
            let text = tok
                .tokenizer
                .decode(&response[at..end], false)
                .unwrap_or_default();
            let role = if k % 2 == 0 { "assistant" } else { "tool" };
            turns.push(json!({"role": role, "text": text}));
        }
        at = end;
    }
    o.insert("turns".into(), Value::Array(turns));
    o.insert("num_turns".into(), json!(t.num_turns));
    o.insert("tool_calls".into(), json!(t.tool_calls));
    if !t.turn_scores.is_empty() {
        o.insert("turn_scores".into(), json!(t.turn_scores));
    }
}

/// Writes `{dir}/{step}.jsonl`.
pub(super) fn write_jsonl(dir: &Path, step: u64, rows: &[Value]) -> Result<()> {
    let err = |e: std::io::Error| TrainerError::Other(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut text = String::new();
    for r in rows {
        text.push_str(&r.to_string());
        text.push('\n');
    }
    std::fs::write(dir.join(format!("{step}.jsonl")), text).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response of "hi" + EOS, a tool turn, "ok": cut by its spans into three turns whose
    /// texts are the ids decoded by hand; single-turn rows get no `turns`.
    #[test]
    fn dumps_show_each_turn() {
        let dir = tempfile::tempdir().unwrap();
        crate::testing::write_tokenizer_dir(dir.path()).unwrap();
        let tok = TokenizerBundle::from_dir(dir.path()).unwrap();
        let enc = |s: &str| tok.encode(s).unwrap();
        let model1 = [enc("hi"), vec![258]].concat();
        let tool = [
            enc("\n"),
            vec![257],
            enc("tool\n4"),
            vec![258],
            enc("\n"),
            vec![257],
            enc("assistant\n"),
        ]
        .concat();
        let model2 = enc("ok");
        let response = [model1.clone(), tool.clone(), model2.clone()].concat();
        let mask: Vec<u8> = [
            vec![1; model1.len()],
            vec![0; tool.len()],
            vec![1; model2.len()],
        ]
        .concat();
        let t = TurnStats {
            num_turns: 4,
            tool_agent: true,
            tool_calls: 1,
            spans: super::super::phases::spans(&mask),
            ..Default::default()
        };
        assert_eq!(t.spans, vec![model1.len() as u32, tool.len() as u32, 2]);
        let mut o = serde_json::Map::new();
        add_turns(&mut o, &tok, &response, &t);
        assert_eq!(
            o["turns"],
            json!([
                {"role": "assistant", "text": "hi<|im_end|>"},
                {"role": "tool", "text": "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"},
                {"role": "assistant", "text": "ok"},
            ])
        );
        assert_eq!(
            (o["num_turns"].clone(), o["tool_calls"].clone()),
            (json!(4), json!(1))
        );
        let mut single = serde_json::Map::new();
        add_turns(
            &mut single,
            &tok,
            &response,
            &TurnStats {
                num_turns: 2,
                ..Default::default()
            },
        );
        assert!(single.is_empty());
    }

    /// Run lengths by hand, including masks that start with appended tokens and empty ones.
    #[test]
    fn spans_alternate_from_a_model_run() {
        use super::super::phases::spans;
        assert_eq!(spans(&[1, 1, 0, 0, 0, 1]), vec![2, 3, 1]);
        assert_eq!(spans(&[0, 1]), vec![0, 1, 1]);
        assert_eq!(spans(&[]), vec![0]);
        assert_eq!(spans(&[1, 1]), vec![2]);
    }
}
