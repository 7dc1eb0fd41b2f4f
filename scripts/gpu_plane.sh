#!/usr/bin/env bash
# The whole plane on a GPU, end to end: `plane up` (embedded nats-server, router, one node per
# model on the triton backend), then open-loop pulses through NATS (requests, then tinylm
# streams at 0.9x and 2x their capacity), the floor, then `plane status`.
# scripts/gpu_check.py checks the kernels alone; this checks the node's GPU path (slots on
# their SM partitions, pinned buffers, the done-event wait) under the real control path.
#
#   scripts/gpu_plane.sh                 # on a CUDA machine, from the repo root (~3 minutes)
#   BACKEND=torch scripts/gpu_plane.sh   # the same run on the CPU, to try the script itself
#   UP_ARGS=--router-per-model scripts/gpu_plane.sh   # `plane up` with a router per model
#
# Where the NATS stack is not installed (a bare GPU box), it installs the wheels in .whl/
# (scripts/gpu_wheels.sh fetches them) into /tmp/site first. The device tool's one command:
#   python3 scripts/gpu_check.py; OUT=$OUT scripts/gpu_plane.sh     (carry: .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
BACKEND=${BACKEND:-triton}
SECONDS_EACH=${SECONDS_EACH:-8}
STREAM_CALLERS=${STREAM_CALLERS:-16}  # closed-loop callers for the stream capacity: at least one a slot
OUT=${OUT:-$(mktemp -d)}
UP_ARGS=${UP_ARGS:-}  # more `plane up` options (word-split)

if ! python3 -c "import nats, msgspec, structlog, hdrh" 2>/dev/null; then
  [ -d .whl ] || { echo "the NATS stack is not installed and there is no .whl/" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
plane() { python3 -m plane "$@"; }

log=$OUT/plane_up.log
t0=$(date +%s.%N)
# python3 itself in the background, not the `plane` function: $! is then the plane's pid (a
# function runs in a subshell whose pid the trap's kill would hit, leaving the plane running).
# shellcheck disable=SC2086  # UP_ARGS: several options
python3 -m plane up --models calibrated,risk,tinylm --backend "$BACKEND" --log-level info \
  $UP_ARGS >"$log" 2>&1 &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null' EXIT
url=""
for _ in $(seq 600); do
  url=$(grep -o 'plane is up: NATS .*' "$log" | awk '{print $NF}' | head -1)
  [ -n "$url" ] && break
  kill -0 $up 2>/dev/null || break
  sleep 0.2
done
if [ -z "$url" ]; then
  echo "plane up did not come up; its log:" >&2; tail -50 "$log" >&2; exit 1
fi
printf 'plane up ready in %.1f s at %s\n' "$(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$t0" "$(date +%s.%N)")" "$url"
grep -E '"node started"|node started' "$log" | sed 's/^/  /'

summary() {  # pulse's --json on stdin: one line of the keys named (floats rounded)
  python3 -c '
import json, sys
s = json.load(sys.stdin)
def r(v):
    if isinstance(v, dict):
        return {k: r(x) for k, x in v.items()}
    return round(v, 4) if isinstance(v, float) else v
print("  " + ", ".join(f"{k}={r(s[k])}" for k in sys.argv[1:] if k in s))
' "$@"
}
pulse() {  # label, then pulse's options
  local label=$1; shift
  echo "== $label"
  # --concurrency: pulse drops (never sends) arrivals past that many in flight; 512 was met
  # on a slow 2-core CI run, the load generator behind on its own answers, not the plane.
  plane pulse --nats "$url" --duration "$SECONDS_EACH" --json --no-progress \
    --concurrency 4096 "$@" |
    summary rate sent answered ok_per_s dropped status_counts refusal_rate \
      first_retry_success mean_retries within_deadline_share p50_ms p99_ms p999_ms \
      p99_over_p50 verdict
}
pulse "calibrated 2 ms, 1000/s" --model calibrated --duration-us 2000 --rate 1000 --retry
pulse "calibrated 2 ms, 3000/s" --model calibrated --duration-us 2000 --rate 3000 --retry
pulse "calibrated 200 us, 3000/s" --model calibrated --duration-us 200 --rate 3000 --retry
pulse "risk, 2000/s" --model risk --rate 2000 --retry
streams() {  # label, then pulse's options: issue 14's figures on this device
  local label=$1; shift
  echo "== $label"
  plane pulse --nats "$url" --model tinylm --stream --retry --duration "$SECONDS_EACH" \
    --json --no-progress "$@" |
    summary capacity rate sent accepted refused_first first_retry_success mean_retries ttft \
      ttft_p99_over_p50 tpot tpot_p99_over_p50 tokens_per_s within_deadline_share verdict
}
streams "tinylm streams of 64 tokens, 0.9x the capacity" --max-tokens 64 --capacity-x 0.9 \
  --callers "$STREAM_CALLERS" --capacity-s 4
streams "tinylm streams of 64 tokens, 2x the capacity" --max-tokens 64 --capacity-x 2 \
  --callers "$STREAM_CALLERS" --capacity-s 4
echo "== the plane against bare NATS request-reply (calibrated 0 us, closed loop)"
python3 benchmarks/plane_vs_floor.py --requests 2000 --slots 4 --backend "$BACKEND" |
  grep -E '^(\| |machine|requests)' | sed 's/^/  /'
echo "== plane status"
plane status --nats "$url" | sed 's/^/  /'
echo "== the log's errors and warnings: $(grep -ciE 'error|traceback|warning' "$log") lines" \
  "(the 20 most frequent below)"
{ grep -iE 'error|traceback|warning' "$log" || true; } | sort | uniq -c | sort -rn | head -20 |
  sed 's/^/  /'
