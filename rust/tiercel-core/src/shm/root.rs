//! A memory tier's root: the checks before it is used, its lock, how much it holds and how
//! its pages are backed.
//!
//! /dev/shm is writable by everyone, so a root there may have been made by someone else, who
//! could then plant a step (pickled items run code when restored) or read ours. A root, and
//! every directory between /dev/shm and it, must belong to this user and be writable by
//! nobody else.

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{Error, Result};

const SHM: &str = "/dev/shm";
const TMPFS_MAGIC: i64 = 0x0102_1994;
const LOCK_FILE: &str = ".lock";

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

/// How the pages of files under a memory root are backed: by 2 MiB transparent huge pages
/// (`Some("huge=within_size")` and the like: the tmpfs mount option that gives them) or by
/// 4 KiB pages (`None`, the default for /dev/shm). With 4 KiB pages, allocating a fresh
/// segment and mapping a stored one cost one page-table entry per 4 KiB; huge pages cut that
/// 512-fold, which is most of what a first save and a restore from RAM cost beyond the copy
/// and the checksum (docs/config.md, "Huge pages").
pub fn huge_pages(root: &Path) -> Option<String> {
    let forced = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").unwrap_or_default();
    if forced.contains("[deny]") {
        return None;
    }
    if forced.contains("[force]") {
        return Some("shmem_enabled=force".into());
    }
    let existing = root.ancestors().find(|p| p.exists())?.canonicalize().ok()?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    huge_option(&mountinfo, &existing)
}

/// An exclusive flock on the tier root, held while a rank decides what to allocate or evict,
/// so ranks sharing a host's memory tier never overshoot its capacity together.
pub struct RootLock(File);

impl RootLock {
    pub fn take(tier: &str, root: &Path) -> Result<RootLock> {
        let p = root.join(LOCK_FILE);
        let f = OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).open(&p).map_err(|e| Error::io(tier, &p, e))?;
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(Error::io(tier, &p, std::io::Error::last_os_error()));
        }
        Ok(RootLock(f))
    }
}

impl Drop for RootLock {
    fn drop(&mut self) {
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Bytes allocated under `p` (blocks, not apparent sizes: what the host really gave).
pub fn dir_bytes(p: &Path, tier: &str) -> Result<u64> {
    let rd = match fs::read_dir(p) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io(tier, p, e)),
    };
    let mut n = 0;
    for e in rd.flatten() {
        match e.metadata() {
            Ok(m) if m.is_dir() => n += dir_bytes(&e.path(), tier)?,
            Ok(m) => n += m.blocks() * 512,
            Err(_) => {} // removed while we looked
        }
    }
    Ok(n)
}

/// Asks for huge pages on a mapping of a memory-tier file: what a tmpfs mounted with
/// `huge=advise` waits for (the other `huge=` settings need no asking; 4 KiB tmpfs ignores it).
pub fn advise_huge(map: &[u8]) {
    if !map.is_empty() {
        unsafe { libc::madvise(map.as_ptr() as *mut libc::c_void, map.len(), libc::MADV_HUGEPAGE) };
    }
}

/// Buffers from this size on get advice on their page size (`zeroed_buffer`).
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed buffer of `len` bytes that a read is about to fill (a restore from a tier that
/// is not this host's memory). The allocation is `calloc`'s, so the memory is not written
/// here: its pages fault in where the read first writes them, and a large buffer's page size
/// is chosen for that (`huge_pages_for_reads`).
pub fn zeroed_buffer(len: usize) -> Vec<u8> {
    let v = vec![0u8; len];
    if len >= 2 * HUGE_PAGE {
        // Only whole huge pages inside the buffer: advice on a neighbour's memory would
        // change its page size, and is not given.
        let start = (v.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
        let end = (v.as_ptr() as usize + len) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            let advice = if huge_pages_for_reads() { libc::MADV_HUGEPAGE } else { libc::MADV_NOHUGEPAGE };
            // SAFETY: madvise on whole pages inside this allocation; the advice only
            // changes how the kernel backs them, never their contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
        }
    }
    v
}

/// Whether a read buffer asks for 2 MiB pages. On a host that owns its memory it does: a
/// fresh 4 KiB page costs a fault and its zeroing, and those faults were a quarter of a
/// peer restore's CPU (perf, 256 MiB); 2 MiB pages take 512 times fewer. On a VM whose
/// balloon reports free memory to the hypervisor it does not: the guest hands back free
/// 2 MiB blocks within seconds, a huge-page fault takes one of them, and the host must back
/// it again. Measured on such a VM: first touch of 256 MiB in 650 ms on huge pages against
/// 110-140 ms on 4 KiB pages (and 14 ms on huge pages freed a moment before); a restore from
/// S3 of 256 MiB into fresh memory 500-650 ms against 260-310 ms.
fn huge_pages_for_reads() -> bool {
    static HUGE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HUGE.get_or_init(|| {
        let reported = fs::read_dir(BALLOONS)
            .into_iter()
            .flatten()
            .flatten()
            .any(|d| fs::read_to_string(d.path().join("features")).is_ok_and(|f| reports_free_pages(&f)));
        if reported {
            log::info!(
                "this VM reports free memory to its host: restores read into 4 KiB pages (huge pages would be backed again on first touch)"
            );
        }
        !reported
    })
}

/// The virtio balloon devices of this guest, each with its negotiated `features`.
const BALLOONS: &str = "/sys/bus/virtio/drivers/virtio_balloon";

/// Whether a virtio device's `features` (one '0' or '1' per feature bit, bit 0 first) has
/// VIRTIO_BALLOON_F_REPORTING (bit 5): the guest reports its free pages to the host.
fn reports_free_pages(features: &str) -> bool {
    features.trim().as_bytes().get(5) == Some(&b'1')
}

/// The `huge=` option of the tmpfs mount that holds `path` (the longest mount point above
/// it), from /proc/self/mountinfo: `id parent dev root mountpoint opts [tags] - fstype source
/// superopts`.
fn huge_option(mountinfo: &str, path: &Path) -> Option<String> {
    let mut best: Option<(usize, Option<String>)> = None;
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(dash) = fields.iter().position(|f| *f == "-") else { continue };
        let (Some(point), Some(fstype), Some(superopts)) = (fields.get(4), fields.get(dash + 1), fields.get(dash + 3)) else {
            continue;
        };
        // Mount points escape blanks and backslashes as octal (`\040`).
        let point = point.replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\");
        if !path.starts_with(&point) || best.as_ref().is_some_and(|(len, _)| *len > point.len()) {
            continue;
        }
        let huge = (*fstype == "tmpfs")
            .then(|| superopts.split(',').find(|o| o.starts_with("huge=") && *o != "huge=never").map(str::to_string))
            .flatten();
        best = Some((point.len(), huge));
    }
    best.and_then(|(_, h)| h)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 0:21 / / rw,relatime - ext4 /dev/vda rw
30 22 0:26 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=24683584k
41 22 0:40 / /mnt/huge rw,relatime - tmpfs tmpfs rw,size=4194304k,huge=within_size
42 41 0:41 / /mnt/huge/small rw,relatime - tmpfs tmpfs rw,size=1024k
43 22 0:42 / /mnt/with\\040blank rw - tmpfs tmpfs rw,huge=always
44 22 0:43 / /mnt/never rw - tmpfs tmpfs rw,huge=never
";

    #[test]
    fn huge_option_of_the_innermost_mount() {
        let at = |p: &str| huge_option(MOUNTINFO, Path::new(p));
        assert_eq!(at("/dev/shm/tiercel"), None);
        assert_eq!(at("/mnt/huge/tiercel/ram"), Some("huge=within_size".into()));
        assert_eq!(at("/mnt/huge/small/x"), None, "an inner mount without huge pages wins");
        assert_eq!(at("/mnt/with blank/r"), Some("huge=always".into()));
        assert_eq!(at("/mnt/never/r"), None);
        assert_eq!(at("/var/tmp"), None, "not tmpfs");
        assert_eq!(at("/mnt/hugepages"), None, "a mount point is a whole path component");
    }

    /// AnonHugePages (kB) of the mapping that holds `addr`, from /proc/self/smaps.
    fn anon_huge_kb(addr: usize) -> u64 {
        let smaps = fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-') && !r.ends_with(':')) {
                let (a, b) = range.split_once('-').unwrap();
                let (a, b) = (usize::from_str_radix(a, 16).unwrap_or(0), usize::from_str_radix(b, 16).unwrap_or(0));
                inside = (a..b).contains(&addr);
            } else if inside {
                if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                    return kb.trim().trim_end_matches("kB").trim().parse().unwrap();
                }
            }
        }
        0
    }

    #[test]
    fn a_large_read_buffer_is_zeroed_and_backed_by_the_page_size_chosen_for_reads() {
        for len in [0, 100, 4 << 20, (16 << 20) + 13] {
            let v = zeroed_buffer(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|b| *b == 0));
        }
        let mut v = zeroed_buffer(16 << 20);
        v.fill(1); // what a read does: the first writes fault the pages in
        let thp = fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if thp.contains("[never]") || thp.is_empty() {
            eprintln!("transparent huge pages are off here: nothing more to check");
            return;
        }
        let huge = anon_huge_kb(v.as_ptr() as usize + (8 << 20));
        if huge_pages_for_reads() {
            assert!(huge > 0, "no huge page under the buffer (THP: {})", thp.trim());
        } else {
            assert_eq!(huge, 0, "huge pages under the buffer on a VM that reports free pages (THP: {})", thp.trim());
        }
    }

    #[test]
    fn free_page_reporting_is_read_from_bit_5_of_a_balloons_features() {
        // Read off a VM whose balloon reports free pages: stats, deflate-on-OOM, reporting.
        assert!(reports_free_pages("0110010100000000000000000000000010000000\n"));
        assert!(!reports_free_pages("0110000100000000000000000000000010000000\n"));
        assert!(!reports_free_pages("01100"), "too short to have bit 5");
        assert!(!reports_free_pages(""));
    }
}
