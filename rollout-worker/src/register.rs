//! `rollout-worker serve --register URL`: the worker offers itself to a learner's control plane,
//! heartbeats while it serves (registering again when the learner forgets it, e.g. after the
//! learner restarted) and deregisters when it stops, after draining its requests.

use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use cotrain_proto::auth::ClusterToken;
use cotrain_proto::control::learner_control_client::LearnerControlClient;
use cotrain_proto::control::{DeregisterRequest, HeartbeatRequest, RegisterRequest};
use cotrain_proto::tls::ClientTls;
use tokio::sync::oneshot;
use tracing::{info, warn};

/// The registration loop of a serving worker.
pub struct Registration {
    url: String,
    address: String,
    token: Option<ClusterToken>,
    tls: Option<ClientTls>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

fn request<M>(m: M, token: Option<&ClusterToken>) -> tonic::Request<M> {
    let mut r = tonic::Request::new(m);
    r.set_timeout(Duration::from_secs(10));
    if let Some(t) = token
        && let Ok(v) = t.bearer().parse()
    {
        r.metadata_mut()
            .insert(cotrain_proto::auth::METADATA_KEY, v);
    }
    r
}

async fn connect(
    url: &str,
    tls: Option<&ClientTls>,
) -> Result<LearnerControlClient<tonic::transport::Channel>, String> {
    let channel = cotrain_proto::tls::endpoint(url, tls)?
        .connect()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    Ok(LearnerControlClient::new(channel))
}

/// The address the learner should dial: `advertise` if given, else the bound gRPC address, with an
/// unspecified IP (0.0.0.0, ::) replaced by this host's address on the route to the learner.
pub fn advertised_address(
    advertise: Option<&str>,
    bound: SocketAddr,
    learner_url: &str,
) -> anyhow::Result<String> {
    if let Some(a) = advertise {
        return Ok(a.to_string());
    }
    if !bound.ip().is_unspecified() {
        return Ok(bound.to_string());
    }
    let host_port = learner_url
        .split_once("://")
        .map_or(learner_url, |(_, r)| r)
        .trim_end_matches('/');
    let learner = host_port
        .to_socket_addrs()
        .map_err(|e| anyhow::anyhow!("--register {learner_url}: cannot resolve {host_port}: {e}"))?
        .next()
        .ok_or_else(|| {
            anyhow::anyhow!("--register {learner_url}: {host_port} resolves to nothing")
        })?;
    // A UDP "connect" sends nothing; it picks the local address routed to the learner.
    let probe = UdpSocket::bind(if learner.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })?;
    probe.connect(learner)?;
    Ok(SocketAddr::new(probe.local_addr()?.ip(), bound.port()).to_string())
}

impl Registration {
    /// Registers `address` (retrying until the learner answers) and heartbeats in the background.
    pub fn start(
        url: &str,
        address: String,
        agents: Vec<String>,
        worker_id: String,
        token: Option<ClusterToken>,
        tls: Option<ClientTls>,
    ) -> Self {
        let url = if url.contains("://") {
            url.to_string()
        } else {
            format!("http://{url}")
        };
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        let (u, a, t, tl) = (url.clone(), address.clone(), token.clone(), tls.clone());
        let task = tokio::spawn(async move {
            let mut interval = Duration::from_secs(2);
            let mut registered = false;
            let mut backoff = Duration::from_millis(500);
            loop {
                let outcome = async {
                    let mut c = connect(&u, tl.as_ref()).await?;
                    if !registered {
                        let req = RegisterRequest {
                            address: a.clone(),
                            agents: agents.clone(),
                            worker_id: worker_id.clone(),
                        };
                        let r = c
                            .register(request(req, t.as_ref()))
                            .await
                            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
                            .into_inner();
                        interval =
                            Duration::from_millis(u64::from(r.heartbeat_interval_ms.max(100)));
                        info!(
                            learner = u,
                            address = a,
                            in_rotation = r.in_rotation,
                            "registered with the learner"
                        );
                        return Ok(true);
                    }
                    let r = c
                        .heartbeat(request(HeartbeatRequest { address: a.clone() }, t.as_ref()))
                        .await
                        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?;
                    Ok::<bool, String>(r.into_inner().known)
                }
                .await;
                let wait = match outcome {
                    Ok(known) => {
                        if registered && !known {
                            warn!(
                                learner = u,
                                "the learner does not know this worker (it restarted or dropped it): registering again"
                            );
                        }
                        registered = known;
                        backoff = Duration::from_millis(500);
                        if known { interval } else { Duration::ZERO }
                    }
                    Err(e) => {
                        warn!(learner = u, error = e, retry_in = ?backoff, "cannot reach the learner's control plane");
                        registered = false;
                        let w = backoff;
                        backoff = (backoff * 2).min(Duration::from_secs(10));
                        w
                    }
                };
                tokio::select! {
                    _ = &mut stop_rx => return,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        });
        Self {
            url,
            address,
            token,
            tls,
            stop: Some(stop_tx),
            task,
        }
    }

    /// Stops heartbeating and deregisters (one attempt; the learner drops silent workers anyway).
    pub async fn deregister(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.task).await;
        let result = async {
            let mut c = connect(&self.url, self.tls.as_ref()).await?;
            c.deregister(request(
                DeregisterRequest {
                    address: self.address.clone(),
                },
                self.token.as_ref(),
            ))
            .await
            .map_err(|s| s.message().to_string())
        }
        .await;
        match result {
            Ok(_) => info!(learner = self.url, "deregistered from the learner"),
            Err(e) => warn!(
                learner = self.url,
                error = e,
                "could not deregister (the learner drops workers that stop heartbeating)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertised_address_replaces_an_unspecified_ip_with_the_route_to_the_learner() {
        let bound: SocketAddr = "0.0.0.0:50061".parse().unwrap();
        assert_eq!(
            advertised_address(None, bound, "http://127.0.0.1:7070").unwrap(),
            "127.0.0.1:50061"
        );
        assert_eq!(
            advertised_address(Some("w0:1"), bound, "http://127.0.0.1:7070").unwrap(),
            "w0:1"
        );
        let lo: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(
            advertised_address(None, lo, "http://10.9.9.9:1").unwrap(),
            "127.0.0.1:9"
        );
    }
}
