//! A tier over any `Blobs` store (a filesystem directory, an s3 or gcs bucket prefix, a
//! Python tier) in the version-3 layout: each rank's manifests and data objects of every step
//! in the rank's own area (`format::rank_area`), a step's directory holding only its commit
//! record. With `dedup`, a chunk whose bytes the rank's previous save here stores already is
//! referred to instead of written again (`areas`); after each persist the rank sweeps its
//! own area (`sweep_rank`), and gc marks and sweeps every area (`blob_gc`). Steps written in
//! the layout of versions 1-2 (everything in the step's directory) are read and removed as
//! before.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use super::areas::{self, RankArea, StoredRef, Swept};
use super::layout::StepLayout;
use super::{encode_rank, EncodeInto, Tier};
use crate::blobs::Blobs;
use crate::codec::Compression;
use crate::error::Result;
use crate::format::{self, ChunkMeta, ChunkSource, Manifest, ObjectMeta};
use crate::gc::{GcOptions, Removal};
use crate::scheduler::Link;

pub struct BlobTier {
    name: String,
    pub(super) layout: StepLayout,
    compression: Compression,
    /// Whether chunks the rank's previous save here stores are referred to, not written again.
    dedup: bool,
    /// Steps this process wrote replicated items of: their commits check every rank's copies
    /// (`replica::check_copies`); other steps commit without reading every manifest.
    replicated: parking_lot::Mutex<std::collections::BTreeSet<u64>>,
    /// What this process knows of each rank area it writes.
    pub(super) areas: parking_lot::Mutex<HashMap<u32, Arc<parking_lot::Mutex<RankArea>>>>,
}

impl BlobTier {
    /// A tier that refers to unchanged chunks (`dedup = true`, the default of fs, s3 and gcs).
    pub fn new(name: &str, blobs: Arc<dyn Blobs>, compression: Compression) -> BlobTier {
        BlobTier::with_dedup(name, blobs, compression, true)
    }

    pub fn with_dedup(name: &str, blobs: Arc<dyn Blobs>, compression: Compression, dedup: bool) -> BlobTier {
        BlobTier {
            name: name.into(),
            layout: StepLayout::with_areas(name, blobs),
            compression,
            dedup,
            replicated: Default::default(),
            areas: Default::default(),
        }
    }

    /// The objects underneath (for tools and tests that look at or damage stored bytes).
    pub fn blobs(&self) -> &dyn Blobs {
        self.layout.blobs()
    }

    pub(super) fn area(&self, rank: u32) -> Arc<parking_lot::Mutex<RankArea>> {
        self.areas.lock().entry(rank).or_default().clone()
    }

    /// Sweeps rank `rank`'s area: its manifests of steps that are gone, its data objects no
    /// manifest left refers to (see `areas`). `keep` is the tier's retention; whether a step
    /// is committed is `known`'s answer (the job's counter: `store::records`), else a HEAD
    /// of its record.
    pub fn sweep_rank(&self, rank: u32, keep: Option<usize>, known: &dyn Fn(u64) -> Option<bool>) -> Result<Swept> {
        let area = self.area(rank);
        let read = |step: u64| self.layout.read_manifest_in_area(step, rank);
        let committed = |step: u64| match known(step) {
            Some(c) => Ok(c),
            None => self.blobs().exists(&format!("{}/{}", format::step_dir(step), format::COMMIT_NAME)),
        };
        areas::sweep(self.blobs(), &area, rank, keep, &committed, &read).map_err(|e| e.with_tier(&self.name))
    }

    /// The chunks of `logical` whose bytes `prev` stores (by item and chunk index).
    fn reused(&self, logical: &Manifest, prev: Option<&Manifest>) -> HashMap<(usize, usize), StoredRef> {
        let Some(prev) = prev.filter(|_| self.dedup) else { return HashMap::new() };
        let stored = areas::stored_chunks(prev);
        let mut out = HashMap::new();
        for (i, it) in logical.items.iter().enumerate() {
            if it.replica.as_ref().is_some_and(|r| r.shared) {
                continue;
            }
            for (c, ch) in it.chunks.iter().enumerate() {
                let Some(h) = &ch.hash else { continue };
                if let Some(r) = stored.get(&(h.clone(), ch.len)).filter(|r| areas::same_bytes(ch, r)) {
                    out.insert((i, c), r.clone());
                }
            }
        }
        out
    }

    /// Writes rank `logical.rank`'s step: the chunks not stored already into one new data
    /// object of its area (none when every chunk is), then the manifest, last.
    fn write_area(&self, logical: &Manifest, src: &dyn ChunkSource, link: &Link, area: &parking_lot::Mutex<RankArea>) -> Result<Manifest> {
        let (step, rank) = (logical.step, logical.rank);
        // What an earlier process left in the area, once per process: a fresh launch's save
        // of a step the rank has no manifest of then sends nothing to the step's prefix.
        // Where the listing fails the area stays unknown, and the save takes back what may
        // be there, as before a listing.
        if let Err(e) = areas::learn(self.blobs(), area, rank) {
            log::warn!("tier '{}': rank {rank}'s area cannot be listed: {e}; taking step {step} back before writing it", self.name);
        }
        let (prev, may_hold) = {
            let a = area.lock();
            (a.last.clone(), a.may_hold(step))
        };
        // A rank with no manifest of this step here (as far as its last listing and its own
        // writes since tell) has no commit of it here either: nothing to take back first.
        if may_hold {
            self.layout.uncommit(step, rank)?;
        }
        let reused = self.reused(logical, prev.as_deref());
        let data_key = format::area_data_key(step, rank, &format::unique_token());
        let mut keys: BTreeSet<String> = reused.values().filter_map(|r| r.object.key.clone()).collect();
        keys.insert(data_key.clone());
        let id = area.lock().begin(step, keys);
        let res = self.write_objects(logical, src, link, &reused, &data_key);
        area.lock().end(id, &data_key, res.as_ref().ok().map(|m| Arc::new(m.clone())));
        res
    }

    fn write_objects(
        &self,
        logical: &Manifest,
        src: &dyn ChunkSource,
        link: &Link,
        reused: &HashMap<(usize, usize), StoredRef>,
        data_key: &str,
    ) -> Result<Manifest> {
        let name = data_key.rsplit('/').next().unwrap_or(data_key).to_string();
        let object = ObjectMeta { name, len: 0, key: Some(data_key.to_string()) };
        let fresh = logical
            .chunk_refs()
            .into_iter()
            .filter(|&(i, c)| !logical.items[i].replica.as_ref().is_some_and(|r| r.shared) && !reused.contains_key(&(i, c)))
            .count();
        let store = |i: usize, c: usize| !reused.contains_key(&(i, c));
        let mut m = if fresh == 0 {
            // Nothing new: no data object at all.
            let mut m =
                encode_rank(&self.name, logical, src, self.compression, EncodeInto { object, store: &store }, link, &mut |_| Ok(()))?;
            m.objects.clear();
            m
        } else {
            let mut w = self.blobs().create(data_key)?;
            match encode_rank(&self.name, logical, src, self.compression, EncodeInto { object, store: &store }, link, &mut |b| w.write(b)) {
                Ok(m) => {
                    w.finish()?;
                    m
                }
                Err(e) => {
                    w.abort();
                    return Err(e);
                }
            }
        };
        let mut index: HashMap<String, u32> = m.objects.iter().enumerate().filter_map(|(i, o)| Some((o.key.clone()?, i as u32))).collect();
        for (&(i, c), r) in reused {
            let key = r.object.key.clone().expect("a stored reference has a key");
            let next = m.objects.len() as u32;
            let idx = *index.entry(key).or_insert_with(|| {
                m.objects.push(r.object.clone());
                next
            });
            let ch: &mut ChunkMeta = &mut m.items[i].chunks[c];
            ch.object = idx;
            ch.stored_offset = r.chunk.stored_offset;
            ch.stored_len = r.chunk.stored_len;
            ch.codec = r.chunk.codec.clone();
        }
        m.version = format::AREAS_VERSION;
        crate::failpoint::hit("persist");
        self.layout.write_manifest(&m)?;
        Ok(m)
    }
}

impl Tier for BlobTier {
    super::layout::forward_to_layout!();

    fn name(&self) -> &str {
        &self.name
    }

    fn write_rank(&self, logical: &Manifest, src: &dyn ChunkSource, link: &Link) -> Result<Manifest> {
        // Replicated items are stored once per replica group, by its primary rank.
        let logical = &crate::tier::replica::share(logical);
        if logical.items.iter().any(|i| i.replica.as_ref().is_some_and(|r| !r.matched)) {
            let mut r = self.replicated.lock();
            r.insert(logical.step);
            while r.len() > 64 {
                r.pop_first();
            }
        }
        let area = self.area(logical.rank);
        self.write_area(logical, src, link, &area)
    }

    fn sweep(&self, rank: u32, keep: Option<usize>, known: &dyn Fn(u64) -> Option<bool>) -> Result<()> {
        let swept = self.sweep_rank(rank, keep, known)?;
        if !swept.manifests.is_empty() || !swept.objects.is_empty() {
            log::debug!(
                "tier '{}': rank {rank} swept its manifests of steps {:?} and {} data objects",
                self.name,
                swept.manifests,
                swept.objects.len()
            );
        }
        Ok(())
    }

    fn merged_reads(&self) -> Option<crate::blobs::MergedReads> {
        self.layout.blobs().merged_reads()
    }

    fn requests(&self) -> Option<Arc<crate::requests::RequestCounters>> {
        self.layout.blobs().requests()
    }

    fn read_stored_run(&self, m: &Manifest, chunks: &[ChunkMeta], dst: &mut [u8]) -> Result<()> {
        self.layout.read_stored_run(m, chunks, dst)
    }

    fn try_commit(&self, step: u64, world_size: u32) -> Result<bool> {
        // Once every rank is written (and before the commit): a rank whose replicated items
        // differ from its primary's keeps the step from committing, with an error naming it.
        // Checked where this process saved replicated items (every rank of a job that uses
        // them does); a restore checks the same again (`replica::resolve`).
        if !self.replicated.lock().contains(&step) {
            return self.layout.try_commit(step, world_size, None);
        }
        // Only the ranks listed here are checked, so the commit waits for a listing that
        // holds them all (the last rank to write always sees one).
        if self.layout.commit_record(step).is_ok() {
            return Ok(true);
        }
        let ranks = self.layout.ranks(step)?;
        if (0..world_size).any(|r| ranks.binary_search(&r).is_err()) {
            return Ok(false);
        }
        crate::tier::replica::check_copies(self, step, &ranks)?;
        self.layout.try_commit(step, world_size, None)
    }

    fn counts_commits(&self) -> bool {
        true
    }

    fn dedups(&self) -> bool {
        self.dedup
    }

    fn commit_counted(&self, step: u64, world_size: u32, generation: &Option<String>) -> Result<()> {
        // A step with replicated items: the committer checks every rank's copies against
        // its primary's first (O(N) reads, on this one rank), as `try_commit` does.
        if self.replicated.lock().contains(&step) {
            crate::tier::replica::check_copies(self, step, &(0..world_size).collect::<Vec<_>>())?;
        }
        self.layout.commit_counted(step, world_size, generation)
    }

    /// The commit record first, then every rank's manifest of the step (their data objects
    /// go with the next sweep or gc: a later step may refer to their chunks).
    fn delete_step(&self, step: u64) -> Result<()> {
        let ranks = self.layout.ranks(step)?;
        self.layout.delete_step(step)?;
        let names: Vec<String> = ranks.iter().map(|&r| format::area_manifest_key(step, r)).collect();
        self.blobs().delete_names(&names)?;
        let areas = self.areas.lock();
        for r in ranks {
            if let Some(a) = areas.get(&r) {
                let mut a = a.lock();
                a.refs.remove(&step);
                if let Some(set) = &mut a.manifests {
                    set.remove(&step);
                }
            }
        }
        Ok(())
    }

    fn gc_plan(&self, opts: &GcOptions) -> Result<Vec<Removal>> {
        super::blob_gc::plan(self, opts)
    }

    fn gc_apply(&self, plan: Vec<Removal>) -> Result<Vec<Removal>> {
        super::blob_gc::apply(self, plan)
    }
}
