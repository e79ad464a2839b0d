"""A replica's output cut into lines of bounded length, whatever it prints: every backend's ``lines()``
reads its replicas' output through here, so a replica that prints a gigabyte without a newline costs
the pipeline one line's worth of memory, and the supervisor's log one line. And what of TensorFlow's
start-up output says nothing to act on (``startup_noise``), left out where a replica or a stage
loads it (``stderr_captured``)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator

# Far longer than any line TensorFlow or Python prints (a traceback's line, a tensor's summary).
LINE_LIMIT = 16 * 1024
READ_SIZE = 64 * 1024


def cut_lines(chunks: Iterable[bytes], limit: int = LINE_LIMIT) -> Iterator[bytes]:
    """``chunks`` again, each line longer than ``limit`` bytes cut there: the rest of it is dropped
    as it arrives, and its end says how many bytes were dropped."""
    kept = dropped = 0  # bytes of the line in progress
    for chunk in chunks:
        out = []
        *ended, going_on = chunk.split(b"\n")
        for piece in ended:
            head = piece[: max(0, limit - kept)]
            cut = dropped + len(piece) - len(head)
            out += [head, f" [{cut} bytes cut]\n".encode() if cut else b"\n"]
            kept = dropped = 0
        head = going_on[: max(0, limit - kept)]
        out.append(head)
        kept += len(head)
        dropped += len(going_on) - len(head)
        yield b"".join(out)
    if dropped:
        yield f" [{dropped} bytes cut]".encode()


def output_lines(chunks: Iterable[bytes], limit: int = LINE_LIMIT) -> Iterator[str]:
    """The lines of ``chunks``, cut at ``limit`` bytes, decoded; the last one even without its newline."""
    pending = b""
    for chunk in cut_lines(chunks, limit):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            yield raw.decode("utf-8", "replace").rstrip()
    if pending:
        yield pending.decode("utf-8", "replace").rstrip()


# TensorFlow's log lines (absl's format: ``I0000 00:00:1796.. 8821 cudart_stub.cc:31] message``).
_ABSL_LINE = re.compile(r"^[IWEF]\d{4} \S+ +\d+ (?P<source>[\w.]+):\d+\] (?P<message>.*)$")
# What TensorFlow prints while it loads that asks nothing of anyone: absl's note that it writes to
# stderr until it is set up (each of TensorFlow's two libraries says it), oneDNN's note on round-off,
# and the CPU instructions a rebuilt binary could use (two lines, the second unprefixed). Any other
# line is kept, TensorFlow's or not.
_STARTUP_NOTES = {
    ("port.cc", "oneDNN custom operations are on."),
    ("cpu_feature_guard.cc", "This TensorFlow binary is optimized"),
}
_STARTUP_PLAIN_LINES = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "To enable the following instructions: ",
)
# TensorFlow's look for CUDA, which finds none on a machine without a GPU: noise where no GPU is
# wanted, the cause where one is.
_CUDA_PROBING = {
    ("cudart_stub.cc", "Could not find cuda drivers on your machine"),
    ("cuda_platform.cc", "failed call to cuInit"),
}


def startup_noise(line: str, gpu_wanted: bool = False) -> bool:
    """Whether ``line`` is one of TensorFlow's start-up lines that say nothing to act on: its notes
    while it loads, and its probing for CUDA unless a GPU is wanted."""
    if line.startswith(_STARTUP_PLAIN_LINES):
        return True
    logged = _ABSL_LINE.match(line)
    if logged is None:
        return False
    known = _STARTUP_NOTES if gpu_wanted else _STARTUP_NOTES | _CUDA_PROBING
    return any(logged["source"] == source and logged["message"].startswith(start) for source, start in known)


@contextlib.contextmanager
def stderr_captured() -> Iterator[list[str]]:
    """File descriptor 2 (where TensorFlow's C++ code and libraries write, not only Python) into an
    anonymous file for the block, then back; the list it yields then holds what was written there,
    a line each (a progress bar's every state too: it redraws its line with carriage returns)."""
    captured_lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield captured_lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", "replace")
            captured_lines += [line.rstrip() for line in re.split(r"[\r\n]+", text) if line.strip()]
