//! The monitoring manifests (`manifests/monitoring/`) checked by Prometheus's own tool: the
//! scrape configuration and the rules load, and the alerts fire (and stay quiet) as their unit
//! tests say, every alert links to its runbook; and the Grafana dashboard is well formed, with
//! every query filtered by the dashboard's job. That a real Prometheus scrapes a running
//! scheduler with them, that the scrape passes `promtool check metrics`, that every dashboard
//! query returns data, and that a normal end raises no alert, is tested in `runtime_metrics.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn monitoring_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../manifests/monitoring")
        .join(name)
}

/// Runs `promtool ARGS`; returns its output, failing the test with it if promtool failed.
fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(monitoring_file(""))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `promtool` ({e}): install Prometheus 2.x (Debian: `apt-get install \
                 prometheus`; .ci/run does)"
            )
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn the_shipped_scrape_configuration_and_rules_pass_promtool() {
    let config = promtool(&["check", "config", "prometheus.yml"]);
    assert!(config.contains("SUCCESS: 1 rule files found"), "{config}");
    let rules = promtool(&["check", "rules", "rollfleet-rules.yaml"]);
    assert!(rules.contains("SUCCESS: 15 rules found"), "{rules}");
}

#[test]
fn the_alerts_fire_and_stay_quiet_as_their_unit_tests_say() {
    let out = promtool(&["test", "rules", "rollfleet-rules.test.yaml"]);
    assert!(out.contains("SUCCESS"), "{out}");
    // Every alert of the rules has a case where it fires.
    let rules = std::fs::read_to_string(monitoring_file("rollfleet-rules.yaml")).unwrap();
    let tests = std::fs::read_to_string(monitoring_file("rollfleet-rules.test.yaml")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert_eq!(alerts.len(), 11, "{alerts:?}");
    for alert in alerts {
        let fires = tests.split("alertname: ").skip(1).any(|case| {
            case.starts_with(alert)
                && case
                    .lines()
                    .nth(1)
                    .is_some_and(|l| l.trim() == "exp_alerts:")
        });
        assert!(fires, "no unit test where {alert} fires");
    }
}

#[test]
fn the_grafana_dashboard_is_well_formed_and_every_panel_queries_prometheus() {
    let dashboard: Value =
        serde_json::from_slice(&std::fs::read(monitoring_file("grafana-dashboard.json")).unwrap())
            .unwrap();
    assert_eq!(dashboard["uid"], "rollfleet-capacity");
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(variables, ["datasource", "namespace", "rljob", "pool"]);
    // The job's variables come from the scheduler's build info, the pools from the chosen job.
    let list = dashboard["templating"]["list"].as_array().unwrap();
    assert_eq!(
        list[1]["definition"],
        "label_values(rollfleet_build_info, namespace)"
    );
    assert_eq!(
        list[2]["definition"],
        "label_values(rollfleet_build_info{namespace=~\"$namespace\"}, rljob)"
    );
    assert_eq!(
        list[3]["definition"],
        "label_values(rollfleet_pool_busy_ratio{namespace=~\"$namespace\", rljob=~\"$rljob\"}, pool)"
    );
    let mut all_exprs = String::new();
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap();
        assert!(
            ids.insert(panel["id"].as_u64().unwrap()),
            "{title}: id used twice"
        );
        let grid = &panel["gridPos"];
        let right = grid["x"].as_u64().unwrap() + grid["w"].as_u64().unwrap();
        assert!(right <= 24, "{title}: wider than the dashboard");
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        assert!(
            !panel["description"].as_str().unwrap().is_empty(),
            "{title}"
        );
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            let expr = target["expr"].as_str().unwrap();
            assert!(expr.contains("rollfleet_"), "{title}: {expr}");
            // Every series the query selects is the dashboard's job's.
            for selector in expr.split("rollfleet_").skip(1) {
                let labels = selector
                    .trim_start_matches(|c: char| c.is_ascii_alphanumeric() || c == '_')
                    .strip_prefix('{')
                    .and_then(|l| l.split_once('}'))
                    .map(|(l, _)| l);
                assert!(
                    labels.is_some_and(
                        |l| l.starts_with("namespace=~\"$namespace\", rljob=~\"$rljob\"")
                    ),
                    "{title}: rollfleet_{selector} is not filtered by the job"
                );
            }
            all_exprs.push_str(expr);
            all_exprs.push('\n');
            // Pool-labelled series follow the dashboard's pool selector.
            if [
                "pool_busy",
                "pending_stages",
                "stage_completions",
                "workers{",
                "gpu_",
            ]
            .iter()
            .any(|m| expr.contains(m))
            {
                assert!(expr.contains("pool=~\"$pool\""), "{title}: {expr}");
            }
            queries += 1;
        }
    }
    assert_eq!(queries, 30);
    // What the practitioner watches: each task's reward and success rate.
    for reward in [
        "rollfleet_task_last_step_mean_reward{",
        "rollfleet_task_last_step_success_ratio{",
    ] {
        assert!(all_exprs.contains(reward), "no panel shows {reward}");
    }
    // Utilisation from the busy-time counter, whatever the scrape interval; p50 and p99 of each
    // histogram.
    assert!(
        !all_exprs.contains("rollfleet_pool_busy_ratio"),
        "{all_exprs}"
    );
    assert!(
        all_exprs.contains("rate(rollfleet_pool_busy_seconds_total{"),
        "{all_exprs}"
    );
    for histogram in [
        "stage_duration_seconds",
        "stage_queue_wait_seconds",
        "rl_step_duration_seconds",
    ] {
        for q in ["0.5", "0.99"] {
            let quantile = format!("histogram_quantile({q}, sum by (");
            assert!(
                all_exprs.lines().any(|e| e.starts_with(&quantile)
                    && e.contains(&format!("(rate(rollfleet_{histogram}_bucket{{"))),
                "no p{} of {histogram}: {all_exprs}",
                q.trim_start_matches("0.")
            );
        }
    }
}

#[test]
fn every_alert_links_to_a_runbook_section_of_the_monitoring_doc_that_exists() {
    let rules = std::fs::read_to_string(monitoring_file("rollfleet-rules.yaml")).unwrap();
    let doc = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/monitoring.md"),
    )
    .unwrap();
    // GitHub's anchors of the doc's headings: lower case, spaces as dashes, other punctuation
    // dropped.
    let anchors: BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|h| {
            h.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect();
    let mut alert = None;
    let mut linked = 0;
    for line in rules.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert: ") {
            assert!(
                alert.is_none(),
                "{name}: the alert before has no runbook_url"
            );
            alert = Some(name);
        } else if let Some(url) = line.strip_prefix("runbook_url: ") {
            let name = alert.take().expect("a runbook_url outside an alert");
            let anchor = url
                .trim_matches('"')
                .strip_prefix(
                    "https://github.com/rollfleet/rollfleet/blob/main/docs/monitoring.md#",
                )
                .unwrap_or_else(|| panic!("{name}: {url} is not a section of docs/monitoring.md"));
            assert_eq!(anchor, name.to_lowercase(), "{name}");
            assert!(
                anchors.contains(anchor),
                "{name}: docs/monitoring.md has no heading for #{anchor}"
            );
            linked += 1;
        }
    }
    assert!(alert.is_none(), "the last alert has no runbook_url");
    assert_eq!(linked, 11);
}
