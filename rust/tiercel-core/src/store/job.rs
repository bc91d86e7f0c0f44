//! One job identity: which job a step belongs to. Every commit record names the job that
//! saved it (`format::JobId`); latest-step selection, restores and retention look only at
//! this job's steps (and those of the run named by `[restore] resume_from`), so a root that
//! holds an older or another job's steps never wins silently.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Store, TierSlot};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{CommitRecord, JobId};
use crate::lease::WriterLease;
use crate::policy::Policy;

/// Environment variables that name a run, in the order they are consulted after the
/// policy's `[store] run`. Each stays the same across restarts of one job.
pub const RUN_ID_VARS: [&str; 3] = ["TIERCEL_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"];

/// This job's identity from the policy and the environment.
pub fn job_of(policy: &Policy, world_size: u32, env: impl Fn(&str) -> Option<String>) -> JobId {
    // torchrun sets TORCHELASTIC_RUN_ID to "none" when no --rdzv-id is given: no run id.
    let from_env = || RUN_ID_VARS.iter().filter_map(|v| env(v)).map(|s| s.trim().to_string()).find(|s| !s.is_empty() && s != "none");
    let run = policy.run.clone().or_else(from_env);
    JobId { run, world_size, policy: fingerprint(policy) }
}

/// A fingerprint of where a policy persists steps: kind and location of each tier that
/// persists (fs, s3, gcs, Python tiers), in order. Retention, schedules and compression may change between restarts of one
/// job, and so may the memory root (a replaced host); these not.
fn fingerprint(policy: &Policy) -> String {
    let mut text = String::new();
    for t in policy.tiers.iter().filter(|t| t.capabilities().persists) {
        text.push_str(&format!("{}:{}\n", t.kind().as_str(), t.spec.location()));
    }
    format!("{:08x}", crate::checksum::crc32c(text.as_bytes()))
}

/// The warnings this process has logged (`warn_once`), so that a cause is said once, not
/// at every open (adapters open a store per save) or every restore of one step.
static SAID: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// How many distinct warnings a process remembers; beyond, it starts afresh.
const SAID_MAX: usize = 4096;

/// Logs `line` as a warning unless this process already has.
pub(crate) fn warn_once(line: &str) {
    let mut said = SAID.lock();
    let said = said.get_or_insert_with(HashSet::new);
    if said.contains(line) {
        log::debug!("{line}");
        return;
    }
    if said.len() >= SAID_MAX {
        said.clear();
    }
    said.insert(line.to_string());
    log::warn!("{line}");
}

/// Logs `warnings` one line per cause: lines that differ only in the tier they start with
/// ("tier 'ram': X", "tier 'disk': X") become one ("tiers 'ram', 'disk': X"), and each
/// line once per process (`warn_once`). Callers keep the full list for their results.
pub(crate) fn warn_per_cause(warnings: &[String]) {
    let mut causes: BTreeMap<&str, (usize, Vec<&str>)> = BTreeMap::new();
    for (i, w) in warnings.iter().enumerate() {
        let (tier, rest) = split_tier(w);
        let e = causes.entry(rest).or_insert((i, vec![]));
        if let Some(t) = tier.filter(|t| !e.1.contains(t)) {
            e.1.push(t);
        }
    }
    let mut lines: Vec<(usize, String)> = causes
        .into_iter()
        .map(|(rest, (i, tiers))| {
            let line = match tiers.as_slice() {
                [] => rest.to_string(),
                [t] => format!("tier '{t}': {rest}"),
                ts => format!("tiers {}: {rest}", ts.iter().map(|t| format!("'{t}'")).collect::<Vec<_>>().join(", ")),
            };
            (i, line)
        })
        .collect();
    lines.sort();
    for (_, line) in lines {
        warn_once(&line);
    }
}

/// "tier 'ram': rest" -> (Some("ram"), "rest"); any other line -> (None, line).
fn split_tier(w: &str) -> (Option<&str>, &str) {
    let Some(tail) = w.strip_prefix("tier '") else { return (None, w) };
    match tail.split_once("': ") {
        Some((t, rest)) if !t.contains('\'') => (Some(t), rest),
        _ => (None, w),
    }
}

/// Now as UTC "YYYY-MM-DD HH:MM:SS", for the writer lease's file.
fn humantime_now() -> String {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as i64;
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    unsafe { libc::gmtime_r(&t, &mut tm) };
    format!("{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec)
}

/// Whose steps a read may return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobFilter {
    /// This job's, and those of the run named by `[restore] resume_from`.
    Mine,
    /// Those of the run with this id (`restore(step, job="...")`).
    Run(String),
    /// Any job's (the CLI's tools, which look at a tier as it is).
    Any,
}

impl JobFilter {
    /// From the Python API's `job=`: None = this job's, "*" = any job's, else a run id.
    pub fn parse(job: Option<&str>) -> JobFilter {
        match job {
            None => JobFilter::Mine,
            Some("*") => JobFilter::Any,
            Some(r) => JobFilter::Run(r.to_string()),
        }
    }
}

/// Per tier and step: whether its commit record names another job (commit records do not
/// change once written, so each is read once).
#[derive(Default)]
pub struct Foreign(Mutex<HashMap<(String, u64), Option<JobId>>>);

/// The writer leases this store holds (`lease::WriterLease`): taken at its first
/// save, one per memory and fs tier, released at close.
#[derive(Default)]
pub struct Writers(Mutex<Option<Vec<Arc<WriterLease>>>>);

impl Store {
    /// Before this store's first save: takes this rank's writer lease on every memory and fs
    /// tier, so that no other live process saves the same rank into the same root (two jobs
    /// in one directory would replace each other's steps, and a restore could meet a step
    /// torn between them). Refused, naming the other process, when one holds it. A process
    /// that died holds nothing (the kernel drops its locks): a restart after a crash is
    /// fine. Object stores hold no lease (see docs/config.md, "Jobs").
    pub(super) fn claim_writer(&self) -> Result<()> {
        let mut held = self.writers.0.lock();
        if held.is_some() {
            return Ok(());
        }
        let who = format!(
            "pid {} on host {} (launch {}, {}, since {})",
            std::process::id(),
            crate::object::host_id(),
            self.launch.read().as_deref().unwrap_or("not yet agreed"),
            self.job.describe(),
            humantime_now()
        );
        let mut leases = vec![];
        for slot in &self.slots {
            let Some(root) = slot.config.capabilities().directory.map(Path::new) else { continue };
            let name = &slot.config.name;
            let at = crate::lease::writer_path(root, self.rank);
            let taken = match WriterLease::take(root, self.rank, &who) {
                Ok(t) => t,
                // A persistent tier that cannot be written now (a full or read-only disk, an
                // NFS server away) fails its persists in the background, as before; it must
                // not fail the save into memory. The memory tier's own trouble does.
                Err(e) if slot.config.capabilities().degradable => {
                    let e = Error::io(name, &at, e);
                    warn_once(&format!(
                        "{}; saves go on without this rank's writer lease there (a second writer is not detected)",
                        e.message
                    ));
                    continue;
                }
                Err(e) => return Err(Error::io(name, &at, e)),
            };
            match taken {
                Ok(l) => leases.push(l),
                Err(holder) => {
                    return Err(Error::config(format!(
                        "tier '{name}' ({}): rank {} is being saved there by another live process: {holder}. This \
                         process (pid {}, {}) would replace its steps: two jobs save into one directory. Give each \
                         job its own tiers (`root`, `path`), or stop the other process first (a process that died \
                         holds nothing: a restart after a crash is fine)",
                        slot.config.spec.location(),
                        self.rank,
                        std::process::id(),
                        self.job.describe()
                    ))
                    .with_tier(name.as_str())
                    .with_rank(self.rank)
                    .with_path(at.display().to_string()));
                }
            }
        }
        *held = Some(leases);
        Ok(())
    }

    /// At close: another process may save this rank into these tiers now.
    pub(super) fn release_writer(&self) {
        self.writers.0.lock().take();
    }

    /// This job's identity, as recorded in every commit record it writes.
    pub fn job(&self) -> &JobId {
        &self.job
    }

    /// The run id, if the job has one.
    pub fn run_id(&self) -> Option<&str> {
        self.job.run.as_deref()
    }

    /// Whether `filter` admits a step whose commit record is `record`.
    pub fn admits(&self, record: &CommitRecord, filter: &JobFilter) -> bool {
        let Some(job) = &record.job else { return true }; // saved before jobs were recorded
        match filter {
            JobFilter::Mine if self.tool => true,
            JobFilter::Any => true,
            JobFilter::Run(r) => job.run.as_deref() == Some(r),
            JobFilter::Mine => self.job.same_job(job) || self.policy.resume_from.as_ref().is_some_and(|r| job.run.as_ref() == Some(r)),
        }
    }

    /// The job that saved `step` on `slot`'s tier when it is not one this job reads
    /// (`JobFilter::Mine`); None for this job's steps and for steps whose record cannot be
    /// read (the restore path reports those).
    pub fn other_job(&self, slot: &TierSlot, step: u64) -> Option<JobId> {
        let key = (slot.config.name.clone(), step);
        if let Some(v) = self.foreign.0.lock().get(&key) {
            return v.clone();
        }
        let record = slot.tier.commit_record(step).ok()?;
        let other = (!self.admits(&record, &JobFilter::Mine)).then(|| record.job.clone()).flatten();
        self.foreign.0.lock().insert(key, other.clone());
        other
    }

    /// The committed steps of other jobs on `slot`'s tier.
    pub fn foreign_steps(&self, slot: &TierSlot) -> Vec<u64> {
        if !slot.config.capabilities().commit_records {
            return vec![]; // replicas carry no commit record of their own
        }
        let steps = slot.tier.committed_steps().unwrap_or_default();
        self.foreign_among(slot, &steps)
    }

    /// Which of `committed`, steps committed on `slot`'s tier, are other jobs'.
    pub fn foreign_among(&self, slot: &TierSlot, committed: &[u64]) -> Vec<u64> {
        committed.iter().copied().filter(|s| self.other_job(slot, *s).is_some()).collect()
    }

    /// At open, for a job without a run id: steps that jobs without one saved at another
    /// world size or into other persistent tiers count as this job's (a resharded resume, a
    /// copied checkpoint: nothing tells them from another job), and the log says so once,
    /// with the setting that keeps jobs apart. Refusing them would break resharded resumes;
    /// a plain restore at another world size is refused by the step choice itself (Python's
    /// `WorldSizeError`, naming both world sizes).
    /// `committed`: each tier's committed steps, by slot (empty for tiers without commit
    /// records), as `check_other_jobs` listed them.
    fn warn_unnamed_jobs(&self, committed: &[Vec<u64>]) {
        if self.job.run.is_some() {
            return;
        }
        let mut seen = vec![];
        for (slot, steps) in self.slots.iter().zip(committed) {
            // The newest step says which job a restore would continue from.
            let Some(&last) = steps.last() else { continue };
            let Ok(record) = slot.tier.commit_record(last) else { continue };
            if let Some(j) = record.job.filter(|j| j.run.is_none() && *j != self.job) {
                seen.push(format!("tier '{}': step {last} by {}", slot.config.name, j.describe()));
            }
        }
        if !seen.is_empty() {
            self.warn_for_job(&format!(
                "{} holds steps of a job without a run id that differs from this one ({}): {}. Without run ids they \
                 count as this job's (a resharded resume); if they belong to another job, give each job a run id \
                 (`[store] run` or $TIERCEL_RUN_ID) or its own tiers",
                self.policy.source,
                self.job.describe(),
                seen.join("; ")
            ));
        }
    }

    /// At open, what the tiers hold: whether each object store's bucket exists (one LIST of
    /// one key each), then other jobs' steps (`check_other_jobs`, unless opened for tools).
    /// A job with a coordinator runs it on rank 0 only and hands the answer to every rank;
    /// the other ranks learn other jobs' steps when they need them (`other_job`, once per
    /// step: restores and retention ask it).
    pub fn check_open(&self) -> Result<()> {
        for b in &self.buckets {
            b.check_bucket()?;
        }
        if !self.tool {
            self.check_other_jobs()?;
        }
        Ok(())
    }

    /// At open: finds other jobs' committed steps on every tier, with one listing of each
    /// tier's root. Logged once; an error when the policy says `[store] other_jobs = "refuse"`.
    fn check_other_jobs(&self) -> Result<()> {
        let mut found = vec![];
        let mut committed = vec![];
        for slot in &self.slots {
            // Replicas carry no commit record of their own.
            let listed = if slot.config.capabilities().commit_records { slot.tier.committed_steps().unwrap_or_default() } else { vec![] };
            let steps = self.foreign_among(slot, &listed);
            committed.push(listed);
            if let (Some(first), Some(last)) = (steps.first(), steps.last()) {
                let who = self.other_job(slot, *first).map(|j| j.describe()).unwrap_or_default();
                found.push(format!(
                    "tier '{}' ({}): {} step(s) {first}..{last} of {who}",
                    slot.config.name,
                    slot.config.spec.location(),
                    steps.len()
                ));
            }
        }
        self.warn_unnamed_jobs(&committed);
        if found.is_empty() {
            return Ok(());
        }
        let me = self.job.describe();
        let msg = format!("{} holds committed steps of other jobs: {}; this job is {me}", self.policy.source, found.join("; "));
        if self.policy.refuse_other_jobs {
            return Err(Error::new(
                ErrorKind::Config,
                format!("{msg}. `[store] other_jobs = \"refuse\"`: give this job tiers of its own, remove those steps, or set `[restore] resume_from` to the run to continue"),
            ));
        }
        self.warn_for_job(&format!("{msg}. They are ignored: never restored, never removed by retention, not counted towards `keep` (set `[restore] resume_from = \"<run id>\"` to continue from them)"));
        Ok(())
    }

    /// A warning about the job as a whole (what its tiers hold): said once per job, by rank
    /// 0, once per process; the other ranks log it at debug level.
    fn warn_for_job(&self, line: &str) {
        if self.rank == 0 {
            warn_once(line);
        } else {
            log::debug!("{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_cause() {
        assert_eq!(split_tier("tier 'ram': step 5 was saved by 2 ranks"), (Some("ram"), "step 5 was saved by 2 ranks"));
        assert_eq!(split_tier("step 5 rank 0: x"), (None, "step 5 rank 0: x"));
        assert_eq!(split_tier("tier 'a b': x"), (Some("a b"), "x"));
    }
}
