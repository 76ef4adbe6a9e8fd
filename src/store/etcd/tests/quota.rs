//! Quotas: a new claim counts its identities' live index ranges after its puts and is charged
//! with the record; one over its bound is undone (the retry-after hint is the first other key's);
//! an answer about an existing record never reads them, a takeover reads them in a second call.

use super::*;

/// A quota index range as read after the claim's puts (keys_only, limit 2): `count` live
/// keys, the first of them `first` (the claim's own key among them).
fn index_after_put(rev: i64, count: i64, first: &[&[u8]]) -> String {
    let kvs: Vec<String> = first.iter().map(|k| kv_json(k, b"", 4)).collect();
    let more = if count > first.len() as i64 { r#","more":true"# } else { "" };
    format!(
        r#"{{"response_range":{{"header":{{"revision":"{rev}"}},"kvs":[{}]{more},"count":"{count}"}}}}"#,
        kvs.join(",")
    )
}

#[test]
fn quotas_are_counted_by_live_index_ranges_and_charged_with_the_record() {
    let principal_prefix = format!("/idem/q/p/{:016x}/", u64::from_be_bytes([4; 8]));
    let tenant_prefix = format!("/idem/q/t/{:016x}/", u64::from_be_bytes([3; 8]));
    // The claim's own index keys count until its lease ends (2 s).
    let own_principal = format!("{principal_prefix}{:016x}/{}", 2_000, hex(&[1; 32]));
    let own_tenant = format!("{tenant_prefix}{:016x}/{}", 2_000, hex(&[1; 32]));
    // Room (one other live record, bound 2): claimed in one transaction that puts one index
    // key per identity and reads the live ranges after the puts.
    let other = format!("{principal_prefix}{:016x}/{}", 2_500, hex(&[9; 32]));
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, true)),
        1_000,
        vec![ok(claimed_answer(
            6,
            &[
                index_after_put(6, 1, &[own_tenant.as_bytes()]),
                index_after_put(6, 2, &[own_principal.as_bytes(), other.as_bytes()]),
            ],
        ))],
    );
    assert!(matches!(begun(answer), Ok(Begin::Claimed(_))));
    assert_eq!(made.len(), 1);
    let body = &made[0].body;
    let success = &body[..body.find(r#""failure""#).unwrap()];
    for index in [&own_tenant, &own_principal] {
        assert!(success.contains(&base64::encode(index.as_bytes())), "{index}");
    }
    // The live range starts just after now and ends after the identity's last key; it comes
    // after the puts.
    let from = format!("{principal_prefix}{:016x}", 1_001);
    let to = format!("/idem/q/p/{:016x}0", u64::from_be_bytes([4; 8]));
    let range = format!(
        r#"{{"request_range":{{"key":"{}","range_end":"{}","limit":"2","keys_only":true}}}}"#,
        base64::encode(from.as_bytes()),
        base64::encode(to.as_bytes())
    );
    let at = success.find(&range).unwrap_or_else(|| panic!("{body}"));
    assert!(success.find(&base64::encode(own_principal.as_bytes())).unwrap() < at);
}

#[test]
fn a_new_claim_over_its_quota_is_undone() {
    let principal_prefix = format!("/idem/q/p/{:016x}/", u64::from_be_bytes([4; 8]));
    let tenant_prefix = format!("/idem/q/t/{:016x}/", u64::from_be_bytes([3; 8]));
    let own_principal = format!("{principal_prefix}{:016x}/{}", 2_000, hex(&[1; 32]));
    let own_tenant = format!("{tenant_prefix}{:016x}/{}", 2_000, hex(&[1; 32]));
    // Two other live records (bound 2), one stopping at 1.5 s, one at 2.5 s: the claim's own
    // key (2 s) sorts between them. EtcdRefusal, retry when the first other stops counting.
    let first = format!("{principal_prefix}{:016x}/{}", 1_500, hex(&[9; 32]));
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, false)),
        1_000,
        vec![
            ok(claimed_answer(6, &[index_after_put(6, 3, &[first.as_bytes(), own_principal.as_bytes()])])),
            ok(written(7)),
        ],
    );
    assert_eq!(begun(answer), Ok(Begin::QuotaExceeded { retry_after_ms: 500, tenant: false }));
    assert_eq!(paths(&made), vec!["/v3/kv/txn", "/v3/kv/txn"]);
    // The undo deletes what the claim wrote, guarded by the claim's revision.
    let undo = &made[1].body;
    assert!(undo.contains(r#""target":"MOD","result":"EQUAL","mod_revision":"6""#), "{undo}");
    for key in [own_principal.clone().into_bytes(), record_key(), lease_key()] {
        let delete = format!(r#"{{"request_delete_range":{{"key":"{}"}}}}"#, base64::encode(&key));
        assert!(undo.contains(&delete), "{undo}");
    }
    assert!(!undo.contains("request_put"), "{undo}");
    // The own key first: the hint is the next key's.
    let later = format!("{principal_prefix}{:016x}/{}", 2_500, hex(&[9; 32]));
    let (answer, _) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, false)),
        1_000,
        vec![
            ok(claimed_answer(6, &[index_after_put(6, 3, &[own_principal.as_bytes(), later.as_bytes()])])),
            ok(refused(8)),
        ],
    );
    // (A guard lost meanwhile changes nothing: the claim was over its quota.)
    assert_eq!(begun(answer), Ok(Begin::QuotaExceeded { retry_after_ms: 1_500, tenant: false }));
    // The tenant is checked first.
    let tenant_first = format!("{tenant_prefix}{:016x}/{}", 3_000, hex(&[9; 32]));
    let (answer, _) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, true)),
        1_000,
        vec![
            ok(claimed_answer(
                6,
                &[
                    index_after_put(6, 6, &[own_tenant.as_bytes(), tenant_first.as_bytes()]),
                    index_after_put(6, 1, &[own_principal.as_bytes()]),
                ],
            )),
            ok(written(7)),
        ],
    );
    assert_eq!(begun(answer), Ok(Begin::QuotaExceeded { retry_after_ms: 2_000, tenant: true }));
    // At the bound exactly, with the claim's own key: room.
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, false)),
        1_000,
        vec![ok(claimed_answer(6, &[index_after_put(6, 2, &[own_principal.as_bytes(), later.as_bytes()])]))],
    );
    assert!(matches!(begun(answer), Ok(Begin::Claimed(_))));
    assert_eq!(made.len(), 1);
}

#[test]
fn answers_about_an_existing_record_never_read_the_quota() {
    // Issue 18 item 8: a replay, a 409 or a mismatch costs the same whatever the caller's
    // live records: the quota indexes are read only when a claim is about to be made.
    let key = record_key();
    let done = value(completed(0, Some(snapshot())), Some(snapshot()));
    let (answer, made) = run(
        &warm_store(10),
        StoreOp::Begin(charged_attempt(10, true)),
        10,
        vec![ok(read_answer(5, Some((&key, &done, 4)), &[]))],
    );
    assert_eq!(begun(answer), Ok(Begin::Replay(snapshot())));
    assert_eq!(made.len(), 1);
    // The quota ranges are in the branch etcd runs only when the record is absent.
    let read = &made[0].body;
    let failure = &read[read.find(r#""failure""#).unwrap()..];
    assert!(!failure.contains("range_end"), "the quota is read only if the record is absent: {read}");
    // A takeover of an abandoned claim reads the quota in a second call, guarded by the
    // revision it saw (a record changed meanwhile is read again).
    let abandoned = value(processing(9, 0), None);
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, false)),
        1_000,
        vec![
            ok(read_answer(5, Some((&key, &abandoned, 4)), &[])),
            ok(format!(r#"{{{},"succeeded":true,"responses":[{}]}}"#, header(5), index_answer(5, 0, None))),
            ok(written(6)),
        ],
    );
    assert!(matches!(begun(answer), Ok(Begin::TookOver(_))), "{made:?}");
    assert!(made[1].body.contains(r#""target":"MOD","result":"EQUAL","mod_revision":"4""#));
    assert!(made[1].body.contains("range_end"));
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, false)),
        1_000,
        vec![
            ok(read_answer(5, Some((&key, &abandoned, 4)), &[])),
            ok(refused(6)),
            ok(read_answer(6, Some((&key, &value(completed(0, None), None), 6)), &[])),
        ],
    );
    assert_eq!(begun(answer), Ok(Begin::NotStored { status: 201 }));
    assert_eq!(made.len(), 3);
}
