//! `Inner`: what every request of one object-store tier needs (the client, the prefix, the
//! settings), and the requests themselves, async. `ObjectBlobs` (`bucket`) blocks on them;
//! the streaming writer (`writer`) and the upload markers (`uploads`) share it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use object_store::list::PaginatedListStore;
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjPath;
use object_store::{GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use super::server_uploads::S3Uploads;
use super::settings::{sanitize, NoCredentials, Secrets};
use crate::error::{Error, ErrorKind, Result};

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
    pub(super) lister: Arc<dyn PaginatedListStore>,
    /// Where requests go ("http://127.0.0.1:9000", "AWS (region eu-central-1)"), for messages.
    pub(super) endpoint: String,
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
    /// S3 only: a client that deletes one key per request, for the empty directories some
    /// servers keep (`delete_directory`).
    pub(super) directories: Option<Arc<dyn ObjectStore>>,
    /// What the tier's gate counts of its requests (`gate`).
    pub(super) requests: Arc<crate::requests::RequestCounters>,
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
    pub(super) fn missing_bucket(&self, text: &str) -> Option<Error> {
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

    pub(super) async fn head_size(&self, key: &str) -> Result<Option<u64>> {
        match self.store.head(&self.path(key)).await {
            Ok(m) => Ok(Some(m.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("HEAD", key, e)),
        }
    }

    pub(super) async fn get_range(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
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

    pub(super) async fn put_if_absent(&self, key: &str, data: &[u8]) -> Result<bool> {
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

    pub(super) async fn list(&self, prefix: &str) -> Result<Vec<String>> {
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

    /// Deletes `names` by their keys in bulk, without listing; a missing one is no error.
    pub(super) async fn delete_names(&self, names: &[String]) -> Result<()> {
        let paths: Vec<object_store::Result<ObjPath>> = names.iter().map(|n| Ok(self.path(n))).collect();
        let mut deleted = self.store.delete_stream(futures_util::stream::iter(paths).boxed());
        while let Some(r) = deleted.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                // The error names the object where the store says which; the message names
                // the first of the batch and how many there were.
                Err(e) => {
                    let op = format!("bulk DELETE of {} objects, the first", names.len());
                    return Err(self.err(&op, names.first().map_or("", |n| n.as_str()), e));
                }
            }
        }
        Ok(())
    }

    pub(super) async fn delete_prefix(&self, prefix: &str) -> Result<()> {
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
        self.delete_directory(&path).await;
        Ok(())
    }

    /// After the objects under a prefix are deleted, its directory: SeaweedFS keeps the
    /// directory of objects it removed (`prefix/`) and its listing of the parent names it,
    /// so gc took every step it ever removed for a leftover again at every run (requests
    /// per step that grew with the steps saved). A DELETE of the key `prefix/`, which
    /// SeaweedFS takes as the directory, makes the listing forget it; to AWS S3 it is a key
    /// that does not exist (no error). One request per prefix, S3 only (GCS has no
    /// directories). Best effort: the objects are gone already.
    async fn delete_directory(&self, path: &ObjPath) {
        let Some(store) = &self.directories else { return };
        let dir = path.clone().join(""); // "<prefix>/": an empty last part keeps the '/'
        match store.delete(&dir).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => log::debug!("tier '{}': removing the directory {dir}: {}", self.tier, sanitize(&e.to_string(), &self.secrets)),
        }
    }
}
