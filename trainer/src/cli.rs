//! The `trainer` command line. Exit codes: 0 ok, 1 failure, 2 usage or bad input.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::config::{Config, ConfigError};
use crate::data::{self, DataError, PrepareProgress};

#[derive(Debug, Parser)]
#[command(
    name = "trainer",
    version,
    about = "Prepare data for and train Mixture-of-Experts language models"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Tokenize text, .jsonl or .jsonl.zst files (or folders of them) into token files.
    Prepare {
        #[arg(long = "input", required = true, num_args = 1..)]
        inputs: Vec<PathBuf>,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "gpt2")]
        tokenizer: String,
        /// Share of the token stream held out for validation (taken from the end).
        #[arg(long, default_value_t = 0.01)]
        val_fraction: f64,
    },
    /// Train a model: --config is a preset name (tiny, small) or a TOML file.
    Train {
        #[arg(long)]
        config: String,
        /// Override a setting: --set section.key=value (repeatable).
        #[arg(long = "set")]
        overrides: Vec<String>,
    },
}

struct Bar(ProgressBar);

impl PrepareProgress for Bar {
    fn set_total(&self, bytes: u64) {
        self.0.set_length(bytes);
    }

    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
}

/// The exit code an error chain deserves.
fn exit_code(error: &anyhow::Error) -> u8 {
    let bad_input = error.chain().any(|cause| {
        cause.is::<ConfigError>() || matches!(cause.downcast_ref::<DataError>(), Some(e) if !matches!(e, DataError::Io { .. }))
            || matches!(cause.downcast_ref::<DataError>(), Some(DataError::Io { cause, .. }) if cause.kind() == std::io::ErrorKind::NotFound)
    });
    if bad_input {
        2
    } else {
        1
    }
}

pub fn main(cli: Cli) -> ExitCode {
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("trainer: error: {error:#}");
            ExitCode::from(exit_code(&error))
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Prepare {
            inputs,
            out,
            tokenizer,
            val_fraction,
        } => {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg:>10} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar.set_message("tokenize");
            let started = Instant::now();
            let index = data::prepare(&inputs, &out, &tokenizer, val_fraction, &Bar(bar.clone()))?;
            bar.finish_and_clear();
            let bytes: u64 = index.sources.iter().map(|s| s.bytes).sum();
            println!(
                "prepared {} document(s) from {} file(s), {:.1} MB of text, in {:.1}s: {} train and {} validation tokens ({} tokenizer) in {}",
                index.documents,
                index.sources.len(),
                bytes as f64 / 1e6,
                started.elapsed().as_secs_f64(),
                index.train.tokens,
                index.val.tokens,
                index.tokenizer,
                out.display()
            );
            Ok(())
        }
        Command::Train { config, overrides } => {
            let config = Config::load(&config, &overrides)?;
            let dataset = data::Dataset::open(std::path::Path::new(&config.data.path))?;
            anyhow::ensure!(
                dataset.train.len() > config.model.seq_len,
                "{}: the training split has {} tokens, fewer than one sequence of {}",
                config.data.path,
                dataset.train.len(),
                config.model.seq_len
            );
            anyhow::bail!(
                "config and data are valid ({} train tokens), but the training loop is not built yet",
                dataset.train.len()
            )
        }
    }
}
