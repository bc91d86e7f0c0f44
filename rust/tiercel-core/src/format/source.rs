//! Where a tier copies a rank's step from when it writes: the raw bytes of its chunks, by
//! item and chunk index into the rank's manifest.

use crate::error::Result;

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
