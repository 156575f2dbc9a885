import pytest
import torch
import torch.nn.functional as F

from cpcompile.testing.losses import linear_cross_entropy


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_linear_cross_entropy_equals_the_logits_loss(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(50, (37,), generator=g)
    targets[[0, 7, 36]] = -100
    ours = linear_cross_entropy(hidden, weight, targets, chunk=chunk)
    (grads,) = [torch.autograd.grad(3.0 * ours, (hidden, weight))]
    reference = F.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    expected = torch.autograd.grad(3.0 * reference, (hidden, weight))
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert grads[0][[0, 7, 36]].abs().max() == 0  # rows without a target get no gradient


def test_linear_cross_entropy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="targets must be"):
        linear_cross_entropy(torch.zeros(4, 3), torch.zeros(5, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk must be positive"):
        linear_cross_entropy(torch.zeros(4, 3), torch.zeros(5, 3), torch.zeros(4, dtype=torch.long), chunk=0)


def test_causal_lm_loss_equals_the_models_own_loss():
    pytest.importorskip("transformers")
    import cpcompile.integrations.hf as cphf
    from cpcompile.testing import synthetic_pack
    from cpcompile.testing.hf_llama import LlamaShape, causal_lm_loss, random_llama

    shape = LlamaShape(hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=97)
    model = random_llama(shape, 2, max_tokens=64, device=torch.device("cpu"), dtype=torch.float64)
    cu = torch.tensor([0, 1, 20, 47, 60], dtype=torch.int32)
    pack = synthetic_pack(cu.diff().tolist(), shape.vocab, torch.Generator().manual_seed(0))
    batch = {"input_ids": pack["input_ids"][None], "position_ids": pack["position_ids"][None], "cu_seq_lens_q": cu}
    batch["labels"] = batch["input_ids"]
    inputs, _ = cphf.shard_flattened_batch(batch, cp_size=1, rank=0)

    def exact():  # the model's logits, the loss in float64 (transformers' own sums in float32)
        logits = model(**{k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}).logits[0]
        total = F.cross_entropy(logits, inputs["shift_labels"][0], reduction="sum")
        return total / inputs["num_items_in_batch"]

    results = []
    for loss_of in (exact, lambda: causal_lm_loss(model.model, model, inputs, chunk=7)):
        loss = loss_of()
        results.append((loss.detach(), torch.autograd.grad(loss, list(model.parameters()))))
    (loss, grads), (ours, our_grads) = results
    torch.testing.assert_close(ours, loss, rtol=1e-12, atol=0)
    for got, want in zip(our_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.float(), model(**inputs).loss.detach(), rtol=1e-5, atol=0)  # what it replaces
