"""One writer per directory (a checkpoint directory, the NVMe tier's), and an error that says
who holds it.

An advisory ``flock`` on ``DIR/.writer.lock``: the kernel drops it when the holder dies (a
SIGKILL leaves no stale lock to clean up), and the file records who took it. The holder
deletes the file on release; a taker checks that the file it locked is still the one on disk,
so a release racing a take never lets two writers in.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import socket
import sys
import time

NAME = ".writer.lock"


class LockedError(RuntimeError):
    """Another process writes into the directory; the message names it."""


class WriterLock:
    """``what`` names the directory in the refusal, ``fix`` says what to do instead."""

    def __init__(self, directory: pathlib.Path, what: str = "checkpoint directory",
                 fix: str = "wait for it to finish, or use another directory"):
        self.path = pathlib.Path(directory) / NAME
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise LockedError(f"{what} {directory} is being written by {self.holder()}: "
                                  f"{fix}") from None
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # released and deleted between our open and our lock: try again
        self.fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(sys.argv)}).encode())

    def holder(self) -> str:
        try:
            h = json.loads(self.path.read_text())
            return f"process {h['pid']} on {h['host']} since {h['since']} ({h['command']})"
        except (OSError, ValueError, KeyError):
            return "another process"

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None
