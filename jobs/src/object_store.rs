//! S3-compatible object storage for uploads and job outputs (aws-sdk-s3).

use crate::{JobOutput, Result};
use aws_sdk_s3::config::{
    BehaviorVersion, Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
};
use aws_sdk_s3::presigning::PresigningConfig;
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::Client;
use bytes::Bytes;
use sha2::{Digest, Sha256};
use std::time::Duration;

/// How to reach the bucket.
#[derive(Clone)]
pub struct ObjectStoreSettings {
    /// Endpoint URL; `None` uses AWS's own endpoints for the region.
    pub endpoint: Option<String>,
    pub region: String,
    pub bucket: String,
    /// Prefix of every object key tern writes or reads (e.g. `staging/`), so deployments can
    /// share a bucket. Keys tern reports (uploads, outputs) are relative to it. Default empty.
    pub key_prefix: String,
    pub access_key: String,
    pub secret_key: String,
    /// Path-style addressing (`endpoint/bucket/key`), which most self-hosted servers need.
    pub path_style: bool,
    /// Lifetime of presigned URLs.
    pub presign_ttl: Duration,
}

/// A bucket in S3-compatible storage. Cheap to clone.
#[derive(Clone)]
pub struct ObjectStore {
    client: Client,
    bucket: String,
    key_prefix: String,
    presign_ttl: Duration,
}

fn s3_err(e: impl std::fmt::Display) -> crate::Error {
    crate::Error::ObjectStore(e.to_string())
}

impl ObjectStore {
    pub fn new(settings: &ObjectStoreSettings) -> ObjectStore {
        let credentials =
            Credentials::new(&settings.access_key, &settings.secret_key, None, None, "tern-config");
        let mut builder = aws_sdk_s3::config::Builder::new()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(settings.region.clone()))
            .credentials_provider(credentials)
            .force_path_style(settings.path_style)
            // Flexible checksums (aws-chunked uploads with CRC trailers) cost CPU on both ends
            // for every small output; TCP and SigV4's payload hash already guard the bytes.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired);
        if let Some(endpoint) = &settings.endpoint {
            builder = builder.endpoint_url(endpoint);
        }
        ObjectStore {
            client: Client::from_conf(builder.build()),
            bucket: settings.bucket.clone(),
            key_prefix: settings.key_prefix.clone(),
            presign_ttl: settings.presign_ttl,
        }
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The object's key in the bucket.
    fn full_key(&self, key: &str) -> String {
        format!("{}{key}", self.key_prefix)
    }

    /// Creates the bucket unless it exists.
    pub async fn ensure_bucket(&self) -> Result<()> {
        if self.client.head_bucket().bucket(&self.bucket).send().await.is_ok() {
            return Ok(());
        }
        match self.client.create_bucket().bucket(&self.bucket).send().await {
            Ok(_) => Ok(()),
            Err(e) => {
                let service = e.as_service_error();
                if service.is_some_and(|s| s.is_bucket_already_owned_by_you() || s.is_bucket_already_exists()) {
                    Ok(())
                } else {
                    Err(s3_err(aws_sdk_s3::error::DisplayErrorContext(e)))
                }
            }
        }
    }

    /// Reachable and the bucket exists.
    pub async fn ping(&self) -> Result<()> {
        self.client
            .head_bucket()
            .bucket(&self.bucket)
            .send()
            .await
            .map_err(|e| s3_err(aws_sdk_s3::error::DisplayErrorContext(e)))?;
        Ok(())
    }

    /// Stores `body` under `key` and describes it (size and SHA-256).
    pub async fn put(&self, key: &str, body: Bytes, content_type: &str) -> Result<JobOutput> {
        let sha256 = hex::encode(Sha256::digest(&body));
        let size = body.len() as i64;
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(self.full_key(key))
            .content_type(content_type)
            .body(ByteStream::from(body))
            .send()
            .await
            .map_err(|e| s3_err(aws_sdk_s3::error::DisplayErrorContext(e)))?;
        Ok(JobOutput {
            key: key.to_string(),
            size,
            sha256,
            content_type: content_type.to_string(),
            formats: Default::default(),
            inline: None,
        })
    }

    /// The object's bytes, at most `max_bytes` of them (a larger object is an error).
    pub async fn get(&self, key: &str, max_bytes: u64) -> Result<Bytes> {
        let resp = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(self.full_key(key))
            .send()
            .await
            .map_err(|e| s3_err(aws_sdk_s3::error::DisplayErrorContext(e)))?;
        if resp.content_length().unwrap_or(0) as u64 > max_bytes {
            return Err(crate::Error::ObjectStore(format!("object {key} is larger than {max_bytes} bytes")));
        }
        let data = resp.body.collect().await.map_err(s3_err)?;
        Ok(data.into_bytes())
    }

    /// The first `len` bytes of the object (fewer if it is shorter).
    pub async fn get_prefix(&self, key: &str, len: u64) -> Result<Bytes> {
        let resp = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(self.full_key(key))
            .range(format!("bytes=0-{}", len.saturating_sub(1)))
            .send()
            .await
            .map_err(|e| s3_err(aws_sdk_s3::error::DisplayErrorContext(e)))?;
        let data = resp.body.collect().await.map_err(s3_err)?;
        Ok(data.into_bytes())
    }

    /// Size of the object, or `None` if there is none under `key`.
    pub async fn size(&self, key: &str) -> Result<Option<i64>> {
        match self.client.head_object().bucket(&self.bucket).key(self.full_key(key)).send().await {
            Ok(head) => Ok(Some(head.content_length().unwrap_or(0))),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_not_found()) => Ok(None),
            Err(e) => Err(s3_err(aws_sdk_s3::error::DisplayErrorContext(e))),
        }
    }

    /// A URL that downloads the object without credentials until the presign TTL passes.
    pub async fn presign_get(&self, key: &str) -> Result<String> {
        let config = PresigningConfig::expires_in(self.presign_ttl).map_err(s3_err)?;
        let req = self.client.get_object().bucket(&self.bucket).key(self.full_key(key)).presigned(config).await.map_err(s3_err)?;
        Ok(req.uri().to_string())
    }

    /// A URL that uploads the object with a plain HTTP PUT until the presign TTL passes.
    pub async fn presign_put(&self, key: &str) -> Result<String> {
        let config = PresigningConfig::expires_in(self.presign_ttl).map_err(s3_err)?;
        let req = self.client.put_object().bucket(&self.bucket).key(self.full_key(key)).presigned(config).await.map_err(s3_err)?;
        Ok(req.uri().to_string())
    }

    pub fn presign_ttl(&self) -> Duration {
        self.presign_ttl
    }
}
