//! Rows → rendered, tokenised prompts: sample limits, overlong filtering and truncation
//! (verl's legacy `RLHFDataset` semantics; the newest verl only left-truncates).

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use crate::config::fields::FreeMap;
use crate::config::{AgentLoopName, DataConfig, Truncation};

use super::image::ImageBatch;
use super::numpy_rng::Pcg64;
use super::read::read_rows;
use super::sample::{Need, Sample};
use super::template::ChatTemplate;
use super::tokenizer::TokenizerBundle;
use super::DataError;

/// How one split (train or validation) is built.
#[derive(Debug, Clone)]
pub struct DatasetOptions {
    pub prompt_key: String,
    pub source_key: String,
    /// Keep at most this many rows.
    pub max_samples: Option<u64>,
    /// Draw that subset at random (NumPy's seeded `choice`, as verl) rather than taking the
    /// first rows.
    pub random_subset: bool,
    pub seed: u64,
    pub max_prompt_length: usize,
    pub filter_overlong: bool,
    pub truncation: Truncation,
    pub template_kwargs: FreeMap,
    /// Check only the prompt column (`main_ppo generate`); training and validation need the
    /// reward columns too.
    pub prompts_only: bool,
    /// Which agent loop each row runs, and the tools its template renders (`None`: every
    /// row single-turn, as before agent loops).
    pub agents: Option<AgentRendering>,
    /// A vision-language model's images (`None`: a text model; a row with images is refused).
    pub vision: Option<super::vision::VisionOptions>,
}

/// How rows choose their agent loop and what the tool agent's prompts show.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentRendering {
    /// `rollout.multi_turn.enable`: rows without `agent_name` run the tool agent.
    pub multi_turn: bool,
    /// `rollout.agent.default_agent_loop` (rows without `agent_name`, multi-turn off).
    pub default: AgentLoopName,
    /// The tools' OpenAI schemas, the template's `tools` for tool-agent rows.
    pub tools: Vec<Value>,
    /// The interactions' names (`multi_turn.interaction_config_path`); every tool-agent row
    /// must name one in `extra_info.interaction_kwargs.name` when there are any.
    pub interactions: Vec<String>,
}

impl AgentRendering {
    /// The loop `s` runs: its `agent_name` column, else the default; an `agent_name` that is
    /// not a string or names no loop of ours is an error naming the row.
    pub fn agent_of(&self, s: &Sample) -> Result<AgentLoopName, DataError> {
        let err = |message: String| DataError::Row {
            file: s.file.clone(),
            row: s.row,
            column: "agent_name".into(),
            message,
        };
        match s.raw.get("agent_name") {
            None | Some(Value::Null) if self.multi_turn => Ok(AgentLoopName::ToolAgent),
            None | Some(Value::Null) => Ok(self.default),
            Some(Value::String(n)) => AgentLoopName::parse(n).ok_or_else(|| {
                let known: Vec<&str> = AgentLoopName::ALL.iter().map(|a| a.name()).collect();
                err(format!(
                    "`{n}` is not an agent loop here (known: {})",
                    known.join(", ")
                ))
            }),
            Some(other) => Err(err(format!("expected a string, found {other}"))),
        }
    }

    /// A tool-agent row of a run with interactions names one of them in
    /// `extra_info.interaction_kwargs.name` (verl stops the run at such a row's rollout).
    pub fn check_interaction(&self, s: &Sample) -> Result<(), DataError> {
        if self.interactions.is_empty() {
            return Ok(());
        }
        let err = |message: String| DataError::Row {
            file: s.file.clone(),
            row: s.row,
            column: "extra_info.interaction_kwargs".into(),
            message,
        };
        let known = self.interactions.join(", ");
        match s.extra_info.get("interaction_kwargs") {
            Some(Value::Object(k)) => match k.get("name") {
                Some(Value::String(n)) if self.interactions.contains(n) => Ok(()),
                Some(Value::String(n)) => Err(err(format!(
                    "names the interaction `{n}`, which the interaction config does not define (it defines: {known})"
                ))),
                _ => Err(err(format!(
                    "has no `name` string; it must name the interaction this row talks to (one of: {known})"
                ))),
            },
            _ => Err(err(format!(
                "is missing: with actor_rollout_ref.rollout.multi_turn.interaction_config_path set, every tool-agent row needs `extra_info.interaction_kwargs` with the interaction's `name` (one of: {known}) and what it reads (the GSM8K interaction: `ground_truth`)"
            ))),
        }
    }
}

impl DatasetOptions {
    /// The training split's options.
    pub fn train(cfg: &DataConfig, prompt_length: usize) -> Self {
        Self::new(cfg, prompt_length, cfg.train_max_samples, cfg.shuffle)
    }

    /// The validation split's options. As in verl (`RLHFDataset` is built from the same `data`
    /// config for both splits), `data.shuffle` decides whether `val_max_samples` keeps a random
    /// subset; `validation_shuffle` plays no part in it.
    pub fn val(cfg: &DataConfig, prompt_length: usize) -> Self {
        Self::new(cfg, prompt_length, cfg.val_max_samples, cfg.shuffle)
    }

    fn new(
        cfg: &DataConfig,
        prompt_length: usize,
        max_samples: Option<u64>,
        random_subset: bool,
    ) -> Self {
        Self {
            prompt_key: cfg.prompt_key.clone(),
            source_key: cfg.reward_fn_key.clone(),
            max_samples,
            random_subset,
            seed: cfg.seed.unwrap_or(1),
            max_prompt_length: prompt_length,
            filter_overlong: cfg.filter_overlong_prompts,
            truncation: cfg.truncation,
            template_kwargs: cfg.apply_chat_template_kwargs.clone(),
            prompts_only: false,
            agents: None,
            vision: None,
        }
    }
}

/// Reads every file, checks each row, and applies the sample limit.
pub fn load_samples(files: &[String], opts: &DatasetOptions) -> Result<Vec<Sample>, DataError> {
    if files.is_empty() {
        return Err(DataError::Other("no data files given".into()));
    }
    let mut samples = Vec::new();
    for f in files {
        let path = crate::util::expand_home(f);
        let rows = read_rows(Path::new(&path))?;
        let need = if opts.prompts_only {
            Need::Prompt
        } else {
            Need::All
        };
        for (i, row) in rows.into_iter().enumerate() {
            let (p, s) = (&opts.prompt_key, &opts.source_key);
            samples.push(Sample::parse(&path, i, row, p, s, need)?);
        }
    }
    if let Some(max) = opts.max_samples {
        let max = max as usize;
        if max < samples.len() {
            if opts.random_subset {
                // verl: `np.random.default_rng(seed).choice(total, size=max, replace=False)`,
                // rows in the order drawn.
                let order =
                    Pcg64::from_seed(opts.seed).choice_without_replacement(samples.len(), max);
                let mut slots: Vec<Option<Sample>> = samples.into_iter().map(Some).collect();
                samples = order
                    .iter()
                    .map(|&i| slots[i].take().expect("choice draws each index once"))
                    .collect();
            } else {
                samples.truncate(max);
            }
        }
    }
    Ok(samples)
}

/// Tokenised prompts ready for batching.
#[derive(Debug, Clone)]
pub struct PromptDataset {
    pub samples: Vec<Sample>,
    /// Prompt token ids (chat template applied, truncated to the prompt budget), one per sample.
    pub prompt_ids: Vec<Vec<u32>>,
    /// Rows dropped because they were longer than the prompt budget (filter_overlong_prompts).
    pub filtered_overlong: usize,
    /// Rows shortened by the truncation rule.
    pub truncated: usize,
    /// The agent loop of each sample.
    pub agents: Vec<AgentLoopName>,
    /// Each sample's processed images (vision-language models; empty otherwise).
    pub images: super::vision::RowImageBatches,
}

impl PromptDataset {
    /// Renders each sample's prompt with `template`, tokenises it, then filters or truncates.
    pub fn build(
        samples: Vec<Sample>,
        tokenizer: &TokenizerBundle,
        template: &ChatTemplate,
        opts: &DatasetOptions,
    ) -> Result<Self, DataError> {
        let mut texts = Vec::with_capacity(samples.len());
        let mut render_failed = vec![false; samples.len()];
        let mut agents = Vec::with_capacity(samples.len());
        let mut images = Vec::with_capacity(samples.len());
        let mut with_tools = opts.template_kwargs.clone();
        if let Some(a) = opts.agents.as_ref().filter(|a| !a.tools.is_empty()) {
            with_tools.insert("tools".into(), Value::Array(a.tools.clone()));
        }
        for (i, s) in samples.iter().enumerate() {
            let agent = match &opts.agents {
                Some(a) => a.agent_of(s)?,
                None => AgentLoopName::SingleTurnAgent,
            };
            if let (Some(a), AgentLoopName::ToolAgent) = (&opts.agents, agent) {
                a.check_interaction(s)?;
            }
            agents.push(agent);
            let kwargs = match agent {
                AgentLoopName::ToolAgent => &with_tools,
                AgentLoopName::SingleTurnAgent => &opts.template_kwargs,
            };
            let (messages, batch) = row_images(s, opts)?;
            images.push(batch);
            match template.render(&messages, true, kwargs) {
                Ok(t) => texts.push(expand(s, opts, t, images.last().expect("pushed"))?),
                // verl's filter counts a prompt the template rejects as too long.
                Err(_) if opts.filter_overlong => {
                    render_failed[i] = true;
                    texts.push(String::new());
                }
                Err(e) => {
                    return Err(DataError::Row {
                        file: s.file.clone(),
                        row: s.row,
                        column: opts.prompt_key.clone(),
                        message: format!("the chat template fails on this prompt: {e}"),
                    })
                }
            }
        }
        let ids = tokenizer.encode_batch(texts).map_err(|e| {
            DataError::Other(format!("tokenizer {}: {e}", tokenizer.source.display()))
        })?;
        let mut out = PromptDataset {
            samples: Vec::new(),
            prompt_ids: Vec::new(),
            filtered_overlong: 0,
            truncated: 0,
            agents: Vec::new(),
            images: Vec::new(),
        };
        let max = opts.max_prompt_length;
        for ((((s, ids), failed), agent), batch) in samples
            .into_iter()
            .zip(ids)
            .zip(render_failed)
            .zip(agents)
            .zip(images)
        {
            if opts.filter_overlong && (failed || ids.len() > max) {
                out.filtered_overlong += 1;
                continue;
            }
            if batch.is_some() && ids.len() > max {
                return Err(DataError::Row {
                    file: s.file.clone(),
                    row: s.row,
                    column: opts.prompt_key.clone(),
                    message: format!(
                        "the prompt with its image tokens is {} tokens, longer than data.max_prompt_length ({max}); a prompt with images cannot be truncated (its image tokens must all stay): raise it, lower data.mm_processor_kwargs.max_pixels, or set data.filter_overlong_prompts=True",
                        ids.len()
                    ),
                });
            }
            let ids = if ids.len() > max {
                out.truncated += 1;
                truncate(&ids, max, opts.truncation).ok_or_else(|| DataError::Row {
                    file: s.file.clone(),
                    row: s.row,
                    column: opts.prompt_key.clone(),
                    message: format!(
                        "the prompt is {} tokens after the chat template, longer than data.max_prompt_length ({max}); \
                         raise it, set data.filter_overlong_prompts=True, or set data.truncation to left, right or middle",
                        ids.len()
                    ),
                })?
            } else {
                ids
            };
            out.samples.push(s);
            out.prompt_ids.push(ids);
            out.agents.push(agent);
            out.images.push(batch);
        }
        if out.images.iter().all(Option::is_none) {
            out.images.clear();
        }
        if out.samples.is_empty() {
            return Err(DataError::Other(format!(
                "no prompts left after filtering: all {} are longer than {max} tokens",
                out.filtered_overlong
            )));
        }
        Ok(out)
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// The messages of `s` to render and its processed images: with a vision-language model's
/// options, its images (column `data.image_key`) fill the `<image>` markers; without, a row
/// with images is refused (a text model would train on the prompt without them). Errors name
/// the row and column.
fn row_images(
    s: &Sample,
    opts: &DatasetOptions,
) -> Result<(Vec<Value>, Option<Arc<ImageBatch>>), DataError> {
    let err = |column: &str, message: String| DataError::Row {
        file: s.file.clone(),
        row: s.row,
        column: column.to_string(),
        message,
    };
    let Some(v) = &opts.vision else {
        for key in ["images", "videos"] {
            let has = s
                .raw
                .get(key)
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty());
            if has
                && s.prompt.iter().any(|m| {
                    m.get("content")
                        .and_then(Value::as_str)
                        .is_some_and(|c| c.contains("<image>") || c.contains("<video>"))
                })
            {
                return Err(err(key, "the row has images or videos but the model is a text model (no preprocessor_config.json in its folder): use a vision-language model, or drop the column".into()));
            }
        }
        return Ok((s.prompt.clone(), None));
    };
    let videos = s
        .raw
        .get(&v.video_key)
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty());
    if videos {
        return Err(err(
            &v.video_key,
            "video input is not supported (images only)".into(),
        ));
    }
    let entries =
        super::vision::image_entries(&s.raw, &v.image_key).map_err(|m| err(&v.image_key, m))?;
    let messages = super::vision::messages_with_images(&s.prompt, entries.len())
        .map_err(|m| err(&opts.prompt_key, m))?;
    if entries.is_empty() {
        return Ok((messages, None));
    }
    let batch = v.process(&entries).map_err(|m| err(&v.image_key, m))?;
    Ok((messages, Some(Arc::new(batch))))
}

/// `rendered` with the row's image placeholders expanded (unchanged without images).
fn expand(
    s: &Sample,
    opts: &DatasetOptions,
    rendered: String,
    batch: &Option<Arc<ImageBatch>>,
) -> Result<String, DataError> {
    match (&opts.vision, batch) {
        (Some(v), Some(b)) => v.expand(&rendered, b).map_err(|message| DataError::Row {
            file: s.file.clone(),
            row: s.row,
            column: opts.prompt_key.clone(),
            message: format!("the chat template's image placeholders: {message}"),
        }),
        _ => Ok(rendered),
    }
}

/// Cuts `ids` to `max` tokens: `left` keeps the end, `right` the start, `middle` the first
/// `max / 2` and the last `max - max / 2`; `error` refuses.
pub fn truncate(ids: &[u32], max: usize, mode: Truncation) -> Option<Vec<u32>> {
    if ids.len() <= max {
        return Some(ids.to_vec());
    }
    match mode {
        Truncation::Error => None,
        Truncation::Left => Some(ids[ids.len() - max..].to_vec()),
        Truncation::Right => Some(ids[..max].to_vec()),
        Truncation::Middle => {
            let head = max / 2;
            let tail = max - head;
            let mut v = ids[..head].to_vec();
            v.extend_from_slice(&ids[ids.len() - tail..]);
            Some(v)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_modes() {
        let ids: Vec<u32> = (0..10).collect();
        assert_eq!(
            truncate(&ids, 4, Truncation::Left).unwrap(),
            vec![6, 7, 8, 9]
        );
        assert_eq!(
            truncate(&ids, 4, Truncation::Right).unwrap(),
            vec![0, 1, 2, 3]
        );
        // max 5: first 5/2 = 2, last 5 - 2 = 3.
        assert_eq!(
            truncate(&ids, 5, Truncation::Middle).unwrap(),
            vec![0, 1, 7, 8, 9]
        );
        assert!(truncate(&ids, 4, Truncation::Error).is_none());
        assert_eq!(truncate(&ids, 10, Truncation::Error).unwrap(), ids);
    }
}

#[cfg(test)]
mod interaction_tests {
    use serde_json::json;

    use super::*;

    fn sample(extra_info: Value) -> Sample {
        Sample {
            file: "train.jsonl".into(),
            row: 3,
            data_source: "openai/gsm8k".into(),
            prompt: vec![json!({"role": "user", "content": "q"})],
            ground_truth: json!("7"),
            extra_info,
            ability: None,
            raw: json!({}),
        }
    }

    /// With interactions configured, a tool-agent row must name one of them in
    /// `extra_info.interaction_kwargs.name`; each way of not doing so is an error naming the
    /// file, row and column and what is configured. Without interactions nothing is asked.
    #[test]
    fn rows_must_name_a_configured_interaction() {
        let mut r = AgentRendering {
            multi_turn: true,
            default: AgentLoopName::ToolAgent,
            tools: Vec::new(),
            interactions: vec!["gsm8k".into()],
        };
        let ok = json!({"interaction_kwargs": {"name": "gsm8k", "ground_truth": "7"}});
        assert!(r.check_interaction(&sample(ok)).is_ok());
        for (extra, says) in [
            (json!({}), "is missing"),
            (
                json!({"interaction_kwargs": {"ground_truth": "7"}}),
                "has no `name`",
            ),
            (
                json!({"interaction_kwargs": {"name": "quiz"}}),
                "`quiz`, which the interaction config does not define (it defines: gsm8k)",
            ),
        ] {
            let e = r.check_interaction(&sample(extra)).unwrap_err().to_string();
            assert!(
                e.starts_with("train.jsonl, row 3, column `extra_info.interaction_kwargs`: ")
                    && e.contains(says),
                "{e}"
            );
        }
        r.interactions.clear();
        assert!(r.check_interaction(&sample(json!({}))).is_ok());
    }
}
