//! Tool calls read while a choice is still being generated, so a stream can send each call's
//! name as soon as it is written and its arguments as they grow, as OpenAI streams them. It
//! reads only answers a grammar holds to calls of one fixed shape — `{"name": "<a tool>",
//! "<arguments key>": <JSON>}` with `", "` and `": "` between — so nothing it sends can turn
//! out not to be a call.

use super::tools::{call_id, Call, ToolChoice, ToolFormat, Tools};

/// What a choice's new text adds to its calls.
#[derive(Debug, Clone, PartialEq)]
pub enum CallPiece {
    /// Call `index` begins: its id and function name.
    Named {
        /// The call's place in the answer.
        index: usize,
        /// Its id.
        id: String,
        /// The function.
        name: String,
    },
    /// More of call `index`'s arguments (JSON text).
    Arguments {
        /// The call's place in the answer.
        index: usize,
        /// The new text.
        text: String,
    },
}

/// Where the reader is in the text.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Place {
    /// Looking for the next call's head.
    Between,
    /// Inside a call's arguments: how deep in brackets, and whether in a string (and just
    /// after a backslash in it).
    Arguments {
        depth: usize,
        in_string: bool,
        escaped: bool,
    },
}

/// Reads one choice's calls as its text grows.
#[derive(Debug, Clone)]
pub struct CallReader {
    /// The tools' names, the only names a call may have.
    names: Vec<String>,
    /// `arguments` or `parameters`.
    key: &'static str,
    /// Bytes of the text read so far.
    read: usize,
    place: Place,
    /// Every call begun, its arguments as far as they are written.
    calls: Vec<Call>,
}

impl CallReader {
    /// A reader for `tools`' answers, when a grammar holds every call to the fixed shape:
    /// always in the generic format, in the others when a call is required.
    pub fn new(tools: &Tools) -> Option<Self> {
        let fixed = tools.format == ToolFormat::Generic || tools.choice != ToolChoice::Auto;
        fixed.then(|| CallReader {
            names: tools.functions.iter().map(|f| f.name.clone()).collect(),
            key: match tools.format {
                ToolFormat::Llama3 => "parameters",
                _ => "arguments",
            },
            read: 0,
            place: Place::Between,
            calls: Vec::new(),
        })
    }

    /// The calls begun so far (the last one's arguments as far as they are written), with
    /// the ids their pieces carried.
    pub fn calls(&self) -> &[Call] {
        &self.calls
    }

    /// Whether a call has begun.
    pub fn started(&self) -> bool {
        !self.calls.is_empty() || self.place != Place::Between
    }

    /// What `text`, the whole choice so far, adds since the last call.
    pub fn advance(&mut self, text: &str) -> Vec<CallPiece> {
        let mut pieces = Vec::new();
        loop {
            match self.place {
                Place::Between => match self.head(text) {
                    Some((name, end)) => {
                        let index = self.calls.len();
                        self.calls.push(Call {
                            id: call_id(),
                            name: name.clone(),
                            arguments: String::new(),
                        });
                        pieces.push(CallPiece::Named {
                            index,
                            id: self.calls[index].id.clone(),
                            name,
                        });
                        self.read = end;
                        self.place = Place::Arguments {
                            depth: 0,
                            in_string: false,
                            escaped: false,
                        };
                    }
                    None => return pieces,
                },
                Place::Arguments { .. } => {
                    let from = self.read;
                    let ended = self.scan(text);
                    let index = self.calls.len() - 1;
                    if self.read > from {
                        let new = &text[from..self.read];
                        self.calls[index].arguments.push_str(new);
                        pieces.push(CallPiece::Arguments {
                            index,
                            text: new.to_string(),
                        });
                    }
                    if !ended {
                        return pieces;
                    }
                    self.place = Place::Between;
                }
            }
        }
    }

    /// The next call's name and the end of its head, once the whole head is in `text`; the
    /// text before a head that cannot be one is passed over.
    fn head(&mut self, text: &str) -> Option<(String, usize)> {
        const OPEN: &str = "{\"name\": \"";
        loop {
            let at = self.read + text.get(self.read..)?.find(OPEN)?;
            let rest = &text[at + OPEN.len()..];
            let Some(quote) = rest.find('"') else {
                // The name is still being written.
                self.read = at;
                return None;
            };
            let name = &rest[..quote];
            let tail = format!("\", \"{}\": ", self.key);
            let after = &rest[quote..];
            if after.len() < tail.len() && tail.starts_with(after) {
                self.read = at;
                return None;
            }
            if after.starts_with(&tail) && self.names.iter().any(|n| n == name) {
                let end = at + OPEN.len() + quote + tail.len();
                return Some((name.to_string(), end));
            }
            self.read = at + 1;
        }
    }

    /// Reads the arguments' JSON from `self.read` as far as `text` goes; true once the value
    /// has ended (its closing bracket read).
    fn scan(&mut self, text: &str) -> bool {
        let Place::Arguments {
            mut depth,
            mut in_string,
            mut escaped,
        } = self.place
        else {
            return true;
        };
        let bytes = text.as_bytes();
        let mut ended = false;
        let mut at = self.read;
        while at < bytes.len() {
            let b = bytes[at];
            at += 1;
            if in_string {
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        ended = true;
                        break;
                    }
                }
                _ => {}
            }
        }
        // Stop at a character boundary: the structural bytes above are ASCII, but the text
        // may end inside a string's multi-byte character.
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        self.read = at;
        self.place = Place::Arguments {
            depth,
            in_string,
            escaped,
        };
        ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::tools::{ToolChoiceSpec, ToolSpec};

    fn tools(format: ToolFormat, choice: &str) -> Tools {
        let spec: ToolSpec = serde_json::from_value(serde_json::json!({"type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object"}}}))
        .expect("a tool");
        Tools::new(
            Some(&[spec]),
            Some(&ToolChoiceSpec::Mode(choice.into())),
            None,
            format,
        )
        .expect("valid")
        .expect("tools")
    }

    /// Feeds `text` a few bytes at a time, as tokens arrive; returns every piece.
    fn read(reader: &mut CallReader, text: &str, step: usize) -> Vec<CallPiece> {
        let mut pieces = Vec::new();
        let mut end = 0;
        while end < text.len() {
            end = (end + step).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            pieces.extend(reader.advance(&text[..end]));
        }
        pieces
    }

    #[test]
    fn calls_are_named_first_then_their_arguments_arrive_in_pieces() {
        let text = r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich \"}\" [x]", "n": [1, {"a": 2}]}}, {"name": "get_weather", "arguments": {}}]}"#;
        for step in [1, 3, 7, 200] {
            let mut reader = CallReader::new(&tools(ToolFormat::Generic, "auto")).expect("reads");
            let pieces = read(&mut reader, text, step);
            let CallPiece::Named { index: 0, id, name } = &pieces[0] else {
                panic!("{pieces:?}")
            };
            assert_eq!(name, "get_weather");
            let args: String = pieces
                .iter()
                .filter_map(|p| match p {
                    CallPiece::Arguments { index: 0, text } => Some(text.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(args, r#"{"city": "Zürich \"}\" [x]", "n": [1, {"a": 2}]}"#);
            let calls = reader.calls();
            assert_eq!(calls.len(), 2, "{step}");
            assert_eq!((&calls[0].id, &calls[0].arguments), (id, &args));
            assert_eq!(calls[1].arguments, "{}");
        }
    }

    #[test]
    fn only_answers_held_to_the_shape_are_read_and_only_known_names_are_calls() {
        assert!(CallReader::new(&tools(ToolFormat::Hermes, "auto")).is_none());
        let mut hermes = CallReader::new(&tools(ToolFormat::Hermes, "required")).expect("reads");
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        assert!(read(&mut hermes, text, 2).len() > 1);
        assert_eq!(hermes.calls()[0].arguments, r#"{"city": "Oslo"}"#);
        let mut llama = CallReader::new(&tools(ToolFormat::Llama3, "required")).expect("reads");
        read(
            &mut llama,
            r#"{"name": "get_weather", "parameters": {"city": "Rome"}}"#,
            5,
        );
        assert_eq!(llama.calls()[0].arguments, r#"{"city": "Rome"}"#);
        let mut generic = CallReader::new(&tools(ToolFormat::Generic, "auto")).expect("reads");
        let answer = r#"{"response": {"name": "fly", "arguments": {"x": 1}, "note": "{\"name\": \"get_weather\"}"}}"#;
        assert!(read(&mut generic, answer, 4).is_empty());
        assert!(!generic.started());
    }
}
