//! The structured-output fields of a request, read into one [`StructuredOutput`]:
//!
//! * OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type":
//!   "json_object"}`, or `{"type": "json_schema", "json_schema": {"name": ..., "schema":
//!   {...}, "strict": ...}}` (ferry always enforces the schema, strict or not);
//! * vLLM's `structured_outputs`: exactly one of `json` (a schema, as an object or as a JSON
//!   string), `regex`, `choice`, `grammar` (Lark, or GBNF: see [`crate::gbnf`]) or
//!   `json_object: true`, and `disable_any_whitespace` (JSON without free whitespace);
//! * vLLM's older names: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
//!
//! At most one of these may be set; each error names the field at fault. The constraint is
//! compiled later, off the async threads ([`compile`]), where an invalid schema, regex or
//! grammar gets its 400 with the same field name.

use ferry_engine::{Constraint, ConstraintError, EngineHandle, StructuredOutput};
use serde_json::Value;

use crate::error::ApiError;
use crate::gbnf::{gbnf_to_lark, looks_like_gbnf};
use crate::request::StructuredFields;

/// A request's constraint, with the field it came from (for error messages).
#[derive(Debug, Clone, PartialEq)]
pub struct StructuredSpec {
    pub output: StructuredOutput,
    pub param: &'static str,
}

/// Reads the request's structured-output fields; `None` when none asks for a constraint.
pub fn structured_output(fields: &StructuredFields) -> Result<Option<StructuredSpec>, ApiError> {
    let mut found: Option<StructuredSpec> = None;
    let mut set = |spec: Option<StructuredSpec>| -> Result<(), ApiError> {
        match (spec, &found) {
            (None, _) => Ok(()),
            (Some(s), Some(first)) => Err(ApiError::invalid(
                s.param,
                format!(
                    "`{}` and `{}` both ask for a structured output; send one",
                    first.param, s.param
                ),
            )),
            (Some(s), None) => {
                found = Some(s);
                Ok(())
            }
        }
    };
    set(response_format(fields.response_format.as_ref())?)?;
    set(structured_outputs(fields.structured_outputs.as_ref())?)?;
    set(present(&fields.guided_json)
        .map(|v| schema("guided_json", v))
        .transpose()?)?;
    set(present(&fields.guided_regex)
        .map(|v| regex("guided_regex", v))
        .transpose()?)?;
    set(present(&fields.guided_choice)
        .map(|v| choice("guided_choice", v))
        .transpose()?)?;
    set(present(&fields.guided_grammar)
        .map(|v| grammar("guided_grammar", v))
        .transpose()?)?;
    Ok(found)
}

/// Compiles `spec` for `engine` off the async threads (a large schema takes milliseconds, and
/// the first call indexes the vocabulary).
pub async fn compile(engine: &EngineHandle, spec: StructuredSpec) -> Result<Constraint, ApiError> {
    let engine = engine.clone();
    let param = spec.param;
    let compiled = tokio::task::spawn_blocking(move || {
        engine.constraints().and_then(|c| c.compile(&spec.output))
    })
    .await
    .map_err(|e| ApiError::internal(format!("compiling the constraint failed: {e}")))?;
    compiled.map_err(|e| match e {
        ConstraintError::Invalid(why) => {
            ApiError::invalid(param, format!("invalid `{param}`: {why}"))
        }
        ConstraintError::Unavailable(_) => ApiError::invalid(param, e.to_string()),
    })
}

/// A field that is set (JSON `null` counts as absent).
fn present(v: &Option<Value>) -> Option<&Value> {
    v.as_ref().filter(|v| !v.is_null())
}

fn response_format(v: Option<&Value>) -> Result<Option<StructuredSpec>, ApiError> {
    const P: &str = "response_format";
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            "response_format.type",
            "`response_format.type` must be `text`, `json_object` or `json_schema`",
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(StructuredSpec {
            output: StructuredOutput::JsonObject,
            param: P,
        })),
        "json_schema" => {
            let schema = v
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .filter(|s| !s.is_null())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "response_format.json_schema.schema",
                        "`response_format.json_schema.schema` is required with `type: json_schema`",
                    )
                })?;
            Ok(Some(check_schema("response_format.json_schema.schema", schema)?))
        }
        other => Err(ApiError::invalid(
            "response_format.type",
            format!("`response_format.type` must be `text`, `json_object` or `json_schema`, got `{other}`"),
        )),
    }
}

fn structured_outputs(v: Option<&Value>) -> Result<Option<StructuredSpec>, ApiError> {
    const P: &str = "structured_outputs";
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let obj = v.as_object().ok_or_else(|| {
        ApiError::invalid(P, "`structured_outputs` must be an object with one of `json`, `regex`, `choice`, `grammar` or `json_object`")
    })?;
    let mut found = None;
    let mut compact = false;
    for (key, value) in obj.iter().filter(|(_, v)| !v.is_null()) {
        let spec = match key.as_str() {
            "json" => schema("structured_outputs.json", value)?,
            "regex" => regex("structured_outputs.regex", value)?,
            "choice" => choice("structured_outputs.choice", value)?,
            "grammar" => grammar("structured_outputs.grammar", value)?,
            "json_object" => match value {
                Value::Bool(false) => continue,
                Value::Bool(true) => StructuredSpec {
                    output: StructuredOutput::JsonObject,
                    param: "structured_outputs.json_object",
                },
                _ => {
                    return Err(ApiError::invalid(
                        "structured_outputs.json_object",
                        "`structured_outputs.json_object` must be a boolean",
                    ))
                }
            },
            "disable_any_whitespace" => match value {
                Value::Bool(b) => {
                    compact = *b;
                    continue;
                }
                _ => {
                    return Err(ApiError::invalid(
                        "structured_outputs.disable_any_whitespace",
                        "`structured_outputs.disable_any_whitespace` must be a boolean",
                    ))
                }
            },
            // vLLM's knobs for other backends: harmless to accept when off.
            "disable_fallback" | "disable_additional_properties"
                if value == &Value::Bool(false) =>
            {
                continue
            }
            "backend" | "whitespace_pattern" => continue,
            other => {
                return Err(ApiError::invalid(
                    format!("structured_outputs.{other}"),
                    format!("`structured_outputs.{other}` is not supported by this server"),
                ))
            }
        };
        if let Some(first) = &found {
            let first: &StructuredSpec = first;
            return Err(ApiError::invalid(
                spec.param,
                format!(
                    "`{}` and `{}` both ask for a structured output; send one",
                    first.param, spec.param
                ),
            ));
        }
        found = Some(spec);
    }
    Ok(if compact {
        found.map(without_any_whitespace)
    } else {
        found
    })
}

/// A JSON schema as an object (or a boolean schema), or as a string holding one.
fn schema(param: &'static str, v: &Value) -> Result<StructuredSpec, ApiError> {
    match v {
        Value::String(s) => {
            let parsed: Value = serde_json::from_str(s).map_err(|e| {
                ApiError::invalid(param, format!("`{param}` is not valid JSON: {e}"))
            })?;
            check_schema(param, &parsed)
        }
        other => check_schema(param, other),
    }
}

fn check_schema(param: &'static str, v: &Value) -> Result<StructuredSpec, ApiError> {
    if !(v.is_object() || v.is_boolean()) {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` must be a JSON schema (an object), got {v}"),
        ));
    }
    Ok(StructuredSpec {
        output: StructuredOutput::JsonSchema(v.clone()),
        param,
    })
}

fn string<'a>(param: &'static str, v: &'a Value, what: &str) -> Result<&'a str, ApiError> {
    v.as_str()
        .ok_or_else(|| ApiError::invalid(param, format!("`{param}` must be {what}, got {v}")))
}

fn regex(param: &'static str, v: &Value) -> Result<StructuredSpec, ApiError> {
    Ok(StructuredSpec {
        output: StructuredOutput::Regex(string(param, v, "a regular expression")?.to_owned()),
        param,
    })
}

/// A Lark grammar, or a GBNF one (`root ::= ...`, llama.cpp's format, which vLLM's default
/// backends take) translated into Lark.
fn grammar(param: &'static str, v: &Value) -> Result<StructuredSpec, ApiError> {
    let src = string(param, v, "a Lark or GBNF grammar")?;
    let lark = if looks_like_gbnf(src) {
        gbnf_to_lark(src)
            .map_err(|why| ApiError::invalid(param, format!("invalid GBNF in `{param}`: {why}")))?
    } else {
        src.to_owned()
    };
    Ok(StructuredSpec {
        output: StructuredOutput::Grammar(lark),
        param,
    })
}

/// `spec` with JSON's free whitespace turned off (vLLM's `disable_any_whitespace`): a JSON
/// constraint produces compact JSON (llguidance's `whitespace_flexible: false`, set through
/// the schema's `x-guidance` options); other constraints are left as they are, as in vLLM.
fn without_any_whitespace(spec: StructuredSpec) -> StructuredSpec {
    let schema = match spec.output {
        StructuredOutput::JsonObject => serde_json::json!({"type": "object"}),
        StructuredOutput::JsonSchema(Value::Bool(true)) => serde_json::json!({}),
        StructuredOutput::JsonSchema(schema @ Value::Object(_)) => schema,
        output => return StructuredSpec { output, ..spec },
    };
    let mut schema = schema;
    if let Some(obj) = schema.as_object_mut() {
        let options = obj
            .entry("x-guidance")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(options) = options.as_object_mut() {
            options.insert("whitespace_flexible".into(), Value::Bool(false));
        }
    }
    StructuredSpec {
        output: StructuredOutput::JsonSchema(schema),
        ..spec
    }
}

fn choice(param: &'static str, v: &Value) -> Result<StructuredSpec, ApiError> {
    let list = v.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
        ApiError::invalid(
            param,
            format!("`{param}` must be a non-empty list of strings"),
        )
    })?;
    let choices = list
        .iter()
        .enumerate()
        .map(|(i, c)| {
            c.as_str().map(str::to_owned).ok_or_else(|| {
                ApiError::invalid(
                    format!("{param}[{i}]"),
                    format!("`{param}[{i}]` must be a string, got {c}"),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(StructuredSpec {
        output: StructuredOutput::Choice(choices),
        param,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json as j;

    fn read(body: Value) -> Result<Option<StructuredSpec>, ApiError> {
        let fields: StructuredFields = serde_json::from_value(body).unwrap();
        structured_output(&fields)
    }

    fn param_of(body: Value) -> String {
        read(body).unwrap_err().param.unwrap_or_default()
    }

    #[test]
    fn every_spelling_reads_into_its_constraint() {
        let schema =
            serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (
                serde_json::json!({"response_format": {"type": "text"}}),
                None,
            ),
            (
                serde_json::json!({"response_format": {"type": "json_object"}}),
                Some(StructuredOutput::JsonObject),
            ),
            (
                serde_json::json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some(StructuredOutput::JsonSchema(schema.clone())),
            ),
            (
                serde_json::json!({"structured_outputs": {"json": schema.to_string()}}),
                Some(StructuredOutput::JsonSchema(schema.clone())),
            ),
            (
                serde_json::json!({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": false}}),
                Some(StructuredOutput::Regex("[a-z]+".into())),
            ),
            (
                serde_json::json!({"structured_outputs": {"choice": ["a", "b"]}}),
                Some(StructuredOutput::Choice(vec!["a".into(), "b".into()])),
            ),
            (
                serde_json::json!({"structured_outputs": {"grammar": "start: \"x\""}}),
                Some(StructuredOutput::Grammar("start: \"x\"".into())),
            ),
            (
                serde_json::json!({"structured_outputs": {"json_object": true}}),
                Some(StructuredOutput::JsonObject),
            ),
            (
                serde_json::json!({"guided_json": schema}),
                Some(StructuredOutput::JsonSchema(schema.clone())),
            ),
            (
                serde_json::json!({"guided_regex": "x+"}),
                Some(StructuredOutput::Regex("x+".into())),
            ),
            (
                serde_json::json!({"guided_choice": ["y"]}),
                Some(StructuredOutput::Choice(vec!["y".into()])),
            ),
            (
                serde_json::json!({"guided_grammar": "start: \"z\""}),
                Some(StructuredOutput::Grammar("start: \"z\"".into())),
            ),
            (serde_json::json!({"guided_json": null}), None),
        ];
        for (body, want) in cases {
            let got = read(body.clone()).unwrap().map(|s| s.output);
            assert_eq!(got, want, "{body}");
        }
    }

    #[test]
    fn bad_fields_are_named() {
        assert_eq!(
            param_of(j!({"response_format": {"type": "yaml"}})),
            "response_format.type"
        );
        assert_eq!(
            param_of(j!({"response_format": {}})),
            "response_format.type"
        );
        assert_eq!(
            param_of(
                j!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
            ),
            "response_format.json_schema.schema"
        );
        assert_eq!(
            param_of(j!({"structured_outputs": {"json": "{not json"}})),
            "structured_outputs.json"
        );
        assert_eq!(
            param_of(j!({"structured_outputs": {"json": 5}})),
            "structured_outputs.json"
        );
        assert_eq!(
            param_of(j!({"structured_outputs": {"regex": 5}})),
            "structured_outputs.regex"
        );
        assert_eq!(
            param_of(j!({"structured_outputs": {"choice": []}})),
            "structured_outputs.choice"
        );
        assert_eq!(
            param_of(j!({"guided_choice": ["a", 1]})),
            "guided_choice[1]"
        );
        assert_eq!(
            param_of(j!({"structured_outputs": {"structural_tag": {}}})),
            "structured_outputs.structural_tag"
        );
        assert_eq!(
            param_of(j!({"structured_outputs": "json"})),
            "structured_outputs"
        );
        // Two at once: the second is named.
        assert_eq!(
            param_of(j!({"response_format": {"type": "json_object"}, "guided_regex": "x"})),
            "guided_regex"
        );
        let both = param_of(j!({"structured_outputs": {"regex": "x", "choice": ["a"]}}));
        assert!(
            ["structured_outputs.regex", "structured_outputs.choice"].contains(&both.as_str()),
            "{both}"
        );
    }
}
