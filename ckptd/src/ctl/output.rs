//! How `ckptctl` talks to people and programs: progress bars on a terminal, aligned tables,
//! byte counts, times, and JSON when asked.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lazarus_shared::store::Progress;

/// A progress bar on stderr; invisible when stderr is not a terminal or output is JSON.
#[derive(Debug)]
pub struct Bar(ProgressBar);

impl Bar {
    pub fn bytes(message: &'static str, visible: bool) -> Self {
        Self::new(
            message,
            visible,
            "{msg:>10} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
    }

    pub fn items(message: &'static str, visible: bool) -> Self {
        Self::new(
            message,
            visible,
            "{msg:>10} [{bar:40}] {pos}/{len} eta {eta}",
        )
    }

    fn new(message: &'static str, visible: bool, template: &str) -> Self {
        let target = if visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(0), target);
        bar.set_style(
            ProgressStyle::with_template(template)
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_message(message);
        Self(bar)
    }

    pub fn set_total_bytes(&self, total: u64) {
        self.0.set_length(total);
    }

    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl Progress for Bar {
    fn set_total(&self, total: u64) {
        self.0.set_length(total);
    }

    fn advance(&self, amount: u64) {
        self.0.inc(amount);
    }
}

pub fn bytes(count: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = count as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{count} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

pub fn ratio(raw: u64, stored: u64) -> String {
    if stored == 0 {
        "-".into()
    } else {
        format!("{:.2}x", raw as f64 / stored as f64)
    }
}

pub fn time(unix_ms: Option<u64>) -> String {
    match unix_ms {
        Some(ms) => humantime::format_rfc3339_seconds(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms),
        )
        .to_string(),
        None => "-".into(),
    }
}

/// Prints rows as left-aligned columns under a header.
pub fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        say!("{}", padded.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        line(row.clone());
    }
}

pub fn json(value: &impl serde::Serialize) {
    say!(
        "{}",
        serde_json::to_string_pretty(value).expect("output types serialise")
    );
}

/// Writes one line of output (see `say!`).
pub fn say_line(line: std::fmt::Arguments) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = out
        .write_fmt(line)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    match written {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(error) => {
            eprintln!("ckptctl: error: writing the output: {error}");
            std::process::exit(1);
        }
    }
}
