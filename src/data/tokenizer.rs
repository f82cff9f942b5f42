//! The tokenizer side of an HF model directory: `tokenizer.json`, the chat template
//! (`chat_template.jinja`, written by transformers 5, or `tokenizer_config.json`'s
//! `chat_template`, a string or a list of named templates), special tokens, and the EOS / pad ids
//! of `generation_config.json` and `config.json`.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizers::Tokenizer;

use super::template::ChatTemplate;
use super::DataError;

/// Special-token strings a chat template may reference.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub pad: Option<String>,
    pub unk: Option<String>,
}

/// The files of a vision-language model's processor, copied beside a saved tokenizer.
pub const PROCESSOR_FILES: [&str; 4] = [
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
];

/// A tokenizer with its chat template and the ids generation needs.
#[derive(Clone)]
pub struct TokenizerBundle {
    pub tokenizer: Tokenizer,
    /// Jinja source of the model's chat template, if it has one.
    pub chat_template: Option<String>,
    /// Where the chat template came from (for messages).
    pub chat_template_origin: String,
    pub special: SpecialTokens,
    /// Ids that end a response.
    pub eos_token_ids: Vec<u32>,
    /// Id used for padding (the pad token, else the first EOS id).
    pub pad_token_id: u32,
    /// Where the tokenizer was loaded from.
    pub source: PathBuf,
}

impl std::fmt::Debug for TokenizerBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerBundle")
            .field("source", &self.source)
            .field("special", &self.special)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("pad_token_id", &self.pad_token_id)
            .finish_non_exhaustive()
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, DataError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| DataError::File {
        file: path.display().to_string(),
        message: e.to_string(),
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| DataError::File {
            file: path.display().to_string(),
            message: format!("not valid JSON: {e}"),
        })
}

/// A special token in `tokenizer_config.json`: a string or an AddedToken object `{content: ...}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// `eos_token_id` as HF writes it: an int or a list of ints.
fn id_list(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

impl TokenizerBundle {
    /// Loads from an HF model (or tokenizer) directory.
    pub fn from_dir(dir: &Path) -> Result<Self, DataError> {
        let label = dir.display().to_string();
        if !dir.is_dir() {
            return Err(DataError::File {
                file: label,
                message: "not a directory (expected an HF model directory with tokenizer.json)"
                    .into(),
            });
        }
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(DataError::File {
                file: label,
                message: "no tokenizer.json (an HF model directory holds tokenizer.json, tokenizer_config.json and config.json)".into(),
            });
        }
        let tokenizer = Tokenizer::from_file(&tok_path).map_err(|e| DataError::File {
            file: tok_path.display().to_string(),
            message: format!("cannot load tokenizer: {e}"),
        })?;
        let tcfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let special = SpecialTokens {
            bos: token_string(tcfg.get("bos_token")),
            eos: token_string(tcfg.get("eos_token")),
            pad: token_string(tcfg.get("pad_token")),
            unk: token_string(tcfg.get("unk_token")),
        };

        let jinja = dir.join("chat_template.jinja");
        let (chat_template, origin) = if jinja.is_file() {
            let s = std::fs::read_to_string(&jinja).map_err(|e| DataError::File {
                file: jinja.display().to_string(),
                message: e.to_string(),
            })?;
            (Some(s), jinja.display().to_string())
        } else {
            let origin = dir.join("tokenizer_config.json").display().to_string();
            match tcfg.get("chat_template") {
                Some(Value::String(s)) => (Some(s.clone()), origin),
                Some(Value::Array(list)) => {
                    let pick = |name: &str| {
                        list.iter()
                            .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
                            .and_then(|t| t.get("template"))
                            .and_then(Value::as_str)
                    };
                    let t = pick("default").or_else(|| {
                        list.first()
                            .and_then(|t| t.get("template"))
                            .and_then(Value::as_str)
                    });
                    (t.map(str::to_string), origin)
                }
                _ => (None, String::new()),
            }
        };

        let gen = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
        let mcfg = read_json(&dir.join("config.json"))?.unwrap_or(Value::Null);
        let mut eos_token_ids = id_list(gen.get("eos_token_id"));
        if eos_token_ids.is_empty() {
            eos_token_ids = id_list(mcfg.get("eos_token_id"));
        }
        if let Some(id) = special
            .eos
            .as_deref()
            .and_then(|t| tokenizer.token_to_id(t))
        {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let pad_token_id = special
            .pad
            .as_deref()
            .and_then(|t| tokenizer.token_to_id(t))
            .or_else(|| id_list(gen.get("pad_token_id")).first().copied())
            .or_else(|| eos_token_ids.first().copied())
            .unwrap_or(0);
        Ok(Self {
            tokenizer,
            chat_template,
            chat_template_origin: origin,
            special,
            eos_token_ids,
            pad_token_id,
            source: dir.to_path_buf(),
        })
    }

    /// Writes `tokenizer.json`, `tokenizer_config.json` (special tokens and the chat template)
    /// and `chat_template.jinja` into `dir`, so the folder loads with [`TokenizerBundle::from_dir`]
    /// and with HF transformers (a GGUF model's tokenizer becomes an HF one this way); a
    /// vision-language model's processor files beside the tokenizer are copied along.
    pub fn save(&self, dir: &Path) -> Result<(), DataError> {
        let err = |p: &Path, e: String| DataError::File {
            file: p.display().to_string(),
            message: e,
        };
        std::fs::create_dir_all(dir).map_err(|e| err(dir, e.to_string()))?;
        let tok = dir.join("tokenizer.json");
        self.tokenizer
            .save(&tok, false)
            .map_err(|e| err(&tok, e.to_string()))?;
        let mut cfg = serde_json::Map::new();
        for (k, v) in [
            ("bos_token", &self.special.bos),
            ("eos_token", &self.special.eos),
            ("pad_token", &self.special.pad),
            ("unk_token", &self.special.unk),
        ] {
            if let Some(v) = v {
                cfg.insert(k.into(), Value::String(v.clone()));
            }
        }
        cfg.insert(
            "tokenizer_class".into(),
            Value::String("PreTrainedTokenizerFast".into()),
        );
        if let Some(t) = &self.chat_template {
            cfg.insert("chat_template".into(), Value::String(t.clone()));
            let jinja = dir.join("chat_template.jinja");
            std::fs::write(&jinja, t).map_err(|e| err(&jinja, e.to_string()))?;
        }
        let path = dir.join("tokenizer_config.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&Value::Object(cfg)).expect("json"),
        )
        .map_err(|e| err(&path, e.to_string()))?;
        // A vision-language model's processor settings travel with its tokenizer.
        for f in PROCESSOR_FILES {
            let from = self.source.join(f);
            if from.is_file() && self.source != dir {
                std::fs::copy(&from, dir.join(f)).map_err(|e| err(&from, e.to_string()))?;
            }
        }
        Ok(())
    }

    /// The chat template to use: `custom` (actor_rollout_ref.model.custom_chat_template) if
    /// given, else the model's own.
    pub fn template(&self, custom: Option<&str>) -> Result<ChatTemplate, DataError> {
        match (custom, &self.chat_template) {
            (Some(src), _) => ChatTemplate::new(src, self.special.clone(), "actor_rollout_ref.model.custom_chat_template"),
            (None, Some(src)) => ChatTemplate::new(src, self.special.clone(), &self.chat_template_origin),
            (None, None) => Err(DataError::Other(format!(
                "{}: the tokenizer has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json); set actor_rollout_ref.model.custom_chat_template",
                self.source.display()
            ))),
        }
    }

    /// Token ids of `text` as `apply_chat_template(tokenize=True)` produces them: the template
    /// already holds any BOS, so no special tokens are added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// Several texts at once (in parallel).
    pub fn encode_batch(&self, texts: Vec<String>) -> Result<Vec<Vec<u32>>, String> {
        self.tokenizer
            .encode_batch(texts, false)
            .map(|v| v.into_iter().map(|e| e.get_ids().to_vec()).collect())
            .map_err(|e| e.to_string())
    }
}
