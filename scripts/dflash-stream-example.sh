#!/usr/bin/env bash
# The first DFlash stream run of docs/sources.md ("A first DFlash stream run"), as written there, checked: a
# random-weight transformers target (clients/python/examples/random_target.py) streams its hidden states on
# replies it wrote itself (`hf --regenerate`) into pipelines/dflash-stream.pipe. The loss must fall and τ rise.
#
#   scripts/dflash-stream-example.sh [WORKDIR]
#
# WORKDIR (default a fresh temporary directory) is where `runs/dflash-stream/` is made; the pipeline's paths are
# relative to it. PYTHON (default target/python-venv/bin/python) needs torch, transformers and tokenizers;
# DRAFTPIPE_BIN defaults to target/debug/draftpipe (built here when missing). About 20 s of training on 2 cores.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/target/python-venv/bin/python}
bin=${DRAFTPIPE_BIN:-$repo/target/debug/draftpipe}
case "$python" in /*) ;; *) python=$repo/$python ;; esac
case "$bin" in /*) ;; *) bin=$repo/$bin ;; esac
if [ ! -x "$bin" ]; then
    (cd "$repo" && cargo build --quiet --bin draftpipe)
fi
work=${1:-$(mktemp -d)}
mkdir -p "$work"
cd "$work"
rm -rf runs/dflash-stream
export PYTHONPATH="$repo/clients/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 MATMUL_NUM_THREADS=1

# The commands of docs/sources.md, with the repository's paths spelled out.
"$python" "$repo/clients/python/examples/random_target.py" --out runs/dflash-stream/target \
    --prompts runs/dflash-stream/prompts.jsonl
"$bin" run "$repo/pipelines/dflash-stream.pipe" --run-dir runs/dflash-stream/run --save runs/dflash-stream/draft \
    > runs/dflash-stream/run.out 2> runs/dflash-stream/run.err &
run=$!
"$python" -m draftpipe_client.hf --model runs/dflash-stream/target --data runs/dflash-stream/prompts.jsonl \
    --regenerate 24 --epochs 24 --tap-layers 1 2 3 --connect unix:runs/dflash-stream/hs.sock \
    --model-dtype float32 2> runs/dflash-stream/hf.err
if ! wait "$run"; then
    cat runs/dflash-stream/run.err >&2
    echo "dflash-stream-example: draftpipe run failed" >&2
    exit 1
fi
tail -n 1 runs/dflash-stream/hf.err

"$python" - runs/dflash-stream/run/summary.json <<'PY'
import json
import sys

summary = json.load(open(sys.argv[1]))
curve = summary["loss_curve"]
first, last = curve[0]["loss"], summary["final_loss"]
tau = summary["final_tau_simulated"]
exact = summary["final_tau_exact"]
print(f"dflash-stream: {summary['steps']} steps, loss {first:.3f} (first status line) -> {last:.3f} "
      f"(last {summary['final_steps']} steps), tau {exact:.3f} exact ({tau:.3f} simulated) of block 4, "
      f"{summary['real_tokens']} real tokens in {summary['token_slots']} slots")
# Measured (2026-12-01, 2 cores at load 10, two runs): 96 steps, loss 7.47 and 6.30 (first status line) -> 1.70, tau (simulated) 2.32;
# 19 s of training in 87 s (the rest: Python's start-up and the replies' generation). A drafter that learns
# nothing stays near ln(256) = 5.5 and tau 1.
if not (last < 0.6 * first and tau >= 1.6):
    sys.exit(f"dflash-stream: the drafter did not learn (loss {first:.3f} -> {last:.3f}, tau {tau:.3f} simulated)")
PY
