//! Learner ranks end to end: `learner launch --nproc-per-node 2` (two `learner train` processes
//! joined by Open MPI, the embedded reward server and rollout worker started once, by rank 0) against
//! one `learner train` process on the same config and seed: the same weights after 3 steps, for
//! separate and for shared parameters; a rank killed mid-run stops the job with the rank named, and
//! the last checkpoint resumes (on 2 ranks) to the same weights as an uninterrupted run. The
//! actor-critic trainers (IAC, MAAC, value heads) likewise: two ranks train the policies and
//! critics one rank trains, and resume to them.
//!
//! The model is the tiny Llama with a word-level tokenizer (see [`tiny_word_model_dir`]) and the
//! task TLDR with its real reward, so that rewards vary and every step changes the weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use cotrain_tests::{binaries, tiny_word_model_dir};
use tch::{Kind, Tensor};

/// A TLDR config of `rows` items, 4 per step; `extra` goes into the `magrpo` section, `top` at the top level.
fn write_config(
    dir: &Path,
    model: &Path,
    name: &str,
    rows: usize,
    extra: &str,
    top: &str,
) -> PathBuf {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!(
            "model: {{name: '{model}', dtype: f32, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 512}}\n\
             dataset: {{name: tldr, train_split: 'train[:{rows}]'}}\n\
             seed: 3\n\
             output: {{base_dir: '{out}', save_final_model: true}}\n\
             magrpo:\n  num_agents: 2\n  num_generations: 3\n  max_new_tokens: 8\n  learning_rate: 0.0005\n  \
             num_train_epochs: 1\n  rollout_buffer_size: 4\n  save_steps: 1\n  logging_steps: 1\n{extra}\
             logging: {{run_name: {name}, progress: never}}\n{top}",
            model = model.display(),
            out = dir.join("out").display(),
        ),
    )
    .unwrap();
    path
}

fn learner(args: &[&str], config: &Path) -> Output {
    let out = Command::new(binaries().unwrap().join("learner"))
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "learner {args:?} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn weights(path: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .collect()
}

/// Over the tensors: the largest ‖a − b‖ / ‖a‖ (relative difference), the largest
/// ‖a − b‖ / ‖a − base‖ (difference relative to the training update), and the largest
/// ‖a − base‖ / ‖base‖ (how far training moved the weights).
fn relative_difference(a: &Path, b: &Path, base: &Path) -> (f64, f64, f64) {
    let (a, b, base) = (weights(a), weights(b), weights(base));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let (mut rel, mut of_update, mut moved) = (0f64, 0f64, 0f64);
    for (k, ta) in &a {
        let norm = |t: Tensor| t.to_kind(Kind::Double).norm().double_value(&[]);
        let diff = norm(ta - &b[k]);
        let update = norm(ta - &base[k]);
        rel = rel.max(diff / norm(ta.shallow_clone()).max(1e-12));
        if update > 0.0 {
            of_update = of_update.max(diff / update);
        }
        moved = moved.max(update / norm(base[k].shallow_clone()).max(1e-12));
    }
    (rel, of_update, moved)
}

fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Trains `extra` once on one rank and once on two; asserts the same steps, rewards and weights.
fn one_rank_equals_two(extra: &str, policy_dirs: &[&str]) {
    one_rank_equals_many(extra, "", 2, policy_dirs, &[]);
}

/// [`one_rank_equals_two`] on `ranks` ranks, with `top` added to the ranks' config (e.g.
/// `learner.placement`) and `launch_flags` given to `learner launch` (e.g. `--backend nccl`).
fn one_rank_equals_many(
    extra: &str,
    top: &str,
    ranks: usize,
    policy_dirs: &[&str],
    launch_flags: &[&str],
) {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_word_model_dir(tmp.path()).unwrap();
    let one = write_config(tmp.path(), &model, "one", 12, extra, "");
    let two = write_config(tmp.path(), &model, "two", 12, extra, top);
    learner(&["train"], &one);
    let ranks = ranks.to_string();
    let mut args = vec!["launch", "--nproc-per-node", ranks.as_str()];
    args.extend_from_slice(launch_flags);
    args.extend(["--", "train"]);
    let out = learner(&args, &two);
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Rank 0 reports the run; the other rank prints nothing of its own.
    assert!(stdout.contains("run directory: "), "{stdout}");
    assert!(!stdout.contains("[1,1]<stdout>:run directory"), "{stdout}");

    let (m1, m2) = (
        metrics(&tmp.path().join("out/one")),
        metrics(&tmp.path().join("out/two")),
    );
    assert_eq!(m1.len(), 3, "12 rows, 4 per step");
    assert_eq!(m2.len(), 3, "rank 0 alone writes metrics: {m2:?}");
    for (a, b) in m1.iter().zip(&m2) {
        assert_eq!(b["ranks"].as_f64(), ranks.parse().ok());
        for k in ["reward/mean", "reward/std", "loss", "grad_norm"] {
            let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                "step {}: {k} {x} on one rank, {y} on two",
                a["step"]
            );
        }
    }
    assert!(
        m1.iter().any(|m| m["reward/std"].as_f64().unwrap() > 0.0),
        "rewards must vary for the comparison to mean anything"
    );
    for dir in policy_dirs {
        let file = format!("final_model/{dir}/model.safetensors");
        let (rel, of_update, moved) = relative_difference(
            &tmp.path().join("out/one").join(&file),
            &tmp.path().join("out/two").join(&file),
            &model.join("model.safetensors"),
        );
        assert!(
            moved > 1e-3,
            "{dir}: training moved no weight (largest change {moved})"
        );
        assert!(
            rel <= 1e-5,
            "{dir}: weights differ by {rel} (relative) between one and two ranks"
        );
        // Adam turns the last bits of a gradient summed in another order into visible differences
        // on its smallest components; a rank that trained alone would differ by the whole update.
        assert!(
            of_update <= 5e-3,
            "{dir}: the ranks' weights differ by {of_update} of the update"
        );
    }
}

#[test]
fn two_cpu_ranks_train_the_same_weights_as_one_with_separate_policies() {
    one_rank_equals_two("", &["agent-0", "agent-1"]);
}

#[test]
fn two_cpu_ranks_train_the_same_weights_as_one_with_shared_parameters() {
    one_rank_equals_two("  shared_parameters: true\n", &["shared"]);
}

#[test]
fn two_agents_placed_on_two_ranks_train_the_same_weights_as_one_rank() {
    one_rank_equals_many(
        "",
        "learner: {placement: agent}\n",
        2,
        &["agent-0", "agent-1"],
        &[],
    );
}

#[test]
fn two_agents_times_two_data_ranks_train_the_same_weights_as_one_rank() {
    one_rank_equals_many(
        "",
        "learner: {placement: agent}\n",
        4,
        &["agent-0", "agent-1"],
        &[],
    );
}

/// An IAC/MAAC config (`variant`: `iac`, `maac`, or `iac-head` for IAC with value heads on the
/// actors) of 20 TLDR rows: 3 samples per agent and item, a buffer of 10 (so 10 items per step,
/// drained after every 4th item: the drains fall on even item counts, where two ranks in lockstep
/// drain too, and step 1 ends with 2 items' samples buffered), mini-batches of 4. The critics are
/// Q critics: the word-level tokenizer reads TLDR's English prompts as `[UNK]`s, on which every
/// position's hidden state is the same and attention's q/k get no gradient but rounding noise,
/// which AdamW magnifies differently for gradients summed in another order; the completions are
/// varied words.
fn write_actor_critic_config(dir: &Path, model: &Path, name: &str, variant: &str) -> PathBuf {
    let (section, head) = match variant {
        "iac-head" => ("iac", "  use_separate_critic: false\n"),
        v => (v, ""),
    };
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!(
            "model: {{name: '{model}', dtype: f32, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 512}}\n\
             dataset: {{name: tldr, train_split: 'train[:20]'}}\n\
             seed: 3\n\
             output: {{base_dir: '{out}', save_final_model: true}}\n\
             {section}:\n  num_agents: 2\n  num_generations: 3\n  max_new_tokens: 8\n  learning_rate: 0.0005\n  \
             critic_learning_rate: 0.0005\n  critic_type: q\n  num_train_epochs: 1\n  rollout_buffer_size: 10\n  train_batch_size: 4\n  \
             eval_interval: 1000\n  save_steps: 1\n  logging_steps: 1\n{head}\
             logging: {{run_name: {name}, progress: never}}\n",
            model = model.display(),
            out = dir.join("out").display(),
        ),
    )
    .unwrap();
    path
}

/// The largest relative difference between two runs' tensors of checkpoint part `part` (the
/// critics follow the policies in a checkpoint), and the tensor it is in.
fn checkpoint_difference(a: &Path, b: &Path, part: usize) -> (f64, String) {
    let file = format!("agent-{part}/model.safetensors");
    let (a, b) = (weights(&a.join(&file)), weights(&b.join(&file)));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .map(|(k, ta)| {
            let norm = |t: Tensor| t.to_kind(Kind::Double).norm().double_value(&[]);
            (
                norm(ta - &b[k]) / norm(ta.shallow_clone()).max(1e-12),
                k.clone(),
            )
        })
        .fold((0.0, String::new()), |x, y| if y.0 > x.0 { y } else { x })
}

/// IAC, MAAC and IAC with value heads on two ranks (data placement: each rank rolls out half of
/// every step's items; every rank holds the whole buffer, back-propagates its half of each
/// mini-batch, and the actors' and critics' gradients are summed) train what one rank trains: the
/// same rewards, losses and critic losses per step, the same policies and critics. Then the 2-rank
/// run resumes, on two ranks, from its step-1 checkpoint (critics, their AdamW moments and a
/// partly filled buffer, all restored on rank 0 and broadcast) to the same weights.
#[test]
fn two_cpu_ranks_train_the_actor_critic_trainers_as_one_rank_does_and_resume() {
    for variant in ["iac", "maac", "iac-head"] {
        let tmp = tempfile::tempdir().unwrap();
        let model = tiny_word_model_dir(tmp.path()).unwrap();
        let one = write_actor_critic_config(tmp.path(), &model, "one", variant);
        let two = write_actor_critic_config(tmp.path(), &model, "two", variant);
        learner(&["train"], &one);
        learner(&["launch", "--nproc-per-node", "2", "--", "train"], &two);
        let (run1, run2) = (tmp.path().join("out/one"), tmp.path().join("out/two"));
        let (m1, m2) = (metrics(&run1), metrics(&run2));
        assert_eq!(m1.len(), 2, "{variant}: 20 rows, 10 per step");
        assert_eq!(
            m2.len(),
            2,
            "{variant}: rank 0 alone writes metrics: {m2:?}"
        );
        for (a, b) in m1.iter().zip(&m2) {
            assert_eq!(b["ranks"].as_f64(), Some(2.0));
            for k in [
                "reward/mean",
                "reward/std",
                "loss",
                "grad_norm",
                "critic/value_loss",
                "critic/explained_variance",
            ] {
                let (x, y) = (
                    a[k].as_f64()
                        .unwrap_or_else(|| panic!("{variant}: {k} in {a}")),
                    b[k].as_f64().unwrap(),
                );
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                    "{variant} step {}: {k} {x} on one rank, {y} on two",
                    a["step"]
                );
            }
        }
        assert!(
            m1.iter().any(|m| m["reward/std"].as_f64().unwrap() > 0.0),
            "rewards must vary for the comparison to mean anything"
        );
        let policies = |run: &Path| run.join("checkpoints/step-2");
        // Policies, then each critic's backbone and head (IAC: 2 critics; MAAC: 1), or each actor's head.
        let parts = match variant {
            "iac" => 6,
            _ => 4,
        };
        // With value heads on the actors, the value loss also reaches the actors' q/k through the
        // `[UNK]` prompt positions, as rounding noise: measured 6.2e-5 of the weights and 0.36% of
        // the update (a rank that trained alone would differ by the whole update).
        let policy_bound = if variant == "iac-head" { 1e-4 } else { 1e-5 };
        for part in 0..parts {
            let (rel, key) = checkpoint_difference(&policies(&run1), &policies(&run2), part);
            let bound = if part < 2 { policy_bound } else { 1e-5 };
            assert!(
                rel <= bound,
                "{variant}: checkpoint part {part} differs by {rel} (relative, in `{key}`) between one and two ranks"
            );
        }
        for dir in ["agent-0", "agent-1"] {
            let file = format!("final_model/{dir}/model.safetensors");
            let (rel, of_update, moved) = relative_difference(
                &run1.join(&file),
                &run2.join(&file),
                &model.join("model.safetensors"),
            );
            assert!(
                moved > 1e-3,
                "{variant} {dir}: training moved no weight (largest change {moved})"
            );
            assert!(
                rel <= policy_bound && of_update <= 5e-3,
                "{variant} {dir}: weights differ by {rel} (relative), {of_update} of the update"
            );
        }

        // Resume the 2-rank run from step 1 (whose checkpoint holds 2 items' samples per agent).
        let state: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(run2.join("checkpoints/step-1/state.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            state["extra"]["actor_critic_buffer"]
                .as_array()
                .map(Vec::len),
            Some(12),
            "{variant}: 2 items × 3 samples × 2 agents buffered"
        );
        let whole = tmp.path().join("whole");
        std::fs::create_dir_all(&whole).unwrap();
        std::fs::rename(run2.join("checkpoints/step-2"), whole.join("step-2")).unwrap();
        std::fs::remove_dir_all(run2.join("final_model")).unwrap();
        // As a job stopped after step 1 leaves it.
        std::fs::write(run2.join("checkpoints/latest"), "step-1").unwrap();
        learner(
            &[
                "launch",
                "--nproc-per-node",
                "2",
                "--",
                "train",
                "--resume",
                run2.to_str().unwrap(),
            ],
            &two,
        );
        assert_eq!(
            metrics(&run2).len(),
            2,
            "{variant}: step 2 logged again, once"
        );
        for part in 0..parts {
            let (rel, key) = checkpoint_difference(&whole.join("step-2"), &policies(&run2), part);
            assert!(
                rel <= 1e-5,
                "{variant}: after the resume, checkpoint part {part} differs by {rel} (in `{key}`) from the uninterrupted run"
            );
        }
    }
}

/// The pid of the `learner train` process that is rank `rank` of the job training `config`.
fn rank_pid(rank: usize, config: &Path) -> Option<u32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let environ = std::fs::read(e.path().join("environ")).ok()?;
        let has = |hay: &[u8], needle: &[u8]| hay.split(|&b| b == 0).any(|part| part == needle);
        let cmd = String::from_utf8_lossy(&cmdline);
        (cmd.contains(config.to_str()?) && cmd.contains("train") && has(&environ, want.as_bytes()))
            .then_some(pid)
    })
}

#[test]
fn a_rank_killed_mid_run_stops_the_job_and_its_checkpoint_resumes_to_the_same_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_word_model_dir(tmp.path()).unwrap();
    // 8 steps, so that the job is still running when its first checkpoint appears.
    let whole = write_config(tmp.path(), &model, "whole", 32, "", "");
    let cut = write_config(tmp.path(), &model, "cut", 32, "", "");
    learner(&["launch", "--nproc-per-node", "2", "--", "train"], &whole);

    let child = Command::new(binaries().unwrap().join("learner"))
        .args(["launch", "--nproc-per-node", "2", "--", "train", "--config"])
        .arg(&cut)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let run_dir = tmp.path().join("out/cut");
    let start = Instant::now();
    while !run_dir.join("checkpoints/step-1/state.json").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no checkpoint appeared"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Freeze rank 1 (rank 0 then waits in the next collective, mid-step), then kill it.
    let pid = rank_pid(1, &cut).expect("rank 1 is running");
    assert!(
        Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the job must fail when a rank dies");
    assert!(
        stderr.contains("rank 1") && stderr.contains("Killed"),
        "the error names the rank and its signal:\n{stderr}"
    );
    assert!(stderr.contains("the learner job failed"), "{stderr}");
    let done = metrics(&run_dir).len();
    assert!(
        done < 8,
        "the job was cut short (it logged {done} of 8 steps)"
    );

    // The last complete checkpoint resumes, on two ranks, to the weights of the uninterrupted run.
    learner(
        &[
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "train",
            "--resume",
            run_dir.to_str().unwrap(),
        ],
        &cut,
    );
    for dir in ["agent-0", "agent-1"] {
        let file = format!("final_model/{dir}/model.safetensors");
        let (rel, _, moved) = relative_difference(
            &tmp.path().join("out/whole").join(&file),
            &run_dir.join(&file),
            &model.join("model.safetensors"),
        );
        assert!(moved > 1e-3);
        assert!(
            rel <= 1e-5,
            "{dir}: the resumed run differs by {rel} from the uninterrupted one"
        );
    }
}

/// A rank that fails on its own (here rank 0: `--resume` of a directory with no checkpoint, while
/// rank 1 waits for rank 0's state) stops the job with its error; it used to wait for ever in
/// `MPI_Finalize` while rank 1 waited in its broadcast.
#[test]
fn a_rank_that_fails_alone_stops_the_job_with_its_error() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_word_model_dir(tmp.path()).unwrap();
    let cfg = write_config(tmp.path(), &model, "empty", 4, "", "");
    let empty = tmp.path().join("out/empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(&cfg, empty.join("config.yaml")).unwrap();
    let mut child = Command::new(binaries().unwrap().join("learner"))
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "train",
            "--resume",
            empty.to_str().unwrap(),
            "--config",
        ])
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Generous (the two ranks start, and rank 0 builds its services first), but finite.
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            panic!("the job did not stop after rank 0 failed");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no complete checkpoint to resume from"),
        "rank 0's error is shown:\n{stderr}"
    );
    assert!(stderr.contains("the learner job failed"), "{stderr}");
}

#[test]
fn a_torchrun_environment_without_an_mpi_launcher_is_refused_with_the_commands_that_work() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_word_model_dir(tmp.path()).unwrap();
    let cfg = write_config(tmp.path(), &model, "torchrun", 4, "", "");
    let out = Command::new(binaries().unwrap().join("learner"))
        .args(["train", "--config"])
        .arg(&cfg)
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29511"),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("learner launch --nproc-per-node N") && stderr.contains("mpirun"),
        "{stderr}"
    );
}

/// On a machine with two GPUs and the `cuda` feature (`cargo test -p cotrain-tests --features cuda
/// --test e2e_ranks`): the NCCL backend, ranks started with torchrun's environment.
#[cfg(feature = "cuda")]
#[test]
fn two_nccl_ranks_train_the_same_weights_as_one() {
    let gpus = cotrain_model::cuda::device_count();
    if gpus < 2 {
        eprintln!("skipped: NCCL ranks need two GPUs, this machine has {gpus}");
        return;
    }
    one_rank_equals_many("", "", 2, &["agent-0", "agent-1"], &["--backend", "nccl"]);
}
