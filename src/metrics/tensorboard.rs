//! TensorBoard event files, written directly: a TFRecord stream (`u64` length, masked CRC-32C
//! of the length, the bytes, masked CRC-32C of the bytes) of `tensorflow.Event` protocol-buffer
//! messages, each holding scalar summaries. Only the handful of protobuf fields TensorBoard
//! reads for scalars are encoded, so no protobuf toolchain is needed.
//!
//! Fields (tensorflow/core/util/event.proto, summary.proto): `Event.wall_time` = 1 (double),
//! `Event.step` = 2 (int64), `Event.file_version` = 3 (string), `Event.summary` = 5;
//! `Summary.value` = 1; `Summary.Value.tag` = 1 (string), `simple_value` = 2 (float).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant.
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, u64::from(field << 3 | u32::from(wire)));
}

fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    key(out, field, 2);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// An `Event` with a wall time and either a file version or a step with scalars.
fn event(
    wall_time: f64,
    step: Option<i64>,
    version: Option<&str>,
    scalars: &[(&str, f32)],
) -> Vec<u8> {
    let mut e = Vec::new();
    key(&mut e, 1, 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    if let Some(s) = step {
        key(&mut e, 2, 0);
        varint(&mut e, s as u64);
    }
    if let Some(v) = version {
        bytes_field(&mut e, 3, v.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, val) in scalars {
            let mut value = Vec::new();
            bytes_field(&mut value, 1, tag.as_bytes());
            key(&mut value, 2, 5);
            value.extend_from_slice(&val.to_le_bytes());
            bytes_field(&mut summary, 1, &value);
        }
        bytes_field(&mut e, 5, &summary);
    }
    e
}

/// Appends scalar events to `events.out.tfevents.<time>.<host>` in a log folder.
pub struct EventWriter {
    out: BufWriter<File>,
    pub path: PathBuf,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl EventWriter {
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let t = now();
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            t as u64,
            std::process::id()
        ));
        let mut w = Self {
            out: BufWriter::new(File::create(&path)?),
            path,
        };
        w.record(&event(t, None, Some("brain.Event:2"), &[]))?;
        Ok(w)
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc(data).to_le_bytes())
    }

    /// One event at `step` holding every scalar.
    pub fn scalars(&mut self, step: i64, scalars: &[(&str, f32)]) -> std::io::Result<()> {
        self.record(&event(now(), Some(step), None, scalars))?;
        self.out.flush()
    }
}

/// Why an event stream could not be read: which record (1-based), at which byte, and what.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordError {
    pub record: usize,
    pub offset: usize,
    pub message: String,
}

/// One event read back: its step and its `(tag, simple_value)` scalars.
pub type ScalarEvent = (i64, Vec<(String, f32)>);

/// Every record of an event stream as `(step, [(tag, simple_value)])`, in file order; checks
/// both checksums of each record. Events without a step (the file-version header) come back
/// with step 0 and no values.
pub fn read_records(data: &[u8]) -> Result<Vec<ScalarEvent>, RecordError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let start = at;
        let err = |message: &str| RecordError {
            record: out.len() + 1,
            offset: start,
            message: message.to_string(),
        };
        let take = |at: &mut usize, n: usize| -> Result<&[u8], RecordError> {
            let end = at.checked_add(n).filter(|&e| e <= data.len());
            let s = &data[*at..end.ok_or_else(|| err("truncated record"))?];
            *at += n;
            Ok(s)
        };
        let u32le = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let len_bytes = take(&mut at, 8)?;
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
        if u32le(take(&mut at, 4)?) != masked_crc(len_bytes) {
            return Err(err("bad length checksum"));
        }
        let len = usize::try_from(len).map_err(|_| err("record length too large"))?;
        let body = take(&mut at, len)?;
        if u32le(take(&mut at, 4)?) != masked_crc(body) {
            return Err(err("bad data checksum"));
        }
        out.push(parse_event(body).map_err(|m| err(&format!("bad Event message: {m}")))?);
    }
    Ok(out)
}

/// Reads back the scalars of an event file: `(step, tag, value)`; checks every checksum.
/// For tests and `main_ppo` users without TensorBoard at hand.
pub fn read_scalars(path: &Path) -> Result<Vec<(i64, String, f32)>, String> {
    let data = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let records = read_records(&data).map_err(|e| {
        format!(
            "{}, record {} at byte {}: {}",
            path.display(),
            e.record,
            e.offset,
            e.message
        )
    })?;
    Ok(records
        .into_iter()
        .flat_map(|(step, values)| values.into_iter().map(move |(t, v)| (step, t, v)))
        .collect())
}

fn read_varint(b: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at).ok_or("truncated varint")?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Ok(v);
        }
    }
    Err("varint too long".into())
}

/// `n` bytes of `b` from `*at` (advancing it), or "truncated `what`".
fn slice(b: &[u8], at: &mut usize, n: usize, what: &str) -> Result<Vec<u8>, String> {
    let end = at.checked_add(n).filter(|&e| e <= b.len());
    let s = b[*at..end.ok_or(format!("truncated {what}"))?].to_vec();
    *at += n;
    Ok(s)
}

/// Fields of one message: `(field, wire type, payload)`; fixed64/fixed32 payloads as bytes.
fn fields(b: &[u8]) -> Result<Vec<(u32, u8, Vec<u8>)>, String> {
    let mut at = 0;
    let mut out = Vec::new();
    while at < b.len() {
        let k = read_varint(b, &mut at)?;
        let (field, wire) = ((k >> 3) as u32, (k & 7) as u8);
        let payload = match wire {
            0 => read_varint(b, &mut at)?.to_le_bytes().to_vec(),
            1 => slice(b, &mut at, 8, "fixed64")?,
            2 => {
                let n = read_varint(b, &mut at)?;
                let n = usize::try_from(n).map_err(|_| "length too large".to_string())?;
                slice(b, &mut at, n, "bytes")?
            }
            5 => slice(b, &mut at, 4, "fixed32")?,
            w => return Err(format!("unsupported wire type {w}")),
        };
        out.push((field, wire, payload));
    }
    Ok(out)
}

fn parse_event(b: &[u8]) -> Result<ScalarEvent, String> {
    let mut step = 0i64;
    let mut values = Vec::new();
    for (field, _, payload) in fields(b)? {
        match field {
            2 => {
                let b: [u8; 8] = payload
                    .get(..8)
                    .and_then(|b| b.try_into().ok())
                    .ok_or("`step` is not a varint")?;
                step = i64::from_le_bytes(b);
            }
            5 => {
                for (f, _, value) in fields(&payload)? {
                    if f != 1 {
                        continue;
                    }
                    let (mut tag, mut v) = (String::new(), f32::NAN);
                    for (vf, _, p) in fields(&value)? {
                        match vf {
                            1 => tag = String::from_utf8_lossy(&p).into_owned(),
                            2 => {
                                let b: [u8; 4] = p
                                    .get(..4)
                                    .and_then(|b| b.try_into().ok())
                                    .ok_or("`simple_value` is not a float")?;
                                v = f32::from_le_bytes(b);
                            }
                            _ => {}
                        }
                    }
                    values.push((tag, v));
                }
            }
            _ => {}
        }
    }
    Ok((step, values))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_of_the_tfrecord_spec() {
        // CRC-32C check value of "123456789" is 0xE3069283 (RFC 3720 / iSCSI); masking is
        // rotr15 + 0xa282ead8 (tensorflow/core/lib/hash/crc32c.h).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        let want = 0xE306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc(b"123456789"), want);
    }

    #[test]
    fn varint_and_event_encoding_by_hand() {
        let mut v = Vec::new();
        varint(&mut v, 300);
        assert_eq!(v, vec![0xac, 0x02]); // protobuf's documented example
                                         // Event{step: 3, summary{value{tag:"a", simple_value: 1.0}}} with wall time 0.
        let e = event(0.0, Some(3), None, &[("a", 1.0)]);
        let mut want = vec![0x09];
        want.extend_from_slice(&0f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 3, 0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15]);
        want.extend_from_slice(&1f32.to_le_bytes());
        assert_eq!(e, want);
    }

    #[test]
    fn written_events_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(1, &[("critic/score/mean", 0.5), ("actor/lr", 1e-6)])
            .unwrap();
        w.scalars(2, &[("critic/score/mean", 0.75)]).unwrap();
        let got = read_scalars(&w.path).unwrap();
        assert_eq!(
            got,
            vec![
                (1, "critic/score/mean".to_string(), 0.5),
                (1, "actor/lr".to_string(), 1e-6),
                (2, "critic/score/mean".to_string(), 0.75),
            ]
        );
    }

    /// Frames `body` as one TFRecord.
    fn framed(body: &[u8]) -> Vec<u8> {
        let len = (body.len() as u64).to_le_bytes();
        let mut r = len.to_vec();
        r.extend_from_slice(&masked_crc(&len).to_le_bytes());
        r.extend_from_slice(body);
        r.extend_from_slice(&masked_crc(body).to_le_bytes());
        r
    }

    #[test]
    fn malformed_records_are_errors_not_panics() {
        let good = framed(&event(0.0, Some(1), None, &[("a", 1.0)]));
        // `step` (field 2) sent as a length-delimited field: key 0x12, length 1.
        let mut stream = good.clone();
        stream.extend(framed(&[0x12, 1, 7]));
        let e = read_records(&stream).unwrap_err();
        assert_eq!((e.record, e.offset), (2, good.len()));
        assert!(e.message.contains("`step`"), "{}", e.message);
        // A length-delimited field claiming more bytes than the message has.
        let e = read_records(&framed(&[0x2a, 0xff, 0x01])).unwrap_err();
        assert!(e.message.contains("truncated bytes"), "{}", e.message);
        // A record cut short.
        let e = read_records(&good[..good.len() - 2]).unwrap_err();
        assert_eq!((e.record, e.message.as_str()), (1, "truncated record"));
    }
}
