//! The node-side programs: `ckptctl`, the operator CLI over the checkpoint store, and (in a
//! later issue) `ckptd`, the per-node checkpoint daemon. The binaries in `src/bin` are thin;
//! everything they do lives here so tests can call it.

pub mod ctl;
