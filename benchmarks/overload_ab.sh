#!/usr/bin/env bash
# Several versions of the plane under benchmarks/overload_2x.py, interleaved: on a shared
# 2-core host the speed of the same code moves by 2x within minutes, so one run of each,
# one after the other, says little. Each round runs every tree in turn, each with its own
# plane/ and benchmarks/ (PYTHONPATH=<tree>), and prints one line per load.
#
#   git worktree add /tmp/base <commit>
#   benchmarks/overload_ab.sh SLOTS WORK_US ROUNDS SECONDS TREE [TREE ...]
#   e.g. benchmarks/overload_ab.sh 2 5000 2 10 /tmp/base .
#   ROUTERS=2 benchmarks/overload_ab.sh ...   # that many routers (default 1)
#   DEVICE_WAITS=thread benchmarks/overload_ab.sh ...   # plane up --device-waits (trees that have it)
#   CAPACITY=1100 benchmarks/overload_ab.sh ...   # every tree offered the same loads (trees that take it)
set -euo pipefail
slots=$1 work=$2 rounds=$3 seconds=$4
shift 4
repo=$(cd "$(dirname "$0")/.." && pwd)
for _ in $(seq "$rounds"); do
  for tree in "$@"; do
    tree=$(cd "$tree" && pwd)
    # Run from the tree: `plane up` of a tree before 21f68a6 starts its router's process with
    # `python -m`, which imports the plane/ of the working directory.
    out=$(cd "$tree" && PYTHONPATH=$tree "$repo/.venv/bin/python" "$tree/benchmarks/overload_2x.py" \
      --duration "$seconds" --slots "$slots" --work-us "$work" --routers "${ROUTERS:-1}" \
      ${CAPACITY:+--capacity "$CAPACITY"} \
      ${DEVICE_WAITS:+--device-waits "$DEVICE_WAITS"} 2>&1)
    cap=$(grep '^capacity' <<<"$out" | sed 's/.*: \([0-9.]*\) req.*/\1/')
    grep -E '^\| [02]' <<<"$out" | awk -v t="$tree" -v c="$cap" -F'|' '{
      printf "%s cap %s |%s| accepted/s %s | p50 %s p99 %s p99/p50 %s | refused first %s | first-retry %s | retries %s | whole %s\n",
             t, c, $2, $4, $6, $7, $8, $9, $10, $11, $12}'
    grep 'what ticket holders found' <<<"$out" | sed "s|^|  $tree |" || true
  done
done
