//! The local Slurm cluster's nodes from tests: a node's slurmd killed and started again, its
//! state, and returning it to service.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::cluster::text_of;
use crate::supervision::kill;

/// `program` (slurmd, scontrol, sinfo) against the cluster whose configuration is `conf`.
pub fn command(conf: &Path, program: &str) -> Command {
    let mut command = Command::new(program);
    command.env("SLURM_CONF", conf);
    command
}

/// SIGKILLs `node`'s slurmd (named by its pid file next to `conf`); whether it was delivered.
pub fn kill_slurmd(conf: &Path, node: &str) -> bool {
    let pid_file = conf
        .parent()
        .expect("slurm.conf lies in the cluster's folder")
        .join(format!("run/slurmd-{node}.pid"));
    std::fs::read_to_string(pid_file).is_ok_and(|pid| kill("KILL", pid.trim()))
}

/// Starts `node`'s slurmd again; whether it started.
pub fn start_slurmd(conf: &Path, node: &str) -> bool {
    command(conf, "slurmd")
        .args(["-N", node])
        .status()
        .is_ok_and(|s| s.success())
}

/// `node`'s state as `sinfo` abbreviates it (idle, mix, alloc, drain, drng, down, ...; a `*`
/// after it when its slurmd does not answer), or "" when sinfo failed.
pub fn state(conf: &Path, node: &str) -> String {
    command(conf, "sinfo")
        .args(["-h", "-N", "-n", node, "-o", "%t"])
        .output()
        .map(|o| text_of(&o).trim().to_string())
        .unwrap_or_default()
}

/// Whether `node` takes jobs: idle, mixed or allocated, and answering.
pub fn in_service(conf: &Path, node: &str) -> bool {
    let state = state(conf, node);
    ["idle", "mix", "alloc"].contains(&state.as_str())
}

/// Returns `node` to service (what an operator does once it is repaired); whether Slurm took
/// the order.
pub fn resume(conf: &Path, node: &str) -> bool {
    command(conf, "scontrol")
        .args(["update", &format!("nodename={node}"), "state=resume"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Starts `node`'s slurmd and resumes it until it takes jobs, for up to 60 s; whether it does.
pub fn bring_back(conf: &Path, node: &str) -> bool {
    start_slurmd(conf, node);
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        resume(conf, node);
        if in_service(conf, node) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    false
}

/// A node of the local Slurm cluster whose slurmd was killed; it is started again and
/// returned to service when this drops.
#[derive(Debug)]
pub struct SlurmdDown {
    conf: PathBuf,
    node: String,
}

impl SlurmdDown {
    pub fn kill(conf: &Path, node: &str) -> Self {
        assert!(kill_slurmd(conf, node), "{node}'s slurmd was running");
        Self {
            conf: conf.to_path_buf(),
            node: node.to_string(),
        }
    }
}

impl Drop for SlurmdDown {
    fn drop(&mut self) {
        bring_back(&self.conf, &self.node);
    }
}
