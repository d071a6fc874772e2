//! One error type for the HTTP API and its one mapping to a status code and the OpenAI
//! error envelope `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use engine::outputs::EngineFault;
use engine::ValidationError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Bad parameters, malformed JSON, context overflow (400).
    #[error("{message}")]
    BadRequest { message: String, param: Option<String> },
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The resource is busy or the request repeats one already applied (409).
    #[error("{0}")]
    Conflict(String),
    /// The id existed but has expired (410).
    #[error("{0}")]
    Gone(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    /// A request body that stalls (408).
    #[error("{0}")]
    RequestTimeout(String),
    /// A body that is not `application/json` (415).
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{0}")]
    TooManyRequests(String),
    #[error("{0}")]
    Unavailable(String),
    /// The server failed (a failed engine step, a panicked task): 500.
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError::BadRequest { message: message.into(), param: param.map(String::from) }
    }

    fn parts(&self) -> (StatusCode, &'static str, Option<&str>) {
        match self {
            ApiError::BadRequest { param, .. } => (StatusCode::BAD_REQUEST, "invalid_request_error", param.as_deref()),
            ApiError::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "authentication_error", None),
            ApiError::Forbidden(_) => (StatusCode::FORBIDDEN, "permission_error", None),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found_error", None),
            ApiError::MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", None),
            ApiError::Conflict(_) => (StatusCode::CONFLICT, "conflict_error", None),
            ApiError::Gone(_) => (StatusCode::GONE, "invalid_request_error", None),
            ApiError::PayloadTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", None),
            ApiError::RequestTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "invalid_request_error", None),
            ApiError::UnsupportedMediaType(_) => (StatusCode::UNSUPPORTED_MEDIA_TYPE, "invalid_request_error", None),
            ApiError::TooManyRequests(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", None),
            ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None),
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        }
    }
}

impl From<ValidationError> for ApiError {
    fn from(e: ValidationError) -> Self {
        let param = match &e {
            ValidationError::Param { param, .. } | ValidationError::VocabId { param, .. } => Some(*param),
            ValidationError::EmptyPrompt | ValidationError::TokenId { .. } => Some("prompt"),
            // A prompt that fills the context alone is at fault itself.
            ValidationError::ContextLength { prompt, max, .. } if prompt >= max => Some("prompt"),
            ValidationError::ContextLength { .. } | ValidationError::TooLongForCache { .. } => Some("max_tokens"),
            ValidationError::DuplicateRequestId(_) => None,
        };
        ApiError::bad(e.to_string(), param)
    }
}

impl From<engine::handle::AddError> for ApiError {
    fn from(e: engine::handle::AddError) -> Self {
        match e {
            engine::handle::AddError::Invalid(v) => v.into(),
            engine::handle::AddError::Stopped(s) => ApiError::Unavailable(s.to_string()),
        }
    }
}

/// The engine could not finish the request (a failed step): the server's fault, 500.
impl From<EngineFault> for ApiError {
    fn from(e: EngineFault) -> Self {
        ApiError::Internal(e.to_string())
    }
}

impl ApiError {
    /// The OpenAI error envelope of this error: the body of an error response, and the
    /// `data:` of the error event that ends a failed stream.
    pub fn envelope(&self) -> serde_json::Value {
        let (status, kind, param) = self.parts();
        serde_json::json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": status.as_u16()}})
    }
}

/// The one mapping of RL errors to HTTP: the caller's mistakes are 4xx (a bad config,
/// dataset or rating, or a file the config names → 400; unknown job or response → 404; a
/// busy learner or a repeated rating → 409; an expired response → 410), the server's own
/// failures 5xx.
impl From<rl::RlError> for ApiError {
    fn from(e: rl::RlError) -> Self {
        use rl::RlError as E;
        match e {
            E::Invalid { ref param, .. } => {
                let param = param.clone();
                ApiError::BadRequest { message: e.to_string(), param }
            }
            E::File { key, .. } => ApiError::bad(e.to_string(), Some(key)),
            E::NotFound(_) => ApiError::NotFound(e.to_string()),
            E::Expired(_) => ApiError::Gone(e.to_string()),
            E::AlreadyRated(_) | E::Busy => ApiError::Conflict(e.to_string()),
            E::Engine(add) => add.into(),
            E::Io { .. }
            | E::Plot { .. }
            | E::Model(_)
            | E::Learner(_)
            | E::Generation(_)
            | E::Spawn(_)
            | E::Panicked(_) => ApiError::Internal(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.parts().0, axum::Json(self.envelope())).into_response()
    }
}
