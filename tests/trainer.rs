//! `trainer` as a user runs it: data preparation on real text, and clear errors with exit 2
//! for bad configs and missing data.

use std::process::Command;

use lazarus_tests::deadline::test_dir;
use lazarus_tests::train::{prepared, TrainerArgs, SMALL_MODEL};
use lazarus_tests::{bin, shared_data};

pub(crate) fn trainer<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> (i32, String) {
    let output = Command::new(bin("trainer")).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.code().unwrap_or(-1), text)
}

#[test]
fn prepare_tokenizes_tinyshakespeare_with_gpt2() {
    let dir = test_dir();
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
    let dir = test_dir();
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
            vec!["train", "--config", "tiny", "--set", "parallel.pp=3"],
            "must divide model.layers 4",
        ),
        (
            vec!["train", "--config", "tiny", "--set", "parallel.tp=2"],
            "parallel.tp x parallel.pp = 2 x 1 must divide the number of ranks 1",
        ),
        (
            vec![
                "train",
                "--config",
                "tiny",
                "--set",
                "parallel.schedule=\"zigzag\"",
            ],
            "parallel.schedule \"zigzag\"",
        ),
        (
            vec![
                "train",
                "--config",
                "tiny",
                "--set",
                "test_faults.crash_at_step=5",
            ],
            "[test_faults] injects faults for tests and is refused in a real run",
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

/// A small model (the GPT-2 vocabulary still sets the head's width) for fast loop tests,
/// metrics under `metrics`.
fn small(metrics: &std::path::Path) -> TrainerArgs {
    TrainerArgs::new("tiny")
        .metrics(metrics)
        .sets(SMALL_MODEL)
        .set("train.val_every", 1000)
}

/// Per-step losses from a run's metrics.jsonl, as exact bit patterns.
fn losses(metrics_dir: &std::path::Path, run: &str) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(metrics_dir.join(run).join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).unwrap();
            (
                value["step"].as_u64().unwrap(),
                value["loss"].as_f64().unwrap().to_bits(),
            )
        })
        .collect()
}

#[test]
fn training_is_deterministic_and_resume_is_bit_identical() {
    let dir = test_dir();
    let data = dir.path().join("data");
    let input = shared_data("tinyshakespeare.txt");
    assert_eq!(
        trainer(&[
            "prepare",
            "--input",
            input.to_str().unwrap(),
            "--out",
            data.to_str().unwrap()
        ])
        .0,
        0
    );
    let store = format!("file://{}", dir.path().join("store").display());
    let metrics = dir.path().join("metrics");
    let run = |id: &str, steps: u64| {
        let args = small(&metrics)
            .run(id)
            .steps(steps)
            .set("checkpoint.every", 100)
            .store(&store)
            .data(&data)
            .build();
        let (code, said) = trainer(&args);
        assert_eq!(code, 0, "{said}");
        said
    };
    // A measured matmul peak makes the logs report CPU-MFU.
    let (code, said) = trainer(&[
        "bench-peak",
        "--size",
        "256",
        "--out-dir",
        metrics.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("GFLOP/s"), "{said}");
    run("straight", 8);
    run("again", 8);
    let text = std::fs::read_to_string(metrics.join("straight").join("metrics.jsonl")).unwrap();
    for line in text.lines() {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        let mfu = value["mfu"]
            .as_f64()
            .unwrap_or_else(|| panic!("no mfu in {line}"));
        assert!(mfu > 0.0 && mfu < 2.0, "implausible MFU {mfu}");
        assert!(
            value["forward_ms"].as_f64().unwrap() > 0.0
                && value["backward_ms"].as_f64().unwrap() > 0.0
        );
    }
    let straight = losses(&metrics, "straight");
    assert_eq!(straight.len(), 8);
    assert_eq!(
        losses(&metrics, "again"),
        straight,
        "two runs with the same seed differ"
    );
    assert!(straight.last().unwrap().1 != straight[0].1);

    // 4 steps, stop (a checkpoint at the end), then resume to 8.
    run("resumed", 4);
    let said = run("resumed", 8);
    assert!(said.contains("resumed from step 4"), "{said}");
    assert_eq!(
        losses(&metrics, "resumed"),
        straight,
        "resume is not bit-identical"
    );

    // The final weights and Adam moments are bit-identical too: same chunk hashes.
    let ctl = lazarus_tests::Ctl::new(store.clone(), &dir.path().join("index"));
    let hashes = |run: &str| -> Vec<(String, serde_json::Value)> {
        let shown = ctl.json(&["show", run, "8"]);
        let mut tensors: Vec<(String, serde_json::Value)> = shown["manifests"][0]["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["name"].as_str().unwrap().to_string(),
                    t["chunks"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|c| c["hash"].clone())
                        .collect(),
                )
            })
            .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        tensors
    };
    let straight_state = hashes("straight");
    assert!(
        straight_state
            .iter()
            .any(|(name, _)| name == "layers.0.expert_gate.exp_avg_sq"),
        "moments are checkpointed"
    );
    assert_eq!(hashes("resumed"), straight_state);
    ctl.expect(0, &["verify", "resumed", "--all", "--read-data"]);

    // Checkpoints written in the background while training goes on: every one is committed,
    // the training is the same bit for bit, and so is a resume from one of them (step 6, a
    // delta against step 4, written while step 7 trained).
    let args = small(&metrics)
        .run("background")
        .steps(8)
        .set("checkpoint.every", 2)
        .set("checkpoint.background", true)
        .set("checkpoint.busy", "wait")
        .store(&store)
        .data(&data)
        .build();
    let (code, said) = trainer(&args);
    assert_eq!(code, 0, "{said}");
    assert_eq!(losses(&metrics, "background"), straight);
    let committed = ctl.committed("background");
    assert_eq!(
        committed,
        [2, 4, 6, 8],
        "{}",
        ctl.json(&["list", "background"])
    );
    assert_eq!(hashes("background"), straight_state);
    ctl.expect(0, &["verify", "background", "--all", "--read-data"]);
    ctl.expect(
        0,
        &["rollback", "background", "--to", "6", "--reason", "test"],
    );
    let (code, said) = trainer(&args);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("resumed from step 6"), "{said}");
    assert_eq!(losses(&metrics, "background")[8..], straight[6..]);

    // A run with checkpoints is never overwritten by a fresh start.
    let args = TrainerArgs::new("tiny")
        .option("--resume", "never")
        .sets(SMALL_MODEL)
        .set("train.val_every", 1000)
        .run("straight")
        .store(&format!("file://{}", dir.path().join("store").display()))
        .data(&data)
        .build();
    let (code, said) = trainer(&args);
    assert_eq!(code, 2, "{said}");
    assert!(said.contains("refusing to overwrite"), "{said}");
}

#[test]
fn bad_data_files_and_unusable_stores_get_clear_errors() {
    let dir = test_dir();
    let data = dir.path().join("data");
    let input = dir.path().join("input.txt");
    std::fs::write(
        &input,
        "to be or not to be, that is the question. ".repeat(400),
    )
    .unwrap();
    let (code, said) = trainer(&[
        "prepare",
        "--input",
        input.to_str().unwrap(),
        "--out",
        data.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{said}");
    let train_to = |data: &std::path::Path, store: &str| {
        let args = small(&dir.path().join("metrics"))
            .steps(1)
            .store(store)
            .data(data)
            .build();
        trainer(&args)
    };
    let good_store = format!("file://{}", dir.path().join("store").display());
    let train = |data: &std::path::Path| train_to(data, &good_store);
    // Stores that cannot be used: the run does not start.
    for (store, says) in [
        ("ftp://host/x", "unknown scheme \"ftp\""),
        ("file:///proc/no/such/store", "cannot use checkpoint store"),
    ] {
        let (code, said) = train_to(&data, store);
        assert_eq!(code, 2, "{store}: {said}");
        assert!(said.contains(says), "{store}: {said}");
    }
    let copy = |name: &str| {
        let target = dir.path().join(name);
        std::fs::create_dir_all(&target).unwrap();
        for entry in std::fs::read_dir(&data).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), target.join(entry.file_name())).unwrap();
        }
        target
    };

    // One flipped byte in the token file: its blake3 no longer matches the index.
    let flipped = copy("flipped");
    let mut tokens = std::fs::read(flipped.join("train.tokens")).unwrap();
    tokens[10] ^= 0x40;
    std::fs::write(flipped.join("train.tokens"), &tokens).unwrap();
    // A token file cut short (an odd number of bytes).
    let truncated = copy("truncated");
    let tokens = std::fs::read(truncated.join("train.tokens")).unwrap();
    std::fs::write(truncated.join("train.tokens"), &tokens[..tokens.len() - 1]).unwrap();
    // An index that is not JSON, and one that is missing.
    let garbled = copy("garbled");
    std::fs::write(garbled.join("index.json"), b"{\"format_version\": 1, \"tok").unwrap();
    let no_index = copy("no-index");
    std::fs::remove_file(no_index.join("index.json")).unwrap();
    // A token id the model's vocabulary does not have.
    let out_of_range = copy("out-of-range");
    let mut tokens = std::fs::read(out_of_range.join("train.tokens")).unwrap();
    tokens[0..2].copy_from_slice(&60000u16.to_le_bytes());
    std::fs::write(out_of_range.join("train.tokens"), &tokens).unwrap();
    let hash = blake3::hash(&tokens).to_hex().to_string();
    let index = std::fs::read_to_string(out_of_range.join("index.json")).unwrap();
    let mut index: serde_json::Value = serde_json::from_str(&index).unwrap();
    index["train"]["blake3"] = hash.into();
    std::fs::write(
        out_of_range.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();

    for (path, says) in [
        (&flipped, "does not match its hash"),
        (&truncated, "train.tokens"),
        (&garbled, "index.json"),
        (&no_index, "index.json"),
        (&out_of_range, "60000"),
    ] {
        let (code, said) = train(path);
        assert_eq!(code, 2, "{}: {said}", path.display());
        assert!(said.contains(says), "{}: {said}", path.display());
        assert!(!said.contains("panicked"), "{}: {said}", path.display());
    }
}

#[test]
fn sigterm_checkpoints_the_current_step_and_a_rerun_resumes() {
    let (dir, _) = prepared();
    sigterm_then_rerun(dir.path(), false);
    // With checkpoints written in the background every other step: the one in flight at
    // the signal, if any, is committed before the current step's.
    sigterm_then_rerun(dir.path(), true);
}

/// Stops a run with SIGTERM after step 3, checks that it checkpointed the step it stopped
/// at, and resumes from it.
fn sigterm_then_rerun(dir: &std::path::Path, background: bool) {
    use std::io::{BufRead, BufReader};
    let data = dir.join("data");
    let store = format!(
        "file://{}",
        dir.join(format!("store-{background}")).display()
    );
    let args = |steps: u64| {
        let every = if background { 2 } else { 1000 };
        small(&dir.join(format!("metrics-{background}")))
            .steps(steps)
            .set("checkpoint.every", every)
            .set("checkpoint.background", background)
            .set("checkpoint.busy", "wait")
            .store(&store)
            .data(&data)
            .build()
    };
    let mut child = Command::new(bin("trainer"))
        .args(args(100_000))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line.unwrap().starts_with("step      3") {
            break;
        }
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let status = child.wait().unwrap();
    let text = rest.join("\n");
    assert!(status.success(), "{status:?}: {text}");
    let stopped: u64 = text
        .split("stopped by signal at step ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no stop message in {text}"));
    assert!(stopped >= 3, "{text}");
    assert!(
        text.contains(&format!("last checkpoint: step {stopped} ")),
        "{text}"
    );
    let ctl = lazarus_tests::Ctl::new(store.clone(), &dir.join(format!("index-{background}")));
    let committed = ctl.committed("tiny");
    let expected: Vec<u64> = if background {
        // Every other step before the signal, then the step it stopped at.
        (2..stopped).step_by(2).chain([stopped]).collect()
    } else {
        vec![stopped]
    };
    assert_eq!(committed, expected, "{}", ctl.json(&["list", "tiny"]));
    let rerun = args(stopped + 2);
    let rerun: Vec<&str> = rerun.iter().map(String::as_str).collect();
    let (code, said) = trainer(&rerun);
    assert_eq!(code, 0, "{said}");
    assert!(
        said.contains(&format!("resumed from step {stopped}")),
        "{said}"
    );
}

#[test]
fn training_checkpoints_to_s3_and_resumes_from_it() {
    let (dir, _) = prepared();
    let data = dir.path().join("data");
    let metrics = dir.path().join("metrics");
    let s3 = lazarus_tests::S3Server::start();
    let store = s3.url("ckpt");
    let run = |id: &str, steps: u64| {
        let args = small(&metrics)
            .run(id)
            .steps(steps)
            .set("checkpoint.every", 2)
            .store(&store)
            .data(&data)
            .build();
        let output = Command::new(bin("trainer"))
            .args(&args)
            .envs(s3.envs())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).to_string()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{text}");
        text
    };
    run("tiny", 2);
    // Saves at steps 4, 6 and 8 in one process: the one at 8 overwrites the copy of the state
    // that the one at 4 wrote, once the save at 6 no longer needs it as its delta base.
    let said = run("tiny", 8);
    assert!(said.contains("resumed from step 2"), "{said}");
    let said = run("tiny", 10);
    assert!(said.contains("resumed from step 8"), "{said}");
    // Step 8's state is the state a run that never stopped had: the same losses after it.
    run("straight", 10);
    let after_8 = |run: &str| -> Vec<(u64, u64)> {
        losses(&metrics, run)
            .into_iter()
            .filter(|(step, _)| *step > 8)
            .collect()
    };
    assert_eq!(after_8("tiny").len(), 2);
    assert_eq!(after_8("tiny"), after_8("straight"));
    let mut ctl = lazarus_tests::Ctl::new(store, &dir.path().join("index"));
    ctl.envs = s3.envs();
    ctl.expect(0, &["verify", "tiny", "--all", "--read-data"]);
    let listed = ctl.json(&["list", "tiny"]).to_string();
    for step in [4, 6, 8, 10] {
        assert!(listed.contains(&format!("\"step\":{step}")), "{listed}");
    }
}

/// Saving in-process at every step keeps the trainer's threads bounded: tokio's default
/// would start a blocking thread for each chunk in flight, up to 512 (184 of them in this run
/// before the bound), each holding its own buffers, and the heap grew with every save.
#[test]
fn in_process_saves_keep_the_trainers_threads_bounded() {
    let (dir, _) = prepared();
    let log = dir.path().join("trainer.log");
    let args = small(&dir.path().join("metrics"))
        .steps(12)
        .set("checkpoint.every", 1)
        .store(&format!("file://{}", dir.path().join("store").display()))
        .data(&dir.path().join("data"))
        .build();
    let mut child = Command::new(bin("trainer"))
        .args(&args)
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let tasks = format!("/proc/{}/task", child.id());
    let mut most = 0;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if let Ok(entries) = std::fs::read_dir(&tasks) {
            most = most.max(entries.count());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{said}");
    assert!(said.contains("last checkpoint: step 12 "), "{said}");
    // The store's blocking threads, and the main thread, the math pool's, tokio's two
    // workers, the signal watcher and whatever the libraries start, with room to spare.
    let bound = lazarus_shared::store::blocking_threads() + 16;
    assert!(most > 1, "no thread count was read from {tasks}");
    assert!(
        most <= bound,
        "the trainer ran {most} threads at once, more than {bound}"
    );
}
