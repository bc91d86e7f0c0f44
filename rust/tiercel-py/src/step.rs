//! `_core.StepWriter`, `SaveHandle` and `StepReader`: one step being written, what its save
//! has done where, and one step being read.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use tiercel_core::error::Error;
use tiercel_core::format::ShardInfo;
use tiercel_core::policy::ReplicatedMode;
use tiercel_core::store::{self as core, ItemSpec};

use crate::buffer::{Backing, Buffer};
use crate::errors::{invalid, TcResult};
use crate::{json, parse_json};

/// One item of `StepWriter.add_part`: (name, kind, dtype, shape, nbytes, meta_json), with an
/// optional 7th element, the shard as JSON (or None).
#[derive(FromPyObject)]
enum SpecTuple {
    Seven((String, String, String, Vec<u64>, u64, String, Option<String>)),
    Six((String, String, String, Vec<u64>, u64, String)),
}

#[pyclass(module = "tiercel._core", frozen)]
pub struct StepWriter {
    pub(crate) inner: Mutex<Option<core::StepWriter>>,
}

impl StepWriter {
    fn with<T>(&self, f: impl FnOnce(&mut core::StepWriter) -> Result<T, Error>) -> TcResult<T> {
        let mut g = self.inner.lock();
        let w = g.as_mut().ok_or_else(|| invalid("this step was already committed or aborted"))?;
        Ok(f(w)?)
    }
}

#[pymethods]
impl StepWriter {
    #[getter]
    fn step(&self) -> TcResult<u64> {
        self.with(|w| Ok(w.step()))
    }

    /// Lays out one put: items are (name, kind, dtype, shape, nbytes, meta_json[,
    /// shard_json]), shard_json being None or `{"global_shape", "offsets", "replica_id"}`.
    /// `replica`: the lowest rank of the replica group when every rank of it puts the same
    /// bytes (a replicated put). Returns (part, [(item index, offset in the part's segment)]).
    #[pyo3(signature = (name, tree_json, items, replica=None))]
    fn add_part(
        &self,
        py: Python<'_>,
        name: &str,
        tree_json: &str,
        items: Vec<SpecTuple>,
        replica: Option<u32>,
    ) -> TcResult<(usize, Vec<(usize, u64)>)> {
        let tree = parse_json(tree_json, "tree")?;
        let mut specs = vec![];
        for t in items {
            let ((name, kind, dtype, shape, nbytes, meta), shard) = match t {
                SpecTuple::Six(six) => (six, None),
                SpecTuple::Seven((a, b, c, d, e, f, g)) => ((a, b, c, d, e, f), g),
            };
            let shard = match shard {
                Some(s) => Some(serde_json::from_str::<ShardInfo>(&s).map_err(|e| {
                    invalid(format!(
                        "item '{name}': shard must be JSON {{\"global_shape\": [...], \"offsets\": [...], \"replica_id\": n}}: {e}"
                    ))
                })?),
                None => None,
            };
            specs.push(ItemSpec { meta: parse_json(&meta, "item meta")?, name, kind, dtype, shape, nbytes, shard, replica });
        }
        py.allow_threads(|| self.with(|w| w.add_part(name, tree, specs)))
    }

    /// The writable shared-memory segment of a part.
    fn segment(&self, part: usize) -> TcResult<Buffer> {
        self.with(|w| w.segment(part)).map(|s| Buffer { backing: Backing::Segment(s) })
    }

    /// Copies items from host memory: [(item index, source address)], GIL released. The
    /// caller keeps every source alive and unchanged during the call.
    fn copy_items(&self, py: Python<'_>, srcs: Vec<(usize, usize)>) -> TcResult<()> {
        py.allow_threads(|| self.with(|w| unsafe { w.copy_items(&srcs) }))
    }

    /// Marks items the caller wrote into the segment itself (device tensors, strided arrays).
    fn mark_written(&self, items: Vec<usize>) -> TcResult<()> {
        self.with(|w| w.mark_written(&items))
    }

    /// The manifest as laid out so far (JSON).
    fn manifest_json(&self) -> TcResult<String> {
        self.with(|w| Ok(json(w.manifest())))
    }

    fn commit(&self, py: Python<'_>) -> TcResult<SaveHandle> {
        let w = self.inner.lock().take().ok_or_else(|| invalid("this step was already committed or aborted"))?;
        let h = py.allow_threads(|| w.commit())?;
        Ok(SaveHandle { inner: h })
    }

    /// Discards the step: its shared memory is freed and nothing becomes visible.
    fn abort(&self) {
        self.inner.lock().take();
    }
}

/// How often a wait with the GIL released looks for Ctrl-C.
const POLL: Duration = Duration::from_millis(100);

#[pyclass(module = "tiercel._core", frozen)]
pub struct SaveHandle {
    pub(crate) inner: Arc<core::SaveHandle>,
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

    /// [(tier, effective interval in iterations, why)]: tiers whose checkpoints do not fit
    /// the training job's idle time at their `every` (`[traffic] mode = "learned"`).
    fn notes(&self) -> Vec<(String, u64, String)> {
        self.inner.notes()
    }

    /// The tiers whose background work failed, each with its error as the exception it is
    /// (its kind's class, message and fields): [(tier, TiercelError)].
    fn errors<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
        self.inner
            .states()
            .into_iter()
            .filter_map(|(tier, st)| match st {
                core::TierState::Failed(e) => Some((tier, e)),
                _ => None,
            })
            .map(|(tier, e)| Ok((tier, crate::errors::exception(py, &e)?)))
            .collect()
    }

    /// Waits (GIL released) until every tier is final; False on timeout. `commit`: until
    /// the step's commit record is on every tier this rank wrote it to, too (or it never
    /// will be). Ctrl-C interrupts the wait (checked every 100 ms).
    #[pyo3(signature = (timeout=None, commit=false))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>, commit: bool) -> PyResult<bool> {
        let deadline = timeout.map(|t| std::time::Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
            let slice = left.map_or(POLL, |l| l.min(POLL));
            if py.allow_threads(|| self.inner.wait(Some(slice), commit)) {
                return Ok(true);
            }
            if left.is_some_and(|l| l <= slice) {
                return Ok(false);
            }
            py.check_signals()?;
        }
    }
}

#[pyclass(module = "tiercel._core", frozen)]
pub struct StepReader {
    pub(crate) inner: core::StepReader,
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

    /// How many ranks saved the step (from the commit record this reader read).
    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.world_size
    }

    /// Which save of the step this reader reads ("<launch>.<n>"), or None for steps saved
    /// before generations were recorded.
    #[getter]
    fn generation(&self) -> Option<String> {
        self.inner.generation().map(str::to_string)
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
    fn read_items(&self, py: Python<'_>, items: Vec<usize>) -> TcResult<Vec<(Buffer, String)>> {
        let got = py.allow_threads(|| self.inner.read_items(&items))?;
        Ok(got.into_iter().map(|(d, tier)| (Buffer::from(d), tier)).collect())
    }

    /// Reads every replicated item together with the other ranks of the replica group
    /// (collective; GIL released). `members`: (rank, host, relay address) of each, this rank
    /// included; `mode`: "single" or "striped". Returns what it did, as a dict.
    fn broadcast<'py>(&self, py: Python<'py>, members: Vec<(u32, String, String)>, mode: &str) -> TcResult<Bound<'py, PyDict>> {
        let group = group_of(self.inner.store(), members, mode)?;
        let s = py.allow_threads(|| self.inner.broadcast(&group))?;
        stats_dict(py, s)
    }

    /// Reads bytes `start .. start + length` of one item (GIL released), reading only the
    /// chunks that overlap them: (Buffer, tier it came from).
    fn read_range(&self, py: Python<'_>, item: usize, start: u64, length: u64) -> TcResult<(Buffer, String)> {
        let (d, tier) = py.allow_threads(|| self.inner.read_range(item, start, length))?;
        Ok((Buffer::from(d), tier))
    }

    /// Reads bytes `start .. start + len(out)` of one item into `out`, a writable
    /// C-contiguous buffer of bytes (GIL released; the buffer stays exported, so it can be
    /// neither resized nor freed meanwhile). Each chunk is copied and verified in parallel.
    /// Returns the tier(s) the bytes came from.
    fn read_into(&self, py: Python<'_>, item: usize, start: u64, out: PyBuffer<u8>) -> TcResult<String> {
        if out.readonly() || !out.is_c_contiguous() {
            return Err(invalid("read_into needs a writable, C-contiguous buffer").into());
        }
        let (addr, len) = (out.buf_ptr() as usize, out.len_bytes());
        // Safety: `out` holds the export until it is dropped after the call; no Python code
        // runs on it meanwhile, and no other Rust reference to the memory exists.
        let tier = py.allow_threads(|| {
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            self.inner.read_into(item, start, dst)
        })?;
        drop(out);
        Ok(tier)
    }
}

/// The group of a broadcast: `members` are (rank, host, relay address); `mode` "single" or
/// "striped"; window and deadline from the store's `[restore]` policy.
pub(crate) fn group_of(store: &core::Store, members: Vec<(u32, String, String)>, mode: &str) -> TcResult<core::Group> {
    let policy = store.policy.replicated;
    let mode = match ReplicatedMode::parse(mode) {
        Some(m @ (ReplicatedMode::Single | ReplicatedMode::Striped)) => m,
        _ => return Err(invalid(format!("broadcast mode must be \"single\" or \"striped\", got {mode:?}")).into()),
    };
    let members = members.into_iter().map(|(rank, host, addr)| core::Member { rank, host, addr }).collect();
    Ok(core::Group { members, mode, window: policy.window, timeout: policy.timeout })
}

/// What a broadcast did, as the dict `RestoreInfo.broadcast` shows.
pub(crate) fn stats_dict(py: Python<'_>, s: core::BroadcastStats) -> TcResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("mode", s.mode)?;
    d.set_item("items", s.items)?;
    d.set_item("bytes_read", s.bytes_read)?;
    d.set_item("bytes_received", s.bytes_received)?;
    d.set_item("bytes_sent", s.bytes_sent)?;
    d.set_item("read_seconds", s.read_seconds)?;
    d.set_item("receive_seconds", s.receive_seconds)?;
    d.set_item("fallbacks", s.fallbacks)?;
    d.set_item("dropped", s.dropped)?;
    d.set_item("warnings", s.warnings)?;
    d.set_item("seconds", s.seconds)?;
    Ok(d)
}
