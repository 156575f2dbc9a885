"""A small GPT written for one device, with packed documents: the model CP runs unchanged.

Attention is an ordinary packed call, ``cpcompile.packed_attention`` or torch's
``varlen_attn``; ``torch.compile(..., backend=cpcompile.backend(...))`` turns either
into context-parallel attention. Also: synthetic packs from a document-length mix.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.varlen import varlen_attn

import cpcompile

# torch 2.11's varlen_attn takes GQA inputs as they are; 2.12 added an explicit switch.
VARLEN_GQA = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}

# ProLong long-context mix (shared/data/doclens/README.md): median 1,914 tokens, mean
# 3,052; a log-normal with these two moments stands in when no length file is given.
PROLONG_LOG_MEDIAN = 7.557  # ln(1914)
PROLONG_LOG_SIGMA = 0.917  # sqrt(2 ln(3052 / 1914))


@dataclasses.dataclass
class GPTConfig:
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    max_position: int = 8192
    attention: str = "packed"  # "packed", "varlen", or "mixed" (alternating by layer)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, use_varlen: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.qkv = nn.Linear(cfg.dim, (cfg.heads + 2 * cfg.kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.use_varlen = use_varlen

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """x ``[T, dim]`` -> ``[T, dim]``, causal within each document."""
        q, k, v = self.qkv(x).unflatten(1, (-1, self.head_dim)).split([self.heads, self.kv_heads, self.kv_heads], 1)
        if self.use_varlen:
            o = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(-1, 0), **VARLEN_GQA)
        else:
            o = cpcompile.packed_attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen)
        return self.out(o.flatten(1))  # [T, Hq, D] -> [T, dim]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, use_varlen: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg, use_varlen)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x, cu_seqlens, max_seqlen):
        x = x + self.attn(self.norm1(x), cu_seqlens, max_seqlen)
        return x + self.mlp(self.norm2(x))


class PackedGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        varlen = {"packed": lambda i: False, "varlen": lambda i: True, "mixed": lambda i: i % 2 == 1}[cfg.attention]
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.max_position, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, varlen(i)) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        """input_ids, position_ids ``[T]`` int64 -> logits ``[T, vocab]``."""
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, cu_seqlens, max_seqlen)
        return self.head(self.norm(x))


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over labelled tokens (-100 is ignored): additive across CP ranks."""
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


def sample_lengths(num_tokens: int, generator: torch.Generator, lengths: list[int] | None = None) -> list[int]:
    """Documents drawn until the pack is full, the last one cut at ``num_tokens``.

    From ``lengths`` (a real length list) when given, else from the ProLong-like log-normal.
    """
    out: list[int] = []
    while sum(out) < num_tokens:
        if lengths:
            n = lengths[int(torch.randint(len(lengths), (1,), generator=generator))]
        else:
            n = int(torch.empty(1).log_normal_(PROLONG_LOG_MEDIAN, PROLONG_LOG_SIGMA, generator=generator))
        out.append(max(1, n))
    out[-1] -= sum(out) - num_tokens
    return [n for n in out if n > 0]


def synthetic_pack(doc_lengths: list[int], vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Documents that repeat a random pattern of 2-4 tokens: learnable by attending back.

    Returns ``cu_seqlens [B + 1]`` int32 and ``input_ids, labels, position_ids [T]`` int64;
    labels are the next token of the same document (-100 on each document's last token).
    """
    lengths = torch.tensor(doc_lengths)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    doc = torch.repeat_interleave(torch.arange(len(doc_lengths)), lengths)
    position = torch.arange(int(cu[-1])) - cu[:-1].long()[doc]
    period = torch.randint(2, 5, (len(doc_lengths),), generator=generator)[doc]
    patterns = torch.randint(vocab, (len(doc_lengths), 8), generator=generator)
    ids = patterns[doc, position % period]
    labels = torch.where(position + 1 < lengths[doc], patterns[doc, (position + 1) % period], -100)
    return {"cu_seqlens": cu, "input_ids": ids, "labels": labels, "position_ids": position}
