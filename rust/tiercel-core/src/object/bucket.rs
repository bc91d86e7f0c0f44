//! `ObjectBlobs`: a bucket prefix as `Blobs`. Each call blocks on its own request(s) on the
//! shared runtime; errors name the tier, the operation and the object, never a credential.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::list::{PaginatedListOptions, PaginatedListStore};
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjPath;
use object_store::ObjectStore;

use super::block_on;
use super::gate::Gate;
use super::inner::Inner;
use super::server_uploads::S3Uploads;
use super::settings::{gcs_builder, s3_builder, sanitize, throttle_config, Env, NoCredentials, Secrets};
use super::uploads::host_id;
use super::writer::ObjectWriter;
use crate::blobs::{BlobWriter, Blobs, MergedReads};
use crate::error::{Error, Result};
use crate::gc::Removal;
use crate::policy::{ObjectSpec, TierSpec};

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
        let gate = Gate::new(name, throttle_config(opts));
        type Clients = (
            Arc<dyn ObjectStore>,
            Arc<dyn MultipartStore>,
            Arc<dyn PaginatedListStore>,
            String,
            Secrets,
            Option<NoCredentials>,
            Option<S3Uploads>,
            Option<Arc<dyn ObjectStore>>,
        );
        let (store, multipart, lister, endpoint, secrets, no_credentials, server_uploads, directories): Clients = match spec {
            TierSpec::Gcs(_) => {
                let (b, secrets) = gcs_builder(&url, opts, env, &gate).map_err(context)?;
                let endpoint = b
                    .get_config_value(&object_store::gcp::GoogleConfigKey::BaseUrl)
                    .unwrap_or_else(|| "https://storage.googleapis.com".into());
                let s = Arc::new(b.build().map_err(|e| fail(e, &secrets))?);
                (s.clone(), s.clone(), s, endpoint, secrets, None, None, None)
            }
            _ => {
                use object_store::aws::AmazonS3ConfigKey;
                let (b, secrets, no_credentials) = s3_builder(&url, opts, env, &gate).map_err(context)?;
                let endpoint = b.get_config_value(&AmazonS3ConfigKey::Endpoint).unwrap_or_else(|| {
                    format!("AWS (region {})", b.get_config_value(&AmazonS3ConfigKey::Region).unwrap_or_else(|| "us-east-1".into()))
                });
                let s = Arc::new(b.clone().build().map_err(|e| fail(e, &secrets))?);
                let bucket = url.split('/').nth(2).unwrap_or("");
                let uploads = S3Uploads::new(&b, s.clone(), bucket).map_err(context)?;
                // One DELETE per key (`Inner::delete_directory`): a bulk delete's per-key
                // answer for a key that ends in '/' is not one object_store can read back.
                let dirs = Arc::new(b.clone().with_disable_bulk_delete(true).build().map_err(|e| fail(e, &secrets))?);
                (s.clone(), s.clone(), s, endpoint, secrets, no_credentials, Some(uploads), Some(dirs as Arc<dyn ObjectStore>))
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
                directories,
                requests: gate.counters.clone(),
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

    fn requests(&self) -> Option<Arc<crate::requests::RequestCounters>> {
        Some(self.inner.requests.clone())
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

    /// S3: one DeleteObjects request per 1,000 names (object_store's `delete_stream`), no
    /// listing; GCS, whose XML API has no bulk delete: a DELETE per name, several at once.
    fn delete_names(&self, names: &[String]) -> Result<()> {
        block_on(self.inner.delete_names(names))
    }

    fn leftovers_under(&self) -> Option<&str> {
        Some(super::uploads::UPLOADS_DIR)
    }

    fn leftovers(&self, temp_age: Option<Duration>) -> Result<Vec<Removal>> {
        block_on(self.inner.abandoned(temp_age))
    }

    fn remove_leftover(&self, r: &Removal) -> Result<bool> {
        block_on(self.inner.abort(r))
    }
}

impl ObjectBlobs {
    /// The multipart uploads recorded under `.uploads/` (running, or left by a killed
    /// writer): (marker key, object key, upload id).
    pub fn uploads(&self) -> Result<Vec<(String, String, String)>> {
        block_on(self.inner.recorded_uploads())
    }
}
