//! Peak resident memory of one rank's gradient all-reduce over MPI: the old path (every gradient
//! flattened into one buffer, plus MPI's send copy of it) against the bucketed one
//! (`dist::all_reduce_grads`), on f32 gradients shaped like Qwen2.5-0.5B's (494M parameters,
//! 1.98 GB; rank r's are all r + 1, so that the sums can be checked), no model needed. The peak (VmHWM) is reset just before the all-reduce, so
//! it measures the all-reduce alone.
//!
//! ```text
//! cargo build -p cotrain-learner --example grad_allreduce_mem
//! for path in old new; do mpirun -np 2 --oversubscribe --bind-to none --allow-run-as-root \
//!   --mca btl self,vader --mca btl_vader_single_copy_mechanism none \
//!   target/debug/examples/grad_allreduce_mem --path $path; done
//! ```

#[cfg(not(feature = "mpi"))]
fn main() {
    eprintln!("grad_allreduce_mem needs the `mpi` feature");
}

#[cfg(feature = "mpi")]
fn main() -> anyhow::Result<()> {
    use std::time::Instant;

    use cotrain_learner::config::DistBackend;
    use tch::{Device, Kind, Tensor};

    cotrain_model::allocator::tune_for_tensors();
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .iter()
        .position(|a| a == "--path")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
        .unwrap_or("new")
        .to_string();
    anyhow::ensure!(path == "old" || path == "new", "--path old|new, got {path}");

    // Old path: MPI initialised here; new path: the learner's own collective.
    let (universe, coll) = if path == "old" {
        (
            Some(mpi::initialize().ok_or_else(|| anyhow::anyhow!("MPI already initialised"))?),
            None,
        )
    } else {
        (
            None,
            Some(cotrain_learner::dist::init(DistBackend::Mpi, Device::Cpu)?),
        )
    };
    let rank = match (&universe, &coll) {
        (Some(u), _) => mpi::traits::Communicator::rank(&u.world()) as usize,
        (_, Some(c)) => c.rank(),
        _ => unreachable!(),
    };

    // Qwen2.5-0.5B: hidden 896, MLP 4864, 24 layers, 2 KV heads of 64, vocabulary 151936 (tied).
    let (h, m, kv, layers, vocab) = (896i64, 4864i64, 128i64, 24, 151936i64);
    let mut shapes: Vec<Vec<i64>> = vec![vec![vocab, h], vec![h]];
    for _ in 0..layers {
        shapes.extend([
            vec![h, h],
            vec![h],
            vec![kv, h],
            vec![kv],
            vec![kv, h],
            vec![kv],
            vec![h, h],
        ]);
        shapes.extend([vec![m, h], vec![m, h], vec![h, m], vec![h], vec![h]]);
    }
    // Parameters never touched (so not resident) but for one row each; their gradients are
    // materialised by a backward and set to rank + 1, so that every summed element must be 3.
    let params: Vec<Tensor> = shapes
        .iter()
        .map(|s| Tensor::empty(s.as_slice(), (Kind::Float, Device::Cpu)).set_requires_grad(true))
        .collect();
    params
        .iter()
        .map(|p| p.narrow(0, 0, 1).sum(Kind::Float) * 0.0)
        .reduce(|a, b| a + b)
        .unwrap()
        .backward();
    tch::no_grad(|| {
        for p in &params {
            let _ = p.grad().fill_((rank + 1) as f64);
        }
    });
    let numel: usize = params.iter().map(Tensor::numel).sum();

    std::fs::write("/proc/self/clear_refs", "5")?; // resets VmHWM to the current RSS
    let before = status_mib("VmRSS:");
    let t = Instant::now();
    match (&universe, &coll) {
        (Some(u), _) => old_all_reduce_grads(&u.world(), &params),
        (_, Some(c)) => cotrain_learner::dist::all_reduce_grads(c.as_ref(), &params)?,
        _ => unreachable!(),
    }
    let secs = t.elapsed().as_secs_f64();
    let peak = status_mib("VmHWM:");

    let (lo, hi) = params.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        let g = p.grad();
        (
            lo.min(g.min().double_value(&[])),
            hi.max(g.max().double_value(&[])),
        )
    });
    anyhow::ensure!(
        lo == 3.0 && hi == 3.0,
        "summed gradients between {lo} and {hi}, expected 3"
    );
    if rank == 0 {
        let lscpu = std::process::Command::new("lscpu")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        for line in lscpu
            .lines()
            .filter(|l| l.starts_with("Model name") || l.starts_with("CPU family"))
        {
            println!("{line}");
        }
    }
    println!(
        "rank {rank} path {path}: {numel} f32 gradients ({:.0} MiB) in {} tensors; RSS before {before:.0} MiB, peak during all-reduce {peak:.0} MiB, extra {:.0} MiB; {secs:.1} s",
        (numel * 4) as f64 / (1 << 20) as f64,
        params.len(),
        peak - before
    );
    drop(coll);
    drop(universe);
    Ok(())
}

/// The all-reduce as it was before buckets (`learner/src/dist/mod.rs` and `mpi_backend.rs`): every
/// gradient concatenated into one f32 buffer, a send copy of it for MPI, the sum copied back.
#[cfg(feature = "mpi")]
fn old_all_reduce_grads(world: &mpi::topology::SimpleCommunicator, params: &[tch::Tensor]) {
    use mpi::traits::*;
    use tch::{Kind, Tensor};
    tch::no_grad(|| {
        let flats: Vec<Tensor> = params
            .iter()
            .map(|p| p.grad().to_kind(Kind::Float).reshape([-1]))
            .collect();
        let flat = Tensor::cat(&flats, 0);
        // SAFETY: `flat` is a contiguous CPU f32 tensor of `numel` elements, alive for the slice's use.
        let buf =
            unsafe { std::slice::from_raw_parts_mut(flat.data_ptr() as *mut f32, flat.numel()) };
        let send = buf.to_vec();
        world.all_reduce_into(&send[..], buf, mpi::collective::SystemOperation::sum());
        drop(send);
        let mut offset = 0i64;
        for p in params {
            let n = p.numel() as i64;
            p.grad()
                .copy_(&flat.narrow(0, offset, n).view(p.size().as_slice()));
            offset += n;
        }
    });
}

/// A `/proc/self/status` field in MiB.
#[cfg(feature = "mpi")]
fn status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}
