//! OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP
//! status that goes with each kind of failure.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::Error;

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
    pub fn unknown_model(requested: &str, served: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "The model `{requested}` does not exist. This server serves `{served}`."
            ),
            param: Some("model".into()),
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

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "invalid_request_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS => {
                "service_unavailable_error"
            }
            _ => "internal_server_error",
        }
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        match e {
            Error::InvalidParameter(m) => {
                // Messages name their parameter first, in backticks: report it as `param`.
                let param = m
                    .split('`')
                    .nth(1)
                    .filter(|p| !p.contains(' '))
                    .map(str::to_string);
                ApiError {
                    status: StatusCode::BAD_REQUEST,
                    message: m,
                    param,
                }
            }
            Error::ChatTemplate(m) => ApiError::bad_request(m, Some("messages")),
            Error::Tokenizer(m) => ApiError::bad_request(m, None),
            other => ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: other.to_string(),
                param: None,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        });
        let mut resp = (self.status, Json(body)).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}
