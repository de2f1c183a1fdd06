//! socklb: a node-local load balancer for control-plane endpoints that
//! redirects `connect()` to a VIP inside the kernel.
//!
//! The library holds everything; the `socklb` binary is a thin CLI over it.

pub mod cgroup;
pub mod clock;
pub mod config;
pub mod convert;
pub mod daemon;
pub mod dataplane;
pub mod discovery;
pub mod errors;
pub mod hand_back;
pub mod health;
pub mod planner;
pub mod privileges;
pub mod protocol;
pub mod sockets;
pub mod status;
pub mod trust;
