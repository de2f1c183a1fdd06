//! The few bpf(2) commands that aya 0.14 does not expose: a cgroup link's
//! target (and a link by id, to read it), the programs attached to a
//! cgroup or a sockhash (PROG_QUERY), batch lookups, the keys of a map
//! whose values cannot be read, swapping a link's program (LINK_UPDATE),
//! a program attached to a sockhash that outlives the daemon, and one
//! test run of a program; plus pinning and opening a pin by descriptor,
//! which the cgroup target needs. Programs and maps by id, and the links
//! of the host, come from aya (`loaded_programs`, `MapInfo::from_id`,
//! `loaded_links`). Each is a thin, safe wrapper around
//! one syscall with a `#[repr(C)]` attribute struct of the kernel's stable
//! ABI; the kernel accepts an attribute shorter than its own and zeroes the
//! rest.

use std::{
    io,
    mem::size_of,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
};

use aya_obj::generated::{bpf_attach_type, bpf_cmd, bpf_map_type};

/// `bpf_link_info::type` of a cgroup link.
pub const LINK_TYPE_CGROUP: u32 = 3;

/// Runs one bpf(2) command on an attribute struct.
fn bpf<T>(command: bpf_cmd, attr: &mut T) -> io::Result<i64> {
    // SAFETY: `attr` is a repr(C) struct of the layout `command` expects,
    // valid for reads and writes of its size for the whole call.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command as libc::c_int,
            (attr as *mut T).cast::<libc::c_void>(),
            size_of::<T>() as libc::c_uint,
        )
    };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(result)
}

/// `bpf_attr` of BPF_MAP_CREATE, up to `max_entries`.
#[repr(C)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
}

/// Creates, then closes, a one-entry array map: whether bpf(2) itself gets
/// through. A seccomp filter or a security module can refuse it (EPERM) to
/// a process that holds CAP_BPF, and the kernel's feature probes would then
/// read as an old kernel.
pub fn try_map_create() -> io::Result<()> {
    let mut attr = MapCreateAttr {
        map_type: bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
        key_size: 4,
        value_size: 4,
        max_entries: 1,
    };
    let fd = bpf(bpf_cmd::BPF_MAP_CREATE, &mut attr)?;
    drop(owned_fd(fd));
    Ok(())
}

/// `bpf_attr` of BPF_PROG_LOAD, up to `expected_attach_type`.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// Loads a program from raw instructions (`insn`), GPL, without a name:
/// for probes and tests that need no object file.
pub fn load_program(
    prog_type: u32,
    expected_attach_type: u32,
    program: &[u64],
) -> io::Result<OwnedFd> {
    let license = c"GPL";
    let mut attr = ProgLoadAttr {
        prog_type,
        insn_cnt: program.len() as u32,
        insns: program.as_ptr() as u64,
        license: license.as_ptr() as u64,
        expected_attach_type,
        ..ProgLoadAttr::default()
    };
    bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr).map(owned_fd)
}

/// One BPF instruction: opcode, registers (dst in the low nibble), offset,
/// immediate.
pub const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    code as u64
        | ((dst | src << 4) as u64) << 8
        | (off as u16 as u64) << 16
        | (imm as u32 as u64) << 32
}

/// Loads, then closes, a socket filter that compare-and-exchanges a word
/// of its stack (BPF_CMPXCHG, Linux 5.12): whether the verifier and the
/// JIT take the instruction the array layout of the socket table needs.
///
/// Only a refusal says no: EINVAL from the verifier, or ENOTSUPP/EOPNOTSUPP
/// from a JIT without it. Any other error (out of memory, a signal) says
/// nothing of the instruction, and counts as yes: the object's own load
/// then fails with a clear error if the kernel cannot load anything, where
/// taking it for no would refuse to start over an install of the array.
pub fn compare_exchange_supported() -> bool {
    /// The kernel's internal ENOTSUPP, which bpf() can return.
    const ENOTSUPP: i32 = 524;
    const BPF_PROG_TYPE_SOCKET_FILTER: u32 = 1;
    let program = [
        insn(0xb7, 0, 0, 0, 0),      // r0 = 0
        insn(0x7a, 10, 0, -8, 0),    // *(u64 *)(r10 - 8) = 0
        insn(0xb7, 1, 0, 0, 1),      // r1 = 1
        insn(0xdb, 10, 1, -8, 0xf1), // r0 = cmpxchg(r10 - 8, r0, r1)
        insn(0xb7, 0, 0, 0, 0),      // r0 = 0
        insn(0x95, 0, 0, 0, 0),      // exit
    ];
    match load_program(BPF_PROG_TYPE_SOCKET_FILTER, 0, &program) {
        Ok(_) => true,
        Err(error) => !matches!(
            error.raw_os_error(),
            Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)
        ),
    }
}

fn owned_fd(raw: i64) -> OwnedFd {
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    unsafe { OwnedFd::from_raw_fd(raw as i32) }
}

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

fn object_info<T>(fd: BorrowedFd<'_>, info: &mut T) -> io::Result<()> {
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of::<T>() as u32,
        info: (info as *mut T) as u64,
    };
    bpf(bpf_cmd::BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(drop)
}

/// The head of `struct bpf_link_info` and its cgroup member.
#[repr(C)]
#[derive(Default)]
struct RawLinkInfo {
    link_type: u32,
    id: u32,
    prog_id: u32,
    _pad: u32,
    cgroup_id: u64,
    attach_type: u32,
    _pad2: u32,
}

/// What the kernel says of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkInfo {
    pub id: u32,
    pub prog_id: u32,
    /// `LINK_TYPE_CGROUP` for the links socklb makes.
    pub link_type: u32,
    /// The cgroup a cgroup link attaches to; 0 once it was detached or its
    /// cgroup was removed (a defunct link).
    pub cgroup_id: u64,
    pub attach_type: u32,
}

pub fn link_info(fd: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    let mut raw = RawLinkInfo::default();
    object_info(fd, &mut raw)?;
    let cgroup = raw.link_type == LINK_TYPE_CGROUP;
    Ok(LinkInfo {
        id: raw.id,
        prog_id: raw.prog_id,
        link_type: raw.link_type,
        cgroup_id: if cgroup { raw.cgroup_id } else { 0 },
        attach_type: if cgroup { raw.attach_type } else { 0 },
    })
}

#[repr(C)]
struct IdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

fn fd_by_id(command: bpf_cmd, id: u32) -> io::Result<OwnedFd> {
    let mut attr = IdAttr {
        id,
        next_id: 0,
        open_flags: 0,
    };
    bpf(command, &mut attr).map(owned_fd)
}

pub fn link_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    fd_by_id(bpf_cmd::BPF_LINK_GET_FD_BY_ID, id)
}

#[repr(C)]
struct QueryAttr {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
}

/// The programs attached directly to a cgroup for one hook, or to a
/// sockmap or sockhash (Linux 5.19).
pub fn attached_programs(
    target: BorrowedFd<'_>,
    attach_type: bpf_attach_type,
) -> io::Result<Vec<u32>> {
    // Room for far more programs than any host attaches to one hook.
    let mut ids = vec![0u32; 256];
    let mut attr = QueryAttr {
        target_fd: target.as_raw_fd() as u32,
        attach_type: attach_type as u32,
        query_flags: 0,
        attach_flags: 0,
        prog_ids: ids.as_mut_ptr() as u64,
        prog_cnt: ids.len() as u32,
        _pad: 0,
    };
    bpf(bpf_cmd::BPF_PROG_QUERY, &mut attr)?;
    ids.truncate(attr.prog_cnt.min(ids.len() as u32) as usize);
    Ok(ids)
}

/// The sk_msg programs attached to a sockmap or sockhash (Linux 5.19).
pub fn sk_msg_programs(map: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    attached_programs(map, bpf_attach_type::BPF_SK_MSG_VERDICT)
}

#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Reads up to `limit` entries of a map with BPF_MAP_LOOKUP_BATCH, in a few
/// syscalls rather than two per entry. The batch cursor is a u32 for both
/// kinds used here: for an array it is the index before the next one (so
/// `after` starts the read past an index), for a hash map a bucket number.
/// Keys and values are plain data (`aya::Pod`).
pub fn lookup_batch<K: aya::Pod + Default, V: aya::Pod + Default>(
    map: BorrowedFd<'_>,
    after: Option<u32>,
    limit: usize,
) -> io::Result<Vec<(K, V)>> {
    const CHUNK: usize = 1024;
    let mut entries: Vec<(K, V)> = Vec::new();
    let mut cursor: Option<u32> = after;
    let mut out_batch: u32 = 0;
    while entries.len() < limit {
        let want = CHUNK.min(limit - entries.len());
        let mut keys = vec![K::default(); want];
        let mut values = vec![V::default(); want];
        let mut attr = BatchAttr {
            in_batch: cursor
                .as_ref()
                .map_or(0, |token| (token as *const u32) as u64),
            out_batch: (&mut out_batch as *mut u32) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: want as u32,
            map_fd: map.as_raw_fd() as u32,
            elem_flags: 0,
            flags: 0,
        };
        let result = bpf(bpf_cmd::BPF_MAP_LOOKUP_BATCH, &mut attr);
        let got = (attr.count as usize).min(want);
        entries.extend(keys.into_iter().zip(values).take(got));
        match result {
            Ok(_) if got > 0 => cursor = Some(out_batch),
            Ok(_) => return Ok(entries),
            // ENOENT: the end of the map was reached (with `got` entries).
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => return Ok(entries),
            Err(error) => return Err(error),
        }
    }
    Ok(entries)
}

#[repr(C)]
struct PinAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// Pins a map, program or link at `path` (BPF_OBJ_PIN).
pub fn pin(fd: BorrowedFd<'_>, path: &std::path::Path) -> io::Result<()> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    let mut attr = PinAttr {
        pathname: c_path.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        file_flags: 0,
    };
    bpf(bpf_cmd::BPF_OBJ_PIN, &mut attr).map(drop)
}

/// Opens what is pinned at `path` (BPF_OBJ_GET).
pub fn open_pinned(path: &std::path::Path) -> io::Result<OwnedFd> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    let mut attr = PinAttr {
        pathname: c_path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    bpf(bpf_cmd::BPF_OBJ_GET, &mut attr).map(owned_fd)
}

/// Whether `error` says this process ran out of something (descriptors,
/// memory) rather than anything about the object it asked for: a pin that
/// cannot be opened for such a reason was not checked, and is neither
/// missing nor replaced.
pub fn out_of_resources(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(
            libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOBUFS | libc::EINTR | libc::EAGAIN
        )
    )
}

/// The head of `struct bpf_map_info`.
#[repr(C)]
#[derive(Default)]
struct RawMapInfo {
    map_type: u32,
    id: u32,
}

/// The kernel's id of a map.
pub fn map_id(fd: BorrowedFd<'_>) -> io::Result<u32> {
    let mut raw = RawMapInfo::default();
    object_info(fd, &mut raw)?;
    Ok(raw.id)
}

#[repr(C)]
struct NextKeyAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    next_key: u64,
}

/// Up to `limit` keys of a map (BPF_MAP_GET_NEXT_KEY), for maps whose
/// values cannot be read from user space, such as a sockhash's.
pub fn map_keys<K: aya::Pod + Default>(fd: BorrowedFd<'_>, limit: usize) -> io::Result<Vec<K>> {
    let mut keys: Vec<K> = Vec::new();
    let mut next = K::default();
    for _ in 0..limit {
        let mut attr = NextKeyAttr {
            map_fd: fd.as_raw_fd() as u32,
            _pad: 0,
            // No key (0) asks for the first one.
            key: keys
                .last()
                .map_or(0, |last| std::ptr::from_ref(last) as u64),
            next_key: std::ptr::from_mut(&mut next) as u64,
        };
        match bpf(bpf_cmd::BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => keys.push(next),
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => break,
            Err(error) => return Err(error),
        }
    }
    Ok(keys)
}

#[repr(C)]
struct ProgAttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
}

/// Attaches a program to a sockmap or sockhash (BPF_PROG_ATTACH), in place
/// of the one there: the map holds it, for as long as the map lives.
pub fn attach_to_map(
    map: BorrowedFd<'_>,
    program: BorrowedFd<'_>,
    attach_type: bpf_attach_type,
) -> io::Result<()> {
    let mut attr = ProgAttachAttr {
        target_fd: map.as_raw_fd() as u32,
        attach_bpf_fd: program.as_raw_fd() as u32,
        attach_type: attach_type as u32,
        attach_flags: 0,
    };
    bpf(bpf_cmd::BPF_PROG_ATTACH, &mut attr).map(drop)
}

#[repr(C)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

/// Swaps the program a link runs, atomically (BPF_LINK_UPDATE): every
/// connect sees the old program or the new one, never none.
pub fn link_update(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkUpdateAttr {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: program.as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    bpf(bpf_cmd::BPF_LINK_UPDATE, &mut attr).map(drop)
}

#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
}

/// Runs a program once on `data` (BPF_PROG_TEST_RUN) and returns what it
/// returned: how the daemon asks a program of its own for an atomic
/// update of a map the kernel's programs update too.
pub fn prog_test_run(program: BorrowedFd<'_>, data: &[u8]) -> io::Result<u32> {
    let mut attr = TestRunAttr {
        prog_fd: program.as_raw_fd() as u32,
        data_size_in: data.len() as u32,
        data_in: data.as_ptr() as u64,
        repeat: 1,
        ..TestRunAttr::default()
    };
    bpf(bpf_cmd::BPF_PROG_TEST_RUN, &mut attr)?;
    Ok(attr.retval)
}

#[cfg(test)]
mod tests {
    use super::insn;

    #[test]
    fn instructions_encode_as_the_kernel_reads_them() {
        // *(u64 *)(r10 - 8) = 0, and r0 = cmpxchg(r10 - 8, r0, r1): the
        // bytes `llvm-objdump` shows for them.
        assert_eq!(
            insn(0x7a, 10, 0, -8, 0).to_le_bytes(),
            [0x7a, 0x0a, 0xf8, 0xff, 0, 0, 0, 0]
        );
        assert_eq!(
            insn(0xdb, 10, 1, -8, 0xf1).to_le_bytes(),
            [0xdb, 0x1a, 0xf8, 0xff, 0xf1, 0, 0, 0]
        );
    }
}
