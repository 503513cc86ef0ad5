"""The tuning of `map_reduce(strategy="auto")`, read at each decision.

Set them in code, before the calls they should govern (a decision already made, in memory or
on disk, stays; a changed setting changes the name of the decision kept on disk):

    import bridge_mr.auto.settings as auto_settings

    auto_settings.AUTO_TIMING = True  # time the candidates the cost model leaves

`BRIDGE_MR_AUTO_DISK=0` (read at each decision) keeps decisions in memory only.
"""

from __future__ import annotations

#: The chunk sizes `auto` considers (those below the number of clients).
AUTO_CHUNK_SIZES: tuple[int, ...] = (16, 128)
#: A candidate replaces one `auto` prefers (vmap, then larger chunks, then per_client; on a TPU
#: per_client first, see `AUTO_TPU_CLIENT_FLOPS`) only when its operation count (or, timed, its
#: median time) is below this fraction of that one's.
AUTO_MARGIN = 0.9
#: On CPU, without `memory_budget_bytes`, a candidate estimated to need over this many times
#: the leanest candidate's memory, and over `AUTO_MEMORY_FLOOR` bytes, is ruled out (vmap of a
#: CNN round at 50 clients: 4x the torch loop's memory). A GPU's budget is half its memory (on
#: an H200 this rule cost GPT-2's round at 128 clients 2x: 11.3 ms in chunks against 5.7 ms).
AUTO_MEMORY_FACTOR = 4
AUTO_MEMORY_FLOOR = 1 << 30
#: On a GPU, a batched candidate (vmap, chunks) whose convolutions are grouped more than this
#: (vmap over per-client weights: one group per client) is ruled out. On an H200, a CNN FedAvg
#: round cost 0.55 ms per client at 16 and 50 groups and 1.9 ms at 500 (vmap of 500 clients:
#: 932 ms against 281 ms in chunks of 16). On CPU every such grouping is ruled out.
AUTO_GPU_MAX_CONV_GROUPS = 64
#: On a TPU, a batched candidate whose convolutions are grouped more than this is ruled out (1:
#: any grouping). On a v5e, a CNN FedAvg round of 500 clients at torch's "medium" precision, the
#: client data on the chip: per_client 263 ms, chunks of 16 476 ms, vmap 609 ms, chunks of 128
#: 905 ms (docs/tpu.md).
AUTO_TPU_MAX_CONV_GROUPS = 1
#: On a TPU that TorchTPU runs ("tpu" tensors), the same; None: no grouping is ruled out. On a
#: v5e, the same round from "tpu" tensors (TorchTPU 0.2.0, its programs compiled at XLA's "O3"):
#: per_client 381 ms, chunks of 128 852 ms (at TorchTPU's default level vmap had been faster:
#: 650 against 954 ms).
AUTO_TORCH_TPU_MAX_CONV_GROUPS: int | None = 1
#: On a TPU (JAX's or TorchTPU's), per_client is preferred to vmap and chunks (which replace it
#: only where they need `AUTO_MARGIN` fewer operations) when each client's share of the
#: round's operations is at least this many: its matrix products then fill the MXU one client
#: at a time, and batching clients measured slower. On a v5e at torch's "medium" precision:
#: GPT-2 2x128 FedAvg, 128 clients, per_client 52-54 ms against vmap's 67-79 ms (TorchTPU
#: tensors: 43 against 67-71 ms); the CNN round of 50 clients 33.6 against 52.9 ms. Below it
#: (a tiny call: 4 clients of an 8-wide MLP, 2.2 ms either way) vmap stays first.
AUTO_TPU_CLIENT_FLOPS = 1e8
#: On a TPU (JAX's), where vmap would group the client's convolutions over per-client weights,
#: `auto` considers strategy "packed" with chunks of this many clients (below the client count,
#: no mesh over the clients) and prefers it to every other candidate (None: not considered).
#: On a v5e, the pfl CNN FedAvg round (data on the chip): 50 clients at torch's "medium"
#: precision, packed 2 26.9 ms against chunks of 2 33.2 ms and vmap 53.3 ms; at "highest"
#: 85.1 against 128 and 136 ms; 500 clients, "medium", 217 against 279 and 618 ms; "highest"
#: 801 against 1,228 ms (vmap out of HBM); chunks of 4 packed were slower than of 2 (32.8 and
#: 234 ms at "medium").
AUTO_TPU_PACKED: int | None = 2
#: Time the candidates the cost model leaves, rather than take its favourite. Each timed
#: candidate is compiled and run (its program kept) a few times, which costs about one first
#: call each: measuring on a first call what the cost model cannot see.
AUTO_TIMING = False
#: When timing: a candidate after the first is tried only while what timing spent beyond the
#: first candidate's first call, plus one more such call, stays under this fraction of it.
AUTO_TIME_BOX = 0.5
#: When timing: calls per candidate after its first (which traces and compiles).
AUTO_REPEATS = 3
#: When timing: a candidate whose first timed call takes over this multiple of the fastest
#: first timed call is not timed again: it cannot win.
AUTO_GIVE_UP = 2.0
#: When timing: a vmap whose timed call takes less (seconds) is kept without trying the others.
AUTO_MIN_SECONDS = 0.005


def as_read_now() -> list[object]:
    """Every `AUTO_*` setting, in definition order, as read now (a decision depends on them:
    its name on disk holds them)."""
    return [value for name, value in globals().items() if name.startswith("AUTO_")]
