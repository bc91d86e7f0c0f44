//! `Buffer`: memory handed to Python through the buffer protocol, without a copy.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;

use tiercel_core::shm::{Segment, View};
use tiercel_core::store::ItemData;

/// Memory handed to Python through the buffer protocol: a segment being written, a
/// zero-copy view of a stored object, or bytes read from a slower tier.
pub enum Backing {
    Segment(Arc<Segment>),
    View(Arc<View>, usize, usize),
    Owned(Vec<u8>),
}

#[pyclass(module = "tiercel._core", frozen)]
pub struct Buffer {
    pub backing: Backing,
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
