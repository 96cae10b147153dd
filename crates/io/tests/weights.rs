//! Weights files: safetensors round trips, corrupt and truncated files, `.npy` directories.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tumble_io::weights::{parse_npy, parse_safetensors, safetensors_bytes};
use tumble_io::{load_params, save_params, IoError};
use tumble_tensor::Tensor;

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tumble-io-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn sample() -> BTreeMap<String, Tensor> {
    let mut m = BTreeMap::new();
    m.insert(
        "W".into(),
        Tensor::from_f32([2, 3], vec![1.0, -2.5, 3.25, 0.0, 1e-7, 6.0]).unwrap(),
    );
    m.insert("b".into(), Tensor::from_f64([2], vec![0.1, -0.2]).unwrap());
    m.insert(
        "idx".into(),
        Tensor::from_i32([3], vec![1, -2, i32::MAX]).unwrap(),
    );
    m.insert("big".into(), Tensor::scalar_i64(i64::MIN));
    m.insert(
        "mask".into(),
        Tensor::from_bool([2, 2], vec![true, false, false, true]).unwrap(),
    );
    m.insert("empty".into(), Tensor::from_f32([0, 4], vec![]).unwrap());
    m
}

/// [`sample`] with tensors over more than one 1 MiB chunk, of odd lengths, first and last in
/// the file's data order.
fn sample_with_large() -> BTreeMap<String, Tensor> {
    let mut m = sample();
    let n = (1 << 19) + 3;
    m.insert(
        "a_large".into(),
        Tensor::from_f32([n], (0..n).map(|i| i as f32 * 0.5 - 7.0).collect()).unwrap(),
    );
    m.insert(
        "large64".into(),
        Tensor::from_f64([n / 3], (0..n / 3).map(|i| i as f64 / 3.0).collect()).unwrap(),
    );
    m.insert(
        "z_large_i64".into(),
        Tensor::from_i64([n / 2], (0..n / 2).map(|i| i as i64 * 7 - 11).collect()).unwrap(),
    );
    m
}

fn msg(r: Result<impl Sized, IoError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn safetensors_round_trip() {
    let dir = temp_dir("roundtrip");
    let path = dir.join("w.safetensors");
    let tensors = sample();
    save_params(&path, &tensors).unwrap();
    let loaded = load_params(&path).unwrap();
    assert_eq!(loaded.tensors, tensors);
    assert!(loaded.warnings.is_empty());
    // Overwriting works and leaves no temp file behind.
    save_params(&path, &tensors).unwrap();
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("w.safetensors")]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let bytes = safetensors_bytes(&sample()).unwrap();
    let p = Path::new("w.safetensors");
    for cut in 0..bytes.len() {
        let e = msg(parse_safetensors(p, &bytes[..cut]));
        assert!(e.starts_with("weights file `w.safetensors`: "), "{e}");
        assert!(
            e.contains("truncated") || e.contains("corrupt"),
            "cut {cut}: {e}"
        );
    }
    assert_eq!(
        msg(parse_safetensors(p, &bytes[..5])),
        "weights file `w.safetensors`: the file is 5 bytes long, too short for a safetensors file \
         (an 8-byte header length, then a JSON header); it is truncated or not a safetensors file"
    );
    // Cutting the last data byte: the tensor that ends there is named.
    let e = msg(parse_safetensors(p, &bytes[..bytes.len() - 1]));
    assert!(e.contains("the file is truncated"), "{e}");
}

#[test]
fn truncated_file_on_disk_names_the_file() {
    let dir = temp_dir("trunc");
    let path = dir.join("cut.safetensors");
    let bytes = safetensors_bytes(&sample()).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let e = msg(load_params(&path));
    assert!(e.contains(&path.display().to_string()), "{e}");
    assert!(e.contains("the file is truncated"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn with_header(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

#[test]
fn corrupt_headers() {
    let p = Path::new("w.safetensors");
    // Every byte of the header flipped in turn: never a panic.
    let bytes = safetensors_bytes(&sample()).unwrap();
    for i in 0..bytes.len().min(400) {
        let mut b = bytes.clone();
        b[i] ^= 0xff;
        let _ = parse_safetensors(p, &b);
    }
    assert_eq!(
        msg(parse_safetensors(p, &with_header("{\"a\": 1", b""))),
        "weights file `w.safetensors`: the JSON header does not parse (EOF while parsing an object \
         at line 1 column 7); the file is corrupt"
    );
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    assert!(msg(parse_safetensors(p, &huge)).contains("more than safetensors allows"));
    // Offsets pointing past the end of the data.
    let h = r#"{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    assert_eq!(
        msg(parse_safetensors(p, &with_header(h, &[0; 8]))),
        "weights file `w.safetensors`: tensor `x` ends at byte 16 of the data section, but the \
         file has only 8 data bytes; the file is truncated"
    );
    // A negative or fractional dimension.
    let h = r#"{"x":{"dtype":"F32","shape":[-2,4],"data_offsets":[0,32]}}"#;
    assert_eq!(
        msg(parse_safetensors(p, &with_header(h, &[0; 32]))),
        "weights file `w.safetensors`: tensor `x`: dimension 0 of its `shape` is -2, not a size \
         (a non-negative integer); the file is corrupt"
    );
    let h = r#"{"x":{"dtype":"F32","shape":[4,1.5],"data_offsets":[0,32]}}"#;
    assert!(msg(parse_safetensors(p, &with_header(h, &[0; 32])))
        .contains("dimension 1 of its `shape` is 1.5, not a size"));
    // Offsets that disagree with the shape.
    let h = r#"{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}"#;
    assert_eq!(
        msg(parse_safetensors(p, &with_header(h, &[0; 16]))),
        "weights file `w.safetensors`: tensor `x`: shape (3,) of F32 needs 12 bytes, but its \
         data_offsets [0, 16] describe 16 bytes; the file is corrupt"
    );
    // A shape whose byte size overflows.
    let h = format!(
        r#"{{"x":{{"dtype":"F32","shape":[{},{}],"data_offsets":[0,0]}}}}"#,
        u64::MAX,
        u64::MAX
    );
    assert!(msg(parse_safetensors(p, &with_header(&h, b""))).contains("too large"));
}

#[test]
fn unsupported_dtype_is_named() {
    let h = r#"{"half":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}"#;
    let e = msg(parse_safetensors(
        Path::new("m.safetensors"),
        &with_header(h, &[0; 4]),
    ));
    assert_eq!(
        e,
        "weights file `m.safetensors`: tensor `half` has dtype F16, which tumble does not \
         support; tumble reads F32, F64, I32, I64 and BOOL; convert the tensor (e.g. `t.float()` \
         in PyTorch) and save again"
    );
}

#[test]
fn non_finite_values_are_warnings() {
    let dir = temp_dir("nan");
    let path = dir.join("w.safetensors");
    let mut m = BTreeMap::new();
    m.insert(
        "W".to_string(),
        Tensor::from_f32([4], vec![f32::NAN, 1.0, f32::INFINITY, f32::NEG_INFINITY]).unwrap(),
    );
    save_params(&path, &m).unwrap();
    let loaded = load_params(&path).unwrap();
    assert_eq!(loaded.warnings.len(), 1);
    assert!(
        loaded.warnings[0].ends_with(
            "tensor `W` has 1 NaN and 2 infinite values (of 4); results computed from it will \
             likely be NaN"
        ),
        "{}",
        loaded.warnings[0]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Subnormal weights are read as zero, with a warning per tensor that had any; normal values,
/// zeros (of either sign), integers and the other tensors are untouched.
#[test]
fn subnormal_weights_are_read_as_zero() {
    let dir = temp_dir("subnormal");
    let path = dir.join("w.safetensors");
    let tiny = f32::MIN_POSITIVE / 8.0;
    let mut m = BTreeMap::new();
    m.insert(
        "emb".to_string(),
        Tensor::from_f32([5], vec![tiny, -tiny, f32::MIN_POSITIVE, -0.0, 0.5]).unwrap(),
    );
    m.insert(
        "w64".to_string(),
        Tensor::from_vec(vec![2], vec![f64::MIN_POSITIVE / 4.0, 1.0]).unwrap(),
    );
    m.insert(
        "b".to_string(),
        Tensor::from_f32([2], vec![1.0, 2.0]).unwrap(),
    );
    save_params(&path, &m).unwrap();
    let loaded = load_params(&path).unwrap();
    let emb = loaded.tensors["emb"].as_f32().unwrap().to_vec();
    let bits: Vec<u32> = emb.iter().map(|x| x.to_bits()).collect();
    let want = [0.0, 0.0, f32::MIN_POSITIVE, -0.0, 0.5];
    assert_eq!(bits, want.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    assert_eq!(loaded.tensors["w64"].to_f64_vec(), vec![0.0, 1.0]);
    assert_eq!(loaded.tensors["b"], m["b"]);
    assert_eq!(loaded.warnings.len(), 2, "{:?}", loaded.warnings);
    assert!(
        loaded.warnings[0].contains("tensor `emb` has 2 subnormal values (of 5), read as zero"),
        "{}",
        loaded.warnings[0]
    );
    assert!(loaded.warnings[1].contains("tensor `w64` has 1 subnormal value (of 2)"));
    // Called directly on tensors without any, nothing changes and nothing is said.
    let mut none = m.clone();
    none.remove("emb");
    none.remove("w64");
    assert!(tumble_io::weights::flush_subnormals(&path, &mut none).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The reader scans each tensor a chunk at a time as it decodes it (1 MiB of the file): a
/// subnormal or a NaN in a later chunk of a large tensor is still flushed or warned about, and
/// the ordinary tensors beside them are left as they are.
#[test]
fn odd_values_past_the_first_chunk_are_found() {
    let dir = temp_dir("late_odd");
    let path = dir.join("w.safetensors");
    let n = 600_000; // three chunks of f32s
    let ramp = |i: usize| (i % 1000) as f32 * 0.25 - 100.0;
    let mut late_sub: Vec<f32> = (0..n).map(ramp).collect();
    late_sub[n - 1] = -f32::MIN_POSITIVE / 2.0;
    late_sub[300_000] = f32::MIN_POSITIVE / 4.0;
    let mut late_nan: Vec<f32> = (0..n).map(ramp).collect();
    late_nan[500_000] = f32::NAN;
    let clean: Vec<f32> = (0..n).map(ramp).collect();
    let mut m = BTreeMap::new();
    m.insert(
        "a_sub".to_string(),
        Tensor::from_f32([n], late_sub).unwrap(),
    );
    m.insert(
        "b_nan".to_string(),
        Tensor::from_f32([n], late_nan).unwrap(),
    );
    m.insert("c_clean".to_string(), Tensor::from_f32([n], clean).unwrap());
    save_params(&path, &m).unwrap();
    let loaded = load_params(&path).unwrap();
    let sub = loaded.tensors["a_sub"].as_f32().unwrap();
    assert_eq!((sub[300_000].to_bits(), sub[n - 1].to_bits()), (0, 0));
    assert_eq!(sub[1], ramp(1));
    assert_eq!(loaded.tensors["c_clean"], m["c_clean"]);
    assert_eq!(loaded.warnings.len(), 2, "{:?}", loaded.warnings);
    assert!(
        loaded.warnings[0].contains("tensor `b_nan` has 1 NaN and 0 infinite values"),
        "{}",
        loaded.warnings[0]
    );
    assert!(
        loaded.warnings[1].contains("tensor `a_sub` has 2 subnormal values (of 600000)"),
        "{}",
        loaded.warnings[1]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn save_into_missing_directory_fails_cleanly() {
    let dir = temp_dir("nodir");
    let path = dir.join("no/such/dir/w.safetensors");
    let e = msg(save_params(&path, &sample()));
    assert!(e.contains("w.safetensors"), "{e}");
    assert!(!path.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `.npy` file written by hand, as numpy would.
fn npy(descr: &str, fortran: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn npy_directory() {
    let dir = temp_dir("npy");
    std::fs::write(
        dir.join("W_iou.npy"),
        npy("<f4", "False", "(2, 2)", &f32_bytes(&[1.0, 2.0, 3.0, 4.0])),
    )
    .unwrap();
    let ids: Vec<u8> = [7i64, -1].iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(dir.join("ids.npy"), npy("<i8", "False", "(2,)", &ids)).unwrap();
    std::fs::write(dir.join("flag.npy"), npy("|b1", "False", "()", &[1])).unwrap();
    std::fs::write(dir.join("README.txt"), "not a tensor").unwrap();
    let loaded = load_params(&dir).unwrap();
    let names: Vec<&str> = loaded.tensors.keys().map(String::as_str).collect();
    assert_eq!(names, ["W_iou", "flag", "ids"]);
    assert_eq!(
        loaded.tensors["W_iou"],
        Tensor::from_f32([2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap()
    );
    assert_eq!(
        loaded.tensors["ids"],
        Tensor::from_i64([2], vec![7, -1]).unwrap()
    );
    assert_eq!(loaded.tensors["flag"], Tensor::scalar_bool(true));
    // The crate's own writer agrees with the hand-written bytes.
    assert_eq!(
        tumble_io::weights::npy_bytes(&loaded.tensors["W_iou"]),
        npy("<f4", "False", "(2, 2)", &f32_bytes(&[1.0, 2.0, 3.0, 4.0]))
    );
    // A single .npy file loads as one tensor.
    let one = load_params(&dir.join("ids.npy")).unwrap();
    assert_eq!(one.tensors.keys().collect::<Vec<_>>(), ["ids"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn npy_errors() {
    let p = Path::new("a.npy");
    let e = msg(parse_npy(p, &npy("<f4", "True", "(2, 2)", &[0; 16])));
    assert_eq!(
        e,
        "weights file `a.npy`: the array is stored in Fortran (column-major) order, which tumble \
         does not read; save it from numpy with `np.save(path, np.ascontiguousarray(a))`"
    );
    let e = msg(parse_npy(p, &npy(">f4", "False", "(2,)", &[0; 8])));
    assert!(
        e.contains("dtype `>f4` is not supported (big-endian data"),
        "{e}"
    );
    let e = msg(parse_npy(p, &npy("<f2", "False", "(2,)", &[0; 4])));
    assert!(e.contains("dtype `<f2` is not supported;"), "{e}");
    let e = msg(parse_npy(p, &npy("<f4", "False", "(2, 2)", &[0; 12])));
    assert_eq!(
        e,
        "weights file `a.npy`: shape (2, 2) of float32 needs 16 data bytes, but the file has \
         only 12; the file is truncated"
    );
    // numpy reads only versions 1.0, 2.0 and 3.0: a minor version is refused as numpy refuses it.
    let mut v11 = npy("<f4", "False", "(2,)", &[0; 8]);
    v11[7] = 1;
    assert_eq!(
        msg(parse_npy(p, &v11)),
        "weights file `a.npy`: .npy format version 1.1 is not supported (versions 1.0, 2.0 and \
         3.0 are)"
    );
    let e = msg(parse_npy(p, b"PK\x03\x04 not npy"));
    assert!(e.contains("not a .npy file"), "{e}");
    // Every truncation of a valid file: an error, never a panic.
    let good = npy("<f8", "False", "(3,)", &[0; 24]);
    for cut in 0..good.len() {
        assert!(parse_npy(p, &good[..cut]).is_err(), "cut {cut}");
    }
    let e = msg(load_params(&temp_dir("emptydir")));
    assert!(e.contains("the directory contains no .npy files"), "{e}");
}

#[test]
fn missing_file_names_the_path() {
    let e = msg(load_params(Path::new("/nonexistent/w.safetensors")));
    assert!(
        e.starts_with("cannot read the weights file `/nonexistent/w.safetensors`: "),
        "{e}"
    );
}

#[test]
fn tensors_must_tile_the_data_section() {
    let p = Path::new("w.safetensors");
    // A gap between two tensors.
    let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
    assert_eq!(
        msg(parse_safetensors(p, &with_header(h, &[0; 12]))),
        "weights file `w.safetensors`: tensor `b` starts at byte 8 of the data section, where 4 \
         was expected (the tensors must follow each other without gaps or overlaps); the file is \
         corrupt"
    );
    // Two tensors over the same bytes.
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    assert!(
        msg(parse_safetensors(p, &with_header(h, &[0; 8]))).contains("without gaps or overlaps")
    );
    // Bytes after the last tensor.
    let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    assert_eq!(
        msg(parse_safetensors(p, &with_header(h, &[0; 6]))),
        "weights file `w.safetensors`: the tensors end at byte 4 of the data section, but it has \
         6 bytes; the file is corrupt"
    );
    // Metadata: a map of strings, or nothing.
    let h =
        r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    assert!(parse_safetensors(p, &with_header(h, &[0; 4])).is_ok());
    let h = r#"{"__metadata__":5,"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    assert!(msg(parse_safetensors(p, &with_header(h, &[0; 4]))).contains("`__metadata__`"));
}

/// The file reader decodes tensor by tensor through a chunk: tensors larger than a chunk, and
/// every dtype, come back as the in-memory parser reads them; every truncation of the file is
/// an error naming it.
#[test]
fn reading_a_file_equals_parsing_its_bytes() {
    let dir = temp_dir("stream");
    let path = dir.join("w.safetensors");
    let tensors = sample_with_large();
    save_params(&path, &tensors).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(load_params(&path).unwrap().tensors, tensors);
    assert_eq!(parse_safetensors(&path, &bytes).unwrap(), tensors);
    for cut in [0, 5, 8, 20, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = msg(load_params(&path));
        assert!(e.contains(&path.display().to_string()), "{e}");
        assert!(
            e.contains("truncated") || e.contains("corrupt"),
            "cut {cut}: {e}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// What the `safetensors` crate's own serializer makes of `tensors` (data encoded whole).
fn crate_bytes(tensors: &BTreeMap<String, Tensor>) -> Vec<u8> {
    use tumble_tensor::Buffer;
    let encoded: Vec<(&String, Vec<u8>, &Tensor)> = tensors
        .iter()
        .map(|(n, t)| {
            let bytes: Vec<u8> = match t.buffer() {
                Buffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Buffer::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Buffer::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Buffer::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Buffer::Bool(v) => v.iter().map(|&b| u8::from(b)).collect(),
            };
            (n, bytes, t)
        })
        .collect();
    let dtype = |t: &Tensor| match t.dtype() {
        tumble_ir::DType::Float32 => safetensors::Dtype::F32,
        tumble_ir::DType::Float64 => safetensors::Dtype::F64,
        tumble_ir::DType::Int32 => safetensors::Dtype::I32,
        tumble_ir::DType::Int64 => safetensors::Dtype::I64,
        tumble_ir::DType::Bool => safetensors::Dtype::BOOL,
    };
    let views: Vec<_> = encoded
        .iter()
        .map(|(n, b, t)| {
            let v = safetensors::tensor::TensorView::new(dtype(t), t.shape().to_vec(), b);
            (n.as_str(), v.unwrap())
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// `save_params` (and `safetensors_bytes`) write tensor by tensor through a chunk: the bytes are
/// those of the `safetensors` crate's own serializer, for every dtype, an empty tensor, tensors
/// over several chunks, and no tensors at all.
#[test]
fn saving_writes_the_bytes_of_the_crates_serializer() {
    let dir = temp_dir("save");
    let path = dir.join("w.safetensors");
    for t in [sample_with_large(), BTreeMap::new()] {
        save_params(&path, &t).unwrap();
        let want = crate_bytes(&t);
        assert_eq!(std::fs::read(&path).unwrap(), want);
        assert_eq!(safetensors_bytes(&t).unwrap(), want);
        assert_eq!(load_params(&path).unwrap().tensors, t);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A header listing one tensor twice is refused (a JSON object keeps the last of repeated keys,
/// so whichever came last would be bound, silently), in either order of the two.
#[test]
fn a_tensor_listed_twice_in_the_header_is_refused() {
    let data = vec![0u8; 160];
    for (first, second) in [("[4, 10]", "[10, 4]"), ("[10, 4]", "[4, 10]")] {
        let header = format!(
            "{{\"emb\":{{\"dtype\":\"F32\",\"shape\":{first},\"data_offsets\":[0,160]}},\
             \"emb\":{{\"dtype\":\"F32\",\"shape\":{second},\"data_offsets\":[0,160]}}}}"
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&data);
        let m = msg(parse_safetensors(Path::new("dup.safetensors"), &bytes));
        assert!(m.contains("lists the tensor `emb` more than once"), "{m}");
    }
}
