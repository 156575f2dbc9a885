"""Hugging Face ``Trainer`` on flattened (packed) batches, context-parallel by configuration.

The script a Trainer user already has (a model, ``TrainingArguments``, a dataset of tokenised documents,
``DataCollatorWithFlattening``), with ``Trainer`` replaced by ``cpcompile.integrations.trainer.CPTrainer`` and
``cp=CPConfig(cp_size=...)``: each CP group (adjacent ranks) trains on one pack per step, the other ranks are
data-parallel groups with packs of their own; the loss is logged as one process would log it.

    torchrun --nproc-per-node 2 examples/train_trainer.py              # cp=2, CPU gloo or GPUs
    torchrun --nproc-per-node 4 examples/train_trainer.py --cp 2       # dp=2 x cp=2
    torchrun --nproc-per-node 2 examples/train_trainer.py --save-steps 5 --resume   # from the last checkpoint

Runs on GPUs with nccl (bf16) when CUDA is available, else on CPU with gloo (float32). The documents repeat a
short random pattern (learnable by attending back).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch._dynamo.utils import counters
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, TrainingArguments

from cpcompile.advisor.advise import positive_int
from cpcompile.integrations.trainer import CPConfig, CPTrainer


def documents(count: int, longest: int, vocab: int, seed: int = 0) -> list[dict]:
    """Tokenised documents of 1 to ``longest`` tokens, each repeating a random pattern of 2 to 6 tokens."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(count):
        n = int(torch.randint(1, longest + 1, (1,), generator=g))
        pattern = torch.randint(vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
        docs.append({"input_ids": pattern.repeat(n // len(pattern) + 1)[:n].tolist()})
    return docs


def tiny_llama(vocab: int, layers: int, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=positive_int, help="ranks per CP group (default: every rank, dp=1)")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--docs-per-pack", type=positive_int, default=8, help="documents per pack (per DP group)")
    p.add_argument("--longest", type=positive_int, default=256, help="longest document, in tokens")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--strategy", default=None, help="CP layout (default: balanced)")
    p.add_argument("--inner", default="inductor", help="compiler after the CP pass: inductor, aot_eager, eager")
    p.add_argument("--output-dir", default="trainer-output")
    p.add_argument("--save-steps", type=positive_int, help="save a checkpoint every this many steps")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    vocab = 256
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.docs_per_pack,
        max_steps=args.steps,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 1,
        report_to="none",
        use_cpu=not cuda,
        bf16=cuda,
        disable_tqdm=True,
    )
    trainer = CPTrainer(
        model=tiny_llama(vocab, args.layers, torch.float32),
        args=training,
        train_dataset=documents(64 * args.docs_per_pack, args.longest, vocab),
        data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True),
        cp=CPConfig(cp_size=args.cp or world, strategy=args.strategy, inner=args.inner),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():  # one graph for every decoder layer and pack composition
        print(f"compiled graphs: {counters['stats']['unique_graphs']}", flush=True)


if __name__ == "__main__":
    main()
