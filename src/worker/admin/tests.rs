//! The admin API against a local store on the fake shared data (the store fake keeps Envoy's
//! shared-data rules), request by request as an operator makes them.

use super::*;
use crate::json::read;
use crate::store::conformance::{attempt, claimed, done, scope, snapshot, LEASE};
use crate::store::fake::FakeSharedData;
use crate::store::local::LocalStore;
use crate::store::{Begin, ClaimAttempt, OnLeaseEnd};

/// What the worker does on the local store: each operation the request asks for, performed at once.
fn answer(cfg: &AdminConfig, s: &LocalStore<&FakeSharedData>, req: &AdminRequest) -> Answered {
    let mut progress = start(cfg, req);
    loop {
        match progress {
            Progress::Done(a) => return a,
            Progress::Ask(task, op) | Progress::Later(task, op) => {
                progress = task.answered(op.perform(s), req.now_ms)
            }
        }
    }
}

const TOKEN: &str = "s3cret-admin-token";

fn store(data: &FakeSharedData) -> LocalStore<&FakeSharedData> {
    LocalStore::open(data, 64, [1; 32], 0).unwrap()
}

fn cfg(token: bool) -> AdminConfig {
    AdminConfig { token_sha256: token.then(|| Sha256::digest(TOKEN.as_bytes()).into()) }
}

fn ask(
    cfg: &AdminConfig,
    s: &LocalStore<&FakeSharedData>,
    method: &str,
    path: &str,
    body: &str,
    now_ms: u64,
) -> (u16, String, Action) {
    let auth = format!("Bearer {TOKEN}");
    let req =
        AdminRequest { method, path, authorization: Some(auth.as_bytes()), body: body.as_bytes(), now_ms };
    let a = answer(cfg, s, &req);
    (a.reply.status, String::from_utf8(a.reply.body).unwrap(), a.action)
}

fn unknown_outcome_of(s: &LocalStore<&FakeSharedData>, n: u64) {
    claimed(s.begin(&attempt(n, 1, n * 10, 0)).unwrap());
    let refuse = ClaimAttempt { on_lease_end: OnLeaseEnd::MarkUnknown, ..attempt(n, 1, n * 10 + 1, LEASE) };
    assert_eq!(s.begin(&refuse).unwrap(), Begin::OutcomeUnknown);
}

#[test]
fn list_then_find_by_key_then_resolve_and_the_retry_replays() {
    let data = FakeSharedData::new();
    let s = store(&data);
    let c = claimed(s.begin(&attempt(1, 1, 1, 0)).unwrap());
    s.complete(&c, &done("one", 1)).unwrap();
    unknown_outcome_of(&s, 2);
    let (status, body, action) =
        ask(&cfg(true), &s, "GET", "/idempotency/records?state=outcome_unknown", "", LEASE + 1);
    assert_eq!((status, action), (200, Action::Listed), "{body}");
    let doc = read(body.as_bytes(), 8, MemberOrder::Document).unwrap();
    let Some(JsonValue::Array(records)) = doc.get("records") else { panic!("{body}") };
    assert_eq!(records.len(), 1, "{body}");
    let r = &records[0];
    assert_eq!(r.get("key"), Some(&JsonValue::String("key-2".into())));
    assert_eq!(r.get("route"), Some(&JsonValue::String("orders".into())));
    assert_eq!(r.get("state"), Some(&JsonValue::String("outcome_unknown".into())));
    assert_eq!(r.get("tag"), Some(&JsonValue::String(scope(2).log_tag().into())));
    let Some(JsonValue::String(created)) = r.get("created_at") else { panic!("{body}") };
    assert!(created.starts_with("1970-01-01T00:00:01"), "{created}");

    let resolve = format!("/idempotency/records/{}/resolve", scope(2).log_tag());
    let answer_body =
        r#"{"status":201,"headers":[["content-type","application/json"]],"body":"{\"paid\":true}"}"#;
    let (status, body, action) = ask(&cfg(true), &s, "POST", &resolve, answer_body, LEASE + 2);
    assert_eq!((status, action), (200, Action::Resolved), "{body}");
    let replay = s.begin(&attempt(2, 1, 99, LEASE + 3)).unwrap();
    let Begin::Replay(snap) = replay else { panic!("{replay:?}") };
    assert_eq!((snap.status, snap.body.as_slice()), (201, br#"{"paid":true}"#.as_slice()));
    // Once is enough: a known outcome is not resolved again.
    let (status, body, _) = ask(&cfg(true), &s, "POST", &resolve, answer_body, LEASE + 4);
    assert_eq!(status, 409, "{body}");
    // The detail view shows the stored response, credentials redacted.
    let c = claimed(s.begin(&attempt(3, 1, 3, 0)).unwrap());
    let mut with_cookie = snapshot("three");
    with_cookie.headers.push(("set-cookie".into(), b"session=abc".to_vec()));
    s.complete(&c, &crate::store::Completion { snapshot: Some(with_cookie), ..done("three", 1) }).unwrap();
    let (status, body, action) =
        ask(&cfg(true), &s, "GET", &format!("/idempotency/records/{}", hex(&scope(3).0)), "", 2);
    assert_eq!((status, action), (200, Action::LookedUp), "{body}");
    assert!(body.contains(r#"["set-cookie","[redacted]"]"#) && !body.contains("session=abc"), "{body}");
    assert!(body.contains(r#""status":201"#) && body.contains(r#""body_bytes":17"#), "{body}");
}

#[test]
fn release_lets_the_key_execute_and_a_live_claim_or_a_known_outcome_is_refused() {
    let data = FakeSharedData::new();
    let s = store(&data);
    unknown_outcome_of(&s, 1);
    claimed(s.begin(&attempt(2, 1, 2, LEASE)).unwrap());
    let release = |n: u64, q: &str| format!("/idempotency/records/{}/release{q}", scope(n).log_tag());
    let (status, body, _) = ask(&cfg(false), &s, "POST", &release(2, ""), "", LEASE + 1);
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("may still be at work") && body.contains("at the earliest"), "{body}");
    let (status, body, action) = ask(&cfg(false), &s, "POST", &release(1, ""), "", LEASE + 1);
    assert_eq!((status, action), (200, Action::Released), "{body}");
    assert!(matches!(s.begin(&attempt(1, 1, 7, LEASE + 2)).unwrap(), Begin::Claimed(_)));
    let c = claimed(s.begin(&attempt(3, 1, 3, 0)).unwrap());
    s.complete(&c, &done("three", 1)).unwrap();
    assert_eq!(ask(&cfg(false), &s, "POST", &release(3, ""), "", 2).0, 409);
    assert_eq!(ask(&cfg(false), &s, "POST", &release(3, "?force=true"), "", 2).0, 200);
    assert_eq!(ask(&cfg(false), &s, "POST", &release(3, "?force=true"), "", 3).0, 404);
}

#[test]
fn a_missing_or_wrong_token_gets_401_and_nothing_is_read() {
    let data = FakeSharedData::new();
    let s = store(&data);
    for auth in [None, Some("Bearer wrong"), Some("Basic czNjcmV0"), Some(TOKEN)] {
        let req = AdminRequest {
            method: "GET",
            path: "/idempotency/records",
            authorization: auth.map(str::as_bytes),
            body: b"",
            now_ms: 1,
        };
        let a = answer(&cfg(true), &s, &req);
        assert_eq!((a.reply.status, a.action), (401, Action::Unauthorized), "{auth:?}");
        assert!(a.reply.headers.iter().any(|(n, v)| n == "www-authenticate" && v == b"Bearer"));
    }
    assert_eq!(ask(&cfg(true), &s, "GET", "/idempotency/records", "", 1).0, 200);
}

#[test]
fn bad_requests_get_a_problem_that_says_what_is_wrong() {
    let data = FakeSharedData::new();
    let s = store(&data);
    unknown_outcome_of(&s, 1);
    let tag = scope(1).log_tag();
    let resolve = format!("/idempotency/records/{tag}/resolve");
    for (method, path, body, status, says) in [
        ("GET", "/idempotency/records?state=odd", "", 400, "state=odd"),
        ("GET", "/idempotency/records?limit=0", "", 400, "limit=0"),
        ("GET", "/idempotency/records/xyz", "", 400, "not a record id"),
        ("GET", "/idempotency/records/000000000000", "", 404, "no live record"),
        ("GET", "/other", "", 404, "not an admin path"),
        ("DELETE", "/idempotency/records", "", 405, "not allowed"),
        ("POST", resolve.as_str(), "{", 400, "the body"),
        ("POST", resolve.as_str(), r#"{"status":99}"#, 400, "status"),
        ("POST", resolve.as_str(), r#"{"status":201,"extra":1}"#, 400, "unknown member"),
        ("POST", resolve.as_str(), r#"{"status":201,"headers":[[":status","1"]]}"#, 400, "header name"),
        ("POST", resolve.as_str(), r#"{"status":201,"body":"a","body_base64":"YQ=="}"#, 400, "not both"),
    ] {
        let (got, body, action) = ask(&cfg(false), &s, method, path, body, LEASE + 1);
        assert_eq!((got, action), (status, Action::Refused), "{method} {path}: {body}");
        assert!(body.contains(says), "{method} {path}: {body}");
        assert!(body.contains("urn:idempotency-filter:"), "{body}");
    }
    // A base64 body.
    let (got, body, _) =
        ask(&cfg(false), &s, "POST", &resolve, r#"{"status":200,"body_base64":"aGk="}"#, LEASE + 1);
    assert_eq!(got, 200, "{body}");
    let Begin::Replay(snap) = s.begin(&attempt(1, 1, 5, LEASE + 2)).unwrap() else { panic!() };
    assert_eq!(snap.body, b"hi");
}

#[test]
fn a_list_stops_at_its_limit_and_says_it_was_truncated() {
    let data = FakeSharedData::new();
    let s = store(&data);
    for n in 1..=5 {
        claimed(s.begin(&attempt(n, 1, n, 0)).unwrap());
    }
    let (status, body, _) =
        ask(&cfg(false), &s, "GET", "/idempotency/records?state=processing&limit=2", "", 1);
    assert_eq!(status, 200);
    assert_eq!(body.matches("\"tag\"").count(), 2, "{body}");
    assert!(body.contains("\"truncated\":true,\"next\":\""), "{body}");
    // The cursor it gave shows the rest.
    let next = body.rsplit("\"next\":\"").next().unwrap().trim_end_matches("\"}").to_string();
    let path = format!("/idempotency/records?state=processing&limit=10&cursor={next}");
    let (_, rest, _) = ask(&cfg(false), &s, "GET", &path, "", 1);
    assert_eq!(rest.matches("\"tag\"").count(), 3, "{rest}");
    assert!(rest.ends_with("\"truncated\":false}"), "{rest}");
    let (status, _, _) = ask(&cfg(false), &s, "GET", "/idempotency/records?cursor=../x", "", 1);
    assert_eq!(status, 400);
    let (_, body, _) = ask(&cfg(false), &s, "GET", "/idempotency/records?route=other", "", 1);
    assert_eq!(body, "{\"records\":[],\"truncated\":false}");
    let (_, body, _) = ask(&cfg(false), &s, "GET", "/idempotency/records?key=key-4", "", 1);
    assert_eq!(body.matches("\"tag\"").count(), 1, "{body}");
    assert!(body.contains(&scope(4).log_tag()), "{body}");
}

/// A resolve's answer is replayed to clients as it is: a header value with CR, LF or NUL would
/// reach an HTTP/1.1 connection as a second response, a name that is no token or a hop-by-hop or
/// framing header would break the replay's framing, and 204 and 304 carry no body. Each is
/// refused with a problem naming what is wrong, and the record stays as it was.
#[test]
fn a_resolve_that_would_split_or_misframe_a_replay_is_refused_and_the_record_stays_unsettled() {
    let data = FakeSharedData::new();
    let s = store(&data);
    unknown_outcome_of(&s, 1);
    let resolve = format!("/idempotency/records/{}/resolve", scope(1).log_tag());
    for (body, says) in [
        (r#"{"status":201,"headers":[["x-a","1\r\nHTTP/1.1 200 OK"]]}"#, "x-a"),
        (r#"{"status":201,"headers":[["x-b","1\nset-cookie: a=b"]]}"#, "x-b"),
        (r#"{"status":201,"headers":[["x-c","1\r"]]}"#, "x-c"),
        (r#"{"status":201,"headers":[["x-d","a\u0000b"]]}"#, "x-d"),
        (r#"{"status":201,"headers":[["x e","1"]]}"#, "x e"),
        (r#"{"status":201,"headers":[["x(e)","1"]]}"#, "x(e)"),
        (r#"{"status":201,"headers":[["x:e","1"]]}"#, "x:e"),
        (r#"{"status":201,"headers":[["Transfer-Encoding","chunked"]]}"#, "transfer-encoding"),
        (r#"{"status":201,"headers":[["content-length","99"]]}"#, "content-length"),
        (r#"{"status":201,"headers":[["connection","close"]]}"#, "connection"),
        (r#"{"status":201,"headers":[["upgrade","h2c"]]}"#, "upgrade"),
        (r#"{"status":201,"headers":[["proxy-connection","x"]]}"#, "proxy-connection"),
        (r#"{"status":204,"body":"x"}"#, "204"),
        (r#"{"status":304,"body_base64":"eA=="}"#, "304"),
        (r#"{"status":101}"#, "status"),
    ] {
        let (got, problem, action) = ask(&cfg(false), &s, "POST", &resolve, body, LEASE + 1);
        assert_eq!((got, action), (400, Action::Refused), "{body}: {problem}");
        assert!(problem.contains(says), "{body}: {problem}");
    }
    assert_eq!(s.begin(&attempt(1, 1, 5, LEASE + 2)).unwrap(), Begin::OutcomeUnknown);
    // A tab inside a value, obs-text, and 204 or 304 without a body are answers a replay carries.
    for body in [
        r#"{"status":201,"headers":[["x-a","a\tb ü"]],"body":"ok"}"#,
        r#"{"status":204,"headers":[["x-a","1"]]}"#,
    ] {
        unknown_outcome_of(&s, 2);
        let resolve = format!("/idempotency/records/{}/resolve", scope(2).log_tag());
        let (got, problem, _) = ask(&cfg(false), &s, "POST", &resolve, body, LEASE + 1);
        assert_eq!(got, 200, "{body}: {problem}");
        let release = format!("/idempotency/records/{}/release?force=true", scope(2).log_tag());
        assert_eq!(ask(&cfg(false), &s, "POST", &release, "", LEASE + 1).0, 200);
    }
}

/// Two tenants' records of one key are told apart in the list by their scope, and `tenant=`
/// (or `host=`, in any case) narrows it; a record labelled by the previous build (route and key
/// only) lists with its scope fields null.
#[test]
fn a_list_names_each_records_scope_and_filters_by_tenant_and_host() {
    use crate::store::conformance::label_in;
    use crate::store::record::Label;
    let data = FakeSharedData::new();
    let s = store(&data);
    for (n, tenant) in [(1, Some("acme")), (2, Some("globex")), (3, None)] {
        claimed(
            s.begin(&ClaimAttempt { label: Some(label_in(tenant, "k")), ..attempt(n, 1, n, 0) }).unwrap(),
        );
    }
    claimed(
        s.begin(&ClaimAttempt { label: Some(Label::new("orders", "k")), ..attempt(4, 1, 4, 0) }).unwrap(),
    );
    // Each record's tag, tenant, host, method, path and principal.
    let records = |query: &str| -> Vec<[Option<String>; 6]> {
        let (status, body, _) = ask(&cfg(false), &s, "GET", &format!("/idempotency/records?{query}"), "", 1);
        assert_eq!(status, 200, "{body}");
        let doc = read(body.as_bytes(), 8, MemberOrder::Document).unwrap();
        let Some(JsonValue::Array(records)) = doc.get("records") else { panic!("{body}") };
        records
            .iter()
            .map(|r| {
                ["tag", "tenant", "host", "method", "path", "principal"].map(|name| match r.get(name) {
                    Some(JsonValue::String(s)) => Some(s.to_string()),
                    Some(JsonValue::Null) => None,
                    other => panic!("{name}: {other:?}"),
                })
            })
            .collect()
    };
    let all = records("key=k");
    let mut tenants: Vec<_> = all.iter().map(|r| r[1].clone()).collect();
    tenants.sort();
    assert_eq!(tenants, [None, None, Some("acme".into()), Some("globex".into())]);
    for [tag, _, host, method, path, principal] in all {
        let shown = [host, method, path, principal];
        if tag == Some(scope(4).log_tag()) {
            assert_eq!(shown, [None, None, None, None]);
        } else {
            assert_eq!(shown, ["api.example", "POST", "/orders", "07070707"].map(|s| Some(s.to_string())));
        }
    }
    let only = records("key=k&tenant=acme");
    assert_eq!(only.iter().map(|r| r[0].clone()).collect::<Vec<_>>(), [Some(scope(1).log_tag())]);
    assert_eq!(records("tenant=initech").len(), 0);
    assert_eq!(records("host=API.Example").len(), 3, "hosts are compared in lower case");
}

/// A list by key, a list in pages and a look-up by tag over a store far larger than one call may
/// read go in parts: each store call reads at most `SCAN_READS` keys (and a bucket's entries),
/// the admin task asks again from where the store stopped (`Progress::Later`), and the answer is
/// the one a single scan would give.
#[test]
fn a_scan_over_a_large_store_goes_in_bounded_parts_and_answers_as_one_scan_would() {
    use crate::store::local::admin::SCAN_READS;
    let data = FakeSharedData::new();
    let s = LocalStore::open(&data, 4_000, [1; 32], 0).unwrap();
    let n = 1_500;
    for i in 1..=n {
        claimed(s.begin(&attempt(i, 1, i, 0)).unwrap());
    }
    // Each store call, with the host reads it made; the answer.
    let run = |method: &str, path: &str, body: &str| -> (Vec<u64>, u16, String) {
        let req =
            AdminRequest { method, path, authorization: None, body: body.as_bytes(), now_ms: LEASE + 1 };
        let mut progress = start(&cfg(false), &req);
        let mut calls = Vec::new();
        loop {
            match progress {
                Progress::Done(a) => {
                    return (calls, a.reply.status, String::from_utf8(a.reply.body).unwrap())
                }
                Progress::Ask(task, op) | Progress::Later(task, op) => {
                    let before = data.io().gets;
                    let answer = op.perform(&s);
                    calls.push(data.io().gets - before);
                    progress = task.answered(answer, LEASE + 1);
                }
            }
        }
    };
    let bound = (SCAN_READS + 1 + 8) as u64;
    let (calls, status, body) = run("GET", "/idempotency/records?key=key-777", "");
    assert_eq!(status, 200, "{body}");
    assert!(calls.len() > 3 && calls.iter().all(|&r| r <= bound), "{calls:?}");
    assert_eq!(body.matches("\"tag\"").count(), 1, "{body}");
    assert!(body.contains(&scope(777).log_tag()) && body.ends_with("\"truncated\":false}"), "{body}");
    // In pages of 400: every record once, whatever the parts.
    let mut seen = std::collections::HashSet::new();
    let mut cursor = String::new();
    for page in 0.. {
        assert!(page < 10, "still more");
        let (calls, _, body) = run("GET", &format!("/idempotency/records?limit=400&cursor={cursor}"), "");
        assert!(calls.iter().all(|&r| r <= bound), "{calls:?}");
        for tag in body.split("\"tag\":\"").skip(1) {
            assert!(seen.insert(tag[..12].to_string()), "{tag} twice");
        }
        match body.split("\"next\":\"").nth(1) {
            Some(next) => cursor = next.trim_end_matches("\"}").to_string(),
            None => break,
        }
    }
    assert_eq!(seen.len(), n as usize);
    // By tag: looked up, and resolved, in parts too.
    unknown_outcome_of(&s, 5_000);
    let tag = scope(5_000).log_tag();
    let (calls, status, body) = run("GET", &format!("/idempotency/records/{tag}"), "");
    assert_eq!(status, 200, "{body}");
    // A tag's scan reads no slot but its record's: buckets only, 750 of them.
    assert!(calls.len() == 3 && calls.iter().all(|&r| r <= bound), "{calls:?}");
    let (_, status, body) =
        run("POST", &format!("/idempotency/records/{tag}/resolve"), r#"{"status":201,"body":"ok"}"#);
    assert_eq!((status, body.as_str()), (200, format!("{{\"resolved\":\"{tag}\"}}").as_str()));
}
