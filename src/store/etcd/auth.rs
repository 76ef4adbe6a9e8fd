//! etcd authentication: the worker's token, fetched by one conversation at a time
//! (`/v3/auth/authenticate` is a bcrypt check and a Raft write on etcd) while the others that
//! need it wait (`Next::Wait`), and fetched again, once per conversation, when etcd
//! refuses it. Apart from the conversation's store steps because none of them depends on it: every
//! call goes out through `send`, which adds the token.

use super::wire::{self, EtcdRefusal};
use super::{etcd_call, unusable, EtcdConversation, EtcdStore};
use crate::store::remote::{Answer, Next};
use crate::store::StoreError;

/// The worker's token fetch: at most one at a time, whatever the number of conversations that need
/// a token (each authenticate is a bcrypt check and a Raft write on etcd).
#[derive(Debug, Clone, Default)]
pub(super) struct TokenFetch {
    /// Fetches started so far: the number of the current or last one.
    started: u64,
    /// Fetch `started` is in flight until this deadline (its callout's timeout): a conversation
    /// waiting for it gives up then, and the next one that needs a token fetches anew.
    in_flight_until_ms: Option<u64>,
    /// The last fetch that failed (or outlived its deadline), and why: conversations that waited for
    /// it fail with the same error.
    failed: Option<(u64, StoreError)>,
    /// A fetch ended since the driver last asked (`take_fetch_ended`).
    ended: bool,
}

impl TokenFetch {
    /// Fetch `started` is over without a token.
    fn fail(&mut self, error: StoreError) {
        self.failed = Some((self.started, error));
        self.in_flight_until_ms = None;
        self.ended = true;
    }
}

impl EtcdStore {
    /// True once after a token fetch ended (a token, or a failure): the driver steps the
    /// conversations that answered `Next::Wait` again.
    pub fn take_fetch_ended(&self) -> bool {
        std::mem::take(&mut self.fetch.borrow_mut().ended)
    }

    pub(super) fn token(&self) -> Option<String> {
        self.token.borrow().clone()
    }
}

impl EtcdConversation {
    /// The pending call with the worker's token; without one, after the worker's token fetch:
    /// this conversation makes it, or waits for the one in flight.
    pub(super) fn send(&mut self, store: &EtcdStore, now_ms: u64) -> Result<Next, StoreError> {
        if store.settings.auth.is_none() || store.token.borrow().is_some() {
            return self.resend(store);
        }
        let waiting = {
            let mut fetch = store.fetch.borrow_mut();
            match fetch.in_flight_until_ms {
                Some(deadline_ms) if now_ms < deadline_ms => Some(fetch.started),
                // One whose answer never came in time (its callout failed or timed out, and
                // its conversation ended without it): over, and a new fetch.
                Some(_) => {
                    fetch.fail(StoreError::TimedOut);
                    None
                }
                None => None,
            }
        };
        match waiting {
            Some(number) => {
                self.awaiting = Some(number);
                Ok(Next::Wait)
            }
            None => Ok(self.authenticate(store, now_ms)),
        }
    }

    /// Stepped again while waiting for fetch number `awaiting`: on with the token it brought,
    /// on waiting while it is in flight, or the fetch's failure (a fetch past its deadline
    /// timed out).
    pub(super) fn token_awaited(&mut self, store: &EtcdStore, now_ms: u64) -> Result<Next, StoreError> {
        let Some(number) = self.awaiting.take() else { return Err(unusable("not waiting for a token")) };
        if store.token.borrow().as_ref().is_some_and(|t| Some(t) != self.sent_token.as_ref()) {
            return self.resend(store);
        }
        let mut fetch = store.fetch.borrow_mut();
        if let Some((failed, error)) = &fetch.failed {
            if *failed >= number {
                return Err(error.clone());
            }
        }
        match fetch.in_flight_until_ms {
            // Its own, or a later one (its token was refused before this conversation took it).
            Some(deadline_ms) if now_ms < deadline_ms => {
                self.awaiting = Some(fetch.started);
                Ok(Next::Wait)
            }
            // Its answer never came in time (the callout failed or timed out and was not handed
            // to its conversation): over, for everyone waiting.
            Some(_) => {
                fetch.fail(StoreError::TimedOut);
                Err(StoreError::TimedOut)
            }
            None => Err(unusable("the token fetch ended without a token")),
        }
    }

    /// The operation's last call, with the current token.
    fn resend(&mut self, store: &EtcdStore) -> Result<Next, StoreError> {
        let call = self.pending.clone().ok_or_else(|| unusable("no call to send"))?;
        let token = store.token();
        self.sent_token.clone_from(&token);
        Ok(etcd_call(call, token, store.settings.timeout_ms))
    }

    /// Starts the worker's token fetch: the others that need a token wait for it.
    fn authenticate(&mut self, store: &EtcdStore, now_ms: u64) -> Next {
        let timeout_ms = store.settings.auth_timeout_ms;
        let number = {
            let mut fetch = store.fetch.borrow_mut();
            fetch.started = fetch.started.wrapping_add(1);
            fetch.in_flight_until_ms = Some(now_ms.saturating_add(timeout_ms));
            fetch.started
        };
        self.fetching = Some(number);
        // Only a store with credentials fetches a token.
        let (username, password) = match &store.settings.auth {
            Some(a) => (a.username.as_str(), a.password.as_str()),
            None => ("", ""),
        };
        etcd_call(wire::authenticate(store.protocol(), username, password), None, timeout_ms)
    }

    /// The answer to the fetch this conversation made: the worker's token (and this conversation's
    /// call sent with it), or the failure every conversation waiting for it gets too.
    pub(super) fn authenticated(
        &mut self,
        store: &EtcdStore,
        number: u64,
        answer: &Answer,
    ) -> Result<Next, StoreError> {
        self.fetching = None;
        let token = wire::body(store.protocol(), &store.settings.cluster, answer)
            .and_then(|body| body.token())
            .map_err(|refused| match refused {
                EtcdRefusal::Unusable(m) => StoreError::Unavailable(format!("authenticate: {m}")),
                other => other.into_error(),
            });
        {
            let mut fetch = store.fetch.borrow_mut();
            // A later fetch (this one outlived its deadline) is not this one's to end.
            if fetch.started == number {
                match &token {
                    Ok(_) => fetch.in_flight_until_ms = None,
                    Err(error) => fetch.fail(error.clone()),
                }
            }
            // Whoever waits for a token takes this one.
            fetch.ended = true;
        }
        *store.token.borrow_mut() = Some(token?);
        self.resend(store)
    }
}
