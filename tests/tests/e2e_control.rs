//! Cluster operations end to end, on real processes over loopback: rollout workers that register
//! with a learner's control plane mid-run and take training requests at the current policy, a
//! worker killed (SIGKILL) mid-step, the learner's status and its graceful stop through the control
//! plane and SIGTERM, a learner killed (SIGKILL) while writing a checkpoint, and resumes that end
//! with the weights of an uninterrupted run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cotrain_tests::{Proc, binaries, tiny_word_model_dir};
use tch::{Kind, Tensor};

/// A TLDR config of `rows` items, 4 per step (two agents, separate policies); `top` goes at the top level.
fn write_config(
    dir: &Path,
    model: &Path,
    name: &str,
    rows: usize,
    save_steps: usize,
    top: &str,
) -> PathBuf {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!(
            "model: {{name: '{model}', dtype: f32, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 512}}\n\
             dataset: {{name: tldr, train_split: 'train[:{rows}]'}}\n\
             seed: 5\n\
             output: {{base_dir: '{out}', save_final_model: true}}\n\
             magrpo:\n  num_agents: 2\n  num_generations: 3\n  max_new_tokens: 24\n  learning_rate: 0.0005\n  \
             num_train_epochs: 1\n  rollout_buffer_size: 4\n  save_steps: {save_steps}\n  logging_steps: 1\n\
             logging: {{run_name: {name}, progress: never, plots: false}}\n{top}",
            model = model.display(),
            out = dir.join("out").display(),
        ),
    )
    .unwrap();
    path
}

fn learner_cmd(args: &[&str], token: &Path) -> Command {
    let mut c = Command::new(binaries().unwrap().join("learner"));
    c.arg("--cluster-token-file")
        .arg(token)
        .args(args)
        .env("RUST_LOG", "info");
    c
}

fn worker(model: &Path, control: &str, token: &Path) -> Proc {
    let spec = model.display().to_string();
    let mut p = Proc::spawn(
        Command::new(binaries().unwrap().join("rollout-worker")).args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--threads",
            "1",
            "--agent",
            &format!("agent0={spec}"),
            "--agent",
            &format!("agent1={spec}"),
            "--separate-weights",
            "--register",
            &format!("http://{control}"),
            "--cluster-token-file",
            token.to_str().unwrap(),
        ]),
    );
    let listening = p.wait_line("listening grpc=", Duration::from_secs(60));
    p.seen.push(format!(
        "grpc {}",
        listening.split_whitespace().next().unwrap()
    ));
    p.seen.push(format!(
        "http {}",
        listening.split_once("http=").unwrap().1.trim()
    ));
    p
}

/// The worker's `cotrain_rollout_in_flight_requests` gauge, read from its HTTP `/metrics`.
fn in_flight(http: &str) -> Option<f64> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(http).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.lines()
        .find_map(|l| l.strip_prefix("cotrain_rollout_in_flight_requests "))
        .and_then(|v| v.trim().parse().ok())
}

fn grpc_of(p: &mut Proc) -> String {
    format!("http://{}", p.wait_line("grpc ", Duration::from_secs(1)))
}

/// `learner status --json` through the binary, as an operator runs it.
fn status(control: &str, token: &Path) -> serde_json::Value {
    let out = learner_cmd(&["status", "--addr", control, "--json"], token)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "learner status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn worker_status<'a>(s: &'a serde_json::Value, address: &str) -> Option<&'a serde_json::Value> {
    s["workers"]
        .as_array()?
        .iter()
        .find(|w| w["address"] == address)
}

fn poll_status(
    control: &str,
    token: &Path,
    what: &str,
    timeout: Duration,
    cond: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + timeout;
    loop {
        let s = status(control, token);
        if cond(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting until {what}; last status: {s:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A plain HTTP/1.1 GET; the whole response, status line first.
fn http_get(addr: &str, path: &str, bearer: Option<&str>) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = bearer
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body
}

fn token_file(dir: &Path) -> PathBuf {
    let t = dir.join("token");
    std::fs::write(&t, "e2e-control-token-0123456789\n").unwrap();
    t
}

fn weights(path: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .collect()
}

/// The largest ‖a − b‖ / ‖a‖ over the tensors of two model files.
fn relative_difference(a: &Path, b: &Path) -> f64 {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let norm = |t: Tensor| t.to_kind(Kind::Double).norm().double_value(&[]);
    a.iter()
        .map(|(k, ta)| norm(ta - &b[k]) / norm(ta.shallow_clone()).max(1e-12))
        .fold(0.0, f64::max)
}

fn final_weights(run_dir: &Path, agent: usize) -> PathBuf {
    run_dir.join(format!("final_model/agent-{agent}/model.safetensors"))
}

#[test]
fn registered_workers_join_mid_run_and_a_killed_worker_costs_only_time() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_word_model_dir(tmp.path()).unwrap();
    let token = token_file(tmp.path());
    // Port 0: the learner binds and says where (a port picked here and handed over could be taken
    // by another process in between).
    let top = "learner: {control_addr: '127.0.0.1:0'}\nrollout: {wait_for_registration: true, min_workers: 1, registration_timeout_secs: 120}\n";
    let cfg = write_config(tmp.path(), &model, "registered", 240, 1000, top);
    // 60 steps an epoch, and epochs enough that the run is still going whenever the test acts on
    // it (release binaries ran 60 steps before the third worker joined); the test stops it, and the
    // resumed run ends at the end of the epoch it stopped in.
    let mut learner = Proc::spawn(
        learner_cmd(&["train", "--config"], &token)
            .arg(&cfg)
            .args(["--override", "magrpo.num_train_epochs=1000"]),
    );
    let control = learner.wait_line("control plane listening on ", Duration::from_secs(120));
    assert!(
        control.starts_with("127.0.0.1:") && !control.ends_with(":0"),
        "{control}"
    );

    // The control plane refuses callers without the cluster token, saying why.
    let out = Command::new(binaries().unwrap().join("learner"))
        .args(["status", "--addr", &control])
        .env_remove("COTRAIN_CLUSTER_TOKEN_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("requires the cluster token"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = status(&control, &token);
    assert_eq!(s["state"], "starting", "{s:#}");

    // The first worker registers; training starts.
    let mut first = worker(&model, &control, &token);
    let first_addr = grpc_of(&mut first);
    let s = poll_status(
        &control,
        &token,
        "two steps done",
        Duration::from_secs(120),
        |s| s["step"].as_u64() >= Some(2),
    );
    assert_eq!(s["state"], "training");
    // The same over HTTP: Prometheus metrics without the token, the status with it (and not without).
    let metrics_text = http_get(&control, "/metrics", None);
    assert!(
        metrics_text.contains("cotrain_learner_step ")
            && metrics_text.contains("cotrain_learner_rollout_workers{state=\"in_rotation\"} 1"),
        "{metrics_text}"
    );
    assert!(http_get(&control, "/status", None).starts_with("HTTP/1.1 401"));
    let body = http_get(&control, "/status", Some("e2e-control-token-0123456789"));
    assert!(
        body.starts_with("HTTP/1.1 200") && body.contains("\"state\":\"training\""),
        "{body}"
    );
    assert_eq!(
        worker_status(&s, &first_addr).unwrap()["origin"],
        "registered"
    );

    // A second worker registers mid-run: it is brought to the current policy, then takes requests.
    let mut second = worker(&model, &control, &token);
    let second_addr = grpc_of(&mut second);
    let s = poll_status(
        &control,
        &token,
        "the second worker serves",
        Duration::from_secs(120),
        |s| {
            worker_status(s, &second_addr)
                .is_some_and(|w| w["in_rotation"] == true && w["completed"].as_u64() > Some(0))
        },
    );
    let w = worker_status(&s, &second_addr).unwrap();
    // Brought to the current policy: by a catch-up, or (seen once on a loaded machine: catch_ups 0,
    // versions current) by the pushes that followed its registration. Either way it must not be
    // behind.
    eprintln!("the joiner: {} catch-ups", w["catch_ups"]);
    for agent in ["agent0", "agent1"] {
        assert!(
            w["versions"][agent].as_u64() >= s["policy_versions"][agent].as_u64(),
            "joiner behind on {agent}: {s:#}"
        );
    }

    // The first worker is killed (SIGKILL) while the learner has requests on it: caught generating,
    // frozen (SIGSTOP) so that they stay in flight, checked on the learner's side, then killed.
    // Its requests go to the second one.
    let first_http = first.wait_line("http ", Duration::from_secs(1));
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        assert!(
            Instant::now() < deadline,
            "the learner never had a request in flight on the first worker"
        );
        if in_flight(&first_http).unwrap_or(0.0) < 1.0 {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        first.signal("-STOP");
        if worker_status(&status(&control, &token), &first_addr)
            .is_some_and(|w| w["in_flight"].as_u64() > Some(0))
        {
            break;
        }
        first.signal("-CONT");
    }
    first.signal("-9");
    let killed_at = status(&control, &token)["step"].as_u64().unwrap();
    poll_status(
        &control,
        &token,
        "two more steps",
        Duration::from_secs(120),
        |s| s["step"].as_u64() >= Some(killed_at + 2),
    );

    // The second worker stops with SIGTERM: it drains, deregisters and exits 0. The run waits
    // without failing until a third worker registers, then goes on.
    second.signal("-TERM");
    assert!(
        second.wait_exit(Duration::from_secs(60)).success(),
        "{:?}",
        second.seen
    );
    assert!(
        second
            .seen
            .iter()
            .any(|l| l.contains("deregistered from the learner")),
        "{:?}",
        second.seen
    );
    let mut third = worker(&model, &control, &token);
    let third_addr = grpc_of(&mut third);
    let at = status(&control, &token)["step"].as_u64().unwrap();
    let s = poll_status(
        &control,
        &token,
        "the third worker carries the run",
        Duration::from_secs(120),
        |s| {
            s["step"].as_u64() >= Some(at + 2)
                && worker_status(s, &third_addr).is_some_and(|w| w["completed"].as_u64() > Some(0))
        },
    );
    assert!(
        worker_status(&s, &second_addr).is_none(),
        "the deregistered worker left the pool: {s:#}"
    );

    // A checkpoint on request: the answer comes once it is on disk.
    let out = learner_cmd(&["control", "checkpoint", "--addr", &control], &token)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    let path = said
        .trim()
        .rsplit_once(": ")
        .map(|(_, p)| p.to_string())
        .unwrap_or_default();
    assert!(
        said.starts_with("checkpoint of step ") && Path::new(&path).join("state.json").is_file(),
        "{said}"
    );

    // A graceful stop through the control plane: a checkpoint, then a clean exit.
    let out = learner_cmd(&["control", "stop", "--addr", &control], &token)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        learner.wait_exit(Duration::from_secs(120)).success(),
        "{:?}",
        learner.seen
    );
    let stopped = learner
        .seen
        .iter()
        .find_map(|l| l.strip_prefix("stopped on request after step "))
        .expect("stop line")
        .to_string();
    let stopped_at: u64 = stopped.split(';').next().unwrap().parse().unwrap();
    assert!(stopped_at >= s["step"].as_u64().unwrap());
    let run_dir = tmp.path().join("out/registered");
    assert!(
        run_dir
            .join(format!("checkpoints/step-{stopped_at}"))
            .is_dir()
    );
    let m = metrics(&run_dir);
    assert_eq!(m.len() as u64, stopped_at, "one metrics line per step");
    let last = m.last().unwrap();
    assert!(
        last["pool/failed_attempts"].as_f64() >= Some(1.0),
        "the killed worker's requests were retried: {last}"
    );
    assert!(last["pool/catch_ups"].as_f64() >= Some(1.0), "{last}");
    assert!(
        m.iter()
            .all(|r| r["reward/mean"].as_f64().is_some_and(f64::is_finite)),
        "every step has its rewards"
    );

    // The learner restarts on the same port and resumes: the third worker registers again
    // (its heartbeat finds a learner that does not know it) and the run finishes.
    let same_port = format!("learner.control_addr={control}");
    let epochs = stopped_at / 60 + 1;
    let resume_epochs = format!("magrpo.num_train_epochs={epochs}");
    let mut resumed = Proc::spawn(
        learner_cmd(&["train", "--config"], &token)
            .arg(&cfg)
            .arg("--resume")
            .arg(&run_dir)
            .args(["--override", &same_port, &resume_epochs]),
    );
    assert!(
        resumed.wait_exit(Duration::from_secs(300)).success(),
        "{:?}",
        resumed.seen
    );
    assert_eq!(
        metrics(&run_dir).len() as u64,
        epochs * 60,
        "the resumed run ends at the last step"
    );
    assert!(final_weights(&run_dir, 1).is_file());
    drop(third);
}

#[test]
fn sigterm_checkpoints_and_a_kill_during_a_checkpoint_resumes_to_the_uninterrupted_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_word_model_dir(tmp.path()).unwrap();
    let token = token_file(tmp.path());
    // The reference: 8 uninterrupted steps.
    let straight = write_config(tmp.path(), &model, "straight", 32, 1, "");
    let out = learner_cmd(&["train", "--config"], &token)
        .arg(&straight)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The same run, stopped by SIGTERM once two steps are done.
    let cfg = write_config(tmp.path(), &model, "interrupted", 32, 1, "");
    let run_dir = tmp.path().join("out/interrupted");
    let mut learner = Proc::spawn(learner_cmd(&["train", "--config"], &token).arg(&cfg));
    let deadline = Instant::now() + Duration::from_secs(120);
    while !run_dir.join("checkpoints/step-2").is_dir() {
        assert!(Instant::now() < deadline, "no second checkpoint");
        std::thread::sleep(Duration::from_millis(20));
    }
    learner.signal("-TERM");
    assert!(
        learner.wait_exit(Duration::from_secs(120)).success(),
        "SIGTERM is a clean exit: {:?}",
        learner.seen
    );
    let stopped = learner
        .seen
        .iter()
        .find_map(|l| l.strip_prefix("stopped on request after step "))
        .expect("stop line")
        .to_string();
    let stopped_at: usize = stopped.split(';').next().unwrap().parse().unwrap();
    assert!(
        stopped_at < 8
            && run_dir
                .join(format!("checkpoints/step-{stopped_at}"))
                .is_dir()
    );
    assert_eq!(metrics(&run_dir).len(), stopped_at);

    // Resumed, and killed with SIGKILL while it writes a checkpoint (a `.tmp-step-*` directory is
    // being filled); the kill may land just after one instead, which must be as harmless.
    let mut resumed = Proc::spawn(
        learner_cmd(&["train", "--config"], &token)
            .arg(&cfg)
            .arg("--resume")
            .arg(&run_dir),
    );
    let checkpoints = run_dir.join("checkpoints");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut during = false;
    loop {
        let writing = std::fs::read_dir(&checkpoints)
            .unwrap()
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().starts_with(".tmp-"));
        if writing {
            resumed.signal("-9");
            during = true;
            break;
        }
        if resumed.child.try_wait().unwrap().is_some() || Instant::now() > deadline {
            break;
        }
    }
    let _ = resumed.wait_exit(Duration::from_secs(60));
    eprintln!("killed during a checkpoint write: {during}");
    assert!(
        during,
        "the resumed run never wrote a checkpoint while watched"
    );
    // The last complete checkpoint resumes, and the run ends where the uninterrupted one did.
    let out = learner_cmd(&["train", "--config"], &token)
        .arg(&cfg)
        .arg("--resume")
        .arg(&run_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let straight_dir = tmp.path().join("out/straight");
    for agent in 0..2 {
        let d = relative_difference(
            &final_weights(&straight_dir, agent),
            &final_weights(&run_dir, agent),
        );
        assert!(d <= 1e-5, "agent {agent}: resumed weights differ by {d:e}");
    }
    assert_eq!(metrics(&run_dir).len(), 8);
}

/// A reward server killed mid-run: an outage shorter than `reward.outage_timeout` is waited out
/// (the run ends on the undisturbed weights), a longer one stops the run with a checkpoint that
/// resumes to the same weights.
#[test]
fn a_reward_server_outage_is_waited_out_and_a_longer_one_stops_the_run_with_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_word_model_dir(tmp.path()).unwrap();
    let token = token_file(tmp.path());
    let straight = write_config(tmp.path(), &model, "straight", 32, 1000, "");
    let out = learner_cmd(&["train", "--config"], &token)
        .arg(&straight)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The first server binds port 0 and says where; its restart takes the same port back.
    let reward_server = |grpc: &str| {
        let mut p = Proc::spawn(
            Command::new(binaries().unwrap().join("reward-server")).args([
                "--grpc-addr",
                grpc,
                "--http-addr",
                "127.0.0.1:0",
            ]),
        );
        let line = p.wait_line("listening grpc=", Duration::from_secs(60));
        let addr = line
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        (p, addr)
    };
    let (reward, grpc) = reward_server("127.0.0.1:0");
    let port: u16 = grpc.rsplit(':').next().unwrap().parse().unwrap();
    let straight_dir = tmp.path().join("out/straight");
    let steps_after = |run_dir: &Path, n: usize| {
        let deadline = Instant::now() + Duration::from_secs(120);
        while std::fs::read_to_string(run_dir.join("metrics.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0)
            < n
        {
            assert!(Instant::now() < deadline, "no step {n}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };

    // An outage shorter than reward.outage_timeout is waited out: the server killed after step 3
    // and started again while the learner waits; the run goes on and ends on the undisturbed
    // run's weights, the wait reported in reward/outage_secs.
    let top = format!(
        "reward: {{endpoint: 'http://127.0.0.1:{port}', max_retries: 2, outage_timeout: 120}}\n"
    );
    let cfg = write_config(tmp.path(), &model, "reward_restarted", 32, 1000, &top);
    let run_dir = tmp.path().join("out/reward_restarted");
    let mut learner = Proc::spawn(learner_cmd(&["train", "--config"], &token).arg(&cfg));
    steps_after(&run_dir, 3);
    reward.signal("-9");
    drop(reward);
    learner.wait_containing(
        "the reward server cannot be reached",
        Duration::from_secs(60),
    );
    let (reward, _) = reward_server(&format!("127.0.0.1:{port}"));
    let status = learner.wait_exit(Duration::from_secs(120));
    assert!(status.success(), "{}", learner.seen.join("\n"));
    let m = metrics(&run_dir);
    assert_eq!(m.len(), 8, "every step once");
    let waited: f64 = m
        .iter()
        .filter_map(|l| l["reward/outage_secs"].as_f64())
        .sum();
    assert!(waited > 0.0, "the wait is reported");
    for agent in 0..2 {
        let d = relative_difference(
            &final_weights(&straight_dir, agent),
            &final_weights(&run_dir, agent),
        );
        assert!(
            d <= 1e-5,
            "agent {agent}: weights after the outage differ by {d:e}"
        );
    }

    // A longer one stops the run with a checkpoint and a message naming the endpoint.
    let top = format!(
        "reward: {{endpoint: 'http://127.0.0.1:{port}', max_retries: 2, outage_timeout: 2}}\n"
    );
    let cfg = write_config(tmp.path(), &model, "reward_killed", 32, 1000, &top);
    let run_dir = tmp.path().join("out/reward_killed");
    let mut learner = Proc::spawn(learner_cmd(&["train", "--config"], &token).arg(&cfg));
    steps_after(&run_dir, 3);
    reward.signal("-9");
    let status = learner.wait_exit(Duration::from_secs(60));
    assert!(!status.success(), "the run cannot go on without rewards");
    let text = learner.seen.join("\n");
    assert!(
        text.contains(&format!("127.0.0.1:{port}"))
            && text.contains("could not be reached for")
            && text.contains("reward.outage_timeout"),
        "a bounded wait, then a clear error naming the endpoint:\n{text}"
    );
    let done = metrics(&run_dir).len();
    assert!(
        text.contains(&format!("the run stopped at step {done}")),
        "{text}"
    );
    assert!(
        run_dir.join(format!("checkpoints/step-{done}")).is_dir(),
        "a checkpoint of the last finished step"
    );

    // With the reward server back, the run resumes from that checkpoint and ends as if uninterrupted.
    let _reward = reward_server(&format!("127.0.0.1:{port}"));
    let out = learner_cmd(&["train", "--config"], &token)
        .arg(&cfg)
        .arg("--resume")
        .arg(&run_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(metrics(&run_dir).len(), 8);
    for agent in 0..2 {
        let d = relative_difference(
            &final_weights(&straight_dir, agent),
            &final_weights(&run_dir, agent),
        );
        assert!(d <= 1e-5, "agent {agent}: resumed weights differ by {d:e}");
    }
}

/// Unauthenticated services beyond loopback are refused unless asked for: a learner whose control
/// plane binds 0.0.0.0 without a cluster token, and a rollout worker serving gRPC on 0.0.0.0 without
/// one, stop at once naming the flags.
#[test]
fn services_beyond_loopback_without_a_token_refuse_to_start() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_word_model_dir(tmp.path()).unwrap();
    let cfg = write_config(
        tmp.path(),
        &model,
        "open",
        4,
        100,
        "learner: {control_addr: '0.0.0.0:0'}\n",
    );
    let out = Command::new(binaries().unwrap().join("learner"))
        .args(["train", "--config", cfg.to_str().unwrap()])
        .env_remove("COTRAIN_CLUSTER_TOKEN_FILE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the learner started an open control plane: {err}"
    );
    assert!(
        err.contains("learner.control_addr")
            && err.contains("--insecure")
            && err.contains("--cluster-token-file"),
        "{err}"
    );

    let spec = format!("agent0={}", model.display());
    let out = Command::new(binaries().unwrap().join("rollout-worker"))
        .args([
            "serve",
            "--grpc-addr",
            "0.0.0.0:0",
            "--http-addr",
            "127.0.0.1:0",
            "--agent",
            &spec,
        ])
        .env_remove("COTRAIN_CLUSTER_TOKEN_FILE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the worker served open weights: {err}"
    );
    assert!(
        err.contains("without a cluster token") && err.contains("--insecure"),
        "{err}"
    );
}

/// `learner train --resume auto`, run blindly again and again as a supervisor would: the first start
/// begins the run, a start after a stop resumes it from its checkpoint (each step logged once), a start
/// after the end does nothing and exits 0, and a run directory with no checkpoint (killed before its
/// first) is moved aside and the run starts over.
#[test]
fn resume_auto_starts_resumes_and_then_does_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_word_model_dir(tmp.path()).unwrap();
    let token = token_file(tmp.path());
    let cfg = write_config(tmp.path(), &model, "auto", 16, 1, "");
    let run_dir = tmp.path().join("out/auto");
    let auto = || {
        let mut c = learner_cmd(&["train", "--config"], &token);
        c.arg(&cfg).args(["--resume", "auto"]);
        c
    };

    // First start: no run yet, so it begins; stopped after its first checkpoint.
    let mut first = Proc::spawn(&mut auto());
    let deadline = Instant::now() + Duration::from_secs(120);
    while !run_dir.join("checkpoints/step-1").is_dir() {
        assert!(Instant::now() < deadline, "no first checkpoint");
        std::thread::sleep(Duration::from_millis(20));
    }
    first.signal("-TERM");
    assert!(
        first.wait_exit(Duration::from_secs(120)).success(),
        "{:?}",
        first.seen
    );
    assert!(!run_dir.join("finished.json").exists());

    // Second start: resumes and finishes; every step is in the metrics once.
    let out = auto().output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: Vec<u64> = metrics(&run_dir)
        .iter()
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, vec![1, 2, 3, 4]);
    assert!(run_dir.join("finished.json").is_file());

    // Third start: the run finished, nothing happens.
    let out = auto().output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("already finished"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(metrics(&run_dir).len(), 4);

    // A directory without a checkpoint is kept aside and the run starts over.
    std::fs::remove_dir_all(&run_dir).unwrap();
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::write(run_dir.join("metrics.jsonl"), "{\"step\":1}\n").unwrap();
    let out = auto().output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(metrics(&run_dir).len(), 4);
    let aside = std::fs::read_dir(tmp.path().join("out"))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("auto.incomplete-")
        })
        .count();
    assert_eq!(aside, 1, "the checkpoint-less directory is kept aside");
}
