//! The web pages (`serve` without `--no-ui`): the chat that learns (`/`) and the training
//! dashboard (`/dashboard`), plain ES modules under `server/ui/` embedded in the binary with
//! their vendored libraries (`server/ui/vendor/`, versions and licences in its README), so
//! the pages work offline and need no build step. They call the same JSON API as any
//! client (docs/ARCHITECTURE.md, "The web pages").
//!
//! Caching: the vendored files carry their version in the path and are cached for a year
//! (`immutable`); the pages and their own scripts are revalidated on every load (`no-cache`
//! with an `ETag`, 304 when unchanged). Every answer forbids framing by another site
//! (`Content-Security-Policy: frame-ancestors 'none'`) and loads scripts from this server
//! only.

use axum::extract::{Path, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// One embedded file: its path under `/ui/`, content type, bytes, and whether it is a
/// versioned vendor file.
struct File {
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
    immutable: bool,
}

macro_rules! embed {
    ($path:literal, $ct:expr, $immutable:literal) => {
        File { path: $path, content_type: $ct, body: include_bytes!(concat!("../ui/", $path)), immutable: $immutable }
    };
}

const JS: &str = "text/javascript; charset=utf-8";

/// Every file the pages load.
static FILES: &[File] = &[
    embed!("index.html", "text/html; charset=utf-8", false),
    embed!("dashboard.html", "text/html; charset=utf-8", false),
    embed!("style.css", "text/css; charset=utf-8", false),
    embed!("api.js", JS, false),
    embed!("chat.js", JS, false),
    embed!("dashboard.js", JS, false),
    embed!("vendor/uplot-1.6.32/uPlot.esm.js", JS, true),
    embed!("vendor/uplot-1.6.32/uPlot.min.css", "text/css; charset=utf-8", true),
    embed!("vendor/marked-18.3.0/marked.esm.js", JS, true),
    embed!("vendor/dompurify-3.5.0/purify.es.mjs", JS, true),
];

/// What a page may load and who may frame it.
const CSP: &str = "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; \
                   connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

/// The pages' routes: `/`, `/dashboard` and `/ui/{file}`.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(|req: Request| async move { serve("index.html", &req) }))
        .route("/dashboard", get(|req: Request| async move { serve("dashboard.html", &req) }))
        .route("/ui/{*path}", get(|Path(path): Path<String>, req: Request| async move { serve(&path, &req) }))
}

/// A weak validator of `body` (FNV-1a, 64 bits).
fn etag(body: &[u8]) -> String {
    let h = body.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    format!("\"{h:016x}\"")
}

/// [`etag`] of every file of [`FILES`], in its order (computed once).
static TAGS: std::sync::LazyLock<Vec<String>> =
    std::sync::LazyLock::new(|| FILES.iter().map(|f| etag(f.body)).collect());

fn serve(path: &str, req: &Request) -> Response {
    let Some(i) = FILES.iter().position(|f| f.path == path) else {
        return crate::api::error::ApiError::NotFound(format!("no page or file /ui/{path}")).into_response();
    };
    let (f, tag) = (&FILES[i], &TAGS[i]);
    let cache = if f.immutable { "public, max-age=31536000, immutable" } else { "no-cache" };
    let headers = [
        (header::CACHE_CONTROL, HeaderValue::from_static(cache)),
        (header::ETAG, HeaderValue::from_str(tag).expect("hex in quotes")),
        (header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP)),
        (header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
    ];
    let matched =
        req.headers().get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()).is_some_and(|v| v == tag.as_str());
    if matched {
        return (StatusCode::NOT_MODIFIED, headers).into_response();
    }
    (headers, [(header::CONTENT_TYPE, f.content_type)], f.body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file the pages import is embedded: the pages' `import`/`href`/`src` paths under
    /// `/ui/` all name a file of [`FILES`].
    #[test]
    fn every_referenced_file_is_embedded() {
        for f in FILES.iter().filter(|f| !f.immutable) {
            let text = std::str::from_utf8(f.body).unwrap();
            for (i, _) in text.match_indices("/ui/") {
                let rest = &text[i + 4..];
                let end = rest.find(['"', '\'', '`', ')']).unwrap();
                let path = &rest[..end];
                assert!(FILES.iter().any(|g| g.path == path), "{} references /ui/{path}, not embedded", f.path);
            }
        }
    }
}
