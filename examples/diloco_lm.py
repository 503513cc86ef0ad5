"""DiLoCo on a character-level transformer LM written in torch, trained on Python's own stdlib.

    OMP_NUM_THREADS=1 python examples/diloco_lm.py --quick   # about 3 minutes on 2 CPU cores
    OMP_NUM_THREADS=1 python examples/diloco_lm.py           # the full run (docs/demo.md: times)

(OMP_NUM_THREADS=1: on a busy machine eager torch's two intra-op threads wait on each other;
the single-replica baseline's 100 quick steps took 117 s with them and 5 s without.)

The corpus ships with every Python: the `.py` files of the standard library (its regression
tests, `test/`, left out). Its top-level modules and packages, in alphabetical order, are cut
into `--replicas` contiguous groups of about equal size, one per replica, so every replica
learns from different code (non-IID: `dis` to `email` on one, `quopri` to `tkinter` on
another); the modules whose name hashes to 0 mod 8 (`asyncio`, `unittest`, `lib2to3`, ...) are
held out for evaluation. Tokens are bytes (a vocabulary of 256).

The model (token and position embeddings, pre-LayerNorm blocks of causal multi-head attention
by `F.scaled_dot_product_attention` and a GELU MLP, a linear head) and its loss are plain
torch; `bridge_mr.from_torch` runs that loss as JAX. Three trainings from the same initial
model, at equal compute (every method makes `rounds x H` optimizer steps of batch `--batch`
per replica, on the same batches):

* DiLoCo (`bridge_mr.algorithms`): each round every replica takes H AdamW steps (optax) from
  the server's model, inside one `map_reduce` program; the replicas' mean delta is the
  pseudo-gradient of an outer Nesterov SGD step (torch.optim, lr 0.7, momentum 0.9).
  Communication: the parameters down and the delta up, once per H steps. Each round starts
  every replica's AdamW state afresh (`local_training` sends parameters only); DiLoCo as
  published keeps each worker's inner optimizer state across rounds.
* Data-parallel AdamW (FedSGD): every step, `bridge_mr.map_reduce` averages the replicas'
  gradients on their own batches, and torch.optim.AdamW steps the model. Communication: a
  gradient up and the parameters down, every step.
* Single replica: replica 0 alone, torch.optim.AdamW in eager torch on its own batches (the
  work of one replica: an eighth of the others' compute). No communication.

Prints the held-out loss and perplexity after every round (every H steps), writes
`metrics.json` and `heldout_loss.png` (held-out loss against inner steps) to `--out`. Uses only
public names of bridge_mr.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import math
import sysconfig
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import bridge_mr
from bridge_mr import data as fd

VOCAB = 256  # bytes
HELD_OUT_MOD = 8  # modules whose crc32 is 0 mod this are held out
INNER_LR = 2e-3
WEIGHT_DECAY = 0.01
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
METHODS = ("diloco", "data_parallel", "single")
LABELS = {
    "diloco": "DiLoCo",
    "data_parallel": "data-parallel AdamW",
    "single": "single replica",
}
Tensors = Mapping[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Config:
    """One run's sizes (the CLI's options; see `parse_args`)."""

    rounds: int
    inner_steps: int
    replicas: int
    batch: int
    context: int
    d_model: int
    layers: int
    heads: int
    eval_windows: int
    seed: int
    strategy: str

    @property
    def total_steps(self) -> int:
        """Optimizer steps per replica, the same for every method."""
        return self.rounds * self.inner_steps


QUICK = {"rounds": 5, "inner_steps": 20, "batch": 8, "eval_windows": 64}
FULL = {"rounds": 10, "inner_steps": 30, "batch": 16, "eval_windows": 256}


# The corpus: the standard library's sources, grouped by top-level module.


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Each replica's bytes, the held-out bytes, and which modules went where."""

    replicas: list[np.ndarray]
    held_out: np.ndarray
    replica_modules: list[list[str]]
    held_out_modules: list[str]


def stdlib_modules(root: Path) -> dict[str, bytes]:
    """The stdlib's `.py` sources by top-level module or package name, in sorted order.

    Args:
      root: the standard library's folder (`sysconfig.get_paths()["stdlib"]`).

    Returns:
      name -> the bytes of its files, concatenated in sorted path order. Third-party packages
      (`site-packages`, `dist-packages`) and the regression tests (`test`) are left out.
    """
    modules: dict[str, list[bytes]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in ("site-packages", "dist-packages", "test"):
            continue
        modules.setdefault(parts[0].removesuffix(".py"), []).append(path.read_bytes())
    return {name: b"\n".join(texts) for name, texts in sorted(modules.items())}


def split_corpus(modules: dict[str, bytes], replicas: int) -> Corpus:
    """Held-out modules by name hash; the rest cut alphabetically into `replicas` groups.

    Args:
      modules: name -> source bytes, from `stdlib_modules`.
      replicas: the number of groups (>= 1).

    Returns:
      The corpus. Groups are contiguous in name order and hold about equal numbers of bytes.

    Raises:
      ValueError: fewer training modules than replicas.
    """
    held = [name for name in modules if zlib.crc32(name.encode()) % HELD_OUT_MOD == 0]
    train = [name for name in modules if name not in held]
    if len(train) < replicas:
        raise ValueError(
            f"--replicas must be at most {len(train)} (stdlib modules); got {replicas}"
        )
    sizes = np.cumsum([len(modules[name]) for name in train])
    # Group g ends where the cumulative size comes closest to g / replicas of the total (each
    # group keeps at least one module).
    bounds = [0]
    for g in range(1, replicas):
        target = sizes[-1] * g / replicas
        i = int(np.searchsorted(sizes, target))  # the first module reaching the target
        cut = i + 1 if i == 0 or sizes[i] - target < target - sizes[i - 1] else i
        bounds.append(min(max(cut, bounds[-1] + 1), len(train) - (replicas - g)))
    bounds.append(len(train))
    groups = [train[a:b] for a, b in itertools.pairwise(bounds)]

    def as_bytes(names: list[str]) -> np.ndarray:
        return np.frombuffer(b"\n".join(modules[name] for name in names), dtype=np.uint8)

    return Corpus([as_bytes(g) for g in groups], as_bytes(held), groups, held)


def windows(
    text: np.ndarray, shape: tuple[int, ...], length: int, rng: np.random.Generator
) -> torch.Tensor:
    """Random windows of `length` bytes of `text`, as int64 token ids of shape [*shape, length]."""
    starts = rng.integers(0, len(text) - length, size=shape)
    return torch.from_numpy(text[starts[..., None] + np.arange(length)].astype(np.int64))


def replica_windows(corpus: Corpus, context: int) -> fd.FederatedDataset:
    """Each replica's text cut into windows of `context + 1` bytes: one client per replica.

    Args:
      corpus: the replicas' texts.
      context: the tokens the model predicts per window.

    Returns:
      A `bridge_mr.data.FederatedDataset` of uint8 windows ("tokens" [context + 1]); the
      bytes after a replica's last whole window are left out.
    """
    width = context + 1
    return fd.FederatedDataset.from_clients(
        {
            replica: {
                "tokens": torch.from_numpy(text[: len(text) // width * width].copy()).view(
                    -1, width
                )
            }
            for replica, text in enumerate(corpus.replicas)
        }
    )


# The model and its loss: torch, written once.


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, time, d_model] -> the same shape."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """Byte-level causal transformer: token + learned position embeddings, blocks, a head."""

    def __init__(self, *, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"--d-model ({d_model}) must be a multiple of --heads ({heads})")
        self.token = nn.Embedding(VOCAB, d_model)
        self.position = nn.Parameter(torch.randn(context, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-byte logits [batch, time, 256] for token ids [batch, time]."""
        x = self.token(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(model: nn.Module, params: Tensors, batch: torch.Tensor) -> torch.Tensor:
    """The mean next-byte cross-entropy (nats) of `model` with `params` on windows `batch`.

    Args:
      model: the network (its own parameters are not used: `functional_call`).
      params: every parameter of `model` by name.
      batch: token ids [batch, context + 1]; the model reads all but the last, predicts all
        but the first.

    Returns:
      The scalar loss.

    Example::

        loss = lm_loss(model, dict(model.named_parameters()), batch)
    """
    logits = functional_call(model, dict(params), (batch[:, :-1],))
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


@torch.no_grad()
def held_out_loss(model: nn.Module, eval_batch: torch.Tensor) -> float:
    """The mean loss of `model` on the held-out windows (eager torch, 64 windows at a time)."""
    losses = [
        lm_loss(model, dict(model.named_parameters()), chunk) * len(chunk)
        for chunk in eval_batch.split(64)
    ]
    return float(torch.stack(losses).sum()) / len(eval_batch)


# The three trainings. Each makes a step function over one round's batches.


StepRound = Callable[[torch.Tensor], float]


def diloco(model: nn.Module, cfg: Config) -> StepRound:
    """DiLoCo's round: H inner AdamW steps per replica (optax, in map_reduce), an outer
    Nesterov SGD step on the mean delta (torch.optim). Returns `run(batches) -> train loss`."""
    import optax

    from bridge_mr import algorithms as alg

    loss = bridge_mr.from_torch(lambda params, batch: lm_loss(model, params, batch))
    inner = optax.adamw(INNER_LR, weight_decay=WEIGHT_DECAY)
    local = alg.local_training(loss, inner, steps=cfg.inner_steps)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    params = dict(model.named_parameters())
    strategy: Any = cfg.strategy

    def run(batches: torch.Tensor) -> float:
        metrics = alg.outer_step(local, params, batches, strategy=strategy)
        outer.step()
        outer.zero_grad()
        return float(metrics["loss"])

    return run


def data_parallel(model: nn.Module, cfg: Config) -> StepRound:
    """Every step, the replicas' mean gradient (map_reduce) stepped by torch AdamW."""
    import jax

    loss = bridge_mr.from_torch(lambda params, batch: lm_loss(model, params, batch))

    def replica(params: Any, batch: Any) -> dict[str, Any]:
        value, grads = jax.value_and_grad(loss)(params, batch)
        return {"loss": value, "grads": grads}

    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=WEIGHT_DECAY)
    params = dict(model.named_parameters())
    strategy: Any = cfg.strategy

    def run(batches: torch.Tensor) -> float:
        losses = []
        for step in range(batches.shape[1]):
            with torch.no_grad():
                mean = bridge_mr.map_reduce(replica, params, batches[:, step], strategy=strategy)
            for name, p in params.items():
                p.grad = mean["grads"][name]
            optimizer.step()
            optimizer.zero_grad()
            losses.append(mean["loss"].item())
        return sum(losses) / len(losses)

    return run


def single(model: nn.Module, cfg: Config) -> StepRound:
    """Replica 0 alone: torch AdamW in eager torch, one step per batch of its own."""
    del cfg
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=WEIGHT_DECAY)
    params = dict(model.named_parameters())

    def run(batches: torch.Tensor) -> float:
        losses = []
        for batch in batches[0]:
            value = lm_loss(model, params, batch)
            value.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(value.detach().item())
        return sum(losses) / len(losses)

    return run


BUILDERS: dict[str, Callable[[nn.Module, Config], StepRound]] = {
    "diloco": diloco,
    "data_parallel": data_parallel,
    "single": single,
}


def bytes_per_step(method: str, param_bytes: int, cfg: Config) -> float:
    """Bytes each replica exchanges with the server per inner step: parameters down and a
    delta or gradient up (float32) every H steps for DiLoCo, every step for data-parallel."""
    per_exchange = 2 * param_bytes
    return {"diloco": per_exchange / cfg.inner_steps, "data_parallel": per_exchange}.get(
        method, 0.0
    )


@dataclasses.dataclass
class Run:
    """One method's training: held-out loss after 0, H, 2H, ... steps, train losses, times."""

    method: str
    steps: list[int]
    held_out: list[float]
    train: list[float]
    seconds: float
    first_round_seconds: float
    bytes_per_step: float

    def summary(self) -> dict[str, Any]:
        """The run as JSON-ready data, with perplexities (exp of the held-out loss)."""
        return {
            **dataclasses.asdict(self),
            "held_out_perplexity": [math.exp(x) for x in self.held_out],
        }


def train(
    method: str,
    initial: nn.Module,
    train_set: fd.FederatedDataset,
    eval_batch: torch.Tensor,
    cfg: Config,
) -> Run:
    """Trains a copy of `initial` with `method` for `cfg.rounds` rounds of H steps each.

    Args:
      method: one of `METHODS`.
      initial: the initial model (copied, not changed).
      train_set: the replicas' windows (`replica_windows`).
      eval_batch: the held-out windows.
      cfg: the sizes; `cfg.seed` fixes the batches (the same for every method).

    Returns:
      The run's losses and times.
    """
    from tqdm import tqdm

    model = copy.deepcopy(initial)
    run_round = BUILDERS[method](model, cfg)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = Run(method, [0], [held_out_loss(model, eval_batch)], [], 0.0, 0.0, 0.0)
    result.bytes_per_step = bytes_per_step(method, param_bytes, cfg)
    bar = tqdm(total=cfg.total_steps, desc=f"{LABELS[method]:>19}", unit="step", leave=True)
    start = time.perf_counter()
    # Each round: [replicas, H, batch, context + 1] windows, each replica's drawn without
    # replacement from its own text (the same for every method: the seed's).
    loop = fd.rounds(
        train_set,
        cfg.rounds,
        batch_size=cfg.batch,
        steps=cfg.inner_steps,
        padding=False,
        generator=cfg.seed + 1,
    )
    for round_index, rnd in enumerate(loop):
        result.train.append(run_round(rnd.batches["tokens"].long()))
        if round_index == 0:
            result.first_round_seconds = time.perf_counter() - start
        result.steps.append((round_index + 1) * cfg.inner_steps)
        result.held_out.append(held_out_loss(model, eval_batch))
        bar.update(cfg.inner_steps)
        bar.set_postfix(held_out=f"{result.held_out[-1]:.3f}")
    result.seconds = time.perf_counter() - start
    bar.close()
    return result


def plot(runs: list[Run], cfg: Config, path: Path) -> None:
    """Held-out loss against inner steps (per replica) for every run, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        axes.plot(run.steps, run.held_out, marker="o", markersize=3, label=LABELS[run.method])
    axes.set_xlabel(f"inner steps per replica (batch {cfg.batch} x {cfg.context} bytes)")
    axes.set_ylabel("held-out loss (nats per byte)")
    axes.set_title(
        f"Byte-level LM on the Python stdlib: {cfg.replicas} non-IID replicas, "
        f"DiLoCo H={cfg.inner_steps}"
    )
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def positive_int(text: str) -> int:
    """An argparse type: `text` as an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, Path]:
    """The command line, as a `Config` and the output folder."""
    parser = argparse.ArgumentParser(
        prog="examples/diloco_lm.py",
        description="DiLoCo vs data-parallel AdamW vs a single replica: a torch byte-level "
        "transformer LM on the Python standard library, through bridge_mr.from_torch.",
    )
    parser.add_argument("--quick", action="store_true", help=f"smaller run: {QUICK} (full: {FULL})")
    parser.add_argument("--out", default="diloco_lm_out", help="output folder (diloco_lm_out)")
    parser.add_argument("--rounds", type=positive_int, help="DiLoCo rounds")
    parser.add_argument("--inner-steps", type=positive_int, help="H: inner steps per round")
    parser.add_argument("--replicas", type=positive_int, default=8, help="replicas (8)")
    parser.add_argument("--batch", type=positive_int, help="windows per replica and step")
    parser.add_argument("--context", type=positive_int, default=64, help="window bytes (64)")
    parser.add_argument("--d-model", type=positive_int, default=128, help="width (128)")
    parser.add_argument("--layers", type=positive_int, default=2, help="blocks (2)")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads (4)")
    parser.add_argument("--eval-windows", type=positive_int, help="held-out windows")
    parser.add_argument("--seed", type=int, default=0, help="init, batches, held-out windows")
    parser.add_argument(
        "--strategy",
        choices=("vmap", "per_client", "auto"),
        default="vmap",
        help="bridge_mr.map_reduce's strategy over replicas (vmap)",
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    cfg = Config(
        rounds=args.rounds or sizes["rounds"],
        inner_steps=args.inner_steps or sizes["inner_steps"],
        replicas=args.replicas,
        batch=args.batch or sizes["batch"],
        context=args.context,
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        eval_windows=args.eval_windows or sizes["eval_windows"],
        seed=args.seed,
        strategy=args.strategy,
    )
    return cfg, Path(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Trains the three ways; prints the per-round table; writes metrics.json and the plot."""
    cfg, out = parse_args(argv)
    corpus = split_corpus(stdlib_modules(Path(sysconfig.get_paths()["stdlib"])), cfg.replicas)
    eval_batch = windows(
        corpus.held_out, (cfg.eval_windows,), cfg.context + 1, np.random.default_rng(cfg.seed)
    )
    torch.manual_seed(cfg.seed)
    initial = CharLM(context=cfg.context, d_model=cfg.d_model, layers=cfg.layers, heads=cfg.heads)
    n_params = sum(p.numel() for p in initial.parameters())
    sizes = ", ".join(f"{len(text) / 1e6:.2f}" for text in corpus.replicas)
    print(
        f"Byte-level transformer LM ({n_params:,} parameters: {cfg.layers} layers, d_model "
        f"{cfg.d_model}, context {cfg.context}) on the Python {sysconfig.get_python_version()} "
        f"stdlib: {cfg.replicas} replicas of {sizes} MB (modules {corpus.replica_modules[0][0]}"
        f"..{corpus.replica_modules[-1][-1]} in alphabetical groups), held out "
        f"{len(corpus.held_out_modules)} modules ({len(corpus.held_out) / 1e6:.2f} MB, "
        f"{cfg.eval_windows} windows). {cfg.rounds} rounds x H={cfg.inner_steps} steps of "
        f"batch {cfg.batch} per replica; AdamW lr {INNER_LR}; DiLoCo outer Nesterov SGD lr "
        f"{OUTER_LR} momentum {OUTER_MOMENTUM}; map_reduce strategy {cfg.strategy}.",
        flush=True,
    )
    train_set = replica_windows(corpus, cfg.context)
    runs = [train(method, initial, train_set, eval_batch, cfg) for method in METHODS]
    print(f"\nheld-out loss (perplexity) after each round of {cfg.inner_steps} steps:")
    print("  steps " + "".join(f"{LABELS[run.method]:>22}" for run in runs))
    for i, steps in enumerate(runs[0].steps):
        cells = "".join(
            f"{run.held_out[i]:>13.3f} ({math.exp(run.held_out[i]):6.2f})" for run in runs
        )
        print(f"  {steps:>5} {cells}")
    print("\nmethod                final loss   ppl  wall time (first round)   bytes/step/replica")
    for run in runs:
        print(
            f"  {LABELS[run.method]:<19} {run.held_out[-1]:8.3f} {math.exp(run.held_out[-1]):7.2f}"
            f"  {run.seconds:7.1f} s ({run.first_round_seconds:5.1f} s)  "
            f"{run.bytes_per_step:>14,.0f}"
        )
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "config": dataclasses.asdict(cfg),
        "n_params": n_params,
        "replica_modules": corpus.replica_modules,
        "held_out_modules": corpus.held_out_modules,
        "runs": {run.method: run.summary() for run in runs},
    }
    (out / "metrics.json").write_text(json.dumps(document, indent=1))
    plot(runs, cfg, out / "heldout_loss.png")
    print(f"\nWrote {out / 'metrics.json'} and {out / 'heldout_loss.png'}")
    return document


if __name__ == "__main__":
    main()
