//! Training configuration: a TOML file or a shipped preset (`tiny`, `small`), overridden by
//! `--set section.key=value`, then checked as a whole. Unknown keys, wrong types and
//! impossible shapes are errors that say what to change; nothing is silently defaulted.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Presets shipped in the binary, by name.
pub const PRESETS: [(&str, &str); 2] = [
    ("tiny", include_str!("../presets/tiny.toml")),
    ("small", include_str!("../presets/small.toml")),
];

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("{source_name}: {message}")]
    Parse {
        source_name: String,
        message: String,
    },
    #[error("cannot read config {path}: {cause}")]
    Read { path: String, cause: std::io::Error },
    #[error("--set {assignment:?}: {reason}")]
    BadOverride { assignment: String, reason: String },
    #[error("invalid config: {0}")]
    Invalid(String),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub run: RunConfig,
    pub model: ModelConfig,
    pub train: TrainConfig,
    pub data: DataConfig,
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub parallel: ParallelConfig,
    #[serde(default)]
    pub health: HealthConfig,
    /// Faults the trainer injects into itself, for tests of the supervisor. Refused unless
    /// the environment sets `LAZARUS_ALLOW_TEST_FAULTS=1`, so a config file that carries it
    /// into a real run fails to load instead of crashing the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_faults: Option<TestFaults>,
}

/// The `[health]` section: what makes a step bad. A non-finite loss or gradient norm always
/// does; a loss spike does when `spike_sigma` is above 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// A loss above the mean of the previous `spike_window` steps' by more than this many
    /// of their standard deviations is a spike (0: no spike rule).
    pub spike_sigma: f64,
    pub spike_window: usize,
    /// No spike rule before this step (the loss falls fast early on).
    pub spike_after_step: u64,
    /// A bad step under ckptd: how long the ranks wait for the supervisor to stop the world
    /// and roll it back before they exit with an error.
    pub stop_wait_seconds: f64,
    /// Every this many steps (and at the first step of every launch), the ranks that hold
    /// the same replicated tensor compare its blake3 digest: silent data corruption (0: off).
    pub sdc_check_every: u64,
    /// The first step after a restore must repeat the loss it had before, within this
    /// relative difference, when the layout is the same (a negative value: no check).
    pub restore_loss_tolerance: f64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            spike_sigma: 0.0,
            spike_window: 100,
            spike_after_step: 200,
            stop_wait_seconds: 60.0,
            sdc_check_every: 100,
            restore_loss_tolerance: 1e-4,
        }
    }
}

/// The environment variable that lets a config carry `[test_faults]`.
pub const ALLOW_TEST_FAULTS: &str = "LAZARUS_ALLOW_TEST_FAULTS";

/// The `[test_faults]` section (see [`Config::test_faults`]). Zero turns a fault off.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TestFaults {
    /// Rank `crash_rank` exits with status 70 (a crash) each time it is about to compute
    /// this step.
    pub crash_at_step: u64,
    pub crash_rank: u32,
    /// Rank `nan_rank` puts a NaN into its gradient at the step that trains the data of this
    /// step of the run's first data order (a rollback that skips that data skips the fault).
    pub nan_at_step: u64,
    pub nan_rank: u32,
    /// The data of `garbage_steps` steps from this one (of the first data order) is replaced
    /// by random tokens: a loss spike.
    pub garbage_at_step: u64,
    pub garbage_steps: u64,
    /// After this step's update, the ranks attached to the ckptd whose socket path ends with
    /// `flip_socket` (the node with the bad memory) flip one bit of their copy of the first
    /// replicated weight.
    pub flip_after_step: u64,
    pub flip_socket: String,
    /// After restoring a step newer than this one, every rank shifts its master weights a
    /// little: a restored state that is not what the run had.
    pub perturb_restore_after_step: u64,
    /// Rank `save_fail_rank`'s write of its shard of this step through the store (without
    /// `ckptd`) fails before it stores anything: a store that refuses one rank's puts.
    pub save_fail_at_step: u64,
    pub save_fail_rank: u32,
    /// With `checkpoint.background`, each rank counts a checkpoint it writes as still being
    /// written until the run has trained this many steps past it, however soon it is stored:
    /// a store slow enough that due checkpoints find the one before in flight.
    pub save_busy_steps: u64,
}

/// How ranks split the work when launched under MPI (`mpiexec -n N`): see [`crate::layout`].
/// Tensor parallel `tp` and pipeline parallel `pp`; the data-parallel size is
/// `N / (tp * pp)`, and expert-parallel groups of `ep` data-parallel ranks split each layer's
/// experts. Keys a config file leaves out are 1 (`schedule` is `1f1b`, `overlap_grad_reduce`
/// true, `pipeline_layers` empty): [`ParallelConfig::default`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    #[serde(default = "one")]
    pub tp: usize,
    #[serde(default = "one")]
    pub pp: usize,
    #[serde(default = "one")]
    pub ep: usize,
    /// Micro-batches per pipeline step (`train.micro_batch` is cut into this many).
    #[serde(default = "one")]
    pub micro_batches: usize,
    /// `1f1b` or `interleaved`.
    #[serde(default = "one_f_one_b")]
    pub schedule: String,
    /// Model chunks per pipeline rank under the interleaved schedule.
    #[serde(default = "one")]
    pub virtual_stages: usize,
    /// Reduce-scatter each layer's gradients while the layers below it run their backward
    /// pass (the step's last micro-batch), rather than all of them after it.
    #[serde(default = "yes")]
    pub overlap_grad_reduce: bool,
    /// Layers per pipeline stage, first to last: `pp` counts of at least 1 that sum to
    /// `model.layers`. Empty: an equal share each. The last stage also runs the final norm,
    /// the LM head and the loss, which at a small model's shapes cost as much as several
    /// layers; fewer layers there balance the stages (as Megatron's
    /// `--decoder-last-pipeline-num-layers` does).
    #[serde(default)]
    pub pipeline_layers: Vec<usize>,
}

fn yes() -> bool {
    true
}

fn one() -> usize {
    1
}

fn one_f_one_b() -> String {
    "1f1b".into()
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            tp: 1,
            pp: 1,
            ep: 1,
            micro_batches: 1,
            schedule: one_f_one_b(),
            virtual_stages: 1,
            overlap_grad_reduce: true,
            pipeline_layers: Vec::new(),
        }
    }
}

impl ParallelConfig {
    pub fn schedule(&self) -> Result<crate::layout::Schedule, ConfigError> {
        match self.schedule.as_str() {
            "1f1b" => Ok(crate::layout::Schedule::OneFOneB),
            "interleaved" => Ok(crate::layout::Schedule::Interleaved),
            other => Err(ConfigError::Invalid(format!(
                "parallel.schedule {other:?} must be \"1f1b\" or \"interleaved\""
            ))),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub id: String,
    pub seed: u64,
}

/// The `[model]` section. It is also what every checkpoint stores as `model.json`, so the
/// one definition lives with the format, in the shared crate.
pub type ModelConfig = lazarus_shared::hf_olmoe::ModelSpec;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub micro_batch: usize,
    pub steps: u64,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    /// Weight decay of matrices and embeddings.
    pub weight_decay: f64,
    /// Weight decay of norm weights (excluded by default).
    pub norm_weight_decay: f64,
    pub grad_clip: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub log_every: u64,
    pub val_every: u64,
    pub val_batches: usize,
    /// CPU threads for the math; 0 means one per physical core.
    pub threads: usize,
    /// Load balancing without a loss (DeepSeek-V3's expert bias): after each step, every
    /// layer's bias of an expert that took more than the mean share of the step's tokens falls
    /// by this much, and one that took less rises. The bias only chooses each token's experts.
    /// 0: off.
    #[serde(default)]
    pub router_bias_rate: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// A directory written by `trainer prepare`.
    pub path: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Store URL: file:///path, s3://bucket/prefix (relative file:// paths are resolved
    /// against the working directory).
    pub store: String,
    /// Steps between checkpoints.
    pub every: u64,
    /// `auto`: continue from the run's latest committed step if there is one; `never`.
    pub resume: String,
    /// Unix socket of this node's `ckptd`. Empty: the trainer writes checkpoints through the
    /// store itself. `LAZARUS_CKPTD_SOCKET` in the environment overrides it (one value per
    /// node). With `ckptd`, `every` is the snapshot interval; the daemon decides which
    /// snapshots become durable.
    #[serde(default)]
    pub ckptd: String,
    /// With `ckptd` (or `background`), when it is still busy with the previous snapshot
    /// (checkpoint): `skip` this one (counted in its metrics) or `wait` for it.
    #[serde(default = "default_busy")]
    pub busy: String,
    /// Without `ckptd`: write each checkpoint in the background while training goes on. The
    /// loop stops only to copy the state; the step is committed once every rank's shard is
    /// stored, at the first step that finds them all stored, and a crash before then resumes
    /// from the checkpoint before. `busy` says what a checkpoint due while the one before is
    /// still being written does. The run's last checkpoint is always written in the
    /// foreground.
    #[serde(default)]
    pub background: bool,
}

fn default_busy() -> String {
    "skip".into()
}

impl CheckpointConfig {
    /// The `ckptd` socket in effect, if any. `{node}` in it stands for the Slurm node name
    /// (`SLURMD_NODENAME`), for daemons whose socket path names their node.
    pub fn ckptd_socket(&self) -> Option<std::path::PathBuf> {
        let value = std::env::var("LAZARUS_CKPTD_SOCKET").unwrap_or_else(|_| self.ckptd.clone());
        let node = std::env::var("SLURMD_NODENAME").unwrap_or_default();
        (!value.is_empty()).then(|| value.replace("{node}", &node).into())
    }

    /// Where the run's checkpoints go and how, for the head of the run's log.
    pub fn describe(&self) -> String {
        let (every, busy) = (self.every, &self.busy);
        match self.ckptd_socket() {
            Some(socket) => format!(
                "checkpoints: a snapshot every {every} steps to ckptd at {} ({busy} one due while the daemon is busy){}",
                socket.display(),
                if self.background {
                    "; checkpoint.background has no effect: the daemon writes off the loop already"
                } else {
                    ""
                }
            ),
            None if self.background => format!(
                "checkpoints: every {every} steps to {}, written in the background ({busy} one due while the one before is being written; the run's last in the foreground)",
                self.store
            ),
            None => format!(
                "checkpoints: every {every} steps to {}, written in the foreground",
                self.store
            ),
        }
    }
}

impl Config {
    /// Loads a preset by name, or a TOML file by path, and applies `--set` overrides.
    pub fn load(source: &str, overrides: &[String]) -> Result<Self, ConfigError> {
        let (name, text) = match PRESETS.iter().find(|(name, _)| *name == source) {
            Some((name, text)) => (format!("preset {name}"), text.to_string()),
            None => {
                let text = std::fs::read_to_string(Path::new(source)).map_err(|cause| {
                    ConfigError::Read {
                        path: source.to_string(),
                        cause,
                    }
                })?;
                (source.to_string(), text)
            }
        };
        let parse_error = |message: String| ConfigError::Parse {
            source_name: name.clone(),
            message,
        };
        let mut table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| parse_error(e.to_string()))?;
        // `--set SECTION.KEY=V` on a config without an optional section, or whose section
        // leaves the key out: it starts from the section's defaults (`[test_faults]`: every
        // fault off, and it goes again if no override changed them).
        let defaults = [
            ("health", toml::Value::try_from(HealthConfig::default())),
            ("parallel", toml::Value::try_from(ParallelConfig::default())),
        ];
        for (section, defaults) in defaults {
            let Ok(toml::Value::Table(defaults)) = defaults else {
                unreachable!("a section of plain fields is a table");
            };
            let given = table
                .entry(section)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            // A section that is not a table is left for serde to refuse.
            if let toml::Value::Table(given) = given {
                for (key, value) in defaults {
                    given.entry(key).or_insert(value);
                }
            }
        }
        let seeded = !table.contains_key("test_faults");
        if seeded {
            let defaults = toml::Value::try_from(TestFaults::default()).expect("plain fields");
            table.insert("test_faults".into(), defaults);
        }
        for assignment in overrides {
            apply_override(&mut table, assignment)?;
        }
        let mut config: Config = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| parse_error(e.to_string()))?;
        if seeded && config.test_faults == Some(TestFaults::default()) {
            config.test_faults = None;
        }
        if config.test_faults.is_some() && std::env::var(ALLOW_TEST_FAULTS).as_deref() != Ok("1") {
            return Err(ConfigError::Invalid(format!(
                "[test_faults] injects faults for tests and is refused in a real run; remove it (a test sets {ALLOW_TEST_FAULTS}=1)"
            )));
        }
        config.validate()?;
        Ok(config)
    }

    /// The layout of this config on `ranks` processes, or every reason it does not fit.
    pub fn layout(&self, ranks: usize) -> Result<crate::layout::Layout, ConfigError> {
        crate::layout::Layout::new(&self.parallel, &self.model, self.train.micro_batch, ranks)
    }

    /// The samples one step trains on in `layout`: a micro-batch per data-parallel replica
    /// (the ranks that split a replica's model, tensor and pipeline parallel, share its).
    pub fn global_batch(&self, layout: &crate::layout::Layout) -> usize {
        self.train.micro_batch * layout.dp
    }

    /// Checks that the numbers describe a model and a run that can exist.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let m = &self.model;
        let t = &self.train;
        let mut problems = Vec::new();
        let mut require = |ok: bool, problem: String| {
            if !ok {
                problems.push(problem);
            }
        };
        require(
            self.run.id.parse::<lazarus_shared::RunId>().is_ok(),
            format!("run.id {:?} must be 1-128 of [A-Za-z0-9._-]", self.run.id),
        );
        require(
            m.vocab_size >= 50257,
            format!(
                "model.vocab_size {} is smaller than the GPT-2 vocabulary (50257)",
                m.vocab_size
            ),
        );
        require(
            m.d_model > 0 && m.heads > 0 && m.d_model.is_multiple_of(m.heads),
            format!(
                "model.d_model {} must be a positive multiple of model.heads {}",
                m.d_model, m.heads
            ),
        );
        require(
            m.heads > 0 && (m.d_model / m.heads.max(1)).is_multiple_of(2),
            format!(
                "the head size d_model/heads = {} must be even for RoPE",
                m.d_model / m.heads.max(1)
            ),
        );
        require(m.layers > 0, "model.layers must be at least 1".into());
        require(
            m.experts > 0,
            "model.experts must be at least 1 (1 is the dense variant)".into(),
        );
        require(
            m.top_k > 0 && m.top_k <= m.experts,
            format!(
                "model.top_k {} must be between 1 and model.experts {}",
                m.top_k, m.experts
            ),
        );
        require(
            m.expert_ffn > 0 && m.seq_len > 1,
            "model.expert_ffn and model.seq_len must be positive (seq_len at least 2)".into(),
        );
        require(
            m.rope_theta > 0.0 && m.norm_eps > 0.0,
            "model.rope_theta and model.norm_eps must be positive".into(),
        );
        require(
            m.router_aux_coef >= 0.0 && m.router_z_coef >= 0.0,
            "router loss coefficients cannot be negative".into(),
        );
        require(
            t.micro_batch > 0 && t.steps > 0,
            "train.micro_batch and train.steps must be positive".into(),
        );
        require(
            t.lr > 0.0 && t.min_lr >= 0.0 && t.min_lr <= t.lr,
            format!(
                "need 0 <= train.min_lr ({}) <= train.lr ({}), lr > 0",
                t.min_lr, t.lr
            ),
        );
        require(
            (0.0..1.0).contains(&t.beta1) && (0.0..1.0).contains(&t.beta2) && t.eps > 0.0,
            "train.beta1/beta2 must be in [0, 1) and train.eps positive".into(),
        );
        require(
            t.grad_clip > 0.0 && t.weight_decay >= 0.0,
            "train.grad_clip must be positive and train.weight_decay not negative".into(),
        );
        require(
            t.router_bias_rate.is_finite() && t.router_bias_rate >= 0.0,
            format!(
                "train.router_bias_rate {} must be 0 (off) or positive",
                t.router_bias_rate
            ),
        );
        require(
            t.log_every > 0 && t.val_every > 0 && t.val_batches > 0,
            "train.log_every, val_every and val_batches must be positive".into(),
        );
        let h = &self.health;
        require(
            h.spike_sigma >= 0.0 && h.spike_window >= 2 && h.stop_wait_seconds >= 0.0,
            "health.spike_sigma and stop_wait_seconds must not be negative, health.spike_window at least 2".into(),
        );
        let p = &self.parallel;
        require(
            p.tp > 0 && p.pp > 0 && p.ep > 0 && p.micro_batches > 0 && p.virtual_stages > 0,
            "parallel.tp, pp, ep, micro_batches and virtual_stages must be at least 1".into(),
        );
        if let Err(error) = p.schedule() {
            require(false, error.to_string().replace("invalid config: ", ""));
        }
        require(
            self.checkpoint.every > 0,
            "checkpoint.every must be positive".into(),
        );
        require(
            matches!(self.checkpoint.busy.as_str(), "skip" | "wait"),
            format!(
                "checkpoint.busy {:?} must be \"skip\" or \"wait\"",
                self.checkpoint.busy
            ),
        );
        require(
            matches!(self.checkpoint.resume.as_str(), "auto" | "never"),
            format!(
                "checkpoint.resume {:?} must be \"auto\" or \"never\"",
                self.checkpoint.resume
            ),
        );
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems.join("; ")))
        }
    }
}

/// Applies `section.key=value`. The key must already exist (presets and files name every
/// key), so a typo is an error rather than a silently ignored setting.
fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<(), ConfigError> {
    let bad = |reason: String| ConfigError::BadOverride {
        assignment: assignment.to_string(),
        reason,
    };
    let (key, raw) = assignment
        .split_once('=')
        .ok_or_else(|| bad("expected section.key=value".into()))?;
    let path: Vec<&str> = key.trim().split('.').collect();
    let (last, sections) = path.split_last().expect("split yields at least one part");
    let mut current = table;
    for section in sections {
        current = current
            .get_mut(*section)
            .and_then(toml::Value::as_table_mut)
            .ok_or_else(|| bad(format!("unknown section {section:?}")))?;
    }
    let existing = current.get(*last).ok_or_else(|| {
        let known: Vec<&String> = current.keys().collect();
        bad(format!("unknown key {last:?}; known keys here: {known:?}"))
    })?;
    // Parse the value as TOML; a bare word for a string key is taken as the string.
    let wrong_type = || {
        bad(format!(
            "{key} takes a value of type {}; {:?} is not one",
            existing.type_str(),
            raw.trim()
        ))
    };
    let parsed: toml::Value = match format!("value = {}", raw.trim()).parse::<toml::Table>() {
        Ok(mut wrapper) => wrapper.remove("value").expect("the wrapper has the key"),
        Err(_) if existing.is_str() => toml::Value::String(raw.trim().to_string()),
        Err(_) => return Err(wrong_type()),
    };
    let parsed = match (existing, parsed) {
        // Let `lr=1` set a float key.
        (toml::Value::Float(_), toml::Value::Integer(i)) => toml::Value::Float(i as f64),
        // A bare word for a string key is the string, even one TOML reads otherwise
        // (`run.id=nan`, `run.id=2024`).
        (toml::Value::String(_), parsed) if !parsed.is_str() => {
            toml::Value::String(raw.trim().to_string())
        }
        (_, parsed) => parsed,
    };
    if existing.type_str() != parsed.type_str() {
        return Err(wrong_type());
    }
    current.insert(last.to_string(), parsed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_load_and_describe_the_tiny_model() {
        let tiny = Config::load("tiny", &[]).unwrap();
        let m = &tiny.model;
        assert_eq!(
            (
                m.d_model,
                m.layers,
                m.heads,
                m.experts,
                m.top_k,
                m.expert_ffn,
                m.seq_len,
                m.vocab_size
            ),
            (256, 4, 4, 8, 2, 512, 256, 50304)
        );
        assert_eq!(tiny.train.micro_batch, 8);
        Config::load("small", &[]).unwrap();
    }

    #[test]
    fn the_log_says_where_checkpoints_go_and_that_background_does_nothing_with_ckptd() {
        let load = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            Config::load("tiny", &sets).unwrap().checkpoint
        };
        let foreground = load(&["checkpoint.store=\"file:///s\"", "checkpoint.every=7"]);
        assert_eq!(
            foreground.describe(),
            "checkpoints: every 7 steps to file:///s, written in the foreground"
        );
        let background = load(&["checkpoint.background=true"]);
        assert!(
            background
                .describe()
                .contains("written in the background (skip one due"),
            "{}",
            background.describe()
        );
        if std::env::var_os("LAZARUS_CKPTD_SOCKET").is_none() {
            let both = load(&[
                "checkpoint.background=true",
                "checkpoint.ckptd=\"/run/c.sock\"",
            ]);
            let said = both.describe();
            assert!(said.starts_with("checkpoints: a snapshot every"), "{said}");
            assert!(said.contains("to ckptd at /run/c.sock"), "{said}");
            assert!(
                said.contains("checkpoint.background has no effect"),
                "{said}"
            );
        }
    }

    #[test]
    fn overrides_apply_and_typos_are_refused() {
        let dense = Config::load(
            "tiny",
            &[
                "model.experts=1".into(),
                "model.top_k=1".into(),
                "train.lr=1".into(),
                "checkpoint.store=file:///x".into(),
            ],
        )
        .unwrap();
        assert_eq!(
            (dense.model.experts, dense.model.top_k, dense.train.lr),
            (1, 1, 1.0)
        );
        assert_eq!(dense.checkpoint.store, "file:///x");
        for (bad, says) in [
            ("model.expert=4", "unknown key \"expert\""),
            ("modle.experts=4", "unknown section \"modle\""),
            (
                "model.experts=four",
                "model.experts takes a value of type integer; \"four\" is not one",
            ),
            ("train.lr=\"high\"", "train.lr takes a value of type float"),
            ("model.experts", "expected section.key=value"),
        ] {
            let error = Config::load("tiny", &[bad.into()]).unwrap_err().to_string();
            assert!(error.contains(says), "{bad}: {error}");
        }
    }

    /// `--set parallel.KEY=V` works on a config file whose `[parallel]` section leaves the key
    /// out, or that has no such section: a missing key is its default.
    #[test]
    fn a_parallel_key_a_config_leaves_out_can_still_be_set() {
        // The defaults a section starts from are the ones serde gives a key left out.
        let left_out: ParallelConfig = toml::from_str("").unwrap();
        assert_eq!(left_out, ParallelConfig::default());
        let dir = tempfile::tempdir().unwrap();
        let tiny = PRESETS.iter().find(|(name, _)| *name == "tiny").unwrap().1;
        let (head, _) = tiny.split_once("[parallel]").unwrap();
        let (_, tail) = tiny.split_once("[health]").unwrap();
        for (name, text) in [
            (
                "partial",
                format!("{head}[parallel]\ntp = 1\n\n[health]{tail}"),
            ),
            ("absent", format!("{head}[health]{tail}")),
        ] {
            let path = dir.path().join(format!("{name}.toml"));
            std::fs::write(&path, text).unwrap();
            let path = path.to_str().unwrap();
            let config = Config::load(
                path,
                &[
                    "parallel.pp=2".into(),
                    "parallel.pipeline_layers=[3, 1]".into(),
                ],
            )
            .unwrap();
            assert_eq!(config.parallel.pipeline_layers, [3, 1], "{name}");
            assert_eq!(config.parallel.pp, 2, "{name}");
            let unset = Config::load(path, &[]).unwrap();
            assert_eq!(unset.parallel, ParallelConfig::default(), "{name}");
            let error = Config::load(path, &["parallel.pipeline_layer=[3, 1]".into()])
                .unwrap_err()
                .to_string();
            assert!(error.contains("unknown key \"pipeline_layer\""), "{error}");
        }
    }

    #[test]
    fn impossible_shapes_are_refused_with_the_reason() {
        for (bad, says) in [
            ("model.heads=3", "multiple of model.heads"),
            (
                "model.top_k=9",
                "model.top_k 9 must be between 1 and model.experts 8",
            ),
            ("model.vocab_size=1000", "smaller than the GPT-2 vocabulary"),
            (
                "checkpoint.resume=sometimes",
                "must be \"auto\" or \"never\"",
            ),
            (
                "train.router_bias_rate=-0.001",
                "train.router_bias_rate -0.001 must be 0 (off) or positive",
            ),
        ] {
            let error = Config::load("tiny", &[bad.into()]).unwrap_err().to_string();
            assert!(error.contains(says), "{bad}: {error}");
        }
        let error = Config::load("/no/such/config.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("cannot read config /no/such/config.toml"),
            "{error}"
        );
    }
}
