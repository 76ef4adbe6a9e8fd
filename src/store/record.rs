//! Record formats shared by the stores: the compact entry (which the local store keeps in its
//! buckets and etcd in its records), the snapshot slot (the local store's commit point, and the
//! layout of an etcd record) and the label. The local store's own formats (buckets, quota
//! counters, the layout registry, fill counts) are in `local/format.rs`, under the same
//! stability contract.
//!
//! Stability contract (record format v2). These bytes outlive the module that wrote them: shared
//! data survives a VM reload (FAIL_RELOAD, config updates with the same vm_id), so a new build
//! must read what the old one wrote, or refuse it. Every value starts with a format version byte;
//! a decoder meets an unknown version or malformed bytes with an error, never a panic or a guess,
//! and the store treats such a value as unusable rather than overwriting live records it cannot
//! read. Changing a layout means a new version byte and a new store namespace (v2 lived under
//! `idem:v2:`; v1 values are refused as an unknown version). Changing where records are placed
//! means a new namespace too: the local store's two-choice placement lives under `idem:v3:`,
//! with v2 entry, bucket, slot and quota bytes and one new value, the fill count.
//!
//! Entry v2 (ENTRY_LEN bytes, integers big-endian):
//!   position u8 | state u8 | flags u8 | status u16 | scope [32] | fingerprint [32] | owner u64 |
//!   lease_deadline_ms u64 | expires_at_ms u64 | charged_at_ms u64 | tenant_tag u64 |
//!   principal_tag u64
//! Bucket v2, Quota v2, Layouts v2, Fill v3: the local store's (`local/format.rs`).
//! Slot v2:     [2u8] | entry (completed: the record's outcome) | snapshot unless the entry's
//!   flags say the body was not stored. Snapshot: status u16 | header count u16 |
//!   per header: name len u16, name, value len u32, value | body len u32 | body
//! Record v2 (etcd store, one key per record): the slot layout, whose entry may also be a claim
//!   (processing, flags saying no body stored, no snapshot); `decode_record` reads it. Its label
//!   is a key of its own (`encode_label`: [4u8] | label), so the record keeps the v2 bytes.
//! Slot v4:     [4u8] | entry | label | snapshot as in v2. Label: created_at_ms u64 | route len
//!   u8 | route | key len u8 | key (UTF-8, at most 64 and 255 bytes). Whereas v2 slots hold only
//!   outcomes, a v4 slot may also hold a claim's label: a processing entry without snapshot,
//!   which the claim writes as it fences the slot and its completion carries into the outcome,
//!   so every record an operator lists has its route and key. Readers of v2 and v4 alike; a
//!   build before v4 reads a v4 value as an unknown version (the store then answers errors for
//!   that record, never a second execution), which is the downgrade limit the changelog states.
//! Slot v5:     [5u8] | entry | label v5 | snapshot as in v2. Label v5: the v4 label, then
//!   method, host and path (each len u8 | UTF-8, at most 16, 96 and 128 bytes), tenant (len u8 |
//!   UTF-8, at most 64, or 255 alone: no tenant header), principal [4] (the first bytes of the
//!   caller's principal digest). A part cut at its bound ends with `LABEL_CUT`. It names the
//!   record's scope, so that an operator tells two tenants' records of one key apart. A v4 or
//!   v5 claim label moves into its outcome as it was written (`slot_label`): v4 values stay
//!   readable and show without the scope. Like v4, it is a new version byte in a slot (one
//!   record), never in a bucket: a build before v5 reads a v5 slot as an unknown version and
//!   answers errors for that record only. The etcd label key holds the same label ([5u8] |
//!   label v5, or [4u8] | label v4).
//!
//! Outcome unknown (`routes[].unknown_outcome: "refuse"`): a completed entry with status 0
//! (`STATUS_OUTCOME_UNKNOWN`), state FAILED_FINAL and `FLAG_BODY_NOT_STORED`, so a slot (or an
//! etcd record) without a snapshot. No upstream status is 0 (statuses a rule stores are
//! 100..599), so no earlier record has this shape, and it needs no new version byte, state or
//! flag: those would make an older build refuse the whole bucket (every record in it) as
//! unreadable. An older build reads it as what it is shaped like, an outcome kept without its
//! body: a retry gets 410 `response-not-stored` with `idempotent-original-status: 0`, never a
//! replay and never a second execution. This build refuses a completed entry with status 0 of
//! any other shape (`NonCanonical`): one meaning per value.

use crate::identity::fingerprint::Fingerprint;
use crate::identity::scope::ScopeId;

pub const FORMAT_V2: u8 = 2;
/// Slot and etcd record values that carry their `Label` (see the module docs).
pub const FORMAT_V4: u8 = 4;
/// Slot values and etcd labels whose `Label` names the record's scope (see the module docs).
pub const FORMAT_V5: u8 = 5;
/// The status of a completed entry whose outcome is unknown (module docs: Outcome unknown).
pub const STATUS_OUTCOME_UNKNOWN: u16 = 0;
pub const ENTRY_LEN: usize = 1 + 1 + 1 + 2 + 32 + 32 + 8 * 6;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Processing,
    Succeeded,
    FailedFinal,
}

impl State {
    fn code(self) -> u8 {
        match self {
            State::Processing => 1,
            State::Succeeded => 2,
            State::FailedFinal => 3,
        }
    }
    fn from_code(c: u8) -> Option<State> {
        match c {
            1 => Some(State::Processing),
            2 => Some(State::Succeeded),
            3 => Some(State::FailedFinal),
            _ => None,
        }
    }
}

/// Entry flag: the outcome is known but the body was not kept (over the size limit, or the
/// response was cut after the upstream's status was seen).
pub const FLAG_BODY_NOT_STORED: u8 = 1;
/// Entry flag: the record counts against its tenant's quota (`tenant_tag`).
pub const FLAG_TENANT_CHARGED: u8 = 2;
/// Entry flag: the record counts against its principal's quota (`principal_tag`).
pub const FLAG_PRINCIPAL_CHARGED: u8 = 4;
const KNOWN_FLAGS: u8 = FLAG_BODY_NOT_STORED | FLAG_TENANT_CHARGED | FLAG_PRINCIPAL_CHARGED;

/// One record header, small enough that a bucket of them stays cheap to copy under the host's
/// global shared-data lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Index of this entry's snapshot slot within the bucket.
    pub position: u8,
    pub state: State,
    pub flags: u8,
    /// Upstream status once completed; 0 while processing.
    pub status: u16,
    pub scope: ScopeId,
    pub fingerprint: Fingerprint,
    /// Token of the claim that owns the record; also tags its slot.
    pub owner: u64,
    /// While processing: after this instant a retry may take the claim over.
    pub lease_deadline_ms: u64,
    /// After this instant the record is absent.
    pub expires_at_ms: u64,
    /// When the record was charged to its quota counters (their epoch check, local_store.rs).
    pub charged_at_ms: u64,
    /// Keyed quota tags of the tenant and principal charged (meaningful with their flags).
    pub tenant_tag: u64,
    pub principal_tag: u64,
}

impl Entry {
    pub fn is_expired(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_at_ms
    }
    pub fn body_stored(&self) -> bool {
        self.flags & FLAG_BODY_NOT_STORED == 0
    }
    pub fn is_completed(&self) -> bool {
        self.state != State::Processing
    }
    /// Completed without a known outcome: the upstream may have executed (module docs).
    pub fn outcome_unknown(&self) -> bool {
        self.is_completed() && self.status == STATUS_OUTCOME_UNKNOWN
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    UnknownVersion(u8),
    Truncated,
    BadState(u8),
    BadFlags(u8),
    BadPosition(u8),
    DuplicatePosition(u8),
    Duplicate,
    TrailingBytes,
    NonCanonical,
}

/// The newest format version this build writes for any value: a higher one was written by a
/// newer build.
const NEWEST_FORMAT: u8 = FORMAT_V5;

/// What a value this build cannot read is, as the store's error and the operator's log say it:
/// a newer build's value is said to be one (a rollback leaves them), not damage.
impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const NEWER_OR_DAMAGED: &str = "written by a newer build of the filter, or damaged";
        match self {
            DecodeError::UnknownVersion(v) if *v > NEWEST_FORMAT => write!(
                f,
                "format version {v}, written by a newer build of the filter (this one reads versions up to \
                 {NEWEST_FORMAT}); left as it is"
            ),
            DecodeError::UnknownVersion(v) => {
                write!(f, "format version {v}, which this kind of value does not have: {NEWER_OR_DAMAGED}")
            }
            DecodeError::BadState(state) => {
                write!(f, "record state {state}, unknown to this build: {NEWER_OR_DAMAGED}")
            }
            DecodeError::BadFlags(flags) => {
                write!(f, "record flags {flags:#04x}, some unknown to this build: {NEWER_OR_DAMAGED}")
            }
            DecodeError::Truncated => write!(f, "shorter than its format says: damaged"),
            DecodeError::TrailingBytes => write!(f, "longer than its format says: damaged"),
            DecodeError::BadPosition(p) => write!(f, "an entry at slot {p}, outside its bucket: damaged"),
            DecodeError::DuplicatePosition(p) => write!(f, "two entries at slot {p}: damaged"),
            DecodeError::Duplicate => write!(f, "the same record twice: damaged"),
            DecodeError::NonCanonical => write!(
                f,
                "a form no build writes (say, a completed record with status 0 \
                                                   that is not an unknown outcome): damaged"
            ),
        }
    }
}

pub(in crate::store) fn read_entry(r: &mut Reader) -> Result<Entry, DecodeError> {
    let position = r.u8()?;
    let state_code = r.u8()?;
    let state = State::from_code(state_code).ok_or(DecodeError::BadState(state_code))?;
    let flags = r.u8()?;
    if flags & !KNOWN_FLAGS != 0 {
        return Err(DecodeError::BadFlags(flags));
    }
    let status = r.u16()?;
    // Status 0 on a completed entry means "outcome unknown", written in one shape only.
    let unknown_shape = state == State::FailedFinal && flags & FLAG_BODY_NOT_STORED != 0;
    if state != State::Processing && status == STATUS_OUTCOME_UNKNOWN && !unknown_shape {
        return Err(DecodeError::NonCanonical);
    }
    Ok(Entry {
        position,
        state,
        flags,
        status,
        scope: ScopeId(r.array()?),
        fingerprint: Fingerprint(r.array()?),
        owner: r.u64()?,
        lease_deadline_ms: r.u64()?,
        expires_at_ms: r.u64()?,
        charged_at_ms: r.u64()?,
        tenant_tag: r.u64()?,
        principal_tag: r.u64()?,
    })
}

pub(in crate::store) fn write_entry(out: &mut Vec<u8>, e: &Entry) {
    out.push(e.position);
    out.push(e.state.code());
    out.push(e.flags);
    out.extend_from_slice(&e.status.to_be_bytes());
    out.extend_from_slice(&e.scope.0);
    out.extend_from_slice(&e.fingerprint.0);
    for n in [e.owner, e.lease_deadline_ms, e.expires_at_ms, e.charged_at_ms, e.tenant_tag, e.principal_tag] {
        out.extend_from_slice(&n.to_be_bytes());
    }
}

/// A stored upstream response, replayed byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Snapshot {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

/// What a record is about, in an operator's words: the rule's route name and the client's
/// Idempotency-Key, when its current claim was made, and (v5) the scope it lives in: the tenant
/// (when the filter has a tenant header), host, method and path, and a short prefix of the
/// caller's principal digest. The scope id is a one-way hash of them, so a record that must be
/// found by key, or told apart from another customer's with the same key, carries them. Every
/// part is bounded: route names by the configuration and keys by the key parser (cut at a
/// character boundary, never refused); a longer method, host, path or tenant is cut and ends
/// with `LABEL_CUT`. Never a secret: the principal only as `LABEL_PRINCIPAL_BYTES` of its
/// digest (a SHA-256 of the caller's credentials), and the path without its query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    /// When the record's current claim was made (the store sets it as it writes the claim).
    pub created_at_ms: u64,
    /// The parts (route, key, method, host, path, tenant; UTF-8, each cut at a character
    /// boundary) in one shared allocation made once per request: every step that carries an
    /// attempt clones it, and a replay never writes it, so a clone is a count, not a copy.
    text: std::rc::Rc<[u8]>,
    /// Each part's length in `text`, in that order (a v4 label has route and key only).
    lens: [u8; PARTS],
    /// None: a v4 label, written before records named their scope.
    scope: Option<LabelScopeBits>,
}

/// What a v5 label says of its scope besides its text parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LabelScopeBits {
    /// The filter has a tenant header (the tenant part is then the record's tenant, maybe "").
    tenant: bool,
    principal: [u8; LABEL_PRINCIPAL_BYTES],
}

/// The scope a request's record lives in, as `Label::scoped` keeps it.
pub struct LabelScope<'a> {
    pub method: &'a str,
    /// Normalized as the scope is (`identity::scope::normalize_authority`).
    pub host: &'a [u8],
    /// Without the query (the scope's path).
    pub path: &'a str,
    /// The tenant header's values; None when the filter has no tenant header.
    pub tenant: Option<&'a [&'a [u8]]>,
    /// The caller's principal digest (`identity::scope`).
    pub principal: &'a [u8; 32],
}

const PARTS: usize = 6;
pub const LABEL_ROUTE_MAX: usize = 64;
pub const LABEL_KEY_MAX: usize = 255;
pub const LABEL_METHOD_MAX: usize = 16;
pub const LABEL_HOST_MAX: usize = 96;
pub const LABEL_PATH_MAX: usize = 128;
pub const LABEL_TENANT_MAX: usize = 64;
/// The bound of each part, in `Label::text` order.
const LABEL_MAX: [usize; PARTS] =
    [LABEL_ROUTE_MAX, LABEL_KEY_MAX, LABEL_METHOD_MAX, LABEL_HOST_MAX, LABEL_PATH_MAX, LABEL_TENANT_MAX];
/// Ends a method, host, path or tenant that was cut at its bound.
pub const LABEL_CUT: &str = "…";
/// How much of the principal's digest a label keeps: enough to tell two callers apart in a
/// list, far too little to stand for the credentials.
pub const LABEL_PRINCIPAL_BYTES: usize = 4;
/// A v5 label's tenant length byte when the filter has no tenant header.
const NO_TENANT: u8 = u8::MAX;

/// `s` cut to at most `max` bytes at a character boundary.
fn cut(s: &str, max: usize) -> &str {
    let mut n = s.len().min(max);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    s.get(..n).unwrap_or("")
}

/// `s` as a label part of at most `max` bytes: itself, or cut to leave room for `LABEL_CUT`
/// (then `true`: the marker follows).
fn capped(s: &str, max: usize) -> (&str, bool) {
    if s.len() <= max {
        (s, false)
    } else {
        (cut(s, max.saturating_sub(LABEL_CUT.len())), true)
    }
}

/// Appends `s` as a label part of at most `max` bytes; `marked`: one cut shorter ends with
/// `LABEL_CUT`, else it is only cut.
fn push_part(text: &mut Vec<u8>, s: &str, max: usize, marked: bool) {
    match capped(s, max) {
        (kept, true) if marked => {
            text.extend_from_slice(kept.as_bytes());
            text.extend_from_slice(LABEL_CUT.as_bytes());
        }
        _ => text.extend_from_slice(cut(s, max).as_bytes()),
    }
}

/// The text a label keeps of `wanted` (a filter's value) at `max`: what it is compared with.
pub fn label_part(wanted: &str, max: usize) -> std::borrow::Cow<'_, str> {
    match capped(wanted, max) {
        (s, false) => std::borrow::Cow::Borrowed(s),
        (s, true) => std::borrow::Cow::Owned(format!("{s}{LABEL_CUT}")),
    }
}

impl Label {
    /// A label without its scope (as v4 labels are): tests, and records read from v4 values.
    pub fn new(route: &str, key: &str) -> Label {
        let (route, key) = (cut(route, LABEL_ROUTE_MAX), cut(key, LABEL_KEY_MAX));
        // An exact-size iterator: the Rc and its bytes are one allocation.
        let text = route.bytes().chain(key.bytes()).collect();
        Label { created_at_ms: 0, text, lens: [route.len() as u8, key.len() as u8, 0, 0, 0, 0], scope: None }
    }

    /// The label a request's record carries: its route and key, and its scope. Made for every
    /// protected request at its admission (a replay's too): each part copied once into one
    /// buffer, UTF-8 checked once (header values that are no UTF-8 are shown with U+FFFD).
    pub fn scoped(route: &str, key: &str, scope: &LabelScope) -> Label {
        // One tenant value (the usual case) as it is; several joined by commas.
        let joined: Vec<u8>;
        let tenant: &[u8] = match scope.tenant {
            None => &[],
            Some([one]) => one,
            Some(more) => {
                joined = more.join(&b',');
                &joined
            }
        };
        let parts: [&[u8]; PARTS] = [
            route.as_bytes(),
            key.as_bytes(),
            scope.method.as_bytes(),
            scope.host,
            scope.path.as_bytes(),
            tenant,
        ];
        let mut text: Vec<u8> = Vec::with_capacity(
            parts.iter().zip(LABEL_MAX).map(|(p, max)| p.len().min(max)).sum::<usize>() + 12,
        );
        let mut lens = [0u8; PARTS];
        for (i, (part, max)) in parts.into_iter().zip(LABEL_MAX).enumerate() {
            let start = text.len();
            // Route and key are bounded upstream (configuration, key parser): cut, never marked.
            let marked = i > 1;
            match std::str::from_utf8(part) {
                Ok(s) => push_part(&mut text, s, max, marked),
                Err(_) => push_part(&mut text, &String::from_utf8_lossy(part), max, marked),
            }
            // Every part is at most 255 bytes (`LABEL_MAX`).
            lens[i] = (text.len() - start) as u8;
        }
        let mut principal = [0u8; LABEL_PRINCIPAL_BYTES];
        principal.copy_from_slice(&scope.principal[..LABEL_PRINCIPAL_BYTES]);
        Label {
            created_at_ms: 0,
            text: std::rc::Rc::from(text),
            lens,
            scope: Some(LabelScopeBits { tenant: scope.tenant.is_some(), principal }),
        }
    }

    pub fn route(&self) -> &str {
        self.part(0)
    }

    pub fn key(&self) -> &str {
        self.part(1)
    }

    /// The record's method, host (normalized) and path (without its query); None for a label
    /// written before records named their scope.
    pub fn method(&self) -> Option<&str> {
        self.scope.map(|_| self.part(2))
    }

    pub fn host(&self) -> Option<&str> {
        self.scope.map(|_| self.part(3))
    }

    pub fn path(&self) -> Option<&str> {
        self.scope.map(|_| self.part(4))
    }

    /// The record's tenant (its header's values, joined by commas); None when the filter has no
    /// tenant header, or the label was written before records named their scope.
    pub fn tenant(&self) -> Option<&str> {
        self.scope.filter(|s| s.tenant).map(|_| self.part(5))
    }

    /// The first bytes of the caller's principal digest.
    pub fn principal(&self) -> Option<[u8; LABEL_PRINCIPAL_BYTES]> {
        self.scope.map(|s| s.principal)
    }

    /// Every part was cut at character boundaries (`new`, `scoped`, `read`), so this never
    /// reads "".
    fn part(&self, i: usize) -> &str {
        let start: usize = self.lens.iter().take(i).map(|&n| usize::from(n)).sum();
        let len = self.lens.get(i).map_or(0, |&n| usize::from(n));
        self.text.get(start..start + len).and_then(|b| std::str::from_utf8(b).ok()).unwrap_or("")
    }

    pub fn created_at(self, now_ms: u64) -> Label {
        Label { created_at_ms: now_ms, ..self }
    }

    /// The format version of the values that carry this label: v5 with its scope, v4 without.
    pub fn version(&self) -> u8 {
        if self.scope.is_some() {
            FORMAT_V5
        } else {
            FORMAT_V4
        }
    }

    fn encoded_len(&self) -> usize {
        8 + self.text.len() + if self.scope.is_some() { PARTS + LABEL_PRINCIPAL_BYTES } else { 2 }
    }

    /// v4: created_at_ms u64 | route len u8 | route | key len u8 | key. v5: the same, then
    /// method, host and path (each len u8 | text), tenant (len u8 | text, or `NO_TENANT`
    /// alone), principal [LABEL_PRINCIPAL_BYTES].
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.created_at_ms.to_be_bytes());
        let parts = if self.scope.is_some() { PARTS } else { 2 };
        // The parts' bytes as `text` holds them (checked UTF-8 when the label was made or read).
        let mut start = 0;
        for (i, &len) in self.lens.iter().enumerate().take(parts) {
            let end = start + usize::from(len);
            match self.scope {
                Some(s) if i == 5 && !s.tenant => out.push(NO_TENANT),
                _ => {
                    // Every part is at most 255 bytes (`LABEL_MAX`).
                    out.push(len);
                    out.extend_from_slice(self.text.get(start..end).unwrap_or_default());
                }
            }
            start = end;
        }
        if let Some(s) = self.scope {
            out.extend_from_slice(&s.principal);
        }
    }

    fn read(r: &mut Reader, version: u8) -> Result<Label, DecodeError> {
        let created_at_ms = r.u64()?;
        let parts = if version == FORMAT_V5 { PARTS } else { 2 };
        let mut text = Vec::with_capacity(r.rest().len().min(1 << 10));
        let mut lens = [0u8; PARTS];
        let mut tenant = true;
        for (i, len) in lens.iter_mut().enumerate().take(parts) {
            let n = r.u8()?;
            if i == 5 && n == NO_TENANT {
                tenant = false;
                continue;
            }
            let bytes = r.take(usize::from(n))?;
            if std::str::from_utf8(bytes).is_err() || bytes.len() > LABEL_MAX.get(i).copied().unwrap_or(0) {
                return Err(DecodeError::NonCanonical);
            }
            text.extend_from_slice(bytes);
            *len = n;
        }
        let scope =
            if version == FORMAT_V5 { Some(LabelScopeBits { tenant, principal: r.array()? }) } else { None };
        Ok(Label { created_at_ms, text: text.into(), lens, scope })
    }

    /// Steps over a label without reading it: a replay's read never shows it.
    fn skip(r: &mut Reader, version: u8) -> Result<(), DecodeError> {
        r.u64()?;
        let parts = if version == FORMAT_V5 { PARTS } else { 2 };
        for (i, max) in LABEL_MAX.iter().enumerate().take(parts) {
            let n = r.u8()?;
            if i == 5 && n == NO_TENANT {
                continue;
            }
            if usize::from(n) > *max {
                return Err(DecodeError::NonCanonical);
            }
            r.take(usize::from(n))?;
        }
        if version == FORMAT_V5 {
            r.take(LABEL_PRINCIPAL_BYTES)?;
        }
        Ok(())
    }
}

/// An etcd record's label, under its own key (`n/<scope hex>`, `store::etcd`): [version] |
/// label (v5 with its scope, v4 without). Apart from the record so that the record's value keeps
/// the v2 bytes every build reads: a fleet upgraded one Envoy at a time never has an older build
/// meet a value it cannot read (an older build's list shows a label it cannot read as none).
pub fn encode_label(label: &Label) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + label.encoded_len());
    out.push(label.version());
    label.write(&mut out);
    out
}

pub fn decode_label(bytes: &[u8]) -> Result<Label, DecodeError> {
    let mut r = Reader::new(bytes);
    let version = r.u8()?;
    if version != FORMAT_V4 && version != FORMAT_V5 {
        return Err(DecodeError::UnknownVersion(version));
    }
    let label = Label::read(&mut r, version)?;
    if !r.rest().is_empty() {
        return Err(DecodeError::TrailingBytes);
    }
    Ok(label)
}

/// A completed record as kept in its snapshot slot: the slot is the record's commit point, so it
/// carries the whole outcome (the entry, completed) besides the snapshot, tagged by the entry's
/// scope and owner so that a reader can tell the current record's outcome from a stale one left
/// by an earlier record at the same position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotValue {
    pub entry: Entry,
    /// None exactly when the entry's flags say the body was not stored.
    pub snapshot: Option<Snapshot>,
    /// What the record is about (v4 values); None: written before records carried it (v2).
    pub label: Option<Label>,
}

impl SlotValue {
    pub fn belongs_to(&self, e: &Entry) -> bool {
        self.entry.scope == e.scope && self.entry.owner == e.owner
    }

    /// A local slot's value that a claim wrote when it fenced the slot: its label, no outcome.
    pub fn is_claim_label(&self) -> bool {
        !self.entry.is_completed()
    }
}

pub fn encode_slot(v: &SlotValue) -> Vec<u8> {
    let label = v.label.as_ref().map(LabelBytes::Decoded);
    encode_slot_parts(&v.entry, v.snapshot.as_ref(), label)
}

/// A label to write into a slot: decoded, or as its claim left it in the slot (`slot_label`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelBytes<'a> {
    Decoded(&'a Label),
    /// The value's format version (v4 or v5) and the label's bytes.
    Encoded(u8, &'a [u8]),
}

/// The encoded label of a v4 or v5 slot value, the bytes `Label::write` wrote, with the
/// value's version (None for v2): a completion moves its claim's label into the outcome as it
/// is, without reading it, in the version it was written in.
pub fn slot_label(bytes: &[u8]) -> Result<Option<LabelBytes<'_>>, DecodeError> {
    let mut r = Reader::new(bytes);
    let version = r.u8()?;
    if version != FORMAT_V4 && version != FORMAT_V5 {
        return Ok(None);
    }
    r.take(ENTRY_LEN)?;
    let before = r.rest().len();
    Label::skip(&mut r, version)?;
    let start = 1 + ENTRY_LEN;
    Ok(bytes.get(start..start + (before - r.rest().len())).map(|b| LabelBytes::Encoded(version, b)))
}

/// `encode_slot` from its parts, borrowed: a completion writes its snapshot without a copy.
pub fn encode_slot_parts(entry: &Entry, snapshot: Option<&Snapshot>, label: Option<LabelBytes>) -> Vec<u8> {
    let snapshot_len = snapshot.map_or(0, |s| {
        8 + s.headers.iter().map(|(n, val)| 6 + n.len() + val.len()).sum::<usize>() + s.body.len()
    });
    let label_len = label.map_or(0, |l| match l {
        LabelBytes::Decoded(l) => l.encoded_len(),
        LabelBytes::Encoded(_, b) => b.len(),
    });
    let mut out = Vec::with_capacity(1 + ENTRY_LEN + label_len + snapshot_len);
    out.push(match label {
        None => FORMAT_V2,
        Some(LabelBytes::Decoded(l)) => l.version(),
        Some(LabelBytes::Encoded(version, _)) => version,
    });
    let mut entry = *entry;
    // The flag and the snapshot's presence must agree, or the bytes would have two meanings.
    if snapshot.is_some() {
        entry.flags &= !FLAG_BODY_NOT_STORED;
    } else {
        entry.flags |= FLAG_BODY_NOT_STORED;
    }
    write_entry(&mut out, &entry);
    match label {
        Some(LabelBytes::Decoded(l)) => l.write(&mut out),
        Some(LabelBytes::Encoded(_, b)) => out.extend_from_slice(b),
        None => {}
    }
    let Some(s) = snapshot else { return out };
    out.extend_from_slice(&s.status.to_be_bytes());
    // Header counts and sizes are bounded by Envoy's header limits (far below these widths);
    // anything beyond is dropped rather than wrapped, so a decoder never mis-frames.
    let headers: Vec<_> = s
        .headers
        .iter()
        .filter(|(n, val)| n.len() <= usize::from(u16::MAX) && u32::try_from(val.len()).is_ok())
        .take(usize::from(u16::MAX))
        .collect();
    out.extend_from_slice(&(headers.len() as u16).to_be_bytes());
    for (name, value) in headers {
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
    let body = &s.body[..s.body.len().min(u32::MAX as usize)];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// Decodes a local store's slot: a committed outcome (v2 or v4), or (v4 only) the label a claim
/// left there when it fenced the slot, a processing entry without snapshot, which is no outcome
/// (`SlotValue::is_claim_label`).
pub fn decode_slot(bytes: &[u8]) -> Result<SlotValue, DecodeError> {
    decode_slot_layout(bytes, false, true)
}

/// `decode_slot` without the label (None whatever the version): a replay reads only the outcome,
/// and steps over the label's bytes rather than copying them.
pub fn decode_slot_outcome(bytes: &[u8]) -> Result<SlotValue, DecodeError> {
    decode_slot_layout(bytes, false, false)
}

/// Decodes a whole record as the etcd store keeps it under one key: the slot layout, whose entry
/// may also be processing (a claim, which has no snapshot: `encode_slot` of a processing entry
/// without one). Written with `encode_slot`.
pub fn decode_record(bytes: &[u8]) -> Result<SlotValue, DecodeError> {
    decode_slot_layout(bytes, true, true)
}

fn decode_slot_layout(
    bytes: &[u8],
    claims_allowed: bool,
    with_label: bool,
) -> Result<SlotValue, DecodeError> {
    let mut r = Reader::new(bytes);
    let version = r.u8()?;
    if version != FORMAT_V2 && version != FORMAT_V4 && version != FORMAT_V5 {
        return Err(DecodeError::UnknownVersion(version));
    }
    let entry = read_entry(&mut r)?;
    let labelled = version != FORMAT_V2;
    let label = match (labelled, with_label) {
        (true, true) => Some(Label::read(&mut r, version)?),
        (true, false) => Label::skip(&mut r, version).map(|()| None)?,
        (false, _) => None,
    };
    // A claim (an etcd record, or a claim's label in a v4 slot) never has a snapshot.
    let claim_ok = (claims_allowed || labelled) && !entry.body_stored();
    if !entry.is_completed() && !claim_ok {
        return Err(DecodeError::BadState(entry.state.code()));
    }
    if !entry.body_stored() {
        if !r.rest().is_empty() {
            return Err(DecodeError::TrailingBytes);
        }
        return Ok(SlotValue { entry, snapshot: None, label });
    }
    let status = r.u16()?;
    let count = r.u16()?;
    let mut headers = Vec::with_capacity(usize::from(count).min(256));
    for _ in 0..count {
        let n = usize::from(r.u16()?);
        let name = String::from_utf8(r.take(n)?.to_vec()).map_err(|_| DecodeError::Truncated)?;
        let vlen = r.u32()? as usize;
        headers.push((name, r.take(vlen)?.to_vec()));
    }
    let blen = r.u32()? as usize;
    let body = r.take(blen)?.to_vec();
    if !r.rest().is_empty() {
        return Err(DecodeError::TrailingBytes);
    }
    Ok(SlotValue { entry, snapshot: Some(Snapshot { status, headers, body }), label })
}

/// Big-endian reads off the front of a value, each `Truncated` past its end (the local store's
/// formats read with it too: `local/format.rs`).
pub(in crate::store) struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(in crate::store) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.bytes.len() {
            return Err(DecodeError::Truncated);
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(in crate::store) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    pub(in crate::store) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    pub(in crate::store) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array()?))
    }
    pub(in crate::store) fn rest(&self) -> &'a [u8] {
        self.bytes
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::local::format::{decode_bucket, encode_bucket};

    /// What each value this build cannot read is said to be: a newer build's version is one, not
    /// damage; the rest say what is wrong with the bytes.
    #[test]
    fn a_value_this_build_cannot_read_says_what_it_is() {
        let said = |e: Result<SlotValue, DecodeError>| e.err().map(|e| e.to_string()).unwrap_or_default();
        let snapshot = Some(Snapshot { status: 201, headers: vec![], body: vec![] });
        let mut newer = encode_slot(&SlotValue { entry: entry(0, 1), snapshot, label: None });
        newer[0] = 6;
        assert_eq!(
            said(decode_record(&newer)),
            "format version 6, written by a newer build of the filter (this one reads versions up to 5); left as it is"
        );
        assert_eq!(
            decode_bucket(&[3, 1], 8).err().map(|e| e.to_string()).unwrap_or_default(),
            "format version 3, which this kind of value does not have: written by a newer build of the filter, or \
             damaged"
        );
        let mut flagged = encode_bucket(&[entry(0, 1)]);
        flagged[4] |= 0x08;
        assert_eq!(
            decode_bucket(&flagged, 8).err().map(|e| e.to_string()).unwrap_or_default(),
            "record flags 0x0c, some unknown to this build: written by a newer build of the filter, or damaged"
        );
        let mut stated = encode_bucket(&[entry(0, 1)]);
        stated[3] = 9;
        assert_eq!(
            decode_bucket(&stated, 8).err().map(|e| e.to_string()).unwrap_or_default(),
            "record state 9, unknown to this build: written by a newer build of the filter, or damaged"
        );
        let whole = encode_bucket(&[entry(0, 1)]);
        let cut = whole.get(..whole.len() - 1).unwrap_or_default();
        assert_eq!(
            decode_bucket(cut, 8).err().map(|e| e.to_string()).unwrap_or_default(),
            "shorter than its format says: damaged"
        );
        let longer = [whole.as_slice(), &[0]].concat();
        assert_eq!(
            decode_bucket(&longer, 8).err().map(|e| e.to_string()).unwrap_or_default(),
            "longer than its format says: damaged"
        );
    }

    /// A completed entry at `position` of `owner` (the local formats' tests use it too).
    pub(crate) fn entry(position: u8, owner: u64) -> Entry {
        Entry {
            position,
            state: State::Succeeded,
            flags: FLAG_PRINCIPAL_CHARGED,
            status: 201,
            scope: ScopeId([position; 32]),
            fingerprint: Fingerprint([7; 32]),
            owner,
            lease_deadline_ms: 10,
            expires_at_ms: 99,
            charged_at_ms: 1,
            tenant_tag: 0,
            principal_tag: 0xfeed,
        }
    }

    #[test]
    fn every_truncation_of_a_slot_is_an_error() {
        let v = SlotValue {
            entry: entry(3, 42),
            snapshot: Some(Snapshot {
                status: 201,
                headers: vec![("set-cookie".into(), b"a=b".to_vec()), ("x".into(), vec![0xff])],
                body: b"{\"id\":1}".to_vec(),
            }),
            label: None,
        };
        let bytes = encode_slot(&v);
        assert_eq!(decode_slot(&bytes), Ok(v));
        for n in 0..bytes.len() {
            assert!(decode_slot(&bytes[..n]).is_err(), "prefix {n}");
        }
    }

    #[test]
    fn a_slot_without_body_carries_the_outcome_alone() {
        let v = SlotValue {
            entry: Entry { flags: FLAG_BODY_NOT_STORED | FLAG_TENANT_CHARGED, ..entry(2, 5) },
            snapshot: None,
            label: None,
        };
        let bytes = encode_slot(&v);
        assert_eq!(bytes.len(), 1 + ENTRY_LEN);
        assert_eq!(decode_slot(&bytes), Ok(v));
        // A processing entry is never a committed outcome.
        let processing = SlotValue {
            entry: Entry { state: State::Processing, ..entry(2, 5) },
            snapshot: None,
            label: None,
        };
        assert_eq!(decode_slot(&encode_slot(&processing)), Err(DecodeError::BadState(1)));
    }

    #[test]
    fn an_outcome_unknown_round_trips_in_the_shape_older_builds_read_as_not_stored() {
        let unknown = Entry {
            state: State::FailedFinal,
            status: STATUS_OUTCOME_UNKNOWN,
            flags: FLAG_BODY_NOT_STORED | FLAG_PRINCIPAL_CHARGED,
            ..entry(2, 5)
        };
        let v = SlotValue { entry: unknown, snapshot: None, label: None };
        let bytes = encode_slot(&v);
        assert_eq!(decode_slot(&bytes), Ok(v.clone()));
        assert_eq!(decode_record(&bytes), Ok(v.clone()));
        assert_eq!(decode_bucket(&encode_bucket(&[unknown]), 8), Ok(vec![unknown]));
        let read = decode_slot(&bytes).unwrap().entry;
        assert!(read.outcome_unknown() && !read.body_stored());
        // What an older build checks: version 2, a known state (FAILED_FINAL) and only known
        // flags, the body-not-stored one among them, and nothing after the entry. It decodes
        // the value as an outcome kept without its body: 410, never a replay or a new execution.
        assert_eq!((bytes[0], bytes[2], bytes[3] & !KNOWN_FLAGS), (FORMAT_V2, 3, 0));
        assert_ne!(bytes[3] & FLAG_BODY_NOT_STORED, 0);
        assert_eq!(bytes.len(), 1 + ENTRY_LEN);
        // A real outcome and a claim are not unknown ones.
        assert!(!entry(2, 5).outcome_unknown());
        assert!(!Entry { state: State::Processing, status: 0, ..entry(2, 5) }.outcome_unknown());
    }

    #[test]
    fn status_0_on_a_completed_entry_has_one_shape_only() {
        let shapes =
            [(State::Succeeded, FLAG_BODY_NOT_STORED), (State::FailedFinal, 0), (State::Succeeded, 0)];
        for (state, flags) in shapes {
            let e = Entry { state, status: 0, flags, ..entry(1, 1) };
            let bucket = encode_bucket(&[e]);
            assert_eq!(decode_bucket(&bucket, 8), Err(DecodeError::NonCanonical), "{state:?} {flags}");
            let mut slot = vec![FORMAT_V2];
            write_entry(&mut slot, &e);
            assert!(decode_slot(&slot).is_err(), "{state:?} {flags}");
        }
    }

    #[test]
    fn a_claim_is_a_record_for_etcd_but_never_a_slot() {
        let claim = Entry { state: State::Processing, status: 0, ..entry(0, 5) };
        let bytes = encode_slot(&SlotValue { entry: claim, snapshot: None, label: None });
        let read = decode_record(&bytes);
        assert_eq!(
            read.as_ref().map(|v| (v.entry.state, v.snapshot.is_none())),
            Ok((State::Processing, true))
        );
        assert_eq!(decode_slot(&bytes), Err(DecodeError::BadState(1)));
        // A claim claiming a stored body would be two meanings for one value.
        let mut with_body = bytes.clone();
        with_body[1 + 2] &= !FLAG_BODY_NOT_STORED;
        assert!(decode_record(&with_body).is_err());
        // Outcomes read the same either way.
        let done = SlotValue {
            entry: Entry { flags: FLAG_PRINCIPAL_CHARGED | FLAG_BODY_NOT_STORED, ..entry(0, 5) },
            snapshot: None,
            label: None,
        };
        assert_eq!(decode_record(&encode_slot(&done)), Ok(done.clone()));
        assert_eq!(decode_slot(&encode_slot(&done)), Ok(done));
    }

    /// A label as the previous build wrote it (v4: route and key only).
    fn labelled_v4(entry: Entry, snapshot: Option<Snapshot>) -> SlotValue {
        SlotValue { entry, snapshot, label: Some(Label::new("orders", "order-42 ü").created_at(7)) }
    }

    fn scope_of(tenant: Option<&[&[u8]]>) -> Label {
        let principal = [0xab; 32];
        let scope = LabelScope {
            method: "POST",
            host: b"api.example",
            path: "/orders",
            tenant,
            principal: &principal,
        };
        Label::scoped("orders", "order-42 ü", &scope).created_at(7)
    }

    /// A label as this build writes it (v5: with the record's scope).
    fn labelled(entry: Entry, snapshot: Option<Snapshot>) -> SlotValue {
        SlotValue { entry, snapshot, label: Some(scope_of(Some(&[b"acme"]))) }
    }

    fn labelled_both(entry: Entry, snapshot: Option<Snapshot>) -> [SlotValue; 3] {
        let no_tenant = SlotValue { label: Some(scope_of(None)), ..labelled(entry, snapshot.clone()) };
        [labelled_v4(entry, snapshot.clone()), labelled(entry, snapshot), no_tenant]
    }

    #[test]
    fn a_labelled_outcome_round_trips_and_every_truncation_is_an_error() {
        let snapshot =
            Snapshot { status: 201, headers: vec![("a".into(), b"b".to_vec())], body: b"{}".to_vec() };
        let values = [
            labelled_both(entry(3, 42), Some(snapshot)),
            labelled_both(Entry { flags: FLAG_BODY_NOT_STORED, ..entry(3, 42) }, None),
        ];
        for v in values.into_iter().flatten() {
            let bytes = encode_slot(&v);
            let label = v.label.clone().unwrap();
            assert_eq!(bytes[0], if label.method().is_some() { FORMAT_V5 } else { FORMAT_V4 });
            assert_eq!(decode_slot(&bytes), Ok(v.clone()));
            assert_eq!(decode_record(&bytes), Ok(v.clone()));
            assert_eq!((label.route(), label.key(), label.created_at_ms), ("orders", "order-42 ü", 7));
            for n in 0..bytes.len() {
                assert!(decode_slot(&bytes[..n]).is_err(), "prefix {n}");
                assert!(decode_slot_outcome(&bytes[..n]).is_err(), "prefix {n}");
            }
            // A replay's read steps over the label: the same outcome, without it.
            assert_eq!(decode_slot_outcome(&bytes), Ok(SlotValue { label: None, ..v }));
            // An etcd label key holds the same label.
            let key = encode_label(&label);
            assert_eq!((key[0], decode_label(&key)), (bytes[0], Ok(label)));
            for n in 0..key.len() {
                assert!(decode_label(&key[..n]).is_err(), "prefix {n}");
            }
        }
    }

    #[test]
    fn a_label_names_the_records_scope_and_one_the_previous_build_wrote_reads_without_it() {
        let [v4, v5, no_tenant] = labelled_both(Entry { flags: FLAG_BODY_NOT_STORED, ..entry(3, 42) }, None);
        let l = v5.label.unwrap();
        assert_eq!(
            (l.method(), l.host(), l.path(), l.tenant(), l.principal()),
            (Some("POST"), Some("api.example"), Some("/orders"), Some("acme"), Some([0xab; 4]))
        );
        let l = no_tenant.label.unwrap();
        assert_eq!((l.tenant(), l.host()), (None, Some("api.example")));
        let l = v4.label.clone().unwrap();
        assert_eq!(
            (l.method(), l.host(), l.path(), l.tenant(), l.principal()),
            (None, None, None, None, None)
        );
        // The previous build's bytes, as it wrote them: version 4, entry, created_at, route, key.
        let mut written = vec![FORMAT_V4];
        write_entry(&mut written, &Entry { flags: FLAG_BODY_NOT_STORED, ..entry(3, 42) });
        written.extend_from_slice(&7u64.to_be_bytes());
        written.push(6);
        written.extend_from_slice(b"orders");
        written.push(11);
        written.extend_from_slice("order-42 ü".as_bytes());
        assert_eq!(decode_slot(&written), Ok(v4.clone()));
        assert_eq!(encode_slot(&v4), written, "a v4 label is written back as v4");
        let mut key = vec![FORMAT_V4];
        key.extend_from_slice(&written[1 + ENTRY_LEN..]);
        assert_eq!(decode_label(&key), Ok(v4.label.unwrap()));
        // Several tenant header values read as one list.
        let principal = [1; 32];
        let two: &[&[u8]] = &[b"a", b"b"];
        let scope =
            LabelScope { method: "PUT", host: b"h", path: "/", tenant: Some(two), principal: &principal };
        assert_eq!(Label::scoped("r", "k", &scope).tenant(), Some("a,b"));
    }

    #[test]
    fn a_claims_label_reads_from_a_slot_as_no_outcome() {
        let claim = Entry { state: State::Processing, flags: FLAG_BODY_NOT_STORED, status: 0, ..entry(2, 5) };
        for v in labelled_both(claim, None) {
            let read = decode_slot(&encode_slot(&v)).unwrap();
            assert!(read.is_claim_label());
            assert_eq!(read, v);
        }
        // An outcome is none.
        assert!(!labelled(Entry { flags: FLAG_BODY_NOT_STORED, ..entry(2, 5) }, None).is_claim_label());
    }

    #[test]
    fn a_claims_label_moves_into_its_outcome_as_bytes_exactly_as_if_decoded() {
        let claim = Entry { state: State::Processing, flags: FLAG_BODY_NOT_STORED, status: 0, ..entry(2, 5) };
        let snapshot =
            Snapshot { status: 201, headers: vec![("a".into(), b"b".to_vec())], body: b"{}".to_vec() };
        // A claim the previous build labelled (v4) keeps its v4 label in its outcome, and one
        // this build labelled its v5 one.
        for (claim, outcome) in
            labelled_both(claim, None).into_iter().zip(labelled_both(entry(2, 5), Some(snapshot)))
        {
            let claimed = encode_slot(&claim);
            let moved = slot_label(&claimed).unwrap().unwrap();
            assert!(matches!(moved, LabelBytes::Encoded(v, _) if v == claimed[0]));
            assert_eq!(
                encode_slot_parts(&outcome.entry, outcome.snapshot.as_ref(), Some(moved)),
                encode_slot(&outcome)
            );
            // A v2 value has none; a truncated label is an error, not a shorter label.
            assert_eq!(slot_label(&encode_slot(&SlotValue { label: None, ..outcome })), Ok(None));
            assert!(slot_label(&claimed[..claimed.len() - 1]).is_err());
        }
    }

    #[test]
    fn a_label_is_cut_at_its_bounds_on_a_character_boundary_and_bad_text_is_refused() {
        let long = Label::new(&"r".repeat(100), &"é".repeat(200));
        assert_eq!(long.route().len(), LABEL_ROUTE_MAX);
        assert_eq!(long.key().len(), 254);
        assert!(long.key().chars().all(|c| c == 'é'));
        for v in labelled_both(Entry { flags: FLAG_BODY_NOT_STORED, ..entry(2, 5) }, None) {
            let mut bytes = encode_slot(&v);
            // The key's first byte (after version, entry, created_at, route len + route, key len).
            let at = 1 + ENTRY_LEN + 8 + 1 + "orders".len() + 1;
            bytes[at] = 0xff;
            assert_eq!(decode_slot(&bytes), Err(DecodeError::NonCanonical));
        }
        // A long method, host, path or tenant is cut and marked; the label stays bounded.
        let principal = [9; 32];
        let host = "h".repeat(300);
        let tenant = "t".repeat(100);
        let tenants: &[&[u8]] = &[tenant.as_bytes()];
        let path = format!("/{}", "p".repeat(500));
        let method = "M".repeat(40);
        let scope = LabelScope {
            method: &method,
            host: host.as_bytes(),
            path: &path,
            tenant: Some(tenants),
            principal: &principal,
        };
        let l = Label::scoped(&"r".repeat(100), &"k".repeat(255), &scope);
        for (part, max) in [
            (l.method(), LABEL_METHOD_MAX),
            (l.host(), LABEL_HOST_MAX),
            (l.path(), LABEL_PATH_MAX),
            (l.tenant(), LABEL_TENANT_MAX),
        ] {
            let part = part.unwrap();
            assert!(part.len() <= max && part.ends_with(LABEL_CUT), "{part}");
        }
        // Cut on a character boundary: 30 ü (60 bytes) and the marker.
        let wide = "ü".repeat(100);
        let wide: &[&[u8]] = &[wide.as_bytes()];
        let cut = Label::scoped("r", "k", &LabelScope { tenant: Some(wide), ..scope });
        assert_eq!(cut.tenant(), Some(format!("{}{LABEL_CUT}", "ü".repeat(30)).as_str()));
        let bytes = encode_label(&l);
        assert_eq!(decode_label(&bytes), Ok(l.clone()));
        assert_eq!(bytes.len(), 1 + 8 + 6 + 64 + 255 + 16 + 96 + 128 + 64 + 4, "the largest label");
        // A filter's value is compared as a label keeps it.
        assert_eq!(label_part(&host, LABEL_HOST_MAX), l.host().unwrap());
        assert_eq!(label_part("short", LABEL_HOST_MAX), "short");
        // A tenant length that is neither a length nor "no tenant" is refused.
        let mut bad = encode_label(&scope_of(Some(&[b"acme"])));
        let at = 1 + 8 + 1 + 6 + 1 + 11 + 1 + 4 + 1 + 11 + 1 + 7;
        assert_eq!(bad[at], 4);
        bad[at] = 65;
        assert!(decode_label(&bad).is_err());
    }
}
