//! Probe kinds: what one health check of one backend does.
//!
//! Health means the application answers, not only that TCP accepts: a
//! server that completes the handshake and then hangs fails every probe
//! except `tcp`, because the whole probe (connect, TLS, request, status
//! line) must finish within the timeout.
//!
//! [`ProbeSpec`] is the configuration, plain data; [`Prober`] is the same
//! thing made ready to run (certificates read, TLS configured). Building a
//! `Prober` is also how validation checks the files.

use std::{fmt, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use http_body_util::Empty;
use hyper::{Request, body::Bytes, header};
use hyper_util::rt::TokioIo;
use rustls::{
    ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::CryptoProvider,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject};
use tokio::{io::AsyncRead, io::AsyncWrite, net::TcpStream, time};
use tokio_rustls::TlsConnector;

/// TLS settings of a `tls` or `https` probe.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsOptions {
    /// CA bundle (PEM) that the server's chain must lead to. Without it the
    /// chain is not verified: the probe checks that the server completes a
    /// handshake, as HAProxy's `check-ssl verify none` does.
    pub ca: Option<PathBuf>,
    /// Client certificate chain (PEM), for servers that demand one.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub key: Option<PathBuf>,
    /// Name to verify the certificate against (with `ca`); by default the
    /// backend's IP address, which apiserver certificates carry as a SAN.
    pub server_name: Option<String>,
}

/// How a backend is checked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ProbeSpec {
    /// A TCP connect that completes.
    #[default]
    Tcp,
    /// A TLS handshake that completes.
    Tls(TlsOptions),
    /// `GET path` answered with one of `statuses`; over TLS when `tls` is set.
    Http {
        path: String,
        statuses: Vec<u16>,
        host: Option<String>,
        tls: Option<TlsOptions>,
    },
}

impl ProbeSpec {
    /// Short form for logs and check-config: `tcp`, `tls`, `https GET /readyz → 200`.
    pub fn describe(&self) -> String {
        match self {
            Self::Tcp => "tcp connect".into(),
            Self::Tls(_) => "tls handshake".into(),
            Self::Http {
                path,
                statuses,
                tls,
                ..
            } => {
                let scheme = if tls.is_some() { "https" } else { "http" };
                let statuses: Vec<String> = statuses.iter().map(ToString::to_string).collect();
                format!("{scheme} GET {path} → {}", statuses.join(","))
            }
        }
    }
}

/// Why a probe failed, in words an operator reads in the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeFailure {
    Refused,
    TimedOut(Duration),
    Unreachable,
    Tls(String),
    Status { path: String, status: u16 },
    Other(String),
}

impl fmt::Display for ProbeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused => write!(f, "connect refused"),
            Self::TimedOut(after) => write!(f, "no answer within {after:?}"),
            Self::Unreachable => write!(f, "unreachable"),
            Self::Tls(message) => write!(f, "TLS: {message}"),
            Self::Status { path, status } => write!(f, "GET {path} answered {status}"),
            Self::Other(message) => write!(f, "{message}"),
        }
    }
}

/// A probe setting that cannot be used; `field` is the setting's name
/// (`ca`, `cert`, `key`, `server-name`).
#[derive(Debug, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct ProbeSetupError {
    pub field: &'static str,
    pub problem: String,
}

fn setup_error(field: &'static str, problem: impl ToString) -> ProbeSetupError {
    ProbeSetupError {
        field,
        problem: problem.to_string(),
    }
}

/// TLS made ready: the client configuration and the name to present.
#[derive(Clone)]
struct PreparedTls {
    connector: TlsConnector,
    server_name: Option<ServerName<'static>>,
}

/// A probe ready to run.
#[derive(Clone)]
pub struct Prober {
    spec: ProbeSpec,
    tls: Option<PreparedTls>,
}

impl fmt::Debug for Prober {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prober").field("spec", &self.spec).finish()
    }
}

impl Prober {
    /// Reads the certificates and builds the TLS client, or says which
    /// setting is wrong.
    pub fn new(spec: &ProbeSpec) -> Result<Self, ProbeSetupError> {
        let tls_options = match spec {
            ProbeSpec::Tcp => None,
            ProbeSpec::Tls(options) => Some(options),
            ProbeSpec::Http { tls, .. } => tls.as_ref(),
        };
        let tls = tls_options.map(prepare_tls).transpose()?;
        Ok(Self {
            spec: spec.clone(),
            tls,
        })
    }

    /// What a passing probe is called in a transition message.
    pub fn success_words(&self) -> String {
        match &self.spec {
            ProbeSpec::Tcp => "connect ok".into(),
            ProbeSpec::Tls(_) => "TLS handshake ok".into(),
            ProbeSpec::Http { path, .. } => format!("GET {path} ok"),
        }
    }

    /// Runs one probe; all of it must finish within `timeout`.
    pub async fn probe(&self, addr: SocketAddr, timeout: Duration) -> Result<(), ProbeFailure> {
        time::timeout(timeout, self.probe_unbounded(addr))
            .await
            .unwrap_or(Err(ProbeFailure::TimedOut(timeout)))
    }

    async fn probe_unbounded(&self, addr: SocketAddr) -> Result<(), ProbeFailure> {
        let stream = TcpStream::connect(addr).await.map_err(connect_failure)?;
        let _ = stream.set_nodelay(true);
        match (&self.spec, &self.tls) {
            (ProbeSpec::Tcp, _) => Ok(()),
            (ProbeSpec::Tls(_), Some(tls)) => tls_handshake(tls, addr, stream).await.map(drop),
            (
                ProbeSpec::Http {
                    path,
                    statuses,
                    host,
                    ..
                },
                Some(tls),
            ) => {
                let stream = tls_handshake(tls, addr, stream).await?;
                http_get(stream, addr, path, statuses, host.as_deref()).await
            }
            (
                ProbeSpec::Http {
                    path,
                    statuses,
                    host,
                    ..
                },
                None,
            ) => http_get(stream, addr, path, statuses, host.as_deref()).await,
            (ProbeSpec::Tls(_), None) => {
                Err(ProbeFailure::Other("TLS probe without TLS settings".into()))
            }
        }
    }
}

fn connect_failure(error: std::io::Error) -> ProbeFailure {
    match error.kind() {
        std::io::ErrorKind::ConnectionRefused => ProbeFailure::Refused,
        std::io::ErrorKind::NetworkUnreachable | std::io::ErrorKind::HostUnreachable => {
            ProbeFailure::Unreachable
        }
        _ => ProbeFailure::Other(error.to_string()),
    }
}

async fn tls_handshake(
    tls: &PreparedTls,
    addr: SocketAddr,
    stream: TcpStream,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, ProbeFailure> {
    let name = tls
        .server_name
        .clone()
        .unwrap_or_else(|| ServerName::IpAddress(addr.ip().into()));
    tls.connector
        .connect(name, stream)
        .await
        .map_err(|error| ProbeFailure::Tls(error.to_string()))
}

async fn http_get<S>(
    stream: S,
    addr: SocketAddr,
    path: &str,
    statuses: &[u16],
    host: Option<&str>,
) -> Result<(), ProbeFailure>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|error| ProbeFailure::Other(format!("HTTP: {error}")))?;
    let host = host.map_or_else(|| addr.to_string(), str::to_string);
    let request = Request::get(path)
        .header(header::HOST, host)
        .header(header::USER_AGENT, "socklb-probe")
        .body(Empty::<Bytes>::new())
        .map_err(|error| ProbeFailure::Other(format!("HTTP request: {error}")))?;
    // Drive the connection and the request together; both end when this
    // function returns, so a hung server leaves no task behind.
    let mut connection = std::pin::pin!(connection);
    let mut answer = std::pin::pin!(sender.send_request(request));
    let response = tokio::select! {
        response = &mut answer => response,
        closed = &mut connection => match closed {
            // A server that answers and closes at once ends the connection
            // first; the answer has been read by then.
            Ok(()) => answer.await,
            Err(error) => return Err(ProbeFailure::Other(format!("HTTP: {error}"))),
        },
    };
    let status = response
        .map_err(|error| ProbeFailure::Other(format!("HTTP: {error}")))?
        .status()
        .as_u16();
    if statuses.contains(&status) {
        Ok(())
    } else {
        Err(ProbeFailure::Status {
            path: path.to_string(),
            status,
        })
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn prepare_tls(options: &TlsOptions) -> Result<PreparedTls, ProbeSetupError> {
    let config = client_config(options)?;
    let server_name = options
        .server_name
        .as_deref()
        .map(|name| {
            ServerName::try_from(name.to_string())
                .map_err(|error| setup_error("server-name", format!("{name:?}: {error}")))
        })
        .transpose()?;
    Ok(PreparedTls {
        connector: TlsConnector::from(config),
        server_name,
    })
}

/// The TLS client configuration of a probe: the CA to verify against (or
/// none), and the client certificate. Also used by the test agents.
pub fn client_config(options: &TlsOptions) -> Result<Arc<ClientConfig>, ProbeSetupError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|error| setup_error("tls", error))?;
    let builder = match &options.ca {
        Some(ca) => {
            check_pem_file("ca", ca)?;
            let mut roots = RootCertStore::empty();
            let certificates = CertificateDer::pem_file_iter(ca)
                .map_err(|error| setup_error("ca", format!("{}: {error}", ca.display())))?;
            for certificate in certificates {
                let certificate = certificate
                    .map_err(|error| setup_error("ca", format!("{}: {error}", ca.display())))?;
                roots
                    .add(certificate)
                    .map_err(|error| setup_error("ca", format!("{}: {error}", ca.display())))?;
            }
            if roots.is_empty() {
                return Err(setup_error(
                    "ca",
                    format!("{}: no certificate in the file", ca.display()),
                ));
            }
            builder.with_root_certificates(roots)
        }
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyServerCertificate { provider })),
    };
    let config = match (&options.cert, &options.key) {
        (None, None) => builder.with_no_client_auth(),
        (Some(cert), Some(key)) => {
            check_pem_file("cert", cert)?;
            check_pem_file("key", key)?;
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                .and_then(|items| items.collect::<Result<_, _>>())
                .map_err(|error| setup_error("cert", format!("{}: {error}", cert.display())))?;
            if chain.is_empty() {
                return Err(setup_error(
                    "cert",
                    format!("{}: no certificate in the file", cert.display()),
                ));
            }
            let private_key = PrivateKeyDer::from_pem_file(key)
                .map_err(|error| setup_error("key", format!("{}: {error}", key.display())))?;
            builder
                .with_client_auth_cert(chain, private_key)
                .map_err(|error| setup_error("key", format!("{}: {error}", key.display())))?
        }
        (Some(_), None) => return Err(setup_error("key", "a client certificate needs its key")),
        (None, Some(_)) => return Err(setup_error("cert", "a client key needs its certificate")),
    };
    Ok(Arc::new(config))
}

/// Largest certificate or key file socklb reads: a CA bundle of a few
/// hundred certificates fits with room to spare.
const MAX_PEM_FILE_BYTES: u64 = 4 << 20;

/// Refuses, before reading, what is not a regular file of a sane size: a
/// path such as /dev/zero would otherwise be read forever.
fn check_pem_file(field: &'static str, path: &std::path::Path) -> Result<(), ProbeSetupError> {
    let metadata = std::fs::metadata(path)
        .map_err(|error| setup_error(field, format!("{}: {error}", path.display())))?;
    if !metadata.is_file() {
        return Err(setup_error(
            field,
            format!("{}: not a regular file", path.display()),
        ));
    }
    if metadata.len() > MAX_PEM_FILE_BYTES {
        return Err(setup_error(
            field,
            format!(
                "{}: {} bytes; a PEM file here may hold at most {MAX_PEM_FILE_BYTES}",
                path.display(),
                metadata.len()
            ),
        ));
    }
    Ok(())
}

/// Accepts any server certificate but still checks the handshake
/// signatures, so the peer must hold the key of the certificate it shows.
#[derive(Debug)]
struct AnyServerCertificate {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for AnyServerCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use rustls::ServerConfig;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };
    use tokio_rustls::TlsAcceptor;

    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    /// A CA and a server certificate for 127.0.0.1 signed by it, as PEM files.
    struct TestPki {
        dir: PathBuf,
        server: ServerConfig,
        /// The same server, demanding a client certificate from the CA.
        server_with_client_auth: ServerConfig,
    }

    impl TestPki {
        fn new(label: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("socklb-probe-{label}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let ca_key = rcgen::KeyPair::generate().unwrap();
            let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let ca = ca_params.self_signed(&ca_key).unwrap();
            let leaf_key = rcgen::KeyPair::generate().unwrap();
            let leaf_params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
            let leaf = leaf_params.signed_by(&leaf_key, &ca, &ca_key).unwrap();
            let write = |name: &str, text: String| {
                let mut file = std::fs::File::create(dir.join(name)).unwrap();
                file.write_all(text.as_bytes()).unwrap();
            };
            write("ca.pem", ca.pem());
            write("other-ca.pem", {
                let other_key = rcgen::KeyPair::generate().unwrap();
                let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
                params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
                params.self_signed(&other_key).unwrap().pem()
            });
            let client_key = rcgen::KeyPair::generate().unwrap();
            let client = rcgen::CertificateParams::new(vec!["agent".to_string()])
                .unwrap()
                .signed_by(&client_key, &ca, &ca_key)
                .unwrap();
            write("client.pem", client.pem());
            write("client-key.pem", client_key.serialize_pem());
            let builder = ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .unwrap();
            let chain = vec![leaf.der().clone()];
            let key = || PrivateKeyDer::try_from(leaf_key.serialize_der()).unwrap();
            let server = builder
                .clone()
                .with_no_client_auth()
                .with_single_cert(chain.clone(), key())
                .unwrap();
            let mut roots = RootCertStore::empty();
            roots.add(ca.der().clone()).unwrap();
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider(),
            )
            .build()
            .unwrap();
            let server_with_client_auth = builder
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain, key())
                .unwrap();
            Self {
                dir,
                server,
                server_with_client_auth,
            }
        }

        fn path(&self, name: &str) -> Option<PathBuf> {
            Some(self.dir.join(name))
        }
    }

    impl Drop for TestPki {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// An HTTPS server on loopback: `/readyz` answers 200, `/hang` never
    /// answers, anything else 500.
    async fn https_server(config: ServerConfig) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(config));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let mut buffer = vec![0u8; 4096];
                    let Ok(read) = tls.read(&mut buffer).await else {
                        return;
                    };
                    let request = String::from_utf8_lossy(&buffer[..read]).to_string();
                    if request.starts_with("GET /hang ") {
                        time::sleep(Duration::from_secs(30)).await;
                        return;
                    }
                    let status = if request.starts_with("GET /readyz ") {
                        "200 OK"
                    } else {
                        "500 Oops"
                    };
                    let answer = format!(
                        "HTTP/1.1 {status}\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                    );
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        addr
    }

    /// Accepts TCP and then never says anything: the rke2 failure.
    async fn silent_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        addr
    }

    fn https(path: &str, statuses: &[u16], tls: TlsOptions) -> Prober {
        Prober::new(&ProbeSpec::Http {
            path: path.into(),
            statuses: statuses.to_vec(),
            host: None,
            tls: Some(tls),
        })
        .unwrap()
    }

    #[tokio::test]
    async fn tcp_probe_outcomes() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = listener.local_addr().unwrap();
        let tcp = Prober::new(&ProbeSpec::Tcp).unwrap();
        assert_eq!(tcp.probe(open, SECOND).await, Ok(()));
        drop(listener);
        assert_eq!(tcp.probe(open, SECOND).await, Err(ProbeFailure::Refused));
    }

    #[tokio::test]
    async fn a_server_that_accepts_and_hangs_fails_every_probe_but_tcp() {
        let addr = silent_server().await;
        let timeout = Duration::from_millis(300);
        assert_eq!(
            Prober::new(&ProbeSpec::Tcp)
                .unwrap()
                .probe(addr, timeout)
                .await,
            Ok(())
        );
        let tls = Prober::new(&ProbeSpec::Tls(TlsOptions::default())).unwrap();
        assert_eq!(
            tls.probe(addr, timeout).await,
            Err(ProbeFailure::TimedOut(timeout))
        );
        let plain_http = Prober::new(&ProbeSpec::Http {
            path: "/readyz".into(),
            statuses: vec![200],
            host: None,
            tls: None,
        })
        .unwrap();
        let started = std::time::Instant::now();
        assert_eq!(
            plain_http.probe(addr, timeout).await,
            Err(ProbeFailure::TimedOut(timeout))
        );
        assert!(
            started.elapsed() < timeout + Duration::from_millis(200),
            "bounded by the timeout"
        );
    }

    #[tokio::test]
    async fn https_probe_checks_status_chain_and_answer_time() {
        let pki = TestPki::new("https");
        let addr = https_server(pki.server.clone()).await;
        let verified = TlsOptions {
            ca: pki.path("ca.pem"),
            ..TlsOptions::default()
        };
        assert_eq!(
            https("/readyz", &[200], verified.clone())
                .probe(addr, SECOND)
                .await,
            Ok(())
        );
        assert_eq!(
            https("/livez", &[200, 401], verified.clone())
                .probe(addr, SECOND)
                .await,
            Err(ProbeFailure::Status {
                path: "/livez".into(),
                status: 500
            })
        );
        assert_eq!(
            https("/livez", &[500], verified.clone())
                .probe(addr, SECOND)
                .await,
            Ok(())
        );
        let timeout = Duration::from_millis(300);
        assert_eq!(
            https("/hang", &[200], verified).probe(addr, timeout).await,
            Err(ProbeFailure::TimedOut(timeout))
        );
        // Without a CA the chain is not checked; with the wrong one it fails.
        assert_eq!(
            https("/readyz", &[200], TlsOptions::default())
                .probe(addr, SECOND)
                .await,
            Ok(())
        );
        let wrong = TlsOptions {
            ca: pki.path("other-ca.pem"),
            ..TlsOptions::default()
        };
        assert!(matches!(
            https("/readyz", &[200], wrong).probe(addr, SECOND).await,
            Err(ProbeFailure::Tls(_))
        ));
        let wrong_name = TlsOptions {
            ca: pki.path("ca.pem"),
            server_name: Some("apiserver.example".into()),
            ..TlsOptions::default()
        };
        assert!(matches!(
            https("/readyz", &[200], wrong_name)
                .probe(addr, SECOND)
                .await,
            Err(ProbeFailure::Tls(_))
        ));
    }

    #[tokio::test]
    async fn a_client_certificate_is_presented_when_configured() {
        let pki = TestPki::new("client-auth");
        let addr = https_server(pki.server_with_client_auth.clone()).await;
        let without = TlsOptions {
            ca: pki.path("ca.pem"),
            ..TlsOptions::default()
        };
        assert!(
            https("/readyz", &[200], without)
                .probe(addr, SECOND)
                .await
                .is_err(),
            "a server that demands a client certificate refuses the probe without one"
        );
        let with = TlsOptions {
            ca: pki.path("ca.pem"),
            cert: pki.path("client.pem"),
            key: pki.path("client-key.pem"),
            ..TlsOptions::default()
        };
        assert_eq!(
            https("/readyz", &[200], with).probe(addr, SECOND).await,
            Ok(())
        );
    }

    #[test]
    fn setup_errors_name_the_setting() {
        let cases = [
            (
                TlsOptions {
                    ca: Some("/nonexistent/ca.pem".into()),
                    ..TlsOptions::default()
                },
                "ca",
            ),
            (
                TlsOptions {
                    cert: Some("/nonexistent/cert.pem".into()),
                    ..TlsOptions::default()
                },
                "key",
            ),
            (
                TlsOptions {
                    cert: Some("/nonexistent/cert.pem".into()),
                    key: Some("/nonexistent/key.pem".into()),
                    ..TlsOptions::default()
                },
                "cert",
            ),
            (
                TlsOptions {
                    server_name: Some("not a name!".into()),
                    ..TlsOptions::default()
                },
                "server-name",
            ),
        ];
        for (options, field) in cases {
            let error = Prober::new(&ProbeSpec::Tls(options.clone())).unwrap_err();
            assert_eq!(error.field, field, "{options:?}: {error}");
        }
    }
}
