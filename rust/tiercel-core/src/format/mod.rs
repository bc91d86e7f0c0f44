//! The on-tier checkpoint format: names of steps and files, the per-rank manifest and the
//! commit record. docs/format.md is the human-readable twin of this file; change both together.
//!
//! A tier holds one directory (or key prefix) per step:
//! ```text
//! step-000000000042/
//!     rank-00000.part-000.data      data objects of rank 0 (memory tier: one per `put`;
//!     rank-00000.manifest.json      blob tiers: a single rank-00000.data)
//!     rank-00001....
//!     COMMIT                        written last, once every rank's manifest is there
//! ```
//! A rank's manifest is written after its data (atomically), so a manifest present means the
//! rank's data is complete; COMMIT present means every rank's is.
//!
//! `source` is the other side of a write: a `ChunkSource` hands a tier the raw bytes of a
//! rank's chunks, by the indices of this manifest.
//!
//! `integrity` holds what every metadata object is read with: its checksum field and the
//! nesting limit.

mod integrity;
mod names;
mod source;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use integrity::{check_depth, seal};
pub use integrity::{json_depth, unseal, MAX_TREE_DEPTH};
pub use names::{area_data_key, area_manifest_key, parse_area_name, parse_rank_dir, rank_area, unique_token, AreaEntry, AREAS};
pub use source::ChunkSource;

pub const FORMAT_VERSION: u32 = 3;
/// The version written when no item is stored by reference (`Replica::shared`): readers of
/// version 1 read such manifests as before.
pub const PLAIN_VERSION: u32 = 1;
/// The version of manifests with items stored by another rank (`Replica::shared`).
pub const SHARED_VERSION: u32 = 2;
/// The version of a blob tier's per-rank areas (`names`): manifests whose objects carry a
/// root-relative `key` (chunks may lie in an earlier step's object), and the commit records
/// of steps whose manifests lie in rank areas.
pub const AREAS_VERSION: u32 = 3;
pub const MANIFEST_FORMAT: &str = "tiercel-manifest";
pub const COMMIT_FORMAT: &str = "tiercel-commit";
pub const COMMIT_NAME: &str = "COMMIT";
/// Items start at multiples of this inside a data object, so that zero-copy views of any
/// dtype are aligned (and cache-line aligned for the copy).
pub const ITEM_ALIGN: u64 = 64;

/// The largest step: a step's name holds exactly 12 digits, so readers of every version
/// list it. `Store::begin` refuses larger steps (a millisecond timestamp is one).
pub const MAX_STEP: u64 = 999_999_999_999;

pub fn step_dir(step: u64) -> String {
    format!("step-{step:012}")
}

/// Parses a `step-000000000042` directory name; anything else is not a step.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.len() != 12 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

pub fn manifest_name(rank: u32) -> String {
    format!("rank-{rank:05}.manifest.json")
}

pub fn part_name(rank: u32, part: usize) -> String {
    format!("rank-{rank:05}.part-{part:03}.data")
}

/// The two hex digits that spread a rank's keys over prefixes of an object store (which
/// rates requests per prefix): a hash of the rank, so that neighbouring ranks, which save at
/// the same moment, land on different prefixes.
pub fn rank_prefix(rank: u32) -> String {
    format!("{:02x}", xxhash_rust::xxh3::xxh3_64(&rank.to_le_bytes()) & 0xff)
}

pub fn data_name(rank: u32) -> String {
    format!("rank-{rank:05}.data")
}

pub fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// One stored chunk: the unit of I/O, checksum and compression.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChunkMeta {
    /// Offset of the chunk inside its item (raw bytes).
    pub offset: u64,
    /// Raw (decoded) length.
    pub len: u64,
    /// CRC32C of the raw bytes.
    pub crc32c: u32,
    /// Index into `Manifest::objects` of the object that holds the stored bytes.
    pub object: u32,
    /// Where the stored (encoded) bytes start in that object, and how many there are.
    pub stored_offset: u64,
    pub stored_len: u64,
    /// "raw", "zstd", or "bytegroupN+zstd" (N = item size in bytes); see codec.rs.
    pub codec: String,
    /// XXH3-128 of the raw bytes, 32 lowercase hex digits (`checksum::crc32c_and_hash`): what
    /// the bytes are, so a tier or a peer that holds them already need not get them again.
    /// Verification stays with `crc32c`. Absent in manifests written before it (and then
    /// omitted from the JSON, which older readers read as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
}

/// One named array, tensor or byte string of one rank.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ItemMeta {
    /// Path-like name: the `put` name, then the keys down the tree ("optim/state/0/exp_avg").
    pub name: String,
    /// "array" (dtype + shape) or "bytes" (an opaque byte string, e.g. a pickled object).
    pub kind: String,
    /// Canonical dtype name ("float32", "bfloat16", "bool", "complex64", ... "uint8" for bytes).
    pub dtype: String,
    pub shape: Vec<u64>,
    pub nbytes: u64,
    /// Free-form facts the Python side needs to rebuild the value (framework, dtype quirks);
    /// tiercel-core stores it and never interprets it.
    #[serde(default)]
    pub meta: serde_json::Value,
    /// Where this item lies in a global array when it is one shard of it (absent: the item
    /// is the whole value). Omitted from the JSON when absent, so older manifests read as is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardInfo>,
    /// Set when ranks of a replica group hold identical copies of this item (a `replicated`
    /// put): persistent tiers then store the bytes once. Omitted when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<Replica>,
    pub chunks: Vec<ChunkMeta>,
}

/// An item that every rank of a replica group holds identically.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Replica {
    /// The rank whose copy is stored: the lowest rank of the group.
    pub primary: u32,
    /// The bytes are not in this rank's objects on this tier: the chunk table holds offsets,
    /// lengths and checksums only, and the stored bytes are the primary's, located by the
    /// primary's manifest of the same step on the same tier (`link_shared` of the tier module `replica`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
    /// Not declared: the ranks were found to hold these bytes on the save path, by the
    /// digest of their chunks (`store::matched`). Such a copy is not checked at the commit
    /// (its digest was), a restore still checks it against the primary's (`replica::resolve`),
    /// and the ranks do not restore it together as a replica group.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub matched: bool,
}

/// One shard of a global array: the item's `shape` is the shard's own; it starts at
/// `offsets` (one per dimension) in an array of `global_shape`. `replica_id` tells copies of
/// the same shard apart (0 for the first data-parallel replica), so a restore can read each
/// shard once and place it into any target sharding.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ShardInfo {
    pub global_shape: Vec<u64>,
    pub offsets: Vec<u64>,
    #[serde(default)]
    pub replica_id: u32,
}

impl ShardInfo {
    /// Checks that a shard of `shape` fits: the ranks agree and, per dimension,
    /// `offset + shape <= global`. Returns why not.
    pub fn check(&self, shape: &[u64]) -> std::result::Result<(), String> {
        let rank = self.global_shape.len();
        if self.offsets.len() != rank || shape.len() != rank {
            return Err(format!(
                "shard has {} offsets and a global shape of {rank} dimensions for an item of {} dimensions; all three must match",
                self.offsets.len(),
                shape.len()
            ));
        }
        for (d, ((&off, &n), &g)) in self.offsets.iter().zip(shape).zip(&self.global_shape).enumerate() {
            if off.checked_add(n).is_none_or(|end| end > g) {
                return Err(format!("shard dimension {d}: offset {off} + size {n} exceeds the global size {g}"));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ObjectMeta {
    pub name: String,
    pub len: u64,
    /// Where the object lies, relative to the tier's root (version 3: a rank area's data
    /// object, possibly of an earlier step whose chunks this one shares). Absent: `name` in
    /// the step's own directory, as in versions 1 and 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

impl ObjectMeta {
    /// The object's key under the tier's root, for a manifest of `step`.
    pub fn key_in(&self, step: u64) -> String {
        match &self.key {
            Some(k) => k.clone(),
            None => format!("{}/{}", step_dir(step), self.name),
        }
    }
}

/// What one rank wrote for one step on one tier.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub step: u64,
    pub rank: u32,
    pub world_size: u32,
    /// The tier this copy of the manifest describes (stored offsets differ per tier).
    pub tier: String,
    pub chunk_size: u64,
    pub objects: Vec<ObjectMeta>,
    /// The structure of each `put` value (nested dicts/lists/scalars with item references),
    /// in the order they were put. Opaque to tiercel-core.
    pub trees: Vec<(String, serde_json::Value)>,
    pub items: Vec<ItemMeta>,
    /// Which save of this step number the manifest belongs to (see `CommitRecord::generation`);
    /// absent in manifests written before generations were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<String>,
}

impl Manifest {
    pub fn new(step: u64, rank: u32, world_size: u32, tier: &str, chunk_size: u64) -> Self {
        Manifest {
            format: MANIFEST_FORMAT.into(),
            version: PLAIN_VERSION,
            step,
            rank,
            world_size,
            tier: tier.into(),
            chunk_size,
            objects: vec![],
            trees: vec![],
            items: vec![],
            generation: None,
        }
    }

    /// The manifest's bytes as stored: JSON with its checksum field last (see `seal`).
    pub fn to_json(&self) -> Vec<u8> {
        seal(serde_json::to_vec(self).expect("manifest serializes"))
    }

    /// Decodes and checks a manifest read from `where_` (a path or key, for the message).
    pub fn from_json(bytes: &[u8], where_: &str) -> Result<Self> {
        Self::parse(bytes, where_).map_err(|e| e.with_path(where_))
    }

    fn parse(bytes: &[u8], where_: &str) -> Result<Self> {
        let bytes = unseal(bytes, where_)?;
        check_depth(bytes, where_)?;
        let m: Manifest =
            serde_json::from_slice(bytes).map_err(|e| Error::integrity(format!("{where_}: not a valid tiercel manifest: {e}")))?;
        if m.format != MANIFEST_FORMAT {
            return Err(Error::integrity(format!("{where_}: format is '{}', expected '{MANIFEST_FORMAT}'", m.format)));
        }
        if m.version > FORMAT_VERSION {
            return Err(Error::integrity(format!(
                "{where_}: manifest version {} is newer than this tiercel understands ({FORMAT_VERSION}); upgrade tiercel",
                m.version
            )));
        }
        if let Some(o) = m.objects.iter().find(|o| o.key.is_some()) {
            let key = o.key.as_deref().unwrap_or_default();
            if m.version < AREAS_VERSION {
                return Err(Error::integrity(format!(
                    "{where_}: object '{}' has a key ({key}) in a version {} manifest",
                    o.name, m.version
                )));
            }
            if key.starts_with('/') || key.split('/').any(|c| c.is_empty() || c == "..") {
                return Err(Error::integrity(format!("{where_}: object '{}' has a key outside the tier's root: {key:?}", o.name)));
            }
        }
        for item in &m.items {
            if let Some(shard) = &item.shard {
                shard.check(&item.shape).map_err(|why| Error::integrity(format!("{where_}: item '{}': {why}", item.name)))?;
            }
            let shared = item.replica.as_ref().is_some_and(|r| r.shared);
            if shared && m.version < SHARED_VERSION {
                return Err(Error::integrity(format!("{where_}: item '{}' is stored by reference in a version 1 manifest", item.name)));
            }
            let mut expect = 0u64;
            for c in &item.chunks {
                if shared {
                    // Located through the primary's manifest; only the table must tile.
                    if c.offset != expect {
                        return Err(Error::integrity(format!("{where_}: item '{}' has inconsistent chunk table", item.name)));
                    }
                    expect += c.len;
                    continue;
                }
                if c.offset != expect || c.object as usize >= m.objects.len() {
                    return Err(Error::integrity(format!("{where_}: item '{}' has inconsistent chunk table", item.name)));
                }
                let obj = &m.objects[c.object as usize];
                if c.stored_offset.checked_add(c.stored_len).is_none_or(|end| end > obj.len) {
                    return Err(Error::integrity(format!(
                        "{where_}: item '{}' chunk at {} lies outside object '{}'",
                        item.name, c.offset, obj.name
                    )));
                }
                expect += c.len;
            }
            if expect != item.nbytes {
                return Err(Error::integrity(format!(
                    "{where_}: item '{}' chunks cover {expect} bytes, item has {}",
                    item.name, item.nbytes
                )));
            }
        }
        Ok(m)
    }

    pub fn total_bytes(&self) -> u64 {
        self.items.iter().map(|i| i.nbytes).sum()
    }

    /// (item, chunk) index pairs of every chunk, in manifest order.
    pub fn chunk_refs(&self) -> Vec<(usize, usize)> {
        self.items.iter().enumerate().flat_map(|(i, it)| (0..it.chunks.len()).map(move |c| (i, c))).collect()
    }

    pub fn item_index(&self, name: &str) -> Option<usize> {
        self.items.iter().position(|i| i.name == name)
    }
}

/// The commit record of a step on a tier: written last, create-if-absent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CommitRecord {
    pub format: String,
    pub version: u32,
    pub step: u64,
    pub world_size: u32,
    pub tier: String,
    /// Seconds since the epoch when the commit was written.
    pub time: f64,
    /// The ranks this commit covers when the tier is local to a host (the memory tier of a
    /// job spread over several hosts); absent: every rank of `world_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Vec<u32>>,
    /// The job that saved the step; absent in records written before jobs were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<JobId>,
    /// The save of this step number that the commit covers: every rank's manifest of the
    /// step carries the same generation (a launch of the job and how many times it has saved
    /// the step), so a step saved again never commits, nor reads, old ranks with new ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<String>,
}

/// Which job saved a step: its run id when it has one (policy `[store] run`, else
/// `$TIERCEL_RUN_ID`, `$TORCHELASTIC_RUN_ID`, `$SLURM_JOB_ID`), its world size, and a
/// fingerprint of where its policy persists steps (kind and location of each fs, s3, gcs tier).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct JobId {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    pub world_size: u32,
    pub policy: String,
}

impl JobId {
    /// Whether a step saved by `other` belongs to this job: the same run id, or neither has
    /// one. Without run ids, world size and policy are recorded but not compared: a job may
    /// resume resharded on another number of ranks (the DCP and Orbax adapters do; a plain
    /// restore of a rank's own part refuses another world size, `WorldSizeError` in Python),
    /// or from a checkpoint copied to another directory or bucket.
    pub fn same_job(&self, other: &JobId) -> bool {
        self.run == other.run
    }

    /// For messages: "run 'abc' (world size 3)" or "a job without a run id (world size 3, policy 1a2b3c4d)".
    pub fn describe(&self) -> String {
        match &self.run {
            Some(r) => format!("run '{r}' (world size {})", self.world_size),
            None => format!("a job without a run id (world size {}, policy {})", self.world_size, self.policy),
        }
    }
}

impl CommitRecord {
    pub fn new(step: u64, world_size: u32, tier: &str) -> Self {
        let time = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        CommitRecord {
            format: COMMIT_FORMAT.into(),
            version: PLAIN_VERSION,
            step,
            world_size,
            tier: tier.into(),
            time,
            ranks: None,
            job: None,
            generation: None,
        }
    }

    /// The record's bytes as stored: JSON with its checksum field last (see `seal`).
    pub fn to_json(&self) -> Vec<u8> {
        seal(serde_json::to_vec(self).expect("commit record serializes"))
    }

    pub fn from_json(bytes: &[u8], where_: &str) -> Result<Self> {
        Self::parse(bytes, where_).map_err(|e| e.with_path(where_))
    }

    fn parse(bytes: &[u8], where_: &str) -> Result<Self> {
        let bytes = unseal(bytes, where_)?;
        let c: CommitRecord =
            serde_json::from_slice(bytes).map_err(|e| Error::integrity(format!("{where_}: not a valid commit record: {e}")))?;
        if c.format != COMMIT_FORMAT || c.version > FORMAT_VERSION {
            return Err(Error::integrity(format!("{where_}: unknown commit record format/version")));
        }
        Ok(c)
    }
}

/// Splits an item of `nbytes` into chunk (offset, len) pairs. Chunk lengths are multiples of
/// the chunk size except the last, so the chunking is the same on every tier.
pub fn chunk_ranges(nbytes: u64, chunk_size: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..nbytes.div_ceil(chunk_size)).map(move |i| {
        let off = i * chunk_size;
        (off, chunk_size.min(nbytes - off))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_dir_round_trip() {
        assert_eq!(parse_step_dir(&step_dir(42)), Some(42));
        assert_eq!(parse_step_dir("step-42"), None);
        assert_eq!(parse_step_dir("step-00000000004x"), None);
        assert!(step_dir(9) < step_dir(10));
    }

    #[test]
    fn chunking_covers_item() {
        let v: Vec<_> = chunk_ranges(10, 4).collect();
        assert_eq!(v, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunk_ranges(0, 4).count(), 0);
    }

    #[test]
    fn manifest_rejects_bad_chunk_table() {
        let mut m = Manifest::new(1, 0, 1, "ram", 4);
        m.objects.push(ObjectMeta { name: "d".into(), len: 8, key: None });
        m.items.push(ItemMeta {
            name: "a".into(),
            kind: "array".into(),
            dtype: "uint8".into(),
            shape: vec![8],
            nbytes: 8,
            meta: serde_json::Value::Null,
            shard: None,
            replica: None,
            chunks: vec![ChunkMeta {
                offset: 0,
                len: 8,
                crc32c: 0,
                object: 0,
                stored_offset: 4,
                stored_len: 8,
                codec: "raw".into(),
                hash: None,
            }],
        });
        let e = Manifest::from_json(&m.to_json(), "x").unwrap_err();
        assert!(e.message.contains("outside object"), "{}", e.message);
        assert!(Manifest::from_json(b"{", "x/y.json").unwrap_err().message.contains("x/y.json"));
    }

    fn one_item(shard: Option<ShardInfo>) -> Manifest {
        let mut m = Manifest::new(1, 0, 1, "ram", 4);
        m.objects.push(ObjectMeta { name: "d".into(), len: 8, key: None });
        m.items.push(ItemMeta {
            name: "w".into(),
            kind: "array".into(),
            dtype: "uint8".into(),
            shape: vec![2, 4],
            nbytes: 8,
            meta: serde_json::Value::Null,
            shard,
            replica: None,
            chunks: vec![ChunkMeta {
                offset: 0,
                len: 8,
                crc32c: 0,
                object: 0,
                stored_offset: 0,
                stored_len: 8,
                codec: "raw".into(),
                hash: None,
            }],
        });
        m
    }

    #[test]
    fn shard_info_round_trips_and_is_omitted_when_absent() {
        let plain = one_item(None);
        let text = String::from_utf8(plain.to_json()).unwrap();
        assert!(!text.contains("shard"), "{text}");
        assert_eq!(Manifest::from_json(text.as_bytes(), "x").unwrap(), plain);
        // A manifest written before shards existed (this one) has no such field and reads as before.

        let shard = ShardInfo { global_shape: vec![4, 8], offsets: vec![2, 4], replica_id: 1 };
        let sharded = one_item(Some(shard.clone()));
        let text = String::from_utf8(sharded.to_json()).unwrap();
        assert!(text.contains(r#""shard":{"global_shape":[4,8],"offsets":[2,4],"replica_id":1}"#), "{text}");
        assert_eq!(Manifest::from_json(text.as_bytes(), "x").unwrap().items[0].shard, Some(shard));
        // replica_id may be left out (0).
        // (A hand-edited manifest has no valid checksum: edit one without the field, as
        // manifests written before checksums existed are.)
        let text = serde_json::to_string(&sharded).unwrap().replace(r#","replica_id":1"#, "");
        assert_eq!(Manifest::from_json(text.as_bytes(), "x").unwrap().items[0].shard.as_ref().unwrap().replica_id, 0);
    }

    /// Repro (issue 14.2): flipping one bit at a time over a manifest gave other keys, one
    /// tensor's bytes under another's name, or a wrong `step`, with no error. Now every flip
    /// either leaves the manifest it decodes to equal to the original or is an integrity error.
    #[test]
    fn every_bit_flip_of_metadata_is_caught_or_harmless() {
        let mut m = one_item(None);
        m.trees.push(("w".into(), serde_json::json!({"t": "dict", "v": [["step", {"t": "int", "v": "7"}]]})));
        let good = m.to_json();
        assert_eq!(Manifest::from_json(&good, "m").unwrap(), m);
        assert!(good.ends_with(b"\"}") && String::from_utf8_lossy(&good).contains(",\"checksum\":\"crc32c:"));
        let (mut caught, mut harmless) = (0, 0);
        for i in 0..good.len() * 8 {
            let mut bad = good.clone();
            bad[i / 8] ^= 1 << (i % 8);
            match Manifest::from_json(&bad, "m") {
                Ok(got) => {
                    assert_eq!(got, m, "flip of bit {i} decoded to a different manifest");
                    harmless += 1;
                }
                Err(e) => {
                    assert_eq!(e.kind, crate::error::ErrorKind::Integrity, "{e}");
                    caught += 1;
                }
            }
        }
        assert!(caught > good.len() * 7, "{caught} caught, {harmless} harmless");
        let mut rec = CommitRecord::new(7, 2, "ram");
        rec.time = 1.5; // serde_json may not round-trip every float to the last bit
        let good = rec.to_json();
        assert_eq!(CommitRecord::from_json(&good, "c").unwrap(), rec);
        for i in 0..good.len() * 8 {
            let mut bad = good.clone();
            bad[i / 8] ^= 1 << (i % 8);
            if let Ok(got) = CommitRecord::from_json(&bad, "c") {
                assert_eq!(got, rec, "flip of bit {i}");
            }
        }
        // Written before checksums existed: read as is.
        assert_eq!(Manifest::from_json(serde_json::to_string(&m).unwrap().as_bytes(), "m").unwrap(), m);
        let e = Manifest::from_json(&[&good[..good.len() - 3], b"0\"}"].concat(), "dir/COMMIT").unwrap_err();
        assert!(e.message.contains("dir/COMMIT") && e.message.contains("checksum"), "{}", e.message);
    }

    /// Repro (issue 14.8): a tree nested ~62 lists deep saved and committed, then could not be
    /// read (the JSON reader's depth limit), and restore() quietly took the previous step.
    /// Readers now refuse deeper trees with a clear message (and `begin`/`add_part` refuse
    /// them at save, with the same limit).
    #[test]
    fn tree_depth_limit_is_the_same_at_save_and_read() {
        let nest = |n: usize| (0..n).fold(serde_json::json!(1), |v, _| serde_json::json!([v]));
        assert_eq!(json_depth(&nest(MAX_TREE_DEPTH)), MAX_TREE_DEPTH);
        let mut m = one_item(None);
        m.trees.push(("w".into(), nest(MAX_TREE_DEPTH)));
        assert_eq!(Manifest::from_json(&m.to_json(), "m").unwrap(), m);
        m.trees[0].1 = nest(MAX_TREE_DEPTH + 1);
        let e = Manifest::from_json(&m.to_json(), "m").unwrap_err();
        assert!(e.message.contains("at most 100 levels"), "{}", e.message);
    }

    #[test]
    fn shard_info_must_fit_its_global_array() {
        let bad = [
            (
                ShardInfo { global_shape: vec![4, 8], offsets: vec![3, 4], replica_id: 0 },
                "dimension 0: offset 3 + size 2 exceeds the global size 4",
            ),
            (ShardInfo { global_shape: vec![4, 8], offsets: vec![0, 5], replica_id: 0 }, "dimension 1"),
            (ShardInfo { global_shape: vec![4, 8], offsets: vec![0], replica_id: 0 }, "1 offsets"),
            (ShardInfo { global_shape: vec![8], offsets: vec![0], replica_id: 0 }, "all three must match"),
            (ShardInfo { global_shape: vec![4, 8], offsets: vec![u64::MAX, 0], replica_id: 0 }, "exceeds"),
        ];
        for (shard, want) in bad {
            let e = Manifest::from_json(&one_item(Some(shard)).to_json(), "m.json").unwrap_err();
            assert_eq!(e.kind, crate::error::ErrorKind::Integrity);
            assert!(e.message.contains(want) && e.message.contains("m.json") && e.message.contains("'w'"), "{}", e.message);
        }
        let whole = ShardInfo { global_shape: vec![2, 4], offsets: vec![0, 0], replica_id: 0 };
        assert!(Manifest::from_json(&one_item(Some(whole)).to_json(), "m.json").is_ok());
    }
}
