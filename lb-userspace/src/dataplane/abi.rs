//! The kernel ABI, checked by a machine: the embedded eBPF object must
//! define every map and program that `lb_common::names` names, each map
//! with the key and value sizes `lb_common` gives it, and every shared
//! struct in its BTF with exactly the fields and offsets `lb_common`
//! asserts. Runs without privileges, on the object this binary embeds.

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, io::Write};

    use lb_common::{LAYOUTS, MAP_SIZES, names};

    use crate::dataplane::object::EBPF_OBJECT;

    /// The structs of a raw BTF blob: name → (size, [(field, byte offset)]).
    type Structs = BTreeMap<String, (u32, Vec<(String, u32)>)>;

    fn word(bytes: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
    }

    fn string(strings: &[u8], offset: u32) -> String {
        let rest = &strings[offset as usize..];
        let end = rest
            .iter()
            .position(|&byte| byte == 0)
            .unwrap_or(rest.len());
        String::from_utf8_lossy(&rest[..end]).into_owned()
    }

    /// Walks the type section of a BTF blob (linux/btf.h) for its structs.
    fn btf_structs(btf: &[u8]) -> Structs {
        assert_eq!(u16::from_le_bytes([btf[0], btf[1]]), 0xeb9f, "BTF magic");
        let header_len = word(btf, 4) as usize;
        let (type_off, type_len) = (word(btf, 8) as usize, word(btf, 12) as usize);
        let (str_off, str_len) = (word(btf, 16) as usize, word(btf, 20) as usize);
        let types = &btf[header_len + type_off..header_len + type_off + type_len];
        let strings = &btf[header_len + str_off..header_len + str_off + str_len];
        let mut structs = Structs::new();
        let mut at = 0;
        while at < types.len() {
            let (name_off, info, size) =
                (word(types, at), word(types, at + 4), word(types, at + 8));
            let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            at += 12;
            let trailing = match kind {
                1 | 14 | 17 => 4,
                3 => 12,
                4 | 5 | 15 | 19 => 12 * vlen,
                6 | 13 => 8 * vlen,
                _ => 0,
            };
            if kind == 4 {
                let members = (0..vlen)
                    .map(|index| {
                        let member = at + 12 * index;
                        let bits = word(types, member + 8) & 0x00ff_ffff;
                        (string(strings, word(types, member)), bits / 8)
                    })
                    .collect();
                structs.insert(string(strings, name_off), (size, members));
            }
            at += trailing;
        }
        structs
    }

    /// The embedded object, or `None` (after one line saying what is
    /// missing) when this build embeds the empty placeholder: a build
    /// without the eBPF toolchain (`cargo xtask check` on a fresh machine).
    /// Under `cargo xtask test` (SOCKLB_TESTS_NO_SKIP) that is a failure.
    fn object(test: &str) -> Option<aya_obj::Object> {
        if EBPF_OBJECT.is_empty() {
            let missing = "this build embeds the empty placeholder, not the eBPF object \
                 (built with AYA_BUILD_SKIP=1 or without the `ebpf` feature); \
                 `cargo xtask build-ebpf` installs nightly, rust-src and bpf-linker and builds it";
            assert!(
                std::env::var_os("SOCKLB_TESTS_NO_SKIP").is_none(),
                "{test}: {missing}"
            );
            // Past the test harness's capture, so that it shows.
            let _ = writeln!(std::io::stderr(), "skipped abi::{test}: {missing}");
            return None;
        }
        Some(aya_obj::Object::parse(EBPF_OBJECT).expect("the embedded object parses"))
    }

    #[test]
    fn every_named_map_and_program_exists_with_its_sizes() {
        let Some(object) = object("every_named_map_and_program_exists_with_its_sizes") else {
            return;
        };
        for name in names::MAPS.iter().chain([
            &names::SOCKET_SLOTS,
            &names::LEGACY_REDIRECTS,
            &names::SOCKETS,
        ]) {
            assert!(
                object.maps.contains_key(*name),
                "map {name} is in the object"
            );
        }
        for (name, key, value) in MAP_SIZES {
            let map = &object.maps[name];
            assert_eq!(
                (map.key_size() as usize, map.value_size() as usize),
                (key, value),
                "{name}: key and value sizes"
            );
        }
        for program in names::PROGRAMS.into_iter().chain(names::UNATTACHED) {
            assert!(
                object.programs.contains_key(program),
                "program {program} is in the object"
            );
        }
    }

    #[test]
    fn the_hash_layout_has_the_same_programs_and_maps_but_the_array() {
        let Some(array) = object("the_hash_layout_has_the_same_programs_and_maps_but_the_array")
        else {
            return;
        };
        let hash = aya_obj::Object::parse(crate::dataplane::object::EBPF_HASH_OBJECT)
            .expect("the hash layout's object parses");
        let mut programs: Vec<&String> = array.programs.keys().collect();
        let mut hash_programs: Vec<&String> = hash.programs.keys().collect();
        programs.sort();
        hash_programs.sort();
        assert_eq!(programs, hash_programs);
        let mut maps: Vec<&String> = array
            .maps
            .keys()
            .filter(|name| *name != names::SOCKET_SLOTS)
            .collect();
        let mut hash_maps: Vec<&String> = hash.maps.keys().collect();
        maps.sort();
        hash_maps.sort();
        assert_eq!(maps, hash_maps);
        // BPF_F_MMAPABLE: the daemon maps the array.
        assert_eq!(array.maps[names::SOCKET_SLOTS].map_flags(), 1 << 10);
    }

    #[test]
    fn every_shared_struct_has_its_fields_at_their_offsets_in_the_btf() {
        let Some(object) = object("every_shared_struct_has_its_fields_at_their_offsets_in_the_btf")
        else {
            return;
        };
        let btf = object
            .btf
            .as_ref()
            .expect("the object carries BTF")
            .to_bytes();
        let structs = btf_structs(&btf);
        for layout in LAYOUTS {
            let (size, members) = structs
                .get(layout.name)
                .unwrap_or_else(|| panic!("{} is in the BTF", layout.name));
            assert_eq!(*size as usize, layout.size, "{}: size", layout.name);
            let expected: Vec<(String, u32)> = layout
                .fields
                .iter()
                .map(|(field, offset)| ((*field).to_string(), *offset as u32))
                .collect();
            assert_eq!(members, &expected, "{}: fields and offsets", layout.name);
        }
    }
}
