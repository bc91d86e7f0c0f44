//! Replicated items: ranks of a replica group (data-parallel copies) that hold identical
//! bytes. Persistent tiers store such an item once, in the group's primary rank's data; the
//! other ranks' manifests keep its chunk table (offsets, lengths, checksums) and mark it
//! `shared`. A reader links a shared item to the primary's stored chunks (`resolve`), and the
//! commit of a step checks that every shared item's checksums equal the primary's
//! (`check_copies`): a rank whose "replicated" data differs is an error naming the rank and
//! the item, never a silently dropped copy.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::format::{Manifest, SHARED_VERSION};
use crate::tier::Tier;

/// What a persistent tier stores for `logical`: its replicated items of which this rank is
/// not the primary become shared (stored by the primary only).
pub fn share(logical: &Manifest) -> Manifest {
    let mut out = logical.clone();
    let mut any = false;
    for it in &mut out.items {
        if let Some(r) = it.replica.as_mut() {
            r.shared = r.primary != logical.rank;
            any |= r.shared;
        }
    }
    if any {
        // Readers that do not know shared items must refuse the manifest, not misread it.
        out.version = SHARED_VERSION;
    }
    out
}

/// The primaries `m`'s shared items are stored by.
fn primaries(m: &Manifest) -> Vec<u32> {
    let mut v: Vec<u32> = m.items.iter().filter_map(|i| i.replica.as_ref().filter(|r| r.shared).map(|r| r.primary)).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Points `m`'s shared items of `primary`'s group at the primary's stored chunks (its objects
/// are added to `m`'s), after checking that both copies have the same chunk table. An item
/// that differs is an integrity error naming both ranks and the item.
pub fn link_shared(m: &mut Manifest, primary: &Manifest) -> Result<()> {
    let mut objects: HashMap<u32, u32> = HashMap::new();
    for i in 0..m.items.len() {
        let Some(r) = m.items[i].replica.clone().filter(|r| r.shared && r.primary == primary.rank) else { continue };
        let it = &m.items[i];
        let theirs = primary.item_index(&it.name).map(|j| &primary.items[j]);
        differs(m, i, theirs).map_err(|why| {
            let cause = if r.matched {
                "the ranks found to hold the same bytes when they saved hold other bytes here: the primary's manifest is of \
                 another save, or was changed since"
            } else {
                "the ranks declared as replicas (replica_group) did not save the same bytes"
            };
            Error::integrity(format!(
                "step {}: rank {}'s replicated item '{}' differs from rank {}'s copy ({why}); {cause}",
                m.step, m.rank, it.name, r.primary
            ))
            .at(m.step, m.rank)
            .with_item(&it.name)
        })?;
        let theirs = theirs.expect("checked by differs");
        let mut chunks = theirs.chunks.clone();
        for c in &mut chunks {
            let next = m.objects.len() as u32;
            let idx = *objects.entry(c.object).or_insert_with(|| {
                let o = &primary.objects[c.object as usize];
                m.objects.push(o.clone());
                next
            });
            c.object = idx;
        }
        let it = &mut m.items[i];
        it.chunks = chunks;
        // Located now: a copy of this manifest to another tier shares it again (`share`).
        it.replica.as_mut().expect("replicated").shared = false;
    }
    Ok(())
}

/// Why item `i` of `m` is not the same as `theirs` (the primary's item of that name).
fn differs(m: &Manifest, i: usize, theirs: Option<&crate::format::ItemMeta>) -> std::result::Result<(), String> {
    let it = &m.items[i];
    let Some(t) = theirs else { return Err("the primary has no item of that name".into()) };
    if (t.nbytes, &t.dtype, &t.shape) != (it.nbytes, &it.dtype, &it.shape) {
        return Err(format!("{} {:?} {} bytes here, {} {:?} {} bytes there", it.dtype, it.shape, it.nbytes, t.dtype, t.shape, t.nbytes));
    }
    if t.chunks.len() != it.chunks.len() {
        return Err(format!("{} chunks here, {} there", it.chunks.len(), t.chunks.len()));
    }
    for (c, (a, b)) in it.chunks.iter().zip(&t.chunks).enumerate() {
        if (a.offset, a.len) != (b.offset, b.len) {
            return Err(format!("chunk {c} covers different bytes"));
        }
        if a.crc32c != b.crc32c {
            return Err(format!(
                "chunk {c} (bytes {}..{}): checksum {:08x} here, {:08x} there",
                a.offset,
                a.offset + a.len,
                a.crc32c,
                b.crc32c
            ));
        }
    }
    Ok(())
}

/// `m` (read from `tier`) with its shared items linked to their primaries' stored chunks.
pub fn resolve(tier: &dyn Tier, mut m: Manifest) -> Result<Manifest> {
    for p in primaries(&m) {
        let primary = tier
            .read_manifest(m.step, p)
            .map_err(|e| e.context(format!("rank {}'s replicated items are stored by rank {p}, whose manifest cannot be read", m.rank)))?;
        link_shared(&mut m, &primary)?;
    }
    Ok(m)
}

/// Before `step` commits on `tier`: every rank's shared items match their primary's copy.
/// Reads each manifest once (the primaries' are cached).
pub fn check_copies(tier: &dyn Tier, step: u64, ranks: &[u32]) -> Result<()> {
    let mut cache: HashMap<u32, Manifest> = HashMap::new();
    for &r in ranks {
        let m = tier.read_manifest(step, r)?;
        for p in primaries(&m) {
            if let std::collections::hash_map::Entry::Vacant(e) = cache.entry(p) {
                e.insert(tier.read_manifest(step, p)?);
            }
            link_shared(&mut m.clone(), &cache[&p]).map_err(|e| e.with_tier(tier.name()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{ChunkMeta, ItemMeta, Replica};

    fn manifest(rank: u32, crc: u32) -> Manifest {
        let mut m = Manifest::new(3, rank, 2, "disk", 4);
        m.objects.push(crate::format::ObjectMeta { name: crate::format::data_name(rank), len: 8, key: None });
        m.items.push(ItemMeta {
            name: "model/w".into(),
            kind: "array".into(),
            dtype: "uint8".into(),
            shape: vec![8],
            nbytes: 8,
            meta: serde_json::Value::Null,
            shard: None,
            replica: Some(Replica { primary: 0, shared: false, matched: false }),
            chunks: (0..2)
                .map(|c| ChunkMeta {
                    offset: c * 4,
                    len: 4,
                    crc32c: crc + c as u32,
                    object: 0,
                    stored_offset: c * 4,
                    stored_len: 4,
                    codec: "raw".into(),
                    hash: None,
                })
                .collect(),
        });
        m
    }

    #[test]
    fn a_shared_item_reads_the_primarys_chunks() {
        let primary = share(&manifest(0, 7));
        assert_eq!(primary.version, crate::format::PLAIN_VERSION, "the primary stores its own bytes");
        let stored = share(&manifest(1, 7));
        assert!(stored.items[0].replica.as_ref().unwrap().shared);
        // Round trip through the stored form: a shared item's chunk table is checked as a table only.
        let mut m = Manifest::from_json(&stored.to_json(), "x").unwrap();
        link_shared(&mut m, &primary).unwrap();
        let c = &m.items[0].chunks[1];
        assert_eq!(m.objects[c.object as usize].name, crate::format::data_name(0));
        assert!(!m.items[0].replica.as_ref().unwrap().shared);
    }

    #[test]
    fn a_copy_that_differs_names_rank_and_item() {
        let primary = share(&manifest(0, 7));
        let mut m = share(&manifest(1, 9));
        let e = link_shared(&mut m, &primary).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Integrity);
        assert!(e.message.contains("rank 1's replicated item 'model/w' differs from rank 0's"), "{}", e.message);
        assert!(e.message.contains("chunk 0"), "{}", e.message);
        assert!(e.message.contains("declared as replicas"), "{}", e.message);
        // A copy matched by content, not declared, says so.
        let mut m = manifest(1, 9);
        m.items[0].replica = Some(Replica { primary: 0, shared: false, matched: true });
        let e = link_shared(&mut share(&m), &primary).unwrap_err();
        assert!(e.message.contains("found to hold the same bytes"), "{}", e.message);
    }

    #[test]
    fn old_readers_refuse_shared_items_and_old_manifests_still_read() {
        let mut m = share(&manifest(1, 7));
        m.version = 1;
        assert!(Manifest::from_json(&m.to_json(), "x").is_err());
        let plain = manifest(1, 7);
        assert_eq!(plain.version, 1);
        Manifest::from_json(&plain.to_json(), "x").unwrap();
    }
}
