//! The training world: one process, or N ranks under MPI (`mpiexec -n N`, or `srun` with
//! pmi2), laid out by a [`Layout`] (tensor, data, pipeline and expert parallel). Each kind of
//! group has its own communicator, whose ranks are in the order of their place in the group.
//!
//! Every collective here is deterministic by construction: sums are taken by each rank over
//! all contributions in rank order, never by MPI's reduction trees, so a given layout
//! reproduces bit for bit.
//!
//! Launched without MPI, the world is a single rank and every collective is the identity.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};

use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Count;

use crate::layout::{Dim, Layout};

/// Which ranks a collective spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// Every rank.
    World,
    /// The ranks that split this rank's layers' tensors.
    Tensor,
    /// The ranks that hold the same weights as this rank and take other samples.
    Data,
    /// The stages of this rank's pipeline.
    Pipeline,
    /// The ranks of this rank's expert-parallel group (they split the experts).
    Expert,
    /// The ranks that hold the same experts as this rank.
    ExpertData,
}

impl Group {
    fn dim(self) -> Option<Dim> {
        match self {
            Group::World => None,
            Group::Tensor => Some(Dim::Tensor),
            Group::Data => Some(Dim::Data),
            Group::Pipeline => Some(Dim::Pipeline),
            Group::Expert => Some(Dim::Expert),
            Group::ExpertData => Some(Dim::ExpertData),
        }
    }
}

struct Comms {
    world: SimpleCommunicator,
    /// One per [`Dim`], in the order of `DIMS`.
    groups: Vec<SimpleCommunicator>,
}

const DIMS: [Dim; 5] = [
    Dim::Tensor,
    Dim::Data,
    Dim::Pipeline,
    Dim::Expert,
    Dim::ExpertData,
];

/// This process's place in the training world.
pub struct World {
    pub rank: usize,
    pub size: usize,
    pub layout: Layout,
    comms: Option<Comms>,
    // Dropped last: finalizes MPI after the communicators are freed.
    _universe: Option<Universe>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("layout", &self.layout.describe())
            .field("mpi", &self.comms.is_some())
            .finish()
    }
}

/// Whether an MPI launcher (MPICH's hydra, Slurm's pmi2, PMIx) started this process.
pub fn launched_by_mpi() -> bool {
    ["PMI_RANK", "PMI_FD", "PMIX_RANK", "PMI_SIZE"]
        .iter()
        .any(|name| std::env::var_os(name).is_some())
}

fn count(n: usize) -> Count {
    Count::try_from(n).expect("an MPI message of more than 2^31 elements")
}

fn displacements(counts: &[Count]) -> Vec<Count> {
    counts
        .iter()
        .scan(0, |next, c| {
            let at = *next;
            *next += c;
            Some(at)
        })
        .collect()
}

impl World {
    /// A world of one rank.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            layout: Layout::data_parallel(1),
            comms: None,
            _universe: None,
        }
    }

    /// Joins the MPI world if an MPI launcher started this process, else a world of one, laid
    /// out by `layout_for(number of ranks)`; its error (a layout that does not fit) is
    /// returned as it is, the same on every rank.
    pub fn init<E>(layout_for: impl FnOnce(usize) -> Result<Layout, E>) -> anyhow::Result<Self>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        if !launched_by_mpi() {
            let layout = layout_for(1)?;
            return Ok(Self {
                layout,
                ..Self::single()
            });
        }
        let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .ok_or_else(|| anyhow::anyhow!("MPI was already initialised"))?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let layout = layout_for(size)?;
        let mut groups = Vec::with_capacity(DIMS.len());
        for dim in DIMS {
            // The group's first rank names it; MPI keeps world order inside, which is the
            // order of the ranks' places in the group.
            let color = layout.group(rank, dim)[0];
            groups.push(
                world
                    .split_by_color(Color::with_value(color as i32))
                    .ok_or_else(|| anyhow::anyhow!("splitting the {dim:?} groups failed"))?,
            );
        }
        Ok(Self {
            rank,
            size,
            layout,
            comms: Some(Comms { world, groups }),
            _universe: Some(universe),
        })
    }

    pub fn is_mpi(&self) -> bool {
        self.comms.is_some()
    }

    /// This rank's place in its expert-parallel group (which experts it holds).
    pub fn ep_rank(&self) -> usize {
        self.layout.coords(self.rank).ep
    }

    /// This rank's coordinates in the layout.
    pub fn coords(&self) -> crate::layout::Coords {
        self.layout.coords(self.rank)
    }

    /// `(my index, size)` within a group.
    pub fn position(&self, group: Group) -> (usize, usize) {
        match group.dim() {
            None => (self.rank, self.size),
            Some(dim) => self.layout.place(self.rank, dim),
        }
    }

    /// The world ranks of this rank's `group`, in the group's order.
    pub fn members(&self, group: Group) -> Vec<usize> {
        match group.dim() {
            None => (0..self.size).collect(),
            Some(dim) => self.layout.group(self.rank, dim),
        }
    }

    fn comm(&self, group: Group) -> Option<&SimpleCommunicator> {
        self.comms.as_ref().map(|c| match group.dim() {
            None => &c.world,
            Some(dim) => {
                let index = DIMS.iter().position(|d| *d == dim).expect("every Dim");
                &c.groups[index]
            }
        })
    }

    pub fn barrier(&self) {
        if let Some(comm) = self.comm(Group::World) {
            waiting(|| yielding(comm.immediate_barrier()));
        }
    }

    /// Ends every rank of the job with `code` (MPI_Abort); a no-op outside MPI.
    ///
    /// It first gives the launcher a moment to forward what this rank wrote: Hydra tears the
    /// job down on an abort without draining the ranks' pipes, and lost the aborting rank's
    /// whole output (its error line and MPICH's own abort line) in 14 of 100 runs of a
    /// write-then-abort program; with a 100 ms pause, in none. It pauses 250 ms.
    ///
    /// Should `MPI_Abort` not end the job within [`ABORT_GRACE`] (a full-suite run saw one
    /// such job of a rank that had written its error stay up until its test's deadline), the
    /// process ends itself with `code`: Hydra, and `srun --kill-on-bad-exit=1` as the
    /// supervisor launches, end the job of a rank that exits without finalizing.
    pub fn abort(&self, code: i32) {
        if let Some(comm) = self.comm(Group::World) {
            std::thread::sleep(std::time::Duration::from_millis(250));
            std::thread::spawn(move || {
                std::thread::sleep(ABORT_GRACE);
                // Said on a thread of its own: a full or closed pipe must not keep the
                // process from ending.
                std::thread::spawn(move || {
                    let _ = std::io::Write::write_all(
                        &mut std::io::stderr(),
                        format!(
                            "trainer: MPI_Abort did not end the job in {} s; exiting with {code}\n",
                            ABORT_GRACE.as_secs()
                        )
                        .as_bytes(),
                    );
                });
                std::thread::sleep(std::time::Duration::from_millis(100));
                // SAFETY: `_exit` ends the process at once, running no atexit handler (the
                // main thread is inside MPI_Abort) and no destructor; nothing depends on them
                // for a job that is being torn down.
                #[allow(unsafe_code)]
                unsafe {
                    libc::_exit(code)
                }
            });
            comm.abort(code);
        }
    }

    /// Every rank's `values` (all the same length), concatenated in rank order.
    pub fn all_gather_f64(&self, group: Group, values: &[f64]) -> Vec<f64> {
        let Some(comm) = self.comm(group) else {
            return values.to_vec();
        };
        let mut out = vec![0f64; values.len() * comm.size() as usize];
        waiting(|| {
            mpi::request::scope(|scope| {
                yielding(comm.immediate_all_gather_into(scope, values, &mut out[..]))
            })
        });
        out
    }

    /// Exchanges `per_rank` integers with every rank of a group: `send` holds the block for
    /// rank 0, then rank 1, ...; returns the blocks received, in rank order.
    pub fn all_to_all_usize(&self, group: Group, send: &[usize], per_rank: usize) -> Vec<usize> {
        let Some(comm) = self.comm(group) else {
            return send.to_vec();
        };
        let counts: Vec<u64> = send.iter().map(|c| *c as u64).collect();
        let mut out = vec![0u64; per_rank * comm.size() as usize];
        waiting(|| {
            mpi::request::scope(|scope| {
                yielding(comm.immediate_all_to_all_into(scope, &counts[..], &mut out[..]))
            })
        });
        out.into_iter().map(|c| c as usize).collect()
    }

    /// Plain MPI all-to-all of `bytes_per_peer` bytes between every pair of the group's ranks,
    /// `repeats` times after one warm-up: `(bytes moved to or from other ranks, seconds)`.
    pub fn bench_all_to_all(
        &self,
        group: Group,
        bytes_per_peer: usize,
        repeats: usize,
    ) -> (u64, f64) {
        let Some(comm) = self.comm(group) else {
            return (0, 0.0);
        };
        let size = comm.size() as usize;
        let floats = bytes_per_peer / 4;
        let send = vec![1f32; floats * size];
        let mut recv = vec![0f32; floats * size];
        comm.all_to_all_into(&send[..], &mut recv[..]);
        comm.barrier();
        let started = std::time::Instant::now();
        for _ in 0..repeats {
            comm.all_to_all_into(&send[..], &mut recv[..]);
        }
        let seconds = started.elapsed().as_secs_f64();
        (2 * 4 * (floats * (size - 1) * repeats) as u64, seconds)
    }

    /// Every rank's process id and host name, in rank order: what an operator needs to map
    /// a launcher's "process 1234 died" back to a rank.
    pub fn processes(&self) -> Vec<(u32, String)> {
        const NAME: usize = 64;
        let mut mine = [0u8; NAME];
        let host = hostname();
        let bytes = host.as_bytes();
        mine[..bytes.len().min(NAME)].copy_from_slice(&bytes[..bytes.len().min(NAME)]);
        let pids = self.sum_u64_gathered(u64::from(std::process::id()));
        let names: Vec<u8> = match self.comm(Group::World) {
            Some(comm) => {
                let mut out = vec![0u8; NAME * self.size];
                comm.all_gather_into(&mine[..], &mut out[..]);
                out
            }
            None => mine.to_vec(),
        };
        pids.into_iter()
            .zip(names.chunks(NAME))
            .map(|(pid, name)| {
                let end = name.iter().position(|b| *b == 0).unwrap_or(NAME);
                (
                    pid as u32,
                    String::from_utf8_lossy(&name[..end]).to_string(),
                )
            })
            .collect()
    }

    /// Every rank's `value`, in rank order.
    fn sum_u64_gathered(&self, value: u64) -> Vec<u64> {
        let Some(comm) = self.comm(Group::World) else {
            return vec![value];
        };
        let mut out = vec![0u64; self.size];
        comm.all_gather_into(&value, &mut out[..]);
        out
    }

    /// The element-wise sum of every rank's `values`, added in rank order.
    pub fn sum_f64(&self, group: Group, values: &[f64]) -> Vec<f64> {
        let _span = tracing::info_span!("all_reduce", values = values.len()).entered();
        let gathered = self.all_gather_f64(group, values);
        let mut sum = vec![0f64; values.len()];
        for contribution in gathered.chunks(values.len().max(1)) {
            for (total, value) in sum.iter_mut().zip(contribution) {
                *total += value;
            }
        }
        sum
    }

    /// The element-wise sum of every rank's `values` (all the same length), added in rank
    /// order: every rank of the group gets the same bits.
    pub fn sum_f32(&self, group: Group, values: &[f32]) -> Vec<f32> {
        let _span = tracing::info_span!("all_reduce", values = values.len()).entered();
        let Some(comm) = self.comm(group) else {
            return values.to_vec();
        };
        let mut gathered = vec![0f32; values.len() * comm.size() as usize];
        waiting(|| {
            mpi::request::scope(|scope| {
                yielding(comm.immediate_all_gather_into(scope, values, &mut gathered[..]))
            })
        });
        let mut sum = vec![0f32; values.len()];
        for contribution in gathered.chunks(values.len().max(1)) {
            for (total, value) in sum.iter_mut().zip(contribution) {
                *total += value;
            }
        }
        sum
    }

    /// Every rank's `values` (all the same length), concatenated in the group's order.
    pub fn all_gather_u64(&self, group: Group, values: &[u64]) -> Vec<u64> {
        let Some(comm) = self.comm(group) else {
            return values.to_vec();
        };
        let mut gathered = vec![0u64; values.len() * comm.size() as usize];
        waiting(|| {
            mpi::request::scope(|scope| {
                yielding(comm.immediate_all_gather_into(scope, values, &mut gathered[..]))
            })
        });
        gathered
    }

    /// The element-wise sum of every rank's `values` (integers, exact).
    pub fn sum_u64(&self, group: Group, values: &[u64]) -> Vec<u64> {
        let _span = tracing::info_span!("all_reduce", values = values.len()).entered();
        let gathered = self.all_gather_u64(group, values);
        let mut sum = vec![0u64; values.len()];
        for contribution in gathered.chunks(values.len().max(1)) {
            for (total, value) in sum.iter_mut().zip(contribution) {
                *total += value;
            }
        }
        sum
    }

    /// Reduce-scatter in a fixed order: `data` is this rank's full vector, split at `bounds`
    /// (one more than the group's size); returns the sum over the group's ranks of this rank's
    /// piece, each element added in rank order. A group of one borrows its piece of `data`.
    pub fn reduce_scatter<'a>(
        &self,
        group: Group,
        data: &'a [f32],
        bounds: &[usize],
    ) -> Cow<'a, [f32]> {
        let _span = tracing::info_span!("reduce_scatter", floats = data.len()).entered();
        let (me, size) = self.position(group);
        assert_eq!(bounds.len(), size + 1, "one bound per rank and the end");
        let Some(comm) = self.comm(group) else {
            return Cow::Borrowed(&data[bounds[0]..bounds[1]]);
        };
        let mine = bounds[me + 1] - bounds[me];
        let send_counts: Vec<Count> = bounds.windows(2).map(|w| count(w[1] - w[0])).collect();
        let send_displs: Vec<Count> = bounds.iter().take(size).map(|b| count(*b)).collect();
        let recv_counts = vec![count(mine); size];
        let recv_displs = displacements(&recv_counts);
        let mut received = vec![0f32; mine * size];
        {
            let send = Partition::new(&data[..bounds[size]], &send_counts[..], &send_displs[..]);
            let mut recv = PartitionMut::new(&mut received[..], &recv_counts[..], &recv_displs[..]);
            waiting(|| {
                mpi::request::scope(|scope| {
                    yielding(comm.immediate_all_to_all_varcount_into(scope, &send, &mut recv))
                })
            });
        }
        Cow::Owned(sum_in_rank_order(&received, mine))
    }

    /// One piece of a [`World::reduce_scatter`], posted before `meanwhile` runs and completed
    /// after it, so that the transfer overlaps whatever `meanwhile` computes: `piece` holds
    /// the elements `at..at + piece.len()` of this rank's full vector, which `bounds`
    /// (absolute) splits over the group. Returns what `meanwhile` returned and the sums of
    /// the part of this rank's share that `piece` covers, each element added in rank order:
    /// the pieces of a vector give the bits its whole reduce-scatter gives.
    pub fn reduce_scatter_around<R>(
        &self,
        group: Group,
        piece: &[f32],
        at: usize,
        bounds: &[usize],
        meanwhile: impl FnOnce() -> R,
    ) -> (R, Vec<f32>) {
        let (me, size) = self.position(group);
        assert_eq!(bounds.len(), size + 1, "one bound per rank and the end");
        let end = at + piece.len();
        let clipped = |rank: usize| bounds[rank].clamp(at, end)..bounds[rank + 1].clamp(at, end);
        let mine = clipped(me);
        let Some(comm) = self.comm(group) else {
            return (meanwhile(), piece[mine.start - at..mine.end - at].to_vec());
        };
        let send_counts: Vec<Count> = (0..size).map(|r| count(clipped(r).len())).collect();
        let send_displs: Vec<Count> = (0..size).map(|r| count(clipped(r).start - at)).collect();
        let recv_counts = vec![count(mine.len()); size];
        let recv_displs = displacements(&recv_counts);
        let mut received = vec![0f32; mine.len() * size];
        let send = Partition::new(piece, &send_counts[..], &send_displs[..]);
        let mut recv = PartitionMut::new(&mut received[..], &recv_counts[..], &recv_displs[..]);
        // Pieces nest (each one's `meanwhile` posts the next): the outermost one's time in
        // flight is all of theirs.
        let outermost = REDUCE_NESTING.fetch_add(1, Ordering::Relaxed) == 0;
        let posted = std::time::Instant::now();
        let mut exposed = std::time::Duration::ZERO;
        let span = || tracing::info_span!("reduce_scatter", floats = piece.len());
        let result = mpi::request::scope(|scope| {
            let request = {
                let _span = span().entered();
                comm.immediate_all_to_all_varcount_into(scope, &send, &mut recv)
            };
            exposed += posted.elapsed();
            let result = completing(meanwhile);
            let waiting = std::time::Instant::now();
            {
                let _span = span().entered();
                yielding(request);
            }
            exposed += waiting.elapsed();
            result
        });
        let exposed_nanos = exposed.as_nanos() as u64;
        COMMUNICATION_NANOS.fetch_add(exposed_nanos, Ordering::Relaxed);
        GRAD_REDUCE_NANOS.fetch_add(exposed_nanos, Ordering::Relaxed);
        REDUCE_NESTING.fetch_sub(1, Ordering::Relaxed);
        if outermost {
            GRAD_REDUCE_FLIGHT_NANOS
                .fetch_add(posted.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        (resumed(result), sum_in_rank_order(&received, mine.len()))
    }

    /// All-gather of pieces split at `bounds`: every rank gets the whole vector. A group of
    /// one borrows its piece, which is the whole.
    pub fn all_gather<'a>(
        &self,
        group: Group,
        piece: &'a [f32],
        bounds: &[usize],
    ) -> Cow<'a, [f32]> {
        let _span = tracing::info_span!("all_gather", floats = piece.len()).entered();
        let (me, size) = self.position(group);
        assert_eq!(bounds.len(), size + 1, "one bound per rank and the end");
        assert_eq!(
            piece.len(),
            bounds[me + 1] - bounds[me],
            "this rank's piece"
        );
        let Some(comm) = self.comm(group) else {
            return Cow::Borrowed(piece);
        };
        let counts: Vec<Count> = bounds.windows(2).map(|w| count(w[1] - w[0])).collect();
        let displs: Vec<Count> = bounds.iter().take(size).map(|b| count(*b)).collect();
        let mut out = vec![0f32; bounds[size]];
        {
            let mut recv = PartitionMut::new(&mut out[..], &counts[..], &displs[..]);
            waiting(|| {
                mpi::request::scope(|scope| {
                    yielding(comm.immediate_all_gather_varcount_into(scope, piece, &mut recv))
                })
            });
        }
        Cow::Owned(out)
    }
}

/// How long [`World::abort`] waits for `MPI_Abort` to end the job before the process exits.
pub const ABORT_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// What travels between pipeline stages: a micro-batch's activations forward, their
/// gradients back. Each kind keeps its order between two stages (MPI does not overtake).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Activations = 1,
    Gradients = 2,
}

/// The other end of a pipeline message: stage `stage` (its place in the pipeline group).
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    pub stage: usize,
    pub flow: Flow,
}

/// Time this rank spent waiting on the stages next to it.
static PIPELINE_NANOS: AtomicU64 = AtomicU64::new(0);

/// Seconds this rank has spent in pipeline sends and receives since the process started.
pub fn pipeline_wait_seconds() -> f64 {
    PIPELINE_NANOS.load(Ordering::Relaxed) as f64 / 1e9
}

impl World {
    /// Sends `send` to one stage of this rank's pipeline and receives `len` floats from one,
    /// together, or either alone. Returns what was received.
    pub fn pipe(&self, send: Option<(Peer, &[f32])>, receive: Option<(Peer, usize)>) -> Vec<f32> {
        let _span = tracing::info_span!("pipeline_send_receive").entered();
        let comm = self
            .comm(Group::Pipeline)
            .expect("pipeline messages need an MPI world");
        let started = std::time::Instant::now();
        let mut received = vec![0f32; receive.map_or(0, |(_, len)| len)];
        mpi::request::scope(|scope| {
            // Both posted before either is waited on: two stages that send to each other at
            // once do not wait on each other.
            let sent = send.map(|(to, data)| {
                comm.process_at_rank(to.stage as i32)
                    .immediate_send_with_tag(scope, data, to.flow as i32)
            });
            let receiving = receive.map(|(from, _)| {
                comm.process_at_rank(from.stage as i32)
                    .immediate_receive_into_with_tag(scope, &mut received[..], from.flow as i32)
            });
            if let Some(request) = sent {
                yielding(request);
            }
            if let Some(request) = receiving {
                yielding(request);
            }
        });
        let nanos = started.elapsed().as_nanos() as u64;
        PIPELINE_NANOS.fetch_add(nanos, Ordering::Relaxed);
        COMMUNICATION_NANOS.fetch_add(nanos, Ordering::Relaxed);
        received
    }
}

/// Runs `work` while a request is posted, catching a panic: a request dropped in flight (as
/// unwinding would) aborts the process, so the caller completes it first and then goes on
/// with the panic ([`resumed`]), which `cli` turns into the rank's error line.
fn completing<R>(work: impl FnOnce() -> R) -> std::thread::Result<R> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
}

/// What [`completing`] caught: the value, or the panic, raised again.
fn resumed<R>(outcome: std::thread::Result<R>) -> R {
    outcome.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Each rank's contribution to `len` elements, back to back in rank order, summed in rank
/// order.
fn sum_in_rank_order(received: &[f32], len: usize) -> Vec<f32> {
    let mut sum = vec![0f32; len];
    for contribution in received.chunks(len.max(1)) {
        for (total, value) in sum.iter_mut().zip(contribution) {
            *total += value;
        }
    }
    sum
}

/// The time this rank spent in MPI calls for gradient reduce-scatters posted around the
/// backward pass ([`World::reduce_scatter_around`]), and the time they were in flight.
static GRAD_REDUCE_NANOS: AtomicU64 = AtomicU64::new(0);
static GRAD_REDUCE_FLIGHT_NANOS: AtomicU64 = AtomicU64::new(0);
/// How many [`World::reduce_scatter_around`] calls are under way on this rank.
static REDUCE_NESTING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `(seconds in flight, seconds of those waited in MPI)` of this rank's gradient
/// reduce-scatters posted around the backward pass, since the process started.
pub fn overlapped_reduce_totals() -> (f64, f64) {
    let seconds = |nanos: &AtomicU64| nanos.load(Ordering::Relaxed) as f64 / 1e9;
    (
        seconds(&GRAD_REDUCE_FLIGHT_NANOS),
        seconds(&GRAD_REDUCE_NANOS),
    )
}

/// Time this rank spent inside collectives (moving data, or waiting for slower ranks).
static COMMUNICATION_NANOS: AtomicU64 = AtomicU64::new(0);

/// Completes `request`, giving the processor away between polls. A rank that spins inside
/// MPI while it waits keeps the rank it waits for off the core when ranks outnumber cores;
/// with a core each, yielding returns at once and this is a plain wait.
fn yielding<'a, D: ?Sized, S: mpi::request::Scope<'a>>(
    mut request: mpi::request::Request<'a, D, S>,
) {
    let _span = tracing::info_span!("mpi_wait").entered();
    loop {
        match request.test() {
            Ok(_) => return,
            Err(pending) => {
                request = pending;
                std::thread::yield_now();
            }
        }
    }
}

fn waiting<T>(collective: impl FnOnce() -> T) -> T {
    let started = std::time::Instant::now();
    let out = collective();
    COMMUNICATION_NANOS.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}

/// Seconds this rank has spent inside collectives since the process started. A step's
/// wall time minus its share of this is the rank's own compute: what tells a straggler
/// apart, since in lockstep training every rank's step takes as long as the slowest's.
pub fn communication_seconds() -> f64 {
    COMMUNICATION_NANOS.load(Ordering::Relaxed) as f64 / 1e9
}

/// Which of the four expert exchanges of a layer a pipelined all-to-all is: its name in the
/// trace, where its span covers only the time the rank spends posting and waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertExchange {
    /// Routed rows out to the ranks that hold their experts.
    Dispatch,
    /// The experts' outputs back to the ranks the rows came from.
    Combine,
    /// The gradient of the dispatched rows, back (the dispatch's backward).
    DispatchBackward,
    /// The gradient of the outputs, out again (the combine's backward).
    CombineBackward,
}

impl ExpertExchange {
    fn span(self) -> tracing::Span {
        match self {
            Self::Dispatch => tracing::info_span!("expert_dispatch"),
            Self::Combine => tracing::info_span!("expert_combine"),
            Self::DispatchBackward => tracing::info_span!("expert_dispatch_backward"),
            Self::CombineBackward => tracing::info_span!("expert_combine_backward"),
        }
    }
}

/// One chunk of a pipelined variable all-to-all of f32: `send_counts[i]` values at
/// `send_displs[i]` of the send buffer go to rank `i` of the group, and `recv_counts[i]`
/// values come from it, stored back to back in rank order.
#[derive(Clone, Debug, Default)]
pub struct ChunkPlan {
    pub send_counts: Vec<usize>,
    pub send_displs: Vec<usize>,
    pub recv_counts: Vec<usize>,
}

impl ChunkPlan {
    pub fn recv_len(&self) -> usize {
        self.recv_counts.iter().sum()
    }
}

/// A [`ChunkPlan`] in MPI's counts.
struct Posted {
    send_counts: Vec<Count>,
    send_displs: Vec<Count>,
    recv_counts: Vec<Count>,
    recv_displs: Vec<Count>,
}

impl From<&ChunkPlan> for Posted {
    fn from(plan: &ChunkPlan) -> Self {
        let recv_counts: Vec<Count> = plan.recv_counts.iter().map(|c| count(*c)).collect();
        Self {
            send_counts: plan.send_counts.iter().map(|c| count(*c)).collect(),
            send_displs: plan.send_displs.iter().map(|d| count(*d)).collect(),
            recv_displs: displacements(&recv_counts),
            recv_counts,
        }
    }
}

/// The time a pipelined exchange spends in MPI calls (exposed: the rank waits) from its
/// first post to its last completion (in flight: the chunks travel while the rank computes
/// the others).
struct Clock {
    kind: ExpertExchange,
    first_post: Option<std::time::Instant>,
    /// When the last request completed.
    last_completion: Option<std::time::Instant>,
    exposed: std::time::Duration,
}

impl Clock {
    fn new(kind: ExpertExchange) -> Self {
        Self {
            kind,
            first_post: None,
            last_completion: None,
            exposed: std::time::Duration::ZERO,
        }
    }

    /// A request completed just now.
    fn completed(&mut self) {
        self.last_completion = Some(std::time::Instant::now());
    }

    fn exposed<T>(&mut self, call: impl FnOnce() -> T) -> T {
        let _span = self.kind.span().entered();
        let started = std::time::Instant::now();
        self.first_post.get_or_insert(started);
        let out = call();
        self.exposed += started.elapsed();
        out
    }

    fn finish(self, plans: &[ChunkPlan], me: usize) {
        let remote: usize = plans
            .iter()
            .flat_map(|plan| {
                let sent = plan.send_counts.iter().enumerate();
                let received = plan.recv_counts.iter().enumerate();
                sent.chain(received).filter(|(rank, _)| *rank != me)
            })
            .map(|(_, values)| values)
            .sum();
        let exposed = self.exposed.as_nanos() as u64;
        let flight = match (self.first_post, self.last_completion) {
            (Some(first), Some(last)) => last.duration_since(first).as_nanos() as u64,
            _ => 0,
        };
        EXCHANGE_BYTES.fetch_add(4 * remote as u64, Ordering::Relaxed);
        EXCHANGE_NANOS.fetch_add(exposed, Ordering::Relaxed);
        EXCHANGE_FLIGHT_NANOS.fetch_add(flight, Ordering::Relaxed);
        COMMUNICATION_NANOS.fetch_add(exposed, Ordering::Relaxed);
    }
}

/// Bytes this rank sent to and received from other ranks in expert exchanges, the time it
/// spent in MPI calls for them, and the time they were in flight, since the process started.
static EXCHANGE_BYTES: AtomicU64 = AtomicU64::new(0);
static EXCHANGE_NANOS: AtomicU64 = AtomicU64::new(0);
static EXCHANGE_FLIGHT_NANOS: AtomicU64 = AtomicU64::new(0);

/// This rank's expert exchanges so far.
#[derive(Clone, Copy, Debug)]
pub struct ExchangeTotals {
    /// Bytes moved to or from other ranks.
    pub bytes: u64,
    /// Seconds from each exchange's first post to its last completion.
    pub in_flight_s: f64,
    /// Seconds of those the rank spent in MPI calls, waiting; the rest it computed.
    pub exposed_s: f64,
}

pub fn exchange_totals() -> ExchangeTotals {
    let seconds = |nanos: &AtomicU64| nanos.load(Ordering::Relaxed) as f64 / 1e9;
    ExchangeTotals {
        bytes: EXCHANGE_BYTES.load(Ordering::Relaxed),
        in_flight_s: seconds(&EXCHANGE_FLIGHT_NANOS),
        exposed_s: seconds(&EXCHANGE_NANOS),
    }
}

/// Computes on one chunk's received values (`chunk`, values).
pub type OnArrival<'c> = dyn FnMut(usize, &[f32]) -> candle_core::Result<()> + 'c;

/// The local work of [`World::compute_then_exchange`], chunk by chunk.
pub trait ChunkWork {
    /// Makes chunk `chunk`'s send buffer.
    fn produce(&mut self, chunk: usize) -> candle_core::Result<Vec<f32>>;
    /// Work that the exchange does not wait for, run while chunk `chunk` is in flight.
    fn meanwhile(&mut self, _chunk: usize) -> candle_core::Result<()> {
        Ok(())
    }
}

impl World {
    /// A pipelined all-to-all whose data is all ready: every chunk of `send` (placed by
    /// `plans`) is posted at once, and `on_arrival(c, values)` runs on chunk `c`'s values,
    /// received into `into[c]`, in chunk order, while the later chunks are still in flight.
    ///
    /// The chunks are posted last first (in the same order on every rank, as MPI requires
    /// of collectives): each chunk's request borrows its buffer only within its own scope, and
    /// the scopes nest, so chunk 0's closes first and its values can be read while the outer
    /// ones are still posted.
    pub fn exchange_then_compute(
        &self,
        kind: ExpertExchange,
        send: &[f32],
        plans: &[ChunkPlan],
        into: &mut [&mut [f32]],
        on_arrival: &mut OnArrival<'_>,
    ) -> candle_core::Result<()> {
        assert_eq!(plans.len(), into.len(), "one buffer per chunk");
        let (me, _) = self.position(Group::Expert);
        let Some(comm) = self.comm(Group::Expert) else {
            for (chunk, (plan, buffer)) in plans.iter().zip(into.iter_mut()).enumerate() {
                let start = plan.send_displs[0];
                buffer.copy_from_slice(&send[start..start + plan.send_counts[0]]);
                on_arrival(chunk, buffer)?;
            }
            return Ok(());
        };
        let posted: Vec<Posted> = plans.iter().map(Posted::from).collect();
        let mut clock = Clock::new(kind);
        let result = receive_chunks(comm, send, &posted, into, on_arrival, &mut clock);
        clock.finish(plans, me);
        result
    }

    /// A pipelined all-to-all whose data is made chunk by chunk: `work.produce(c)` makes
    /// chunk `c`'s send buffer, which is posted at once; `work.meanwhile(c)` then runs while it
    /// travels, and so does the making of the next chunk. Returns each chunk's received values.
    pub fn compute_then_exchange(
        &self,
        kind: ExpertExchange,
        plans: &[ChunkPlan],
        work: &mut dyn ChunkWork,
    ) -> candle_core::Result<Vec<Vec<f32>>> {
        let (me, _) = self.position(Group::Expert);
        let mut received: Vec<Vec<f32>> = vec![Vec::new(); plans.len()];
        let Some(comm) = self.comm(Group::Expert) else {
            for (chunk, (plan, buffer)) in plans.iter().zip(received.iter_mut()).enumerate() {
                let send = work.produce(chunk)?;
                let start = plan.send_displs[0];
                *buffer = send[start..start + plan.send_counts[0]].to_vec();
                work.meanwhile(chunk)?;
            }
            return Ok(received);
        };
        let posted: Vec<Posted> = plans.iter().map(Posted::from).collect();
        let mut clock = Clock::new(kind);
        let mut stage = SendStage {
            comm,
            work,
            clock: &mut clock,
        };
        let result = stage.send_chunks(&posted, 0, &mut received);
        clock.finish(plans, me);
        result.map(|()| received)
    }
}

/// Posts the last of `plans` first, then the others inside its scope; runs `on_arrival` on
/// each chunk once its scope has closed.
fn receive_chunks(
    comm: &SimpleCommunicator,
    send: &[f32],
    plans: &[Posted],
    into: &mut [&mut [f32]],
    on_arrival: &mut OnArrival<'_>,
    clock: &mut Clock,
) -> candle_core::Result<()> {
    let (Some((plan, earlier)), Some((buffer, earlier_buffers))) =
        (plans.split_last(), into.split_last_mut())
    else {
        return Ok(());
    };
    let outgoing = Partition::new(send, &plan.send_counts[..], &plan.send_displs[..]);
    let mut incoming = PartitionMut::new(
        &mut buffer[..],
        &plan.recv_counts[..],
        &plan.recv_displs[..],
    );
    let before = mpi::request::scope(|scope| {
        let request = clock
            .exposed(|| comm.immediate_all_to_all_varcount_into(scope, &outgoing, &mut incoming));
        let before =
            completing(|| receive_chunks(comm, send, earlier, earlier_buffers, on_arrival, clock));
        clock.exposed(|| yielding(request));
        clock.completed();
        before
    });
    resumed(before)?;
    on_arrival(earlier.len(), buffer)
}

/// What [`World::compute_then_exchange`] carries down its chunks.
struct SendStage<'s> {
    comm: &'s SimpleCommunicator,
    work: &'s mut dyn ChunkWork,
    clock: &'s mut Clock,
}

impl SendStage<'_> {
    /// Makes and posts the first of `plans`, then the others inside its scope.
    fn send_chunks(
        &mut self,
        plans: &[Posted],
        chunk: usize,
        received: &mut [Vec<f32>],
    ) -> candle_core::Result<()> {
        let (Some((plan, later)), Some((buffer, later_buffers))) =
            (plans.split_first(), received.split_first_mut())
        else {
            return Ok(());
        };
        let data = self.work.produce(chunk)?;
        *buffer = vec![0f32; plan.recv_counts.iter().map(|c| *c as usize).sum()];
        let outgoing = Partition::new(&data[..], &plan.send_counts[..], &plan.send_displs[..]);
        let mut incoming = PartitionMut::new(
            &mut buffer[..],
            &plan.recv_counts[..],
            &plan.recv_displs[..],
        );
        let comm = self.comm;
        let rest = mpi::request::scope(|scope| {
            let request = self.clock.exposed(|| {
                comm.immediate_all_to_all_varcount_into(scope, &outgoing, &mut incoming)
            });
            let rest = completing(|| {
                self.work
                    .meanwhile(chunk)
                    .and_then(|()| self.send_chunks(later, chunk + 1, later_buffers))
            });
            self.clock.exposed(|| yielding(request));
            self.clock.completed();
            rest
        });
        resumed(rest)
    }
}

/// This machine's host name, or "unknown".
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// `parts` nearly equal contiguous ranges of `0..len`, as `parts + 1` bounds.
pub fn even_bounds(len: usize, parts: usize) -> Vec<usize> {
    (0..=parts).map(|i| len * i / parts).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_world_makes_every_collective_the_identity() {
        let world = World::single();
        let data = [1.0f32, 2.0, 3.0];
        assert_eq!(*world.reduce_scatter(Group::World, &data, &[0, 3]), data);
        assert_eq!(*world.all_gather(Group::World, &data, &[0, 3]), data);
        assert_eq!(world.sum_f64(Group::World, &[1.5, 2.5]), [1.5, 2.5]);
        assert_eq!(world.position(Group::ExpertData), (0, 1));
        assert_eq!(even_bounds(10, 3), [0, 3, 6, 10]);
    }
}
