"""Bounded reads of the small input files kvkit takes (prompt files, calibration files, DuoAttention patterns).

A leaf module (standard library only): every layer may import it, policies included. :func:`read_file_bytes`
checks that the path names a regular file within a size limit *before* reading anything (``/dev/zero``, a FIFO,
a directory or a symlink loop is refused by name, never read without end or blocked on), reads at most
``limit + 1`` bytes (a file that grows while read), and raises :class:`FileReadError` (a ``ValueError``) whose
one-line message starts with the caller's ``what`` and names the file and the actual problem.
"""

from __future__ import annotations

import os
import stat

__all__ = ["FileReadError", "file_kind", "read_file_bytes", "read_text_file"]


class FileReadError(ValueError):
    """A file kvkit was asked to read is missing, not a regular file, too large, unreadable or not UTF-8.

    ``reason`` is one of ``"missing"``, ``"directory"``, ``"not_regular"``, ``"too_large"``, ``"unreadable"``,
    ``"not_utf8"`` (callers may word the common ones their own way)."""

    def __init__(self, message: str, reason: str, path: str):
        super().__init__(message)
        self.reason = reason
        self.path = path


def file_kind(mode: int) -> str:
    """``"a directory"``, ``"a character device"``, ... for an ``st_mode`` that is not a regular file."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def read_file_bytes(path, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit`` bytes), or a :class:`FileReadError`.

    The file is opened non-blocking (a FIFO without a writer does not hang) and checked with ``fstat`` on the
    descriptor opened (not whatever the path names by then) before anything is read."""
    path = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileReadError(f"{what} {path}: no such file", "missing", path) from None
    except IsADirectoryError:  # where open() of a directory fails (it succeeds on Linux)
        raise FileReadError(f"{what} {path} is a directory; pass a text file", "directory", path) from None
    except OSError as e:  # a symlink loop, no permission, a name too long, ...
        raise FileReadError(f"{what} {path}: cannot open it ({e.strerror})", "unreadable", path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a directory, a device (/dev/zero), a FIFO, a socket
            raise FileReadError(f"{what} {path} is {file_kind(st.st_mode)}, not a regular file; pass a text file",
                                "directory" if stat.S_ISDIR(st.st_mode) else "not_regular", path)
        too_big = f"{what} {path} is larger than the limit of {limit:,} bytes ({limit / 2**20:.0f} MiB)"
        if st.st_size > limit:
            raise FileReadError(f"{too_big}: it has {st.st_size:,} bytes", "too_large", path)
        chunks, n = [], 0
        while n <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
        if n > limit:
            raise FileReadError(too_big, "too_large", path)
    except OSError as e:
        raise FileReadError(f"{what} {path}: cannot read it ({e.strerror})", "unreadable", path) from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_text_file(path, what: str, limit: int) -> str:
    """:func:`read_file_bytes` decoded as UTF-8 (a :class:`FileReadError` naming the byte when it is not)."""
    data = read_file_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileReadError(f"{what} {os.fspath(path)} is not UTF-8 text (byte {e.start}: {e.reason})", "not_utf8",
                            os.fspath(path)) from None
