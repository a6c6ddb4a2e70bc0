//! The prediction's tests: each model piece against hand-computed figures, and the whole
//! prediction on small problems.

use super::model::{
    EarlyRestart, Holding, IterationTimes, Release, SlotLife, action_spread, closed_loop_step,
    drain_wait, expected_max_z, held_occupancy, iteration_time, job_average, mean_survival,
    push_slot_lives, queue, regeneration, replica_occupancy, routed, skewed_expected_max,
    token_time, trainer_done,
};
use super::prefill::{
    Backlog, CaughtTurn, Prefills, compute_left_by_decoding, prefill_queue, refill_backlog,
    refill_backlogs, refill_moments,
};
use super::*;
use rollfleet_spec::WeightReads;

/// A dense model of 1 GB of weights.
fn gb() -> WeightReads {
    WeightReads::dense(1e9)
}

fn kind(replicas: f64, bandwidth: f64) -> DecodeKind {
    DecodeKind {
        replicas,
        bandwidth,
        flops: 1e18,
        cap: 1e9,
        weight: 1.0,
    }
}

/// What one replica of `k` runs at with `alive` trajectories and `other` seconds of other
/// work per token, as `routed` evaluates it.
fn occupancy(k: &DecodeKind, alive: f64, other: f64, reads: &WeightReads) -> Occupancy {
    replica_occupancy(alive, other, &IterationTimes::new(k, reads, 1e6, 1.0))
}

/// 1 GB shared, 64 experts of 0.1 GB, 4 per token.
fn moe_reads() -> WeightReads {
    WeightReads {
        shared_bytes: 1e9,
        expert_bytes: 1e8,
        experts: 64.0,
        experts_per_token: 4.0,
    }
}

#[test]
fn a_moe_replica_decodes_at_the_time_of_reading_the_experts_its_batch_routes_to() {
    // 1 MB of KV per sequence, 100 sequences always decoding: the iteration reads
    // 1e9 + 1e8 x 64 (1 - (60/64)^100) bytes plus 100 MB of KV at 1 TB/s, the simulator's
    // formula.
    let reads = moe_reads();
    let tau = occupancy(&kind(1.0, 1e12), 100.0, 0.0, &reads).tau;
    let expected = (reads.bytes(100.0) + 100.0 * 1e6) / 1e12;
    assert!((tau - expected).abs() < 1e-12, "{tau} vs {expected}");
    // More than the active weights (1.4 GB) alone would take, less than all (7.4 GB).
    assert!(tau > (1.4e9 + 1e8) / 1e12 && tau < (7.4e9 + 1e8) / 1e12);
    // The capacity search reaches the same per-token time for the rate those 100 make.
    let rate = 100.0 / tau;
    let solved = token_time(&[kind(1.0, 1e12)], rate, &reads, 1e6, 1.0).unwrap();
    assert!((solved - tau).abs() < 1e-6 * tau, "{solved} vs {tau}");
}

#[test]
fn two_trajectories_share_a_replica_as_the_product_form_gives_by_hand() {
    // P(0) : P(1) : P(2) = 1 : 2 t1 / o : t1 t2 / o^2, so E[b] / throughput is
    // t1 (o + t2) / (o + t1): a token decoded alone most of the time, with the other
    // sequence's share of the time at the batch of two.
    let reads = moe_reads();
    let k = kind(1.0, 1e12);
    let (t1, t2) = (
        iteration_time(&k, 1.0, &reads, 1e6, 1.0),
        iteration_time(&k, 2.0, &reads, 1e6, 1.0),
    );
    let o = 2e-3;
    let got = occupancy(&k, 2.0, o, &reads);
    let hand = t1 * (o + t2) / (o + t1);
    assert!((got.tau - hand).abs() < 1e-15, "{got:?} vs {hand}");
    let z = 1.0 + 2.0 * t1 / o + t1 * t2 / (o * o);
    let batch = (2.0 * t1 / o + 2.0 * t1 * t2 / (o * o)) / z;
    assert!((got.batch - batch).abs() < 1e-12, "{got:?} vs {batch}");
    // Little's law at the rest of the loop: the two not decoding make tokens at 1 / o each.
    assert!((got.tokens_per_s - (2.0 - got.batch) / o).abs() < 1e-6 * got.tokens_per_s);
}

#[test]
fn a_moe_token_sees_a_larger_batch_than_the_mean_so_it_waits_longer_than_the_mean_field_says() {
    // 200 trajectories, 100 ms of other work per token: a batch of about six that varies,
    // and each extra sequence reads about four more experts, so the busy states are the
    // slow ones and a token spends its time in them.
    let reads = moe_reads();
    let k = kind(1.0, 1e12);
    let got = occupancy(&k, 200.0, 100e-3, &reads);
    let at_mean = iteration_time(&k, got.batch, &reads, 1e6, 1.0);
    // About 5% here: 3.35 ms against 3.20 at a mean batch of 6.5.
    assert!(got.tau > 1.03 * at_mean, "{got:?} against {at_mean}");
    // Nor can it beat a lone sequence's time, or the time of every trajectory at once.
    assert!(got.tau > iteration_time(&k, 1.0, &reads, 1e6, 1.0));
    assert!(got.tau < iteration_time(&k, 200.0, &reads, 1e6, 1.0));
}

#[test]
fn a_replica_emptied_by_each_update_decodes_at_the_mean_of_its_holdings_from_none_to_twice_its_mean()
 {
    // Always decoding, a replica holding h sequences makes h / t(h) tokens a second. Refilled
    // after each update, it holds 16 evenly spaced holdings between none and twice the mean
    // of 4 (0.25, 0.75, ..., 7.75) for equal shares of the step: its batch is their mean
    // and its tokens a second theirs.
    let reads = moe_reads();
    let k = kind(1.0, 1e12);
    let times = IterationTimes::new(&k, &reads, 1e6, 1.0);
    let swept = held_occupancy(4.0, 1e9, 0.0, &times, Holding::RefilledEachUpdate);
    let tokens = (0..16)
        .map(|i| {
            let h = 0.25 + 0.5 * i as f64;
            h / iteration_time(&k, h, &reads, 1e6, 1.0)
        })
        .sum::<f64>()
        / 16.0;
    assert!((swept.batch - 4.0).abs() < 1e-9, "{swept:?}");
    assert!(
        (swept.tokens_per_s - tokens).abs() < 1e-9 * tokens,
        "{swept:?} vs {tokens}"
    );
    // A token spends more of its time in the crowded holdings, where each sequence reads
    // more experts: 2.68 ms against 2.46 at a steady 4 (each extra sequence reads about
    // four more of the 64 experts while few are read).
    let steady = held_occupancy(4.0, 1e9, 0.0, &times, Holding::Steady);
    assert!(swept.tau > 1.08 * steady.tau, "{swept:?} vs {steady:?}");
    // Flat per-token time (weights only, no KV, no experts): the sweep changes nothing.
    let weights_only = gb();
    let dense = IterationTimes::new(&k, &weights_only, 0.0, 1.0);
    let (flat, fixed) = (
        held_occupancy(4.0, 1e9, 0.0, &dense, Holding::RefilledEachUpdate),
        held_occupancy(4.0, 1e9, 0.0, &dense, Holding::Steady),
    );
    assert!((flat.tau - fixed.tau).abs() < 1e-12 * fixed.tau, "{flat:?}");
}

#[test]
fn a_replica_near_full_sweeps_only_as_far_as_it_can_hold() {
    // Room for 24: around a mean of 20 it holds from 16 to 24, never more; full, it stays full.
    let reads = moe_reads();
    let k = kind(1.0, 1e12);
    let times = IterationTimes::new(&k, &reads, 1e6, 1.0);
    let swept = held_occupancy(20.0, 24.0, 0.0, &times, Holding::RefilledEachUpdate);
    let tokens = (0..16)
        .map(|i| {
            let h = 16.25 + 0.5 * i as f64;
            h / iteration_time(&k, h, &reads, 1e6, 1.0)
        })
        .sum::<f64>()
        / 16.0;
    assert!(
        (swept.tokens_per_s - tokens).abs() < 1e-9 * tokens,
        "{swept:?} vs {tokens}"
    );
    let full = held_occupancy(30.0, 24.0, 0.0, &times, Holding::RefilledEachUpdate);
    let at_cap = held_occupancy(24.0, 24.0, 0.0, &times, Holding::Steady);
    assert!(
        (full.batch - at_cap.batch).abs() < 1e-9,
        "{full:?} vs {at_cap:?}"
    );
    assert!(
        (full.tau - at_cap.tau).abs() < 1e-12 * at_cap.tau,
        "{full:?} vs {at_cap:?}"
    );
}

#[test]
fn token_time_solves_littles_law_on_decoding_sequences() {
    // One replica, 1 TB/s, 1 GB of weights, 1 MB of KV per sequence. At tau, a batch of
    // (1e12 tau - 1e9) / 1e6 sequences; asked for 1e5 tokens/s, b = 1e5 tau:
    // 1e6 tau - 1e3 = 1e5 tau  =>  tau = 1e3 / 9e5 = 1.111 ms.
    let tau = token_time(&[kind(1.0, 1e12)], 1e5, &gb(), 1e6, 1.0).unwrap();
    assert!((tau - 1e3 / 9e5).abs() < 1e-12, "{tau}");
}

#[test]
fn the_router_fills_replicas_by_room_so_a_slow_one_decodes_its_share_at_its_own_pace() {
    // Equal room, 1 GB of weights, 1 MB of KV per sequence, nothing but decoding. At 100
    // sequences each, the 1 TB/s replica takes (1e9 + 1e8) / 1e12 = 1.1 ms a token and the
    // 0.1 TB/s one 11 ms: 100 / 1.1e-3 + 100 / 1.1e-2 = 100,000 tokens/s, 10/11 of them
    // fast. Token-weighted: 10/11 x 1.1 + 1/11 x 11 = 2 ms (= 200 sequences / 1e5 tokens/s),
    // where water-filling gave the slow replica nothing and 1.11 ms.
    let served = routed(
        &[kind(1.0, 1e12), kind(1.0, 1e11)],
        1e5,
        0.0,
        Holding::Steady,
        &gb(),
        1e6,
        1.0,
    )
    .unwrap();
    assert!((served.tau - 2e-3).abs() < 1e-9, "{served:?}");
    assert!(
        (served.token_share[0] - 10.0 / 11.0).abs() < 1e-6,
        "{served:?}"
    );
    assert!((served.kinds[1].2 - 1.1e-2).abs() < 1e-8, "{served:?}");
    let filled = token_time(&[kind(1.0, 1e12), kind(1.0, 1e11)], 1e5, &gb(), 1e6, 1.0).unwrap();
    assert!((filled - 1e3 / 9e5).abs() < 1e-12, "{filled}");
}

#[test]
fn one_gpu_replicas_that_the_router_still_fills_decode_their_share_far_slower_than_tp8() {
    // 1 GB of weights, 1 MB of KV per sequence. A fast replica (8 TB/s, room for 100 per
    // unit of load) beside a slow pool's eight GPUs at 0.25 TB/s each, either as one TP8
    // replica (2 TB/s, room 100) or as eight TP1 ones (room 5 each: the weights fill their
    // memory). TP8 at load 1: the fast one takes (1e9 + 1e8) / 8e12 = 0.1375 ms a token,
    // the slow one 1.1e9 / 2e12 = 0.55 ms; 100 / 0.1375e-3 + 100 / 0.55e-3 = 909,090.9
    // tokens/s, 200 sequences: 0.22 ms a token on average, 0.8 of the tokens fast.
    let fast = DecodeKind {
        weight: 100.0,
        ..kind(1.0, 8e12)
    };
    let tp8 = DecodeKind {
        weight: 100.0,
        ..kind(1.0, 2e12)
    };
    let rate = 100.0 / 0.1375e-3 + 100.0 / 0.55e-3;
    let a = routed(&[fast, tp8], rate, 0.0, Holding::Steady, &gb(), 1e6, 1.0).unwrap();
    assert!((a.tau - 0.22e-3).abs() < 1e-12, "{a:?}");
    assert!((a.token_share[0] - 0.8).abs() < 1e-9, "{a:?}");
    // Always decoding, a sequence's own KV read is part of its batch's: it sees each
    // replica's time, 0.8 x 0.1375 + 0.2 x 0.55 = 0.22 ms, with a variance of
    // 0.8 x 0.1375^2 + 0.2 x 0.55^2 - 0.22^2 = 0.027225 ms^2.
    let (seen_a, var_a) = a.seen();
    assert!((seen_a - 0.22e-3).abs() < 1e-12, "{seen_a}");
    let hand = 0.8 * 0.1375e-3_f64.powi(2) + 0.2 * 0.55e-3_f64.powi(2) - 0.22e-3_f64.powi(2);
    assert!((var_a - hand).abs() < 1e-18, "{var_a} {hand}");
    // TP1: each replica reads the whole weights at a quarter of that bandwidth, more than
    // 4 ms a token (7.3 times the TP8 replica's pace), and the router still gives them
    // 40 / 140 of the trajectories: the per-token times a group's members see spread out.
    let tp1 = DecodeKind {
        weight: 5.0,
        ..kind(8.0, 0.25e12)
    };
    let b = routed(&[fast, tp1], rate, 0.0, Holding::Steady, &gb(), 1e6, 1.0).unwrap();
    assert!(b.kinds[1].2 > 4e-3, "{b:?}");
    assert!(b.token_share[1] > 0.0, "{b:?}");
    let (_, var_b) = b.seen();
    // 1.4% of the tokens at 4.0 ms: a standard deviation of 0.45 ms against 0.165.
    assert!(var_b.sqrt() > 2.5 * var_a.sqrt(), "{b:?}");
    // Water-filling gave the slow replicas nothing either way.
    let wa = token_time(&[fast, tp8], rate, &gb(), 1e6, 1.0).unwrap();
    let wb = token_time(&[fast, tp1], rate, &gb(), 1e6, 1.0).unwrap();
    assert!(wb <= a.tau && wa <= a.tau, "{wa} {wb}");
}

#[test]
fn a_trajectory_that_is_not_always_decoding_batches_only_while_it_decodes() {
    // 100 trajectories alive on a dense replica (1 GB of weights, 1 MB of KV a sequence,
    // 1 TB/s): with 1 ms of other work per token, about half of them decode at a time, and
    // a token takes about the roofline of that batch (the mean-field fixed point, 1.0512 ms
    // at a batch of 51.25; a dense model's iteration barely grows with its batch, so the
    // batch's spread changes little).
    let k = kind(1.0, 1e12);
    let got = occupancy(&k, 100.0, 1e-3, &gb());
    let mean_field = (1e-4 + 4.01e-6_f64.sqrt()) / 2.0;
    assert!((got.tau - mean_field).abs() < 2e-3 * mean_field, "{got:?}");
    assert!((got.batch - 51.25).abs() < 0.5, "{got:?}");
    // Always decoding, it is the plain roofline of the whole batch.
    let plain = occupancy(&k, 100.0, 0.0, &gb()).tau;
    assert!((plain - 1.1e-3).abs() < 1e-12, "{plain}");
}

#[test]
fn the_router_gives_a_replica_trajectories_in_proportion_to_its_room() {
    // 256 batch slots; 10,000 tokens reserved per trajectory. 2.56 M KV tokens: load
    // 1/256 + 1/256 per trajectory, weight 128; 100,000 KV tokens: 1/256 + 1/10, 9.624.
    assert!((router_weight(256.0, 10_000.0, 2.56e6) - 128.0).abs() < 1e-9);
    let small = router_weight(256.0, 10_000.0, 1e5);
    assert!((small - 1.0 / (1.0 / 256.0 + 0.1)).abs() < 1e-12, "{small}");
    assert_eq!(router_weight(256.0, 10_000.0, 0.0), 0.0);
}

#[test]
fn a_replica_too_slow_to_help_gets_no_sequences() {
    // The fast replica alone: (1e12 tau - 1e9)/1e6 = 1e3 tau => tau = 1e3/(1e6 - 1e3).
    // A 1 GB/s replica needs tau >= 1 s to read its weights once: it stays empty.
    let alone = token_time(&[kind(1.0, 1e12)], 1e3, &gb(), 1e6, 1.0).unwrap();
    let both = token_time(&[kind(1.0, 1e12), kind(1.0, 1e9)], 1e3, &gb(), 1e6, 1.0).unwrap();
    assert!((alone - both).abs() < 1e-15);
}

#[test]
fn asking_for_more_tokens_than_bandwidth_allows_has_no_token_time() {
    // The limit is 1e12 / 1e6 = 1e6 tokens/s (the weights' share vanishes as the batch grows).
    assert!(token_time(&[kind(1.0, 1e12)], 1.01e6, &gb(), 1e6, 1.0).is_none());
    assert!(token_time(&[kind(1.0, 1e12)], 0.99e6, &gb(), 1e6, 1.0).is_some());
}

#[test]
fn the_mdl_queue_factor_is_one_when_idle_and_grows_with_load() {
    assert_eq!(queue(0.0), 1.0);
    assert!((queue(0.5) - 1.5).abs() < 1e-12);
    assert!(queue(0.9) > queue(0.5));
}

#[test]
fn a_group_whose_attempt_fits_the_earliest_deadline_is_never_regenerated() {
    // S = 2, T = 100 s: deadlines fall in [200, 300] s; a fixed 150 s attempt makes all.
    let r = regeneration(150.0, 0.0, 0.0, 2.0, 100.0, 1e9, None);
    assert_eq!(r.attempts, 1.0);
    assert_eq!(r.slot_s, 150.0);
}

#[test]
fn a_fixed_attempt_misses_the_share_of_deadlines_it_outlives_and_holds_its_slot_until_each_one() {
    // A 250 s attempt outlives deadlines in [200, 250): half of them, restarted at the
    // deadline, 225 s in on average. An attempt holds the slot 0.5 x 250 + 0.5 x 225 = 237.5 s,
    // and 1 / (1 - 0.5) = 2 are made: 475 s, 1.9 attempts' worth of generation.
    let r = regeneration(250.0, 0.0, 0.0, 2.0, 100.0, 1e9, None);
    assert!((r.slot_s - 475.0).abs() < 1e-9, "{r:?}");
    assert!((r.attempts - 1.9).abs() < 1e-12, "{r:?}");
}

#[test]
fn a_group_that_never_makes_its_deadline_holds_its_slot_until_the_limit() {
    // S = 0, T = 100: every deadline is under 100 s; a 1,000 s attempt always misses.
    let r = regeneration(1000.0, 0.0, 0.0, 0.0, 100.0, 5000.0, None);
    assert!((r.slot_s - 5000.0).abs() < 1e-9, "{r:?}");
    assert!((r.attempts - 5.0).abs() < 1e-9, "{r:?}");
}

#[test]
fn a_fresh_spread_misses_by_the_mean_normal_survival_over_the_deadlines() {
    // Attempt Normal(250, 50) against deadlines uniform on [200, 300]: the mean of Q(x) for
    // x in [-1, 1] is 1/2 by symmetry, so 2 attempts on average. Each is cut at its deadline:
    // it runs past one by 50^2 / 100 x [(Phi - z^2 Q + z phi) / 2] from -1 to 1 = 23.1165 s on
    // average, so it holds the slot 226.8835 s: 453.767 s in all.
    let r = regeneration(250.0, 0.0, 50.0, 2.0, 100.0, 1e9, None);
    assert!((r.slot_s - 453.767).abs() < 1e-3, "{r:?}");
    assert!((r.attempts - 453.767 / 250.0).abs() < 1e-5, "{r:?}");
}

fn early(chain: f64, delay: f64) -> Option<EarlyRestart> {
    Some(EarlyRestart { chain, delay })
}

#[test]
fn a_group_the_core_restarts_early_holds_its_slot_for_the_share_of_a_step_it_lived_then_has_the_whole_bound()
 {
    // S = 2, T = 100 s, a long chain of 250 s: groups started in the last half of a step
    // (deadlines under 250 s) are restarted at the next publication, after 25 s on average,
    // and start again with the whole 300 s. The others' deadlines are in [250, 300] s, which
    // a fixed 220 s attempt makes: (220 + 0.5^2 x 100 / 2) / 1 = 232.5 s.
    let r = regeneration(220.0, 0.0, 0.0, 2.0, 100.0, 1e9, early(250.0, 0.0));
    assert!((r.slot_s - 232.5).abs() < 1e-9, "{r:?}");
    assert!((r.attempts - 232.5 / 220.0).abs() < 1e-12, "{r:?}");
    // Without the rule the same attempt misses the deadlines in [200, 220): a fifth of
    // them, each cut at its deadline, 20^2 / 2 / 100 = 2 s short of a whole attempt on
    // average: (220 - 2) / 0.8 = 272.5 s.
    let r = regeneration(220.0, 0.0, 0.0, 2.0, 100.0, 1e9, None);
    assert!((r.slot_s - 272.5).abs() < 1e-9, "{r:?}");
    // A chain longer than the whole bound restarts nothing (the core lets such a group run).
    let beyond = regeneration(220.0, 0.0, 0.0, 2.0, 100.0, 1e9, early(350.0, 0.0));
    assert_eq!(beyond, r);
    // A restart that waits 10 s for the running members holds the slot 10 s more, and leaves
    // 290 s, which the attempt still makes: 220 + 0.5 x (25 + 10) = 237.5 s.
    let r = regeneration(220.0, 0.0, 0.0, 2.0, 100.0, 1e9, early(250.0, 10.0));
    assert!((r.slot_s - 237.5).abs() < 1e-9, "{r:?}");
    // An attempt longer than what is left after the delay misses it every time, 5 s past:
    // 295 s against 290 s. The others' deadlines, uniform on [250, 300], miss 0.9 of the
    // time, by 45^2 / 2 / 50 = 20.25 s on average, so (295 - 0.5 x 20.25 - 0.5 x 5 + 17.5) /
    // (1 - 0.5 x 0.9 - 0.5 x 1) = 5,997.5 s.
    let r = regeneration(295.0, 0.0, 0.0, 2.0, 100.0, 1e9, early(250.0, 10.0));
    assert!((r.slot_s - 5997.5).abs() < 1e-6, "{r:?}");
}

#[test]
fn a_job_of_several_steps_averages_its_steady_steps_and_the_drain_of_its_last() {
    // 20 steps of 110 s, the last 40 s longer: (19 x 110 + 150) / 20 = 112 s. The slowest
    // groups of a batch started at once (260 s) do not set it. The trainer's floor, 20 + 20
    // x 70 = 1,420 s, is under 20 x 110 = 2,200 s.
    assert_eq!(job_average(110.0, 20.0, 260.0, 1420.0, 40.0), 112.0);
    assert_eq!(job_average(110.0, 20.0, 260.0, 1420.0, 0.0), 110.0);
}

#[test]
fn a_job_of_one_step_waits_for_the_slowest_groups_of_its_batch() {
    // Its one batch is started at once: 260 s, not the steady 110 s (nor a drain).
    assert_eq!(job_average(110.0, 1.0, 260.0, 90.0, 40.0), 260.0);
    // A batch quicker than the steady step still takes a steady step.
    assert_eq!(job_average(110.0, 1.0, 90.0, 90.0, 0.0), 110.0);
}

/// Ten steps of 512 trajectories in groups of 8, training batches of 128, at a staleness
/// bound and an over-provisioning of the caller's (at bound 2 and 25%: a window of one batch
/// and a margin of 128 trajectories).
fn drained_workload(max_staleness: f64, over_provisioning: f64) -> crate::workload::Workload {
    crate::workload::Workload {
        tasks: Vec::new(),
        batch: 512.0,
        group_size: 8.0,
        train_batch: 128.0,
        max_staleness,
        over_provisioning,
        train_mfu: 0.4,
        steps: 10.0,
        group_max_z: 0.0,
        group_max_sd: 1.0,
        window_widening_quarters: 0,
    }
}

fn fixed_life(share: f64, mean_s: f64) -> SlotLife {
    SlotLife {
        share,
        mean_s,
        sd_s: 0.0,
    }
}

#[test]
fn groups_that_all_live_alike_end_the_job_when_a_full_window_would_have() {
    // Every group holds its slot 100 s: 640 running make a step of 512 x 100 / 640 = 80 s.
    // The job's last 384 trajectories start one batch early, with the cap of two batches
    // (1,024 started and not yet trained): the 112th of the 128 groups is one of those, done
    // 100 s later, where a full window would have taken 896 / 512 steps (140 s): no drain.
    let w = drained_workload(2.0, 0.25);
    assert_eq!(w.admission_terms(), (512.0, 128.0));
    assert_eq!(w.last_starts(), 1024.0);
    let drain = drain_wait(&[fixed_life(1.0, 100.0)], &w, 80.0);
    assert!(drain.abs() < 1e-6, "{drain}");
}

#[test]
fn the_drain_waits_for_the_long_lives_a_full_window_would_have_dropped() {
    // Bound 1: a window of 384 and a margin of 128 fill the cap of one batch, so nothing
    // starts early. Half the groups live 50 s, half 150 s (mean 100 s; 512 running make a
    // step of 100 s). A group is caught in proportion to its life, and what it has left
    // integrates the survival: `0.5 min(r, 50) + 0.5 min(r, 150)` reaches the quantile p =
    // 47.625 / 64.25 of the mean life (the 48th of 64 groups) at r = 200 p - 50 = 98.25 s,
    // 23.25 s after the 0.75 steps a full window would have taken.
    let w = drained_workload(1.0, 0.25);
    assert_eq!(w.admission_terms(), (384.0, 128.0));
    assert_eq!(w.last_starts(), 512.0);
    let lives = [fixed_life(0.5, 50.0), fixed_life(0.5, 150.0)];
    let drain = drain_wait(&lives, &w, 100.0);
    let expected = 200.0 * 47.625 / 64.25 - 50.0 - 75.0;
    assert!((drain - expected).abs() < 1e-6, "{drain}");
    // Normal lives of the same means and a little spread wait a little longer still.
    let spread = [
        SlotLife {
            share: 0.5,
            mean_s: 50.0,
            sd_s: 5.0,
        },
        SlotLife {
            share: 0.5,
            mean_s: 150.0,
            sd_s: 15.0,
        },
    ];
    let wider = drain_wait(&spread, &w, 100.0);
    assert!(wider > drain && wider < drain + 5.0, "{wider}");
}

#[test]
fn without_over_provisioning_the_last_step_waits_for_the_longest_of_the_last_groups() {
    // The same lives at bound 1, no margin: a window of 384 (a step of 512 x 100 / 384 s),
    // and the job's last batch's 128 more start when 512 are left to train: every group
    // left must be done, so the last step ends with the longest life, 150 s after, where a
    // full window would have taken one step.
    let lives = [fixed_life(0.5, 50.0), fixed_life(0.5, 150.0)];
    let w = drained_workload(1.0, 0.0);
    assert_eq!(w.admission_terms(), (384.0, 0.0));
    assert_eq!(w.last_starts(), 512.0);
    let step = 512.0 * 100.0 / 384.0;
    let drain = drain_wait(&lives, &w, step);
    assert!((drain - (150.0 - step)).abs() < 1e-6, "{drain}");
}

#[test]
fn groups_that_start_again_are_apart_from_those_that_keep_their_first_attempt() {
    // Attempts of 100 s, slots of 120 s: a fifth restarts and holds its slot 100 s more.
    let mut lives = Vec::new();
    push_slot_lives(&mut lives, 0.5, 100.0, 120.0, 10.0);
    assert_eq!(lives.len(), 2);
    assert!((lives[0].share - 0.4).abs() < 1e-12 && lives[0].mean_s == 100.0);
    assert!((lives[1].share - 0.1).abs() < 1e-12);
    assert!((lives[1].mean_s - 200.0).abs() < 1e-9, "{lives:?}");
    assert!((lives[1].sd_s - 10.0 * 2f64.sqrt()).abs() < 1e-9);
    // The mean over both is the slot's.
    let mean = (lives[0].share * lives[0].mean_s + lives[1].share * lives[1].mean_s) / 0.5;
    assert!((mean - 120.0).abs() < 1e-9, "{mean}");
    // None restarted, or more than once on average: one life of the slot's mean.
    for slot in [100.0, 250.0] {
        let mut one = Vec::new();
        push_slot_lives(&mut one, 0.5, 100.0, slot, 10.0);
        let whole = SlotLife {
            share: 0.5,
            mean_s: slot,
            sd_s: 10.0,
        };
        assert_eq!(one, vec![whole]);
    }
}

#[test]
fn without_over_provisioning_the_last_step_waits_for_a_group_that_started_again() {
    // Bound 1, no margin: every group left must be done, where a full window would have
    // taken one step (512 x 120 / 384 = 160 s). Groups of 100-s attempts and 120-s slots:
    // as one mean life, all are done by 120 s, no drain; apart, the end waits for a
    // restarted group's 200 s.
    let w = drained_workload(1.0, 0.0);
    let step = 512.0 * 120.0 / 384.0;
    let mean = drain_wait(&[fixed_life(1.0, 120.0)], &w, step);
    let mut apart = Vec::new();
    push_slot_lives(&mut apart, 1.0, 100.0, 120.0, 0.0);
    let drain = drain_wait(&apart, &w, step);
    assert!(mean.abs() < 1e-6, "{mean}");
    assert!((drain - (200.0 - step)).abs() < 1e-6, "{drain}");
}

#[test]
fn the_jobs_last_groups_started_a_batch_early_end_it_with_whole_lives() {
    // Bound 2, lives of 50 s and 150 s, a step of 80 s: the last 384 start with 896 left to
    // train, the 112th of the 128 groups then running or just started. Just before 150 s
    // the 80 running ones are all done and half the 48 fresh ones (the 50-s ones): 104, so
    // the end waits for the fresh 150-s groups, 150 s on, where a full window would have
    // taken 896 / 512 steps (140 s): 10 s of drain.
    let w = drained_workload(2.0, 0.25);
    let lives = [fixed_life(0.5, 50.0), fixed_life(0.5, 150.0)];
    let drain = drain_wait(&lives, &w, 80.0);
    assert!((drain - 10.0).abs() < 1e-6, "{drain}");
}

#[test]
fn a_job_whose_whole_budget_starts_at_once_has_no_drain_but_its_one_batch() {
    // One step, one window: everything starts at once (`one_batch` takes it).
    let lives = [fixed_life(0.5, 50.0), fixed_life(0.5, 150.0)];
    let mut one = drained_workload(2.0, 0.25);
    one.steps = 1.0;
    assert_eq!(drain_wait(&lives, &one, 80.0), 0.0);
}

#[test]
fn a_trainer_idle_until_the_first_groups_are_done_can_set_the_jobs_average() {
    // 5 steps of 0.9 s, training 0.8 s a step: with the first groups done at 0.5 s the
    // trainer's 5 x 0.8 s after them end at 4.5 s, 0.9 s a step; done at 0.6 s, they end at
    // 4.6 s, 0.92 s a step, above the steady 0.9 s.
    assert!((job_average(0.9, 5.0, 1.2, 0.5 + 5.0 * 0.8, 0.0) - 0.9).abs() < 1e-12);
    assert!((job_average(0.9, 5.0, 1.2, 0.6 + 5.0 * 0.8, 0.0) - 0.92).abs() < 1e-12);
}

fn released_by(share: f64, mean_s: f64, group_train_s: f64) -> Release {
    Release {
        life: SlotLife {
            share,
            mean_s,
            sd_s: 0.0,
        },
        group_train_s,
    }
}

#[test]
fn a_trainer_waits_for_the_long_groups_of_a_fresh_window_when_the_short_ones_bring_too_little() {
    // 100 slots; half the groups live 10 s and train in 0.1 s, half live 100 s and train in
    // 1.9 s; 200 s to train; a grid of 1 s (512 s over 512 cells). Until 99 s only chains of
    // short groups are done: a slot's k-th is short with probability 0.5^k, so 100 x 0.1 x (1 -
    // 0.5^9) = 9.98046875 s of training have come, and 99 + 200 - 9.98046875 = 289.01953125 s is
    // the earliest the trainer is done. At 100 s half the slots bring 1.9 s each (95 s), and
    // after that the training comes faster than the trainer takes it: no later moment binds.
    let releases = [released_by(0.5, 10.0, 0.1), released_by(0.5, 100.0, 1.9)];
    let done = trainer_done(&releases, 100.0, 200.0, 512.0);
    assert!((done - 289.01953125).abs() < 1e-9, "{done}");
    // Its steady share of the step does not show it: 100 slots bring 100 x 1.0 / 55 = 1.8 s
    // of training a second, nearly twice what the trainer takes.
}

#[test]
fn a_trainer_fed_by_groups_of_one_life_waits_only_for_the_first_of_them() {
    // Every group lives 10 s and trains in 1 s, 100 slots, 500 s to train: nothing comes
    // before the cell of 10 s, so the trainer is done no sooner than 9 + 500 s, and 100 s more
    // comes every 10 s after, which it takes in 100 s.
    let releases = [released_by(1.0, 10.0, 1.0)];
    let done = trainer_done(&releases, 100.0, 500.0, 512.0);
    assert!((done - 509.0).abs() < 1e-9, "{done}");
}

#[test]
fn the_slowest_of_a_skewed_lot_lies_where_a_log_normal_puts_it_and_a_symmetric_one_where_a_normal_does()
 {
    // A log-normal of median 2,500 and p99 12,000: the largest of two has the closed form
    // 2 E[X] Phi(sigma / sqrt 2).
    let sigma = (12_000.0_f64 / 2_500.0).ln() / 2.326_347_874_040_841;
    let w = (sigma * sigma).exp();
    let mean = 2_500.0 * w.sqrt();
    let sd = mean * (w - 1.0).sqrt();
    let skew = (w + 2.0) * (w - 1.0).sqrt();
    let two = skewed_expected_max(mean, sd, skew, 2.0);
    let hand = 2.0 * mean * crate::workload::normal_cdf(sigma / 2.0_f64.sqrt());
    assert!((two - hand).abs() < 1e-3 * hand, "{two} vs {hand}");
    // The largest of 16: 8,830 tokens, where the normal's 1.77 standard deviations say 7,350.
    let sixteen = skewed_expected_max(mean, sd, skew, 16.0);
    assert!((sixteen - 8_832.0).abs() < 10.0, "{sixteen}");
    assert!(sixteen > mean + expected_max_z(16.0) * sd + 1_000.0);
    // No skew: the normal's; and a shift moves the largest draw with the mean.
    assert_eq!(
        skewed_expected_max(100.0, 10.0, 0.0, 16.0),
        100.0 + expected_max_z(16.0) * 10.0
    );
    let shifted = skewed_expected_max(mean + 1_000.0, sd, skew, 16.0);
    assert!((shifted - sixteen - 1_000.0).abs() < 1e-6, "{shifted}");
    // One draw is its mean.
    assert_eq!(skewed_expected_max(mean, sd, skew, 1.0), mean);
}

#[test]
fn the_mean_survival_function_matches_its_antiderivative_by_hand() {
    // Over [0, 1]: (1 x Q(1) - phi(1)) - (0 - phi(0)) = 0.158655 - 0.241971 + 0.398942.
    assert!((mean_survival(0.0, 1.0) - 0.315_626).abs() < 1e-5);
    assert!((mean_survival(-1.0, 1.0) - 0.5).abs() < 1e-7);
    assert!((mean_survival(0.0, 0.0) - 0.5).abs() < 1e-7);
}

#[test]
fn one_group_in_the_closed_loop_takes_its_generation_plus_its_training() {
    // One customer: never queues, cycle = 3 s + 1 s; 2 groups a step take two cycles.
    assert!((closed_loop_step(1.0, 3.0, 1.0, 2.0) - 8.0).abs() < 1e-12);
}

#[test]
fn two_groups_in_the_closed_loop_follow_mean_value_analysis_by_hand() {
    // k = 1: R = 1, X = 1/4, Q = 1/4. k = 2: R = 1 x (1 + 1/4) = 1.25, X = 2 / 4.25.
    // One group a step: 4.25 / 2 = 2.125 s.
    assert!((closed_loop_step(2.0, 3.0, 1.0, 1.0) - 2.125).abs() < 1e-12);
}

#[test]
fn a_crowded_closed_loop_runs_at_the_trainers_pace_and_a_sparse_one_at_littles_law() {
    // 1,000 groups, 3 s each in generation, 1 s each at the trainer: the trainer binds.
    assert!((closed_loop_step(1000.0, 3.0, 1.0, 1.0) - 1.0).abs() < 1e-6);
    // A trainer far faster than generation: Little's law, 100 groups per 50 s cycle.
    let sparse = closed_loop_step(100.0, 50.0, 1e-6, 100.0);
    assert!((sparse - 50.0).abs() < 1e-3, "{sparse}");
}

#[test]
fn a_prefill_waits_as_in_an_mg1_queue_by_hand() {
    // One replica of 1 PFLOP/s; per 100 s step, 10 prefills of 1 PFLOP and 10 of 3 PFLOP.
    // Load 40 s, rho 0.4; E[S^2] / (2 E[S]) = (10 + 90) / (2 x 40) = 1.25 s;
    // wait = 0.4 / 0.6 x 1.25 = 0.8333 s.
    let q = prefill_queue(
        &[(1.0, 1e15, 1.0)],
        &[Prefills::alike(10.0, 1e15), Prefills::alike(10.0, 3e15)],
        100.0,
    );
    assert!((q.load_s - 40.0).abs() < 1e-9, "{q:?}");
    assert!((q.wait_s - 0.4 / 0.6 * 1.25).abs() < 1e-9, "{q:?}");
    assert!((q.s_per_flop - 1e-15).abs() < 1e-27, "{q:?}");
}

#[test]
fn the_action_spread_pools_the_tasks_by_their_turns() {
    // Task a: 1 turn of 100 +- 0 tokens; task b: 3 turns of 200 +- 10. Weights 1 and 3:
    // mean 175; second moment (1 x 10,000 + 3 x 40,100) / 4 = 32,575; sd sqrt(1,950).
    let task = |turns: f64, action: f64, action_var: f64| crate::workload::TaskLoad {
        share: 0.5,
        turns,
        group_turns: turns,
        max_turns: turns,
        action_var,
        prompt: 0.0,
        action,
        observation: 0.0,
        ..refilled_task(1.0, false)
    };
    let w = Workload {
        tasks: vec![task(1.0, 100.0, 0.0), task(3.0, 200.0, 100.0)],
        batch: 8.0,
        group_size: 1.0,
        train_batch: 8.0,
        max_staleness: 1.0,
        over_provisioning: 0.0,
        train_mfu: 0.5,
        steps: 1.0,
        group_max_z: 0.0,
        group_max_sd: 1.0,
        window_widening_quarters: 0,
    };
    let (mean, sd) = action_spread(&w);
    assert!((mean - 175.0).abs() < 1e-9);
    assert!((sd - 1950.0_f64.sqrt()).abs() < 1e-9);
}

#[test]
fn a_replica_prefills_with_the_compute_its_decoding_leaves_and_never_with_less_than_a_tenth() {
    // 1,000 tokens a second of 100 GFLOP each take a tenth of 1 PFLOP/s.
    assert!((compute_left_by_decoding(1e15, 1e14) - 9e14).abs() < 1.0);
    assert_eq!(compute_left_by_decoding(1e15, 0.0), 1e15);
    // Decoding asking for more than the replica has still leaves a prefill a tenth.
    assert!((compute_left_by_decoding(1e15, 5e15) - 1e14).abs() < 1.0);
}

/// A task of `turns` turns (uniform on `[turns - 1, turns + 1]` when `varies`), a 100-token
/// prompt and 100 tokens a turn (60 of action, 40 of observation).
fn refilled_task(turns: f64, varies: bool) -> crate::workload::TaskLoad {
    crate::workload::TaskLoad {
        name: String::new(),
        share: 1.0,
        turns,
        group_turns: turns,
        // A uniform on an interval of 2 has variance 4 / 12.
        turns_var: if varies { 1.0 / 3.0 } else { 0.0 },
        max_turns: if varies { turns + 1.0 } else { turns },
        env_step_var: 0.0,
        action_var: 0.0,
        env_step_k3: 0.0,
        action_k3: 0.0,
        prompt: 100.0,
        action: 60.0,
        observation: 40.0,
        decode_context: 0.0,
        context_limit: 1e6,
        env_step_s: 0.0,
        env_cpus: 1.0,
        reward_s: 0.0,
        serverless_pool: None,
        local_reward: false,
    }
}

#[test]
fn a_refill_prefills_the_whole_context_of_a_turn_the_trajectory_goes_on_after() {
    // Three turns: an update in the first or second refills 200 or 300 tokens; one in the
    // third needs none. One FLOP a token: mean 250, mean square (40,000 + 90,000) / 2.
    let r = refill_moments(&refilled_task(3.0, false), |c| c);
    assert!((r.count - 2.0 / 3.0).abs() < 1e-12, "{r:?}");
    assert!((r.flops - 250.0).abs() < 1e-9, "{r:?}");
    assert!((r.flops_sq - 65_000.0).abs() < 1e-6, "{r:?}");
    // Quadratic attention weighs the long contexts: the mean square exceeds the mean's square.
    let quadratic = refill_moments(&refilled_task(3.0, false), |c| c * c);
    assert!(quadratic.flops_sq > quadratic.flops * quadratic.flops * 1.05);
    // The context limit caps what there is to refill.
    let capped = refill_moments(
        &crate::workload::TaskLoad {
            context_limit: 250.0,
            ..refilled_task(3.0, false)
        },
        |c| c,
    );
    assert!((capped.flops - 225.0).abs() < 1e-9, "{capped:?}");
}

#[test]
fn a_single_turn_task_has_nothing_to_refill() {
    let r = refill_moments(&refilled_task(1.0, false), |c| c);
    assert_eq!(r.count, 0.0);
}

#[test]
fn turns_that_vary_refill_after_each_turn_as_often_as_a_trajectory_goes_on_past_it() {
    // Turns uniform on [2, 4], rounded: 2, 3 or 4 turns with chances 1/4, 1/2, 1/4. A
    // trajectory goes on past turn 1 always, past turn 2 with 3/4, past turn 3 with 1/4: 2 of
    // its 3 turns on average. Contexts 200, 300, 400: mean (200 + 225 + 100) / 2.
    let r = refill_moments(&refilled_task(3.0, true), |c| c);
    assert!((r.count - 2.0 / 3.0).abs() < 1e-12, "{r:?}");
    assert!((r.flops - 262.5).abs() < 1e-9, "{r:?}");
}

/// Sequences all caught in turns of `length_s` seconds.
fn fixed_turns(length_s: f64) -> [CaughtTurn; 1] {
    [CaughtTurn {
        share: 1.0,
        mean_s: length_s,
        var_s: 0.0,
    }]
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-3 * b.abs().max(1.0)
}

#[test]
fn a_burst_of_refills_faster_than_it_arrives_leaves_no_backlog() {
    // Turns of 20 s bring 10 s of refills back over 20 s: half a second of work a second.
    assert_eq!(
        refill_backlog(10.0, &fixed_turns(20.0), 100.0),
        Backlog::default()
    );
}

#[test]
fn a_burst_of_refills_outrunning_its_arrival_keeps_others_waiting_for_the_share_of_the_step_it_lasts()
 {
    // 30 s of refills back over 10 s (turns of 10 s, caught uniformly within them): the
    // backlog peaks at 20 s and is served by 30 s; a refill meets 10 s of it, any other
    // prefill 20 x 30 / 200 = 3 s averaged over a 100 s step.
    let backlog = refill_backlog(30.0, &fixed_turns(10.0), 100.0);
    assert!(close(backlog.refill_s, 10.0), "{backlog:?}");
    assert!(close(backlog.other_s, 3.0), "{backlog:?}");
    assert!(close(backlog.busy_s, 30.0), "{backlog:?}");
}

#[test]
fn a_slow_kind_of_replica_takes_its_share_of_the_refills_and_serves_them_longer() {
    // 60 FLOPs of refills, half to a replica of 3 FLOP/s and half to one of 1 FLOP/s, back over
    // turns of 10 s. The fast one serves its 10 s as they come: no backlog. The slow one gets
    // 30 s over 10 s: a refill meets 10 s there, any other prefill 3 s (as above). Over both:
    // 5 s and 1.5 s. Pooling their compute (15 s over 10 s, the backlog growing half a second
    // a second) would have said 2.5 s.
    let kinds = [(1.0, 3.0, 0.5), (1.0, 1.0, 0.5)];
    let backlogs = refill_backlogs(60.0, &kinds, &fixed_turns(10.0), 100.0);
    assert!(close(backlogs.refill_s(), 5.0), "{backlogs:?}");
    assert!(close(backlogs.other_s(), 1.5), "{backlogs:?}");
    let pooled = refill_backlog(15.0, &fixed_turns(10.0), 100.0);
    assert!(close(pooled.refill_s, 2.5), "{pooled:?}");
}

#[test]
fn turns_that_vary_bring_most_sequences_back_early_and_leave_a_backlog_their_mean_rest_would_not() {
    // 20 s of refills. Turns of a fixed 20 s bring them back at one second of work a second:
    // no backlog. Turns of 10 s on average with a standard deviation of 10 s have the same
    // mean rest, 10 s (`E[X^2] / 2 E[X]`), but the rest of a turn is most likely short: two
    // seconds of work a second come back at first, and a backlog builds.
    assert_eq!(
        refill_backlog(20.0, &fixed_turns(20.0), 100.0),
        Backlog::default()
    );
    let varied = [CaughtTurn {
        share: 1.0,
        mean_s: 10.0,
        var_s: 100.0,
    }];
    let backlog = refill_backlog(20.0, &varied, 100.0);
    assert!(backlog.refill_s > 1.0, "{backlog:?}");
    assert!(backlog.busy_s > 0.0 && backlog.busy_s < 20.0, "{backlog:?}");
}

#[test]
fn a_sequence_refilled_within_a_burst_meets_the_rest_of_it_at_its_later_turns_while_it_lives() {
    // 30 s of refills over 10 s in a 100 s step: a refill waits 10 s. A sequence that comes
    // back every 10 s and lives through the step is refilled at a uniform moment of the 30 s
    // the burst lasts, and meets it at (30 - 10)^2 / (2 x 30 x 10) = 2/3 of a later turn on
    // average, of the 10 it takes a step, each waiting 10 s: 2/3 s a turn.
    let backlog = refill_backlog(30.0, &fixed_turns(10.0), 100.0);
    assert!(close(backlog.cached_s(10.0, 1000.0, 100.0), 2.0 / 3.0));
    // One living 20 s meets it for 20 s at most: (20 - 10)^2 / (2 x 20 x 10) = 1/4 of a turn
    // when refilled, which it is at one step in five: 1/20 of a turn of the 2 it lives, each
    // waiting 10 s: 1/4 s a turn.
    assert!(close(backlog.cached_s(10.0, 20.0, 100.0), 0.25));
    // One that comes back only after the burst is served meets none of it, nor does any
    // sequence when the refills never outrun their arrival.
    assert_eq!(backlog.cached_s(30.0, 1000.0, 100.0), 0.0);
    assert_eq!(
        refill_backlog(10.0, &fixed_turns(20.0), 100.0).cached_s(1.0, 1000.0, 100.0),
        0.0
    );
}
