//! Reads verl dataset files into rows (JSON objects): `.parquet` through arrow, `.jsonl`
//! (one object per line) and `.json` (a list of objects, or JSON lines as HF `datasets` accepts).

use std::fs::File;
use std::path::Path;

use arrow_json::writer::{JsonArray, WriterBuilder};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::Value;

use super::DataError;

/// All rows of one file, in order. Each row is a JSON object with the file's columns.
pub fn read_rows(path: &Path) -> Result<Vec<Value>, DataError> {
    let file = path.display().to_string();
    let err = |message: String| DataError::File {
        file: file.clone(),
        message,
    };
    if !path.exists() {
        return Err(err("no such file".into()));
    }
    if path.is_dir() {
        return Err(err(
            "is a directory, expected a .parquet, .jsonl or .json file".into(),
        ));
    }
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let rows = match ext.as_str() {
        "parquet" => read_parquet(path).map_err(err)?,
        "jsonl" => read_jsonl(&read_text(path).map_err(err)?).map_err(err)?,
        "json" => {
            let text = read_text(path).map_err(err)?;
            match serde_json::from_str::<Value>(&text) {
                Ok(Value::Array(rows)) => rows,
                Ok(obj @ Value::Object(_)) => vec![obj],
                Ok(other) => {
                    return Err(err(format!(
                        "expected a list of row objects, found {}",
                        kind(&other)
                    )))
                }
                Err(_) => read_jsonl(&text)
                    .map_err(|m| err(format!("neither a JSON list nor JSON lines: {m}")))?,
            }
        }
        other => {
            return Err(err(format!(
                "unsupported file type `.{other}`; verl datasets are .parquet, .jsonl or .json"
            )))
        }
    };
    if rows.is_empty() {
        return Err(err("the file has no rows".into()));
    }
    for (i, row) in rows.iter().enumerate() {
        if !row.is_object() {
            return Err(DataError::Row {
                file: file.clone(),
                row: i,
                column: "*".into(),
                message: format!("a row must be an object of columns, found {}", kind(row)),
            });
        }
    }
    Ok(rows)
}

fn read_parquet(path: &Path) -> Result<Vec<Value>, String> {
    // The parquet reader asserts on some damaged metadata instead of returning an error: the
    // layout is checked first, and any panic left is still reported as a damaged file.
    std::panic::catch_unwind(|| read_parquet_checked(path)).unwrap_or_else(|p| {
        let why = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(format!("not a readable parquet file (damaged: {why})"))
    })
}

fn read_parquet_checked(path: &Path) -> Result<Vec<Value>, String> {
    let f = File::open(path).map_err(|e| e.to_string())?;
    let file_len = f.metadata().map_err(|e| e.to_string())?.len();
    let builder = ParquetRecordBatchReaderBuilder::try_new(f)
        .map_err(|e| format!("not a readable parquet file: {e}"))?;
    for (g, group) in builder.metadata().row_groups().iter().enumerate() {
        for col in group.columns() {
            let start = col
                .dictionary_page_offset()
                .unwrap_or_else(|| col.data_page_offset());
            let len = col.compressed_size();
            let fits = start >= 0
                && len >= 0
                && (start as u64)
                    .checked_add(len as u64)
                    .is_some_and(|end| end <= file_len);
            if !fits {
                return Err(format!(
                    "not a readable parquet file: row group {g}, column `{}` claims bytes {start}..{start}+{len} of a {file_len}-byte file",
                    col.column_path()
                ));
            }
        }
    }
    let reader = builder
        .build()
        .map_err(|e| format!("not a readable parquet file: {e}"))?;
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| format!("corrupt parquet data: {e}"))?;
        let mut buf = Vec::new();
        let mut writer = WriterBuilder::new()
            .with_explicit_nulls(true)
            .build::<_, JsonArray>(&mut buf);
        writer
            .write(&batch)
            .map_err(|e| format!("cannot convert a column to JSON: {e}"))?;
        writer
            .finish()
            .map_err(|e| format!("cannot convert a column to JSON: {e}"))?;
        drop(writer);
        if buf.is_empty() {
            continue;
        }
        let Value::Array(batch_rows) =
            serde_json::from_slice::<Value>(&buf).map_err(|e| e.to_string())?
        else {
            return Err("internal: arrow-json did not produce a list".into());
        };
        rows.extend(batch_rows);
    }
    Ok(rows)
}

/// The file as UTF-8 text; bytes that are not name the line (1-based) and the byte offset of
/// the first bad byte, so the row can be found and fixed.
fn read_text(path: &Path) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    utf8_text(bytes)
}

fn utf8_text(bytes: Vec<u8>) -> Result<String, String> {
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let raw = e.as_bytes();
        let line = raw[..at].iter().filter(|b| **b == b'\n').count() + 1;
        format!(
            "line {line}: not UTF-8 text (invalid byte 0x{:02x} at byte offset {at}); JSON rows must be UTF-8",
            raw[at]
        )
    })
}

fn read_jsonl(text: &str) -> Result<Vec<Value>, String> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .map_err(|e| format!("line {}: not valid JSON: {e}", i + 1))?;
        rows.push(v);
    }
    Ok(rows)
}

/// The JSON type of a value, for messages.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_utf8_rows_name_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        for ext in ["jsonl", "json"] {
            let p = dir.path().join(format!("rows.{ext}"));
            let mut bytes = b"{\"a\": 1}\n{\"a\": 2}\n{\"a\": \"".to_vec();
            bytes.extend_from_slice(&[0xc3, 0x28]); // a lead byte without its continuation
            bytes.extend_from_slice(b"\"}\n");
            std::fs::write(&p, &bytes).unwrap();
            let e = read_rows(&p).unwrap_err().to_string();
            assert!(
                e.contains(&p.display().to_string()) && e.contains("line 3") && e.contains("UTF-8"),
                "{e}"
            );
        }
    }

    /// A small verl-style parquet file, written by arrow.
    fn small_parquet() -> Vec<u8> {
        use std::sync::Arc;
        let rows: Vec<Value> = (0..6)
            .map(|i| {
                serde_json::json!({
                    "data_source": "openai/gsm8k",
                    "prompt": [{"role": "user", "content": format!("What is {i} + {i}?")}],
                    "reward_model": {"style": "rule", "ground_truth": (2 * i).to_string()},
                    "extra_info": {"index": i},
                })
            })
            .collect();
        let schema = arrow_json::reader::infer_json_schema_from_iterator(
            rows.iter().map(Ok::<_, arrow_schema::ArrowError>),
        )
        .unwrap();
        let schema = Arc::new(schema);
        let mut decoder = arrow_json::ReaderBuilder::new(schema.clone())
            .build_decoder()
            .unwrap();
        decoder.serialize(&rows).unwrap();
        let mut buf = Vec::new();
        let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, schema, None).unwrap();
        while let Some(b) = decoder.flush().unwrap() {
            w.write(&b).unwrap();
        }
        w.close().unwrap();
        buf
    }

    /// Bytes of JSON-lines-like text: objects, lists, scalars, broken syntax, non-UTF-8 bytes.
    fn jsonish() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let piece = prop_oneof![
            Just(b"{\"data_source\": \"openai/gsm8k\", \"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}]}".to_vec()),
            Just(b"{\"a\": 1}".to_vec()),
            Just(b"[1, 2]".to_vec()),
            Just(b"3".to_vec()),
            Just(b"null".to_vec()),
            Just(b"{".to_vec()),
            Just(b"}".to_vec()),
            Just(b"\"".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(vec![0xff]),
            Just(vec![0xc3]),
            Just(vec![0xef, 0xbb, 0xbf]),
            Just(b"\\u0000".to_vec()),
            Just(b"1e999".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..6),
        ];
        proptest::collection::vec(piece, 0..20).prop_map(|v| v.concat())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

        /// JSONL and JSON files of any bytes: rows that are all objects, or an error naming
        /// the file; never a panic.
        #[test]
        fn any_json_bytes_give_rows_or_an_error_naming_the_file(bytes in jsonish(), jsonl in proptest::prelude::any::<bool>()) {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join(if jsonl { "rows.jsonl" } else { "rows.json" });
            std::fs::write(&p, &bytes).unwrap();
            match read_rows(&p) {
                Ok(rows) => proptest::prop_assert!(!rows.is_empty() && rows.iter().all(Value::is_object)),
                Err(e) => {
                    let e = e.to_string();
                    proptest::prop_assert!(e.contains(&p.display().to_string()), "{}", e);
                }
            }
        }

        /// A real parquet file with bytes overwritten and/or cut short: rows, or an error
        /// naming the file; never a panic or an abort.
        #[test]
        fn damaged_parquet_gives_rows_or_an_error_naming_the_file(
            edits in proptest::collection::vec((proptest::prelude::any::<proptest::sample::Index>(), proptest::prelude::any::<u8>()), 0..6),
            cut in proptest::option::of(proptest::prelude::any::<proptest::sample::Index>()),
        ) {
            let mut bytes = small_parquet();
            for (at, b) in &edits {
                let i = at.index(bytes.len());
                bytes[i] = *b;
            }
            if let Some(c) = cut {
                bytes.truncate(c.index(bytes.len()));
            }
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("rows.parquet");
            std::fs::write(&p, &bytes).unwrap();
            match read_rows(&p) {
                Ok(rows) => proptest::prop_assert!(rows.iter().all(Value::is_object)),
                Err(e) => {
                    let e = e.to_string();
                    proptest::prop_assert!(e.contains(&p.display().to_string()), "{}", e);
                }
            }
        }
    }

    #[test]
    fn the_undamaged_parquet_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("rows.parquet");
        std::fs::write(&p, small_parquet()).unwrap();
        let rows = read_rows(&p).unwrap();
        assert_eq!(rows.len(), 6);
        assert_eq!(rows[3]["reward_model"]["ground_truth"], "6");
    }

    #[test]
    fn utf8_text_offsets_are_exact() {
        // Hand-counted: "ab\n" is 3 bytes, then 'c', then the bad byte at offset 4 on line 2.
        let e = utf8_text(b"ab\nc\xffd".to_vec()).unwrap_err();
        assert!(
            e.contains("line 2") && e.contains("offset 4") && e.contains("0xff"),
            "{e}"
        );
        assert_eq!(utf8_text("é\n".as_bytes().to_vec()).unwrap(), "é\n");
    }
}
