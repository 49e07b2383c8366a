"""Many devices at a glance: devices grouped by the plan's stages, their numbers summed up per
group, their colours a hue per stage and a shade per device, device lists said as ranges.

Up to ``GROUPED_ABOVE`` devices the explorer shows every device on its own (a number, a bar
and a colour each); above, it shows groups (:func:`device_groups`: one per stage, runs of
consecutive stages when there are more than ``MAX_GROUPS`` of them, and the unused devices),
each summed up as its smallest, median and largest value with the device that has the
largest named (:func:`spread_text`).
"""

from __future__ import annotations

import colorsys
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from explorer.core.plan import Plan

#: clusters of more devices than this are shown in groups, not device by device (from 8
#: devices on: 8 devices' numbers, bars and lanes one by one make the widget taller than a
#: screen)
GROUPED_ABOVE = 7
#: most groups shown: more stages than this are grouped in runs of consecutive stages
MAX_GROUPS = 8
#: the first eight stages' hues: eight hues spread around the colour wheel (210, 35, 125, 285,
#: 55, 325, 175 and 250 degrees, lightness 0.42, saturation 0.65), so that a stage's lighter
#: and darker shades stay nearer its own hue than any other stage's; none is the cross-device
#: edge red. Stages beyond these get hues a golden angle apart (:func:`stage_hue`).
STAGE_HUES = ("#256BB1", "#B17725", "#25B131", "#8E25B1", "#B1A525", "#B12577", "#25B1A5",
              "#3D25B1")
#: the colour of devices no stage uses
UNUSED_COLOR = "#e0e0e0"
#: how far the shades of a stage's devices go from its hue's lightness towards white and
#: towards black (0..1)
SHADE_SPAN = 0.45


@dataclass(frozen=True)
class DeviceGroup:
    """Devices shown together: ``label`` ("stage 2", "stages 0-7", "unused"), its
    ``devices`` in cluster order and the plan's ``stages`` it holds."""

    label: str
    devices: tuple[str, ...]
    stages: tuple[int, ...]


def grouped(n_devices: int) -> bool:
    """Whether a cluster of ``n_devices`` is shown in groups rather than device by device."""
    return n_devices > GROUPED_ABOVE


def device_span(ids: Iterable[str]) -> str:
    """Devices in words, consecutive numbers as ranges: "H100:0-7, H100:12, cpu:0"."""
    runs: list[list] = []  # [prefix, first, last] or [name]
    for d in ids:
        m = re.fullmatch(r"(.*?)(\d+)", d)
        if m and runs and len(runs[-1]) == 3 and runs[-1][0] == m[1] \
                and runs[-1][2] + 1 == int(m[2]):
            runs[-1][2] = int(m[2])
        elif m:
            runs.append([m[1], int(m[2]), int(m[2])])
        else:
            runs.append([d])
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}{r[1]}" if r[1] == r[2]
                     else f"{r[0]}{r[1]}-{r[2]}" for r in runs)


def device_groups(plan: Plan, ids: Sequence[str], max_groups: int = MAX_GROUPS
                  ) -> list[DeviceGroup]:
    """The groups the devices ``ids`` are shown in under ``plan``: one per stage, in stage
    order (runs of consecutive stages, about equal in number, when there are more than
    ``max_groups``), then the devices no stage uses."""
    n = len(plan.stages)
    size = max(1, -(-n // max_groups))
    out = []
    for first in range(0, n, size):
        stages = tuple(range(first, min(first + size, n)))
        members = {d for k in stages for d in plan.stages[k]}
        label = (f"stage {first}" if len(stages) == 1
                 else f"stages {stages[0]}-{stages[-1]}")
        out.append(DeviceGroup(label, tuple(d for d in ids if d in members), stages))
    used = set(plan.devices)
    unused = tuple(d for d in ids if d not in used)
    if unused:
        out.append(DeviceGroup("unused", unused, ()))
    return out


def spread_text(values: Mapping[str, float], devices: Sequence[str],
                fmt: Callable[[float], str]) -> str:
    """The values of ``devices`` (those ``values`` has) in words: one device's value, or the
    smallest, median and largest with the device that has the largest ("1.2 ms .. 1.5 ms,
    median 1.3 ms, most on H100:3")."""
    have = [(values[d], d) for d in devices if d in values]
    if not have:
        return "none"
    if len(have) == 1:
        return f"{fmt(have[0][0])} on {have[0][1]}"
    lo = min(v for v, _ in have)
    top, worst = max(have, key=lambda p: p[0])
    med = statistics.median(v for v, _ in have)
    if lo == top:
        return f"{fmt(top)} on each"
    return f"{fmt(lo)} .. {fmt(top)}, median {fmt(med)}, most on {worst}"


def worst_device(values: Mapping[str, float], devices: Iterable[str] | None = None) -> str:
    """The device (of ``devices``, default all) with the largest value ("" when none)."""
    have = [(v, d) for d, v in values.items() if devices is None or d in set(devices)]
    return max(have, key=lambda p: p[0])[1] if have else ""


def _rgb(color: str) -> tuple[float, float, float]:
    return tuple(int(color[k:k + 2], 16) / 255 for k in (1, 3, 5))  # type: ignore[return-value]


def _hex(rgb: Iterable[float]) -> str:
    return "#" + "".join(f"{round(min(1.0, max(0.0, c)) * 255):02x}" for c in rgb)


def shade(color: str, amount: float) -> str:
    """``color`` (``#rrggbb``) lighter (``amount`` > 0) or darker (< 0) by ``abs(amount)``
    of the way to white or black, its hue and saturation kept."""
    h, light, sat = colorsys.rgb_to_hls(*_rgb(color))
    light += amount * ((1 - light) if amount > 0 else light)
    return _hex(colorsys.hls_to_rgb(h, light, sat))


def stage_hue(k: int) -> str:
    """Stage ``k``'s hue: one of ``STAGE_HUES``, then hues a golden angle apart on the colour
    wheel at three lightnesses."""
    if k < len(STAGE_HUES):
        return STAGE_HUES[k]
    j = k - len(STAGE_HUES)
    hue = (0.1 + j * 0.381966) % 1.0
    light = (0.42, 0.56, 0.32)[j % 3]
    return _hex(colorsys.hls_to_rgb(hue, light, 0.65))


def device_shade(base: str, j: int, n: int) -> str:
    """The shade of the ``j``-th of a stage's ``n`` devices: the first the stage's hue, the
    others in turn lighter and darker, up to ``SHADE_SPAN`` for the last ones."""
    if j == 0 or n <= 1:
        return base
    steps = n // 2 + 1
    amount = SHADE_SPAN * ((j + 1) // 2) / steps
    return shade(base, amount if j % 2 else -amount)


def stage_colors(plan: Plan, ids: Sequence[str]) -> dict[str, str]:
    """Each device's colour under ``plan``: a hue per stage (:func:`stage_hue`), a shade per
    device within it (:func:`device_shade`; the stage's first device has the hue itself, as
    the items of a stage are drawn), ``UNUSED_COLOR`` for the devices no stage uses."""
    out = dict.fromkeys(ids, UNUSED_COLOR)
    for k, devs in enumerate(plan.stages):
        base = stage_hue(k)
        for j, d in enumerate(devs):
            out[d] = device_shade(base, j, len(devs))
    return out


def mix_text(plan: Plan, stages: Sequence[int]) -> str:
    """What a "mixed" item holds, from the stage of each of its ops (``stages``): how many
    stages and devices, and each stage's share of the ops, largest first ("mixed: 2 stages,
    9 devices: stage 0 (H100:0-7) 75%, stage 1 (H100:8) 25%")."""
    counts = Counter(stages)
    devices = {d for k in counts for d in plan.stages[k]}
    total = sum(counts.values())
    shares = [f"stage {k} ({device_span(plan.stages[k])}) {c / total:.0%}"
              for k, c in sorted(counts.items(), key=lambda kc: (-kc[1], kc[0]))]
    head = f"mixed: {len(counts)} stages, {len(devices)} device{'s' * (len(devices) != 1)}"
    return f"{head}: {', '.join(shares)}"
