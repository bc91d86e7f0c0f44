use std::collections::BTreeMap;
use std::time::Duration;

use super::store::{Req, SimOptions};
use super::*;

fn fast(ranks: u32) -> SimConfig {
    SimConfig { ranks, store: SimOptions { latency: Duration::from_millis(1), ..Default::default() }, ..Default::default() }
}

/// Ranks one after another, in the steady state (step 3, keep 1: each step removes the one
/// before), each running retention as before issue 34: the requests are exactly
/// 10N + 4 per step (docs/scale.md), and the last rank alone reads every manifest.
#[test]
fn requests_per_step_follow_the_formula() {
    let n = 8u64;
    let cfg = SimConfig { sequential: true, ..fast(n as u32) };
    let steps = run(&cfg);
    let s = &steps[2];
    assert_eq!(s.failed, 0, "{:?}", s.errors);
    let want: BTreeMap<(Req, &str), u64> = [
        ((Req::Put, "data"), n),
        ((Req::Put, "manifest"), n),
        ((Req::Put, "commit"), 1),
        // Each rank's uncommit, then the retention that removes step 2.
        ((Req::Delete, "commit"), n + 1),
        ((Req::Delete, "manifest"), n),
        // Each rank's commit attempt, then the removal's recursive listing and DeleteObjects.
        ((Req::List, "step"), n + 1),
        ((Req::Post, "step"), 1),
        // The last rank sees every manifest and reads them all (the generation rule).
        ((Req::Get, "manifest"), n),
        // Each process reads each committed step's record once (`Store::other_job`).
        ((Req::Get, "commit"), n),
        // Each rank's retention: one LIST of the root and a HEAD per step there (2).
        ((Req::Head, "commit"), 2 * n),
        ((Req::List, "root"), n),
    ]
    .into_iter()
    .collect();
    assert_eq!(s.tally.requests, want);
    assert_eq!(s.tally.total(), 10 * n + 4);
    assert_eq!(s.tally.slowdowns, 0);
    assert!(s.commit_delay.is_some(), "step 3 did not commit");
}

/// All ranks at once against a prefix that admits 20 writes a second: the store answers
/// 503s, the client's retries get every save through, and every step commits.
#[test]
fn slowdowns_are_answered_and_retried() {
    let mut cfg = fast(8);
    cfg.store.write_rate = 20.0;
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

/// The counted commit, ranks one after another: 4 requests per rank (its uncommit's two
/// DELETEs, its data and its manifest), then one commit record and one rank's retention:
/// 4N + 8 per step, no LIST of the step and no manifest read; N adds and one delete on the
/// counter.
#[test]
fn the_counted_commit_costs_each_rank_its_own_objects_only() {
    let n = 8u64;
    let steps = run(&SimConfig { sequential: true, protocol: Protocol::Counter, ..fast(n as u32) });
    let s = &steps[2];
    assert_eq!(s.failed, 0, "{:?}", s.errors);
    let want: BTreeMap<(Req, &str), u64> = [
        ((Req::Put, "data"), n),
        ((Req::Put, "manifest"), n),
        ((Req::Put, "commit"), 1),
        ((Req::Delete, "commit"), n + 1),
        ((Req::Delete, "manifest"), n),
        // The committer's retention: steps 2 and 3 present, step 2 removed.
        ((Req::List, "step"), 1),
        ((Req::Post, "step"), 1),
        ((Req::Get, "commit"), 1),
        ((Req::Head, "commit"), 2),
        ((Req::List, "root"), 1),
    ]
    .into_iter()
    .collect();
    assert_eq!(s.tally.requests, want);
    assert_eq!(s.tally.total(), 4 * n + 8);
    assert_eq!(s.counter_ops, n + 1);
    assert!(s.commit_delay.is_some(), "step 3 did not commit");
}

/// All 64 ranks at once with the counted commit: still no LIST of the step but retention's
/// and no manifest read, whichever rank counts last.
#[test]
fn the_counted_commit_lists_nothing_when_ranks_race() {
    let n = 64u64;
    let steps = run(&SimConfig { protocol: Protocol::Counter, steps: 2, ..fast(n as u32) });
    let s = &steps[1];
    assert_eq!(s.failed, 0, "{:?}", s.errors);
    assert_eq!(s.tally.of(Req::Get, "manifest"), 0);
    assert_eq!(s.tally.of(Req::List, "step"), 1, "{:?}", s.tally.requests);
    // The committer reads step 2's record, and step 1's too when it did not commit step 1.
    assert!((4 * n + 8..=4 * n + 9).contains(&s.tally.total()), "{:?}", s.tally.requests);
    assert!(s.commit_delay.is_some());
}

/// 64 ranks at once against a prefix that admits 100 writes a second (and holds a second's
/// worth): no step's busiest prefix admits more than 100 + 100 per second of the step.
#[test]
fn a_prefix_admits_no_more_than_its_rate() {
    let mut cfg = SimConfig { protocol: Protocol::Counter, steps: 2, ..fast(64) };
    cfg.store.write_rate = 100.0;
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
/// writes its objects into `step-<12>/`: one prefix takes every write of the step, which is
/// what made 10,000 ranks fail on S3's 3,500 writes a second (docs/scale.md).
#[test]
fn one_steps_writes_land_on_one_prefix_in_the_step_layout() {
    let steps = run(&SimConfig { sequential: true, protocol: Protocol::Counter, steps: 1, ..fast(256) });
    let s = &steps[0];
    assert_eq!(s.failed, 0, "{:?}", s.errors);
    let (prefixes, busiest, total) = spread(s);
    assert!(total >= 2 * 256, "{:?}", s.tally.writes_by_prefix);
    assert_eq!((prefixes, busiest), (1, total), "{:?}", s.tally.writes_by_prefix);
    assert_eq!(s.tally.peak_writes.1, format::step_dir(1));
}
