//! Bad model folders and bad requests give errors that name the file, tensor or
//! field at fault, and never panic.
use dataplane::model::{Logits, Model};
use dataplane::Error;
use std::path::{Path, PathBuf};

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name)
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hypic-bad-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn copy_dir(src: &Path, dst: &Path) {
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

fn load_err(dir: &Path) -> Error {
    match Model::load(dir, &mut |_, _| {}) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    }
}

/// Rewrites one tensor's header entry in a single-file safetensors checkpoint.
fn edit_header(file: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(&mut h);
    let mut hb = serde_json::to_vec(&h).unwrap();
    while hb.len() < n {
        hb.push(b' ');
    }
    assert_eq!(
        hb.len(),
        n,
        "edited header must keep its length for this test"
    );
    let mut out = Vec::with_capacity(bytes.len());
    out.extend_from_slice(&bytes[..8]);
    out.extend_from_slice(&hb);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(file, out).unwrap();
}

#[test]
fn missing_config_names_the_file() {
    let d = tmp("noconfig");
    let e = load_err(&d);
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert!(e.to_string().contains("config.json"), "{e}");
}

#[test]
fn missing_weights_name_the_file() {
    let d = tmp("noweights");
    std::fs::copy(golden("qwen3_5").join("config.json"), d.join("config.json")).unwrap();
    let e = load_err(&d);
    assert!(e.to_string().contains("safetensors"), "{e}");
}

#[test]
fn unknown_model_type_is_named() {
    let d = tmp("mtype");
    std::fs::write(
        d.join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 8}"#,
    )
    .unwrap();
    let e = load_err(&d);
    assert!(
        matches!(&e, Error::UnsupportedModel(t) if t == "llama"),
        "{e}"
    );
    assert!(e.to_string().contains("llama"));
}

#[test]
fn missing_config_field_is_named() {
    let d = tmp("field");
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(golden("qwen3_next").join("config.json")).unwrap(),
    )
    .unwrap();
    cfg.as_object_mut()
        .unwrap()
        .remove("linear_num_value_heads");
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let e = load_err(&d);
    assert!(e.to_string().contains("linear_num_value_heads"), "{e}");
}

#[test]
fn invalid_json_config_names_the_file() {
    let d = tmp("json");
    std::fs::write(d.join("config.json"), "{ not json").unwrap();
    let e = load_err(&d);
    assert!(e.to_string().contains("config.json"), "{e}");
}

#[test]
fn wrong_tensor_shape_is_named() {
    let d = tmp("shape");
    copy_dir(&golden("qwen3_next"), &d);
    edit_header(&d.join("model.safetensors"), |h| {
        // Same element count, different shape: [64] stays [64] but norm [64] → [8, 8].
        let t = h.get_mut("model.norm.weight").unwrap();
        t["shape"] = serde_json::json!([8, 8]);
    });
    let e = load_err(&d);
    assert!(
        matches!(&e, Error::Shape { name, .. } if name == "model.norm.weight"),
        "{e}"
    );
}

#[test]
fn wrong_tensor_dtype_is_named() {
    let d = tmp("dtype");
    copy_dir(&golden("qwen3_next"), &d);
    edit_header(&d.join("model.safetensors"), |h| {
        // F32 [64] → I32 [64]: same byte size, unsupported dtype.
        h.get_mut("model.norm.weight").unwrap()["dtype"] = serde_json::json!("I32");
    });
    let e = load_err(&d);
    assert!(
        matches!(&e, Error::Dtype { name, .. } if name == "model.norm.weight"),
        "{e}"
    );
}

#[test]
fn corrupt_safetensors_header_names_the_file() {
    let d = tmp("corrupt");
    copy_dir(&golden("qwen3_5"), &d);
    let f = d.join("model.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[8..40].copy_from_slice(&[b'#'; 32]);
    std::fs::write(&f, bytes).unwrap();
    let e = load_err(&d);
    assert!(matches!(e, Error::Safetensors { .. }), "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    // A truncated file too.
    std::fs::write(&f, [1u8, 2, 3]).unwrap();
    let e = load_err(&d);
    assert!(e.to_string().contains("model.safetensors"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let d = tmp("missing");
    copy_dir(&golden("qwen3_next"), &d);
    edit_header(&d.join("model.safetensors"), |h| {
        let v = h.remove("lm_head.weight").unwrap();
        h.insert("lm_head.weigh_".into(), v);
    });
    let e = load_err(&d);
    assert!(
        matches!(&e, Error::MissingTensor { name, .. } if name == "lm_head.weight"),
        "{e}"
    );
}

#[test]
fn empty_prompt_and_bad_tokens_are_input_errors() {
    let m = Model::load(&golden("qwen3_5"), &mut |_, _| {}).unwrap();
    let mut st = m.new_state();
    let e = m.prefill(&[], &mut st, Logits::Last).unwrap_err();
    assert!(e.to_string().contains("empty prompt"), "{e}");
    let e = m.prefill(&[1, 99_999], &mut st, Logits::Last).unwrap_err();
    assert!(e.to_string().contains("99999"), "{e}");
    // The failed calls left the state untouched.
    assert_eq!(st, m.new_state());
}
