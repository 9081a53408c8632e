//! `chorus::sync` (DistributedDataParallel for Rust) on real ranks
//! (`chorus::spawn`, ranks as actors in one process): bucket layout and rebuild,
//! overlap observed, averages against a naive per-tensor all-reduce, a
//! small model trained on N ranks against one rank with the whole batch,
//! the errors, no_sync, the half-precision hooks, and an elastic job that
//! loses a rank mid-step and goes on after `rebind`, and uneven inputs
//! finished with `join`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chorus::sync::{Average, BucketInfo, CommHook, Compress, HookFuture};
use chorus::{DistributedSync, ProcessGroup, ReduceOp, SyncError, SyncOptions, Tensor, spawn};

mod common;
use common::within;

fn named(sizes: &[usize], fill: impl Fn(usize, usize) -> f32) -> Vec<(String, Vec<f32>)> {
    sizes
        .iter()
        .enumerate()
        .map(|(p, &n)| (format!("p{p}"), (0..n).map(|i| fill(p, i)).collect()))
        .collect()
}

/// Small caps, in bytes, so a few small parameters make several buckets.
fn small_buckets(first: usize, rest: usize) -> SyncOptions {
    SyncOptions {
        first_bucket_bytes: first,
        bucket_cap_mb: rest as f64 / (1 << 20) as f64,
        ..SyncOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buckets_start_reversed_then_follow_rank_0s_ready_order() {
    within(60, "bucket order", async {
        let layouts = spawn(3, |pg| async move {
            // 6 parameters of 16 floats (64 B): first bucket 64 B, then 128 B.
            let mut model = named(&[16; 6], |_, _| 0.0);
            let mut ddp = DistributedSync::new(&pg, &mut model, small_buckets(64, 128))
                .await
                .unwrap();
            let initial: Vec<Vec<usize>> = ddp.layout().buckets.iter().map(|b| b.params.clone()).collect();
            // Rank 0 produces gradients first-to-last; the others in yet
            // another order: every rank must adopt rank 0's.
            let order: Vec<usize> = if pg.rank() == 0 {
                vec![0, 1, 2, 3, 4, 5]
            } else {
                vec![5, 3, 4, 1, 2, 0]
            };
            for p in order {
                ddp.mark_ready(p).unwrap();
            }
            ddp.finish().await.unwrap();
            let rebuilt: Vec<Vec<usize>> = ddp.layout().buckets.iter().map(|b| b.params.clone()).collect();
            (initial, rebuilt)
        })
        .await
        .unwrap();
        for (rank, (initial, rebuilt)) in layouts.iter().enumerate() {
            assert_eq!(initial, &vec![vec![5], vec![4, 3], vec![2, 1], vec![0]], "rank {rank}");
            assert_eq!(rebuilt, &vec![vec![0], vec![1, 2], vec![3, 4], vec![5]], "rank {rank}");
        }
    })
    .await;
}

#[test]
fn default_buckets_are_one_mib_then_twenty_five() {
    // The layout is a pure function; DDP's defaults on 4 MiB parameters.
    use chorus::sync::plan::{BucketCaps, ParamSpec, assign_buckets, reverse_order};
    let specs: Vec<ParamSpec> = (0..16)
        .map(|i| ParamSpec {
            name: format!("p{i}"),
            dtype: chorus::DType::Float32,
            len: 1 << 20,
        })
        .collect();
    let layout = assign_buckets(&specs, &reverse_order(16), BucketCaps::default());
    let mib: Vec<usize> = layout.buckets.iter().map(|b| (b.len * 4) >> 20).collect();
    assert_eq!(mib, vec![4, 28, 28, 4]);
    assert_eq!(layout.buckets[0].params, vec![15]);
}

/// Wraps the default hook and records when bucket `watch` finished.
struct Watch {
    watch: usize,
    done: Arc<AtomicBool>,
}

impl CommHook for Watch {
    fn reduce(&mut self, group: &ProcessGroup, bucket: BucketInfo, data: Tensor) -> HookFuture {
        let inner = Average.reduce(group, bucket, data);
        let done = (bucket.index == self.watch).then(|| self.done.clone());
        Box::pin(async move {
            let out = inner.await;
            if let Some(done) = done {
                done.store(true, Ordering::SeqCst);
            }
            out
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_is_reduced_before_the_last_gradient_is_ready() {
    within(60, "overlap", async {
        let seen = spawn(2, |pg| async move {
            let mut model = named(&[1000, 1000, 1000], |_, i| i as f32);
            let options = SyncOptions {
                rebuild_buckets: false,
                ..small_buckets(4000, 4000)
            };
            let mut ddp = DistributedSync::new(&pg, &mut model, options).await.unwrap();
            let done = Arc::new(AtomicBool::new(false));
            ddp.register_comm_hook(Box::new(Watch {
                watch: 0,
                done: done.clone(),
            }));
            assert_eq!(ddp.layout().buckets.len(), 3);
            ddp.grad_mut::<f32>(2).unwrap().fill(pg.rank() as f32);
            ddp.mark_ready(2).unwrap();
            // The backward pass goes on; bucket 0 must finish meanwhile,
            // with nobody waiting on it.
            let start = Instant::now();
            while !done.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let reduced_early = done.load(Ordering::SeqCst);
            ddp.mark_ready(1).unwrap();
            ddp.mark_ready(0).unwrap();
            ddp.finish().await.unwrap();
            (reduced_early, ddp.grad::<f32>(2).unwrap()[0])
        })
        .await
        .unwrap();
        for (rank, (early, value)) in seen.into_iter().enumerate() {
            assert!(
                early,
                "rank {rank}: bucket 0 was not reduced before the last mark_ready"
            );
            assert_eq!(value, 0.5, "rank {rank}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn averaged_gradients_equal_a_naive_per_tensor_all_reduce() {
    within(60, "averages", async {
        for world in [3, 5] {
            spawn(world, |pg| async move {
                let sizes = [1, 7, 1001, 33_333, 3, 0, 129];
                let mut model = named(&sizes, |_, _| 0.0);
                let mut ddp = DistributedSync::new(&pg, &mut model, small_buckets(1000, 40_000))
                    .await
                    .unwrap();
                for step in 0..2 {
                    // Small integers: every summation order gives the same sum.
                    let value = |p: usize, i: usize| ((pg.rank() * 7 + p * 3 + i + step) % 13) as f32;
                    for p in (0..sizes.len()).rev() {
                        for (i, g) in ddp.grad_mut::<f32>(p).unwrap().iter_mut().enumerate() {
                            *g = value(p, i);
                        }
                        ddp.mark_ready(p).unwrap();
                    }
                    ddp.finish().await.unwrap();
                    for (p, &n) in sizes.iter().enumerate() {
                        let mine: Vec<f32> = (0..n).map(|i| value(p, i)).collect();
                        let naive = pg.all_reduce(Tensor::from_slice(&mine), ReduceOp::Avg).await.unwrap();
                        assert_eq!(
                            ddp.grad::<f32>(p).unwrap(),
                            naive.to_vec::<f32>().unwrap(),
                            "world {} step {step} param {p}",
                            pg.world_size()
                        );
                    }
                }
            })
            .await
            .unwrap();
        }
    })
    .await;
}

/// A two-layer perceptron, `y = W2 tanh(W1 x + b1) + b2`, with its gradient
/// of the mean squared error written out by hand.
#[derive(Clone, Debug)]
struct Mlp {
    params: Vec<(String, Vec<f64>)>,
}

const IN: usize = 3;
const HIDDEN: usize = 5;
const OUT: usize = 2;

impl Mlp {
    fn new(seed: u64) -> Self {
        let mut state = seed;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64 / (1u64 << 53) as f64) - 0.5
        };
        let mut layer = |n: usize| (0..n).map(|_| next()).collect::<Vec<f64>>();
        Self {
            params: vec![
                ("fc1.weight".into(), layer(HIDDEN * IN)),
                ("fc1.bias".into(), layer(HIDDEN)),
                ("fc2.weight".into(), layer(OUT * HIDDEN)),
                ("fc2.bias".into(), layer(OUT)),
            ],
        }
    }

    /// Gradients (in parameter order) of the mean over `batch` of `|y - t|^2`.
    fn grads(&self, batch: &[([f64; IN], [f64; OUT])]) -> Vec<Vec<f64>> {
        let [w1, b1, w2, b2] = [0, 1, 2, 3].map(|i| &self.params[i].1);
        let mut g: Vec<Vec<f64>> = self.params.iter().map(|(_, v)| vec![0.0; v.len()]).collect();
        let scale = 1.0 / batch.len() as f64;
        for (x, t) in batch {
            let h: Vec<f64> = (0..HIDDEN)
                .map(|j| (b1[j] + (0..IN).map(|k| w1[j * IN + k] * x[k]).sum::<f64>()).tanh())
                .collect();
            let dy: Vec<f64> = (0..OUT)
                .map(|o| 2.0 * (b2[o] + (0..HIDDEN).map(|j| w2[o * HIDDEN + j] * h[j]).sum::<f64>() - t[o]) * scale)
                .collect();
            for o in 0..OUT {
                g[3][o] += dy[o];
                for j in 0..HIDDEN {
                    g[2][o * HIDDEN + j] += dy[o] * h[j];
                }
            }
            for j in 0..HIDDEN {
                let dh = (0..OUT).map(|o| dy[o] * w2[o * HIDDEN + j]).sum::<f64>() * (1.0 - h[j] * h[j]);
                g[1][j] += dh;
                for k in 0..IN {
                    g[0][j * IN + k] += dh * x[k];
                }
            }
        }
        g
    }

    fn sgd(&mut self, grads: impl Fn(usize) -> Vec<f64>, lr: f64) {
        for (p, (_, values)) in self.params.iter_mut().enumerate() {
            for (v, g) in values.iter_mut().zip(grads(p)) {
                *v -= lr * g;
            }
        }
    }
}

fn sample(i: usize) -> ([f64; IN], [f64; OUT]) {
    let x = [(i as f64 * 0.37).sin(), (i as f64 * 0.11).cos(), (i % 7) as f64 / 7.0];
    (x, [x[0] * 2.0 - x[1], x[2] + 0.5 * x[0] * x[1]])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_ranks_with_batch_b_train_like_one_rank_with_batch_3b() {
    const WORLD: usize = 3;
    const B: usize = 4;
    const STEPS: usize = 6;
    const LR: f64 = 0.1;
    within(60, "training", async {
        let mut reference = Mlp::new(7);
        for step in 0..STEPS {
            let batch: Vec<_> = (0..WORLD * B).map(|i| sample(step * WORLD * B + i)).collect();
            let grads = reference.grads(&batch);
            reference.sgd(|p| grads[p].clone(), LR);
        }
        let trained = spawn(WORLD, |pg| async move {
            // Every rank starts from its own weights: rank 0's win at construction.
            let mut model = Mlp::new(7 + pg.rank() as u64 * 1000);
            let mut ddp = DistributedSync::new(&pg, &mut model.params, SyncOptions::default())
                .await
                .unwrap();
            for step in 0..STEPS {
                let mine: Vec<_> = (0..B).map(|i| sample(step * WORLD * B + pg.rank() * B + i)).collect();
                let grads = model.grads(&mine);
                for p in (0..grads.len()).rev() {
                    ddp.grad_mut::<f64>(p).unwrap().copy_from_slice(&grads[p]);
                    ddp.mark_ready(p).unwrap();
                }
                ddp.finish().await.unwrap();
                model.sgd(|p| ddp.grad::<f64>(p).unwrap().to_vec(), LR);
            }
            ddp.verify(&mut model.params).await.unwrap();
            model
        })
        .await
        .unwrap();
        for (rank, model) in trained.iter().enumerate() {
            for ((name, got), (_, want)) in model.params.iter().zip(&reference.params) {
                for (g, w) in got.iter().zip(want) {
                    assert!((g - w).abs() < 1e-12, "rank {rank} {name}: {g} vs {w}");
                }
            }
        }
        // Training moved the weights: the comparison is not of the initial values.
        assert_ne!(reference.params[0].1, Mlp::new(7).params[0].1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatched_parameter_fails_every_rank_naming_it_and_both_values() {
    within(60, "mismatch", async {
        let errors = spawn(3, |pg| async move {
            let wrong = if pg.rank() == 2 { 11 } else { 12 };
            let mut model = vec![
                ("fc.weight".to_string(), vec![0f32; wrong]),
                ("fc.bias".to_string(), vec![0f32; 3]),
            ];
            DistributedSync::new(&pg, &mut model, SyncOptions::default())
                .await
                .expect_err("a mismatch must fail")
                .to_string()
        })
        .await
        .unwrap();
        for (rank, text) in errors.iter().enumerate() {
            assert!(
                text.contains("rank 2")
                    && text.contains("'fc.weight' float32 x 12")
                    && text.contains("'fc.weight' float32 x 11"),
                "rank {rank}: {text}"
            );
        }
        let errors = spawn(2, |pg| async move {
            let mut model: Vec<(String, Vec<f32>)> = vec![("a".into(), vec![0.0; 2])];
            if pg.rank() == 0 {
                model.push(("b".into(), vec![0.0; 2]));
            }
            DistributedSync::new(&pg, &mut model, SyncOptions::default())
                .await
                .expect_err("a shorter list must fail")
                .to_string()
        })
        .await
        .unwrap();
        assert!(
            errors.iter().all(|t| t.contains("'b'") && t.contains("nothing")),
            "{errors:?}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmarked_gradient_is_named_or_counts_as_zero() {
    within(60, "unmarked", async {
        let results = spawn(2, |pg| async move {
            let mut model = named(&[4, 4], |_, _| 0.0);
            let mut strict = DistributedSync::new(&pg, &mut model, SyncOptions::default())
                .await
                .unwrap();
            strict.mark_ready(1).unwrap();
            let twice = strict.mark_ready(1).expect_err("twice").to_string();
            if pg.rank() == 0 {
                strict.mark_ready(0).unwrap();
            }
            let strict_result = strict.finish().await.map_err(|e| e.to_string());
            // The group is still usable: the bucket went out with a zero.
            let options = SyncOptions {
                find_unused_parameters: true,
                ..SyncOptions::default()
            };
            let mut lenient = DistributedSync::new(&pg, &mut model, options).await.unwrap();
            lenient.grad_mut::<f32>(0).unwrap().fill(8.0);
            lenient.grad_mut::<f32>(1).unwrap().fill(2.0);
            lenient.mark_ready(1).unwrap();
            if pg.rank() == 0 {
                lenient.mark_ready(0).unwrap();
            }
            lenient.finish().await.unwrap();
            (
                twice,
                strict_result,
                lenient.grad::<f32>(0).unwrap().to_vec(),
                lenient.grad::<f32>(1).unwrap()[0],
            )
        })
        .await
        .unwrap();
        assert!(results[0].0.contains("'p1' marked ready twice"), "{}", results[0].0);
        assert!(results[0].1.is_ok(), "{:?}", results[0].1);
        let err = results[1].1.as_ref().expect_err("rank 1 never marked p0");
        assert!(err.contains("p0") && err.contains("find_unused_parameters"), "{err}");
        for (rank, (_, _, p0, p1)) in results.iter().enumerate() {
            assert_eq!(p0, &vec![4.0; 4], "rank {rank}: rank 1's unused p0 counts as zero");
            assert_eq!(*p1, 2.0, "rank {rank}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_the_rank_whose_parameters_diverged() {
    within(60, "verify", async {
        let errors = spawn(3, |pg| async move {
            let mut model = named(&[5, 9], |p, i| (p * 10 + i + pg.rank() * 100) as f32);
            let ddp = DistributedSync::new(&pg, &mut model, SyncOptions::default())
                .await
                .unwrap();
            // The broadcast made every rank equal to rank 0.
            assert_eq!(model[1].1[0], 10.0);
            ddp.verify(&mut model).await.unwrap();
            if pg.rank() == 2 {
                model[1].1[3] += 1.0;
            }
            ddp.verify(&mut model).await.expect_err("rank 2 diverged").to_string()
        })
        .await
        .unwrap();
        for (rank, text) in errors.iter().enumerate() {
            assert!(
                text.contains("rank 2 (first at 'p1')") && !text.contains("rank 1"),
                "rank {rank}: {text}"
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sync_accumulates_and_the_next_step_reduces_the_sum() {
    within(60, "no_sync", async {
        let grads = spawn(2, |pg| async move {
            let mut model = named(&[3, 5], |_, _| 0.0);
            let mut ddp = DistributedSync::new(&pg, &mut model, SyncOptions::default())
                .await
                .unwrap();
            let add = |ddp: &mut DistributedSync<'_>, by: f32| {
                for p in 0..2 {
                    ddp.grad_mut::<f32>(p).unwrap().iter_mut().for_each(|g| *g += by);
                }
            };
            {
                let mut accumulating = ddp.no_sync();
                add(&mut accumulating, 1.0 + pg.rank() as f32);
                accumulating.mark_ready(1).unwrap();
                accumulating.mark_ready(0).unwrap();
                accumulating.finish().await.unwrap();
                // Nothing was reduced: the local sum is still there.
                assert_eq!(accumulating.grad::<f32>(0).unwrap()[0], 1.0 + pg.rank() as f32);
            }
            add(&mut ddp, 10.0);
            ddp.mark_ready(1).unwrap();
            ddp.mark_ready(0).unwrap();
            ddp.finish().await.unwrap();
            ddp.grad::<f32>(1).unwrap().to_vec()
        })
        .await
        .unwrap();
        // (1 + 10 + 2 + 10) / 2
        assert!(grads.iter().all(|g| g == &vec![11.5; 5]), "{grads:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fp16_and_bf16_hooks_average_within_their_precision() {
    within(60, "compression hooks", async {
        for (hook, tolerance) in [("fp16", 2e-3), ("bf16", 1.6e-2)] {
            let value = |rank: usize, i: usize| (((rank * 31 + i * 17) % 1000) as f32 / 500.0) - 1.0;
            let results = spawn(3, move |pg| async move {
                let mut model = named(&[2000, 333], |_, _| 0.0);
                let mut ddp = DistributedSync::new(&pg, &mut model, SyncOptions::default())
                    .await
                    .unwrap();
                ddp.register_comm_hook(Box::new(if hook == "fp16" {
                    Compress::fp16()
                } else {
                    Compress::bf16()
                }));
                for p in [1, 0] {
                    for (i, g) in ddp.grad_mut::<f32>(p).unwrap().iter_mut().enumerate() {
                        *g = value(pg.rank(), i);
                    }
                    ddp.mark_ready(p).unwrap();
                }
                ddp.finish().await.unwrap();
                ddp.grad::<f32>(0).unwrap().to_vec()
            })
            .await
            .unwrap();
            let exact: Vec<f32> = (0..2000)
                .map(|i| (0..3).map(|r| value(r, i)).sum::<f32>() / 3.0)
                .collect();
            for (rank, got) in results.iter().enumerate() {
                let worst = got.iter().zip(&exact).map(|(g, e)| (g - e).abs()).fold(0.0, f32::max);
                assert!(worst <= tolerance, "{hook} rank {rank}: error {worst} > {tolerance}");
                // Compressed for real: not bit-identical to the f32 average everywhere.
                assert!(got.iter().zip(&exact).any(|(g, e)| g != e), "{hook}: no rounding seen");
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gradients_are_views_and_busy_while_their_bucket_is_reduced() {
    within(60, "views", async {
        let checks = spawn(2, |pg| async move {
            let mut model = named(&[4, 4], |_, _| 0.0);
            let mut ddp = DistributedSync::new(&pg, &mut model, SyncOptions::default())
                .await
                .unwrap();
            let wrong = matches!(ddp.grad::<f64>(0), Err(SyncError::WrongType { .. }));
            let unknown = matches!(ddp.mark_ready(7), Err(SyncError::Unknown(_)));
            ddp.mark_ready(1).unwrap();
            ddp.mark_ready(0).unwrap();
            let busy = matches!(ddp.grad_mut::<f32>(0), Err(SyncError::InFlight(_)));
            ddp.finish().await.unwrap();
            (wrong, unknown, busy, ddp.grad::<f32>(0).is_ok())
        })
        .await
        .unwrap();
        assert!(checks.iter().all(|&c| c == (true, true, true, true)), "{checks:?}");
    })
    .await;
}

#[test]
fn bench_ddp_over_real_processes_reports_buckets_started_during_the_backward_pass() {
    let mut command = std::process::Command::new(common::chorus_bin());
    command
        .args([
            "bench", "ddp", "--world", "3", "--params", "3M", "--steps", "2", "--warmup", "1",
        ])
        .args(["--bucket-cap-mb", "4", "--json", "--timeout", "60"])
        .env("CHORUS_LOG", "warn")
        .stdin(std::process::Stdio::null());
    let output = common::run(&mut command, 120, "chorus bench ddp", common::Stop::Kill);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let row: serde_json::Value = stdout
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON line in {stdout}"));
    assert_eq!(
        (row["library"].as_str(), row["world"].as_u64()),
        (Some("chorus"), Some(3))
    );
    let buckets = row["buckets"].as_u64().unwrap() as usize;
    let timeline = row["timeline"].as_array().unwrap();
    // 12 MB: a 1 MiB bucket, then 4 MiB ones.
    assert!(buckets >= 3, "{row}");
    assert_eq!(timeline.len(), buckets, "{row}");
    let first_start = timeline[0]["start_ms"].as_f64().unwrap();
    assert!(first_start < row["backward_ms"].as_f64().unwrap(), "{row}");
    assert!(row["exposed_sync_ms"].as_f64().unwrap() >= 0.0 && row["no_sync_ms"].as_f64().unwrap() > 0.0);
}

fn powersgd_now() -> chorus::sync::PowerSgdOptions {
    chorus::sync::PowerSgdOptions {
        start_iter: 0,
        ..chorus::sync::PowerSgdOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn powersgd_sends_two_thin_factors_and_recovers_a_rank_one_average() {
    within(60, "powersgd rank one", async {
        let results = spawn(3, |pg| async move {
            let mut model = named(&[400], |_, _| 0.0);
            let mut ddp = DistributedSync::new(&pg, &mut model, SyncOptions::default())
                .await
                .unwrap();
            let hook = chorus::sync::PowerSgd::new(&pg, powersgd_now()).await.unwrap();
            let probe = Arc::new(std::sync::Mutex::new(None::<u64>));
            // Reads the hook's traffic counter after each bucket.
            struct Counting(chorus::sync::PowerSgd, Arc<std::sync::Mutex<Option<u64>>>);
            impl CommHook for Counting {
                fn reduce(&mut self, group: &ProcessGroup, bucket: BucketInfo, data: Tensor) -> HookFuture {
                    let out = self.0.reduce(group, bucket, data);
                    *self.1.lock().unwrap() = Some(self.0.sent_elements());
                    out
                }
            }
            ddp.register_comm_hook(Box::new(Counting(hook, probe.clone())));
            let (u, v) = (
                |i: usize| (i as f32 * 0.3).sin(),
                |j: usize| (j as f32 * 0.7).cos() + 0.1,
            );
            for (k, g) in ddp.grad_mut::<f32>(0).unwrap().iter_mut().enumerate() {
                *g = (pg.rank() + 1) as f32 * u(k / 20) * v(k % 20);
            }
            ddp.mark_ready(0).unwrap();
            ddp.finish().await.unwrap();
            let worst = ddp
                .grad::<f32>(0)
                .unwrap()
                .iter()
                .enumerate()
                .map(|(k, g)| (g - 2.0 * u(k / 20) * v(k % 20)).abs())
                .fold(0.0, f32::max);
            let sent = probe.lock().unwrap().unwrap();
            (worst, sent)
        })
        .await
        .unwrap();
        for (rank, (worst, sent)) in results.into_iter().enumerate() {
            assert!(worst < 1e-4, "rank {rank}: error {worst}");
            // A 20 x 20 bucket as two 20 x 1 factors: 40 elements, not 400.
            assert_eq!(sent, 40, "rank {rank}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn powersgd_with_error_feedback_still_trains() {
    within(60, "powersgd training", async {
        let losses = spawn(3, |pg| async move {
            // Least squares on 4 x 64 weights, one bucket each (so the second
            // rounds of four buckets queue behind each other): w* = (i % 5) - 2.
            let target = |i: usize| (i % 5) as f32 - 2.0;
            let mut model = named(&[64; 4], |_, _| 0.0);
            let mut ddp = DistributedSync::new(&pg, &mut model, small_buckets(256, 256))
                .await
                .unwrap();
            assert_eq!(ddp.layout().buckets.len(), 4);
            ddp.register_comm_hook(Box::new(
                chorus::sync::PowerSgd::new(&pg, powersgd_now()).await.unwrap(),
            ));
            let loss = |model: &[(String, Vec<f32>)]| {
                model
                    .iter()
                    .flat_map(|(_, w)| w.iter().enumerate().map(|(i, x)| (x - target(i)).powi(2)))
                    .sum::<f32>()
            };
            let first = loss(&model);
            for step in 0..300 {
                for p in (0..4).rev() {
                    // Each rank sees a noisy, rank-dependent gradient of the same loss.
                    let w = model[p].1.clone();
                    for (i, g) in ddp.grad_mut::<f32>(p).unwrap().iter_mut().enumerate() {
                        let noise = (((i * 7 + pg.rank() * 13 + step + p) % 11) as f32 - 5.0) * 0.01;
                        *g = 2.0 * (w[i] - target(i)) + noise;
                    }
                    ddp.mark_ready(p).unwrap();
                }
                ddp.finish().await.unwrap();
                for (p, (_, w)) in model.iter_mut().enumerate() {
                    let g = ddp.grad::<f32>(p).unwrap();
                    w.iter_mut().zip(g).for_each(|(x, g)| *x -= 0.1 * g);
                }
            }
            (first, loss(&model))
        })
        .await
        .unwrap();
        for (rank, (first, last)) in losses.into_iter().enumerate() {
            assert!(last < first * 0.01, "rank {rank}: loss {first} -> {last}");
        }
    })
    .await;
}

/// Fills every gradient with `value` and marks it ready, last parameter first.
fn backward(ddp: &mut DistributedSync<'_>, value: f32) -> Result<(), SyncError> {
    for p in (0..ddp.params().len()).rev() {
        ddp.grad_mut::<f32>(p)?.fill(value);
        ddp.mark_ready(p)?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_dying_mid_step_aborts_the_step_and_rebind_goes_on_in_the_next_generation() {
    use chorus::ElasticGroup;
    use chorus::store::{HashStore, Store};
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    // Rank 2 dies only once every rank has its step-0 result (a crash
    // earlier could take frames still in flight with it).
    let step_0_done = Arc::new(tokio::sync::Barrier::new(3));
    let mut ranks = Vec::new();
    for rank in 0..3 {
        let options = common::elastic_options(&store, rank, 3).elastic_world(2, 3);
        let step_0_done = step_0_done.clone();
        ranks.push(tokio::spawn(async move {
            let group = ElasticGroup::init_with(options, |e| eprintln!("gave up: {e}"))
                .await
                .unwrap();
            let mut model = named(&[10, 7, 5, 3], |_, _| 0.0);
            let mut ddp = DistributedSync::new(group.current(), &mut model, small_buckets(16, 32))
                .await
                .unwrap();
            backward(&mut ddp, rank as f32 + 1.0).unwrap();
            ddp.finish().await.unwrap();
            assert!(ddp.grad::<f32>(0).unwrap().iter().all(|&g| g == 2.0), "(1 + 2 + 3) / 3");
            step_0_done.wait().await;
            if rank == 2 {
                // Dies between steps: its links are lost (cut, as a crash).
                let links: Vec<_> = (0..3).filter_map(|r| group.current().link(r).cloned()).collect();
                drop(ddp);
                drop(group);
                for link in links {
                    link.cut("rank 2 died");
                }
                return None;
            }
            // The survivors' next step cannot complete: the abort, typed.
            backward(&mut ddp, 5.0).unwrap();
            let generation = ddp.group().generation();
            let aborted = match ddp.finish().await {
                Err(SyncError::Aborted { step: 1, aborted }) => aborted,
                other => panic!("rank {rank}: expected the group's abort at step 1, got {other:?}"),
            };
            assert_eq!(aborted.generation, generation);
            assert!(
                ddp.grad::<f32>(1).unwrap().iter().all(|&g| g == 0.0),
                "zeroed after an abort"
            );
            let next = group.next_generation(generation).await.unwrap();
            ddp.rebind(next.clone()).await.unwrap();
            // The redone step averages over the new world of 2.
            backward(&mut ddp, next.rank() as f32 + 1.0).unwrap();
            ddp.finish().await.unwrap();
            let grads: Vec<Vec<f32>> = (0..4).map(|p| ddp.grad::<f32>(p).unwrap().to_vec()).collect();
            let world = next.world_size();
            drop(ddp);
            drop(next);
            group.destroy().await.unwrap();
            Some((world, grads))
        }));
    }
    let mut survivors = 0;
    for task in ranks {
        if let Some((world, grads)) = within(60, "an elastic job losing a rank mid-step", task).await.unwrap() {
            assert_eq!(world, 2);
            assert!(grads.iter().flatten().all(|&g| g == 1.5), "(1 + 2) / 2: {grads:?}");
            survivors += 1;
        }
    }
    assert_eq!(survivors, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_with_5_3_and_4_batches_join_without_hanging_and_average_over_the_active() {
    within(60, "uneven inputs with join", async {
        let batches = [5usize, 3, 4];
        let seen = spawn(3, move |pg| async move {
            let rank = pg.rank();
            let mut model = named(&[10, 7, 5, 3], |_, _| 0.0);
            let options = SyncOptions {
                join: true,
                divide_by_initial_world_size: false,
                ..small_buckets(16, 32)
            };
            let mut ddp = DistributedSync::new(&pg, &mut model, options).await.unwrap();
            let mut averages = Vec::new();
            for batch in 0..batches[rank] {
                backward(&mut ddp, (rank as f32 + 1.0) * 10.0 + batch as f32).unwrap();
                ddp.finish().await.unwrap();
                let grads: Vec<f32> = (0..4).flat_map(|p| ddp.grad::<f32>(p).unwrap().to_vec()).collect();
                averages.push(grads);
            }
            ddp.join().await.unwrap();
            assert!(
                ddp.grad::<f32>(0).unwrap().iter().all(|&g| g == 0.0),
                "zeroed after join"
            );
            averages
        })
        .await
        .unwrap();
        for (rank, averages) in seen.iter().enumerate() {
            for (batch, grads) in averages.iter().enumerate() {
                let active: Vec<f32> = (0..3)
                    .filter(|&r| batches[r] > batch)
                    .map(|r| (r as f32 + 1.0) * 10.0 + batch as f32)
                    .collect();
                let want = active.iter().sum::<f32>() / active.len() as f32;
                assert!(
                    grads.iter().all(|&g| (g - want).abs() < 1e-4),
                    "rank {rank} batch {batch}: want {want} over {} active ranks, got {:?}",
                    active.len(),
                    &grads[..3]
                );
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_without_the_option_is_refused_and_by_default_divides_by_the_world() {
    within(60, "join defaults", async {
        let seen = spawn(2, |pg| async move {
            let mut model = named(&[4], |_, _| 0.0);
            let mut plain = DistributedSync::new(&pg, &mut model, SyncOptions::default())
                .await
                .unwrap();
            assert!(matches!(plain.join().await, Err(SyncError::JoinOff)));
            let options = SyncOptions {
                join: true,
                ..SyncOptions::default()
            };
            let mut ddp = DistributedSync::new(&pg, &mut model, options).await.unwrap();
            if pg.rank() == 0 {
                backward(&mut ddp, 6.0).unwrap();
                ddp.finish().await.unwrap();
                let got = ddp.grad::<f32>(0).unwrap()[0];
                ddp.join().await.unwrap();
                got
            } else {
                ddp.join().await.unwrap();
                0.0
            }
        })
        .await
        .unwrap();
        assert_eq!(seen[0], 3.0, "PyTorch's default: 6 / the initial world of 2");
    })
    .await;
}
