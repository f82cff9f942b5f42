//! The training batch order: seeded per-epoch shuffles, `drop_last` like verl's loader, and a
//! cursor that serialises into a checkpoint so a resumed run sees the same batches.
//!
//! With verl's custom sampler (`data.sampler.class_path`) the order is the sampler's: the
//! loader holds an [`IndexSampler`] (the Python worker of `reward::sampler`, given by the
//! trainer: this room starts no process) and draws each batch from it when the batch is needed,
//! as verl's loader with `dataloader_num_workers=0` does, so a curriculum sampler's `update`
//! after a step shapes the next batch. An epoch is one `iter(sampler)`; it ends when the
//! iterator cannot fill a batch (the rest is dropped, `drop_last`). Batches drawn for a step
//! that was then abandoned are given back ([`BatchLoader::rewind`]) and served again first,
//! also after a resume ([`SamplerCursor::pending`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::dataset::PromptDataset;
use super::DataError;

pub use crate::util::permutation;

/// Where the loader is: the epoch, the batches already served in it, and the shuffle seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderCursor {
    pub epoch: u64,
    pub batches_served: u64,
    pub seed: u64,
    pub shuffle: bool,
}

/// A sampler that orders the training data (verl's `data.sampler.class_path`). Errors name the
/// sampler and what it did.
#[allow(clippy::len_without_is_empty)] // `len(sampler)`, as Python's; nothing asks for emptiness
pub trait IndexSampler: Send {
    /// The sampler in messages: "`Class` from path (data.sampler)".
    fn name(&self) -> &str;
    /// `len(sampler)`: indices an epoch is expected to give (the steps of an epoch follow it).
    fn len(&self) -> usize;
    /// Whether `update(batch=...)` is called after each step (verl's `AbstractCurriculumSampler`).
    fn curriculum(&self) -> bool;
    /// Begins the sampler's next epoch (`iter(sampler)`).
    fn begin_epoch(&mut self) -> Result<(), DataError>;
    /// Up to `n` more indices of the epoch; fewer when its iterator ended.
    fn take(&mut self, n: usize) -> Result<Vec<i64>, DataError>;
    /// `update(batch=...)` with the step's data (`step`: the step just finished).
    fn update(&mut self, step: u64, batch: &Value) -> Result<(), DataError>;
    /// The sampler's position (and state, where it keeps one) for a checkpoint.
    fn save(&mut self) -> Result<Value, DataError>;
    /// Puts the freshly built sampler where [`IndexSampler::save`] found the saved one.
    fn restore(&mut self, saved: &Value) -> Result<(), DataError>;
}

/// The custom sampler's part of a checkpoint, beside the [`LoaderCursor`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplerCursor {
    /// Batches drawn from the sampler and not yet trained on (a stopped step's), served before
    /// the sampler is asked again; each with the cursor before it.
    pub pending: Vec<(LoaderCursor, Vec<usize>)>,
    /// Whether an epoch had begun (`iter(sampler)` called).
    pub begun: bool,
    /// What [`IndexSampler::save`] returned.
    pub state: Value,
}

/// The loader's custom sampler and the batches it drew.
struct Custom {
    sampler: Box<dyn IndexSampler>,
    begun: bool,
    /// Drawn, given back by a rewind, served first (with the cursor before each).
    pending: VecDeque<(LoaderCursor, Vec<usize>)>,
    /// Served, with the cursor before each: this epoch's and the previous one's (for rewinds).
    served: VecDeque<(LoaderCursor, Vec<usize>)>,
}

impl std::fmt::Debug for Custom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Custom")
            .field("sampler", &self.sampler.name())
            .field("pending", &self.pending.len())
            .finish()
    }
}

/// Serves batches of dataset indices, epoch after epoch. A clone shares a custom sampler (one
/// Python worker) with the original.
#[derive(Debug, Clone)]
pub struct BatchLoader {
    len: usize,
    batch_size: usize,
    cursor: LoaderCursor,
    order: Vec<usize>,
    custom: Option<Arc<Mutex<Custom>>>,
}

impl BatchLoader {
    /// A loader at the start of epoch 0.
    pub fn new(len: usize, batch_size: usize, shuffle: bool, seed: u64) -> Self {
        Self::resume(
            len,
            batch_size,
            LoaderCursor {
                epoch: 0,
                batches_served: 0,
                seed,
                shuffle,
            },
        )
    }

    /// A loader continuing from `cursor` (from a checkpoint).
    pub fn resume(len: usize, batch_size: usize, cursor: LoaderCursor) -> Self {
        let order = Self::order_for(len, &cursor);
        Self {
            len,
            batch_size: batch_size.max(1),
            cursor,
            order,
            custom: None,
        }
    }

    /// A loader whose order is `sampler`'s (verl's `data.sampler.class_path`), at the start of
    /// epoch 0; `data.shuffle` and `data.seed` then order nothing, as in verl.
    pub fn with_sampler(len: usize, batch_size: usize, sampler: Box<dyn IndexSampler>) -> Self {
        let mut l = Self::resume(
            len,
            batch_size,
            LoaderCursor {
                epoch: 0,
                batches_served: 0,
                seed: 0,
                shuffle: false,
            },
        );
        l.order = Vec::new();
        l.custom = Some(Arc::new(Mutex::new(Custom {
            sampler,
            begun: false,
            pending: VecDeque::new(),
            served: VecDeque::new(),
        })));
        l
    }

    fn custom(&self) -> Option<std::sync::MutexGuard<'_, Custom>> {
        self.custom
            .as_ref()
            .map(|c| c.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Whether the order is a custom sampler's.
    pub fn has_sampler(&self) -> bool {
        self.custom.is_some()
    }

    /// The custom sampler's name and whether it is a curriculum sampler (`update` after each step).
    pub fn sampler_info(&self) -> Option<(String, bool)> {
        self.custom()
            .map(|c| (c.sampler.name().to_string(), c.sampler.curriculum()))
    }

    /// Calls the curriculum sampler's `update(batch=...)` after step `step` (nothing without one).
    pub fn update_sampler(&self, step: u64, batch: &Value) -> Result<(), DataError> {
        match self.custom() {
            Some(mut c) if c.sampler.curriculum() => c.sampler.update(step, batch),
            _ => Ok(()),
        }
    }

    /// The custom sampler's part of a checkpoint (`None` without one).
    pub fn sampler_cursor(&self) -> Result<Option<SamplerCursor>, DataError> {
        let Some(mut c) = self.custom() else {
            return Ok(None);
        };
        Ok(Some(SamplerCursor {
            pending: c.pending.iter().cloned().collect(),
            begun: c.begun,
            state: c.sampler.save()?,
        }))
    }

    /// Continues from a checkpoint: `cursor`, and for a custom sampler what
    /// [`BatchLoader::sampler_cursor`] saved (the sampler is put where it was).
    pub fn restore(
        &mut self,
        cursor: LoaderCursor,
        saved: Option<&SamplerCursor>,
    ) -> Result<(), DataError> {
        let Some(custom) = self.custom.clone() else {
            *self = Self::resume(self.len, self.batch_size, cursor);
            return Ok(());
        };
        let mut c = custom.lock().unwrap_or_else(|p| p.into_inner());
        let saved = saved.ok_or_else(|| {
            DataError::Other(format!(
                "data.sampler.class_path: the checkpoint was saved without a custom sampler, so the position of {} is unknown; resume without data.sampler or start a new run (trainer.resume_mode=disable)",
                c.sampler.name()
            ))
        })?;
        c.sampler.restore(&saved.state)?;
        c.begun = saved.begun;
        c.pending = saved.pending.iter().cloned().collect();
        c.served.clear();
        self.cursor = cursor;
        Ok(())
    }

    /// Puts the loader back to `cursor`, taken earlier in this run: the batches served since are
    /// served again next (with a custom sampler they are given back, not drawn anew).
    pub fn rewind(&mut self, cursor: LoaderCursor) {
        let Some(custom) = self.custom.clone() else {
            *self = Self::resume(self.len, self.batch_size, cursor);
            return;
        };
        let mut c = custom.lock().unwrap_or_else(|p| p.into_inner());
        let key = |k: &LoaderCursor| (k.epoch, k.batches_served);
        while c.served.back().is_some_and(|(b, _)| key(b) >= key(&cursor)) {
            let entry = c.served.pop_back().expect("checked");
            c.pending.push_front(entry);
        }
        self.cursor = cursor;
    }

    fn order_for(len: usize, c: &LoaderCursor) -> Vec<usize> {
        if c.shuffle {
            permutation(len, c.seed, c.epoch)
        } else {
            (0..len).collect()
        }
    }

    /// Full batches per epoch (the last partial batch is dropped); with a custom sampler, of
    /// `len(sampler)` indices.
    pub fn batches_per_epoch(&self) -> usize {
        match self.custom() {
            Some(c) => c.sampler.len() / self.batch_size,
            None => self.len / self.batch_size,
        }
    }

    pub fn cursor(&self) -> LoaderCursor {
        self.cursor
    }

    /// The epoch the next batch belongs to (with a custom sampler, as `len(sampler)` foretells
    /// it: an iterator that ends sooner or later moves the epoch's end).
    pub fn next_epoch(&self) -> u64 {
        if let Some(c) = self.custom() {
            if let Some((before, _)) = c.pending.front() {
                return before.epoch;
            }
        }
        let used_up = self.cursor.batches_served as usize >= self.batches_per_epoch();
        self.cursor.epoch + u64::from(used_up)
    }

    /// [`BatchLoader::try_next_batch`] for the loader's own order, which cannot fail; a custom
    /// sampler's error is logged and gives `None` (the trainer calls `try_next_batch`).
    pub fn next_batch(&mut self) -> Option<Vec<usize>> {
        self.try_next_batch().unwrap_or_else(|e| {
            tracing::error!("{e}");
            None
        })
    }

    /// The next batch of indices, moving to the next epoch (with a new order) when this one is
    /// used up. `None` when the data set holds less than one batch. Errors come from a custom
    /// sampler only (it failed, or gave indices outside the data).
    pub fn try_next_batch(&mut self) -> Result<Option<Vec<usize>>, DataError> {
        if let Some(custom) = self.custom.clone() {
            let mut c = custom.lock().unwrap_or_else(|p| p.into_inner());
            return self.next_drawn(&mut c).map(Some);
        }
        if self.batches_per_epoch() == 0 {
            return Ok(None);
        }
        if self.cursor.batches_served as usize >= self.batches_per_epoch() {
            self.cursor.epoch += 1;
            self.cursor.batches_served = 0;
            self.order = Self::order_for(self.len, &self.cursor);
        }
        let start = self.cursor.batches_served as usize * self.batch_size;
        self.cursor.batches_served += 1;
        Ok(Some(self.order[start..start + self.batch_size].to_vec()))
    }

    /// The next batch from the custom sampler: a given-back batch first, else drawn (a new
    /// epoch begun when the iterator cannot fill one).
    fn next_drawn(&mut self, c: &mut Custom) -> Result<Vec<usize>, DataError> {
        let (before, batch) = match c.pending.pop_front() {
            Some(entry) => entry,
            None => {
                if !c.begun {
                    c.sampler.begin_epoch()?;
                    c.begun = true;
                }
                let mut got = c.sampler.take(self.batch_size)?;
                if got.len() < self.batch_size {
                    self.epoch_too_short(c, got.len())?;
                    self.cursor.epoch += 1;
                    self.cursor.batches_served = 0;
                    c.sampler.begin_epoch()?;
                    got = c.sampler.take(self.batch_size)?;
                    if got.len() < self.batch_size {
                        self.epoch_too_short(c, got.len())?;
                    }
                }
                (self.cursor, self.checked(c, got)?)
            }
        };
        self.cursor = LoaderCursor {
            batches_served: before.batches_served + 1,
            epoch: before.epoch,
            ..self.cursor
        };
        c.served.push_back((before, batch.clone()));
        while c
            .served
            .front()
            .is_some_and(|(b, _)| b.epoch + 1 < self.cursor.epoch)
        {
            c.served.pop_front();
        }
        Ok(batch)
    }

    /// An epoch that ended before its first full batch: the sampler can never fill one.
    fn epoch_too_short(&self, c: &Custom, got: usize) -> Result<(), DataError> {
        if self.cursor.batches_served > 0 {
            return Ok(());
        }
        Err(DataError::Other(format!(
            "{}: epoch {} gave {got} indices, fewer than one batch of {} prompts (data.gen_batch_size, else data.train_batch_size); len(sampler) is {}",
            c.sampler.name(),
            self.cursor.epoch,
            self.batch_size,
            c.sampler.len()
        )))
    }

    /// `got` as dataset indices: each must name a row of the training data.
    fn checked(&self, c: &Custom, got: Vec<i64>) -> Result<Vec<usize>, DataError> {
        got.into_iter()
            .enumerate()
            .map(|(k, i)| {
                usize::try_from(i).ok().filter(|&i| i < self.len).ok_or_else(|| {
                    DataError::Other(format!(
                        "{}: it gave index {i} (position {} of batch {} in epoch {}), outside the training data's {} rows (0..{})",
                        c.sampler.name(),
                        k,
                        self.cursor.batches_served,
                        self.cursor.epoch,
                        self.len,
                        self.len
                    ))
                })
            })
            .collect()
    }
}

/// A left-padded batch of prompts. Shapes: `input_ids`, `attention_mask`, `position_ids` are
/// `[batch, width]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptBatch {
    /// Dataset indices of the rows.
    pub indices: Vec<usize>,
    pub batch: usize,
    pub width: usize,
    pub input_ids: Vec<u32>,
    /// 1 for prompt tokens, 0 for left padding.
    pub attention_mask: Vec<u8>,
    /// Position of each token counted from the row's first real token (0 on padding).
    pub position_ids: Vec<u32>,
}

/// Left-pads the prompts at `indices` to the longest of them with `pad_id`.
pub fn collate(ds: &PromptDataset, indices: &[usize], pad_id: u32) -> PromptBatch {
    let width = indices
        .iter()
        .map(|&i| ds.prompt_ids[i].len())
        .max()
        .unwrap_or(0);
    let mut input_ids = Vec::with_capacity(indices.len() * width);
    let mut attention_mask = Vec::with_capacity(indices.len() * width);
    let mut position_ids = Vec::with_capacity(indices.len() * width);
    for &i in indices {
        let ids = &ds.prompt_ids[i];
        let pad = width - ids.len();
        input_ids.extend(std::iter::repeat_n(pad_id, pad));
        input_ids.extend_from_slice(ids);
        attention_mask.extend(std::iter::repeat_n(0u8, pad));
        attention_mask.extend(std::iter::repeat_n(1u8, ids.len()));
        position_ids.extend(std::iter::repeat_n(0u32, pad));
        position_ids.extend(0..ids.len() as u32);
    }
    PromptBatch {
        indices: indices.to_vec(),
        batch: indices.len(),
        width,
        input_ids,
        attention_mask,
        position_ids,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_seeded_permutation() {
        let p = permutation(100, 7, 0);
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(p, permutation(100, 7, 0), "same seed, same order");
        assert_ne!(p, permutation(100, 8, 0), "another seed, another order");
        assert_ne!(p, permutation(100, 7, 1), "another epoch, another order");
    }

    #[test]
    fn drop_last_and_epochs() {
        let mut l = BatchLoader::new(10, 3, false, 1);
        assert_eq!(l.batches_per_epoch(), 3);
        assert_eq!(l.next_batch().unwrap(), vec![0, 1, 2]);
        assert_eq!(l.next_batch().unwrap(), vec![3, 4, 5]);
        assert_eq!(l.next_batch().unwrap(), vec![6, 7, 8]);
        // Row 9 is dropped; the next epoch starts over.
        assert_eq!(l.next_batch().unwrap(), vec![0, 1, 2]);
        assert_eq!(l.cursor().epoch, 1);
        assert!(BatchLoader::new(2, 3, false, 1).next_batch().is_none());
    }

    /// A sampler giving fixed epochs of indices (each epoch's list, then the last repeated),
    /// whose position is (epochs begun, indices taken): what a Python sampler's worker saves.
    struct Fixed {
        epochs: Vec<Vec<i64>>,
        begun: usize,
        taken: usize,
        updates: Arc<Mutex<Vec<u64>>>,
    }

    impl Fixed {
        fn new(epochs: Vec<Vec<i64>>) -> Self {
            Self {
                epochs,
                begun: 0,
                taken: 0,
                updates: Arc::default(),
            }
        }
        fn epoch(&self) -> &[i64] {
            &self.epochs[(self.begun - 1).min(self.epochs.len() - 1)]
        }
    }

    impl IndexSampler for Fixed {
        fn name(&self) -> &str {
            "data.sampler: `Fixed` from test"
        }
        fn len(&self) -> usize {
            self.epochs[0].len()
        }
        fn curriculum(&self) -> bool {
            true
        }
        fn begin_epoch(&mut self) -> Result<(), DataError> {
            self.begun += 1;
            self.taken = 0;
            Ok(())
        }
        fn take(&mut self, n: usize) -> Result<Vec<i64>, DataError> {
            let e = self.epoch().to_vec();
            let end = (self.taken + n).min(e.len());
            let out = e[self.taken..end].to_vec();
            self.taken = end;
            Ok(out)
        }
        fn update(&mut self, step: u64, _: &Value) -> Result<(), DataError> {
            self.updates.lock().unwrap().push(step);
            Ok(())
        }
        fn save(&mut self) -> Result<Value, DataError> {
            Ok(serde_json::json!([self.begun, self.taken]))
        }
        fn restore(&mut self, saved: &Value) -> Result<(), DataError> {
            self.begun = saved[0].as_u64().unwrap() as usize;
            self.taken = saved[1].as_u64().unwrap() as usize;
            Ok(())
        }
    }

    fn fixed_loader(epochs: Vec<Vec<i64>>, batch: usize) -> BatchLoader {
        BatchLoader::with_sampler(10, batch, Box::new(Fixed::new(epochs)))
    }

    /// The loader serves the sampler's indices in its order, drops an epoch's partial batch
    /// (drop_last) and begins the next epoch with a fresh `iter()`.
    #[test]
    fn a_sampler_sets_the_order_and_epochs_end_where_its_iterator_does() {
        let mut l = fixed_loader(vec![vec![9, 3, 5, 0, 7], vec![1, 2, 4, 6, 8, 0, 3]], 2);
        assert_eq!(l.batches_per_epoch(), 2, "len(sampler) = 5, batches of 2");
        let got: Vec<Vec<usize>> = (0..6)
            .map(|_| l.try_next_batch().unwrap().unwrap())
            .collect();
        // Epoch 0's five indices make two batches (7 is dropped); epoch 1's seven make three
        // (3 is dropped); epoch 2 begins again.
        assert_eq!(
            got,
            vec![
                vec![9, 3],
                vec![5, 0],
                vec![1, 2],
                vec![4, 6],
                vec![8, 0],
                vec![1, 2]
            ]
        );
        assert_eq!(l.cursor().epoch, 2);
        assert!(l.has_sampler());
    }

    /// Batches drawn for an abandoned step are given back and served again, in order, and a
    /// checkpoint taken then holds them (a resumed loader serves them before drawing).
    #[test]
    fn a_rewind_gives_drawn_batches_back_and_a_checkpoint_keeps_them() {
        let epochs = vec![vec![4, 1, 6, 2, 9, 0, 3, 8]];
        let mut straight = fixed_loader(epochs.clone(), 2);
        let all: Vec<Vec<usize>> = (0..7).map(|_| straight.next_batch().unwrap()).collect();
        let mut l = fixed_loader(epochs.clone(), 2);
        let mut head: Vec<Vec<usize>> = (0..3).map(|_| l.next_batch().unwrap()).collect();
        let at = l.cursor();
        l.next_batch().unwrap();
        l.next_batch().unwrap(); // crosses into epoch 1
        l.rewind(at);
        assert_eq!(l.cursor(), at);
        assert_eq!(l.next_epoch(), 0, "the given-back batch belongs to epoch 0");
        let saved = (l.cursor(), l.sampler_cursor().unwrap().unwrap());
        assert_eq!(saved.1.pending.len(), 2);
        let text = serde_json::to_string(&saved).unwrap();
        let (cursor, sc): (LoaderCursor, SamplerCursor) = serde_json::from_str(&text).unwrap();
        let mut resumed = fixed_loader(epochs, 2);
        resumed.restore(cursor, Some(&sc)).unwrap();
        head.extend((0..4).map(|_| resumed.next_batch().unwrap()));
        assert_eq!(head, all);
        let e = fixed_loader(vec![vec![1]], 2)
            .restore(cursor, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("saved without a custom sampler"), "{e}");
    }

    /// Indices outside the data, and an epoch that cannot fill one batch, are errors naming the
    /// sampler (never an endless loop).
    #[test]
    fn bad_sampler_output_is_an_error_naming_the_sampler() {
        let e = fixed_loader(vec![vec![0, 10]], 2)
            .try_next_batch()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`Fixed`") && e.contains("index 10 (position 1") && e.contains("10 rows"),
            "{e}"
        );
        let e = fixed_loader(vec![vec![-1, 0]], 2)
            .try_next_batch()
            .unwrap_err()
            .to_string();
        assert!(e.contains("index -1"), "{e}");
        let e = fixed_loader(vec![vec![3]], 2)
            .try_next_batch()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("epoch 0 gave 1 indices, fewer than one batch of 2"),
            "{e}"
        );
        let mut l = fixed_loader(vec![vec![3, 4], vec![5]], 2);
        l.try_next_batch().unwrap();
        let e = l.try_next_batch().unwrap_err().to_string();
        assert!(e.contains("epoch 1 gave 1 indices"), "{e}");
    }

    /// `update` reaches a curriculum sampler with the step.
    #[test]
    fn updates_reach_the_sampler() {
        let f = Fixed::new(vec![vec![0, 1]]);
        let updates = f.updates.clone();
        let l = BatchLoader::with_sampler(2, 1, Box::new(f));
        l.update_sampler(3, &Value::Null).unwrap();
        assert_eq!(*updates.lock().unwrap(), vec![3]);
        BatchLoader::new(2, 1, true, 0)
            .update_sampler(1, &Value::Null)
            .unwrap();
    }

    #[test]
    fn resume_gives_the_same_order() {
        let mut straight = BatchLoader::new(50, 4, true, 3);
        let all: Vec<Vec<usize>> = (0..30).map(|_| straight.next_batch().unwrap()).collect();
        let mut first = BatchLoader::new(50, 4, true, 3);
        let head: Vec<Vec<usize>> = (0..17).map(|_| first.next_batch().unwrap()).collect();
        let saved = serde_json::to_string(&first.cursor()).unwrap();
        let mut resumed = BatchLoader::resume(50, 4, serde_json::from_str(&saved).unwrap());
        let tail: Vec<Vec<usize>> = (0..13).map(|_| resumed.next_batch().unwrap()).collect();
        assert_eq!([head, tail].concat(), all);
    }
}
