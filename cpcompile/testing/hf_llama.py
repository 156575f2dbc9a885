"""A random-weight Hugging Face ``LlamaForCausalLM`` with cpcompile's attention, for the GPU main
job and the end-to-end benchmark (needs transformers: the ``hf`` extra)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Layer shapes: hidden and MLP sizes, query and K/V heads, vocabulary."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


#: Llama-3-8B's layer shapes (vocabulary 32,000, Llama 2's).
LLAMA_8B_LAYERS = LlamaShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000)


def random_llama(
    shape: LlamaShape,
    layers: int,
    *,
    max_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    checkpointing: bool = False,
) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of ``layers`` decoder layers in training mode, seeded alike on every rank,
    made in ``dtype`` on ``device`` (no float32 copy first), ``attn_implementation="cpcompile"``;
    ``checkpointing``: HF activation checkpointing of every layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cpcompile.integrations import hf as cphf

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(max_tokens, 8192),
        use_cache=False,
        attn_implementation=cphf.ATTN_IMPLEMENTATION,
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    if checkpointing:  # activation_checkpointing_enable from transformers 5.2x, the old name before
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    return model.train()


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters of the model's linear layers: the ``N`` of ``6 N`` FLOPs per token (:mod:`cpcompile.cost.flops`)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def fully_shard_llama(model: torch.nn.Module, mesh=None, dp_size: int = 1) -> None:
    """FSDP2 (``fully_shard``) over each decoder layer, then the output projection and the decoder
    stack (``model.lm_head``, ``model.model``: no unit on the root), on ``mesh`` (default: every rank),
    as torchtitan shards over the flattened dp x cp mesh. With the output projection a unit of its
    own, :func:`causal_lm_loss` runs the loss in its forward (:func:`~cpcompile.testing.losses.fuse_loss`
    first), where FSDP2 has gathered its weight; calls of the whole model run as before.

    Each CP rank's loss is its share of the pack's mean, so a pack's gradient is the sum of
    the ranks' gradients: FSDP2's reduce-scatter divides by ``dp_size`` alone (the data-parallel
    mean), not by the mesh size, and stays a plain sum (a pre-multiplied sum is not on gloo).
    """
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:  # before torch 2.6
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard

    if model.lm_head.weight is model.model.embed_tokens.weight:
        raise ValueError("fully_shard_llama: tied input and output embeddings (tie_word_embeddings) are not supported")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model.model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(dp_size))
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch 2.8 and later
                module.set_force_sum_reduction_for_comms(True)


def compile_llama(model: torch.nn.Module, backend, *, regional: bool = False, base: bool = False) -> torch.nn.Module:
    """``model`` compiled whole, or with ``regional`` each decoder layer on its own, as torchtitan
    compiles per block: the layers share one code object, so one graph serves every layer and the
    compile time does not grow with depth. Returns what to call: the ``LlamaForCausalLM``, or with
    ``base`` its decoder stack ``model.model`` (for :func:`causal_lm_loss`)."""
    target = model.model if base else model
    if not regional:
        return torch.compile(target, backend=backend, dynamic=True)
    for layer in model.model.layers:
        layer.compile(backend=backend, dynamic=True)
    return target


#: What :func:`causal_lm_loss` reads itself rather than passing to the decoder stack.
_LOSS_INPUTS = ("labels", "shift_labels", "num_items_in_batch")


def causal_lm_loss(decoder, model: torch.nn.Module, inputs: dict, *, chunk: int = 8192) -> torch.Tensor:
    """This rank's share of the pack's mean next-token loss, as ``model(**inputs).loss`` gives it
    from ``shard_flattened_batch``'s inputs, without the ``[T, vocab]`` logits: ``decoder`` (what
    :func:`compile_llama` returns with ``base=True``) gives the hidden states, and ``model.lm_head``
    (a :class:`~cpcompile.testing.losses.LinearCrossEntropy`; a plain ``nn.Linear`` is made one)
    takes them to the summed loss in its forward, so FSDP2 (:func:`fully_shard_llama`) works too."""
    from cpcompile.testing.losses import LinearCrossEntropy, fuse_loss

    head = model.lm_head
    if not isinstance(head, LinearCrossEntropy):
        fuse_loss(head)
    hidden = decoder(**{k: v for k, v in inputs.items() if k not in _LOSS_INPUTS}).last_hidden_state[0]
    return head(hidden, inputs["shift_labels"][0], chunk=chunk) / inputs["num_items_in_batch"]
