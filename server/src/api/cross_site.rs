//! What a web page the user visits may ask of the server (the browser sends the user's
//! requests to loopback too). Three checks on every request, before authentication:
//!
//! - **Host** (DNS rebinding: a page whose name resolves to 127.0.0.1 would be same-origin
//!   with the server and could read its answers). A server listening on a loopback address
//!   answers only `Host: localhost | 127.0.0.1 | [::1]` (any port), its `--host`, and
//!   `--allowed-hosts`; on another address only `--allowed-hosts` when given (any Host when
//!   not, as vLLM). `*` in `--allowed-hosts` turns the check off (behind a proxy that sets
//!   the Host).
//! - **Origin** on state-changing methods (anything but GET/HEAD/OPTIONS): a browser sends it
//!   with every cross-origin request, and a form or a `text/plain` `fetch` needs no preflight.
//!   Allowed: no `Origin` (curl, the OpenAI SDKs), the server's own origin (the `Origin`'s
//!   host:port is the request's `Host`: its own pages), and `--allowed-origins`. Else 403.
//! - **Content type** on POST with a body: `application/json` (any parameters), or
//!   `application/x-protobuf` (the Tinker API's `forward_backward`), else 415: a cross-site
//!   form can only send urlencoded, multipart or `text/plain` bodies, and any other type
//!   needs a CORS preflight.
//!
//! CORS only as configured: for an origin in `--allowed-origins` the answers carry
//! `Access-Control-Allow-Origin` and a preflight `OPTIONS` gets 204 with the methods and
//! headers; nothing otherwise (browsers then keep other origins from reading answers).
//! Refusals use the OpenAI error envelope (docs/ARCHITECTURE.md, "An HTTP request").

use super::{ApiError, AppState};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// The checks' settings (`--host`, `--allowed-hosts`, `--allowed-origins`).
#[derive(Debug, Clone, Default)]
pub struct CrossSite {
    /// `--host`: the address the server listens on.
    pub listen_host: String,
    /// `--allowed-hosts` (lower case, without port; `*` = any).
    pub allowed_hosts: Vec<String>,
    /// `--allowed-origins` (`scheme://host[:port]`, as browsers send them).
    pub allowed_origins: Vec<String>,
}

impl CrossSite {
    /// Whether `Host: value` may be answered.
    pub fn host_allowed(&self, value: &str) -> bool {
        if self.allowed_hosts.iter().any(|h| h == "*") {
            return true;
        }
        let host = host_name(value);
        if self.allowed_hosts.contains(&host) || host == self.listen_host.to_ascii_lowercase() {
            return true;
        }
        if crate::serve::is_loopback(&self.listen_host) {
            return matches!(host.as_str(), "localhost" | "127.0.0.1" | "::1");
        }
        self.allowed_hosts.is_empty()
    }

    fn origin_listed(&self, origin: &str) -> bool {
        self.allowed_origins.iter().any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
    }
}

/// The host of a `Host` value, lower case, without the port (`[::1]:8000` → `::1`).
fn host_name(value: &str) -> String {
    let v = value.trim().to_ascii_lowercase();
    if let Some(rest) = v.strip_prefix('[') {
        return rest.split(']').next().unwrap_or_default().to_string();
    }
    v.split(':').next().unwrap_or_default().to_string()
}

/// The `host[:port]` of an `Origin` (`http://127.0.0.1:8000` → `127.0.0.1:8000`).
fn origin_authority(origin: &str) -> Option<&str> {
    origin.split_once("://").map(|(_, a)| a.trim_end_matches('/'))
}

fn header_str(h: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

/// The middleware (see the module doc).
pub async fn guard(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let cs = &state.cross_site;
    let h = req.headers();
    if let Some(host) = header_str(h, header::HOST) {
        if !cs.host_allowed(host) {
            return ApiError::Forbidden(format!(
                "Host `{host}` is not one this server answers (DNS rebinding guard): add it with --allowed-hosts"
            ))
            .into_response();
        }
    }
    let origin = header_str(h, header::ORIGIN).map(str::to_string);
    let listed = origin.as_deref().is_some_and(|o| cs.origin_listed(o));
    // A CORS preflight from a listed origin.
    if req.method() == Method::OPTIONS && listed && h.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD) {
        let mut r = StatusCode::NO_CONTENT.into_response();
        cors_headers(r.headers_mut(), origin.as_deref().unwrap_or_default(), true);
        return r;
    }
    if !matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        if let Some(o) = &origin {
            let own = origin_authority(o).is_some_and(|a| Some(a) == header_str(h, header::HOST));
            if !own && !listed {
                return ApiError::Forbidden(format!(
                    "cross-origin {} from `{o}` refused: only the server's own pages and --allowed-origins may \
                     change its state",
                    req.method()
                ))
                .into_response();
            }
        }
        let has_body = header_str(h, header::CONTENT_LENGTH).is_none_or(|n| n.trim() != "0")
            && (h.contains_key(header::CONTENT_LENGTH) || h.contains_key(header::TRANSFER_ENCODING));
        let json = header_str(h, header::CONTENT_TYPE).is_some_and(|t| {
            t.split(';').next().is_some_and(|m| {
                let m = m.trim();
                m.eq_ignore_ascii_case("application/json") || m.eq_ignore_ascii_case("application/x-protobuf")
            })
        });
        if has_body && !json {
            let got = header_str(h, header::CONTENT_TYPE).unwrap_or("none");
            return ApiError::UnsupportedMediaType(format!(
                "request bodies must be `Content-Type: application/json` (or application/x-protobuf), got `{got}`"
            ))
            .into_response();
        }
    }
    let mut r = next.run(req).await;
    if let (true, Some(o)) = (listed, origin) {
        cors_headers(r.headers_mut(), &o, false);
    }
    r
}

/// `Access-Control-Allow-Origin` for `origin` (and, for a preflight, the methods and headers).
fn cors_headers(h: &mut HeaderMap, origin: &str, preflight: bool) {
    if let Ok(v) = HeaderValue::from_str(origin) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    if preflight {
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, HeaderValue::from_static("authorization, content-type"));
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_a_loopback_server_answers() {
        let cs = |listen: &str, allowed: &[&str]| CrossSite {
            listen_host: listen.into(),
            allowed_hosts: allowed.iter().map(|s| s.to_string()).collect(),
            allowed_origins: vec![],
        };
        let cases: [(CrossSite, &str, bool); 10] = [
            (cs("127.0.0.1", &[]), "127.0.0.1:8000", true),
            (cs("127.0.0.1", &[]), "localhost:8000", true),
            (cs("127.0.0.1", &[]), "[::1]:8000", true),
            (cs("127.0.0.1", &[]), "evil.example:8000", false),
            (cs("127.0.0.1", &["rlserve.lan"]), "rlserve.lan", true),
            (cs("127.0.0.1", &["*"]), "evil.example", true),
            (cs("0.0.0.0", &[]), "evil.example", true),
            (cs("0.0.0.0", &["rlserve.lan"]), "evil.example", false),
            (cs("0.0.0.0", &["rlserve.lan"]), "RLSERVE.LAN:80", true),
            (cs("10.0.0.5", &["rlserve.lan"]), "10.0.0.5:8000", true),
        ];
        for (c, host, want) in cases {
            assert_eq!(c.host_allowed(host), want, "{host} on {c:?}");
        }
    }
}
