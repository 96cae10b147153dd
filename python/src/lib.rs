//! The `tumble._tumble` extension: [`tumble_api::Model`] for Python.
//!
//! Instances are converted to the JSON encoding the CLI reads — numpy arrays are attached as
//! tensors instead of being spelled out — so the decoder by type, and its located messages, are
//! the CLI's. Conversion, the run and the conversion back happen on one thread with the CLI's
//! stack (deeply nested instances convert by native recursion), which takes the GIL only while it
//! touches Python objects: other Python threads run meanwhile, and two threads may run the same
//! model at once.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use numpy::{
    PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTimeoutError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};
use std::borrow::Cow;
use tumble_api::{
    Doc, Error as ApiError, Kind, LoadOptions, Model, Num, OutTree, Params, RunOptions, Source,
};
use tumble_tensor::{Buffer, Tensor};

// Same allocator as the CLI (mimalloc without transparent huge pages, counted for the memory
// budget), so that runs from Python take the same time and stop at the same budget.
#[global_allocator]
static GLOBAL: tumble_limits::CountingAlloc<mimalloc::MiMalloc> =
    tumble_limits::CountingAlloc(mimalloc::MiMalloc);

create_exception!(
    tumble,
    Error,
    PyException,
    "Base class of tumble's errors; the message names the place (source line, instance and path in it, parameter)."
);
create_exception!(
    tumble,
    CheckError,
    Error,
    "The model does not parse or type-check, or cannot be read."
);
create_exception!(
    tumble,
    ParamError,
    Error,
    "A parameter is missing, has the wrong shape or dtype, or the weights file is bad."
);
create_exception!(
    tumble,
    InputError,
    Error,
    "An instance does not match @main's argument types; `.instance` is its index."
);
create_exception!(
    tumble,
    RunError,
    Error,
    "Running an instance failed (run-time shape error, memory budget, ...); `.instance` is its index."
);

/// The deepest Python nesting converted (tumble's limit for JSON instances).
const MAX_DEPTH: usize = tumble_api::MAX_INPUT_DEPTH;

/// A message of the shared layers in the package's terms: their hints name the CLI's flags.
fn python_terms(message: String) -> String {
    message
        .replace(
            "(raise it with --max-memory)",
            "(raise it with tumble.set_max_memory)",
        )
        .replace("--params FILE", "params=")
        .replace("--random-params SEED", "random_params=SEED")
}

fn to_py_err(py: Python<'_>, e: ApiError) -> PyErr {
    let message = python_terms(e.to_string());
    let err = match &e {
        ApiError::Check { .. } => CheckError::new_err(message),
        ApiError::Param { .. } => ParamError::new_err(message),
        ApiError::Input { .. } => InputError::new_err(message),
        ApiError::Run { .. } | ApiError::Output { .. } => RunError::new_err(message),
        ApiError::Usage { .. } => PyValueError::new_err(message),
    };
    if let Some(i) = e.instance() {
        // Best effort: the message already names the instance.
        let _ = err.value(py).setattr("instance", i);
    }
    err
}

// ---------------------------------------------------------------------------------------------
// Python → tensors

/// A numpy array as a tensor (one copy: tumble's tensors own their buffers). `None` when `obj`
/// is not a numpy array.
fn array_to_tensor(obj: &Bound<'_, PyAny>) -> Result<Option<Tensor>, String> {
    let Ok(untyped) = obj.cast::<PyUntypedArray>() else {
        return Ok(None);
    };
    let shape = untyped.shape().to_vec();
    // Decoded inputs count against the memory budget (`set_max_memory`): asked before the copy,
    // as the CLI's decoder asks for each line (30 arrays of 40 MB were copied under a 200 MB
    // budget before a later check stopped the run).
    let bytes = untyped
        .len()
        .saturating_mul(untyped.dtype().itemsize().max(1));
    if let Err(stop) = tumble_limits::reserve(bytes) {
        return Err(format!(
            "a numpy array of {} cannot be copied in: {stop}",
            tumble_limits::bytes_text(bytes)
        ));
    }
    // numpy promises neither alignment (`np.frombuffer(buf, dtype, offset=1)`) nor bool bytes
    // of 0 or 1 (`np.uint8([2]).view(bool)`, `np.empty(n, bool)`), which Rust's `&[T]` and
    // `bool` require: an unaligned array is copied aligned by numpy first, and bools are read
    // as bytes.
    let py_err = |e: PyErr| format!("reading a numpy array: {e}");
    let aligned: bool = obj
        .getattr("flags")
        .and_then(|f| f.getattr("aligned"))
        .and_then(|a| a.extract())
        .map_err(py_err)?;
    let owned;
    let obj = if aligned {
        obj
    } else {
        let kwargs = pyo3::types::PyDict::new(obj.py());
        kwargs.set_item("requirements", "A").map_err(py_err)?;
        owned = obj
            .py()
            .import("numpy")
            .and_then(|np| np.call_method("require", (obj,), Some(&kwargs)))
            .map_err(py_err)?;
        &owned
    };
    if obj.cast::<PyArrayDyn<bool>>().is_ok() {
        let bytes = obj.call_method1("view", ("uint8",)).map_err(py_err)?;
        let a = bytes
            .cast::<PyArrayDyn<u8>>()
            .map_err(|e| format!("reading a numpy bool array as bytes: {e}"))?;
        let ro = a.readonly();
        let data: Vec<bool> = match ro.as_slice() {
            Ok(s) => s.iter().map(|&b| b != 0).collect(),
            Err(_) => ro.as_array().iter().map(|&b| b != 0).collect(),
        };
        return Tensor::from_vec(shape, data)
            .map(Some)
            .map_err(|e| e.to_string());
    }
    macro_rules! take {
        ($($t:ty),*) => {
            $(
                if let Ok(a) = obj.cast::<PyArrayDyn<$t>>() {
                    let ro = a.readonly();
                    let data: Vec<$t> = match ro.as_slice() {
                        Ok(s) => s.to_vec(),
                        // Not C-contiguous: read it in logical (row-major) order.
                        Err(_) => ro.as_array().iter().copied().collect(),
                    };
                    return Tensor::from_vec(shape, data).map(Some).map_err(|e| e.to_string());
                }
            )*
        };
    }
    take!(f32, f64, i32, i64);
    let dtype = untyped
        .dtype()
        .str()
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "?".into());
    Err(format!(
        "a numpy array of dtype {dtype}, which tumble does not take (float32, float64, int32, \
         int64, bool); convert it with .astype(...)"
    ))
}

/// Functions returning a Python class, imported once per process.
macro_rules! cached_classes {
    ($($(#[$doc:meta])* $name:ident = $module:literal . $class:literal;)*) => {$(
        $(#[$doc])*
        fn $name(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
            static CLASS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
            CLASS.import(py, $module, $class)
        }
    )*};
}

cached_classes! {
    numpy_generic = "numpy"."generic";
    numpy_floating = "numpy"."floating";
    /// `numpy.number`: with `numpy.bool_`, the scalar kinds an instance can hold.
    numpy_number = "numpy"."number";
    numpy_bool = "numpy"."bool_";
    ctor_class = "tumble"."Ctor";
}

/// A Python object as a document the instance decoder reads by type (`tumble_api::Doc`): no JSON
/// copy is made. Lists and tuples are arrays, dicts and `tumble.Ctor` values objects, numpy
/// arrays tensors (their dtype checked by the decoder), numpy scalars numbers.
struct PyDoc<'py>(Bound<'py, PyAny>);

impl<'py> PyDoc<'py> {
    /// The Python value of a numpy scalar (`numpy.float32(1.5).item()`), else `None`.
    fn numpy_item(&self) -> Option<Bound<'py, PyAny>> {
        let py = self.0.py();
        let generic = numpy_generic(py).ok()?;
        if !self.0.is_instance(generic).unwrap_or(false) {
            return None;
        }
        // Numbers and booleans only: `numpy.datetime64(..).item()` is an int of nanoseconds (or
        // a `datetime`), which was taken as a number.
        let is = |t: PyResult<&Bound<'_, PyType>>| {
            t.is_ok_and(|c| self.0.is_instance(c).unwrap_or(false))
        };
        let numeric = is(numpy_number(py)) || is(numpy_bool(py));
        if !numeric {
            return None;
        }
        let item = self.0.call_method0("item").ok()?;
        if !item.is_instance(generic).unwrap_or(false) {
            return Some(item);
        }
        // `numpy.longdouble(1.5).item()` is a longdouble again (Python has no such float):
        // unwrapping it again recursed until the stack overflowed. A real one is read as the
        // nearest float64 (tumble's widest dtype); anything else (a complex) is not a number.
        let real = item.is_instance_of::<PyFloat>()
            || numpy_floating(py).is_ok_and(|f| item.is_instance(f).unwrap_or(false));
        if !real {
            return None;
        }
        let x: f64 = item.extract().ok()?;
        Some(PyFloat::new(py, x).into_any())
    }

    fn is_ctor(&self) -> bool {
        ctor_class(self.0.py()).is_ok_and(|c| self.0.is_instance(c).unwrap_or(false))
    }

    /// A `tumble.Ctor`'s name and fields.
    fn ctor(&self) -> Option<(Bound<'py, PyString>, Bound<'py, PyAny>)> {
        if !self.is_ctor() {
            return None;
        }
        let name = self.0.getattr("name").ok()?.cast_into::<PyString>().ok()?;
        let fields = self.0.getattr("fields").ok()?;
        Some((name, fields))
    }
}

fn py_str(s: &Bound<'_, PyString>) -> String {
    s.to_cow().map(|c| c.into_owned()).unwrap_or_default()
}

impl Doc for PyDoc<'_> {
    fn kind(&self) -> Result<Kind, String> {
        let o = &self.0;
        if o.is_instance_of::<PyBool>() {
            return Ok(Kind::Bool);
        }
        if o.is_instance_of::<PyInt>() {
            if o.extract::<i64>().is_err() && o.extract::<u64>().is_err() {
                return Err(format!("the integer {o} is too large for any tumble dtype"));
            }
            return Ok(Kind::Number);
        }
        if let Ok(f) = o.cast::<PyFloat>() {
            let x = f.value();
            if !x.is_finite() {
                return Err(format!(
                    "{x} in a Python number or list; pass NaN and infinities in a numpy array"
                ));
            }
            return Ok(Kind::Number);
        }
        if let Ok(d) = o.cast::<PyDict>() {
            for k in d.keys() {
                if !k.is_instance_of::<PyString>() {
                    return Err(format!(
                        "a dict key {} is not a string (keys are argument or constructor names)",
                        short_repr(&k)
                    ));
                }
            }
            return Ok(Kind::Object);
        }
        if o.is_instance_of::<PyList>() || o.is_instance_of::<PyTuple>() {
            return Ok(Kind::Array);
        }
        if o.is_instance_of::<PyString>() {
            return Ok(Kind::String);
        }
        if o.cast::<PyUntypedArray>().is_ok() {
            return Ok(Kind::Tensor);
        }
        if let Some(item) = self.numpy_item() {
            return PyDoc(item).kind();
        }
        if self.is_ctor() {
            return Ok(Kind::Object);
        }
        if o.is_none() {
            return Ok(Kind::Null);
        }
        Err(format!(
            "cannot take a {} (instances are made of numpy arrays, numbers, lists, tuples, dicts \
             and tumble.Ctor values)",
            type_name(o)
        ))
    }

    fn as_bool(&self) -> Option<bool> {
        match self.0.cast::<PyBool>() {
            Ok(b) => Some(b.is_true()),
            Err(_) => PyDoc(self.numpy_item()?).as_bool(),
        }
    }

    fn as_number(&self) -> Option<Num> {
        let o = &self.0;
        if o.is_instance_of::<PyBool>() {
            return None;
        }
        if o.is_instance_of::<PyInt>() {
            return match o.extract::<i64>() {
                Ok(i) => Some(Num::Int(i)),
                Err(_) => o.extract::<u64>().ok().map(Num::UInt),
            };
        }
        if let Ok(f) = o.cast::<PyFloat>() {
            return Some(Num::Float(f.value()));
        }
        PyDoc(self.numpy_item()?).as_number()
    }

    fn as_str(&self) -> Option<Cow<'_, str>> {
        self.0.cast::<PyString>().ok()?.to_cow().ok()
    }

    fn array_len(&self) -> usize {
        if let Ok(l) = self.0.cast::<PyList>() {
            l.len()
        } else if let Ok(t) = self.0.cast::<PyTuple>() {
            t.len()
        } else {
            0
        }
    }

    fn item(&self, i: usize) -> Option<Self> {
        if let Ok(l) = self.0.cast::<PyList>() {
            l.get_item(i).ok().map(PyDoc)
        } else if let Ok(t) = self.0.cast::<PyTuple>() {
            t.get_item(i).ok().map(PyDoc)
        } else {
            None
        }
    }

    fn keys(&self) -> Vec<String> {
        if let Ok(d) = self.0.cast::<PyDict>() {
            return d
                .keys()
                .iter()
                .filter_map(|k| k.cast::<PyString>().ok().map(py_str))
                .collect();
        }
        self.ctor()
            .map_or_else(Vec::new, |(name, _)| vec![py_str(&name)])
    }

    fn get(&self, key: &str) -> Option<Self> {
        if let Ok(d) = self.0.cast::<PyDict>() {
            return d.get_item(key).ok().flatten().map(PyDoc);
        }
        let (name, fields) = self.ctor()?;
        (py_str(&name) == key).then_some(PyDoc(fields))
    }

    fn single_entry(&self) -> Option<(Cow<'_, str>, Self)> {
        if let Ok(d) = self.0.cast::<PyDict>() {
            if d.len() != 1 {
                return None;
            }
            let (k, v) = d.iter().next()?;
            let k = k.cast::<PyString>().ok()?.to_cow().ok()?.into_owned();
            return Some((Cow::Owned(k), PyDoc(v)));
        }
        let (name, fields) = self.ctor()?;
        Some((Cow::Owned(py_str(&name)), PyDoc(fields)))
    }

    fn tensor(&self) -> Option<Result<Tensor, String>> {
        array_to_tensor(&self.0).transpose()
    }

    fn describe(&self) -> String {
        let o = &self.0;
        let count = |n: usize, what: &str| match n {
            0 => format!("an empty {what}"),
            1 => format!("a {what} of 1 element"),
            n => format!("a {what} of {n} elements"),
        };
        if let Ok(b) = o.cast::<PyBool>() {
            return format!("the boolean {}", if b.is_true() { "True" } else { "False" });
        }
        if o.is_instance_of::<PyInt>() || o.is_instance_of::<PyFloat>() {
            return format!("the number {}", short_repr(o));
        }
        if let Ok(s) = o.cast::<PyString>() {
            return format!("the string {:?}", tumble_api::shorten(&py_str(s), 40));
        }
        if let Ok(l) = o.cast::<PyList>() {
            return count(l.len(), "list");
        }
        if let Ok(t) = o.cast::<PyTuple>() {
            return count(t.len(), "tuple");
        }
        if o.is_instance_of::<PyDict>() {
            let keys = self.keys();
            return if keys.is_empty() {
                "an empty dict".into()
            } else {
                format!("a dict with keys {}", keys.join(", "))
            };
        }
        if let Ok(a) = o.cast::<PyUntypedArray>() {
            let dtype = a
                .dtype()
                .str()
                .map(|s| s.to_string())
                .unwrap_or_else(|_| "?".into());
            return format!("a numpy array of shape {:?} and dtype {dtype}", a.shape());
        }
        if let Some((name, _)) = self.ctor() {
            return format!("tumble.Ctor({:?}, ...)", py_str(&name));
        }
        if o.is_none() {
            return "None".into();
        }
        format!("a {}", type_name(o))
    }
}

/// `Model.run`'s `timeout`: `None`, or a positive number of seconds up to 1e9 (about 30 years,
/// the CLI's `--timeout` bound).
fn timeout_arg(t: Option<&Bound<'_, PyAny>>) -> PyResult<Option<std::time::Duration>> {
    let Some(t) = t.filter(|t| !t.is_none()) else {
        return Ok(None);
    };
    let expected = "timeout: expected a positive number of seconds up to 1e9, or None";
    if t.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!("{expected}; found a bool")));
    }
    let secs: f64 = match t.extract() {
        Ok(s) => s,
        Err(_) if t.is_instance_of::<PyInt>() => {
            return Err(PyValueError::new_err(format!(
                "{expected}; found an integer too large for a number of seconds"
            )))
        }
        Err(_) => {
            return Err(PyTypeError::new_err(format!(
                "{expected}; found a {}",
                type_name(t)
            )))
        }
    };
    if !(secs.is_finite() && secs > 0.0 && secs <= 1e9) {
        let shown = if secs.abs() < 1e6 {
            format!("{secs}")
        } else {
            format!("{secs:e}")
        };
        return Err(PyValueError::new_err(format!("{expected}; found {shown}")));
    }
    Ok(Some(std::time::Duration::from_secs_f64(secs)))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn short_repr(obj: &Bound<'_, PyAny>) -> String {
    let r = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into());
    let mut s: String = r.chars().take(40).collect();
    if s.len() < r.len() {
        s.push('…');
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Results → Python

/// Results of at least this many bytes are made by `numpy.empty`, whose failure to allocate is a
/// `MemoryError`: rust-numpy's constructors panic when numpy cannot allocate (a `RunError`
/// "internal error" with a backtrace on stderr, or a `PanicException` that `except Exception`
/// does not catch). Smaller ones take the direct path.
const VIA_NUMPY_EMPTY: usize = 1 << 20;

/// A copy of `src` in a new numpy array of `shape` and numpy dtype `dtype`, made by `numpy.empty`.
fn array_via_empty<'py, T: numpy::Element + Copy>(
    py: Python<'py>,
    shape: &[usize],
    dtype: &str,
    src: &[T],
) -> PyResult<Bound<'py, PyAny>> {
    let numpy = py.import("numpy")?;
    let array = numpy.call_method1("empty", (PyTuple::new(py, shape)?, dtype))?;
    {
        let typed = array.cast::<PyArrayDyn<T>>()?;
        let mut rw = typed.try_readwrite()?;
        rw.as_slice_mut()?.copy_from_slice(src);
    }
    Ok(array)
}

fn tensor_to_py<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    let shape = t.shape().to_vec();
    if t.len().saturating_mul(t.dtype().size()) >= VIA_NUMPY_EMPTY {
        return match t.buffer() {
            Buffer::F32(v) => array_via_empty(py, &shape, "float32", v),
            Buffer::F64(v) => array_via_empty(py, &shape, "float64", v),
            Buffer::I32(v) => array_via_empty(py, &shape, "int32", v),
            Buffer::I64(v) => array_via_empty(py, &shape, "int64", v),
            Buffer::Bool(v) => array_via_empty(py, &shape, "bool", v),
        };
    }
    Ok(match t.buffer() {
        Buffer::F32(v) => numpy::PyArray1::from_slice(py, v)
            .reshape(shape)?
            .into_any(),
        Buffer::F64(v) => numpy::PyArray1::from_slice(py, v)
            .reshape(shape)?
            .into_any(),
        Buffer::I32(v) => numpy::PyArray1::from_slice(py, v)
            .reshape(shape)?
            .into_any(),
        Buffer::I64(v) => numpy::PyArray1::from_slice(py, v)
            .reshape(shape)?
            .into_any(),
        Buffer::Bool(v) => numpy::PyArray1::from_slice(py, v)
            .reshape(shape)?
            .into_any(),
    })
}

fn tree_to_py<'py>(py: Python<'py>, t: &OutTree, depth: usize) -> PyResult<Bound<'py, PyAny>> {
    if depth > MAX_DEPTH * 16 {
        return Err(RunError::new_err(format!(
            "the result nests deeper than {} levels",
            MAX_DEPTH * 16
        )));
    }
    let many = |items: &[OutTree]| -> PyResult<Vec<Bound<'py, PyAny>>> {
        items.iter().map(|x| tree_to_py(py, x, depth + 1)).collect()
    };
    Ok(match t {
        OutTree::Tensor(t) => tensor_to_py(py, t)?,
        OutTree::Tuple(items) => PyTuple::new(py, many(items)?)?.into_any(),
        OutTree::List(items) => PyList::new(py, many(items)?)?.into_any(),
        OutTree::Ctor { name, fields } => {
            let mut args = vec![PyString::new(py, name).into_any()];
            args.extend(many(fields)?);
            ctor_class(py)?.call1(PyTuple::new(py, args)?)?
        }
    })
}

// ---------------------------------------------------------------------------------------------
// The Python classes

/// A model loaded, checked and compiled, its parameters bound: call `run` with instances.
#[pyclass(frozen, module = "tumble._tumble", name = "Model")]
struct PyModel {
    inner: Arc<Model>,
    last_profile: Mutex<Option<String>>,
}

fn tensor_param(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    match array_to_tensor(obj) {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(ParamError::new_err(format!(
            "params[{name:?}]: expected a numpy array, found a {}",
            type_name(obj)
        ))),
        Err(e) => Err(ParamError::new_err(format!("params[{name:?}]: {e}"))),
    }
}

fn params_from(params: Option<&Bound<'_, PyAny>>, random_params: Option<u64>) -> PyResult<Params> {
    let mut out = Params {
        random_seed: random_params,
        ..Params::default()
    };
    let Some(p) = params else {
        return Ok(out);
    };
    if p.is_none() {
        return Ok(out);
    }
    if let Ok(d) = p.cast::<PyDict>() {
        for (k, v) in d.iter() {
            let name: String = k.extract().map_err(|_| {
                ParamError::new_err(format!(
                    "params: the key {} is not a string (keys are @main's argument names)",
                    short_repr(&k)
                ))
            })?;
            let t = tensor_param(&name, &v)?;
            out.tensors.insert(name, t);
        }
        return Ok(out);
    }
    match p.extract::<PathBuf>() {
        Ok(path) => {
            out.file = Some(path);
            Ok(out)
        }
        Err(_) => Err(ParamError::new_err(format!(
            "params: expected a path (str or os.PathLike) to a safetensors / .npy file or \
             directory, or a dict of numpy arrays; found a {}",
            type_name(p)
        ))),
    }
}

fn load_with(
    py: Python<'_>,
    source: Source<'_>,
    params: Option<&Bound<'_, PyAny>>,
    random_params: Option<u64>,
    inputs: Option<Vec<String>>,
    entry: String,
) -> PyResult<PyModel> {
    let params = params_from(params, random_params)?;
    let opts = LoadOptions {
        entry,
        inputs,
        ..LoadOptions::default()
    };
    let loaded = py.detach(|| {
        tumble_api::with_big_stack(|| Model::load(source, &params, &opts)).and_then(|r| r)
    });
    let model = loaded.map_err(|e| to_py_err(py, e))?;
    Ok(PyModel {
        inner: Arc::new(model),
        last_profile: Mutex::new(None),
    })
}

/// Loads the model at `path` (Relay text format). See `tumble.load`.
#[pyfunction]
#[pyo3(signature = (path, params=None, random_params=None, inputs=None, entry="main".to_string()))]
fn load(
    py: Python<'_>,
    path: PathBuf,
    params: Option<&Bound<'_, PyAny>>,
    random_params: Option<u64>,
    inputs: Option<Vec<String>>,
    entry: String,
) -> PyResult<PyModel> {
    load_with(
        py,
        Source::File(&path),
        params,
        random_params,
        inputs,
        entry,
    )
}

/// Loads a model from its text. See `tumble.loads`.
#[pyfunction]
#[pyo3(signature = (text, params=None, random_params=None, inputs=None, entry="main".to_string(), name="<string>".to_string()))]
fn loads(
    py: Python<'_>,
    text: String,
    params: Option<&Bound<'_, PyAny>>,
    random_params: Option<u64>,
    inputs: Option<Vec<String>>,
    entry: String,
    name: String,
) -> PyResult<PyModel> {
    load_with(
        py,
        Source::Text {
            name: &name,
            text: &text,
        },
        params,
        random_params,
        inputs,
        entry,
    )
}

#[pymethods]
impl PyModel {
    /// Runs every instance; returns one output per instance, in order.
    #[pyo3(signature = (instances, batch=None, threads=None, workers=None, seed=0, scheduler="inline", profile=false, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        instances: &Bound<'_, PyAny>,
        batch: Option<usize>,
        threads: Option<usize>,
        workers: Option<usize>,
        seed: u64,
        scheduler: &str,
        profile: bool,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyList>> {
        let limit = timeout_arg(timeout)?;
        if instances.is_instance_of::<PyDict>() || instances.is_instance_of::<PyString>() {
            return Err(PyValueError::new_err(
                "instances: expected a sequence of instances (a list of dicts), found a single \
                 dict or string; wrap one instance in a list",
            ));
        }
        let items: Vec<Py<PyAny>> = instances
            .try_iter()
            .map_err(|_| {
                PyValueError::new_err(format!(
                    "instances: expected a sequence of instances, found a {}",
                    type_name(instances)
                ))
            })?
            .map(|x| x.map(Bound::unbind))
            .collect::<PyResult<_>>()?;
        let mut opts = RunOptions {
            batch,
            threads,
            workers,
            seed,
            ..RunOptions::default()
        };
        opts.runtime.scheduler = tumble_api::scheduler(scheduler).map_err(|e| to_py_err(py, e))?;
        let model = self.inner.clone();
        // A Ctrl-C while the run goes on: Python's KeyboardInterrupt, raised once the run has
        // stopped at its next safe point (it could not be stopped at all before).
        let mut signalled: Option<PyErr> = None;
        let watch = || {
            Python::attach(|py| match py.check_signals() {
                Ok(()) => false,
                Err(e) => {
                    signalled = Some(e);
                    true
                }
            })
        };
        // This call's own stop: its deadline, and its Ctrl-C (other calls running meanwhile, in
        // other threads, go on).
        let run_stop = tumble_limits::RunStop::new(limit);
        let deadline = run_stop.clone();
        // On a kept run thread (its buffers stay warm from one call to the next).
        let result = py.detach(|| {
            tumble_api::on_run_thread_watched(
                move || -> Result<_, ApiError> {
                    // Each instance is decoded straight from its Python objects when its
                    // mini-batch starts (holding the GIL only for that), with no JSON copy.
                    let (outs, prof) = model.run_with(
                        items.len(),
                        |i, decoding| {
                            Python::attach(|py| {
                                let source = format!("instances: instance at index {i}");
                                let obj =
                                    items.get(i).map_or_else(|| py.None(), |o| o.clone_ref(py));
                                decoding.decode(i, &PyDoc(obj.into_bound(py)), &[], &source)
                            })
                        },
                        |i| format!("instance at index {i}"),
                        &opts,
                    )?;
                    let text = profile.then(|| prof.to_string());
                    let py_outs = Python::attach(|py| -> PyResult<Py<PyList>> {
                        let list = PyList::empty(py);
                        for o in &outs {
                            list.append(tree_to_py(py, o, 0)?)?;
                        }
                        Ok(list.unbind())
                    });
                    Ok((py_outs, text))
                },
                run_stop,
                watch,
            )
            .and_then(|r| r)
        });
        if let Some(e) = signalled {
            return Err(e);
        }
        // A timeout only where a safe point stopped the run for it: a run that failed for its
        // own reasons after the deadline passed reports that failure.
        if let (Err(_), Some(limit)) = (&result, deadline.stopped_by_deadline()) {
            return Err(PyTimeoutError::new_err(format!(
                "the run did not finish within its timeout of {} (timeout=); it was stopped",
                tumble_limits::duration_text(limit)
            )));
        }
        let (outs, text) = result.map_err(|e| to_py_err(py, e))?;
        if let Some(t) = text {
            if let Ok(mut p) = self.last_profile.lock() {
                *p = Some(t);
            }
        }
        outs
    }

    /// Each user function with its inferred type, as `tumble check` prints them.
    fn check(&self) -> String {
        self.inner.check()
    }

    /// What the compiler made of the model: static optimizations, blocks, kernel plans.
    fn explain(&self) -> String {
        self.inner.explain()
    }

    /// Parameters: name -> (shape, dtype name).
    #[getter]
    fn parameters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for p in self.inner.parameters() {
            let shape = PyTuple::new(py, &p.shape)?;
            d.set_item(p.name, (shape, p.dtype.name()))?;
        }
        Ok(d)
    }

    /// A parameter's values (a copy), e.g. to save generated weights.
    fn parameter<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        match self.inner.parameter(name) {
            Some(t) => tensor_to_py(py, t),
            None => Err(ParamError::new_err(format!(
                "the model has no parameter `{name}`; it has: {}",
                self.inner
                    .parameters()
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    /// The arguments each instance gives: name -> declared type.
    #[getter]
    fn inputs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (n, ty) in self.inner.inputs() {
            d.set_item(n, ty.to_string())?;
        }
        Ok(d)
    }

    /// @main's return type.
    #[getter]
    fn output_type(&self) -> String {
        self.inner.output_type().to_string()
    }

    /// Warnings of checking and binding.
    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.inner.warnings().to_vec()
    }

    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_string()
    }

    /// The batching profile of the last `run(..., profile=True)`.
    #[getter]
    fn last_profile(&self) -> Option<String> {
        self.last_profile.lock().ok().and_then(|p| p.clone())
    }

    fn __repr__(&self) -> String {
        let inputs: Vec<&str> = self
            .inner
            .inputs()
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        format!(
            "<tumble.Model {} inputs=[{}] parameters={}>",
            self.inner.name(),
            inputs.join(", "),
            self.inner.parameters().len()
        )
    }
}

/// Sets the memory budget of runs (bytes; None: no limit). Default: half the machine's memory.
#[pyfunction]
#[pyo3(signature = (limit))]
fn set_max_memory(limit: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    let bytes = match limit {
        None => None,
        Some(l) if l.is_none() => None,
        Some(l) => {
            if let Ok(n) = l.extract::<usize>() {
                Some(n)
            } else {
                let s: String = l.extract().map_err(|_| {
                    PyValueError::new_err(
                        "max memory: expected bytes (int), a size like '4G', or None",
                    )
                })?;
                tumble_limits::parse_size(&s).map_err(PyValueError::new_err)?
            }
        }
    };
    tumble_limits::set_limit(bytes);
    Ok(())
}

#[pymodule]
fn _tumble(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    tumble_limits::set_limit(tumble_limits::default_limit());
    m.add("Error", py.get_type::<Error>())?;
    m.add("CheckError", py.get_type::<CheckError>())?;
    m.add("ParamError", py.get_type::<ParamError>())?;
    m.add("InputError", py.get_type::<InputError>())?;
    m.add("RunError", py.get_type::<RunError>())?;
    m.add_class::<PyModel>()?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(loads, m)?)?;
    m.add_function(wrap_pyfunction!(set_max_memory, m)?)?;
    Ok(())
}
