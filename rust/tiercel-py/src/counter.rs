//! The job-wide counter of the commit protocol (`tiercel_core::store::StepCounter`) from a
//! Python callable: a coordinator's `counter()` (`add(key, by) -> int`, and `delete(key)`
//! where the store can delete keys), called from the Store's background threads with the
//! GIL held for the call only.

use pyo3::prelude::*;

use tiercel_core::error::{Error, Result};
use tiercel_core::store::StepCounter;

use crate::pytier::{describe_exception, InFlight};

pub struct PyCounter {
    add: Py<PyAny>,
    /// The callable's `delete`, if it has one.
    delete: Option<Py<PyAny>>,
    /// Where it came from, for messages ("TorchCoordinator's c10d store").
    source: String,
}

impl PyCounter {
    pub fn new(py: Python<'_>, add: Py<PyAny>) -> PyCounter {
        let bound = add.bind(py);
        let delete = bound.getattr("delete").ok().filter(|d| d.is_callable()).map(|d| d.unbind());
        let source = bound.getattr("source").and_then(|s| s.extract::<String>()).unwrap_or_else(|_| "the coordinator's counter".into());
        PyCounter { add, delete, source }
    }

    /// Calls `f` with the GIL; a Python exception (or an exiting interpreter) becomes an
    /// unavailable error naming the counter, the operation and the key.
    fn call<T>(&self, op: &str, key: &str, f: impl FnOnce(Python<'_>) -> PyResult<T>) -> Result<T> {
        let Some(_in_flight) = InFlight::enter_unless_exiting() else {
            return Err(Error::unavailable(format!("{}: {op} '{key}': not called, the Python interpreter is exiting", self.source)));
        };
        Python::with_gil(|py| {
            f(py).map_err(|e| {
                Error::unavailable(format!(
                    "{}: {op} '{key}' failed: {}; check that the job's coordinator (its TCPStore or JAX service) is still up",
                    self.source,
                    describe_exception(py, &e)
                ))
            })
        })
    }
}

impl StepCounter for PyCounter {
    fn add(&self, key: &str, by: i64) -> Result<i64> {
        self.call("add", key, |py| self.add.bind(py).call1((key, by))?.extract::<i64>())
    }

    fn delete(&self, key: &str) -> Result<()> {
        let Some(d) = &self.delete else { return Ok(()) };
        self.call("delete", key, |py| d.bind(py).call1((key,)).map(drop))
    }
}
