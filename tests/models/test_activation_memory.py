"""What a training step keeps in memory: the tied embedding adds its gradient into the output layer's (no second
[vocab, hidden] tensor), norm outputs are rebuilt in the backward instead of kept, the chunked head loss holds one
[chunk, vocab] buffer (and a few rows) at a time, and a run that does not use DeepSpeed does not import it. Each
against the plain computation, value for value."""

import subprocess
import sys
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.losses import logprobs
from posttrain.losses.logprobs import linear_logps
from posttrain.losses.sft import IGNORE_INDEX, chunked_token_loss_sums
from posttrain.models.fused_layers import fuse_layers, rebuilt_activations
from posttrain.models.tied_embedding import allow_tied_embedding, tied_embedding
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer


class _Ops(TorchDispatchMode):
    """Records (op name, output shape) of every op, and how many tensors of `shape` (or how many elements of tensors
    whose last dimension is `last_dim`) are alive at most at once."""

    def __init__(self, shape=None, last_dim=None):
        super().__init__()
        self.calls, self.shape, self.last_dim, self.alive, self.most_alive = [], shape, last_dim, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.calls.append((str(func.overloadpacket.__name__), tuple(tensor.shape)))
                counted = (
                    tuple(tensor.shape) == self.shape
                    if self.shape is not None
                    else (self.last_dim is not None and tensor.dim() > 0 and tensor.shape[-1] == self.last_dim)
                )
                if counted and tensor.untyped_storage().data_ptr() not in inputs:  # new memory, not a view
                    self.alive = [ref for ref in self.alive if ref() is not None and ref() is not tensor]
                    self.alive.append(weakref.ref(tensor))  # an in-place op returns a tensor already counted
                    sizes = [1 if self.shape is not None else ref().numel() for ref in self.alive]
                    self.most_alive = max(self.most_alive, sum(sizes))
        return out


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _tied_model(tokenizer, dtype=torch.float64):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2).to(dtype)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    allow_tied_embedding(model)
    return model


def _head_loss_grads(model, ids, labels, tie: bool, inputs_embeds=None):
    """The tied weight's gradient from the chunked SFT loss, with or without the in-place embedding gradient."""
    model.zero_grad(set_to_none=True)
    head = model.get_output_embeddings()
    captured = {}
    handle = model.get_decoder().register_forward_hook(
        lambda m, a, out: captured.update(hidden=out[0] if isinstance(out, tuple) else out.last_hidden_state)
    )
    context = tied_embedding(model, head.weight) if tie else tied_embedding(model, None)
    with context as head_gradient:
        inputs = {"inputs_embeds": inputs_embeds} if inputs_embeds is not None else {"input_ids": ids}
        model(**inputs, logits_to_keep=1)
    handle.remove()
    sums = chunked_token_loss_sums(captured["hidden"], head.weight, labels, chunk_size=5, on_weight_grad=head_gradient)
    sums.loss.backward()
    return head_gradient, head.weight.grad.clone()


def test_tied_embedding_gradient_is_added_into_the_head_gradient(tokenizer):
    model = _tied_model(tokenizer)
    pad = model.get_input_embeddings().padding_idx
    assert pad is not None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (2, 9), generator=g)
    ids[1, :3] = pad  # the padding row gets no gradient from the lookup, as in the dense backward
    labels = ids.clone()
    labels[1, :3] = IGNORE_INDEX
    plain_handoff, plain = _head_loss_grads(model, ids, labels, tie=False)
    assert plain_handoff is None  # no head weight given: the context does nothing
    handoff, fused = _head_loss_grads(model, ids, labels, tie=True)
    assert handoff is not None and handoff.armed and handoff.grad is None  # delivered, no reference left behind
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-14)
    assert "forward" not in vars(model.get_input_embeddings())  # restored after the block


def test_several_forwards_and_other_gradient_paths_are_summed(tokenizer):
    """Two handed-over forwards before one backward, plus a loss on the model's own logits (another path into the
    tied weight): the same gradient as without any handover."""
    model = _tied_model(tokenizer)
    weight = model.get_output_embeddings().weight
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(3, len(tokenizer), (2, 7), generator=g) for _ in range(2)]

    def gradient(tie: bool):
        model.zero_grad(set_to_none=True)
        total = 0
        for ids in batches:
            captured = {}
            handle = model.get_decoder().register_forward_hook(
                lambda m, a, out, captured=captured: captured.update(hidden=out[0])
            )
            with tied_embedding(model, weight if tie else None) as head_gradient:
                logits = model(input_ids=ids, logits_to_keep=2).logits
            handle.remove()
            total = (
                total
                + chunked_token_loss_sums(
                    captured["hidden"], weight, ids, chunk_size=4, on_weight_grad=head_gradient
                ).loss
                + logits.square().mean()
            )
        total.backward()
        return weight.grad.clone()

    torch.testing.assert_close(gradient(True), gradient(False), rtol=1e-12, atol=1e-14)


def test_a_head_gradient_the_lookup_cannot_deliver_is_an_error(tokenizer):
    model = _tied_model(tokenizer)
    weight = model.get_output_embeddings().weight
    with tied_embedding(model, weight) as head_gradient:
        model.get_input_embeddings()(torch.tensor([[4, 5]]))  # a lookup whose output the loss does not use
    hidden = torch.randn(1, 3, 32, dtype=torch.float64, requires_grad=True)
    loss = chunked_token_loss_sums(hidden, weight, torch.tensor([[1, 2, 3]]), on_weight_grad=head_gradient).loss
    with pytest.raises(RuntimeError, match="fused_layers=False"):
        loss.backward()


def test_no_second_vocabulary_sized_gradient_in_the_backward(tokenizer):
    model = _tied_model(tokenizer, torch.float32)
    ids = torch.randint(3, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(1))
    weight = model.get_output_embeddings().weight
    for tie, expect_dense in ((False, True), (True, False)):
        model.zero_grad(set_to_none=True)
        captured = {}
        handle = model.get_decoder().register_forward_hook(
            lambda m, a, out, captured=captured: captured.update(hidden=out[0])
        )
        with tied_embedding(model, weight if tie else None) as head_gradient:
            model(input_ids=ids, logits_to_keep=1)
        handle.remove()
        loss = chunked_token_loss_sums(captured["hidden"], weight, ids, on_weight_grad=head_gradient).loss
        with _Ops() as ops:
            loss.backward()
        vocabulary_sized = [name for name, shape in ops.calls if shape == tuple(weight.shape)]
        assert ("embedding_dense_backward" in vocabulary_sized) == expect_dense, vocabulary_sized
        if tie:
            assert "index_add_" in vocabulary_sized and "add" not in vocabulary_sized


def test_lookup_without_the_head_gradient_falls_back_to_the_dense_gradient(tokenizer):
    model = _tied_model(tokenizer)
    ids = torch.randint(3, len(tokenizer), (1, 6), generator=torch.Generator().manual_seed(2))
    embedding = model.get_input_embeddings()
    with tied_embedding(model, embedding.weight) as head_gradient:
        out = embedding(ids)
    (out * 3).sum().backward()  # no head loss handed a gradient over
    want = torch.zeros_like(embedding.weight)
    want.index_add_(0, ids.flatten(), torch.full((6, embedding.weight.shape[1]), 3.0, dtype=torch.float64))
    want[embedding.padding_idx] = 0
    torch.testing.assert_close(embedding.weight.grad, want)
    assert head_gradient.grad is None
    # The embeddings given directly: the head's gradient is not handed over (nothing would take it).
    embeds = embedding(ids).detach()
    handoff, fused = _head_loss_grads(model, ids, ids, tie=True, inputs_embeds=embeds)
    _, plain = _head_loss_grads(model, ids, ids, tie=False, inputs_embeds=embeds)
    assert not handoff.armed and handoff.grad is None  # no lookup: the head kept its gradient
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def test_untied_or_customised_embeddings_are_left_alone(tokenizer):
    untied = build_tiny_model(tokenizer, tie=False)
    with tied_embedding(untied, untied.get_output_embeddings().weight) as handoff:
        assert handoff is None
    tied = _tied_model(tokenizer)
    tied.get_input_embeddings().scale_grad_by_freq = True
    with tied_embedding(tied, tied.get_output_embeddings().weight) as handoff:
        assert handoff is None
    not_allowed = build_tiny_model(tokenizer)  # fused_layers=False: no allow_tied_embedding
    with tied_embedding(not_allowed, not_allowed.get_output_embeddings().weight) as handoff:
        assert handoff is None


def _watched_step(model, ids, rebuild: bool, checkpointing: bool, watch):
    """A forward (inside `rebuilt_activations(rebuild)`) and backward pass; `watch(model)` registers hooks and
    returns (their handles, a function measuring what they saw, called between the two passes)."""
    model.zero_grad(set_to_none=True)
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
    handles, measure = watch(model)
    with rebuilt_activations(rebuild):
        out = model(input_ids=ids, labels=ids)
    for handle in handles:
        handle.remove()
    seen = measure()
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    if checkpointing:
        model.gradient_checkpointing_disable()
    return out.loss.detach(), grads, seen


def _alive(refs) -> int:
    return sum(ref() is not None for ref in refs)


def _norm_step(model, ids, recompute: bool, checkpointing: bool = False):
    def watch(model):
        norm_outputs = []
        handles = [
            m.register_forward_hook(lambda m, a, out: norm_outputs.append(weakref.ref(out)))
            for name, m in model.named_modules()
            if name.endswith("layernorm")
        ]
        return handles, lambda: (_alive(norm_outputs), len(norm_outputs))

    loss, grads, (kept, made) = _watched_step(model, ids, recompute, checkpointing, watch)
    return loss, list(grads.values()), kept, made


@pytest.mark.parametrize("checkpointing", [False, True])
def test_norm_outputs_are_rebuilt_bit_for_bit_instead_of_kept(tokenizer, checkpointing):
    model = _tied_model(tokenizer)
    assert fuse_layers(model) == 2 * 2 + 2 + 1  # two norms and an MLP per layer, the final norm
    ids = torch.randint(3, len(tokenizer), (2, 11), generator=torch.Generator().manual_seed(3))
    loss, grads, kept, norms = _norm_step(model, ids, recompute=False, checkpointing=checkpointing)
    loss_r, grads_r, kept_r, norms_r = _norm_step(model, ids, recompute=True, checkpointing=checkpointing)
    assert torch.equal(loss, loss_r)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))
    assert norms == norms_r == 2 * 2
    if not checkpointing:
        assert kept == 4 and kept_r == 0  # the layers' norm outputs: kept by q/k/v and the MLP, or not at all
    else:  # inside non-reentrant checkpointing its own hooks decide (nothing is kept either way)
        assert kept == kept_r == 0


@pytest.mark.parametrize("stats", [False, True])
def test_head_losses_hold_one_chunk_of_logits_and_a_few_rows_more(monkeypatch, stats):
    monkeypatch.setattr(logprobs, "SOFTMAX_ELEMENTS", 4000)  # softmax 4 rows of the 1,000-word vocabulary at a time
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 40, 8, generator=g, requires_grad=True)
    weight = torch.randn(1000, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 1000, (1, 40), generator=g)
    with _Ops(last_dim=1000) as ops:
        chunked_token_loss_sums(hidden, weight, labels, chunk_size=16)
    # the chunk's logits (turned into its gradient in place) and one softmax temporary of 4 rows
    assert ops.most_alive == (16 + 4) * 1000
    with _Ops(last_dim=1000) as ops:
        scores = linear_logps(hidden[0], weight, labels[0], chunk_size=16, stats=stats, log_sum_sq=stats)
    assert ops.most_alive == (16 + 4) * 1000  # in the forward: the chunk's logits and the softmax temporary
    with _Ops(last_dim=1000) as ops:
        scores.logps.sum().backward()
    assert ops.most_alive == 16 * 1000  # in the backward: the chunk's logits become its gradient in place


UNWRAP_PROBE = """
import sys, tempfile
import accelerate.utils.other as other
from datasets import Dataset
from posttrain import SFTConfig, SFTTrainer
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

assert not getattr(other.is_deepspeed_available, "imported_first", False)  # accelerate's own, before any trainer
installed = other.is_deepspeed_available()
tokenizer = build_tiny_tokenizer()
args = SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", max_steps=2, disable_tqdm=True)
trainer = SFTTrainer(build_tiny_model(tokenizer), processing_class=tokenizer, args=args,
                     train_dataset=Dataset.from_list([{"text": "one two three"}] * 4))
trainer.train()
trainer.save_model()
print("INSTALLED", installed, "IMPORTED", "deepspeed" in sys.modules)
import deepspeed  # once imported, accelerate's test runs again (a DeepSpeedEngine would be unwrapped)
print("CHECK", other.is_deepspeed_available())
"""


def test_a_run_without_deepspeed_does_not_import_it():
    done = subprocess.run(
        [sys.executable, "-c", UNWRAP_PROBE],
        text=True,
        capture_output=True,
        timeout=300,
        env={"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if "INSTALLED False" in done.stdout:
        pytest.skip("DeepSpeed is not installed here")
    assert "INSTALLED True IMPORTED False" in done.stdout, done.stdout
    assert "CHECK True" in done.stdout


def _lora_mlp_step(model, ids, rebuild: bool, checkpointing: bool):
    def watch(model):
        intermediates, projections, alive_at_end, handles = [], [], [], []
        for name, module in model.named_modules():
            if name.endswith("mlp.act_fn"):
                handles.append(module.register_forward_hook(lambda m, a, out: intermediates.append(weakref.ref(out))))
            elif name.endswith("mlp.down_proj"):
                handles.append(
                    module.register_forward_pre_hook(lambda m, args: intermediates.append(weakref.ref(args[0])))
                )
            elif name.endswith(("mlp.gate_proj", "mlp.up_proj")):
                handles.append(module.register_forward_hook(lambda m, a, out: projections.append(weakref.ref(out))))
            elif name.endswith("model.norm"):  # the end of the layers, still inside the forward
                handles.append(module.register_forward_hook(lambda m, a, out: alive_at_end.append(_alive(projections))))
        return handles, lambda: (_alive(intermediates), len(intermediates), alive_at_end)

    loss, grads, (kept, made, alive_at_end) = _watched_step(model, ids, rebuild, checkpointing, watch)
    return loss, grads, kept, made, alive_at_end


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_mlp_rebuilds_its_elementwise_outputs_bit_for_bit(tokenizer, checkpointing):
    from peft import LoraConfig, get_peft_model

    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2).to(torch.float64)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    assert fuse_layers(model) == 2 * 2 + 2 + 1
    ids = torch.randint(3, len(tokenizer), (2, 11), generator=torch.Generator().manual_seed(5))
    loss, grads, kept, made, alive = _lora_mlp_step(model, ids, rebuild=False, checkpointing=checkpointing)
    loss_r, grads_r, kept_r, made_r, alive_r = _lora_mlp_step(model, ids, rebuild=True, checkpointing=checkpointing)
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys() and all(torch.equal(grads[n], grads_r[n]) for n in grads)
    assert any("lora_A" in n and "mlp" in n for n in grads)
    if not checkpointing:
        assert made == made_r == 2 * 2  # silu(gate) and silu(gate) * up, per layer
        assert kept == 4 and kept_r == 0  # kept for the backward by the product and LoRA's down_proj, or not at all
        assert alive == alive_r == [2 * 2]  # gate and up: kept for the backward either way
    else:  # checkpointing frees each layer's gate and up after its forward; the recipes must not keep them
        assert kept == kept_r == 0 and alive == alive_r == [0]


def test_rebuilding_from_a_tensor_modified_in_place_raises():
    from posttrain.models.fused_layers import _remember

    gate = torch.randn(3, 4, requires_grad=True)
    with rebuilt_activations():
        pre = gate * 1.0
        activated = _remember(torch.sigmoid(pre), torch.sigmoid, pre)
        loss = (activated * gate).sum()  # mul keeps `activated`: as a recipe from `pre`
    pre.detach().add_(1.0)  # bypasses autograd's own check of `pre` (which sigmoid does not keep)
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        loss.backward()
