//! The Store: one per training process (rank). It copies a step into the memory tier (the
//! only blocking part of a save), then commits, persists and evicts in the background through
//! the scheduler; it reads a step back chunk by chunk from the first tier that has a valid copy.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use rayon::prelude::*;

use crate::blobs::FsBlobs;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self, ChunkMeta, ItemMeta, Manifest, ObjectMeta, ShardInfo};
use crate::policy::{Policy, TierConfig, TierKind};
use crate::scheduler::{Job, Link, Priority, Scheduler, Start};
use crate::tier::blob::BlobTier;
use crate::tier::memory::{MemoryTier, Segment, View};
use crate::tier::peer::{PeerOptions, PeerTier};
use crate::tier::{read_chunk, ChunkSource, Tier};

pub struct TierSlot {
    pub config: TierConfig,
    pub tier: Arc<dyn Tier>,
    pub link: Arc<Link>,
}

pub struct Store {
    pub policy: Policy,
    pub rank: u32,
    pub world_size: u32,
    memory: Arc<MemoryTier>,
    slots: Vec<TierSlot>,
    scheduler: Arc<Scheduler>,
    copy_pool: rayon::ThreadPool,
    peer: Option<Arc<PeerTier>>,
}

/// Opens the tier a policy entry describes.
pub fn open_tier(cfg: &TierConfig) -> Result<Arc<dyn Tier>> {
    let at = |e: Error| e.context(format!("opening tier '{}' ({})", cfg.name, cfg.location));
    Ok(match cfg.kind {
        TierKind::Memory => MemoryTier::open(&cfg.name, cfg.location.as_ref(), cfg.capacity).map_err(at)?,
        TierKind::Fs => {
            let blobs = FsBlobs::new(&cfg.name, cfg.location.as_ref()).map_err(at)?;
            Arc::new(BlobTier::new(&cfg.name, "fs", Arc::new(blobs), cfg.compression))
        }
        TierKind::S3 | TierKind::Gcs => {
            let blobs = crate::object::ObjectBlobs::open(cfg).map_err(at)?;
            Arc::new(BlobTier::new(&cfg.name, cfg.kind.as_str(), Arc::new(blobs), cfg.compression))
        }
        TierKind::Peer => {
            return Err(Error::invalid(format!("tier '{}': a peer tier is opened by its Store (it needs the rank)", cfg.name)))
        }
    })
}

/// Opens a peer tier for `rank`: its replica store lives under the memory tier's root.
fn open_peer(cfg: &TierConfig, rank: u32, memory: &MemoryTier) -> Result<Arc<PeerTier>> {
    let p = cfg.peer.as_ref().expect("a peer tier has peer settings");
    let secret = p.secret.clone().or_else(|| std::env::var("TIERCEL_PEER_SECRET").ok()).map(String::into_bytes);
    let opts = PeerOptions {
        listen: cfg.location.clone(),
        replicas: p.replicas,
        strategy: crate::placement::Strategy::parse(&p.placement)?,
        keep: cfg.keep.unwrap_or(2),
        secret,
        timeout: Duration::from_secs(30),
    };
    PeerTier::open(&cfg.name, rank, memory.root(), opts).map_err(|e| e.context(format!("opening tier '{}'", cfg.name)))
}

impl Store {
    pub fn open(policy: Policy, rank: u32, world_size: u32) -> Result<Arc<Store>> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(format!("rank {rank} is not in a world of size {world_size}")));
        }
        let mem_cfg = policy.memory_tier().clone();
        let memory = MemoryTier::open(&mem_cfg.name, mem_cfg.location.as_ref(), mem_cfg.capacity)
            .map_err(|e| e.context(format!("opening tier '{}' ({})", mem_cfg.name, mem_cfg.location)))?;
        let mut slots = vec![];
        let mut peer = None;
        for cfg in &policy.tiers {
            let tier: Arc<dyn Tier> = match cfg.kind {
                TierKind::Memory => memory.clone(),
                TierKind::Peer => {
                    let p = open_peer(cfg, rank, &memory)?;
                    peer = Some(p.clone());
                    p
                }
                _ => open_tier(cfg)?,
            };
            slots.push(TierSlot { link: Link::new(&cfg.name, cfg.bandwidth), config: cfg.clone(), tier });
        }
        let copy_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(policy.threads)
            .thread_name(|i| format!("tiercel-copy-{i}"))
            .build()
            .map_err(|e| Error::invalid(format!("cannot start copy threads: {e}")))?;
        let scheduler = Scheduler::new(policy.io_threads);
        Ok(Arc::new(Store { policy, rank, world_size, memory, slots, scheduler, copy_pool, peer }))
    }

    pub fn slots(&self) -> &[TierSlot] {
        &self.slots
    }

    pub fn slot(&self, name: &str) -> Result<&TierSlot> {
        self.slots.iter().find(|s| s.config.name == name).ok_or_else(|| {
            let names: Vec<_> = self.slots.iter().map(|s| s.config.name.as_str()).collect();
            Error::invalid(format!("no tier named '{name}' in {} (tiers: {})", self.policy.source, names.join(", ")))
        })
    }

    pub fn memory(&self) -> &Arc<MemoryTier> {
        &self.memory
    }

    /// The peer tier, when the policy has one.
    pub fn peer(&self) -> Option<&Arc<PeerTier>> {
        self.peer.as_ref()
    }

    /// Committed steps per tier, in policy order.
    pub fn steps(&self) -> Result<Vec<(String, Vec<u64>)>> {
        self.slots.iter().map(|s| Ok((s.config.name.clone(), s.tier.committed_steps()?))).collect()
    }

    /// Steps this rank could restore from some tier in restore order, newest last. A tier
    /// that cannot be listed right now is skipped (logged): restore falls back past it.
    pub fn restorable_steps(&self) -> Vec<u64> {
        let mut all = std::collections::BTreeSet::new();
        for name in &self.policy.restore_order {
            let Ok(slot) = self.slot(name) else { continue };
            match slot.tier.committed_steps() {
                Ok(v) => all.extend(v),
                Err(e) => log::warn!("tier '{name}' cannot be listed, skipped: {e}"),
            }
        }
        all.into_iter().collect()
    }

    pub fn begin(self: &Arc<Self>, step: u64) -> StepWriter {
        StepWriter {
            store: self.clone(),
            manifest: Manifest::new(step, self.rank, self.world_size, &self.memory_name(), self.policy.chunk_size),
            parts: vec![],
            filled: vec![],
            finished: false,
        }
    }

    fn memory_name(&self) -> String {
        self.policy.memory_tier().name.clone()
    }

    /// Waits for every background job; then stops the workers and frees this process's
    /// spare shared memory. Committed steps stay.
    pub fn close(&self) {
        self.scheduler.shutdown();
        if let Some(p) = &self.peer {
            p.shutdown();
        }
        self.memory.release_pool();
    }

    /// Blocks until the background queue is empty.
    pub fn flush(&self) {
        self.scheduler.wait_idle();
    }

    pub fn scheduler(&self) -> &Arc<Scheduler> {
        &self.scheduler
    }

    /// Applies `keep` on a tier and removes uncommitted leftovers older than its newest
    /// committed step. Returns the removed steps.
    pub fn retain(&self, slot: &TierSlot) -> Result<Vec<u64>> {
        match slot.config.kind {
            TierKind::Memory => return self.memory.retain(slot.config.keep.unwrap_or(usize::MAX)),
            // Holders apply `keep` to the copies they hold, as they receive new ones.
            TierKind::Peer => return Ok(vec![]),
            _ => {}
        }
        // Uploads that killed writers left (object stores) go first: a step deleted below may
        // be the one such an upload was writing.
        match slot.tier.blobs().sweep() {
            Ok(done) => done.iter().for_each(|d| log::info!("tier '{}': {d}", slot.config.name)),
            Err(e) => log::warn!("tier '{}': cleaning up abandoned uploads failed: {e}", slot.config.name),
        }
        let committed = slot.tier.committed_steps()?;
        let victims = crate::tier::retention_victims(&committed, &slot.tier.all_steps()?, slot.config.keep);
        for s in &victims {
            slot.tier.delete_step(*s)?;
        }
        Ok(victims)
    }
}

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
}

/// Builds one step of this rank in the memory tier, `put` by `put`.
pub struct StepWriter {
    store: Arc<Store>,
    manifest: Manifest,
    parts: Vec<Arc<Segment>>,
    filled: Vec<bool>,
    finished: bool,
}

/// Raw bytes of chunks stored raw in memory-tier segments.
struct SegmentSource<'a> {
    manifest: &'a Manifest,
    segments: &'a [Arc<Segment>],
}

impl ChunkSource for SegmentSource<'_> {
    fn read_raw(&self, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
        let c = &self.manifest.items[item].chunks[chunk];
        let seg = &self.segments[c.object as usize];
        let start = c.stored_offset as usize;
        dst.copy_from_slice(&seg.bytes()[start..start + c.len as usize]);
        Ok(())
    }

    fn raw_slice(&self, item: usize, chunk: usize) -> Option<&[u8]> {
        let c = &self.manifest.items[item].chunks[chunk];
        let start = c.stored_offset as usize;
        Some(&self.segments[c.object as usize].bytes()[start..start + c.len as usize])
    }
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
            return Err(Error::invalid(format!("step {step}: '{name}' was already put in this step")));
        }
        for it in &items {
            if let Some(shard) = &it.shard {
                shard.check(&it.shape).map_err(|why| Error::invalid(format!("step {step}: item '{}': {why}", it.name)))?;
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
                chunks,
            });
        }
        self.manifest.objects.push(ObjectMeta { name: format::part_name(self.store.rank, part), len: pos });
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
            return Err(Error::invalid(format!(
                "step {}: item '{}' was laid out but never written",
                self.step(),
                self.manifest.items[i].name
            )));
        }
        self.finished = true;
        let store = self.store.clone();
        let manifest = std::mem::take(&mut self.manifest);
        let parts = std::mem::take(&mut self.parts);
        let handle = SaveHandle::new(manifest.step, &store.slots);
        let (store2, handle2) = (store.clone(), handle.clone());
        store.scheduler.submit(Job {
            link: store.slots[0].link.clone(),
            priority: Priority::Flush,
            size: manifest.total_bytes(),
            label: format!("step {}", manifest.step),
            supersede_key: None,
            run: Box::new(move |_| flush_step(store2, handle2, manifest, parts)),
        });
        Ok(handle)
    }
}

/// The background half of a save (see `StepWriter::commit`).
fn flush_step(store: Arc<Store>, handle: Arc<SaveHandle>, mut manifest: Manifest, parts: Vec<Arc<Segment>>) {
    let step = manifest.step;
    let mem = &store.slots[0];
    let mem_name = mem.config.name.clone();
    handle.set(&mem_name, TierState::Running);
    let work = manifest.chunk_refs();
    let crcs: Vec<u32> = store.copy_pool.install(|| {
        work.par_iter()
            .map(|&(i, c)| {
                let ch = &manifest.items[i].chunks[c];
                let start = ch.stored_offset as usize;
                crc32c::crc32c(&parts[ch.object as usize].bytes()[start..start + ch.len as usize])
            })
            .collect()
    });
    for (&(i, c), crc) in work.iter().zip(crcs) {
        manifest.items[i].chunks[c].crc32c = crc;
    }
    let res = store.memory.publish(&manifest).and_then(|_| store.memory.try_commit(step, store.world_size));
    match res {
        Ok(committed) => handle.set(&mem_name, if committed { TierState::Done } else { TierState::Written }),
        Err(e) => {
            let e = e.context(format!("step {step} rank {}", store.rank));
            log::error!("{e}");
            handle.set(&mem_name, TierState::Failed(e.message.clone()));
            for slot in &store.slots[1..] {
                handle.set(&slot.config.name, TierState::Skipped(format!("the memory tier failed: {}", e.message)));
            }
            return;
        }
    }
    let manifest = Arc::new(manifest);
    for (idx, slot) in store.slots.iter().enumerate().skip(1) {
        if step % slot.config.every != 0 {
            handle.set(&slot.config.name, TierState::NotScheduled);
            continue;
        }
        let (store2, handle2, manifest2, parts2) = (store.clone(), handle.clone(), manifest.clone(), parts.clone());
        let name = slot.config.name.clone();
        let priority = if slot.config.kind == TierKind::Peer { Priority::Replicate } else { Priority::Persist };
        store.scheduler.submit(Job {
            link: slot.link.clone(),
            priority,
            size: manifest.total_bytes(),
            label: format!("step {step}"),
            supersede_key: Some(format!("persist:{name}")),
            run: Box::new(move |start| {
                if let Start::Superseded { by } = start {
                    handle2.set(&name, TierState::Skipped(format!("a newer save ({by}) replaced it while it waited")));
                    return;
                }
                handle2.set(&name, TierState::Running);
                let slot = &store2.slots[idx];
                let src = SegmentSource { manifest: &manifest2, segments: &parts2 };
                let res = slot.tier.write_rank(&manifest2, &src, &slot.link).and_then(|_| slot.tier.try_commit(step, store2.world_size));
                drop(parts2);
                match res {
                    Ok(committed) => {
                        handle2.set(&name, if committed { TierState::Done } else { TierState::Written });
                        if let Err(e) = store2.retain(slot) {
                            log::warn!("tier '{name}': retention after step {step} failed: {e}");
                        }
                    }
                    Err(e) => {
                        let e = e.context(format!("persisting step {step} of rank {} to tier '{name}'", store2.rank));
                        log::error!("{e}");
                        handle2.set(&name, TierState::Failed(e.message));
                    }
                }
            }),
        });
    }
    let sizes: Vec<u64> = parts.iter().map(|p| p.len() as u64).collect();
    drop(parts);
    if let Err(e) = store.retain(mem) {
        log::warn!("tier '{mem_name}': retention after step {step} failed: {e}");
    }
    if let Err(e) = store.memory.prefault(&sizes) {
        log::warn!("tier '{mem_name}': pre-faulting for the next step failed: {e}");
    }
}

impl Drop for StepWriter {
    /// A writer dropped without commit (an exception in the `with` block) leaves nothing
    /// behind: its segments are deleted, so no half-written step takes memory.
    fn drop(&mut self) {
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierState {
    Pending,
    Running,
    /// This rank's data and manifest are on the tier; other ranks have not all finished.
    Written,
    /// Committed: every rank's data is on the tier.
    Done,
    /// `every` does not select this step for the tier.
    NotScheduled,
    Skipped(String),
    Failed(String),
}

impl TierState {
    pub fn is_final(&self) -> bool {
        !matches!(self, TierState::Pending | TierState::Running)
    }
    pub fn describe(&self) -> String {
        match self {
            TierState::Pending => "pending".into(),
            TierState::Running => "running".into(),
            TierState::Written => "written".into(),
            TierState::Done => "committed".into(),
            TierState::NotScheduled => "not scheduled".into(),
            TierState::Skipped(r) => format!("skipped: {r}"),
            TierState::Failed(e) => format!("failed: {e}"),
        }
    }
}

/// What a save has done where, tier by tier.
pub struct SaveHandle {
    pub step: u64,
    states: Mutex<Vec<(String, TierState)>>,
    changed: Condvar,
    started: Instant,
}

impl SaveHandle {
    fn new(step: u64, slots: &[TierSlot]) -> Arc<SaveHandle> {
        Arc::new(SaveHandle {
            step,
            states: Mutex::new(slots.iter().map(|s| (s.config.name.clone(), TierState::Pending)).collect()),
            changed: Condvar::new(),
            started: Instant::now(),
        })
    }

    fn set(&self, tier: &str, st: TierState) {
        let mut v = self.states.lock();
        if let Some(e) = v.iter_mut().find(|(n, _)| n == tier) {
            e.1 = st;
        }
        self.changed.notify_all();
    }

    pub fn states(&self) -> Vec<(String, TierState)> {
        self.states.lock().clone()
    }

    pub fn done(&self) -> bool {
        self.states.lock().iter().all(|(_, s)| s.is_final())
    }

    /// Waits until every tier is final or `timeout` passes; true when all are final.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut v = self.states.lock();
        while !v.iter().all(|(_, s)| s.is_final()) {
            match deadline {
                Some(d) => {
                    if self.changed.wait_until(&mut v, d).timed_out() {
                        return v.iter().all(|(_, s)| s.is_final());
                    }
                }
                None => self.changed.wait(&mut v),
            }
        }
        true
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

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

/// Reads one rank's step from the tiers in restore order that have it committed.
pub struct StepReader {
    pub step: u64,
    pub rank: u32,
    /// (tier index in store slots, that tier's manifest), in restore order.
    sources: Vec<(usize, Manifest)>,
    store: Arc<Store>,
    /// Problems met on the way (a bad chunk read from the next tier instead, a tier whose
    /// manifest could not be read), for logs and for the caller to show.
    pub warnings: Mutex<Vec<String>>,
}

impl StepReader {
    /// `tiers`: restrict to these tiers (in this order); default: the policy's restore order.
    pub fn open(store: &Arc<Store>, step: u64, rank: u32, tiers: Option<&[String]>) -> Result<StepReader> {
        let order: Vec<String> = tiers.map(|t| t.to_vec()).unwrap_or_else(|| store.policy.restore_order.clone());
        let mut sources = vec![];
        let mut warnings = vec![];
        let mut seen = vec![];
        let mut broken = false;
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
            if record.ranks.as_ref().is_some_and(|rs| !rs.contains(&rank)) {
                continue; // a host-local commit of other ranks
            }
            seen.push(name.clone());
            if rank >= record.world_size {
                return Err(Error::invalid(format!(
                    "tier '{name}': step {step} was saved by {} ranks; there is no rank {rank}",
                    record.world_size
                )));
            }
            match tier.read_manifest(step, rank) {
                Ok(m) => sources.push((idx, m)),
                Err(e) => warnings.push(e.message),
            }
        }
        if sources.is_empty() {
            let mut have = vec![];
            for name in &order {
                if let Ok(slot) = store.slot(name) {
                    let steps = slot.tier.committed_steps().unwrap_or_default();
                    have.push(format!("{name}: {steps:?}"));
                }
            }
            let why = if warnings.is_empty() { String::new() } else { format!(" ({})", warnings.join("; ")) };
            let kind = if seen.is_empty() && !broken { ErrorKind::NotFound } else { ErrorKind::Integrity };
            return Err(Error::new(
                kind,
                format!("step {step} rank {rank} can be restored from no tier in {order:?}{why}; committed steps: {}", have.join(", ")),
            ));
        }
        for w in &warnings {
            log::warn!("{w}");
        }
        Ok(StepReader { step, rank, sources, store: store.clone(), warnings: Mutex::new(warnings) })
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
    pub fn read_items(&self, items: &[usize]) -> Result<Vec<(ItemData, String)>> {
        let m = self.manifest();
        for &i in items {
            if i >= m.items.len() {
                return Err(Error::invalid(format!("step {}: no item {i}", self.step)));
            }
        }
        let mut views: HashMap<String, Arc<View>> = HashMap::new();
        self.store.copy_pool.install(|| items.iter().map(|&i| self.read_span(i, 0, m.items[i].nbytes, &mut views)).collect())
    }

    /// Reads bytes `start..start + len` of item `item`, touching only the chunks that overlap
    /// them (each still verified whole by its CRC32C, falling back chunk by chunk across tiers
    /// like `read_items`). A zero-copy view when the item qualifies for one.
    pub fn read_range(&self, item: usize, start: u64, len: u64) -> Result<(ItemData, String)> {
        let it = self.manifest().items.get(item).ok_or_else(|| Error::invalid(format!("step {}: no item {item}", self.step)))?;
        let end = start.checked_add(len).filter(|e| *e <= it.nbytes).ok_or_else(|| {
            Error::invalid(format!(
                "step {} rank {} item '{}': bytes {start}..{} lie outside its {} bytes",
                self.step,
                self.rank,
                it.name,
                start as u128 + len as u128,
                it.nbytes
            ))
        })?;
        let mut views = HashMap::new();
        self.store.copy_pool.install(|| self.read_span(item, start, end, &mut views))
    }

    /// Bytes `start..end` of item `i`: zero-copy if it can, else chunk by chunk.
    fn read_span(&self, i: usize, start: u64, end: u64, views: &mut HashMap<String, Arc<View>>) -> Result<(ItemData, String)> {
        if let Some(v) = self.try_zero_copy(i, start, end, views)? {
            return Ok(v);
        }
        self.read_owned(i, start, end)
    }

    /// The fast path: the first source is the memory tier, the chunks of `start..end` sit
    /// raw and contiguous in one object, and each of their checksums holds.
    fn try_zero_copy(&self, i: usize, start: u64, end: u64, views: &mut HashMap<String, Arc<View>>) -> Result<Option<(ItemData, String)>> {
        let (idx, m) = &self.sources[0];
        let slot = &self.store.slots[*idx];
        if slot.config.kind != TierKind::Memory {
            return Ok(None);
        }
        let it = &m.items[i];
        let chunks = &it.chunks[overlapping(&it.chunks, start, end)];
        let Some(first) = chunks.first() else {
            return Ok(Some((ItemData::Owned(vec![]), slot.config.name.clone())));
        };
        // Where byte 0 of the item would lie if the item is stored contiguously.
        let base = first.stored_offset.wrapping_sub(first.offset);
        let contiguous = chunks
            .iter()
            .all(|c| c.codec == crate::codec::RAW && c.object == first.object && c.stored_offset == base.wrapping_add(c.offset));
        if !contiguous {
            return Ok(None);
        }
        let obj = &m.objects[first.object as usize].name;
        let view = match views.get(obj) {
            Some(v) => v.clone(),
            None => match self.store.memory.view(m.step, obj) {
                Ok(v) => {
                    views.insert(obj.clone(), v.clone());
                    v
                }
                Err(e) => {
                    self.warnings.lock().push(e.message);
                    return Ok(None);
                }
            },
        };
        let last = chunks.last().expect("not empty");
        if last.stored_offset + last.len > view.len() as u64 {
            self.warnings
                .lock()
                .push(format!("tier '{}': step {} rank {} object {obj} is shorter than its manifest", slot.config.name, m.step, m.rank));
            return Ok(None);
        }
        let ok = chunks.par_iter().all(|c| {
            let s = c.stored_offset as usize;
            crc32c::crc32c(&view[s..s + c.len as usize]) == c.crc32c
        });
        if !ok {
            return Ok(None); // read_owned finds the bad chunks, says which, and falls back
        }
        // The first overlapping chunk starts at or before `start` (chunks tile the item).
        let (offset, len) = ((first.stored_offset + (start - first.offset)) as usize, (end - start) as usize);
        Ok(Some((ItemData::View { view, offset, len }, slot.config.name.clone())))
    }

    /// Reads bytes `start..end` of item `i`: every overlapping chunk from the first source
    /// that has a valid copy of it. A chunk the range covers only in part is read whole (its
    /// checksum covers all of it) and cut.
    fn read_owned(&self, i: usize, start: u64, end: u64) -> Result<(ItemData, String)> {
        let primary = &self.manifest().items[i];
        let range = overlapping(&primary.chunks, start, end);
        let mut buf = vec![0u8; (end - start) as usize];
        let mut dsts: Vec<(usize, &mut [u8])> = vec![];
        let mut rest = &mut buf[..];
        for c in range {
            let ch = &primary.chunks[c];
            let n = (ch.offset + ch.len).min(end) - ch.offset.max(start);
            let (a, b) = rest.split_at_mut(n as usize);
            dsts.push((c, a));
            rest = b;
        }
        let used: Vec<Result<usize>> = dsts
            .into_par_iter()
            .map(|(c, dst)| {
                let ch = &primary.chunks[c];
                if dst.len() as u64 == ch.len {
                    return self.read_chunk_anywhere(primary, c, dst);
                }
                let mut whole = vec![0u8; ch.len as usize];
                let s = self.read_chunk_anywhere(primary, c, &mut whole)?;
                let from = (ch.offset.max(start) - ch.offset) as usize;
                dst.copy_from_slice(&whole[from..from + dst.len()]);
                Ok(s)
            })
            .collect();
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
        Ok((ItemData::Owned(buf), label))
    }

    /// Reads chunk `c` of `primary` (an item of the first source's manifest) into `dst` from
    /// the first source with a matching copy that decodes and passes its checksum. Returns
    /// the index of that source.
    fn read_chunk_anywhere(&self, primary: &ItemMeta, c: usize, dst: &mut [u8]) -> Result<usize> {
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
            match read_chunk(tier, m, j, c, dst) {
                Ok(()) => {
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
        Err(Error::integrity(format!(
            "step {} rank {} item '{}' chunk {c}: no tier has a valid copy: {}",
            self.step,
            self.rank,
            primary.name,
            errs.join("; ")
        )))
    }
}

/// Indices of the chunks (in item order, each starting where the previous ended) that
/// overlap bytes `start..end`; empty when the range is.
fn overlapping(chunks: &[ChunkMeta], start: u64, end: u64) -> std::ops::Range<usize> {
    if start >= end {
        return 0..0;
    }
    let first = chunks.partition_point(|c| c.offset + c.len <= start);
    let last = chunks.partition_point(|c| c.offset < end);
    first..last.max(first)
}

/// Copies one committed step (every rank) from one tier to another and commits it there.
pub fn copy_step(store: &Arc<Store>, step: u64, from: &str, to: &str, progress: &dyn Fn(u32, u32)) -> Result<()> {
    let src_slot = store.slot(from)?;
    let dst_slot = store.slot(to)?;
    let record = src_slot.tier.commit_record(step)?;
    for rank in 0..record.world_size {
        let reader = StepReader::open(store, step, rank, Some(&[from.to_string()]))?;
        let m = reader.manifest().clone();
        struct ReaderSource<'a>(&'a StepReader);
        impl ChunkSource for ReaderSource<'_> {
            fn read_raw(&self, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
                let (idx, m) = &self.0.sources[0];
                read_chunk(&*self.0.store.slots[*idx].tier, m, item, chunk, dst)
            }
        }
        dst_slot.tier.write_rank(&m, &ReaderSource(&reader), &dst_slot.link)?;
        progress(rank + 1, record.world_size);
    }
    if !dst_slot.tier.try_commit(step, record.world_size)? {
        return Err(Error::integrity(format!("tier '{to}': step {step} did not commit after copying every rank")));
    }
    Ok(())
}
