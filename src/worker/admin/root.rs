//! The admin API's root part: an admin instance's stream is one request the module answers itself
//! (`crate::worker::admin` decides the answer). Its head is read at the headers, its body collected,
//! the store operations it asks for carried out (at once where the store answers at once, else
//! by the root, as every callout), and the answer sent as a local reply; each request is counted
//! and logged.

use crate::host::{Host, HostError, BUFFER_REQUEST_BODY, MAP_REQUEST_HEADERS};
use crate::store::remote::{Answer, Conversation};
use crate::store::seam::Started;
use crate::store::{StoreAnswer, StoreError};
use crate::worker::admin::{self, AdminRequest, Answered, Progress, MAX_BODY};
use crate::worker::calls::{AdminAsk, AdminLater, AdminLine, RootAdmin};
use crate::worker::flow::Verdict;
use crate::worker::plugin::PluginState;
use crate::worker::settle::{step, Stepped};
use std::rc::Rc;

/// `response.code_details` of the admin API's replies.
pub const DETAILS_ADMIN: &str = "idempotency_admin";

/// An admin instance's stream: one request, answered by the module.
pub struct AdminStream<H: Host> {
    context_id: u32,
    plugin: Rc<PluginState<H>>,
    /// Its head, read at the headers.
    head: Option<AdminHead>,
}

impl<H: Host> AdminStream<H> {
    pub fn new(context_id: u32, plugin: Rc<PluginState<H>>) -> AdminStream<H> {
        AdminStream { context_id, plugin, head: None }
    }

    pub fn on_request_headers(&mut self, end_of_stream: bool) -> Verdict {
        self.head = head(&self.plugin);
        on_headers(&self.plugin, self.context_id, self.head.as_ref(), end_of_stream)
    }

    pub fn on_request_body(&mut self, size: usize, end_of_stream: bool) -> Verdict {
        on_body(&self.plugin, self.context_id, self.head.as_ref(), size, end_of_stream)
    }
}

/// What an admin request said in its headers, kept until its body has arrived.
pub struct AdminHead {
    method: String,
    path: String,
    authorization: Option<Vec<u8>>,
}

/// The request's head; None when the host cannot give it (answered 500 by the caller).
fn head<H: Host>(plugin: &PluginState<H>) -> Option<AdminHead> {
    let map = plugin.host.header_map(MAP_REQUEST_HEADERS).ok()?;
    let text = |name: &str| map.get(name).map(|v| String::from_utf8_lossy(v).into_owned());
    Some(AdminHead {
        method: text(":method")?,
        path: text(":path")?,
        authorization: map.get("authorization").map(<[u8]>::to_vec),
    })
}

/// At the request's headers: answered now when it has no body, else held for it.
fn on_headers<H: Host>(
    plugin: &PluginState<H>,
    context_id: u32,
    head: Option<&AdminHead>,
    end_of_stream: bool,
) -> Verdict {
    match head {
        None => {
            send(plugin, 500, b"{\"detail\":\"cannot read the request headers\"}");
            Verdict::Pause
        }
        Some(head) if end_of_stream => {
            serve(plugin, context_id, head, &[]);
            Verdict::Pause
        }
        Some(_) => Verdict::Pause,
    }
}

/// At each piece of the body: answered with the last one (Envoy buffers the rest).
fn on_body<H: Host>(
    plugin: &PluginState<H>,
    context_id: u32,
    head: Option<&AdminHead>,
    size: usize,
    end_of_stream: bool,
) -> Verdict {
    let Some(head) = head else { return Verdict::Pause };
    if size > MAX_BODY {
        send(plugin, 413, b"{\"detail\":\"the admin request body is over 4 MiB\"}");
        return Verdict::Pause;
    }
    if !end_of_stream {
        return Verdict::Pause;
    }
    match plugin.host.buffer(BUFFER_REQUEST_BODY, 0, size) {
        Ok(body) => serve(plugin, context_id, head, &body),
        Err(HostError(s)) => {
            log::warn!("admin: cannot read the request body (host status {s})");
            send(plugin, 500, b"{\"detail\":\"cannot read the request body\"}");
        }
    }
    Verdict::Pause
}

fn serve<H: Host>(plugin: &PluginState<H>, context_id: u32, head: &AdminHead, body: &[u8]) {
    let Some(cfg) = &plugin.config.admin else {
        send(plugin, 500, b"{\"detail\":\"not an admin instance\"}");
        return;
    };
    let req = AdminRequest {
        method: &head.method,
        path: &head.path,
        authorization: head.authorization.as_deref(),
        body,
        now_ms: plugin.host.now_ms(),
    };
    let line = AdminLine {
        method: head.method.clone(),
        path: head.path.split('?').next().unwrap_or("").to_string(),
    };
    match advance(plugin, line, admin::start(cfg, &req)) {
        None => {}
        Some(Handoff::Conversation(asked, conversation)) => {
            plugin.admin_from_root(context_id, conversation, asked)
        }
        Some(Handoff::Later(asked)) => plugin.admin_later(context_id, asked),
    }
}

/// Where an admin request goes on, when not answered at once: with the root.
pub enum Handoff {
    /// The store answers through callouts (etcd): the root carries the conversation.
    Conversation(AdminAsk, Box<dyn Conversation>),
    /// The store paused a long scan: the root asks again at its next tick.
    Later(AdminAsk),
}

/// Takes an admin request on until it is answered (the effective context is its stream's), or
/// until the store does not answer at once, or paused a scan: that ask is handed back, for the
/// root.
pub fn advance<H: Host>(plugin: &PluginState<H>, line: AdminLine, mut progress: Progress) -> Option<Handoff> {
    loop {
        match progress {
            Progress::Done(answered) => {
                reply(plugin, &line, &answered);
                return None;
            }
            // Kept: a conversation that fails is answered as this op's failure.
            Progress::Ask(task, op) => match plugin.start(op.clone()) {
                Started::Answered(answer) => progress = task.answered(answer, plugin.host.now_ms()),
                Started::Conversation(conversation) => {
                    return Some(Handoff::Conversation(AdminAsk { task, op, line }, conversation))
                }
            },
            Progress::Later(task, op) => return Some(Handoff::Later(AdminAsk { task, op, line })),
        }
    }
}

fn reply<H: Host>(plugin: &PluginState<H>, line: &AdminLine, answered: &Answered) {
    plugin.meter.count_admin(answered.action);
    log::info!("{}", audit_line(line, answered));
    // The stream is the effective context here: its peer, and its access log's entry.
    let peer = plugin.host.property(&["source", "address"]).ok().flatten();
    let peer = peer.as_deref().map(String::from_utf8_lossy);
    plugin.meter.audit(&answered.audit_entry(&line.method, &line.path, peer.as_deref()));
    if let Some(scope) = &answered.changed {
        // The requests waiting for this record look now, not at their next recheck.
        plugin.wakeups.broadcast(scope);
    }
    let r = &answered.reply;
    if let Err(HostError(s)) = plugin.host.send_response(r.status, DETAILS_ADMIN, &r.headers, &r.body) {
        log::warn!("admin: could not send the reply (host status {s})");
    }
}

/// The audit line of an admin request, at info level: the action, the record's tag, whose it
/// is (route, tenant: quoted, as the label keeps them), which token (`Answered::who`: a digest
/// prefix, never the token's), and the request. `-` where there is none (a list, no tenant
/// header, no token).
pub fn audit_line(line: &AdminLine, answered: &Answered) -> String {
    let record = answered.record.as_ref();
    let quoted = |s: Option<&String>| s.map_or_else(|| "-".to_string(), |s| format!("{s:?}"));
    let token = if answered.who == "-" { "-".to_string() } else { format!("sha256:{}", answered.who) };
    format!(
        "admin {} tag={} route={} tenant={} token={} ({} {} -> {})",
        answered.action.name(),
        record.map_or("-", |r| r.tag.as_str()),
        quoted(record.and_then(|r| r.route.as_ref())),
        quoted(record.and_then(|r| r.tenant.as_ref())),
        token,
        line.method,
        line.path,
        answered.reply.status
    )
}

fn send<H: Host>(plugin: &PluginState<H>, status: u16, body: &[u8]) {
    let headers = vec![("content-type".to_string(), b"application/json".to_vec())];
    if let Err(HostError(s)) = plugin.host.send_response(status, DETAILS_ADMIN, &headers, body) {
        log::warn!("admin: could not send the reply (host status {s})");
    }
}

/// Takes an admin request's store operation one step: its next callout, or the store's answer
/// for the request's task, which replies (if its stream is still there) or asks again.
pub(in crate::worker) fn converse_admin<H: Host>(
    plugin: &PluginState<H>,
    call: Box<RootAdmin>,
    answer: Option<Answer>,
) {
    match step(plugin, call, answer) {
        Stepped::Kept => {}
        Stepped::Failed(call, error) => admin_failed(plugin, call, error),
        Stepped::Done(call, answer) => admin_answered(plugin, *call, answer),
    }
}

pub(in crate::worker) fn admin_failed<H: Host>(
    plugin: &PluginState<H>,
    call: Box<RootAdmin>,
    error: StoreError,
) {
    let answer = StoreAnswer::failed(&call.ask.op, error);
    admin_answered(plugin, *call, answer);
}

fn admin_answered<H: Host>(plugin: &PluginState<H>, call: RootAdmin, answer: StoreAnswer) {
    if plugin.host.set_effective_context(call.context_id).is_err() {
        // The operator's client left: a change already made stands, and is logged by nobody.
        log::info!("admin #{}: the client left before the store answered", call.context_id);
        return;
    }
    let RootAdmin { context_id, ask, .. } = call;
    let progress = ask.task.answered(answer, plugin.host.now_ms());
    admin_handed_off(plugin, context_id, advance(plugin, ask.line, progress));
}

/// Where the root takes an admin request on that did not end in its callback.
fn admin_handed_off<H: Host>(plugin: &PluginState<H>, context_id: u32, handoff: Option<Handoff>) {
    match handoff {
        None => {}
        Some(Handoff::Conversation(ask, conversation)) => {
            converse_admin(plugin, Box::new(RootAdmin { context_id, conversation, ask }), None)
        }
        Some(Handoff::Later(ask)) => {
            plugin.calls.borrow_mut().admin_later.push(AdminLater { context_id, ask });
        }
    }
}

/// At the root's tick: the admin requests whose store paused a scan ask again, each one bounded
/// part more (`store::local::admin::SCAN_READS`), or are answered; one whose client left is
/// dropped (a look changes nothing).
pub(in crate::worker) fn continue_admin<H: Host>(plugin: &PluginState<H>) {
    let later = std::mem::take(&mut plugin.calls.borrow_mut().admin_later);
    for AdminLater { context_id, ask } in later {
        if plugin.host.set_effective_context(context_id).is_err() {
            log::info!("admin #{context_id}: the client left before its list was read");
            continue;
        }
        let AdminAsk { task, op, line } = ask;
        admin_handed_off(plugin, context_id, advance(plugin, line, Progress::Ask(task, op)));
    }
}
