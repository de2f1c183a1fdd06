//! The server's directory: a CA made once and reused, a server certificate
//! issued on every start, the client certificate, and the kubeconfig.

use std::{
    io::Write,
    net::{IpAddr, SocketAddr},
    os::unix::fs::OpenOptionsExt,
    path::Path,
    sync::Arc,
};

use anyhow::{Context, Result};
use rustls::{RootCertStore, ServerConfig, server::WebPkiClientVerifier};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use socklb_tests::kube::files;

/// Writes a file whole or not at all: a reader never sees half of it.
pub fn write_atomically(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    let name = path
        .file_name()
        .and_then(|name| name.to_str())
        .context("a file name")?;
    let temporary = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&temporary)
        .with_context(|| format!("creating {}", temporary.display()))?;
    file.write_all(contents)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, path).with_context(|| format!("renaming to {}", path.display()))
}

pub const PUBLIC: u32 = 0o644;
pub const SECRET: u32 = 0o600;

/// The CA (made once, then reused from DIR), a server certificate it
/// issues on every start, and the client certificate of the kubeconfig.
pub fn prepare_pki(dir: &Path, server_names: &[String]) -> Result<Arc<ServerConfig>> {
    let ca_path = dir.join(files::CA);
    let ca_key_path = dir.join(files::CA_KEY);
    let reuse_ca = ca_path.exists() && ca_key_path.exists();
    let ca_key = if reuse_ca {
        let pem = std::fs::read_to_string(&ca_key_path)
            .with_context(|| format!("reading {}", ca_key_path.display()))?;
        rcgen::KeyPair::from_pem(&pem).with_context(|| format!("{}", ca_key_path.display()))?
    } else {
        rcgen::KeyPair::generate()?
    };
    // Only the name and the key of an issuer go into what it signs, so the
    // CA rebuilt from its key signs what ca.pem verifies.
    let ca = ca_params().self_signed(&ca_key)?;
    if !reuse_ca {
        write_atomically(&ca_key_path, ca_key.serialize_pem().as_bytes(), SECRET)?;
        write_atomically(&ca_path, ca.pem().as_bytes(), PUBLIC)?;
    }
    let ca_der = CertificateDer::from_pem_file(&ca_path)
        .with_context(|| format!("reading {}", ca_path.display()))?;

    let client_cert = dir.join(files::CLIENT_CERT);
    let client_key = dir.join(files::CLIENT_KEY);
    if !reuse_ca || !client_cert.exists() || !client_key.exists() {
        let key = rcgen::KeyPair::generate()?;
        let certificate = client_params()?.signed_by(&key, &ca, &ca_key)?;
        write_atomically(&client_key, key.serialize_pem().as_bytes(), SECRET)?;
        write_atomically(&client_cert, certificate.pem().as_bytes(), PUBLIC)?;
    }

    let server_key = rcgen::KeyPair::generate()?;
    let server_cert = server_params(server_names)?.signed_by(&server_key, &ca, &ca_key)?;
    write_atomically(
        &dir.join(files::SERVER_KEY),
        server_key.serialize_pem().as_bytes(),
        SECRET,
    )?;
    write_atomically(
        &dir.join(files::SERVER_CERT),
        server_cert.pem().as_bytes(),
        PUBLIC,
    )?;

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    roots.add(ca_der)?;
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
            .build()?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![server_cert.der().clone()],
            PrivateKeyDer::try_from(server_key.serialize_der()).map_err(anyhow::Error::msg)?,
        )?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

pub fn ca_params() -> rcgen::CertificateParams {
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "socklb-test-kubernetes-ca");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    params
}

pub fn leaf_params(
    names: &[String],
    usage: rcgen::ExtendedKeyUsagePurpose,
) -> Result<rcgen::CertificateParams> {
    let mut params = rcgen::CertificateParams::new(names.to_vec())?;
    params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![usage];
    // OpenSSL's strict verification (Python 3.13's default) wants it.
    params.use_authority_key_identifier_extension = true;
    Ok(params)
}

pub fn server_params(names: &[String]) -> Result<rcgen::CertificateParams> {
    let mut params = leaf_params(names, rcgen::ExtendedKeyUsagePurpose::ServerAuth)?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "kube-apiserver");
    Ok(params)
}

pub fn client_params() -> Result<rcgen::CertificateParams> {
    let mut params = leaf_params(&[], rcgen::ExtendedKeyUsagePurpose::ClientAuth)?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "system:node:test");
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, "system:nodes");
    Ok(params)
}

/// Names in the server certificate: loopback, the listening address, and
/// the host of the kubeconfig's server URL.
pub fn server_names(listen: SocketAddr, server_url: &str) -> Vec<String> {
    let mut names: Vec<String> = ["127.0.0.1", "::1", "localhost"]
        .iter()
        .map(ToString::to_string)
        .collect();
    let url_host = server_url
        .split_once("://")
        .map_or(server_url, |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or_default();
    let url_host = match url_host.strip_prefix('[') {
        Some(bracketed) => bracketed.split(']').next().unwrap_or_default(),
        None => url_host.split(':').next().unwrap_or_default(),
    };
    for name in [listen.ip().to_string(), url_host.to_string()] {
        let unspecified = name.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified());
        if !name.is_empty() && !unspecified && !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// A kubeconfig like a kubelet's: one cluster, one user with a client
/// certificate, one context. Strings are written as JSON strings, which
/// YAML reads as they are.
pub fn kubeconfig(server_url: &str, dir: &Path) -> String {
    let quoted = |text: &str| serde_json::to_string(text).expect("a string");
    let path = |name: &str| quoted(&dir.join(name).display().to_string());
    format!(
        "apiVersion: v1\n\
         kind: Config\n\
         clusters:\n\
         - name: socklb-test\n  \
           cluster:\n    \
             server: {server}\n    \
             certificate-authority: {ca}\n\
         users:\n\
         - name: {user}\n  \
           user:\n    \
             client-certificate: {cert}\n    \
             client-key: {key}\n\
         contexts:\n\
         - name: socklb-test\n  \
           context:\n    \
             cluster: socklb-test\n    \
             user: {user}\n\
         current-context: socklb-test\n\
         preferences: {{}}\n",
        server = quoted(server_url),
        ca = path(files::CA),
        user = quoted("system:node:test"),
        cert = path(files::CLIENT_CERT),
        key = path(files::CLIENT_KEY),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_certificate_names_the_kubeconfig_host() {
        let listen: SocketAddr = "127.0.0.5:6443".parse().unwrap();
        assert_eq!(
            server_names(listen, "https://[::1]:6444"),
            ["127.0.0.1", "::1", "localhost", "127.0.0.5"]
        );
        assert_eq!(
            server_names("0.0.0.0:1".parse().unwrap(), "https://api.test:6443/x"),
            ["127.0.0.1", "::1", "localhost", "api.test"]
        );
    }
}
