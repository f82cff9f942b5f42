//! The bytes ranks exchange a step's rows in: a JSON head (whatever the rows carry besides
//! their per-token values, and the names of the columns that follow), then each column's
//! values as little-endian f32 bits, row after row, each row as long as its response (exact,
//! unlike decimal text).
//!
//! ```text
//! [u64 n, little-endian] [n bytes: JSON {"rows": head, "columns": [names]}] [column 0: row 0's f32s, row 1's, ...] [column 1] ...
//! ```

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Why bytes from another rank could not be read.
#[derive(Debug, thiserror::Error)]
#[error("a step batch from another rank: {0}")]
pub struct WireError(pub String);

/// Per-token values of every row, `[rows][len]`.
pub type Column = Vec<Vec<f32>>;

#[derive(Serialize)]
struct HeadOut<'a, H> {
    rows: &'a H,
    columns: Vec<&'a str>,
}

#[derive(Deserialize)]
struct HeadIn<H> {
    rows: H,
    columns: Vec<String>,
}

/// `head` and the named `columns` as bytes (see the module header).
pub fn encode<H: Serialize>(head: &H, columns: &[(&str, &Column)]) -> Vec<u8> {
    let json = serde_json::to_vec(&HeadOut {
        rows: head,
        columns: columns.iter().map(|(n, _)| *n).collect(),
    })
    .unwrap_or_default();
    let values: usize = columns
        .iter()
        .map(|(_, c)| c.iter().map(Vec::len).sum::<usize>())
        .sum();
    let mut out = Vec::with_capacity(8 + json.len() + 4 * values);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for (_, col) in columns {
        for row in col.iter() {
            for v in row {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    out
}

/// Reads [`encode`]'s bytes: the head, then the columns by name, each row `lens(&head)[r]`
/// values long. Every length is checked.
pub fn decode<H: DeserializeOwned>(
    bytes: &[u8],
    lens: impl FnOnce(&H) -> Vec<usize>,
) -> Result<(H, Vec<(String, Column)>), WireError> {
    let bad = |m: String| WireError(m);
    let head = bytes
        .get(..8)
        .ok_or_else(|| bad("shorter than its header".into()))?;
    let n = u64::from_le_bytes(head.try_into().map_err(|_| bad("header".into()))?) as usize;
    let json = 8usize
        .checked_add(n)
        .and_then(|end| bytes.get(8..end))
        .ok_or_else(|| bad("shorter than its row data".into()))?;
    let h: HeadIn<H> = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
    let lens = lens(&h.rows);
    let mut at = 8 + n;
    let mut columns = Vec::with_capacity(h.columns.len());
    for name in h.columns {
        let mut col: Column = Vec::with_capacity(lens.len());
        for &l in &lens {
            let raw = bytes
                .get(at..at + 4 * l)
                .ok_or_else(|| bad(format!("column `{name}` is cut short")))?;
            col.push(
                raw.chunks_exact(4)
                    .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                    .collect(),
            );
            at += 4 * l;
        }
        columns.push((name, col));
    }
    if at != bytes.len() {
        return Err(bad(format!("{} bytes left over", bytes.len() - at)));
    }
    Ok((h.rows, columns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Rows {
        lens: Vec<usize>,
        tag: String,
    }

    fn sample() -> (Rows, Column, Column) {
        let rows = Rows {
            lens: vec![2, 0, 3],
            tag: "x".into(),
        };
        let a = vec![
            vec![1.5, -0.0],
            vec![],
            vec![f32::MIN_POSITIVE, 3.0, f32::NAN],
        ];
        let b = vec![vec![0.1, 0.2], vec![], vec![7.0, 8.0, 9.0]];
        (rows, a, b)
    }

    fn bits(c: &Column) -> Vec<Vec<u32>> {
        c.iter()
            .map(|r| r.iter().map(|v| v.to_bits()).collect())
            .collect()
    }

    /// Head and columns come back bit for bit (NaN, −0 and subnormal-edge values included).
    #[test]
    fn round_trip_is_exact() {
        let (rows, a, b) = sample();
        let bytes = encode(&rows, &[("a", &a), ("b", &b)]);
        let (got, cols) = decode::<Rows>(&bytes, |r| r.lens.clone()).unwrap();
        assert_eq!(got, rows);
        assert_eq!(cols.len(), 2);
        assert_eq!((cols[0].0.as_str(), bits(&cols[0].1)), ("a", bits(&a)));
        assert_eq!((cols[1].0.as_str(), bits(&cols[1].1)), ("b", bits(&b)));
    }

    /// Every cut or extension of the bytes is an error naming what is wrong, never a panic.
    #[test]
    fn damaged_bytes_are_errors() {
        let (rows, a, _) = sample();
        let bytes = encode(&rows, &[("a", &a)]);
        for cut in 0..bytes.len() {
            let e = decode::<Rows>(&bytes[..cut], |r| r.lens.clone()).unwrap_err();
            assert!(
                e.to_string().starts_with("a step batch from another rank"),
                "{e}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        let e = decode::<Rows>(&long, |r| r.lens.clone()).unwrap_err();
        assert!(e.to_string().contains("1 bytes left over"), "{e}");
        let mut huge = bytes;
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode::<Rows>(&huge, |r| r.lens.clone()).is_err());
    }
}
