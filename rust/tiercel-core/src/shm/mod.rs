//! Shared memory on this host: the mappings of memory-tier files that the rest of the crate
//! hands around (a `Segment` a rank writes a step into, a `View` a restore reads from without
//! copying, which the peer transport also serves from), and `root`, what a memory tier's root
//! must be and how its pages are backed.
//!
//! These are vocabulary: the memory tier (`tier::memory`) makes them; the store, the peer
//! transport and the bindings only use them.

pub mod root;

use std::path::PathBuf;

use memmap2::MmapMut;
use parking_lot::Mutex;

use crate::lease::Lease;

/// A writable shared mapping of one shared-memory file.
pub struct Segment {
    // Set by the memory tier, which makes, recycles and renames its segments.
    pub(crate) path: Mutex<PathBuf>,
    pub(crate) map: MmapMut,
}

impl Segment {
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    /// Base pointer for the parallel copy. Writers touch disjoint ranges only.
    pub fn ptr(&self) -> *mut u8 {
        self.map.as_ptr() as *mut u8
    }
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
    pub fn path(&self) -> PathBuf {
        self.path.lock().clone()
    }
}

/// A read view of a stored object, private (copy-on-write): a user writing into a restored
/// array never changes the checkpoint. It holds a read lease on the file (`lease`), so
/// no writer in any process recycles the file under it.
pub struct View {
    // Set by the memory tier, which maps the file and takes the lease.
    pub(crate) map: MmapMut,
    pub(crate) _lease: Option<Lease>,
}

impl View {
    /// Maps the pages of bytes `range` (clamped to the view) for reading ahead of use, in one
    /// call rather than one fault per few pages, without copying them (MADV_POPULATE_READ,
    /// Linux 5.14+; on older kernels a harmless no-op, and the pages fault in on first touch).
    pub fn populate(&self, range: std::ops::Range<usize>) {
        const MADV_POPULATE_READ: libc::c_int = 22;
        const PAGE: usize = 4096;
        let end = range.end.min(self.map.len());
        // madvise takes a page-aligned start; the map itself is.
        let start = range.start / PAGE * PAGE;
        if start < end {
            unsafe { libc::madvise(self.map.as_ptr().add(start) as *mut libc::c_void, end - start, MADV_POPULATE_READ) };
        }
    }
}

impl std::ops::Deref for View {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}
