"""The tuning of the strategies' lowerings, read while a program traces.

Set them in code, before the calls they should govern (a program already traced keeps the
lowering it was traced with):

    import bridge_mr.jax_core.settings as jax_core_settings

    jax_core_settings.PACKED_PATCH_FEATURES = 0  # every packed convolution stays one
"""

from __future__ import annotations

#: On a TPU at float32's "highest" precision, strategy "packed" computes a dense convolution
#: whose input has at most this many features a client (an image's channels: grey, RGB, RGBA),
#: and its kernel's gradient, as strided slices of the input (its patches) and one matrix
#: product; 0: every convolution stays one. On a v5e, the pfl CIFAR10 CNN FedAvg round (client
#: data on the chip): 500 clients 636.7 ms against 725.1 ms, 50 clients 64.8 against 73.8 ms
#: (docs/tpu.md). At "medium" the patches measured slower (and are not used there).
PACKED_PATCH_FEATURES = 4
