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
//! Whoever wants to recycle or remove takes the exclusive lock without waiting; failing
//! that, someone holds a lease.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

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
