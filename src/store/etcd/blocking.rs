//! (`testing`) A `RecordStore` over etcd that drives `EtcdConversation`s with a blocking client: the
//! conformance suite runs against a real etcd through exactly the conversations the filter performs
//! as callouts. Its own std::net HTTP/1.1 client carries JSON (the gateway); a test hands it a
//! `Transport` for gRPC (tests/etcd_conformance.rs has an HTTP/2 one). Never in the shipped filter
//! (no sockets in Wasm).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::store::etcd::{EtcdSettings, EtcdStore};
use crate::store::remote::{Answer, Next, Request};
use crate::store::{
    Amendment, Begin, Claim, ClaimAttempt, Completion, RecordPage, RecordQuery, RecordStore, RecordView,
    Refusal, Renew, Settled, StoreAnswer, StoreError, StoreOp,
};

/// A conversation makes a handful of calls; more means it is looping.
const MAX_CALLS: usize = 16;
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Carries one call to etcd at `addr` and hands back its answer (a failure: `status: None`).
pub trait Transport {
    fn call(&self, addr: SocketAddr, path: &str, body: &[u8], token: Option<&str>) -> Answer;
}

pub struct BlockingEtcd {
    pub addr: SocketAddr,
    store: EtcdStore,
    /// None: the HTTP/1.1 client below (JSON).
    transport: Option<Box<dyn Transport>>,
    /// (path, whether a token was sent) of every call made, for tests of the sequence.
    calls: std::cell::RefCell<Vec<(&'static str, bool)>>,
}

impl BlockingEtcd {
    pub fn new(addr: SocketAddr, settings: EtcdSettings) -> BlockingEtcd {
        BlockingEtcd {
            addr,
            store: EtcdStore::new(settings),
            transport: None,
            calls: std::cell::RefCell::new(Vec::new()),
        }
    }

    /// The conversations' calls go through `transport` (as gRPC needs; `post` stays HTTP/1.1).
    pub fn with_transport(
        addr: SocketAddr,
        settings: EtcdSettings,
        transport: Box<dyn Transport>,
    ) -> BlockingEtcd {
        BlockingEtcd { transport: Some(transport), ..BlockingEtcd::new(addr, settings) }
    }

    pub fn store(&self) -> &EtcdStore {
        &self.store
    }

    /// The calls made so far (path, token sent), oldest first.
    pub fn calls(&self) -> Vec<(&'static str, bool)> {
        self.calls.borrow().clone()
    }

    /// Carries out `op` with the clock at `now_ms` (the op's own time: the suite's clock is
    /// virtual, and leases are granted relative to it).
    pub fn perform(&self, op: StoreOp, now_ms: u64) -> StoreAnswer {
        self.perform_losing(op, now_ms, None).0
    }

    /// `perform`, except that the answer to call number `lose` (from 0), made for real, never
    /// reaches the conversation (a failed callout, as Envoy reports a timeout or a reset); also the
    /// claim the conversation then says may be in etcd (`EtcdConversation::unanswered_claim`).
    pub fn perform_losing(
        &self,
        op: StoreOp,
        now_ms: u64,
        lose: Option<usize>,
    ) -> (StoreAnswer, Option<Claim>) {
        let mut conversation = self.store.start(op);
        let mut answer = None;
        for call in 0..MAX_CALLS {
            match conversation.step(&self.store, answer.take(), now_ms) {
                Next::Done(done) => return (done, conversation.unanswered_claim()),
                // One conversation at a time: the token fetch is always this conversation's own.
                Next::Wait => {
                    let waiting =
                        StoreError::Unavailable("waiting for a token no conversation fetches".into());
                    return (StoreAnswer::Settled(Err(waiting)), None);
                }
                Next::Call(Request { path, body, token, .. }) => {
                    self.calls.borrow_mut().push((path, token.is_some()));
                    let answered = match &self.transport {
                        Some(t) => t.call(self.addr, path, &body, token.as_deref()),
                        None => self.post(path, &body, token.as_deref()),
                    };
                    answer = Some(if lose == Some(call) { Answer::default() } else { answered });
                }
            }
        }
        (StoreAnswer::Settled(Err(StoreError::Unavailable("the conversation did not finish".into()))), None)
    }

    /// One HTTP/1.1 POST on a fresh connection. Any I/O failure is a failed callout (no status),
    /// as Envoy reports a reset.
    pub fn post(&self, path: &str, body: &[u8], token: Option<&str>) -> Answer {
        post(self.addr, path, body, token)
    }
}

/// One HTTP/1.1 POST to etcd at `addr` on a fresh connection; any I/O failure is a failed callout
/// (no status), as Envoy reports a reset.
pub fn post(addr: SocketAddr, path: &str, body: &[u8], token: Option<&str>) -> Answer {
    try_post(addr, path, body, token).unwrap_or_default()
}

fn try_post(addr: SocketAddr, path: &str, body: &[u8], token: Option<&str>) -> std::io::Result<Answer> {
    let mut stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nhost: etcd\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    if let Some(t) = token {
        request.push_str(&format!("authorization: {t}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes())?;
    stream.write_all(body)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse_response(&raw).ok_or_else(|| std::io::Error::other("malformed HTTP response"))
}

fn parse_response(raw: &[u8]) -> Option<Answer> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let rest = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked { dechunk(rest)? } else { rest.to_vec() };
    Some(Answer { status: Some(status), body, grpc: None, from_envoy: false })
}

fn dechunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let end = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[end + 2..];
        if size == 0 {
            return Some(body);
        }
        body.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

fn begun(answer: StoreAnswer) -> Result<Begin, StoreError> {
    match answer {
        StoreAnswer::Begun(b) => b,
        StoreAnswer::Settled(Err(e)) => Err(e),
        other => Err(other.unexpected()),
    }
}

/// (`testing`) A `RecordStore` over any store on the one storage interface (`seam::Store`), its
/// calls made to the etcd of their shard (`Request::shard`, an index into `addrs`) with the
/// HTTP/1.1 client above: the conformance suite runs against a store in shards (and one whose
/// shard list is changing) exactly as the worker drives it.
pub struct BlockingSeam {
    pub addrs: Vec<SocketAddr>,
    store: Box<dyn crate::store::seam::Store>,
}

impl BlockingSeam {
    pub fn new(addrs: Vec<SocketAddr>, store: Box<dyn crate::store::seam::Store>) -> BlockingSeam {
        BlockingSeam { addrs, store }
    }

    pub fn perform(&self, op: StoreOp, now_ms: u64) -> StoreAnswer {
        let failed = |why: &str| StoreAnswer::Settled(Err(StoreError::Unavailable(why.into())));
        let mut conversation = match self.store.start(op, &|| now_ms) {
            crate::store::seam::Started::Answered(answer) => return answer,
            crate::store::seam::Started::Conversation(conversation) => conversation,
        };
        let mut answer = None;
        for _ in 0..MAX_CALLS * 2 {
            match conversation.step(answer.take(), now_ms) {
                Next::Done(done) => return done,
                Next::Wait => return failed("waiting for a token no conversation fetches"),
                Next::Call(Request { path, body, token, shard, .. }) => {
                    let Some(addr) = self.addrs.get(usize::from(shard)) else {
                        return failed("no such shard");
                    };
                    answer = Some(post(*addr, path, &body, token.as_deref()));
                }
            }
        }
        failed("the conversation did not finish")
    }
}

/// The `RecordStore` of a blocking driver whose `perform(op, now_ms)` carries out one operation:
/// each call as that operation, at its own time.
macro_rules! record_store_by_perform {
    ($driver:ty) => {
        impl RecordStore for $driver {
            fn begin(&self, attempt: &ClaimAttempt) -> Result<Begin, StoreError> {
                begun(self.perform(StoreOp::Begin(attempt.clone()), attempt.now_ms))
            }
            fn complete(&self, claim: &Claim, completion: &Completion) -> Result<Settled, StoreError> {
                let op = StoreOp::Complete { claim: *claim, completion: completion.clone() };
                self.perform(op, completion.now_ms).into_settled()
            }
            fn release(&self, claim: &Claim) -> Result<Settled, StoreError> {
                // A release writes no lease, so its clock does not matter.
                self.perform(StoreOp::Release(*claim), 0).into_settled()
            }
            /// Leases collect expired records (and expired ones already read as absent): nothing
            /// to sweep.
            fn sweep(&self, _now_ms: u64) -> Result<u32, StoreError> {
                Ok(0)
            }
            fn renew(&self, renew: &Renew) -> Result<Vec<crate::store::Kept>, StoreError> {
                self.perform(StoreOp::Renew(renew.clone()), renew.now_ms).into_renewed()
            }
            fn records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
                self.perform(StoreOp::Records(query.clone()), query.now_ms).into_records()
            }
            fn amend(
                &self,
                view: &RecordView,
                change: &Amendment,
                now_ms: u64,
            ) -> Result<Result<(), Refusal>, StoreError> {
                let op = StoreOp::Amend { view: Box::new(view.clone()), change: change.clone(), now_ms };
                self.perform(op, now_ms).into_amended()
            }
        }
    };
}

record_store_by_perform!(BlockingEtcd);
record_store_by_perform!(BlockingSeam);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_with_length_or_chunks_are_read() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}";
        assert_eq!(
            parse_response(plain),
            Some(Answer { status: Some(200), body: b"{}".to_vec(), grpc: None, from_envoy: false })
        );
        let chunked = b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n";
        assert_eq!(
            parse_response(chunked),
            Some(Answer { status: Some(404), body: b"{\"a\":1}".to_vec(), grpc: None, from_envoy: false })
        );
        assert_eq!(parse_response(b"garbage"), None);
    }
}
