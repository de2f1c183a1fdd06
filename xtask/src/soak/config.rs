//! socklb's configuration for the soak, and the edits the nemesis makes
//! to it. Every text written is first parsed by socklb's own parser, so
//! that the harness never mistakes a mistake of its own for a fault.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};

/// The health settings of every service: the detection bounds follow
/// from them.
pub const INTERVAL: Duration = Duration::from_millis(500);
pub const TIMEOUT: Duration = Duration::from_millis(500);
pub const RISE: u32 = 2;
pub const FALL: u32 = 2;

/// The names of the services.
pub const API: &str = "api";
pub const PLAIN: &str = "plain";
pub const ETCD: &str = "etcd";

/// What the configuration is made of.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub api_vip: SocketAddr,
    pub plain_vip: SocketAddr,
    pub etcd_vip: SocketAddr,
    pub plain_backends: Vec<SocketAddr>,
    pub etcd_backends: Vec<SocketAddr>,
    pub state_file: PathBuf,
    pub kubeconfig: PathBuf,
    pub ca: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

/// The parts the nemesis edits (`config-edit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edits {
    /// Weight of the plain service's first backend.
    pub first_weight: u32,
    /// Sockmap acceleration of the plain service.
    pub accelerate: bool,
    /// The api service's rebalance tolerance, in hundredths.
    pub tolerance_percent: u32,
}

impl Default for Edits {
    fn default() -> Self {
        Self {
            first_weight: 1,
            accelerate: false,
            tolerance_percent: 20,
        }
    }
}

impl Edits {
    /// The edit of `config-edit` variant `variant`.
    pub fn edited(self, variant: u32) -> Self {
        match variant % 3 {
            0 => Self {
                first_weight: 3,
                ..self
            },
            1 => Self {
                accelerate: !self.accelerate,
                ..self
            },
            _ => Self {
                tolerance_percent: 35,
                ..self
            },
        }
    }

    pub fn describe(variant: u32) -> &'static str {
        match variant % 3 {
            0 => "the plain service's first backend to weight 3",
            1 => "sockmap acceleration of the plain service toggled",
            _ => "the api service's rebalance tolerance to 0.35",
        }
    }
}

fn list(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(|addr| format!("\"{addr}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

fn health(kind: &str, extra: &str) -> String {
    format!(
        "[service.health]\nkind = \"{kind}\"\ninterval = \"{}ms\"\ntimeout = \"{}ms\"\nrise = {RISE}\nfall = {FALL}\n{extra}",
        INTERVAL.as_millis(),
        TIMEOUT.as_millis(),
    )
}

/// The configuration text.
pub fn render(inputs: &Inputs, edits: Edits) -> String {
    let mut plain = inputs
        .plain_backends
        .iter()
        .map(|addr| format!("\"{addr}\""))
        .collect::<Vec<_>>();
    if let Some(first) = plain.first_mut() {
        *first = format!(
            "\"{},weight={}\"",
            inputs.plain_backends[0], edits.first_weight
        );
    }
    let accelerate = if edits.accelerate {
        "accelerate = \"sockmap\"\n"
    } else {
        ""
    };
    format!(
        r#"# Written by cargo xtask soak.
[[service]]
name = "{API}"
vips = ["{api_vip}"]
policy = "least-conn"
close-on-failure = true
slow-start = "10s"
rebalance = true
rebalance-tolerance = {tolerance}
k3s-state = "{state}"
endpointslices = "default/kubernetes"
kubeconfig = "{kubeconfig}"
{api_health}
[[service]]
name = "{PLAIN}"
vips = ["{plain_vip}"]
policy = "least-conn"
close-on-failure = true
slow-start = "10s"
{accelerate}backends = [{plain}]
{plain_health}
[[service]]
name = "{ETCD}"
vips = ["{etcd_vip}"]
close-on-failure = true
backends = [{etcd}]
{etcd_health}"#,
        api_vip = inputs.api_vip,
        tolerance = f64::from(edits.tolerance_percent) / 100.0,
        state = inputs.state_file.display(),
        kubeconfig = inputs.kubeconfig.display(),
        api_health = health("apiserver", &format!("ca = \"{}\"\n", inputs.ca.display())),
        plain_vip = inputs.plain_vip,
        plain = plain.join(", "),
        plain_health = health("http:/readyz", ""),
        etcd_vip = inputs.etcd_vip,
        etcd = list(&inputs.etcd_backends),
        etcd_health = health(
            "etcd",
            &format!(
                "ca = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\n",
                inputs.ca.display(),
                inputs.client_cert.display(),
                inputs.client_key.display()
            )
        ),
    )
}

/// A configuration socklb must refuse: a weight out of range.
pub fn invalid(inputs: &Inputs) -> String {
    render(inputs, Edits::default()).replace(",weight=1\"", ",weight=0\"")
}

/// Checks a text with socklb's own parser.
pub fn check(text: &str) -> Result<socklb::config::Config> {
    socklb::config::parse_toml(text).map_err(|error| anyhow::anyhow!("{error}"))
}

/// Writes the configuration the way config management does (a temporary
/// file renamed over it), after checking it parses as `valid` says.
pub fn write(path: &Path, text: &str, valid: bool) -> Result<()> {
    match (check(text), valid) {
        (Ok(_), true) | (Err(_), false) => {}
        (Ok(_), false) => bail!("the harness's invalid configuration parses"),
        (Err(error), true) => bail!("the harness's configuration is invalid: {error}\n{text}"),
    }
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, text).with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, path).with_context(|| format!("renaming to {}", path.display()))
}
