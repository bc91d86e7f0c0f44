//! Runs the conformance suites of `tiercel_core::testing` against every implementation: the
//! tier suite on memory, fs (each codec), s3 (moto, as `tests/servers.py` starts it), gcs
//! (a real bucket, when configured) and peer (two hosts on loopback); the `Blobs` suite on
//! fs, s3, gcs and the scale simulator's store. A kind whose server is not configured is reported as ignored, and the
//! reason is printed first: never a silent "ok".

use std::process::ExitCode;
use std::sync::Arc;

use libtest_mimic::{Arguments, Failed, Trial};
use tiercel_core::codec::Compression;
use tiercel_core::policy::TierKind;
use tiercel_core::testing::subjects::{self, BlobsSubject, TierSubject};
use tiercel_core::testing::{blobs, tiers, Case, Rules};

/// One implementation: its name, its rules, what it needs to run (None: it runs), and how
/// to make a fresh one.
struct Kind<S> {
    name: &'static str,
    rules: Rules,
    missing: Option<String>,
    make: Arc<dyn Fn() -> S + Send + Sync>,
}

fn kind<S>(name: &'static str, rules: Rules, missing: Option<String>, make: impl Fn() -> S + Send + Sync + 'static) -> Kind<S> {
    Kind { name, rules, missing, make: Arc::new(make) }
}

const S3: &str = "TIERCEL_TEST_S3";
const GCS: &str = "TIERCEL_TEST_GCS";

fn s3_missing() -> Option<String> {
    subjects::server_missing(S3, "`make test-rust` starts a moto server and sets them")
}

fn gcs_missing() -> Option<String> {
    subjects::server_missing(GCS, "no GCS emulator takes the XML API's writes: point them at a real bucket to run these")
}

fn tier_kinds() -> Vec<Kind<TierSubject>> {
    let peer = Rules { per_rank_commit: true, deletes: false };
    let normal = Rules::default();
    vec![
        kind("memory", normal, None, subjects::memory_tier),
        kind("fs_none", normal, None, || subjects::fs_tier(Compression::none())),
        kind("fs_zstd", normal, None, || subjects::fs_tier(subjects::zstd3())),
        kind("fs_bytegroup_zstd", normal, None, || subjects::fs_tier(subjects::bytegroup_zstd3())),
        kind("s3", normal, s3_missing(), || subjects::object_tier(TierKind::S3, S3, subjects::zstd3())),
        kind("s3_none", normal, s3_missing(), || subjects::object_tier(TierKind::S3, S3, Compression::none())),
        kind("gcs", normal, gcs_missing(), || subjects::object_tier(TierKind::Gcs, GCS, subjects::zstd3())),
        kind("peer", peer, None, subjects::peer_tier),
    ]
}

fn blobs_kinds() -> Vec<Kind<BlobsSubject>> {
    let r = Rules::default();
    vec![
        kind("fs", r, None, subjects::fs_blobs),
        kind("sim", r, None, subjects::sim_blobs),
        kind("s3", r, s3_missing(), || subjects::object_blobs(TierKind::S3, S3)),
        kind("gcs", r, gcs_missing(), || subjects::object_blobs(TierKind::Gcs, GCS)),
    ]
}

/// One trial per (kind, case): ignored when the kind cannot run here or the case does not
/// apply to it; the reasons are printed once, before the run.
fn trials<S: 'static>(suite: &str, kinds: Vec<Kind<S>>, cases: fn() -> Vec<Case<S>>, notes: &mut Vec<String>) -> Vec<Trial> {
    let mut out = vec![];
    // (case, reason) -> the kinds it does not apply to
    let mut not_applying: Vec<(&str, &str, Vec<&str>)> = vec![];
    for k in kinds {
        if let Some(why) = &k.missing {
            notes.push(format!("{suite}::{}: skipped: {why}", k.name));
        }
        for case in cases() {
            let not_here = (case.skip)(&k.rules);
            if let (None, Some(why)) = (&k.missing, not_here) {
                match not_applying.iter_mut().find(|(c, w, _)| *c == case.name && *w == why) {
                    Some((_, _, ks)) => ks.push(k.name),
                    None => not_applying.push((case.name, why, vec![k.name])),
                }
            }
            let make = k.make.clone();
            let run = case.run;
            let trial = Trial::test(format!("{suite}::{}::{}", k.name, case.name), move || {
                let subject = make();
                run(&subject);
                Ok::<(), Failed>(())
            });
            out.push(trial.with_ignored_flag(k.missing.is_some() || not_here.is_some()));
        }
    }
    for (case, why, ks) in not_applying {
        notes.push(format!("{suite}::*::{case}: does not apply to {}: {why}", ks.join(", ")));
    }
    out
}

/// The compressed fs kinds really exercise their codecs on the suite's data (else it would
/// test the raw path three times), and the memory tier stores raw, aligned chunks.
fn codecs_are_exercised() -> Result<(), Failed> {
    for (compression, want) in [(subjects::zstd3(), "zstd"), (subjects::bytegroup_zstd3(), "bytegroup4+zstd")] {
        let s = subjects::fs_tier(compression);
        let (codecs, stored, raw, _) = tiers::stored_layout(&*s.tier, tiers::TARGET);
        if !codecs.iter().any(|c| c == want) {
            return Err(format!("{compression}: {} codecs {codecs:?}", tiers::TARGET).into());
        }
        let (noise, _, _, _) = tiers::stored_layout(&*subjects::fs_tier(compression).tier, "optim/noise");
        if noise.iter().any(|c| c != "raw") {
            return Err(format!("{compression}: noise was not stored raw: {noise:?}").into());
        }
        if stored >= raw {
            return Err(format!("{compression}: nothing was compressed ({stored} of {raw} bytes)").into());
        }
    }
    let s = subjects::memory_tier();
    let (codecs, _, _, aligned) = tiers::stored_layout(&*s.tier, tiers::TARGET);
    if codecs.iter().any(|c| c != "raw") || !aligned {
        return Err(format!("memory tier: codecs {codecs:?}, aligned {aligned}").into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let mut notes = vec![];
    let mut all = trials("tier", tier_kinds(), tiers::cases, &mut notes);
    all.extend(trials("blobs", blobs_kinds(), blobs::cases, &mut notes));
    all.push(Trial::test("tier::codecs_are_exercised", codecs_are_exercised));
    if !args.list {
        for n in &notes {
            println!("conformance: {n}");
        }
    }
    libtest_mimic::run(&args, all).exit_code()
}
