//! The training batch order: seeded per-epoch shuffles, `drop_last` like verl's loader, and a
//! cursor that serialises into a checkpoint so a resumed run sees the same batches.

use serde::{Deserialize, Serialize};

use super::dataset::PromptDataset;

pub use crate::util::permutation;

/// Where the loader is: the epoch, the batches already served in it, and the shuffle seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderCursor {
    pub epoch: u64,
    pub batches_served: u64,
    pub seed: u64,
    pub shuffle: bool,
}

/// Serves batches of dataset indices, epoch after epoch.
#[derive(Debug, Clone)]
pub struct BatchLoader {
    len: usize,
    batch_size: usize,
    cursor: LoaderCursor,
    order: Vec<usize>,
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
        }
    }

    fn order_for(len: usize, c: &LoaderCursor) -> Vec<usize> {
        if c.shuffle {
            permutation(len, c.seed, c.epoch)
        } else {
            (0..len).collect()
        }
    }

    /// Full batches per epoch (the last partial batch is dropped).
    pub fn batches_per_epoch(&self) -> usize {
        self.len / self.batch_size
    }

    pub fn cursor(&self) -> LoaderCursor {
        self.cursor
    }

    /// The epoch the next batch belongs to.
    pub fn next_epoch(&self) -> u64 {
        let used_up = self.cursor.batches_served as usize >= self.batches_per_epoch();
        self.cursor.epoch + u64::from(used_up)
    }

    /// The next batch of indices, moving to the next epoch (with a new order) when this one is
    /// used up. `None` when the data set holds less than one batch.
    pub fn next_batch(&mut self) -> Option<Vec<usize>> {
        if self.batches_per_epoch() == 0 {
            return None;
        }
        if self.cursor.batches_served as usize >= self.batches_per_epoch() {
            self.cursor.epoch += 1;
            self.cursor.batches_served = 0;
            self.order = Self::order_for(self.len, &self.cursor);
        }
        let start = self.cursor.batches_served as usize * self.batch_size;
        self.cursor.batches_served += 1;
        Some(self.order[start..start + self.batch_size].to_vec())
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
