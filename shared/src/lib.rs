//! What every Lazarus program agrees on: the on-storage checkpoint format (chunk codec,
//! manifests, commit and rollback records), the identifiers that name objects, and the store
//! library that writes and reads checkpoints through `object_store`.
//!
//! The trainer, `ckptd` and `ckptctl` never build object keys or parse stored bytes
//! themselves; they go through [`store`].

pub mod busy_word;
pub mod codec;
pub mod error;
pub mod format;
pub mod hash;
pub mod hf_olmoe;
pub mod ids;
pub mod page_buf;
pub mod progress;
pub mod safetensors_io;
pub mod store;
pub mod wire;

pub use error::StoreError;
pub use hash::ChunkHash;
pub use ids::{Rank, RunId, StepKey};
