//! Finding another socklb install that would shadow this one, or be
//! shadowed by it: one whose connect programs attach to this cgroup, an
//! ancestor or a descendant, and whose SERVICES map holds one of our VIPs.
//! Whichever attached first would take every connect to that VIP, and the
//! other would show healthy backends and no redirects.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    net::SocketAddr,
    os::{fd::AsFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use aya::{
    maps::MapInfo,
    programs::{ProgramInfo, links::LinkType},
};
use aya_obj::generated::bpf_attach_type;
use lb_common::{Endpoint, ServiceEntry, names};

use super::{CgroupTarget, PinPaths, sys};
use crate::convert::socket_addr;

/// Where a related cgroup sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relation {
    Same,
    Ancestor,
    Descendant,
}

/// Another install that serves one of our VIPs on a related cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtherInstall {
    /// Its pin directory, when a pin of its links was found.
    pub pin_path: Option<PathBuf>,
    pub relation: Relation,
    pub vips: Vec<SocketAddr>,
}

impl fmt::Display for OtherInstall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let vips: Vec<String> = self.vips.iter().map(ToString::to_string).collect();
        let place = match self.relation {
            Relation::Same => "on the same cgroup",
            Relation::Ancestor => "on an ancestor cgroup",
            Relation::Descendant => "on a descendant cgroup",
        };
        match &self.pin_path {
            Some(path) => write!(
                f,
                "VIP {} is also served by the socklb install at {} ({place})",
                vips.join(", "),
                path.display()
            ),
            None => write!(
                f,
                "VIP {} is also served by another socklb install whose pins were not found ({place})",
                vips.join(", ")
            ),
        }
    }
}

/// Inode numbers (cgroup ids) of the cgroup's ancestors up to the mount.
fn ancestor_ids(cgroup: &Path) -> HashSet<u64> {
    let root = crate::cgroup::v2_root().unwrap_or_else(|_| PathBuf::from("/"));
    cgroup
        .ancestors()
        .skip(1)
        .take_while(|dir| dir.starts_with(&root))
        .filter_map(|dir| std::fs::metadata(dir).ok().map(|meta| meta.ino()))
        .collect()
}

/// Whether a cgroup with this id lies below `dir` (a bounded walk).
fn is_descendant(dir: &Path, id: u64) -> bool {
    let mut pending = vec![dir.to_path_buf()];
    let mut visited = 0;
    while let Some(current) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&current) else {
            continue;
        };
        for entry in entries.flatten() {
            visited += 1;
            if visited > 200_000 {
                return false;
            }
            if !entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                continue;
            }
            if entry.metadata().is_ok_and(|meta| meta.ino() == id) {
                return true;
            }
            pending.push(entry.path());
        }
    }
    false
}

/// Every pinned socklb connect link under /sys/fs/bpf (a bounded walk,
/// four levels deep), with the directory that holds it.
fn pinned_connect_links() -> Vec<(PathBuf, PathBuf)> {
    let mut found = Vec::new();
    let mut pending = vec![(PathBuf::from("/sys/fs/bpf"), 0)];
    let mut visited = 0;
    while let Some((dir, depth)) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            visited += 1;
            if visited > 20_000 {
                return found;
            }
            let path = entry.path();
            if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                if depth < 4 {
                    pending.push((path, depth + 1));
                }
                continue;
            }
            let is_connect_link = entry.file_name().to_str().is_some_and(|name| {
                [names::CONNECT4, names::CONNECT6]
                    .iter()
                    .any(|program| name == super::pins::link_file_name(program))
            });
            if is_connect_link {
                found.push((dir.clone(), path));
            }
        }
    }
    found
}

/// The pin directory under /sys/fs/bpf holding a pinned link with this id.
fn pin_dir_of_link(link_id: u32) -> Option<PathBuf> {
    pinned_connect_links().into_iter().find_map(|(dir, path)| {
        sys::open_pinned(&path)
            .and_then(|fd| sys::link_info(fd.as_fd()))
            .is_ok_and(|info| info.id == link_id)
            .then_some(dir)
    })
}

/// The VIPs in the SERVICES map of a program.
fn vips_of_program(program: &ProgramInfo) -> Vec<Endpoint> {
    let map_ids = program.map_ids().ok().flatten().unwrap_or_default();
    for map_id in map_ids {
        let Ok(map) = MapInfo::from_id(map_id) else {
            continue;
        };
        if map.name_as_str() != Some(names::SERVICES) {
            continue;
        }
        let Ok(fd) = map.fd() else {
            continue;
        };
        return sys::lookup_batch::<Endpoint, ServiceEntry>(fd.as_fd(), None, 4096)
            .map(|entries| entries.into_iter().map(|(vip, _)| vip).collect())
            .unwrap_or_default();
    }
    Vec::new()
}

/// A connect link of another install: its id, where it attaches, and the
/// VIPs its SERVICES map holds.
struct ConnectLink {
    id: u32,
    cgroup_id: u64,
    pin_dir: Option<PathBuf>,
    vips: Vec<Endpoint>,
}

/// Every socklb connect link of the machine, found by id. Needs
/// CAP_SYS_ADMIN (the kernel's GET_NEXT_ID and GET_FD_BY_ID).
fn links_by_id(own: &HashSet<u32>) -> std::io::Result<Vec<ConnectLink>> {
    let connect_hooks = [
        bpf_attach_type::BPF_CGROUP_INET4_CONNECT as u32,
        bpf_attach_type::BPF_CGROUP_INET6_CONNECT as u32,
    ];
    // Every program once, by id: the links name theirs.
    let programs: HashMap<u32, ProgramInfo> = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .map(|program| (program.id(), program))
        .collect();
    let mut links = Vec::new();
    for link in aya::programs::loaded_links() {
        // The syscall's own error, so that EPERM (no CAP_SYS_ADMIN) reaches
        // `overlapping`, which then looks through the pins instead.
        let link = match link.map_err(|error| match error {
            aya::programs::links::LinkError::SyscallError(aya::sys::SyscallError {
                io_error,
                ..
            }) => io_error,
            other => std::io::Error::other(other),
        }) {
            Ok(link) => link,
            // A link that another BPF user of the node (another socklb
            // detaching, any agent) frees (ENOENT) or is still creating
            // (EAGAIN: in the kernel's table, not yet settled) between its
            // id and its descriptor. Neither is an install to refuse, and
            // the walk goes on from its id. Failing here ended socklb's
            // start at random on a busy node (exit 1 in hardening.rs's
            // crash test whenever another suite ran beside it).
            Err(error) if matches!(error.raw_os_error(), Some(libc::ENOENT | libc::EAGAIN)) => {
                continue;
            }
            Err(error) => return Err(error),
        };
        if own.contains(&link.id()) || !matches!(link.link_type(), Ok(LinkType::Cgroup)) {
            continue;
        }
        // aya's link info lacks the cgroup link's target.
        let Ok(info) = sys::link_fd_by_id(link.id()).and_then(|fd| sys::link_info(fd.as_fd()))
        else {
            continue;
        };
        if info.cgroup_id == 0 || !connect_hooks.contains(&info.attach_type) {
            continue;
        }
        let Some(program) = programs.get(&info.prog_id).filter(|program| {
            program
                .name_as_str()
                .is_some_and(|name| name == names::CONNECT4 || name == names::CONNECT6)
        }) else {
            continue;
        };
        links.push(ConnectLink {
            id: info.id,
            cgroup_id: info.cgroup_id,
            pin_dir: None,
            vips: vips_of_program(program),
        });
    }
    Ok(links)
}

/// The socklb connect links pinned under /sys/fs/bpf (a bounded walk),
/// with the VIPs of the SERVICES map pinned beside them. Needs only
/// CAP_BPF; an install whose pins this process cannot open is not seen.
fn links_by_pin(own: &HashSet<u32>) -> Vec<ConnectLink> {
    pinned_connect_links()
        .into_iter()
        .filter_map(|(dir, path)| {
            let info = sys::open_pinned(&path)
                .and_then(|fd| sys::link_info(fd.as_fd()))
                .ok()?;
            if own.contains(&info.id) || info.cgroup_id == 0 {
                return None;
            }
            let services = PinPaths::new(&dir).map(names::SERVICES);
            let vips = sys::open_pinned(&services)
                .and_then(|fd| sys::lookup_batch::<Endpoint, ServiceEntry>(fd.as_fd(), None, 4096))
                .map(|entries| entries.into_iter().map(|(vip, _)| vip).collect())
                .unwrap_or_default();
            Some(ConnectLink {
                id: info.id,
                cgroup_id: info.cgroup_id,
                pin_dir: Some(dir),
                vips,
            })
        })
        .collect()
}

/// How [`overlapping`] looked for other installs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Search {
    /// Every link of the machine, by id (with CAP_SYS_ADMIN).
    AllLinks,
    /// Only links pinned under /sys/fs/bpf that this process can open
    /// (without CAP_SYS_ADMIN).
    PinnedLinks,
}

/// Other socklb installs that serve one of `vips` on a related cgroup,
/// and how they were looked for. Links pinned under `ours` are this
/// install's own and are skipped.
pub fn overlapping(
    ours: &PinPaths,
    cgroup: &CgroupTarget,
    vips: &[Endpoint],
) -> std::io::Result<(Vec<OtherInstall>, Search)> {
    let own_links: HashSet<u32> = ours
        .links()
        .filter_map(|(_, path)| sys::open_pinned(&path).ok())
        .filter_map(|fd| sys::link_info(fd.as_fd()).ok())
        .map(|info| info.id)
        .collect();
    let (links, search) = match links_by_id(&own_links) {
        Ok(links) => (links, Search::AllLinks),
        Err(error) if error.raw_os_error() == Some(libc::EPERM) => {
            (links_by_pin(&own_links), Search::PinnedLinks)
        }
        Err(error) => return Err(error),
    };
    let ancestors = ancestor_ids(&cgroup.path);
    let wanted: HashSet<Endpoint> = vips.iter().copied().collect();
    let mut others: Vec<OtherInstall> = Vec::new();
    for link in links {
        let relation = if link.cgroup_id == cgroup.id {
            Relation::Same
        } else if ancestors.contains(&link.cgroup_id) {
            Relation::Ancestor
        } else if is_descendant(&cgroup.path, link.cgroup_id) {
            Relation::Descendant
        } else {
            continue;
        };
        let shared: Vec<SocketAddr> = link
            .vips
            .iter()
            .filter(|vip| wanted.contains(vip))
            .filter_map(socket_addr)
            .collect();
        if shared.is_empty() {
            continue;
        }
        let other = OtherInstall {
            pin_path: link.pin_dir.or_else(|| pin_dir_of_link(link.id)),
            relation,
            vips: shared,
        };
        // connect4 and connect6 of one install share their maps.
        if !others.contains(&other) {
            others.push(other);
        }
    }
    Ok((others, search))
}
