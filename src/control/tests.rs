//! The control API over real HTTP on loopback (a hand-written HTTP/1.1 client, so the server is
//! checked against the protocol rather than against a client library's leniency).

use std::io::{Read, Write};
use std::net::TcpStream;

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
