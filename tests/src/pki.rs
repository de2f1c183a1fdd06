//! A small PKI for test servers that clients verify: one CA, a server
//! certificate per server (its addresses, and loopback, as a k3s server
//! certificate carries 127.0.0.1 for the agents' local balancer), and one
//! client certificate (etcd's client authentication). Written as PEM
//! files into a directory of the caller's.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

/// The files of one certificate and its key.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The CA's certificate file, and what it issued.
#[derive(Debug, Clone)]
pub struct Pki {
    pub ca: PathBuf,
    pub servers: Vec<Issued>,
    pub client: Issued,
}

fn write(path: &Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    std::io::Write::write_all(&mut file, text.as_bytes())
}

fn leaf(
    names: Vec<String>,
    common_name: &str,
    usages: Vec<rcgen::ExtendedKeyUsagePurpose>,
) -> Result<rcgen::CertificateParams, rcgen::Error> {
    let mut params = rcgen::CertificateParams::new(names)?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::DigitalSignature,
        rcgen::KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = usages;
    params.use_authority_key_identifier_extension = true;
    Ok(params)
}

impl Pki {
    /// A CA, one server certificate for each list of addresses in
    /// `servers` (each also names 127.0.0.1 and `localhost`), and a client
    /// certificate, under `dir`.
    pub fn create(dir: &Path, servers: &[Vec<IpAddr>]) -> Result<Self, Box<dyn std::error::Error>> {
        let ca_key = rcgen::KeyPair::generate()?;
        let mut ca_params = rcgen::CertificateParams::default();
        ca_params.distinguished_name = rcgen::DistinguishedName::new();
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "socklb-soak-ca");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let ca = ca_params.self_signed(&ca_key)?;
        let ca_path = dir.join("ca.pem");
        write(&ca_path, &ca.pem())?;
        let issue = |stem: &str,
                     params: rcgen::CertificateParams|
         -> Result<Issued, Box<dyn std::error::Error>> {
            let key = rcgen::KeyPair::generate()?;
            let cert = params.signed_by(&key, &ca, &ca_key)?;
            let issued = Issued {
                cert: dir.join(format!("{stem}.pem")),
                key: dir.join(format!("{stem}-key.pem")),
            };
            write(&issued.cert, &cert.pem())?;
            write(&issued.key, &key.serialize_pem())?;
            Ok(issued)
        };
        let mut issued = Vec::new();
        for (index, addresses) in servers.iter().enumerate() {
            let mut names: Vec<String> = addresses.iter().map(ToString::to_string).collect();
            names.extend(["127.0.0.1".to_string(), "localhost".to_string()]);
            let params = leaf(
                names,
                &format!("server-{index}"),
                // etcd's gateway dials its own server with this certificate.
                vec![
                    rcgen::ExtendedKeyUsagePurpose::ServerAuth,
                    rcgen::ExtendedKeyUsagePurpose::ClientAuth,
                ],
            )?;
            issued.push(issue(&format!("server-{index}"), params)?);
        }
        let mut client_params = leaf(
            Vec::new(),
            "socklb-soak-client",
            vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
        )?;
        client_params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "socklb");
        let client = issue("client", client_params)?;
        Ok(Self {
            ca: ca_path,
            servers: issued,
            client,
        })
    }
}
