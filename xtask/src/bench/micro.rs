//! The criterion microbenchmarks of lb-userspace (benches/planner.rs), run
//! with a short measurement time and read back from criterion's JSON.

use std::{
    path::{Path, PathBuf},
    time::SystemTime,
};

use anyhow::{Context, Result};
use serde_json::Value;

use crate::{cargo, run_checked};

const BENCH_ARGS: [&str; 5] = ["bench", "--package", "lb-userspace", "--bench", "planner"];

/// Criterion's own settings, shortened so that the whole set takes well
/// under a minute.
const CRITERION_ARGS: [&str; 5] = [
    "--warm-up-time",
    "0.5",
    "--measurement-time",
    "1",
    "--noplot",
];

/// One microbenchmark: median time per iteration and criterion's 95%
/// confidence interval of it.
#[derive(Debug, Clone)]
pub struct MicroFigure {
    pub id: String,
    pub median_ns: f64,
    pub lower_ns: f64,
    pub upper_ns: f64,
}

/// Runs the benchmark and returns the figures it wrote in this run.
pub fn run(target_dir: &Path) -> Result<Vec<MicroFigure>> {
    let started = SystemTime::now();
    println!("bench: criterion microbenchmarks (short: 0.5 s warm-up, 1 s measurement each)");
    run_checked(cargo().args(BENCH_ARGS).arg("--").args(CRITERION_ARGS))?;
    let mut figures = Vec::new();
    for estimates in files_named(&target_dir.join("criterion"), "estimates.json") {
        if !estimates.parent().is_some_and(|dir| dir.ends_with("new")) {
            continue;
        }
        let fresh = std::fs::metadata(&estimates)
            .and_then(|meta| meta.modified())
            .is_ok_and(|modified| modified >= started);
        if !fresh {
            continue;
        }
        let benchmark = estimates.with_file_name("benchmark.json");
        let id = read_json(&benchmark)?["full_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let median = &read_json(&estimates)?["median"];
        let number = |value: &Value| value.as_f64().unwrap_or(f64::NAN);
        figures.push(MicroFigure {
            id,
            median_ns: number(&median["point_estimate"]),
            lower_ns: number(&median["confidence_interval"]["lower_bound"]),
            upper_ns: number(&median["confidence_interval"]["upper_bound"]),
        });
    }
    // By benchmark, then by size as a number (3, 100, 10000).
    figures.sort_by_key(|figure| {
        let (name, size) = figure.id.rsplit_once('/').unwrap_or((&figure.id, ""));
        (name.to_string(), size.parse::<u64>().unwrap_or(u64::MAX))
    });
    Ok(figures)
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Files called `name` under `dir`, at most a few levels down.
fn files_named(dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![(dir.to_path_buf(), 0)];
    while let Some((dir, depth)) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            if path.is_dir() && depth < 6 {
                pending.push((path, depth + 1));
            } else if path.file_name().is_some_and(|file| file == name) {
                found.push(path);
            }
        }
    }
    found
}
