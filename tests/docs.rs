//! The documentation against the code, checked on the sources:
//! - `docs/environment.md` lists exactly the `CHORUS_*` variables that the
//!   workspace's Rust sources name in string literals;
//! - every relative link in the Markdown files resolves (file and anchor),
//!   and every `*.md` file the sources or the Markdown files name exists;
//! - every Markdown page with Rust code is compiled as a doc-test of
//!   `chorus` (an `include_str!` item in `src/lib.rs`);
//! - ARCHITECTURE.md's rule index lists exactly the numbered rules the
//!   sources name, each with a file that states it and every test named
//!   after it, and no rule lacks a test.
//!
//! Run: `cargo test --release -p chorus-cli --test docs`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

// These tests belong to chorus-cli (cli/); the files are at the root.
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The variables' prefix, spelled so that this file names no variable itself.
const PREFIX: &str = concat!("CHORUS", "_");

/// Every file under the root with one of `extensions`, outside build
/// output, hidden directories and nested checkouts.
fn files(extensions: &[&str]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![PathBuf::from(ROOT)];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                if !name.starts_with('.') && name != "target" && !path.join(".git").exists() {
                    dirs.push(path);
                }
            } else if kind.is_file() && extensions.iter().any(|e| name.ends_with(&format!(".{e}"))) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

fn relative(path: &Path) -> String {
    path.strip_prefix(ROOT).unwrap_or(path).display().to_string()
}

/// The contents of the string literals of a Rust source (normal, byte, C
/// and raw strings; comments and char literals skipped).
fn string_literals(source: &str) -> Vec<String> {
    let chars: Vec<char> = source.chars().collect();
    let mut literals = Vec::new();
    let mut i = 0;
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == 'r'
            && (i == 0 || !ident(chars[i - 1]) || matches!(chars[i - 1], 'b' | 'c'))
            && matches!(next, Some('"' | '#'))
        {
            // A raw string: r"..." or r#"..."# (also br and cr).
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                i += 1;
                continue;
            }
            let start = j + 1;
            let mut k = start;
            loop {
                if k >= chars.len() {
                    break;
                }
                if chars[k] == '"' && (1..=hashes).all(|h| chars.get(k + h) == Some(&'#')) {
                    break;
                }
                k += 1;
            }
            literals.push(chars[start..k.min(chars.len())].iter().collect());
            i = k + 1 + hashes;
        } else if c == '"' {
            let (literal, end) = literal_until(&chars, i + 1, |k| chars[k] == '"');
            literals.push(literal);
            i = end + 1;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}', '"'), or a lifetime or label.
            if next == Some('\\') {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if chars.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    literals
}

/// The variable names (`PREFIX` and at least one more character) in `text`.
/// A string literal's characters from `i` up to where `ends` holds (a
/// backslash keeps the character after it, as written), and that index.
fn literal_until(chars: &[char], mut i: usize, ends: impl Fn(usize) -> bool) -> (String, usize) {
    let mut literal = String::new();
    while i < chars.len() && !ends(i) {
        if chars[i] == '\\' {
            literal.push(chars[i]);
            i += 1;
        }
        if let Some(&ch) = chars.get(i) {
            literal.push(ch);
        }
        i += 1;
    }
    (literal, i)
}

/// The string literals of a Python source (docstrings too), outside its
/// `#` comments.
fn python_string_literals(source: &str) -> Vec<String> {
    let chars: Vec<char> = source.chars().collect();
    let mut literals = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '"' || c == '\'' {
            let triple = chars.get(i + 1) == Some(&c) && chars.get(i + 2) == Some(&c);
            let quote = if triple { 3 } else { 1 };
            let closes = |k: usize| (0..quote).all(|q| chars.get(k + q) == Some(&c));
            let (literal, end) = literal_until(&chars, i + quote, |k| closes(k) || (!triple && chars[k] == '\n'));
            literals.push(literal);
            i = end + quote;
        } else {
            i += 1;
        }
    }
    literals
}

fn variables_in(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(PREFIX) {
        let before = text.len() - rest.len() + at;
        let tail = &rest[at + PREFIX.len()..];
        let len = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..len].trim_end_matches('_');
        let preceded = text[..before]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        if !name.is_empty() && !preceded {
            found.push(format!("{PREFIX}{name}"));
        }
        rest = &tail[len..];
    }
    found
}

/// The variables named in the first column of `docs/environment.md`'s tables.
fn table_variables() -> BTreeSet<String> {
    let table = std::fs::read_to_string(Path::new(ROOT).join("docs/environment.md")).unwrap();
    let mut rows = BTreeSet::new();
    for line in table.lines() {
        let Some(cell) = line.strip_prefix("| `").and_then(|l| l.split('`').next()) else {
            continue;
        };
        if cell.starts_with(PREFIX) {
            assert!(
                rows.insert(cell.to_string()),
                "docs/environment.md: {cell} has two rows"
            );
        }
    }
    rows
}

#[test]
fn the_environment_table_lists_every_variable_the_code_reads_and_no_other() {
    let mut in_code: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in files(&["rs", "py"]) {
        let source = std::fs::read_to_string(&path).unwrap();
        let literals = if path.extension().is_some_and(|e| e == "py") {
            python_string_literals(&source)
        } else {
            string_literals(&source)
        };
        for literal in literals {
            for name in variables_in(&literal) {
                in_code.entry(name).or_default().insert(relative(&path));
            }
        }
    }
    assert!(
        in_code.len() >= 20,
        "the scan found too few variables: {:?}",
        in_code.keys()
    );
    let table = table_variables();
    let missing: Vec<String> = in_code
        .iter()
        .filter(|(name, _)| !table.contains(*name))
        .map(|(name, files)| {
            format!(
                "{name} (named in {})",
                files.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    let unread: Vec<&String> = table.iter().filter(|name| !in_code.contains_key(*name)).collect();
    assert!(
        missing.is_empty() && unread.is_empty(),
        "docs/environment.md is out of date.\n\
         Variables the code names that the table lacks (add a row: default and meaning):\n  {}\n\
         Rows no code names any more (remove them):\n  {}",
        missing.join("\n  "),
        unread.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n  "),
    );
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces
/// turned into dashes.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// A Markdown file's lines outside code fences, and its anchors.
fn prose_and_anchors(text: &str) -> (Vec<String>, BTreeSet<String>) {
    let mut prose = Vec::new();
    let mut anchors = BTreeSet::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        if let Some(heading) = line.strip_prefix('#') {
            let heading = heading.trim_start_matches('#');
            if heading.starts_with(' ') {
                let base = anchor(heading);
                // Repeated headings get -1, -2, ... as on GitHub.
                let mut name = base.clone();
                let mut n = 0;
                while anchors.contains(&name) {
                    n += 1;
                    name = format!("{base}-{n}");
                }
                anchors.insert(name);
            }
        }
        prose.push(line.to_string());
    }
    (prose, anchors)
}

/// The targets of the inline links and images of a line: `[text](target)`.
fn link_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let tail = &rest[at + 2..];
        let Some(end) = tail.find(')') else {
            break;
        };
        targets.push(tail[..end].split_whitespace().next().unwrap_or("").to_string());
        rest = &tail[end..];
    }
    targets
}

#[test]
fn every_relative_link_in_the_markdown_resolves() {
    let markdown = files(&["md"]);
    let anchors: BTreeMap<PathBuf, BTreeSet<String>> = markdown
        .iter()
        .map(|path| {
            let text = std::fs::read_to_string(path).unwrap();
            (path.canonicalize().unwrap(), prose_and_anchors(&text).1)
        })
        .collect();
    let mut broken = Vec::new();
    for path in &markdown {
        let text = std::fs::read_to_string(path).unwrap();
        for line in prose_and_anchors(&text).0 {
            for target in link_targets(&line) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, fragment) = target.split_once('#').unwrap_or((&target, ""));
                let resolved = if file.is_empty() {
                    path.clone()
                } else {
                    path.parent().unwrap().join(file)
                };
                let Ok(resolved) = resolved.canonicalize() else {
                    broken.push(format!("{}: {target}: no such file", relative(path)));
                    continue;
                };
                if !fragment.is_empty() {
                    match anchors.get(&resolved) {
                        Some(known) if known.contains(fragment) => {}
                        Some(_) => broken.push(format!("{}: {target}: no such heading", relative(path))),
                        None => broken.push(format!(
                            "{}: {target}: an anchor into a file that is not Markdown",
                            relative(path)
                        )),
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n  {}", broken.join("\n  "));
}

/// The `*.md` file names in `text` (a path such as `docs/gpu.md` or a bare
/// name such as `ARCHITECTURE.md`).
fn markdown_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(".md") {
        let start = text.len() - rest.len() + at;
        let after = text[start + 3..].chars().next();
        if after.is_none_or(|c| !(c.is_alphanumeric() || c == '_')) {
            let name_start = text[..start]
                .rfind(|c: char| !(c.is_alphanumeric() || matches!(c, '_' | '-' | '/' | '.')))
                .map_or(0, |i| i + 1);
            let name = text[name_start..start + 3]
                .trim_start_matches("./")
                .trim_start_matches("../");
            if name.len() > 3 && !name.starts_with('/') && !name.starts_with('.') {
                names.push(name.to_string());
            }
        }
        rest = &rest[at + 3..];
    }
    names
}

#[test]
fn every_markdown_file_the_repository_names_is_in_it() {
    let root = PathBuf::from(ROOT);
    let markdown = files(&["md"]);
    let basenames: BTreeSet<String> = markdown
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let mut missing = Vec::new();
    for path in files(&["rs", "md", "toml", "sh", "py"]) {
        let text = std::fs::read_to_string(&path).unwrap();
        for name in markdown_names(&text) {
            let found = root.join(&name).exists()
                || path.parent().unwrap().join(&name).exists()
                || (!name.contains('/') && basenames.contains(&name));
            if !found {
                missing.push(format!("{}: {name}", relative(&path)));
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "files named but not in the repository (write what the text relies on into docs/ and point there):\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn every_markdown_page_with_rust_code_is_compiled() {
    let lib = std::fs::read_to_string(Path::new(ROOT).join("src/lib.rs")).unwrap();
    let mut uncompiled = Vec::new();
    for path in files(&["md"]) {
        let name = relative(&path);
        if !(name == "README.md" || name.starts_with("docs/")) {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut in_fence = false;
        let mut has_rust = false;
        for line in text.lines() {
            let Some(info) = line.trim_start().strip_prefix("```") else {
                continue;
            };
            if !in_fence {
                let lang = info.trim().split(',').next().unwrap_or("");
                has_rust |= lang.is_empty() || lang == "rust";
            }
            in_fence = !in_fence;
        }
        if has_rust && !lib.contains(&format!("include_str!(\"../{name}\")")) {
            uncompiled.push(name);
        }
    }
    assert!(
        uncompiled.is_empty(),
        "pages with Rust code blocks that src/lib.rs does not compile (add a #[cfg(doctest)] item with #[doc = include_str!(..)]):\n  {}",
        uncompiled.join("\n  ")
    );
}

/// The families of numbered rules, spelled apart so that this file states none.
const RULE_FAMILIES: [&str; 6] = ["SV", "RA", "NC", "EN", "SHM", "PP"];

/// Every rule (`XX-N`) named in `text`.
fn rules_in(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for family in RULE_FAMILIES {
        let tag = format!("{family}-");
        for (at, _) in text.match_indices(&tag) {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            let digits: String = text[at + tag.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            if !digits.is_empty() {
                found.insert(format!("{tag}{digits}"));
            }
        }
    }
    found
}

/// The rules a test's name says it checks: its leading `xxN_` words.
fn rules_of_test(name: &str) -> Vec<String> {
    let mut rules = Vec::new();
    for word in name.split('_') {
        let family = word.trim_end_matches(|c: char| c.is_ascii_digit());
        let number = &word[family.len()..];
        match RULE_FAMILIES.iter().find(|f| f.eq_ignore_ascii_case(family)) {
            Some(f) if !number.is_empty() => rules.push(format!("{f}-{number}")),
            _ => break,
        }
    }
    rules
}

/// Every function in the Rust sources whose name says it checks a rule.
fn rule_tests() -> BTreeMap<String, Vec<String>> {
    let mut by_rule: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for path in files(&["rs"]) {
        let source = std::fs::read_to_string(&path).unwrap();
        for (at, _) in source.match_indices("fn ") {
            let name: String = source[at + 3..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            for rule in rules_of_test(&name) {
                by_rule.entry(rule).or_default().push(name.clone());
            }
        }
    }
    by_rule
}

#[test]
fn the_rule_index_lists_every_rule_with_its_file_and_tests() {
    let architecture = std::fs::read_to_string(Path::new(ROOT).join("ARCHITECTURE.md")).unwrap();
    let index = architecture
        .split("\n## Rules\n")
        .nth(1)
        .expect("ARCHITECTURE.md has a `## Rules` section")
        .split("\n## ")
        .next()
        .unwrap_or_default();
    let mut in_sources = BTreeSet::new();
    for path in files(&["rs"]) {
        in_sources.extend(rules_in(&std::fs::read_to_string(&path).unwrap()));
    }
    let tests = rule_tests();
    let mut indexed = BTreeSet::new();
    let mut problems = Vec::new();
    for row in index
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| rule "))
    {
        let cells: Vec<&str> = row.trim_matches('|').split(" | ").map(str::trim).collect();
        let [rule, _, file, named] = cells[..] else {
            problems.push(format!("a row without 4 cells: {row}"));
            continue;
        };
        indexed.insert(rule.to_owned());
        if !in_sources.contains(rule) {
            problems.push(format!("{rule} is in the index, but no source names it"));
        }
        let file = file.trim_matches('`');
        match std::fs::read_to_string(Path::new(ROOT).join(file)) {
            Ok(text) if rules_in(&text).contains(rule) => {}
            Ok(_) => problems.push(format!("{rule}: {file} does not state it")),
            Err(e) => problems.push(format!("{rule}: {file}: {e}")),
        }
        let found = tests.get(rule).cloned().unwrap_or_default();
        for test in named.split(", ").map(|t| t.trim_matches('`')).filter(|t| !t.is_empty()) {
            if !found.iter().any(|f| f == test) {
                problems.push(format!("{rule}: no test `{test}` named after it in the sources"));
            }
        }
        for test in &found {
            if !named.contains(&format!("`{test}`")) {
                problems.push(format!("{rule}: the index does not list its test `{test}`"));
            }
        }
        if found.is_empty() {
            problems.push(format!("{rule} has no test named after it"));
        }
    }
    for rule in in_sources.difference(&indexed) {
        problems.push(format!(
            "{rule} is named in the sources but not in ARCHITECTURE.md's rule index"
        ));
    }
    assert!(
        problems.is_empty(),
        "the rule index is out of step:\n{}",
        problems.join("\n")
    );
}
