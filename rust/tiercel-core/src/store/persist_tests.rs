//! The persist plan: what one save does on each later tier, from plain facts.

use super::*;

fn tier(slot: usize, name: &str, every: u64) -> TierFacts {
    TierFacts { slot, name: name.into(), every, priority: Priority::Persist, degraded: None, learned: None }
}

fn actions(p: &PersistPlan) -> Vec<(&str, &PersistAction)> {
    p.tiers.iter().map(|t| (t.name.as_str(), &t.action)).collect()
}

fn queued(name: &str, order: u64) -> PersistAction {
    PersistAction::Queue {
        priority: Priority::Persist,
        supersede: Supersede { key: SupersedeKey::Persist { tier: name.into() }, order },
        learned: None,
    }
}

#[test]
fn every_picks_the_steps_each_tier_gets() {
    let facts = || vec![tier(1, "disk", 1), tier(2, "s3", 10)];
    let p = plan(20, 3, facts());
    assert_eq!(p.step, 20);
    assert_eq!(actions(&p), vec![("disk", &queued("disk", 3)), ("s3", &queued("s3", 3))]);
    let p = plan(7, 4, facts());
    assert_eq!(actions(&p), vec![("disk", &queued("disk", 4)), ("s3", &PersistAction::NotScheduled)]);
    // Step 0 is a multiple of every `every`.
    assert!(plan(0, 1, facts()).tiers.iter().all(|t| matches!(t.action, PersistAction::Queue { .. })));
    // Policy order and slots are kept, whatever each tier gets.
    assert_eq!(p.tiers.iter().map(|t| t.slot).collect::<Vec<_>>(), vec![1, 2]);
}

#[test]
fn a_degraded_tier_is_skipped_with_its_reason_on_the_steps_it_would_get() {
    let peer = TierFacts { degraded: Some("2 of 4 hosts answer".into()), ..tier(1, "peer", 2) };
    let facts = || vec![peer.clone(), tier(2, "disk", 1)];
    assert_eq!(
        actions(&plan(4, 1, facts())),
        vec![("peer", &PersistAction::Degraded("2 of 4 hosts answer".into())), ("disk", &queued("disk", 1))]
    );
    // A step that `every` does not select is not the tier's at all: no skip to count.
    assert_eq!(actions(&plan(5, 2, facts())), vec![("peer", &PersistAction::NotScheduled), ("disk", &queued("disk", 2))]);
}

#[test]
fn each_tier_supersedes_its_own_persists_in_save_order() {
    let peer = TierFacts { priority: Priority::Replicate, ..tier(1, "peer", 1) };
    let p = plan(6, 9, vec![peer, tier(2, "disk", 1)]);
    let keys: Vec<(&SupersedeKey, u64, Priority)> = p
        .tiers
        .iter()
        .map(|t| match &t.action {
            PersistAction::Queue { supersede, priority, .. } => (&supersede.key, supersede.order, *priority),
            other => panic!("{}: {other:?}", t.name),
        })
        .collect();
    assert_eq!(
        keys,
        vec![
            (&SupersedeKey::Persist { tier: "peer".into() }, 9, Priority::Replicate),
            (&SupersedeKey::Persist { tier: "disk".into() }, 9, Priority::Persist),
        ]
    );
}

#[test]
fn the_learned_interval_goes_with_the_queued_persist() {
    let learned = LearnedInterval { interval: 30, note: Some("a checkpoint takes 3 iterations' idle time".into()) };
    let s3 = TierFacts { learned: Some(learned.clone()), ..tier(1, "s3", 10) };
    let p = plan(30, 1, vec![s3.clone()]);
    match &p.tiers[0].action {
        PersistAction::Queue { learned: got, .. } => assert_eq!(got.as_ref(), Some(&learned)),
        other => panic!("{other:?}"),
    }
    // A step `every` passes by: the interval is not reported for it.
    assert_eq!(plan(31, 2, vec![s3.clone()]).tiers[0].action, PersistAction::NotScheduled);
    // A step `every` selects and the learned interval does not: thinned, with the interval.
    assert_eq!(plan(20, 3, vec![s3]).tiers[0].action, PersistAction::Thinned(learned));
}

#[test]
fn ranks_with_different_learned_intervals_persist_common_steps() {
    // Two ranks measured their links a little differently (intervals 4 and 8, both every 1
    // times a power of two): the steps both persist are every 8th, not none, as when each
    // rank's newer saves replaced its own queued ones.
    let rank = |interval: u64| {
        let learned = LearnedInterval { interval, note: None };
        let facts = TierFacts { learned: Some(learned), ..tier(1, "s3", 1) };
        (1..=32u64)
            .filter(|&s| matches!(plan(s, s, vec![facts.clone()]).tiers[0].action, PersistAction::Queue { .. }))
            .collect::<Vec<u64>>()
    };
    let (a, b) = (rank(4), rank(8));
    assert_eq!(a, vec![4, 8, 12, 16, 20, 24, 28, 32]);
    let both: Vec<u64> = a.iter().filter(|s| b.contains(s)).copied().collect();
    assert_eq!(both, vec![8, 16, 24, 32]);
}
