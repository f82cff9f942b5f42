//! Fuzz-style property tests of the model file headers a user hands over: a GGUF file and an
//! HF directory's `model.safetensors`, each a real tiny model with header bytes overwritten or
//! the file cut short. Reading the hyper-parameters, the tensors and the whole model returns a
//! model or an error naming the file; it never panics or aborts.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use proptest::prelude::*;

use super::*;
use crate::model::{Arch, ModelArgs};

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

/// Regression input: a tensor whose header declares a zero dimension. candle's reader builds
/// a typed slice from the empty buffer and panics on the dangling pointer's alignment (or
/// divides by zero elements further on); opening the file is an error naming the file and the
/// tensor instead. The same file with the dimension intact opens.
#[test]
fn a_gguf_tensor_without_elements_is_an_error_not_a_panic() {
    use candle_core::quantized::gguf_file::Value as G;
    use candle_core::quantized::QTensor;
    let dir = tempfile::tempdir().unwrap();
    let t = QTensor::quantize(
        &candle_core::Tensor::ones((2, 32), DType::F32, &Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap();
    let path = dir.path().join("empty.gguf");
    let arch = G::String("llama".into());
    let meta: Vec<(&str, &G)> = vec![("general.architecture", &arch)];
    let mut f = std::fs::File::create(&path).unwrap();
    candle_core::quantized::gguf_file::write(&mut f, &meta, &[("token_embd.weight", &t)]).unwrap();
    drop(f);
    let (mut f, c) = gguf::open(&path).expect("the intact file opens");
    assert_eq!(
        c.tensor(&mut f, "token_embd.weight", &Device::Cpu)
            .unwrap()
            .shape()
            .dims(),
        &[2, 32]
    );
    // The tensor info: dimension count (u32 2), then the dimensions innermost first (u64 32,
    // u64 2). Set the outer one to 0.
    let mut bytes = std::fs::read(&path).unwrap();
    let mut info = 2u32.to_le_bytes().to_vec();
    info.extend(32u64.to_le_bytes());
    info.extend(2u64.to_le_bytes());
    let at = bytes
        .windows(info.len())
        .position(|w| w == info.as_slice())
        .expect("the tensor info in the header");
    bytes[at + 12..at + 20].copy_from_slice(&0u64.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let e = gguf::open(&path).unwrap_err().to_string();
    assert!(
        e.contains("empty.gguf")
            && e.contains("token_embd.weight")
            && e.contains("has no elements"),
        "{e}"
    );
    // Loading a model from it fails the same way (no panic on the way in).
    match load_model_and_tokenizer(
        &path.display().to_string(),
        None,
        &Default::default(),
        DType::F32,
        &Device::Cpu,
        true,
    ) {
        Ok(_) => panic!("a model from a tensor without elements"),
        Err(e) => assert!(e.to_string().contains("empty.gguf"), "{e}"),
    }
}

/// Every scalar integer of a tiny model's GGUF metadata (sizes, counts, token ids).
fn integer_keys(c: &candle_core::quantized::gguf_file::Content) -> Vec<String> {
    use candle_core::quantized::gguf_file::Value as G;
    let mut keys: Vec<String> = c
        .metadata
        .iter()
        .filter(|(_, v)| matches!(v, G::U32(_) | G::I32(_) | G::U64(_) | G::I64(_)))
        .map(|(k, _)| k.clone())
        .collect();
    keys.sort();
    keys
}

/// A copy of the GGUF file `path` (`changed.gguf` beside it) with the integer metadata entry
/// number `key` (of [`integer_keys`], taken modulo their count) set to `value` (cut to the
/// entry's own type); returns the copy and the key.
fn with_metadata_integer(path: &Path, key: usize, value: u64) -> (std::path::PathBuf, String) {
    use candle_core::quantized::gguf_file::{self, Value as G};
    use candle_core::quantized::QTensor;
    let (mut f, c) = gguf::open(path).unwrap();
    let keys = integer_keys(&c);
    let key = keys[key % keys.len()].clone();
    let mut meta = c.metadata.clone();
    let changed = match &meta[&key] {
        G::U32(_) => G::U32(value as u32),
        G::I32(_) => G::I32(value as i32),
        G::U64(_) => G::U64(value),
        _ => G::I64(value as i64),
    };
    meta.insert(key.clone(), changed);
    let mut names: Vec<&String> = c.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, QTensor)> = names
        .iter()
        .map(|n| ((*n).clone(), c.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    let out = path.with_file_name("changed.gguf");
    let mut w = std::fs::File::create(&out).unwrap();
    let meta_refs: Vec<(&str, &G)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &meta_refs, &tensor_refs).unwrap();
    (out, key)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// The header fuzz above changes bytes; this one changes meaning: one metadata integer the
    /// model is built from (layer count, widths, head counts, context, vocabulary size, token
    /// ids) set to any value, including sizes no file could back. Loading gives a model or an
    /// error naming the file, never a panic or an abort from allocating by the value (run it
    /// under a memory limit, e.g. `prlimit --as=4000000000`, to make such an allocation fail
    /// fast).
    #[test]
    fn any_integer_in_the_gguf_metadata_loads_or_is_an_error(
        key in 0usize..64,
        value in prop_oneof![
            Just(0u64), Just(1), Just(2), Just(3), Just(u64::from(u32::MAX)), Just(u64::MAX),
            Just(1 << 31), Just(1 << 40), 0u64..100_000, any::<u64>(),
        ],
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = tiny_gguf(dir.path());
        let (out, key) = with_metadata_integer(&path, key, value);
        let shown = out.display().to_string();
        if let Err(e) = read_args(&shown, &Default::default()) {
            prop_assert!(e.to_string().contains("changed.gguf"), "{}: {}", key, e);
        }
        if let Err(e) = load_model_and_tokenizer(&shown, None, &Default::default(), DType::F32, &Device::Cpu, true) {
            prop_assert!(!e.to_string().is_empty());
        }
    }
}

/// Regression input found by the metadata fuzz above: a width, layer count or vocabulary size
/// of 2^32 - 1 in the header made the model allocate its variables by that size before the
/// weights were compared with it (`memory allocation of 4449586117620 bytes failed`, an
/// abort). Every variable is now one of the file's tensors, so each is an error naming the
/// tensor whose shape disagrees (or the missing one), and the file is loaded nowhere else.
#[test]
fn a_gguf_size_the_weights_do_not_back_is_an_error_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = tiny_gguf(dir.path());
    let (_, c) = gguf::open(&path).unwrap();
    let keys = integer_keys(&c);
    for want in [
        "llama.vocab_size",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.block_count",
        "llama.attention.head_count_kv",
    ] {
        let k = keys.iter().position(|k| k == want).unwrap();
        let (out, _) = with_metadata_integer(&path, k, u64::from(u32::MAX));
        match load_model_and_tokenizer(
            &out.display().to_string(),
            None,
            &Default::default(),
            DType::F32,
            &Device::Cpu,
            true,
        ) {
            Ok(_) => panic!("{want} = 2^32 - 1 loaded"),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains("has shape")
                        || e.contains("no tensor")
                        || e.contains("changed.gguf"),
                    "{want}: {e}"
                );
            }
        }
    }
}
