//! The README's limits, checked by `cargo xtask check`: it is an operator's
//! first page, so it stays within [`MAX_README_LINES`] and every link in it
//! is relative and leads to a file of this repository (and, for a link to a
//! heading, to that heading). The pages under docs/ have their relative
//! links checked the same way; they may also link out.

use std::path::{Component, Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The README's length at most.
pub const MAX_README_LINES: usize = 200;

/// Checks README.md and docs/*.md under `root`; says every problem at once.
pub fn check(root: &Path) -> Result<()> {
    let mut problems = Vec::new();
    let readme = root.join("README.md");
    let text = std::fs::read_to_string(&readme).context("reading README.md")?;
    let lines = text.lines().count();
    if lines > MAX_README_LINES {
        problems.push(format!(
            "README.md: {lines} lines, more than {MAX_README_LINES}; move the detail to docs/"
        ));
    }
    problems.extend(link_problems(root, Path::new("README.md"), &text, false));
    let docs = root.join("docs");
    let mut pages: Vec<PathBuf> = std::fs::read_dir(&docs)
        .with_context(|| format!("listing {}", docs.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    pages.sort();
    for page in pages {
        let text = std::fs::read_to_string(&page)
            .with_context(|| format!("reading {}", page.display()))?;
        let relative = page.strip_prefix(root).unwrap_or(&page);
        problems.extend(link_problems(root, relative, &text, true));
    }
    if !problems.is_empty() {
        bail!("the docs:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

/// The problems of the links in `text`, the file at `file` (relative to
/// `root`). `external`: links to other sites are allowed.
fn link_problems(root: &Path, file: &Path, text: &str, external: bool) -> Vec<String> {
    let dir = file.parent().unwrap_or(Path::new(""));
    let mut problems = Vec::new();
    for target in links(text) {
        let say = |problem: &str| format!("{}: link `{target}` {problem}", file.display());
        if target.contains("://") || target.starts_with("mailto:") {
            if !external {
                problems.push(say("leads out of the repository; link a file in it"));
            }
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((path, anchor)) => (path, Some(anchor)),
            None => (target.as_str(), None),
        };
        let Some(resolved) = inside(&dir.join(path)) else {
            problems.push(say("leads out of the repository"));
            continue;
        };
        let full = root.join(&resolved);
        if path.starts_with('/') {
            problems.push(say("is absolute; make it relative"));
        } else if !full.exists() {
            problems.push(say(&format!(
                "names {}, which does not exist",
                resolved.display()
            )));
        } else if let Some(anchor) = anchor
            && full.extension().is_some_and(|ext| ext == "md")
        {
            let page = std::fs::read_to_string(&full).unwrap_or_default();
            if !headings(&page).iter().any(|slug| slug == anchor) {
                problems.push(say(&format!("names no heading of {}", resolved.display())));
            }
        }
    }
    problems
}

/// `path` with `.` and `..` resolved, if it stays inside the repository.
fn inside(path: &Path) -> Option<PathBuf> {
    let mut resolved = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => resolved.push(part),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir => {
                if !resolved.pop() {
                    return None;
                }
            }
            Component::Prefix(_) => return None,
        }
    }
    Some(resolved)
}

/// The targets of the Markdown links and images in `text`, outside code.
fn links(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let prose = without_code_spans(line);
        let mut rest = prose.as_str();
        while let Some(start) = rest.find("](") {
            rest = &rest[start + 2..];
            let Some(end) = rest.find(')') else { break };
            targets.push(rest[..end].trim().to_string());
            rest = &rest[end + 1..];
        }
        if let Some(definition) = prose.trim_start().strip_prefix('[')
            && let Some((_, target)) = definition.split_once("]: ")
        {
            targets.push(target.trim().to_string());
        }
    }
    targets
}

/// `line` without its `code spans`.
fn without_code_spans(line: &str) -> String {
    line.split('`').step_by(2).collect::<Vec<_>>().join("")
}

/// The anchors GitHub gives the headings of a page: lower case, spaces to
/// `-`, punctuation other than `-` and `_` dropped.
fn headings(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut slugs = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        slugs.push(slug);
    }
    slugs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    #[test]
    fn finds_links_outside_code() {
        let text =
            "See [a](docs/a.md) and ![b](b.svg).\n`[not](x)`\n```\n[no](y)\n```\n[c]: docs/c.md\n";
        assert_eq!(links(text), ["docs/a.md", "b.svg", "docs/c.md"]);
    }

    #[test]
    fn slugs_headings_as_github_does() {
        let page =
            "# Top\n## `socklb run` only (flags)\n```\n# not a heading\n```\n### The DaemonSet\n";
        assert_eq!(
            headings(page),
            ["top", "socklb-run-only-flags", "the-daemonset"]
        );
    }

    #[test]
    fn says_each_bad_link() {
        let text = "[gone](docs/nothing.md) [out](../../etc/passwd) [web](https://example.com) \
                    [abs](/etc/hostname) [heading](docs/testing.md#no-such-heading) [ok](Cargo.toml)";
        let problems = link_problems(&repo(), Path::new("README.md"), text, false);
        assert_eq!(problems.len(), 5, "{problems:#?}");
        let external = link_problems(
            &repo(),
            Path::new("README.md"),
            "[web](https://example.com)",
            true,
        );
        assert!(external.is_empty(), "{external:?}");
    }

    #[test]
    fn the_readme_and_docs_hold_their_limits() {
        check(&repo()).unwrap();
    }
}
