//! The streaming writer of an object-store tier: bytes gather into a part-sized buffer; an
//! object no larger than one part goes up in a single PUT, a larger one as a multipart upload
//! with up to `concurrency` parts in flight (recorded by a marker, see `uploads`). On an error,
//! `abort` or drop the upload is aborted.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use object_store::multipart::PartId;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt, PutPayload};
use tokio::task::JoinHandle;

use super::inner::Inner;
use super::settings::sanitize;
use super::uploads::active_uploads;
use super::{block_on, runtime};
use crate::blobs::BlobWriter;
use crate::error::{Error, Result};

/// After every this many parts of one upload, its part size doubles (see `part_len`).
pub(super) const PARTS_PER_DOUBLING: usize = 1000;
/// S3's limits on one multipart upload (GCS's XML API has the same): parts, and bytes per part.
pub(super) const MAX_PARTS: usize = 10_000;
const MAX_PART_LEN: usize = 5 << 30;

/// The size of part `index` (from 0) of an upload whose tier has `part_size`: `part_size` for
/// the first `PARTS_PER_DOUBLING` parts, then twice that for as many, and so on, up to 5 GiB.
/// A writer does not know an object's size in advance; this way a small object takes parts
/// of `part_size` (as many requests per GiB as that gives, no more), and a large one fits in
/// S3's 10,000 parts: 4.88 TiB from the 5 MiB minimum; from the 16 MiB default, 15.6 GiB in
/// the first 1,000 parts, and past S3's largest object (5 TiB) in 8,284.
pub(super) fn part_len(part_size: usize, index: usize) -> usize {
    let doublings = (index / PARTS_PER_DOUBLING).min(20) as u32;
    part_size.saturating_mul(1usize << doublings).min(MAX_PART_LEN)
}

struct Upload {
    id: String,
    marker: String,
    started: SystemTime,
    /// Parts sent, in order, each still running or done.
    parts: Vec<Option<PartId>>,
    running: std::collections::VecDeque<(usize, JoinHandle<object_store::Result<PartId>>)>,
}

pub(super) struct ObjectWriter {
    inner: Arc<Inner>,
    key: String,
    buf: Vec<u8>,
    upload: Option<Upload>,
    total: u64,
    closed: bool,
}

impl ObjectWriter {
    pub(super) fn new(inner: Arc<Inner>, key: &str) -> ObjectWriter {
        ObjectWriter { inner, key: key.trim_matches('/').to_string(), buf: Vec::new(), upload: None, total: 0, closed: false }
    }

    fn path(&self) -> ObjPath {
        self.inner.path(&self.key)
    }

    /// Starts the multipart upload and records it in a marker.
    fn begin(&mut self) -> Result<()> {
        let i = &self.inner;
        let path = self.path();
        let id = block_on(i.multipart.create_multipart(&path)).map_err(|e| i.err("POST (start multipart upload)", &self.key, e))?;
        active_uploads().lock().insert(id.clone());
        crate::failpoint::hit("upload");
        let marker = match block_on(i.record_upload(&self.key, &id)) {
            Ok(m) => m,
            Err(e) => {
                let _ = block_on(i.multipart.abort_multipart(&path, &id));
                active_uploads().lock().remove(&id);
                return Err(e);
            }
        };
        self.upload = Some(Upload { id, marker, started: SystemTime::now(), parts: vec![], running: Default::default() });
        Ok(())
    }

    /// Waits for the oldest running part.
    fn wait_one(&mut self) -> Result<()> {
        let i = self.inner.clone();
        let up = self.upload.as_mut().expect("upload");
        let Some((idx, handle)) = up.running.pop_front() else { return Ok(()) };
        let part = block_on(handle)
            .map_err(|e| Error::unavailable(format!("tier '{}': {}: part {idx} was lost: {e}", i.tier, i.describe(&self.key))))?
            .map_err(|e| i.err(&format!("PUT (part {})", idx + 1), &self.key, e))?;
        up.parts[idx] = Some(part);
        Ok(())
    }

    /// Sends the buffer as the next part, once fewer than `concurrency` parts are running.
    fn send_part(&mut self) -> Result<()> {
        if self.upload.is_none() {
            self.begin()?;
        }
        while self.upload.as_ref().unwrap().running.len() >= self.inner.concurrency {
            self.wait_one()?;
        }
        let data = std::mem::take(&mut self.buf);
        let up = self.upload.as_mut().unwrap();
        let idx = up.parts.len();
        if idx >= MAX_PARTS {
            return Err(Error::invalid(format!(
                "tier '{}': {} would take more than {MAX_PARTS} parts (S3's limit; {} bytes so far): the object is \
                 larger than the store accepts; raise the tier's `part_size`",
                self.inner.tier,
                self.inner.describe(&self.key),
                self.total
            )));
        }
        up.parts.push(None);
        let (mp, path, id) = (self.inner.multipart.clone(), self.inner.path(&self.key), up.id.clone());
        let handle = runtime().spawn(async move { mp.put_part(&path, &id, idx, PutPayload::from(data)).await });
        up.running.push_back((idx, handle));
        Ok(())
    }

    fn cleanup(&mut self) {
        self.closed = true;
        self.buf = Vec::new();
        let Some(up) = self.upload.take() else { return };
        for (_, h) in &up.running {
            h.abort();
        }
        let (i, path, key) = (self.inner.clone(), self.path(), self.key.clone());
        let fut = async move {
            for (_, h) in up.running {
                let _ = h.await;
            }
            let res = i.multipart.abort_multipart(&path, &up.id).await;
            active_uploads().lock().remove(&up.id);
            match res {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                    let _ = i.delete(&up.marker).await;
                }
                // The marker stays, so that a later gc aborts the upload.
                Err(e) => log::warn!(
                    "tier '{}': cannot abort the multipart upload of {}: {}",
                    i.tier,
                    i.describe(&key),
                    sanitize(&e.to_string(), &i.secrets)
                ),
            }
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            runtime().spawn(fut);
        } else {
            block_on(fut);
        }
    }

    fn complete(&mut self) -> Result<()> {
        if self.upload.is_none() {
            // Small enough for one PUT.
            let data = std::mem::take(&mut self.buf);
            return block_on(self.inner.put(&self.key, PutPayload::from(data)));
        }
        if !self.buf.is_empty() {
            self.send_part()?;
        }
        while !self.upload.as_ref().unwrap().running.is_empty() {
            self.wait_one()?;
        }
        let i = self.inner.clone();
        let up = self.upload.as_ref().unwrap();
        let parts: Vec<PartId> = up.parts.iter().map(|p| p.clone().expect("every part finished")).collect();
        let path = self.path();
        let res = block_on(i.multipart.complete_multipart(&path, &up.id, parts));
        if let Err(e) = res {
            // The answer to a completion that succeeded may have been lost, and its retry
            // then finds no upload: the object tells.
            let landed = block_on(i.store.head(&path))
                .is_ok_and(|m| m.size == self.total && SystemTime::from(m.last_modified) + Duration::from_secs(300) >= up.started);
            if !landed {
                return Err(i.err("POST (complete multipart upload)", &self.key, e));
            }
        }
        let up = self.upload.take().unwrap();
        active_uploads().lock().remove(&up.id);
        if let Err(e) = block_on(i.delete(&up.marker)) {
            log::warn!("tier '{}': upload marker {} stays: {e}", i.tier, up.marker);
        }
        Ok(())
    }
}

impl BlobWriter for ObjectWriter {
    fn write(&mut self, mut data: &[u8]) -> Result<()> {
        self.total += data.len() as u64;
        while !data.is_empty() {
            let part = part_len(self.inner.part_size, self.upload.as_ref().map_or(0, |u| u.parts.len()));
            if self.buf.capacity() == 0 {
                self.buf.reserve_exact(part);
            }
            let take = (part - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.buf.len() == part {
                if let Err(e) = self.send_part() {
                    self.cleanup();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> Result<()> {
        let res = self.complete();
        if res.is_err() {
            self.cleanup();
        }
        self.closed = true;
        res
    }

    fn abort(mut self: Box<Self>) {
        self.cleanup();
    }
}

impl Drop for ObjectWriter {
    fn drop(&mut self) {
        if !self.closed {
            self.cleanup();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const GIB: u64 = 1 << 30;

    /// Parts an object of `size` bytes takes.
    fn parts(part_size: usize, size: u64) -> usize {
        let (mut n, mut covered) = (0, 0u64);
        while covered < size {
            covered += part_len(part_size, n) as u64;
            n += 1;
        }
        n
    }

    #[test]
    fn parts_grow_so_that_the_largest_objects_fit_in_ten_thousand() {
        assert_eq!(part_len(16 * MIB, 0), 16 * MIB);
        assert_eq!(part_len(16 * MIB, 999), 16 * MIB);
        assert_eq!(part_len(16 * MIB, 1000), 32 * MIB);
        assert_eq!(part_len(16 * MIB, 9999), 5 << 30);
        // 10,000 parts: 4.88 TiB from the 5 MiB minimum, S3's largest object (5 TiB) from the default.
        assert!(parts(5 * MIB, 4_990 * GIB) <= MAX_PARTS);
        assert!(parts(5 * MIB, 5_000 * GIB) > MAX_PARTS);
        assert!(parts(16 * MIB, 5 << 40) <= MAX_PARTS);
        // Requests per GiB never exceed those of `part_size` parts, and fall for large objects.
        for part_size in [5 * MIB, 16 * MIB, 64 * MIB] {
            let per_gib = (GIB as usize).div_ceil(part_size);
            for gib in [1u64, 10, 100, 1000, 4000] {
                let n = parts(part_size, gib * GIB);
                assert!(n as u64 <= per_gib as u64 * gib, "{part_size} {gib} GiB: {n} parts");
            }
        }
        assert_eq!(parts(16 * MIB, GIB), 64);
        assert_eq!(parts(16 * MIB, 100 * GIB), 1000 + 1000 + 850);
    }
}
