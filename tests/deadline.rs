//! The harness's own promise: a test that hangs fails at its deadline, with its processes'
//! logs, and leaves none of them running.

use std::process::Command;
use std::time::{Duration, Instant};

use lazarus_tests::deadline::{logs_under, processes_naming, test_dir_within};

#[test]
fn a_hung_process_is_killed_at_the_deadline_and_fails_the_test_with_its_log() {
    let dir = test_dir_within(Duration::from_secs(2));
    let path = dir.path().to_path_buf();
    std::fs::write(path.join("hung.log"), "the last words of a hung process\n").unwrap();
    // A process that would never end, naming the test's directory as every test's do.
    let mut child = Command::new("bash")
        .args(["-c", &format!("sleep 600; : {}", path.display())])
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = child.wait().unwrap();
    let waited = started.elapsed();
    assert!(!status.success(), "killed, not ended: {status}");
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(10),
        "killed after {waited:?}"
    );
    assert!(!processes_naming(&path), "nothing of the test runs on");
    assert!(logs_under(&path).contains("the last words of a hung process"));
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(dir)));
    let message = failed.expect_err("a test past its deadline fails");
    let message = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(message.contains("deadline of 2 s"), "{message}");
    assert!(!path.exists(), "its directory is removed");
}
