"""Token streams and the batches cut from them.

The default corpus is the Python standard library's own source, read as bytes: it ships with
every Python, needs no download, and a byte-level model visibly learns its syntax in minutes.
Batch ``i`` depends only on the seed and ``i``, so a run can be replayed or resumed exactly.
"""

from __future__ import annotations

import pathlib
import sysconfig

import numpy as np

DEFAULT_BYTES = 4 << 20
HELD_OUT = 0.1  # the stream's last tenth, for evaluation (train.eval_every), as nanoGPT splits
EVAL_SEED = 2**32  # held-out windows drawn alike in every run: no train.seed is this large


def stdlib_corpus(limit: int = DEFAULT_BYTES) -> np.ndarray:
    """The first ``limit`` bytes of the standard library's top-level modules, sorted by name."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], np.uint8)


def load_tokens(path: str | None) -> np.ndarray:
    """Token ids from ``path``: a ``.bin`` of uint16 ids (nanoGPT's format; ``.BIN`` too), a
    text file, or a directory of text files (bytes as ids 0-255); the standard library when
    ``path`` is None. Anything else (a FIFO, a device) is refused before it is opened: reading
    one blocks, or never ends."""
    if path is None:
        return stdlib_corpus()
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file {path} does not exist: pass an existing text file, "
                                "directory of text files, or .bin of uint16 token ids")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        return np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8)
    if not p.is_file():
        raise ValueError(f"data file {path} is not a regular file or directory (a FIFO or a "
                         "device, which would be read without end): pass a text file, a "
                         "directory of text files, or a .bin of uint16 token ids")
    if p.suffix.lower() != ".bin":
        return np.frombuffer(p.read_bytes(), np.uint8)
    size = p.stat().st_size
    if size == 0 or size % 2:
        raise ValueError(f"data file {path} holds {size} bytes, not a whole number of uint16 "
                         f"token ids (2 bytes each{', and at least one' if not size else ''}): "
                         "a .bin is nanoGPT's token ids; rewrite it, or rename a text file")
    return np.memmap(p, dtype=np.uint16, mode="r")


def check_tokens(tokens: np.ndarray, vocab_size: int, seq_len: int, source: str) -> None:
    if len(tokens) < seq_len + 2:
        raise ValueError(f"{source} holds {len(tokens)} tokens, fewer than one sequence of "
                         f"{seq_len + 1}: use more data or a smaller model.seq_len")
    top = int(tokens.max())
    if top >= vocab_size:
        raise ValueError(f"{source} has token id {top} but model.vocab_size is {vocab_size}: "
                         f"set --set model.vocab_size={top + 1} or larger")


def batch(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int,
          rows: slice = slice(None)) -> np.ndarray:
    """``(batch_size, seq_len + 1)`` int32 windows at positions drawn from (seed, step); with
    ``rows``, only those rows of it (one process's slice: the positions of the whole batch are
    drawn, so the rows are the same however the batch is split, but only these are read)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)[rows]
    return np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int32)


def held_out(tokens: np.ndarray, seq_len: int, source: str) -> tuple[np.ndarray, np.ndarray]:
    """The stream cut in two, the first nine tenths to train on and the last tenth to evaluate
    on: no window of one reads the other."""
    cut = int(len(tokens) * (1 - HELD_OUT))
    if len(tokens) - cut < seq_len + 2:
        raise ValueError(f"{source}'s last tenth, held out for train.eval_every, holds "
                         f"{len(tokens) - cut} tokens, fewer than one sequence of {seq_len + 1}: "
                         "use more data, a smaller model.seq_len, or train.eval_every=0")
    return tokens[:cut], tokens[cut:]


def eval_batch(held: np.ndarray, j: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Held-out batch ``j``: the same windows whatever the run's seed, so that runs compare."""
    return batch(held, j, batch_size, seq_len, EVAL_SEED)
