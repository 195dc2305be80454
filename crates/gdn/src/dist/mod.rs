//! Several ranks: the [`Communicator`] (collectives over host or device buffers) with an
//! in-process implementation ([`inproc`]: N ranks as threads of one process, so every parallel
//! path runs in CI on the CPU) and an NCCL one ([`nccl`]: one process per GPU, ranks from
//! torchrun's environment, the NCCL unique id shared over a TCP rendezvous), and context
//! parallelism's permutations ([`cp`]; the CP layer itself is `layer::CpLayer`).
//!
//! Every reduction is in a fixed order: [`Communicator::all_reduce_sum`] gathers every rank's
//! buffer and adds them in rank order 0, 1, ..., N-1 on every rank, so the result is the same bits
//! on every rank and from run to run (no ring whose order depends on the rank).

pub mod comm;
pub mod cp;
pub mod env;
pub mod grid;
pub mod inproc;
pub mod nccl;
pub mod rendezvous;

pub use comm::{all_reduce_sum_f32, all_reduce_sum_host, Communicator};
pub use env::DistEnv;
pub use grid::{check_layout, Grid};
pub use inproc::{run_grid, run_ranks, InProc};
pub use nccl::Nccl;
