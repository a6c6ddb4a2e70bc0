//! A per-pool utilisation timeline as a hand-written SVG: one panel per policy, one band per
//! pool, the band's filled height the share of the pool busy over time. All panels share the
//! time axis, so a faster policy's panel ends earlier.

use std::fmt::Write;

use crate::sim::RunResult;

const WIDTH: f64 = 960.0;
const LABEL: f64 = 150.0;
const BAND: f64 = 28.0;
const GAP: f64 = 6.0;
const COLOURS: [&str; 8] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Draws the timeline of several runs over the same pools.
pub fn timeline(
    pool_names: &[String],
    runs: &[(String, &RunResult)],
    attribution: Option<&str>,
) -> String {
    let max_t = runs.iter().map(|(_, r)| r.makespan_s).fold(1e-9, f64::max);
    let plot_w = WIDTH - LABEL - 20.0;
    let panel_h = 24.0 + pool_names.len() as f64 * (BAND + GAP);
    let height = 40.0 + runs.len() as f64 * (panel_h + 16.0) + 40.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="10" y="22" font-size="15" font-weight="bold">Pool utilisation over time (virtual seconds, 0 to {max_t:.0} s)</text>"#
    );
    let mut y = 40.0;
    for (name, run) in runs {
        let _ = writeln!(
            svg,
            r#"<text x="10" y="{:.1}" font-weight="bold">{} — {:.0} s for {} steps</text>"#,
            y + 14.0,
            escape(name),
            run.makespan_s,
            run.publish_times_s.len()
        );
        y += 24.0;
        for (i, pool) in pool_names.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let _ = writeln!(
                svg,
                r##"<text x="10" y="{:.1}">{}</text><rect x="{LABEL}" y="{y:.1}" width="{plot_w:.1}" height="{BAND}" fill="#f3f3f3"/>"##,
                y + BAND / 2.0 + 4.0,
                escape(pool)
            );
            let cap = run.capacity.get(&(i as u32)).copied().unwrap_or(0.0);
            if let Some(meter) = run.meters.get(&(i as u32))
                && cap > 0.0
            {
                let width_s = meter.width as f64 / 1e9;
                let mut path = format!("M{LABEL:.1},{:.1}", y + BAND);
                for (b, busy) in meter.buckets.iter().enumerate() {
                    let share = (busy / (cap * width_s)).clamp(0.0, 1.0);
                    let x0 = LABEL + (b as f64 * width_s / max_t).min(1.0) * plot_w;
                    let x1 = LABEL
                        + (((b + 1) as f64 * width_s).min(run.makespan_s) / max_t).min(1.0)
                            * plot_w;
                    let top = y + BAND - share * BAND;
                    let _ = write!(path, " L{x0:.1},{top:.1} L{x1:.1},{top:.1}");
                }
                let end = LABEL + (run.makespan_s / max_t).min(1.0) * plot_w;
                let _ = write!(path, " L{end:.1},{:.1} Z", y + BAND);
                let _ = writeln!(svg, r#"<path d="{path}" fill="{colour}" stroke="none"/>"#);
            }
            y += BAND + GAP;
        }
        y += 16.0;
    }
    if let Some(a) = attribution {
        let _ = writeln!(
            svg,
            r##"<text x="10" y="{:.1}" font-size="10" fill="#555">Workload samples: {}</text>"##,
            y + 10.0,
            escape(a)
        );
    }
    svg.push_str("</svg>\n");
    svg
}
