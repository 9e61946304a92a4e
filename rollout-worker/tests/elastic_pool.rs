//! The client pool as an elastic pool: workers that join, restart, fall behind or leave DNS, on real
//! worker processes. Each test checks that every request is answered exactly once, by a worker at
//! the version the request needs.

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cotrain_rollout_client::pool::{PoolConfig, Resolve, RolloutPool, WorkerSnapshot};
use futures::future::BoxFuture;
use support::*;

const AGENT: &str = "alice";

fn pool_config(endpoints: Vec<String>) -> PoolConfig {
    PoolConfig {
        endpoints,
        refresh_interval: Duration::from_millis(200),
        connect_timeout: Duration::from_secs(2),
        wait_for_worker: Duration::from_secs(60),
        max_backoff: Duration::from_secs(1),
        ..PoolConfig::default()
    }
}

async fn version_of(w: &WorkerProcess) -> u64 {
    w.info()
        .await
        .agents
        .iter()
        .find(|a| a.name == AGENT)
        .expect("agent")
        .policy_version
}

fn snapshot(pool: &RolloutPool, address: &str) -> WorkerSnapshot {
    pool.workers()
        .into_iter()
        .find(|s| s.address == address)
        .unwrap_or_else(|| panic!("{address} not in the pool"))
}

async fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `n` requests needing `min_version` concurrently; every one must be answered, each exactly once.
async fn run_requests(pool: &Arc<RolloutPool>, n: u64, min_version: u64) {
    let before: u64 = pool.workers().iter().map(|s| s.completed).sum();
    let calls: Vec<_> = (0..n)
        .map(|i| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut req = request(
                    AGENT,
                    vec![token_prompt(vec![2 + i as u32, 3])],
                    1,
                    500 + i,
                    24,
                );
                req.min_policy_version = Some(min_version);
                pool.generate(req).await
            })
        })
        .collect();
    for (i, c) in calls.into_iter().enumerate() {
        let r = c
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("request {i} lost: {e}"));
        let v = r.completions[0].samples[0].policy_version;
        assert!(
            v >= min_version,
            "request {i} answered at version {v} < {min_version}"
        );
    }
    let after: u64 = pool.workers().iter().map(|s| s.completed).sum();
    assert_eq!(
        after - before,
        n,
        "each request answered exactly once: {:?}",
        pool.workers()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_and_restarted_workers_catch_up_before_they_get_requests() {
    let model = TinyModel::new("llama");
    let spec = model.spec();
    let agents = [(AGENT, spec.as_str())];
    let a = WorkerProcess::start(&agents, &[]).await;
    let mut b = WorkerProcess::start(&agents, &[]).await;
    let replay_dir = std::env::temp_dir().join(format!("elastic-replay-{}", std::process::id()));
    let cfg = PoolConfig {
        replay_dir: Some(replay_dir.clone()),
        ..pool_config(vec![a.endpoint(), b.endpoint()])
    };
    let pool = Arc::new(RolloutPool::new(cfg).await.unwrap());
    pool.wait_for_healthy(2, Duration::from_secs(30))
        .await
        .unwrap();

    // Two versions; the second is a partial update the pool merges into what it replays.
    let mut c = a.client().await;
    for v in 1..=2 {
        let answers = pool
            .push_weights(
                AGENT,
                v,
                true,
                lm_head_update(&mut c, AGENT, v as u32).await,
            )
            .await;
        assert!(answers.iter().all(|(_, r)| r.is_ok()), "{answers:?}");
        pool.wait_for_version(AGENT, v, Duration::from_secs(10))
            .await
            .unwrap();
    }
    run_requests(&pool, 6, 2).await;
    // What is kept for later workers is on disk, one file for the agent, not in the pool's memory.
    let kept: Vec<std::path::PathBuf> = std::fs::read_dir(&replay_dir)
        .unwrap()
        .flat_map(|d| std::fs::read_dir(d.unwrap().path()).unwrap())
        .map(|f| f.unwrap().path())
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(std::fs::metadata(&kept[0]).unwrap().len() > 0);

    // A worker that joins mid-run is at version 0: it is brought to v2 before it is in rotation.
    let joiner = WorkerProcess::start(&agents, &[]).await;
    assert_eq!(version_of(&joiner).await, 0);
    pool.add_endpoint(&joiner.endpoint()).await.unwrap();
    wait_until("the joiner is in rotation", Duration::from_secs(30), || {
        snapshot(&pool, &joiner.endpoint()).in_rotation
    })
    .await;
    assert_eq!(version_of(&joiner).await, 2);
    assert_eq!(snapshot(&pool, &joiner.endpoint()).catch_ups, 1);
    // The replayed weights are the learner's: the joiner answers exactly as a worker that took both pushes.
    let mut req = request(AGENT, vec![token_prompt(vec![7, 3])], 2, 99, 24);
    req.min_policy_version = Some(2);
    let on_a = a
        .client()
        .await
        .generate(req.clone())
        .await
        .unwrap()
        .into_inner();
    let on_joiner = joiner
        .client()
        .await
        .generate(req)
        .await
        .unwrap()
        .into_inner();
    let ids = |r: &cotrain_proto::rollout::GenerateResponse| {
        r.completions[0]
            .samples
            .iter()
            .map(|s| s.token_ids.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&on_a), ids(&on_joiner));

    // A worker that serves only a verifier joins: it gets no generate request and no push for the
    // agent, and nothing waits for it to reach the agent's version.
    let vdir = tempfile::tempdir().unwrap();
    {
        use cotrain_model::loader::{self, LoadOptions};
        let base = loader::load(&spec, &LoadOptions::default()).unwrap();
        cotrain_model::verifier::Verifier::new(
            base,
            &spec,
            Some(cotrain_model::lora::LoraConfig::default()),
            64,
        )
        .unwrap()
        .save(vdir.path())
        .unwrap();
    }
    let judge = WorkerProcess::start(
        &[],
        &["--verifier", &format!("judge={}", vdir.path().display())],
    )
    .await;
    pool.add_endpoint(&judge.endpoint()).await.unwrap();
    wait_until(
        "the verifier worker is in rotation",
        Duration::from_secs(30),
        || snapshot(&pool, &judge.endpoint()).in_rotation,
    )
    .await;
    run_requests(&pool, 8, 2).await;
    let answers = pool
        .push_weights(AGENT, 3, true, lm_head_update(&mut c, AGENT, 3).await)
        .await;
    assert!(
        answers
            .iter()
            .all(|(w, r)| r.is_ok() && *w != judge.endpoint()),
        "{answers:?}"
    );
    pool.wait_for_version(AGENT, 3, Duration::from_secs(10))
        .await
        .unwrap();
    run_requests(&pool, 8, 3).await;
    let j = snapshot(&pool, &judge.endpoint());
    assert_eq!(
        (j.completed, j.failed, j.in_rotation),
        (0, 0, true),
        "{j:?}"
    );
    drop(judge);

    // A worker that another pool took to a version newer than this pool's is not at this pool's
    // policy: it stays out of rotation, and the pool says why.
    let rogue = WorkerProcess::start(&agents, &[]).await;
    let other = RolloutPool::new(pool_config(vec![rogue.endpoint()]))
        .await
        .unwrap();
    let answers = other
        .push_weights(AGENT, 5, true, lm_head_update(&mut c, AGENT, 5).await)
        .await;
    assert!(answers.iter().all(|(_, r)| r.is_ok()), "{answers:?}");
    drop(other);
    pool.add_endpoint(&rogue.endpoint()).await.unwrap();
    wait_until(
        "the pool refuses to catch up a worker ahead of it",
        Duration::from_secs(30),
        || {
            snapshot(&pool, &rogue.endpoint())
                .catch_up_error
                .is_some_and(|e| e.contains("newer than this pool's v3"))
        },
    )
    .await;
    assert!(!snapshot(&pool, &rogue.endpoint()).in_rotation);
    drop(rogue);

    // A worker killed and restarted on its port comes back at version 0 and is caught up.
    let b_addr = b.grpc.to_string();
    b.kill();
    let b = WorkerProcess::start_on(&b_addr, &agents, &[]).await;
    assert_eq!(version_of(&b).await, 0);
    run_requests(&pool, 12, 2).await;
    wait_until(
        "the restarted worker is back in rotation",
        Duration::from_secs(30),
        || snapshot(&pool, &b.endpoint()).in_rotation,
    )
    .await;
    assert_eq!(version_of(&b).await, 3);
    let s = snapshot(&pool, &b.endpoint());
    assert!(s.catch_ups >= 1, "{s:?}");
    run_requests(&pool, 12, 2).await;
    assert!(
        snapshot(&pool, &b.endpoint()).completed > s.completed,
        "restarted worker got no requests: {:?}",
        pool.workers()
    );

    // A push that a worker refuses takes it out of rotation instead of failing: the others serve v4.
    let mut joiner = joiner;
    joiner.kill();
    let answers = pool
        .push_weights(AGENT, 4, true, lm_head_update(&mut c, AGENT, 4).await)
        .await;
    assert!(
        answers.iter().filter(|(_, r)| r.is_ok()).count() >= 2,
        "{answers:?}"
    );
    pool.wait_for_version(AGENT, 4, Duration::from_secs(10))
        .await
        .unwrap();
    run_requests(&pool, 6, 4).await;
    assert!(!snapshot(&pool, &joiner.endpoint()).in_rotation);
    drop(pool);
    assert_eq!(
        std::fs::read_dir(&replay_dir).unwrap().count(),
        0,
        "the pool's replay directory goes with it"
    );
    let _ = std::fs::remove_dir_all(&replay_dir);
}

/// Name resolution the test controls: what `rollout.dns` resolves to, changed while the pool runs.
#[derive(Debug, Default)]
struct TestResolver(Mutex<HashMap<String, Vec<SocketAddr>>>);

impl Resolve for TestResolver {
    fn resolve<'a>(&'a self, name: &'a str) -> BoxFuture<'a, std::io::Result<Vec<SocketAddr>>> {
        let r = self
            .0
            .lock()
            .unwrap()
            .get(name)
            .cloned()
            .ok_or_else(|| std::io::Error::other(format!("{name}: no such name")));
        Box::pin(async move { r })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_workers_on_ipv4_and_ipv6_join_and_leave() {
    let model = TinyModel::new("llama");
    let spec = model.spec();
    let agents = [(AGENT, spec.as_str())];
    let v4 = WorkerProcess::start(&agents, &[]).await;
    let v6 = WorkerProcess::start_on("[::1]:0", &agents, &[]).await;
    assert!(v6.grpc.is_ipv6());
    let resolver = Arc::new(TestResolver::default());
    resolver
        .0
        .lock()
        .unwrap()
        .insert("rollout:50061".into(), vec![v4.grpc, v6.grpc]);
    let cfg = PoolConfig {
        dns_names: vec!["rollout:50061".into()],
        resolver: resolver.clone(),
        ..pool_config(vec![])
    };
    let pool = Arc::new(RolloutPool::new(cfg).await.unwrap());
    pool.wait_for_healthy(2, Duration::from_secs(30))
        .await
        .unwrap();
    let addresses: Vec<String> = pool.workers().into_iter().map(|s| s.address).collect();
    assert!(
        addresses.contains(&format!("http://[::1]:{}", v6.grpc.port())),
        "{addresses:?}"
    );
    run_requests(&pool, 8, 0).await;
    assert!(
        pool.workers().iter().all(|s| s.completed > 0),
        "both families serve: {:?}",
        pool.workers()
    );

    // The IPv4 worker leaves the name: it is dropped, and requests go on.
    resolver
        .0
        .lock()
        .unwrap()
        .insert("rollout:50061".into(), vec![v6.grpc]);
    wait_until(
        "the worker that left dns is dropped",
        Duration::from_secs(10),
        || pool.workers().len() == 1,
    )
    .await;
    run_requests(&pool, 4, 0).await;
    // A failed lookup keeps the known workers.
    resolver.0.lock().unwrap().clear();
    pool.refresh().await;
    assert_eq!(pool.workers().len(), 1);
}

/// A network namespace joined to this one by a veth pair: a second host for the test.
struct TestHost {
    ns: String,
    host_if: String,
    /// The namespace's address.
    ip: String,
}

impl TestHost {
    fn ip_cmd(args: &[&str]) -> bool {
        std::process::Command::new("ip")
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Makes the namespace, or says why it cannot (not root, no netns support).
    fn new(tag: u8) -> Result<Self, String> {
        let pid = std::process::id() % 10_000;
        let ns = format!("cotrain-pt{pid}-{tag}");
        let (host_if, ns_if) = (format!("vh{pid}x{tag}"), format!("vw{pid}x{tag}"));
        let net = format!("10.231.{}.", (pid % 60) * 4 + tag as u32);
        let (host_ip, ip) = (format!("{net}1"), format!("{net}2"));
        if !Self::ip_cmd(&["netns", "add", &ns]) {
            return Err("cannot create a network namespace (needs root and netns support)".into());
        }
        let host = Self {
            ns: ns.clone(),
            host_if: host_if.clone(),
            ip: ip.clone(),
        };
        let ok = Self::ip_cmd(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
        ]) && Self::ip_cmd(&["link", "set", &ns_if, "netns", &ns])
            && Self::ip_cmd(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if])
            && Self::ip_cmd(&["link", "set", &host_if, "up"])
            && Self::ip_cmd(&[
                "netns",
                "exec",
                &ns,
                "ip",
                "addr",
                "add",
                &format!("{ip}/30"),
                "dev",
                &ns_if,
            ])
            && Self::ip_cmd(&["netns", "exec", &ns, "ip", "link", "set", &ns_if, "up"])
            && Self::ip_cmd(&["netns", "exec", &ns, "ip", "link", "set", "lo", "up"]);
        if ok {
            Ok(host)
        } else {
            Err("cannot wire a veth pair into the namespace".into())
        }
    }

    /// Cuts (false) or restores (true) the link between the hosts.
    fn link(&self, up: bool) {
        assert!(Self::ip_cmd(&[
            "link",
            "set",
            &self.host_if,
            if up { "up" } else { "down" }
        ]));
    }
}

impl Drop for TestHost {
    fn drop(&mut self) {
        Self::ip_cmd(&["link", "del", &self.host_if]);
        Self::ip_cmd(&["netns", "del", &self.ns]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_worker_loses_nothing_and_catches_up_when_healed() {
    let host = match TestHost::new(1) {
        Ok(h) => h,
        Err(why) => {
            eprintln!(
                "SKIPPED a_partitioned_worker_loses_nothing_and_catches_up_when_healed: {why}"
            );
            return;
        }
    };
    let model = TinyModel::new("llama");
    let spec = model.spec();
    let agents = [(AGENT, spec.as_str())];
    let local = WorkerProcess::start(&agents, &[]).await;
    let ns = host.ns.clone();
    // Its address is not loopback: without a cluster token the worker needs --insecure (the
    // namespace's link reaches this process only).
    let remote = WorkerProcess::start_under(
        &["ip", "netns", "exec", &ns],
        &format!("{}:0", host.ip),
        &agents,
        &["--insecure"],
    )
    .await;
    let pool = Arc::new(
        RolloutPool::new(pool_config(vec![local.endpoint(), remote.endpoint()]))
            .await
            .unwrap(),
    );
    pool.wait_for_healthy(2, Duration::from_secs(30))
        .await
        .unwrap();
    let mut c = local.client().await;
    assert!(
        pool.push_weights(AGENT, 1, true, lm_head_update(&mut c, AGENT, 1).await)
            .await
            .iter()
            .all(|(_, r)| r.is_ok())
    );
    run_requests(&pool, 8, 1).await;
    assert!(
        snapshot(&pool, &remote.endpoint()).completed > 0,
        "the other host serves: {:?}",
        pool.workers()
    );

    // Partition: requests in flight on the other host and new ones go to the local worker; a push
    // goes on without it.
    host.link(false);
    run_requests(&pool, 12, 1).await;
    let answers = pool
        .push_weights(AGENT, 2, true, lm_head_update(&mut c, AGENT, 2).await)
        .await;
    assert!(
        answers
            .iter()
            .any(|(a, r)| *a == local.endpoint() && r.is_ok()),
        "{answers:?}"
    );
    pool.wait_for_version(AGENT, 2, Duration::from_secs(10))
        .await
        .unwrap();
    run_requests(&pool, 6, 2).await;
    assert!(
        !snapshot(&pool, &remote.endpoint()).in_rotation,
        "{:?}",
        pool.workers()
    );

    // Healed: it passes a health check, is caught up to version 2, and serves again.
    host.link(true);
    wait_until(
        "the healed worker is back in rotation",
        Duration::from_secs(60),
        || snapshot(&pool, &remote.endpoint()).in_rotation,
    )
    .await;
    assert_eq!(version_of(&remote).await, 2);
    let before = snapshot(&pool, &remote.endpoint()).completed;
    run_requests(&pool, 12, 2).await;
    assert!(
        snapshot(&pool, &remote.endpoint()).completed > before,
        "the healed worker got no requests: {:?}",
        pool.workers()
    );
}
