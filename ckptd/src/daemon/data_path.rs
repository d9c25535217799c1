//! The data path's runtime (hashing and replicating snapshots, receiving replicas, uploads)
//! and how its threads share the node's cores with the ranks ([`DataCpu`]).
//!
//! Under `DataCpu::Idle` the threads start under `SCHED_IDLE`, and a valve keeps that from
//! starving them: once any of the data path's work has been in hand longer than
//! [`IDLE_GRACE`], every thread of the runtime is raised to `SCHED_BATCH` (the ranks' equal),
//! and lowered again once the data path has nothing in hand. On a node with idle cores the
//! data path keeps up and stays below the ranks; on one whose ranks keep every core busy, it
//! takes its share after the grace until it has caught up, instead of leaving the node to
//! restore from a step long gone. (Lowered as soon as its oldest work is within the grace, it
//! waited the grace again for every snapshot, and a rank lost at step 9 of a run on busy
//! cores restored step 1.) The kernel lets a thread leave
//! `SCHED_IDLE` only with `CAP_SYS_NICE` (or an `RLIMIT_NICE` of 20); a daemon without either
//! runs the data path under `SCHED_BATCH` from the start, as `DataCpu::Shared`, and says so.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use tokio::runtime::{Handle, Runtime};

use super::DataCpu;

/// How long the data path's work waits for idle time before the valve raises it.
pub const IDLE_GRACE: Duration = Duration::from_millis(100);

/// The data path's runtime, as the daemon's tasks hand it work.
#[derive(Clone, Debug)]
pub struct DataPath {
    handle: Handle,
    /// Under `DataCpu::Idle`: what raises the threads when work waits too long.
    valve: Option<Arc<Valve>>,
}

impl DataPath {
    /// The data path's runtime: 2 workers, and up to 8 blocking threads for hashing, encoding
    /// and file IO (a few keep 2 cores busy, and fewer threads keep fewer malloc arenas
    /// holding freed chunk buffers), lowered as `cpu` says.
    pub fn start(cpu: DataCpu) -> std::io::Result<(Runtime, DataPath)> {
        let valve = match cpu {
            DataCpu::Idle if can_leave_idle() => Some(Arc::new(Valve::default())),
            DataCpu::Idle => {
                tracing::warn!(
                    "data_cpu = \"idle\" needs CAP_SYS_NICE (or an RLIMIT_NICE of 20) to raise the data path when the ranks leave it no idle time; running it as \"shared\""
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
        // Work is in hand from now until it is done (or dropped at exit).
        let waiting = self.valve.as_ref().map(Valve::waiting);
        self.handle.spawn(async move {
            let _waiting = waiting;
            work.await
        })
    }

    /// The valve's loop, to run on the control path's runtime (a loop on the data path's
    /// would wait for the idle time it is there to do without); `None` unless the data path
    /// runs under `SCHED_IDLE`. Each raise counts in `raised`.
    pub fn valve(&self, raised: Counter) -> Option<impl Future<Output = ()> + Send + 'static> {
        self.valve.clone().map(|valve| valve.watch(raised))
    }
}

/// The data path's threads and the work they have in hand, for raising the threads while
/// work waits too long.
#[derive(Debug, Default)]
struct Valve {
    threads: Mutex<Threads>,
    /// When each piece of work in hand was handed over, by a number of its own.
    waiting: Mutex<HashMap<u64, Instant>>,
    next: AtomicU64,
    /// Work was handed over or finished.
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Threads {
    raised: bool,
    ids: Vec<libc::pid_t>,
}

/// Work in hand on the data path, from hand-over until it is done or dropped.
struct Waiting {
    valve: Arc<Valve>,
    id: u64,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.valve
            .waiting
            .lock()
            .expect("not poisoned")
            .remove(&self.id);
        self.valve.changed.notify_one();
    }
}

impl Valve {
    fn waiting(self: &Arc<Self>) -> Waiting {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.waiting
            .lock()
            .expect("not poisoned")
            .insert(id, Instant::now());
        self.changed.notify_one();
        Waiting {
            valve: self.clone(),
            id,
        }
    }

    /// A thread of the data runtime starts: it takes the policy the others have now.
    fn joined(&self) {
        let mut threads = self.threads.lock().expect("not poisoned");
        // SAFETY: gettid has no preconditions.
        #[allow(unsafe_code)]
        let id = unsafe { libc::gettid() };
        set_policy(id, threads.raised);
        threads.ids.push(id);
    }

    /// A thread of the data runtime stops (before it exits, so its id is not yet reused).
    fn left(&self) {
        // SAFETY: gettid has no preconditions.
        #[allow(unsafe_code)]
        let id = unsafe { libc::gettid() };
        self.threads
            .lock()
            .expect("not poisoned")
            .ids
            .retain(|&other| other != id);
    }

    /// Raises or lowers every thread, if they are not so already. Whether it raised them.
    fn raise(&self, raise: bool) -> bool {
        let mut threads = self.threads.lock().expect("not poisoned");
        if threads.raised == raise {
            return false;
        }
        threads.raised = raise;
        for &id in &threads.ids {
            set_policy(id, raise);
        }
        raise
    }

    /// Raises the threads once any work in hand was handed over more than [`IDLE_GRACE`] ago,
    /// and lowers them once nothing is in hand; wakes when work comes or goes, or when the
    /// oldest in hand passes the grace.
    async fn watch(self: Arc<Self>, raised: Counter) {
        loop {
            let oldest = self
                .waiting
                .lock()
                .expect("not poisoned")
                .values()
                .min()
                .copied();
            let due = oldest.map(|since| since + IDLE_GRACE);
            let overdue = due.is_some_and(|due| due <= Instant::now());
            let raise = match oldest {
                None => Some(false),
                Some(_) if overdue => Some(true),
                // Work within its grace: raised threads stay so until the data path is empty.
                Some(_) => None,
            };
            if raise.is_some_and(|raise| self.raise(raise)) {
                raised.inc();
                tracing::debug!("data path raised to SCHED_BATCH: its work waited over the grace");
            }
            match due.filter(|_| !overdue) {
                Some(due) => {
                    tokio::select! {
                        () = self.changed.notified() => {}
                        () = tokio::time::sleep_until(due.into()) => {}
                    }
                }
                None => self.changed.notified().await,
            }
        }
    }
}

/// Puts thread `id` under `SCHED_BATCH` (`raise`) or `SCHED_IDLE`. A refusal is logged once:
/// the thread keeps the policy it had.
fn set_policy(id: libc::pid_t, raise: bool) {
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
}

/// Whether a thread of this process may leave `SCHED_IDLE` again: tried on a thread of its
/// own, which goes idle and back.
fn can_leave_idle() -> bool {
    std::thread::spawn(|| {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: as in `set_policy`; pid 0 is this probe thread.
        #[allow(unsafe_code)]
        unsafe {
            libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) == 0
                && libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) == 0
        }
    })
    .join()
    .unwrap_or(false)
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

    /// With every core kept busy, work on an idle data path is raised after the grace and
    /// done in about the time it needs (under `SCHED_IDLE` alone, 50 ms of CPU took 17 s: the
    /// busy threads leave it a fraction of a percent), and the data path is lowered again
    /// once it has nothing in hand.
    #[test]
    fn work_that_waits_past_the_grace_is_raised_and_then_lowered() {
        let (runtime, data) = DataPath::start(DataCpu::Idle).unwrap();
        let control = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let raised = Counter::default();
        let Some(valve) = data.valve(raised.clone()) else {
            let policy = control.block_on(data.run(async { policy() }));
            assert_ne!(policy, libc::SCHED_IDLE, "unraisable, so never lowered");
            eprintln!("no CAP_SYS_NICE here: only the fallback to \"shared\" was checked");
            return;
        };
        control.spawn(valve);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
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
        let started = Instant::now();
        let during = control.block_on(data.run(async {
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
        // Lowered once nothing is in hand: between two pieces of work, so a later one finds
        // it done.
        let mut after = control.block_on(data.run(async { policy() }));
        let waited = Instant::now();
        while after != libc::SCHED_IDLE && waited.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(10));
            after = control.block_on(data.run(async { policy() }));
        }
        stop.store(true, Ordering::Relaxed);
        for thread in busy {
            thread.join().unwrap();
        }
        assert_eq!(during, libc::SCHED_BATCH, "raised while it worked");
        assert!(took < Duration::from_secs(3), "done in {took:?}");
        assert_eq!(raised.get(), 1);
        assert_eq!(after, libc::SCHED_IDLE, "lowered once nothing waited");
        drop(runtime);
    }
}
