//! Validated identifiers. Object keys are built only from these types, so a run id or step
//! read from the command line or from a hostile manifest can never escape its run's prefix.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A data-parallel x expert-parallel rank number.
pub type Rank = u32;

/// A run identifier: 1 to 128 characters of `[A-Za-z0-9._-]`, starting with a letter or digit.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RunId(String);

/// A run id that does not follow the rules of [`RunId`].
#[derive(Debug, thiserror::Error)]
#[error("invalid run id {0:?}: use 1 to 128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit")]
pub struct BadRunId(pub String);

impl RunId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for RunId {
    type Error = BadRunId;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        let valid = !text.is_empty()
            && text.len() <= 128
            && text.as_bytes()[0].is_ascii_alphanumeric()
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if valid {
            Ok(Self(text))
        } else {
            Err(BadRunId(text.chars().take(140).collect()))
        }
    }
}

impl FromStr for RunId {
    type Err = BadRunId;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::try_from(text.to_string())
    }
}

impl From<RunId> for String {
    fn from(run: RunId) -> Self {
        run.0
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RunId({})", self.0)
    }
}

/// One checkpointed step on one timeline.
///
/// A rollback starts a new timeline, so that training can write step 110 again after rolling
/// back from 200 to 100 without touching the hidden step 110 of the old timeline. Timeline 0
/// keys are the bare zero-padded step (`000000000110`); later timelines add `-t<n>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StepKey {
    pub step: u64,
    pub timeline: u32,
}

/// The largest step number: object names give a step 12 digits, and the parsers read no
/// other width.
pub const STEP_MAX: u64 = 999_999_999_999;

impl StepKey {
    pub fn new(step: u64, timeline: u32) -> Self {
        Self { step, timeline }
    }

    /// The name used in object keys: `shards/<name>/...`, `commits/<name>.json`.
    pub fn object_name(&self) -> String {
        if self.timeline == 0 {
            format!("{:012}", self.step)
        } else {
            format!("{:012}-t{}", self.step, self.timeline)
        }
    }

    /// Parses what [`StepKey::object_name`] wrote; anything else is `None`.
    pub fn parse_object_name(name: &str) -> Option<Self> {
        let (step, timeline) = match name.split_once("-t") {
            Some((step, timeline)) => (step, timeline.parse::<u32>().ok().filter(|t| *t > 0)?),
            None => (name, 0),
        };
        if step.len() != 12 || !step.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let key = Self::new(step.parse().ok()?, timeline);
        (key.object_name() == name).then_some(key)
    }
}

impl fmt::Display for StepKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.timeline == 0 {
            write!(f, "{}", self.step)
        } else {
            write!(f, "{} (timeline {})", self.step, self.timeline)
        }
    }
}

impl fmt::Debug for StepKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StepKey({}/t{})", self.step, self.timeline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_cannot_escape_their_prefix() {
        for bad in [
            "",
            "..",
            "../x",
            "a/b",
            ".hidden",
            "a b",
            "-x",
            &"x".repeat(129),
        ] {
            assert!(bad.parse::<RunId>().is_err(), "{bad:?} accepted");
        }
        for good in ["run1", "olmoe-1b.v2_final", "7"] {
            assert_eq!(good.parse::<RunId>().expect("valid").as_str(), good);
        }
    }

    #[test]
    fn step_keys_round_trip_and_reject_lookalikes() {
        for key in [
            StepKey::new(0, 0),
            StepKey::new(110, 0),
            StepKey::new(110, 3),
        ] {
            assert_eq!(StepKey::parse_object_name(&key.object_name()), Some(key));
        }
        for bad in [
            "110",
            "000000000110-t0",
            "000000000110-t",
            "00000000011a",
            "000000000110-t01",
        ] {
            assert_eq!(StepKey::parse_object_name(bad), None, "{bad:?} accepted");
        }
    }
}
