//! The engine's errors as data: a request that breaks a rule is a [`RequestError`] naming
//! its parameter, a setting the engine cannot start with is a [`ConfigError`] naming the
//! setting, and failures of the machine or of the engine itself have variants of their own,
//! so whoever answers a client (the HTTP layer) maps each kind to a status in one place.

use std::path::PathBuf;

/// Everything that can go wrong while loading a model or generating text.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request broke one of the rules a request must keep; the client can fix it.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// A setting the engine was started with is not usable.
    #[error(transparent)]
    Config(#[from] ConfigError),
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
    /// The model has no chat template, or the template failed to render the conversation.
    #[error("chat template: {0}")]
    ChatTemplate(String),
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
    /// A model-parallel group could not form, or a rank or its connection was lost: the
    /// message names the rank and what happened.
    #[error("model-parallel group: {0}")]
    Group(String),
    /// The HTTP server could not start or stopped with an error.
    #[error("server: {0}")]
    Server(String),
    /// A model download failed; the message says what to change or that rerunning resumes.
    #[error("download: {0}")]
    Download(String),
    /// A file, stream or thread could not be opened, read, written or started.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A tensor operation failed (a bug or an inconsistent model file).
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    /// Something the engine holds to be true was not: a bug, reported rather than hidden.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// A model error about `path`.
    pub fn model(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Model {
            path: path.into(),
            message: message.into(),
        }
    }

    /// A bug, described.
    pub fn internal(message: impl Into<String>) -> Self {
        Error::Internal(message.into())
    }
}

/// A rule a request broke, with the request parameter it is about.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// A number that must be finite was not.
    #[error("`{param}` must be a finite number, got {got}")]
    NotFinite {
        /// The parameter.
        param: &'static str,
        /// Its value.
        got: f32,
    },
    /// A value outside its allowed range.
    #[error("`{param}` must be in {range}, got {got}")]
    OutOfRange {
        /// The parameter.
        param: &'static str,
        /// The allowed range, as a reader writes it (`(0, 1]`).
        range: &'static str,
        /// The value given.
        got: String,
    },
    /// A count that must be at least one was zero.
    #[error("`{param}` must be at least 1, got 0")]
    Zero {
        /// The parameter.
        param: &'static str,
    },
    /// `min_tokens` above `max_tokens`.
    #[error("`min_tokens` ({min}) must not exceed `max_tokens` ({max})")]
    MinAboveMax {
        /// `min_tokens`.
        min: usize,
        /// `max_tokens`.
        max: usize,
    },
    /// A `logit_bias` value outside [-100, 100].
    #[error("`logit_bias` values must be in [-100, 100], got {bias} for token {token}")]
    BiasOutOfRange {
        /// The token it was for.
        token: u32,
        /// The bias.
        bias: f32,
    },
    /// An empty stop string.
    #[error("`stop` strings must not be empty")]
    EmptyStop,
    /// A prompt of no tokens.
    #[error("the prompt must contain at least one token")]
    EmptyPrompt,
    /// A conversation of no messages.
    #[error("`messages` must contain at least one message")]
    NoMessages,
    /// A token id of the prompt beyond the vocabulary.
    #[error("token id {id} is out of range: the vocabulary has {vocab} tokens")]
    PromptToken {
        /// The id.
        id: u32,
        /// Tokens in the vocabulary.
        vocab: usize,
    },
    /// A token id of another parameter beyond the vocabulary.
    #[error("`{param}` holds token id {id}, beyond the vocabulary of {vocab} tokens")]
    TokenOutOfVocab {
        /// The parameter.
        param: &'static str,
        /// The id.
        id: u32,
        /// Tokens in the vocabulary.
        vocab: usize,
    },
    /// Prompt plus completion longer than the model's context.
    #[error(
        "this model's maximum context length is {max} tokens, but {} were requested ({prompt} in \
         the prompt, {completion} for the completion); reduce the prompt or `max_tokens`",
        prompt + completion
    )]
    ContextTooLong {
        /// `max_model_len`.
        max: usize,
        /// Prompt tokens.
        prompt: usize,
        /// `max_tokens`.
        completion: usize,
    },
    /// One call's prompts times choices exceed what may wait at once.
    #[error(
        "`n` times the prompts gives {requests} requests, more than the {limit} that may wait \
         at once (--max-waiting-requests)"
    )]
    TooManyRequests {
        /// Engine requests the call needs.
        requests: usize,
        /// `max_waiting_requests`.
        limit: usize,
    },
}

impl RequestError {
    /// The request parameter at fault, where one is.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            RequestError::NotFinite { param, .. }
            | RequestError::OutOfRange { param, .. }
            | RequestError::Zero { param }
            | RequestError::TokenOutOfVocab { param, .. } => Some(param),
            RequestError::MinAboveMax { .. } => Some("min_tokens"),
            RequestError::BiasOutOfRange { .. } => Some("logit_bias"),
            RequestError::EmptyStop => Some("stop"),
            RequestError::EmptyPrompt | RequestError::PromptToken { .. } => Some("prompt"),
            RequestError::NoMessages => Some("messages"),
            RequestError::ContextTooLong { .. } => Some("max_tokens"),
            RequestError::TooManyRequests { .. } => Some("n"),
        }
    }
}

/// A setting the engine cannot start with. Settings are named as the engine's flags are
/// (vLLM's names): `max_num_seqs` is shown as `--max-num-seqs`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A count that must be at least one.
    #[error("--{} must be at least 1", flag(setting))]
    Zero {
        /// The setting.
        setting: &'static str,
    },
    /// A value outside its allowed range.
    #[error("--{} must be {range}, got {got}", flag(setting))]
    OutOfRange {
        /// The setting.
        setting: &'static str,
        /// The allowed values, as a reader writes them.
        range: String,
        /// The value given.
        got: String,
    },
    /// A value this engine does not support, and what to use instead.
    #[error("--{} {value}: {reason}", flag(setting))]
    Unsupported {
        /// The setting.
        setting: &'static str,
        /// The value given.
        value: String,
        /// Why it cannot be used, and what can.
        reason: String,
    },
    /// The KV cache the memory budget allows cannot hold one sequence of `max_model_len`.
    #[error(
        "the KV cache holds {capacity} tokens ({blocks} blocks of {block_size}; {explanation}) \
         but --max-model-len is {max_model_len}: lower --max-model-len, or raise \
         --gpu-memory-utilization or --kv-cache-memory"
    )]
    CacheTooSmall {
        /// Tokens the cache holds.
        capacity: usize,
        /// Its blocks.
        blocks: usize,
        /// Tokens per block.
        block_size: usize,
        /// How its size was derived.
        explanation: String,
        /// The longest sequence it must hold.
        max_model_len: usize,
    },
    /// A command-line input (a file, a manifest, a combination of flags) is not usable.
    #[error("{what}: {message}")]
    Input {
        /// The flag or file it is about (`--prompts-file x.txt`).
        what: String,
        /// What is wrong and what is expected.
        message: String,
    },
}

/// A setting's flag spelling: `max_num_seqs` → `max-num-seqs`.
fn flag(setting: &str) -> String {
    setting.replace('_', "-")
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_shown_as_their_flags() {
        let e = ConfigError::OutOfRange {
            setting: "block_size",
            range: "between 1 and 256 tokens".into(),
            got: "0".into(),
        };
        assert_eq!(
            e.to_string(),
            "--block-size must be between 1 and 256 tokens, got 0"
        );
        assert_eq!(
            ConfigError::Zero {
                setting: "max_num_seqs"
            }
            .to_string(),
            "--max-num-seqs must be at least 1"
        );
    }

    #[test]
    fn every_request_rule_names_its_parameter_in_data_not_in_words() {
        let e = RequestError::OutOfRange {
            param: "top_p",
            range: "(0, 1]",
            got: "1.5".into(),
        };
        assert_eq!(
            (e.param(), e.to_string().as_str()),
            (Some("top_p"), "`top_p` must be in (0, 1], got 1.5")
        );
        let long = RequestError::ContextTooLong {
            max: 256,
            prompt: 3,
            completion: 300,
        };
        assert!(long.to_string().contains("but 303 were requested"));
        assert_eq!(long.param(), Some("max_tokens"));
    }
}
