#!/usr/bin/env bash
# Before the long work: does this runner have the disk and memory the bundle job needs? The needs
# come from `python3 -m stages.planning.needs` (disk: the plan's model of what a full run writes to WORKDIR;
# memory: the largest peak RSS a bench run of the same model geometry measured), with the same
# config options as the job (G4V69_<FIELD> variables, PRESET). Exits 1 naming what is short and by
# how much, so a runner without room fails in seconds instead of hours in.
# DF and MEMINFO (default: df, /proc/meminfo) let the tests stand in a small runner.
set -euo pipefail
cd "$(dirname "$0")/.."
workdir="${WORKDIR:-.}"
mkdir -p "$workdir"
read -r disk_need ram_need ram_source < <(python3 -m stages.planning.needs --preset "${PRESET:-default}")
disk_free=$("${DF:-df}" -P -B1 "$workdir" | awk 'NR == 2 {print $4}')
# Memory: RAM and swap together (the workflow adds swap when RAM alone is short).
ram_have=$(awk '/^(MemTotal|SwapTotal):/ {kb += $2} END {printf "%.0f", kb * 1024}' "${MEMINFO:-/proc/meminfo}")
gb() { awk -v b="$1" 'BEGIN {printf "%.1f GB", b / 1e9}'; }
short=0
echo "disk in $workdir: $(gb "$disk_free") free, a full run needs about $(gb "$disk_need")"
if [ "$disk_free" -lt "$disk_need" ]; then
  echo "error: $(gb $((disk_need - disk_free))) more disk is needed in $workdir: free space (the workflow's" \
    "'free disk' step) or point WORKDIR at a bigger disk" >&2
  short=1
fi
if [ "$ram_need" -eq 0 ]; then
  echo "memory: $(gb "$ram_have") of RAM and swap; not checked: $ram_source"
else
  echo "memory: $(gb "$ram_have") of RAM and swap, a full run peaks at about $(gb "$ram_need") ($ram_source)"
  if [ "$ram_have" -lt "$ram_need" ]; then
    echo "error: $(gb $((ram_need - ram_have))) more memory is needed: add swap or use a larger runner" >&2
    short=1
  fi
fi
exit "$short"
