"""FSDP2 (``torch.distributed.fsdp.fully_shard``) through Lightning Fabric, on CPU and GPU.

:func:`parallelize` is the ``parallelize_fn(module, mesh)`` that shards any model for Fabric's
``ModelParallelStrategy``; :func:`fabric_strategy` turns the ``strategy`` setting into the
strategy object. Build the optimizer after ``fabric.setup_module``. See docs/distributed.md and
docs/design/fsdp.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from lightning_fabric.strategies import ModelParallelStrategy
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: ``strategy`` values that mean FSDP2 in stabletrain. ``fsdp`` is one of them: Fabric's own
#: ``fsdp`` (FSDP1) cannot run on the CPU, and its flat parameters hide the per-parameter
#: gradients every debugging tool reads.
FSDP_STRATEGY_NAMES = ("fsdp", "fsdp2")

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def fsdp_units(module: nn.Module) -> list[str]:
    """Names of the submodules that :func:`parallelize` shards as units of their own.

    A unit is each child that holds parameters of an ``nn.ModuleList`` or ``nn.Sequential``
    with at least two such children, at the shallowest such level: the transformer blocks
    (``blocks.0``, ``blocks.1``), the CNN's conv blocks (``features.0``), a ResNet's residual
    blocks (``layer1.0``), a ViT's encoder layers. Everything else (embeddings, heads, norms)
    belongs to the root unit. One unit's parameters are gathered for its forward and backward
    and freed after, so peak memory is the largest unit plus the shards.

    A candidate that shares a parameter with anything outside it (tied weights) is left to the
    root unit: a parameter can belong to only one unit.

    Args:
        module: The model, before sharding.

    Returns:
        Submodule names relative to ``module``, in module order.

    Example::

        fsdp_units(TransformerLM(vocab_size=256, n_layers=2, n_heads=4, dim=64, context_length=32))
        # ['blocks.0', 'blocks.1']
    """
    candidates: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        holders = [name for name, child in mod.named_children() if next(child.parameters(), None) is not None]
        repeated = isinstance(mod, _CONTAINERS) and len(holders) >= 2
        for name, child in mod.named_children():
            if repeated and name in holders:
                candidates.append((prefix + name, child))
            else:
                visit(prefix + name + ".", child)

    visit("", module)
    # Which candidate (if any) owns each parameter occurrence; tied parameters occur twice.
    owners: dict[int, set[str]] = {}
    unit_of = {id(m): name for name, m in candidates}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        owner = _enclosing(mod_name, unit_of, module)
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(owner)
    shared = {o for os_ in owners.values() if len(os_) > 1 for o in os_}
    return [name for name, _ in candidates if name not in shared]


def _enclosing(mod_name: str, unit_of: dict[int, str], root: nn.Module) -> str:
    """The candidate unit that ``mod_name`` lies in, or "" for the root unit."""
    parts = mod_name.split(".") if mod_name else []
    mod = root
    for part in parts:
        mod = getattr(mod, part)
        if id(mod) in unit_of:
            return unit_of[id(mod)]
    return ""


def parallelize(module: nn.Module, mesh: "DeviceMesh", **fully_shard_kwargs: Any) -> nn.Module:
    """Shard ``module`` with FSDP2: each of :func:`fsdp_units` first, then the root.

    Module and parameter names do not change (FSDP2 swaps the class, ``Block`` becomes
    ``FSDPBlock``, and makes parameters DTensors sharded on dim 0; it wraps nothing), so
    ``named_parameters()`` and ``named_modules()`` give the same names as without sharding.

    Args:
        module: The model (or the trainer's wrapper around it). Shard the module whose
            forward runs the whole step, so that parameters used outside the inner model's
            forward are gathered too.
        mesh: The device mesh. Fabric's ``ModelParallelStrategy`` passes a 2-D mesh
            (``data_parallel``, ``tensor_parallel``); its ``data_parallel`` dimension is used,
            and the tensor-parallel one must have size 1 (as :class:`FSDP2Strategy` sets it).
        fully_shard_kwargs: Passed to ``fully_shard`` (``mp_policy``, ``offload_policy``,
            ``reshard_after_forward``).

    Returns:
        ``module`` itself, sharded in place.

    Raises:
        ValueError: The mesh has a tensor-parallel dimension larger than 1.
    """
    from torch.distributed.fsdp import fully_shard

    dp_mesh = _data_parallel_mesh(mesh)
    for name in fsdp_units(module):
        fully_shard(module.get_submodule(name), mesh=dp_mesh, **fully_shard_kwargs)
    fully_shard(module, mesh=dp_mesh, **fully_shard_kwargs)
    return module


def _data_parallel_mesh(mesh: "DeviceMesh") -> "DeviceMesh":
    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"parallelize: the device mesh has a tensor_parallel dimension of size {mesh['tensor_parallel'].size()}; "
            "stabletrain's FSDP shards over every process and supports no tensor parallelism. "
            "Use FSDP2Strategy (tensor_parallel_size=1)."
        )
    return mesh["data_parallel"] if "data_parallel" in names else mesh


class FSDP2Strategy(ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` as plain FSDP2 over all processes of all nodes.

    Fabric's default mesh is ``num_nodes`` x ``devices`` (data parallel across nodes, tensor
    parallel within one); FSDP shards over every process, so the data-parallel dimension is the
    world size and the tensor-parallel one is 1, which also makes Fabric's
    ``distributed_sampler_kwargs`` give every process its own samples.

    Args:
        parallelize_fn: Shards the module; :func:`parallelize` by default.
        save_distributed_checkpoint: ``fabric.save`` writes a folder of per-rank DCP shards
            when True, one full file from rank 0 when False (the default here: see
            ``docs/design/fsdp.md``).
        kwargs: Passed to ``ModelParallelStrategy`` (``process_group_backend``, ``timeout``).
    """

    def __init__(self, parallelize_fn: Any = parallelize, save_distributed_checkpoint: bool = False, **kwargs: Any):
        super().__init__(
            parallelize_fn=parallelize_fn,
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )

    def setup_environment(self) -> None:
        # Known only now: the launcher or the cluster environment has set nodes and processes.
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()


def is_sharded(fabric: Any) -> bool:
    """Does ``fabric`` shard the model with FSDP2 (Fabric's ``ModelParallelStrategy``, of which
    :class:`FSDP2Strategy` is one)?"""
    return isinstance(getattr(fabric, "strategy", None), ModelParallelStrategy)


def fabric_strategy(strategy: str) -> Union[str, FSDP2Strategy]:
    """What to give ``Fabric(strategy=...)`` for the ``strategy`` setting.

    Args:
        strategy: The setting's value, e.g. ``"fsdp"``, ``"ddp"``, ``"auto"``.

    Returns:
        A new :class:`FSDP2Strategy` for any of :data:`FSDP_STRATEGY_NAMES` (any letter case),
        otherwise ``strategy`` unchanged for Fabric's own registry.

    Example::

        Fabric(accelerator="cpu", devices=2, strategy=fabric_strategy("fsdp"))
    """
    if strategy.lower() in FSDP_STRATEGY_NAMES:
        return FSDP2Strategy()
    return strategy
