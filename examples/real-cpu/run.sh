#!/usr/bin/env bash
# The real-model job on this machine, with nothing of the RL loop emulated: SmolLM2-135M-Instruct
# served by two replicas of the test engine (llama.cpp behind SGLang's API, engine/server.py),
# the environment of env.py (a question, a verifiable reward), `rollfleet scheduler` on job.yaml,
# one `rollfleet worker` per pool (the generation pool drives the two engines token-in,
# token-out), and train.py, the GRPO trainer written against the Python SDK. It prints each RL
# step as it ends, then a summary; everything it wrote stays in the directory it names.
#
#   bash examples/real-cpu/run.sh          # after bash examples/real-cpu/check.sh (the venv)
#
# The GPU pools of job.yaml are what the scheduler plans with: the engines run on the CPU.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="$here/.venv/bin/python"
rollfleet="${ROLLFLEET:-$root/target/debug/rollfleet}"
[[ -x $py ]] || { echo "no $py: run bash examples/real-cpu/check.sh first" >&2; exit 3; }
[[ -x $rollfleet ]] || { echo "no $rollfleet: cargo build -p rollfleet-cli first" >&2; exit 3; }
# The trainer speaks to the scheduler through the Python SDK.
"$py" -c 'import rollfleet' 2>/dev/null || "$py" -m pip install -q --disable-pip-version-check -e "$root/python"

work="${WORK:-$(mktemp -d -t rollfleet-real-cpu-XXXXXX)}"
mkdir -p "$work"
pids=()
# Stops what it started, and waits for it to be gone.
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
started=$SECONDS

wait_file() { # wait_file FILE WHAT
    for _ in $(seq 600); do [[ -s $1 ]] && return; sleep 0.1; done
    echo "$2 never started (see $work)" >&2
    exit 1
}

# Started in this shell (not in a command substitution), so that the trap stops them.
start_engine() { # start_engine NAME SEED
    "$py" "$here/engine/server.py" --port 0 --port-file "$work/$1.port" --threads 1 \
        --seed "$2" >"$work/$1.log" 2>"$work/$1.err" &
    pids+=($!)
    wait_file "$work/$1.port" "engine $1"
}
start_engine engine-a 1
start_engine engine-b 2
engine_a="http://127.0.0.1:$(cat "$work/engine-a.port")"
engine_b="http://127.0.0.1:$(cat "$work/engine-b.port")"
"$py" "$here/env.py" --port-file "$work/env.port" >"$work/env.log" 2>&1 &
pids+=($!)
wait_file "$work/env.port" "the environment"
env_url="http://127.0.0.1:$(cat "$work/env.port")"

"$rollfleet" scheduler "$here/job.yaml" --listen 127.0.0.1:0 --expect-workers 3 \
    --time-scale 1 --weights-dir "$work" --report "$work/report.json" \
    >"$work/scheduler.out" 2>"$work/scheduler.log" &
scheduler=$!
pids+=($scheduler)
for _ in $(seq 100); do grep -q "listening on" "$work/scheduler.out" 2>/dev/null && break; sleep 0.1; done
url="http://$(sed -n 's/^listening on //p' "$work/scheduler.out")"
"$rollfleet" worker --scheduler "$url" --pool gen --engine sglang --engine-url "$engine_a" \
    --engine-url "$engine_b" --chat-tokenizer-url "$engine_a" --temperature 1 \
    2>"$work/worker-gen.log" &
pids+=($!)
"$rollfleet" worker --scheduler "$url" --pool train 2>"$work/worker-train.log" &
pids+=($!)
"$rollfleet" worker --scheduler "$url" --pool envs --remote-env "digit=$env_url" \
    2>"$work/worker-envs.log" &
pids+=($!)
echo "real-cpu: scheduler on $url; engines $engine_a and $engine_b; everything in $work" >&2

"$py" "$here/train.py" --scheduler "$url" --checkpoints "$work/checkpoints" \
    --report "$work/trainer.json"
wait "$scheduler" || true

"$py" - "$work" "$((SECONDS - started))" <<'PY'
import json, pathlib, sys
work, wall = pathlib.Path(sys.argv[1]), int(sys.argv[2])
trainer = json.loads((work / "trainer.json").read_text())
report = json.loads((work / "report.json").read_text())
print(f"\nreal-cpu: job {report['job']} {report['phase']} at version {report['policy_version']} in {wall} s")
print("step  mean reward  |trainer-engine| logprob mean/max  probe logprob  seconds")
for s in trainer["steps"]:
    print(f"{s['version']:4d}  {s['mean_reward']:11.2f}  {s['logprob_gap_mean']:15.3f} / {s['logprob_gap_max']:.3f}"
          f"  {s['probe_logprob']:13.3f}  {s['seconds']:7.1f}")
# The mean reward per step, plotted (SVG, no plotting library).
points = [(s["version"], s["mean_reward"]) for s in trainer["steps"]]
top = max([r for _, r in points] + [1e-9])
width, height, pad = 420, 220, 40
def xy(step, reward):
    x = pad + (step - 1) / max(len(points) - 1, 1) * (width - 2 * pad)
    return x, height - pad - reward / top * (height - 2 * pad)
line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(*p) for p in points))
labels = "".join(
    f'<text x="{xy(v, 0)[0]:.1f}" y="{height - pad + 16}" text-anchor="middle">{v}</text>'
    for v, _ in points
)
(work / "reward.svg").write_text(
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
    f'font-family="sans-serif" font-size="11">'
    f'<text x="{pad}" y="20">mean reward per RL step (max {top:.2f}); real model, CPU</text>'
    f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>'
    f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>'
    f'<polyline points="{line}" fill="none" stroke="steelblue" stroke-width="2"/>{labels}'
    f'<text x="{width / 2:.0f}" y="{height - 6}" text-anchor="middle">version published</text></svg>'
)
print(f"reward per step plotted in {work / 'reward.svg'}")
for name in ("engine-a", "engine-b"):
    gens = [json.loads(l) for l in (work / f"{name}.log").read_text().splitlines() if l.startswith("{")]
    gens = [g for g in gens if g.get("path") == "/generate" and isinstance(g.get("output_ids"), list)]
    tokens = sum(len(g["output_ids"]) for g in gens)
    seconds = sum(g.get("seconds", 0.0) for g in gens)
    rate = tokens / seconds if seconds else 0.0
    print(f"{name}: {len(gens)} generations, {tokens} tokens, {rate:.1f} tokens/s while generating")
PY
