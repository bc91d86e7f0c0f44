//! `ObjectBlobs`: a bucket prefix as `Blobs`. Each call blocks on its own request(s) on the
//! shared runtime; errors name the tier, the operation and the object, never a credential.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use object_store::list::{PaginatedListOptions, PaginatedListStore};
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjPath;
use object_store::{GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use super::block_on;
use super::server_uploads::S3Uploads;
use super::settings::{gcs_builder, s3_builder, sanitize, Env, NoCredentials, Secrets};
use super::uploads::host_id;
use super::writer::ObjectWriter;
use crate::blobs::{BlobWriter, Blobs, MergedReads};
use crate::error::{Error, ErrorKind, Result};
use crate::gc::Removal;
use crate::policy::{ObjectSpec, TierSpec};

/// What every request of one tier needs; shared with its writers.
pub(super) struct Inner {
    pub(super) tier: String,
    /// `s3://bucket/prefix`: what messages show.
    pub(super) url: String,
    pub(super) root: ObjPath,
    pub(super) store: Arc<dyn ObjectStore>,
    pub(super) multipart: Arc<dyn MultipartStore>,
    /// One page of a listing, as small as asked: how `check_bucket` asks whether the bucket
    /// exists.
    lister: Arc<dyn PaginatedListStore>,
    /// Where requests go ("http://127.0.0.1:9000", "AWS (region eu-central-1)"), for messages.
    endpoint: String,
    pub(super) part_size: usize,
    pub(super) concurrency: usize,
    pub(super) secrets: Secrets,
    /// Set when no credentials were found and the client falls back to instance metadata.
    pub(super) no_credentials: Option<NoCredentials>,
    /// Set once the store has said it cannot create-if-absent.
    pub(super) no_conditional_put: AtomicBool,
    /// This process, as upload markers name it: host (and pid namespace) and pid.
    pub(super) host: String,
    /// The server's own list of multipart uploads (S3 only; see `server_uploads`).
    pub(super) server_uploads: Option<S3Uploads>,
}

/// An s3 or gcs bucket prefix as `Blobs`.
pub struct ObjectBlobs {
    pub(super) inner: Arc<Inner>,
}

impl ObjectBlobs {
    /// Opens tier `name` (an s3 or gcs spec) with settings from the process environment.
    pub fn open(name: &str, spec: &TierSpec) -> Result<ObjectBlobs> {
        Self::open_with(name, spec, &Env::process())
    }

    pub fn open_with(name: &str, spec: &TierSpec, env: &Env) -> Result<ObjectBlobs> {
        let (TierSpec::S3(ObjectSpec { url, options: opts }) | TierSpec::Gcs(ObjectSpec { url, options: opts })) = spec else {
            return Err(Error::invalid(format!("tier '{name}' of kind {} is no object store", spec.kind().as_str())));
        };
        let url = url.clone();
        let fail = |e: object_store::Error, secrets: &Secrets| {
            Error::config(format!("tier '{name}': cannot set up a client for {url}: {}", sanitize(&e.to_string(), secrets)))
        };
        let context = |e: Error| e.context(format!("tier '{name}'"));
        type Clients = (
            Arc<dyn ObjectStore>,
            Arc<dyn MultipartStore>,
            Arc<dyn PaginatedListStore>,
            String,
            Secrets,
            Option<NoCredentials>,
            Option<S3Uploads>,
        );
        let (store, multipart, lister, endpoint, secrets, no_credentials, server_uploads): Clients = match spec {
            TierSpec::Gcs(_) => {
                let (b, secrets) = gcs_builder(&url, opts, env).map_err(context)?;
                let endpoint = b
                    .get_config_value(&object_store::gcp::GoogleConfigKey::BaseUrl)
                    .unwrap_or_else(|| "https://storage.googleapis.com".into());
                let s = Arc::new(b.build().map_err(|e| fail(e, &secrets))?);
                (s.clone(), s.clone(), s, endpoint, secrets, None, None)
            }
            _ => {
                use object_store::aws::AmazonS3ConfigKey;
                let (b, secrets, no_credentials) = s3_builder(&url, opts, env).map_err(context)?;
                let endpoint = b.get_config_value(&AmazonS3ConfigKey::Endpoint).unwrap_or_else(|| {
                    format!("AWS (region {})", b.get_config_value(&AmazonS3ConfigKey::Region).unwrap_or_else(|| "us-east-1".into()))
                });
                let s = Arc::new(b.clone().build().map_err(|e| fail(e, &secrets))?);
                let bucket = url.split('/').nth(2).unwrap_or("");
                let uploads = S3Uploads::new(&b, s.clone(), bucket).map_err(context)?;
                (s.clone(), s.clone(), s, endpoint, secrets, no_credentials, Some(uploads))
            }
        };
        let prefix = url.splitn(4, '/').nth(3).unwrap_or("").to_string();
        Ok(ObjectBlobs {
            inner: Arc::new(Inner {
                tier: name.to_string(),
                url,
                root: ObjPath::from(prefix),
                store,
                multipart,
                lister,
                endpoint,
                part_size: opts.part_size as usize,
                concurrency: opts.concurrency.max(1),
                secrets,
                no_credentials,
                no_conditional_put: AtomicBool::new(false),
                host: host_id(),
                server_uploads,
            }),
        })
    }
}

/// How long opening a tier waits for its bucket check: a server that does not answer by
/// then is left to the requests that follow (the tier runs degraded, as when it goes away).
const BUCKET_CHECK: Duration = Duration::from_secs(10);

impl ObjectBlobs {
    /// At open: whether the bucket exists, by one LIST of at most one key under the prefix.
    /// A bucket that does not exist is a `ConfigError` naming the tier, the url and the
    /// endpoint (otherwise the first persist would fail with an object "not found"). Any
    /// other answer (a server down or slow, credentials refused) is left to the requests
    /// that follow: a tier that cannot be reached now runs degraded, as it does when it goes
    /// away later.
    pub fn check_bucket(&self) -> Result<()> {
        let i = &self.inner;
        let prefix = i.root.as_ref().to_string();
        let opts = PaginatedListOptions { max_keys: Some(1), ..Default::default() };
        let res = block_on(async { tokio::time::timeout(BUCKET_CHECK, i.lister.list_paginated(Some(prefix.as_str()), opts)).await });
        match res {
            Ok(Err(e)) => match i.missing_bucket(&e.to_string()) {
                Some(err) => Err(err),
                None => {
                    log::debug!("tier '{}': checking the bucket of {}: {}", i.tier, i.url, sanitize(&e.to_string(), &i.secrets));
                    Ok(())
                }
            },
            _ => Ok(()),
        }
    }
}

impl Inner {
    /// The bucket of this tier's url.
    fn bucket(&self) -> &str {
        self.url.split('/').nth(2).unwrap_or("")
    }

    /// When a request's error `text` says the bucket does not exist, the error that says so:
    /// the `NoSuchBucket` code (S3, and GCS's XML API that object_store lists through), a
    /// 404 answer to a listing (which only a missing bucket gets), or fake-gcs-server's
    /// "no bucket named" (the emulator Google's SDKs test against, which answers 500).
    fn missing_bucket(&self, text: &str) -> Option<Error> {
        let listing = text.contains("list request") || text.contains("List request");
        if !(text.contains("NoSuchBucket") || text.contains("no bucket named") || listing && text.contains(" 404 ")) {
            return None;
        }
        Some(
            Error::config(format!(
                "tier '{}': bucket '{}' does not exist ({} at {}): create it, or correct the tier's `url` (or \
                 `endpoint`)",
                self.tier,
                self.bucket(),
                self.url,
                self.endpoint
            ))
            .with_tier(&self.tier)
            .with_path(self.url.clone()),
        )
    }

    pub(super) fn path(&self, key: &str) -> ObjPath {
        let key = key.trim_matches('/');
        if key.is_empty() {
            self.root.clone()
        } else if self.root.as_ref().is_empty() {
            ObjPath::from(key)
        } else {
            ObjPath::from(format!("{}/{key}", self.root))
        }
    }

    pub(super) fn describe(&self, key: &str) -> String {
        format!("{}/{}", self.url, key.trim_matches('/'))
    }

    /// A tiercel error for a failed `op` on `key`.
    pub(super) fn err(&self, op: &str, key: &str, e: object_store::Error) -> Error {
        let what = self.describe(key);
        let text = sanitize(&e.to_string(), &self.secrets);
        if let Some(missing) = self.missing_bucket(&text) {
            // The bucket went away after open: the tier cannot be written (nor read), which
            // is no missing object.
            return Error::unavailable(missing.message).with_tier(&self.tier).with_path(what);
        }
        let e = match e {
            object_store::Error::NotFound { .. } => Error::not_found(format!("tier '{}': {what}: not found", self.tier)),
            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => Error::unavailable(format!(
                "tier '{}': {op} {what}: {text} (check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or \
                 the $AWS_PROFILE profile for s3; GOOGLE_APPLICATION_CREDENTIALS for gcs)",
                self.tier
            )),
            _ => match self.no_credentials.as_ref().and_then(|n| n.explain(&self.tier, &text)) {
                Some(m) => Error::unavailable(format!("{m} ({op} {what})")),
                None => Error::unavailable(format!("tier '{}': {op} {what}: {text}", self.tier)),
            },
        };
        e.with_tier(&self.tier).with_path(what)
    }

    pub(super) async fn put(&self, key: &str, payload: PutPayload) -> Result<()> {
        self.store.put(&self.path(key), payload).await.map(|_| ()).map_err(|e| self.err("PUT", key, e))
    }

    pub(super) async fn get(&self, key: &str) -> Result<Bytes> {
        let r = self.store.get(&self.path(key)).await.map_err(|e| self.err("GET", key, e))?;
        r.bytes().await.map_err(|e| self.err("GET", key, e))
    }

    async fn head_size(&self, key: &str) -> Result<Option<u64>> {
        match self.store.head(&self.path(key)).await {
            Ok(m) => Ok(Some(m.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("HEAD", key, e)),
        }
    }

    async fn get_range(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
        let want = offset..offset + dst.len() as u64;
        let short = |have: Option<u64>| {
            Error::integrity(format!(
                "tier '{}': {} is shorter than its manifest says (needs bytes {}..{}, has {})",
                self.tier,
                self.describe(key),
                want.start,
                want.end,
                have.map_or("none".to_string(), |h| format!("{h}"))
            ))
            .with_tier(&self.tier)
            .with_path(self.describe(key))
        };
        if dst.is_empty() {
            return match self.head_size(key).await? {
                Some(n) if n >= offset => Ok(()),
                Some(n) => Err(short(Some(n))),
                None => Err(Error::not_found(format!("tier '{}': {}: not found", self.tier, self.describe(key)))),
            };
        }
        let res = self.store.get_opts(&self.path(key), GetOptions::new().with_range(Some(want.clone()))).await;
        let r = match res {
            Ok(r) => r,
            Err(e @ object_store::Error::NotFound { .. }) => return Err(self.err("GET", key, e)),
            Err(e) => {
                // A range past the end is refused (416); say that the object is short.
                if let Ok(Some(n)) = self.head_size(key).await {
                    if n < want.end {
                        return Err(short(Some(n)));
                    }
                }
                return Err(self.err("GET", key, e));
            }
        };
        if r.range != want {
            let size = r.meta.size;
            return Err(short(Some(size)));
        }
        // The one copy: from the HTTP body into the caller's buffer.
        let mut pos = 0usize;
        let mut stream = r.into_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.err("GET", key, e))?;
            let end = pos + chunk.len();
            if end > dst.len() {
                return Err(Error::integrity(format!(
                    "tier '{}': {}: the server sent more bytes than the range {}..{} asked for",
                    self.tier,
                    self.describe(key),
                    want.start,
                    want.end
                )));
            }
            dst[pos..end].copy_from_slice(&chunk);
            pos = end;
        }
        if pos != dst.len() {
            return Err(short(Some(offset + pos as u64)));
        }
        Ok(())
    }

    async fn put_if_absent(&self, key: &str, data: &[u8]) -> Result<bool> {
        let path = self.path(key);
        let bytes = Bytes::copy_from_slice(data);
        let mut attempt = 0;
        loop {
            attempt += 1;
            if self.no_conditional_put.load(Ordering::Relaxed) {
                if self.head_size(key).await?.is_some() {
                    return Ok(false);
                }
                self.put(key, bytes.clone().into()).await?;
                return Ok(true);
            }
            let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
            match self.store.put_opts(&path, bytes.clone().into(), opts).await {
                Ok(_) => return Ok(true),
                Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => return Ok(false),
                Err(e)
                    if matches!(e, object_store::Error::NotImplemented { .. } | object_store::Error::NotSupported { .. })
                        || e.to_string().contains("status code: 501") =>
                {
                    if !self.no_conditional_put.swap(true, Ordering::Relaxed) {
                        log::warn!(
                            "tier '{}': {} cannot create an object only if it is absent ({}); using HEAD then PUT, \
                             which two writers racing for the same key can both pass",
                            self.tier,
                            self.url,
                            sanitize(&e.to_string(), &self.secrets)
                        );
                    }
                }
                // A create that is not idempotent is not retried by the client on a reset or
                // timeout: the object may or may not be there. Look, then try again.
                Err(e) if attempt < 4 => {
                    log::warn!(
                        "tier '{}': create-if-absent of {} failed, checking: {}",
                        self.tier,
                        self.describe(key),
                        sanitize(&e.to_string(), &self.secrets)
                    );
                    match self.get(key).await {
                        Ok(have) => return Ok(have.as_ref() == data),
                        Err(g) if g.kind == ErrorKind::NotFound => {}
                        Err(_) => tokio::time::sleep(Duration::from_millis(200 << attempt)).await,
                    }
                }
                Err(e) => return Err(self.err("PUT (create if absent)", key, e)),
            }
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>> {
        let path = self.path(prefix);
        let at = if path.as_ref().is_empty() { None } else { Some(&path) };
        let r = self.store.list_with_delimiter(at).await.map_err(|e| self.err("LIST", prefix, e))?;
        let mut names: Vec<String> = r
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(String::from))
            .chain(r.objects.iter().filter_map(|m| m.location.filename().map(String::from)))
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    pub(super) async fn delete(&self, key: &str) -> Result<()> {
        match self.store.delete(&self.path(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err("DELETE", key, e)),
        }
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<()> {
        let path = self.path(prefix);
        if path.as_ref().is_empty() {
            return Err(Error::invalid(format!("tier '{}': refusing to delete everything under {}", self.tier, self.url)));
        }
        let locations = self.store.list(Some(&path)).map_ok(|m| m.location).boxed();
        let mut deleted = self.store.delete_stream(locations);
        while let Some(r) = deleted.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.err("DELETE", prefix, e)),
            }
        }
        Ok(())
    }
}

impl Blobs for ObjectBlobs {
    fn describe(&self, key: &str) -> String {
        self.inner.describe(key)
    }

    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        block_on(self.inner.put(key, Bytes::copy_from_slice(data).into()))
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> Result<bool> {
        block_on(self.inner.put_if_absent(key, data))
    }

    fn create(&self, key: &str) -> Result<Box<dyn BlobWriter>> {
        Ok(Box::new(ObjectWriter::new(self.inner.clone(), key)))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        block_on(self.inner.get(key)).map(|b| b.to_vec())
    }

    fn get_range(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
        block_on(self.inner.get_range(key, offset, dst))
    }

    /// A part's worth, `concurrency` at once: as uploads cut objects, and as boto3's managed
    /// download reads them.
    fn merged_reads(&self) -> Option<MergedReads> {
        Some(MergedReads { bytes: self.inner.part_size as u64, in_flight: self.inner.concurrency })
    }

    fn exists(&self, key: &str) -> Result<bool> {
        block_on(self.inner.head_size(key)).map(|s| s.is_some())
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        block_on(self.inner.list(prefix))
    }

    fn delete(&self, key: &str) -> Result<()> {
        block_on(self.inner.delete(key))
    }

    fn delete_prefix(&self, prefix: &str) -> Result<()> {
        block_on(self.inner.delete_prefix(prefix))
    }

    fn leftovers(&self, temp_age: Option<Duration>) -> Result<Vec<Removal>> {
        block_on(self.inner.abandoned(temp_age))
    }

    fn remove_leftover(&self, r: &Removal) -> Result<bool> {
        block_on(self.inner.abort(r))
    }
}
