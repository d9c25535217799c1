//! The leader against a simulated cluster (`lazarus_tests::scale`): 256 nodes of 8 ranks
//! speaking the real wire protocol to a real `ckptd --lead`.

use std::time::Duration;

use lazarus_tests::deadline::{logs_under, test_dir};
use lazarus_tests::scale::{self, Load};

#[test]
fn at_256_nodes_of_8_ranks_every_step_is_memory_committed_exactly_once_on_every_node() {
    let dir = test_dir();
    let load = Load::new(256, 8)
        .steps(20, Duration::from_millis(250))
        .with_takeover();
    let figures = scale::run(dir.path(), &load).unwrap();
    println!("{}\n{}", scale::Figures::header(), figures.row());
    // 20 steps, then 3 more committed by the successor after the leader was killed.
    assert_eq!(figures.commits.len(), 23);
    assert!(figures.takeover_s.is_some(), "{figures:?}");
    assert_eq!(
        figures.commit_faults(),
        Vec::new(),
        "steps some node did not receive exactly once\n{}",
        logs_under(dir.path())
    );
    assert_eq!(figures.commit_ms.samples, 256 * 20);
    // The node silenced at the end was declared lost, after the heartbeat timeout.
    assert!(figures.lost_after_ms >= 1500.0, "{figures:?}");
}

/// The store's cost in requests grows with what an operation must read, not with the run's
/// whole history: a commit reads each manifest once, the catalog lists the step folders
/// instead of every manifest, `latest` reads one record however long the run, and gc
/// deletes chunks a thousand to a request where S3 takes them so.
#[test]
fn store_operations_cost_the_requests_they_must() {
    use lazarus_tests::store_scale::{self, Backend};
    let dir = test_dir();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let backend = Backend::File(dir.path());

    let commit = runtime.block_on(store_scale::commit(backend, 300)).unwrap();
    for figure in &commit {
        println!("{}", figure.row());
    }
    for figure in commit.iter().filter(|f| f.what.starts_with("commit")) {
        // Every manifest read once, the commit record put once, nothing listed.
        assert_eq!(
            (figure.requests.get, figure.requests.put),
            (300, 1),
            "{figure:?}"
        );
        assert_eq!(figure.requests.listed, 0, "{figure:?}");
    }

    let history = runtime
        .block_on(store_scale::history(backend, 200, 4))
        .unwrap();
    for figure in &history {
        println!("{}", figure.row());
    }
    let (latest, listed): (Vec<_>, Vec<_>) =
        history.iter().partition(|f| f.what.starts_with("latest"));
    // run.json and the newest commit record, and two listings (rollbacks, commits).
    assert_eq!(latest[0].requests.get, 2, "{:?}", latest[0]);
    for figure in listed {
        // 200 commit records and 200 step folders, not the 800 manifests in them.
        assert_eq!(figure.requests.listed, 400, "{figure:?}");
        assert_eq!(figure.requests.get, 201, "{figure:?}");
    }

    let gc = runtime
        .block_on(store_scale::gc(backend, 20_000, 100))
        .unwrap();
    println!("{}", gc[0].row());
    let deleted = gc[0].requests.deleted;
    // 90 of 100 steps dropped: their chunks, manifests and commit records.
    assert!(deleted > 18_000, "{:?}", gc[0]);
    // Each dropped step's commit record and manifests, then the chunks a thousand at a time.
    assert!(
        gc[0].requests.delete <= 90 * 2 + deleted.div_ceil(1000) + 4,
        "{:?}",
        gc[0]
    );
}
