"""Sharding rules as data: the one place that maps array names to mesh axes.

Two tables, both plain data a config can name or replace:

1. ``LOGICAL_AXES[name]``: logical dimension name -> mesh axes (a mesh axis name, a tuple of
   them, or None = replicated). Model code never mentions devices; it has dimensions with names
   ("embed", "heads", "vocab", "batch", ...) and this table decides where they live.

2. ``PARAM_RULES[name]``: regular expressions over parameter paths -> the logical names of that
   parameter's dimensions (or a literal ``PartitionSpec`` over mesh axes). A path is the
   "/"-joined key path of a leaf in the param pytree, e.g. "layers/q_proj/kernel". The first
   rule whose pattern matches (re.search) wins; a parameter that matches no rule is an error,
   so a new parameter cannot silently end up replicated. ``mesh.rules`` in the run config names
   one of these rule sets (and the logical table of the same name).

The update and log-prob batches have fixed names (``ARRAY_AXES``): ``tokens [B, T]`` and
``rows [B]``, split over "batch". The rollout does not use these tables: it runs under
``shard_map`` with the params replicated and each device decoding its share of every prompt's
samples in its own slots (brorl_jax/rollout/engine.py).

Optimizer state (Adam's mu and nu) mirrors the params, so it gets the params' shardings; scalars
in the optimizer state (counts) are replicated.

A mesh axis that does not divide a dimension is dropped for that array (tiny test models, GQA
with 2 kv heads on tensor=4): the array is then replicated over that axis, which is always
correct, only less memory-efficient. ``check_divisible=True`` turns this into an error for plans
where every byte counts (bench/plan_memory.py).
"""
from __future__ import annotations

import re
from typing import Any, Sequence, Union

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

MeshAxes = Union[str, tuple, None]

# -------------------------------------------------------------------------------------------------
# Logical dimension -> mesh axes
# -------------------------------------------------------------------------------------------------
LOGICAL_AXES: dict[str, dict[str, MeshAxes]] = {
    # Training (update, log-probs): ZeRO-3/FSDP over `fsdp`, Megatron-style over `tensor`, and
    # the batch over every axis that is not splitting features.
    "default": {
        "batch": ("data", "fsdp"),     # update rows (sequences)
        "seq": None,
        "layers": None,                # the stacked-layer axis is scanned over, never split
        "embed": "fsdp",               # hidden size D (params); gathered per layer by XLA
        "heads": "tensor",             # H*Dh of q_proj/o_proj
        "kv_heads": "tensor",          # Hkv*Dh of k_proj/v_proj
        "head_dim": None,
        "mlp": "tensor",               # intermediate size I
        "vocab": "tensor",             # V of the embedding / lm_head
        "norm": None,                  # RMSNorm scales (tiny)
        # Mixture of experts (qwen3_moe): whole experts over fsdp (ZeRO-3 along the expert
        # axis: a device keeps E/fsdp experts and XLA gathers a layer's experts for its grouped
        # GEMM, as it gathers every FSDP weight; no token exchange: with mesh.expert > 1,
        # EXPERT_PARALLEL below), each expert's width over tensor, as the dense MLP's.
        "experts": "fsdp",             # E of the router and the stacked experts
        "expert_mlp": "tensor",        # moe_intermediate_size
        "lora_rank": None,             # r of the LoRA adapters (tiny: replicated)
    },
    # Everything replicated except the batch (pure data parallelism).
    "replicated": {
        "batch": ("data", "fsdp"), "seq": None, "layers": None, "embed": None, "heads": None,
        "kv_heads": None, "head_dim": None, "mlp": None, "vocab": None, "norm": None,
        "experts": None, "expert_mlp": None, "lora_rank": None,
    },
}

# Expert parallelism (a mesh whose `expert` axis is > 1, config mesh.expert): these entries
# replace the logical table's (``for_mesh``). The experts go over `expert` (each device holds
# E / expert of them and runs them on the tokens sent to it: parallel/expert_parallel.py) and
# then over fsdp (ZeRO-3 within a device's experts, gathered per layer); the rows go over
# `expert` as well, so every device routes its own tokens. Applied only when the axis is > 1,
# so a mesh without expert parallelism gets exactly the table above.
EXPERT_PARALLEL: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp", "expert"),
    "experts": ("expert", "fsdp"),
}


def expert_axis_size(mesh) -> int:
    """The size of `mesh`'s expert axis (1 when it has none)."""
    return int(dict(mesh.shape).get("expert", 1)) if mesh is not None else 1


def for_mesh(axes: str | dict, mesh) -> str | dict:
    """The logical table `axes` (a name or a table) resolved for `mesh`: unchanged, or with the
    EXPERT_PARALLEL entries when the mesh's expert axis is > 1 (a name becomes the table)."""
    if expert_axis_size(mesh) == 1:
        return axes
    return {**logical_table(axes), **EXPERT_PARALLEL}


# -------------------------------------------------------------------------------------------------
# Parameter path -> logical names (one per dimension). Shapes: embedding [V, D]; layers/*:
# [L, in, out] kernels, [L, out] biases, [L, D] or [L, Dh] norm scales; lm_head [D, V].
# -------------------------------------------------------------------------------------------------
_TRANSFORMER_PARAMS: list[tuple[str, Any]] = [
    (r"^embed/embedding$", ("vocab", "embed")),
    (r"^layers/q_proj/kernel$", ("layers", "embed", "heads")),
    (r"^layers/(k_proj|v_proj)/kernel$", ("layers", "embed", "kv_heads")),
    (r"^layers/(gate_proj|up_proj)/kernel$", ("layers", "embed", "mlp")),
    (r"^layers/o_proj/kernel$", ("layers", "heads", "embed")),
    (r"^layers/down_proj/kernel$", ("layers", "mlp", "embed")),
    (r"^layers/q_proj/bias$", ("layers", "heads")),
    (r"^layers/(k_proj|v_proj)/bias$", ("layers", "kv_heads")),
    (r"^layers/o_proj/bias$", ("layers", "norm")),
    (r"^layers/(input_norm|post_attn_norm|q_norm|k_norm)/scale$", ("layers", "norm")),
    # mixture of experts: router [L, D, E], experts [L, E, D, I] and [L, E, I, D]
    (r"^layers/moe/router$", ("layers", "embed", "experts")),
    (r"^layers/moe/(gate_proj|up_proj)$", ("layers", "experts", "embed", "expert_mlp")),
    (r"^layers/moe/down_proj$", ("layers", "experts", "expert_mlp", "embed")),
    # Qwen2-MoE's shared expert (a dense SwiGLU MLP on every token) as the dense MLP's kernels;
    # its sigmoid gate [L, D, 1] like a norm's output
    (r"^layers/moe/shared_(gate_proj|up_proj)$", ("layers", "embed", "mlp")),
    (r"^layers/moe/shared_down_proj$", ("layers", "mlp", "embed")),
    (r"^layers/moe/shared_expert_gate$", ("layers", "embed", None)),
    (r"^final_norm/scale$", ("norm",)),
    (r"^lm_head/kernel$", ("embed", "vocab")),
    # LoRA adapters (models/lora.py, params["lora"][target]): A [L, in, r] splits its input like
    # its projection's kernel input, B [L, r, out] its output like the kernel output, so x A and
    # (x A) B need the collectives of x W; the rank r is replicated.
    (r"^lora/(q|k|v|gate|up)/a$", ("layers", "embed", "lora_rank")),
    (r"^lora/o/a$", ("layers", "heads", "lora_rank")),
    (r"^lora/down/a$", ("layers", "mlp", "lora_rank")),
    (r"^lora/q/b$", ("layers", "lora_rank", "heads")),
    (r"^lora/(k|v)/b$", ("layers", "lora_rank", "kv_heads")),
    (r"^lora/(gate|up)/b$", ("layers", "lora_rank", "mlp")),
    (r"^lora/(o|down)/b$", ("layers", "lora_rank", "embed")),
]
PARAM_RULES: dict[str, list[tuple[str, Any]]] = {
    "default": _TRANSFORMER_PARAMS,
    "replicated": [(r".*", P())],
}

# Named arrays of the update / log-prob steps (docs/INTERFACES.md "algo") -> logical names.
ARRAY_AXES: dict[str, tuple[str, ...]] = {
    "tokens": ("batch", "seq"),    # [B, T]
    "rows": ("batch",),            # [B]
}


# -------------------------------------------------------------------------------------------------
# Resolution
# -------------------------------------------------------------------------------------------------
def path_str(path) -> str:
    """"/"-joined key path of a pytree leaf ("layers/q_proj/kernel")."""
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


def logical_table(axes: str | dict = "default") -> dict[str, MeshAxes]:
    if isinstance(axes, dict):
        return axes
    if axes not in LOGICAL_AXES:
        raise ValueError(f"unknown logical-axis table {axes!r}; known: {sorted(LOGICAL_AXES)} "
                         "(brorl_jax/parallel/rules.py LOGICAL_AXES).")
    return LOGICAL_AXES[axes]


def param_rule_table(rules: str | Sequence = "default") -> list[tuple[str, Any]]:
    if isinstance(rules, str):
        if rules not in PARAM_RULES:
            raise ValueError(f"unknown sharding rule set {rules!r} (config mesh.rules); known: "
                             f"{sorted(PARAM_RULES)}.")
        return PARAM_RULES[rules]
    return list(rules)


def logical_to_spec(names: Sequence[str | None] | P, axes: str | dict = "default") -> P:
    """("vocab", "embed") -> P("tensor", "fsdp") through the logical table. A PartitionSpec is
    returned unchanged (a rule may name mesh axes directly)."""
    if isinstance(names, P):
        return names
    table = logical_table(axes)
    out = []
    for n in names:
        if n is None:
            out.append(None)
            continue
        if n not in table:
            raise ValueError(f"logical axis {n!r} is not in the logical-axis table; known: "
                             f"{sorted(table)}; add it to brorl_jax/parallel/rules.py "
                             "LOGICAL_AXES.")
        out.append(table[n])
    # A mesh axis may shard only one dimension of an array: later uses are dropped.
    used: set = set()
    final = []
    for a in out:
        names_a = a if isinstance(a, tuple) else (a,) if a else ()
        keep = tuple(x for x in names_a if x not in used)
        used.update(keep)
        final.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*final)


def spec_for(path: str, ndim: int, rules: Sequence, axes: str | dict = "default") -> P:
    """The PartitionSpec of the parameter at `path` (first matching rule)."""
    for pattern, spec in rules:
        if re.search(pattern, path):
            spec = logical_to_spec(spec, axes)
            if len(spec) > ndim:
                raise ValueError(f"sharding rule {pattern!r} gives {spec} ({len(spec)} axes) for "
                                 f"parameter '{path}' of rank {ndim}; fix the rule.")
            return spec
    raise ValueError(f"parameter '{path}' matches no sharding rule; add a (pattern, logical "
                     "axes) entry for it in brorl_jax/parallel/rules.py PARAM_RULES.")


def param_specs(params: Any, rules: str | Sequence = "default",
                axes: str | dict | None = None) -> Any:
    """A pytree of PartitionSpecs with the structure of `params` (raises for unmatched leaves).

    `axes` defaults to the logical table with the same name as `rules` (or "default")."""
    table = param_rule_table(rules)
    axes = axes if axes is not None else (rules if isinstance(rules, str) and rules in LOGICAL_AXES
                                          else "default")
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec_for(path_str(path), len(leaf.shape), table, axes), params)


def unmatched_params(params: Any, rules: str | Sequence = "default") -> list[str]:
    """Paths of the parameters that match no rule (empty when the rules cover everything)."""
    table = param_rule_table(rules)
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        p = path_str(path)
        if not any(re.search(pattern, p) for pattern, _ in table):
            out.append(p)
    return out


def fit_spec(spec: P, shape: Sequence[int], mesh, *, check_divisible: bool = False,
             name: str = "array") -> P:
    """Drops mesh axes that do not divide a dimension (or raises with check_divisible)."""
    out = []
    for i, (dim, axes) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
        names = axes if isinstance(axes, tuple) else (axes,) if axes else ()
        size = 1
        for n in names:
            size *= mesh.shape[n]
        if names and dim % size:
            if check_divisible:
                raise ValueError(f"{name}: dimension {i} of size {dim} is not divisible by mesh "
                                 f"axes {names} (size {size}); change the mesh or the rule.")
            out.append(None)
        else:
            out.append(axes)
    return P(*out)


def param_shardings(params: Any, mesh, rules: str | Sequence = "default",
                    axes: str | dict | None = None, *, check_divisible: bool = False) -> Any:
    """NamedShardings for `params` (arrays or ShapeDtypeStructs) on `mesh`."""
    if expert_axis_size(mesh) > 1:
        axes = for_mesh(axes if axes is not None else (
            rules if isinstance(rules, str) and rules in LOGICAL_AXES else "default"), mesh)
    specs = param_specs(params, rules, axes)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    out = [NamedSharding(mesh, fit_spec(s, leaf.shape, mesh, check_divisible=check_divisible,
                                        name=path_str(path)))
           for (path, leaf), s in zip(leaves, spec_leaves)]
    return jax.tree.unflatten(treedef, out)


def batch_shardings(batch: Any, mesh, axes: str | dict = "default") -> Any:
    """Update/log-prob batch: every leaf [B, ...] split over the "batch" logical axis."""
    axes = for_mesh(axes, mesh)
    def one(x):
        name = "rows" if len(x.shape) == 1 else "tokens"
        spec = logical_to_spec(ARRAY_AXES[name], axes)
        full = P(*(tuple(spec) + (None,) * (len(x.shape) - len(spec))))
        return NamedSharding(mesh, fit_spec(full, x.shape, mesh))
    return jax.tree.map(one, batch)


def state_shardings(state: Any, params_sharding: Any, mesh) -> Any:
    """Shardings for an optimizer-state (or TrainState) pytree: subtrees with the structure of the
    params share the params' shardings; everything else (step counts, scalars) is replicated.

    Optax states hold copies of the param tree (mu, nu); flax.struct dataclasses (TrainState) and
    NamedTuples are walked field by field.
    """
    param_struct = jax.tree.structure(params_sharding)
    replicated = NamedSharding(mesh, P())

    def walk(node):
        if node is None:
            return None
        if jax.tree.structure(node) == param_struct:
            return params_sharding
        if hasattr(node, "_fields"):      # NamedTuple optax states
            return type(node)(*(walk(n) for n in node))
        if isinstance(node, (tuple, list)):
            return type(node)(walk(n) for n in node)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if hasattr(node, "__dataclass_fields__") and hasattr(node, "replace"):  # flax.struct
            return node.replace(**{f: walk(getattr(node, f)) for f in node.__dataclass_fields__})
        return replicated

    return walk(state)
