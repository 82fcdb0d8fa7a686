//! The tern API over HTTP: JSON in and out, errors with their stable codes.

use anyhow::Result;
use serde_json::Value;
use std::time::Duration;

/// A request the API refused, or one that never reached it.
#[derive(Debug)]
pub struct ApiFailure {
    /// HTTP status; 0 when the API could not be reached.
    pub status: u16,
    pub code: String,
    pub message: String,
}

impl std::fmt::Display for ApiFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.status == 0 {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{} ({}, HTTP {})", self.message, self.code, self.status)
        }
    }
}

impl std::error::Error for ApiFailure {}

/// A client of one tern deployment.
#[derive(Clone)]
pub struct Api {
    http: reqwest::Client,
    /// For long transfers (uploads, downloads), without the request timeout.
    transfers: reqwest::Client,
    base: String,
    key: Option<String>,
}

fn unreachable(base: &str, e: reqwest::Error) -> anyhow::Error {
    ApiFailure { status: 0, code: "unreachable".into(), message: format!("could not reach {base}: {e}") }.into()
}

impl Api {
    pub fn new(base: &str, key: Option<String>) -> Result<Api> {
        Ok(Api {
            http: reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?,
            transfers: reqwest::Client::builder().build()?,
            base: base.trim_end_matches('/').to_string(),
            key,
        })
    }

    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
    }

    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.authorized(self.http.request(method, format!("{}{path}", self.base)))
    }

    /// A request without a timeout, for streams and large files.
    pub fn long_request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.authorized(self.transfers.request(method, format!("{}{path}", self.base)))
    }

    /// Sends a request and reads its JSON answer; a refusal is an [`ApiFailure`].
    pub async fn send(&self, request: reqwest::RequestBuilder) -> Result<Value> {
        let response = request.send().await.map_err(|e| unreachable(&self.base, e))?;
        Self::json(response).await
    }

    pub async fn json(response: reqwest::Response) -> Result<Value> {
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(body);
        }
        let error = &body["error"];
        Err(ApiFailure {
            status: status.as_u16(),
            code: error["code"].as_str().unwrap_or("http_error").to_string(),
            message: error["message"].as_str().map_or_else(|| format!("HTTP {status}"), str::to_string),
        }
        .into())
    }

    pub async fn get(&self, path: &str) -> Result<Value> {
        self.send(self.request(reqwest::Method::GET, path)).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Result<Value> {
        self.send(self.request(reqwest::Method::POST, path).json(body)).await
    }

    /// Puts `bytes` to a presigned URL (no key: the URL carries the permission).
    pub async fn put_presigned(&self, url: &str, bytes: Vec<u8>) -> Result<()> {
        let response = self.transfers.put(url).body(bytes).send().await.map_err(|e| unreachable(url, e))?;
        if !response.status().is_success() {
            anyhow::bail!(ApiFailure { status: response.status().as_u16(), code: "upload_failed".into(), message: format!("storing the file answered {}", response.status()) });
        }
        Ok(())
    }

    /// Downloads a URL (presigned, or a path of the API) to bytes.
    pub async fn download(&self, url_or_path: &str) -> Result<Vec<u8>> {
        let request = if url_or_path.starts_with('/') {
            self.long_request(reqwest::Method::GET, url_or_path)
        } else {
            self.transfers.get(url_or_path)
        };
        let response = request.send().await.map_err(|e| unreachable(url_or_path, e))?;
        if !response.status().is_success() {
            return Err(Self::json(response).await.err().unwrap_or_else(|| anyhow::anyhow!("download failed")));
        }
        Ok(response.bytes().await?.to_vec())
    }
}
