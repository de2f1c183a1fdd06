//! A memory cgroup (v1) of a test's own: this machine's cgroups are
//! hybrid, and the memory controller is on v1.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use crate::unique_name;

/// A cgroup of the v1 memory controller with a limit (and the same limit
/// on memory and swap where swap is counted), removed on drop: declare it
/// before the processes put in it, so that they are gone first.
pub struct MemoryCgroup {
    pub path: PathBuf,
}

impl MemoryCgroup {
    const ROOT: &str = "/sys/fs/cgroup/memory";

    pub fn new(label: &str, limit: u64) -> Self {
        assert!(
            Path::new(Self::ROOT).join("cgroup.procs").exists(),
            "this test needs the cgroup v1 memory controller at {}",
            Self::ROOT
        );
        let path = Path::new(Self::ROOT).join(unique_name(label));
        std::fs::create_dir(&path).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
        let group = Self { path };
        group.write("memory.limit_in_bytes", &limit.to_string());
        // Without swap counted in, the limit could spill to swap.
        let memsw = group.path.join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            group.write("memory.memsw.limit_in_bytes", &limit.to_string());
        }
        group
    }

    pub fn write(&self, file: &str, value: &str) {
        let path = self.path.join(file);
        std::fs::write(&path, value).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    }

    /// A number file of the group, such as `memory.usage_in_bytes`.
    pub fn read_u64(&self, file: &str) -> u64 {
        let path = self.path.join(file);
        std::fs::read_to_string(&path)
            .unwrap_or_else(|error| panic!("{}: {error}", path.display()))
            .trim()
            .parse()
            .expect("a number")
    }

    /// A command prefix that runs the rest of its arguments in this group.
    pub fn launcher(&self) -> Vec<String> {
        let procs = self.path.join("cgroup.procs");
        vec![
            "sh".into(),
            "-c".into(),
            format!("echo $$ > {} && exec \"$@\"", procs.display()),
            "sh".into(),
        ]
    }

    /// OOM kills in this group so far.
    pub fn oom_kills(&self) -> u64 {
        let path = self.path.join("memory.oom_control");
        let text = std::fs::read_to_string(&path).expect("memory.oom_control");
        text.lines()
            .find_map(|line| line.strip_prefix("oom_kill "))
            .and_then(|count| count.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // The daemon was killed before; its exit may take a moment to
        // leave the group.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("could not remove {}", self.path.display());
    }
}
