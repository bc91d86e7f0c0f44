//! PyO3 bindings of tiercel-core as `tiercel._core`: conversions, GIL release and the one
//! mapping of core errors to Python exceptions. No logic of its own lives here.

use std::ffi::{c_int, c_void};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use tiercel_core::error::{Error, ErrorKind};
use tiercel_core::format::ShardInfo;
use tiercel_core::policy::Policy;
use tiercel_core::store::{self as core, ItemData, ItemSpec};
use tiercel_core::tier::gc::Removal;
use tiercel_core::tier::memory::{Segment, View};

create_exception!(_core, TiercelError, PyException, "Base class of every tiercel error.");
create_exception!(_core, ConfigError, TiercelError, "A policy file or value is wrong.");
create_exception!(_core, IntegrityError, TiercelError, "Stored bytes fail their checksum or cannot be decoded.");
create_exception!(_core, NotFoundError, TiercelError, "The step, rank or item exists on no tier asked.");
create_exception!(_core, TierUnavailableError, TiercelError, "A tier cannot be read or written right now.");
create_exception!(_core, CapacityError, TiercelError, "A step does not fit into a tier's capacity.");
create_exception!(_core, InvalidArgumentError, TiercelError, "Something tiercel cannot store, or a call out of order.");

fn err(e: Error) -> PyErr {
    let m = e.message;
    match e.kind {
        ErrorKind::Config => ConfigError::new_err(m),
        ErrorKind::Integrity => IntegrityError::new_err(m),
        ErrorKind::NotFound => NotFoundError::new_err(m),
        ErrorKind::TierUnavailable => TierUnavailableError::new_err(m),
        ErrorKind::Capacity => CapacityError::new_err(m),
        ErrorKind::InvalidArgument => InvalidArgumentError::new_err(m),
    }
}

fn json<T: serde::Serialize + ?Sized>(v: &T) -> String {
    serde_json::to_string(v).expect("serializes")
}

fn parse_json(s: &str, what: &str) -> PyResult<serde_json::Value> {
    serde_json::from_str(s).map_err(|e| InvalidArgumentError::new_err(format!("{what} is not valid JSON: {e}")))
}

fn seconds(s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| InvalidArgumentError::new_err(format!("tmp_age must be a non-negative number of seconds, got {s}")))
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

/// Memory handed to Python through the buffer protocol: a segment being written, a
/// zero-copy view of a stored object, or bytes read from a slower tier.
enum Backing {
    Segment(Arc<Segment>),
    View(Arc<View>, usize, usize),
    Owned(Vec<u8>),
}

#[pyclass(module = "tiercel._core", frozen)]
pub struct Buffer {
    backing: Backing,
}

impl Buffer {
    fn ptr_len(&self) -> (*const u8, usize) {
        match &self.backing {
            Backing::Segment(s) => (s.ptr(), s.len()),
            Backing::View(v, off, len) => (unsafe { v.as_ptr().add(*off) }, *len),
            Backing::Owned(v) => (v.as_ptr(), v.len()),
        }
    }
}

impl From<ItemData> for Buffer {
    fn from(d: ItemData) -> Buffer {
        let backing = match d {
            ItemData::View { view, offset, len } => Backing::View(view, offset, len),
            ItemData::Owned(v) => Backing::Owned(v),
        };
        Buffer { backing }
    }
}

#[pymethods]
impl Buffer {
    fn __len__(&self) -> usize {
        self.ptr_len().1
    }

    /// "segment", "view" (zero-copy over shared memory) or "owned".
    #[getter]
    fn kind(&self) -> &'static str {
        match self.backing {
            Backing::Segment(_) => "segment",
            Backing::View(..) => "view",
            Backing::Owned(_) => "owned",
        }
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let (ptr, len) = slf.get().ptr_len();
        // Every backing is writable memory: segments while a step is written, private
        // (copy-on-write) maps and owned vectors after a restore, so the flag is honoured.
        let ret = ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr as *mut c_void, len as ffi::Py_ssize_t, 0, flags);
        if ret != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

#[pyclass(module = "tiercel._core", frozen)]
pub struct Store {
    inner: Arc<core::Store>,
}

#[pymethods]
impl Store {
    /// Opens a store from a policy file (`path`) or a JSON policy (`policy_json`).
    #[new]
    #[pyo3(signature = (rank, world_size, path=None, policy_json=None))]
    fn new(py: Python<'_>, rank: u32, world_size: u32, path: Option<String>, policy_json: Option<String>) -> PyResult<Self> {
        let policy = match (path, policy_json) {
            (Some(p), None) => Policy::load(Path::new(&p)).map_err(err)?,
            (None, Some(j)) => Policy::from_json(&j, "<dict>").map_err(err)?,
            _ => return Err(InvalidArgumentError::new_err("give exactly one of path= and policy_json=")),
        };
        let inner = py.allow_threads(|| core::Store::open(policy, rank, world_size)).map_err(err)?;
        Ok(Store { inner })
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.inner.rank
    }

    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.world_size
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

    /// The tiers in policy order, as dicts.
    fn tiers<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.inner
            .slots()
            .iter()
            .map(|s| {
                let c = &s.config;
                let d = PyDict::new(py);
                d.set_item("name", &c.name)?;
                d.set_item("kind", c.kind().as_str())?;
                d.set_item("location", c.location())?;
                d.set_item("every", c.every)?;
                d.set_item("keep", c.keep)?;
                d.set_item("compression", c.compression.to_string())?;
                d.set_item("bandwidth", c.bandwidth)?;
                d.set_item("capacity", c.capacity)?;
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

    /// What this process has done per tier, in policy order: [{"tier", "steps_written",
    /// "bytes_written", "write_seconds", "write_bytes_per_second", "steps_read", "bytes_read",
    /// "last_step", "lag_steps", "lag_seconds", "queue_depth", "skips", "failures"}].
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.inner
            .metrics()
            .into_iter()
            .map(|m| {
                let d = PyDict::new(py);
                d.set_item("tier", m.tier)?;
                d.set_item("steps_written", m.steps_written)?;
                d.set_item("bytes_written", m.bytes_written)?;
                d.set_item("write_seconds", m.write_seconds)?;
                d.set_item("write_bytes_per_second", m.write_bytes_per_second)?;
                d.set_item("steps_read", m.steps_read)?;
                d.set_item("bytes_read", m.bytes_read)?;
                d.set_item("last_step", m.last_step)?;
                d.set_item("lag_steps", m.lag_steps)?;
                d.set_item("lag_seconds", m.lag_seconds)?;
                d.set_item("queue_depth", m.queue_depth)?;
                d.set_item("skips", m.skips)?;
                d.set_item("failures", m.failures)?;
                Ok(d)
            })
            .collect()
    }

    /// Every step on a tier, committed or not.
    fn all_steps(&self, py: Python<'_>, tier: &str) -> PyResult<Vec<u64>> {
        let slot = self.inner.slot(tier).map_err(err)?;
        py.allow_threads(|| slot.tier.all_steps()).map_err(err)
    }

    fn restorable_steps(&self, py: Python<'_>) -> Vec<u64> {
        py.allow_threads(|| self.inner.restorable_steps())
    }

    fn begin(&self, step: u64) -> StepWriter {
        StepWriter { inner: Mutex::new(Some(self.inner.begin(step))) }
    }

    #[pyo3(signature = (step, rank=None, tiers=None))]
    fn reader(&self, py: Python<'_>, step: u64, rank: Option<u32>, tiers: Option<Vec<String>>) -> PyResult<StepReader> {
        let rank = rank.unwrap_or(self.inner.rank);
        let r = py.allow_threads(|| core::StepReader::open(&self.inner, step, rank, tiers.as_deref())).map_err(err)?;
        Ok(StepReader { inner: r })
    }

    /// The commit record of `step` on `tier`, as JSON.
    fn commit_record(&self, py: Python<'_>, tier: &str, step: u64) -> PyResult<String> {
        let slot = self.inner.slot(tier).map_err(err)?;
        py.allow_threads(|| slot.tier.commit_record(step)).map(|r| json(&r)).map_err(err)
    }

    /// Copies a committed step (every rank) between tiers; `progress(done, total)` per rank.
    #[pyo3(signature = (step, source, dest, progress=None))]
    fn copy_step(&self, py: Python<'_>, step: u64, source: &str, dest: &str, progress: Option<PyObject>) -> PyResult<()> {
        let report = |done: u32, total: u32| {
            if let Some(cb) = &progress {
                Python::with_gil(|py| {
                    let _ = cb.call1(py, (done, total));
                });
            }
        };
        py.allow_threads(|| core::copy_step(&self.inner, step, source, dest, &report)).map_err(err)
    }

    fn delete_step(&self, py: Python<'_>, tier: &str, step: u64) -> PyResult<()> {
        let slot = self.inner.slot(tier).map_err(err)?;
        py.allow_threads(|| slot.tier.delete_step(step)).map_err(err)
    }

    /// Applies `keep` on a tier and removes uncommitted leftovers; returns removed steps.
    fn retain(&self, py: Python<'_>, tier: &str) -> PyResult<Vec<u64>> {
        let slot = self.inner.slot(tier).map_err(err)?;
        py.allow_threads(|| self.inner.retain(slot)).map_err(err)
    }

    /// Cleans up what killed writers left outside the steps (an object store's abandoned
    /// multipart uploads); one line per thing removed. `retain` does this first as well.
    fn sweep(&self, py: Python<'_>, tier: &str) -> PyResult<Vec<String>> {
        py.allow_threads(|| self.inner.sweep_uploads(tier)).map_err(err)
    }

    /// What `gc(tier)` would remove now, and why: [{"what": "step" | "temp file" | "upload" |
    /// "segment", "step": int | None, "path": str | None, "bytes": int | None, "reason": str}].
    /// Temporary files of dead writers count once `tmp_age` seconds old.
    #[pyo3(signature = (tier, tmp_age=600.0))]
    fn gc_plan<'py>(&self, py: Python<'py>, tier: &str, tmp_age: f64) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let age = seconds(tmp_age)?;
        let plan = py.allow_threads(|| self.inner.gc_plan(tier, age)).map_err(err)?;
        plan.iter().map(|r| removal_dict(py, r)).collect()
    }

    /// Removes what `gc_plan(tier)` lists (retention, leftovers of killed writers); returns
    /// what was removed, in the same form.
    #[pyo3(signature = (tier, tmp_age=600.0))]
    fn gc<'py>(&self, py: Python<'py>, tier: &str, tmp_age: f64) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let age = seconds(tmp_age)?;
        let done = py.allow_threads(|| self.inner.gc(tier, age)).map_err(err)?;
        done.iter().map(|r| removal_dict(py, r)).collect()
    }

    /// Tells the memory tier which ranks share this host's root (a step commits there when
    /// all of them have written it).
    fn set_local_ranks(&self, ranks: Vec<u32>) {
        self.inner.memory().set_local_ranks(ranks)
    }

    /// The peer tier's server address ("ip:port" as bound), or None without a peer tier.
    fn peer_address(&self) -> Option<String> {
        self.inner.peer().map(|p| p.local_addr().to_string())
    }

    /// Whether the peer tier already has its shared secret (from the policy or environment).
    fn peer_has_secret(&self) -> bool {
        self.inner.peer().is_some_and(|p| p.has_secret())
    }

    /// Tells the peer tier where every rank is (host names and server addresses by rank),
    /// and the shared secret when it was handed out through the coordinator.
    #[pyo3(signature = (hosts, addrs, secret=None))]
    fn connect_peers(&self, hosts: Vec<String>, addrs: Vec<String>, secret: Option<Vec<u8>>) -> PyResult<()> {
        let peer = self.inner.peer().ok_or_else(|| InvalidArgumentError::new_err("the policy has no peer tier"))?;
        if let Some(s) = secret {
            peer.set_secret(s);
        }
        peer.set_cluster(&hosts, &addrs).map_err(err)
    }

    /// Bytes in use under the memory tier's root (all ranks of this host).
    fn memory_used(&self, py: Python<'_>) -> PyResult<u64> {
        py.allow_threads(|| self.inner.memory().used_bytes()).map_err(err)
    }

    /// Pre-faulted spare segments held by this process.
    fn pool_len(&self) -> usize {
        self.inner.memory().pool_len()
    }

    /// Background jobs queued or running.
    fn pending(&self) -> usize {
        self.inner.scheduler().pending()
    }

    fn flush(&self, py: Python<'_>) {
        py.allow_threads(|| self.inner.flush())
    }

    fn close(&self, py: Python<'_>) {
        py.allow_threads(|| self.inner.close())
    }
}

/// One item of `StepWriter.add_part`: (name, kind, dtype, shape, nbytes, meta_json), with an
/// optional 7th element, the shard as JSON (or None).
#[derive(FromPyObject)]
enum SpecTuple {
    Seven((String, String, String, Vec<u64>, u64, String, Option<String>)),
    Six((String, String, String, Vec<u64>, u64, String)),
}

#[pyclass(module = "tiercel._core", frozen)]
pub struct StepWriter {
    inner: Mutex<Option<core::StepWriter>>,
}

impl StepWriter {
    fn with<T>(&self, f: impl FnOnce(&mut core::StepWriter) -> Result<T, Error>) -> PyResult<T> {
        let mut g = self.inner.lock();
        let w = g.as_mut().ok_or_else(|| InvalidArgumentError::new_err("this step was already committed or aborted"))?;
        f(w).map_err(err)
    }
}

#[pymethods]
impl StepWriter {
    #[getter]
    fn step(&self) -> PyResult<u64> {
        self.with(|w| Ok(w.step()))
    }

    /// Lays out one put: items are (name, kind, dtype, shape, nbytes, meta_json[,
    /// shard_json]), shard_json being None or `{"global_shape", "offsets", "replica_id"}`.
    /// Returns (part, [(item index, offset in the part's segment)]).
    fn add_part(&self, py: Python<'_>, name: &str, tree_json: &str, items: Vec<SpecTuple>) -> PyResult<(usize, Vec<(usize, u64)>)> {
        let tree = parse_json(tree_json, "tree")?;
        let mut specs = vec![];
        for t in items {
            let ((name, kind, dtype, shape, nbytes, meta), shard) = match t {
                SpecTuple::Six(six) => (six, None),
                SpecTuple::Seven((a, b, c, d, e, f, g)) => ((a, b, c, d, e, f), g),
            };
            let shard = match shard {
                Some(s) => Some(serde_json::from_str::<ShardInfo>(&s).map_err(|e| {
                    InvalidArgumentError::new_err(format!(
                        "item '{name}': shard must be JSON {{\"global_shape\": [...], \"offsets\": [...], \"replica_id\": n}}: {e}"
                    ))
                })?),
                None => None,
            };
            specs.push(ItemSpec { meta: parse_json(&meta, "item meta")?, name, kind, dtype, shape, nbytes, shard });
        }
        py.allow_threads(|| self.with(|w| w.add_part(name, tree, specs)))
    }

    /// The writable shared-memory segment of a part.
    fn segment(&self, part: usize) -> PyResult<Buffer> {
        self.with(|w| w.segment(part)).map(|s| Buffer { backing: Backing::Segment(s) })
    }

    /// Copies items from host memory: [(item index, source address)], GIL released. The
    /// caller keeps every source alive and unchanged during the call.
    fn copy_items(&self, py: Python<'_>, srcs: Vec<(usize, usize)>) -> PyResult<()> {
        py.allow_threads(|| self.with(|w| unsafe { w.copy_items(&srcs) }))
    }

    /// Marks items the caller wrote into the segment itself (device tensors, strided arrays).
    fn mark_written(&self, items: Vec<usize>) -> PyResult<()> {
        self.with(|w| w.mark_written(&items))
    }

    /// The manifest as laid out so far (JSON).
    fn manifest_json(&self) -> PyResult<String> {
        self.with(|w| Ok(json(w.manifest())))
    }

    fn commit(&self, py: Python<'_>) -> PyResult<SaveHandle> {
        let w = self.inner.lock().take().ok_or_else(|| InvalidArgumentError::new_err("this step was already committed or aborted"))?;
        let h = py.allow_threads(|| w.commit()).map_err(err)?;
        Ok(SaveHandle { inner: h })
    }

    /// Discards the step: its shared memory is freed and nothing becomes visible.
    fn abort(&self) {
        self.inner.lock().take();
    }
}

#[pyclass(module = "tiercel._core", frozen)]
pub struct SaveHandle {
    inner: Arc<core::SaveHandle>,
}

#[pymethods]
impl SaveHandle {
    #[getter]
    fn step(&self) -> u64 {
        self.inner.step
    }

    /// {tier: state}; states: pending, running, written, committed, not scheduled,
    /// "skipped: why", "failed: error".
    fn states(&self) -> Vec<(String, String)> {
        self.inner.states().into_iter().map(|(n, s)| (n, s.describe())).collect()
    }

    fn done(&self) -> bool {
        self.inner.done()
    }

    /// Waits (GIL released) until every tier is final; False on timeout.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> bool {
        let t = timeout.map(Duration::from_secs_f64);
        py.allow_threads(|| self.inner.wait(t))
    }
}

#[pyclass(module = "tiercel._core", frozen)]
pub struct StepReader {
    inner: core::StepReader,
}

#[pymethods]
impl StepReader {
    #[getter]
    fn step(&self) -> u64 {
        self.inner.step
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.inner.rank
    }

    fn manifest_json(&self) -> String {
        json(self.inner.manifest())
    }

    /// Tiers that hold this step, in restore order.
    fn tiers(&self) -> Vec<String> {
        self.inner.tiers()
    }

    fn warnings(&self) -> Vec<String> {
        self.inner.warnings.lock().clone()
    }

    /// Reads items by index (GIL released): [(Buffer, tier it came from)].
    fn read_items(&self, py: Python<'_>, items: Vec<usize>) -> PyResult<Vec<(Buffer, String)>> {
        let got = py.allow_threads(|| self.inner.read_items(&items)).map_err(err)?;
        Ok(got.into_iter().map(|(d, tier)| (Buffer::from(d), tier)).collect())
    }

    /// Reads bytes `start .. start + length` of one item (GIL released), reading only the
    /// chunks that overlap them: (Buffer, tier it came from).
    fn read_range(&self, py: Python<'_>, item: usize, start: u64, length: u64) -> PyResult<(Buffer, String)> {
        let (d, tier) = py.allow_threads(|| self.inner.read_range(item, start, length)).map_err(err)?;
        Ok((Buffer::from(d), tier))
    }
}

/// Prints the core's log records at or above the level in $TIERCEL_LOG (default: warn) to
/// stderr, so background failures are seen even when nobody waits on a handle.
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::max_level()
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            eprintln!("tiercel {}: {}", r.level().as_str().to_lowercase(), r.args());
        }
    }
    fn flush(&self) {}
}

static LOGGER: StderrLog = StderrLog;

/// GEMINI placement of `hosts` hosts with `replicas` copies each ("group", "ring" or "mixed"):
/// (groups, then the ring part if any; holders per host, the host itself first; the exact
/// probability that no host loses every copy when `failures` hosts fail at once; GEMINI's
/// closed form for group placement, when `replicas` divides `hosts`).
#[pyfunction]
#[pyo3(signature = (hosts, replicas, strategy, failures=None))]
#[allow(clippy::type_complexity)]
fn placement(
    hosts: usize,
    replicas: usize,
    strategy: &str,
    failures: Option<usize>,
) -> PyResult<(Vec<Vec<usize>>, Vec<Vec<usize>>, Option<f64>, Option<f64>)> {
    use tiercel_core::placement as pl;
    let p = pl::Placement::new(hosts, replicas, pl::Strategy::parse(strategy).map_err(err)?).map_err(err)?;
    let holders = (0..hosts).map(|h| p.holders(h)).collect();
    let exact = failures.map(|k| p.survival_probability(k)).transpose().map_err(err)?;
    let closed = failures.filter(|_| hosts % replicas == 0).map(|k| pl::gemini_closed_form(hosts, replicas, k));
    Ok((p.groups(), holders, exact, closed))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let level = match std::env::var("TIERCEL_LOG").unwrap_or_default().to_lowercase().as_str() {
        "off" => log::LevelFilter::Off,
        "error" => log::LevelFilter::Error,
        "info" => log::LevelFilter::Info,
        "debug" => log::LevelFilter::Debug,
        _ => log::LevelFilter::Warn,
    };
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level);
    }
    let py = m.py();
    m.add("TiercelError", py.get_type::<TiercelError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("IntegrityError", py.get_type::<IntegrityError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("TierUnavailableError", py.get_type::<TierUnavailableError>())?;
    m.add("CapacityError", py.get_type::<CapacityError>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add_class::<Store>()?;
    m.add_class::<StepWriter>()?;
    m.add_class::<SaveHandle>()?;
    m.add_class::<StepReader>()?;
    m.add_class::<Buffer>()?;
    m.add("FORMAT_VERSION", tiercel_core::format::FORMAT_VERSION)?;
    m.add_function(wrap_pyfunction!(placement, m)?)?;
    Ok(())
}
