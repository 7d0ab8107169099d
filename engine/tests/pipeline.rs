//! A model-parallel group — pipeline stages, tensor-parallel ranks, or both — gives exactly
//! the tokens and log-probabilities one process gives (concurrent requests, chunked
//! prefill, prefix caching and preemption included), and its handshake admits only ranks
//! with the secret, the protocol and the model. The ranks here are threads — stages joined
//! over loopback TCP, tensor ranks through shared memory — running the same code the
//! processes of `ferrite-engine serve` run (`tests/api/test_pipeline.py` runs those).

mod common;

use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Duration;

use candle_core::Device;
use ferrite_engine::engine::{Collected, EngineConfig, EngineHandle};
use ferrite_engine::model::{load_with, LoadOptions};
use ferrite_engine::parallel::tensor::region_path;
use ferrite_engine::parallel::wire::{self, Layout, Message, StageReport};
use ferrite_engine::parallel::{
    form_group, join_group, GroupSettings, RankSpec, Secret, TensorPeers,
};
use ferrite_engine::sampling::SamplingParams;
use ferrite_engine::Result;

const TEXT: &str = "The quick brown fox jumps over the lazy dog. In the beginning the \
universe was created. This has made a lot of people very angry and been widely regarded as a \
bad move. It was the best of times, it was the worst of times, it was the age of wisdom.";

/// A group of `stages` stages of `tensor` ranks each over `model`: the leader's engine,
/// and the other ranks' threads (each returns how its rank ended).
fn group(
    model: &Path,
    config: &EngineConfig,
    tensor: usize,
    stages: usize,
) -> (EngineHandle, Vec<JoinHandle<Result<()>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("addr").to_string();
    let spec = RankSpec {
        model: model.to_path_buf(),
        load: LoadOptions::default(),
        engine: EngineConfig {
            pipeline_parallel_size: stages,
            tensor_parallel_size: tensor,
            ..config.clone()
        },
        secret: Secret::random(),
        timeout: Duration::from_secs(120),
    };
    let peers: Vec<Option<TensorPeers>> = (0..stages)
        .map(|_| {
            (tensor > 1).then(|| TensorPeers {
                region: region_path(),
                pids: Vec::new(),
            })
        })
        .collect();
    let mut ranks = Vec::new();
    for (stage, peers) in peers.iter().enumerate() {
        for t in 1..tensor {
            let (spec, peers) = (spec.clone(), peers.clone().expect("peers"));
            ranks.push(std::thread::spawn(move || {
                spec.run_tensor_peer(stage, t, &peers.region)
            }));
        }
        if stage > 0 {
            let (spec, addr, peers) = (spec.clone(), addr.clone(), peers.clone());
            ranks.push(std::thread::spawn(move || {
                spec.run_worker(stage, &addr, peers.as_ref(), || {})
            }));
        }
    }
    match spec.start_leader(&listener, peers[0].as_ref()) {
        Ok((engine, _)) => (engine, ranks),
        // The other ranks have ended by now (refused, or failed on their own): say how, so
        // a group that did not form names the rank's own error, not only that it is missing.
        Err(e) => {
            let ranks: Vec<String> = ranks
                .into_iter()
                .map(|r| match r.join() {
                    Ok(r) => format!("{r:?}"),
                    Err(_) => "panicked".to_string(),
                })
                .collect();
            panic!("the group did not form: {e}; the other ranks ended with {ranks:?}")
        }
    }
}

/// Prompts of 3 to 40 tokens, some sharing a prefix, two identical.
fn prompts(model: &Path, n: usize) -> Vec<Vec<u32>> {
    let m = load_with(model, &Device::Cpu, &LoadOptions::default()).expect("loads");
    let ids = m.tokenizer.encode(TEXT, false).expect("encodes");
    let vocab = m.model.config().vocab_size as u32;
    let ids: Vec<u32> = ids.into_iter().map(|t| t % vocab).collect();
    let mut out: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            let start = (i * 5) % 12;
            ids[start..(start + 3 + (i * 11) % 37).min(ids.len())].to_vec()
        })
        .collect();
    out.push(out[0].clone());
    out
}

/// A completion as bits: each scored prompt token (id, log-probability), then each generated
/// token (id, log-probability, top alternatives).
type Bits = (Option<Vec<(u32, u32)>>, Vec<(u32, u32, Vec<(u32, u32)>)>);

/// Every prompt submitted at once: greedy, scored with the top 3, some prompts scored too.
fn run(engine: &EngineHandle, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Bits> {
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = SamplingParams {
                ignore_eos: true,
                logprobs: Some(3),
                prompt_logprobs: (i % 4 == 1).then_some(2),
                ..SamplingParams::greedy(max_tokens)
            };
            engine.submit(p.clone(), params).expect("accepted")
        })
        .collect();
    streams
        .into_iter()
        .map(|s| bits(s.collect_blocking().expect("completes")))
        .collect()
}

/// The bits of a completion.
fn bits(c: Collected) -> Bits {
    let lp = |l: Option<f32>| l.map_or(u32::MAX, f32::to_bits);
    let prompt = c
        .prompt
        .map(|p| p.iter().map(|t| (t.id, lp(t.logprob))).collect());
    let tokens = c
        .tokens
        .iter()
        .map(|t| {
            let top = t.top.iter().map(|&(id, l)| (id, l.to_bits())).collect();
            (t.id, lp(t.logprob), top)
        })
        .collect();
    (prompt, tokens)
}

/// Checks that a group of `stages` stages of `tensor` ranks computes what one process
/// computes, and that both preempted.
fn same_as_one_process(model: &Path, tensor: usize, stages: usize, blocks: u64) {
    let prompts = prompts(model, 15);
    let one = EngineHandle::start(
        load_with(model, &Device::Cpu, &LoadOptions::default()).expect("loads"),
        pressure(model, blocks, 1, 1),
    )
    .expect("starts");
    let want = run(&one, &prompts, 24);
    let config = pressure(model, blocks, tensor, stages);
    let (engine, workers) = group(model, &config, tensor, stages);
    let got = run(&engine, &prompts, 24);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g, w,
            "request {i} with {tensor} tensor ranks and {stages} stages"
        );
    }
    let (a, b) = (one.stats(), engine.stats());
    assert!(a.preemptions > 0 && b.preemptions > 0, "{a:?} {b:?}");
    assert!(
        b.prefix_hits > 0,
        "the twin prompt shared its prefix: {b:?}"
    );
    assert_eq!(engine.stage_stats().len(), stages);
    let steps = engine
        .stage_stats()
        .iter()
        .map(|s| s.steps)
        .collect::<Vec<_>>();
    assert!(
        steps[0] > 0 && steps.iter().all(|&n| n == steps[0]),
        "{steps:?}"
    );
    // Every stage had a step of its own to compute at once.
    assert_eq!(
        engine.stage_stats()[0].most_in_flight,
        stages as u64,
        "{:?}",
        engine.stage_stats()
    );
    drop(engine);
    for w in workers {
        w.join().expect("worker thread").expect("a clean shutdown");
    }
}

/// A cache of `blocks` blocks of 16 in the stage of `stages` with the most layers, each of
/// its `tensor` ranks holding its share of the KV heads (each rank sizes its own, the group
/// takes the smallest), and steps of at most 32 tokens, so long prompts are chunked and 16
/// requests preempt.
fn pressure(model: &Path, blocks: u64, tensor: usize, stages: usize) -> EngineConfig {
    let options = LoadOptions {
        stage: Some((0, stages)),
        ..LoadOptions::default()
    };
    let m = load_with(model, &Device::Cpu, &options).expect("loads");
    let c = m.model.config();
    let layers = m.stages.iter().map(|p| p.layers.len()).max().unwrap_or(1);
    let per_token = (2 * layers * c.num_kv_heads / tensor * c.head_dim * 2) as u64;
    EngineConfig {
        kv_cache_memory: Some(blocks * 16 * per_token),
        max_model_len: Some(64),
        max_num_batched_tokens: 32,
        ..EngineConfig::default()
    }
}

#[test]
fn two_stages_of_the_default_model_give_one_processes_tokens_and_logprobs() {
    let model = common::default_model();
    same_as_one_process(&model, 1, 2, 12);
}

#[test]
fn three_stages_of_the_default_model_give_one_processes_tokens_and_logprobs() {
    let model = common::default_model();
    same_as_one_process(&model, 1, 3, 12);
}

#[test]
fn three_tensor_ranks_of_the_default_model_give_one_processes_tokens_and_logprobs() {
    // Its 3 KV heads split only into 3 (or 1).
    let model = common::default_model();
    same_as_one_process(&model, 3, 1, 12);
}

#[test]
fn two_stages_of_tiny_gqa_models_in_several_formats_give_one_processes_tokens() {
    for name in ["tiny-Q4_K_M.gguf", "tiny-Q5_0.gguf", "tiny-F16.gguf"] {
        let model: PathBuf = common::fixture("tiny").join(name);
        same_as_one_process(&model, 1, 2, 10);
    }
}

#[test]
fn tensor_ranks_alone_and_in_stages_of_tiny_gqa_models_give_one_processes_tokens() {
    for name in ["tiny-Q4_K_M.gguf", "tiny-Q5_0.gguf", "tiny-F16.gguf"] {
        let model: PathBuf = common::fixture("tiny").join(name);
        same_as_one_process(&model, 2, 1, 10);
        same_as_one_process(&model, 2, 2, 10);
    }
}

/// Why a leader of `model` with `engine`'s sizes fails to start (empty if it starts).
fn leader_refusal(model: PathBuf, engine: EngineConfig, peers: Option<&TensorPeers>) -> String {
    let spec = RankSpec {
        model,
        load: LoadOptions::default(),
        engine,
        secret: Secret::random(),
        timeout: Duration::from_secs(1),
    };
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let err = spec.start_leader(&listener, peers).err();
    err.map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn a_tensor_size_that_does_not_divide_the_kv_heads_is_refused_naming_both() {
    let peers = TensorPeers {
        region: region_path(),
        pids: Vec::new(),
    };
    let engine = EngineConfig {
        tensor_parallel_size: 2,
        ..EngineConfig::default()
    };
    let err = leader_refusal(common::default_model(), engine, Some(&peers));
    assert!(
        err.contains("--tensor-parallel-size 2")
            && err.contains("2 does not divide the model's 3 KV heads"),
        "{err}"
    );
    assert!(!peers.region.exists(), "no shared memory is left behind");
}

#[test]
fn a_stage_per_layer_is_the_most_and_more_is_refused_naming_the_layers() {
    let engine = EngineConfig {
        pipeline_parallel_size: 3,
        ..EngineConfig::default()
    };
    let err = leader_refusal(common::fixture("tiny/tiny-F16.gguf"), engine, None);
    assert!(
        err.contains("--pipeline-parallel-size") && err.contains("2 layers"),
        "{err}"
    );
}

/// Settings for handshake tests: what matters is that both sides compare them.
fn settings(secret: &str) -> GroupSettings {
    GroupSettings {
        layout: Layout {
            pipeline: 2,
            tensor: 1,
            block_size: 16,
            max_num_batched_tokens: 64,
            max_num_seqs: 4,
            max_model_len: 64,
            kv_f16: true,
        },
        fingerprint: [5; 32],
        secret: Secret::new(secret.as_bytes()).expect("a secret"),
        timeout: Duration::from_secs(20),
        max_frame: 1 << 20,
    }
}

fn report() -> StageReport {
    StageReport {
        first_layer: 1,
        end_layer: 2,
        weight_bytes: 10,
        kv_blocks: 10,
        explanation: "test".into(),
    }
}

/// A joiner speaking protocol version `version`, otherwise correct: the leader's answer.
fn join_as_version(addr: &str, s: &GroupSettings, version: u32) -> Message {
    let stream = TcpStream::connect(addr).expect("connects");
    let mut r = BufReader::new(stream.try_clone().expect("clone"));
    let mut w = BufWriter::new(stream);
    let Ok(Message::Hello {
        nonce: challenge, ..
    }) = wire::read_frame(&mut r, 4096)
    else {
        panic!("no hello");
    };
    let nonce = [1; 32];
    let mac = wire::join_mac(
        s.secret.bytes(),
        &challenge,
        version,
        1,
        &s.layout,
        &s.fingerprint,
        &nonce,
    );
    let join = Message::Join {
        version,
        rank: 1,
        layout: s.layout,
        model: s.fingerprint,
        nonce,
        mac,
    };
    wire::write_frame(&mut w, &join).expect("sends");
    wire::read_frame(&mut r, 4096).expect("an answer")
}

#[test]
fn the_handshake_refuses_a_wrong_secret_protocol_model_or_layout_then_admits_the_right_rank() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("addr").to_string();
    let leader = std::thread::spawn(move || form_group(&listener, &settings("right"), 2));
    let refused = |s: GroupSettings| {
        join_group(&addr, 1, &s, report())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = refused(settings("wrong"));
    assert!(
        e.contains("refused rank 1: rank 1 failed authentication"),
        "{e}"
    );
    let e = refused(GroupSettings {
        fingerprint: [6; 32],
        ..settings("right")
    });
    assert!(e.contains("loaded a different model"), "{e}");
    let mut other = settings("right");
    other.layout.block_size = 32;
    let e = refused(other);
    assert!(e.contains("other settings"), "{e}");
    match join_as_version(&addr, &settings("right"), 99) {
        Message::Refused { reason } => {
            assert!(
                reason.contains("protocol version 99, the leader speaks 1"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    // Bytes that are no message at all: the leader closes that connection and goes on.
    {
        use std::io::Write;
        let mut junk = TcpStream::connect(&addr).expect("connects");
        let _ = junk.write_all(&[0xff; 64]);
    }
    let joined = join_group(&addr, 1, &settings("right"), report()).expect("admitted");
    let members = leader
        .join()
        .expect("leader thread")
        .expect("the group forms");
    assert_eq!(members.len(), 1);
    assert_eq!(members[0].report, report());
    drop(joined);
}

#[test]
fn a_group_that_does_not_form_in_time_names_the_missing_rank_and_why() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("addr").to_string();
    let short = GroupSettings {
        timeout: Duration::from_secs(2),
        ..settings("right")
    };
    let leader = std::thread::spawn(move || form_group(&listener, &short, 3));
    let _ = join_group(&addr, 2, &settings("wrong"), report());
    let err = leader
        .join()
        .expect("leader thread")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("did not form within 2 s"), "{err}");
    assert!(err.contains("rank 1 (never connected)"), "{err}");
    assert!(
        err.contains("rank 2 (refused: rank 2 failed authentication"),
        "{err}"
    );
}

#[test]
fn a_secret_is_never_shown_by_debug() {
    let s = Secret::new(b"hunter2").expect("a secret");
    assert!(!format!("{s:?}").contains("hunter2"));
    assert!(!format!("{:?}", settings("hunter2")).contains("hunter2"));
    assert!(Secret::new(b"  \n").is_err());
}
