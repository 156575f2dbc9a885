"""Graph passes of the ``torch.compile`` backend (attention sharding, TP overlap)."""
