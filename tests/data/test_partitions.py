"""bridge_mr.data's partitioners and datasets: statistics, determinism, bad input."""

from __future__ import annotations

import pytest
import torch

from bridge_mr import data as fd

N, LABELS = 2000, 10


def _examples(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(N, 3, generator=g), "y": torch.randint(0, LABELS, (N,), generator=g)}


def _label_histograms(ids: torch.Tensor, y: torch.Tensor, clients: int) -> torch.Tensor:
    """[clients, labels]: how many examples of each label each client holds."""
    return torch.bincount(ids * LABELS + y, minlength=clients * LABELS).view(clients, LABELS)


PARTITIONERS = {
    "iid": fd.IID(num_clients=40, seed=3),
    "dirichlet": fd.Dirichlet(num_clients=40, alpha=0.5, seed=3),
    "shards": fd.Shards(num_clients=40, shards_per_client=2, seed=3),
}


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_every_example_in_exactly_one_client(name: str) -> None:
    examples = _examples()
    train = fd.FederatedDataset.from_tensors(examples, PARTITIONERS[name])
    assert train.num_clients == 40
    assert int(train.example_counts.sum()) == N
    assert int(train.example_counts.min()) >= 1
    # The dataset holds a permutation of the examples, client by client.
    seen = torch.cat([train.client(c)["x"] for c in range(train.num_clients)])
    assert torch.equal(seen.sort(dim=0).values, examples["x"].sort(dim=0).values)
    ids = PARTITIONERS[name](examples)
    assert ids.shape == (N,)
    assert ids.dtype == torch.int64
    for c in (0, 17, 39):
        assert torch.equal(train.client(c)["x"], examples["x"][ids == c])  # stable within a client


def test_iid_sizes_and_labels() -> None:
    examples = _examples()
    ids = fd.IID(num_clients=7, seed=0)(examples)
    counts = torch.bincount(ids)
    assert int(counts.max() - counts.min()) <= 1
    # Every client's label mix is close to the global one (IID).
    hist = _label_histograms(ids, examples["y"], 7).float()
    share = hist / hist.sum(1, keepdim=True)
    overall = torch.bincount(examples["y"], minlength=LABELS).float() / N
    assert float((share - overall).abs().sum(1).max()) < 0.35


def test_iid_of_a_fixed_size_leaves_the_rest_out() -> None:
    examples = _examples()
    ids = fd.IID(num_clients=7, examples_per_client=100, seed=0)(examples)
    assert torch.equal(torch.bincount(ids[ids >= 0]), torch.full((7,), 100))
    assert int((ids == -1).sum()) == N - 700
    with pytest.raises(ValueError, match=r"IID: 7 clients of 300 example\(s\) need 2100"):
        fd.IID(num_clients=7, examples_per_client=300)(examples)


def test_iid_of_equal_parts_and_iid_of_a_size_alone() -> None:
    examples = _examples()
    # drop_remainder: 2000 // 7 = 285 each, the same deal as asking for 285 a client.
    equal = fd.IID(num_clients=7, drop_remainder=True, seed=2)(examples)
    assert torch.equal(equal, fd.IID(num_clients=7, examples_per_client=285, seed=2)(examples))
    assert torch.equal(torch.bincount(equal[equal >= 0]), torch.full((7,), 285))
    # A size alone: as many clients as the examples fill, the same deal again.
    sized = fd.IID(examples_per_client=300, seed=2)(examples)
    assert torch.equal(sized, fd.IID(num_clients=6, examples_per_client=300, seed=2)(examples))
    assert int(sized.max()) == 5
    assert int((sized == -1).sum()) == N - 6 * 300
    with pytest.raises(ValueError, match=r"IID: 2001 clients of at least 1 example\(s\) need 2001"):
        fd.IID(num_clients=2001, drop_remainder=True)(examples)
    with pytest.raises(ValueError, match=r"examples_per_client=2001\): one client .* got 2000\."):
        fd.IID(examples_per_client=2001)(examples)


def test_dirichlet_alpha_controls_label_skew() -> None:
    examples = _examples()
    overall = torch.bincount(examples["y"], minlength=LABELS).float() / N

    def stats(alpha: float) -> tuple[float, float]:
        ids = fd.Dirichlet(num_clients=20, alpha=alpha, seed=1)(examples)
        hist = _label_histograms(ids, examples["y"], 20).float()
        labels_per_client = float((hist > 0).sum(1).float().mean())
        share = hist / hist.sum(1, keepdim=True)
        distance = float(0.5 * (share - overall).abs().sum(1).mean())  # total variation
        return labels_per_client, distance

    few_labels, skewed = stats(0.05)
    all_labels, iid_like = stats(1000.0)
    assert few_labels < 3.5, few_labels  # alpha small: a few labels per client
    assert skewed > 0.6, skewed
    assert all_labels == LABELS  # alpha large: every label everywhere, in global proportions
    assert iid_like < 0.1, iid_like


def test_dirichlet_min_examples_and_failure() -> None:
    examples = _examples()
    ids = fd.Dirichlet(num_clients=30, alpha=0.3, min_examples=10, seed=0)(examples)
    assert int(torch.bincount(ids, minlength=30).min()) >= 10
    with pytest.raises(ValueError, match=r"min_examples=60 .*Fix: a larger alpha"):
        fd.Dirichlet(num_clients=30, alpha=0.01, min_examples=60, seed=0)(examples)


def test_shards_give_few_labels() -> None:
    y = torch.arange(1000) % LABELS
    ids = fd.Shards(num_clients=50, shards_per_client=2, seed=0)({"y": y})
    hist = _label_histograms(ids, y, 50)
    labels_per_client = (hist > 0).sum(1)
    assert int(labels_per_client.max()) <= 2  # 100 shards of 10 examples: one label each
    assert torch.equal(torch.bincount(ids), torch.full((50,), 20))


def test_equal_shards_leave_the_remainder_out() -> None:
    examples = _examples()
    ids = fd.Shards(num_clients=30, shards_per_client=2, shard_size=33, seed=0)(examples)
    assert int((ids == -1).sum()) == N - 30 * 2 * 33
    train = fd.FederatedDataset.from_tensors(examples, ids)  # -1: in no client
    assert torch.equal(train.example_counts, torch.full((30,), 66))
    assert int(train.examples["x"].shape[0]) == 30 * 66
    for c in (0, 29):
        assert torch.equal(train.client(c)["x"], examples["x"][ids == c])
    hist = _label_histograms(ids.clamp(min=0), examples["y"], 30)
    assert float((hist > 0).sum(1).float().mean()) <= 3.0  # about two labels each
    with pytest.raises(ValueError, match=r"of 40 example\(s\) need 2400 examples, got 2000"):
        fd.Shards(num_clients=30, shards_per_client=2, shard_size=40)(examples)


def test_shards_of_equal_size_drop_the_remainder() -> None:
    examples = _examples()
    # 2000 // (30 x 2) = 33 a shard: the deal of shard_size=33.
    ids = fd.Shards(num_clients=30, drop_remainder=True, seed=1)(examples)
    assert torch.equal(ids, fd.Shards(num_clients=30, shard_size=33, seed=1)(examples))
    assert torch.equal(torch.bincount(ids[ids >= 0]), torch.full((30,), 66))
    with pytest.raises(ValueError, match=r"1001 clients x 2 shards of at least 1 .* need 2002"):
        fd.Shards(num_clients=1001, drop_remainder=True)(examples)


def test_natural_key() -> None:
    users = torch.tensor([42, 7, 42, 1000, 7, 7])
    train = fd.FederatedDataset.from_tensors(
        {"user": users, "x": torch.arange(6.0)}, fd.NaturalKey("user")
    )
    assert train.example_counts.tolist() == [3, 2, 1]  # keys 7, 42, 1000 in order
    assert train.client(1)["x"].tolist() == [0.0, 2.0]


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_partitions_are_deterministic_by_seed(name: str) -> None:
    examples = _examples()
    partitioner = PARTITIONERS[name]
    assert torch.equal(partitioner(examples), partitioner(examples))
    other = type(partitioner)(**{**vars(partitioner), "seed": 4})
    assert not torch.equal(partitioner(examples), other(examples))


def test_from_clients_and_from_dataset() -> None:
    a = {"x": torch.ones(2, 3), "y": torch.tensor([1, 2])}
    b = {"x": torch.zeros(4, 3), "y": torch.tensor([3, 4, 5, 6])}
    train = fd.FederatedDataset.from_clients({"ann": a, "bob": b})
    assert train.client_keys == ("ann", "bob")
    assert torch.equal(train.client(1)["y"], b["y"])
    pairs = torch.utils.data.TensorDataset(torch.randn(9, 2), torch.arange(9))
    read = fd.FederatedDataset.from_dataset(pairs, torch.arange(9) % 3, names=("x", "y"))
    assert read.client(2)["y"].tolist() == [2, 5, 8]
    assert torch.equal(read.client(2)["x"], pairs.tensors[0][2::3])


def test_digits() -> None:
    train, test = fd.digits(fd.Shards(num_clients=64, seed=0), shape=(8, 8, 1))
    assert train.examples["x"].shape == (1437, 8, 8, 1)
    assert test["x"].shape == (360, 8, 8, 1)
    assert test["y"].dtype == torch.int64
    assert float(train.examples["x"].max()) == 1.0
    assert int(train.example_counts.sum()) == 1437


def test_bad_input_is_named() -> None:
    examples = _examples()
    with pytest.raises(ValueError, match=r"client 2 \(of 4\) with none.*Fix"):
        fd.FederatedDataset.from_tensors({"x": torch.arange(3.0)}, torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match=r"label key 'label'.*got keys \['x', 'y'\].*Fix"):
        fd.FederatedDataset.from_tensors(examples, fd.Dirichlet(10, alpha=1.0, label="label"))
    with pytest.raises(ValueError, match=r"examples\['x'\] to hold one integer label"):
        fd.Shards(10, label="x")(examples)
    with pytest.raises(ValueError, match=r"Dirichlet\(alpha=...\): expected a concentration > 0"):
        fd.Dirichlet(10, alpha=0.0)
    with pytest.raises(ValueError, match=r"IID\(num_clients=...\): expected an int >= 1, got 0"):
        fd.IID(0)
    with pytest.raises(ValueError, match=r"IID: expected num_clients=.*or both, got neither"):
        fd.IID()
    with pytest.raises(ValueError, match=r"drop_remainder=True\): .*examples_per_client=5\. Fix"):
        fd.IID(num_clients=3, examples_per_client=5, drop_remainder=True)
    with pytest.raises(ValueError, match=r"got num_clients=None, examples_per_client=5\. Fix"):
        fd.IID(examples_per_client=5, drop_remainder=True)
    with pytest.raises(TypeError, match=r"IID\(drop_remainder=...\): expected a bool, got 1"):
        fd.IID(3, drop_remainder=1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"Shards\(drop_remainder=True\): .*shard_size=4\. Fix"):
        fd.Shards(3, shard_size=4, drop_remainder=True)
    with pytest.raises(TypeError, match=r"Shards\(drop_remainder=...\): expected a bool"):
        fd.Shards(3, drop_remainder="yes")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"same number of examples.*'x': 3, 'y': 2"):
        fd.FederatedDataset.from_tensors({"x": torch.ones(3), "y": torch.ones(2)}, fd.IID(1))
    with pytest.raises(ValueError, match=r"client_ids=...\): expected one client id >= 0"):
        fd.FederatedDataset.from_tensors({"x": torch.ones(3)}, torch.tensor([0.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"other than 'mask'"):
        fd.FederatedDataset.from_tensors({"mask": torch.ones(3)}, fd.IID(1))
    with pytest.raises(ValueError, match=r"fields \['x'\] \(as 'a'\), got \['z'\] for 'b'"):
        fd.FederatedDataset.from_clients({"a": {"x": torch.ones(1)}, "b": {"z": torch.ones(1)}})
    with pytest.raises(TypeError, match=r"Fix: names=\(...\)"):
        fd.FederatedDataset.from_dataset(torch.utils.data.TensorDataset(torch.ones(2)), fd.IID(1))
