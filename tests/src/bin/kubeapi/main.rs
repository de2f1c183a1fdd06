//! A test Kubernetes apiserver: the part of the API that a client of
//! `discovery.k8s.io/v1` EndpointSlices uses (kube-rs's `watcher`, the
//! official Python client), over TLS that requires a client certificate
//! signed by its own CA, as a kubelet's kubeconfig does. Tests drive it
//! through a plain-HTTP admin API on loopback (`socklb_tests::kube`).
//!
//! DIR receives ca.pem, server.pem, client.pem (each with its -key.pem),
//! a kubeconfig, state.json (the slices and the resource version, which a
//! restarted server keeps as one backed by etcd does), and `ready` last,
//! once it listens. A restarted server reuses the CA and the client
//! certificate; it issues a new server certificate from that CA. Its watch
//! history starts empty, so a watch that resumes from an older version
//! gets 410, as after a real apiserver's restart.
//!
//! The API: `/version`, `/api`, `/apis`, `/apis/discovery.k8s.io[/v1]`,
//! and list, watch and get of `endpointslices`, cluster-wide or in a
//! namespace, with label and field selectors, resource versions, bookmarks,
//! `sendInitialEvents` and `timeoutSeconds`.
//!
//! The admin API: `PUT|DELETE /slices/{namespace}/{name}` (the body is a
//! `socklb_tests::kube::SliceSpec`), `POST /compact` (drops the event
//! history), `POST /close-watches`, `PUT /faults` (a
//! `socklb_tests::kube::Faults`: watches that fail, end at once or stream
//! a line that never ends; lists that never end), `GET /stats`.

mod admin;
mod api;
mod fault;
mod pki;
mod selector;
mod store;
mod watch;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result};
use clap::Parser;
use hyper::{server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use socklb_tests::{
    cli::{millis, seconds},
    kube::{Faults, KubeApiStats, files},
};
use tokio::{net::TcpListener, sync::watch as signal};
use tokio_rustls::TlsAcceptor;

use crate::{
    admin::admin,
    api::api,
    pki::{PUBLIC, SECRET, kubeconfig, prepare_pki, server_names, write_atomically},
    store::Store,
};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A test Kubernetes apiserver (see the module documentation).
#[derive(Debug, Parser)]
#[command(name = "kubeapi")]
struct Args {
    /// Where the API listens (TLS).
    #[arg(long)]
    listen: SocketAddr,
    /// The server's directory (PKI, kubeconfig, state, `ready`).
    #[arg(long)]
    dir: PathBuf,
    /// Where the admin API listens (plain HTTP, loopback only).
    #[arg(long, value_parser = loopback_addr)]
    admin: Option<SocketAddr>,
    /// `server:` of the kubeconfig, for a client that reaches the API
    /// through a VIP.
    #[arg(long)]
    kubeconfig_server: Option<String>,
    /// Interval of BOOKMARK events (at least 1 ms).
    #[arg(
        long = "bookmark-interval-ms",
        value_name = "MS",
        default_value = "1000",
        value_parser = millis
    )]
    bookmark_interval: Duration,
    /// The server's bound: an orphan ends by itself.
    #[arg(long = "max-seconds", value_name = "S", default_value = "3600", value_parser = seconds)]
    max_lifetime: Duration,
}

/// `--admin`: the admin API has no authentication, so only loopback.
fn loopback_addr(text: &str) -> Result<SocketAddr, String> {
    let addr: SocketAddr = text
        .parse()
        .map_err(|error| format!("{text}: expected ADDR:PORT ({error})"))?;
    if !addr.ip().is_loopback() {
        return Err(format!(
            "{addr}: the admin API has no authentication, so it listens on loopback only"
        ));
    }
    Ok(addr)
}

#[derive(Default)]
struct Stats {
    lists: AtomicU64,
    watches: AtomicU64,
    watches_open: AtomicU64,
    gone_sent: AtomicU64,
    bookmarks_sent: AtomicU64,
    events_sent: AtomicU64,
    handshake_failures: AtomicU64,
    endless_answers: AtomicU64,
    endless_bytes_sent: AtomicU64,
    failed_watches: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

struct Server {
    store: Mutex<Store>,
    stats: Stats,
    /// The current resource version, to wake watches.
    version_changed: signal::Sender<u64>,
    /// Bumped by the admin API's close-watches.
    close_watches: signal::Sender<u64>,
    bookmark_interval: Duration,
    /// How the server misbehaves (the admin API's `PUT /faults`).
    faults: Mutex<Faults>,
}

impl Server {
    fn faults(&self) -> Faults {
        *self
            .faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn store(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock would be a bug in this file; the
        // store stays consistent between statements, so go on.
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn stats(&self) -> KubeApiStats {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        KubeApiStats {
            lists: read(&self.stats.lists),
            watches: read(&self.stats.watches),
            watches_open: read(&self.stats.watches_open),
            gone_sent: read(&self.stats.gone_sent),
            bookmarks_sent: read(&self.stats.bookmarks_sent),
            events_sent: read(&self.stats.events_sent),
            handshake_failures: read(&self.stats.handshake_failures),
            resource_version: self.store().resource_version,
            endless_answers: read(&self.stats.endless_answers),
            endless_bytes_sent: read(&self.stats.endless_bytes_sent),
            failed_watches: read(&self.stats.failed_watches),
        }
    }
}

async fn serve_api(listener: TcpListener, acceptor: TlsAcceptor, server: Arc<Server>) {
    // Runs for the life of the process (bounded by --max-seconds).
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                eprintln!("kubeapi: accept: {error}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let server = Arc::clone(&server);
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => {
                    bump(&server.stats.handshake_failures);
                    eprintln!("kubeapi: TLS handshake with {peer} failed: {error}");
                    return;
                }
                Err(_) => {
                    bump(&server.stats.handshake_failures);
                    eprintln!("kubeapi: TLS handshake with {peer} timed out");
                    return;
                }
            };
            let service = service_fn(move |request| api(Arc::clone(&server), request));
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .serve_connection(TokioIo::new(tls), service)
                .await;
        });
    }
}

async fn serve_admin(listener: TcpListener, server: Arc<Server>) {
    // Runs for the life of the process (bounded by --max-seconds).
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                eprintln!("kubeapi admin: accept: {error}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let server = Arc::clone(&server);
        tokio::spawn(async move {
            let service = service_fn(move |request| admin(Arc::clone(&server), request));
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn run(args: Args) -> Result<()> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = args
        .dir
        .canonicalize()
        .with_context(|| format!("{}", args.dir.display()))?;
    let ready = dir.join(files::READY);
    let _ = std::fs::remove_file(&ready);

    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let listen = listener.local_addr()?;
    let admin_listener = match args.admin {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("listening on {addr} (admin)"))?,
        ),
        None => None,
    };
    let server_url = args
        .kubeconfig_server
        .clone()
        .unwrap_or_else(|| format!("https://{listen}"));
    let tls = prepare_pki(&dir, &server_names(listen, &server_url))?;
    write_atomically(
        &dir.join(files::KUBECONFIG),
        kubeconfig(&server_url, &dir).as_bytes(),
        SECRET,
    )?;
    let store = Store::load(dir.join(files::STATE))?;
    let version = store.resource_version;
    let server = Arc::new(Server {
        store: Mutex::new(store),
        stats: Stats::default(),
        version_changed: signal::Sender::new(version),
        close_watches: signal::Sender::new(0),
        bookmark_interval: args.bookmark_interval,
        faults: Mutex::new(Faults::default()),
    });
    tokio::spawn(serve_api(
        listener,
        TlsAcceptor::from(tls),
        Arc::clone(&server),
    ));
    let admin_addr = match admin_listener {
        Some(admin_listener) => {
            let addr = admin_listener.local_addr()?;
            tokio::spawn(serve_admin(admin_listener, Arc::clone(&server)));
            addr.to_string()
        }
        None => "none".to_string(),
    };
    write_atomically(&ready, b"", PUBLIC)?;
    eprintln!(
        "kubeapi: serving {server_url} on {listen} (admin {admin_addr}) at resource version {version}"
    );

    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        () = tokio::time::sleep(args.max_lifetime) => {
            eprintln!("kubeapi: exiting after --max-seconds {}", args.max_lifetime.as_secs());
        }
        _ = terminate.recv() => eprintln!("kubeapi: SIGTERM"),
        _ = tokio::signal::ctrl_c() => eprintln!("kubeapi: SIGINT"),
    }
    let _ = std::fs::remove_file(&ready);
    Ok(())
}

fn main() -> std::process::ExitCode {
    let mut args = Args::parse();
    args.bookmark_interval = args.bookmark_interval.max(Duration::from_millis(1));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match runtime.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kubeapi: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
