//! Tests that need something the Rust toolchain does not bring (PyTorch, a
//! GPU, root for network namespaces, Slurm, an etcd server) must be
//! `#[ignore = "needs ..."]`, named so the commands that run them select
//! them (`torch_*`, `gpu_*`, `netns_*`, `slurm_*`, `etcd_*`, `browser_*`), and fail rather than pass when run
//! without it: a green `cargo test` then lists them as ignored instead of
//! reporting "ok" for a test that checked nothing. Checked on the sources.

use std::path::Path;

// These tests belong to chorus-cli (cli/); tests/ is at the root.
const TESTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests");

/// Each test function of `source`: its name, the attributes above it, its body.
fn test_functions(source: &str) -> Vec<(String, String, String)> {
    let mut found = Vec::new();
    let mut rest = source;
    while let Some(at) = ["#[test]", "#[tokio::test"].iter().filter_map(|a| rest.find(a)).min() {
        let from_attributes = &rest[at..];
        let Some(fn_at) = from_attributes.find("fn ") else {
            break;
        };
        let attributes = from_attributes[..fn_at].to_string();
        let after = &from_attributes[fn_at + 3..];
        let name: String = after.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let body_end = after.find("\n}\n").map_or(after.len(), |e| e + 3);
        found.push((name, attributes, after[..body_end].to_string()));
        rest = &after[body_end..];
    }
    found
}

#[test]
fn tests_that_need_more_than_the_toolchain_are_ignored_with_the_reason() {
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(TESTS).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") || path.file_name() == Some("ignored.rs".as_ref()) {
            continue;
        }
        let source = std::fs::read_to_string(&path).unwrap();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            !source.contains("torch_available"),
            "{file}: a test that returns early without torch reports ok; use #[ignore] and common::require_torch()"
        );
        for (name, attributes, body) in test_functions(&source) {
            let (needs, prefix) = if body.contains("require_torch()") {
                ("needs PyTorch", "torch_")
            } else if body.contains("device(\"") {
                ("needs a GPU", "gpu_")
            } else if body.contains("Cluster::up(") || body.contains("NetemPair::up(") {
                ("needs root for network namespaces", "netns_")
            } else if body.contains("slurm-local.sh") {
                ("needs Slurm", "slurm_")
            } else if body.contains("Etcd::start(") {
                ("needs etcd-server", "etcd_")
            } else if body.contains("chromium()") {
                ("needs chromium", "browser_")
            } else {
                continue;
            };
            assert!(
                attributes.contains(&format!("#[ignore = \"{needs}")),
                "{file}: {name} {needs}: mark it #[ignore = \"{needs} ...\"]"
            );
            assert!(
                name.starts_with(prefix),
                "{file}: {name} must be named {prefix}* to be selected"
            );
            checked.push(name);
        }
    }
    assert!(checked.len() >= 7, "the torch and GPU tests were found: {checked:?}");
}

/// `.ci/run` runs the README's test command, then the torch, netns and
/// slurm, etcd and browser tests by the filters the reasons name.
#[test]
fn ci_runs_the_readme_test_command_and_the_ignored_tests() {
    // These tests belong to chorus-cli (cli/); the files are at the root.
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    let command = readme
        .split("Run the tests:\n\n```sh\n")
        .nth(1)
        .and_then(|rest| rest.lines().next())
        .expect("the README's test command");
    assert!(ci.lines().any(|l| l.trim() == command), ".ci/run must run {command:?}");
    for filter in ["torch_", "netns_", "slurm_", "etcd_", "browser_"] {
        let ignored = format!("{command} -- --ignored {filter}");
        assert!(ci.lines().any(|l| l.trim() == ignored), ".ci/run must run {ignored:?}");
        assert!(readme.contains(&ignored), "the README must say {ignored:?}");
    }
}
