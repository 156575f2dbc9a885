"""Optional integrations with other libraries; each imports its library only when imported itself.

- :mod:`cpcompile.integrations.hf`: Hugging Face transformers models (``pip install "cpcompile[hf]"``).
"""
