//! The leader against a simulated cluster (`lazarus_tests::scale`): 256 nodes of 8 ranks
//! speaking the real wire protocol to a real `ckptd --lead`.

use std::time::Duration;

use lazarus_tests::deadline::test_dir;
use lazarus_tests::scale::{self, Load};

#[test]
fn at_256_nodes_of_8_ranks_every_step_is_memory_committed_exactly_once_on_every_node() {
    let dir = test_dir();
    let load = Load::new(256, 8).steps(20, Duration::from_millis(250));
    let figures = scale::run(dir.path(), &load).unwrap();
    println!("{}\n{}", scale::Figures::header(), figures.row());
    assert_eq!(figures.commits.len(), 20);
    assert_eq!(
        figures.commit_faults(),
        Vec::new(),
        "steps some node did not receive exactly once"
    );
    assert_eq!(figures.commit_ms.samples, 256 * 20);
    // The node silenced at the end was declared lost, after the heartbeat timeout.
    assert!(figures.lost_after_ms >= 1500.0, "{figures:?}");
}
