//! The learner's reward-server client against a server that answers wrongly: a Score response with
//! fewer results than joint actions is an error naming both counts, not a short list that MaPoRL
//! and the verifier's labelling would index past.

use std::sync::Arc;
use std::time::Duration;

use cotrain_learner::services::GrpcReward;
use cotrain_learner::trainer::{RewardSource, ScoreAction};
use cotrain_proto::reward as pb;
use tonic::{Request, Response, Status};

/// Scores every joint action but the last.
struct OneShort;

#[tonic::async_trait]
impl pb::reward_server::Reward for OneShort {
    async fn score(
        &self,
        request: Request<pb::ScoreRequest>,
    ) -> Result<Response<pb::ScoreResponse>, Status> {
        let n = request.into_inner().actions.len();
        let results = (1..n)
            .map(|_| pb::ScoreResult {
                reward: 1.0,
                ..Default::default()
            })
            .collect();
        Ok(Response::new(pb::ScoreResponse {
            results,
            ..Default::default()
        }))
    }
    async fn analyze(
        &self,
        _: Request<pb::AnalyzeRequest>,
    ) -> Result<Response<pb::AnalyzeResponse>, Status> {
        Err(Status::unimplemented("analyze"))
    }
    async fn execute(
        &self,
        _: Request<pb::ExecuteRequest>,
    ) -> Result<Response<pb::ExecuteResponse>, Status> {
        Err(Status::unimplemented("execute"))
    }
    async fn info(
        &self,
        _: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        Err(Status::unimplemented("info"))
    }
    async fn verify(
        &self,
        _: Request<pb::VerifyRequest>,
    ) -> Result<Response<pb::VerifyResponse>, Status> {
        Err(Status::unimplemented("verify"))
    }
}

#[test]
fn a_score_response_with_too_few_results_is_an_error_naming_the_counts() {
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    );
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(pb::reward_server::RewardServer::new(OneShort))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let mut client = GrpcReward::connect(
        rt.clone(),
        &format!("http://{addr}"),
        Duration::from_secs(30),
        None,
    )
    .unwrap();
    let action = |text: &str| ScoreAction {
        completions: vec![text.into()],
        completion_ids: vec![vec![1]],
        item: serde_json::json!({}),
    };
    let e = client
        .score("tldr", &[action("a"), action("b"), action("c")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 scores for 3 joint actions"), "{e}");
}
