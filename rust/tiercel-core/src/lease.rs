//! Leases on memory-tier files and step directories, shared by every process on the host:
//! `flock` locks, which conflict between open files (not processes), so they hold between
//! two stores of one process as well as between a trainer and another process.
//!
//! - A **read lease** (shared lock on a part file) is held for as long as a zero-copy view
//!   of the file is mapped. A file under a read lease is never recycled (rewritten or cut
//!   down for another step): its writer deletes it instead, and the view keeps its pages.
//! - A **write lease** (shared lock on a step directory) is held by a writer from `begin`
//!   until its background flush has published and committed. Retention and eviction never
//!   remove a step under a write lease.
//!
//! - A **writer lease** (exclusive lock on `<root>/.writers/rank-NNNNN`) is held by the one
//!   process that saves rank N into a memory or fs tier, from its first save until its store
//!   closes (or the process dies: the kernel drops the lock). A second live process that
//!   would save the same rank into the same root is refused before it writes a byte (two
//!   jobs in one directory would otherwise replace each other's steps), and `tiercel gc`
//!   knows an uncommitted step whose writers hold no lease is abandoned.
//!
//! Whoever wants to recycle or remove takes the exclusive lock without waiting; failing
//! that, someone holds a lease.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

fn flock(f: &File, op: libc::c_int) -> std::io::Result<bool> {
    if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Ok(false);
    }
    Err(e)
}

/// A shared lock on an open file or directory, held until dropped (closing the file).
#[derive(Debug)]
pub struct Lease(#[allow(dead_code)] File);

impl Lease {
    /// Takes a shared lock on `f`, which was opened from `path`, and checks that `path` still
    /// names it: a file renamed away (recycled) or a directory removed between the open and
    /// the lock is not leased. Returns None then.
    pub fn take(f: File, path: &Path) -> std::io::Result<Option<Lease>> {
        flock(&f, libc::LOCK_SH)?;
        let ino = f.metadata()?.ino();
        match std::fs::metadata(path) {
            Ok(m) if m.ino() == ino => Ok(Some(Lease(f))),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// An exclusive lock on `path`, taken without waiting, while `f` runs: `f` gets false when
/// someone holds a lease on it (or it cannot be opened), true when nobody does.
pub fn with_exclusive<R>(path: &Path, f: impl FnOnce(bool) -> R) -> R {
    let Ok(file) = File::open(path) else { return f(false) };
    match flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
        Ok(true) => {
            let r = f(true);
            let _ = flock(&file, libc::LOCK_UN);
            r
        }
        _ => f(false),
    }
}

/// Whether someone holds a lease on `path` (a missing path has none).
pub fn leased(path: &Path) -> bool {
    if !path.exists() {
        return false;
    }
    !with_exclusive(path, |free| free)
}

/// Where writer leases live under a tier's root.
pub const WRITERS_DIR: &str = ".writers";

/// The writer lease file of `rank` under `root`.
pub fn writer_path(root: &Path, rank: u32) -> PathBuf {
    root.join(WRITERS_DIR).join(format!("rank-{rank:05}"))
}

/// An exclusive lock on a rank's writer file, held while the process may save that rank into
/// the tier (see the module's notes). The file says who holds it, for the error a second
/// writer gets.
#[derive(Debug)]
pub struct WriterLease {
    #[allow(dead_code)]
    file: File,
    path: PathBuf,
}

/// The writer leases this process holds, by file: two stores of one process (a reader and a
/// writer, a store reopened before the old one is dropped) share one lease rather than
/// refusing each other.
static HELD: parking_lot::Mutex<Option<HashMap<PathBuf, Weak<WriterLease>>>> = parking_lot::Mutex::new(None);

/// Tries to take the lock a few times: someone probing whether the lease is held (`leased`,
/// `tiercel gc`) holds it for an instant.
const TRIES: u32 = 5;

impl WriterLease {
    /// Takes `rank`'s writer lease under `root` for this process, which `who` describes
    /// (pid, host, launch, run). Ok(Err(holder)): another live process holds it, as its file
    /// says ("pid 42 on host h, launch 1a2b, since ...").
    pub fn take(root: &Path, rank: u32, who: &str) -> std::io::Result<std::result::Result<Arc<WriterLease>, String>> {
        let path = writer_path(root, rank);
        let mut held = HELD.lock();
        let held = held.get_or_insert_with(HashMap::new);
        held.retain(|_, l| l.strong_count() > 0);
        if let Some(l) = held.get(&path).and_then(Weak::upgrade) {
            return Ok(Ok(l));
        }
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(root.join(WRITERS_DIR))?;
        let mut file = OpenOptions::new().create(true).truncate(false).read(true).write(true).mode(0o600).open(&path)?;
        for i in 0..TRIES {
            if flock(&file, libc::LOCK_EX | libc::LOCK_NB)? {
                file.set_len(0)?;
                file.write_all(who.as_bytes())?;
                let lease = Arc::new(WriterLease { file, path: path.clone() });
                held.insert(path, Arc::downgrade(&lease));
                return Ok(Ok(lease));
            }
            if i + 1 < TRIES {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let mut text = String::new();
        file.rewind()?;
        file.read_to_string(&mut text)?;
        let text = text.trim();
        Ok(Err(if text.is_empty() { "another process (it has not said who yet)".to_string() } else { text.to_string() }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Whether any process holds a writer lease under `root`: some job may still save (and
/// commit) steps there.
pub fn any_writer(root: &Path) -> bool {
    let Ok(rd) = std::fs::read_dir(root.join(WRITERS_DIR)) else { return false };
    rd.flatten().any(|e| e.file_type().is_ok_and(|t| t.is_file()) && leased(&e.path()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writer_lease_is_shared_in_a_process_and_said_who_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let a = WriterLease::take(dir.path(), 3, "pid 1 (first)").unwrap().unwrap();
        let b = WriterLease::take(dir.path(), 3, "pid 1 (second store)").unwrap().unwrap();
        assert!(Arc::ptr_eq(&a, &b), "one process holds one lease per file");
        assert!(any_writer(dir.path()) && leased(a.path()));
        assert_eq!(std::fs::read_to_string(a.path()).unwrap(), "pid 1 (first)");
        // Another open file of the same path (as another process would open it) is refused.
        let other = File::open(a.path()).unwrap();
        assert!(!flock(&other, libc::LOCK_EX | libc::LOCK_NB).unwrap());
        drop((a, b));
        assert!(!any_writer(dir.path()), "dropped with the last store");
        assert!(WriterLease::take(dir.path(), 3, "next").unwrap().is_ok());
    }
}
