//! `cargo xtask image`: the container image, built without any container
//! registry (none is reachable from an air-gapped build host).
//!
//! The Dockerfile stays the one description of the image. Its final stage
//! is read here and built another way:
//! - `FROM debian:<suite>-slim` plus its `apt-get install` becomes a root
//!   filesystem from Debian's mirror (mmdebstrap, minbase without
//!   recommends or documentation, as Debian's slim images are), imported
//!   into podman's local storage;
//! - `COPY --from=build …` takes the release binary built here (stripped,
//!   as the Dockerfile's build stage strips it);
//! - ENTRYPOINT, CMD, USER and the like are copied as they are written.
//!
//! The base root filesystem is cached under target/image/ with the text it
//! was made from (suite, packages, options); only the layer holding the
//! binary is built again while that text stays the same.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result, bail};

use crate::{background::Background, cargo, run_checked, toolchain, workspace_root};

/// The image this builds, in podman's local storage.
pub const IMAGE: &str = "localhost/socklb:dev";

/// Its base (the Debian root filesystem), tagged for `podman images`.
const BASE_IMAGE: &str = "localhost/socklb-base:dev";

/// Debian packages `cargo xtask image` uses, with a command that shows each
/// is there.
pub const IMAGE_PACKAGES: &[(&str, &str)] = &[
    ("mmdebstrap", "mmdebstrap"),
    ("podman", "podman"),
    // Debian's podman defaults to crun; runc is the runtime that works on
    // hybrid cgroup hosts (see tests/tests/container.rs).
    ("runc", "runc"),
    ("binutils", "strip"),
];

/// The PATH of Debian's images (docker.io/library/debian sets it in the
/// image config; a root filesystem imported by podman carries none).
const DEBIAN_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Debian's mirrors for the base: the suite, its updates and security.
fn mirrors(suite: &str) -> Vec<String> {
    vec![
        format!("deb http://deb.debian.org/debian {suite} main"),
        format!("deb http://deb.debian.org/debian {suite}-updates main"),
        format!("deb http://deb.debian.org/debian-security {suite}-security main"),
    ]
}

/// What the Dockerfile's final stage asks of the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeStage {
    /// Debian suite of the `FROM` image (`bookworm`).
    pub suite: String,
    /// The packages its `apt-get install` adds.
    pub packages: Vec<String>,
    /// Where `COPY --from=build` puts the binary.
    pub binary_path: String,
    /// ENTRYPOINT, CMD, USER, WORKDIR, ENV, LABEL, EXPOSE: as written.
    pub config: Vec<String>,
}

/// The Dockerfile's instructions: continuation lines joined, comments and
/// blank lines dropped.
fn instructions(dockerfile: &str) -> Vec<String> {
    let mut joined = Vec::new();
    let mut current = String::new();
    for line in dockerfile.lines() {
        let trimmed = line.trim();
        if current.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head.trim_end());
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                joined.push(std::mem::take(&mut current));
            }
        }
    }
    if !current.is_empty() {
        joined.push(current);
    }
    joined
}

/// Reads the final stage of the Dockerfile. Anything this build does not
/// know how to reproduce is an error, so the two cannot drift apart.
pub fn runtime_stage(dockerfile: &str) -> Result<RuntimeStage> {
    let all = instructions(dockerfile);
    let from = all
        .iter()
        .rposition(|line| line.starts_with("FROM "))
        .context("the Dockerfile has no FROM")?;
    let suite = debian_suite(&all[from])?;
    let mut stage = RuntimeStage {
        suite,
        packages: Vec::new(),
        binary_path: String::new(),
        config: Vec::new(),
    };
    for line in &all[from + 1..] {
        let (keyword, rest) = line.split_once(' ').unwrap_or((line, ""));
        match keyword {
            "RUN" => stage.packages.extend(apt_packages(rest)?),
            "COPY" => stage.binary_path = copied_binary(rest)?,
            "ENTRYPOINT" | "CMD" | "USER" | "WORKDIR" | "ENV" | "LABEL" | "EXPOSE" => {
                stage.config.push(line.clone())
            }
            other => bail!("xtask image does not know how to build `{other}` ({line})"),
        }
    }
    if stage.binary_path.is_empty() {
        bail!("the Dockerfile's final stage copies no binary from the build stage");
    }
    Ok(stage)
}

/// `FROM docker.io/library/debian:bookworm-slim` → `bookworm`.
fn debian_suite(from: &str) -> Result<String> {
    let image = from
        .split_whitespace()
        .nth(1)
        .context("FROM names no image")?;
    let (name, tag) = image
        .rsplit_once(':')
        .with_context(|| format!("{image}: no tag"))?;
    if !name.ends_with("/debian") && name != "debian" {
        bail!("{image}: xtask image builds Debian bases only");
    }
    let suite = tag.trim_end_matches("-slim");
    if suite.is_empty() || !suite.chars().all(|c| c.is_ascii_lowercase()) {
        bail!("{image}: the tag names no Debian suite");
    }
    Ok(suite.to_string())
}

/// The packages of `apt-get install` in a RUN line; the line may hold only
/// the steps of a package install (update, install, removal of the lists).
fn apt_packages(run: &str) -> Result<Vec<String>> {
    let mut packages = Vec::new();
    for step in run.split("&&").map(str::trim) {
        if let Some(arguments) = step.strip_prefix("apt-get install") {
            packages.extend(
                arguments
                    .split_whitespace()
                    .filter(|word| !word.starts_with('-'))
                    .map(str::to_string),
            );
        } else if step != "apt-get update" && step != "rm -rf /var/lib/apt/lists/*" {
            bail!("xtask image does not know how to build `RUN {step}`");
        }
    }
    Ok(packages)
}

/// The destination of `COPY --from=build SOURCE DEST`.
fn copied_binary(copy: &str) -> Result<String> {
    let words: Vec<&str> = copy.split_whitespace().collect();
    match words.as_slice() {
        ["--from=build", source, dest] if source.ends_with("/socklb") => Ok(dest.to_string()),
        _ => bail!("xtask image does not know how to build `COPY {copy}`"),
    }
}

/// mmdebstrap's arguments for the base of `stage`, into `output`: also the
/// cache key (the same arguments give the same base).
fn mmdebstrap_args(stage: &RuntimeStage, output: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "--variant=minbase",
        // A merged /usr without the usrmerge package (and the perl it pulls).
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        "--aptopt=APT::Install-Recommends \"false\"",
        "--aptopt=Acquire::Languages \"none\"",
        // What Debian's slim images leave out.
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/info/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
    ]
    .map(String::from)
    .to_vec();
    args.push(format!("--include={}", stage.packages.join(",")));
    args.push(stage.suite.clone());
    args.push(output.display().to_string());
    args.extend(mirrors(&stage.suite));
    args
}

/// Builds `localhost/socklb:dev` and target/image/socklb-dev.oci.tar.
/// Returns the image name.
pub fn build() -> Result<String> {
    if !crate::is_root() {
        bail!("cargo xtask image runs mmdebstrap and podman as root: run it as root");
    }
    toolchain::install_debian_packages(IMAGE_PACKAGES)?;
    let started = Instant::now();
    let root = workspace_root();
    let dir = root.join("target/image");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).context("the Dockerfile")?;
    let stage = runtime_stage(&dockerfile)?;
    // The base comes from Debian's mirror while the binary compiles.
    let (tar, binary) = std::thread::scope(|scope| {
        let base = scope.spawn(|| base_tar(&stage, &dir));
        let binary = release_binary();
        (base.join().expect("the base's thread"), binary)
    });
    let base = import_base(&tar?, &dir)?;
    let binary = binary?;
    let context = dir.join("context");
    write_context(&stage, &base, &binary, &context)?;
    println!("xtask: building {IMAGE} (the binary's layer on the cached base)");
    let previous = podman_output(&["image", "inspect", "--format", "{{.Id}}", IMAGE]).ok();
    run_checked(
        Command::new("podman")
            .args(["build", "--pull=never", "--tag", IMAGE, "--file"])
            .arg(context.join("Containerfile"))
            .arg(&context),
    )?;
    let current = podman_output(&["image", "inspect", "--format", "{{.Id}}", IMAGE])?;
    if let Some(previous) = previous.filter(|previous| previous.trim() != current.trim()) {
        // The image this replaced, now untagged; kept if a container uses it.
        let _ = Command::new("podman")
            .args(["rmi", previous.trim()])
            .output();
    }
    let archive = dir.join("socklb-dev.oci.tar");
    save_archive(&archive)?;
    println!(
        "xtask: {IMAGE}: {} MB in podman's storage, archive {} ({} MB), built in {:.0} s",
        image_size(IMAGE)? / 1_000_000,
        archive.display(),
        std::fs::metadata(&archive)?.len() / 1_000_000,
        started.elapsed().as_secs_f64()
    );
    Ok(IMAGE.to_string())
}

/// The base's root filesystem as a tar, cached under `dir` with the
/// mmdebstrap arguments it was made with; made again when the Dockerfile's
/// suite or packages change.
fn base_tar(stage: &RuntimeStage, dir: &Path) -> Result<PathBuf> {
    let tar = dir.join("base.tar");
    let key_file = dir.join("base.key");
    let key = mmdebstrap_args(stage, &tar).join("\n");
    if tar.exists() && std::fs::read_to_string(&key_file).ok().as_ref() == Some(&key) {
        return Ok(tar);
    }
    println!(
        "xtask: building the image's base from Debian {} with {} (mmdebstrap)",
        stage.suite,
        stage.packages.join(" ")
    );
    let _ = std::fs::remove_file(dir.join("base.id"));
    let partial = dir.join("base.tar.partial");
    let mut args = mmdebstrap_args(stage, &partial);
    // mmdebstrap picks the format from the name: a tar.
    args.insert(0, "--format=tar".into());
    run_checked(Command::new("mmdebstrap").args(&args))
        .context("mmdebstrap could not build the base (is deb.debian.org reachable?)")?;
    std::fs::rename(&partial, &tar)?;
    std::fs::write(&key_file, &key)?;
    Ok(tar)
}

/// The base image in podman's storage, imported from `tar` unless the
/// image of the last import is still there. Returns its image ID.
fn import_base(tar: &Path, dir: &Path) -> Result<String> {
    let id_file = dir.join("base.id");
    if let Ok(id) = std::fs::read_to_string(&id_file)
        && podman_succeeds(&["image", "exists", id.trim()])
    {
        return Ok(id.trim().to_string());
    }
    println!("xtask: importing the base into podman's storage");
    let output = Command::new("podman")
        .arg("import")
        .args(["--change", &format!("ENV PATH={DEBIAN_PATH}")])
        .arg(tar)
        .arg(BASE_IMAGE)
        .output()
        .context("podman import")?;
    if !output.status.success() {
        bail!(
            "podman import {}: {}",
            tar.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let id = String::from_utf8_lossy(&output.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .trim_start_matches("sha256:")
        .to_string();
    std::fs::write(&id_file, &id)?;
    Ok(id)
}

/// `cargo build` arguments of the release socklb the image ships.
const RELEASE_BUILD: [&str; 7] = [
    "build",
    "--release",
    "--locked",
    "--package",
    "lb-userspace",
    "--bin",
    "socklb",
];

/// The release socklb, built with the eBPF toolchain in place.
fn release_binary() -> Result<PathBuf> {
    toolchain::ensure_ebpf_toolchain()?;
    println!("xtask: building the release socklb");
    run_checked(cargo().args(RELEASE_BUILD))?;
    Ok(workspace_root().join("target/release/socklb"))
}

/// Starts the image's release build in the background, in the idle
/// scheduling class and one job: while `cargo xtask test` runs its
/// suites, which mostly wait on timers, the build takes the CPU they leave,
/// and `test-deploy` then finds the binary built (a clean-clone run:
/// test-deploy 62 s instead of 394 s; the build itself took 20 minutes at
/// that priority, beside the suites). Its output goes to
/// target/release-build.log.
pub fn start_release_build() -> Result<Background> {
    toolchain::ensure_ebpf_toolchain()?;
    let mut command = cargo();
    command.args(RELEASE_BUILD).args(["--jobs", "1"]);
    Background::start(
        "the release build of socklb",
        command,
        workspace_root().join("target/release-build.log"),
    )
}

/// The build context: the stripped binary, and a Containerfile that is the
/// Dockerfile's final stage on the local base.
fn write_context(stage: &RuntimeStage, base: &str, binary: &Path, context: &Path) -> Result<()> {
    std::fs::create_dir_all(context)?;
    let copy = context.join("socklb");
    std::fs::copy(binary, &copy).with_context(|| format!("copying {}", binary.display()))?;
    run_checked(Command::new("strip").arg(&copy))?;
    let mut containerfile = format!(
        "# Written by `cargo xtask image` from the Dockerfile's final stage.\nFROM {base}\nCOPY socklb {}\n",
        stage.binary_path
    );
    for line in &stage.config {
        containerfile.push_str(line);
        containerfile.push('\n');
    }
    std::fs::write(context.join("Containerfile"), containerfile)?;
    Ok(())
}

/// Writes the image as an OCI archive, unless the archive already holds
/// this very image.
fn save_archive(archive: &Path) -> Result<()> {
    let id = podman_output(&["image", "inspect", "--format", "{{.Id}}", IMAGE])?;
    let id_file = archive.with_extension("id");
    if archive.exists() && std::fs::read_to_string(&id_file).ok().as_deref() == Some(id.trim()) {
        return Ok(());
    }
    let _ = std::fs::remove_file(archive);
    run_checked(
        Command::new("podman")
            .args(["save", "--format", "oci-archive", "--output"])
            .arg(archive)
            .arg(IMAGE),
    )?;
    std::fs::write(id_file, id.trim())?;
    Ok(())
}

/// The image's size as podman counts it (all its layers, uncompressed).
fn image_size(image: &str) -> Result<u64> {
    let size = podman_output(&["image", "inspect", "--format", "{{.Size}}", image])?;
    size.trim()
        .parse()
        .with_context(|| format!("podman's size of {image}: {size}"))
}

fn podman_output(args: &[&str]) -> Result<String> {
    let output = Command::new("podman")
        .args(args)
        .output()
        .with_context(|| format!("podman {}", args.join(" ")))?;
    if !output.status.success() {
        bail!(
            "podman {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn podman_succeeds(args: &[&str]) -> bool {
    Command::new("podman")
        .args(args)
        .output()
        .is_ok_and(|output| output.status.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_final_stage_of_the_dockerfile_is_read() {
        let dockerfile = std::fs::read_to_string(workspace_root().join("Dockerfile")).unwrap();
        let stage = runtime_stage(&dockerfile).unwrap();
        assert_eq!(stage.suite, "bookworm");
        assert_eq!(stage.packages, ["bpftool", "ca-certificates"]);
        assert_eq!(stage.binary_path, "/usr/local/bin/socklb");
        assert_eq!(
            stage.config,
            [
                "ENTRYPOINT [\"/usr/local/bin/socklb\"]",
                "CMD [\"run\", \"--config\", \"/etc/socklb/socklb.toml\"]"
            ]
        );
    }

    #[test]
    fn a_step_it_cannot_reproduce_is_refused() {
        for (dockerfile, refused) in [
            (
                "FROM debian:bookworm-slim\nRUN apt-get update && curl -o x y\n",
                "RUN curl",
            ),
            ("FROM debian:bookworm-slim\nADD x /x\n", "ADD"),
            ("FROM alpine:3\nCOPY --from=build /s/socklb /x\n", "Debian"),
            (
                "FROM debian:bookworm-slim\nCOPY config /etc/socklb/\n",
                "COPY config",
            ),
        ] {
            let error = runtime_stage(dockerfile).unwrap_err().to_string();
            assert!(error.contains(refused), "{dockerfile}: {error}");
        }
    }
}
