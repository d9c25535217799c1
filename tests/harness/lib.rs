//! Shared pieces of the end-to-end tests and benchmarks: finding the built binaries, running
//! `ckptctl`, a real S3 server (`s3s-fs`) on 127.0.0.1, and test data.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub mod cluster;
pub mod deadline;
pub mod relay;
pub mod runbook;
pub mod scale;
pub mod slurm;
pub mod stats;
pub mod store_scale;
pub mod supervision;
pub mod toy;
pub mod train;

use lazarus_shared::format::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A binary of this workspace, built by `cargo build --workspace --bins` in the same profile
/// as the running test.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let path = profile_dir.join(name);
    assert!(path.exists(), "{} is missing: build the binaries first (ops/test.sh does: cargo build --release --workspace --bins)", path.display());
    path
}

/// `../shared/data/<name>` beside the repository.
/// The Python for the interop checks: LAZARUS_PYTHON, else the environment that
/// `ops/setup.sh interop` makes, else `python3`.
pub fn python() -> String {
    if let Ok(python) = std::env::var("LAZARUS_PYTHON") {
        return python;
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-interop/bin/python");
    if venv.exists() {
        return venv.display().to_string();
    }
    "python3".into()
}

pub fn shared_data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data")
        .join(name)
}

/// Runs `ckptctl` against one store with a private local index.
#[derive(Debug)]
pub struct Ctl {
    pub store: String,
    pub index: PathBuf,
    pub envs: Vec<(String, String)>,
}

impl Ctl {
    pub fn new(store: impl Into<String>, index: &Path) -> Self {
        Self {
            store: store.into(),
            index: index.to_path_buf(),
            envs: Vec::new(),
        }
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(bin("ckptctl"));
        command
            .arg("--store")
            .arg(&self.store)
            .arg("--index")
            .arg(&self.index)
            .args(args);
        command
            .env_remove("LAZARUS_STORE")
            .env("LAZARUS_LOG", "warn");
        for (key, value) in &self.envs {
            command.env(key, value);
        }
        command
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("ckptctl runs")
    }

    /// [`Self::run`], or None when it did not end within `limit` (it is killed then): for
    /// callers that must not wait on a hung store or a stopped leader.
    pub fn run_within(&self, args: &[&str], limit: Duration) -> Option<Output> {
        let child = self
            .command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("ckptctl runs");
        let pid = child.id();
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = sender.send(child.wait_with_output());
        });
        match receiver.recv_timeout(limit) {
            Ok(output) => output.ok(),
            Err(_) => {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
                None
            }
        }
    }

    /// Runs and asserts the exit code; returns stdout.
    pub fn expect(&self, code: i32, args: &[&str]) -> String {
        let output = self.run(args);
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        assert_eq!(
            output.status.code(),
            Some(code),
            "ckptctl {args:?} exited {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            output.status.code()
        );
        stdout + &stderr
    }

    /// The committed steps of `run`, oldest first.
    pub fn committed(&self, run: &str) -> Vec<u64> {
        self.json(&["list", run])["steps"]
            .as_array()
            .expect("list --json has steps")
            .iter()
            .filter(|s| s["state"] == "committed")
            .filter_map(|s| s["step"]["step"].as_u64())
            .collect()
    }

    /// Waits (up to 60 s) until the store's latest durable step of `run` is `step`.
    pub fn wait_for_latest(&self, run: &str, step: u64) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let listed = self.json(&["list", run]);
            if listed["latest"]["step"].as_u64() == Some(step) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "step {step} never became durable: {listed}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let output = self.run(&all);
        assert!(
            output.status.success(),
            "ckptctl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice(&output.stdout).expect("ckptctl --json prints JSON")
    }
}

/// Ports the tests' servers listen on come from below Linux's ephemeral range (32768 and up),
/// where every outgoing connection takes its local port: a port picked there by binding port
/// 0 could be taken by some client before the server bound it (CI saw a daemon refused its
/// metrics port). One counter serves every test of this process, so two never pick the same
/// port; the start varies with the process id so consecutive runs do not meet TIME_WAITs.
const TEST_PORTS: std::ops::Range<u32> = 15_000..32_000;

static NEXT_TEST_PORT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The first of `count` consecutive free ports on 127.0.0.1.
pub fn free_port_run(count: u16) -> u16 {
    let span = TEST_PORTS.end - TEST_PORTS.start;
    let offset = std::process::id() * 97 % span;
    for _ in 0..span / u32::from(count.max(1)) {
        let taken =
            NEXT_TEST_PORT.fetch_add(u32::from(count), std::sync::atomic::Ordering::Relaxed);
        let first = TEST_PORTS.start + (offset + taken) % span;
        if first + u32::from(count) > TEST_PORTS.end {
            continue;
        }
        let first = first as u16;
        let all_free =
            (first..first + count).all(|port| TcpListener::bind(("127.0.0.1", port)).is_ok());
        if all_free {
            return first;
        }
    }
    panic!("no {count} consecutive free ports on 127.0.0.1 in {TEST_PORTS:?}");
}

/// A free port on 127.0.0.1 that no other test of this process was given.
pub fn free_port() -> u16 {
    free_port_run(1)
}

pub const S3_ACCESS_KEY: &str = "lazarus-test";
pub const S3_SECRET_KEY: &str = "lazarus-test-secret";
pub const S3_BUCKET: &str = "ckpt";

/// A real S3 server (`s3s-fs`) on 127.0.0.1 and a free port, serving a temporary directory
/// with one bucket. Killed when dropped.
#[derive(Debug)]
pub struct S3Server {
    child: Child,
    pub port: u16,
    pub root: tempfile::TempDir,
}

impl S3Server {
    pub fn start() -> Self {
        let root = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(root.path().join(S3_BUCKET)).expect("bucket directory");
        for _attempt in 0..5 {
            let port = free_port();
            if let Some(child) = Self::spawn(port, root.path()) {
                return Self { child, port, root };
            }
        }
        panic!("s3s-fs did not start on 127.0.0.1");
    }

    fn spawn(port: u16, root: &Path) -> Option<Child> {
        let mut child = Command::new("s3s-fs")
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--access-key",
                S3_ACCESS_KEY,
                "--secret-key",
                S3_SECRET_KEY,
            ])
            .arg(root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("s3s-fs is installed (ops/setup.sh test installs it)");
        if wait_ready(&mut child, port) {
            return Some(child);
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// An outage: the server is killed; its data stays.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Back after an outage, on the same port with the same data.
    pub fn restart(&mut self) {
        for _attempt in 0..50 {
            if let Some(child) = Self::spawn(self.port, self.root.path()) {
                self.child = child;
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("s3s-fs did not come back on port {}", self.port);
    }

    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{S3_BUCKET}/{prefix}")
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The environment a client needs to reach this server.
    pub fn envs(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID".into(), S3_ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY".into(), S3_SECRET_KEY.into()),
            ("AWS_ENDPOINT".into(), self.endpoint()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
        ]
    }
}

/// Waits until `child` accepts connections on `port`; false if it exits or takes too long.
fn wait_ready(child: &mut Child, port: u16) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deterministic pseudo-random f32 values in [-0.5, 0.5), as little-endian bytes.
pub fn random_f32_bytes(count: usize, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..count)
        .flat_map(|_| rng.random_range(-0.5f32..0.5).to_le_bytes())
        .collect()
}

/// Deterministic pseudo-random f32 values as trained weights hold them, as little-endian
/// bytes: normal with mean 0 and standard deviation `std`, drawn in f64 and rounded to f32,
/// so that every mantissa bit carries information. [`random_f32_bytes`]' values lie on a
/// grid of 2^-23, whose small values end in zero bits: their low mantissa bytes carry 5.7
/// bits of entropy each, where these carry 8.0, and compress where trained weights' do not.
pub fn random_weight_bytes(count: usize, seed: u64, std: f64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let normal = rand_distr::Normal::new(0.0, std).expect("a finite standard deviation");
    (0..count)
        .flat_map(|_| (rng.sample(normal) as f32).to_le_bytes())
        .collect()
}

/// Writes a `.safetensors` file of f32 tensors.
pub fn write_safetensors(path: &Path, tensors: &[(&str, Vec<u64>, Vec<u8>)]) {
    let tensors: Vec<(String, DType, Vec<u64>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape, data)| (name.to_string(), DType::F32, shape.clone(), data.clone()))
        .collect();
    let bytes = lazarus_shared::safetensors_io::serialize(&tensors).expect("valid tensors");
    std::fs::write(path, bytes).expect("write safetensors");
}

/// Every file under `root`, recursively.
pub fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Says why a test cannot run here, and lets it pass: on a developer's machine without root
/// or without a tool. Under `CI=true` it fails the test instead, since CI installs and runs
/// everything the suite needs (`ops/setup.sh test`), and a skip there would hide a gap.
pub fn skip(why: &str) {
    if std::env::var("CI").is_ok_and(|value| value == "true") {
        panic!("cannot run here: {why} (under CI=true every test must run)");
    }
    println!("skipped: {why}");
}

/// The local Slurm cluster (`ops/slurm/local-cluster.sh`), brought up once per test process
/// in a private directory and taken down by a watchdog when the process exits. Returns the
/// `SLURM_CONF` to use, or why it cannot run here (not root, Slurm not installed).
pub fn slurm_cluster() -> Result<PathBuf, String> {
    static CLUSTER: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    CLUSTER
        .get_or_init(|| {
            // SAFETY-free check for root: the effective uid from `id -u`.
            let uid = Command::new("id").arg("-u").output().map_err(|e| e.to_string())?;
            if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
                return Err("the local Slurm cluster needs root (slurmd)".into());
            }
            if Command::new("slurmctld").arg("-V").output().is_err() {
                return Err("Slurm is not installed (ops/setup.sh test installs it)".into());
            }
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/slurm/local-cluster.sh");
            let dir = std::env::temp_dir().join(format!("lazarus-slurm-{}", std::process::id()));
            let port = free_port().to_string();
            let node_port = free_port_run(4).to_string();
            let output = Command::new(&script)
                .arg("up")
                .env("LAZARUS_SLURM_DIR", &dir)
                .env("LAZARUS_SLURM_PORT", &port)
                .env("LAZARUS_SLURM_NODE_PORT", &node_port)
                .output()
                .map_err(|e| e.to_string())?;
            if !output.status.success() {
                return Err(format!(
                    "local-cluster.sh up failed: {}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ));
            }
            // Down when this test process is gone, however it ends.
            let watchdog = format!(
                "while kill -0 {} 2>/dev/null; do sleep 1; done; LAZARUS_SLURM_DIR={} {} down >/dev/null 2>&1; rm -rf {}",
                std::process::id(),
                dir.display(),
                script.display(),
                dir.display()
            );
            Command::new("setsid")
                .args(["bash", "-c", &watchdog])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| e.to_string())?;
            Ok(dir.join("slurm.conf"))
        })
        .clone()
}

/// Held by a test that takes the local Slurm cluster's nodes down or allocates them whole,
/// so two such tests do not run at once.
pub fn slurm_exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The local Slurm cluster held exclusively by this test, or `None` (after saying why) where
/// it cannot run.
pub fn exclusive_slurm_cluster() -> Option<(PathBuf, std::sync::MutexGuard<'static, ()>)> {
    match slurm_cluster() {
        Ok(conf) => Some((conf, slurm_exclusive())),
        Err(why) => {
            skip(&why);
            None
        }
    }
}
