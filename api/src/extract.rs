//! Request bodies and query strings, read so that every way they can be wrong answers in the
//! API's error shape with a stable code (axum's own extractors answer in plain text), and so
//! that no NUL character reaches Postgres, which cannot store one in text or JSON (it would
//! answer 503 `database_unavailable`, and a client would retry forever).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;

/// Reads a JSON body, mapping each way it can fail to a stable code: `body_too_large` (413),
/// `invalid_body`, `invalid_json` or `invalid_character` (a NUL anywhere, 400).
pub fn json_value(body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", "the request body is larger than allowed")
        } else {
            ApiError::bad_request("invalid_body", rejection.body_text())
        }
    })?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("the body is not valid JSON: {e}")))?;
    if let Some(path) = nul_in(&value, "body") {
        return Err(nul_error(&path));
    }
    Ok(value)
}

/// Where in `value` (a path such as `body.input.texts[2]`) a string or key holds a NUL.
pub fn nul_in(value: &Value, path: &str) -> Option<String> {
    match value {
        Value::String(s) => s.contains('\0').then(|| path.to_string()),
        Value::Array(items) => items.iter().enumerate().find_map(|(i, v)| nul_in(v, &format!("{path}[{i}]"))),
        Value::Object(map) => map.iter().find_map(|(k, v)| {
            let here = format!("{path}.{}", k.replace('\0', "\\u0000"));
            if k.contains('\0') {
                Some(here)
            } else {
                nul_in(v, &here)
            }
        }),
        _ => None,
    }
}

/// 400 `invalid_character`: `path` holds a NUL.
pub fn nul_error(path: &str) -> ApiError {
    ApiError::bad_request("invalid_character", format!("{path} contains a NUL character (\\u0000), which tern cannot store"))
}

/// A JSON body deserialised into `T`: 415 `unsupported_media_type` unless the content type is
/// JSON, the errors of [`json_value`], and 422 `invalid_request` when the JSON does not have
/// `T`'s shape (not an object, a missing field, a wrong type).
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|mime| {
                let mime = mime.trim().to_ascii_lowercase();
                mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
            });
        if !json {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the body as JSON, with content-type: application/json",
            ));
        }
        let value = json_value(Bytes::from_request(req, state).await)?;
        // Every body of this API is an object; serde would also fill a struct from an array.
        if !value.is_object() {
            return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", "the body must be a JSON object"));
        }
        serde_json::from_value(value)
            .map(ApiJson)
            .map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", format!("the body does not fit this request: {e}")))
    }
}

/// A query string deserialised into `T`: 400 `invalid_query` when it does not parse (a
/// repeated key, a number that is not one), 400 `invalid_character` for a NUL.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let query = parts.uri.query().unwrap_or_default();
        if query.to_ascii_lowercase().contains("%00") {
            return Err(nul_error("the query string"));
        }
        axum::extract::Query::<T>::try_from_uri(&parts.uri)
            .map(|axum::extract::Query(q)| ApiQuery(q))
            .map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))
    }
}

#[cfg(test)]
mod tests {
    use super::nul_in;
    use serde_json::json;

    #[test]
    fn a_nul_is_found_in_strings_keys_and_nested_values() {
        assert_eq!(nul_in(&json!({"a": ["x", "y\u{0}"]}), "body").as_deref(), Some("body.a[1]"));
        assert_eq!(nul_in(&json!({"k\u{0}": 1}), "body").as_deref(), Some("body.k\\u0000"));
        assert_eq!(nul_in(&json!({"a": {"b": "\\u0000 is text here"}}), "body"), None);
    }
}
