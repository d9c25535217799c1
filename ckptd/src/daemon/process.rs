//! The local rank processes as processes: signalling them for the supervisor, and reading
//! their state from `/proc` for the heartbeat (a stopped or stuck rank is named as such).

use std::sync::Arc;

use lazarus_shared::Rank;

use super::Daemon;

/// The supervisor stops the world (`KILL`) or asks it to checkpoint and exit (`TERM`): the
/// signal goes to every registered local rank.
pub async fn signal_ranks(daemon: &Arc<Daemon>, signal: &str) {
    let pids: Vec<(Rank, u32)> = daemon
        .ranks
        .lock()
        .await
        .values()
        .filter(|s| s.pid != 0)
        .map(|s| (s.rank, s.pid))
        .collect();
    for (rank, pid) in pids {
        tracing::info!(rank, pid, signal, "signalling the rank for the supervisor");
        let _ = tokio::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .await;
    }
}

/// The process state of `pid` when it is neither running (`R`) nor sleeping (`S`, `I`):
/// `T` stopped, `t` stopped by a tracer, `D` waiting on IO, `Z` a zombie. `None` also when
/// `/proc` cannot tell (the process is gone, or in another pid namespace).
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "PID (COMM) STATE ...": COMM may hold spaces and parentheses, so read past the last ')'.
    let state = stat
        .get(stat.rfind(')')? + 1..)?
        .trim_start()
        .chars()
        .next()?;
    (!matches!(state, 'R' | 'S' | 'I')).then_some(state)
}

#[cfg(test)]
#[cfg(test)]
mod tests {
    use super::process_state;

    #[test]
    fn a_stopped_process_reads_as_state_t_and_a_running_one_as_none() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep runs");
        let pid = child.id();
        let signal = |name: &str| {
            std::process::Command::new("kill")
                .args([&format!("-{name}"), &pid.to_string()])
                .status()
                .expect("kill runs")
                .success()
        };
        let settle = |want: Option<char>| {
            for _ in 0..100 {
                if process_state(pid) == want {
                    return true;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            false
        };
        assert!(settle(None), "a sleeping process: {:?}", process_state(pid));
        assert!(signal("STOP"));
        assert!(settle(Some('T')), "stopped: {:?}", process_state(pid));
        assert!(signal("CONT"));
        assert!(settle(None), "continued: {:?}", process_state(pid));
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert_eq!(process_state(pid), None, "a reaped process is gone");
    }
}
