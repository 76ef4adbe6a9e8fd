//! Records kept in several etcd clusters (`store.shards`), behind the one storage interface as a
//! single store. Each shard is a whole etcd store of its own (`EtcdRemote`): its claims, leases,
//! auth token, replay cache and watch stream are that shard's, so what one shard does (a stale
//! token, a full quota, an outage) touches only its own records. A record lives on the shard its
//! scope hashes to; nothing ever spans two shards, except the admin API's list, which reads them
//! in turn.
//!
//! The shard is chosen by rendezvous hashing (highest random weight) of the scope with each
//! shard's cluster name: every Envoy listing the same clusters picks the same shard whatever
//! their order, and adding a shard to N moves only the records it wins, about 1/(N+1) of them.

use std::rc::Rc;

use super::remote::EtcdRemote;
use super::EtcdStore;
use crate::config::etcd::EtcdSettings;
use crate::identity::scope::ScopeId;
use crate::splitmix::splitmix64;
use crate::store::remote::{Answer, Conversation, Next, RemoteSettings};
use crate::store::seam::{Started, Store, Watch};
use crate::store::{Claim, RecordId, RecordPage, RecordQuery, StoreAnswer, StoreError, StoreOp};

/// A shard's weight seed: its cluster's name, hashed (FNV-1a), so that a shard keeps its records
/// wherever it stands in the list.
fn seed(cluster: &str) -> u64 {
    cluster.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The index of `scope`'s shard among `seeds`: the highest weight wins, the first of equals.
pub fn home(seeds: &[u64], scope: &ScopeId) -> usize {
    // A scope id is a digest: any 8 of its bytes are uniformly spread.
    let mut first = [0u8; 8];
    first.copy_from_slice(scope.0.get(..8).unwrap_or(&[0; 8]));
    let key = u64::from_le_bytes(first);
    let mut best = (0, 0);
    for (i, s) in seeds.iter().enumerate() {
        let weight = splitmix64(s ^ key);
        if i == 0 || weight > best.1 {
            best = (i, weight);
        }
    }
    best.0
}

pub struct EtcdShards {
    shards: Rc<Vec<EtcdRemote>>,
    seeds: Vec<u64>,
}

impl EtcdShards {
    /// A store over every shard of `settings` (at most `config::etcd::MAX_SHARDS`).
    pub fn new(settings: &EtcdSettings) -> EtcdShards {
        let each = settings.shard_settings();
        let seeds = each.iter().map(|s| seed(&s.cluster)).collect();
        let shards = each.into_iter().map(|s| EtcdRemote::new(EtcdStore::new(s))).collect();
        EtcdShards { shards: Rc::new(shards), seeds }
    }

    /// The shard `scope`'s record lives on.
    pub fn home(&self, scope: &ScopeId) -> usize {
        home(&self.seeds, scope)
    }

    /// The shard an operation is about; None: the admin API's look that every shard answers.
    fn shard_of(&self, op: &StoreOp) -> Option<usize> {
        let scope = match op {
            StoreOp::Begin(attempt) => &attempt.scope,
            StoreOp::Complete { claim, .. } | StoreOp::Release(claim) => &claim.scope,
            StoreOp::Amend { view, .. } => &view.scope,
            StoreOp::Records(RecordQuery { id: Some(RecordId::Scope(scope)), .. }) => scope,
            StoreOp::Records(_) => return None,
        };
        Some(self.home(scope))
    }
}

impl Store for EtcdShards {
    fn start(&self, op: StoreOp, now: &dyn Fn() -> u64) -> Started {
        let Some(i) = self.shard_of(&op) else {
            return match look_through(Rc::clone(&self.shards), op) {
                Ok(look) => Started::first_step(look, now()),
                Err(refused) => Started::Answered(StoreAnswer::Records(Err(refused))),
            };
        };
        let Some(shard) = self.shards.get(i) else {
            return Started::Answered(StoreAnswer::failed(&op, StoreError::Unavailable("no shard".into())));
        };
        match shard.start(op, now) {
            Started::Conversation(conversation) => {
                Started::Conversation(Box::new(OnShard { shard: shard_number(i), conversation }))
            }
            answered => answered,
        }
    }
    fn remote_for(&self, shard: u8) -> Option<&RemoteSettings> {
        self.shards.get(usize::from(shard))?.remote_for(0)
    }
    fn held_past_lease_ms(&self, lease_ms: u64) -> u64 {
        super::leases::held_past_lease_ms(lease_ms)
    }
    fn take_woken(&self) -> bool {
        // Every shard's flag is taken, not just the first one set.
        self.shards.iter().fold(false, |woken, shard| shard.take_woken() | woken)
    }
    fn watch(&self, scope: &ScopeId) -> Option<&dyn Watch> {
        self.shards.get(self.home(scope))?.watch(scope)
    }
    fn watches(&self) -> Vec<&dyn Watch> {
        self.shards.iter().flat_map(|s| s.watches()).collect()
    }
}

fn shard_number(i: usize) -> u8 {
    // `config` allows at most MAX_SHARDS (32) shards.
    u8::try_from(i).unwrap_or(u8::MAX)
}

/// One shard's conversation: its calls go to that shard's cluster.
struct OnShard {
    shard: u8,
    conversation: Box<dyn Conversation>,
}

impl Conversation for OnShard {
    fn step(&mut self, answer: Option<Answer>, now_ms: u64) -> Next {
        match self.conversation.step(answer, now_ms) {
            Next::Call(request) => Next::Call(crate::store::remote::Request { shard: self.shard, ..request }),
            next => next,
        }
    }
    fn into_op(self: Box<Self>) -> StoreOp {
        self.conversation.into_op()
    }
    fn unanswered_claim(&self) -> Option<Claim> {
        self.conversation.unanswered_claim()
    }
}

/// The admin API's look at records over every shard, one after the other: a page holds what the
/// shards gave until the limit, and its cursor (`<shard>s<that shard's cursor>`) says where the
/// next one starts.
fn look_through(shards: Rc<Vec<EtcdRemote>>, op: StoreOp) -> Result<Box<dyn Conversation>, StoreError> {
    let StoreOp::Records(query) = op else { return Err(StoreError::Unavailable("not a look".into())) };
    let (shard, cursor) = match query.cursor.as_deref().map(|c| (c, c.split_once('s'))) {
        None => (0, None),
        Some((_, Some((n, rest)))) if n.parse::<usize>().is_ok_and(|n| n < shards.len()) => {
            (n.parse::<usize>().unwrap_or(0), (!rest.is_empty()).then(|| rest.to_string()))
        }
        Some((c, _)) => return Err(StoreError::Corrupt(format!("cursor {c:?}"))),
    };
    Ok(Box::new(LookThrough { shards, query, shard, cursor, current: None, found: RecordPage::default() }))
}

struct LookThrough {
    shards: Rc<Vec<EtcdRemote>>,
    query: RecordQuery,
    /// The shard being read, from the cursor's on.
    shard: usize,
    /// Where in it to start (the first shard read only).
    cursor: Option<String>,
    current: Option<Box<dyn Conversation>>,
    found: RecordPage,
}

impl LookThrough {
    /// What this shard's look answered; None: go on to the next shard.
    fn page_read(&mut self, page: RecordPage) -> Option<Next> {
        self.found.views.extend(page.views);
        if let Some(next) = page.next {
            self.found.next = Some(format!("{}s{next}", self.shard));
            return Some(self.done());
        }
        self.shard += 1;
        if self.shard >= self.shards.len() {
            return Some(self.done());
        }
        if self.found.views.len() >= self.query.limit {
            self.found.next = Some(format!("{}s", self.shard));
            return Some(self.done());
        }
        None
    }

    fn done(&mut self) -> Next {
        Next::Done(StoreAnswer::Records(Ok(std::mem::take(&mut self.found))))
    }
}

impl Conversation for LookThrough {
    fn step(&mut self, mut answer: Option<Answer>, now_ms: u64) -> Next {
        loop {
            let next = match self.current.as_mut() {
                Some(conversation) => conversation.step(answer.take(), now_ms),
                None => {
                    let Some(shard) = self.shards.get(self.shard) else { return self.done() };
                    let query = RecordQuery {
                        limit: self.query.limit.saturating_sub(self.found.views.len()).max(1),
                        cursor: self.cursor.take(),
                        ..self.query.clone()
                    };
                    match shard.start(StoreOp::Records(query), &|| now_ms) {
                        Started::Answered(answer) => Next::Done(answer),
                        Started::Conversation(conversation) => {
                            self.current = Some(conversation);
                            continue;
                        }
                    }
                }
            };
            match next {
                Next::Call(request) => {
                    return Next::Call(crate::store::remote::Request {
                        shard: shard_number(self.shard),
                        ..request
                    })
                }
                Next::Wait => return Next::Wait,
                Next::Done(StoreAnswer::Records(Ok(page))) => {
                    self.current = None;
                    if let Some(next) = self.page_read(page) {
                        return next;
                    }
                }
                Next::Done(failed) => return Next::Done(failed),
            }
        }
    }
    fn into_op(self: Box<Self>) -> StoreOp {
        StoreOp::Records(self.query)
    }
}

#[cfg(test)]
mod tests;
