//! Retention and garbage collection: the one rule for what may go from a tier, and why.
//!
//! A tier's plan (`Tier::gc_plan`) lists what would be removed; `Tier::gc_apply` removes what
//! a plan lists. The same plan serves the retention run after every save, `tiercel gc` and
//! `tiercel gc --dry-run`, and the peer tier's holders apply the same step rule to the
//! replicas they keep. What a plan may hold:
//!
//! - committed steps beyond the newest `keep`;
//! - uncommitted steps older than the newest committed one (a rank died mid-save);
//! - on a tier that knows its writers (the memory tier: `lease`'s writer leases), any
//!   uncommitted step once no process holds a writer lease there (its writers were killed
//!   mid-save: nobody will ever commit it), in a gc run that looks for dead writers' leftovers;
//! - temporary files (`<name>.tmp-<pid>-<n>`) whose writer process is gone, once they are
//!   old enough not to belong to a writer on another host of a shared filesystem;
//! - multipart uploads that a killed writer left on an object store (see `object::uploads`);
//! - spare shared-memory segments of processes that are gone (memory tier).

use std::time::Duration;

/// What a gc run considers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcOptions {
    /// Committed steps kept (the tier's `keep`); None keeps all.
    pub keep: Option<usize>,
    /// Temporary files of dead writers are removed once this old; None leaves them alone
    /// (the retention run after a save does).
    pub temp_age: Option<Duration>,
    /// Committed steps of other jobs: not counted towards `keep`, never removed.
    pub foreign: Vec<u64>,
    /// Committed steps of this job kept beyond `keep` (not counted towards it, not removed):
    /// on the memory tier, the own copies of the steps a peer tier keeps replicas of
    /// (`Store::retain`).
    pub pinned: Vec<u64>,
    /// The tier's steps as the caller listed them just now (`Tier::list_steps`), so that
    /// the plan does not list them again; None: the plan lists them itself.
    pub listed: Option<Listed>,
}

/// A tier's steps from one listing (`Tier::list_steps`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listed {
    /// Every step with something stored, committed or not, oldest first.
    pub all: Vec<u64>,
    /// The committed ones, oldest first.
    pub committed: Vec<u64>,
    /// The names at the tier's root as listed (None where the tier does not say): whether
    /// anything a dead writer left can be there at all (`Blobs::leftovers_under`).
    pub names: Option<Vec<String>>,
}

/// Something gc removes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A whole step (commit record first, as `Tier::delete_step`).
    Step(u64),
    /// A temporary file a writer left: its key (path under the tier's root) and size.
    TempFile { key: String, bytes: u64 },
    /// An unfinished multipart upload of `key` (object stores), recorded by `marker`.
    Upload { key: String, marker: String, upload_id: String },
    /// A spare shared-memory segment of a process that is gone (memory tier).
    Segment { key: String, bytes: u64 },
    /// A manifest or data object in a rank area (version 3) that nothing kept refers to.
    Object { key: String, bytes: Option<u64> },
}

/// One entry of a plan: what, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removal {
    pub target: Target,
    pub reason: String,
}

impl Removal {
    pub fn new(target: Target, reason: impl Into<String>) -> Removal {
        Removal { target, reason: reason.into() }
    }

    /// "step", "temp file", "upload", "segment" or "object".
    pub fn what(&self) -> &'static str {
        match self.target {
            Target::Step(_) => "step",
            Target::TempFile { .. } => "temp file",
            Target::Upload { .. } => "upload",
            Target::Segment { .. } => "segment",
            Target::Object { .. } => "object",
        }
    }

    pub fn step(&self) -> Option<u64> {
        match self.target {
            Target::Step(s) => Some(s),
            _ => None,
        }
    }

    /// The key (path under the tier's root) of a file, upload or segment.
    pub fn key(&self) -> Option<&str> {
        match &self.target {
            Target::Step(_) => None,
            Target::TempFile { key, .. } | Target::Upload { key, .. } | Target::Segment { key, .. } | Target::Object { key, .. } => {
                Some(key)
            }
        }
    }

    /// Bytes it frees, where known.
    pub fn bytes(&self) -> Option<u64> {
        match self.target {
            Target::TempFile { bytes, .. } | Target::Segment { bytes, .. } => Some(bytes),
            Target::Object { bytes, .. } => bytes,
            _ => None,
        }
    }
}

/// The step rule: committed steps beyond the newest `keep` (None keeps all), and uncommitted
/// steps older than the newest committed one. `committed` and `all` are oldest first; the
/// plan is too.
pub fn step_removals(committed: &[u64], all: &[u64], keep: Option<usize>) -> Vec<Removal> {
    let newest = committed.last().copied();
    let beyond: Vec<u64> = keep.map(|k| committed.iter().rev().skip(k).copied().collect()).unwrap_or_default();
    all.iter()
        .filter_map(|&s| {
            if beyond.contains(&s) {
                Some(Removal::new(Target::Step(s), format!("committed; beyond keep {}", keep.unwrap_or(0))))
            } else if !committed.contains(&s) && newest.is_some_and(|n| s < n) {
                Some(Removal::new(Target::Step(s), "uncommitted leftover"))
            } else {
                None
            }
        })
        .collect()
}

/// Why an abandoned step goes (see `abandoned_steps`).
pub const ABANDONED: &str = "uncommitted; no process writes to this tier: its writer is gone";

/// Uncommitted steps that `step_removals` leaves (newer than the newest committed one, or
/// none committed), for a tier where no process holds a writer lease: their writers are
/// gone, so nothing will ever commit them. A tier calls this only when it knows that
/// (`lease::any_writer`), and only for a gc run that removes dead writers' leftovers
/// (`GcOptions::temp_age` set). Oldest first.
pub fn abandoned_steps(committed: &[u64], all: &[u64]) -> Vec<Removal> {
    let newest = committed.last().copied();
    all.iter()
        .filter(|s| !committed.contains(s) && newest.is_none_or(|n| **s > n))
        .map(|&s| Removal::new(Target::Step(s), ABANDONED))
        .collect()
}

/// Steps a plan removes.
pub fn steps_of(plan: &[Removal]) -> Vec<u64> {
    plan.iter().filter_map(Removal::step).collect()
}

/// Whether process `pid` of this host (pid namespace) still runs. A process that exists but
/// belongs to someone else (EPERM) counts as running.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else { return false };
    if p <= 0 {
        return false;
    }
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Temporary files carry this marker: `<name>.tmp-<pid>-<n>` (see `blobs::FsBlobs`).
pub const TEMP_MARKER: &str = ".tmp-";

/// The writer's pid of a temporary file name (`x.data.tmp-4242-7` -> 4242); None for any
/// other name.
pub fn temp_writer(name: &str) -> Option<u32> {
    let tail = &name[name.rfind(TEMP_MARKER)? + TEMP_MARKER.len()..];
    let (pid, n) = tail.split_once('-')?;
    if pid.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Why a temporary file of `age` may go, or None while it may still be written: its writer
/// must be gone (or unknown) and the file older than `min_age`.
pub fn stale_temp(name: &str, age: Duration, min_age: Duration) -> Option<String> {
    if !name.contains(TEMP_MARKER) || age < min_age {
        return None;
    }
    match temp_writer(name) {
        Some(pid) if pid_alive(pid) => None,
        Some(pid) => Some(format!("stale temporary file: its writer (pid {pid}) is gone")),
        None => Some("stale temporary file of an unknown writer".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_rule() {
        let plan = step_removals(&[2, 4, 6, 8], &[1, 2, 3, 4, 5, 6, 8, 9], Some(2));
        let got: Vec<(u64, &str)> = plan.iter().map(|r| (r.step().unwrap(), r.reason.as_str())).collect();
        assert_eq!(
            got,
            vec![
                (1, "uncommitted leftover"),
                (2, "committed; beyond keep 2"),
                (3, "uncommitted leftover"),
                (4, "committed; beyond keep 2"),
                (5, "uncommitted leftover"),
            ]
        );
        // Keep all: only leftovers. Nothing committed: nothing goes (a save may be under way).
        assert_eq!(steps_of(&step_removals(&[2, 4], &[1, 2, 3, 4, 5], None)), vec![1, 3]);
        assert!(step_removals(&[], &[1, 2, 3], Some(1)).is_empty());
        // With no writer left: the uncommitted steps the step rule leaves.
        assert_eq!(steps_of(&abandoned_steps(&[2, 4], &[1, 2, 3, 4, 5, 7])), vec![5, 7]);
        assert_eq!(steps_of(&abandoned_steps(&[], &[1, 3])), vec![1, 3]);
        assert!(abandoned_steps(&[2, 4], &[2, 4]).is_empty());
    }

    #[test]
    fn temp_names_and_their_writers() {
        assert_eq!(temp_writer("rank-00000.data.tmp-4242-7"), Some(4242));
        assert_eq!(temp_writer("COMMIT.tmp-1-0"), Some(1));
        for other in ["rank-00000.data", "x.tmp-", "x.tmp-12", "x.tmp-a-1", "x.tmp-12-x"] {
            assert_eq!(temp_writer(other), None, "{other}");
        }
        let me = std::process::id();
        let old = Duration::from_secs(3600);
        assert_eq!(stale_temp(&format!("a.tmp-{me}-0"), old, Duration::ZERO), None, "a running writer's file");
        assert_eq!(stale_temp("a.tmp-999999999-0", Duration::from_secs(5), Duration::from_secs(600)), None, "too young");
        assert!(stale_temp("a.tmp-999999999-0", old, Duration::from_secs(600)).unwrap().contains("pid 999999999"));
        assert_eq!(stale_temp("a.data", old, Duration::ZERO), None);
        assert!(pid_alive(me) && !pid_alive(0) && !pid_alive(u32::MAX));
    }
}
