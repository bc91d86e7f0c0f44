//! The `Tier` trait and what every tier shares: reading a chunk (decode, verify) and encoding
//! a rank for a compressed tier. `layout` is the step layout that the blob-backed tiers
//! (memory, fs, s3, gcs) keep their steps in, `replica` how a step's shared (replicated)
//! items are stored once and checked at commit, `open` turns a policy's tiers into `Tier`s.
//! The retention and cleanup rule every tier applies is `crate::gc`.

mod areas;
#[cfg(test)]
mod areas_tests;
pub mod blob;
mod blob_gc;
pub mod external;
#[cfg(test)]
mod gc_tests;
pub mod layout;
pub mod memory;
pub mod open;
pub mod peer;
pub mod replica;

use std::sync::Arc;

use rayon::prelude::*;

use crate::codec;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self, ChunkSource, CommitRecord, Manifest};
use crate::gc::{GcOptions, Removal};
use crate::scheduler::{Link, Priority};
use crate::shm::View;

/// One storage tier. The Store reaches every tier through this trait only; every kind passes
/// the conformance suite in `testing::tiers`.
pub trait Tier: Send + Sync {
    fn name(&self) -> &str;

    /// Stores one rank's data for a step, then its manifest (atomically, last). `logical`
    /// describes items and chunks (stored offsets are ignored: each tier lays out its own).
    /// Returns the manifest as written on this tier. The step is not visible until committed.
    fn write_rank(&self, logical: &Manifest, src: &dyn ChunkSource, link: &Link) -> Result<Manifest>;

    /// Reads the stored (encoded) bytes of one chunk into `dst` (`stored_len` bytes).
    fn read_stored(&self, m: &Manifest, chunk: &format::ChunkMeta, dst: &mut [u8]) -> Result<()>;

    /// `read_stored`, handing the bytes to `each` piece by piece as they land, so that the
    /// checksum of a raw chunk reads them while they are in cache (`Blobs::get_range_blocks`);
    /// the default reads the chunk, then hands it over whole.
    fn read_stored_blocks(&self, m: &Manifest, chunk: &format::ChunkMeta, dst: &mut [u8], each: &mut dyn FnMut(&[u8])) -> Result<()> {
        self.read_stored(m, chunk, dst)?;
        each(dst);
        Ok(())
    }

    /// Whether `read_stored` itself checks every raw chunk it reads against the chunk's
    /// CRC32C, on the bytes as they landed in `dst` (the peer tier checksums each block as it
    /// arrives from the socket): `read_chunk` then does not read them a second time.
    fn verifies_reads(&self) -> bool {
        false
    }

    /// How to merge reads of neighbouring chunks into `read_stored_run`s, where requests
    /// cost round trips; None (the default): reads are not worth merging here.
    fn merged_reads(&self) -> Option<crate::blobs::MergedReads> {
        None
    }

    /// What the tier's client counts of its requests (object stores), for `store.metrics()`.
    fn requests(&self) -> Option<Arc<crate::requests::RequestCounters>> {
        None
    }

    /// What the tier's writes send against what they deliver (a tier that sends only what a
    /// destination lacks: the peer tier), for `store.metrics()`.
    fn sent(&self) -> Option<Arc<crate::requests::SentCounters>> {
        None
    }

    /// The bytes a write of `m` will move over the tier's link, as far as the tier can tell
    /// beforehand: what the traffic schedule plans a checkpoint's transfer by. All of the
    /// step's raw bytes, unless the tier sends less (the peer tier: the chunks the holders
    /// lack).
    fn bytes_to_move(&self, m: &Manifest) -> u64 {
        m.total_bytes()
    }

    /// Reads the stored bytes of `chunks`, which lie back to back in one object (each stored
    /// where the previous ends), into `dst` (their `stored_len`s together).
    fn read_stored_run(&self, m: &Manifest, chunks: &[format::ChunkMeta], dst: &mut [u8]) -> Result<()> {
        let mut rest = dst;
        for c in chunks {
            let (this, next) = rest.split_at_mut(c.stored_len as usize);
            self.read_stored(m, c, this)?;
            rest = next;
        }
        Ok(())
    }

    /// Makes `step` visible once every rank it needs has written it; true when it is. Each
    /// rank calls this after writing its own part, so the last one to finish commits.
    fn try_commit(&self, step: u64, world_size: u32) -> Result<bool>;

    /// Whether a job-wide counter may stand in for `try_commit`'s look at the other ranks'
    /// manifests here (`store::commit`): a tier that every rank of the job writes to in one
    /// place (fs, s3, gcs, python). False (the default) for a host-local tier or one that
    /// commits on its own terms (memory, peer).
    fn counts_commits(&self) -> bool {
        false
    }

    /// Whether the tier refers to chunks it stores already instead of writing them again
    /// (`dedup`): then bytes that several ranks hold are stored once too (`store::matched`).
    fn dedups(&self) -> bool {
        false
    }

    /// Writes `step`'s commit record for save `generation` without looking for the other
    /// ranks' manifests: the caller has counted every one of `world_size` ranks in, each
    /// after its manifest of `generation` was durable here. Only where `counts_commits`.
    fn commit_counted(&self, step: u64, _world_size: u32, _generation: &Option<String>) -> Result<()> {
        Err(Error::invalid(format!("tier '{}': step {step}: this tier does not commit by a counter", self.name())))
    }

    /// All steps with something stored here, committed or not, oldest first.
    fn all_steps(&self) -> Result<Vec<u64>>;

    /// Committed steps, oldest first.
    fn committed_steps(&self) -> Result<Vec<u64>>;

    /// All steps and the committed ones from one listing (retention's, which hands it to
    /// `gc_plan` in `GcOptions::listed` rather than list twice).
    fn list_steps(&self) -> Result<crate::gc::Listed> {
        Ok(crate::gc::Listed { all: self.all_steps()?, committed: self.committed_steps()?, names: None })
    }

    /// The commit record of a committed step (NotFound otherwise).
    fn commit_record(&self, step: u64) -> Result<CommitRecord>;

    /// Rank `rank`'s manifest of `step`, checked (NotFound when the rank wrote none here).
    /// Readable before the step commits: a manifest marks that rank's part complete.
    fn read_manifest(&self, step: u64, rank: u32) -> Result<Manifest>;

    /// Ranks whose part of `step` is complete here (their manifest is written), committed or
    /// not: what a step that never committed is missing.
    fn ranks_written(&self, step: u64) -> Result<Vec<u32>>;

    /// Removes a step, so that no reader sees it half-deleted.
    fn delete_step(&self, step: u64) -> Result<()>;

    /// After this rank's persist of a step here (and its commit and retention, where it ran
    /// them): removes what the rank's own earlier saves left that nothing kept needs any more
    /// (a blob tier's rank area: `tier::areas`). `keep` is the tier's retention; `known`
    /// answers whether a step is committed here where the job's counter knows
    /// (`store::records`), None where the tier's own record must tell. The default has
    /// nothing to sweep.
    fn sweep(&self, _rank: u32, _keep: Option<usize>, _known: &dyn Fn(u64) -> Option<bool>) -> Result<()> {
        Ok(())
    }

    /// What gc would remove now, and why (see `gc`).
    fn gc_plan(&self, opts: &GcOptions) -> Result<Vec<Removal>>;

    /// Removes what a plan lists; returns what was removed.
    fn gc_apply(&self, plan: Vec<Removal>) -> Result<Vec<Removal>>;

    /// The job whose commits this tier records from now on (tiers without commit records
    /// ignore it).
    fn set_job(&self, _job: &crate::format::JobId) {}

    /// The scheduler priority of background jobs that write to this tier.
    fn priority(&self) -> Priority {
        Priority::Persist
    }

    /// A zero-copy read view of object `object` of `step`, for a tier that keeps its objects
    /// in this host's memory; None for every other tier. Its pages may be mapped lazily
    /// (`View::populate` maps a range ahead of use).
    fn view(&self, _step: u64, _object: &str) -> Option<Result<Arc<View>>> {
        None
    }
}

/// Plans and applies gc on `tier` in one go: what was removed.
pub fn run_gc(tier: &dyn Tier, opts: &GcOptions) -> Result<Vec<Removal>> {
    tier.gc_apply(tier.gc_plan(opts)?)
}

/// Reads, decodes and verifies one chunk from `tier` into `dst` (its raw length). Errors name
/// the tier, step, rank, item and chunk.
pub fn read_chunk(tier: &dyn Tier, m: &Manifest, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
    let c = &m.items[item].chunks[chunk];
    // A committed step whose data object is gone has lost data: an integrity problem.
    let missing = |e: Error| if e.kind == ErrorKind::NotFound { e.with_kind(ErrorKind::Integrity) } else { e };
    let res = (|| {
        if c.codec == codec::RAW && tier.verifies_reads() {
            return tier.read_stored(m, c, dst).map_err(missing);
        }
        if c.codec == codec::RAW {
            // Checksummed block by block as the bytes land, not in a second pass over the chunk.
            let mut digest = crate::checksum::Crc32c::new();
            tier.read_stored_blocks(m, c, dst, &mut |b| digest.update(b)).map_err(missing)?;
            return check(c, digest.finish());
        }
        let mut stored = vec![0u8; c.stored_len as usize];
        tier.read_stored(m, c, &mut stored).map_err(missing)?;
        codec::decode(&c.codec, &stored, dst)?;
        verify(c, dst)
    })();
    res.map_err(|e| in_chunk(tier, m, item, chunk, e))
}

/// Decodes and verifies one chunk whose stored bytes were read already (`stored`, in a
/// merged read) into `dst` (its raw length); for a raw chunk `stored` may be `dst` itself
/// (`None`). Errors as `read_chunk`'s.
pub fn decode_chunk(tier: &dyn Tier, m: &Manifest, item: usize, chunk: usize, stored: Option<&[u8]>, dst: &mut [u8]) -> Result<()> {
    let c = &m.items[item].chunks[chunk];
    let res = (|| {
        match stored {
            Some(b) if c.codec == codec::RAW => dst.copy_from_slice(b),
            Some(b) => codec::decode(&c.codec, b, dst)?,
            None => debug_assert_eq!(c.codec, codec::RAW),
        }
        verify(c, dst)
    })();
    res.map_err(|e| in_chunk(tier, m, item, chunk, e))
}

fn verify(c: &format::ChunkMeta, raw: &[u8]) -> Result<()> {
    check(c, crate::checksum::crc32c(raw))
}

/// `crc`, the checksum of a chunk's raw bytes, against the manifest's.
fn check(c: &format::ChunkMeta, crc: u32) -> Result<()> {
    if crc != c.crc32c {
        return Err(Error::integrity(format!("checksum mismatch (stored {:08x}, computed {crc:08x})", c.crc32c)));
    }
    Ok(())
}

/// `e`, said of chunk `chunk` of item `item` of `m` on `tier`.
fn in_chunk(tier: &dyn Tier, m: &Manifest, item: usize, chunk: usize, e: Error) -> Error {
    let it = &m.items[item];
    let c = &it.chunks[chunk];
    let ctx = format!(
        "tier '{}', step {}, rank {}, item '{}', chunk {} (bytes {}..{})",
        tier.name(),
        m.step,
        m.rank,
        it.name,
        chunk,
        c.offset,
        c.offset + c.len
    );
    e.context(ctx).with_tier(tier.name()).at(m.step, m.rank).with_item(&it.name).with_chunk(chunk as u64)
}

/// A chunk's bytes as a blob tier stores them: the source's own memory (a raw chunk of a
/// source that has it in place) or an encoded copy.
enum Stored<'a> {
    Source(&'a [u8]),
    Owned(Vec<u8>),
}

/// Chunks are encoded in batches of this many in parallel, then written in order, so a
/// blob tier's writer holds a bounded amount of memory.
const ENCODE_BATCH: usize = 8;

/// Where `encode_rank` writes: the data object (its `len` is set) and which chunks go into it
/// (by item and chunk index).
pub struct EncodeInto<'a> {
    pub object: format::ObjectMeta,
    pub store: &'a dyn Fn(usize, usize) -> bool,
}

/// Streams the chunks of `logical` that `store` names (by item and chunk index) from `src`
/// through `encode` into `sink`, in manifest order, and returns the manifest with this
/// tier's stored layout: those chunks in one data object (`object`, whose `len` this sets),
/// object 0; the other chunks as `logical` has them (a caller that stores by reference sets
/// them). A shared item's bytes are never stored here (its primary rank stores them: see
/// `replica`).
pub fn encode_rank(
    tier_name: &str,
    logical: &Manifest,
    src: &dyn ChunkSource,
    compression: crate::codec::Compression,
    into: EncodeInto<'_>,
    link: &Link,
    sink: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<Manifest> {
    let EncodeInto { object, store } = into;
    let mut out = logical.clone();
    out.tier = tier_name.into();
    let refs: Vec<(usize, usize)> = logical
        .chunk_refs()
        .into_iter()
        .filter(|&(i, c)| !logical.items[i].replica.as_ref().is_some_and(|r| r.shared) && store(i, c))
        .collect();
    let mut pos = 0u64;
    for batch in refs.chunks(ENCODE_BATCH) {
        let encoded: Vec<Result<(String, Stored)>> = batch
            .par_iter()
            .map(|&(i, c)| {
                let it = &logical.items[i];
                let value_size = codec::float_value_size(&it.dtype);
                // Straight from the segment where the source has its bytes in memory: a
                // chunk stored raw is then written without any copy of ours.
                if let Some(raw) = src.raw_slice(i, c) {
                    return Ok(match codec::encode(raw, compression, value_size) {
                        Some((name, z)) => (name, Stored::Owned(z)),
                        None => (codec::RAW.into(), Stored::Source(raw)),
                    });
                }
                let mut raw = vec![0u8; it.chunks[c].len as usize];
                src.read_raw(i, c, &mut raw)?;
                Ok(match codec::encode(&raw, compression, value_size) {
                    Some((name, z)) => (name, Stored::Owned(z)),
                    None => (codec::RAW.into(), Stored::Owned(raw)),
                })
            })
            .collect();
        for (&(i, c), enc) in batch.iter().zip(encoded) {
            let (codec_name, stored) = enc?;
            let bytes: &[u8] = match &stored {
                Stored::Source(s) => s,
                Stored::Owned(v) => v,
            };
            link.acquire(bytes.len() as u64);
            sink(bytes)?;
            let ch = &mut out.items[i].chunks[c];
            ch.object = 0;
            ch.stored_offset = pos;
            ch.stored_len = bytes.len() as u64;
            ch.codec = codec_name;
            pos += bytes.len() as u64;
        }
    }
    out.objects = vec![format::ObjectMeta { len: pos, ..object }];
    Ok(out)
}
