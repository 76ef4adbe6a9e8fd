//! The audit trail's part of a request's flow: its record's outcome, once known, and the entry
//! an outcome counted for its stream publishes.

use crate::metrics::Counter;
use crate::store::record::State;
use crate::worker::flow::RequestFlow;

impl RequestFlow {
    /// What the record is being completed with (a stored answer, a lookup's): its entry says it.
    pub(in crate::worker) fn audit_outcome(&mut self, state: State, status: u16) {
        if let Some(record) = &mut self.audit {
            record.outcome = Some((state, status));
        }
    }

    /// The audit entry of `counter`, counted for this flow's stream now (`now_ms`, a host call
    /// made only for an entry): None without `audit`, or for an outcome that changed no record
    /// (a replay, a refusal).
    pub fn audit_entry(&self, counter: Counter, now_ms: impl FnOnce() -> u64) -> Option<Vec<u8>> {
        self.audit.as_ref()?.entry(counter, now_ms)
    }
}
