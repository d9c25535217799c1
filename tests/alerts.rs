//! The Prometheus alert rules (`ops/prometheus/lazarus-alerts.yml`): valid, unit-tested by
//! promtool against synthetic series, and written against metric names a real daemon exports.

use std::path::Path;
use std::process::Command;

use lazarus_tests::cluster::{text_of, Cluster, Settings};
use lazarus_tests::deadline::test_dir;

fn prometheus_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/prometheus")
}

#[test]
fn the_alert_rules_pass_promtool_and_name_metrics_the_daemons_export() {
    let Ok(version) = Command::new("promtool").arg("--version").output() else {
        lazarus_tests::skip("promtool is not installed (ops/setup.sh test installs it)");
        return;
    };
    assert!(version.status.success());
    for args in [
        ["check", "rules", "lazarus-alerts.yml"],
        ["test", "rules", "lazarus-alerts.test.yml"],
    ] {
        let output = Command::new("promtool")
            .args(args)
            .current_dir(prometheus_dir())
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "promtool {args:?}: {}",
            text_of(&output)
        );
    }

    // Every lazarus_* name in the rules is on a supervising leader's /metrics page.
    let dir = test_dir();
    let store = format!("file://{}", dir.path().join("store").display());
    let settings = Settings {
        leader_extra: [
            "--supervise",
            "mpiexec",
            "--active-nodes",
            "2",
            "--trainer-arg=train",
        ]
        .map(String::from)
        .to_vec(),
        ..Settings::default()
    };
    let cluster = Cluster::start(dir.path(), "alerts", &store, 1, &settings, Vec::new());
    let page = cluster.metrics(0);
    let rules = std::fs::read_to_string(prometheus_dir().join("lazarus-alerts.yml")).unwrap();
    let mut names: Vec<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("lazarus_ckptd_"))
        .collect();
    names.sort_unstable();
    names.dedup();
    assert!(names.len() >= 7, "{names:?}");
    for name in names {
        let exported = page.lines().any(|line| {
            line.starts_with(&format!("{name} ")) || line.starts_with(&format!("{name}{{"))
        });
        assert!(exported, "{name} is not on /metrics:\n{page}");
    }
    // Every alert names a runbook that exists.
    for line in rules
        .lines()
        .filter(|l| l.trim_start().starts_with("runbook:"))
    {
        let path = line.split_once(':').unwrap().1.trim();
        assert!(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join(path)
                .exists(),
            "{path} is named by an alert but missing"
        );
    }
    // The leader says it leads and supervises.
    assert_eq!(cluster.metric(0, "lazarus_ckptd_leader"), 1.0);
    assert_eq!(cluster.metric(0, "lazarus_ckptd_supervising"), 1.0);
}
