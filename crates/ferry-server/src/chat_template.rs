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
        env.add_filter("tojson", python_tojson);
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
    /// `tools` are the request's tools (the template's `tools`, left undefined without any).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Json]>,
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
        if let Some(tools) = tools {
            ctx.insert("tools".into(), Json::Array(tools.to_vec()));
        }
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

/// `tojson` as transformers defines it for chat templates: Python's `json.dumps` with
/// `ensure_ascii=False` (and its `indent`, `separators`, `sort_keys`), not minijinja's own
/// (compact, HTML-escaped), so tool schemas and arguments render to transformers' bytes.
fn python_tojson(
    value: Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<Value, minijinja::Error> {
    let bad = |why: String| minijinja::Error::new(ErrorKind::InvalidOperation, why);
    let json = serde_json::to_value(&value).map_err(|e| bad(format!("tojson: {e}")))?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (_, Some(s)) => Some(s.to_owned()),
            _ => return Err(bad(format!("tojson: indent must be a number, got {v}"))),
        },
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .filter(|p: &Vec<String>| p.len() == 2)
                .ok_or_else(|| bad("tojson: separators must be two strings".into()))?;
            (parts[0].clone(), parts[1].clone())
        }
        // Python's defaults: no space after the comma when indenting.
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let style = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// How Python's `json.dumps` lays JSON out (its scalars are [`crate::pyjson`]'s).
struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(&self, v: &Json, level: usize, out: &mut String) {
        match v {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                (Some(i), _, _) => out.push_str(&i.to_string()),
                (_, Some(u), _) => out.push_str(&u.to_string()),
                (_, _, Some(f)) => out.push_str(&crate::pyjson::float_repr(f)),
                _ => out.push_str(&n.to_string()),
            },
            Json::String(s) => self.string(s, out),
            Json::Array(items) => {
                let items: Vec<&Json> = items.iter().collect();
                self.container('[', ']', items.len(), level, out, |i, out| {
                    self.write(items[i], level + 1, out)
                });
            }
            Json::Object(map) => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                self.container('{', '}', entries.len(), level, out, |i, out| {
                    self.string(entries[i].0, out);
                    out.push_str(&self.key_sep);
                    self.write(entries[i].1, level + 1, out);
                });
            }
        }
    }

    fn container(
        &self,
        open: char,
        close: char,
        len: usize,
        level: usize,
        out: &mut String,
        mut item: impl FnMut(usize, &mut String),
    ) {
        out.push(open);
        if len == 0 {
            out.push(close);
            return;
        }
        let newline = |out: &mut String, level: usize| {
            if let Some(indent) = &self.indent {
                out.push('\n');
                for _ in 0..level {
                    out.push_str(indent);
                }
            }
        };
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            newline(out, level + 1);
            item(i, out);
        }
        newline(out, level);
        out.push(close);
    }

    fn string(&self, s: &str, out: &mut String) {
        crate::pyjson::write_str(s, self.ensure_ascii, out);
    }
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
    // vLLM's conversion: an assistant's calls with their arguments as objects (an empty
    // list dropped, so templates take their plain path), its reasoning under both names,
    // a tool message's call id.
    if let Some(calls) = m.tool_calls.as_deref().filter(|c| !c.is_empty()) {
        obj.insert(
            "tool_calls".into(),
            crate::tools::template_tool_calls(calls),
        );
    }
    if let Some(reasoning) = m.reasoning.as_ref().or(m.reasoning_content.as_ref()) {
        obj.insert("reasoning".into(), reasoning.clone().into());
        obj.insert("reasoning_content".into(), reasoning.clone().into());
    }
    if let Some(id) = &m.tool_call_id {
        obj.insert("tool_call_id".into(), id.clone().into());
    }
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

    impl ChatTemplate {
        fn render_test(
            &self,
            messages: &[ChatMessage],
            add_generation_prompt: bool,
            kwargs: Option<&Map<String, Json>>,
        ) -> Result<String, ApiError> {
            self.render(messages, None, add_generation_prompt, kwargs)
        }
    }

    /// `tojson` writes what Python's `json.dumps(..., ensure_ascii=False)` writes (the
    /// expected strings are Python 3.12's output for the same values).
    #[test]
    fn tojson_is_pythons_json_dumps() {
        let t = |src: &str| {
            ChatTemplate::new(src, "", "")
                .unwrap()
                .render(&[], Some(&[serde_json::json!({
                    "name": "f", "d": {"b": [1, 2.5, 1e-5, 1e16, 3.0], "a": null, "e": {}, "l": []},
                    "s": "é \"q\" \\ \n \u{1}", "t": true
                })]), false, None)
                .unwrap()
        };
        assert_eq!(
            t("{{ tools[0] | tojson }}"),
            r#"{"name": "f", "d": {"b": [1, 2.5, 1e-05, 1e+16, 3.0], "a": null, "e": {}, "l": []}, "s": "é \"q\" \\ \n \u0001", "t": true}"#
        );
        assert_eq!(
            t("{{ tools[0].d | tojson(indent=2) }}"),
            "{\n  \"b\": [\n    1,\n    2.5,\n    1e-05,\n    1e+16,\n    3.0\n  ],\n  \"a\": null,\n  \"e\": {},\n  \"l\": []\n}"
        );
        assert_eq!(
            t("{{ tools[0].d.b | tojson(separators=(',', ':')) }}"),
            "[1,2.5,1e-05,1e+16,3.0]"
        );
        assert_eq!(
            t("{{ tools[0] | tojson(sort_keys=true, ensure_ascii=true) }}"),
            r#"{"d": {"a": null, "b": [1, 2.5, 1e-05, 1e+16, 3.0], "e": {}, "l": []}, "name": "f", "s": "\u00e9 \"q\" \\ \n \u0001", "t": true}"#
        );
    }

    /// An assistant's calls reach the template with their arguments as objects, its
    /// reasoning under both names, a tool message with its call id; tools as sent.
    #[test]
    fn tool_calls_reasoning_and_tools_reach_the_template() {
        let src = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:{{ m.content }}|{% if m.reasoning_content %}r={{ m.reasoning_content }}|{% endif %}{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }}{{ c.function.arguments.city }}|{% endfor %}{% if m.tool_call_id %}id={{ m.tool_call_id }}|{% endif %}{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let m = messages(
            r#"[{"role": "assistant", "content": null, "reasoning": "think",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Paris\"}"}},
                                {"id": "c2", "type": "function", "function": {"name": "v", "arguments": "not json"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]"#,
        );
        let tools = [serde_json::json!({"type": "function", "function": {"name": "w"}})];
        assert_eq!(
            t.render(&m, Some(&tools), false, None).unwrap(),
            r#"[w]assistant:|r=think|w{"city": "Paris"}Paris|v{}|tool:sunny|id=c1|"#
        );
        // No tools: the template's `tools` is undefined.
        let t = ChatTemplate::new(
            "{% if tools is defined %}T{% else %}none{% endif %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(t.render(&m, None, false, None).unwrap(), "none");
    }

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
            t.render_test(&m, true, None).unwrap(),
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(!t
            .render_test(&m, false, None)
            .unwrap()
            .ends_with("assistant\n"));
    }

    #[test]
    fn template_variables_pycompat_and_kwargs() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content.strip().upper() }}{% endfor %}{% if flag %}!{% endif %}{{ eos_token }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let kwargs: Map<String, Json> = parse_json(br#"{"flag": true}"#).unwrap();
        let m = messages(r#"[{"role": "user", "content": "  hi "}]"#);
        assert_eq!(
            t.render_test(&m, false, Some(&kwargs)).unwrap(),
            "<s>HI!</s>"
        );
    }

    #[test]
    fn raise_exception_and_bad_parts_are_400s_on_messages() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let e = t
            .render_test(
                &messages(r#"[{"role": "user", "content": "x"}]"#),
                true,
                None,
            )
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(e.message.contains("roles must alternate"), "{}", e.message);
        let t = ChatTemplate::new(CHATML, "", "").unwrap();
        let e = t
            .render_test(
                &messages(r#"[{"role": "user", "content": [{"type": "image_url"}]}]"#),
                true,
                None,
            )
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"));
        let e = t
            .render_test(&messages(r#"[{"content": "x"}]"#), true, None)
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
            let text = t.render_test(&m, false, None).unwrap();
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
            t.render_test(&messages(r#"[{"role": "user", "content": "hi"}]"#), true, None).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render_test(
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
        assert_eq!(t.render_test(&m, false, None).unwrap(), "[a]\n[b]\n");
    }

    #[test]
    fn broken_template_is_a_compile_error() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(TemplateError::Compile(_))
        ));
    }
}
