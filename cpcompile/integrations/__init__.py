"""Optional integrations with other libraries; each imports its library only when imported itself.

- :mod:`cpcompile.integrations.hf`: Hugging Face transformers models (``pip install "cpcompile[hf]"``).
- :mod:`cpcompile.integrations.trainer`: Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` trained context-parallel
  (``pip install "cpcompile[trainers]"``).
- :mod:`cpcompile.integrations.titan`: torchtitan's varlen Llama under CP (torchtitan installed by the user).
"""
