//! Crash points, for tests that kill a daemon at a chosen moment of its work.
//!
//! `LAZARUS_CKPTD_CRASH_AT=<point>[:<n>]` makes the daemon SIGKILL itself the `n`-th time
//! (default the first) it reaches `point`: no destructor runs, nothing is flushed, exactly
//! as when an operator or the OOM killer kills it. Unset, a crash point costs one atomic
//! load. The points are named after the work they interrupt:
//!
//! | point | where |
//! | --- | --- |
//! | `poll` | a rank's per-step poll was read, its answer not yet sent |
//! | `snapshot` | a snapshot was taken over (its slot held), the rank not yet answered |
//! | `replicate` | the first chunk of a snapshot went to the buddy, the rest did not |
//! | `replica-in` | the first chunk of a buddy's replica was written aside, the rest not |
//! | `commit` | a memory commit made a snapshot T0 and `state.json` says so |
//! | `upload` | a durable upload has stored some chunks, not yet its manifest |
//! | `base` | an upload is copying its hashed chunks over the delta-base file, which `state.json` no longer names |

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The variable that arms a crash point.
pub const CRASH_AT_ENV: &str = "LAZARUS_CKPTD_CRASH_AT";

struct Armed {
    point: String,
    nth: u64,
    reached: AtomicU64,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let value = std::env::var(CRASH_AT_ENV).ok()?;
            let (point, nth) = match value.split_once(':') {
                Some((point, nth)) => (point.to_string(), nth.parse().ok()?),
                None => (value, 1),
            };
            Some(Armed {
                point,
                nth,
                reached: AtomicU64::new(0),
            })
        })
        .as_ref()
}

/// Kills this process if `point` is armed and reached for the armed time.
pub fn point(point: &str) {
    let Some(armed) = armed().filter(|a| a.point == point) else {
        return;
    };
    if armed.reached.fetch_add(1, Ordering::SeqCst) + 1 == armed.nth {
        tracing::warn!(point, "crash point reached: killing this daemon");
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
}
