//! The core's metrics as Python values. The field lists come from the core
//! (`tiercel_core::store::metrics`) and are iterated here, so a new metric needs no edit in
//! the bindings nor in the Prometheus text (tiercel/metrics.py iterates the same lists).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use tiercel_core::store::metrics::{Field, Value, TIER_FIELDS, TIMINGS, TIMING_FIELDS};

/// `(name, Prometheus type, help)` of each field of a list.
fn described(fields: &[Field]) -> Vec<(&'static str, &'static str, &'static str)> {
    fields.iter().map(|f| (f.name, f.kind.as_str(), f.help)).collect()
}

/// `TIER_FIELDS`, `TIMING_FIELDS` and `TIMINGS` ((name, what it measures)) on the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TIER_FIELDS", described(TIER_FIELDS))?;
    m.add("TIMING_FIELDS", described(TIMING_FIELDS))?;
    m.add("TIMINGS", TIMINGS.to_vec())?;
    Ok(())
}

/// One snapshot as a dict: `key` (the tier, the timing) first, then every field in its
/// list's order; a value not known yet is None.
pub fn dict<'py>(py: Python<'py>, key: (&str, &str), values: Vec<(&'static str, Option<Value>)>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(key.0, key.1)?;
    for (name, value) in values {
        match value {
            Some(Value::Int(n)) => d.set_item(name, n)?,
            Some(Value::Float(x)) => d.set_item(name, x)?,
            None => d.set_item(name, py.None())?,
        }
    }
    Ok(d)
}
