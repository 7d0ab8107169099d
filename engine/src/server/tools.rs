//! Tool calling: a request's function tools and `tool_choice`; how the model is told of
//! them (its own chat template where the template takes tools, else a generic JSON
//! format, as llama.cpp does for such models); the grammar that forces a call when one is
//! required (and, in the generic format, always keeps the output to that format); and
//! the parsers that read calls back out of each model family's text.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::errors::ApiError;
use crate::grammar::Grammar;
use crate::tokenizer::ChatMessage;

/// One entry of `tools`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function the model may call.
    pub function: FunctionSpec,
}

/// A function tool: its name, what it does, and the JSON schema of its arguments.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionSpec {
    /// Letters, digits, `_` and `-`, at most 64.
    pub name: String,
    /// What the function does, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON schema of its arguments; absent, any object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    /// OpenAI's strict mode; a forced call always meets the schema, so both values mean
    /// the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice` as sent: a mode or a named function.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "expected \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}"
)]
pub enum ToolChoiceSpec {
    /// `none`, `auto` or `required`.
    Mode(String),
    /// `{"type": "function", "function": {"name": ...}}`.
    Named {
        /// Always `function`.
        #[serde(rename = "type")]
        kind: String,
        /// The function to call.
        function: NamedFunction,
    },
}

/// The function a named `tool_choice` forces.
#[derive(Debug, Clone, Deserialize)]
pub struct NamedFunction {
    /// Its name, one of `tools`.
    pub name: String,
}

/// Whether and how the model calls tools.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// The model may answer in text or call tools.
    Auto,
    /// The model must call at least one tool.
    Required,
    /// The model must call this function.
    Named(String),
}

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// Hermes and Qwen: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.
    Hermes,
    /// Llama 3.x: a JSON object `{"name": ..., "parameters": ...}`, after `<|python_tag|>`
    /// or alone.
    Llama3,
    /// Mistral: `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}`.
    Mistral,
    /// A template that knows no tools: the tools and the answer format are described in
    /// the system message, and the answer is one JSON object, `{"tool_calls": [...]}` or
    /// `{"response": ...}`, always held to that shape by a grammar.
    Generic,
}

impl ToolFormat {
    /// The format of a model whose chat template is `source`.
    pub fn of_template(source: Option<&str>) -> Self {
        match source {
            Some(s) if s.contains("tools") => {
                if s.contains("<tool_call>") {
                    ToolFormat::Hermes
                } else if s.contains("[TOOL_CALLS]") {
                    ToolFormat::Mistral
                } else if s.contains("<|python_tag|>") || s.contains("ipython") {
                    ToolFormat::Llama3
                } else {
                    ToolFormat::Generic
                }
            }
            _ => ToolFormat::Generic,
        }
    }
}

/// A tool call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// `call_` and 24 hex digits.
    pub id: String,
    /// The function.
    pub name: String,
    /// Its arguments, as a JSON text.
    pub arguments: String,
}

/// What a choice's text says: text for the user, tool calls, or both.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// Text for the user (none when the model only called tools).
    pub content: Option<String>,
    /// The calls, in order.
    pub calls: Vec<Call>,
}

/// The tools of one chat request, checked, with the format the model writes calls in.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The functions, by their order in `tools`.
    pub functions: Vec<FunctionSpec>,
    /// Whether and what to call.
    pub choice: ToolChoice,
    /// Whether one answer may hold several calls.
    pub parallel: bool,
    /// How the model is told of the tools and writes its calls.
    pub format: ToolFormat,
}

/// Whether `name` is a valid function name (OpenAI's rule).
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Tools {
    /// The request's tools, or none when it has none or `tool_choice` is `none`; every
    /// mistake is a 400 naming `tools` or `tool_choice`.
    pub fn new(
        tools: Option<&[ToolSpec]>,
        choice: Option<&ToolChoiceSpec>,
        parallel: Option<bool>,
        format: ToolFormat,
    ) -> Result<Option<Tools>, ApiError> {
        let tools_err = |m: String| ApiError::bad_request(m, Some("tools"));
        let choice_err = |m: String| ApiError::bad_request(m, Some("tool_choice"));
        let mut functions: Vec<FunctionSpec> = Vec::new();
        for (i, t) in tools.unwrap_or_default().iter().enumerate() {
            if t.kind != "function" {
                return Err(tools_err(format!(
                    "`tools[{i}].type` must be `function`, got `{}`",
                    t.kind
                )));
            }
            let f = &t.function;
            if !valid_name(&f.name) {
                return Err(tools_err(format!(
                    "`tools[{i}].function.name` must be 1 to 64 letters, digits, `_` or `-`, got {:?}",
                    f.name
                )));
            }
            if functions.iter().any(|g| g.name == f.name) {
                return Err(tools_err(format!(
                    "`tools[{i}].function.name` `{}` names two tools",
                    f.name
                )));
            }
            if let Some(p) = &f.parameters {
                if !p.is_object() {
                    return Err(tools_err(format!(
                        "`tools[{i}].function.parameters` must be a JSON schema object"
                    )));
                }
            }
            functions.push(f.clone());
        }
        let names = || {
            functions
                .iter()
                .map(|f| f.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let choice = match choice {
            None => ToolChoice::Auto,
            Some(ToolChoiceSpec::Mode(m)) => match m.as_str() {
                "none" => return Ok(None),
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(choice_err(format!(
                    "`tool_choice` must be none, auto, required or a named function, got `{other}`"
                )))
                }
            },
            Some(ToolChoiceSpec::Named { kind, function }) => {
                if kind != "function" {
                    return Err(choice_err(format!(
                        "`tool_choice.type` must be `function`, got `{kind}`"
                    )));
                }
                if !functions.iter().any(|f| f.name == function.name) {
                    return Err(choice_err(format!(
                        "`tool_choice` names `{}`, which is not among `tools` ({})",
                        function.name,
                        names()
                    )));
                }
                ToolChoice::Named(function.name.clone())
            }
        };
        if functions.is_empty() {
            return match choice {
                ToolChoice::Auto => Ok(None),
                _ => Err(choice_err(
                    "`tool_choice` requires a tool call but `tools` lists none".into(),
                )),
            };
        }
        Ok(Some(Tools {
            functions,
            choice,
            parallel: parallel.unwrap_or(true),
            format,
        }))
    }

    /// The functions a call may name: the named one, or all.
    fn callable(&self) -> impl Iterator<Item = &FunctionSpec> {
        self.functions.iter().filter(|f| match &self.choice {
            ToolChoice::Named(n) => &f.name == n,
            _ => true,
        })
    }

    /// `tools` as the chat template reads them (OpenAI's shape), for formats whose
    /// template takes tools.
    pub fn for_template(&self) -> Option<Value> {
        (self.format != ToolFormat::Generic).then(|| {
            Value::Array(
                self.callable()
                    .map(|f| json!({"type": "function", "function": f}))
                    .collect(),
            )
        })
    }

    /// The conversation as the template is given it: in the generic format, the tools
    /// and the answer format described in the system message, earlier calls written as
    /// the model writes them and tool results as user turns; in the others, unchanged.
    pub fn conversation(&self, mut messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
        if self.format != ToolFormat::Generic {
            return messages;
        }
        for m in &mut messages {
            if let Some(calls) = m.tool_calls.take() {
                let calls: Vec<Value> = calls
                    .iter()
                    .map(|c| json!({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}))
                    .collect();
                m.content = json!({"tool_calls": calls}).to_string();
            } else if m.role == "tool" {
                m.role = "user".into();
                m.content = json!({"tool_response": {
                    "tool_call_id": m.tool_call_id.take(),
                    "content": m.content,
                }})
                .to_string();
            }
        }
        let prompt = self.generic_prompt();
        match messages.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{prompt}", first.content);
            }
            _ => messages.insert(0, ChatMessage::new("system", prompt)),
        }
        messages
    }

    /// The generic format's instructions: the tools, then how to answer.
    fn generic_prompt(&self) -> String {
        let listed: Vec<Value> = self
            .callable()
            .map(|f| json!({"name": f.name, "description": f.description, "parameters": f.parameters}))
            .collect();
        let tools = serde_json::to_string_pretty(&listed).unwrap_or_default();
        let call = r#"{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}"#;
        let how = match &self.choice {
            ToolChoice::Auto => format!(
                "Answer with one JSON object: {call} to call tools, or {{\"response\": \"<your reply>\"}} to answer the user directly."
            ),
            ToolChoice::Required => format!("Answer with one JSON object that calls tools: {call}"),
            ToolChoice::Named(n) => format!(
                "Answer by calling the tool `{n}`, with one JSON object: {call}"
            ),
        };
        format!("You can call these tools:\n{tools}\n\n{how}")
    }

    /// The grammar the answer must match: always in the generic format (a call, or a
    /// response that meets `response` when the request also set a response format), and
    /// in the others when a call is required (else none: the request's own response
    /// format, if any, applies).
    pub fn grammar(&self, response: Option<&Grammar>) -> Option<Grammar> {
        let must_call = self.choice != ToolChoice::Auto;
        let args_key = match self.format {
            ToolFormat::Llama3 => "parameters",
            _ => "arguments",
        };
        let calls: Vec<String> = self
            .callable()
            .map(|f| {
                let mut params = f.parameters.clone().unwrap_or_else(|| json!({"type": "object"}));
                if let Value::Object(o) = &mut params {
                    o.entry("x-guidance").or_insert_with(
                        || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
                    );
                }
                let head = format!(r#"{{"name": "{}", "{args_key}": "#, f.name);
                format!("{} %json {} \"}}\"", lark_str(&head), params)
            })
            .collect();
        let call = format!("call: {}", calls.join(" | "));
        let many = |open: &str, sep: &str, close: &str| {
            let more = if self.parallel {
                format!("({} call)*", lark_str(sep))
            } else {
                String::new()
            };
            format!("{} call {more} {}", lark_str(open), lark_str(close))
        };
        let start = match self.format {
            ToolFormat::Generic => {
                let calls = many(r#"{"tool_calls": ["#, ", ", "]}");
                if must_call {
                    calls
                } else {
                    let reply = match response {
                        Some(Grammar::JsonSchema(s)) => s.clone(),
                        Some(Grammar::JsonObject) => json!({"type": "object"}),
                        _ => json!({"type": "string"}),
                    };
                    format!(
                        "{calls} | {} %json {} \"}}\"",
                        lark_str(r#"{"response": "#),
                        reply
                    )
                }
            }
            _ if !must_call => return None,
            ToolFormat::Hermes => {
                let block = "(\"<tool_call>\\n\" call \"\\n</tool_call>\")";
                if self.parallel {
                    format!("{block} (\"\\n\" {block})*")
                } else {
                    block.to_string()
                }
            }
            ToolFormat::Llama3 => "call".to_string(),
            ToolFormat::Mistral => many("[", ", ", "]"),
        };
        Some(Grammar::Lark(format!("start: {start}\n{call}\n")))
    }

    /// What `text` (a whole choice) says, read in this format: calls to functions not in
    /// `tools` are not calls, and a text that does not parse is the user's text.
    pub fn parse(&self, text: &str) -> Parsed {
        let found = match self.format {
            ToolFormat::Generic => parse_generic(text),
            ToolFormat::Hermes => parse_hermes(text),
            ToolFormat::Llama3 => parse_llama3(text),
            ToolFormat::Mistral => parse_mistral(text),
        };
        match found {
            Some(p)
                if p.calls
                    .iter()
                    .all(|c| self.functions.iter().any(|f| f.name == c.name)) =>
            {
                p
            }
            _ => Parsed {
                content: Some(text.to_string()),
                calls: Vec::new(),
            },
        }
    }
}

/// `s` as a Lark string literal.
fn lark_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// A fresh call id.
pub fn call_id() -> String {
    format!("call_{:024x}", rand::random::<u128>() >> 32)
}

/// A call read from `{"name": ..., "arguments" | "parameters": ...}`.
fn call_of(v: &Value) -> Option<Call> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let arguments = match args {
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
        None => "{}".to_string(),
    };
    Some(Call {
        id: call_id(),
        name,
        arguments,
    })
}

/// Calls from a JSON list of call objects.
fn calls_of(list: &[Value]) -> Option<Vec<Call>> {
    list.iter().map(call_of).collect()
}

fn parse_generic(text: &str) -> Option<Parsed> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    if let Some(list) = v.get("tool_calls").and_then(Value::as_array) {
        return Some(Parsed {
            content: None,
            calls: calls_of(list)?,
        });
    }
    if let Some(one) = v.get("tool_call") {
        return Some(Parsed {
            content: None,
            calls: vec![call_of(one)?],
        });
    }
    let reply = v.get("response")?;
    Some(Parsed {
        content: Some(match reply {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        }),
        calls: Vec::new(),
    })
}

fn parse_hermes(text: &str) -> Option<Parsed> {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let first = text.find(OPEN)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    let mut after = String::new();
    while let Some(at) = rest.find(OPEN) {
        after.push_str(&rest[..at]);
        let body = &rest[at + OPEN.len()..];
        let (inner, next) = match body.find(CLOSE) {
            Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
            None => (body, ""),
        };
        calls.push(call_of(&serde_json::from_str(inner.trim()).ok()?)?);
        rest = next;
    }
    after.push_str(rest);
    let content = format!("{}{}", &text[..first], after.trim());
    let content = content.trim();
    Some(Parsed {
        content: (!content.is_empty()).then(|| content.to_string()),
        calls,
    })
}

fn parse_llama3(text: &str) -> Option<Parsed> {
    let body = text.trim();
    let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
    let mut calls = Vec::new();
    for part in body.split(';') {
        let v: Value = serde_json::from_str(part.trim()).ok()?;
        if v.get("parameters").is_none() && v.get("arguments").is_none() {
            return None;
        }
        calls.push(call_of(&v)?);
    }
    Some(Parsed {
        content: None,
        calls,
    })
}

fn parse_mistral(text: &str) -> Option<Parsed> {
    let body = text.trim();
    let (content, body) = match body.find("[TOOL_CALLS]") {
        Some(at) => (body[..at].trim(), body[at + "[TOOL_CALLS]".len()..].trim()),
        None => ("", body),
    };
    let calls = if body.starts_with('[') {
        let list: Vec<Value> = serde_json::from_str(body).ok()?;
        calls_of(&list)?
    } else {
        // The v11 tokenizer's `name[ARGS]{...}`, one or more.
        let mut calls = Vec::new();
        for part in body.split("[TOOL_CALLS]") {
            let (name, args) = part.split_once("[ARGS]")?;
            let args: Value = serde_json::from_str(args.trim()).ok()?;
            calls.push(Call {
                id: call_id(),
                name: name.trim().to_string(),
                arguments: args.to_string(),
            });
        }
        calls
    };
    Some(Parsed {
        content: (!content.is_empty()).then(|| content.to_string()),
        calls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::tests::{tokenizer, walk};
    use crate::grammar::GrammarCompiler;

    fn weather() -> ToolSpec {
        serde_json::from_value(json!({"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"], "additionalProperties": false}}}))
        .expect("a tool")
    }

    fn tools(format: ToolFormat, choice: Option<ToolChoiceSpec>) -> Tools {
        Tools::new(Some(&[weather()]), choice.as_ref(), None, format)
            .expect("valid")
            .expect("tools")
    }

    fn call(p: &Parsed) -> (String, Value) {
        let c = p.calls.first().expect("a call");
        (
            c.name.clone(),
            serde_json::from_str(&c.arguments).expect("JSON arguments"),
        )
    }

    #[test]
    fn each_familys_own_call_format_is_read() {
        let paris = json!({"city": "Paris"});
        let cases = [
            (ToolFormat::Hermes, "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", Some("Let me look.")),
            (ToolFormat::Llama3, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", None),
            (ToolFormat::Llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", None),
            (ToolFormat::Mistral, "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]", None),
            (ToolFormat::Mistral, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}", None),
            (ToolFormat::Generic, "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]}", None),
        ];
        for (format, text, content) in cases {
            let p = tools(format, None).parse(text);
            assert_eq!(
                call(&p),
                ("get_weather".into(), paris.clone()),
                "{format:?}: {text}"
            );
            assert_eq!(p.content.as_deref(), content, "{format:?}");
            assert!(p.calls[0].id.starts_with("call_"));
        }
    }

    #[test]
    fn text_that_makes_no_known_call_is_the_users_text() {
        let generic = tools(ToolFormat::Generic, None);
        let p = generic.parse("{\"response\": \"Hello!\"}");
        assert_eq!((p.content.as_deref(), p.calls.len()), (Some("Hello!"), 0));
        let hermes = tools(ToolFormat::Hermes, None);
        for text in [
            "Just text.",
            "<tool_call>{\"name\": \"launch\", \"arguments\": {}}</tool_call>",
            "<tool_call>{broken",
        ] {
            let p = hermes.parse(text);
            assert_eq!((p.content.as_deref(), p.calls.len()), (Some(text), 0));
        }
    }

    #[test]
    fn a_forced_call_grammar_only_writes_calls_whose_arguments_validate() {
        let tk = tokenizer();
        let compiler = GrammarCompiler::new(&tk, tk.vocab_size()).expect("compiler");
        let named = ToolChoiceSpec::Named {
            kind: "function".into(),
            function: NamedFunction {
                name: "get_weather".into(),
            },
        };
        for (format, choice) in [
            (ToolFormat::Generic, None),
            (
                ToolFormat::Generic,
                Some(ToolChoiceSpec::Mode("required".into())),
            ),
            (ToolFormat::Hermes, Some(named.clone())),
            (ToolFormat::Llama3, Some(named.clone())),
            (ToolFormat::Mistral, Some(named)),
        ] {
            let t = tools(format, choice);
            let g = t.grammar(None).expect("a grammar");
            let fresh = compiler
                .compile(&g)
                .unwrap_or_else(|e| panic!("{format:?}: {e}"));
            let mut ends = 0;
            for seed in 0..10 {
                let mut c = fresh.clone();
                let (text, ended) = walk(&mut c, &tk, seed, 400);
                if !ended {
                    continue;
                }
                ends += 1;
                let p = t.parse(&text);
                if t.choice == ToolChoice::Auto && p.calls.is_empty() {
                    assert!(p.content.is_some(), "{text}");
                    continue;
                }
                let (name, args) = call(&p);
                assert_eq!(name, "get_weather", "{format:?}: {text}");
                assert!(
                    args["city"]
                        .as_str()
                        .is_some_and(|c| c.chars().count() <= 8),
                    "{text}"
                );
                assert_eq!(args.as_object().map(|o| o.len()), Some(1), "{text}");
            }
            assert!(ends > 0, "{format:?}: no walk ended within 400 tokens");
        }
        assert!(
            tools(ToolFormat::Hermes, None).grammar(None).is_none(),
            "auto leaves Hermes free"
        );
    }

    #[test]
    fn bad_tools_and_choices_are_refused_naming_the_field() {
        let refuse = |tools: &[ToolSpec], choice: ToolChoiceSpec| {
            Tools::new(Some(tools), Some(&choice), None, ToolFormat::Generic).expect_err("refused")
        };
        let e = refuse(
            &[weather()],
            ToolChoiceSpec::Named {
                kind: "function".into(),
                function: NamedFunction { name: "fly".into() },
            },
        );
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        assert!(
            e.message.contains("`fly`") && e.message.contains("get_weather"),
            "{}",
            e.message
        );
        let e = refuse(&[], ToolChoiceSpec::Mode("required".into()));
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let mut bad = weather();
        bad.function.name = "two words".into();
        let e = refuse(&[bad], ToolChoiceSpec::Mode("auto".into()));
        assert_eq!(e.param.as_deref(), Some("tools"));
        let none = Tools::new(
            Some(&[weather()]),
            Some(&ToolChoiceSpec::Mode("none".into())),
            None,
            ToolFormat::Generic,
        );
        assert!(none.expect("valid").is_none());
    }

    #[test]
    fn the_format_is_read_from_the_chat_template() {
        assert_eq!(ToolFormat::of_template(None), ToolFormat::Generic);
        assert_eq!(
            ToolFormat::of_template(Some("{% for m in messages %}{% endfor %}")),
            ToolFormat::Generic
        );
        assert_eq!(
            ToolFormat::of_template(Some("{% if tools %}<tool_call>{% endif %}")),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::of_template(Some("{% if tools %}[TOOL_CALLS]{% endif %}")),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::of_template(Some("{% if tools %}<|python_tag|>{% endif %}")),
            ToolFormat::Llama3
        );
    }
}
