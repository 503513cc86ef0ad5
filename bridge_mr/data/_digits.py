"""scikit-learn's digits as a federated dataset: the examples' and the tests' one loader."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ._dataset import FederatedDataset, Partitioner


def digits(
    partition: Partitioner,
    *,
    shape: Sequence[int] = (64,),
    test_fraction: float = 0.2,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[FederatedDataset, dict[str, torch.Tensor]]:
    """scikit-learn's digits (1797 8x8 images, 10 classes), federated, and a held-out test set.

    The images are scaled to [0, 1] float32 and reshaped to `shape` per example (`(64,)`,
    `(1, 8, 8)` for NCHW convolutions, `(8, 8, 1)` for NHWC); labels `"y"` are int64. A
    stratified `test_fraction` is held out (scikit-learn's `train_test_split`, `random_state=
    seed`); the rest is split over the clients by `partition`. Needs scikit-learn (its digits
    ship with it: nothing is downloaded).

    Args:
      partition: a partitioner of the training examples, e.g. `Shards(64)` or `IID(16)`.
      shape: each image's shape, 64 elements.
      test_fraction: the held-out fraction, in (0, 1).
      seed: the test split's seed (the partitioner has its own).
      device: where the examples live (the dataset's and the test set's).

    Returns:
      `(train, test)`: the federated training set (fields "x", "y") and `{"x": ..., "y": ...}`.

    Raises:
      ValueError: a `shape` of other than 64 elements, `test_fraction` out of range, and what
        the partitioner and `FederatedDataset.from_tensors` raise.
      ModuleNotFoundError: scikit-learn is not installed.

    Example:
      >>> train, test = bridge_mr.data.digits(bridge_mr.data.IID(num_clients=16), shape=(1, 8, 8))
      >>> train.num_clients, train.examples["x"].shape, test["y"].shape
      (16, torch.Size([1437, 1, 8, 8]), torch.Size([360]))
    """
    shape = tuple(shape)
    if int(np.prod(shape)) != 64:
        raise ValueError(
            f"digits(shape=...): expected an image shape of 64 elements, e.g. (64,), (1, 8, 8) "
            f"or (8, 8, 1), got {shape}."
        )
    if isinstance(test_fraction, bool) or not (
        isinstance(test_fraction, float) and 0 < test_fraction < 1
    ):
        raise ValueError(
            f"digits(test_fraction=...): expected a float in (0, 1), got {test_fraction!r}."
        )
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "bridge_mr.data.digits needs scikit-learn (its digits ship with it): "
            "pip install scikit-learn",
            name=error.name,
        ) from error
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype(np.float32).reshape(-1, *shape),
        y.astype(np.int64),
        test_size=test_fraction,
        stratify=y,
        random_state=seed,
    )
    train = FederatedDataset.from_tensors(
        {"x": torch.from_numpy(x_train), "y": torch.from_numpy(y_train)}, partition, device=device
    )
    test = {"x": torch.from_numpy(x_test).to(device), "y": torch.from_numpy(y_test).to(device)}
    return train, test
