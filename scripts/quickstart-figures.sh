#!/usr/bin/env bash
# Measures the figures the README's quick start quotes, by running its first command exactly as written:
#   cargo run --release -- run pipelines/dflash-quickstart.pipe --save exports/dflash-quickstart
# from a release build timed separately (cold on a fresh clone, a freshness check once built), then prints one
# table: build time, the run's wall time, real tokens/s and token slots/s (padding included), the final loss
# and tau from the run's summary.json, and the load average before and after. CI runs it so every run prints
# the figures with the load they were measured under. The run's own output goes to a log (its tail is shown if
# it fails); the run writes runs/dflash-quickstart/ and exports/dflash-quickstart/ as the README's command does.
set -euo pipefail
cd "$(dirname "$0")/.."

run_log="${QUICKSTART_LOG:-${CARGO_TARGET_DIR:-target}/quickstart-figures.log}"
summary=runs/dflash-quickstart/summary.json
mkdir -p "$(dirname "$run_log")"

load() { cut -d' ' -f1-3 /proc/loadavg; }
now() { date +%s.%N; }
seconds_since() { awk -v start="$1" -v end="$(now)" 'BEGIN { printf "%.1f", end - start }'; }

release_binary="${CARGO_TARGET_DIR:-target}/release/draftpipe"
build_kind=cold
[[ -x $release_binary ]] && build_kind="incremental (a release build was already there)"

load_before=$(load)
started=$(now)
cargo build --release --quiet
build_s=$(seconds_since "$started")

started=$(now)
if ! cargo run --release --quiet -- run pipelines/dflash-quickstart.pipe --save exports/dflash-quickstart \
    >"$run_log" 2>&1; then
    echo "quickstart-figures: the quick start's run failed; the end of $run_log:" >&2
    tail -n 40 "$run_log" >&2
    exit 1
fi
run_s=$(seconds_since "$started")
load_after=$(load)

python3 - "$summary" "$build_s" "$build_kind" "$run_s" "$load_before" "$load_after" "$(nproc)" <<'EOF'
import json, sys

path, build_s, build_kind, run_s, load_before, load_after, cores = sys.argv[1:]
with open(path) as f:
    s = json.load(f)
wall = s["wall_s"]
rows = [
    ("release build (`cargo build --release`)", f"{float(build_s):.1f} s, {build_kind}"),
    ("run wall time (the command, with cargo's freshness check and the export)", f"{float(run_s):.1f} s"),
    ("training wall time (summary.json `wall_s`)", f"{wall:.1f} s for {s['steps']} steps"),
    ("real tokens/s (`real_tokens` / `wall_s`)", f"{s['real_tokens'] / wall:,.0f}"),
    ("token slots/s, padding included (`token_slots` / `wall_s`)", f"{s['token_slots'] / wall:,.0f}"),
    ("final loss (`final_loss`, mean of the last steps)", f"{s['final_loss']:.2f}"),
    ("final tau exact (`final_tau_exact`)", f"{s['final_tau_exact']:.2f}" if s.get("final_tau_exact") is not None else "-"),
    ("final tau simulated (`final_tau_simulated`)",
     f"{s['final_tau_simulated']:.2f}" if s.get("final_tau_simulated") is not None else "-"),
    ("load average before (1, 5, 15 min)", f"{load_before} on {cores} cores"),
    ("load average after (1, 5, 15 min)", load_after),
]
print("| quick start figure | measured |")
print("| --- | --- |")
for name, value in rows:
    print(f"| {name} | {value} |")
EOF
