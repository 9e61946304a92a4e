//! This process's security settings, set once by the CLI and read by the services and the control
//! plane: the cluster token, whether unauthenticated non-loopback services are allowed
//! (`--insecure`), and TLS.

static CLUSTER_TOKEN: std::sync::OnceLock<Option<cotrain_proto::auth::ClusterToken>> =
    std::sync::OnceLock::new();

/// Sets the cluster token this process sends with weight updates and requires from its embedded
/// rollout worker's clients (the CLI reads it once from `--cluster-token-file` or
/// `COTRAIN_CLUSTER_TOKEN_FILE`). Later calls are ignored.
pub fn set_cluster_token(token: Option<cotrain_proto::auth::ClusterToken>) {
    let _ = CLUSTER_TOKEN.set(token);
}

/// The cluster token set by [`set_cluster_token`], if any.
pub fn cluster_token() -> Option<cotrain_proto::auth::ClusterToken> {
    CLUSTER_TOKEN.get().cloned().flatten()
}

/// The token this process's embedded worker requires and its pool sends: the cluster token, or
/// without one a random token made once per process, so that no other local process can push
/// weights into the run through the embedded worker's loopback port. Remote workers are sent the
/// cluster token only.
pub fn process_token() -> cotrain_proto::auth::ClusterToken {
    static RANDOM: std::sync::OnceLock<cotrain_proto::auth::ClusterToken> =
        std::sync::OnceLock::new();
    cluster_token().unwrap_or_else(|| {
        RANDOM
            .get_or_init(|| {
                cotrain_proto::auth::ClusterToken::random().expect("the system's random source")
            })
            .clone()
    })
}

static INSECURE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// `--insecure`: allow the control plane on a non-loopback address without a cluster token.
pub fn set_insecure(insecure: bool) {
    let _ = INSECURE.set(insecure);
}

/// Whether [`set_insecure`] allowed unauthenticated non-loopback services.
pub fn insecure() -> bool {
    INSECURE.get().copied().unwrap_or(false)
}

static TLS: std::sync::OnceLock<(
    Option<cotrain_proto::tls::ServerTls>,
    Option<cotrain_proto::tls::ClientTls>,
)> = std::sync::OnceLock::new();

/// Sets this process's TLS: the certificate its control plane serves (`--tls-cert`, `--tls-key`) and
/// the certificates it trusts when it dials remote services (`--tls-ca`, `COTRAIN_TLS_CA`). The
/// embedded services on loopback stay plain. Later calls are ignored.
pub fn set_tls(
    server: Option<cotrain_proto::tls::ServerTls>,
    client: Option<cotrain_proto::tls::ClientTls>,
) {
    let _ = TLS.set((server, client));
}

/// The control plane's certificate, if any.
pub fn server_tls() -> Option<cotrain_proto::tls::ServerTls> {
    TLS.get().and_then(|(s, _)| s.clone())
}

/// What clients of remote services trust, if TLS is on.
pub fn client_tls() -> Option<cotrain_proto::tls::ClientTls> {
    TLS.get().and_then(|(_, c)| c.clone())
}
