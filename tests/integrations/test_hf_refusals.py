"""What cpcompile's HF attention refuses, and Llama 4's chunked attention, in one process.

A model that reads more of the sequence than attention does (LFM2's convolutions, Bamba's Mamba layers)
cannot be split over CP ranks: given a batch cut for CP (``shard_flattened_batch(cp_size=2)``), the
attention function raises naming the config field, eagerly and while Dynamo traces the model (so a
compiled model raises before it runs; every rank raises alike, from its config and the batch's CP size).
Gemma 2's soft-capping runs (uncompiled, one process: exact); StableLM's decoder layer, which drops the
batch's offsets, is named; attention dropout names the config field that gives it. Models that compute
attention in their own layers (Falcon, Bloom, GPT-J), which would never call the implementation, are refused
when built. Llama 4's chunked layers attend within ``attention_chunk_size`` chunks of each document: exact
uncompiled (the offsets cut per chunk), refused compiled for documents longer than a chunk;
its NoPE layers' temperature tuning is refused under CP.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from tests.integrations.test_hf_matrix import (
    FLOAT32_NORMS,
    PACK,
    compile_attention,
    flattened_batch,
    reference_logits,
    tiny_model,
)
from tests.reference import relative_error

transformers = pytest.importorskip("transformers", reason='needs the hf extra: pip install "cpcompile[hf]"')
cphf = pytest.importorskip("cpcompile.integrations.hf")

TOLERANCE = 1e-9
SMALL = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def _model(config_class: str, model_class: str, **kwargs) -> torch.nn.Module:
    config = getattr(transformers, config_class)(
        **SMALL, **kwargs, use_cache=False, attn_implementation=cphf.ATTN_IMPLEMENTATION
    )
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).to(torch.float64)


def lfm2() -> torch.nn.Module:
    return _model("Lfm2Config", "Lfm2ForCausalLM", num_hidden_layers=2, layer_types=["conv", "full_attention"])


def bamba() -> torch.nn.Module:
    return _model(
        "BambaConfig",
        "BambaForCausalLM",
        num_hidden_layers=2,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_chunk_size=8,
    )


def _cp_inputs(cp_size: int = 2) -> tuple[dict, cpcompile.ShardedBatch]:
    return cphf.shard_flattened_batch(flattened_batch(PACK, seed=1), cp_size=cp_size, rank=0, strategy="balanced")


def _run(model, cut: tuple[dict, cpcompile.ShardedBatch], compiled: bool):
    if compiled:  # the refusal comes while Dynamo traces the attention function, before any backend runs
        torch._dynamo.reset()
        compile_attention(model, "aot_eager")
    inputs, sharded = cut
    with cpcompile.strategy(sharded):
        return model(**inputs)


LFM2 = r"Lfm2Config has layers that mix tokens outside attention \(config.layer_types \['conv'\] \(layers \[0\]\)"
BAMBA = r"BambaConfig has layers .* \(config.layer_types \['linear_attention'\] \(layers \[0\]\)"


@pytest.mark.parametrize(
    ("make", "named", "compiled"),
    [(lfm2, LFM2, False), (bamba, BAMBA, False), (lfm2, LFM2, True)],
    ids=["lfm2", "bamba", "lfm2-compiled"],
)
def test_token_mixers_outside_attention_are_refused_under_cp(make, named, compiled):
    model = make()
    with pytest.raises(ValueError, match=named + r".*cp_size=2"):
        _run(model, _cp_inputs(), compiled)
    if not compiled:  # one process (cp_size=1): no refusal, the model runs
        assert _run(model, _cp_inputs(cp_size=1), compiled).logits.shape == (1, sum(PACK), 48)


def test_non_attention_layers_follow_the_config():
    assert cphf.non_attention_layers(transformers.LlamaConfig()) is None
    assert cphf.non_attention_layers(transformers.Gemma3TextConfig(num_hidden_layers=2)) is None
    assert cphf.non_attention_layers(transformers.Lfm2Config(num_hidden_layers=2)) is None  # every layer attention
    assert "'hybrid'" in cphf.non_attention_layers(transformers.FalconH1Config(num_hidden_layers=2))
    nemotron = transformers.NemotronHConfig(num_hidden_layers=3, layers_block_type=["mamba", "attention", "mlp"])
    assert cphf.non_attention_layers(nemotron) is not None


def test_gemma2_softcapping_is_exact_uncompiled():
    """``config.attn_logit_softcapping`` reaches the attention function, which caps the scores (a cap the
    tiny model's scores reach): the pack equals its documents run alone with transformers' eager attention."""
    model = tiny_model("gemma2", cphf.ATTN_IMPLEMENTATION, attn_logit_softcapping=0.02)
    reference = tiny_model("gemma2", "eager", attn_logit_softcapping=0.02)
    uncapped = tiny_model("gemma2", "eager", attn_logit_softcapping=None)
    batch = flattened_batch(PACK, seed=1)
    want = reference_logits(reference, batch)
    assert relative_error(model(**batch).logits[0], want) < FLOAT32_NORMS
    assert relative_error(reference_logits(uncapped, batch), want) > 50 * FLOAT32_NORMS  # the cap changes the result


def test_stablelm_that_drops_the_offsets_is_named():
    model = _model("StableLmConfig", "StableLmForCausalLM", num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"the model dropped them: StableLmDecoderLayer.forward does not pass"):
        model(**flattened_batch(PACK, seed=1))


@pytest.mark.parametrize(
    ("config_class", "model_class", "kwargs"),
    [
        ("FalconConfig", "FalconForCausalLM", dict(hidden_size=32, num_attention_heads=4)),  # was KeyError: 'cpcompile'
        ("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_head=4)),  # ran its own attention over the pack
        ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=32, n_head=4, rotary_dim=4)),
    ],
    ids=["falcon", "bloom", "gptj"],
)
def test_models_that_compute_attention_themselves_are_refused_when_built(config_class, model_class, kwargs):
    config = getattr(transformers, config_class)(
        vocab_size=48, num_hidden_layers=1, **kwargs, attn_implementation=cphf.ATTN_IMPLEMENTATION
    )
    with pytest.raises(ValueError, match=model_class + r" computes attention in its own layers .*AttentionInterface"):
        getattr(transformers, model_class)(config)
    stock = getattr(transformers, config_class)(vocab_size=48, num_hidden_layers=1, **kwargs)
    getattr(transformers, model_class)(stock)  # with its own attention: built as before


def test_attention_dropout_names_the_config_field():
    config = transformers.GPT2Config(
        vocab_size=48, n_embd=32, n_head=4, n_layer=1, attn_pdrop=0.25, attn_implementation=cphf.ATTN_IMPLEMENTATION
    )
    model = transformers.GPT2LMHeadModel(config).train()
    with pytest.raises(ValueError, match=r"dropout must be 0.0, got 0.25 \(set config.attn_pdrop=0.0\)"):
        model(**flattened_batch(PACK, seed=1))


def test_llama4_chunked_attention_is_exact_uncompiled():
    """Chunks of 4 tokens, shorter than most documents: the chunked layer matches each document run alone with
    SDPA (transformers' chunked mask), and differs from a model without chunks."""
    batch = flattened_batch(PACK, seed=1)
    got = tiny_model("llama4", cphf.ATTN_IMPLEMENTATION, attention_chunk_size=4)(**batch).logits[0]
    want = reference_logits(tiny_model("llama4", "sdpa", attention_chunk_size=4), batch)
    assert relative_error(got, want) < TOLERANCE
    unchunked = reference_logits(tiny_model("llama4", "sdpa", attention_chunk_size=64), batch)
    assert relative_error(got, unchunked) > 1e3 * TOLERANCE


def test_llama4_chunked_attention_compiled_on_one_process_is_exact():
    """Compiled on one process, the chunked layer's offsets are cut on the host (a graph break)."""
    batch = flattened_batch(PACK, seed=1)
    model = tiny_model("llama4", cphf.ATTN_IMPLEMENTATION, attention_chunk_size=4)
    torch._dynamo.reset()
    model.model.layers[0].self_attn.compile(backend="aot_eager", dynamic=True)  # the chunked layer
    want = reference_logits(tiny_model("llama4", "sdpa", attention_chunk_size=4), batch)
    assert relative_error(model(**batch).logits[0], want) < TOLERANCE


def _attention_under_cp(model, layer: int):
    """The attention function of ``layer`` on a batch cut for cp_size=2 (as each rank's compiled model calls it)."""
    inputs, sharded = _cp_inputs()
    q, kv = torch.randn(1, 4, 16, 8, dtype=torch.float64), torch.randn(1, 2, 16, 8, dtype=torch.float64)
    keys = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    module = model.model.layers[layer].self_attn
    with cpcompile.strategy(sharded):
        return cphf.cpcompile_attention_forward(module, q, kv, kv, None, **{k: inputs[k] for k in keys})


def test_llama4_chunked_attention_under_cp_refuses_documents_longer_than_a_chunk():
    model = tiny_model("llama4", cphf.ATTN_IMPLEMENTATION, attention_chunk_size=4)
    with pytest.raises(ValueError, match=r"config.attention_chunk_size=4\).*cp_size=2.*got max_length_q=13"):
        _attention_under_cp(model, 0)


def test_llama4_temperature_tuning_is_refused_under_cp():
    model = tiny_model("llama4", cphf.ATTN_IMPLEMENTATION, attn_temperature_tuning=True)
    with pytest.raises(ValueError, match=r"config.attn_temperature_tuning=True.*cp_size=2"):
        _attention_under_cp(model, 1)


def test_models_without_attention_layers_are_refused_when_built():
    """A state-space model (Mamba) has no attention to replace: it would mix the documents of a flattened
    batch (its state carries over), and under CP see each rank's tokens alone; it was built without an error."""
    config = transformers.MambaConfig(
        vocab_size=48, hidden_size=16, num_hidden_layers=1, attn_implementation=cphf.ATTN_IMPLEMENTATION
    )
    with pytest.raises(ValueError, match=r"MambaForCausalLM has no attention layer going through .*AttentionInterface"):
        transformers.MambaForCausalLM(config)
    transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=48, hidden_size=16, num_hidden_layers=1))
