"""Small models and synthetic packs shared by the tests, examples and benchmarks, like ``torch.testing``.

Not imported by ``cpcompile`` itself, and importing it has no side effects beyond the imports.

- :mod:`cpcompile.testing.packed_gpt`: a small GPT written for one device with packed documents
  (:class:`PackedGPT`, :class:`GPTConfig`), its summed loss, and synthetic packs from a
  document-length mix (:func:`sample_lengths`, :func:`synthetic_pack`).
- :mod:`cpcompile.testing.hf_llama`: a random-weight Hugging Face Llama with cpcompile's attention
  (needs transformers, so not imported here).
"""

from cpcompile.testing.packed_gpt import VARLEN_GQA, GPTConfig, PackedGPT, sample_lengths, summed_loss, synthetic_pack

__all__ = ["VARLEN_GQA", "GPTConfig", "PackedGPT", "sample_lengths", "summed_loss", "synthetic_pack"]
