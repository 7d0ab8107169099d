//! The engine's one error type: every failure names the file, field or parameter it is about.

use std::path::PathBuf;

/// Everything that can go wrong while loading a model or generating text.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A model file or directory is missing, malformed, truncated or of an unsupported kind.
    #[error("{path}: {message}")]
    Model {
        /// The file or directory that could not be used.
        path: PathBuf,
        /// What was wrong and what was expected instead.
        message: String,
    },
    /// The tokenizer could not be built or could not encode/decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The model has no chat template, or the template failed to render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A request parameter is outside its allowed range.
    #[error("{0}")]
    InvalidParameter(String),
    /// As many requests as may wait are already waiting; retrying later may succeed.
    #[error("the waiting queue is full ({limit} requests are waiting for their first step)")]
    QueueFull {
        /// The bound, `max_waiting_requests`.
        limit: usize,
    },
    /// The engine thread has ended (a bug made it panic): nothing more can be generated
    /// until the process restarts.
    #[error("the engine has stopped; the server must be restarted")]
    EngineStopped,
    /// The HTTP server could not start or stopped with an error.
    #[error("server: {0}")]
    Server(String),
    /// A model download failed; the message says what to change or that rerunning resumes.
    #[error("download: {0}")]
    Download(String),
    /// A file could not be read or written.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A tensor operation failed (a bug or an inconsistent model file).
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
}

impl Error {
    /// A model error about `path`.
    pub fn model(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Model {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
