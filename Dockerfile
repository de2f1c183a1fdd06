# socklb's container image (deploy/kubernetes/daemonset.yaml runs it).
#   docker build -t ghcr.io/socklb/socklb:0.1.0 .
#
# Stage 1 builds the eBPF object (nightly with rust-src, and bpf-linker
# against the nightly's LLVM, both set up by `cargo xtask build-ebpf`) and
# the release binary. Stage 2 holds only that binary, bpftool (to look at
# the pinned maps on a node) and the shell and mount that the DaemonSet's
# bpffs init container uses.
FROM docker.io/library/rust:1.95-bookworm AS build
RUN rustup toolchain install nightly --profile minimal --component rust-src
WORKDIR /src
COPY . .
RUN cargo xtask build-ebpf \
 && cargo build --release --locked -p lb-userspace --bin socklb \
 && strip target/release/socklb \
 && target/release/socklb --version

FROM docker.io/library/debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends bpftool ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/socklb /usr/local/bin/socklb
# The binary links only libc, libm and libgcc_s (glibc's own); it needs no
# other library, no configuration and no writable root filesystem.
ENTRYPOINT ["/usr/local/bin/socklb"]
CMD ["run", "--config", "/etc/socklb/socklb.toml"]
