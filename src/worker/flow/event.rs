//! Everything that happens to a request, as one input (raft-rs's `Message`): its stream's
//! callbacks, and what the worker's root brings back (a store's answer, a lookup's, a detached
//! call's, a due lease-end lookup). `RequestFlow::handle` is the flow's one entry; the worker's
//! executor (`worker/carry.rs`) feeds it and carries out the `Output` it returns, and an answer
//! that comes while the executor is carrying out steps is fed to the flow only once they are
//! all carried out, never in the middle of them.

use super::{Output, RequestFlow, StreamFacts};
use crate::config::etcd::OnStoreError;
use crate::config::Config;
use crate::store::{StoreAnswer, StoreError};
use crate::worker::detached::CallAnswer;
use crate::worker::reconcile::LookupAnswer;
use crate::worker::wait::NotHeld;

/// One of Envoy's callbacks on the stream, with what Envoy said of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Callback {
    RequestHeaders {
        end_of_stream: bool,
    },
    /// `size`: all that Envoy has buffered so far.
    RequestBody {
        size: usize,
        end_of_stream: bool,
    },
    RequestTrailers,
    ResponseHeaders {
        end_of_stream: bool,
    },
    ResponseBody {
        size: usize,
        end_of_stream: bool,
    },
    ResponseTrailers,
    /// Envoy's last word on the stream (`on_log`).
    Log,
}

impl Callback {
    /// A response callback: a settlement handed to the root holds its response until written.
    pub fn is_response(self) -> bool {
        matches!(
            self,
            Callback::ResponseHeaders { .. } | Callback::ResponseBody { .. } | Callback::ResponseTrailers
        )
    }
}

/// One input to a request's flow.
pub enum Event<'f> {
    /// A callback of its stream's, and the stream's facts to read.
    Stream { callback: Callback, facts: &'f mut dyn StreamFacts },
    /// The store answered a `Step::Store`.
    StoreAnswered(StoreAnswer),
    /// The store could not be used for a `begin`; `mode` says what that means for the request.
    StoreFailed { error: StoreError, mode: OnStoreError },
    /// `Step::Park` or `Step::Repark`: whether the request is held in the wait room.
    Parked(Result<(), NotHeld>),
    /// `Step::Detach`: no detached call could be made, for this reason.
    DetachRefused(String),
    /// The detached call answered. `held_ms`: how long past its lease the store keeps a claim
    /// its owner's (`Store::held_past_lease_ms`).
    DetachedAnswered { answer: CallAnswer, now_ms: u64, held_ms: u64 },
    /// `Step::Lookup`: no lookup can be made now; the next retry may ask after `retry_after_ms`.
    LookupRefused { retry_after_ms: u64 },
    /// The upstream's lookup answered.
    LookupAnswered { answer: LookupAnswer, now_ms: u64 },
    /// A lease-end lookup's time came (`RequestFlow::lease_end`).
    LeaseEndDue { now_ms: u64 },
}

impl RequestFlow {
    /// The flow's one entry: what `event` means for the request, as steps and a verdict.
    /// Always inlined: where the event's kind is known (each of the root's answers) the match
    /// folds to one call, and no one function holds every transition (`make bench-fuel` charges
    /// a block's instructions on entry, and a match over all of them cost each callback about
    /// 6,000 there).
    #[inline(always)]
    pub fn handle(&mut self, cfg: &Config, event: Event) -> Output {
        match event {
            Event::Stream { callback, facts } => match callback {
                Callback::RequestHeaders { end_of_stream } => self.request_headers(cfg, facts, end_of_stream),
                Callback::RequestBody { size, end_of_stream } => {
                    self.request_body(cfg, facts, size, end_of_stream)
                }
                Callback::RequestTrailers => self.request_trailers(cfg, facts),
                Callback::ResponseHeaders { end_of_stream } => {
                    self.response_headers(cfg, facts, end_of_stream)
                }
                Callback::ResponseBody { size, end_of_stream } => {
                    self.response_body(facts, size, end_of_stream)
                }
                Callback::ResponseTrailers => self.response_trailers(facts),
                Callback::Log => self.stream_ended(facts),
            },
            Event::StoreAnswered(answer) => self.store_answered(cfg, answer),
            Event::StoreFailed { error, mode } => self.store_failed(cfg, error, mode),
            Event::Parked(held) => self.parked(cfg, held),
            Event::DetachRefused(why) => self.detach_refused(&why),
            Event::DetachedAnswered { answer, now_ms, held_ms } => {
                self.detached_answered(answer, now_ms, held_ms)
            }
            Event::LookupRefused { retry_after_ms } => self.lookup_refused(retry_after_ms),
            Event::LookupAnswered { answer, now_ms } => self.lookup_answered(answer, now_ms),
            Event::LeaseEndDue { now_ms } => self.lease_end_due(now_ms),
        }
    }
}
