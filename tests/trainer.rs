//! `trainer` as a user runs it: data preparation on real text, and clear errors with exit 2
//! for bad configs and missing data.

use std::process::Command;

use lazarus_tests::{bin, shared_data};

fn trainer(args: &[&str]) -> (i32, String) {
    let output = Command::new(bin("trainer")).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.code().unwrap_or(-1), text)
}

#[test]
fn prepare_tokenizes_tinyshakespeare_with_gpt2() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ts");
    let input = shared_data("tinyshakespeare.txt");
    let (code, said) = trainer(&[
        "prepare",
        "--input",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--val-fraction",
        "0.1",
    ]);
    assert_eq!(code, 0, "{said}");
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("index.json")).unwrap()).unwrap();
    let (train, val) = (
        index["train"]["tokens"].as_u64().unwrap(),
        index["val"]["tokens"].as_u64().unwrap(),
    );
    // GPT-2 BPE turns these 1.1 MB into about 338k tokens.
    assert!(
        (330_000..345_000).contains(&(train + val)),
        "{train} + {val} tokens"
    );
    assert!(
        val * 9 <= train + val && val * 11 >= train + val,
        "validation share is not 10%: {val} of {}",
        train + val
    );
    assert_eq!(
        std::fs::metadata(out.join("train.tokens")).unwrap().len(),
        train * 2
    );
    assert!(said.contains("prepared 1 document(s)"), "{said}");
}

#[test]
fn bad_configs_and_missing_data_exit_2_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    for (args, says) in [
        (
            vec!["train", "--config", "tiny", "--set", "model.expert=3"],
            "unknown key \"expert\"",
        ),
        (
            vec!["train", "--config", "tiny", "--set", "model.heads=5"],
            "multiple of model.heads",
        ),
        (
            vec!["train", "--config", "/no/such.toml"],
            "cannot read config /no/such.toml",
        ),
        (
            vec![
                "train",
                "--config",
                "tiny",
                "--set",
                "data.path=/no/such/data",
            ],
            "prepare the data first",
        ),
        (
            vec![
                "prepare",
                "--input",
                "/no/such/text",
                "--out",
                dir.path().to_str().unwrap(),
            ],
            "/no/such/text",
        ),
    ] {
        let (code, said) = trainer(&args);
        assert_eq!(code, 2, "{args:?}: {said}");
        assert!(said.contains(says), "{args:?}: {said}");
    }
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "[model]\nd_model = 'wide'\n").unwrap();
    let (code, said) = trainer(&["train", "--config", config.to_str().unwrap()]);
    assert_eq!(code, 2, "{said}");
    assert!(said.contains("bad.toml"), "{said}");
}
