"""The bundled demo agent: speaks the bridge protocol, really makes files.

Run as `python -m adapters.agents.demo_agent`; reads the user's message on
stdin, works in its current directory (its sandbox), draws a PNG chart of
y = x^2 (or x^3 / sqrt(x) when the message asks), writes a CSV report of the
same data, and replies with MEDIA tags naming both. Pure standard library.
"""

from __future__ import annotations

import csv
import json
import math
import os
import struct
import sys
import zlib

W, H = 640, 400
MARGIN = 48


def event(**ev) -> None:
    print("AX_GATEWAY_EVENT " + json.dumps(ev), flush=True)


def png_bytes(pixels: bytearray, w: int, h: int) -> bytes:
    raw = b"".join(b"\x00" + bytes(pixels[y * w * 3:(y + 1) * w * 3]) for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def draw_chart(points: list[tuple[float, float]]) -> bytes:
    px = bytearray(b"\xff" * (W * H * 3))

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < W and 0 <= y < H:
            i = (y * W + x) * 3
            px[i:i + 3] = bytes(rgb)

    def line(x0: int, y0: int, x1: int, y1: int, rgb, thick: int = 1) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            x = round(x0 + (x1 - x0) * s / steps)
            y = round(y0 + (y1 - y0) * s / steps)
            for dx in range(-(thick // 2), thick // 2 + 1):
                for dy in range(-(thick // 2), thick // 2 + 1):
                    put(x + dx, y + dy, rgb)

    xs, ys = zip(*points)
    x0, x1, y0, y1 = min(xs), max(xs), min(0.0, min(ys)), max(ys) or 1.0

    def sx(x: float) -> int:
        return round(MARGIN + (x - x0) / (x1 - x0 or 1) * (W - 2 * MARGIN))

    def sy(y: float) -> int:
        return round(H - MARGIN - (y - y0) / (y1 - y0 or 1) * (H - 2 * MARGIN))

    grey = (220, 220, 220)
    for i in range(11):  # grid
        gx = MARGIN + i * (W - 2 * MARGIN) // 10
        gy = MARGIN + i * (H - 2 * MARGIN) // 10
        line(gx, MARGIN, gx, H - MARGIN, grey)
        line(MARGIN, gy, W - MARGIN, gy, grey)
    line(MARGIN, H - MARGIN, W - MARGIN, H - MARGIN, (0, 0, 0), 2)  # axes
    line(MARGIN, MARGIN, MARGIN, H - MARGIN, (0, 0, 0), 2)
    for (a, b), (c, d) in zip(points, points[1:]):
        line(sx(a), sy(b), sx(c), sy(d), (31, 119, 180), 3)
    for a, b in points:
        for dx in range(-3, 4):
            for dy in range(-3, 4):
                if dx * dx + dy * dy <= 9:
                    put(sx(a) + dx, sy(b) + dy, (214, 39, 40))
    return png_bytes(px, W, H)


def main() -> int:
    message = sys.stdin.read().strip() or os.environ.get("COURIER_MESSAGE", "")
    event(kind="status", status="thinking", message="planning the chart")
    low = message.lower()
    if "x^3" in low or "cube" in low:
        label, fn = "x^3", lambda x: x ** 3
    elif "sqrt" in low:
        label, fn = "sqrt(x)", math.sqrt
    else:
        label, fn = "x^2", lambda x: x ** 2
    points = [(x / 2, fn(x / 2)) for x in range(0, 21)]
    here = os.getcwd()
    chart = os.path.join(here, "chart.png")
    report = os.path.join(here, "report.csv")

    event(kind="tool_start", tool_name="write_file", tool_call_id="c1", activity=f"writing {chart}")
    with open(chart, "wb") as f:
        f.write(draw_chart(points))
    event(kind="tool_result", tool_name="write_file", tool_call_id="c1", status="tool_complete")

    event(kind="tool_start", tool_name="write_file", tool_call_id="c2", activity=f"writing {report}")
    with open(report, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["x", label])
        for a, b in points:
            w.writerow([f"{a:g}", f"{b:g}"])
    event(kind="tool_result", tool_name="write_file", tool_call_id="c2", status="tool_complete")

    print(f"Here is the chart of y = {label} for x in [0, 10], and the data as CSV.")
    print(f"MEDIA:{chart}")
    print(f"MEDIA:{report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
