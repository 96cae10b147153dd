//! `.npy` files and directories of them.

use std::collections::BTreeMap;
use std::path::Path;

use tumble_ir::DType;
use tumble_tensor::shape::format_shape;
use tumble_tensor::Tensor;

use super::{byte_size, decode_le, encode_le, file_stem, read_file};
use crate::IoError;

/// Loads every `*.npy` file directly inside `dir`, each as the tensor named by its file stem.
pub fn load_npy_dir(dir: &Path) -> Result<BTreeMap<String, Tensor>, IoError> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| IoError::file(dir, "list the weights directory", e))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| IoError::file(dir, "list the weights directory", e))?;
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "npy") && p.is_file() {
            files.push(p);
        }
    }
    if files.is_empty() {
        return Err(IoError::weights(
            dir,
            "the directory contains no .npy files (tumble reads a directory of `NAME.npy` files, \
             one tensor each, or a .safetensors file)",
        ));
    }
    files.sort();
    let mut out = BTreeMap::new();
    for p in files {
        let bytes = read_file(&p)?;
        out.insert(file_stem(&p), parse_npy(&p, &bytes)?);
    }
    Ok(out)
}

/// Parses the bytes of one `.npy` file (format versions 1, 2 and 3; `path` is for messages).
pub fn parse_npy(path: &Path, bytes: &[u8]) -> Result<Tensor, IoError> {
    let err = |m: String| IoError::weights(path, m);
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(err(
            "not a .npy file (it does not start with the magic bytes `\\x93NUMPY`)".into(),
        ));
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let (hlen, hstart): (usize, usize) = match (major, minor) {
        (1, 0) => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        (2 | 3, 0) => {
            let Some(b) = bytes.get(8..12) else {
                return Err(err("the file is truncated inside the .npy preamble".into()));
            };
            let n = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            (usize::try_from(n).unwrap_or(usize::MAX), 12)
        }
        // numpy writes and reads only 1.0, 2.0 and 3.0 (`numpy.lib.format`).
        (v, m) => {
            return Err(err(format!(
                ".npy format version {v}.{m} is not supported (versions 1.0, 2.0 and 3.0 are)"
            )))
        }
    };
    let hend = hstart
        .checked_add(hlen)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| {
            err(format!(
            "the header length field says {hlen} bytes, but only {} follow; the file is truncated",
            bytes.len() - hstart
        ))
        })?;
    let header = std::str::from_utf8(&bytes[hstart..hend])
        .map_err(|_| err("the .npy header is not valid text; the file is corrupt".into()))?;
    let h = parse_npy_header(header).map_err(|m| {
        err(format!(
            "cannot read the .npy header `{}`: {m}",
            header.trim_end()
        ))
    })?;
    if h.fortran_order {
        return Err(err(
            "the array is stored in Fortran (column-major) order, which tumble does not read; \
             save it from numpy with `np.save(path, np.ascontiguousarray(a))`"
                .into(),
        ));
    }
    let dtype = match h.descr.as_str() {
        "<f4" => DType::Float32,
        "<f8" => DType::Float64,
        "<i4" => DType::Int32,
        "<i8" => DType::Int64,
        "|b1" => DType::Bool,
        other => {
            let why = if other.starts_with('>') {
                " (big-endian data; use `a.astype(a.dtype.newbyteorder('<'))`)"
            } else {
                ""
            };
            return Err(err(format!(
                "dtype `{other}` is not supported{why}; tumble reads `<f4` (float32), `<f8` \
                 (float64), `<i4` (int32), `<i8` (int64) and `|b1` (bool)"
            )));
        }
    };
    let data = &bytes[hend..];
    let need = byte_size(&h.shape, dtype.size())
        .ok_or_else(|| err(format!("shape {} is too large", format_shape(&h.shape))))?;
    if data.len() < need {
        return Err(err(format!(
            "shape {} of {dtype} needs {need} data bytes, but the file has only {}; \
             the file is truncated",
            format_shape(&h.shape),
            data.len()
        )));
    }
    if data.len() > need {
        return Err(err(format!(
            "shape {} of {dtype} needs {need} data bytes, but the file has {}; \
             the header does not match the data (is the file corrupt?)",
            format_shape(&h.shape),
            data.len()
        )));
    }
    Tensor::new(h.shape, decode_le(dtype, data)).map_err(|e| err(e.to_string()))
}

struct NpyHeader {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

/// Parses the Python dict literal of a `.npy` header:
/// `{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`.
fn parse_npy_header(text: &str) -> Result<NpyHeader, String> {
    let mut p = PyLit {
        s: text.as_bytes(),
        i: 0,
    };
    p.expect(b'{')?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    loop {
        p.ws();
        if p.eat(b'}') {
            break;
        }
        let key = p.string()?;
        p.ws();
        p.expect(b':')?;
        p.ws();
        match key.as_str() {
            "descr" => descr = Some(p.string()?),
            "fortran_order" => fortran = Some(p.boolean()?),
            "shape" => shape = Some(p.tuple()?),
            other => return Err(format!("unexpected key '{other}'")),
        }
        p.ws();
        if !p.eat(b',') {
            p.ws();
            p.expect(b'}')?;
            break;
        }
    }
    Ok(NpyHeader {
        descr: descr.ok_or("no 'descr' entry")?,
        fortran_order: fortran.ok_or("no 'fortran_order' entry")?,
        shape: shape.ok_or("no 'shape' entry")?,
    })
}

struct PyLit<'a> {
    s: &'a [u8],
    i: usize,
}

impl PyLit<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected `{}` at offset {}", c as char, self.i))
        }
    }

    fn string(&mut self) -> Result<String, String> {
        let q = match self.s.get(self.i) {
            Some(&q @ (b'\'' | b'"')) => q,
            _ => return Err(format!("expected a quoted string at offset {}", self.i)),
        };
        self.i += 1;
        let start = self.i;
        while let Some(&c) = self.s.get(self.i) {
            if c == q {
                let out = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
                self.i += 1;
                return Ok(out);
            }
            self.i += 1;
        }
        Err("unterminated string".into())
    }

    fn boolean(&mut self) -> Result<bool, String> {
        let rest = &self.s[self.i..];
        if rest.starts_with(b"True") {
            self.i += 4;
            Ok(true)
        } else if rest.starts_with(b"False") {
            self.i += 5;
            Ok(false)
        } else {
            Err(format!("expected True or False at offset {}", self.i))
        }
    }

    fn tuple(&mut self) -> Result<Vec<usize>, String> {
        self.expect(b'(')?;
        let mut dims = Vec::new();
        loop {
            self.ws();
            if self.eat(b')') {
                return Ok(dims);
            }
            let start = self.i;
            while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
                self.i += 1;
            }
            let digits = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
            let d: usize = digits
                .parse()
                .map_err(|_| format!("expected a dimension size at offset {start}"))?;
            self.eat(b'L'); // Python 2 long literals
            dims.push(d);
            self.ws();
            if !self.eat(b',') {
                self.ws();
                self.expect(b')')?;
                return Ok(dims);
            }
        }
    }
}

/// The bytes of a version-1 `.npy` file holding `tensor` (used by tests and tools that want to
/// hand tensors to numpy).
pub fn npy_bytes(tensor: &Tensor) -> Vec<u8> {
    let descr = match tensor.dtype() {
        DType::Float32 => "<f4",
        DType::Float64 => "<f8",
        DType::Int32 => "<i4",
        DType::Int64 => "<i8",
        DType::Bool => "|b1",
    };
    let shape = format_shape(tensor.shape()); // Python tuple syntax: `(4,)`, `(2, 3)`, `()`
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Pad with spaces so that magic + version + length + header + '\n' is a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + tensor.len() * tensor.dtype().size());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    // Our headers are far below 64 KiB.
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&encode_le(tensor.buffer()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_headers() {
        let h = parse_npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }  \n")
            .unwrap();
        assert_eq!(
            (h.descr.as_str(), h.fortran_order, h.shape),
            ("<f4", false, vec![3, 4])
        );
        let h = parse_npy_header("{\"shape\": (), \"fortran_order\": True, \"descr\": \"|b1\"}")
            .unwrap();
        assert_eq!(
            (h.descr.as_str(), h.fortran_order, h.shape),
            ("|b1", true, vec![])
        );
        let h =
            parse_npy_header("{'descr': '<i8', 'fortran_order': False, 'shape': (7L,), }").unwrap();
        assert_eq!(h.shape, vec![7]);
        assert!(parse_npy_header("{'descr': '<f4', 'shape': (3,), }").is_err());
        assert!(
            parse_npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,)}").is_err()
        );
        assert!(parse_npy_header("{'descr': '<f4'").is_err());
        assert!(parse_npy_header("").is_err());
    }

    #[test]
    fn npy_round_trip_all_dtypes() {
        let ts = [
            Tensor::from_f32([2], vec![1.5, -2.0]).unwrap(),
            Tensor::from_f64([1, 2], vec![1e300, -0.0]).unwrap(),
            Tensor::from_i32([3], vec![1, -1, i32::MIN]).unwrap(),
            Tensor::scalar_i64(i64::MAX),
            Tensor::from_bool([2], vec![true, false]).unwrap(),
            Tensor::from_f32([0], vec![]).unwrap(),
        ];
        for t in ts {
            let bytes = npy_bytes(&t);
            assert_eq!(bytes.len() % 64, (t.len() * t.dtype().size()) % 64);
            assert_eq!(parse_npy(Path::new("t.npy"), &bytes).unwrap(), t);
        }
    }
}
