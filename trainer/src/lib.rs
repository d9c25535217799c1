//! The trainer: data preparation, configuration and OLMoE-style MoE pretraining, single-process
//! or over MPI, with checkpoints through the store library. `main.rs` is thin; everything lives here so
//! tests can call it.

pub mod attention;
pub mod cli;
pub mod config;
mod custom_op;
pub mod data;
pub mod dist;
pub mod embedding;
pub mod expert_parallel;
pub mod experts;
pub mod handed;
pub mod health;
pub mod kernels;
pub mod layout;
pub mod loss;
pub mod memory;
pub mod model;
pub mod norm;
pub mod optim;
pub mod pipeline;
pub mod sdc;
pub mod snapshot;
pub mod steplog;
pub mod tensor_parallel;
pub mod trace;
pub mod train;
