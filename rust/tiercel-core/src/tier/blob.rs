//! A tier over any `Blobs` store (a filesystem directory, an s3 or gcs bucket prefix): each
//! rank's step is one data object of encoded chunks plus its manifest, in the step layout.

use std::sync::Arc;

use super::layout::{self, StepLayout};
use super::{encode_rank, Tier};
use crate::blobs::Blobs;
use crate::codec::Compression;
use crate::error::Result;
use crate::format::{self, ChunkMeta, ChunkSource, Manifest};
use crate::gc::{GcOptions, Removal};
use crate::scheduler::Link;

pub struct BlobTier {
    name: String,
    layout: StepLayout,
    compression: Compression,
    /// Steps this process wrote replicated items of: their commits check every rank's copies
    /// (`replica::check_copies`); other steps commit without reading every manifest.
    replicated: parking_lot::Mutex<std::collections::BTreeSet<u64>>,
}

impl BlobTier {
    pub fn new(name: &str, blobs: Arc<dyn Blobs>, compression: Compression) -> BlobTier {
        BlobTier { name: name.into(), layout: StepLayout::new(name, blobs), compression, replicated: Default::default() }
    }

    /// The objects underneath (for tools and tests that look at or damage stored bytes).
    pub fn blobs(&self) -> &dyn Blobs {
        self.layout.blobs()
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
        if logical.items.iter().any(|i| i.replica.is_some()) {
            let mut r = self.replicated.lock();
            r.insert(logical.step);
            while r.len() > 64 {
                r.pop_first();
            }
        }
        let object = format::data_name(logical.rank);
        self.layout.uncommit(logical.step, logical.rank)?;
        let mut w = self.layout.blobs().create(&layout::key(logical.step, &object))?;
        let res = encode_rank(&self.name, logical, src, self.compression, &object, link, &mut |b| w.write(b));
        let manifest = match res {
            Ok(m) => m,
            Err(e) => {
                w.abort();
                return Err(e);
            }
        };
        w.finish()?;
        crate::failpoint::hit("persist");
        self.layout.write_manifest(&manifest)?;
        Ok(manifest)
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

    fn commit_counted(&self, step: u64, world_size: u32, generation: &Option<String>) -> Result<()> {
        // A step with replicated items: the committer checks every rank's copies against
        // its primary's first (O(N) reads, on this one rank), as `try_commit` does.
        if self.replicated.lock().contains(&step) {
            crate::tier::replica::check_copies(self, step, &(0..world_size).collect::<Vec<_>>())?;
        }
        self.layout.commit_counted(step, world_size, generation)
    }

    fn delete_step(&self, step: u64) -> Result<()> {
        self.layout.delete_step(step)
    }

    fn gc_plan(&self, opts: &GcOptions) -> Result<Vec<Removal>> {
        self.layout.gc_plan(opts)
    }

    fn gc_apply(&self, plan: Vec<Removal>) -> Result<Vec<Removal>> {
        self.layout.gc_apply(plan)
    }
}
