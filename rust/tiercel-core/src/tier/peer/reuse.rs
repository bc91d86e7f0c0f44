//! The holder's half of sending only what changed: before a replica's chunks come over the
//! link, the holder fills those it holds already, by hash (`ChunkMeta::hash`), from its
//! replicas of earlier steps of the same rank, and asks the sender for the rest only.
//!
//! A held chunk is reused only where its hash, length and CRC32C are those of the new
//! chunk, and it is copied with its checksum computed over the bytes that landed in the new
//! replica (`checksum::copy_crc32c`): a held copy that was damaged since it arrived fails
//! there and is asked for again, so the new replica is verified chunk by chunk as a received
//! one is. A base that retention removed before it was opened is simply not used (its chunks
//! are sent); one opened is read under a read lease, which keeps its files from being
//! recycled while they are copied.

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;

use crate::codec::RAW;
use crate::format::{ChunkMeta, Manifest};
use crate::shm::{Segment, View};
use crate::tier::memory::MemoryTier;
use crate::tier::Tier;

/// A chunk's bytes that a reuse can copy as they are (the replica store keeps chunks raw).
fn plain(c: &ChunkMeta) -> bool {
    c.codec == RAW && c.stored_len == c.len
}

/// One held chunk to copy into the new replica: the new chunk's index, where its bytes are.
struct Copy {
    chunk: usize,
    from: Arc<View>,
    at: u64,
}

/// Fills the chunks of `m` that the replicas of `bases` (steps of `m.rank` this host holds,
/// newest first) hold, into `segs` (the new replica's segments, one per object, as the
/// transport's put allocated them). Returns, by chunk in manifest order, which are filled and
/// verified. `tier` names the tier in what is logged.
pub(super) fn fill(tier: &str, replicas: &MemoryTier, m: &Manifest, segs: &[Arc<Segment>], bases: &[u64]) -> Vec<bool> {
    let chunks: Vec<&ChunkMeta> = m.items.iter().flat_map(|it| &it.chunks).collect();
    let mut filled = vec![false; chunks.len()];
    // Chunks without a hash (a manifest of an older writer) are always sent.
    let mut wanted: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, c) in chunks.iter().enumerate() {
        if let (Some(h), true) = (c.hash.as_deref(), plain(c)) {
            wanted.entry(h).or_default().push(i);
        }
    }
    for &step in bases {
        if wanted.is_empty() {
            break;
        }
        let Ok(old) = replicas.read_manifest(step, m.rank) else { continue };
        let mut views: HashMap<u32, Option<Arc<View>>> = HashMap::new();
        let mut copies = vec![];
        for c in old.items.iter().flat_map(|it| &it.chunks).filter(|c| plain(c)) {
            let Some(want) = c.hash.as_deref().and_then(|h| wanted.get_mut(h)) else { continue };
            // Every new chunk with these bytes is copied from this one.
            let (same, other): (Vec<usize>, Vec<usize>) =
                want.iter().partition(|&&i| chunks[i].len == c.len && chunks[i].crc32c == c.crc32c);
            if same.is_empty() {
                continue;
            }
            let view = views.entry(c.object).or_insert_with(|| {
                let name = &old.objects.get(c.object as usize)?.name;
                // Gone (retention removed the base meanwhile): its chunks are sent instead.
                replicas.open_view(step, name).ok()
            });
            let Some(view) = view.as_ref().filter(|v| c.stored_offset.checked_add(c.len).is_some_and(|end| end <= v.len() as u64)) else {
                continue;
            };
            *want = other;
            copies.extend(same.into_iter().map(|chunk| Copy { chunk, from: view.clone(), at: c.stored_offset }));
        }
        wanted.retain(|_, w| !w.is_empty());
        for (chunk, good) in copy_all(&chunks, segs, copies) {
            if good {
                filled[chunk] = true;
            } else {
                let c = chunks[chunk];
                log::warn!(
                    "tier '{tier}': step {step} rank {}: this host's replica of the chunk at object {} offset {} fails its \
                     checksum; asking the sender for it",
                    m.rank,
                    c.object,
                    c.stored_offset
                );
                // An older base may hold a good copy.
                if let Some(h) = c.hash.as_deref() {
                    wanted.entry(h).or_default().push(chunk);
                }
            }
        }
    }
    filled
}

/// Copies every one of `copies` into its chunk's place in `segs`, in parallel, each checked
/// against the new chunk's CRC32C as it lands: (chunk, verified). Chunks of one object that
/// overlap (a manifest no writer makes) are not copied: two threads would write one range.
fn copy_all(chunks: &[&ChunkMeta], segs: &[Arc<Segment>], mut copies: Vec<Copy>) -> Vec<(usize, bool)> {
    copies.sort_by_key(|c| (chunks[c.chunk].object, chunks[c.chunk].stored_offset));
    let mut ok = Vec::with_capacity(copies.len());
    let mut end: Option<(u32, u64)> = None;
    for c in &copies {
        let ch = chunks[c.chunk];
        let fits = segs.get(ch.object as usize).is_some_and(|s| ch.stored_offset + ch.len <= s.len() as u64);
        let apart = end.is_none_or(|(o, e)| o != ch.object || ch.stored_offset >= e);
        ok.push(fits && apart);
        let this = ch.stored_offset.saturating_add(ch.len);
        end = Some(match end {
            Some((o, e)) if o == ch.object => (o, e.max(this)),
            _ => (ch.object, this),
        });
    }
    copies
        .par_iter()
        .zip(ok)
        .map(|(c, ok)| {
            if !ok {
                return (c.chunk, false);
            }
            let ch = chunks[c.chunk];
            let seg = &segs[ch.object as usize];
            // Safety: the range lies inside the segment (checked above) and apart from every
            // other copy's; the put that allocated the fresh segment writes no chunk into it
            // until this returns.
            let dst = unsafe { std::slice::from_raw_parts_mut(seg.ptr().add(ch.stored_offset as usize), ch.len as usize) };
            let src = &c.from[c.at as usize..(c.at + ch.len) as usize];
            (c.chunk, crate::checksum::copy_crc32c(src, dst) == ch.crc32c)
        })
        .collect()
}
