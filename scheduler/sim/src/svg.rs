//! A per-pool utilisation timeline as a hand-written SVG: one panel per policy, one band per
//! pool, the band's filled height the share of the pool busy over time, coloured by the roles the
//! policy gave the pool. All panels share one time axis (so a faster policy's panel ends
//! earlier); thin vertical lines mark each published policy version (the end of an RL step).
//!
//! The canvas is sized from its content, and every number is written with a fixed precision
//! from deterministic inputs, so the same runs give the same bytes.

use std::collections::BTreeSet;
use std::fmt::Write;

use rollfleet_core::placement::ServeRole;
use rollfleet_spec::{JobSpec, PoolKind, RewardPlacement, Role};

use crate::sim::RunResult;

/// Canvas width; the height follows from the number of panels and pools.
const WIDTH: f64 = 1000.0;
/// Left margin of every text line.
const MARGIN: f64 = 12.0;
/// Left edge of the plot area: the column to its left holds pool names and the 0-100% scale.
const PLOT_X: f64 = 190.0;
/// Right edge of the plot area, leaving room for half of the last tick label.
const PLOT_RIGHT: f64 = WIDTH - 28.0;
/// Height of one pool band and the gap between bands.
const BAND: f64 = 40.0;
const BAND_GAP: f64 = 10.0;
/// Least horizontal distance between time tick labels and between step labels, px.
const TICK_SPACING: f64 = 70.0;
const STEP_LABEL_SPACING: f64 = 24.0;
/// Width of one character relative to the font size: a generous estimate for sans-serif text,
/// used to wrap lines and lay out the legend without measuring fonts.
const CHAR_WIDTH: f64 = 0.6;
/// Fill of a band's background (the pool idle) and colour of the text and axis lines.
const BAND_BG: &str = "#eeeeee";
const INK: &str = "#222222";
const MUTED: &str = "#666666";
/// Fill of a pool the policy gave no role.
const UNUSED: &str = "#bab0ac";

/// The roles a pool can play in a run, in legend order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum PoolRole {
    Prefill,
    Decode,
    Generate,
    Train,
    Environment,
    Reward,
}

impl PoolRole {
    fn name(self) -> &'static str {
        match self {
            PoolRole::Prefill => "prefill",
            PoolRole::Decode => "decode",
            PoolRole::Generate => "generate (prefill + decode)",
            PoolRole::Train => "train",
            PoolRole::Environment => "environment",
            PoolRole::Reward => "reward",
        }
    }

    fn short(self) -> &'static str {
        match self {
            PoolRole::Generate => "generate",
            other => other.name(),
        }
    }

    fn colour(self) -> &'static str {
        match self {
            PoolRole::Prefill => "#4e79a7",
            PoolRole::Decode => "#f28e2b",
            PoolRole::Generate => "#76b7b2",
            PoolRole::Train => "#e15759",
            PoolRole::Environment => "#59a14f",
            PoolRole::Reward => "#b07aa1",
        }
    }

    fn from_spec(role: Role) -> Self {
        match role {
            Role::Prefill => PoolRole::Prefill,
            Role::Decode => PoolRole::Decode,
            Role::Generate => PoolRole::Generate,
            Role::Train => PoolRole::Train,
            Role::Environment => PoolRole::Environment,
            Role::Reward => PoolRole::Reward,
        }
    }
}

/// The roles of every pool in one run: GPU pools from the run's placement (serving replicas and
/// trainer), CPU and serverless pools from the spec (their pinned roles, else environments on
/// CPU nodes and rewards wherever a reward function names the pool).
fn pool_roles(spec: &JobSpec, run: &RunResult) -> Vec<BTreeSet<PoolRole>> {
    let mut roles = vec![BTreeSet::new(); spec.pools.len()];
    for replica in &run.placement.replicas {
        if let Some(r) = roles.get_mut(replica.pool as usize) {
            r.insert(match replica.role {
                ServeRole::Prefill => PoolRole::Prefill,
                ServeRole::Decode => PoolRole::Decode,
                ServeRole::Generate => PoolRole::Generate,
            });
        }
    }
    if let Some(r) = roles.get_mut(run.placement.trainer.pool as usize) {
        r.insert(PoolRole::Train);
    }
    for (pool, r) in spec.pools.iter().zip(&mut roles) {
        let kind = pool.kind();
        if kind == Some(PoolKind::Gpu) {
            continue;
        }
        let pinned: BTreeSet<_> = pool
            .roles
            .iter()
            .filter(|role| !role.is_gpu_role())
            .map(|role| PoolRole::from_spec(*role))
            .collect();
        if !pinned.is_empty() {
            r.extend(pinned);
            continue;
        }
        let wanted = match kind {
            Some(PoolKind::Serverless) => RewardPlacement::Serverless,
            _ => RewardPlacement::Local,
        };
        if spec
            .rewards
            .iter()
            .any(|rw| rw.runs_on == wanted && rw.pool.as_deref().is_none_or(|p| p == pool.name))
            || kind == Some(PoolKind::Serverless)
        {
            r.insert(PoolRole::Reward);
        }
        if kind == Some(PoolKind::Cpu) {
            r.insert(PoolRole::Environment);
        }
    }
    roles
}

/// The fill of a pool band: the role's colour, diagonal stripes of each role's colour for a pool
/// shared by several roles, grey for an unused pool.
fn fill(roles: &BTreeSet<PoolRole>) -> String {
    match roles.len() {
        0 => UNUSED.to_owned(),
        1 => roles.iter().map(|r| r.colour()).collect(),
        _ => format!("url(#{})", pattern_id(roles)),
    }
}

fn pattern_id(roles: &BTreeSet<PoolRole>) -> String {
    let names: Vec<_> = roles.iter().map(|r| r.short()).collect();
    format!("roles-{}", names.join("-"))
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn text_width(s: &str, font_size: f64) -> f64 {
    s.chars().count() as f64 * font_size * CHAR_WIDTH
}

/// Words of `s` in lines of at most `width` px at `font_size`.
fn wrap(s: &str, font_size: f64, width: f64) -> Vec<String> {
    let max_chars = ((width / (font_size * CHAR_WIDTH)) as usize).max(1);
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in s.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > max_chars {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// A round tick step of `mantissa * 10^exponent` seconds (mantissa 1, 2 or 5) giving ticks at
/// least [`TICK_SPACING`] apart over `max_t` seconds. Kept as integers so that labels are exact.
fn tick_step(max_t: f64, plot_w: f64) -> (u64, i32) {
    let least = max_t * TICK_SPACING / plot_w;
    for exponent in -3..=12 {
        for mantissa in [1, 2, 5] {
            if mantissa as f64 * 10f64.powi(exponent) >= least {
                return (mantissa, exponent);
            }
        }
    }
    (1, 13)
}

/// `units * 10^exponent` written exactly, without float formatting.
fn tick_label(units: u64, exponent: i32) -> String {
    if exponent >= 0 {
        return (units * 10u64.pow(exponent as u32)).to_string();
    }
    let digits = exponent.unsigned_abs() as usize;
    let s = format!("{units:0>width$}", width = digits + 1);
    let (int, frac) = s.split_at(s.len() - digits);
    let frac = frac.trim_end_matches('0');
    if frac.is_empty() {
        int.to_owned()
    } else {
        format!("{int}.{frac}")
    }
}

/// The smallest of 1, 2, 5, 10, 20, ... such that labelling every that-many steps keeps labels
/// [`STEP_LABEL_SPACING`] apart.
fn step_label_every(step_px: f64) -> usize {
    let mut every = 1;
    let mut scale = 1;
    loop {
        for m in [1, 2, 5] {
            every = m * scale;
            if every as f64 * step_px >= STEP_LABEL_SPACING {
                return every;
            }
        }
        scale *= 10;
        if scale > 1_000_000 {
            return every;
        }
    }
}

/// Draws the timeline of several runs of `spec` (the job called `job`) over the same pools.
pub fn timeline(
    job: &str,
    spec: &JobSpec,
    runs: &[(String, &RunResult)],
    attribution: Option<&str>,
) -> String {
    let max_t = runs.iter().map(|(_, r)| r.makespan_s).fold(1e-9, f64::max);
    let plot_w = PLOT_RIGHT - PLOT_X;
    let x_of = |t: f64| PLOT_X + (t / max_t).clamp(0.0, 1.0) * plot_w;
    let roles: Vec<Vec<BTreeSet<PoolRole>>> =
        runs.iter().map(|(_, r)| pool_roles(spec, r)).collect();

    // The body is written first and wrapped in the header once its height is known.
    let mut body = String::new();
    let mut y = 0.0;

    let title = format!("{job}: pool utilisation over time");
    y += 26.0;
    let _ = writeln!(
        body,
        r#"<text x="{MARGIN}" y="{y:.1}" font-size="16" font-weight="bold">{}</text>"#,
        escape(&title)
    );
    let subtitle = "Filled height: share of the pool busy (GPUs, vCPUs or concurrent calls). \
                    Thin vertical lines: a policy version published, ending an RL step.";
    for line in wrap(subtitle, 11.0, WIDTH - 2.0 * MARGIN) {
        y += 16.0;
        let _ = writeln!(
            body,
            r#"<text x="{MARGIN}" y="{y:.1}" font-size="11" fill="{MUTED}">{}</text>"#,
            escape(&line)
        );
    }

    // Legend: every role some policy gave some pool, then the stripes of a shared pool.
    let used: BTreeSet<PoolRole> = roles.iter().flatten().flatten().copied().collect();
    let shared: BTreeSet<&BTreeSet<PoolRole>> =
        roles.iter().flatten().filter(|r| r.len() > 1).collect();
    let unused = roles.iter().flatten().any(|r| r.is_empty());
    let mut entries: Vec<(String, String)> = used
        .iter()
        .map(|r| (r.colour().to_owned(), r.name().to_owned()))
        .collect();
    if let Some(first) = shared.iter().next() {
        entries.push((fill(first), "striped: pool shared by roles".to_owned()));
    }
    if unused {
        entries.push((UNUSED.to_owned(), "unused pool".to_owned()));
    }
    y += 12.0;
    let mut x = MARGIN;
    for (colour, label) in &entries {
        let w = 16.0 + text_width(label, 11.0) + 18.0;
        if x > MARGIN && x + w > WIDTH - MARGIN {
            x = MARGIN;
            y += 20.0;
        }
        let _ = writeln!(
            body,
            r#"<g class="legend"><rect x="{x:.1}" y="{y:.1}" width="12" height="12" fill="{colour}"/><text x="{:.1}" y="{:.1}" font-size="11">{}</text></g>"#,
            x + 16.0,
            y + 10.0,
            escape(label)
        );
        x += w;
    }
    y += 12.0;

    let (mantissa, exponent) = tick_step(max_t, plot_w);
    let tick_s = mantissa as f64 * 10f64.powi(exponent);
    let ticks = (max_t / tick_s + 1e-9).floor() as u64;

    for ((name, run), roles) in runs.iter().zip(&roles) {
        // Header: the policy and its pace.
        y += 28.0;
        let steps = run.publish_times_s.len();
        let per_step = run.makespan_s / steps.max(1) as f64;
        let _ = writeln!(
            body,
            r#"<text class="panel" x="{MARGIN}" y="{y:.1}" font-size="13" font-weight="bold">{}: {per_step:.1} s per RL step ({steps} steps in {:.0} s)</text>"#,
            escape(name),
            run.makespan_s
        );
        // Step labels, every few steps so that they stay apart.
        y += 16.0;
        let step_px = plot_w * per_step / max_t;
        let every = step_label_every(step_px);
        let _ = writeln!(
            body,
            r#"<text x="{:.1}" y="{y:.1}" font-size="9" fill="{MUTED}" text-anchor="end">step</text>"#,
            PLOT_X - 6.0
        );
        for (i, t) in run.publish_times_s.iter().enumerate() {
            let step = i + 1;
            if step.is_multiple_of(every) {
                let _ = writeln!(
                    body,
                    r#"<text class="step-label" x="{:.1}" y="{y:.1}" font-size="9" fill="{MUTED}" text-anchor="middle">{step}</text>"#,
                    x_of(*t)
                );
            }
        }
        y += 6.0;
        let bands_top = y;

        for (i, pool) in spec.pools.iter().enumerate() {
            let pool_roles = &roles[i];
            let role_names: Vec<_> = pool_roles.iter().map(|r| r.short()).collect();
            let role_text = if role_names.is_empty() {
                "unused".to_owned()
            } else {
                role_names.join(" + ")
            };
            let bottom = y + BAND;
            let _ = writeln!(
                body,
                r#"<text class="pool" x="{MARGIN}" y="{:.1}" font-weight="bold">{}</text><text class="roles" x="{MARGIN}" y="{:.1}" font-size="10" fill="{MUTED}">{}</text>"#,
                y + 16.0,
                escape(&pool.name),
                y + 30.0,
                escape(&role_text)
            );
            let _ = writeln!(
                body,
                r#"<rect class="band" x="{PLOT_X:.1}" y="{y:.1}" width="{plot_w:.1}" height="{BAND:.1}" fill="{BAND_BG}"/>"#
            );
            // The 0-100% scale: labels at the band's edges and a gridline at half.
            let _ = writeln!(
                body,
                r##"<g font-size="9" fill="{MUTED}" text-anchor="end"><text x="{lx:.1}" y="{:.1}">100%</text><text x="{lx:.1}" y="{:.1}">50%</text><text x="{lx:.1}" y="{:.1}">0%</text></g>"##,
                y + 7.0,
                y + BAND / 2.0 + 3.0,
                bottom,
                lx = PLOT_X - 6.0
            );
            for k in 1..=ticks {
                let tx = x_of(k as f64 * tick_s);
                let _ = writeln!(
                    body,
                    r##"<line x1="{tx:.1}" y1="{y:.1}" x2="{tx:.1}" y2="{bottom:.1}" stroke="#d8d8d8" stroke-width="1"/>"##
                );
            }
            let cap = run.capacity.get(&(i as u32)).copied().unwrap_or(0.0);
            if let Some(meter) = run.meters.get(&(i as u32))
                && cap > 0.0
                && !meter.buckets.is_empty()
            {
                let width_s = meter.width as f64 / 1e9;
                let mut path = format!("M{PLOT_X:.1},{bottom:.1}");
                for (b, busy) in meter.buckets.iter().enumerate() {
                    let start = b as f64 * width_s;
                    if start >= run.makespan_s {
                        break;
                    }
                    let share = (busy / (cap * width_s)).clamp(0.0, 1.0);
                    let x0 = x_of(start);
                    let x1 = x_of(((b + 1) as f64 * width_s).min(run.makespan_s));
                    let top = bottom - share * BAND;
                    let _ = write!(path, " L{x0:.1},{top:.1} L{x1:.1},{top:.1}");
                }
                let end = x_of(run.makespan_s);
                let _ = write!(path, " L{end:.1},{bottom:.1} Z");
                let _ = writeln!(
                    body,
                    r#"<path class="usage" d="{path}" fill="{}" stroke="none"/>"#,
                    fill(pool_roles)
                );
            }
            let half = y + BAND / 2.0;
            let _ = writeln!(
                body,
                r##"<line x1="{PLOT_X:.1}" y1="{half:.1}" x2="{PLOT_RIGHT:.1}" y2="{half:.1}" stroke="#ffffff" stroke-width="0.8" stroke-dasharray="3 3" stroke-opacity="0.8"/>"##
            );
            y = bottom + BAND_GAP;
        }
        let bands_bottom = y - BAND_GAP;

        // Step markers over the bands, light enough not to hide the fill.
        let _ = write!(
            body,
            r##"<g class="steps" stroke="#000000" stroke-opacity="0.3" stroke-width="0.7">"##
        );
        for t in &run.publish_times_s {
            let sx = x_of(*t);
            let _ = write!(
                body,
                r#"<line x1="{sx:.1}" y1="{:.1}" x2="{sx:.1}" y2="{bands_bottom:.1}"/>"#,
                bands_top - 3.0
            );
        }
        let _ = writeln!(body, "</g>");

        // The time axis under the panel, the same for every panel.
        // On a half pixel, so that a 1 px line covers one row of pixels rather than two greyed ones.
        let axis_y = bands_bottom + 4.5;
        let _ = write!(
            body,
            r#"<g class="axis" stroke="{INK}" stroke-width="1"><line x1="{PLOT_X:.1}" y1="{axis_y:.1}" x2="{PLOT_RIGHT:.1}" y2="{axis_y:.1}"/>"#
        );
        for k in 0..=ticks {
            let tx = x_of(k as f64 * tick_s);
            let _ = write!(
                body,
                r#"<line x1="{tx:.1}" y1="{axis_y:.1}" x2="{tx:.1}" y2="{:.1}"/>"#,
                axis_y + 5.0
            );
        }
        let _ = writeln!(body, "</g>");
        let label_y = bands_bottom + 21.0;
        let _ = write!(
            body,
            r#"<g class="ticks" font-size="10" fill="{INK}" text-anchor="middle">"#
        );
        for k in 0..=ticks {
            let _ = write!(
                body,
                r#"<text x="{:.1}" y="{label_y:.1}">{}</text>"#,
                x_of(k as f64 * tick_s),
                tick_label(k * mantissa, exponent)
            );
        }
        let _ = writeln!(body, "</g>");
        let _ = writeln!(
            body,
            r#"<text x="{:.1}" y="{label_y:.1}" font-size="10" fill="{MUTED}" text-anchor="end">time (s)</text>"#,
            PLOT_X - 6.0
        );
        y = label_y;
    }

    if let Some(a) = attribution {
        y += 10.0;
        for line in wrap(
            &format!("Workload samples: {a}"),
            10.0,
            WIDTH - 2.0 * MARGIN,
        ) {
            y += 13.0;
            let _ = writeln!(
                body,
                r#"<text x="{MARGIN}" y="{y:.1}" font-size="10" fill="{MUTED}">{}</text>"#,
                escape(&line)
            );
        }
    }
    let height = (y + MARGIN).ceil();

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH:.0}" height="{height:.0}" viewBox="0 0 {WIDTH:.0} {height:.0}" font-family="sans-serif" font-size="12" fill="{INK}">"#
    );
    if !shared.is_empty() {
        svg.push_str("<defs>\n");
        for roles in &shared {
            let stripe = 5.0;
            let _ = write!(
                svg,
                r#"<pattern id="{}" patternUnits="userSpaceOnUse" width="{:.0}" height="10" patternTransform="rotate(45)">"#,
                pattern_id(roles),
                stripe * roles.len() as f64
            );
            for (k, role) in roles.iter().enumerate() {
                let _ = write!(
                    svg,
                    r#"<rect x="{:.0}" y="0" width="{stripe:.0}" height="10" fill="{}"/>"#,
                    k as f64 * stripe,
                    role.colour()
                );
            }
            svg.push_str("</pattern>\n");
        }
        svg.push_str("</defs>\n");
    }
    let _ = writeln!(
        svg,
        r##"<rect x="0" y="0" width="{WIDTH:.0}" height="{height:.0}" fill="#ffffff"/>"##
    );
    svg.push_str(&body);
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_steps_are_one_two_or_five_times_a_power_of_ten() {
        assert_eq!(tick_step(11_530.0, 780.0), (2, 3));
        assert_eq!(tick_step(4.5, 780.0), (5, -1));
        assert_eq!(tick_step(100.0, 780.0), (1, 1));
    }

    #[test]
    fn tick_labels_are_written_exactly() {
        assert_eq!(tick_label(6, 3), "6000");
        assert_eq!(tick_label(15, -1), "1.5");
        assert_eq!(tick_label(20, -1), "2");
        assert_eq!(tick_label(5, -3), "0.005");
        assert_eq!(tick_label(0, -2), "0");
    }

    #[test]
    fn step_labels_thin_out_as_steps_get_narrow() {
        assert_eq!(step_label_every(40.0), 1);
        assert_eq!(step_label_every(10.0), 5);
        assert_eq!(step_label_every(1.0), 50);
    }

    #[test]
    fn long_lines_wrap_at_word_boundaries() {
        let lines = wrap("aaaa bbbb cccc", 10.0, 50.0);
        assert_eq!(lines, vec!["aaaa", "bbbb", "cccc"]);
        assert_eq!(wrap("aaaa bbbb", 10.0, 600.0), vec!["aaaa bbbb"]);
    }
}
