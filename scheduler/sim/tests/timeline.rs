//! The utilisation timeline SVG: well-formed, labelled (time axis, 0-100% scales, step markers,
//! legend of roles), inside its canvas, deterministic, and drawing what it claims once rendered.
//! Rendering uses resvg without fonts, so text is not drawn in the pixel checks; its placement is
//! checked on the SVG itself.
#![allow(clippy::unwrap_used)]

use rollfleet_sim::sim::{RunResult, SimOptions, simulate, workload_means};
use rollfleet_sim::{Baseline, svg};
use rollfleet_spec::JobSpec;

/// A small job with one pool per role: a generating pool, a training pool, CPU nodes for the
/// environments and a serverless pool for the rewards.
const JOB: &str = r#"
apiVersion: rollfleet.dev/v1alpha1
kind: RLJob
metadata: { name: small }
spec:
  model: { name: toy, parameters: 1.0e9, layers: 1, hiddenSize: 8, kvHeads: 1, headDim: 8 }
  rl: { groupSize: 2, rolloutBatchSize: 8, trainBatchSize: 8, maxStaleness: 1, steps: 12, trainMfu: 0.5 }
  tasks:
    - { name: t, environment: calculator, share: 1.0, maxTurns: 2, promptTokens: 1000, actionTokens: 100,
        observationTokens: 10, contextLimit: 4096, envStepMs: 1000, reward: r }
  rewards:
    - { name: r, runsOn: serverless, pool: fn, function: exact_match, latencyMs: 500 }
  network: { crossPoolGBps: 25 }
  catalog:
    gpus:
      - { name: T1, bf16DenseTflops: 1000, memoryGb: 100, memoryBandwidthGBps: 1000,
          interconnectGBps: 100, pricePerHourUsd: 1, source: test }
  pools:
    - { name: gen, gpu: T1, count: 2, roles: [generate] }
    - { name: train, gpu: T1, count: 1, roles: [train] }
    - { name: envs, cpu: c7i.8xlarge, count: 1 }
    - { name: fn, serverless: aws-lambda, concurrency: 16 }
"#;

const ATTRIBUTION: &str = "Traces & samples <test>";

fn runs() -> (JobSpec, Vec<(String, RunResult)>) {
    let job = rollfleet_spec::parse_job(JOB.as_bytes(), "small.yaml").unwrap();
    let spec = job.spec().clone();
    let runs = [Baseline::OneStepOff, Baseline::Rollfleet]
        .into_iter()
        .map(|baseline| {
            let (placement, policy) = baseline
                .setup(&spec, &job.catalog, &workload_means(&spec))
                .unwrap();
            let run = simulate(
                &spec,
                &job.catalog,
                placement,
                policy,
                &SimOptions::default(),
                &mut |_, _| {},
            )
            .unwrap();
            (baseline.name().to_owned(), run)
        })
        .collect();
    (spec, runs)
}

fn draw(spec: &JobSpec, runs: &[(String, RunResult)]) -> String {
    let refs: Vec<(String, &RunResult)> = runs.iter().map(|(n, r)| (n.clone(), r)).collect();
    svg::timeline("small", spec, &refs, Some(ATTRIBUTION))
}

type Attrs = Vec<(String, String)>;

/// One element of the drawing, with the attributes it inherits from its enclosing groups.
#[derive(Debug)]
struct Element {
    name: String,
    attrs: Vec<(String, String)>,
    inherited: Vec<(String, String)>,
    text: String,
    in_defs: bool,
}

impl Element {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .iter()
            .chain(self.inherited.iter().rev())
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn num(&self, key: &str) -> Option<f64> {
        self.attr(key).map(|v| v.parse().unwrap())
    }
}

fn attributes(tag: &str) -> Vec<(String, String)> {
    let mut attrs = Vec::new();
    let mut rest = tag;
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim().to_owned();
        let value_end = rest[eq + 2..]
            .find('"')
            .expect("an unterminated attribute value");
        let value = rest[eq + 2..eq + 2 + value_end].to_owned();
        assert!(
            !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
            "a malformed attribute name {key:?} in <{tag}>"
        );
        attrs.push((key, value));
        rest = &rest[eq + 2 + value_end + 1..];
    }
    assert!(rest.trim().is_empty(), "stray text {rest:?} in a tag");
    attrs
}

/// Parses the subset of XML the timeline writes, panicking on anything malformed: unbalanced
/// or mismatched tags, unquoted attributes, a bare `&` or `<` in text.
fn parse(svg: &str) -> Vec<Element> {
    let mut elements: Vec<Element> = Vec::new();
    // Open elements: name, own attributes (for their children to inherit), index in `elements`.
    let mut open: Vec<(String, Attrs, usize)> = Vec::new();
    let mut rest = svg;
    let mut roots = 0;
    while let Some(start) = rest.find('<') {
        let text = &rest[..start];
        assert!(!text.contains('>'), "a bare '>' in text {text:?}");
        for (i, _) in text.match_indices('&') {
            let entity = &text[i..];
            assert!(
                ["&amp;", "&lt;", "&gt;", "&quot;"]
                    .iter()
                    .any(|e| entity.starts_with(e)),
                "a bare '&' in text {text:?}"
            );
        }
        if let Some((_, _, index)) = open.last() {
            elements[*index].text.push_str(text);
        } else {
            assert!(text.trim().is_empty(), "text {text:?} outside the root");
        }
        let end = rest[start..].find('>').expect("an unclosed tag") + start;
        let tag = &rest[start + 1..end];
        assert!(!tag.contains('<'), "a '<' inside tag {tag:?}");
        rest = &rest[end + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            let (opened, _, _) = open.pop().expect("a closing tag with nothing open");
            assert_eq!(opened, name.trim(), "mismatched closing tag");
            continue;
        }
        let self_closing = tag.ends_with('/');
        let tag = tag.trim_end_matches('/');
        let (name, attr_text) = tag.split_once(' ').unwrap_or((tag, ""));
        if open.is_empty() {
            roots += 1;
        }
        let element = Element {
            name: name.to_owned(),
            attrs: attributes(attr_text),
            inherited: open.iter().flat_map(|(_, a, _)| a.clone()).collect(),
            text: String::new(),
            in_defs: open.iter().any(|(n, _, _)| n == "defs"),
        };
        elements.push(element);
        if !self_closing {
            let attrs = elements.last().unwrap().attrs.clone();
            open.push((name.to_owned(), attrs, elements.len() - 1));
        }
    }
    assert!(open.is_empty(), "unclosed elements: {open:?}");
    assert!(rest.trim().is_empty(), "text after the root");
    assert_eq!(roots, 1, "exactly one root element");
    elements
}

fn canvas(elements: &[Element]) -> (f64, f64) {
    let root = &elements[0];
    assert_eq!(root.name, "svg");
    (root.num("width").unwrap(), root.num("height").unwrap())
}

fn texts<'a>(elements: &'a [Element], class: &str) -> Vec<&'a str> {
    elements
        .iter()
        .filter(|e| e.name == "text" && e.attr("class") == Some(class))
        .map(|e| e.text.as_str())
        .collect()
}

#[test]
fn the_timeline_is_well_formed_xml_and_escapes_its_text() {
    let (spec, runs) = runs();
    let drawing = draw(&spec, &runs);
    let elements = parse(&drawing);
    assert!(
        elements
            .iter()
            .any(|e| e.text == "Workload samples: Traces &amp; samples &lt;test&gt;")
    );
}

#[test]
fn the_timeline_has_a_time_axis_scales_step_markers_a_legend_and_a_label_per_panel() {
    let (spec, runs) = runs();
    let elements = parse(&draw(&spec, &runs));

    // One time axis per panel, with the same round tick labels in seconds.
    let axes = elements
        .iter()
        .filter(|e| e.attr("class") == Some("axis") && e.name == "g");
    assert_eq!(axes.count(), runs.len());
    let ticks = texts(&elements, "ticks");
    assert!(ticks.len() >= 3 * runs.len(), "{ticks:?}");
    let per_panel = ticks.len() / runs.len();
    assert_eq!(ticks[0], "0");
    assert_eq!(ticks[..per_panel], ticks[per_panel..2 * per_panel]);
    let values: Vec<f64> = ticks[..per_panel]
        .iter()
        .map(|t| t.parse().unwrap())
        .collect();
    let step = values[1] - values[0];
    assert!(values.windows(2).all(|w| (w[1] - w[0] - step).abs() < 1e-9));
    let mantissa = step / 10f64.powf(step.log10().floor());
    assert!(
        [1.0, 2.0, 5.0].iter().any(|m| (mantissa - m).abs() < 1e-9),
        "tick step {step}"
    );
    assert!(elements.iter().any(|e| e.text == "time (s)"));

    // A 0/50/100% scale on every band.
    let bands = spec.pools.len() * runs.len();
    for mark in ["0%", "50%", "100%"] {
        assert_eq!(elements.iter().filter(|e| e.text == mark).count(), bands);
    }
    let band_rects = elements.iter().filter(|e| e.attr("class") == Some("band"));
    assert_eq!(band_rects.count(), bands);

    // A marker per published version, and step labels.
    let steps: usize = runs.iter().map(|(_, r)| r.publish_times_s.len()).sum();
    let markers = elements
        .iter()
        .filter(|e| e.name == "line" && e.attr("class") == Some("steps"));
    assert_eq!(markers.count(), steps);
    assert!(!texts(&elements, "step-label").is_empty());

    // A legend entry per role the pools play, and every pool labelled with its role.
    let legend = texts(&elements, "legend");
    for role in [
        "generate (prefill + decode)",
        "train",
        "environment",
        "reward",
    ] {
        assert!(legend.contains(&role), "{role} missing from {legend:?}");
    }
    for pool in ["gen", "train", "envs", "fn"] {
        assert_eq!(
            texts(&elements, "pool")
                .iter()
                .filter(|t| **t == pool)
                .count(),
            runs.len()
        );
    }

    // Every panel names its policy.
    let panels = texts(&elements, "panel");
    assert_eq!(panels.len(), runs.len());
    for ((name, _), title) in runs.iter().zip(&panels) {
        assert!(title.starts_with(&format!("{name}: ")), "{title}");
    }
}

/// The least and greatest x a text may cover, by the estimate the drawing lays text out with.
fn text_extent(e: &Element) -> (f64, f64) {
    let x = e.num("x").unwrap();
    let width = e.text.chars().count() as f64 * e.num("font-size").unwrap() * 0.6;
    match e.attr("text-anchor").unwrap_or("start") {
        "end" => (x - width, x),
        "middle" => (x - width / 2.0, x + width / 2.0),
        _ => (x, x + width),
    }
}

#[test]
fn every_element_of_the_timeline_stays_within_its_canvas() {
    let (spec, runs) = runs();
    let elements = parse(&draw(&spec, &runs));
    let (width, height) = canvas(&elements);
    let inside = |x: f64, y: f64, what: &str| {
        assert!(
            (0.0..=width).contains(&x) && (0.0..=height).contains(&y),
            "{what} at ({x}, {y}) outside the {width} x {height} canvas"
        );
    };
    for e in elements.iter().filter(|e| !e.in_defs) {
        match e.name.as_str() {
            "rect" => {
                let (x, y) = (e.num("x").unwrap(), e.num("y").unwrap());
                inside(x, y, "a rect");
                inside(
                    x + e.num("width").unwrap(),
                    y + e.num("height").unwrap(),
                    "a rect",
                );
            }
            "line" => {
                inside(e.num("x1").unwrap(), e.num("y1").unwrap(), "a line");
                inside(e.num("x2").unwrap(), e.num("y2").unwrap(), "a line");
            }
            "path" => {
                let numbers: Vec<f64> = e
                    .attr("d")
                    .unwrap()
                    .split(|c: char| c.is_ascii_alphabetic() || c == ',' || c == ' ')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse().unwrap())
                    .collect();
                assert!(!numbers.is_empty() && numbers.len().is_multiple_of(2));
                for xy in numbers.chunks(2) {
                    inside(xy[0], xy[1], "a path point");
                }
            }
            "text" => {
                let (left, right) = text_extent(e);
                let y = e.num("y").unwrap();
                let size = e.num("font-size").unwrap();
                inside(left, y - size, &format!("text {:?}", e.text));
                inside(right, y + 0.25 * size, &format!("text {:?}", e.text));
            }
            _ => {}
        }
    }
}

#[test]
fn the_same_runs_draw_the_same_bytes() {
    let (spec, runs) = runs();
    assert_eq!(draw(&spec, &runs), draw(&spec, &runs));
}

/// Pixels of `pixmap` in a rectangle of the drawing, as RGB.
fn pixels(pixmap: &resvg::tiny_skia::Pixmap, x: f64, y: f64, w: f64, h: f64) -> Vec<[u8; 3]> {
    let mut out = Vec::new();
    for py in y.ceil() as u32..(y + h).floor() as u32 {
        for px in x.ceil() as u32..(x + w).floor() as u32 {
            let p = pixmap.pixel(px, py).unwrap();
            out.push([p.red(), p.green(), p.blue()]);
        }
    }
    out
}

fn rgb(hex: &str) -> [u8; 3] {
    let v = u32::from_str_radix(hex.trim_start_matches('#'), 16).unwrap();
    [(v >> 16) as u8, (v >> 8) as u8, v as u8]
}

#[test]
fn the_rendered_png_has_the_canvas_size_and_draws_every_band_and_axis() {
    let (spec, runs) = runs();
    let drawing = draw(&spec, &runs);
    let elements = parse(&drawing);
    let (width, height) = canvas(&elements);

    let tree = resvg::usvg::Tree::from_str(&drawing, &resvg::usvg::Options::default()).unwrap();
    let size = tree.size().to_int_size();
    let mut pixmap = resvg::tiny_skia::Pixmap::new(size.width(), size.height()).unwrap();
    resvg::render(
        &tree,
        resvg::tiny_skia::Transform::default(),
        &mut pixmap.as_mut(),
    );
    let png = pixmap.encode_png().unwrap();
    let image = resvg::tiny_skia::Pixmap::decode_png(&png).unwrap();
    assert_eq!(
        (image.width() as f64, image.height() as f64),
        (width, height)
    );

    // Every band shows its background, and the busy ones the colour of their role.
    let usage: Vec<&Element> = elements
        .iter()
        .filter(|e| e.attr("class") == Some("usage"))
        .collect();
    let bands: Vec<&Element> = elements
        .iter()
        .filter(|e| e.attr("class") == Some("band"))
        .collect();
    assert!(
        usage.len() >= 2 * runs.len(),
        "most pools are busy in every run"
    );
    for band in &bands {
        let (x, y) = (band.num("x").unwrap(), band.num("y").unwrap());
        let (w, h) = (band.num("width").unwrap(), band.num("height").unwrap());
        let inside = pixels(&image, x, y, w, h);
        let background = rgb(band.attr("fill").unwrap());
        assert!(inside.contains(&background), "band at y={y} not drawn");
        let fill = usage
            .iter()
            .find(|u| {
                let d = u.attr("d").unwrap();
                d.split(' ')
                    .any(|xy| xy.ends_with(&format!(",{:.1}", y + h)))
            })
            .and_then(|u| u.attr("fill"));
        if let Some(colour) = fill.filter(|f| f.starts_with('#')) {
            let colour = rgb(colour);
            let count = inside.iter().filter(|p| **p == colour).count();
            assert!(count > 0, "no pixel of {colour:?} in the band at y={y}");
        }
    }

    // Every axis line is drawn in dark ink across the plot.
    for axis in elements
        .iter()
        .filter(|e| e.name == "line" && e.attr("class") == Some("axis"))
        .filter(|e| e.num("y1") == e.num("y2"))
    {
        let (x1, x2, y) = (
            axis.num("x1").unwrap(),
            axis.num("x2").unwrap(),
            axis.num("y1").unwrap(),
        );
        let row = pixels(&image, x1, y - 1.0, x2 - x1, 2.0);
        let dark = row.iter().filter(|p| p.iter().all(|c| *c < 128)).count();
        assert!(
            dark as f64 >= 0.9 * (x2 - x1).floor(),
            "the axis at y={y} is not drawn"
        );
    }
}
