"""The start-up phases as a picture: one row per node, one coloured bar segment per phase.

Each node's row is its slowest rank (the one the node's start-up waits for), its phases laid end
to end from the step's launch, so a node that started late or imported slowly stands out without
reading a line per rank. Drawn with Pillow's ImageDraw (torchvision depends on Pillow, so every
image and the test venv have it; matplotlib is in neither). A phase no rank recorded (no
XSCALE_LAUNCH_T when srun was typed by hand) has no segment and says "unknown" in the legend;
the row then starts at the first moment that was recorded.
"""

from __future__ import annotations

import math

from PIL import Image, ImageDraw, ImageFont

from xscale.observe.startup import PHASES, RankPhases, slowest_per_node

# One colour per phase, in PHASES' order (Tableau 10: distinct, and readable when printed grey).
COLOURS = {"launch": (78, 121, 167), "run_sh": (242, 142, 43), "imports": (225, 87, 89),
           "group": (118, 183, 178), "first_step": (89, 161, 79)}
BACKGROUND, INK, GRID = (255, 255, 255), (0, 0, 0), (225, 225, 225)
WIDTH = 960
LABELS = 130  # node names, left of the bars
RIGHT = 30
HEADER = 56  # title and legend
FOOTER = 40  # the seconds axis
LARGEST_PICTURE_ROWS = 4000  # pixels of rows at most: 8,192 nodes get one pixel each
# Pillow's default font is FreeType's Aileron when Pillow has FreeType (it does from wheels); at
# its default 10 pixels the hinted spaces shrink to nothing ("itsslowest"): 13 keeps them.
FONT_PIXELS = 13


def text_font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=FONT_PIXELS)


def row_height(nodes: int) -> int:
    """22 pixels, with the node's name, for up to a few dozen nodes; thinner rows beyond, down to
    one pixel, so that thousands of nodes still make one picture."""
    return max(1, min(22, LARGEST_PICTURE_ROWS // max(nodes, 1)))


def tick_step(seconds: float) -> float:
    """A round step (1, 2 or 5 x 10^n) giving at most ten ticks over `seconds`."""
    raw = max(seconds, 1e-3) / 10
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def draw_startup(records: list[RankPhases]) -> Image.Image:
    rows = slowest_per_node(records)
    height = row_height(len(rows))
    longest = max((_span(row) for row in rows), default=0.0) or 1.0
    scale = (WIDTH - LABELS - RIGHT) / longest  # pixels per second
    image = Image.new("RGB", (WIDTH, HEADER + height * len(rows) + FOOTER), BACKGROUND)
    draw = ImageDraw.Draw(image)
    font = text_font()
    _header(draw, font, records, len(rows))
    _axis(draw, font, longest, scale, HEADER + height * len(rows))
    for index, row in enumerate(rows):
        top = HEADER + index * height
        if height >= FONT_PIXELS + 2:  # thinner rows: a name would overlap the next one's
            draw.text((6, top + (height - FONT_PIXELS) // 2), row.node[:16], fill=INK, font=font)
        _bar(draw, row, top, height, scale)
    return image


def _span(row: RankPhases) -> float:
    return sum(max(row.phases.get(p.name) or 0.0, 0.0) for p in PHASES)


def _bar(draw: ImageDraw.ImageDraw, row: RankPhases, top: int, height: int,
         scale: float) -> None:
    """The row's phases end to end; a negative one (two nodes' clocks apart) draws nothing."""
    x = float(LABELS)
    inset = 2 if height >= 8 else 0
    for phase in PHASES:
        seconds = row.phases.get(phase.name)
        if seconds is None or seconds <= 0:
            continue
        right = x + seconds * scale
        draw.rectangle([round(x), top + inset, max(round(right) - 1, round(x)),
                        top + height - 1 - inset], fill=COLOURS[phase.name])
        x = right


def _header(draw: ImageDraw.ImageDraw, font: ImageFont.ImageFont, records: list[RankPhases],
            nodes: int) -> None:
    launched = any(r.phases.get("launch") is not None for r in records)
    since = "the step's launch" if launched else "the first moment recorded"
    draw.text((6, 6), f"start-up per node (its slowest rank), {len(records)} ranks on "
                      f"{nodes} nodes: seconds since {since}", fill=INK, font=font)
    x = 6
    for phase in PHASES:
        known = any(r.phases.get(phase.name) is not None for r in records)
        draw.rectangle([x, 28, x + 14, 40], fill=COLOURS[phase.name])
        label = phase.name if known else f"{phase.name} (unknown)"
        draw.text((x + 19, 28), label, fill=INK, font=font)
        x += 19 + int(draw.textlength(label, font=font)) + 18


def _axis(draw: ImageDraw.ImageDraw, font: ImageFont.ImageFont, longest: float, scale: float,
          bottom: int) -> None:
    step = tick_step(longest)
    draw.line([LABELS, bottom + 2, WIDTH - RIGHT, bottom + 2], fill=INK)
    for index in range(int(longest / step + 1e-9) + 1):
        seconds = index * step
        x = round(LABELS + seconds * scale)
        draw.line([x, HEADER, x, bottom], fill=GRID)  # under the bars' gaps, a guide
        draw.line([x, bottom + 2, x, bottom + 7], fill=INK)
        draw.text((x - 8, bottom + 10), f"{seconds:g}", fill=INK, font=font)
    draw.text((WIDTH - RIGHT - 10, bottom + 24), "s", fill=INK, font=font)
