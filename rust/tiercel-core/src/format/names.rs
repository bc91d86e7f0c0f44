//! The names of a version-3 blob tier's per-rank areas (docs/format.md, "Rank areas"): each
//! rank's manifests and data objects of every step under one key prefix, spread over 256
//! prefixes by `rank_prefix`, so that N ranks writing one step hit min(N, 256) prefixes of an
//! object store (which rates requests per prefix) and a rank finds all its objects with one
//! listing. A step's own directory then holds only its commit record.

use super::{rank_prefix, step_dir};

/// The root-level name under which every rank area lies.
pub const AREAS: &str = "ranks";

/// Rank `rank`'s area: `ranks/<rank_prefix>/rank-RRRRR`.
pub fn rank_area(rank: u32) -> String {
    format!("{AREAS}/{}/rank-{rank:05}", rank_prefix(rank))
}

/// The key of rank `rank`'s manifest of `step`: `<area>/step-SSSSSSSSSSSS.manifest.json`.
pub fn area_manifest_key(step: u64, rank: u32) -> String {
    format!("{}/{}.manifest.json", rank_area(rank), step_dir(step))
}

/// The key of a data object rank `rank` wrote for `step`: `<area>/step-SSSSSSSSSSSS.<unique>.data`.
/// `unique` differs per save (`unique_token`), so a step saved again never overwrites bytes
/// that a later step's manifest may still refer to.
pub fn area_data_key(step: u64, rank: u32, unique: &str) -> String {
    format!("{}/{}.{unique}.data", rank_area(rank), step_dir(step))
}

/// A token no other save of this process or of another has: 16 hex digits of a hash of the
/// time, the process and a counter.
pub fn unique_token() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let seed = format!("{now}-{}-{}-{:?}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed), std::thread::current().id());
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(seed.as_bytes()))
}

/// What a name inside a rank area is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AreaEntry {
    /// `step-SSSSSSSSSSSS.manifest.json`
    Manifest(u64),
    /// `step-SSSSSSSSSSSS.<unique>.data`
    Data(u64),
}

/// Parses a name listed in a rank area (its last path component); temporary files and
/// anything else are None.
pub fn parse_area_name(name: &str) -> Option<AreaEntry> {
    if name.contains(crate::gc::TEMP_MARKER) {
        return None;
    }
    let (dir, rest) = name.split_at_checked(17)?;
    let step = super::parse_step_dir(dir)?;
    if rest == ".manifest.json" {
        return Some(AreaEntry::Manifest(step));
    }
    let unique = rest.strip_prefix('.')?.strip_suffix(".data")?;
    (!unique.is_empty() && !unique.contains('/')).then_some(AreaEntry::Data(step))
}

/// The rank of an area's last component (`rank-00042` -> 42).
pub fn parse_rank_dir(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("rank-")?;
    (digits.len() == 5 && digits.bytes().all(|b| b.is_ascii_digit())).then(|| digits.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn area_names_round_trip() {
        let m = area_manifest_key(42, 7);
        assert_eq!(m, format!("ranks/{}/rank-00007/step-000000000042.manifest.json", rank_prefix(7)));
        let d = area_data_key(42, 7, "00ff");
        let last = |k: &str| k.rsplit('/').next().unwrap().to_string();
        assert_eq!(parse_area_name(&last(&m)), Some(AreaEntry::Manifest(42)));
        assert_eq!(parse_area_name(&last(&d)), Some(AreaEntry::Data(42)));
        for other in ["step-000000000042.manifest.json.tmp-1-0", "step-42.manifest.json", "step-000000000042..data", "COMMIT"] {
            assert_eq!(parse_area_name(other), None, "{other}");
        }
        assert_eq!(parse_rank_dir("rank-00007"), Some(7));
        assert_eq!(parse_rank_dir("rank-7"), None);
        assert_ne!(unique_token(), unique_token());
    }
}
