//! Reading a JSON body so that a bad one is a 400 naming the field at fault: the server's
//! request types and the admin calls' arguments (`ferry-admin`) are read through these.

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;

/// Parses `bytes` as a `T`, naming the field at fault on a type error.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    from_value(&value)
}

/// Reads a `T` out of a JSON value, naming the field at fault on a type error. Request types
/// read their parts with this, one part at a time, rather than with `#[serde(flatten)]`:
/// flattened fields are buffered and lose their path, so errors could not name them.
pub fn from_value<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        if path == "." {
            ApiError::bad_request(format!("the request body has the wrong shape: {inner}"))
        } else {
            ApiError::invalid(path.clone(), format!("invalid value for `{path}`: {inner}"))
        }
    })
}

/// A JSON body that may be absent: an empty body reads as `T::default()`.
pub fn optional_json<T: DeserializeOwned + Default>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    parse_json(bytes)
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;

    #[derive(Debug, Default, PartialEq, serde::Deserialize)]
    #[allow(dead_code)]
    struct Body {
        n: Option<u32>,
        messages: Option<Vec<Msg>>,
    }
    #[derive(Debug, Default, PartialEq, serde::Deserialize)]
    #[allow(dead_code)]
    struct Msg {
        content: Option<String>,
    }

    #[test]
    fn type_errors_name_the_field_path() {
        let e =
            parse_json::<Body>(br#"{"messages": [{"content": "a"}, {"content": 3}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].content"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = parse_json::<Body>(br#"{"n": "two"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
    }

    #[test]
    fn malformed_json_is_a_400_without_param() {
        for body in [&b"{\"n\": 1"[..], b"not json", b"{} trailing", b"[1]"] {
            let e = parse_json::<Body>(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body:?}");
            assert_eq!(e.param, None, "{body:?}");
        }
    }

    #[test]
    fn an_empty_body_reads_as_the_default() {
        assert_eq!(optional_json::<Body>(b" \n").unwrap(), Body::default());
        assert_eq!(
            optional_json::<Body>(br#"{"n": 2}"#).unwrap(),
            Body {
                n: Some(2),
                messages: None
            }
        );
        assert!(optional_json::<Body>(b"{").is_err());
    }
}
