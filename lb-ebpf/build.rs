//! Rebuild the object when bpf-linker changes: cargo cannot know this
//! dependency otherwise (aya-template does the same).

fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
