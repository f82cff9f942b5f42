//! The tool pool with a real `python3` (verl is not installed here, so the bridge's stand-ins
//! for verl's modules are what the tool files import).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn settings(workers: usize, timeout_s: f64) -> ToolPoolSettings {
    ToolPoolSettings {
        python: "python3".into(),
        num_workers: workers,
        timeout: Duration::from_secs_f64(timeout_s),
        max_output_bytes: Some(DEFAULT_MAX_OUTPUT_BYTES),
    }
}

fn source(config: Option<&Path>, functions: Option<&Path>) -> ToolSource {
    ToolSource {
        tool_config_path: config.map(Path::to_path_buf),
        function_tool_path: functions.map(Path::to_path_buf),
        interaction_config_path: None,
    }
}

fn call(key: u64, name: &str, arguments: &str, create_kwargs: Value) -> ToolCall {
    ToolCall {
        key,
        name: name.into(),
        arguments: arguments.into(),
        create_kwargs,
        interaction: None,
    }
}

/// Submits all calls at once and returns their outcomes by key.
fn run_all(pool: &ToolPool, calls: Vec<ToolCall>) -> Vec<ToolOutcome> {
    let (tx, rx) = mpsc::channel();
    let n = calls.len();
    for c in calls {
        pool.submit(c, tx.clone());
    }
    let mut out: Vec<ToolOutcome> = (0..n)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(60))
                .expect("an outcome")
        })
        .collect();
    out.sort_by_key(|o| o.key);
    out
}

fn run_one(pool: &ToolPool, c: ToolCall) -> ToolOutcome {
    run_all(pool, vec![c]).remove(0)
}

const GSM8K_YAML: &str = r#"
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer"
          required: ["answer"]
"#;

#[test]
fn gsm8k_tool_scores_like_verl() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(dir.path(), "gsm8k.yaml", GSM8K_YAML);
    let pool = ToolPool::start(&source(Some(&cfg), None), settings(1, 30.0)).unwrap();
    assert_eq!(
        pool.schemas(),
        &[
            json!({"type": "function", "function": {"name": "calc_gsm8k_reward",
            "description": "A tool for calculating the reward of gsm8k.",
            "parameters": {"type": "object",
                "properties": {"answer": {"type": "string", "description": "The model's answer"}},
                "required": ["answer"]}}})
        ]
    );
    let gt = json!({"ground_truth": "72"});
    let args = [
        r#"{"answer": "72"}"#,
        r#"{"answer": "71"}"#,
        "{\"answer\": \"#### 72\"}",
        r#"{"answer": "it is 1,072"}"#,
        r#"{"answer": "no idea"}"#,
        r#"{"answer": 72}"#,
    ];
    let calls = args
        .iter()
        .enumerate()
        .map(|(i, a)| call(i as u64, "calc_gsm8k_reward", a, gt.clone()))
        .collect();
    let out = run_all(&pool, calls);
    // Each call creates a fresh instance whose stored reward is 0.0: a correct answer
    // improves on it (step reward 0.0), anything else does not (-0.05). Flexible extraction
    // keeps commas; no number at all scores the integer 0.
    let expected = [
        ("Current parsed answer='72' reward=1.0", 0.0),
        ("Current parsed answer='71' reward=0.0", -0.05),
        ("Current parsed answer='#### 72' reward=1.0", 0.0),
        ("Current parsed answer='it is 1,072' reward=0.0", -0.05),
        ("Current parsed answer='no idea' reward=0", -0.05),
        ("Current parsed answer='72' reward=1.0", 0.0),
    ];
    for (o, (text, reward)) in out.iter().zip(expected) {
        assert_eq!(o.text, text);
        assert_eq!(o.reward, Some(reward), "{text}");
        assert_eq!(o.error, None);
    }
}

const FUNCTIONS: &str = r#"
import os, time
from typing import Optional
from verl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: float = 1.0) -> float:
    """Adds two numbers.

    Args:
        a: The first
            number.
        b: The second number.

    Returns:
        The sum.
    """
    return a + b


@function_tool("lookup")
async def find(key: str, tags: list[str], mode: Optional[str] = None, opts: dict = None, n: int | float = 2) -> str:
    """Looks a key up
    in the table.

    Args:
        key: The key.
        tags: Tags to match.
        mode: How to match (choices: ["exact", "prefix"])
        opts: Options.
        n: A count.
    """
    return {"key": key, "tags": tags}, 0.5, {"hits": 1}


@function_tool
def nap(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


@function_tool
def die(code: int) -> str:
    """Ends the process at once.

    Args:
        code: Exit status.
    """
    os._exit(code)


@function_tool
def big(n: int) -> str:
    """Returns n bytes.

    Args:
        n: How many.
    """
    return "x" * n


@function_tool
def boom(message: str) -> str:
    """Raises.

    Args:
        message: The error message.
    """
    raise ValueError(message)


@function_tool
def pid() -> str:
    """The worker's process id."""
    return str(os.getpid())
"#;

fn function_pool(dir: &Path, workers: usize, timeout_s: f64) -> ToolPool {
    let f = write(dir, "functions.py", FUNCTIONS);
    ToolPool::start(&source(None, Some(&f)), settings(workers, timeout_s)).unwrap()
}

#[test]
fn function_tool_schemas_come_from_signature_and_docstring() {
    let dir = tempfile::tempdir().unwrap();
    let pool = function_pool(dir.path(), 1, 30.0);
    let by_name = |n: &str| {
        pool.schemas()
            .iter()
            .find(|s| s["function"]["name"] == n)
            .cloned()
            .unwrap()
    };
    assert_eq!(
        by_name("add"),
        json!({"type": "function", "function": {"name": "add", "description": "Adds two numbers.",
            "parameters": {"type": "object", "properties": {
                "a": {"type": "integer", "description": "The first number."},
                "b": {"type": "number", "description": "The second number."}},
            "required": ["a"]}}})
    );
    // verl's schema model keeps only type, description and enum of a property (a list's
    // `items` goes); `int | float` is a list of types.
    assert_eq!(
        by_name("lookup"),
        json!({"type": "function", "function": {"name": "lookup",
            "description": "Looks a key up\nin the table.",
            "parameters": {"type": "object", "properties": {
                "key": {"type": "string", "description": "The key."},
                "tags": {"type": "array", "description": "Tags to match."},
                "mode": {"type": "string", "description": "How to match", "enum": ["exact", "prefix"]},
                "opts": {"type": "object", "description": "Options."},
                "n": {"type": ["integer", "number"], "description": "A count."}},
            "required": ["key", "tags"]}}})
    );
    assert_eq!(
        by_name("pid"),
        json!({"type": "function", "function": {"name": "pid", "description": "The worker's process id.",
            "parameters": {"type": "object", "properties": {}}}})
    );
    let out = run_all(
        &pool,
        vec![
            call(0, "add", r#"{"a": 2}"#, json!({})),
            call(1, "lookup", r#"{"key": "k", "tags": ["é"]}"#, Value::Null),
        ],
    );
    assert_eq!(out[0].text, "3.0");
    assert_eq!(out[0].reward, Some(0.0));
    assert_eq!(out[1].text, r#"{"key": "k", "tags": ["é"]}"#);
    assert_eq!(out[1].reward, Some(0.5));
}

#[test]
fn unknown_tools_bad_json_and_exceptions_read_as_in_verl() {
    let dir = tempfile::tempdir().unwrap();
    let pool = function_pool(dir.path(), 1, 30.0);
    let out = run_all(
        &pool,
        vec![
            call(0, "nope", "{}", json!({})),
            call(1, "add", "{bad", json!({})),
            call(2, "boom", r#"{"message": "no luck"}"#, json!({})),
            call(3, "add", r#"{"c": 1}"#, json!({})),
        ],
    );
    assert_eq!(
        out[0].text,
        "Unknown function 'nope'. Available tools: ['add', 'big', 'boom', 'die', 'lookup', 'nap', 'pid']"
    );
    assert_eq!((out[0].reward, &out[0].error), (Some(0.0), &None));
    assert_eq!(
        out[1].text,
        "Invalid JSON in arguments for 'add': Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    );
    assert_eq!((out[1].reward, &out[1].error), (Some(0.0), &None));
    assert_eq!(out[2].text, "Error executing tool 'boom': no luck");
    assert_eq!(out[2].reward, Some(0.0));
    assert_eq!(
        out[2].error.as_deref(),
        Some("tool 'boom' raised ValueError: no luck")
    );
    assert_eq!(
        out[3].text,
        "Error executing tool 'add': add() got an unexpected keyword argument 'c'"
    );
}

/// Runs `bad` and a fast call together on two workers; the fast one must succeed, and the
/// pool must still work afterwards (the bad call's worker replaced).
fn failing_next_to_a_fast_call(bad: ToolCall) -> ToolOutcome {
    let dir = tempfile::tempdir().unwrap();
    let pool = function_pool(dir.path(), 2, 2.0);
    let fast = call(1, "nap", r#"{"seconds": 0.2}"#, json!({}));
    let out = run_all(&pool, vec![bad, fast]);
    assert_eq!(out[1].text, "slept 0.2");
    assert_eq!(out[1].error, None);
    let again = run_all(
        &pool,
        vec![
            call(2, "nap", r#"{"seconds": 0}"#, json!({})),
            call(3, "nap", r#"{"seconds": 0}"#, json!({})),
        ],
    );
    assert!(again.iter().all(|o| o.text == "slept 0"), "{again:?}");
    out[0].clone()
}

#[test]
fn a_call_past_the_timeout_is_a_named_error() {
    let started = Instant::now();
    let o = failing_next_to_a_fast_call(call(0, "nap", r#"{"seconds": 30}"#, json!({})));
    assert_eq!(
        o.error.as_deref(),
        Some("tool 'nap' timed out after 2 s (its worker was killed and replaced)")
    );
    assert_eq!(o.text, "Error executing tool 'nap': timed out after 2 s");
    assert_eq!(o.reward, None);
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_dying_worker_is_a_named_error() {
    let o = failing_next_to_a_fast_call(call(0, "die", r#"{"code": 3}"#, json!({})));
    let err = o.error.unwrap();
    assert!(
        err.starts_with("tool 'die': its worker process died (exit status: 3)"),
        "{err}"
    );
    assert_eq!(
        o.text,
        "Error executing tool 'die': the tool's process died"
    );
}

#[test]
fn an_oversized_output_is_a_named_error() {
    let o = failing_next_to_a_fast_call(call(0, "big", r#"{"n": 10485760}"#, json!({})));
    assert_eq!(
        o.error.as_deref(),
        Some("tool 'big' returned 10485760 bytes, over the 1048576-byte limit")
    );
    assert_eq!(o.text, "Error executing tool 'big': output too large");
}

#[test]
fn calls_run_concurrently_on_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    let pool = function_pool(dir.path(), 4, 30.0);
    let started = Instant::now();
    let calls = (0..4)
        .map(|k| call(k, "nap", r#"{"seconds": 1}"#, json!({})))
        .collect();
    let out = run_all(&pool, calls);
    let took = started.elapsed();
    assert!(out.iter().all(|o| o.text == "slept 1"), "{out:?}");
    assert!(
        took < Duration::from_secs(3),
        "4 one-second calls took {took:?}"
    );
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

#[test]
fn dropping_the_pool_ends_calls_in_flight_and_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    let pool = function_pool(dir.path(), 2, 60.0);
    let pids: Vec<u32> = run_all(
        &pool,
        vec![
            call(0, "pid", "{}", json!({})),
            call(1, "pid", "{}", json!({})),
        ],
    )
    .iter()
    .map(|o| o.text.parse().unwrap())
    .collect();
    let (tx, rx) = mpsc::channel();
    pool.submit(call(9, "nap", r#"{"seconds": 60}"#, json!({})), tx);
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    drop(pool);
    assert!(started.elapsed() < Duration::from_secs(3));
    let o = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(
        o.error.as_deref(),
        Some("tool 'nap': the tool pool was shut down")
    );
    for pid in pids {
        assert!(!alive(pid), "tool worker {pid} is still running");
    }
}

fn code_pool(dir: &Path, extra: &str) -> ToolPool {
    let yaml = format!(
        "tools:\n  - class_name: main_ppo.tools.CodeInterpreterTool\n    config:\n      type: native\n      timeout_s: 1\n{extra}    tool_schema: null\n"
    );
    let cfg = write(dir, "code.yaml", &yaml);
    ToolPool::start(&source(Some(&cfg), None), settings(2, 30.0)).unwrap()
}

fn code(key: u64, src: &str) -> ToolCall {
    call(
        key,
        "code_interpreter",
        &json!({ "code": src }).to_string(),
        json!({}),
    )
}

#[test]
fn the_code_interpreter_runs_code_within_its_limits() {
    let dir = tempfile::tempdir().unwrap();
    let pool = code_pool(dir.path(), "");
    assert_eq!(pool.schemas()[0]["function"]["name"], "code_interpreter");
    let out = run_all(
        &pool,
        vec![
            code(0, "print(1+1)"),
            code(1, "while True:\n    pass"),
            code(
                2,
                "import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=5)",
            ),
            code(
                3,
                "import os; print(os.getcwd() != '/')\nraise SystemExit(4)",
            ),
        ],
    );
    assert_eq!(out[0].text, "2\n");
    assert_eq!(out[0].reward, Some(0.0));
    assert_eq!(out[1].text, "[killed: CPU time limit of 1 s exceeded]");
    assert!(out[2].text.ends_with("[exit status 1]"), "{}", out[2].text);
    assert!(out[2].text.contains("Error"), "{}", out[2].text);
    assert_eq!(out[3].text, "True\n[exit status 4]");
}

#[test]
fn the_code_interpreter_socket_shim_blocks_the_network() {
    let dir = tempfile::tempdir().unwrap();
    let pool = code_pool(dir.path(), "      network_isolation: socket_shim\n");
    let o = run_one(
        &pool,
        code(
            0,
            "import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=5)",
        ),
    );
    assert!(
        o.text
            .contains("PermissionError: network access is disabled in this sandbox"),
        "{}",
        o.text
    );
    assert!(o.text.ends_with("[exit status 1]"), "{}", o.text);
}

/// A one-request HTTP server answering `body` with status 200; returns its URL and the
/// request body it received.
fn retrieval_server(body: Value) -> (String, mpsc::Receiver<Value>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/retrieve", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut length = 0;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if line.trim().is_empty() {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap();
            }
        }
        let mut request = vec![0; length];
        reader.read_exact(&mut request).unwrap();
        tx.send(serde_json::from_slice(&request).unwrap()).unwrap();
        let text = body.to_string();
        let mut stream = stream;
        write!(
            stream,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        )
        .unwrap();
    });
    (url, rx)
}

#[test]
fn the_search_tool_formats_retrieved_passages() {
    let passages = json!({"result": [
        [
            {"document": {"id": "1", "contents": "Paris\nParis is the capital of France.\nIt is big."}, "score": 0.9},
            {"document": {"id": "2", "contents": "Lyon\nLyon is a city."}, "score": 0.5}
        ],
        [
            {"document": {"id": "3", "contents": "Rhine\nA river."}, "score": 0.7}
        ]
    ]});
    let (url, request) = retrieval_server(passages);
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "tools:\n  - class_name: verl.tools.search_tool.SearchTool\n    config:\n      type: native\n      retrieval_service_url: {url}\n      topk: 2\n      timeout: 10\n    tool_schema: null\n"
    );
    let cfg = write(dir.path(), "search.yaml", &yaml);
    let pool = ToolPool::start(&source(Some(&cfg), None), settings(1, 30.0)).unwrap();
    let o = run_one(
        &pool,
        call(
            0,
            "search",
            r#"{"query_list": ["capital of France", "rivers"]}"#,
            json!({}),
        ),
    );
    assert_eq!(
        request.recv_timeout(Duration::from_secs(5)).unwrap(),
        json!({"queries": ["capital of France", "rivers"], "topk": 2, "return_scores": true})
    );
    // verl's search tool: passages per query joined by blank lines, queries by `---`, all
    // wrapped as the JSON `{"result": ...}` (json.dumps' spacing).
    let result = "Doc 1 (Title: Paris)\nParis is the capital of France.\nIt is big.\n\nDoc 2 (Title: Lyon)\nLyon is a city.\n---\nDoc 1 (Title: Rhine)\nA river.";
    assert_eq!(
        o.text,
        format!("{{\"result\": {}}}", serde_json::to_string(result).unwrap())
    );
    assert_eq!((o.reward, o.error), (Some(0.0), None));
}

/// A service script of `scripts/` started on a free port (killed when the guard drops, also
/// when an assertion fails), and the URL it prints first.
struct Service(std::process::Child);

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(script: &str, args: &[&str]) -> (Service, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(script);
    let mut child = std::process::Command::new("python3")
        .arg(&path)
        .args(args)
        .args(["--port", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let service = Service(child);
    let mut url = String::new();
    BufReader::new(stdout).read_line(&mut url).unwrap();
    (service, url.trim().to_string())
}

/// The shipped BM25 service (`scripts/retrieval_server.py`) answers the search tool: a query
/// naming a term found in one passage only gets that passage first (BM25 scores a passage
/// without the query's terms 0, so it never outranks one that has them), `topk` bounds the
/// list, and the tool's text is built from what the service returned.
#[test]
fn the_search_tool_reads_the_shipped_retrieval_server() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write(
        dir.path(),
        "corpus.jsonl",
        concat!(
            "{\"id\": \"a\", \"contents\": \"\\\"Varnholt\\\"\\nVarnholt was founded in 1742.\"}\n",
            "{\"id\": \"b\", \"contents\": \"\\\"Quellby\\\"\\nQuellby stands on the river Tave.\"}\n",
            "{\"id\": \"c\", \"contents\": \"\\\"Ostrel\\\"\\nOstrel is a region.\"}\n",
        ),
    );
    let (_server, url) = serve(
        "retrieval_server.py",
        &["--corpus", corpus.to_str().unwrap()],
    );
    assert!(url.ends_with("/retrieve"), "{url}");
    let yaml = format!(
        "tools:\n  - class_name: verl.tools.search_tool.SearchTool\n    config:\n      type: native\n      retrieval_service_url: {url}\n      topk: 1\n      timeout: 10\n    tool_schema: null\n"
    );
    let cfg = write(dir.path(), "search.yaml", &yaml);
    let pool = ToolPool::start(&source(Some(&cfg), None), settings(1, 30.0)).unwrap();
    let o = run_one(
        &pool,
        call(
            0,
            "search",
            r#"{"query_list": ["when was Varnholt founded", "which river: Tave"]}"#,
            json!({}),
        ),
    );
    let result = "Doc 1 (Title: \"Varnholt\")\nVarnholt was founded in 1742.\n---\nDoc 1 (Title: \"Quellby\")\nQuellby stands on the river Tave.";
    assert_eq!(
        o.text,
        format!("{{\"result\": {}}}", serde_json::to_string(result).unwrap())
    );
    assert_eq!(o.error, None);
}

/// A tool in the form of verl 1dda039's agent-loop tutorial (`sandbox.SandboxTool`: a JSON tool
/// config naming a class from a module next to it, no `tool_schema` — the class builds it with
/// `OpenAIFunctionToolSchema(**...)` — and `execute` POSTing the code to `sandbox_fusion_url`)
/// against the shipped `scripts/code_sandbox_server.py`: the schema comes from the class, the
/// code runs in the service and its stdout and stderr come back as the tool's text.
#[test]
fn a_tutorial_style_sandbox_tool_runs_code_on_the_shipped_service() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = serve("code_sandbox_server.py", &[]);
    write(
        dir.path(),
        "sandbox_tool.py",
        r#"
import json
import urllib.request

from verl.tools.base_tool import BaseTool, OpenAIFunctionToolSchema, ToolResponse


class SandboxTool(BaseTool):
    def get_openai_tool_schema(self):
        return OpenAIFunctionToolSchema(**{
            "type": "function",
            "function": {
                "name": "code_interpreter",
                "description": "Runs Python code.",
                "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code."}}, "required": ["code"]},
            },
        })

    async def execute(self, instance_id, parameters, **kwargs):
        body = json.dumps({"code": parameters["code"]}).encode()
        req = urllib.request.Request(self.config["sandbox_fusion_url"], data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            run = json.loads(resp.read())["run_result"]
        return ToolResponse(text=run["stdout"] + run["stderr"]), 0.0, {}
"#,
    );
    let cfg = write(
        dir.path(),
        "tool_config.json",
        &json!({"tools": [{"class_name": "sandbox_tool.SandboxTool", "config": {"type": "native", "sandbox_fusion_url": url}}]}).to_string(),
    );
    let pool = ToolPool::start(&source(Some(&cfg), None), settings(1, 60.0)).unwrap();
    let schemas = pool.schemas();
    let ok = run_one(
        &pool,
        call(
            0,
            "code_interpreter",
            r#"{"code": "print(6 * 7)"}"#,
            json!({}),
        ),
    );
    let failed = run_one(
        &pool,
        call(
            1,
            "code_interpreter",
            r#"{"code": "import sys; sys.exit('no')"}"#,
            json!({}),
        ),
    );
    assert_eq!(schemas.len(), 1);
    assert_eq!(schemas[0]["function"]["name"], "code_interpreter");
    assert_eq!(
        schemas[0]["function"]["parameters"]["required"],
        json!(["code"])
    );
    assert_eq!((ok.text.as_str(), ok.error), ("42\n", None));
    assert_eq!(failed.text, "no\n");
}

/// Arguments that are JSON but not an object (an array, a string, a number) are answered as
/// such, as invalid JSON is: a message for the model, reward 0, not a tool error. Before, the
/// function tool was called with them and the model read Python's "argument after ** must be a
/// mapping, not list".
#[test]
fn arguments_that_are_not_a_json_object_are_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let pool = function_pool(dir.path(), 1, 30.0);
    let out = run_all(
        &pool,
        vec![
            call(0, "add", "[1, 2]", json!({})),
            call(1, "add", r#""a""#, json!({})),
            call(2, "add", "3", json!({})),
        ],
    );
    for (o, kind) in out.iter().zip(["an array", "a string", "a number"]) {
        assert_eq!(
            o.text,
            format!("Invalid arguments for 'add': expected a JSON object of parameter names and values, got {kind}")
        );
        assert_eq!((o.reward, &o.error), (Some(0.0), &None));
    }
}

/// A tool whose reward is NaN or infinite: the reward is left out and the call is a tool error
/// naming the tool and the value; a finite reward passes. Before, NaN went on into
/// `tool_rewards` (and so into `agent/tool_reward/mean` and the reward function's extra_info,
/// where JSON turned it into null) without a word.
#[test]
fn a_non_finite_tool_reward_is_left_out_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "rewards.py",
        "from verl.tools.function_tool import function_tool\n\n@function_tool\ndef score(x: str) -> str:\n    \"\"\"Scores.\n\n    Args:\n        x: A float as text.\n    \"\"\"\n    return 'ok', float(x)\n",
    );
    let pool = ToolPool::start(&source(None, Some(&f)), settings(1, 30.0)).unwrap();
    let out = run_all(
        &pool,
        vec![
            call(0, "score", r#"{"x": "nan"}"#, json!({})),
            call(1, "score", r#"{"x": "-inf"}"#, json!({})),
            call(2, "score", r#"{"x": "0.25"}"#, json!({})),
        ],
    );
    for (o, shown) in out.iter().zip(["NaN", "-inf"]) {
        assert_eq!((o.text.as_str(), o.reward), ("ok", None));
        let e = o.error.as_deref().unwrap_or("");
        assert!(
            e.contains("tool 'score' returned the reward")
                && e.contains(shown)
                && e.contains("not a finite number"),
            "{e}"
        );
    }
    assert_eq!((out[2].reward, &out[2].error), (Some(0.25), &None));
}

/// A tool file whose import takes longer than `MAIN_PPO_WORKER_LOAD_S` fails at start-up naming
/// the limit and the variable (the limit was a fixed, undocumented 120 s). Run in a child
/// process of this test binary, so that the variable is set for it alone.
#[test]
fn the_tool_load_limit_is_set_by_its_variable() {
    if std::env::var_os("MAIN_PPO_TEST_SLOW_TOOL").is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "reward::tools::tests::the_tool_load_limit_is_set_by_its_variable",
                "--nocapture",
            ])
            .env("MAIN_PPO_TEST_SLOW_TOOL", "1")
            .env(LOAD_TIMEOUT_VAR, "1.5")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        assert!(text.contains("1 passed"), "{text}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "slow.py", "import time\ntime.sleep(30)\n");
    let t0 = Instant::now();
    let e = ToolPool::start(&source(None, Some(&f)), settings(1, 30.0)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    assert_eq!(
        e,
        ToolError::Failed("loading the tools took more than 1.5 s (MAIN_PPO_WORKER_LOAD_S)".into())
    );
}

fn start_error(dir: &Path, yaml: &str, functions: Option<&str>) -> String {
    let cfg = write(dir, "tools.yaml", yaml);
    let f = functions.map(|code| write(dir, "fns.py", code));
    ToolPool::start(&source(Some(&cfg), f.as_deref()), settings(1, 30.0))
        .unwrap_err()
        .to_string()
}

#[test]
fn bad_tool_configs_name_the_file_and_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tools.yaml").display().to_string();
    let gsm8k = "  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n";
    let e = start_error(
        dir.path(),
        &format!("tools:\n{gsm8k}  - config: {{type: native}}\n"),
        None,
    );
    assert!(
        e.contains(&format!("{cfg}: tools[1] has no `class_name`")),
        "{e}"
    );
    let e = start_error(
        dir.path(),
        "tools:\n  - class_name: a.B\n    config: {type: mcp}\n",
        None,
    );
    assert!(
        e.contains(&format!("{cfg}: tools[0] (a.B): config.type is `mcp`; only native tools are supported (MCP tools are not)")),
        "{e}"
    );
    let e = start_error(dir.path(), "tools: [\n", None);
    assert!(
        e.contains(&format!("the tool config {cfg} is not valid YAML")),
        "{e}"
    );
    let e = start_error(dir.path(), "other: 1\n", None);
    assert!(
        e.contains(&format!("{cfg}: no top-level `tools:` list")),
        "{e}"
    );
    let e = start_error(
        dir.path(),
        "tools:\n  - class_name: no_such_module.Tool\n    config: {type: native}\n",
        None,
    );
    assert!(
        e.contains(&format!(
            "({cfg}: tools[0] (no_such_module.Tool)): ModuleNotFoundError"
        )),
        "{e}"
    );
    let clash = "from verl.tools.function_tool import function_tool\n\n@function_tool(\"calc_gsm8k_reward\")\ndef f(x: str) -> str:\n    \"\"\"F.\n\n    Args:\n        x: X.\n    \"\"\"\n    return x\n";
    let e = start_error(dir.path(), &format!("tools:\n{gsm8k}"), Some(clash));
    assert!(
        e.contains(
            "Function tool name(s) ['calc_gsm8k_reward'] collide with tools already declared in"
        ),
        "{e}"
    );
    let undocumented = "from verl.tools.function_tool import function_tool\n\n@function_tool\ndef g(x: str, y: int) -> str:\n    \"\"\"G.\n\n    Args:\n        x: X.\n    \"\"\"\n    return x\n";
    let e = start_error(dir.path(), "tools: []\n", Some(undocumented));
    assert!(
        e.contains("does not describe parameter `y`") && e.contains("fns.py"),
        "{e}"
    );
}

fn interaction_pool(config: &Path) -> Result<ToolPool, ToolError> {
    let src = ToolSource {
        interaction_config_path: Some(config.to_path_buf()),
        ..ToolSource::default()
    };
    ToolPool::start(&src, settings(1, 30.0))
}

fn interact(
    key: u64,
    name: &str,
    instance: &str,
    said: Option<&str>,
    kwargs: Value,
    first: bool,
) -> ToolCall {
    ToolCall {
        key,
        name: name.into(),
        arguments: String::new(),
        create_kwargs: Value::Null,
        interaction: Some(crate::rollout::agent::InteractionTurn {
            instance: instance.into(),
            kwargs,
            messages: said.map(|s| {
                vec![
                    json!({"role": "user", "content": "Natalia sold clips ..."}),
                    json!({"role": "assistant", "content": s}),
                ]
            }),
            first,
        }),
    }
}

/// verl's GSM8K interaction (b178a3c's `verl.interactions.gsm8k_interaction`, which the
/// bridge ships): the last assistant message scored strictly against the row's ground truth,
/// 1.0 ends the conversation with "Your response is correct!", anything else (a wrong number,
/// no `#### `) scores 0.0 and asks again; each instance keeps its own ground truth; the name
/// comes from the config entry. A user class (a file next to the config, subclassing verl's
/// base class as the bridge provides it) takes the name derived from its class, gets its
/// config with the name, counts its turns per instance, is finalized with the instance id;
/// an exception ends the conversation with the error named.
#[test]
fn interactions_answer_as_verls_gsm8k_interaction_and_user_classes() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "counting.py",
        r#"
from verl.interactions.base import BaseInteraction

class CountingInteraction(BaseInteraction):
    def __init__(self, config):
        super().__init__(config)
        self.turns, self.done = {}, []

    async def start_interaction(self, instance_id=None, **kwargs):
        self.turns[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        if kwargs.get("explode"):
            raise RuntimeError("exploded")
        self.turns[instance_id] += 1
        n = self.turns[instance_id]
        return n >= 2, f"{self.name} turn {n} of {kwargs['who']} ({self.config['greeting']}, done {self.done})", 0.25 * n, {}

    async def finalize_interaction(self, instance_id):
        self.done.append(instance_id)
"#,
    );
    let cfg = write(
        dir.path(),
        "interactions.yaml",
        "interaction:\n  - name: gsm8k\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n    config: {}\n  - class_name: counting.CountingInteraction\n    config: {greeting: hi}\n",
    );
    let entries = read_interaction_config(&cfg).unwrap();
    assert_eq!(interaction_names(&entries), ["gsm8k", "counting"]);
    let pool = interaction_pool(&cfg).unwrap();
    let gt = |g: &str| json!({"name": "gsm8k", "query": "q", "ground_truth": g});
    let outs = run_all(
        &pool,
        vec![
            interact(
                1,
                "gsm8k",
                "a",
                Some("so 48 + 24 = 72\n#### 72"),
                gt("72"),
                true,
            ),
            interact(2, "gsm8k", "b", Some("#### 71"), gt("72"), true),
            interact(3, "gsm8k", "b", Some("the answer is 72"), gt("72"), false),
            interact(4, "gsm8k", "c", Some("#### 1,000"), gt("1000"), true),
        ],
    );
    let got: Vec<(&str, Option<f64>, bool)> = outs
        .iter()
        .map(|o| (o.text.as_str(), o.reward, o.terminate))
        .collect();
    let wrong = "Your response is incorrect! You need to reflect on your answer and try again.";
    assert_eq!(
        got,
        [
            ("Your response is correct!", Some(1.0), true),
            (wrong, Some(0.0), false),
            (wrong, Some(0.0), false),
            ("Your response is correct!", Some(1.0), true),
        ]
    );
    assert!(outs.iter().all(|o| o.error.is_none()));
    let who = |w: &str| json!({"name": "counting", "who": w});
    let outs = run_all(
        &pool,
        vec![
            interact(1, "counting", "x", Some("."), who("x"), true),
            interact(2, "counting", "y", Some("."), who("y"), true),
            interact(3, "counting", "x", Some("."), who("x"), false),
            interact(4, "counting", "x", None, who("x"), false),
            interact(5, "counting", "y", Some("."), who("y"), false),
        ],
    );
    assert_eq!(
        (outs[0].text.as_str(), outs[0].reward, outs[0].terminate),
        ("counting turn 1 of x (hi, done [])", Some(0.25), false)
    );
    assert_eq!(outs[1].text, "counting turn 1 of y (hi, done [])");
    assert_eq!((outs[2].reward, outs[2].terminate), (Some(0.5), true));
    assert!(outs[3].error.is_none(), "{:?}", outs[3].error);
    assert_eq!(outs[4].text, "counting turn 2 of y (hi, done ['x'])");
    let boom = run_one(
        &pool,
        interact(
            9,
            "counting",
            "z",
            Some("."),
            json!({"name": "counting", "who": "z", "explode": true}),
            true,
        ),
    );
    assert!(boom.terminate);
    assert!(
        boom.error
            .as_deref()
            .unwrap()
            .contains("interaction 'counting' raised RuntimeError: exploded"),
        "{boom:?}"
    );
}

/// A bad interaction config is refused at start-up naming the file and the entry: no list, an
/// entry without class_name, a name used twice (given or derived), a class that does not
/// import.
#[test]
fn bad_interaction_configs_name_the_file_and_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let shown = dir.path().join("i.yaml").display().to_string();
    let err = |yaml: &str| {
        let cfg = write(dir.path(), "i.yaml", yaml);
        interaction_pool(&cfg).unwrap_err().to_string()
    };
    let e = err("tools: []\n");
    assert!(
        e.contains(&format!("{shown}: no top-level `interaction:` list")),
        "{e}"
    );
    let e = err("interaction:\n  - name: a\n");
    assert!(
        e.contains(&format!("{shown}: interaction[0] has no `class_name`")),
        "{e}"
    );
    let e = err(
        "interaction:\n  - class_name: x.Gsm8kInteraction\n  - name: gsm8k\n    class_name: y.Z\n",
    );
    assert!(
        e.contains("interaction[1]: the name \"gsm8k\" is used twice"),
        "{e}"
    );
    let e = err("interaction:\n  - name: q\n    class_name: no_such_module.QuizInteraction\n");
    assert!(
        e.contains(&format!(
            "{shown}: interaction[0] (no_such_module.QuizInteraction)"
        )) && e.contains("ModuleNotFoundError"),
        "{e}"
    );
    let cfg = write(
        dir.path(),
        "i.yaml",
        "interaction:\n  - name: q\n    class_name: no_such_module.QuizInteraction\n",
    );
    match interaction_pool(&cfg).unwrap_err() {
        ToolError::Config { setting, .. } => {
            assert_eq!(setting, ToolSetting::InteractionConfigPath)
        }
        other => panic!("{other:?}"),
    }
}
