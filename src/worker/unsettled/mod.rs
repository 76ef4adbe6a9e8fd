//! The unsettled records gauge (issue 47): per route, the records of this Envoy's requests whose
//! outcome is unknown (`outcome_unknown`: completed as such, a retry answered 502) or left in
//! flight for a takeover or the upstream's lookup (`processing`), exported as
//! `idempotency.route.<rule>.unsettled_records.<state>`, so an alert fires for as long as one
//! stays unsettled, not for a window after it appeared.
//!
//! Kept cheap on both stores: nothing on a replay or a new key. A request that meets an unknown
//! outcome (the rare path) notes its record in this Envoy's registry (one shared-data key,
//! `REGISTRY_KEY`: two host calls, and the gauges set again). Every `RECHECK_MS` one root of the
//! Envoy (the one whose CAS on the registry's next check wins) asks the store for each noted
//! record, as the admin API looks one up (the local store in place; etcd one range, then its
//! label) and drops those settled (resolved, released, reconciled, replaced, expired). Every
//! root, at its own look every `RECHECK_MS`, sets its rules' gauges from what the registry
//! holds, since the check may be won by a root of another configuration on the VM (the admin
//! listener's has no rule and no gauge). So a record settled anywhere in a fleet (another
//! sidecar's lookup, an operator on any admin listener) leaves the gauge within two
//! `RECHECK_MS`, and a record forgotten by its store (its ttl) too. The registry keeps `MAX_NOTED` records at most: past
//! them the gauges stay at what they hold (an alert fires either way).

pub mod note;
pub mod root;

use crate::host::Host;
use crate::identity::scope::ScopeId;
use crate::metrics::Counter;
use crate::store::record::Entry;

/// The shared-data key of this Envoy's registry (one per vm_id).
pub const REGISTRY_KEY: &str = "idempotency.unsettled.v1";
/// How often one root of the Envoy looks the noted records up again.
pub const RECHECK_MS: u64 = 5_000;
/// Records the registry keeps at most.
pub const MAX_NOTED: usize = 64;
/// Longest route name kept (the configuration's bound on a rule's name).
const ROUTE_MAX: usize = 64;
const FORMAT_V1: u8 = 1;

/// How a noted record stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Completed as "outcome unknown": retries get 502 until someone settles it.
    OutcomeUnknown,
    /// In flight with no owner at work (its lease ended without an outcome): waiting for a
    /// takeover or the upstream's lookup.
    Processing,
}

impl Standing {
    /// The last part of its gauge's name.
    pub fn name(self) -> &'static str {
        match self {
            Standing::OutcomeUnknown => "outcome_unknown",
            Standing::Processing => "processing",
        }
    }

    fn byte(self) -> u8 {
        match self {
            Standing::OutcomeUnknown => 0,
            Standing::Processing => 1,
        }
    }
}

/// The gauges of one route rule: `idempotency.route.<rule>.unsettled_records.<state>`.
pub fn gauge_name(rule: &str, state: Standing) -> String {
    format!("idempotency.route.{rule}.unsettled_records.{}", state.name())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Noted {
    pub scope: ScopeId,
    pub route: String,
    pub standing: Standing,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Unsettled {
    /// When a root looks the noted records up next (a root that CAS-moves it does).
    pub next_check_ms: u64,
    pub noted: Vec<Noted>,
}

impl Unsettled {
    /// Notes a record (its standing updated if it is there). False: nothing changed (there
    /// already as it is, or the registry is full).
    pub fn note(&mut self, noted: Noted) -> bool {
        if let Some(there) = self.noted.iter_mut().find(|n| n.scope == noted.scope) {
            let changed = *there != noted;
            *there = noted;
            return changed;
        }
        if self.noted.len() >= MAX_NOTED {
            return false;
        }
        self.noted.push(noted);
        true
    }

    /// How many noted records of `rule` stand as `standing`.
    pub fn count(&self, rule: &str, standing: Standing) -> u64 {
        self.noted.iter().filter(|n| n.route == rule && n.standing == standing).count() as u64
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(10 + self.noted.len() * 48);
        out.push(FORMAT_V1);
        out.extend_from_slice(&self.next_check_ms.to_be_bytes());
        out.push(u8::try_from(self.noted.len()).unwrap_or(u8::MAX));
        for n in &self.noted {
            out.extend_from_slice(&n.scope.0);
            out.push(n.standing.byte());
            let route = &n.route.as_bytes()[..n.route.len().min(ROUTE_MAX)];
            out.push(u8::try_from(route.len()).unwrap_or(0));
            out.extend_from_slice(route);
        }
        out
    }

    /// An empty value is an empty registry; bytes this build cannot read are one too (the
    /// registry is a cache of what the store holds: the next notes and checks rebuild it).
    pub fn decode(bytes: &[u8]) -> Unsettled {
        Self::try_decode(bytes).unwrap_or_default()
    }

    fn try_decode(bytes: &[u8]) -> Option<Unsettled> {
        let (&version, rest) = bytes.split_first()?;
        if version != FORMAT_V1 {
            return None;
        }
        let next_check_ms = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
        let (&count, mut rest) = rest.get(8..)?.split_first()?;
        let mut noted = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let scope = ScopeId(rest.get(..32)?.try_into().ok()?);
            let standing = match rest.get(32)? {
                0 => Standing::OutcomeUnknown,
                1 => Standing::Processing,
                _ => return None,
            };
            let len = usize::from(*rest.get(33)?);
            let route = std::str::from_utf8(rest.get(34..34 + len)?).ok()?.to_owned();
            noted.push(Noted { scope, route, standing });
            rest = rest.get(34 + len..)?;
        }
        rest.is_empty().then_some(Unsettled { next_check_ms, noted })
    }
}

/// Makes the registry's key if it is missing (at configure: a write to a missing key ignores
/// CAS, so it is made empty once and only ever CAS-written after), and defines this
/// configuration's gauges, two per rule.
pub fn prepare<H: Host>(
    host: &H,
    rules: &[std::rc::Rc<crate::config::Rule>],
) -> Result<Vec<(u32, u32)>, String> {
    let exists =
        host.get(REGISTRY_KEY).map_err(|e| format!("cannot prepare {REGISTRY_KEY}: {e:?}"))?.exists();
    if !exists {
        // Racy creation is harmless: every creator writes the same empty value.
        host.set(REGISTRY_KEY, &[], None).map_err(|e| format!("cannot prepare {REGISTRY_KEY}: {e:?}"))?;
    }
    rules
        .iter()
        .map(|r| {
            let define = |s: Standing| {
                host.define_gauge(&gauge_name(&r.name, s))
                    .map_err(|e| format!("cannot define the unsettled records gauge of {}: {e:?}", r.name))
            };
            Ok((define(Standing::OutcomeUnknown)?, define(Standing::Processing)?))
        })
        .collect()
}

/// The standing of the record a request's outcome `counter` leaves unsettled, if it does: an
/// unknown outcome completed as such (`refuse`), or kept in flight (`takeover`; `reconcile`, whose
/// lookup decides), a retry that met one (502), a lookup that settled nothing.
pub fn standing_after(counter: Counter, reconciles: bool) -> Option<Standing> {
    match counter {
        Counter::OutcomeUnknown if reconciles => Some(Standing::Processing),
        Counter::OutcomeUnknown | Counter::UnknownRefused => Some(Standing::OutcomeUnknown),
        Counter::KeptUnknown | Counter::ReconcileFailed => Some(Standing::Processing),
        _ => None,
    }
}

/// What a look at a noted record found: how it stands now, or None when it is settled (no
/// record, a known outcome) and leaves the registry. A claim within its lease is someone at
/// work on it (a takeover, a lookup's execution): still unsettled until it ends, as
/// `Processing`.
pub fn standing_of(entry: Option<&Entry>) -> Option<Standing> {
    let e = entry?;
    if e.outcome_unknown() {
        return Some(Standing::OutcomeUnknown);
    }
    (!e.is_completed()).then_some(Standing::Processing)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn noted(n: u8, route: &str, standing: Standing) -> Noted {
        Noted { scope: ScopeId([n; 32]), route: route.into(), standing }
    }

    #[test]
    fn a_registry_reads_back_as_written_and_unreadable_bytes_are_an_empty_one() {
        let mut r = Unsettled { next_check_ms: 77, noted: Vec::new() };
        assert!(r.note(noted(1, "pay", Standing::OutcomeUnknown)));
        assert!(r.note(noted(2, "orders", Standing::Processing)));
        assert_eq!(Unsettled::decode(&r.encode()), r);
        assert_eq!(Unsettled::decode(&[]), Unsettled::default());
        let mut cut = r.encode();
        cut.pop();
        assert_eq!(Unsettled::decode(&cut), Unsettled::default());
        assert_eq!(Unsettled::decode(&[9, 0, 0]), Unsettled::default());
    }

    #[test]
    fn a_record_is_noted_once_its_standing_updated_and_the_registry_bounded() {
        let mut r = Unsettled::default();
        assert!(r.note(noted(1, "pay", Standing::Processing)));
        assert!(!r.note(noted(1, "pay", Standing::Processing)));
        assert!(r.note(noted(1, "pay", Standing::OutcomeUnknown)));
        assert_eq!((r.count("pay", Standing::OutcomeUnknown), r.count("pay", Standing::Processing)), (1, 0));
        for n in 2..=MAX_NOTED as u8 {
            assert!(r.note(noted(n, "pay", Standing::OutcomeUnknown)));
        }
        assert!(!r.note(noted(200, "pay", Standing::OutcomeUnknown)));
        assert_eq!(r.count("pay", Standing::OutcomeUnknown), MAX_NOTED as u64);
        assert_eq!(r.count("other", Standing::OutcomeUnknown), 0);
    }

    #[test]
    fn only_an_unknown_outcome_or_an_unfinished_claim_stays_unsettled() {
        use crate::store::record::{State, FLAG_BODY_NOT_STORED, STATUS_OUTCOME_UNKNOWN};
        let claim = Entry {
            position: 0,
            state: State::Processing,
            flags: 0,
            status: 0,
            scope: ScopeId([1; 32]),
            fingerprint: crate::identity::fingerprint::Fingerprint([2; 32]),
            owner: 3,
            lease_deadline_ms: 10,
            expires_at_ms: 100,
            charged_at_ms: 0,
            tenant_tag: 0,
            principal_tag: 0,
        };
        let unknown = Entry {
            state: State::FailedFinal,
            status: STATUS_OUTCOME_UNKNOWN,
            flags: FLAG_BODY_NOT_STORED,
            ..claim
        };
        let known = Entry { state: State::Succeeded, status: 201, ..claim };
        assert_eq!(standing_of(Some(&claim)), Some(Standing::Processing));
        assert_eq!(standing_of(Some(&unknown)), Some(Standing::OutcomeUnknown));
        assert_eq!(standing_of(Some(&known)), None);
        assert_eq!(standing_of(None), None);
        assert_eq!(
            gauge_name("pay", Standing::OutcomeUnknown),
            "idempotency.route.pay.unsettled_records.outcome_unknown"
        );
    }
}
