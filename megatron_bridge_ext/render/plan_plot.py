"""``mbx plan --plot``: a stacked bar per option (the config as is, then each evaluated lever), with the device
size, each option's usable share, and a title naming the config and the device.

The option names under the bars are long (``recompute_modules=['core_attn', 'mlp']``): they are wrapped
between words, and the figure is widened until no two labels overlap, measured on the drawn labels.
"""

from __future__ import annotations

import textwrap

from megatron_bridge_ext.sizes import GIB, gib

LABEL_WIDTH = 18
"""Characters per line of an option's name under its bar."""
LABEL_GAP_PX = 8
"""Space kept between two neighbouring labels, in pixels at the figure's resolution."""
TITLE_WIDTH = 110
"""Characters per line of the title."""


def tick_label(label: str, width: int = LABEL_WIDTH) -> str:
    """An option's name under its bar, wrapped between words only (a long word keeps its own line)."""
    return textwrap.fill(label, width, break_long_words=False, break_on_hyphens=False)


def title(config_line: str, result) -> str:
    """The config (as the text plan's ``config:`` line says it) and the device, wrapped."""
    device = f"device: {gib(result.gpu_memory)} per GPU, {result.gpu.name} step times"
    return "\n".join(textwrap.wrap(f"{config_line}; {device}", TITLE_WIDTH))


def figure(result, config_line: str):
    """The plot as a matplotlib figure (drawn, its labels clear of each other)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_bridge_ext.planner import breakdown

    bars = [("as is", breakdown(result.baseline), result.usable_now)]
    bars += [(f"{o.step}: {o.label}", o.breakdown, o.usable_bytes) for o in result.options if o.applicable and o.breakdown]
    fig, ax = plt.subplots(figsize=(3 + 1.5 * len(bars), 5))
    top = _stack(ax, bars)
    ax.set_ylim(0, 1.05 * max(top, result.gpu_memory / GIB))
    ax.axhline(result.gpu_memory / GIB, color="black", linewidth=1, label="device memory")
    for x, (_, _, usable) in enumerate(bars):
        ax.hlines(usable / GIB, x - 0.45, x + 0.45, colors="black", linestyles="--", linewidth=1,
                  label="usable after the margin" if x == 0 else None)
    ax.set_xticks(range(len(bars)), [tick_label(label) for label, _, _ in bars], fontsize=7)
    ax.set_ylabel("GiB per GPU at the peak (2^30 bytes)")
    ax.set_title(title(config_line, result), fontsize=7, loc="left")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _widen_until_labels_clear(fig, ax)
    return fig


def _stack(ax, bars) -> float:
    """One stacked bar per option, a colour per component; returns the tallest bar's top (GiB)."""
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(k for _, parts, _ in bars for k in parts))
    colours = plt.get_cmap("tab20").colors
    bottoms = [0.0] * len(bars)
    for index, key in enumerate(keys):
        values = [parts.get(key, 0) / GIB for _, parts, _ in bars]
        ax.bar(range(len(bars)), values, bottom=bottoms, label=key, color=colours[index % len(colours)])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    return max(bottoms)


def _widen_until_labels_clear(fig, ax, tries: int = 5) -> None:
    """Lay the figure out, then widen it by what the widest label lacks of the bar spacing (a few passes, as
    the layout moves the axes each time)."""
    for _ in range(tries):
        fig.tight_layout()
        fig.canvas.draw()
        shortfall = label_overlap_px(ax)
        if shortfall <= 0:
            return
        labels = len(ax.get_xticklabels())
        fig.set_figwidth(fig.get_figwidth() + shortfall * labels / fig.dpi)


def label_overlap_px(ax) -> float:
    """How far (pixels) the closest pair of neighbouring tick labels overlaps, gap included; <= 0 when clear."""
    boxes = sorted((t.get_window_extent() for t in ax.get_xticklabels()), key=lambda b: b.x0)
    return max((left.x1 + LABEL_GAP_PX - right.x0 for left, right in zip(boxes, boxes[1:])), default=0.0)


def plot(result, path: str, config_line: str) -> None:
    """Write the figure to ``path`` (the format from its extension, as matplotlib decides)."""
    import matplotlib.pyplot as plt

    fig = figure(result, config_line)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
