//! Merged reads from tiers where every request costs a round trip (object stores): the
//! chunks of an item that lie back to back in one object are fetched in ranged requests of a
//! part's worth or more (`Tier::merged_reads`, `run_bytes`), several in flight, not one
//! request per chunk on the copy threads, so a restore sends no more requests than a managed
//! download of the same bytes would. Each chunk is still decoded and checked against its own
//! CRC32C before it is used; a chunk that fails (or a request that fails) is read again on
//! its own, from the first tier with a valid copy.

use std::ops::Range;

use parking_lot::Mutex;

use super::StepReader;
use crate::blobs::MergedReads;
use crate::codec;
use crate::error::Result;
use crate::format::ChunkMeta;
use crate::tier::decode_chunk;

/// Runs of neighbouring chunks in `range`: each stored where the previous ends, in one object,
/// together at most `max` stored bytes (a chunk larger than that alone).
pub(super) fn runs(chunks: &[ChunkMeta], range: Range<usize>, max: u64) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = vec![];
    let mut bytes = 0;
    for c in range {
        let ch = &chunks[c];
        if let Some(run) = out.last_mut() {
            let prev = &chunks[c - 1];
            if run.end == c
                && prev.object == ch.object
                && prev.stored_offset + prev.stored_len == ch.stored_offset
                && bytes + ch.stored_len <= max
            {
                run.end = c + 1;
                bytes += ch.stored_len;
                continue;
            }
        }
        out.push(c..c + 1);
        bytes = ch.stored_len;
    }
    out
}

/// The most stored bytes one request reads for `chunks`: a part's worth, or more for a large
/// read, as long as `in_flight` requests still share it (up to 4 parts each). Fewer, longer
/// requests keep as many streams busy and cost less per byte: a request per run, and on a
/// server that reads a whole object for each ranged GET (moto), one such read per request.
fn run_bytes(chunks: &[ChunkMeta], merge: MergedReads) -> u64 {
    let stored: u64 = chunks.iter().map(|c| c.stored_len).sum();
    merge.bytes.max(stored.div_ceil(merge.in_flight.max(1) as u64).min(4 * merge.bytes))
}

impl StepReader {
    /// `read_owned_into` from the first source in merged runs: bytes `start..end` of item `i`
    /// into `buf`. Returns the indices of the sources the chunks came from.
    pub(super) fn read_merged_into(&self, i: usize, start: u64, end: u64, buf: &mut [u8], merge: MergedReads) -> Result<Vec<usize>> {
        let (idx, m) = &self.sources[0];
        let chunks = &m.items[i].chunks;
        let mut regions: Vec<(Range<usize>, &mut [u8])> = vec![];
        let mut rest = buf;
        let range = super::overlapping(chunks, start, end);
        for run in runs(chunks, range.clone(), run_bytes(&chunks[range], merge)) {
            let (first, last) = (&chunks[run.start], &chunks[run.end - 1]);
            let n = (last.offset + last.len).min(end) - first.offset.max(start);
            let (a, b) = rest.split_at_mut(n as usize);
            regions.push((run, a));
            rest = b;
        }
        // The requests wait on the network, not the CPU: `in_flight` threads of their own,
        // not the copy threads, each taking the next run.
        let n = regions.len();
        let queue = Mutex::new(regions.into_iter().enumerate());
        let done: Mutex<Vec<(usize, Result<Vec<usize>>)>> = Mutex::new(Vec::with_capacity(n));
        std::thread::scope(|s| {
            for _ in 0..merge.in_flight.clamp(1, n.max(1)) {
                s.spawn(|| loop {
                    let Some((k, (run, out))) = queue.lock().next() else { break };
                    let res = self.read_run(*idx, i, run, start, end, out);
                    done.lock().push((k, res));
                });
            }
        });
        let mut done = done.into_inner();
        done.sort_by_key(|(k, _)| *k);
        let mut from = vec![];
        for (_, u) in done {
            from.extend(u?);
        }
        Ok(from)
    }

    /// One run: one ranged read, then each chunk decoded and verified into its place in `out`
    /// (the run's share of bytes `start..end`).
    fn read_run(&self, idx: usize, i: usize, run: Range<usize>, start: u64, end: u64, out: &mut [u8]) -> Result<Vec<usize>> {
        let m = &self.sources[0].1;
        let tier = &*self.store.slots[idx].tier;
        let chunks = &m.items[i].chunks[run.clone()];
        let (first, last) = (&chunks[0], &chunks[chunks.len() - 1]);
        // Raw chunks that the range covers whole land where they belong: no copy.
        let in_place = chunks.iter().all(|c| c.codec == codec::RAW) && first.offset >= start && last.offset + last.len <= end;
        let stored: u64 = chunks.iter().map(|c| c.stored_len).sum();
        let mut staging = if in_place { vec![] } else { vec![0u8; stored as usize] };
        let read = self.store.slots[idx].link.read(stored);
        let fetched = tier.read_stored_run(m, chunks, if in_place { &mut *out } else { &mut staging });
        drop(read);
        if fetched.is_ok() {
            self.store.metrics.tier(idx).read(stored);
        }
        let base = first.offset.max(start);
        let mut from = vec![];
        let mut at = 0usize;
        for (k, c) in run.enumerate() {
            let ch = &m.items[i].chunks[c];
            let (lo, hi) = (ch.offset.max(start), (ch.offset + ch.len).min(end));
            let dst = &mut out[(lo - base) as usize..(hi - base) as usize];
            let mut ok = false;
            if fetched.is_ok() {
                let stored_bytes = (!in_place).then(|| &staging[at..at + ch.stored_len as usize]);
                let decoded = if dst.len() as u64 == ch.len {
                    decode_chunk(tier, m, i, c, stored_bytes, dst)
                } else {
                    let mut whole = vec![0u8; ch.len as usize];
                    decode_chunk(tier, m, i, c, stored_bytes, &mut whole)
                        .map(|()| dst.copy_from_slice(&whole[(lo - ch.offset) as usize..][..dst.len()]))
                };
                match decoded {
                    Ok(()) => ok = true,
                    Err(e) => log::warn!("{e}; reading chunk {c} again on its own"),
                }
            }
            at += chunks[k].stored_len as usize;
            from.push(if ok { 0 } else { self.read_chunk_cut(&self.manifest().items[i], c, start, dst)? });
        }
        if let Err(e) = fetched {
            log::warn!("{e}; its chunks were read one by one");
        }
        Ok(from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(object: u32, stored_offset: u64, stored_len: u64) -> ChunkMeta {
        ChunkMeta { offset: 0, len: stored_len, crc32c: 0, object, stored_offset, stored_len, codec: codec::RAW.into(), hash: None }
    }

    #[test]
    fn runs_merge_neighbours_up_to_the_limit() {
        // 0..4 back to back (10 bytes each), a gap before 4, then 5 in another object.
        let cs = vec![chunk(0, 0, 10), chunk(0, 10, 10), chunk(0, 20, 10), chunk(0, 30, 10), chunk(0, 50, 10), chunk(1, 60, 10)];
        assert_eq!(runs(&cs, 0..6, 25), vec![0..2, 2..4, 4..5, 5..6]);
        assert_eq!(runs(&cs, 0..6, 40), vec![0..4, 4..5, 5..6]);
        assert_eq!(runs(&cs, 1..3, 40), vec![1..3]);
        assert_eq!(runs(&cs, 0..2, 5), vec![0..1, 1..2], "a chunk larger than the limit is a run of its own");
        assert_eq!(runs(&cs, 2..2, 40), Vec::<Range<usize>>::new());
    }
}
