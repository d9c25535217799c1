//! Every test that starts processes runs against a deadline: a hang must fail that test with
//! its processes' logs, not hold the whole suite until CI's limit.
//!
//! A [`TestDir`] is a test's private directory and its deadline. The processes a test starts
//! name that directory on their command lines (daemons, launchers, ranks, `ckptctl`), so
//! when the deadline passes a watchdog prints the logs found there and kills every process
//! that names it, again each second until the test ends. The test's own waits then return,
//! its assertions fail with what the processes said, and dropping the `TestDir` afterwards
//! fails the test in any case.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The deadline of a test that does not choose one: several times the longest test's time
/// on a loaded 2-core CI machine, and short enough that one hang leaves the suite inside
/// CI's limit.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(600);

/// A test's directory (removed when dropped) and its deadline.
#[derive(Debug)]
pub struct TestDir {
    dir: tempfile::TempDir,
    limit: Duration,
    ended: Arc<(Mutex<bool>, Condvar)>,
    fired: Arc<AtomicBool>,
    watchdog: Option<JoinHandle<()>>,
}

/// A fresh test directory with the default deadline.
pub fn test_dir() -> TestDir {
    test_dir_within(DEFAULT_DEADLINE)
}

/// A fresh test directory whose processes are killed `limit` after now.
pub fn test_dir_within(limit: Duration) -> TestDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let ended = Arc::new((Mutex::new(false), Condvar::new()));
    let fired = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (ended, fired, path) = (ended.clone(), fired.clone(), dir.path().to_path_buf());
        std::thread::spawn(move || watch(&path, limit, &ended, &fired))
    };
    TestDir {
        dir,
        limit,
        ended,
        fired,
        watchdog: Some(watchdog),
    }
}

impl TestDir {
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        *self.ended.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.ended.1.notify_all();
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
        if self.fired.load(Ordering::SeqCst) && !std::thread::panicking() {
            panic!(
                "the test passed its deadline of {} s; its processes were killed (their logs are above)",
                self.limit.as_secs()
            );
        }
    }
}

fn watch(dir: &Path, limit: Duration, ended: &(Mutex<bool>, Condvar), fired: &AtomicBool) {
    let deadline = Instant::now() + limit;
    let mut done = ended.0.lock().unwrap_or_else(|e| e.into_inner());
    while !*done {
        let now = Instant::now();
        if now < deadline {
            done = ended
                .1
                .wait_timeout(done, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            continue;
        }
        if !fired.swap(true, Ordering::SeqCst) {
            eprintln!(
                "deadline: {} s passed for the test in {}; killing its processes\n{}",
                limit.as_secs(),
                dir.display(),
                logs_under(dir)
            );
        }
        kill_processes_naming(dir);
        done = ended
            .1
            .wait_timeout(done, Duration::from_secs(1))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// The last lines of every `*.log`, `*.out` and `*.err` file under `dir` (two levels).
pub fn logs_under(dir: &Path) -> String {
    let mut files: Vec<PathBuf> = Vec::new();
    let mut pending = vec![(dir.to_path_buf(), 0)];
    while let Some((folder, depth)) = pending.pop() {
        for entry in std::fs::read_dir(&folder).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() && depth < 2 {
                pending.push((path, depth + 1));
            } else if path
                .extension()
                .is_some_and(|e| e == "log" || e == "out" || e == "err")
            {
                files.push(path);
            }
        }
    }
    files.sort();
    files
        .iter()
        .map(|path| {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(80)..].join("\n");
            format!("--- {} (last 80 lines) ---\n{tail}", path.display())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// SIGKILLs every process whose command line contains `dir`.
pub fn kill_processes_naming(dir: &Path) {
    let _ = Command::new("pkill")
        .args(["-KILL", "-f", &pattern_of(dir)])
        .status();
}

/// Whether any process's command line contains `dir`.
pub fn processes_naming(dir: &Path) -> bool {
    Command::new("pgrep")
        .args(["-f", &pattern_of(dir)])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `dir` as a regular expression that matches only itself.
fn pattern_of(dir: &Path) -> String {
    dir.display()
        .to_string()
        .chars()
        .flat_map(|c| {
            let special = "\\.^$|?*+()[]{}".contains(c);
            special
                .then_some('\\')
                .into_iter()
                .chain(std::iter::once(c))
        })
        .collect()
}
