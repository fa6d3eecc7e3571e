"""The benchmarks' plots: matplotlib without a display, each PNG written whole."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    """Lay out and write fig as a PNG at path (through a temporary file: a reader never sees
    half a plot), then free it."""
    fig.tight_layout()
    tmp = path.with_suffix(".png.tmp")
    fig.savefig(tmp, format="png", dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    os.replace(tmp, path)
