//! The `Tier` trait and what every tier shares: a step is a directory (key prefix) of
//! per-rank data objects and manifests, made visible by a commit record written last.

pub mod blob;
pub mod memory;
pub mod peer;

use rayon::prelude::*;

use crate::blobs::Blobs;
use crate::codec;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self, CommitRecord, Manifest};
use crate::scheduler::Link;

/// Raw bytes of one rank's step, chunk by chunk: where a tier copies from when it writes.
pub trait ChunkSource: Sync {
    /// Fills `dst` with the raw bytes of chunk `chunk` of item `item` (indices into the
    /// manifest the writer was given); `dst.len()` is that chunk's raw length.
    fn read_raw(&self, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()>;

    /// The chunk's raw bytes in place, when the source holds them in memory (a shared-memory
    /// segment): a writer then sends them without copying.
    fn raw_slice(&self, _item: usize, _chunk: usize) -> Option<&[u8]> {
        None
    }
}

/// One storage tier. Every kind passes the conformance suite in `tier::conformance`.
pub trait Tier: Send + Sync {
    fn name(&self) -> &str;
    fn kind(&self) -> &'static str;
    /// The step layout's storage (manifests, commit records, data objects of blob tiers).
    fn blobs(&self) -> &dyn Blobs;

    /// Stores one rank's data for a step, then its manifest (atomically, last). `logical`
    /// describes items and chunks (stored offsets are ignored: each tier lays out its own).
    /// Returns the manifest as written on this tier. The step is not visible until committed.
    fn write_rank(&self, logical: &Manifest, src: &dyn ChunkSource, link: &Link) -> Result<Manifest>;

    /// Reads the stored (encoded) bytes of one chunk into `dst` (`stored_len` bytes).
    fn read_stored(&self, m: &Manifest, chunk: &format::ChunkMeta, dst: &mut [u8]) -> Result<()>;

    /// Removes a step; its commit record goes first, so no reader sees it half-deleted.
    fn delete_step(&self, step: u64) -> Result<()> {
        let dir = format::step_dir(step);
        self.blobs().delete(&format!("{dir}/{}", format::COMMIT_NAME))?;
        self.blobs().delete_prefix(&dir)
    }

    /// Writes the commit record if every rank's manifest is there. Each rank calls this
    /// after writing its own manifest, so the last one to finish commits the step.
    fn try_commit(&self, step: u64, world_size: u32) -> Result<bool> {
        commit_if_complete(self, step, world_size, None)
    }

    /// All steps with a directory here, committed or not, oldest first.
    fn all_steps(&self) -> Result<Vec<u64>> {
        let mut v: Vec<u64> = self.blobs().list("")?.iter().filter_map(|n| format::parse_step_dir(n)).collect();
        v.sort_unstable();
        Ok(v)
    }

    /// Committed steps, oldest first.
    fn committed_steps(&self) -> Result<Vec<u64>> {
        let mut out = vec![];
        for s in self.all_steps()? {
            if self.blobs().exists(&format!("{}/{}", format::step_dir(s), format::COMMIT_NAME))? {
                out.push(s);
            }
        }
        Ok(out)
    }

    fn commit_record(&self, step: u64) -> Result<CommitRecord> {
        let key = format!("{}/{}", format::step_dir(step), format::COMMIT_NAME);
        let bytes = self.blobs().get(&key).map_err(|e| match e.kind {
            ErrorKind::NotFound => Error::not_found(format!("tier '{}': step {step} is not committed", self.name())),
            _ => e,
        })?;
        CommitRecord::from_json(&bytes, &self.blobs().describe(&key))
    }

    fn read_manifest(&self, step: u64, rank: u32) -> Result<Manifest> {
        let key = format!("{}/{}", format::step_dir(step), format::manifest_name(rank));
        let bytes = self.blobs().get(&key).map_err(|e| match e.kind {
            ErrorKind::NotFound => Error::not_found(format!("tier '{}': step {step} has no manifest for rank {rank}", self.name())),
            _ => e,
        })?;
        let m = Manifest::from_json(&bytes, &self.blobs().describe(&key))?;
        if m.step != step || m.rank != rank {
            return Err(Error::integrity(format!(
                "{}: manifest says step {} rank {}, expected step {step} rank {rank}",
                self.blobs().describe(&key),
                m.step,
                m.rank
            )));
        }
        Ok(m)
    }
}

/// Writes `step`'s commit record on `tier` once the manifest of every rank it covers is there:
/// `ranks` (a host-local tier's ranks, recorded in the commit), else all of `world_size`.
pub fn commit_if_complete<T: Tier + ?Sized>(tier: &T, step: u64, world_size: u32, ranks: Option<Vec<u32>>) -> Result<bool> {
    let dir = format::step_dir(step);
    let names = tier.blobs().list(&dir)?;
    if names.iter().any(|n| n == format::COMMIT_NAME) {
        return Ok(true);
    }
    let complete = match &ranks {
        Some(rs) => rs.iter().all(|r| names.contains(&format::manifest_name(*r))),
        None => (0..world_size).all(|r| names.contains(&format::manifest_name(r))),
    };
    if !complete {
        return Ok(false);
    }
    let mut record = CommitRecord::new(step, world_size, tier.name());
    record.ranks = ranks;
    tier.blobs().put_if_absent(&format!("{dir}/{}", format::COMMIT_NAME), &serde_json::to_vec(&record).unwrap())?;
    Ok(true)
}

/// What retention removes from a tier: committed steps beyond the newest `keep` (None keeps
/// all), and uncommitted leftovers older than the newest committed step (a rank died mid-save).
pub fn retention_victims(committed: &[u64], all: &[u64], keep: Option<usize>) -> Vec<u64> {
    let newest = committed.last().copied();
    let mut victims: Vec<u64> = keep.map(|k| committed.iter().rev().skip(k).copied().collect()).unwrap_or_default();
    victims.extend(all.iter().copied().filter(|s| !committed.contains(s) && newest.is_some_and(|n| *s < n)));
    victims
}

/// Reads, decodes and verifies one chunk from `tier` into `dst` (its raw length). Errors name
/// the tier, step, rank, item and chunk.
pub fn read_chunk(tier: &dyn Tier, m: &Manifest, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
    let it = &m.items[item];
    let c = &it.chunks[chunk];
    let ctx = || {
        format!(
            "tier '{}', step {}, rank {}, item '{}', chunk {} (bytes {}..{})",
            tier.name(),
            m.step,
            m.rank,
            it.name,
            chunk,
            c.offset,
            c.offset + c.len
        )
    };
    // A committed step whose data object is gone has lost data: an integrity problem.
    let missing = |e: Error| if e.kind == ErrorKind::NotFound { Error::integrity(e.message) } else { e };
    let res = (|| {
        if c.codec == codec::RAW {
            tier.read_stored(m, c, dst).map_err(missing)?;
        } else {
            let mut stored = vec![0u8; c.stored_len as usize];
            tier.read_stored(m, c, &mut stored).map_err(missing)?;
            codec::decode(&c.codec, &stored, dst)?;
        }
        let crc = crc32c::crc32c(dst);
        if crc != c.crc32c {
            return Err(Error::integrity(format!("checksum mismatch (stored {:08x}, computed {crc:08x})", c.crc32c)));
        }
        Ok(())
    })();
    res.map_err(|e| e.context(ctx()))
}

/// Chunks are encoded in batches of this many in parallel, then written in order, so a
/// blob tier's writer holds a bounded amount of memory.
const ENCODE_BATCH: usize = 8;

/// Streams every chunk of `logical` from `src` through `encode` into `sink`, in manifest
/// order, and returns the manifest with this tier's stored layout (one data object).
pub fn encode_rank(
    tier_name: &str,
    logical: &Manifest,
    src: &dyn ChunkSource,
    compression: crate::policy::Compression,
    object_name: &str,
    link: &Link,
    sink: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<Manifest> {
    let mut out = logical.clone();
    out.tier = tier_name.into();
    let refs = logical.chunk_refs();
    let mut pos = 0u64;
    for batch in refs.chunks(ENCODE_BATCH) {
        let encoded: Vec<Result<(String, Vec<u8>)>> = batch
            .par_iter()
            .map(|&(i, c)| {
                let it = &logical.items[i];
                let mut raw = vec![0u8; it.chunks[c].len as usize];
                src.read_raw(i, c, &mut raw)?;
                Ok(codec::encode(raw, compression, codec::float_value_size(&it.dtype)))
            })
            .collect();
        for (&(i, c), enc) in batch.iter().zip(encoded) {
            let (codec_name, bytes) = enc?;
            link.acquire(bytes.len() as u64);
            sink(&bytes)?;
            let ch = &mut out.items[i].chunks[c];
            ch.object = 0;
            ch.stored_offset = pos;
            ch.stored_len = bytes.len() as u64;
            ch.codec = codec_name;
            pos += bytes.len() as u64;
        }
    }
    out.objects = vec![format::ObjectMeta { name: object_name.into(), len: pos }];
    Ok(out)
}

#[cfg(test)]
pub mod conformance;
