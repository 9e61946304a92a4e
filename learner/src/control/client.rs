//! `learner status` / `learner control`: a client of another learner's control plane.

use cotrain_proto::auth::ClusterToken;
use cotrain_proto::control::learner_control_client::LearnerControlClient;
use cotrain_proto::control::{CheckpointRequest, StatusRequest, StatusResponse, StopRequest};

/// What to ask.
#[derive(Clone, Copy, Debug)]
pub enum Call {
    Status,
    Checkpoint,
    Stop,
}

/// Calls the control plane at `addr` (`host:port` or `http://host:port`) with the cluster token, if
/// any; returns the status, or a line saying what happened.
pub fn call(
    addr: &str,
    token: Option<&ClusterToken>,
    tls: Option<&cotrain_proto::tls::ClientTls>,
    what: Call,
) -> anyhow::Result<Result<StatusResponse, String>> {
    let endpoint = cotrain_proto::tls::endpoint(addr, tls).map_err(anyhow::Error::msg)?;
    let url = endpoint.uri().to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| anyhow::anyhow!("cannot reach the learner control plane at {url}: {e}"))?;
        let mut client = LearnerControlClient::new(channel);
        fn request<M>(m: M, token: Option<&ClusterToken>) -> tonic::Request<M> {
            let mut r = tonic::Request::new(m);
            if let Some(t) = token
                && let Ok(v) = t.bearer().parse()
            {
                r.metadata_mut()
                    .insert(cotrain_proto::auth::METADATA_KEY, v);
            }
            r
        }
        let failed = |s: tonic::Status| anyhow::anyhow!("{url}: {:?}: {}", s.code(), s.message());
        Ok(match what {
            Call::Status => Ok(client
                .status(request(StatusRequest {}, token))
                .await
                .map_err(failed)?
                .into_inner()),
            Call::Checkpoint => {
                let r = client
                    .checkpoint(request(CheckpointRequest {}, token))
                    .await
                    .map_err(failed)?
                    .into_inner();
                Err(format!("checkpoint of step {} written: {}", r.step, r.path))
            }
            Call::Stop => Err(client
                .stop(request(StopRequest {}, token))
                .await
                .map_err(failed)?
                .into_inner()
                .message),
        })
    })
}

fn duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    format!("{}h{:02}m{:02}s", s / 3600, s / 60 % 60, s % 60)
}

/// The status as an operator reads it.
pub fn format_status(s: &StatusResponse) -> String {
    let mut out = String::new();
    let reward = s.reward.map_or("-".into(), |r| format!("{r:.4}"));
    let eta = s.eta_secs.map_or("-".into(), duration);
    out += &format!("run      {}\nstate    {}\n", s.run_dir, s.state);
    out += &format!(
        "step     {}/{}   epoch {}/{}   reward {reward}   elapsed {}   eta {eta}\n",
        s.step,
        s.total_steps,
        s.epoch,
        s.total_epochs,
        duration(s.elapsed_secs)
    );
    if let Some(c) = s.last_checkpoint_step {
        out += &format!("checkpoint at step {c}\n");
    }
    let versions = |v: &[cotrain_proto::control::AgentVersion]| {
        v.iter()
            .map(|a| format!("{}=v{}", a.agent, a.version))
            .collect::<Vec<_>>()
            .join(" ")
    };
    out += &format!("policy   {}\n", versions(&s.policy_versions));
    out += &format!(
        "workers  {} ({} in rotation)\n",
        s.workers.len(),
        s.workers.iter().filter(|w| w.in_rotation).count()
    );
    for w in &s.workers {
        let state = if w.in_rotation {
            "serving"
        } else if w.healthy {
            "catching up"
        } else {
            "down"
        };
        out += &format!(
            "  {:<28} {:<10} {:<11} load {:>3}  done {:>6}  failed {:>4}  catch-ups {:>3}  {}\n",
            w.address,
            w.origin,
            state,
            w.in_flight,
            w.completed,
            w.failed,
            w.catch_ups,
            versions(&w.versions)
        );
    }
    out
}
