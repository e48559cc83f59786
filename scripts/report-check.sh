#!/usr/bin/env bash
# The report in a real browser: trains the quick start briefly and a producer-bound run, writes both reports
# (`draftpipe report`), screenshots them with headless Chromium and checks that every chart drew data and the
# page names the bottleneck (scripts/report_check.py). Then breaks one chart on purpose and requires the check
# to fail. Needs Debian's `chromium` (`apt-get install -y --no-install-recommends chromium`).
#   bash scripts/report-check.sh [SCREENSHOT_DIR]   (with a directory, the two screenshots are kept there)
set -euo pipefail
cd "$(dirname "$0")/.."
keep=${1:-}
command -v chromium >/dev/null || { echo "report check: chromium is not installed (apt-get install -y --no-install-recommends chromium)" >&2; exit 1; }
cargo build --quiet --bin draftpipe
draftpipe=target/debug/draftpipe
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

shoot() { # PAGE PNG DOM: screenshot at the page's own size and the DOM as Chromium parsed it
    local size flags
    size=$(python3 scripts/report_check.py layout "$1")
    flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
           --disable-component-update --disable-sync --hide-scrollbars --user-data-dir="$(mktemp -d -p "$work")")
    chromium "${flags[@]}" --window-size="${size% *},${size#* }" --screenshot="$2" "file://$(realpath "$1")" 2>/dev/null
    chromium "${flags[@]}" --dump-dom "file://$(realpath "$1")" >"$3" 2>/dev/null
}

report() { # NAME PIPELINE STEPS BOTTLENECK
    local run="$work/$1"
    "$draftpipe" run "$2" --steps "$3" --run-dir "$run" >"$work/$1.log" 2>&1
    grep -q "bottleneck: $4" <("$draftpipe" diagnose "$run") || { echo "report check: diagnose does not call $1 '$4'" >&2; exit 1; }
    "$draftpipe" report "$run"
    shoot "$run/report.html" "$work/$1.png" "$work/$1.dom.html"
    echo "$1:"
    python3 scripts/report_check.py check "$run/report.html" "$work/$1.png" "$work/$1.dom.html" "$4"
    if [ -n "$keep" ]; then mkdir -p "$keep" && cp "$work/$1.png" "$keep/report-$1.png"; fi
}

report quickstart pipelines/dflash-quickstart.pipe 400 "the drafters (consumers)"
report producer-bound pipelines/producer-bound.pipe 100 "the producers (target)"

# A deliberate break: the quick start's page with the data of its first chart removed must fail the check.
broken="$work/broken.html"
python3 - "$work/quickstart/report.html" "$broken" <<'PY'
import re, sys
page = open(sys.argv[1], encoding="utf-8").read()
start = page.index('<section class="chart" id="loss-tau"')
end = page.index("</section>", start)
chart = re.sub(r"<polyline[^>]*/>", "", page[start:end])
open(sys.argv[2], "w", encoding="utf-8").write(page[:start] + chart + page[end:])
PY
shoot "$broken" "$work/broken.png" "$work/broken.dom.html"
echo "broken (loss-tau emptied on purpose):"
if python3 scripts/report_check.py check "$broken" "$work/broken.png" "$work/broken.dom.html" "the drafters (consumers)"; then
    echo "report check: a page with an empty chart passed the check" >&2
    exit 1
fi
echo "report check: both reports drew every chart and name their bottleneck; the broken page was caught"
