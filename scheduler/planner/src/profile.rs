//! Profiles from three sources, merged with a stated precedence: **probed** on the node beats
//! **measured** online, which beats the **model** (the roofline at assumed efficiencies).
//!
//! What a profile records is an achieved share of a GPU product's peak: of its FLOP/s for
//! compute-bound work (prefill, training), of its HBM bandwidth for bandwidth-bound work (decode).
//! That is the one number the roofline needs per (work kind, hardware) to turn FLOPs and bytes
//! into seconds, and it carries over between shapes of the same work.
//!
//! - **Measured**: every report of a stage (its FLOPs, bytes and seconds on a pool) becomes a
//!   sample `roofline time at peak / seconds`; each (work kind, pool) keeps the last
//!   [`WINDOW`] samples and answers with their median and median absolute deviation (robust to
//!   the odd stalled or preempted stage), and is used instead of the model once it has
//!   [`MIN_SAMPLES`].
//! - **Probed**: a GEMM and a device-to-device copy on the node (`rollfleet-gpu`), giving a
//!   product's achieved FLOP/s and bandwidth; on a machine without a GPU there is no probe and no
//!   number.
//!
//! A [`ProfileStore`] is plain data (serde), saved and loaded as JSON by `rollfleet profile
//! export|import`, so measurements survive restarts and can be shared. Deterministic: windows are
//! `VecDeque`s in arrival order, maps are `BTreeMap`s.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::roofline::{Efficiency, WorkKind};

/// Samples a measured estimate keeps (the most recent).
pub const WINDOW: usize = 256;

/// Samples a measured estimate needs before it replaces the model.
pub const MIN_SAMPLES: usize = 20;

/// The longest environment step or reward a measured duration may say: a day is no step of an
/// RL rollout, only a unit mistake or a broken clock.
pub const MAX_TIMED_SECONDS: f64 = 86_400.0;

/// Where a figure comes from, in increasing precedence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    /// The roofline at the planner's assumed efficiencies.
    Model,
    /// Robust running estimate of stage reports.
    Measured,
    /// Probed on the node.
    Probed,
}

/// What produced a measured duration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// A real GPU.
    Hardware,
    /// An emulated engine or the simulator: the duration is the roofline model's own, so a
    /// profile built from it only shows that the plumbing works.
    Modelled,
}

/// A robust running estimate of an achieved share of peak.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// The most recent samples, oldest first.
    pub samples: VecDeque<f64>,
    /// Samples ever added (including those that left the window).
    pub total: u64,
    /// Of `total`, the samples that came from emulated or simulated hardware
    /// ([`Origin::Modelled`]).
    #[serde(default)]
    pub modelled: u64,
    /// The sum of every sample ever added (for [`Estimate::lifetime_mean`]).
    #[serde(default)]
    pub sum: f64,
}

impl Estimate {
    /// Adds a sample; non-finite or non-positive ones are ignored.
    pub fn add(&mut self, value: f64, origin: Origin) {
        if !(value.is_finite() && value > 0.0) {
            return;
        }
        if origin == Origin::Modelled {
            self.modelled += 1;
        }
        if self.samples.len() == WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back(value);
        self.total += 1;
        self.sum += value;
    }

    /// Adds one measured duration of `work` of `kind` on hardware of the given peaks, as the
    /// share of its resource's peak it achieved (what [`ProfileStore::record`] does for its kind
    /// and pool). Durations that are not finite and positive are ignored, and so is work the other
    /// resource bounds at the model's shares of peak: a prefill or training pass limited by
    /// memory bandwidth says nothing of the share of FLOP/s the estimate is of (it would read
    /// as the bandwidth share), nor a decode step limited by compute of the bandwidth share.
    /// (The model's shares, not the peaks, draw the line: work just past the ridge point at
    /// peak is still bound by compute once compute reaches a smaller share of its peak.) A
    /// duration shorter than the work takes at peak is ignored too.
    pub fn add_measured(
        &mut self,
        kind: WorkKind,
        work: crate::roofline::Work,
        peak_flops: f64,
        peak_bandwidth: f64,
        seconds: f64,
        origin: Origin,
    ) {
        if !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        let model = Efficiency::default();
        let compute_bound = work.flops / (peak_flops * model.compute)
            >= work.bytes / (peak_bandwidth * model.bandwidth);
        let bound_by_its_resource = match kind {
            WorkKind::Prefill | WorkKind::Train => compute_bound,
            WorkKind::Decode => !compute_bound,
            WorkKind::WeightTransfer => true,
        };
        if !bound_by_its_resource {
            return;
        }
        let at_peak = work.seconds(peak_flops, peak_bandwidth);
        // Faster than peak is no measurement of the hardware but a clock or accounting error.
        if at_peak > seconds {
            return;
        }
        // The share of the resource the estimate is of: FLOP/s for prefill and training, bytes/s
        // for decode (near the ridge point the other roof can be the higher one at peak).
        let own = match kind {
            WorkKind::Prefill | WorkKind::Train => work.flops / peak_flops,
            WorkKind::Decode => work.bytes / peak_bandwidth,
            WorkKind::WeightTransfer => at_peak,
        };
        self.add(own / seconds, origin);
    }

    /// Whether any of its samples came from emulated or simulated hardware.
    pub fn modelled(&self) -> bool {
        self.modelled > 0
    }

    /// The median of the window.
    pub fn median(&self) -> Option<f64> {
        median(self.samples.iter().copied().collect())
    }

    /// The mean of every sample ever added. The planner's workload model takes means of
    /// durations (a heavy tail included, which a median leaves out), and the mean of a window of
    /// a heavy-tailed duration is far off (a lognormal step with a p99 ten times its median,
    /// mean 0.490 s: 0.606 s over the last 256 of a run, 0.489 s over all 49,544): this one
    /// settles as samples come.
    pub fn lifetime_mean(&self) -> Option<f64> {
        (self.total > 0).then(|| self.sum / self.total as f64)
    }

    /// The median absolute deviation from the median (the spread).
    pub fn mad(&self) -> Option<f64> {
        let m = self.median()?;
        median(self.samples.iter().map(|v| (v - m).abs()).collect())
    }

    /// Whether there are enough samples to trust it.
    pub fn ready(&self) -> bool {
        self.samples.len() >= MIN_SAMPLES
    }

    /// Adds one measured duration of an environment step or a reward, in seconds. Durations
    /// that are not finite, negative or longer than [`MAX_TIMED_SECONDS`] are ignored; zero is a
    /// duration (a reward computed in the environment step), kept as the smallest positive one,
    /// since [`Estimate::add`] keeps positive values only.
    pub fn add_seconds(&mut self, seconds: f64, origin: Origin) {
        if seconds.is_finite() && (0.0..=MAX_TIMED_SECONDS).contains(&seconds) {
            self.add(seconds.max(f64::MIN_POSITIVE), origin);
        }
    }

    /// Takes in another estimate of the same thing (another run's, from a file): its window
    /// after this one's (the most recent [`WINDOW`] kept), and its counts and sum.
    pub fn absorb(&mut self, other: &Estimate) {
        for &v in &other.samples {
            if self.samples.len() == WINDOW {
                self.samples.pop_front();
            }
            self.samples.push_back(v);
        }
        self.total += other.total;
        self.modelled += other.modelled;
        self.sum += other.sum;
    }

    /// Forgets the window (the hardware changed under it: its samples describe what was), so
    /// that the estimate is the model's again until [`MIN_SAMPLES`] new ones are in. The counts
    /// of samples ever added stay.
    pub fn restart(&mut self) {
        self.samples.clear();
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// What a probe measured for a GPU product.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Probed {
    /// Achieved dense BF16 GEMM FLOP/s per GPU.
    pub gemm_flops: f64,
    /// Achieved device-memory bytes/s per GPU.
    pub memory_bandwidth_bytes_per_s: f64,
}

/// Measured and probed profiles.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProfileStore {
    /// Measured shares of peak, per work kind and pool name.
    #[serde(default)]
    pub measured: BTreeMap<WorkKind, BTreeMap<String, Estimate>>,
    /// Probed rates, per GPU product (catalogue name).
    #[serde(default)]
    pub probed: BTreeMap<String, Probed>,
    /// Measured seconds of one environment step, per task (by name).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub environment_steps: BTreeMap<String, Estimate>,
    /// Measured seconds of one reward, per reward function (by the job's name for it).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rewards: BTreeMap<String, Estimate>,
}

/// Work whose duration is measured in seconds rather than as a share of a GPU's peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timed {
    /// One environment step of a task.
    EnvironmentStep,
    /// One reward of a reward function.
    Reward,
}

/// One effective figure and its source.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Effective {
    /// The achieved share of peak.
    pub share: f64,
    /// Where it comes from.
    pub source: Source,
    /// Its spread (median absolute deviation), for a measured figure.
    pub spread: Option<f64>,
    /// Samples behind it, for a measured figure.
    pub samples: usize,
    /// Whether a measured figure came (at least in part) from emulated or simulated hardware.
    pub modelled: bool,
}

impl Effective {
    /// Its source as users read it: `model`, `probed`, `measured`, or `measured (emulated or
    /// simulated)` when the samples were the roofline model's own durations.
    pub fn label(&self) -> &'static str {
        match (self.source, self.modelled) {
            (Source::Model, _) => "model",
            (Source::Probed, _) => "probed",
            (Source::Measured, false) => "measured",
            (Source::Measured, true) => "measured (emulated or simulated)",
        }
    }
}

impl ProfileStore {
    /// Records a stage that did `flops` and moved `bytes` on pool `pool` (of a GPU product with
    /// the given peaks, per replica) in `seconds`, on hardware of the given `origin`.
    // One sample's own figures; a struct for them would only be unpacked again here.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &mut self,
        kind: WorkKind,
        pool: &str,
        work: crate::roofline::Work,
        peak_flops: f64,
        peak_bandwidth: f64,
        seconds: f64,
        origin: Origin,
    ) {
        if !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        self.measured
            .entry(kind)
            .or_default()
            .entry(pool.to_owned())
            .or_default()
            .add_measured(kind, work, peak_flops, peak_bandwidth, seconds, origin);
    }

    /// Records one measured duration of an environment step of task `name`, or of a reward of
    /// reward function `name` ([`Estimate::add_seconds`]).
    pub fn record_timed(&mut self, what: Timed, name: &str, seconds: f64, origin: Origin) {
        // Checked here too, so that a refused duration leaves no empty entry behind.
        if !(seconds.is_finite() && (0.0..=MAX_TIMED_SECONDS).contains(&seconds)) {
            return;
        }
        let map = match what {
            Timed::EnvironmentStep => &mut self.environment_steps,
            Timed::Reward => &mut self.rewards,
        };
        map.entry(name.to_owned())
            .or_default()
            .add_seconds(seconds, origin);
    }

    /// The measured mean seconds of `what` named `name` (over every sample), once it has
    /// [`MIN_SAMPLES`].
    pub fn timed_mean(&self, what: Timed, name: &str) -> Option<f64> {
        let map = match what {
            Timed::EnvironmentStep => &self.environment_steps,
            Timed::Reward => &self.rewards,
        };
        map.get(name)
            .filter(|e| e.ready())
            .and_then(Estimate::lifetime_mean)
    }

    /// Forgets the measured window of `kind` on `pool` ([`Estimate::restart`]).
    pub fn restart(&mut self, kind: WorkKind, pool: &str) {
        if let Some(e) = self.measured.get_mut(&kind).and_then(|m| m.get_mut(pool)) {
            e.restart();
        }
    }

    /// Whether `kind` on `pool` has enough measured samples to replace the model.
    pub fn measured_ready(&self, kind: WorkKind, pool: &str) -> bool {
        self.measured
            .get(&kind)
            .and_then(|m| m.get(pool))
            .is_some_and(Estimate::ready)
    }

    /// The share of peak to use for `kind` on `pool` (a `gpu` product with the given peaks):
    /// probed, else measured once ready, else the model.
    pub fn effective(
        &self,
        kind: WorkKind,
        pool: &str,
        gpu: &str,
        peak_flops: f64,
        peak_bandwidth: f64,
        model: &Efficiency,
    ) -> Effective {
        let compute = matches!(kind, WorkKind::Prefill | WorkKind::Train);
        if let Some(p) = self.probed.get(gpu) {
            let share = if compute {
                p.gemm_flops / peak_flops.max(1e-30)
            } else {
                p.memory_bandwidth_bytes_per_s / peak_bandwidth.max(1e-30)
            };
            if share.is_finite() && share > 0.0 {
                return Effective {
                    share,
                    source: Source::Probed,
                    spread: None,
                    samples: 0,
                    modelled: false,
                };
            }
        }
        if let Some(e) = self.measured.get(&kind).and_then(|m| m.get(pool))
            && e.ready()
            && let Some(share) = e.median()
        {
            return Effective {
                share,
                source: Source::Measured,
                spread: e.mad(),
                samples: e.samples.len(),
                modelled: e.modelled(),
            };
        }
        Effective {
            share: if compute {
                model.compute
            } else {
                model.bandwidth
            },
            source: Source::Model,
            spread: None,
            samples: 0,
            modelled: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::roofline::Work;

    #[test]
    fn the_estimate_is_the_median_and_ignores_an_outlier() {
        let mut e = Estimate::default();
        for v in [0.5, 0.52, 0.48, 0.51, 0.49] {
            e.add(v, Origin::Hardware);
        }
        // A stage stalled by preemption: 100x slower.
        e.add(0.005, Origin::Hardware);
        // Sorted: 0.005 0.48 0.49 0.5 0.51 0.52 -> median (0.49 + 0.5) / 2 = 0.495.
        assert!((e.median().unwrap() - 0.495).abs() < 1e-12);
        // Deviations: 0.49 0.015 0.005 0.005 0.015 0.025 -> sorted 0.005 0.005 0.015 0.015
        // 0.025 0.49 -> MAD 0.015.
        assert!((e.mad().unwrap() - 0.015).abs() < 1e-12);
    }

    #[test]
    fn the_window_keeps_only_the_latest_samples() {
        let mut e = Estimate::default();
        for i in 0..(WINDOW + 10) {
            e.add(if i < 10 { 100.0 } else { 1.0 }, Origin::Hardware);
        }
        assert_eq!(e.samples.len(), WINDOW);
        assert_eq!(e.total, (WINDOW + 10) as u64);
        assert_eq!(e.median(), Some(1.0));
    }

    #[test]
    fn probed_beats_measured_which_beats_the_model_once_it_has_enough_samples() {
        let model = Efficiency::default();
        let mut store = ProfileStore::default();
        // Decode of 1 GB at 1 TB/s peak takes 1 ms at peak; measured 1.25 ms: 80% of peak.
        let work = Work {
            flops: 0.0,
            bytes: 1e9,
        };
        let sample = |store: &mut ProfileStore| {
            store.record(
                WorkKind::Decode,
                "h20",
                work,
                1e15,
                1e12,
                1.25e-3 / 0.9,
                Origin::Hardware,
            )
        };
        for _ in 0..(MIN_SAMPLES - 1) {
            sample(&mut store);
        }
        let e = store.effective(WorkKind::Decode, "h20", "H20", 1e15, 1e12, &model);
        assert_eq!(e.source, Source::Model);
        assert_eq!(e.share, model.bandwidth);
        sample(&mut store);
        let e = store.effective(WorkKind::Decode, "h20", "H20", 1e15, 1e12, &model);
        assert_eq!(e.source, Source::Measured);
        assert!((e.share - 0.72).abs() < 1e-9, "{}", e.share);
        store.probed.insert(
            "H20".into(),
            Probed {
                gemm_flops: 0.5e15,
                memory_bandwidth_bytes_per_s: 0.9e12,
            },
        );
        let e = store.effective(WorkKind::Decode, "h20", "H20", 1e15, 1e12, &model);
        assert_eq!(e.source, Source::Probed);
        assert!((e.share - 0.9).abs() < 1e-12);
        let e = store.effective(WorkKind::Prefill, "h20", "H20", 1e15, 1e12, &model);
        assert!((e.share - 0.5).abs() < 1e-12);
    }

    #[test]
    fn work_bound_by_the_other_resource_says_nothing_of_the_share_an_estimate_is_of() {
        let model = Efficiency::default();
        let mut store = ProfileStore::default();
        // A short prefill on a 1 PFLOP/s, 1 TB/s GPU: 1 ms of weights to read, 0.2 ms of FLOPs.
        // Measured at 80% of the bandwidth, it would read as 80% of the FLOP/s.
        let short = Work {
            flops: 0.2e12,
            bytes: 1e9,
        };
        // A long one: 10 ms of FLOPs against 1 ms of bytes, measured at 60% of the FLOP/s.
        let long = Work {
            flops: 10e12,
            bytes: 1e9,
        };
        // A decode step of a huge batch, bound by compute, and a plain one bound by bandwidth.
        let crowded = Work {
            flops: 2e12,
            bytes: 1e9,
        };
        let plain = Work {
            flops: 1e9,
            bytes: 1e9,
        };
        for _ in 0..MIN_SAMPLES {
            let h = Origin::Hardware;
            store.record(WorkKind::Prefill, "p", short, 1e15, 1e12, 1e-3 / 0.8, h);
            store.record(WorkKind::Decode, "d", crowded, 1e15, 1e12, 2e-3 / 0.5, h);
        }
        let e = store.effective(WorkKind::Prefill, "p", "H800", 1e15, 1e12, &model);
        assert_eq!((e.source, e.share), (Source::Model, model.compute));
        let e = store.effective(WorkKind::Decode, "d", "H20", 1e15, 1e12, &model);
        assert_eq!((e.source, e.share), (Source::Model, model.bandwidth));
        for _ in 0..MIN_SAMPLES {
            let h = Origin::Hardware;
            store.record(WorkKind::Prefill, "p", long, 1e15, 1e12, 10e-3 / 0.6, h);
            store.record(WorkKind::Decode, "d", plain, 1e15, 1e12, 1e-3 / 0.7, h);
        }
        let e = store.effective(WorkKind::Prefill, "p", "H800", 1e15, 1e12, &model);
        assert_eq!(e.source, Source::Measured);
        assert!((e.share - 0.6).abs() < 1e-12, "{}", e.share);
        let e = store.effective(WorkKind::Decode, "d", "H20", 1e15, 1e12, &model);
        assert!((e.share - 0.7).abs() < 1e-12, "{}", e.share);
        // Faster than the peak allows: no measurement at all.
        let before = store.measured[&WorkKind::Decode]["d"].total;
        store.record(
            WorkKind::Decode,
            "d",
            plain,
            1e15,
            1e12,
            0.5e-3,
            Origin::Hardware,
        );
        assert_eq!(store.measured[&WorkKind::Decode]["d"].total, before);
    }

    #[test]
    fn a_store_survives_a_round_trip_through_json() {
        let mut store = ProfileStore::default();
        let work = Work {
            flops: 1e12,
            bytes: 1e9,
        };
        for i in 0..30 {
            store.record(
                WorkKind::Prefill,
                "h800",
                work,
                1e15,
                1e12,
                2e-3 + i as f64 * 1e-5,
                if i % 2 == 0 {
                    Origin::Hardware
                } else {
                    Origin::Modelled
                },
            );
        }
        let json = serde_json::to_string(&store).unwrap();
        let back: ProfileStore = serde_json::from_str(&json).unwrap();
        // JSON keeps 17 significant digits; the last bit of a sample may differ.
        let (a, b) = (
            &store.measured[&WorkKind::Prefill]["h800"],
            &back.measured[&WorkKind::Prefill]["h800"],
        );
        assert_eq!(a.total, b.total);
        assert_eq!((a.modelled, b.modelled), (15, 15));
        assert_eq!(a.samples.len(), b.samples.len());
        for (x, y) in a.samples.iter().zip(&b.samples) {
            assert!((x - y).abs() <= 1e-15 * x.abs(), "{x} {y}");
        }
        assert_eq!(back.probed, store.probed);
    }

    #[test]
    fn a_figure_measured_on_emulated_hardware_says_so() {
        let model = Efficiency::default();
        let work = Work {
            flops: 0.0,
            bytes: 1e9,
        };
        let store_of = |origin: Origin| {
            let mut store = ProfileStore::default();
            for _ in 0..MIN_SAMPLES {
                store.record(WorkKind::Decode, "h20", work, 1e15, 1e12, 1.25e-3, origin);
            }
            store
        };
        let (real, emulated) = (store_of(Origin::Hardware), store_of(Origin::Modelled));
        let real = real.effective(WorkKind::Decode, "h20", "H20", 1e15, 1e12, &model);
        let emulated = emulated.effective(WorkKind::Decode, "h20", "H20", 1e15, 1e12, &model);
        assert_eq!((real.source, real.modelled), (Source::Measured, false));
        assert_eq!(
            (emulated.source, emulated.modelled),
            (Source::Measured, true)
        );
        assert!((real.share - 0.8).abs() < 1e-12 && (emulated.share - 0.8).abs() < 1e-12);
    }
}
