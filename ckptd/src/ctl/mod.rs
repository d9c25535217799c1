//! `ckptctl`: the operator CLI over the checkpoint store.
//!
//! Exit codes: 0 ok, 1 failure (storage unreachable, IO), 2 usage or bad input, 3 an
//! integrity problem was found (`verify` found damage, or a read refused damaged data).

/// `println!` for ckptctl's output: when the reader of stdout has gone (`ckptctl list |
/// head`), the program ends quietly with success instead of panicking; any other write
/// error ends it with exit 1.
macro_rules! say {
    () => {
        $crate::ctl::output::say_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::ctl::output::say_line(format_args!($($arg)*))
    };
}

mod commands;
pub mod output;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use lazarus_shared::store::{OpenMode, S3Settings, Store, StoreOptions};
use lazarus_shared::StoreError;

pub use crate::logging::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "ckptctl",
    version,
    about = "Inspect, audit, restore, roll back and garbage-collect Lazarus checkpoints"
)]
pub struct Cli {
    /// Store URL: file:///path, s3://bucket/prefix or memory://
    #[arg(long, env = "LAZARUS_STORE", global = true)]
    pub store: Option<String>,
    /// Machine-readable JSON on stdout instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// Local chunk index directory (default: a per-store directory under the user's cache).
    #[arg(long, env = "LAZARUS_INDEX", global = true)]
    pub index: Option<PathBuf>,
    /// Work without the local chunk index.
    #[arg(long, global = true)]
    pub no_index: bool,
    /// S3 endpoint (overrides AWS_ENDPOINT).
    #[arg(long, global = true)]
    pub s3_endpoint: Option<String>,
    /// S3 region (overrides AWS_REGION).
    #[arg(long, global = true)]
    pub s3_region: Option<String>,
    /// Allow plain-HTTP S3 endpoints (overrides AWS_ALLOW_HTTP).
    #[arg(long, global = true)]
    pub s3_allow_http: bool,
    /// Chunks uploaded or downloaded at once.
    #[arg(long, global = true, default_value_t = 8)]
    pub concurrency: usize,
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExportFormat {
    /// The tensors as stored (or the imported files, byte for byte).
    Safetensors,
    /// `config.json` and `model.safetensors` that Hugging Face transformers'
    /// `OlmoeForCausalLM` loads (trainer checkpoints only).
    HfOlmoe,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Runs in the store, with their latest step.
    Runs,
    /// Steps of a run with their state, sizes and time.
    List { run: String },
    /// Layout, ranks, tensors, shapes, dtypes and chunk counts of a step.
    Show { run: String, step: String },
    /// Check a step (default: latest), or every step with --all.
    Verify {
        run: String,
        step: Option<String>,
        #[arg(long, conflicts_with = "step")]
        all: bool,
        /// Download and re-hash chunk data.
        #[arg(long)]
        read_data: bool,
        /// With --read-data, check only this percentage of chunks.
        #[arg(long, requires = "read_data", value_parser = parse_percent)]
        sample: Option<f64>,
    },
    /// Which tensors changed between two steps, and by how much.
    Diff { run: String, a: String, b: String },
    /// Import .safetensors files as step N of a run (created if new).
    Import {
        run: String,
        #[arg(long)]
        step: u64,
        /// Delta-encode against the run's latest step where that stores less.
        #[arg(long)]
        delta: bool,
        /// Raw bytes per chunk, used when this import creates the run (default 4 MiB).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1024..=256 << 20))]
        chunk_bytes: Option<u64>,
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Write a step as files other tools load.
    Export {
        run: String,
        step: String,
        #[arg(long, value_enum, default_value_t = ExportFormat::Safetensors)]
        format: ExportFormat,
        #[arg(long)]
        out: PathBuf,
    },
    /// Copy a verified step into a local directory, as a store the trainer can resume from.
    Restore {
        run: String,
        step: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Hide every step after STEP (nothing is deleted); `latest` moves back to STEP.
    Rollback {
        run: String,
        #[arg(long)]
        to: String,
        #[arg(long)]
        reason: String,
    },
    /// The supervisor's failure timeline of a run, with how long each phase took.
    Events { run: String },
    /// The running job as its leader ckptd sees it: nodes, ranks, memory and durable steps.
    Status {
        /// The leader ckptd's TCP address (a daemon that no longer leads points to the one
        /// that does).
        #[arg(long, env = "LAZARUS_LEADER")]
        leader: Option<std::net::SocketAddr>,
        /// The run, to find its leader in the store (`--store`) when `--leader` is not given
        /// or does not answer (after a takeover).
        #[arg(long)]
        run: Option<String>,
        /// The job key file the daemons use.
        #[arg(long, env = "LAZARUS_KEY_FILE")]
        key_file: PathBuf,
    },
    /// Delete steps outside the retention policy and chunks nothing retained references.
    Gc {
        run: String,
        #[arg(long)]
        keep_last: usize,
        #[arg(long)]
        keep_every: Option<u64>,
        /// Leave unreferenced data younger than this (e.g. 30m, 1h).
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        grace: std::time::Duration,
        /// Leave staging files of interrupted local writes younger than this (0s only when no
        /// writer is running).
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        staging_grace: std::time::Duration,
        #[arg(long)]
        dry_run: bool,
    },
    /// The local chunk index.
    Index {
        #[command(subcommand)]
        action: IndexAction,
    },
}

#[derive(Debug, Subcommand)]
pub enum IndexAction {
    /// Recreate the index from storage alone.
    Rebuild,
    /// Counts of chunks, manifests and references in the index.
    Stats,
}

fn parse_percent(text: &str) -> Result<f64, String> {
    match text.trim_end_matches('%').parse::<f64>() {
        Ok(value) if value > 0.0 && value <= 100.0 => Ok(value),
        _ => Err(format!("{text:?} is not a percentage in (0, 100]")),
    }
}

/// A problem with what the user asked for (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Integrity problems were found and reported (exit 3).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct IntegrityProblems(pub String);

pub const EXIT_FAILURE: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_INTEGRITY: u8 = 3;

/// The exit code an error chain deserves.
pub fn exit_code(error: &anyhow::Error) -> u8 {
    for cause in error.chain() {
        if cause.is::<IntegrityProblems>() {
            return EXIT_INTEGRITY;
        }
        if cause.is::<UsageError>()
            || cause.is::<lazarus_shared::safetensors_io::SafetensorsError>()
        {
            return EXIT_USAGE;
        }
        if let Some(store) = cause.downcast_ref::<StoreError>() {
            if store.is_integrity() {
                return EXIT_INTEGRITY;
            }
            if store.is_bad_input() {
                return EXIT_USAGE;
            }
        }
    }
    EXIT_FAILURE
}

pub fn main(cli: Cli) -> ExitCode {
    crate::logging::init(cli.log_format, "warn");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .max_blocking_threads(lazarus_shared::store::blocking_threads())
        .enable_all()
        .build()
        .expect("tokio runtime starts");
    match runtime.block_on(commands::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ckptctl: error: {error:#}");
            ExitCode::from(exit_code(&error))
        }
    }
}

impl Cli {
    pub(crate) fn store_options(&self) -> StoreOptions {
        let index_path = if self.no_index {
            None
        } else {
            self.index
                .clone()
                .or_else(|| self.store.as_deref().map(default_index_path))
        };
        StoreOptions {
            upload_concurrency: self.concurrency.max(1),
            download_concurrency: self.concurrency.max(1),
            index_path,
            s3: S3Settings {
                endpoint: self.s3_endpoint.clone(),
                region: self.s3_region.clone(),
                allow_http: self.s3_allow_http.then_some(true),
                ..S3Settings::default()
            },
            ..StoreOptions::default()
        }
    }

    /// [`Cli::store_options`] without the local chunk index, for commands that never read it.
    pub(crate) fn store_options_without_index(&self) -> StoreOptions {
        StoreOptions {
            index_path: None,
            ..self.store_options()
        }
    }

    pub(crate) async fn open_store(&self, mode: OpenMode) -> anyhow::Result<Store> {
        self.open_store_with(mode, self.store_options()).await
    }

    pub(crate) async fn open_store_with(
        &self,
        mode: OpenMode,
        options: StoreOptions,
    ) -> anyhow::Result<Store> {
        let url = self.store.as_deref().ok_or_else(|| {
            UsageError("no store given: pass --store URL or set LAZARUS_STORE".into())
        })?;
        Ok(Store::open(url, mode, options).await?)
    }
}

/// `$XDG_CACHE_HOME/lazarus/index/<hash of the store URL>` (or under `~/.cache`).
fn default_index_path(url: &str) -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache
        .join("lazarus")
        .join("index")
        .join(&blake3::hash(url.as_bytes()).to_hex()[..16])
}
