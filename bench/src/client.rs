//! Talking to the server under test: tokenising the prompt text and streaming one
//! completion with its timings.

use std::time::Instant;

use futures::StreamExt;
use serde_json::{json, Value};

use crate::workload::RequestSpec;
use crate::{Error, Result};

/// One finished request's timings.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// Seconds from sending to the first token.
    pub ttft: f64,
    /// Seconds between consecutive streamed tokens.
    pub itl: Vec<f64>,
    /// Seconds from sending to the end of the stream.
    pub e2e: f64,
    /// Output tokens (the server's usage count when it reports one, else streamed chunks).
    pub output_tokens: usize,
}

/// Tokenises `text` with the server's own tokenizer: vLLM's and Ferrite's `/tokenize`
/// (`{"model", "prompt"}`), else llama.cpp's (`{"content"}`).
pub async fn tokenize(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    text: &str,
) -> Result<Vec<u32>> {
    let url = format!("{base}/tokenize");
    let bodies = [
        json!({"model": model, "prompt": text, "add_special_tokens": false}),
        json!({"content": text, "add_special": false}),
    ];
    let mut last = String::new();
    for body in bodies {
        let resp = match http.post(&url).json(&body).send().await {
            Ok(r) => r,
            Err(e) => return Err(Error::Http(format!("{url}: {e}"))),
        };
        let status = resp.status();
        let v: Value = resp.json().await.unwrap_or(Value::Null);
        if status.is_success() {
            if let Some(tokens) = v["tokens"].as_array() {
                let ids: Vec<u32> = tokens
                    .iter()
                    .filter_map(|t| t.as_u64().or_else(|| t["id"].as_u64()))
                    .map(|t| t as u32)
                    .collect();
                if !ids.is_empty() {
                    return Ok(ids);
                }
            }
        }
        last = format!("{status}: {v}");
    }
    Err(Error::Http(format!(
        "{url} did not tokenise the prompt text (tried vLLM's and llama.cpp's forms): {last}"
    )))
}

/// Streams one completion of `spec` from `{base}/v1/completions` and times it; `extra`
/// (a JSON object, e.g. llama.cpp's `{"cache_prompt": false}`) is merged into the body.
pub async fn complete(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    spec: &RequestSpec,
    extra: &Value,
) -> Result<Sample> {
    let url = format!("{base}/v1/completions");
    let mut body = json!({
        "model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
        "temperature": 0, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let fail = |e: &dyn std::fmt::Display| Error::Http(format!("{url}: {e}"));
    let start = Instant::now();
    let resp = http
        .post(&url)
        .json(&body)
        .send()
        .await
        .map_err(|e| fail(&e))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return Err(fail(&format!("{status}: {text}")));
    }
    let mut bytes = resp.bytes_stream();
    let mut buf = String::new();
    let mut sample = Sample::default();
    let mut chunks = 0usize;
    let mut usage = None;
    let mut last: Option<Instant> = None;
    while let Some(chunk) = bytes.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.map_err(|e| fail(&e))?));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                sample.e2e = start.elapsed().as_secs_f64();
                sample.output_tokens = usage.unwrap_or(chunks);
                return Ok(sample);
            }
            let v: Value = serde_json::from_str(data).map_err(|e| fail(&e))?;
            if let Some(err) = v.get("error") {
                return Err(fail(err));
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                usage = Some(n as usize);
            }
            let has_text = v["choices"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["text"].as_str().is_some_and(|t| !t.is_empty()))
            });
            if !has_text {
                continue;
            }
            chunks += 1;
            let now = Instant::now();
            match last {
                None => sample.ttft = (now - start).as_secs_f64(),
                Some(t) => sample.itl.push((now - t).as_secs_f64()),
            }
            last = Some(now);
        }
    }
    Err(fail(&"the stream ended without data: [DONE]"))
}
