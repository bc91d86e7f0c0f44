//! The one mapping of core errors to Python exceptions: each `ErrorKind` to its class in
//! `tiercel.errors` (imported once; `_core` re-exports the same class objects), each context
//! field to the exception's attribute of the same name.

use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyDict;

use tiercel_core::error::{Error, ErrorKind};

/// The Python module that defines the exception classes.
const ERRORS_MODULE: &str = "tiercel.errors";

static ERRORS: GILOnceCell<Py<PyModule>> = GILOnceCell::new();

/// `tiercel.errors`, imported on first use.
pub fn module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    Ok(ERRORS.get_or_try_init(py, || Ok::<_, PyErr>(py.import(ERRORS_MODULE)?.unbind()))?.bind(py))
}

/// The class names, by kind; `TiercelError` is their base.
pub const CLASSES: [(ErrorKind, &str); 6] = [
    (ErrorKind::Config, "ConfigError"),
    (ErrorKind::Integrity, "IntegrityError"),
    (ErrorKind::NotFound, "NotFoundError"),
    (ErrorKind::TierUnavailable, "TierUnavailableError"),
    (ErrorKind::Capacity, "CapacityError"),
    (ErrorKind::InvalidArgument, "InvalidArgumentError"),
];

fn class_name(kind: ErrorKind) -> &'static str {
    CLASSES.iter().find(|(k, _)| *k == kind).map(|(_, n)| *n).expect("every kind has a class")
}

/// The exception instance for `e`: its kind's class, its message, its fields as attributes.
pub fn exception<'py>(py: Python<'py>, e: &Error) -> PyResult<Bound<'py, PyAny>> {
    let cls = module(py)?.getattr(class_name(e.kind))?;
    let kw = PyDict::new(py);
    kw.set_item("tier", e.tier.as_deref())?;
    kw.set_item("step", e.step)?;
    kw.set_item("rank", e.rank)?;
    kw.set_item("item", e.item.as_deref())?;
    kw.set_item("chunk", e.chunk)?;
    kw.set_item("path", e.path.as_deref())?;
    cls.call((e.message.as_str(),), Some(&kw))
}

/// What every binding returns on failure: a core error (raised as its tiercel class) or a
/// Python one (raised as it is), so that `?` works on both.
pub enum TcError {
    Core(Error),
    Py(PyErr),
}

pub type TcResult<T> = Result<T, TcError>;

impl From<Error> for TcError {
    fn from(e: Error) -> Self {
        TcError::Core(e)
    }
}

impl From<PyErr> for TcError {
    fn from(e: PyErr) -> Self {
        TcError::Py(e)
    }
}

impl From<TcError> for PyErr {
    fn from(e: TcError) -> PyErr {
        match e {
            TcError::Py(e) => e,
            TcError::Core(e) => Python::with_gil(|py| match exception(py, &e) {
                Ok(instance) => PyErr::from_value(instance),
                Err(failed) => failed, // tiercel.errors cannot be imported: say that
            }),
        }
    }
}

/// A wrong argument or a call out of order.
pub fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(message)
}
