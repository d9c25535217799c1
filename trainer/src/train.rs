//! The single-process training loop: sample, forward, backward, clip, AdamW, log, validate,
//! checkpoint through the store library, and resume from the latest committed step.
//!
//! A checkpoint of step `s` holds, per parameter, the fp32 master weight and both Adam
//! moments, plus the blobs `trainer.json` (step, samples consumed, optimizer step) and
//! `model.json` (the model configuration, which `ckptctl export --format hf-olmoe` reads).
//! Restoring it
//! gives a bit-identical continuation: the data order is a pure function of (seed, sample
//! index) and nothing else is random after initialisation.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use candle_core::{DType, Tensor};
use lazarus_shared::format::DType as StoredDType;
use lazarus_shared::hf_olmoe;
use lazarus_shared::store::{
    row_major_runs, ByteSource, DeltaBases, OpenMode, RegionKind, RestoreChoice, RunStore,
    SourcedShard, Store, StoreOptions,
};
use lazarus_shared::{RunId, StepKey, StoreError};
// The progress stored with every checkpoint (`trainer.json`), with the layout that wrote it.
use lazarus_shared::progress::{SkippedData, TrainerProgress as TrainerState, TRAINER_BLOB};
use serde::Serialize;

use crate::config::Config;
use crate::data::{Dataset, Sampler};
use crate::dist::{Group, World};
use crate::model::Model;
use crate::optim::{learning_rate, AdamW, Part};
use crate::pipeline::StepFigures;
use crate::snapshot::{Ckptd, HeldSlots, StateMemory};
use crate::steplog::{Phase, StepLog};
use lazarus_shared::wire::{DataSkip, SdcFinding, SlotTensor};

/// Bad configuration or a run that must not be touched (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RefusedRun(pub String);

/// What a finished (or stopped) run reports.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub run: String,
    /// The store URL, resolved to an absolute path for file://.
    pub store: String,
    pub first_step: u64,
    pub last_step: u64,
    pub resumed_from: Option<u64>,
    pub losses: Vec<(u64, f64)>,
    pub last_checkpoint: Option<u64>,
    pub parameters: usize,
    pub optimizer_bytes: u64,
    pub stopped_by_signal: bool,
}

/// `file://relative/path` is taken relative to the working directory.
fn resolve_store_url(url: &str) -> Result<String> {
    match url.strip_prefix("file://") {
        Some(path) if !path.starts_with('/') => {
            let absolute = std::env::current_dir()?.join(path.trim_start_matches("./"));
            Ok(format!("file://{}", absolute.display()))
        }
        _ => Ok(url.to_string()),
    }
}

/// The copy of the optimizer state an in-process save writes and keeps as the next save's
/// delta base, little endian, in an anonymous map. A foreground save copies the state into a
/// map of its own; the map of the save before is reused once its base is no longer needed: a
/// fresh 472 MB buffer for the `tiny` preset's state cost about 0.9 s of a 1.6-2.0 s save in
/// page faults on a virtual machine whose host takes freed memory back, where the copy itself
/// takes a tenth of that. Between saves the spare map is given back lazily (`MADV_FREE`): the
/// kernel takes its pages only when it needs the memory. A background save copies nothing: its
/// map is the state's own, shared ([`StateMemory::share_current`]).
#[derive(Clone)]
struct StateCopy(Arc<memmap2::MmapMut>);

impl StateCopy {
    /// `values` as little-endian bytes, in `spare` where it has their size.
    fn of(values: &[f32], spare: Option<memmap2::MmapMut>) -> std::io::Result<Self> {
        let len = std::mem::size_of_val(values);
        let mut map = match spare {
            Some(map) if map.len() == len => map,
            _ => memmap2::MmapMut::map_anon(len)?,
        };
        // On the math pool's threads, in a piece each: the training loop waits for the copy,
        // and one core's copy is bound by that core, not by the memory.
        use rayon::prelude::*;
        let piece = len
            .div_ceil(rayon::current_num_threads())
            .next_multiple_of(4)
            .max(4);
        let from: &[u8] = bytemuck::cast_slice(values);
        map.par_chunks_mut(piece)
            .zip(from.par_chunks(piece))
            .for_each(|(to, from)| {
                to.copy_from_slice(from);
                if cfg!(target_endian = "big") {
                    to.chunks_exact_mut(4).for_each(<[u8]>::reverse);
                }
            });
        Ok(Self(Arc::new(map)))
    }

    /// The copy's bytes, read without a copy; the map is not spare while any of them live.
    fn bytes(&self) -> Bytes {
        Bytes::from_owner(self.clone())
    }

    /// The map, once nothing else reads it (nor, for a shared one, the state's memory); its
    /// pages are kept.
    fn into_kept(self) -> Option<memmap2::MmapMut> {
        Arc::into_inner(self.0)
    }

    /// The map, to be overwritten by a later save, once nothing else reads it.
    fn into_spare(self) -> Option<memmap2::MmapMut> {
        let map = self.into_kept()?;
        // SAFETY: `MADV_FREE` may replace the map's pages with zeros at any time; the map is
        // only written (whole, by `of`) before it is read again.
        #[allow(unsafe_code)]
        let advised = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::Free) };
        if let Err(error) = advised {
            tracing::debug!(%error, "MADV_FREE of the spare state copy");
        }
        Some(map)
    }
}

impl AsRef<[u8]> for StateCopy {
    fn as_ref(&self) -> &[u8] {
        &self.0[..]
    }
}

/// Little-endian floats from the store into `values`, which holds as many.
fn floats_from_bytes(values: &mut [f32], bytes: &[u8]) {
    for (value, le) in values.iter_mut().zip(bytes.chunks_exact(4)) {
        *value = f32::from_le_bytes([le[0], le[1], le[2], le[3]]);
    }
}

/// This rank's layout: for each parameter its weight and both moments, each stored as one
/// global tensor of the model's shape, of which this rank holds the block of its tensor- or
/// expert-parallel split and writes the run of it that its optimizer shard holds (as
/// rectangles of the global tensor, [`row_major_runs`]), as byte ranges of the state memory
/// (what a `ckptd` slot holds a copy of); and the state's size. A tensor-parallel group's
/// replicated parameters are stored by its first rank and only read by the others. Any layout
/// can read any other layout's regions back.
fn slot_layout(optim: &AdamW, tp_rank: usize) -> (Vec<SlotTensor>, u64) {
    let as_u64 = |values: &[usize]| values.iter().map(|v| *v as u64).collect::<Vec<u64>>();
    let mut tensors = Vec::new();
    for shard in &optim.shards {
        for (placement, range) in optim.pieces(shard) {
            let kind = if placement.replicated_over_tp && tp_rank != 0 {
                RegionKind::Read
            } else {
                RegionKind::Stored
            };
            let run =
                (range.start - placement.offset) as u64..(range.end - placement.offset) as u64;
            let global_shape = as_u64(&placement.global_shape);
            let rectangles = row_major_runs(
                &as_u64(&placement.shape),
                &as_u64(&placement.global_start),
                run,
            );
            // A shard manifest holds one slice of each tensor: the optimizer's shards are cut
            // at whole rows of each parameter.
            assert_eq!(rectangles.len(), 1, "{}: {rectangles:?}", placement.name);
            for (slice, elements) in rectangles {
                // The rectangle's elements, relative to the start of the shard's part.
                let first = placement.offset + elements.start as usize - shard.mine.start;
                let local = first..first + (elements.end - elements.start) as usize;
                for part in Part::ALL {
                    let elements = shard.range(part, local.clone());
                    tensors.push(SlotTensor {
                        name: format!("{}{}", placement.name, part.suffix()),
                        dtype: StoredDType::F32,
                        global_shape: global_shape.clone(),
                        slice: slice.clone(),
                        offset: 4 * elements.start as u64,
                        bytes: 4 * elements.len() as u64,
                        kind,
                    });
                }
            }
        }
    }
    (tensors, 4 * optim.state_len() as u64)
}

/// Where this rank's checkpoints go. The training loop asks it at every step (heartbeat,
/// held slots, busy, save, finish) and never branches on which kind it has.
enum Saver {
    /// This process writes its shard to the store; rank 0 commits once every shard is in.
    Store(StoreSaver),
    /// The node's `ckptd` takes snapshots out of the shm slots it owns.
    Ckptd(Box<CkptdSaver>),
}

/// What this process keeps between its own saves to the store.
#[derive(Default)]
struct StoreSaver {
    /// The last checkpoint's data, for delta encoding.
    bases: Option<DeltaBases>,
    /// The copy of the state the bases read.
    held: Option<StateCopy>,
    /// A copy no longer read, for the next save to overwrite.
    spare: Option<memmap2::MmapMut>,
    /// The checkpoint being written in the background (`checkpoint.background`), not yet
    /// committed.
    writing: Option<ShardWrite>,
    /// Checkpoints not taken because the one before was still being written.
    skipped: u64,
    /// With background saves, seconds the run's last checkpoint (written in the foreground)
    /// took; not counted among the loop's stalls. 0 before it.
    last_wait: f64,
}

/// One rank's shard of a checkpoint on its way to the store.
struct ShardWrite {
    key: StepKey,
    /// This rank's layout of the state, which the copy's delta bases are read by.
    layout: Vec<SlotTensor>,
    /// The state the shard is written from (a copy, or the state's shared map); the next
    /// save's delta base.
    copy: StateCopy,
    /// The write, on the run's runtime.
    task: tokio::task::JoinHandle<Result<lazarus_shared::format::ShardManifest, StoreError>>,
    /// When the state was taken.
    started: Instant,
}

/// A rank's checkpointing through its node's `ckptd`.
struct CkptdSaver {
    client: Ckptd,
    /// How long the last snapshot held the training loop.
    last_stall: std::time::Duration,
    /// What the last [`Session::busy`] poll spent waiting for a CPU and for the daemon's
    /// answer (parts of the stall).
    poll_waits: (std::time::Duration, std::time::Duration),
    skipped: u64,
    /// Seconds the run's last snapshot took: it waits for a daemon still busy with the step
    /// before, so it is not counted among the loop's stalls. 0 before it.
    last_wait: f64,
    /// When the last per-step heartbeat went, and this rank's time inside collectives then.
    heartbeat_mark: (Instant, f64),
}

/// How long one checkpoint or snapshot held the training loop, and what it waited for.
#[derive(Clone, Copy, Debug, Default)]
struct Stall {
    step: u64,
    /// Seconds the loop stood still.
    seconds: f64,
    /// Of them, seconds this thread was ready to run but waited for a CPU.
    cpu_wait: f64,
    /// Of them, seconds this thread was blocked reading the daemon's answers (to a poll, or
    /// to the hand-over before, read before the next request is written).
    answer_wait: f64,
}

impl Stall {
    /// The figures one rank gathers per stall, in this order.
    const FIGURES: usize = 3;

    fn figures(&self) -> [f64; Self::FIGURES] {
        [self.seconds, self.cpu_wait, self.answer_wait]
    }

    /// The stall of `step` from its [`Stall::figures`].
    fn from_figures(step: u64, figures: &[f64]) -> Self {
        Self {
            step,
            seconds: figures[0],
            cpu_wait: figures[1],
            answer_wait: figures[2],
        }
    }

    fn by_seconds(a: &Stall, b: &Stall) -> std::cmp::Ordering {
        a.seconds.total_cmp(&b.seconds)
    }
}

/// The held slots of a saver that has none (the store's: the state is one heap buffer).
static NO_SLOTS_HELD: HeldSlots = HeldSlots::NONE;

impl Saver {
    /// The slots an optimizer update must not write.
    fn held(&self) -> &HeldSlots {
        match self {
            Saver::Store(_) => &NO_SLOTS_HELD,
            Saver::Ckptd(saver) => saver.client.held(),
        }
    }
}

/// Holds the training state and the things it reads and writes.
struct Session {
    world: Arc<World>,
    config: Config,
    model: Model,
    optim: AdamW,
    run: RunStore,
    runtime: tokio::runtime::Runtime,
    state: TrainerState,
    saver: Saver,
    /// Per checkpoint or snapshot, how long the training loop stood still for it.
    stalls: Vec<Stall>,
    /// This (the training) thread's wait for a CPU, for the stalls.
    cpu_wait: crate::trace::CpuWait,
    /// Seconds of the pipeline steps so far, and of them waiting on neighbouring stages.
    pipeline_seconds: f64,
    pipeline_wait: f64,
    /// The most activation bytes a step held, over the steps after this process's first
    /// (whose buffers that live on, such as the kernels' scratch, would count as activations).
    activation_bytes: Option<usize>,
    steps_run: u64,
    /// The data the supervisor says to skip after the step it rolled the run back to.
    skip_offered: Option<DataSkip>,
    /// `(step, loss)` the run had before at the step after each step the leader offered,
    /// agreed over the ranks; emptied when the restored state's layout differs (another
    /// global batch, another loss).
    expected_losses: Vec<(u64, f64)>,
    /// The loss of the newest step, for the next heartbeat.
    last_loss: Option<f64>,
    /// The newest step checkpointed: written to the store, or taken by the daemon (whose
    /// answer to an in-loop hand-over is read with the next request).
    checkpointed: Option<u64>,
}

impl Session {
    /// How long the loop stood still for its checkpoints or snapshots, if it took any: each
    /// checkpoint's slowest rank (the others wait for it at the next collective), and how much
    /// of that rank's stall it spent ready to run but waiting for a CPU (other processes on
    /// its cores, the daemon's work among them) and blocked on the daemon's answers. Collective: every rank checkpointed the same
    /// steps. The run's last snapshot through `ckptd` waits for a daemon still busy with the
    /// step before (the last step must be taken), and with background saves the run's last
    /// checkpoint is written in the foreground: its time is given on its own, not counted.
    fn report_stalls(&self, log: &mut dyn Write) -> Result<()> {
        let n = self.stalls.len();
        let counts = self.world.all_gather_f64(Group::World, &[n as f64]);
        if n == 0 || counts.iter().any(|c| *c as usize != n) {
            return Ok(());
        }
        let last_wait = match &self.saver {
            Saver::Ckptd(saver) => saver.last_wait,
            Saver::Store(saver) => saver.last_wait,
        };
        let mut mine: Vec<f64> = self.stalls.iter().flat_map(Stall::figures).collect();
        mine.push(last_wait);
        let all = self.world.all_gather_f64(Group::World, &mine);
        let per_rank = Stall::FIGURES * n + 1;
        let last_wait = all
            .chunks(per_rank)
            .map(|rank| rank[per_rank - 1])
            .fold(0.0, f64::max);
        // Per checkpoint, the slowest rank's stall. Every rank's stalls are of the same
        // steps, in order.
        let slowest: Vec<Stall> = self
            .stalls
            .iter()
            .enumerate()
            .filter_map(|(i, own)| {
                all.chunks(per_rank)
                    .map(|rank| Stall::from_figures(own.step, &rank[Stall::FIGURES * i..]))
                    .max_by(Stall::by_seconds)
            })
            .collect();
        let total = slowest.iter().map(|s| s.seconds).sum::<f64>();
        let max = slowest
            .iter()
            .copied()
            .max_by(Stall::by_seconds)
            .unwrap_or_default();
        let mut sorted: Vec<f64> = slowest.iter().map(|s| s.seconds).collect();
        sorted.sort_by(f64::total_cmp);
        let share = |part: fn(&Stall) -> f64| {
            100.0 * slowest.iter().map(part).sum::<f64>() / total.max(f64::MIN_POSITIVE)
        };
        let last = if last_wait > 0.0 {
            let what = match self.saver {
                Saver::Ckptd(_) => "snapshot, which waits for a daemon busy with the step before",
                Saver::Store(_) => "checkpoint, written in the foreground",
            };
            format!(
                "; the run's last {what}, {:.3} ms (not counted)",
                last_wait * 1e3
            )
        } else {
            String::new()
        };
        writeln!(
            log,
            "checkpoint stall ({}) over {n} in-loop checkpoints, slowest rank each: mean {:.3} ms, median {:.3} ms, max {:.3} ms at step {} (of it {:.3} ms waiting for a CPU and {:.3} ms for the daemon's answers; {:.0}% and {:.0}% of all stall time), state {} bytes per rank{last}",
            self.saver_name(),
            total / n as f64 * 1e3,
            sorted[n / 2] * 1e3,
            max.seconds * 1e3,
            max.step,
            max.cpu_wait * 1e3,
            max.answer_wait * 1e3,
            share(|s| s.cpu_wait),
            share(|s| s.answer_wait),
            4 * self.optim.state_len()
        )?;
        Ok(())
    }

    /// The saver through the store, which only a run without `ckptd` checkpoints with.
    fn store_saver(&mut self) -> &mut StoreSaver {
        match &mut self.saver {
            Saver::Store(saver) => saver,
            Saver::Ckptd(_) => {
                unreachable!("a checkpoint through the store needs the store's saver")
            }
        }
    }

    /// Writes this rank's shard of the current step and commits the step once every rank's
    /// is stored. Collective.
    fn checkpoint(&mut self, log: &mut dyn Write) -> Result<()> {
        let write = self.start_write()?;
        self.finish_write(write, log)
    }

    /// Takes the state (a copy of it, or, with background saves, its own shared map) and
    /// starts writing this rank's shard of the current step from it, against the last
    /// checkpoint's delta bases, on the run's runtime.
    fn start_write(&mut self) -> Result<ShardWrite> {
        let started = Instant::now();
        let timeline = self.runtime.block_on(self.run.current_timeline())?;
        let key = StepKey::new(self.state.step, timeline);
        let (layout, _) = slot_layout(&self.optim, self.world.coords().tp);
        let copy = match self.optim.memory.share_current() {
            // Background saves write from the state's own map, which the next update leaves.
            Some(map) => StateCopy(map),
            None => {
                let spare = self.store_saver().spare.take();
                StateCopy::of(self.optim.memory.current(), spare)?
            }
        };
        let saver = self.store_saver();
        let bases = saver.bases.take();
        let state: Arc<dyn ByteSource> = Arc::new(copy.bytes());
        let blobs = if self.world.rank == 0 {
            Session::blobs_of(&self.state, &self.config)?
        } else {
            Vec::new()
        };
        let shard = SourcedShard::from_regions(
            key,
            self.world.rank as u32,
            self.world.size as u32,
            &layout,
            &state,
            blobs,
        );
        let run = self.run.clone();
        let refused = self.config.test_faults.as_ref().is_some_and(|f| {
            f.save_fail_at_step == key.step && f.save_fail_rank as usize == self.world.rank
        });
        let task = self.runtime.spawn(async move {
            if refused {
                return Err(StoreError::Io {
                    path: format!("test_faults.save_fail_at_step = {}", key.step),
                    cause: std::io::ErrorKind::PermissionDenied.into(),
                });
            }
            run.write_shard_sourced(shard, bases.as_ref(), &()).await
        });
        Ok(ShardWrite {
            key,
            layout,
            copy,
            task,
            started,
        })
    }

    /// Waits for this rank's shard of `write`, agrees with the other ranks that every shard
    /// is stored, and commits the step (rank 0). The copy it was written from becomes the
    /// next save's delta base. Rank 0 logs the commit. Collective.
    fn finish_write(&mut self, write: ShardWrite, log: &mut dyn Write) -> Result<()> {
        let written = match self.runtime.block_on(write.task) {
            Ok(written) => written.map_err(anyhow::Error::from),
            Err(error) => Err(anyhow::anyhow!("the shard write did not finish: {error}")),
        };
        // Every rank learns whether any shard failed, and leaves here the same way.
        let failed = self
            .world
            .sum_u64(Group::World, &[u64::from(written.is_err())])[0];
        let manifest =
            written.with_context(|| format!("writing this rank's shard of step {}", write.key))?;
        if failed > 0 {
            bail!(
                "{failed} rank(s) could not write their shard of step {}; it is not committed",
                write.key
            );
        }
        if self.world.rank == 0 {
            let record = self
                .runtime
                .block_on(self.run.commit(write.key, self.world.size as u32))?;
            let when = if write.key.step == self.state.step {
                String::new()
            } else {
                format!(" at step {}", self.state.step)
            };
            writeln!(
                log,
                "checkpoint: step {} committed{when}, {:.3} s after its state was taken: {:.1} MB of state, {:.1} MB written (its new chunks, encoded)",
                write.key.step,
                write.started.elapsed().as_secs_f64(),
                record.raw_bytes() as f64 / 1e6,
                record.uploaded_bytes() as f64 / 1e6
            )?;
        }
        self.world.barrier();
        let saver = self.store_saver();
        let chunks = manifest.tensors.into_iter().map(|t| t.chunks).collect();
        let state: Arc<dyn ByteSource> = Arc::new(write.copy.bytes());
        saver.bases = DeltaBases::of_regions(&write.layout, &state, chunks);
        // The bases of the save before, which read the held copy, are gone. A copy that is
        // one of the state's shared maps goes back to the updates (`into_spare` finds it
        // still shared and keeps nothing).
        saver.spare = saver
            .held
            .replace(write.copy)
            .and_then(StateCopy::into_spare);
        self.checkpointed = Some(write.key.step);
        Ok(())
    }

    /// Commits the checkpoint being written in the background, waiting for it if it is not
    /// stored yet; nothing if there is none. Collective: every rank has one or none.
    fn settle_write(&mut self, log: &mut dyn Write) -> Result<()> {
        let Saver::Store(saver) = &mut self.saver else {
            return Ok(());
        };
        match saver.writing.take() {
            Some(write) => self.finish_write(write, log),
            None => Ok(()),
        }
    }

    /// Before the loop: with background saves through the store, the state moves into three
    /// shared maps ([`StateMemory::into_shared`]), faulted in here, off the loop: a save writes
    /// from the state's own map and the update after it writes the next state into another,
    /// so the loop never waits for a copy. Little-endian machines only, where the state's
    /// bytes are the store's.
    fn prepare_saves(&mut self) -> Result<()> {
        let background = self.config.checkpoint.background && cfg!(target_endian = "little");
        if let (true, Saver::Store(_)) = (background, &self.saver) {
            let memory = std::mem::replace(&mut self.optim.memory, StateMemory::heap(Vec::new()));
            self.optim.memory = memory
                .into_shared(3)
                .context("mapping the copies of the state that background saves share")?;
        }
        Ok(())
    }

    /// Takes the progress of a restored step (this launch's layout stays), and the model
    /// routes with the step's bias.
    fn continue_from(&mut self, state: TrainerState) {
        self.state = TrainerState {
            layout: self.state.layout.take(),
            ..state
        };
        self.model.set_router_bias(&self.state.router_bias);
    }

    /// Whether a checkpoint is being written in the background (on every rank alike).
    fn writing(&self) -> bool {
        matches!(&self.saver, Saver::Store(saver) if saver.writing.is_some())
    }

    /// Loads the latest committed step into the model and optimizer, if the run has one. Each
    /// rank reads the regions of the flattened tensors its shards cover, whatever layout wrote
    /// them.
    fn resume(&mut self) -> Result<Option<u64>> {
        let Some(latest) = self.runtime.block_on(self.run.latest())? else {
            return Ok(None);
        };
        let checkpoint = self.runtime.block_on(self.run.open_checkpoint(latest))?;
        let state: TrainerState = serde_json::from_slice(
            &self
                .runtime
                .block_on(checkpoint.read_blob(0, TRAINER_BLOB))?,
        )
        .context("trainer.json in the checkpoint")?;
        let (layout, _) = slot_layout(&self.optim, self.world.coords().tp);
        let state_floats = self.optim.memory.current_mut(&HeldSlots::default());
        let read = self
            .runtime
            .block_on(checkpoint.read_regions(&layout, &(), |region, data| {
                let start = region.offset as usize / 4;
                floats_from_bytes(&mut state_floats[start..start + data.len() / 4], &data);
                Ok::<(), StoreError>(())
            }));
        read.map_err(|error| match error {
            // A tensor missing or shaped otherwise: the run belongs to another trainer.
            StoreError::BadRequest { reason } => anyhow::Error::new(RefusedRun(reason)),
            other => other.into(),
        })?;
        self.optim.step = state.optimizer_step;
        self.optim.write_to(&self.model)?;
        // Delta bases only where this rank wrote the same slices before.
        self.saver = Saver::Store(StoreSaver::default());
        self.continue_from(state);
        Ok(Some(latest.step))
    }

    /// Connects to the node's `ckptd`, moves the optimizer state into its slots, and restores
    /// the step it serves (from T0, T1 or T2), if any. Returns the step and tier.
    fn attach_ckptd(
        &mut self,
        socket: &Path,
        run: &RunId,
        restore: bool,
    ) -> Result<Option<(u64, lazarus_shared::wire::Tier)>> {
        let (tensors, slot_bytes) = slot_layout(&self.optim, self.world.coords().tp);
        let mut ckptd = Ckptd::connect(
            socket,
            run.clone(),
            self.world.rank as u32,
            self.world.size as u32,
            tensors,
            slot_bytes,
        )?;
        let restored = if restore {
            self.agree_and_restore(&mut ckptd)?
        } else {
            None
        };
        let fresh = self.optim.memory.current().to_vec();
        self.optim.memory = StateMemory::mapped(
            &ckptd.slots,
            ckptd.held(),
            &fresh,
            restored.as_ref().map(|r| r.slot),
        )?;
        let result = match restored {
            Some(restored) => {
                let trainer = restored
                    .blobs
                    .iter()
                    .find(|(name, _)| name == TRAINER_BLOB)
                    .ok_or_else(|| {
                        anyhow::anyhow!("ckptd served step {} without trainer.json", restored.step)
                    })?;
                let state: TrainerState =
                    serde_json::from_slice(&trainer.1).context("trainer.json from ckptd")?;
                if state.step != restored.step {
                    bail!(
                        "ckptd served step {} but its trainer.json says {}",
                        restored.step,
                        state.step
                    );
                }
                self.optim.step = state.optimizer_step;
                self.optim.write_to(&self.model)?;
                if state.layout != self.state.layout {
                    self.expected_losses.clear();
                }
                self.continue_from(state);
                Some((restored.step, restored.tier))
            }
            None => None,
        };
        self.saver = Saver::Ckptd(Box::new(CkptdSaver {
            client: ckptd,
            last_stall: std::time::Duration::ZERO,
            poll_waits: Default::default(),
            skipped: 0,
            last_wait: 0.0,
            heartbeat_mark: (Instant::now(), crate::dist::communication_seconds()),
        }));
        Ok(result)
    }

    /// Every rank restores the same step: the newest memory-committed step any daemon was
    /// told of (each rank has it in T0 or its buddy's T1), unless a durable step is newer. If
    /// any rank cannot get it, all fall back to the newest durable step (T2).
    fn agree_and_restore(
        &mut self,
        ckptd: &mut Ckptd,
    ) -> Result<Option<crate::snapshot::Restored>> {
        let choice = ckptd.choose()?;
        let (memory, durable, skip) = (choice.memory, choice.durable, choice.skip);
        // Every rank compares with the same figures: the first rank's that has them.
        let mine: Vec<f64> = (0..2)
            .flat_map(|i| match choice.losses.get(i) {
                Some((step, loss)) => [1.0, *step as f64, *loss],
                None => [0.0; 3],
            })
            .collect();
        let all = self.world.all_gather_f64(Group::World, &mine);
        self.expected_losses = all
            .chunks(6)
            .find(|r| r[0] > 0.0 || r[3] > 0.0)
            .map(|r| {
                r.chunks(3)
                    .filter(|e| e[0] > 0.0)
                    .map(|e| (e[1] as u64, e[2]))
                    .collect()
            })
            .unwrap_or_default();
        let encode = |step: Option<u64>| step.map_or(0.0, |s| s as f64 + 1.0);
        let newest = |value: Option<u64>| -> Option<u64> {
            let all = self.world.all_gather_f64(Group::World, &[encode(value)]);
            let max = all.into_iter().fold(0.0, f64::max);
            (max > 0.0).then(|| max as u64 - 1)
        };
        let (memory, durable) = (newest(memory), newest(durable));
        let after_step = newest(skip.map(|s| s.after_step));
        let batches = newest(skip.map(|s| s.batches));
        self.skip_offered = after_step
            .zip(batches)
            .map(|(after_step, batches)| DataSkip {
                after_step,
                batches,
            });
        let memory = RestoreChoice::new(memory, durable).memory();
        let failed = |result: &Result<_>| -> bool {
            let mine = f64::from(u8::from(result.is_err()));
            self.world.sum_f64(Group::World, &[mine])[0] > 0.0
        };
        let first = ckptd.restore(memory, durable);
        if !failed(&first) || memory.is_none() {
            return first;
        }
        if let Err(error) = &first {
            tracing::warn!(error = %format!("{error:#}"), "memory-committed step {memory:?} is not restorable everywhere; falling back to durable step {durable:?}");
        }
        ckptd.restore(None, durable)
    }

    /// The step's forward and backward passes over this rank's `tokens` (`batch` samples),
    /// through the pipeline's micro-batches; the gradients wait in the optimizer. Adds their
    /// seconds to the step log's forward and backward times.
    fn gradients(
        &mut self,
        tokens: &[u32],
        batch: usize,
        step_log: &mut StepLog,
    ) -> Result<StepFigures> {
        let figures =
            crate::pipeline::train_step(&self.model, &self.world, &mut self.optim, tokens, batch)?;
        step_log.time(Phase::Forward, figures.forward_seconds);
        step_log.time(Phase::Backward, figures.backward_seconds);
        self.pipeline_wait += figures.pipeline_wait_seconds;
        self.pipeline_seconds += figures.seconds;
        self.steps_run += 1;
        if self.steps_run > 1 {
            let peak = self.activation_bytes.unwrap_or(0);
            self.activation_bytes = Some(peak.max(figures.activation_bytes));
        }
        Ok(figures)
    }

    /// Step `step` failed the health check: nothing of it is saved. Under ckptd the daemon
    /// tells the supervisor, which stops the world and rolls it back; the rank waits for
    /// that (`health.stop_wait_seconds`), and gives up with the error.
    fn went_bad(
        &mut self,
        step: u64,
        reason: &str,
        (sdc, restored): (Option<SdcFinding>, Option<u64>),
        log: &mut dyn Write,
    ) -> anyhow::Error {
        let error = if sdc.is_some() || restored.is_some() {
            anyhow::anyhow!("step {step} failed the health check: {reason}")
        } else {
            anyhow::anyhow!(
                "step {step} failed the health check: {reason}; lower train.lr or check the data"
            )
        };
        if let Saver::Ckptd(saver) = &mut self.saver {
            let wait = self.config.health.stop_wait_seconds;
            let _ = writeln!(
                log,
                "step {step} failed the health check ({reason}); waiting up to {wait} s for the supervisor to roll the run back"
            );
            if saver.client.unhealthy(step, reason, sdc, restored).is_ok() {
                std::thread::sleep(std::time::Duration::from_secs_f64(wait));
            }
        }
        error
    }

    /// The rank's heartbeat to `ckptd`, once a step before the update, with its own compute
    /// time since the last one. It does not wait for the answer: the update goes by the held
    /// slots of the answers come so far (the daemon takes no slot the rank did not hand over,
    /// so they hold at least what it holds), then by the daemon's word, and waits for the
    /// daemon's answers only when those leave it no free slot.
    fn heartbeat(&mut self) {
        let Saver::Ckptd(saver) = &mut self.saver else {
            return;
        };
        let communication = crate::dist::communication_seconds();
        let (since, waited) =
            std::mem::replace(&mut saver.heartbeat_mark, (Instant::now(), communication));
        let compute = since
            .elapsed()
            .saturating_sub(std::time::Duration::from_secs_f64(communication - waited));
        // A daemon that does not answer keeps its last word on the held slots.
        let _ = saver
            .client
            .heartbeat(self.state.step, compute, self.last_loss);
        if !self.optim.memory.has_free_slot(saver.client.held()) {
            saver.client.read_held();
        }
        if !self.optim.memory.has_free_slot(saver.client.held()) {
            let _ = saver.client.settle();
        }
        self.take_answers();
    }

    /// Counts the hand-overs the daemon answered since the last call: the newest taken is
    /// the newest checkpoint; one not taken was skipped.
    fn take_answers(&mut self) {
        let Saver::Ckptd(saver) = &mut self.saver else {
            return;
        };
        for (step, taken) in saver.client.take_answers() {
            if taken {
                self.checkpointed = self.checkpointed.max(Some(step));
            } else {
                saver.skipped += 1;
            }
        }
    }

    /// Whether this rank's saver is busy with an earlier checkpoint, and how long asking took.
    /// A daemon with a hand-over not yet answered is busy; otherwise its busy word says, and
    /// it is asked only if it keeps none (or the answers so far leave too few slots free for
    /// the word to be enough). The loop then waits for no answer of the daemon between the
    /// step's end and the hand-over.
    fn busy(&mut self, step: u64) -> (bool, std::time::Duration) {
        let saver = match &mut self.saver {
            Saver::Ckptd(saver) => saver,
            Saver::Store(saver) => {
                let held_for = self
                    .config
                    .test_faults
                    .as_ref()
                    .map_or(0, |f| f.save_busy_steps);
                let busy = saver
                    .writing
                    .as_ref()
                    .is_some_and(|w| !w.task.is_finished() || step < w.key.step + held_for);
                return (busy, std::time::Duration::ZERO);
            }
        };
        saver.client.take_arrived();
        if let Some(busy) = saver.client.busy_now() {
            return (busy, std::time::Duration::ZERO);
        }
        let started = Instant::now();
        let (waited, answered) = (self.cpu_wait.now(), saver.client.answer_wait());
        let busy = saver
            .client
            .poll(step, std::time::Duration::ZERO, None)
            .unwrap_or(true);
        saver.poll_waits = (
            self.cpu_wait.now().saturating_sub(waited),
            saver.client.answer_wait().saturating_sub(answered),
        );
        (busy, started.elapsed())
    }

    /// Checkpoints the current step; `any_busy` and `poll_time` come from [`Session::busy`],
    /// summed over the ranks. Commits are logged to `log`.
    fn save(
        &mut self,
        last: bool,
        (any_busy, poll_time): (bool, std::time::Duration),
        log: &mut dyn Write,
    ) -> Result<()> {
        if let Saver::Ckptd(_) = self.saver {
            return self.snapshot(last, Some((any_busy, poll_time)));
        }
        let started = Instant::now();
        let waited = self.cpu_wait.now();
        let background = self.config.checkpoint.background && !last;
        let skip = background && any_busy && self.config.checkpoint.busy == "skip";
        if skip {
            self.store_saver().skipped += 1;
        } else {
            self.settle_write(log)?;
            let write = self.start_write()?;
            if background {
                self.store_saver().writing = Some(write);
            } else {
                self.finish_write(write, log)?;
            }
        }
        let stall = Stall {
            step: self.state.step,
            seconds: (started.elapsed() + poll_time).as_secs_f64(),
            cpu_wait: self.cpu_wait.now().saturating_sub(waited).as_secs_f64(),
            answer_wait: 0.0,
        };
        match &mut self.saver {
            Saver::Store(saver) if last && self.config.checkpoint.background => {
                saver.last_wait = stall.seconds;
            }
            _ => self.stalls.push(stall),
        }
        Ok(())
    }

    /// At a step with no checkpoint due: commits the checkpoint written in the background
    /// once no rank is still writing it (`any_busy`, agreed in the step's sums), and counts
    /// the loop's time for it in that checkpoint's stall.
    fn settle_in_loop(&mut self, any_busy: bool, log: &mut dyn Write) -> Result<()> {
        if any_busy || !self.writing() {
            return Ok(());
        }
        let started = Instant::now();
        let waited = self.cpu_wait.now();
        self.settle_write(log)?;
        // A checkpoint skipped meanwhile has a stall of its own, after this one's.
        let settled = self.checkpointed;
        if let Some(stall) = self
            .stalls
            .iter_mut()
            .rev()
            .find(|s| Some(s.step) == settled)
        {
            stall.seconds += started.elapsed().as_secs_f64();
            stall.cpu_wait += self.cpu_wait.now().saturating_sub(waited).as_secs_f64();
        }
        Ok(())
    }

    /// At the end of the run: checkpoints the last step if it is not yet, and (with `ckptd`)
    /// waits until the daemon has it and says goodbye. Returns the step checkpointed now.
    ///
    /// Whether the last step still needs a checkpoint is summed over the ranks: a daemon that
    /// died after the others took the last snapshot leaves this rank without it, and the
    /// final snapshot (collectives inside) must be taken by every rank or by none.
    fn finish(&mut self, log: &mut dyn Write) -> Result<()> {
        let step = self.state.step;
        if let Saver::Ckptd(saver) = &mut self.saver {
            // The answer to the loop's last hand-over, if it was not read yet (a failure is
            // among the answers).
            let _ = saver.client.settle();
        }
        self.take_answers();
        // The checkpoint written in the background, if any, is committed before the last.
        self.settle_write(log)?;
        let lacking = self.checkpointed != Some(step) && step > 0;
        let due = self.world.sum_u64(Group::World, &[u64::from(lacking)])[0] > 0;
        if let Saver::Store(saver) = &self.saver {
            if saver.skipped > 0 {
                writeln!(
                    log,
                    "in-process save: {} checkpoints skipped while the one before was still being written",
                    saver.skipped
                )?;
            }
            if due {
                self.checkpoint(log)?;
            }
            return Ok(());
        }
        if due {
            self.snapshot(true, None)?;
        }
        // Leave once the daemon has the last snapshot in T0 and T1 and, as asked, in T2.
        self.drain_ckptd();
        // A daemon drops a snapshot no memory commit came for (no leader at that moment, a
        // buddy that went away): then the last step is handed over again. A rank that said
        // goodbye without its last step committed would end a run whose end is lost.
        let deadline = Instant::now() + FINAL_COMMIT_WITHIN;
        while step > 0 && self.final_uncommitted(step) {
            let expired = Instant::now() >= deadline;
            if self.world.sum_u64(Group::World, &[u64::from(expired)])[0] > 0 {
                bail!(
                    "step {step}, the run's last, was not committed by ckptd within {} s: exiting with an error, so that the supervisor relaunches from the newest committed step",
                    FINAL_COMMIT_WITHIN.as_secs()
                );
            }
            writeln!(
                log,
                "ckptd: the last step {step} was not committed; handing it over again"
            )?;
            std::thread::sleep(std::time::Duration::from_secs(1));
            self.snapshot(true, None)?;
            self.drain_ckptd();
        }
        self.world.barrier();
        if let Saver::Ckptd(saver) = &mut self.saver {
            let _ = saver.client.bye();
            writeln!(
                log,
                "ckptd: {} snapshots skipped while the daemon was busy",
                saver.skipped
            )?;
            let unsent = saver.client.unsent();
            if unsent > 0 {
                writeln!(
                    log,
                    "ckptd: {unsent} heartbeats not sent while the daemon left {} requests unanswered",
                    crate::snapshot::PENDING_MAX
                )?;
            }
        }
        Ok(())
    }

    /// Whether any rank's daemon answers that it lacks `step` in its T0 (summed over the
    /// ranks, so every rank decides the same). A daemon that does not answer cannot take
    /// the step again: its node is lost, which the supervisor sees for itself.
    fn final_uncommitted(&mut self, step: u64) -> bool {
        let Saver::Ckptd(saver) = &mut self.saver else {
            return false;
        };
        let lacking = saver
            .client
            .committed(step)
            .is_ok_and(|committed| committed != Some(step));
        self.world.sum_u64(Group::World, &[u64::from(lacking)])[0] > 0
    }

    /// What a checkpoint is, for the stall summary.
    fn saver_name(&self) -> &'static str {
        match self.saver {
            Saver::Store(_) => "in-process save",
            Saver::Ckptd(_) => "ckptd snapshot",
        }
    }

    /// Hands the current state to `ckptd` if every rank's daemon is free (all ranks snapshot
    /// the same steps, or none does). `last`: the run's final snapshot, which waits for a busy
    /// daemon, asks for a durable commit and waits for the daemon's answer; the loop's
    /// snapshots go on without it (read with the next request).
    ///
    /// `agreed`: whether any daemon was busy, when the caller already polled and summed that
    /// over the ranks (with the step's loss, so no extra collective), and how long its poll
    /// took.
    fn snapshot(&mut self, last: bool, agreed: Option<(bool, std::time::Duration)>) -> Result<()> {
        let started = Instant::now();
        let waited = self.cpu_wait.now();
        let wait = last || self.config.checkpoint.busy == "wait";
        let deadline = Instant::now() + std::time::Duration::from_secs(600);
        let step = self.state.step;
        let Saver::Ckptd(saver) = &mut self.saver else {
            unreachable!("a snapshot needs ckptd");
        };
        let ckptd = &mut saver.client;
        let answered = ckptd.answer_wait();
        // Whether any rank's daemon is busy, and whether any rank's wait ran out: both are
        // summed, so every rank leaves the wait at the same poll.
        let any_busy = |ckptd: &mut Ckptd, world: &World| {
            let busy = ckptd
                .poll(step, std::time::Duration::ZERO, None)
                .unwrap_or(true);
            let expired = Instant::now() >= deadline;
            let sums = world.sum_u64(Group::World, &[u64::from(busy), u64::from(expired)]);
            (sums[0] > 0, sums[1] > 0)
        };
        let (mut busy, poll_time) = match agreed {
            Some((busy, poll_time)) => (busy, poll_time),
            None => (any_busy(ckptd, &self.world).0, std::time::Duration::ZERO),
        };
        let mut expired = false;
        while busy && wait && !expired {
            std::thread::sleep(std::time::Duration::from_millis(5));
            (busy, expired) = any_busy(ckptd, &self.world);
        }
        if busy {
            saver.skipped += 1;
            let _ = ckptd.skipped(step);
        } else {
            let slot = self.optim.memory.current_slot();
            let (specs, stall) = (
                Session::blobs_of(&self.state, &self.config)?,
                saver.last_stall,
            );
            // Whatever the daemon answers, or a link that broke, is among its answers.
            let _ = if last {
                ckptd.snapshot(step, slot, last, &specs, stall).map(drop)
            } else {
                ckptd.hand_over(step, slot, last, &specs, stall)
            };
        }
        saver.last_stall = started.elapsed() + poll_time;
        let (poll_cpu_wait, poll_answer_wait) = std::mem::take(&mut saver.poll_waits);
        let cpu_wait = self.cpu_wait.now().saturating_sub(waited) + poll_cpu_wait;
        let answer_wait = saver.client.answer_wait().saturating_sub(answered) + poll_answer_wait;
        if last {
            saver.last_wait = saver.last_wait.max(saver.last_stall.as_secs_f64());
        } else {
            self.stalls.push(Stall {
                step,
                seconds: saver.last_stall.as_secs_f64(),
                cpu_wait: cpu_wait.as_secs_f64(),
                answer_wait: answer_wait.as_secs_f64(),
            });
        }
        self.take_answers();
        Ok(())
    }

    fn blobs_of(state: &TrainerState, config: &Config) -> Result<Vec<(String, Bytes)>> {
        Ok(vec![
            (TRAINER_BLOB.into(), Bytes::from(serde_json::to_vec(state)?)),
            (
                hf_olmoe::MODEL_BLOB.into(),
                Bytes::from(serde_json::to_vec(&config.model)?),
            ),
        ])
    }

    /// Waits (bounded) until this rank's daemon has finished with everything handed over.
    fn drain_ckptd(&mut self) {
        let deadline = Instant::now() + std::time::Duration::from_secs(600);
        if let Saver::Ckptd(saver) = &mut self.saver {
            while Instant::now() < deadline
                && saver
                    .client
                    .poll(self.state.step, std::time::Duration::ZERO, None)
                    .unwrap_or(false)
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }

    fn validate(&self, dataset: &Dataset) -> Result<Option<f64>> {
        let c = &self.config;
        let Some(mut sampler) = Sampler::new(&dataset.val, c.model.seq_len, c.run.seed) else {
            return Ok(None);
        };
        let mut total = 0.0;
        for batch in 0..c.train.val_batches {
            let tokens: Vec<u32> = (0..c.train.micro_batch)
                .flat_map(|i| {
                    sampler.sample(&dataset.val, (batch * c.train.micro_batch + i) as u64)
                })
                .collect();
            total +=
                crate::pipeline::evaluate(&self.model, &self.world, &tokens, c.train.micro_batch)?;
        }
        Ok(Some(total / c.train.val_batches as f64))
    }
}

/// How long a rank keeps handing its run's last step to ckptd (once a second) until its
/// daemon has it committed, before it gives up with an error.
const FINAL_COMMIT_WITHIN: std::time::Duration = std::time::Duration::from_secs(120);

/// The store calls a rank makes at start. Under ckptd, whose daemons checked the store when
/// they started, they are best effort: the first that fails or gets no answer within
/// `limit` is logged, and the rest are skipped, so that a store that is down or hung does
/// not keep a relaunched world from restoring from the daemons' memory (T0, T1).
struct StartChecks {
    limit: Option<std::time::Duration>,
    gave_up: bool,
}

impl StartChecks {
    fn call<T>(
        &mut self,
        runtime: &tokio::runtime::Runtime,
        log: &mut dyn Write,
        what: &str,
        call: impl std::future::Future<Output = Result<T>>,
    ) -> Result<Option<T>> {
        let Some(limit) = self.limit else {
            return runtime.block_on(call).map(Some);
        };
        if self.gave_up {
            return Ok(None);
        }
        // The timer needs the runtime: it is made inside block_on.
        let failed = match runtime.block_on(async { tokio::time::timeout(limit, call).await }) {
            Ok(Ok(value)) => return Ok(Some(value)),
            Ok(Err(error)) => format!("{error:#}"),
            Err(_) => format!("no answer within {} s", limit.as_secs()),
        };
        self.gave_up = true;
        writeln!(
            log,
            "checkpoint store: {what}: {failed}; starting without it (the node daemons restore from memory)"
        )?;
        Ok(None)
    }
}

/// The run's store, opened and checked before any training: the run exists (rank 0 creates
/// it), was made for this model, and is not overwritten when `checkpoint.resume = never`.
struct OpenedRun {
    runtime: tokio::runtime::Runtime,
    url: String,
    run_id: RunId,
    run: RunStore,
}

fn open_run(config: &Config, world: &World, log: &mut dyn Write) -> Result<OpenedRun> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(lazarus_shared::store::blocking_threads())
        .enable_all()
        .build()?;
    let url = resolve_store_url(&config.checkpoint.store)?;
    if world.size > 1 && url.starts_with("memory:") {
        bail!(RefusedRun(format!(
            "checkpoint.store {url} lives in one process; {} ranks need a store they share (file:// or s3://)",
            world.size
        )));
    }
    // Under ckptd the daemons write the store, and a relaunched world restores from their
    // memory: the checks below are best effort (see StartChecks).
    let mut checks = StartChecks {
        limit: config
            .checkpoint
            .ckptd_socket()
            .map(|_| std::time::Duration::from_secs(3)),
        gave_up: false,
    };
    let store = runtime
        .block_on(Store::open(
            &url,
            OpenMode::CreateIfMissing,
            StoreOptions {
                check_reachable: checks.limit.is_none(),
                ..StoreOptions::default()
            },
        ))
        .map_err(|error| RefusedRun(format!("cannot use checkpoint store {url}: {error}")))?;
    let run_id: RunId = config
        .run
        .id
        .parse()
        .map_err(|e| RefusedRun(format!("{e}")))?;
    let run = store.run(&run_id);
    let description = serde_json::json!({ "model": config.model, "source": "trainer" });
    let existing = checks.call(&runtime, log, "looking for earlier steps", async {
        match run.info().await {
            Ok(_) => Ok(run.latest().await?),
            Err(lazarus_shared::StoreError::NoSuchRun { .. }) => Ok(None),
            Err(error) => Err(error.into()),
        }
    })?;
    if config.checkpoint.resume == "never" {
        match existing {
            Some(Some(_)) => bail!(RefusedRun(format!("run {run_id} already has checkpoints in {url}; refusing to overwrite them (use checkpoint.resume=auto, or another run.id)"))),
            Some(None) => {}
            None => bail!(RefusedRun(format!("cannot tell whether run {run_id} already has checkpoints in {url}: the store did not answer (checkpoint.resume=never needs to know)"))),
        }
    }
    // Rank 0 creates the run; the others read it once it exists.
    if world.rank == 0 {
        checks.call(&runtime, log, "creating the run", async {
            Ok(run.create(description.clone()).await?)
        })?;
    }
    world.barrier();
    let info = checks.call(&runtime, log, "reading the run", async {
        Ok(run.create(description.clone()).await?)
    })?;
    if let Some(info) = &info {
        if info.description.get("model") != description.get("model") {
            bail!(RefusedRun(format!(
                "run {run_id} in {url} was created for a different model; choose another run.id"
            )));
        }
    }
    Ok(OpenedRun {
        runtime,
        url,
        run_id,
        run,
    })
}

/// Rank 0's table of the layout: every rank's coordinates, host, and the bytes it holds
/// (`held`: weights, gradients, optimizer state per rank, in rank order) next to the layout's
/// prediction.
fn write_layout_table(
    log: &mut dyn Write,
    model: &crate::config::ModelConfig,
    layout: &crate::layout::Layout,
    processes: &[(u32, String)],
    held: &[f64],
) -> Result<()> {
    let mb = |bytes: f64| bytes / 1e6;
    writeln!(log, "layout: {}", layout.describe())?;
    writeln!(
        log,
        "{:>5} {:>3} {:>3} {:>3} {:>3}  {:<16} {:>21} {:>21} {:>21}",
        "rank",
        "tp",
        "pp",
        "dp",
        "ep",
        "host",
        "weights MB (pred.)",
        "gradients MB (pred.)",
        "optimizer MB (pred.)"
    )?;
    for (rank, ((_, host), held)) in processes.iter().zip(held.chunks(3)).enumerate() {
        let at = layout.coords(rank);
        let predicted = crate::layout::RankBytes::predict(model, layout, at);
        writeln!(
            log,
            "{rank:>5} {:>3} {:>3} {:>3} {:>3}  {host:<16} {:>10.1} {:<10} {:>10.1} {:<10} {:>10.1} ({:.1})",
            at.tp,
            at.pp,
            at.dp,
            at.ep,
            mb(held[0]),
            format!("({:.1})", mb(predicted.weights)),
            mb(held[1]),
            format!("({:.1})", mb(predicted.gradients)),
            mb(held[2]),
            mb(predicted.optimizer),
        )?;
    }
    // A tensor-parallel group's all-reduces run every layer: they belong inside a node.
    for first in (0..processes.len()).step_by(layout.tp) {
        let group = layout.group(first, crate::layout::Dim::Tensor);
        let mut hosts: Vec<&str> = group.iter().map(|r| processes[*r].1.as_str()).collect();
        hosts.sort_unstable();
        hosts.dedup();
        if hosts.len() > 1 {
            writeln!(
                log,
                "warning: the tensor-parallel group of ranks {group:?} spans hosts {}; launch tp ranks per node together (ranks are numbered node by node)",
                hosts.join(", ")
            )?;
        }
    }
    Ok(())
}

/// Trains until `config.train.steps` or until `stop` is raised (then checkpoints and returns).
pub fn train(
    config: &Config,
    world: Arc<World>,
    stop: Arc<AtomicBool>,
    metrics_dir: &Path,
    skip_batches: u64,
    log: &mut dyn Write,
) -> Result<Summary> {
    let layout = &world.layout;
    // Rank 0 speaks for the job; the others log nothing.
    let mut quiet = std::io::sink();
    let log: &mut dyn Write = if world.rank == 0 { log } else { &mut quiet };
    let dataset = Dataset::open(Path::new(&config.data.path))?;
    if dataset.index.vocab_size > config.model.vocab_size {
        bail!(RefusedRun(format!(
            "{}: the data's tokenizer has {} tokens, more than model.vocab_size {}",
            config.data.path, dataset.index.vocab_size, config.model.vocab_size
        )));
    }
    let seq = config.model.seq_len;
    let mut sampler = Sampler::new(&dataset.train, seq, config.run.seed).ok_or_else(|| {
        RefusedRun(format!(
            "{}: the training split holds {} tokens, fewer than one sequence of {seq}",
            config.data.path,
            dataset.train.len()
        ))
    })?;
    let OpenedRun {
        runtime,
        url,
        run_id,
        run,
    } = open_run(config, &world, log)?;
    let model = if world.size > 1 {
        Model::part_of(&config.model, config.run.seed, DType::F32, world.clone())?
    } else {
        Model::new(&config.model, config.run.seed, DType::F32)?
    };
    let mut optim = AdamW::new(&model, &config.train, world.clone())?;
    optim.overlap_grad_reduce =
        config.parallel.overlap_grad_reduce && optim.can_overlap_grad_reduce();
    let parameters = optim.len;
    let optimizer_bytes = optim.state_bytes();
    let predicted_bytes = optim.predicted_state_bytes();
    let mut session = Session {
        world: world.clone(),
        config: config.clone(),
        model,
        optim,
        run,
        runtime,
        state: TrainerState {
            step: 0,
            samples_seen: 0,
            optimizer_step: 0,
            layout: Some(layout.written()),
            skipped: Vec::new(),
            recent_losses: Vec::new(),
            router_bias: Vec::new(),
        },
        saver: Saver::Store(StoreSaver::default()),
        stalls: Vec::new(),
        cpu_wait: crate::trace::CpuWait::of_this_thread(),
        pipeline_seconds: 0.0,
        pipeline_wait: 0.0,
        activation_bytes: None,
        steps_run: 0,
        skip_offered: None,
        expected_losses: Vec::new(),
        last_loss: None,
        checkpointed: None,
    };
    let mut restored_tier = None;
    let resumed_from = match config.checkpoint.ckptd_socket() {
        Some(socket) => {
            let restored =
                session.attach_ckptd(&socket, &run_id, config.checkpoint.resume == "auto")?;
            restored_tier = restored.map(|(_, tier)| tier);
            restored.map(|(step, _)| step)
        }
        None if config.checkpoint.resume == "auto" => session.resume()?,
        None => None,
    };
    writeln!(
        log,
        "run {run_id}: {parameters} parameters, {} MB of optimizer state, {} train tokens{}",
        optimizer_bytes / 1_000_000,
        dataset.train.len(),
        resumed_from
            .map(|s| format!(
                ", resumed from step {s}{}",
                restored_tier
                    .map(|t| format!(" ({} via ckptd)", t.name()))
                    .unwrap_or_default()
            ))
            .unwrap_or_default()
    )?;
    writeln!(log, "{}", config.checkpoint.describe())?;
    // The machines the world runs on, whose matmul peaks together bound its CPU-MFU.
    let mut hosts = 1;
    if world.size > 1 {
        let processes = world.processes();
        hosts = crate::steplog::distinct_hosts(&processes);
        let ranks: Vec<String> = processes
            .iter()
            .enumerate()
            .map(|(rank, (pid, host))| format!("rank {rank} = pid {pid} on {host}"))
            .collect();
        writeln!(log, "ranks: {}", ranks.join(", "))?;
        let held = world.all_gather_f64(
            Group::World,
            &[
                4.0 * parameters as f64,
                4.0 * parameters as f64,
                optimizer_bytes as f64,
            ],
        );
        write_layout_table(log, &config.model, layout, &processes, &held)?;
        writeln!(
            log,
            "{} ranks (data parallel {}, expert parallel {}): optimizer state {} bytes per rank on rank 0, ZeRO-1 predicts {:.0}",
            world.size, layout.dp, layout.ep, optimizer_bytes, predicted_bytes
        )?;
    }
    if let (Some(faults), Some(step)) = (config.test_faults.as_ref(), resumed_from) {
        let after = faults.perturb_restore_after_step;
        if after > 0 && step > after {
            for (_, var) in session.model.parameters() {
                var.set(&(var.as_tensor() + 1e-2)?)?;
            }
            eprintln!(
                "rank {}: test_faults.perturb_restore_after_step = {after}: shifted the weights restored from step {step}",
                world.rank
            );
        }
    }
    let mut step_log = StepLog::open(config, layout, hosts, world.rank == 0, metrics_dir, log)?;
    let batch = config.train.micro_batch;
    let global_batch = config.global_batch(layout) as u64;
    // Data to skip right after the step this start resumed: the supervisor's, once it rolled
    // the run back past data that made it go bad, and the operator's `--skip-batches`.
    let resumed_step = session.state.step;
    let skip = session
        .skip_offered
        .filter(|s| s.after_step == resumed_step)
        .map_or(0, |s| s.batches)
        + skip_batches;
    if skip > 0 {
        // The first step trains other data than it did before: nothing to compare.
        session.expected_losses.clear();
        session.state.samples_seen += skip * global_batch;
        session.state.skipped.push(SkippedData {
            after_step: resumed_step,
            batches: skip,
        });
        writeln!(
            log,
            "skipping {skip} global batches of data after step {resumed_step}: step {} trains the data step {} did before",
            resumed_step + 1,
            session.state.samples_seen / global_batch + 1
        )?;
    }
    let first_step = session.state.step + 1;
    session.prepare_saves()?;
    let mut losses = Vec::new();
    // The newest step whose weights every copy agreed on, and what the checks cost.
    let mut sdc_agreed = 0;
    let mut checks = CheckTimes::default();
    let loop_started = Instant::now();
    session.checkpointed = resumed_from;
    let mut stopped_by_signal = false;
    while session.state.step < config.train.steps {
        crate::trace::step_begins();
        let _step_span = tracing::info_span!("step", step = session.state.step + 1).entered();
        // Every rank stops at the same step, whichever of them saw the signal first.
        let stop_requested = if world.size > 1 {
            world.sum_u64(Group::World, &[u64::from(stop.load(Ordering::Relaxed))])[0] > 0
        } else {
            stop.load(Ordering::Relaxed)
        };
        if stop_requested {
            stopped_by_signal = true;
            break;
        }
        let step = session.state.step + 1;
        // The step of the run's first data order whose data this step trains (they differ
        // once data was skipped).
        let data_step = session.state.samples_seen / global_batch + 1;
        let faults = config.test_faults.as_ref();
        if let Some(faults) = faults {
            if faults.crash_at_step == step && faults.crash_rank as usize == world.rank {
                eprintln!(
                    "rank {}: test_faults.crash_at_step = {step}: crashing",
                    world.rank
                );
                std::process::exit(70);
            }
        }
        // This rank's part of the global batch: the same global sample order for any N.
        // Micro-batch j of the global batch is its j-th run of samples, split over the
        // data-parallel ranks: the same micro-batches (and router statistics) for any dp.
        let data_rank = layout.coords(world.rank).dp;
        let per_micro = batch / layout.micro_batches;
        let tokens: Vec<u32> = (0..layout.micro_batches)
            .flat_map(|j| {
                let first = (j * layout.dp + data_rank) * per_micro;
                (first..first + per_micro).map(|i| session.state.samples_seen + i as u64)
            })
            .flat_map(|sample| sampler.sample(&dataset.train, sample))
            .collect();
        let tokens = match faults {
            Some(f)
                if (f.garbage_at_step..f.garbage_at_step + f.garbage_steps)
                    .contains(&data_step) =>
            {
                garbage(
                    tokens.len(),
                    dataset.index.vocab_size,
                    data_step,
                    world.rank,
                )
            }
            _ => tokens,
        };
        let figures = session.gradients(&tokens, batch, &mut step_log)?;
        if faults.is_some_and(|f| f.nan_at_step == data_step && f.nan_rank as usize == world.rank) {
            session.optim.poison_gradient();
        }
        // The weights this step computed with, compared across their copies before the
        // update: at the first step of a launch (the restored or initial state), and after
        // every sdc_check_every-th step.
        let every = config.health.sdc_check_every;
        if every > 0 && world.size > 1 && (step == first_step || (step - 1).is_multiple_of(every)) {
            let timer = Instant::now();
            let checking = tracing::info_span!("sdc_check").entered();
            let mismatch = crate::sdc::check(&world, &session.model, &session.optim)?;
            drop(checking);
            checks.sdc.push(timer.elapsed().as_secs_f64());
            match mismatch {
                None => sdc_agreed = step - 1,
                Some(mismatch) => {
                    let finding = SdcFinding {
                        suspect: mismatch.suspect.map(|r| r as u32),
                        // A restored state that fails agreed on nothing newer than the step
                        // before it.
                        agreed_step: if step == first_step {
                            (step - 1).saturating_sub(1)
                        } else {
                            sdc_agreed
                        },
                    };
                    let reason = mismatch.describe(step);
                    return Err(session.went_bad(step, &reason, (Some(finding), None), log));
                }
            }
        }
        session.heartbeat();
        let timer = Instant::now();
        let lr = learning_rate(&config.train, step);
        let held = session.saver.held();
        let updating = tracing::info_span!("optimizer").entered();
        let update = session.optim.apply(&session.model, lr, held)?;
        drop(updating);
        step_log.time(Phase::Optimizer, timer.elapsed().as_secs_f64());
        if let Some(f) = faults.filter(|f| f.flip_after_step == step && !f.flip_socket.is_empty()) {
            let here = config
                .checkpoint
                .ckptd_socket()
                .is_some_and(|s| s.display().to_string().ends_with(&f.flip_socket));
            if here {
                let tensor = crate::sdc::flip_one_bit(&session.model, &session.optim)?;
                eprintln!(
                    "rank {}: test_faults.flip_after_step = {step}: flipped a bit of {tensor}",
                    world.rank
                );
            }
        }
        step_log.stepped();
        // A checkpoint is due: ask the saver whether it is free now, and agree on it across
        // ranks in the same sum as the loss.
        let checkpoint_due = step.is_multiple_of(config.checkpoint.every);
        let (busy_here, poll_time) = if checkpoint_due || session.writing() {
            session.busy(step)
        } else {
            (false, std::time::Duration::ZERO)
        };
        // Each data-parallel rank's and pipeline stage's part of the loss, summed over the
        // world: a tensor-parallel group's ranks all hold the same figures, and its first rank
        // speaks for it.
        let speaks = if world.coords().tp == 0 { 1.0 } else { 0.0 };
        let local = [
            figures.loss * speaks,
            figures.cross_entropy * speaks,
            figures.load_balancing * speaks,
            figures.router_z * speaks,
            f64::from(u8::from(busy_here)),
        ];
        let sums = if world.size > 1 {
            world.sum_f64(Group::World, &local)
        } else {
            local.to_vec()
        };
        let (loss, any_busy) = (sums[0], sums[4] > 0.0);
        let mut expert_load = figures.expert_load;
        if layout.pp > 1 {
            // Every stage's layers, for the step log and the routing bias (every rank keeps
            // every layer's: rank 0 writes them all to trainer.json).
            let experts = config.model.experts;
            let mut all = vec![0u64; config.model.layers * experts];
            let first = session.model.first_layer;
            for (layer, load) in expert_load.iter().enumerate() {
                all[(first + layer) * experts..][..experts].copy_from_slice(load);
            }
            let all = world.sum_u64(Group::Pipeline, &all);
            expert_load = all.chunks(experts).map(<[u64]>::to_vec).collect();
        }
        if config.train.router_bias_rate > 0.0 {
            crate::model::update_router_bias(
                &mut session.state.router_bias,
                &expert_load,
                config.train.router_bias_rate,
            );
            session.model.set_router_bias(&session.state.router_bias);
        }
        let forward = StepFigures {
            cross_entropy: sums[1],
            load_balancing: sums[2],
            router_z: sums[3],
            expert_load,
            ..StepFigures::default()
        };
        session.state.step = step;
        session.state.samples_seen += global_batch;
        session.state.optimizer_step = session.optim.step;
        losses.push((step, loss));
        session.last_loss = Some(loss);
        if step == first_step {
            if let Some(reason) =
                restore_mismatch(&config.health, &session.expected_losses, step, loss)
            {
                let restored = Some(step - 1);
                return Err(session.went_bad(step, &reason, (None, restored), log));
            }
        }
        let timer = Instant::now();
        let recent = &session.state.recent_losses;
        if let Some(reason) =
            crate::health::verdict(&config.health, recent, step, loss, update.grad_norm)
        {
            return Err(session.went_bad(step, &reason, (None, None), log));
        }
        crate::health::remember(&config.health, &mut session.state.recent_losses, loss);
        checks.health.push(timer.elapsed().as_secs_f64());
        let val_loss = if step.is_multiple_of(config.train.val_every) {
            let _span = tracing::info_span!("validation").entered();
            session.validate(&dataset)?
        } else {
            None
        };
        step_log.step_done(step, loss, &forward, &update, lr, val_loss, log)?;
        if checkpoint_due {
            let _span = tracing::info_span!("checkpoint").entered();
            session.save(step == config.train.steps, (any_busy, poll_time), log)?;
        } else if session.writing() {
            let _span = tracing::info_span!("checkpoint_commit").entered();
            session.settle_in_loop(any_busy, log)?;
        }
    }
    if let Some(bytes) = session.activation_bytes {
        // Every rank takes part, so the gathers below stay collective.
        let measured = world.all_gather_f64(Group::World, &[bytes as f64]);
        let ranks: Vec<String> = measured
            .iter()
            .enumerate()
            .map(|(rank, bytes)| {
                let predicted = crate::layout::predicted_activation_bytes(
                    &config.model,
                    layout,
                    layout.coords(rank),
                    batch,
                );
                format!("rank {rank} {:.1} MB ({:.1})", bytes / 1e6, predicted / 1e6)
            })
            .collect();
        writeln!(
            log,
            "peak activations, measured on the heap after each forward pass (predicted): {}",
            ranks.join(", ")
        )?;
    }
    if world.size > 1 {
        let peaks = world.all_gather_f64(Group::World, &[peak_resident_bytes().unwrap_or(0.0)]);
        let peaks: Vec<String> = peaks
            .iter()
            .enumerate()
            .map(|(rank, bytes)| format!("rank {rank} {:.0} MB", bytes / 1e6))
            .collect();
        writeln!(
            log,
            "peak resident memory per rank (weights, state, activations, runtime): {}",
            peaks.join(", ")
        )?;
    }
    if layout.pp > 1 {
        // Each rank's share of its pipeline steps spent waiting on the stages next to it.
        let idle = world.all_gather_f64(
            Group::World,
            &[session.pipeline_wait / session.pipeline_seconds.max(1e-9)],
        );
        let by_stage: Vec<String> = (0..layout.pp)
            .map(|stage| {
                let shares: Vec<f64> = (0..world.size)
                    .filter(|rank| layout.coords(*rank).pp == stage)
                    .map(|rank| idle[rank])
                    .collect();
                format!(
                    "{:.0}%",
                    100.0 * shares.iter().sum::<f64>() / shares.len() as f64
                )
            })
            .collect();
        writeln!(
            log,
            "pipeline bubble: {:.1}% of each step waiting on other stages (mean over ranks; stages {}), 1F1B predicts {:.1}% for pp {} and {} micro-batches",
            100.0 * idle.iter().sum::<f64>() / idle.len() as f64,
            by_stage.join(" "),
            100.0 * layout.bubble_fraction(),
            layout.pp,
            layout.micro_batches
        )?;
    }
    if session.optim.overlap_grad_reduce {
        let (in_flight, waited) = crate::dist::overlapped_reduce_totals();
        writeln!(
            log,
            "gradient reduce-scatter on rank 0, layer by layer during the last micro-batch's backward pass: in flight {in_flight:.2} s while the layers below ran theirs, of which the rank waited in it {waited:.2} s"
        )?;
    }
    if layout.ep > 1 {
        let totals = crate::dist::exchange_totals();
        let meanwhile = (totals.in_flight_s - totals.exposed_s).max(0.0);
        writeln!(
            log,
            "expert all-to-all on rank 0: {:.1} MB to and from other ranks; the rank waited in it {:.2} s ({:.0} MB/s) and computed {meanwhile:.2} s while chunks of it were posted",
            totals.bytes as f64 / 1e6,
            totals.exposed_s,
            totals.bytes as f64 / 1e6 / totals.exposed_s.max(1e-9),
        )?;
    }
    checks.report(
        config.health.sdc_check_every,
        loop_started.elapsed().as_secs_f64(),
        losses.len(),
        log,
    )?;
    session.finish(log)?;
    session.report_stalls(log)?;
    Ok(Summary {
        run: run_id.to_string(),
        store: url,
        first_step,
        last_step: session.state.step,
        resumed_from,
        losses,
        last_checkpoint: session.checkpointed,
        parameters,
        optimizer_bytes,
        stopped_by_signal,
    })
}

/// Why the first step after a restore is bad: it had another loss before the restore (beyond
/// `health.restore_loss_tolerance`, relative), so the restored state is not what the run had.
fn restore_mismatch(
    config: &crate::config::HealthConfig,
    expected: &[(u64, f64)],
    step: u64,
    loss: f64,
) -> Option<String> {
    let tolerance = config.restore_loss_tolerance;
    let (_, before) = expected.iter().find(|(s, _)| *s == step)?;
    let off = (loss - before).abs() / before.abs().max(1e-12);
    (tolerance >= 0.0 && (off > tolerance || off.is_nan())).then(|| {
        format!(
            "the first step after restoring step {} has loss {loss:.6}, and had {before:.6} before the restore (relative difference {off:.2e}, health.restore_loss_tolerance = {tolerance:e}): the restored state is not what the run had",
            step - 1
        )
    })
}

/// What the health and silent-data-corruption checks cost on this rank, for the summary.
#[derive(Default)]
struct CheckTimes {
    health: Vec<f64>,
    sdc: Vec<f64>,
}

impl CheckTimes {
    /// One line: each check's mean time, and its share of the mean step (`seconds` over
    /// `steps`).
    fn report(&self, every: u64, seconds: f64, steps: usize, log: &mut dyn Write) -> Result<()> {
        if steps == 0 {
            return Ok(());
        }
        let step = seconds / steps as f64;
        let mean = |times: &[f64]| times.iter().sum::<f64>() / times.len().max(1) as f64;
        let health = mean(&self.health);
        write!(
            log,
            "health checks: {} at {:.1} us each ({:.4}% of a {:.1} ms step)",
            self.health.len(),
            health * 1e6,
            100.0 * health / step,
            step * 1e3
        )?;
        if self.sdc.is_empty() {
            return Ok(writeln!(log, "; no silent-data-corruption check ran")?);
        }
        let sdc = mean(&self.sdc);
        writeln!(
            log,
            "; silent-data-corruption checks: {} at {:.2} ms each ({:.2}% of a step, {:.3}% averaged over sdc_check_every = {every} steps)",
            self.sdc.len(),
            sdc * 1e3,
            100.0 * sdc / step,
            100.0 * sdc / step / every.max(1) as f64
        )?;
        Ok(())
    }
}

/// This process's peak resident memory so far (Linux's `VmHWM`), in bytes.
/// `len` random tokens below `vocab`, the same for the same data step and rank: the
/// garbage data of `test_faults.garbage_at_step`.
fn garbage(len: usize, vocab: usize, data_step: u64, rank: usize) -> Vec<u32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(data_step << 16 | rank as u64);
    (0..len)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect()
}

fn peak_resident_bytes() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// The best of several timed `size`x`size` f32 matmuls, after a warm-up, in GFLOP/s.
pub fn bench_peak(size: usize) -> Result<f64> {
    let a = Tensor::ones((size, size), DType::F32, &candle_core::Device::Cpu)?;
    let b = Tensor::ones((size, size), DType::F32, &candle_core::Device::Cpu)?;
    a.matmul(&b)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let timer = Instant::now();
        a.matmul(&b)?;
        best = best.min(timer.elapsed().as_secs_f64());
    }
    Ok(2.0 * (size as f64).powi(3) / best / 1e9)
}

#[cfg(test)]
mod tests {
    use super::{floats_from_bytes, restore_mismatch, StateCopy};
    use crate::config::HealthConfig;
    use lazarus_shared::store::ByteSource;

    /// The state goes to the store as each float's little-endian bytes, in order, and comes
    /// back as the same bits (a NaN's payload and a zero's sign included); a spare copy of
    /// the same size is overwritten whole, and one of another size is not used.
    #[test]
    fn state_floats_are_stored_little_endian_and_read_back_bit_for_bit() {
        let values = [
            1.0f32,
            -0.0,
            f32::from_bits(0x7fc0_1234),
            3.5e-42,
            f32::MAX,
            -2.25,
        ];
        let expected: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let first = StateCopy::of(&values, None).unwrap();
        assert_eq!(first.as_ref(), &expected[..]);
        let read = first.bytes().read_at(4, 8).unwrap();
        assert_eq!(&read[..], &expected[4..12]);
        assert!(first.bytes().read_at(20, 8).is_err());
        // Not spare while a read of it is alive.
        assert!(first.clone().into_spare().is_none());
        drop(read);
        let spare = first.into_spare().unwrap();
        let reversed: Vec<f32> = values.iter().rev().copied().collect();
        let second = StateCopy::of(&reversed, Some(spare)).unwrap();
        let expected_second: Vec<u8> = reversed.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(second.as_ref(), &expected_second[..]);
        let shorter = StateCopy::of(&values[..2], second.into_spare()).unwrap();
        assert_eq!(shorter.as_ref(), &expected[..8]);
        // A rank with no state of its own.
        let empty = StateCopy::of(&[], shorter.into_spare()).unwrap();
        assert!(empty.as_ref().is_empty());
        assert!(empty.bytes().read_at(0, 0).unwrap().is_empty());
        assert!(StateCopy::of(&[], empty.into_spare()).is_ok());
        let mut back = [0f32; 6];
        floats_from_bytes(&mut back, &expected);
        assert_eq!(back.map(f32::to_bits), values.map(f32::to_bits));
        // A state of a length no core count divides, copied in pieces on every core, into
        // a kept map of its size.
        let long: Vec<f32> = (0..100_003u32).map(|i| i as f32 * 0.5 - 7.0).collect();
        let expected_long: Vec<u8> = long.iter().flat_map(|v| v.to_le_bytes()).collect();
        let kept = StateCopy::of(&long, None).unwrap().into_kept().unwrap();
        let copied = StateCopy::of(&long, Some(kept)).unwrap();
        assert!(copied.as_ref() == &expected_long[..]);
    }

    #[test]
    fn the_first_step_after_a_restore_must_repeat_its_loss() {
        let config = HealthConfig::default();
        let before = [(61, 6.5), (51, 7.0)];
        assert_eq!(restore_mismatch(&config, &before, 61, 6.5), None);
        assert_eq!(
            restore_mismatch(&config, &before, 61, 6.5 * (1.0 + 1e-5)),
            None
        );
        let reason = restore_mismatch(&config, &before, 61, 6.6).unwrap();
        assert!(reason.contains("after restoring step 60"), "{reason}");
        assert!(restore_mismatch(&config, &before, 61, f64::NAN).is_some());
        // No loss known for the step: nothing to compare.
        assert_eq!(restore_mismatch(&config, &before, 71, 1.0), None);
        let off = HealthConfig {
            restore_loss_tolerance: -1.0,
            ..HealthConfig::default()
        };
        assert_eq!(restore_mismatch(&off, &before, 61, 6.6), None);
    }
}
