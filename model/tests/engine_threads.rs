//! The engine's decode thread count (`engine::threads`) never changes what it generates: on the
//! default model (SmolLM2, f32 and bf16), seeded samples, greedy samples and top log-probs are the
//! same bit for bit with decode steps on 1, 2 or 3 threads and with the adaptive count, which is
//! what lets the adaptive count follow the machine's load without costing reproducibility. Needs
//! `make setup`.

mod support;

use cotrain_model::engine::{
    DecodeThreads, Engine, EngineConfig, Request, Sample, SamplingParams, StopConditions,
};
use cotrain_model::loader::{self, LoadOptions};
use support::*;
use tch::Kind;

/// The count only varies where the step runs in cotrain's kernels; they are what this checks, so
/// they serve every product whatever this machine's pinned dispatch chose (a debug build pins
/// libtorch on some CPUs). Set before any test of this binary decodes.
fn kernels_on() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: every test of this binary calls this first, before anything reads the environment.
    ONCE.call_once(|| unsafe { std::env::set_var(cotrain_model::kernels::dispatch::ENV, "on") });
}

fn generate(kind: Kind, threads: DecodeThreads) -> Vec<Vec<Sample>> {
    let opts = LoadOptions {
        kind,
        ..LoadOptions::default()
    };
    let loaded = loader::load(smollm2_path().to_str().unwrap(), &opts).unwrap();
    let prompt = loaded
        .tokenizer
        .encode(
            "def running_sum(xs):\n    \"\"\"Return the running sums of xs.",
            false,
        )
        .unwrap();
    let mut engine = Engine::with_config(
        loaded,
        EngineConfig {
            decode_threads: threads,
            ..EngineConfig::default()
        },
    );
    let stop = StopConditions {
        max_new_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    let sampled = Request {
        n: 6,
        params: SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            ..SamplingParams::default()
        },
        seed: 11,
        stop: stop.clone(),
        top_logprobs: 2,
        ..Request::new(prompt.clone())
    };
    let greedy = Request {
        params: SamplingParams::greedy(),
        stop,
        ..Request::new(prompt)
    };
    engine.generate(&[sampled, greedy]).unwrap()
}

fn same_bits(a: &[Vec<Sample>], b: &[Vec<Sample>]) -> bool {
    a.iter().flatten().zip(b.iter().flatten()).all(|(x, y)| {
        x.token_ids == y.token_ids
            && x.logprobs
                .iter()
                .map(|v| v.to_bits())
                .eq(y.logprobs.iter().map(|v| v.to_bits()))
            && x.top_logprobs
                .iter()
                .flatten()
                .map(|(t, v)| (*t, v.to_bits()))
                .eq(y
                    .top_logprobs
                    .iter()
                    .flatten()
                    .map(|(t, v)| (*t, v.to_bits())))
    })
}

#[test]
fn decode_thread_count_leaves_samples_bit_identical() {
    if !cotrain_model::kernels::gemm_f32::is_available() {
        eprintln!("skipped: no AVX-512F, so decode steps run in libtorch at the configured count");
        return;
    }
    kernels_on();
    tch::set_num_threads(3);
    for kind in [Kind::Float, Kind::BFloat16] {
        let reference = generate(kind, DecodeThreads::Fixed(1));
        assert_eq!(reference.iter().map(Vec::len).sum::<usize>(), 7);
        for threads in [
            DecodeThreads::Fixed(2),
            DecodeThreads::Fixed(3),
            DecodeThreads::Adaptive,
        ] {
            assert!(
                same_bits(&reference, &generate(kind, threads)),
                "{kind:?}: {threads:?} differs from one thread"
            );
        }
    }
}
