//! The bucketed gradient all-reduce (`learner/src/dist/buckets.rs`) with buckets of 4 KiB, far
//! smaller than a tiny model's weights, so that gradients are split across buckets and small ones
//! share them: in process against a collective that stands for two identical ranks (every call's
//! count and kind recorded), and on two real MPI ranks against one rank on the same global batch.

use std::cell::RefCell;

use cotrain_learner::config::DistBackend;
use cotrain_learner::dist::buckets::{MAX_COUNT, plan};
use cotrain_learner::dist::launch::{LaunchSpec, mpirun_command};
use cotrain_learner::dist::{
    self, Collective, DistError, Launcher, RankEnv, all_reduce_grads_bucketed,
};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const BUCKET_BYTES: usize = 4 << 10;
const BUCKET_ELEMS: usize = BUCKET_BYTES / 4;
const VOCAB: i64 = 50;

/// Two ranks holding the same gradients: every sum doubles, and every call is recorded.
struct Twins {
    calls: RefCell<Vec<(usize, Kind)>>,
}

impl Collective for Twins {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        2
    }
    fn backend(&self) -> &'static str {
        "twins"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<(), DistError> {
        assert!(t.is_contiguous() && t.numel() <= MAX_COUNT);
        self.calls.borrow_mut().push((t.numel(), t.kind()));
        let _ = t.g_mul_scalar_(2.0);
        Ok(())
    }
    fn broadcast(&self, _t: &mut Tensor, _root: usize) -> Result<(), DistError> {
        Ok(())
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        Ok(Tensor::stack(&[t, t], 0))
    }
}

/// Embedding 50×32 (1600 weights), linear 32→64 (2048 + 64), linear 64→50 (3200 + 50): three
/// gradients larger than a 1024-element bucket and two that share one.
fn tiny_model(vs: &nn::Path) -> nn::Sequential {
    nn::seq()
        .add(nn::embedding(vs / "embed", VOCAB, 32, Default::default()))
        .add(nn::linear(vs / "up", 32, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs / "out", 64, VOCAB, Default::default()))
}

/// The summed negative log-likelihood of items `range` of step `step`'s batch of 8, divided by the
/// global batch size (as the trainers scale by the global sample count).
fn loss(model: &impl Module, step: i64, range: std::ops::Range<i64>) -> Tensor {
    let idx = Tensor::arange_start(range.start, range.end, (Kind::Int64, Device::Cpu)) + 8 * step;
    let tokens = (&idx * 7 + 3).remainder(VOCAB);
    let targets = (&idx * 11 + 5).remainder(VOCAB);
    // (N, VOCAB) log-probs, then the target's: (N, 1)
    let logp = model.forward(&tokens).log_softmax(-1, Kind::Float);
    -logp
        .gather(1, &targets.unsqueeze(1), false)
        .sum(Kind::Float)
        / 8.0
}

fn grads(vs: &nn::VarStore) -> Vec<Tensor> {
    trainable(vs).iter().map(|p| p.grad().copy()).collect()
}

/// The trainable variables, sorted by name (as the trainers' optimiser hands them over).
fn trainable(vs: &nn::VarStore) -> Vec<Tensor> {
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars.into_iter().map(|(_, t)| t).collect()
}

#[test]
fn tiny_model_gradients_in_4_kib_buckets_are_each_summed_once() {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = tiny_model(&vs.root());
    loss(&model, 0, 0..8).backward();
    let before = grads(&vs);
    let params = trainable(&vs);
    let twins = Twins {
        calls: RefCell::new(Vec::new()),
    };
    all_reduce_grads_bucketed(&twins, &params, BUCKET_BYTES).unwrap();

    for (p, g) in params.iter().zip(&before) {
        assert!(
            p.grad().equal(&(g * 2.0)),
            "a gradient of shape {:?} was not summed exactly once",
            p.size()
        );
    }
    let calls = twins.calls.into_inner();
    let numels: Vec<usize> = params.iter().map(Tensor::numel).collect();
    // In name order: embed.weight 1600 → 1024 + 576; out.bias 50 waits; out.weight 3200 →
    // 3×1024 + 128; up.bias 64 joins out.bias; up.weight 2048 → 2×1024; the shared 50 + 64 last.
    assert_eq!(
        calls.iter().map(|c| c.0).collect::<Vec<_>>(),
        vec![1024, 576, 1024, 1024, 1024, 128, 1024, 1024, 114]
    );
    assert_eq!(calls.len(), plan(&numels, BUCKET_ELEMS).len());
    assert!(
        calls
            .iter()
            .all(|&(n, k)| n <= BUCKET_ELEMS && k == Kind::Float)
    );
}

#[test]
fn bf16_gradients_are_summed_in_f32_buckets_and_written_back() {
    let big = Tensor::randn([3000], (Kind::BFloat16, Device::Cpu)).set_requires_grad(true);
    let small = Tensor::randn([7, 5], (Kind::BFloat16, Device::Cpu)).set_requires_grad(true);
    let f32_big = Tensor::randn([2500], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    ((&big * &big).sum(Kind::Float)
        + (&small * 3.0).sum(Kind::Float)
        + (&f32_big * &f32_big).sum(Kind::Float))
    .backward();
    let params = [big, small, f32_big];
    let before: Vec<Tensor> = params.iter().map(|p| p.grad().copy()).collect();
    let twins = Twins {
        calls: RefCell::new(Vec::new()),
    };
    all_reduce_grads_bucketed(&twins, &params, BUCKET_BYTES).unwrap();

    for (p, g) in params.iter().zip(&before) {
        assert_eq!(p.grad().kind(), p.kind());
        assert!(
            p.grad().equal(&(g * 2.0)),
            "a {:?} gradient was not summed exactly once",
            p.kind()
        );
    }
    let calls = twins.calls.into_inner();
    // bf16 3000 → 1024 + 1024 + 952 (staged); f32 2500 → 1024 + 1024 + 452 (in place); bf16 7×5 last.
    assert_eq!(
        calls.iter().map(|c| c.0).collect::<Vec<_>>(),
        vec![1024, 1024, 952, 1024, 1024, 452, 35]
    );
    assert!(calls.iter().all(|&(_, k)| k == Kind::Float));
}

#[test]
fn a_rank_without_gradients_contributes_zeros() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _model = tiny_model(&vs.root());
    let params = trainable(&vs);
    assert!(params.iter().all(|p| !p.grad().defined()));
    all_reduce_grads_bucketed(
        &Twins {
            calls: RefCell::new(Vec::new()),
        },
        &params,
        BUCKET_BYTES,
    )
    .unwrap();
    for p in &params {
        assert_eq!(p.grad().size(), p.size());
        assert_eq!(p.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
    }
}

/// This test started by `mpirun`: one rank of [`two_mpi_ranks_in_4_kib_buckets_match_one_rank`].
fn one_of_two_mpi_ranks() {
    let coll = dist::init(DistBackend::Mpi, Device::Cpu).unwrap();
    let rank = coll.rank() as i64;
    tch::manual_seed(7);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = tiny_model(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.5).unwrap();
    tch::manual_seed(7);
    let one_vs = nn::VarStore::new(Device::Cpu);
    let one_model = tiny_model(&one_vs.root());
    let mut one_opt = nn::Sgd::default().build(&one_vs, 0.5).unwrap();

    for step in 0..3 {
        opt.zero_grad();
        // Step 0: rank 0 takes the whole batch, and rank 1 has no gradients at all.
        let mine = if step == 0 {
            if rank == 0 { Some(0..8) } else { None }
        } else {
            Some(4 * rank..4 * rank + 4)
        };
        if let Some(range) = mine {
            loss(&model, step, range).backward();
        }
        all_reduce_grads_bucketed(coll.as_ref(), &trainable(&vs), BUCKET_BYTES).unwrap();
        one_opt.zero_grad();
        loss(&one_model, step, 0..8).backward();
        for (two, one) in grads(&vs).iter().zip(&grads(&one_vs)) {
            assert!(
                two.allclose(one, 1e-5, 1e-7, false),
                "rank {rank}, step {step}: gradients differ from one rank's"
            );
        }
        opt.step();
        one_opt.step();
    }
    for (two, one) in trainable(&vs).iter().zip(&trainable(&one_vs)) {
        let diff = (two - one).abs().max().double_value(&[]);
        assert!(
            diff < 1e-6,
            "rank {rank}: weights differ from one rank's by {diff}"
        );
    }
    println!("rank {rank}: 3 steps in 4 KiB buckets match one rank");
}

#[test]
fn two_mpi_ranks_in_4_kib_buckets_match_one_rank() {
    if RankEnv::from_env().unwrap().launcher == Launcher::Mpi {
        return one_of_two_mpi_ranks();
    }
    let name = "two_mpi_ranks_in_4_kib_buckets_match_one_rank";
    let spec = LaunchSpec {
        nproc: 2,
        backend: DistBackend::Mpi,
        master_port: None,
        args: [name, "--exact", "--nocapture", "--test-threads", "1"]
            .map(String::from)
            .to_vec(),
        token_file: None,
        nccl_one_gpu_test: false,
        network_interface: None,
        global_flags: Vec::new(),
    };
    let out = mpirun_command(&spec, &std::env::current_exe().unwrap(), is_root())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "mpirun failed ({})\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!(
                "rank {rank}: 3 steps in 4 KiB buckets match one rank"
            )),
            "rank {rank} did not check\n{stdout}"
        );
    }
}

/// Open MPI refuses to run as root unless told (containers and CI machines often are root).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2))
                .map(|u| u == "0")
        })
        .unwrap_or(false)
}
