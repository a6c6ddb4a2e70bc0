//! The monitoring manifests (`manifests/monitoring/`) checked by Prometheus's own tool: the
//! scrape configuration and the rules load, and the alerts fire (and stay quiet) as their unit
//! tests say; and the Grafana dashboard is well formed. That a real Prometheus scrapes a running
//! scheduler with them, and that every dashboard query returns data, is tested in `runtime.rs`.

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
    assert_eq!(variables, ["datasource", "pool"]);
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
    assert_eq!(queries, 19);
}
