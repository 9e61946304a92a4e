//! Weight sync alone, gRPC chunks against /dev/shm, in the same conditions: the embedded default
//! model for two agents on an embedded worker, `--rounds` pushes of both agents per transport.
//!
//! `cargo run --release -p cotrain-learner --example weight_sync_bench -- --rounds 3`

use std::time::Instant;

use cotrain_learner::config::WeightTransport;
use cotrain_learner::services::embedded::EmbeddedRollout;
use cotrain_learner::services::{PoolRollout, runtime};
use cotrain_learner::trainer::RolloutSource;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    // SAFETY: first thing in `main`, before any other thread and any libtorch call.
    unsafe { cotrain_model::mkl_dispatch::prefer_avx512() };
    cotrain_model::allocator::tune_for_tensors();
    println!("cpu: {}", cotrain_model::cpu::CpuFacts::probe().summary());
    println!(
        "roofline: {}",
        cotrain_model::cpu::Roofline::measure().summary()
    );
    let rounds: u64 = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let model =
        cotrain_model::loader::load("default", &cotrain_model::loader::LoadOptions::default())?;
    let params = model.named_parameters();
    let rt = runtime()?;
    let agents: Vec<(String, String)> = (0..2)
        .map(|i| (format!("agent{i}"), "default".to_string()))
        .collect();
    let worker = EmbeddedRollout::start(rt.clone(), &agents, tch::Device::Cpu, tch::Kind::Float)?;
    let mut version = 0;
    for transport in [
        WeightTransport::Grpc,
        WeightTransport::Shm,
        WeightTransport::Grpc,
        WeightTransport::Shm,
    ] {
        let mut pool = PoolRollout::connect(
            rt.clone(),
            vec![format!("http://{}", worker.grpc)],
            vec![],
            std::time::Duration::from_secs(600),
            1,
            std::time::Duration::from_secs(5),
            std::time::Duration::from_secs(60),
        )?
        .with_weight_transport(transport);
        let mut times = Vec::new();
        for _ in 0..rounds {
            version += 1;
            let t = Instant::now();
            for (agent, _) in &agents {
                pool.push_weights(agent, version, &params)?;
            }
            times.push(t.elapsed().as_secs_f64());
        }
        let best = times.iter().cloned().fold(f64::INFINITY, f64::min);
        eprintln!("{transport:?}: weight sync of 2 agents: best {best:.2} s, all {times:.2?}");
    }
    drop(worker);
    Ok(())
}
