"""Hugging Face transformers: stock models trained context-parallel on flattened (packed) batches.

Importing this module registers the attention implementation ``"cpcompile"`` with
transformers' ``AttentionInterface``. A model loaded with
``attn_implementation="cpcompile"`` runs :func:`cpcompile.packed_attention` on the
flattened-batch convention of ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``:
batch size 1, ``position_ids`` restarting per document, ``cu_seq_lens_q`` /
``cu_seq_lens_k`` passed to the model. Compiled with :func:`cpcompile.backend`, every
layer's call becomes CP attention; :func:`shard_flattened_batch` cuts the batch for a
rank (its tokens, labels shifted on the whole pack, ``cu_seq_lens`` kept global).

What a rank cannot compute from its own tokens raises (on every rank, naming the config field): LFM2's
convolutions, Bamba's Mamba layers and other token mixers outside attention under CP, and Llama 4's chunked
attention under CP for documents longer than a chunk. A model whose layers compute attention themselves,
outside transformers' attention interface (Falcon, Bloom, GPT-J, GPT-Neo, CodeGen, MPT, XGLM), would never
call this implementation: it is refused when built (:func:`check_attention_interface`).

Design constraint: the model code stays stock. No attention mask is built (custom
implementations get ``attention_mask=None`` from transformers), so nothing of size
``T x T`` exists, and rotary embeddings follow the sharded ``position_ids``. The one change to transformers
is a check: ``PreTrainedModel.get_correct_attn_implementation``, which validates a model's
``attn_implementation`` while the model is built, first calls :func:`check_attention_interface` for
``"cpcompile"``.

    import cpcompile.integrations.hf as cphf

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=cphf.ATTN_IMPLEMENTATION)
    compiled = torch.compile(model, backend=cpcompile.backend(group=cp_group), dynamic=True)
    inputs, sharded = cphf.shard_flattened_batch(collator(examples), cp_size=cp, rank=rank)
    with cpcompile.strategy(sharded):
        loss = compiled(**inputs).loss   # this rank's share of the mean loss: add it over the CP group
"""

from __future__ import annotations

import functools
import sys

import torch

from cpcompile.attention import packed_attention
from cpcompile.batch import ShardedBatch, shard_batch
from cpcompile.cache import upload
from cpcompile.checks import check_cu_seqlens, data_checks_enabled
from cpcompile.cost.comm import Heads
from cpcompile.cost.timing import Topology
from cpcompile.spec import StrategyLike, current_rows

try:
    from transformers import AttentionInterface, PreTrainedModel
except ImportError as e:  # the extra is optional: say how to get it
    raise ImportError(
        'cpcompile.integrations.hf needs transformers: pip install "cpcompile[hf]" (or transformers>=5)'
    ) from e

ATTN_IMPLEMENTATION = "cpcompile"
IGNORE_INDEX = -100


def _check_batch_of_one(name: str, t: torch.Tensor) -> None:
    if t.dim() < 2 or t.shape[0] != 1:
        raise ValueError(
            f"{name} must have batch size 1 (one flattened batch: documents packed back to back, as "
            f"DataCollatorWithFlattening makes them), got shape {tuple(t.shape)}"
        )


def cpcompile_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over :func:`cpcompile.packed_attention`.

    Args:
        query: ``[1, Hq, T, D]``; key: ``[1, Hkv, T, D]``; value: ``[1, Hkv, T, Dv]`` (transformers'
            layout; ``Dv`` may differ from ``D``: DeepSeek-V3's multi-head latent attention); under CP, ``T``
            is the rank's token count.
        cu_seq_lens_q, cu_seq_lens_k: ``[B + 1]`` int32 cumulative document lengths of the
            whole pack (equal: self-attention), as DataCollatorWithFlattening returns them.
        max_length_q: longest document, a launch bound for GPU kernels.
        scaling: softmax scale (default ``D ** -0.5``); ``is_causal`` defaults to ``module.is_causal``.
        sliding_window: this layer's window (:func:`hf_window`; ``None`` on global layers), so
            models that alternate sliding and global layers run both.
        softcap: logit soft-capping (Gemma 2's ``config.attn_logit_softcapping``), as
            :func:`cpcompile.packed_attention` takes it.
    Returns:
        ``([1, T, Hq, Dv], None)``: the output in transformers' layout, and no attention weights.

    A chunked-attention layer (Llama 4's ``config.attention_chunk_size``) attends within each chunk of each
    document (:func:`_chunked`). Under CP (the strategy block's batch cut with ``cp_size > 1``)
    a model that reads more of the sequence than attention does is refused, eagerly or while Dynamo traces
    this function: token mixers outside attention (:func:`non_attention_layers`), Llama 4's temperature tuning.
    """
    layer = f"{type(module).__name__} (attn_implementation={ATTN_IMPLEMENTATION!r})"
    if cu_seq_lens_q is None:
        raise ValueError(
            f"{layer} needs cu_seq_lens_q, the [B + 1] int32 document boundaries of the flattened batch, got None: "
            "pass the batch of DataCollatorWithFlattening(return_flash_attn_kwargs=True) or of "
            "cpcompile.integrations.hf.shard_flattened_batch to the model" + _dropped_kwargs_hint(module)
        )
    config = getattr(module, "config", None)
    cp_size = _cp_size_in_force()
    if cp_size > 1:
        _check_cp_computable(module, config, cp_size, layer)
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
        # values are compared only where they can be read (not while tracing): see checks.data_checks_enabled
        readable = data_checks_enabled(cu_seq_lens_k) and data_checks_enabled(cu_seq_lens_q)
        if cu_seq_lens_k.shape != cu_seq_lens_q.shape or (readable and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
            shown = (cu_seq_lens_k.tolist(), cu_seq_lens_q.tolist()) if readable else (cu_seq_lens_k, cu_seq_lens_q)
            raise ValueError(
                f"{layer} computes self-attention over packed documents: cu_seq_lens_k must equal cu_seq_lens_q, "
                f"got {shown[0]} and {shown[1]}"
            )
    if attention_mask is not None:
        raise ValueError(
            f"{layer} does not support a 2-D or 4-D mask; documents are given by cu_seq_lens_q instead: "
            f"attention_mask must be None, got {attention_mask!r}"
        )
    if dropout != 0.0:
        field = next((f for f in _DROPOUT_FIELDS if getattr(config, f, None) == dropout), _DROPOUT_FIELDS[0])
        raise ValueError(
            f"{layer} does not support attention dropout: dropout must be 0.0, got {dropout!r} (set config.{field}=0.0)"
        )
    _check_batch_of_one("query", query)
    causal = module.is_causal if is_causal is None else is_causal
    window = hf_window(sliding_window, causal, layer)
    cu_seqlens = cu_seq_lens_q
    chunk = _attention_chunk(module, config)
    if chunk is not None:
        cu_seqlens, max_length_q = _chunked(cu_seq_lens_q, chunk, max_length_q, cp_size, layer)
    out = packed_attention(
        query[0].transpose(0, 1),  # [Hq, T, D] -> [T, Hq, D]
        key[0].transpose(0, 1),  # [T, Hkv, D]
        value[0].transpose(0, 1),
        cu_seqlens,
        max_seqlen=max_length_q,
        causal=causal,
        window_size=window,
        scale=scaling,
        sinks=kwargs.get("s_aux"),  # GPT-OSS's per-head sink logits (module.sinks), a parameter: its gradient flows
        softcap=softcap,
    )
    return out.unsqueeze(0), None  # [1, T, Hq, Dv]


def hf_window(sliding_window: object, causal: bool, layer: str = "attention") -> tuple[int, int] | None:
    """``varlen_attn``'s ``window_size`` of transformers' ``sliding_window`` (``None``: none).

    transformers gives a layer its config's ``sliding_window`` where ``config.layer_types`` marks it
    ``"sliding_attention"`` (``None`` on ``"full_attention"`` layers): a query sees the
    ``sliding_window`` most recent keys, itself included (``masking_utils.sliding_window_overlay``;
    its flash path passes ``window_size=(w - 1, w - 1)`` to a causal kernel), and on a
    bidirectional layer those within ``w - 1`` on either side.
    """
    if sliding_window is None:
        return None
    if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1:
        raise ValueError(f"{layer}: sliding_window must be None or an int >= 1, got {sliding_window!r}")
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def layer_windows(config: object) -> tuple[int, ...]:
    """Every layer's window as ``StrategySpec("balanced" or "auto", windows=...)`` takes them, from a transformers
    config: ``sliding_window - 1`` (:func:`hf_window`'s left side) for a sliding layer, -1 for a global
    one; ``()`` for a model without windows, whose balance counts causal work.

    A config with ``layer_types`` (Gemma 2/3, GPT-OSS, Qwen2 and the other alternating models of
    transformers 5) gives the window to its ``"sliding_attention"`` layers; one without (Mistral)
    gives ``sliding_window`` to every layer, where it is set. A multimodal config's text config
    (``get_text_config``) holds them.
    """
    config = config.get_text_config(decoder=True)  # a multimodal model's: its language model's
    sliding = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if sliding is None or (kinds is not None and "sliding_attention" not in kinds):
        return ()
    left = hf_window(sliding, True, type(config).__name__)[0]
    if kinds is None:
        return (left,) * int(config.num_hidden_layers)
    return tuple(left if kind == "sliding_attention" else -1 for kind in kinds)


@torch._dynamo.assume_constant_result
def _cp_size_in_force() -> int:
    """The CP size of the strategy block's batch (``with cpcompile.strategy(sharded)``, or the last batch
    sharded in the block), 1 without one: under CP the attention function refuses what a rank cannot compute
    from its own tokens (:func:`_check_cp_computable`). While Dynamo traces, read once as a constant and not
    guarded on: the block's batch changes every step, and a guard would recompile (inside a CUDA graph's
    capture, too) for what is the same model and group."""
    rows, _ = current_rows()
    return 1 if rows is None else rows.cp_size


#: ``config.layer_types`` entries whose layers mix tokens in the attention function alone (or not at all).
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
_NO_MIXING_LAYERS = frozenset({"mlp", "moe"})  # nemotron_h's feed-forward layers
#: Config fields of state-space, convolution and linear-attention layers, for configs without ``layer_types``.
_MIXER_FIELDS = (
    "conv_L_cache",  # LFM2
    "mamba_d_state",  # Bamba, Jamba, Zamba, Falcon-H1, GraniteMoeHybrid
    "mamba_num_heads",  # Nemotron-H
    "ssm_state_size",
    "linear_conv_kernel_dim",  # Qwen3-Next, Qwen3.5, Kimi-Linear, OLMo-hybrid
    "short_conv_kernel_size",
    "conv1d_width",  # RecurrentGemma
    "layers_block_type",
    "block_types",
    "hybrid_override_pattern",
)


def non_attention_layers(config: object) -> str | None:
    """What in a transformers config mixes tokens outside attention (convolutions, state-space scans, linear or
    sparse-indexed attention), named for an error; ``None``: nothing found.

    ``config.layer_types`` decides where the config has it: entries other than full, sliding and chunked attention
    (and the feed-forward ``"mlp"``/``"moe"``), with the layers that have them; else a field of such layers
    (:data:`_MIXER_FIELDS`)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        others = [(i, kind) for i, kind in enumerate(kinds) if kind not in _ATTENTION_LAYERS | _NO_MIXING_LAYERS]
        if not others:
            return None
        named = sorted({kind for _, kind in others})
        return f"config.layer_types {named} (layers {[i for i, _ in others]})"
    for field in _MIXER_FIELDS:
        if getattr(config, field, None) is not None:
            return f"config.{field}"
    return None


def _check_cp_computable(module: torch.nn.Module, config: object, cp_size: int, layer: str) -> None:
    """Refuse, under CP (``cp_size > 1``), a model that reads more of the sequence than attention does: a rank
    holds part of each document, so such a layer would see its own tokens alone, silently wrong."""
    model = type(config).__name__ if config is not None else type(module).__name__
    mixers = non_attention_layers(config) if config is not None else None
    if mixers is not None:
        raise ValueError(
            f"{layer}: {model} has layers that mix tokens outside attention ({mixers}: convolutions, state-space "
            f"or linear-attention scans, sparse indexers). Under context parallelism (cp_size={cp_size}) each rank "
            "holds only part of each document, and those layers would see only the rank's own tokens: "
            "cpcompile cannot run this model context-parallel. Use cp_size=1 (data parallelism alone)"
        )
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        # Llama 4's NoPE layers scale queries by the token's index in the sequence the layer sees
        raise ValueError(
            f"{layer}: {model}'s layers without RoPE scale their queries by each token's index in the sequence "
            "they see (config.attn_temperature_tuning=True), which under context parallelism "
            f"(cp_size={cp_size}) is the rank's own rows, not the pack: set config.attn_temperature_tuning=False, "
            "or use cp_size=1"
        )


#: the config fields that give attention its dropout, transformers' name first (GPT-2's, BERT-style names)
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")


@torch.compiler.disable  # only on the error path: reads the model's source
def _dropped_kwargs_hint(module: torch.nn.Module) -> str:
    """Where the attention module's decoder layer calls it without passing on its keyword arguments, a sentence
    saying so (the batch's ``cu_seq_lens_q`` never reaches attention then); else ``""``."""
    import inspect
    import re
    import sys

    source_module = sys.modules.get(type(module).__module__)
    for name, cls in vars(source_module or object()).items():
        if not (name.endswith("DecoderLayer") and isinstance(cls, type) and hasattr(cls, "forward")):
            continue
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        call = re.search(r"self\.self_attn\((.*?)\n\s*\)", source, re.DOTALL)
        if call is not None and "**kwargs" not in call.group(1):
            return (
                f". If the batch had them, the model dropped them: {name}.forward does not pass its keyword "
                f"arguments (cu_seq_lens_q among them) on to {type(module).__name__}, so this model cannot run "
                f"with attn_implementation={ATTN_IMPLEMENTATION!r} unless its decoder layer passes **kwargs on to "
                "attention"
            )
    return ""


def _attention_chunk(module: torch.nn.Module, config: object) -> int | None:
    """The chunk of a chunked-attention layer (Llama 4's ``"chunked_attention"`` layers: a query sees the keys of
    its own ``config.attention_chunk_size`` chunk of the document), ``None`` for other layers."""
    kinds = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if kinds is None or index is None or kinds[index] != "chunked_attention":
        return None
    return getattr(config, "attention_chunk_size", None)


def _chunked(
    cu_seqlens: torch.Tensor, chunk: int, max_length: int | None, cp_size: int, layer: str
) -> tuple[torch.Tensor, int | None]:
    """``(cu_seqlens, max_length)`` of chunked attention: each document cut into chunks of ``chunk`` tokens
    (from its first token, as the document alone would be), which attend as documents.

    Packs whose documents fit in one chunk (``max_length <= chunk``) are unchanged. Otherwise the cut offsets
    depend on the values of ``cu_seqlens``: on one process they are made on the host (:func:`_cut_in_chunks`,
    a graph break where compiled); under CP (``cp_size > 1``) they are refused, since the rows were laid out by
    the documents, not their chunks."""
    if max_length is not None and max_length <= chunk:
        return cu_seqlens, max_length
    if cp_size > 1:
        raise ValueError(
            f"{layer} is a chunked-attention layer (config.attention_chunk_size={chunk}): under context "
            f"parallelism (cp_size={cp_size}) cpcompile computes it only for packs whose documents fit in one "
            f"chunk, max_length_q <= {chunk}, got max_length_q={max_length}. Pack documents of at most {chunk} "
            "tokens (shard_flattened_batch gives the longest as max_length_q), or run on one process (cp_size=1), "
            "where documents are cut into chunks exactly"
        )
    return _cut_in_chunks(cu_seqlens, chunk)


@torch.compiler.disable  # the offsets' count depends on their values: made on the host, outside the graph
def _cut_in_chunks(cu_seqlens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` ``[B + 1]`` with each document cut every ``chunk`` tokens from its start, and the longest
    piece."""
    bounds = cu_seqlens.tolist()
    cut = bounds[:1]
    for start, end in zip(bounds[:-1], bounds[1:]):
        cut.extend(range(start + chunk, end, chunk))
        cut.append(end)
    longest = max([b - a for a, b in zip(cut[:-1], cut[1:])], default=0)
    return torch.tensor(cut, dtype=cu_seqlens.dtype, device=cu_seqlens.device), max(longest, 1)


AttentionInterface.register(ATTN_IMPLEMENTATION, cpcompile_attention_forward)


def check_attention_interface(model_class: type) -> None:
    """Raise ``ValueError`` where ``model_class`` (a transformers model) computes attention in its own layers
    rather than through transformers' ``AttentionInterface``: such a model never calls the function of
    ``attn_implementation="cpcompile"``, so it would attend across the documents of a flattened batch (and,
    under CP, over the rank's own tokens alone) without an error, or fail inside transformers (Falcon's
    ``KeyError: 'cpcompile'``).

    transformers' own test decides (``PreTrainedModel._can_set_attn_implementation``: a modeling module that
    defines attention layers and does not dispatch through the interface); a transformers release without that
    method checks nothing. A model whose modeling module has no attention function to dispatch to (a state-space
    model) is refused too: it has nothing for the implementation to replace."""
    follows_interface = getattr(model_class, "_can_set_attn_implementation", None)
    if follows_interface is None or follows_interface():
        modeling = sys.modules.get(model_class.__module__)
        if modeling is not None and not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS"):
            # no layer dispatches through the interface (Mamba, Mamba2, FalconMamba): the state-space layers would
            # carry their state from one document into the next of a flattened batch, and under CP see only the
            # rank's own tokens
            raise ValueError(
                f"{model_class.__name__} has no attention layer going through transformers' AttentionInterface "
                f"({model_class.__module__}), so attn_implementation={ATTN_IMPLEMENTATION!r} has nothing to replace: "
                "its layers would mix the documents of a flattened batch, and under context parallelism see each "
                "rank's own tokens alone. cpcompile cannot run this model"
            )
        return
    raise ValueError(
        f"{model_class.__name__} computes attention in its own layers ({model_class.__module__}), not through "
        f"transformers' AttentionInterface, so attn_implementation={ATTN_IMPLEMENTATION!r} would never be called: "
        "its layers would attend across the documents of a flattened batch, and under context parallelism over "
        "each rank's own tokens alone. cpcompile cannot run this model; it runs models whose attention goes "
        "through the interface (Llama, Qwen, Mistral, Gemma, Phi, OLMo, GPT-NeoX, GPTBigCode and others)"
    )


def _checking_attention_interface(get_correct_attn_implementation):
    """``PreTrainedModel.get_correct_attn_implementation`` that first refuses, for ``"cpcompile"``, the models
    :func:`check_attention_interface` refuses."""

    @functools.wraps(get_correct_attn_implementation)
    def checked(self, requested_attention, *args, **kwargs):
        if requested_attention == ATTN_IMPLEMENTATION:
            check_attention_interface(type(self))
        return get_correct_attn_implementation(self, requested_attention, *args, **kwargs)

    checked._cpcompile_checks_interface = True
    return checked


if not getattr(PreTrainedModel.get_correct_attn_implementation, "_cpcompile_checks_interface", False):  # once
    PreTrainedModel.get_correct_attn_implementation = _checking_attention_interface(
        PreTrainedModel.get_correct_attn_implementation
    )


def flattened_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries of a flattened batch from its ``position_ids``.

    Args:
        position_ids: ``[1, T]`` int64; a document starts wherever a position is not
            its predecessor's plus one (transformers' packed-sequence rule).
    Returns:
        ``[B + 1]`` int32 cumulative document lengths.
    """
    _check_batch_of_one("position_ids", position_ids)
    pos = position_ids[0]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    bounds = torch.cat([starts.nonzero()[:, 0], pos.new_tensor([pos.shape[0]])])
    return bounds.to(torch.int32)


def shift_labels(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Next-token targets of a flattened batch: ``labels[t + 1]`` inside a document, -100 on its last token.

    transformers' causal-LM loss shifts labels by one over the sequence it sees;
    under CP a rank's tokens are not consecutive, so the shift is done here, on the
    whole pack, and the model gets it as ``shift_labels``.

    Args:
        labels: ``[1, T]`` int64; cu_seqlens: ``[B + 1]`` int32.
    Returns:
        ``[1, T]`` int64.
    """
    _check_batch_of_one("labels", labels)
    shifted = torch.cat([labels[:, 1:], labels.new_full((1, 1), IGNORE_INDEX)], dim=1)
    last = cu_seqlens[1:].long() - 1  # each document's last token predicts nothing
    shifted[0, last[last >= 0]] = IGNORE_INDEX
    return shifted


def model_heads(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Heads:
    """A transformers model's attention heads as ``auto`` weighs them (:func:`shard_flattened_batch`'s
    ``heads``): query and key/value heads and their dimensions, from the language model's config
    (``get_text_config``: a multimodal model's); MLA's (DeepSeek-V2/V3) query/key heads are
    ``qk_nope_head_dim + qk_rope_head_dim`` and its value heads ``v_head_dim``. The element size is
    ``dtype``'s, the dtype attention runs in (under autocast, ``torch.bfloat16`` say); default that of
    the model's floating-point parameters (the first one's)."""
    config = model.config.get_text_config(decoder=True)
    q = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or q
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if nope is not None and rope is not None:  # MLA: q and k carry the rotary part beside the rest
        dim = nope + rope
    else:
        dim = getattr(config, "head_dim", None) or config.hidden_size // q
    v_dim = getattr(config, "v_head_dim", None) or dim
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return Heads(q, kv, dim, dtype.itemsize, None if v_dim == dim else v_dim)


def shard_flattened_batch(
    batch: dict,
    *,
    cp_size: int,
    rank: int,
    strategy: StrategyLike = None,
    device: torch.device | str | None = None,
    max_length: int | None = None,
    heads: Heads | None = None,
    topology: Topology | str | None = None,
) -> tuple[dict, ShardedBatch]:
    """Rank ``rank``'s part of a flattened transformers batch, ready for ``model(**inputs)``.

    Args:
        batch: ``input_ids`` ``[1, T]`` int64, ``position_ids`` ``[1, T]`` int64 restarting per
            document, optionally ``labels`` ``[1, T]`` (unshifted, as DataCollatorWithFlattening
            returns them) and ``cu_seq_lens_q`` ``[B + 1]`` int32 (else found from ``position_ids``).
        strategy: default the active one; ``auto`` is resolved here (see the returned spec).
        device: where the model runs: the batch (on the host) comes back there, ready for a step
            that reads nothing from the GPU (``cpcompile.shard_batch``'s ``device``).
        max_length: the ``max_length_q``/``max_length_k`` given to the model, at least the longest
            document (``ValueError`` otherwise); default the longest. A fixed one keeps packs of a
            capacity bucket (``StrategySpec.capacity``) in one graph with ``dynamic=False``, where
            Dynamo specialises the model's int arguments; it is also the kernels' launch bound.
        heads, topology: ``auto`` decides layout and path with communication (``cpcompile.shard_batch``'s);
            :func:`model_heads` gives a model's heads.
    Returns:
        ``(inputs, sharded)``. ``inputs``: ``input_ids``, ``position_ids`` ``[1, T_local]``;
        ``cu_seq_lens_q``/``cu_seq_lens_k`` ``[B + 1]`` int32 and ``max_length_q``/``max_length_k``
        of the whole pack; with labels, ``labels`` and ``shift_labels`` ``[1, T_local]`` (shifted
        on the whole pack) and ``num_items_in_batch`` (labelled tokens of the whole pack, a 0-d
        int64 tensor), so each rank's loss is its share of the pack's mean and the shares add up
        over the CP group. ``sharded``: the :class:`cpcompile.ShardedBatch`; run the model under
        ``cpcompile.strategy(sharded)``.
    """
    for name in ("input_ids", "position_ids"):
        if not isinstance(batch.get(name), torch.Tensor):
            raise ValueError(f"batch[{name!r}] must be a [1, T] tensor, got {batch.get(name)!r}")
        _check_batch_of_one(f"batch[{name!r}]", batch[name])
    shape = tuple(batch["input_ids"].shape)
    for name in ("position_ids", "labels"):
        t = batch.get(name)
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"batch[{name!r}] must have input_ids' shape {shape}, got {got}")
    cu = batch.get("cu_seq_lens_q")
    if cu is None:
        cu = flattened_cu_seqlens(batch["position_ids"])
    else:  # read here, before the labels are shifted by it
        check_cu_seqlens("batch['cu_seq_lens_q']", cu)
        if int(cu[-1]) != shape[1]:
            raise ValueError(f"batch['cu_seq_lens_q'][-1] = {int(cu[-1])} must be input_ids' token count {shape[1]}")
    tensors = {"input_ids": batch["input_ids"][0], "position_ids": batch["position_ids"][0]}
    if batch.get("labels") is not None:
        tensors["labels"] = shift_labels(batch["labels"], cu)[0]  # padded with -100 by shard_batch
    longest = int((cu[1:] - cu[:-1]).max())
    if max_length is None:
        max_length = longest
    elif not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < longest:
        raise ValueError(f"max_length must be an int of at least the longest document, {longest}; got {max_length!r}")
    kw = {"strategy": strategy, "device": device, "heads": heads, "topology": topology}
    sharded = shard_batch(tensors, cu, cp_size=cp_size, rank=rank, **kw)
    cu = sharded.cu_seqlens
    inputs = {name: t.unsqueeze(0) for name, t in sharded.tensors.items()}
    inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_length, max_length_k=max_length)
    if "labels" in tensors:
        inputs["shift_labels"] = inputs["labels"]  # the loss reads shift_labels; labels only switch it on
        # counted on the host and uploaded without waiting for the stream, as shard_batch uploads the rest: a
        # blocking copy would make the host wait for the GPU's previous step before this one's first launch (a
        # batch already on the device is counted there)
        count = (tensors["labels"] != IGNORE_INDEX).sum()
        inputs["num_items_in_batch"] = upload(count, cu.device) if count.device.type == "cpu" else count
    return inputs, sharded
