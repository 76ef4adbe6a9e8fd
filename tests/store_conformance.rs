//! The store conformance suite instantiated from outside the crate, as a second backend (etcd)
//! will: the suite, the fake shared data and the local store are reachable through the
//! `testing` feature alone.

use idempotency_filter::store::conformance::Backend;
use idempotency_filter::store::fake::FakeSharedData;
use idempotency_filter::store::local::LocalStore;
use idempotency_filter::store::RecordStore;

struct Local {
    data: FakeSharedData,
    capacity: u32,
}

impl Backend for Local {
    fn with_capacity(capacity: u32) -> Self {
        let local = Local { data: FakeSharedData::new(), capacity };
        // Creates the layout, as on_configure does before any worker serves.
        if let Err(e) = LocalStore::open(&local.data, capacity, [1; 32], 0) {
            unreachable!("the fake never refuses: {e}");
        }
        local
    }

    fn worker(&self, n: u8) -> Box<dyn RecordStore + '_> {
        // Every worker keeps a room of tombstones, as a configuration with a rule that keeps
        // them does (`store.tombstones`): twice the records.
        let opened = LocalStore::open(&self.data, self.capacity, [n.wrapping_add(2); 32], 0)
            .and_then(|s| s.keeping_tombstones(2 * self.capacity, 0));
        match opened {
            Ok(store) => Box::new(store),
            Err(e) => unreachable!("the fake never refuses: {e}"),
        }
    }
}

idempotency_filter::conformance_suite!(Local);
