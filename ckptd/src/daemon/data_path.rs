//! The data path's runtime (hashing and replicating snapshots, receiving replicas, uploads)
//! and how its threads share the node's cores with the ranks ([`DataCpu`]).
//!
//! Under `DataCpu::Idle` the threads start under `SCHED_IDLE`, and a valve keeps that from
//! starving them. While the data path has work in hand, a thread of its own (`ckptd-valve`,
//! under the daemon's policy) adds up how long the data path's threads have waited, runnable,
//! for a CPU: what the kernel adds to each one's run-queue delay (`schedstat`, which grows
//! only when a thread gets a CPU), and for a thread runnable now that has not run since the
//! last look, the time since. A quarter of each look's interval is allowed and taken off, so
//! short waits on idle cores never add up. Past [`IDLE_GRACE`] the valve raises every thread
//! of the runtime to `SCHED_BATCH` (the ranks' equal), until the data path has nothing in
//! hand or [`RAISED_FOR`] has passed, then lowers them and measures again. On a node with
//! idle cores the data path's threads do not wait and stay below the ranks however long its
//! work is in hand; on one whose ranks keep every core busy it takes its share after the
//! grace, instead of leaving the node to restore from a step long gone. (With the threads
//! lowered as soon as the oldest work was within a grace of time in hand, every snapshot
//! waited the grace again, and a rank lost at step 9 of a run on busy cores restored step 1.)
//!
//! The kernel lets a thread leave `SCHED_IDLE` only with `CAP_SYS_NICE` (in the initial user
//! namespace) or an `RLIMIT_NICE` that allows its nice value (20 at nice 0); a daemon with
//! neither, or on a kernel that does not show run-queue delays, runs the data path under
//! `SCHED_BATCH` from the start, as `DataCpu::Shared`, and says so. The valve takes no lock
//! of the daemon's: the threads' ids, the policy it wants and the work in hand are atomics,
//! and it puts each thread under the policy it wants at every look (a thread that started as
//! it turned included). Tokio's own scheduler locks are shared with the control path, as for
//! any work handed between runtimes. It reads and sets the threads through [`Kernel`], which
//! the unit tests make up to test its decisions exactly and without privilege.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::runtime::{Handle, Runtime};

use super::DataCpu;

/// How long, in all (less a quarter of the time passing), the data path's threads may wait
/// for a CPU while it has work in hand before the valve raises them.
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
            DataCpu::Idle if can_leave_idle() => Some(Arc::new(Valve::new(Arc::new(ThisProcess)))),
            DataCpu::Idle => {
                tracing::warn!(
                    "data_cpu = \"idle\" needs CAP_SYS_NICE (or an RLIMIT_NICE that allows nice 0) and the kernel's run-queue delays (schedstat) to raise the data path when the ranks leave it no idle time; running it as \"shared\""
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

    /// Runs `work` on the data path's runtime and waits for it. A panic is the caller's, as
    /// if `work` had run in its task. What takes the daemon's locks stays out of `work`: a
    /// thread under `SCHED_IDLE` holding one would keep every task that wants it waiting
    /// until a core is idle (or the valve raises it).
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
/// wait too long. Lock-free: the threads may be under `SCHED_IDLE`, and whatever they held
/// while starved would stop the valve too.
#[derive(Debug)]
struct Valve {
    /// What the valve reads of the threads and asks of the kernel for them.
    kernel: Arc<dyn Kernel>,
    /// The data threads' ids, each in a slot of its own (0: free), set as they start and
    /// cleared as they stop.
    ids: [AtomicI32; ID_SLOTS],
    /// What the valve wants the threads under; a thread that starts takes it.
    raised: AtomicBool,
    /// Work handed over and not yet done.
    in_hand: AtomicUsize,
    /// The valve's thread, once opened; woken when work comes to an empty data path.
    watcher: OnceLock<std::thread::Thread>,
}

/// What the valve reads of the kernel about a data thread and asks of it: this process's
/// threads ([`ThisProcess`]), or a test's threads, whose scheduling it makes up.
trait Kernel: Send + Sync + std::fmt::Debug {
    /// Thread `id`'s CPU time and run-queue delay in ns; None for a thread gone.
    fn schedstat(&self, id: libc::pid_t) -> Option<(u64, u64)>;
    /// Whether thread `id` is runnable (running or waiting for a CPU).
    fn runnable(&self, id: libc::pid_t) -> bool;
    /// Thread `id`'s scheduling policy (-1 for a thread gone).
    fn policy(&self, id: libc::pid_t) -> i32;
    /// Puts thread `id` under `policy`.
    fn set_policy(&self, id: libc::pid_t, policy: i32) -> std::io::Result<()>;
}

/// This process's threads, through `/proc/self/task` and the scheduler's system calls.
#[derive(Debug)]
struct ThisProcess;

impl Kernel for ThisProcess {
    fn schedstat(&self, id: libc::pid_t) -> Option<(u64, u64)> {
        schedstat(id)
    }

    fn runnable(&self, id: libc::pid_t) -> bool {
        runnable(id)
    }

    fn policy(&self, id: libc::pid_t) -> i32 {
        policy_of(id)
    }

    fn set_policy(&self, id: libc::pid_t, policy: i32) -> std::io::Result<()> {
        set_scheduler(id, policy)
    }
}

/// Slots for the data threads' ids: 2 workers and up to 8 blocking threads, with room for
/// threads that have stopped and not yet left.
const ID_SLOTS: usize = 32;

/// Work in hand on the data path, from hand-over until it is done or dropped.
struct InHand(Arc<Valve>);

impl Drop for InHand {
    fn drop(&mut self) {
        // The valve notices at its next look (every tick while work is in hand).
        self.0.in_hand.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the valve keeps between looks.
#[derive(Debug, Default)]
struct Watch {
    /// Each thread as last read.
    threads: HashMap<libc::pid_t, Sched>,
    /// The threads' wait for a CPU, less an allowance per look (so that short waits on idle
    /// cores never add up), since the threads were last lowered; raised at [`IDLE_GRACE`].
    waited: Duration,
    /// When the threads were raised, while they are.
    raised_at: Option<std::time::Instant>,
    last_look: Option<std::time::Instant>,
}

/// One thread's scheduling figures, as the valve last read them.
#[derive(Clone, Copy, Debug)]
struct Sched {
    /// CPU time and run-queue delay (`schedstat`), ns.
    ran_ns: u64,
    delay_ns: u64,
    /// Waiting time the valve counted before the kernel did: the kernel adds a wait to the
    /// run-queue delay only when the thread gets a CPU, so a thread starved now shows none.
    counted_ns: u64,
    /// Runnable (running or waiting for a CPU) when read.
    runnable: bool,
}

/// The share of each look's interval a thread's waits are allowed before they count.
const ALLOWANCE: u32 = 4;
/// How long the threads stay raised with work still in hand before the valve lowers them
/// to measure again.
const RAISED_FOR: Duration = Duration::from_secs(1);

impl Valve {
    fn new(kernel: Arc<dyn Kernel>) -> Valve {
        Valve {
            kernel,
            ids: Default::default(),
            raised: AtomicBool::default(),
            in_hand: AtomicUsize::default(),
            watcher: OnceLock::new(),
        }
    }

    fn handed_over(self: &Arc<Self>) -> InHand {
        if self.in_hand.fetch_add(1, Ordering::AcqRel) == 0 {
            if let Some(watcher) = self.watcher.get() {
                watcher.unpark();
            }
        }
        InHand(self.clone())
    }

    /// A thread of the data runtime starts: it takes the policy the valve wants now (the valve
    /// puts it right at its next look if that changes meanwhile).
    fn joined(&self) {
        self.join(this_thread_id());
    }

    /// Thread `id` joins the data runtime, under the policy the valve wants now.
    fn join(&self, id: libc::pid_t) {
        if !self.ids.iter().any(|slot| {
            slot.compare_exchange(0, id, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        }) {
            tracing::warn!(
                "more data-path threads than the valve has room for: one is not watched"
            );
        }
        self.put(id, self.raised.load(Ordering::Acquire));
    }

    /// A thread of the data runtime stops (on the thread, before it exits, so its id is not
    /// yet reused).
    fn left(&self) {
        self.leave(this_thread_id());
    }

    fn leave(&self, id: libc::pid_t) {
        for slot in &self.ids {
            let _ = slot.compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    fn open(self: &Arc<Self>, raised: Counter) -> std::io::Result<()> {
        if self.watcher.get().is_some() {
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

    fn ids(&self) -> Vec<libc::pid_t> {
        self.ids
            .iter()
            .map(|slot| slot.load(Ordering::Acquire))
            .filter(|&id| id != 0)
            .collect()
    }

    /// Puts every thread under the policy the valve wants, where one is not.
    fn enforce(&self) {
        let raise = self.raised.load(Ordering::Acquire);
        for id in self.ids() {
            if self.kernel.policy(id) != policy_for(raise) {
                self.put(id, raise);
            }
        }
    }

    /// Puts thread `id` under `SCHED_BATCH` (`raise`) or `SCHED_IDLE`. The first refusal is
    /// logged; the valve tries again at its next look.
    fn put(&self, id: libc::pid_t, raise: bool) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        if let Err(error) = self.kernel.set_policy(id, policy_for(raise)) {
            WARNED.call_once(|| {
                tracing::warn!(%error, raise, "could not change the data path's scheduling policy");
            });
        }
    }

    /// One look: lowers the threads when nothing is in hand or they have been raised for
    /// [`RAISED_FOR`]; while work is in hand and they are lowered, adds up their waits for a
    /// CPU and raises them past the grace. Returns how long to sleep.
    fn look(&self, watch: &mut Watch, raised: &Counter, now: std::time::Instant) -> Duration {
        let since = watch.last_look.replace(now).map(|then| now - then);
        let in_hand = self.in_hand.load(Ordering::Acquire) > 0;
        let lower = match watch.raised_at {
            Some(at) => !in_hand || now - at >= RAISED_FOR,
            None => false,
        };
        if lower {
            self.raised.store(false, Ordering::Release);
            watch.raised_at = None;
            tracing::debug!("data path lowered to SCHED_IDLE");
        }
        if !in_hand || lower {
            // A fresh measure from here.
            watch.threads.clear();
            watch.waited = Duration::ZERO;
        }
        if in_hand && watch.raised_at.is_none() {
            let waited = self.waits(watch, since.unwrap_or_default());
            let allowance = since.unwrap_or_default() / ALLOWANCE;
            watch.waited = watch.waited.saturating_sub(allowance) + waited;
            if watch.waited >= IDLE_GRACE {
                self.raised.store(true, Ordering::Release);
                watch.raised_at = Some(now);
                raised.inc();
                tracing::debug!(
                    waited_ms = watch.waited.as_millis() as u64,
                    "data path raised to SCHED_BATCH: its threads waited past the grace for a CPU"
                );
            }
        }
        self.enforce();
        if in_hand {
            TICK
        } else {
            IDLE_LOOK
        }
    }

    /// The threads' waits for a CPU since the last look: what the kernel added to their
    /// run-queue delay (less what was counted ahead of it), and, for a thread runnable at this
    /// look and the last (`since` ago) that has not run between, that time.
    fn waits(&self, watch: &mut Watch, since: Duration) -> Duration {
        let ids = self.ids();
        watch.threads.retain(|id, _| ids.contains(id));
        let mut waited_ns = 0;
        for id in ids {
            let Some((ran_ns, delay_ns)) = self.kernel.schedstat(id) else {
                continue;
            };
            let mut now = Sched {
                ran_ns,
                delay_ns,
                counted_ns: 0,
                runnable: self.kernel.runnable(id),
            };
            // First seen: a baseline.
            if let Some(before) = watch.threads.get(&id).copied() {
                let added = delay_ns.saturating_sub(before.delay_ns);
                let counted_now = added.min(before.counted_ns);
                now.counted_ns = before.counted_ns - counted_now;
                waited_ns += added - counted_now;
                // Runnable at both looks and not run between: it waited all of the interval.
                if before.runnable && now.runnable && ran_ns == before.ran_ns {
                    let pending = since.as_nanos() as u64;
                    now.counted_ns += pending;
                    waited_ns += pending;
                }
            }
            watch.threads.insert(id, now);
        }
        Duration::from_nanos(waited_ns)
    }
}

/// The valve's thread: looks while the valve is there (the daemon's data path lives as long
/// as the process; a test's is dropped).
fn watch(valve: Weak<Valve>, raised: Counter) {
    let mut watch = Watch::default();
    while let Some(pause) = valve
        .upgrade()
        .map(|valve| valve.look(&mut watch, &raised, std::time::Instant::now()))
    {
        std::thread::park_timeout(pause);
    }
}

/// The policy of a raised (`SCHED_BATCH`) or lowered (`SCHED_IDLE`) data thread.
fn policy_for(raise: bool) -> i32 {
    if raise {
        libc::SCHED_BATCH
    } else {
        libc::SCHED_IDLE
    }
}

/// Puts thread `id` of this process (0: the calling thread) under `policy`, a
/// non-real-time one.
pub(super) fn set_scheduler(id: libc::pid_t, policy: i32) -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads the one valid `sched_param` passed.
    #[allow(unsafe_code)]
    let result = unsafe { libc::sched_setscheduler(id, policy, &param) };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The scheduling policy of thread `id` of this process (-1 for a thread gone).
fn policy_of(id: libc::pid_t) -> i32 {
    // SAFETY: sched_getscheduler reads nothing of ours.
    #[allow(unsafe_code)]
    unsafe {
        libc::sched_getscheduler(id)
    }
}

/// The calling thread's id.
fn this_thread_id() -> libc::pid_t {
    rustix::thread::gettid().as_raw_nonzero().get()
}

/// Thread `id`'s CPU time and run-queue delay in ns (`/proc/self/task/<id>/schedstat`); None
/// for a thread gone, or a kernel without the figures.
fn schedstat(id: libc::pid_t) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/self/task/{id}/schedstat")).ok()?;
    let mut figures = text.split_whitespace().map(|f| f.parse::<u64>().ok());
    Some((figures.next()??, figures.next()??))
}

/// Whether thread `id` is runnable (running or waiting for a CPU), from its `stat`.
fn runnable(id: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/self/task/{id}/stat"))
        .ok()
        .and_then(|text| {
            let state = text.get(text.rfind(')')? + 2..)?;
            Some(state.starts_with('R'))
        })
        .unwrap_or(false)
}

/// Whether a thread of this process may leave `SCHED_IDLE` again, and the kernel shows the
/// run-queue delay the valve goes by: tried on a thread of its own, which goes idle and back.
fn can_leave_idle() -> bool {
    let probe = std::thread::Builder::new().spawn(|| {
        let left = set_scheduler(0, libc::SCHED_IDLE).is_ok()
            && set_scheduler(0, libc::SCHED_BATCH).is_ok();
        left && schedstat(this_thread_id()).is_some_and(|(ran_ns, _)| ran_ns > 0)
    });
    probe.is_ok_and(|probe| probe.join().unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held by the tests that keep every core busy or want them not to be: one at a time.
    static CORES: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// An idle data path with its valve open (where it has one), what counts its raises, and
    /// [`CORES`] held.
    fn idle_data_path() -> (
        std::sync::MutexGuard<'static, ()>,
        Runtime,
        DataPath,
        Counter,
    ) {
        let cores = CORES
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (runtime, data) = DataPath::start(DataCpu::Idle).unwrap();
        let raised = Counter::default();
        data.open_valve(raised.clone()).unwrap();
        (cores, runtime, data, raised)
    }

    /// The scheduling policy of the thread that runs this.
    fn policy() -> i32 {
        policy_of(0)
    }

    /// The CPU time this thread has used.
    fn thread_cpu() -> Duration {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
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

    /// Work that waits on something else (here a sleep, as a replica receive waits on the
    /// network) is not starved, however long it is in hand: the data path stays lowered unless
    /// its threads really waited the grace for a CPU (other load on the machine).
    #[test]
    fn work_in_hand_that_does_not_wait_for_a_cpu_is_not_raised() {
        let (_cores, runtime, data, raised) = idle_data_path();
        let Some(valve) = data.valve.clone() else {
            eprintln!("no CAP_SYS_NICE here: nothing to check");
            return;
        };
        let delay = || -> u64 {
            valve
                .ids()
                .into_iter()
                .filter_map(|id| schedstat(id).map(|(_, delay)| delay))
                .sum()
        };
        let before = delay();
        let during = runtime.block_on(data.run(async {
            for _ in 0..30 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::task::spawn_blocking(|| {
                std::thread::sleep(Duration::from_millis(200));
                policy()
            })
            .await
            .unwrap()
        }));
        let waited = Duration::from_nanos(delay().saturating_sub(before));
        if raised.get() == 0 {
            assert_eq!(during, libc::SCHED_IDLE);
        } else {
            // Other work on a loaded machine can starve even this: then the raise is due.
            assert!(waited >= IDLE_GRACE, "raised after waits of {waited:?}");
        }
        println!(
            "raised {} times; the threads waited {waited:?}",
            raised.get()
        );
    }

    /// With every core kept busy, work on an idle data path is raised once its threads have
    /// waited the grace for a CPU, and done in about the time it needs (unraised, 50 ms of
    /// CPU took 17 s: the busy threads leave it a fraction of a percent); with nothing in
    /// hand, every thread is lowered again.
    #[test]
    fn work_that_waits_past_the_grace_is_raised_and_then_lowered() {
        let (_cores, runtime, data, raised) = idle_data_path();
        let Some(valve) = data.valve.clone() else {
            let policy = runtime.block_on(data.run(async { policy() }));
            assert_ne!(policy, libc::SCHED_IDLE, "unraisable, so never lowered");
            eprintln!("no CAP_SYS_NICE here: only the fallback to \"shared\" was checked");
            return;
        };
        let stop = Arc::new(AtomicBool::new(false));
        // One per CPU this process may run on (a CPU quota would leave some free), each held
        // on its CPU: two on one CPU, until the kernel moved one, left the other CPU to the
        // idle work (it was done in 50 ms unraised in about one run of ten).
        let allowed = rustix::thread::sched_getaffinity(None).expect("this thread's CPUs");
        let cpus: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU)
            .filter(|cpu| allowed.is_set(*cpu))
            .collect();
        let spinning = Arc::new(AtomicUsize::new(0));
        let busy: Vec<_> = cpus
            .iter()
            .map(|&cpu| {
                let (stop, spinning) = (stop.clone(), spinning.clone());
                std::thread::spawn(move || {
                    let mut only = rustix::thread::CpuSet::new();
                    only.set(cpu);
                    rustix::thread::sched_setaffinity(None, &only).expect("a CPU of this process");
                    spinning.fetch_add(1, Ordering::AcqRel);
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        // Every core busy before the work comes.
        while spinning.load(Ordering::Acquire) < cpus.len() {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
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
            let lowered = !valve.raised.load(Ordering::Acquire);
            // The valve puts each thread right after it turns: read them a look later.
            std::thread::sleep(TICK * 2);
            let policies: Vec<i32> = valve.ids().into_iter().map(policy_of).collect();
            if lowered || waited.elapsed() > Duration::from_secs(2) {
                break policies;
            }
        };
        // Raised while it worked (lowered again to measure after a second raised, where other
        // load here slows even the raised work).
        assert!(raises >= 1, "never raised; done in {took:?}");
        assert!(
            during == libc::SCHED_BATCH || took > RAISED_FOR,
            "done unraised in {took:?}"
        );
        assert!(took < Duration::from_secs(5), "done in {took:?}");
        assert!(policies.len() >= 2, "{policies:?}");
        assert!(
            policies.iter().all(|&p| p == libc::SCHED_IDLE),
            "lowered: {policies:?}"
        );
        drop(runtime);
    }

    /// A test's data threads: their scheduling figures are what the test says, and their
    /// policies what the valve last put (or refused, while `refuse` is set).
    #[derive(Debug, Default)]
    struct Made {
        threads: std::sync::Mutex<HashMap<libc::pid_t, MadeThread>>,
        refuse: AtomicBool,
    }

    #[derive(Clone, Copy, Debug, Default)]
    struct MadeThread {
        ran_ns: u64,
        delay_ns: u64,
        runnable: bool,
        policy: i32,
    }

    impl Made {
        fn thread(&self, id: libc::pid_t) -> MadeThread {
            self.threads
                .lock()
                .unwrap()
                .get(&id)
                .copied()
                .unwrap_or_default()
        }

        fn update(&self, id: libc::pid_t, change: impl FnOnce(&mut MadeThread)) {
            change(self.threads.lock().unwrap().entry(id).or_default());
        }
    }

    impl Kernel for Made {
        fn schedstat(&self, id: libc::pid_t) -> Option<(u64, u64)> {
            let thread = self.thread(id);
            Some((thread.ran_ns, thread.delay_ns))
        }

        fn runnable(&self, id: libc::pid_t) -> bool {
            self.thread(id).runnable
        }

        fn policy(&self, id: libc::pid_t) -> i32 {
            self.thread(id).policy
        }

        fn set_policy(&self, id: libc::pid_t, policy: i32) -> std::io::Result<()> {
            if self.refuse.load(Ordering::Acquire) {
                return Err(std::io::Error::from_raw_os_error(libc::EPERM));
            }
            self.update(id, |thread| thread.policy = policy);
            Ok(())
        }
    }

    /// A valve over made-up threads 1 and 2, looked at on a made-up clock.
    struct Scene {
        made: Arc<Made>,
        valve: Arc<Valve>,
        watch: Watch,
        raised: Counter,
        now: std::time::Instant,
    }

    impl Scene {
        fn new() -> Scene {
            let made = Arc::new(Made::default());
            let valve = Arc::new(Valve::new(made.clone()));
            valve.join(1);
            valve.join(2);
            Scene {
                made,
                valve,
                watch: Watch::default(),
                raised: Counter::default(),
                now: std::time::Instant::now(),
            }
        }

        /// A look `after` the last one.
        fn look(&mut self, after: Duration) {
            self.now += after;
            self.valve.look(&mut self.watch, &self.raised, self.now);
        }

        /// Both threads wait for a CPU through the next `looks` ticks (the first look ever is
        /// a baseline), each ending in a look.
        fn starve(&mut self, looks: usize) {
            for id in [1, 2] {
                self.made.update(id, |thread| thread.runnable = true);
            }
            for _ in 0..looks {
                self.look(TICK);
            }
        }

        fn policies(&self) -> [i32; 2] {
            [1, 2].map(|id| self.made.thread(id).policy)
        }

        /// How many times the valve raised the threads, and their policies now.
        fn state(&self) -> (u64, [i32; 2]) {
            (self.raised.get(), self.policies())
        }
    }

    const IDLE: [i32; 2] = [libc::SCHED_IDLE; 2];
    const RAISED: [i32; 2] = [libc::SCHED_BATCH; 2];

    /// Two threads runnable at two looks and not run between have each waited the whole tick:
    /// 40 ms a look, less the 5 ms allowance from the second on. Past the 100 ms grace at the
    /// third look after the first that saw them runnable, not before, and then both are raised.
    #[test]
    fn threads_starved_past_the_grace_are_raised_at_the_look_that_passes_it() {
        let mut scene = Scene::new();
        assert_eq!(scene.policies(), IDLE, "they join lowered");
        let _in_hand = scene.valve.handed_over();
        scene.starve(1);
        scene.starve(2);
        assert_eq!(scene.watch.waited, Duration::from_millis(75));
        assert_eq!(scene.state(), (0, IDLE));
        scene.starve(1);
        assert_eq!(scene.state(), (1, RAISED), "110 ms");
        // Raised, it does not count again.
        scene.starve(10);
        assert_eq!(scene.raised.get(), 1);
    }

    /// Without work in hand the threads' waits are not the data path's: not counted.
    #[test]
    fn waits_with_nothing_in_hand_do_not_count() {
        let mut scene = Scene::new();
        scene.look(Duration::ZERO);
        scene.starve(50);
        assert_eq!(scene.state(), (0, IDLE));
        // Work comes: counted from then on, not from before.
        let _in_hand = scene.valve.handed_over();
        scene.starve(3);
        assert_eq!(
            scene.raised.get(),
            0,
            "the first look with work is a baseline"
        );
        scene.starve(1);
        assert_eq!(scene.raised.get(), 1);
    }

    /// The kernel adds a wait to the run-queue delay only when the thread next runs. What the
    /// valve counted ahead of it is taken off when it does, not counted twice.
    #[test]
    fn a_wait_counted_ahead_of_the_kernel_is_not_counted_again_when_it_shows() {
        let mut scene = Scene::new();
        let _in_hand = scene.valve.handed_over();
        scene.made.update(1, |thread| thread.runnable = true);
        for _ in 0..5 {
            scene.look(TICK);
        }
        // After the baseline, 4 looks of 20 ms counted ahead for thread 1, less the allowance
        // of 5 ms at the last 3: 65 ms.
        assert_eq!(scene.watch.waited, Duration::from_millis(65));
        // Thread 1 runs, and the kernel shows the 90 ms it waited: the 80 counted ahead and 10
        // from before the first look that saw it runnable, which count now.
        scene.made.update(1, |thread| {
            thread.ran_ns += 1_000_000;
            thread.delay_ns += 90_000_000;
            thread.runnable = false;
        });
        scene.look(TICK);
        assert_eq!(scene.watch.waited, Duration::from_millis(70));
        assert_eq!(
            scene.raised.get(),
            0,
            "counted twice, it would pass the grace"
        );
        // Once caught up, what the kernel shows counts whole.
        scene.made.update(1, |thread| thread.delay_ns += 40_000_000);
        scene.look(TICK);
        assert_eq!(scene.watch.waited, Duration::from_millis(105));
        assert_eq!(scene.raised.get(), 1);
    }

    /// Threads that wait a little at every look (wake-ups on idle cores) stay within the
    /// allowance, however long the work is in hand.
    #[test]
    fn short_waits_at_every_look_never_add_up() {
        let mut scene = Scene::new();
        let _in_hand = scene.valve.handed_over();
        scene.look(Duration::ZERO);
        for _ in 0..1000 {
            for id in [1, 2] {
                scene.made.update(id, |thread| {
                    thread.ran_ns += 5_000_000;
                    thread.delay_ns += 2_000_000;
                });
            }
            scene.look(TICK);
        }
        assert_eq!(scene.state(), (0, IDLE));
        assert!(
            scene.watch.waited <= Duration::from_millis(4),
            "{:?}",
            scene.watch.waited
        );
    }

    /// Raised threads are lowered when nothing is in hand, or after RAISED_FOR with work still
    /// in hand, and the valve measures afresh: starved again, they are raised again after a
    /// whole grace.
    #[test]
    fn raised_threads_are_lowered_after_a_while_or_with_nothing_in_hand() {
        let mut scene = Scene::new();
        let in_hand = scene.valve.handed_over();
        scene.starve(4);
        assert_eq!(scene.policies(), RAISED);
        let looks = RAISED_FOR.as_millis() / TICK.as_millis();
        scene.starve(looks as usize - 1);
        assert_eq!(scene.policies(), RAISED, "within RAISED_FOR");
        scene.starve(1);
        assert_eq!(scene.state(), (1, IDLE), "after it");
        // Lowered with the work still in hand, and measured from nothing (that look is the
        // baseline).
        scene.starve(2);
        assert_eq!(scene.raised.get(), 1, "75 ms");
        scene.starve(1);
        assert_eq!(scene.state(), (2, RAISED));
        drop(in_hand);
        scene.look(TICK);
        assert_eq!(scene.policies(), IDLE, "nothing in hand");
    }

    /// A change the kernel refuses is tried again at the next look, and a thread that joins
    /// while the threads are raised starts raised.
    #[test]
    fn a_refused_change_is_tried_again_and_a_joining_thread_takes_the_wanted_policy() {
        let mut scene = Scene::new();
        let _in_hand = scene.valve.handed_over();
        scene.made.refuse.store(true, Ordering::Release);
        scene.starve(4);
        assert_eq!(scene.state(), (1, IDLE), "refused");
        scene.made.refuse.store(false, Ordering::Release);
        scene.starve(1);
        assert_eq!(scene.policies(), RAISED, "put right at the next look");
        scene.valve.join(3);
        assert_eq!(scene.made.thread(3).policy, libc::SCHED_BATCH);
        scene.valve.leave(3);
        assert_eq!(scene.valve.ids(), vec![1, 2]);
    }
}
