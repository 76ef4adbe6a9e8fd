//! Issue 19: over every order of the events around one key's detached call (its client leaves,
//! the call's answer, a retry, the lease's end) followed by a last retry, the key executes
//! once, and every retry that comes after the answer gets the replay. The host guarantees the
//! answer (or its timeout) comes before the lease ends (`upstream_timeout` < `processing_timeout`),
//! so the lease's end is ordered after the answer.

use super::pairs;
use crate::host::fake::{FakeHost, HostCall};
use crate::store::fake::permutations;
use crate::worker::http::Http;
use crate::worker::root::Root;

/// A route with `unknown_outcome: "takeover"`.
const CONFIG: &str = r#"{"store":{"type":"local","capacity":64},"routes":[
    {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"execution":"detached",
     "processing_timeout":"10s","upstream_timeout":"4s","unknown_outcome":"takeover"}]}"#;
/// The same route with the default `unknown_outcome`, refuse: then no answer at all (Envoy's
/// timeout) never executes twice either.
const REFUSE: &str = r#"{"store":{"type":"local","capacity":64},"routes":[
    {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"execution":"detached",
     "processing_timeout":"10s","upstream_timeout":"4s"}]}"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    ClientGone,
    Answer,
    Retry,
    LeaseEnd,
}

/// A POST of the key on a new stream `id`; the root then runs what it was handed.
fn post(h: &FakeHost, root: &mut Root<FakeHost>, id: u32) -> Http<FakeHost> {
    let mut http = root.http_context(id);
    h.0.effective.set(id);
    *h.0.request_headers.borrow_mut() =
        pairs(&[(":method", "POST"), (":path", "/pay"), (":authority", "a"), ("idempotency-key", "k")]);
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    http.on_request_headers(false);
    http.on_request_body(2, true);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    http
}

fn replies_to(h: &FakeHost, id: u32) -> Vec<(u16, bool)> {
    h.0.calls
        .borrow()
        .iter()
        .filter_map(|c| match c {
            HostCall::SendResponse { context, status, headers, .. } if *context == id => {
                Some((*status, headers.iter().any(|(n, _)| n == crate::engine::REPLAYED_HEADER)))
            }
            _ => None,
        })
        .collect()
}

/// C9, C16: in every order of the events the key executes once, and every retry after the
/// answer gets it replayed, or on a `refuse` rule whose call got no answer, 502.
#[test]
fn no_order_of_events_executes_a_key_twice() {
    let orders =
        permutations(&[Event::ClientGone, Event::Answer, Event::Retry, Event::Retry, Event::LeaseEnd]);
    let mut checked = 0;
    for order in orders {
        let answer_at = order.iter().position(|e| *e == Event::Answer).unwrap_or(0);
        if order.iter().position(|e| *e == Event::LeaseEnd) < Some(answer_at) {
            continue; // the host answers (or times out) before the lease ends
        }
        for (config, status) in [(CONFIG, "201"), (CONFIG, "422"), (REFUSE, "201"), (REFUSE, "timeout")] {
            let h = FakeHost::default();
            *h.0.config.borrow_mut() = config.as_bytes().to_vec();
            h.0.now_ms.set(1_000);
            h.0.clusters.borrow_mut().push("orders".into());
            h.0.properties.borrow_mut().insert("xds.cluster_name".into(), b"orders".to_vec());
            let mut root = Root::new(1, h.clone());
            assert!(root.on_configure());
            let mut streams = vec![post(&h, &mut root, 2)];
            let mut next_id = 3;
            let mut answered = false;
            let mut retries_after_answer = Vec::new();
            for event in &order {
                match event {
                    Event::ClientGone => {
                        h.0.effective.set(2);
                        streams[0].on_log();
                        h.0.gone.borrow_mut().push(2);
                    }
                    Event::Answer => {
                        let token = h.dispatches().iter().find_map(|c| match c {
                            HostCall::Dispatch { token, .. } => Some(*token),
                            _ => None,
                        });
                        if status == "timeout" {
                            // Envoy's own 504: no answer from the upstream.
                            *h.0.call_response_headers.borrow_mut() = pairs(&[(":status", "504")]);
                            *h.0.call_response_body.borrow_mut() = b"upstream request timeout".to_vec();
                        } else {
                            *h.0.call_response_headers.borrow_mut() =
                                pairs(&[(":status", status), ("x-envoy-upstream-service-time", "1")]);
                            *h.0.call_response_body.borrow_mut() = b"{}".to_vec();
                        }
                        h.0.now_ms.set(h.0.now_ms.get() + 50);
                        root.on_http_call_response(token.unwrap_or(0), 2);
                        answered = true;
                    }
                    Event::Retry => {
                        streams.push(post(&h, &mut root, next_id));
                        if answered {
                            retries_after_answer.push(next_id);
                        }
                        next_id += 1;
                    }
                    Event::LeaseEnd => {
                        h.0.now_ms.set(h.0.now_ms.get() + 10_001);
                        root.on_tick();
                    }
                }
            }
            let last = next_id;
            streams.push(post(&h, &mut root, last));
            retries_after_answer.push(last);
            let executions = h.dispatches().len();
            assert_eq!(executions, 1, "{order:?} {status}: executed {executions} times");
            for id in retries_after_answer {
                // The replay, or for an unknown outcome on a refuse rule its 502.
                let expected = match status.parse::<u16>() {
                    Ok(s) => (s, true),
                    Err(_) => (502, false),
                };
                assert_eq!(replies_to(&h, id), vec![expected], "{order:?} {status}: retry #{id}");
            }
            checked += 1;
        }
    }
    assert!(checked >= 200, "{checked} orders");
}
