//! The trainer over MPI (a real `mpiexec` from MPICH): ranks in data, expert, tensor and
//! pipeline parallel layouts with the ZeRO-1 sharded optimizer train the same model as one
//! process on the same global batch, a layout repeats bit for bit, and a checkpoint taken with
//! one layout resumes in another.

use std::path::Path;
use std::process::Command;

use lazarus_tests::bin;
use lazarus_tests::runbook::Runbook;
use lazarus_tests::train::{metrics_records, prepared, TrainerArgs};

/// A small model; `micro_batch` is per rank, so the global batch is micro_batch x ranks.
fn args(dir: &Path, run: &str, steps: u64, micro_batch: usize) -> Vec<String> {
    args_ep(dir, run, steps, micro_batch, 1)
}

/// [`args`] with `parallel.ep`.
fn args_ep(dir: &Path, run: &str, steps: u64, micro_batch: usize, ep: usize) -> Vec<String> {
    args_layout(
        dir,
        run,
        steps,
        micro_batch,
        &[&format!("parallel.ep={ep}")],
    )
}

/// [`args`] with the `parallel` settings `layout` (e.g. `parallel.tp=2`).
fn args_layout(
    dir: &Path,
    run: &str,
    steps: u64,
    micro_batch: usize,
    layout: &[&str],
) -> Vec<String> {
    TrainerArgs::small(dir)
        .run(run)
        .set("train.micro_batch", micro_batch)
        .steps(steps)
        // Inside the warm-up the schedule does not depend on train.steps, so a run stopped
        // at step 5 and resumed to 10 sees the same learning rates as one run to 10. At a
        // peak of 0.02 the loss falls steeply enough by step 10 that the gradient norm
        // magnifies the layouts' rounding differences to 2e-5 (the loss stays within 1e-7);
        // at 0.01 both stay within 1e-6.
        .sets([
            "train.warmup_steps=20",
            "train.lr=0.01",
            "train.val_every=1000",
        ])
        .sets(layout.iter().copied())
        .set("checkpoint.every", 5)
        .store(&format!("file://{}", dir.join("store").display()))
        .build()
}

fn run(ranks: usize, args: &[String]) -> String {
    let mut command = if ranks == 1 {
        Command::new(bin("trainer"))
    } else {
        let mut command = Command::new("mpiexec");
        command.args(["-n", &ranks.to_string()]).arg(bin("trainer"));
        command
    };
    let output = command.args(args).output().expect("mpiexec runs");
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{ranks} ranks: {text}");
    text
}

/// `ckptctl` on the store the [`args`] runs checkpoint to.
fn store_ctl(dir: &Path) -> lazarus_tests::Ctl {
    lazarus_tests::Ctl::new(
        format!("file://{}", dir.join("store").display()),
        &dir.join("index"),
    )
}

/// (step, loss, gradient norm) from a run's metrics.jsonl.
fn losses(dir: &Path, run: &str) -> Vec<(u64, f64, f64)> {
    let text = std::fs::read_to_string(dir.join("metrics").join(run).join("metrics.jsonl"))
        .expect("metrics");
    text.lines()
        .map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).unwrap();
            (
                value["step"].as_u64().unwrap(),
                value["loss"].as_f64().unwrap(),
                value["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// (step, validation loss) from a run's metrics.jsonl, for the steps that validated.
fn val_losses(dir: &Path, run: &str) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(dir.join("metrics").join(run).join("metrics.jsonl"))
        .expect("metrics");
    text.lines()
        .filter_map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).ok()?;
            Some((value["step"].as_u64()?, value["val_loss"].as_f64()?))
        })
        .collect()
}

/// The same steps, with losses and gradient norms within 1e-5 relative.
fn assert_close(a: &[(u64, f64, f64)], b: &[(u64, f64, f64)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for ((step_a, loss_a, norm_a), (step_b, loss_b, norm_b)) in a.iter().zip(b) {
        assert_eq!(step_a, step_b);
        for (figure, x, y) in [("loss", loss_a, loss_b), ("gradient norm", norm_a, norm_b)] {
            let relative = (x - y).abs() / x.abs().max(1e-12);
            assert!(
                relative < 1e-5,
                "{what}: step {step_a}: {figure} {x} vs {y} (relative {relative:.2e})"
            );
        }
    }
}

/// The exact bits of a run's figures, for a layout that must repeat itself.
fn bits(figures: &[(u64, f64, f64)]) -> Vec<(u64, u64, u64)> {
    figures
        .iter()
        .map(|(step, loss, norm)| (*step, loss.to_bits(), norm.to_bits()))
        .collect()
}

/// The rows of rank 0's layout table, split at whitespace: rank, tp, pp, dp, ep, host, then
/// weights, gradients and optimizer MB held, each followed by its prediction in parentheses.
fn layout_rows(said: &str) -> Vec<Vec<String>> {
    said.lines()
        .skip_while(|line| !line.starts_with("layout: "))
        .skip(2)
        .map(|line| {
            line.split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .take_while(|row| row.len() == 12 && row[0].parse::<usize>().is_ok())
        .collect()
}

/// Rank 0's layout table has a row for each of `ranks` ranks, with the coordinates
/// `[tp, pp, dp, ep]` that `coords` gives for it, and every rank holds what the layout
/// predicts (to the table's 0.1 MB).
fn assert_layout_table(said: &str, ranks: usize, coords: impl Fn(usize) -> [usize; 4]) {
    let rows = layout_rows(said);
    assert_eq!(rows.len(), ranks, "{said}");
    for (rank, row) in rows.iter().enumerate() {
        let [tp, pp, dp, ep] = coords(rank);
        assert_eq!(
            row[..5],
            [rank, tp, pp, dp, ep].map(|n| n.to_string()),
            "{said}"
        );
        for (held, predicted) in [(6, 7), (8, 9), (10, 11)] {
            assert_eq!(format!("({})", row[held]), row[predicted], "{said}");
        }
    }
}

#[test]
fn two_ranks_train_like_one_process_and_repeat_bit_for_bit() {
    let (_guard, dir) = prepared();
    run(1, &args(&dir, "single", 10, 4));
    let said = run(2, &args(&dir, "dp2", 10, 2));
    assert!(said.contains("2 ranks (data parallel 2"), "{said}");
    // The gradient was reduced layer by layer around the backward pass (the default).
    assert!(
        said.contains("gradient reduce-scatter on rank 0, layer by layer"),
        "{said}"
    );
    let single = losses(&dir, "single");
    let dp2 = losses(&dir, "dp2");
    println!("single: {single:?}\ndp2:    {dp2:?}");
    assert_close(&single, &dp2, "DP2 vs one process");
    assert!(single[9].1 < single[0].1, "the loss falls");

    // Expert parallel: 2 ranks that split the experts, and 4 ranks in two EP groups of 2.
    run(2, &args_ep(&dir, "ep2", 10, 2, 2));
    assert_close(&single, &losses(&dir, "ep2"), "DP2 x EP2 vs one process");
    let said = run(4, &args_ep(&dir, "dp4-ep2", 10, 1, 2));
    assert!(said.contains("expert parallel 2"), "{said}");
    // Rank 0's layout table: rank r is data-parallel rank r at place r % 2 of its expert
    // group.
    assert_layout_table(&said, 4, |rank| [0, 0, rank, rank % 2]);
    assert_close(
        &single,
        &losses(&dir, "dp4-ep2"),
        "DP4 x EP2 vs one process",
    );

    // Tensor parallel: 2 ranks split the heads, the vocabulary and the experts; then with
    // data and expert parallel beside it.
    let tp2 = ["parallel.tp=2"];
    let said = run(2, &args_layout(&dir, "tp2", 10, 4, &tp2));
    assert!(said.contains("layout: tp 2 x pp 1 x dp 1 (ep 1)"), "{said}");
    let tp2_losses = losses(&dir, "tp2");
    assert_close(&single, &tp2_losses, "TP2 vs one process");
    let said = run(
        4,
        &args_layout(
            &dir,
            "tp2-dp2-ep2",
            10,
            2,
            &["parallel.tp=2", "parallel.ep=2"],
        ),
    );
    // Rank r is tensor-parallel rank r % 2 of data-parallel rank r / 2.
    assert_layout_table(&said, 4, |rank| [rank % 2, 0, rank / 2, rank / 2]);
    let tp2_dp2_ep2_losses = losses(&dir, "tp2-dp2-ep2");
    assert_close(
        &single,
        &tp2_dp2_ep2_losses,
        "TP2 x DP2 x EP2 vs one process",
    );

    // Again, checkpointing every other step in the background: the ranks agree when both
    // shards are stored and rank 0 commits, while training goes on, bit for bit as before.
    let mut background = args(&dir, "dp2-again", 10, 2);
    background.extend(
        [
            "--set",
            "checkpoint.every=2",
            "--set",
            "checkpoint.background=true",
            "--set",
            "checkpoint.busy=wait",
        ]
        .map(String::from),
    );
    run(2, &background);
    assert_eq!(
        bits(&losses(&dir, "dp2-again")),
        bits(&dp2),
        "the same layout repeats bit for bit"
    );
    run(2, &args_layout(&dir, "tp2-again", 10, 4, &tp2));
    assert_eq!(
        bits(&losses(&dir, "tp2-again")),
        bits(&tp2_losses),
        "TP2 repeats bit for bit"
    );
    run(
        4,
        &args_layout(
            &dir,
            "tp2-dp2-ep2-again",
            10,
            2,
            &["parallel.tp=2", "parallel.ep=2"],
        ),
    );
    assert_eq!(
        bits(&losses(&dir, "tp2-dp2-ep2-again")),
        bits(&tp2_dp2_ep2_losses),
        "TP2 x DP2 x EP2 repeats bit for bit"
    );

    // Every rank's shard is stored and verifies; rank 0 committed step 10 for 2 ranks.
    let ctl = store_ctl(&dir);
    let shown = ctl.json(&["show", "dp2", "10"]);
    assert_eq!(shown["manifests"].as_array().unwrap().len(), 2, "{shown}");
    ctl.expect(0, &["verify", "dp2", "--all", "--read-data"]);
    // Every background checkpoint was committed with both ranks' shards.
    let listed = ctl.json(&["list", "dp2-again"]);
    let committed: Vec<(u64, u64)> = listed["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|step| step["state"] == "committed")
        .map(|step| {
            (
                step["step"]["step"].as_u64().unwrap(),
                step["world_size"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        committed,
        [(2, 2), (4, 2), (6, 2), (8, 2), (10, 2)],
        "{listed}"
    );
    ctl.expect(0, &["verify", "dp2-again", "--all", "--read-data"]);
}

/// `train --trace`: each rank writes a Chrome trace of the launch's first steps, and
/// `trace-summary` prints a step of it by phase and by op, the expert exchange and the MPI
/// waits included. Tracing leaves the losses as they were, bit for bit.
#[test]
fn a_traced_run_writes_each_rank_a_timeline_of_its_first_steps_by_phase_and_op() {
    let (_guard, dir) = prepared();
    let trace = dir.join("trace.json");
    let mut traced = args_ep(&dir, "traced", 6, 2, 2);
    traced.extend([
        "--trace".to_string(),
        trace.display().to_string(),
        "--trace-steps".to_string(),
        "3".to_string(),
    ]);
    run(2, &traced);
    run(2, &args_ep(&dir, "untraced", 6, 2, 2));
    assert_eq!(
        bits(&losses(&dir, "traced")),
        bits(&losses(&dir, "untraced")),
        "tracing changes nothing"
    );
    let summary = |file: &Path, step: Option<&str>| {
        let mut command = Command::new(bin("trainer"));
        command.arg("trace-summary").arg(file);
        if let Some(step) = step {
            command.args(["--step", step]);
        }
        command.output().expect("trainer runs")
    };
    for rank in 0..2 {
        let file = dir.join(format!("trace.rank{rank}.json"));
        // A whole JSON array of trace events.
        let events: Vec<serde_json::Value> =
            serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        assert!(events.iter().all(|e| e["ph"].is_string()), "{file:?}");
        let output = summary(&file, None);
        let text = String::from_utf8_lossy(&output.stdout).to_string();
        assert!(output.status.success(), "{text}");
        println!("rank {rank}:\n{text}");
        assert!(text.starts_with("step 3: "), "the last traced step: {text}");
        for span in [
            "forward",
            "backward",
            "optimizer",
            "embed",
            "attention",
            "attention_backward",
            "rms_norm",
            "rms_norm_backward",
            "router",
            "swiglu",
            "grouped_matmul_backward",
            "lm_head_loss",
            "expert_dispatch",
            "expert_combine",
            "expert_dispatch_backward",
            "expert_combine_backward",
            "reduce_scatter",
            "all_gather",
            "adamw",
            "mpi_wait",
        ] {
            let line = text
                .lines()
                .find(|l| l.split_whitespace().next() == Some(span))
                .unwrap_or_else(|| panic!("no {span} in rank {rank}'s step:\n{text}"));
            let calls: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
            assert!(calls > 0, "{line}");
        }
        // Steps past --trace-steps are not recorded.
        let output = summary(&file, Some("4"));
        assert!(!output.status.success());
        let said = String::from_utf8_lossy(&output.stderr);
        assert!(
            said.contains("no complete step 4 (traced: [1, 2, 3])"),
            "{said}"
        );
    }
    // Both ranks' files: each step, then its waits inside MPI split by op between waiting
    // together and waiting for the other rank, the expert exchange among them.
    let output = Command::new(bin("trainer"))
        .arg("trace-summary")
        .args((0..2).map(|rank| dir.join(format!("trace.rank{rank}.json"))))
        .output()
        .expect("trainer runs");
    let text = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(output.status.success(), "{text}");
    println!("both ranks:\n{text}");
    let table = text
        .split("waits inside MPI across the 2 ranks")
        .nth(1)
        .unwrap_or_else(|| panic!("no wait split:\n{text}"));
    let waited: f64 = table
        .lines()
        .filter(|l| l.trim_start().starts_with("expert_"))
        .map(|l| {
            let fields: Vec<f64> = l
                .split_whitespace()
                .skip(2)
                .map(|f| f.parse().unwrap())
                .collect();
            fields.iter().sum::<f64>()
        })
        .sum();
    assert!(waited > 0.0, "no wait in the expert exchange:\n{table}");
}

/// Pipeline parallel: each layout matches one process that trains the same global batch in
/// the same micro-batches (whose router statistics are per micro-batch, as in Megatron), and
/// repeats itself bit for bit.
#[test]
fn pipeline_layouts_train_like_one_process_and_repeat_bit_for_bit() {
    let (_guard, dir) = prepared();
    // Validation every 5 steps: through the pipeline's stages, forward only.
    let m4 = ["parallel.micro_batches=4", "train.val_every=5"];
    run(1, &args_layout(&dir, "single-m4", 10, 4, &m4));
    let single_m4 = losses(&dir, "single-m4");
    assert!(single_m4[9].1 < single_m4[0].1, "the loss falls");

    // Two stages over 4 micro-batches: rank r is stage r.
    let pp2 = [
        "parallel.pp=2",
        "parallel.micro_batches=4",
        "train.val_every=5",
    ];
    let said = run(2, &args_layout(&dir, "pp2", 10, 4, &pp2));
    assert!(
        said.contains("layout: tp 1 x pp 2 x dp 1 (ep 1), 4 micro-batches, 1f1b"),
        "{said}"
    );
    assert_layout_table(&said, 2, |rank| [0, rank, 0, 0]);
    assert!(
        said.contains("1F1B predicts 20.0% for pp 2 and 4 micro-batches"),
        "{said}"
    );
    let pp2_losses = losses(&dir, "pp2");
    assert_close(
        &single_m4,
        &pp2_losses,
        "PP2 (4 micro-batches) vs one process",
    );
    let (single_val, pp2_val) = (val_losses(&dir, "single-m4"), val_losses(&dir, "pp2"));
    assert_eq!(single_val.len(), 2, "{single_val:?}");
    assert_eq!(single_val.len(), pp2_val.len(), "{pp2_val:?}");
    for ((step, a), (_, b)) in single_val.iter().zip(&pp2_val) {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "validation at step {step}: {a} vs {b}"
        );
    }

    // Tensor parallel inside each stage: rank r is tensor-parallel rank r % 2 of stage r / 2.
    let tp2_pp2 = ["parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=4"];
    let said = run(4, &args_layout(&dir, "tp2-pp2", 10, 4, &tp2_pp2));
    assert_layout_table(&said, 4, |rank| [rank % 2, rank / 2, 0, 0]);
    let tp2_pp2_losses = losses(&dir, "tp2-pp2");
    assert_close(&single_m4, &tp2_pp2_losses, "TP2 x PP2 vs one process");
    // `ckptctl show` names the layout that wrote a step and each rank's place in it.
    let ctl = store_ctl(&dir);
    let shown = ctl.expect(0, &["show", "tp2-pp2", "10"]);
    assert!(
        shown.contains("written by the layout tp 2 x pp 2 x dp 1 (ep 1), 4 micro-batches, 1f1b"),
        "{shown}"
    );
    let shown = ctl.json(&["show", "tp2-pp2", "10"]);
    assert_eq!(
        shown["layout"]["ranks"],
        serde_json::json!([[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]]),
        "{shown}"
    );

    // Data and expert parallel inside each stage, 2 micro-batches of one sample per rank:
    // rank r is data-parallel rank (and expert place) r % 2 of stage r / 2.
    run(
        1,
        &args_layout(&dir, "single-m2", 10, 4, &["parallel.micro_batches=2"]),
    );
    let dp2_ep2_pp2 = ["parallel.pp=2", "parallel.ep=2", "parallel.micro_batches=2"];
    let said = run(4, &args_layout(&dir, "dp2-ep2-pp2", 10, 2, &dp2_ep2_pp2));
    assert_layout_table(&said, 4, |rank| [0, rank / 2, rank % 2, rank % 2]);
    let dp2_ep2_pp2_losses = losses(&dir, "dp2-ep2-pp2");
    assert_close(
        &losses(&dir, "single-m2"),
        &dp2_ep2_pp2_losses,
        "DP2 x EP2 x PP2 vs one process",
    );

    run(2, &args_layout(&dir, "pp2-again", 10, 4, &pp2));
    assert_eq!(
        bits(&losses(&dir, "pp2-again")),
        bits(&pp2_losses),
        "PP2 repeats bit for bit"
    );
    run(4, &args_layout(&dir, "tp2-pp2-again", 10, 4, &tp2_pp2));
    assert_eq!(
        bits(&losses(&dir, "tp2-pp2-again")),
        bits(&tp2_pp2_losses),
        "TP2 x PP2 repeats bit for bit"
    );
    run(
        4,
        &args_layout(&dir, "dp2-ep2-pp2-again", 10, 2, &dp2_ep2_pp2),
    );
    assert_eq!(
        bits(&losses(&dir, "dp2-ep2-pp2-again")),
        bits(&dp2_ep2_pp2_losses),
        "DP2 x EP2 x PP2 repeats bit for bit"
    );

    // Stages of unequal layers (`parallel.pipeline_layers`) on a model of three: two layers
    // on the first stage and one beside the LM head on the last to step 5, then one and two
    // to step 10 (each stage reads the layers it holds now from the checkpoint). Both match
    // one process.
    let three = ["model.layers=3", "parallel.micro_batches=4"];
    run(1, &args_layout(&dir, "single-l3", 10, 4, &three));
    let uneven = |split| [three[0], three[1], "parallel.pp=2", split];
    let said = run(
        2,
        &args_layout(
            &dir,
            "pp2-uneven",
            5,
            4,
            &uneven("parallel.pipeline_layers=[2, 1]"),
        ),
    );
    assert!(
        said.contains(
            "layout: tp 1 x pp 2 x dp 1 (ep 1), 4 micro-batches, 1f1b, layers per stage [2, 1]"
        ),
        "{said}"
    );
    // Each rank holds what the layout predicts for its stage's layers.
    assert_layout_table(&said, 2, |rank| [0, rank, 0, 0]);
    let shown = ctl.expect(0, &["show", "pp2-uneven", "5"]);
    assert!(shown.contains("layers per stage [2, 1]"), "{shown}");
    let said = run(
        2,
        &args_layout(
            &dir,
            "pp2-uneven",
            10,
            4,
            &uneven("parallel.pipeline_layers=[1, 2]"),
        ),
    );
    assert!(said.contains("resumed from step 5"), "{said}");
    assert!(said.contains("layers per stage [1, 2]"), "{said}");
    assert_layout_table(&said, 2, |rank| [0, rank, 0, 0]);
    assert_close(
        &losses(&dir, "single-l3"),
        &losses(&dir, "pp2-uneven"),
        "PP2 over layers [2, 1], then [1, 2], vs one process",
    );
}

/// A layout that does not fit the world, or a schedule not built yet, ends the job with exit 2 and
/// the reason before any training.
#[test]
fn a_layout_that_does_not_fit_exits_2_with_the_reason() {
    let (_guard, dir) = prepared();
    for (ranks, set, says) in [
        (
            3,
            "parallel.ep=2",
            "parallel.ep 2 must divide the data-parallel size 3",
        ),
        (
            3,
            "parallel.tp=3",
            "parallel.tp 3 must divide model.heads 2",
        ),
        (
            2,
            "parallel.schedule=interleaved",
            "the interleaved pipeline schedule is not built yet",
        ),
        (
            2,
            "parallel.pipeline_layers=[1, 1]",
            "parallel.pipeline_layers [1, 1] gives 2 stages their layers, but parallel.pp is 1",
        ),
    ] {
        let output = Command::new("mpiexec")
            .args(["-n", &ranks.to_string()])
            .arg(bin("trainer"))
            .args(args(&dir, "misfit", 2, 2))
            .args(["--set", set])
            .output()
            .expect("mpiexec runs");
        let said = String::from_utf8_lossy(&output.stdout).to_string()
            + &String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{set} on {ranks}: {said}");
        assert!(said.contains(says), "{set} on {ranks}: {said}");
        assert!(!said.contains("step 1"), "{set} on {ranks}: {said}");
    }
}

/// `train.router_bias_rate` (load balancing by a routing bias, without a loss): every rank
/// holds the same bias, so ranks splitting the experts, the layers or the heads train like one
/// process; the bias travels in the checkpoint, so a run stopped at step 5 resumes bit for bit
/// in its layout and like one process in another.
#[test]
fn the_routing_bias_is_the_same_on_every_rank_and_resumes_with_the_checkpoint() {
    let (_guard, dir) = prepared();
    let bias = ["train.router_bias_rate=0.05"];
    let biased = |run: &str, steps: u64, micro_batch: usize, layout: &[&str]| {
        args_layout(&dir, run, steps, micro_batch, &[&bias[..], layout].concat())
    };
    run(1, &args(&dir, "plain", 10, 4));
    run(1, &biased("biased", 10, 4, &[]));
    let (plain, reference) = (losses(&dir, "plain"), losses(&dir, "biased"));
    println!("plain:  {plain:?}\nbiased: {reference:?}");
    // The bias changes which experts the tokens take, and so the losses after step 1.
    assert_eq!(plain[0], reference[0], "step 1 routes before any update");
    assert!(
        plain[1..]
            .iter()
            .zip(&reference[1..])
            .all(|(p, b)| p.1 != b.1),
        "the bias changed nothing"
    );

    // Two ranks, each with its own experts and tokens: the same bias on both. Two stages,
    // each routing its own layers with the bias the loads of both gave. Two ranks splitting
    // the heads and the experts of each layer, both routing every token.
    run(2, &biased("biased-ep2", 10, 2, &["parallel.ep=2"]));
    assert_close(
        &reference,
        &losses(&dir, "biased-ep2"),
        "DP2 x EP2 with the bias",
    );
    // Where ranks split the experts, the step log also gives the busiest rank's share.
    let rank_imbalance = |run: &str| -> Vec<Option<f64>> {
        let records = metrics_records(&dir, run);
        records
            .iter()
            .map(|r| r["expert_rank_imbalance"].as_f64())
            .collect()
    };
    let ep2 = rank_imbalance("biased-ep2");
    assert!(ep2.iter().all(|r| r.is_some_and(|r| r >= 1.0)), "{ep2:?}");
    let one = rank_imbalance("biased");
    assert!(one.iter().all(Option::is_none), "{one:?}");
    run(2, &biased("biased-pp2", 10, 4, &["parallel.pp=2"]));
    assert_close(&reference, &losses(&dir, "biased-pp2"), "PP2 with the bias");
    run(2, &biased("biased-tp2", 10, 4, &["parallel.tp=2"]));
    assert_close(&reference, &losses(&dir, "biased-tp2"), "TP2 with the bias");

    // Stopped at step 5 and resumed: bit for bit in the same layout, and like one process
    // after two ranks.
    run(1, &biased("biased-again", 5, 4, &[]));
    let said = run(1, &biased("biased-again", 10, 4, &[]));
    assert!(said.contains("resumed from step 5"), "{said}");
    assert_eq!(bits(&losses(&dir, "biased-again")), bits(&reference));
    // Under PP2, rank 0 holds only the first stage's layers, and keeps every layer's bias.
    for (id, micro_batch, layout) in [
        ("biased-ep2-to-1", 2, "parallel.ep=2"),
        ("biased-pp2-to-1", 4, "parallel.pp=2"),
    ] {
        run(2, &biased(id, 5, micro_batch, &[layout]));
        let said = run(1, &biased(id, 10, 4, &[]));
        assert!(said.contains("resumed from step 5"), "{id}: {said}");
        assert_close(&reference, &losses(&dir, id), id);
    }

    // OLMoE's format has no routing bias: exporting a biased step says so, a plain one not.
    let ctl = store_ctl(&dir);
    let export = |run: &str| {
        let out = dir.join("hf").join(run);
        let args = ["export", run, "latest", "--format", "hf-olmoe", "--out"];
        ctl.expect(0, &[&args[..], &[out.to_str().unwrap()]].concat())
    };
    let said = export("biased");
    assert!(
        said.contains("ckptctl: warning: step 10 routes 2 layers' tokens with a bias"),
        "{said}"
    );
    let said = export("plain");
    assert!(!said.contains("warning"), "{said}");
}

#[test]
fn a_checkpoint_resumes_in_another_layout() {
    let (_guard, dir) = prepared();
    run(1, &args(&dir, "straight", 10, 4));
    let straight = losses(&dir, "straight");

    // Two ranks splitting the experts to step 5, then one process from step 5 to 10.
    run(2, &args_ep(&dir, "dp2-to-1", 5, 2, 2));
    let said = run(1, &args(&dir, "dp2-to-1", 10, 4));
    assert!(said.contains("resumed from step 5"), "{said}");
    assert_close(&straight, &losses(&dir, "dp2-to-1"), "DP2 x EP2 then DP1");

    // One process to step 5, then two ranks.
    run(1, &args(&dir, "dp1-to-2", 5, 4));
    let said = run(2, &args(&dir, "dp1-to-2", 10, 2));
    assert!(said.contains("resumed from step 5"), "{said}");
    assert_close(&straight, &losses(&dir, "dp1-to-2"), "DP1 then DP2");

    // Tensor parallel with data and expert parallel to step 5, then one process; and one
    // process to step 5, then TP2.
    let tp2_dp2_ep2 = ["parallel.tp=2", "parallel.ep=2"];
    run(
        4,
        &args_layout(&dir, "tp2-dp2-ep2-to-1", 5, 2, &tp2_dp2_ep2),
    );
    let said = run(1, &args(&dir, "tp2-dp2-ep2-to-1", 10, 4));
    assert!(said.contains("resumed from step 5"), "{said}");
    assert_close(
        &straight,
        &losses(&dir, "tp2-dp2-ep2-to-1"),
        "TP2 x DP2 x EP2 then one process",
    );
    run(1, &args(&dir, "dp1-to-tp2", 5, 4));
    let said = run(
        2,
        &args_layout(&dir, "dp1-to-tp2", 10, 4, &["parallel.tp=2"]),
    );
    assert!(said.contains("resumed from step 5"), "{said}");
    assert_close(
        &straight,
        &losses(&dir, "dp1-to-tp2"),
        "one process then TP2",
    );

    // Pipeline parallel: TP2 x PP2 to step 5, then one process; one process to step 5, then
    // DP2 x PP2; TP2 x DP2 x EP2 to step 5, then PP2 x EP2 (ranks take other layers, other
    // experts and other shards of the optimizer state).
    run(
        4,
        &args_layout(
            &dir,
            "tp2-pp2-to-1",
            5,
            4,
            &["parallel.tp=2", "parallel.pp=2"],
        ),
    );
    let said = run(1, &args(&dir, "tp2-pp2-to-1", 10, 4));
    assert!(said.contains("resumed from step 5"), "{said}");
    assert_close(
        &straight,
        &losses(&dir, "tp2-pp2-to-1"),
        "TP2 x PP2 then one process",
    );
    run(1, &args(&dir, "dp1-to-dp2-pp2", 5, 4));
    let said = run(
        4,
        &args_layout(&dir, "dp1-to-dp2-pp2", 10, 2, &["parallel.pp=2"]),
    );
    assert!(said.contains("resumed from step 5"), "{said}");
    assert_close(
        &straight,
        &losses(&dir, "dp1-to-dp2-pp2"),
        "one process then DP2 x PP2",
    );
    run(
        4,
        &args_layout(&dir, "tp2-dp2-ep2-to-pp2-ep2", 5, 2, &tp2_dp2_ep2),
    );
    let said = run(
        4,
        &args_layout(
            &dir,
            "tp2-dp2-ep2-to-pp2-ep2",
            10,
            2,
            &["parallel.pp=2", "parallel.ep=2"],
        ),
    );
    assert!(said.contains("resumed from step 5"), "{said}");
    assert_close(
        &straight,
        &losses(&dir, "tp2-dp2-ep2-to-pp2-ep2"),
        "TP2 x DP2 x EP2 then PP2 x EP2",
    );

    // The sharded step-5 checkpoint of DP2 x EP2 is complete: every parameter has its weight
    // and both moments, each covers its whole range, and reading it in another layout's
    // slices (three regions along the first dimension, as a DP3 resume of a flat tensor or
    // a TP3 split of rows would) gives the same bytes, hash for hash, as reading it whole.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let url = format!("file://{}", dir.join("store").display());
    runtime.block_on(async {
        use lazarus_shared::format::DimRange;
        use lazarus_shared::store::{OpenMode, Store, StoreOptions};
        let store = Store::open(&url, OpenMode::Existing, StoreOptions::default())
            .await
            .unwrap();
        let run = store.run(&"dp2-to-1".parse().unwrap());
        let key = run.resolve_step("5").await.unwrap();
        let checkpoint = run.open_checkpoint(key).await.unwrap();
        assert_eq!(checkpoint.manifests.len(), 2, "two ranks wrote step 5");
        let names: Vec<String> = checkpoint
            .tensors()
            .iter()
            .map(|t| t.name.clone())
            .collect();
        let weights: Vec<&String> = names.iter().filter(|n| !n.contains(".exp_avg")).collect();
        assert_eq!(names.len(), 3 * weights.len(), "{names:?}");
        for name in &names {
            let whole = checkpoint.read_tensor(name, &()).await.unwrap();
            let shape = checkpoint.tensor_info(name).unwrap().global_shape.clone();
            let rows = shape[0];
            let mut pieces = Vec::new();
            for part in 0..3u64 {
                let (start, end) = (rows * part / 3, rows * (part + 1) / 3);
                let mut region = vec![DimRange {
                    start,
                    len: end - start,
                }];
                region.extend(shape[1..].iter().map(|len| DimRange {
                    start: 0,
                    len: *len,
                }));
                pieces.extend(checkpoint.read_region(name, &region, &()).await.unwrap());
            }
            assert_eq!(
                blake3::hash(&pieces),
                blake3::hash(&whole),
                "{name}: regions differ from the whole"
            );
        }
    });

    // The optimizer state arrived complete: at step 10 every tensor (weights and both
    // moments) matches the uninterrupted run's closely.
    let read_all = |run: &str| {
        runtime.block_on(async {
            use lazarus_shared::store::{OpenMode, Store, StoreOptions};
            let store = Store::open(&url, OpenMode::Existing, StoreOptions::default())
                .await
                .unwrap();
            let run = store.run(&run.parse().unwrap());
            let checkpoint = run
                .open_checkpoint(run.latest().await.unwrap().unwrap())
                .await
                .unwrap();
            let mut tensors = Vec::new();
            for info in checkpoint.tensors() {
                let bytes = checkpoint.read_tensor(&info.name, &()).await.unwrap();
                tensors.push((info.name.clone(), bytes));
            }
            tensors.sort();
            tensors
        })
    };
    let reference = read_all("straight");
    assert!(reference.len() > 30);
    for other in [
        "dp2-to-1",
        "dp1-to-2",
        "tp2-dp2-ep2-to-1",
        "dp1-to-tp2",
        "tp2-pp2-to-1",
        "dp1-to-dp2-pp2",
        "tp2-dp2-ep2-to-pp2-ep2",
    ] {
        let tensors = read_all(other);
        assert_eq!(
            tensors.iter().map(|t| &t.0).collect::<Vec<_>>(),
            reference.iter().map(|t| &t.0).collect::<Vec<_>>()
        );
        for ((name, a), (_, b)) in reference.iter().zip(&tensors) {
            let floats = |b: &[u8]| -> Vec<f32> {
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            };
            let (a, b) = (floats(a), floats(b));
            let scale = a.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-30);
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= 1e-3 * scale,
                "{other}: {name} differs by {worst} (largest value {scale})"
            );
        }
    }
}

/// [`args`] with background checkpoints every other step, and `extra` settings.
fn background_args(dir: &Path, run: &str, steps: u64, extra: &[&str]) -> Vec<String> {
    let mut all = args(dir, run, steps, 2);
    for set in ["checkpoint.every=2", "checkpoint.background=true"]
        .iter()
        .chain(extra)
    {
        all.extend(["--set".to_string(), set.to_string()]);
    }
    all
}

/// Two ranks' `trainer train`, `[test_faults]` allowed: (success, stdout and stderr).
fn launch(args: &[String]) -> (bool, String) {
    let output = Command::new("mpiexec")
        .args(["-n", "2"])
        .arg(bin("trainer"))
        .args(args)
        .env("LAZARUS_ALLOW_TEST_FAULTS", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

/// A checkpoint written in the background that cannot be stored (its run's chunk folder is
/// a file) ends every rank with the error, and nothing is committed.
#[test]
fn a_background_checkpoint_that_cannot_be_stored_ends_every_rank_with_the_error() {
    let (_guard, dir) = prepared();
    let run_dir = dir.join("store").join("runs").join("unstorable");
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::write(run_dir.join("chunks"), b"not a folder").unwrap();
    let (ok, text) = launch(&background_args(&dir, "unstorable", 6, &[]));
    assert!(!ok, "{text}");
    // Training goes on while the write runs; the ranks learn of the failure together at the
    // first step after it, long before the run's last step.
    for rank in 0..2 {
        assert!(
            text.contains(&format!(
                "rank {rank} of 2: error: writing this rank's shard of step 2"
            )),
            "{text}"
        );
    }
    assert!(!text.contains("step      6"), "{text}");
    let ctl = store_ctl(&dir);
    let listed = ctl.json(&["list", "unstorable"]);
    assert!(!listed.to_string().contains("\"committed\""), "{listed}");
}

#[test]
fn a_background_checkpoint_one_rank_cannot_store_is_not_committed_and_a_rerun_resumes_before_it() {
    let (_guard, dir) = prepared();
    let wait = "checkpoint.busy=\"wait\"";
    let refused = [
        wait,
        "test_faults.save_fail_at_step=4",
        "test_faults.save_fail_rank=1",
    ];
    let (ok, text) = launch(&background_args(&dir, "refused", 8, &refused));
    assert!(!ok, "{text}");
    // Rank 1 names its own error; rank 0, whose shard of step 4 was stored, learns of rank
    // 1's in the same sum and leaves too, without committing the step.
    assert!(
        text.contains("rank 1 of 2: error: writing this rank's shard of step 4"),
        "{text}"
    );
    assert!(
        text.contains(
            "rank 0 of 2: error: 1 rank(s) could not write their shard of step 4; it is not committed"
        ),
        "{text}"
    );
    let ctl = store_ctl(&dir);
    assert_eq!(ctl.committed("refused"), [2], "{text}");
    assert!(
        text.contains("checkpoint: step 2 committed at step "),
        "{text}"
    );
    assert!(!text.contains("checkpoint: step 4 committed"), "{text}");
    let failed = losses(&dir, "refused");

    // Without the fault, the run goes on from step 2; rank 0's leftover shard of step 4 is
    // written again.
    let said = run(2, &background_args(&dir, "refused", 8, &[wait]));
    assert!(said.contains("resumed from step 2"), "{said}");
    assert_eq!(ctl.committed("refused"), [2, 4, 6, 8], "{said}");
    ctl.expect(0, &["verify", "refused", "--all", "--read-data"]);
    // The steps both launches trained have the same figures, bit for bit.
    let all = losses(&dir, "refused");
    let again = &all[failed.len()..];
    assert_eq!(again[0].0, 3, "{all:?}");
    let repeated = failed.len() - 2;
    assert!(repeated >= 2, "{failed:?}");
    assert_eq!(bits(&failed[2..]), bits(&again[..repeated]), "{all:?}");
}

#[test]
fn background_checkpoints_due_while_one_is_in_flight_are_skipped_and_the_rest_commit() {
    let (_guard, dir) = prepared();
    // Each write counts as in flight for 3 steps: the one of step 2 through step 4, so step
    // 4's checkpoint is skipped and step 2 is committed at step 5, a step with none due.
    let held = ["checkpoint.busy=\"skip\"", "test_faults.save_busy_steps=3"];
    let (ok, text) = launch(&background_args(&dir, "held", 10, &held));
    assert!(ok, "{text}");
    assert!(
        text.contains("checkpoints: every 2 steps to file://")
            && text.contains("written in the background (skip one due"),
        "{text}"
    );
    let ctl = store_ctl(&dir);
    let committed = ctl.committed("held");
    // A write slower than 3 steps is skipped over longer; where each lands depends on the
    // machine, what holds on any is this.
    println!("committed: {committed:?}");
    assert_eq!(committed.first(), Some(&2), "{text}");
    assert_eq!(committed.last(), Some(&10), "{text}");
    let in_loop = &committed[..committed.len() - 1];
    assert!(
        in_loop.windows(2).all(|pair| pair[1] - pair[0] >= 4),
        "{committed:?}: {text}"
    );
    let skipped = 5 - committed.len();
    assert!(skipped >= 2, "{committed:?}");
    assert!(
        text.contains(&format!(
            "in-process save: {skipped} checkpoints skipped while the one before was still being written"
        )),
        "{text}"
    );
    // The last one is written in the foreground and not counted among the 4 in the loop.
    assert!(text.contains("over 4 in-loop checkpoints"), "{text}");
    ctl.expect(0, &["verify", "held", "--all", "--read-data"]);

    // A write still in flight when the loop ends (step 9 has no checkpoint due) is committed
    // before the last checkpoint is written, not dropped: held for longer than the run, step
    // 2's is committed at the end.
    let held = [
        "checkpoint.busy=\"skip\"",
        "test_faults.save_busy_steps=100",
    ];
    let (ok, text) = launch(&background_args(&dir, "held-long", 9, &held));
    assert!(ok, "{text}");
    assert_eq!(ctl.committed("held-long"), [2, 9], "{text}");
    // Each commit is logged: step 2's at step 9, when the loop has ended; step 9's where it
    // is taken, in the foreground.
    assert!(
        text.contains("checkpoint: step 2 committed at step 9, "),
        "{text}"
    );
    assert!(text.contains("checkpoint: step 9 committed, "), "{text}");
    assert!(
        text.contains("in-process save: 3 checkpoints skipped"),
        "{text}"
    );
    ctl.expect(0, &["verify", "held-long", "--all", "--read-data"]);
}

#[test]
fn a_killed_rank_ends_the_job_quickly_and_a_relaunch_resumes() {
    use std::io::{BufRead, BufReader};
    use std::time::{Duration, Instant};
    let (_guard, dir) = prepared();
    let mut child = Command::new("mpiexec")
        .args(["-n", "2"])
        .arg(bin("trainer"))
        .args(args(&dir, "killed", 100_000, 2))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut ranks_line = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line.starts_with("ranks: ") {
            ranks_line = line.clone();
        }
        if line.starts_with("step      7") {
            break;
        }
    }
    // "ranks: rank 0 = pid P on H, rank 1 = pid Q on H"
    let pid_of_rank_1: u32 = ranks_line
        .split("rank 1 = pid ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no rank table in {ranks_line:?}"));
    let killed = Instant::now();
    assert!(Command::new("kill")
        .args(["-KILL", &pid_of_rank_1.to_string()])
        .status()
        .unwrap()
        .success());
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let status = child.wait().unwrap();
    let took = killed.elapsed();
    let said = rest.join("\n") + &stderr;
    println!("the job ended {took:?} after rank 1 (pid {pid_of_rank_1}) was killed: {status:?}");
    assert!(!status.success(), "{said}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    // Hydra names the first rank it saw go: the killed one, or (once in a full CI-like run)
    // rank 0, which its cleanup killed a moment later. Either maps to the rank table.
    let pids: Vec<u32> = [0, 1]
        .map(|rank| lazarus_tests::train::pid_in_rank_table(&ranks_line, rank))
        .to_vec();
    assert!(
        pids.iter().any(|pid| said.contains(&format!("PID {pid} "))),
        "the launcher names a dead process of the job ({pids:?}): {said}"
    );

    // Nothing committed is damaged, and a relaunch continues from the last commit.
    let ctl = store_ctl(&dir);
    ctl.expect(0, &["verify", "killed", "--all", "--read-data"]);
    let listed = ctl.json(&["list", "killed"]);
    let latest = listed["latest"]["step"]
        .as_u64()
        .unwrap_or_else(|| panic!("no committed step in {listed}"));
    assert!(latest >= 5, "{listed}");
    let said = run(2, &args(&dir, "killed", latest + 2, 2));
    assert!(
        said.contains(&format!("resumed from step {latest}")),
        "{said}"
    );
}

#[test]
fn the_resharding_runbook_moves_a_run_from_two_ranks_to_one() {
    let (_guard, dir) = prepared();
    run(2, &args(&dir, "moved", 5, 2));
    let runbook = Runbook::load("resharding.md");
    let env = vec![
        (
            "LAZARUS_STORE",
            format!("file://{}", dir.join("store").display()),
        ),
        ("LAZARUS_INDEX", dir.join("index").display().to_string()),
        ("RUN", "moved".to_string()),
        ("RANKS", "1".to_string()),
        ("TRAINER_ARGS", args(&dir, "moved", 10, 4).join(" ")),
    ];
    let checked = runbook.run("Check the step it will resume from", &env);
    assert!(checked.contains("OK"), "{checked}");
    let said = runbook.run("Restart on the new number of ranks", &env);
    assert!(said.contains("resumed from step 5"), "{said}");
    let verified = runbook.run("Verify it worked", &env);
    assert!(verified.contains("10"), "{verified}");
    let ctl = store_ctl(&dir);
    let listed = ctl.json(&["list", "moved"]);
    let last = listed["steps"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["step"]["step"], 10, "{listed}");
    assert_eq!(last["world_size"], 1, "{listed}");
}

/// A rank that fails ends the job with MPI_Abort; its error line must reach the operator
/// every time. (Hydra drops a rank's output in flight when it aborts: before the trainer
/// paused ahead of the abort, about one run in seven printed nothing at all.)
#[test]
fn the_error_of_a_rank_that_ends_the_job_always_reaches_the_launcher() {
    let (_guard, dir) = prepared();
    let missing = dir.join("no-such-ckptd.sock");
    for attempt in 0..20 {
        // Rank 0 is told to use a ckptd that is not there; rank 1 waits for it in MPI.
        let output = Command::new("mpiexec")
            .args(["-n", "1", "-env", "LAZARUS_CKPTD_SOCKET"])
            .arg(&missing)
            .arg(bin("trainer"))
            .args(args(&dir, "aborted", 5, 2))
            .args([":", "-n", "1"])
            .arg(bin("trainer"))
            .args(args(&dir, "aborted", 5, 2))
            .output()
            .expect("mpiexec runs");
        let said = String::from_utf8_lossy(&output.stdout).to_string()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "attempt {attempt}: {said}");
        assert!(
            said.contains("trainer: rank 0 of 2: error: cannot reach ckptd"),
            "attempt {attempt}: the failing rank's error was lost: {said:?}"
        );
    }
}

/// The activations a step holds for its backward passes, measured on the heap after each
/// forward pass, are what the layout's formula predicts (`tiny`, where the layers' share
/// outweighs the small buffers the formula leaves out): one process over 2 micro-batches, and
/// both stages of PP2 over 4 (the first stage holds two micro-batches in flight).
#[test]
fn the_activations_a_step_holds_are_the_predicted_ones() {
    let (_guard, dir) = prepared();
    let measured = |ranks: usize, id: &str, layout: &[&str]| -> Vec<(f64, f64)> {
        let args = TrainerArgs::new("tiny")
            .metrics(&dir.join("metrics"))
            .run(id)
            .steps(3)
            .sets([
                "train.micro_batch=4",
                "train.threads=1",
                "train.val_every=1000",
                "checkpoint.every=1000",
            ])
            .sets(layout.iter().copied())
            .store(&format!("file://{}", dir.join("store").display()))
            .data(&dir.join("data"))
            .build();
        let said = run(ranks, &args);
        let line = said
            .lines()
            .find(|l| l.starts_with("peak activations"))
            .unwrap_or_else(|| panic!("no activations line: {said}"));
        // "...: rank 0 92.7 MB (92.1), rank 1 ..."
        line.split("rank ")
            .skip(1)
            .map(|part| {
                let words: Vec<&str> = part.split_whitespace().collect();
                let held: f64 = words[1].parse().unwrap();
                let predicted: f64 = words[3]
                    .trim_matches(|c| c == '(' || c == ')' || c == ',')
                    .parse()
                    .unwrap();
                (held, predicted)
            })
            .collect()
    };
    let single = measured(1, "activations-1", &["parallel.micro_batches=2"]);
    let staged = measured(
        2,
        "activations-pp2",
        &["parallel.pp=2", "parallel.micro_batches=4"],
    );
    assert_eq!(single.len(), 1, "{single:?}");
    assert_eq!(staged.len(), 2, "{staged:?}");
    assert!(staged[0].1 != staged[1].1, "{staged:?}");
    for (held, predicted) in single.iter().chain(&staged) {
        assert!(
            (held - predicted).abs() <= 0.05 * predicted,
            "measured {held} MB, predicted {predicted} MB: {single:?} {staged:?}"
        );
    }
}
