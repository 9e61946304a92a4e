//! GGUF reader tests: a fixture written by the Python `gguf` package (scripts/reference/gguf_quants.py)
//! with one tensor per storage type, files built by our writer, corrupt files, and the real
//! SmolLM2 checkpoint when `COTRAIN_DEFAULT_MODEL` points at it.

use std::path::{Path, PathBuf};

use cotrain_model::gguf::writer::GgufWriter;
use cotrain_model::gguf::{
    GgmlType, GgufError, GgufFile, MetaValue, permute_qk_rows, unpermute_qk_rows,
};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

fn load_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn assert_close(name: &str, got: &[f32], want: &[Value]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let w = w.as_f64().unwrap() as f32;
        let tol = 1e-6 * w.abs().max(1.0);
        assert!((g - w).abs() <= tol, "{name}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn python_fixture_metadata_of_every_value_type() {
    let f = GgufFile::open(fixture("quants.gguf")).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.architecture().unwrap(), "testarch");
    assert_eq!(f.get("test.u8"), Some(&MetaValue::U8(200)));
    assert_eq!(f.get("test.i8"), Some(&MetaValue::I8(-100)));
    assert_eq!(f.get("test.u16"), Some(&MetaValue::U16(60000)));
    assert_eq!(f.get("test.i16"), Some(&MetaValue::I16(-30000)));
    assert_eq!(f.get_u32("test.u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get_i64("test.i32").unwrap(), -2_000_000_000);
    assert_eq!(f.get_u64("test.u64").unwrap(), (1 << 40) + 7);
    assert_eq!(f.get_i64("test.i64").unwrap(), -(1 << 40) - 7);
    assert_eq!(f.get_f32("test.f32").unwrap(), 0.5);
    assert_eq!(f.get("test.f64"), Some(&MetaValue::F64(2.25)));
    assert!(f.get_bool("test.bool").unwrap());
    assert_eq!(f.get_str("test.string").unwrap(), "héllo wörld");
    assert_eq!(
        f.get_str_array("test.str_array").unwrap(),
        vec!["a", "bc", "déf"]
    );
    assert_eq!(f.get_i64_array("test.int_array").unwrap(), vec![1, -2, 3]);
    assert_eq!(
        f.get_f32_array("test.float_array").unwrap(),
        vec![0.5, -1.25]
    );
    // Integer getters convert between widths only when the value fits.
    assert_eq!(f.get_u32("test.u8").unwrap(), 200);
    assert!(matches!(
        f.get_u32("test.i8"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        f.get_str("test.u8"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(
        matches!(f.get_u32("no.such.key"), Err(GgufError::MissingKey(k)) if k == "no.such.key")
    );
}

#[test]
fn python_fixture_dequantises_every_type_like_the_gguf_package() {
    let f = GgufFile::open(fixture("quants.gguf")).unwrap();
    let expected = load_json(&fixture("quants.json"));
    let tensors = expected["tensors"].as_object().unwrap();
    assert_eq!(tensors.len(), f.tensors().len());
    for (name, want) in tensors {
        let info = f
            .tensor_info(name)
            .unwrap_or_else(|| panic!("tensor {name} missing"));
        assert_eq!(
            info.ggml_type.to_string(),
            want["type"].as_str().unwrap(),
            "{name}: type"
        );
        let shape: Vec<usize> = want["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(info.shape, shape, "{name}: row-major shape");
        let got = f.dequantize(name).unwrap();
        assert_close(name, &got, want["values"].as_array().unwrap());
    }
    // The caller-buffer form gives the same values and checks the length.
    let mut buf = vec![0f32; 512];
    f.dequantize_to("q6_k", &mut buf).unwrap();
    assert_eq!(buf, f.dequantize("q6_k").unwrap());
    assert!(matches!(
        f.dequantize_to("q6_k", &mut [0f32; 10]),
        Err(GgufError::SizeMismatch(_))
    ));
    assert!(matches!(
        f.dequantize("nope"),
        Err(GgufError::TensorNotFound(_))
    ));
}

#[test]
fn every_truncation_of_a_file_is_an_error_not_a_panic() {
    let bytes = std::fs::read(fixture("quants.gguf")).unwrap();
    // The Python writer pads the file after the last tensor; only the padding may be cut.
    let full = GgufFile::from_bytes(bytes.clone()).unwrap();
    let data_end = full
        .tensors()
        .iter()
        .map(|t| t.offset + t.n_bytes)
        .max()
        .unwrap() as usize;
    assert!(data_end <= bytes.len() && bytes.len() - data_end < 64);
    for len in 0..data_end {
        let r = GgufFile::from_bytes(bytes[..len].to_vec());
        assert!(
            r.is_err(),
            "a file cut to {len} of {} bytes parsed",
            bytes.len()
        );
    }
    // Cutting into the last tensor's data names that tensor.
    let err = GgufFile::from_bytes(bytes[..data_end - 1].to_vec()).unwrap_err();
    assert!(
        matches!(&err, GgufError::BadTensor { tensor, .. } if tensor == "cube"),
        "{err}"
    );
    assert!(err.to_string().contains("truncated"), "{err}");
    assert!(GgufFile::from_bytes(bytes[..data_end].to_vec()).is_ok());
}

#[test]
fn corrupt_headers_give_typed_errors() {
    let bytes = std::fs::read(fixture("quants.gguf")).unwrap();
    let mut bad = bytes.clone();
    bad[0] = b'X';
    assert!(matches!(
        GgufFile::from_bytes(bad),
        Err(GgufError::BadMagic { .. })
    ));
    let mut v1 = bytes.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(v1),
        Err(GgufError::UnsupportedVersion(1))
    ));
    let mut huge = bytes.clone();
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(huge),
        Err(GgufError::Corrupt(_))
    ));
    // A string whose length runs past the end of the file.
    let mut long_key = bytes;
    long_key[24..32].copy_from_slice(&(1u64 << 50).to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(long_key),
        Err(GgufError::Truncated { .. })
    ));
    assert!(matches!(
        GgufFile::open("/definitely/not/here.gguf"),
        Err(GgufError::Io { .. })
    ));
}

#[test]
fn writer_round_trips_metadata_and_tensors() {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", MetaValue::String("llama".into()))
        .metadata("llama.block_count", MetaValue::U32(2))
        .metadata("llama.rope.freq_base", MetaValue::F32(10000.0))
        .metadata(
            "tokenizer.ggml.tokens",
            MetaValue::Array(vec![MetaValue::String("a".into()); 3]),
        );
    let values: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
    w.tensor_f32("w", &[2, 3], &values).unwrap();
    w.tensor_f16("h", &[3, 2], &values).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    w.write(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.get_u32(&f.arch_key("block_count").unwrap()).unwrap(), 2);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 10000.0);
    assert_eq!(f.tensor_info("w").unwrap().shape, vec![2, 3]);
    assert_eq!(f.tensor_info("h").unwrap().shape, vec![3, 2]);
    assert_eq!(f.tensor_info("h").unwrap().ggml_type, GgmlType::F16);
    assert_eq!(f.dequantize("w").unwrap(), values);
    assert_eq!(f.dequantize("h").unwrap(), values); // all exactly representable in f16
    assert!(w.tensor_f32("bad", &[4], &values).is_err());
}

#[test]
fn unsupported_tensor_type_names_tensor_and_type() {
    let mut w = GgufWriter::new();
    w.tensor_bytes("blk.0.ffn_up.weight", &[1, 256], GgmlType::Q2K, vec![0; 84])
        .unwrap();
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let err = f.dequantize("blk.0.ffn_up.weight").unwrap_err();
    assert!(
        matches!(&err, GgufError::UnsupportedType { tensor, ty: GgmlType::Q2K } if tensor == "blk.0.ffn_up.weight"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "gguf tensor `blk.0.ffn_up.weight` has unsupported type Q2_K"
    );
}

#[test]
fn unpermute_inverts_llama_cpp_qk_permutation() {
    // 2 heads of head_dim 4, 3 columns. llama.cpp: reshape(2, 2, 2, 3).swapaxes(1, 2): within a
    // head, HF rows [0, 1, 2, 3] are stored as [0, 2, 1, 3].
    let hf: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let gg = permute_qk_rows(&hf, 2, 8, 3).unwrap();
    let row = |w: &[f32], r: usize| w[r * 3..r * 3 + 3].to_vec();
    let order: Vec<usize> = (0..8).map(|r| row(&gg, r)[0] as usize / 3).collect();
    assert_eq!(order, vec![0, 2, 1, 3, 4, 6, 5, 7]);
    assert_eq!(unpermute_qk_rows(&gg, 2, 8, 3).unwrap(), hf);
    // head_dim 8: HF [0..8] stored as [0, 4, 1, 5, 2, 6, 3, 7].
    let hf: Vec<f32> = (0..8).map(|i| i as f32).collect();
    assert_eq!(
        permute_qk_rows(&hf, 1, 8, 1).unwrap(),
        vec![0., 4., 1., 5., 2., 6., 3., 7.]
    );
    assert!(unpermute_qk_rows(&hf, 3, 8, 1).is_err());
}

fn default_model() -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os("COTRAIN_DEFAULT_MODEL")?);
    path.exists().then_some(path)
}

#[test]
fn smollm2_gguf_metadata_and_rows_match_python() {
    let Some(path) = default_model() else {
        eprintln!("skipping: COTRAIN_DEFAULT_MODEL not set or missing");
        return;
    };
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(f.get_u32("llama.feed_forward_length").unwrap(), 1536);
    assert_eq!(f.get_u32("llama.attention.head_count").unwrap(), 9);
    assert_eq!(f.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(f.get_u32("llama.context_length").unwrap(), 8192);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    assert!((f.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap() - 1e-5).abs() < 1e-9);
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(f.get_array("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(f.get_array("tokenizer.ggml.merges").unwrap().len(), 48900);
    assert!(
        f.tensor_info("output.weight").is_none(),
        "embeddings are tied"
    );
    let count = |t: GgmlType| f.tensors().iter().filter(|i| i.ggml_type == t).count();
    assert_eq!(count(GgmlType::Q4_1), 210);
    assert_eq!(
        f.tensor_info("token_embd.weight").unwrap().ggml_type,
        GgmlType::Q8_0
    );
    assert_eq!(
        f.tensor_info("token_embd.weight").unwrap().shape,
        vec![49152, 576]
    );
    assert_eq!(
        f.tensor_info("blk.0.attn_k.weight").unwrap().shape,
        vec![192, 576]
    );

    let expected = load_json(&fixture("smollm2_rows.json"));
    for (name, want) in expected.as_object().unwrap() {
        let info = f.tensor_info(name).unwrap();
        let cols = *info.shape.last().unwrap();
        let got = f.dequantize(name).unwrap();
        match want["rows"].as_array() {
            None => assert_close(name, &got, want["values"].as_array().unwrap()),
            Some(rows) => {
                for (r, vals) in rows.iter().zip(want["values"].as_array().unwrap()) {
                    let r = r.as_u64().unwrap() as usize;
                    assert_close(
                        &format!("{name} row {r}"),
                        &got[r * cols..(r + 1) * cols],
                        vals.as_array().unwrap(),
                    );
                }
            }
        }
    }

    let start = std::time::Instant::now();
    let mut total = 0usize;
    for info in f.tensors() {
        total += f.dequantize(&info.name).unwrap().len();
    }
    eprintln!("dequantised {total} values in {:?}", start.elapsed());
    assert_eq!(total, 134_515_008);
}
