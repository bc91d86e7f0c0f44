//! Checks on a memory tier's root before it is used. /dev/shm is writable by everyone, so a
//! root there may have been made by someone else, who could then plant a step (pickled
//! items run code when restored) or read ours. A root, and every directory between /dev/shm
//! and it, must belong to this user and be writable by nobody else.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::{Error, Result};

const SHM: &str = "/dev/shm";
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Refuses an existing root (or a directory above it under /dev/shm) that another user
/// owns or that others may write to; warns when the root is not on tmpfs (then the tier is
/// a disk directory: slower, and it outlives a reboot).
pub fn check_root(tier: &str, root: &Path) -> Result<()> {
    let me = unsafe { libc::geteuid() };
    let mut dirs = vec![root];
    if root.starts_with(SHM) {
        dirs.extend(root.ancestors().skip(1).take_while(|p| *p != Path::new(SHM) && p.starts_with(SHM)));
    }
    for d in dirs {
        let m = match std::fs::symlink_metadata(d) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue, // we create it
            Err(e) => return Err(Error::io(tier, d, e)),
        };
        let mode = m.mode() & 0o7777;
        if m.uid() != me || mode & 0o022 != 0 || m.file_type().is_symlink() {
            return Err(Error::config(format!(
                "tier '{tier}': memory root {} is not safe to use: {} is {} by uid {} with mode {mode:o}; \
                 it must be a directory of yours (uid {me}) that nobody else can write. Another user may have \
                 planted steps there: choose another `root`, or remove it if it is yours",
                root.display(),
                d.display(),
                if m.file_type().is_symlink() { "a symbolic link owned" } else { "owned" },
                m.uid(),
            )));
        }
    }
    if let Some(existing) = root.ancestors().find(|p| p.exists()) {
        let c = std::ffi::CString::new(existing.as_os_str().as_encoded_bytes()).unwrap_or_default();
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0 && st.f_type as i64 != TMPFS_MAGIC {
            log::warn!(
                "tier '{tier}': memory root {} is not on tmpfs (shared memory): the tier works, but copies go to \
                 disk and steps outlive a reboot; use a directory under /dev/shm",
                root.display()
            );
        }
    }
    Ok(())
}
