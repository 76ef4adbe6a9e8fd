//! Envoy's imports, one closure each, over the state in `host.rs`: how a value crosses into the
//! module's memory and back, and what each call does or refuses, with Envoy's status codes.

use crate::host::*;
use crate::wire::{self, Pairs};
use std::collections::VecDeque;
use wasmi::{Caller, Engine, Error, Linker};

const ERRNO_SUCCESS: i32 = 0;
const ERRNO_FAULT: i32 = 21;

/// A write's outcome as a proxy-wasm status.
fn status(written: bool) -> i32 {
    if written {
        OK
    } else {
        INVALID_MEMORY_ACCESS
    }
}

/// A write's outcome as a WASI errno.
fn errno(written: bool) -> i32 {
    if written {
        ERRNO_SUCCESS
    } else {
        ERRNO_FAULT
    }
}

type Ctx<'a> = Caller<'a, Host>;

/// Notes a host call; one made while the module initializes is a violation (Envoy refuses
/// them then: `_initialize` runs before any context exists).
fn enter(caller: &mut Ctx, call: &str) {
    if caller.data().initializing {
        caller.data_mut().violation(format!("{call} while the module initializes"));
    }
}

fn read(caller: &mut Ctx, ptr: i32, len: i32) -> Option<Vec<u8>> {
    let (start, len) = (ptr as u32 as usize, len as u32 as usize);
    if len == 0 {
        return Some(Vec::new());
    }
    let memory = caller.data().memory?;
    let bytes = memory.data(&*caller).get(start..start.checked_add(len)?).map(<[u8]>::to_vec);
    if bytes.is_none() {
        caller.data_mut().violation(format!("read of {len} bytes at {start}: out of the module's memory"));
    }
    bytes
}

fn read_string(caller: &mut Ctx, ptr: i32, len: i32) -> Option<String> {
    let bytes = read(caller, ptr, len)?;
    match String::from_utf8(bytes) {
        Ok(s) => Some(s),
        Err(_) => {
            caller.data_mut().violation("a name that is not UTF-8".to_string());
            None
        }
    }
}

fn write(caller: &mut Ctx, ptr: i32, bytes: &[u8]) -> bool {
    let start = ptr as u32 as usize;
    let Some(memory) = caller.data().memory else { return false };
    let ok = match memory.data_mut(&mut *caller).get_mut(start..start + bytes.len()) {
        Some(place) => {
            place.copy_from_slice(bytes);
            true
        }
        None => false,
    };
    if !ok {
        caller
            .data_mut()
            .violation(format!("write of {} bytes at {start}: out of the module's memory", bytes.len()));
    }
    ok
}

fn write_u32(caller: &mut Ctx, ptr: i32, value: u32) -> bool {
    write(caller, ptr, &value.to_le_bytes())
}

/// Hands `bytes` to the module as Envoy's `copyToPointerSize` does: allocated through the
/// module's allocator and written there, pointer and size stored at `ptr_ptr` and `size_ptr`;
/// nothing allocated for an empty value (pointer 0, size 0). A trap in the allocator is the
/// module's and ends the callback.
fn copy_out(caller: &mut Ctx, bytes: &[u8], ptr_ptr: i32, size_ptr: i32) -> Result<i32, Error> {
    let mut pointer = 0u32;
    if !bytes.is_empty() {
        let Some(malloc) = caller.data().malloc else {
            caller.data_mut().violation("the module exports no allocator".to_string());
            return Ok(INVALID_MEMORY_ACCESS);
        };
        pointer = malloc.call(&mut *caller, bytes.len() as i32)? as u32;
        if pointer == 0 || !write(caller, pointer as i32, bytes) {
            return Ok(INVALID_MEMORY_ACCESS);
        }
    }
    if write_u32(caller, ptr_ptr, pointer) && write_u32(caller, size_ptr, bytes.len() as u32) {
        Ok(OK)
    } else {
        Ok(INVALID_MEMORY_ACCESS)
    }
}

fn read_pairs(caller: &mut Ctx, ptr: i32, len: i32) -> Option<Pairs> {
    let bytes = read(caller, ptr, len)?;
    let pairs = wire::decode(&bytes);
    if pairs.is_none() {
        caller.data_mut().violation("a header map that is not in proxy-wasm's serialization".to_string());
    }
    pairs
}

/// The linker with every import Envoy 1.40 gives a module this one may ask for. An import
/// missing here fails instantiation, naming it: a module that asks Envoy for something this
/// host lacks is a failed test, never a silent stub.
pub fn linker(engine: &Engine) -> Result<Linker<Host>, Error> {
    let mut l = Linker::<Host>::new(engine);
    define_core(&mut l)?;
    define_maps(&mut l)?;
    define_stream(&mut l)?;
    define_shared(&mut l)?;
    define_metrics(&mut l)?;
    define_calls(&mut l)?;
    define_wasi(&mut l)?;
    l.func_wrap("env", "log_execution", |mut c: Ctx, site: i32| {
        let now = c.get_fuel().unwrap_or(0);
        if let Some((last, at)) = c.data_mut().last_site.take() {
            c.data_mut().fuel_by_site.entry(last).or_default().0 += at.saturating_sub(now);
            *c.data_mut().site_steps.entry((last, site)).or_default() += 1;
        }
        c.data_mut().fuel_by_site.entry(site).or_default().1 += 1;
        c.data_mut().last_site = Some((site, now));
    })?;
    Ok(l)
}

fn define_core(l: &mut Linker<Host>) -> Result<(), Error> {
    l.func_wrap("env", "proxy_log", |mut c: Ctx, level: i32, ptr: i32, len: i32| -> i32 {
        // Allowed while initializing too: Envoy's root VM context logs.
        let Some(message) = read(&mut c, ptr, len) else { return INVALID_MEMORY_ACCESS };
        c.data_mut().logs.push((level, String::from_utf8_lossy(&message).into_owned()));
        OK
    })?;
    l.func_wrap("env", "proxy_get_log_level", |mut c: Ctx, ptr: i32| -> i32 {
        enter(&mut c, "proxy_get_log_level");
        let level = c.data().log_level;
        status(write_u32(&mut c, ptr, level))
    })?;
    l.func_wrap("env", "proxy_get_current_time_nanoseconds", |mut c: Ctx, ptr: i32| -> i32 {
        enter(&mut c, "proxy_get_current_time_nanoseconds");
        let now = c.data().now_ns;
        status(write(&mut c, ptr, &now.to_le_bytes()))
    })?;
    l.func_wrap("env", "proxy_set_tick_period_milliseconds", |mut c: Ctx, period: i32| -> i32 {
        enter(&mut c, "proxy_set_tick_period_milliseconds");
        let host = c.data_mut();
        match host.root_of(host.effective).and_then(|r| host.roots.get_mut(&r)) {
            Some(root) => {
                root.tick_ms = period as u32;
                OK
            }
            None => BAD_ARGUMENT,
        }
    })?;
    l.func_wrap("env", "proxy_set_effective_context", |mut c: Ctx, id: i32| -> i32 {
        enter(&mut c, "proxy_set_effective_context");
        let host = c.data_mut();
        let id = id as u32;
        if host.roots.contains_key(&id) || host.streams.contains_key(&id) {
            host.effective = id;
            OK
        } else {
            BAD_ARGUMENT
        }
    })?;
    l.func_wrap("env", "proxy_done", |mut c: Ctx| -> i32 {
        enter(&mut c, "proxy_done");
        let host = c.data_mut();
        match host.roots.get_mut(&host.effective) {
            Some(root) => {
                root.done_called = true;
                OK
            }
            None => NOT_FOUND,
        }
    })?;
    l.func_wrap("env", "proxy_get_property", |mut c: Ctx, ptr: i32, len: i32, out: i32, out_len: i32| {
        enter(&mut c, "proxy_get_property");
        let Some(path) = read(&mut c, ptr, len) else { return Ok(INVALID_MEMORY_ACCESS) };
        let key = String::from_utf8_lossy(&path).into_owned();
        match c.data().property(&key).cloned() {
            Some(value) => copy_out(&mut c, &value, out, out_len),
            None => Ok(NOT_FOUND),
        }
    })?;
    l.func_wrap(
        "env",
        "proxy_set_property",
        |mut c: Ctx, ptr: i32, len: i32, value: i32, value_len: i32| -> i32 {
            enter(&mut c, "proxy_set_property");
            let (Some(path), Some(value)) = (read_string(&mut c, ptr, len), read(&mut c, value, value_len))
            else {
                return INVALID_MEMORY_ACCESS;
            };
            // Filter state lives on a stream; a root has none (Envoy: NotFound).
            let host = c.data_mut();
            match host.streams.get_mut(&host.effective) {
                Some(stream) => {
                    stream.filter_state.insert(path, value);
                    OK
                }
                None => NOT_FOUND,
            }
        },
    )?;
    Ok(())
}

fn define_maps(l: &mut Linker<Host>) -> Result<(), Error> {
    l.func_wrap("env", "proxy_get_header_map_pairs", |mut c: Ctx, map: i32, out: i32, out_len: i32| {
        enter(&mut c, "proxy_get_header_map_pairs");
        let Some(pairs) = c.data().readable_map(map).cloned() else { return Ok(BAD_ARGUMENT) };
        // Envoy hands over an empty map as no allocation at all.
        let bytes = if pairs.is_empty() { Vec::new() } else { wire::encode(&pairs) };
        copy_out(&mut c, &bytes, out, out_len)
    })?;
    l.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut c: Ctx, map: i32, key: i32, key_len: i32, out: i32, out_len: i32| {
            enter(&mut c, "proxy_get_header_map_value");
            let Some(name) = read_string(&mut c, key, key_len) else { return Ok(INVALID_MEMORY_ACCESS) };
            let Some(pairs) = c.data().readable_map(map) else { return Ok(BAD_ARGUMENT) };
            // Envoy answers the first value of a repeated header.
            let found = pairs.iter().find(|(n, _)| n.eq_ignore_ascii_case(&name)).map(|(_, v)| v.clone());
            match found {
                Some(value) => copy_out(&mut c, &value, out, out_len),
                None => Ok(NOT_FOUND),
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_replace_header_map_value",
        |mut c: Ctx, map: i32, key: i32, key_len: i32, value: i32, value_len: i32| -> i32 {
            enter(&mut c, "proxy_replace_header_map_value");
            let (Some(name), Some(value)) =
                (read_string(&mut c, key, key_len), read(&mut c, value, value_len))
            else {
                return INVALID_MEMORY_ACCESS;
            };
            let Some(pairs) = c.data_mut().writable_map(map) else { return BAD_ARGUMENT };
            let name = name.to_ascii_lowercase();
            match pairs.iter().position(|(n, _)| *n == name) {
                Some(first) => {
                    pairs[first].1 = value;
                    let mut i = 0;
                    pairs.retain(|(n, _)| {
                        i += 1;
                        i - 1 == first || *n != name
                    });
                }
                None => pairs.push((name, value)),
            }
            OK
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_add_header_map_value",
        |mut c: Ctx, map: i32, key: i32, key_len: i32, value: i32, value_len: i32| -> i32 {
            enter(&mut c, "proxy_add_header_map_value");
            let (Some(name), Some(value)) =
                (read_string(&mut c, key, key_len), read(&mut c, value, value_len))
            else {
                return INVALID_MEMORY_ACCESS;
            };
            let Some(pairs) = c.data_mut().writable_map(map) else { return BAD_ARGUMENT };
            pairs.push((name.to_ascii_lowercase(), value));
            OK
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut c: Ctx, map: i32, key: i32, key_len: i32| -> i32 {
            enter(&mut c, "proxy_remove_header_map_value");
            let Some(name) = read_string(&mut c, key, key_len) else { return INVALID_MEMORY_ACCESS };
            let Some(pairs) = c.data_mut().writable_map(map) else { return BAD_ARGUMENT };
            pairs.retain(|(n, _)| !n.eq_ignore_ascii_case(&name));
            OK
        },
    )?;
    l.func_wrap("env", "proxy_set_header_map_pairs", |mut c: Ctx, map: i32, ptr: i32, len: i32| -> i32 {
        enter(&mut c, "proxy_set_header_map_pairs");
        let Some(new) = read_pairs(&mut c, ptr, len) else { return BAD_ARGUMENT };
        let Some(pairs) = c.data_mut().writable_map(map) else { return BAD_ARGUMENT };
        *pairs = new.into_iter().map(|(n, v)| (n.to_ascii_lowercase(), v)).collect();
        OK
    })?;
    l.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: Ctx, kind: i32, start: i32, max: i32, out: i32, out_len: i32| {
            enter(&mut c, "proxy_get_buffer_bytes");
            let Some(buffer) = c.data().buffer(kind) else { return Ok(NOT_FOUND) };
            // Envoy's arithmetic is on 64-bit words: no overflow from 32-bit arguments; it
            // never reads past the end, and an empty read writes nothing at all.
            let (start, max) = (u64::from(start as u32), u64::from(max as u32));
            let size = buffer.len() as u64;
            let end = (start + max).min(size);
            if end <= start {
                return Ok(OK);
            }
            let bytes = buffer[start as usize..end as usize].to_vec();
            copy_out(&mut c, &bytes, out, out_len)
        },
    )?;
    Ok(())
}

fn define_stream(l: &mut Linker<Host>) -> Result<(), Error> {
    l.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut c: Ctx,
         status: i32,
         details: i32,
         details_len: i32,
         body: i32,
         body_len: i32,
         headers: i32,
         headers_len: i32,
         grpc_status: i32|
         -> i32 {
            enter(&mut c, "proxy_send_local_response");
            let details = read_string(&mut c, details, details_len);
            let body = read(&mut c, body, body_len);
            let headers = read_pairs(&mut c, headers, headers_len);
            let (Some(details), Some(body), Some(headers)) = (details, body, headers) else {
                return BAD_ARGUMENT;
            };
            let host = c.data_mut();
            let id = host.effective;
            let Some(stream) = host.effective_stream("proxy_send_local_response") else {
                return BAD_ARGUMENT;
            };
            stream.local_responses.push(LocalResponse {
                status: status as u32,
                details,
                body,
                headers,
                grpc_status,
            });
            // Envoy sends it once the VM call returns (addAfterVmCallAction).
            host.after.push_back(After::LocalReply(id));
            OK
        },
    )?;
    l.func_wrap("env", "proxy_continue_stream", |mut c: Ctx, kind: i32| -> i32 {
        enter(&mut c, "proxy_continue_stream");
        let host = c.data_mut();
        let id = host.effective;
        let after = match kind {
            0 => After::ContinueRequest(id),
            1 => After::ContinueResponse(id),
            _ => return BAD_ARGUMENT,
        };
        let Some(stream) = host.effective_stream("proxy_continue_stream") else { return OK };
        stream.continued.push(kind);
        host.after.push_back(after);
        OK
    })?;
    Ok(())
}

fn define_shared(l: &mut Linker<Host>) -> Result<(), Error> {
    l.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: Ctx, key: i32, key_len: i32, out: i32, out_len: i32, cas_out: i32| {
            enter(&mut c, "proxy_get_shared_data");
            let Some(key) = read_string(&mut c, key, key_len) else { return Ok(INVALID_MEMORY_ACCESS) };
            let Some((value, cas)) = c.data().shared.get(&key).cloned() else { return Ok(NOT_FOUND) };
            if !write_u32(&mut c, cas_out, cas) {
                return Ok(INVALID_MEMORY_ACCESS);
            }
            copy_out(&mut c, &value, out, out_len)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: Ctx, key: i32, key_len: i32, value: i32, value_len: i32, cas: i32| -> i32 {
            enter(&mut c, "proxy_set_shared_data");
            let (Some(key), Some(value)) =
                (read_string(&mut c, key, key_len), read(&mut c, value, value_len))
            else {
                return INVALID_MEMORY_ACCESS;
            };
            c.data_mut().set_shared(key, value, cas as u32)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_register_shared_queue",
        |mut c: Ctx, name: i32, name_len: i32, out: i32| -> i32 {
            enter(&mut c, "proxy_register_shared_queue");
            let Some(name) = read_string(&mut c, name, name_len) else { return INVALID_MEMORY_ACCESS };
            let host = c.data_mut();
            let Some(owner) = host.root_of(host.effective) else { return BAD_ARGUMENT };
            // The same name again keeps its token and changes its owner: only the last registrant
            // is told.
            let token = match host.queues.iter().position(|q| q.name == name) {
                Some(i) => {
                    host.queues[i].owner = owner;
                    i + 1
                }
                None => {
                    host.queues.push(Queue { name, owner, items: VecDeque::new() });
                    host.queues.len()
                }
            };
            status(write_u32(&mut c, out, token as u32))
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_resolve_shared_queue",
        |mut c: Ctx, vm_id: i32, vm_id_len: i32, name: i32, name_len: i32, out: i32| -> i32 {
            enter(&mut c, "proxy_resolve_shared_queue");
            let (Some(vm_id), Some(name)) =
                (read_string(&mut c, vm_id, vm_id_len), read_string(&mut c, name, name_len))
            else {
                return INVALID_MEMORY_ACCESS;
            };
            let host = c.data();
            // An empty vm_id is the caller's own.
            if !vm_id.is_empty() && vm_id != host.vm_id {
                return NOT_FOUND;
            }
            let Some(i) = host.queues.iter().position(|q| q.name == name) else { return NOT_FOUND };
            status(write_u32(&mut c, out, i as u32 + 1))
        },
    )?;
    l.func_wrap("env", "proxy_enqueue_shared_queue", |mut c: Ctx, token: i32, ptr: i32, len: i32| -> i32 {
        enter(&mut c, "proxy_enqueue_shared_queue");
        let Some(value) = read(&mut c, ptr, len) else { return INVALID_MEMORY_ACCESS };
        let host = c.data_mut();
        let Some(queue) = (token as u32).checked_sub(1).and_then(|i| host.queues.get_mut(i as usize)) else {
            return NOT_FOUND;
        };
        queue.items.push_back(value);
        let owner = queue.owner;
        host.queue_ready.push_back((owner, token as u32));
        OK
    })?;
    l.func_wrap("env", "proxy_dequeue_shared_queue", |mut c: Ctx, token: i32, out: i32, out_len: i32| {
        enter(&mut c, "proxy_dequeue_shared_queue");
        let host = c.data_mut();
        let Some(queue) = (token as u32).checked_sub(1).and_then(|i| host.queues.get_mut(i as usize)) else {
            return Ok(NOT_FOUND);
        };
        match queue.items.pop_front() {
            Some(value) => copy_out(&mut c, &value, out, out_len),
            None => Ok(EMPTY),
        }
    })?;
    Ok(())
}

fn define_metrics(l: &mut Linker<Host>) -> Result<(), Error> {
    l.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: Ctx, kind: i32, name: i32, name_len: i32, out: i32| -> i32 {
            enter(&mut c, "proxy_define_metric");
            let kind = match kind {
                METRIC_COUNTER => MetricKind::Counter,
                METRIC_GAUGE => MetricKind::Gauge,
                METRIC_HISTOGRAM => MetricKind::Histogram,
                _ => return BAD_ARGUMENT,
            };
            let Some(name) = read_string(&mut c, name, name_len) else { return INVALID_MEMORY_ACCESS };
            let host = c.data_mut();
            // A new id on every definition, as Envoy hands out; one stat per name.
            host.metrics.push(Metric { kind, name, value: 0 });
            let id = host.metrics.len() as u32;
            status(write_u32(&mut c, out, id))
        },
    )?;
    l.func_wrap("env", "proxy_increment_metric", |mut c: Ctx, id: i32, offset: i64| -> i32 {
        enter(&mut c, "proxy_increment_metric");
        let host = c.data_mut();
        let Some(metric) = (id as u32).checked_sub(1).and_then(|i| host.metrics.get_mut(i as usize)) else {
            return NOT_FOUND;
        };
        match metric.kind {
            // A counter only grows: Envoy refuses 0 and negative offsets.
            MetricKind::Counter if offset <= 0 => BAD_ARGUMENT,
            MetricKind::Counter | MetricKind::Gauge => {
                metric.value = metric.value.saturating_add(offset);
                OK
            }
            MetricKind::Histogram => BAD_ARGUMENT,
        }
    })?;
    l.func_wrap("env", "proxy_record_metric", |mut c: Ctx, id: i32, value: i64| -> i32 {
        enter(&mut c, "proxy_record_metric");
        let host = c.data_mut();
        let Some(metric) = (id as u32).checked_sub(1).and_then(|i| host.metrics.get_mut(i as usize)) else {
            return NOT_FOUND;
        };
        match metric.kind {
            MetricKind::Counter => metric.value = metric.value.saturating_add(value),
            MetricKind::Gauge | MetricKind::Histogram => metric.value = value,
        }
        OK
    })?;
    Ok(())
}

fn define_calls(l: &mut Linker<Host>) -> Result<(), Error> {
    l.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: Ctx,
         upstream: i32,
         upstream_len: i32,
         headers: i32,
         headers_len: i32,
         body: i32,
         body_len: i32,
         trailers: i32,
         trailers_len: i32,
         timeout_ms: i32,
         out: i32|
         -> i32 {
            enter(&mut c, "proxy_http_call");
            let cluster = read_string(&mut c, upstream, upstream_len);
            let headers = read_pairs(&mut c, headers, headers_len);
            let body = read(&mut c, body, body_len);
            let trailers = read_pairs(&mut c, trailers, trailers_len);
            let (Some(cluster), Some(headers), Some(body), Some(_)) = (cluster, headers, body, trailers)
            else {
                return BAD_ARGUMENT;
            };
            let host = c.data_mut();
            // Envoy refuses an unknown cluster and a call without its pseudo-headers.
            let has = |name: &str| headers.iter().any(|(n, _)| n == name);
            if !(host.clusters.contains(&cluster) && has(":method") && has(":path") && has(":authority")) {
                return BAD_ARGUMENT;
            }
            let Some(root) = host.root_of(host.effective) else { return BAD_ARGUMENT };
            host.next_token += 1;
            let token = host.next_token;
            host.http_calls.push(HttpCall {
                token,
                root,
                cluster,
                headers,
                body,
                timeout_ms: timeout_ms as u32,
            });
            status(write_u32(&mut c, out, token))
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_grpc_stream",
        |mut c: Ctx,
         service: i32,
         service_len: i32,
         name: i32,
         name_len: i32,
         method: i32,
         method_len: i32,
         metadata: i32,
         metadata_len: i32,
         out: i32|
         -> i32 {
            enter(&mut c, "proxy_grpc_stream");
            let _ = read(&mut c, service, service_len);
            let name = read_string(&mut c, name, name_len);
            let method = read_string(&mut c, method, method_len);
            let metadata = read_pairs(&mut c, metadata, metadata_len);
            let (Some(name), Some(method), Some(_)) = (name, method, metadata) else { return BAD_ARGUMENT };
            let host = c.data_mut();
            host.next_token += 1;
            let token = host.next_token;
            host.grpc_streams.push((token, name, method));
            status(write_u32(&mut c, out, token))
        },
    )?;
    l.func_wrap("env", "proxy_grpc_send", |mut c: Ctx, token: i32, ptr: i32, len: i32, _end: i32| -> i32 {
        enter(&mut c, "proxy_grpc_send");
        if read(&mut c, ptr, len).is_none() {
            return INVALID_MEMORY_ACCESS;
        }
        if c.data().grpc_streams.iter().any(|(t, _, _)| *t == token as u32) {
            OK
        } else {
            BAD_ARGUMENT
        }
    })?;
    l.func_wrap("env", "proxy_grpc_cancel", |mut c: Ctx, token: i32| -> i32 {
        enter(&mut c, "proxy_grpc_cancel");
        if c.data().grpc_streams.iter().any(|(t, _, _)| *t == token as u32) {
            OK
        } else {
            NOT_FOUND
        }
    })?;
    Ok(())
}

/// WASI as Envoy's runtime provides it to a proxy-wasm module: no environment, stdout and
/// stderr into Envoy's log, randomness, a clock; `proc_exit` ends the VM (a trap here).
fn define_wasi(l: &mut Linker<Host>) -> Result<(), Error> {
    const WASI: &str = "wasi_snapshot_preview1";
    l.func_wrap(WASI, "random_get", |mut c: Ctx, ptr: i32, len: i32| -> i32 {
        let mut bytes = vec![0u8; len as u32 as usize];
        c.data_mut().random(&mut bytes);
        errno(write(&mut c, ptr, &bytes))
    })?;
    l.func_wrap(WASI, "environ_sizes_get", |mut c: Ctx, count: i32, size: i32| -> i32 {
        errno(write_u32(&mut c, count, 0) && write_u32(&mut c, size, 0))
    })?;
    l.func_wrap(WASI, "environ_get", |_: Ctx, _environ: i32, _buf: i32| -> i32 { ERRNO_SUCCESS })?;
    l.func_wrap(WASI, "fd_write", |mut c: Ctx, _fd: i32, iovs: i32, iovs_len: i32, written: i32| -> i32 {
        let mut total = 0u32;
        for i in 0..iovs_len {
            let Some(iov) = read(&mut c, iovs.wrapping_add(8 * i), 8) else { return ERRNO_FAULT };
            let ptr = i32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
            let len = i32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
            let Some(bytes) = read(&mut c, ptr, len) else { return ERRNO_FAULT };
            total += bytes.len() as u32;
            c.data_mut().stdio.extend_from_slice(&bytes);
        }
        errno(write_u32(&mut c, written, total))
    })?;
    l.func_wrap(WASI, "clock_time_get", |mut c: Ctx, _clock: i32, _precision: i64, ptr: i32| -> i32 {
        let now = c.data().now_ns;
        errno(write(&mut c, ptr, &now.to_le_bytes()))
    })?;
    l.func_wrap(WASI, "proc_exit", |_: Ctx, code: i32| -> Result<(), Error> { Err(Error::i32_exit(code)) })?;
    Ok(())
}
