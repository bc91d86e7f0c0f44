//! `_core.Traffic`: the training job's communication signals to a store's scheduler, and
//! what the scheduler learned from them (see `tiercel_core::scheduler`).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use tiercel_core::scheduler::LinkKind;
use tiercel_core::store as core;

use crate::errors::TcResult;

#[pyclass(module = "tiercel._core", frozen)]
pub struct Traffic {
    pub(crate) store: Arc<core::Store>,
}

#[pymethods]
impl Traffic {
    /// The training job starts communicating (nested calls count).
    fn busy(&self) {
        self.store.traffic().busy();
    }

    /// The communication that `busy` announced is over.
    fn idle(&self) -> TcResult<()> {
        Ok(self.store.traffic().idle()?)
    }

    /// A training iteration starts.
    fn iteration(&self) {
        self.store.traffic().iteration();
    }

    /// Starts (clearing it) or stops keeping the timeline.
    fn record(&self, on: bool) {
        self.store.traffic().set_recording(on);
    }

    /// [(t, kind, link, bytes, seconds)]: t in seconds since the store opened; kind "busy",
    /// "idle", "iteration" or "chunk" (seconds: how long the chunk took to send, if known).
    fn timeline(&self) -> Vec<(f64, &'static str, String, u64, Option<f64>)> {
        self.store.traffic().timeline().into_iter().map(|e| (e.t, e.kind, e.link, e.bytes, e.seconds)).collect()
    }

    /// Seconds since the store opened, on the timeline's clock.
    fn now(&self) -> f64 {
        self.store.traffic().now()
    }

    /// {"mode", "mu", "floor", "warmup", "busy", "iterations", "profiled", "waits",
    /// "wait_seconds", "profile": None or {"iteration", "iteration_spread", "iterations",
    /// "spans": [(offset, length, spread)]}, "links": {name: {"network", "bytes_sent",
    /// "bandwidth_limit", "alpha", "bandwidth", "plan"}}}; a link's "plan" is for a checkpoint
    /// of `checkpoint_bytes` (mode "learned", once learned): {"spans": [(offset, usable,
    /// chunks, bytes)], "bytes_per_iteration", "iterations", "effective_interval",
    /// "largest_chunk", "note"}.
    #[pyo3(signature = (checkpoint_bytes=None))]
    fn stats<'py>(&self, py: Python<'py>, checkpoint_bytes: Option<u64>) -> PyResult<Bound<'py, PyDict>> {
        let t = self.store.traffic();
        let st = t.stats();
        let d = PyDict::new(py);
        d.set_item("mode", t.config.mode.as_str())?;
        d.set_item("mu", t.config.mu)?;
        d.set_item("floor", t.config.floor)?;
        d.set_item("warmup", t.config.warmup)?;
        d.set_item("busy", st.busy)?;
        d.set_item("iterations", st.iterations)?;
        d.set_item("profiled", st.profiled)?;
        d.set_item("waits", st.waits)?;
        d.set_item("wait_seconds", st.wait_seconds)?;
        match &st.profile {
            Some(p) => {
                let pd = PyDict::new(py);
                pd.set_item("iteration", p.iteration)?;
                pd.set_item("iteration_spread", p.iteration_spread)?;
                pd.set_item("iterations", p.iterations)?;
                pd.set_item("spans", p.spans.iter().map(|s| (s.offset, s.length, s.spread)).collect::<Vec<_>>())?;
                d.set_item("profile", pd)?;
            }
            None => d.set_item("profile", py.None())?,
        }
        let links = PyDict::new(py);
        for slot in self.store.slots() {
            let l = PyDict::new(py);
            l.set_item("network", slot.link.kind == LinkKind::Network)?;
            l.set_item("bytes_sent", slot.link.bytes_sent())?;
            l.set_item("bandwidth_limit", slot.link.bandwidth_limit())?;
            let m = slot.link.model();
            l.set_item("alpha", m.map(|m| m.alpha))?;
            l.set_item("bandwidth", m.map(|m| m.bandwidth))?;
            match checkpoint_bytes.and_then(|b| self.store.traffic_plan(slot, b)) {
                Some(p) => {
                    let pd = PyDict::new(py);
                    pd.set_item("spans", p.spans.iter().map(|s| (s.offset, s.usable, s.chunks, s.bytes)).collect::<Vec<_>>())?;
                    pd.set_item("bytes_per_iteration", p.bytes_per_iteration)?;
                    pd.set_item("iterations", p.iterations)?;
                    pd.set_item("effective_interval", p.effective_interval)?;
                    pd.set_item("largest_chunk", p.largest_chunk)?;
                    pd.set_item("note", p.note)?;
                    l.set_item("plan", pd)?;
                }
                None => l.set_item("plan", py.None())?,
            }
            links.set_item(&slot.config.name, l)?;
        }
        d.set_item("links", links)?;
        Ok(d)
    }
}
