//! `ckptd`'s Prometheus metrics, served at `/metrics`.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Cause {
    pub cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabel {
    pub tier: String,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub stall_seconds: Histogram,
    pub snapshots: Counter,
    pub snapshots_skipped: Counter,
    pub data_path_raised: Counter,
    pub durable_skipped: Counter,
    pub durable_deferred: Counter,
    pub commits_given_up: Counter,
    pub bytes_raw: Counter,
    pub bytes_stored: Counter,
    pub bytes_replicated: Counter,
    pub upload_bytes_per_second: Gauge<f64, AtomicU64>,
    pub replicate_seconds: Histogram,
    pub commit_latency_seconds: Histogram,
    pub memory_step: Gauge,
    pub durable_step: Gauge,
    pub restores: Family<TierLabel, Counter>,
    pub errors: Family<Cause, Counter>,
    pub peer_rejected: Family<Cause, Counter>,
    pub replicas_held_bytes: Gauge,
    pub durable_commit_timestamp: Gauge<f64, AtomicU64>,
    pub stragglers: Gauge,
    pub nodes_drained: Gauge,
    pub spare_nodes: Gauge,
    pub faults: Counter,
    pub leader: Gauge,
    pub leader_epoch: Gauge,
    pub takeovers: Counter,
    pub supervising: Gauge,
    pub run_failed: Gauge,
    pub rollbacks: Counter,
    pub unhealthy: Counter,
    pub recommits: Counter,
    pub sdc_mismatches: Counter,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("lazarus_ckptd");
        let m = Self {
            stall_seconds: Histogram::new(exponential_buckets(1e-5, 4.0, 12)),
            snapshots: Counter::default(),
            snapshots_skipped: Counter::default(),
            data_path_raised: Counter::default(),
            durable_skipped: Counter::default(),
            durable_deferred: Counter::default(),
            commits_given_up: Counter::default(),
            bytes_raw: Counter::default(),
            bytes_stored: Counter::default(),
            bytes_replicated: Counter::default(),
            upload_bytes_per_second: Gauge::default(),
            replicate_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 16)),
            commit_latency_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 18)),
            memory_step: Gauge::default(),
            durable_step: Gauge::default(),
            restores: Family::default(),
            errors: Family::default(),
            peer_rejected: Family::default(),
            replicas_held_bytes: Gauge::default(),
            durable_commit_timestamp: Gauge::default(),
            stragglers: Gauge::default(),
            nodes_drained: Gauge::default(),
            spare_nodes: Gauge::default(),
            faults: Counter::default(),
            leader: Gauge::default(),
            leader_epoch: Gauge::default(),
            takeovers: Counter::default(),
            supervising: Gauge::default(),
            run_failed: Gauge::default(),
            rollbacks: Counter::default(),
            unhealthy: Counter::default(),
            recommits: Counter::default(),
            sdc_mismatches: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "snapshot_stall_seconds",
            "Training-loop stall per snapshot, as the ranks report it",
            m.stall_seconds.clone(),
        );
        registry.register(
            "snapshots",
            "Snapshots accepted from local ranks",
            m.snapshots.clone(),
        );
        registry.register(
            "snapshots_skipped",
            "Snapshots a rank skipped because this daemon was still busy",
            m.snapshots_skipped.clone(),
        );
        registry.register(
            "data_path_raised",
            "Times the data path, under data_cpu = idle, waited past its grace for a CPU and was raised to the ranks' share",
            m.data_path_raised.clone(),
        );
        registry.register(
            "durable_steps_skipped",
            "Durable steps of a local rank never uploaded: a newer one came while an upload ran",
            m.durable_skipped.clone(),
        );
        registry.register(
            "durable_deferrals",
            "Leader: memory commits due to be durable but not made so because a rank's upload still ran (the next one every daemon can upload at once is)",
            m.durable_deferred.clone(),
        );
        registry.register(
            "memory_commits_given_up",
            "Leader: times the steps waiting for the ranks' reports were given up at once, as a rank reported a later step than one of them lacked (a daemon restarted, or ranks handed over different steps)",
            m.commits_given_up.clone(),
        );
        registry.register(
            "bytes_raw",
            "Raw bytes of durable shards written",
            m.bytes_raw.clone(),
        );
        registry.register(
            "bytes_stored",
            "Encoded bytes uploaded to the store",
            m.bytes_stored.clone(),
        );
        registry.register(
            "bytes_replicated",
            "Bytes sent to the buddy node",
            m.bytes_replicated.clone(),
        );
        registry.register(
            "upload_bytes_per_second",
            "Raw bytes per second of the last durable shard upload",
            m.upload_bytes_per_second.clone(),
        );
        registry.register(
            "replicate_seconds",
            "Time to hash a snapshot and replicate it to the buddy",
            m.replicate_seconds.clone(),
        );
        registry.register(
            "commit_latency_seconds",
            "Leader: time from a step's memory commit to its durable commit record",
            m.commit_latency_seconds.clone(),
        );
        registry.register(
            "memory_committed_step",
            "Newest memory-committed step (T0 + T1 on every rank)",
            m.memory_step.clone(),
        );
        registry.register(
            "memory_recommits",
            "Leader: memory commits repeated to a node whose snapshot of a committed step expired before the commit reached it and was handed over again",
            m.recommits.clone(),
        );
        registry.register(
            "durable_committed_step",
            "Newest durable step (commit record written)",
            m.durable_step.clone(),
        );
        // Every tier's series exists from the start, so the first T2 restore is an
        // increase (an alert on `increase(...)` would miss a series that starts at 1).
        for tier in ["t0", "t1", "t2"] {
            drop(m.restores.get_or_create(&TierLabel { tier: tier.into() }));
        }
        registry.register("restores", "Restores served, by tier", m.restores.clone());
        registry.register("errors", "Errors by cause", m.errors.clone());
        registry.register(
            "peer_messages_rejected",
            "Peer messages dropped: unauthenticated, malformed or oversized",
            m.peer_rejected.clone(),
        );
        registry.register(
            "leader",
            "1 on the daemon that leads now, else 0",
            m.leader.clone(),
        );
        registry.register(
            "leader_epoch",
            "The newest leadership epoch this daemon knows of",
            m.leader_epoch.clone(),
        );
        registry.register(
            "leader_takeovers",
            "Times this daemon took over leadership from a lost leader",
            m.takeovers.clone(),
        );
        registry.register(
            "supervising",
            "1 on a leader that supervises the training world, else 0",
            m.supervising.clone(),
        );
        registry.register(
            "run_failed",
            "1 once the leader stopped relaunching the world: the trainer refused its input, or the world failed at the same step again",
            m.run_failed.clone(),
        );
        registry.register(
            "supervisor_rollbacks",
            "Supervising leader: times it rolled the run back to an older step rather than relaunch from the one it kept failing after",
            m.rollbacks.clone(),
        );
        registry.register(
            "supervisor_sdc_mismatches",
            "Supervising leader: worlds stopped because replicated copies of a weight differed (silent data corruption); the suspect's node is drained",
            m.sdc_mismatches.clone(),
        );
        registry.register(
            "supervisor_unhealthy",
            "Supervising leader: worlds stopped because a rank's health check failed (a non-finite loss or gradient norm, a loss spike)",
            m.unhealthy.clone(),
        );
        registry.register(
            "durable_commit_timestamp_seconds",
            "Leader: Unix time of the newest durable commit record (or of its start, before any)",
            m.durable_commit_timestamp.clone(),
        );
        registry.register(
            "stragglers",
            "Leader: ranks persistently slower than the median by more than straggler_margin",
            m.stragglers.clone(),
        );
        registry.register(
            "nodes_drained",
            "Supervising leader: nodes it drained in Slurm that are still out",
            m.nodes_drained.clone(),
        );
        registry.register(
            "spare_nodes",
            "Supervising leader: connected idle nodes ready to replace a lost one",
            m.spare_nodes.clone(),
        );
        registry.register(
            "supervisor_faults",
            "Supervising leader: failures that stopped the world",
            m.faults.clone(),
        );
        registry.register(
            "replicas_held_bytes",
            "Bytes of buddy replicas (T1) held in shared memory, with each rank's spare replica file",
            m.replicas_held_bytes.clone(),
        );
        Self { registry, ..m }
    }

    pub fn error(&self, cause: &str) {
        self.errors
            .get_or_create(&Cause {
                cause: cause.into(),
            })
            .inc();
    }

    pub fn rejected(&self, cause: &str) {
        self.peer_rejected
            .get_or_create(&Cause {
                cause: cause.into(),
            })
            .inc();
    }

    pub fn restored(&self, tier: &str) {
        self.restores
            .get_or_create(&TierLabel { tier: tier.into() })
            .inc();
    }

    pub fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String does not fail");
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Serves `GET /metrics` on `address` from a background thread.
pub fn serve(address: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<SocketAddr> {
    let server = tiny_http::Server::http(address).map_err(std::io::Error::other)?;
    let bound = server
        .server_addr()
        .to_ip()
        .ok_or_else(|| std::io::Error::other("metrics server is not on TCP"))?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let response = if request.url() == "/metrics" {
                    let header = tiny_http::Header::from_bytes(
                        &b"Content-Type"[..],
                        &b"text/plain; version=0.0.4"[..],
                    )
                    .expect("a valid header");
                    tiny_http::Response::from_string(metrics.encode()).with_header(header)
                } else {
                    tiny_http::Response::from_string("see /metrics\n").with_status_code(404)
                };
                let _ = request.respond(response);
            }
        })?;
    Ok(bound)
}
