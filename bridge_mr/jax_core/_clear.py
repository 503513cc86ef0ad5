"""`clear_caches`: bridge_mr's caches, then JAX's (the lowest layer that sees both)."""

from __future__ import annotations

import jax

from bridge_mr import _caches


def clear_caches() -> None:
    """Drops the traces, plans and compiled programs that bridge_mr and JAX keep.

    Like `jax.clear_caches` (which it calls): every cache a loaded bridge_mr module registered
    (`bridge_mr._caches`: the torch frontend's traced functions, and with them the user
    functions and arrays they captured; the choices of `strategy="auto"`; the custom op's
    traced calls (compiled graphs rebuild theirs by name); the runners' embeddings; Beam's
    plans and segments) is emptied. Later calls trace and compile again; trace counts keep
    counting. Nothing on disk is deleted (auto's decisions, compiled programs).

    Example:
      >>> bridge_mr.clear_caches()  # e.g. between experiments in one long-lived process
    """
    _caches.clear_all()
    jax.clear_caches()
