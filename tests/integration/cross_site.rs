//! What a web page the user visits can make a browser ask of the server
//! (`server/src/api/cross_site.rs`): the requests a cross-site page can send without a CORS
//! preflight (a form, a `text/plain` fetch) and any request with a foreign `Origin` are
//! refused on every state-changing route, as is a foreign `Host` (DNS rebinding); the
//! server's own pages and clients without an `Origin` (curl, the OpenAI SDKs) work.

use crate::rl::{start_server, tiny};
use serde_json::json;
use server::serve::ServeArgs;

/// One case: method, path, headers, body, expected status, a substring of the answer.
type Case<'a> = (&'a str, &'a str, Vec<(&'a str, &'a str)>, &'a str, u16, &'a str);

/// Sends `method path` with `headers` and `body`.
async fn send(base: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> reqwest::Response {
    let c = reqwest::Client::new();
    let mut r = c.request(method.parse().unwrap(), format!("{base}{path}")).body(body.to_string());
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    r.send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_site_requests_are_refused_and_the_servers_own_are_not() {
    let (s, base) = start_server(tiny("cross-site", 5), ServeArgs::default()).await;
    let own = base.clone(); // http://127.0.0.1:PORT: the server's own origin
    let port = s.addr.port();
    let rebound = format!("rebind.example:{port}");
    let json_ct = ("content-type", "application/json");
    let evil = ("origin", "http://evil.example");
    let feedback = r#"{"id": "cmpl-1", "preferred": 0}"#;
    let job = r#"{"max_steps": 1}"#;
    let rollout = r#"{"prompts": ["a"], "max_tokens": 1}"#;
    let completion = r#"{"prompt": "a", "max_tokens": 1}"#;
    let cases: Vec<Case> = vec![
        // Forms and text/plain: what a cross-site page sends without a preflight.
        ("POST", "/v1/feedback", vec![("content-type", "text/plain")], feedback, 415, "application/json"),
        (
            "POST",
            "/v1/train/jobs",
            vec![("content-type", "application/x-www-form-urlencoded")],
            "a=b",
            415,
            "application/json",
        ),
        (
            "POST",
            "/v1/rollouts",
            vec![("content-type", "multipart/form-data; boundary=x")],
            rollout,
            415,
            "application/json",
        ),
        ("POST", "/v1/completions", vec![], completion, 415, "got `none`"),
        // A foreign Origin, even with a JSON body (and even without a body).
        ("POST", "/v1/feedback", vec![json_ct, evil], feedback, 403, "cross-origin POST from `http://evil.example`"),
        ("POST", "/v1/train/jobs", vec![json_ct, evil], job, 403, "cross-origin"),
        ("POST", "/v1/rollouts", vec![json_ct, evil], rollout, 403, "cross-origin"),
        ("POST", "/v1/train/jobs/job-1/stop", vec![evil], "", 403, "cross-origin"),
        ("POST", "/v1/feedback", vec![("origin", "null"), json_ct], feedback, 403, "cross-origin"),
        // DNS rebinding: the page's own origin, but a Host this loopback server does not have.
        ("GET", "/v1/models", vec![("host", &rebound)], "", 403, "Host `rebind.example"),
        ("POST", "/v1/completions", vec![("host", &rebound), json_ct], completion, 403, "DNS rebinding"),
        // The server's own page, and clients without an Origin.
        ("POST", "/v1/completions", vec![json_ct, ("origin", &own)], completion, 200, ""),
        ("POST", "/v1/completions", vec![("content-type", "application/json; charset=utf-8")], completion, 200, ""),
        ("GET", "/v1/models", vec![("host", "localhost")], "", 200, ""),
        ("POST", "/v1/train/jobs/job-1/stop", vec![], "", 404, "job-1"),
    ];
    for (method, path, headers, body, status, needle) in cases {
        let r = send(&base, method, path, &headers, body).await;
        assert!(r.headers().get("access-control-allow-origin").is_none(), "no CORS unless configured");
        let got = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert_eq!(got, status, "{method} {path} {headers:?}: {text}");
        assert!(text.contains(needle), "{method} {path} {headers:?}: {text}");
        if status >= 400 {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert!(v["error"]["message"].is_string(), "the OpenAI envelope: {text}");
        }
    }
    s.shutdown(std::time::Duration::from_secs(5)).await;

    // --allowed-origins: that origin may post and read (CORS), others still may not.
    let args = ServeArgs { allowed_origins: vec!["http://app.example".into()], ..ServeArgs::default() };
    let (s, base) = start_server(tiny("cross-site-cors", 5), args).await;
    let app = ("origin", "http://app.example");
    let r = send(&base, "POST", "/v1/completions", &[json_ct, app], completion).await;
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["access-control-allow-origin"], "http://app.example");
    let pre = [app, ("access-control-request-method", "POST"), ("access-control-request-headers", "content-type")];
    let r = send(&base, "OPTIONS", "/v1/completions", &pre, "").await;
    assert_eq!(r.status().as_u16(), 204);
    assert_eq!(r.headers()["access-control-allow-methods"], "GET, POST, OPTIONS");
    let r = send(&base, "POST", "/v1/rollouts", &[json_ct, evil], rollout).await;
    assert_eq!(r.status().as_u16(), 403);
    assert_eq!(json!(r.headers().get("access-control-allow-origin").is_none()), json!(true));
    s.shutdown(std::time::Duration::from_secs(5)).await;
}
