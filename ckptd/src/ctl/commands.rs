//! One function per `ckptctl` command. Each prints a table, or JSON with `--json`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use lazarus_shared::format::{DType, DimRange};
use lazarus_shared::hf_olmoe;
use lazarus_shared::progress::{TrainerProgress, WrittenLayout, TRAINER_BLOB};
use lazarus_shared::safetensors_io::{self, HEADER_BLOB_PREFIX};
use lazarus_shared::store::{
    ByteSource, Checkpoint, DeltaBases, FileSource, GcPolicy, OpenMode, RunStore, SourceRange,
    SourcedShard, SourcedTensor, StepState, Store, StoreOptions, VerifyOptions,
};
use lazarus_shared::{RunId, StepKey};
use serde::Serialize;

use super::output::{self, Bar};
use super::{Cli, Command, ExportFormat, IndexAction, IntegrityProblems, UsageError};

pub async fn run(cli: Cli) -> Result<()> {
    let bars = !cli.json;
    match &cli.command {
        Command::Runs => runs(&cli).await,
        Command::List { run } => list(&cli, run).await,
        Command::Show { run, step } => show(&cli, run, step).await,
        Command::Verify {
            run,
            step,
            all,
            read_data,
            sample,
        } => {
            let options = VerifyOptions {
                read_data: *read_data,
                sample_percent: *sample,
            };
            verify(&cli, run, step.as_deref(), *all, &options, bars).await
        }
        Command::Diff { run, a, b } => diff(&cli, run, a, b).await,
        Command::Import {
            run,
            step,
            delta,
            chunk_bytes,
            files,
        } => import(&cli, run, *step, *delta, *chunk_bytes, files, bars).await,
        Command::Export {
            run,
            step,
            format,
            out,
        } => export(&cli, run, step, *format, out, bars).await,
        Command::Restore { run, step, out } => restore(&cli, run, step, out, bars).await,
        Command::Rollback { run, to, reason } => rollback(&cli, run, to, reason).await,
        Command::Gc {
            run,
            keep_last,
            keep_every,
            grace,
            staging_grace,
            dry_run,
        } => {
            let policy = GcPolicy {
                keep_last: *keep_last,
                keep_every: *keep_every,
                grace_ms: grace.as_millis() as u64,
                staging_grace_ms: staging_grace.as_millis() as u64,
                dry_run: *dry_run,
            };
            gc(&cli, run, &policy, bars).await
        }
        Command::Index { action } => index(&cli, action, bars).await,
        Command::Status {
            leader,
            run,
            key_file,
        } => status(&cli, *leader, run.as_deref(), key_file).await,
        Command::Events { run } => events(&cli, run).await,
    }
}

async fn events(cli: &Cli, run: &str) -> Result<()> {
    let store = cli.open_store(OpenMode::Existing).await?;
    let events = store.run(&run_id(run)?).events().await?;
    if cli.json {
        output::json(&events);
        return Ok(());
    }
    // Each phase's duration is the time since the previous event of the same generation
    // (for a fault: since the previous event at all, e.g. the launch or the first step).
    let mut rows = Vec::new();
    let mut previous: Option<u64> = None;
    for event in &events {
        let took = previous
            .map(|p| format!("+{:.3} s", event.unix_ms.saturating_sub(p) as f64 / 1000.0))
            .unwrap_or_default();
        previous = Some(event.unix_ms);
        rows.push(vec![
            humantime::format_rfc3339_millis(
                std::time::UNIX_EPOCH + std::time::Duration::from_millis(event.unix_ms),
            )
            .to_string(),
            event.generation.to_string(),
            if event.epoch == 0 {
                "-".to_string()
            } else {
                event.epoch.to_string()
            },
            event.kind.clone(),
            took,
            event.detail.clone(),
        ]);
    }
    output::table(
        &["TIME", "GEN", "EPOCH", "EVENT", "AFTER PREVIOUS", "DETAIL"],
        &rows,
    );
    for line in takeovers(&events) {
        say!("{line}");
    }
    Ok(())
}

/// One line per leader takeover: how long from the lost leader's last word to the election,
/// and to the new leader's first act of supervision.
fn takeovers(events: &[lazarus_shared::wire::Event]) -> Vec<String> {
    let mut lines = Vec::new();
    for (i, elected) in events.iter().enumerate() {
        if elected.kind != "elected" {
            continue;
        }
        let lost = events[..i]
            .iter()
            .rev()
            .find(|e| e.kind == "leader_lost" && e.epoch == elected.epoch);
        let Some(lost) = lost else {
            continue;
        };
        let seconds = |e: &lazarus_shared::wire::Event| {
            e.unix_ms.saturating_sub(lost.unix_ms) as f64 / 1000.0
        };
        let acted = events[i + 1..]
            .iter()
            .find(|e| e.epoch == elected.epoch && ["adopted", "fault"].contains(&e.kind.as_str()));
        lines.push(format!(
            "takeover to epoch {}: elected {:.2} s after the leader was last heard from{}",
            elected.epoch,
            seconds(elected),
            acted.map_or(String::new(), |e| format!(
                ", supervising again ({}) after {:.2} s",
                e.kind,
                seconds(e)
            ))
        ));
    }
    lines
}

/// Asks the leader for the job's status: at `--leader`, else (or when it does not lead or
/// answer) where the run's newest leadership record in the store points.
async fn status(
    cli: &Cli,
    leader: Option<std::net::SocketAddr>,
    run: Option<&str>,
    key_file: &std::path::Path,
) -> Result<()> {
    use lazarus_shared::wire::{self, JobKey, Message};
    let key = JobKey::from_file(key_file).map_err(|e| UsageError(e.to_string()))?;
    if leader.is_none() && run.is_none() {
        return Err(UsageError(
            "ckptctl status needs --leader ADDRESS or --run RUN (with --store)".into(),
        )
        .into());
    }
    let mut asked = Vec::new();
    let mut next = leader;
    let status = loop {
        let address = match next.take() {
            Some(address) => address,
            None => {
                let Some(run) = run else {
                    bail!("the daemon at {} does not lead, and no --run was given to look the leader up in the store", asked.iter().map(|a: &std::net::SocketAddr| a.to_string()).collect::<Vec<_>>().join(", "));
                };
                let store = cli.open_store(OpenMode::Existing).await?;
                let record = store
                    .run(&run_id(run)?)
                    .leadership()
                    .await?
                    .ok_or_else(|| {
                        anyhow::anyhow!("run {run} has no leader record in the store")
                    })?;
                let address: std::net::SocketAddr = record.address.parse()?;
                if asked.contains(&address) {
                    bail!(
                        "the leader of epoch {} ({address}) does not answer",
                        record.epoch
                    );
                }
                address
            }
        };
        asked.push(address);
        let answer = crate::daemon::framing::request_frame(&key, address, &Message::StatusRequest)
            .await
            .map(|frame| (frame.message, frame.payload));
        match answer {
            Ok((Message::Status { json_bytes }, payload)) => {
                break wire::unpack_status(json_bytes, &payload)?;
            }
            Ok((
                Message::NotLeader {
                    leader: Some(other),
                    ..
                },
                _,
            )) => {
                let other: std::net::SocketAddr = other.parse()?;
                if !asked.contains(&other) {
                    next = Some(other);
                }
            }
            Ok((other, _)) => bail!("the daemon at {address} answered {other:?}"),
            Err(error) if run.is_some() => {
                tracing::warn!(%address, error = %format!("{error:#}"), "no answer; looking the leader up in the store");
            }
            Err(error) => {
                return Err(error).with_context(|| format!("asking the leader ckptd at {address}"))
            }
        }
    };
    if cli.json {
        output::json(&status);
        return Ok(());
    }
    say!("leader: {} (epoch {})", status.leader, status.epoch);
    say!(
        "succession: {}",
        if status.succession.is_empty() {
            "none (no other daemon may lead)".to_string()
        } else {
            status
                .succession
                .iter()
                .map(|s| s.node.clone())
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    if let Some(s) = &status.supervision {
        let list = |nodes: &[String]| {
            if nodes.is_empty() {
                "-".to_string()
            } else {
                nodes.join(",")
            }
        };
        say!(
            "supervising (launch generation {}): active {}, spares {}, drained {}",
            s.generation,
            list(&s.active),
            list(&s.spares),
            list(&s.drained)
        );
    }
    let rows: Vec<Vec<String>> = status
        .nodes
        .iter()
        .map(|n| {
            vec![
                n.node.clone(),
                n.address.clone(),
                format!("{:.1}s ago", n.last_seen_ms_ago as f64 / 1000.0),
                n.ranks
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                n.t0_steps
                    .iter()
                    .map(|(_, s)| s.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            ]
        })
        .collect();
    output::table(&["NODE", "ADDRESS", "SEEN", "RANKS", "T0 STEPS"], &rows);
    for run in &status.runs {
        say!(
            "run {}: world size {}, memory-committed step {}, durable step {}",
            run.run,
            run.world_size,
            run.memory_step.map_or("-".into(), |s| s.to_string()),
            run.durable_step.map_or("-".into(), |s| s.to_string())
        );
        let rows: Vec<Vec<String>> = run
            .ranks
            .iter()
            .map(|r| {
                vec![
                    r.rank.to_string(),
                    r.node.clone(),
                    r.pid.to_string(),
                    r.step.to_string(),
                    format!("{:.1}s ago", r.last_seen_ms_ago as f64 / 1000.0),
                    r.compute_ms.map_or("-".into(), |ms| format!("{ms:.1}")),
                ]
            })
            .collect();
        output::table(
            &["RANK", "NODE", "PID", "STEP", "SEEN", "COMPUTE MS/STEP"],
            &rows,
        );
        let stragglers: Vec<String> = run
            .ranks
            .iter()
            .filter(|r| r.straggler)
            .map(|r| {
                format!(
                    "rank {} on {} ({:.1} ms per step)",
                    r.rank,
                    r.node,
                    r.compute_ms.unwrap_or(0.0)
                )
            })
            .collect();
        say!(
            "stragglers: {}",
            if stragglers.is_empty() {
                "none".to_string()
            } else {
                stragglers.join(", ")
            }
        );
    }
    Ok(())
}

fn run_id(text: &str) -> Result<RunId> {
    text.parse::<RunId>()
        .map_err(|e| UsageError(e.to_string()).into())
}

async fn open_run(cli: &Cli, run: &str) -> Result<RunStore> {
    open_run_with(cli, run, cli.store_options()).await
}

async fn open_run_with(cli: &Cli, run: &str, options: StoreOptions) -> Result<RunStore> {
    let run = run_id(run)?;
    let store = cli.open_store_with(OpenMode::Existing, options).await?;
    let handle = store.run(&run);
    handle.info().await?;
    Ok(handle)
}

/// A committed step, for the commands that only read it (show, diff, export, restore): they
/// never consult the local chunk index, so it is not opened (as for verify).
async fn open_step(cli: &Cli, run: &str, step: &str) -> Result<Checkpoint> {
    let run = open_run_with(cli, run, cli.store_options_without_index()).await?;
    let key = run.resolve_step(step).await?;
    Ok(run.open_checkpoint(key).await?)
}

async fn runs(cli: &Cli) -> Result<()> {
    #[derive(Serialize)]
    struct RunLine {
        run: RunId,
        latest: Option<StepKey>,
        committed_steps: usize,
        steps: usize,
    }
    let store = cli.open_store(OpenMode::Existing).await?;
    let mut lines = Vec::new();
    for run in store.runs().await? {
        let catalog = store.run(&run).catalog().await?;
        lines.push(RunLine {
            latest: catalog.latest,
            committed_steps: catalog.visible_commits().count(),
            steps: catalog.steps.len(),
            run,
        });
    }
    if cli.json {
        output::json(&lines);
    } else {
        let rows: Vec<Vec<String>> = lines
            .iter()
            .map(|l| {
                vec![
                    l.run.to_string(),
                    l.latest.map_or("-".into(), |s| s.to_string()),
                    l.committed_steps.to_string(),
                    l.steps.to_string(),
                ]
            })
            .collect();
        output::table(&["RUN", "LATEST", "COMMITTED", "STEPS"], &rows);
    }
    Ok(())
}

fn state_text(state: &StepState) -> String {
    match state {
        StepState::Committed => "committed".into(),
        StepState::RolledBack { by } => format!("rolled back (#{by})"),
        StepState::Incomplete { ranks_present } => {
            format!("incomplete ({} ranks)", ranks_present.len())
        }
        StepState::Damaged { .. } => "DAMAGED".into(),
    }
}

async fn list(cli: &Cli, run: &str) -> Result<()> {
    let run = open_run(cli, run).await?;
    let catalog = run.catalog().await?;
    if cli.json {
        output::json(&catalog);
        return Ok(());
    }
    let rows: Vec<Vec<String>> = catalog
        .steps
        .iter()
        .map(|s| {
            let marker = if Some(s.step) == catalog.latest {
                "latest"
            } else {
                ""
            };
            vec![
                s.step.step.to_string(),
                s.step.timeline.to_string(),
                state_text(&s.state),
                s.world_size.map_or("-".into(), |w| w.to_string()),
                output::bytes(s.raw_bytes),
                output::bytes(s.uploaded_bytes),
                output::ratio(s.raw_bytes, s.uploaded_bytes),
                output::time(s.created_unix_ms),
                marker.into(),
            ]
        })
        .collect();
    output::table(
        &[
            "STEP",
            "TIMELINE",
            "STATE",
            "RANKS",
            "RAW",
            "NEW STORED",
            "RATIO",
            "CREATED",
            "",
        ],
        &rows,
    );
    for rollback in &catalog.rollbacks {
        say!(
            "rollback #{}: to step {} by {} at {}: {}",
            rollback.seq,
            rollback.to,
            rollback.operator,
            output::time(Some(rollback.created_unix_ms)),
            rollback.reason
        );
    }
    for step in &catalog.steps {
        if let StepState::Damaged { reason } = &step.state {
            say!("step {} is damaged: {reason}", step.step);
        }
    }
    Ok(())
}

fn slice_text(slice: &[DimRange]) -> String {
    let dims: Vec<String> = slice
        .iter()
        .map(|r| format!("{}:{}", r.start, r.start + r.len))
        .collect();
    format!("[{}]", dims.join(","))
}

async fn show(cli: &Cli, run: &str, step: &str) -> Result<()> {
    let checkpoint = open_step(cli, run, step).await?;
    let layout = written_layout(&checkpoint).await;
    if cli.json {
        #[derive(Serialize)]
        struct Show<'a> {
            commit: &'a lazarus_shared::format::CommitRecord,
            manifests: &'a [lazarus_shared::format::ShardManifest],
            /// The trainer layout that wrote the step, when it recorded one.
            layout: Option<&'a WrittenLayout>,
        }
        output::json(&Show {
            commit: &checkpoint.commit,
            manifests: &checkpoint.manifests,
            layout: layout.as_ref(),
        });
        return Ok(());
    }
    let commit = &checkpoint.commit;
    say!(
        "run {} step {}  world size {}  committed {}",
        commit.run,
        commit.step,
        commit.world_size,
        output::time(Some(commit.created_unix_ms))
    );
    match &layout {
        Some(layout) => say!("written by the layout {}", layout.describe),
        None => say!("written by an unrecorded layout (a trainer before layouts were recorded, or an import)"),
    }
    let place = |rank: u32| -> Vec<String> {
        let at = layout
            .as_ref()
            .and_then(|l| l.ranks.get(rank as usize))
            .map(|at| at.map(|n| n.to_string()));
        at.map_or_else(|| vec!["-".to_string(); 4], |at| at.to_vec())
    };
    let ranks: Vec<Vec<String>> = commit
        .shards
        .iter()
        .zip(&checkpoint.manifests)
        .map(|(shard, manifest)| {
            let mut row = vec![shard.rank.to_string()];
            row.extend(place(shard.rank));
            row.extend([
                manifest.tensors.len().to_string(),
                manifest.blobs.len().to_string(),
                output::bytes(shard.raw_bytes),
                output::bytes(shard.uploaded_bytes),
                shard.manifest_blake3.short(),
            ]);
            row
        })
        .collect();
    output::table(
        &[
            "RANK",
            "TP",
            "PP",
            "DP",
            "EP",
            "TENSORS",
            "BLOBS",
            "RAW",
            "NEW STORED",
            "MANIFEST",
        ],
        &ranks,
    );
    say!();
    let mut rows = Vec::new();
    for tensor in checkpoint.tensors() {
        let mut holders = Vec::new();
        let mut chunks = 0;
        for manifest in &checkpoint.manifests {
            if let Some(entry) = manifest.tensor(&tensor.name) {
                chunks += entry.chunks.len();
                holders.push(if entry.is_whole() {
                    manifest.rank.to_string()
                } else {
                    format!("{}{}", manifest.rank, slice_text(&entry.slice))
                });
            }
        }
        let bytes =
            tensor.global_shape.iter().product::<u64>() * tensor.dtype.element_bytes() as u64;
        rows.push(vec![
            tensor.name,
            tensor.dtype.name(),
            format!("{:?}", tensor.global_shape),
            holders.join(" "),
            chunks.to_string(),
            output::bytes(bytes),
        ]);
    }
    output::table(
        &["TENSOR", "DTYPE", "SHAPE", "RANKS", "CHUNKS", "BYTES"],
        &rows,
    );
    for manifest in &checkpoint.manifests {
        for blob in &manifest.blobs {
            say!(
                "blob rank {}: {} ({})",
                manifest.rank,
                blob.name,
                output::bytes(blob.raw_bytes)
            );
        }
    }
    Ok(())
}

/// The trainer layout that wrote `checkpoint`, from rank 0's `trainer.json`, when it has one
/// that records it.
async fn written_layout(checkpoint: &Checkpoint) -> Option<WrittenLayout> {
    trainer_progress(checkpoint).await?.layout
}

/// Rank 0's `trainer.json` of `checkpoint`, when it has a readable one.
async fn trainer_progress(checkpoint: &Checkpoint) -> Option<TrainerProgress> {
    let manifest = checkpoint.manifests.first()?;
    manifest.blob(TRAINER_BLOB)?;
    let bytes = checkpoint
        .read_blob(manifest.rank, TRAINER_BLOB)
        .await
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

async fn verify(
    cli: &Cli,
    run: &str,
    step: Option<&str>,
    all: bool,
    options: &VerifyOptions,
    bars: bool,
) -> Result<()> {
    // Verify reads the store, never the local chunk index: opening it (and the database's
    // first use) cost 13-29 ms of CPU and a seventh of a 524 MB verify's samples.
    let run = open_run_with(cli, run, cli.store_options_without_index()).await?;
    let steps: Vec<StepKey> = if all {
        let catalog = run.catalog().await?;
        catalog
            .steps
            .iter()
            .filter(|s| !matches!(s.state, StepState::Incomplete { .. }))
            .map(|s| s.step)
            .collect()
    } else {
        let wanted = step.unwrap_or("latest");
        match run.resolve_step(wanted).await {
            Ok(key) => vec![key],
            Err(error @ lazarus_shared::StoreError::NotCommitted { .. }) => {
                // Manifests without a commit record: either a write that never finished, or a
                // commit record that was lost. Asked for by name, that is a problem to report.
                let catalog = run.catalog().await?;
                let orphan = catalog.steps.iter().find(|s| {
                    s.step.step.to_string() == wanted
                        && matches!(s.state, StepState::Incomplete { .. })
                });
                let Some(orphan) = orphan else {
                    return Err(error.into());
                };
                let message = format!(
                    "BAD run={} step={}: shard manifests exist but the commit record commits/{}.json is missing (lost, or the write never finished)",
                    run.id(),
                    orphan.step,
                    orphan.step.object_name()
                );
                say!("{message}");
                return Err(IntegrityProblems(message).into());
            }
            Err(error) => return Err(error.into()),
        }
    };
    let bar = if options.read_data {
        Bar::bytes("verify", bars)
    } else {
        Bar::items("verify", bars)
    };
    let started = Instant::now();
    let report = run.verify(&steps, options, &bar).await?;
    bar.finish();
    if cli.json {
        output::json(&report);
    } else {
        for problem in &report.problems {
            let mut place = format!("run={} step={}", problem.run, problem.step);
            if let Some(rank) = problem.rank {
                place += &format!(" rank={rank}");
            }
            if let (Some(item), Some(name)) = (&problem.item, &problem.name) {
                place += &format!(" {item}={name:?}");
            }
            if let Some(chunk) = &problem.chunk {
                place += &format!(" chunk={chunk}");
            }
            say!("BAD {place}: {}", problem.error);
        }
        let seconds = started.elapsed().as_secs_f64();
        say!(
            "verified {} step(s), {} manifest(s), {} chunk(s){} in {seconds:.1}s: {}",
            report.steps.len(),
            report.manifests_checked,
            report.chunks_checked,
            if options.read_data {
                format!(", {} re-hashed", output::bytes(report.bytes_read))
            } else {
                String::new()
            },
            if report.problems.is_empty() {
                "OK".to_string()
            } else {
                format!("{} PROBLEM(S)", report.problems.len())
            }
        );
    }
    if !report.problems.is_empty() {
        return Err(IntegrityProblems(format!(
            "{} integrity problem(s) found in run {}",
            report.problems.len(),
            run.id()
        ))
        .into());
    }
    Ok(())
}

fn to_f64(dtype: DType, bytes: &[u8]) -> Option<Vec<f64>> {
    let values = match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes(b.try_into().expect("4 bytes"))))
            .collect(),
        DType::F64 => bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| f64::from(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| f64::from(half::f16::from_le_bytes([b[0], b[1]]).to_f32()))
            .collect(),
        _ => return None,
    };
    Some(values)
}

async fn diff(cli: &Cli, run: &str, a: &str, b: &str) -> Result<()> {
    #[derive(Serialize)]
    struct TensorDiff {
        name: String,
        status: &'static str,
        changed_elements: u64,
        elements: u64,
        max_abs_diff: Option<f64>,
        relative_l2: Option<f64>,
    }
    let left = open_step(cli, run, a).await?;
    let right = open_step(cli, run, b).await?;
    let left_tensors: BTreeMap<String, _> = left
        .tensors()
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();
    let right_tensors: BTreeMap<String, _> = right
        .tensors()
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();
    let names: std::collections::BTreeSet<&String> =
        left_tensors.keys().chain(right_tensors.keys()).collect();
    let chunk_list = |checkpoint: &Checkpoint, name: &str| -> Vec<_> {
        checkpoint
            .manifests
            .iter()
            .filter_map(|m| m.tensor(name))
            .flat_map(|t| t.chunks.iter().map(|c| c.hash))
            .collect()
    };
    let mut diffs = Vec::new();
    for name in names {
        let (Some(l), Some(r)) = (left_tensors.get(name), right_tensors.get(name)) else {
            let status = if left_tensors.contains_key(name) {
                "removed"
            } else {
                "added"
            };
            diffs.push(TensorDiff {
                name: name.clone(),
                status,
                changed_elements: 0,
                elements: 0,
                max_abs_diff: None,
                relative_l2: None,
            });
            continue;
        };
        let elements = l.global_shape.iter().product::<u64>();
        if l.dtype != r.dtype || l.global_shape != r.global_shape {
            diffs.push(TensorDiff {
                name: name.clone(),
                status: "reshaped",
                changed_elements: elements,
                elements,
                max_abs_diff: None,
                relative_l2: None,
            });
            continue;
        }
        if chunk_list(&left, name) == chunk_list(&right, name) {
            diffs.push(TensorDiff {
                name: name.clone(),
                status: "same",
                changed_elements: 0,
                elements,
                max_abs_diff: Some(0.0),
                relative_l2: Some(0.0),
            });
            continue;
        }
        let (lb, rb) = (
            left.read_tensor(name, &()).await?,
            right.read_tensor(name, &()).await?,
        );
        let element = l.dtype.element_bytes();
        let changed = lb
            .chunks(element)
            .zip(rb.chunks(element))
            .filter(|(x, y)| x != y)
            .count() as u64;
        let (max_abs_diff, relative_l2) = match (to_f64(l.dtype, &lb), to_f64(l.dtype, &rb)) {
            (Some(x), Some(y)) => {
                let max = x
                    .iter()
                    .zip(&y)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0.0, f64::max);
                let diff_norm = x
                    .iter()
                    .zip(&y)
                    .map(|(p, q)| (p - q) * (p - q))
                    .sum::<f64>()
                    .sqrt();
                let base_norm = x.iter().map(|p| p * p).sum::<f64>().sqrt();
                (
                    Some(max),
                    Some(if base_norm > 0.0 {
                        diff_norm / base_norm
                    } else {
                        diff_norm
                    }),
                )
            }
            _ => (None, None),
        };
        let status = if changed == 0 { "same" } else { "changed" };
        diffs.push(TensorDiff {
            name: name.clone(),
            status,
            changed_elements: changed,
            elements,
            max_abs_diff,
            relative_l2,
        });
    }
    if cli.json {
        output::json(&diffs);
        return Ok(());
    }
    let show = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.3e}"));
    let rows: Vec<Vec<String>> = diffs
        .iter()
        .map(|d| {
            vec![
                d.name.clone(),
                d.status.into(),
                format!("{}/{}", d.changed_elements, d.elements),
                show(d.max_abs_diff),
                show(d.relative_l2),
            ]
        })
        .collect();
    output::table(
        &["TENSOR", "STATUS", "CHANGED", "MAX |DIFF|", "REL L2"],
        &rows,
    );
    let changed = diffs.iter().filter(|d| d.status != "same").count();
    say!(
        "{changed} of {} tensors differ between {} and {}",
        diffs.len(),
        left.step(),
        right.step()
    );
    Ok(())
}

async fn import(
    cli: &Cli,
    run: &str,
    step: u64,
    delta: bool,
    chunk_bytes: Option<u64>,
    files: &[PathBuf],
    bars: bool,
) -> Result<()> {
    let run_id = run_id(run)?;
    // Parse every file's header before touching the store: bad input changes nothing. The
    // tensors' bytes are read chunk by chunk while they are written, on every core.
    let mut tensors = Vec::new();
    let mut blobs = Vec::new();
    let mut names = HashSet::new();
    let mut file_names = HashSet::new();
    for path in files {
        let file_name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| UsageError(format!("{} is not a file name", path.display())))?;
        if !file_names.insert(file_name.to_string()) {
            bail!(UsageError(format!("two input files are named {file_name}")));
        }
        let (layout, file) = read_safetensors_layout(path, file_name)?;
        // The tensors are read from the file whose header was checked, whatever the path
        // names by then.
        let source: Arc<dyn ByteSource> = Arc::new(FileSource::from_file(file, path));
        for place in layout.tensors {
            if !names.insert(place.name.clone()) {
                bail!(UsageError(format!(
                    "tensor {:?} appears in more than one input file",
                    place.name
                )));
            }
            let data = SourceRange {
                source: source.clone(),
                offset: place.offset,
                len: place.len,
            };
            tensors.push(SourcedTensor::whole(
                place.name,
                place.dtype,
                place.shape,
                data,
            ));
        }
        blobs.push((
            format!("{HEADER_BLOB_PREFIX}{}", layout.file_name),
            layout.header,
        ));
    }
    let mut options = cli.store_options();
    options.chunk_bytes = chunk_bytes.unwrap_or(options.chunk_bytes);
    let url = cli.store.as_deref().ok_or_else(|| {
        UsageError("no store given: pass --store URL or set LAZARUS_STORE".into())
    })?;
    let store = Store::open(url, OpenMode::CreateIfMissing, options).await?;
    let handle = store.run(&run_id);
    let description = serde_json::json!({ "source": "ckptctl import" });
    let info = handle.create(description).await?;
    let key = StepKey::new(step, handle.current_timeline().await?);
    if handle.load_commit(key).await.is_ok() {
        // Re-running an import that already finished is a no-op, if the content is the same.
        let checkpoint = handle.open_checkpoint(key).await?;
        // Reading the files again blocks: the runtime is told so.
        let same = tokio::task::block_in_place(|| {
            same_content(&checkpoint, &tensors, &blobs, info.chunk_bytes)
        })?;
        if !same {
            return Err(lazarus_shared::StoreError::StepAlreadyCommitted {
                run: run_id,
                step: key,
            }
            .into());
        }
        say!("run {run_id} step {key} is already committed with this content; nothing to do");
        return Ok(());
    }
    let bases = if delta {
        delta_bases(&handle).await?
    } else {
        None
    };
    let started = Instant::now();
    let bar = Bar::bytes("import", bars);
    let input = SourcedShard {
        step: key,
        rank: 0,
        world_size: 1,
        tensors,
        blobs,
        copy: None,
    };
    let manifest = handle
        .write_shard_sourced(input, bases.as_ref(), &bar)
        .await?;
    let commit = handle.commit(key, 1).await?;
    bar.finish();
    let seconds = started.elapsed().as_secs_f64();
    if cli.json {
        output::json(
            &serde_json::json!({ "run": run_id, "step": key, "raw_bytes": manifest.raw_bytes(), "uploaded_bytes": manifest.uploaded_bytes, "seconds": seconds, "commit": commit }),
        );
    } else {
        say!(
            "imported {} tensor(s), {} as run {run_id} step {key} in {seconds:.1}s: {} new in storage ({} of raw)",
            manifest.tensors.len(),
            output::bytes(manifest.raw_bytes()),
            output::bytes(manifest.uploaded_bytes),
            output::ratio(manifest.raw_bytes(), manifest.uploaded_bytes)
        );
    }
    Ok(())
}

/// A `.safetensors` file's layout, read from its header alone, and the file, open.
fn read_safetensors_layout(
    path: &Path,
    file_name: &str,
) -> Result<(safetensors_io::FileLayout, std::fs::File)> {
    use std::io::Read;
    let reading = || format!("reading {}", path.display());
    let mut file = std::fs::File::open(path).with_context(reading)?;
    let file_len = file.metadata().with_context(reading)?.len();
    let mut prefix = [0u8; 8];
    let prefix_len = file_len.min(8) as usize;
    file.read_exact(&mut prefix[..prefix_len])
        .with_context(reading)?;
    let header_len = safetensors_io::header_len(file_name, &prefix[..prefix_len], file_len)?;
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).with_context(reading)?;
    let layout = safetensors_io::parse_layout(file_name, Bytes::from(header), file_len)?;
    Ok((layout, file))
}

/// Whether a committed single-rank step holds exactly these tensors and blobs (the tensors'
/// files are read again to tell).
fn same_content(
    checkpoint: &Checkpoint,
    tensors: &[SourcedTensor],
    blobs: &[(String, Bytes)],
    chunk_bytes: u64,
) -> Result<bool> {
    let Ok(manifest) = checkpoint.manifest(0) else {
        return Ok(false);
    };
    let hashes = |data: &SourceRange| -> Result<Vec<lazarus_shared::ChunkHash>> {
        (0..data.len)
            .step_by(chunk_bytes as usize)
            .map(|offset| {
                let piece = data
                    .sub(offset, chunk_bytes.min(data.len - offset))
                    .read()?;
                Ok(lazarus_shared::ChunkHash::of(&piece))
            })
            .collect()
    };
    let stored = |chunks: &[lazarus_shared::format::ChunkRef]| -> Vec<lazarus_shared::ChunkHash> {
        chunks.iter().map(|c| c.hash).collect()
    };
    if checkpoint.manifests.len() != 1
        || manifest.tensors.len() != tensors.len()
        || manifest.blobs.len() != blobs.len()
    {
        return Ok(false);
    }
    for t in tensors {
        let Some(entry) = manifest.tensor(&t.name) else {
            return Ok(false);
        };
        if entry.dtype != t.dtype
            || entry.global_shape != t.global_shape
            || stored(&entry.chunks) != hashes(&t.data)?
        {
            return Ok(false);
        }
    }
    for (name, data) in blobs {
        let Some(entry) = manifest.blob(name) else {
            return Ok(false);
        };
        if stored(&entry.chunks) != hashes(&SourceRange::from(data.clone()))? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The latest step's tensors as delta bases, when it was written by a single rank.
async fn delta_bases(run: &RunStore) -> Result<Option<DeltaBases>> {
    let Some(latest) = run.latest().await? else {
        return Ok(None);
    };
    let checkpoint = run.open_checkpoint(latest).await?;
    let Ok(manifest) = checkpoint.manifest(0) else {
        return Ok(None);
    };
    if checkpoint.manifests.len() != 1 {
        return Ok(None);
    }
    let mut bases = DeltaBases::default();
    for tensor in &manifest.tensors {
        let raw = checkpoint.read_shard_tensor(0, &tensor.name, &()).await?;
        bases.insert(tensor.name.clone(), Bytes::from(raw), tensor.chunks.clone());
    }
    // Reading a tensor decodes and hashes every chunk of it: the writer need not again.
    Ok(Some(bases.already_checked()))
}

/// An output file written under a `.partial` name, fsynced and renamed into place by
/// [`PartialFile::finish`]. Dropped unfinished (an error on the way), it is removed, so a failed
/// export leaves no file that looks complete.
struct PartialFile {
    partial: PathBuf,
    path: PathBuf,
    file: std::fs::File,
    finished: bool,
}

impl PartialFile {
    fn create(path: PathBuf) -> Result<Self> {
        let partial = path.with_extension("partial");
        let file = std::fs::File::create(&partial)
            .with_context(|| format!("creating {}", partial.display()))?;
        Ok(Self {
            partial,
            path,
            file,
            finished: false,
        })
    }

    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.file.write_all(bytes)
    }

    /// A `.safetensors` file at `path` begun with `header` (and its length): the tensors'
    /// bytes follow, written in place ([`PartialFile::positional`]).
    fn with_header(path: PathBuf, header: &[u8]) -> Result<Self> {
        let mut file = Self::create(path)?;
        file.write(&safetensors_io::length_prefix(header))?;
        file.write(header)?;
        Ok(file)
    }

    /// A handle for positional writes (`write_all_at`) from other threads.
    fn positional(&self) -> Result<Arc<std::fs::File>> {
        let file = self
            .file
            .try_clone()
            .with_context(|| format!("opening {} again", self.partial.display()))?;
        Ok(Arc::new(file))
    }

    /// Makes the file durable under its name: its bytes, then the directory's new entry.
    fn finish(mut self) -> Result<PathBuf> {
        self.file
            .sync_all()
            .with_context(|| format!("syncing {}", self.partial.display()))?;
        std::fs::rename(&self.partial, &self.path)
            .with_context(|| format!("renaming {}", self.partial.display()))?;
        self.finished = true;
        let dir = self
            .path
            .parent()
            .filter(|dir| !dir.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        lazarus_shared::store::sync_dir(dir)
            .with_context(|| format!("syncing {}", dir.display()))?;
        Ok(self.path.clone())
    }
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

async fn export(
    cli: &Cli,
    run: &str,
    step: &str,
    format: ExportFormat,
    out: &Path,
    bars: bool,
) -> Result<()> {
    let checkpoint = open_step(cli, run, step).await?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    if let ExportFormat::HfOlmoe = format {
        return export_hf_olmoe(cli, &checkpoint, out, bars).await;
    }
    let bar = Bar::bytes("export", bars);
    let total: u64 = checkpoint
        .tensors()
        .iter()
        .map(|t| t.global_shape.iter().product::<u64>() * t.dtype.element_bytes() as u64)
        .sum();
    bar.set_total_bytes(total);
    let header_blobs: Vec<String> = checkpoint
        .manifests
        .first()
        .map(|m| {
            m.blobs
                .iter()
                .filter(|b| b.name.starts_with(HEADER_BLOB_PREFIX))
                .map(|b| b.name.clone())
                .collect()
        })
        .unwrap_or_default();
    let mut written = Vec::new();
    if header_blobs.is_empty() {
        // Not imported from files: one file with every global tensor, written as they are
        // read (a tensor that ranks hold in slices is assembled first), not gathered whole.
        let described: Vec<_> = checkpoint
            .tensors()
            .into_iter()
            .map(|info| (info.name, info.dtype, info.global_shape))
            .collect();
        let (header, places) = safetensors_io::header(&described)?;
        let file = PartialFile::with_header(out.join("model.safetensors"), &header)?;
        let names: Vec<String> = places.into_iter().map(|place| place.name).collect();
        let data_start = 8 + header.len() as u64;
        checkpoint
            .write_tensors_at(&names, &file.positional()?, data_start, &bar)
            .await?;
        written.push(file.finish()?);
    }
    for blob in header_blobs {
        let file_name = &blob[HEADER_BLOB_PREFIX.len()..];
        safetensors_io::check_file_name(file_name)?;
        let header = checkpoint.read_blob(0, &blob).await?;
        let layout = safetensors_io::header_layout(file_name, &header)?;
        // Each chunk is verified before it is written; the file only takes its name at the end.
        let file = PartialFile::with_header(out.join(file_name), &header)?;
        let mut names = Vec::new();
        for (name, dtype, shape) in layout {
            let info = checkpoint.tensor_info(&name).ok_or_else(|| {
                anyhow::anyhow!(
                    "{file_name}: tensor {name:?} is in the file header but not in the checkpoint"
                )
            })?;
            if info.dtype != dtype || info.global_shape != shape {
                bail!("{file_name}: tensor {name:?} is {:?} {:?} in the checkpoint but {dtype:?} {shape:?} in the file header", info.dtype, info.global_shape);
            }
            names.push(name);
        }
        let data_start = 8 + header.len() as u64;
        checkpoint
            .write_tensors_at(&names, &file.positional()?, data_start, &bar)
            .await?;
        written.push(file.finish()?);
    }
    bar.finish();
    if cli.json {
        output::json(&serde_json::json!({ "step": checkpoint.step(), "files": written }));
    } else {
        for path in &written {
            say!("wrote {}", path.display());
        }
    }
    Ok(())
}

/// A trainer checkpoint's weights in the layout of transformers' `OlmoeForCausalLM`.
async fn export_hf_olmoe(cli: &Cli, checkpoint: &Checkpoint, out: &Path, bars: bool) -> Result<()> {
    let has_spec = checkpoint
        .manifests
        .first()
        .is_some_and(|m| m.blobs.iter().any(|b| b.name == hf_olmoe::MODEL_BLOB));
    if !has_spec {
        bail!(UsageError(format!(
            "step {} has no {} blob: only checkpoints the trainer wrote can be exported as hf-olmoe",
            checkpoint.step(),
            hf_olmoe::MODEL_BLOB
        )));
    }
    let spec: hf_olmoe::ModelSpec =
        serde_json::from_slice(&checkpoint.read_blob(0, hf_olmoe::MODEL_BLOB).await?)
            .with_context(|| format!("reading {}", hf_olmoe::MODEL_BLOB))?;
    let biased = trainer_progress(checkpoint).await.map_or(0, |progress| {
        let layers = progress.router_bias.iter();
        layers
            .filter(|layer| layer.iter().any(|b| *b != 0.0))
            .count()
    });
    if biased > 0 {
        eprintln!(
            "ckptctl: warning: step {} routes {biased} layers' tokens with a bias \
             (train.router_bias_rate) that OLMoE's format has no place for: the exported model \
             chooses its experts by the router's probabilities alone",
            checkpoint.step()
        );
    }
    let parameters = spec.trainer_parameters();
    let bar = Bar::bytes("export", bars);
    bar.set_total_bytes(
        parameters
            .iter()
            .map(|(_, shape)| shape.iter().product::<u64>() * 4)
            .sum(),
    );
    // The header first, from the names and shapes alone; then each parameter is read,
    // converted and written where its tensors go, so only one parameter is held at a time.
    let mut stored = Vec::with_capacity(parameters.len());
    let mut described = Vec::new();
    for (name, shape) in &parameters {
        let info = checkpoint.tensor_info(name).ok_or_else(|| {
            anyhow::anyhow!("tensor {name} of the model is missing from the checkpoint")
        })?;
        // Older trainers stored parameters flattened; the model configuration gives the shape.
        let elements = |s: &[u64]| s.iter().product::<u64>();
        if info.dtype != DType::F32 || elements(&info.global_shape) != elements(shape) {
            bail!(
                "tensor {name} is {:?} {:?} in the checkpoint; the model needs F32 {shape:?}",
                info.dtype,
                info.global_shape
            );
        }
        for (hf_name, hf_shape) in spec.hf_tensors(name, shape)? {
            described.push((hf_name, DType::F32, hf_shape));
        }
        stored.push(info.global_shape);
    }
    let (header, places) = safetensors_io::header(&described)?;
    let offsets: HashMap<String, u64> = places
        .into_iter()
        .map(|place| (place.name, place.offset))
        .collect();
    let offsets = Arc::new(offsets);
    let file = PartialFile::with_header(out.join("model.safetensors"), &header)?;
    let positional = file.positional()?;
    for ((name, shape), stored_shape) in parameters.iter().zip(&stored) {
        let data = spec.current_layout(
            name,
            stored_shape,
            checkpoint.read_tensor(name, &bar).await?,
        );
        let tensors = spec.to_hf(name, shape, &data)?;
        drop(data);
        let (positional, offsets) = (positional.clone(), offsets.clone());
        tokio::task::spawn_blocking(move || -> Result<()> {
            for (hf_name, _, bytes) in tensors {
                lazarus_shared::store::write_out_at(&positional, &bytes, offsets[&hf_name])
                    .with_context(|| format!("writing {hf_name}"))?;
            }
            Ok(())
        })
        .await??;
    }
    let model_file = file.finish()?;
    let mut file = PartialFile::create(out.join("config.json"))?;
    file.write(&serde_json::to_vec_pretty(&spec.hf_config())?)?;
    let config_file = file.finish()?;
    bar.finish();
    let written = [config_file, model_file];
    if cli.json {
        output::json(&serde_json::json!({ "step": checkpoint.step(), "files": written }));
    } else {
        for path in &written {
            say!("wrote {}", path.display());
        }
    }
    Ok(())
}

async fn restore(cli: &Cli, run: &str, step: &str, out: &Path, bars: bool) -> Result<()> {
    let checkpoint = open_step(cli, run, step).await?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let absolute =
        std::fs::canonicalize(out).with_context(|| format!("resolving {}", out.display()))?;
    let url = format!("file://{}", absolute.display());
    let target = Store::open(
        &url,
        OpenMode::CreateIfMissing,
        cli.store_options_without_index(),
    )
    .await?;
    let bar = Bar::bytes("restore", bars);
    let started = Instant::now();
    checkpoint
        .run()
        .copy_step_to(&target.run(checkpoint.run().id()), checkpoint.step(), &bar)
        .await?;
    bar.finish();
    if cli.json {
        output::json(
            &serde_json::json!({ "run": checkpoint.run().id(), "step": checkpoint.step(), "store": url }),
        );
    } else {
        say!(
            "restored run {} step {} ({}) into {url} in {:.1}s; check it with: ckptctl --store {url} verify {} {} --read-data",
            checkpoint.run().id(),
            checkpoint.step(),
            output::bytes(checkpoint.commit.raw_bytes()),
            started.elapsed().as_secs_f64(),
            checkpoint.run().id(),
            checkpoint.step().step,
        );
    }
    Ok(())
}

async fn rollback(cli: &Cli, run: &str, to: &str, reason: &str) -> Result<()> {
    if reason.trim().is_empty() {
        bail!(UsageError(
            "--reason must say why; it is kept with the rollback".into()
        ));
    }
    let run = open_run(cli, run).await?;
    let key = run.resolve_step(to).await?;
    let operator = format!(
        "{}@{}",
        std::env::var("USER").unwrap_or_else(|_| "unknown".into()),
        std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown".into())
    );
    let record = run.rollback(key, reason, &operator).await?;
    if cli.json {
        output::json(&record);
    } else {
        say!("rolled back run {} to step {} (rollback #{}); later steps are hidden, not deleted; new steps go to timeline {}", run.id(), record.to, record.seq, record.seq);
    }
    Ok(())
}

async fn gc(cli: &Cli, run: &str, policy: &GcPolicy, bars: bool) -> Result<()> {
    if policy.keep_last == 0 {
        bail!(UsageError("--keep-last must be at least 1".into()));
    }
    let run = open_run(cli, run).await?;
    let bar = Bar::items("gc", bars);
    let report = run.gc(policy, &bar).await?;
    bar.finish();
    if cli.json {
        output::json(&report);
        return Ok(());
    }
    let verb = if report.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    let steps: Vec<String> = report.deleted_steps.iter().map(|s| s.to_string()).collect();
    say!(
        "kept {} step(s); {verb} {} step(s) [{}] and {} abandoned incomplete step(s)",
        report.kept_steps.len(),
        steps.len(),
        steps.join(", "),
        report.deleted_incomplete.len()
    );
    say!(
        "kept {} chunk(s); {verb} {} unreferenced chunk(s) ({}); left {} unreferenced chunk(s) younger than the grace period",
        report.kept_chunks,
        report.deleted_chunks,
        output::bytes(report.deleted_bytes),
        report.young_chunks
    );
    if report.deleted_staging_files > 0 {
        say!(
            "{verb} {} staging file(s) left by killed writers",
            report.deleted_staging_files
        );
    }
    Ok(())
}

async fn index(cli: &Cli, action: &IndexAction, bars: bool) -> Result<()> {
    if cli.no_index {
        bail!(UsageError("--no-index leaves no index to work on".into()));
    }
    let store = cli.open_store(OpenMode::Existing).await?;
    if store.index().is_none() {
        bail!("the local index could not be opened (another ckptctl may hold it)");
    }
    let stats = match action {
        IndexAction::Rebuild => {
            let bar = Bar::items("index", bars);
            let stats = store.rebuild_index(&bar).await?;
            bar.finish();
            stats
        }
        IndexAction::Stats => store.index().expect("checked above").stats()?,
    };
    if cli.json {
        output::json(&stats);
    } else {
        say!(
            "index: {} chunk(s), {} manifest(s), {} reference(s)",
            stats.chunks,
            stats.manifests,
            stats.references
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use lazarus_shared::wire::Event;

    fn event(unix_ms: u64, kind: &str, epoch: u64) -> Event {
        Event {
            unix_ms,
            kind: kind.into(),
            detail: String::new(),
            generation: 0,
            nodes: Vec::new(),
            epoch,
        }
    }

    #[test]
    fn a_takeover_is_timed_from_the_lost_leaders_last_word() {
        let events = vec![
            event(1_000, "launch", 1),
            event(5_000, "leader_lost", 2),
            event(8_500, "elected", 2),
            // The deposed leader's own record does not count as the new one acting.
            event(8_600, "deposed", 1),
            event(12_250, "fault", 2),
            event(12_300, "relaunch", 2),
        ];
        assert_eq!(
            super::takeovers(&events),
            vec![
                "takeover to epoch 2: elected 3.50 s after the leader was last heard from, \
                 supervising again (fault) after 7.25 s"
                    .to_string()
            ]
        );
        // No `leader_lost` of the same epoch (a leader that started, not a takeover): no line.
        assert!(super::takeovers(&[event(1, "elected", 3)]).is_empty());
    }
}
