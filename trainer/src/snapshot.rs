//! The optimizer's state memory and the hand-off to the node's `ckptd`.
//!
//! Without `ckptd`, the state is one heap buffer updated in place, or, with background saves
//! through the store, one of three anonymous maps that the saves hold as the daemon holds its
//! slots (a save holds the map it writes from and, after it, reads it as the next save's delta
//! base). With `ckptd`, it lives in the daemon's four shm slot files, mapped here. The daemon *holds* some slots (its
//! committed T0, the snapshot it is working on, the durable upload in flight); the trainer
//! never writes a held slot. Each optimizer update reads the current slot and writes the
//! next state into a free one (or in place when the current slot is not held), so after an
//! update the new state already sits in a slot the daemon can read: a snapshot is a message
//! naming that slot, whatever the state's size.

use std::collections::VecDeque;
use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use lazarus_shared::busy_word::{self, BusyWordReader};
use lazarus_shared::wire::{self, DataSkip, Message, SlotTensor, Tier};

enum Buffer {
    Heap(Vec<f32>),
    Mapped(memmap2::MmapMut),
    /// An anonymous map that in-process saves share ([`StateMemory::into_shared`]).
    Shared(Arc<memmap2::MmapMut>),
}

impl Buffer {
    fn as_slice(&self) -> &[f32] {
        match self {
            Buffer::Heap(v) => v,
            Buffer::Mapped(m) => bytemuck::cast_slice(&m[..]),
            Buffer::Shared(m) => bytemuck::cast_slice(&m[..]),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        match self {
            Buffer::Heap(v) => v,
            Buffer::Mapped(m) => bytemuck::cast_slice_mut(&mut m[..]),
            Buffer::Shared(m) => {
                let map = Arc::get_mut(m).expect("a copy of the state a save holds is not written");
                bytemuck::cast_slice_mut(&mut map[..])
            }
        }
    }

    /// Whether a save holds this buffer (it writes from it, or reads it as a delta base).
    fn held_by_a_save(&self) -> bool {
        matches!(self, Buffer::Shared(m) if Arc::strong_count(m) > 1)
    }
}

/// Where an update writes.
#[derive(Debug)]
pub enum UpdateTarget<'a> {
    /// The current state, in place.
    InPlace(&'a mut [f32]),
    /// From the current state into a free slot.
    Copy { from: &'a [f32], to: &'a mut [f32] },
}

/// The slots this rank must not write: the daemon's last answer, plus a slot handed over
/// whose answer never came (the link broke mid-request, so the daemon may have taken it).
/// Only the rank's client of its daemon ([`Ckptd`]) changes it, from the daemon's answers;
/// an update reads it. The daemon holds at most three of its four slots and answers every
/// hand-over with its new held set, so one slot is always free for the next update.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeldSlots {
    answered: Vec<usize>,
    unconfirmed: Option<usize>,
}

impl HeldSlots {
    /// No slot held.
    pub const NONE: HeldSlots = HeldSlots {
        answered: Vec::new(),
        unconfirmed: None,
    };

    /// The daemon's own word: it replaces what was known, an unconfirmed hand-over included.
    fn answer(&mut self, held: &[u32]) {
        self.answered = held.iter().map(|s| *s as usize).collect();
        self.unconfirmed = None;
    }

    /// `slot` went to the daemon and no answer came back (yet).
    fn unconfirmed(&mut self, slot: usize) {
        self.unconfirmed = Some(slot);
    }

    /// The daemon refused the hand-over of `slot`: it did not take it.
    fn refused(&mut self, slot: usize) {
        if self.unconfirmed == Some(slot) {
            self.unconfirmed = None;
        }
    }

    pub fn contains(&self, slot: usize) -> bool {
        self.answered.contains(&slot) || self.unconfirmed == Some(slot)
    }
}

/// One or more copies of the optimizer state, and which one is current.
pub struct StateMemory {
    buffers: Vec<Buffer>,
    current: usize,
    next: usize,
}

impl std::fmt::Debug for StateMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateMemory")
            .field("buffers", &self.buffers.len())
            .field("current", &self.current)
            .finish()
    }
}

impl StateMemory {
    /// One heap buffer, updated in place.
    pub fn heap(state: Vec<f32>) -> Self {
        Self {
            buffers: vec![Buffer::Heap(state)],
            current: 0,
            next: 0,
        }
    }

    /// This state in the first of `copies` anonymous maps, faulted in here. An in-process save
    /// shares the current one ([`StateMemory::share_current`]) while it writes from it and
    /// reads it as the next save's delta base, and updates go around the maps it holds as they
    /// go around the daemon's held slots: the save's copy of the state is made by the update
    /// after it, not in the training loop's stall. Three are enough: a save in flight and the
    /// delta base of the one before hold two. The memory before goes back to the allocator
    /// once the state is in the first map, before the others are made; the heap keeps it for
    /// its own later use.
    pub fn into_shared(self, copies: usize) -> io::Result<Self> {
        let bytes = std::mem::size_of_val(self.current());
        let map = || memmap2::MmapOptions::new().len(bytes).populate().map_anon();
        let mut first = map()?;
        first.copy_from_slice(bytemuck::cast_slice(self.current()));
        drop(self);
        let mut buffers = vec![Buffer::Shared(Arc::new(first))];
        for _ in 1..copies {
            buffers.push(Buffer::Shared(Arc::new(map()?)));
        }
        Ok(Self {
            buffers,
            current: 0,
            next: 0,
        })
    }

    /// The map that holds the current state, for a save to write from: while the save (or
    /// anyone) keeps it, updates write elsewhere. `None` unless the memory is
    /// [`StateMemory::into_shared`].
    pub fn share_current(&self) -> Option<Arc<memmap2::MmapMut>> {
        match &self.buffers[self.current] {
            Buffer::Shared(map) => Some(map.clone()),
            _ => None,
        }
    }

    /// Whether `slot` must not be written: the daemon holds it, or a save does.
    fn is_held(&self, held: &HeldSlots, slot: usize) -> bool {
        held.contains(slot) || self.buffers[slot].held_by_a_save()
    }

    /// Maps the daemon's slot files; the state moves into a slot the daemon does not hold,
    /// unless `restored` names the slot that already holds it.
    pub fn mapped(
        paths: &[PathBuf],
        held: &HeldSlots,
        state: &[f32],
        restored: Option<usize>,
    ) -> Result<Self> {
        let mut buffers = Vec::with_capacity(paths.len());
        for path in paths {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .with_context(|| format!("opening snapshot slot {}", path.display()))?;
            let bytes = file.metadata()?.len();
            if bytes != (state.len() * 4) as u64 {
                bail!(
                    "snapshot slot {} has {bytes} bytes; this rank's state needs {}",
                    path.display(),
                    state.len() * 4
                );
            }
            // SAFETY: the slot file belongs to this rank's ckptd, which only reads the slots
            // this process handed over and does not truncate them while the rank is
            // registered. The trainer writes only slots the daemon does not hold.
            #[allow(unsafe_code)]
            let map = unsafe { memmap2::MmapMut::map_mut(&file) }
                .with_context(|| format!("mapping {}", path.display()))?;
            buffers.push(Buffer::Mapped(map));
        }
        let current = match restored {
            Some(slot) => slot,
            None => {
                let free = (0..buffers.len())
                    .find(|i| !held.contains(*i))
                    .ok_or_else(|| anyhow!("ckptd holds every snapshot slot"))?;
                buffers[free].as_mut_slice().copy_from_slice(state);
                free
            }
        };
        Ok(Self {
            buffers,
            current,
            next: current,
        })
    }

    pub fn current(&self) -> &[f32] {
        self.buffers[self.current].as_slice()
    }

    /// The current state, to write; only while neither the daemon nor a save holds it.
    pub fn current_mut(&mut self, held: &HeldSlots) -> &mut [f32] {
        assert!(
            !self.is_held(held, self.current),
            "the current state is held by ckptd or a save"
        );
        self.buffers[self.current].as_mut_slice()
    }

    pub fn current_slot(&self) -> usize {
        self.current
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self.buffers[0], Buffer::Mapped(_))
    }

    /// Picks where the next state goes: in place if neither the daemon nor a save holds the
    /// current slot, else a free slot. The daemon holds at most three of four slots (see
    /// [`HeldSlots`]), saves two of three maps; if every one were ever held, this is an error
    /// that ends the job, never a write into a slot the daemon or a save reads.
    pub fn begin_update(&mut self, held: &HeldSlots) -> Result<UpdateTarget<'_>> {
        let current = self.current;
        if !self.is_held(held, current) {
            self.next = current;
            return Ok(UpdateTarget::InPlace(self.buffers[current].as_mut_slice()));
        }
        let next = (0..self.buffers.len())
            .find(|i| *i != current && !self.is_held(held, *i))
            .ok_or_else(|| {
                anyhow!(
                    "every copy of the state is held by ckptd ({held:?}) or a save; none is free for the update"
                )
            })?;
        self.next = next;
        let (from, to) = if current < next {
            let (a, b) = self.buffers.split_at_mut(next);
            (&a[current], &mut b[0])
        } else {
            let (a, b) = self.buffers.split_at_mut(current);
            (&b[0], &mut a[next])
        };
        Ok(UpdateTarget::Copy {
            from: from.as_slice(),
            to: to.as_mut_slice(),
        })
    }

    /// Whether an update has somewhere to go while the daemon holds `held` (and saves hold
    /// what they hold): the current slot, or another free one.
    pub fn has_free_slot(&self, held: &HeldSlots) -> bool {
        (0..self.buffers.len()).any(|i| !self.is_held(held, i))
    }

    pub fn finish_update(&mut self) {
        self.current = self.next;
    }
}

/// A restore the daemon served.
#[derive(Debug)]
pub struct Restored {
    pub step: u64,
    pub slot: usize,
    pub tier: Tier,
    pub blobs: Vec<(String, Bytes)>,
}

/// The leader's answer to which step a world restores (see `Message::StepChoice`).
#[derive(Clone, Debug, Default)]
pub struct Choice {
    pub memory: Option<u64>,
    pub durable: Option<u64>,
    pub skip: Option<DataSkip>,
    /// `(step, loss)` the run had at the step after each offered one, where known.
    pub losses: Vec<(u64, f64)>,
}

/// How often a rank whose link to its daemon is down tries to reconnect. A refused connect
/// costs microseconds; a restarted daemon is found within a step or two, where a second's wait
/// had cost a fast run dozens of skipped snapshots.
const RECONNECT_EVERY: Duration = Duration::from_millis(100);

/// A request written to the daemon whose answer is not read yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pending {
    /// A hand-over of `slot`, holding `step`.
    HandOver { step: u64, slot: usize },
    /// A heartbeat, or word of a skipped snapshot: answered with the held slots.
    Note,
}

/// The most requests a rank leaves unanswered. Past it, heartbeats and word of skipped
/// snapshots are not written (counted in [`Ckptd::unsent`]) rather than waited on: a daemon
/// that stopped reading (SIGSTOPped, or starved of CPU) must not stop its node's ranks, and
/// with them the world. It bounds what the socket's buffer holds for a daemon that is gone;
/// past the heartbeat timeout the leader finds such a node for itself.
pub const PENDING_MAX: usize = 64;

/// The rank's connection to its node's `ckptd` (Unix socket). The daemon answers requests
/// in order; the loop's heartbeats and hand-overs go on without waiting for theirs, which are
/// read once they have come (or before a request that needs its own answer). The client owns
/// the rank's view of the held slots: every answer of the daemon updates it. The daemon
/// takes a slot only when the rank hands it over, so a view older than the daemon's state
/// holds at least what the daemon holds: it may keep a free slot from an update, never give
/// the update one the daemon reads.
#[derive(Debug)]
pub struct Ckptd {
    socket: PathBuf,
    stream: Option<UnixStream>,
    register: Message,
    /// When a reconnect last failed, for rate-limiting the next ones (the first after a
    /// break is tried at once).
    broken_at: Option<Instant>,
    /// Whether the last request was written (wholly or partly) before its link broke: the
    /// daemon may then have acted on it.
    last_request_sent: bool,
    pub slots: Vec<PathBuf>,
    held: HeldSlots,
    /// Requests written whose answers are not read yet, oldest first; at most one
    /// hand-over among them.
    pending: VecDeque<Pending>,
    /// The hand-overs answered since [`Ckptd::take_answers`] last took them: step, and
    /// whether the daemon took it.
    answers: Vec<(u64, bool)>,
    /// The daemon's busy word for this rank, beside the slot files (a daemon without one is
    /// asked instead).
    busy_word: Option<BusyWordReader>,
    /// How long this client has been blocked reading the daemon's answers, in all.
    answer_wait: Duration,
    /// Heartbeats and skips not written because [`PENDING_MAX`] requests were unanswered,
    /// and whether the last one was such.
    unsent: u64,
    unsending: bool,
}

impl Ckptd {
    /// Connects and registers this rank's slot layout.
    pub fn connect(
        socket: &Path,
        run: lazarus_shared::RunId,
        rank: u32,
        world_size: u32,
        tensors: Vec<SlotTensor>,
        slot_bytes: u64,
    ) -> Result<Self> {
        let register = Message::Register {
            run,
            rank,
            world_size,
            pid: std::process::id(),
            slot_bytes,
            tensors,
        };
        let mut client = Self {
            socket: socket.to_path_buf(),
            stream: None,
            register,
            broken_at: None,
            last_request_sent: false,
            slots: Vec::new(),
            held: HeldSlots::default(),
            pending: VecDeque::new(),
            answers: Vec::new(),
            busy_word: None,
            answer_wait: Duration::ZERO,
            unsent: 0,
            unsending: false,
        };
        client.reconnect().with_context(|| {
            format!(
                "cannot reach ckptd at {} (is it running on this node? without it, leave checkpoint.ckptd unset)",
                socket.display()
            )
        })?;
        Ok(client)
    }

    /// The slots the rank must not write.
    pub fn held(&self) -> &HeldSlots {
        &self.held
    }

    /// Whether the daemon is busy with this rank's last snapshot: yes while that hand-over's
    /// answer is pending, else read from the word it keeps in shm rather than asked; `None`
    /// when the link is down, the daemon keeps no word, or it is free but the held slots
    /// known hold three (then ask with [`Ckptd::poll`]). The busy flag says nothing of the
    /// held set: after a hand-over on its say-so whose answer never came (the daemon died),
    /// three slots held and the one handed over would leave the rank's update no free slot,
    /// while the daemon had let one go. So the held slots are first read from the word too,
    /// where the daemon keeps them ([`Ckptd::read_held`]).
    pub fn busy_now(&mut self) -> Option<bool> {
        self.stream.as_ref()?;
        if self.handing_over() {
            return Some(true);
        }
        if self.busy_word.as_ref()?.get() {
            return Some(true);
        }
        self.read_held();
        if self.held.answered.len() + 2 > self.slots.len() {
            return None;
        }
        Some(false)
    }

    /// Takes the slots the daemon holds from its shm word, where it keeps them (with the link
    /// up): they are its state now, newer than any answer not yet read. A hand-over not yet
    /// answered keeps its slot held. The answers still to come are older, so they hold at
    /// least as much.
    pub fn read_held(&mut self) {
        if self.stream.is_none() {
            return;
        }
        if let Some(held) = self.busy_word.as_ref().and_then(BusyWordReader::held) {
            self.take_held(&held);
        }
    }

    /// The daemon's word on its held slots, from an answer or its shm word: it replaces what
    /// was known, except the slot of a hand-over still pending, which the daemon may not have
    /// taken in when it said so.
    fn take_held(&mut self, held: &[u32]) {
        self.held.answer(held);
        for pending in &self.pending {
            if let Pending::HandOver { slot, .. } = *pending {
                self.held.unconfirmed(slot);
            }
        }
    }

    fn reconnect(&mut self) -> Result<()> {
        let mut stream = UnixStream::connect(&self.socket)?;
        stream.set_read_timeout(Some(Duration::from_secs(300)))?;
        wire::write_frame_sync(&mut stream, &self.register, &[], None)?;
        match wire::read_frame_sync(&mut stream, None)?.message {
            Message::Registered { slots, held } => {
                self.slots = slots.into_iter().map(PathBuf::from).collect();
                self.held.answer(&held);
                self.busy_word = self.slots.first().and_then(|slot| {
                    BusyWordReader::open(&slot.with_file_name(busy_word::FILE_NAME))
                });
            }
            Message::Refused { reason } => bail!("ckptd refused the rank: {reason}"),
            other => bail!("ckptd answered {other:?} to Register"),
        }
        self.stream = Some(stream);
        self.broken_at = None;
        Ok(())
    }

    /// One request and its answer, after the answers still pending (the daemon answers in
    /// order). A broken link is retried (with a re-registration) at the next request, then at
    /// most every [`RECONNECT_EVERY`]; until it works, this returns an error and the caller
    /// carries on.
    fn call(&mut self, message: &Message, payload: &[u8]) -> Result<wire::Frame> {
        // What the pending answers say is kept in `answers`; a link they broke is retried
        // by the send.
        let _ = self.settle();
        self.send(message, payload)?;
        self.receive()
    }

    /// Writes one request; its answer is read by the caller, or queued as `pending`.
    fn send(&mut self, message: &Message, payload: &[u8]) -> Result<()> {
        self.last_request_sent = false;
        if self.stream.is_none() {
            if self
                .broken_at
                .is_some_and(|at| at.elapsed() < RECONNECT_EVERY)
            {
                bail!("ckptd link is down");
            }
            if let Err(error) = self.reconnect() {
                self.broken_at = Some(Instant::now());
                return Err(error.context("ckptd link is down"));
            }
            tracing::info!("reconnected to ckptd");
        }
        let stream = self.stream.as_mut().expect("connected");
        self.last_request_sent = true;
        let written = wire::write_frame_sync(stream, message, payload, None);
        written.map_err(|error| self.broke(error))
    }

    /// The answer to the request written last.
    fn receive(&mut self) -> Result<wire::Frame> {
        let stream = self
            .stream
            .as_mut()
            .ok_or_else(|| anyhow!("ckptd link is down"))?;
        let started = Instant::now();
        let read = wire::read_frame_sync(stream, None);
        self.answer_wait += started.elapsed();
        read.map_err(|error| self.broke(error))
    }

    /// How long this client has been blocked reading the daemon's answers so far: the
    /// difference over a span is the part of it spent waiting for the daemon.
    pub fn answer_wait(&self) -> Duration {
        self.answer_wait
    }

    /// The link is gone, and with it the answers still pending: a hand-over among them
    /// counts as not taken, and its slot stays held (the daemon may have taken it) until the
    /// daemon answers again.
    fn broke(&mut self, error: impl std::fmt::Display) -> anyhow::Error {
        self.stream = None;
        for pending in std::mem::take(&mut self.pending) {
            if let Pending::HandOver { step, .. } = pending {
                self.answers.push((step, false));
            }
        }
        anyhow!("ckptd link broke: {error}")
    }

    /// Whether an answer (or the link's end) has come and can be read without waiting.
    fn answer_arrived(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let Some(stream) = &self.stream else {
            return false;
        };
        let mut fds = [PollFd::new(stream, PollFlags::IN)];
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // An error of poll itself is read as an arrival: the read then breaks the link.
        poll(&mut fds, Some(&now)).map_or(true, |ready| ready > 0)
    }

    /// Reads the oldest pending answer, waiting for it. A hand-over's refusal or a link that
    /// broke is an error.
    fn read_pending(&mut self) -> Result<()> {
        let Some(pending) = self.pending.pop_front() else {
            return Ok(());
        };
        let frame = match self.receive() {
            Ok(frame) => frame,
            Err(error) => {
                if let Pending::HandOver { step, .. } = pending {
                    self.answers.push((step, false));
                }
                return Err(error);
            }
        };
        let result = match (pending, frame.message) {
            (Pending::Note, Message::Held { held, .. }) => {
                self.take_held(&held);
                Ok(())
            }
            (Pending::HandOver { step, .. }, Message::Held { held, accepted, .. }) => {
                self.take_held(&held);
                self.answers.push((step, accepted));
                Ok(())
            }
            (Pending::HandOver { step, slot }, Message::Refused { reason }) => {
                tracing::warn!(step, %reason, "ckptd refused the snapshot");
                self.held.refused(slot);
                self.answers.push((step, false));
                Err(io::Error::other(reason).into())
            }
            (Pending::HandOver { step, .. }, other) => {
                self.answers.push((step, false));
                Err(anyhow!("ckptd answered {other:?} to Snapshot"))
            }
            (Pending::Note, other) => Err(anyhow!("ckptd answered {other:?} to a heartbeat")),
        };
        result
    }

    /// Reads the pending answers that have come, without waiting for the others.
    pub fn take_arrived(&mut self) {
        while !self.pending.is_empty() && self.answer_arrived() {
            // What it says is kept; a link it broke is retried by the next request.
            let _ = self.read_pending();
        }
    }

    /// Whether a hand-over's answer is still pending: the daemon has not taken the request
    /// in yet, so it is busy (its busy word may not say so yet).
    pub fn handing_over(&self) -> bool {
        self.pending
            .iter()
            .any(|p| matches!(p, Pending::HandOver { .. }))
    }

    /// The steps this world could start from: (memory-committed, durable).
    /// The steps this world could restore (memory-committed, durable), and data to skip
    /// after the step a supervisor rolled the run back to.
    pub fn choose(&mut self) -> Result<Choice> {
        match self.call(&Message::Choose, &[])?.message {
            Message::StepChoice {
                memory,
                durable,
                skip,
                losses,
                ..
            } => Ok(Choice {
                memory,
                durable: durable.map(|d| d.step),
                skip,
                losses,
            }),
            Message::Refused { reason } => bail!("ckptd could not choose a step: {reason}"),
            other => bail!("ckptd answered {other:?} to Choose"),
        }
    }

    /// Restores the agreed step into a slot (see `Message::Restore`).
    pub fn restore(
        &mut self,
        memory: Option<u64>,
        durable: Option<u64>,
    ) -> Result<Option<Restored>> {
        let frame = self.call(&Message::Restore { memory, durable }, &[])?;
        match frame.message {
            Message::Restored {
                step: Some(step),
                slot: Some(slot),
                tier: Some(tier),
                blobs,
                held,
            } => {
                self.held.answer(&held);
                Ok(Some(Restored {
                    step,
                    slot: slot as usize,
                    tier,
                    blobs: wire::unpack_blobs(&blobs, &frame.payload)?,
                }))
            }
            Message::Restored { held, .. } => {
                self.held.answer(&held);
                Ok(None)
            }
            Message::Refused { reason } => bail!("ckptd could not restore: {reason}"),
            other => bail!("ckptd answered {other:?} to Restore"),
        }
    }

    /// The loop's heartbeat, with `step`'s loss once it is known, written without waiting
    /// for its answer (read with the answers that come later). Past [`PENDING_MAX`] pending
    /// requests it is not written.
    pub fn heartbeat(&mut self, step: u64, compute: Duration, loss: Option<f64>) -> Result<()> {
        let poll = Message::Poll {
            step,
            compute_us: compute.as_micros() as u64,
            loss,
        };
        self.note(&poll)
    }

    /// Writes a request answered with the held slots, without waiting for the answer; with
    /// [`PENDING_MAX`] requests unanswered, drops it instead.
    fn note(&mut self, message: &Message) -> Result<()> {
        self.take_arrived();
        if self.pending.len() >= PENDING_MAX {
            if !self.unsending {
                tracing::warn!(
                    pending = self.pending.len(),
                    "ckptd has not answered this rank's last requests; training goes on, sending it no heartbeats until it does"
                );
            }
            self.unsending = true;
            self.unsent += 1;
            return Ok(());
        }
        self.unsending = false;
        self.send(message, &[])?;
        self.pending.push_back(Pending::Note);
        Ok(())
    }

    /// Heartbeat, with `step`'s loss once it is known; returns whether the daemon is busy.
    pub fn poll(&mut self, step: u64, compute: Duration, loss: Option<f64>) -> Result<bool> {
        let compute_us = compute.as_micros() as u64;
        let poll = Message::Poll {
            step,
            compute_us,
            loss,
        };
        match self.call(&poll, &[])?.message {
            Message::Held { held, busy, .. } => {
                self.held.answer(&held);
                Ok(busy)
            }
            other => bail!("ckptd answered {other:?} to Poll"),
        }
    }

    /// Tells the daemon that `step` failed the health check (`sdc`: the silent-data-
    /// corruption check; `restored`: the step restored before it, whose first step did not
    /// repeat its loss): it tells the supervisor.
    pub fn unhealthy(
        &mut self,
        step: u64,
        reason: &str,
        sdc: Option<lazarus_shared::wire::SdcFinding>,
        restored: Option<u64>,
    ) -> Result<()> {
        let message = Message::Unhealthy {
            step,
            reason: reason.to_string(),
            sdc,
            restored,
        };
        match self.call(&message, &[])?.message {
            Message::Held { .. } => Ok(()),
            other => bail!("ckptd answered {other:?} to Unhealthy"),
        }
    }

    /// The step of this rank's T0 at its daemon (its newest memory-committed snapshot).
    pub fn committed(&mut self, step: u64) -> Result<Option<u64>> {
        let poll = Message::Poll {
            step,
            compute_us: 0,
            loss: None,
        };
        match self.call(&poll, &[])?.message {
            Message::Held {
                held, committed, ..
            } => {
                self.held.answer(&held);
                Ok(committed)
            }
            other => bail!("ckptd answered {other:?} to Poll"),
        }
    }

    /// Tells the daemon this rank finished normally (so its exit is not taken for a crash).
    pub fn bye(&mut self) -> Result<()> {
        self.call(&Message::Bye, &[]).map(|_| ())
    }

    /// Tells the daemon the ranks skipped `step` (it counts skips in its metrics), without
    /// waiting for the answer, as a heartbeat.
    pub fn skipped(&mut self, step: u64) -> Result<()> {
        self.note(&Message::Skipped { step })
    }

    /// Hands `slot` (holding `step`) over and waits for the answer. Returns whether the
    /// daemon took it (also kept for [`Ckptd::take_answers`]). A hand-over whose answer never
    /// came keeps `slot` held until the daemon answers again.
    pub fn snapshot(
        &mut self,
        step: u64,
        slot: usize,
        durable: bool,
        blobs: &[(String, Bytes)],
        stall: Duration,
    ) -> Result<bool> {
        self.hand_over(step, slot, durable, blobs, stall)?;
        self.settle()?;
        Ok(self.answers.last() == Some(&(step, true)))
    }

    /// Hands `slot` (holding `step`) over without waiting for the answer: the rank goes on
    /// training while the daemon takes the request in, and the answer is read once it has
    /// come (or by [`Ckptd::settle`]). Until then `slot` counts as held. On a busy node the
    /// wait for the answer was a wait to be scheduled again, up to tens of milliseconds,
    /// which the training loop need not stand still for. A hand-over still pending is
    /// answered first: the rank's view keeps one unconfirmed slot.
    pub fn hand_over(
        &mut self,
        step: u64,
        slot: usize,
        durable: bool,
        blobs: &[(String, Bytes)],
        stall: Duration,
    ) -> Result<()> {
        let (specs, payload) = wire::pack_blobs(blobs);
        let message = Message::Snapshot {
            step,
            slot: slot as u32,
            durable,
            blobs: specs,
            stall_us: stall.as_micros() as u64,
        };
        if self.handing_over() {
            let _ = self.settle();
        }
        self.take_arrived();
        if let Err(error) = self.send(&message, &payload) {
            if self.last_request_sent {
                self.held.unconfirmed(slot);
            }
            self.answers.push((step, false));
            return Err(error);
        }
        self.held.unconfirmed(slot);
        self.pending.push_back(Pending::HandOver { step, slot });
        Ok(())
    }

    /// Reads every pending answer, waiting for them. A hand-over's refusal, or a link that
    /// breaks first, is an error; the slot of a hand-over whose answer never came stays held
    /// and counts as not taken.
    pub fn settle(&mut self) -> Result<()> {
        let mut result = Ok(());
        while !self.pending.is_empty() {
            let read = self.read_pending();
            if result.is_ok() {
                result = read;
            }
        }
        result
    }

    /// How many heartbeats and skips were not written because the daemon had not answered
    /// [`PENDING_MAX`] requests.
    pub fn unsent(&self) -> u64 {
        self.unsent
    }

    /// The hand-overs answered since the last call: step, and whether the daemon took it.
    pub fn take_answers(&mut self) -> Vec<(u64, bool)> {
        std::mem::take(&mut self.answers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(dir: &Path, count: usize, elements: usize) -> Vec<PathBuf> {
        (0..count)
            .map(|i| {
                let path = dir.join(format!("slot-{i}"));
                std::fs::File::create(&path)
                    .unwrap()
                    .set_len(elements as u64 * 4)
                    .unwrap();
                path
            })
            .collect()
    }

    fn held(answered: &[u32]) -> HeldSlots {
        let mut held = HeldSlots::default();
        held.answer(answered);
        held
    }

    fn write_all(memory: &mut StateMemory, held: &HeldSlots, value: f32) {
        match memory.begin_update(held).unwrap() {
            UpdateTarget::InPlace(state) => state.fill(value),
            UpdateTarget::Copy { from, to } => {
                assert!(from.iter().all(|x| *x != value));
                to.fill(value);
            }
        }
        memory.finish_update();
    }

    #[test]
    fn updates_never_write_a_slot_the_daemon_holds() {
        let dir = tempfile::tempdir().unwrap();
        let paths = slots(dir.path(), 3, 16);
        // The daemon holds slot 0 (say, T0); the fresh state goes to a free slot.
        let mut memory = StateMemory::mapped(&paths, &held(&[0]), &[1.0; 16], None).unwrap();
        assert_eq!(memory.current_slot(), 1);
        write_all(&mut memory, &held(&[0]), 2.0);
        assert_eq!(memory.current_slot(), 1, "not held: in place");
        // Hand slot 1 over: the next update goes to the only free slot, 2.
        write_all(&mut memory, &held(&[0, 1]), 3.0);
        assert_eq!(memory.current_slot(), 2);
        let read = |i: usize| std::fs::read(&paths[i]).unwrap();
        assert_eq!(
            read(1),
            2.0f32.to_le_bytes().repeat(16),
            "the held copy is intact"
        );
        assert_eq!(read(2), 3.0f32.to_le_bytes().repeat(16));
        assert_eq!(read(0), vec![0u8; 64], "slot 0 was never written");
        // The daemon lets go of 0 and holds 1 and 2: the update goes to 0.
        write_all(&mut memory, &held(&[1, 2]), 4.0);
        assert_eq!(memory.current_slot(), 0);
        assert_eq!(read(2), 3.0f32.to_le_bytes().repeat(16));
        // Every slot held is an error, not a write into one of them (nor a panic).
        let mut all = held(&[0, 1]);
        assert!(memory.has_free_slot(&all));
        all.unconfirmed(2);
        assert!(!memory.has_free_slot(&all));
        assert!(memory.begin_update(&all).is_err());
        assert_eq!(read(0), 4.0f32.to_le_bytes().repeat(16));
    }

    #[test]
    fn updates_never_write_a_map_a_save_holds() {
        let none = HeldSlots::NONE;
        let mut memory = StateMemory::heap(vec![1.0; 16]).into_shared(3).unwrap();
        assert_eq!(memory.current(), &[1.0; 16]);
        write_all(&mut memory, &none, 2.0);
        assert_eq!(memory.current_slot(), 0, "not shared: in place");
        // A save writes from the current map: the update goes elsewhere and the save's bytes
        // stay those of the state it took.
        let saved = memory.share_current().unwrap();
        write_all(&mut memory, &none, 3.0);
        assert_eq!(memory.current_slot(), 1);
        assert_eq!(&saved[..], 2.0f32.to_le_bytes().repeat(16));
        // The next save while the first is held (as the delta base): the only free map.
        let next = memory.share_current().unwrap();
        write_all(&mut memory, &none, 4.0);
        assert_eq!(memory.current_slot(), 2);
        assert_eq!(&next[..], 3.0f32.to_le_bytes().repeat(16));
        // Every map held is an error, not a write into one of them (nor a panic).
        let third = memory.share_current().unwrap();
        assert!(!memory.has_free_slot(&none));
        assert!(memory.begin_update(&none).is_err());
        // The first save lets go: its map takes the next state.
        drop(saved);
        write_all(&mut memory, &none, 5.0);
        assert_eq!(memory.current_slot(), 0);
        assert_eq!(&next[..], 3.0f32.to_le_bytes().repeat(16));
        assert_eq!(&third[..], 4.0f32.to_le_bytes().repeat(16));
        drop((next, third));
        write_all(&mut memory, &none, 6.0);
        assert_eq!(memory.current_slot(), 0, "none shared: in place again");
        assert_eq!(memory.current(), &[6.0; 16]);
    }

    #[test]
    fn a_restored_slot_is_used_where_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let paths = slots(dir.path(), 3, 4);
        std::fs::write(&paths[2], 7.0f32.to_le_bytes().repeat(4)).unwrap();
        let memory = StateMemory::mapped(&paths, &held(&[2]), &[0.0; 4], Some(2)).unwrap();
        assert_eq!(memory.current(), &[7.0; 4]);
        assert!(
            StateMemory::mapped(&paths, &HeldSlots::default(), &[0.0; 5], None).is_err(),
            "wrong size"
        );
    }

    /// A daemon on a Unix socket that answers each request from a script, then closes.
    fn scripted_daemon(socket: &Path, answers: Vec<Message>) -> std::thread::JoinHandle<()> {
        let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            for answer in answers {
                wire::read_frame_sync(&mut stream, None).unwrap();
                wire::write_frame_sync(&mut stream, &answer, &[], None).unwrap();
            }
        })
    }

    /// A daemon's side of a registration: accepts the rank, reads its `Register` and answers
    /// that it holds `held` (no slot files).
    fn accept_registration(
        listener: &std::os::unix::net::UnixListener,
        held: &[u32],
    ) -> std::os::unix::net::UnixStream {
        let (mut stream, _) = listener.accept().unwrap();
        wire::read_frame_sync(&mut stream, None).unwrap();
        let registered = Message::Registered {
            slots: Vec::new(),
            held: held.to_vec(),
        };
        wire::write_frame_sync(&mut stream, &registered, &[], None).unwrap();
        stream
    }

    fn answer(held: &[u32], busy: bool, accepted: bool) -> Message {
        Message::Held {
            held: held.to_vec(),
            busy,
            accepted,
            committed: None,
        }
    }

    /// The daemon's side: reads a request that must be a hand-over; its step and slot.
    fn read_hand_over(stream: &mut std::os::unix::net::UnixStream) -> (u64, u32) {
        match wire::read_frame_sync(stream, None).unwrap().message {
            Message::Snapshot { step, slot, .. } => (step, slot),
            other => panic!("{other:?} instead of a hand-over"),
        }
    }

    /// A client registered with a daemon holding slot 0 whose further side is `script`: it
    /// gets the connection and the receiving end of the returned sender, by which the test
    /// lets it go on (say, once the rank went on without an answer).
    fn held_back_daemon<T: Send + 'static>(
        script: impl FnOnce(std::os::unix::net::UnixStream, std::sync::mpsc::Receiver<()>) -> T
            + Send
            + 'static,
    ) -> (
        tempfile::TempDir,
        Ckptd,
        std::sync::mpsc::Sender<()>,
        std::thread::JoinHandle<T>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("ckptd.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let daemon = std::thread::spawn(move || {
            let stream = accept_registration(&listener, &[0]);
            script(stream, released)
        });
        let client = Ckptd::connect(&socket, "run".parse().unwrap(), 0, 1, Vec::new(), 16).unwrap();
        (dir, client, release, daemon)
    }

    /// Regression: a rank kept the held set of its last poll and added each slot it handed
    /// over. The daemon then held T0, the committed snapshot and the upload (3 slots); the
    /// rank handed the fourth over; its daemon died; the next poll failed, and the update
    /// found all four held and panicked, which left the other ranks in a collective forever.
    /// The held set is now the daemon's answer to the hand-over itself.
    #[test]
    fn a_daemon_that_dies_after_a_hand_over_leaves_a_free_slot() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("ckptd.sock");
        let daemon = scripted_daemon(
            &socket,
            vec![
                Message::Registered {
                    slots: Vec::new(),
                    held: vec![0],
                },
                // Before the update: T0 in 0, a snapshot waiting for its commit in 1, an
                // upload in 2.
                answer(&[0, 1, 2], true, false),
                // The commit came: 1 is T0, and 0 is free again. The rank's update went to 3.
                answer(&[1, 2], false, false),
                answer(&[1, 2, 3], true, true),
            ],
        );
        let mut client =
            Ckptd::connect(&socket, "run".parse().unwrap(), 0, 1, Vec::new(), 16).unwrap();
        assert!(client.poll(1, Duration::ZERO, None).unwrap());
        assert!(!client.poll(1, Duration::ZERO, None).unwrap());
        assert!(client.snapshot(1, 3, false, &[], Duration::ZERO).unwrap());
        daemon.join().unwrap();
        // The daemon is gone: the poll fails and the held set stays as it last said.
        assert!(client.poll(2, Duration::ZERO, None).is_err());
        assert_eq!(client.held(), &held(&[1, 2, 3]));
        let paths = slots(dir.path(), 4, 4);
        let mut memory = StateMemory::mapped(&paths, &held(&[0]), &[0.0; 4], None).unwrap();
        assert_eq!(memory.current_slot(), 1);
        write_all(&mut memory, client.held(), 1.0);
        assert_eq!(memory.current_slot(), 0, "the one free slot");
    }

    /// A hand-over whose answer never came keeps its slot held until the daemon speaks again.
    #[test]
    fn an_unanswered_hand_over_stays_held_until_the_daemon_answers() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("ckptd.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            let mut stream = accept_registration(&listener, &[0]);
            // Takes the snapshot request and dies without answering.
            wire::read_frame_sync(&mut stream, None).unwrap();
            drop(stream);
            // Back: the new life registers the rank again and holds only its T0.
            let mut stream = accept_registration(&listener, &[0]);
            wire::read_frame_sync(&mut stream, None).unwrap();
            wire::write_frame_sync(&mut stream, &answer(&[0], false, false), &[], None).unwrap();
        });
        let mut client =
            Ckptd::connect(&socket, "run".parse().unwrap(), 0, 1, Vec::new(), 16).unwrap();
        assert!(client.snapshot(1, 2, false, &[], Duration::ZERO).is_err());
        assert!(client.held().contains(2), "{:?}", client.held());
        // The first request after the break reconnects at once.
        assert!(!client.poll(2, Duration::ZERO, None).unwrap());
        assert_eq!(client.held(), &held(&[0]));
        daemon.join().unwrap();
    }

    /// An in-loop hand-over does not wait for the daemon's answer: the slot counts as held
    /// meanwhile, and the answer is read before the next request's.
    #[test]
    fn a_hand_over_goes_on_without_its_answer_and_the_next_request_reads_it() {
        let (_dir, mut client, release, daemon) = held_back_daemon(move |mut stream, released| {
            assert_eq!(read_hand_over(&mut stream), (1, 2));
            // The answer comes only once the rank has gone on without it.
            let went_on = released.recv_timeout(Duration::from_secs(30)).is_ok();
            wire::write_frame_sync(&mut stream, &answer(&[0, 2], true, true), &[], None).unwrap();
            let poll = wire::read_frame_sync(&mut stream, None).unwrap();
            assert!(matches!(poll.message, Message::Poll { step: 2, .. }));
            wire::write_frame_sync(&mut stream, &answer(&[2], false, false), &[], None).unwrap();
            // Takes the next hand-over and dies without answering.
            wire::read_frame_sync(&mut stream, None).unwrap();
            went_on
        });
        client.hand_over(1, 2, false, &[], Duration::ZERO).unwrap();
        assert!(client.held().contains(2), "{:?}", client.held());
        assert!(client.take_answers().is_empty(), "no answer read yet");
        release.send(()).unwrap();
        assert!(
            !client.poll(2, Duration::ZERO, None).unwrap(),
            "the poll's own answer"
        );
        assert_eq!(client.take_answers(), vec![(1, true)]);
        assert_eq!(client.held(), &held(&[2]));
        client.hand_over(3, 1, false, &[], Duration::ZERO).unwrap();
        assert!(
            daemon.join().unwrap(),
            "the hand-over waited for its answer"
        );
        // No answer came: the slot stays held and the hand-over counts as not taken.
        assert!(client.settle().is_err());
        assert_eq!(client.take_answers(), vec![(3, false)]);
        assert!(client.held().contains(1) && client.held().contains(2));
    }

    /// A heartbeat goes on without its answer. An answer to a request written before a
    /// hand-over (the daemon's state before it) keeps the handed-over slot held; the
    /// hand-over's own answer says what the daemon holds. While it is pending, the daemon is
    /// busy.
    #[test]
    fn an_answer_older_than_a_hand_over_keeps_its_slot_held() {
        let (answered, poll_answered) = std::sync::mpsc::channel::<()>();
        let (_dir, mut client, release, daemon) = held_back_daemon(move |mut stream, released| {
            let poll = wire::read_frame_sync(&mut stream, None).unwrap();
            assert!(matches!(poll.message, Message::Poll { step: 1, .. }));
            assert_eq!(read_hand_over(&mut stream), (1, 2));
            // The rank wrote both before any answer came.
            let went_on = released.recv_timeout(Duration::from_secs(30)).is_ok();
            wire::write_frame_sync(&mut stream, &answer(&[0], false, false), &[], None).unwrap();
            answered.send(()).unwrap();
            released.recv_timeout(Duration::from_secs(30)).unwrap();
            wire::write_frame_sync(&mut stream, &answer(&[0, 2], true, true), &[], None).unwrap();
            went_on
        });
        client.heartbeat(1, Duration::ZERO, None).unwrap();
        client.hand_over(1, 2, false, &[], Duration::ZERO).unwrap();
        assert_eq!(client.busy_now(), Some(true), "the hand-over is pending");
        release.send(()).unwrap();
        poll_answered.recv_timeout(Duration::from_secs(30)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while client.pending.len() == 2 {
            assert!(Instant::now() < deadline, "the poll's answer was not read");
            client.take_arrived();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(client.pending.len(), 1, "only what has come is read");
        let mut expected = held(&[0]);
        expected.unconfirmed(2);
        assert_eq!(client.held(), &expected, "slot 2 is still held");
        assert!(client.take_answers().is_empty());
        release.send(()).unwrap();
        client.settle().unwrap();
        assert_eq!(client.take_answers(), vec![(1, true)]);
        assert_eq!(client.held(), &held(&[0, 2]));
        assert!(
            daemon.join().unwrap(),
            "the heartbeat or the hand-over waited for an answer"
        );
    }

    /// Heartbeats never wait for their answers: past [`PENDING_MAX`] pending, the next are
    /// not written (a daemon that stopped reading does not stop the rank), and once the
    /// daemon answers they are written again. Regression: past 4 pending the heartbeat waited
    /// for the oldest answer, so a daemon SIGSTOPped for seconds held its ranks (and the
    /// world) that long.
    #[test]
    fn heartbeats_past_the_pending_limit_are_dropped_not_waited_on() {
        const AFTER: u64 = 1_000;
        let (_dir, mut client, release, daemon) = held_back_daemon(move |mut stream, released| {
            let heartbeat_step = |stream: &mut UnixStream| match wire::read_frame_sync(stream, None)
                .unwrap()
                .message
            {
                Message::Poll { step, .. } => step,
                other => panic!("{other:?} instead of a heartbeat"),
            };
            let mut steps = Vec::new();
            for _ in 0..PENDING_MAX {
                steps.push(heartbeat_step(&mut stream));
            }
            let went_on = released.recv_timeout(Duration::from_secs(30)).is_ok();
            for _ in 0..PENDING_MAX {
                wire::write_frame_sync(&mut stream, &answer(&[0], false, false), &[], None)
                    .unwrap();
            }
            // The next request written is the one after the answers, none of those dropped.
            steps.push(heartbeat_step(&mut stream));
            wire::write_frame_sync(&mut stream, &answer(&[0], false, false), &[], None).unwrap();
            (went_on, steps)
        });
        let extra = 3;
        for step in 0..PENDING_MAX as u64 + extra {
            client.heartbeat(step, Duration::ZERO, None).unwrap();
        }
        assert_eq!(client.pending.len(), PENDING_MAX);
        assert_eq!(client.unsent(), extra);
        release.send(()).unwrap();
        client.settle().unwrap();
        client.heartbeat(AFTER, Duration::ZERO, None).unwrap();
        client.settle().unwrap();
        assert_eq!(client.unsent(), extra, "written again once answered");
        let (went_on, steps) = daemon.join().unwrap();
        assert!(went_on, "a heartbeat past the limit waited for an answer");
        let mut expected: Vec<u64> = (0..PENDING_MAX as u64).collect();
        expected.push(AFTER);
        assert_eq!(steps, expected);
    }

    /// The rank reads its daemon's busy word instead of asking; without one it has no word.
    #[test]
    fn the_busy_word_beside_the_slots_is_read_without_asking() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("ckptd.sock");
        let paths = slots(dir.path(), 4, 4);
        let word = dir.path().join(busy_word::FILE_NAME);
        // A client registered with a daemon whose answer holds `held`.
        let registered = |held: Vec<u32>| {
            let _ = std::fs::remove_file(&socket);
            let registered = Message::Registered {
                slots: paths.iter().map(|p| p.display().to_string()).collect(),
                held,
            };
            let daemon = scripted_daemon(&socket, vec![registered]);
            let client =
                Ckptd::connect(&socket, "run".parse().unwrap(), 0, 1, Vec::new(), 16).unwrap();
            daemon.join().unwrap();
            client
        };
        std::fs::write(&word, 1u32.to_ne_bytes()).unwrap();
        let mut client = registered(Vec::new());
        assert_eq!(client.busy_now(), Some(true));
        std::fs::write(&word, 0u32.to_ne_bytes()).unwrap();
        assert_eq!(client.busy_now(), Some(false), "the same word, mapped");

        // Regression: with three slots held at the last answer, the word is not enough (the
        // rank once handed slot 2 over on it while its view held 0, 1 and 3, the daemon died
        // before answering, and the update found every slot held).
        assert_eq!(registered(vec![0, 1, 3]).busy_now(), None, "ask instead");

        // A daemon that keeps its held slots in the word too: they are read from there, and
        // the word is then enough.
        let daemon_word = busy_word::BusyWord::create(&word, 0o600).unwrap();
        daemon_word.set(false);
        daemon_word.set_held(&[1]);
        let mut client = registered(vec![0, 1, 3]);
        assert_eq!(client.busy_now(), Some(false));
        assert_eq!(client.held(), &held(&[1]));
        // A hand-over not yet answered keeps its slot held, whatever the word says.
        client.held.unconfirmed(2);
        client
            .pending
            .push_back(Pending::HandOver { step: 1, slot: 2 });
        client.read_held();
        let mut expected = held(&[1]);
        expected.unconfirmed(2);
        assert_eq!(client.held(), &expected);
        drop(daemon_word);

        // A daemon that keeps no word is asked instead.
        std::fs::remove_file(&word).unwrap();
        assert_eq!(registered(Vec::new()).busy_now(), None);
    }
}
