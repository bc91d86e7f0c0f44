use std::collections::HashMap;
use std::time::Duration;

use super::*;
use crate::format::{ChunkMeta, ItemMeta, ShardInfo};
use crate::store::commit::LocalCounter;

/// A job's counter, counting each rank's operations.
#[derive(Default)]
struct Counted {
    inner: LocalCounter,
    ops: Mutex<HashMap<u32, usize>>,
    deleted: Mutex<Vec<String>>,
}

/// One rank's view of the counter.
struct Rank<'a>(&'a Counted, u32);

impl StepCounter for Rank<'_> {
    fn add(&self, key: &str, by: i64) -> Result<i64> {
        *self.0.ops.lock().entry(self.1).or_default() += 1;
        self.0.inner.add(key, by)
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.0.deleted.lock().push(key.to_string());
        self.0.inner.delete(key)
    }
}

impl Counted {
    /// Operations of each of ranks 0..n since the last call.
    fn ops(&self, n: u32) -> Vec<usize> {
        let mut ops = self.ops.lock();
        (0..n).map(|r| ops.remove(&r).unwrap_or(0)).collect()
    }
}

fn key(step: u64, d: &str) -> String {
    format!("tiercel/match/launch/disk/{step}/g{step}/{d}")
}

/// Rank `rank` meets the others over `d` at `step`, with its own memory `m`.
fn meet(c: &Counted, m: &Matching, rank: u32, step: u64, d: &str) -> Option<u32> {
    m.primary(&Rank(c, rank), rank, "disk", key(step, d), d.into()).unwrap()
}

#[test]
fn ranks_with_the_same_bytes_agree_on_one_primary_and_keep_it_while_the_bytes_stay() {
    let c = Counted::default();
    let (m0, m1, m2) = (Matching::default(), Matching::default(), Matching::default());
    // First persist: the first to claim stores; the others follow it.
    assert_eq!(meet(&c, &m1, 1, 1, "a"), Some(1));
    assert_eq!(meet(&c, &m0, 0, 1, "a"), Some(1));
    assert_eq!(meet(&c, &m2, 2, 1, "a"), Some(1));
    assert_eq!(c.ops(3), [2, 2, 2], "claim, then publish or read");
    // The same bytes at the next persist: the same primary, whoever comes first, one
    // operation each.
    std::thread::scope(|s| {
        let f0 = s.spawn(|| meet(&c, &m0, 0, 2, "a"));
        let f2 = s.spawn(|| meet(&c, &m2, 2, 2, "a"));
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(meet(&c, &m1, 1, 2, "a"), Some(1));
        assert_eq!((f0.join().unwrap(), f2.join().unwrap()), (Some(1), Some(1)));
    });
    let ops = c.ops(3);
    assert_eq!(ops[1], 1, "the primary publishes: {ops:?}");
    assert!(ops[0] >= 1 && ops[2] >= 1 && ops[0] + ops[2] <= 2 * 12, "followers poll a little: {ops:?}");
}

#[test]
fn ranks_with_their_own_bytes_each_store_them() {
    let c = Counted::default();
    let (m0, m1) = (Matching::default(), Matching::default());
    for step in 1..=3 {
        assert_eq!(meet(&c, &m0, 0, step, &format!("zero{step}")), Some(0));
        assert_eq!(meet(&c, &m1, 1, step, &format!("one{step}")), Some(1));
        assert_eq!(c.ops(2), [2, 2], "a claim and a publication a step each");
    }
    // The primary of unchanged bytes only publishes.
    assert_eq!(meet(&c, &m0, 0, 4, "zero3"), Some(0));
    assert_eq!(c.ops(2), [1, 0]);
}

#[test]
fn two_publishers_each_store_and_so_do_their_followers() {
    let c = Counted::default();
    let (m0, m1, m2) = (Matching::default(), Matching::default(), Matching::default());
    assert_eq!(meet(&c, &m0, 0, 1, "a"), Some(0));
    assert_eq!(meet(&c, &m2, 2, 1, "a"), Some(0));
    assert_eq!(meet(&c, &m1, 1, 1, "b"), Some(1));
    // Step 2: rank 1's bytes became rank 0's. Rank 0 publishes as the holder of "a"; rank 1,
    // new to "a", claims first and publishes too. Rank 2 then follows neither.
    assert_eq!(meet(&c, &m1, 1, 2, "a"), Some(1));
    assert_eq!(meet(&c, &m0, 0, 2, "a"), Some(0));
    assert_eq!(meet(&c, &m2, 2, 2, "a"), None);
    // Having stored nothing of its own to follow, rank 2 claims at the next persist.
    assert_eq!(meet(&c, &m2, 2, 3, "a"), Some(2));
}

#[test]
fn a_follower_whose_primary_changed_its_bytes_stores_its_own_after_the_wait() {
    let c = Counted::default();
    let (m0, m1) = (Matching::default(), Matching::default());
    assert_eq!(meet(&c, &m0, 0, 1, "a"), Some(0));
    assert_eq!(meet(&c, &m1, 1, 1, "a"), Some(0));
    assert_eq!(meet(&c, &m0, 0, 2, "b"), Some(0));
    let t0 = Instant::now();
    assert_eq!(meet(&c, &m1, 1, 2, "a"), None);
    assert!(t0.elapsed() >= WAIT, "waited {:?}", t0.elapsed());
}

#[test]
fn a_primary_deletes_the_keys_of_its_older_publications() {
    let c = Counted::default();
    let m0 = Matching::default();
    for step in 1..=(KEYS_KEPT as u64 + 2) {
        meet(&c, &m0, 0, step, "a");
    }
    let deleted = c.deleted.lock().clone();
    assert_eq!(
        deleted,
        [
            format!("{}/claim", key(1, "a")),
            format!("{}/who", key(1, "a")),
            format!("{}/claim", key(2, "a")),
            format!("{}/who", key(2, "a"))
        ]
    );
}

fn item(name: &str, nbytes: u64, hash: &str) -> ItemMeta {
    ItemMeta {
        name: name.into(),
        kind: "array".into(),
        dtype: "uint8".into(),
        shape: vec![nbytes],
        nbytes,
        meta: serde_json::Value::Null,
        shard: None,
        replica: None,
        chunks: vec![ChunkMeta {
            offset: 0,
            len: nbytes,
            crc32c: 7,
            object: 0,
            stored_offset: 0,
            stored_len: nbytes,
            codec: "raw".into(),
            hash: Some(hash.into()),
        }],
    }
}

#[test]
fn the_digest_covers_large_undeclared_items_their_bytes_and_their_place() {
    let mut m = Manifest::new(1, 0, 2, "ram", 1 << 20);
    m.items = vec![item("model/w", 1 << 20, "h1"), item("rng", 16, "h2"), item("model/b", MIN_MATCHED, "h3")];
    m.items[2].replica = Some(Replica { primary: 0, shared: false, matched: false });
    assert_eq!(candidates(&m), [0], "small and declared items are each rank's own");
    let d = digest(&m, &[0]);
    let mut other = m.clone();
    other.rank = 1;
    other.items[1].chunks[0].hash = Some("different".into());
    assert_eq!(digest(&other, &[0]), d, "the same large bytes on another rank");
    other.items[0].chunks[0].hash = Some("h9".into());
    assert_ne!(digest(&other, &[0]), d, "other bytes");
    let mut shard = m.clone();
    shard.items[0].shard = Some(ShardInfo { global_shape: vec![2 << 20], offsets: vec![1 << 20], replica_id: 0 });
    assert_ne!(digest(&shard, &[0]), d, "the same bytes at another place of a global array");
    let mut unhashed = m.clone();
    unhashed.items[0].chunks[0].hash = None;
    assert!(candidates(&unhashed).is_empty(), "chunks without a hash are never matched");
}

#[test]
fn a_follower_remembers_its_primary_and_has_nothing_to_delete() {
    let c = Counted::default();
    let (m0, m1) = (Matching::default(), Matching::default());
    assert_eq!(meet(&c, &m0, 0, 1, "a"), Some(0));
    assert_eq!(meet(&c, &m1, 1, 1, "a"), Some(0));
    assert_eq!(m1.tiers.lock()["disk"].last, Some(("a".to_string(), 0)));
    assert!(m1.tiers.lock()["disk"].published.is_empty());
}

#[test]
fn at_10000_ranks_each_makes_at_most_2_counter_operations_and_each_group_stores_once() {
    // 10,000 ranks in 8 replica groups of identical bytes (HSDP: replicas of one shard hold
    // the same), meeting through one counter, in arrival order; then the next persist with the
    // bytes unchanged. Rank r holds group r % 8's bytes.
    const N: u32 = 10_000;
    const GROUPS: u32 = 8;
    let c = Counted::default();
    let memories: Vec<Matching> = (0..N).map(|_| Matching::default()).collect();
    for step in 1..=2u64 {
        let mut primaries = vec![Vec::new(); GROUPS as usize];
        for r in 0..N {
            let d = format!("group{}", r % GROUPS);
            let p = meet(&c, &memories[r as usize], r, step, &d).expect("a sole publisher");
            primaries[(r % GROUPS) as usize].push(p);
        }
        for (g, ps) in primaries.iter().enumerate() {
            assert!(ps.iter().all(|&p| p == g as u32), "group {g} agrees on its first rank as primary");
        }
        let per_rank = c.ops(N).iter().sum::<usize>() as f64 / f64::from(N);
        // Step 1: a claim each, then a publication (8 ranks) or a read (the rest): 2N.
        // Step 2: the same bytes: a publication or a read each: N.
        let want = if step == 1 { 2.0 } else { 1.0 };
        assert_eq!(per_rank, want, "step {step}: {per_rank} counter operations per rank");
    }
}
