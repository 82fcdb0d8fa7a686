//! Signed links to outputs that live in Postgres: `GET /outputs/{id}?expires=..&signature=..`,
//! the counterpart of an S3 presigned URL, so a job's `output.url` downloads without an API key
//! wherever the output lives.
//!
//! The signing key is derived from the S3 secret key, which every API replica of a deployment
//! already shares: links stay valid across replicas and restarts, and rotating the S3 secret
//! revokes them as it revokes presigned URLs.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::time::Duration;
use uuid::Uuid;

type HmacSha256 = Hmac<Sha256>;

pub struct OutputLinks {
    key: [u8; 32],
    /// Where clients reach this API (`TERN_PUBLIC_URL`), without a trailing slash.
    base: String,
    /// How long a link works: `TERN_PRESIGN_TTL_SECS`, as presigned S3 URLs.
    ttl: Duration,
}

impl OutputLinks {
    pub fn new(s3_secret_key: &str, base: &str, ttl: Duration) -> OutputLinks {
        let mut hasher = Sha256::new();
        // A key of its own, so a link's signature says nothing about the S3 secret.
        hasher.update(b"tern output links v1\0");
        hasher.update(s3_secret_key.as_bytes());
        OutputLinks { key: hasher.finalize().into(), base: base.trim_end_matches('/').to_string(), ttl }
    }

    fn mac(&self, id: Uuid, expires: i64) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(format!("{id}.{expires}").as_bytes());
        mac
    }

    /// A link to job `id`'s output that works until the TTL passes.
    pub fn url(&self, id: Uuid) -> String {
        let expires = chrono::Utc::now().timestamp() + self.ttl.as_secs() as i64;
        let signature = hex::encode(self.mac(id, expires).finalize().into_bytes());
        format!("{}/outputs/{id}?expires={expires}&signature={signature}", self.base)
    }

    /// Whether a link's `expires` and `signature` are this API's and have not expired.
    pub fn check(&self, id: Uuid, expires: i64, signature: &str) -> Result<(), LinkRefused> {
        let bytes = hex::decode(signature).map_err(|_| LinkRefused::BadSignature)?;
        // Constant-time: a guess learns nothing from how long the comparison took.
        self.mac(id, expires).verify_slice(&bytes).map_err(|_| LinkRefused::BadSignature)?;
        if expires < chrono::Utc::now().timestamp() {
            return Err(LinkRefused::Expired);
        }
        Ok(())
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum LinkRefused {
    BadSignature,
    Expired,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_checks_until_it_expires_and_only_for_its_job_and_key() {
        let links = OutputLinks::new("secret", "http://tern.example/", Duration::from_secs(60));
        let id = Uuid::now_v7();
        let url = links.url(id);
        assert!(url.starts_with(&format!("http://tern.example/outputs/{id}?expires=")), "{url}");
        let query: std::collections::HashMap<String, String> =
            reqwest::Url::parse(&url).unwrap().query_pairs().map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
        let (expires, signature) = (query["expires"].parse::<i64>().unwrap(), query["signature"].as_str());
        assert_eq!(links.check(id, expires, signature), Ok(()));
        assert_eq!(links.check(Uuid::now_v7(), expires, signature), Err(LinkRefused::BadSignature));
        assert_eq!(links.check(id, expires + 1, signature), Err(LinkRefused::BadSignature));
        assert_eq!(links.check(id, expires, "zz"), Err(LinkRefused::BadSignature));
        let other = OutputLinks::new("another secret", "http://tern.example", Duration::from_secs(60));
        assert_eq!(other.check(id, expires, signature), Err(LinkRefused::BadSignature));
        let past = chrono::Utc::now().timestamp() - 1;
        let stale = hex::encode(links.mac(id, past).finalize().into_bytes());
        assert_eq!(links.check(id, past, &stale), Err(LinkRefused::Expired));
    }
}
