//! Logging for both programs: one format switch and one subscriber set-up.

use clap::ValueEnum;
use serde::Deserialize;

/// How log lines are written to stderr.
#[derive(Clone, Copy, Debug, Default, ValueEnum, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// `tracing`'s human-readable lines, `key=value` fields.
    #[default]
    Human,
    /// One JSON object per line.
    Json,
}

/// Installs the process's subscriber: stderr, filtered by `LAZARUS_LOG` (else
/// `default_level`).
pub fn init(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LAZARUS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // Colour only on a terminal: a log file (journald, a Slurm job's output) would otherwise
    // get escape codes between every field's name and value.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
