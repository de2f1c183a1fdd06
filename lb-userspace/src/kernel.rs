//! The kernel side, seen from userspace: load, attach, pin, adopt, write the
//! selection tables, read them back, and uninstall.
//!
//! socklb owns exactly the objects pinned under its pin directory: the maps
//! named in [`MAP_NAMES`] and one bpf_link per program in [`PROGRAMS`]. It
//! attaches with bpf_link, so other programs on the same cgroup hooks keep
//! running, and it never removes anything it did not pin.

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    net::SocketAddr,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, Map, MapData, MapError, PerCpuArray, PerCpuValues},
    programs::{CgroupAttachMode, Program, ProgramError, links::FdLink, links::PinnedLink},
    util::nr_cpus,
};
use lb_common::{
    BackendConns, BackendInfo, BackendSlot, BackendStats, Endpoint, NAME_LEN, ROLE_NORMAL,
    ROLE_PREFERRED, ROLE_STANDBY, RedirectedSocket, SLOTS_PER_LIST, ServiceEntry, Settings,
    TableInfo, TableStats, bank_base,
};

use crate::planner::{Layout, TableContents, TableLayout, Tier, endpoint};

/// The eBPF object, built by `cargo xtask build-ebpf` and embedded by build.rs.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/socklb.bpf.o"));

/// Where socklb pins its objects unless told otherwise.
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/socklb";

/// The maps socklb pins, by name. Pin file name = map name.
pub const MAP_NAMES: [&str; 11] = [
    "SERVICES",
    "SLOTS",
    "REDIRECTS",
    "BACKEND_STATS",
    "TABLE_STATS",
    "BACKENDS",
    "TABLES",
    "SETTINGS",
    "BACKEND_CONNS",
    "CONNECT_FAILURES",
    "DRAINS",
];

/// The programs socklb attaches; each link is pinned as `link_<program>`.
pub const PROGRAMS: [&str; 5] = [
    "socklb_connect4",
    "socklb_connect6",
    "socklb_getpeername4",
    "socklb_getpeername6",
    "socklb_sockops",
];

/// The program whose log ring buffer the daemon forwards (all share it).
const LOGGING_PROGRAM: &str = "socklb_connect4";

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "this socklb was built without its eBPF object; run `cargo xtask build-ebpf` and build again"
    )]
    NoObject,
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("map {name}: {source}")]
    Map { name: String, source: MapError },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        source: aya::pin::PinError,
    },
    #[error("link {path}: {source}")]
    Link {
        path: PathBuf,
        source: aya::programs::links::LinkError,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{dir} holds part of a socklb install (missing: {}); run `socklb uninstall --pin-path {dir}` and start again",
        .missing.join(", ")
    )]
    Partial { dir: PathBuf, missing: Vec<String> },
    #[error(
        "the pinned links under {dir} attach to cgroup id {pinned}, not to {requested} (id {requested_id}); run `socklb uninstall --pin-path {dir}` first"
    )]
    CgroupMismatch {
        dir: PathBuf,
        pinned: u64,
        requested: PathBuf,
        requested_id: u64,
    },
    #[error("nothing of socklb is pinned under {0}")]
    NotInstalled(PathBuf),
    #[error("another socklb daemon holds {0}")]
    Locked(PathBuf),
    #[error(
        "--pin-path {0} is not on a bpf file system; mount one there (mount -t bpf bpf DIR) or choose a directory under /sys/fs/bpf"
    )]
    NotBpffs(PathBuf),
    #[error("mounting bpffs on {path}: {source}")]
    Mount {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> KernelError + '_ {
    move |source| KernelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Every path socklb pins, derived from one directory.
#[derive(Debug, Clone)]
pub struct PinPaths {
    pub dir: PathBuf,
}

impl PinPaths {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn link(&self, program: &str) -> PathBuf {
        self.dir.join(format!("link_{program}"))
    }

    /// Every pin socklb may own here, links first (removing them detaches).
    pub fn all(&self) -> Vec<PathBuf> {
        let links = PROGRAMS.iter().map(|program| self.link(program));
        let maps = MAP_NAMES.iter().map(|name| self.map(name));
        links.chain(maps).collect()
    }
}

/// Log level of the kernel programs, fixed when they are loaded. `Off`
/// keeps logging out of the connect path entirely: the verifier removes the
/// dead branches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BpfLogLevel {
    Off,
    Error,
    Warn,
    Info,
    Debug,
}

impl BpfLogLevel {
    fn as_u8(self) -> u8 {
        match self {
            Self::Off => 0,
            Self::Error => 1,
            Self::Warn => 2,
            Self::Info => 3,
            Self::Debug => 4,
        }
    }
}

/// What the records say about one backend's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BackendHealth {
    pub healthy: bool,
    /// False while `healthy` is only assumed (no probe has answered yet).
    pub probed: bool,
    /// Takes no new connections (config `drain` or `socklb drain`).
    pub draining: bool,
}

/// The maps, opened with their key and value types.
pub struct Dataplane {
    services: BpfHashMap<MapData, Endpoint, ServiceEntry>,
    redirects: BpfHashMap<MapData, u64, RedirectedSocket>,
    slots: Array<MapData, BackendSlot>,
    backends: BpfHashMap<MapData, u32, BackendInfo>,
    tables: BpfHashMap<MapData, u32, TableInfo>,
    backend_stats: PerCpuArray<MapData, BackendStats>,
    backend_conns: Array<MapData, BackendConns>,
    drains: BpfHashMap<MapData, Endpoint, u32>,
    table_stats: PerCpuArray<MapData, TableStats>,
    settings: Array<MapData, Settings>,
}

fn map_error(name: &str) -> impl FnOnce(MapError) -> KernelError + '_ {
    move |source| KernelError::Map {
        name: name.to_string(),
        source,
    }
}

/// Opens every map by name through `open`, typed.
fn open_maps(
    mut open: impl FnMut(&str) -> Result<Map, KernelError>,
) -> Result<Dataplane, KernelError> {
    macro_rules! typed {
        ($name:literal) => {
            open($name)?.try_into().map_err(map_error($name))?
        };
    }
    Ok(Dataplane {
        services: typed!("SERVICES"),
        redirects: typed!("REDIRECTS"),
        slots: typed!("SLOTS"),
        backends: typed!("BACKENDS"),
        tables: typed!("TABLES"),
        backend_stats: typed!("BACKEND_STATS"),
        backend_conns: typed!("BACKEND_CONNS"),
        drains: typed!("DRAINS"),
        table_stats: typed!("TABLE_STATS"),
        settings: typed!("SETTINGS"),
    })
}

impl Dataplane {
    /// Opens the maps pinned under `paths`.
    pub fn open_pinned(paths: &PinPaths) -> Result<Self, KernelError> {
        open_maps(|name| {
            let path = paths.map(name);
            if !path.exists() {
                return Err(KernelError::NotInstalled(paths.dir.clone()));
            }
            let data = MapData::from_pin(&path).map_err(map_error(name))?;
            Map::from_map_data(data).map_err(map_error(name))
        })
    }

    fn take_from(ebpf: &mut Ebpf) -> Result<Self, KernelError> {
        open_maps(|name| {
            ebpf.take_map(name).ok_or_else(|| KernelError::Map {
                name: name.to_string(),
                source: MapError::InvalidName {
                    name: name.to_string(),
                },
            })
        })
    }

    pub fn settings(&self) -> Result<Settings, KernelError> {
        self.settings.get(&0, 0).map_err(map_error("SETTINGS"))
    }

    pub fn write_settings(&mut self, settings: Settings) -> Result<(), KernelError> {
        self.settings
            .set(0, settings, 0)
            .map_err(map_error("SETTINGS"))
    }

    /// Replaces the selection table of one (service, family): the idle bank
    /// is filled first, then each VIP's entry is switched to it by a single
    /// hash-map update, which the kernel swaps in whole. A connect thus sees
    /// the old table or the new one, never a mix.
    pub fn write_table(
        &mut self,
        table: &TableLayout,
        contents: &TableContents,
    ) -> Result<(), KernelError> {
        let previous = table
            .vips
            .iter()
            .find_map(|vip| self.services.get(&endpoint(vip), 0).ok())
            .filter(|entry| entry.table_id == table.table_id);
        // Never fill a bank that any VIP entry points at now, even one left
        // from a configuration whose ids were different.
        let in_use: HashSet<u32> = self
            .service_entries()
            .iter()
            .map(|(_, entry)| entry.bank_base)
            .collect();
        let preferred = match previous {
            Some(entry) if entry.bank_base == bank_base(table.table_id, 0) => 1,
            _ => 0,
        };
        let bank = [preferred, 1 - preferred]
            .into_iter()
            .find(|bank| !in_use.contains(&bank_base(table.table_id, *bank)))
            .unwrap_or(preferred);
        let base = bank_base(table.table_id, bank);
        let targets: HashMap<u32, SocketAddr> = table
            .backends
            .iter()
            .map(|backend| (backend.id, backend.addr))
            .collect();
        for (offset, list) in [(0, &contents.healthy), (SLOTS_PER_LIST, &contents.all)] {
            for (index, backend_id) in list.iter().enumerate() {
                let slot = BackendSlot {
                    target: endpoint(&targets[backend_id]),
                    backend_id: *backend_id,
                };
                self.slots
                    .set(base + offset + index as u32, slot, 0)
                    .map_err(map_error("SLOTS"))?;
            }
        }
        let entry = ServiceEntry {
            table_id: table.table_id,
            bank_base: base,
            healthy_slots: contents.healthy.len() as u32,
            all_slots: contents.all.len() as u32,
            flags: table.flags,
            generation: previous.map_or(1, |entry| entry.generation.wrapping_add(1)),
        };
        for vip in &table.vips {
            self.services
                .insert(endpoint(vip), entry, 0)
                .map_err(map_error("SERVICES"))?;
        }
        Ok(())
    }

    /// Writes what status shows: table names and policies, backends with
    /// weight and health. A reused id with a new meaning starts its
    /// counters at zero.
    pub fn write_records(
        &mut self,
        layout: &Layout,
        health: impl Fn(u32) -> BackendHealth,
    ) -> Result<(), KernelError> {
        for table in &layout.tables {
            let info = table_info(table);
            let old = self.tables.get(&table.table_id, 0).ok();
            if old.is_none_or(|old| old.name != info.name || old.family != info.family) {
                self.reset_table_stats(table.table_id)?;
            }
            if old != Some(info) {
                self.tables
                    .insert(table.table_id, info, 0)
                    .map_err(map_error("TABLES"))?;
            }
        }
        for (table, backend) in layout.backends() {
            let state = health(backend.id);
            let info = BackendInfo {
                target: endpoint(&backend.addr),
                table_id: table.table_id,
                weight: backend.weight,
                healthy: u8::from(state.healthy),
                probed: u8::from(state.probed),
                role: match backend.tier {
                    Tier::Preferred => ROLE_PREFERRED,
                    Tier::Normal => ROLE_NORMAL,
                    Tier::Standby => ROLE_STANDBY,
                },
                draining: u8::from(state.draining),
            };
            let old = self.backends.get(&backend.id, 0).ok();
            if old.is_none_or(|old| old.target != info.target || old.table_id != info.table_id) {
                self.reset_backend_stats(backend.id)?;
            }
            if old != Some(info) {
                self.backends
                    .insert(backend.id, info, 0)
                    .map_err(map_error("BACKENDS"))?;
            }
        }
        Ok(())
    }

    /// Removes VIPs, backends and tables that the layout no longer has.
    pub fn remove_stale(&mut self, layout: &Layout) -> Result<(), KernelError> {
        let vips: HashSet<Endpoint> = layout
            .tables
            .iter()
            .flat_map(|table| table.vips.iter().map(endpoint))
            .collect();
        let stale_vips: Vec<Endpoint> = self
            .services
            .keys()
            .filter_map(Result::ok)
            .filter(|key| !vips.contains(key))
            .collect();
        for key in stale_vips {
            self.services.remove(&key).map_err(map_error("SERVICES"))?;
        }
        let backend_ids: HashSet<u32> = layout.backends().map(|(_, backend)| backend.id).collect();
        let stale_backends: Vec<u32> = self
            .backends
            .keys()
            .filter_map(Result::ok)
            .filter(|id| !backend_ids.contains(id))
            .collect();
        for id in stale_backends {
            self.backends.remove(&id).map_err(map_error("BACKENDS"))?;
        }
        let table_ids: HashSet<u32> = layout.tables.iter().map(|table| table.table_id).collect();
        let stale_tables: Vec<u32> = self
            .tables
            .keys()
            .filter_map(Result::ok)
            .filter(|id| !table_ids.contains(id))
            .collect();
        for id in stale_tables {
            self.tables.remove(&id).map_err(map_error("TABLES"))?;
        }
        Ok(())
    }

    /// Writes a whole plan: records, every table, then removes leftovers.
    pub fn write_all(
        &mut self,
        layout: &Layout,
        contents: &[TableContents],
        health: impl Fn(u32) -> BackendHealth,
    ) -> Result<(), KernelError> {
        // Leftovers first: a VIP dropped from the configuration stops
        // redirecting before its table id can be given to another service.
        self.remove_stale(layout)?;
        self.write_records(layout, health)?;
        for (table, table_contents) in layout.tables.iter().zip(contents) {
            self.write_table(table, table_contents)?;
        }
        Ok(())
    }

    /// The backends `socklb drain` asked to drain.
    pub fn drain_requests(&self) -> HashSet<Endpoint> {
        self.drains.keys().filter_map(Result::ok).collect()
    }

    /// Asks for (or withdraws) a drain of one backend address.
    pub fn request_drain(&mut self, backend: Endpoint, drain: bool) -> Result<(), KernelError> {
        let result = if drain {
            self.drains.insert(backend, 1, 0)
        } else {
            match self.drains.remove(&backend) {
                Err(MapError::KeyNotFound) => Ok(()),
                other => other,
            }
        };
        result.map_err(map_error("DRAINS"))
    }

    /// Whether socklb sent the socket with this cookie to `backend`.
    pub fn redirected_to(&self, cookie: u64, backend: &Endpoint) -> bool {
        self.redirects
            .get(&cookie, 0)
            .is_ok_and(|record| record.backend == *backend)
    }

    /// The backend ids in the healthy list an entry points at.
    pub fn healthy_backend_ids(&self, entry: &ServiceEntry) -> HashSet<u32> {
        (0..entry.healthy_slots.min(SLOTS_PER_LIST))
            .filter_map(|offset| self.slots.get(&(entry.bank_base + offset), 0).ok())
            .map(|slot| slot.backend_id)
            .collect()
    }

    /// The service entry each VIP has now.
    pub fn service_entries(&self) -> Vec<(Endpoint, ServiceEntry)> {
        self.services.iter().filter_map(Result::ok).collect()
    }

    pub fn backend_records(&self) -> Vec<(u32, BackendInfo)> {
        self.backends.iter().filter_map(Result::ok).collect()
    }

    pub fn table_records(&self) -> Vec<(u32, TableInfo)> {
        self.tables.iter().filter_map(Result::ok).collect()
    }

    /// Redirects of one backend, summed over CPUs.
    pub fn redirects(&self, backend_id: u32) -> u64 {
        self.backend_stats
            .get(&backend_id, 0)
            .map(|values| values.iter().map(|stats| stats.redirects).sum())
            .unwrap_or(0)
    }

    /// "None healthy" counters of one table, summed over CPUs.
    pub fn table_stats(&self, table_id: u32) -> TableStats {
        self.table_stats
            .get(&table_id, 0)
            .map(|values| {
                values
                    .iter()
                    .fold(TableStats::default(), |sum, stats| TableStats {
                        none_healthy: sum.none_healthy + stats.none_healthy,
                        rejected: sum.rejected + stats.rejected,
                    })
            })
            .unwrap_or_default()
    }

    fn reset_backend_stats(&mut self, backend_id: u32) -> Result<(), KernelError> {
        let zeros = per_cpu_zeros::<BackendStats>()?;
        self.backend_stats
            .set(backend_id, zeros, 0)
            .map_err(map_error("BACKEND_STATS"))?;
        self.backend_conns
            .set(backend_id, BackendConns::default(), 0)
            .map_err(map_error("BACKEND_CONNS"))
    }

    /// What sock_ops counted for one backend; `live` clamped at zero.
    pub fn connections(&self, backend_id: u32) -> BackendConns {
        let mut conns = self.backend_conns.get(&backend_id, 0).unwrap_or_default();
        conns.live = conns.live.max(0);
        conns
    }

    fn reset_table_stats(&mut self, table_id: u32) -> Result<(), KernelError> {
        let zeros = per_cpu_zeros::<TableStats>()?;
        self.table_stats
            .set(table_id, zeros, 0)
            .map_err(map_error("TABLE_STATS"))
    }
}

fn per_cpu_zeros<T: aya::Pod + Default + Clone>() -> Result<PerCpuValues<T>, KernelError> {
    let cpus = nr_cpus().map_err(|(_, source)| KernelError::Io {
        path: PathBuf::from("/sys/devices/system/cpu/possible"),
        source,
    })?;
    PerCpuValues::try_from(vec![T::default(); cpus]).map_err(|source| KernelError::Io {
        path: PathBuf::from("/sys/devices/system/cpu/possible"),
        source,
    })
}

fn table_info(table: &TableLayout) -> TableInfo {
    let mut name = [0u8; NAME_LEN];
    let bytes = table.service.as_bytes();
    let length = bytes.len().min(NAME_LEN - 1);
    name[..length].copy_from_slice(&bytes[..length]);
    TableInfo {
        name,
        flags: table.flags,
        family: table.family,
        _pad: [0; 3],
    }
}

/// The service name stored in a table record.
pub fn table_name(info: &TableInfo) -> String {
    let end = info
        .name
        .iter()
        .position(|&byte| byte == 0)
        .unwrap_or(NAME_LEN);
    String::from_utf8_lossy(&info.name[..end]).into_owned()
}

/// What is pinned under a directory.
#[derive(Debug, PartialEq, Eq)]
pub enum PinState {
    Empty,
    Complete,
    Partial(Vec<String>),
}

pub fn pin_state(paths: &PinPaths) -> PinState {
    let all = paths.all();
    let missing: Vec<String> = all
        .iter()
        .filter(|path| !path.exists())
        .map(|path| {
            path.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    match missing.len() {
        0 => PinState::Complete,
        count if count == all.len() => PinState::Empty,
        _ => PinState::Partial(missing),
    }
}

/// A running data plane: the maps, plus how it came to be.
pub struct Installed {
    pub dataplane: Dataplane,
    /// True when a previous daemon's pinned programs were adopted.
    pub adopted: bool,
    /// Id of the program whose logs are forwarded.
    pub logging_program_id: u32,
}

/// Takes over what is pinned under `paths`, or installs afresh. `prepare`
/// fills the maps; on a fresh install it runs before the programs are
/// attached, so the first redirected connect already finds a full table, and
/// on adoption the old tables keep serving until it has written new ones.
pub fn install_or_adopt(
    paths: &PinPaths,
    cgroup_dir: &Path,
    cgroup_id: u64,
    log_level: BpfLogLevel,
    prepare: impl FnOnce(&mut Dataplane) -> Result<(), KernelError>,
) -> Result<Installed, KernelError> {
    match pin_state(paths) {
        PinState::Partial(missing) => Err(KernelError::Partial {
            dir: paths.dir.clone(),
            missing,
        }),
        PinState::Complete => adopt(paths, cgroup_dir, cgroup_id, prepare),
        PinState::Empty => {
            let result = install(paths, cgroup_dir, log_level, prepare);
            if result.is_err() {
                // A failed fresh install leaves nothing behind.
                remove_pins(paths);
            }
            result
        }
    }
}

fn adopt(
    paths: &PinPaths,
    cgroup_dir: &Path,
    cgroup_id: u64,
    prepare: impl FnOnce(&mut Dataplane) -> Result<(), KernelError>,
) -> Result<Installed, KernelError> {
    let mut dataplane = Dataplane::open_pinned(paths)?;
    let pinned = dataplane.settings()?.attached_cgroup_id;
    if pinned != cgroup_id {
        return Err(KernelError::CgroupMismatch {
            dir: paths.dir.clone(),
            pinned,
            requested: cgroup_dir.to_path_buf(),
            requested_id: cgroup_id,
        });
    }
    let link_path = paths.link(LOGGING_PROGRAM);
    let link = PinnedLink::from_pin(&link_path).map_err(|source| KernelError::Link {
        path: link_path.clone(),
        source,
    })?;
    let fd_link: FdLink = link.into();
    let info = fd_link.info().map_err(|source| KernelError::Link {
        path: link_path,
        source,
    })?;
    prepare(&mut dataplane)?;
    Ok(Installed {
        dataplane,
        adopted: true,
        logging_program_id: info.program_id(),
    })
}

fn install(
    paths: &PinPaths,
    cgroup_dir: &Path,
    log_level: BpfLogLevel,
    prepare: impl FnOnce(&mut Dataplane) -> Result<(), KernelError>,
) -> Result<Installed, KernelError> {
    if EBPF_OBJECT.is_empty() {
        return Err(KernelError::NoObject);
    }
    std::fs::create_dir_all(&paths.dir).map_err(io_error(&paths.dir))?;
    let level = log_level.as_u8();
    let mut ebpf = EbpfLoader::new()
        .override_global("AYA_LOG_LEVEL", &level, false)
        .load(EBPF_OBJECT)?;
    for name in PROGRAMS {
        load_program(&mut ebpf, name)?;
    }
    for name in MAP_NAMES {
        let path = paths.map(name);
        let map = ebpf.map(name).ok_or_else(|| KernelError::Map {
            name: name.to_string(),
            source: MapError::InvalidName {
                name: name.to_string(),
            },
        })?;
        map.pin(&path)
            .map_err(|source| KernelError::Pin { path, source })?;
    }
    let mut dataplane = Dataplane::take_from(&mut ebpf)?;
    prepare(&mut dataplane)?;

    let cgroup = File::open(cgroup_dir).map_err(io_error(cgroup_dir))?;
    let mut logging_program_id = 0;
    for name in PROGRAMS {
        let fd_link = attach_program(&mut ebpf, name, &cgroup, paths)?;
        let path = paths.link(name);
        let pinned = fd_link.pin(&path).map_err(|source| KernelError::Pin {
            path: path.clone(),
            source,
        })?;
        if name == LOGGING_PROGRAM {
            let fd_link: FdLink = pinned.into();
            logging_program_id = fd_link
                .info()
                .map_err(|source| KernelError::Link { path, source })?
                .program_id();
        }
    }
    Ok(Installed {
        dataplane,
        adopted: false,
        logging_program_id,
    })
}

fn load_program(ebpf: &mut Ebpf, name: &'static str) -> Result<(), KernelError> {
    let result = match ebpf.program_mut(name) {
        Some(Program::CgroupSockAddr(program)) => program.load(),
        Some(Program::SockOps(program)) => program.load(),
        _ => Err(ProgramError::UnexpectedProgramType),
    };
    result.map_err(|source| KernelError::Program { name, source })
}

/// Attaches one program to the cgroup with a bpf_link, which always lets
/// other programs run beside ours, and hands the link back for pinning.
fn attach_program(
    ebpf: &mut Ebpf,
    name: &'static str,
    cgroup: &File,
    paths: &PinPaths,
) -> Result<FdLink, KernelError> {
    let program_error = |source| KernelError::Program { name, source };
    let link_error = |source| KernelError::Link {
        path: paths.link(name),
        source,
    };
    // The two program types share the attach API but no trait for it.
    macro_rules! attach_and_take_link {
        ($program:expr) => {{
            let id = $program
                .attach(cgroup, CgroupAttachMode::Single)
                .map_err(program_error)?;
            $program
                .take_link(id)
                .map_err(program_error)?
                .try_into()
                .map_err(link_error)
        }};
    }
    match ebpf.program_mut(name) {
        Some(Program::CgroupSockAddr(program)) => attach_and_take_link!(program),
        Some(Program::SockOps(program)) => attach_and_take_link!(program),
        _ => Err(program_error(ProgramError::UnexpectedProgramType)),
    }
}

/// Removes every pin socklb owns under `paths`, links first so that
/// redirection stops before the maps go, and the directory if it is then
/// empty. Returns what was removed. Nothing else is touched.
pub fn remove_pins(paths: &PinPaths) -> Vec<PathBuf> {
    let removed: Vec<PathBuf> = paths
        .all()
        .into_iter()
        .filter(|path| std::fs::remove_file(path).is_ok())
        .collect();
    // Fails, harmlessly, if someone else keeps files there.
    let _ = std::fs::remove_dir(&paths.dir);
    removed
}

/// The ring buffer of failed connects that sock_ops fills.
pub fn open_connect_failures(paths: &PinPaths) -> Result<aya::maps::RingBuf<MapData>, KernelError> {
    let name = "CONNECT_FAILURES";
    let data = MapData::from_pin(paths.map(name)).map_err(map_error(name))?;
    Map::from_map_data(data)
        .map_err(map_error(name))?
        .try_into()
        .map_err(map_error(name))
}

/// `socklb uninstall`: like [`remove_pins`], but an error when nothing of
/// socklb is there.
pub fn uninstall(paths: &PinPaths) -> Result<Vec<PathBuf>, KernelError> {
    if pin_state(paths) == PinState::Empty {
        return Err(KernelError::NotInstalled(paths.dir.clone()));
    }
    Ok(remove_pins(paths))
}

/// `statfs` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
/// Where bpffs lives by convention.
const BPFFS_MOUNT: &str = "/sys/fs/bpf";

fn fs_magic(path: &Path) -> Option<i64> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } == 0).then_some(stat.f_type as i64)
}

/// Makes sure the pin directory can live on bpffs. Some hosts boot without
/// bpffs mounted; as Cilium and bpftool do, socklb then mounts it at
/// /sys/fs/bpf (and only there). Returns whether it mounted it.
pub fn ensure_bpffs(paths: &PinPaths) -> Result<bool, KernelError> {
    let existing = paths
        .dir
        .ancestors()
        .find(|dir| dir.exists())
        .unwrap_or(Path::new("/"));
    if fs_magic(existing) == Some(BPF_FS_MAGIC) {
        return Ok(false);
    }
    let mount_point = Path::new(BPFFS_MOUNT);
    if !paths.dir.starts_with(mount_point) || existing != mount_point {
        return Err(KernelError::NotBpffs(paths.dir.clone()));
    }
    let source = c"bpf";
    let target = c"/sys/fs/bpf";
    // SAFETY: plain mount(2) with static NUL-terminated strings.
    let result = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            source.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if result != 0 {
        return Err(KernelError::Mount {
            path: mount_point.to_path_buf(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(true)
}

/// An exclusive lock on the pin directory, held while a daemon runs, so two
/// daemons never write the same maps.
pub fn lock_pin_dir(paths: &PinPaths) -> Result<File, KernelError> {
    std::fs::create_dir_all(&paths.dir).map_err(io_error(&paths.dir))?;
    let dir = File::open(&paths.dir).map_err(io_error(&paths.dir))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(KernelError::Locked(paths.dir.clone()));
    }
    Ok(dir)
}

/// The cookie of the network namespace this process runs in.
pub fn current_netns_cookie() -> Result<u64, std::io::Error> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let mut cookie: u64 = 0;
    let mut length = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `length` bytes into `cookie`.
    let result = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut length,
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}
