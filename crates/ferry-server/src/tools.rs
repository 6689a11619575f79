//! Tool calling on `/v1/chat/completions`, under vLLM's names: the request's `tools`,
//! `tool_choice` and `parallel_tool_calls`, checked ([`ToolFields::read`]); the messages'
//! `tool_calls` and `tool_call_id`, checked ([`check_messages`]); the constraint that
//! `tool_choice: "required"` or a named function puts on the output ([`ToolRequest::constraint`]);
//! and the answer's calls, whole ([`ToolOutput::parse`]) or streamed ([`ToolStream`]).
//!
//! What each `tool_choice` does (with `tools` present; without, only `none` is allowed):
//! * `none`: no calls are parsed; the tools are still rendered by the template, as in vLLM;
//! * `auto` (the default with tools): the output is free, and the server's
//!   `--tool-call-parser` ([`crate::tool_parsers`]) finds the calls in it; a server without
//!   `--enable-auto-tool-choice` and a parser refuses it, as vLLM does;
//! * `required`: the output is held (llguidance) to a JSON array of one or more
//!   `{"name": ..., "parameters": ...}` objects, each naming a tool and matching its
//!   `parameters` schema (vLLM's schema; `parallel_tool_calls: false` makes it one);
//! * a named function: the output is held to that function's `parameters` schema, and is
//!   the call's `arguments`.
//!
//! `required` and named calls need no parser (their format is the constraint's), so ferry
//! takes them without `--tool-call-parser`, where vLLM 0.34 refuses them. A forced call cut
//! off by `max_tokens` ends as vLLM ends it: a named call keeps the arguments it has (the
//! text so far, not valid JSON) with `finish_reason: "length"`; a `required` array that does
//! not parse gives no calls. Either way the content is `null` (vLLM writes `""` for forced
//! calls; OpenAI and ferry's other answers write `null`).
//!
//! `arguments` is the model's own text of the arguments (for the JSON formats), so streamed
//! argument fragments join to exactly the non-streamed string, and turn n+1 can carry the
//! sampled text back.

use ferry_engine::StructuredOutput;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::extract::random_id;
use crate::request::{ChatMessage, ToolFields};
use crate::structured::StructuredSpec;
use crate::tool_parsers::{ParsedCall, ToolCallParser};

/// What the server was started with (`--tool-call-parser`, `--enable-auto-tool-choice`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ToolServer {
    /// The parser for `tool_choice: "auto"`, when auto tool choice is enabled.
    pub auto: Option<ToolCallParser>,
}

/// One function tool.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    /// Its `parameters` schema (`None`: any object).
    pub parameters: Option<Value>,
}

/// `tool_choice`, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    /// As sent, for the template.
    pub tools: Vec<Value>,
    pub functions: Vec<Function>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

impl ToolFields {
    /// The request's tools, or `None` without any (`tools` absent, `null` or `[]`): each
    /// error names the field at fault.
    pub fn read(&self, server: ToolServer) -> Result<Option<ToolRequest>, ApiError> {
        let choice = self.choice()?;
        let tools = match self.tools.as_ref().filter(|v| !v.is_null()) {
            None => None,
            Some(Value::Array(list)) => Some(list.clone()),
            Some(_) => return Err(ApiError::invalid("tools", "`tools` must be a list")),
        };
        // OpenAI treats an empty list as none: "auto" and "required" fall back to "none"
        // (vLLM's rule); a named function still has to exist.
        let tools = match (tools, &choice) {
            (Some(list), Some(ToolChoice::Named(_))) => list,
            (Some(list), _) if !list.is_empty() => list,
            // `[]` is no tools (with any choice but a named one).
            (Some(_), _) | (None, None | Some(ToolChoice::None)) => return Ok(None),
            (None, Some(_)) => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "When using `tool_choice`, `tools` must be set.",
                ))
            }
        };
        let functions = tools
            .iter()
            .enumerate()
            .map(|(i, t)| function(i, t))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, f) in functions.iter().enumerate() {
            if functions[..i].iter().any(|g| g.name == f.name) {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.name"),
                    format!(
                        "two tools are named `{}`: tool names must be unique",
                        f.name
                    ),
                ));
            }
        }
        let choice = choice.unwrap_or(ToolChoice::Auto);
        match &choice {
            ToolChoice::Named(name) if !functions.iter().any(|f| &f.name == name) => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "The tool `{name}` specified in `tool_choice` does not match any of \
                         the specified `tools`"
                    ),
                ))
            }
            ToolChoice::Auto if server.auto.is_none() => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "\"auto\" tool choice requires --enable-auto-tool-choice and \
                     --tool-call-parser to be set",
                ))
            }
            _ => {}
        }
        Ok(Some(ToolRequest {
            tools,
            functions,
            choice,
            parallel: self.parallel_tool_calls != Some(false),
        }))
    }

    fn choice(&self) -> Result<Option<ToolChoice>, ApiError> {
        const USAGE: &str =
            r#"Correct usage: `{"type": "function", "function": {"name": "my_function"}}`"#;
        let Some(v) = self.tool_choice.as_ref().filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        match v {
            Value::String(s) => match s.as_str() {
                "none" => Ok(Some(ToolChoice::None)),
                "auto" => Ok(Some(ToolChoice::Auto)),
                "required" => Ok(Some(ToolChoice::Required)),
                other => Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "Invalid value for `tool_choice`: {other}! Only named tools, \"none\", \
                         \"auto\" or \"required\" are supported."
                    ),
                )),
            },
            Value::Object(o) => {
                let function = o
                    .get("function")
                    .and_then(Value::as_object)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "tool_choice.function",
                            format!("`tool_choice` needs a `function` object. {USAGE}"),
                        )
                    })?;
                match function.get("name") {
                    Some(Value::String(name)) if !name.is_empty() => {
                        Ok(Some(ToolChoice::Named(name.clone())))
                    }
                    _ => Err(ApiError::invalid(
                        "tool_choice.function.name",
                        format!("`tool_choice.function.name` must be a non-empty string. {USAGE}"),
                    )),
                }
            }
            other => Err(ApiError::invalid(
                "tool_choice",
                format!("Invalid value for `tool_choice`: {other}! {USAGE}"),
            )),
        }
    }
}

/// Tool `i`, checked: a function with a non-empty name and an object schema, if any.
fn function(i: usize, tool: &Value) -> Result<Function, ApiError> {
    let at = |field: &str| format!("tools[{i}]{field}");
    let obj = tool
        .as_object()
        .ok_or_else(|| ApiError::invalid(at(""), "each tool must be an object"))?;
    match obj.get("type") {
        None => {}
        Some(Value::String(t)) if t == "function" => {}
        Some(other) => {
            return Err(ApiError::invalid(
                at(".type"),
                format!("only `function` tools are supported (got {other})"),
            ))
        }
    }
    let function = obj
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| ApiError::invalid(at(".function"), "a tool needs a `function` object"))?;
    let name = match function.get("name") {
        Some(Value::String(n)) if !n.trim().is_empty() => n.clone(),
        _ => {
            return Err(ApiError::invalid(
                at(".function.name"),
                "a tool's function needs a `name` (a non-empty string)",
            ))
        }
    };
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => None,
        Some(p @ Value::Object(_)) => Some(p.clone()),
        Some(other) => {
            return Err(ApiError::invalid(
                at(".function.parameters"),
                format!("`parameters` must be a JSON schema object (got {other})"),
            ))
        }
    };
    Ok(Function { name, parameters })
}

impl ToolRequest {
    /// Every function's `parameters` schema with its field, to compile (so a schema that
    /// does not compile is a 400 naming its tool, whatever the `tool_choice`).
    pub fn schemas(&self) -> Vec<(String, StructuredOutput)> {
        self.functions
            .iter()
            .enumerate()
            .filter_map(|(i, f)| {
                let p = f.parameters.clone()?;
                Some((
                    format!("tools[{i}].function.parameters"),
                    StructuredOutput::JsonSchema(p),
                ))
            })
            .collect()
    }

    /// The constraint `required` or a named function puts on the output; `None` for
    /// `none` and `auto`.
    pub fn constraint(&self) -> Option<StructuredSpec> {
        let output = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Named(name) => {
                let f = self.functions.iter().find(|f| &f.name == name)?;
                StructuredOutput::JsonSchema(python_layout(params_or_any_object(
                    f.parameters.as_ref(),
                )))
            }
            ToolChoice::Required => {
                StructuredOutput::JsonSchema(python_layout(self.required_schema()))
            }
        };
        Some(StructuredSpec {
            output,
            param: "tool_choice",
        })
    }

    /// vLLM's schema for `required`: an array of `{"name", "parameters"}` objects, one of
    /// the tools each, the tools' `$defs` gathered at the root (where their `$ref`s point).
    fn required_schema(&self) -> Value {
        let mut defs = Map::new();
        let alternatives: Vec<Value> = self
            .functions
            .iter()
            .map(|f| {
                let mut params = params_or_any_object(f.parameters.as_ref());
                if let Some(Value::Object(d)) =
                    params.as_object_mut().and_then(|p| p.remove("$defs"))
                {
                    defs.extend(d);
                }
                serde_json::json!({
                    "properties": {
                        "name": {"type": "string", "enum": [f.name]},
                        "parameters": params,
                    },
                    "required": ["name", "parameters"],
                    // vLLM's schema leaves this open; xgrammar closes it by default, and
                    // llguidance would let the model add keys without end.
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut schema = serde_json::json!({
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": alternatives},
        });
        if !self.parallel {
            schema["maxItems"] = 1.into();
        }
        if !defs.is_empty() {
            schema["$defs"] = Value::Object(defs);
        }
        schema
    }

    /// How the answer's calls are read.
    pub fn output(&self, parser: Option<ToolCallParser>) -> Option<ToolOutput> {
        let mode = match &self.choice {
            ToolChoice::None => return None,
            ToolChoice::Auto => Mode::Auto(parser?),
            ToolChoice::Required => Mode::Required,
            ToolChoice::Named(name) => Mode::Named(name.clone()),
        };
        Some(ToolOutput {
            mode,
            parallel: self.parallel,
        })
    }
}

/// A forced call is written in the layout chat templates write arguments in (Python's
/// `json.dumps`: `", "` and `": "`, no other whitespace) unless the schema asks for its own:
/// the model cannot spin on free whitespace (it did, under the flexible default), and a
/// template that re-serialises the arguments on the next turn writes the same text.
fn python_layout(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// A missing or empty schema still holds the arguments to an object (vLLM's rule).
fn params_or_any_object(params: Option<&Value>) -> Value {
    match params {
        Some(Value::Object(o)) if !o.is_empty() => Value::Object(o.clone()),
        _ => serde_json::json!({"type": "object", "properties": {}}),
    }
}

/// The messages' tool fields, checked: an assistant's `tool_calls` are function calls with a
/// name and `arguments` as a string (OpenAI's type; an object is refused rather than
/// guessed at), and a `tool` message's `tool_call_id`, when it has one, is an earlier call's.
pub fn check_messages(messages: &[ChatMessage]) -> Result<(), ApiError> {
    let mut ids: Vec<&str> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if let Some(calls) = &m.tool_calls {
            for (j, call) in calls.iter().enumerate() {
                let at = |f: &str| format!("messages[{i}].tool_calls[{j}]{f}");
                let function =
                    call.get("function")
                        .and_then(Value::as_object)
                        .ok_or_else(|| {
                            ApiError::invalid(
                                at(".function"),
                                "a tool call needs a `function` object",
                            )
                        })?;
                if !matches!(function.get("name"), Some(Value::String(_))) {
                    return Err(ApiError::invalid(
                        at(".function.name"),
                        "a tool call's function needs a `name`",
                    ));
                }
                match function.get("arguments") {
                    None | Some(Value::Null | Value::String(_)) => {}
                    Some(other) => {
                        let kind = if other.is_object() {
                            "an object"
                        } else {
                            "not a string"
                        };
                        return Err(ApiError::invalid(
                            at(".function.arguments"),
                            format!(
                                "`arguments` must be a string of JSON (got {kind}: send \
                                 `JSON.stringify(arguments)` / `json.dumps(arguments)`)"
                            ),
                        ));
                    }
                }
                if let Some(id) = call.get("id").and_then(Value::as_str) {
                    ids.push(id);
                }
            }
        }
        if let Some(id) = &m.tool_call_id {
            if !ids.contains(&id.as_str()) {
                return Err(ApiError::invalid(
                    format!("messages[{i}].tool_call_id"),
                    format!("`tool_call_id` {id:?} is not the id of any earlier tool call"),
                ));
            }
        }
    }
    Ok(())
}

/// An assistant's tool calls as the template sees them (vLLM's conversion): `arguments`
/// parsed from its JSON string into an object (templates write it with `tojson`); a string
/// that is not a JSON object becomes `{}`, as vLLM coerces it so a conversation can go on.
pub fn template_tool_calls(calls: &[Value]) -> Value {
    Value::Array(
        calls
            .iter()
            .map(|call| {
                let mut call = call.clone();
                if let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) {
                    let args = match f.get("arguments") {
                        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                            Ok(v @ Value::Object(_)) => v,
                            _ => Value::Object(Map::new()),
                        },
                        _ => Value::Object(Map::new()),
                    };
                    f.insert("arguments".into(), args);
                }
                call
            })
            .collect(),
    )
}

/// How an answer's calls are read: the request's `tool_choice` with the server's parser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    mode: Mode,
    parallel: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    Auto(ToolCallParser),
    Required,
    Named(String),
}

/// One call of an answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments, a string of JSON.
    pub arguments: String,
}

/// A streamed piece of one call: its first carries `id`, `type` and `name`, the others
/// argument text, all under the call's `index`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct DeltaToolCall {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: DeltaFunction,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct DeltaFunction {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// vLLM's ids: `chatcmpl-tool-` and a random hex string.
fn call_id() -> String {
    format!("chatcmpl-tool-{}", random_id())
}

fn with_ids(calls: Vec<ParsedCall>) -> Vec<ToolCall> {
    calls
        .into_iter()
        .map(|c| ToolCall {
            id: call_id(),
            kind: "function",
            function: FunctionCall {
                name: c.name,
                arguments: c.arguments,
            },
        })
        .collect()
}

/// One `{"name", "parameters"}` item of a `required` answer; `parameters` kept as written.
#[derive(Deserialize)]
struct RequiredItem<'a> {
    name: String,
    #[serde(borrow)]
    parameters: &'a RawValue,
}

impl ToolOutput {
    /// A whole answer's content (after any reasoning): its content and calls.
    pub fn parse(&self, content: Option<String>) -> (Option<String>, Vec<ToolCall>) {
        let text = content.unwrap_or_default();
        let (content, mut calls) = match &self.mode {
            Mode::Auto(parser) => {
                let parsed = parser.parse(&text);
                if parsed.calls.is_empty() {
                    (Some(text), Vec::new())
                } else {
                    let content = parsed.content.filter(|c| !c.trim().is_empty());
                    (content, parsed.calls)
                }
            }
            Mode::Required => (None, parse_required(&text)),
            Mode::Named(name) => {
                if text.trim().is_empty() {
                    (None, Vec::new())
                } else {
                    let call = ParsedCall {
                        name: name.clone(),
                        arguments: text,
                    };
                    (None, vec![call])
                }
            }
        };
        if !self.parallel {
            calls.truncate(1);
        }
        let content = content.filter(|c| !c.is_empty());
        (content, with_ids(calls))
    }

    /// The answer is read in the model's own call format (`auto`), not a constraint's.
    pub fn reads_model_format(&self) -> bool {
        matches!(self.mode, Mode::Auto(_))
    }

    /// The choice's `finish_reason`: `tool_calls` when it made calls and stopped on its own,
    /// but not for a named function (OpenAI reports `stop` there), as vLLM resolves it.
    pub fn finish_reason(&self, made_calls: bool, engine: &'static str) -> &'static str {
        if made_calls && engine == "stop" && !matches!(self.mode, Mode::Named(_)) {
            "tool_calls"
        } else {
            engine
        }
    }

    /// The streaming reader for one choice.
    pub fn stream(&self) -> ToolStream {
        ToolStream {
            output: self.clone(),
            text: String::new(),
            sent: 0,
            named_id: None,
            made_calls: false,
        }
    }
}

fn parse_required(text: &str) -> Vec<ParsedCall> {
    match serde_json::from_str::<Vec<RequiredItem<'_>>>(text) {
        Ok(items) => items
            .into_iter()
            .map(|i| ParsedCall {
                name: i.name,
                arguments: i.parameters.get().to_owned(),
            })
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// What one streamed piece of content becomes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Streamed {
    pub content: String,
    pub calls: Vec<DeltaToolCall>,
}

/// Reads one choice's calls as its content streams. Text that is or may become part of a
/// call is held back until it is known ([`ToolCallParser::held_from`]); the calls are sent
/// when the answer ends, parsed from the whole text by the same [`ToolOutput::parse`] as a
/// non-streamed answer, so the deltas join to it exactly and no call text reaches
/// `content`. A named function's arguments (the whole output) stream as they come.
#[derive(Debug, Clone)]
pub struct ToolStream {
    output: ToolOutput,
    /// The content so far.
    text: String,
    /// How much of it went out as content (or, named, as arguments).
    sent: usize,
    /// A named call's id, once its first delta went out.
    named_id: Option<String>,
    made_calls: bool,
}

impl ToolStream {
    /// Takes the next piece of content.
    pub fn push(&mut self, piece: &str) -> Streamed {
        self.text.push_str(piece);
        match &self.output.mode {
            Mode::Auto(parser) => {
                let until = parser.held_from(&self.text).max(self.sent);
                let content = self.text[self.sent..until].to_owned();
                self.sent = until;
                Streamed {
                    content,
                    calls: Vec::new(),
                }
            }
            Mode::Required => Streamed::default(),
            Mode::Named(name) => {
                // Nothing goes out while the text is only whitespace: such an answer makes
                // no call.
                if self.named_id.is_none() && self.text.trim().is_empty() {
                    return Streamed::default();
                }
                let mut calls = Vec::new();
                if self.named_id.is_none() {
                    let id = call_id();
                    calls.push(DeltaToolCall {
                        index: 0,
                        id: Some(id.clone()),
                        kind: Some("function"),
                        function: DeltaFunction {
                            name: Some(name.clone()),
                            arguments: Some(String::new()),
                        },
                    });
                    self.named_id = Some(id);
                    self.made_calls = true;
                }
                let args = self.text[self.sent..].to_owned();
                self.sent = self.text.len();
                if !args.is_empty() {
                    calls.push(DeltaToolCall {
                        index: 0,
                        id: None,
                        kind: None,
                        function: DeltaFunction {
                            name: None,
                            arguments: Some(args),
                        },
                    });
                }
                Streamed {
                    content: String::new(),
                    calls,
                }
            }
        }
    }

    /// The next piece of content, and with `last` the rest and every call
    /// ([`Self::push`], then [`Self::finish`]).
    pub fn feed(&mut self, piece: &str, last: bool) -> Streamed {
        let mut out = self.push(piece);
        if last {
            let rest = self.finish();
            out.content.push_str(&rest.content);
            out.calls.extend(rest.calls);
        }
        out
    }

    /// The answer ended: the rest of the content and every call (each as a delta with its
    /// id and name, then one with its arguments).
    pub fn finish(&mut self) -> Streamed {
        if let Mode::Named(_) = self.output.mode {
            return Streamed::default();
        }
        let (content, calls) = self.output.parse(Some(self.text.clone()));
        let content = content.unwrap_or_default();
        // The parser's content starts with what was sent (`held_from`'s promise).
        let rest = content.get(self.sent..).unwrap_or_default().to_owned();
        self.sent = self.text.len();
        self.made_calls = !calls.is_empty();
        let calls = calls
            .into_iter()
            .enumerate()
            .flat_map(|(index, c)| {
                [
                    DeltaToolCall {
                        index,
                        id: Some(c.id),
                        kind: Some("function"),
                        function: DeltaFunction {
                            name: Some(c.function.name),
                            arguments: Some(String::new()),
                        },
                    },
                    DeltaToolCall {
                        index,
                        id: None,
                        kind: None,
                        function: DeltaFunction {
                            name: None,
                            arguments: Some(c.function.arguments),
                        },
                    },
                ]
            })
            .collect();
        Streamed {
            content: rest,
            calls,
        }
    }

    /// The choice's `finish_reason`, given the engine's.
    pub fn finish_reason(&self, engine: &'static str) -> &'static str {
        self.output.finish_reason(self.made_calls, engine)
    }
}
