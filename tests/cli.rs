//! `ckptctl` as an operator uses it: corruption is found and named, damaged data is never
//! handed out, bad input gets a clear error and the documented exit code, imports from
//! Python's `safetensors` export byte-identical, and the local index rebuilds from storage.

use std::path::{Path, PathBuf};

use lazarus_tests::deadline::test_dir;
use lazarus_tests::runbook::Runbook;
use lazarus_tests::{files_under, random_f32_bytes, write_safetensors, Ctl, S3Server};

/// A store with run `r` holding steps 10 and 20 imported from files, chunked small.
fn fixture(dir: &Path) -> (Ctl, PathBuf) {
    let store = dir.join("store");
    let ctl = Ctl::new(format!("file://{}", store.display()), &dir.join("index"));
    let input = dir.join("model.safetensors");
    write_safetensors(
        &input,
        &[
            ("w1", vec![256, 256], random_f32_bytes(256 * 256, 1)),
            ("w2", vec![100, 300], random_f32_bytes(30_000, 2)),
        ],
    );
    ctl.expect(
        0,
        &[
            "import",
            "r",
            "--step",
            "10",
            "--chunk-bytes",
            "65536",
            input.to_str().unwrap(),
        ],
    );
    let second = dir.join("model2.safetensors");
    write_safetensors(
        &second,
        &[
            ("w1", vec![256, 256], random_f32_bytes(256 * 256, 3)),
            ("w2", vec![100, 300], random_f32_bytes(30_000, 2)),
        ],
    );
    ctl.expect(
        0,
        &["import", "r", "--step", "20", second.to_str().unwrap()],
    );
    (ctl, input)
}

fn copy_dir(from: &Path, to: &Path) {
    for file in files_under(from) {
        let target = to.join(file.strip_prefix(from).unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(&file, &target).unwrap();
    }
}

#[derive(Clone, Copy, Debug)]
enum Damage {
    FlipBit,
    Truncate,
    Delete,
}

fn damage(path: &Path, how: Damage) {
    match how {
        Damage::FlipBit => {
            let mut bytes = std::fs::read(path).unwrap();
            let middle = bytes.len() / 2;
            bytes[middle] ^= 0x04;
            std::fs::write(path, bytes).unwrap();
        }
        Damage::Truncate => {
            let bytes = std::fs::read(path).unwrap();
            std::fs::write(path, &bytes[..bytes.len() / 2]).unwrap();
        }
        Damage::Delete => std::fs::remove_file(path).unwrap(),
    }
}

#[test]
fn every_kind_of_damage_is_found_named_and_refused() {
    let dir = test_dir();
    let (pristine, _) = fixture(dir.path());
    let pristine_store = dir.path().join("store");
    pristine.expect(0, &["verify", "r", "--all", "--read-data"]);

    let step10 = |store: &Path| store.join("runs/r");
    let manifest10 = Path::new("shards/000000000010/000000.json");
    let commit10 = Path::new("commits/000000000010.json");
    // A chunk only step 10 uses (w1 changed in step 20), found through `show --json`.
    let shown = pristine.json(&["show", "r", "10"]);
    let chunk = shown["manifests"][0]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "w1")
        .unwrap()["chunks"][1]["hash"]
        .as_str()
        .unwrap()
        .to_string();
    let chunk_path = PathBuf::from(format!("chunks/{}/{chunk}", &chunk[..2]));

    for (target, what) in [
        (&chunk_path, "chunk"),
        (&manifest10.to_path_buf(), "manifest"),
        (&commit10.to_path_buf(), "commit"),
    ] {
        for how in [Damage::FlipBit, Damage::Truncate, Damage::Delete] {
            let case = test_dir();
            copy_dir(&pristine_store, &case.path().join("store"));
            damage(&step10(&case.path().join("store")).join(target), how);
            let ctl = Ctl::new(
                format!("file://{}", case.path().join("store").display()),
                &case.path().join("index"),
            );
            let label = format!("{how:?} {what}");

            // verify names the damage and exits 3.
            let report = ctl.expect(3, &["verify", "r", "10", "--read-data"]);
            assert!(
                report.contains("step=10"),
                "{label}: verify did not name the step:\n{report}"
            );
            if what == "chunk" {
                assert!(
                    report.contains(&chunk)
                        && report.contains("tensor=\"w1\"")
                        && report.contains("rank=0"),
                    "{label}: not named:\n{report}"
                );
            }
            // --all finds it too (a deleted commit leaves step 10 incomplete, not committed).
            if what != "commit" || !matches!(how, Damage::Delete) {
                ctl.expect(3, &["verify", "r", "--all", "--read-data"]);
            }
            // Step 20 shares w2 with step 10 and must still be fine unless a shared chunk was hit.
            ctl.expect(0, &["verify", "r", "20", "--read-data"]);

            // Neither export nor restore hands out damaged data.
            let out = case.path().join("export");
            let code = ctl
                .run(&["export", "r", "10", "--out", out.to_str().unwrap()])
                .status
                .code();
            assert!(
                matches!(code, Some(2) | Some(3)),
                "{label}: export exited {code:?}"
            );
            assert!(
                files_under(&out).is_empty(),
                "{label}: export left files: {:?}",
                files_under(&out)
            );
            let restored = case.path().join("restored");
            let code = ctl
                .run(&["restore", "r", "10", "--out", restored.to_str().unwrap()])
                .status
                .code();
            assert!(
                matches!(code, Some(2) | Some(3)),
                "{label}: restore exited {code:?}"
            );
            assert!(
                !restored.join("runs/r/commits/000000000010.json").exists(),
                "{label}: restore committed damaged data"
            );
        }
    }
}

#[test]
fn export_is_byte_identical_and_restore_gives_a_verified_local_store() {
    let dir = test_dir();
    let (ctl, input) = fixture(dir.path());
    let out = dir.path().join("export");
    ctl.expect(0, &["export", "r", "10", "--out", out.to_str().unwrap()]);
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        std::fs::read(&input).unwrap()
    );

    let restored = dir.path().join("restored");
    ctl.expect(
        0,
        &["restore", "r", "20", "--out", restored.to_str().unwrap()],
    );
    let local = Ctl::new(
        format!("file://{}", restored.display()),
        &dir.path().join("index2"),
    );
    local.expect(0, &["verify", "r", "20", "--read-data"]);
    let listed = local.json(&["list", "r"]);
    assert_eq!(listed["latest"]["step"], 20);

    // diff sees that w1 changed and w2 did not.
    let diff = ctl.json(&["diff", "r", "10", "20"]);
    let status = |name: &str| {
        diff.as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == name)
            .unwrap()["status"]
            .clone()
    };
    assert_eq!(
        (status("w1"), status("w2")),
        (serde_json::json!("changed"), serde_json::json!("same"))
    );
}

/// A checkpoint written by ranks, not imported: export writes one `model.safetensors` of
/// every global tensor, as the `safetensors` crate serializes them, a tensor that ranks hold
/// in slices assembled and one held whole written chunk by chunk.
#[test]
fn export_of_a_written_checkpoint_holds_every_global_tensor() {
    use bytes::Bytes;
    use lazarus_shared::format::DType;
    use lazarus_shared::store::{OpenMode, ShardInput, Store, StoreOptions, TensorData};
    use lazarus_shared::StepKey;

    let dir = test_dir();
    let url = format!("file://{}", dir.path().join("store").display());
    // 256 KB in 64 KiB chunks, and 96 KB split by rows over the two ranks.
    let embedding = random_f32_bytes(64 * 1000, 1);
    let expert = random_f32_bytes(8 * 3000, 2);
    let scale: Vec<u8> = (0..16u8).collect();
    let half: Vec<u8> = (100..106u8).collect();
    let row_bytes = 3000 * 4;
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let options = StoreOptions {
            chunk_bytes: 64 << 10,
            ..StoreOptions::default()
        };
        let store = Store::open(&url, OpenMode::CreateIfMissing, options)
            .await
            .unwrap();
        let run = store.run(&"r".parse().unwrap());
        run.create(serde_json::json!({})).await.unwrap();
        let step = StepKey::new(1, 0);
        for rank in 0..2u32 {
            let rows = u64::from(rank) * 4..u64::from(rank) * 4 + 4;
            let mut tensors = vec![
                TensorData::whole(
                    "embedding",
                    DType::F32,
                    vec![64, 1000],
                    Bytes::from(embedding.clone()),
                ),
                crate::conformance::sliced(
                    "expert",
                    &[8, 3000],
                    rows.clone(),
                    &expert[rows.start as usize * row_bytes..rows.end as usize * row_bytes],
                ),
            ];
            if rank == 1 {
                tensors.push(TensorData::whole(
                    "scale",
                    DType::F64,
                    vec![2],
                    Bytes::from(scale.clone()),
                ));
                tensors.push(TensorData::whole(
                    "half",
                    DType::BF16,
                    vec![3],
                    Bytes::from(half.clone()),
                ));
            }
            let input = ShardInput {
                step,
                rank,
                world_size: 2,
                tensors,
                blobs: Vec::new(),
            };
            run.write_shard(input, None, &()).await.unwrap();
        }
        run.commit(step, 2).await.unwrap();
    });

    let ctl = Ctl::new(url, &dir.path().join("index"));
    let out = dir.path().join("export");
    ctl.expect(0, &["export", "r", "1", "--out", out.to_str().unwrap()]);
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let view = |dtype, shape, data| TensorView::new(dtype, shape, data).unwrap();
    let expected = safetensors::serialize(
        [
            (
                "embedding",
                view(Dtype::F32, vec![64, 1000], &embedding[..]),
            ),
            ("expert", view(Dtype::F32, vec![8, 3000], &expert[..])),
            ("scale", view(Dtype::F64, vec![2], &scale[..])),
            ("half", view(Dtype::BF16, vec![3], &half[..])),
        ],
        None,
    )
    .unwrap();
    assert!(
        std::fs::read(out.join("model.safetensors")).unwrap() == expected,
        "the exported file is not the serialized global tensors"
    );
    assert_eq!(files_under(&out), vec![out.join("model.safetensors")]);
}

#[test]
fn rollback_hides_steps_and_list_shows_it() {
    let dir = test_dir();
    let (ctl, input) = fixture(dir.path());
    ctl.expect(2, &["rollback", "r", "--to", "10", "--reason", " "]);
    let said = ctl.expect(
        0,
        &[
            "rollback",
            "r",
            "--to",
            "10",
            "--reason",
            "loss spike at 15",
        ],
    );
    assert!(said.contains("rolled back run r to step 10"), "{said}");
    let listed = ctl.json(&["list", "r"]);
    assert_eq!(listed["latest"]["step"], 10);
    assert_eq!(listed["steps"][1]["state"], "rolled-back");
    let human = ctl.expect(0, &["list", "r"]);
    assert!(
        human.contains("rolled back (#1)") && human.contains("loss spike at 15"),
        "{human}"
    );
    // Training continues from 10 on a new timeline: step 20 can be written again.
    ctl.expect(0, &["import", "r", "--step", "20", input.to_str().unwrap()]);
    assert_eq!(
        ctl.json(&["list", "r"])["latest"],
        serde_json::json!({"step": 20, "timeline": 1})
    );
    // The hidden step is still there and still verifies.
    ctl.expect(0, &["verify", "r", "20-t0", "--read-data"]);
    // A reader that stops early (`ckptctl show r 20 | head -1`) ends ckptctl quietly.
    let mut child = ctl
        .command(&["show", "r", "20"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{:?}: {stderr}", output.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_input_gets_a_clear_error_and_changes_nothing() {
    let dir = test_dir();
    let (ctl, _) = fixture(dir.path());
    let before = files_under(&dir.path().join("store"));

    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":1}").unwrap();
    let said = ctl.expect(
        2,
        &["import", "r", "--step", "30", garbage.to_str().unwrap()],
    );
    assert!(
        said.contains("garbage.safetensors: not a valid safetensors file"),
        "{said}"
    );
    let missing = ctl.expect(
        1,
        &["import", "r", "--step", "30", "/nonexistent/x.safetensors"],
    );
    assert!(missing.contains("/nonexistent/x.safetensors"), "{missing}");
    assert!(ctl
        .expect(2, &["list", "../etc"])
        .contains("invalid run id"));
    assert!(ctl
        .expect(2, &["list", "nosuchrun"])
        .contains("does not exist"));
    assert!(ctl
        .expect(2, &["show", "r", "15"])
        .contains("no committed step 15"));
    assert!(ctl
        .expect(
            2,
            &[
                "import",
                "r",
                "--step",
                "10",
                dir.path().join("model2.safetensors").to_str().unwrap()
            ]
        )
        .contains("already committed"));
    assert_eq!(
        files_under(&dir.path().join("store")),
        before,
        "bad input changed the store"
    );

    let bad_url = Ctl::new("ftp://host/x", &dir.path().join("index"));
    assert!(bad_url.expect(2, &["runs"]).contains("unknown scheme"));
    let relative = Ctl::new("file://relative/path", &dir.path().join("index"));
    assert!(relative.expect(2, &["runs"]).contains("absolute path"));
    let absent = Ctl::new(
        format!("file://{}", dir.path().join("absent").display()),
        &dir.path().join("index"),
    );
    assert!(absent.expect(2, &["runs"]).contains("is not a directory"));

    // A format version from the future is refused by name.
    let commit = dir.path().join("store/runs/r/commits/000000000020.json");
    let text = std::fs::read_to_string(&commit)
        .unwrap()
        .replace("\"format_version\":1", "\"format_version\":99");
    std::fs::write(&commit, text).unwrap();
    let listed = ctl.expect(0, &["list", "r"]);
    assert!(
        listed.contains("DAMAGED") && listed.contains("format version 99 is not supported"),
        "{listed}"
    );
    assert!(ctl
        .expect(3, &["verify", "r", "--all"])
        .contains("format version 99 is not supported"));
}

#[test]
fn s3_errors_are_clear() {
    let server = S3Server::start();
    let dir = test_dir();
    let mut ctl = Ctl::new(server.url("x"), &dir.path().join("index"));
    ctl.envs = server.envs();
    ctl.expect(0, &["runs"]);
    let mut no_bucket = Ctl::new("s3://no-such-bucket/x", &dir.path().join("index"));
    no_bucket.envs = server.envs();
    let said = no_bucket.expect(2, &["runs"]);
    assert!(said.contains("does not exist"), "{said}");
    let mut no_credentials = Ctl::new(server.url("x"), &dir.path().join("index"));
    no_credentials.envs = server
        .envs()
        .into_iter()
        .filter(|(k, _)| !k.contains("KEY"))
        .collect();
    let mut command = no_credentials.command(&["runs"]);
    command
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY");
    let output = command.output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("no S3 credentials"));

    // The same import, export and verify work against the real S3 server.
    let input = dir.path().join("m.safetensors");
    write_safetensors(
        &input,
        &[("w", vec![300, 300], random_f32_bytes(90_000, 5))],
    );
    ctl.expect(
        0,
        &[
            "import",
            "r",
            "--step",
            "1",
            "--chunk-bytes",
            "65536",
            input.to_str().unwrap(),
        ],
    );
    ctl.expect(0, &["verify", "r", "1", "--read-data"]);
    let out = dir.path().join("out");
    ctl.expect(0, &["export", "r", "1", "--out", out.to_str().unwrap()]);
    assert_eq!(
        std::fs::read(out.join("m.safetensors")).unwrap(),
        std::fs::read(&input).unwrap()
    );
}

#[test]
fn python_safetensors_files_round_trip_byte_identical() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import safetensors.numpy, numpy"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        println!("SKIPPED: python3 with safetensors and numpy is not installed (ops/setup.sh test installs them)");
        return;
    }
    let dir = test_dir();
    let file = dir.path().join("py.safetensors");
    let script = r#"
import sys, numpy as np, safetensors.numpy as st
rng = np.random.default_rng(7)
st.save_file({
    "model.layers.0.mlp.experts": rng.standard_normal((4, 64, 32)).astype(np.float32),
    "model.norm.weight": rng.standard_normal(64).astype(np.float16),
    "step": np.array([1234], dtype=np.int64),
    "mask": (rng.standard_normal(77) > 0).astype(np.uint8),
}, sys.argv[1], metadata={"format": "np", "note": "written by python"})
"#;
    let written = std::process::Command::new("python3")
        .args(["-c", script, file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        written.status.success(),
        "{}",
        String::from_utf8_lossy(&written.stderr)
    );
    let ctl = Ctl::new(
        format!("file://{}", dir.path().join("store").display()),
        &dir.path().join("index"),
    );
    ctl.expect(0, &["import", "py", "--step", "1", file.to_str().unwrap()]);
    let out = dir.path().join("out");
    ctl.expect(0, &["export", "py", "1", "--out", out.to_str().unwrap()]);
    assert_eq!(
        std::fs::read(out.join("py.safetensors")).unwrap(),
        std::fs::read(&file).unwrap(),
        "export is not byte-identical"
    );
    let check = r#"
import sys, numpy as np, safetensors.numpy as st
a, b = st.load_file(sys.argv[1]), st.load_file(sys.argv[2])
assert a.keys() == b.keys()
for k in a: assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
print("python loaded", len(b), "tensors")
"#;
    let loaded = std::process::Command::new("python3")
        .args([
            "-c",
            check,
            file.to_str().unwrap(),
            out.join("py.safetensors").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        loaded.status.success(),
        "{}",
        String::from_utf8_lossy(&loaded.stderr)
    );
}

#[test]
fn the_index_rebuilds_from_storage_alone() {
    let dir = test_dir();
    let (ctl, _) = fixture(dir.path());
    let before = ctl.json(&["index", "stats"]);
    assert!(
        before["chunks"].as_u64().unwrap() > 0 && before["manifests"] == 2,
        "{before}"
    );
    std::fs::remove_dir_all(dir.path().join("index")).unwrap();
    ctl.expect(0, &["verify", "r", "--all", "--read-data", "--no-index"]);
    let rebuilt = ctl.json(&["index", "rebuild"]);
    assert_eq!(
        rebuilt, before,
        "rebuilt index differs from the one built while writing"
    );
}

#[test]
fn the_corruption_and_rollback_runbooks_work_as_written() {
    let dir = test_dir();
    let (ctl, _) = fixture(dir.path());
    // Step 30 changes w1 again; one of its own chunks rots.
    let third = dir.path().join("model3.safetensors");
    write_safetensors(
        &third,
        &[
            ("w1", vec![256, 256], random_f32_bytes(256 * 256, 5)),
            ("w2", vec![100, 300], random_f32_bytes(30_000, 2)),
        ],
    );
    ctl.expect(0, &["import", "r", "--step", "30", third.to_str().unwrap()]);
    let shown = ctl.json(&["show", "r", "30"]);
    let chunk = shown["manifests"][0]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "w1")
        .unwrap()["chunks"][0]["hash"]
        .as_str()
        .unwrap()
        .to_string();
    damage(
        &dir.path()
            .join("store/runs/r/chunks")
            .join(&chunk[..2])
            .join(&chunk),
        Damage::FlipBit,
    );
    let env = |good: &str, bad: &str| {
        vec![
            ("LAZARUS_STORE", ctl.store.clone()),
            ("LAZARUS_INDEX", ctl.index.display().to_string()),
            ("RUN", "r".to_string()),
            ("GOOD_STEP", good.to_string()),
            ("BAD_STEP", bad.to_string()),
        ]
    };
    let runbook = Runbook::load("corrupted-checkpoint.md");
    let env_corrupt = env("20", "30");
    let confirmed = runbook.run("Confirm", &env_corrupt);
    assert!(
        confirmed.contains("step=30") && confirmed.contains(&chunk),
        "{confirmed}"
    );
    runbook.run("Fix", &env_corrupt);
    let verified = runbook.run("Verify it worked", &env_corrupt);
    assert!(verified.contains("rolled back"), "{verified}");
    assert_eq!(ctl.json(&["list", "r"])["latest"]["step"], 20);

    // A loss spike after step 10 of a healthy copy: back to 10.
    let spiked = test_dir();
    let (ctl, _) = fixture(spiked.path());
    let runbook = Runbook::load("rollback-after-loss-spike.md");
    let env_spike = vec![
        ("LAZARUS_STORE", ctl.store.clone()),
        ("LAZARUS_INDEX", ctl.index.display().to_string()),
        ("RUN", "r".to_string()),
        ("GOOD_STEP", "10".to_string()),
        ("BAD_STEP", "20".to_string()),
    ];
    let confirmed = runbook.run("Confirm", &env_spike);
    assert!(
        confirmed.contains("w1") && confirmed.contains("changed"),
        "{confirmed}"
    );
    runbook.run("Roll back", &env_spike);
    let verified = runbook.run("Verify it worked", &env_spike);
    assert!(verified.contains("loss spike after step 10"), "{verified}");
    assert_eq!(ctl.json(&["list", "r"])["latest"]["step"], 10);
}
