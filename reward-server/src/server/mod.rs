//! The gRPC and HTTP front ends of the reward service, started together by [`serve`].
//!
//! Both are thin adapters ([`grpc`], [`http`]) over [`core::RewardApi`]; errors are mapped to
//! gRPC codes and HTTP statuses in one place ([`error`]); [`metrics`] feeds `/metrics`.

pub mod core;
pub mod error;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod once;
pub mod verifier;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use cotrain_proto::reward::reward_server::RewardServer;

use crate::config::ServerConfig;
use crate::sandbox::BwrapSandbox;

/// The addresses actually bound (ports resolved when 0 was asked for).
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
}

/// Sets up the sandbox (refusing to go on if isolation does not work), binds both listeners,
/// reports the bound addresses to `on_bound`, and serves until `shutdown` resolves. In-flight
/// requests then finish; queued sandbox work is refused.
pub async fn serve(
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(Bound),
) -> anyhow::Result<()> {
    let sandbox = BwrapSandbox::start(&cfg.sandbox)
        .await
        .context("sandbox set-up failed")?;
    let grpc_listener = tokio::net::TcpListener::bind(cfg.grpc_addr)
        .await
        .with_context(|| format!("cannot bind the gRPC address {}", cfg.grpc_addr))?;
    let http_listener = tokio::net::TcpListener::bind(cfg.http_addr)
        .await
        .with_context(|| format!("cannot bind the HTTP address {}", cfg.http_addr))?;
    let bound = Bound {
        grpc: grpc_listener.local_addr()?,
        http: http_listener.local_addr()?,
    };

    let metrics = Arc::new(metrics::Metrics::new());
    let mut api = core::RewardApi::new(sandbox.clone(), metrics);
    if let Some(endpoint) = &cfg.verifier_endpoint {
        api.verifier = Some(verifier::VerifierClient::new(endpoint).map_err(anyhow::Error::msg)?);
        tracing::info!(endpoint = %endpoint, "learned verifier forwarded to a rollout worker");
    }
    let api = Arc::new(api);

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<RewardServer<grpc::RewardGrpc>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(cotrain_proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("cannot build the reflection service")?;
    let reward = RewardServer::new(grpc::RewardGrpc::new(api.clone(), cfg.sandbox.queue_limit))
        .max_decoding_message_size(cfg.max_body_bytes)
        .max_encoding_message_size(usize::MAX);
    let mut builder = tonic::transport::Server::builder();
    let (http_plain, http_tls) = match &cfg.tls {
        Some(tls) => {
            builder = builder.tls_config(tls.tonic()).context("gRPC TLS")?;
            (
                None,
                Some(
                    tls.listener(http_listener)
                        .map_err(anyhow::Error::msg)
                        .context("HTTP TLS")?,
                ),
            )
        }
        None => (Some(http_listener), None),
    };
    let grpc_server = builder
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reward)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(grpc_listener),
            stopped(stop_rx.clone()),
        );
    let router = http::router(http::HttpState {
        api: api.clone(),
        max_body_bytes: cfg.max_body_bytes,
    });
    let http_stopped = stopped(stop_rx.clone());
    let http_server = async move {
        match (http_plain, http_tls) {
            (Some(l), _) => {
                axum::serve(l, router)
                    .with_graceful_shutdown(http_stopped)
                    .await
            }
            (None, Some(l)) => {
                axum::serve(l, router)
                    .with_graceful_shutdown(http_stopped)
                    .await
            }
            (None, None) => unreachable!("one HTTP listener"),
        }
    };

    tracing::info!(grpc = %bound.grpc, http = %bound.http, sandboxed = sandbox.is_sandboxed(),
        max_concurrency = sandbox.max_concurrency(), queue_limit = cfg.sandbox.queue_limit, "reward server listening");
    on_bound(bound);

    let signal_task = tokio::spawn({
        let sandbox = sandbox.clone();
        async move {
            shutdown.await;
            tracing::info!("shutting down: finishing in-flight requests");
            sandbox.close();
            let _ = stop_tx.send(true);
        }
    });
    let (g, h) = tokio::join!(grpc_server, http_server);
    signal_task.abort();
    health_reporter
        .set_not_serving::<RewardServer<grpc::RewardGrpc>>()
        .await;
    g.context("gRPC server failed")?;
    h.context("HTTP server failed")?;
    tracing::info!("reward server stopped");
    Ok(())
}
