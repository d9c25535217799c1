//! Several `ckptd`s on 127.0.0.1 standing for several nodes, and the trainer ranks that use
//! them under a real `mpiexec`. Node i replicates to node i+1 (a ring); node 0 leads.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{bin, free_port};

/// One daemon: its process (while running), ports and paths.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    /// The address it listens on (127.0.0.1, or its own loopback address behind a relay).
    pub host: std::net::IpAddr,
    pub listen: u16,
    /// Where the other daemons reach it (its listen address, or its relay).
    pub advertise: String,
    pub metrics: u16,
    pub socket: PathBuf,
    pub shm: PathBuf,
    child: Option<Child>,
    args: Vec<String>,
    log: PathBuf,
}

/// A set of daemons for one run. Every daemon is killed when this is dropped.
#[derive(Debug)]
pub struct Cluster {
    pub dir: PathBuf,
    pub run: String,
    pub store: String,
    pub key_file: PathBuf,
    pub nodes: Vec<Node>,
    envs: Vec<(String, String)>,
    shm_root: PathBuf,
    /// The relays between the daemons, when the test cuts the network.
    pub relays: Option<crate::relay::Relays>,
}

/// Daemon settings a test may change.
#[derive(Clone, Debug)]
pub struct Settings {
    pub durable_every_steps: u64,
    pub commit_timeout_seconds: f64,
    pub extra: Vec<String>,
    /// Flags for the leader (node 1) only, e.g. `--supervise mpiexec`.
    pub leader_extra: Vec<String>,
    /// Nodes after the first that may take over leadership: they get
    /// `--leader-candidate` and the leader's flags too.
    pub candidates: usize,
    /// Daemons talk through fault-injecting relays (`crate::relay`).
    pub relayed: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            durable_every_steps: 5,
            commit_timeout_seconds: 3.0,
            extra: Vec::new(),
            leader_extra: Vec::new(),
            candidates: 0,
            relayed: false,
        }
    }
}

impl Cluster {
    /// Starts `nodes` daemons for `run` over `store`, with `envs` (e.g. S3 credentials).
    pub fn start(
        dir: &Path,
        run: &str,
        store: &str,
        nodes: usize,
        settings: &Settings,
        envs: Vec<(String, String)>,
    ) -> Self {
        let key_file = dir.join("job.key");
        std::fs::write(&key_file, format!("{:064x}", rand::random::<u128>()))
            .expect("writing the job key");
        // Slots belong in shared memory, as on a real node; a temp dir where there is none.
        let shm_base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let shm_root = shm_base.join(format!(
            "lazarus-test-{}-{}",
            std::process::id(),
            free_port()
        ));
        let listens: Vec<u16> = (0..nodes).map(|_| free_port()).collect();
        let hosts: Vec<std::net::IpAddr> = (0..nodes)
            .map(|i| {
                if settings.relayed {
                    crate::relay::node_ip(i)
                } else {
                    std::net::IpAddr::from([127, 0, 0, 1])
                }
            })
            .collect();
        let relays = settings.relayed.then(|| {
            let targets: Vec<std::net::SocketAddr> = (0..nodes)
                .map(|i| std::net::SocketAddr::new(hosts[i], listens[i]))
                .collect();
            crate::relay::Relays::start(&targets)
        });
        let advertised: Vec<String> = (0..nodes)
            .map(|i| match &relays {
                Some(relays) => relays.addresses[i].to_string(),
                None => format!("127.0.0.1:{}", listens[i]),
            })
            .collect();
        let mut cluster = Self {
            dir: dir.to_path_buf(),
            run: run.to_string(),
            store: store.to_string(),
            key_file: key_file.clone(),
            nodes: Vec::new(),
            envs,
            shm_root: shm_root.clone(),
            relays,
        };
        for (i, listen) in listens.iter().enumerate() {
            let name = format!("n{}", i + 1);
            let metrics = free_port();
            let socket = dir.join(format!("{name}.sock"));
            let shm = shm_root.join(&name);
            let mut args: Vec<String> = vec![
                "--node".into(),
                name.clone(),
                "--run".into(),
                run.into(),
                "--store".into(),
                store.into(),
                "--shm-dir".into(),
                shm.display().to_string(),
                "--socket".into(),
                socket.display().to_string(),
                "--listen".into(),
                format!("{}:{listen}", hosts[i]),
                "--advertise".into(),
                advertised[i].clone(),
                "--leader".into(),
                advertised[0].clone(),
                "--key-file".into(),
                key_file.display().to_string(),
                "--metrics".into(),
                format!("127.0.0.1:{metrics}"),
                "--durable-every-steps".into(),
                settings.durable_every_steps.to_string(),
                "--commit-timeout-seconds".into(),
                settings.commit_timeout_seconds.to_string(),
            ];
            if nodes > 1 {
                args.push("--buddy".into());
                args.push(advertised[(i + 1) % nodes].clone());
            }
            if i == 0 {
                args.push("--lead".into());
                args.extend(settings.leader_extra.iter().cloned());
            } else if i <= settings.candidates {
                args.push("--leader-candidate".into());
                args.extend(settings.leader_extra.iter().cloned());
            }
            args.extend(settings.extra.iter().cloned());
            cluster.nodes.push(Node {
                log: dir.join(format!("{name}.log")),
                name,
                host: hosts[i],
                listen: *listen,
                advertise: advertised[i].clone(),
                metrics,
                socket,
                shm,
                child: None,
                args,
            });
        }
        for i in 0..nodes {
            cluster.start_node(i);
        }
        cluster
    }

    /// Starts (or restarts) node `i` and waits until its socket and port answer.
    pub fn start_node(&mut self, i: usize) {
        self.start_node_with(i, &[]);
    }

    /// Starts (or restarts) node `i` with `envs` added to its environment (say, a crash
    /// point), and waits until its socket and port answer.
    pub fn start_node_with(&mut self, i: usize, envs: &[(&str, String)]) {
        let node = &mut self.nodes[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)
            .expect("daemon log file");
        let mut command = Command::new(bin("ckptd"));
        command
            .args(&node.args)
            .env("LAZARUS_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log);
        for (k, v) in &self.envs {
            command.env(k, v);
        }
        for (k, v) in envs {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("ckptd starts");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "ckptd {} exited {status}:\n{}",
                    node.name,
                    std::fs::read_to_string(&node.log).unwrap_or_default()
                );
            }
            let up = std::os::unix::net::UnixStream::connect(&node.socket).is_ok()
                && std::net::TcpStream::connect((node.host, node.listen)).is_ok();
            if up {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "ckptd {} did not come up",
                node.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        node.child = Some(child);
    }

    /// SIGKILL node `i`'s daemon.
    pub fn kill_node(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills node `i`'s daemon and wipes its shared memory: the node's T0 and the replicas it
    /// held for its neighbour are gone.
    pub fn wipe_node(&mut self, i: usize) {
        self.kill_node(i);
        let _ = std::fs::remove_dir_all(&self.nodes[i].shm);
    }

    /// Whether node `i`'s daemon was running and has exited (say, at a crash point).
    pub fn node_exited(&mut self, i: usize) -> bool {
        let exited = self.nodes[i]
            .child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(Some(_))));
        if exited {
            self.nodes[i].child = None;
        }
        exited
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].child.as_ref().map(Child::id)
    }

    pub fn leader(&self) -> String {
        self.nodes[0].advertise.clone()
    }

    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.nodes[i].log).unwrap_or_default()
    }

    /// The text of node `i`'s /metrics.
    pub fn metrics(&self, i: usize) -> String {
        self.try_metrics(i)
            .unwrap_or_else(|error| panic!("node {i}'s metrics endpoint: {error}"))
    }

    /// [`Self::metrics`], or why it did not answer within 5 s (a stopped daemon does not).
    pub fn try_metrics(&self, i: usize) -> std::io::Result<String> {
        let limit = Some(Duration::from_secs(5));
        let address = std::net::SocketAddr::from(([127, 0, 0, 1], self.nodes[i].metrics));
        let mut stream = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(5))?;
        stream.set_read_timeout(limit)?;
        stream.set_write_timeout(limit)?;
        stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut text = String::new();
        stream.read_to_string(&mut text)?;
        Ok(text)
    }

    /// One sample of node `i`'s metrics, by its full name with labels (0 if absent).
    pub fn metric(&self, i: usize, name: &str) -> f64 {
        sample(&self.metrics(i), name)
    }

    /// [`Self::metric`], or None when node `i`'s endpoint does not answer.
    pub fn try_metric(&self, i: usize, name: &str) -> Option<f64> {
        self.try_metrics(i).ok().map(|text| sample(&text, name))
    }

    /// `mpiexec` with one rank per node, each pointed at its node's daemon.
    pub fn mpiexec(&self, trainer_args: &[String]) -> Command {
        let all: Vec<usize> = (0..self.nodes.len()).collect();
        self.mpiexec_on(&all, trainer_args)
    }

    /// `mpiexec` with one rank on each of `nodes` (indices), in that order.
    pub fn mpiexec_on(&self, nodes: &[usize], trainer_args: &[String]) -> Command {
        let mut command = Command::new("mpiexec");
        for (k, i) in nodes.iter().enumerate() {
            if k > 0 {
                command.arg(":");
            }
            command
                .args(["-n", "1", "-env", "LAZARUS_CKPTD_SOCKET"])
                .arg(&self.nodes[*i].socket)
                .arg(bin("trainer"))
                .args(trainer_args);
        }
        for (k, v) in &self.envs {
            command.env(k, v);
        }
        command
    }

    /// Runs the ranks to completion; panics with their output if they fail.
    pub fn train(&self, trainer_args: &[String]) -> String {
        let output = self.mpiexec(trainer_args).output().expect("mpiexec runs");
        let text = text_of(&output);
        assert!(
            output.status.success(),
            "training failed: {text}\n{}",
            self.logs()
        );
        text
    }

    pub fn logs(&self) -> String {
        (0..self.nodes.len())
            .map(|i| format!("--- {} ---\n{}", self.nodes[i].name, self.log(i)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

pub fn text_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr)
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill_node(i);
        }
        // Launchers and ranks of a test that ended early (their command lines name the
        // test's directory) would otherwise train on, and wait for their daemons.
        crate::deadline::kill_processes_naming(&self.dir);
        // The shared memory goes once they are gone (a rank still mapping its slots would
        // keep the pages); a test run must not leave hundreds of MB behind in /dev/shm.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let alive = crate::deadline::processes_naming(&self.dir);
            let removed = match std::fs::remove_dir_all(&self.shm_root) {
                Ok(()) => true,
                Err(error) => error.kind() == std::io::ErrorKind::NotFound,
            };
            if (removed && !alive) || Instant::now() > deadline {
                if !removed {
                    eprintln!("could not remove {}", self.shm_root.display());
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// One sample of a metrics text, by its full name with labels (0 if absent).
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|line| {
            line.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|value| value.trim().parse().ok())
        })
        .unwrap_or(0.0)
}
