#!/usr/bin/env python3
"""Peak unsharded memory per rank against the world size, one line per sharding strategy and
one for the FSDP2 + torch.optim.Muon peer, from the memory.tsv fsdp_strategies_bench writes:

    python3 bench/plot_memory.py memory.tsv memory.png

Columns of the TSV: world, series (optim, optim_grads, optim_grads_params, fsdp2_muon),
peak_unsharded_mib, sharded_state_mib, two_groups_mib. Two charts: the peak of unsharded
weights + gradients (with the ZeRO-3 goal, two groups' worth), and that plus the sharded state. The PNG is drawn by this file alone (the standard
library's zlib and struct; a 5x7 bitmap font), so the benchmark writes it wherever Python runs,
with or without matplotlib.
"""

import struct
import sys
import zlib

# 5x7 glyphs, one string of 7 rows per character, '#' is ink. Text is drawn upper-case.
FONT = {
    " ": ["     "] * 7,
    "0": [" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "],
    "1": ["  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
    "2": [" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"],
    "3": ["#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "],
    "4": ["   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "],
    "5": ["#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "],
    "6": ["  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "],
    "7": ["#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "],
    "8": [" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "],
    "9": [" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "],
    "A": [" ### ", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"],
    "B": ["#### ", "#   #", "#   #", "#### ", "#   #", "#   #", "#### "],
    "C": [" ### ", "#   #", "#    ", "#    ", "#    ", "#   #", " ### "],
    "D": ["#### ", "#   #", "#   #", "#   #", "#   #", "#   #", "#### "],
    "E": ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"],
    "F": ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#    "],
    "G": [" ### ", "#   #", "#    ", "# ###", "#   #", "#   #", " ####"],
    "H": ["#   #", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"],
    "I": [" ### ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
    "J": ["  ###", "   # ", "   # ", "   # ", "   # ", "#  # ", " ##  "],
    "K": ["#   #", "#  # ", "# #  ", "##   ", "# #  ", "#  # ", "#   #"],
    "L": ["#    ", "#    ", "#    ", "#    ", "#    ", "#    ", "#####"],
    "M": ["#   #", "## ##", "# # #", "# # #", "#   #", "#   #", "#   #"],
    "N": ["#   #", "#   #", "##  #", "# # #", "#  ##", "#   #", "#   #"],
    "O": [" ### ", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "],
    "P": ["#### ", "#   #", "#   #", "#### ", "#    ", "#    ", "#    "],
    "Q": [" ### ", "#   #", "#   #", "#   #", "# # #", "#  # ", " ## #"],
    "R": ["#### ", "#   #", "#   #", "#### ", "# #  ", "#  # ", "#   #"],
    "S": [" ####", "#    ", "#    ", " ### ", "    #", "    #", "#### "],
    "T": ["#####", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  "],
    "U": ["#   #", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "],
    "V": ["#   #", "#   #", "#   #", "#   #", "#   #", " # # ", "  #  "],
    "W": ["#   #", "#   #", "#   #", "# # #", "# # #", "# # #", " # # "],
    "X": ["#   #", "#   #", " # # ", "  #  ", " # # ", "#   #", "#   #"],
    "Y": ["#   #", "#   #", " # # ", "  #  ", "  #  ", "  #  ", "  #  "],
    "Z": ["#####", "    #", "   # ", "  #  ", " #   ", "#    ", "#####"],
    ".": ["     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "],
    ",": ["     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   "],
    ":": ["     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "],
    "-": ["     ", "     ", "     ", "#####", "     ", "     ", "     "],
    "+": ["     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     "],
    "=": ["     ", "     ", "#####", "     ", "#####", "     ", "     "],
    "/": ["     ", "    #", "   # ", "  #  ", " #   ", "#    ", "     "],
    "(": ["   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "],
    ")": [" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "],
    "_": ["     ", "     ", "     ", "     ", "     ", "     ", "#####"],
    "'": ["  #  ", "  #  ", " #   ", "     ", "     ", "     ", "     "],
    "<": ["   # ", "  #  ", " #   ", "#    ", " #   ", "  #  ", "   # "],
    ">": [" #   ", "  #  ", "   # ", "    #", "   # ", "  #  ", " #   "],
}

SERIES = [  # name in the TSV, legend, colour
    ("optim", "FSDP_MUON OPTIM (ZERO-1)", (31, 119, 180)),
    ("optim_grads", "FSDP_MUON OPTIM_GRADS (ZERO-2)", (255, 127, 14)),
    ("optim_grads_params", "FSDP_MUON OPTIM_GRADS_PARAMS (ZERO-3)", (44, 160, 44)),
    ("fsdp2_muon", "PYTORCH FSDP2 + TORCH.OPTIM.MUON", (214, 39, 40)),
]


class Canvas:
    def __init__(self, width, height):
        self.w, self.h = width, height
        self.px = bytearray([255] * (width * height * 3))

    def dot(self, x, y, rgb):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(rgb)

    def rect(self, x0, y0, x1, y1, rgb):
        for y in range(max(0, y0), min(self.h, y1 + 1)):
            for x in range(max(0, x0), min(self.w, x1 + 1)):
                self.dot(x, y, rgb)

    def line(self, x0, y0, x1, y1, rgb, thick=1, dash=0):
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, n = dx + dy, 0
        while True:
            if not dash or (n // dash) % 2 == 0:
                r = thick // 2
                self.rect(x0 - r, y0 - r, x0 - r + thick - 1, y0 - r + thick - 1, rgb)
            n += 1
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x, y, s, rgb=(0, 0, 0), scale=2):
        for ch in s.upper():
            glyph = FONT.get(ch, FONT[" "])
            for row, bits in enumerate(glyph):
                for col, b in enumerate(bits):
                    if b == "#":
                        self.rect(x + col * scale, y + row * scale, x + col * scale + scale - 1,
                                  y + row * scale + scale - 1, rgb)
            x += 6 * scale

    @staticmethod
    def text_width(s, scale=2):
        return len(s) * 6 * scale

    def png(self):
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3])
                       for y in range(self.h))

        def chunk(kind, data):
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) +
                chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def nice_step(span, ticks=5):
    raw = span / ticks
    mag = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 10 ** -len(str(int(1 / raw)))
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def read_tsv(path):
    rows = []
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
        for line in f:
            if line.strip():
                rows.append(dict(zip(header, line.rstrip("\n").split("\t"))))
    if not rows:
        sys.exit(f"plot_memory.py: {path} has no rows")
    return rows


def panel(c, box, title, worlds, data, two_groups=None):
    """One chart in box = (x0, y0, x1, y1) of the canvas: a line per series against W."""
    x0, y0, x1, y1 = box
    values = [v for s in data.values() for v in s.values()]
    if two_groups:
        values += list(two_groups.values())
    ymax = max(values + [1e-9])
    step = nice_step(ymax * 1.1)
    ytop = step * (int(ymax * 1.1 / step) + 1)

    def px(world):
        if len(worlds) == 1:
            return (x0 + x1) // 2
        i = worlds.index(world)
        return x0 + 30 + i * (x1 - x0 - 60) // (len(worlds) - 1)

    def py(v):
        return y1 - int(round(v / ytop * (y1 - y0)))

    c.text((x0 + x1 - c.text_width(title)) // 2, y0 - 34, title)
    v = 0.0
    while v <= ytop + 1e-9:  # grid and y labels
        y = py(v)
        c.line(x0, y, x1, y, (225, 225, 225))
        label = f"{v:g}"
        c.text(x0 - 10 - c.text_width(label), y - 7, label)
        v += step
    c.line(x0, y0, x0, y1, (0, 0, 0), 2)
    c.line(x0, y1, x1, y1, (0, 0, 0), 2)
    for w in worlds:
        c.line(px(w), y1, px(w), y1 + 6, (0, 0, 0), 2)
        c.text(px(w) - c.text_width(str(w)) // 2, y1 + 12, str(w))
    c.text((x0 + x1 - c.text_width("W (RANKS)")) // 2, y1 + 36, "W (RANKS)")
    for name, _, rgb in SERIES:
        pts = [(px(w), py(data[name][w])) for w in worlds if w in data[name]]
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            c.line(ax, ay, bx, by, rgb, 3)
        for x, y in pts:
            c.rect(x - 5, y - 5, x + 5, y + 5, rgb)
    if two_groups:  # the ZeRO-3 goal, dashed, over the lines
        pts = [(px(w), py(two_groups[w])) for w in worlds]
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            c.line(ax, ay, bx, by, (120, 120, 120), 2, dash=6)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_memory.py memory.tsv memory.png")
    rows = read_tsv(sys.argv[1])
    worlds = sorted({int(r["world"]) for r in rows})
    unsharded = {name: {} for name, _, _ in SERIES}
    total = {name: {} for name, _, _ in SERIES}
    two_groups = {}
    for r in rows:
        if r["series"] not in unsharded:
            sys.exit(f"plot_memory.py: unknown series {r['series']!r}")
        w = int(r["world"])
        unsharded[r["series"]][w] = float(r["peak_unsharded_mib"])
        total[r["series"]][w] = float(r["peak_unsharded_mib"]) + float(r["sharded_state_mib"])
        two_groups[w] = float(r["two_groups_mib"])

    W, H = 1400, 640
    c = Canvas(W, H)
    title = "MEMORY PER RANK (MIB) AGAINST THE WORLD SIZE"
    c.text((W - c.text_width(title)) // 2, 12, title)
    panel(c, (110, 90, 660, 400), "PEAK UNSHARDED WEIGHTS + GRADS", worlds, unsharded,
          two_groups)
    panel(c, (820, 90, 1370, 400), "THAT + SHARDED STATE (SHARDS, OPTIMIZERS)", worlds, total)

    ly = 480
    for i, (name, label, rgb) in enumerate(SERIES):
        x = 110 + (i % 2) * 660
        y = ly + (i // 2) * 30
        c.rect(x, y + 2, x + 30, y + 11, rgb)
        c.text(x + 42, y, label)
    y = ly + 60
    c.line(110, y + 7, 140, y + 7, (120, 120, 120), 2, dash=6)
    c.text(152, y, "TWO GROUPS' WORTH (ZERO-3 GOAL: AT MOST THIS)")
    c.text(110, y + 36, "ACTIVATIONS ARE IN NEITHER. SHARDED STATE: MAIN WEIGHT / PARAMETER AND")
    c.text(110, y + 60, "GRADIENT SHARDS, ADAMW MOMENTS, MUON MOMENTUM, AS ALLOCATED AFTER A STEP")

    with open(sys.argv[2], "wb") as f:
        f.write(c.png())
    print(f"plot_memory.py: wrote {sys.argv[2]} ({W}x{H})")


if __name__ == "__main__":
    main()
