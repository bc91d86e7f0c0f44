use std::collections::BTreeMap;
use std::time::Duration;

use super::store::{Req, SimOptions};
use super::*;

fn fast(ranks: u32) -> SimConfig {
    SimConfig { ranks, store: SimOptions { latency: Duration::from_millis(1), ..Default::default() }, ..Default::default() }
}

/// The counted commit, ranks one after another (deterministic counts), in the version-3
/// layout, keep 1, so rank N - 1 commits every step.
///
/// A step of fresh processes costs 3N + 4: each rank's one LIST of its area before its first
/// write (once per process: what an earlier process left; empty, so there is nothing to take
/// back and no uncommit DELETE goes to the step's prefix), its data and manifest; its sweep
/// then has nothing to look at; then the commit record and the committer's retention (a
/// LIST of the root, a HEAD of the one step there, a GET of its record).
///
/// In the steady state a rank's sweep lists nothing and sends no HEAD: it knows its area,
/// and asks the counter about two commits (`store::records`: step s - 1 still committed, its
/// manifest stays; step s - 2 removed by the last retention), then deletes that step's
/// manifest and data object in one DeleteObjects. Each rank: data, manifest, 1 DeleteObjects.
/// The committer: its record, and retention: a LIST of the root, a HEAD per step there
/// (K + 1), a GET of the new record, the removed step's `COMMIT` DELETE and a LIST of its
/// prefix (`delete_step` removes the prefix always). The committer's own sweep runs right
/// after its retention removed step s - 1, which it has seen committed and so does not look
/// at: in one step it looks at nothing and deletes nothing (3N + 6 in all), in the next it
/// finds two steps gone (3 counter reads, 1 DeleteObjects: 3N + 7), as (P + 2)·N + K + 5 and
/// a half (docs/scale.md). No LIST of the new step, no manifest read, no HEAD on a step's
/// prefix but retention's. On the counter: N adds and the key's delete, the commit's record,
/// retention's read and record of the step it removes, 2 reads a sweeping rank, and from
/// step 5 the delete of step s - 4's record.
#[test]
fn requests_per_step_follow_the_formula() {
    let n = 8u64;
    let steps = run(&SimConfig { sequential: true, protocol: Protocol::Counter, steps: 4, ..fast(n as u32) });
    for s in &steps {
        assert_eq!(s.failed, 0, "step {}: {:?}", s.step, s.errors);
        assert!(s.commit_delay.is_some(), "step {} did not commit", s.step);
        assert_eq!(s.sweep_failures, 0);
    }
    let first: BTreeMap<(Req, &str), u64> = [
        ((Req::Put, "data"), n),
        ((Req::Put, "manifest"), n),
        ((Req::List, "area"), n),
        ((Req::Put, "commit"), 1),
        ((Req::List, "root"), 1),
        ((Req::Head, "commit"), 1),
        ((Req::Get, "commit"), 1),
    ]
    .into_iter()
    .collect();
    assert_eq!(steps[0].tally.requests, first);
    assert_eq!(steps[0].tally.total(), 3 * n + 4);
    assert_eq!(steps[0].counter_ops, n + 2, "N adds, the key's delete, the commit's record");
    // Steps 3 and 4: the committer's sweep idle, then catching up.
    for (s, committer_reads, committer_deletes) in [(&steps[2], 0, 0), (&steps[3], 3, 1)] {
        let steady: BTreeMap<(Req, &str), u64> = [
            ((Req::Put, "data"), n),
            ((Req::Put, "manifest"), n),
            // The committer's retention: K + 1; no sweep's.
            ((Req::Head, "commit"), 2),
            // One DeleteObjects a sweeping rank (its first key: the removed step's manifest).
            ((Req::Post, "manifest"), n - 1 + committer_deletes),
            ((Req::Put, "commit"), 1),
            ((Req::List, "root"), 1),
            ((Req::Get, "commit"), 1),
            ((Req::Delete, "commit"), 1),
            ((Req::List, "step"), 1),
        ]
        .into_iter()
        .collect();
        assert_eq!(s.tally.requests, steady, "step {}", s.step);
        assert_eq!(s.tally.slowdowns, 0);
        assert_eq!(s.counter_ops, n + 4 + 2 * (n - 1) + committer_reads, "step {}", s.step);
    }
    assert_eq!(steps[2].tally.total(), 3 * n + 6);
    assert_eq!(steps[3].tally.total(), 3 * n + 7);
}

/// Without a counter (`Protocol::ListAll`, ranks one after another): the step's directory
/// holds only its commit record in version 3, so each rank's commit attempt LISTs it and
/// reads the manifests in rank order until one is missing, and the last reads all N:
/// N(N + 3)/2 - 1 manifest GETs a step, quadratic in N (the counted commit reads none). From
/// step 2 on, the retention that removes the step before (keep 1) LISTs that step's prefix
/// once more (`delete_step` removes the prefix always): N + 1 LISTs of step directories.
#[test]
fn the_commit_without_a_counter_reads_manifests_up_to_the_first_missing_one() {
    let n = 8u64;
    let steps = run(&SimConfig { sequential: true, steps: 3, ..fast(n as u32) });
    for s in &steps {
        assert_eq!(s.failed, 0, "step {}: {:?}", s.step, s.errors);
        assert!(s.commit_delay.is_some(), "step {} did not commit", s.step);
        assert_eq!(s.tally.of(Req::Get, "manifest"), n * (n + 3) / 2 - 1, "step {}: {:?}", s.step, s.tally.requests);
        let removed = u64::from(s.step > 1);
        assert_eq!(s.tally.of(Req::List, "step"), n + removed, "step {}: one LIST of the step a rank, one of the removed step", s.step);
    }
}

/// All ranks at once against prefixes that admit 20 writes a second, every rank's area on
/// one of them (`prefix_depth` 1: all of `ranks/` is one prefix): the store answers 503s,
/// the client's retries get every save through, and every step commits.
#[test]
fn slowdowns_are_answered_and_retried() {
    let mut cfg = fast(16);
    cfg.store.write_rate = 20.0;
    cfg.store.prefix_depth = 1;
    cfg.steps = 2;
    let steps = run(&cfg);
    for s in &steps {
        assert_eq!(s.failed, 0, "step {}: {:?}", s.step, s.errors);
        assert!(s.commit_delay.is_some(), "step {} did not commit", s.step);
    }
    assert!(steps.iter().map(|s| s.tally.slowdowns).sum::<u64>() > 0, "no 503 at 32 writes against 20 a second");
    // Arrivals count refused requests too: the demand, above what the prefix admits.
    assert!(steps[0].tally.peak_writes.0 > 20, "{:?}", steps[0].tally.peak_writes);
}

/// All 64 ranks at once with the counted commit: the commit lists nothing and reads no
/// manifest, whichever rank counts last. Each rank lists its own area once, in its first
/// step; after that the step's only LISTs are the committer's retention (the root, and the
/// prefix of the step it removes), and each rank's sweep asks the counter about the two steps
/// before: no sweep reads a step's prefix (before the counter kept commit records: N HEADs
/// on each of those two prefixes, the busiest reads of a step at N = 10,000).
#[test]
fn the_counted_commit_lists_nothing_when_ranks_race() {
    let n = 64u64;
    let steps = run(&SimConfig { protocol: Protocol::Counter, steps: 3, ..fast(n as u32) });
    assert_eq!(steps[0].tally.of(Req::List, "area"), n, "{:?}", steps[0].tally.requests);
    let s = &steps[2];
    assert_eq!(s.failed, 0, "{:?}", s.errors);
    assert_eq!(s.tally.of(Req::Get, "manifest"), 0);
    assert_eq!(s.tally.of(Req::List, "area"), 0, "{:?}", s.tally.requests);
    assert_eq!(s.tally.of(Req::List, "root"), 1, "{:?}", s.tally.requests);
    assert_eq!(s.tally.of(Req::List, "step"), 1, "{:?}", s.tally.requests);
    for before in [1, 2] {
        // Retention's: a HEAD of step s - 1's record, and a GET of it where the committer
        // did not commit that one.
        let reads = s.tally.reads_by_prefix.get(&format::step_dir(s.step - before)).copied().unwrap_or(0);
        assert!(reads <= 3, "step {}'s prefix: {reads} reads ({:?})", s.step - before, s.tally.requests);
    }
    assert_eq!(s.tally.of(Req::Head, "commit"), 2, "retention's K + 1 HEADs, no sweep's: {:?}", s.tally.requests);
    // As in the steady state above (3N + 6 to 3N + 7, by what the committer's sweep finds);
    // the committer reads the record of an earlier step too when it did not commit that one.
    assert!((3 * n + 5..=3 * n + 8).contains(&s.tally.total()), "{:?}", s.tally.requests);
    assert!(s.commit_delay.is_some());
}

/// 64 ranks at once against prefixes that admit 100 writes a second (and hold a second's
/// worth), every area on one (`prefix_depth` 1): no step's busiest prefix admits more than
/// 100 + 100 per second of the step.
#[test]
fn a_prefix_admits_no_more_than_its_rate() {
    let mut cfg = SimConfig { protocol: Protocol::Counter, steps: 2, ..fast(64) };
    cfg.store.write_rate = 100.0;
    cfg.store.prefix_depth = 1;
    for s in run(&cfg) {
        let bound = 100.0 * (1.0 + s.wall.as_secs_f64());
        assert!((s.tally.admitted.0 as f64) <= bound, "step {}: {} writes admitted in {:?}", s.step, s.tally.admitted.0, s.wall);
        assert!(s.tally.admitted.0 > 100, "step {}: {:?}", s.step, s.tally.admitted);
    }
}

/// `delete_names` costs what `ObjectBlobs` sends for it: one DeleteObjects per 1,000 names,
/// no LIST, whatever directories the names are in.
#[test]
fn deleting_by_name_is_one_bulk_request_per_thousand_keys() {
    use crate::blobs::Blobs;
    let blobs = store::SimBlobs::new(SimOptions { latency: Duration::ZERO, ..Default::default() });
    let names: Vec<String> = (0..2500).map(|i| format!("{:02x}/rank-{i:05}/x.data", i % 256)).collect();
    for n in &names {
        blobs.put(n, b"x").unwrap();
    }
    blobs.put("kept", b"k").unwrap();
    blobs.take_tally();
    blobs.delete_names(&names).unwrap();
    let t = blobs.take_tally();
    assert_eq!(t.requests, [((Req::Post, "data"), 3)].into_iter().collect::<BTreeMap<_, _>>());
    assert_eq!(blobs.keys(), vec!["kept".to_string()]);
}

/// A key's prefix, for the rates, is its first two '/'-separated parts (or its directory
/// where it has fewer); a listing's, the listed prefix cut the same way.
#[test]
fn prefixes_are_cut_at_the_second_slash() {
    use store::prefix_of;
    for (key, listing, want) in [
        ("step-000000000001/rank-00001.data", false, "step-000000000001"),
        ("step-000000000001/COMMIT", false, "step-000000000001"),
        ("COMMIT", false, ""),
        ("3f/rank-00001/step-000000000001/x.data", false, "3f/rank-00001"),
        ("3f/x.data", false, "3f"),
        ("", true, ""),
        ("step-000000000001", true, "step-000000000001"),
        ("3f/rank-00001/step-000000000001", true, "3f/rank-00001"),
    ] {
        assert_eq!(prefix_of(key, 2, listing), want, "{key} (listing: {listing})");
    }
}

/// Where one step's writes land: (prefixes written, writes on the busiest, writes in all).
fn spread(s: &StepReport) -> (usize, u64, u64) {
    let w = &s.tally.writes_by_prefix;
    (w.len(), w.values().copied().max().unwrap_or(0), w.values().sum())
}

/// 256 ranks save one step (the counted commit). In the layout before version 3 every rank
/// wrote its objects into `step-<12>/`, and this test found one prefix taking every write of
/// the step (what made 10,000 ranks fail on S3's 3,500 writes a second: docs/scale.md).
/// Version 3 puts each rank's objects in its area under `ranks/<rank_prefix>/`: the writes
/// spread over most of the 256 prefixes, none takes more than a few ranks' worth, and the
/// step's directory gets its commit record alone.
#[test]
fn one_steps_writes_spread_over_the_rank_prefixes() {
    let n = 256;
    let steps = run(&SimConfig { sequential: true, protocol: Protocol::Counter, steps: 2, ..fast(n) });
    // The first step of fresh processes: each rank listed its area before writing, found no
    // manifest of the step, and so sent no uncommit DELETE to the step's prefix (before, N
    // DELETEs of a `COMMIT` that could not be there: the one write hot spot left).
    let first = &steps[0].tally.writes_by_prefix;
    assert_eq!(first.get(&format::step_dir(1)), Some(&1), "a fresh launch's first step writes only COMMIT to the step's prefix: {first:?}");
    let s = &steps[1];
    assert_eq!(s.failed, 0, "{:?}", s.errors);
    let (prefixes, busiest, total) = spread(s);
    let w = &s.tally.writes_by_prefix;
    assert!(total >= 2 * u64::from(n), "{w:?}");
    assert!(prefixes >= 128, "{prefixes} prefixes: {w:?}");
    assert!(busiest <= total / 16, "the busiest prefix took {busiest} of {total} writes: {w:?}");
    assert_eq!(w.get(&format::step_dir(2)), Some(&1), "the step's directory: its commit record only ({w:?})");
    // Every rank's area is in one of the 256: rank_prefix's two hex digits.
    for p in w.keys().filter(|p| p.starts_with(format::AREAS)) {
        let hex = p.strip_prefix(&format!("{}/", format::AREAS)).unwrap_or("");
        assert!(hex.len() == 2 && hex.bytes().all(|b| b.is_ascii_hexdigit()), "{p}");
    }
}

/// A relaunch (fresh processes over the same store) that saves a step its ranks hold a
/// manifest of already takes that save back first (`COMMIT` and the rank's manifest), and a
/// save of a step it holds none of sends nothing to the step's prefix: the listing before a
/// process's first write tells them apart, at one LIST per rank area.
#[test]
fn a_relaunch_takes_back_only_the_steps_it_holds() {
    let blobs = store::SimBlobs::new(SimOptions { latency: Duration::ZERO, ..Default::default() });
    let shared: Arc<dyn crate::blobs::Blobs> = Arc::new(blobs.clone());
    let link = Link::new("sim", None);
    let save = |tier: &BlobTier, step: u64| {
        let (m, src) = logical(step, 0, 1, 64);
        tier.write_rank(&m, &src, &link).unwrap();
        tier.commit_counted(step, 1, &m.generation).unwrap();
    };
    save(&BlobTier::new("sim", shared.clone(), Compression::none()), 1);
    blobs.take_tally();
    let relaunch = BlobTier::new("sim", shared.clone(), Compression::none());
    save(&relaunch, 1);
    let t = blobs.take_tally();
    assert_eq!(t.of(Req::List, "area"), 1, "{:?}", t.requests);
    assert_eq!(t.of(Req::Delete, "commit"), 1, "the step held: taken back first ({:?})", t.requests);
    assert_eq!(t.of(Req::Delete, "manifest"), 1, "{:?}", t.requests);
    save(&relaunch, 2);
    let t = blobs.take_tally();
    assert_eq!(t.of(Req::List, "area") + t.of(Req::Delete, "commit") + t.of(Req::Delete, "manifest"), 0, "{:?}", t.requests);
}

/// The counter's commit records (`store::records`) replace a sweep's HEAD only where they
/// know: a commit never recorded (its committer killed between `COMMIT` and the record, a
/// step of an earlier launch) is looked at on the tier, a recorded one is not; retention
/// records as removed only the commits recorded before it removed them.
#[test]
fn a_sweep_heads_a_record_only_where_the_counter_cannot_know() {
    use crate::gc::GcOptions;
    use crate::store::records::Records;
    use crate::store::LocalCounter;
    let blobs = store::SimBlobs::new(SimOptions { latency: Duration::ZERO, ..Default::default() });
    let shared: Arc<dyn crate::blobs::Blobs> = Arc::new(blobs.clone());
    let counter = LocalCounter::default();
    let records = Records { counter: &counter, launch: "sim", tier: "sim" };
    let tier = BlobTier::new("sim", shared, Compression::none());
    let link = Link::new("sim", None);
    let save = |step: u64, record: bool| {
        let (m, src) = logical(step, 0, 1, 64);
        tier.write_rank(&m, &src, &link).unwrap();
        tier.commit_counted(step, 1, &m.generation).unwrap();
        if record {
            records.committed(step, &generation_of(step));
        }
    };
    let known = |t: u64| records.state(t, &generation_of(t));
    save(1, false); // the committer died before its record
    save(2, true);
    blobs.take_tally();
    tier.sweep_rank(0, Some(1), &known).unwrap();
    assert_eq!(blobs.take_tally().of(Req::Head, "commit"), 1, "step 1: not recorded, so looked at");
    let keep1 = GcOptions { keep: Some(1), ..Default::default() };
    records.retain(&tier, &keep1, &|s| vec![generation_of(s)]).unwrap();
    assert_eq!(known(1), None, "a removal of a commit never recorded is not recorded either");
    assert_eq!(known(2), Some(true));
    save(3, true);
    records.retain(&tier, &keep1, &|s| vec![generation_of(s)]).unwrap();
    assert_eq!(known(2), Some(false), "recorded, then removed");
    save(4, true);
    blobs.take_tally();
    let swept = tier.sweep_rank(0, Some(1), &known).unwrap();
    // Steps 3 (committed) and 2 (removed) as recorded; step 1 from its record (gone).
    assert_eq!(blobs.take_tally().of(Req::Head, "commit"), 1, "only the commit never recorded is looked at");
    assert_eq!(swept.manifests, vec![1, 2]);
}
