"""Sharding rules as data: regular expressions over parameter paths -> PartitionSpec.

A path is the "/"-joined key path of a leaf in the param pytree, e.g.
"layers/q_proj/kernel". Layer leaves carry a leading stacked-layer axis (never sharded).
The first rule whose pattern matches (re.search) wins; a parameter that matches no rule is an
error, so a new parameter cannot silently end up replicated.

Optimizer state (Adam's mu and nu) mirrors the params, so it gets the params' specs; scalars in
the optimizer state (counts) are replicated.
"""
from __future__ import annotations

import re
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

# name -> list of (pattern, spec). Shapes: embedding [V, D]; layers/*: [L, in, out] kernels,
# [L, out] biases, [L, D] or [L, Dh] norm scales; lm_head [D, V].
RULES: dict[str, list[tuple[str, P]]] = {
    "default": [
        (r"^embed/embedding$", P("tensor", "fsdp")),
        (r"^layers/(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", P(None, "fsdp", "tensor")),
        (r"^layers/(o_proj|down_proj)/kernel$", P(None, "tensor", "fsdp")),
        (r"^layers/(q_proj|k_proj|v_proj)/bias$", P(None, "tensor")),
        (r"^layers/o_proj/bias$", P(None, None)),
        (r"^layers/\w+norm/scale$", P(None, None)),
        (r"^final_norm/scale$", P(None)),
        (r"^lm_head/kernel$", P("fsdp", "tensor")),
    ],
    # Everything replicated (pure data parallelism).
    "replicated": [(r".*", P())],
}


def path_str(path) -> str:
    parts = []
    for k in path:
        if hasattr(k, "key"):
            parts.append(str(k.key))
        elif hasattr(k, "name"):
            parts.append(str(k.name))
        elif hasattr(k, "idx"):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    return "/".join(parts)


def spec_for(path: str, ndim: int, rules: list[tuple[str, P]]) -> P:
    for pattern, spec in rules:
        if re.search(pattern, path):
            if len(spec) > ndim:
                raise ValueError(f"sharding rule {pattern!r} gives {spec} ({len(spec)} axes) for "
                                 f"parameter '{path}' of rank {ndim}; fix the rule.")
            return spec
    raise ValueError(f"parameter '{path}' matches no sharding rule; add a (pattern, "
                     "PartitionSpec) entry for it in brorl_jax/parallel/rules.py RULES.")


def param_specs(params: Any, rules: str | list = "default") -> Any:
    """A pytree of PartitionSpecs with the structure of `params`."""
    table = RULES[rules] if isinstance(rules, str) else rules
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec_for(path_str(path), leaf.ndim, table), params)


def _fits(spec: P, shape, mesh) -> P:
    """Drops mesh axes that do not divide a dimension (tiny test models), keeping the rest."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = axes if isinstance(axes, tuple) else (axes,) if axes else ()
        size = 1
        for n in names:
            size *= mesh.shape[n]
        out.append(axes if size and dim % size == 0 else None)
    return P(*out)


def param_shardings(params: Any, mesh, rules: str | list = "default") -> Any:
    """NamedShardings for `params` on `mesh` (axes that do not divide a dim are dropped)."""
    specs = param_specs(params, rules)
    return jax.tree.map(lambda leaf, s: NamedSharding(mesh, _fits(s, leaf.shape, mesh)),
                        params, specs)


def state_shardings(state: Any, params_sharding: Any, mesh) -> Any:
    """Shardings for an optimizer-state pytree: leaves shaped like a param share its sharding.

    Optax states hold copies of the param tree (mu, nu); we match subtrees by structure and give
    everything else (step counts, scalars) a replicated sharding.
    """
    param_struct = jax.tree.structure(params_sharding)
    replicated = NamedSharding(mesh, P())

    def assign(node):
        if jax.tree.structure(node) == param_struct:
            return params_sharding
        return None

    def walk(node):
        got = assign(node)
        if got is not None:
            return got
        if isinstance(node, (tuple, list)) and not hasattr(node, "_fields"):
            return type(node)(walk(n) for n in node)
        if hasattr(node, "_fields"):      # NamedTuple optax states
            return type(node)(*(walk(n) for n in node))
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return replicated

    return walk(state)
