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
    /// write-then-abort program; with a 100 ms pause, in none.
    pub fn abort(&self, code: i32) {
        if let Some(comm) = self.comm(Group::World) {
            std::thread::sleep(std::time::Duration::from_millis(250));
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
        let mut sum = vec![0f32; mine];
        for contribution in received.chunks(mine.max(1)) {
            for (total, value) in sum.iter_mut().zip(contribution) {
                *total += value;
            }
        }
        Cow::Owned(sum)
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

    /// Variable all-to-all of f32 within a group: `send` holds the parts for rank 0, 1, ...
    /// back to back, `send_counts[i]` elements for rank `i`; returns what each rank sent here,
    /// in rank order, with the counts received from each.
    pub fn all_to_all_v(
        &self,
        group: Group,
        send: &[f32],
        send_counts: &[usize],
    ) -> (Vec<f32>, Vec<usize>) {
        let Some(comm) = self.comm(group) else {
            return (send.to_vec(), send_counts.to_vec());
        };
        let size = comm.size() as usize;
        assert_eq!(send_counts.len(), size);
        let counts: Vec<Count> = send_counts.iter().map(|c| count(*c)).collect();
        let mut recv_counts = vec![0 as Count; size];
        waiting(|| {
            mpi::request::scope(|scope| {
                yielding(comm.immediate_all_to_all_into(scope, &counts[..], &mut recv_counts[..]))
            })
        });
        let send_displs = displacements(&counts);
        let recv_displs = displacements(&recv_counts);
        let total: usize = recv_counts.iter().map(|c| *c as usize).sum();
        let mut received = vec![0f32; total];
        {
            let send = Partition::new(send, &counts[..], &send_displs[..]);
            let mut recv = PartitionMut::new(&mut received[..], &recv_counts[..], &recv_displs[..]);
            waiting(|| {
                mpi::request::scope(|scope| {
                    yielding(comm.immediate_all_to_all_varcount_into(scope, &send, &mut recv))
                })
            });
        }
        (received, recv_counts.iter().map(|c| *c as usize).collect())
    }
}

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

/// Rows of `width` floats that travel between the ranks of an expert-parallel group: out in
/// the forward pass ([`Dispatch`]) and back in the backward pass, or the reverse
/// ([`Combine`]). `send_rows[i]` rows go to rank `i`; `recv_rows[i]` come from it.
#[derive(Debug)]
pub struct Exchange {
    pub world: std::sync::Arc<World>,
    pub width: usize,
    pub send_rows: Vec<usize>,
    pub recv_rows: Vec<usize>,
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

/// Bytes this rank sent to and received from other ranks in expert exchanges, and the time
/// spent in them, since the process started.
static EXCHANGE_BYTES: AtomicU64 = AtomicU64::new(0);
static EXCHANGE_NANOS: AtomicU64 = AtomicU64::new(0);

/// `(bytes moved to or from other ranks, seconds)` of this rank's expert exchanges so far.
pub fn exchange_totals() -> (u64, f64) {
    (
        EXCHANGE_BYTES.load(Ordering::Relaxed),
        EXCHANGE_NANOS.load(Ordering::Relaxed) as f64 / 1e9,
    )
}

impl Exchange {
    fn run(&self, data: &[f32], rows: &[usize], expect: &[usize]) -> candle_core::Result<Vec<f32>> {
        let counts: Vec<usize> = rows.iter().map(|r| r * self.width).collect();
        let started = std::time::Instant::now();
        let (out, received) = self.world.all_to_all_v(Group::Expert, data, &counts);
        let me = self.world.ep_rank();
        let remote: usize = counts
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != me)
            .map(|(_, c)| c)
            .sum::<usize>()
            + received
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != me)
                .map(|(_, c)| c)
                .sum::<usize>();
        EXCHANGE_BYTES.fetch_add(4 * remote as u64, Ordering::Relaxed);
        EXCHANGE_NANOS.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let expected: Vec<usize> = expect.iter().map(|r| r * self.width).collect();
        if received != expected {
            return Err(candle_core::Error::Msg(format!(
                "expert exchange: received {received:?} values, expected {expected:?}"
            )));
        }
        Ok(out)
    }
}

fn exchange_op(
    exchange: &Exchange,
    storage: &candle_core::CpuStorage,
    layout: &candle_core::Layout,
    outbound: bool,
) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
    let candle_core::CpuStorage::F32(values) = storage else {
        return Err(candle_core::Error::Msg("expert exchange: f32 only".into()));
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("expert exchange: contiguous input only".into()))?;
    let (send, recv) = if outbound {
        (&exchange.send_rows, &exchange.recv_rows)
    } else {
        (&exchange.recv_rows, &exchange.send_rows)
    };
    let out = exchange.run(&values[start..end], send, recv)?;
    let rows = out.len() / exchange.width.max(1);
    Ok((
        candle_core::CpuStorage::F32(out),
        candle_core::Shape::from((rows, exchange.width)),
    ))
}

fn exchange_grad(
    exchange: &Exchange,
    grad: &candle_core::Tensor,
    outbound: bool,
) -> candle_core::Result<candle_core::Tensor> {
    let grad = grad.contiguous()?;
    let values: Vec<f32> = grad.flatten_all()?.to_vec1()?;
    let (send, recv) = if outbound {
        (&exchange.send_rows, &exchange.recv_rows)
    } else {
        (&exchange.recv_rows, &exchange.send_rows)
    };
    let out = exchange.run(&values, send, recv)?;
    let rows = out.len() / exchange.width.max(1);
    candle_core::Tensor::from_vec(out, (rows, exchange.width), &candle_core::Device::Cpu)
}

/// Sends each rank's rows to the ranks that hold their experts; the gradient goes back.
#[derive(Clone, Debug)]
pub struct Dispatch(pub std::sync::Arc<Exchange>);

/// Returns the experts' outputs to the ranks the rows came from; the gradient goes out.
#[derive(Clone, Debug)]
pub struct Combine(pub std::sync::Arc<Exchange>);

impl candle_core::CustomOp1 for Dispatch {
    fn name(&self) -> &'static str {
        "expert-dispatch"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let _span = tracing::info_span!("expert_dispatch").entered();
        exchange_op(&self.0, storage, layout, true)
    }

    fn bwd(
        &self,
        _arg: &candle_core::Tensor,
        _res: &candle_core::Tensor,
        grad: &candle_core::Tensor,
    ) -> candle_core::Result<Option<candle_core::Tensor>> {
        let _span = tracing::info_span!("expert_dispatch_backward").entered();
        exchange_grad(&self.0, grad, false).map(Some)
    }
}

impl candle_core::CustomOp1 for Combine {
    fn name(&self) -> &'static str {
        "expert-combine"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let _span = tracing::info_span!("expert_combine").entered();
        exchange_op(&self.0, storage, layout, false)
    }

    fn bwd(
        &self,
        _arg: &candle_core::Tensor,
        _res: &candle_core::Tensor,
        grad: &candle_core::Tensor,
    ) -> candle_core::Result<Option<candle_core::Tensor>> {
        let _span = tracing::info_span!("expert_combine_backward").entered();
        exchange_grad(&self.0, grad, true).map(Some)
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
