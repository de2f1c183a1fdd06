//! The clients: `soakclient` processes in the clients' cgroup (short
//! connections, keep-alive clients and watchers) and an etcdctl loop, all
//! recorded as they go. Each can be paused for a checkpoint: what is in
//! flight finishes and nothing new starts.

use std::{
    io::{BufRead, BufReader, Write},
    net::SocketAddr,
    process::{Child, ChildStdin, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use socklb_tests::cluster::helper_bin;

use super::{
    record::{Connect, ConnectKind, now_ms},
    world::World,
};

/// The mix of the issue: about 200 new connections a second (a quarter
/// over TLS), 300 long-lived clients in two processes (a third of them
/// watchers), and an etcdctl call every two seconds.
pub const SHORT_RATE: u32 = 200;
pub const SHORT_TLS_PERCENT: u32 = 25;
pub const KEEPALIVE_PROCESSES: u32 = 2;
pub const KEEPALIVE_PER_PROCESS: u32 = 150;
pub const WATCHERS_PER_PROCESS: u32 = 50;
pub const ETCD_EVERY: Duration = Duration::from_secs(2);
/// A client's timeout for a connect, a handshake or an answer.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(3);

/// Everything the clients reported.
#[derive(Debug, Default)]
pub struct Recorded {
    pub connects: Vec<Connect>,
    /// Requests that failed on connections that were open, by kind.
    pub request_failures: Vec<(u64, String, Option<SocketAddr>, String)>,
    /// Connections that ended between requests: (time, kind, why).
    pub ended: Vec<(u64, String, String)>,
    /// Per second: requests answered and failed, over all clients.
    pub seconds: Vec<(u64, u64, u64)>,
    pub skipped: u64,
    /// Lines that did not parse.
    pub garbled: u64,
}

/// One client process with its reader.
struct Client {
    label: String,
    child: Child,
    stdin: Option<ChildStdin>,
    reader: Option<JoinHandle<()>>,
    /// Pause acknowledgements seen.
    paused: Arc<AtomicU64>,
}

impl Drop for Client {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

fn server_index(name: &str) -> Option<u8> {
    name.strip_prefix('s')?.parse().ok()
}

/// Takes one output line of soakclient into the record.
fn take_line(line: &str, recorded: &Mutex<Recorded>, paused: &AtomicU64) {
    let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
        recorded.lock().expect("record").garbled += 1;
        return;
    };
    let text = |key: &str| event[key].as_str().map(str::to_string);
    let t_ms = event["t"].as_u64().unwrap_or(0);
    let dst = || text("dst").and_then(|dst| dst.parse().ok());
    let mut recorded = recorded.lock().expect("record");
    match event["k"].as_str() {
        Some("c") => {
            let error = match (text("stage"), text("err")) {
                (Some(stage), Some(err)) => Some(format!("{stage}: {err}")),
                _ => None,
            };
            recorded.connects.push(Connect {
                t_ms,
                kind: text("kind")
                    .as_deref()
                    .and_then(ConnectKind::parse)
                    .unwrap_or(ConnectKind::Plain),
                dst: dst(),
                ok: event["ok"] == true,
                ms: event["ms"].as_u64().unwrap_or(0) as u32,
                server: text("server").as_deref().and_then(server_index),
                error,
            });
        }
        Some("r") => recorded.request_failures.push((
            t_ms,
            text("kind").unwrap_or_default(),
            dst(),
            text("err").unwrap_or_default(),
        )),
        Some("x") => recorded.ended.push((
            t_ms,
            text("kind").unwrap_or_default(),
            text("why").unwrap_or_default(),
        )),
        Some("s") => {
            recorded.skipped += event["skipped"].as_u64().unwrap_or(0);
            recorded.seconds.push((
                t_ms,
                event["ok"].as_u64().unwrap_or(0),
                event["failed"].as_u64().unwrap_or(0),
            ));
        }
        Some("p") => {
            paused.fetch_add(1, Ordering::SeqCst);
        }
        _ => {}
    }
}

impl Client {
    fn spawn(label: &str, command: &mut Command, recorded: &Arc<Mutex<Recorded>>) -> Result<Self> {
        let mut child = super::world::die_with_parent(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {label}"))?;
        let stdout = child.stdout.take().context("soakclient's stdout")?;
        let paused = Arc::new(AtomicU64::new(0));
        let reader = {
            let (recorded, paused) = (Arc::clone(recorded), Arc::clone(&paused));
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else {
                        return;
                    };
                    take_line(&line, &recorded, &paused);
                }
            })
        };
        Ok(Self {
            label: label.to_string(),
            stdin: child.stdin.take(),
            child,
            reader: Some(reader),
            paused,
        })
    }

    fn say(&mut self, word: &str) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{word}").and_then(|()| stdin.flush());
        }
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

/// The etcdctl loop, in a thread of its own.
struct EtcdLoop {
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    busy: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for EtcdLoop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Every client of the run.
pub struct Load {
    clients: Vec<Client>,
    etcd: EtcdLoop,
    pub recorded: Arc<Mutex<Recorded>>,
}

/// Addresses a connection through a VIP may reach: every server's
/// addresses on the VIP's backend port, and the VIP itself (unredirected).
fn candidates(world: &World) -> String {
    let mut all: Vec<SocketAddr> = Vec::new();
    for addrs in &world.addrs {
        all.push(addrs.tls(false));
        all.push(addrs.tls(true));
        all.push(addrs.plain());
    }
    all.extend([
        world.local_plain,
        world.inputs.api_vip,
        world.inputs.plain_vip,
    ]);
    all.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

impl Load {
    pub fn start(world: &World) -> Result<Self> {
        let recorded = Arc::new(Mutex::new(Recorded::default()));
        let common = |mode: &str| {
            let mut command = Command::new(helper_bin("soakclient"));
            command
                .arg(mode)
                .arg("--cgroup")
                .arg(&world.cgroup.path)
                .args(["--tls-vip", &world.inputs.api_vip.to_string()])
                .arg("--ca")
                .arg(&world.pki.ca)
                .args(["--candidates", &candidates(world)])
                .args(["--timeout-ms", &CLIENT_TIMEOUT.as_millis().to_string()])
                .args(["--max-seconds", "10800"]);
            command
        };
        let mut clients = Vec::new();
        let mut short = common("short");
        short
            .args(["--plain-vip", &world.inputs.plain_vip.to_string()])
            .args(["--rate", &SHORT_RATE.to_string()])
            .args(["--tls-percent", &SHORT_TLS_PERCENT.to_string()]);
        clients.push(Client::spawn("short connections", &mut short, &recorded)?);
        for index in 0..KEEPALIVE_PROCESSES {
            let mut keepalive = common("keepalive");
            keepalive
                .args(["--clients", &KEEPALIVE_PER_PROCESS.to_string()])
                .args(["--watchers", &WATCHERS_PER_PROCESS.to_string()]);
            clients.push(Client::spawn(
                &format!("keep-alive clients {index}"),
                &mut keepalive,
                &recorded,
            )?);
        }
        let etcd = Self::etcd_loop(world, &recorded);
        Ok(Self {
            clients,
            etcd,
            recorded,
        })
    }

    fn etcd_loop(world: &World, recorded: &Arc<Mutex<Recorded>>) -> EtcdLoop {
        let (stop, paused, busy) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let endpoint = format!("https://{}", world.inputs.etcd_vip);
        let (cgroup, etcdctl) = (world.cgroup.path.clone(), world.etcdctl());
        let (stopped, pausing, working, recorded) = (
            Arc::clone(&stop),
            Arc::clone(&paused),
            Arc::clone(&busy),
            Arc::clone(recorded),
        );
        let thread = std::thread::spawn(move || {
            // Bounded by the stop flag, a turn every ETCD_EVERY.
            for turn in 1u64.. {
                std::thread::sleep(ETCD_EVERY);
                if stopped.load(Ordering::SeqCst) {
                    return;
                }
                if pausing.load(Ordering::SeqCst) {
                    continue;
                }
                working.store(true, Ordering::SeqCst);
                let (t_ms, started) = (now_ms(), Instant::now());
                let output = etcdctl.run(
                    &endpoint,
                    Some(&cgroup),
                    &["put", "soak/key", &turn.to_string()],
                );
                let error = match &output {
                    Ok(output) if output.status.success() => None,
                    Ok(output) => Some(
                        String::from_utf8_lossy(&output.stderr)
                            .trim()
                            .chars()
                            .take(300)
                            .collect(),
                    ),
                    Err(error) => Some(format!("running etcdctl (Debian etcd-client): {error}")),
                };
                let connect = Connect {
                    t_ms,
                    kind: ConnectKind::Etcd,
                    dst: None,
                    ok: error.is_none(),
                    ms: started.elapsed().as_millis() as u32,
                    server: None,
                    error,
                };
                recorded.lock().expect("record").connects.push(connect);
                working.store(false, Ordering::SeqCst);
            }
        });
        EtcdLoop {
            stop,
            paused,
            busy,
            thread: Some(thread),
        }
    }

    /// Stops every client from starting anything new, and returns once
    /// what was in flight has finished (false if one did not say so in
    /// time).
    pub fn pause(&mut self) -> bool {
        self.etcd.paused.store(true, Ordering::SeqCst);
        let before: Vec<u64> = self
            .clients
            .iter()
            .map(|client| client.paused.load(Ordering::SeqCst))
            .collect();
        for client in &mut self.clients {
            client.say("pause");
        }
        let limit = CLIENT_TIMEOUT * 3 + Duration::from_secs(2);
        super::world::wait_until(limit, || {
            !self.etcd.busy.load(Ordering::SeqCst)
                && self
                    .clients
                    .iter()
                    .zip(&before)
                    .all(|(client, before)| client.paused.load(Ordering::SeqCst) > *before)
        })
    }

    pub fn resume(&mut self) {
        for client in &mut self.clients {
            client.say("resume");
        }
        self.etcd.paused.store(false, Ordering::SeqCst);
    }

    /// Client processes that exited by themselves (a harness problem).
    pub fn exited(&mut self) -> Vec<String> {
        self.clients
            .iter_mut()
            .filter_map(|client| {
                client
                    .exited()
                    .map(|status| format!("{} exited: {status}", client.label))
            })
            .collect()
    }

    pub fn pids(&self) -> Vec<u32> {
        self.clients
            .iter()
            .map(|client| client.child.id())
            .collect()
    }
}
