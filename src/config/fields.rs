//! The JSON field readers: each reads one typed value (object, array, string, integer,
//! duration, ...) and takes the field's path, so every error names the field it is about. Kept
//! apart from what the fields mean, which `mod.rs` and `etcd.rs` decide.

use std::borrow::Cow;

use super::ConfigError;
use crate::json::{JsonError, JsonValue as Value};

/// An object's members in document order, so the first unknown field is the one reported.
pub(super) type Obj<'j> = [(Cow<'j, str>, Value<'j>)];
pub(super) type Res<T> = Result<T, ConfigError>;

const DURATION_GRAMMAR: &str = "digits followed by ms, s, m, h or d (e.g. \"30s\")";

pub(super) fn duration_ms(v: &Value, path: &str) -> Res<u64> {
    let Value::String(s) = v else {
        return Err(err(path, format!("expected a duration string of {DURATION_GRAMMAR}, got {}", kind(v))));
    };
    let bad = || err(path, format!("{s:?} is not a duration: expected {DURATION_GRAMMAR}"));
    let unit = s.trim_start_matches(|c: char| c.is_ascii_digit());
    let digits = s.strip_suffix(unit).unwrap_or_default();
    let scale: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    if digits.is_empty() {
        return Err(bad());
    }
    let too_large = || err(path, format!("{s:?} is too large"));
    let ms = digits.parse::<u64>().ok().and_then(|n| n.checked_mul(scale)).ok_or_else(too_large)?;
    if ms == 0 {
        return Err(err(path, format!("{s:?} must be greater than zero")));
    }
    Ok(ms)
}

// ---- generic JSON walking: each helper takes the field path so errors can name it ----

pub(super) fn err(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError { field: field.to_owned(), reason: reason.into() }
}

pub(super) fn key(parent: &str, k: &str) -> String {
    if parent.is_empty() {
        k.to_owned()
    } else {
        format!("{parent}.{k}")
    }
}

pub(super) fn index(parent: &str, i: usize) -> String {
    format!("{parent}[{i}]")
}

/// The parser's wording talks about a request body; this names the configuration instead.
pub(super) fn json_error(e: JsonError) -> ConfigError {
    let reason = match e {
        JsonError::InvalidUtf8 => "not valid UTF-8".to_owned(),
        JsonError::ByteOrderMark => "starts with a UTF-8 byte order mark".to_owned(),
        JsonError::Empty => "empty: expected a JSON object".to_owned(),
        JsonError::Syntax { offset } => format!("not valid JSON: syntax error at byte {offset}"),
        JsonError::DuplicateMember => "not valid JSON: an object has a duplicate member name".to_owned(),
        JsonError::TooDeep { limit } => format!("not valid JSON: nested deeper than {limit} levels"),
        JsonError::LoneSurrogate => {
            "not valid JSON: a string escape holds an unpaired UTF-16 surrogate".to_owned()
        }
        JsonError::TrailingData => "not valid JSON: data after the top-level value".to_owned(),
    };
    err("", reason)
}

pub(super) fn kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => (*n).to_owned(),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

pub(super) fn type_error(path: &str, expected: &str, v: &Value) -> ConfigError {
    err(path, format!("expected {expected}, got {}", kind(v)))
}

/// An object whose keys must all be in `allowed`: a misspelt optional field would otherwise
/// silently fall back to its default.
pub(super) fn object<'v, 'j>(v: &'v Value<'j>, path: &str, allowed: &[&str]) -> Res<&'v Obj<'j>> {
    let o = object_any(v, path)?;
    reject_unknown(o, path, allowed)?;
    Ok(o)
}

pub(super) fn object_any<'v, 'j>(v: &'v Value<'j>, path: &str) -> Res<&'v Obj<'j>> {
    match v {
        Value::Object(members) => Ok(members),
        _ => Err(type_error(path, "an object", v)),
    }
}

pub(super) fn get<'v, 'j>(o: &'v Obj<'j>, k: &str) -> Option<&'v Value<'j>> {
    o.iter().find(|(name, _)| name == k).map(|(_, v)| v)
}

pub(super) fn reject_unknown(o: &Obj, path: &str, allowed: &[&str]) -> Res<()> {
    match o.iter().find(|(k, _)| !allowed.contains(&k.as_ref())) {
        Some((k, _)) => Err(err(&key(path, k), "unknown field")),
        None => Ok(()),
    }
}

pub(super) fn array<'v, 'j>(v: &'v Value<'j>, path: &str) -> Res<&'v [Value<'j>]> {
    match v {
        Value::Array(items) => Ok(items),
        _ => Err(type_error(path, "an array", v)),
    }
}

pub(super) fn string<'v>(v: &'v Value, path: &str) -> Res<&'v str> {
    match v {
        Value::String(s) => Ok(s),
        _ => Err(type_error(path, "a string", v)),
    }
}

pub(super) fn boolean(v: &Value, path: &str) -> Res<bool> {
    match v {
        Value::Bool(b) => Ok(*b),
        _ => Err(type_error(path, "true or false", v)),
    }
}

/// Only plain decimal digits: negatives, fractions (even `1.0`) and exponents (even `1e3`) are
/// refused rather than converted, so a value means exactly what it spells. The JSON grammar
/// already rules out a `+` sign and leading zeros.
pub(super) fn uint(v: &Value, path: &str, min: u64, max: u64) -> Res<u64> {
    let n = match v {
        Value::Number(text) if text.bytes().all(|b| b.is_ascii_digit()) => text.parse::<u64>().ok(),
        _ => None,
    };
    n.filter(|n| (min..=max).contains(n))
        .ok_or_else(|| type_error(path, &format!("an integer from {min} to {max}"), v))
}

/// An array of distinct items; a duplicate is refused at its own index since it is always a
/// copy-paste slip and, for statuses, could hide which entry was meant.
pub(super) fn unique_list<T: PartialEq>(
    v: &Value,
    path: &str,
    item: impl Fn(&Value, &str) -> Res<T>,
) -> Res<Vec<T>> {
    let items = array(v, path)?;
    let mut out: Vec<T> = Vec::with_capacity(items.len());
    for (i, x) in items.iter().enumerate() {
        let p = index(path, i);
        let parsed = item(x, &p)?;
        if out.contains(&parsed) {
            return Err(err(&p, "duplicate entry"));
        }
        out.push(parsed);
    }
    Ok(out)
}

pub(super) fn optional<T>(
    o: &Obj,
    parent: &str,
    k: &str,
    f: impl FnOnce(&Value, &str) -> Res<T>,
) -> Res<Option<T>> {
    get(o, k).map(|v| f(v, &key(parent, k))).transpose()
}

pub(super) fn required<T>(o: &Obj, parent: &str, k: &str, f: impl FnOnce(&Value, &str) -> Res<T>) -> Res<T> {
    optional(o, parent, k, f)?.ok_or_else(|| err(&key(parent, k), "required"))
}
