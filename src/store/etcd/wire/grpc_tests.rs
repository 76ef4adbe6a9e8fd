//! The gRPC codec: requests byte for byte against vectors worked out by hand from etcd's protos,
//! answers as etcd encodes them (fields in number order, defaults left out, unknown fields
//! skipped), and hostile bytes refused without a panic.

use super::*;
use crate::splitmix::SeededRng;
use crate::store::remote::GrpcStatus;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    out.extend_from_slice(message);
    out
}

fn ok(message: &[u8]) -> Answer {
    Answer {
        status: Some(200),
        body: frame(message),
        grpc: Some(GrpcStatus { code: 0, message: String::new() }),
        from_envoy: false,
    }
}

fn message(write: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::new();
    write(&mut out);
    out
}

/// A ResponseHeader as etcd sends it: cluster_id, member_id, revision, raft_term.
fn header(out: &mut Vec<u8>, number: u32, revision: i64) {
    message_field(out, number, |h| {
        int_field(h, 1, 0x1234_5678_9abc, false);
        int_field(h, 2, 0x0fed_cba9_8765, false);
        int_field(h, field::HEADER_REVISION, revision, false);
        int_field(h, 4, 2, false);
    });
}

/// A KeyValue: key, create_revision, mod_revision, version, value, lease.
fn kv(out: &mut Vec<u8>, number: u32, key: &[u8], mod_revision: i64, value: &[u8]) {
    message_field(out, number, |m| {
        bytes_field(m, field::KV_KEY, key);
        int_field(m, 2, mod_revision - 1, false);
        int_field(m, field::KV_MOD_REVISION, mod_revision, false);
        int_field(m, 4, 2, false);
        if !value.is_empty() {
            bytes_field(m, field::KV_VALUE, value);
        }
        int_field(m, 6, 0x694d_8a1e_2f3c_4b5a, false);
    });
}

#[test]
fn a_claim_transaction_is_encoded_as_etcd_reads_it() {
    let body = txn(
        &[(&b"k"[..], Guard::Absent)],
        &[TxnOp::Put { key: b"k".to_vec(), value: b"v".to_vec(), lease: 5 }],
        &[TxnOp::Range { key: b"k".to_vec(), range_end: None, limit: 0, keys_only: false }],
    );
    // frame | compare{target CREATE, key, create_revision 0 (a oneof member: written)}
    // | success{request_put{key, value, lease}} | failure{request_range{key}}
    assert_eq!(
        hex(&body),
        "00 00 00 00 1c 0a 07 10 01 1a 01 6b 28 00 12 0a 12 08 0a 01 6b 12 01 76 18 05 1a 05 0a 03 0a 01 6b"
    );
}

#[test]
fn a_guarded_write_a_delete_and_a_keys_only_range_are_encoded_as_etcd_reads_them() {
    let body = txn(
        &[(&b"r"[..], Guard::ModRevision(300))],
        &[
            TxnOp::Delete { key: b"q".to_vec() },
            TxnOp::Range { key: b"a".to_vec(), range_end: Some(b"b".to_vec()), limit: 2, keys_only: true },
        ],
        &[],
    );
    // compare{target MOD, key, mod_revision 300 = ac 02} | success{request_delete_range{key}}
    // | success{request_range{key, range_end, limit 2, keys_only}}
    assert_eq!(
        hex(&body),
        "00 00 00 00 1f 0a 08 10 02 1a 01 72 30 ac 02 12 05 1a 03 0a 01 71 12 0c 0a 0a 0a 01 61 12 01 62 18 02 40 01"
    );
    assert_eq!(hex(&range(b"r")), "00 00 00 00 03 0a 01 72");
    assert_eq!(hex(&lease_grant(22)), "00 00 00 00 02 08 16");
    assert_eq!(hex(&authenticate("u", "p")), "00 00 00 00 06 0a 01 75 12 01 70");
}

#[test]
fn an_owner_guard_compares_the_value_as_etcd_reads_it() {
    let body = txn(&[(&b"l"[..], Guard::Owner(11))], &[TxnOp::Delete { key: b"r".to_vec() }], &[]);
    // compare{target VALUE, key, value = the owner token's 8 big-endian bytes}
    // | success{request_delete_range{key}}
    assert_eq!(
        hex(&body),
        "00 00 00 00 18 0a 0f 10 03 1a 01 6c 3a 08 00 00 00 00 00 00 00 0b 12 05 1a 03 0a 01 72"
    );
}

#[test]
fn a_transaction_answer_is_read_with_its_ranges_and_revision() {
    let answer = message(|m| {
        header(m, field::TXN_HEADER, 42);
        // succeeded false: left out
        message_field(m, field::TXN_RESPONSES, |op| {
            message_field(op, field::OP_RANGE, |r| {
                header(r, field::RANGE_HEADER, 42);
                kv(r, field::RANGE_KVS, b"/idem/r/x", 41, b"record");
                int_field(r, field::RANGE_COUNT, 1, false);
            });
        });
        // a put's answer is skipped
        message_field(m, field::TXN_RESPONSES, |op| {
            message_field(op, field::OP_PUT, |p| header(p, 1, 42));
        });
    });
    let read = read_txn(body(&ok(&answer)).unwrap()).unwrap();
    assert_eq!(
        read,
        TxnAnswer {
            revision: 42,
            succeeded: false,
            ranges: vec![RangeAnswer {
                kvs: vec![Kv { key: b"/idem/r/x".to_vec(), value: b"record".to_vec(), mod_revision: 41 }],
                count: 1
            }],
        }
    );
    let succeeded = message(|m| {
        header(m, field::TXN_HEADER, 43);
        int_field(m, field::TXN_SUCCEEDED, 1, false);
    });
    assert_eq!(read_txn(&succeeded).unwrap(), TxnAnswer { revision: 43, succeeded: true, ranges: vec![] });
    // An empty range and an empty value: proto3 leaves both out.
    let empty = message(|m| {
        header(m, field::RANGE_HEADER, 7);
        kv(m, field::RANGE_KVS, b"k", 5, b"");
    });
    assert_eq!(
        read_range(&empty).unwrap(),
        RangeAnswer { kvs: vec![Kv { key: b"k".to_vec(), value: vec![], mod_revision: 5 }], count: 0 }
    );
}

#[test]
fn lease_and_token_answers_are_read() {
    let granted = message(|m| {
        header(m, 1, 9);
        int_field(m, field::GRANTED_ID, 0x694d_8a1e_2f3c_4b5a, false);
        int_field(m, 3, 22, false);
    });
    assert_eq!(read_lease_id(&granted), Ok(0x694d_8a1e_2f3c_4b5a));
    let refused = message(|m| bytes_field(m, field::GRANTED_ERROR, b"too many leases"));
    assert!(
        matches!(read_lease_id(&refused), Err(EtcdRefusal::Unusable(m)) if m.contains("too many leases"))
    );
    assert!(read_lease_id(&message(|m| header(m, 1, 9))).is_err(), "no ID");
    let token = message(|m| {
        header(m, 1, 9);
        bytes_field(m, field::AUTH_TOKEN, b"tok.123");
    });
    assert_eq!(read_token(&token), Ok("tok.123".to_string()));
    assert!(read_token(&message(|m| header(m, 1, 9))).is_err(), "no token");
}

#[test]
fn etcd_errors_and_envoy_failures_are_refusals() {
    let grpc = |code: u32, message: &str| Answer {
        status: Some(200),
        body: vec![],
        grpc: Some(GrpcStatus { code, message: message.into() }),
        from_envoy: false,
    };
    assert!(matches!(body(&grpc(16, "etcdserver: invalid auth token")), Err(EtcdRefusal::InvalidToken(_))));
    assert!(matches!(
        body(&grpc(3, "etcdserver: revision of auth store is old")),
        Err(EtcdRefusal::InvalidToken(_))
    ));
    assert_eq!(body(&grpc(5, "etcdserver: requested lease not found")), Err(EtcdRefusal::LeaseNotFound));
    assert!(
        matches!(body(&grpc(14, "no healthy upstream")), Err(EtcdRefusal::Unusable(m)) if m.contains("no healthy upstream"))
    );
    assert!(matches!(body(&Answer::default()), Err(EtcdRefusal::Unusable(_))), "no status");
    let reset =
        Answer { status: Some(503), body: b"upstream connect error".to_vec(), grpc: None, from_envoy: false };
    assert!(matches!(body(&reset), Err(EtcdRefusal::Unusable(m)) if m.contains("503")));
    let unfinished = Answer { grpc: None, ..ok(&[]) };
    assert!(matches!(body(&unfinished), Err(EtcdRefusal::Unusable(m)) if m.contains("grpc-status")));
}

#[test]
fn frames_that_are_not_one_plain_message_are_refused() {
    let mut compressed = ok(b"\x08\x01");
    compressed.body[0] = 1;
    let mut short = ok(b"\x08\x01");
    short.body.pop();
    let mut long = ok(b"\x08\x01");
    long.body.push(0);
    let truncated = Answer { body: vec![0, 0, 0], ..ok(&[]) };
    for (name, answer) in
        [("compressed", compressed), ("short", short), ("long", long), ("truncated", truncated)]
    {
        assert!(matches!(body(&answer), Err(EtcdRefusal::Unusable(_))), "{name}");
    }
}

#[test]
fn hostile_bytes_are_refused_or_read_never_a_panic() {
    // Truncated varints and lengths, groups, field 0, an 11-byte varint.
    for bad in
        [&b"\x08"[..], b"\x0a\x05ab", b"\x0b", b"\x00\x01", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f"]
    {
        assert!(read_txn(bad).is_err(), "{}", hex(bad));
        assert!(read_range(bad).is_err(), "{}", hex(bad));
    }
    // A wrong wire type where a message is expected.
    assert!(read_txn(b"\x08\x01").is_err(), "header as a varint");
    let mut rng = SeededRng(0x9e37_79b9);
    for _ in 0..20_000 {
        let len = (rng.next_u64() % 48) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        let _ = read_txn(&bytes);
        let _ = read_range(&bytes);
        let _ = read_lease_id(&bytes);
        let _ = read_token(&bytes);
    }
}
