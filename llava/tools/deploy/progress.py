"""Progress reporting: line and byte progress callbacks, human-readable sizes and durations."""

from __future__ import annotations

import sys
from collections.abc import Callable

Progress = Callable[[str], None]
ByteProgress = Callable[[int, int], None]


def print_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def default_byte_progress(total: int, label: str) -> tuple[ByteProgress, Callable[[], None]]:
    """A tqdm bar on stderr when tqdm is installed, else a line every 5%."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with the engine extra
        tqdm = None
    if tqdm is not None:
        bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label, file=sys.stderr
        )

        def update(done: int, _total: int) -> None:
            bar.update(done - bar.n)

        return update, bar.close
    last = [-1]

    def report(done: int, all_bytes: int) -> None:  # pragma: no cover
        step = int(20 * done / all_bytes) if all_bytes else 20
        if step != last[0]:
            last[0] = step
            print_stderr(f"{label}: {human_bytes(done)} / {human_bytes(all_bytes)} ({5 * step}%)")

    return report, lambda: None


def format_elapsed(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s"
