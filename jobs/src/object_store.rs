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
            key: Some(key.to_string()),
            size,
            sha256,
            content_type: content_type.to_string(),
            formats: Default::default(),
            inline: None,
            body: None,
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

    /// The object's size and its bytes as a stream, for objects too large to hold at once;
    /// `None` if there is none under `key`.
    pub async fn stream(&self, key: &str) -> Result<Option<(i64, ObjectBytes)>> {
        match self.client.get_object().bucket(&self.bucket).key(self.full_key(key)).send().await {
            Ok(resp) => {
                let size = resp.content_length().unwrap_or(0);
                let chunks = futures::stream::unfold(resp.body, |mut body| async move {
                    body.next().await.map(|chunk| (chunk.map_err(s3_err), body))
                });
                Ok(Some((size, Box::pin(chunks))))
            }
            Err(e) if e.as_service_error().is_some_and(|s| s.is_no_such_key()) => Ok(None),
            Err(e) => Err(s3_err(aws_sdk_s3::error::DisplayErrorContext(e))),
        }
    }

    /// A writer that stores an object of any size under `key` as it is written: one PUT if it
    /// ends under [`ObjectWriter::PART_BYTES`], a multipart upload otherwise.
    pub fn writer(&self, key: &str, content_type: &str) -> ObjectWriter {
        ObjectWriter {
            store: self.clone(),
            key: key.to_string(),
            content_type: content_type.to_string(),
            upload_id: None,
            parts: Vec::new(),
            buffer: Vec::new(),
            size: 0,
            sha256: Sha256::new(),
        }
    }

    /// Keys under `prefix` (without the deployment's prefix), at most the first 1,000: for
    /// checks that a prefix holds nothing it should not.
    pub async fn keys(&self, prefix: &str) -> Result<Vec<String>> {
        let listed = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(self.full_key(prefix))
            .send()
            .await
            .map_err(|e| s3_err(aws_sdk_s3::error::DisplayErrorContext(e)))?;
        Ok(listed.contents().iter().filter_map(|o| o.key()).map(|k| k.strip_prefix(&self.key_prefix).unwrap_or(k).to_string()).collect())
    }

    /// Removes the object; removing one that is not there is no error.
    pub async fn delete(&self, key: &str) -> Result<()> {
        self.client
            .delete_object()
            .bucket(&self.bucket)
            .key(self.full_key(key))
            .send()
            .await
            .map_err(|e| s3_err(aws_sdk_s3::error::DisplayErrorContext(e)))?;
        Ok(())
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

/// An object's bytes, chunk by chunk.
pub type ObjectBytes = std::pin::Pin<Box<dyn futures::Stream<Item = Result<Bytes>> + Send>>;

/// An object written piece by piece ([`ObjectStore::writer`]). Nothing is visible under its
/// key until [`finish`](ObjectWriter::finish); dropped unfinished, a multipart upload it began
/// is left for the bucket's lifecycle rules (or `abort`) to clear.
pub struct ObjectWriter {
    store: ObjectStore,
    key: String,
    content_type: String,
    upload_id: Option<String>,
    parts: Vec<aws_sdk_s3::types::CompletedPart>,
    buffer: Vec<u8>,
    size: i64,
    sha256: Sha256,
}

impl ObjectWriter {
    /// Bytes buffered before a part is sent: 8 MiB (S3's parts are at least 5 MiB but the last).
    pub const PART_BYTES: usize = 8 * 1024 * 1024;

    /// Adds `bytes`; once a part's worth is buffered, sends it (and waits for it), so a
    /// writer holds about one part whatever the object's size.
    pub async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        if self.buffer.capacity() == 0 {
            // One allocation a part: grown by doubling, a part's buffer peaked at three times
            // its size while its contents were copied over.
            self.buffer.reserve_exact(Self::PART_BYTES + bytes.len());
        }
        self.buffer.extend_from_slice(bytes);
        self.sha256.update(bytes);
        self.size += bytes.len() as i64;
        if self.buffer.len() >= Self::PART_BYTES {
            self.send_part().await?;
        }
        Ok(())
    }

    async fn send_part(&mut self) -> Result<()> {
        let (client, bucket, key) = (&self.store.client, &self.store.bucket, self.store.full_key(&self.key));
        let upload_id = match &self.upload_id {
            Some(id) => id.clone(),
            None => {
                let created = client
                    .create_multipart_upload()
                    .bucket(bucket)
                    .key(&key)
                    .content_type(&self.content_type)
                    .send()
                    .await
                    .map_err(|e| s3_err(aws_sdk_s3::error::DisplayErrorContext(e)))?;
                let id = created.upload_id().ok_or_else(|| s3_err("no upload id"))?.to_string();
                self.upload_id = Some(id.clone());
                id
            }
        };
        let number = self.parts.len() as i32 + 1;
        let body = Bytes::from(std::mem::take(&mut self.buffer));
        let sent = client
            .upload_part()
            .bucket(bucket)
            .key(&key)
            .upload_id(&upload_id)
            .part_number(number)
            .body(ByteStream::from(body))
            .send()
            .await
            .map_err(|e| s3_err(aws_sdk_s3::error::DisplayErrorContext(e)))?;
        self.parts.push(
            aws_sdk_s3::types::CompletedPart::builder().part_number(number).set_e_tag(sent.e_tag().map(str::to_string)).build(),
        );
        Ok(())
    }

    /// Stores what was written and describes it.
    pub async fn finish(mut self) -> Result<JobOutput> {
        let Some(upload_id) = self.upload_id.clone() else {
            let body = Bytes::from(std::mem::take(&mut self.buffer));
            return self.store.put(&self.key, body, &self.content_type).await;
        };
        if !self.buffer.is_empty() {
            self.send_part().await?;
        }
        let parts = aws_sdk_s3::types::CompletedMultipartUpload::builder().set_parts(Some(std::mem::take(&mut self.parts))).build();
        self.store
            .client
            .complete_multipart_upload()
            .bucket(&self.store.bucket)
            .key(self.store.full_key(&self.key))
            .upload_id(upload_id)
            .multipart_upload(parts)
            .send()
            .await
            .map_err(|e| s3_err(aws_sdk_s3::error::DisplayErrorContext(e)))?;
        Ok(JobOutput {
            key: Some(self.key.clone()),
            size: self.size,
            sha256: hex::encode(self.sha256.clone().finalize()),
            content_type: self.content_type.clone(),
            formats: Default::default(),
            inline: None,
            body: None,
        })
    }
}
