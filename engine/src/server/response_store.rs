//! The bounded in-memory store behind `previous_response_id` and `GET`/`DELETE
//! /v1/responses/{id}`: the newest `capacity` stored responses, the oldest evicted first. A
//! response id carries this process's boot number and the response's sequence number, so a
//! miss can say whether the response was evicted, deleted or never made here.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::errors::ApiError;
use super::openai::responses::ResponseObject;
use crate::tokenizer::ChatMessage;

/// A stored response: the object clients read back, and the conversation a response that
/// continues it starts from (its input and its output, without its instructions).
#[derive(Debug, Clone)]
pub struct Stored {
    /// The response as it was answered.
    pub response: ResponseObject,
    /// Every turn up to and including this response's output.
    pub conversation: Vec<ChatMessage>,
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// The response.
    Found(Arc<Stored>),
    /// No response with that id is here; the error says why.
    Missing(ApiError),
}

/// The newest responses, by sequence number.
#[derive(Debug)]
pub struct ResponseStore {
    capacity: usize,
    boot: u32,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// The next response's sequence number.
    next: u64,
    /// Every sequence number below this was evicted (or deleted before it would have been).
    evicted_below: u64,
    responses: BTreeMap<u64, (String, Arc<Stored>)>,
}

impl ResponseStore {
    /// A store of at most `capacity` responses (0: nothing is stored).
    pub fn new(capacity: usize) -> Self {
        ResponseStore {
            capacity,
            boot: rand::random(),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// How many responses it keeps.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// A fresh response id: `resp_`, then the boot and sequence numbers and a random tail.
    pub fn new_id(&self) -> String {
        let seq = {
            let mut inner = self.lock();
            inner.next += 1;
            inner.next - 1
        };
        format!(
            "resp_{:08x}{seq:016x}{:016x}",
            self.boot,
            rand::random::<u64>()
        )
    }

    /// Keeps `stored` under its response's id, evicting the oldest beyond the capacity.
    pub fn put(&self, stored: Stored) {
        let Some(seq) = self.sequence_of(&stored.response.id) else {
            return;
        };
        if self.capacity == 0 {
            return;
        }
        let mut inner = self.lock();
        inner
            .responses
            .insert(seq, (stored.response.id.clone(), Arc::new(stored)));
        while inner.responses.len() > self.capacity {
            if let Some((evicted, _)) = inner.responses.pop_first() {
                inner.evicted_below = inner.evicted_below.max(evicted + 1);
            }
        }
    }

    /// The response `id`, or a 404 that says why it is not here (`param` names the field
    /// the id came from).
    pub fn get(&self, id: &str, param: Option<&str>) -> Lookup {
        let missing = |why: String| {
            Lookup::Missing(ApiError {
                status: axum::http::StatusCode::NOT_FOUND,
                message: format!("response `{id}` {why}"),
                param: param.map(str::to_string),
            })
        };
        let Some(seq) = self.sequence_of(id) else {
            return missing(
                "was not made by this server process: responses are stored in memory, so one \
                 made before a restart or by another replica is not here"
                    .into(),
            );
        };
        let inner = self.lock();
        match inner.responses.get(&seq) {
            Some((stored_id, stored)) if stored_id == id => Lookup::Found(Arc::clone(stored)),
            _ if self.capacity == 0 => missing(
                "is not stored: this server stores no responses (--max-stored-responses 0)".into(),
            ),
            _ if seq < inner.evicted_below => missing(format!(
                "is no longer stored: the store keeps the newest {} responses \
                 (--max-stored-responses) and this one was evicted",
                self.capacity
            )),
            _ => missing(
                "is not stored: it was deleted, made with `store: false`, or never finished".into(),
            ),
        }
    }

    /// Deletes `id`; false when it was not stored.
    pub fn delete(&self, id: &str) -> bool {
        let Some(seq) = self.sequence_of(id) else {
            return false;
        };
        let mut inner = self.lock();
        match inner.responses.get(&seq) {
            Some((stored_id, _)) if stored_id == id => inner.responses.remove(&seq).is_some(),
            _ => false,
        }
    }

    /// The sequence number of an id this process made.
    fn sequence_of(&self, id: &str) -> Option<u64> {
        let hex = id.strip_prefix("resp_")?;
        if hex.len() != 40 {
            return None;
        }
        let boot = u32::from_str_radix(hex.get(..8)?, 16).ok()?;
        let seq = u64::from_str_radix(hex.get(8..24)?, 16).ok()?;
        (boot == self.boot).then_some(seq)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves the maps consistent (every change is one
        // call), so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::openai::responses::TextOut;

    fn response(id: String) -> Stored {
        Stored {
            response: ResponseObject {
                id,
                object: "response",
                created_at: 0,
                status: "completed",
                error: None,
                incomplete_details: None,
                instructions: None,
                max_output_tokens: None,
                model: "m".into(),
                output: Vec::new(),
                parallel_tool_calls: true,
                previous_response_id: None,
                temperature: 1.0,
                top_p: 1.0,
                tool_choice: "auto".into(),
                tools: Vec::new(),
                text: TextOut {
                    format: serde_json::json!({"type": "text"}),
                },
                truncation: "disabled".into(),
                metadata: serde_json::json!({}),
                store: true,
                service_tier: "default",
                usage: None,
            },
            conversation: vec![ChatMessage::new("user", "hi")],
        }
    }

    fn message(lookup: Lookup) -> String {
        match lookup {
            Lookup::Found(s) => panic!("{} was found", s.response.id),
            Lookup::Missing(e) => {
                assert_eq!(e.status, axum::http::StatusCode::NOT_FOUND);
                e.message
            }
        }
    }

    #[test]
    fn the_store_keeps_the_newest_responses_and_says_why_one_is_missing() {
        let store = ResponseStore::new(2);
        let ids: Vec<String> = (0..3).map(|_| store.new_id()).collect();
        for id in &ids {
            store.put(response(id.clone()));
        }
        assert!(matches!(store.get(&ids[1], None), Lookup::Found(_)));
        assert!(matches!(store.get(&ids[2], None), Lookup::Found(_)));
        let evicted = message(store.get(&ids[0], Some("previous_response_id")));
        assert!(evicted.contains("newest 2 responses"), "{evicted}");
        assert!(evicted.contains("evicted"), "{evicted}");

        assert!(store.delete(&ids[2]));
        assert!(!store.delete(&ids[2]));
        assert!(message(store.get(&ids[2], None)).contains("deleted"));

        let unstored = store.new_id();
        assert!(message(store.get(&unstored, None)).contains("store: false"));
        let elsewhere = ResponseStore::new(2).new_id();
        assert!(message(store.get(&elsewhere, None)).contains("another replica"));
        assert!(message(store.get("resp_abc", None)).contains("another replica"));
        // An id of the right shape whose random tail differs is not the stored response.
        let forged = format!("{}0000000000000000", &ids[1][..ids[1].len() - 16]);
        assert!(matches!(store.get(&forged, None), Lookup::Missing(_)));
    }

    #[test]
    fn a_store_of_no_capacity_keeps_nothing_and_says_so() {
        let store = ResponseStore::new(0);
        let id = store.new_id();
        store.put(response(id.clone()));
        assert!(message(store.get(&id, None)).contains("--max-stored-responses 0"));
    }
}
