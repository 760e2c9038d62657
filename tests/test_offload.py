"""Layer checkpointing with inputs on GPU / host / rebuilt, cached attention outputs, the tiled loss
inside a model: each equals the plain computation (loss and every gradient, float64 on the CPU)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ringfa4
from ringfa4.memory import OffloadPlan, plan_offload

transformers = pytest.importorskip("transformers")
import ringfa4.hf as rhf  # noqa: E402

GIB = 2**30


def test_plan_offload_places_last_layers_on_gpu_then_host_then_groups():
    assert plan_offload(4, GIB, None, None).places == ("gpu",) * 4
    p = plan_offload(6, GIB, 2 * GIB, 10 * GIB)
    assert p.places == ("host",) * 4 + ("gpu",) * 2 and p.group == 1
    p = plan_offload(8, GIB, 3 * GIB, 2 * GIB)  # 5 inputs at most: k=2 keeps 4 heads, 1 rebuilt at a time
    assert p.group == 2
    assert p.places == ("host", "rebuild", "host", "rebuild", "gpu", "rebuild", "gpu", "rebuild")
    assert plan_offload(8, GIB, 5 * GIB, 0, group=2).places == ("gpu", "rebuild") * 4
    with pytest.raises(ValueError, match="do not fit"):
        plan_offload(8, GIB, 0.5 * GIB, 0)
    with pytest.raises(ValueError, match="group=2"):
        plan_offload(8, GIB, 2 * GIB, 0, group=2)


def _model(layers=4, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return LlamaForCausalLM(cfg).double().train()


def _loss_and_grads(model, ids, meta):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False, **({} if meta is None else {rhf.NAME: meta})).logits
    loss = F.cross_entropy(logits[0, :-1], ids[0, 1:])  # float64 (transformers' own loss is float32)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("plan,cache", [
    (OffloadPlan(("gpu",) * 4), False),
    (OffloadPlan(("host", "host", "gpu", "gpu")), True),
    (OffloadPlan(("host", "rebuild", "gpu", "rebuild"), group=2), False),
    (OffloadPlan(("gpu", "rebuild", "rebuild", "rebuild"), group=4), True),
])
@pytest.mark.parametrize("cp_kind", ["one", "ring", "hybrid"])
def test_layer_checkpointing_equals_plain(plan, cache, cp_kind):
    from ringfa4.memory import LayerCheckpointing

    cp = {"one": lambda: ringfa4.ContextParallel(backend="reference"),
          "ring": lambda: ringfa4.ContextParallel.simulated(2, backend="reference"),
          "hybrid": lambda: ringfa4.ContextParallel.simulated(4, backend="reference", ulysses=2)}[cp_kind]()
    rhf.register(cp)
    ref = _model()
    ref.set_attn_implementation(rhf.NAME)
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(1))
    want_loss, want = _loss_and_grads(ref, ids, None)
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt = LayerCheckpointing(model.model.layers, plan=plan, cache=cache).install()
    for _ in range(2):  # a second step reuses the pinned pool and the plan
        loss, grads = _loss_and_grads(model, ids, None)
        assert torch.equal(loss, want_loss)
        assert grads.keys() == want.keys()
        for n in want:
            torch.testing.assert_close(grads[n], want[n], rtol=1e-12, atol=1e-14, msg=n)
    rebuilt = plan.places.count("rebuild")
    assert ckpt.rebuilds == 2 * rebuilt
    if cache:  # every recompute (and every rebuild) reused the forward's attention outputs
        calls = 2 if cp_kind == "hybrid" else 1  # simulated Ulysses: one ring call per head group
        assert ckpt.cache.hits == 2 * calls * (4 + rebuilt) and not ckpt.cache.slots
    assert ckpt.peak_host_bytes == plan.places.count("host") * 32 * 32 * 8


def test_attention_cache_skips_the_recompute_forward(monkeypatch):
    from ringfa4.kernels import reference

    calls = {"n": 0}
    real = reference.ReferenceBackend.forward

    def counting(self, *a, **k):
        calls["n"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(reference.ReferenceBackend, "forward", counting)
    rhf.register(ringfa4.ContextParallel(backend="reference"))
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(2))
    counts = []
    for cache in (False, True):
        model = _model(layers=3)
        model.set_attn_implementation(rhf.NAME)
        rhf.enable_long_context(model, mlp_tile=None, cache_attention=cache, lean_norms=False)
        calls["n"] = 0
        _loss_and_grads(model, ids, None)
        counts.append(calls["n"])
    assert counts == [6, 3]


def test_enable_long_context_budgets_and_tiled_loss_module():
    rhf.register(ringfa4.ContextParallel(backend="reference"))
    ref = _model()
    ref.set_attn_implementation(rhf.NAME)
    S = 24
    ids = torch.randint(0, 64, (1, S), generator=torch.Generator().manual_seed(3))
    want_loss, want = _loss_and_grads(ref, ids, None)
    model = copy.deepcopy(ref)
    layer_bytes = S * 32 * 8
    rhf.enable_long_context(model, rhf.LongContext(mlp_tile=5, gpu_budget_gib=2.5 * layer_bytes / GIB,
                                                   host_budget_gib=1.0 * layer_bytes / GIB, cache_attention=True,
                                                   lean_norms=False, fold_mlp_norm=False))
    train = rhf.TiledLossLM(model, chunk=7)
    shard = rhf.shard_batch({"input_ids": ids}, ringfa4.ContextParallel(backend="reference"))
    loss = train(shard)
    loss.backward()
    ckpt = model.ringfa4_checkpointing
    assert ckpt.plan.group == 2 and "rebuild" in ckpt.plan.places, ckpt.describe()
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-12, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-13, msg=n)
    lean = copy.deepcopy(ref)  # lean norms too: transformers' norm is fp32 math, so fp32-level agreement
    rhf.enable_long_context(lean, rhf.LongContext(mlp_tile=5, cache_attention=True))
    loss = rhf.TiledLossLM(lean, chunk=7)(shard)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-7, atol=0)
    for n, p in lean.named_parameters():
        assert (p.grad - want[n]).norm() <= 1e-6 * want[n].norm(), n
    with pytest.raises(ValueError, match="unknown long-context options"):
        rhf.enable_long_context(model, offload=True)
    small = rhf.enable_long_context(_model(), gpu_budget_gib=0.1 * layer_bytes / GIB, host_budget_gib=0)
    with pytest.raises(ValueError, match="do not fit"):
        _loss_and_grads(small, ids, None)


@pytest.mark.gpu
def test_host_offload_same_gradients_less_gpu_memory():
    """A 4-layer Llama (hidden 1024) at 16k tokens on the GPU: host-held inputs give the same
    gradients as GPU-held ones, and the forward leaves 4 layer inputs less on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rhf.register(ringfa4.ContextParallel(backend="auto"))
    cfg = LlamaConfig(vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, use_cache=False)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    base.set_attn_implementation(rhf.NAME)
    ids = torch.randint(0, 1000, (1, 16384), device="cuda")
    results = {}
    for name, budget in (("gpu", None), ("host", 0.0)):
        model = copy.deepcopy(base)
        rhf.enable_long_context(model, mlp_tile=4096, gpu_budget_gib=budget, host_budget_gib=None)
        train = rhf.TiledLossLM(model, chunk=4096)
        shard = rhf.shard_batch({"input_ids": ids}, ringfa4.ContextParallel(backend="auto"))
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        loss = train(shard)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - start  # what the forward leaves for backward
        loss.backward()
        torch.cuda.synchronize()
        results[name] = (held, model.ringfa4_checkpointing.peak_host_bytes,
                         {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
        del model, train, loss
    (held_gpu, host_gpu, g_gpu), (held_host, host_host, g_host) = results["gpu"], results["host"]
    layer = 16384 * 1024 * 2
    assert host_gpu == 0 and host_host == 4 * layer, (host_gpu, host_host)
    assert held_host <= held_gpu - 3.5 * layer, (held_gpu / 2**20, held_host / 2**20)
    for n in g_gpu:  # same kernels (FA4's dq uses atomics: equal up to summation order)
        diff = (g_gpu[n] - g_host[n]).norm() / g_gpu[n].norm().clamp_min(1e-30)
        assert diff < 1e-2, (n, diff.item())


def test_unpack_hooks_are_idempotent():
    """torch may unpack one saved input more than once (seen on the H200 with torch 2.11 for a group
    head): every placement's unpack returns the same tensor again, and a group rebuild runs once."""
    from ringfa4.memory import LayerCheckpointing

    calls = []

    def layer_fn(x):
        calls.append(1)
        return x * 2

    layers = [torch.nn.Identity() for _ in range(3)]
    ckpt = LayerCheckpointing(layers, plan=OffloadPlan(("host", "rebuild", "rebuild"), group=3))
    x = torch.randn(4, 5)
    ckpt._fns = {0: layer_fn, 1: layer_fn, 2: layer_fn}
    head_pack, head_unpack = ckpt._head_hooks(0, "host")
    held = head_pack(x)
    packs = {i: ckpt._rebuild_hooks(i, 0) for i in (1, 2)}
    saved = {i: packs[i][0](x) for i in (1, 2)}
    a = packs[2][1](saved[2])
    assert torch.equal(a, x * 4) and len(calls) == 2  # inputs of layers 1 and 2 rebuilt once
    assert packs[2][1](saved[2]) is a and len(calls) == 2
    b = packs[1][1](saved[1])
    assert torch.equal(b, x * 2) and packs[1][1](saved[1]) is b and len(calls) == 2
    h = head_unpack(held)
    assert torch.equal(h, x) and head_unpack(held) is h
    host_pack, host_unpack = ckpt._host_hooks(0)
    held = host_pack(x)
    first = host_unpack(held)
    assert torch.equal(first, x) and host_unpack(held) is first


def test_attention_cache_with_packed_documents():
    """Packed documents (ring and all-gather modes): cached outputs give the plain gradients."""
    from ringfa4.memory import LayerCheckpointing

    for mode in ("ring", "allgather"):
        cp = ringfa4.ContextParallel.simulated(2, backend="reference")
        rhf.register(cp)
        ref = _model(layers=2)
        ref.set_attn_implementation(rhf.NAME)
        pos = torch.tensor([list(range(13)) + list(range(11)) + list(range(8))])
        ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(4))
        meta = rhf.CPMeta(cp, cp.pack_from_position_ids(pos[0], mode))

        def run(model, ids=ids, pos=pos, meta=meta):
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=ids, position_ids=pos, use_cache=False, **{rhf.NAME: meta}).logits
            loss = F.cross_entropy(logits[0, :-1], ids[0, 1:])
            loss.backward()
            return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

        want_loss, want = run(ref)
        model = copy.deepcopy(ref)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ckpt = LayerCheckpointing(model.model.layers, plan=OffloadPlan(("host", "gpu")), cache=True).install()
        loss, grads = run(model)
        assert torch.equal(loss, want_loss) and ckpt.cache.hits == 2, mode
        for n in want:
            torch.testing.assert_close(grads[n], want[n], rtol=1e-12, atol=1e-14, msg=n)


class _Torch211Inputs(torch.autograd.Function):
    """torch <= 2.11's checkpoint saved its inputs with a 0-element dummy in front (the H200 runs
    2.11); this reproduces that saving so the CPU (torch 2.13) sees what the hooks saw there."""

    @staticmethod
    def forward(*args):
        return torch.empty((0,))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.idx = [i for i, o in enumerate(inputs) if isinstance(o, torch.Tensor)]
        ctx.args = [None if isinstance(o, torch.Tensor) else o for o in inputs]
        ctx.save_for_backward(*[inputs[i] for i in ctx.idx])

    @staticmethod
    def backward(ctx, *grads):
        raise AssertionError


def test_torch211_dummy_input_and_host_inputs_released(monkeypatch):
    """With 2.11's dummy saved next to the layer input, each group is rebuilt once (not once per
    saved tensor), and no input copied back from the host stays referenced by the checkpointer."""
    from torch.utils import checkpoint as C

    from ringfa4.memory import LayerCheckpointing

    def save_inputs(self, *args):
        self.input_saver = _Torch211Inputs.apply(torch.empty((0,), requires_grad=True), *args)

    def get_inputs(self):
        ctx = self.input_saver.grad_fn
        ret = list(ctx.args)
        for j, i in enumerate(ctx.idx):
            ret[i] = ctx.saved_tensors[j]
        return ret[1:]

    monkeypatch.setattr(C._CheckpointFrame, "save_inputs", save_inputs)
    monkeypatch.setattr(C._CheckpointFrame, "get_inputs", get_inputs)
    rhf.register(ringfa4.ContextParallel(backend="reference"))
    ref = _model(layers=8)
    ref.set_attn_implementation(rhf.NAME)
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(5))
    want_loss, want = _loss_and_grads(ref, ids, None)
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plan = OffloadPlan(("host", "rebuild", "host", "rebuild", "host", "rebuild", "gpu", "rebuild"), group=2)
    ckpt = LayerCheckpointing(model.model.layers, plan=plan).install()
    taken = []
    real_take = ckpt._take

    def take(held):
        x = real_take(held)
        taken.append(sum(1 for _, h in ckpt._host if h.gpu is not None))
        return x

    ckpt._take = take
    loss, grads = _loss_and_grads(model, ids, None)
    assert torch.equal(loss, want_loss)
    for n in want:
        torch.testing.assert_close(grads[n], want[n], rtol=1e-12, atol=1e-14, msg=n)
    assert ckpt.rebuilds == 4  # one rebuilt input per group of two
    assert taken and max(taken) == 0, taken  # every copied-back input is held by autograd alone
    assert not ckpt._heads and not ckpt._fns


@pytest.mark.parametrize("plan", [OffloadPlan(("host",) * 4),
                                  OffloadPlan(("host", "rebuild", "gpu", "rebuild"), group=2)])
def test_forward_frees_inputs_not_kept_on_the_gpu(plan):
    """After the forward only the inputs placed on the GPU (and group heads placed there) are still
    alive: host-held and rebuilt inputs are not pinned by the hooks (they once were, through the
    pack hook's closure, which autograd keeps as long as the saved tensor)."""
    import gc
    import weakref

    from ringfa4.memory import LayerCheckpointing

    rhf.register(ringfa4.ContextParallel(backend="reference"))
    model = _model(layers=4)
    model.set_attn_implementation(rhf.NAME)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    LayerCheckpointing(model.model.layers, plan=plan).install()
    inputs = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(
            lambda mod, a, kw: inputs.append(weakref.ref(a[0] if a else kw["hidden_states"])), with_kwargs=True)
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    gc.collect()
    alive = [ref() is not None for ref in inputs]
    assert alive == [p == "gpu" for p in plan.places], (alive, plan.places)
    loss.backward()
