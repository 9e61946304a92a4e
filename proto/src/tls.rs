//! TLS for every gRPC and HTTP listener and client (rustls with the ring provider), as an option:
//! services take `--tls-cert PATH --tls-key PATH` (PEM), clients `--tls-ca PATH` (the PEM
//! certificates they trust) or the environment variable `COTRAIN_TLS_CA`. One cluster certificate can
//! serve every host: clients then check it against `--tls-domain NAME` (`COTRAIN_TLS_DOMAIN`) instead
//! of the host they dial.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The environment variable naming the CA file clients trust.
pub const CA_ENV: &str = "COTRAIN_TLS_CA";
/// The environment variable naming the server name clients check certificates against.
pub const DOMAIN_ENV: &str = "COTRAIN_TLS_DOMAIN";

/// A service's certificate chain and key.
#[derive(Clone)]
pub struct ServerTls {
    cert_pem: Arc<[u8]>,
    key_pem: Arc<[u8]>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls(<key redacted>)")
    }
}

impl ServerTls {
    /// Reads and checks a PEM certificate chain and its PEM private key.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, String> {
        let cert_pem =
            std::fs::read(cert).map_err(|e| format!("--tls-cert {}: {e}", cert.display()))?;
        let key_pem =
            std::fs::read(key).map_err(|e| format!("--tls-key {}: {e}", key.display()))?;
        let tls = Self {
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
        };
        tls.rustls_config(&[]).map_err(|e| {
            format!(
                "--tls-cert {} / --tls-key {}: {e}",
                cert.display(),
                key.display()
            )
        })?;
        Ok(tls)
    }

    /// Both flags or neither.
    pub fn from_flags(cert: Option<&Path>, key: Option<&Path>) -> Result<Option<Self>, String> {
        match (cert, key) {
            (Some(c), Some(k)) => Self::from_files(c, k).map(Some),
            (None, None) => Ok(None),
            _ => Err("--tls-cert and --tls-key go together".into()),
        }
    }

    /// For tonic's gRPC server.
    pub fn tonic(&self) -> tonic::transport::ServerTlsConfig {
        tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(
            &*self.cert_pem,
            &*self.key_pem,
        ))
    }

    fn rustls_config(&self, alpn: &[&[u8]]) -> Result<rustls::ServerConfig, String> {
        let certs = CertificateDer::pem_slice_iter(&self.cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("certificate: {e}"))?;
        if certs.is_empty() {
            return Err("no certificate in the PEM file".into());
        }
        let key = PrivateKeyDer::from_pem_slice(&self.key_pem)
            .map_err(|e| format!("private key: {e}"))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| e.to_string())?;
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(cfg)
    }

    /// A listener for `axum::serve` whose connections speak TLS (ALPN: HTTP/2 and HTTP/1.1).
    pub fn listener(&self, tcp: tokio::net::TcpListener) -> Result<TlsListener, String> {
        let cfg = self.rustls_config(&[b"h2", b"http/1.1"])?;
        TlsListener::new(
            tcp,
            tokio_rustls::TlsAcceptor::from(Arc::new(cfg)),
            MAX_HANDSHAKES,
        )
        .map_err(|e| e.to_string())
    }
}

/// TLS handshakes a listener runs at once. Connections beyond it wait in the kernel's accept
/// queue: a flood of connections that never finish a handshake holds at most this many tasks
/// (each for at most [`HANDSHAKE_TIMEOUT`]), not one per connection.
pub const MAX_HANDSHAKES: usize = 256;

/// How long one TLS handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The certificates a client trusts, and the name it checks them against.
#[derive(Clone, Debug)]
pub struct ClientTls {
    ca_pem: Arc<[u8]>,
    domain: Option<String>,
}

impl ClientTls {
    /// From `--tls-ca` if given, else `COTRAIN_TLS_CA`; the domain from `--tls-domain` or
    /// `COTRAIN_TLS_DOMAIN`. None: plain connections.
    pub fn from_flag_or_env(
        ca: Option<&Path>,
        domain: Option<&str>,
    ) -> Result<Option<Self>, String> {
        let ca = match ca {
            Some(p) => Some(p.to_path_buf()),
            None => std::env::var_os(CA_ENV)
                .filter(|v| !v.is_empty())
                .map(Into::into),
        };
        let Some(ca) = ca else { return Ok(None) };
        let ca_pem =
            std::fs::read(&ca).map_err(|e| format!("TLS CA file {}: {e}", ca.display()))?;
        let n = CertificateDer::pem_slice_iter(&ca_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("TLS CA file {}: {e}", ca.display()))?
            .len();
        if n == 0 {
            return Err(format!(
                "TLS CA file {}: no certificate in it",
                ca.display()
            ));
        }
        let domain = domain
            .map(str::to_string)
            .or_else(|| std::env::var(DOMAIN_ENV).ok().filter(|d| !d.is_empty()));
        Ok(Some(Self {
            ca_pem: ca_pem.into(),
            domain,
        }))
    }

    /// For tonic's channels.
    pub fn tonic(&self) -> tonic::transport::ClientTlsConfig {
        let cfg = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&*self.ca_pem));
        match &self.domain {
            Some(d) => cfg.domain_name(d.clone()),
            None => cfg,
        }
    }

    /// `http://host:port` or `host:port` as the `https://` URL this client dials.
    pub fn url(address: &str) -> String {
        let rest = address.split_once("://").map_or(address, |(_, r)| r);
        format!("https://{rest}")
    }
}

/// An endpoint for `address`: `https` with `tls`, as given otherwise (`http://` added to a bare
/// `host:port`).
pub fn endpoint(
    address: &str,
    tls: Option<&ClientTls>,
) -> Result<tonic::transport::Endpoint, String> {
    let url = match tls {
        Some(_) => ClientTls::url(address),
        None if address.contains("://") => address.to_string(),
        None => format!("http://{address}"),
    };
    let ep = tonic::transport::Endpoint::from_shared(url.clone())
        .map_err(|e| format!("endpoint `{url}`: {e}"))?;
    match tls {
        Some(t) => ep
            .tls_config(t.tonic())
            .map_err(|e| format!("endpoint `{url}`: TLS: {e}")),
        None => Ok(ep),
    }
}

/// See [`ServerTls::listener`]. Handshakes run concurrently, at most [`MAX_HANDSHAKES`] at once:
/// one that fails or takes more than [`HANDSHAKE_TIMEOUT`] drops that connection only.
pub struct TlsListener {
    local: std::net::SocketAddr,
    ready: tokio::sync::mpsc::Receiver<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        std::net::SocketAddr,
    )>,
    accepting: tokio::task::JoinHandle<()>,
    handshakes: Arc<tokio::sync::Semaphore>,
    limit: usize,
}

impl TlsListener {
    fn new(
        tcp: tokio::net::TcpListener,
        acceptor: tokio_rustls::TlsAcceptor,
        limit: usize,
    ) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let (tx, ready) = tokio::sync::mpsc::channel(64);
        let handshakes = Arc::new(tokio::sync::Semaphore::new(limit));
        let permits = handshakes.clone();
        let accepting = tokio::spawn(async move {
            loop {
                let (stream, addr) = match tcp.accept().await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // At the limit, this one connection waits here and the rest in the kernel's queue.
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let handshake =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                    drop(permit);
                    match handshake {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, addr)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%addr, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%addr, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self {
            local,
            ready,
            accepting,
            handshakes,
            limit,
        })
    }

    /// Handshakes under way now.
    pub fn handshaking(&self) -> usize {
        self.limit - self.handshakes.available_permits()
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accepting task only ends when dropped with the listener.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate for 127.0.0.1, made with the `openssl` command.
    fn server_tls(dir: &Path) -> ServerTls {
        let out = std::process::Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
            ])
            .args([
                "-keyout",
                "k.pem",
                "-out",
                "c.pem",
                "-days",
                "1",
                "-subj",
                "/CN=t",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
            ])
            .current_dir(dir)
            .output()
            .expect("the openssl command (apt-get install openssl)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        ServerTls::from_files(&dir.join("c.pem"), &dir.join("k.pem")).unwrap()
    }

    async fn until(what: &str, mut cond: impl FnMut() -> bool) {
        let start = std::time::Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "timed out waiting until {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn connections_that_never_handshake_hold_at_most_the_limit() {
        let dir = std::env::temp_dir().join(format!("tls-limit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = server_tls(&dir).rustls_config(&[b"h2"]).unwrap();
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let listener =
            TlsListener::new(tcp, tokio_rustls::TlsAcceptor::from(Arc::new(cfg)), 2).unwrap();
        let mut idle = Vec::new();
        for _ in 0..6 {
            idle.push(
                tokio::net::TcpStream::connect(listener.local)
                    .await
                    .unwrap(),
            );
        }
        until("two handshakes are under way", || {
            listener.handshaking() == 2
        })
        .await;
        // The other four wait in the accept queue; nothing more is started for them meanwhile.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(listener.handshaking(), 2);
        // Closed connections end their handshakes and let the queued ones in, until none is left.
        idle.clear();
        until("every handshake ended", || listener.handshaking() == 0).await;
        let _ = std::fs::remove_dir_all(&dir);
    }
}
