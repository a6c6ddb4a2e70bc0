#!/usr/bin/env bash
# The quick-start job with an external trainer and fake SGLang engines, all on this machine:
#   - three fake SGLang servers (tests/fakes/sglang_server.py: SGLang's native HTTP API over a
#     toy model, no GPU), one per inference replica, and a fake vLLM server whose chat-aware
#     /tokenize applies the toy model's chat template;
#   - `rollfleet scheduler` on examples/jobs/quickstart-external.yaml;
#   - one `rollfleet worker` per pool: prefill and decode drive the fake engines token-in,
#     token-out; train, envs and rewards as in the quick-start (the train pool's GPUs are the
#     external trainer's: no training is dispatched there);
#   - `rollfleet train`, the reference external trainer: it reads the feed, writes a checkpoint
#     per RL step and publishes it; the engines load each version replica by replica.
# Run from the repository root after `cargo build -p rollfleet-cli`; it prints where the logs are.
set -euo pipefail
cd "$(dirname "$0")/../.."
rollfleet=${ROLLFLEET:-target/debug/rollfleet}
[[ -x $rollfleet ]] || { echo "build it first: cargo build -p rollfleet-cli" >&2; exit 3; }
work=$(mktemp -d -t rollfleet-external-XXXXXX)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT

# Started in this shell (not in a command substitution), so that the trap stops them.
fake() { # fake SCRIPT NAME
    python3 "tests/fakes/$1" --port-file "$work/$2.port" >"$work/$2.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do [[ -s $work/$2.port ]] && break; sleep 0.1; done
}
url_of() { echo "http://127.0.0.1:$(cat "$work/$1.port")"; }
fake sglang_server.py prefill-0
fake sglang_server.py decode-0
fake sglang_server.py decode-1
fake vllm_server.py tokenizer
prefill=$(url_of prefill-0)
decode0=$(url_of decode-0)
decode1=$(url_of decode-1)
tokenizer=$(url_of tokenizer)

job=examples/jobs/quickstart-external.yaml
"$rollfleet" scheduler "$job" --listen 127.0.0.1:0 --expect-workers 5 --time-scale 1 \
    --journal "$work/journal" --weights-dir "$work" --report "$work/report.json" \
    >"$work/scheduler.out" 2>"$work/scheduler.log" &
scheduler=$!
pids+=($scheduler)
for _ in $(seq 100); do grep -q "listening on" "$work/scheduler.out" 2>/dev/null && break; sleep 0.1; done
url="http://$(sed -n 's/^listening on //p' "$work/scheduler.out")"
sglang=(--engine sglang --chat-tokenizer-url "$tokenizer")
"$rollfleet" worker --scheduler "$url" --pool prefill "${sglang[@]}" --engine-url "$prefill" \
    2>"$work/worker-prefill.log" &
pids+=($!)
"$rollfleet" worker --scheduler "$url" --pool decode "${sglang[@]}" --engine-url "$decode0" \
    --engine-url "$decode1" 2>"$work/worker-decode.log" &
pids+=($!)
for pool in train envs rewards; do
    "$rollfleet" worker --scheduler "$url" --pool "$pool" 2>"$work/worker-$pool.log" &
    pids+=($!)
done
echo "scheduler on $url; logs and checkpoints in $work" >&2
"$rollfleet" train "$job" --scheduler "$url" --checkpoints "$work/checkpoints" \
    --report "$work/trainer.json"
wait "$scheduler" || true
echo "the scheduler's report: $work/report.json; each engine's requests: $work/*-?.log" >&2
