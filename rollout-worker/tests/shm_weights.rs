//! The shared-memory weight transport end to end: the real binary on ephemeral ports, a weight
//! file in /dev/shm, the update named in the `UpdateWeights` stream.

mod support;

use std::sync::Arc;
use std::time::Duration;

use cotrain_proto::rollout::rollout_client::RolloutClient;
use cotrain_proto::rollout::{
    GenerateResponse, ListParametersRequest, ShmWeights, UpdateHeader, UpdateWeightsRequest,
    UpdateWeightsResponse, update_weights_request::Item,
};
use cotrain_rollout_client::pool::{PoolConfig, RolloutPool, update_stream};
use cotrain_rollout_client::shm::{SHM_FLAG, ShmFile};
use cotrain_rollout_client::wire::{UpdatedTensor, WireDType};
use support::*;
use tonic::transport::Channel;
use tonic::{Code, Status};

const AGENT: &str = "alice";

fn tokens(r: &GenerateResponse) -> Vec<Vec<Vec<u32>>> {
    r.completions
        .iter()
        .map(|c| c.samples.iter().map(|s| s.token_ids.clone()).collect())
        .collect()
}

/// Every parameter of the agent's model replaced with random values (a full update).
async fn full_update(c: &mut RolloutClient<Channel>, seed: u32) -> Vec<UpdatedTensor> {
    let params = c
        .list_parameters(ListParametersRequest {
            agent: AGENT.into(),
        })
        .await
        .unwrap()
        .into_inner();
    params
        .parameters
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let numel: i64 = p.shape.iter().product();
            UpdatedTensor {
                name: p.name.clone(),
                dtype: WireDType::F32,
                shape: p.shape.clone(),
                data: random_f32_bytes(numel as usize, seed + i as u32),
            }
        })
        .collect()
}

fn shm_file(tensors: &[UpdatedTensor], version: u64) -> ShmFile {
    let mut f = ShmFile::create(AGENT, version).expect("create a file in /dev/shm");
    for t in tensors {
        f.write_tensor(&t.name, t.dtype, &t.shape, &t.data).unwrap();
    }
    f
}

async fn push_shm(
    c: &mut RolloutClient<Channel>,
    version: u64,
    msg: ShmWeights,
) -> Result<UpdateWeightsResponse, Status> {
    let header = UpdateHeader {
        agent: AGENT.into(),
        version,
        tensor_count: msg.tensors.len() as u32,
        partial: false,
        lora_scaling: 0.0,
        probe: None,
    };
    let msgs = vec![
        UpdateWeightsRequest {
            item: Some(Item::Header(header)),
        },
        UpdateWeightsRequest {
            item: Some(Item::Shm(msg)),
        },
    ];
    c.update_weights(futures::stream::iter(msgs))
        .await
        .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_update_equals_the_same_update_over_grpc_and_refusals_keep_the_old_weights() {
    let model = TinyModel::new("llama");
    let shm_worker =
        WorkerProcess::start(&[(AGENT, &model.spec())], &["--allow-shm-weights"]).await;
    let grpc_worker = WorkerProcess::start(&[(AGENT, &model.spec())], &[]).await;
    assert!(shm_worker.info().await.shm_weights);
    assert!(!grpc_worker.info().await.shm_weights);
    let (mut a, mut b) = (shm_worker.client().await, grpc_worker.client().await);
    let probe = request(AGENT, vec![token_prompt(vec![3, 4, 5])], 2, 99, 20);
    let before = tokens(&a.generate(probe.clone()).await.unwrap().into_inner());

    let tensors = Arc::new(full_update(&mut a, 7).await);
    let file = shm_file(&tensors, 1);

    // Without the opt-in the worker refuses, naming the flag, and keeps its weights.
    let e = push_shm(&mut b, 1, file.message()).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains(SHM_FLAG), "{}", e.message());
    assert_eq!(grpc_worker.info().await.agents[0].policy_version, 0);

    // Refusals on the opted-in worker: the file's size, a file outside /dev/shm, a wrong shape.
    let mut wrong = file.message();
    wrong.size += 4;
    let e = push_shm(&mut a, 1, wrong).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("the message declares"),
        "{}",
        e.message()
    );
    let mut wrong = file.message();
    wrong.path = format!(
        "/tmp/{}",
        file.path().file_name().unwrap().to_str().unwrap()
    );
    let e = push_shm(&mut a, 1, wrong).await.unwrap_err();
    assert!(
        e.message().contains("is not directly in /dev/shm"),
        "{}",
        e.message()
    );
    let mut wrong = file.message();
    wrong.tensors[0].shape.reverse();
    wrong.tensors[0].shape.push(1);
    let e = push_shm(&mut a, 1, wrong).await.unwrap_err();
    assert!(
        e.message().contains("does not match the model's"),
        "{}",
        e.message()
    );
    // A chunk after the shm message is refused.
    let header = UpdateHeader {
        agent: AGENT.into(),
        version: 1,
        tensor_count: tensors.len() as u32,
        partial: false,
        lora_scaling: 0.0,
        probe: None,
    };
    let mut mixed: Vec<UpdateWeightsRequest> = update_stream(header, tensors.clone(), 1 << 20)
        .collect()
        .await;
    mixed.insert(
        1,
        UpdateWeightsRequest {
            item: Some(Item::Shm(file.message())),
        },
    );
    let e = a
        .update_weights(futures::stream::iter(mixed))
        .await
        .unwrap_err();
    assert!(
        e.message().contains("after the shm message"),
        "{}",
        e.message()
    );
    assert_eq!(shm_worker.info().await.agents[0].policy_version, 0);
    assert_eq!(
        tokens(&a.generate(probe.clone()).await.unwrap().into_inner()),
        before,
        "a refused update changed the weights"
    );

    // Through the pool: the worker takes the file, version 1.
    let pool = RolloutPool::new(PoolConfig {
        endpoints: vec![shm_worker.endpoint()],
        ..PoolConfig::default()
    })
    .await
    .unwrap();
    pool.shm_capable()
        .await
        .expect("a loopback worker with the opt-in");
    let answers = pool
        .push_weights_shm(AGENT, 1, false, &file.message())
        .await;
    assert_eq!(answers.len(), 1);
    let ok = answers[0].1.as_ref().expect("shm update accepted");
    assert_eq!(
        (ok.version, ok.tensors_updated as usize),
        (1, tensors.len())
    );
    assert_eq!(ok.bytes_received, file.message().size);
    let path = file.path().to_path_buf();
    drop(file);
    assert!(!path.exists(), "the weight file outlived its guard");

    // The same weights over gRPC chunks on the other worker give the same samples.
    let header = UpdateHeader {
        agent: AGENT.into(),
        version: 1,
        tensor_count: tensors.len() as u32,
        partial: false,
        lora_scaling: 0.0,
        probe: None,
    };
    b.update_weights(update_stream(header, tensors.clone(), 1 << 16))
        .await
        .expect("grpc update");
    let after_shm = a.generate(probe.clone()).await.unwrap().into_inner();
    let after_grpc = b.generate(probe).await.unwrap().into_inner();
    assert!(
        after_shm.completions[0]
            .samples
            .iter()
            .all(|s| s.policy_version == 1)
    );
    assert_ne!(
        tokens(&after_shm),
        before,
        "the shm update did not change the samples"
    );
    assert_eq!(
        tokens(&after_shm),
        tokens(&after_grpc),
        "shm and gRPC updates disagree"
    );
    wait_info(&mut a, Duration::from_secs(5), |i| {
        i.agents[0].policy_version == 1
    })
    .await;
}

use futures::StreamExt as _;
