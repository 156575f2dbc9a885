"""Hugging Face ``Trainer`` and TRL's ``SFTTrainer(padding_free=True)`` trained context-parallel.

One configuration turns CP on: the trainer class gets :class:`CPTrainerMixin` (ready-made:
:class:`CPTrainer`, and ``CPSFTTrainer`` where TRL is installed) and a ``cp=CPConfig(cp_size=...)``
argument; the script is otherwise the one that trains on one process::

    from cpcompile.integrations.trainer import CPConfig, CPTrainer

    trainer = CPTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                        data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True),
                        cp=CPConfig(cp_size=2))
    trainer.train()          # torchrun --nproc-per-node 4 train.py: dp=2 x cp=2

What the mixin does, on ranks laid out ``rank = dp_rank * cp_size + cp_rank`` (a CP group is adjacent ranks):

- **model**: switched to ``attn_implementation="cpcompile"`` and compiled in place with :func:`cpcompile.backend`
  over its CP group (each decoder layer, or with ``CPConfig(regional=False)`` the whole model), once for packs of
  any composition (``dynamic=True``). The Trainer then wraps it in DDP over every rank as usual.
- **data**: the training loader is sharded over the data-parallel groups only (accelerate's ``BatchSamplerShard``
  given ``dp_size`` and ``dp_rank``): CP peers get the same flattened pack, DP groups different packs.
  Each step each rank keeps its share (:func:`cpcompile.integrations.hf.shard_flattened_batch`, labels shifted
  on the whole pack) and runs it under ``cpcompile.strategy(sharded)``.
- **loss**: the Trainer's own normalisation, told the CP size (``get_cp_size``): the labelled tokens of all
  packs of the step (``average_tokens_across_devices``, the default), so each rank's loss is its share of the
  mean over every token of the step, scaled by the world size as DDP's averaging expects. The gradients DDP
  averages over dp x cp are then those of one process trained on all the packs; the logged loss (the Trainer's
  mean over ranks) is that process's loss.
- **checkpoints**: the Trainer's (model and optimizer state from rank 0, equal on every rank, each rank's RNG
  state), resumed with ``resume_from_checkpoint`` as usual.

What CP cannot compute exactly raises, naming the setting: batches that are not flattened (an
``attention_mask``, a batch size above 1), label smoothing and ``compute_loss_func`` (they would shift this
rank's labels again), ``torch_compile=True`` (the mixin compiles), an ``IterableDataset`` (its loader has no
sampler to shard by DP group), evaluation under CP.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

import cpcompile
from cpcompile.cache import upload
from cpcompile.cost.comm import Heads
from cpcompile.cost.timing import check_topology, options
from cpcompile.integrations import hf as cphf
from cpcompile.spec import Strategy, StrategyLike, StrategySpec, resolve_strategy

try:
    from accelerate.data_loader import BatchSamplerShard
    from transformers import Trainer
except ImportError as e:  # the extra is optional: say how to get it
    raise ImportError(
        'cpcompile.integrations.trainer needs transformers and accelerate: pip install "cpcompile[trainers]"'
    ) from e

logger = logging.getLogger(__name__)

#: Batch keys the sharded step consumes or replaces (the flattened-batch convention).
_FLATTENED_KEYS = frozenset(
    {"input_ids", "position_ids", "labels", "shift_labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
     "max_length_k", "num_items_in_batch"}
)  # fmt: skip
#: Per-token keys of padding-free collators that only token mixers outside attention read (TRL's ``seq_idx``,
#: for short convolutions): such models are refused under CP, so the key is dropped.
_DROPPED_KEYS = frozenset({"seq_idx"})


@dataclasses.dataclass(frozen=True)
class CPConfig:
    """How a trainer runs context-parallel.

    Args:
        cp_size: ranks per CP group (adjacent ranks); the world size must be a multiple of it, the quotient
            is the data-parallel size. 1: data parallelism alone (the model still runs cpcompile's attention).
        strategy: every choice of how CP runs, one :class:`cpcompile.StrategySpec` (layout, ``kv``, ``kernel``,
            ...; or a :class:`cpcompile.Strategy` or its name, the rest defaults); the batches are sharded under it
            and each step runs under ``cpcompile.strategy(batch)``, so its attention runs as the spec says.
            Default ``balanced`` told each layer's sliding window (:func:`cpcompile.integrations.hf.layer_windows`);
            ``auto`` given no ``windows`` is told them too (it then never picks head parallelism, which attention
            refuses under sliding windows).
        inner: the compiler after the CP pass (``"inductor"``, ``"aot_eager"``, ...).
        regional: compile each decoder layer on its own (the model's ``_no_split_modules`` classes: one graph
            for all layers, compile time independent of depth; the default), or with False the whole model.
        topology: with ``strategy="auto"``, where the ranks sit (a :class:`cpcompile.cost.timing.Topology` or its
            text, e.g. ``"h200,gpus_per_node=4"``): ``auto`` then decides each pack's layout, K/V path and head
            parallelism with communication, given the model's heads (``cpcompile.shard_batch``'s ``topology``;
            one compilation per distinct decision: the trainer raises ``torch._dynamo.config.recompile_limit`` to
            hold them). ``None``: ``auto`` weighs the kernel's work alone. Only with ``auto`` (else ``ValueError``).
    """

    cp_size: int = 1
    strategy: StrategyLike = None
    inner: object = "inductor"
    regional: bool = True
    topology: object = None

    def __post_init__(self):
        if not isinstance(self.cp_size, int) or isinstance(self.cp_size, bool) or self.cp_size < 1:
            raise ValueError(f"CPConfig.cp_size must be an int >= 1, got {self.cp_size!r}")
        if not isinstance(self.regional, bool):
            raise TypeError(f"CPConfig.regional must be a bool, got {self.regional!r}")
        if self.topology is not None:  # here, before the Trainer is built
            auto = self.strategy is not None and resolve_strategy(self.strategy).strategy is Strategy.AUTO
            if not auto:
                raise ValueError(
                    f"CPConfig.topology={self.topology!r} only applies to strategy='auto' (which it lets decide each "
                    f"pack's layout and K/V path with communication), got strategy={self.strategy!r}: use "
                    "strategy='auto', or topology=None"
                )
            try:
                object.__setattr__(self, "topology", check_topology(self.topology))
            except ValueError as e:
                raise ValueError(f"CPConfig.{e}") from None


class CPTrainerMixin:
    """Context parallelism for a ``transformers.Trainer`` subclass: ``class T(CPTrainerMixin, Trainer)``, built
    with ``cp=CPConfig(...)`` (or an int, the CP size). See the module docstring for what it changes."""

    def __init__(self, *args, cp: CPConfig | int | None = None, **kwargs):
        config = CPConfig(cp_size=cp) if isinstance(cp, int) and not isinstance(cp, bool) else cp or CPConfig()
        if not isinstance(config, CPConfig):
            raise TypeError(f"cp must be a CPConfig or an int (the CP size), got {cp!r}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "torch_compile", False):
            raise ValueError(
                "TrainingArguments.torch_compile must be False with a CP trainer, got True: the trainer compiles the "
                "model with cpcompile.backend itself (choose the compiler after the CP pass with CPConfig(inner=...))"
            )
        super().__init__(*args, **kwargs)
        self.cp_config = config
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if world % config.cp_size:
            raise ValueError(
                f"CPConfig.cp_size={config.cp_size} must divide the world size {world} (dp x cp ranks; CP groups are "
                "adjacent ranks)"
            )
        self.cp_rank, self.dp_rank = rank % config.cp_size, rank // config.cp_size
        self.dp_size = world // config.cp_size
        self.cp_group = _cp_groups(world, config.cp_size)[self.dp_rank] if world > 1 else None
        self._check_cp_settings()
        model = self.accelerator.unwrap_model(self.model)
        if model.config._attn_implementation != cphf.ATTN_IMPLEMENTATION:
            logger.info("CP trainer: attn_implementation %r -> %r", model.config._attn_implementation,
                        cphf.ATTN_IMPLEMENTATION)  # fmt: skip
            model.set_attn_implementation(cphf.ATTN_IMPLEMENTATION)
        self.cp_strategy = _with_model_windows(config.strategy, cphf.layer_windows(model.config))
        self.cp_heads = None  # auto's decision with communication weighs the model's heads
        if config.topology is not None:
            # attention's dtype: the autocast one where the Trainer's mixed precision is on
            dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
            self.cp_heads = cphf.model_heads(model, dtype)
            _make_room_for_decisions(config.cp_size, self.cp_heads)
        # one process without a process group has nothing to make CP: the inner compiler alone
        backend = cpcompile.backend(group=self.cp_group, inner=config.inner) if world > 1 else config.inner
        _compile_in_place(model, backend, config.regional)

    def _check_cp_settings(self) -> None:
        """Refuse what would silently compute something else under CP (every rank raises alike)."""
        if self.cp_config.cp_size == 1:
            return
        if self.args.label_smoothing_factor != 0:
            raise ValueError(
                f"label_smoothing_factor must be 0 under context parallelism (cp_size={self.cp_config.cp_size}), got "
                f"{self.args.label_smoothing_factor}: the label smoother shifts this rank's labels again, which are "
                "already shifted on the whole pack"
            )
        if self.compute_loss_func is not None:
            raise ValueError(
                f"compute_loss_func must be None under context parallelism (cp_size={self.cp_config.cp_size}): it "
                "would get this rank's share of the pack's labels, already shifted on the whole pack; use the "
                "model's loss (with shift_labels and num_items_in_batch)"
            )
        if not self.model_accepts_loss_kwargs:
            raise ValueError(
                f"{type(self.model).__name__}.forward must take the loss keyword arguments (shift_labels, "
                f"num_items_in_batch) under context parallelism (cp_size={self.cp_config.cp_size}): each rank's loss "
                "is its share of the mean over the step's tokens"
            )

    def get_cp_size(self) -> int:
        """The CP size: the Trainer divides the step's label count (gathered from every rank, so counted once per
        CP rank) by it, and the data-parallel size is the world size divided by it."""
        return self.cp_config.cp_size

    def get_train_dataloader(self):
        """The Trainer's loader, sharded over the data-parallel groups only: CP peers get the same pack; its
        batches stay on the host (:meth:`shard_inputs` uploads each rank's share)."""
        loader = super().get_train_dataloader()
        if getattr(loader, "device", None) is not None:
            # batches stay on the host, where shard_flattened_batch reads their offsets and uploads this rank's
            # share with host twins (it takes host batches: on the device each read would wait for the stream)
            loader.device = None
        if self.cp_config.cp_size == 1:
            return loader
        shard = getattr(loader, "batch_sampler", None)
        if not isinstance(shard, BatchSamplerShard):
            raise ValueError(
                f"the training loader's batch_sampler must be accelerate's BatchSamplerShard under context "
                f"parallelism (cp_size={self.cp_config.cp_size}), to give CP peers the same packs, got "
                f"{type(shard).__name__} (an IterableDataset train_dataset is not supported: use a map-style dataset)"
            )
        shard.num_processes, shard.process_index = self.dp_size, self.dp_rank
        return loader

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The Trainer's count of labelled tokens, taken on the labels as the step's loss reads them (shifted
        inside each document, :meth:`shard_inputs`), uploaded to ``device`` without a host sync.

        The Trainer counts on the loader's (host) batches and moves the count with a blocking copy, which waits
        for the GPU to finish the previous step: the host's work up to this step's first launch (the Trainer's
        bookkeeping, the pack's sharding and planning) would then leave the GPU idle. Here the labels it counts
        are on ``device`` already (pinned, ``non_blocking``), so the count is a kernel queued behind that step."""
        batch_samples = [_with_shift_labels(b, device) for b in batch_samples]
        return super()._get_num_items_in_batch(batch_samples, device)

    def _track_num_input_tokens(self, inputs):
        """The Trainer's ``num_input_tokens_seen``, gathered from every rank: each CP rank holds the whole pack, so
        the sum counts it once per CP rank."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        counted = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + counted // self.cp_config.cp_size

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step on this rank's share of the pack, under its strategy block."""
        local, sharded = self.shard_inputs(inputs)
        with cpcompile.strategy(sharded):
            return super().training_step(model, local, num_items_in_batch)

    def shard_inputs(self, inputs: dict) -> tuple[dict, object]:
        """This rank's share of a flattened batch (``input_ids`` ``[1, T]``, ``position_ids``, ``labels``,
        ``cu_seq_lens_q``) and its :class:`cpcompile.ShardedBatch`. Keys of other per-token inputs raise."""
        if inputs.get("attention_mask") is not None:
            raise ValueError(
                "the batch has an attention_mask: a CP trainer trains on flattened (padding-free) batches, documents "
                "given by position_ids / cu_seq_lens_q; use DataCollatorWithFlattening(return_flash_attn_kwargs=True) "
                "or TRL's SFTConfig(padding_free=True)"
            )
        unknown = sorted(k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and k not in
                         _FLATTENED_KEYS | _DROPPED_KEYS)  # fmt: skip
        if unknown:
            raise ValueError(
                f"the batch has inputs a CP trainer cannot cut by rank: {unknown} (accepted: input_ids, position_ids, "
                "labels, cu_seq_lens_q/k, max_length_q/k)"
            )
        extra = {k: v for k, v in inputs.items() if k not in _FLATTENED_KEYS | _DROPPED_KEYS}
        batch = {k: inputs[k] for k in ("input_ids", "position_ids", "labels", "cu_seq_lens_q") if k in inputs}
        local, sharded = cphf.shard_flattened_batch(
            batch,
            cp_size=self.cp_config.cp_size,
            rank=self.cp_rank,
            strategy=self.cp_strategy,
            device=self.args.device,
            heads=self.cp_heads,
            topology=self.cp_config.topology,
        )
        local.pop("num_items_in_batch", None)  # the Trainer's count of the whole step is passed instead
        return {**extra, **local}, sharded

    def prediction_step(self, *args, **kwargs):
        if self.cp_config.cp_size > 1:
            raise NotImplementedError(
                f"evaluation and prediction under context parallelism (cp_size={self.cp_config.cp_size}) are not "
                "supported by the CP trainer: set eval_strategy='no' and evaluate the saved checkpoint on one process "
                "or with cp_size=1"
            )
        return super().prediction_step(*args, **kwargs)


def _with_shift_labels(batch: dict, device: torch.device) -> dict:
    """``batch`` with ``shift_labels`` (next-token labels inside each document) on ``device``, which the Trainer
    counts (:meth:`CPTrainerMixin._get_num_items_in_batch`); the batch's other tensors stay where they are. A
    batch that is not flattened comes back as it is: the Trainer counts it, and :meth:`CPTrainerMixin.shard_inputs`
    then refuses it, saying why (it has no documents to shift inside)."""
    unflattened = batch.get("attention_mask") is not None or (
        "cu_seq_lens_q" not in batch and "position_ids" not in batch
    )
    if batch.get("labels") is None or unflattened:
        return batch
    labels = batch.get("shift_labels")
    if labels is None:
        cu = batch.get("cu_seq_lens_q")
        if cu is None:
            cu = cphf.flattened_cu_seqlens(batch["position_ids"])
        labels = cphf.shift_labels(batch["labels"], cu)
    return {**batch, "shift_labels": upload(labels, device) if labels.device.type == "cpu" else labels}


def _with_model_windows(strategy: StrategyLike, windows: tuple[int, ...]) -> StrategyLike:
    """The strategy the batches are sharded under: ``balanced`` told the model's sliding ``windows`` by default,
    and ``auto`` told them where it was given none, so that it weighs the windowed work and never picks head
    parallelism, which attention refuses under sliding windows."""
    if strategy is None:
        return StrategySpec("balanced", windows=windows)
    spec = resolve_strategy(strategy)
    if spec.strategy is not Strategy.AUTO or spec.windows or not windows:
        return strategy
    if spec.head_parallel > 1:
        raise ValueError(
            f"CPConfig.strategy={spec}: the model has sliding-window layers (windows={windows}), which attention "
            "cannot split by heads: use kv='auto' (or another kv) with head_parallel=1"
        )
    return dataclasses.replace(spec, windows=windows)


#: Graphs Dynamo may compile of a function beyond ``auto``'s decisions (its default ``recompile_limit``): shape
#: and other guard changes.
_OTHER_GRAPHS = 8


def _make_room_for_decisions(cp_size: int, heads: Heads) -> None:
    """Raise ``torch._dynamo.config.recompile_limit`` (never lower it) to hold a graph per option ``auto``
    may pick with a topology (:func:`cpcompile.cost.timing.options`: 21 at 8 ranks and 32 query heads).

    Each distinct decision is a spec of its own, which every compiled layer is guarded on (one graph each),
    and Dynamo's default limit (8) would be reached within the options: past it the backend refuses the graph
    (``compiler.backend._check_recompile_room``) rather than let Dynamo run attention eagerly. The trainer
    compiles the model itself, so it sets the limit here, before the first compile."""
    import torch._dynamo.config as dynamo_config

    need = len(options(cp_size, heads)) + _OTHER_GRAPHS
    if dynamo_config.recompile_limit < need:
        logger.info("CP trainer: torch._dynamo.config.recompile_limit %d -> %d (auto's options with a topology)",
                    dynamo_config.recompile_limit, need)  # fmt: skip
        dynamo_config.recompile_limit = need


_GROUPS: dict[tuple[int, int], list] = {}


def _cp_groups(world: int, cp_size: int) -> list:
    """The CP groups ``[d * cp_size, (d + 1) * cp_size)`` for each data-parallel rank ``d``, made once per layout
    (every rank makes every group, in one order: ``dist.new_group`` is collective)."""
    key = (world, cp_size)
    if key not in _GROUPS:
        _GROUPS[key] = [dist.new_group(list(range(d * cp_size, (d + 1) * cp_size))) for d in range(world // cp_size)]
    return _GROUPS[key]


def _compile_in_place(model: torch.nn.Module, backend, regional: bool) -> None:
    """Compile ``model`` (or each of its decoder layers) in place: its ``state_dict`` keys, the Trainer's DDP
    wrapping and saving see the module they know."""
    if not regional:
        model.compile(backend=backend, dynamic=True)
        return
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"CPConfig(regional=True) compiles each decoder layer, found by {type(model).__name__}._no_split_modules "
            f"({sorted(names)}), and found none: use regional=False"
        )
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)


class CPTrainer(CPTrainerMixin, Trainer):
    """``transformers.Trainer`` with context parallelism: ``CPTrainer(..., cp=CPConfig(cp_size=2))``."""


def __getattr__(name: str):
    if name == "CPSFTTrainer":  # TRL is imported only when asked for
        try:
            from trl import SFTTrainer
        except ImportError as e:
            raise ImportError('CPSFTTrainer needs TRL: pip install "cpcompile[trainers]"') from e

        class CPSFTTrainer(CPTrainerMixin, SFTTrainer):
            """TRL's ``SFTTrainer`` with context parallelism, for ``SFTConfig(padding_free=True)``."""

        globals()[name] = CPSFTTrainer
        return CPSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
