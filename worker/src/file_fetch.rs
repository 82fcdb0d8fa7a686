//! Reading the file a job input refers to: an upload in object storage or an http(s) URL.

use bytes::Bytes;
use futures::StreamExt;
use std::time::Duration;
use tern_jobs::file_ref::FileRef;
use tern_jobs::{Failure, ObjectStore};

/// How long fetching a URL may take in all. Default 60 s.
pub const URL_FETCH_TIMEOUT: Duration = Duration::from_secs(60);

pub struct FileFetcher {
    pub objects: ObjectStore,
    /// A client from [`tern_jobs::egress::client`]: internal addresses refused.
    pub http: reqwest::Client,
    /// Whether internal addresses may be fetched (`TERN_ALLOW_PRIVATE_URLS`).
    pub allow_private: bool,
    /// Largest file a job may bring.
    pub max_bytes: u64,
}

impl FileFetcher {
    /// The file's bytes, or a permanent failure (`file_unreadable`, `file_too_large`) that no
    /// retry would fix; `Err(None)`-like transient errors come back retryable.
    pub async fn fetch(&self, file: &FileRef) -> Result<Bytes, (Failure, bool)> {
        match file {
            FileRef::UploadKey(key) => self.objects.get(key, self.max_bytes).await.map_err(|e| {
                (Failure::new("file_unreadable", format!("could not read upload {key}: {e}")), false)
            }),
            FileRef::Url(url) => self.fetch_url(url).await,
            FileRef::Base64(_) => Err((Failure::new("file_unreadable", "inline files are stored at submit"), true)),
        }
    }

    async fn fetch_url(&self, url: &str) -> Result<Bytes, (Failure, bool)> {
        let forbidden = |m: String| (Failure::new("url_forbidden", m), true);
        tern_jobs::egress::check_url(url, self.allow_private).map_err(|e| forbidden(e.0))?;
        let resp = self.http.get(url).timeout(URL_FETCH_TIMEOUT).send().await.map_err(|e| match tern_jobs::egress::forbidden_cause(&e) {
            Some(why) => forbidden(why),
            None => (Failure::new("file_unreachable", format!("fetching {url}: {e}")), false),
        })?;
        let status = resp.status();
        if !status.is_success() {
            // 4xx will not heal by itself; 5xx might.
            let permanent = status.is_client_error();
            return Err((Failure::new("file_unreachable", format!("fetching {url}: HTTP {status}")), permanent));
        }
        if resp.content_length().is_some_and(|n| n > self.max_bytes) {
            return Err((self.too_large(), true));
        }
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| (Failure::new("file_unreachable", format!("reading {url}: {e}")), false))?;
            if (body.len() + chunk.len()) as u64 > self.max_bytes {
                return Err((self.too_large(), true));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body.into())
    }

    fn too_large(&self) -> Failure {
        Failure::new("file_too_large", format!("the file is larger than {} bytes", self.max_bytes))
    }
}
