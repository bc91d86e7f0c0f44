//! A tier written in Python as a core `Blobs`: every call goes to the user's object with the
//! GIL held for that call only, at most `concurrency` calls in flight. A missing key
//! (`FileNotFoundError`, `KeyError`) is the core's NotFound; any other exception a tier
//! failure naming the tier, the key, the user's error and where it was raised, which the
//! core treats like any other tier's failure (falls back, never fails the other tiers).
//! The protocol itself is documented in docs/tiers.md.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyFileNotFoundError, PyKeyError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use tiercel_core::blobs::{BlobWriter, Blobs};
use tiercel_core::error::{Error, Result};

/// The first read of an object of unknown size (`get` without the optional `get` method);
/// each further read asks for twice as much.
const FIRST_READ: usize = 1 << 20;

/// Set once the interpreter begins to exit (`tiercel.tiers` registers `exiting` with
/// `atexit`): a thread that asked for the GIL after that would be ended by CPython inside
/// Rust, which aborts the process; calls from then on fail as the tier's failure instead.
static EXITING: AtomicBool = AtomicBool::new(false);
/// Calls into Python tiers in flight (waiting for the GIL or holding it), in all tiers.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// The interpreter is exiting: refuse new calls into Python tiers, and let those in flight
/// return before finalization starts (a call cut off there would abort the process).
#[pyfunction]
pub fn exiting(py: Python<'_>) {
    EXITING.store(true, Ordering::SeqCst);
    py.allow_threads(|| {
        let (start, mut told) = (Instant::now(), false);
        while IN_FLIGHT.load(Ordering::SeqCst) > 0 {
            if !told && start.elapsed() > Duration::from_secs(5) {
                told = true;
                log::warn!("exiting: waiting for {} call(s) into Python tiers to return", IN_FLIGHT.load(Ordering::SeqCst));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
}

/// One call into Python from a Rust thread, counted while it lasts (`exiting` waits for it).
pub(crate) struct InFlight;

impl InFlight {
    /// Counts a call in; None once the interpreter is exiting (the call must not be made).
    pub(crate) fn enter_unless_exiting() -> Option<InFlight> {
        let f = InFlight::enter();
        (!EXITING.load(Ordering::SeqCst)).then_some(f)
    }

    fn enter() -> InFlight {
        IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts calls in flight.
struct Gate {
    free: Mutex<usize>,
    freed: Condvar,
}

struct Permit<'a>(&'a Gate);

impl Gate {
    fn enter(&self) -> Permit<'_> {
        let mut free = self.free.lock();
        while *free == 0 {
            self.freed.wait(&mut free);
        }
        *free -= 1;
        Permit(self)
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        *self.0.free.lock() += 1;
        self.0.freed.notify_one();
    }
}

/// What the tier's object offers beyond the five required methods.
#[derive(Clone, Copy)]
struct Optional {
    get: bool,
    exists: bool,
    writer: bool,
    delete_prefix: bool,
}

struct Inner {
    tier: String,
    /// Where the tier lives, for messages: its url, else its factory.
    location: String,
    obj: Py<PyAny>,
    /// Prepended to every key (`check_tier` runs each case under its own).
    base: String,
    gate: Gate,
    has: Optional,
}

pub struct PyBlobs(Arc<Inner>);

impl PyBlobs {
    pub fn new(py: Python<'_>, tier: &str, location: &str, obj: Py<PyAny>, base: &str, concurrency: usize) -> PyBlobs {
        let o = obj.bind(py);
        let has = |m: &str| o.hasattr(m).unwrap_or(false);
        let has = Optional { get: has("get"), exists: has("exists"), writer: has("writer"), delete_prefix: has("delete_prefix") };
        PyBlobs(Arc::new(Inner {
            tier: tier.into(),
            location: location.trim_end_matches('/').into(),
            obj,
            base: base.into(),
            gate: Gate { free: Mutex::new(concurrency.max(1)), freed: Condvar::new() },
            has,
        }))
    }
}

/// `ValueError: disk full (at mypkg/tiers.py:42)`: the user's exception and the innermost
/// place it was raised.
pub(crate) fn describe_exception(py: Python<'_>, e: &PyErr) -> String {
    let kind = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_else(|_| "Exception".into());
    let mut text = match e.value(py).str() {
        Ok(s) if !s.to_string_lossy().is_empty() => format!("{kind}: {}", s.to_string_lossy()),
        _ => kind,
    };
    let mut tb = e.traceback(py).map(|t| t.into_any());
    let mut last = None;
    while let Some(t) = tb {
        last = Some(t.clone());
        tb = t.getattr("tb_next").ok().filter(|n| !n.is_none());
    }
    if let Some(t) = last {
        let file = t.getattr("tb_frame").and_then(|f| f.getattr("f_code")).and_then(|c| c.getattr("co_filename"));
        if let (Ok(file), Ok(line)) = (file, t.getattr("tb_lineno")) {
            text.push_str(&format!(" (at {file}:{line})"));
        }
    }
    text
}

impl Inner {
    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.base)
    }

    fn describe(&self, key: &str) -> String {
        format!("{}/{}", self.location, self.key(key))
    }

    /// Calls into the object with the GIL held for the call only; a Python exception becomes
    /// the core's error, naming what `op` did to `key`.
    fn call<T>(&self, op: &str, key: &str, f: impl FnOnce(Python<'_>, &Bound<'_, PyAny>) -> PyResult<T>) -> Result<T> {
        let _permit = self.gate.enter();
        let _in_flight = InFlight::enter();
        if EXITING.load(Ordering::SeqCst) {
            return Err(Error::unavailable(format!(
                "tier '{}': {op} {}: not called, the Python interpreter is exiting",
                self.tier,
                self.describe(key)
            ))
            .with_tier(&self.tier));
        }
        Python::with_gil(|py| f(py, self.obj.bind(py)).map_err(|e| self.error(py, op, key, &e)))
    }

    fn error(&self, py: Python<'_>, op: &str, key: &str, e: &PyErr) -> Error {
        let what = self.describe(key);
        let user = describe_exception(py, e);
        let missing = e.is_instance_of::<PyFileNotFoundError>(py) || e.is_instance_of::<PyKeyError>(py);
        let err = if missing {
            Error::not_found(format!("tier '{}': {what} not found ({op}: {user})", self.tier))
        } else {
            Error::unavailable(format!("tier '{}': {op} {what} failed: {user}", self.tier))
        };
        err.with_tier(&self.tier).with_path(what)
    }

    fn shorter(&self, key: &str) -> Error {
        Error::integrity(format!("tier '{}': {} is shorter than its manifest says", self.tier, self.describe(key)))
            .with_tier(&self.tier)
            .with_path(self.describe(key))
    }

    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        self.call("put", key, |py, o| o.call_method1("put", (self.key(key), PyBytes::new(py, data))).map(drop))
    }

    /// Reads up to `len` bytes at `offset` into `dst` (cleared first); how many arrived.
    fn read(&self, key: &str, offset: u64, len: usize, dst: &mut Vec<u8>) -> Result<usize> {
        self.call("get_range", key, |py, o| {
            let got = o.call_method1("get_range", (self.key(key), offset, len))?;
            let buf = PyBuffer::<u8>::get(&got)?;
            dst.clear();
            dst.extend_from_slice(&buf.to_vec(py)?);
            Ok(dst.len())
        })
    }
}

impl Blobs for PyBlobs {
    fn describe(&self, key: &str) -> String {
        self.0.describe(key)
    }

    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        self.0.put(key, data)
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> Result<bool> {
        let i = &self.0;
        let r = i.call("put_if_absent", key, |py, o| {
            o.call_method1("put_if_absent", (i.key(key), PyBytes::new(py, data)))?.extract::<Option<bool>>()
        })?;
        r.ok_or_else(|| {
            Error::unavailable(format!(
                "tier '{}': put_if_absent({}) returned None; it must return True (created) or False (it existed)",
                i.tier,
                i.describe(key)
            ))
            .with_tier(&i.tier)
        })
    }

    fn create(&self, key: &str) -> Result<Box<dyn BlobWriter>> {
        let i = &self.0;
        if !i.has.writer {
            return Ok(Box::new(Buffered { blobs: i.clone(), key: key.into(), data: vec![] }));
        }
        let w = i.call("writer", key, |_, o| o.call_method1("writer", (i.key(key),)).map(Bound::unbind))?;
        Ok(Box::new(Streaming { blobs: i.clone(), key: key.into(), writer: Some(w) }))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        let i = &self.0;
        if i.has.get {
            return i.call("get", key, |py, o| PyBuffer::<u8>::get(&o.call_method1("get", (i.key(key),))?)?.to_vec(py));
        }
        // Ranges of growing size until one comes back short: the object's end.
        let (mut out, mut piece, mut want) = (vec![], vec![], FIRST_READ);
        loop {
            let n = i.read(key, out.len() as u64, want, &mut piece)?;
            out.extend_from_slice(&piece);
            if n < want {
                return Ok(out);
            }
            want = (want * 2).min(256 << 20);
        }
    }

    fn get_range(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
        let i = &self.0;
        let want = dst.len();
        // Straight from the returned buffer into `dst` (one copy).
        let n = i.call("get_range", key, |py, o| {
            let buf = PyBuffer::<u8>::get(&o.call_method1("get_range", (i.key(key), offset, want))?)?;
            if buf.item_count() == want {
                buf.copy_to_slice(py, dst)?;
            }
            Ok(buf.item_count())
        })?;
        if n < want {
            return Err(i.shorter(key));
        }
        if n > want {
            return Err(Error::unavailable(format!(
                "tier '{}': get_range({}, {offset}, {want}) returned {n} bytes, more than asked",
                i.tier,
                i.describe(key)
            ))
            .with_tier(&i.tier));
        }
        Ok(())
    }

    fn exists(&self, key: &str) -> Result<bool> {
        let i = &self.0;
        if i.has.exists {
            return i.call("exists", key, |_, o| o.call_method1("exists", (i.key(key),))?.extract::<bool>());
        }
        match i.read(key, 0, 0, &mut vec![]) {
            Ok(_) => Ok(true),
            Err(e) if e.kind == tiercel_core::error::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        let i = &self.0;
        let names: Vec<String> = match i.call("list", prefix, |_, o| o.call_method1("list", (i.key(prefix),))?.extract::<Vec<String>>()) {
            Ok(n) => n,
            Err(e) if e.kind == tiercel_core::error::ErrorKind::NotFound => vec![],
            Err(e) => return Err(e),
        };
        // Names, as the protocol asks; a full path or a directory's trailing '/' is forgiven.
        let mut names: Vec<String> = names
            .iter()
            .map(|n| n.trim_end_matches('/').rsplit('/').next().unwrap_or_default().to_string())
            .filter(|n| !n.is_empty())
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    fn delete(&self, key: &str) -> Result<()> {
        let i = &self.0;
        match i.call("delete", key, |_, o| o.call_method1("delete", (i.key(key),)).map(drop)) {
            Err(e) if e.kind == tiercel_core::error::ErrorKind::NotFound => Ok(()),
            r => r,
        }
    }

    fn delete_prefix(&self, prefix: &str) -> Result<()> {
        let i = &self.0;
        if i.has.delete_prefix {
            return match i.call("delete_prefix", prefix, |_, o| o.call_method1("delete_prefix", (i.key(prefix),)).map(drop)) {
                Err(e) if e.kind == tiercel_core::error::ErrorKind::NotFound => Ok(()),
                r => r,
            };
        }
        // Without it: each name under the prefix, deleted as an object and emptied as a
        // directory (`list` does not tell the two apart).
        for name in self.list(prefix)? {
            let key = if prefix.is_empty() { name } else { format!("{}/{name}", prefix.trim_end_matches('/')) };
            self.delete(&key)?;
            self.delete_prefix(&key)?;
        }
        Ok(())
    }
}

/// A write of an object whose tier has no `writer`: the bytes are gathered and put at once.
struct Buffered {
    blobs: Arc<Inner>,
    key: String,
    data: Vec<u8>,
}

impl BlobWriter for Buffered {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.data.extend_from_slice(data);
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<()> {
        self.blobs.put(&self.key, &self.data)
    }

    fn abort(self: Box<Self>) {}
}

/// A write through the tier's own `writer(key)`: `write(data)` per piece, `commit()` makes
/// the object appear, `abort()` drops it.
struct Streaming {
    blobs: Arc<Inner>,
    key: String,
    writer: Option<Py<PyAny>>,
}

impl Streaming {
    fn method(&self, name: &str, arg: Option<&[u8]>) -> Result<()> {
        let Some(w) = &self.writer else { return Ok(()) };
        self.blobs.call(name, &self.key, |py, _| {
            let w = w.bind(py);
            match arg {
                Some(data) => w.call_method1(name, (PyBytes::new(py, data),)).map(drop),
                None => w.call_method0(name).map(drop),
            }
        })
    }
}

impl BlobWriter for Streaming {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.method("write", Some(data))
    }

    fn finish(mut self: Box<Self>) -> Result<()> {
        let r = self.method("commit", None);
        self.writer = None;
        r
    }

    fn abort(mut self: Box<Self>) {
        if let Err(e) = self.method("abort", None) {
            log::warn!("{e}");
        }
        self.writer = None;
    }
}

impl Drop for Streaming {
    /// A writer dropped without finish or abort (a failed write): aborted.
    fn drop(&mut self) {
        if self.writer.is_some() {
            let _ = self.method("abort", None);
        }
    }
}
