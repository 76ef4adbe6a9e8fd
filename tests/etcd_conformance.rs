//! The store conformance suite against a real etcd, through the same conversations the filter
//! performs as callouts (`BlockingEtcd` drives them over std::net).
//!
//! Needs the `etcd` binary (Debian's etcd-server; `make etcd`, or `ETCD_BIN`): without it these
//! tests FAIL rather than skip, so a missing etcd cannot pass for a green run. One etcd process
//! serves the tests that overlap in time (each test works under its own key prefix); it runs on
//! free loopback ports with a temporary data directory and is killed when the last test using
//! it ends, panicking or not.

// Test code: a failed setup is the test's failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency_filter::codec::base64;
use idempotency_filter::store::conformance::Backend;
use idempotency_filter::store::conformance::{attempt, claimed};
use idempotency_filter::store::etcd::blocking::BlockingEtcd;
use idempotency_filter::store::etcd::{EtcdAuth, EtcdSettings, OnStoreError};
use idempotency_filter::store::{Begin, ClaimAttempt, Completion, RecordStore, Settled, StoreError};

/// A running etcd, killed (and its data directory removed) on drop.
struct EtcdProcess {
    child: Child,
    addr: SocketAddr,
    dir: std::path::PathBuf,
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Two distinct ports on 127.0.0.1 that were free a moment ago: both listeners are held until
/// both ports are known, since the kernel may hand one port to two binds in a row once the first
/// is closed (etcd then gets one port as its client and its peer port, and cannot start).
fn free_ports() -> (u16, u16) {
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    (a.local_addr().unwrap().port(), b.local_addr().unwrap().port())
}

/// Where a test etcd keeps its data: tmpfs (`/dev/shm`) where the machine has it, so a slow disk's
/// fsync (seconds, seen on CI) does not turn into the store's timeouts; what these tests check
/// does not depend on etcd's durability.
fn etcd_data_root() -> std::path::PathBuf {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

fn healthy(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    if s.write_all(b"GET /health HTTP/1.1\r\nhost: etcd\r\nconnection: close\r\n\r\n").is_err() {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200") && out.contains("\"health\":\"true\"")
}

fn start_etcd() -> EtcdProcess {
    start_etcd_with(&[])
}

fn start_etcd_with(extra: &[&str]) -> EtcdProcess {
    static STARTS: AtomicU32 = AtomicU32::new(0);
    let bin = std::env::var("ETCD_BIN").unwrap_or_else(|_| "etcd".into());
    let dir = etcd_data_root().join(format!(
        "idem-etcd-{}-{}",
        std::process::id(),
        STARTS.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (client, peer) = free_ports();
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
    let child = Command::new(&bin)
        .args(["--name", "conformance", "--data-dir"])
        .arg(dir.join("data"))
        .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("conformance={peer_url}")])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {bin} (install etcd-server: make etcd): {e}"));
    let mut etcd = EtcdProcess { child, addr: SocketAddr::from(([127, 0, 0, 1], client)), dir };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !healthy(etcd.addr) {
        if let Ok(Some(status)) = etcd.child.try_wait() {
            let log = std::fs::read_to_string(etcd.dir.join("etcd.log")).unwrap_or_default();
            panic!("etcd exited ({status}) before it was healthy:\n{log}");
        }
        assert!(Instant::now() < deadline, "etcd was not healthy within 20 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    etcd
}

/// The etcd shared by the tests running now: started by the first, killed with the last.
static SHARED: Mutex<Option<(Arc<EtcdProcess>, usize)>> = Mutex::new(None);

struct EtcdUse(Arc<EtcdProcess>);

impl EtcdUse {
    fn acquire() -> EtcdUse {
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        let (etcd, users) = shared.get_or_insert_with(|| (Arc::new(start_etcd()), 0));
        *users += 1;
        EtcdUse(Arc::clone(etcd))
    }
}

impl Drop for EtcdUse {
    fn drop(&mut self) {
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, users)) = shared.as_mut() {
            *users -= 1;
            if *users == 0 {
                // Dropping the last Arc kills etcd.
                *shared = None;
            }
        }
    }
}

/// One run of the suite against the shared etcd: its own key prefix, and `F` says how its
/// workers reach etcd.
struct EtcdWith<F> {
    etcd: EtcdUse,
    prefix: String,
    flavor: std::marker::PhantomData<F>,
}

/// How a run's workers reach etcd: their settings (from the run's prefix) and their client.
trait Flavor {
    fn worker(addr: SocketAddr, settings: EtcdSettings) -> BlockingEtcd;
}

/// The JSON gateway, as the filter's default store does.
struct Gateway;

impl Flavor for Gateway {
    fn worker(addr: SocketAddr, settings: EtcdSettings) -> BlockingEtcd {
        BlockingEtcd::new(addr, settings)
    }
}

type Etcd = EtcdWith<Gateway>;

fn settings(prefix: &str) -> EtcdSettings {
    EtcdSettings {
        cluster: "etcd".into(),
        authority: "etcd".into(),
        prefix: prefix.into(),
        timeout_ms: 250,
        on_error: OnStoreError::FailClosed,
        auth: None,
        auth_timeout_ms: 2_000,
        replay_cache: None,
        protocol: Default::default(),
        shards: Vec::new(),
        previous_shards: Vec::new(),
    }
}

impl<F: Flavor> Backend for EtcdWith<F> {
    // etcd has no capacity bound: no new record is ever refused for room (the suite's Full
    // cases state what an unbounded store must do instead).
    const BOUNDED: bool = false;
    // Leases collect expired records; `sweep` has nothing to reclaim.
    const RECLAIMS_BY_SWEEP: bool = false;

    fn with_capacity(_capacity: u32) -> Self {
        static TESTS: AtomicU32 = AtomicU32::new(0);
        let prefix = format!("/idem-test/{}/", TESTS.fetch_add(1, Ordering::SeqCst));
        EtcdWith { etcd: EtcdUse::acquire(), prefix, flavor: std::marker::PhantomData }
    }

    fn worker(&self, _n: u8) -> Box<dyn RecordStore + '_> {
        // Each worker has its own EtcdStore (lease cache, token), as each Envoy worker does.
        Box::new(F::worker(self.etcd.0.addr, settings(&self.prefix)))
    }

    fn let_claim_leases_end(&self) {
        wait_for_claim_leases();
    }

    fn let_part_of_a_claim_lease_pass(&self) {
        wait_part_of_a_claim_lease();
    }
}

/// Twice this outlives a claim's first lease key (`wait_for_claim_leases`), once does not.
fn wait_part_of_a_claim_lease() {
    std::thread::sleep(Duration::from_millis(2_500));
}

/// A claim's lease key lives on an etcd lease, by etcd's clock: the suite's LEASE (1 s), then
/// its completion's retry window (one LEASE more), the reuse window (1 s) and 1 s of slack, then
/// etcd's lease checker (every 500 ms).
fn wait_for_claim_leases() {
    std::thread::sleep(Duration::from_millis(4_000 + 700));
}

idempotency_filter::conformance_suite!(Etcd);

/// Two more etcds beside the shared one, for the suite over a store in shards: started with the
/// first case that needs them, stopped with the last.
type TwoEtcds = Arc<(EtcdProcess, EtcdProcess)>;

static MORE: Mutex<Option<(TwoEtcds, usize)>> = Mutex::new(None);

struct MoreUse(TwoEtcds);

impl MoreUse {
    fn acquire() -> MoreUse {
        let mut more = MORE.lock().unwrap_or_else(|p| p.into_inner());
        let (etcds, users) = more.get_or_insert_with(|| (Arc::new((start_etcd(), start_etcd())), 0));
        *users += 1;
        MoreUse(Arc::clone(etcds))
    }
}

impl Drop for MoreUse {
    fn drop(&mut self) {
        let mut more = MORE.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, users)) = more.as_mut() {
            *users -= 1;
            if *users == 0 {
                *more = None;
            }
        }
    }
}

/// The same suite over a store in three shards, three etcds (`store.shards`): every operation
/// through the one storage interface, each call to its shard's etcd; and over the same store in
/// the middle of a change from two shards to three (`store.previous_shards`), where a record
/// whose home moves is claimed and settled on both homes.
mod in_shards {
    use super::*;
    use idempotency_filter::config::etcd::EtcdShard;
    use idempotency_filter::store::etcd::blocking::BlockingSeam;
    use idempotency_filter::store::etcd::shards::EtcdShards;

    pub struct Sharded<const MOVING: bool> {
        etcd: EtcdUse,
        more: MoreUse,
        prefix: String,
    }

    impl<const MOVING: bool> Sharded<MOVING> {
        fn settings(&self) -> EtcdSettings {
            EtcdSettings {
                shards: vec![shard("etcd-a"), shard("etcd-b"), shard("etcd-c")],
                previous_shards: if MOVING { vec![shard("etcd-a"), shard("etcd-b")] } else { Vec::new() },
                ..settings(&self.prefix)
            }
        }
    }

    fn shard(cluster: &str) -> EtcdShard {
        EtcdShard { cluster: cluster.into(), authority: "etcd".into(), auth: None }
    }

    impl<const MOVING: bool> Backend for Sharded<MOVING> {
        const BOUNDED: bool = false;
        const RECLAIMS_BY_SWEEP: bool = false;

        fn with_capacity(_capacity: u32) -> Self {
            static TESTS: AtomicU32 = AtomicU32::new(0);
            let prefix = format!("/idem-shards-{MOVING}/{}/", TESTS.fetch_add(1, Ordering::SeqCst));
            Sharded { etcd: EtcdUse::acquire(), more: MoreUse::acquire(), prefix }
        }

        fn worker(&self, _n: u8) -> Box<dyn RecordStore + '_> {
            let addrs = vec![self.etcd.0.addr, self.more.0 .0.addr, self.more.0 .1.addr];
            Box::new(BlockingSeam::new(addrs, Box::new(EtcdShards::new(&self.settings()))))
        }

        fn let_claim_leases_end(&self) {
            wait_for_claim_leases();
        }

        fn let_part_of_a_claim_lease_pass(&self) {
            wait_part_of_a_claim_lease();
        }
    }

    mod fixed {
        idempotency_filter::conformance_suite!(super::Sharded<false>, quotas per shard);
    }

    mod changing {
        idempotency_filter::conformance_suite!(super::Sharded<true>, quotas per shard);
    }

    /// With shards, a quota bounds a caller's live records on each shard (each etcd counts its
    /// own): the bound's records on one shard, then the next is refused there while another
    /// shard still takes the caller's new records.
    #[test]
    fn a_quota_bounds_a_callers_records_on_each_shard() {
        use idempotency_filter::store::conformance::charged;
        let b = Sharded::<false>::with_capacity(0);
        let w = b.worker(0);
        let homes = EtcdShards::new(&b.settings());
        let bounds = (100, 2);
        let mut by_home: [Vec<u64>; 3] = Default::default();
        for n in 1..400u64 {
            let home = usize::from(homes.home(&charged(n, 1, 0, 1, None, bounds).scope));
            by_home[home].push(n);
        }
        assert!(by_home.iter().all(|scopes| scopes.len() >= 3), "{by_home:?}");
        let mut owner = 10;
        for scopes in &by_home[..2] {
            for n in &scopes[..2] {
                owner += 1;
                claimed(w.begin(&charged(*n, owner, owner, 1, None, bounds)).unwrap());
            }
            owner += 1;
            let refused = w.begin(&charged(scopes[2], owner, owner, 1, None, bounds)).unwrap();
            assert!(matches!(refused, Begin::QuotaExceeded { tenant: false, .. }), "{refused:?}");
        }
        // The third shard has none of the caller's records yet.
        claimed(w.begin(&charged(by_home[2][0], 99, 99, 1, None, bounds)).unwrap());
    }
}

/// The same suite with each worker's replay cache on: answers from the cache must be the ones
/// etcd gives (replays, mismatches, expiry in virtual time, takeovers of expired records).
mod with_replay_cache {
    use super::*;
    use idempotency_filter::store::etcd::cache::ReplayCacheSettings;

    pub struct Cached;

    impl Flavor for Cached {
        fn worker(addr: SocketAddr, settings: EtcdSettings) -> BlockingEtcd {
            let replay_cache = Some(ReplayCacheSettings { entries: 4, max_bytes: 1 << 20 });
            BlockingEtcd::new(addr, EtcdSettings { replay_cache, ..settings })
        }
    }

    idempotency_filter::conformance_suite!(EtcdWith<Cached>);
}

/// The same suite over etcd's gRPC API (`store.protocol: "grpc"`): every conversation's calls encoded
/// as protobuf, carried over HTTP/2, and etcd's answers and errors read from gRPC.
mod over_grpc {
    use super::*;
    use idempotency_filter::store::etcd::blocking::Transport;
    use idempotency_filter::store::etcd::Protocol;
    use idempotency_filter::store::remote::{Answer, GrpcStatus};

    /// A blocking HTTP/2 (h2c, prior knowledge) client: one connection per call, as the HTTP/1.1
    /// one; what Envoy's HTTP/2 cluster does for the filter.
    pub struct H2;

    async fn call(addr: SocketAddr, path: &str, body: &[u8], token: Option<&str>) -> Option<Answer> {
        let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
        let (client, connection) = h2::client::handshake(tcp).await.ok()?;
        tokio::spawn(connection);
        let mut client = client.ready().await.ok()?;
        let mut request = http::Request::builder()
            .method("POST")
            .uri(format!("http://etcd{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        if let Some(t) = token {
            request = request.header("token", t);
        }
        let (response, mut send) = client.send_request(request.body(()).ok()?, false).ok()?;
        send.send_data(bytes::Bytes::copy_from_slice(body), true).ok()?;
        let (head, mut recv) = response.await.ok()?.into_parts();
        let mut data = Vec::new();
        while let Some(chunk) = recv.data().await {
            let chunk = chunk.ok()?;
            let _ = recv.flow_control().release_capacity(chunk.len());
            data.extend_from_slice(&chunk);
        }
        let trailers = recv.trailers().await.ok()?;
        // Trailers, or the headers of a trailers-only answer.
        let status_from = |map: &http::HeaderMap| {
            let code = map.get("grpc-status")?.to_str().ok()?.parse().ok()?;
            let message = map.get("grpc-message").and_then(|m| m.to_str().ok()).unwrap_or("").to_owned();
            Some(GrpcStatus { code, message })
        };
        let grpc = trailers.as_ref().and_then(status_from).or_else(|| status_from(&head.headers));
        Some(Answer { status: Some(head.status.as_u16()), body: data, grpc, from_envoy: false })
    }

    impl Transport for H2 {
        fn call(&self, addr: SocketAddr, path: &str, body: &[u8], token: Option<&str>) -> Answer {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()
            else {
                return Answer::default();
            };
            let answer = runtime.block_on(async {
                tokio::time::timeout(Duration::from_secs(5), call(addr, path, body, token))
                    .await
                    .ok()
                    .flatten()
            });
            answer.unwrap_or_default()
        }
    }

    pub struct Grpc;

    impl Flavor for Grpc {
        fn worker(addr: SocketAddr, settings: EtcdSettings) -> BlockingEtcd {
            BlockingEtcd::with_transport(
                addr,
                EtcdSettings { protocol: Protocol::Grpc, ..settings },
                Box::new(H2),
            )
        }
    }

    idempotency_filter::conformance_suite!(EtcdWith<Grpc>);
}

/// A begin whose claim landed in etcd but whose answer was lost (Envoy's timeout, a reset):
/// nobody forwards that request, so its claim is given back by its owner token (the claim's
/// lease key) instead of blocking the key until its lease ends, and then, on a rule that refuses
/// unknown outcomes, reading as one for the whole ttl. A late give-back never touches a claim
/// that has become someone else's.
fn an_unanswered_claim_is_given_back_by_its_owner<F: Flavor>() {
    use idempotency_filter::store::StoreOp;
    let b = EtcdWith::<F>::with_capacity(0);
    let lost = F::worker(b.etcd.0.addr, settings(&b.prefix));
    let other = b.worker(1);
    let t = 1_000_000;
    // A claim made moments ago: this worker has its leases, so a claim is one transaction.
    claimed(lost.begin(&attempt(9, 1, 10, t)).unwrap());
    let (answer, in_doubt) = lost.perform_losing(StoreOp::Begin(attempt(1, 1, 11, t)), t, Some(0));
    assert!(matches!(answer, idempotency_filter::store::StoreAnswer::Begun(Err(StoreError::Unavailable(_)))));
    let in_doubt = in_doubt.expect("the claim went out and its answer was lost");
    // It landed: another Envoy's retry finds it in flight.
    assert!(matches!(other.begin(&attempt(1, 1, 12, t + 10)).unwrap(), Begin::InFlight { .. }));
    assert_eq!(lost.release(&in_doubt).unwrap(), Settled::Done);
    // Given back: the retry claims the key at once, within what was the lease.
    let retried = claimed(other.begin(&attempt(1, 1, 12, t + 20)).unwrap());
    // The same give-back arriving late (tried again after a lost answer) finds another owner's
    // claim, and leaves it.
    assert_eq!(lost.release(&in_doubt).unwrap(), Settled::Done);
    assert!(matches!(lost.begin(&attempt(1, 1, 13, t + 30)).unwrap(), Begin::InFlight { .. }));
    assert_eq!(other.release(&retried).unwrap(), Settled::Done);

    // A claim in doubt that another Envoy took over once its lease ended: the late give-back
    // leaves the new owner's claim.
    let (_, in_doubt) = lost.perform_losing(StoreOp::Begin(attempt(2, 1, 14, t)), t, Some(0));
    let in_doubt = in_doubt.expect("the claim went out and its answer was lost");
    b.let_claim_leases_end();
    let later = t + idempotency_filter::store::conformance::LEASE;
    let taken = other.begin(&attempt(2, 1, 15, later)).unwrap();
    assert!(matches!(taken, Begin::TookOver(_)), "{taken:?}");
    assert_eq!(lost.release(&in_doubt).unwrap(), Settled::Done);
    assert!(matches!(lost.begin(&attempt(2, 1, 16, later + 10)).unwrap(), Begin::InFlight { .. }));
}

#[test]
fn an_unanswered_claim_is_given_back_by_its_owner_over_the_gateway() {
    an_unanswered_claim_is_given_back_by_its_owner::<Gateway>();
}

#[test]
fn an_unanswered_claim_is_given_back_by_its_owner_over_grpc() {
    an_unanswered_claim_is_given_back_by_its_owner::<over_grpc::Grpc>();
}

/// Auth against a real etcd: a role limited to the store's prefix, a token fetched on the first
/// call, and a token etcd expired (simple tokens live `--auth-token-ttl` seconds) replaced once.
#[test]
fn auth_with_a_real_etcd_and_an_expiring_token() {
    let etcd = start_etcd_with(&["--auth-token", "simple", "--auth-token-ttl", "1"]);
    let admin = BlockingEtcd::new(etcd.addr, settings("/unused/"));
    let b64 = |s: &str| base64::encode(s.as_bytes());
    let setup = [
        ("/v3/auth/role/add", r#"{"name":"root"}"#.to_owned()),
        ("/v3/auth/user/add", r#"{"name":"root","password":"rootpw"}"#.to_owned()),
        ("/v3/auth/user/grant", r#"{"user":"root","role":"root"}"#.to_owned()),
        ("/v3/auth/role/add", r#"{"name":"idem"}"#.to_owned()),
        (
            "/v3/auth/role/grant",
            format!(
                r#"{{"name":"idem","perm":{{"permType":"READWRITE","key":"{}","range_end":"{}"}}}}"#,
                b64("/auth-test/"),
                b64("/auth-test0")
            ),
        ),
        ("/v3/auth/user/add", r#"{"name":"idem","password":"idem-pw"}"#.to_owned()),
        ("/v3/auth/user/grant", r#"{"user":"idem","role":"idem"}"#.to_owned()),
        ("/v3/auth/enable", "{}".to_owned()),
    ];
    for (path, body) in setup {
        let answer = admin.post(path, body.as_bytes(), None);
        assert_eq!(answer.status, Some(200), "{path}: {}", String::from_utf8_lossy(&answer.body));
    }
    let auth = Some(EtcdAuth { username: "idem".into(), password: "idem-pw".into() });
    let worker = BlockingEtcd::new(etcd.addr, EtcdSettings { auth, ..settings("/auth-test/") });
    let c = claimed(worker.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(worker.calls().first(), Some(&("/v3/auth/authenticate", false)));
    assert!(worker.calls()[1..].iter().all(|(_, token)| *token), "{:?}", worker.calls());
    // The token expires; the next conversation is refused once, authenticates again and goes on.
    std::thread::sleep(Duration::from_millis(2_500));
    let before = worker.calls().len();
    assert_eq!(worker.release(&c).unwrap(), Settled::Done);
    let after: Vec<_> = worker.calls()[before..].iter().map(|(path, _)| *path).collect();
    // One guarded txn (the claim carries its record), refused once, then sent again.
    assert_eq!(after, vec!["/v3/kv/txn", "/v3/auth/authenticate", "/v3/kv/txn"]);
    // Without credentials etcd refuses: unavailable, never a guess.
    let anonymous = BlockingEtcd::new(etcd.addr, settings("/auth-test/"));
    assert!(matches!(anonymous.begin(&attempt(2, 1, 12, 0)), Err(StoreError::Unavailable(_))));
    // Outside its prefix the role has no rights: unavailable too.
    let auth = Some(EtcdAuth { username: "idem".into(), password: "idem-pw".into() });
    let elsewhere = BlockingEtcd::new(etcd.addr, EtcdSettings { auth, ..settings("/other/") });
    assert!(matches!(elsewhere.begin(&attempt(3, 1, 13, 0)), Err(StoreError::Unavailable(_))));
}

/// An auth change elsewhere (a user added by an operator) makes etcd refuse every range and txn
/// made with a JWT token issued before it ("revision of auth store is old", until the token
/// expires); a worker authenticates again once and its call goes through.
#[test]
fn a_token_issued_before_an_auth_change_is_replaced() {
    let dir = std::env::temp_dir().join(format!("idem-jwt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key = dir.join("hs256.key");
    std::fs::write(&key, b"a-test-only-hmac-secret-of-32-bytes!").unwrap();
    let token_option = format!("jwt,priv-key={},sign-method=HS256,ttl=10m", key.display());
    let etcd = start_etcd_with(&["--auth-token", &token_option]);
    let admin = BlockingEtcd::new(etcd.addr, settings("/unused/"));
    enable_auth(&admin, "/old-rev/");
    let auth = Some(EtcdAuth { username: "idem".into(), password: "idem-pw".into() });
    let worker = BlockingEtcd::new(etcd.addr, EtcdSettings { auth, ..settings("/old-rev/") });
    claimed(worker.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(worker.calls().iter().filter(|(p, _)| *p == "/v3/auth/authenticate").count(), 1);

    // The operator adds a user: the auth store's revision moves past the worker's token.
    let root = admin.post("/v3/auth/authenticate", br#"{"name":"root","password":"rootpw"}"#, None);
    let root = String::from_utf8(root.body).unwrap();
    let root = root.split("\"token\":\"").nth(1).and_then(|t| t.split('"').next()).unwrap().to_owned();
    let added = admin.post("/v3/auth/user/add", br#"{"name":"other","password":"other-pw"}"#, Some(&root));
    assert_eq!(added.status, Some(200), "{}", String::from_utf8_lossy(&added.body));

    let before = worker.calls().len();
    claimed(worker.begin(&attempt(2, 1, 12, 1)).unwrap());
    let after: Vec<_> = worker.calls()[before..].iter().map(|(path, _)| *path).collect();
    // The claim's one txn (its leases cached), refused once, then sent again.
    assert_eq!(after, vec!["/v3/kv/txn", "/v3/auth/authenticate", "/v3/kv/txn"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Users root and idem (read-write on `prefix` only), then auth enabled.
fn enable_auth(admin: &BlockingEtcd, prefix: &str) {
    let b64 = |s: &str| base64::encode(s.as_bytes());
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    let setup = [
        ("/v3/auth/role/add", r#"{"name":"root"}"#.to_owned()),
        ("/v3/auth/user/add", r#"{"name":"root","password":"rootpw"}"#.to_owned()),
        ("/v3/auth/user/grant", r#"{"user":"root","role":"root"}"#.to_owned()),
        ("/v3/auth/role/add", r#"{"name":"idem"}"#.to_owned()),
        (
            "/v3/auth/role/grant",
            format!(
                r#"{{"name":"idem","perm":{{"permType":"READWRITE","key":"{}","range_end":"{}"}}}}"#,
                b64(prefix),
                base64::encode(&end)
            ),
        ),
        ("/v3/auth/user/add", r#"{"name":"idem","password":"idem-pw"}"#.to_owned()),
        ("/v3/auth/user/grant", r#"{"user":"idem","role":"idem"}"#.to_owned()),
        ("/v3/auth/enable", "{}".to_owned()),
    ];
    for (path, body) in setup {
        let answer = admin.post(path, body.as_bytes(), None);
        assert_eq!(answer.status, Some(200), "{path}: {}", String::from_utf8_lossy(&answer.body));
    }
}

/// Workers on several threads (as on several Envoys) racing for the same keys: exactly one
/// claim per key, every other answer in flight.
#[test]
fn racing_threads_make_exactly_one_claim_per_key() {
    let b = Etcd::with_capacity(0);
    let (addr, prefix) = (b.etcd.0.addr, b.prefix.clone());
    let answers: Vec<Vec<Begin>> = std::thread::scope(|s| {
        let racers: Vec<_> = (0..4u64)
            .map(|t| {
                let prefix = prefix.clone();
                s.spawn(move || {
                    let worker = BlockingEtcd::new(addr, settings(&prefix));
                    (1..=16u64).map(|n| worker.begin(&attempt(n, 1, t * 100 + n, 0)).unwrap()).collect()
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for n in 0..16 {
        let claims = answers.iter().filter(|a| matches!(a[n], Begin::Claimed(_))).count();
        assert_eq!(claims, 1, "key {n}: {:?}", answers.iter().map(|a| &a[n]).collect::<Vec<_>>());
        assert!(answers.iter().all(|a| matches!(a[n], Begin::Claimed(_) | Begin::InFlight { .. })));
    }
}

/// In real time, a record's etcd lease outlives the record: a claim's covers its ttl, and a
/// completion moves the record to a lease covering its new expiry.
#[test]
fn a_records_lease_never_ends_before_the_record() {
    use idempotency_filter::json::{self, JsonValue, MemberOrder};
    let b = Etcd::with_capacity(0);
    let worker = BlockingEtcd::new(b.etcd.0.addr, settings(&b.prefix));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let remaining_ms = |scope_n: u64| -> u64 {
        let lease = record_lease(&worker, &b.prefix, scope_n);
        let asked = format!(r#"{{"ID":"{lease}"}}"#);
        let alive = worker.post("/v3/lease/timetolive", asked.as_bytes(), None);
        let doc = json::read(&alive.body, 16, MemberOrder::Document).unwrap();
        let Some(JsonValue::String(ttl)) = doc.get("TTL") else { panic!("no TTL: {doc:?}") };
        ttl.parse::<u64>().unwrap() * 1_000
    };
    let mut first = attempt(1, 1, 11, now);
    first.ttl_ms = 10_000;
    let c = claimed(worker.begin(&first).unwrap());
    let elapsed = || {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64 - now
    };
    assert!(remaining_ms(1) + elapsed() >= 10_000, "claim lease {} ms", remaining_ms(1));
    let completion =
        Completion { ttl_ms: 30_000, ..idempotency_filter::store::conformance::done("a", now + 100) };
    assert_eq!(worker.complete(&c, &completion).unwrap(), Settled::Done);
    assert!(remaining_ms(1) + elapsed() >= 30_100, "record lease {} ms", remaining_ms(1));
}

/// A lease etcd no longer has (revoked here; lost with etcd's data in real life) is granted
/// again by the next write that needs it, and that write goes through.
#[test]
fn a_revoked_lease_is_granted_again() {
    let b = Etcd::with_capacity(0);
    let worker = BlockingEtcd::new(b.etcd.0.addr, settings(&b.prefix));
    claimed(worker.begin(&attempt(1, 1, 11, 0)).unwrap());
    let grants = || worker.calls().iter().filter(|(path, _)| *path == "/v3/lease/grant").count();
    // The record's lease and its lease key's claim lease.
    assert_eq!(grants(), 2);
    // Find the lease through the record and revoke it: the record goes with it.
    let id = record_lease(&worker, &b.prefix, 1);
    let revoked = worker.post("/v3/lease/revoke", format!(r#"{{"ID":"{id}"}}"#).as_bytes(), None);
    assert_eq!(revoked.status, Some(200));
    // Same window: the cached leases are tried, refused, granted anew (etcd does not say
    // which one it lacks).
    claimed(worker.begin(&attempt(2, 1, 12, 1)).unwrap());
    assert_eq!(grants(), 4);
    // The revoked record is gone: the key is free again.
    claimed(worker.begin(&attempt(1, 1, 13, 2)).unwrap());
}

/// The id of the lease the record of conformance scope `scope_n` carries in etcd.
fn record_lease(worker: &BlockingEtcd, prefix: &str, scope_n: u64) -> String {
    use idempotency_filter::json::{self, JsonValue, MemberOrder};
    let mut key = format!("{prefix}r/").into_bytes();
    let scope = idempotency_filter::store::conformance::scope(scope_n);
    key.extend(scope.0.iter().flat_map(|x| format!("{x:02x}").into_bytes()));
    let body = format!(r#"{{"key":"{}"}}"#, base64::encode(&key));
    let found = worker.post("/v3/kv/range", body.as_bytes(), None);
    let doc = json::read(&found.body, 16, MemberOrder::Document).unwrap();
    let Some(JsonValue::Array(kvs)) = doc.get("kvs") else { panic!("no record: {doc:?}") };
    let Some(JsonValue::String(lease)) = kvs[0].get("lease") else { panic!("no lease: {doc:?}") };
    lease.to_string()
}

/// C10, C9 across clocks: an Envoy whose clock runs ahead of the owner's by more than the lease
/// (26 s here, with the suite's 1 s lease) sees the claim's deadline long past while the owner's
/// call is still running. The takeover is decided by etcd's clock (the claim's lease key), so it
/// gets 409 and, once the owner completes, the replay: one execution.
#[test]
fn a_clock_ahead_by_more_than_the_lease_does_not_take_over_a_running_claim() {
    use idempotency_filter::store::conformance::{done, snapshot, LEASE};
    let b = Etcd::with_capacity(0);
    let (owner, ahead) = (b.worker(0), b.worker(1));
    let t = 1_000_000;
    let skew = 26_000;
    // Records kept an hour, as a payment API would keep them a day: the skew is far below it.
    let at = |owner: u64, now_ms: u64| ClaimAttempt { ttl_ms: 3_600_000, ..attempt(1, 1, owner, now_ms) };
    let c = claimed(owner.begin(&at(11, t)).unwrap());
    let early = ahead.begin(&at(12, t + 100 + skew)).unwrap();
    assert!(matches!(early, Begin::InFlight { .. }), "taken over by a clock {skew} ms ahead: {early:?}");
    assert!(skew + 100 > LEASE);
    let outcome = Completion { ttl_ms: 3_600_000, ..done("owner", t + 500) };
    assert_eq!(owner.complete(&c, &outcome).unwrap(), Settled::Done);
    assert_eq!(ahead.begin(&at(13, t + 600 + skew)).unwrap(), Begin::Replay(snapshot("owner")));
}

/// The same clock behind the owner's: etcd's lease key is gone, but this Envoy waits for the
/// deadline by its own clock too (a takeover is never earlier than either says).
#[test]
fn a_clock_behind_takes_over_only_once_its_own_deadline_passed() {
    use idempotency_filter::store::conformance::LEASE;
    let b = Etcd::with_capacity(0);
    let (owner, behind) = (b.worker(0), b.worker(1));
    let t = 1_000_000;
    claimed(owner.begin(&attempt(1, 1, 11, t)).unwrap());
    wait_for_claim_leases();
    let waiting = behind.begin(&attempt(1, 1, 12, t + LEASE - 300)).unwrap();
    assert_eq!(waiting, Begin::InFlight { retry_after_ms: 300 });
    assert!(matches!(behind.begin(&attempt(1, 1, 13, t + LEASE)).unwrap(), Begin::TookOver(_)));
}
