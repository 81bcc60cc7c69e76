"""Model states: what trains (every weight, or LoRA's low-rank adapters on a frozen base) and where weights,
gradients and AdamW state live (sharded on the GPUs by FSDP2, or in pinned host memory with the optimizer step
on the CPU, FSDP2's `CPUOffloadPolicy`, as `memo train --offload-states` runs them): per GPU, their device and
host bytes, the host link's traffic they add per step, and the CPU optimizer step's seconds."""

from __future__ import annotations

from ..config import ModelConfig
from ..job import Job
from ..lora import adapter_parameters

# a trained weight in one process (`train.optim.MasterAdamW`) at the update: its bf16 value, its fp32 master, AdamW's
# m and v, and the master's fp32 gradient (in the backward its bf16 gradient, 2 bytes less: counted at the larger)
BYTES_PER_PARAM = 2 + 4 + 8 + 4
# a trained weight under FSDP2 with bf16 mixed precision (`parallel.fsdp`), sharded: the fp32 parameter (its own
# master), its fp32 gradient, AdamW's m and v; bf16 copies exist only gathered (`device_terms`)
FSDP_BYTES_PER_PARAM = 4 + 4 + 8
# offloaded, per trained weight on the host: the fp32 sharded parameter (its own master), its fp32 gradient
# (FSDP2 reduces in fp32 and copies the shard out), and AdamW's two fp32 moments
HOST_BYTES_PER_PARAM = 4 + 4 + 8
GATHERED_LAYERS = 2  # FSDP2 holds the running layer's weights and prefetches the next one's
# PyTorch's AdamW over fp32 host tensors, as `memo train` runs it (fused=True): the per-tensor loop takes 14.76 s
# per step for 10B parameters ("PT-CPU" in the Adam latency table of Ren et al. 2021, ZeRO-Offload, arXiv
# 2101.06840; a DGX-2 host), and PyTorch's fused CPU kernel is 5.1x faster than that loop (PyTorch PR #123074,
# a 56-core Sapphire Rapids). benchmarks/cpu_adam.py times both on the machine it runs on
CPU_ADAM_SECONDS_PER_PARAM = 14.76 / 10e9 / 5.1


def frozen_bytes(job: Job) -> int:
    """Returns the bytes of a frozen base weight: its value in the training dtype, no gradient, master or moments."""
    return job.torch_dtype.itemsize


def root_parameters(c: ModelConfig) -> int:
    """Returns the weights outside the decoder layers: embedding and head (one tensor when tied), final norm;
    FSDP2's root unit, gathered for the whole step."""
    final_norm = (2 if c.arch == "gpt" else 1) * c.hidden_size  # LayerNorm's weight and bias, or RMSNorm's weight
    return c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2) + final_norm


def trained(job: Job) -> tuple[int, int]:
    """Returns (trained, frozen) parameters of the whole model: every weight trains, or the adapters alone."""
    c = job.model
    if job.lora is None:
        return c.num_parameters(), 0
    return adapter_parameters(c, job.lora), c.num_parameters()


def _layer(job: Job) -> tuple[int, int]:
    """Returns (trained, frozen) parameters of one decoder layer (one FSDP2 unit)."""
    c = job.model
    layer = (c.num_parameters() - root_parameters(c)) // c.n_layers
    if job.lora is None:
        return layer, 0
    return adapter_parameters(c, job.lora) // c.n_layers, layer


def device_terms(job: Job) -> dict[str, int]:
    """Returns one GPU's bytes of model states by term, as the code that holds them allocates them.

    One process (one GPU, states on it): `BYTES_PER_PARAM` per trained weight, `frozen_bytes` per frozen one.
    FSDP2 (more than one GPU, or states offloaded): the shards (`FSDP_BYTES_PER_PARAM`, or on the host when
    offloaded); "gathered": two layers in bf16 (the running one, the prefetched one) and the root unit (embedding,
    final norm, head), which FSDP2 leaves unsharded from its forward to its backward (the root never reshards
    after forward: torch/distributed/fsdp/_fully_shard/_fsdp_state.py, `_lazy_init`); "gradients": the root's
    trained weights' bf16 gradients, alive from the loss's backward to the end of the step, and one layer's
    reduce-scatter in flight beside the running layer's (a new fp32 input of the unsharded size and its fp32
    shard out per call, `_fsdp_collectives.foreach_reduce`; the next call waits for the one before,
    `_fsdp_param_group.post_backward`). Offloaded, each gathered layer's shard is first copied in as it is
    stored (`FSDPParam.all_gather_inputs`) and the shard out is then copied to the host."""
    gpus = job.gpus
    train, frozen = trained(job)
    if gpus == 1 and not job.offload_states:
        return {"states": train * BYTES_PER_PARAM + frozen * frozen_bytes(job), "gathered": 0, "gradients": 0}
    layer_train, layer_frozen = _layer(job)
    root = root_parameters(job.model)
    root_grads = 0 if job.lora else root - job.model.vocab_size * job.model.hidden_size * (not job.model.tie_embeddings)
    gathered = GATHERED_LAYERS * 2 * (layer_train + layer_frozen) + 2 * root
    reduce_scatter = layer_train * 4 * (1 + 1 / gpus)
    if not job.offload_states:
        shards = (train * FSDP_BYTES_PER_PARAM + frozen * frozen_bytes(job)) / gpus
    else:  # the shard of one layer on its way in: trained weights fp32, frozen ones as stored
        shards = (layer_train * 4 + layer_frozen * frozen_bytes(job)) / gpus
    return {"states": int(shards), "gathered": int(gathered), "gradients": int(2 * root_grads + reduce_scatter)}


def device_bytes(job: Job) -> int:
    """Returns one GPU's bytes of model states (`device_terms`, summed)."""
    return sum(device_terms(job).values())


def host_bytes(job: Job) -> int:
    """Returns one GPU's bytes of model states in host memory (0 unless offloaded): its shard of every weight,
    trained ones with their gradient and AdamW moments (`HOST_BYTES_PER_PARAM`), frozen ones in the job's dtype.
    The trainer refuses a run whose host budget cannot hold them with this same count (even shards: FSDP pads
    each parameter's rows to a multiple of the ranks, a few rows more)."""
    if not job.offload_states:
        return 0
    train, frozen = trained(job)
    return int((train * HOST_BYTES_PER_PARAM + frozen * frozen_bytes(job)) / job.gpus)


def layer_traffic(job: Job) -> tuple[float, float]:
    """Returns the host-link bytes one GPU moves for one layer's states, (in its forward, in its backward): its
    shard copied in for each gather (trained weights as fp32, frozen as bf16), and in the backward its fp32
    gradient shard copied out besides. 0 unless offloaded."""
    if not job.offload_states:
        return 0.0, 0.0
    layer_train, layer_frozen = _layer(job)
    weights = (layer_train * 4 + layer_frozen * frozen_bytes(job)) / job.gpus
    return weights, weights + layer_train * 4 / job.gpus


def root_traffic(job: Job) -> float:
    """Returns the host-link bytes of the root unit per step and GPU (0 unless offloaded): its shard copied in
    before the first layer and its gradient shard copied out after the last, with no compute to hide behind."""
    if not job.offload_states:
        return 0.0
    root = root_parameters(job.model) / job.gpus
    return root * (frozen_bytes(job) if job.lora else 4 + 4)


def optimizer_seconds(job: Job, node_gpus: int) -> float:
    """Returns the seconds of the CPU optimizer step, which starts after the backward and overlaps nothing (0
    unless offloaded): the `node_gpus` ranks of a node update their shards at once on the node's cores."""
    if not job.offload_states:
        return 0.0
    return trained(job)[0] * node_gpus / job.gpus * CPU_ADAM_SECONDS_PER_PARAM
