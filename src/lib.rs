//! deepep-nccl: DeepEP's `Buffer` (MoE expert-parallel dispatch/combine) with
//! kernels on NCCL's Device API. The C ABI in [`capi`] is the one door in;
//! Python (`compat/python`) and C++ (`include/deepep_nccl.hpp`) sit on it.
pub mod buffer;
pub mod capi;
pub mod config;
pub mod cuda;
mod env;
pub mod error;
mod faults;
mod handles;
pub mod internode;
pub mod kernels;
pub mod layout;
mod log;
pub mod ll;
pub mod nccl;
pub mod normal;
pub mod outputs;
pub mod tensor;

pub use buffer::{Buffer, BufferArgs};
pub use error::{DeepepStatus, Error, Result};
