"""Fully sharded data parallelism for the train step (`trainer.sharding: fsdp`), on torch FSDP2.

`fully_shard` (torch.distributed.fsdp) is applied to each decoder layer, then to the root: every
worker keeps 1/N of the parameters, of their gradients and of the optimizer state (AdamW steps on
the shards), and a layer's full parameters exist only while that layer computes (all-gathered
before its forward and backward, freed after). What this module decides on top of torch:

- The process group. FSDP2 needs a DeviceMesh; `DeviceMesh.from_group` accepts only a group that
  torch.distributed has registered (its ranks are looked up in the c10d world) and reads the rank
  from the default group. A group built directly on a store, as `Collective` builds the
  replicated trainer's, is neither: so a sharded worker initialises torch.distributed's default
  group (`Collective(default_group=True)`, on the same TCP store) and the mesh is that group. One
  sharded trainer per process; `Collective.close()` destroys the group, so tests can build and
  tear down trainers again in one process. Gloo binds each worker to its own address (127.0.0.1 when
  all workers share a node) through `BOUND_GLOO`, a registered gloo backend that takes the
  device from the group options, since the built-in "gloo" picks its interface from the host name.
- The sum, not the mean. FSDP2 divides reduced gradients by the number of workers by default; the
  train step needs their sum (each worker's loss is in sum form and the division is by the
  update's global count, operators/trainer/plan.py), so every FSDP module gets divide factor 1
  with sum-only reductions (plain SUM on gloo and NCCL, no PREMUL_SUM or AVG).
- Numerics. Under `optimizer.mixed_precision: bf16` the parameters stay float32 and the forward
  runs under the same bf16 autocast as every pi_old scorer (engines/training_numerics.py), with
  float32 gradient reduction: `MixedPrecisionPolicy(param_dtype=bf16)` would compute norms,
  residual adds and the softmax in bf16, so pi_theta would not equal pi_old on-policy
  (r_s != 1; tests/test_trainer_fsdp.py measures it). The price is that the all-gathers move
  float32, twice the bytes of bf16.
- LoRA (`lora:`): the adapter is sharded with its layer, not replicated. `fully_shard` shards
  every parameter of a unit, frozen base and trainable adapter alike (FSDP2 keeps frozen and
  trainable parameters in one unit and reduce-scatters only the gradients that exist, the
  adapter's), so the adapter rides the all-gathers the base needs anyway and the update is the
  same code path as full fine-tuning: one division by the global count, one clip over sharded
  gradients, AdamW on the shards. Replicating it instead would take the adapter out of FSDP
  (`ignored_params`) and add a second reduction of its gradients, for a saving of a few MB.
  Reading the adapter (`version_payload`: publish, checkpoint, versions/) gathers each of its
  tensors on every worker in step; a sharded checkpoint keeps the adapter's shards (not the
  frozen base) and the whole adapter beside them, which a resumed run publishes first.
- Lockstep. Every forward and backward of a sharded module is a collective, so every worker
  runs the same passes: the shard plan pads a worker's micro-batches with zero-weight dummy
  passes (`plan_shards(lockstep=True)`), strategies whose pi_old needs a model forward score
  with a sharded copy (`TrainerReplica.policy_copy`), and reading the full weights
  (`full_tensors`) gathers one tensor at a time on every worker in the same order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor

from trajflow.engines.checkpoint import local_part, storage_key

BOUND_GLOO = "trajflow_gloo"  # gloo whose device (the address it binds) comes from the group options


def register_bound_gloo() -> str:
    """Register `BOUND_GLOO` with torch.distributed (once per process); returns its name.

    `init_process_group(BOUND_GLOO, pg_options=options)` then builds a plain ProcessGroupGloo
    from `options` (the devices it binds, its timeout), as `Collective` does for its own group."""
    import torch.distributed as dist

    if BOUND_GLOO not in dist.Backend.backend_list:
        def create(backend_options, options):  # extended API: the store, rank and size, and our options
            return dist.ProcessGroupGloo(backend_options.store, backend_options.group_rank,
                                         backend_options.group_size, options)

        dist.Backend.register_backend(BOUND_GLOO, create, extended_api=True, devices=["cpu"])
    return BOUND_GLOO


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules Hugging Face names as never split across devices
    (`_no_split_modules`, e.g. LlamaDecoderLayer), each one FSDP unit."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"trainer.sharding: fsdp: {type(model).__name__} names no decoder layer class "
                         "(_no_split_modules); cannot shard it layer by layer")
    return layers


def mixed_precision_policy():
    """Float32 parameters (bf16 compute comes from the training numerics' autocast, as for every
    pi_old scorer) and float32 gradient reduction; see the module docstring."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)


def offload_policy(cpu_offload: bool, device: torch.device | str):
    """`trainer.cpu_offload`: shards, gradients and optimizer state in host memory, each layer
    copied to the GPU to compute (CPUOffloadPolicy, pinned memory). It only means something on
    CUDA: a CPU worker's shards are in host memory already, so there it is the no-op policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if cpu_offload and torch.device(device).type == "cuda":
        return CPUOffloadPolicy(pin_memory=True)
    return OffloadPolicy()


def shard_model(model: torch.nn.Module, mesh, cpu_offload: bool = False, frozen: bool = False) -> None:
    """Shard `model` in place over `mesh`: each decoder layer, then the root (embeddings, final
    norm, head; a tied head stays one parameter). Gradients reduce as a sum (module docstring).
    The shards move to the mesh's device (or stay on the host with `cpu_offload` on CUDA).
    FSDP keeps the root's parameters whole from a forward to its backward; a `frozen` model
    (no backward) frees them after each forward like every layer's."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    kwargs = dict(mesh=mesh, mp_policy=mixed_precision_policy(),
                  offload_policy=offload_policy(cpu_offload, mesh.device_type))
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, reshard_after_forward=True if frozen else None, **kwargs)
    for module in model.modules():  # the setting is per FSDP module: the root's covers only its own
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def full(t: Tensor) -> Tensor:
    """`t` whole: a sharded tensor (DTensor) all-gathered from every worker (a collective), else `t`."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if t.device.type != t.device_mesh.device_type:  # offloaded shards gather on the mesh's device
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()


def full_tensors(state: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) for each entry of a state dict, in its order, one at a time.

    A sharded tensor is cast (floating point, to `dtype` if given: on the shard, so the gather
    moves `dtype`) and all-gathered: a collective, so every worker of the group must run the same
    iteration in step, to the end. A tensor under two names (tied weights) is gathered once and
    yielded as the same tensor under both. A tensor that is not sharded is yielded as it is
    (detached; cast if asked)."""
    counts = Counter(storage_key(t) for t in state.values())
    tied: dict[tuple, Tensor] = {}
    for name, t in state.items():
        key = storage_key(t)
        if key in tied:
            yield name, tied[key]
            continue
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        whole = full(t)
        if counts[key] > 1:
            tied[key] = whole
        yield name, whole


def local_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` on this worker: a sharded tensor counts
    its local shard's storage (FSDP's padding to equal shards included), a tied tensor once."""
    storages = {}
    for t in tensors:
        storage = local_part(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def clip_grad_norm(params: list[Tensor], max_norm: float) -> float:
    """Clip the gradients of `params` to a global norm of `max_norm` (inf: no clip); returns the
    norm before clipping. Over sharded gradients the norm is reduced over every worker."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(full(norm))
