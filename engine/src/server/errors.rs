//! OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP
//! status that goes with each kind of failure.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::{Error, RequestError};

/// An error answered to an API client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong and what is allowed.
    pub message: String,
    /// The request field at fault, if any.
    pub param: Option<String>,
}

/// Most bytes a request body may hold (axum's default limit, made explicit).
pub const MAX_BODY_BYTES: usize = 2 << 20;

/// A request's body, read whole; a body that cannot be read (over [`MAX_BODY_BYTES`], or
/// cut off) is refused in OpenAI's error shape like every other bad request.
#[derive(Debug)]
pub struct Body(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for Body {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        Bytes::from_request(req, state)
            .await
            .map(Body)
            .map_err(|rejection| {
                let status = rejection.status();
                let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
                    format!("the request body is larger than the {MAX_BODY_BYTES} bytes this server accepts")
                } else {
                    format!("cannot read the request body: {}", rejection.body_text())
                };
                ApiError {
                    status,
                    message,
                    param: None,
                }
            })
    }
}

/// Reads a request body as JSON, refusing one that is not.
pub fn json_body(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("the request body is not valid JSON: {e}"), None)
    })
}

/// Reads a request from its JSON; a field of the wrong type or out of its type's range is
/// named, as `param` and in the message (`max_tokens: -1` gives "invalid `max_tokens`:
/// invalid value: integer `-1`, expected usize").
pub fn from_json<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::bad_request(format!("invalid request: {inner}"), None)
        } else {
            ApiError::bad_request(format!("invalid `{path}`: {inner}"), Some(&path))
        }
    })
}

impl ApiError {
    /// A 400 about `param`.
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(str::to_string),
        }
    }

    /// A 404 for a model this server does not serve.
    pub fn unknown_model(requested: &str, served: &[String]) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "The model `{requested}` does not exist. This server serves `{}`.",
                served.join("`, `")
            ),
            param: Some("model".into()),
        }
    }

    /// A 500: the server's own fault.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
        }
    }

    /// A 503: loading, draining or the waiting queue is full.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            param: None,
        }
    }

    /// OpenAI's error object: `{"error": {"message", "type", "param", "code"}}` (also sent
    /// as the last event of a stream that fails midway).
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS => {
                "service_unavailable_error"
            }
            s if s.is_client_error() => "invalid_request_error",
            _ => "internal_server_error",
        }
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        ApiError::bad_request(e.to_string(), e.param())
    }
}

/// Every engine error's HTTP status, in one place: a client's mistake is a 4xx naming what
/// to change, a full queue a 503 to retry, and anything else the server's own fault.
impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        match e {
            Error::Request(r) => r.into(),
            Error::ChatTemplate(m) => ApiError::bad_request(m, Some("messages")),
            Error::Tokenizer(m) => ApiError::bad_request(m, None),
            Error::QueueFull { limit } => ApiError::unavailable(format!(
                "the waiting queue is full ({limit} requests, --max-waiting-requests {limit}); \
                 retry later"
            )),
            e @ (Error::EngineStopped
            | Error::Group(_)
            | Error::Config(_)
            | Error::Model { .. }
            | Error::Server(_)
            | Error::Download(_)
            | Error::Io(_)
            | Error::Tensor(_)
            | Error::Internal(_)) => ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: e.to_string(),
                param: None,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}
