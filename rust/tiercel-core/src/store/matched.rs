//! Bytes that several ranks hold, stored once on a tier that dedups (`Tier::dedups`): ranks
//! of a data-parallel job that save the same parameters without declaring them replicated
//! (`replica_group`). On the save path, before its write, each rank digests its large items
//! (the chunks' XXH3-128 hashes, names, shapes and shard places) and meets the ranks with the
//! same digest on the job's counter; one of them, the primary, stores the items, and the
//! others' manifests refer to the primary's copy of the same step (`Replica::matched`, read
//! as declared replicas are: `tier::replica`). A step commits only with every rank's manifest,
//! the primary's among them, and retention keeps or removes a step's manifests together, so a
//! copy is never referred to after it is gone.
//!
//! The protocol per rank, tier and persisted step, under keys named by the launch, tier, step,
//! save (generation) and digest (docs/scale.md, "Ranks that hold the same bytes"):
//! - the rank that stored these items at its last persist here (same digest) publishes
//!   itself under `who` (1 counter operation), and stores them;
//! - a rank that followed a primary at its last persist here, with the same digest, waits for
//!   `who` (1 operation, more while it polls);
//! - any other rank adds 1 to `claim`: the first (its add returns 1) publishes itself and
//!   stores; the others wait for `who` (2 operations each).
//!
//! `who` holds 2^32 per publisher plus its rank + 1, so a reader sees how many published; it
//! follows only a sole publisher. Two publishers (a rank whose bytes became those of another
//! rank's last persist) both store their own copies, and so does a rank that waited in vain
//! (WAIT): storing is always safe, referring only where a rank published these very bytes for
//! this very save. Unique items (sharded state) cost each rank 2 operations a step, the same
//! bytes unchanged since the last step 1 each: O(1) per rank whatever the number of ranks.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::commit::StepCounter;
use super::{Store, TierSlot};
use crate::error::Result;
use crate::format::{Manifest, Replica};

/// Items smaller than this are each rank's own: they are where ranks differ (step counters,
/// random states), and storing them twice costs little.
pub const MIN_MATCHED: u64 = 64 << 10;

/// How long a rank waits for the primary to publish itself before it stores its own copy.
const WAIT: Duration = Duration::from_secs(5);

/// How many of its publications a primary keeps on the counter before it deletes their keys
/// (a rank that lags this many persists behind stores its own copy).
const KEYS_KEPT: usize = 4;

/// What one publication adds to `who`, besides the publisher's rank + 1.
const PUBLISHER: i64 = 1 << 32;

/// What this process knows of its matches, per tier: its last persist's digest and primary,
/// and the keys it published (to delete them later).
#[derive(Default)]
pub(super) struct Matching {
    tiers: Mutex<HashMap<String, Known>>,
}

#[derive(Default)]
struct Known {
    last: Option<(String, u32)>,
    published: VecDeque<String>,
}

/// The counter and names that one persist's keys are made of.
struct Meeting<'a> {
    counter: &'a dyn StepCounter,
    rank: u32,
    key: String,
}

impl Store {
    /// `m` as `slot`'s tier should store it: its large items marked as stored by another rank
    /// that holds the same bytes, where one does (see the module). None: store `m` as it is
    /// (a tier that does not dedup, one rank, no counter, nothing large, no match).
    pub(super) fn match_ranks(&self, slot: &TierSlot, m: &Manifest) -> Option<Manifest> {
        if self.world_size == 1 || !slot.tier.dedups() {
            return None;
        }
        let counter = self.commits.counter.read().clone()?;
        let launch = self.launch.read().clone()?;
        let generation = m.generation.as_ref()?;
        let items = candidates(m);
        if items.is_empty() {
            return None;
        }
        let d = digest(m, &items);
        let key = format!("tiercel/match/{launch}/{}/{}/{generation}/{d}", slot.config.name, m.step);
        let p = self.matching.primary(&*counter, self.rank, &slot.config.name, key, d).unwrap_or_else(|e| {
            log::warn!("tier '{}': step {} rank {}: the counter: {e}; this rank stores its own copy", slot.config.name, m.step, self.rank);
            None
        })?;
        if p == self.rank {
            return None;
        }
        let mut out = m.clone();
        for i in items {
            out.items[i].replica = Some(Replica { primary: p, shared: false, matched: true });
        }
        Some(out)
    }
}

impl Matching {
    /// Which rank stores the bytes of digest `d` in the save that `key` names, on `tier`:
    /// this rank (`rank`), another, or None (each its own copy). Remembers the answer for
    /// this rank's next persist to the tier, and deletes the keys of its older publications.
    fn primary(&self, counter: &dyn StepCounter, rank: u32, tier: &str, key: String, d: String) -> Result<Option<u32>> {
        let last = self.tiers.lock().entry(tier.to_string()).or_default().last.take();
        let meeting = Meeting { counter, rank, key };
        let primary = meeting.meet(last.filter(|(ld, _)| *ld == d).map(|(_, p)| p))?;
        let mut known = self.tiers.lock();
        let known = known.entry(tier.to_string()).or_default();
        known.last = primary.map(|p| (d, p));
        if primary == Some(rank) {
            known.published.push_back(meeting.key);
            while known.published.len() > KEYS_KEPT {
                let old = known.published.pop_front().expect("not empty");
                let _ = counter.delete(&format!("{old}/claim"));
                let _ = counter.delete(&format!("{old}/who"));
            }
        }
        Ok(primary)
    }
}

impl Meeting<'_> {
    /// The primary of these bytes in this save: this rank, another, or None (this rank stores
    /// its own copy). `before`: the primary of the same bytes at this rank's last persist.
    fn meet(&self, before: Option<u32>) -> Result<Option<u32>> {
        match before {
            Some(p) if p == self.rank => self.publish(),
            Some(_) => self.wait(),
            None if self.counter.add(&format!("{}/claim", self.key), 1)? == 1 => self.publish(),
            None => self.wait(),
        }
    }

    fn publish(&self) -> Result<Option<u32>> {
        self.counter.add(&format!("{}/who", self.key), PUBLISHER + i64::from(self.rank) + 1)?;
        Ok(Some(self.rank))
    }

    fn wait(&self) -> Result<Option<u32>> {
        let key = format!("{}/who", self.key);
        let deadline = Instant::now() + WAIT;
        let mut pause = Duration::from_millis(2);
        loop {
            let v = self.counter.add(&key, 0)?;
            if v != 0 {
                // One publisher: its rank. Several: each stores its own copy, and so does this rank.
                return Ok((v / PUBLISHER == 1).then(|| (v % PUBLISHER - 1) as u32));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }
}

/// The items a match may cover: large, not declared replicated, every chunk hashed.
fn candidates(m: &Manifest) -> Vec<usize> {
    (0..m.items.len())
        .filter(|&i| {
            let it = &m.items[i];
            it.replica.is_none() && it.nbytes >= MIN_MATCHED && it.chunks.iter().all(|c| c.hash.is_some())
        })
        .collect()
}

/// What `items` of `m` are: XXH3-128 over each item's name, dtype, shape, shard place and
/// chunk table (offsets, lengths, CRC32Cs, hashes). Equal digests, equal bytes.
fn digest(m: &Manifest, items: &[usize]) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for &i in items {
        let it = &m.items[i];
        let shard = it.shard.as_ref().map(|s| (&s.global_shape, &s.offsets));
        h.update(format!("{}\0{}\0{:?}\0{:?}\0", it.name, it.dtype, it.shape, shard).as_bytes());
        for c in &it.chunks {
            h.update(format!("{} {} {:08x} {}\0", c.offset, c.len, c.crc32c, c.hash.as_deref().unwrap_or("")).as_bytes());
        }
    }
    format!("{:032x}", h.digest128())
}

#[cfg(test)]
#[path = "matched_tests.rs"]
mod tests;
