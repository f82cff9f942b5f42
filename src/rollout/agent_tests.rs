use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use serde_json::{json, Map, Value};

use super::*;
use crate::config::{MultiTurnConfig, SanityCheckMode, ToolFormat, TruncateSide};
use crate::data::TokenizerBundle;
use crate::rollout::StopReason;

/// A tool runner scripted in Rust: `echo` answers `echo:<arguments>` with reward 0.5 after
/// `delay`; `boom` fails; it records every call.
struct Script {
    calls: Mutex<Vec<ToolCall>>,
}

impl ToolRunner for Script {
    fn schemas(&self) -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {}}}}),
        ]
    }
    fn submit(&self, call: ToolCall, done: Sender<ToolOutcome>) {
        self.calls.lock().unwrap().push(call.clone());
        std::thread::spawn(move || {
            let o = match call.name.as_str() {
                "echo" => ToolOutcome {
                    key: call.key,
                    text: format!("echo:{}", call.arguments),
                    reward: Some(0.5),
                    error: None,
                    terminate: false,
                },
                _ => ToolOutcome {
                    key: call.key,
                    text: "Error executing tool 'boom': it broke".into(),
                    reward: None,
                    error: Some("it broke".into()),
                    terminate: false,
                },
            };
            let _ = done.send(o);
        });
    }
}

fn bundle() -> (tempfile::TempDir, TokenizerBundle) {
    let dir = tempfile::tempdir().unwrap();
    crate::testing::write_tokenizer_dir(dir.path()).unwrap();
    let tok = TokenizerBundle::from_dir(dir.path()).unwrap();
    (dir, tok)
}

fn context(tok: &TokenizerBundle, runner: Arc<Script>, mt: &MultiTurnConfig) -> AgentContext {
    AgentContext::new(
        Arc::new(tok.clone()),
        Arc::new(tok.template(None).unwrap()),
        Map::new(),
        runner,
        AgentSettings::new(mt),
    )
    .unwrap()
}

fn ids(tok: &TokenizerBundle, text: &str) -> Vec<u32> {
    tok.encode(text).unwrap()
}

/// One conversation through the loop with hand-made model turns: the tool turn's ids are the
/// ChatML rendering written out by hand (the newline the template puts after `<|im_end|>`, the
/// tool message, the generation prompt), their mask is 0 and the model's tokens' 1; the tool
/// saw the row's create_kwargs and the parsed arguments; at most `max_parallel_calls` run; an
/// overlong text is cut as `tool_response_truncate_side` says; the tools' rewards and errors
/// are counted; a turn without calls ends the conversation.
#[test]
fn a_tool_turn_appends_the_templates_ids_with_mask_zero() {
    let (_d, tok) = bundle();
    let runner = Arc::new(Script {
        calls: Mutex::new(Vec::new()),
    });
    let mt = MultiTurnConfig {
        max_parallel_calls: 2,
        max_tool_response_length: 12,
        tool_response_truncate_side: TruncateSide::Right,
        format: ToolFormat::Hermes,
        ..MultiTurnConfig::default()
    };
    let ctx = context(&tok, runner.clone(), &mt);
    let im_end = 258;
    let turn1_text = "ok<tool_call>{\"name\": \"echo\", \"arguments\": {\"x\": 1}}</tool_call><tool_call>{\"name\": \"boom\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"echo\", \"arguments\": {\"x\": 3}}</tool_call>";
    let mut turn1 = ids(&tok, turn1_text);
    turn1.push(im_end);
    let conv = Conversation {
        messages: vec![json!({"role": "user", "content": "hi"})],
        tools_kwargs: json!({"echo": {"create_kwargs": {"ground_truth": "7"}}}),
        tool_agent: true,
        interaction: None,
    };
    let prompt = vec![1, 2, 3];
    let mut agent = ToolAgent::new(&ctx, vec![conv], vec![prompt], 400, vec![im_end, 256]);
    let mut out = Rollout {
        responses: vec![turn1.clone()],
        log_probs: vec![vec![-1.0; turn1.len()]],
        stop: vec![StopReason::Eos],
    };
    assert!(
        agent.turn_ended(0, &out),
        "a turn with calls waits for them"
    );
    let ready = agent.ready(true);
    let (row, appended) = (ready[0].0, ready[0].1.clone().expect("continues"));
    assert_eq!(row, 0);
    // Two calls ran (max_parallel_calls), in order; the third was dropped.
    let calls = runner.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 2);
    assert_eq!(
        (calls[0].name.as_str(), calls[0].arguments.as_str()),
        ("echo", "{\"x\":1}")
    );
    assert_eq!(calls[0].create_kwargs, json!({"ground_truth": "7"}));
    assert_eq!(calls[1].create_kwargs, json!({}));
    // "echo:{"x":1}" is 12 characters: kept whole; the error text is cut to 12 + marker.
    let expected = [
        "\n".to_string(),
        "<|im_start|>tool\necho:{\"x\":1}<|im_end|>\n".into(),
        "<|im_start|>tool\nError execut...(truncated)<|im_end|>\n".into(),
        "<|im_start|>assistant\n".into(),
    ]
    .concat();
    assert_eq!(appended, ids(&tok, &expected));
    // The scheduler appends them; the model's second turn calls nothing.
    out.responses[0].extend(&appended);
    let turn2 = [ids(&tok, "72"), vec![im_end]].concat();
    out.responses[0].extend(&turn2);
    assert!(!agent.turn_ended(0, &out), "no call: the conversation ends");
    let ep = agent.finish(&mut out).remove(0);
    let want_mask: Vec<u8> = [
        vec![1; turn1.len()],
        vec![0; appended.len()],
        vec![1; turn2.len()],
    ]
    .concat();
    assert_eq!(ep.mask, want_mask);
    assert_eq!(
        (ep.assistant_turns, ep.user_turns, ep.num_turns()),
        (2, 1, 4)
    );
    assert_eq!((ep.tool_calls, ep.tool_errors), (2, 1));
    assert_eq!(ep.tool_rewards, vec![0.5]);
    assert_eq!(ep.messages.len(), 5, "{:?}", ep.messages);
    assert_eq!(
        ep.messages[1]["tool_calls"][0]["function"]["arguments"],
        json!({"x": 1})
    );
}

/// Limits end a conversation: a tool turn that would reach the response budget is not
/// appended, and `max_assistant_turns` stops before calling.
#[test]
fn budgets_and_turn_limits_end_the_conversation() {
    let (_d, tok) = bundle();
    let runner = Arc::new(Script {
        calls: Mutex::new(Vec::new()),
    });
    let call = [
        ids(
            &tok,
            "<tool_call>{\"name\": \"echo\", \"arguments\": {}}</tool_call>",
        ),
        vec![258],
    ]
    .concat();
    let conv = || Conversation {
        messages: vec![json!({"role": "user", "content": "hi"})],
        tools_kwargs: json!({}),
        tool_agent: true,
        interaction: None,
    };
    let mut out = Rollout {
        responses: vec![call.clone()],
        log_probs: vec![vec![0.0; call.len()]],
        stop: vec![StopReason::Eos],
    };
    // Room for the call but not for the tool turn after it.
    let ctx = context(&tok, runner.clone(), &MultiTurnConfig::default());
    let mut a = ToolAgent::new(&ctx, vec![conv()], vec![vec![1]], call.len() + 5, vec![258]);
    assert!(a.turn_ended(0, &out));
    assert_eq!(a.ready(true), vec![(0, None)]);
    // max_assistant_turns = 1: the first turn is the last; its call never runs.
    let mt = MultiTurnConfig {
        max_assistant_turns: Some(1),
        ..MultiTurnConfig::default()
    };
    let before = runner.calls.lock().unwrap().len();
    let ctx = context(&tok, runner.clone(), &mt);
    let mut a = ToolAgent::new(&ctx, vec![conv()], vec![vec![1]], 500, vec![258]);
    assert!(!a.turn_ended(0, &out));
    assert_eq!(runner.calls.lock().unwrap().len(), before);
    // A single-turn row never waits.
    let mut a = ToolAgent::new(
        &ctx,
        vec![Conversation {
            tool_agent: false,
            ..conv()
        }],
        vec![vec![1]],
        500,
        vec![258],
    );
    assert!(!a.turn_ended(0, &out));
    assert_eq!(a.finish(&mut out)[0].mask, vec![1; call.len()]);
}

/// The turn limits as verl reads them (`if limit and turns >= limit`), each value given as a
/// command-line override: null and 0 are no limit (the call of the first turn runs), 1 ends
/// after the first turn, and a negative value is reached at once (the call never runs).
#[test]
fn turn_limits_read_zero_and_null_as_no_limit_and_a_negative_one_as_reached() {
    let (_d, tok) = bundle();
    let call = [
        ids(
            &tok,
            "<tool_call>{\"name\": \"echo\", \"arguments\": {}}</tool_call>",
        ),
        vec![258],
    ]
    .concat();
    let out = Rollout {
        responses: vec![call.clone()],
        log_probs: vec![vec![0.0; call.len()]],
        stop: vec![StopReason::Eos],
    };
    for key in ["max_assistant_turns", "max_user_turns"] {
        for (value, runs) in [
            ("null", true),
            ("0", true),
            ("1", key == "max_user_turns"),
            ("-1", false),
            ("-5", false),
        ] {
            let cfg = crate::config::load(
                &crate::config::ConfigSource::Builtin,
                &[format!(
                    "actor_rollout_ref.rollout.multi_turn.{key}={value}"
                )],
            )
            .unwrap()
            .config;
            let runner = Arc::new(Script {
                calls: Mutex::new(Vec::new()),
            });
            let ctx = context(
                &tok,
                runner.clone(),
                &cfg.actor_rollout_ref.rollout.multi_turn,
            );
            let conv = Conversation {
                messages: vec![json!({"role": "user", "content": "hi"})],
                tools_kwargs: json!({}),
                tool_agent: true,
                interaction: None,
            };
            let mut a = ToolAgent::new(&ctx, vec![conv], vec![vec![1]], 500, vec![258]);
            assert_eq!(a.turn_ended(0, &out), runs, "{key}={value}");
            assert_eq!(
                runner.calls.lock().unwrap().len(),
                usize::from(runs),
                "{key}={value}"
            );
        }
    }
}

/// verl's truncation of tool texts, written out by hand.
#[test]
fn tool_texts_are_cut_as_verl_cuts_them() {
    let t = "abcdefghij";
    assert_eq!(truncate_tool_text(t, 10, TruncateSide::Left), t);
    assert_eq!(
        truncate_tool_text(t, 4, TruncateSide::Left),
        "(truncated)...ghij"
    );
    assert_eq!(
        truncate_tool_text(t, 4, TruncateSide::Right),
        "abcd...(truncated)"
    );
    assert_eq!(
        truncate_tool_text(t, 4, TruncateSide::Middle),
        "ab...(truncated)...ij"
    );
    // A limit of 0 (or 1 in the middle) as Python slices it: `text[-0:]` is the whole text.
    assert_eq!(
        truncate_tool_text(t, 0, TruncateSide::Left),
        "(truncated)...abcdefghij"
    );
    assert_eq!(
        truncate_tool_text(t, 0, TruncateSide::Right),
        "...(truncated)"
    );
    assert_eq!(
        truncate_tool_text(t, 1, TruncateSide::Middle),
        "...(truncated)...abcdefghij"
    );
    assert_eq!(truncate_tool_text("", 0, TruncateSide::Left), "");
}

/// `tokenization_sanity_check_mode` on hand-made conversations: ids that are the conversation
/// tokenised at once pass; a response whose text is not the conversation's is reported with
/// the token index and both texts; a difference only in surrounding whitespace passes under
/// `ignore_strippable` and not under `strict`; the same text in other tokens (a tokenizer with
/// the merge `o k` tokenises "ok" as one id, the model wrote two) is reported with both id
/// runs.
#[test]
fn the_sanity_check_reports_where_turn_by_turn_ids_differ() {
    let (dir, tok) = bundle();
    let runner = Arc::new(Script {
        calls: Mutex::new(Vec::new()),
    });
    let strict = MultiTurnConfig::default();
    let ctx = context(&tok, runner.clone(), &strict);
    let user = json!({"role": "user", "content": "hi"});
    let said = |text: &str| vec![user.clone(), json!({"role": "assistant", "content": text})];
    let prompt = ctx.render_ids(std::slice::from_ref(&user), true).unwrap();
    let answer = |t: &TokenizerBundle, text: &str| [t.encode(text).unwrap(), vec![258]].concat();
    assert_eq!(
        sanity(&ctx, &said("ok"), &prompt, &answer(&tok, "ok"), false),
        None
    );
    let m = sanity(&ctx, &said("ok"), &prompt, &answer(&tok, "no"), false).unwrap();
    assert!(m.starts_with(&format!("token {}:", prompt.len())), "{m}");
    assert!(m.contains("no") && m.contains("ok"), "{m}");
    // Whitespace around the content: strict reports it, ignore_strippable does not.
    assert!(sanity(&ctx, &said("ok"), &prompt, &answer(&tok, "ok "), false).is_some());
    let loose = MultiTurnConfig {
        tokenization_sanity_check_mode: SanityCheckMode::IgnoreStrippable,
        ..Default::default()
    };
    let lctx = context(&tok, runner.clone(), &loose);
    assert_eq!(
        sanity(&lctx, &said("ok"), &prompt, &answer(&tok, "ok "), false),
        None
    );
    // A tokenizer that merges "o" "k": the text is the same, the ids are not.
    let path = dir.path().join("tokenizer.json");
    let mut j: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    j["model"]["vocab"]["ok"] = json!(256);
    j["model"]["merges"] = json!(["o k"]);
    std::fs::write(&path, j.to_string()).unwrap();
    let merged = TokenizerBundle::from_dir(dir.path()).unwrap();
    let ok = merged.encode("ok").unwrap();
    assert_eq!(ok.len(), 1);
    let mctx = context(&merged, runner, &strict);
    let mprompt = mctx.render_ids(std::slice::from_ref(&user), true).unwrap();
    let end = merged.encode("<|im_end|>").unwrap();
    let split = [vec![u32::from(b'o'), u32::from(b'k')], end].concat();
    let m = sanity(&mctx, &said("ok"), &mprompt, &split, false).unwrap();
    assert!(
        m.contains("the same text was generated as ids")
            && m.contains(&format!("{}, {}", b'o', b'k'))
            && m.contains(&ok[0].to_string()),
        "{m}"
    );
}

/// An interaction scripted in Rust: the last assistant message containing the row's
/// `ground_truth` scores 1 and ends the conversation ("right"); any other scores 0 ("wrong");
/// a row whose ground truth is "boom" fails. Records every request.
struct Quiz {
    calls: Mutex<Vec<ToolCall>>,
}

impl ToolRunner for Quiz {
    fn schemas(&self) -> Vec<Value> {
        Vec::new()
    }
    fn submit(&self, call: ToolCall, done: Sender<ToolOutcome>) {
        self.calls.lock().unwrap().push(call.clone());
        let turn = call.interaction.clone().expect("an interaction request");
        let Some(messages) = turn.messages else {
            return; // finalize: nothing to answer
        };
        let said = messages.last().unwrap()["content"]
            .as_str()
            .unwrap()
            .to_string();
        let truth = turn.kwargs["ground_truth"].as_str().unwrap().to_string();
        let (text, reward, terminate, error) = if truth == "boom" {
            (
                String::new(),
                None,
                true,
                Some("the interaction raised".to_string()),
            )
        } else if said.contains(&truth) {
            ("right".into(), Some(1.0), true, None)
        } else {
            ("wrong".into(), Some(0.0), false, None)
        };
        let _ = done.send(ToolOutcome {
            key: call.key,
            text,
            reward,
            error,
            terminate,
        });
    }
}

fn quiz_conv(truth: &str) -> Conversation {
    Conversation {
        messages: vec![json!({"role": "user", "content": "6*7?"})],
        tools_kwargs: json!({}),
        tool_agent: true,
        interaction: Some(json!({"name": "quiz", "ground_truth": truth})),
    }
}

/// A model turn without tool calls goes to the row's interaction (started on the first turn,
/// the same instance after, ended at the finish; the turn decoded without special tokens as
/// the last message); its answer is a user turn in ChatML written out by hand with mask 0, its
/// score goes to `turn_scores`; an answer that ends the conversation is still appended to the
/// response (mask 0, log-prob 0, the generation prompt included), as verl appends it before
/// stopping, and the turn-by-turn ids then equal the conversation rendered at once.
#[test]
fn an_interaction_answers_turns_without_calls_and_may_end_the_conversation() {
    let (_d, tok) = bundle();
    let quiz = Arc::new(Quiz {
        calls: Mutex::new(Vec::new()),
    });
    let mt = MultiTurnConfig::default();
    let tools = Arc::new(Script {
        calls: Mutex::new(Vec::new()),
    });
    let ctx = context(&tok, tools, &mt).with_interactions(quiz.clone());
    let im_end = 258;
    let prompt = tok
        .encode(
            &tok.template(None)
                .unwrap()
                .render(&quiz_conv("42").messages, true, &Map::new())
                .unwrap(),
        )
        .unwrap();
    let mut agent = ToolAgent::new(
        &ctx,
        vec![quiz_conv("42")],
        vec![prompt.clone()],
        400,
        vec![im_end],
    );
    let turn1 = [ids(&tok, "7"), vec![im_end]].concat();
    let mut out = Rollout {
        responses: vec![turn1.clone()],
        log_probs: vec![vec![-1.0; turn1.len()]],
        stop: vec![StopReason::Eos],
    };
    assert!(
        agent.turn_ended(0, &out),
        "no call: the interaction answers"
    );
    let ready = agent.ready(true);
    let appended = ready[0].1.clone().expect("a wrong answer continues");
    let user_turn = |text: &str| {
        ids(
            &tok,
            &format!("\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"),
        )
    };
    assert_eq!(appended, user_turn("wrong"));
    out.responses[0].extend(&appended);
    out.log_probs[0].extend(vec![0.0; appended.len()]);
    let turn2 = [ids(&tok, "it is 42"), vec![im_end]].concat();
    out.responses[0].extend(&turn2);
    out.log_probs[0].extend(vec![-1.0; turn2.len()]);
    assert!(agent.turn_ended(0, &out));
    assert_eq!(agent.ready(true), vec![(0, None)], "a right answer ends it");
    let before = out.responses[0].len();
    let ep = agent.finish(&mut out).remove(0);
    let tail = user_turn("right");
    assert_eq!(out.responses[0][before..], tail[..]);
    assert_eq!(out.log_probs[0][before..], vec![0.0; tail.len()][..]);
    let want_mask: Vec<u8> = [
        vec![1; turn1.len()],
        vec![0; appended.len()],
        vec![1; turn2.len()],
        vec![0; tail.len()],
    ]
    .concat();
    assert_eq!(ep.mask, want_mask);
    assert_eq!(ep.turn_scores, vec![0.0, 1.0]);
    assert_eq!(
        (ep.assistant_turns, ep.user_turns, ep.num_turns()),
        (2, 2, 5)
    );
    assert_eq!(ep.sanity_mismatch, None, "{:?}", ep.sanity_mismatch);
    let calls = quiz.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 3, "two turns and the finalize");
    let turns: Vec<&InteractionTurn> = calls
        .iter()
        .map(|c| c.interaction.as_ref().unwrap())
        .collect();
    assert!(calls.iter().all(|c| c.name == "quiz"));
    assert_eq!((turns[0].first, turns[1].first), (true, false));
    assert!(turns.iter().all(|t| t.instance == turns[0].instance));
    assert_eq!(
        turns[0].messages.as_ref().unwrap().last().unwrap()["content"],
        json!("7")
    );
    assert_eq!(
        turns[1].messages.as_ref().unwrap().len(),
        4,
        "user, assistant, user, assistant"
    );
    assert!(turns[2].messages.is_none(), "the finalize");
}

/// `max_user_turns` counts the interaction's turns (the second model turn ends the
/// conversation without asking it); a failing interaction ends the conversation, is counted and
/// leaves nothing appended; rows without an interaction runner end at a turn without calls.
#[test]
fn interaction_limits_and_failures_end_the_conversation() {
    let (_d, tok) = bundle();
    let quiz = Arc::new(Quiz {
        calls: Mutex::new(Vec::new()),
    });
    let tools = || {
        Arc::new(Script {
            calls: Mutex::new(Vec::new()),
        })
    };
    let im_end = 258;
    let turn = [ids(&tok, "7"), vec![im_end]].concat();
    let rollout = |r: &[u32]| Rollout {
        responses: vec![r.to_vec()],
        log_probs: vec![vec![0.0; r.len()]],
        stop: vec![StopReason::Eos],
    };
    let mt = MultiTurnConfig {
        max_user_turns: Some(1),
        ..MultiTurnConfig::default()
    };
    let ctx = context(&tok, tools(), &mt).with_interactions(quiz.clone());
    let mut a = ToolAgent::new(
        &ctx,
        vec![quiz_conv("42")],
        vec![vec![1]],
        400,
        vec![im_end],
    );
    let mut out = rollout(&turn);
    assert!(a.turn_ended(0, &out));
    let appended = a.ready(true)[0].1.clone().unwrap();
    out.responses[0].extend(&appended);
    out.responses[0].extend(&turn);
    assert!(!a.turn_ended(0, &out), "max_user_turns reached");
    let ep = a.finish(&mut out).remove(0);
    assert_eq!((ep.user_turns, ep.turn_scores.clone()), (1, vec![0.0]));

    let ctx = context(&tok, tools(), &MultiTurnConfig::default()).with_interactions(quiz.clone());
    let mut a = ToolAgent::new(
        &ctx,
        vec![quiz_conv("boom")],
        vec![vec![1]],
        400,
        vec![im_end],
    );
    let mut out = rollout(&turn);
    assert!(a.turn_ended(0, &out));
    assert_eq!(a.ready(true), vec![(0, None)]);
    let ep = a.finish(&mut out).remove(0);
    assert_eq!(out.responses[0], turn, "nothing appended");
    assert_eq!(ep.interaction_errors, 1);
    assert!(ep.error.as_deref().unwrap().contains("raised"));

    let ctx = context(&tok, tools(), &MultiTurnConfig::default());
    let mut a = ToolAgent::new(
        &ctx,
        vec![quiz_conv("42")],
        vec![vec![1]],
        400,
        vec![im_end],
    );
    assert!(
        !a.turn_ended(0, &rollout(&turn)),
        "no interactions configured"
    );
}
