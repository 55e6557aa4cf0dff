"""The device mesh (which arrays go over which axis: brorl_jax/parallel/rules.py).

Mesh axes: `data` (replicas: the update's rows), `fsdp` (parameters and optimizer state sharded,
gathered per layer by XLA; rows too), `expert` (expert parallelism: a mixture-of-experts layer's
experts split over it, tokens sent to their experts' devices and back, rows too; an axis of the
mesh only when mesh.expert > 1: parallel/expert_parallel.py), `tensor` (heads, MLP width and
vocabulary split). Sizes come from the config; -1 means "the devices that are left" (data, fsdp
or tensor); an axis a caller leaves out has size 1. The rollout uses every device of the mesh
alike (brorl_jax/rollout/engine.py).
"""
from __future__ import annotations

import contextlib
import math

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "fsdp", "expert", "tensor")


def mesh_axes(sizes: dict) -> tuple[str, ...]:
    """The axes of the mesh `sizes` declares: AXES, less `expert` when its size is 1 (so a mesh
    without expert parallelism is the three-axis mesh it always was)."""
    return tuple(a for a in AXES if a != "expert" or int(sizes.get(a, 1)) != 1)


def mesh_shape(sizes: dict, num_devices: int) -> tuple[int, ...]:
    """Resolves {"data": -1, "fsdp": 4, "tensor": 2} against `num_devices`: the sizes of
    mesh_axes(sizes), in that order (an axis not in `sizes` has size 1)."""
    axes = mesh_axes(sizes)
    shape = [int(sizes.get(a, 1)) for a in axes]
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"mesh: {num_devices} devices cannot be split with fixed axes "
                             f"{dict(zip(axes, shape))}; make the fixed sizes divide "
                             f"{num_devices}.")
        shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh: axes {dict(zip(axes, shape))} use {math.prod(shape)} devices "
                         f"but {num_devices} are present; set one axis (config mesh.data) to -1 "
                         "or make the product match.")
    return tuple(shape)


def make_mesh(sizes: dict | None = None, devices=None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over `devices` (default: all, across hosts), with an
    "expert" axis before "tensor" when sizes["expert"] > 1."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = sizes or {"data": -1, "fsdp": 1, "tensor": 1}
    shape = mesh_shape(dict(sizes), len(devices))
    try:
        from jax.experimental import mesh_utils
        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # simulated CPU devices have no topology to optimise for
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, mesh_axes(dict(sizes)))


def mesh_from_config(mesh_cfg, devices=None) -> Mesh:
    """The mesh a config declares: `mesh_cfg` has data/fsdp/expert/tensor sizes (config key
    `mesh`; one it lacks has size 1)."""
    get = mesh_cfg.get if hasattr(mesh_cfg, "get") else lambda k, d=None: getattr(mesh_cfg, k, d)
    return make_mesh({a: int(get(a, 1)) for a in AXES}, devices)


def batch_axis_size(mesh: Mesh) -> int:
    """How many ways the batch (rows) is split: data x fsdp x expert (rules.EXPERT_PARALLEL)."""
    return mesh.shape["data"] * mesh.shape["fsdp"] * dict(mesh.shape).get("expert", 1)


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
    """Sets `mesh` as the ambient mesh for shardings given as bare PartitionSpecs."""
    if hasattr(jax, "set_mesh"):
        with jax.set_mesh(mesh):
            yield mesh
    elif hasattr(jax.sharding, "use_mesh"):
        with jax.sharding.use_mesh(mesh):
            yield mesh
    else:
        with mesh:
            yield mesh
