#!/usr/bin/env python3
"""Writes docs/results.md: every figure the README and the docs quote, from the commands that
produce them.

Two kinds of figures, in two sections:

- simulated and planned (virtual clock): deterministic, the same on every machine; regenerated
  on every run of this script, and checked by CI (`--check`) so that they cannot go stale;
- measured (wall clock: benchmarks): they depend on the machine, so they are regenerated only
  with `--benchmarks` (several minutes) and otherwise kept from the file as it stands, with the
  machine and date they were measured on.

The README's comparison table is generated from the same runs, between its markers.

Usage: python3 docs/results.py [--rollfleet PATH] [--benchmarks [dispatch,simulator,invoke]]
       [--check]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results.md"
ROLLART = "examples/jobs/rollart-agentic.yaml"
QUICKSTART = "examples/jobs/quickstart.yaml"
# The RollArt-like job's GPUs cut to a third: a fleet too small for the job's batch.
THIRD = "examples/inventories/rollart-third.yaml"
# Jobs written before any tuning against them and kept untouched: how the model holds on shapes
# it was not tuned on.
HOLDOUT = (
    "examples/jobs/holdout-math-code.yaml",
    "examples/jobs/holdout-web-agent.yaml",
    "examples/jobs/holdout-moe-agent.yaml",
    "examples/jobs/holdout-mixtral-search.yaml",
)
SEEDS = (0, 1, 2)
MEASURED_MARK = "<!-- measured: kept unless regenerated with --benchmarks -->"
README = ROOT / "README.md"
README_BEGIN = "<!-- results.py: comparison table (generated; do not edit by hand) -->"
README_END = "<!-- results.py: end of comparison table -->"

POLICY_NAMES = {
    "sync": "sync (verl's synchronous colocated loop)",
    "sync-disaggregated": "sync-disaggregated",
    "one-step-off": "one-step-off (verl, slime)",
    "areal-like": "areal-like (AReaL)",
    "rollfleet": "**rollfleet**",
}


def window_label(quarters: int) -> str:
    """An admission window as `rollfleet sim` names it: the core's rule, widened or narrowed by
    quarters of a rollout batch."""
    if quarters == 0:
        return "rule"
    whole, left = divmod(abs(quarters), 4)
    parts = [str(whole)] if whole else []
    if left:
        parts.append({1: "1/4", 2: "1/2", 3: "3/4"}[left])
    return f"rule {'+' if quarters > 0 else '-'} {' '.join(parts)} batch"


def predicted_cell(report: dict[str, Any], run: dict[str, Any]) -> str:
    """The planner's predicted step of a report's placement and its error against `run`'s
    simulated step, or `-` where the planner did not make the placement."""
    predicted = report.get("predicted_step_s")
    if not isinstance(predicted, (int, float)):
        return "-"
    return f"{predicted:.1f} ({(predicted / run['step_time_s'] - 1) * 100:+.1f}%)"


def sim(rollfleet: str, job: str, *args: str) -> dict[str, Any]:
    """The JSON report of `rollfleet sim JOB ARGS -o json`."""
    out = subprocess.run(
        [rollfleet, "sim", job, "-o", "json", *args],
        cwd=ROOT,
        check=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def policy(report: dict[str, Any], name: str) -> dict[str, Any]:
    for p in report["policies"]:
        if p["policy"] == name:
            found: dict[str, Any] = p
            return found
    raise KeyError(f"no policy {name} in the report")


def simulated_section(rollfleet: str) -> tuple[str, str]:
    """The deterministic figures, as Markdown, and the README's comparison table (from the same
    runs)."""
    lines: list[str] = []
    add = lines.append
    by_seed = {seed: sim(rollfleet, ROLLART, "--seed", str(seed)) for seed in SEEDS}
    first = by_seed[SEEDS[0]]
    add("## Simulated: the RollArt-like job under every policy")
    add("")
    add(
        f"`rollfleet sim {ROLLART} --seed N -o json`, seeds {', '.join(map(str, SEEDS))}. "
        "Every figure is **simulated** (virtual clock, a roofline of published peaks): the "
        "same on every machine. Each policy runs on the placement its own rules choose "
        "([baselines.md](baselines.md)): `tp N` is `sync`'s colocated tensor-parallel degree; "
        f"rollfleet runs on the `{first['placement']}` placement. **Reference efficiency** is "
        "the job's fixed "
        "yardstick (the bound of the episodes as first sampled, the same for every policy) "
        "over the step; **bias** is how the trained mix differs from those episodes (tokens "
        "and environment time per trajectory, and the largest gap of a task's share, in "
        "points). The run's own bound is computed from what it trained "
        "([baselines.md](baselines.md#the-lower-bound))."
    )
    add("")
    ref = first["reference"]
    add(
        f"Fixed yardstick, seed 0: {ref['bound']['step_s']:.1f} s per step "
        f"({ref['bound']['binding']} binds, staleness {ref['bound']['max_staleness']}), "
        f"{ref['mix']['tokens_per_trajectory']:.0f} tokens and "
        f"{ref['mix']['env_cpu_s_per_trajectory']:.1f} environment vCPU-s per trajectory."
    )
    add("")
    add(
        "| policy | placement | staleness | s per RL step (seeds 0 / 1 / 2) | steady state s | "
        "vs sync | "
        "reference efficiency | bias: tokens / env time / task share | USD per step | "
        "steps per USD vs sync | own bound s | own efficiency |"
    )
    add("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sync_usd = policy(first, "sync")["usd_per_step"]
    for name, shown in POLICY_NAMES.items():
        runs = [policy(by_seed[s], name) for s in SEEDS]
        steps = " / ".join(f"{r['step_time_s']:.1f}" for r in runs)
        speedups = " / ".join(f"{r['speedup_vs_sync']:.2f}x" for r in runs)
        bias = runs[0]["bias"]
        add(
            f"| {shown} | {runs[0]['placement']} | {runs[0]['max_staleness']} | {steps} | "
            f"{runs[0]['steady_step_time_s']:.1f} | {speedups} | "
            + " / ".join(f"{r['reference_efficiency']:.2f}" for r in runs)
            + f" | {bias['tokens'] * 100:+.1f}% / {bias['env_time'] * 100:+.1f}% / "
            f"{bias['task_share'] * 100:.1f} | {runs[0]['usd_per_step']:.2f} | "
            f"{sync_usd / runs[0]['usd_per_step']:.2f}x | {runs[0]['bound']['step_s']:.1f} | "
            + " / ".join(f"{r['efficiency']:.2f}" for r in runs)
            + " |"
        )
    add("")
    add(
        "Placement, steady state (steps after the first tenth and before the last tenth), "
        "bias, cost and the own bound are seed 0's."
    )
    add("")

    add("## Simulated: the RollArt-like job at equal staleness")
    add("")
    add(
        f"`rollfleet sim {ROLLART} --max-staleness 1 --baseline one-step-off "
        "--baseline areal-like --baseline rollfleet --seed 0 -o json`: every asynchronous "
        "policy at one-step-off's staleness bound of one version."
    )
    add("")
    equal = sim(
        rollfleet,
        ROLLART,
        "--max-staleness",
        "1",
        "--baseline",
        "one-step-off",
        "--baseline",
        "areal-like",
        "--baseline",
        "rollfleet",
        "--seed",
        "0",
    )
    readme = readme_table(first, equal)
    base = policy(equal, "one-step-off")["step_time_s"]
    add("| policy | s per RL step | vs one-step-off | reference efficiency | token bias |")
    add("|---|---:|---:|---:|---:|")
    for name in ("one-step-off", "areal-like", "rollfleet"):
        run = policy(equal, name)
        add(
            f"| {POLICY_NAMES[name]} | {run['step_time_s']:.1f} | "
            f"{base / run['step_time_s']:.2f}x | {run['reference_efficiency']:.2f} | "
            f"{run['bias']['tokens'] * 100:+.1f}% |"
        )
    add("")

    add("## Simulated: placements of the RollArt-like job")
    add("")
    add(
        f"`rollfleet sim {ROLLART} --baseline rollfleet --placement P --seed 0 -o json`. "
        "\"Predicted\" is the planner's model of the same placement, averaged over the job's "
        "steps as the simulated figure is."
    )
    add("")
    add("| placement | simulated s per step | trajectories/s | predicted s per step |")
    add("|---|---:|---:|---:|")
    for placement in ("plan", "uniform", "best-gpu", "default"):
        report = sim(
            rollfleet,
            ROLLART,
            "--baseline",
            "rollfleet",
            "--placement",
            placement,
            "--seed",
            "0",
        )
        run = policy(report, "rollfleet")
        add(
            f"| {placement} | {run['step_time_s']:.1f} | {run['trajectories_per_s']:.2f} | "
            f"{predicted_cell(report, run)} |"
        )
    add("")

    add("## Simulated: the RollArt-like job on a third of its GPUs")
    add("")
    add(
        f"`rollfleet sim {ROLLART} --inventory {THIRD} --baseline rollfleet --placement P "
        "--seed 0 -o json`: 64 H800s and 96 H20s, too few for the job's batch. The admission "
        "window is chosen narrower than the core's rule there (quarters of a rollout batch), "
        "and the plan's lone prefill replica is full much of the run (the decode replicas then "
        "prefill the turns it has no room for). \"Predicted\" as above."
    )
    add("")
    add(
        "| placement | simulated s per step | reference efficiency | admission window | "
        "predicted s per step |"
    )
    add("|---|---:|---:|---:|---:|")
    for placement in ("plan", "uniform"):
        report = sim(
            rollfleet,
            ROLLART,
            "--inventory",
            THIRD,
            "--baseline",
            "rollfleet",
            "--placement",
            placement,
            "--seed",
            "0",
        )
        run = policy(report, "rollfleet")
        quarters = run["admission_window"]["widening_quarters"]
        add(
            f"| {placement} | {run['step_time_s']:.1f} | {run['reference_efficiency']:.2f} | "
            f"{window_label(quarters)} | {predicted_cell(report, run)} |"
        )
    add("")

    add("## Simulated: jobs the model was not tuned on")
    add("")
    add(
        "`rollfleet sim JOB --seed 0 -o json` on jobs written before any tuning against them "
        "and kept untouched since (their headers say so): a dense 14B policy on long "
        "single-turn math and multi-turn coding on H100 + L40S, an 8B policy on "
        "long-horizon web tasks on H200 + H20 at staleness 3, and a mixture-of-experts policy "
        "(Qwen3-30B-A3B-like) on a coding agent, tool use and math on H800 + H20, and a "
        "Mixtral-8x7B-like policy on a search agent, text-to-SQL and math on H800 + H20 at "
        "staleness 1. "
        "\"Predicted\" is the planner's step for rollfleet on its placement (held at the "
        "fixed yardstick at least: an asterisk marks a model figure below it). **At the "
        "yardstick** is the speed-up a policy running at the fixed yardstick would show over "
        "the best sync and over areal-like: no policy training the same mix can show more. "
        "rollfleet starts at most the job's batches and one over-provisioning margin, so its "
        "bias is at most that margin's groups left untrained at the end and its restarts of "
        "late groups; the last column is areal-like's token bias, whose window stays full "
        "to the end."
    )
    add("")
    add(
        "| job | rollfleet s per step | predicted s | vs best sync | vs areal-like | "
        "at the yardstick: vs best sync / vs areal-like | reference efficiency | "
        "bias: tokens / task share | areal-like token bias |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    holdout: list[dict[str, Any]] = []
    for job in HOLDOUT:
        report = sim(rollfleet, job, "--seed", "0")
        holdout.append(report)
        run = policy(report, "rollfleet")
        syncs = [policy(report, n)["step_time_s"] for n in ("sync", "sync-disaggregated")]
        areal = policy(report, "areal-like")["step_time_s"]
        yardstick = report["reference"]["bound"]["step_s"]
        predicted = report.get("predicted_step_s")
        shown = "-"
        if isinstance(predicted, (int, float)):
            raised = "*" if report.get("predicted_below_yardstick") is not None else ""
            shown = (
                f"{predicted:.1f}{raised} ({(predicted / run['step_time_s'] - 1) * 100:+.1f}%)"
            )
        add(
            f"| {report['job']} | {run['step_time_s']:.1f} | {shown} | "
            f"{min(syncs) / run['step_time_s']:.2f}x | {areal / run['step_time_s']:.2f}x | "
            f"{min(syncs) / yardstick:.2f}x / {areal / yardstick:.2f}x | "
            f"{run['reference_efficiency']:.2f} | {run['bias']['tokens'] * 100:+.1f}% / "
            f"{run['bias']['task_share'] * 100:.1f} | "
            f"{policy(report, 'areal-like')['bias']['tokens'] * 100:+.1f}% |"
        )
    add("")

    add("## Simulated: how much of the distance from the yardstick is decode speed")
    add("")
    add(
        "The same runs (seed 0). The yardstick's chains decode every token as a lone sequence "
        "on the largest replica; a run batches its sequences, and a batched token takes its "
        "batch's iteration time (a mixture of experts reads more experts for a batch). **At "
        "its decode** replays the yardstick with every token of its chains at the run's own "
        "mean time a token (over the tokens, as the sequences decoding them saw it): a "
        "diagnostic, not a bound (a schedule could decode a critical chain alone). What is "
        "left between it and the step is the rest of the schedule: the admission window, "
        "waits for the trainer and the weights, regeneration."
    )
    add("")
    add(
        "| job | lone ms per token | rollfleet ms per token | yardstick s | at its decode s | "
        "reference efficiency | efficiency at its decode |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|")
    for report in [first, *holdout]:
        run = policy(report, "rollfleet")
        ref = report["reference"]
        at = run["yardstick_at_its_decode_s"]
        add(
            f"| {report['job']} | {ref['lone_decode_s_per_token'] * 1000:.2f} | "
            f"{run['decode_s_per_token'] * 1000:.2f} | {ref['bound']['step_s']:.1f} | "
            f"{at:.1f} | {run['reference_efficiency']:.2f} | {at / run['step_time_s']:.2f} |"
        )
    add("")

    add("## Simulated: finished groups that expired waiting for the trainer")
    add("")
    add(
        "The same runs (seed 0). A finished group that the trainer comes to take past the "
        "staleness bound loses its whole attempt and generates again; each cell is how many "
        "did, and their share of the groups the policy trained. The trainer takes the oldest "
        "first, so these are the groups of a version beyond the training batches left before "
        "their deadline. On the held-out jobs rollfleet's window, wider than the AReaL-like "
        "loop's, loses more of them, and is still the faster per step on every one."
    )
    add("")
    add("| job | maxStaleness | rollfleet | areal-like |")
    add("|---|---:|---:|---:|")

    def expired(run: dict[str, Any]) -> str:
        core = run["core"]
        trained = sum(lives["groups"] for lives in core["task_lives"])
        count = core["groups_expired_waiting"]
        return f"{count} ({count / max(trained, 1) * 100:.0f}%)"

    for report in [first, *holdout]:
        run = policy(report, "rollfleet")
        add(
            f"| {report['job']} | {run['max_staleness']} | {expired(run)} | "
            f"{expired(policy(report, 'areal-like'))} |"
        )
    add("")

    add("## Simulated: rollfleet's first, steady and last steps")
    add("")
    add(
        "The same runs (seed 0): rollfleet's first step, the shortest, mean and longest of its "
        "steady steps (between the warm-up and the drain, a tenth of the steps each), its last "
        "step, the average over the job's steps (what the other tables compare) and the "
        "planner's prediction of that average. The first step ends with the first groups to "
        "finish of a window started at once; the last waits for the job's last groups, "
        "restarted ones included; the steady steps swing as long groups fill the window and "
        "are then taken together."
    )
    add("")
    add(
        "| job | steps | first | steady min | steady mean | steady max | last | job average "
        "| predicted |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for report in [first, *holdout]:
        run = policy(report, "rollfleet")
        steps = run["step_times_s"]
        if run["steady_step_time_s"] is None:
            continue  # fewer than five steps: no steady part
        edge = max(len(steps) // 10, 1)
        steady = steps[edge : len(steps) - edge]
        add(
            f"| {report['job']} | {len(steps)} | {steps[0]:.1f} | {min(steady):.1f} | "
            f"{run['steady_step_time_s']:.1f} | {max(steady):.1f} | {steps[-1]:.1f} | "
            f"{run['step_time_s']:.1f} | {report['predicted_step_s']:.1f} |"
        )
    add("")

    add("## Simulated: rollfleet's decode per GPU pool")
    add("")
    add(
        "The same runs (seed 0), per GPU pool rollfleet decoded on: its replicas, the sequences "
        "decoding at once while any did (the pool's, and its busiest replica's), and the "
        "milliseconds a decoded token took, its batch's iteration time (the pool's, and its "
        "slowest replica's). A replica or a pool far above the others took more than its share "
        "of the sequences ([planner.md](planner.md#how-accurate-it-is) says why on "
        "the held-out MoE job)."
    )
    add("")
    add("| job | pool | replicas | batch | busiest replica | ms a token | slowest replica |")
    add("|---|---|---:|---:|---:|---:|---:|")
    for report in [first, *holdout]:
        run = policy(report, "rollfleet")
        for pool in run["pools"]:
            decode = pool["decode"]
            if decode is None:
                continue
            add(
                f"| {report['job']} | {pool['name']} | {decode['replicas']} | "
                f"{decode['batch']:.1f} | {decode['busiest_replica_batch']:.1f} | "
                f"{decode['s_per_token'] * 1000:.2f} | "
                f"{decode['slowest_replica_s_per_token'] * 1000:.2f} |"
            )
    add("")

    add("## Simulated: how busy rollfleet's trainer was")
    add("")
    add(
        "The same runs (seed 0): rollfleet's training batches, the share of the run its trainer "
        "spent training, and the seconds a batch took (shortest, mean, longest). A batch's "
        "training follows its tokens: a batch of long groups takes well over the mean, and a "
        "run of them keeps the trainer busy while finished groups wait, which is why rollfleet's "
        "trainer takes the cheapest groups first once none is about to expire "
        "([simulator.md](simulator.md#rollfleets-policy-choices-as-the-simulator-informs-them))."
    )
    add("")
    add("| job | batches | trainer busy | shortest batch s | mean batch s | longest batch s |")
    add("|---|---:|---:|---:|---:|---:|")
    for report in [first, *holdout]:
        trainer = policy(report, "rollfleet")["trainer"]
        add(
            f"| {report['job']} | {trainer['batches']} | {trainer['busy_share'] * 100:.0f}% | "
            f"{trainer['batch_s_min']:.1f} | {trainer['batch_s_mean']:.1f} | "
            f"{trainer['batch_s_max']:.1f} |"
        )
    add("")

    add("## Simulated: how rollfleet's groups lived, beside the planner's model")
    add("")
    add(
        "The same runs (seed 0), per task, means over the groups the trainer took: a member's "
        "life (from its group's first turn to its reward), the slowest member's (when the group "
        "is done), and the time from a group's admission to being done (restarted attempts "
        "included), and from being done to the trainer taking it, each simulated / as the "
        "planner's model has it (its error). The model's wait for the trainer is half the time "
        "a training batch takes to fill and its closed loop's queue at the trainer, the same "
        "for every task. Where a predicted step and a simulated one part, this says which part "
        "of a group's life the model misses."
    )
    add("")
    add(
        "| job | task | groups | member life s | slowest member s | admitted to done s | "
        "trainer wait s |"
    )
    add("|---|---|---:|---:|---:|---:|---:|")

    def pair(simulated: float, model: float | None) -> str:
        if model is None or simulated <= 0:
            return f"{simulated:.1f}"
        return f"{simulated:.1f} / {model:.1f} ({(model / simulated - 1) * 100:+.0f}%)"

    for report in [first, *holdout]:
        for life in report["group_lives"]:
            model = life.get("model") or {}
            add(
                f"| {report['job']} | {life['task']} | {life['groups']} | "
                f"{pair(life['member_s'], model.get('member_s'))} | "
                f"{pair(life['group_s'], model.get('group_s'))} | "
                f"{pair(life['until_done_s'], model.get('until_done_s'))} | "
                f"{pair(life['trainer_wait_s'], model.get('trainer_wait_s'))} |"
            )
    add("")

    add("## Simulated: the quick-start job")
    add("")
    add(f"`rollfleet sim {QUICKSTART} --seed N -o json`: seconds per RL step.")
    add("")
    add("| policy | " + " | ".join(f"seed {s}" for s in SEEDS) + " |")
    add("|---|" + "---:|" * len(SEEDS))
    quick = {seed: sim(rollfleet, QUICKSTART, "--seed", str(seed)) for seed in SEEDS}
    for name in POLICY_NAMES:
        quick_steps = [policy(quick[s], name)["step_time_s"] for s in SEEDS]
        add(f"| {POLICY_NAMES[name]} | " + " | ".join(f"{x:.2f}" for x in quick_steps) + " |")
    add("")
    return "\n".join(lines), readme


def readme_table(report: dict[str, Any], equal: dict[str, Any]) -> str:
    """The README's comparison: every policy of seed 0 on its own placement and staleness, then
    the asynchronous ones at one-step-off's staleness."""
    rows = [
        "| policy | placement | staleness | s per RL step | vs sync | steps per USD vs sync | "
        "efficiency (fixed bound) | bias: tokens / task share |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    sync = policy(report, "sync")

    def row(run: dict[str, Any], shown: str) -> str:
        bias = run["bias"]
        return (
            f"| {shown} | {run['placement']} | {run['max_staleness']} | "
            f"{run['step_time_s']:.1f} | {sync['step_time_s'] / run['step_time_s']:.2f}x | "
            f"{sync['usd_per_step'] / run['usd_per_step']:.2f}x | "
            f"{run['reference_efficiency']:.2f} | {bias['tokens'] * 100:+.1f}% / "
            f"{bias['task_share'] * 100:.1f} pts |"
        )

    for name, shown in POLICY_NAMES.items():
        rows.append(row(policy(report, name), shown))
    for name in ("areal-like", "rollfleet"):
        rows.append(row(policy(equal, name), POLICY_NAMES[name]))
    return "\n".join(rows)


def with_readme_table(text: str, table: str) -> str | None:
    """`text` (the README) with its generated block replaced by `table`; None without markers."""
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        return None
    return text[: begin + len(README_BEGIN)] + "\n" + table + "\n" + text[end:]


def machine() -> str:
    """This machine in one line: CPU model, vCPUs, memory."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = f", {int(line.split()[1]) / 1024 / 1024:.0f} GiB"
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} vCPUs{memory}"


def bench(args: list[str], env: dict[str, str] | None = None) -> list[str]:
    """The summary lines (those with a median) a `cargo bench` prints."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    out = subprocess.run(
        ["cargo", "bench", *args],
        cwd=ROOT,
        check=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=full_env,
        text=True,
    )
    return [line for line in out.stdout.splitlines() if "median" in line]


def measured_section(only: set[str]) -> str:
    """The wall-clock benchmarks named in `only` (all of them when empty), run now."""
    today = datetime.date.today().isoformat()
    lines = [
        "## Measured: benchmarks",
        "",
        f"Measured {today} on {machine()}. Wall-clock figures: they vary with the machine "
        "and, on shared VMs, from one hour to the next; each line is a median of the runs "
        "the benchmark states.",
        "",
    ]
    suites = [
        (
            "dispatch",
            "the scheduler's dispatch over gRPC on loopback "
            "(`cargo bench -p rollfleet-server --bench dispatch`)",
            ["-p", "rollfleet-server", "--bench", "dispatch"],
            {"ROLLFLEET_BENCH_RUNS": "5"},
        ),
        (
            "simulator",
            "the simulator (`cargo bench -p rollfleet-sim`)",
            ["-p", "rollfleet-sim"],
            None,
        ),
        (
            "invoke",
            "reward invocations through aws-sdk-lambda against the local Lambda host "
            "(`cargo bench -p rollfleet-lambda-invoker --bench invoke`)",
            ["-p", "rollfleet-lambda-invoker", "--bench", "invoke"],
            None,
        ),
    ]
    for name, title, args, env in suites:
        if only and name not in only:
            continue
        print(f"results: running {title}", file=sys.stderr)
        lines += [f"{title}:", "", "```", *bench(args, env), "```", ""]
    return "\n".join(lines)


def kept_measured_section() -> str:
    """The measured section of the file as it stands (empty when there is none)."""
    if not RESULTS.exists():
        return ""
    text = RESULTS.read_text()
    at = text.find(MEASURED_MARK)
    return text[at + len(MEASURED_MARK) :].strip() + "\n" if at >= 0 else ""


def document(simulated: str, measured: str) -> str:
    header = (
        "# Results\n\n"
        "Generated by `python3 docs/results.py` from the commands named in each section; do "
        "not edit by hand. Nothing here ran on a GPU: GPU figures are simulated (virtual "
        "clock) or come from the emulated engine.\n\n"
    )
    body = header + simulated.strip() + "\n\n" + MEASURED_MARK + "\n\n"
    return body + (measured.strip() + "\n" if measured.strip() else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rollfleet",
        default=str(ROOT / "target" / "release" / "rollfleet"),
        help="the rollfleet binary (default: target/release/rollfleet)",
    )
    parser.add_argument(
        "--benchmarks",
        nargs="?",
        const="all",
        default=None,
        help="run the benchmarks too: all, or some of dispatch,simulator,invoke",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="fail if the simulated figures in docs/results.md are not what the code gives",
    )
    args = parser.parse_args()
    if not Path(args.rollfleet).exists():
        print(
            f"results: no binary at {args.rollfleet}; build it first "
            "(cargo build --release -p rollfleet-cli)",
            file=sys.stderr,
        )
        return 2
    simulated, table = simulated_section(args.rollfleet)
    readme = README.read_text()
    new_readme = with_readme_table(readme, table)
    if new_readme is None:
        print(
            f"results: README.md has no generated comparison table ({README_BEGIN} ... "
            f"{README_END})",
            file=sys.stderr,
        )
        return 1
    if args.check:
        current = RESULTS.read_text() if RESULTS.exists() else ""
        stale = [
            name
            for name, fresh in (
                ("docs/results.md", simulated.strip() in current),
                ("README.md's comparison table", new_readme == readme),
            )
            if not fresh
        ]
        if stale:
            print(
                f"results: {' and '.join(stale)} stale: the simulated figures are not what "
                "the code gives; run python3 docs/results.py and commit the files",
                file=sys.stderr,
            )
            return 1
        print("results: docs/results.md and the README's table are current", file=sys.stderr)
        return 0
    README.write_text(new_readme)
    if args.benchmarks:
        only = set() if args.benchmarks == "all" else set(args.benchmarks.split(","))
        measured = measured_section(only)
    else:
        measured = kept_measured_section()
    RESULTS.write_text(document(simulated, measured))
    print(f"results: wrote {RESULTS.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
