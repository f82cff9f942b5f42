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
        "jsonl" => read_jsonl(&std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?)
            .map_err(err)?,
        "json" => {
            let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
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
    let f = File::open(path).map_err(|e| e.to_string())?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(f)
        .map_err(|e| format!("not a readable parquet file: {e}"))?;
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
