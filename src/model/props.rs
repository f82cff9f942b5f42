//! Fuzz-style property tests of the model file headers a user hands over: a GGUF file and an
//! HF directory's `model.safetensors`, each a real tiny model with header bytes overwritten or
//! the file cut short. Reading the hyper-parameters, the tensors and the whole model returns a
//! model or an error naming the file; it never panics or aborts.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use proptest::prelude::*;

use super::*;

/// A tiny Llama in GGUF (tokenizer in the metadata) and the offset where tensor data starts.
fn tiny_gguf(dir: &Path) -> (std::path::PathBuf, usize) {
    let args = ModelArgs::tiny(Arch::Llama, 259);
    let (vm, _m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
    let path = dir.join("m.gguf");
    super::tests::write_gguf(&vm, &args, &path, GgmlDType::F32);
    let (_, c) = gguf::open(&path).unwrap();
    (path, c.tensor_data_offset as usize)
}

/// A tiny Llama as an HF directory; returns the directory and the safetensors header length.
fn tiny_hf(dir: &Path) -> (std::path::PathBuf, usize) {
    let args = ModelArgs::tiny(Arch::Llama, 259);
    let (vm, _m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
    let out = dir.join("hf");
    hf::save_dir(&vm, &args, &out, &[258], None, None).unwrap();
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (out, 8 + n)
}

/// Overwrites bytes inside `0..limit` (the header) and optionally cuts the file.
fn damage(
    bytes: &mut Vec<u8>,
    limit: usize,
    edits: &[(prop::sample::Index, u8)],
    cut: Option<prop::sample::Index>,
) {
    let limit = limit.min(bytes.len()).max(1);
    for (at, b) in edits {
        let i = at.index(limit);
        bytes[i] = *b;
    }
    if let Some(c) = cut {
        let n = c.index(bytes.len());
        bytes.truncate(n);
    }
}

fn edits() -> impl Strategy<Value = Vec<(prop::sample::Index, u8)>> {
    proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn a_damaged_gguf_header_is_an_error_naming_the_file(
        edits in edits(),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (path, header) = tiny_gguf(dir.path());
        let mut bytes = std::fs::read(&path).unwrap();
        damage(&mut bytes, header, &edits, cut);
        std::fs::write(&path, &bytes).unwrap();
        let shown = path.display().to_string();
        let named = |e: &dyn std::fmt::Display| e.to_string().contains(&shown) || e.to_string().contains("m.gguf");
        match read_args(&shown, &Default::default()) {
            Ok(a) => prop_assert!(a.is_some()),
            Err(e) => prop_assert!(named(&e), "{}", e),
        }
        if let Ok((mut f, c)) = gguf::open(&path) {
            for name in c.tensor_infos.keys() {
                // Errors are fine; a panic or an abort is not.
                let _ = c.tensor(&mut f, name, &Device::Cpu);
            }
        }
        if let Err(e) = load_model_and_tokenizer(&shown, None, &Default::default(), DType::F32, &Device::Cpu, true) {
            prop_assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn a_damaged_safetensors_header_is_an_error_naming_the_file(
        edits in edits(),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (hf_dir, header) = tiny_hf(dir.path());
        let file = hf_dir.join("model.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        damage(&mut bytes, header, &edits, cut);
        std::fs::write(&file, &bytes).unwrap();
        match hf::read_weights(&hf_dir) {
            Ok(_) => {}
            Err(e) => prop_assert!(e.to_string().contains("model.safetensors"), "{}", e),
        }
        if let Err(e) = hf::load_dir(&hf_dir, &Default::default(), DType::F32, &Device::Cpu, true) {
            prop_assert!(!e.to_string().is_empty());
        }
    }
}

/// Regression input: `general.alignment = 0` made candle's reader divide by zero (a panic);
/// it is an error naming the file. Any other alignment value loads.
#[test]
fn a_zero_gguf_alignment_is_an_error_not_a_panic() {
    use candle_core::quantized::gguf_file::Value as G;
    use candle_core::quantized::QTensor;
    let dir = tempfile::tempdir().unwrap();
    let t = QTensor::quantize(
        &candle_core::Tensor::zeros((2, 32), DType::F32, &Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap();
    for (name, align, ok) in [
        ("u32", G::U32(0), false),
        ("u8", G::U8(0), false),
        ("i32", G::I32(0), false),
        ("good", G::U32(32), true),
    ] {
        let path = dir.path().join(format!("{name}.gguf"));
        let arch = G::String("llama".into());
        let tokens = G::Array(vec![G::String("a".into()), G::String("b".into())]);
        let meta: Vec<(&str, &G)> = vec![
            ("general.architecture", &arch),
            ("tokenizer.ggml.tokens", &tokens),
            ("general.alignment", &align),
        ];
        let mut f = std::fs::File::create(&path).unwrap();
        candle_core::quantized::gguf_file::write(&mut f, &meta, &[("token_embd.weight", &t)])
            .unwrap();
        drop(f);
        match gguf::open(&path) {
            Ok(_) => assert!(ok, "{name}"),
            Err(e) => {
                assert!(!ok, "{name}: {e}");
                let e = e.to_string();
                assert!(
                    e.contains("general.alignment") && e.contains(&format!("{name}.gguf")),
                    "{e}"
                );
            }
        }
    }
}

/// Regression input found by the property test above: a metadata key length of 2^40 made
/// candle's reader allocate it and abort the process; it is an error naming the file and the
/// field, before candle reads anything.
#[test]
fn a_huge_gguf_length_field_is_an_error_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = tiny_gguf(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    // GGUF v2/v3: magic, version (u32 each), tensor count, metadata count (u64 each), then the
    // first key's length (u64) at byte 24.
    assert!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()) >= 2);
    bytes[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = gguf::open(&path).unwrap_err().to_string();
    assert!(err.contains("m.gguf"), "{err}");
    assert!(
        err.contains("a metadata key's length is 1099511627776"),
        "{err}"
    );
}
