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
use crate::store::remote::{Answer, Conversation, Next, RemoteSettings, Request};
use crate::store::seam::{Started, Store, Watch};
use crate::store::{
    Amendment, Begin, Claim, RecordId, RecordPage, RecordQuery, StoreAnswer, StoreError, StoreOp,
};

pub mod moving;
use moving::{Leg, Moving};

/// A shard's weight seed: its cluster's name, hashed (FNV-1a), so that a shard keeps its records
/// wherever it stands in the list.
fn seed(cluster: &str) -> u64 {
    cluster.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The index of `scope`'s shard among `seeds`: the highest weight wins, the first of equals.
pub fn home<'a>(seeds: impl IntoIterator<Item = &'a u64>, scope: &ScopeId) -> usize {
    // A scope id is a digest: any 8 of its bytes are uniformly spread.
    let mut first = [0u8; 8];
    first.copy_from_slice(scope.0.get(..8).unwrap_or(&[0; 8]));
    let key = u64::from_le_bytes(first);
    let mut best = (0, 0);
    for (i, s) in seeds.into_iter().enumerate() {
        let weight = splitmix64(s ^ key);
        if i == 0 || weight > best.1 {
            best = (i, weight);
        }
    }
    best.0
}

/// A shard list's shards: each one's index in the store's shards, and its weight seed.
type List = Vec<(u8, u64)>;

/// The shard of `list` that `scope`'s record lives on.
fn home_in(list: &List, scope: &ScopeId) -> u8 {
    list.get(home(list.iter().map(|(_, seed)| seed), scope)).map_or(0, |(shard, _)| *shard)
}

pub struct EtcdShards {
    /// Every shard of either list: the current list's, in its order, then the previous list's
    /// other clusters.
    shards: Rc<Vec<EtcdRemote>>,
    current: List,
    /// `store.previous_shards` (empty: no change under way).
    previous: List,
}

impl EtcdShards {
    /// A store over every shard of `settings` and of its previous list (at most
    /// `config::etcd::MAX_SHARDS` each).
    pub fn new(settings: &EtcdSettings) -> EtcdShards {
        let mut all: Vec<EtcdSettings> = Vec::new();
        let mut list = |each: Vec<EtcdSettings>| -> List {
            each.into_iter()
                .map(|s| {
                    let seed = seed(&s.cluster);
                    let at = all.iter().position(|x| x.cluster == s.cluster).unwrap_or_else(|| {
                        all.push(s);
                        all.len() - 1
                    });
                    (shard_number(at), seed)
                })
                .collect()
        };
        let current = list(settings.shard_settings());
        let previous = list(settings.previous_shard_settings());
        let shards = all.into_iter().map(|s| EtcdRemote::new(EtcdStore::new(s))).collect();
        EtcdShards { shards: Rc::new(shards), current, previous }
    }

    /// The shard `scope`'s record lives on.
    pub fn home(&self, scope: &ScopeId) -> u8 {
        home_in(&self.current, scope)
    }

    /// While the shard list changes, the shard `scope`'s record lived on by the previous list,
    /// when it is another one.
    pub fn old_home(&self, scope: &ScopeId) -> Option<u8> {
        if self.previous.is_empty() {
            return None;
        }
        Some(home_in(&self.previous, scope)).filter(|old| *old != self.home(scope))
    }

    /// `op` on one shard: its calls go there, its claims and records are that shard's.
    fn on(&self, shard: u8, op: StoreOp, now: &dyn Fn() -> u64) -> Started {
        let Some(store) = self.shards.get(usize::from(shard)) else {
            return Started::Answered(StoreAnswer::failed(
                &op,
                StoreError::Unavailable("no such shard".into()),
            ));
        };
        match store.start(op, now) {
            Started::Conversation(conversation) => {
                Started::Conversation(Box::new(OnShard { shard, conversation }))
            }
            Started::Answered(answer) => Started::Answered(on_shard(answer, shard)),
        }
    }

    /// An operation of a record whose home moves, carried out step by step as `Moving` plans.
    fn moving(&self, plan: Moving, first: Leg, now: &dyn Fn() -> u64) -> Started {
        let op = MovingOp { shards: Rc::clone(&self.shards), plan, next: Some(first), current: None };
        Started::first_step(Box::new(op), now())
    }
}

impl Store for EtcdShards {
    fn start(&self, op: StoreOp, now: &dyn Fn() -> u64) -> Started {
        let order = match &op {
            StoreOp::Begin(attempt) => {
                let new = self.home(&attempt.scope);
                return match self.old_home(&attempt.scope) {
                    Some(old) => {
                        let (plan, first) = Moving::begin(attempt.clone(), old, new);
                        self.moving(plan, first, now)
                    }
                    None => self.on(new, op, now),
                };
            }
            // A renewal's claims are one shard's (a moving claim's old home is a claim of its own,
            // on the old home's shard): the worker groups them so.
            StoreOp::Renew(renew) => {
                let shard = renew.claims.first().map_or(0, |c| c.shard);
                return self.on(shard, op, now);
            }
            StoreOp::Complete { claim, .. } | StoreOp::Release(claim) => {
                let shard = claim.shard;
                return match Moving::settle(op.clone()) {
                    Some((plan, first)) => self.moving(plan, first, now),
                    None => self.on(shard, op, now),
                };
            }
            // Where the look found it, and while its home moves, on its other home too.
            StoreOp::Amend { view, change, .. } => {
                let other = match self.old_home(&view.scope) {
                    Some(old) if old == view.shard => Some(self.home(&view.scope)),
                    Some(old) => Some(old),
                    None => None,
                };
                let Some(other) = other else { return self.on(view.shard, op, now) };
                let both = AmendBoth {
                    shards: Rc::clone(&self.shards),
                    op: op.clone(),
                    other,
                    change: change.clone(),
                    stage: AmendStage::First,
                    first: None,
                    current: None,
                };
                return Started::first_step(Box::new(both), now());
            }
            StoreOp::Records(RecordQuery { id: Some(RecordId::Scope(scope)), .. }) => {
                let mut order = vec![self.home(scope)];
                order.extend(self.old_home(scope));
                order
            }
            StoreOp::Records(_) => (0..self.shards.len()).map(shard_number).collect(),
        };
        // While homes move, a list shows each record on its new home: one an Envoy on the new list
        // made is on both (a lookup by id or tag finds either).
        let keep: Option<Keep> = match &op {
            StoreOp::Records(RecordQuery { id: None, .. }) if !self.previous.is_empty() => {
                let current = self.current.clone();
                Some(Box::new(move |scope, shard| home_in(&current, scope) == shard))
            }
            _ => None,
        };
        match look_through(Rc::clone(&self.shards), order, op, keep) {
            Ok(look) => Started::first_step(look, now()),
            Err(refused) => Started::Answered(StoreAnswer::Records(Err(refused))),
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
        // While the home moves, a record in flight is first read on its old home.
        let shard = self.old_home(scope).unwrap_or_else(|| self.home(scope));
        self.shards.get(usize::from(shard))?.watch(scope)
    }
    fn watches(&self) -> Vec<&dyn Watch> {
        self.shards.iter().flat_map(|s| s.watches()).collect()
    }
}

fn shard_number(i: usize) -> u8 {
    // `config` allows at most MAX_SHARDS (32) shards per list.
    u8::try_from(i).unwrap_or(u8::MAX)
}

/// An answer of one shard as the store's: its claims and records say which shard they are on.
pub fn on_shard(answer: StoreAnswer, shard: u8) -> StoreAnswer {
    match answer {
        StoreAnswer::Begun(Ok(Begin::Claimed(claim))) => {
            StoreAnswer::Begun(Ok(Begin::Claimed(Claim { shard, ..claim })))
        }
        StoreAnswer::Begun(Ok(Begin::TookOver(claim))) => {
            StoreAnswer::Begun(Ok(Begin::TookOver(Claim { shard, ..claim })))
        }
        StoreAnswer::Records(Ok(mut page)) => {
            for view in &mut page.views {
                view.shard = shard;
            }
            StoreAnswer::Records(Ok(page))
        }
        other => other,
    }
}

/// One shard's conversation: its calls go to that shard's cluster.
struct OnShard {
    shard: u8,
    conversation: Box<dyn Conversation>,
}

impl Conversation for OnShard {
    fn step(&mut self, answer: Option<Answer>, now_ms: u64) -> Next {
        match self.conversation.step(answer, now_ms) {
            Next::Call(request) => Next::Call(Request { shard: self.shard, ..request }),
            Next::Done(answer) => Next::Done(on_shard(answer, self.shard)),
            Next::Wait => Next::Wait,
        }
    }
    fn into_op(self: Box<Self>) -> StoreOp {
        self.conversation.into_op()
    }
    fn unanswered_claim(&self) -> Option<Claim> {
        self.conversation.unanswered_claim().map(|claim| Claim { shard: self.shard, ..claim })
    }
}

/// A moving record's operation: each step `Moving` plans, as a conversation on its shard.
struct MovingOp {
    shards: Rc<Vec<EtcdRemote>>,
    plan: Moving,
    next: Option<Leg>,
    current: Option<OnShard>,
}

impl Conversation for MovingOp {
    fn step(&mut self, mut answer: Option<Answer>, now_ms: u64) -> Next {
        loop {
            if let Some(current) = self.current.as_mut() {
                match current.step(answer.take(), now_ms) {
                    Next::Done(done) => {
                        let unanswered = current.unanswered_claim();
                        self.current = None;
                        self.next = Some(self.plan.answered(done, unanswered));
                    }
                    waiting => return waiting,
                }
            }
            match self.next.take() {
                Some(Leg::Run(shard, op)) => match self.shards.get(usize::from(shard)) {
                    None => {
                        self.next = Some(self.plan.answered(
                            StoreAnswer::failed(&op, StoreError::Unavailable("no such shard".into())),
                            None,
                        ))
                    }
                    Some(store) => match store.start(op, &|| now_ms) {
                        Started::Answered(done) => {
                            self.next = Some(self.plan.answered(on_shard(done, shard), None))
                        }
                        Started::Conversation(conversation) => {
                            self.current = Some(OnShard { shard, conversation })
                        }
                    },
                },
                Some(Leg::Done(done)) => return Next::Done(done),
                None => {
                    let op = self.plan.clone().into_op();
                    return Next::Done(StoreAnswer::failed(
                        &op,
                        StoreError::Unavailable("stepped past its end".into()),
                    ));
                }
            }
        }
    }
    fn into_op(self: Box<Self>) -> StoreOp {
        self.plan.into_op()
    }
    fn unanswered_claim(&self) -> Option<Claim> {
        self.plan.unanswered(self.current.as_ref().and_then(OnShard::unanswered_claim))
    }
}

/// An operator's change of a record whose home moves: made where the look found it, then on its
/// other home, looked up there first (its revision there is another). The first change's answer
/// is the operator's; the other home's is best effort (a record an Envoy on one list made is on
/// one home only).
struct AmendBoth {
    shards: Rc<Vec<EtcdRemote>>,
    /// The change as asked.
    op: StoreOp,
    /// The other home and the change to make there.
    other: u8,
    change: Amendment,
    stage: AmendStage,
    /// The first change's answer, once it came.
    first: Option<StoreAnswer>,
    current: Option<OnShard>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum AmendStage {
    First,
    Look,
    Other,
}

impl AmendBoth {
    /// `op` on `shard`: its conversation, or its answer at once.
    fn run(&self, shard: u8, op: StoreOp) -> Result<OnShard, Box<StoreAnswer>> {
        let Some(store) = self.shards.get(usize::from(shard)) else {
            return Err(Box::new(StoreAnswer::failed(&op, StoreError::Unavailable("no such shard".into()))));
        };
        match store.start(op, &|| 0) {
            Started::Conversation(conversation) => Ok(OnShard { shard, conversation }),
            Started::Answered(answer) => Err(Box::new(on_shard(answer, shard))),
        }
    }

    /// After an answer of the stage's operation: the next operation, if any.
    fn next(&mut self, done: StoreAnswer, now_ms: u64) -> Option<(u8, StoreOp)> {
        match self.stage {
            AmendStage::First => {
                self.first = Some(done);
                self.stage = AmendStage::Look;
                let StoreOp::Amend { view, .. } = &self.op else { return None };
                Some((self.other, StoreOp::Records(RecordQuery::of_scope(view.scope, now_ms))))
            }
            AmendStage::Look => {
                self.stage = AmendStage::Other;
                let StoreAnswer::Records(Ok(page)) = done else { return None };
                let view = page.views.into_iter().next()?;
                let at = match &self.op {
                    StoreOp::Amend { now_ms, .. } => *now_ms,
                    _ => now_ms,
                };
                let amend = StoreOp::Amend { view: Box::new(view), change: self.change.clone(), now_ms: at };
                Some((self.other, amend))
            }
            AmendStage::Other => None,
        }
    }
}

impl Conversation for AmendBoth {
    fn step(&mut self, mut answer: Option<Answer>, now_ms: u64) -> Next {
        loop {
            let done = match self.current.as_mut() {
                Some(current) => match current.step(answer.take(), now_ms) {
                    Next::Done(done) => done,
                    waiting => return waiting,
                },
                None => match self.run_first() {
                    Ok(current) => {
                        self.current = Some(current);
                        continue;
                    }
                    Err(done) => *done,
                },
            };
            self.current = None;
            let mut next = self.next(done, now_ms);
            while let Some((shard, op)) = next.take() {
                match self.run(shard, op) {
                    Ok(current) => self.current = Some(current),
                    Err(done) => next = self.next(*done, now_ms),
                }
            }
            if self.current.is_none() {
                let op = &self.op;
                let first = self.first.take();
                return Next::Done(first.unwrap_or_else(|| {
                    StoreAnswer::failed(op, StoreError::Unavailable("no answer".into()))
                }));
            }
        }
    }
    fn into_op(self: Box<Self>) -> StoreOp {
        self.op
    }
}

impl AmendBoth {
    /// The first change, on the shard where the look found the record.
    fn run_first(&self) -> Result<OnShard, Box<StoreAnswer>> {
        let shard = match &self.op {
            StoreOp::Amend { view, .. } => view.shard,
            _ => 0,
        };
        self.run(shard, self.op.clone())
    }
}

/// Which views of a shard a list shows: those of records whose home (by the current list) it is.
type Keep = Box<dyn Fn(&ScopeId, u8) -> bool>;

/// The admin API's look at records over the shards of `order`, one after the other (a record
/// found on two, as a moving record may be, is shown as the first has it): a page holds what the
/// shards gave until the limit, and its cursor (`<n>s<that shard's cursor>`, the n-th shard of
/// `order`) says where the next one starts.
fn look_through(
    shards: Rc<Vec<EtcdRemote>>,
    order: Vec<u8>,
    op: StoreOp,
    keep: Option<Keep>,
) -> Result<Box<dyn Conversation>, StoreError> {
    let StoreOp::Records(query) = op else { return Err(StoreError::Unavailable("not a look".into())) };
    let (at, cursor) = match query.cursor.as_deref().map(|c| (c, c.split_once('s'))) {
        None => (0, None),
        Some((_, Some((n, rest)))) if n.parse::<usize>().is_ok_and(|n| n < order.len()) => {
            (n.parse::<usize>().unwrap_or(0), (!rest.is_empty()).then(|| rest.to_string()))
        }
        Some((c, _)) => return Err(StoreError::Corrupt(format!("cursor {c:?}"))),
    };
    Ok(Box::new(LookThrough {
        shards,
        order,
        keep,
        query,
        at,
        cursor,
        current: None,
        found: RecordPage::default(),
    }))
}

struct LookThrough {
    shards: Rc<Vec<EtcdRemote>>,
    order: Vec<u8>,
    /// Which views of a shard to show (None: all).
    keep: Option<Keep>,
    query: RecordQuery,
    /// The position in `order` of the shard being read, from the cursor's on.
    at: usize,
    /// Where in it to start (the first shard read only).
    cursor: Option<String>,
    current: Option<OnShard>,
    found: RecordPage,
}

impl LookThrough {
    /// What this shard's look answered; None: go on to the next shard.
    fn page_read(&mut self, page: RecordPage) -> Option<Next> {
        for view in page.views {
            let kept = self.keep.as_ref().is_none_or(|keep| keep(&view.scope, view.shard));
            if kept && !self.found.views.iter().any(|v| v.scope == view.scope) {
                self.found.views.push(view);
            }
        }
        if let Some(next) = page.next {
            self.found.next = Some(format!("{}s{next}", self.at));
            return Some(self.done());
        }
        self.at += 1;
        if self.at >= self.order.len() {
            return Some(self.done());
        }
        if self.found.views.len() >= self.query.limit {
            self.found.next = Some(format!("{}s", self.at));
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
                    let Some((shard, store)) =
                        self.order.get(self.at).and_then(|s| Some((*s, self.shards.get(usize::from(*s))?)))
                    else {
                        return self.done();
                    };
                    let query = RecordQuery {
                        limit: self.query.limit.saturating_sub(self.found.views.len()).max(1),
                        cursor: self.cursor.take(),
                        ..self.query.clone()
                    };
                    match store.start(StoreOp::Records(query), &|| now_ms) {
                        Started::Answered(answer) => Next::Done(on_shard(answer, shard)),
                        Started::Conversation(conversation) => {
                            self.current = Some(OnShard { shard, conversation });
                            continue;
                        }
                    }
                }
            };
            match next {
                Next::Done(StoreAnswer::Records(Ok(page))) => {
                    self.current = None;
                    if let Some(next) = self.page_read(page) {
                        return next;
                    }
                }
                other => return other,
            }
        }
    }
    fn into_op(self: Box<Self>) -> StoreOp {
        StoreOp::Records(self.query)
    }
}

#[cfg(test)]
mod tests;
