//! Fresh certificates for one test cluster: a CA, the API server's serving certificate, an
//! admin client certificate (group `system:masters`), the service-account signing key and a
//! serving certificate for webhooks on loopback (LeaderWorkerSet's).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::Error;

/// Paths of the PEM files written by [`generate`].
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// The cluster CA certificate (trusts the serving and client certificates).
    pub ca_cert: PathBuf,
    /// The CA private key (for the controller-manager's CSR signer).
    pub ca_key: PathBuf,
    /// The API server's serving certificate (SANs: localhost, 127.0.0.1, the service IP).
    pub server_cert: PathBuf,
    /// The API server's serving key.
    pub server_key: PathBuf,
    /// The admin client certificate (CN `ferrite-admin`, O `system:masters`).
    pub admin_cert: PathBuf,
    /// The admin client key.
    pub admin_key: PathBuf,
    /// Service-account token signing key (private, PKCS#8).
    pub sa_key: PathBuf,
    /// Service-account token verification key (public, PKIX).
    pub sa_pub: PathBuf,
    /// Folder with `tls.crt` and `tls.key`: a serving certificate for 127.0.0.1 signed by
    /// the CA, for webhook servers the API server calls on loopback.
    pub webhook_dir: PathBuf,
}

fn cert_err(what: &str, e: rcgen::Error) -> Error {
    Error::Certificates(format!("{what}: {e}"))
}

fn write(path: &Path, contents: &str) -> Result<(), Error> {
    std::fs::write(path, contents).map_err(|e| Error::io(path, e))
}

/// Generates every key and certificate a cluster needs into `dir`.
pub fn generate(dir: &Path) -> Result<CertFiles, Error> {
    let files = CertFiles {
        ca_cert: dir.join("ca.crt"),
        ca_key: dir.join("ca.key"),
        server_cert: dir.join("apiserver.crt"),
        server_key: dir.join("apiserver.key"),
        admin_cert: dir.join("admin.crt"),
        admin_key: dir.join("admin.key"),
        sa_key: dir.join("sa.key"),
        sa_pub: dir.join("sa.pub"),
        webhook_dir: dir.join("webhook-certs"),
    };

    let ca_key = KeyPair::generate().map_err(|e| cert_err("CA key", e))?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(|e| cert_err("CA", e))?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "ferrite-testcluster-ca");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca
        .self_signed(&ca_key)
        .map_err(|e| cert_err("CA certificate", e))?;
    write(&files.ca_cert, &ca_cert.pem())?;
    write(&files.ca_key, &ca_key.serialize_pem())?;
    let issuer = Issuer::new(ca, ca_key);

    let server_key = KeyPair::generate().map_err(|e| cert_err("server key", e))?;
    let sans = [
        "localhost",
        "127.0.0.1",
        "10.0.0.1",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ];
    let mut server = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .map_err(|e| cert_err("server", e))?;
    server
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_cert = server
        .signed_by(&server_key, &issuer)
        .map_err(|e| cert_err("server certificate", e))?;
    write(&files.server_cert, &server_cert.pem())?;
    write(&files.server_key, &server_key.serialize_pem())?;

    let admin_key = KeyPair::generate().map_err(|e| cert_err("admin key", e))?;
    let mut admin =
        CertificateParams::new(Vec::<String>::new()).map_err(|e| cert_err("admin", e))?;
    admin
        .distinguished_name
        .push(DnType::CommonName, "ferrite-admin");
    admin
        .distinguished_name
        .push(DnType::OrganizationName, "system:masters");
    admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let admin_cert = admin
        .signed_by(&admin_key, &issuer)
        .map_err(|e| cert_err("admin certificate", e))?;
    write(&files.admin_cert, &admin_cert.pem())?;
    write(&files.admin_key, &admin_key.serialize_pem())?;

    let sa_key = KeyPair::generate().map_err(|e| cert_err("service-account key", e))?;
    write(&files.sa_key, &sa_key.serialize_pem())?;
    write(&files.sa_pub, &sa_key.public_key_pem())?;

    let hook_key = KeyPair::generate().map_err(|e| cert_err("webhook key", e))?;
    let mut hook = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()])
        .map_err(|e| cert_err("webhook", e))?;
    hook.distinguished_name
        .push(DnType::CommonName, "ferrite-testcluster-webhooks");
    hook.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let hook_cert = hook
        .signed_by(&hook_key, &issuer)
        .map_err(|e| cert_err("webhook certificate", e))?;
    std::fs::create_dir_all(&files.webhook_dir).map_err(|e| Error::io(&files.webhook_dir, e))?;
    write(&files.webhook_dir.join("tls.crt"), &hook_cert.pem())?;
    write(
        &files.webhook_dir.join("tls.key"),
        &hook_key.serialize_pem(),
    )?;
    Ok(files)
}
