//! DAPO's group filter (`algorithm.filter_groups`): which prompt groups carry a GRPO signal.
//!
//! A group (the rows sharing a `uid`) is kept when the filter metric of its responses has a
//! nonzero standard deviation, or when it holds a single response (verl's rule, from its DAPO
//! trainer). The deviation is NumPy's `np.std` with NumPy's arithmetic — the first element plus
//! the pairwise sum of the rest, in the values' precision — because verl's decision is exactly
//! `np.std(values) > 0`, and for values such as `[0.1, 0.1, 0.1]` that is not 0 (the mean
//! rounds): such a group is kept there and so it is kept here.

use num_traits::Float;

/// NumPy's sum of a 1-D array (`np.add.reduce`): the first element plus the pairwise sum of
/// the rest (`pairwise_sum` in NumPy's loops: sequential below 8 values, 8 accumulators up to
/// 128, halves above).
pub fn np_sum<T: Float>(a: &[T]) -> T {
    match a.split_first() {
        None => T::zero(),
        Some((first, rest)) => *first + pairwise_sum(rest),
    }
}

fn pairwise_sum<T: Float>(a: &[T]) -> T {
    let n = a.len();
    if n < 8 {
        a.iter().fold(T::zero(), |s, &x| s + x)
    } else if n <= 128 {
        let mut r = [T::zero(); 8];
        r.copy_from_slice(&a[..8]);
        let whole = n - n % 8;
        for block in a[8..whole].chunks_exact(8) {
            for (acc, &x) in r.iter_mut().zip(block) {
                *acc = *acc + x;
            }
        }
        let mut s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for &x in &a[whole..] {
            s = s + x;
        }
        s
    } else {
        let mut half = n / 2;
        half -= half % 8;
        pairwise_sum(&a[..half]) + pairwise_sum(&a[half..])
    }
}

/// NumPy's `np.std(a)` (population deviation, `ddof=0`) in `T`'s precision; NaN when empty.
pub fn np_std<T: Float>(a: &[T]) -> T {
    let n = T::from(a.len()).unwrap_or_else(T::nan);
    let mean = np_sum(a) / n;
    let squares: Vec<T> = a.iter().map(|&x| (x - mean) * (x - mean)).collect();
    (np_sum(&squares) / n).sqrt()
}

/// The precision verl computes a metric's deviation in: f32 for the summed token-level rewards
/// (`seq_reward`, `seq_final_reward`: a float32 tensor's sums), f64 for the reward function's
/// values (Python floats and bools).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    F64,
}

/// The outcome of filtering one generation batch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupFilter {
    /// The rows of the kept groups, in row order.
    pub rows: Vec<usize>,
    /// Kept groups, in order of their first row.
    pub kept: Vec<u64>,
    /// Groups dropped: every response had the same metric value.
    pub dropped: usize,
}

/// The groups of `uid` (rows of a group need not be adjacent) that [`filter`] keeps: a group's
/// metric `values` (`None` for a row left out of the update, which does not count) must have a
/// nonzero [`np_std`], or the group must be a single response that is in the update. A group
/// whose rows are all left out is dropped.
pub fn filter(uid: &[u64], values: &[Option<f64>], precision: Precision) -> GroupFilter {
    let mut order: Vec<u64> = Vec::new();
    let mut groups: std::collections::HashMap<u64, (usize, Vec<f64>)> = Default::default();
    for (&u, v) in uid.iter().zip(values) {
        let g = groups.entry(u).or_insert_with(|| {
            order.push(u);
            (0, Vec::new())
        });
        g.0 += 1;
        g.1.extend(*v);
    }
    let keep = |(rows, vals): &(usize, Vec<f64>)| match (rows, vals.len()) {
        (1, 1) => true,
        (_, 0 | 1) => false,
        _ => match precision {
            Precision::F64 => np_std(vals) > 0.0,
            Precision::F32 => np_std(&vals.iter().map(|&x| x as f32).collect::<Vec<_>>()) > 0.0,
        },
    };
    let kept: Vec<u64> = order.iter().copied().filter(|u| keep(&groups[u])).collect();
    let kept_set: std::collections::HashSet<u64> = kept.iter().copied().collect();
    GroupFilter {
        rows: (0..uid.len())
            .filter(|r| kept_set.contains(&uid[*r]))
            .collect(),
        dropped: order.len() - kept.len(),
        kept,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// NumPy 2.4.6 printed these (`np.std`, `np.add.reduce`, in the bench venv): the rounding
    /// cases verl's rule inherits.
    #[test]
    fn numpy_std_and_sum_on_rounding_cases() {
        // np.std([0.1, 0.1, 0.1]) = 1.3877787807814457e-17 (the mean is 0.10000000000000002).
        assert_eq!(np_std(&[0.1f64, 0.1, 0.1]), 1.3877787807814457e-17);
        // float32: np.std(np.float32([0.1] * 3)) = 0.0.
        assert_eq!(np_std(&[0.1f32, 0.1, 0.1]), 0.0);
        // np.std([1.0, 1.0]) = 0.0, np.std([1.0, 0.0]) = 0.5.
        assert_eq!(np_std(&[1.0f64, 1.0]), 0.0);
        assert_eq!(np_std(&[1.0f64, 0.0]), 0.5);
        // From 9 values on, NumPy's sum is not a running sum:
        // np.add.reduce([0.1] * 10) = 1.0 (running: 0.9999999999999999),
        // np.add.reduce([0.1] * 17) = 1.7000000000000002 (running: 1.7000000000000004).
        assert_eq!(np_sum(&[0.1f64; 10]), 1.0);
        assert_eq!([0.1f64; 10].iter().sum::<f64>(), 0.9999999999999999);
        assert_eq!(np_sum(&[0.1f64; 17]), 1.7000000000000002);
        assert_eq!([0.1f64; 17].iter().sum::<f64>(), 1.7000000000000004);
        // np.std([0.1] * 17) = 0.0; np.std([0.3] * 200) = 5.551115123125783e-17 (halves).
        assert_eq!(np_std(&[0.1f64; 17]), 0.0);
        assert_eq!(np_std(&[0.3f64; 200]), 5.551115123125783e-17);
    }

    #[test]
    fn keeps_groups_with_spread_and_single_responses() {
        // uid 7: all correct (dropped); uid 3: mixed (kept); uid 9: one response (kept);
        // uid 5: two rows, one left out of the update (one value left: dropped).
        let uid = [7, 7, 3, 3, 9, 5, 5];
        let v = [
            Some(1.0),
            Some(1.0),
            Some(0.0),
            Some(1.0),
            Some(0.0),
            Some(1.0),
            None,
        ];
        let f = filter(&uid, &v, Precision::F64);
        assert_eq!(f.kept, vec![3, 9]);
        assert_eq!(f.rows, vec![2, 3, 4]);
        assert_eq!(f.dropped, 2);
        // A single response left out of the update carries nothing: dropped.
        assert_eq!(filter(&[1], &[None], Precision::F64).dropped, 1);
        // The precision decides the rounding case.
        let tenth = [Some(0.1); 3];
        assert_eq!(filter(&[4; 3], &tenth, Precision::F64).kept, vec![4]);
        assert_eq!(filter(&[4; 3], &tenth, Precision::F32).dropped, 1);
    }

    proptest! {
        /// Whatever the groups and scores, no kept group of two or more responses has all its
        /// values equal, every group is either kept whole or dropped whole, and kept + dropped
        /// covers every group.
        #[test]
        fn never_keeps_a_zero_variance_group(
            rows in proptest::collection::vec((0u64..6, 0u8..3, proptest::bool::weighted(0.9)), 1..40)
        ) {
            let uid: Vec<u64> = rows.iter().map(|r| r.0).collect();
            let values: Vec<Option<f64>> =
                rows.iter().map(|r| r.2.then_some(r.1 as f64 * 0.5)).collect();
            let f = filter(&uid, &values, Precision::F64);
            let groups: std::collections::BTreeSet<u64> = uid.iter().copied().collect();
            prop_assert_eq!(f.kept.len() + f.dropped, groups.len());
            for g in &f.kept {
                let members: Vec<usize> = (0..uid.len()).filter(|&r| uid[r] == *g).collect();
                prop_assert!(members.iter().all(|r| f.rows.contains(r)));
                let vals: Vec<f64> = members.iter().filter_map(|&r| values[r]).collect();
                if members.len() > 1 {
                    prop_assert!(vals.iter().any(|&x| x != vals[0]), "group {} kept with {:?}", g, vals);
                } else {
                    prop_assert_eq!(vals.len(), 1);
                }
            }
            prop_assert!(f.rows.iter().all(|r| f.kept.contains(&uid[*r])));
        }
    }
}
