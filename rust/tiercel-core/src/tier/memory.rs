//! The memory tier: one shared-memory file per `put` of a rank (under /dev/shm by default),
//! so a checkpoint outlives the trainer process that wrote it.
//!
//! Copying into freshly created tmpfs pages runs at ~1 GB/s (allocation and zeroing), into
//! pages already touched at ~13 GB/s. So segments of evicted steps are recycled through a
//! per-process pool, and new ones are allocated and pre-faulted off the critical path
//! (`prefault`), as GEMINI keeps two CPU buffers per copy for the same reason.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};
use parking_lot::Mutex;

use crate::blobs::FsBlobs;
use crate::error::{Error, Result};
use crate::format::ChunkSource;
use crate::format::{self, Manifest, ObjectMeta};
use crate::gc::{self, GcOptions, Removal, Target};
use crate::lease::{self, Lease};
use crate::policy::format_size;
use crate::scheduler::Link;
use crate::shm::root::{dir_bytes, RootLock};
use crate::shm::{Segment, View};
use crate::tier::layout::StepLayout;
use crate::tier::Tier;

const POOL_DIR: &str = ".pool";

pub struct MemoryTier {
    name: String,
    root: PathBuf,
    /// The step layout over the root's files (manifests, commit records, part files).
    layout: StepLayout,
    capacity: Option<u64>,
    /// Recyclable, pre-faulted segments of this process.
    pool: Mutex<Vec<Arc<Segment>>>,
    /// This process's segments of steps it wrote, until they are evicted.
    owned: Mutex<BTreeMap<u64, Vec<Arc<Segment>>>>,
    /// The ranks that share this host's root, once known; a step commits here when all of
    /// them have written it. Unknown: every rank of the job (one host).
    local_ranks: parking_lot::RwLock<Option<Vec<u32>>>,
    /// The root's huge-page setting (`shm::root::huge_pages`), for the log and `tiercel ls`.
    huge_pages: Option<String>,
}

/// Pool file names are `<pid>-<n>.seg`; `n` is process-wide because several stores (ranks)
/// in one process may share a root.
static POOL_SEQ: AtomicU64 = AtomicU64::new(0);

/// Room kept for a part's manifest and commit record beside its data, so that they too stay
/// within capacity.
const META_RESERVE: u64 = 2 * 4096;

impl MemoryTier {
    pub fn open(name: &str, root: &Path, capacity: Option<u64>) -> Result<Arc<MemoryTier>> {
        crate::shm::root::check_root(name, root)?;
        fs::DirBuilder::new().recursive(true).mode(0o700).create(root.join(POOL_DIR)).map_err(|e| Error::io(name, root, e))?;
        let t = MemoryTier {
            name: name.into(),
            root: root.into(),
            layout: StepLayout::new(name, Arc::new(FsBlobs::new(name, root)?)),
            capacity,
            pool: Mutex::new(vec![]),
            owned: Mutex::new(BTreeMap::new()),
            local_ranks: parking_lot::RwLock::new(None),
            huge_pages: crate::shm::root::huge_pages(root),
        };
        match &t.huge_pages {
            Some(h) => log::info!("tier '{name}': memory root {} is backed by huge pages ({h})", root.display()),
            None => log::info!(
                "tier '{name}': memory root {} is backed by 4 KiB pages; a tmpfs mounted with huge=within_size makes \
                 first saves and restores from RAM faster (docs/config.md, \"Huge pages\")",
                root.display()
            ),
        }
        let dead = t.dead_pool_segments()?;
        t.gc_apply(dead)?;
        Ok(Arc::new(t))
    }

    /// Tells the tier which ranks write to this host's root.
    pub fn set_local_ranks(&self, ranks: Vec<u32>) {
        *self.local_ranks.write() = Some(ranks);
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// The root's huge-page setting (`shm::root::huge_pages`): `None` for 4 KiB pages.
    pub fn huge_pages(&self) -> Option<&str> {
        self.huge_pages.as_deref()
    }

    /// Pool files are named `<pid>-<n>.seg`; those of processes that are gone hold memory
    /// nobody will use again (removed when a store opens the tier, and by gc).
    fn dead_pool_segments(&self) -> Result<Vec<Removal>> {
        let mut out = vec![];
        for name in self.layout.blobs().list(POOL_DIR)? {
            let pid = name.split('-').next().and_then(|p| p.parse::<u32>().ok());
            if pid.is_none_or(|p| !gc::pid_alive(p)) {
                let path = self.root.join(POOL_DIR).join(&name);
                let bytes = fs::symlink_metadata(&path).map(|m| m.blocks() * 512).unwrap_or(0);
                let who = pid.map_or("an unknown process".to_string(), |p| format!("pid {p}"));
                out.push(Removal::new(
                    Target::Segment { key: format!("{POOL_DIR}/{name}"), bytes },
                    format!("spare shared-memory segment of {who}, which is gone"),
                ));
            }
        }
        Ok(out)
    }

    fn pool_path(&self) -> PathBuf {
        let n = POOL_SEQ.fetch_add(1, Ordering::Relaxed);
        self.root.join(POOL_DIR).join(format!("{}-{n}.seg", std::process::id()))
    }

    /// Bytes held under the root: every step of every rank on this host, and every pool.
    pub fn used_bytes(&self) -> Result<u64> {
        dir_bytes(&self.root, &self.name)
    }

    fn new_segment(&self, size: u64) -> Result<Arc<Segment>> {
        let path = self.pool_path();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io(&self.name, &path, e))?;
        // fallocate, not just ftruncate: a full tmpfs must fail here with ENOSPC rather than
        // kill the trainer with SIGBUS halfway through the copy.
        if size > 0 && unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, size as libc::off_t) } != 0 {
            let e = std::io::Error::last_os_error();
            let _ = fs::remove_file(&path);
            return Err(Error::io(&self.name, &path, e).context(format!(
                "cannot allocate {} of shared memory (is {} full? see `df -h {}`)",
                format_size(size),
                self.root.display(),
                self.root.display()
            )));
        }
        self.map_segment(f, path, size)
    }

    fn map_segment(&self, f: File, path: PathBuf, size: u64) -> Result<Arc<Segment>> {
        let map = if size == 0 {
            MmapMut::map_anon(0).map_err(|e| Error::io(&self.name, &path, e))?
        } else {
            unsafe { MmapOptions::new().len(size as usize).populate().map_mut(&f) }.map_err(|e| Error::io(&self.name, &path, e))?
        };
        crate::shm::root::advise_huge(&map);
        Ok(Arc::new(Segment { path: Mutex::new(path), map }))
    }

    /// Takes a pool segment of exactly `size` bytes (a larger one is cut down), or none.
    fn take_pooled(&self, size: u64) -> Result<Option<Arc<Segment>>> {
        let mut pool = self.pool.lock();
        let pick = pool.iter().enumerate().filter(|(_, s)| s.len() as u64 >= size).min_by_key(|(_, s)| s.len()).map(|(i, _)| i);
        let Some(i) = pick else { return Ok(None) };
        let seg = pool.swap_remove(i);
        drop(pool);
        if seg.len() as u64 == size {
            return Ok(Some(seg));
        }
        let path = seg.path();
        let f = OpenOptions::new().read(true).write(true).open(&path).map_err(|e| Error::io(&self.name, &path, e))?;
        match Arc::try_unwrap(seg) {
            // The mapping is shrunk in place (its tail goes), then the file: mapping the cut
            // segment again would fill a page-table entry per 4 KiB page (a brand-new job's
            // 1 GiB first save into a `Store::prefault`ed segment measured 2.1x a memcpy that
            // way, against 0.9x for a segment of the exact size).
            Ok(mut seg) if size > 0 => {
                // SAFETY: shrinking only; nothing else maps or borrows this segment (the Arc
                // was its only owner), and the bytes past `size` are never read again.
                unsafe { seg.map.remap(size as usize, memmap2::RemapOptions::new()) }.map_err(|e| Error::io(&self.name, &path, e))?;
                f.set_len(size).map_err(|e| Error::io(&self.name, &path, e))?;
                Ok(Some(Arc::new(seg)))
            }
            seg => {
                drop(seg);
                f.set_len(size).map_err(|e| Error::io(&self.name, &path, e))?;
                Ok(Some(self.map_segment(f, path, size)?))
            }
        }
    }

    /// Steps that may be evicted to make room for `step`, oldest first: uncommitted
    /// leftovers older than the newest committed step, then committed steps but the newest.
    /// The newest committed step is never evicted for a step that may yet fail.
    fn evictable(&self, step: u64) -> Result<Vec<u64>> {
        let committed = self.committed_steps()?;
        let newest = committed.last().copied();
        let mut v: Vec<u64> =
            self.all_steps()?.into_iter().filter(|s| *s != step && !committed.contains(s) && newest.is_some_and(|n| *s < n)).collect();
        v.extend(committed.iter().copied().filter(|s| Some(*s) != newest && *s != step));
        v.retain(|s| !self.being_written(*s));
        Ok(v)
    }

    /// A segment of `size` bytes within capacity: a spare one that fits, else a new one. To
    /// make room it drops spare segments too small to use, then evicts steps oldest first,
    /// trying the pool again after each (an evicted step's segments return to it). When even
    /// evicting everything allowed could not make room, it fails before evicting anything.
    fn reserve(&self, size: u64, step: u64, rank: u32) -> Result<Arc<Segment>> {
        loop {
            if let Some(seg) = self.take_pooled(size)? {
                return Ok(seg);
            }
            let Some(cap) = self.capacity else { return self.new_segment(size) };
            let need = size + META_RESERVE;
            let used = self.used_bytes()?;
            if used + need <= cap {
                return self.new_segment(size);
            }
            let victims = self.evictable(step)?;
            let spare: u64 = self.pool.lock().iter().map(|s| s.len() as u64).sum();
            let mut freeable = spare;
            for v in &victims {
                freeable += dir_bytes(&self.root.join(format::step_dir(*v)), &self.name)?;
            }
            if used.saturating_sub(freeable) + need > cap {
                return Err(Error::capacity(format!(
                    "tier '{}' ({}): step {step} rank {rank} needs {}; {} of the {} capacity are in use and at most {} \
                     could be freed without evicting the newest committed step: raise `capacity` or save less per step",
                    self.name,
                    self.root.display(),
                    format_size(need),
                    format_size(used),
                    format_size(cap),
                    format_size(freeable),
                ))
                .with_tier(&self.name)
                .at(step, rank)
                .with_path(self.root.display().to_string()));
            }
            // Bind first: `evict` locks the pool again.
            let too_small = self.pool.lock().pop();
            if let Some(seg) = too_small {
                let _ = fs::remove_file(seg.path());
                continue;
            }
            log::info!("tier '{}': evicting step {} to make room for step {step}", self.name, victims[0]);
            self.evict(victims[0])?;
        }
    }

    /// A writable segment of `size` bytes for part `part` of `rank` at `step`: recycled from
    /// the pool when one fits, else newly allocated (never beyond `capacity`).
    pub fn allocate(&self, step: u64, rank: u32, part: usize, size: u64) -> Result<Arc<Segment>> {
        let _lock = RootLock::take(&self.name, &self.root)?;
        let seg = self.reserve(size, step, rank)?;
        let dir = self.root.join(format::step_dir(step));
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(|e| Error::io(&self.name, &dir, e))?;
        if part == 0 {
            // Saving a step again (a job that resumed from an older step redoes it): the old
            // commit and this rank's old manifest go before any of its data is replaced, so no
            // reader mixes old and new, and no stale manifest counts towards a new commit.
            self.layout.uncommit(step, rank)?;
        }
        let dst = dir.join(format::part_name(rank, part));
        let src = seg.path();
        fs::rename(&src, &dst).map_err(|e| Error::io(&self.name, &dst, e))?;
        let mut owned = self.owned.lock();
        let mine = owned.entry(step).or_default();
        // Saving a step again replaces its part file: the segment that had this name has
        // none now, and must not be recycled (or deleted) under it later.
        mine.retain(|s| s.path() != dst);
        *seg.path.lock() = dst;
        mine.push(seg.clone());
        drop(owned);
        Ok(seg)
    }

    /// Writes `m` (this tier's manifest of one rank) atomically: the rank's part is complete.
    pub fn publish(&self, m: &Manifest) -> Result<()> {
        self.layout.write_manifest(m)
    }

    /// Removes one object of `step` (a part of a replica that never completed).
    pub fn remove_object(&self, step: u64, name: &str) -> Result<()> {
        self.layout.blobs().delete(&crate::tier::layout::key(step, name))
    }

    /// This process's segments of `step` (for the background jobs that persist them).
    pub fn owned_segments(&self, step: u64) -> Vec<Arc<Segment>> {
        self.owned.lock().get(&step).cloned().unwrap_or_default()
    }

    /// Drops this process's record of a step it abandoned (its files are already gone).
    pub fn forget(&self, step: u64) {
        self.owned.lock().remove(&step);
    }

    /// Maps a stored object for reading, under a read lease: no writer recycles the file
    /// while the view lives. A file that retention removed meanwhile is not found. Every page
    /// is mapped before it returns, on every copy thread (for a reader that sends the whole
    /// object on, such as the peer server).
    pub fn map_view(&self, step: u64, object: &str) -> Result<Arc<View>> {
        let view = self.open_view(step, object)?;
        // Mapping the pages costs about as much as checksumming them: do it on every copy
        // thread, in slices.
        const SLICE: usize = 16 << 20;
        use rayon::prelude::*;
        (0..view.len().div_ceil(SLICE)).into_par_iter().for_each(|i| view.populate(i * SLICE..view.len().min((i + 1) * SLICE)));
        Ok(view)
    }

    /// `map_view` without mapping the pages ahead: each is mapped on first touch, or by
    /// `View::populate` (the restore path maps and checksums chunk by chunk, on all threads).
    pub fn open_view(&self, step: u64, object: &str) -> Result<Arc<View>> {
        let path = self.root.join(format::step_dir(step)).join(object);
        let f = File::open(&path).map_err(|e| Error::io(&self.name, &path, e))?;
        let gone = || Error::not_found(format!("tier '{}': step {step} was removed (retention) while it was read", self.name));
        let lease = Lease::take(f.try_clone().map_err(|e| Error::io(&self.name, &path, e))?, &path)
            .map_err(|e| Error::io(&self.name, &path, e))?
            .ok_or_else(gone)?;
        let meta = f.metadata().map_err(|e| Error::io(&self.name, &path, e))?;
        // Not MAP_POPULATE: on a private writable mapping it pre-faults for writing, which
        // copies every page. `View::populate` maps the shared pages without copying.
        let map = if meta.len() == 0 { MmapMut::map_anon(0) } else { unsafe { MmapOptions::new().map_copy(&f) } }
            .map_err(|e| Error::io(&self.name, &path, e))?;
        crate::shm::root::advise_huge(&map);
        Ok(Arc::new(View { map, _lease: Some(lease) }))
    }

    /// A write lease on `step` (its directory, created if need be): held by a writer until
    /// its flush has committed, so that no retention or eviction, in any process on this
    /// host, removes the step meanwhile.
    pub fn lease_step(&self, step: u64) -> Result<Lease> {
        let dir = self.root.join(format::step_dir(step));
        loop {
            fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(|e| Error::io(&self.name, &dir, e))?;
            let f = File::open(&dir).map_err(|e| Error::io(&self.name, &dir, e))?;
            // None: removed between the create and the lock; make it again.
            if let Some(l) = Lease::take(f, &dir).map_err(|e| Error::io(&self.name, &dir, e))? {
                return Ok(l);
            }
        }
    }

    /// Whether a writer (of any process) holds `step`'s write lease.
    pub fn being_written(&self, step: u64) -> bool {
        lease::leased(&self.root.join(format::step_dir(step)))
    }

    /// Removes a step from this host's memory: commit record first, then this process's own
    /// segments go back to the pool (unless something still maps them), the rest is deleted.
    pub fn evict(&self, step: u64) -> Result<()> {
        let dir = format::step_dir(step);
        self.layout.blobs().delete(&crate::tier::layout::key(step, format::COMMIT_NAME))?;
        crate::failpoint::hit("evict");
        let mine = self.owned.lock().remove(&step).unwrap_or_default();
        for seg in mine {
            // Recycled only when nothing maps it: no job of ours (the Arc) and no reader in
            // any process (a read lease). Otherwise it is deleted with the step: unlinked,
            // its pages live on for whoever maps them.
            if Arc::strong_count(&seg) == 1 {
                let path = seg.path();
                let to = self.pool_path();
                if lease::with_exclusive(&path, |free| free && fs::rename(&path, &to).is_ok()) {
                    *seg.path.lock() = to;
                    self.pool.lock().push(seg);
                }
            }
        }
        self.layout.blobs().delete_prefix(&dir)
    }

    /// Pre-faults pool segments for the given part sizes (the shape of the next step), as
    /// far as capacity allows without evicting anything. Runs in the background.
    pub fn prefault(&self, sizes: &[u64]) -> Result<()> {
        let _lock = RootLock::take(&self.name, &self.root)?;
        let mut have: Vec<u64> = self.pool.lock().iter().map(|s| s.len() as u64).collect();
        for &size in sizes {
            if let Some(i) = have.iter().position(|&h| h == size) {
                have.swap_remove(i);
                continue;
            }
            if let Some(cap) = self.capacity {
                if self.used_bytes()? + size + META_RESERVE > cap {
                    return Ok(());
                }
            }
            let seg = self.new_segment(size)?;
            self.pool.lock().push(seg);
        }
        Ok(())
    }

    /// Number of spare pre-faulted segments (for tests and stats).
    pub fn pool_len(&self) -> usize {
        self.pool.lock().len()
    }

    /// Releases this process's pool (its files) on close.
    pub fn release_pool(&self) {
        for seg in self.pool.lock().drain(..) {
            let _ = fs::remove_file(seg.path());
        }
    }
}

impl Tier for MemoryTier {
    super::layout::forward_to_layout!();

    fn name(&self) -> &str {
        &self.name
    }

    /// Copies a rank's step in from elsewhere (CLI `cp`, tests): one segment, raw layout.
    fn write_rank(&self, logical: &Manifest, src: &dyn ChunkSource, link: &Link) -> Result<Manifest> {
        let mut m = logical.clone();
        m.tier = self.name.clone();
        let mut pos = 0u64;
        let mut places = vec![];
        for it in &m.items {
            pos = format::align_up(pos, format::ITEM_ALIGN);
            places.push(pos);
            pos += it.nbytes;
        }
        let seg = self.allocate(m.step, m.rank, 0, pos)?;
        for (i, it) in m.items.iter_mut().enumerate() {
            for (c, ch) in it.chunks.iter_mut().enumerate() {
                let start = (places[i] + ch.offset) as usize;
                let dst = unsafe { std::slice::from_raw_parts_mut(seg.ptr().add(start), ch.len as usize) };
                link.acquire(ch.len);
                src.read_raw(i, c, dst)?;
                ch.object = 0;
                ch.stored_offset = start as u64;
                ch.stored_len = ch.len;
                ch.codec = crate::codec::RAW.into();
            }
        }
        m.objects = vec![ObjectMeta { name: format::part_name(m.rank, 0), len: pos, key: None }];
        self.publish(&m)?;
        Ok(m)
    }

    /// Commits once every rank that shares this host's root has written the step.
    fn try_commit(&self, step: u64, world_size: u32) -> Result<bool> {
        let local = self.local_ranks.read().clone();
        self.layout.try_commit(step, world_size, local)
    }

    fn delete_step(&self, step: u64) -> Result<()> {
        self.evict(step)
    }

    /// The layout's plan, uncommitted steps nobody will commit (a gc run for dead writers'
    /// leftovers, where no process holds a writer lease on this root), and spare segments
    /// of processes that are gone.
    fn gc_plan(&self, opts: &GcOptions) -> Result<Vec<Removal>> {
        let mut plan = self.layout.gc_plan(opts)?;
        if opts.temp_age.is_some() && !lease::any_writer(&self.root) {
            let mine = |s: &u64| !opts.foreign.contains(s);
            let committed: Vec<u64> = self.committed_steps()?.into_iter().filter(mine).collect();
            let all: Vec<u64> = self.all_steps()?.into_iter().filter(mine).collect();
            plan.extend(gc::abandoned_steps(&committed, &all));
        }
        // A step whose writer has not finished its flush (its memory commit may still come)
        // is no leftover, whatever its age relative to newer steps.
        plan.retain(|r| r.step().is_none_or(|s| !self.being_written(s)));
        plan.extend(self.dead_pool_segments()?);
        Ok(plan)
    }

    /// Steps are evicted (this process's segments go back to its pool); the rest goes as
    /// files. What was removed comes back in plan order.
    fn gc_apply(&self, plan: Vec<Removal>) -> Result<Vec<Removal>> {
        let mut done = vec![];
        for r in plan {
            match &r.target {
                Target::Step(s) => {
                    // Under the step directory's exclusive lock: a writer that begins the step
                    // meanwhile waits for its write lease, then finds the directory gone and
                    // makes it again (`lease_step`); one that holds the lease keeps the step.
                    let dir = self.root.join(format::step_dir(*s));
                    if !lease::with_exclusive(&dir, |free| if free { self.evict(*s).map(|_| true) } else { Ok(false) })? {
                        continue;
                    }
                }
                Target::Segment { key, .. } => self.layout.blobs().delete(key)?,
                _ => {
                    done.extend(self.layout.gc_apply(vec![r])?);
                    continue;
                }
            }
            done.push(r);
        }
        // Steps of ours that another rank on this host evicted (it deletes the whole step):
        // drop our mappings of them, or their memory would stay mapped for ever. Steps newer
        // than the oldest one kept may still be on their way.
        let present = self.all_steps()?;
        let oldest_kept = self.committed_steps()?.first().copied();
        self.owned.lock().retain(|s, _| present.contains(s) || oldest_kept.is_none_or(|o| *s > o));
        Ok(done)
    }

    /// Pages are mapped on first touch or by `View::populate`: the restore path maps each
    /// chunk just before it checksums it.
    fn view(&self, step: u64, object: &str) -> Option<Result<Arc<View>>> {
        Some(self.open_view(step, object))
    }
}
