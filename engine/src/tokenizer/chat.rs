//! Chat templates: the model's own Jinja template rendered with minijinja, as HF does.

use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Error, RequestError, Result};

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The turn's text.
    pub content: String,
    /// An assistant turn's tool calls, in OpenAI's shape with `function.arguments` as a
    /// JSON value (as chat templates read them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool turn's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

fn template_error(e: minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::ChatTemplate(msg)
}

impl ChatTemplate {
    /// Compiles `source` with the settings HF transformers uses (trimmed blocks, Python
    /// string methods, `raise_exception`).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders `messages` with `tools` (OpenAI's list of function tools) given to the
    /// template as `tools`, as HF's `apply_chat_template(tools=...)` does.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        if messages.is_empty() {
            return Err(RequestError::NoMessages.into());
        }
        let tmpl = self.env.get_template("chat").map_err(template_error)?;
        tmpl.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(template_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn renders_with_generation_prompt() -> Result<()> {
        let t = ChatTemplate::new(CHATML, "", "")?;
        let out = t.render(&[ChatMessage::new("user", " hi ")], true)?;
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        Ok(())
    }

    #[test]
    fn raise_exception_becomes_a_clear_error() -> Result<()> {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "")?;
        let err = t
            .render(&[ChatMessage::new("user", "x")], true)
            .err()
            .map(|e| e.to_string());
        assert!(err.unwrap_or_default().contains("roles must alternate"));
        Ok(())
    }

    #[test]
    fn empty_conversation_is_refused() -> Result<()> {
        let t = ChatTemplate::new(CHATML, "", "")?;
        assert!(t.render(&[], true).is_err());
        Ok(())
    }
}
