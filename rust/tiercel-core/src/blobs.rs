//! Named byte objects under one root: the storage interface that every tier except the
//! memory tier stands on. Keys are '/'-separated paths relative to the root. The filesystem
//! implementation lives here; object stores implement the same trait.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::gc::{self, Removal, Target};

/// How reads from a store whose requests cost a round trip are merged (`Blobs::merged_reads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergedReads {
    /// The most stored bytes of neighbouring chunks one ranged request reads.
    pub bytes: u64,
    /// Requests in flight at once.
    pub in_flight: usize,
}

pub trait Blobs: Send + Sync {
    /// Where `key` lives, for messages (a path or URL; never credentials).
    fn describe(&self, key: &str) -> String;
    /// Atomically replaces `key` with `data`.
    fn put(&self, key: &str, data: &[u8]) -> Result<()>;
    /// Creates `key` only if it does not exist; true when this call created it.
    fn put_if_absent(&self, key: &str, data: &[u8]) -> Result<bool>;
    /// A streaming writer whose object appears (atomically) only on `finish`.
    fn create(&self, key: &str) -> Result<Box<dyn BlobWriter>>;
    fn get(&self, key: &str) -> Result<Vec<u8>>;
    /// Reads exactly `dst.len()` bytes at `offset`.
    fn get_range(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()>;
    /// `get_range`, handing each piece of `dst` to `each` as soon as it has landed, in order.
    /// A filesystem reads in `checksum::BLOCK`s, so that a checksum reads each while it is
    /// still in cache instead of going over the whole range again from memory; the default
    /// reads the range, then hands it over whole.
    fn get_range_blocks(&self, key: &str, offset: u64, dst: &mut [u8], each: &mut dyn FnMut(&[u8])) -> Result<()> {
        self.get_range(key, offset, dst)?;
        each(dst);
        Ok(())
    }
    /// Where each request costs a round trip (an object store): neighbouring chunks are read
    /// in ranged requests of up to this many bytes, this many at once. None (a filesystem):
    /// chunk by chunk, on the copy threads.
    fn merged_reads(&self) -> Option<MergedReads> {
        None
    }
    /// What this backend counts of its requests (an object store's client), for
    /// `store.metrics()`; None: it counts none.
    fn requests(&self) -> Option<std::sync::Arc<crate::requests::RequestCounters>> {
        None
    }
    fn exists(&self, key: &str) -> Result<bool>;
    /// Names of the entries directly under `prefix` ("" for the root).
    fn list(&self, prefix: &str) -> Result<Vec<String>>;
    /// Whether `list` costs no request (a directory read on this host), so that a check by
    /// listing costs nothing worth counting.
    fn lists_cheaply(&self) -> bool {
        false
    }
    /// The one name at the root under which everything `leftovers(None)` finds lives, if
    /// there is one: a root listing without it means there are none (no request to look).
    fn leftovers_under(&self) -> Option<&str> {
        None
    }
    /// Deletes `key`; a missing key is not an error.
    fn delete(&self, key: &str) -> Result<()>;
    /// Deletes everything under `prefix`.
    fn delete_prefix(&self, prefix: &str) -> Result<()>;
    /// Deletes the objects `names` (keys, as `delete` takes them), whose names the caller
    /// knows, so that nothing is listed to find them; names that are not there are not an
    /// error. One by one here (a filesystem: an unlink each); an object store overrides it
    /// with its bulk delete (S3's DeleteObjects, 1,000 keys a request). The first failure
    /// ends the call; what was deleted before it stays deleted.
    fn delete_names(&self, names: &[String]) -> Result<()> {
        names.iter().try_for_each(|n| self.delete(n))
    }
    /// What writers that died left here (see `gc`): temporary files of writers that
    /// are gone, at least `temp_age` old (None: none of them), on a filesystem; abandoned
    /// multipart uploads on an object store.
    fn leftovers(&self, _temp_age: Option<Duration>) -> Result<Vec<Removal>> {
        Ok(vec![])
    }
    /// Removes one thing `leftovers` listed; false when it was gone already.
    fn remove_leftover(&self, _r: &Removal) -> Result<bool> {
        Ok(false)
    }
}

pub trait BlobWriter: Send {
    fn write(&mut self, data: &[u8]) -> Result<()>;
    fn finish(self: Box<Self>) -> Result<()>;
    fn abort(self: Box<Self>);
}

/// A directory on a local or network filesystem. Objects appear by rename (put, create) or
/// by hard link (put_if_absent), both atomic on POSIX filesystems and NFS.
pub struct FsBlobs {
    tier: String,
    root: PathBuf,
}

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// `<path>.tmp-<pid>-<n>`: a writer's temporary file, named so that gc can tell whose it
/// is (`gc::temp_writer`) once a killed writer leaves it.
fn tmp_path(p: &Path) -> PathBuf {
    let n = TMP_SEQ.fetch_add(1, Ordering::Relaxed);
    let mut s = p.as_os_str().to_owned();
    s.push(format!("{}{}-{n}", gc::TEMP_MARKER, std::process::id()));
    PathBuf::from(s)
}

impl FsBlobs {
    pub fn new(tier: &str, root: &Path) -> Result<FsBlobs> {
        fs::create_dir_all(root).map_err(|e| Error::io(tier, root, e))?;
        Ok(FsBlobs { tier: tier.into(), root: root.into() })
    }

    fn path(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }

    fn err(&self, p: &Path, e: std::io::Error) -> Error {
        Error::io(&self.tier, p, e)
    }

    fn ensure_parent(&self, p: &Path) -> Result<()> {
        if let Some(dir) = p.parent() {
            fs::create_dir_all(dir).map_err(|e| self.err(dir, e))?;
        }
        Ok(())
    }

    fn write_tmp(&self, p: &Path, data: &[u8]) -> Result<PathBuf> {
        self.ensure_parent(p)?;
        let tmp = tmp_path(p);
        let res = (|| {
            let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
            f.write_all(data)?;
            f.sync_all()
        })();
        if let Err(e) = res {
            let _ = fs::remove_file(&tmp);
            return Err(self.err(p, e));
        }
        Ok(tmp)
    }
}

fn sync_dir(dir: &Path) {
    // Makes the rename itself durable; best effort (some filesystems refuse to open dirs).
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

impl Blobs for FsBlobs {
    fn describe(&self, key: &str) -> String {
        self.path(key).display().to_string()
    }

    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        let p = self.path(key);
        let tmp = self.write_tmp(&p, data)?;
        fs::rename(&tmp, &p).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            self.err(&p, e)
        })?;
        sync_dir(p.parent().unwrap_or(&self.root));
        Ok(())
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> Result<bool> {
        let p = self.path(key);
        let tmp = self.write_tmp(&p, data)?;
        let res = fs::hard_link(&tmp, &p);
        let _ = fs::remove_file(&tmp);
        match res {
            Ok(()) => {
                sync_dir(p.parent().unwrap_or(&self.root));
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(self.err(&p, e)),
        }
    }

    fn create(&self, key: &str) -> Result<Box<dyn BlobWriter>> {
        let p = self.path(key);
        self.ensure_parent(&p)?;
        let tmp = tmp_path(&p);
        let file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp).map_err(|e| self.err(&p, e))?;
        Ok(Box::new(FsWriter { tier: self.tier.clone(), file: std::io::BufWriter::with_capacity(1 << 20, file), tmp, dst: p }))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        let p = self.path(key);
        fs::read(&p).map_err(|e| self.err(&p, e))
    }

    fn get_range(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.get_range_blocks(key, offset, dst, &mut |_| {})
    }

    fn get_range_blocks(&self, key: &str, offset: u64, dst: &mut [u8], each: &mut dyn FnMut(&[u8])) -> Result<()> {
        let p = self.path(key);
        let f = File::open(&p).map_err(|e| self.err(&p, e))?;
        let mut at = offset;
        for block in dst.chunks_mut(crate::checksum::BLOCK) {
            f.read_exact_at(block, at).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    Error::integrity(format!("tier '{}': {} is shorter than its manifest says", self.tier, p.display()))
                        .with_tier(&self.tier)
                        .with_path(p.display().to_string())
                } else {
                    self.err(&p, e)
                }
            })?;
            each(block);
            at += block.len() as u64;
        }
        Ok(())
    }

    fn exists(&self, key: &str) -> Result<bool> {
        let p = self.path(key);
        match fs::metadata(&p) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(self.err(&p, e)),
        }
    }

    fn lists_cheaply(&self) -> bool {
        true
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        let p = self.path(prefix);
        let rd = match fs::read_dir(&p) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(self.err(&p, e)),
        };
        let mut names = vec![];
        for entry in rd {
            let entry = entry.map_err(|e| self.err(&p, e))?;
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }

    fn delete(&self, key: &str) -> Result<()> {
        let p = self.path(key);
        match fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(self.err(&p, e)),
        }
    }

    fn delete_prefix(&self, prefix: &str) -> Result<()> {
        let p = self.path(prefix);
        match fs::remove_dir_all(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(self.err(&p, e)),
        }
    }

    /// Stale temporary files anywhere under the root. Only regular files count, and symbolic
    /// links are never followed, so nothing outside the root is ever listed (or removed).
    fn leftovers(&self, temp_age: Option<Duration>) -> Result<Vec<Removal>> {
        let Some(min_age) = temp_age else { return Ok(vec![]) };
        let mut out = vec![];
        let mut dirs = vec![String::new()];
        let now = SystemTime::now();
        while let Some(dir) = dirs.pop() {
            let p = self.path(&dir);
            let rd = match fs::read_dir(&p) {
                Ok(rd) => rd,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(self.err(&p, e)),
            };
            for entry in rd.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let key = if dir.is_empty() { name.clone() } else { format!("{dir}/{name}") };
                let Ok(meta) = entry.metadata() else { continue }; // does not follow links
                if meta.is_dir() {
                    dirs.push(key);
                    continue;
                }
                if !meta.is_file() {
                    continue;
                }
                let age = meta.modified().ok().and_then(|m| now.duration_since(m).ok()).unwrap_or_default();
                if let Some(reason) = gc::stale_temp(&name, age, min_age) {
                    out.push(Removal::new(Target::TempFile { key, bytes: meta.len() }, reason));
                }
            }
        }
        out.sort_by(|a, b| a.key().cmp(&b.key()));
        Ok(out)
    }

    fn remove_leftover(&self, r: &Removal) -> Result<bool> {
        let Target::TempFile { key, .. } = &r.target else { return Ok(false) };
        let p = self.path(key);
        // Checked again: never a link, and still a temporary file.
        match fs::symlink_metadata(&p) {
            Ok(m) if m.is_file() && key.contains(gc::TEMP_MARKER) => {}
            _ => return Ok(false),
        }
        match fs::remove_file(&p) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(self.err(&p, e)),
        }
    }
}

struct FsWriter {
    tier: String,
    file: std::io::BufWriter<File>,
    tmp: PathBuf,
    dst: PathBuf,
}

impl BlobWriter for FsWriter {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.file.write_all(data).map_err(|e| Error::io(&self.tier, &self.dst, e))
    }

    fn finish(self: Box<Self>) -> Result<()> {
        let FsWriter { tier, file, tmp, dst } = *self;
        let res = (|| {
            let f = file.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
            fs::rename(&tmp, &dst)
        })();
        if let Err(e) = res {
            let _ = fs::remove_file(&tmp);
            return Err(Error::io(&tier, &dst, e));
        }
        sync_dir(dst.parent().unwrap_or(Path::new("/")));
        Ok(())
    }

    fn abort(self: Box<Self>) {
        let _ = fs::remove_file(&self.tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::{Blobs, FsBlobs};
    use crate::checksum::{crc32c, Crc32c, BLOCK};
    use crate::error::ErrorKind;

    #[test]
    fn a_file_range_is_handed_over_block_by_block_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = FsBlobs::new("disk", dir.path()).unwrap();
        let data: Vec<u8> = (0..3 * BLOCK + 1000).map(|i| (i.wrapping_mul(2654435761) >> 9) as u8).collect();
        blobs.put("obj", &data).unwrap();
        let (offset, len) = (123, 2 * BLOCK + 777);
        let mut dst = vec![0u8; len];
        let (mut digest, mut sizes) = (Crc32c::new(), vec![]);
        blobs
            .get_range_blocks("obj", offset as u64, &mut dst, &mut |b| {
                digest.update(b);
                sizes.push(b.len());
            })
            .unwrap();
        assert_eq!(dst, &data[offset..offset + len]);
        assert_eq!(digest.finish(), crc32c(&data[offset..offset + len]));
        assert_eq!(sizes, [BLOCK, BLOCK, 777]);
        // A range past the end of the file is an integrity error naming the file.
        let mut past = vec![0u8; BLOCK + 1];
        let e = blobs.get_range("obj", (data.len() - BLOCK) as u64, &mut past).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Integrity);
        assert!(e.to_string().contains("shorter than its manifest says"), "{e}");
    }
}
