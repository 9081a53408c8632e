//! Every collective, algorithm, dtype and operator against a naive reference,
//! executed by [`sim`](super::sim) for world sizes 1 to 8.

use proptest::prelude::*;

use super::plan::{Action, Builder, Combine, Region, Tag};
use super::sim::{self, Buffers, encode};
use super::*;

/// Filler for outputs the collective must overwrite.
const GARBAGE: u8 = 0x5a;

/// Element `i` of `rank`'s data: small integers, so float sums and products
/// are exact in every order and the reference needs no tolerance.
fn value(dtype: DType, op: ReduceOp, rank: usize, i: usize) -> i64 {
    let (r, i) = (rank as i64, i as i64);
    let unsigned = dtype.name().starts_with('u');
    match op {
        ReduceOp::Prod => {
            let v: i64 = [1, 2, -1, -2, 1][((r * 3 + i) % 5) as usize];
            if unsigned { v.abs() } else { v }
        }
        ReduceOp::Sum | ReduceOp::Avg => (r * 31 + i * 17) % 7 - if unsigned { 0 } else { 3 },
        ReduceOp::Min | ReduceOp::Max => (r * 13 + i * 7) % 50 - if unsigned { 0 } else { 25 },
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => (r * 37 + i * 11) % 105,
    }
}

/// `rank`'s first `len` elements. [`value`] repeats every 1050 elements
/// (a multiple of each of its periods), so one period is encoded and the rest
/// copied: element-wise generation would dominate the debug-mode test time.
fn data(dtype: DType, op: ReduceOp, rank: usize, len: usize) -> Vec<u8> {
    const PERIOD: usize = 1050;
    let period: Vec<u8> = (0..PERIOD.min(len))
        .flat_map(|i| encode(dtype, value(dtype, op, rank, i)))
        .collect();
    let mut out = period.repeat(len.div_ceil(PERIOD));
    out.truncate(len * dtype.size());
    out
}

/// The reduction of `bufs` in rank order, averaged if `op` is.
fn reduced(dtype: DType, op: ReduceOp, bufs: &[&[u8]]) -> Vec<u8> {
    let mut acc = bufs[0].to_vec();
    for b in &bufs[1..] {
        reduce_into(op, dtype, &mut acc, b).unwrap();
    }
    if op == ReduceOp::Avg {
        finalize_avg(dtype, &mut acc, bufs.len()).unwrap();
    }
    acc
}

/// One case: a collective, its algorithm, and its shape.
#[derive(Debug, Clone, Copy)]
struct Case {
    spec: Spec,
    algorithm: Algorithm,
    op: ReduceOp,
    seed: u64,
    /// The ranks (bit r: rank r) that run the out-of-place form, their
    /// data in `input` (reducing kinds only).
    out_of_place: u64,
}

/// Plans every rank, runs them, and compares each rank's result with the
/// naive reference.
fn check(case: Case) -> Result<(), String> {
    let Case {
        spec,
        algorithm,
        op,
        seed,
        out_of_place,
    } = case;
    let apart = |r: usize| r < 64 && out_of_place & (1 << r) != 0;
    let Spec {
        kind,
        dtype,
        count,
        root,
        world,
    } = spec;
    let size = dtype.size();
    let root = root.unwrap_or(0);
    let plans: Vec<Plan> = (0..world)
        .map(|r| match apart(r) {
            true => spec.plan_out_of_place(r, algorithm),
            false => spec.plan(r, algorithm),
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    // Each rank's own data, `count` or `count * world` elements as the kind needs.
    let per_rank = match kind {
        CollectiveKind::Scatter | CollectiveKind::ReduceScatter | CollectiveKind::AllToAll => count * world,
        _ => count,
    };
    let own: Vec<Vec<u8>> = (0..world).map(|r| data(dtype, op, r, per_rank)).collect();
    let mut bufs: Vec<Buffers> = plans
        .iter()
        .enumerate()
        .map(|(r, plan)| {
            let garbage = vec![GARBAGE; plan.output_len() * size];
            let (input, output) = match kind {
                _ if apart(r) => (own[r].clone(), garbage),
                CollectiveKind::AllReduce | CollectiveKind::Reduce | CollectiveKind::ReduceScatter => {
                    (Vec::new(), own[r].clone())
                }
                CollectiveKind::Broadcast if r == root => (Vec::new(), own[r].clone()),
                _ => (own[r][..plan.input_len() * size].to_vec(), garbage),
            };
            Buffers { input, output }
        })
        .collect();
    let heard = sim::run(&plans, dtype, op, &mut bufs, seed)?;
    // What a driver does last for an average, on the ranks holding a result.
    if op == ReduceOp::Avg && !plans.iter().any(Plan::averages_in_steps) {
        for (r, buf) in bufs.iter_mut().enumerate() {
            let result = match kind {
                CollectiveKind::AllReduce => &mut buf.output[..],
                CollectiveKind::Reduce if r == root => &mut buf.output[..],
                CollectiveKind::ReduceScatter => &mut buf.output[r * count * size..(r + 1) * count * size],
                _ => continue,
            };
            finalize_avg(dtype, result, world).map_err(|e| e.to_string())?;
        }
    }
    let everyone = if world == 64 { u64::MAX } else { (1 << world) - 1 };
    let block = |r: usize| r * count * size..(r + 1) * count * size;
    let all: Vec<&[u8]> = own.iter().map(Vec::as_slice).collect();
    for (r, buf) in bufs.iter().enumerate() {
        if apart(r) && buf.input != own[r] {
            return Err(format!("rank {r}: the out-of-place form changed its input"));
        }
        let (got, want): (&[u8], Vec<u8>) = match kind {
            CollectiveKind::AllReduce => (&buf.output, reduced(dtype, op, &all)),
            CollectiveKind::Reduce if r == root => (&buf.output, reduced(dtype, op, &all)),
            CollectiveKind::Reduce => continue,
            CollectiveKind::Broadcast => (&buf.output, own[root].clone()),
            CollectiveKind::AllGather => (&buf.output, own.concat()),
            CollectiveKind::Gather if r == root => (&buf.output, own.concat()),
            CollectiveKind::Gather => (&buf.output, Vec::new()),
            CollectiveKind::Scatter => (&buf.output, own[root][block(r)].to_vec()),
            CollectiveKind::ReduceScatter => {
                let blocks: Vec<&[u8]> = own.iter().map(|o| &o[block(r)]).collect();
                (&buf.output[block(r)], reduced(dtype, op, &blocks))
            }
            CollectiveKind::AllToAll => (&buf.output, own.iter().flat_map(|o| o[block(r)].to_vec()).collect()),
            CollectiveKind::Barrier | CollectiveKind::Send | CollectiveKind::Recv => (&[], Vec::new()),
        };
        if got != want {
            return Err(format!("rank {r}: wrong result"));
        }
        let spreads = matches!(
            kind,
            CollectiveKind::AllReduce | CollectiveKind::AllGather | CollectiveKind::AllToAll | CollectiveKind::Barrier
        );
        if spreads && count > 0 && heard[r] != everyone {
            return Err(format!("rank {r} finished having heard only from {:b}", heard[r]));
        }
    }
    Ok(())
}

/// Runs every case, reporting all failures at once.
fn check_all(cases: impl IntoIterator<Item = Case>) {
    let mut failures = Vec::new();
    let mut n = 0;
    for case in cases {
        n += 1;
        if let Err(e) = check(case) {
            failures.push(format!("{case:?}: {e}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {n} cases failed:\n{}",
        failures.len(),
        failures[..failures.len().min(10)].join("\n")
    );
}

/// The roots tried for a world: first, last and middle.
fn roots(kind: CollectiveKind, world: usize) -> Vec<Option<usize>> {
    if !kind.rooted() {
        return vec![None];
    }
    let mut roots = vec![0, world - 1, world / 2];
    roots.sort_unstable();
    roots.dedup();
    roots.into_iter().map(Some).collect()
}

/// The (dtype, op) pairs `kind` takes: every supported pair if it reduces,
/// every dtype with `Sum` (ignored) otherwise.
fn combos(kind: CollectiveKind) -> Vec<(DType, ReduceOp)> {
    let ops: &[ReduceOp] = if kind.reduces() {
        &ReduceOp::ALL
    } else {
        &[ReduceOp::Sum]
    };
    DType::ALL
        .into_iter()
        .flat_map(|d| ops.iter().filter(move |op| op.supports(d)).map(move |&op| (d, op)))
        .collect()
}

/// Every (algorithm, world 1..=8, count, root) of `kind`, each with every
/// `stride`th (dtype, op) pair, starting at an offset that moves with the
/// world and count so that the pairs rotate through the shapes. A stride of
/// 1 is the full cross product.
fn matrix(kind: CollectiveKind, counts: &[usize], stride: usize) -> Vec<Case> {
    let combos = combos(kind);
    let mut cases = Vec::new();
    for &algorithm in kind.algorithms() {
        for world in 1..=8 {
            for &count in counts {
                for root in roots(kind, world) {
                    let offset = (world + count + root.unwrap_or(0)) % stride;
                    for &(dtype, op) in combos.iter().skip(offset).step_by(stride) {
                        let spec = Spec {
                            kind,
                            dtype,
                            count,
                            root,
                            world,
                        };
                        let seed = (world * 1000 + count) as u64;
                        cases.push(Case {
                            spec,
                            algorithm,
                            op,
                            seed,
                            out_of_place: 0,
                        });
                    }
                }
            }
        }
    }
    cases
}

/// The full dtype x op product at an odd count (smaller than the largest
/// worlds, so some chunks and blocks are empty), and rotating subsets of it
/// at the other counts.
fn every_dtype_and_op(kind: CollectiveKind) {
    check_all(matrix(kind, &[7], 1));
    check_all(matrix(kind, &[0, 1, 33], 9));
}

#[test]
fn all_reduce_every_algorithm_dtype_and_op() {
    every_dtype_and_op(CollectiveKind::AllReduce);
}

#[test]
fn reduce_and_reduce_scatter_every_dtype_and_op() {
    every_dtype_and_op(CollectiveKind::Reduce);
    every_dtype_and_op(CollectiveKind::ReduceScatter);
}

/// Out of place, every rank or every other one (the forms mix), at the
/// shapes of the in-place tests: the same results, inputs left as they were.
#[test]
fn out_of_place_reductions_match_in_place_and_leave_the_input() {
    for kind in [
        CollectiveKind::AllReduce,
        CollectiveKind::Reduce,
        CollectiveKind::ReduceScatter,
    ] {
        for mask in [u64::MAX, 0x5555_5555_5555_5555] {
            let apart = |cases: Vec<Case>| {
                cases
                    .into_iter()
                    .map(|case| Case {
                        out_of_place: mask,
                        ..case
                    })
                    .collect::<Vec<_>>()
            };
            check_all(apart(matrix(kind, &[7], 3)));
            check_all(apart(matrix(kind, &[0, 1, 33, 3001], 17)));
        }
    }
}

#[test]
fn an_out_of_place_ring_reads_the_input_where_in_place_it_copied_nothing() {
    // World 4, a ring: the first sends read the input, every reduction of
    // the reduce-scatter takes this rank's values from it, and nothing is
    // copied over first.
    let spec = Spec {
        kind: CollectiveKind::AllReduce,
        dtype: DType::Float32,
        count: 1 << 20,
        root: None,
        world: 4,
    };
    let plan = spec.plan_out_of_place(1, Algorithm::Ring).unwrap();
    let steps = plan.steps();
    let count = |f: &dyn Fn(&Action) -> bool| steps.iter().filter(|s| f(&s.action)).count();
    assert_eq!(plan.input_len(), 1 << 20);
    assert_eq!(count(&|a| matches!(a, Action::Copy { .. })), 0);
    let in_place = spec.plan(1, Algorithm::Ring).unwrap();
    let reductions = in_place
        .steps()
        .iter()
        .filter(|s| {
            matches!(
                s.action,
                Action::Recv {
                    then: Combine::Reduce | Combine::ReduceComplete,
                    ..
                }
            )
        })
        .count();
    assert!(reductions > 0);
    assert_eq!(
        count(&|a| matches!(
            a,
            Action::Recv {
                then: Combine::ReduceInput | Combine::ReduceCompleteInput,
                ..
            }
        )),
        reductions
    );
    assert!(
        count(&|a| matches!(
            a,
            Action::Send {
                src: Region::Input(_),
                ..
            }
        )) > 0
    );
    assert!(matches!(
        Spec {
            kind: CollectiveKind::AllGather,
            ..spec
        }
        .plan_out_of_place(0, Algorithm::Ring),
        Err(PlanError::NotOutOfPlace(CollectiveKind::AllGather))
    ));
}

#[test]
fn data_movement_collectives_every_dtype() {
    for kind in [
        CollectiveKind::Broadcast,
        CollectiveKind::AllGather,
        CollectiveKind::Gather,
        CollectiveKind::Scatter,
        CollectiveKind::AllToAll,
    ] {
        check_all(matrix(kind, &[0, 1, 7, 33], 1));
    }
}

#[test]
fn thousands_of_elements_every_collective() {
    // About four (dtype, op) pairs per world for reducing kinds, two dtypes
    // per world otherwise: every pair occurs across the worlds and roots.
    for kind in CollectiveKind::ALL
        .into_iter()
        .filter(|k| !matches!(k, CollectiveKind::Barrier | CollectiveKind::Send | CollectiveKind::Recv))
    {
        let stride = if kind.reduces() { 17 } else { 5 };
        check_all(matrix(kind, &[3001], stride));
    }
}

#[test]
fn several_mib_float32_sum_all_reduce_on_the_ring() {
    // 7 MiB over 3 ranks: chunks of 2.3 MiB, three segments of at most 1 MiB.
    let spec = Spec {
        kind: CollectiveKind::AllReduce,
        dtype: DType::Float32,
        count: 7 << 18,
        root: None,
        world: 3,
    };
    let plan = spec.plan(0, Algorithm::Ring).unwrap();
    let first_round = |s: &&Step| {
        matches!(
            s.action,
            Action::Send {
                tag: Tag { round: 0, .. },
                ..
            }
        )
    };
    assert_eq!(plan.steps().iter().filter(first_round).count(), 3);
    check_all([Case {
        spec,
        algorithm: Algorithm::Ring,
        op: ReduceOp::Sum,
        seed: 7,
        out_of_place: 0,
    }]);
}

#[test]
fn direct_messages_of_several_mib_go_in_matching_segments() {
    // 2.5 MiB of float32 per message: three segments of at most 1 MiB, so
    // a message streams through a transport buffer smaller than it
    // (point-to-point messages stay whole: `direct::send`).
    let count = 5 << 17;
    let sends = |plan: &Plan| -> Vec<(Tag, usize)> {
        plan.steps()
            .iter()
            .filter_map(|s| match &s.action {
                Action::Send {
                    tag,
                    src: Region::Input(range),
                    ..
                } => Some((*tag, range.len())),
                _ => None,
            })
            .collect()
    };
    let gather = Spec {
        kind: CollectiveKind::Gather,
        dtype: DType::Float32,
        count,
        root: Some(1),
        world: 2,
    };
    let sent = sends(&gather.plan(0, Algorithm::Direct).unwrap());
    assert_eq!(
        sent,
        (0..3)
            .map(|s| (Tag::new(0, s), [218454, 218453, 218453][s]))
            .collect::<Vec<_>>()
    );
    assert!(sent.iter().all(|&(_, len)| len * 4 <= MAX_SEGMENT_BYTES));
    for kind in [
        CollectiveKind::Gather,
        CollectiveKind::Scatter,
        CollectiveKind::AllToAll,
    ] {
        check_all([Case {
            spec: Spec {
                kind,
                dtype: DType::Float32,
                count,
                root: kind.rooted().then_some(2),
                world: 3,
            },
            algorithm: if kind == CollectiveKind::AllToAll {
                Algorithm::Pairwise
            } else {
                Algorithm::Direct
            },
            op: ReduceOp::Sum,
            seed: 3,
            out_of_place: 0,
        }]);
    }
}

#[test]
fn send_meets_recv_for_every_pair() {
    let dtype = DType::Int64;
    for world in 2..=4 {
        for from in 0..world {
            for to in (0..world).filter(|&t| t != from) {
                let p2p = |kind, peer, rank| {
                    let spec = Spec {
                        kind,
                        dtype,
                        count: 5,
                        root: Some(peer),
                        world,
                    };
                    spec.plan(rank, Algorithm::Direct).unwrap()
                };
                let plans: Vec<Plan> = (0..world)
                    .map(|r| match r {
                        _ if r == from => p2p(CollectiveKind::Send, to, r),
                        _ if r == to => p2p(CollectiveKind::Recv, from, r),
                        _ => Builder::new(r, world, 0, 0).finish(),
                    })
                    .collect();
                let sent = data(dtype, ReduceOp::Sum, from, 5);
                let mut bufs: Vec<Buffers> = (0..world)
                    .map(|r| Buffers {
                        input: if r == from { sent.clone() } else { Vec::new() },
                        output: vec![0; if r == to { 40 } else { 0 }],
                    })
                    .collect();
                sim::run(&plans, dtype, ReduceOp::Sum, &mut bufs, 1).unwrap();
                assert_eq!(bufs[to].output, sent);
            }
        }
    }
}

#[test]
fn barrier_completes_only_after_hearing_from_every_rank() {
    for world in 1..=17 {
        let spec = Spec {
            kind: CollectiveKind::Barrier,
            dtype: DType::UInt8,
            count: 0,
            root: None,
            world,
        };
        let plans: Vec<Plan> = (0..world)
            .map(|r| spec.plan(r, Algorithm::Dissemination).unwrap())
            .collect();
        let rounds = (world as f64).log2().ceil() as usize;
        assert!(plans.iter().all(|p| p.steps().len() == 2 * rounds));
        let mut bufs = vec![
            Buffers {
                input: Vec::new(),
                output: Vec::new()
            };
            world
        ];
        for seed in 1..4 {
            let heard = sim::run(&plans, DType::UInt8, ReduceOp::Sum, &mut bufs, seed).unwrap();
            assert!(
                heard.iter().all(|&h| h == (1u64 << world) - 1),
                "world {world}: {heard:?}"
            );
        }
    }
}

/// Two ranks' hand-built plans, run with empty buffers.
fn run_pair(build: impl Fn(&mut Builder, usize)) -> Result<Vec<u64>, String> {
    let plans: Vec<Plan> = (0..2)
        .map(|r| {
            let mut b = Builder::new(r, 2, 0, 4);
            build(&mut b, r);
            b.finish()
        })
        .collect();
    let mut bufs = vec![
        Buffers {
            input: Vec::new(),
            output: vec![0; 16]
        };
        2
    ];
    sim::run(&plans, DType::Float32, ReduceOp::Sum, &mut bufs, 3)
}

#[test]
fn executor_reports_deadlock_size_mismatch_and_lost_messages() {
    let tag = Tag::new(0, 0);
    // Both ranks receive first, from each other, and send only after.
    let err = run_pair(|b, r| {
        let got = b.recv(1 - r, tag, 0..4, Combine::Copy).unwrap();
        b.push(
            Action::Send {
                to: 1 - r,
                tag,
                src: Region::Output(0..0),
            },
            &[got],
        );
    })
    .unwrap_err();
    assert!(err.starts_with("deadlock"), "{err}");
    let err = run_pair(|b, r| {
        b.send(1 - r, tag, Region::Output(0..4 - r));
        b.recv(1 - r, tag, 0..4 - r, Combine::Reduce);
    })
    .unwrap_err();
    assert!(err.contains("size mismatch"), "{err}");
    let err = run_pair(|b, r| {
        if r == 0 {
            b.send(1, tag, Region::Output(0..4));
        }
    })
    .unwrap_err();
    assert!(err.contains("never received"), "{err}");
    assert!(
        run_pair(|b, r| {
            b.send(1 - r, tag, Region::Output(0..4));
            b.recv(1 - r, tag, 0..4, Combine::Reduce);
        })
        .is_ok()
    );
}

#[test]
fn ring_segments_pipeline_independently() {
    // A segment's send waits only for the same segment's previous receive,
    // so the driver can send segment k while segment k + 1 is reduced.
    let spec = Spec {
        kind: CollectiveKind::AllReduce,
        dtype: DType::Float32,
        count: 4000,
        root: None,
        world: 4,
    };
    let plan = spec.plan(1, Algorithm::Ring).unwrap();
    for (i, step) in plan.steps().iter().enumerate() {
        if let Action::Send { tag, .. } = step.action {
            for d in plan.deps(StepId(i as u32)) {
                match &plan.steps()[d.index()].action {
                    Action::Recv { tag: t, .. } => {
                        assert_eq!((t.round + 1, t.segment), (tag.round, tag.segment), "step {i}")
                    }
                    other => panic!("send {i} waits for {other:?}"),
                }
            }
        }
    }
    // 2 (P - 1) rounds of 2 segments, one send and one receive each.
    assert_eq!(plan.steps().len(), 2 * 3 * 2 * 2);
}

#[test]
fn choice_follows_the_thresholds_unless_overridden() {
    let none = Overrides::default();
    let ar = CollectiveKind::AllReduce;
    assert_eq!(choose_algorithm(ar, 1024, 8, &none), Algorithm::RecursiveDoubling);
    assert_eq!(
        choose_algorithm(ar, RECURSIVE_DOUBLING_MAX_BYTES, 8, &none),
        Algorithm::RecursiveDoubling
    );
    assert_eq!(
        choose_algorithm(ar, RECURSIVE_DOUBLING_MAX_BYTES + 1, 8, &none),
        Algorithm::HalvingDoubling
    );
    assert_eq!(
        choose_algorithm(ar, HALVING_DOUBLING_MAX_BYTES + 1, 8, &none),
        Algorithm::Ring
    );
    assert_eq!(
        choose_algorithm(ar, HALVING_DOUBLING_MAX_BYTES, 2, &none),
        Algorithm::RecursiveDoubling
    );
    assert_eq!(choose_algorithm(ar, 1 << 30, 2, &none), Algorithm::Ring);
    assert_eq!(
        choose_algorithm(CollectiveKind::Broadcast, 1 << 30, 8, &none),
        Algorithm::BinomialTree
    );
    assert_eq!(
        choose_algorithm(CollectiveKind::AllGather, 8, 8, &none),
        Algorithm::Ring
    );
    for kind in CollectiveKind::ALL {
        for bytes in [0, 1 << 16, 1 << 30] {
            assert!(kind.algorithms().contains(&choose_algorithm(kind, bytes, 5, &none)));
        }
    }

    let ring = Overrides::parse("ring").unwrap();
    assert_eq!(choose_algorithm(ar, 8, 8, &ring), Algorithm::Ring);
    assert_eq!(ring.get(CollectiveKind::ReduceScatter), Some(Algorithm::Ring));
    assert_eq!(ring.get(CollectiveKind::Broadcast), None);
    let later_wins = Overrides::parse(" ring , all_reduce=halving_doubling,").unwrap();
    assert_eq!(
        choose_algorithm(ar, 1 << 30, 8, &later_wins),
        Algorithm::HalvingDoubling
    );
    assert_eq!(Overrides::parse(""), Ok(Overrides::default()));

    // Ranks sharing threads take the tree for small buffers over many ranks.
    let shared = Overrides::default().sharing_threads();
    let many = SHARED_THREADS_TREE_MIN_WORLD;
    assert_eq!(choose_algorithm(ar, 8, many, &shared), Algorithm::BinomialTree);
    assert_eq!(
        choose_algorithm(ar, RECURSIVE_DOUBLING_MAX_BYTES, 1024, &shared),
        Algorithm::BinomialTree
    );
    assert_eq!(choose_algorithm(ar, 8, many - 1, &shared), Algorithm::RecursiveDoubling);
    assert_eq!(
        choose_algorithm(ar, RECURSIVE_DOUBLING_MAX_BYTES + 1, 1024, &shared),
        Algorithm::HalvingDoubling
    );
    assert_eq!(choose_algorithm(ar, 8, 1024, &none), Algorithm::RecursiveDoubling);
    let forced = Overrides::parse("all_reduce=ring").unwrap().sharing_threads();
    assert_eq!(choose_algorithm(ar, 8, 1024, &forced), Algorithm::Ring);
}

#[test]
fn measured_thresholds_move_the_switch_points() {
    let ar = CollectiveKind::AllReduce;
    let t = Thresholds::parse(" recursive_doubling=256K , halving_doubling=4M").unwrap();
    assert_eq!(
        t,
        Thresholds {
            recursive_doubling_max: 256 << 10,
            halving_doubling_max: 4 << 20
        }
    );
    let tuned = Overrides::default().with_thresholds(t);
    assert_eq!(choose_algorithm(ar, 256 << 10, 8, &tuned), Algorithm::RecursiveDoubling);
    assert_eq!(
        choose_algorithm(ar, (256 << 10) + 1, 8, &tuned),
        Algorithm::HalvingDoubling
    );
    assert_eq!(choose_algorithm(ar, 4 << 20, 8, &tuned), Algorithm::HalvingDoubling);
    assert_eq!(choose_algorithm(ar, (4 << 20) + 1, 8, &tuned), Algorithm::Ring);
    // Two ranks: recursive doubling up to the halving-doubling threshold.
    assert_eq!(choose_algorithm(ar, 4 << 20, 2, &tuned), Algorithm::RecursiveDoubling);
    assert_eq!(choose_algorithm(ar, (4 << 20) + 1, 2, &tuned), Algorithm::Ring);
    // A zero threshold turns an algorithm off; a forced algorithm still wins.
    let ring_only =
        Overrides::default().with_thresholds(Thresholds::parse("recursive_doubling=0,halving_doubling=0").unwrap());
    assert_eq!(choose_algorithm(ar, 8, 8, &ring_only), Algorithm::Ring);
    let forced = Overrides::parse("all_reduce=halving_doubling")
        .unwrap()
        .with_thresholds(t);
    assert_eq!(choose_algorithm(ar, 8, 8, &forced), Algorithm::HalvingDoubling);
    // Left out: the default; the printed form parses back.
    assert_eq!(
        Thresholds::parse("halving_doubling=2M").unwrap().recursive_doubling_max,
        RECURSIVE_DOUBLING_MAX_BYTES
    );
    assert_eq!(Thresholds::parse("").unwrap(), Thresholds::default());
    assert_eq!(
        Thresholds::default().to_string(),
        "recursive_doubling=64K,halving_doubling=1M"
    );
    let odd = Thresholds {
        recursive_doubling_max: 3000,
        halving_doubling_max: 3 << 30,
    };
    assert_eq!(Thresholds::parse(&odd.to_string()), Ok(odd));
    assert_eq!(Overrides::default().thresholds(), Thresholds::default());
    // Bad input is a typed error, never a panic.
    assert_eq!(
        Thresholds::parse("ring=1M").unwrap_err().what,
        "algorithm with a threshold"
    );
    assert_eq!(Thresholds::parse("fast=1M").unwrap_err().what, "algorithm");
    assert_eq!(Thresholds::parse("recursive_doubling").unwrap_err().what, "threshold");
    assert_eq!(Thresholds::parse("recursive_doubling=").unwrap_err().what, "size");
    assert_eq!(Thresholds::parse("recursive_doubling=1Q").unwrap_err().what, "size");
    assert_eq!(
        Thresholds::parse("halving_doubling=99999999999999999G")
            .unwrap_err()
            .what,
        "size"
    );
}

#[test]
fn bad_overrides_and_specs_are_typed_errors() {
    let err = Overrides::parse("all_gather=pairwise").unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown algorithm for this collective \"all_gather=pairwise\"; expected one of: ring"
    );
    assert_eq!(Overrides::parse("allreduce=ring").unwrap_err().what, "collective");
    assert_eq!(Overrides::parse("fast").unwrap_err().what, "algorithm");

    let spec = Spec {
        kind: CollectiveKind::Broadcast,
        dtype: DType::Float32,
        count: 4,
        root: Some(3),
        world: 3,
    };
    let tree = Algorithm::BinomialTree;
    assert!(matches!(spec.plan(0, tree), Err(PlanError::Root { root: Some(3), .. })));
    assert!(matches!(
        Spec { root: None, ..spec }.plan(0, tree),
        Err(PlanError::Root { .. })
    ));
    assert_eq!(spec.plan(3, tree), Err(PlanError::Rank { rank: 3, world: 3 }));
    assert_eq!(Spec { world: 0, ..spec }.plan(0, tree), Err(PlanError::World(0)));
    let err = Spec { root: Some(0), ..spec }.plan(0, Algorithm::Ring).unwrap_err();
    assert_eq!(
        err.to_string(),
        "broadcast has no ring algorithm; it has: binomial_tree"
    );
    let huge = Spec {
        count: usize::MAX / 2,
        root: Some(0),
        ..spec
    };
    assert!(matches!(huge.plan(0, tree), Err(PlanError::TooLarge { .. })));
    let to_self = Spec {
        kind: CollectiveKind::Send,
        root: Some(1),
        ..spec
    };
    assert!(matches!(
        to_self.plan(1, Algorithm::Direct),
        Err(PlanError::Root { .. })
    ));
    assert!(to_self.plan(0, Algorithm::Direct).is_ok());
}

fn any_case() -> impl Strategy<Value = Case> {
    let kinds = prop::sample::select(
        CollectiveKind::ALL
            .into_iter()
            .filter(|k| !matches!(k, CollectiveKind::Send | CollectiveKind::Recv))
            .collect::<Vec<_>>(),
    );
    let dtypes = prop::sample::select(vec![DType::UInt8, DType::Int64, DType::Float16, DType::Float32]);
    let ops = prop::sample::select(vec![ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg, ReduceOp::Prod]);
    (
        kinds,
        dtypes,
        ops,
        1usize..=12,
        0usize..150,
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(kind, dtype, op, world, count, root, algo, seed, out_of_place)| {
            let count = if kind == CollectiveKind::Barrier { 0 } else { count };
            Case {
                spec: Spec {
                    kind,
                    dtype,
                    count,
                    root: kind.rooted().then(|| root.index(world)),
                    world,
                },
                algorithm: *algo.get(kind.algorithms()),
                op: if kind.reduces() { op } else { ReduceOp::Sum },
                seed,
                out_of_place: if kind.reduces() { out_of_place } else { 0 },
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_shapes_match_the_reference(case in any_case()) {
        prop_assert_eq!(check(case), Ok(()));
    }
}

#[test]
fn the_tree_all_reduce_sends_two_messages_per_rank_where_doubling_sends_log2_p() {
    let sends = |world: usize, algorithm: Algorithm| -> usize {
        let spec = Spec {
            kind: CollectiveKind::AllReduce,
            dtype: DType::Float32,
            count: 2,
            root: None,
            world,
        };
        (0..world)
            .map(|rank| spec.plan(rank, algorithm).unwrap())
            .map(|plan| {
                plan.steps()
                    .iter()
                    .filter(|s| matches!(s.action, Action::Send { .. }))
                    .count()
            })
            .sum()
    };
    for world in [16, 64, 1000, 1024] {
        assert_eq!(sends(world, Algorithm::BinomialTree), 2 * (world - 1), "world {world}");
    }
    assert_eq!(sends(1024, Algorithm::RecursiveDoubling), 1024 * 10);
}
