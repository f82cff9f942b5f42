//! On-policy distillation's teachers (`distillation.*`): frozen models, each loaded once in
//! the trainer's process, that score the step's responses. The `teacher` phase (after `ref`)
//! fills `teacher_logprobs`: each row's sampled tokens under the teacher routed to it (verl's
//! `teacher_key` routing; one teacher serves every row), at temperature 1 (verl's teacher
//! computes prompt log-probs, on which temperature has no effect).
//!
//! A teacher must read the student's token ids: its tokenizer is compared with the run's
//! before its weights are read.

use candle_core::Device;

use super::actor::Reference;
use super::batch::{Column, Ragged, StepBatch, TopkRows};
use super::micro::Layout;
use super::{Result, TrainerError};
use crate::config::{DistillPlan, MicroBatching, TeacherPlan};
use crate::data::{PromptDataset, TokenizerBundle};

/// One loaded teacher.
struct Teacher {
    plan: TeacherPlan,
    model: Reference,
    /// Bytes of its weights (`perf/teacher_memory_gb`).
    bytes: usize,
}

/// The teachers of a run.
pub struct Teachers {
    teachers: Vec<Teacher>,
    /// The dataset column routing rows (read with several teachers).
    key: String,
    /// Top-k distillation: how many of each teacher's most likely tokens to keep.
    topk: Option<usize>,
}

/// Why `theirs` (a teacher's tokenizer) cannot read `ours`' token ids, if it cannot: the
/// vocabularies (token → id, added tokens included) must be equal.
pub fn vocabulary_difference(ours: &TokenizerBundle, theirs: &TokenizerBundle) -> Option<String> {
    let (a, b) = (
        ours.tokenizer.get_vocab(true),
        theirs.tokenizer.get_vocab(true),
    );
    if a.len() != b.len() {
        return Some(format!(
            "its tokenizer has {} tokens, the student's {}",
            b.len(),
            a.len()
        ));
    }
    let mut differ: Vec<(&String, &u32)> = a
        .iter()
        .filter(|(tok, id)| b.get(*tok) != Some(*id))
        .collect();
    differ.sort_by_key(|(_, id)| **id);
    let (tok, id) = differ.first()?;
    Some(format!(
        "its tokenizer differs from the student's in {} tokens (the student's token {id} is {tok:?}, the teacher's {})",
        differ.len(),
        theirs
            .tokenizer
            .id_to_token(**id)
            .map_or("nothing".into(), |t| format!("{t:?}"))
    ))
}

impl Teachers {
    /// Loads `plan`'s teachers on `device`, each after its tokenizer was found equal to
    /// `student`'s (a differing one fails before its weights are read).
    pub fn load(
        plan: &DistillPlan,
        student: &TokenizerBundle,
        device: &Device,
        micro: MicroBatching,
        inputs: Layout,
    ) -> Result<Self> {
        let mut teachers = Vec::new();
        for t in &plan.teachers {
            let key = format!("distillation.teacher_models.{}.model_path", t.name);
            let tok = crate::weights::load_tokenizer(&t.model_path)
                .map_err(|e| TrainerError::Other(format!("{key}={}: {e}", t.model_path)))?;
            if let Some(why) = vocabulary_difference(student, &tok) {
                return Err(TrainerError::Other(format!(
                    "{key}={}: {why}; a teacher must read the student's token ids (same tokenizer), nothing was loaded",
                    t.model_path
                )));
            }
            let started = std::time::Instant::now();
            let (mut loaded, _) = crate::weights::load_model_and_tokenizer(
                &t.model_path,
                None,
                &Default::default(),
                candle_core::DType::F32,
                device,
                true,
            )
            .map_err(|e| TrainerError::Other(format!("{key}={}: {e}", t.model_path)))?;
            loaded.model.set_exec(crate::model::Exec {
                recompute: false,
                composed: false,
                bf16: t.bf16,
                dense_experts: false,
            });
            let bytes = loaded
                .varmap
                .all_vars()
                .iter()
                .map(|v| v.elem_count() * v.dtype().size_in_bytes())
                .sum();
            tracing::info!(
                "distillation teacher `{}` ({}): {:.1} MiB of weights, {} products, loaded in {:.1} s",
                t.name,
                t.model_path,
                bytes as f64 / (1u64 << 20) as f64,
                if t.bf16 { "bf16" } else { "f32" },
                started.elapsed().as_secs_f64()
            );
            teachers.push(Teacher {
                plan: t.clone(),
                model: Reference::new(loaded, micro, 1.0, inputs),
                bytes,
            });
        }
        Ok(Self {
            teachers,
            key: plan.teacher_key.clone(),
            topk: plan.topk,
        })
    }

    /// GiB of the teachers' weights.
    pub fn memory_gb(&self) -> f64 {
        self.teachers.iter().map(|t| t.bytes).sum::<usize>() as f64 / (1u64 << 30) as f64
    }

    /// Which teacher scores each row of `batch` (indices into the teachers): with one teacher
    /// every row's; otherwise the teacher whose `key` is the row's value of the routing
    /// column in `data`.
    fn route(&self, batch: &StepBatch, data: &PromptDataset) -> Result<Vec<usize>> {
        if self.teachers.len() == 1 {
            return Ok(vec![0; batch.len()]);
        }
        batch
            .sample
            .iter()
            .map(|&i| {
                let s = &data.samples[i];
                let value = match s.raw.get(&self.key) {
                    Some(serde_json::Value::String(v)) => v.clone(),
                    Some(serde_json::Value::Null) | None => {
                        return Err(TrainerError::Other(format!(
                            "distillation.teacher_key={}: {} row {} has no `{}` column to route it to a teacher by",
                            self.key, s.file, s.row, self.key
                        )))
                    }
                    Some(v) => v.to_string(),
                };
                self.teachers
                    .iter()
                    .position(|t| t.plan.key.as_deref() == Some(value.as_str()))
                    .ok_or_else(|| {
                        let keys: Vec<&str> =
                            self.teachers.iter().filter_map(|t| t.plan.key.as_deref()).collect();
                        TrainerError::Other(format!(
                            "distillation.teacher_key={}: {} row {} has `{}` = {value:?}, which no teacher serves (teachers' keys: {})",
                            self.key,
                            s.file,
                            s.row,
                            self.key,
                            keys.join(", ")
                        ))
                    })
            })
            .collect()
    }

    /// The `teacher` phase: fills `teacher_logprobs` for every row of `batch` (whose prompts
    /// index `data`), or with top-k distillation the teacher's `topk` most likely tokens.
    pub fn compute(&self, batch: &mut StepBatch, data: &PromptDataset) -> Result<()> {
        let route = self.route(batch, data)?;
        let n = batch.len();
        let mut lps: Ragged = vec![Vec::new(); n];
        let mut topk = self.topk.map(|k| TopkRows {
            k,
            ids: vec![Vec::new(); n],
            log_probs: vec![Vec::new(); n],
        });
        for (i, t) in self.teachers.iter().enumerate() {
            let rows: Vec<usize> = (0..n).filter(|&r| route[r] == i).collect();
            if rows.is_empty() {
                continue;
            }
            let mut part = batch.select(&rows);
            match topk.as_mut() {
                Some(all) => {
                    let got = t.model.compute_topk(&part, all.k)?;
                    for ((&r, ids), lp) in rows.iter().zip(got.ids).zip(got.log_probs) {
                        (all.ids[r], all.log_probs[r]) = (ids, lp);
                    }
                }
                None => {
                    t.model.compute_ref_log_prob(&mut part)?;
                    for (&r, lp) in rows.iter().zip(part.column(Column::RefLogProb)?) {
                        lps[r] = lp.clone();
                    }
                }
            }
        }
        match topk {
            Some(all) => batch.teacher_topk = Some(all),
            None => batch.set(Column::TeacherLogProbs, lps)?,
        }
        Ok(())
    }
}
