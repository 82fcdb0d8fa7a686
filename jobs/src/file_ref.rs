//! Files carried by job inputs: an http(s) URL, base64 in the request, or an upload's key.
//!
//! The API turns base64 into an upload before the job is stored, so Postgres never holds file
//! bytes and workers only ever see a URL or an upload key.

use serde_json::{json, Value};

/// Largest file accepted as base64 in a request body: 10 MiB (decoded).
pub const BASE64_MAX_BYTES: usize = 10 * 1024 * 1024;
/// Key prefix of objects uploaded through `POST /v1/uploads`.
pub const UPLOAD_PREFIX: &str = "uploads/";

/// Where a job's file comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileRef {
    Url(String),
    Base64(String),
    UploadKey(String),
}

/// Why a file reference was refused; `code()` is the stable API error code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileRefError {
    #[error("a file must be an object with exactly one of \"url\", \"base64\" or \"upload_key\"")]
    Shape,
    #[error("file URLs must use http or https: {0}")]
    Scheme(String),
    #[error("not a valid URL: {0}")]
    Url(String),
    #[error("the file's base64 does not decode: {0}")]
    Base64(String),
    #[error("the file is larger than {BASE64_MAX_BYTES} bytes; upload it through POST /v1/uploads")]
    TooLarge,
    #[error("upload keys start with \"uploads/\": {0}")]
    UploadKey(String),
}

impl FileRefError {
    pub fn code(&self) -> &'static str {
        match self {
            FileRefError::Shape => "invalid_input",
            // A scheme tern never fetches is refused as the internal addresses are.
            FileRefError::Scheme(_) => "url_forbidden",
            FileRefError::Url(_) => "invalid_url",
            FileRefError::Base64(_) => "invalid_base64",
            FileRefError::TooLarge => "file_too_large",
            FileRefError::UploadKey(_) => "upload_not_found",
        }
    }
}

impl FileRef {
    /// Reads and checks a file reference from its JSON form.
    pub fn parse(value: &Value) -> Result<FileRef, FileRefError> {
        let obj = value.as_object().ok_or(FileRefError::Shape)?;
        if obj.len() != 1 {
            return Err(FileRefError::Shape);
        }
        let (field, v) = obj.iter().next().expect("one entry");
        let s = v.as_str().ok_or(FileRefError::Shape)?;
        match field.as_str() {
            "url" => {
                let scheme = s.split_once("://").map(|(scheme, _)| scheme.to_ascii_lowercase());
                match scheme.as_deref() {
                    Some("http") | Some("https") => {}
                    Some(_) => return Err(FileRefError::Scheme(s.to_string())),
                    None => return Err(FileRefError::Url(s.to_string())),
                }
                let host = s.split_once("://").map(|(_, rest)| rest).unwrap_or_default();
                if host.is_empty() || host.starts_with('/') || !crate::egress::well_formed(s) {
                    return Err(FileRefError::Url(s.to_string()));
                }
                Ok(FileRef::Url(s.to_string()))
            }
            "base64" => Ok(FileRef::Base64(s.to_string())),
            "upload_key" => {
                if !s.starts_with(UPLOAD_PREFIX) || s.contains("..") {
                    return Err(FileRefError::UploadKey(s.to_string()));
                }
                Ok(FileRef::UploadKey(s.to_string()))
            }
            _ => Err(FileRefError::Shape),
        }
    }

    /// Decodes base64 content, enforcing [`BASE64_MAX_BYTES`].
    pub fn decode_base64(data: &str) -> Result<Vec<u8>, FileRefError> {
        use base64::Engine;
        // 4 characters carry 3 bytes: refuse oversized data before decoding it.
        if data.len() / 4 * 3 > BASE64_MAX_BYTES + 3 {
            return Err(FileRefError::TooLarge);
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| FileRefError::Base64(e.to_string()))?;
        if bytes.len() > BASE64_MAX_BYTES {
            return Err(FileRefError::TooLarge);
        }
        Ok(bytes)
    }

    pub fn to_json(&self) -> Value {
        match self {
            FileRef::Url(u) => json!({ "url": u }),
            FileRef::Base64(b) => json!({ "base64": b }),
            FileRef::UploadKey(k) => json!({ "upload_key": k }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_http_and_https_urls_only() {
        assert!(FileRef::parse(&json!({"url": "https://example.com/a.wav"})).is_ok());
        assert!(FileRef::parse(&json!({"url": "HTTP://example.com/a.wav"})).is_ok());
        let err = FileRef::parse(&json!({"url": "file:///etc/passwd"})).unwrap_err();
        assert_eq!(err.code(), "url_forbidden");
        let err = FileRef::parse(&json!({"url": "ftp://example.com/a"})).unwrap_err();
        assert_eq!(err.code(), "url_forbidden");
        assert_eq!(
            FileRef::parse(&json!({"url": "example.com"}))
                .unwrap_err()
                .code(),
            "invalid_url"
        );
    }

    #[test]
    fn needs_exactly_one_source() {
        let err = FileRef::parse(&json!({"url": "https://a/b", "base64": "AA=="})).unwrap_err();
        assert_eq!(err, FileRefError::Shape);
        assert_eq!(FileRef::parse(&json!("https://a/b")).unwrap_err(), FileRefError::Shape);
    }

    #[test]
    fn base64_is_decoded_and_bounded() {
        assert_eq!(FileRef::decode_base64("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(FileRef::decode_base64("not base64!").unwrap_err().code(), "invalid_base64");
        let big = "A".repeat((BASE64_MAX_BYTES / 3 + 10) * 4);
        assert_eq!(FileRef::decode_base64(&big).unwrap_err(), FileRefError::TooLarge);
    }

    #[test]
    fn upload_keys_stay_under_the_upload_prefix() {
        assert!(FileRef::parse(&json!({"upload_key": "uploads/0190-abc"})).is_ok());
        assert!(FileRef::parse(&json!({"upload_key": "outputs/x"})).is_err());
        assert!(FileRef::parse(&json!({"upload_key": "uploads/../outputs/x"})).is_err());
    }
}
