"""A replica's output cut into lines of bounded length, whatever it prints: every backend's ``lines()``
reads its replicas' output through here, so a replica that prints a gigabyte without a newline costs
the pipeline one line's worth of memory, and the supervisor's log one line."""

from __future__ import annotations

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
