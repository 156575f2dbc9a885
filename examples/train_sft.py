"""TRL's ``SFTTrainer`` with ``padding_free=True``, context-parallel by configuration.

The fine-tuning script of a TRL user (a model, ``SFTConfig(padding_free=True)``, a dataset, a tokenizer), with
``SFTTrainer`` replaced by ``cpcompile.integrations.trainer.CPSFTTrainer`` and ``cp=CPConfig(cp_size=...)``:
TRL's padding-free collator flattens each batch into one pack, CP peers (adjacent ranks) share it, DP groups
get packs of their own; TRL's fused log-probability head scores each rank's tokens against the labels shifted
on the whole pack.

    torchrun --nproc-per-node 2 examples/train_sft.py               # cp=2, CPU gloo or GPUs
    torchrun --nproc-per-node 4 examples/train_sft.py --cp 2        # dp=2 x cp=2

Runs on GPUs with nccl (bf16) when CUDA is available, else on CPU with gloo (float32). The model and the
word-level tokenizer are made here (no hub download); the documents are train_trainer.py's.
"""

from __future__ import annotations

import argparse
import os

import datasets
import torch
from tokenizers import Tokenizer, models
from torch._dynamo.utils import counters
from train_trainer import documents, tiny_llama
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig

from cpcompile.advisor.advise import positive_int
from cpcompile.integrations.trainer import CPConfig, CPSFTTrainer


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``t0 ... t{vocab - 1}`` (SFTTrainer reads its pad and EOS tokens)."""
    made = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=made, pad_token="t0", eos_token="t1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=positive_int, help="ranks per CP group (default: every rank, dp=1)")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--docs-per-pack", type=positive_int, default=8, help="documents per pack (per DP group)")
    p.add_argument("--longest", type=positive_int, default=256, help="longest document, in tokens")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--inner", default="inductor", help="compiler after the CP pass: inductor, aot_eager, eager")
    p.add_argument("--output-dir", default="sft-output")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    vocab = 256
    config = SFTConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.docs_per_pack,
        max_steps=args.steps,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not cuda,
        bf16=cuda,
        disable_tqdm=True,
        padding_free=True,
        max_length=None,  # padding-free without packing: documents are kept whole
    )
    trainer = CPSFTTrainer(
        model=tiny_llama(vocab, args.layers, torch.float32),
        args=config,
        train_dataset=datasets.Dataset.from_list(documents(64 * args.docs_per_pack, args.longest, vocab)),
        processing_class=word_tokenizer(vocab),
        cp=CPConfig(cp_size=args.cp or world, inner=args.inner),
    )
    trainer.train()
    if trainer.is_world_process_zero():  # one graph for every decoder layer and pack composition
        print(f"compiled graphs: {counters['stats']['unique_graphs']}", flush=True)


if __name__ == "__main__":
    main()
