//! Instructions the module executes per request, by path, for one or more builds of it:
//!
//!     cargo run --release -p module-abi --example fuel -- A.wasm [B.wasm ...]
//!
//! Each build runs the same requests in an emulated Envoy (`Envoy::load_metered`): a warm-up,
//! then N new keys (claimed, forwarded, answered 201 with 1 KiB, stored), N replays of a stored
//! key, and N requests no rule matches, with the root's tick every 100 ms of the emulated
//! clock. Deterministic: the count does not move with the machine's load, so a change of a
//! fraction of a percent shows. It counts the module's work only (Envoy's side of each host
//! call is not in it), and wasmi charges a block's instructions as it enters the block (code a
//! branch skips there counts too, so the code's layout moves the count): `make bench-ab` is
//! still what says what a request costs Envoy.
//! With `FUEL_EXPORTS=1`, each path's count split by the export (Envoy's callback) that ran it.

use module_abi::{keyed_post, Envoy, CONTINUE};

const CONFIG: &str = r#"{"store":{"type":"local","capacity":100000},"quota":{"per_tenant":100000,"per_principal":100000},"routes":[{"name":"orders","match":{"prefix":"/orders","methods":["POST"]},"require_key":true,"ttl":"24h"}]}"#;
const N: u32 = 2000;
const WARM: u32 = 200;

fn body() -> Vec<u8> {
    let mut b = br#"{"item":"book","note":""#.to_vec();
    b.resize(1022, b'x');
    b.extend_from_slice(b"\"}");
    b
}

/// One request through the module: a new key forwarded and answered (`answer`), else answered
/// locally or passed through.
fn request(envoy: &mut Envoy, path: &str, key: &str, answer: Option<&[u8]>) {
    let id = envoy.new_stream();
    envoy.request_headers(id, &keyed_post(path, key), false);
    let action = envoy.request_body(id, &body(), true);
    if let (Some(answer), Some(CONTINUE)) = (answer, action) {
        envoy.upstream_responds(id, 201, &[("content-type", "application/json")], answer);
    }
    envoy.end_stream(id);
}

/// Fuel per request of `n` requests made by `each`, the clock moving 1 ms per request and the
/// root ticking every 100.
fn per_request(envoy: &mut Envoy, n: u32, mut each: impl FnMut(&mut Envoy, u32)) -> f64 {
    let before = envoy.fuel();
    for i in 0..n {
        each(envoy, i);
        envoy.advance_ms(1);
        if i % 100 == 99 {
            envoy.tick();
        }
    }
    (before - envoy.fuel()) as f64 / f64::from(n)
}

fn main() {
    // The emulator's calls nest deeper than the main thread's stack allows for thousands of
    // streams in a row.
    let run = std::thread::Builder::new().stack_size(1 << 30).spawn(measure);
    if run.map(|t| t.join().is_err()).unwrap_or(true) {
        std::process::exit(1);
    }
}

fn measure() {
    let answer = vec![b'a'; 1024];
    println!("{:<56} {:>10} {:>10} {:>10}", "module", "new key", "replay", "pass");
    for path in std::env::args().skip(1) {
        let wasm = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let mut envoy = Envoy::load_metered(&wasm).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(envoy.start(CONFIG), "{path}: configuration refused");
        per_request(&mut envoy, WARM, |e, i| request(e, "/orders", &format!("warm-{i}"), Some(&answer)));
        envoy.fuel_by_export.clear();
        envoy.host_mut().fuel_by_site.clear();
        envoy.host_mut().site_steps.clear();
        let new =
            per_request(&mut envoy, N, |e, i| request(e, "/orders", &format!("new-{i}"), Some(&answer)));
        by_export(&mut envoy, "new key");
        let replay =
            per_request(&mut envoy, N, |e, i| request(e, "/orders", &format!("new-{}", i % 64), None));
        by_export(&mut envoy, "replay");
        let pass = per_request(&mut envoy, N, |e, _| request(e, "/other", "x", None));
        by_export(&mut envoy, "pass");
        println!("{path:<56} {new:>10.0} {replay:>10.0} {pass:>10.0}");
    }
}

/// With `FUEL_EXPORTS` set, what each export used per request since the last call (then the
/// tally starts again).
fn by_export(envoy: &mut Envoy, path: &str) {
    if std::env::var("FUEL_EXPORTS").is_ok() {
        for (name, fuel) in &envoy.fuel_by_export {
            eprintln!("  {path:<8} {name:<32} {:>10.0}", *fuel as f64 / f64::from(N));
        }
    }
    envoy.fuel_by_export.clear();
    if let Ok(out) = std::env::var("FUEL_SITES") {
        let sites = std::mem::take(&mut envoy.host_mut().fuel_by_site);
        let text: String =
            sites.iter().map(|(site, fuel)| format!("{path}\t{site}\t{}\t{}\n", fuel.0, fuel.1)).collect();
        let steps = std::mem::take(&mut envoy.host_mut().site_steps);
        let text: String = text
            + &steps.iter().map(|((a, b), n)| format!("{path}\tstep\t{a}\t{b}\t{n}\n")).collect::<String>();
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(out).expect("sites");
        std::io::Write::write_all(&mut f, text.as_bytes()).expect("sites");
    }
}
