//! The restore path: `StepReader` opens one rank's step on the tiers in restore order that
//! have it committed and reads items, or byte ranges of one item, zero-copy from the memory
//! tier when it can, else chunk by chunk from the first tier with a valid copy.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rayon::prelude::*;

use super::{JobFilter, Store};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{ChunkMeta, ItemMeta, Manifest};
use crate::shm::View;
use crate::tier::read_chunk;

mod merged;

/// One restored item: a zero-copy view of a memory-tier object, or bytes read into memory.
pub enum ItemData {
    View { view: Arc<View>, offset: usize, len: usize },
    Owned(Vec<u8>),
}

impl ItemData {
    pub fn bytes(&self) -> &[u8] {
        match self {
            ItemData::View { view, offset, len } => &view[*offset..*offset + *len],
            ItemData::Owned(v) => v,
        }
    }
}

/// Bytes of one item that a zero-copy view can serve once `StepReader::verify` passed.
struct ZeroCopy {
    item: usize,
    /// The item's chunks that overlap the bytes.
    chunks: std::ops::Range<usize>,
    view: Arc<View>,
    offset: usize,
    len: usize,
}

/// Reads one rank's step from the tiers in restore order that have it committed.
pub struct StepReader {
    pub step: u64,
    pub rank: u32,
    /// How many ranks saved the step, as the commit record of the first tier read says.
    pub world_size: u32,
    /// (tier index in store slots, that tier's manifest), in restore order.
    pub(super) sources: Vec<(usize, Manifest)>,
    pub(super) store: Arc<Store>,
    /// Problems met on the way (a bad chunk read from the next tier instead, a tier whose
    /// manifest could not be read), for logs and for the caller to show.
    pub warnings: Mutex<Vec<String>>,
    /// Counted as a step read (of its first source) once something is read, not on open:
    /// a restore opens readers just to see whether a step can be read.
    counted: AtomicBool,
    /// Objects of the first source mapped so far (memory tier), by name: mapped once for the
    /// reader's life, so reading many items or ranges of one part does not map (and
    /// pre-populate) the whole part again each time.
    views: Mutex<HashMap<String, Arc<View>>>,
    /// Items already read by a broadcast with the other replicas (`broadcast`).
    pub(super) prefetched: super::broadcast::Prefetched,
    /// The manifest whose part sizes the next save of this process will need: pre-faulted
    /// for it once this reader is done, if it read anything (`Store::prefault_after_restore`).
    prefault_after: Option<Manifest>,
}

impl Drop for StepReader {
    fn drop(&mut self) {
        if let Some(m) = self.prefault_after.take().filter(|_| self.counted.load(Ordering::Relaxed)) {
            self.store.prefault_after_restore(&m);
        }
    }
}

impl StepReader {
    /// `tiers`: restrict to these tiers (in this order); default: the policy's restore order.
    /// `job`: whose step it may be (a step of another job is passed over, and said why).
    pub fn open(store: &Arc<Store>, step: u64, rank: u32, tiers: Option<&[String]>, job: &JobFilter) -> Result<StepReader> {
        let order: Vec<String> = tiers.map(|t| t.to_vec()).unwrap_or_else(|| store.policy.restore_order.clone());
        let mut sources = vec![];
        let mut warnings = vec![];
        // A step this process saved is read once its memory commit is there (or we know why not).
        let own = store.await_own_save(step);
        let mut seen = vec![];
        let mut broken = false;
        let mut other_jobs: Vec<String> = vec![];
        let mut world_size = None;
        for name in &order {
            let idx = store.slots.iter().position(|s| &s.config.name == name).ok_or_else(|| store.slot(name).err().unwrap())?;
            let tier = &store.slots[idx].tier;
            let record = match tier.commit_record(step) {
                Ok(r) => r,
                Err(e) if e.kind == ErrorKind::NotFound => continue,
                Err(e) => {
                    broken |= e.kind == ErrorKind::Integrity;
                    warnings.push(e.message);
                    continue;
                }
            };
            if !store.admits(&record, job) {
                let whose = record.job.as_ref().map(|j| j.describe()).unwrap_or_default();
                other_jobs.push(format!(
                    "tier '{name}': step {step} was saved by {whose}, not by this job ({}); restore(step, job=\"<run id>\") \
                     or `[restore] resume_from` reads it",
                    store.job().describe()
                ));
                continue;
            }
            // A step of another world size is read as saved, rank by rank: whether that may
            // be done (a resharding adapter, `restore(rank=...)`) is the caller's rule
            // (`Store.restore` in Python refuses it otherwise), not this reader's.
            if rank >= record.world_size {
                return Err(Error::invalid(format!(
                    "tier '{name}': step {step} was saved by {} rank{}; there is no rank {rank}",
                    record.world_size,
                    if record.world_size == 1 { "" } else { "s" }
                ))
                .with_tier(name.as_str())
                .at(step, rank));
            }
            if record.ranks.as_ref().is_some_and(|rs| !rs.contains(&rank)) {
                continue; // a host-local commit of other ranks
            }
            world_size.get_or_insert(record.world_size);
            seen.push(name.clone());
            match tier.read_manifest(step, rank).and_then(|m| crate::tier::replica::resolve(&**tier, m)) {
                Ok(m) if m.generation != record.generation => warnings.push(format!(
                    "tier '{name}': step {step} rank {rank}: the manifest is of another save of this step ({}) than the \
                     commit ({}): the step is being saved again, or a save of it again was interrupted",
                    m.generation.as_deref().unwrap_or("-"),
                    record.generation.as_deref().unwrap_or("-")
                )),
                Ok(m) => sources.push((idx, m)),
                Err(e) => warnings.push(e.message),
            }
        }
        // One save of the step only: a tier holding another save of it (the step saved again,
        // and not yet persisted there) is not mixed in chunk by chunk.
        if let Some((_, first)) = sources.first() {
            let generation = first.generation.clone();
            sources.retain(|(idx, m)| {
                let same = m.generation == generation;
                if !same {
                    warnings.push(format!(
                        "tier '{}': step {step} rank {rank} there is another save of the step ({}) than the one read ({}): not read",
                        store.slots[*idx].config.name,
                        m.generation.as_deref().unwrap_or("-"),
                        generation.as_deref().unwrap_or("-")
                    ));
                }
                same
            });
        }
        if sources.is_empty() {
            let mut have = vec![];
            for name in &order {
                if let Ok(slot) = store.slot(name) {
                    let steps = slot.tier.committed_steps().unwrap_or_default();
                    have.push(format!("{name}: {steps:?}"));
                }
            }
            warnings.extend(own);
            warnings.extend(other_jobs);
            let why = if warnings.is_empty() { String::new() } else { format!(" ({})", warnings.join("; ")) };
            let kind = if seen.is_empty() && !broken { ErrorKind::NotFound } else { ErrorKind::Integrity };
            return Err(Error::new(
                kind,
                format!("step {step} rank {rank} can be restored from no tier in {order:?}{why}; committed steps: {}", have.join(", ")),
            )
            .at(step, rank));
        }
        super::job::warn_per_cause(&warnings);
        // Queued when the reader is done (dropped), not now: the pre-fault would take cores
        // from the restore it follows, which a restarted job waits for.
        let memory_layout = |i: usize| store.slots[i].config.capabilities().memory_layout;
        let prefault_after =
            if rank == store.rank { sources.iter().find(|(i, _)| memory_layout(*i)).map(|(_, m)| m.clone()) } else { None };
        Ok(StepReader {
            step,
            rank,
            world_size: world_size.expect("a source comes with its commit record"),
            sources,
            store: store.clone(),
            warnings: Mutex::new(warnings),
            counted: AtomicBool::new(false),
            views: Mutex::new(HashMap::new()),
            prefetched: Default::default(),
            prefault_after,
        })
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Which save of the step this reader reads (see `CommitRecord::generation`).
    pub fn generation(&self) -> Option<&str> {
        self.sources.first().and_then(|(_, m)| m.generation.as_deref())
    }

    /// The manifest of the first tier that has the step.
    pub fn manifest(&self) -> &Manifest {
        &self.sources[0].1
    }

    pub fn tiers(&self) -> Vec<String> {
        self.sources.iter().map(|(i, _)| self.store.slots[*i].config.name.clone()).collect()
    }

    /// Reads items (indices into `manifest().items`). Returns each item's data and the tier
    /// it came from ("ram", or "ram+disk" when chunks had to come from several tiers).
    ///
    /// Items the memory tier holds raw come back as zero-copy views; every chunk of all of
    /// them is mapped and verified in one parallel pass over the copy threads (no item waits
    /// for the one before it). The others are read chunk by chunk, with fallback.
    pub fn read_items(&self, items: &[usize]) -> Result<Vec<(ItemData, String)>> {
        let m = self.manifest();
        for &i in items {
            if i >= m.items.len() {
                return Err(Error::invalid(format!("step {}: no item {i}", self.step)).at(self.step, self.rank));
            }
        }
        self.count_read();
        let plans: Vec<Option<ZeroCopy>> =
            self.with_views(|views| items.iter().map(|&i| self.plan_zero_copy(i, 0, m.items[i].nbytes, views)).collect());
        self.store.copy_pool.install(|| {
            let ok = self.verify(&plans);
            items.iter().zip(plans).zip(ok).map(|((&i, plan), ok)| self.serve(i, 0, m.items[i].nbytes, plan.filter(|_| ok))).collect()
        })
    }

    /// Reads bytes `start..start + len` of item `item`, touching only the chunks that overlap
    /// them (each still verified whole by its CRC32C, falling back chunk by chunk across tiers
    /// like `read_items`). A zero-copy view when the item qualifies for one.
    pub fn read_range(&self, item: usize, start: u64, len: u64) -> Result<(ItemData, String)> {
        let end = self.check_range(item, start, len)?;
        self.count_read();
        let plan = self.with_views(|views| self.plan_zero_copy(item, start, end, views));
        self.store.copy_pool.install(|| {
            let ok = self.verify(std::slice::from_ref(&plan))[0];
            self.serve(item, start, end, plan.filter(|_| ok))
        })
    }

    /// Reads bytes `start..start + dst.len()` of item `item` into `dst`, the caller's memory:
    /// each overlapping chunk is copied and verified by its CRC32C on the copy threads, in
    /// parallel, falling back chunk by chunk across tiers like `read_items`. From the memory
    /// tier that is one copy straight out of shared memory: a `pread`, or on huge pages one
    /// pass out of the mapped object (`copy_verified`). On an error `dst` holds part of the
    /// bytes. Returns the tier(s) the bytes came from.
    pub fn read_into(&self, item: usize, start: u64, dst: &mut [u8]) -> Result<String> {
        let end = self.check_range(item, start, dst.len() as u64)?;
        self.count_read();
        if let Some(data) = self.prefetched.lock().get(&item) {
            dst.copy_from_slice(&data[start as usize..end as usize]);
            return Ok(self.store.slots[self.sources[0].0].config.name.clone());
        }
        // Out of shared memory backed by huge pages, mapping the object costs little, and one
        // pass copies and verifies (`copy_verified`). On 4 KiB pages, mapping and unmapping a
        // fresh reader's objects costs more CPU than a `pread`'s page lookups (measured: ~12%
        // more for 512 MiB; ~15% less on huge pages), so those are read chunk by chunk.
        let mapped = self.store.memory().huge_pages().is_some();
        let plan = if mapped { self.with_views(|views| self.plan_zero_copy(item, start, end, views)) } else { None };
        self.store.copy_pool.install(|| match plan {
            Some(plan) => self.copy_verified(&plan, start, end, dst),
            None => self.read_owned_into(item, start, end, dst),
        })
    }

    /// Copies bytes `start..end` of `plan`'s item out of its mapped object into `dst`, chunk
    /// by chunk in parallel: each chunk's pages are mapped in one call, copied and
    /// checksummed in the same pass (`checksum::copy_crc32c`; a `pread` out of shared memory
    /// costs the kernel a page lookup per 4 KiB, and the checksum a second read of the
    /// chunk). A chunk that fails its checksum, or that the range covers only in part, is
    /// read as `read_owned_into` reads it (the next tier for a bad one, which says so).
    fn copy_verified(&self, plan: &ZeroCopy, start: u64, end: u64, buf: &mut [u8]) -> Result<String> {
        let primary = &self.manifest().items[plan.item];
        let idx = self.sources[0].0;
        let used: Vec<Result<usize>> = chunk_dsts(&primary.chunks, plan.chunks.clone(), start, end, buf)
            .into_par_iter()
            .with_max_len(1)
            .map(|(c, dst)| {
                let ch = &primary.chunks[c];
                if dst.len() as u64 == ch.len {
                    let s = ch.stored_offset as usize..(ch.stored_offset + ch.len) as usize;
                    plan.view.populate(s.clone());
                    let read = self.store.slots[idx].link.read(ch.len);
                    let crc = crate::checksum::copy_crc32c(&plan.view[s], dst);
                    drop(read);
                    if crc == ch.crc32c {
                        self.store.metrics.tier(idx).read(ch.len);
                        return Ok(0);
                    }
                    return self.read_chunk_anywhere(primary, c, dst);
                }
                self.read_chunk_cut(primary, c, start, dst)
            })
            .collect();
        self.label(used)
    }

    /// The end of bytes `start..start + len` of item `item`, when they lie inside it.
    fn check_range(&self, item: usize, start: u64, len: u64) -> Result<u64> {
        let it = self
            .manifest()
            .items
            .get(item)
            .ok_or_else(|| Error::invalid(format!("step {}: no item {item}", self.step)).at(self.step, self.rank))?;
        start.checked_add(len).filter(|e| *e <= it.nbytes).ok_or_else(|| {
            Error::invalid(format!(
                "step {} rank {} item '{}': bytes {start}..{} lie outside its {} bytes",
                self.step,
                self.rank,
                it.name,
                start as u128 + len as u128,
                it.nbytes
            ))
            .at(self.step, self.rank)
            .with_item(&it.name)
        })
    }

    /// A step read is counted (for its first source) once, on the first read.
    fn count_read(&self) {
        if !self.counted.swap(true, Ordering::Relaxed) {
            self.store.metrics.tier(self.sources[0].0).step_read();
        }
    }

    /// Runs `f` with the objects mapped so far (and keeps what it maps). Taken rather than
    /// locked across the call, and handed back before any copy thread runs: concurrent
    /// calls cannot deadlock (they map again at worst).
    fn with_views<T>(&self, f: impl FnOnce(&mut HashMap<String, Arc<View>>) -> T) -> T {
        let mut views = std::mem::take(&mut *self.views.lock());
        let out = f(&mut views);
        self.views.lock().extend(views);
        out
    }

    /// Bytes `start..end` of item `i`: the verified zero-copy `plan` if there is one, else
    /// chunk by chunk.
    fn serve(&self, i: usize, start: u64, end: u64, plan: Option<ZeroCopy>) -> Result<(ItemData, String)> {
        if let Some(v) = self.take_prefetched(i, start, end) {
            return Ok(v);
        }
        match plan {
            Some(ZeroCopy { view, offset, len, .. }) => {
                let idx = self.sources[0].0;
                self.store.metrics.tier(idx).read(len as u64);
                Ok((ItemData::View { view, offset, len }, self.store.slots[idx].config.name.clone()))
            }
            None => {
                let mut buf = crate::shm::root::zeroed_buffer((end - start) as usize);
                let label = self.read_owned_into(i, start, end, &mut buf)?;
                Ok((ItemData::Owned(buf), label))
            }
        }
    }

    /// Bytes `start..end` of item `i` if a broadcast read it (the whole item is handed over,
    /// a range copied out).
    fn take_prefetched(&self, i: usize, start: u64, end: u64) -> Option<(ItemData, String)> {
        let mut pre = self.prefetched.lock();
        let whole = start == 0 && end == self.manifest().items[i].nbytes;
        let data = if whole { pre.remove(&i)? } else { pre.get(&i)?[start as usize..end as usize].to_vec() };
        Some((ItemData::Owned(data), self.store.slots[self.sources[0].0].config.name.clone()))
    }

    /// Whether a zero-copy view can serve bytes `start..end` of item `i`: the first source
    /// offers views (the memory tier) and the chunks of `start..end` sit raw and contiguous
    /// in one object. Maps that object (once per reader), but neither touches nor verifies
    /// the bytes: `verify` does.
    fn plan_zero_copy(&self, i: usize, start: u64, end: u64, views: &mut HashMap<String, Arc<View>>) -> Option<ZeroCopy> {
        let (idx, m) = &self.sources[0];
        let slot = &self.store.slots[*idx];
        let it = &m.items[i];
        let range = overlapping(&it.chunks, start, end);
        let chunks = &it.chunks[range.clone()];
        // Nothing to map for an empty range: read_owned_into returns the empty bytes.
        let first = chunks.first()?;
        // Where byte 0 of the item would lie if the item is stored contiguously.
        let base = first.stored_offset.wrapping_sub(first.offset);
        let contiguous = chunks
            .iter()
            .all(|c| c.codec == crate::codec::RAW && c.object == first.object && c.stored_offset == base.wrapping_add(c.offset));
        if !contiguous {
            return None;
        }
        let obj = &m.objects[first.object as usize].name;
        let view = match views.get(obj) {
            Some(v) => v.clone(),
            None => match slot.tier.view(m.step, obj)? {
                Ok(v) => {
                    views.insert(obj.clone(), v.clone());
                    v
                }
                Err(e) => {
                    self.warnings.lock().push(e.message);
                    return None;
                }
            },
        };
        let last = chunks.last().expect("not empty");
        if last.stored_offset + last.len > view.len() as u64 {
            self.warnings
                .lock()
                .push(format!("tier '{}': step {} rank {} object {obj} is shorter than its manifest", slot.config.name, m.step, m.rank));
            return None;
        }
        // The first overlapping chunk starts at or before `start` (chunks tile the item).
        let (offset, len) = ((first.stored_offset + (start - first.offset)) as usize, (end - start) as usize);
        Some(ZeroCopy { item: i, chunks: range, view, offset, len })
    }

    /// Verifies every chunk of every plan, all in one parallel pass on the calling pool:
    /// each chunk's pages are mapped, then its CRC32C is computed, by the same thread (the
    /// mapping of one chunk overlaps the checksums of others). True per plan when all its
    /// chunks match; a plan that fails is read chunk by chunk instead, which says which
    /// chunk is bad and falls back to another tier.
    fn verify(&self, plans: &[Option<ZeroCopy>]) -> Vec<bool> {
        let items = &self.manifest().items;
        let work: Vec<(usize, &ZeroCopy, &ChunkMeta)> = plans
            .iter()
            .enumerate()
            .filter_map(|(k, p)| p.as_ref().map(|p| (k, p)))
            .flat_map(|(k, p)| items[p.item].chunks[p.chunks.clone()].iter().map(move |c| (k, p, c)))
            .collect();
        let bad: Vec<usize> = work
            .into_par_iter()
            .with_max_len(1)
            .filter(|(_, p, c)| {
                let s = c.stored_offset as usize..(c.stored_offset + c.len) as usize;
                p.view.populate(s.clone());
                crate::checksum::crc32c(&p.view[s]) != c.crc32c
            })
            .map(|(k, ..)| k)
            .collect();
        (0..plans.len()).map(|k| !bad.contains(&k)).collect()
    }

    /// Reads bytes `start..end` of item `i` into `buf` (`end - start` bytes): every
    /// overlapping chunk from the first source that has a valid copy of it, in parallel. A
    /// chunk the range covers only in part is read whole (its checksum covers all of it)
    /// and cut. From a tier where requests cost round trips, neighbouring chunks are fetched
    /// together (`merged`). Returns the tier(s) the chunks came from.
    fn read_owned_into(&self, i: usize, start: u64, end: u64, buf: &mut [u8]) -> Result<String> {
        let merge = self.store.slots[self.sources[0].0].tier.merged_reads();
        let used: Vec<Result<usize>> = if let Some(merge) = merge {
            self.read_merged_into(i, start, end, buf, merge)?.into_iter().map(Ok).collect()
        } else {
            let primary = &self.manifest().items[i];
            let dsts = chunk_dsts(&primary.chunks, overlapping(&primary.chunks, start, end), start, end, buf);
            dsts.into_par_iter().map(|(c, dst)| self.read_chunk_cut(primary, c, start, dst)).collect()
        };
        self.label(used)
    }

    /// The tier(s) a read's chunks came from ("ram", "ram+disk"), given each chunk's source
    /// index, or the first error.
    fn label(&self, used: Vec<Result<usize>>) -> Result<String> {
        let mut from: Vec<usize> = vec![];
        for u in used {
            let s = u?;
            if !from.contains(&s) {
                from.push(s);
            }
        }
        from.sort_unstable();
        let names: Vec<String> = from.iter().map(|s| self.store.slots[self.sources[*s].0].config.name.clone()).collect();
        let label = if names.is_empty() { self.store.slots[self.sources[0].0].config.name.clone() } else { names.join("+") };
        Ok(label)
    }

    /// The part of chunk `c` of `primary` that `dst` holds (the range read starts at byte
    /// `start` of the item), from the first source with a valid copy: a chunk the range
    /// covers only in part is read whole (its checksum covers all of it) and cut. Returns the source's index.
    fn read_chunk_cut(&self, primary: &ItemMeta, c: usize, start: u64, dst: &mut [u8]) -> Result<usize> {
        let ch = &primary.chunks[c];
        if dst.len() as u64 == ch.len {
            return self.read_chunk_anywhere(primary, c, dst);
        }
        let mut whole = vec![0u8; ch.len as usize];
        let s = self.read_chunk_anywhere(primary, c, &mut whole)?;
        let from = (ch.offset.max(start) - ch.offset) as usize;
        dst.copy_from_slice(&whole[from..from + dst.len()]);
        Ok(s)
    }

    /// Reads chunk `c` of `primary` (an item of the first source's manifest) into `dst` from
    /// the first source with a matching copy that decodes and passes its checksum. Returns
    /// the index of that source.
    pub(super) fn read_chunk_anywhere(&self, primary: &ItemMeta, c: usize, dst: &mut [u8]) -> Result<usize> {
        let want = &primary.chunks[c];
        let mut errs = vec![];
        for (s, (idx, m)) in self.sources.iter().enumerate() {
            let tier = &*self.store.slots[*idx].tier;
            let found = m.items.iter().position(|x| x.name == primary.name).and_then(|j| {
                let ch = m.items[j].chunks.get(c)?;
                (ch.offset == want.offset && ch.len == want.len && ch.crc32c == want.crc32c).then_some(j)
            });
            let Some(j) = found else {
                errs.push(format!("tier '{}' has no matching copy of item '{}' chunk {c}", tier.name(), primary.name));
                continue;
            };
            // The read goes through the scheduler's link: it takes its tokens, and background
            // chunks wait until it is done (a restore preempts a persist between chunks).
            let read = self.store.slots[*idx].link.read(dst.len() as u64);
            let res = read_chunk(tier, m, j, c, dst);
            drop(read);
            match res {
                Ok(()) => {
                    self.store.metrics.tier(*idx).read(dst.len() as u64);
                    if s > 0 {
                        let msg = format!(
                            "step {} rank {} item '{}' chunk {c} read from tier '{}' after: {}",
                            self.step,
                            self.rank,
                            primary.name,
                            tier.name(),
                            errs.join("; ")
                        );
                        log::warn!("{msg}");
                        self.warnings.lock().push(msg);
                    }
                    return Ok(s);
                }
                Err(e) => errs.push(e.message),
            }
        }
        // Retention (of this or another process) may have removed the step meanwhile: that
        // is a step that is gone, not damaged data.
        if self
            .sources
            .iter()
            .all(|(idx, _)| self.store.slots[*idx].tier.commit_record(self.step).is_err_and(|e| e.kind == ErrorKind::NotFound))
        {
            return Err(Error::not_found(format!(
                "step {} rank {} item '{}': the step was removed (retention) from every tier while it was read; restore a newer step",
                self.step, self.rank, primary.name
            )));
        }
        Err(Error::integrity(format!(
            "step {} rank {} item '{}' chunk {c}: no tier has a valid copy: {}",
            self.step,
            self.rank,
            primary.name,
            errs.join("; ")
        ))
        .at(self.step, self.rank)
        .with_item(&primary.name)
        .with_chunk(c as u64))
    }
}

/// `buf` (bytes `start..end` of an item) cut into the share of each chunk in `range`.
fn chunk_dsts<'a>(
    chunks: &[ChunkMeta],
    range: std::ops::Range<usize>,
    start: u64,
    end: u64,
    buf: &'a mut [u8],
) -> Vec<(usize, &'a mut [u8])> {
    let mut dsts = vec![];
    let mut rest = buf;
    for c in range {
        let ch = &chunks[c];
        let n = (ch.offset + ch.len).min(end) - ch.offset.max(start);
        let (a, b) = std::mem::take(&mut rest).split_at_mut(n as usize);
        dsts.push((c, a));
        rest = b;
    }
    dsts
}

/// Indices of the chunks (in item order, each starting where the previous ended) that
/// overlap bytes `start..end`; empty when the range is.
pub(super) fn overlapping(chunks: &[ChunkMeta], start: u64, end: u64) -> std::ops::Range<usize> {
    if start >= end {
        return 0..0;
    }
    let first = chunks.partition_point(|c| c.offset + c.len <= start);
    let last = chunks.partition_point(|c| c.offset < end);
    first..last.max(first)
}
