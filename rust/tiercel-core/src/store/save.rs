//! The save path: `StepWriter` lays a rank's step out in memory-tier segments and copies it
//! in (the only part that blocks training); `flush_step`, in the background, checksums,
//! publishes and commits it there, then carries out the save's persist plan (`persist`):
//! one job per later tier that gets the step.

use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use super::handle::{probe_commit, Probed};
use super::{persist, SaveHandle, Store, TierState};
use crate::error::{Error, Result};
use crate::format::{self, ChunkMeta, ItemMeta, Manifest, ObjectMeta, ShardInfo};
use crate::lease::Lease;
use crate::scheduler::{Job, Priority};
use crate::shm::Segment;
use crate::tier::Tier;

/// What a caller hands over about one item before the copy.
#[derive(Debug, Clone)]
pub struct ItemSpec {
    pub name: String,
    pub kind: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub nbytes: u64,
    pub meta: serde_json::Value,
    /// Set when the item is one shard of a global array.
    pub shard: Option<ShardInfo>,
    /// Set when every rank of a replica group holds the same bytes: the group's lowest rank
    /// (whose copy persistent tiers store).
    pub replica: Option<u32>,
}

impl Store {
    /// Starts saving `step` of this rank. Takes the step's write lease on the memory tier,
    /// held until the background flush has committed (no retention removes it meanwhile).
    pub fn begin(self: &Arc<Self>, step: u64) -> Result<StepWriter> {
        if step > format::MAX_STEP {
            return Err(Error::invalid(format!(
                "step {step} is too large: steps go up to {} (12 digits in the step's name); \
                 number steps by training iteration, not by timestamp",
                format::MAX_STEP
            )));
        }
        self.claim_writer()?;
        let lease = self.memory.lease_step(step)?;
        Ok(StepWriter {
            store: self.clone(),
            manifest: Manifest::new(step, self.rank, self.world_size, &self.memory_slot().config.name, self.policy.chunk_size),
            parts: vec![],
            filled: vec![],
            finished: false,
            lease: Some(lease),
        })
    }
}

/// Builds one step of this rank in the memory tier, `put` by `put`.
pub struct StepWriter {
    store: Arc<Store>,
    manifest: Manifest,
    parts: Vec<Arc<Segment>>,
    filled: Vec<bool>,
    finished: bool,
    /// The step's write lease, handed to the flush.
    lease: Option<Lease>,
}

/// A raw pointer that may cross to the copy threads; the caller keeps its memory alive
/// and unchanged for the duration of the copy.
#[derive(Clone, Copy)]
struct SendPtr(*const u8);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl StepWriter {
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Lays out a put's items in a new segment. Returns the part index and, per item, its
    /// global item index and byte offset in the segment.
    pub fn add_part(&mut self, name: &str, tree: serde_json::Value, items: Vec<ItemSpec>) -> Result<(usize, Vec<(usize, u64)>)> {
        let step = self.manifest.step;
        if self.manifest.trees.iter().any(|(n, _)| n == name) {
            return Err(Error::invalid(format!("step {step}: '{name}' was already put in this step")).with_step(step));
        }
        // The limit every reader applies (format::MAX_TREE_DEPTH): a deeper tree would save,
        // commit, and never restore.
        let depth = format::json_depth(&tree);
        if depth > format::MAX_TREE_DEPTH {
            return Err(Error::invalid(format!(
                "step {step}: the tree of '{name}' nests {depth} JSON levels deep; tiercel stores at most {}: flatten it",
                format::MAX_TREE_DEPTH
            )));
        }
        for it in &items {
            if let Some(shard) = &it.shard {
                shard
                    .check(&it.shape)
                    .map_err(|why| Error::invalid(format!("step {step}: item '{}': {why}", it.name)).with_step(step).with_item(&it.name))?;
            }
        }
        let mut pos = 0u64;
        let mut places = vec![];
        for it in &items {
            pos = format::align_up(pos, format::ITEM_ALIGN);
            places.push(pos);
            pos += it.nbytes;
        }
        let part = self.parts.len();
        let seg = self.store.memory.allocate(step, self.store.rank, part, pos)?;
        let chunk_size = self.manifest.chunk_size;
        let mut out = vec![];
        for (spec, start) in items.into_iter().zip(places) {
            let chunks = format::chunk_ranges(spec.nbytes, chunk_size)
                .map(|(off, len)| ChunkMeta {
                    offset: off,
                    len,
                    crc32c: 0,
                    object: part as u32,
                    stored_offset: start + off,
                    stored_len: len,
                    codec: crate::codec::RAW.into(),
                    hash: None,
                })
                .collect();
            out.push((self.manifest.items.len(), start));
            self.filled.push(spec.nbytes == 0);
            self.manifest.items.push(ItemMeta {
                name: spec.name,
                kind: spec.kind,
                dtype: spec.dtype,
                shape: spec.shape,
                nbytes: spec.nbytes,
                meta: spec.meta,
                shard: spec.shard,
                replica: spec.replica.map(|primary| format::Replica { primary, shared: false, matched: false }),
                chunks,
            });
        }
        self.manifest.objects.push(ObjectMeta { name: format::part_name(self.store.rank, part), len: pos, key: None });
        self.manifest.trees.push((name.into(), tree));
        self.parts.push(seg);
        Ok((part, out))
    }

    pub fn segment(&self, part: usize) -> Result<Arc<Segment>> {
        self.parts.get(part).cloned().ok_or_else(|| Error::invalid(format!("no part {part} in step {}", self.step())))
    }

    /// Copies items from contiguous host memory into their segment on the copy threads.
    /// `srcs`: (item index, source address). Checksums are computed later, in the
    /// background: fusing them into the copy measured no faster than a second pass, and the
    /// copy is the only part of a save that blocks training.
    ///
    /// # Safety
    /// Each source address must point to `nbytes` readable bytes of that item that stay
    /// alive and unchanged until this returns.
    pub unsafe fn copy_items(&mut self, srcs: &[(usize, usize)]) -> Result<()> {
        for &(i, _) in srcs {
            if i >= self.manifest.items.len() {
                return Err(Error::invalid(format!("no item {i} in step {}", self.step())));
            }
        }
        let tasks: Vec<(SendPtr, SendPtr, usize)> = srcs
            .iter()
            .flat_map(|&(i, src)| {
                let it = &self.manifest.items[i];
                let parts = &self.parts;
                it.chunks.iter().map(move |ch| {
                    let dst = unsafe { parts[ch.object as usize].ptr().add(ch.stored_offset as usize) };
                    (SendPtr(unsafe { (src as *const u8).add(ch.offset as usize) }), SendPtr(dst), ch.len as usize)
                })
            })
            .collect();
        self.store.copy_pool.install(|| {
            tasks.par_iter().for_each(|&(src, dst, len)| unsafe {
                std::ptr::copy_nonoverlapping(src.0, dst.0 as *mut u8, len);
            })
        });
        for &(i, _) in srcs {
            self.filled[i] = true;
        }
        Ok(())
    }

    /// Marks items the caller wrote into the segment itself (device tensors, non-contiguous
    /// arrays copied by their framework).
    pub fn mark_written(&mut self, items: &[usize]) -> Result<()> {
        for &i in items {
            let step = self.manifest.step;
            *self.filled.get_mut(i).ok_or_else(|| Error::invalid(format!("no item {i} in step {step}")))? = true;
        }
        Ok(())
    }

    /// Ends the blocking part. In the background, in order: checksum every chunk, publish
    /// this rank's manifest on the memory tier (committing the step there once every rank
    /// has), persist to the tiers whose `every` selects this step, evict beyond `keep`, and
    /// pre-fault segments for the next step. The returned handle tells what is done where.
    pub fn commit(mut self) -> Result<Arc<SaveHandle>> {
        if let Some(i) = self.filled.iter().position(|f| !f) {
            let item = &self.manifest.items[i].name;
            return Err(Error::invalid(format!("step {}: item '{item}' was laid out but never written", self.step()))
                .with_step(self.step())
                .with_item(item));
        }
        self.finished = true;
        let store = self.store.clone();
        let mut manifest = std::mem::take(&mut self.manifest);
        // Counted here, not at `begin`: a save that one rank aborts and retries (bad input)
        // must not put it out of step with the others.
        manifest.generation = store.next_generation(manifest.step);
        let parts = std::mem::take(&mut self.parts);
        let handle = SaveHandle::new(manifest.step, &store.slots);
        store.track(&handle);
        let lease = self.lease.take();
        // This save's place in the process's save order: which persist replaces which
        // follows it, never the order in which background flushes happen to finish.
        let order = store.save_order.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        store.metrics.saved(manifest.step);
        store.metrics.tier(store.memory_at).scheduled(manifest.step, manifest.total_bytes());
        // The flush pre-faults for the next save: a restore after this needs no pre-fault of its own.
        store.prefaulting.store(true, std::sync::atomic::Ordering::Relaxed);
        let (store2, handle2) = (store.clone(), handle.clone());
        store.scheduler.submit(Job {
            link: store.memory_slot().link.clone(),
            priority: Priority::Flush,
            size: manifest.total_bytes(),
            label: format!("step {}", manifest.step),
            supersede: None,
            run: Box::new(move |_| flush_step(store2, handle2, manifest, parts, lease, order)),
        });
        Ok(handle)
    }
}

/// The background half of a save (see `StepWriter::commit`); `order`: the save's place in
/// this process's save order. Checksums, publishes and commits the step on the memory tier,
/// then carries out its persist plan (`persist`), retention and the next step's pre-fault.
fn flush_step(
    store: Arc<Store>,
    handle: Arc<SaveHandle>,
    mut manifest: Manifest,
    parts: Vec<Arc<Segment>>,
    lease: Option<Lease>,
    order: u64,
) {
    let step = manifest.step;
    let mem = store.memory_slot();
    let mem_name = mem.config.name.clone();
    handle.set(&mem_name, TierState::Running);
    let started = Instant::now();
    checksum_chunks(&store, &mut manifest, &parts);
    let res = store.memory.publish(&manifest).and_then(|_| store.memory.try_commit(step, store.world_size));
    // Published (a leftover of ours no more) or failed: retention may have the step now.
    drop(lease);
    let Some(mem_state) = memory_outcome(&store, &handle, &manifest, res, started) else {
        return;
    };
    let manifest = Arc::new(manifest);
    let handle_mem = handle.clone();
    let (store1, parts1): (_, Vec<persist::Part>) = (store.clone(), parts.iter().map(|p| p.clone() as persist::Part).collect());
    // Planned when the persists are queued: a tier degraded meanwhile is skipped.
    let queue_later = move || {
        let plan = persist::plan(step, order, store1.persist_facts(&manifest));
        store1.queue_persists(plan, &handle, &manifest, &parts1)
    };
    if crate::failpoint::armed_at("persist_late", order) {
        // The test of save order: this save's persists reach the scheduler only after a
        // later save's (as when two flushes on two workers finish in the other order).
        // Queued at once when the later save came first (it released the earlier ones).
        let now = store.held_persists.lock().hold(order, Box::new(queue_later));
        if let Some(queue) = now {
            queue();
        }
    } else {
        queue_later();
        store.release_held_persists(order);
    }
    // Only now does the save count as flushed to memory: a preemption's flush, which waits
    // for that (`preempt_step`), then finds this save's persists queued, and replaces them
    // rather than being replaced by them (as it was when they arrived after it).
    handle_mem.set(&mem_name, mem_state);
    let sizes: Vec<u64> = parts.iter().map(|p| p.len() as u64).collect();
    drop(parts);
    if let Err(e) = store.retain(mem) {
        log::warn!("tier '{mem_name}': retention after step {step} failed: {e}");
    }
    if let Err(e) = store.memory.prefault(&sizes) {
        log::warn!("tier '{mem_name}': pre-faulting for the next step failed: {e}");
    }
}

/// Sets every chunk's CRC32C and hash in `manifest` from its bytes in `parts`, in parallel
/// on the copy threads (one pass over each chunk: `checksum::crc32c_and_hash`).
fn checksum_chunks(store: &Store, manifest: &mut Manifest, parts: &[Arc<Segment>]) {
    let work = manifest.chunk_refs();
    let sums: Vec<(u32, String)> = store.copy_pool.install(|| {
        work.par_iter()
            .map(|&(i, c)| {
                let ch = &manifest.items[i].chunks[c];
                let start = ch.stored_offset as usize;
                crate::checksum::crc32c_and_hash(&parts[ch.object as usize].bytes()[start..start + ch.len as usize])
            })
            .collect()
    });
    for (&(i, c), (crc, hash)) in work.iter().zip(sums) {
        let ch = &mut manifest.items[i].chunks[c];
        ch.crc32c = crc;
        ch.hash = Some(hash);
    }
}

/// Records how the step's publish and commit on the memory tier went (`res`: committed or
/// not): its metrics and a probe for the commit that another rank of this host makes.
/// Some(state): it succeeded, and the caller sets `handle`'s memory state to it once the
/// persists are queued. None: it failed (the handle says so); the later tiers are skipped,
/// for they copy from memory.
fn memory_outcome(store: &Arc<Store>, handle: &SaveHandle, manifest: &Manifest, res: Result<bool>, started: Instant) -> Option<TierState> {
    let (step, mem_name) = (manifest.step, &store.memory_slot().config.name);
    match res {
        Ok(committed) => {
            if !committed {
                // Another rank of this host commits it when it finishes: let the handle see.
                let (weak, rank, generation) = (Arc::downgrade(store), store.rank, manifest.generation.clone());
                let probe = move || {
                    let store = weak.upgrade();
                    let probed = probe_commit(store.as_ref().map(|s| &*s.memory as &dyn Tier), step, rank, &generation);
                    if let (Some(s), Probed::Committed) = (&store, &probed) {
                        s.metrics.tier(s.memory_at).committed(step);
                    }
                    probed
                };
                handle.set_probe(mem_name, Box::new(probe), true);
            }
            store.metrics.tier(store.memory_at).written(step, manifest.total_bytes(), started.elapsed());
            if committed {
                store.metrics.tier(store.memory_at).committed(step);
            }
            Some(if committed { TierState::Done } else { TierState::Written })
        }
        Err(e) => {
            let e = e.context(format!("step {step} rank {}", store.rank)).with_tier(mem_name).at(step, store.rank);
            log::error!("{e}");
            store.metrics.tier(store.memory_at).failed();
            for (_, slot) in store.later_slots() {
                handle.set(&slot.config.name, TierState::Skipped(format!("the memory tier failed: {}", e.message)));
            }
            handle.set(mem_name, TierState::Failed(e));
            None
        }
    }
}

impl Store {
    /// A job that restarts restores first and saves next: the first save of this process
    /// would copy into freshly allocated shared memory (page faults and zeroing on the
    /// critical path, ~10x a memcpy with 4 KiB pages). When the step this rank restores is in
    /// the memory tier (or the peer tier's replicas, the same layout), its parts have the
    /// sizes the next save will need (training states keep their shapes): segments of those
    /// sizes are pre-faulted in the background, as after every save, once per process. It
    /// holds no more memory than the steady state after a save, and stops at `capacity`.
    pub(super) fn prefault_after_restore(self: &Arc<Self>, m: &Manifest) {
        let sizes: Vec<u64> = m.objects.iter().map(|o| o.len).collect();
        self.prefault_once(sizes, format!("pre-fault for the first save after restoring step {}", m.step));
    }

    /// Pre-faults shared memory for this process's first save in the background, when the
    /// caller knows its size before it has saved or restored anything (a brand-new job): one
    /// segment per part of `sizes` bytes (`StepWriter::put` makes one part per call; a
    /// `save` of one state is one part). Each is made a little larger than asked, since a
    /// part also holds the alignment between its items, and cut to the part's size when used.
    /// Like the pre-fault after a restore: once per process, up to `capacity`.
    pub fn prefault(self: &Arc<Self>, sizes: &[u64]) {
        let slack = |s: u64| s + s / 64 + (4 << 20);
        self.prefault_once(
            sizes.iter().map(|&s| slack(s)).collect(),
            format!("pre-fault of {} bytes for the first save", sizes.iter().sum::<u64>()),
        );
    }

    /// Queues the pre-fault of segments of `sizes` bytes, unless one was queued already.
    fn prefault_once(self: &Arc<Self>, sizes: Vec<u64>, label: String) {
        if self.tool || self.prefaulting.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let memory = self.memory.clone();
        self.scheduler.submit(Job {
            link: self.memory_slot().link.clone(),
            priority: Priority::Persist,
            size: sizes.iter().sum(),
            label,
            supersede: None,
            run: Box::new(move |_| {
                if let Err(e) = memory.prefault(&sizes) {
                    log::warn!("tier '{}': pre-faulting for the first save failed: {e}", memory.name());
                }
            }),
        });
    }
}

impl Drop for StepWriter {
    /// A writer dropped without commit (an exception in the `with` block) leaves nothing
    /// behind: its segments are deleted, so no half-written step takes memory.
    fn drop(&mut self) {
        self.lease = None;
        if !self.finished && self.parts.is_empty() {
            // Only the leased directory was made; remove it if nothing else is in it.
            let _ = std::fs::remove_dir(self.store.memory.root().join(format::step_dir(self.manifest.step)));
        }
        if !self.finished && !self.parts.is_empty() {
            let step = self.manifest.step;
            let rank = self.store.rank;
            for (i, seg) in self.parts.drain(..).enumerate() {
                let path = seg.path();
                let _ = std::fs::remove_file(&path);
                // Removes the step directory only if nothing else (another rank) is in it.
                if let Some(dir) = path.parent() {
                    let _ = std::fs::remove_dir(dir);
                }
                log::debug!("step {step} rank {rank}: discarded part {i}");
            }
            self.store.memory.forget(step);
        }
    }
}
