//! Markers of multipart uploads: each upload in flight is recorded by a small object under
//! `.uploads/` (key, upload id, host, pid), removed when the upload completes or is aborted.
//! A writer killed meanwhile leaves its marker, and gc aborts such uploads: those of this
//! host whose process is gone, those of other hosts once they are old. `tiercel gc` and the
//! retention run after a persist list them (`abandoned`) and remove them (`abort`).
//!
//! A writer killed after starting an upload and before writing its marker leaves an upload
//! no marker names: `tiercel gc` (which gives a grace period, `--tmp-age`) also asks an S3
//! server for the uploads under the prefix (`server_uploads`) and aborts those that no
//! marker names, that no writer of this process runs, and that are older than the grace.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};

use std::collections::HashSet;

use super::inner::Inner;
use super::server_uploads::S3Uploads;
use super::settings::sanitize;
use crate::error::Result;
use crate::gc::{self, Removal, Target};

/// Where multipart-upload markers live, under the tier's prefix. Not a step directory, so
/// the step layout ignores it.
pub const UPLOADS_DIR: &str = ".uploads";
/// A marker whose writer cannot be checked (another host) counts as abandoned after this.
pub const STALE_UPLOAD_AGE: Duration = Duration::from_secs(24 * 3600);

static MARKER_SEQ: AtomicU64 = AtomicU64::new(0);

/// Upload ids this process is writing right now: its own markers of other ids are uploads it
/// could not abort (the server was gone), which gc may abort now.
pub(super) fn active_uploads() -> &'static parking_lot::Mutex<std::collections::HashSet<String>> {
    static ACTIVE: OnceLock<parking_lot::Mutex<std::collections::HashSet<String>>> = OnceLock::new();
    ACTIVE.get_or_init(Default::default)
}

/// This process's host as markers name it: host name and pid namespace.
/// This host (and pid namespace), as upload markers and writer leases name it.
pub fn host_id() -> String {
    let mut buf = [0u8; 256];
    let host = if unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0 {
        let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..n]).into_owned()
    } else {
        "unknown".into()
    };
    // Two containers may share a host name but not a pid namespace.
    let ns = std::fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string()).unwrap_or_default();
    format!("{host}/{ns}")
}

pub(super) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// What a marker under `.uploads/` records about one running multipart upload.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct UploadMarker {
    key: String,
    upload_id: String,
    host: String,
    pid: u32,
    started: u64,
}

impl Inner {
    /// The multipart uploads recorded under `.uploads/` (running, or left by a killed
    /// writer): (marker key, object key, upload id).
    pub(super) async fn recorded_uploads(&self) -> Result<Vec<(String, String, String)>> {
        let mut out = vec![];
        for name in self.list(UPLOADS_DIR).await? {
            let key = format!("{UPLOADS_DIR}/{name}");
            if let Ok(m) = serde_json::from_slice::<UploadMarker>(&self.get(&key).await?) {
                out.push((key, m.key, m.upload_id));
            }
        }
        Ok(out)
    }

    /// Records upload `id` of `key` in a new marker; returns the marker's key.
    pub(super) async fn record_upload(&self, key: &str, id: &str) -> Result<String> {
        // Letters, digits, `.`, `-` only: a key that no store escapes.
        let marker =
            format!("{UPLOADS_DIR}/{}.{}.{}.json", key.replace('/', "--"), std::process::id(), MARKER_SEQ.fetch_add(1, Ordering::Relaxed));
        let m = UploadMarker {
            key: key.to_string(),
            upload_id: id.to_string(),
            host: self.host.clone(),
            pid: std::process::id(),
            started: unix_now(),
        };
        self.put(&marker, serde_json::to_vec(&m).expect("marker serializes").into()).await?;
        Ok(marker)
    }

    /// The multipart uploads that killed writers left (see the module docs), as gc removals.
    /// `grace`: also those the server lists that nothing names and that are at least this
    /// old (None: markers only, as the retention after every persist does).
    pub(super) async fn abandoned(&self, grace: Option<Duration>) -> Result<Vec<Removal>> {
        let dir = self.path(UPLOADS_DIR);
        let markers: Vec<object_store::ObjectMeta> =
            self.store.list(Some(&dir)).try_collect().await.map_err(|e| self.err("LIST", UPLOADS_DIR, e))?;
        let now = unix_now();
        let mut out = vec![];
        let mut marked = std::collections::HashSet::new();
        for meta in markers {
            let Some(name) = meta.location.filename().map(String::from) else { continue };
            let marker_key = format!("{UPLOADS_DIR}/{name}");
            let age = now.saturating_sub(meta.last_modified.timestamp().max(0) as u64);
            // By the listed location itself: a name is not always a valid key again.
            let got = match self.store.get(&meta.location).await {
                Ok(r) => r.bytes().await,
                Err(e) => Err(e),
            };
            let bytes = match got {
                Ok(b) => b,
                Err(object_store::Error::NotFound { .. }) => continue, // finished meanwhile
                Err(e) => return Err(self.err("GET", &marker_key, e)),
            };
            let marker: Option<UploadMarker> = serde_json::from_slice(&bytes).ok();
            marked.extend(marker.as_ref().map(|m| m.upload_id.clone()));
            let stale = match &marker {
                Some(m) if m.host == self.host && m.pid == std::process::id() => !active_uploads().lock().contains(&m.upload_id),
                Some(m) if m.host == self.host => !gc::pid_alive(m.pid) || age > STALE_UPLOAD_AGE.as_secs(),
                _ => age > STALE_UPLOAD_AGE.as_secs(),
            };
            if !stale {
                continue;
            }
            let location = meta.location.to_string();
            out.push(match marker {
                Some(m) => {
                    let who = if m.host != self.host {
                        format!("pid {} on {}", m.pid, m.host)
                    } else if m.pid == std::process::id() {
                        "this process (its abort had failed)".to_string()
                    } else {
                        format!("pid {} (gone)", m.pid)
                    };
                    let reason = format!("abandoned multipart upload of {} by {who}", self.describe(&m.key));
                    Removal::new(Target::Upload { key: m.key, marker: location, upload_id: m.upload_id }, reason)
                }
                None => Removal::new(
                    Target::Upload { key: marker_key.clone(), marker: location, upload_id: String::new() },
                    format!("unreadable upload marker {}", self.describe(&marker_key)),
                ),
            });
        }
        if let (Some(grace), Some(lister)) = (grace, &self.server_uploads) {
            out.extend(self.unmarked(lister, &marked, grace, now).await?);
        }
        Ok(out)
    }

    /// Uploads the server holds under this tier's prefix that no marker names, that this
    /// process is not writing, and that were started at least `grace` ago: a writer killed
    /// between starting the upload and recording it.
    async fn unmarked(&self, lister: &S3Uploads, marked: &HashSet<String>, grace: Duration, now: u64) -> Result<Vec<Removal>> {
        let root = self.root.as_ref();
        let prefix = if root.is_empty() { String::new() } else { format!("{root}/") };
        let mut out = vec![];
        for u in lister.list(&prefix).await.map_err(|e| e.with_tier(&self.tier))? {
            let age = u.initiated.map(|t| now.saturating_sub(t));
            if marked.contains(&u.upload_id) || active_uploads().lock().contains(&u.upload_id) || age.is_none_or(|a| a < grace.as_secs()) {
                continue;
            }
            let key = u.key.strip_prefix(&prefix).unwrap_or(&u.key).to_string();
            let reason = format!(
                "abandoned multipart upload of {} that no marker names ({} s old: its writer died before recording it)",
                self.describe(&key),
                age.unwrap_or(0)
            );
            out.push(Removal::new(Target::Upload { key, marker: String::new(), upload_id: u.upload_id }, reason));
        }
        Ok(out)
    }

    /// Aborts an abandoned upload and removes its marker (an unreadable marker: just that).
    /// False when the server refused the abort: the marker stays for the next run.
    pub(super) async fn abort(&self, r: &Removal) -> Result<bool> {
        let Target::Upload { key, marker, upload_id } = &r.target else { return Ok(false) };
        if !upload_id.is_empty() {
            match self.multipart.abort_multipart(&self.path(key), upload_id).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => {
                    log::warn!(
                        "tier '{}': cannot abort the abandoned upload of {}: {}",
                        self.tier,
                        self.describe(key),
                        sanitize(&e.to_string(), &self.secrets)
                    );
                    return Ok(false);
                }
            }
        }
        if marker.is_empty() {
            return Ok(true); // an upload no marker names
        }
        let location = ObjPath::parse(marker).unwrap_or_else(|_| ObjPath::from(marker.as_str()));
        match self.store.delete(&location).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(true),
            Err(e) => Err(self.err("DELETE", marker, e)),
        }
    }
}
