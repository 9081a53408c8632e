//! Elastic data-parallel training of a real model that survives a worker's
//! death: `cargo run --release --example train`.
//!
//! A 3-layer MLP (candle, CPU) learns a synthetic 10-class problem (labels
//! from a fixed random teacher network; no download) on 4 ranks under
//! `chorus launch --restart-policy worker`. At `--fault-step` one worker
//! dies (`--fault kill`: SIGKILL), freezes (`freeze`: SIGSTOP, found by the
//! heartbeats, killed twice the heartbeat timeout later), is cut off (`partition`: its links are
//! cut while it keeps running) or has one bit of its parameters or local
//! gradient flipped (`corrupt`, `--corrupt params|grads`: silent data
//! corruption, found by the members' checks and healed from the
//! majority's state); the survivors never roll back, the
//! relaunched worker rejoins and receives the model and optimizer state,
//! and training goes on. The same steps then run fault-free, and both
//! final losses (on held-out data) are printed side by side, with a loss
//! curve (`--plot`, the failure marked).
//!
//! Run without launcher variables, this program launches itself (through
//! `chorus_cli::launch`, the library behind `chorus launch`); with them (`RANK`
//! set) it is one worker.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use candle_core::{D, DType as CDType, Device, Tensor as CTensor, Var};
use chorus::process::{self, Signal};
use chorus::sync::{DistributedSync, ParamBuffer, Parameters};
use chorus::train::{
    self, InPlace, Job, Mode, NamedState, StateCorruption, StateTarget, Step, TrainOptions, TrainState,
};
use chorus::{ElasticGroup, InitOptions};
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Fault {
    None,
    Kill,
    Freeze,
    Partition,
    Corrupt,
}

/// Where `--fault corrupt` flips its bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CorruptArg {
    Params,
    Grads,
}

impl Fault {
    /// Its name on the command line.
    fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::Kill => "kill",
            Fault::Freeze => "freeze",
            Fault::Partition => "partition",
            Fault::Corrupt => "corrupt",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModeArg {
    Ddp,
    LocalSgd,
    Diloco,
}

/// Elastic data-parallel training with an injected failure.
#[derive(Debug, Clone, Parser)]
struct Args {
    /// The failure to inject into the last rank.
    #[arg(long, value_enum, default_value = "kill")]
    fault: Fault,
    /// The committed step at which it happens, from 1 to --steps - 1
    /// [default: 3/8 of --steps].
    #[arg(long)]
    fault_step: Option<u64>,
    /// Also kill a worker (rotating over ranks 1..) every SECS seconds
    /// (goodput runs; not with --fault none).
    #[arg(long)]
    fault_every: Option<f64>,
    /// What `--fault corrupt` flips a bit of: the parameters (silent,
    /// found by the state check) or the local gradient (found at the vote).
    #[arg(long, value_enum, default_value = "params")]
    corrupt: CorruptArg,
    /// How replicas are kept together.
    #[arg(long, value_enum, default_value = "ddp")]
    mode: ModeArg,
    /// Local steps between outer syncs (local-sgd, diloco).
    #[arg(long, default_value_t = 8)]
    every: u64,
    /// DiLoCo's outer learning rate.
    #[arg(long, default_value_t = 0.7)]
    outer_lr: f32,
    /// DiLoCo's outer (Nesterov) momentum. The published 0.9 is for
    /// hundreds of outer steps; this short run takes 50, and 0.9's
    /// effective step (lr / (1 - momentum) = 7x the drift) overshoots.
    #[arg(long, default_value_t = 0.5)]
    outer_momentum: f32,
    /// Streaming DiLoCo: sync the model in this many fragments, at staggered steps.
    #[arg(long, default_value_t = 1)]
    fragments: u32,
    /// Committed steps.
    #[arg(long, default_value_t = 400)]
    steps: u64,
    /// Workers.
    #[arg(long, default_value_t = 4)]
    world: usize,
    /// Samples per step over all workers.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Width of the two hidden layers: 256 is 77 k parameters (600 KiB of
    /// model and optimizer state); 3600 makes 100 MiB of it.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// MiB of extra optimizer-side state beside the model (a stand-in for
    /// a larger model's state: moved to joiners and verified like the rest,
    /// one value changed per committed step), to measure recovery at a
    /// state size without a slower step.
    #[arg(long, default_value_t = 0)]
    state_mib: usize,
    /// Heartbeat timeout in milliseconds: how long a frozen worker goes unnoticed.
    #[arg(long, default_value_t = 2000)]
    heartbeat_ms: u64,
    /// Seed of the data and the initial weights.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Skip the fault-free reference run.
    #[arg(long)]
    no_reference: bool,
    /// The loss curve.
    #[arg(long, default_value = "train-loss.png")]
    plot: PathBuf,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
    /// Keep the run's directory (the workers' logs, where their output
    /// goes; `CHORUS_LOG=info` shows each one's phases) and print where it is.
    #[arg(long)]
    keep_logs: bool,
    /// Serve the training run's live page at ADDR (`chorus launch
    /// --dashboard`; 127.0.0.1:0 picks a free port and prints the URL).
    #[arg(long, value_name = "ADDR")]
    dashboard: Option<String>,
    /// Let the page inject faults, with the job secret (`--dashboard-faults`).
    #[arg(long)]
    dashboard_faults: bool,
    /// (internal) the run's directory, given to the workers.
    #[arg(long, hide = true)]
    run_dir: Option<PathBuf>,
}

impl Args {
    /// The training mode and the injected corruption the flags ask for.
    fn train_options(&self) -> TrainOptions {
        let mode = match self.mode {
            ModeArg::Ddp => Mode::Ddp,
            ModeArg::LocalSgd => Mode::LocalSgd { every: self.every },
            ModeArg::Diloco => Mode::DiLoCo {
                every: self.every,
                outer_lr: self.outer_lr,
                outer_momentum: self.outer_momentum,
                fragments: self.fragments,
            },
        };
        let corruptions = match self.fault {
            Fault::Corrupt => vec![StateCorruption {
                rank: self.world - 1,
                step: self.fault_step(),
                target: match self.corrupt {
                    CorruptArg::Params => StateTarget::Params,
                    CorruptArg::Grads => StateTarget::Grads,
                },
                bit: None,
            }],
            _ => Vec::new(),
        };
        TrainOptions {
            mode,
            steps: self.steps,
            global_batch: self.batch,
            corruptions,
            ..TrainOptions::default()
        }
    }

    /// The step of `--fault`: given, or 3/8 of the way (150 of 400).
    fn fault_step(&self) -> u64 {
        self.fault_step.unwrap_or(self.steps * 3 / 8).max(1)
    }

    /// Checks every flag before anything starts, each mistake a one-line
    /// error: an option that cannot act (a fault never injected, a sync
    /// that never runs) would otherwise look like success, and a batch
    /// too small for the workers would end in a restart loop.
    fn check(&self, available: Option<u64>) -> Result<()> {
        let Args {
            world, steps, batch, ..
        } = *self;
        if world < 2 {
            bail!("--world {world}: at least 2 workers, one to fail and one to go on");
        }
        if steps < 2 {
            bail!("--steps {steps}: at least 2 steps");
        }
        if batch < world {
            bail!(
                "--batch {batch} with --world {world}: every worker needs a sample per step; give --batch {world} or more"
            );
        }
        if self.hidden == 0 {
            bail!("--hidden 0: the hidden layers need at least one unit");
        }
        if self.heartbeat_ms < 100 {
            bail!(
                "--heartbeat-ms {}: at least 100; a shorter window takes a busy worker for frozen",
                self.heartbeat_ms
            );
        }
        if let Some(step) = self.fault_step
            && self.fault != Fault::None
            && !(1..steps).contains(&step)
        {
            bail!(
                "--fault-step {step} with --steps {steps}: the {} would never be injected; give a step from 1 to {}",
                self.fault.name(),
                steps - 1
            );
        }
        if self.fault == Fault::Corrupt && self.mode != ModeArg::Ddp {
            let mode = self
                .mode
                .to_possible_value()
                .map(|v| v.get_name().to_owned())
                .unwrap_or_default();
            bail!(
                "--fault corrupt with --mode {mode}: corruption is checked for in ddp only (the local modes' replicas differ by design)"
            );
        }
        if let Some(every) = self.fault_every {
            if !(every.is_finite() && every > 0.0) {
                bail!("--fault-every {every}: a positive number of seconds");
            }
            if self.fault == Fault::None {
                bail!(
                    "--fault-every {every} with --fault none: no worker would be killed; give --fault kill (or another)"
                );
            }
        }
        if self.mode != ModeArg::Ddp && !(1..steps).contains(&self.every) {
            bail!(
                "--every {} with --steps {steps}: the replicas would never sync; give 1 to {}",
                self.every,
                steps - 1
            );
        }
        if self.mode == ModeArg::Diloco {
            if !(self.outer_lr.is_finite() && self.outer_lr > 0.0) {
                bail!("--outer-lr {}: a positive number", self.outer_lr);
            }
            if !(0.0..1.0).contains(&self.outer_momentum) {
                bail!("--outer-momentum {}: from 0 to below 1", self.outer_momentum);
            }
        }
        if self.fragments == 0 || (self.fragments > 1 && self.mode != ModeArg::Diloco) {
            bail!(
                "--fragments {}: at least 1, and more only with --mode diloco",
                self.fragments
            );
        }
        if let Some(dir) = self.plot.parent().filter(|d| !d.as_os_str().is_empty())
            && !dir.is_dir()
        {
            bail!(
                "--plot {}: the directory {} does not exist",
                self.plot.display(),
                dir.display()
            );
        }
        if let Some(available) = available {
            let needed = self.memory_needed();
            if needed > available {
                let gib = |b: u64| b as f64 / f64::from(1 << 30);
                bail!(
                    "--world {world} needs about {:.1} GiB ({:.0} MiB per worker, a rough estimate), more than the {:.1} GiB this host has available; give a smaller --world, --hidden or --state-mib",
                    gib(needed),
                    needed as f64 / world as f64 / f64::from(1 << 20),
                    gib(available)
                );
            }
        }
        Ok(())
    }

    /// A rough estimate of the host memory the workers take: each a
    /// runtime, its data and copies of the state (model, optimizer,
    /// gradients, a joiner's transfer), plus the host's shared-memory
    /// rings (48 MiB each, at most `CHORUS_SHM_BUDGET`'s default 576 MiB in
    /// all; `chorus::mesh`).
    fn memory_needed(&self) -> u64 {
        const BASE: u64 = 100 << 20;
        const RING: u64 = 48 << 20;
        const RINGS_BUDGET: u64 = 576 << 20;
        let h = self.hidden as u64;
        let params = (INPUTS as u64 + 1) * h + (h + 1) * h + (h + 1) * CLASSES as u64;
        let state = 4 * params * 4 + 2 * ((self.state_mib as u64) << 20);
        let world = self.world as u64;
        let rings = (RING * world * (world - 1)).min(RINGS_BUDGET);
        world * (BASE + state) + rings
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

const INPUTS: usize = 32;
const CLASSES: usize = 10;
const TRAIN_SAMPLES: usize = 16384;
const EVAL_SAMPLES: usize = 2048;

/// splitmix64: a small deterministic generator, the same on every rank.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform().max(1e-7), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}

/// Inputs and labels from a fixed random teacher (a 2-layer tanh network).
struct Dataset {
    x: Vec<f32>,
    y: Vec<u32>,
}

impl Dataset {
    fn generate(seed: u64, samples: usize, stream: u64) -> Self {
        let mut teacher = Rng(seed);
        let w1: Vec<f32> = (0..INPUTS * 64)
            .map(|_| teacher.normal() / (INPUTS as f32).sqrt())
            .collect();
        let w2: Vec<f32> = (0..64 * CLASSES).map(|_| teacher.normal() / 8.0 * 3.0).collect();
        let mut rng = Rng(seed ^ stream.wrapping_mul(0x2545_f491_4f6c_dd1d));
        let mut x = Vec::with_capacity(samples * INPUTS);
        let mut y = Vec::with_capacity(samples);
        for _ in 0..samples {
            let sample: Vec<f32> = (0..INPUTS).map(|_| rng.normal()).collect();
            let hidden: Vec<f32> = (0..64)
                .map(|j| (0..INPUTS).map(|i| sample[i] * w1[i * 64 + j]).sum::<f32>().tanh())
                .collect();
            let logits: Vec<f32> = (0..CLASSES)
                .map(|c| (0..64).map(|j| hidden[j] * w2[j * CLASSES + c]).sum::<f32>() + 0.3 * rng.normal())
                .collect();
            let label = (0..CLASSES)
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap_or(0);
            x.extend_from_slice(&sample);
            y.push(label as u32);
        }
        Self { x, y }
    }

    fn len(&self) -> usize {
        self.y.len()
    }

    /// The training set, read from `dir` where an earlier worker of the
    /// run saved it (a relaunched worker then starts in milliseconds, as
    /// one reading its data from disk would), else generated and saved.
    fn load_or_generate(dir: &Path, seed: u64, samples: usize) -> Self {
        let path = dir.join(format!("train-data-{seed}-{samples}"));
        if let Some(data) = std::fs::read(&path).ok().and_then(|b| Self::decode(&b, samples)) {
            return data;
        }
        let data = Self::generate(seed, samples, 1);
        // Written aside and renamed: a reader never sees half a file.
        let aside = path.with_extension(std::process::id().to_string());
        if std::fs::write(&aside, data.encode()).is_ok() {
            let _ = std::fs::rename(&aside, &path);
        }
        data
    }

    fn encode(&self) -> Vec<u8> {
        let x = self.x.iter().map(|v| v.to_le_bytes());
        x.chain(self.y.iter().map(|v| v.to_le_bytes())).flatten().collect()
    }

    fn decode(bytes: &[u8], samples: usize) -> Option<Self> {
        if bytes.len() != samples * (INPUTS + 1) * 4 {
            return None;
        }
        let (x, y) = bytes.split_at(samples * INPUTS * 4);
        let word = |w: &[u8]| [w[0], w[1], w[2], w[3]];
        Some(Self {
            x: x.chunks_exact(4).map(|w| f32::from_le_bytes(word(w))).collect(),
            y: y.chunks_exact(4).map(|w| u32::from_le_bytes(word(w))).collect(),
        })
    }
}

/// The MLP and its SGD-with-momentum state, as plain vectors (chorus moves
/// them); candle computes the forward and backward passes.
struct Mlp {
    state: NamedState,
    data: Arc<Dataset>,
    seed: u64,
    steps: u64,
    lr: f32,
    layers: Layers,
    /// `--state-mib` of extra state.
    padding: Vec<f32>,
}

/// Each layer's name, inputs and outputs.
type Layers = [(&'static str, usize, usize); 3];

fn layers(hidden: usize) -> Layers {
    [("l1", INPUTS, hidden), ("l2", hidden, hidden), ("l3", hidden, CLASSES)]
}

impl Mlp {
    fn new(seed: u64, data: Arc<Dataset>, steps: u64, lr: f32, hidden: usize, state_mib: usize) -> Self {
        let mut rng = Rng(seed.wrapping_add(1));
        let mut params = Vec::new();
        let layers = layers(hidden);
        for (name, fan_in, fan_out) in layers {
            let bound = (6.0 / fan_in as f32).sqrt();
            let w = (0..fan_in * fan_out)
                .map(|_| (rng.uniform() * 2.0 - 1.0) * bound)
                .collect();
            params.push((format!("{name}.weight"), w));
            params.push((format!("{name}.bias"), vec![0.0; fan_out]));
        }
        let optimizer = params
            .iter()
            .map(|(name, p)| (format!("{name}.momentum"), vec![0.0; p.len()]))
            .collect();
        Self {
            state: NamedState {
                params,
                buffers: Vec::new(),
                optimizer,
                extra: Vec::new(),
            },
            data,
            seed,
            steps,
            lr,
            layers,
            // Every page written (no zero pages a source would read for
            // free, none a joiner's transfer would fault in), but cheaply.
            padding: (0..(state_mib << 20) / 4)
                .map(|i| (i as u32).wrapping_mul(0x9e37_79b9) as f32)
                .collect(),
        }
    }

    /// Warm-up over 20 steps, then cosine decay to a tenth: follows the committed step.
    fn learning_rate(&self, step: u64) -> f32 {
        let warmup = 20.0;
        let s = step as f32;
        if s < warmup {
            return self.lr * (s + 1.0) / warmup;
        }
        let progress = ((s - warmup) / (self.steps as f32 - warmup).max(1.0)).min(1.0);
        self.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f32::consts::PI * progress).cos()))
    }

    /// Sample indices of `step`'s global batch: a fresh permutation each epoch.
    fn batch(&self, step: u64, batch: usize) -> Vec<usize> {
        let n = self.data.len();
        let start = step as usize * batch;
        (start..start + batch)
            .map(|i| {
                let (epoch, at) = (i / n, i % n);
                permutation(self.seed, epoch as u64, n)[at]
            })
            .collect()
    }

    /// Mean loss and, when asked, the gradients of the samples `indices` of `data`.
    fn loss(&self, data: &Dataset, indices: &[usize], grads: bool) -> Result<(f32, Vec<Vec<f32>>)> {
        let device = Device::Cpu;
        let x: Vec<f32> = indices
            .iter()
            .flat_map(|&i| data.x[i * INPUTS..(i + 1) * INPUTS].iter().copied())
            .collect();
        let y: Vec<u32> = indices.iter().map(|&i| data.y[i]).collect();
        let x = CTensor::from_vec(x, (indices.len(), INPUTS), &device)?;
        let y = CTensor::from_vec(y, indices.len(), &device)?;
        let vars: Vec<Var> = self
            .state
            .params
            .iter()
            .zip(self.layers.iter().flat_map(|&(_, i, o)| [vec![i, o], vec![o]]))
            .map(|((_, v), shape)| Var::from_tensor(&CTensor::from_slice(v, shape, &device)?))
            .collect::<candle_core::Result<_>>()?;
        let mut h = x;
        for (layer, pair) in vars.chunks(2).enumerate() {
            h = h.matmul(pair[0].as_tensor())?.broadcast_add(pair[1].as_tensor())?;
            if layer + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        let loss = candle_nn::loss::cross_entropy(&h, &y)?;
        let value = loss.to_scalar::<f32>()?;
        if !grads {
            return Ok((value, Vec::new()));
        }
        let store = loss.backward()?;
        let grads = vars
            .iter()
            .map(|v| match store.get(v.as_tensor()) {
                Some(g) => Ok(g.flatten_all()?.to_vec1::<f32>()?),
                None => Ok(vec![0.0; v.as_tensor().elem_count()]),
            })
            .collect::<Result<_>>()?;
        Ok((value, grads))
    }

    fn accuracy(&self, data: &Dataset) -> Result<f32> {
        let device = Device::Cpu;
        let x = CTensor::from_slice(&data.x, (data.len(), INPUTS), &device)?;
        let mut h = x;
        for (layer, pair) in self.state.params.chunks(2).enumerate() {
            let (_, i, o) = self.layers[layer];
            let w = CTensor::from_slice(&pair[0].1, (i, o), &device)?;
            let b = CTensor::from_slice(&pair[1].1, o, &device)?;
            h = h.matmul(&w)?.broadcast_add(&b)?;
            if layer + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        let predicted = h.argmax(D::Minus1)?.to_dtype(CDType::U32)?.to_vec1::<u32>()?;
        let right = predicted.iter().zip(&data.y).filter(|(p, y)| p == y).count();
        Ok(right as f32 / data.len() as f32)
    }
}

/// A permutation with its (seed, epoch).
type Permutation = (u64, u64, Arc<Vec<usize>>);

/// The permutation of `0..n` for `epoch` (cached: it is asked for every sample).
fn permutation(seed: u64, epoch: u64, n: usize) -> Arc<Vec<usize>> {
    use std::sync::Mutex;
    static CACHE: Mutex<Option<Permutation>> = Mutex::new(None);
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((s, e, p)) = cache.as_ref()
        && (*s, *e) == (seed, epoch)
        && p.len() == n
    {
        return p.clone();
    }
    let mut rng = Rng(seed ^ (epoch + 1).wrapping_mul(0x9e37_79b9));
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        p.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let p = Arc::new(p);
    *cache = Some((seed, epoch, p.clone()));
    p
}

impl Parameters for Mlp {
    fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        self.state.visit_parameters(visit)
    }
}

impl TrainState for Mlp {
    fn visit_optimizer(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        self.state.visit_optimizer(visit);
        if !self.padding.is_empty() {
            visit("padding", &mut self.padding);
        }
    }
    fn buffers_in_place(&self) -> Option<InPlace> {
        // SAFETY: it visits `Vec`s it owns (its `NamedState`'s and the
        // padding), never resized while the state is borrowed.
        Some(unsafe { InPlace::promise() })
    }
}

impl Job for Mlp {
    fn backward(&mut self, step: &Step, grads: &mut DistributedSync<'static>) -> Result<f64, String> {
        let batch = self.batch(step.step, step.global_batch);
        let mine = &batch[step.shard()];
        if mine.is_empty() {
            return Ok(0.0);
        }
        let data = self.data.clone();
        let (loss, computed) = self.loss(&data, mine, true).map_err(|e| e.to_string())?;
        // candle gives the mean over my samples; the sync wants their sum times grad_scale.
        let factor = mine.len() as f32 * step.grad_scale;
        // Last layer first, as a backward pass produces them (the buckets start early).
        for id in (0..computed.len()).rev() {
            let view = grads.grad_mut::<f32>(id).map_err(|e| e.to_string())?;
            for (g, c) in view.iter_mut().zip(&computed[id]) {
                *g = c * factor;
            }
            grads.mark_ready(id).map_err(|e| e.to_string())?;
        }
        Ok(f64::from(loss) * mine.len() as f64)
    }

    fn apply(&mut self, step: &Step, grads: &DistributedSync<'static>) -> Result<(), String> {
        let lr = self.learning_rate(step.step);
        for (id, ((_, p), (_, m))) in self
            .state
            .params
            .iter_mut()
            .zip(self.state.optimizer.iter_mut())
            .enumerate()
        {
            let g = grads.grad::<f32>(id).map_err(|e| e.to_string())?;
            for ((p, m), g) in p.iter_mut().zip(m.iter_mut()).zip(g) {
                *m = 0.9 * *m + g;
                *p -= lr * *m;
            }
        }
        if !self.padding.is_empty() {
            let at = step.step as usize % self.padding.len();
            self.padding[at] += 1.0;
        }
        Ok(())
    }
}

/// What rank 0 hands back to the launching process.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Outcome {
    final_loss: f64,
    accuracy: f64,
    steps: u64,
    applied: u64,
    adopted: u64,
    /// As the last rank 0 counted them.
    corruptions_detected: u64,
    train_seconds: f64,
    recoveries: Vec<RecoveryOut>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct RecoveryOut {
    generation: u64,
    world_size: usize,
    resumed_step: u64,
    bytes: u64,
    rendezvous_ms: f64,
    transfer_ms: f64,
    first_step_ms: f64,
    total_ms: f64,
    /// From the injected failure (its wall-clock time) to the first committed step.
    since_failure_ms: Option<f64>,
}

impl Outcome {
    /// The last generation's rank 0's result: the model evaluated on
    /// held-out data, and each recovery with the failure before it.
    fn of(args: &Args, run_dir: &Path, job: &Mlp, report: &train::TrainReport, train_seconds: f64) -> Result<Self> {
        let eval = Dataset::generate(args.seed, EVAL_SAMPLES, 2);
        let all: Vec<usize> = (0..eval.len()).collect();
        let (loss, _) = job.loss(&eval, &all, false)?;
        let failures_us: Vec<i64> = failures(run_dir).into_iter().map(|(at, _)| at).collect();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let recovery = |r: &train::Recovery| {
            let at = r
                .first_step_at
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as i64);
            RecoveryOut {
                generation: r.generation,
                world_size: r.world_size,
                resumed_step: r.resumed_step,
                bytes: r.bytes,
                rendezvous_ms: ms(r.rendezvous),
                transfer_ms: ms(r.transfer),
                first_step_ms: ms(r.first_step),
                total_ms: ms(r.total()),
                // The last failure injected before it recovered.
                since_failure_ms: failures_us
                    .iter()
                    .filter(|&&f| f < at)
                    .max()
                    .map(|f| (at - f) as f64 / 1e3),
            }
        };
        Ok(Self {
            final_loss: f64::from(loss),
            accuracy: f64::from(job.accuracy(&eval)?),
            steps: report.steps,
            applied: report.applied,
            adopted: report.adopted,
            corruptions_detected: report.corruptions_detected,
            train_seconds,
            recoveries: report.recoveries.iter().map(recovery).collect(),
        })
    }
}

/// Appends an injected failure to the run's list: its wall-clock time and
/// what it was (`kill of rank 3 at step 150`), for the summary.
fn record_failure(run_dir: &Path, what: &str) {
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(run_dir.join("failures"))
    {
        let _ = writeln!(file, "{} {what}", chorus::train::record::unix_us());
    }
}

/// The failures injected into the run in `run_dir`: when (unix
/// microseconds) and what.
fn failures(run_dir: &Path) -> Vec<(i64, String)> {
    std::fs::read_to_string(run_dir.join("failures"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (at, what) = l.split_once(' ')?;
            Some((at.parse().ok()?, what.to_string()))
        })
        .collect()
}

/// Injects `fault` into this worker, rank `rank`, at committed step `step`.
fn inject(fault: Fault, group: &ElasticGroup, run_dir: &Path, rank: usize, step: u64) {
    record_failure(run_dir, &format!("{} of rank {rank} at step {step}", fault.name()));
    match fault {
        Fault::None => {}
        Fault::Kill => {
            process::signal_self(Signal::SIGKILL);
        }
        Fault::Freeze => {
            let _ = std::fs::write(run_dir.join("frozen"), format!("{} {rank}", std::process::id()));
            process::signal_self(Signal::SIGSTOP);
        }
        // The trainer flips the bit (TrainOptions::corruptions).
        Fault::Corrupt => {}
        Fault::Partition => {
            let pg = group.current();
            for rank in 0..pg.world_size() {
                if let Some(link) = pg.link(rank) {
                    link.cut("injected partition");
                }
            }
        }
    }
}

fn worker(args: Args) -> Result<()> {
    // `CHORUS_LOG=chorus::train=info` shows each transfer and recovery as it happens.
    chorus_cli::logging::init();
    let run_dir = args
        .run_dir
        .clone()
        .context("--run-dir is set by the launching process")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let Some((group, mut job)) = join_job(&args, &run_dir).await? else {
            eprintln!("the job finished before this worker could rejoin it");
            return Ok(());
        };
        let first_rank = group.rank();
        let relaunched = group.generation() > 0;
        let _ = std::fs::create_dir_all(run_dir.join("pids"));
        let _ = std::fs::write(
            run_dir.join("pids").join(first_rank.to_string()),
            std::process::id().to_string(),
        );
        let options = args.train_options();
        let reporter = first_rank == 0 && !relaunched;
        let mut progress = match reporter {
            true => Some(std::fs::File::create(run_dir.join("progress"))?),
            false => None,
        };
        let victim = !relaunched && first_rank == args.world - 1 && args.fault != Fault::None;
        let started = Instant::now();
        let report = train::train(&group, &mut job, &options, |c| {
            if let Some(file) = progress.as_mut() {
                let _ = writeln!(file, "{} {} {} {}", c.step, c.loss, c.world_size, c.generation);
            }
            if victim && c.step + 1 == args.fault_step() {
                inject(args.fault, &group, &run_dir, first_rank, args.fault_step());
            }
        })
        .await?;
        let train_seconds = started.elapsed().as_secs_f64();
        std::fs::write(run_dir.join("finished"), b"")?;
        if report.corruptions_injected > 0 {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(run_dir.join("corruptions-injected"))?;
            writeln!(file, "{}", report.corruptions_injected)?;
        }
        let pg = group.current();
        if options.mode == Mode::Ddp {
            // Every member holds the same model and optimizer state.
            train::verify_state(&pg, &mut job).await?;
        }
        // Rank 0 of the last generation reports: the first rank 0 may be
        // gone with its host (survivors keep their order, so this is the
        // lowest surviving first rank).
        if pg.rank() == 0 {
            let outcome = Outcome::of(&args, &run_dir, &job, &report, train_seconds)?;
            std::fs::write(run_dir.join("result.json"), serde_json::to_string(&outcome)?)?;
        }
        // Every worker checks the counter: no step applied twice, none skipped.
        if report.applied + report.adopted != report.steps {
            bail!(
                "rank {first_rank}: applied {} + adopted {} != committed {}",
                report.applied,
                report.adopted,
                report.steps
            );
        }
        drop(pg);
        group.destroy().await?;
        Ok(())
    })
}

/// Joins the job's elastic group while the data and the model are built;
/// `None` when the job finished before this worker could join it.
async fn join_job(args: &Args, run_dir: &Path) -> Result<Option<(ElasticGroup, Mlp)>> {
    let mut options = InitOptions::from_url("env://")?
        .timeout(Duration::from_secs(60))
        .heartbeat_timeout(Duration::from_millis(args.heartbeat_ms))
        .last_call(Duration::from_millis(300))
        .restart_budget(1000, Duration::from_secs(600));
    if args.fault == Fault::Freeze {
        // The frozen worker is not dead: the others go on without it.
        options = options.elastic_world(args.world - 1, args.world);
    }
    // The data and the model are made while joining: a relaunched
    // worker's peers wait for it from the moment they form the
    // generation until it takes part in the transfer, and the sooner
    // it joins, the sooner that is (forming the links takes longer
    // than building these).
    let (seed, steps, hidden, state_mib) = (args.seed, args.steps, args.hidden, args.state_mib);
    let dir = run_dir.to_owned();
    let job = tokio::task::spawn_blocking(move || {
        let data = Arc::new(Dataset::load_or_generate(&dir, seed, TRAIN_SAMPLES));
        Mlp::new(seed, data, steps, 0.05, hidden, state_mib)
    });
    // A worker relaunched after the others finished (a freeze found
    // late, say) has no job left to join: it would wait out the
    // rendezvous timeout, again on every relaunch.
    let finished = run_dir.join("finished");
    let group = tokio::select! {
        group = ElasticGroup::init(options) => match group {
            Err(e) if e.job_finished() => return Ok(None),
            group => group?,
        },
        () = appears(&finished) => return Ok(None),
    };
    let job = job.await.context("building the model and data")?;
    Ok(Some((group, job)))
}

/// Returns once `path` exists.
async fn appears(path: &Path) {
    while !path.exists() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Kills a worker every `every` seconds (ranks 1.. in turn) until `done`.
fn fault_loop(run_dir: PathBuf, world: usize, every: f64, done: Arc<AtomicBool>) {
    let mut next = 1;
    let mut waited = 0.0;
    let started = Instant::now();
    while !done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        waited += 0.1;
        if waited < every {
            continue;
        }
        waited = 0.0;
        let pid = std::fs::read_to_string(run_dir.join("pids").join(next.to_string()))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok());
        if let Some(pid) = pid {
            let at = started.elapsed().as_secs_f64();
            record_failure(&run_dir, &format!("kill of rank {next} at {at:.1} s"));
            process::signal(pid, Signal::SIGKILL);
        }
        next = next % (world - 1) + 1;
    }
}

/// Kills a frozen worker once the others went on without it (rank 0's
/// progress shows a later generation), or at the latest `after` it froze
/// (twice the heartbeat timeout), so the launcher relaunches it while the
/// job still runs and it rejoins.
fn thaw_loop(run_dir: PathBuf, after: Duration, done: Arc<AtomicBool>) {
    while !done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
        let frozen = std::fs::read_to_string(run_dir.join("frozen")).unwrap_or_default();
        let Some((pid, rank)) = frozen
            .split_once(' ')
            .and_then(|(pid, rank)| Some((pid.parse::<i32>().ok()?, rank.trim().to_string())))
        else {
            continue;
        };
        let froze = Instant::now();
        let generation_at_freeze = latest_generation(&run_dir);
        while froze.elapsed() < after
            && latest_generation(&run_dir) == generation_at_freeze
            && !done.load(Ordering::Relaxed)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        let why = match latest_generation(&run_dir) == generation_at_freeze {
            true => "the others have not gone on without it yet",
            false => "the others went on without it",
        };
        print_line(&format!(
            "train: killing the frozen rank {rank} (pid {pid}) {:.1} s after it froze ({why}), for the launcher to relaunch it",
            froze.elapsed().as_secs_f64()
        ));
        process::signal(pid, Signal::SIGKILL);
        return;
    }
}

/// The generation of rank 0's last committed step, from its progress file.
fn latest_generation(run_dir: &Path) -> Option<u64> {
    let progress = std::fs::read_to_string(run_dir.join("progress")).ok()?;
    let last = progress.lines().rev().find(|l| l.split_whitespace().count() == 4)?;
    last.split_whitespace().nth(3)?.parse().ok()
}

/// Shows rank 0's committed steps as they come.
fn progress_loop(
    run_dir: PathBuf,
    (steps, batch): (u64, usize),
    label: &'static str,
    done: Arc<AtomicBool>,
    show: bool,
) -> Vec<(u64, f64)> {
    let bar = indicatif::ProgressBar::new(steps);
    if !show {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(label);
    *lock_bar() = Some(bar.clone());
    *lock_injected() = Some((run_dir.clone(), 0));
    let mut curve = Vec::new();
    let mut reader = None;
    let started = Instant::now();
    let mut line = String::new();
    loop {
        let finished = done.load(Ordering::Relaxed);
        if reader.is_none() {
            reader = std::fs::File::open(run_dir.join("progress"))
                .ok()
                .map(std::io::BufReader::new);
        }
        if let Some(r) = reader.as_mut() {
            while r.read_line(&mut line).unwrap_or(0) > 0 {
                if !line.ends_with('\n') {
                    break;
                }
                let f: Vec<&str> = line.split_whitespace().collect();
                if let [step, loss, world, generation] = f[..]
                    && let (Ok(step), Ok(loss)) = (step.parse::<u64>(), loss.parse::<f64>())
                {
                    curve.push((step, loss));
                    let rate = (step + 1) as f64 / started.elapsed().as_secs_f64().max(1e-3);
                    bar.set_position(step + 1);
                    bar.set_message(format!(
                        "loss {loss:.4}  {:.0} samples/s  gen {generation}  world {world}",
                        rate * batch as f64
                    ));
                }
                line.clear();
            }
        }
        report_injected();
        if finished {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bar.finish();
    *lock_injected() = None;
    *lock_bar() = None;
    curve
}

/// The run whose injected faults are being reported, and how many were.
fn lock_injected() -> std::sync::MutexGuard<'static, Option<(PathBuf, usize)>> {
    static INJECTED: std::sync::Mutex<Option<(PathBuf, usize)>> = std::sync::Mutex::new(None);
    INJECTED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Prints the faults injected since the last call: before the launcher's
/// report of a fault, so the fault reads as intended.
fn report_injected() {
    let mut injected = lock_injected();
    let Some((run_dir, reported)) = injected.as_mut() else {
        return;
    };
    let all = failures(run_dir);
    for (_, what) in all.iter().skip(*reported) {
        print_line(&format!(
            "train: injected the fault: {what}; the launcher and the others recover from it"
        ));
    }
    *reported = all.len();
}

/// The progress bar being drawn, if any.
fn lock_bar() -> std::sync::MutexGuard<'static, Option<indicatif::ProgressBar>> {
    static BAR: std::sync::Mutex<Option<indicatif::ProgressBar>> = std::sync::Mutex::new(None);
    BAR.lock().unwrap_or_else(|e| e.into_inner())
}

/// Prints a line on stderr above the progress bar, not through it: the
/// launcher's notes and the example's own.
fn print_line(line: &str) {
    match lock_bar().as_ref() {
        Some(bar) => bar.suspend(|| eprintln!("{line}")),
        None => eprintln!("{line}"),
    }
}

/// One launched run: its outcome, loss curve and the failures injected.
struct Run {
    outcome: Outcome,
    /// Bits flipped by the trainers (`--fault corrupt`).
    corruptions_injected: u64,
    curve: Vec<(u64, f64)>,
    injected: Vec<String>,
}

fn launch(args: &Args, fault: Fault, label: &'static str, run_dir: &Path) -> Result<Run> {
    std::fs::create_dir_all(run_dir)?;
    let launch_args = launch_args(args, fault, label, run_dir)?;
    let done = Arc::new(AtomicBool::new(false));
    let show = !args.json;
    let progress = {
        let (dir, done) = (run_dir.to_path_buf(), done.clone());
        let size = (args.steps, args.batch);
        std::thread::spawn(move || progress_loop(dir, size, label, done, show))
    };
    let mut helpers = Vec::new();
    if fault == Fault::Freeze {
        let (dir, done) = (run_dir.to_path_buf(), done.clone());
        let after = Duration::from_millis(2 * args.heartbeat_ms);
        helpers.push(std::thread::spawn(move || thaw_loop(dir, after, done)));
    }
    if let Some(every) = args.fault_every.filter(|_| fault != Fault::None) {
        let (dir, done, world) = (run_dir.to_path_buf(), done.clone(), args.world);
        helpers.push(std::thread::spawn(move || fault_loop(dir, world, every, done)));
    }
    let code = chorus_cli::launch::main(&launch_args);
    done.store(true, Ordering::Relaxed);
    let curve = progress.join().unwrap_or_default();
    for helper in helpers {
        let _ = helper.join();
    }
    let result = run_dir.join("result.json");
    let outcome: Outcome = match std::fs::read_to_string(&result) {
        Ok(text) => serde_json::from_str(&text)?,
        Err(_) => bail!(
            "the {label} run ended ({code:?}) without a result; the workers' logs are under {}",
            run_dir.join("logs").display()
        ),
    };
    let injected = failures(run_dir).into_iter().map(|(_, what)| what).collect();
    let corruptions_injected = std::fs::read_to_string(run_dir.join("corruptions-injected"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse::<u64>().ok())
        .sum();
    Ok(Run {
        corruptions_injected,
        outcome,
        curve,
        injected,
    })
}

/// `chorus launch`'s command line for the `label` run: the launcher's
/// flags, then this executable as the worker with the run's flags.
fn launch_args(args: &Args, fault: Fault, label: &str, run_dir: &Path) -> Result<Vec<String>> {
    let exe = std::env::current_exe()?;
    let mut launch_args: Vec<String> = vec![
        "--nproc-per-node".into(),
        args.world.to_string(),
        "--restart-policy".into(),
        "worker".into(),
        "--max-restarts".into(),
        // One relaunch per injected failure, and a few to spare.
        if args.fault_every.is_some() { "1000" } else { "3" }.into(),
        "--master-port".into(),
        free_port()?.to_string(),
        "--log-dir".into(),
        run_dir.join("logs").display().to_string(),
        // The workers' output only into their logs (`--keep-logs`): the
        // survivors' reports of the injected failure (errors, from where
        // they stand) would read as if the demo failed.
        "--redirects".into(),
        "3".into(),
        "--".into(),
        exe.display().to_string(),
        "--run-dir".into(),
        run_dir.display().to_string(),
    ];
    // The training run's page; the reference run has none.
    if let Some(addr) = args.dashboard.as_ref().filter(|_| label == "training") {
        let mut flags = vec!["--dashboard".to_string(), addr.clone()];
        if args.dashboard_faults {
            flags.push("--dashboard-faults".into());
        }
        launch_args.splice(0..0, flags);
    }
    let mode = match args.mode {
        ModeArg::Ddp => "ddp",
        ModeArg::LocalSgd => "local-sgd",
        ModeArg::Diloco => "diloco",
    };
    for (flag, value) in [
        ("--fault", fault.name().to_string()),
        ("--fault-step", args.fault_step().to_string()),
        ("--corrupt", format!("{:?}", args.corrupt).to_lowercase()),
        ("--mode", mode.to_string()),
        ("--every", args.every.to_string()),
        ("--outer-lr", args.outer_lr.to_string()),
        ("--outer-momentum", args.outer_momentum.to_string()),
        ("--fragments", args.fragments.to_string()),
        ("--steps", args.steps.to_string()),
        ("--world", args.world.to_string()),
        ("--batch", args.batch.to_string()),
        ("--seed", args.seed.to_string()),
        ("--hidden", args.hidden.to_string()),
        ("--state-mib", args.state_mib.to_string()),
        ("--heartbeat-ms", args.heartbeat_ms.to_string()),
    ] {
        launch_args.push(flag.into());
        launch_args.push(value);
    }
    Ok(launch_args)
}

fn plot(path: &Path, run: &Run, reference: Option<&Run>, failures: &[u64]) -> Result<()> {
    use chorus_lab::bench::plot::{LABEL, canvas, legend};
    use plotters::prelude::*;
    let curves: Vec<&Vec<(u64, f64)>> = std::iter::once(&run.curve).chain(reference.map(|r| &r.curve)).collect();
    let xmax = curves.iter().flat_map(|c| c.iter()).map(|p| p.0).max().unwrap_or(1) as f64 + 1.0;
    let ymax = curves.iter().flat_map(|c| c.iter()).map(|p| p.1).fold(0.0, f64::max) * 1.05;
    let root = canvas(path, (900, 520)).map_err(anyhow::Error::msg)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("chorus elastic training: loss per committed step", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax.max(0.1))?;
    chart
        .configure_mesh()
        .x_desc("committed step")
        .y_desc("training loss")
        .label_style(LABEL)
        .draw()?;
    let red = RGBColor(214, 39, 40);
    for &step in failures {
        chart
            .draw_series(LineSeries::new(
                [(step as f64, 0.0), (step as f64, ymax)],
                red.stroke_width(2),
            ))?
            .label(format!("failure (resumed at step {step})"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red.stroke_width(2)));
    }
    // The reference first, wide, so the run drawn over it shows where they differ.
    let mut series = Vec::new();
    if let Some(reference) = reference {
        series.push(("fault-free reference", &reference.curve, RGBColor(150, 210, 150), 5));
    }
    series.push(("with the failure", &run.curve, RGBColor(31, 119, 180), 1));
    for (label, curve, color, width) in series {
        chart
            .draw_series(LineSeries::new(
                curve.iter().map(|&(s, l)| (s as f64, l)),
                color.stroke_width(width),
            ))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3)));
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight).map_err(anyhow::Error::msg)?;
    root.present()?;
    Ok(())
}

/// What the summary says of the faults: those injected and when, or that
/// none was (asked for or not).
fn injected_summary(args: &Args, injected: &[String]) -> String {
    let asked = format!(
        "{} of rank {} at step {}",
        args.fault.name(),
        args.world - 1,
        args.fault_step()
    );
    let mut text = match injected {
        [] => "no fault injected".to_string(),
        all => format!("injected: {}", all.join(", ")),
    };
    if args.fault != Fault::None && !injected.contains(&asked) {
        text.push_str(&format!(" (the {asked} was not: that worker was relaunched before it)"));
    }
    text
}

fn main() -> Result<()> {
    let args = Args::parse();
    if std::env::var_os("RANK").is_some() {
        return worker(args);
    }
    args.check(available_memory())?;
    chorus_cli::launch::print_lines_with(|line| {
        report_injected();
        print_line(line);
    });
    if std::env::var_os("OMP_NUM_THREADS").is_none() {
        // SAFETY: no other thread runs yet. Set here once, for the workers
        // of both runs, rather than noted by the launcher at each.
        unsafe { std::env::set_var("OMP_NUM_THREADS", "1") };
    }
    let base = std::env::temp_dir().join(format!("chorus-train-{}", std::process::id()));
    let started = Instant::now();
    let run = launch(&args, args.fault, "training", &base.join("run"))?;
    let reference = match args.fault == Fault::None || args.no_reference {
        true => None,
        false => Some(launch(&args, Fault::None, "reference", &base.join("reference"))?),
    };
    let reference_loss = reference
        .as_ref()
        .map_or(run.outcome.final_loss, |r| r.outcome.final_loss);
    let failures: Vec<u64> = run.outcome.recoveries.iter().map(|r| r.resumed_step).collect();
    let plotted = plot(&args.plot, &run, reference.as_ref(), &failures);
    let o = &run.outcome;
    if !args.json {
        for r in &o.recoveries {
            println!(
                "recovery into generation {} ({} workers) at step {}: rendezvous {:.0} ms, transfer {:.0} ms ({} KiB), first step {:.0} ms; {:.0} ms in all{}",
                r.generation,
                r.world_size,
                r.resumed_step,
                r.rendezvous_ms,
                r.transfer_ms,
                r.bytes / 1024,
                r.first_step_ms,
                r.total_ms,
                r.since_failure_ms
                    .map(|ms| format!(", {ms:.0} ms after the failure"))
                    .unwrap_or_default()
            );
        }
        println!(
            "final loss {:.4} (accuracy {:.1}%), fault-free reference {:.4}: {:+.2}%; {} steps in {:.1} s; {}",
            o.final_loss,
            o.accuracy * 100.0,
            reference_loss,
            (o.final_loss / reference_loss - 1.0) * 100.0,
            o.steps,
            o.train_seconds,
            injected_summary(&args, &run.injected)
        );
        if args.fault == Fault::Corrupt {
            println!(
                "silent data corruption: {} bit flip(s) injected, {} found by the members' checks",
                run.corruptions_injected, o.corruptions_detected
            );
        }
        match &plotted {
            Ok(()) => println!("loss curve: {}", args.plot.display()),
            Err(e) => println!("loss curve not drawn: {e}"),
        }
    }
    if args.json {
        let json = serde_json::json!({
            "mode": format!("{:?}", args.mode).to_lowercase(),
            "fault": format!("{:?}", args.fault).to_lowercase(),
            "world": args.world,
            "steps": o.steps,
            "final_loss": o.final_loss,
            "reference_loss": reference_loss,
            "accuracy": o.accuracy,
            "recoveries": o.recoveries.len(),
            "injected": run.injected,
            "recovery_ms": o.recoveries.iter().map(|r| r.since_failure_ms.unwrap_or(r.total_ms)).collect::<Vec<_>>(),
            "phases": o.recoveries,
            "applied": o.applied,
            "adopted": o.adopted,
            "corruptions_injected": run.corruptions_injected,
            "corruptions_detected": o.corruptions_detected,
            "train_seconds": o.train_seconds,
            "steps_per_second": o.steps as f64 / o.train_seconds,
            "reference_steps_per_second": reference.as_ref().map(|r| r.outcome.steps as f64 / r.outcome.train_seconds),
            "wall_seconds": started.elapsed().as_secs_f64(),
        });
        println!("{json}");
    }
    if args.keep_logs {
        eprintln!("the workers' logs: {}", base.display());
    } else {
        let _ = std::fs::remove_dir_all(&base);
    }
    Ok(())
}
