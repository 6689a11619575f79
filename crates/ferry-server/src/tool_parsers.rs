//! Tool-call output parsers: vLLM's `--tool-call-parser` `hermes`, `llama3_json` and
//! `pythonic`, as ferry has them.
//!
//! Given a model's whole output, [`ToolCallParser::parse`] splits it into the tool calls it
//! holds and the content the response should carry, the way vLLM 0.34 does with
//! `--enable-auto-tool-choice` and `tool_choice: "auto"` (no reasoning parser). For streaming,
//! [`ToolCallParser::held_from`] says how much of the text so far may already go out as
//! content: everything before the returned index; the rest is, or may still become, a call.
//!
//! Both functions are pure and keep no state: each reads the whole text it is given, in time
//! linear in its length (so calling `held_from` after every token costs quadratic time over
//! a long output; for plain text that does not start like a call list it is a substring
//! search).
//!
//! # The rules, per parser
//!
//! Where a rule names a Python function, that is the vLLM 0.34 code it follows.
//! "Whitespace" is Python's `str.isspace` (Unicode white space and `\x1c`..`\x1f`).
//!
//! ## `hermes` (`Hermes2ProToolParser.extract_tool_calls`)
//!
//! * No `<tool_call>` in the output: no calls, the whole output is the content.
//! * Otherwise the regions are what `<tool_call>(.*?)</tool_call>|<tool_call>(.*)` finds: each
//!   `<tool_call>` up to the next `</tool_call>`, and a last `<tool_call>` with no closing tag
//!   up to the end of the output. Text between regions is ignored.
//! * Each region must be one JSON value (`json.loads`: whitespace around it is allowed) that is
//!   an object with a `name` that is a string and an `arguments` member of any JSON type
//!   (duplicate keys: the last one counts, as in `json.loads`).
//! * If any region fails, there are no calls and the whole output is the content. So a call
//!   cut off at the end is content when its JSON is incomplete (and when a partial
//!   `</tool_` follows it), and is a call when its JSON happens to be complete.
//! * With calls, the content is the text before the first `<tool_call>`, `None` when that is
//!   empty or only whitespace (`DelegatingParser._extract_tool_calls`). It is not stripped.
//!
//! ## `llama3_json` (the parser engine: `LlamaJsonParser` on `ParserEngine`)
//!
//! * An output that starts with `<|python_tag|>`, or with `{` (taken as if `<|python_tag|>`
//!   came first: `LlamaJsonParser._preprocess_feed`), is checked whole first
//!   (`_validate_complete_tool_output`): after the tag, whitespace-separated JSON objects
//!   joined by single `;`s, each with a `name` and an `arguments` or `parameters` member; a
//!   trailing `;`, and after the last object one `<|eom_id|>`, `<|eot_id|>` or
//!   `<|end_of_text|>` followed only by whitespace, are allowed. If that check fails (a call
//!   cut off at the end, malformed JSON, text after the calls, no object at all) there are no
//!   calls and the whole output is the content. Leading whitespace is not skipped: ` {...}`
//!   is plain text.
//! * Then the engine's scan: text is content until `<|python_tag|>`; after it, `{...}`
//!   objects (split by a string- and escape-aware brace count) separated by whitespace
//!   (` \t\r\n`) and at most one `;` between two objects. Any other character ends the call
//!   list: it and everything after it is content again, until the next `<|python_tag|>`
//!   (which opens a new list; a tag met while a list is open is only text). An object still
//!   open at the end is a cut-off call.
//! * Each complete object is a call when it is a JSON object whose `name` is a string that is
//!   not empty once whitespace is stripped (the name is stripped); its arguments are the first
//!   `arguments` member, else the first `parameters` member, else `{}`. A JSON string there is
//!   replaced by its decoded text (vLLM returns the string itself) when that text is JSON.
//! * Content: the text before the first `{` of a call list, plus the text after it only when
//!   no object in the output has a name vLLM finds (its regex `"name"\s*:\s*"([^"]*)"`,
//!   leftmost match, non-empty); tool-call markup (`<|python_tag|>`, the objects, `;`) is never
//!   content. Content that is only whitespace is dropped when any object was opened. With
//!   calls, the content is stripped (`strip_content_whitespace_with_tools`). Empty content is
//!   `None` (`DelegatingParser._extract_tool_calls` returns the engine's content `or None`,
//!   which is how incomplete tool-call markup is dropped).
//!
//! ## `pythonic` (`PythonicToolParser.extract_tool_calls`, `tool_parsers/utils.py`)
//!
//! * The output must match vLLM's `TOOL_CALL_REGEX` at its start (`regex.match`, no stripping):
//!   `[`, then a call name starting with an ASCII letter right after it, and so on; ferry
//!   runs an exact emulation of that regex (`pythonic_regex`). It rejects, among others,
//!   leading whitespace, `[ f()]`, a first argument that is positional, `f(a =1)` in the first
//!   call, `[]`, and a trailing comma after the last call (`[f(a=1),]`).
//! * Then the output must parse as Python with the list as its first statement
//!   (`ast.parse`): a list of calls `name(...)`, or `a.b.name(...)` after the first call
//!   (the name keeps its dots; in the first call the regex refuses the dot).
//!   Keyword arguments become the arguments, in order; a repeated keyword is a syntax error.
//!   Positional arguments that get past the regex (in a call after one that used a keyword)
//!   are dropped, as vLLM drops them.
//! * Values (`get_parameter_value`): `str` (all quote styles, escapes, raw strings, implicit
//!   concatenation, f-strings without placeholders), `int` (any size, `0x`/`0o`/`0b`, `_`),
//!   `float`, `True`/`False`/`None`, the names `true`/`false`/`null`, lists, tuples and sets
//!   (as JSON arrays, in source order), dicts whose keys are constants (`str`, `int`, `float`,
//!   `bool`, `None`; later duplicates replace the value, Python's dict equality, so `1` and
//!   `True` are one key), and unary `-`/`+` on a number. Anything else (a variable, an
//!   expression, bytes, a complex number, `...`) means no calls.
//! * Any failure: no calls, the whole output is the content. With calls the content is
//!   `None`: nothing but the list (and whitespace, comments, one `;`) may be in the output.
//! * `arguments` is `json.dumps(kwargs, ensure_ascii=False)`: `", "` and `": "` separators,
//!   keys in order, non-ASCII text as is, Python's float `repr` (`1.0`, `1e-05`, `1e+16`), int
//!   and float dict keys written as strings.
//!
//! # `held_from`: what streaming holds back
//!
//! The streamed content is `text[..held_from(text)]`. It only grows as the text grows, and
//! it is a prefix of the content [`ToolCallParser::parse`] returns for the finished output,
//! whether or not that finds calls (so the caller may send the rest of the content at the
//! end).
//!
//! * `hermes`: held from the first `<tool_call>`, or from a partial `<tool_call>` at the end;
//!   held from the start while the text before that is only whitespace (it becomes `None`).
//! * `llama3_json`: text that starts with `{`, `<|python_tag|>` or a part of it is held whole
//!   while it can still pass the whole-output check, and let go at once when it cannot (it will
//!   all be content). Otherwise held from the first `<|python_tag|>` (or a partial one at the
//!   end) and from any whitespace before it; held whole when the text starts with whitespace,
//!   because vLLM strips the content when calls follow.
//! * `pythonic`: held whole while the text starts with `[` and can still become a call list
//!   (the regex and the parser both run on prefixes and say when no continuation can
//!   succeed); otherwise nothing is held.
//!
//! # Where ferry deliberately differs from vLLM
//!
//! * `arguments` for `hermes` and `llama3_json` is the model's own text of the arguments
//!   value, exactly as written (vLLM's `hermes` re-serialises it with `json.dumps`), so that
//!   streamed argument text joins to exactly the final string. It is always valid JSON.
//! * `llama3_json` never returns a call whose arguments are not valid JSON: where vLLM would
//!   (an object cut off at the end, or malformed JSON, after text and `<|python_tag|>`; its
//!   name found by the regex), ferry drops that object like any other tool-call markup. The
//!   content is still computed as vLLM computes it, but it is only stripped when ferry
//!   returns calls.
//! * `llama3_json` arguments given as a JSON string whose text is not JSON (`"arguments":
//!   "x"`) stay the JSON string `"x"`; vLLM returns the bare text `x`.
//! * `llama3_json` names are the decoded JSON string of the top-level `name`; vLLM takes the
//!   regex capture, which keeps escapes undecoded and can pick a nested `"name"` inside the
//!   arguments when that comes first. A name that is only whitespace is no call (vLLM returns a
//!   call named with the whitespace).
//! * No schema-driven type coercion (`ParserEngine._fix_arg_types` rewrites string values
//!   when the request's tool schema says number or boolean): ferry's parsers do not see the
//!   request's tools.
//! * vLLM's engine deletes the tokenizer's special tokens (other than `<|python_tag|>`) from
//!   the text; ferry's text is assumed to carry none. Trailing end tokens after calls are
//!   dropped all the same (they are text after the call list).
//! * JSON is read by `serde_json`, not Python's `json`: `NaN`/`Infinity` and a lone-surrogate
//!   escape in a key or name are errors (the output is then treated as vLLM treats malformed
//!   JSON).
//! * `pythonic`: after the list only whitespace, comments and one `;` may follow (vLLM
//!   accepts any further Python statements and drops them); a positional argument vLLM would
//!   drop must itself be a literal ferry reads; `*args`, `**kwargs` and `\N{...}` escapes are
//!   rejected; a float that overflows to infinity, a string with a lone surrogate and an int
//!   of more than 4300 digits mean no calls (vLLM would write `Infinity`, which is not JSON,
//!   or fail); more than 200 nested brackets (Python's own limit) or unary signs (ferry's
//!   bound on its recursion, so a degenerate `[[[[...` cannot overflow the stack) mean no
//!   calls; identifiers are not NFKC-normalised.

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// vLLM's `--tool-call-parser` names that ferry has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolCallParser {
    /// `hermes`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Hermes 2 Pro,
    /// Qwen 2.5 and others).
    Hermes,
    /// `llama3_json`: `<|python_tag|>{"name": ..., "parameters": ...}; {...}` or the same
    /// objects at the start of the output (Llama 3.1 to 3.3).
    Llama3Json,
    /// `pythonic`: a Python list of calls, `[f(a=1), g(b='x')]` (Llama 3.2, ToolACE).
    Pythonic,
}

impl ToolCallParser {
    /// Every parser ferry has: `hermes`, `llama3_json`, `pythonic`.
    pub const ALL: [ToolCallParser; 3] = [Self::Hermes, Self::Llama3Json, Self::Pythonic];

    /// The `--tool-call-parser` name: `"hermes"`, `"llama3_json"` or `"pythonic"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Pythonic => "pythonic",
        }
    }

    /// vLLM 0.34's other names for these parsers: `qwen3_json` (its alias of `hermes`) and
    /// `llama4_json` (the same parser as `llama3_json`).
    pub const ALIASES: [(&'static str, ToolCallParser); 2] = [
        ("qwen3_json", Self::Hermes),
        ("llama4_json", Self::Llama3Json),
    ];

    /// The parser with this `--tool-call-parser` name (or vLLM alias), if ferry has it.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|parser| parser.name() == name)
            .or_else(|| {
                Self::ALIASES
                    .into_iter()
                    .find_map(|(alias, parser)| (alias == name).then_some(parser))
            })
    }

    /// A whole output, parsed: vLLM's calls and content.
    pub fn parse(self, output: &str) -> Parsed {
        match self {
            Self::Hermes => hermes_parse(output),
            Self::Llama3Json => llama_parse(output),
            Self::Pythonic => pythonic_parse(output),
        }
    }

    /// Streaming: the byte index (a char boundary) of `text` from which the text is held back
    /// because it is, or may become, part of a call; `text.len()` when nothing is held.
    pub fn held_from(self, text: &str) -> usize {
        match self {
            Self::Hermes => hermes_held_from(text),
            Self::Llama3Json => llama_held_from(text),
            Self::Pythonic => pythonic_held_from(text),
        }
    }
}

/// One tool call found in an output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    /// The function's name.
    pub name: String,
    /// The arguments, as JSON text (for `hermes` and `llama3_json` the model's own text).
    pub arguments: String,
}

/// What a whole output holds: the content to return and the tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    /// The message content, `None` where vLLM returns none.
    pub content: Option<String>,
    /// The tool calls, in order; empty when there are none.
    pub calls: Vec<ParsedCall>,
}

impl Parsed {
    /// No calls; the whole output is the content.
    fn content_only(output: &str) -> Self {
        Self {
            content: Some(output.to_owned()),
            calls: Vec::new(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// Python's `str.isspace` for one character.
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// Python's `str.strip()`.
fn py_strip(s: &str) -> &str {
    s.trim_matches(py_isspace)
}

/// Whether `s` is empty or only whitespace (Python: `not s.strip()`).
fn is_blank(s: &str) -> bool {
    s.chars().all(py_isspace)
}

/// `Some(s)` unless `s` is empty.
fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// The length of the longest proper prefix of `marker` (ASCII) that `text` ends with.
fn marker_overlap(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&k| text.ends_with(&marker[..k]))
        .unwrap_or(0)
}

/// A JSON object's members in order, each value as its own text. Keys are decoded.
#[derive(Debug)]
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'a> Members<'a> {
    fn first(&self, key: &str) -> Option<&'a RawValue> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    fn last(&self, key: &str) -> Option<&'a RawValue> {
        self.0.iter().rev().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    fn has(&self, key: &str) -> bool {
        self.first(key).is_some()
    }
}

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MembersVisitor;

        impl<'de> Visitor<'de> for MembersVisitor {
            type Value = Members<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members = Vec::new();
                while let Some(entry) = map.next_entry::<String, &'de RawValue>()? {
                    members.push(entry);
                }
                Ok(Members(members))
            }
        }

        deserializer.deserialize_map(MembersVisitor)
    }
}

/// `text` as one JSON object (whitespace around it allowed), or `None`.
fn json_object(text: &str) -> Option<Members<'_>> {
    serde_json::from_str(text).ok()
}

/// A JSON string value's decoded text, or `None` when `raw` is no string.
fn json_string(raw: &RawValue) -> Option<String> {
    serde_json::from_str(raw.get()).ok()
}

// ---------------------------------------------------------------------------------------------
// hermes
// ---------------------------------------------------------------------------------------------

const HERMES_START: &str = "<tool_call>";
const HERMES_END: &str = "</tool_call>";

fn hermes_parse(output: &str) -> Parsed {
    let Some(first) = output.find(HERMES_START) else {
        return Parsed::content_only(output);
    };
    let mut calls = Vec::new();
    let mut from = first;
    while let Some(at) = output[from..].find(HERMES_START) {
        let body_start = from + at + HERMES_START.len();
        let (body, next) = match output[body_start..].find(HERMES_END) {
            Some(end) => {
                let end = body_start + end;
                (&output[body_start..end], Some(end + HERMES_END.len()))
            }
            None => (&output[body_start..], None),
        };
        match hermes_call(body) {
            Some(call) => calls.push(call),
            None => return Parsed::content_only(output),
        }
        match next {
            Some(next) => from = next,
            None => break,
        }
    }
    let before = &output[..first];
    Parsed {
        content: (!is_blank(before)).then(|| before.to_owned()),
        calls,
    }
}

/// One `<tool_call>` region's call: a JSON object with a string `name` and an `arguments`.
fn hermes_call(body: &str) -> Option<ParsedCall> {
    let members = json_object(body)?;
    let name = json_string(members.last("name")?)?;
    let arguments = members.last("arguments")?.get().to_owned();
    Some(ParsedCall { name, arguments })
}

fn hermes_held_from(text: &str) -> usize {
    let cut = match text.find(HERMES_START) {
        Some(at) => at,
        None => text.len() - marker_overlap(text, HERMES_START),
    };
    if is_blank(&text[..cut]) {
        0
    } else {
        cut
    }
}

// ---------------------------------------------------------------------------------------------
// llama3_json
// ---------------------------------------------------------------------------------------------

const PYTHON_TAG: &str = "<|python_tag|>";
const LLAMA_END_TOKENS: [&str; 3] = ["<|eom_id|>", "<|eot_id|>", "<|end_of_text|>"];

fn llama_parse(output: &str) -> Parsed {
    if let Some(after_tag) = llama_candidate(output) {
        if !llama_validate(after_tag).passes {
            // `_single_pass_parse` hands the output back untouched.
            return Parsed::content_only(output);
        }
    }
    let scan = llama_scan(output);
    let calls: Vec<ParsedCall> = scan
        .objects
        .iter()
        .filter(|object| object.complete)
        .filter_map(|object| llama_call(object.text))
        .collect();
    let named = scan
        .objects
        .iter()
        .any(|object| vllm_finds_name(object.text));
    let mut content = scan.before;
    if !named {
        content.push_str(&scan.after);
    }
    if !scan.objects.is_empty() && is_blank(&content) {
        content.clear();
    }
    let content = if calls.is_empty() {
        non_empty(&content)
    } else {
        non_empty(py_strip(&content))
    };
    Parsed { content, calls }
}

/// The text after `<|python_tag|>` (or the whole output when it starts with `{`) when the
/// output is one the whole-output check applies to.
fn llama_candidate(output: &str) -> Option<&str> {
    if let Some(rest) = output.strip_prefix(PYTHON_TAG) {
        Some(rest)
    } else if output.starts_with('{') {
        Some(output)
    } else {
        None
    }
}

/// `_validate_complete_tool_output`'s answer for a text, and whether some continuation of
/// the text could still pass.
#[derive(Debug, Clone, Copy)]
struct Validation {
    passes: bool,
    viable: bool,
}

/// `_validate_complete_tool_output` on the text after the tag.
fn llama_validate(text: &str) -> Validation {
    let fail = Validation {
        passes: false,
        viable: false,
    };
    let skip_space = |mut pos: usize| {
        while let Some(c) = text[pos..].chars().next().filter(|&c| py_isspace(c)) {
            pos += c.len_utf8();
        }
        pos
    };
    let mut pos = 0;
    let mut found = false;
    loop {
        pos = skip_space(pos);
        if pos == text.len() {
            return Validation {
                passes: found,
                viable: true,
            };
        }
        match json_object_at(&text[pos..]) {
            JsonAt::Object(end, members) => {
                if !(members.has("name") && (members.has("arguments") || members.has("parameters")))
                {
                    return fail;
                }
                pos += end;
            }
            JsonAt::Open => {
                return Validation {
                    passes: false,
                    viable: true,
                }
            }
            JsonAt::Bad => return fail,
        }
        found = true;
        pos = skip_space(pos);
        let rest = &text[pos..];
        if rest.is_empty() {
            return Validation {
                passes: true,
                viable: true,
            };
        }
        for token in LLAMA_END_TOKENS {
            if let Some(after) = rest.strip_prefix(token) {
                if is_blank(after) {
                    return Validation {
                        passes: true,
                        viable: true,
                    };
                }
            }
        }
        if LLAMA_END_TOKENS.iter().any(|token| token.starts_with(rest)) {
            return Validation {
                passes: false,
                viable: true,
            };
        }
        if !rest.starts_with(';') {
            return fail;
        }
        pos += 1;
    }
}

/// One JSON value read from the start of a text (Python's `raw_decode`).
enum JsonAt<'a> {
    /// A complete object, ending at this byte index.
    Object(usize, Members<'a>),
    /// Not complete, but a continuation could make it an object.
    Open,
    /// No continuation makes it an object.
    Bad,
}

fn json_object_at(text: &str) -> JsonAt<'_> {
    if !text.starts_with('{') {
        return JsonAt::Bad;
    }
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Members<'_>>();
    match values.next() {
        Some(Ok(members)) => JsonAt::Object(values.byte_offset(), members),
        Some(Err(error)) if json_error_at_end(text, &error) => JsonAt::Open,
        Some(Err(_)) => JsonAt::Bad,
        None => JsonAt::Open,
    }
}

/// Whether a JSON error was met at the end of the text (so more text could mend it).
fn json_error_at_end(text: &str, error: &serde_json::Error) -> bool {
    if error.is_eof() {
        return true;
    }
    if error.line() == 0 {
        return false;
    }
    let line_start: usize = text
        .split_inclusive('\n')
        .take(error.line() - 1)
        .map(str::len)
        .sum();
    line_start + error.column() >= text.len()
}

/// One `{...}` of a call list, as the engine split it.
#[derive(Debug)]
struct LlamaObject<'a> {
    text: &'a str,
    complete: bool,
}

/// The engine's reading of an output.
#[derive(Debug, Default)]
struct LlamaScan<'a> {
    /// Content before the first object began.
    before: String,
    /// Content after the first object began (`_events_to_delta`'s deferred content).
    after: String,
    /// Whether an object has begun (vLLM's first `TOOL_CALL_START`).
    started: bool,
    objects: Vec<LlamaObject<'a>>,
}

impl LlamaScan<'_> {
    fn content(&mut self, text: &str) {
        if self.started {
            self.after.push_str(text);
        } else {
            self.before.push_str(text);
        }
    }
}

/// The engine's state machine (`StreamingParserEngine` with `SEMICOLON_SEQUENCE`).
#[derive(Debug, Default)]
struct LlamaMachine {
    in_list: bool,
    in_object: bool,
    had_object: bool,
    separator_seen: bool,
    object_start: usize,
    depth: usize,
    in_string: bool,
    escape: bool,
}

impl LlamaMachine {
    fn enter_list(&mut self) {
        *self = Self {
            in_list: true,
            ..Self::default()
        };
    }

    /// Text of `output[from..to]`, in whatever state the machine is.
    fn text<'a>(&mut self, output: &'a str, from: usize, to: usize, scan: &mut LlamaScan<'a>) {
        for (offset, c) in output[from..to].char_indices() {
            let pos = from + offset;
            if !self.in_list {
                scan.content(&output[pos..to]);
                return;
            }
            self.list_char(output, pos, c, scan);
        }
    }

    fn list_char<'a>(&mut self, output: &'a str, pos: usize, c: char, scan: &mut LlamaScan<'a>) {
        if self.in_object {
            if self.escape {
                self.escape = false;
            } else if self.in_string {
                match c {
                    '\\' => self.escape = true,
                    '"' => self.in_string = false,
                    _ => {}
                }
            } else {
                match c {
                    '"' => self.in_string = true,
                    '{' | '[' => self.depth += 1,
                    '}' | ']' => self.depth = self.depth.saturating_sub(1),
                    _ => {}
                }
            }
            if c == '}' && !self.in_string && !self.escape && self.depth == 0 {
                let text = &output[self.object_start..pos + 1];
                scan.objects.push(LlamaObject {
                    text,
                    complete: true,
                });
                self.in_object = false;
                self.had_object = true;
            }
            return;
        }
        let waiting_for_separator = self.had_object && !self.separator_seen;
        match c {
            ' ' | '\t' | '\r' | '\n' => {}
            ';' if waiting_for_separator => self.separator_seen = true,
            '{' if !waiting_for_separator => {
                self.in_object = true;
                self.object_start = pos;
                self.depth = 1;
                self.in_string = false;
                self.escape = false;
                self.separator_seen = false;
                scan.started = true;
            }
            _ => {
                *self = Self::default();
                scan.content(&output[pos..pos + c.len_utf8()]);
            }
        }
    }
}

/// The engine's pass over a whole output: content, and the call list's objects.
fn llama_scan(output: &str) -> LlamaScan<'_> {
    let mut scan = LlamaScan::default();
    let mut machine = LlamaMachine::default();
    if output.starts_with('{') {
        machine.enter_list();
    }
    let mut from = 0;
    loop {
        let tag = output[from..].find(PYTHON_TAG).map(|at| from + at);
        let to = tag.unwrap_or(output.len());
        machine.text(output, from, to, &mut scan);
        let Some(tag) = tag else { break };
        if machine.in_list {
            // No transition for a tag inside a call list: it is only text there.
            machine.text(output, tag, tag + PYTHON_TAG.len(), &mut scan);
        } else {
            machine.enter_list();
        }
        from = tag + PYTHON_TAG.len();
    }
    if machine.in_object {
        let text = &output[machine.object_start..];
        scan.objects.push(LlamaObject {
            text,
            complete: false,
        });
    }
    scan
}

/// Whether vLLM's `"name"\s*:\s*"([^"]*)"` finds a non-empty name in an object's text (its
/// leftmost match decides).
fn vllm_finds_name(text: &str) -> bool {
    const KEY: &str = "\"name\"";
    let mut from = 0;
    while let Some(at) = text[from..].find(KEY) {
        let start = from + at;
        from = start + 1;
        let rest = text[start + KEY.len()..].trim_start_matches(py_isspace);
        let Some(rest) = rest.strip_prefix(':') else {
            continue;
        };
        let rest = rest.trim_start_matches(py_isspace);
        let Some(rest) = rest.strip_prefix('"') else {
            continue;
        };
        if let Some(end) = rest.find('"') {
            return end > 0;
        }
    }
    false
}

/// One complete object's call, if it is one.
fn llama_call(text: &str) -> Option<ParsedCall> {
    let members = json_object(text)?;
    let name = json_string(members.first("name")?)?;
    let name = py_strip(&name);
    if name.is_empty() {
        return None;
    }
    let arguments = match members
        .first("arguments")
        .or_else(|| members.first("parameters"))
    {
        None => "{}".to_owned(),
        Some(raw) => match json_string(raw) {
            Some(inner) if serde_json::from_str::<serde::de::IgnoredAny>(&inner).is_ok() => inner,
            _ => raw.get().to_owned(),
        },
    };
    Some(ParsedCall {
        name: name.to_owned(),
        arguments,
    })
}

fn llama_held_from(text: &str) -> usize {
    if text.is_empty() || PYTHON_TAG.starts_with(text) {
        return 0;
    }
    if let Some(after_tag) = llama_candidate(text) {
        return if llama_validate(after_tag).viable {
            0
        } else {
            text.len()
        };
    }
    if text.starts_with(py_isspace) {
        return 0;
    }
    let cut = match text.find(PYTHON_TAG) {
        Some(at) => at,
        None => text.len() - marker_overlap(text, PYTHON_TAG),
    };
    text[..cut].trim_end_matches(py_isspace).len()
}

// ---------------------------------------------------------------------------------------------
// pythonic
// ---------------------------------------------------------------------------------------------

fn pythonic_parse(output: &str) -> Parsed {
    if pythonic_regex(output) == Match::Yes {
        if let Ok(calls) = PyParser::new(output).module() {
            return Parsed {
                content: None,
                calls,
            };
        }
    }
    Parsed::content_only(output)
}

fn pythonic_held_from(text: &str) -> usize {
    if text.is_empty() {
        return 0;
    }
    if !text.starts_with('[') || pythonic_regex(text) == Match::No {
        return text.len();
    }
    match PyParser::new(text).module() {
        Err(PyError::Invalid) => text.len(),
        Ok(_) | Err(PyError::Incomplete) => 0,
    }
}

/// Whether a text matches a regex at its start, or may once more text comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Match {
    Yes,
    No,
    More,
}

/// vLLM's `PythonicToolParser.TOOL_CALL_REGEX.match(text)`, emulated exactly:
///
/// ```text
/// \[([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s)?\),\s*)*
///   ([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s*)?\)\s*)+\]      (DOTALL)
/// ```
///
/// Each call is a name (an ASCII letter, then word characters) and `(`, then either `)` or a
/// `name=`. After the first `name=`, `.*` can take anything, so the match succeeds exactly
/// when a `)` followed by optional whitespace and `]` comes later. Calls with empty
/// parentheses are joined by `,` (directly after the `)`) until one is followed by whitespace
/// only; after that only `]` or another call may follow.
fn pythonic_regex(text: &str) -> Match {
    let s: Vec<char> = text.chars().collect();
    let is_word = |c: char| c == '_' || c.is_alphanumeric();
    if s.is_empty() {
        return Match::More;
    }
    if s[0] != '[' {
        return Match::No;
    }
    let mut i = 1;
    let mut joined_by_space = false;
    loop {
        match s.get(i) {
            None => return Match::More,
            Some(c) if c.is_ascii_alphabetic() => {}
            Some(_) => return Match::No,
        }
        while s.get(i).is_some_and(|&c| is_word(c)) {
            i += 1;
        }
        match s.get(i) {
            None => return Match::More,
            Some('(') => i += 1,
            Some(_) => return Match::No,
        }
        match s.get(i) {
            None => return Match::More,
            Some(c) if c.is_ascii_alphabetic() => {
                while s.get(i).is_some_and(|&c| is_word(c)) {
                    i += 1;
                }
                return match s.get(i) {
                    None => Match::More,
                    Some('=') if close_then_bracket(&s[i + 1..]) => Match::Yes,
                    Some('=') => Match::More,
                    Some(_) => Match::No,
                };
            }
            Some(')') => {
                i += 1;
                match s.get(i) {
                    None => return Match::More,
                    Some(',') if !joined_by_space => {
                        i += 1;
                        while s.get(i).is_some_and(|&c| py_isspace(c)) {
                            i += 1;
                        }
                    }
                    Some(_) => {
                        joined_by_space = true;
                        while s.get(i).is_some_and(|&c| py_isspace(c)) {
                            i += 1;
                        }
                        match s.get(i) {
                            None => return Match::More,
                            Some(']') => return Match::Yes,
                            Some(_) => {}
                        }
                    }
                }
            }
            Some(_) => return Match::No,
        }
    }
}

/// Whether `)`, optional whitespace and `]` occur in `s`.
fn close_then_bracket(s: &[char]) -> bool {
    let mut after_close = false;
    for &c in s {
        if c == ')' {
            after_close = true;
        } else if after_close && c == ']' {
            return true;
        } else if !(after_close && py_isspace(c)) {
            after_close = false;
        }
    }
    false
}

/// Why Python source is not (yet) a call list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PyError {
    /// It ends too soon: more text could make it one.
    Incomplete,
    /// It cannot become one, whatever follows.
    Invalid,
}

type PyResult<T> = Result<T, PyError>;

/// A Python literal, as `get_parameter_value` returns it.
#[derive(Debug, Clone)]
enum PyVal {
    None,
    Bool(bool),
    /// Decimal digits, with `-` when negative.
    Int(String),
    Float(f64),
    Str(String),
    List(Vec<PyVal>),
    Dict(Vec<(PyVal, PyVal)>),
}

/// Python's hard keywords: never a name.
const PY_KEYWORDS: [&str; 35] = [
    "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue",
    "def", "del", "elif", "else", "except", "finally", "for", "from", "global", "if", "import",
    "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return", "try", "while",
    "with", "yield",
];

/// Python's tokenizer refuses more nested brackets than this (`MAXLEVEL`); ferry counts
/// unary signs in as well, which bounds its recursion.
const PY_MAX_NESTING: usize = 200;

/// Python's integer-to-string digit limit (`sys.get_int_max_str_digits()`).
const PY_INT_MAX_DIGITS: usize = 4300;

fn is_ident_start(c: char) -> bool {
    c == '_' || c.is_alphabetic()
}

fn is_ident_continue(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

/// A recursive-descent reader of the Python subset a call list uses. Running out of text is
/// [`PyError::Incomplete`], anything else that is wrong [`PyError::Invalid`], so it also
/// answers whether a prefix can still become a call list.
#[derive(Debug)]
struct PyParser {
    s: Vec<char>,
    i: usize,
    /// Brackets and unary signs open around the cursor (bounds the recursion).
    nesting: usize,
}

impl PyParser {
    /// Python reads `\r\n` and `\r` as `\n`.
    fn new(source: &str) -> Self {
        let mut s = Vec::with_capacity(source.len());
        let mut chars = source.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '\r' {
                chars.next_if_eq(&'\n');
                s.push('\n');
            } else {
                s.push(c);
            }
        }
        Self {
            s,
            i: 0,
            nesting: 0,
        }
    }

    fn peek(&self) -> Option<char> {
        self.s.get(self.i).copied()
    }

    fn peek_at(&self, k: usize) -> Option<char> {
        self.s.get(self.i + k).copied()
    }

    /// The next character; running out is `Incomplete`.
    fn need(&self) -> PyResult<char> {
        self.peek().ok_or(PyError::Incomplete)
    }

    fn eat(&mut self, c: char) -> bool {
        let found = self.peek() == Some(c);
        if found {
            self.i += 1;
        }
        found
    }

    /// Skips a comment up to (not over) the end of its line.
    fn skip_comment(&mut self) {
        while self.peek().is_some_and(|c| c != '\n') {
            self.i += 1;
        }
    }

    /// Whitespace, newlines, comments and line continuations inside brackets.
    fn skip_trivia(&mut self) -> PyResult<()> {
        loop {
            match self.peek() {
                Some(' ' | '\t' | '\x0c' | '\n') => self.i += 1,
                Some('#') => self.skip_comment(),
                Some('\\') => match self.peek_at(1) {
                    Some('\n') => self.i += 2,
                    None => return Err(PyError::Incomplete),
                    Some(_) => return Err(PyError::Invalid),
                },
                _ => return Ok(()),
            }
        }
    }

    /// The whole source: the list of calls, then only whitespace, comments and one `;`.
    fn module(&mut self) -> PyResult<Vec<ParsedCall>> {
        if self.s.contains(&'\0') {
            return Err(PyError::Invalid);
        }
        if !self.eat('[') {
            return Err(PyError::Invalid);
        }
        self.nest()?;
        let mut calls = Vec::new();
        loop {
            self.skip_trivia()?;
            if self.eat(']') {
                break;
            }
            calls.push(self.call()?);
            self.skip_trivia()?;
            match self.need()? {
                ',' => self.i += 1,
                ']' => {
                    self.i += 1;
                    break;
                }
                _ => return Err(PyError::Invalid),
            }
        }
        let mut same_line = true;
        let mut semicolon = false;
        loop {
            match self.peek() {
                None => return Ok(calls),
                Some(' ' | '\t' | '\x0c') => self.i += 1,
                Some('\n') => {
                    same_line = false;
                    self.i += 1;
                }
                Some('#') => self.skip_comment(),
                Some(';') if same_line && !semicolon => {
                    semicolon = true;
                    self.i += 1;
                }
                Some(_) => return Err(PyError::Invalid),
            }
        }
    }

    /// An identifier that is not a keyword.
    fn name(&mut self) -> PyResult<String> {
        let ident = self.ident()?;
        if PY_KEYWORDS.contains(&ident.as_str()) {
            return Err(PyError::Invalid);
        }
        Ok(ident)
    }

    /// An identifier; one that runs to the end of the text may still grow.
    fn ident(&mut self) -> PyResult<String> {
        if !is_ident_start(self.need()?) {
            return Err(PyError::Invalid);
        }
        let start = self.i;
        while self.peek().is_some_and(is_ident_continue) {
            self.i += 1;
        }
        if self.peek().is_none() {
            return Err(PyError::Incomplete);
        }
        Ok(self.s[start..self.i].iter().collect())
    }

    /// `name(...)` or `a.b.name(...)` (`handle_single_tool`).
    fn call(&mut self) -> PyResult<ParsedCall> {
        let mut name = self.name()?;
        loop {
            self.skip_trivia()?;
            match self.need()? {
                '.' => {
                    self.i += 1;
                    self.skip_trivia()?;
                    name.push('.');
                    name.push_str(&self.name()?);
                }
                '(' => {
                    self.i += 1;
                    self.nest()?;
                    break;
                }
                _ => return Err(PyError::Invalid),
            }
        }
        let mut keywords: Vec<(String, PyVal)> = Vec::new();
        loop {
            self.skip_trivia()?;
            match self.need()? {
                ')' => {
                    self.i += 1;
                    break;
                }
                '*' => return Err(PyError::Invalid),
                _ => {}
            }
            if let Some(keyword) = self.keyword()? {
                if keywords.iter().any(|(k, _)| *k == keyword) {
                    return Err(PyError::Invalid);
                }
                self.skip_trivia()?;
                let (value, _) = self.value()?;
                keywords.push((keyword, value));
            } else {
                if !keywords.is_empty() {
                    // Positional argument follows keyword argument.
                    return Err(PyError::Invalid);
                }
                // vLLM reads only `call.keywords`: a positional argument is dropped.
                self.value()?;
            }
            self.skip_trivia()?;
            match self.need()? {
                ',' => self.i += 1,
                ')' => {
                    self.i += 1;
                    break;
                }
                _ => return Err(PyError::Invalid),
            }
        }
        self.nesting -= 1;
        let mut arguments = String::from("{");
        for (n, (keyword, value)) in keywords.iter().enumerate() {
            if n > 0 {
                arguments.push_str(", ");
            }
            crate::pyjson::write_str(keyword, false, &mut arguments);
            arguments.push_str(": ");
            dump_json(value, &mut arguments);
        }
        arguments.push('}');
        Ok(ParsedCall { name, arguments })
    }

    /// `name =` (not `==`) at the cursor: the keyword, with the cursor after the `=`.
    /// Otherwise the cursor stays put.
    fn keyword(&mut self) -> PyResult<Option<String>> {
        if !self.peek().is_some_and(is_ident_start) || self.string_prefix()?.is_some() {
            return Ok(None);
        }
        let start = self.i;
        let ident = self.ident()?;
        self.skip_trivia()?;
        match (self.need()?, self.peek_at(1)) {
            ('=', None) => Err(PyError::Incomplete),
            ('=', Some(next)) if next != '=' => {
                if PY_KEYWORDS.contains(&ident.as_str()) {
                    return Err(PyError::Invalid);
                }
                self.i += 1;
                Ok(Some(ident))
            }
            _ => {
                self.i = start;
                Ok(None)
            }
        }
    }

    /// One more bracket or sign open; too many is an error, as in Python.
    fn nest(&mut self) -> PyResult<()> {
        if self.nesting >= PY_MAX_NESTING {
            return Err(PyError::Invalid);
        }
        self.nesting += 1;
        Ok(())
    }

    /// A literal value, and whether it is an `ast.Constant` (a possible dict key).
    fn value(&mut self) -> PyResult<(PyVal, bool)> {
        let nests = matches!(self.need()?, '[' | '(' | '{' | '-' | '+');
        if nests {
            self.nest()?;
        }
        let value = self.value_inner()?;
        if nests {
            self.nesting -= 1;
        }
        Ok(value)
    }

    fn value_inner(&mut self) -> PyResult<(PyVal, bool)> {
        match self.need()? {
            sign @ ('-' | '+') => {
                self.i += 1;
                self.skip_trivia()?;
                let value = match self.value()?.0 {
                    PyVal::Int(digits) if sign == '-' => PyVal::Int(negate(digits)),
                    PyVal::Float(f) if sign == '-' => PyVal::Float(-f),
                    value @ (PyVal::Int(_) | PyVal::Float(_)) => value,
                    _ => return Err(PyError::Invalid),
                };
                Ok((value, false))
            }
            '[' => {
                self.i += 1;
                Ok((PyVal::List(self.items(']')?), false))
            }
            '(' => self.parenthesized(),
            '{' => self.braced(),
            '"' | '\'' => self.strings(),
            '0'..='9' => Ok((self.number()?, true)),
            '.' => match self.peek_at(1) {
                Some('0'..='9') => Ok((self.number()?, true)),
                None => Err(PyError::Incomplete),
                Some(_) => Err(PyError::Invalid),
            },
            c if is_ident_start(c) => {
                if self.string_prefix()?.is_some() {
                    return self.strings();
                }
                match self.ident()?.as_str() {
                    "True" => Ok((PyVal::Bool(true), true)),
                    "False" => Ok((PyVal::Bool(false), true)),
                    "None" => Ok((PyVal::None, true)),
                    // `_JSON_NAME_LITERALS`: names, so no dict keys.
                    "true" => Ok((PyVal::Bool(true), false)),
                    "false" => Ok((PyVal::Bool(false), false)),
                    "null" => Ok((PyVal::None, false)),
                    _ => Err(PyError::Invalid),
                }
            }
            _ => Err(PyError::Invalid),
        }
    }

    /// Comma-separated values up to `close` (the opener already read).
    fn items(&mut self, close: char) -> PyResult<Vec<PyVal>> {
        let mut items = Vec::new();
        loop {
            self.skip_trivia()?;
            if self.eat(close) {
                return Ok(items);
            }
            items.push(self.value()?.0);
            self.skip_trivia()?;
            match self.need()? {
                ',' => self.i += 1,
                c if c == close => {
                    self.i += 1;
                    return Ok(items);
                }
                _ => return Err(PyError::Invalid),
            }
        }
    }

    /// `(value)` (the value itself), or a tuple (a list).
    fn parenthesized(&mut self) -> PyResult<(PyVal, bool)> {
        self.i += 1;
        self.skip_trivia()?;
        if self.eat(')') {
            return Ok((PyVal::List(Vec::new()), false));
        }
        let first = self.value()?;
        self.skip_trivia()?;
        match self.need()? {
            ')' => {
                self.i += 1;
                Ok(first)
            }
            ',' => {
                self.i += 1;
                let mut items = vec![first.0];
                items.extend(self.items(')')?);
                Ok((PyVal::List(items), false))
            }
            _ => Err(PyError::Invalid),
        }
    }

    /// A dict, or a set (a list).
    fn braced(&mut self) -> PyResult<(PyVal, bool)> {
        self.i += 1;
        self.skip_trivia()?;
        if self.eat('}') {
            return Ok((PyVal::Dict(Vec::new()), false));
        }
        if self.need()? == '*' {
            return Err(PyError::Invalid);
        }
        let (first, first_constant) = self.value()?;
        self.skip_trivia()?;
        match self.need()? {
            ':' => {}
            ',' => {
                self.i += 1;
                let mut items = vec![first];
                items.extend(self.items('}')?);
                return Ok((PyVal::List(items), false));
            }
            '}' => {
                self.i += 1;
                return Ok((PyVal::List(vec![first]), false));
            }
            _ => return Err(PyError::Invalid),
        }
        let mut entries: Vec<(PyVal, PyVal)> = Vec::new();
        let (mut key, mut key_constant) = (first, first_constant);
        loop {
            // At the `:`.
            self.i += 1;
            self.skip_trivia()?;
            let (value, _) = self.value()?;
            if !key_constant {
                return Err(PyError::Invalid);
            }
            match entries.iter_mut().find(|(k, _)| py_key_eq(k, &key)) {
                Some(entry) => entry.1 = value,
                None => entries.push((key, value)),
            }
            self.skip_trivia()?;
            match self.need()? {
                '}' => {
                    self.i += 1;
                    return Ok((PyVal::Dict(entries), false));
                }
                ',' => self.i += 1,
                _ => return Err(PyError::Invalid),
            }
            self.skip_trivia()?;
            if self.eat('}') {
                return Ok((PyVal::Dict(entries), false));
            }
            if self.need()? == '*' {
                return Err(PyError::Invalid);
            }
            (key, key_constant) = self.value()?;
            self.skip_trivia()?;
            if self.need()? != ':' {
                return Err(PyError::Invalid);
            }
        }
    }

    /// The length of a string prefix (`r`, `u`, `f`, `b`, `br`, `rb`, `fr`, `rf`, any case)
    /// when a string literal starts at the cursor.
    fn string_prefix(&self) -> PyResult<Option<usize>> {
        const VALID: [&str; 8] = ["r", "u", "f", "b", "br", "rb", "fr", "rf"];
        let mut k = 0;
        while k < 2 && self.peek_at(k).is_some_and(|c| "rRuUfFbB".contains(c)) {
            k += 1;
        }
        let prefix: String = self.s[self.i..self.i + k]
            .iter()
            .collect::<String>()
            .to_lowercase();
        let valid = k == 0 || VALID.contains(&prefix.as_str());
        match self.peek_at(k) {
            Some('"' | '\'') if valid => Ok(Some(k)),
            None if k > 0 && valid => Err(PyError::Incomplete),
            _ => Ok(None),
        }
    }

    /// One or more adjacent string literals, concatenated. A constant unless one is an
    /// f-string (then a `JoinedStr`, still a string when it has no placeholders).
    fn strings(&mut self) -> PyResult<(PyVal, bool)> {
        let mut text = String::new();
        let mut any_f = false;
        while let Some(k) = self.string_prefix()? {
            let prefix: String = self.s[self.i..self.i + k]
                .iter()
                .collect::<String>()
                .to_lowercase();
            if prefix.contains('b') {
                // Bytes: no JSON value.
                return Err(PyError::Invalid);
            }
            let f = prefix.contains('f');
            any_f |= f;
            self.i += k;
            self.string_body(prefix.contains('r'), f, &mut text)?;
            self.skip_trivia()?;
        }
        Ok((PyVal::Str(text), !any_f))
    }

    /// One string literal from its opening quote, its value appended to `out`.
    fn string_body(&mut self, raw: bool, f: bool, out: &mut String) -> PyResult<()> {
        let quote = self.need()?;
        let triple = match (self.peek_at(1), self.peek_at(2)) {
            (Some(a), Some(b)) => a == quote && b == quote,
            // `''` at the very end: an empty string, or the start of `'''`.
            (None, _) => return Err(PyError::Incomplete),
            (Some(a), None) if a == quote => return Err(PyError::Incomplete),
            (Some(_), None) => false,
        };
        self.i += if triple { 3 } else { 1 };
        loop {
            let c = self.need()?;
            if c == quote {
                if !triple {
                    self.i += 1;
                    return Ok(());
                }
                match (self.peek_at(1), self.peek_at(2)) {
                    (Some(a), Some(b)) if a == quote && b == quote => {
                        self.i += 3;
                        return Ok(());
                    }
                    (None, _) => return Err(PyError::Incomplete),
                    (Some(a), None) if a == quote => return Err(PyError::Incomplete),
                    _ => {
                        out.push(c);
                        self.i += 1;
                        continue;
                    }
                }
            }
            match c {
                '\n' if !triple => return Err(PyError::Invalid),
                '\\' => {
                    let next = self.peek_at(1).ok_or(PyError::Incomplete)?;
                    if f && (next == '{' || next == '}') {
                        // The backslash stays; the brace is read as a brace.
                        out.push('\\');
                        self.i += 1;
                    } else if raw {
                        out.push('\\');
                        out.push(next);
                        self.i += 2;
                    } else {
                        self.i += 2;
                        self.escape(next, out)?;
                    }
                }
                '{' | '}' if f => {
                    // `{{` and `}}` are braces; anything else is a placeholder (or an error).
                    match self.peek_at(1) {
                        Some(next) if next == c => {
                            out.push(c);
                            self.i += 2;
                        }
                        None => return Err(PyError::Incomplete),
                        Some(_) => return Err(PyError::Invalid),
                    }
                }
                _ => {
                    out.push(c);
                    self.i += 1;
                }
            }
        }
    }

    /// The escape `\` `c` (both read) in a non-raw string.
    fn escape(&mut self, c: char, out: &mut String) -> PyResult<()> {
        let simple = match c {
            '\n' => return Ok(()),
            '\\' | '\'' | '"' => c,
            'a' => '\x07',
            'b' => '\x08',
            'f' => '\x0c',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'v' => '\x0b',
            '0'..='7' => {
                let mut value = c.to_digit(8).unwrap_or(0);
                for _ in 0..2 {
                    match self.peek().and_then(|d| d.to_digit(8)) {
                        Some(d) => {
                            value = value * 8 + d;
                            self.i += 1;
                        }
                        None => break,
                    }
                }
                char::from_u32(value).ok_or(PyError::Invalid)?
            }
            'x' | 'u' | 'U' => {
                let width = match c {
                    'x' => 2,
                    'u' => 4,
                    _ => 8,
                };
                let mut value: u32 = 0;
                for _ in 0..width {
                    let digit = self.need()?.to_digit(16).ok_or(PyError::Invalid)?;
                    value = value * 16 + digit;
                    self.i += 1;
                }
                // A surrogate or a value past U+10FFFF: not representable here.
                char::from_u32(value).ok_or(PyError::Invalid)?
            }
            // `\N{...}` needs Unicode's name table: not read here.
            'N' => return Err(PyError::Invalid),
            other => {
                out.push('\\');
                other
            }
        };
        out.push(simple);
        Ok(())
    }

    /// Digits of `radix` with single `_` between them (at least one digit).
    fn digits(&mut self, radix: u32, out: &mut String) -> PyResult<()> {
        if !self.need()?.is_digit(radix) {
            return Err(PyError::Invalid);
        }
        loop {
            match self.peek() {
                Some(c) if c.is_digit(radix) => {
                    out.push(c);
                    self.i += 1;
                }
                Some('_') => {
                    self.i += 1;
                    if !self.need()?.is_digit(radix) {
                        return Err(PyError::Invalid);
                    }
                }
                _ => return Ok(()),
            }
        }
    }

    /// An int or float literal (no sign).
    fn number(&mut self) -> PyResult<PyVal> {
        let radix = match (self.peek(), self.peek_at(1)) {
            (Some('0'), Some('x' | 'X')) => 16,
            (Some('0'), Some('o' | 'O')) => 8,
            (Some('0'), Some('b' | 'B')) => 2,
            _ => 10,
        };
        let value = if radix != 10 {
            self.i += 2;
            if self.peek() == Some('_') {
                self.i += 1;
            }
            let mut digits = String::new();
            self.digits(radix, &mut digits)?;
            PyVal::Int(radix_to_decimal(&digits, radix))
        } else {
            let mut int_part = String::new();
            if self.peek() != Some('.') {
                self.digits(10, &mut int_part)?;
            }
            let mut literal = int_part.clone();
            let mut is_float = false;
            if self.peek() == Some('.') {
                self.i += 1;
                is_float = true;
                literal.push('.');
                if self.peek().is_some_and(|c| c.is_ascii_digit()) {
                    self.digits(10, &mut literal)?;
                }
            }
            if let Some(e @ ('e' | 'E')) = self.peek() {
                self.i += 1;
                is_float = true;
                literal.push(e);
                if let Some(sign @ ('+' | '-')) = self.peek() {
                    self.i += 1;
                    literal.push(sign);
                }
                self.digits(10, &mut literal)?;
            }
            if is_float {
                let f: f64 = literal.parse().map_err(|_| PyError::Invalid)?;
                if !f.is_finite() {
                    return Err(PyError::Invalid);
                }
                PyVal::Float(f)
            } else {
                if int_part.len() > 1
                    && int_part.starts_with('0')
                    && int_part.contains(|c| c != '0')
                {
                    // Leading zeros in a decimal integer literal.
                    return Err(PyError::Invalid);
                }
                PyVal::Int(normalize_int(&int_part))
            }
        };
        match self.peek() {
            // A complex number, or a number run into a name.
            Some(c) if is_ident_continue(c) => Err(PyError::Invalid),
            _ => match &value {
                PyVal::Int(digits) if digits.trim_start_matches('-').len() > PY_INT_MAX_DIGITS => {
                    Err(PyError::Invalid)
                }
                _ => Ok(value),
            },
        }
    }
}

/// Decimal digits without leading zeros.
fn normalize_int(digits: &str) -> String {
    let trimmed = digits.trim_start_matches('0');
    if trimmed.is_empty() {
        "0".to_owned()
    } else {
        trimmed.to_owned()
    }
}

/// `-n` for a decimal int (`-0` is `0`).
fn negate(digits: String) -> String {
    match digits.strip_prefix('-') {
        Some(positive) => positive.to_owned(),
        None if digits == "0" => digits,
        None => format!("-{digits}"),
    }
}

/// Digits in base 2, 8 or 16 as a decimal string, at any size.
fn radix_to_decimal(digits: &str, radix: u32) -> String {
    const LIMB: u64 = 1_000_000_000;
    let mut limbs: Vec<u64> = vec![0];
    for d in digits.chars().filter_map(|c| c.to_digit(radix)) {
        let mut carry = u64::from(d);
        for limb in &mut limbs {
            let v = *limb * u64::from(radix) + carry;
            *limb = v % LIMB;
            carry = v / LIMB;
        }
        while carry > 0 {
            limbs.push(carry % LIMB);
            carry /= LIMB;
        }
    }
    let mut out = String::new();
    for (n, limb) in limbs.iter().rev().enumerate() {
        if n == 0 {
            out.push_str(&limb.to_string());
        } else {
            out.push_str(&format!("{limb:09}"));
        }
    }
    out
}

/// Python's `==` on dict keys (`1 == 1.0 == True`).
fn py_key_eq(a: &PyVal, b: &PyVal) -> bool {
    fn number(v: &PyVal) -> Option<String> {
        match v {
            PyVal::Bool(b) => Some(if *b { "1" } else { "0" }.to_owned()),
            PyVal::Int(digits) => Some(digits.clone()),
            PyVal::Float(f) if f.fract() == 0.0 => Some(normalize_signed(&format!("{f:.0}"))),
            PyVal::Float(f) => Some(format!("float:{}", f.to_bits())),
            _ => None,
        }
    }
    fn normalize_signed(s: &str) -> String {
        match s.strip_prefix('-') {
            Some("0") => "0".to_owned(),
            _ => s.to_owned(),
        }
    }
    match (a, b) {
        (PyVal::Str(x), PyVal::Str(y)) => x == y,
        (PyVal::None, PyVal::None) => true,
        _ => matches!((number(a), number(b)), (Some(x), Some(y)) if x == y),
    }
}

/// `json.dumps(value, ensure_ascii=False)`.
fn dump_json(value: &PyVal, out: &mut String) {
    match value {
        PyVal::None => out.push_str("null"),
        PyVal::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        PyVal::Int(digits) => out.push_str(digits),
        PyVal::Float(f) => out.push_str(&crate::pyjson::float_repr(*f)),
        PyVal::Str(s) => crate::pyjson::write_str(s, false, out),
        PyVal::List(items) => {
            out.push('[');
            for (n, item) in items.iter().enumerate() {
                if n > 0 {
                    out.push_str(", ");
                }
                dump_json(item, out);
            }
            out.push(']');
        }
        PyVal::Dict(entries) => {
            out.push('{');
            for (n, (key, value)) in entries.iter().enumerate() {
                if n > 0 {
                    out.push_str(", ");
                }
                // `json.dumps` writes int, float, bool and None keys as strings.
                let key = match key {
                    PyVal::Str(s) => s.clone(),
                    PyVal::Int(digits) => digits.clone(),
                    PyVal::Float(f) => crate::pyjson::float_repr(*f),
                    PyVal::Bool(b) => if *b { "true" } else { "false" }.to_owned(),
                    PyVal::None => "null".to_owned(),
                    PyVal::List(_) | PyVal::Dict(_) => String::new(),
                };
                crate::pyjson::write_str(&key, false, out);
                out.push_str(": ");
                dump_json(value, out);
            }
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_vllms_aliases_find_their_parser() {
        for parser in ToolCallParser::ALL {
            assert_eq!(ToolCallParser::from_name(parser.name()), Some(parser));
        }
        assert_eq!(
            ToolCallParser::from_name("qwen3_json"),
            Some(ToolCallParser::Hermes)
        );
        assert_eq!(
            ToolCallParser::from_name("llama4_json"),
            Some(ToolCallParser::Llama3Json)
        );
        assert_eq!(ToolCallParser::from_name("mistral"), None);
    }

    /// One hand-written output and what vLLM 0.34 returns for it.
    struct Case {
        output: &'static str,
        content: Option<&'static str>,
        calls: &'static [(&'static str, &'static str)],
    }

    const fn case(
        output: &'static str,
        content: Option<&'static str>,
        calls: &'static [(&'static str, &'static str)],
    ) -> Case {
        Case {
            output,
            content,
            calls,
        }
    }

    /// No calls; the whole output is the content.
    const fn text(output: &'static str) -> Case {
        case(output, Some(output), &[])
    }

    fn check(parser: ToolCallParser, cases: &[Case]) {
        for c in cases {
            let expected = Parsed {
                content: c.content.map(str::to_owned),
                calls: c
                    .calls
                    .iter()
                    .map(|(name, arguments)| ParsedCall {
                        name: (*name).to_owned(),
                        arguments: (*arguments).to_owned(),
                    })
                    .collect(),
            };
            assert_eq!(
                parser.parse(c.output),
                expected,
                "{} on {:?}",
                parser.name(),
                c.output
            );
            for call in &expected.calls {
                assert!(
                    serde_json::from_str::<serde::de::IgnoredAny>(&call.arguments).is_ok(),
                    "arguments are JSON: {:?}",
                    call.arguments
                );
            }
        }
    }

    const HERMES_CASES: &[Case] = &[
        // No `<tool_call>`: the whole output is the content.
        text("The weather in Paris is sunny."),
        // Text, then one call: the content is the text before the first `<tool_call>`, not
        // stripped; the arguments are the model's own text (ferry's difference).
        case(
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>",
            Some("Let me check.\n"),
            &[("get_weather", r#"{"city": "Paris", "days": 3}"#)],
        ),
        // Several calls; the arguments keep their spacing (vLLM's `json.dumps` would write
        // `{"x": [1, 2]}`).
        case(
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\":[1,2]}}\n</tool_call>",
            None,
            &[("a", "{}"), ("b", r#"{"x":[1,2]}"#)],
        ),
        // Text between and after the regions is ignored; content is what precedes the first.
        case(
            "A<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call> middle <tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call> tail",
            Some("A"),
            &[("a", "{}"), ("b", "{}")],
        ),
        // `<tool_call>(.*)`: a call cut off at the end whose JSON is incomplete fails
        // `json.loads`, so the whole output is content.
        text("Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par"),
        // ... and one whose JSON happens to be complete parses.
        case(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n",
            None,
            &[("get_weather", r#"{"city": "Paris"}"#)],
        ),
        // A partial closing tag is part of the `(.*)` region: extra data, content.
        text("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_"),
        // Malformed JSON in any region: no calls at all, the whole output is content.
        text("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {x: 1}}</tool_call>"),
        // Missing `name`, missing `arguments`, a name that is no string (pydantic `str`): content.
        text("<tool_call>{\"arguments\": {}}</tool_call>"),
        text("<tool_call>{\"name\": \"f\"}</tool_call>"),
        text("<tool_call>{\"name\": 7, \"arguments\": {}}</tool_call>"),
        // The region must be a JSON object: an empty region and an array are content.
        text("<tool_call></tool_call>"),
        text("<tool_call>[{\"name\": \"f\", \"arguments\": {}}]</tool_call>"),
        // Arguments as an object with nested values and unicode, kept byte for byte.
        case(
            "<tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"naïve café ☕\", \"filters\": {\"tags\": [\"日本\", null, true], \"max\": 1.5e3}}}</tool_call>",
            None,
            &[("search", r#"{"q": "naïve café ☕", "filters": {"tags": ["日本", null, true], "max": 1.5e3}}"#)],
        ),
        // Content that is only whitespace before the calls becomes `None`
        // (`DelegatingParser._extract_tool_calls`).
        case(
            "  \n<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
            None,
            &[("f", "{}")],
        ),
        // `arguments` may be any JSON value: a string stays a JSON string, `null` is `null`.
        case(
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
            None,
            &[("f", r#""{\"a\": 1}""#)],
        ),
        case("<tool_call>{\"name\": \"f\", \"arguments\": null}</tool_call>", None, &[("f", "null")]),
        // `json.loads` keeps the last of duplicate keys.
        case(
            "<tool_call>{\"name\": \"a\", \"name\": \"b\", \"arguments\": 1, \"arguments\": {\"z\": 0}}</tool_call>",
            None,
            &[("b", r#"{"z": 0}"#)],
        ),
        // Ferry's difference: serde_json rejects `NaN`, which Python's `json` reads.
        text("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": NaN}}</tool_call>"),
    ];

    const LLAMA_CASES: &[Case] = &[
        // No tag, no `{` start: everything is content.
        text("It is 21 degrees in Paris."),
        // `<|python_tag|>` then an object with `parameters`; nothing else is content: `None`.
        case(
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
            None,
            &[("get_weather", r#"{"city": "Paris"}"#)],
        ),
        // An output starting with `{` is read as if `<|python_tag|>` came first; `arguments`.
        case(
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
            None,
            &[("get_weather", r#"{"city": "Paris"}"#)],
        ),
        // `;`-separated calls, and a trailing `;`.
        case(
            "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": [1, 2]}}",
            None,
            &[("a", "{}"), ("b", r#"{"x": [1, 2]}"#)],
        ),
        case(
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {}};{\"name\": \"b\", \"parameters\": {}};",
            None,
            &[("a", "{}"), ("b", "{}")],
        ),
        // A trailing end token passes the check and is text after the call list, which is
        // dropped once a call was named.
        case(
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": 1}}<|eot_id|>",
            None,
            &[("f", r#"{"a": 1}"#)],
        ),
        case("{\"name\": \"f\", \"parameters\": {}}\n<|eom_id|>\n", None, &[("f", "{}")]),
        // Anything but whitespace after the end token fails the check: all content.
        text("{\"name\": \"f\", \"parameters\": {}}<|eot_id|> done"),
        // Text before the tag is content, stripped because calls follow.
        case(
            "Let me look that up. <|python_tag|>{\"name\": \"search\", \"parameters\": {\"q\": \"rust\"}}",
            Some("Let me look that up."),
            &[("search", r#"{"q": "rust"}"#)],
        ),
        // Content before the tag that is only whitespace: dropped, `None`.
        case("  \n<|python_tag|>{\"name\": \"f\", \"parameters\": {}}", None, &[("f", "{}")]),
        // A call cut off at the end of an output that starts with the tag or `{` fails the
        // whole-output check: all content.
        text("{\"name\": \"f\", \"parameters\": {\"a\""),
        text("<|python_tag|>{\"name\": \"f\","),
        // Cut off after text: the engine drops the incomplete markup (`_extract_tool_calls`
        // returns the engine's content); no stripping without calls.
        case("Checking. <|python_tag|>{\"na", Some("Checking. "), &[]),
        // Same with the name complete: vLLM returns `f` with arguments `{"a": 1`, which is not
        // JSON; ferry drops that call (its difference) and keeps vLLM's content.
        case(
            "Checking. <|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": 1",
            Some("Checking. "),
            &[],
        ),
        // Malformed JSON, or no `parameters`/`arguments`, or no `name`: the check fails.
        text("{\"name\": \"f\", \"parameters\": {a: 1}}"),
        text("{\"name\": \"f\"}"),
        text("<|python_tag|>{\"parameters\": {}}"),
        // Two objects need a `;` between them.
        text("{\"name\": \"a\", \"parameters\": {}} {\"name\": \"b\", \"parameters\": {}}"),
        // Leading whitespace is not skipped: not a call list, plain content.
        text(" {\"name\": \"f\", \"parameters\": {}}"),
        // The tag alone: the check finds no object and fails: the output is the content.
        text("<|python_tag|>"),
        // Empty output: the engine's content is empty, `or None`.
        case("", None, &[]),
        // Arguments given as a JSON string: vLLM returns the string's text.
        case(
            "{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}",
            None,
            &[("f", r#"{"a": 1}"#)],
        ),
        // ... unless that text is not JSON: ferry keeps the JSON string (vLLM: `hello`).
        case("{\"name\": \"f\", \"arguments\": \"hello\"}", None, &[("f", r#""hello""#)]),
        // `arguments` wins over `parameters`; the name is stripped.
        case(
            "<|python_tag|>{\"name\": \" f \", \"parameters\": {\"p\": 1}, \"arguments\": {\"a\": 2}}",
            None,
            &[("f", r#"{"a": 2}"#)],
        ),
        // Text after the call list (a character that is no `;`, `{` or whitespace) is
        // dropped once a call was named.
        case(
            "Here: <|python_tag|>{\"name\": \"f\", \"parameters\": {}} and more",
            Some("Here:"),
            &[("f", "{}")],
        ),
        // With no named object that text stays, after the text before the list; the object
        // is markup and goes.
        case("Hi <|python_tag|>{\"foo\": 1} bye", Some("Hi bye"), &[]),
        // Text right after the tag is content again; the tag itself is dropped.
        case("Hi <|python_tag|>not json", Some("Hi not json"), &[]),
        // A tag inside an open call list is only text: it ends the list, and what follows is
        // content (then dropped, a call having been named).
        case(
            "Hi <|python_tag|>{\"name\": \"a\", \"parameters\": {}}<|python_tag|>{\"name\": \"b\", \"parameters\": {}}",
            Some("Hi"),
            &[("a", "{}")],
        ),
        // After text ended a list, a new tag opens a new one.
        case(
            "Hi <|python_tag|>{\"name\": \"a\", \"parameters\": {}} then <|python_tag|>{\"name\": \"b\", \"parameters\": {}}",
            Some("Hi"),
            &[("a", "{}"), ("b", "{}")],
        ),
        // An empty name is no call, and the text after the list is not dropped.
        case(
            "<|python_tag|>{\"name\": \"\", \"parameters\": {}}<|eot_id|>",
            Some("<|eot_id|>"),
            &[],
        ),
        // Nested values and unicode, kept as written.
        case(
            "<|python_tag|>{\"name\": \"translate\", \"parameters\": {\"text\": \"Grüße, 世界\", \"opts\": {\"to\": [\"fr\", \"ja\"], \"formal\": true}}}",
            None,
            &[("translate", r#"{"text": "Grüße, 世界", "opts": {"to": ["fr", "ja"], "formal": true}}"#)],
        ),
        // A brace inside a string does not end the object.
        case(
            "{\"name\": \"echo\", \"parameters\": {\"s\": \"}{\\\"\"}}",
            None,
            &[("echo", r#"{"s": "}{\""}"#)],
        ),
    ];

    const PYTHONIC_CASES: &[Case] = &[
        // Not a list: content.
        text("No tools needed."),
        // One call; keyword arguments, `json.dumps` spacing.
        case(
            "[get_weather(city='San Francisco', metric=\"celsius\")]",
            None,
            &[("get_weather", r#"{"city": "San Francisco", "metric": "celsius"}"#)],
        ),
        // Several calls; nested lists, tuples (lists), dicts, sets (lists, source order), and
        // a negative float (unary minus).
        case(
            "[search(query='rust', limit=10), plot(points=[(1, 2), (3, -4.5)], style={'color': 'red', 'width': 2, 'tags': {'a', 'b'}})]",
            None,
            &[
                ("search", r#"{"query": "rust", "limit": 10}"#),
                ("plot", r#"{"points": [[1, 2], [3, -4.5]], "style": {"color": "red", "width": 2, "tags": ["a", "b"]}}"#),
            ],
        ),
        // `_JSON_NAME_LITERALS` and Python's constants.
        case(
            "[f(a=true, b=false, c=null, d=True, e=None)]",
            None,
            &[("f", r#"{"a": true, "b": false, "c": null, "d": true, "e": null}"#)],
        ),
        // Strings: escaped quotes, escapes, raw, hex/unicode escapes, triple quotes with a
        // newline, implicit concatenation, an f-string with no placeholder, non-ASCII kept.
        case(
            r#"[f(a='It\'s', b="say \"hi\"", c='tab\there\n', d=r'C:\temp\new', e='\x41\u00e9\U0001F600', f='''two
lines''', g='con' "cat", h=f'{{x}}', i='\\', j='日本')]"#,
            None,
            &[(
                "f",
                r#"{"a": "It's", "b": "say \"hi\"", "c": "tab\there\n", "d": "C:\\temp\\new", "e": "Aé😀", "f": "two\nlines", "g": "concat", "h": "{x}", "i": "\\", "j": "日本"}"#,
            )],
        ),
        // Control characters are `\u00XX`; U+2028 stays as is (`ensure_ascii=False`).
        case(
            "[f(a='\\x00\\x1f\u{2028}')]",
            None,
            &[("f", "{\"a\": \"\\u0000\\u001f\u{2028}\"}")],
        ),
        // Numbers: Python's float repr, ints of any size, hex/octal/binary, `_`, signs.
        case(
            "[f(a=1.0, b=0.00001, c=1e16, d=2.50, e=.5, f=-3.25, g=1_000.5, h=0xFF, i=123456789012345678901234567890, j=-0, k=1e15, l=0.1, m=-1e-7, n=+7, o=0o17, p=0b101)]",
            None,
            &[(
                "f",
                r#"{"a": 1.0, "b": 1e-05, "c": 1e+16, "d": 2.5, "e": 0.5, "f": -3.25, "g": 1000.5, "h": 255, "i": 123456789012345678901234567890, "j": 0, "k": 1000000000000000.0, "l": 0.1, "m": -1e-07, "n": 7, "o": 15, "p": 5}"#,
            )],
        ),
        // Dict keys: constants, written as JSON strings; `1` and `True` are one key (the first
        // key, the last value); a repeated key keeps its place.
        case(
            "[f(d={1: 'a', True: 'b', 2.5: 'c', None: 'd', 'k': 1, 'k': 2})]",
            None,
            &[("f", r#"{"d": {"1": "b", "2.5": "c", "null": "d", "k": 2}}"#)],
        ),
        // Text before the list: the regex matches at the start only.
        text("Sure! [get_weather(city='Paris')]"),
        text(" [f(a=1)]"),
        // A positional first argument fails the regex: content.
        text("[f(1, a=2)]"),
        text("[f(), g(1)]"),
        // Past the first keyword the regex takes anything, and `handle_single_tool` reads only
        // keywords: the positional `2` is dropped.
        case("[f(a=1), g(2, b=3)]", None, &[("f", r#"{"a": 1}"#), ("g", r#"{"b": 3}"#)]),
        // Non-literal values: `UnexpectedAstError`, content.
        text("[f(a=x)]"),
        text("[f(a=1+2)]"),
        text("[f(a=[i for i in y])]"),
        text("[f(a=f'{x}')]"),
        text("[f(a=b'x')]"),
        // A cut-off list does not parse: content.
        text("[get_weather(city='Paris'), get_time(tz='Europe/"),
        // Dotted names: a dotted first call fails the regex; later ones keep the dots.
        text("[weather.current(city='Paris')]"),
        case(
            "[f(a=1), weather.current(city='Paris')]",
            None,
            &[("f", r#"{"a": 1}"#), ("weather.current", r#"{"city": "Paris"}"#)],
        ),
        // Whitespace, a comment or `;` after the list: still one statement.
        case("[f(a=1)]\n", None, &[("f", r#"{"a": 1}"#)]),
        case("[f(a=1)]  # done\n", None, &[("f", r#"{"a": 1}"#)]),
        case("[f(a=1)]; ", None, &[("f", r#"{"a": 1}"#)]),
        // Text after the list is a syntax error: content.
        text("[f(a=1)] Done."),
        // Ferry's difference: vLLM parses `Done` as a second statement and returns the call.
        text("[f(a=1)]\nDone"),
        // A float that overflows: vLLM would write `Infinity` (no JSON); ferry: content.
        text("[f(a=1e999)]"),
        // No arguments, and an empty list (no match).
        case("[f()]", None, &[("f", "{}")]),
        case("[f(), g()]", None, &[("f", "{}"), ("g", "{}")]),
        text("[]"),
        // A repeated keyword is a syntax error.
        text("[f(a=1, a=2)]"),
        // The regex needs `)`, whitespace, `]`: a trailing comma in the list fails it, one in
        // the arguments does not.
        text("[f(a=1),]"),
        case("[f(a=1,)]", None, &[("f", r#"{"a": 1}"#)]),
        text("[f() , g()]"),
        // The first argument must be `name=` with no space before `=`.
        text("[f(a = 1)]"),
        case("[f(a=1, b = 2)]", None, &[("f", r#"{"a": 1, "b": 2}"#)]),
        // Newlines and comments inside the brackets.
        case(
            "[f(a=1,  # first\n    b=2),\n g(c=3)]",
            None,
            &[("f", r#"{"a": 1, "b": 2}"#), ("g", r#"{"c": 3}"#)],
        ),
        // A raw newline in a single-quoted string is a syntax error.
        text("[f(a='x\ny')]"),
        // `-True` is no number: `UnexpectedAstError`.
        text("[f(a=-True)]"),
        // A call as a value, or a non-call element: content.
        text("[f(a=g(b=1))]"),
        text("[f(a=1), 2]"),
        // A keyword as a name: a syntax error.
        text("[f(class=1)]"),
    ];

    #[test]
    fn hermes_cases() {
        check(ToolCallParser::Hermes, HERMES_CASES);
    }

    #[test]
    fn llama3_json_cases() {
        check(ToolCallParser::Llama3Json, LLAMA_CASES);
    }

    #[test]
    fn pythonic_cases() {
        check(ToolCallParser::Pythonic, PYTHONIC_CASES);
    }

    #[test]
    fn names() {
        for parser in ToolCallParser::ALL {
            assert_eq!(ToolCallParser::from_name(parser.name()), Some(parser));
        }
        assert_eq!(ToolCallParser::Hermes.name(), "hermes");
        assert_eq!(ToolCallParser::Llama3Json.name(), "llama3_json");
        assert_eq!(ToolCallParser::Pythonic.name(), "pythonic");
        assert_eq!(ToolCallParser::from_name("mistral"), None);
        assert_eq!(ToolCallParser::from_name("Hermes"), None);
    }

    /// Every hand-written output, for the streaming property.
    fn all_outputs() -> Vec<&'static str> {
        let extra = [
            "",
            " ",
            "Hello <tool_",
            "<tool_call>",
            "Hi <|python_tag|",
            "[get_",
            "[ not a call",
            "\u{a0}Hi <|python_tag|>{\"name\": \"f\", \"parameters\": {}}",
            "Hi\u{a0}<|python_tag|>{\"name\": \"f\", \"parameters\": {}}",
            "é<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
            "[f(a='日本', b=\"\"\"x\"\"\", c='')]",
        ];
        HERMES_CASES
            .iter()
            .chain(LLAMA_CASES)
            .chain(PYTHONIC_CASES)
            .map(|c| c.output)
            .chain(extra)
            .collect()
    }

    /// `held_from` over every prefix (at char boundaries) of every output, for every parser:
    /// the streamed content `p[..held_from(p)]` only grows, and it is always a prefix of the
    /// finished output's content, so no text of a call ever leaks, and whitespace that
    /// becomes `None` is held.
    #[test]
    fn held_from_is_monotone_and_never_leaks() {
        for parser in ToolCallParser::ALL {
            for output in all_outputs() {
                let parsed = parser.parse(output);
                let content = parsed.content.unwrap_or_default();
                let mut streamed = "";
                for end in (0..=output.len()).filter(|&end| output.is_char_boundary(end)) {
                    let prefix = &output[..end];
                    let held = parser.held_from(prefix);
                    assert!(held <= prefix.len() && prefix.is_char_boundary(held));
                    let now = &prefix[..held];
                    assert!(
                        now.starts_with(streamed),
                        "{}: {now:?} does not extend {streamed:?} ({output:?})",
                        parser.name()
                    );
                    assert!(
                        content.starts_with(now),
                        "{}: streamed {now:?} is not a prefix of the content {content:?} ({output:?})",
                        parser.name()
                    );
                    streamed = now;
                }
            }
        }
    }

    /// The same property on outputs stitched at random (fixed seed) from pieces of all
    /// three formats, to reach the corners the hand-written outputs miss.
    #[test]
    fn held_from_property_on_stitched_outputs() {
        const PIECES: &[&str] = &[
            "<tool_call>",
            "</tool_call>",
            "<tool_",
            "<|python_tag|>",
            "<|eot_id|>",
            "<|eo",
            "{",
            "}",
            "\"name\"",
            "\"arguments\"",
            "\"parameters\"",
            ": ",
            "\"f\"",
            "\"\"",
            ", ",
            ";",
            "[",
            "]",
            "(",
            ")",
            "f(",
            "g.h(",
            "a=",
            "b = ",
            "1",
            "-2.5e3",
            "'x'",
            "\"y\"",
            "r'\\d'",
            "f'{{'",
            "true",
            "None",
            "x",
            " ",
            "\n",
            "\t",
            "# c\n",
            "\\",
            "é",
            "Hi",
            ".",
            "*",
            "'''",
            "\u{a0}",
            "0x1F",
            "\\u00e9",
            "{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
            "[f(a=1)]",
            "[f(a=1), g(b='x')]",
        ];
        const CALLS: &[&[&str]] = &[
            &[
                "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>",
                "<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>\n",
            ],
            &[
                "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}",
                "{\"name\": \"g\", \"arguments\": {\"x\": [1]}}",
                "; ",
                "<|eot_id|>",
            ],
            &["[f(a=1)]", "[f(a=1), g(b='x')]", "[h()]", "\n"],
        ];
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = |bound: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % bound as u64) as usize
        };
        let mut with_calls = [0usize; 3];
        for _ in 0..6000 {
            let pieces = 1 + next(10);
            let mut output: String = (0..pieces).map(|_| PIECES[next(PIECES.len())]).collect();
            if next(2) == 0 {
                // Noise around whole calls of one format.
                let calls = CALLS[next(CALLS.len())];
                let head: String = (0..next(3)).map(|_| PIECES[next(PIECES.len())]).collect();
                let tail: String = (0..next(3)).map(|_| PIECES[next(PIECES.len())]).collect();
                let middle: String = (0..1 + next(3)).map(|_| calls[next(calls.len())]).collect();
                output = match next(3) {
                    0 => middle,
                    1 => head + &middle,
                    _ => head + &middle + &tail,
                };
            }
            for parser in ToolCallParser::ALL {
                let parsed = parser.parse(&output);
                with_calls[parser as usize] += usize::from(!parsed.calls.is_empty());
                for call in &parsed.calls {
                    assert!(
                        serde_json::from_str::<serde::de::IgnoredAny>(&call.arguments).is_ok(),
                        "{}: arguments of {output:?} are no JSON",
                        parser.name()
                    );
                }
                let content = parsed.content.unwrap_or_default();
                let mut streamed = "";
                for end in (0..=output.len()).filter(|&end| output.is_char_boundary(end)) {
                    let prefix = &output[..end];
                    let now = &prefix[..parser.held_from(prefix)];
                    assert!(
                        now.starts_with(streamed),
                        "{}: {output:?} at {end}",
                        parser.name()
                    );
                    assert!(
                        content.starts_with(now),
                        "{}: streamed {now:?} vs content {content:?} ({output:?})",
                        parser.name()
                    );
                    streamed = now;
                }
            }
        }
        eprintln!("stitched outputs with calls (hermes, llama3_json, pythonic): {with_calls:?}");
        assert!(
            with_calls.iter().all(|&n| n >= 100),
            "too few calls to test: {with_calls:?}"
        );
    }

    #[test]
    fn held_from_examples() {
        use ToolCallParser::{Hermes, Llama3Json, Pythonic};
        // A partial marker at the end is held; text before it goes.
        assert_eq!(Hermes.held_from("Hello <tool_"), 6);
        assert_eq!(Hermes.held_from("Hello <tool_call>{\"na"), 6);
        assert_eq!(Hermes.held_from("Hello <"), 6);
        assert_eq!(Hermes.held_from("Hello <b>"), 9);
        // Whitespace only (it would become `None`): held.
        assert_eq!(Hermes.held_from(" \n "), 0);
        assert_eq!(Hermes.held_from(" \n <tool_call>"), 0);
        assert_eq!(Hermes.held_from(" Hi"), 3);

        assert_eq!(Llama3Json.held_from("Hello"), 5);
        // The partial tag and the whitespace before it (stripped when calls follow).
        assert_eq!(Llama3Json.held_from("Hi <|pyth"), 2);
        assert_eq!(Llama3Json.held_from("Hi <|python_tag|>{\"name\""), 2);
        assert_eq!(Llama3Json.held_from("Hi <b>"), 6);
        // A possible call list at the start is held whole ...
        assert_eq!(Llama3Json.held_from("<|py"), 0);
        assert_eq!(Llama3Json.held_from("{"), 0);
        assert_eq!(
            Llama3Json.held_from("{\"name\": \"f\", \"parameters\": {\"a\": 1."),
            0
        );
        assert_eq!(
            Llama3Json.held_from("{\"name\": \"f\", \"parameters\": {}}<|eo"),
            0
        );
        // ... and let go once it cannot pass the whole-output check.
        assert_eq!(Llama3Json.held_from("{\"name\": x }"), 12);
        // (An error on the very last character may still be mended: held one more char.)
        assert_eq!(Llama3Json.held_from("{\"name\": x"), 0);
        assert_eq!(
            Llama3Json.held_from("{\"name\": \"f\", \"parameters\": {}} x"),
            33
        );
        assert_eq!(Llama3Json.held_from("<|pyx"), 5);
        // Leading whitespace: the content would be stripped if calls followed.
        assert_eq!(Llama3Json.held_from(" Hi there"), 0);

        assert_eq!(Pythonic.held_from("Hi"), 2);
        assert_eq!(Pythonic.held_from("["), 0);
        assert_eq!(Pythonic.held_from("[get_"), 0);
        assert_eq!(Pythonic.held_from("[get_weather(city='Par"), 0);
        assert_eq!(Pythonic.held_from("[f(a=1)]"), 0);
        assert_eq!(Pythonic.held_from("[ x"), 3);
        assert_eq!(Pythonic.held_from("[1, 2"), 5);
        assert_eq!(Pythonic.held_from("[f(a=1)] x"), 10);
        assert_eq!(Pythonic.held_from("[f(a=x"), 0);
        assert_eq!(Pythonic.held_from("[f(a=x)"), 7);
    }

    #[test]
    fn pythonic_regex_emulation() {
        let cases = [
            ("[f()]", Match::Yes),
            ("[f(), g()]", Match::Yes),
            ("[f() g()]", Match::Yes),
            ("[f(a=1)]", Match::Yes),
            ("[f(a=1) ]trailing", Match::Yes),
            ("[f(a=1),]", Match::More),
            ("[f(a=1), g(x=')]')", Match::Yes),
            ("[f(1)]", Match::No),
            ("[f( a=1)]", Match::No),
            ("[_f(a=1)]", Match::No),
            ("[f(), g(1)]", Match::No),
            ("[f() , g()]", Match::No),
            ("[f(),g() ,h()]", Match::No),
            ("[f() g(), h()]", Match::No),
            (" [f()]", Match::No),
            ("[]", Match::No),
            ("", Match::More),
            ("[", Match::More),
            ("[f", Match::More),
            ("[f(", Match::More),
            ("[f()", Match::More),
            ("[f() ", Match::More),
            ("[f(a=1)", Match::More),
            ("[f(a", Match::More),
        ];
        for (text, expected) in cases {
            assert_eq!(pythonic_regex(text), expected, "{text:?}");
        }
    }

    #[test]
    fn python_ints() {
        assert_eq!(radix_to_decimal("ff", 16), "255");
        assert_eq!(radix_to_decimal("0", 2), "0");
        assert_eq!(
            radix_to_decimal("ffffffffffffffffffffffffffffffff", 16),
            u128::MAX.to_string()
        );
        assert_eq!(normalize_int("000"), "0");
        assert_eq!(negate("0".to_owned()), "0");
        assert_eq!(negate("-5".to_owned()), "5");
        // More than 4300 digits: Python will not write it.
        let huge = format!("[f(a={})]", "9".repeat(4301));
        assert_eq!(
            ToolCallParser::Pythonic.parse(&huge),
            Parsed::content_only(&huge)
        );
    }

    /// Pathological nesting (a model stuck repeating `[`) must not overflow the stack.
    #[test]
    fn deep_nesting_is_refused_not_a_crash() {
        let deep = format!("[f(a={}1{})]", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(
            ToolCallParser::Pythonic.parse(&deep),
            Parsed::content_only(&deep)
        );
        assert_eq!(ToolCallParser::Pythonic.held_from(&deep), deep.len());
        let signs = format!("[f(a={}1)]", "-".repeat(100_000));
        assert_eq!(
            ToolCallParser::Pythonic.parse(&signs),
            Parsed::content_only(&signs)
        );
        // 198 brackets inside the list and the call: Python's limit of 200 is reached, not passed.
        let ok = format!("[f(a={}1{})]", "[".repeat(198), "]".repeat(198));
        assert_eq!(ToolCallParser::Pythonic.parse(&ok).calls.len(), 1);
        let over = format!("[f(a={}1{})]", "[".repeat(199), "]".repeat(199));
        assert!(ToolCallParser::Pythonic.parse(&over).calls.is_empty());
        // serde_json reads raw values without recursing: deep JSON arguments are fine.
        let json = format!(
            "<tool_call>{{\"name\": \"f\", \"arguments\": {}{}}}</tool_call>",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert_eq!(ToolCallParser::Hermes.parse(&json).calls.len(), 1);
        let json = format!(
            "{{\"name\": \"f\", \"arguments\": {{\"a\": {}{}}}}}",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert_eq!(ToolCallParser::Llama3Json.parse(&json).calls.len(), 1);
        assert_eq!(ToolCallParser::Llama3Json.held_from(&json), 0);
    }

    #[test]
    fn llama_every_prefix_of_a_call_list_is_viable() {
        let output = "{\"name\": \"f\", \"parameters\": {\"a\": -1.5e-3, \"b\": [true, false, null], \"c\": \"x\\\"\\u00e9\"}}; {\"name\": \"g\", \"arguments\": {}}\n<|eot_id|>";
        assert!(llama_validate(output).passes);
        for end in 0..output.len() {
            assert!(
                llama_validate(&output[..end]).viable,
                "{:?}",
                &output[..end]
            );
        }
    }
}
