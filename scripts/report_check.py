#!/usr/bin/env python3
"""Checks a `draftpipe report` page as headless Chromium drew it (standard library only).

    report_check.py layout PAGE.html             prints "WIDTH HEIGHT" from the page's layout comment
    report_check.py check PAGE.html SHOT.png DOM.html 'BOTTLENECK WORDS'

`check` fails unless every chart region the layout comment names holds data pixels in the screenshot (coloured
pixels: the report draws axes, grid and text in black and grey and only the data in colour), and the DOM
Chromium dumped names the bottleneck (`bottleneck: BOTTLENECK WORDS`) and holds no script.
"""
import json
import re
import struct
import sys
import zlib

MARKER = "draftpipe-report-layout"
# A data line across a chart is hundreds of pixels; the chart's frame and labels are none.
MIN_DATA_PIXELS = 150
# Channel spread that makes a pixel coloured: grey and black have none, anti-aliased grey edges a few.
COLOURED_SPREAD = 60


def layout(page_path):
    text = open(page_path, encoding="utf-8").read()
    found = re.search(r"<!-- " + MARKER + r" (\{.*?\}) -->", text)
    if not found:
        sys.exit(f"{page_path}: no `{MARKER}` comment: not a draftpipe report")
    return json.loads(found.group(1))


def read_png(path):
    """(width, height, rows of (r, g, b) tuples) of an 8-bit RGB or RGBA PNG."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        sys.exit(f"{path}: not a PNG")
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    width, height, depth, colour_type, _, _, interlace = header
    if depth != 8 or colour_type not in (2, 6) or interlace:
        sys.exit(f"{path}: PNG depth {depth}, colour type {colour_type}, interlace {interlace}: expected 8-bit RGB(A)")
    channels = 3 if colour_type == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, previous, pos = [], bytearray(stride), 0
    for _ in range(height):
        kind, line = raw[pos], bytearray(raw[pos + 1 : pos + 1 + stride])
        pos += 1 + stride
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            corner = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + ((left + up) >> 1)) & 0xFF
            elif kind == 4:
                guess = left + up - corner
                pa, pb, pc = abs(guess - left), abs(guess - up), abs(guess - corner)
                nearest = left if pa <= pb and pa <= pc else (up if pb <= pc else corner)
                line[i] = (line[i] + nearest) & 0xFF
        rows.append(line)
        previous = line
    return width, height, channels, rows


def data_pixels(shot, region):
    width, height, channels, rows = shot
    count = 0
    for y in range(region["y"], min(region["y"] + region["height"], height)):
        row = rows[y]
        for x in range(region["x"], min(region["x"] + region["width"], width)):
            r, g, b = row[x * channels : x * channels + 3]
            if max(r, g, b) - min(r, g, b) > COLOURED_SPREAD:
                count += 1
    return count


def check(page_path, shot_path, dom_path, bottleneck):
    failures = []
    shot = read_png(shot_path)
    for region in layout(page_path)["charts"]:
        pixels = data_pixels(shot, region)
        verdict = "ok" if pixels >= MIN_DATA_PIXELS else "BLANK"
        print(f"  chart {region['id']:<10} at ({region['x']},{region['y']}) {region['width']}x{region['height']}: {pixels} data pixels {verdict}")
        if pixels < MIN_DATA_PIXELS:
            failures.append(f"chart {region['id']} drew no data ({pixels} coloured pixels, at least {MIN_DATA_PIXELS} expected)")
    dom = open(dom_path, encoding="utf-8").read()
    text = re.sub(r"<[^>]+>", "", dom)
    if f"bottleneck: {bottleneck}" not in text:
        failures.append(f"the page does not name the bottleneck `{bottleneck}`")
    if "<script" in dom.lower():
        failures.append("the page holds a script")
    for failure in failures:
        print(f"report check failed: {page_path}: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "layout":
        size = layout(sys.argv[2])
        print(size["width"], size["height"])
    elif len(sys.argv) == 6 and sys.argv[1] == "check":
        sys.exit(check(*sys.argv[2:]))
    else:
        sys.exit(__doc__)
