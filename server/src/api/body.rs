//! Request bodies, parsed by one set of rules for every endpoint: the body is a JSON object
//! that names each member once;
//! an explicit `null` member is the same as an absent one; a member the endpoint does not
//! implement is a 400 naming it (never silently ignored); a type error names the field
//! (`param` is its path, such as `max_tokens` or `messages[0].content`).

use super::error::ApiError;
use axum::extract::{FromRequest, Request};
use futures_util::StreamExt;
use serde::de::{self, DeserializeOwned, Visitor};
use serde_json::{Map, Value};

/// A body type: how a JSON value becomes it (see the module rules).
pub trait Body: Sized {
    /// Parses the whole body.
    fn from_value(v: Value) -> Result<Self, ApiError>;
}

/// A JSON body parsed by [`Body`]; malformed JSON, wrong types and unknown members come back
/// in the OpenAI error envelope.
pub struct ApiJson<T>(pub T);

/// The longest wait for the next piece of a request body: a client that stops sending
/// mid-body gets a 408 and its connection back (the headers have
/// `crate::serve::HEADER_READ_TIMEOUT`, the same 10 s; without this a stalled body held its
/// connection and task for good).
pub const BODY_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Bytes read past the body limit (and thrown away) before a 413: a client that sends a
/// body somewhat too large gets to read the answer instead of a connection reset mid-send;
/// beyond this the connection is closed unread.
const DRAIN_BYTES: usize = 4 * super::MAX_BODY_BYTES;

/// A request body's bytes, read with [`read_body`]'s limits (Tinker's protobuf bodies).
pub struct RawBody(pub Vec<u8>);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        read_body(req).await.map(RawBody)
    }
}

impl<S: Send + Sync, T: Body> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let bytes = read_body(req).await?;
        let UniqueKeys(v) =
            serde_json::from_slice(&bytes).map_err(|e| ApiError::bad(format!("malformed JSON: {e}"), None))?;
        T::from_value(v).map(ApiJson)
    }
}

/// A JSON value whose objects name each member once: a repeated key is an error (`serde_json`
/// alone keeps the last, which would silently drop the first value). A number with no
/// fraction, such as `2.0`, is read as the integer it is (pydantic's lax mode, so vLLM's;
/// Python clients send `float(n)`); a float field still reads it unchanged. Free-form JSON
/// that reaches the chat template ([`EXACT_MEMBERS`]) keeps its numbers as written, so a
/// tool schema's `1.0` renders as `1.0`, as in Python.
struct UniqueKeys(Value);

/// Members whose values are kept exactly as written (see [`UniqueKeys`]).
const EXACT_MEMBERS: [&str; 2] = ["tools", "chat_template_kwargs"];

/// Reads a [`UniqueKeys`] value; `exact` inside an [`EXACT_MEMBERS`] member.
#[derive(Clone, Copy)]
struct Parse {
    exact: bool,
}

impl<'de> de::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de::DeserializeSeed::deserialize(Parse { exact: false }, d)
    }
}

impl<'de> de::DeserializeSeed<'de> for Parse {
    type Value = UniqueKeys;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<UniqueKeys, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Parse {
    type Value = UniqueKeys;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<UniqueKeys, A::Error> {
        let mut obj = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let exact = self.exact || EXACT_MEMBERS.contains(&k.as_str());
            let UniqueKeys(v) = map.next_value_seed(Parse { exact })?;
            if obj.insert(k.clone(), v).is_some() {
                return Err(de::Error::custom(format!("the key `{k}` appears twice in one object")));
            }
        }
        Ok(UniqueKeys(Value::Object(obj)))
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<UniqueKeys, A::Error> {
        let mut v = Vec::new();
        while let Some(UniqueKeys(x)) = seq.next_element_seed(self)? {
            v.push(x);
        }
        Ok(UniqueKeys(Value::Array(v)))
    }
    fn visit_bool<E>(self, b: bool) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::Bool(b)))
    }
    fn visit_i64<E>(self, n: i64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::from(n)))
    }
    fn visit_u64<E>(self, n: u64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::from(n)))
    }
    fn visit_f64<E>(self, n: f64) -> Result<UniqueKeys, E> {
        // The bounds are exact powers of two, so the casts are exact.
        let whole = n.fract() == 0.0 && !self.exact;
        Ok(UniqueKeys(if whole && (-(2f64.powi(63))..2f64.powi(63)).contains(&n) {
            Value::from(n as i64)
        } else if whole && (0.0..2f64.powi(64)).contains(&n) {
            Value::from(n as u64)
        } else {
            Value::from(n)
        }))
    }
    fn visit_str<E>(self, s: &str) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::String(s.to_string())))
    }
    fn visit_string<E>(self, s: String) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::String(s)))
    }
    fn visit_unit<E>(self) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::Null))
    }
}

/// The whole body, at most `MAX_BODY_BYTES` (a 413 beyond, after draining up to
/// [`DRAIN_BYTES`]), each piece within [`BODY_IDLE_TIMEOUT`] of the last (a 408).
async fn read_body(req: Request) -> Result<Vec<u8>, ApiError> {
    let limit = super::MAX_BODY_BYTES;
    let mut stream = req.into_body().into_data_stream();
    let (mut bytes, mut total) = (Vec::new(), 0usize);
    loop {
        let next = tokio::time::timeout(BODY_IDLE_TIMEOUT, stream.next()).await.map_err(|_| {
            ApiError::RequestTimeout(format!(
                "the request body stalled: nothing arrived for {} s after {total} bytes",
                BODY_IDLE_TIMEOUT.as_secs()
            ))
        })?;
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(|e| ApiError::bad(format!("could not read the request body: {e}"), None))?;
        total += chunk.len();
        if total <= limit {
            bytes.extend_from_slice(&chunk);
        } else if total > limit + DRAIN_BYTES {
            break;
        }
    }
    if total > limit {
        return Err(ApiError::PayloadTooLarge(format!(
            "request body is larger than the limit: {total}{} bytes, at most {limit}",
            if total > limit + DRAIN_BYTES { "+" } else { "" }
        )));
    }
    Ok(bytes)
}

/// A rating: only its own fields.
impl Body for rl::FeedbackRequest {
    fn from_value(v: Value) -> Result<Self, ApiError> {
        strict(v)
    }
}

/// A job config: the `rl` crate checks its keys itself.
impl Body for Value {
    fn from_value(v: Value) -> Result<Self, ApiError> {
        Ok(v)
    }
}

/// `v` as an object with its `null` members removed.
pub fn object(v: Value, what: &str) -> Result<Map<String, Value>, ApiError> {
    match v {
        Value::Object(mut m) => {
            m.retain(|_, v| !v.is_null());
            Ok(m)
        }
        other => Err(ApiError::bad(format!("{what} must be a JSON object, got {}", kind(&other)), None)),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// 400 for the first member of `obj` that is none of `allowed`; `prefix` is the object's
/// path (`""` at the top level, `messages[0].` inside).
pub fn only(obj: &Map<String, Value>, allowed: &[&[&str]], prefix: &str) -> Result<(), ApiError> {
    match obj.keys().find(|k| !allowed.iter().any(|a| a.contains(&k.as_str()))) {
        None => Ok(()),
        Some(k) => {
            let name = format!("{prefix}{k}");
            Err(ApiError::BadRequest {
                message: format!("`{name}` is not supported by this server; remove it or set it to null"),
                param: Some(name),
            })
        }
    }
}

/// `T` from the members of `obj` it names (others are ignored here: [`only`] checks them);
/// a type error names the field's path.
pub fn typed<T: DeserializeOwned>(obj: &Map<String, Value>) -> Result<T, ApiError> {
    typed_at(&Value::Object(obj.clone()), "")
}

/// `T` from `v`, a value at `prefix` in the body (`""` for the body itself, `tools[0]`
/// inside); a type error names the field's whole path.
pub fn typed_at<T: DeserializeOwned>(v: &Value, prefix: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = rl::config::json_words(&e.inner().to_string());
        // serde's path ends at the object a required member is missing from: the member is
        // the field at fault.
        let missing = inner.strip_prefix("missing field `").and_then(|r| r.split_once('`')).map(|(f, _)| f);
        let join = |a: &str, b: &str| match (a, b) {
            ("", b) => b.to_string(),
            (a, "") => a.to_string(),
            (a, b) if b.starts_with('[') => format!("{a}{b}"),
            (a, b) => format!("{a}.{b}"),
        };
        let at = join(prefix, if path == "." { "" } else { &path });
        let param = join(&at, missing.unwrap_or(""));
        let message = match param.as_str() {
            "" => format!("invalid request: {inner}"),
            p => format!("invalid request: `{p}`: {inner}"),
        };
        ApiError::BadRequest { message, param: (!param.is_empty()).then_some(param) }
    })
}

/// A body with only its own fields: `T`'s fields and nothing else.
pub fn strict<T: DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    let obj = object(v, "the request body")?;
    only(&obj, &[fields::<T>()], "")?;
    typed(&obj)
}

/// The field names of a struct deserialized by serde derive (its `FIELDS`, skipped fields
/// left out), read by a deserializer that only records them.
pub fn fields<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Names(Option<&'static [&'static str]>);
    #[derive(Debug)]
    struct Stop;
    impl std::fmt::Display for Stop {
        fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("stop")
        }
    }
    impl std::error::Error for Stop {}
    impl de::Error for Stop {
        fn custom<M: std::fmt::Display>(_: M) -> Self {
            Stop
        }
    }
    impl<'de> de::Deserializer<'de> for &mut Names {
        type Error = Stop;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
            Err(Stop)
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Stop> {
            self.0 = Some(fields);
            Err(Stop)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }
    let mut names = Names(None);
    let _ = T::deserialize(&mut names);
    names.0.unwrap_or(&[])
}

/// Chat messages inside a body (`messages` of chat and tokenize, rollout prompts): each an
/// object of `role`, `content`, `name`, `tool_calls` and `tool_call_id` (nulls removed), a
/// list content's parts objects of `type` and `text`. `path` names the list (`messages`, `prompts[2].messages`).
pub fn check_messages(v: &mut Value, path: &str) -> Result<(), ApiError> {
    let Value::Array(msgs) = v else { return Ok(()) };
    for (i, m) in msgs.iter_mut().enumerate() {
        let Value::Object(obj) = m else { continue };
        obj.retain(|_, v| !v.is_null());
        only(obj, &[fields::<super::protocol::ChatMessageIn>()], &format!("{path}[{i}]."))?;
        if let Some(Value::Array(parts)) = obj.get_mut("content") {
            for (j, p) in parts.iter_mut().enumerate() {
                let Value::Object(po) = p else { continue };
                po.retain(|_, v| !v.is_null());
                only(po, &[&["type", "text"]], &format!("{path}[{i}].content[{j}]."))?;
            }
        }
    }
    Ok(())
}
