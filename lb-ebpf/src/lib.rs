//! The eBPF programs are the `lb-ebpf` binary (src/main.rs). This empty
//! library lets lb-userspace name the crate as a build dependency, so that
//! cargo rebuilds the object when it changes.
#![no_std]
