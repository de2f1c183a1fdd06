use super::*;
use crate::config::parse_toml;

fn set(addrs: &[&str]) -> BackendSet {
    addrs
        .iter()
        .map(|addr| Found {
            addr: addr.parse().unwrap(),
            standby: false,
        })
        .collect()
}

fn config(extra: &str) -> Config {
    parse_toml(&format!(
        r#"
[[service]]
name = "api"
vips = ["127.0.0.1:6444"]
{extra}
"#
    ))
    .unwrap()
}

fn addrs(config: &Config) -> Vec<String> {
    config.services[0]
        .backends
        .iter()
        .map(|backend| backend.addr.to_string())
        .collect()
}

#[test]
fn slices_rule_then_state_file_then_persisted_then_static() {
    let base = config(
        r#"backends = ["10.0.0.1:6443"]
k3s-state = "/var/lib/rancher/k3s/agent/etc/k3s-api-server-agent-load-balancer.json"
endpointslices = "default/kubernetes""#,
    );
    let mut sources = ServiceSources::new(&base.services[0]);
    assert_eq!(sources.effective().unwrap().0, Source::Static);
    sources.seed_persisted(set(&["10.0.0.5:6443"]));
    assert_eq!(sources.effective().unwrap().0, Source::Persisted);
    sources.report(Source::K3sState, Report::Set(set(&["10.0.0.2:6443"])));
    assert_eq!(sources.effective().unwrap().0, Source::K3sState);
    sources.report(
        Source::EndpointSlices,
        Report::Set(set(&["10.0.0.3:6443", "10.0.0.4:6443"])),
    );
    let (source, effective) = sources.effective().unwrap();
    assert_eq!(source, Source::EndpointSlices);
    assert_eq!(effective, &set(&["10.0.0.3:6443", "10.0.0.4:6443"]));
    // The state file changing does not move the table off the slices.
    sources.report(Source::K3sState, Report::Set(set(&["10.0.0.9:6443"])));
    assert_eq!(sources.effective().unwrap().0, Source::EndpointSlices);
}

#[test]
fn failures_and_empty_sets_keep_the_last_known_set_and_warn_once() {
    let base = config(r#"endpointslices = "default/kubernetes""#);
    let mut sources = ServiceSources::new(&base.services[0]);
    assert!(sources.effective().is_none());
    let first = sources.report(Source::EndpointSlices, Report::Failed("refused".into()));
    assert_eq!(
        first.problem.map(|problem| (problem.kind, problem.text)),
        Some((
            ProblemKind::Failed,
            "endpointslices failed: refused; nothing known from it yet".to_string()
        ))
    );
    sources.report(Source::EndpointSlices, Report::Set(set(&["10.0.0.1:6443"])));
    let empty = sources.report(Source::EndpointSlices, Report::Set(BackendSet::new()));
    assert_eq!(
        empty.problem.map(|problem| problem.text).as_deref(),
        Some("endpointslices lists no backend; keeping its last known 1 backends")
    );
    let again = sources.report(Source::EndpointSlices, Report::Failed("timeout".into()));
    assert_eq!(again, Outcome::default(), "said once");
    assert_eq!(
        sources.effective().unwrap().1,
        &set(&["10.0.0.1:6443"]),
        "never emptied"
    );
    let back = sources.report(Source::EndpointSlices, Report::Set(set(&["10.0.0.2:6443"])));
    assert!(back.recovered.is_some());
    assert_eq!(sources.effective().unwrap().1, &set(&["10.0.0.2:6443"]));
}

#[test]
fn persisted_set_is_not_used_without_a_dynamic_source() {
    let base = config(r#"backends = ["10.0.0.1:6443"]"#);
    let mut sources = ServiceSources::new(&base.services[0]);
    sources.seed_persisted(set(&["10.0.0.5:6443"]));
    assert_eq!(sources.effective().unwrap().0, Source::Static);
}

#[test]
fn effective_config_keeps_static_attributes_and_waits_for_a_first_set() {
    let base = config(
        r#"backends = ["10.0.0.1:6443,weight=3"]
endpointslices = "default/kubernetes""#,
    );
    let mut sources = BTreeMap::new();
    sources.insert("api".to_string(), ServiceSources::new(&base.services[0]));
    let (effective, waiting) = effective_config(&base, &sources);
    assert_eq!(addrs(&effective), ["10.0.0.1:6443"]);
    assert!(waiting.is_empty());
    let api = sources.get_mut("api").unwrap();
    api.report(
        Source::EndpointSlices,
        Report::Set(set(&["10.0.0.1:6443", "10.0.0.2:6443", "[fd00::1]:6443"])),
    );
    let (effective, _) = effective_config(&base, &sources);
    assert_eq!(addrs(&effective), ["10.0.0.1:6443", "10.0.0.2:6443"]);
    let weights: Vec<u32> = effective.services[0]
        .backends
        .iter()
        .map(|backend| backend.weight)
        .collect();
    assert_eq!(weights, [3, 1], "the static entry's weight stays");

    let no_seed = config(r#"endpointslices = "default/kubernetes""#);
    let mut sources = BTreeMap::new();
    sources.insert("api".to_string(), ServiceSources::new(&no_seed.services[0]));
    let (effective, waiting) = effective_config(&no_seed, &sources);
    assert!(effective.services.is_empty());
    assert_eq!(waiting, ["api"]);
}

#[test]
fn a_set_of_standbys_only_still_serves() {
    let base = config(r#"k3s-state = "/tmp/state.json""#);
    let mut sources = BTreeMap::new();
    let mut api = ServiceSources::new(&base.services[0]);
    api.report(
        Source::K3sState,
        Report::Set(
            [Found {
                addr: "10.0.0.9:6443".parse().unwrap(),
                standby: true,
            }]
            .into(),
        ),
    );
    sources.insert("api".to_string(), api);
    let (effective, _) = effective_config(&base, &sources);
    assert_eq!(effective.services[0].backends[0].role, BackendRole::Normal);
}

#[test]
fn reload_carries_over_what_unchanged_sources_said() {
    let base = config(r#"endpointslices = "default/kubernetes""#);
    let mut old = ServiceSources::new(&base.services[0]);
    old.report(Source::EndpointSlices, Report::Set(set(&["10.0.0.1:6443"])));
    let mut kept = ServiceSources::new(&base.services[0]);
    kept.carry_over(&old, |_| true);
    assert_eq!(kept.effective().unwrap().1, &set(&["10.0.0.1:6443"]));
    let mut changed = ServiceSources::new(&base.services[0]);
    changed.carry_over(&old, |_| false);
    assert!(changed.effective().is_none());
}

#[test]
fn a_failure_said_before_a_reload_is_not_said_again_after_it() {
    let base = config(r#"endpointslices = "default/kubernetes""#);
    let mut old = ServiceSources::new(&base.services[0]);
    old.report(Source::EndpointSlices, Report::Set(set(&["10.0.0.1:6443"])));
    let said = old.report(
        Source::EndpointSlices,
        Report::Failed("a watch event".into()),
    );
    assert!(said.problem.is_some());
    // The watcher is kept across the reload, so its next failure (the
    // relist's) belongs to the same episode.
    let mut kept = ServiceSources::new(&base.services[0]);
    kept.carry_over(&old, |_| true);
    let relist = kept.report(Source::EndpointSlices, Report::Failed("a list".into()));
    assert_eq!(relist, Outcome::default(), "said once per episode");
    let back = kept.report(Source::EndpointSlices, Report::Set(set(&["10.0.0.1:6443"])));
    assert!(back.recovered.is_some(), "and its end is said");
    // A source whose spec changed has a new watcher: a new episode.
    let mut changed = ServiceSources::new(&base.services[0]);
    changed.carry_over(&old, |_| false);
    let fresh = changed.report(Source::EndpointSlices, Report::Failed("a list".into()));
    assert!(fresh.problem.is_some());
}

#[test]
fn change_lines() {
    let base = config(r#"backends = ["10.0.0.1:6443", "10.0.0.2:6443"]"#);
    let other = config(r#"backends = ["10.0.0.2:6443", "10.0.0.3:6443"]"#);
    assert_eq!(
        describe_change(&base.services[0].backends, &other.services[0].backends).as_deref(),
        Some("+10.0.0.3:6443, -10.0.0.1:6443")
    );
    assert!(describe_change(&base.services[0].backends, &base.services[0].backends).is_none());
}

#[test]
fn a_set_over_the_cap_is_refused_and_a_refused_part_changes_nothing() {
    let base = config(
        r#"k3s-state = "/state.json"
max-discovered-backends = 2"#,
    );
    let mut sources = ServiceSources::new(&base.services[0]);
    sources.report(Source::K3sState, Report::Set(set(&["10.0.0.1:6443"])));
    let three = set(&["10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"]);
    let refused = sources.report(Source::K3sState, Report::Set(three.clone()));
    let problem = refused.problem.expect("said");
    assert_eq!(problem.kind, ProblemKind::TooManyBackends);
    assert!(
        problem
            .text
            .contains("lists 3 backends, more than max-discovered-backends (2)"),
        "{}",
        problem.text
    );
    assert_eq!(sources.effective().unwrap().1, &set(&["10.0.0.1:6443"]));
    assert_eq!(
        sources.report(Source::K3sState, Report::Set(three)),
        Outcome::default(),
        "said once"
    );
    let part = sources.report(
        Source::K3sState,
        Report::Refused(Refusal {
            kind: ProblemKind::Invalid,
            why: "a part".into(),
        }),
    );
    assert_eq!(part.problem.unwrap().text, "k3s-state: a part");
    assert_eq!(sources.effective().unwrap().1, &set(&["10.0.0.1:6443"]));
}
