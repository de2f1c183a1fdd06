//! `cargo xtask test-deploy`: what ships, run the way it ships. The image
//! (`cargo xtask image`) under podman with the DaemonSet's container spec
//! (tests/tests/container.rs), and the systemd unit under systemd booted
//! in a systemd-nspawn container (tests/tests/systemd.rs).
//!
//! Those two test files are `test = false` in tests/Cargo.toml, so that
//! `cargo xtask test` (which builds no image) leaves them to this verb.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result, bail};

use crate::{cargo, image, is_leftover, run_checked, toolchain, workspace_root};

/// Debian packages the deploy tests use besides the image's, with a
/// command that shows each is there.
const DEPLOY_PACKAGES: &[(&str, &str)] = &[
    // systemd-nspawn boots the Debian root with systemd as PID 1.
    ("systemd-container", "systemd-nspawn"),
    // journalctl reads the container's journal from the host.
    ("systemd", "journalctl"),
    // nsenter and unshare: the tests' own mount namespaces.
    ("util-linux", "nsenter"),
];

/// The Debian root the systemd test boots: minbase with systemd as init,
/// and procps for the unit's `ExecReload=/bin/kill` (every Debian install
/// but minbase has it).
const SYSTEMD_ROOT_PACKAGES: &str = "systemd,systemd-sysv,dbus,procps";

/// The integration tests this verb runs.
const DEPLOY_TESTS: [&str; 2] = ["container", "systemd"];

pub fn test(cargo_args: &[String]) -> Result<()> {
    if !crate::is_root() {
        bail!("cargo xtask test-deploy runs podman and systemd-nspawn: run it as root");
    }
    let started = Instant::now();
    toolchain::install_debian_packages(image::IMAGE_PACKAGES)?;
    toolchain::install_debian_packages(DEPLOY_PACKAGES)?;
    let python = toolchain::ensure_python_env()?;
    // The systemd root comes from Debian's mirror while the image builds.
    let (image, systemd_root) = std::thread::scope(|scope| {
        let root = scope.spawn(systemd_root);
        let image = image::build();
        (image, root.join().expect("the systemd root's thread"))
    });
    let (image, systemd_root) = (image?, systemd_root?);
    let artefacts_done = started.elapsed();
    crate::build_all()?;
    crate::sweep_leftovers();
    sweep_podman_leftovers();
    let target = workspace_root().join("target");
    let figures = target.join("deploy-figures.txt");
    let _ = std::fs::remove_file(&figures);
    let test_args = crate::one_test_at_a_time(cargo_args);
    println!(
        "xtask: running the deploy tests ({})",
        DEPLOY_TESTS.join(", ")
    );
    let tests_started = Instant::now();
    let mut command = cargo();
    command.args(["test", "--package", "socklb-tests"]);
    for name in DEPLOY_TESTS {
        command.args(["--test", name]);
    }
    run_checked(
        command
            .args(&test_args)
            .env("SOCKLB_BIN", target.join("debug/socklb"))
            .env("LBCLIENT_BIN", target.join("debug/lbclient"))
            .env("SOCKLB_RELEASE_BIN", target.join("release/socklb"))
            .env("SOCKLB_PYTHON", &python)
            .env("SOCKLB_IMAGE", &image)
            .env("SOCKLB_IMAGE_CONTEXT", target.join("image/context"))
            .env("SOCKLB_SYSTEMD_ROOT", &systemd_root)
            .env("SOCKLB_FIGURES", &figures),
    )?;
    if let Ok(text) = std::fs::read_to_string(&figures) {
        println!("xtask: deploy figures\n{text}");
    }
    println!(
        "xtask: test-deploy took {:.0} s: the image and the systemd root {:.0} s, the tests (with their build) {:.0} s",
        started.elapsed().as_secs_f64(),
        artefacts_done.as_secs_f64(),
        tests_started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The Debian root with systemd, as a tar under target/nspawn/ (built by
/// mmdebstrap once for its package list; each test extracts a fresh copy).
fn systemd_root() -> Result<PathBuf> {
    let dir = workspace_root().join("target/nspawn");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let tar = dir.join("root.tar");
    let key_file = dir.join("root.key");
    let args = systemd_root_args(&tar);
    let key = args.join("\n");
    if tar.exists() && std::fs::read_to_string(&key_file).ok().as_ref() == Some(&key) {
        return Ok(tar);
    }
    println!("xtask: building the Debian root with systemd for the unit's test (mmdebstrap)");
    let partial = dir.join("root.tar.partial");
    let mut build = systemd_root_args(&partial);
    build.insert(0, "--format=tar".into());
    run_checked(Command::new("mmdebstrap").args(&build))
        .context("mmdebstrap could not build the systemd root (is deb.debian.org reachable?)")?;
    std::fs::rename(&partial, &tar)?;
    std::fs::write(&key_file, key)?;
    Ok(tar)
}

fn systemd_root_args(output: &Path) -> Vec<String> {
    vec![
        "--variant=minbase".into(),
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr".into(),
        "--aptopt=APT::Install-Recommends \"false\"".into(),
        format!("--include={SYSTEMD_ROOT_PACKAGES}"),
        "bookworm".into(),
        output.display().to_string(),
        "deb http://deb.debian.org/debian bookworm main".into(),
        "deb http://deb.debian.org/debian-security bookworm-security main".into(),
    ]
}

/// Removes the containers and images that a killed deploy test left:
/// their names are the tests' `unique_name`s, and only those of a test
/// process that is gone are touched.
fn sweep_podman_leftovers() {
    let list = |args: &[&str]| -> Vec<String> {
        Command::new("podman")
            .args(args)
            .output()
            .map(|output| {
                String::from_utf8_lossy(&output.stdout)
                    .lines()
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    for name in list(&["ps", "--all", "--format", "{{.Names}}"]) {
        if is_leftover(&name) {
            println!("xtask: removing leftover container {name}");
            let _ = Command::new("podman")
                .args(["rm", "--force", "--time", "0", &name])
                .output();
        }
    }
    for image in list(&["images", "--format", "{{.Repository}}:{{.Tag}}"]) {
        let repository = image.trim_start_matches("localhost/");
        let name = repository.split(':').next().unwrap_or_default();
        if is_leftover(name) {
            println!("xtask: removing leftover image {image}");
            let _ = Command::new("podman")
                .args(["rmi", "--force", &image])
                .output();
        }
    }
    // nspawn's cgroups in the named v1 hierarchy of a hybrid host.
    if let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup/systemd") {
        for entry in entries.flatten() {
            if is_leftover(&entry.file_name().to_string_lossy()) {
                let _ = crate::remove_cgroup_tree(&entry.path());
            }
        }
    }
}
