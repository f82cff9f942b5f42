//! The control API over real HTTP on loopback (a hand-written HTTP/1.1 client, so the server is
//! checked against the protocol rather than against a client library's leniency).

use std::io::{Read, Write};
use std::net::TcpStream;

use proptest::prelude::*;

use super::*;

/// One request with `Connection: close`; returns (status, body).
pub(crate) fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &[u8],
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    // A server may answer (413) before reading all of a large body; ignore a broken pipe.
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (status, body)
}

fn cfg(token: Option<&str>) -> RewardControlConfig {
    RewardControlConfig {
        enable: true,
        host: "127.0.0.1".into(),
        port: 0,
        token: token.map(str::to_string),
        max_body_bytes: 1024,
    }
}

fn weights() -> BTreeMap<String, f64> {
    [("acc".to_string(), 1.0), ("safety".to_string(), 0.5)].into()
}

#[test]
fn get_post_and_status() {
    let srv = ControlServer::start(&cfg(None), weights(), 10).unwrap();
    let (st, body) = http(srv.addr, "GET", "/api/v1/reward/weights", None, b"");
    assert_eq!(st, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"acc": 1.0, "safety": 0.5})
    );
    assert!(srv.take_changes().is_none());
    let (st, body) = http(
        srv.addr,
        "POST",
        "/api/v1/reward/weights",
        None,
        br#"{"safety": 2}"#,
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"acc": 1.0, "safety": 2.0})
    );
    assert_eq!(srv.take_changes().unwrap()["safety"], 2.0);
    assert!(srv.take_changes().is_none(), "taken once");
    let mut m = Metrics::new();
    m.insert("critic/score/mean".into(), 0.25);
    srv.publish(3, &m);
    let (st, body) = http(srv.addr, "GET", "/api/v1/status", None, b"");
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["step"], 3);
    assert_eq!(v["total_steps"], 10);
    assert_eq!(v["metrics"]["critic/score/mean"], 0.25);
}

#[test]
fn every_bad_request_is_a_4xx_and_changes_nothing() {
    let srv = ControlServer::start(&cfg(None), weights(), 10).unwrap();
    let big = format!("{{\"acc\": 1.0, \"pad\": \"{}\"}}", "x".repeat(4096));
    let cases: Vec<(&str, &str, Vec<u8>, u16)> = vec![
        ("POST", "/api/v1/reward/weights", b"{acc: 1".to_vec(), 400),
        ("POST", "/api/v1/reward/weights", b"[1, 2]".to_vec(), 400),
        ("POST", "/api/v1/reward/weights", b"{}".to_vec(), 400),
        (
            "POST",
            "/api/v1/reward/weights",
            br#"{"acc": 1e999}"#.to_vec(),
            400,
        ),
        (
            "POST",
            "/api/v1/reward/weights",
            br#"{"nope": 1}"#.to_vec(),
            422,
        ),
        (
            "POST",
            "/api/v1/reward/weights",
            br#"{"acc": 2, "nope": 1}"#.to_vec(),
            422,
        ),
        (
            "POST",
            "/api/v1/reward/weights",
            br#"{"acc": -1}"#.to_vec(),
            422,
        ),
        (
            "POST",
            "/api/v1/reward/weights",
            br#"{"acc": "2"}"#.to_vec(),
            422,
        ),
        (
            "POST",
            "/api/v1/reward/weights",
            br#"{"acc": null}"#.to_vec(),
            422,
        ),
        ("POST", "/api/v1/reward/weights", big.into_bytes(), 413),
        ("DELETE", "/api/v1/reward/weights", Vec::new(), 405),
        ("GET", "/api/v1/nothing", Vec::new(), 404),
    ];
    for (method, path, body, want) in cases {
        let (st, text) = http(srv.addr, method, path, None, &body);
        assert_eq!(
            st,
            want,
            "{method} {path} {}: {text}",
            String::from_utf8_lossy(&body[..body.len().min(40)])
        );
        if want != 405 && want != 413 {
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(v["error"].is_string(), "{text}");
        }
    }
    assert!(
        srv.take_changes().is_none(),
        "no rejected request changed anything"
    );
    let (_, body) = http(srv.addr, "GET", "/api/v1/reward/weights", None, b"");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"acc": 1.0, "safety": 0.5})
    );
}

#[test]
fn a_token_is_required_when_set() {
    let srv = ControlServer::start(&cfg(Some("s3cret")), weights(), 10).unwrap();
    for (token, want) in [
        (None, 401),
        (Some("wrong"), 401),
        (Some("s3cre"), 401),
        (Some("s3cret"), 200),
    ] {
        let (st, _) = http(srv.addr, "GET", "/api/v1/reward/weights", token, b"");
        assert_eq!(st, want, "{token:?}");
        let (st, _) = http(
            srv.addr,
            "POST",
            "/api/v1/reward/weights",
            token,
            br#"{"acc": 3}"#,
        );
        assert_eq!(st, want, "{token:?}");
        let (st, _) = http(srv.addr, "GET", "/api/v1/status", token, b"");
        assert_eq!(st, want, "{token:?}");
    }
    assert_eq!(srv.take_changes().unwrap()["acc"], 3.0);
}

#[test]
fn a_public_address_without_a_token_is_refused() {
    let mut c = cfg(None);
    c.host = "0.0.0.0".into();
    let err = ControlServer::start(&c, weights(), 1).err().unwrap();
    assert!(err.contains("token"), "{err}");
    c.token = Some("t".into());
    c.host = "127.0.0.1".into();
    assert!(ControlServer::start(&c, weights(), 1).is_ok());
}

#[test]
fn load_test_on_loopback() {
    // 8 clients × 150 requests, a third of them invalid. No crash; every 2xx POST's value is a
    // valid one; the final weights are the value of some accepted POST; rejected requests never
    // leave a trace.
    let srv = ControlServer::start(&cfg(None), weights(), 10).unwrap();
    let addr = srv.addr;
    let t0 = std::time::Instant::now();
    let handles: Vec<_> = (0..8)
        .map(|c| {
            std::thread::spawn(move || {
                let mut accepted = Vec::new();
                let mut statuses = BTreeMap::<u16, usize>::new();
                let mut latencies = Vec::new();
                for i in 0..150u32 {
                    let t = std::time::Instant::now();
                    let (st, _) = match i % 3 {
                        0 => http(addr, "GET", "/api/v1/reward/weights", None, b""),
                        1 => {
                            let w = f64::from(c * 1000 + i);
                            let r = http(
                                addr,
                                "POST",
                                "/api/v1/reward/weights",
                                None,
                                format!("{{\"acc\": {w}}}").as_bytes(),
                            );
                            if r.0 == 200 {
                                accepted.push(w);
                            }
                            r
                        }
                        _ => http(
                            addr,
                            "POST",
                            "/api/v1/reward/weights",
                            None,
                            br#"{"acc": -5}"#,
                        ),
                    };
                    latencies.push(t.elapsed().as_secs_f64());
                    *statuses.entry(st).or_default() += 1;
                }
                (accepted, statuses, latencies)
            })
        })
        .collect();
    let mut accepted = Vec::new();
    let mut statuses = BTreeMap::<u16, usize>::new();
    let mut lat = Vec::new();
    for h in handles {
        let (a, s, l) = h.join().expect("client thread");
        accepted.extend(a);
        for (k, v) in s {
            *statuses.entry(k).or_default() += v;
        }
        lat.extend(l);
    }
    let secs = t0.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    eprintln!(
        "control load test: {} requests in {secs:.2} s ({:.0}/s), p50 {:.2} ms, p99 {:.2} ms, statuses {statuses:?}",
        lat.len(),
        lat.len() as f64 / secs,
        lat[lat.len() / 2] * 1e3,
        lat[lat.len() * 99 / 100] * 1e3
    );
    assert_eq!(
        statuses.get(&200),
        Some(&800),
        "every GET and valid POST answered 200"
    );
    assert_eq!(
        statuses.get(&422),
        Some(&400),
        "every invalid POST answered 422"
    );
    assert_eq!(accepted.len(), 400);
    let (_, body) = http(addr, "GET", "/api/v1/reward/weights", None, b"");
    let v: Value = serde_json::from_str(&body).unwrap();
    let final_acc = v["acc"].as_f64().unwrap();
    assert!(
        accepted.contains(&final_acc),
        "{final_acc} was never accepted"
    );
    assert_eq!(v["safety"], 0.5);
}

/// Sends `head` (no body follows) and returns what came back within `wait`, and how long it took.
fn send_head_only(addr: SocketAddr, head: &str, wait: std::time::Duration) -> (String, f64) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(wait)).unwrap();
    let t0 = std::time::Instant::now();
    s.write_all(head.as_bytes()).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    // Read until the server closes, or the wait runs out (the error ends the loop).
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    (
        String::from_utf8_lossy(&out).into_owned(),
        t0.elapsed().as_secs_f64(),
    )
}

#[test]
fn token_and_declared_size_are_checked_before_the_body_is_read() {
    let srv = ControlServer::start(&cfg(Some("s3cret")), weights(), 10).unwrap();
    let wait = std::time::Duration::from_secs(8);
    // No token, a 100-byte body declared and never sent: answered from the head alone.
    let head = format!(
        "POST /api/v1/reward/weights HTTP/1.1\r\nHost: {}\r\nContent-Length: 100\r\n\r\n",
        srv.addr
    );
    let (reply, secs) = send_head_only(srv.addr, &head, wait);
    assert!(
        reply.starts_with("HTTP/1.1 401"),
        "{reply:?} after {secs:.1} s"
    );
    assert!(
        secs < 5.0,
        "answered without waiting for the body: {secs:.1} s"
    );
    // The right token and a body far over the limit: 413 from the head alone.
    let head = format!(
        "POST /api/v1/reward/weights HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer s3cret\r\nContent-Length: 1000000000\r\n\r\n",
        srv.addr
    );
    let (reply, secs) = send_head_only(srv.addr, &head, wait);
    assert!(
        reply.starts_with("HTTP/1.1 413"),
        "{reply:?} after {secs:.1} s"
    );
    assert!(reply.contains("max_body_bytes"), "{reply}");
    assert!(secs < 5.0, "{secs:.1} s");
    assert!(srv.take_changes().is_none());
}

fn quick_limits() -> Limits {
    Limits {
        header_timeout: std::time::Duration::from_millis(1000),
        idle_timeout: std::time::Duration::from_millis(1000),
        connection_lifetime: std::time::Duration::from_secs(20),
        max_connections: 4,
    }
}

#[test]
fn silent_and_slow_clients_are_disconnected() {
    let srv = ControlServer::start_with(&cfg(None), weights(), 10, quick_limits()).unwrap();
    let wait = std::time::Duration::from_secs(10);
    // Connects and sends nothing.
    let (reply, secs) = send_head_only(srv.addr, "", wait);
    assert!(
        secs < 5.0,
        "a silent connection is closed: {secs:.1} s, {reply:?}"
    );
    // Sends its head one byte every 200 ms (never idle for long), so only the header timeout
    // can end it.
    let mut s = TcpStream::connect(srv.addr).unwrap();
    s.set_write_timeout(Some(std::time::Duration::from_secs(1)))
        .unwrap();
    let t0 = std::time::Instant::now();
    let head = b"GET /api/v1/reward/weights HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut cut_after = None;
    for b in head.iter() {
        // Once the server has closed, a write fails (the first may still be buffered).
        if s.write_all(&[*b]).is_err() {
            cut_after = Some(t0.elapsed().as_secs_f64());
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        if t0.elapsed().as_secs_f64() > 8.0 {
            break;
        }
    }
    let cut_after = cut_after.expect("the server closed a connection whose head took over 8 s");
    assert!(
        cut_after < 5.0,
        "closed by the 1 s header timeout, noticed after {cut_after:.1} s"
    );
    // The server still serves.
    let (st, _) = http(srv.addr, "GET", "/api/v1/reward/weights", None, b"");
    assert_eq!(st, 200);
}

#[test]
fn connections_beyond_the_cap_are_closed_and_the_server_recovers() {
    let srv = ControlServer::start_with(&cfg(None), weights(), 10, quick_limits()).unwrap();
    // Four idle connections take every slot; a fifth is closed on accept.
    let held: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(srv.addr).unwrap())
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let head = format!(
        "GET /api/v1/reward/weights HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        srv.addr
    );
    let (reply, _) = send_head_only(srv.addr, &head, std::time::Duration::from_secs(3));
    assert!(!reply.starts_with("HTTP/1.1 200"), "{reply:?}");
    // Once the idle ones time out, slots free up.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let (st, _) = http(srv.addr, "GET", "/api/v1/reward/weights", None, b"");
    assert_eq!(st, 200);
    drop(held);
}

/// One raw request: a plausible head (methods, paths, header lines and lengths that lie) and a
/// body, or bytes with no structure at all.
fn raw_request() -> impl Strategy<Value = Vec<u8>> {
    let method =
        proptest::sample::select(vec!["GET", "POST", "PUT", "get", "", "POST POST", "\u{0}"]);
    let path = prop_oneof![
        proptest::sample::select(vec![
            "/api/v1/reward/weights",
            "/api/v1/status",
            "/api/v1/reward/weights?x=1",
            "//api/v1/reward/weights",
            "/api/v1/reward/../reward/weights",
            "*",
            "",
        ])
        .prop_map(str::to_string),
        "[ -~]{0,40}",
    ];
    let version = proptest::sample::select(vec![
        "HTTP/1.1",
        "HTTP/1.0",
        "HTTP/2.0",
        "HTTP/1.1 extra",
        "",
    ]);
    let header = prop_oneof![
        (0u64..5000).prop_map(|n| format!("Content-Length: {n}")),
        Just("Content-Length: 18446744073709551616".to_string()),
        Just("Content-Length: -1".to_string()),
        Just("Content-Length: 5\r\nContent-Length: 7".to_string()),
        Just("Transfer-Encoding: chunked".to_string()),
        Just("Transfer-Encoding: gzip, chunked".to_string()),
        Just("Authorization: Bearer wrong".to_string()),
        Just("Authorization: Basic s3cret".to_string()),
        Just("Authorization: Bearer ".to_string()),
        Just("Expect: 100-continue".to_string()),
        Just("Connection: keep-alive".to_string()),
        Just("Host:".to_string()),
        Just(" folded: header".to_string()),
        Just("NoColon".to_string()),
        "[ -~]{0,30}",
    ];
    let body = prop_oneof![
        Just(br#"{"acc": 5}"#.to_vec()),
        Just(b"5\r\n{\"ac\r\n0\r\n\r\n".to_vec()),
        Just(b"ffffffffffffffff\r\n".to_vec()),
        proptest::collection::vec(any::<u8>(), 0..64),
    ];
    let structured = (
        method,
        path,
        version,
        proptest::collection::vec(header, 0..5),
        body,
    )
        .prop_map(|(m, p, v, hs, b)| {
            let mut out = format!("{m} {p} {v}\r\n");
            for h in hs {
                out.push_str(&h);
                out.push_str("\r\n");
            }
            out.push_str("\r\n");
            let mut bytes = out.into_bytes();
            bytes.extend_from_slice(&b);
            bytes
        });
    prop_oneof![
        4 => structured,
        1 => proptest::collection::vec(any::<u8>(), 0..200),
    ]
}

#[test]
fn any_bytes_from_a_client_are_refused_without_a_trace() {
    use proptest::test_runner::{Config, TestRunner};
    let srv =
        ControlServer::start_with(&cfg(Some("s3cret")), weights(), 10, quick_limits()).unwrap();
    let addr = srv.addr;
    let mut runner = TestRunner::new(Config {
        cases: 256,
        ..Config::default()
    });
    runner
        .run(&raw_request(), |bytes| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            let _ = s.write_all(&bytes);
            // End of request: the server sees EOF instead of waiting for more.
            let _ = s.shutdown(std::net::Shutdown::Write);
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
            let reply = String::from_utf8_lossy(&out);
            if !reply.is_empty() {
                let status: u16 = reply
                    .strip_prefix("HTTP/1.1 ")
                    .or_else(|| reply.strip_prefix("HTTP/1.0 "))
                    .and_then(|r| r.get(..3))
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(0);
                // Nothing without the token is served; malformed requests are refused (4xx,
                // or hyper's 501/505 for what HTTP/1.1 does not define); never a 5xx crash.
                proptest::prop_assert!(
                    (400..500).contains(&status) || status == 501 || status == 505,
                    "{:?} → {:?}",
                    String::from_utf8_lossy(&bytes),
                    reply
                );
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(srv.take_changes().is_none(), "nothing was changed");
    let (st, body) = http(addr, "GET", "/api/v1/reward/weights", Some("s3cret"), b"");
    assert_eq!(st, 200, "still serving");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"acc": 1.0, "safety": 0.5})
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

    /// The body parser alone: accepted updates hold only known sources with finite weights >= 0.
    #[test]
    fn any_body_is_a_valid_update_or_a_4xx(body in proptest::prop_oneof![
        proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        "[ -~]{0,64}".prop_map(String::into_bytes),
        (proptest::sample::select(vec!["acc", "safety", "other", ""]), proptest::sample::select(vec!["1", "-1", "0", "1e999", "\"2\"", "null", "[]", "0.5", "1e308"]))
            .prop_map(|(k, v)| format!("{{\"{k}\": {v}}}").into_bytes()),
    ]) {
        match parse_update(&body, &weights()) {
            Ok(u) => {
                proptest::prop_assert!(!u.is_empty());
                for (k, v) in &u {
                    proptest::prop_assert!(weights().contains_key(k));
                    proptest::prop_assert!(v.is_finite() && *v >= 0.0);
                }
            }
            Err(Reject(st, msg)) => {
                proptest::prop_assert!(st.is_client_error());
                proptest::prop_assert!(!msg.is_empty());
            }
        }
    }
}
