//! The predictor's fixed point: the step time that the model's latency, prefill, staleness and
//! fixed (training, environment, serverless) terms all fit in, found by one search
//! ([`least_fitting_step`]) for the full prediction and for the search's cheaper objective.

use super::model::{
    DecodeKind, EarlyRestart, Holding, Release, SlotLife, action_spread, closed_loop_step,
    drain_wait, expected_max_z, job_average, push_slot_lives, queue, regeneration, routed,
    skewed_expected_max, step_work, token_time, trainer_done, trajectory_train_flops,
};
use super::prefill::{
    Backlogs, CaughtTurn, Prefills, compute_left_by_decoding, context_prefill_flops, prefill_queue,
    refill_backlogs, refill_moments, remote_prefill, step_prefills,
};
use super::{
    Binding, Candidate, Caps, Prediction, Problem, RefillArrivals, Role, TaskLife, Terms,
    TokenTimes, cpu_terms,
};

/// What a job's start and end take beside its steady steps ([`job_average`]).
struct JobEnds {
    /// A batch started at once: its slowest groups, then its training.
    one_batch: f64,
    /// When the first groups are done and the trainer can start.
    first_ready: f64,
    /// How long each task's groups hold their slots and what training one takes, for the
    /// trainer's start and the last step's drain.
    releases: Vec<Release>,
    /// How each task's groups live, as the prediction reports it.
    task_lives: Vec<TaskLife>,
}

/// What the last round of the lifetimes' fixed point gives ([`predict_caps`]).
struct Round {
    /// The token-weighted per-token time, and each decode kind's batch.
    tau: TokenTimes,
    /// A group's mean slot life over the tasks, seconds.
    slots: f64,
    /// The slot time a group spends on attempts thrown away, over the tasks, seconds.
    regenerated: f64,
    /// The slowest task's attempt, seconds.
    tail: f64,
    /// The longest chain of a step's trajectories, seconds.
    chain: f64,
    /// When the quickest task's first groups are done, seconds.
    first_ready: f64,
    /// Local and remote prefill seconds of a step (the capacity terms).
    local_load: f64,
    remote_load: f64,
    /// Each task's slot lives with what training one of its groups takes, for the trainer's
    /// start and the drain, and its lives as the prediction reports them.
    releases: Vec<Release>,
    task_lives: Vec<TaskLife>,
}

pub(super) fn predict_caps(
    p: &Problem,
    caps: &Caps,
    c: &Candidate,
    arrivals: RefillArrivals,
) -> Option<Prediction> {
    let s = step_work(p);
    let w = &p.workload;
    if caps.trainer_flops <= 0.0 {
        return None;
    }
    let disaggregated = caps.disaggregated;
    let prefill_flops = caps.prefill_flops;
    let prefill_fastest = caps.prefill_fastest;
    let kinds = &caps.kinds;
    if kinds.iter().all(|k| k.cap < 1.0) {
        return None;
    }
    let train_s = s.train_flops / (caps.trainer_flops * w.train_mfu);
    let (env_s, serverless_s) = cpu_terms(p, &s);
    let kv_per_seq = p.kv_bytes_per_token * s.decode_context;
    let flops_per_seq = p.flops_per_token + p.attention_flops * s.decode_context;
    let weights = &p.weight_reads;
    // Weight sync takes each replica offline once a step for a transfer; fold it in as a share
    // of the step the replica cannot serve.
    let sync_s = p.weight_bytes / p.link_bytes_per_s.max(1.0);
    let window = w.window();
    let transfer_per_token = p.kv_bytes_per_token / p.link_bytes_per_s.max(1.0);
    let decode_replicas: f64 = kinds.iter().map(|k| k.replicas).sum();
    // A job of one step publishes no weights while it generates, so no replica is emptied.
    let holding = if w.steps > 1.0 {
        Holding::RefilledEachUpdate
    } else {
        Holding::Steady
    };

    // Seconds a trajectory is alive but not decoding, per token it decodes: at first its
    // environment steps and reward alone; each round of the fixed point below then counts its
    // prefills, queues and refills too.
    let plain_tokens_per_traj: f64 = w.tasks.iter().map(|k| k.share * k.turns * k.action).sum();
    let other_first = w
        .tasks
        .iter()
        .map(|k| k.share * ((k.turns + 1.0) * k.env_step_s + k.reward_s))
        .sum::<f64>()
        / plain_tokens_per_traj.max(1e-12);
    // Everything that depends on the step time T (through the throughput asked for).
    let (action_mean, action_sd) = action_spread(w);
    // Each task's refills after a weight update (how many a trajectory makes, their FLOPs' mean
    // and mean square) depend on its shapes alone.
    let refills: Vec<Prefills> = w
        .tasks
        .iter()
        .map(|task| refill_moments(task, |c| context_prefill_flops(p, c)))
        .collect();
    let no_refills = vec![0.0; w.tasks.len()];
    // What training one group of each task takes: its share of a step's training.
    let trajectory_flops: Vec<f64> = w
        .tasks
        .iter()
        .map(|task| trajectory_train_flops(p, task))
        .collect();
    let mean_flops: f64 = w
        .tasks
        .iter()
        .zip(&trajectory_flops)
        .map(|(task, f)| task.share * f)
        .sum();
    let group_train_s: Vec<f64> = trajectory_flops
        .iter()
        .map(|f| train_s * w.group_size / w.batch.max(1e-12) * f / mean_flops.max(1e-30))
        .collect();
    let evaluate = |t: f64| -> Option<(Terms, TokenTimes, f64, JobEnds)> {
        let prefill_kinds = [(
            prefill_flops / prefill_fastest.max(1e-30),
            prefill_fastest,
            1.0,
        )];
        let fill = w.train_batch / w.batch;
        // A finished group waits for a training batch to fill: half the time one takes to
        // arrive. Its wait for the trainer itself is the closed loop's (below); the slot is
        // freed when the trainer takes the group, not when training ends.
        let wait = fill * t / 2.0;
        // Regenerated attempts decode their tokens again, which slows every token, which makes
        // more groups miss their deadline; and the trajectories alive set how much context the
        // weight updates make the replicas prefill again, which sets how long every prefill
        // queues, which sets how long they live. Four rounds of that fixed point, from the
        // lifetimes without regeneration or refills.
        let mut attempts_per_token = 1.0;
        let mut alive_s: Vec<f64> = vec![0.0; w.tasks.len()];
        let mut outcome = None;
        let mut offline_s = sync_s;
        let mut other = other_first;
        for _ in 0..4 {
            // Once a step each replica is drained and loads new weights: it serves nothing for
            // `offline_s`, a share of the step no sequence decodes on it.
            let online = (1.0 - offline_s / t).clamp(0.05, 1.0);
            let scaled = online_share(kinds, online);
            // The router fills replicas by room, not speed: each kind decodes at its own
            // per-token time under the batch it is given, and a trajectory decodes at the time
            // of the replica it lands on.
            let served = routed(
                &scaled,
                s.decode_tokens * attempts_per_token / t,
                other,
                holding,
                weights,
                kv_per_seq,
                flops_per_seq,
            )?;
            let tau = served.tau;
            // What a token sees on its replica, and how that varies over the replicas.
            let (seen_tau, seen_var) = served.seen();
            // Draining waits for the longest of the replica's running actions, caught on
            // average half-way; a turn that arrives meanwhile (probability `offline / T`) waits
            // half of it.
            let per_replica = served.batch_per_replica(&scaled);
            // The actions running when the drain begins are caught in proportion to their
            // length (the inspection paradox): their mean is `E[X^2] / E[X]`, and their spread
            // scales with it (exact for a log-normal, whose length-biased law is the same
            // log-normal shifted by its log-variance).
            let biased_mean = action_mean + action_sd * action_sd / action_mean.max(1e-12);
            let biased_sd = action_sd * biased_mean / action_mean.max(1e-12);
            let longest_action = biased_mean + expected_max_z(per_replica) * biased_sd;
            offline_s = sync_s + longest_action * seen_tau / 2.0;
            let update_wait = offline_s * offline_s / (2.0 * t);
            // The core updates replicas a trainer node's worth at a time, never more than half
            // of the decoding ones, and a turn whose replica is draining goes to another one
            // (paying the refill counted below), so a later turn waits only when every replica
            // updates at once: a single decode replica. A first turn under a
            // staleness bound of 1 must start on the newest weights, which no replica has until
            // the first of them is updated, so it waits either way.
            let at_once = f64::from(super::decoding_updated_at_once(
                caps.trainer_nodes as u32,
                decode_replicas as u32,
            ));
            let together = decode_replicas <= at_once;
            let later_wait = if together { update_wait } else { 0.0 };
            // It waits for the first of the replicas updated at once to come back, not for its
            // own: each is caught with about a uniform share of its longest action left to
            // run, and the least of `k` such shares is `1 / (k + 1)` of it.
            let first_offline = sync_s + longest_action * seen_tau / (at_once + 1.0);
            let first_wait = if together || w.max_staleness <= 1.0 {
                first_offline * first_offline / (2.0 * t)
            } else {
                0.0
            };
            // A sequence's own prefills run where it decodes: each kind of replica gets the
            // share of the trajectories' turns it serves, its share of the tokens (by compute
            // while none decodes). It prefills with the compute its decoding leaves (the engine
            // runs both at once, decode first): the tokens it decodes a second take their FLOPs
            // of its FLOP/s, on average over the step.
            let sequences: f64 = served.token_share.iter().sum();
            let prefill_left: Vec<f64> = scaled
                .iter()
                .zip(&served.kinds)
                .map(|(k, &(_, batch, tau))| {
                    let tokens_per_s = if tau > 0.0 { batch / tau } else { 0.0 };
                    compute_left_by_decoding(k.flops, tokens_per_s * flops_per_seq)
                })
                .collect();
            let local_capacity: f64 = scaled
                .iter()
                .zip(&prefill_left)
                .map(|(k, f)| k.replicas * f)
                .sum();
            let at_tau: Vec<(f64, f64, f64)> = scaled
                .iter()
                .zip(&served.token_share)
                .zip(&prefill_left)
                .map(|((k, q), &f)| {
                    let share = if sequences > 0.0 {
                        q / sequences
                    } else {
                        k.replicas * f / local_capacity.max(1e-30)
                    };
                    (k.replicas, f, share)
                })
                .collect();
            let (local_jobs, remote_jobs) = step_prefills(p, disaggregated, &refills, &alive_s, t);
            let local = prefill_queue(&at_tau, &local_jobs, t);
            // Outside the refills' bursts, a prefill on a cached context waits behind the other
            // cached prefills and the first turns alone; with the refills taken as a Poisson
            // stream, behind them too.
            let cached_wait = match arrivals {
                RefillArrivals::Burst => {
                    let (unrefilled, _) = step_prefills(p, disaggregated, &refills, &no_refills, t);
                    prefill_queue(&at_tau, &unrefilled, t).wait_s
                }
                RefillArrivals::Poisson => local.wait_s,
            };
            let remote = prefill_queue(&prefill_kinds, &remote_jobs, t);
            let (local_load, local_wait) = (local.load_s, local.wait_s);
            // Refills do not arrive as M/G/1's Poisson stream but in a burst, one on each kind
            // of replica ([`refill_backlogs`]). The sequences a replica held when it took new
            // weights were caught part-way through a turn, and come back as the rest of it ends
            // (the turns caught are length-biased, and the rest of one is uniform on it), to the
            // replica or to the least loaded, or to the prefill replicas, which take every decode
            // replica's refills as its update comes. A refill meets the backlog of its moment, a
            // first turn (routed as a refill is, without a cache) the backlog averaged over the
            // step, and a prefill on top of its cached context waits behind the other prefills
            // between bursts, or behind the rest of the burst it was refilled in
            // ([`Backlogs::cached_s`]). Without the burst the prediction ranked a smaller prefill
            // pool well at `maxStaleness` 3 and above, where the window holds two batches, and
            // was 11-21% low there when the rule was chosen.
            let (mut refill_remote, mut refill_local) = (0.0, 0.0);
            let (mut caught_remote, mut caught_local) = (Vec::new(), Vec::new());
            for ((task, alive), refill) in w.tasks.iter().zip(&alive_s).zip(&refills) {
                let work = w.batch * task.share / t * alive * refill.count * refill.flops;
                if work <= 0.0 {
                    continue;
                }
                let caught = CaughtTurn {
                    share: work,
                    mean_s: task.env_step_s + task.action * seen_tau + local_wait,
                    var_s: task.env_step_var + seen_tau * seen_tau * task.action_var,
                };
                if remote_prefill(p, disaggregated, task.decode_context) {
                    refill_remote += work;
                    caught_remote.push(caught);
                } else {
                    refill_local += work;
                    caught_local.push(caught);
                }
            }
            let (burst_remote, burst_local) = match arrivals {
                RefillArrivals::Burst => (
                    refill_backlogs(refill_remote, &prefill_kinds, &caught_remote, t),
                    refill_backlogs(refill_local, &at_tau, &caught_local, t),
                ),
                RefillArrivals::Poisson => (Backlogs::default(), Backlogs::default()),
            };
            let mut slots = 0.0;
            let mut regenerated = 0.0;
            let mut tokens_with_retries = 0.0;
            let mut tail: f64 = 0.0;
            let mut chain: f64 = 0.0;
            let mut first_ready = f64::INFINITY;
            let mut not_decoding = 0.0;
            let mut task_lives = Vec::with_capacity(w.tasks.len());
            let mut releases = Vec::with_capacity(2 * w.tasks.len());
            for (((task, alive), refill), &group_train_s) in w
                .tasks
                .iter()
                .zip(alive_s.iter_mut())
                .zip(&refills)
                .zip(&group_train_s)
            {
                let first_tokens = task.prompt;
                let first = p.prefill_flops(first_tokens, 0.0);
                let first_s = first_wait
                    + if remote_prefill(p, disaggregated, first_tokens) {
                        first * remote.s_per_flop
                            + remote.wait_s
                            + burst_remote.other_s()
                            + first_tokens * transfer_per_token
                    } else {
                        first * local.s_per_flop + local_wait + burst_local.other_s()
                    };
                let obs = task.observation;
                let later = p.flops_per_token * obs + p.attention_flops * obs * task.decode_context;
                // A sequence refilled on its replica within the burst meets the rest of it at
                // its later turns there ([`Backlog::cached_s`]).
                let within_burst = if remote_prefill(p, disaggregated, task.decode_context) {
                    0.0
                } else {
                    let turn = task.env_step_s + task.action * seen_tau + local_wait;
                    refill.count * burst_local.cached_s(turn, *alive, t)
                };
                let later_s = later * local.s_per_flop + cached_wait + later_wait + within_burst;
                // Once a step its replica takes new weights and drops its KV cache: its next
                // turn prefills the whole context again, and queues for it.
                let whole = refill.flops;
                let refill_s = if remote_prefill(p, disaggregated, task.decode_context) {
                    whole * remote.s_per_flop
                        + remote.wait_s
                        + burst_remote.refill_s()
                        + task.decode_context * transfer_per_token
                } else {
                    whole * local.s_per_flop + local_wait + burst_local.refill_s()
                };
                // A group is trained when its slowest member is done: the largest of its members'
                // lifetimes, from their mean, spread and skew (turns vary, and so does every
                // step); that maximum itself varies by `group_max_sd` standard deviations.
                let turns = task.turns;
                let per_turn = task.env_step_s + later_s + task.action * seen_tau;
                let plain_life = (turns + 1.0) * task.env_step_s
                    + first_s
                    + (turns - 1.0).max(0.0) * later_s
                    + turns * task.action * seen_tau
                    + task.reward_s;
                // One refill per step lived: `life = plain + refill x life / T`.
                let refill_share = (refill_s / t).min(0.9);
                let stretch = 1.0 / (1.0 - refill_share);
                let mean_life = plain_life * stretch;
                // Where a trajectory decodes is drawn by the router, again after every
                // weight update (its KV cache is gone, so it is routed afresh): its decode time
                // varies by the spread of per-token times over the replicas it may land on,
                // averaged over the steps it lives through.
                let tokens = turns * task.action;
                let placements = 1.0 + plain_life * stretch / t;
                let fresh_var = (turns
                    * (task.env_step_var + seen_tau * seen_tau * task.action_var)
                    + tokens * tokens * seen_var / placements)
                    * stretch
                    * stretch;
                let lasting_var = task.turns_var * per_turn * per_turn * stretch * stretch;
                let var_life = fresh_var + lasting_var;
                // The skew of a life: each turn's (its environment step's and its action's),
                // summed over the turns, and the turns' count times their spread (a compound
                // sum's third cumulant; the count's own is taken as none, turns being uniform or
                // fixed in practice).
                let turn_var = task.env_step_var + seen_tau * seen_tau * task.action_var;
                let turn_k3 = task.env_step_k3 + seen_tau.powi(3) * task.action_k3;
                let k3_life = (turns * turn_k3 + 3.0 * task.turns_var * per_turn * turn_var)
                    * stretch.powi(3);
                let skew = k3_life / var_life.powf(1.5).max(1e-30);
                let sd_life = var_life.sqrt();
                let attempt = skewed_expected_max(mean_life, sd_life, skew, w.group_size) + wait;
                // The core's long chain of a multi-turn task (`maxTurns` turns at the mean turn
                // time it measures, plus one standard deviation of their sum), by which it
                // restarts groups early; a single-turn task measures no turn time, so has none.
                let restart = (task.max_turns > 1.0).then(|| EarlyRestart {
                    chain: (task.max_turns * per_turn + (task.max_turns * turn_var).sqrt())
                        * stretch,
                    // The slowest running member ends its turn first: about a whole turn.
                    delay: per_turn * stretch,
                });
                let regen = regeneration(
                    attempt,
                    w.group_max_sd * lasting_var.sqrt(),
                    w.group_max_sd * fresh_var.sqrt(),
                    w.max_staleness,
                    t,
                    w.steps * t / 2.0,
                    restart,
                );
                slots += task.share * regen.slot_s;
                task_lives.push(TaskLife {
                    member_s: mean_life,
                    group_s: attempt - wait,
                    until_done_s: regen.slot_s - wait,
                    // The fill wait; the closed loop's queue at the trainer is added below.
                    trainer_wait_s: wait,
                });
                let mut slot_lives = Vec::with_capacity(2);
                push_slot_lives(
                    &mut slot_lives,
                    task.share,
                    attempt,
                    regen.slot_s,
                    w.group_max_sd * sd_life,
                );
                releases.extend(slot_lives.into_iter().map(|life| Release {
                    life,
                    group_train_s,
                }));
                regenerated += task.share * (regen.slot_s - attempt).max(0.0);
                tokens_with_retries += task.share * turns * task.action * regen.attempts;
                tail = tail.max(attempt);
                // The longest chain of a step's trajectories of this task (not of one group):
                // the staleness-latency term of the lower bound, at the per-token times
                // predicted here rather than the fastest possible.
                let step_members = w.batch * task.share;
                // It keeps the normal's maximum, not the skewed one the group's slowest member
                // takes: the core restarts a group that would be late on fresh draws
                // (`Core::restart_late_groups`), so the longest of the chains first drawn is not
                // what a step waits for. With the skewed maximum this term bound the
                // RollArt-like job at 120.9 s a step against 110.1 simulated, when chosen.
                chain = chain.max(mean_life + expected_max_z(step_members) * sd_life);
                first_ready = first_ready.min(attempt - wait);
                *alive = mean_life * regen.attempts;
                not_decoding += task.share * (mean_life - tokens * seen_tau).max(0.0);
            }
            other = not_decoding / plain_tokens_per_traj.max(1e-12);
            let plain_tokens: f64 = w.tasks.iter().map(|k| k.share * k.turns * k.action).sum();
            attempts_per_token = (tokens_with_retries / plain_tokens.max(1e-12)).max(1.0);
            outcome = Some(Round {
                tau: (tau, served.kinds.iter().map(|k| k.1).collect::<Vec<f64>>()),
                slots,
                regenerated,
                tail,
                chain,
                first_ready,
                local_load,
                remote_load: remote.load_s,
                releases,
                task_lives,
            });
        }
        let mut round = outcome?;
        // The window's groups, and the finished ones waiting for a training batch that the core
        // lets out of it, circulate between generation (each holds its slot `slots`, the fill
        // wait included) and the trainer, a single server taking `train_s / (B / n)` per
        // group: a closed network, solved exactly by mean value analysis. It is at least both
        // Little's law through the window (`B x slots / N`) and the trainer's capacity, and
        // above both near the knee, where the trainer sometimes waits for data and groups
        // sometimes wait for the trainer.
        let groups_per_step = w.batch / w.group_size.max(1.0);
        let customers = (window + w.waiting_outside_window()) / w.group_size.max(1.0);
        let service_s = train_s / groups_per_step.max(1e-12);
        let latency_s = closed_loop_step(customers, round.slots, service_s, groups_per_step);
        // A group's cycle is its slot and its response at the trainer (`customers / throughput`
        // by Little's law); the response less its own training is its queue there.
        let trainer_queue = (customers.floor().max(1.0) * latency_s / groups_per_step.max(1e-12)
            - round.slots
            - service_s)
            .max(0.0);
        for life in &mut round.task_lives {
            life.trainer_wait_s += trainer_queue;
        }
        let terms = Terms {
            train_s,
            prefill_s: round.remote_load,
            local_prefill_s: round.local_load,
            decode_s: 0.0,
            env_s,
            serverless_s,
            latency_s,
            staleness_s: w.batch * round.regenerated / window.max(1.0),
            chain_s: (round.chain + fill * train_s) / (w.max_staleness + 1.0),
        };
        // A batch whose groups all start at once waits for the slowest of them and is then
        // trained: what a job of one step takes ([`job_average`]).
        let one_batch = round.tail + fill * train_s;
        // Nor can the trainer start before the first groups are done (the quickest task's),
        // and then it has every step's training still to do.
        let first_ready = if round.first_ready.is_finite() {
            round.first_ready
        } else {
            0.0
        };
        Some((
            terms,
            round.tau,
            round.slots,
            JobEnds {
                one_batch,
                first_ready,
                releases: round.releases,
                task_lives: round.task_lives,
            },
        ))
    };
    let fixed = [train_s, env_s, serverless_s]
        .into_iter()
        .fold(0.0_f64, f64::max);
    let fits = |t: f64| -> bool {
        evaluate(t).is_some_and(|(terms, _, _, _)| {
            terms
                .latency_s
                .max(terms.chain_s)
                .max(terms.local_prefill_s)
                .max(terms.prefill_s)
                .max(fixed)
                <= t
        })
    };
    let t = least_fitting_step(fixed, fits)?;
    let (mut terms, (tau, batches), slot, ends) = evaluate(t)?;

    let lives: Vec<SlotLife> = ends.releases.iter().map(|r| r.life).collect();
    let drain_s = drain_wait(&lives, w, t);
    // The trainer idles until the first groups are done, and the first window's long groups
    // can leave it idle long after ([`trainer_done`]). The slots cycling are the closed loop's
    // customers: the window and the finished groups the core lets out of it.
    let started_at_once = (window + w.waiting_outside_window()) / w.group_size.max(1.0);
    let longest_life = lives
        .iter()
        .map(|l| l.mean_s + 4.0 * l.sd_s)
        .fold(0.0_f64, f64::max);
    let trainer_done_s = trainer_done(
        &ends.releases,
        started_at_once,
        w.steps * train_s,
        2.0 * w.steps * t + longest_life,
    )
    .max(ends.first_ready + w.steps * train_s);
    let job_step_s = job_average(t, w.steps, ends.one_batch, trainer_done_s, drain_s);
    // The decode capacity term: the step time below which no per-token time serves the tokens.
    let mut dlo = 0.0;
    let mut dhi = t;
    if token_time(
        kinds,
        s.decode_tokens / dhi,
        weights,
        kv_per_seq,
        flops_per_seq,
    )
    .is_some()
    {
        for _ in 0..50 {
            let mid = 0.5 * (dlo + dhi);
            if mid <= 0.0 {
                break;
            }
            if token_time(
                kinds,
                s.decode_tokens / mid,
                weights,
                kv_per_seq,
                flops_per_seq,
            )
            .is_some()
            {
                dhi = mid;
            } else {
                dlo = mid;
            }
        }
        terms.decode_s = dhi;
    }
    let binding = [
        (terms.train_s, Binding::Train),
        (terms.prefill_s, Binding::Prefill),
        (terms.local_prefill_s, Binding::Prefill),
        (terms.env_s, Binding::Environment),
        (terms.serverless_s, Binding::Serverless),
        (terms.latency_s, Binding::Latency),
        (terms.chain_s, Binding::Staleness),
    ]
    .into_iter()
    .fold(
        (0.0, Binding::Latency),
        |best, x| {
            if x.0 > best.0 { x } else { best }
        },
    )
    .1;
    let binding = if terms.decode_s >= 0.98 * t {
        Binding::Decode
    } else {
        binding
    };
    // Utilisation per pool.
    let mut busy = vec![0.0; p.gpu_pools.len()];
    if let Some(b) = busy.get_mut(c.trainer_pool) {
        *b += c.trainer_gpus as f64 * (train_s / t).min(1.0);
    }
    let mut decode_index = 0;
    let mut decode_batch = vec![0.0; c.groups.len()];
    for (g, batch) in c.groups.iter().zip(decode_batch.iter_mut()) {
        if g.replicas == 0 || p.gpu_pools.get(g.pool).is_none() {
            continue;
        }
        let gpus = (g.tp * g.replicas) as f64;
        let share = match g.role {
            Role::Prefill => (terms.prefill_s / t).min(1.0),
            Role::Decode | Role::Generate => {
                // The decode kinds are the serving groups in order (`capacities`).
                let b = batches.get(decode_index).copied().unwrap_or(0.0);
                decode_index += 1;
                *batch = b;
                // A replica is busy whenever it holds a sequence (Poisson occupancy).
                1.0 - (-b).exp()
            }
        };
        if let Some(x) = busy.get_mut(g.pool) {
            *x += gpus * share;
        }
    }
    let gpu_utilisation: Vec<f64> = busy
        .iter()
        .zip(&p.gpu_pools)
        .map(|(b, pool)| (b / pool.count.max(1) as f64).min(1.0))
        .collect();
    let gpu_cost_per_s: f64 = p
        .gpu_pools
        .iter()
        .map(|pool| pool.count as f64 * pool.rates.price_per_hour / 3600.0)
        .sum();
    let cost_per_step_usd = (gpu_cost_per_s + p.cpu_price_per_hour / 3600.0) * t
        + p.serverless_gb_s_per_step * p.serverless.first().map_or(0.0, |s| s.price_per_gb_s);
    Some(Prediction {
        step_s: t,
        job_step_s,
        trajectories_per_s: w.batch / t,
        binding,
        terms,
        token_s: tau,
        decode_batch,
        slot_lifetime_s: slot,
        task_lives: ends.task_lives,
        gpu_utilisation,
        env_utilisation: (env_s / t).min(1.0),
        cost_per_step_usd,
    })
}

/// The search's objective: the steady-state step time of the first-order model (Little's law
/// through the window with an M/D/1 trainer queue, and the slowest group inside `maxStaleness`
/// steps), with the refills after weight updates as prefill load and a burst wait, and without
/// the other terms [`predict`] adds (regeneration, the refills' own queueing model, drains, the
/// closed loop with the trainer). Those bring the prediction closer to the
/// simulated step on every placement checked, but rank one pair the wrong way round (a single
/// decode replica, whose stalls they underrate: docs/planner.md), so the search keeps this one.
pub(super) fn objective_caps(p: &Problem, caps: &Caps) -> Option<f64> {
    let s = step_work(p);
    let w = &p.workload;
    if caps.trainer_flops <= 0.0 {
        return None;
    }
    let disaggregated = caps.disaggregated;
    let prefill_flops = caps.prefill_flops;
    let prefill_fastest = caps.prefill_fastest;
    let local_flops = caps.local_flops;
    let local_fastest = caps.local_fastest;
    let kinds = &caps.kinds;
    if kinds.iter().all(|k| k.cap < 1.0) {
        return None;
    }
    let (first_remote, first_local) = if disaggregated {
        (s.first_prefill_flops, 0.0)
    } else {
        (0.0, s.first_prefill_flops)
    };
    let local_work = s.later_prefill_flops + first_local;
    let train_s = s.train_flops / (caps.trainer_flops * w.train_mfu);
    let prefill_s = if first_remote > 0.0 {
        first_remote / prefill_flops.max(1e-30)
    } else {
        0.0
    };
    // With all the decode replicas' compute: a floor for the search; each step time's own
    // decoding takes its share of it below.
    let local_prefill_s = local_work / local_flops.max(1e-30);
    let (env_s, serverless_s) = cpu_terms(p, &s);
    let kv_per_seq = p.kv_bytes_per_token * s.decode_context;
    let flops_per_seq = p.flops_per_token + p.attention_flops * s.decode_context;
    let weights = &p.weight_reads;
    // Weight sync takes each replica offline once a step for a transfer; fold it in as a share
    // of the step the replica cannot serve.
    let sync_s = p.weight_bytes / p.link_bytes_per_s.max(1.0);
    let window = w.window();
    let transfer_per_token = p.kv_bytes_per_token / p.link_bytes_per_s.max(1.0);

    // Everything that depends on the step time T (through the throughput asked for).
    let evaluate = |t: f64| -> Option<(Terms, f64, f64)> {
        let online = (1.0 - sync_s / t).clamp(0.05, 1.0);
        let scaled = online_share(kinds, online);
        let tau = token_time(
            &scaled,
            s.decode_tokens / t,
            weights,
            kv_per_seq,
            flops_per_seq,
        )?;
        // The decode replicas prefill with the compute their decoding leaves at this step time.
        let decode_flops: f64 = scaled.iter().map(|k| k.replicas * k.flops).sum();
        let left = compute_left_by_decoding(decode_flops, s.decode_tokens / t * flops_per_seq)
            / decode_flops.max(1e-30);
        let local_flops = local_flops * left;
        let local_fastest = local_fastest * left;
        let local_prefill_s = local_work / local_flops.max(1e-30);
        // Every trajectory alive when its replica takes new weights (once a step) loses its KV
        // cache and prefills its whole context again (a refill), where a turn without a cache
        // goes: by Little's law `B / T x life` are alive. Refills load the prefill queues, which
        // lengthen lives, which make more refills: two rounds, from none.
        let refill_flops = context_prefill_flops(p, s.decode_context);
        let refills_remote = remote_prefill(p, disaggregated, s.decode_context);
        let own_refill = refill_flops
            / if refills_remote {
                prefill_fastest
            } else {
                local_fastest
            }
            .max(1e-30);
        let mut refill = (0.0, 0.0);
        let mut outcome = (0.0, 0.0);
        for _ in 0..2 {
            let (refill_remote_s, refill_local_s) = refill;
            let q_first = queue((prefill_s + refill_remote_s) / t);
            let q_local = queue((local_prefill_s + refill_local_s) / t);
            // Refills come in a burst as each wave of replicas loads new weights, so a
            // trajectory alive at an update queues behind about half of the step's refills as
            // well as paying for its own, once for every step it lives.
            let burst = refill_remote_s.max(refill_local_s) / 2.0;
            let stretch = 1.0 / (1.0 - ((own_refill + burst) / t).min(0.9));
            let mut slots = 0.0;
            let mut longest: f64 = 0.0;
            let mut alive = 0.0;
            for task in &w.tasks {
                let first_tokens = task.prompt;
                let first = p.prefill_flops(first_tokens, 0.0);
                let first_s = if disaggregated {
                    first / prefill_fastest.max(1e-30) * q_first + first_tokens * transfer_per_token
                } else {
                    first / local_fastest.max(1e-30) * q_local
                };
                let obs = task.observation;
                let later = p.flops_per_token * obs + p.attention_flops * obs * task.decode_context;
                let later_s = later / local_fastest.max(1e-30) * q_local;
                // A group is trained when its slowest member is done: the mean lifetime plus
                // `group_max_z` standard deviations of it (turns vary, and so does every step).
                let turns = task.turns;
                let per_turn = task.env_step_s + later_s + task.action * tau;
                let mean_life = (turns + 1.0) * task.env_step_s
                    + first_s
                    + (turns - 1.0).max(0.0) * later_s
                    + turns * task.action * tau
                    + task.reward_s;
                let mean_life = mean_life * stretch;
                let var_life = (turns * (task.env_step_var + tau * tau * task.action_var)
                    + task.turns_var * per_turn * per_turn)
                    * stretch
                    * stretch;
                let life = mean_life + w.group_max_z * var_life.sqrt();
                longest = longest.max(life);
                slots += task.share * life;
                alive += task.share * mean_life;
            }
            let refill_work = w.batch / t * alive * refill_flops;
            refill = if refills_remote {
                (refill_work / prefill_flops.max(1e-30), 0.0)
            } else {
                (0.0, refill_work / local_flops.max(1e-30))
            };
            outcome = (slots, longest);
        }
        let (slots, longest) = outcome;
        let (refill_remote_s, refill_local_s) = refill;
        let fill = w.train_batch / w.batch;
        // A finished group waits for a training batch to fill and for the trainer, which
        // queues batches like any server: a trainer busy nearly all the step makes every group
        // wait (M/D/1), holding its slot and ageing towards the staleness bound.
        let wait = fill * (t / 2.0 + train_s * queue(train_s / t));
        let latency_s = w.batch * (slots + wait) / window.max(1.0);
        let staleness_s = longest / w.max_staleness.max(1.0);
        let terms = Terms {
            train_s,
            prefill_s: prefill_s + refill_remote_s,
            local_prefill_s: local_prefill_s + refill_local_s,
            decode_s: 0.0,
            env_s,
            serverless_s,
            latency_s,
            staleness_s,
            chain_s: 0.0,
        };
        Some((terms, tau, slots + wait))
    };
    let fixed = [train_s, prefill_s, local_prefill_s, env_s, serverless_s]
        .into_iter()
        .fold(0.0_f64, f64::max);
    let fits = |t: f64| -> bool {
        evaluate(t).is_some_and(|(terms, _, _)| {
            let refilled = terms.prefill_s.max(terms.local_prefill_s);
            terms
                .latency_s
                .max(terms.staleness_s)
                .max(refilled)
                .max(fixed)
                <= t
        })
    };
    least_fitting_step(fixed, fits)
}

/// The shortest step time that `fits` (to a relative 1e-7), for a step no shorter than its
/// `fixed` terms: from `max(fixed, 1 s)`, doubled until it fits (`None` when 60 doublings do
/// not), then bisected down between it and `fixed` (or a millionth of it, whichever is longer).
/// Both the prediction ([`predict_caps`]) and the search's objective ([`objective_caps`]) find
/// their step this way.
fn least_fitting_step(fixed: f64, fits: impl Fn(f64) -> bool) -> Option<f64> {
    let mut hi = fixed.max(1.0);
    let mut tries = 0;
    while !fits(hi) {
        hi *= 2.0;
        tries += 1;
        if tries > 60 {
            return None;
        }
    }
    let mut lo = fixed.max(hi / 1e6);
    if fits(lo) {
        hi = lo;
    }
    for _ in 0..60 {
        if hi - lo <= 1e-7 * hi {
            break;
        }
        let mid = 0.5 * (lo + hi);
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}

/// `kinds` with each kind's replicas counted at the share `online` of the step they serve
/// (the rest of it they spend loading new weights).
fn online_share(kinds: &[DecodeKind], online: f64) -> Vec<DecodeKind> {
    kinds
        .iter()
        .map(|k| DecodeKind {
            replicas: k.replicas * online,
            ..*k
        })
        .collect()
}
