"""The compiled CP model composed with FSDP2 and with activation checkpointing, on real gloo ranks.

Two gloo ranks form the CP group. Each compiles its model through ``cpcompile.backend(inner="aot_eager")``,
takes its shard of flattened packs of different lengths and document counts, and trains. The reference
is independent of cpcompile: the same initial weights on one process, no CP, no FSDP, not compiled,
attention one document at a time without cpcompile (transformers' SDPA attention for the Llama: its
eager attention takes the softmax in float32; ``tests.reference.attention_fp64`` for PackedGPT).
Everything runs in float64, where the CP reference kernel accumulates in float64, so losses,
gradients and parameters after optimizer steps agree to rounding.

- FSDP2: the CP ranks are also the FSDP mesh (torchtitan shards over the flattened dp x cp mesh; here
  dp = 1), every decoder layer and the root ``fully_shard``-ed, then compiled.
- Activation checkpointing: HF gradient checkpointing of a Llama, and PackedGPT whose blocks go
  through ``torch.utils.checkpoint``; the compiled graphs must hold the checkpointed layers with CP
  attention inside them.
- Both together: FSDP2 over HF-checkpointed layers.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import cpcompile
from cpcompile.testing import GPTConfig, PackedGPT, synthetic_pack
from cpcompile.testing.hf_llama import causal_lm_loss, fully_shard_llama
from cpcompile.testing.losses import fuse_loss
from cpcompile.testing.packed_gpt import Attention
from tests.dist import assert_matches_summed_over_ranks, run_ranks
from tests.reference import attention_fp64, relative_error

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers", reason='needs the hf extra: pip install "cpcompile[hf]"')
cphf = pytest.importorskip("cpcompile.integrations.hf")

DTYPE = torch.float64
TOLERANCE = 1e-10  # float64 on both sides: only summation order differs
VOCAB = 48
PACKS = [[5, 9, 3, 13], [17, 1, 8], [2, 11, 6, 4, 20]]  # document lengths: T and B change every step
LAYERS = 2


# --- models and packs ----------------------------------------------------------------------------


def tiny_llama(attn_implementation: str) -> torch.nn.Module:
    """A 2-layer GQA Llama (4 query heads, 2 KV heads) with seeded random float64 weights, in train mode."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(DTYPE).train()  # HF checkpoints only in train mode


def flattened_batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """What DataCollatorWithFlattening(return_flash_attn_kwargs=True) returns for random documents of these lengths."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(VOCAB, (n,), generator=g).tolist() for n in lengths]
    return transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])


def llama_reference_loss(model, batch) -> torch.Tensor:
    """The pack's mean next-token cross-entropy, one document at a time (no packing involved)."""
    cu = batch["cu_seq_lens_q"].tolist()
    total = torch.zeros((), dtype=DTYPE)
    for a, b in zip(cu[:-1], cu[1:]):
        ids = batch["input_ids"][:, a:b]
        logits = model(input_ids=ids).logits[0]  # [n, VOCAB]
        total = total + F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
    return total / (len(batch["input_ids"][0]) - (len(cu) - 1))  # labelled tokens: all but each document's last


def llama_rank_loss(compiled, batch, rank: int, world: int) -> torch.Tensor:
    """This rank's share of the pack's mean loss: its tokens' summed cross-entropy over the pack's labelled count.

    The loss is taken from the float64 logits here: transformers' own loss casts logits to float32.
    """
    inputs, sharded = cphf.shard_flattened_batch(batch, cp_size=world, rank=rank)
    labels, labelled = inputs.pop("shift_labels")[0], inputs.pop("num_items_in_batch")
    del inputs["labels"]
    with cpcompile.strategy(sharded):
        logits = compiled(**inputs).logits[0]  # [T_local, VOCAB]
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / labelled


class CheckpointedGPT(PackedGPT):
    """PackedGPT with every block recomputed in backward (``torch.utils.checkpoint``, non-reentrant)."""

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = checkpoint(block, x, cu_seqlens, max_seqlen, use_reentrant=False)
        return self.head(self.norm(x))


class PlainAttention(Attention):
    """PackedGPT's attention with the packed call replaced by plain float64 softmax attention per document."""

    def forward(self, x, cu_seqlens, max_seqlen):
        q, k, v = self.qkv(x).unflatten(1, (-1, self.head_dim)).split([self.heads, self.kv_heads, self.kv_heads], 1)
        return self.out(attention_fp64(q, k, v, cu_seqlens, causal=True).flatten(1))


# --- what the compiled graphs hold ---------------------------------------------------------------


class GraphRecorder:
    """Wraps cpcompile's backend: counts the attention calls of each graph after the pass, and those run.

    Per compiled graph: ``cp`` (``cpcompile::cp_attention`` nodes, in the graph or any subgraph),
    ``packed`` (single-device packed attention left anywhere: it would attend within each rank's
    tokens only), ``cp_checkpointed`` (cp_attention nodes inside ``tag_activation_checkpoint`` bodies).
    ``ran`` and ``ran_checkpointed`` add a graph's counts each time it runs: per forward they must
    reach the layer count, also where one graph serves several layers (FSDP2's per-layer frames).
    """

    def __init__(self, inner) -> None:
        self.inner, self.graphs, self.ran, self.ran_checkpointed = inner, [], 0, 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        compiled = self.inner(gm, example_inputs)  # the pass rewrites gm in place first

        def cp_calls(module) -> int:
            graphs = [m.graph for m in module.modules() if isinstance(m, torch.fx.GraphModule)]
            return sum(n.target is torch.ops.cpcompile.cp_attention.default for g in graphs for n in g.nodes)

        modules = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
        hop = torch.ops.higher_order.tag_activation_checkpoint
        bodies = [
            getattr(m, n.args[0].target) for m in modules for n in m.graph.find_nodes(op="call_function", target=hop)
        ]
        graph = dict(
            cp=cp_calls(gm),
            packed=sum("packed_attention" in str(n.target) for m in modules for n in m.graph.nodes),
            cp_checkpointed=sum(map(cp_calls, bodies)),
        )
        self.graphs.append(graph)

        @functools.wraps(compiled)  # keeps the attributes Dynamo reads (_boxed_call)
        def run(*args):
            self.ran += graph["cp"]
            self.ran_checkpointed += graph["cp_checkpointed"]
            return compiled(*args)

        return run

    def check_forward(self, step: int, *, checkpointed: bool, label: str) -> None:
        """The forward just run was CP in every layer (inside checkpoint bodies if ``checkpointed``), and
        packs after the first (other lengths and document counts) compiled nothing new."""
        assert all(g["packed"] == 0 for g in self.graphs), (
            f"{label}: packed attention left single-device: {self.graphs}"
        )
        assert self.ran == LAYERS, f"{label}: {self.ran} CP attention calls ran, graphs {self.graphs}"
        assert self.ran_checkpointed == (LAYERS if checkpointed else 0), f"{label}: graphs {self.graphs}"
        self.ran = self.ran_checkpointed = 0
        if step == 0:
            self.first = len(self.graphs)
        assert len(self.graphs) == self.first, f"{label}: recompiled, graphs {self.graphs}"


def compile_cp(model, group=None):
    recorder = GraphRecorder(cpcompile.backend(group=group, inner="aot_eager"))
    torch._dynamo.reset()
    return torch.compile(model, backend=recorder, dynamic=True), recorder


# --- FSDP2 ---------------------------------------------------------------------------------------


def _fsdp_training(rank: int, world: int, checkpointing: bool, fused_loss: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    reference = tiny_llama("sdpa")
    model = tiny_llama(cphf.ATTN_IMPLEMENTATION)
    model.load_state_dict(reference.state_dict())
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    mesh = init_device_mesh("cpu", (world,))  # the CP ranks are the FSDP mesh (dp = 1)
    # Each rank's loss is its share of the pack's mean, so the pack's gradient is the SUM of the
    # ranks' gradients: the helper sets FSDP2's divide factor to the data-parallel size (1 here),
    # not the mesh size (its default mean would leave every gradient 1/cp of the pack's)
    if fused_loss:  # the loss in the output projection's forward, where FSDP2 has gathered its weight
        fuse_loss(model.lm_head)
    fully_shard_llama(model, mesh=mesh)
    compiled, recorder = compile_cp(model.model if fused_loss else model, group=mesh.get_group())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # SGD: steps scale with the gradient
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    named = list(zip(model.named_parameters(), reference.named_parameters()))

    for step, lengths in enumerate(PACKS):
        what = "FSDP2" + (" + checkpointing" if checkpointing else "") + (" + fused loss" if fused_loss else "")
        label = f"{what} rank {rank} step {step} docs {lengths}"
        batch = flattened_batch(lengths, seed=step)
        want = llama_reference_loss(reference, batch)
        want.backward()
        if fused_loss:
            inputs, sharded = cphf.shard_flattened_batch(batch, cp_size=world, rank=rank)
            with cpcompile.strategy(sharded):
                loss = causal_lm_loss(compiled, model, inputs)
        else:
            loss = llama_rank_loss(compiled, batch, rank, world)
        recorder.check_forward(step, checkpointed=checkpointing, label=label)
        loss.backward()

        total = loss.detach().clone()
        dist.all_reduce(total)
        assert relative_error(total, want) < TOLERANCE, f"loss {label}: {total} vs {want}"
        for (name, p), (_, p_ref) in named:
            assert isinstance(p.grad, DTensor), f"{name}'s gradient is not FSDP-sharded"
            grad = p.grad.full_tensor()  # the reduce-scattered shards, gathered
            assert relative_error(grad, p_ref.grad) < TOLERANCE, f"grad of {name} {label}"
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        for (name, p), (_, p_ref) in named:
            assert relative_error(p.full_tensor(), p_ref) < TOLERANCE, f"{name} after the optimizer step {label}"


def _fsdp_variants(rank: int, world: int) -> None:
    _fsdp_training(rank, world, False)
    _fsdp_training(rank, world, True)  # over HF-checkpointed layers
    _fsdp_training(rank, world, False, True)  # the loss in the output projection


def test_fsdp2_cp_training_matches_one_process():
    """Plain, with HF checkpointing, and with the loss in the output projection, in turn on one pair of
    ranks: starting the processes (and importing transformers) costs more than a variant."""
    run_ranks(_fsdp_variants, 2)


# --- activation checkpointing --------------------------------------------------------------------


def _hf_checkpointing(rank: int, world: int) -> None:
    reference = tiny_llama("sdpa")
    model = tiny_llama(cphf.ATTN_IMPLEMENTATION)
    model.load_state_dict(reference.state_dict())
    model.gradient_checkpointing_enable({"use_reentrant": False})
    compiled, recorder = compile_cp(model)
    with cpcompile.strategy("balanced"):
        for step, lengths in enumerate(PACKS):
            label = f"HF checkpointing rank {rank} step {step} docs {lengths}"
            batch = flattened_batch(lengths, seed=step)
            reference.zero_grad()
            want = llama_reference_loss(reference, batch)
            want.backward()
            model.zero_grad()
            loss = llama_rank_loss(compiled, batch, rank, world)
            recorder.check_forward(step, checkpointed=True, label=label)
            loss.backward()
            assert_matches_summed_over_ranks(loss, want, model, reference, label, TOLERANCE)


def _checkpointed_gpt(rank: int, world: int) -> None:
    cfg = GPTConfig(vocab=VOCAB, dim=32, heads=4, kv_heads=2, layers=LAYERS, max_position=64)
    torch.manual_seed(0)
    reference = PackedGPT(cfg).to(DTYPE)
    for block in reference.blocks:
        block.attn.__class__ = PlainAttention  # same parameters, attention without cpcompile
    model = CheckpointedGPT(cfg).to(DTYPE)
    model.load_state_dict(reference.state_dict())
    compiled, recorder = compile_cp(model)
    with cpcompile.strategy("no_load_balance"):
        for step, lengths in enumerate(PACKS):
            label = f"checkpointed PackedGPT rank {rank} step {step} docs {lengths}"
            pack = synthetic_pack(lengths, VOCAB, torch.Generator().manual_seed(step))  # [T] tensors, cu [B + 1]
            cu, max_seqlen = pack["cu_seqlens"], max(lengths)
            reference.zero_grad()
            logits = reference(pack["input_ids"], pack["position_ids"], cu, max_seqlen)  # [T, VOCAB]
            want = F.cross_entropy(logits, pack["labels"], ignore_index=-100, reduction="sum")
            want.backward()

            model.zero_grad()
            names = ("input_ids", "position_ids", "labels")
            batch = cpcompile.shard_batch({n: pack[n] for n in names}, cu, cp_size=world, rank=rank)
            t = batch.tensors  # [T_local], padding rows labelled -100
            logits = compiled(t["input_ids"], t["position_ids"], batch.cu_seqlens, max_seqlen)  # [T_local, VOCAB]
            recorder.check_forward(step, checkpointed=True, label=label)
            loss = F.cross_entropy(logits, t["labels"], ignore_index=-100, reduction="sum")  # summed: adds over ranks
            loss.backward()
            assert_matches_summed_over_ranks(loss, want, model, reference, label, TOLERANCE)


def _checkpointing(rank: int, world: int) -> None:
    _hf_checkpointing(rank, world)
    _checkpointed_gpt(rank, world)


def test_hf_and_torch_checkpointing_match_one_process():
    """HF gradient checkpointing of a Llama, then PackedGPT's blocks through ``torch.utils.checkpoint``,
    on one pair of ranks."""
    run_ranks(_checkpointing, 2)
