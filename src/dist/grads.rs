//! What the update sums over the ranks: gradients (after the micro-batch loop, before
//! clipping), rows of per-token values that each rank filled for its own micro-batches, and
//! the update's scalar metrics.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use super::Collective;

/// Sums each variable's gradient over the ranks, in buckets of at most
/// [`super::BUCKET_BYTES`], after the micro-batch loop and before clipping, so that the
/// gradient norm, the skip decision and AdamW see the same numbers on every rank. A variable
/// that received a gradient on no rank stays without one (AdamW leaves it alone, as with one
/// process); one that did on some ranks only counts zeros for the others. Gradients of f64
/// variables are summed in f64, all others in f32.
pub fn all_reduce_grads(
    comm: &dyn Collective,
    vars: &[(String, candle_core::Var)],
    grads: &mut GradStore,
) -> candle_core::Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut present: Vec<f64> = vars
        .iter()
        .map(|(_, v)| f64::from(u8::from(grads.get(v.as_tensor()).is_some())))
        .collect();
    comm.all_reduce_sum_f64(&mut present)?;
    let with_grad = |f64s: bool| -> Vec<usize> {
        (0..vars.len())
            .filter(|&i| present[i] > 0.0 && (vars[i].1.dtype() == DType::F64) == f64s)
            .collect()
    };
    reduce_group::<f64>(comm, vars, grads, &with_grad(true))?;
    reduce_group::<f32>(comm, vars, grads, &with_grad(false))
}

/// An element type the collectives sum.
trait Reduced: candle_core::WithDType {
    fn all_reduce(comm: &dyn Collective, buf: &mut [Self]) -> super::Result<()>;
}

impl Reduced for f32 {
    fn all_reduce(comm: &dyn Collective, buf: &mut [Self]) -> super::Result<()> {
        comm.all_reduce_sum_f32(buf)
    }
}

impl Reduced for f64 {
    fn all_reduce(comm: &dyn Collective, buf: &mut [Self]) -> super::Result<()> {
        comm.all_reduce_sum_f64(buf)
    }
}

/// [`all_reduce_grads`] for the variables `members` (indices into `vars`), summed as `T`.
fn reduce_group<T: Reduced>(
    comm: &dyn Collective,
    vars: &[(String, candle_core::Var)],
    grads: &mut GradStore,
    members: &[usize],
) -> candle_core::Result<()> {
    let cap = (super::BUCKET_BYTES / <T as candle_core::WithDType>::DTYPE.size_in_bytes()).max(1);
    let mut buf: Vec<T> = Vec::new();
    let mut held: Vec<usize> = Vec::new();
    let flush = |buf: &mut Vec<T>, held: &mut Vec<usize>, grads: &mut GradStore| {
        T::all_reduce(comm, buf)?;
        let mut at = 0;
        for &i in held.iter() {
            let var = &vars[i].1;
            let n = var.elem_count();
            let t = Tensor::from_slice(&buf[at..at + n], var.shape(), var.device())?
                .to_dtype(var.dtype())?;
            grads.insert(var.as_tensor(), t);
            at += n;
        }
        buf.clear();
        held.clear();
        candle_core::Result::Ok(())
    };
    for &i in members {
        let var = &vars[i].1;
        // [elem_count]: this rank's gradient, zeros where it had none
        let flat: Vec<T> = match grads.get(var.as_tensor()) {
            Some(g) => g
                .flatten_all()?
                .to_dtype(<T as candle_core::WithDType>::DTYPE)?
                .to_vec1()?,
            None => vec![T::zero(); var.elem_count()],
        };
        if !buf.is_empty() && buf.len() + flat.len() > cap {
            flush(&mut buf, &mut held, grads)?;
        }
        buf.extend_from_slice(&flat);
        held.push(i);
    }
    if !held.is_empty() {
        flush(&mut buf, &mut held, grads)?;
    }
    Ok(())
}

/// Rows filled on one rank each (the others empty) made whole on every rank: rows laid end to
/// end at their response lengths `lens`, zeros where this rank has no values, summed over the
/// ranks (`x + 0` is exact, so every value arrives unchanged).
pub fn sum_rows_over_ranks(
    comm: &dyn Collective,
    rows: Vec<Vec<f32>>,
    lens: &[usize],
) -> candle_core::Result<Vec<Vec<f32>>> {
    let mut flat = vec![0f32; lens.iter().sum()];
    let mut at = 0;
    for (r, (row, &len)) in rows.iter().zip(lens).enumerate() {
        if !row.is_empty() {
            if row.len() != len {
                candle_core::bail!(
                    "row {r}: {} captured values for a response of {len} tokens",
                    row.len()
                );
            }
            flat[at..at + len].copy_from_slice(row);
        }
        at += len;
    }
    super::all_reduce_sum_bucketed_f32(comm, &mut flat)?;
    let mut at = 0;
    Ok(lens
        .iter()
        .map(|&len| {
            at += len;
            flat[at - len..at].to_vec()
        })
        .collect())
}

/// One scalar metric of a rank: a sum with its count (a mean), or a total.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Summed {
    pub sum: f64,
    pub count: f64,
    /// Totals add up over the ranks; the others are means over every rank's values.
    pub total: bool,
    /// A minimum (`Some(false)`) or maximum (`Some(true)`) over the ranks, held in `sum`.
    #[serde(default)]
    pub extreme: Option<bool>,
}

impl Summed {
    /// The values of a mean (their sum and count).
    pub fn mean(values: &[f64]) -> Self {
        Summed {
            sum: values.iter().sum(),
            count: values.len() as f64,
            total: false,
            extreme: None,
        }
    }

    /// The smallest (`max` false) or largest of `values` (none: no entry is made from it).
    pub fn extreme(values: &[f64], max: bool) -> Self {
        let v = match max {
            true => values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            false => values.iter().copied().fold(f64::INFINITY, f64::min),
        };
        Summed {
            sum: v,
            count: 1.0,
            total: false,
            extreme: Some(max),
        }
    }

    pub fn total(v: f64) -> Self {
        Summed {
            sum: v,
            count: 0.0,
            total: true,
            extreme: None,
        }
    }
}

/// Every rank's `mine` merged, the same on every rank (in rank order): per key the sum over the
/// ranks (totals) or the mean over all their values.
pub fn merge_over_ranks(
    comm: &dyn Collective,
    mine: BTreeMap<String, Summed>,
) -> candle_core::Result<BTreeMap<String, f64>> {
    let bytes = serde_json::to_vec(&mine).map_err(candle_core::Error::wrap)?;
    let mut merged: BTreeMap<String, Summed> = BTreeMap::new();
    for part in super::all_gather_bytes(comm, bytes)? {
        let p: BTreeMap<String, Summed> =
            serde_json::from_slice(&part).map_err(candle_core::Error::wrap)?;
        for (k, s) in p {
            let e = merged.entry(k).or_insert(Summed {
                sum: match s.extreme {
                    Some(true) => f64::NEG_INFINITY,
                    Some(false) => f64::INFINITY,
                    None => 0.0,
                },
                count: 0.0,
                total: s.total,
                extreme: s.extreme,
            });
            match s.extreme {
                Some(true) => e.sum = e.sum.max(s.sum),
                Some(false) => e.sum = e.sum.min(s.sum),
                None => e.sum += s.sum,
            }
            e.count += s.count;
        }
    }
    Ok(merged
        .into_iter()
        .map(|(k, s)| {
            let v = if s.total || s.extreme.is_some() {
                s.sum
            } else {
                s.sum / s.count.max(1.0)
            };
            (k, v)
        })
        .collect())
}
