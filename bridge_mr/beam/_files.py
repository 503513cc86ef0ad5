"""Client records and results through Beam's `FileSystems`: any path a worker can open.

`run` writes the stacked records as `.npy` files under a directory every worker can reach (the
pipeline's `temp_location`: a local path, `gs://`, `s3://`, ...; a local temporary directory
when none is given), and each bundle reads its rows back with a seek into the file. The
pipeline's result comes back the same way.
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from apache_beam.io.filesystems import FileSystems

_UNCOMPRESSED = "uncompressed"


def new_directory(base: str) -> str:
    """A fresh directory under `base` for one run's files (created where the scheme needs it).

    Args:
        base: A path of any Beam filesystem (local, gs://, s3://, ...).

    Returns:
        The new directory's path.
    """
    path = FileSystems.join(base, f"bridge_mr_beam_{uuid.uuid4().hex}")
    FileSystems.mkdirs(path)
    return path


def join(directory: str, name: str) -> str:
    """The path of `name` in `directory` (any Beam filesystem)."""
    return FileSystems.join(directory, name)


def write_array(path: str, array: np.ndarray[Any, Any]) -> None:
    """Writes `array` as an `.npy` file at `path`."""
    with FileSystems.create(path, compression_type=_UNCOMPRESSED) as f:
        np.lib.format.write_array(f, np.ascontiguousarray(array), allow_pickle=False)


def read_rows(path: str, start: int, stop: int) -> np.ndarray[Any, Any]:
    """Rows `start:stop` (along the first axis) of the `.npy` file at `path`, read with a seek.

    Raises:
        ValueError: The file is not a C-ordered `.npy` array with at least `stop` rows.
    """
    with FileSystems.open(path, compression_type=_UNCOMPRESSED) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"bridge_mr.beam: {path} has .npy format {version}; expected 1.0/2.0.")
        if fortran_order or not shape or shape[0] < stop:
            raise ValueError(
                f"bridge_mr.beam: {path} does not hold rows {start}:{stop} of a C-ordered array "
                f"(it holds shape {shape}, fortran_order={fortran_order}); was it overwritten?"
            )
        row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        f.seek(f.tell() + start * row)
        data = f.read((stop - start) * row)
    return np.frombuffer(data, dtype=dtype).reshape((stop - start, *shape[1:]))


def write_object(path: str, value: Any) -> None:
    """Pickles `value` to `path`."""
    with FileSystems.create(path, compression_type=_UNCOMPRESSED) as f:
        f.write(pickle.dumps(value))


def read_object(path: str) -> Any:
    """Unpickles the value at `path` (written by `write_object` in this run)."""
    with FileSystems.open(path, compression_type=_UNCOMPRESSED) as f:
        return pickle.loads(f.read())


def exists(path: str) -> bool:
    """Whether `path` exists."""
    return FileSystems.exists(path)


def delete_tree(paths: Sequence[str]) -> None:
    """Deletes `paths` (files or directories) where they exist."""
    existing = [p for p in paths if exists(p)]
    if existing:
        FileSystems.delete(existing)
