//! The links that attach socklb's programs to a cgroup: adopted or made at
//! start, then checked against the kernel every pass and repaired.
//!
//! The daemon holds a descriptor of every link, so a link whose pin was
//! removed stays attached and is simply pinned again. A link that was
//! detached (`bpftool link detach`) or went defunct (its cgroup was removed)
//! is replaced by a new one. A cgroup removed and created again at the same
//! path (systemd does this on a service restart) gets new links.

use std::{
    collections::BTreeMap,
    fmt,
    fs::File,
    os::{
        fd::{AsFd, OwnedFd},
        unix::fs::MetadataExt,
    },
    path::{Path, PathBuf},
};

use aya::{Ebpf, programs::ProgramInfo};
use aya_obj::generated::bpf_attach_type;
use lb_common::{names, repair};

use super::{KernelError, PinPaths, object, sys};

/// What the kernel says of the program with this id (aya's
/// `loaded_programs`, which needs CAP_SYS_ADMIN to open programs by id).
pub fn program_by_id(id: u32) -> Option<ProgramInfo> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|program| program.id() == id)
}

/// The kernel hook of each program.
pub fn attach_type(program: &str) -> bpf_attach_type {
    match program {
        names::CONNECT4 => bpf_attach_type::BPF_CGROUP_INET4_CONNECT,
        names::CONNECT6 => bpf_attach_type::BPF_CGROUP_INET6_CONNECT,
        names::GETPEERNAME4 => bpf_attach_type::BPF_CGROUP_INET4_GETPEERNAME,
        names::GETPEERNAME6 => bpf_attach_type::BPF_CGROUP_INET6_GETPEERNAME,
        names::RELEASE => bpf_attach_type::BPF_CGROUP_INET_SOCK_RELEASE,
        _ => bpf_attach_type::BPF_CGROUP_SOCK_OPS,
    }
}

/// The cgroup socklb attaches to: its path and the id it had when the links
/// were made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupTarget {
    pub path: PathBuf,
    pub id: u64,
}

impl CgroupTarget {
    /// The id of the cgroup at `path` now, if one is there.
    pub fn current_id(path: &Path) -> Option<u64> {
        std::fs::metadata(path).ok().map(|metadata| metadata.ino())
    }
}

/// A difference between the links and what socklb attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkProblem {
    /// Nothing is at the cgroup's path: nothing to attach to until a cgroup
    /// appears there again.
    CgroupGone,
    /// A new cgroup was made at the path; the links attach to the old one.
    CgroupRecreated { new_id: u64 },
    /// The link no longer attaches anywhere (detached, or defunct).
    Detached { program: &'static str },
    /// The link attaches to another cgroup than socklb's.
    AttachedElsewhere {
        program: &'static str,
        cgroup_id: u64,
    },
    /// The cgroup's list of programs for the hook lacks ours.
    NotListed { program: &'static str },
    /// The link's pin is gone; the link itself lives on in the daemon.
    PinMissing { program: &'static str },
    /// Something else is pinned where the link belongs.
    PinReplaced { program: &'static str },
}

impl LinkProblem {
    /// The `repair::*` kind a fix of this problem is counted under.
    pub fn kind(&self) -> usize {
        match self {
            Self::CgroupGone | Self::CgroupRecreated { .. } => repair::CGROUP,
            Self::Detached { .. } | Self::AttachedElsewhere { .. } | Self::NotListed { .. } => {
                repair::LINK
            }
            Self::PinMissing { .. } | Self::PinReplaced { .. } => repair::LINK_PIN,
        }
    }
}

impl fmt::Display for LinkProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CgroupGone => write!(f, "the attached cgroup was removed"),
            Self::CgroupRecreated { new_id } => write!(
                f,
                "the attached cgroup was removed and created again (new id {new_id})"
            ),
            Self::Detached { program } => write!(f, "the link of {program} was detached"),
            Self::AttachedElsewhere { program, cgroup_id } => write!(
                f,
                "the link of {program} was moved to cgroup id {cgroup_id}"
            ),
            Self::NotListed { program } => {
                write!(f, "the cgroup no longer lists {program} on its hook")
            }
            Self::PinMissing { program } => write!(f, "the pin of {program}'s link was removed"),
            Self::PinReplaced { program } => {
                write!(f, "something else was pinned in place of {program}'s link")
            }
        }
    }
}

/// Where the links to check come from.
pub enum LinkSource<'a> {
    /// The descriptors the daemon holds: a link whose pin is gone is still
    /// seen, and its pin is checked to be this link.
    Held(&'a BTreeMap<&'static str, OwnedFd>),
    /// The pins alone (`status`, with or without a daemon).
    Pins,
}

/// Compares the links with the kernel: the cgroup at its path (when it is
/// known; a cgroup gone or created again is the only problem said), each
/// link's target, the cgroup's program lists, and the pins. The daemon's
/// verification and `status` both ask this.
pub fn check_links(
    paths: &PinPaths,
    cgroup_path: Option<&Path>,
    cgroup_id: u64,
    source: LinkSource<'_>,
) -> Vec<LinkProblem> {
    if let Some(path) = cgroup_path {
        match CgroupTarget::current_id(path) {
            None => return vec![LinkProblem::CgroupGone],
            Some(id) if id != cgroup_id => {
                return vec![LinkProblem::CgroupRecreated { new_id: id }];
            }
            Some(_) => {}
        }
    }
    let cgroup_file = cgroup_path.and_then(|path| File::open(path).ok());
    names::PROGRAMS
        .into_iter()
        .filter_map(|program| {
            // A pin the daemon could not open for want of descriptors is
            // left as it is: taking it for missing would pin over it.
            let read = pinned_link(&paths.link(program));
            let looked = read.is_ok();
            let pinned = read.ok().flatten();
            let (fd, held) = match (&source, &pinned) {
                (LinkSource::Held(links), _) => (links.get(program)?.as_fd(), true),
                (LinkSource::Pins, Some((fd, _))) => (fd.as_fd(), false),
                (LinkSource::Pins, None) => return Some(LinkProblem::PinMissing { program }),
            };
            let problem = link_problem(program, fd, cgroup_id, cgroup_file.as_ref());
            problem.or_else(|| {
                (held && looked)
                    .then(|| pin_problem(program, fd, pinned.as_ref()))
                    .flatten()
            })
        })
        .collect()
}

/// What is wrong with one link itself: its target and the cgroup's list.
fn link_problem(
    program: &'static str,
    fd: std::os::fd::BorrowedFd<'_>,
    cgroup_id: u64,
    cgroup: Option<&File>,
) -> Option<LinkProblem> {
    let Ok(info) = sys::link_info(fd) else {
        return Some(LinkProblem::Detached { program });
    };
    if info.cgroup_id == 0 {
        return Some(LinkProblem::Detached { program });
    }
    if info.cgroup_id != cgroup_id {
        return Some(LinkProblem::AttachedElsewhere {
            program,
            cgroup_id: info.cgroup_id,
        });
    }
    let listed = cgroup.is_none_or(|file| {
        sys::attached_programs(file.as_fd(), attach_type(program))
            .map_or(true, |ids| ids.contains(&info.prog_id))
    });
    (!listed).then_some(LinkProblem::NotListed { program })
}

/// Whether the link the daemon holds is the one pinned.
fn pin_problem(
    program: &'static str,
    held: std::os::fd::BorrowedFd<'_>,
    pinned: Option<&(OwnedFd, sys::LinkInfo)>,
) -> Option<LinkProblem> {
    let held_id = sys::link_info(held).ok()?.id;
    match pinned {
        None => Some(LinkProblem::PinMissing { program }),
        Some((_, info)) if info.id != held_id => Some(LinkProblem::PinReplaced { program }),
        Some(_) => None,
    }
}

/// The links of one install, held by the daemon.
pub struct Attachment {
    paths: PinPaths,
    cgroup: CgroupTarget,
    /// A descriptor of each link: it keeps the link alive when its pin is
    /// removed, and lets the daemon pin it again.
    links: BTreeMap<&'static str, OwnedFd>,
}

/// What a pinned link says of itself: `None` when there is none, an error
/// when the daemon is out of descriptors or memory and could not look.
fn pinned_link(path: &Path) -> std::io::Result<Option<(std::os::fd::OwnedFd, sys::LinkInfo)>> {
    let read =
        sys::open_pinned(path).and_then(|fd| sys::link_info(fd.as_fd()).map(|info| (fd, info)));
    match read {
        Ok(link) => Ok(Some(link)),
        Err(error) if sys::out_of_resources(&error) => Err(error),
        Err(_) => Ok(None),
    }
}

/// Pins the link behind `fd` at its path, replacing what is there in one
/// rename so that the path never stands empty.
fn pin_fd(paths: &PinPaths, program: &'static str, fd: &OwnedFd) -> Result<(), KernelError> {
    let staging = paths.link_staging(program);
    let _ = std::fs::remove_file(&staging);
    sys::pin(fd.as_fd(), &staging).map_err(|source| KernelError::Io {
        path: staging.clone(),
        source,
    })?;
    let target = paths.link(program);
    std::fs::rename(&staging, &target).map_err(|source| KernelError::Io {
        path: target,
        source,
    })?;
    super::install::pinned_one();
    Ok(())
}

/// Attaches a new link for `program` and pins it; returns a descriptor of
/// it that the daemon keeps.
fn attach_and_pin(
    paths: &PinPaths,
    ebpf: &mut Ebpf,
    program: &'static str,
    cgroup: &File,
) -> Result<OwnedFd, KernelError> {
    let link = object::attach(ebpf, program, cgroup)?;
    let staging = paths.link_staging(program);
    let _ = std::fs::remove_file(&staging);
    // aya keeps the link's descriptor to itself; the pin lends us one.
    let pinned = link.pin(&staging).map_err(|source| KernelError::Pin {
        path: staging.clone(),
        source,
    })?;
    let fd = sys::open_pinned(&staging).map_err(|source| KernelError::Io {
        path: staging.clone(),
        source,
    })?;
    drop(pinned);
    let target = paths.link(program);
    std::fs::rename(&staging, &target).map_err(|source| KernelError::Io {
        path: target,
        source,
    })?;
    super::install::pinned_one();
    Ok(fd)
}

fn open_cgroup(cgroup: &CgroupTarget) -> Result<File, KernelError> {
    File::open(&cgroup.path).map_err(|source| KernelError::Io {
        path: cgroup.path.clone(),
        source,
    })
}

impl Attachment {
    /// Adopts each pinned link that attaches to the cgroup, switching it to
    /// this load's program with BPF_LINK_UPDATE, atomically (an upgrade
    /// when the program differs, which is noted). Attaches and pins a new
    /// link where none is pinned, or the pinned one is detached or
    /// defunct. `map_id` is the id of this install's socket table.
    pub fn establish(
        paths: &PinPaths,
        cgroup: CgroupTarget,
        ebpf: &mut Ebpf,
        map_id: u32,
    ) -> Result<(Self, Vec<String>), KernelError> {
        let cgroup_file = open_cgroup(&cgroup)?;
        let mut attachment = Self {
            paths: paths.clone(),
            cgroup,
            links: BTreeMap::new(),
        };
        let mut notes = Vec::new();
        for program in names::PROGRAMS {
            let path = paths.link(program);
            let attached = pinned_link(&path)
                .ok()
                .flatten()
                .filter(|(_, info)| info.cgroup_id == attachment.cgroup.id);
            let Some((fd, info)) = attached else {
                if path.exists() {
                    notes.push(format!(
                        "{}: not attached to {}; replaced by a new link",
                        path.display(),
                        attachment.cgroup.path.display()
                    ));
                }
                let fd = attach_and_pin(paths, ebpf, program, &cgroup_file)?;
                attachment.links.insert(program, fd);
                continue;
            };
            let ours = object::program_fd(ebpf, program)?;
            let our_tag = ebpf
                .program(program)
                .and_then(|loaded| loaded.info().ok())
                .map(|info| info.tag());
            // Without CAP_SYS_ADMIN the program behind the link cannot be
            // read.
            let current = program_by_id(info.prog_id);
            // Unknown (no CAP_SYS_ADMIN) counts as the same: a note on
            // every restart of the DaemonSet would be a false alarm.
            let same = current.as_ref().is_none_or(|current| {
                Some(current.tag()) == our_tag
                    && current
                        .map_ids()
                        .ok()
                        .flatten()
                        .is_some_and(|ids| ids.contains(&map_id))
            });
            // Always this load's program, even when the instructions are the
            // same: its read-only globals (log level, kernel features) are
            // this start's. The switch is atomic.
            sys::link_update(fd.as_fd(), ours.as_fd()).map_err(|source| KernelError::Io {
                path: path.clone(),
                source,
            })?;
            if !same {
                notes.push(format!(
                    "{}: switched in place to this version's program (BPF_LINK_UPDATE; program id {} before)",
                    path.display(),
                    info.prog_id
                ));
            }
            attachment.links.insert(program, fd);
        }
        Ok((attachment, notes))
    }

    pub fn cgroup(&self) -> &CgroupTarget {
        &self.cgroup
    }

    /// Compares the links with the kernel (see [`check_links`]), through
    /// the descriptors the daemon holds.
    pub fn check(&self) -> Vec<LinkProblem> {
        check_links(
            &self.paths,
            Some(&self.cgroup.path),
            self.cgroup.id,
            LinkSource::Held(&self.links),
        )
    }

    /// Repairs what `check` found. Returns a line for each repair made;
    /// a cgroup that is gone cannot be repaired until it returns.
    pub fn repair(
        &mut self,
        ebpf: &mut Ebpf,
        problems: &[LinkProblem],
    ) -> Result<Vec<(usize, String)>, KernelError> {
        let mut done = Vec::new();
        for problem in problems {
            match problem {
                LinkProblem::CgroupGone => {}
                LinkProblem::CgroupRecreated { new_id } => {
                    self.cgroup.id = *new_id;
                    let cgroup_file = open_cgroup(&self.cgroup)?;
                    for program in names::PROGRAMS {
                        self.replace_link(ebpf, program, &cgroup_file)?;
                    }
                    done.push((
                        problem.kind(),
                        format!(
                            "{problem}; attached every program to the new cgroup at {}",
                            self.cgroup.path.display()
                        ),
                    ));
                }
                LinkProblem::Detached { program }
                | LinkProblem::AttachedElsewhere { program, .. }
                | LinkProblem::NotListed { program } => {
                    let cgroup_file = open_cgroup(&self.cgroup)?;
                    self.replace_link(ebpf, program, &cgroup_file)?;
                    done.push((
                        problem.kind(),
                        format!("{problem}; attached a new link and pinned it"),
                    ));
                }
                LinkProblem::PinMissing { program } | LinkProblem::PinReplaced { program } => {
                    if let Some(fd) = self.links.get(program) {
                        pin_fd(&self.paths, program, fd)?;
                        done.push((problem.kind(), format!("{problem}; pinned it again")));
                    }
                }
            }
        }
        Ok(done)
    }

    fn replace_link(
        &mut self,
        ebpf: &mut Ebpf,
        program: &'static str,
        cgroup: &File,
    ) -> Result<(), KernelError> {
        let fd = attach_and_pin(&self.paths, ebpf, program, cgroup)?;
        // The old link (if any) is dropped here; its pin was replaced.
        self.links.insert(program, fd);
        Ok(())
    }

    /// Gives up the links without detaching them: their pins keep them.
    pub fn release(self) {
        drop(self.links);
    }
}
