//! The cluster token: a rollout worker started with `--cluster-token-file` refuses weight updates
//! from a learner without the token or with another one (the learner's error says why and what to
//! give it), and serves a learner that reads the same file, from the flag or the environment, on one
//! rank or on two (`learner launch` hands the file to its ranks).

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use cotrain_tests::{binaries, start_service, tiny_word_model_dir};

fn learner(args: &[&str], env_token: Option<&Path>) -> Output {
    let mut cmd = Command::new(binaries().unwrap().join("learner"));
    cmd.args(args)
        .env_remove(cotrain_proto::auth::TOKEN_FILE_ENV);
    if let Some(t) = env_token {
        cmd.env(cotrain_proto::auth::TOKEN_FILE_ENV, t);
    }
    cmd.output().unwrap()
}

#[test]
fn a_worker_with_a_cluster_token_refuses_weight_updates_without_it() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_word_model_dir(tmp.path()).unwrap();
    let (token, wrong) = (tmp.path().join("token"), tmp.path().join("wrong"));
    std::fs::write(&token, "s3cret-cluster-token-0123456789\n").unwrap();
    std::fs::write(&wrong, "another-cluster-token-0123456789\n").unwrap();
    let agent = |a: usize| format!("agent{a}={}", model.display());
    let worker = start_service(
        "rollout-worker",
        &[
            "serve".into(),
            "--grpc-addr".into(),
            "127.0.0.1:0".into(),
            "--http-addr".into(),
            "127.0.0.1:0".into(),
            "--agent".into(),
            agent(0),
            "--agent".into(),
            agent(1),
            "--separate-weights".into(),
            "--cluster-token-file".into(),
            token.display().to_string(),
        ],
        Duration::from_secs(120),
    )
    .unwrap();
    let config = |name: &str| {
        let path = tmp.path().join(format!("{name}.yaml"));
        std::fs::write(
            &path,
            format!(
                "model: {{name: '{model}', temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 512}}\n\
                 dataset: {{name: tldr, train_split: 'train[:4]'}}\n\
                 output: {{base_dir: '{out}', save_final_model: false}}\n\
                 magrpo: {{num_agents: 2, num_generations: 2, max_new_tokens: 4, rollout_buffer_size: 2, save_steps: 1000}}\n\
                 rollout: {{endpoints: ['http://{grpc}']}}\n\
                 logging: {{run_name: {name}, progress: never, plots: false}}\n",
                model = model.display(),
                out = tmp.path().join("out").display(),
                grpc = worker.grpc,
            ),
        )
        .unwrap();
        path.display().to_string()
    };

    let none = learner(&["train", "--config", &config("none")], None);
    let err = String::from_utf8_lossy(&none.stderr);
    assert!(!none.status.success());
    assert!(
        err.contains("requires the cluster token")
            && err.contains("carried none")
            && err.contains("--cluster-token-file"),
        "{err}"
    );

    let other = learner(
        &[
            "train",
            "--config",
            &config("other"),
            "--cluster-token-file",
            wrong.to_str().unwrap(),
        ],
        None,
    );
    let err = String::from_utf8_lossy(&other.stderr);
    assert!(!other.status.success());
    assert!(err.contains("carried another one"), "{err}");

    let by_env = learner(&["train", "--config", &config("env")], Some(&token));
    assert!(
        by_env.status.success(),
        "{}",
        String::from_utf8_lossy(&by_env.stderr)
    );
    let ranks = learner(
        &[
            "--cluster-token-file",
            token.to_str().unwrap(),
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "train",
            "--config",
            &config("ranks"),
        ],
        None,
    );
    assert!(
        ranks.status.success(),
        "{}",
        String::from_utf8_lossy(&ranks.stderr)
    );
    assert!(tmp.path().join("out/ranks/metrics.jsonl").is_file());
}
