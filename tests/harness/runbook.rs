//! Runs the commands of a runbook (`runbooks/*.md`) as an operator would paste them, so the
//! runbooks stay true. A runbook's shell commands are its ```sh blocks, grouped by their
//! `## ` section. Each command must exit 0, or the code its `# exits N` comment names.
//! Commands read what they act on from the environment (`$RUN`, `$LEADER`, `$NODE`, ...),
//! which the test sets; `ckptctl`, `ckptd` and `trainer` are the built binaries.
//!
//! A test that loads a runbook must run every section that has commands: dropping the
//! [`Runbook`] with a section not run fails the test.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use crate::bin;

#[derive(Debug)]
pub struct Runbook {
    name: String,
    sections: Vec<(String, Vec<String>)>,
    ran: RefCell<BTreeSet<String>>,
}

impl Runbook {
    pub fn load(name: &str) -> Self {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../runbooks")
            .join(name);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut sections: Vec<(String, Vec<String>)> = Vec::new();
        let mut section = String::new();
        let mut in_block = false;
        let mut pending = String::new();
        for line in text.lines() {
            if !in_block {
                if let Some(heading) = line.strip_prefix("## ") {
                    section = heading.trim().to_string();
                } else if line.trim() == "```sh" {
                    in_block = true;
                }
                continue;
            }
            if line.trim() == "```" {
                in_block = false;
                continue;
            }
            // A trailing backslash continues the command on the next line.
            if let Some(start) = line.strip_suffix('\\') {
                pending.push_str(start);
                pending.push(' ');
                continue;
            }
            pending.push_str(line);
            let command = std::mem::take(&mut pending);
            if command.trim().is_empty() || command.trim_start().starts_with('#') {
                continue;
            }
            match sections.iter_mut().find(|(name, _)| *name == section) {
                Some((_, commands)) => commands.push(command),
                None => sections.push((section.clone(), vec![command])),
            }
        }
        assert!(!sections.is_empty(), "{name} has no ```sh commands");
        Self {
            name: name.to_string(),
            sections,
            ran: RefCell::new(BTreeSet::new()),
        }
    }

    /// Runs every command of `section` with `env`, checks each exit code, and returns what
    /// they printed (stdout and stderr, command by command).
    pub fn run(&self, section: &str, env: &[(&str, String)]) -> String {
        let commands = self
            .sections
            .iter()
            .find(|(name, _)| name == section)
            .map(|(_, commands)| commands)
            .unwrap_or_else(|| {
                panic!(
                    "{} has no section {section:?} with commands (it has {:?})",
                    self.name,
                    self.sections.iter().map(|(n, _)| n).collect::<Vec<_>>()
                )
            });
        self.ran.borrow_mut().insert(section.to_string());
        let bin_dir = bin("ckptctl").parent().expect("a directory").to_path_buf();
        let path = format!(
            "{}:{}",
            bin_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut printed = String::new();
        for command in commands {
            let expected = expected_code(command);
            let output = Command::new("bash")
                .args(["-o", "pipefail", "-c", command])
                .env("PATH", &path)
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .output()
                .expect("bash runs");
            let text = format!(
                "$ {command}\n{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            assert_eq!(
                output.status.code(),
                Some(expected),
                "{} ({section}): the command exited {:?}, the runbook expects {expected}:\n{text}",
                self.name,
                output.status.code()
            );
            printed.push_str(&text);
        }
        printed
    }
}

impl Drop for Runbook {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let ran = self.ran.borrow();
        let missed: Vec<&String> = self
            .sections
            .iter()
            .map(|(name, _)| name)
            .filter(|name| !ran.contains(*name))
            .collect();
        assert!(
            missed.is_empty(),
            "{}: the test never ran the commands of {missed:?}",
            self.name
        );
    }
}

/// The exit code a command's `# exits N` comment names, else 0.
fn expected_code(command: &str) -> i32 {
    command
        .rsplit_once('#')
        .and_then(|(_, comment)| {
            let mut words = comment.split_whitespace();
            while let Some(word) = words.next() {
                if word == "exits" {
                    return words
                        .next()
                        .map(|n| n.trim_end_matches(|c: char| !c.is_ascii_digit()))
                        .and_then(|n| n.parse().ok());
                }
            }
            None
        })
        .unwrap_or(0)
}
