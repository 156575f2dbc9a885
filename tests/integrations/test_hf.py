"""Stock Hugging Face causal LMs trained context-parallel (``cpcompile.integrations.hf``).

Tiny random-weight LlamaForCausalLM and Qwen2ForCausalLM (also one alternating sliding-window
and global layers) built from configs (no hub downloads). On 2 gloo ranks each rank compiles the model with
``attn_implementation="cpcompile"`` through ``cpcompile.backend(inner="aot_eager")``,
takes its shard of flattened batches of varying length and document count
(``shard_flattened_batch``), and its loss (transformers' own causal-LM loss) and every
parameter gradient, added over the ranks, must equal the reference: the same weights
run one document at a time with transformers' SDPA attention, cross-entropy summed
over next tokens, all in float64 (transformers' eager attention takes its softmax in float32), so
they agree to rounding. The in-process tests cover the single-device path, the label shift
and the error messages.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import cpcompile
from tests.dist import assert_matches_summed_over_ranks, compiled_graphs, run_ranks
from tests.reference import relative_error

transformers = pytest.importorskip("transformers", reason='needs the hf extra: pip install "cpcompile[hf]"')
cphf = pytest.importorskip("cpcompile.integrations.hf")
from cpcompile.testing.hf_llama import compile_llama  # noqa: E402  (needs transformers)

TOLERANCE = 1e-9  # float64 on both sides
LOSS_FLOAT32 = 1e-6
VOCAB = 48
PACKS = [[5, 9, 3, 13], [17, 1, 8], [2, 11, 6, 4, 20]]  # document lengths: T and B vary per step


def tiny_model(arch: str, attn_implementation: str) -> torch.nn.Module:
    """A 2-layer GQA model (4 query heads, 2 KV heads) with seeded random weights, in float64."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    # alternating sliding and global layers (as Gemma 3, GPT-OSS and Qwen2 with layer_types run them),
    # with a window shorter than most documents
    alternating = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    config = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common, use_sliding_window=False),
        "qwen2_sliding": lambda: transformers.Qwen2Config(**common, use_sliding_window=True, **alternating),
    }[arch]()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    return model(config).to(torch.float64)


def flattened_batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """What DataCollatorWithFlattening(return_flash_attn_kwargs=True) returns for these documents."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(VOCAB, (n,), generator=g).tolist() for n in lengths]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return collate([{"input_ids": d} for d in docs])


def reference_loss_sum(model, batch) -> torch.Tensor:
    """Next-token cross-entropy summed over the pack, one document at a time (no packing involved)."""
    cu = batch["cu_seq_lens_q"].tolist()
    total = torch.zeros(())
    for a, b in zip(cu[:-1], cu[1:]):
        ids = batch["input_ids"][:, a:b]
        logits = model(input_ids=ids).logits[0]  # [n, vocab]
        total = total + F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
    return total


def loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over ``logits`` ``[1, T, vocab]`` in their dtype (transformers'
    loss takes them in float32)."""
    return F.cross_entropy(logits[0], shift_labels[0], ignore_index=-100, reduction="sum")


def _check_cp_training(rank: int, world: int, archs: list[str], regional: bool = False, spec=None) -> None:
    """``regional``: each decoder layer compiled on its own (one graph for all of them, as
    torchtitan compiles per block), and the batch given to the model through the loader's
    ``device`` path (``shard_flattened_batch(..., device=...)``, which makes the plan there);
    ``spec``: the strategy (default: the active one)."""
    for arch in archs:
        reference = tiny_model(arch, "sdpa")
        model = tiny_model(arch, cphf.ATTN_IMPLEMENTATION)
        torch._dynamo.reset()
        counters.clear()
        ops = set()  # what the pass left in the graphs

        def inner(gm, example_inputs, ops=ops):
            ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

        compiled = compile_llama(model, cpcompile.backend(inner=inner), regional=regional)
        graphs_after_first = None
        for step, lengths in enumerate(PACKS):
            batch = flattened_batch(lengths, seed=step)
            label = f"{arch} rank {rank}/{world} step {step} docs {lengths}"
            reference.zero_grad()
            want = reference_loss_sum(reference, batch)
            want.backward()
            labelled = sum(n - 1 for n in lengths)

            device = "cpu" if regional else None
            inputs, sharded = cphf.shard_flattened_batch(batch, cp_size=world, rank=rank, strategy=spec, device=device)
            assert int(inputs["num_items_in_batch"]) == labelled, label
            model.zero_grad()
            with cpcompile.strategy(sharded):
                out = compiled(**inputs)
            loss = loss_sum(out.logits, inputs["shift_labels"])
            # transformers' own loss, this rank's share of the pack's mean, takes the logits in float32
            assert relative_error(out.loss * labelled, loss.detach()) < LOSS_FLOAT32, label
            loss.backward()
            assert_matches_summed_over_ranks(loss, want, model, reference, label, TOLERANCE)
            if step == 0:
                graphs_after_first = counters["stats"]["unique_graphs"]
        # new lengths and document counts reuse the graphs compiled for the first pack
        assert counters["stats"]["unique_graphs"] == graphs_after_first, f"{arch} recompiled"
        if regional:  # every layer runs the first layer's graph
            assert graphs_after_first == 1, graphs_after_first
        head_parallel = spec is not None and spec.head_parallel > 1
        assert ("cpcompile.cp_head_attention.default" in ops) == head_parallel, ops


# Each test runs several cases in turn on one pair of ranks: starting the processes (and importing
# transformers there) costs more than a case.


def _archs_and_windows(rank: int, world: int, windows: tuple[int, ...]) -> None:
    _check_cp_training(rank, world, ["llama", "qwen2_sliding"])  # Qwen2's architecture, its window too
    _check_cp_training(rank, world, ["qwen2_sliding"], False, cpcompile.StrategySpec("balanced", windows=windows))


@pytest.mark.distributed
def test_compiled_cp_training_matches_single_device():
    """Llama and the alternating Qwen2 under the active strategy, then the Qwen2 under balanced told
    each layer's window (``layer_windows``: the sliding layer's 3, the global one's -1)."""
    windows = cphf.layer_windows(tiny_model("qwen2_sliding", "eager").config)
    run_ranks(_archs_and_windows, 2, windows)


def _count_graphs_over_packs(rank: int, world: int, packs: int) -> None:
    """Forward and backward of a Llama over ``packs`` random packs (1-12 documents of 1-24 tokens,
    1-token documents included), each decoder layer compiled on its own (as docs/guide.md's GPU job
    runs it): one graph for all layers and packs."""
    rng = random.Random(7)
    lengths = [[rng.choice([1, rng.randint(2, 24)]) for _ in range(rng.randint(1, 12))] for _ in range(packs)]
    assert len({sum(p) for p in lengths}) > 10 and len({len(p) for p in lengths}) > 5
    model = tiny_model("llama", cphf.ATTN_IMPLEMENTATION)
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_llama(model, cpcompile.backend(inner="aot_eager"), regional=True)
    for step, docs in enumerate(lengths):
        inputs, sharded = cphf.shard_flattened_batch(flattened_batch(docs, seed=step), cp_size=world, rank=rank)
        with cpcompile.strategy(sharded):
            compiled(**inputs).loss.backward()
    assert compiled_graphs() == 1, compiled_graphs()


def _regional_head_parallel_and_many_packs(rank: int, world: int) -> None:
    _check_cp_training(rank, world, ["llama"], True)
    _check_cp_training(
        rank, world, ["llama"], False, cpcompile.StrategySpec("no_load_balance", kv="heads", head_parallel=2)
    )
    _count_graphs_over_packs(rank, world, 50)


@pytest.mark.distributed
def test_regional_and_head_parallel_training_and_one_graph_over_fifty_packs():
    """Each decoder layer compiled on its own; Ulysses through the HF attention function (4 query heads,
    2 K/V heads over 2 ranks); then one graph over fifty packs of varying length and document count."""
    run_ranks(_regional_head_parallel_and_many_packs, 2)


def test_single_device_matches_per_document():
    model = tiny_model("llama", cphf.ATTN_IMPLEMENTATION)
    reference = tiny_model("llama", "sdpa")
    batch = flattened_batch(PACKS[0], seed=0)
    out = model(**batch)  # transformers shifts the collator's labels itself
    want = reference_loss_sum(reference, batch)
    assert (
        relative_error(loss_sum(out.logits, cphf.shift_labels(batch["labels"], batch["cu_seq_lens_q"])), want)
        < TOLERANCE
    )
    assert relative_error(out.loss * sum(n - 1 for n in PACKS[0]), want) < LOSS_FLOAT32


def test_sliding_layers_get_their_window():
    """The sliding layers of an alternating model run windowed attention, the global ones do not: its
    logits match the SDPA reference's on every document, and differ from a model without windows."""
    model = tiny_model("qwen2_sliding", cphf.ATTN_IMPLEMENTATION)
    layers = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert layers == [4, None], layers
    batch = flattened_batch(PACKS[0], seed=0)
    got = model(**batch).logits[0]  # [T, vocab]
    cu = batch["cu_seq_lens_q"].tolist()
    for name, arch in (("windowed", "qwen2_sliding"), ("unwindowed", "qwen2")):
        reference = tiny_model(arch, "sdpa")
        want = torch.cat([reference(input_ids=batch["input_ids"][:, a:b]).logits[0] for a, b in zip(cu, cu[1:])])
        error = relative_error(got, want)
        assert error < TOLERANCE if name == "windowed" else error > 100 * TOLERANCE, (name, error)


def test_layer_windows_follow_the_config():
    """Each layer's window as balanced takes them: alternating models by ``layer_types``, Mistral-like
    ones (no ``layer_types``) on every layer, none for models without windows."""
    assert cphf.layer_windows(tiny_model("qwen2_sliding", "eager").config) == (3, -1)
    assert cphf.layer_windows(tiny_model("qwen2", "eager").config) == ()
    assert cphf.layer_windows(tiny_model("llama", "eager").config) == ()
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=32)
    assert cphf.layer_windows(mistral) == (31, 31, 31)
    gemma = transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window=16)
    assert cphf.layer_windows(gemma) == (15,) * 5 + (-1,)
    multimodal = transformers.Gemma3Config(text_config={"num_hidden_layers": 6, "sliding_window": 16})
    assert cphf.layer_windows(multimodal) == (15,) * 5 + (-1,)
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1, got 0"):
        cphf.layer_windows(transformers.MistralConfig(num_hidden_layers=1, sliding_window=0))


def test_shift_labels_stay_inside_documents():
    labels = torch.tensor([[-100, 11, 12, -100, 21, -100, 31, 32]])
    cu = torch.tensor([0, 3, 5, 6, 8], dtype=torch.int32)
    assert cphf.shift_labels(labels, cu).tolist() == [[11, 12, -100, 21, -100, -100, 32, -100]]
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    assert cphf.flattened_cu_seqlens(positions).tolist() == [0, 3, 5, 6, 8]


def test_shard_keeps_global_metadata():
    batch = flattened_batch([7, 5], seed=1)
    inputs, sharded = cphf.shard_flattened_batch(batch, cp_size=2, rank=1, strategy="dual_chunk_swap")
    assert inputs["cu_seq_lens_q"].tolist() == [0, 7, 12] and inputs["max_length_q"] == 7
    assert inputs["input_ids"].shape == (1, sharded.indices.shape[0])
    # position ids travel with their tokens: the rank's rotary phases are the pack's
    full = torch.cat([batch["position_ids"][0, :7], torch.zeros(1, dtype=torch.long), batch["position_ids"][0, 7:]])
    full = torch.cat([full, torch.zeros(3, dtype=torch.long)])  # dual_chunk_swap pads each document to 4k
    assert inputs["position_ids"][0].tolist() == full[sharded.indices].tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_a_batch_on_the_device_is_sharded_there_with_its_label_count():
    """A batch already on the GPU (no ``device``): its labelled tokens counted there, as on the host (an upload
    takes host tensors: it pins them)."""
    host = flattened_batch([7, 5], seed=1)
    batch = {name: t.cuda() if isinstance(t, torch.Tensor) else t for name, t in host.items()}
    inputs, _ = cphf.shard_flattened_batch(batch, cp_size=2, rank=1, strategy="dual_chunk_swap")
    count = inputs["num_items_in_batch"]
    assert count.device == batch["input_ids"].device and int(count) == 7 - 1 + 5 - 1


def test_auto_with_a_topology_decides_from_the_models_heads():
    from cpcompile.cost.comm import Heads
    from cpcompile.cost.timing import resolve

    model = tiny_model("llama", "sdpa")
    heads = cphf.model_heads(model)
    config = model.config
    assert heads == Heads(config.num_attention_heads, config.num_key_value_heads, 32 // 4, 8)  # float64
    batch = flattened_batch([70, 5, 40, 13], seed=1)
    _, sharded = cphf.shard_flattened_batch(batch, cp_size=2, rank=1, strategy="auto", heads=heads, topology="h200")
    assert sharded.spec == resolve("auto", batch["cu_seq_lens_q"], cp_size=2, heads=heads, topology="h200")
    assert sharded.sharded_for.requested == sharded.spec  # the step runs the decision


def test_shard_to_a_capacity_gives_packs_one_shape_and_the_launch_bound_asked_for():
    """With a capacity bucket and a fixed ``max_length``, every pack gives the model the same shapes
    and ints (one graph under ``dynamic=False``); a ``max_length`` below the longest document is refused."""
    spec = cpcompile.StrategySpec("balanced", capacity=cpcompile.Capacity(tokens=32, documents=4))
    for lengths in ([7, 5], [20, 1, 3], [2]):
        inputs, sharded = cphf.shard_flattened_batch(
            flattened_batch(lengths, seed=1), cp_size=2, rank=0, strategy=spec, max_length=32
        )
        assert inputs["cu_seq_lens_q"].shape == (5,) and inputs["input_ids"].shape == (1, 16)
        assert inputs["max_length_q"] == inputs["max_length_k"] == 32 and sharded.spec == spec
    with pytest.raises(ValueError, match="max_length must be an int of at least the longest document, 20; got 8"):
        cphf.shard_flattened_batch(flattened_batch([20, 1], seed=1), cp_size=2, rank=0, strategy=spec, max_length=8)


def test_shard_refuses_a_batch_whose_parts_disagree():
    """Labels or ``cu_seq_lens_q`` of another length than ``input_ids`` are named, not an IndexError
    from the labels' shift."""
    batch = flattened_batch([7, 5], seed=1)
    cases = [
        ({"labels": batch["labels"][:, :10]}, r"batch\['labels'\] must have input_ids' shape \(1, 12\), got \(1, 10\)"),
        ({"position_ids": batch["position_ids"][:, :10]}, r"batch\['position_ids'\] must have input_ids' shape"),
        (
            {"cu_seq_lens_q": torch.tensor([0, 7, 20], dtype=torch.int32)},
            r"batch\['cu_seq_lens_q'\]\[-1\] = 20 must be input_ids' token count 12",
        ),
        ({"cu_seq_lens_q": torch.tensor([0, 7, 12])}, r"batch\['cu_seq_lens_q'\] must have dtype torch.int32"),
    ]
    for change, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            cphf.shard_flattened_batch(batch | change, cp_size=2, rank=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cu_seq_lens_q": None}, "needs cu_seq_lens_q"),
        ({"sliding_window": 0}, "sliding_window must be None or an int >= 1, got 0"),
        ({"dropout": 0.1}, "dropout must be 0.0, got 0.1"),
        ({"cu_seq_lens_k": torch.tensor([0, 4, 8], dtype=torch.int32)}, "cu_seq_lens_k must equal cu_seq_lens_q"),
    ],
)
def test_errors_name_the_argument(kwargs, message):
    model = tiny_model("llama", cphf.ATTN_IMPLEMENTATION)
    module = model.model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    args = {"cu_seq_lens_q": torch.tensor([0, 3, 8], dtype=torch.int32), **kwargs}
    with pytest.raises(ValueError, match=message):
        cphf.cpcompile_attention_forward(module, q, kv, kv, None, **args)


def test_model_heads_reads_the_text_config_mla_dims_and_attentions_dtype():
    """The language model's config (a multimodal model's text config), MLA's query/key and value head
    dimensions, and the dtype attention runs in where given (autocast), else the parameters'."""
    from cpcompile.cost.comm import Heads

    class Stub(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config, self.emb = config, torch.nn.Embedding(4, 4, dtype=torch.bfloat16)

    mla = transformers.DeepseekV3Config(
        num_attention_heads=16, num_key_value_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )
    assert cphf.model_heads(Stub(mla)) == Heads(16, 16, 192, 2, 128)
    assert cphf.model_heads(Stub(mla), torch.float32).itemsize == 4
    llama = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    outer = transformers.LlavaConfig(text_config=llama.to_dict())
    assert cphf.model_heads(Stub(outer)) == Heads(8, 2, 8, 2)  # v_dim None: the value heads are dim's
