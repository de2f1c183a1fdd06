//! A node's surroundings for the tests that run socklb the way it ships
//! (tests/tests/container.rs, systemd.rs): apiservers on loopback aliases,
//! and an agent that dials the VIP every few milliseconds until the test
//! has seen what it came for.

use std::{
    io::BufRead,
    net::{SocketAddr, TcpListener, TcpStream},
    path::Path,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::cluster::{AgentRequest, helper_bin};

/// A `testapiserver` on a loopback alias (TLS, `/readyz` answers 200 with
/// `x-server: NAME`), killed by its PID on drop.
pub struct LoopbackApiserver {
    pub name: String,
    pub addr: SocketAddr,
    process: Child,
}

impl LoopbackApiserver {
    /// Listens on `ip` and a port that was free a moment ago.
    pub fn start(name: &str, ip: &str) -> Self {
        let port = TcpListener::bind((ip, 0))
            .and_then(|listener| listener.local_addr())
            .unwrap_or_else(|error| panic!("a free port on {ip}: {error}"))
            .port();
        let addr: SocketAddr = format!("{ip}:{port}").parse().expect("an address");
        let process = Command::new(helper_bin("testapiserver"))
            .args(["--listen", &addr.to_string(), "--name", name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("starting testapiserver: {error}"));
        let server = Self {
            name: name.to_string(),
            addr,
            process,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(Instant::now() < deadline, "{name} did not listen on {addr}");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }
}

impl Drop for LoopbackApiserver {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// A `testagent` in a cgroup making one HTTPS request on a new connection
/// every `interval`, with no retry, until [`DialingAgent::stop`]: every
/// request it completed, each failed connect included.
pub struct DialingAgent {
    process: Child,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
    started: Instant,
}

impl DialingAgent {
    pub fn start(vip: SocketAddr, cgroup: &Path, interval: Duration) -> Self {
        let mut process = Command::new(helper_bin("testagent"))
            .args(["--addr", &vip.to_string(), "--cgroup"])
            .arg(cgroup)
            .args([
                "--path",
                "/readyz",
                "--retries",
                "0",
                "--timeout-ms",
                "2000",
            ])
            // The agent's own bound: 100,000 requests.
            .args(["--requests", "100000"])
            .args(["--interval-ms", &interval.as_millis().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("starting testagent: {error}"));
        let stdout = process.stdout.take().expect("stdout");
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = Arc::clone(&lines);
        // Each request is one line, written and flushed when it ends.
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                sink.lock().expect("the agent's lines").push(line);
            }
        });
        Self {
            process,
            lines,
            reader: Some(reader),
            started: Instant::now(),
        }
    }

    /// Requests completed so far.
    pub fn completed(&self) -> usize {
        self.lines.lock().expect("the agent's lines").len()
    }

    /// Waits until `more` requests beyond the current count complete: the
    /// agent has dialed through whatever just happened.
    pub fn wait_for_more(&self, more: usize, limit: Duration) {
        let target = self.completed() + more;
        let deadline = Instant::now() + limit;
        while self.completed() < target {
            assert!(
                Instant::now() < deadline,
                "the agent completed {} of {target} requests within {limit:?}",
                self.completed()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops the agent (by its PID) and returns every request it completed,
    /// and for how long it dialed.
    pub fn stop(mut self) -> (Vec<AgentRequest>, Duration) {
        let _ = self.process.kill();
        let _ = self.process.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let lines = std::mem::take(&mut *self.lines.lock().expect("the agent's lines"));
        let requests = lines
            .iter()
            .map(|line| {
                serde_json::from_str(line).unwrap_or_else(|error| panic!("{line:?}: {error}"))
            })
            .collect();
        (requests, self.started.elapsed())
    }
}

impl Drop for DialingAgent {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// The failed requests among `requests`, with their errors, for a message.
pub fn failures(requests: &[AgentRequest]) -> Vec<String> {
    requests
        .iter()
        .filter(|request| !request.ok)
        .map(|request| request.errors.join("; "))
        .collect()
}
