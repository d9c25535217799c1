//! `trainer train --trace FILE`: a timeline of the first steps of a launch, written as a
//! Chrome trace (JSON that Perfetto and `chrome://tracing` open), and the summary of one step
//! of such a file by phase and by op (`trainer trace-summary FILE`).
//!
//! The training code marks its phases and ops with `tracing` spans: `step` (with its number),
//! `forward`, `backward`, `optimizer`, the ops inside them (`attention`, `rms_norm`,
//! `swiglu`, `grouped_matmul`, `lm_head_loss`, their `*_backward`, `expert_dispatch`,
//! `expert_combine`, `reduce_scatter`, `all_gather`, ...) and `mpi_wait`, the time a rank
//! waits inside MPI for the others. With no trace asked for, no subscriber is installed and a
//! span costs a relaxed load.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use anyhow::{bail, Context, Result};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer;

/// Whether spans are recorded now: only for the first steps of a launch.
static RECORDING: AtomicBool = AtomicBool::new(false);
/// Steps still to record.
static STEPS_LEFT: AtomicU64 = AtomicU64::new(0);

/// A trace being written; the file is complete once this drops.
pub struct Trace {
    guard: Option<tracing_chrome::FlushGuard>,
    pub path: PathBuf,
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trace").field("path", &self.path).finish()
    }
}

impl Trace {
    /// Finishes the file now (before the process exits without unwinding).
    pub fn finish(&mut self) {
        RECORDING.store(false, Ordering::Relaxed);
        self.guard.take();
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The file rank `rank` of `size` writes for `--trace path`: `path` itself in a one-rank
/// world, else `path` with `.rank<r>` before its extension (`trace.json` -> `trace.rank1.json`).
pub fn file_for(path: &Path, rank: usize, size: usize) -> PathBuf {
    if size <= 1 {
        return path.to_path_buf();
    }
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// Starts writing this rank's trace of the next `steps` steps (see [`file_for`]).
pub fn start(path: &Path, rank: usize, size: usize, steps: u64) -> Result<Trace> {
    let path = file_for(path, rank, size);
    let file = std::fs::File::create(&path)
        .with_context(|| format!("creating the trace file {}", path.display()))?;
    let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new()
        .writer(file)
        .include_args(true)
        .include_locations(false)
        .build();
    // Asked at every span (a plain filter_fn's answer would be cached per callsite).
    let layer = layer.with_filter(tracing_subscriber::filter::dynamic_filter_fn(|_, _| {
        RECORDING.load(Ordering::Relaxed)
    }));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
        .context("a tracing subscriber is installed already")?;
    STEPS_LEFT.store(steps, Ordering::Relaxed);
    RECORDING.store(steps > 0, Ordering::Relaxed);
    Ok(Trace {
        guard: Some(guard),
        path,
    })
}

/// A step begins: recording goes on while traced steps are left, then stops for good.
pub fn step_begins() {
    let left = STEPS_LEFT.load(Ordering::Relaxed);
    if left == 0 {
        RECORDING.store(false, Ordering::Relaxed);
    } else {
        STEPS_LEFT.store(left - 1, Ordering::Relaxed);
    }
}

/// One op's or phase's time within a step.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    pub name: String,
    pub calls: u64,
    /// Milliseconds inside the span, its children included.
    pub total_ms: f64,
    /// Milliseconds inside the span outside its children.
    pub self_ms: f64,
}

/// A step of a trace file, summed by span name.
#[derive(Clone, Debug)]
pub struct StepProfile {
    pub step: u64,
    pub step_ms: f64,
    /// By total time, longest first.
    pub ops: Vec<OpTime>,
}

/// One begin or end of a span, as the file has it.
#[derive(Debug, serde::Deserialize)]
struct Entry {
    ph: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    ts: f64,
    #[serde(default)]
    tid: u64,
    #[serde(default)]
    args: serde_json::Value,
}

/// Step `step` of the trace at `path` (the last traced step when `None`): its number, its
/// length in ms, and the spans inside it on its thread, in order (the `step` span left out).
fn read_step(path: &Path, step: Option<u64>) -> Result<(u64, f64, Vec<Entry>)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the trace {}", path.display()))?;
    let entries: Vec<Entry> = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a complete Chrome trace", path.display()))?;
    // The step spans: (step, thread, start, end).
    let mut steps = Vec::new();
    let mut open: BTreeMap<u64, (u64, f64)> = BTreeMap::new();
    for entry in entries.iter().filter(|e| e.name == "step") {
        match entry.ph.as_str() {
            "B" => {
                // The layer writes span fields as text.
                let number = match &entry.args["step"] {
                    serde_json::Value::String(text) => text.parse().unwrap_or(0),
                    other => other.as_u64().unwrap_or(0),
                };
                open.insert(entry.tid, (number, entry.ts));
            }
            "E" => {
                if let Some((number, start)) = open.remove(&entry.tid) {
                    steps.push((number, entry.tid, start, entry.ts));
                }
            }
            _ => {}
        }
    }
    let chosen = match step {
        Some(wanted) => steps.iter().find(|s| s.0 == wanted),
        None => steps.last(),
    };
    let Some(&(number, tid, start, end)) = chosen else {
        bail!(
            "{} holds no complete step{} (traced: {:?})",
            path.display(),
            step.map(|s| format!(" {s}")).unwrap_or_default(),
            steps.iter().map(|s| s.0).collect::<Vec<_>>()
        );
    };
    let inside = entries
        .into_iter()
        .filter(|e| e.tid == tid && e.ts >= start && e.ts <= end && e.name != "step")
        .collect();
    Ok((number, (end - start) / 1e3, inside))
}

/// A span as it closed: its name, and in µs its length, its time in the spans inside it,
/// and its time in the `mpi_wait` spans directly inside it.
struct Closed {
    name: String,
    took: f64,
    children: f64,
    waited: f64,
}

/// The spans of `entries` (begins and ends nesting on one thread), in the order they close.
fn closed_spans(entries: &[Entry]) -> Vec<Closed> {
    // A stack of (name, start, time in children, time in mpi_wait children).
    let mut stack: Vec<(&str, f64, f64, f64)> = Vec::new();
    let mut closed = Vec::new();
    for entry in entries {
        match entry.ph.as_str() {
            "B" => stack.push((&entry.name, entry.ts, 0.0, 0.0)),
            "E" => {
                let Some((name, began, children, waited)) = stack.pop() else {
                    continue;
                };
                let took = entry.ts - began;
                if let Some(parent) = stack.last_mut() {
                    parent.2 += took;
                    if name == "mpi_wait" {
                        parent.3 += took;
                    }
                }
                closed.push(Closed {
                    name: name.to_string(),
                    took,
                    children,
                    waited,
                });
            }
            _ => {}
        }
    }
    closed
}

/// The profile of step `step` of the trace at `path` (the last traced step when `None`):
/// every span inside that step's `step` span on its thread, summed by name.
pub fn profile(path: &Path, step: Option<u64>) -> Result<StepProfile> {
    let (number, step_ms, entries) = read_step(path, step)?;
    let mut sums: BTreeMap<String, OpTime> = BTreeMap::new();
    for span in closed_spans(&entries) {
        let sum = sums.entry(span.name.clone()).or_insert(OpTime {
            name: span.name,
            calls: 0,
            total_ms: 0.0,
            self_ms: 0.0,
        });
        sum.calls += 1;
        sum.total_ms += span.took / 1e3;
        sum.self_ms += (span.took - span.children) / 1e3;
    }
    let mut ops: Vec<OpTime> = sums.into_values().collect();
    ops.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
    Ok(StepProfile {
        step: number,
        step_ms,
        ops,
    })
}

/// The waits inside MPI of one op (an exchange or collective) in one step, split across the
/// ranks whose traces were read.
#[derive(Clone, Debug, PartialEq)]
pub struct WaitSplit {
    /// The span the waits were in (the innermost one around them).
    pub op: String,
    /// Its calls in the step, as many on every rank.
    pub calls: u64,
    /// Per rank, ms: in each call, the least any rank waited in it. Every rank waited that
    /// long, so no rank was waiting for another to arrive: the transfer and MPI's latency.
    pub together_ms: f64,
    /// Mean per rank, ms: in each call, what a rank waited beyond the least: the time it
    /// waited for slower ranks to arrive (another rank's extra work: load imbalance).
    pub for_others_ms: f64,
}

/// How step `step`'s waits inside MPI split, call by call, between waiting together and
/// waiting for other ranks, for the traces of several ranks of one world (`trace.rank0.json`,
/// `trace.rank1.json`, ...). Calls are matched by their order among the op's calls in the
/// step; an op that some rank called a different number of times (a pipeline stage's, say)
/// is left out.
pub fn wait_split(paths: &[PathBuf], step: Option<u64>) -> Result<Vec<WaitSplit>> {
    let mut per_rank: Vec<BTreeMap<String, Vec<f64>>> = Vec::new();
    let mut number = None;
    for path in paths {
        let (this, _, entries) = read_step(path, step.or(number))?;
        number = Some(this);
        // Per op, its calls' waits (µs), in order.
        let mut calls: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for span in closed_spans(&entries) {
            if span.name != "mpi_wait" {
                calls.entry(span.name).or_default().push(span.waited);
            }
        }
        per_rank.push(calls);
    }
    let Some(first) = per_rank.first() else {
        bail!("no trace to read");
    };
    let ranks = per_rank.len() as f64;
    let mut splits = Vec::new();
    for op in first.keys() {
        let counts: Vec<usize> = per_rank
            .iter()
            .map(|r| r.get(op).map_or(0, Vec::len))
            .collect();
        let waited = per_rank.iter().any(|r| {
            r.get(op)
                .is_some_and(|calls| calls.iter().any(|w| *w > 0.0))
        });
        if !waited || counts.iter().any(|c| *c != counts[0]) {
            continue;
        }
        let (mut together, mut apart) = (0.0, 0.0);
        for call in 0..counts[0] {
            let waits: Vec<f64> = per_rank.iter().map(|r| r[op][call]).collect();
            let least = waits.iter().copied().fold(f64::INFINITY, f64::min);
            together += least;
            apart += waits.iter().map(|w| w - least).sum::<f64>();
        }
        splits.push(WaitSplit {
            op: op.clone(),
            calls: counts[0] as u64,
            together_ms: together / 1e3,
            for_others_ms: apart / ranks / 1e3,
        });
    }
    splits.sort_by(|a, b| {
        (b.together_ms + b.for_others_ms).total_cmp(&(a.together_ms + a.for_others_ms))
    });
    Ok(splits)
}

/// [`wait_split`]'s figures as a table, for `ranks` ranks.
pub fn wait_split_table(splits: &[WaitSplit], ranks: usize) -> String {
    let mut text = format!(
        "waits inside MPI across the {ranks} ranks, by op: waiting together (every rank waiting: the transfer) and for other ranks (mean per rank: their extra work)\n  {:<28} {:>6} {:>13} {:>17}\n",
        "span", "calls", "together ms", "for others ms"
    );
    for split in splits {
        text += &format!(
            "  {:<28} {:>6} {:>13.2} {:>17.2}\n",
            split.op, split.calls, split.together_ms, split.for_others_ms
        );
    }
    text
}

impl std::fmt::Display for StepProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "step {}: {:.1} ms", self.step, self.step_ms)?;
        writeln!(
            f,
            "  {:<28} {:>6} {:>10} {:>7} {:>10} {:>7}",
            "span", "calls", "total ms", "%", "self ms", "%"
        )?;
        let share = |ms: f64| 100.0 * ms / self.step_ms.max(1e-9);
        for op in &self.ops {
            writeln!(
                f,
                "  {:<28} {:>6} {:>10.2} {:>6.1}% {:>10.2} {:>6.1}%",
                op.name,
                op.calls,
                op.total_ms,
                share(op.total_ms),
                op.self_ms,
                share(op.self_ms)
            )?;
        }
        Ok(())
    }
}

/// How long one thread has been ready to run but waiting for a CPU, since it started (the
/// kernel's `run_delay` in `/proc/thread-self/schedstat`); zero where the kernel does not
/// say. The difference over a span of the training loop tells waiting for the cores (other
/// processes on them) apart from waiting for an answer. The file is opened once, by the
/// thread it describes, and read again from its start: a read is one syscall, on the
/// snapshot hand-off's path.
#[derive(Debug)]
pub struct CpuWait(Option<std::fs::File>);

impl CpuWait {
    /// For the calling thread.
    pub fn of_this_thread() -> Self {
        Self(std::fs::File::open("/proc/thread-self/schedstat").ok())
    }

    pub fn now(&self) -> std::time::Duration {
        use std::os::unix::fs::FileExt;
        let mut buffer = [0u8; 128];
        self.0
            .as_ref()
            .and_then(|file| file.read_at(&mut buffer, 0).ok())
            .and_then(|len| std::str::from_utf8(&buffer[..len]).ok())
            .and_then(|text| text.split_whitespace().nth(1)?.parse().ok())
            .map_or(std::time::Duration::ZERO, std::time::Duration::from_nanos)
    }
}

#[cfg(test)]
mod tests {
    use super::{file_for, profile, wait_split, wait_split_table, CpuWait};

    /// Read again through the one open file, the wait matches a fresh read of the kernel's
    /// figure taken between two reads.
    #[test]
    fn the_cpu_wait_rereads_the_threads_schedstat() {
        let wait = CpuWait::of_this_thread();
        let before = wait.now();
        let fresh = std::fs::read_to_string("/proc/thread-self/schedstat")
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .map(std::time::Duration::from_nanos)
            .unwrap();
        let after = wait.now();
        assert!(
            before <= fresh && fresh <= after,
            "{before:?} {fresh:?} {after:?}"
        );
        assert!(after >= wait.now().saturating_sub(std::time::Duration::from_secs(1)));
    }
    use std::path::Path;

    #[test]
    fn ranks_write_files_of_their_own() {
        assert_eq!(file_for(Path::new("t.json"), 0, 1), Path::new("t.json"));
        assert_eq!(
            file_for(Path::new("out/t.json"), 1, 2),
            Path::new("out/t.rank1.json")
        );
        assert_eq!(file_for(Path::new("t"), 3, 4), Path::new("t.rank3"));
    }

    /// Two ranks' traces of one step: in the first exchange rank 0 waits 0.5 ms and rank 1
    /// 0.1 ms (0.1 together, 0.4 more for rank 0: 0.2 mean); in the second each waits 0.3
    /// ms in two waits (all together); the all-reduce, called once on rank 0 and twice on
    /// rank 1, is left out.
    #[test]
    fn waits_split_call_by_call_into_together_and_for_other_ranks() {
        let dir = tempfile::tempdir().unwrap();
        let event = |ph: &str, name: &str, ts: f64| serde_json::json!({"ph": ph, "pid": 1, "name": name, "ts": ts, "tid": 1});
        let write = |name: &str, waits: [f64; 3], all_reduces: usize| {
            let mut entries = vec![
                serde_json::json!({"ph": "B", "pid": 1, "name": "step", "ts": 0.0, "tid": 1, "args": {"step": "3"}}),
                event("B", "layer", 0.0),
                event("B", "expert_combine", 100.0),
                event("B", "mpi_wait", 100.0),
                event("E", "mpi_wait", 100.0 + waits[0]),
                event("E", "expert_combine", 1000.0),
                event("B", "expert_combine", 1000.0),
                event("B", "mpi_wait", 1000.0),
                event("E", "mpi_wait", 1000.0 + waits[1]),
                event("B", "mpi_wait", 1500.0),
                event("E", "mpi_wait", 1500.0 + waits[2]),
                event("E", "expert_combine", 2000.0),
                event("E", "layer", 2000.0),
            ];
            for i in 0..all_reduces {
                let at = 2000.0 + 100.0 * i as f64;
                entries.extend([
                    event("B", "all_reduce", at),
                    event("B", "mpi_wait", at),
                    event("E", "mpi_wait", at + 50.0),
                    event("E", "all_reduce", at + 100.0),
                ]);
            }
            entries.push(
                serde_json::json!({"ph": "E", "pid": 1, "name": "step", "ts": 3000.0, "tid": 1}),
            );
            let path = dir.path().join(name);
            std::fs::write(&path, serde_json::to_vec(&entries).unwrap()).unwrap();
            path
        };
        let rank0 = write("t.rank0.json", [500.0, 100.0, 200.0], 1);
        let rank1 = write("t.rank1.json", [100.0, 200.0, 100.0], 2);
        let splits = wait_split(&[rank0, rank1], None).unwrap();
        assert_eq!(splits.len(), 1, "{splits:?}");
        let combine = &splits[0];
        assert_eq!((combine.op.as_str(), combine.calls), ("expert_combine", 2));
        // 0.1 ms together in the first call, 0.3 in the second.
        assert!((combine.together_ms - 0.4).abs() < 1e-9, "{combine:?}");
        // Rank 0 waited 0.4 ms more in the first call: 0.2 per rank.
        assert!((combine.for_others_ms - 0.2).abs() < 1e-9, "{combine:?}");
        let table = wait_split_table(&splits, 2);
        assert!(table.contains("expert_combine"), "{table}");
        assert!(wait_split(&[], None).is_err());
    }

    #[test]
    fn a_step_sums_its_spans_by_name_with_their_own_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        let event = |ph: &str, name: &str, ts: f64, tid: u64| serde_json::json!({"ph": ph, "pid": 1, "name": name, "ts": ts, "tid": tid});
        let mut entries = vec![
            serde_json::json!({"ph": "B", "pid": 1, "name": "step", "ts": 0.0, "tid": 1, "args": {"step": "7"}}),
            event("B", "forward", 0.0, 1),
            event("B", "attention", 100.0, 1),
            event("E", "attention", 400.0, 1),
            event("B", "attention", 500.0, 1),
            event("B", "mpi_wait", 600.0, 1),
            event("E", "mpi_wait", 700.0, 1),
            event("E", "attention", 800.0, 1),
            event("E", "forward", 1000.0, 1),
            // Another thread's spans are not this step's.
            event("B", "forward", 100.0, 2),
            event("E", "forward", 900.0, 2),
            event("B", "backward", 1000.0, 1),
            event("E", "backward", 3000.0, 1),
        ];
        entries
            .push(serde_json::json!({"ph": "E", "pid": 1, "name": "step", "ts": 3000.0, "tid": 1}));
        std::fs::write(&path, serde_json::to_vec(&entries).unwrap()).unwrap();
        let step = profile(&path, None).unwrap();
        assert_eq!(step.step, 7);
        assert!((step.step_ms - 3.0).abs() < 1e-9);
        let get = |name: &str| step.ops.iter().find(|o| o.name == name).unwrap().clone();
        let forward = get("forward");
        assert_eq!(forward.calls, 1);
        assert!((forward.total_ms - 1.0).abs() < 1e-9);
        // 1 ms less two attentions (0.3 + 0.3 ms).
        assert!((forward.self_ms - 0.4).abs() < 1e-9, "{forward:?}");
        let attention = get("attention");
        assert_eq!(attention.calls, 2);
        assert!((attention.self_ms - 0.5).abs() < 1e-9, "{attention:?}");
        assert_eq!(step.ops[0].name, "backward");
        assert!(profile(&path, Some(8)).is_err());
    }
}
