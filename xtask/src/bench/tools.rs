//! The outside programs the benchmark drives: installing them and asking
//! their versions.

use std::{path::Path, process::Command};

use anyhow::Result;

use crate::toolchain;

/// nginx's stream module; Debian ships it as a dynamic module.
pub const NGINX_STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

/// Debian packages the benchmark uses, with a command that shows each is there.
const BENCH_PACKAGES: &[(&str, &str)] = &[
    ("nginx", "nginx"),
    ("haproxy", "haproxy"),
    ("wrk", "wrk"),
    ("sockperf", "sockperf"),
    ("iperf3", "iperf3"),
    ("bpftool", "bpftool"),
];

/// Installs the tools that are missing (apt-get update first).
pub fn install() -> Result<()> {
    let mut packages = BENCH_PACKAGES.to_vec();
    if !Path::new(NGINX_STREAM_MODULE).exists() {
        // A module is no command; a name no shell finds makes the helper
        // install the package exactly when the module file is missing.
        packages.push(("libnginx-mod-stream", "ngx-stream-module-is-missing"));
    }
    toolchain::install_debian_packages(&packages)
}

/// The first line a command prints about its version, or why there is none.
pub fn version_of(program: &str, args: &[&str]) -> String {
    match Command::new(program).args(args).output() {
        Ok(output) => {
            let text = format!(
                "{}\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            text.lines()
                .map(str::trim)
                .find(|line| !line.is_empty())
                .unwrap_or("(no version printed)")
                .to_string()
        }
        Err(error) => format!("(not runnable: {error})"),
    }
}

/// (tool, version line) of every program the benchmark runs.
pub fn versions() -> Vec<(String, String)> {
    [
        ("wrk", &["-v"][..]),
        ("haproxy", &["-v"]),
        ("nginx", &["-v"]),
        ("sockperf", &["--version"]),
        ("iperf3", &["--version"]),
        ("bpftool", &["version"]),
        ("rustc", &["--version"]),
    ]
    .iter()
    .map(|(program, args)| (program.to_string(), version_of(program, args)))
    .collect()
}

/// (what, value) describing this machine.
pub fn machine() -> Vec<(String, String)> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name")?.split_once(':'))
        .map_or("unknown".to_string(), |(_, model)| model.trim().to_string());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|value| value.split_whitespace().next()?.parse::<f64>().ok())
        .map_or("unknown".to_string(), |kib| {
            format!("{:.1} GiB", kib / 1024.0 / 1024.0)
        });
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let command_line = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .output()
            .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_string())
            .unwrap_or_default()
    };
    vec![
        ("CPUs (nproc)".into(), cpus.to_string()),
        ("CPU model".into(), cpu_model),
        ("Memory".into(), memory),
        ("Kernel".into(), command_line("uname", &["-r"])),
        (
            "OS".into(),
            std::fs::read_to_string("/etc/os-release")
                .unwrap_or_default()
                .lines()
                .find_map(|line| line.strip_prefix("PRETTY_NAME="))
                .unwrap_or("unknown")
                .trim_matches('"')
                .to_string(),
        ),
        (
            "Date".into(),
            command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        ),
    ]
}
