//! The step layout of docs/format.md on named byte objects (`Blobs`): one directory (key
//! prefix) per step with a commit record written last, and each rank's manifests and data
//! objects either in the step's directory (versions 1-2: the memory tier, and steps blob tiers
//! wrote before version 3) or in the rank's own area (version 3, `format::rank_area`: the
//! blob tiers now). The tiers that keep their steps this way (memory, fs, s3, gcs) implement
//! `Tier` through it; a tier that keeps them elsewhere (peer) does not use it at all.
//!
//! Which layout a step has is learnt per step and remembered (`known`): from its commit
//! record (version 3: rank areas), from a manifest this process wrote or read. A reader of an
//! old step reads its commit record first (restores do), so it reads each manifest with one
//! request, as before; a manifest of a step not known yet is looked for in its rank area
//! first, then in the step's directory.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::blobs::Blobs;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self, ChunkMeta, CommitRecord, JobId, Manifest};
use crate::gc::{self, GcOptions, Listed, Removal, Target};

pub struct StepLayout {
    tier: String,
    blobs: Arc<dyn Blobs>,
    /// The job written into commit records (`set_job`); none until a Store sets it.
    job: parking_lot::RwLock<Option<JobId>>,
    /// Whether this tier writes the version-3 layout (rank areas): blob tiers do.
    areas: bool,
    /// Per step, whether its manifests lie in rank areas, as last learnt (bounded).
    known: parking_lot::Mutex<BTreeMap<u64, bool>>,
    /// The world size of the saves this process wrote here (`ranks` of a step not committed).
    world: parking_lot::Mutex<Option<u32>>,
}

/// How many steps' layouts a `StepLayout` remembers.
const KNOWN_STEPS: usize = 4096;

/// The key of object `name` of `step`.
pub fn key(step: u64, name: &str) -> String {
    format!("{}/{name}", format::step_dir(step))
}

impl StepLayout {
    /// The layout of versions 1-2 (every rank's objects in the step's directory): the
    /// memory tier's.
    pub fn new(tier: &str, blobs: Arc<dyn Blobs>) -> StepLayout {
        StepLayout { tier: tier.into(), blobs, job: Default::default(), areas: false, known: Default::default(), world: Default::default() }
    }

    /// The version-3 layout (rank areas) for the steps written from now on; steps of
    /// versions 1-2 are read as before.
    pub fn with_areas(tier: &str, blobs: Arc<dyn Blobs>) -> StepLayout {
        StepLayout { areas: true, ..StepLayout::new(tier, blobs) }
    }

    /// Whether this layout writes rank areas.
    pub fn areas(&self) -> bool {
        self.areas
    }

    fn learn(&self, step: u64, in_areas: bool) {
        let mut known = self.known.lock();
        known.insert(step, in_areas);
        while known.len() > KNOWN_STEPS {
            known.pop_first();
        }
    }

    /// Whether `step`'s manifests lie in rank areas: None while not known.
    fn in_areas(&self, step: u64) -> Option<bool> {
        if !self.areas {
            return Some(false);
        }
        self.known.lock().get(&step).copied()
    }

    /// The key of rank `rank`'s manifest of `step` in one layout or the other.
    pub fn manifest_key(step: u64, rank: u32, in_areas: bool) -> String {
        if in_areas {
            format::area_manifest_key(step, rank)
        } else {
            key(step, &format::manifest_name(rank))
        }
    }

    /// The job that commits here from now on (recorded in each commit record).
    pub fn set_job(&self, job: &JobId) {
        *self.job.write() = Some(job.clone());
    }

    /// The objects underneath (manifests, commit records, data objects).
    pub fn blobs(&self) -> &dyn Blobs {
        &*self.blobs
    }

    /// All steps with a directory here or (rank areas) a manifest in some rank's area,
    /// committed or not, oldest first. Lists every area: for tools, not a save's path.
    pub fn all_steps(&self) -> Result<Vec<u64>> {
        let names = self.blobs.list("")?;
        let mut v: std::collections::BTreeSet<u64> = names.iter().filter_map(|n| format::parse_step_dir(n)).collect();
        if self.areas && names.iter().any(|n| n == format::AREAS) {
            for area in self.rank_areas()? {
                for n in self.blobs.list(&area)? {
                    if let Some(format::AreaEntry::Manifest(s)) = format::parse_area_name(&n) {
                        v.insert(s);
                    }
                }
            }
        }
        Ok(v.into_iter().collect())
    }

    /// Committed steps, oldest first.
    pub fn committed_steps(&self) -> Result<Vec<u64>> {
        Ok(self.list_steps()?.committed)
    }

    /// All steps, the committed ones and the names at the root, from one listing (and one
    /// look per step for its commit record).
    pub fn list_steps(&self) -> Result<Listed> {
        let names = self.blobs.list("")?;
        let mut all: Vec<u64> = names.iter().filter_map(|n| format::parse_step_dir(n)).collect();
        all.sort_unstable();
        let mut committed = vec![];
        for &s in &all {
            if self.blobs.exists(&key(s, format::COMMIT_NAME))? {
                committed.push(s);
            }
        }
        Ok(Listed { all, committed, names: Some(names) })
    }

    pub fn commit_record(&self, step: u64) -> Result<CommitRecord> {
        let k = key(step, format::COMMIT_NAME);
        let bytes = self.blobs.get(&k).map_err(|e| match e.kind {
            ErrorKind::NotFound => Error::not_found(format!("tier '{}': step {step} is not committed", self.tier)),
            _ => e,
        });
        let at = |e: Error| e.with_tier(&self.tier).with_step(step).with_path(self.blobs.describe(&k));
        let record = CommitRecord::from_json(&bytes.map_err(at)?, &self.blobs.describe(&k)).map_err(at)?;
        if self.areas {
            self.learn(step, record.version >= format::AREAS_VERSION);
        }
        Ok(record)
    }

    pub fn read_manifest(&self, step: u64, rank: u32) -> Result<Manifest> {
        match self.in_areas(step) {
            Some(in_areas) => self.read_manifest_at(step, rank, in_areas),
            None => match self.read_manifest_at(step, rank, true) {
                Err(e) if e.kind == ErrorKind::NotFound => self.read_manifest_at(step, rank, false),
                res => res,
            },
        }
    }

    /// Rank `rank`'s manifest of `step` in its rank area (gc reads the areas it lists).
    pub fn read_manifest_in_area(&self, step: u64, rank: u32) -> Result<Manifest> {
        self.read_manifest_at(step, rank, true)
    }

    fn read_manifest_at(&self, step: u64, rank: u32, in_areas: bool) -> Result<Manifest> {
        let k = Self::manifest_key(step, rank, in_areas);
        let bytes = self.blobs.get(&k).map_err(|e| match e.kind {
            ErrorKind::NotFound => Error::not_found(format!("tier '{}': step {step} has no manifest for rank {rank}", self.tier)),
            _ => e,
        });
        let at = |e: Error| e.with_tier(&self.tier).at(step, rank).with_path(self.blobs.describe(&k));
        let m = Manifest::from_json(&bytes.map_err(at)?, &self.blobs.describe(&k)).map_err(at)?;
        if m.step != step || m.rank != rank {
            return Err(at(Error::integrity(format!(
                "{}: manifest says step {} rank {}, expected step {step} rank {rank}",
                self.blobs.describe(&k),
                m.step,
                m.rank
            ))));
        }
        if self.areas {
            self.learn(step, in_areas);
        }
        Ok(m)
    }

    /// Writes a rank's manifest (atomically): its data is complete. In this layout's own
    /// place for new steps (a rank area, or the step's directory).
    pub fn write_manifest(&self, m: &Manifest) -> Result<()> {
        self.blobs.put(&Self::manifest_key(m.step, m.rank, self.areas), &m.to_json())?;
        if self.areas {
            self.learn(m.step, true);
            *self.world.lock() = Some(m.world_size);
        }
        Ok(())
    }

    /// Before a rank writes a step again: its commit and this rank's manifest go first, so
    /// no reader mixes old and new data and no stale manifest counts towards a new commit.
    /// (A blob tier skips this where it knows that the rank has no manifest of the step
    /// here: then no commit of it can be there either.)
    pub fn uncommit(&self, step: u64, rank: u32) -> Result<()> {
        self.blobs.delete(&key(step, format::COMMIT_NAME))?;
        self.blobs.delete(&Self::manifest_key(step, rank, self.areas))
    }

    /// Ranks whose manifest of `step` is here (committed or not). In the step's directory:
    /// one listing. In rank areas: a look at each rank's manifest of 0..world size (the
    /// commit record's, else this process's saves'); a step of neither (not committed, saved
    /// by another job) lists every area: a diagnosis, never a save's path.
    pub fn ranks(&self, step: u64) -> Result<Vec<u32>> {
        let names = self.blobs.list(&format::step_dir(step))?;
        let mut v: Vec<u32> = names.iter().filter_map(|n| n.strip_prefix("rank-")?.strip_suffix(".manifest.json")?.parse().ok()).collect();
        if !self.areas || !v.is_empty() {
            v.sort_unstable();
            return Ok(v);
        }
        let committed = names.iter().any(|n| n == format::COMMIT_NAME);
        let world = if committed { Some(self.commit_record(step)?.world_size) } else { *self.world.lock() };
        if let Some(world) = world {
            let mut v = vec![];
            for r in 0..world {
                if self.blobs.exists(&format::area_manifest_key(step, r))? {
                    v.push(r);
                }
            }
            // This process's world size may not be the step's (another job's save): where it
            // finds none, every area is looked at.
            if committed || !v.is_empty() {
                return Ok(v);
            }
        }
        self.ranks_by_listing(step)
    }

    /// Ranks with a manifest of `step` in their area, found by listing every area (a step
    /// whose world size nothing here tells: a diagnosis, never on a save's path).
    fn ranks_by_listing(&self, step: u64) -> Result<Vec<u32>> {
        let mut v = vec![];
        for area in self.rank_areas()? {
            let Some(rank) = format::parse_rank_dir(area.rsplit('/').next().unwrap_or("")) else { continue };
            if self.blobs.exists(&format::area_manifest_key(step, rank))? {
                v.push(rank);
            }
        }
        v.sort_unstable();
        Ok(v)
    }

    /// Every rank area here (`ranks/<pp>/rank-RRRRR`), by listing.
    pub fn rank_areas(&self) -> Result<Vec<String>> {
        let mut out = vec![];
        for p in self.blobs.list(format::AREAS)? {
            if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                continue;
            }
            let dir = format!("{}/{p}", format::AREAS);
            for r in self.blobs.list(&dir)? {
                if format::parse_rank_dir(&r).is_some() {
                    out.push(format!("{dir}/{r}"));
                }
            }
        }
        Ok(out)
    }

    /// Writes `step`'s commit record once the manifest of every rank it covers is there:
    /// `ranks` (a host-local tier's ranks, recorded in the commit), else all of `world_size`.
    /// Each rank tries after writing its own manifest, so the last one to finish commits.
    pub fn try_commit(&self, step: u64, world_size: u32, ranks: Option<Vec<u32>>) -> Result<bool> {
        let dir = format::step_dir(step);
        let names = self.blobs.list(&dir)?;
        if names.iter().any(|n| n == format::COMMIT_NAME) {
            return Ok(true);
        }
        let needed: Vec<u32> = match &ranks {
            Some(rs) => rs.clone(),
            None => (0..world_size).collect(),
        };
        // In rank areas the manifests are not listed here: reading them (`one_generation`)
        // finds a missing one.
        if !self.areas && !needed.iter().all(|r| names.contains(&format::manifest_name(*r))) {
            return Ok(false);
        }
        let Some(generation) = self.one_generation(step, &needed)? else {
            return Ok(false);
        };
        self.write_commit(step, world_size, ranks, generation)?;
        Ok(true)
    }

    /// Writes `step`'s commit record of save `generation` for all of `world_size` ranks,
    /// without reading their manifests: the caller counted every rank in after its manifest
    /// of `generation` was durable (`store::commit`). Where listing is cheap (a filesystem:
    /// one directory read, no request), it checks that every manifest is here all the same: a
    /// directory that is not one shared by every host would otherwise commit ranks it lacks.
    pub fn commit_counted(&self, step: u64, world_size: u32, generation: &Option<String>) -> Result<()> {
        if self.blobs.lists_cheaply() {
            let have = if self.areas {
                let mut v = vec![];
                for r in 0..world_size {
                    if self.blobs.exists(&format::area_manifest_key(step, r))? {
                        v.push(r);
                    }
                }
                v
            } else {
                self.ranks(step)?
            };
            let missing: Vec<u32> = (0..world_size).filter(|r| have.binary_search(r).is_err()).collect();
            if !missing.is_empty() {
                return Err(Error::integrity(format!(
                    "tier '{}': step {step}: every rank counted its manifest in, but {} has none of ranks {:?}{}: \
                     an fs tier must be one directory that every host of the job mounts",
                    self.tier,
                    self.blobs.describe(if self.areas { format::AREAS } else { "" }),
                    &missing[..missing.len().min(8)],
                    if missing.len() > 8 { " ..." } else { "" }
                ))
                .with_tier(&self.tier)
                .with_step(step));
            }
        }
        self.write_commit(step, world_size, None, generation.clone())
    }

    /// The commit record, last and create-if-absent: a commit there already (the same save's,
    /// by a rank that retried, or one a reader already trusts) is left as it is.
    fn write_commit(&self, step: u64, world_size: u32, ranks: Option<Vec<u32>>, generation: Option<String>) -> Result<()> {
        let mut record = CommitRecord::new(step, world_size, &self.tier);
        if self.areas {
            // Tells a reader that the manifests lie in rank areas (and an older tiercel to
            // refuse the step rather than look for them in the step's directory).
            record.version = format::AREAS_VERSION;
        }
        record.ranks = ranks;
        record.job = self.job.read().clone();
        record.generation = generation;
        crate::failpoint::hit("commit");
        self.blobs.put_if_absent(&key(step, format::COMMIT_NAME), &record.to_json())?;
        Ok(())
    }

    /// The generation that the manifests of `ranks` share: `Some(generation)` when they all
    /// belong to one save of `step`, None while some rank's manifest is still of an earlier
    /// save (a re-save in progress, or one whose rank died: the step then stays uncommitted
    /// here rather than commit old ranks with new ones) or was removed meanwhile.
    fn one_generation(&self, step: u64, ranks: &[u32]) -> Result<Option<Option<String>>> {
        let mut seen: Option<Option<String>> = None;
        for &r in ranks {
            let m = match self.read_manifest(step, r) {
                Ok(m) => m,
                Err(e) if e.kind == ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            };
            match &seen {
                None => seen = Some(m.generation),
                Some(g) if *g == m.generation => {}
                Some(g) => {
                    log::debug!(
                        "tier '{}': step {step} not committed yet: rank {r}'s manifest is of save {:?}, another rank's of {:?}",
                        self.tier,
                        m.generation,
                        g
                    );
                    return Ok(None);
                }
            }
        }
        Ok(Some(seen.flatten()))
    }

    /// Removes a step; its commit record goes first, so no reader sees it half-deleted. A
    /// step in rank areas keeps nothing else in its directory, but a store whose directories
    /// outlive their objects (a filesystem, a Python tier over one) keeps the directory, and
    /// a step of versions 1-2 keeps everything there: the prefix goes too. Its manifests and
    /// data objects in rank areas go with each rank's sweep (`tier::areas`) or gc.
    pub fn delete_step(&self, step: u64) -> Result<()> {
        self.blobs.delete(&key(step, format::COMMIT_NAME))?;
        self.blobs.delete_prefix(&format::step_dir(step))
    }

    /// Reads the stored bytes of one chunk: `stored_len` bytes at `stored_offset` of its object.
    pub fn read_stored(&self, m: &Manifest, c: &ChunkMeta, dst: &mut [u8]) -> Result<()> {
        self.blobs.get_range(&m.objects[c.object as usize].key_in(m.step), c.stored_offset, dst)
    }

    /// `read_stored`, handing the bytes to `each` piece by piece as they land
    /// (`Blobs::get_range_blocks`).
    pub fn read_stored_blocks(&self, m: &Manifest, c: &ChunkMeta, dst: &mut [u8], each: &mut dyn FnMut(&[u8])) -> Result<()> {
        self.blobs.get_range_blocks(&m.objects[c.object as usize].key_in(m.step), c.stored_offset, dst, each)
    }

    /// Reads the stored bytes of chunks that lie back to back in one object in one ranged
    /// read (`Tier::read_stored_run`).
    pub fn read_stored_run(&self, m: &Manifest, chunks: &[ChunkMeta], dst: &mut [u8]) -> Result<()> {
        match chunks.first() {
            Some(c) => self.read_stored(m, c, dst),
            None => Ok(()),
        }
    }

    /// The gc plan of this layout: steps by the rule of `gc`, then what dead writers
    /// left in the objects underneath (temporary files, abandoned uploads), except inside
    /// steps the plan removes anyway.
    pub fn gc_plan(&self, opts: &GcOptions) -> Result<Vec<Removal>> {
        // Another job's steps, and pinned ones, are neither counted towards `keep` nor removed.
        let mine = |s: &u64| !opts.foreign.contains(s) && !opts.pinned.contains(s);
        let listed = match &opts.listed {
            Some(l) => l.clone(),
            None => self.list_steps()?,
        };
        let committed: Vec<u64> = listed.committed.into_iter().filter(mine).collect();
        let all: Vec<u64> = listed.all.into_iter().filter(mine).collect();
        let mut plan = gc::step_removals(&committed, &all, opts.keep);
        let gone = gc::steps_of(&plan);
        // A temporary file inside a step that goes anyway is not listed twice; an upload is:
        // it must be aborted, whatever happens to its step.
        let in_gone_step = |r: &Removal| match &r.target {
            Target::TempFile { key, .. } => format::parse_step_dir(key.split('/').next().unwrap_or("")).is_some_and(|s| gone.contains(&s)),
            _ => false,
        };
        // Where the leftovers a retention run looks for (no `temp_age`) live under one name
        // at the root (an object store's upload markers), a root without it has none: no
        // request to look. gc with a `temp_age` also asks the server for unrecorded uploads.
        let leftovers = match (self.blobs.leftovers_under(), &listed.names) {
            (Some(under), Some(names)) if opts.temp_age.is_none() && !names.iter().any(|n| n == under) => vec![],
            _ => self.blobs.leftovers(opts.temp_age)?,
        };
        plan.extend(leftovers.into_iter().filter(|r| !in_gone_step(r)));
        Ok(plan)
    }

    /// Removes what `plan` lists; returns what was removed, in plan order. Uploads go before
    /// steps: a step removed here may be the one such an upload was writing.
    pub fn gc_apply(&self, plan: Vec<Removal>) -> Result<Vec<Removal>> {
        let (steps, others): (Vec<_>, Vec<_>) = plan.into_iter().enumerate().partition(|(_, r)| r.step().is_some());
        let mut done = vec![];
        for (i, r) in others {
            if self.blobs.remove_leftover(&r)? {
                done.push((i, r));
            }
        }
        for (i, r) in steps {
            if let Target::Step(s) = r.target {
                self.delete_step(s)?;
                done.push((i, r));
            }
        }
        done.sort_by_key(|(i, _)| *i);
        Ok(done.into_iter().map(|(_, r)| r).collect())
    }
}

/// The `Tier` methods a tier whose steps live in a `StepLayout` (its field `layout`) hands to
/// the layout unchanged: reads of stored bytes, the job, steps, commit records, manifests and
/// ranks. The memory and blob tiers both say `forward_to_layout!();` in their `impl Tier`,
/// so a new kind built on a `Blobs` writes only what differs (its `write_rank`, commit and
/// gc rules).
macro_rules! forward_to_layout {
    () => {
        fn read_stored(&self, m: &crate::format::Manifest, c: &crate::format::ChunkMeta, dst: &mut [u8]) -> crate::error::Result<()> {
            self.layout.read_stored(m, c, dst)
        }

        fn read_stored_blocks(
            &self,
            m: &crate::format::Manifest,
            c: &crate::format::ChunkMeta,
            dst: &mut [u8],
            each: &mut dyn FnMut(&[u8]),
        ) -> crate::error::Result<()> {
            self.layout.read_stored_blocks(m, c, dst, each)
        }

        fn set_job(&self, job: &crate::format::JobId) {
            self.layout.set_job(job);
        }

        fn all_steps(&self) -> crate::error::Result<Vec<u64>> {
            self.layout.all_steps()
        }

        fn committed_steps(&self) -> crate::error::Result<Vec<u64>> {
            self.layout.committed_steps()
        }

        fn list_steps(&self) -> crate::error::Result<crate::gc::Listed> {
            self.layout.list_steps()
        }

        fn commit_record(&self, step: u64) -> crate::error::Result<crate::format::CommitRecord> {
            self.layout.commit_record(step)
        }

        fn read_manifest(&self, step: u64, rank: u32) -> crate::error::Result<crate::format::Manifest> {
            self.layout.read_manifest(step, rank)
        }

        fn ranks_written(&self, step: u64) -> crate::error::Result<Vec<u32>> {
            self.layout.ranks(step)
        }
    };
}
pub(crate) use forward_to_layout;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blobs::FsBlobs;

    fn manifest(step: u64, rank: u32, generation: &str) -> Manifest {
        let mut m = Manifest::new(step, rank, 2, "t", 64);
        m.generation = Some(generation.into());
        m
    }

    /// A step saved again by rank 0 while rank 1's manifest is still of the earlier save
    /// does not commit (it used to: old and new ranks under one commit); it commits, with
    /// the new generation, once rank 1's manifest is of the same save.
    #[test]
    fn commits_only_the_manifests_of_one_save() {
        let dir = tempfile::tempdir().unwrap();
        let layout = StepLayout::new("t", Arc::new(FsBlobs::new("t", dir.path()).unwrap()));
        layout.write_manifest(&manifest(5, 0, "a.1")).unwrap();
        layout.write_manifest(&manifest(5, 1, "a.1")).unwrap();
        assert!(layout.try_commit(5, 2, None).unwrap());
        assert_eq!(layout.commit_record(5).unwrap().generation.as_deref(), Some("a.1"));
        // Rank 0 saves step 5 again.
        layout.uncommit(5, 0).unwrap();
        layout.write_manifest(&manifest(5, 0, "a.2")).unwrap();
        assert!(!layout.try_commit(5, 2, None).unwrap(), "committed rank 0's new part with rank 1's old one");
        assert!(layout.commit_record(5).is_err());
        layout.uncommit(5, 1).unwrap();
        layout.write_manifest(&manifest(5, 1, "a.2")).unwrap();
        assert!(layout.try_commit(5, 2, None).unwrap());
        assert_eq!(layout.commit_record(5).unwrap().generation.as_deref(), Some("a.2"));
    }

    /// The counted commit writes the record of the counted generation without reading a
    /// manifest; on a filesystem it still refuses a directory that lacks a counted rank's
    /// manifest (one not shared by every host), naming the rank.
    #[test]
    fn a_counted_commit_records_its_generation_and_refuses_a_directory_missing_ranks() {
        let dir = tempfile::tempdir().unwrap();
        let layout = StepLayout::new("t", Arc::new(FsBlobs::new("t", dir.path()).unwrap()));
        layout.write_manifest(&manifest(5, 0, "a.1")).unwrap();
        let e = layout.commit_counted(5, 2, &Some("a.1".into())).unwrap_err();
        assert!(e.message.contains("none of ranks [1]") && e.message.contains("every host"), "{}", e.message);
        assert!(layout.commit_record(5).is_err());
        layout.write_manifest(&manifest(5, 1, "a.1")).unwrap();
        layout.commit_counted(5, 2, &Some("a.1".into())).unwrap();
        assert_eq!(layout.commit_record(5).unwrap().generation.as_deref(), Some("a.1"));
    }
}
