//! TLS end to end: a reward server and a rollout worker serving gRPC and HTTP over TLS, a learner
//! whose control plane serves TLS and which dials both over TLS, trusting only the test's CA; the
//! worker registers with the learner over TLS. A plain-text client gets no answer from a TLS port.
//! The certificates are made here with the `openssl` command (Debian's `openssl` package).

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use cotrain_tests::{Proc, binaries, tiny_word_model_dir};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl command (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, and a server certificate it signed for 127.0.0.1 and `localhost`.
fn certificates(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    openssl(
        dir,
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=cotrain test CA",
            ],
        ]
        .concat(),
    );
    openssl(
        dir,
        &[
            &["req"][..],
            &ec,
            &[
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=cotrain",
            ],
        ]
        .concat(),
    );
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ],
    );
}

/// The first bytes a server sends back to a plain-text HTTP request.
fn plain_http_answer(addr: &str) -> Vec<u8> {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    buf
}

#[test]
fn services_learner_and_registration_over_tls() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    certificates(dir);
    let (cert, key, ca) = (
        dir.join("server.pem"),
        dir.join("server.key"),
        dir.join("ca.pem"),
    );
    let tls_server = |c: &mut Command| {
        c.arg("--tls-cert").arg(&cert).arg("--tls-key").arg(&key);
    };

    let mut c = Command::new(binaries().unwrap().join("reward-server"));
    c.args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"]);
    tls_server(&mut c);
    let mut reward = Proc::spawn(&mut c);
    let listening = reward.wait_line("listening grpc=", Duration::from_secs(120));
    let reward_grpc = listening.split_whitespace().next().unwrap().to_string();
    let reward_http = listening.split_once("http=").unwrap().1.trim().to_string();
    // A plain-text client gets no HTTP answer from a TLS port.
    assert!(
        !plain_http_answer(&reward_http).starts_with(b"HTTP/"),
        "the reward server answered plain HTTP"
    );

    let model = tiny_word_model_dir(dir).unwrap();
    let cfg = dir.join("tls.yaml");
    std::fs::write(
        &cfg,
        format!(
            "model: {{name: '{model}', dtype: f32, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 512}}\n\
             dataset: {{name: tldr, train_split: 'train[:12]'}}\n\
             output: {{base_dir: '{out}', save_final_model: false}}\n\
             magrpo: {{num_agents: 2, num_generations: 2, max_new_tokens: 8, num_train_epochs: 1, rollout_buffer_size: 4, logging_steps: 1}}\n\
             logging: {{run_name: tls, progress: never, plots: false}}\n\
             reward: {{endpoint: 'https://{reward_grpc}'}}\n\
             learner: {{control_addr: '127.0.0.1:0'}}\n\
             rollout: {{wait_for_registration: true, registration_timeout_secs: 120}}\n",
            model = model.display(),
            out = dir.join("out").display(),
        ),
    )
    .unwrap();
    let mut c = Command::new(binaries().unwrap().join("learner"));
    c.arg("--tls-ca").arg(&ca);
    tls_server(&mut c);
    c.arg("train").arg("--config").arg(&cfg);
    let mut learner = Proc::spawn(&mut c);
    let control = learner.wait_line("control plane listening on ", Duration::from_secs(120));

    let spec = model.display().to_string();
    let mut c = Command::new(binaries().unwrap().join("rollout-worker"));
    c.args([
        "serve",
        "--grpc-addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--threads",
        "1",
        "--separate-weights",
    ])
    .args([
        "--agent",
        &format!("agent0={spec}"),
        "--agent",
        &format!("agent1={spec}"),
    ])
    .args(["--register", &format!("https://{control}")])
    .arg("--tls-ca")
    .arg(&ca);
    tls_server(&mut c);
    let mut worker = Proc::spawn(&mut c);
    let listening = worker.wait_line("listening grpc=", Duration::from_secs(120));
    let worker_http = listening.split_once("http=").unwrap().1.trim().to_string();
    assert!(
        !plain_http_answer(&worker_http).starts_with(b"HTTP/"),
        "the worker answered plain HTTP"
    );

    let status = learner.wait_exit(Duration::from_secs(300));
    assert!(
        status.success(),
        "learner over TLS failed: {:?}",
        learner.seen
    );
    let metrics = std::fs::read_to_string(dir.join("out/tls/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 3, "three steps trained");
    worker.drain();
    assert!(
        worker
            .seen
            .iter()
            .any(|l| l.contains("registered with the learner")),
        "{:?}",
        worker.seen
    );
}
