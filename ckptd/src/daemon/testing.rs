//! What the daemon's unit tests build on: a validated config and an empty store.

use std::path::Path;

use clap::Parser;
use lazarus_shared::store::{OpenMode, Store, StoreOptions};

use super::{Cli, Config};

/// A validated config of node `node` in run `r1`, listening on `listen` and led from
/// 127.0.0.1:7001, with its shm directory and socket under `dir` and `flags` added. Its store
/// and key file are never opened: tests pass a store of their own.
pub fn config(dir: &Path, node: &str, listen: &str, flags: &[&str]) -> Config {
    let shm = dir.join("shm");
    let socket = dir.join(format!("{node}.sock"));
    let base = [
        "ckptd",
        "--node",
        node,
        "--run",
        "r1",
        "--store",
        "file:///unused",
        "--shm-dir",
        shm.to_str().expect("a UTF-8 test path"),
        "--socket",
        socket.to_str().expect("a UTF-8 test path"),
        "--listen",
        listen,
        "--leader",
        "127.0.0.1:7001",
        "--key-file",
        "/unused",
    ];
    Config::resolve(&Cli::parse_from(base.iter().chain(flags))).expect("a valid test config")
}

/// An empty store in memory.
pub async fn memory_store() -> Store {
    Store::open(
        "memory://",
        OpenMode::CreateIfMissing,
        StoreOptions::default(),
    )
    .await
    .expect("a memory store opens")
}
