//! The deployment examples in `examples/deploy/` run as written: the
//! Kubeflow manifest's command forms a job from the variables the operator
//! gives each pod (always run), and the sbatch script forms one from
//! Slurm's variables alone under a real one-node Slurm (needs root and
//! slurm-wlm: ignored unless asked for, run by `.ci/run`).

mod common;

use std::process::{Child, Command};

use common::{Stop, chorus_bin, finish, free_port, joined, spawn_piped};

const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/deploy");

/// The container commands of the manifest's replica specs and their replica counts.
fn replica_specs(manifest: &str) -> Vec<(usize, Vec<String>)> {
    let mut specs = Vec::new();
    let mut replicas = None;
    for line in manifest.lines().map(str::trim) {
        if let Some(n) = line.strip_prefix("replicas:") {
            replicas = Some(n.trim().parse().expect("a replica count"));
        }
        if let Some(command) = line.strip_prefix("command:") {
            let command: Vec<String> = serde_json::from_str(command.trim()).expect("a command list");
            specs.push((replicas.take().expect("replicas before the command"), command));
        }
    }
    specs
}

#[test]
fn the_kubeflow_manifest_forms_a_job_from_the_operators_variables() {
    let manifest = std::fs::read_to_string(format!("{DEPLOY}/pytorchjob.yaml")).unwrap();
    let specs = replica_specs(&manifest);
    assert_eq!(specs.len(), 2, "a Master and a Worker spec");
    assert_eq!(specs[0].0, 1, "one master");
    let world: usize = specs.iter().map(|(n, _)| n).sum();
    let port = free_port().to_string();
    let mut rank = 0;
    let mut pods: Vec<Child> = Vec::new();
    for (replicas, command) in &specs {
        assert_eq!(command[0], "chorus", "the image's chorus binary");
        for _ in 0..*replicas {
            // What the training operator and Kubernetes put in each pod
            // (MASTER_ADDR is the master's service; here it is this machine).
            let mut pod = Command::new(chorus_bin());
            pod.args(&command[1..])
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("WORLD_SIZE", world.to_string())
                .env("RANK", rank.to_string())
                .env("KUBERNETES_PORT", "tcp://10.96.0.1:443")
                .env("PYTHONUNBUFFERED", "1")
                .env("CHORUS_JOB_SECRET", "deploy-test");
            pods.push(spawn_piped(&mut pod, "a pod's command"));
            rank += 1;
        }
    }
    for (rank, pod) in pods.into_iter().enumerate() {
        let output = finish(pod, 120, &format!("pod {rank}"), Stop::Kill);
        let text = joined(&output);
        assert!(output.status.success(), "pod {rank}:\n{text}");
        assert!(
            text.contains(&format!("rank {rank} of {world}")) && text.contains("checks passed"),
            "pod {rank}:\n{text}"
        );
    }
}

#[test]
#[ignore = "needs Slurm (root and slurm-wlm); run: cargo test --workspace --release -- --ignored slurm_"]
fn slurm_the_sbatch_script_forms_a_job_from_slurms_variables_alone() {
    let dir = tempfile::tempdir().unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/slurm-local.sh");
    let conf = dir.path().join("slurm.conf");
    let cluster = Command::new("bash")
        .arg(script)
        .arg("up")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(cluster.status.success(), "cannot start Slurm: {}", joined(&cluster));
    let out = dir.path().join("job.out");
    let mut sbatch = Command::new("sbatch");
    sbatch
        .arg("--wait")
        .arg(format!("--output={}", out.display()))
        .arg(format!("{DEPLOY}/slurm.sbatch"))
        .env("SLURM_CONF", &conf)
        .env("CHORUS", chorus_bin());
    let submitted = finish(spawn_piped(&mut sbatch, "sbatch"), 180, "sbatch --wait", Stop::Kill);
    let job = std::fs::read_to_string(&out).unwrap_or_default();
    Command::new("bash")
        .arg(script)
        .arg("down")
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(submitted.status.success(), "{}\njob output:\n{job}", joined(&submitted));
    for rank in 0..4 {
        assert!(
            job.contains(&format!("rank {rank} of 4")) && job.contains("checks passed"),
            "rank {rank} did not pass:\n{job}"
        );
    }
}
