//! The training loop's record of itself: the time each phase of a step took, the window of
//! steps since the last log line, and the line itself, written to the log (rank 0's stdout)
//! and as JSON to `metrics.jsonl`.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::config::Config;
use crate::layout::Layout;
use crate::optim::UpdateStats;
use crate::pipeline::StepFigures;

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f64,
    pub cross_entropy: f64,
    pub load_balancing: f64,
    pub router_z: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub tokens_per_second: f64,
    /// Most-loaded expert's share over the mean share, averaged over layers (1.0 = balanced).
    pub expert_imbalance: f64,
    /// Where each layer's experts are split over ranks (expert and tensor parallel): the rows
    /// of the busiest rank's experts over the mean rank's, averaged over layers. What the
    /// other ranks wait for at the expert exchange.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_rank_imbalance: Option<f64>,
    /// Model FLOPs per second over the matmul peak `trainer bench-peak` measured (if it ran).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// Mean milliseconds per step since the last log line, by phase.
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub optimizer_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
}

/// A step's phases, for the per-phase times of the log line.
#[derive(Clone, Copy, Debug)]
pub enum Phase {
    Forward = 0,
    Backward = 1,
    Optimizer = 2,
}

/// The tokens one step trains on: its global batch's ([`Config::global_batch`]).
fn tokens_per_step(config: &Config, layout: &Layout) -> usize {
    config.global_batch(layout) * config.model.seq_len
}

/// How many machines `processes` (each rank's process id and host name) run on.
pub fn distinct_hosts(processes: &[(u32, String)]) -> usize {
    processes
        .iter()
        .map(|(_, host)| host.as_str())
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// The window of steps since the last log line and where lines go.
pub struct StepLog {
    metrics: Box<dyn Write>,
    log_every: u64,
    last_step: u64,
    tokens_per_step: usize,
    flops_per_token: f64,
    experts: usize,
    /// How many ranks split each layer's experts (`ep x tp`).
    expert_places: usize,
    /// The world's peak: the measured one machine's, times the machines.
    peak_gflops: Option<f64>,
    window_start: Instant,
    window_tokens: usize,
    window_steps: u32,
    phase_seconds: [f64; 3],
}

impl std::fmt::Debug for StepLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepLog")
            .field("window_steps", &self.window_steps)
            .field("window_tokens", &self.window_tokens)
            .finish_non_exhaustive()
    }
}

impl StepLog {
    /// Appends to `<metrics_dir>/<run>/metrics.jsonl` on rank 0 (`speaks`), to nothing on
    /// the other ranks. Says on `log` when no matmul peak was measured for CPU-MFU, which is
    /// taken against the measured peak (one machine's) times the `hosts` the world runs on.
    pub fn open(
        config: &Config,
        layout: &Layout,
        hosts: usize,
        speaks: bool,
        metrics_dir: &Path,
        log: &mut dyn Write,
    ) -> Result<Self> {
        let path = metrics_dir.join(&config.run.id).join("metrics.jsonl");
        std::fs::create_dir_all(path.parent().expect("has a parent"))
            .with_context(|| format!("creating {}", path.display()))?;
        let metrics: Box<dyn Write> = if speaks {
            Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .with_context(|| format!("opening {}", path.display()))?,
            )
        } else {
            Box::new(std::io::sink())
        };
        let peak_gflops = saved_peak(metrics_dir);
        if peak_gflops.is_none() {
            writeln!(log, "no matmul peak measured yet: run `trainer bench-peak --out-dir {}` to get CPU-MFU in the logs", metrics_dir.display())?;
        }
        Ok(Self {
            metrics,
            log_every: config.train.log_every,
            last_step: config.train.steps,
            tokens_per_step: tokens_per_step(config, layout),
            flops_per_token: crate::model::training_flops_per_token(&config.model),
            experts: config.model.experts,
            expert_places: layout.ep * layout.tp,
            peak_gflops: peak_gflops.map(|peak| peak * hosts.max(1) as f64),
            window_start: Instant::now(),
            window_tokens: 0,
            window_steps: 0,
            phase_seconds: [0.0; 3],
        })
    }

    /// Adds `seconds` to `phase` of the current step.
    pub fn time(&mut self, phase: Phase, seconds: f64) {
        self.phase_seconds[phase as usize] += seconds;
    }

    /// The optimizer step ran: the step counts in the window.
    pub fn stepped(&mut self) {
        self.window_steps += 1;
    }

    /// Step `step` is done (its loss summed over the ranks): writes its line when one is due
    /// (every `log_every` steps, at validation and at the last step) and starts a new window.
    #[allow(clippy::too_many_arguments)]
    pub fn step_done(
        &mut self,
        step: u64,
        loss: f64,
        forward: &StepFigures,
        update: &UpdateStats,
        lr: f64,
        val_loss: Option<f64>,
        log: &mut dyn Write,
    ) -> Result<()> {
        self.window_tokens += self.tokens_per_step;
        if !step.is_multiple_of(self.log_every) && val_loss.is_none() && step != self.last_step {
            return Ok(());
        }
        let seconds = self.window_start.elapsed().as_secs_f64();
        let imbalance = places_imbalance(&forward.expert_load, self.experts);
        let rank_imbalance = (self.expert_places > 1)
            .then(|| places_imbalance(&forward.expert_load, self.expert_places));
        let steps = f64::from(self.window_steps);
        let tokens_per_second = self.window_tokens as f64 / seconds.max(1e-9);
        let line = StepMetrics {
            step,
            loss,
            cross_entropy: forward.cross_entropy,
            load_balancing: forward.load_balancing,
            router_z: forward.router_z,
            grad_norm: update.grad_norm,
            lr,
            tokens_per_second,
            expert_imbalance: imbalance,
            expert_rank_imbalance: rank_imbalance,
            mfu: self
                .peak_gflops
                .map(|peak| tokens_per_second * self.flops_per_token / 1e9 / peak),
            forward_ms: self.phase_seconds[0] * 1000.0 / steps,
            backward_ms: self.phase_seconds[1] * 1000.0 / steps,
            optimizer_ms: self.phase_seconds[2] * 1000.0 / steps,
            val_loss,
        };
        writeln!(self.metrics, "{}", serde_json::to_string(&line)?)?;
        writeln!(
            log,
            "step {step:>6}  loss {loss:.4}  ce {:.4}  aux {:.4}  z {:.3}  |g| {:.3}  lr {lr:.2e}  {:.0} tok/s{}  experts max/mean {imbalance:.2}{}  ms fwd/bwd/opt {:.0}/{:.0}/{:.0}{}",
            line.cross_entropy,
            line.load_balancing,
            line.router_z,
            line.grad_norm,
            line.tokens_per_second,
            line.mfu.map(|m| format!("  MFU {:.1}%", m * 100.0)).unwrap_or_default(),
            rank_imbalance
                .map(|r| format!(" (ranks' {r:.2})"))
                .unwrap_or_default(),
            line.forward_ms,
            line.backward_ms,
            line.optimizer_ms,
            val_loss.map(|v| format!("  val {v:.4}")).unwrap_or_default()
        )?;
        self.window_start = Instant::now();
        self.window_tokens = 0;
        self.window_steps = 0;
        self.phase_seconds = [0.0; 3];
        Ok(())
    }
}

/// Each layer's experts cut into `places` runs of consecutive experts, as expert and tensor
/// parallel split them (one expert each where `places` is the expert count): the busiest
/// place's tokens over the mean place's, averaged over the layers of `load`.
fn places_imbalance(load: &[Vec<u64>], places: usize) -> f64 {
    let per_layer = |layer: &Vec<u64>| {
        let sums: Vec<u64> = layer
            .chunks(layer.len().div_ceil(places).max(1))
            .map(|run| run.iter().sum())
            .collect();
        let mean = sums.iter().sum::<u64>() as f64 / places as f64;
        *sums.iter().max().unwrap_or(&0) as f64 / mean.max(1e-9)
    };
    load.iter().map(per_layer).sum::<f64>() / load.len().max(1) as f64
}

/// The peak `trainer bench-peak` saved in `dir`, if any.
fn saved_peak(dir: &Path) -> Option<f64> {
    let text = std::fs::read(dir.join("peak.json")).ok()?;
    serde_json::from_slice::<serde_json::Value>(&text).ok()?["gflops"].as_f64()
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    /// Tokens/s and CPU-MFU count each replica's tokens once, however many ranks split its
    /// model: 4 ranks as TP2 x PP2 train one micro-batch per step, not four.
    #[test]
    fn a_step_counts_the_tokens_of_its_global_batch() {
        for (sets, ranks, replicas) in [
            (&[][..], 1, 1),
            (&[][..], 4, 4),
            (&["parallel.tp=2"][..], 4, 2),
            (&["parallel.tp=2", "parallel.pp=2"][..], 4, 1),
            (&["parallel.pp=2", "parallel.ep=2"][..], 8, 4),
        ] {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            let config = Config::load("tiny", &sets).unwrap();
            let layout = config.layout(ranks).unwrap();
            assert_eq!(
                super::tokens_per_step(&config, &layout),
                config.train.micro_batch * config.model.seq_len * replicas,
                "{sets:?} on {ranks} ranks"
            );
        }
    }

    /// The busiest expert, and the busiest rank's experts, against the mean.
    #[test]
    fn imbalance_is_the_busiest_expert_or_rank_over_the_mean() {
        let load = [vec![10, 2, 1, 3], vec![4, 4, 4, 4]];
        // Layer 0: 10 of a mean of 4; layer 1: balanced.
        assert_eq!(super::places_imbalance(&load, 4), (2.5 + 1.0) / 2.0);
        // Two ranks of two experts each: layer 0 is 12 against 4, a mean of 8.
        assert_eq!(super::places_imbalance(&load, 2), (1.5 + 1.0) / 2.0);
        // A busy expert beside an idle one on one rank is no rank's imbalance.
        assert_eq!(super::places_imbalance(&[vec![8, 0, 4, 4]], 2), 1.0);
    }

    /// CPU-MFU is against the peak of every machine the ranks run on: ranks on one machine
    /// share its peak, ranks on two have twice it.
    #[test]
    fn the_world_peak_counts_each_machine_once() {
        let world = |hosts: &[&str]| -> Vec<(u32, String)> {
            hosts
                .iter()
                .enumerate()
                .map(|(pid, host)| (pid as u32, host.to_string()))
                .collect()
        };
        assert_eq!(super::distinct_hosts(&world(&["n1"])), 1);
        assert_eq!(super::distinct_hosts(&world(&["n1", "n1", "n1", "n1"])), 1);
        assert_eq!(super::distinct_hosts(&world(&["n1", "n2", "n1", "n2"])), 2);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("peak.json"), r#"{"gflops": 100.0}"#).unwrap();
        let config = Config::load("tiny", &[]).unwrap();
        let layout = config.layout(4).unwrap();
        for hosts in [1, 2] {
            let log =
                super::StepLog::open(&config, &layout, hosts, false, dir.path(), &mut Vec::new())
                    .unwrap();
            assert_eq!(log.peak_gflops, Some(100.0 * hosts as f64));
        }
    }
}
