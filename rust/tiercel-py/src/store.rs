//! `_core.Store`: one rank's store, its tiers and their housekeeping.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use tiercel_core::gc::Removal;
use tiercel_core::policy::Policy;
use tiercel_core::store as core;
use tiercel_core::tier::peer::HostMembers;

/// One host as Python hands it to `connect_peer_hosts`: (index, name, [(rank, address)]).
type HostTuple = (usize, String, Vec<(u32, String)>);

use crate::errors::{invalid, TcResult};
use crate::metrics;
use crate::step::{StepReader, StepWriter};
use crate::{json, seconds};

/// One item of `Store.broadcast_items`: (reader, item index, owner rank, agreed position,
/// indices of the members that read it).
type SharedTuple = (Py<StepReader>, usize, u32, usize, Vec<usize>);

#[pyclass(module = "tiercel._core", frozen)]
pub struct Store {
    inner: Arc<core::Store>,
}

#[pymethods]
impl Store {
    /// Opens a store from a policy file (`path`) or a JSON policy (`policy_json`). `tool`:
    /// for tools that look at tiers as they are (every job's steps; see `core::Store::open_as`).
    /// `check=False`: without `check_open`, which the caller runs (on one rank of a job).
    #[new]
    #[pyo3(signature = (rank, world_size, path=None, policy_json=None, tool=false, check=true))]
    fn new(
        py: Python<'_>,
        rank: u32,
        world_size: u32,
        path: Option<String>,
        policy_json: Option<String>,
        tool: bool,
        check: bool,
    ) -> TcResult<Self> {
        let policy = match (path, policy_json) {
            (Some(p), None) => Policy::load(Path::new(&p))?,
            (None, Some(j)) => Policy::from_json(&j, "<dict>")?,
            _ => return Err(invalid("give exactly one of path= and policy_json=").into()),
        };
        let open = if check { core::Store::open_as } else { core::Store::open_unchecked };
        let inner = py.allow_threads(|| open(policy, rank, world_size, tool))?;
        Ok(Store { inner })
    }

    /// What the tiers hold, checked at open (`core::Store::check_open`): a missing bucket,
    /// other jobs' steps.
    fn check_open(&self, py: Python<'_>) -> TcResult<()> {
        Ok(py.allow_threads(|| self.inner.check_open())?)
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.inner.rank
    }

    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.world_size
    }

    /// This job's run id (policy `[store] run`, else $TIERCEL_RUN_ID, $TORCHELASTIC_RUN_ID,
    /// $SLURM_JOB_ID), or None.
    #[getter]
    fn run_id(&self) -> Option<String> {
        self.inner.run_id().map(str::to_string)
    }

    /// This job's identity as recorded in commit records: {"run", "world_size", "policy"}.
    #[getter]
    fn job(&self) -> String {
        serde_json::to_string(self.inner.job()).expect("serializes")
    }

    #[getter]
    fn policy_source(&self) -> String {
        self.inner.policy.source.clone()
    }

    #[getter]
    fn restore_order(&self) -> Vec<String> {
        self.inner.policy.restore_order.clone()
    }

    #[getter]
    fn chunk_size(&self) -> u64 {
        self.inner.policy.chunk_size
    }

    /// `[store] pickle`: "warn", "error" or "allow".
    #[getter]
    fn pickle(&self) -> &'static str {
        self.inner.policy.pickle.as_str()
    }

    /// The policy's `[preemption]` section as (grace seconds, signal names, exit), or None
    /// without one (no handler is installed).
    #[getter]
    fn preemption(&self) -> Option<(f64, Vec<String>, bool)> {
        self.inner.policy.preemption.as_ref().map(|p| (p.grace.as_secs_f64(), p.signals.clone(), p.exit))
    }

    /// The steps a preemption may flush, oldest first: those this rank holds in the memory
    /// tier (`core::Store::preempt_steps`).
    fn preempt_steps(&self, py: Python<'_>) -> Vec<u64> {
        py.allow_threads(|| self.inner.preempt_steps())
    }

    /// Queues `step` to every tier that persists, at the top priority, limits lifted (see
    /// `core::Store::persist_now`); the handle says what each tier did.
    fn persist_now(&self, py: Python<'_>, step: u64) -> TcResult<crate::step::SaveHandle> {
        let inner = py.allow_threads(|| self.inner.persist_now(step))?;
        Ok(crate::step::SaveHandle { inner })
    }

    /// The preemption's flush is over: the links' limits apply again.
    fn end_preempt(&self) {
        self.inner.end_preempt()
    }

    /// The tiers in policy order, as dicts.
    fn tiers<'py>(&self, py: Python<'py>) -> TcResult<Vec<Bound<'py, PyDict>>> {
        self.inner
            .slots()
            .iter()
            .map(|s| {
                let c = &s.config;
                let d = PyDict::new(py);
                d.set_item("name", &c.name)?;
                d.set_item("kind", c.kind_name())?;
                d.set_item("location", c.location())?;
                d.set_item("every", c.every)?;
                d.set_item("keep", c.keep)?;
                d.set_item("compression", c.compression.to_string())?;
                d.set_item("bandwidth", c.bandwidth)?;
                d.set_item("capacity", c.capacity)?;
                // What the tier is, so that Python asks rather than matching kind names.
                let caps = c.capabilities();
                d.set_item("network", caps.network)?;
                d.set_item("persists", caps.persists)?;
                d.set_item("commit_records", caps.commit_records)?;
                d.set_item("memory_layout", caps.memory_layout)?;
                d.set_item("cluster", caps.cluster)?;
                d.set_item("directory", caps.directory)?;
                if c.name == tiercel_core::tier::Tier::name(&**self.inner.memory()) {
                    d.set_item("huge_pages", self.inner.memory().huge_pages())?;
                }
                Ok(d)
            })
            .collect()
    }

    /// Committed steps per tier: [(tier, [steps] or None, None or why it cannot be listed)].
    fn steps(&self, py: Python<'_>) -> Vec<(String, Option<Vec<u64>>, Option<String>)> {
        py.allow_threads(|| self.inner.steps())
            .into_iter()
            .map(|(name, r)| match r {
                Ok(steps) => (name, Some(steps), None),
                Err(e) => (name, None, Some(e.to_string())),
            })
            .collect()
    }

    /// What this process has done per tier, in policy order: [{"tier", then each field of
    /// `_core.TIER_FIELDS`}].
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.inner.metrics().into_iter().map(|m| metrics::dict(py, ("tier", &m.tier), m.values())).collect()
    }

    /// The framework adapters' timings: [{"timing", then each field of `_core.TIMING_FIELDS`}],
    /// one per `_core.TIMINGS`.
    fn timings<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.inner.timings().into_iter().map(|t| metrics::dict(py, ("timing", t.timing), t.values())).collect()
    }

    /// An adapter measured the timing `name` (one of `_core.TIMINGS`) once more: `seconds`.
    fn timed(&self, name: &str, seconds: f64) -> TcResult<()> {
        Ok(self.inner.timed(name, seconds)?)
    }

    /// Every step on a tier, committed or not.
    fn all_steps(&self, py: Python<'_>, tier: &str) -> TcResult<Vec<u64>> {
        let slot = self.inner.slot(tier)?;
        Ok(py.allow_threads(|| slot.tier.all_steps())?)
    }

    fn restorable_steps(&self, py: Python<'_>) -> Vec<u64> {
        py.allow_threads(|| self.inner.restorable_steps())
    }

    fn begin(&self, step: u64) -> TcResult<StepWriter> {
        Ok(StepWriter { inner: Mutex::new(Some(self.inner.begin(step)?)) })
    }

    /// `job`: None for this job's steps, "*" for any job's, else a run id.
    #[pyo3(signature = (step, rank=None, tiers=None, job=None))]
    fn reader(
        &self,
        py: Python<'_>,
        step: u64,
        rank: Option<u32>,
        tiers: Option<Vec<String>>,
        job: Option<String>,
    ) -> TcResult<StepReader> {
        let rank = rank.unwrap_or(self.inner.rank);
        let filter = core::JobFilter::parse(job.as_deref());
        let r = py.allow_threads(|| core::StepReader::open(&self.inner, step, rank, tiers.as_deref(), &filter))?;
        Ok(StepReader { inner: r })
    }

    /// Ranks whose part of `step` is complete on `tier` (their manifest is there), committed
    /// or not.
    fn step_ranks(&self, py: Python<'_>, tier: &str, step: u64) -> TcResult<Vec<u32>> {
        let slot = self.inner.slot(tier)?;
        Ok(py.allow_threads(|| slot.tier.ranks_written(step))?)
    }

    /// Rank `rank`'s manifest of `step` on `tier` as JSON, committed or not (a reader needs
    /// the step committed).
    fn manifest_json(&self, py: Python<'_>, tier: &str, step: u64, rank: u32) -> TcResult<String> {
        let slot = self.inner.slot(tier)?;
        Ok(py.allow_threads(|| slot.tier.read_manifest(step, rank)).map(|m| json(&m))?)
    }

    /// The commit record of `step` on `tier`, as JSON.
    fn commit_record(&self, py: Python<'_>, tier: &str, step: u64) -> TcResult<String> {
        let slot = self.inner.slot(tier)?;
        Ok(py.allow_threads(|| slot.tier.commit_record(step)).map(|r| json(&r))?)
    }

    /// Copies a committed step (every rank) between tiers; `progress(done, total)` per rank.
    #[pyo3(signature = (step, source, dest, progress=None))]
    fn copy_step(&self, py: Python<'_>, step: u64, source: &str, dest: &str, progress: Option<PyObject>) -> TcResult<()> {
        let report = |done: u32, total: u32, nbytes: u64| {
            if let Some(cb) = &progress {
                Python::with_gil(|py| {
                    let _ = cb.call1(py, (done, total, nbytes));
                });
            }
        };
        Ok(py.allow_threads(|| core::copy_step(&self.inner, step, source, dest, &report))?)
    }

    fn delete_step(&self, py: Python<'_>, tier: &str, step: u64) -> TcResult<()> {
        let slot = self.inner.slot(tier)?;
        Ok(py.allow_threads(|| slot.tier.delete_step(step))?)
    }

    /// Applies `keep` on a tier and removes uncommitted leftovers; returns removed steps.
    fn retain(&self, py: Python<'_>, tier: &str) -> TcResult<Vec<u64>> {
        let slot = self.inner.slot(tier)?;
        Ok(py.allow_threads(|| self.inner.retain(slot))?)
    }

    /// Cleans up what killed writers left outside the steps (an object store's abandoned
    /// multipart uploads); one line per thing removed. `retain` does this first as well.
    fn sweep(&self, py: Python<'_>, tier: &str) -> TcResult<Vec<String>> {
        Ok(py.allow_threads(|| self.inner.sweep_uploads(tier))?)
    }

    /// What `gc(tier)` would remove now, and why: [{"what": "step" | "temp file" | "upload" |
    /// "segment", "step": int | None, "path": str | None, "bytes": int | None, "reason": str}].
    /// Temporary files of dead writers count once `tmp_age` seconds old.
    #[pyo3(signature = (tier, tmp_age=600.0))]
    fn gc_plan<'py>(&self, py: Python<'py>, tier: &str, tmp_age: f64) -> TcResult<Vec<Bound<'py, PyDict>>> {
        let age = seconds(tmp_age)?;
        let plan = py.allow_threads(|| self.inner.gc_plan(tier, age))?;
        Ok(plan.iter().map(|r| removal_dict(py, r)).collect::<PyResult<_>>()?)
    }

    /// Removes what `gc_plan(tier)` lists (retention, leftovers of killed writers); returns
    /// what was removed, in the same form.
    #[pyo3(signature = (tier, tmp_age=600.0))]
    fn gc<'py>(&self, py: Python<'py>, tier: &str, tmp_age: f64) -> TcResult<Vec<Bound<'py, PyDict>>> {
        let age = seconds(tmp_age)?;
        let done = py.allow_threads(|| self.inner.gc(tier, age))?;
        Ok(done.iter().map(|r| removal_dict(py, r)).collect::<PyResult<_>>()?)
    }

    /// Tells the memory tier which ranks share this host's root (a step commits there when
    /// all of them have written it).
    fn set_local_ranks(&self, ranks: Vec<u32>) {
        self.inner.memory().set_local_ranks(ranks)
    }

    /// Sets this launch of the job (the same token on every rank, made by rank 0 at open):
    /// the ranks' saves of one step then carry one generation.
    fn set_launch(&self, token: &str) {
        self.inner.set_launch(token)
    }

    /// Sets the job-wide counter that commits on shared tiers count ranks in: a callable
    /// `add(key, by) -> int` (with `delete(key)` where the store can delete keys), called
    /// from background threads; None: commits list the step instead (docs/scale.md, "Commit").
    #[pyo3(signature = (counter=None))]
    fn set_counter(&self, py: Python<'_>, counter: Option<PyObject>) {
        let c = counter
            .map(|c| std::sync::Arc::new(crate::counter::PyCounter::new(py, c)) as std::sync::Arc<dyn tiercel_core::store::StepCounter>);
        self.inner.set_counter(c)
    }

    /// Whether commits count ranks in (a counter is set) rather than list the step.
    fn has_counter(&self) -> bool {
        self.inner.has_counter()
    }

    /// `[restore] replicated`, `relay_window` (bytes) and `relay_timeout` (seconds).
    fn replicated_policy(&self) -> (&'static str, u64, f64) {
        let r = self.inner.policy.replicated;
        (r.mode.name(), r.window, r.timeout.as_secs_f64())
    }

    /// Starts this rank's relay (once) on `listen`; returns the address it listens on.
    fn start_relay(&self, py: Python<'_>, listen: &str, job: &str, host: &str, secret: Vec<u8>) -> TcResult<String> {
        Ok(py.allow_threads(|| self.inner.start_relay(listen, job, host, secret))?.to_string())
    }

    /// Reads shared items together with the processes that restore them too (collective over
    /// the members of each; GIL released). `items`: (reader, item index, owner rank, agreed
    /// position, indices into `members` of those that read it); `members` and `mode` as
    /// `StepReader.broadcast`. Returns what it did, as a dict.
    fn broadcast_items<'py>(
        &self,
        py: Python<'py>,
        items: Vec<SharedTuple>,
        members: Vec<(u32, String, String)>,
        mode: &str,
    ) -> TcResult<Bound<'py, PyDict>> {
        let group = crate::step::group_of(&self.inner, members, mode)?;
        let s = py.allow_threads(|| {
            let shared = items
                .iter()
                .map(|(r, item, owner, position, members)| core::SharedItem {
                    reader: &r.get().inner,
                    item: *item,
                    owner: *owner,
                    position: *position,
                    members: members.clone(),
                })
                .collect();
            self.inner.broadcast_items(shared, &group)
        })?;
        crate::step::stats_dict(py, s)
    }

    /// The peer tier's server address ("ip:port" as bound), or None without a peer tier.
    fn peer_address(&self) -> Option<String> {
        self.inner.cluster().map(|c| c.local_addr().to_string())
    }

    /// Whether the peer tier already has its shared secret (from the policy or environment).
    fn peer_has_secret(&self) -> bool {
        self.inner.cluster().is_some_and(|c| c.has_secret())
    }

    /// Tells the peer tier its job (connections to or from another job are refused), where
    /// every rank is (host names and server addresses by rank), and the shared secret when
    /// it was handed out through the coordinator.
    #[pyo3(signature = (job, hosts, addrs, secret=None))]
    fn connect_peers(&self, job: &str, hosts: Vec<String>, addrs: Vec<String>, secret: Option<Vec<u8>>) -> TcResult<()> {
        let cluster = self.inner.cluster().ok_or_else(|| invalid("the policy has no peer tier"))?;
        if let Some(s) = secret {
            cluster.set_secret(s)?;
        }
        Ok(cluster.join(job, &hosts, &addrs)?)
    }

    /// For each of `hosts` hosts, by index, the hosts it must know to join the peer tier
    /// (its placement neighbours), or None when so few hosts leave the tier degraded.
    fn peer_neighbours(&self, hosts: usize) -> TcResult<Option<Vec<Vec<usize>>>> {
        let cluster = self.inner.cluster().ok_or_else(|| invalid("the policy has no peer tier"))?;
        Ok(cluster.neighbours(hosts)?)
    }

    /// `connect_peers` knowing only some hosts: the job has `hosts` hosts; `members` holds
    /// this process's own host and its placement neighbours (`peer_neighbours`), each as
    /// (host index, host name, [(rank, address)]).
    #[pyo3(signature = (job, hosts, members, secret=None))]
    fn connect_peer_hosts(&self, job: &str, hosts: usize, members: Vec<HostTuple>, secret: Option<Vec<u8>>) -> TcResult<()> {
        let cluster = self.inner.cluster().ok_or_else(|| invalid("the policy has no peer tier"))?;
        if let Some(s) = secret {
            cluster.set_secret(s)?;
        }
        let members: Vec<HostMembers> = members.into_iter().map(|(index, name, ranks)| HostMembers { index, name, ranks }).collect();
        Ok(cluster.join_hosts(job, self.inner.world_size, hosts, &members)?)
    }

    /// The peer server's connection counters (open, unauthenticated, refused, idle_closed),
    /// or None without a peer tier.
    fn peer_server_stats(&self) -> Option<std::collections::HashMap<&'static str, u64>> {
        self.inner.cluster().map(|c| {
            let s = c.server_stats();
            [("open", s.open), ("unauthenticated", s.unauthenticated), ("refused", s.refused), ("idle_closed", s.idle_closed)]
                .into_iter()
                .collect()
        })
    }

    /// Bytes in use under the memory tier's root (all ranks of this host).
    fn memory_used(&self, py: Python<'_>) -> TcResult<u64> {
        Ok(py.allow_threads(|| self.inner.memory().used_bytes())?)
    }

    /// Pre-faulted spare segments held by this process.
    fn pool_len(&self) -> usize {
        self.inner.memory().pool_len()
    }

    /// Background jobs queued or running.
    /// The training job's communication signals to this store's scheduler.
    fn traffic(&self) -> crate::traffic::Traffic {
        crate::traffic::Traffic { store: self.inner.clone() }
    }

    fn pending(&self) -> usize {
        self.inner.scheduler().pending()
    }

    /// Waits (GIL released; Ctrl-C interrupts it) until no background work is left, or
    /// `timeout` seconds passed. Returns None when done, else what is left ("tier 'disk':
    /// step 7 (running), ...").
    #[pyo3(signature = (timeout=None))]
    fn flush(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<String>> {
        let timeout = timeout.map(|t| Duration::from_secs_f64(t.max(0.0)));
        let mut err = None;
        let waited = py.allow_threads(|| {
            self.inner.wait_background(timeout, false, || Python::with_gil(|py| py.check_signals().map_err(|e| err = Some(e)).is_ok()))
        });
        if let Some(e) = err {
            return Err(e);
        }
        Ok((waited != core::Waited::Idle).then(|| core::PendingWork::describe(&self.inner.pending_work())))
    }

    /// The background work queued or running: [(tier, [job labels], running, bytes)].
    fn pending_work(&self) -> Vec<(String, Vec<String>, usize, u64)> {
        self.inner.pending_work().into_iter().map(|w| (w.tier, w.jobs, w.running, w.bytes)).collect()
    }

    fn prefault(&self, sizes: Vec<u64>) {
        self.inner.prefault(&sizes)
    }

    /// Waits for the background work (GIL released), up to `timeout` seconds, then stops;
    /// what is still queued or running then is left (logged). The first Ctrl-C while it
    /// waits says what it waits for; the next one (or the first, when `interrupted`: the
    /// caller is already leaving on a Ctrl-C) leaves at once, raising KeyboardInterrupt.
    /// Returns what was left, as `flush` describes it, or None.
    #[pyo3(signature = (timeout=None, interrupted=false))]
    fn close(&self, py: Python<'_>, timeout: Option<f64>, interrupted: bool) -> PyResult<Option<String>> {
        let timeout = timeout.map(|t| Duration::from_secs_f64(t.max(0.0)));
        let mut err = None;
        let mut patience = if interrupted { 0 } else { 1 };
        let waited = py.allow_threads(|| {
            self.inner.wait_background(timeout, true, || {
                Python::with_gil(|py| match py.check_signals() {
                    Ok(()) => true,
                    Err(e) if patience > 0 && e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) => {
                        patience -= 1;
                        self.inner.note_interrupt();
                        true
                    }
                    Err(e) => {
                        err = Some(e);
                        false
                    }
                })
            })
        });
        let left = if waited == core::Waited::Idle {
            py.allow_threads(|| self.inner.close_waited());
            None
        } else {
            let left = py.allow_threads(|| self.inner.close_now());
            (!left.is_empty()).then(|| core::PendingWork::describe(&left))
        };
        match err {
            Some(e) => Err(e),
            None => Ok(left),
        }
    }
}

fn removal_dict<'py>(py: Python<'py>, r: &Removal) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("what", r.what())?;
    d.set_item("step", r.step())?;
    d.set_item("path", r.key())?;
    d.set_item("bytes", r.bytes())?;
    d.set_item("reason", &r.reason)?;
    Ok(d)
}
