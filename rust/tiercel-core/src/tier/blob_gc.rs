//! gc of a blob tier (`tiercel gc`, `Store::gc`): the step rule of `crate::gc` over the step
//! directories (commit records; whole directories of steps in the layout of versions 1-2),
//! then a mark-and-sweep of every rank area (ranks of an older world size too).
//!
//! Marked (kept): every manifest of a committed step that stays (this job's kept steps and
//! other jobs' steps alike), of a step newer than the newest committed one (a save in
//! flight), and each area's newest manifest where it is not older than the newest committed
//! step (what a live writer's next save refers to: an area of ranks an earlier, larger job
//! had is swept whole); then
//! every data object a marked manifest refers to, and every data object of a step newer than
//! the newest committed one (written before its manifest). Everything else in the areas goes:
//! manifests of steps that are gone, data objects of killed saves and of removed steps.
//!
//! The plan is made from listings taken when the gc starts, and a run removes only what its
//! plan lists: an object written after the gc started is never removed. The retention run
//! after a save (no `temp_age`) removes commit records only: each rank's sweep of its own
//! area (`areas::sweep`) removes the rest, O(1) requests per rank and step.
//!
//! A run removes commit records first, then manifests, then data objects: killed at any
//! point it leaves every step that still has its commit record restorable.

use std::collections::BTreeSet;

use super::blob::BlobTier;
use super::layout::StepLayout;
use crate::error::{ErrorKind, Result};
use crate::format::{self, AreaEntry};
use crate::gc::{self, GcOptions, Removal, Target};

/// Why a manifest goes.
pub const GONE_MANIFEST: &str = "manifest of a step that is gone (removed, or never committed)";
/// Why a data object goes.
pub const UNREFERENCED: &str = "data object that no kept manifest refers to";

pub fn plan(tier: &BlobTier, opts: &GcOptions) -> Result<Vec<Removal>> {
    let layout = &tier.layout;
    let listed = match &opts.listed {
        Some(l) => l.clone(),
        None => layout.list_steps()?,
    };
    let mut plan = layout.gc_plan(&GcOptions { listed: Some(listed.clone()), ..opts.clone() })?;
    // The retention run after a save stops here (each rank sweeps its own area); so does a
    // tier without rank areas.
    let has_areas = listed.names.as_ref().is_none_or(|n| n.iter().any(|n| n == format::AREAS));
    if opts.temp_age.is_none() || !has_areas {
        return Ok(plan);
    }
    let removed: BTreeSet<u64> = gc::steps_of(&plan).into_iter().collect();
    let kept: BTreeSet<u64> = listed.committed.iter().copied().filter(|s| !removed.contains(s)).collect();
    let newest = listed.committed.last().copied();
    plan.extend(sweep_areas(layout, &kept, newest)?);
    Ok(plan)
}

/// The removals of every rank area, given the committed steps that stay and the newest
/// committed step (before the step rule ran).
fn sweep_areas(layout: &StepLayout, kept: &BTreeSet<u64>, newest: Option<u64>) -> Result<Vec<Removal>> {
    let in_flight = |s: u64| newest.is_none_or(|n| s > n);
    let blobs = layout.blobs();
    let mut out = vec![];
    for dir in layout.rank_areas()? {
        let Some(rank) = format::parse_rank_dir(dir.rsplit('/').next().unwrap_or("")) else { continue };
        let mut manifests = BTreeSet::new();
        let mut data = vec![];
        for n in blobs.list(&dir)? {
            match format::parse_area_name(&n) {
                Some(AreaEntry::Manifest(s)) => {
                    manifests.insert(s);
                }
                Some(AreaEntry::Data(s)) => data.push((s, format!("{dir}/{n}"))),
                None => {}
            }
        }
        let newest_here = manifests.last().copied();
        let (marked, gone): (Vec<u64>, Vec<u64>) = manifests
            .iter()
            .partition(|&&s| kept.contains(&s) || in_flight(s) || (Some(s) == newest_here && newest.is_none_or(|n| s >= n)));
        let mut referenced = BTreeSet::new();
        let mut complete = true;
        for &s in &marked {
            match layout.read_manifest_in_area(s, rank) {
                Ok(m) => referenced.extend(super::areas::object_keys(&m)),
                Err(e) if e.kind == ErrorKind::NotFound => {}
                Err(e) => {
                    log::warn!("{e}: rank {rank}'s area keeps every data object until its manifest of step {s} can be read");
                    complete = false;
                }
            }
        }
        for s in gone {
            let key = format::area_manifest_key(s, rank);
            out.push(Removal::new(Target::Object { key, bytes: None }, format!("rank {rank}'s {GONE_MANIFEST} (step {s})")));
        }
        if complete {
            for (s, key) in data {
                if !in_flight(s) && !referenced.contains(&key) {
                    out.push(Removal::new(Target::Object { key, bytes: None }, format!("rank {rank}'s {UNREFERENCED} (step {s})")));
                }
            }
        }
    }
    Ok(out)
}

/// Removes what `plan` lists: commit records and old-layout steps and leftovers first, then
/// manifests, then data objects, each group in one batched delete.
pub fn apply(tier: &BlobTier, plan: Vec<Removal>) -> Result<Vec<Removal>> {
    let (objects, rest): (Vec<_>, Vec<_>) = plan.into_iter().partition(|r| matches!(r.target, Target::Object { .. }));
    let mut done = tier.layout.gc_apply(rest)?;
    let (manifests, data): (Vec<_>, Vec<_>) = objects.into_iter().partition(|r| r.key().is_some_and(|k| k.ends_with(".manifest.json")));
    for group in [manifests, data] {
        let names: Vec<String> = group.iter().filter_map(|r| r.key().map(String::from)).collect();
        if names.is_empty() {
            continue;
        }
        crate::failpoint::hit("gc");
        tier.blobs().delete_names(&names)?;
        done.extend(group);
    }
    Ok(done)
}
