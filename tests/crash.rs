//! Crash consistency: imports killed with SIGKILL at random moments never leave a step that is
//! listed as committed but fails verification; re-running the import succeeds; and gc then
//! removes exactly the orphans the killed imports left behind.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use lazarus_tests::deadline::test_dir;
use lazarus_tests::{files_under, random_f32_bytes, write_safetensors, Ctl};
use rand::{Rng, SeedableRng};

const TRIALS: u64 = 50;

#[test]
fn sigkilled_imports_never_leave_a_false_commit() {
    let seed: u64 = std::env::var("LAZARUS_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("crash test seed {seed} (set LAZARUS_TEST_SEED to replay)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = test_dir();
    let store = dir.path().join("store");
    let ctl = Ctl::new(
        format!("file://{}", store.display()),
        &dir.path().join("index"),
    );
    let shared = random_f32_bytes(512 * 1024, 1);
    let file = |trial: u64| {
        let path = dir.path().join(format!("step{trial}.safetensors"));
        write_safetensors(
            &path,
            &[
                ("shared", vec![512, 1024], shared.clone()),
                (
                    "fresh",
                    vec![256, 1024],
                    random_f32_bytes(256 * 1024, 100 + trial),
                ),
            ],
        );
        path
    };

    // Time one whole import to spread the kills over its length.
    let first = file(0);
    let started = Instant::now();
    ctl.expect(
        0,
        &[
            "import",
            "r",
            "--step",
            "0",
            "--chunk-bytes",
            "32768",
            first.to_str().unwrap(),
        ],
    );
    let full = started.elapsed();
    let mut killed_before_commit = 0;
    for trial in 1..=TRIALS {
        let input = file(trial);
        let step = trial.to_string();
        let mut child = ctl
            .command(&["import", "r", "--step", &step, input.to_str().unwrap()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_micros(
            rng.random_range(0..full.as_micros() as u64 * 6 / 5),
        ));
        child.kill().unwrap();
        child.wait().unwrap();
        let committed = ctl.committed("r");
        if !committed.contains(&trial) {
            killed_before_commit += 1;
        }
        // Whatever is listed as committed verifies, byte for byte.
        ctl.expect(0, &["verify", "r", "--all", "--read-data"]);
        // Re-running the import succeeds (or finds the identical step already committed).
        ctl.expect(
            0,
            &["import", "r", "--step", &step, input.to_str().unwrap()],
        );
        ctl.expect(0, &["verify", "r", &step, "--read-data"]);
    }
    println!("{killed_before_commit} of {TRIALS} imports were killed before their commit (one import takes {full:?})");
    assert!(
        killed_before_commit > 0,
        "no kill landed before a commit: the test did not exercise crashes"
    );
    assert_eq!(ctl.committed("r"), (0..=TRIALS).collect::<Vec<_>>());

    // gc with nothing to drop removes exactly the unreferenced chunks.
    let mut referenced = BTreeSet::new();
    for step in 0..=TRIALS {
        let shown = ctl.json(&["show", "r", &step.to_string()]);
        for manifest in shown["manifests"].as_array().unwrap() {
            for item in manifest["tensors"]
                .as_array()
                .unwrap()
                .iter()
                .chain(manifest["blobs"].as_array().unwrap())
            {
                for chunk in item["chunks"].as_array().unwrap() {
                    referenced.insert(chunk["hash"].as_str().unwrap().to_string());
                    for base in chunk["bases"].as_array().into_iter().flatten() {
                        referenced.insert(base.as_str().unwrap().to_string());
                    }
                }
            }
        }
    }
    let chunk_files = || -> BTreeSet<String> {
        files_under(&store.join("runs/r/chunks"))
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().to_string())
            .collect()
    };
    let before = chunk_files();
    assert!(
        referenced.is_subset(&before),
        "a referenced chunk is missing before gc"
    );
    ctl.expect(
        0,
        &[
            "gc",
            "r",
            "--keep-last",
            "1000",
            "--grace",
            "0s",
            "--staging-grace",
            "0s",
        ],
    );
    let after = chunk_files();
    println!(
        "gc removed {} orphaned chunk(s), kept {}",
        before.len() - after.len(),
        after.len()
    );
    assert_eq!(
        after, referenced,
        "gc must remove exactly the chunks no step references"
    );
    ctl.expect(0, &["verify", "r", "--all", "--read-data"]);
}
