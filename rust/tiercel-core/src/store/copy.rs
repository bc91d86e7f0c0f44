//! Copying a committed step between tiers (`tiercel cp`).

use std::sync::Arc;

use super::{StepReader, Store};
use crate::error::{Error, Result};
use crate::tier::{read_chunk, ChunkSource};

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
        return Err(Error::integrity(format!("tier '{to}': step {step} did not commit after copying every rank"))
            .with_tier(to)
            .with_step(step));
    }
    Ok(())
}
