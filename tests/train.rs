//! Elastic training (`chorus::train`): per-step commit through a member's
//! death and a joiner, in process; and `examples/train.rs` (a candle MLP
//! on 4 processes under `chorus launch --restart-policy worker`) against
//! its fault-free run and across modes.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use chorus::store::{HashStore, Store};
use chorus::sync::{DistributedSync, ParamBuffer, Parameters};
use chorus::train::{
    self, Begin, Cadence, IntegrityOptions, Job, Mode, NamedState, StateCorruption, StateTarget, Step, Stepper,
    StepperOptions, TrainOptions, TrainReport, TrainState,
};
use chorus::{Admission, ElasticGroup, InitOptions};
use chorus::{ReduceOp, Tensor};

mod common;
use common::{LAUNCHER, elastic_options as options, example, text, within};

const STEPS: u64 = 400;

/// Every committed step subtracts exactly 1 from each parameter (the
/// members' gradient shares sum to 1 in binary fractions) and adds 1 to
/// the optimizer's counter; the steps it applied are recorded.
struct Counter {
    state: NamedState,
    applied: Vec<u64>,
}

impl Counter {
    fn new() -> Self {
        Self {
            state: NamedState {
                params: vec![("x".into(), vec![0.0; 1000])],
                buffers: Vec::new(),
                optimizer: vec![("count".into(), vec![0.0; 1000])],
                extra: Vec::new(),
            },
            applied: Vec::new(),
        }
    }
}

impl Parameters for Counter {
    fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        self.state.visit_parameters(visit)
    }
}

impl TrainState for Counter {
    fn visit_optimizer(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        self.state.visit_optimizer(visit)
    }
}

impl Job for Counter {
    fn backward(&mut self, step: &Step, grads: &mut DistributedSync<'static>) -> Result<f64, String> {
        // Slow enough that the joiner arrives while the others train.
        std::thread::sleep(Duration::from_millis(3));
        let share = step.shard().len() as f32 * step.grad_scale;
        grads.grad_mut::<f32>(0).map_err(|e| e.to_string())?.fill(share);
        grads.mark_ready(0).map_err(|e| e.to_string())?;
        Ok(step.shard().len() as f64)
    }

    fn apply(&mut self, step: &Step, grads: &DistributedSync<'static>) -> Result<(), String> {
        let g = grads.grad::<f32>(0).map_err(|e| e.to_string())?;
        self.state.params[0].1.iter_mut().zip(g).for_each(|(x, g)| *x -= g);
        self.state.optimizer[0].1.iter_mut().for_each(|c| *c += 1.0);
        self.applied.push(step.step);
        Ok(())
    }
}

async fn init(options: InitOptions) -> ElasticGroup {
    ElasticGroup::init_with(options, |e| eprintln!("gave up: {e}"))
        .await
        .unwrap()
}

fn train_options() -> TrainOptions {
    TrainOptions {
        mode: Mode::Ddp,
        steps: STEPS,
        global_batch: 64,
        ..TrainOptions::default()
    }
}

/// Trains to the end, checks every member holds the same state, leaves.
async fn train_to_end(group: ElasticGroup, mut job: Counter) -> (TrainReport, Counter) {
    let report = train::train(&group, &mut job, &train_options(), |_| {}).await.unwrap();
    train::verify_state(&group.current(), &mut job).await.unwrap();
    group.destroy().await.unwrap();
    (report, job)
}

/// Every member (and whether it is the joiner) ended with all `STEPS`
/// committed, each applied once or received, never twice or lost, and
/// byte for byte the first member's state.
fn assert_every_step_applied_once(results: &[(bool, (TrainReport, Counter))]) {
    let reference = &results[0].1.1.state;
    for (_, (report, job)) in results {
        assert_eq!(report.steps, STEPS);
        // What was not applied was received.
        assert_eq!(report.applied + report.adopted, STEPS, "{report:?}");
        assert_eq!(job.applied.len() as u64, report.applied);
        assert!(job.applied.windows(2).all(|w| w[1] > w[0]), "{:?}", job.applied);
        assert!(
            job.state.params[0].1.iter().all(|&x| x == -(STEPS as f32)),
            "a step was applied twice or lost: {:?}",
            &job.state.params[0].1[..3]
        );
        assert!(job.state.optimizer[0].1.iter().all(|&c| c == STEPS as f32));
        assert_eq!(&job.state, reference);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_step_is_re_run_never_applied_twice_and_the_joiner_gets_the_survivors_state() {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let died = Arc::new(tokio::sync::Notify::new());
    let mut members = Vec::new();
    for rank in 0..4 {
        let (options, died) = (options(&store, rank, 4).elastic_world(3, 4), died.clone());
        members.push(tokio::spawn(async move {
            let group = init(options).await;
            if rank != 3 {
                return Some(train_to_end(group, Counter::new()).await);
            }
            // Rank 3 dies in the middle of step 20 (after committing 0..20):
            // its training is dropped at its next await, then its links are cut.
            let dying = Arc::new(tokio::sync::Notify::new());
            let mut job = Counter::new();
            let (signal, train_options) = (dying.clone(), train_options());
            tokio::select! {
                _ = train::train(&group, &mut job, &train_options, |c| {
                    if c.step == 19 {
                        signal.notify_one();
                    }
                }) => panic!("rank 3 finished training instead of dying"),
                _ = dying.notified() => {}
            }
            let links: Vec<_> = (0..4).filter_map(|r| group.current().link(r).cloned()).collect();
            drop(group);
            for link in links {
                link.cut("rank 3 died");
            }
            died.notify_one();
            None
        }));
    }
    within(20, "rank 3's death", died.notified()).await;
    // A new process takes its place and joins the running job.
    let joiner = within(20, "the joiner", init(options(&store, 0, 4).elastic_world(3, 4))).await;
    assert!(joiner.generation() > 0, "the joiner formed a job of its own");
    let joined = tokio::spawn(train_to_end(joiner, Counter::new()));

    let mut results = Vec::new();
    for member in members {
        if let Some(result) = within(60, "a survivor", member).await.unwrap() {
            results.push((false, result));
        }
    }
    results.push((true, within(60, "the joiner's training", joined).await.unwrap()));
    assert_every_step_applied_once(&results);
    for (is_joiner, (report, _)) in &results {
        if *is_joiner {
            assert!(report.adopted >= 20, "{report:?}");
            assert!(report.applied > 0, "the joiner joined after the end: {report:?}");
        } else {
            assert!(!report.recoveries.is_empty(), "{report:?}");
            // A survivor left out of a generation (it came after the last
            // call) is behind when it is admitted and adopts the steps it
            // missed; the others resume where the death stopped them.
            if report.adopted == 0 {
                let first = &report.recoveries[0];
                assert!(first.resumed_step >= 19 && first.resumed_step <= 20, "{first:?}");
            }
        }
    }
}

/// One step of a caller's own loop on a [`Stepper`]: the gradient sync is
/// an all-reduce of ones on the step's group, and a committed step
/// subtracts 1 from every parameter and counts 1. Returns whether it
/// committed.
async fn own_step(stepper: &mut Stepper, group: &ElasticGroup, job: &mut Counter) -> Result<bool, train::TrainError> {
    own_step_holding(stepper, group, job, async || {}).await
}

/// [`own_step`], running `before_vote` between the step's sync and its
/// commit vote.
async fn own_step_holding(
    stepper: &mut Stepper,
    group: &ElasticGroup,
    job: &mut Counter,
    before_vote: impl AsyncFnOnce(),
) -> Result<bool, train::TrainError> {
    let begun = match stepper.begin(group, None).await? {
        Begin::Ready(begun) => begun,
        Begin::NeedState => match stepper.begin(group, Some(&mut *job)).await? {
            Begin::Ready(begun) => begun,
            Begin::NeedState => panic!("the state was given and still needed"),
        },
    };
    assert_eq!(begun.step, stepper.step());
    let world = begun.group.world_size();
    let synced = begun
        .group
        .all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum)
        .await
        .is_ok_and(|sum| sum.to_vec::<f32>().unwrap() == [world as f32]);
    before_vote().await;
    let (committed, _) = stepper.commit(group, synced, false, 0.0).await?;
    if committed {
        job.state.params[0].1.iter_mut().for_each(|x| *x -= 1.0);
        job.state.optimizer[0].1.iter_mut().for_each(|c| *c += 1.0);
        job.applied.push(begun.step);
    }
    Ok(committed)
}

/// Runs a caller's loop to the end, checks every member holds the same state, leaves.
async fn own_loop_to_end(group: ElasticGroup, mut job: Counter) -> (TrainReport, Counter) {
    let mut stepper = Stepper::new(&group, StepperOptions::default());
    while stepper.step() < STEPS {
        std::thread::sleep(Duration::from_millis(2));
        own_step(&mut stepper, &group, &mut job).await.unwrap();
    }
    train::verify_state(&group.current(), &mut job).await.unwrap();
    group.destroy().await.unwrap();
    (stepper.report(), job)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_the_callers_loop_a_failed_step_is_discarded_everywhere_and_the_joiner_gets_the_survivors_state() {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let died = Arc::new(tokio::sync::Notify::new());
    let mut members = Vec::new();
    for rank in 0..4 {
        let (options, died) = (options(&store, rank, 4).elastic_world(3, 4), died.clone());
        members.push(tokio::spawn(async move {
            let group = init(options).await;
            // Built apart, as a script's members seeded differently: the
            // first step gives every member rank 0's state.
            let mut job = Counter::new();
            job.state.params[0].1.fill(rank as f32 * 100.0);
            if rank != 3 {
                return Some(own_loop_to_end(group, job).await);
            }
            // Rank 3 dies in the middle of step 20, between its sync and its vote.
            let mut stepper = Stepper::new(&group, StepperOptions::default());
            while stepper.step() < 20 {
                own_step(&mut stepper, &group, &mut job).await.unwrap();
            }
            let begun = match stepper.begin(&group, None).await.unwrap() {
                Begin::NeedState => stepper.begin(&group, Some(&mut job)).await.unwrap(),
                begun => begun,
            };
            assert!(matches!(begun, Begin::Ready(_)));
            let links: Vec<_> = (0..4).filter_map(|r| group.current().link(r).cloned()).collect();
            drop(group);
            for link in links {
                link.cut("rank 3 died");
            }
            died.notify_one();
            None
        }));
    }
    within(20, "rank 3's death", died.notified()).await;
    let joiner = within(20, "the joiner", init(options(&store, 0, 4).elastic_world(3, 4))).await;
    assert!(joiner.generation() > 0, "the joiner formed a job of its own");
    let joined = tokio::spawn(own_loop_to_end(joiner, Counter::new()));
    let mut results = Vec::new();
    for member in members {
        if let Some(result) = within(60, "a survivor", member).await.unwrap() {
            results.push((false, result));
        }
    }
    results.push((true, within(60, "the joiner's loop", joined).await.unwrap()));
    // Rank 0's start, then one subtraction per committed step.
    assert_every_step_applied_once(&results);
    for (is_joiner, (report, _)) in &results {
        if *is_joiner {
            assert!(report.adopted >= 20, "{report:?}");
        } else {
            assert!(!report.recoveries.is_empty(), "{report:?}");
        }
    }
}

/// In the caller's loop too, a member whose state changed silently (a
/// flipped value between two steps) is outvoted at the next state check
/// and receives the others' state at its next `begin`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_the_callers_loop_a_silently_changed_state_is_outvoted_and_healed() {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let members: Vec<_> = (0..3)
        .map(|rank| {
            let options = options(&store, rank, 3);
            tokio::spawn(async move {
                let group = init(options).await;
                let mut job = Counter::new();
                let integrity = IntegrityOptions {
                    cadence: Cadence::Every(7),
                    ..IntegrityOptions::default()
                };
                let mut stepper = Stepper::new(
                    &group,
                    StepperOptions {
                        integrity,
                        ..StepperOptions::default()
                    },
                );
                let mut healed = 0;
                while stepper.step() < STEPS {
                    if rank == 2 && stepper.step() == 50 && job.applied.len() == 50 {
                        job.state.params[0].1[5] += 0.5;
                    }
                    let before = job.state.params[0].1[5];
                    own_step(&mut stepper, &group, &mut job).await.unwrap();
                    healed += usize::from(rank == 2 && job.state.params[0].1[5] == before - 1.5);
                }
                train::verify_state(&group.current(), &mut job).await.unwrap();
                group.destroy().await.unwrap();
                assert!(rank != 2 || healed == 1, "rank 2 healed {healed} times");
                (false, (stepper.report(), job))
            })
        })
        .collect();
    let mut results = Vec::new();
    for member in members {
        results.push(within(60, "a member's loop", member).await.unwrap());
    }
    assert_every_step_applied_once(&results);
    for (_, (report, _)) in &results {
        assert_eq!(report.corruptions_detected, 1, "{report:?}");
    }
}

/// Options of rank `rank` of `members` on one fresh store, with room for
/// one joiner, admitted at a step boundary within `longest`.
fn room_for_a_joiner(members: usize, longest: Duration) -> impl Fn(usize) -> InitOptions {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let boundary = Admission::AtStepBoundary { longest };
    move |rank| {
        options(&store, rank, members)
            .elastic_world(members, members + 1)
            .admission(boundary)
    }
}

/// Under `Admission::AtStepBoundary` a joiner restarts no step under way:
/// the members' vote says it waits, and they admit it between two steps.
/// Its bound (60 s) is past the test's limit, so the boundary admitted it.
/// (Under `Admission::Immediate` this test fails: a step is lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_a_step_boundary_a_joiner_is_admitted_and_no_step_is_lost() {
    let options = room_for_a_joiner(3, Duration::from_secs(60));
    let halfway = Arc::new(tokio::sync::Notify::new());
    let members: Vec<_> = (0..3)
        .map(|rank| {
            let (options, halfway) = (options(rank), halfway.clone());
            tokio::spawn(async move {
                let group = init(options).await;
                let mut job = Counter::new();
                let mut stepper = Stepper::new(&group, StepperOptions::default());
                let mut lost = 0;
                while stepper.step() < STEPS {
                    std::thread::sleep(Duration::from_millis(2));
                    if !own_step(&mut stepper, &group, &mut job).await.unwrap() {
                        lost += 1;
                    }
                    if stepper.step() == 30 && rank == 0 {
                        halfway.notify_one();
                    }
                }
                train::verify_state(&group.current(), &mut job).await.unwrap();
                let world = group.world_size();
                group.destroy().await.unwrap();
                (stepper.report(), lost, world)
            })
        })
        .collect();
    within(20, "30 steps", halfway.notified()).await;
    let joiner = within(20, "the joiner", init(options(0))).await;
    let joined = tokio::spawn(own_loop_to_end(joiner, Counter::new()));
    for member in members {
        let (report, lost, world) = within(40, "a member", member).await.unwrap();
        assert_eq!(
            (lost, report.rejected),
            (0, 0),
            "a step under way was lost to the admission: {report:?}"
        );
        assert_eq!(world, 4, "the joiner was never admitted");
        assert_eq!(report.applied, STEPS, "{report:?}");
        assert_eq!(report.recoveries.len(), 1, "one membership change: {report:?}");
    }
    let (report, _) = within(40, "the joiner's loop", joined).await.unwrap();
    assert!(
        report.adopted >= 30 && report.applied + report.adopted == STEPS,
        "{report:?}"
    );
}

/// A member's loop that, once it holds generation 1 (formed beside 0),
/// holds until `resume` just before its step's vote (which reads whether
/// it holds generation 1 right after): no vote can swap before the test
/// says so. Returns its report, the steps it lost and its final world size.
fn held_once_ready(group: Arc<ElasticGroup>, resume: tokio::sync::broadcast::Receiver<()>) -> HeldLoop {
    tokio::spawn(async move {
        let mut job = Counter::new();
        let mut stepper = Stepper::new(&group, StepperOptions::default());
        let (mut lost, mut resume) = (0, Some(resume));
        while stepper.step() < STEPS {
            std::thread::sleep(Duration::from_millis(2));
            let hold = async || {
                if group.next_ready(0)
                    && let Some(mut resume) = resume.take()
                {
                    resume.recv().await.unwrap();
                }
            };
            if !own_step_holding(&mut stepper, &group, &mut job, hold).await.unwrap() {
                lost += 1;
            }
        }
        train::verify_state(&group.current(), &mut job).await.unwrap();
        let world = group.world_size();
        let group = Arc::into_inner(group).expect("the test let go of the group");
        group.destroy().await.unwrap();
        (stepper.report(), lost, world)
    })
}

type HeldLoop = tokio::task::JoinHandle<(TrainReport, u32, usize)>;

/// Three members of generation 0, with room for a joiner admitted at a
/// step boundary, each in a loop [`held_once_ready`]; and the joiner,
/// whose generation 1 every member holds, formed beside generation 0.
struct FormedBeside {
    groups: [Arc<ElasticGroup>; 3],
    members: Vec<HeldLoop>,
    /// Lets the members' loops go on.
    resume: tokio::sync::broadcast::Sender<()>,
    joiner: ElasticGroup,
}

async fn formed_beside() -> FormedBeside {
    let options = room_for_a_joiner(3, Duration::from_secs(60));
    let groups = within(20, "the first generation", async {
        let (a, b, c) = tokio::join!(init(options(0)), init(options(1)), init(options(2)));
        [a, b, c].map(Arc::new)
    })
    .await;
    let (resume, _) = tokio::sync::broadcast::channel::<()>(1);
    let members = groups
        .iter()
        .map(|g| held_once_ready(g.clone(), resume.subscribe()))
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let joiner = within(20, "the joiner's generation, formed beside", init(options(0))).await;
    within(20, "every member holding generation 1", async {
        while !groups.iter().all(|g| g.next_ready(0)) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    FormedBeside {
        groups,
        members,
        resume,
        joiner,
    }
}

/// The next generation forms beside the running one: the joiner and
/// every member hold it while the members are still in generation 0 (each
/// holds its loop before its next vote once it holds it, so no vote can
/// swap); then the first vote in which all hold it swaps, and no step is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_generation_forms_beside_the_running_one_and_the_members_swap_together() {
    let FormedBeside {
        groups,
        members,
        resume,
        joiner,
    } = formed_beside().await;
    assert_eq!((joiner.generation(), joiner.world_size()), (1, 4));
    for group in &groups {
        assert_eq!(group.generation(), 0, "a member left generation 0 before the swap");
    }
    drop(groups);
    let joined = tokio::spawn(own_loop_to_end(joiner, Counter::new()));
    resume.send(()).unwrap();
    for member in members {
        let (report, lost, world) = within(40, "a member", member).await.unwrap();
        assert_eq!((lost, report.rejected, world), (0, 0, 4), "{report:?}");
        assert_eq!(report.applied, STEPS, "{report:?}");
        assert_eq!(report.recoveries.len(), 1, "one membership change: {report:?}");
    }
    let (report, _) = within(40, "the joiner's loop", joined).await.unwrap();
    assert_eq!(report.applied + report.adopted, STEPS, "{report:?}");
}

/// A joiner that leaves after generation 1 formed beside generation 0,
/// before the swap: both generations end and the members re-form without
/// it (generation 2, three members); the step each member was in when
/// generation 0 ended runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_next_generation_that_fails_before_the_swap_ends_both_and_the_members_go_on() {
    let FormedBeside {
        groups,
        members,
        resume,
        joiner,
    } = formed_beside().await;
    joiner.shutdown("the joiner leaves before the swap").await;
    within(20, "the members' generation 2", async {
        while !groups.iter().all(|g| g.generation() == 2) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(groups.iter().all(|g| g.world_size() == 3));
    drop(groups);
    resume.send(()).unwrap();
    for member in members {
        let (report, lost, world) = within(40, "a member", member).await.unwrap();
        assert!(
            lost <= 1 && report.rejected == 0 && world == 3,
            "lost {lost}: {report:?}"
        );
        assert_eq!(report.applied, STEPS, "{report:?}");
    }
}

/// A loop that stopped stepping still admits a joiner, once the bound passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_step_boundary_a_joiner_is_admitted_after_the_bound() {
    let options = room_for_a_joiner(2, Duration::from_millis(300));
    let (a, b) = (init(options(0)), init(options(1)));
    let (a, b) = within(20, "the first generation", async { tokio::join!(a, b) }).await;
    let joiner = within(20, "the joiner's admission", init(options(0))).await;
    assert_eq!((joiner.generation(), joiner.world_size()), (1, 3));
    // Each member swaps its generation on its own: wait for both.
    for member in [&a, &b] {
        within(20, "the others' next generation", member.next_generation(0))
            .await
            .unwrap();
        assert_eq!(member.world_size(), 3);
    }
}

/// A member that leaves the job while the next generation is formed
/// beside the running one, before the swap, closes that generation with a
/// notice: its other members see it leave, not crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_leaving_before_the_swap_closes_the_next_generation_with_a_notice() {
    let options = room_for_a_joiner(2, Duration::from_secs(60));
    let (a, b) = within(20, "the first generation", async {
        tokio::join!(init(options(0)), init(options(1)))
    })
    .await;
    let joining = tokio::spawn(init(options(0)));
    within(20, "the members seeing the joiner", async {
        while !(a.joiners_waiting(0) && b.joiners_waiting(0)) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // The members agree at a step boundary, as a commit vote would.
    for member in [&a, &b] {
        member.admit_at_boundary(&member.current());
    }
    let joiner = within(20, "the joiner's generation, formed beside", joining)
        .await
        .unwrap();
    assert_eq!(joiner.generation(), 1);
    within(20, "both members holding generation 1", async {
        while !(a.next_ready(0) && b.next_ready(0)) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let mut failures = joiner.current().failures();
    a.shutdown("the member leaves before the swap").await;
    let aborted = within(20, "the joiner's generation ending", async {
        failures.wait_for(Option::is_some).await.unwrap().clone().unwrap()
    })
    .await;
    let said = aborted.to_string();
    assert!(
        said.contains("shut down") && !said.contains("without closing"),
        "{said}"
    );
}

/// A member whose state cannot be made equal to the others' (its extras
/// name its own process here): the join says so, naming the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_that_differs_after_the_join_is_an_error_naming_it() {
    struct Stubborn(NamedState, u8);
    impl Parameters for Stubborn {
        fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
            self.0.visit_parameters(visit)
        }
    }
    impl TrainState for Stubborn {
        fn save_extra(&self) -> Vec<u8> {
            vec![self.1]
        }
    }
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let members: Vec<_> = (0..2)
        .map(|rank| {
            let options = options(&store, rank, 2);
            tokio::spawn(async move {
                let group = init(options).await;
                let mut state = Stubborn(Counter::new().state, rank as u8);
                let mut stepper = Stepper::new(&group, StepperOptions::default());
                let error = stepper.begin(&group, Some(&mut state)).await.unwrap_err();
                group.destroy().await.ok();
                error.to_string()
            })
        })
        .collect();
    for member in members {
        let error = within(30, "a member's join", member).await.unwrap();
        assert!(error.contains("extras"), "{error}");
    }
}

/// Members whose state lists differ are refused at the first step, before
/// any training, naming the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_different_state_are_refused_at_the_first_step() {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let members: Vec<_> = (0..2)
        .map(|rank| {
            let options = options(&store, rank, 2);
            tokio::spawn(async move {
                let group = init(options).await;
                let mut job = Counter::new();
                if rank == 1 {
                    job.state.params[0].0 = "y".into();
                }
                let mut stepper = Stepper::new(&group, StepperOptions::default());
                let error = stepper.begin(&group, Some(&mut job)).await.unwrap_err();
                group.destroy().await.ok();
                error.to_string()
            })
        })
        .collect();
    for member in members {
        let error = within(30, "a member's join", member).await.unwrap();
        assert!(
            error.contains("rank 1 lists different state") && error.contains('y'),
            "{error}"
        );
    }
}

/// Trains `world` in-process members with `corruptions` asked for and the
/// state checked every `every` steps; each member's result.
async fn train_corrupted(
    world: usize,
    corruptions: Vec<StateCorruption>,
    every: u64,
) -> Vec<Result<(TrainReport, Counter), train::TrainError>> {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let members: Vec<_> = (0..world)
        .map(|rank| {
            let (options, corruptions) = (options(&store, rank, world), corruptions.clone());
            tokio::spawn(async move {
                let group = init(options).await;
                let mut job = Counter::new();
                let train_options = TrainOptions {
                    corruptions,
                    integrity: IntegrityOptions {
                        cadence: Cadence::Every(every),
                        ..IntegrityOptions::default()
                    },
                    ..train_options()
                };
                let report = train::train(&group, &mut job, &train_options, |_| {}).await;
                if report.is_ok() {
                    train::verify_state(&group.current(), &mut job).await.unwrap();
                }
                group.destroy().await.ok();
                report.map(|report| (report, job))
            })
        })
        .collect();
    let mut results = Vec::new();
    for member in members {
        results.push(within(60, "a member's training", member).await.unwrap());
    }
    results
}

fn corrupt(rank: usize, step: u64, target: StateTarget) -> StateCorruption {
    StateCorruption {
        rank,
        step,
        target,
        bit: None,
    }
}

/// A flipped bit in one member's parameters (silent: its loss stays
/// finite) is found by the state check within its cadence; the member is
/// outvoted by the two others and receives their state; nobody rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_parameter_bit_is_outvoted_and_healed_from_the_majority() {
    let results = train_corrupted(3, vec![corrupt(1, 40, StateTarget::Params)], 8).await;
    let results: Vec<_> = results.into_iter().map(|r| (false, r.unwrap())).collect();
    // Exact values: the corrupt state was replaced, no step applied twice or lost.
    assert_every_step_applied_once(&results);
    for (rank, (_, (report, _))) in results.iter().enumerate() {
        assert_eq!(report.corruptions_detected, 1, "rank {rank}: {report:?}");
        assert_eq!(
            report.corruptions_injected,
            u64::from(rank == 1),
            "rank {rank}: {report:?}"
        );
        assert!(report.recoveries.is_empty(), "healing is no re-formation: {report:?}");
    }
}

/// With two members no majority tells which copy is right: both stop at
/// the check, naming the step, the entry and both fingerprints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_members_a_corrupt_state_stops_training_naming_both_fingerprints() {
    // Checked every 5 steps: the corruption at 22 is found before step 25.
    for result in train_corrupted(2, vec![corrupt(0, 22, StateTarget::Params)], 5).await {
        let Err(error) = result else {
            panic!("training went on with two different states");
        };
        let text = error.to_string();
        let train::TrainError::Corrupted {
            step,
            entry,
            fingerprints,
        } = error
        else {
            panic!("not a corruption: {text}");
        };
        assert_eq!((step, entry.as_str()), (25, "x"), "{text}");
        assert_eq!(fingerprints.len(), 2);
        assert_ne!(fingerprints[0].1, fingerprints[1].1);
        assert!(text.contains("no majority") && text.contains("rank 1: "), "{text}");
    }
}

/// A flipped exponent bit in one member's local gradient makes its norm
/// an outlier: the step is voted down on every member and computed again,
/// so the corrupt gradient is never applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_gradient_bit_is_found_at_the_vote_and_the_step_is_computed_again() {
    let results = train_corrupted(2, vec![corrupt(0, 30, StateTarget::Grads)], 1000).await;
    let results: Vec<_> = results.into_iter().map(|r| (false, r.unwrap())).collect();
    assert_every_step_applied_once(&results);
    for (rank, (_, (report, _))) in results.iter().enumerate() {
        assert_eq!(
            (report.corruptions_detected, report.rejected),
            (1, 1),
            "rank {rank}: {report:?}"
        );
        assert_eq!(report.corruptions_injected, u64::from(rank == 0));
    }
}

/// Runs the example with `args` and `--json`; its last line, parsed.
fn run_example(args: &[&str], secs: u64) -> serde_json::Value {
    run_example_with_stderr(args, secs).0
}

/// Runs the example with `args` and `--json`; its last line, parsed, and
/// what it printed on stderr.
fn run_example_with_stderr(args: &[&str], secs: u64) -> (serde_json::Value, String) {
    let plot = std::env::temp_dir().join(format!("chorus-train-test-{}.png", std::process::id()));
    let mut command = Command::new(example("train"));
    command
        .args(args)
        .args(["--json", "--plot"])
        .arg(&plot)
        .env_remove("CHORUS_FAULTS")
        .env_remove("CHORUS_JOB_SECRET");
    let output = common::run(&mut command, secs, "examples/train", LAUNCHER);
    assert!(output.status.success(), "{}", text(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    let json = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}\n{}", text(&output)));
    (json, String::from_utf8_lossy(&output.stderr).into_owned())
}

/// Every flag is checked before anything starts, with a one-line error:
/// an option that can never act is an error, not a silent no-op.
#[test]
fn bad_flags_fail_at_once_with_one_line_each() {
    for (args, needle) in [
        (
            &["--fault-step", "0"][..],
            "--fault-step 0 with --steps 400: the kill would never be injected",
        ),
        (&["--fault-step", "99999"], "--fault-step 99999 with --steps 400"),
        (&["--steps", "100", "--fault-step", "100"], "give a step from 1 to 99"),
        (
            &["--batch", "3"],
            "--batch 3 with --world 4: every worker needs a sample per step",
        ),
        (&["--hidden", "0"], "--hidden 0"),
        (&["--world", "1"], "--world 1: at least 2"),
        (&["--heartbeat-ms", "0"], "--heartbeat-ms 0"),
        (
            &["--fault", "none", "--fault-every", "2"],
            "--fault-every 2 with --fault none",
        ),
        (&["--fault-every", "0"], "--fault-every 0: a positive number of seconds"),
        (
            &["--fault", "corrupt", "--mode", "local-sgd"],
            "--fault corrupt with --mode local-sgd: corruption is checked for in ddp only",
        ),
        (&["--mode", "local-sgd", "--every", "0"], "--every 0 with --steps 400"),
        (
            &["--fragments", "2"],
            "--fragments 2: at least 1, and more only with --mode diloco",
        ),
        (
            &["--plot", "/nonexistent-dir/loss.png"],
            "the directory /nonexistent-dir does not exist",
        ),
        (
            &["--world", "100000", "--batch", "100000"],
            "--world 100000 needs about",
        ),
    ] {
        let mut command = Command::new(example("train"));
        // (A backtrace asked for would be more lines.)
        command
            .args(args)
            .env_remove("RANK")
            .env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE");
        let output = common::run(&mut command, 20, "examples/train", common::Stop::Kill);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} ran:\n{}", text(&output));
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: one line: {stderr}");
        assert!(output.stdout.is_empty(), "{args:?} started: {}", text(&output));
    }
}

#[test]
fn after_a_kill_and_rejoin_the_loss_is_the_fault_free_runs() {
    let (run, stderr) = run_example_with_stderr(&["--fault", "kill", "--steps", "200", "--fault-step", "80"], 90);
    // The injected fault and its recovery read as expected events: said
    // before the launcher reports it, no errors from the survivors, no
    // colour codes off a terminal, no note repeated for each run.
    assert!(
        stderr.contains("train: injected the fault: kill of rank 3 at step 80"),
        "{stderr}"
    );
    assert!(!stderr.contains("ERROR") && !stderr.contains('\u{1b}'), "{stderr}");
    assert!(!stderr.contains("OMP_NUM_THREADS"), "{stderr}");
    assert_eq!(run["recoveries"], 1, "{run}");
    // The summary says which fault was injected, and when.
    assert_eq!(
        run["injected"],
        serde_json::json!(["kill of rank 3 at step 80"]),
        "{run}"
    );
    assert_eq!(run["recovery_ms"].as_array().map(Vec::len), Some(1), "{run}");
    let (loss, reference) = (
        run["final_loss"].as_f64().unwrap(),
        run["reference_loss"].as_f64().unwrap(),
    );
    assert!((loss / reference - 1.0).abs() < 0.02, "{run}");
    assert_eq!(run["applied"].as_u64().unwrap() + run["adopted"].as_u64().unwrap(), 200);
}

/// A bit flipped in the last worker's parameters is found by the state
/// check and healed from the three others' state; one flipped in its
/// local gradient is found at the vote and the step computed again, so
/// the run ends exactly where the fault-free one does.
#[test]
fn a_flipped_bit_in_a_worker_is_found_and_healed_and_the_loss_is_the_fault_free_runs() {
    for target in ["params", "grads"] {
        let args = [
            "--fault",
            "corrupt",
            "--corrupt",
            target,
            "--steps",
            "160",
            "--fault-step",
            "60",
        ];
        let run = run_example(&args, 60);
        assert_eq!(
            run["injected"],
            serde_json::json!(["corrupt of rank 3 at step 60"]),
            "{run}"
        );
        assert_eq!(
            (&run["corruptions_injected"], &run["corruptions_detected"]),
            (&1.into(), &1.into()),
            "{run}"
        );
        assert_eq!(run["recoveries"], 0, "healing re-forms nothing: {run}");
        assert_eq!(run["applied"], 160, "{run}");
        let (loss, reference) = (
            run["final_loss"].as_f64().unwrap(),
            run["reference_loss"].as_f64().unwrap(),
        );
        match target {
            // The corrupt gradient was never applied.
            "grads" => assert_eq!(loss, reference, "{run}"),
            // Until it was found, the corrupt replica's gradients counted.
            _ => assert!((loss / reference - 1.0).abs() < 0.02, "{run}"),
        }
    }
}

#[test]
fn local_sgd_and_diloco_streaming_or_not_reach_ddp_loss_within_5_percent() {
    let loss = |mode: &[&str]| {
        let run = run_example(&[&["--fault", "none", "--mode"], mode].concat(), 60);
        run["final_loss"].as_f64().unwrap()
    };
    let ddp = loss(&["ddp"]);
    for mode in [&["local-sgd"][..], &["diloco"], &["diloco", "--fragments", "2"]] {
        let local = loss(mode);
        assert!(
            (local / ddp - 1.0).abs() < 0.05,
            "{mode:?}: {local} against DDP's {ddp}"
        );
    }
}

#[test]
fn diloco_recovers_from_a_kill_with_its_outer_state() {
    let run = run_example(
        &[
            "--fault",
            "kill",
            "--mode",
            "diloco",
            "--steps",
            "200",
            "--fault-step",
            "80",
        ],
        90,
    );
    assert_eq!(run["recoveries"], 1, "{run}");
    let (loss, reference) = (
        run["final_loss"].as_f64().unwrap(),
        run["reference_loss"].as_f64().unwrap(),
    );
    assert!((loss / reference - 1.0).abs() < 0.05, "{run}");
}

/// The run's loss against its fault-free reference, and the counter of
/// applied updates: every committed step applied or adopted once.
fn assert_reaches_the_reference(run: &serde_json::Value, steps: u64) {
    let (loss, reference) = (
        run["final_loss"].as_f64().unwrap(),
        run["reference_loss"].as_f64().unwrap(),
    );
    assert!((loss / reference - 1.0).abs() < 0.02, "{run}");
    assert_eq!(
        run["applied"].as_u64().unwrap() + run["adopted"].as_u64().unwrap(),
        steps,
        "{run}"
    );
}

#[test]
fn a_frozen_worker_is_left_behind_then_rejoins_and_the_loss_is_the_fault_free_runs() {
    // SIGSTOP at step 80: only the heartbeats (1 s here) find it; the
    // example kills it once the others went on without it, and its
    // relaunch rejoins before the job ends.
    let (run, stderr) = run_example_with_stderr(
        &[
            "--fault",
            "freeze",
            "--steps",
            "200",
            "--fault-step",
            "80",
            "--heartbeat-ms",
            "1000",
        ],
        120,
    );
    let first = &run["phases"][0];
    assert_eq!(
        first["world_size"], 3,
        "the survivors did not go on without the frozen worker: {run}"
    );
    // Never rolled back: step 79 was committed by all four, 80 is re-run.
    assert_eq!(first["resumed_step"], 80, "{run}");
    let phases = run["phases"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        phases.last().map(|p| p["world_size"].clone()),
        Some(4.into()),
        "the frozen worker's relaunch did not rejoin: {run}"
    );
    assert_eq!(
        run["injected"],
        serde_json::json!(["freeze of rank 3 at step 80"]),
        "{run}"
    );
    // Who killed the frozen worker, and why, comes before the launcher's report of it.
    let killing = stderr
        .find("train: killing the frozen rank 3")
        .unwrap_or_else(|| panic!("{stderr}"));
    let reported = stderr
        .find("was killed by signal SIGKILL")
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(killing < reported, "{stderr}");
    assert_reaches_the_reference(&run, 200);
}

#[test]
fn a_cut_off_worker_rejoins_and_the_loss_is_the_fault_free_runs() {
    // Its links are cut at step 80 while it keeps running: nobody dies.
    let run = run_example(&["--fault", "partition", "--steps", "200", "--fault-step", "80"], 120);
    let phases = run["phases"].as_array().cloned().unwrap_or_default();
    assert!(!phases.is_empty(), "no recovery: {run}");
    assert_eq!(phases[0]["resumed_step"], 80, "{run}");
    assert_eq!(
        phases.last().map(|p| p["world_size"].clone()),
        Some(4.into()),
        "the cut-off worker did not come back: {run}"
    );
    assert_reaches_the_reference(&run, 200);
}
