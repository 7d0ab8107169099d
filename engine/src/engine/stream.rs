//! What a request's stream carries, and the one way to collect a whole completion from it.

use std::time::Instant;

use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::{Error, Result};
use crate::sequence::{FinishReason, TokenOutput};

/// What a request's stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token and the text it completes.
    Token {
        /// The token and its log-probabilities.
        token: TokenOutput,
        /// Text that may be shown (stop-string prefixes are held back).
        text: String,
    },
    /// The prompt's tokens after the first, each scored given the tokens before it (asked
    /// for with `prompt_logprobs`); comes once, before the first token.
    PromptLogprobs(Vec<TokenOutput>),
    /// The request ended; nothing follows.
    Finished(Finish),
}

/// How a request ended, with its token counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finish {
    /// Why generation stopped.
    pub reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Seconds from arrival until the request was first scheduled.
    pub queue_seconds: f64,
    /// When the request was first scheduled (`None` if it never was).
    pub scheduled: Option<Instant>,
    /// Times the request was preempted (its blocks given back, recomputed later).
    pub preemptions: u32,
}

/// A whole completion, collected from its stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    /// The prompt's tokens after the first, scored (with `prompt_logprobs`).
    pub prompt: Option<Vec<TokenOutput>>,
    /// The generated tokens.
    pub tokens: Vec<TokenOutput>,
    /// Their text.
    pub text: String,
    /// How the request ended.
    pub finish: Finish,
}

/// A completion being gathered event by event.
#[derive(Debug, Default)]
pub struct Collector {
    prompt: Option<Vec<TokenOutput>>,
    tokens: Vec<TokenOutput>,
    text: String,
}

impl Collector {
    /// Takes the next event; returns the whole completion once it has finished.
    pub fn push(&mut self, event: Event) -> Option<Collected> {
        match event {
            Event::PromptLogprobs(scores) => self.prompt = Some(scores),
            Event::Token { token, text } => {
                self.tokens.push(token);
                self.text.push_str(&text);
            }
            Event::Finished(finish) => {
                let this = std::mem::take(self);
                return Some(Collected {
                    prompt: this.prompt,
                    tokens: this.tokens,
                    text: this.text,
                    finish,
                });
            }
        }
        None
    }
}

/// The tokens of one request as they are produced. Dropping it cancels the request.
#[derive(Debug)]
pub struct RequestStream {
    pub(super) rx: UnboundedReceiver<Event>,
}

impl RequestStream {
    /// The next event, waiting for it (for async callers).
    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// The next event, blocking the thread (for synchronous callers, outside a runtime).
    pub fn next_blocking(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }

    /// Waits for the whole completion, showing `observe` each event as it comes; a stream
    /// that ends unfinished lost its engine.
    pub async fn collect(mut self, mut observe: impl FnMut(&Event)) -> Result<Collected> {
        let mut collector = Collector::default();
        while let Some(event) = self.next().await {
            observe(&event);
            if let Some(done) = collector.push(event) {
                return Ok(done);
            }
        }
        Err(Error::EngineStopped)
    }

    /// [`RequestStream::collect`], blocking the thread.
    pub fn collect_blocking(mut self) -> Result<Collected> {
        let mut collector = Collector::default();
        while let Some(event) = self.next_blocking() {
            if let Some(done) = collector.push(event) {
                return Ok(done);
            }
        }
        Err(Error::EngineStopped)
    }
}
