"""The transformers architectures cpcompile's HF attention runs, at cp=2 on gloo, compiled, against one process.

Each architecture is a tiny random-weight causal LM built from its config (no hub downloads): 2 layers
where the model alternates layer kinds (sliding and global, RoPE and NoPE, chunked and full), else 1;
4 query heads over 2 K/V heads where the model has GQA; float64 (MoE experts through transformers'
eager experts). On each of 2 gloo ranks the model, ``attn_implementation="cpcompile"``, has its attention
modules compiled with ``cpcompile.backend`` (what CP rewrites: projections, rotary embeddings, norms and
the attention call; the rest of the model runs per token, eagerly) and takes its shard of one flattened
pack (``shard_flattened_batch``): its logits (at the rank's tokens), its loss and every parameter
gradient, added over the ranks, must equal the same weights run one document at a time with
transformers' SDPA attention, to rounding. A transformers upgrade that changes what an architecture
passes to attention (or how it mixes tokens) fails here by name.

Every architecture is compiled, forward and backward, through ``inner="aot_eager"`` (exact to float64
rounding) and through ``inner="inductor"`` (the default; exact but where the compiled attention modules round
to float32 themselves, :data:`INDUCTOR_TOLERANCES`). Cost (the suite runs on 2 CPU cores): the matrix
compiles with static shapes (``dynamic=False``, several times cheaper to compile;
tests/integrations/test_hf.py covers ``dynamic=True`` and several packs per graph) and runs the
architectures one after another in a pair of gloo processes; inductor, slow to compile on CPU, takes the
architectures in :data:`INDUCTOR_PARTS` tests of their own, which pytest-xdist spreads over its workers.
Llama 4 is compiled whole too (its MoE's in-place add beside the rewritten attention).

Gemma 2 runs with its logit soft-capping (a cap of 0.02, which the tiny model's scores reach), and
DeepSeek-V3 with its multi-head latent attention (query/key head dim 12, value head dim 8, as DeepSeek's
192/128).
Architectures CP cannot run exactly are refused on every rank with an error naming the config field:
token mixers outside attention (LFM2's convolutions, Bamba's Mamba layers),
Llama 4's chunked attention over documents longer than a chunk (compiled) and its NoPE layers'
temperature tuning; StableLM, whose decoder layer drops the batch's offsets, gets an error saying so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpcompile
from tests.dist import run_ranks
from tests.reference import relative_error

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers", reason='needs the hf extra: pip install "cpcompile[hf]"')
cphf = pytest.importorskip("cpcompile.integrations.hf")

TOLERANCE = 1e-9  # float64 on both sides
VOCAB = 48
PACK = [5, 9, 3, 13]  # document lengths: longer and shorter than the sliding window and the Llama 4 chunk
WINDOW = 4
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=64)
GQA = dict(SMALL, num_key_value_heads=2)
MOE = dict(num_experts_per_tok=2)
ALTERNATING = dict(num_hidden_layers=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])


def _llama4(chunk: int = 32, tuning: bool = False, **extra) -> dict:
    """Llama 4's text model, every layer MoE (routed and shared experts), a chunked (RoPE) layer then a full
    (NoPE) one; ``chunk`` longer than every document of :data:`PACK` but for the chunking tests."""
    return dict(
        GQA,
        num_hidden_layers=2,
        head_dim=8,
        intermediate_size_mlp=64,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        no_rope_layers=[1, 0],
        attention_chunk_size=chunk,
        attn_temperature_tuning=tuning,
        **extra,
    )


#: name -> (config class, causal-LM class, config arguments)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(GQA, num_hidden_layers=1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(GQA, use_sliding_window=True, **ALTERNATING)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(GQA, num_hidden_layers=1, head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(GQA, num_hidden_layers=1, sliding_window=WINDOW)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(GQA, num_hidden_layers=1, pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(GQA, num_hidden_layers=1)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(GQA, **ALTERNATING)),
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(GQA, num_hidden_layers=2, no_rope_layers=[1, 0], pad_token_id=0),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(GQA, num_hidden_layers=1, head_dim=8)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(GQA, head_dim=8, attn_logit_softcapping=0.02, final_logit_softcapping=None, **ALTERNATING),
    ),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(GQA, head_dim=8, **ALTERNATING)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(GQA, num_hidden_layers=1)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(GQA, num_hidden_layers=1)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(GQA, head_dim=8, **ALTERNATING)),
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(GQA, num_hidden_layers=1, head_dim=8)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(GQA, num_hidden_layers=1, sliding_window=WINDOW)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(GQA, **ALTERNATING)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(GQA, **MOE, num_hidden_layers=1, num_local_experts=4)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            GQA, **MOE, num_hidden_layers=1, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(GQA, **MOE, num_hidden_layers=1, head_dim=8, num_experts=4, moe_intermediate_size=16),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(GQA, **MOE, num_hidden_layers=1, num_experts=4)),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_inner=64,
            n_layer=1,
            n_head=4,
            n_positions=64,
            multi_query=True,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
        ),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            word_embed_proj_dim=32,
            ffn_dim=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=64,
            pad_token_id=0,
            dropout=0.0,
            attention_dropout=0.0,
            layerdrop=0.0,
        ),
    ),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", _llama4()),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(GQA, num_hidden_layers=1, resid_pdrop=0.0, embd_pdrop=0.0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(SMALL, num_hidden_layers=1)),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(GQA, num_hidden_layers=1, head_dim=8, pad_token_id=0)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(GQA, num_hidden_layers=1, head_dim=8, pad_token_id=0)),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(GQA, head_dim=8, **ALTERNATING)),
    "seed_oss": (
        "SeedOssConfig",
        "SeedOssForCausalLM",
        dict(GQA, num_hidden_layers=1, head_dim=8, pad_token_id=0, attention_dropout=0.0, residual_dropout=0.0),
    ),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(GQA, num_hidden_layers=1, head_dim=8)),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(GQA, num_hidden_layers=1, pad_token_id=0)),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(GQA, num_hidden_layers=1)),
    "hunyuan": (
        "HunYuanDenseV1Config",
        "HunYuanDenseV1ForCausalLM",
        dict(GQA, num_hidden_layers=1, head_dim=8, pad_token_id=0),
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(GQA, **MOE, num_hidden_layers=1, num_local_experts=4),
    ),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(GQA, **MOE, num_hidden_layers=1, num_local_experts=4)),
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", dict(GQA, num_hidden_layers=1)),
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", dict(GQA, num_hidden_layers=1)),
    # learnable sinks (s_aux) in every layer, sliding and full; MoE experts
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            GQA,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **ALTERNATING,
        ),
    ),
    # multi-head latent attention: keys of qk_nope + qk_rope = 12 dims, values of 8; a dense MLP layer
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            SMALL,
            num_hidden_layers=1,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            rope_interleave=False,
        ),
    ),
}

#: the reference's attention where transformers has no SDPA for the model (Gemma 2's eager attention takes its
#: softmax in float32; GPT-OSS's, with the sinks' column, in the model's dtype), and the tolerance where the
#: model rounds to float32 itself (its norms or the eager softmax)
REFERENCE = {"gemma2": ("eager",), "gpt_oss": ("eager",)}
FLOAT32_NORMS = 1e-6
TOLERANCES = {arch: FLOAT32_NORMS for arch in ("gemma", "gemma2", "gemma3", "cohere", "cohere2", "helium", "diffllama")}

#: under inductor, the models whose compiled attention modules round to float32: their query/key (or output)
#: norms take float32 (eager rounds after each op, inductor's fused kernels once, in their own order), and
#: Llama 4's rotary embeddings are complex multiplications (its own SDPA model alike, one process); DeepSeek-V3's
#: attention norms its latent K/V (and queries, with a query rank) in float32
INDUCTOR_TOLERANCES = {
    arch: FLOAT32_NORMS
    for arch in (
        "qwen3", "olmo2", "olmo3", "exaone4", "qwen3_moe", "olmoe", "apertus", "hunyuan", "bitnet", "llama4",
        "deepseek_v3",
    )
}  # fmt: skip

#: the inductor matrix's tests: every architecture of :data:`ARCHS` in one of them (taken alternately: about
#: as much compile time in each)
INDUCTOR_PARTS = 2


def tiny_model(arch: str, attn_implementation: str, **changes) -> torch.nn.Module:
    """``arch`` of :data:`ARCHS` (its config changed by ``changes``), seeded random weights, float64."""
    config_class, model_class, kwargs = ARCHS[arch]
    config = getattr(transformers, config_class)(
        **{**kwargs, **changes},
        use_cache=False,
        attn_implementation=attn_implementation,
        experts_implementation="eager",  # MoE experts in float64 (grouped_mm takes float32 and narrower)
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).to(torch.float64)
    with torch.no_grad():  # random biases and norm weights (zeros and ones at init hide mistakes in them)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def flattened_batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """What DataCollatorWithFlattening(return_flash_attn_kwargs=True) returns for these documents."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return collate([{"input_ids": d} for d in docs])


def reference_logits(model, batch) -> torch.Tensor:
    """``[T, vocab]`` logits of the pack, each document run alone (no packing involved)."""
    cu = batch["cu_seq_lens_q"].tolist()
    return torch.cat([model(input_ids=batch["input_ids"][:, a:b]).logits[0] for a, b in zip(cu, cu[1:])])


def loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over ``logits`` ``[T, vocab]`` (``shift_labels`` ``[T]``, -100 skipped)."""
    return F.cross_entropy(logits, shift_labels, ignore_index=-100, reduction="sum")


def compile_attention(model: torch.nn.Module, backend, dynamic: bool = True) -> None:
    """Compile each attention module of ``model`` (those of a class named ``*Attention``, not inside another):
    what CP rewrites (projections, rotary embeddings, norms and the attention call) at a fraction of the
    whole model's compile time; the rest runs per token, eagerly."""
    names = [n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    for name in names:
        if not any(name.startswith(other + ".") for other in names):
            model.get_submodule(name).compile(backend=backend, dynamic=dynamic)


def _check_arch(rank: int, world: int, arch: str, inner: str, whole: bool = False) -> None:
    """One pack forward and backward of ``arch`` on this rank against the reference, its attention modules
    (``whole``: the whole model) compiled with ``inner``."""
    attn = REFERENCE.get(arch, ("sdpa",))[0]
    tolerance = max(TOLERANCES.get(arch, TOLERANCE), INDUCTOR_TOLERANCES.get(arch, 0.0) if inner == "inductor" else 0.0)
    reference = tiny_model(arch, attn)
    model = tiny_model(arch, cphf.ATTN_IMPLEMENTATION)
    batch = flattened_batch(PACK, seed=1)
    want_logits = reference_logits(reference, batch)
    shifted = cphf.shift_labels(batch["labels"], batch["cu_seq_lens_q"])[0]
    want = loss_sum(want_logits, shifted)
    want.backward()

    spec = cpcompile.StrategySpec("dual_chunk_swap")
    inputs, sharded = cphf.shard_flattened_batch(batch, cp_size=world, rank=rank, strategy=spec)
    # each local row's index in the pack (-1: padding), laid out as shard_flattened_batch lays out the tokens
    where = cpcompile.shard_batch(
        {"i": torch.arange(sum(PACK))},
        batch["cu_seq_lens_q"],
        cp_size=world,
        rank=rank,
        strategy=spec,
        pad_values={"i": -1},
    ).tensors["i"]
    torch._dynamo.reset()
    backend = cpcompile.backend(inner=inner)
    if whole:
        compiled = torch.compile(model, backend=backend, dynamic=False)
    else:
        compiled = model
        compile_attention(model, backend, dynamic=False)
    with cpcompile.strategy(sharded):
        logits = compiled(**inputs).logits[0]  # [T_local, vocab]
    label = f"{arch} ({inner}) rank {rank}/{world}"
    real = where >= 0
    assert relative_error(logits[real], want_logits[where[real]]) < tolerance, f"logits of {label}"
    loss = loss_sum(logits, inputs["shift_labels"][0])
    loss.backward()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    assert relative_error(total, want.detach()) < tolerance, f"loss of {label}: {total} vs {want}"
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()  # an expert no token of this rank chose
        torch.distributed.all_reduce(grad)
        want_grad = torch.zeros_like(p_ref) if p_ref.grad is None else p_ref.grad
        if want_grad.abs().max() < 1e-12:  # zero but for rounding (a key bias: softmax ignores it)
            assert grad.abs().max() < 1e-12, f"grad of {name}, {label}: {grad.abs().max()}"
        else:
            assert relative_error(grad, want_grad) < tolerance, f"grad of {name}, {label}"


def _matrix(rank: int, world: int, archs: list[str], inner: str, whole: bool = False) -> None:
    failures = []
    for arch in archs:  # every architecture, then the failures by name
        try:
            _check_arch(rank, world, arch, inner, whole)
        except Exception as e:  # noqa: BLE001 (reported below, with the others)
            failures.append(f"{arch}: {type(e).__name__}: {str(e)[:400]}")
    assert not failures, "\n".join(failures)


def test_architectures_aot_eager():
    """Every architecture of :data:`ARCHS`, forward and backward through aot_eager, exact at cp=2."""
    run_ranks(_matrix, 2, list(ARCHS), "aot_eager", timeout_s=600)


@pytest.mark.parametrize("part", range(INDUCTOR_PARTS))
def test_architectures_inductor(part: int):
    """Every architecture of :data:`ARCHS` (this test's share of them), forward and backward through inductor,
    exact at cp=2 (head-major q and k, as partial rotary embeddings leave them, included: Phi, GPT-NeoX, GLM,
    DiffLlama)."""
    run_ranks(_matrix, 2, list(ARCHS)[part::INDUCTOR_PARTS], "inductor", timeout_s=600)


def _llama4_whole_and_refusals(rank: int, world: int) -> None:
    _matrix(rank, world, ["llama4"], "aot_eager", whole=True)
    # LFM2 (a convolution layer, then attention) under CP: refused on every rank while the attention compiles
    config = transformers.Lfm2Config(
        **SMALL, num_key_value_heads=2, num_hidden_layers=2, layer_types=["conv", "full_attention"], use_cache=False
    )
    config._attn_implementation = cphf.ATTN_IMPLEMENTATION
    model = transformers.Lfm2ForCausalLM(config).to(torch.float64)
    torch._dynamo.reset()
    compile_attention(model, cpcompile.backend(inner="aot_eager"), dynamic=False)
    inputs, sharded = cphf.shard_flattened_batch(
        flattened_batch(PACK, seed=1), cp_size=world, rank=rank, strategy="balanced"
    )
    with pytest.raises(
        ValueError, match=r"Lfm2Config has layers that mix tokens outside attention .*'conv'.*cp_size=2"
    ):
        with cpcompile.strategy(sharded):
            model(**inputs)


def test_llama4_moe_compiled_whole_and_token_mixers_refused_on_every_rank():
    """Llama 4 (routed and shared experts, chunked and NoPE layers) compiled whole: the experts' in-place
    ``out.add_(routed_out)`` beside the rewritten attention is kept (a pass that dropped it lost the routed
    experts' output, 100 % of their gradients). Then LFM2 under CP raises on both ranks."""
    run_ranks(_llama4_whole_and_refusals, 2, timeout_s=300)
