//! loadgen: a small HTTP/1.1 load generator for the filter's benchmarks (std only).
//!
//! N keep-alive connections, one thread each, one request in flight per connection. Closed loop
//! (send, wait for the answer, send the next) for a duration and/or a request count, or open
//! loop (`--rate`): requests are scheduled at a fixed total rate and latency is measured from the
//! scheduled send time, so a slow answer is not hidden by the requests it delayed (no coordinated
//! omission). Per-request latency goes into a log-linear histogram with microsecond resolution
//! (exact below 512 us, < 0.4 % bucket width above). Every answer's status is checked against
//! `--expect`; anything else, and every I/O error or timeout, is an error and is reported.
//!
//! Each request may carry a key header: `--key-prefix P` gives every request a new key `P-<n>`
//! (n counts requests across all connections), `--key-set P:COUNT` cycles through the fixed
//! keys `P-0` .. `P-<COUNT-1>`.
//!
//! Output: one JSON object on stdout (see `report`). Usage: `loadgen --help`.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const USAGE: &str = "\
loadgen --addr HOST:PORT [options]

  --addr HOST:PORT        server (plain HTTP/1.1)
  --method M              request method (default POST)
  --path P                request path (default /)
  --host-header H         Host header (default: the --addr value)
  --connections N         keep-alive connections, one thread each (default 8)
  --duration SECS         stop sending after this long (default 2; 0 = no time limit)
  --requests N            stop after N requests in total (default: no count limit)
  --rate RPS              open loop: this many requests per second in total, spread evenly
                          over the connections; latency counts from the scheduled send time
  --body-bytes N          a JSON body of exactly N bytes (default 0: no body)
  --header 'NAME: VALUE'  extra request header (repeatable)
  --key-header NAME       key header name (default idempotency-key)
  --key-prefix P          unique key per request: P-<n>
  --key-set P:COUNT       fixed keys P-0 .. P-<COUNT-1>, in turn
  --expect CODES          expected status codes, comma separated (default 200); others are errors
  --expect-header 'NAME: VALUE'
                          every expected answer must carry this header (else: an error)
  --timeout SECS          per-request read timeout (default 10)
  --label TEXT            copied into the output
";

// ---------------------------------------------------------------------------------------------
// histogram

/// Log-linear buckets over microseconds: values below 2*SUB are exact; above, each power of two
/// is split into SUB buckets (relative width < 1/SUB).
const SUB_BITS: u32 = 8;
const SUB: u64 = 1 << SUB_BITS;
const BUCKETS: usize = (64 - SUB_BITS as usize + 1) * SUB as usize;

#[derive(Clone)]
struct Histogram {
    counts: Vec<u64>,
    total: u64,
    sum: u128,
    min: u64,
    max: u64,
}

impl Histogram {
    fn new() -> Self {
        Histogram { counts: vec![0; BUCKETS], total: 0, sum: 0, min: u64::MAX, max: 0 }
    }

    fn index(v: u64) -> usize {
        if v < 2 * SUB {
            return v as usize;
        }
        let msb = 63 - v.leading_zeros();
        let shift = msb - SUB_BITS;
        (shift as usize + 1) * SUB as usize + ((v >> shift) - SUB) as usize
    }

    /// Lowest and highest value of bucket `i`.
    fn bounds(i: usize) -> (u64, u64) {
        if i < 2 * SUB as usize {
            return (i as u64, i as u64);
        }
        let shift = (i / SUB as usize - 1) as u32;
        let sub = (i % SUB as usize) as u64 + SUB;
        (sub << shift, ((sub + 1) << shift) - 1)
    }

    /// The value reported for bucket `i`: its middle.
    fn value(i: usize) -> u64 {
        let (lo, hi) = Self::bounds(i);
        lo + (hi - lo) / 2
    }

    fn record(&mut self, us: u64) {
        self.counts[Self::index(us)] += 1;
        self.total += 1;
        self.sum += u128::from(us);
        self.min = self.min.min(us);
        self.max = self.max.max(us);
    }

    fn merge(&mut self, o: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&o.counts) {
            *a += b;
        }
        self.total += o.total;
        self.sum += o.sum;
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
    }

    /// Smallest recorded value v with at least q of all values <= v (bucket resolution).
    fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::value(i).clamp(self.min, self.max);
            }
        }
        self.max
    }
}

// ---------------------------------------------------------------------------------------------
// options

#[derive(Clone)]
enum Keys {
    None,
    Unique(String),
    Set(String, u64),
}

#[derive(Clone)]
struct Opts {
    addr: SocketAddr,
    addr_text: String,
    method: String,
    path: String,
    host_header: Option<String>,
    connections: usize,
    duration: Option<Duration>,
    requests: Option<u64>,
    rate: Option<f64>,
    body_bytes: usize,
    headers: Vec<(String, String)>,
    key_header: String,
    keys: Keys,
    expect: Vec<u16>,
    expect_header: Option<(String, String)>,
    timeout: Duration,
    label: String,
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    let (n, v) = s.split_once(':').ok_or_else(|| format!("header {s:?}: expected 'NAME: VALUE'"))?;
    let n = n.trim();
    if n.is_empty() || n.contains(|c: char| c.is_whitespace()) {
        return Err(format!("header {s:?}: bad name"));
    }
    Ok((n.to_string(), v.trim().to_string()))
}

fn parse_args() -> Result<Opts, String> {
    let mut args = std::env::args().skip(1);
    let mut o = Opts {
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        addr_text: String::new(),
        method: "POST".into(),
        path: "/".into(),
        host_header: None,
        connections: 8,
        duration: Some(Duration::from_secs(2)),
        requests: None,
        rate: None,
        body_bytes: 0,
        headers: Vec::new(),
        key_header: "idempotency-key".into(),
        keys: Keys::None,
        expect: vec![200],
        expect_header: None,
        timeout: Duration::from_secs(10),
        label: String::new(),
    };
    let mut have_addr = false;
    let secs = |s: &str, what: &str| -> Result<f64, String> {
        s.parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("{what}: bad number {s:?}"))
    };
    while let Some(a) = args.next() {
        if a == "-h" || a == "--help" {
            print!("{USAGE}");
            std::process::exit(0);
        }
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--addr" => {
                let v = val()?;
                o.addr = v
                    .to_socket_addrs()
                    .map_err(|e| format!("--addr {v}: {e}"))?
                    .next()
                    .ok_or_else(|| format!("--addr {v}: no address"))?;
                o.addr_text = v;
                have_addr = true;
            }
            "--method" => o.method = val()?,
            "--path" => o.path = val()?,
            "--host-header" => o.host_header = Some(val()?),
            "--connections" => {
                o.connections = val()?.parse().map_err(|_| "--connections: bad number".to_string())?;
                if o.connections == 0 {
                    return Err("--connections must be > 0".into());
                }
            }
            "--duration" => {
                let d = secs(&val()?, "--duration")?;
                o.duration = (d > 0.0).then(|| Duration::from_secs_f64(d));
            }
            "--requests" => {
                o.requests = Some(val()?.parse().map_err(|_| "--requests: bad number".to_string())?)
            }
            "--rate" => {
                let r = secs(&val()?, "--rate")?;
                if r <= 0.0 {
                    return Err("--rate must be > 0".into());
                }
                o.rate = Some(r);
            }
            "--body-bytes" => {
                o.body_bytes = val()?.parse().map_err(|_| "--body-bytes: bad number".to_string())?
            }
            "--header" => o.headers.push(parse_header(&val()?)?),
            "--key-header" => o.key_header = val()?,
            "--key-prefix" => o.keys = Keys::Unique(val()?),
            "--key-set" => {
                let v = val()?;
                let (p, n) = v.rsplit_once(':').ok_or("--key-set: expected PREFIX:COUNT")?;
                let n: u64 = n.parse().map_err(|_| "--key-set: bad count".to_string())?;
                if n == 0 {
                    return Err("--key-set: count must be > 0".into());
                }
                o.keys = Keys::Set(p.to_string(), n);
            }
            "--expect" => {
                o.expect = val()?
                    .split(',')
                    .map(|c| c.trim().parse::<u16>().map_err(|_| format!("--expect: bad status {c:?}")))
                    .collect::<Result<_, _>>()?;
            }
            "--expect-header" => o.expect_header = Some(parse_header(&val()?)?),
            "--timeout" => o.timeout = Duration::from_secs_f64(secs(&val()?, "--timeout")?.max(0.001)),
            "--label" => o.label = val()?,
            _ => return Err(format!("unknown argument {a:?} (see --help)")),
        }
    }
    if !have_addr {
        return Err("--addr is required".into());
    }
    if o.duration.is_none() && o.requests.is_none() {
        return Err("give --duration > 0 or --requests (or both)".into());
    }
    Ok(o)
}

/// A JSON object of exactly `n` bytes (for n >= 2): `{"item":"book","qty":1,"note":"xxx..."}`.
fn json_body(n: usize) -> Vec<u8> {
    let head = br#"{"item":"book","qty":1,"note":""#;
    let tail = br#""}"#;
    if n == 0 {
        return Vec::new();
    }
    if n < head.len() + tail.len() {
        return b"{}".iter().copied().chain(std::iter::repeat(b' ')).take(n.max(2)).collect();
    }
    let mut b = Vec::with_capacity(n);
    b.extend_from_slice(head);
    let fill = n - head.len() - tail.len();
    b.extend((0..fill).map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789"[i % 36]));
    b.extend_from_slice(tail);
    b
}

// ---------------------------------------------------------------------------------------------
// one connection

/// A request split around its key: `head` + key + `tail` (the tail holds the rest of the headers
/// and the body), or the whole request in `head` when there is no key.
struct Template {
    head: Vec<u8>,
    tail: Vec<u8>,
}

fn template(o: &Opts) -> Template {
    let body = json_body(o.body_bytes);
    let host = o.host_header.clone().unwrap_or_else(|| o.addr_text.clone());
    let mut head = format!("{} {} HTTP/1.1\r\nhost: {}\r\n", o.method, o.path, host);
    for (n, v) in &o.headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    let mut tail = String::new();
    if !body.is_empty() || o.method == "POST" || o.method == "PUT" || o.method == "PATCH" {
        tail.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    tail.push_str("\r\n");
    let mut tail = tail.into_bytes();
    tail.extend_from_slice(&body);
    match o.keys {
        Keys::None => {
            let mut h = head.into_bytes();
            h.extend_from_slice(&tail);
            Template { head: h, tail: Vec::new() }
        }
        _ => {
            head.push_str(&format!("{}: ", o.key_header));
            let mut t = b"\r\n".to_vec();
            t.extend_from_slice(&tail);
            Template { head: head.into_bytes(), tail: t }
        }
    }
}

#[derive(Default)]
struct Tally {
    statuses: BTreeMap<u16, u64>,
    unexpected: BTreeMap<u16, u64>,
    io_errors: u64,
    timeouts: u64,
    missing_header: u64,
    connects: u64,
    closed_by_server: u64,
    first_error: Option<String>,
    bytes_in: u64,
}

impl Tally {
    fn error(&mut self, what: String) {
        if self.first_error.is_none() {
            self.first_error = Some(what);
        }
    }
}

struct Answer {
    status: u16,
    close: bool,
    has_expected_header: bool,
}

/// Reads one HTTP/1.1 response from `s` (content-length or chunked), using `buf` as scratch.
fn read_response(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    want: &Option<(String, String)>,
    bytes_in: &mut u64,
) -> io::Result<Answer> {
    buf.clear();
    let mut chunk = [0u8; 16384];
    let head_end = loop {
        if let Some(p) = find(buf, b"\r\n\r\n") {
            break p + 4;
        }
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed before a response"));
        }
        *bytes_in += n as u64;
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| bad("response head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad(&format!("bad status line {status_line:?}")))?;
    let mut length: Option<usize> = None;
    let mut chunked = false;
    let mut close = status_line.starts_with("HTTP/1.0");
    let mut has_expected_header = want.is_none();
    for line in lines {
        let Some((n, v)) = line.split_once(':') else { continue };
        let (n, v) = (n.trim(), v.trim());
        if n.eq_ignore_ascii_case("content-length") {
            length = Some(v.parse().map_err(|_| bad("bad content-length"))?);
        } else if n.eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        } else if n.eq_ignore_ascii_case("connection") && v.eq_ignore_ascii_case("close") {
            close = true;
        }
        if let Some((wn, wv)) = want {
            if n.eq_ignore_ascii_case(wn) && v.eq_ignore_ascii_case(wv) {
                has_expected_header = true;
            }
        }
    }
    let mut pos = head_end;
    let mut fill = |buf: &mut Vec<u8>, need: usize| -> io::Result<()> {
        while buf.len() < need {
            let n = s.read(&mut chunk)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a response",
                ));
            }
            *bytes_in += n as u64;
            buf.extend_from_slice(&chunk[..n]);
        }
        Ok(())
    };
    if chunked {
        loop {
            let line_end = loop {
                if let Some(p) = find(&buf[pos..], b"\r\n") {
                    break pos + p;
                }
                let need = buf.len() + 1;
                fill(buf, need)?;
            };
            let size_text = std::str::from_utf8(&buf[pos..line_end]).map_err(|_| bad("bad chunk size"))?;
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| bad("bad chunk size"))?;
            pos = line_end + 2;
            if size == 0 {
                // Trailers (if any), then the empty line.
                loop {
                    let end = loop {
                        if let Some(p) = find(&buf[pos..], b"\r\n") {
                            break pos + p;
                        }
                        let need = buf.len() + 1;
                        fill(buf, need)?;
                    };
                    let empty = end == pos;
                    pos = end + 2;
                    if empty {
                        break;
                    }
                }
                break;
            }
            fill(buf, pos + size + 2)?;
            pos += size + 2;
        }
    } else if let Some(len) = length {
        fill(buf, pos + len)?;
        pos += len;
    } else if status >= 200 && status != 204 && status != 304 {
        // No length: the body ends when the server closes.
        loop {
            let n = s.read(&mut chunk)?;
            if n == 0 {
                break;
            }
            *bytes_in += n as u64;
        }
        close = true;
    }
    if buf.len() > pos {
        return Err(bad("unexpected bytes after the response"));
    }
    Ok(Answer { status, close, has_expected_header })
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn connect(o: &Opts) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&o.addr, o.timeout)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(o.timeout))?;
    s.set_write_timeout(Some(o.timeout))?;
    Ok(s)
}

struct Shared {
    counter: AtomicU64,
    stop: AtomicBool,
}

struct WorkerResult {
    hist: Histogram,
    tally: Tally,
}

fn worker(
    o: Arc<Opts>,
    tpl: Arc<Template>,
    shared: Arc<Shared>,
    barrier: Arc<Barrier>,
    index: usize,
) -> WorkerResult {
    let mut hist = Histogram::new();
    let mut tally = Tally::default();
    let mut conn = match connect(&o) {
        Ok(c) => {
            tally.connects += 1;
            Some(c)
        }
        Err(e) => {
            tally.io_errors += 1;
            tally.error(format!("connect: {e}"));
            None
        }
    };
    let mut req = Vec::with_capacity(tpl.head.len() + tpl.tail.len() + 64);
    let mut buf = Vec::with_capacity(8192);
    // Open loop: this connection's share of the rate, offset so connections interleave.
    let interval = o.rate.map(|r| Duration::from_secs_f64(o.connections as f64 / r));
    barrier.wait();
    let start = Instant::now();
    let deadline = o.duration.map(|d| start + d);
    let first = interval.map(|iv| start + iv.mul_f64(index as f64 / o.connections as f64));
    let mut sent_here: u32 = 0;
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            break;
        }
        let scheduled = match (first, interval) {
            (Some(f), Some(iv)) => {
                let at = f + iv * sent_here;
                if deadline.is_some_and(|d| at >= d) {
                    break;
                }
                let now = Instant::now();
                if at > now {
                    thread::sleep(at - now);
                }
                Some(at)
            }
            _ => None,
        };
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let n = shared.counter.fetch_add(1, Ordering::Relaxed);
        if o.requests.is_some_and(|max| n >= max) {
            shared.stop.store(true, Ordering::Relaxed);
            break;
        }
        sent_here += 1;
        req.clear();
        req.extend_from_slice(&tpl.head);
        match &o.keys {
            Keys::None => {}
            Keys::Unique(p) => {
                req.extend_from_slice(p.as_bytes());
                req.push(b'-');
                req.extend_from_slice(n.to_string().as_bytes());
            }
            Keys::Set(p, count) => {
                req.extend_from_slice(p.as_bytes());
                req.push(b'-');
                req.extend_from_slice((n % count).to_string().as_bytes());
            }
        }
        req.extend_from_slice(&tpl.tail);

        let t0 = scheduled.unwrap_or_else(Instant::now);
        if conn.is_none() {
            match connect(&o) {
                Ok(c) => {
                    tally.connects += 1;
                    conn = Some(c);
                }
                Err(e) => {
                    tally.io_errors += 1;
                    tally.error(format!("connect: {e}"));
                    thread::sleep(Duration::from_millis(10));
                    continue;
                }
            }
        }
        let Some(s) = conn.as_mut() else { continue };
        let result =
            s.write_all(&req).and_then(|_| read_response(s, &mut buf, &o.expect_header, &mut tally.bytes_in));
        match result {
            Ok(a) => {
                let us = t0.elapsed().as_micros() as u64;
                hist.record(us);
                *tally.statuses.entry(a.status).or_default() += 1;
                if !o.expect.contains(&a.status) {
                    *tally.unexpected.entry(a.status).or_default() += 1;
                    tally.error(format!("unexpected status {}", a.status));
                } else if !a.has_expected_header {
                    tally.missing_header += 1;
                    tally.error("an expected answer without the expected header".into());
                }
                if a.close {
                    tally.closed_by_server += 1;
                    conn = None;
                }
            }
            Err(e) => {
                if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
                    tally.timeouts += 1;
                    tally.error(format!("timeout after {:?}", o.timeout));
                } else {
                    tally.io_errors += 1;
                    tally.error(format!("i/o: {e}"));
                }
                conn = None;
            }
        }
    }
    WorkerResult { hist, tally }
}

// ---------------------------------------------------------------------------------------------
// output

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_map(m: &BTreeMap<u16, u64>) -> String {
    let items: Vec<String> = m.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    format!("{{{}}}", items.join(","))
}

fn main() -> ExitCode {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("loadgen: {e}");
            return ExitCode::from(2);
        }
    };
    let o = Arc::new(o);
    let tpl = Arc::new(template(&o));
    let shared = Arc::new(Shared { counter: AtomicU64::new(0), stop: AtomicBool::new(false) });
    let barrier = Arc::new(Barrier::new(o.connections + 1));
    let handles: Vec<_> = (0..o.connections)
        .map(|i| {
            let (o, tpl, shared, barrier) = (o.clone(), tpl.clone(), shared.clone(), barrier.clone());
            thread::Builder::new()
                .name(format!("conn-{i}"))
                .spawn(move || worker(o, tpl, shared, barrier, i))
                .expect("spawn a connection thread")
        })
        .collect();
    barrier.wait();
    let started_unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let start = Instant::now();
    let mut hist = Histogram::new();
    let mut t = Tally::default();
    for h in handles {
        let r = h.join().unwrap_or_else(|_| WorkerResult {
            hist: Histogram::new(),
            tally: Tally {
                io_errors: 1,
                first_error: Some("a connection thread panicked".into()),
                ..Tally::default()
            },
        });
        hist.merge(&r.hist);
        for (k, v) in r.tally.statuses {
            *t.statuses.entry(k).or_default() += v;
        }
        for (k, v) in r.tally.unexpected {
            *t.unexpected.entry(k).or_default() += v;
        }
        t.io_errors += r.tally.io_errors;
        t.timeouts += r.tally.timeouts;
        t.missing_header += r.tally.missing_header;
        t.connects += r.tally.connects;
        t.closed_by_server += r.tally.closed_by_server;
        t.bytes_in += r.tally.bytes_in;
        if t.first_error.is_none() {
            t.first_error = r.tally.first_error;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let completed = hist.total;
    let unexpected: u64 = t.unexpected.values().sum();
    let ok = completed - unexpected - t.missing_header;
    let errors = unexpected + t.missing_header + t.io_errors + t.timeouts;
    let mean = if completed > 0 { hist.sum as f64 / completed as f64 } else { 0.0 };
    let buckets: Vec<String> = hist
        .counts
        .iter()
        .enumerate()
        .filter(|(_, c)| **c > 0)
        .map(|(i, c)| format!("[{},{}]", Histogram::value(i), c))
        .collect();
    let mode = if o.rate.is_some() { "open" } else { "closed" };
    let out = format!(
        concat!(
            "{{\"label\":{},\"mode\":{},\"connections\":{},\"rate\":{},\"started_unix\":{:.3},\"elapsed_s\":{:.6},",
            "\"requests\":{},\"ok\":{},\"errors\":{},\"rps\":{:.1},\"ok_rps\":{:.1},",
            "\"statuses\":{},\"unexpected_statuses\":{},\"io_errors\":{},\"timeouts\":{},\"missing_header\":{},",
            "\"connects\":{},\"closed_by_server\":{},\"bytes_in\":{},\"first_error\":{},",
            "\"latency_us\":{{\"min\":{},\"mean\":{:.1},\"p50\":{},\"p90\":{},\"p99\":{},\"p999\":{},\"max\":{}}},",
            "\"histogram_us\":[{}]}}"
        ),
        json_str(&o.label),
        json_str(mode),
        o.connections,
        o.rate.map(|r| format!("{r}")).unwrap_or_else(|| "null".into()),
        started_unix,
        elapsed,
        completed,
        ok,
        errors,
        completed as f64 / elapsed.max(1e-9),
        ok as f64 / elapsed.max(1e-9),
        json_map(&t.statuses),
        json_map(&t.unexpected),
        t.io_errors,
        t.timeouts,
        t.missing_header,
        t.connects,
        t.closed_by_server,
        t.bytes_in,
        t.first_error.as_deref().map(json_str).unwrap_or_else(|| "null".into()),
        if completed > 0 { hist.min } else { 0 },
        mean,
        hist.quantile(0.50),
        hist.quantile(0.90),
        hist.quantile(0.99),
        hist.quantile(0.999),
        hist.max,
        buckets.join(","),
    );
    println!("{out}");
    if errors > 0 {
        eprintln!(
            "loadgen: {errors} error(s) in {completed} answers (unexpected statuses {}, i/o {}, timeouts {}, missing header {}); first: {}",
            json_map(&t.unexpected),
            t.io_errors,
            t.timeouts,
            t.missing_header,
            t.first_error.as_deref().unwrap_or("?")
        );
    }
    // Exit status: 0 = ran (errors, if any, are in the JSON); 2 = bad arguments.
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_contiguous_and_tight() {
        let mut prev_hi = None;
        for i in 0..BUCKETS {
            let (lo, hi) = Histogram::bounds(i);
            if let Some(p) = prev_hi {
                assert_eq!(lo, p + 1, "bucket {i}");
            }
            assert!(hi >= lo);
            assert!((hi - lo) as f64 <= lo as f64 / SUB as f64 + 1.0, "bucket {i} too wide");
            prev_hi = Some(hi);
            if hi == u64::MAX {
                break;
            }
        }
        for v in [0u64, 1, 511, 512, 513, 1000, 123_456, 10_000_000, u64::MAX / 2] {
            let (lo, hi) = Histogram::bounds(Histogram::index(v));
            assert!(lo <= v && v <= hi, "{v}");
        }
    }

    #[test]
    fn quantiles() {
        let mut h = Histogram::new();
        for v in 1..=1000u64 {
            h.record(v);
        }
        assert_eq!(h.quantile(0.5), 500);
        let p99 = h.quantile(0.99);
        assert!((988..=992).contains(&p99), "{p99}");
        assert_eq!(h.quantile(1.0), 1000);
    }

    #[test]
    fn body_has_the_requested_size() {
        for n in [0, 2, 10, 40, 1024] {
            assert_eq!(json_body(n).len(), n);
        }
        let b = json_body(1024);
        assert!(b.starts_with(b"{") && b.ends_with(b"}"));
    }
}
