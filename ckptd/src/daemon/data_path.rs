//! The data path's runtime (hashing and replicating snapshots, receiving replicas, uploads)
//! and how its threads share the node's cores with the ranks ([`DataCpu`]).
//!
//! Under `DataCpu::Idle` the threads start under `SCHED_IDLE`, and a valve keeps that from
//! starving them. While the data path has work in hand, a thread of its own (`ckptd-valve`,
//! under the daemon's `SCHED_BATCH`) adds up how long the data path's threads have waited,
//! runnable, for a CPU (the kernel's run-queue delay per thread); once that passes
//! [`IDLE_GRACE`], it raises every thread of the runtime to `SCHED_BATCH` (the ranks' equal)
//! until the data path has nothing in hand, then lowers them again. On a node with idle cores
//! the data path's threads do not wait and it stays below the ranks; on one whose ranks keep
//! every core busy it takes its share after the grace, instead of leaving the node to restore
//! from a step long gone. (With the raise ended as soon as the oldest work was within the
//! grace, every snapshot waited the grace again, and a rank lost at step 9 of a run on busy
//! cores restored step 1.)
//!
//! The kernel lets a thread leave `SCHED_IDLE` only with `CAP_SYS_NICE` (in the initial user
//! namespace) or an `RLIMIT_NICE` that allows its nice value (20 at nice 0); a daemon with
//! neither runs the data path under `SCHED_BATCH` from the start, as `DataCpu::Shared`, and
//! says so. Nothing on the control path takes a lock a data-path thread may hold: work is
//! counted in and out with an atomic, and the valve only tries the threads' lock.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::runtime::{Handle, Runtime};

use super::DataCpu;

/// How long, in all, the data path's threads may wait for a CPU in one spell of work before
/// the valve raises them.
pub const IDLE_GRACE: Duration = Duration::from_millis(100);
/// How often the valve looks while work is in hand.
const TICK: Duration = Duration::from_millis(20);
/// How long the valve sleeps with nothing in hand, unless work comes.
const IDLE_LOOK: Duration = Duration::from_secs(1);

/// The data path's runtime, as the daemon's tasks hand it work.
#[derive(Clone, Debug)]
pub struct DataPath {
    handle: Handle,
    /// Under `DataCpu::Idle`: what raises the threads when they wait too long.
    valve: Option<Arc<Valve>>,
}

impl DataPath {
    /// The data path's runtime: 2 workers, and up to 8 blocking threads for hashing, encoding
    /// and file IO (a few keep 2 cores busy, and fewer threads keep fewer malloc arenas
    /// holding freed chunk buffers), lowered as `cpu` says. Under `DataCpu::Idle` the valve
    /// starts with [`DataPath::open_valve`].
    pub fn start(cpu: DataCpu) -> std::io::Result<(Runtime, DataPath)> {
        let valve = match cpu {
            DataCpu::Idle if can_leave_idle() => Some(Arc::new(Valve::default())),
            DataCpu::Idle => {
                tracing::warn!(
                    "data_cpu = \"idle\" needs CAP_SYS_NICE (or an RLIMIT_NICE that allows nice 0) to raise the data path when the ranks leave it no idle time; running it as \"shared\""
                );
                None
            }
            DataCpu::Shared => None,
        };
        let (starting, stopping) = (valve.clone(), valve.clone());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(8)
            .thread_name("ckptd-data")
            .on_thread_start(move || {
                if let Some(valve) = &starting {
                    valve.joined();
                }
            })
            .on_thread_stop(move || {
                if let Some(valve) = &stopping {
                    valve.left();
                }
            })
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        Ok((runtime, DataPath { handle, valve }))
    }

    /// Work runs on `handle` as it is, under the policy its threads already have (the tests'
    /// daemons).
    #[cfg(test)]
    pub fn on(handle: Handle) -> Self {
        Self {
            handle,
            valve: None,
        }
    }

    /// Runs `work` on the data path's runtime and waits for it. A panic is the caller's, as
    /// if `work` had run in its task.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> T {
        match self.spawn(work).await {
            Ok(value) => value,
            // Cancelled: the data runtime shut down as the daemon exits, and the caller goes
            // with it.
            Err(error) => std::panic::resume_unwind(
                error
                    .try_into_panic()
                    .unwrap_or_else(|error| Box::new(error.to_string())),
            ),
        }
    }

    /// Starts `work` on the data path's runtime, not waiting for it.
    pub fn spawn<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        // In hand from now until it is done (or dropped at exit).
        let in_hand = self.valve.as_ref().map(Valve::handed_over);
        self.handle.spawn(async move {
            let _in_hand = in_hand;
            work.await
        })
    }

    /// Starts the valve's thread, under `DataCpu::Idle` (once; a later call does nothing).
    /// Each raise counts in `raised`.
    pub fn open_valve(&self, raised: Counter) -> std::io::Result<()> {
        match &self.valve {
            Some(valve) => valve.open(raised),
            None => Ok(()),
        }
    }
}

/// The data path's threads and the work it has in hand, for raising the threads while they
/// wait too long.
#[derive(Debug, Default)]
struct Valve {
    /// Taken by the data path's threads as they start and stop, and tried by the valve.
    threads: Mutex<Threads>,
    /// Work handed over and not yet done.
    in_hand: AtomicUsize,
    opened: AtomicBool,
    /// The valve's thread, woken when work comes to an empty data path.
    watcher: OnceLock<std::thread::Thread>,
}

#[derive(Debug, Default)]
struct Threads {
    raised: bool,
    ids: Vec<libc::pid_t>,
}

/// Work in hand on the data path, from hand-over until it is done or dropped.
struct InHand(Arc<Valve>);

impl Drop for InHand {
    fn drop(&mut self) {
        // No wake-up from here (perhaps a thread under SCHED_IDLE): the valve looks every
        // tick while work is in hand.
        self.0.in_hand.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One spell of work in hand while lowered: each thread's run-queue delay as last read,
/// and the delay added up since the spell began.
#[derive(Debug, Default)]
struct Spell {
    last: HashMap<libc::pid_t, u64>,
    waited_ns: u64,
}

impl Spell {
    /// Adds the delays read now; a thread first seen in this spell counts from its start.
    fn add(&mut self, delays: impl IntoIterator<Item = (libc::pid_t, u64)>, first: bool) {
        for (id, delay) in delays {
            let before = self.last.insert(id, delay);
            if !first {
                self.waited_ns += delay.saturating_sub(before.unwrap_or(0));
            }
        }
    }
}

impl Valve {
    fn handed_over(self: &Arc<Self>) -> InHand {
        if self.in_hand.fetch_add(1, Ordering::AcqRel) == 0 {
            if let Some(watcher) = self.watcher.get() {
                watcher.unpark();
            }
        }
        InHand(self.clone())
    }

    /// A thread of the data runtime starts: it takes the policy the others have now.
    fn joined(&self) {
        let id = this_thread_id();
        let raised = {
            let mut threads = self.threads.lock().expect("not poisoned");
            threads.ids.push(id);
            threads.raised
        };
        // Set outside the lock (this thread may already be under SCHED_IDLE, inherited), then
        // made right under it if the valve turned meanwhile.
        set_policy(id, raised);
        let threads = self.threads.lock().expect("not poisoned");
        if threads.raised != raised {
            set_policy(id, threads.raised);
        }
    }

    /// A thread of the data runtime stops (on the thread, before it exits, so its id is not
    /// yet reused).
    fn left(&self) {
        let id = this_thread_id();
        self.threads
            .lock()
            .expect("not poisoned")
            .ids
            .retain(|&other| other != id);
    }

    fn open(self: &Arc<Self>, raised: Counter) -> std::io::Result<()> {
        if self.opened.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let valve = Arc::downgrade(self);
        let thread = std::thread::Builder::new()
            .name("ckptd-valve".into())
            .spawn(move || watch(valve, raised))?;
        let _ = self.watcher.set(thread.thread().clone());
        // Work handed over before the watcher was known.
        thread.thread().unpark();
        Ok(())
    }

    /// One look: lowers the threads when nothing is in hand; while work is, adds up their
    /// waits and raises them past the grace. Returns how long to sleep.
    fn look(&self, spell: &mut Option<Spell>, raised: &Counter) -> Duration {
        // A data-path thread holding the lock is starting or stopping: look again soon.
        let Ok(mut threads) = self.threads.try_lock() else {
            return TICK;
        };
        if self.in_hand.load(Ordering::Acquire) == 0 {
            *spell = None;
            if threads.raised && !threads.set_all(false) {
                return TICK;
            }
            return IDLE_LOOK;
        }
        if threads.raised {
            return TICK;
        }
        let delays: Vec<(libc::pid_t, u64)> = threads
            .ids
            .iter()
            .map(|&id| (id, run_delay_ns(id)))
            .collect();
        let first = spell.is_none();
        let spell = spell.get_or_insert_with(Spell::default);
        spell.add(delays, first);
        if spell.waited_ns >= IDLE_GRACE.as_nanos() as u64 && threads.set_all(true) {
            raised.inc();
            tracing::debug!(
                waited_ms = spell.waited_ns / 1_000_000,
                "data path raised to SCHED_BATCH: its threads waited past the grace for a CPU"
            );
        }
        TICK
    }
}

impl Threads {
    /// Raises or lowers every thread; whether all took it (only then is `raised` changed, and
    /// the valve tries again at its next look otherwise).
    fn set_all(&mut self, raise: bool) -> bool {
        let all = self.ids.iter().all(|&id| set_policy(id, raise));
        if all {
            self.raised = raise;
            if !raise {
                tracing::debug!("data path lowered to SCHED_IDLE: nothing in hand");
            }
        }
        all
    }
}

/// The valve's thread: looks while the valve is there (the daemon's data path lives as long
/// as the process; a test's is dropped).
fn watch(valve: Weak<Valve>, raised: Counter) {
    let mut spell = None;
    while let Some(pause) = valve.upgrade().map(|valve| valve.look(&mut spell, &raised)) {
        std::thread::park_timeout(pause);
    }
}

/// Puts thread `id` under `SCHED_BATCH` (`raise`) or `SCHED_IDLE`; whether the kernel took
/// it. The first refusal is logged.
fn set_policy(id: libc::pid_t, raise: bool) -> bool {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let policy = if raise {
        libc::SCHED_BATCH
    } else {
        libc::SCHED_IDLE
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads the one valid `sched_param` passed.
    #[allow(unsafe_code)]
    let result = unsafe { libc::sched_setscheduler(id, policy, &param) };
    if result != 0 {
        let error = std::io::Error::last_os_error();
        WARNED.call_once(|| {
            tracing::warn!(%error, raise, "could not change the data path's scheduling policy");
        });
    }
    result == 0
}

/// The calling thread's id (the `gettid` system call: glibc has a wrapper only since 2.30).
fn this_thread_id() -> libc::pid_t {
    // SAFETY: gettid takes no arguments and cannot fail.
    #[allow(unsafe_code)]
    let id = unsafe { libc::syscall(libc::SYS_gettid) };
    id as libc::pid_t
}

/// How long thread `id` of this process has waited, runnable, for a CPU (the second figure
/// of its `schedstat`), in ns; 0 for a thread gone.
fn run_delay_ns(id: libc::pid_t) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{id}/schedstat"))
        .ok()
        .and_then(|text| text.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// Whether a thread of this process may leave `SCHED_IDLE` again: tried on a thread of its
/// own, which goes idle and back.
fn can_leave_idle() -> bool {
    let probe = std::thread::Builder::new().spawn(|| {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: as in `set_policy`; pid 0 is this probe thread.
        #[allow(unsafe_code)]
        unsafe {
            libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) == 0
                && libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) == 0
        }
    });
    probe.is_ok_and(|probe| probe.join().unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scheduling policy of the thread that runs this.
    fn policy() -> i32 {
        // SAFETY: sched_getscheduler reads nothing of ours; pid 0 is the calling thread.
        #[allow(unsafe_code)]
        unsafe {
            libc::sched_getscheduler(0)
        }
    }

    /// The scheduling policy of thread `id` of this process.
    fn policy_of(id: libc::pid_t) -> i32 {
        // SAFETY: as in `policy`.
        #[allow(unsafe_code)]
        unsafe {
            libc::sched_getscheduler(id)
        }
    }

    /// The CPU time this thread has used.
    fn thread_cpu() -> Duration {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes the one valid timespec passed.
        #[allow(unsafe_code)]
        unsafe {
            libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now);
        }
        Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
    }

    #[test]
    fn the_data_path_starts_under_sched_idle_unless_shared() {
        let here = policy();
        assert_ne!(here, libc::SCHED_IDLE, "the test thread starts unlowered");
        // Without the right to raise it again, "idle" runs as "shared".
        let idle = if can_leave_idle() {
            libc::SCHED_IDLE
        } else {
            here
        };
        for (cpu, expected) in [(DataCpu::Idle, idle), (DataCpu::Shared, here)] {
            let (runtime, data) = DataPath::start(cpu).unwrap();
            let (worker, blocking) = runtime.block_on(async {
                let worker = data.run(async { policy() }).await;
                let blocking = data
                    .run(async { tokio::task::spawn_blocking(policy).await.unwrap() })
                    .await;
                (worker, blocking)
            });
            assert_eq!((worker, blocking), (expected, expected), "{cpu:?}");
        }
        assert_eq!(policy(), here, "the calling thread keeps its policy");
    }

    /// With every core kept busy, work on an idle data path is raised once its threads have
    /// waited the grace for a CPU, and done in about the time it needs (unraised, 50 ms of
    /// CPU took 17 s: the busy threads leave it a fraction of a percent); with nothing in
    /// hand, every thread is lowered again.
    #[test]
    fn work_that_waits_past_the_grace_is_raised_and_then_lowered() {
        let (runtime, data) = DataPath::start(DataCpu::Idle).unwrap();
        let raised = Counter::default();
        let Some(valve) = data.valve.clone() else {
            let policy = runtime.block_on(data.run(async { policy() }));
            assert_ne!(policy, libc::SCHED_IDLE, "unraisable, so never lowered");
            eprintln!("no CAP_SYS_NICE here: only the fallback to \"shared\" was checked");
            return;
        };
        data.open_valve(raised.clone()).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let busy: Vec<_> = (0..cores)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        let started = std::time::Instant::now();
        let during = runtime.block_on(data.run(async {
            tokio::task::spawn_blocking(|| {
                let from = thread_cpu();
                while thread_cpu() - from < Duration::from_millis(50) {
                    std::hint::spin_loop();
                }
                policy()
            })
            .await
            .unwrap()
        }));
        let took = started.elapsed();
        let raises = raised.get();
        stop.store(true, Ordering::Relaxed);
        for thread in busy {
            thread.join().unwrap();
        }
        // Nothing in hand now: the valve lowers every thread at its next look.
        let waited = std::time::Instant::now();
        let policies = loop {
            let threads = valve.threads.lock().unwrap();
            let policies: Vec<i32> = threads.ids.iter().map(|&id| policy_of(id)).collect();
            if !threads.raised || waited.elapsed() > Duration::from_secs(2) {
                break policies;
            }
            drop(threads);
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(during, libc::SCHED_BATCH, "raised while it worked");
        assert!(took < Duration::from_secs(3), "done in {took:?}");
        assert_eq!(raises, 1);
        assert!(policies.len() >= 2, "{policies:?}");
        assert!(
            policies.iter().all(|&p| p == libc::SCHED_IDLE),
            "lowered: {policies:?}"
        );
        drop(runtime);
    }
}
