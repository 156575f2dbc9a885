"""Hugging Face ``Trainer`` and TRL's ``SFTTrainer(padding_free=True)`` trained context-parallel
(``cpcompile.integrations.trainer``).

A tiny random-weight Llama in float64 trains for a few optimizer steps on flattened batches of documents of
varying length and count, on gloo ranks as torchrun starts them (dp x cp, CP groups of adjacent ranks), with
``CPTrainer`` / ``CPSFTTrainer(cp=CPConfig(...))``. The reference is the stock trainer on one process (this
pytest process, no process group) with transformers' SDPA attention, fed the packs of every DP group as one
batch: its logged loss per step, final weights and AdamW moments must equal every rank's. A run resumed from a
step's checkpoint must continue as the uninterrupted run did. The Trainer's cp=2 run accumulates two packs per
optimizer step. The logged loss is float32 in the trainers, and
TRL's fused log-probability head computes in float32: their tolerances say so.
"""

from __future__ import annotations

import os

import pytest
import torch

import cpcompile
import cpcompile.cost.timing
from tests.dist import compiled_graphs, run_ranks
from tests.reference import relative_error

transformers = pytest.importorskip("transformers", reason='needs the trainers extra: pip install "cpcompile[trainers]"')
pytest.importorskip("accelerate", reason='needs the trainers extra: pip install "cpcompile[trainers]"')
cpt = pytest.importorskip("cpcompile.integrations.trainer")

VOCAB = 48
BATCH = 2  # documents per pack (per DP group and step)
STEPS = 3
LOSS = 1e-6  # the trainers log the loss in float32
WEIGHTS = {"trainer": 1e-9, "sft": 1e-6}  # float64 throughout; TRL's log-probabilities are float32


def tiny_llama() -> torch.nn.Module:
    """A 2-layer GQA Llama with seeded random weights, in float64, SDPA attention (the CP trainer switches it)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def documents(n: int = 24) -> list[dict]:
    """Tokenised documents of 1 to 23 tokens (1-token documents included: nothing to predict)."""
    g = torch.Generator().manual_seed(0)
    lengths = [1, *torch.randint(2, 24, (n - 1,), generator=g).tolist()]
    return [{"input_ids": torch.randint(VOCAB, (k,), generator=g).tolist()} for k in lengths]


def tokenizer():
    """A word-level tokenizer over the vocabulary, made here (no hub): SFTTrainer asks for one."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    made = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=made, pad_token="t0", eos_token="t1")


def train(
    kind: str, out: str, *, batch: int, steps: int = STEPS, cp=None, resume=None, save_steps=None, accumulate=1
) -> dict:
    """Train with the stock ``kind`` ("trainer" or "sft") trainer, or its CP subclass when ``cp`` is given,
    ``accumulate`` packs per optimizer step; returns the logged losses, the final weights and AdamW's moments."""
    common = dict(
        output_dir=out,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulate,
        max_steps=steps,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 1,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        include_num_input_tokens_seen="all",
    )
    if kind == "trainer":
        args = transformers.TrainingArguments(**common)
        collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        kwargs = dict(args=args, train_dataset=documents(), data_collator=collator)
        cls = transformers.Trainer if cp is None else cpt.CPTrainer
    else:
        import datasets
        import trl

        args = trl.SFTConfig(**common, padding_free=True, max_length=None, bf16=False)
        kwargs = dict(args=args, train_dataset=datasets.Dataset.from_list(documents()), processing_class=tokenizer())
        cls = trl.SFTTrainer if cp is None else cpt.CPSFTTrainer
    trainer = cls(model=tiny_llama(), **kwargs, **({} if cp is None else {"cp": cp}))
    trainer.train(resume_from_checkpoint=resume)
    state = trainer.optimizer.state_dict()["state"]
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "moments": [state[i][m].clone() for i in sorted(state) for m in ("exp_avg", "exp_avg_sq")],
        "tokens_seen": trainer.state.num_input_tokens_seen,
    }


def assert_same_training(got: dict, want: dict, kind: str, label: str) -> None:
    assert len(got["losses"]) == len(want["losses"]), (label, got["losses"], want["losses"])
    assert got["tokens_seen"] == want["tokens_seen"], (label, got["tokens_seen"], want["tokens_seen"])
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(a - b) <= LOSS * abs(b), f"{label}: loss of step {step + 1} {a} vs one process's {b}"
    for name, w in want["weights"].items():
        assert relative_error(got["weights"][name], w) < WEIGHTS[kind], f"{label}: weight {name}"
    for i, (a, b) in enumerate(zip(got["moments"], want["moments"], strict=True)):
        assert relative_error(a, b) < WEIGHTS[kind] * 10, f"{label}: AdamW moment {i}"


def as_torchrun(rank: int, world: int) -> None:
    """The variables torchrun sets, which the trainers (accelerate's PartialState) read; the group exists."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


#: Packs per optimizer step at cp=2: the Trainer's gradient accumulation (its token count covers both packs).
ACCUMULATE = {"trainer": 2, "sft": 1}


def _cp2_and_resume(rank: int, world: int, kind: str, want: dict, out: str) -> None:
    as_torchrun(rank, world)
    cp = cpt.CPConfig(cp_size=2, inner="eager")
    full = train(kind, f"{out}/full", batch=BATCH, cp=cp, save_steps=1, accumulate=ACCUMULATE[kind])
    assert_same_training(full, want, kind, f"{kind} cp=2 rank {rank}")
    # every decoder layer and every pack (their lengths and document counts vary) run one graph
    assert compiled_graphs() == 1, compiled_graphs()
    # a new trainer and model, resumed from the first step's checkpoint (model, optimizer, scheduler, RNG, data)
    resumed = train(
        kind, f"{out}/resumed", batch=BATCH, cp=cp, resume=f"{out}/full/checkpoint-1", accumulate=ACCUMULATE[kind]
    )
    assert_same_training(resumed, full, kind, f"{kind} resumed at step 1, rank {rank}")


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_cp2_trains_as_one_process_and_resumes_identically(kind, tmp_path):
    want = train(kind, str(tmp_path / "reference"), batch=BATCH, accumulate=ACCUMULATE[kind])
    run_ranks(_cp2_and_resume, 2, kind, want, str(tmp_path))


def _dp2_cp2(rank: int, world: int, wants: dict, out: str) -> None:
    as_torchrun(rank, world)
    for kind, want in wants.items():
        got = train(kind, f"{out}/{kind}", batch=BATCH, cp=cpt.CPConfig(cp_size=2, inner="eager"))
        assert_same_training(got, want, kind, f"{kind} dp=2 x cp=2 rank {rank}")


@pytest.mark.distributed
def test_dp2_x_cp2_trains_as_one_process():
    """4 ranks: CP groups {0, 1} and {2, 3} each on their own packs; one process takes both packs as one batch."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        wants = {kind: train(kind, f"{tmp}/reference-{kind}", batch=2 * BATCH) for kind in ("trainer", "sft")}
        run_ranks(_dp2_cp2, 4, wants, tmp)


def test_config_and_batches_cp_cannot_take_are_refused(tmp_path):
    """Errors name the setting: a CP size that does not divide the world, a padded batch, label smoothing,
    the Trainer's own torch_compile."""
    with pytest.raises(ValueError, match="CPConfig.cp_size must be an int >= 1, got 0"):
        cpt.CPConfig(cp_size=0)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="CPConfig.cp_size=2 must divide the world size 1"):
        cpt.CPTrainer(model=tiny_llama(), args=args, train_dataset=documents(), cp=2)
    smoothing = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, label_smoothing_factor=0.1
    )
    with pytest.raises(ValueError, match="torch_compile must be False"):
        cpt.CPTrainer(model=tiny_llama(), args=transformers.TrainingArguments(
            output_dir=str(tmp_path), report_to="none", use_cpu=True, torch_compile=True), cp=1)  # fmt: skip
    with pytest.raises(ValueError, match="topology must start with one of"):
        cpt.CPTrainer(model=tiny_llama(), args=args, cp=cpt.CPConfig(strategy="auto", topology="h100"))
    trainer = cpt.CPTrainer(model=tiny_llama(), args=smoothing, train_dataset=documents(), cp=1)
    assert trainer.model.config._attn_implementation == "cpcompile"
    # batches stay on the host: shard_flattened_batch takes them there and uploads the rank's share itself
    assert trainer.get_train_dataloader().device is None
    trainer.cp_config = cpt.CPConfig(cp_size=2)  # as on a rank of a CP group
    with pytest.raises(ValueError, match="label_smoothing_factor must be 0 under context parallelism"):
        trainer._check_cp_settings()
    padded = transformers.DataCollatorWithPadding(tokenizer())(documents()[:2])
    padded["labels"] = padded["input_ids"]
    with pytest.raises(ValueError, match="the batch has an attention_mask"):
        trainer.shard_inputs(padded)
    flattened = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(documents()[:2])
    with pytest.raises(ValueError, match=r"inputs a CP trainer cannot cut by rank: \['token_type_ids'\]"):
        trainer.shard_inputs({**flattened, "token_type_ids": torch.zeros_like(flattened["input_ids"])})


def test_a_padded_batch_is_refused_by_the_step_not_by_the_count_of_its_tokens(tmp_path):
    """The Trainer counts a step's labelled tokens before the step: a padded batch (``attention_mask``, no
    ``position_ids``) reaches ``shard_inputs``, which says what to use, rather than failing in the count."""

    def padded(docs):
        batch = transformers.DataCollatorWithPadding(tokenizer())(docs)
        return {**batch, "labels": batch["input_ids"]}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=1)
    trainer = cpt.CPTrainer(model=tiny_llama(), args=args, train_dataset=documents(4), data_collator=padded, cp=1)
    with pytest.raises(ValueError, match="the batch has an attention_mask"):
        trainer.train()


def test_the_step_count_of_labelled_tokens_is_the_loss_count_at_any_cp_size(tmp_path):
    """The count the Trainer normalises the loss by is taken on the labels the loss reads (shifted inside each
    document, as ``shard_inputs`` gives them) also at cp=1: a pack whose labels do not mask each document's first
    token (the stock Trainer counts ``labels[..., 1:]``, which then counts across documents) counts its tokens
    minus one per document; a ``DataCollatorWithFlattening`` pack counts what the stock Trainer counts."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = cpt.CPTrainer(model=tiny_llama(), args=args, train_dataset=documents(), cp=1)
    stock = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=documents())
    flattened = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(documents()[:3])
    raw = {**flattened, "labels": flattened["input_ids"]}  # every token labelled, document starts included
    tokens, docs = flattened["input_ids"].shape[1], flattened["cu_seq_lens_q"].shape[0] - 1
    cpu = torch.device("cpu")
    assert int(trainer._get_num_items_in_batch([raw], cpu)) == tokens - docs
    assert int(stock._get_num_items_in_batch([raw], cpu)) == tokens - 1
    assert int(trainer._get_num_items_in_batch([flattened], cpu)) == int(
        stock._get_num_items_in_batch([flattened], cpu)
    )
    local, _ = trainer.shard_inputs(raw)
    assert int((local["shift_labels"] != -100).sum()) == tokens - docs


def test_auto_with_a_topology_is_told_the_windows_and_room_for_its_graphs(tmp_path):
    """``auto`` on a sliding-window model weighs the windows (never head parallelism, which attention refuses
    under windows); with a topology the trainer raises Dynamo's recompile limit to hold a graph per option;
    a topology is refused with another strategy, when the config is made."""
    with pytest.raises(ValueError, match=r"CPConfig.topology='h200' only applies to strategy='auto'"):
        cpt.CPConfig(strategy="balanced", topology="h200")
    with pytest.raises(ValueError, match=r"CPConfig.topology='h200' only applies to strategy='auto'"):
        cpt.CPConfig(topology="h200")
    with pytest.raises(ValueError, match="CPConfig.topology must start with one of"):
        cpt.CPConfig(strategy="auto", topology="h100")
    assert cpt.CPConfig(strategy="auto", topology="h200").topology == cpcompile.cost.timing.H200
    assert cpt._with_model_windows("auto", (15, -1)) == cpcompile.StrategySpec("auto", windows=(15, -1))
    assert cpt._with_model_windows("auto", ()) == "auto"
    assert cpt._with_model_windows("striped", (15,)) == "striped"
    with pytest.raises(ValueError, match="the model has sliding-window layers"):
        cpt._with_model_windows(cpcompile.StrategySpec("auto", kv="heads", head_parallel=2), (15,))
    # config.patch, not monkeypatch: undoing a monkeypatch of Dynamo's config module deletes the setting
    with torch._dynamo.config.patch(recompile_limit=8):
        heads = cpcompile.cost.comm.Heads(32, 8)
        cpt._make_room_for_decisions(8, heads)
        assert torch._dynamo.config.recompile_limit == len(cpcompile.cost.timing.options(8, heads)) + 8 > 21
        torch._dynamo.config.recompile_limit = 100
        cpt._make_room_for_decisions(8, heads)  # never lowered
        assert torch._dynamo.config.recompile_limit == 100
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16, use_cache=False))  # fmt: skip
    trainer = cpt.CPTrainer(model=model, args=args, cp=cpt.CPConfig(strategy="auto", topology="h200"))
    assert trainer.cp_strategy == cpcompile.StrategySpec("auto", windows=(15, 15))
    assert trainer.cp_heads == cpcompile.cost.comm.Heads(4, 2, 8, 4)
