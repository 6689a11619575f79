//! Chat templates: renders a model's Jinja chat template (from its tokenizer config) over the
//! request's messages with minijinja, configured like Hugging Face transformers renders them
//! (`trim_blocks`, `lstrip_blocks`, Python string methods through `pycompat`,
//! `raise_exception`).

use minijinja::{Environment, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::error::ApiError;
use crate::request::{ChatMessage, MessageContent};

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template and the special-token strings it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// Why a chat template could not be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TemplateError {
    #[error("the model's chat template does not compile: {0}")]
    Compile(String),
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| TemplateError::Compile(format!("{e:#}")))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// Renders `messages` into a prompt. Errors (a template's `raise_exception`, a bad message)
    /// are 400s on `messages`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: Option<&Map<String, Json>>,
    ) -> Result<String, ApiError> {
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| message_value(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ctx = kwargs.cloned().unwrap_or_default();
        ctx.insert("messages".into(), Json::Array(messages));
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ApiError::internal(format!("chat template missing: {e}")))?;
        template
            .render(Value::from_serialize(&ctx))
            .map_err(|e| ApiError::invalid("messages", format!("the chat template failed: {e:#}")))
    }
}

/// `rendered` cut right after the final message's text, so the model continues that message
/// (`continue_final_message`), as transformers' `apply_chat_template` cuts it: at the last
/// occurrence of the text (stripped), keeping its leading and trailing spaces where the
/// template kept them. A 400 if the template dropped the text.
pub fn continue_final(rendered: &str, final_text: &str) -> Result<String, ApiError> {
    let stripped = final_text.trim();
    let Some(at) = rendered.rfind(stripped) else {
        return Err(ApiError::invalid(
            "continue_final_message",
            "the final message does not appear in the prompt the chat template made (the \
             template deletes part of it), so it cannot be continued",
        ));
    };
    // transformers compares the text as it came with the rendered slice as long as the text
    // without its leading spaces: equal only for a text with none, whose trailing spaces
    // the template kept.
    let end = if final_text.trim_start() == final_text && rendered[at..].starts_with(final_text) {
        at + final_text.len()
    } else {
        at + stripped.len()
    };
    Ok(rendered[..end].to_owned())
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// OpenAI's chat roles (`developer` is its newer `system`). Other roles are passed to the
/// template as they are, as vLLM passes them: a template that knows a custom role renders it,
/// one that does not can refuse it with `raise_exception`.
pub const CHAT_ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// One message as the template sees it: `role`, `content` as a string (text parts joined by
/// newlines, as most templates expect a string), and any other fields unchanged.
fn message_value(i: usize, m: &ChatMessage) -> Result<Json, ApiError> {
    let role = m.role.as_deref().ok_or_else(|| {
        ApiError::invalid(
            format!("messages[{i}].role"),
            "every message needs a `role`",
        )
    })?;
    let content = match &m.content {
        None => String::new(),
        Some(MessageContent::Text(t)) => t.clone(),
        Some(MessageContent::Parts(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => texts.push(t.as_str()),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}]"),
                            format!(
                                "only text content parts are supported (got type `{}`)",
                                p.kind
                            ),
                        ))
                    }
                }
            }
            texts.join("\n")
        }
    };
    let mut obj = Map::new();
    if let Some(name) = &m.name {
        obj.insert("name".into(), name.clone().into());
    }
    obj.insert("role".into(), role.into());
    obj.insert("content".into(), content.into());
    Ok(Json::Object(obj))
}

#[cfg(test)]
mod tests {

    /// transformers' cut, case by case: the text as the template kept it, trailing spaces
    /// the template trimmed, leading spaces, a text the template dropped.
    #[test]
    fn a_continued_message_is_cut_as_transformers_cuts_it() {
        let r = "<s>user: hi</s><s>assistant: The answer is </s>";
        assert_eq!(
            continue_final(r, "The answer is ").unwrap(),
            "<s>user: hi</s><s>assistant: The answer is "
        );
        let trimmed = "<s>assistant: The answer is</s>";
        assert_eq!(
            continue_final(trimmed, "The answer is ").unwrap(),
            "<s>assistant: The answer is"
        );
        assert_eq!(
            continue_final(r, "  The answer").unwrap(),
            "<s>user: hi</s><s>assistant: The answer"
        );
        // The last occurrence.
        assert_eq!(continue_final("ab ab x", "ab").unwrap(), "ab ab");
        assert_eq!(continue_final(r, "").unwrap(), r);
        assert_eq!(
            continue_final(r, "missing").unwrap_err().param.as_deref(),
            Some("continue_final_message")
        );
    }

    use super::*;
    use crate::extract::parse_json;

    const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    fn messages(json: &str) -> Vec<ChatMessage> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn renders_chatml_with_text_parts() {
        let t = ChatTemplate::new(CHATML, "<s>", "</s>").unwrap();
        let m = messages(
            r#"[{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]"#,
        );
        assert_eq!(
            t.render(&m, true, None).unwrap(),
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(!t.render(&m, false, None).unwrap().ends_with("assistant\n"));
    }

    #[test]
    fn template_variables_pycompat_and_kwargs() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content.strip().upper() }}{% endfor %}{% if flag %}!{% endif %}{{ eos_token }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let kwargs: Map<String, Json> = parse_json(br#"{"flag": true}"#).unwrap();
        let m = messages(r#"[{"role": "user", "content": "  hi "}]"#);
        assert_eq!(t.render(&m, false, Some(&kwargs)).unwrap(), "<s>HI!</s>");
    }

    #[test]
    fn raise_exception_and_bad_parts_are_400s_on_messages() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let e = t
            .render(
                &messages(r#"[{"role": "user", "content": "x"}]"#),
                true,
                None,
            )
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(e.message.contains("roles must alternate"), "{}", e.message);
        let t = ChatTemplate::new(CHATML, "", "").unwrap();
        let e = t
            .render(
                &messages(r#"[{"role": "user", "content": [{"type": "image_url"}]}]"#),
                true,
                None,
            )
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"));
        let e = t
            .render(&messages(r#"[{"content": "x"}]"#), true, None)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    }

    #[test]
    fn openai_and_custom_roles_reach_the_template() {
        let t = ChatTemplate::new(CHATML, "", "").unwrap();
        for role in CHAT_ROLES
            .into_iter()
            .chain(["function", "User", "", "system ", "tool_result"])
        {
            let m = messages(&format!(r#"[{{"role": "{role}", "content": "x"}}]"#));
            let text = t.render(&m, false, None).unwrap();
            assert_eq!(text, format!("<|im_start|>{role}\nx<|im_end|>\n"));
        }
    }

    /// SmolLM2-Instruct's template (the default model): a default system prompt unless the
    /// first message is one, with `loop.first` and indexing into `messages`.
    #[test]
    fn renders_the_smollm2_template() {
        let src = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let t = ChatTemplate::new(src, "<|im_start|>", "<|im_end|>").unwrap();
        assert_eq!(
            t.render(&messages(r#"[{"role": "user", "content": "hi"}]"#), true, None).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(
                &messages(
                    r#"[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]"#
                ),
                false,
                None
            )
            .unwrap(),
            "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        );
    }

    /// Block tags on their own lines leave no blank lines (`trim_blocks`, `lstrip_blocks`), as
    /// in transformers.
    #[test]
    fn block_whitespace_is_trimmed_like_transformers() {
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let m = messages(r#"[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]"#);
        assert_eq!(t.render(&m, false, None).unwrap(), "[a]\n[b]\n");
    }

    #[test]
    fn broken_template_is_a_compile_error() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(TemplateError::Compile(_))
        ));
    }
}
