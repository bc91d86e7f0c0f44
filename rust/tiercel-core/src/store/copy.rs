//! Copying a committed step between tiers (`tiercel cp`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{StepReader, Store};
use crate::error::{Error, Result};
use crate::format::ChunkSource;
use crate::tier::read_chunk;

/// What a copy reports as it goes: ranks done, ranks in all, raw bytes copied so far. Called
/// after every chunk (from the copy's threads) and after every rank.
pub type CopyProgress<'a> = &'a (dyn Fn(u32, u32, u64) + Sync);

/// Copies one committed step (every rank) from one tier to another and commits it there.
pub fn copy_step(store: &Arc<Store>, step: u64, from: &str, to: &str, progress: CopyProgress) -> Result<()> {
    let src_slot = store.slot(from)?;
    let dst_slot = store.slot(to)?;
    let record = src_slot.tier.commit_record(step)?;
    let copied = AtomicU64::new(0);
    for rank in 0..record.world_size {
        let reader = StepReader::open(store, step, rank, Some(&[from.to_string()]), &super::JobFilter::Any)?;
        let m = reader.manifest().clone();
        struct ReaderSource<'a> {
            reader: &'a StepReader,
            // Progress within a rank: a large rank takes seconds.
            report: &'a (dyn Fn(u64) + Sync),
        }
        impl ChunkSource for ReaderSource<'_> {
            fn read_raw(&self, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
                let (idx, m) = &self.reader.sources[0];
                read_chunk(&*self.reader.store.slots[*idx].tier, m, item, chunk, dst)?;
                (self.report)(dst.len() as u64);
                Ok(())
            }
        }
        let report = |n: u64| progress(rank, record.world_size, copied.fetch_add(n, Ordering::Relaxed) + n);
        dst_slot.tier.write_rank(&m, &ReaderSource { reader: &reader, report: &report }, &dst_slot.link)?;
        progress(rank + 1, record.world_size, copied.load(Ordering::Relaxed));
    }
    if !dst_slot.tier.try_commit(step, record.world_size)? {
        return Err(Error::integrity(format!("tier '{to}': step {step} did not commit after copying every rank"))
            .with_tier(to)
            .with_step(step));
    }
    Ok(())
}
