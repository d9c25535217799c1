//! The node-side programs: `ckptd`, the per-node checkpoint daemon, and `ckptctl`, the
//! operator CLI over the checkpoint store and the running job. The binaries in `src/bin` are
//! thin; everything they do lives here so tests can call it.

pub mod ctl;
pub mod daemon;
pub mod logging;
